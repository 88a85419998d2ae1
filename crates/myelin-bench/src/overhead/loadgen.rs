//! The overhead benchmark's load generator, on glommio executors pinned to its own CPUs.
//!
//! - Closed loop ([`ClosedLoop`]): C keep-alive HTTP/1.1 connections spread over one executor
//!   per load-generator CPU; each connection sends its next request as soon as the previous
//!   response has ended. The main thread reads the live counters to measure peak req/s.
//! - Open loop ([`run_open_loop`]): requests sent at a fixed rate from one executor, each on
//!   an idle keep-alive connection or a new one when none is idle (one connection per request
//!   in flight); records the time from send to the first body byte and to the end of the
//!   response.

use std::cell::RefCell;
use std::net::{SocketAddr, ToSocketAddrs};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::timer::Timer;
use http::{Request, header};
use http_body_util::BodyExt;
use hyper::client::conn::http1::SendRequest;
use myelin_http::body::{Body, full};
use myelin_http::client::{Pool, PoolConfig};
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::io::GlommioIo;

use super::shapes::ShapeGenerator;

/// Time allowed to open a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections the open loop keeps idle between requests; a request finding none opens one.
/// Enough to keep every connection a transient made it open: with fewer, each request past
/// them opened a connection of its own (with TLS, a handshake each, which kept the router
/// behind: docs/measurements/2026-12-07-tls-overhead.md).
pub const OPEN_LOOP_IDLE_CONNECTIONS: u64 = 1024;
/// Pause after a failed connect before the next try.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);

/// Where requests go: a router or an engine, `http://host:port` (or `https://`), and the
/// endpoint path.
#[derive(Debug, Clone)]
pub struct Target {
    pub address: SocketAddr,
    /// `host:port`, the Host header.
    pub authority: String,
    pub path: &'static str,
    /// For an `https://` target: how its certificate is verified.
    pub tls: Option<Arc<myelin_http::tls::ClientConfig>>,
}

impl Target {
    /// A target from `http://host:port` and a path; `https://host:port` with `tls`.
    pub fn new(
        base_url: &str,
        path: &'static str,
        tls: Option<Arc<myelin_http::tls::ClientConfig>>,
    ) -> Result<Target, String> {
        let scheme = if tls.is_some() { "https://" } else { "http://" };
        let authority = base_url
            .strip_prefix(scheme)
            .map(|rest| rest.trim_end_matches('/'))
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
            .ok_or_else(|| format!("{base_url:?} is not {scheme}host:port"))?;
        let address = authority
            .to_socket_addrs()
            .map_err(|error| format!("resolving {authority}: {error}"))?
            .next()
            .ok_or_else(|| format!("{authority} resolves to nothing"))?;
        Ok(Target {
            address,
            authority: authority.to_string(),
            path,
            tls,
        })
    }

    fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}{}", self.authority, self.path)
    }
}

/// Counters of one closed-loop executor (one allocation each, so executors do not share a
/// cache line).
#[derive(Debug, Default)]
struct Counters {
    completed: AtomicU64,
    errors: AtomicU64,
}

/// What a closed loop needs.
#[derive(Clone)]
pub struct ClosedLoopConfig {
    pub target: Target,
    pub generator: Arc<ShapeGenerator>,
    pub connections: usize,
    /// One executor per CPU (at most one per connection); empty: one unpinned executor.
    pub cpus: Vec<usize>,
    /// Index of the first request body.
    pub first_index: u64,
    pub request_timeout: Duration,
}

/// A running closed loop.
pub struct ClosedLoop {
    counters: Vec<Arc<Counters>>,
    stop: Arc<AtomicBool>,
    first_error: Arc<Mutex<Option<String>>>,
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
}

