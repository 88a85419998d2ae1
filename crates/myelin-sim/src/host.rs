//! The I/O shell around one [`EngineModel`]: its state shared with the embedding API
//! ([`EngineShared`], behind a mutex only the engine's own executor and oracle probes take), and
//! its executor-local side ([`LocalEngine`]): the step loop that sleeps each step's time on a
//! glommio timer, request submission and per-request output channels.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_lite::future::or;
use glommio::timer::Timer;
use myelin_http::server::Shutdown;
use myelin_kv_events::EventBatch;

use crate::engine::{AddRequestError, EngineModel, RequestId, RequestOutput, RequestSpec};
use crate::faults::FaultConfig;
use crate::publisher::KvPublisher;
use crate::text::TextModel;

/// How this engine publishes KV events, for `GET /kv_event_sources`.
#[derive(Clone, Debug)]
pub struct KvEventSource {
    /// Bound PUB endpoint.
    pub endpoint: String,
    /// Bound replay endpoint.
    pub replay_endpoint: Option<String>,
    /// Topic.
    pub topic: String,
    /// Replay buffer size.
    pub buffer_steps: usize,
    /// Wire layout (the endpoint exists from vLLM 0.31, so 0.22 engines do not serve it).
    pub wire: myelin_kv_events::WireVersion,
}

/// Everything about one engine besides its model.
#[derive(Debug)]
pub struct EngineSettings {
    /// Engine index in its cluster.
    pub index: usize,
    /// Served model name.
    pub model_name: String,
    /// LoRA adapters served besides it.
    pub lora_adapters: Vec<String>,
    /// Time divisor.
    pub speedup: f64,
    /// Faults to inject.
    pub faults: FaultConfig,
    /// The KV-event publisher, when enabled.
    pub publisher: Option<KvPublisher>,
    /// Its configuration for `GET /kv_event_sources`.
    pub kv_source: Option<KvEventSource>,
    /// Tokenizer, template, output vocabulary.
    pub text: Arc<TextModel>,
}

/// Engine state reachable from any thread.
#[derive(Debug)]
pub struct EngineShared {
    /// Engine index in its cluster.
    pub index: usize,
    /// Served model name.
    pub model_name: String,
    /// LoRA adapters served besides it.
    pub lora_adapters: Vec<String>,
    /// Time divisor.
    pub speedup: f64,
    /// Faults to inject.
    pub faults: FaultConfig,
    /// The KV-event publisher, when enabled.
    pub publisher: Option<KvPublisher>,
    /// Its configuration as `GET /kv_event_sources` reports it.
    pub kv_source: Option<KvEventSource>,
    /// Tokenizer, template, output vocabulary.
    pub text: Arc<TextModel>,
    /// Generation requests received (fault counting).
    pub generation_requests: AtomicU64,
    /// Process start, for `created` fields.
    pub created_unix_seconds: u64,
    model: Mutex<EngineModel>,
}

impl EngineShared {
    /// Wraps a model with its engine's settings.
    pub fn new(model: EngineModel, settings: EngineSettings) -> Self {
        EngineShared {
            index: settings.index,
            model_name: settings.model_name,
            lora_adapters: settings.lora_adapters,
            speedup: settings.speedup,
            faults: settings.faults,
            publisher: settings.publisher,
            kv_source: settings.kv_source,
            text: settings.text,
            generation_requests: AtomicU64::new(0),
            created_unix_seconds: unix_seconds(),
            model: Mutex::new(model),
        }
    }

    /// Locks the model. A panic while holding the lock cannot leave the model half-updated in
    /// a way that matters more than stopping would, so a poisoned lock is recovered.
    pub fn model(&self) -> MutexGuard<'_, EngineModel> {
        self.model
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Publishes the model's pending KV events as one batch (only non-empty batches).
    pub fn flush_events(&self, model: &mut EngineModel) {
        let events = model.take_events();
        if events.is_empty() {
            return;
        }
        if let Some(publisher) = &self.publisher {
            publisher.publish(EventBatch {
                ts: unix_seconds_f64(),
                events,
                data_parallel_rank: Some(0),
            });
        }
    }

