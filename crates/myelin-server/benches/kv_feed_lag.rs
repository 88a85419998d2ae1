//! Event-to-routable lag of the KV-event path: how long after the subscriber side receives a
//! batch its changes are in a data core's replica, at half the control-core throughput this
//! machine sustains.
//!
//! 1. Calibration: the control-core path (decode + translate + channel hop + wrap + fan-out to
//!    8 queues, as in the `kv_feed` bench) over the whole stream on this thread, 3 times; the
//!    median rate in block events per second of the thread's CPU time (what one core does,
//!    whatever the neighbours take; wall time is printed too) is "the measured rate".
//! 2. Runs at half that rate (`MYELIN_KV_LAG_RATE=<block events/s>` overrides), 3 repeats per
//!    consumer mode. A producer thread stands in for the 8 subscriber threads: it paces the
//!    8 engines' interleaved messages (sleeping until each one's due time, as a subscriber
//!    blocks in its socket), stamps each when it
//!    takes it ("received by the subscriber side", before decoding), decodes and translates it
//!    (`decode_live` + `KvFeed::apply`) and sends the `FeedEvent` through a real bounded
//!    crossbeam channel (as `KV_FEED_QUEUE`). A consumer thread plays the control core and one
//!    data core: wraps the updates in a shared `Arc<[WriteOp]>`, sends it to 8 data-core queues
//!    (crossbeam channels standing in for the glommio mesh; the 7 other queues are drained and
//!    dropped), applies it to its warm `Shard` replica (`Shard::apply`), and records the lag
//!    to that moment in an HDR histogram.
//!    - `wake`: the consumer blocks on the channel and runs as soon as a batch arrives.
//!    - `tick2000us`: the consumer wakes every 2 ms and drains up to 4096 batches, as
//!      `control::feed_loop` does today (`KV_FEED_INTERVAL`).
//!    - `tick250us`: the same with a 250 us tick.
//!
//!    `MYELIN_KV_LAG_CPUS=P,C` pins the producer to CPU P and the consumer to CPU C;
//!    `MYELIN_KV_LAG_FIFO=1` runs both under `SCHED_FIFO`, as if on a dedicated core. Each row
//!    shows the 1-minute load average when the run started.
//!
//! `cargo bench -p myelin-server --bench kv_feed_lag`

mod kv_workload;

/// The `myelin` binary's allocator, so the figures are the router's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use hdrhistogram::Histogram;
use kv_workload::cpu_time::thread_cpu_nanos;
use kv_workload::{
    ENGINES, Message, Workload, WriteBatch, control_side, data_core_queues, replica_side,
    subscriber_side,
};
use myelin_kv_events::WireVersion;
use myelin_routing::Shard;
use myelin_server::kv_subscriber::FeedEvent;

/// Measured batches per engine (about 1.2 million block events in all).
const STEPS: usize = 2_500;
const REPEATS: usize = 3;
/// As `control::KV_FEED_QUEUE`.
const FEED_QUEUE: usize = 16 * 1024;
/// As `control::KV_FEED_INTERVAL` and the per-tick bound of `control::feed_loop`.
const TICK: Duration = Duration::from_millis(2);
/// A shorter tick, for comparison.
const SHORT_TICK: Duration = Duration::from_micros(250);
const TICK_BATCHES: usize = 4096;

fn mixed(engine: usize) -> WireVersion {
    if engine < ENGINES / 2 {
        WireVersion::V0_22
    } else {
        WireVersion::V0_33
    }
}