/// A closed loop's totals from start to stop.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClosedTotals {
    pub completed: u64,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl ClosedLoop {
    /// Opens the connections and starts sending.
    pub fn start(config: ClosedLoopConfig) -> std::io::Result<ClosedLoop> {
        let connections = config.connections.max(1);
        let slots: Vec<Option<usize>> = if config.cpus.is_empty() {
            vec![None]
        } else {
            config
                .cpus
                .iter()
                .copied()
                .take(connections)
                .map(Some)
                .collect()
        };
        let threads = slots.len();
        let next_index = Arc::new(AtomicU64::new(config.first_index));
        let mut closed = ClosedLoop {
            counters: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            first_error: Arc::new(Mutex::new(None)),
            handles: Vec::new(),
        };
        for (thread, cpu) in slots.into_iter().enumerate() {
            let mine = (thread..connections).step_by(threads).count();
            let counters = Arc::new(Counters::default());
            closed.counters.push(counters.clone());
            let spec = match cpu {
                Some(cpu) => ExecutorSpec::pinned(format!("overhead-load-{cpu}"), cpu),
                None => ExecutorSpec::unpinned("overhead-load"),
            };
            let shared = ThreadShared {
                config: config.clone(),
                counters,
                next_index: next_index.clone(),
                stop: closed.stop.clone(),
                first_error: closed.first_error.clone(),
            };
            let handle = spawn_executor(spec, move || async move {
                let shared = Rc::new(shared);
                let tasks: Vec<_> = (0..mine)
                    .map(|_| glommio::spawn_local(connection_loop(shared.clone())))
                    .collect();
                for task in tasks {
                    task.await;
                }
            });
            match handle {
                Ok(handle) => closed.handles.push(handle),
                Err(error) => {
                    closed.stop_and_join();
                    return Err(error);
                }
            }
        }
        Ok(closed)
    }

    /// Requests completed so far (2xx, body read to the end).
    pub fn completed(&self) -> u64 {
        self.counters
            .iter()
            .map(|counters| counters.completed.load(Ordering::Relaxed))
            .sum()
    }

    /// Requests failed so far.
    pub fn errors(&self) -> u64 {
        self.counters
            .iter()
            .map(|counters| counters.errors.load(Ordering::Relaxed))
            .sum()
    }

    /// Stops sending, waits for the requests in flight, and returns the totals.
    pub fn finish(mut self) -> ClosedTotals {
        self.stop_and_join();
        ClosedTotals {
            completed: self.completed(),
            errors: self.errors(),
            first_error: self.first_error.lock().ok().and_then(|error| error.clone()),
        }
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        for handle in self.handles.drain(..) {
            if handle.join().is_err() {
                // A panicked executor: its connections are gone; count it as an error.
                if let Some(counters) = self.counters.first() {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Drop for ClosedLoop {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

struct ThreadShared {
    config: ClosedLoopConfig,
    counters: Arc<Counters>,
    next_index: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    first_error: Arc<Mutex<Option<String>>>,
}

impl ThreadShared {
    fn error(&self, problem: String) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut first) = self.first_error.lock()
            && first.is_none()
        {
            *first = Some(problem);
        }
    }
}

async fn connection_loop(shared: Rc<ThreadShared>) {
    let config = &shared.config;
    let mut sender: Option<SendRequest<Body>> = None;
    while !shared.stop.load(Ordering::Relaxed) {
        // A connection the server closed (keep-alive ended) is replaced without counting an
        // error: nothing was sent on it.
        if sender.as_ref().is_none_or(SendRequest::is_closed) {
            match connect(&config.target).await {
                Ok(connected) => sender = Some(connected),
                Err(problem) => {
                    shared.error(problem);
                    Timer::new(RECONNECT_PAUSE).await;
                    continue;
                }
            }
        }
        let Some(connection) = sender.as_mut() else {
            continue;
        };
        let index = shared.next_index.fetch_add(1, Ordering::Relaxed);
        let request = build_request(&config.target, config.generator.request_body(index));
        let outcome =
            myelin_http::rt::timeout(config.request_timeout, exchange(connection, request)).await;
        match outcome {
            Some(Ok(_)) => {
                shared.counters.completed.fetch_add(1, Ordering::Relaxed);
            }
            Some(Err(failure)) => {
                if failure.connection_broken {
                    sender = None;
                }
                shared.error(failure.problem);
            }
            None => {
                sender = None;
                shared.error(format!(
                    "no complete response within {} s",
                    config.request_timeout.as_secs_f64()
                ));
            }
        }
    }
}

async fn connect(target: &Target) -> Result<SendRequest<Body>, String> {
    let address = target.address;
    let stream =
        myelin_http::rt::timeout(CONNECT_TIMEOUT, glommio::net::TcpStream::connect(address))
            .await
            .ok_or_else(|| format!("connecting to {address}: timed out"))?
            .map_err(|error| format!("connecting to {address}: {error}"))?;
    stream
        .set_nodelay(true)
        .map_err(|error| format!("TCP_NODELAY on {address}: {error}"))?;
    let Some(tls) = &target.tls else {
        return handshake(address, stream).await;
    };
    let host = address.ip().to_string();
    let handshake_tls = myelin_http::tls::connect(tls.clone(), &host, stream);
    let stream = myelin_http::rt::timeout(CONNECT_TIMEOUT, handshake_tls)
        .await
        .ok_or_else(|| format!("TLS handshake with {address}: timed out"))?
        .map_err(|error| format!("TLS handshake with {address}: {error}"))?;
    handshake(address, stream).await
}

/// An HTTP/1.1 client connection over `stream`, driven by a task of its own.
async fn handshake<S>(address: SocketAddr, stream: S) -> Result<SendRequest<Body>, String>
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(GlommioIo::new(stream))
        .await
        .map_err(|error| format!("HTTP handshake with {address}: {error}"))?;
    glommio::spawn_local(async move {
        // Connection errors surface on the request in flight.
        let _ = connection.await;
    })
    .detach();
    Ok(sender)
}

fn build_request(target: &Target, body: String) -> Request<Body> {
    let mut request = Request::new(full(body));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = http::Uri::from_static(target.path);
    let headers = request.headers_mut();
    if let Ok(host) = header::HeaderValue::from_str(&target.authority) {
        headers.insert(header::HOST, host);
    }
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    request
}

/// One exchange's times.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// First body byte.
    first_byte: Instant,
    /// End of the body.
    end: Instant,
}

/// Why an exchange failed, and whether its connection is unusable afterwards.
#[derive(Debug)]
struct Failure {
    problem: String,
    connection_broken: bool,
}

async fn exchange(
    sender: &mut SendRequest<Body>,
    request: Request<Body>,
) -> Result<Timing, Failure> {
    let broken = |problem: String| Failure {
        problem,
        connection_broken: true,
    };
    sender
        .ready()
        .await
        .map_err(|error| broken(format!("connection not ready: {error}")))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|error| broken(format!("sending: {error}")))?;
    read_response(response).await
}

async fn read_response(response: http::Response<hyper::body::Incoming>) -> Result<Timing, Failure> {
    let status = response.status();
    let mut body = response.into_body();
    let mut first_byte = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| Failure {
            problem: format!("reading the response: {error}"),
            connection_broken: true,
        })?;
        if first_byte.is_none() && frame.data_ref().is_some_and(|data| !data.is_empty()) {
            first_byte = Some(Instant::now());
        }
    }
    let end = Instant::now();
    if !status.is_success() {
        return Err(Failure {
            problem: format!("HTTP {status}"),
            connection_broken: false,
        });
    }
    Ok(Timing {
        first_byte: first_byte.unwrap_or(end),
        end,
    })
}

