//! The KV-event subscriber of one engine: a ZMQ SUB socket on the engine's event stream (and a
//! DEALER on its replay socket, when known), decoded batches through [`KvFeed`], mirror updates
//! out to the control core over a crossbeam channel.
//!
//! libzmq sockets are blocking, so each engine's subscriber runs on its own small thread, pinned
//! to the control core's CPU when the router pins: data cores never run it. The thread polls its
//! stop flag between receives (at most [`RECEIVE_TIMEOUT`] apart).
//!
//! Sequence handling (vLLM numbers batches from 0 per engine process):
//! - at start, with a replay endpoint, everything the engine still buffers is replayed first,
//!   so blocks cached before the router started are known;
//! - a gap (the PUB socket dropped batches for a slow subscriber) is filled from the replay
//!   socket when there is one;
//! - a sequence going back means the engine restarted with an empty cache: the backend's
//!   mirror is cleared.
//!
//! A mirror that may lack blocks the engine holds is *partial* ([`Partial`]): live, its blocks
//! count as cached, and for the rest the estimate and history decide. That is the case when
//! the first batch seen is not the engine's first (a warm engine whose replay buffer no longer
//! reaches back, or no replay socket), after a gap that cannot be filled (the mirror is
//! cleared at the gap: what follows is exact), and after the tracked-block map passed its
//! bound ([`KvFeed::overflowed`]; reset with the mirror). It is exact again when the engine
//! clears its cache (`AllBlocksCleared`), restarts, or has stored more blocks than its KV
//! capacity since ([`Subscriber::set_capacity_blocks`]).
//!
//! Two things take the mirror out of routing (not live: the estimate decides) until the
//! stream shows it exact again:
//! - the backend went down ([`Subscriber::suspend`]): a dead engine's blocks are gone, and its
//!   restarted process publishes nothing until it stores its first block. The next batch
//!   decides: one that continues the sequence (it was not a restart) brings the mirror back
//!   as it was, one that starts a new sequence clears it first;
//! - the engine's blocks are of another size than the router's `--block-size`: none can be
//!   mirrored (said once in the log, and in `myelin_kv_events_block_size_mismatch`), until the
//!   engine restarts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use myelin_kv_events::decode::{self, DecodedBatch, ReplayFrame};
use myelin_routing::MirrorTrust;

use crate::backends::BackendId;
use crate::kv_feed::{FeedCounters, KvFeed, MirrorChange};
use crate::metrics as names;

/// Longest wait for one message before the stop flag is looked at again.
pub const RECEIVE_TIMEOUT: Duration = Duration::from_millis(100);
/// Longest wait for the replay socket's next batch.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest message accepted from an engine's sockets (`ZMQ_MAXMSGSIZE`): libzmq drops the
/// connection of a peer that sends more instead of allocating it (a reconnect then shows as a
/// gap). A vLLM batch of one step is far smaller: a 16-token block is about 100 bytes.
pub const MAX_MESSAGE_BYTES: i64 = 64 << 20;

/// Where one engine publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEndpoints {
    /// The PUB endpoint (`tcp://host:port`).
    pub publish: String,
    /// The ROUTER replay endpoint, when the engine has one.
    pub replay: Option<String>,
}

/// What a subscriber tells the control core.
#[derive(Debug)]
pub enum FeedEvent {
    /// Mirror changes, in stream order.
    Updates {
        backend: BackendId,
        updates: Vec<MirrorChange>,
    },
    /// The backend's mirror is in sync (exact or partial) or not, and why.
    Live {
        backend: BackendId,
        status: MirrorStatus,
    },
    /// The whole mirror (`Cleared`, then every block), in stream order with `Updates`, and
    /// how far it is trusted: asked for by [`Subscriber::request_snapshot`].
    Snapshot {
        backend: BackendId,
        changes: Vec<MirrorChange>,
        trust: MirrorTrust,
    },
}

/// A backend's mirror as its subscriber sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorStatus {
    /// Out of routing (the estimate decides), and why.
    NotLive(NotLive),
    /// In sync, but it may lack blocks the engine holds, and why.
    Partial(Partial),
    /// In sync since the engine started or last cleared its cache.
    Exact,
}

impl MirrorStatus {
    /// What routing makes of it.
    pub fn trust(self) -> MirrorTrust {
        match self {
            MirrorStatus::NotLive(_) => MirrorTrust::None,
            MirrorStatus::Partial(_) => MirrorTrust::Partial,
            MirrorStatus::Exact => MirrorTrust::Exact,
        }
    }
}