/// Block events per second of the whole control-core path on this thread: per second of wall
/// time, and per second of the thread's CPU time.
fn calibrate(workload: &Workload, messages: &[Message]) -> (f64, f64) {
    let mut feeds = workload.warm_feeds.clone();
    let (senders, receivers) = data_core_queues();
    let (feed_sender, feed_receiver) = crossbeam_channel::bounded(FEED_QUEUE);
    let start = Instant::now();
    let cpu_start = thread_cpu_nanos();
    for message in messages {
        if let Some(event) = subscriber_side(&mut feeds, message) {
            let _ = feed_sender.send(event);
        }
        for event in feed_receiver.try_iter() {
            control_side(event, &senders);
        }
    }
    let cpu = thread_cpu_nanos() - cpu_start;
    let elapsed = start.elapsed();
    drop((feeds, senders, receivers));
    let events = workload.block_events as f64;
    (events / elapsed.as_secs_f64(), events * 1e9 / cpu as f64)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Consumer {
    /// Blocks on the channel: runs as soon as a batch arrives.
    Wake,
    /// Wakes every `Duration` and drains what is queued (as `control::feed_loop`).
    Tick(Duration),
}

impl Consumer {
    fn name(self) -> String {
        match self {
            Consumer::Wake => "wake".into(),
            Consumer::Tick(tick) => format!("tick{}us", tick.as_micros()),
        }
    }
}

/// `MYELIN_KV_LAG_CPUS=P,C`: pin the producer to CPU P and the consumer to CPU C (the same
/// CPU for both is the production layout: subscribers are pinned to the control core).
fn pinning() -> Option<(usize, usize)> {
    let value = std::env::var("MYELIN_KV_LAG_CPUS").ok()?;
    let (producer, consumer) = value.split_once(',')?;
    Some((producer.trim().parse().ok()?, consumer.trim().parse().ok()?))
}

fn pin_to(cpu: usize) {
    // SAFETY: sched_setaffinity(2) on the calling thread with a zeroed, then filled, set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// `MYELIN_KV_LAG_FIFO=1`: run the producer and the consumer under `SCHED_FIFO` (priority 1),
/// so that on a shared machine they preempt the neighbours' threads as soon as they are
/// runnable, like threads on a dedicated core (needs CAP_SYS_NICE; the kernel's real-time
/// throttling still leaves the others 5%).
fn fifo() -> bool {
    std::env::var("MYELIN_KV_LAG_FIFO").is_ok_and(|value| value == "1")
}

fn make_fifo() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler(2) on the calling thread with a valid parameter block.
    let result = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    assert_eq!(
        result, 0,
        "SCHED_FIFO refused (MYELIN_KV_LAG_FIFO=1 needs CAP_SYS_NICE)"
    );
}

/// The 1-minute load average, to say how busy the machine was.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

struct Run {
    lag: Histogram<u64>,
    achieved_rate: f64,
}

/// What the consumer does with one received event: control core, then one data core.
struct ControlAndReplica {
    shard: Shard,
    senders: Vec<Sender<WriteBatch>>,
    receivers: Vec<Receiver<WriteBatch>>,
    lag: Histogram<u64>,
}

impl ControlAndReplica {
    fn handle(&mut self, received: Instant, event: FeedEvent) {
        control_side(event, &self.senders);
        for batch in self.receivers[0].try_iter() {
            replica_side(&mut self.shard, &batch);
        }
        let lag = received.elapsed().as_nanos() as u64;
        self.lag.saturating_record(lag);
        for other in &self.receivers[1..] {
            other.try_iter().for_each(drop);
        }
    }
}

fn run(workload: &Workload, messages: &[Message], rate: f64, consumer: Consumer) -> Run {
    let (senders, receivers) = data_core_queues();
    let mut sink = ControlAndReplica {
        shard: workload.warm_shard(),
        senders,
        receivers,
        lag: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram"),
    };
    let mut feeds = workload.warm_feeds.clone();
    let (feed_sender, feed_receiver) =
        crossbeam_channel::bounded::<(Instant, FeedEvent)>(FEED_QUEUE);
    std::thread::scope(|scope| {
        let consumer_thread = scope.spawn(move || {
            if let Some((_, cpu)) = pinning() {
                pin_to(cpu);
            }
            if fifo() {
                make_fifo();
            }
            // Ticks end on time, as glommio's io_uring timers do.
            // SAFETY: prctl(2) on this thread's own timer slack.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
            }
            match consumer {
                Consumer::Wake => {
                    for (received, event) in feed_receiver.iter() {
                        sink.handle(received, event);
                    }
                }
                Consumer::Tick(tick) => loop {
                    std::thread::sleep(tick);
                    let mut drained = 0;
                    for (received, event) in feed_receiver.try_iter().take(TICK_BATCHES) {
                        sink.handle(received, event);
                        drained += 1;
                    }
                    if drained == 0 {
                        match feed_receiver.try_recv() {
                            Ok((received, event)) => sink.handle(received, event),
                            Err(crossbeam_channel::TryRecvError::Empty) => {}
                            Err(crossbeam_channel::TryRecvError::Disconnected) => break,
                        }
                    }
                },
            }
            sink.lag
        });
        // Sleep to each message's due time, as a subscriber blocked in its socket: spinning
        // would take a core from the consumer on a small machine. Timer slack 1 ns so the
        // sleeps end on time (the default 50 us would bunch messages).
        // SAFETY: prctl(2) on this thread's own timer slack.
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
        }
        if let Some((cpu, _)) = pinning() {
            pin_to(cpu);
        }
        if fifo() {
            make_fifo();
        }
        let start = Instant::now();
        let mut due = start;
        for message in messages {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let received = Instant::now();
            if let Some(event) = subscriber_side(&mut feeds, message) {
                let _ = feed_sender.send((received, event));
            }
            due += Duration::from_secs_f64(message.block_events as f64 / rate);
        }
        let elapsed = start.elapsed();
        drop(feed_sender);
        let lag = consumer_thread.join().expect("consumer");
        Run {
            lag,
            achieved_rate: workload.block_events as f64 / elapsed.as_secs_f64(),
        }
    })
}

