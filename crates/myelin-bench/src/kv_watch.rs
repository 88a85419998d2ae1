//! The external engines' KV-event streams, followed by the harness: evictions, and the truth
//! the residency calibration scores the router against.
//!
//! vLLM exports no eviction counter, but it publishes every evicted block: a cached block's
//! hash is dropped only when its memory is taken for another block, and that is its
//! `BlockRemoved` (a `reset_prefix_cache` is an `AllBlocksCleared` instead, not counted). The
//! harness subscribes to each `kv-events=` endpoint once, before the first leg, live messages
//! only (no replay: what the engine buffered from before the run is not this run's), so a leg's
//! evictions are the difference of two readings, as on simulated engines.
//!
//! From the same events it keeps a mirror of each engine's GPU prefix cache, keyed by the
//! blocks' tokens (a chain hash of the parent's key and the block's token ids, so a prompt is
//! looked up without knowing the engine's hash function): [`KvWatch::probe`] gives, per engine,
//! the leading prompt tokens whose full blocks the engine holds, which is what the simulator's
//! oracle tells the calibration and the resident-prefix probe. The mirror is exact from the
//! engine's first cache reset on (the harness resets before every leg and clears the mirror at
//! once: vLLM publishes its `AllBlocksCleared` only with its next step); a block stored on top
//! of one the mirror never saw, a LoRA block or one of another block size is not mirrored.
//!
//! A sequence gap (the engine's PUB socket dropped messages) or an undecodable message makes
//! the counts a lower bound, said once on stderr.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use myelin_kv_events::decode::{MirrorFilter, decode_live};
use myelin_kv_events::wire::{BlockStored, KvEvent};

use crate::oracle::{CacheOracle, EngineTruth};

/// How long one receive waits before the thread looks at its stop flag.
const RECEIVE_TIMEOUT: Duration = Duration::from_millis(200);
/// Blocks mirrored per engine at most (4M blocks, 67M tokens at 16 a block: far beyond any one
/// engine's KV cache; about 200 MB of maps); stores beyond it are not mirrored.
const MAX_MIRRORED_BLOCKS: usize = 1 << 22;

/// One engine's GPU prefix cache as its events describe it.
#[derive(Debug, Default)]
struct Mirror {
    /// Engine block hash -> the block's key (the chain of token ids up to it).
    keys: HashMap<u64, u64>,
    /// Block key -> copies held (two requests computing one block at once hold two).
    copies: HashMap<u64, u32>,
}

impl Mirror {
    fn clear(&mut self) {
        self.keys.clear();
        self.copies.clear();
    }

    fn store(&mut self, stored: &BlockStored, block_size: u32) {
        let size = block_size as usize;
        if stored.block_size != block_size
            || stored.lora_id.is_some()
            || stored.lora_name.is_some()
            || stored.token_ids.len() != stored.block_hashes.len() * size
        {
            return;
        }
        let mut parent = match stored.parent_block_hash {
            None => ROOT_KEY,
            Some(hash) => match self.keys.get(&hash) {
                Some(key) => *key,
                None => return,
            },
        };
        for (hash, tokens) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks(size))
        {
            if self.keys.len() >= MAX_MIRRORED_BLOCKS {
                return;
            }
            let key = block_key(parent, tokens);
            self.keys.insert(*hash, key);
            *self.copies.entry(key).or_default() += 1;
            parent = key;
        }
    }

    fn remove(&mut self, hashes: &[u64]) {
        for hash in hashes {
            let Some(&key) = self.keys.get(hash) else {
                continue;
            };
            let copies = self.copies.entry(key).or_default();
            *copies = copies.saturating_sub(1);
            if *copies == 0 {
                self.copies.remove(&key);
                self.keys.remove(hash);
            }
        }
    }

    /// Leading tokens of `prompt` whose full blocks are held.
    fn cached_tokens(&self, prompt: &[u32], block_size: u32) -> u64 {
        let mut parent = ROOT_KEY;
        let mut blocks = 0;
        for tokens in prompt.chunks_exact(block_size as usize) {
            parent = block_key(parent, tokens);
            if !self.copies.contains_key(&parent) {
                break;
            }
            blocks += 1;
        }
        blocks * u64::from(block_size)
    }
}

