//! Criterion benchmark of the router's KV-event path, without sockets, on one core: 8 vLLM
//! engines under heavy churn (see `kv_workload`), their batches encoded with the project's
//! vLLM 0.22 / 0.33 encoders.
//!
//! - `decode_translate/v0.22|v0.33|mixed`: the subscriber side, per message:
//!   `decode_live` + `KvFeed::apply` of every event (engine hash -> router chain hash).
//! - `decode_only/...` and `translate_only/mixed`: the two halves of `decode_translate`.
//! - `control_fanout/mixed`: the control core, per `FeedEvent::Updates`: one
//!   `WriteOp::Mirror` in one shared `Arc<[WriteOp]>`, sent to 8 data-core queues (crossbeam
//!   channels standing in for the glommio mesh).
//! - `replica_apply/mixed`: one data core: `Shard::apply` of every batch to a replica already
//!   holding the 8 engines' steady state (256k blocks).
//! - `control_core_path/v0.22|v0.33|mixed`: all of the control-core side in sequence on one
//!   thread: decode + translate, the `FeedEvent` through a crossbeam channel (subscriber ->
//!   control core), wrap + fan-out. The headline figure (block events per second).
//!
//! Throughput is in block events: blocks stored plus blocks removed. Every iteration replays
//! the whole measured stream from the warm state (setup, cloning and drops are not timed).
//! Group `kv_feed` measures the benchmark thread's CPU time (`Melem/cpu-s`: per second of CPU
//! the thread got, so neighbours on a shared machine do not count; see
//! `kv_workload/cpu_time.rs`); group `kv_feed_wall` repeats `control_core_path/mixed` in wall
//! time.
//!
//! `cargo bench -p myelin-server --bench kv_feed`

mod kv_workload;

/// The `myelin` binary's allocator, so the figures are the router's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::Duration;

use criterion::measurement::Measurement;
use criterion::{BatchSize, BenchmarkGroup, Criterion, Throughput};
use kv_workload::cpu_time::ThreadCpuTime;
use kv_workload::{
    ENGINES, Message, Workload, WriteBatch, control_side, data_core_queues, replica_side,
    subscriber_side,
};
use myelin_kv_events::{DecodedEvent, WireVersion, decode_live};
use myelin_routing::{MirrorChange, WriteOp};
use myelin_server::kv_subscriber::FeedEvent;

/// Measured batches per engine (about 190k block events in all).
const STEPS: usize = 400;

fn mixed(engine: usize) -> WireVersion {
    if engine < ENGINES / 2 {
        WireVersion::V0_22
    } else {
        WireVersion::V0_33
    }
}

/// Which layout engine `e` publishes in.
type Layout = fn(usize) -> WireVersion;