fn micros(nanos: u64) -> f64 {
    nanos as f64 / 1_000.0
}

fn main() {
    let started = Instant::now();
    let workload = Workload::generate(STEPS, 7);
    let messages = workload.messages(mixed);
    eprintln!(
        "kv_feed_lag: {} messages of 8 engines (4 vLLM 0.22, 4 vLLM 0.33), {} block events, generated in {:.1?}",
        messages.len(),
        workload.block_events,
        started.elapsed()
    );
    let mut rates: Vec<f64> = (0..REPEATS)
        .map(|repeat| {
            let (wall, cpu) = calibrate(&workload, &messages);
            println!(
                "calibration {}: control-core path {:.2} M block events/s wall, {:.2} M per cpu-s (load {})",
                repeat + 1,
                wall / 1e6,
                cpu / 1e6,
                load_average(),
            );
            cpu
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    let measured = rates[REPEATS / 2];
    let rate = std::env::var("MYELIN_KV_LAG_RATE")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(measured / 2.0);
    println!(
        "offered rate {:.2} M block events/s (half the median {:.2} M per cpu-s unless MYELIN_KV_LAG_RATE); producer and consumer {}{}",
        rate / 1e6,
        measured / 1e6,
        if fifo() { "SCHED_FIFO" } else { "SCHED_OTHER" },
        pinning().map_or(String::new(), |(producer, consumer)| format!(
            ", pinned to CPUs {producer} and {consumer}"
        )),
    );
    println!(
        "{:<10} {:>6} {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "consumer",
        "repeat",
        "load",
        "achieved",
        "p50 us",
        "p90 us",
        "p99 us",
        "p99.9 us",
        "max us",
        "batches"
    );
    for consumer in [
        Consumer::Wake,
        Consumer::Tick(TICK),
        Consumer::Tick(SHORT_TICK),
    ] {
        for repeat in 0..REPEATS {
            let load = load_average();
            let result = run(&workload, &messages, rate, consumer);
            let lag = &result.lag;
            println!(
                "{:<10} {:>6} {:>6} {:>8.2} M {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8}",
                consumer.name(),
                repeat + 1,
                load,
                result.achieved_rate / 1e6,
                micros(lag.value_at_quantile(0.50)),
                micros(lag.value_at_quantile(0.90)),
                micros(lag.value_at_quantile(0.99)),
                micros(lag.value_at_quantile(0.999)),
                micros(lag.max()),
                lag.len(),
            );
        }
    }
}
