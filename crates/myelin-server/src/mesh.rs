//! Cross-core message passing: a full mesh of bounded glommio shared channels between the data
//! cores and the control core, plus a same-core one-shot reply slot.
//!
//! Index `0..shards` are data cores, index `shards` is the control core. Every ordered pair of
//! distinct cores has its own single-producer single-consumer channel, so no channel is ever
//! contended and nothing is locked.

use std::cell::RefCell;
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};

use glommio::channels::shared_channel::{
    self, ConnectedReceiver, ConnectedSender, SharedReceiver, SharedSender,
};

/// Messages a channel holds before `try_send` reports it full.
pub const CHANNEL_CAPACITY: usize = 4096;

/// The unconnected ends of one core's channels, moved into its executor thread.
pub struct MeshEnds<T: Send + 'static> {
    /// `senders[to]`, `None` for `to == me`.
    senders: Vec<Option<SharedSender<T>>>,
    /// `receivers[from]`, `None` for `from == me`.
    receivers: Vec<Option<SharedReceiver<T>>>,
}

/// Builds the ends for `cores` cores (data cores plus the control core).
pub fn build_mesh<T: Send + 'static>(cores: usize) -> Vec<MeshEnds<T>> {
    let mut ends: Vec<MeshEnds<T>> = (0..cores)
        .map(|_| MeshEnds {
            senders: (0..cores).map(|_| None).collect(),
            receivers: (0..cores).map(|_| None).collect(),
        })
        .collect();
    for from in 0..cores {
        for to in 0..cores {
            if from != to {
                let (sender, receiver) = shared_channel::new_bounded(CHANNEL_CAPACITY);
                ends[from].senders[to] = Some(sender);
                ends[to].receivers[from] = Some(receiver);
            }
        }
    }
    ends
}

/// One core's connected senders.
pub struct Mesh<T: Send + 'static> {
    senders: Vec<Option<ConnectedSender<T>>>,
}

/// Why a message was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    #[error("the receiving core's queue is full")]
    Full,
    #[error("the receiving core has stopped")]
    Closed,
    #[error("no such core")]
    NoSuchCore,
}

impl<T: Send + 'static> MeshEnds<T> {
    /// Connects every end on the current executor. All cores must connect concurrently (each
    /// connect waits for its peer), so the connects run as parallel tasks.
    pub async fn connect(self) -> (Mesh<T>, Vec<(usize, ConnectedReceiver<T>)>) {
        let sender_tasks: Vec<_> = self
            .senders
            .into_iter()
            .map(|sender| {
                glommio::spawn_local(async move {
                    match sender {
                        Some(sender) => Some(sender.connect().await),
                        None => None,
                    }
                })
            })
            .collect();
        let receiver_tasks: Vec<_> = self
            .receivers
            .into_iter()
            .enumerate()
            .filter_map(|(from, receiver)| receiver.map(|receiver| (from, receiver)))
            .map(|(from, receiver)| {
                glommio::spawn_local(async move { (from, receiver.connect().await) })
            })
            .collect();
        let mut senders = Vec::with_capacity(sender_tasks.len());
        for task in sender_tasks {
            senders.push(task.await);
        }
        let mut receivers = Vec::with_capacity(receiver_tasks.len());
        for task in receiver_tasks {
            receivers.push(task.await);
        }
        (Mesh { senders }, receivers)
    }
}

impl<T: Send + 'static> Mesh<T> {
    /// Sends without waiting; fails when the peer's queue is full or it stopped.
    pub fn try_send(&self, to: usize, message: T) -> Result<(), SendError> {
        let sender = self
            .senders
            .get(to)
            .and_then(Option::as_ref)
            .ok_or(SendError::NoSuchCore)?;
        sender.try_send(message).map_err(|error| match error {
            glommio::GlommioError::WouldBlock(_) => SendError::Full,
            _ => SendError::Closed,
        })
    }
}

/// A same-executor one-shot slot: the receiving half of a request/reply over the mesh.
pub struct OneShot<T> {
    inner: Rc<RefCell<(Option<T>, Option<Waker>)>>,
}

impl<T> Clone for OneShot<T> {
    fn clone(&self) -> Self {
        OneShot {
            inner: self.inner.clone(),
        }
    }
}

impl<T> Default for OneShot<T> {
    fn default() -> Self {
        OneShot {
            inner: Rc::new(RefCell::new((None, None))),
        }
    }
}

impl<T> OneShot<T> {
    /// Fills the slot and wakes the waiter.
    pub fn fill(&self, value: T) {
        let mut inner = self.inner.borrow_mut();
        inner.0 = Some(value);
        if let Some(waker) = inner.1.take() {
            waker.wake();
        }
    }

    /// Waits for the value.
    pub async fn wait(&self) -> T {
        poll_fn(|cx| {
            let mut inner = self.inner.borrow_mut();
            match inner.0.take() {
                Some(value) => Poll::Ready(value),
                None => {
                    inner.1 = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }
}