fn layouts() -> [(&'static str, Layout); 3] {
    [
        ("v0.22", |_| WireVersion::V0_22),
        ("v0.33", |_| WireVersion::V0_33),
        ("mixed", mixed as Layout),
    ]
}

fn describe(name: &str, workload: &Workload, messages: &[Message]) {
    let bytes: usize = messages.iter().map(|message| message.frames[2].len()).sum();
    eprintln!(
        "kv_feed {name}: {} messages, {} block events ({:.1} per message), {:.0} payload bytes per message",
        messages.len(),
        workload.block_events,
        workload.block_events as f64 / messages.len() as f64,
        bytes as f64 / messages.len() as f64,
    );
}

/// The subscriber side's output for the whole stream, from the warm state.
fn updates_of(
    workload: &Workload,
    messages: &[Message],
) -> Vec<(myelin_routing::BackendId, Vec<MirrorChange>)> {
    let mut feeds = workload.warm_feeds.clone();
    messages
        .iter()
        .filter_map(|message| match subscriber_side(&mut feeds, message) {
            Some(FeedEvent::Updates { backend, updates }) => Some((backend, updates)),
            _ => None,
        })
        .collect()
}

/// The whole control-core side on one thread: decode + translate, the `FeedEvent` through a
/// crossbeam channel (subscriber -> control core), wrap + fan-out.
fn control_core_path<M: Measurement>(
    group: &mut BenchmarkGroup<'_, M>,
    name: &str,
    workload: &Workload,
    messages: &[Message],
) {
    group.bench_function(format!("control_core_path/{name}"), |bencher| {
        bencher.iter_batched(
            || {
                let (senders, receivers) = data_core_queues();
                (workload.warm_feeds.clone(), senders, receivers)
            },
            |(mut feeds, senders, receivers)| {
                // The subscriber -> control core hop (bounded, as `KV_FEED_QUEUE`).
                let (feed_sender, feed_receiver) = crossbeam_channel::bounded(16 * 1024);
                for message in messages {
                    if let Some(event) = subscriber_side(&mut feeds, message) {
                        let _ = feed_sender.send(event);
                    }
                    for event in feed_receiver.try_iter() {
                        control_side(event, &senders);
                    }
                }
                (feeds, senders, receivers)
            },
            BatchSize::PerIteration,
        )
    });
}

/// Every bench (`all`), or only the control-core path.
fn benches<M: Measurement>(
    criterion: &mut Criterion<M>,
    name: &str,
    workload: &Workload,
    all: bool,
) {
    let elements = Throughput::Elements(workload.block_events);
    let mut group = criterion.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(elements);

    for (name, layout) in layouts() {
        let messages = workload.messages(layout);
        if !all {
            if name == "mixed" {
                control_core_path(&mut group, name, workload, &messages);
            }
            continue;
        }
        describe(name, workload, &messages);
        group.bench_function(format!("decode_translate/{name}"), |bencher| {
            bencher.iter_batched(
                || workload.warm_feeds.clone(),
                |mut feeds| {
                    let events: Vec<Option<FeedEvent>> = messages
                        .iter()
                        .map(|message| subscriber_side(&mut feeds, message))
                        .collect();
                    (feeds, events)
                },
                BatchSize::PerIteration,
            )
        });
        group.bench_function(format!("decode_only/{name}"), |bencher| {
            bencher.iter_batched(
                || (),
                |()| {
                    messages
                        .iter()
                        .map(|message| decode_live(&message.frames).expect("decodes"))
                        .collect::<Vec<_>>()
                },
                BatchSize::PerIteration,
            )
        });
        control_core_path(&mut group, name, workload, &messages);
    }
    if !all {
        group.finish();
        return;
    }

    let messages = workload.messages(mixed);
    let updates = updates_of(workload, &messages);
    group.bench_function("control_fanout/mixed", |bencher| {
        bencher.iter_batched(
            || {
                let events: Vec<FeedEvent> = updates
                    .iter()
                    .map(|(backend, updates)| FeedEvent::Updates {
                        backend: *backend,
                        updates: updates.clone(),
                    })
                    .collect();
                (events, data_core_queues())
            },
            |(events, (senders, receivers))| {
                for event in events {
                    control_side(event, &senders);
                }
                (senders, receivers)
            },
            BatchSize::PerIteration,
        )
    });

    let decoded: Vec<(u32, Vec<DecodedEvent>)> = messages
        .iter()
        .map(|message| {
            let live = decode_live(&message.frames).expect("decodes");
            (message.engine, live.batch.events)
        })
        .collect();
    group.bench_function("translate_only/mixed", |bencher| {
        bencher.iter_batched(
            || workload.warm_feeds.clone(),
            |mut feeds| {
                let out: Vec<Vec<MirrorChange>> = decoded
                    .iter()
                    .map(|(engine, events)| {
                        let mut updates = Vec::new();
                        for event in events {
                            feeds[*engine as usize].apply(event, &mut updates);
                        }
                        updates
                    })
                    .collect();
                (feeds, out)
            },
            BatchSize::PerIteration,
        )
    });

    let batches: Vec<WriteBatch> = updates
        .iter()
        .map(|(backend, updates)| {
            std::sync::Arc::from(vec![WriteOp::Mirror {
                backend: *backend,
                changes: updates.as_slice().into(),
            }])
        })
        .collect();
    group.bench_function("replica_apply/mixed", |bencher| {
        bencher.iter_batched(
            || workload.warm_shard(),
            |mut shard| {
                for batch in &batches {
                    replica_side(&mut shard, batch);
                }
                shard
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

fn main() {
    let workload = Workload::generate(STEPS, 42);
    // CPU time of the benchmark thread for every bench (robust to neighbours on a shared
    // machine), then wall time for the headline.
    let mut cpu = Criterion::default()
        .with_measurement(ThreadCpuTime)
        .configure_from_args();
    benches(&mut cpu, "kv_feed", &workload, true);
    let mut wall = Criterion::default().configure_from_args();
    benches(&mut wall, "kv_feed_wall", &workload, false);
    Criterion::default().configure_from_args().final_summary();
}
