//! The HTTP server loop: accepts on a glommio listener, sniffs HTTP/1.1 vs h2c (prior
//! knowledge), serves each connection with hyper, and drains gracefully on shutdown. It knows
//! nothing of routes: the handler does.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::io;
use std::pin::{Pin, pin};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures_lite::future::or;
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite};
use glommio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use glommio::timer::Timer;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};

use crate::body::Body;
use crate::io::{ErrorBodies, GlommioIo, Rewind};
use crate::rt::{GlommioTimer, LocalExec};

/// The HTTP/2 connection preface a prior-knowledge h2c client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(20);

/// Server tuning.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Time a client has to send a request head (and the protocol preface); slowloris guard.
    pub header_read_timeout: Duration,
    /// Accept h2c with prior knowledge besides HTTP/1.1.
    pub http2: bool,
    /// How long a graceful shutdown waits for open connections before giving up on them.
    pub drain_timeout: Duration,
    /// Body of hyper's own answers to unparsable HTTP/1 requests (400, 414, 431), which are
    /// otherwise empty (see [`crate::io::ErrorBodies`]).
    pub error_bodies: Option<crate::io::ErrorBodyRenderer>,
    /// Connections this loop keeps open at once; one accepted past it is closed at once
    /// (counted in [`ServeReport::refused`] and passed to `on_refused`).
    pub max_connections: usize,
    /// Called for each connection closed because `max_connections` were open.
    pub on_refused: Option<fn()>,
    /// Streams one h2 connection may have open at once (hyper's default is 200).
    pub h2_max_concurrent_streams: u32,
    /// An h2 connection with no stream open for this long is closed (HTTP/1 keep-alive
    /// connections get `header_read_timeout` for their next request head).
    pub h2_idle_timeout: Duration,
    /// Serve HTTPS: every connection's TLS handshake must finish within
    /// `header_read_timeout`; ALPN offers what [`crate::tls::ServerTls::load`] was told.
    pub tls: Option<crate::tls::ServerTls>,
    /// Called for each TLS event of this loop (a certificate reload, a failed handshake).
    pub on_tls: Option<fn(crate::tls::TlsEvent)>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(30),
            http2: true,
            drain_timeout: Duration::from_secs(30),
            error_bodies: None,
            max_connections: 8_192,
            on_refused: None,
            h2_max_concurrent_streams: 64,
            h2_idle_timeout: Duration::from_secs(30),
            tls: None,
            on_tls: None,
        }
    }
}

/// What one `serve` loop did before it returned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeReport {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections still open when the drain deadline passed (0 after a clean drain).
    pub abandoned: usize,
    /// Connections closed on accept because `max_connections` were open.
    pub refused: u64,
}

/// A same-executor shutdown signal: cheap to clone, awaited by accept loops and connections.
#[derive(Clone, Default)]
pub struct Shutdown {
    inner: Rc<ShutdownInner>,
}

#[derive(Default)]
struct ShutdownInner {
    triggered: Cell<bool>,
    waiters: RefCell<Waiters>,
}

/// Wakers of pending [`ShutdownWait`]s, one slot each; a slot is freed when its future is
/// dropped, so code that races `wait()` against other work in a loop does not pile up wakers
/// (each one holds a task reference, and glommio panics when a task's count overflows).
#[derive(Default)]
struct Waiters {
    slots: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Waiters {
    fn register(&mut self, slot: &mut Option<usize>, waker: &Waker) {
        match *slot {
            Some(index) => match &mut self.slots[index] {
                Some(existing) if existing.will_wake(waker) => {}
                entry => *entry = Some(waker.clone()),
            },
            None => {
                let index = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(None);
                    self.slots.len() - 1
                });
                self.slots[index] = Some(waker.clone());
                *slot = Some(index);
            }
        }
    }

    fn release(&mut self, slot: &mut Option<usize>) {
        if let Some(index) = slot.take() {
            self.slots[index] = None;
            self.free.push(index);
        }
    }
}

/// Resolves once its [`Shutdown`] is triggered.
pub struct ShutdownWait<'a> {
    shutdown: &'a Shutdown,
    slot: Option<usize>,
}

impl Future for ShutdownWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let inner = &this.shutdown.inner;
        let mut waiters = inner.waiters.borrow_mut();
        if inner.triggered.get() {
            waiters.release(&mut this.slot);
            Poll::Ready(())
        } else {
            waiters.register(&mut this.slot, cx.waker());
            Poll::Pending
        }
    }
}

