//! Instant engines: OpenAI-shaped HTTP servers that answer every generation request at once
//! with a small fixed completion. No simulated GPU time, no tokenizer: whatever time a
//! request takes through them is the HTTP path and whatever sits in front of them.
//!
//! `count` engines listen on `count` loopback ports. One glommio executor per engine CPU
//! serves all of them, every executor listening on every port (SO_REUSEPORT), so the kernel
//! spreads connections over the engine CPUs and no single engine is bounded by one core when
//! a cache-aware router sends it everything.
//!
//! Routes: POST /v1/chat/completions and /v1/completions (JSON, or SSE when the body asks
//! for `"stream": true`), GET /v1/models, GET /health; anything else is 404 (so /metrics is).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use myelin_http::body::{Body, full};
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::server::{ServerConfig, Shutdown, serve};

use super::shapes::MODEL;

/// Completion tokens every answer reports (and the number of words in it).
pub const COMPLETION_TOKENS: u32 = 8;

/// How often an engine executor checks the stop flag.
const STOP_POLL: Duration = Duration::from_millis(20);

/// The fixed completion text.
const COMPLETION_TEXT: &str = "ok ok ok ok ok ok ok ok";

/// Running instant engines; stopped when dropped.
pub struct InstantEngines {
    ports: Vec<u16>,
    cpus: Vec<usize>,
    stop: Arc<AtomicBool>,
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
}

impl InstantEngines {
    /// Starts `count` engines served by one executor pinned to each of `cpus` (unpinned when
    /// `cpus` is empty: one executor).
    pub fn start(count: usize, cpus: &[usize]) -> std::io::Result<InstantEngines> {
        let count = count.max(1);
        let stop = Arc::new(AtomicBool::new(false));
        let slots: Vec<Option<usize>> = if cpus.is_empty() {
            vec![None]
        } else {
            cpus.iter().copied().map(Some).collect()
        };
        let mut engines = InstantEngines {
            ports: Vec::new(),
            cpus: cpus.to_vec(),
            stop: stop.clone(),
            handles: Vec::new(),
        };
        // The first executor binds ephemeral ports; the others join those ports.
        for (index, cpu) in slots.into_iter().enumerate() {
            let spec = match cpu {
                Some(cpu) => ExecutorSpec::pinned(format!("instant-engine-{cpu}"), cpu),
                None => ExecutorSpec::unpinned("instant-engine"),
            };
            let wanted: Vec<u16> = if index == 0 {
                vec![0; count]
            } else {
                engines.ports.clone()
            };
            let (bound_sender, bound) = std::sync::mpsc::channel();
            let stop = stop.clone();
            let handle = spawn_executor(spec, move || serve_ports(wanted, bound_sender, stop))?;
            engines.handles.push(handle);
            let ports = bound
                .recv_timeout(Duration::from_secs(10))
                .map_err(|_| std::io::Error::other("an instant engine did not start"))??;
            if index == 0 {
                engines.ports = ports;
            }
        }
        Ok(engines)
    }

    /// `http://127.0.0.1:PORT` of every engine.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|port| format!("http://127.0.0.1:{port}"))
            .collect()
    }

    /// The CPUs serving the engines (empty: unpinned).
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// Stops every engine and waits for its executor.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

impl Drop for InstantEngines {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One engine executor: binds `ports` (0 = ephemeral), reports the bound ports, serves them
/// all until `stop`.
async fn serve_ports(
    ports: Vec<u16>,
    bound: std::sync::mpsc::Sender<std::io::Result<Vec<u16>>>,
    stop: Arc<AtomicBool>,
) {
    let mut listeners = Vec::new();
    for port in ports {
        match glommio::net::TcpListener::bind(("127.0.0.1", port)) {
            Ok(listener) => listeners.push(listener),
            Err(error) => {
                let _ = bound.send(Err(std::io::Error::other(format!(
                    "binding an instant engine to 127.0.0.1:{port}: {error}"
                ))));
                return;
            }
        }
    }
    let addresses: std::io::Result<Vec<u16>> = listeners
        .iter()
        .map(|listener| {
            listener
                .local_addr()
                .map(|address| address.port())
                .map_err(std::io::Error::from)
        })
        .collect();
    let failed = addresses.is_err();
    let _ = bound.send(addresses);
    if failed {
        return;
    }
    let shutdown = Shutdown::new();
    shutdown.follow(stop, STOP_POLL);
    let config = ServerConfig {
        drain_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let servers: Vec<_> = listeners
        .into_iter()
        .map(|listener| {
            glommio::spawn_local(serve(listener, handle, config.clone(), shutdown.clone()))
        })
        .collect();
    for server in servers {
        server.await;
    }
}

fn respond(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    respond(status, "application/json", body)
}

async fn handle(request: Request<Incoming>) -> Response<Body> {
    let path = request.uri().path();
    let chat = match (request.method(), path) {
        (&Method::GET, "/health") => return json(StatusCode::OK, "{}".into()),
        (&Method::GET, "/v1/models") => {
            return json(
                StatusCode::OK,
                format!(
                    r#"{{"object":"list","data":[{{"id":"{MODEL}","object":"model","created":0,"owned_by":"myelin-bench"}}]}}"#
                ),
            );
        }
        (&Method::POST, "/v1/chat/completions") => true,
        (&Method::POST, "/v1/completions") => false,
        _ => {
            return json(
                StatusCode::NOT_FOUND,
                r#"{"error":{"message":"not found","type":"invalid_request_error"}}"#.into(),
            );
        }
    };
    let body = match request.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            return json(
                StatusCode::BAD_REQUEST,
                r#"{"error":{"message":"unreadable body","type":"invalid_request_error"}}"#.into(),
            );
        }
    };
    let prompt_tokens = rough_token_count(&body);
    if asks_for_stream(&body) {
        respond(
            StatusCode::OK,
            "text/event-stream",
            stream_body(chat, prompt_tokens),
        )
    } else {
        json(StatusCode::OK, completion_body(chat, prompt_tokens))
    }
}