/// What an open loop needs.
#[derive(Clone)]
pub struct OpenLoopConfig {
    pub target: Target,
    pub generator: Arc<ShapeGenerator>,
    /// Requests sent first and left out of the figures.
    pub warmup: usize,
    /// Requests measured.
    pub requests: usize,
    /// Requests per second.
    pub rate: f64,
    pub cpu: Option<usize>,
    pub first_index: u64,
    pub request_timeout: Duration,
}

/// What an open loop measured (microseconds, in send order, successful requests only).
#[derive(Debug, Clone, Default)]
pub struct OpenOutcome {
    /// Send to the end of the response.
    pub latency_us: Vec<u64>,
    /// Send to the first body byte.
    pub first_byte_us: Vec<u64>,
    /// Failed requests, warm-up included.
    pub errors: u64,
    pub first_error: Option<String>,
    /// Connections opened (a request that finds no idle connection opens one).
    pub connections_opened: u64,
}

/// Runs an open loop to the end (or until `interrupted`) on its own executor.
pub fn run_open_loop(
    config: OpenLoopConfig,
    interrupted: Arc<AtomicBool>,
) -> Result<OpenOutcome, String> {
    let spec = match config.cpu {
        Some(cpu) => ExecutorSpec::pinned(format!("overhead-open-{cpu}"), cpu),
        None => ExecutorSpec::unpinned("overhead-open"),
    };
    let handle = spawn_executor(spec, move || open_loop(config, interrupted))
        .map_err(|error| format!("starting the open-loop generator: {error}"))?;
    handle
        .join()
        .map_err(|error| format!("the open-loop generator failed: {error}"))
}

