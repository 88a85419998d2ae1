//! The response body relayed from an engine to the client, frame by frame with no buffering.
//!
//! It reports the first byte (TTFT), the end of the stream, and how it ended to an observer.
//! A stream that breaks after its first byte ends with an SSE `error` event (for event streams)
//! instead of hanging; so does one whose engine stays silent longer than the idle timeout (the
//! engine's body is then dropped, which aborts its request). Dropping it before its end (the client went away) drops the engine's
//! body, which closes that upstream connection: the engine sees the disconnect and aborts.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use glommio::timer::Timer;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use myelin_http::BoxError;

/// How a relayed body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The engine's body ended normally.
    Complete,
    /// The engine's body failed mid-way.
    UpstreamBroken,
    /// The engine sent nothing for the idle timeout; its request was aborted.
    IdleTimeout,
    /// The router's drain deadline passed; the engine's request was aborted.
    Drained,
    /// The client stopped reading (disconnect) before the end.
    ClientGone,
}

/// Receives the relay's milestones. `finished` is called exactly once.
pub trait RelayObserver {
    fn first_byte(&mut self);
    fn finished(&mut self, end: StreamEnd);
    /// Whether to look for the response's `usage` (keeps the body's last bytes).
    fn wants_usage(&self) -> bool {
        false
    }
    /// The response's `usage`, when `wants_usage` and the body completed with one; called
    /// just before `finished(Complete)`.
    fn usage(&mut self, _usage: Usage) {}
    /// A frame of the body arrived (the engine is making progress).
    fn frame(&mut self) {}
}

/// The `usage` object of an OpenAI response (non-streaming body, or the final chunk of a
/// stream with `stream_options.include_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the engine served from its
    /// prefix cache (vLLM with `--enable-prompt-tokens-details`, SGLang, the simulator).
    pub cached_tokens: Option<u64>,
}

/// Bytes of the body's end kept to find its `usage` (it comes last: the last JSON fields of a
/// completion, or the last chunk of a stream).
const USAGE_TAIL_BYTES: usize = 8 * 1024;

impl Usage {
    /// The last `"usage": {...}` object in `tail`, if any.
    pub fn find(tail: &[u8]) -> Option<Usage> {
        const KEY: &[u8] = b"\"usage\"";
        let mut end = tail.len();
        while let Some(at) = tail[..end]
            .windows(KEY.len())
            .rposition(|window| window == KEY)
        {
            end = at;
            let rest = &tail[at + KEY.len()..];
            let rest = rest.trim_ascii_start();
            let Some(rest) = rest.strip_prefix(b":") else {
                continue;
            };
            let rest = rest.trim_ascii_start();
            if !rest.starts_with(b"{") {
                continue;
            }
            let mut values =
                serde_json::Deserializer::from_slice(rest).into_iter::<serde_json::Value>();
            let Some(Ok(value)) = values.next() else {
                continue;
            };
            return Some(Usage {
                prompt_tokens: value
                    .get("prompt_tokens")
                    .and_then(serde_json::Value::as_u64),
                cached_tokens: value
                    .get("prompt_tokens_details")
                    .and_then(|details| details.get("cached_tokens"))
                    .and_then(serde_json::Value::as_u64),
            });
        }
        None
    }
}

/// The relaying body.
pub struct RelayBody<O: RelayObserver> {
    upstream: Option<Incoming>,
    is_event_stream: bool,
    saw_first_byte: bool,
    observer: Option<O>,
    /// The idle timeout and its timer (re-armed on every frame).
    idle: Option<(Duration, Timer)>,
    /// Resolves when the relay must end now (the drain deadline).
    cut_off: Option<Pin<Box<dyn Future<Output = ()>>>>,
    /// The body's last bytes, when the observer wants the `usage`.
    tail: Option<Vec<u8>>,
}

impl<O: RelayObserver> RelayBody<O> {
    pub fn new(upstream: Incoming, is_event_stream: bool, observer: O) -> Self {
        let tail = observer.wants_usage().then(Vec::new);
        RelayBody {
            upstream: Some(upstream),
            is_event_stream,
            saw_first_byte: false,
            observer: Some(observer),
            idle: None,
            cut_off: None,
            tail,
        }
    }

    /// Keeps the last [`USAGE_TAIL_BYTES`] (at most twice that between trims).
    fn keep_tail(&mut self, data: &[u8]) {
        if let Some(tail) = self.tail.as_mut() {
            tail.extend_from_slice(data);
            if tail.len() > 2 * USAGE_TAIL_BYTES {
                tail.drain(..tail.len() - USAGE_TAIL_BYTES);
            }
        }
    }

    /// The body completed: hands the observer its `usage`, then finishes.
    fn complete(&mut self) {
        if let Some(tail) = self.tail.take()
            && let Some(usage) = Usage::find(&tail)
            && let Some(observer) = self.observer.as_mut()
        {
            observer.usage(usage);
        }
        self.finish(StreamEnd::Complete);
    }