/// Why a live mirror is partial: every block in it is resident, but the engine may hold others
/// the router never saw stored. Routing counts the mirror's blocks and leaves the rest to the
/// estimate and history, until the engine clears its cache, restarts, or has stored more
/// blocks than its KV capacity since the mirror became partial (by then, under LRU, what it
/// held before has been evicted unless it was used again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partial {
    /// The first batch seen was not the engine's first (`first_seq`): the router started
    /// against a warm engine, beyond what its replay buffer still held (or without one).
    JoinedLate { first_seq: u64 },
    /// Batches were lost and could not be replayed: the mirror was cleared at the gap.
    Unsynced,
    /// The tracked-block map passed its bound and was reset, the mirror with it.
    Overflowed,
}

impl Partial {
    /// For `GET /admin/backends`.
    pub fn describe(self) -> String {
        let why = match self {
            Partial::JoinedLate { first_seq } => format!(
                "the first event batch seen was number {first_seq}, not 0: the engine had cached \
                 blocks before the router subscribed"
            ),
            Partial::Unsynced => {
                "event batches were lost and could not be replayed: the mirror was cleared".into()
            }
            Partial::Overflowed => "more blocks than the mirror tracks: it was reset".into(),
        };
        format!(
            "{why}; its blocks count as cached, the estimate decides for the rest until the \
             engine clears its cache, restarts or stores more blocks than its capacity"
        )
    }
}

/// Why a backend's mirror is not live (routing then uses the estimate for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotLive {
    /// No batch applied yet since the subscription.
    Starting,
    /// The backend went down; the stream's next batch decides.
    BackendDown,
    /// The engine's blocks are not of the router's block size.
    BlockSize { engine: u32, router: u32 },
    /// The subscriber stopped.
    Stopped,
}

impl NotLive {
    /// For `GET /admin/backends`.
    pub fn describe(self) -> String {
        match self {
            NotLive::Starting => "no event batch seen yet".into(),
            NotLive::BackendDown => {
                "the backend went down: waiting for its stream to show whether it restarted".into()
            }
            NotLive::BlockSize { engine, router } => format!(
                "the engine's blocks are {engine} tokens, the router's --block-size is {router}: \
                 not mirrored until they agree"
            ),
            NotLive::Stopped => "the subscriber stopped".into(),
        }
    }
}

