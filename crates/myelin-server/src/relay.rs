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
}

impl<O: RelayObserver> RelayBody<O> {
    pub fn new(upstream: Incoming, is_event_stream: bool, observer: O) -> Self {
        RelayBody {
            upstream: Some(upstream),
            is_event_stream,
            saw_first_byte: false,
            observer: Some(observer),
            idle: None,
            cut_off: None,
        }
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
                    this.finish(StreamEnd::Complete);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.upstream = None;
                this.finish(StreamEnd::Complete);
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