impl Drop for ShutdownWait<'_> {
    fn drop(&mut self) {
        if let Ok(mut waiters) = self.shutdown.inner.waiters.try_borrow_mut() {
            waiters.release(&mut self.slot);
        }
    }
}

impl Shutdown {
    /// A signal not yet triggered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Triggers the signal; every waiter wakes.
    pub fn trigger(&self) {
        self.inner.triggered.set(true);
        let wakers: Vec<Waker> = self
            .inner
            .waiters
            .borrow_mut()
            .slots
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        for waker in wakers {
            waker.wake();
        }
    }

    /// True once triggered.
    pub fn is_triggered(&self) -> bool {
        self.inner.triggered.get()
    }

    /// Resolves once triggered.
    pub fn wait(&self) -> ShutdownWait<'_> {
        ShutdownWait {
            shutdown: self,
            slot: None,
        }
    }

    /// Triggers this signal when `flag` (set from another thread, e.g. a signal handler) turns
    /// true; checks every `interval`. Must be called on a glommio executor.
    pub fn follow(&self, flag: Arc<AtomicBool>, interval: Duration) {
        let this = self.clone();
        glommio::spawn_local(async move {
            while !flag.load(Ordering::Acquire) && !this.is_triggered() {
                Timer::new(interval).await;
            }
            this.trigger();
        })
        .detach();
    }
}

/// Counts open connections so a drain can wait for them.
#[derive(Clone, Default)]
struct OpenConnections {
    inner: Rc<(Cell<usize>, RefCell<Option<Waker>>)>,
}

impl OpenConnections {
    fn enter(&self) -> ConnectionGuard {
        self.inner.0.set(self.inner.0.get() + 1);
        ConnectionGuard { open: self.clone() }
    }

    fn count(&self) -> usize {
        self.inner.0.get()
    }

