//! Response and request bodies: one boxed body type for everything myelin sends, constructors
//! for whole bodies, and a bounded same-thread channel for bodies produced over time (SSE).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;

/// Errors carried inside bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The one body type: boxed and `!Send`, since bodies never leave their executor (and may hold
/// `Rc`s, like the channel body below).
pub struct Body {
    inner: Pin<Box<dyn http_body::Body<Data = Bytes, Error = BoxError>>>,
}

impl Body {
    /// Boxes any body whose errors convert into `BoxError` (e.g. hyper's `Incoming`).
    pub fn new<B>(body: B) -> Self
    where
        B: http_body::Body<Data = Bytes> + 'static,
        B::Error: Into<BoxError>,
    {
        Self {
            inner: Box::pin(body.map_err(Into::into)),
        }
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body").finish_non_exhaustive()
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.inner.as_mut().poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A whole body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Body::new(http_body_util::Full::new(bytes.into()))
}

/// An empty body.
pub fn empty() -> Body {
    Body::new(http_body_util::Empty::<Bytes>::new())
}

/// The receiving side of the body channel went away (the client disconnected).
#[derive(Debug, thiserror::Error)]
#[error("body receiver dropped")]
pub struct ReceiverGone;

struct ChannelState {
    queue: VecDeque<Result<Bytes, BoxError>>,
    capacity: usize,
    sender_alive: bool,
    receiver_alive: bool,
    receiver_waker: Option<Waker>,
    sender_waker: Option<Waker>,
}

/// Produces a body chunk by chunk; waits while `capacity` chunks are queued (backpressure).
pub struct BodySender {
    state: Rc<RefCell<ChannelState>>,
}

/// A body fed by a [`BodySender`]; ends when the sender is dropped.
struct ChannelBody {
    state: Rc<RefCell<ChannelState>>,
}

/// A streaming body and its sender. The sender learns that the client went away when a send
/// fails with [`ReceiverGone`] or [`BodySender::is_closed`] turns true.
pub fn channel(capacity: usize) -> (BodySender, Body) {
    let state = Rc::new(RefCell::new(ChannelState {
        queue: VecDeque::new(),
        capacity: capacity.max(1),
        sender_alive: true,
        receiver_alive: true,
        receiver_waker: None,
        sender_waker: None,
    }));
    let body = ChannelBody {
        state: state.clone(),
    };
    (BodySender { state }, Body::new(body))
}

impl BodySender {
    /// Queues a chunk, waiting while the queue is full.
    pub async fn send(&self, chunk: impl Into<Bytes>) -> Result<(), ReceiverGone> {
        self.push(Ok(chunk.into())).await
    }

    /// Ends the body with an error (the client sees a broken stream).
    pub async fn abort(&self, error: impl Into<BoxError>) -> Result<(), ReceiverGone> {
        self.push(Err(error.into())).await
    }

    /// True once the receiving body was dropped.
    pub fn is_closed(&self) -> bool {
        !self.state.borrow().receiver_alive
    }

    /// Resolves when the receiving body is dropped (the client went away).
    pub async fn closed(&self) {
        poll_fn(|cx| {
            let mut state = self.state.borrow_mut();
            if !state.receiver_alive {
                return Poll::Ready(());
            }
            state.sender_waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    async fn push(&self, item: Result<Bytes, BoxError>) -> Result<(), ReceiverGone> {
        let mut item = Some(item);
        poll_fn(|cx| {
            let mut state = self.state.borrow_mut();
            if !state.receiver_alive {
                return Poll::Ready(Err(ReceiverGone));
            }
            if state.queue.len() >= state.capacity {
                state.sender_waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            if let Some(item) = item.take() {
                state.queue.push_back(item);
            }
            if let Some(waker) = state.receiver_waker.take() {
                waker.wake();
            }
            Poll::Ready(Ok(()))
        })
        .await
    }
}

impl Drop for BodySender {
    fn drop(&mut self) {
        let mut state = self.state.borrow_mut();
        state.sender_alive = false;
        if let Some(waker) = state.receiver_waker.take() {
            waker.wake();
        }
    }
}

impl Drop for ChannelBody {
    fn drop(&mut self) {
        let mut state = self.state.borrow_mut();
        state.receiver_alive = false;
        state.queue.clear();
        if let Some(waker) = state.sender_waker.take() {
            waker.wake();
        }
    }
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut state = self.state.borrow_mut();
        if let Some(item) = state.queue.pop_front() {
            if let Some(waker) = state.sender_waker.take() {
                waker.wake();
            }
            return Poll::Ready(Some(item.map(Frame::data)));
        }
        if !state.sender_alive {
            return Poll::Ready(None);
        }
        state.receiver_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_delivers_in_order_then_ends() {
        glommio::LocalExecutorBuilder::default()
            .io_memory(crate::executor::DEFAULT_IO_MEMORY_BYTES)
            .make()
            .expect("executor")
            .run(async {
                let (sender, body) = channel(2);
                let producer = glommio::spawn_local(async move {
                    for chunk in ["a", "b", "c", "d"] {
                        sender.send(chunk).await.expect("receiver alive");
                    }
                });
                let collected = body.collect().await.expect("body").to_bytes();
                producer.await;
                assert_eq!(&collected[..], b"abcd");
            });
    }

    #[test]
    fn sender_learns_receiver_dropped() {
        glommio::LocalExecutorBuilder::default()
            .io_memory(crate::executor::DEFAULT_IO_MEMORY_BYTES)
            .make()
            .expect("executor")
            .run(async {
                let (sender, body) = channel(1);
                sender.send("x").await.expect("room for one");
                assert!(!sender.is_closed());
                drop(body);
                assert!(sender.is_closed());
                assert!(sender.send("y").await.is_err());
                sender.closed().await;
            });
    }
}