/// The key of a chain's first block's parent.
const ROOT_KEY: u64 = 0x6d79_656c_696e_0000;

/// A block's key: its parent's key and its token ids (SipHash with fixed keys: the same in
/// every thread and run).
fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    hasher.finish()
}

/// What one engine's stream has shown so far.
#[derive(Debug, Default)]
struct Stream {
    removed_blocks: AtomicU64,
    /// Sequence gaps and undecodable messages: the counts are a lower bound when non-zero.
    lost_messages: AtomicU64,
    mirror: Mutex<Mirror>,
}

/// Subscriptions to the engines' KV-event streams.
#[derive(Debug)]
pub struct KvWatch {
    streams: Vec<Arc<Stream>>,
    block_size: u32,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    warned: AtomicBool,
}

impl KvWatch {
    /// Subscribes to every endpoint (`tcp://` or `ipc://`, as vLLM's `endpoint`), in engine
    /// order; the engines' blocks are `block_size` tokens.
    pub fn start(endpoints: &[String], block_size: u32) -> Result<KvWatch, String> {
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
            let stream = Arc::new(Stream::default());
            streams.push(stream.clone());
            let stop = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("myelin-bench-kv-watch".into())
                    .spawn(move || follow(socket, &stream, block_size, &stop))
                    .map_err(|error| format!("starting the KV-event watch: {error}"))?,
            );
        }
        Ok(KvWatch {
            streams,
            block_size,
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
            .map(|stream| stream.lost_messages.load(Ordering::Relaxed))
            .sum();
        if lost > 0 && !self.warned.swap(true, Ordering::Relaxed) {
            eprintln!(
                "myelin bench: {lost} KV-event messages of the engines were lost or undecodable: \
                 the evictions counted and the calibration's truth read from them are a lower bound"
            );
        }
        self.streams
            .iter()
            .map(|stream| stream.removed_blocks.load(Ordering::Relaxed))
            .sum()
    }

    /// Engine `engine`'s cache was just emptied (`POST /reset_prefix_cache` answered 2xx).
    pub fn cleared(&self, engine: usize) {
        if let Some(stream) = self.streams.get(engine) {
            lock(&stream.mirror).clear();
        }
    }
}

impl CacheOracle for KvWatch {
    /// What the engines' events say they hold; their queues are not known here.
    fn probe(&self, prompt_tokens: &[u32]) -> Vec<EngineTruth> {
        self.streams
            .iter()
            .map(|stream| EngineTruth {
                cached_tokens: lock(&stream.mirror).cached_tokens(prompt_tokens, self.block_size),
                ..EngineTruth::default()
            })
            .collect()
    }
}