    async fn all_closed(&self) {
        poll_fn(|cx| {
            if self.inner.0.get() == 0 {
                Poll::Ready(())
            } else {
                *self.inner.1.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

struct ConnectionGuard {
    open: OpenConnections,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        let remaining = self.open.inner.0.get() - 1;
        self.open.inner.0.set(remaining);
        if remaining == 0
            && let Some(waker) = self.open.inner.1.borrow_mut().take()
        {
            waker.wake();
        }
    }
}

/// A listening socket [`serve`] accepts connections on: TCP, or a Unix stream socket.
pub trait Listener {
    /// An accepted connection.
    type Stream: AsyncRead + AsyncWrite + Unpin + 'static;

    /// Waits for the next connection.
    fn accept(&self) -> impl Future<Output = io::Result<Self::Stream>>;

    /// Readies an accepted connection (TCP: no Nagle delay).
    fn prepare(stream: &mut Self::Stream) -> io::Result<()>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;

    async fn accept(&self) -> io::Result<TcpStream> {
        Ok(TcpListener::accept(self).await?)
    }

    fn prepare(stream: &mut TcpStream) -> io::Result<()> {
        Ok(stream.set_nodelay(true)?)
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;

    async fn accept(&self) -> io::Result<UnixStream> {
        Ok(UnixListener::accept(self).await?)
    }

    fn prepare(_stream: &mut UnixStream) -> io::Result<()> {
        Ok(())
    }
}

/// Serves HTTP (HTTPS with `config.tls`) on `listener` until `shutdown` triggers, then stops
/// accepting, lets open connections finish their in-flight requests (up to
/// `config.drain_timeout`) and returns.
pub async fn serve<L, H, F>(
    listener: L,
    handler: H,
    config: ServerConfig,
    shutdown: Shutdown,
) -> ServeReport
where
    H: Fn(Request<Incoming>) -> F + 'static,
    F: Future<Output = Response<Body>> + 'static,
    L: Listener,
{
    let tls = config
        .tls
        .as_ref()
        .map(|tls| crate::tls::Acceptor::new(tls, config.on_tls));
    let handler = Rc::new(handler);
    let config = Rc::new(config);
    let open = OpenConnections::default();
    let mut report = ServeReport::default();
    loop {
        let accepted = or(async { Some(listener.accept().await) }, async {
            shutdown.wait().await;
            None
        })
        .await;
        match accepted {
            None => break,
            Some(Ok(mut stream)) => {
                report.accepted += 1;
                if open.count() >= config.max_connections {
                    // Closed without a word: the client sees a reset and may retry elsewhere;
                    // nothing of it is read or buffered.
                    report.refused += 1;
                    if let Some(on_refused) = config.on_refused {
                        on_refused();
                    }
                    drop(stream);
                    continue;
                }
                if L::prepare(&mut stream).is_err() {
                    continue;
                }
                let guard = open.enter();
                let handler = handler.clone();
                let config = config.clone();
                let shutdown = shutdown.clone();
                let acceptor = tls.as_ref().map(|tls| tls.acceptor());
                glommio::spawn_local(async move {
                    let _guard = guard;
                    // Errors of one connection (resets, timeouts, bad preface, a failed
                    // handshake) end that connection only; hyper has already answered
                    // protocol errors.
                    let Some(acceptor) = acceptor else {
                        let _ = serve_connection(stream, handler, &config, shutdown).await;
                        return;
                    };
                    let handshake =
                        crate::rt::timeout(config.header_read_timeout, acceptor.accept(stream));
                    match handshake.await {
                        Some(Ok(stream)) => {
                            let _ = serve_connection(stream, handler, &config, shutdown).await;
                        }
                        _ => {
                            if let Some(on_tls) = config.on_tls {
                                on_tls(crate::tls::TlsEvent::HandshakeFailed);
                            }
                        }
                    }
                })
                .detach();
            }
            Some(Err(_error)) => {
                Timer::new(ACCEPT_ERROR_BACKOFF).await;
            }
        }
    }
    drop(listener);
    let drained = or(
        async {
            open.all_closed().await;
            true
        },
        async {
            Timer::new(config.drain_timeout).await;
            false
        },
    )
    .await;
    if !drained {
        report.abandoned = open.count();
    }
    report
}

/// Why one connection ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// Socket error.
    #[error("connection I/O: {0}")]
    Io(#[from] io::Error),
    /// The client sent no request head in time.
    #[error("client sent nothing within the header read timeout")]
    HeaderTimeout,
    /// hyper reported a protocol or I/O error.
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
}

async fn serve_connection<S, H, F>(
    mut stream: S,
    handler: Rc<H>,
    config: &ServerConfig,
    shutdown: Shutdown,
) -> Result<(), ConnectionError>
where
    H: Fn(Request<Incoming>) -> F + 'static,
    F: Future<Output = Response<Body>> + 'static,
    S: AsyncRead + AsyncWrite + Unpin + 'static,
{
    let sniffed =
        crate::rt::timeout(config.header_read_timeout, sniff_h2_preface(&mut stream)).await;
    let (is_h2, prefix) = sniffed.ok_or(ConnectionError::HeaderTimeout)??;
    let stream = Rewind::new(prefix, stream);
    // On h2, the streams of this connection being answered (until their body ends), and when
    // the last one ended: the idle timeout's clock.
    let activity = Rc::new(Activity::default());
    let service_activity = (is_h2 && config.http2).then(|| activity.clone());
    let service = service_fn(move |request| {
        let handler = handler.clone();
        let active = service_activity.as_ref().map(Activity::begin);
        async move {
            let response = handler(request).await;
            Ok::<_, Infallible>(match active {
                None => response,
                Some(active) => response.map(|body| {
                    Body::new(Tracked {
                        body,
                        _active: active,
                    })
                }),
            })
        }
    });
    // Serves the connection; on shutdown (or `$stop`), asks it to finish its in-flight
    // requests and close. A macro, not a function: hyper's two connection types share no
    // trait for this.
    macro_rules! drive_until_shutdown {
        ($connection:expr) => {
            drive_until_shutdown!($connection, std::future::pending::<()>())
        };
        ($connection:expr, $stop:expr) => {{
            let mut connection = pin!($connection);
            let finished = or(async { Some(connection.as_mut().await) }, async {
                or(shutdown.wait(), $stop).await;
                None
            })
            .await;
            match finished {
                Some(result) => result?,
                None => {
                    connection.as_mut().graceful_shutdown();
                    connection.await?;
                }
            }
        }};
    }
    if is_h2 && config.http2 {
        let io = GlommioIo::new(stream);
        drive_until_shutdown!(
            hyper::server::conn::http2::Builder::new(LocalExec)
                .timer(GlommioTimer)
                .max_concurrent_streams(config.h2_max_concurrent_streams)
                .serve_connection(io, service),
            activity.idle_for(config.h2_idle_timeout)
        );
    } else if let Some(render) = config.error_bodies {
        let io = GlommioIo::new(ErrorBodies::new(stream, render));
        drive_until_shutdown!(
            hyper::server::conn::http1::Builder::new()
                .timer(GlommioTimer)
                .header_read_timeout(config.header_read_timeout)
                .keep_alive(true)
                .serve_connection(io, service)
        );
    } else {
        let io = GlommioIo::new(stream);
        drive_until_shutdown!(
            hyper::server::conn::http1::Builder::new()
                .timer(GlommioTimer)
                .header_read_timeout(config.header_read_timeout)
                .keep_alive(true)
                .serve_connection(io, service)
        );
    }
    Ok(())
}

/// The streams one h2 connection is answering (each until its response body ends), and since
/// when it has had none.
struct Activity {
    answering: Cell<usize>,
    idle_since: Cell<std::time::Instant>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            answering: Cell::new(0),
            idle_since: Cell::new(std::time::Instant::now()),
        }
    }
}

struct Answering(Rc<Activity>);

/// A response body that keeps its stream counted as answering until hyper drops it (at its
/// end, or when the client resets the stream).
struct Tracked {
    body: Body,
    _active: Answering,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.body)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::Body::size_hint(&self.body)
    }
}

impl Activity {
    fn begin(self: &Rc<Self>) -> Answering {
        self.answering.set(self.answering.get() + 1);
        Answering(self.clone())
    }