/// A running subscriber; stops (without waiting) when dropped.
pub struct Subscriber {
    stop: Arc<AtomicBool>,
    snapshot: Arc<AtomicBool>,
    suspend: Arc<AtomicBool>,
    /// The engine's KV capacity in blocks (0: unknown), for [`Partial`]'s end.
    capacity_blocks: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Starts following `endpoints` for `backend`.
    pub fn start(
        backend: BackendId,
        endpoints: KvEndpoints,
        feed: KvFeed,
        sender: Sender<FeedEvent>,
        cpu: Option<usize>,
    ) -> std::io::Result<Subscriber> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let snapshot = Arc::new(AtomicBool::new(false));
        let thread_snapshot = snapshot.clone();
        let suspend = Arc::new(AtomicBool::new(false));
        let thread_suspend = suspend.clone();
        let capacity_blocks = Arc::new(AtomicU64::new(0));
        let thread_capacity_blocks = capacity_blocks.clone();
        let thread = std::thread::Builder::new()
            .name(format!("myelin-kv-{backend}"))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    pin_to(cpu);
                }
                let mut follower = Follower::new(
                    backend,
                    feed,
                    sender,
                    thread_snapshot,
                    thread_suspend,
                    thread_capacity_blocks,
                );
                follower.run(&endpoints, &thread_stop);
                let _ = follower.sender.send(FeedEvent::Live {
                    backend,
                    status: MirrorStatus::NotLive(NotLive::Stopped),
                });
            })?;
        Ok(Subscriber {
            stop,
            snapshot,
            suspend,
            capacity_blocks,
            thread: Some(thread),
        })
    }

    /// The engine's KV capacity, in blocks: a partial mirror becomes exact once the engine has
    /// stored more blocks than this since it became partial (unknown: only a cache clear or a
    /// restart ends it).
    pub fn set_capacity_blocks(&self, blocks: u64) {
        self.capacity_blocks.store(blocks, Ordering::Relaxed);
    }

    /// The backend went down: its mirror stops being live within about [`RECEIVE_TIMEOUT`]
    /// and stays out of routing until the stream's next batch shows whether the engine kept
    /// its cache (the sequence goes on) or restarted (it starts again, and the mirror is
    /// cleared).
    pub fn suspend(&self) {
        self.suspend.store(true, Ordering::Release);
    }

    /// Asks the thread to send its whole mirror ([`FeedEvent::Snapshot`]) within about
    /// [`RECEIVE_TIMEOUT`].
    pub fn request_snapshot(&self) {
        self.snapshot.store(true, Ordering::Release);
    }

    /// Stops the thread and waits for it (at most about [`RECEIVE_TIMEOUT`]).
    pub fn stop_and_join(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

pub(crate) fn pin_to(cpu: usize) {
    // SAFETY: `cpu_set_t` is plain data, zeroed is its empty set; CPU_SET writes inside it
    // and sched_setaffinity only reads it. A failure leaves the thread unpinned.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The payload hashes of batches applied from the replay socket, by sequence number, until the
/// live socket passes them: a live batch of the same number and bytes is the same batch, one of
/// other bytes is a new engine process's. Bounded (vLLM buffers 10,000 batches by default).
#[derive(Debug, Default)]
struct Replayed {
    batches: std::collections::VecDeque<(u64, u64)>,
}

impl Replayed {
    const MAX_BATCHES: usize = 16_384;

    fn remember(&mut self, seq: u64, hash: u64) {
        if self.batches.len() == Self::MAX_BATCHES {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, hash));
    }

    /// The hash replayed for `seq`, if any; forgets it and every earlier one (the live stream
    /// is past them).
    fn take(&mut self, seq: u64) -> Option<u64> {
        while let Some(&(front, hash)) = self.batches.front() {
            if front > seq {
                return None;
            }
            self.batches.pop_front();
            if front == seq {
                return Some(hash);
            }
        }
        None
    }
}

/// A hash of a batch's payload (its last frame), to tell two batches of one number apart.
fn payload_hash(frames: &[Vec<u8>]) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let payload = frames.last().map_or(&[][..], Vec::as_slice);
    BuildHasherDefault::<DefaultHasher>::default().hash_one(payload)
}

struct Follower {
    backend: BackendId,
    label: String,
    feed: KvFeed,
    sender: Sender<FeedEvent>,
    /// Last batch applied, live or replayed.
    last_seq: Option<u64>,
    /// Last batch received on the live socket.
    last_live_seq: Option<u64>,
    /// Why the mirror is out of routing; `None` while live.
    not_live: Option<NotLive>,
    /// Why the live mirror may lack blocks the engine holds; `None`: exact.
    partial: Option<Partial>,
    /// Blocks the engine stored since the mirror became partial.
    stored_since_partial: u64,
    /// The status last sent to the control core.
    sent: MirrorStatus,
    /// [`Subscriber::set_capacity_blocks`].
    capacity_blocks: Arc<AtomicU64>,
    /// Batches applied from the replay socket that may still come live.
    replayed: Replayed,
    /// The engine's block size, when it is not the router's: nothing can be mirrored until
    /// the engine restarts.
    foreign_block_size: Option<u32>,
    /// Set by [`Subscriber::request_snapshot`].
    snapshot: Arc<AtomicBool>,
    /// Set by [`Subscriber::suspend`].
    suspend: Arc<AtomicBool>,
    reported: FeedCounters,
}

impl Follower {
    /// A follower of `backend`'s stream that has seen nothing yet.
    fn new(
        backend: BackendId,
        feed: KvFeed,
        sender: Sender<FeedEvent>,
        snapshot: Arc<AtomicBool>,
        suspend: Arc<AtomicBool>,
        capacity_blocks: Arc<AtomicU64>,
    ) -> Follower {
        Follower {
            backend,
            label: names::backend_label(backend),
            feed,
            sender,
            last_seq: None,
            last_live_seq: None,
            not_live: Some(NotLive::Starting),
            partial: None,
            stored_since_partial: 0,
            sent: MirrorStatus::NotLive(NotLive::Starting),
            foreign_block_size: None,
            snapshot,
            suspend,
            capacity_blocks,
            replayed: Replayed::default(),
            reported: FeedCounters::default(),
        }
    }