/// A rough prompt token count: the spaces in the body plus one (the benchmark's prompts are
/// single-token words separated by spaces).
pub fn rough_token_count(body: &[u8]) -> u64 {
    body.iter().filter(|&&byte| byte == b' ').count() as u64 + 1
}

/// Whether a JSON body has `"stream": true` (a byte scan, not a parse: the engines must be
/// cheap; the benchmark's own bodies never hold the key inside a string).
pub fn asks_for_stream(body: &[u8]) -> bool {
    const KEY: &[u8] = b"\"stream\"";
    let mut rest = body;
    while let Some(found) = rest.windows(KEY.len()).position(|window| window == KEY) {
        let after = &rest[found + KEY.len()..];
        let after = trim_ascii_start(after);
        if let Some(value) = after.strip_prefix(b":") {
            return trim_ascii_start(value).starts_with(b"true");
        }
        rest = after;
    }
    false
}

fn trim_ascii_start(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|byte| !byte.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    &bytes[start..]
}

fn usage(prompt_tokens: u64) -> String {
    format!(
        r#"{{"prompt_tokens":{prompt_tokens},"completion_tokens":{COMPLETION_TOKENS},"total_tokens":{}}}"#,
        prompt_tokens + u64::from(COMPLETION_TOKENS)
    )
}

/// The non-streaming answer.
pub fn completion_body(chat: bool, prompt_tokens: u64) -> String {
    let usage = usage(prompt_tokens);
    if chat {
        format!(
            r#"{{"id":"chatcmpl-instant","object":"chat.completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant","content":"{COMPLETION_TEXT}"}},"finish_reason":"length"}}],"usage":{usage}}}"#
        )
    } else {
        format!(
            r#"{{"id":"cmpl-instant","object":"text_completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"text":"{COMPLETION_TEXT}","finish_reason":"length","logprobs":null}}],"usage":{usage}}}"#
        )
    }
}

/// The streaming answer, all at once: one content chunk, a final chunk with the finish
/// reason and usage, `[DONE]`.
pub fn stream_body(chat: bool, prompt_tokens: u64) -> String {
    let usage = usage(prompt_tokens);
    if chat {
        format!(
            "data: {{\"id\":\"chatcmpl-instant\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"{COMPLETION_TEXT}\"}},\"finish_reason\":null}}]}}\n\n\
             data: {{\"id\":\"chatcmpl-instant\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"length\"}}],\"usage\":{usage}}}\n\n\
             data: [DONE]\n\n"
        )
    } else {
        format!(
            "data: {{\"id\":\"cmpl-instant\",\"object\":\"text_completion\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"text\":\"{COMPLETION_TEXT}\",\"finish_reason\":null}}]}}\n\n\
             data: {{\"id\":\"cmpl-instant\",\"object\":\"text_completion\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}}],\"usage\":{usage}}}\n\n\
             data: [DONE]\n\n"
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::blocking_http;

    #[test]
    fn stream_flag_is_found_with_any_spacing() {
        assert!(asks_for_stream(br#"{"model":"m","stream":true}"#));
        assert!(asks_for_stream(br#"{"model":"m", "stream" :  true }"#));
        assert!(!asks_for_stream(br#"{"model":"m","stream":false}"#));
        assert!(!asks_for_stream(br#"{"model":"m"}"#));
        assert!(!asks_for_stream(br#"{"stream"}"#));
    }

    #[test]
    fn answers_are_valid_openai_json_with_usage() {
        for chat in [true, false] {
            let value: serde_json::Value =
                serde_json::from_str(&completion_body(chat, 2_000)).unwrap();
            assert_eq!(value["usage"]["prompt_tokens"], 2_000);
            assert_eq!(value["usage"]["completion_tokens"], COMPLETION_TOKENS);
            let choice = &value["choices"][0];
            let text = if chat {
                &choice["message"]["content"]
            } else {
                &choice["text"]
            };
            assert_eq!(text.as_str().unwrap().split(' ').count(), 8);
            let events: Vec<serde_json::Value> = stream_body(chat, 5)
                .split("\n\n")
                .filter_map(|event| event.strip_prefix("data: "))
                .filter(|data| *data != "[DONE]")
                .map(|data| serde_json::from_str(data).unwrap())
                .collect();
            assert_eq!(events.len(), 2);
            assert_eq!(events[1]["usage"]["prompt_tokens"], 5);
            assert!(stream_body(chat, 5).ends_with("data: [DONE]\n\n"));
        }
        assert_eq!(rough_token_count(b"a b c"), 3);
    }

    #[test]
    fn engines_serve_health_models_and_completions_on_every_port() {
        let engines = InstantEngines::start(2, &[]).unwrap();
        let urls = engines.urls();
        assert_eq!(urls.len(), 2);
        assert_ne!(urls[0], urls[1]);
        for url in &urls {
            let timeout = Duration::from_secs(5);
            let health = blocking_http::get(&format!("{url}/health"), timeout).unwrap();
            assert_eq!(health.status, 200);
            let models = blocking_http::get(&format!("{url}/v1/models"), timeout).unwrap();
            let models: serde_json::Value = serde_json::from_str(&models.body).unwrap();
            assert_eq!(models["data"][0]["id"], MODEL);
            let metrics = blocking_http::get(&format!("{url}/metrics"), timeout).unwrap();
            assert_eq!(metrics.status, 404);
        }
        engines.stop();
    }
}