    /// Resolves once no request has been answered for `limit` (checked every quarter of it,
    /// at most every second).
    async fn idle_for(&self, limit: Duration) {
        let tick = (limit / 4)
            .min(Duration::from_secs(1))
            .max(Duration::from_millis(10));
        loop {
            Timer::new(tick).await;
            if self.answering.get() == 0 && self.idle_since.get().elapsed() >= limit {
                return;
            }
        }
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        let activity = &self.0;
        activity.answering.set(activity.answering.get() - 1);
        activity.idle_since.set(std::time::Instant::now());
    }
}

/// Reads until the bytes either diverge from the h2 preface or complete it. Returns whether
/// the client speaks h2c and the bytes read, to be replayed to the protocol handler.
async fn sniff_h2_preface<S: AsyncRead + Unpin>(stream: &mut S) -> io::Result<(bool, Bytes)> {
    let mut buffer = [0u8; H2_PREFACE.len()];
    let mut filled = 0;
    loop {
        let read = stream.read(&mut buffer[filled..]).await?;
        if read == 0 {
            return Ok((false, Bytes::copy_from_slice(&buffer[..filled])));
        }
        filled += read;
        let is_h2 = buffer[..filled] == H2_PREFACE[..filled];
        if !is_h2 || filled == H2_PREFACE.len() {
            return Ok((is_h2, Bytes::copy_from_slice(&buffer[..filled])));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_waits_release_their_waker_and_trigger_wakes_the_rest() {
        glommio::LocalExecutorBuilder::default()
            .io_memory(crate::executor::DEFAULT_IO_MEMORY_BYTES)
            .make()
            .expect("executor")
            .run(async {
                let shutdown = Shutdown::new();
                // More polls than glommio's task reference count allows (32,767): each race
                // registers a waker, and dropping the losing wait must release it.
                for _ in 0..40_000 {
                    let finished_first = or(
                        async {
                            futures_lite::future::yield_now().await;
                            true
                        },
                        async {
                            shutdown.wait().await;
                            false
                        },
                    )
                    .await;
                    assert!(finished_first);
                }
                let registered = |shutdown: &Shutdown| {
                    let waiters = shutdown.inner.waiters.borrow();
                    (waiters.slots.iter().flatten().count(), waiters.slots.len())
                };
                assert_eq!(registered(&shutdown), (0, 1));
                let waiter = shutdown.clone();
                let pending = glommio::spawn_local(async move { waiter.wait().await });
                Timer::new(Duration::from_millis(1)).await;
                assert_eq!(registered(&shutdown).0, 1);
                shutdown.trigger();
                pending.await;
                assert!(shutdown.is_triggered());
                shutdown.wait().await;
            });
    }
}