#[derive(Default)]
struct OpenState {
    outcome: OpenOutcome,
}

async fn open_loop(config: OpenLoopConfig, interrupted: Arc<AtomicBool>) -> OpenOutcome {
    let pool = Rc::new(Pool::new(PoolConfig {
        connect_timeout: CONNECT_TIMEOUT,
        max_idle_per_host: OPEN_LOOP_IDLE_CONNECTIONS as usize,
        tls: config.target.tls.clone(),
    }));
    let state = Rc::new(RefCell::new(OpenState::default()));
    let url = config.target.url();
    let interval = Duration::from_secs_f64(1.0 / config.rate.max(0.001));
    let total = config.warmup + config.requests;
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(total);
    for sequence in 0..total {
        if interrupted.load(Ordering::Relaxed) {
            break;
        }
        let due = started + interval.mul_f64(sequence as f64);
        let now = Instant::now();
        if due > now {
            Timer::new(due - now).await;
        }
        let (pool, state, url, generator) = (
            pool.clone(),
            state.clone(),
            url.clone(),
            config.generator.clone(),
        );
        let measured = sequence >= config.warmup;
        let index = config.first_index + sequence as u64;
        let timeout = config.request_timeout;
        tasks.push(glommio::spawn_local(async move {
            let body = generator.request_body(index);
            let request = Request::post(url.as_str())
                .header(header::CONTENT_TYPE, "application/json")
                .body(full(body));
            let sent = Instant::now();
            let result = match request {
                Ok(request) => myelin_http::rt::timeout(timeout, async {
                    let response = pool.send(request).await.map_err(|error| Failure {
                        problem: format!("sending: {error}"),
                        connection_broken: true,
                    })?;
                    read_response(response).await
                })
                .await
                .unwrap_or_else(|| {
                    Err(Failure {
                        problem: format!("no complete response within {} s", timeout.as_secs_f64()),
                        connection_broken: true,
                    })
                }),
                Err(error) => Err(Failure {
                    problem: format!("building the request: {error}"),
                    connection_broken: false,
                }),
            };
            let mut state = state.borrow_mut();
            match result {
                Ok(timing) if measured => {
                    let micros = |at: Instant| at.duration_since(sent).as_micros() as u64;
                    state.outcome.latency_us.push(micros(timing.end));
                    state.outcome.first_byte_us.push(micros(timing.first_byte));
                }
                Ok(_) => {}
                Err(failure) => {
                    state.outcome.errors += 1;
                    state.outcome.first_error.get_or_insert(failure.problem);
                }
            }
        }));
    }
    for task in tasks {
        task.await;
    }
    let mut outcome = std::mem::take(&mut state.borrow_mut().outcome);
    outcome.connections_opened = pool.connections_opened();
    outcome
}

