//! Evictions on external engines, counted from the engines' own KV-event streams.
//!
//! vLLM exports no eviction counter, but it publishes every evicted block: a cached block's
//! hash is dropped only when its memory is taken for another block, and that is its
//! `BlockRemoved` (a `reset_prefix_cache` is an `AllBlocksCleared` instead, not counted). The
//! harness subscribes to each `kv-events=` endpoint once, before the first leg, and counts
//! the removed GPU blocks of the main attention group, live messages only (no replay: what
//! the engine buffered from before the run is not this run's), so a leg's evictions are the
//! difference of two readings, as on simulated engines. A sequence gap (the engine's PUB socket
//! dropped messages) makes the count a lower bound, said once on stderr; an undecodable message
//! is skipped and counted the same way.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use myelin_kv_events::decode::{MirrorFilter, decode_live};
use myelin_kv_events::wire::KvEvent;

/// How long one receive waits before the thread looks at its stop flag.
const RECEIVE_TIMEOUT: Duration = Duration::from_millis(200);

/// What one engine's stream has shown so far.
#[derive(Debug, Default)]
struct StreamCounts {
    removed_blocks: AtomicU64,
    /// Sequence gaps and undecodable messages: the count is a lower bound when non-zero.
    lost_messages: AtomicU64,
}

/// Subscriptions to the engines' KV-event streams, counting evicted blocks.
#[derive(Debug)]
pub struct EvictionWatch {
    streams: Vec<Arc<StreamCounts>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    warned: AtomicBool,
}

impl EvictionWatch {
    /// Subscribes to every endpoint (`tcp://` or `ipc://`, as vLLM's `endpoint`).
    pub fn start(endpoints: &[String]) -> Result<EvictionWatch, String> {
        let context = zmq::Context::new();
        let stop = Arc::new(AtomicBool::new(false));
        let mut streams = Vec::new();
        let mut threads = Vec::new();
        for endpoint in endpoints {
            let socket = context
                .socket(zmq::SUB)
                .and_then(|socket| {
                    socket.set_subscribe(b"")?;
                    socket.set_rcvtimeo(RECEIVE_TIMEOUT.as_millis() as i32)?;
                    socket.set_linger(0)?;
                    socket.connect(endpoint)?;
                    Ok(socket)
                })
                .map_err(|error| format!("subscribing to {endpoint}: {error}"))?;
            let counts = Arc::new(StreamCounts::default());
            streams.push(counts.clone());
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("myelin-bench-kv-watch".into())
                    .spawn(move || follow(socket, &counts, &stop))
                    .map_err(|error| format!("starting the KV-event watch: {error}"))?,
            );
        }
        Ok(EvictionWatch {
            streams,
            stop,
            threads,
            warned: AtomicBool::new(false),
        })
    }

    /// Blocks evicted on all the engines since the subscription.
    pub fn evictions(&self) -> u64 {
        let lost: u64 = self
            .streams
            .iter()
            .map(|counts| counts.lost_messages.load(Ordering::Relaxed))
            .sum();
        if lost > 0 && !self.warned.swap(true, Ordering::Relaxed) {
            eprintln!(
                "myelin bench: {lost} KV-event messages of the engines were lost or undecodable: \
                 the evictions counted from them are a lower bound"
            );
        }
        self.streams
            .iter()
            .map(|counts| counts.removed_blocks.load(Ordering::Relaxed))
            .sum()
    }
}

impl Drop for EvictionWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Receives one engine's live messages until `stop`, counting evicted blocks.
fn follow(socket: zmq::Socket, counts: &StreamCounts, stop: &AtomicBool) {
    let mut filter = MirrorFilter::default();
    let mut next_seq: Option<u64> = None;
    while !stop.load(Ordering::Relaxed) {
        let frames = match socket.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(_) => return,
        };
        let Ok(message) = decode_live(&frames) else {
            counts.lost_messages.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        // A restarted engine counts from 0 again: only a jump forward is a loss.
        if let Some(expected) = next_seq
            && message.seq > expected
        {
            counts
                .lost_messages
                .fetch_add(message.seq - expected, Ordering::Relaxed);
        }
        next_seq = Some(message.seq.saturating_add(1));
        let removed: usize = message
            .batch
            .events
            .iter()
            .filter(|event| filter.accepts(event))
            .map(|event| match &event.event {
                KvEvent::BlockRemoved(removed) => removed.block_hashes.len(),
                _ => 0,
            })
            .sum();
        counts
            .removed_blocks
            .fetch_add(removed as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use myelin_kv_events::wire::{
        AllBlocksCleared, BlockRemoved, EventBatch, WireVersion, encode_batch,
    };

    use super::*;

    fn removed(hashes: &[u64], medium: &str) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: Some(medium.into()),
            group_idx: None,
        })
    }

    fn publish(socket: &zmq::Socket, seq: u64, events: Vec<KvEvent>) {
        let payload = encode_batch(
            &EventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: None,
            },
            WireVersion::V0_33,
        );
        socket
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &payload[..]], 0)
            .unwrap();
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn counts_evicted_gpu_blocks_of_live_messages_and_says_what_was_lost() {
        let context = zmq::Context::new();
        let publisher = context.socket(zmq::PUB).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let watch = EvictionWatch::start(&[endpoint]).unwrap();
        // A SUB socket misses what is sent before it has joined: probe until one arrives.
        let mut seq = 0;
        wait_for("the subscription", || {
            publish(&publisher, seq, vec![removed(&[1], "GPU")]);
            seq += 1;
            std::thread::sleep(Duration::from_millis(20));
            watch.evictions() > 0
        });
        // Let the last probes land before taking the baseline.
        std::thread::sleep(Duration::from_millis(200));
        let stream = &watch.streams[0];
        let before = watch.evictions();
        let lost_before = stream.lost_messages.load(Ordering::Relaxed);
        publish(
            &publisher,
            seq,
            vec![
                removed(&[10, 11, 12], "GPU"),
                removed(&[20, 21, 22, 23, 24], "CPU"),
                KvEvent::AllBlocksCleared(AllBlocksCleared),
            ],
        );
        // Two sequence numbers skipped, then an undecodable payload.
        publish(&publisher, seq + 3, vec![removed(&[30], "GPU")]);
        publisher
            .send_multipart([&b""[..], &(seq + 4).to_be_bytes()[..], &b"\xc1"[..]], 0)
            .unwrap();
        wait_for("the batches", || watch.evictions() == before + 4);
        wait_for("the losses", || {
            stream.lost_messages.load(Ordering::Relaxed) == lost_before + 3
        });
        drop(watch);
    }
}
