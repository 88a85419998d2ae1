//! A scriptable OpenAI-style engine on loopback for router tests: streams SSE chunk by chunk
//! (optionally one chunk per test-released gate), fails on demand, records what it saw and
//! whether the client went away mid-stream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use glommio::timer::Timer;
use http::{Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use myelin_http::body::{Body, channel, full};
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::server::{ServerConfig, Shutdown, serve};

/// What the engine does with generation requests.
#[derive(Clone, Debug)]
pub enum Behavior {
    /// Streams `chunks` SSE chunks `interval` apart, then `[DONE]`; JSON when not streaming.
    Normal { chunks: usize, interval: Duration },
    /// Streams one chunk each time the test calls [`Engine::release`], then `[DONE]`.
    Gated { chunks: usize },
    /// Answers every generation request with this status and an error body.
    Status(u16),
    /// Streams this many chunks, then breaks the connection.
    BreakAfter(usize),
    /// Accepts generation requests and never answers (no response head); health checks pass.
    Hang,
    /// Sends the head and this many chunks, then stays silent (until the client goes away,
    /// counted as a cancellation).
    StallAfter(usize),
}

/// What the engine saw and did (shared with the test thread).
#[derive(Default)]
pub struct EngineRecord {
    pub generation_requests: AtomicUsize,
    /// Generation requests held without an answer ([`Behavior::Hang`]).
    pub hung: AtomicUsize,
    /// `GET /metrics` answers 404 (an engine without a progress counter).
    pub no_metrics: AtomicBool,
    /// The `max_model_len` its `GET /v1/models` reports (0: as a broken engine would).
    pub max_model_len: AtomicUsize,
    pub streams_completed: AtomicUsize,
    /// Streams the client abandoned (the engine's send failed: its request was cancelled).
    pub streams_cancelled: AtomicUsize,
    pub last_authorization: Mutex<Option<String>>,
    pub last_custom_header: Mutex<Option<String>>,
    /// The W3C `traceparent` of the last generation request.
    pub last_traceparent: Mutex<Option<String>>,
    pub last_body: Mutex<Option<serde_json::Value>>,
    pub healthy: AtomicBool,
}

struct Shared {
    name: String,
    behavior: Mutex<Behavior>,
    record: Arc<EngineRecord>,
    gate: Mutex<mpsc::Receiver<()>>,
}

/// A running engine; stops when dropped.
pub struct Engine {
    pub addr: SocketAddr,
    pub record: Arc<EngineRecord>,
    shared: Arc<Shared>,
    gate: mpsc::Sender<()>,
    stop: Arc<AtomicBool>,
}

impl Engine {
    pub fn start(name: &str, behavior: Behavior) -> Engine {
        let record = Arc::new(EngineRecord::default());
        record.healthy.store(true, Ordering::SeqCst);
        let (gate, gate_receiver) = mpsc::channel();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            behavior: Mutex::new(behavior),
            record: record.clone(),
            gate: Mutex::new(gate_receiver),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (addr_sender, addr_receiver) = mpsc::channel();
        let engine_shared = shared.clone();
        let engine_stop = stop.clone();
        spawn_executor(
            ExecutorSpec::unpinned(format!("engine-{name}")),
            move || async move {
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").expect("bind engine");
                addr_sender
                    .send(listener.local_addr().expect("addr"))
                    .expect("report addr");
                let shutdown = Shutdown::new();
                shutdown.follow(engine_stop, Duration::from_millis(10));
                let config = ServerConfig {
                    drain_timeout: Duration::from_millis(50),
                    ..ServerConfig::default()
                };
                serve(
                    listener,
                    move |request| handle(engine_shared.clone(), request),
                    config,
                    shutdown,
                )
                .await;
            },
        )
        .expect("engine executor");
        let addr = addr_receiver
            .recv_timeout(Duration::from_secs(10))
            .expect("engine address");
        Engine {
            addr,
            record,
            shared,
            gate,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_behavior(&self, behavior: Behavior) {
        *self.shared.behavior.lock().unwrap() = behavior;
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.record.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Lets a gated stream send its next chunk.
    pub fn release(&self) {
        self.gate.send(()).expect("engine gate");
    }

    pub fn requests(&self) -> usize {
        self.record.generation_requests.load(Ordering::SeqCst)
    }

    pub fn cancelled(&self) -> usize {
        self.record.streams_cancelled.load(Ordering::SeqCst)
    }

    pub fn completed(&self) -> usize {
        self.record.streams_completed.load(Ordering::SeqCst)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A loopback URL where nothing listens (connection refused).
pub fn dead_backend_url() -> String {
    format!("http://{}", free_loopback_addr())
}

/// A loopback address nothing listens on now (the OS's pick of a free port), for a listener
/// a test starts there.
pub fn free_loopback_addr() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(value.to_string()))
        .expect("response")
}

pub fn chunk_event(name: &str, index: usize) -> String {
    let chunk = serde_json::json!({
        "id": format!("cmpl-{name}"),
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "test-model",
        "choices": [{"index": 0, "delta": {"content": format!("{name}-{index} ")}, "finish_reason": null}],
    });
    format!("data: {chunk}\n\n")
}

async fn handle(shared: Arc<Shared>, request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path().to_string();
    if request.method() == http::Method::GET {
        return match path.as_str() {
            "/health" if shared.record.healthy.load(Ordering::SeqCst) => {
                json(StatusCode::OK, serde_json::json!({}))
            }
            "/health" => json(StatusCode::SERVICE_UNAVAILABLE, serde_json::json!({})),
            // vLLM's progress counter: it moves with every answered request (a hung engine's
            // stands still).
            "/metrics" if !shared.record.no_metrics.load(Ordering::SeqCst) => {
                let generated = shared.record.generation_requests.load(Ordering::SeqCst)
                    - shared.record.hung.load(Ordering::SeqCst);
                let page = format!(
                    "# TYPE vllm:generation_tokens_total counter\n\
                     vllm:generation_tokens_total{{model_name=\"test-model\"}} {generated}.0\n"
                );
                Response::builder()
                    .status(StatusCode::OK)
                    .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
                    .body(full(page))
                    .expect("response")
            }
            "/v1/models" => json(
                StatusCode::OK,
                serde_json::json!({"object": "list", "data": [
                    {"id": "test-model", "object": "model", "owned_by": "test", "max_model_len": shared.record.max_model_len.load(Ordering::SeqCst)},
                    {"id": format!("model-{}", shared.name), "object": "model", "owned_by": "test"},
                ]}),
            ),
            _ => json(StatusCode::NOT_FOUND, serde_json::json!({})),
        };
    }
    let record = &shared.record;
    let header_text = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_string)
    };
    *record.last_authorization.lock().unwrap() = header_text("authorization");
    *record.last_custom_header.lock().unwrap() = header_text("x-custom");
    *record.last_traceparent.lock().unwrap() = header_text("traceparent");
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return json(StatusCode::BAD_REQUEST, serde_json::json!({})),
    };
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    record.generation_requests.fetch_add(1, Ordering::SeqCst);
    let stream = body.get("stream").and_then(serde_json::Value::as_bool) == Some(true);
    *record.last_body.lock().unwrap() = Some(body);
    let behavior = shared.behavior.lock().unwrap().clone();
    if let Behavior::Hang = behavior {
        record.hung.fetch_add(1, Ordering::SeqCst);
        // Bounded so a leaked connection cannot keep the test's executor alive forever.
        Timer::new(Duration::from_secs(120)).await;
        return json(StatusCode::INTERNAL_SERVER_ERROR, serde_json::json!({}));
    }
    if let Behavior::Status(status) = behavior {
        let status = StatusCode::from_u16(status).expect("status");
        return json(
            status,
            serde_json::json!({"error": {"message": format!("engine {} says {status}", shared.name), "type": "server_error", "param": null, "code": null}}),
        );
    }
    if !stream {
        let completion = serde_json::json!({
            "id": format!("cmpl-{}", shared.name),
            "object": "chat.completion",
            "created": 1,
            "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("hello from {}", shared.name)}, "text": format!("hello from {}", shared.name), "finish_reason": "stop", "logprobs": null}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        });
        record.streams_completed.fetch_add(1, Ordering::SeqCst);
        return json(StatusCode::OK, completion);
    }
    let (sender, body) = channel(1);
    let task_shared = shared.clone();
    glommio::spawn_local(async move {
        let name = task_shared.name.clone();
        let record = task_shared.record.clone();
        let (chunks, interval, gated, break_after, stall_after) = match behavior {
            Behavior::Normal { chunks, interval } => (chunks, interval, false, None, None),
            Behavior::Gated { chunks } => (chunks, Duration::ZERO, true, None, None),
            Behavior::BreakAfter(after) => (
                after + 10,
                Duration::from_millis(5),
                false,
                Some(after),
                None,
            ),
            Behavior::StallAfter(after) => (after + 10, Duration::ZERO, false, None, Some(after)),
            Behavior::Status(_) | Behavior::Hang => (0, Duration::ZERO, false, None, None),
        };
        for index in 0..chunks {
            if break_after == Some(index) {
                let _ = sender.abort("engine crashed mid-stream").await;
                return;
            }
            if stall_after == Some(index) {
                // Silent until the router drops the stream (bounded: 120 s).
                for _ in 0..12_000 {
                    if sender.is_closed() {
                        record.streams_cancelled.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    Timer::new(Duration::from_millis(10)).await;
                }
                return;
            }
            if gated {
                loop {
                    let released = task_shared.gate.lock().unwrap().try_recv();
                    match released {
                        Ok(()) => break,
                        Err(mpsc::TryRecvError::Empty) => {
                            if sender.is_closed() {
                                record.streams_cancelled.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                            Timer::new(Duration::from_millis(1)).await;
                        }
                        Err(mpsc::TryRecvError::Disconnected) => return,
                    }
                }
            } else if index > 0 {
                Timer::new(interval).await;
            }
            if sender
                .send(Bytes::from(chunk_event(&name, index)))
                .await
                .is_err()
            {
                record.streams_cancelled.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        if sender
            .send(Bytes::from_static(b"data: [DONE]\n\n"))
            .await
            .is_err()
        {
            record.streams_cancelled.fetch_add(1, Ordering::SeqCst);
            return;
        }
        record.streams_completed.fetch_add(1, Ordering::SeqCst);
    })
    .detach();
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("response")
}