/// Nearest-rank percentile of microsecond samples, in milliseconds (`None` when empty).
pub fn percentile_ms(samples_us: &[u64], fraction: f64) -> Option<f64> {
    if samples_us.is_empty() {
        return None;
    }
    let mut sorted = samples_us.to_vec();
    sorted.sort_unstable();
    let rank = ((sorted.len() as f64 * fraction).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1] as f64 / 1_000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overhead::engine::InstantEngines;
    use crate::overhead::shapes::Shape;
    use crate::workload::TokenAlphabet;

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<u64> = (1..=100).map(|value| value * 1_000).collect();
        assert_eq!(percentile_ms(&samples, 0.5), Some(50.0));
        assert_eq!(percentile_ms(&samples, 0.99), Some(99.0));
        assert_eq!(percentile_ms(&samples, 1.0), Some(100.0));
        assert_eq!(percentile_ms(&[7_500], 0.99), Some(7.5));
        assert_eq!(percentile_ms(&[], 0.5), None);
    }

    #[test]
    fn targets_parse_only_http_host_port() {
        let target = Target::new("http://127.0.0.1:8080", "/v1/chat/completions", None).unwrap();
        assert_eq!(target.authority, "127.0.0.1:8080");
        assert_eq!(target.address.port(), 8080);
        assert!(Target::new("https://127.0.0.1:1", "/", None).is_err());
        assert!(Target::new("http://127.0.0.1:1/x", "/", None).is_err());
    }

    #[test]
    fn both_loops_complete_requests_against_instant_engines() {
        let engines = InstantEngines::start(1, &[]).unwrap();
        let path = myelin_tokenize::bundled_tokenizer_path().unwrap();
        let alphabet = TokenAlphabet::words_from_tokenizer(&path).unwrap();
        let generator =
            Arc::new(ShapeGenerator::new(Shape::SharedPrefix2k, &alphabet, 1, 16, false).unwrap());
        let target = Target::new(&engines.urls()[0], "/v1/chat/completions", None).unwrap();
        let closed = ClosedLoop::start(ClosedLoopConfig {
            target: target.clone(),
            generator: generator.clone(),
            connections: 4,
            cpus: vec![],
            first_index: 0,
            request_timeout: Duration::from_secs(10),
        })
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while closed.completed() < 50 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let totals = closed.finish();
        assert!(totals.completed >= 50, "{totals:?}");
        assert_eq!(totals.errors, 0, "{totals:?}");

        let open = run_open_loop(
            OpenLoopConfig {
                target,
                generator,
                warmup: 3,
                requests: 20,
                rate: 1_000.0,
                cpu: None,
                first_index: 1 << 32,
                request_timeout: Duration::from_secs(10),
            },
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        assert_eq!(open.errors, 0, "{:?}", open.first_error);
        assert_eq!(open.latency_us.len(), 20);
        assert_eq!(open.first_byte_us.len(), 20);
        assert!(
            open.first_byte_us
                .iter()
                .zip(&open.latency_us)
                .all(|(first, last)| first <= last)
        );
        engines.stop();
    }

    #[test]
    fn errors_are_counted_not_hidden() {
        let engines = InstantEngines::start(1, &[]).unwrap();
        let path = myelin_tokenize::bundled_tokenizer_path().unwrap();
        let alphabet = TokenAlphabet::words_from_tokenizer(&path).unwrap();
        let generator =
            Arc::new(ShapeGenerator::new(Shape::Short, &alphabet, 1, 16, false).unwrap());
        // The engines answer 404 on this path.
        let target = Target::new(&engines.urls()[0], "/v1/nothing", None).unwrap();
        let open = run_open_loop(
            OpenLoopConfig {
                target,
                generator,
                warmup: 0,
                requests: 5,
                rate: 1_000.0,
                cpu: None,
                first_index: 0,
                request_timeout: Duration::from_secs(10),
            },
            Arc::new(AtomicBool::new(false)),
        )
        .unwrap();
        assert_eq!(open.errors, 5);
        assert!(open.latency_us.is_empty());
        assert_eq!(open.first_error.as_deref(), Some("HTTP 404 Not Found"));
        engines.stop();
    }
}