fn lock(mirror: &Mutex<Mirror>) -> std::sync::MutexGuard<'_, Mirror> {
    mirror
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for KvWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Receives one engine's live messages until `stop`.
fn follow(socket: zmq::Socket, stream: &Stream, block_size: u32, stop: &AtomicBool) {
    let mut filter = MirrorFilter::default();
    let mut next_seq: Option<u64> = None;
    while !stop.load(Ordering::Relaxed) {
        let frames = match socket.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(_) => return,
        };
        let Ok(message) = decode_live(&frames) else {
            stream.lost_messages.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let mut mirror = lock(&stream.mirror);
        match next_seq {
            Some(expected) if message.seq > expected => {
                stream
                    .lost_messages
                    .fetch_add(message.seq - expected, Ordering::Relaxed);
            }
            // A restarted engine counts from 0 again, with an empty cache.
            Some(expected) if message.seq + 1 < expected => mirror.clear(),
            _ => {}
        }
        next_seq = Some(message.seq.saturating_add(1));
        let mut removed = 0;
        for event in message
            .batch
            .events
            .iter()
            .filter(|event| filter.accepts(event))
        {
            match &event.event {
                KvEvent::BlockStored(stored) => mirror.store(stored, block_size),
                KvEvent::BlockRemoved(gone) => {
                    removed += gone.block_hashes.len() as u64;
                    mirror.remove(&gone.block_hashes);
                }
                KvEvent::AllBlocksCleared(_) => mirror.clear(),
            }
        }
        stream.removed_blocks.fetch_add(removed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use myelin_kv_events::wire::{
        AllBlocksCleared, BlockRemoved, EventBatch, WireVersion, encode_batch,
    };

    use crate::oracle::CacheOracle as _;

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

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> BlockStored {
        BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    }

    #[test]
    fn the_mirror_answers_by_tokens_whatever_the_engine_hashes() {
        let mut mirror = Mirror::default();
        // Blocks [1,2] [3,4] in one event, [5,6] on top of them in another.
        mirror.store(&stored(&[901, 902], None, vec![1, 2, 3, 4]), 2);
        mirror.store(&stored(&[903], Some(902), vec![5, 6]), 2);
        assert_eq!(mirror.cached_tokens(&[1, 2, 3, 4, 5, 6, 7], 2), 6);
        assert_eq!(mirror.cached_tokens(&[1, 2, 3, 9, 5, 6], 2), 2);
        assert_eq!(
            mirror.cached_tokens(&[3, 4], 2),
            0,
            "a block is keyed by its chain"
        );
        // A store on a parent never seen, of another block size or of a LoRA is not mirrored.
        mirror.store(&stored(&[904], Some(777), vec![7, 8]), 2);
        let mut lora = stored(&[905], Some(903), vec![7, 8]);
        lora.lora_name = Some("adapter".into());
        mirror.store(&lora, 2);
        let mut other = stored(&[906], Some(903), vec![7, 8, 9, 10]);
        other.block_size = 4;
        mirror.store(&other, 2);
        assert_eq!(mirror.cached_tokens(&[1, 2, 3, 4, 5, 6, 7, 8], 2), 6);
        assert_eq!(mirror.keys.len(), 3);
        // Two copies of [1,2]: the block stays until both are removed.
        mirror.store(&stored(&[901], None, vec![1, 2]), 2);
        mirror.remove(&[901]);
        assert_eq!(mirror.cached_tokens(&[1, 2, 3, 4], 2), 4);
        mirror.remove(&[901, 12345]);
        assert_eq!(mirror.cached_tokens(&[1, 2, 3, 4], 2), 0);
        mirror.clear();
        assert!(mirror.keys.is_empty() && mirror.copies.is_empty());
    }

    #[test]
    fn counts_evicted_gpu_blocks_of_live_messages_and_says_what_was_lost() {
        let context = zmq::Context::new();
        let publisher = context.socket(zmq::PUB).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let watch = KvWatch::start(&[endpoint], 4).unwrap();
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

        // The mirror: a stored block is held; a reset the harness made empties it at once; a
        // restarted engine (its sequence back to 0) starts empty.
        let prompt = [1, 2, 3, 4, 5];
        let store = || {
            let mut block = stored(&[77], None, vec![1, 2, 3, 4]);
            block.block_size = 4;
            KvEvent::BlockStored(block)
        };
        publish(&publisher, seq + 5, vec![store()]);
        wait_for("the store", || watch.probe(&prompt)[0].cached_tokens == 4);
        watch.cleared(0);
        assert_eq!(watch.probe(&prompt)[0].cached_tokens, 0);
        publish(&publisher, seq + 6, vec![store()]);
        wait_for("the store again", || {
            watch.probe(&prompt)[0].cached_tokens == 4
        });
        publish(&publisher, 0, vec![]);
        wait_for("the restart", || watch.probe(&prompt)[0].cached_tokens == 0);
        drop(watch);
    }
}
