//! The KV-event publisher edge: vLLM's `ZmqEventPublisher` on a dedicated std thread. A PUB
//! socket sends `[topic, seq u64 BE, msgpack payload]`; a ROUTER socket answers replay requests
//! `[identity, "", start_seq 8B BE]` from a bounded buffer and ends with seq -1. Engines hand
//! batches over a crossbeam channel, so a glommio executor never blocks on ZMQ.
//!
//! Fault knobs (for tests of gap recovery): drop every Nth batch on the PUB socket (it stays in
//! the replay buffer, as when a real PUB drops at its high-water mark), and restart (sequence
//! numbers begin again at 0 with an empty buffer, as after a process restart).

use std::collections::VecDeque;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use myelin_kv_events::{EventBatch, WireVersion, encode_batch};

/// vLLM's end-of-replay marker: seq -1 as 8 big-endian bytes.
pub const REPLAY_END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// vLLM's default replay buffer (`buffer_steps`).
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// vLLM's default PUB high-water mark.
pub const DEFAULT_HWM: i32 = 100_000;

/// How often the publisher thread looks for replay requests when no batch arrives.
const REPLAY_POLL_INTERVAL: Duration = Duration::from_millis(5);

/// Publisher settings for one engine.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, e.g. `tcp://*:5557` or `tcp://127.0.0.1:*` (ephemeral).
    pub endpoint: String,
    /// ROUTER replay endpoint to bind, if any.
    pub replay_endpoint: Option<String>,
    /// Topic frame (vLLM's default is empty).
    pub topic: String,
    /// Payload layout.
    pub wire: WireVersion,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Drop every Nth batch on the PUB socket (still replayable): makes sequence gaps.
    pub drop_every: Option<u64>,
    /// Restart the sequence (back to 0, buffer emptied) after every N batches.
    pub restart_every: Option<u64>,
}

/// Why the publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// A ZMQ socket could not be created or bound.
    #[error("KV event socket {endpoint}: {source}")]
    Socket {
        /// The endpoint.
        endpoint: String,
        /// The ZMQ error.
        source: zmq::Error,
    },
    /// The publisher thread could not be spawned.
    #[error("cannot start the KV publisher thread: {0}")]
    Thread(std::io::Error),
}

enum Command {
    Publish(EventBatch),
    Restart,
    Shutdown,
}

/// A running publisher. Dropping it stops the thread and closes the sockets.
#[derive(Debug)]
pub struct KvPublisher {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    publish_endpoint: String,
    replay_endpoint: Option<String>,
}

impl KvPublisher {
    /// Binds the sockets (errors surface here) and starts the publisher thread.
    pub fn start(context: &zmq::Context, config: PublisherConfig) -> Result<Self, PublisherError> {
        let socket_error = |endpoint: &str| {
            let endpoint = endpoint.to_string();
            move |source| PublisherError::Socket { endpoint, source }
        };
        let publish = context
            .socket(zmq::PUB)
            .map_err(socket_error(&config.endpoint))?;
        publish
            .set_sndhwm(DEFAULT_HWM)
            .and_then(|()| publish.set_linger(0))
            .and_then(|()| publish.bind(&config.endpoint))
            .map_err(socket_error(&config.endpoint))?;
        let publish_endpoint = bound_endpoint(&publish).unwrap_or_else(|| config.endpoint.clone());
        let (replay, replay_endpoint) = match &config.replay_endpoint {
            Some(endpoint) => {
                let router = context
                    .socket(zmq::ROUTER)
                    .map_err(socket_error(endpoint))?;
                router
                    .set_linger(0)
                    .and_then(|()| router.bind(endpoint))
                    .map_err(socket_error(endpoint))?;
                let bound = bound_endpoint(&router).unwrap_or_else(|| endpoint.clone());
                (Some(router), Some(bound))
            }
            None => (None, None),
        };
        let (commands, receiver) = crossbeam_channel::unbounded();
        let state = PublisherThread {
            publish,
            replay,
            topic: config.topic.into_bytes(),
            wire: config.wire,
            buffer: VecDeque::new(),
            buffer_steps: config.buffer_steps.max(1),
            next_seq: 0,
            batches_seen: 0,
            drop_every: config.drop_every.filter(|&every| every > 0),
            restart_every: config.restart_every.filter(|&every| every > 0),
        };
        let thread = std::thread::Builder::new()
            .name("kv-publisher".to_string())
            .spawn(move || state.run(receiver))
            .map_err(PublisherError::Thread)?;
        Ok(KvPublisher {
            commands,
            thread: Some(thread),
            publish_endpoint,
            replay_endpoint,
        })
    }

