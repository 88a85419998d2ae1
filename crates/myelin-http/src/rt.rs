//! hyper runtime glue for glommio: an executor that spawns onto the current glommio executor,
//! and a timer backed by glommio's timers.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::rt::{Executor, Sleep, Timer};

/// Spawns hyper's background tasks (HTTP/2 streams, client connections) on the current glommio
/// executor.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExec;

impl<F> Executor<F> for LocalExec
where
    F: Future + 'static,
{
    fn execute(&self, future: F) {
        glommio::spawn_local(future).detach();
    }
}

/// hyper's `Timer` on glommio's timers (header-read timeouts, HTTP/2 keep-alive).
#[derive(Clone, Copy, Debug, Default)]
pub struct GlommioTimer;

impl Timer for GlommioTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        Box::pin(LocalSleep {
            timer: glommio::timer::Timer::new(duration),
        })
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        self.sleep(deadline.saturating_duration_since(Instant::now()))
    }
}

/// A glommio timer wearing hyper's `Sleep` bounds.
struct LocalSleep {
    timer: glommio::timer::Timer,
}

// SAFETY: hyper asks for `Send + Sync` sleeps because its connections may be `Send`. Ours never
// are: every connection that owns one of these wraps a glommio socket, which is `!Send`, so the
// sleep is created, polled and dropped on the executor thread that made it, and never shared.
unsafe impl Send for LocalSleep {}
unsafe impl Sync for LocalSleep {}

impl Sleep for LocalSleep {}

impl Future for LocalSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.timer).poll(cx).map(|_| ())
    }
}

/// Runs `future` for at most `duration` on the current glommio executor: `None` if the time
/// ran out first (the future is then dropped, which cancels it).
pub async fn timeout<T>(duration: Duration, future: impl Future<Output = T>) -> Option<T> {
    futures_lite::future::or(async { Some(future.await) }, async {
        glommio::timer::Timer::new(duration).await;
        None
    })
    .await
}