    fn run(&mut self, endpoints: &KvEndpoints, stop: &AtomicBool) {
        let context = zmq::Context::new();
        let subscriber = match self.socket(&context, zmq::SUB, &endpoints.publish) {
            Some(socket) => socket,
            None => return,
        };
        if subscriber.set_subscribe(b"").is_err() {
            return;
        }
        let replay = endpoints
            .replay
            .as_deref()
            .and_then(|endpoint| self.socket(&context, zmq::DEALER, endpoint));
        // Everything the engine still buffers, before the live stream.
        if let Some(replay) = &replay {
            self.replay_from(replay, 0, None);
        }
        if self.last_seq.is_some() && self.exact() {
            self.set_status(None);
        }
        while !stop.load(Ordering::Acquire) {
            if self.suspend.swap(false, Ordering::AcqRel) && self.not_live.is_none() {
                self.set_status(Some(NotLive::BackendDown));
            }
            if self.snapshot.swap(false, Ordering::AcqRel) {
                let mut changes = Vec::new();
                self.feed.snapshot(&mut changes);
                let _ = self.sender.send(FeedEvent::Snapshot {
                    backend: self.backend,
                    changes,
                    trust: self.status().trust(),
                });
            }
            let frames = match subscriber.recv_multipart(0) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => continue,
                Err(zmq::Error::ETERM) => return,
                Err(_) => continue,
            };
            let message = match decode::decode_live(&frames) {
                Ok(message) => message,
                Err(_) => {
                    metrics::counter!(names::KV_EVENTS_DECODE_ERRORS_TOTAL, "backend" => self.label.clone())
                        .increment(1);
                    continue;
                }
            };
            let seq = message.seq;
            // vLLM never repeats a live sequence number: going back means a new engine
            // process (restart), whose cache starts empty. A batch the replay socket already
            // gave is a restart's too when its bytes differ (the engine restarted before any
            // batch came live).
            let repeated_live = self.last_live_seq.is_some_and(|previous| seq <= previous);
            let replayed_as = self.replayed.take(seq);
            if repeated_live || replayed_as.is_some_and(|hash| hash != payload_hash(&frames)) {
                self.restart();
            }
            self.last_live_seq = Some(seq);
            let missing_from = match self.last_seq {
                // Already applied from the replay socket.
                Some(last) if seq <= last => continue,
                Some(last) if seq > last + 1 => {
                    metrics::counter!(names::KV_EVENTS_GAPS_TOTAL, "backend" => self.label.clone())
                        .increment(1);
                    Some(last + 1)
                }
                // The first batch seen is not the engine's first (a batch published before
                // the subscription took effect, or a warm engine): the ones before it are
                // asked for too. What the buffer no longer holds leaves the mirror partial.
                None if seq > 0 => Some(0),
                _ => None,
            };
            if let Some(start) = missing_from {
                if let Some(replay) = &replay {
                    self.replay_from(replay, start, Some(seq));
                }
                if self.last_seq.is_some_and(|last| last + 1 < seq) {
                    self.lose_sync();
                }
            }
            self.apply(seq, &message.batch);
            if self.exact() {
                self.set_status(None);
            }
        }
    }

    /// Whether the mirror holds what the engine announced (all of it, or all since it became
    /// partial).
    fn exact(&self) -> bool {
        self.foreign_block_size.is_none()
    }

    fn socket(
        &self,
        context: &zmq::Context,
        kind: zmq::SocketType,
        endpoint: &str,
    ) -> Option<zmq::Socket> {
        let socket = context.socket(kind).ok()?;
        let timeout = i32::try_from(RECEIVE_TIMEOUT.as_millis()).unwrap_or(100);
        socket.set_rcvtimeo(timeout).ok()?;
        socket.set_linger(0).ok()?;
        socket.set_maxmsgsize(MAX_MESSAGE_BYTES).ok()?;
        match socket.connect(endpoint) {
            Ok(()) => Some(socket),
            Err(error) => {
                eprintln!("myelin: kv events {endpoint}: {error}");
                None
            }
        }
    }

    /// Applies every buffered batch from `start` (and before `until`, when given).
    fn replay_from(&mut self, replay: &zmq::Socket, start: u64, until: Option<u64>) {
        let request = decode::replay_request(start);
        if replay.send_multipart(request, 0).is_err() {
            return;
        }
        let deadline = Instant::now() + REPLAY_TIMEOUT;
        while Instant::now() < deadline {
            let frames = match replay.recv_multipart(0) {
                Ok(frames) => frames,
                Err(_) => continue,
            };
            match decode::decode_replay(&frames) {
                Ok(ReplayFrame::End) => return,
                Ok(ReplayFrame::Batch { seq, batch }) => {
                    if until.is_some_and(|until| seq >= until)
                        || self.last_seq.is_some_and(|last| seq <= last)
                    {
                        continue;
                    }
                    self.replayed.remember(seq, payload_hash(&frames));
                    self.apply(seq, &batch);
                }
                Err(_) => {
                    metrics::counter!(names::KV_EVENTS_DECODE_ERRORS_TOTAL, "backend" => self.label.clone())
                        .increment(1);
                }
            }
        }
    }

    fn restart(&mut self) {
        metrics::counter!(names::KV_EVENTS_RESTARTS_TOTAL, "backend" => self.label.clone())
            .increment(1);
        let mut updates = Vec::new();
        self.feed.clear(&mut updates);
        self.last_seq = None;
        self.replayed = Replayed::default();
        // A new engine process starts empty: the mirror is exact again (and its blocks may
        // now be of the router's size).
        self.end_partial();
        if self.foreign_block_size.take().is_some() {
            metrics::gauge!(names::KV_EVENTS_BLOCK_SIZE_MISMATCH, "backend" => self.label.clone())
                .set(0.0);
        }
        self.forward(updates);
    }

    /// A gap that cannot be filled: batches are lost, so the mirror may hold evicted blocks
    /// and miss stored ones. It is cleared and partial from here: what is stored after the
    /// gap is exact.
    fn lose_sync(&mut self) {
        metrics::counter!(names::KV_EVENTS_UNSYNCED_TOTAL, "backend" => self.label.clone())
            .increment(1);
        self.begin_partial(Partial::Unsynced);
        let mut updates = Vec::new();
        self.feed.clear(&mut updates);
        self.forward(updates);
    }

    fn begin_partial(&mut self, why: Partial) {
        self.partial = Some(why);
        self.stored_since_partial = 0;
        self.publish();
    }

    fn end_partial(&mut self) {
        self.partial = None;
        self.publish();
    }

    fn apply(&mut self, seq: u64, batch: &DecodedBatch) {
        let before = self.feed.counters;
        let mut updates = Vec::new();
        for event in &batch.events {
            self.feed.apply(event, &mut updates);
        }
        let after = self.feed.counters;
        if after.overflow_clears > before.overflow_clears {
            self.begin_partial(Partial::Overflowed);
        } else if updates.contains(&MirrorChange::Cleared) {
            // The engine dropped its whole cache: from here on the mirror is exact.
            self.end_partial();
        } else if self.last_seq.is_none() && seq > 0 {
            // The engine's batches before this one are neither replayed nor coming.
            self.begin_partial(Partial::JoinedLate { first_seq: seq });
        } else if self.partial.is_some() {
            self.stored_since_partial += (after.stored_blocks - before.stored_blocks)
                + (after.skipped_orphan - before.skipped_orphan);
            let capacity = self.capacity_blocks.load(Ordering::Relaxed);
            if capacity > 0 && self.stored_since_partial > capacity {
                self.end_partial();
            }
        }
        let skipped_for_size = before.skipped_block_size;
        let foreign = self.feed.counters.foreign_block_size;
        if self.feed.counters.skipped_block_size > skipped_for_size
            && self.foreign_block_size.is_none()
        {
            self.foreign_block_size = Some(foreign);
            self.set_status(Some(NotLive::BlockSize {
                engine: foreign,
                router: self.feed.block_size().get(),
            }));
            eprintln!(
                "myelin: kv events of backend {}: the engine's KV blocks are {foreign} tokens, the \
                 router's --block-size is {}: this engine's cache is not mirrored (the \
                 estimate routes it) until the two agree and the engine restarts",
                self.label,
                self.feed.block_size()
            );
            metrics::gauge!(names::KV_EVENTS_BLOCK_SIZE_MISMATCH, "backend" => self.label.clone())
                .set(f64::from(foreign));
        }
        self.last_seq = Some(seq);
        metrics::counter!(names::KV_EVENTS_BATCHES_TOTAL, "backend" => self.label.clone())
            .increment(1);
        self.report_counters();
        self.forward(updates);
    }

    fn forward(&self, updates: Vec<MirrorChange>) {
        if !updates.is_empty() {
            let _ = self.sender.send(FeedEvent::Updates {
                backend: self.backend,
                updates,
            });
        }
    }

    fn status(&self) -> MirrorStatus {
        match (self.not_live, self.partial) {
            (Some(why), _) => MirrorStatus::NotLive(why),
            (None, Some(why)) => MirrorStatus::Partial(why),
            (None, None) => MirrorStatus::Exact,
        }
    }

    fn set_status(&mut self, not_live: Option<NotLive>) {
        self.not_live = not_live;
        self.publish();
    }

    /// Tells the control core the mirror's status, when it changed.
    fn publish(&mut self) {
        let status = self.status();
        if self.sent != status {
            self.sent = status;
            let _ = self.sender.send(FeedEvent::Live {
                backend: self.backend,
                status,
            });
        }
    }

    /// Adds what the feed counted since the last report to the metrics.
    fn report_counters(&mut self) {
        let now = self.feed.counters;
        let before = std::mem::replace(&mut self.reported, now);
        for (reason, now, before) in [
            (
                "other_cache",
                now.skipped_other_cache,
                before.skipped_other_cache,
            ),
            ("lora", now.skipped_lora, before.skipped_lora),
            (
                "extra_keys",
                now.skipped_extra_keys,
                before.skipped_extra_keys,
            ),
            (
                "block_size",
                now.skipped_block_size,
                before.skipped_block_size,
            ),
            ("malformed", now.skipped_malformed, before.skipped_malformed),
            ("orphan", now.skipped_orphan, before.skipped_orphan),
            (
                "unknown_removal",
                now.unknown_removals,
                before.unknown_removals,
            ),
        ] {
            if now > before {
                metrics::counter!(names::KV_EVENTS_SKIPPED_BLOCKS_TOTAL, "reason" => reason)
                    .increment(now - before);
            }
        }
        let stored = now.stored_blocks - before.stored_blocks;
        let removed = now.removed_blocks - before.removed_blocks;
        if stored > 0 {
            metrics::counter!(names::KV_EVENTS_BLOCKS_TOTAL, "event" => "stored").increment(stored);
        }
        if removed > 0 {
            metrics::counter!(names::KV_EVENTS_BLOCKS_TOTAL, "event" => "removed")
                .increment(removed);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use crossbeam_channel::Receiver;
    use myelin_kv_events::decode::DecodedEvent;
    use myelin_kv_events::wire::{AllBlocksCleared, KvEvent};

    use super::*;

    /// The block size of `kv_feed`'s test events.
    const BLOCK: u32 = 4;

    fn follower(capacity_blocks: u64) -> (Follower, Receiver<FeedEvent>) {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let follower = Follower::new(
            BackendId(3),
            KvFeed::new(NonZeroU32::new(BLOCK).unwrap()),
            sender,
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(capacity_blocks)),
        );
        (follower, receiver)
    }

    fn batch(events: Vec<DecodedEvent>) -> DecodedBatch {
        DecodedBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
            skipped_unknown_events: 0,
        }
    }

    /// A chain of `blocks` blocks from the root, engine hashes from `first_hash`.
    fn stored(first_hash: u64, blocks: u32) -> DecodedEvent {
        let hashes: Vec<u64> = (0..u64::from(blocks)).map(|i| first_hash + i).collect();
        let tokens: Vec<u32> = (0..blocks * BLOCK)
            .map(|token| token + first_hash as u32)
            .collect();
        crate::kv_feed::tests::stored(&hashes, None, &tokens)
    }

    /// The mirror statuses sent so far, in order.
    fn statuses(receiver: &Receiver<FeedEvent>) -> Vec<MirrorStatus> {
        receiver
            .try_iter()
            .filter_map(|event| match event {
                FeedEvent::Live { status, .. } => Some(status),
                _ => None,
            })
            .collect()
    }

    /// Applies a batch as the receive loop does after the sequence checks.
    fn receive(follower: &mut Follower, seq: u64, events: Vec<DecodedEvent>) {
        follower.apply(seq, &batch(events));
        if follower.exact() {
            follower.set_status(None);
        }
    }

    #[test]
    fn replayed_batches_are_known_by_number_until_the_live_stream_passes_them() {
        let mut replayed = Replayed::default();
        for seq in 3..8 {
            replayed.remember(seq, seq * 10);
        }
        assert_eq!(replayed.take(2), None);
        assert_eq!(replayed.take(4), Some(40), "3 is forgotten on the way");
        assert_eq!(replayed.take(3), None);
        assert_eq!(replayed.take(7), Some(70));
        assert!(replayed.batches.is_empty());
        for seq in 0..Replayed::MAX_BATCHES as u64 + 2 {
            replayed.remember(seq, seq);
        }
        assert_eq!(replayed.batches.len(), Replayed::MAX_BATCHES);
        assert_eq!(
            replayed.take(1),
            None,
            "the oldest are dropped at the bound"
        );
        assert_eq!(
            payload_hash(&[b"topic".to_vec(), b"a".to_vec()]),
            payload_hash(&[b"other".to_vec(), b"a".to_vec()])
        );
        assert_ne!(
            payload_hash(&[b"a".to_vec()]),
            payload_hash(&[b"b".to_vec()])
        );
    }

    #[test]
    fn joining_a_stream_at_batch_zero_is_exact() {
        let (mut follower, receiver) = follower(100);
        receive(&mut follower, 0, vec![stored(10, 2)]);
        receive(&mut follower, 1, vec![stored(20, 2)]);
        assert_eq!(statuses(&receiver), vec![MirrorStatus::Exact]);
    }

    #[test]
    fn joining_late_is_partial_until_a_capacity_of_blocks_is_stored() {
        let (mut follower, receiver) = follower(10);
        receive(&mut follower, 7, vec![stored(10, 4)]);
        let late = MirrorStatus::Partial(Partial::JoinedLate { first_seq: 7 });
        assert_eq!(statuses(&receiver), vec![late]);
        assert_eq!(follower.status().trust(), MirrorTrust::Partial);
        // 6 + 4 = 10 blocks stored since: not more than the capacity yet.
        receive(&mut follower, 8, vec![stored(20, 6)]);
        receive(&mut follower, 9, vec![stored(30, 4)]);
        assert_eq!(statuses(&receiver), vec![]);
        receive(&mut follower, 10, vec![stored(40, 1)]);
        assert_eq!(statuses(&receiver), vec![MirrorStatus::Exact]);
    }

    #[test]
    fn with_no_capacity_known_only_a_clear_or_a_restart_ends_a_partial_mirror() {
        let (mut follower, receiver) = follower(0);
        receive(&mut follower, 3, vec![stored(10, 50)]);
        receive(&mut follower, 4, vec![stored(100, 50)]);
        assert_eq!(follower.status().trust(), MirrorTrust::Partial);
        receive(
            &mut follower,
            5,
            vec![crate::kv_feed::tests::local(KvEvent::AllBlocksCleared(
                AllBlocksCleared,
            ))],
        );
        assert_eq!(follower.status(), MirrorStatus::Exact);
        // A restart whose first batch was missed: partial again, from that batch.
        follower.restart();
        receive(&mut follower, 2, vec![stored(10, 1)]);
        assert_eq!(
            follower.status(),
            MirrorStatus::Partial(Partial::JoinedLate { first_seq: 2 })
        );
        follower.restart();
        receive(&mut follower, 0, vec![stored(10, 1)]);
        assert_eq!(follower.status(), MirrorStatus::Exact);
        let seen = statuses(&receiver);
        assert_eq!(seen.first().map(|s| s.trust()), Some(MirrorTrust::Partial));
        assert_eq!(seen.last(), Some(&MirrorStatus::Exact));
    }

    #[test]
    fn a_gap_that_cannot_be_filled_clears_the_mirror_and_leaves_it_partial() {
        let (mut follower, receiver) = follower(100);
        receive(&mut follower, 0, vec![stored(10, 2)]);
        follower.lose_sync();
        let events: Vec<FeedEvent> = receiver.try_iter().collect();
        // Exact first; then partial, and the mirror cleared after the status changed.
        let partial_at = events
            .iter()
            .position(|event| {
                matches!(
                    event,
                    FeedEvent::Live {
                        status: MirrorStatus::Partial(Partial::Unsynced),
                        ..
                    }
                )
            })
            .expect("partial");
        let cleared_at = events
            .iter()
            .position(|event| {
                matches!(event, FeedEvent::Updates { updates, .. } if updates == &[MirrorChange::Cleared])
            })
            .expect("cleared");
        assert!(partial_at < cleared_at);
        // What follows the gap is exact, but the mirror stays partial (and live).
        receive(&mut follower, 5, vec![stored(30, 2)]);
        assert_eq!(follower.status(), MirrorStatus::Partial(Partial::Unsynced));
        assert!(follower.status().trust().is_live());
    }
}