    /// Ends the relay (SSE error event, engine request aborted) once `cut_off` resolves.
    pub fn with_cut_off(mut self, cut_off: Pin<Box<dyn Future<Output = ()>>>) -> Self {
        self.cut_off = Some(cut_off);
        self
    }

    /// Drops the engine's body (closing its connection: the engine aborts) and returns the
    /// relay's last frame: an SSE error event, or an error for other bodies.
    fn end_early(
        &mut self,
        end: StreamEnd,
        message: &str,
        code: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.upstream = None;
        self.idle = None;
        self.cut_off = None;
        self.finish(end);
        if self.is_event_stream {
            Poll::Ready(Some(Ok(Frame::data(sse_error_event_with_code(
                message, code,
            )))))
        } else {
            Poll::Ready(Some(Err(message.to_string().into())))
        }
    }

    /// Ends the relay when the engine sends nothing for `timeout` (before its first frame or
    /// between two). Must be called on a glommio executor.
    pub fn with_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle = Some((timeout, Timer::new(timeout)));
        self
    }

    fn finish(&mut self, end: StreamEnd) {
        if let Some(mut observer) = self.observer.take() {
            observer.finished(end);
        }
    }
}

/// The SSE event that ends a broken stream, in OpenAI's error shape.
pub fn sse_error_event(message: &str) -> Bytes {
    sse_error_event_with_code(message, "upstream_stream_error")
}

/// An SSE `error` event in OpenAI's error shape with this `code`.
pub fn sse_error_event_with_code(message: &str, code: &str) -> Bytes {
    let body = serde_json::json!({
        "error": {
            "message": message,
            "type": "server_error",
            "param": null,
            "code": code,
        }
    });
    Bytes::from(format!("event: error\ndata: {body}\n\n"))
}

impl<O: RelayObserver + Unpin> HttpBody for RelayBody<O> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.upstream.is_none() {
            return Poll::Ready(None);
        }
        if let Some(cut_off) = this.cut_off.as_mut()
            && cut_off.as_mut().poll(cx).is_ready()
        {
            return this.end_early(
                StreamEnd::Drained,
                "the router is shutting down (--drain-timeout-ms passed)",
                "router_draining",
            );
        }
        let Some(upstream) = this.upstream.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(upstream).poll_frame(cx) {
            Poll::Pending => {
                let Some((timeout, timer)) = this.idle.as_mut() else {
                    return Poll::Pending;
                };
                if Pin::new(timer).poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let message = format!(
                    "the engine sent nothing for {} ms (--stream-idle-timeout-ms)",
                    timeout.as_millis()
                );
                this.end_early(StreamEnd::IdleTimeout, &message, "upstream_timeout")
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some((timeout, timer)) = this.idle.as_mut() {
                    timer.reset(*timeout);
                }
                if let Some(observer) = this.observer.as_mut() {
                    observer.frame();
                }
                if let Some(data) = frame.data_ref() {
                    this.keep_tail(data);
                }
                if !this.saw_first_byte && frame.data_ref().is_some_and(|data| !data.is_empty()) {
                    this.saw_first_byte = true;
                    if let Some(observer) = this.observer.as_mut() {
                        observer.first_byte();
                    }
                }
                // A body with a known length is complete after its last byte; hyper may never
                // poll again, so finish now.
                if this.upstream.as_ref().is_some_and(HttpBody::is_end_stream) {
                    this.upstream = None;
                    this.complete();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.upstream = None;
                this.complete();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(error))) => {
                this.upstream = None;
                this.finish(StreamEnd::UpstreamBroken);
                if this.is_event_stream {
                    let event = sse_error_event(&format!("the engine's stream broke: {error}"));
                    Poll::Ready(Some(Ok(Frame::data(event))))
                } else {
                    Poll::Ready(Some(Err(Box::new(error))))
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.upstream.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.upstream {
            Some(upstream) => upstream.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}

impl<O: RelayObserver> Drop for RelayBody<O> {
    fn drop(&mut self) {
        // Still holding the upstream body means the end was never reached.
        if self.upstream.take().is_some() {
            self.finish(StreamEnd::ClientGone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Usage;

    #[test]
    fn usage_of_a_completion_and_of_a_stream() {
        let body = br#"{"id":"x","choices":[{"text":"usage"}],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        assert_eq!(
            Usage::find(body),
            Some(Usage {
                prompt_tokens: Some(40),
                cached_tokens: Some(32)
            })
        );
        let stream = b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\": {\"prompt_tokens\":7,\"completion_tokens\":1}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(
            Usage::find(stream),
            Some(Usage {
                prompt_tokens: Some(7),
                cached_tokens: None
            })
        );
        assert_eq!(Usage::find(b"data: {\"usage\":null}\n\n"), None);
        assert_eq!(Usage::find(b"{\"usage\":{\"prompt_tok"), None);
        assert_eq!(Usage::find(b""), None);
    }
}