    /// Counts a generation request; returns its 1-based number.
    pub fn count_generation_request(&self) -> u64 {
        self.generation_requests.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// UNIX time in whole seconds.
pub fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

fn unix_seconds_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// A same-executor wake-up flag for the step loop (no lost wake-ups: a notify before the wait
/// makes the next wait return at once).
#[derive(Default)]
struct Notify {
    notified: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Notify {
    fn notify(&self) {
        self.notified.set(true);
        if let Some(waker) = self.waker.borrow_mut().take() {
            waker.wake();
        }
    }

    async fn wait(&self) {
        poll_fn(|cx| {
            if self.notified.replace(false) {
                Poll::Ready(())
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

/// An output routed to a response: which choice of the response it belongs to.
pub type ChoiceOutput = (usize, RequestOutput);

struct OutputQueueState {
    queue: VecDeque<ChoiceOutput>,
    senders: usize,
    waker: Option<Waker>,
}

/// The engine's end of a response's output queue (one per request of the response).
pub struct OutputSender {
    state: Rc<RefCell<OutputQueueState>>,
}

/// The response's end: yields outputs in order, `None` once every sender is gone and the
/// queue is drained (the engine stopped).
pub struct OutputReceiver {
    state: Rc<RefCell<OutputQueueState>>,
}

/// A same-executor unbounded queue from the step loop to one response.
pub fn output_queue() -> (OutputSender, OutputReceiver) {
    let state = Rc::new(RefCell::new(OutputQueueState {
        queue: VecDeque::new(),
        senders: 1,
        waker: None,
    }));
    (
        OutputSender {
            state: state.clone(),
        },
        OutputReceiver { state },
    )
}

impl OutputSender {
    fn send(&self, item: ChoiceOutput) {
        let mut state = self.state.borrow_mut();
        state.queue.push_back(item);
        if let Some(waker) = state.waker.take() {
            waker.wake();
        }
    }
}

impl Clone for OutputSender {
    fn clone(&self) -> Self {
        self.state.borrow_mut().senders += 1;
        OutputSender {
            state: self.state.clone(),
        }
    }
}

impl Drop for OutputSender {
    fn drop(&mut self) {
        let mut state = self.state.borrow_mut();
        state.senders -= 1;
        if state.senders == 0
            && let Some(waker) = state.waker.take()
        {
            waker.wake();
        }
    }
}

impl OutputReceiver {
    /// The next output.
    pub async fn recv(&self) -> Option<ChoiceOutput> {
        poll_fn(|cx| {
            let mut state = self.state.borrow_mut();
            if let Some(item) = state.queue.pop_front() {
                return Poll::Ready(Some(item));
            }
            if state.senders == 0 {
                return Poll::Ready(None);
            }
            state.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// The executor-local side of one engine.
pub struct LocalEngine {
    /// Shared state.
    pub shared: Arc<EngineShared>,
    wake: Notify,
    streams: RefCell<HashMap<RequestId, (usize, OutputSender)>>,
    next_request_id: Cell<RequestId>,
}

impl LocalEngine {
    /// The local side of `shared`.
    pub fn new(shared: Arc<EngineShared>) -> Rc<Self> {
        Rc::new(LocalEngine {
            shared,
            wake: Notify::default(),
            streams: RefCell::new(HashMap::new()),
            next_request_id: Cell::new(1),
        })
    }

    /// Queues a request whose outputs go to `sink` tagged with `choice`.
    pub fn submit(
        &self,
        spec: RequestSpec,
        choice: usize,
        sink: OutputSender,
    ) -> Result<RequestId, AddRequestError> {
        let id = self.next_request_id.get();
        self.next_request_id.set(id + 1);
        self.shared.model().add_request(id, spec)?;
        self.streams.borrow_mut().insert(id, (choice, sink));
        self.wake.notify();
        Ok(id)
    }

    /// Aborts a request (no-op when it already finished) and frees its blocks.
    pub fn abort(&self, id: RequestId) {
        self.streams.borrow_mut().remove(&id);
        if self.shared.model().abort(id) {
            // Freed blocks may let a blocked waiting request in.
            self.wake.notify();
        }
    }

    /// The step loop: schedule, sleep the step time (divided by the speedup), complete, publish
    /// the step's KV events, deliver outputs. Sleeps until woken when idle. Ends on `shutdown`.
    pub async fn run(self: Rc<Self>, shutdown: Shutdown) {
        let speedup = if self.shared.speedup > 0.0 {
            self.shared.speedup
        } else {
            1.0
        };
        while !shutdown.is_triggered() {
            let started = Instant::now();
            let step = self.shared.model().schedule();
            let Some(step) = step else {
                {
                    let mut model = self.shared.model();
                    self.shared.flush_events(&mut model);
                }
                or(self.wake.wait(), shutdown.wait()).await;
                continue;
            };
            let deadline = started + step.step_time.div_f64(speedup);
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining > Duration::ZERO {
                or(
                    async {
                        Timer::new(remaining).await;
                    },
                    shutdown.wait(),
                )
                .await;
            }
            let outputs = {
                let mut model = self.shared.model();
                let outputs = model.complete_step(&step);
                self.shared.flush_events(&mut model);
                outputs
            };
            let mut streams = self.streams.borrow_mut();
            for output in outputs {
                let id = output.request_id;
                let finished = output.finished.is_some();
                if let Some((choice, sink)) = streams.get(&id) {
                    sink.send((*choice, output));
                }
                if finished {
                    streams.remove(&id);
                }
            }
        }
        // Dropping the senders ends every response still waiting for output.
        self.streams.borrow_mut().clear();
    }
}

/// Aborts a request when dropped: a response future dropped by a client disconnect frees the
/// request's blocks. Harmless after the request finished.
pub struct AbortOnDrop {
    engine: Rc<LocalEngine>,
    request_ids: Vec<RequestId>,
}

impl AbortOnDrop {
    /// Guards `request_ids` on `engine`.
    pub fn new(engine: Rc<LocalEngine>, request_ids: Vec<RequestId>) -> Self {
        AbortOnDrop {
            engine,
            request_ids,
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for &id in &self.request_ids {
            self.engine.abort(id);
        }
    }
}