    /// The bound PUB endpoint as ZMQ reports it (e.g. `tcp://0.0.0.0:5557`).
    pub fn publish_endpoint(&self) -> &str {
        &self.publish_endpoint
    }

    /// The bound replay endpoint.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Queues a batch (never blocks).
    pub fn publish(&self, batch: EventBatch) {
        // The thread only stops on Drop, so a send cannot fail while `self` lives.
        let _ = self.commands.send(Command::Publish(batch));
    }

    /// Simulates a publisher restart: the next batch has seq 0 and the replay buffer is empty.
    pub fn restart(&self) {
        let _ = self.commands.send(Command::Restart);
    }
}

impl Drop for KvPublisher {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn bound_endpoint(socket: &zmq::Socket) -> Option<String> {
    socket.get_last_endpoint().ok().and_then(Result::ok)
}

struct PublisherThread {
    publish: zmq::Socket,
    replay: Option<zmq::Socket>,
    topic: Vec<u8>,
    wire: WireVersion,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    next_seq: u64,
    batches_seen: u64,
    drop_every: Option<u64>,
    restart_every: Option<u64>,
}

impl PublisherThread {
    fn run(mut self, commands: Receiver<Command>) {
        loop {
            match commands.recv_timeout(REPLAY_POLL_INTERVAL) {
                Ok(Command::Publish(batch)) => self.publish_batch(&batch),
                Ok(Command::Restart) => self.restart(),
                Ok(Command::Shutdown) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {}
            }
            self.serve_replay_requests();
        }
    }

    fn restart(&mut self) {
        self.next_seq = 0;
        self.buffer.clear();
    }

    fn publish_batch(&mut self, batch: &EventBatch) {
        let payload = encode_batch(batch, self.wire);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.batches_seen += 1;
        let dropped = self
            .drop_every
            .is_some_and(|every| self.batches_seen.is_multiple_of(every));
        if !dropped {
            let frames: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
            // PUB never blocks: like vLLM, a batch a slow subscriber cannot take is lost.
            let _ = self.publish.send_multipart(frames, zmq::DONTWAIT);
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
        if self
            .restart_every
            .is_some_and(|every| self.batches_seen.is_multiple_of(every))
        {
            self.restart();
        }
    }

    fn serve_replay_requests(&mut self) {
        let Some(replay) = &self.replay else {
            return;
        };
        while let Ok(frames) = replay.recv_multipart(zmq::DONTWAIT) {
            let [identity, delimiter, start] = frames.as_slice() else {
                continue; // Not a replay request: vLLM logs and ignores it.
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                continue;
            };
            let start_seq = u64::from_be_bytes(start);
            for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start_seq) {
                Self::send_replay(
                    replay,
                    self.wire,
                    identity,
                    delimiter,
                    &self.topic,
                    &seq.to_be_bytes(),
                    payload,
                );
            }
            Self::send_replay(
                replay,
                self.wire,
                identity,
                delimiter,
                &self.topic,
                &REPLAY_END_SEQ,
                &[],
            );
        }
    }

    /// One replay reply: `[identity, "", seq, payload]` up to vLLM 0.25, with the topic frame
    /// before the seq from 0.26.
    fn send_replay(
        replay: &zmq::Socket,
        wire: WireVersion,
        identity: &[u8],
        delimiter: &[u8],
        topic: &[u8],
        seq: &[u8],
        payload: &[u8],
    ) {
        let result = if wire.replay_has_topic() {
            replay.send_multipart([identity, delimiter, topic, seq, payload], 0)
        } else {
            replay.send_multipart([identity, delimiter, seq, payload], 0)
        };
        // A requester that went away is not an error for the publisher.
        let _ = result;
    }
}
