//! The load generator: one glommio executor running the workload's users (closed loop) or
//! arrivals (open loop), streaming every response over myelin-http's client pool, recording
//! each request, and measuring its own cost (thread CPU, timer lateness).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_lite::future::or;
use glommio::timer::Timer;
use http_body_util::BodyExt;
use myelin_http::client::{Pool, PoolConfig};
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::sse::SseParser;

use crate::calibration::{CalibrationSetup, Calibrator, LegCalibration, Ticket};
use crate::engine_tokens::EngineTokenizer;
use crate::oracle::{CacheOracle, Oracle};
use crate::record::{Outcome, RequestRecord};
use crate::request_body::{endpoint_path, request_body};
use crate::stats::HarnessCost;
use crate::stream::StreamReader;
use crate::workload::{Api, Arrival, PlannedRequest, PromptFormat, TokenAlphabet, Workload};

/// How often the lateness probe wakes.
const LAG_PROBE_INTERVAL: Duration = Duration::from_millis(5);

/// Live counters the main thread shows in the progress bar.
#[derive(Debug, Default)]
pub struct LoadProgress {
    pub sent: AtomicU64,
    pub completed: AtomicU64,
    pub errors: AtomicU64,
    /// Set when the generator has stopped sending and every request has ended.
    pub finished: AtomicBool,
}

/// Where requests go.
#[derive(Clone)]
pub enum Target {
    /// Every request to one router.
    Router { base_url: String },
    /// Several router nodes (a peer cluster, or independent routers) in front of the same
    /// engines: see [`router_node`] for which request goes to which.
    Routers { base_urls: Vec<String> },
    /// The harness picks the engine per request from the simulator's truth.
    Oracle {
        engine_urls: Vec<String>,
        oracle: Arc<dyn CacheOracle>,
        /// The engines' KV block size in tokens.
        block_size: u32,
        /// Text prompts: how the engines tokenize them (token-id prompts are probed as is).
        engine_tokenizer: Option<Arc<EngineTokenizer>>,
    },
}

/// The probe of the simulator's truth at each send, for the share of requests whose reusable
/// prefix was resident on some engine (the regime line): every engine's cached leading blocks,
/// read in process before the request's clock starts (on the oracle leg, from the oracle's own
/// probe).
#[derive(Clone)]
pub struct ResidentProbe {
    pub oracle: Arc<dyn CacheOracle>,
    /// The engines' KV block size in tokens.
    pub block_size: u32,
    /// Text prompts: how the engines tokenize them (token-id prompts are probed as is).
    pub engine_tokenizer: Option<Arc<EngineTokenizer>>,
}

/// Everything the generator needs for one leg.
#[derive(Clone)]
pub struct LoadPlan {
    pub workload: Arc<Workload>,
    pub alphabet: Arc<TokenAlphabet>,
    pub api: Api,
    pub prompt: PromptFormat,
    pub model: String,
    pub speedup: f64,
    /// Simulated seconds during which requests are sent.
    pub duration_s: f64,
    /// Simulated seconds over which closed-loop users start (staggered, so they do not all
    /// fire in the same millisecond).
    pub stagger_s: f64,
    /// Wall-clock limit for one request, first byte to last.
    pub request_timeout: Duration,
    pub progress: Arc<LoadProgress>,
}

/// What a leg's traffic produced.
#[derive(Debug)]
pub struct LoadOutcome {
    pub records: Vec<RequestRecord>,
    pub harness: HarnessCost,
    /// Wall time from the first send to the end of the last request.
    pub wall: Duration,
    /// The residency calibration, when the leg measured it (see [`start_calibrated`]).
    pub calibration: Option<LegCalibration>,
}

/// Starts the generator on its own executor thread; join the handle for the outcome.
pub fn start(
    plan: LoadPlan,
    target: Target,
) -> std::io::Result<glommio::ExecutorJoinHandle<LoadOutcome>> {
    start_calibrated(plan, target, None)
}

/// [`start`], measuring the residency calibration when `calibration` is set (router targets:
/// the backend comes from `x-myelin-backend`; see [`crate::calibration`]).
pub fn start_calibrated(
    plan: LoadPlan,
    target: Target,
    calibration: Option<CalibrationSetup>,
) -> std::io::Result<glommio::ExecutorJoinHandle<LoadOutcome>> {
    start_probed(plan, target, calibration, None)
}

/// [`start_calibrated`], also recording at every send whether the request's reusable prefix
/// was resident on some engine when `resident` is set (see [`ResidentProbe`]).
pub fn start_probed(
    plan: LoadPlan,
    target: Target,
    calibration: Option<CalibrationSetup>,
    resident: Option<ResidentProbe>,
) -> std::io::Result<glommio::ExecutorJoinHandle<LoadOutcome>> {
    spawn_executor(ExecutorSpec::unpinned("myelin-bench-load"), move || {
        drive(plan, target, calibration, resident)
    })
}

/// State shared by the tasks of one generator (single thread, so `Rc`).
struct Shared {
    plan: LoadPlan,
    target: Target,
    pool: Pool,
    started: Instant,
    records: RefCell<Vec<RequestRecord>>,
    /// Oracle only: the router's decision code, fed the truth.
    oracle: RefCell<Oracle>,
    /// Oracle only: how long each probe of the simulator took, microseconds.
    probe_us: RefCell<Vec<u64>>,
    /// The residency calibration's replica of the router, when measured.
    calibration: Option<RefCell<Calibrator>>,
    /// The probe of resident prefixes at each send, when recorded.
    resident: Option<ResidentProbe>,
}

impl Shared {
    fn elapsed_sim_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * self.plan.speedup
    }

    fn wall_at_sim_s(&self, sim_s: f64) -> Instant {
        self.started + Duration::from_secs_f64((sim_s / self.plan.speedup).max(0.0))
    }
}

/// Marks the generator finished when dropped, so the main thread stops waiting even if the
/// generator's thread panics.
struct FinishOnDrop(Arc<LoadProgress>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.finished.store(true, Ordering::Release);
    }
}

async fn drive(
    plan: LoadPlan,
    target: Target,
    calibration: Option<CalibrationSetup>,
    resident: Option<ResidentProbe>,
) -> LoadOutcome {
    let _finish = FinishOnDrop(plan.progress.clone());
    let cpu_at_start = thread_cpu_us();
    let block_size = match &target {
        Target::Oracle { block_size, .. } => *block_size,
        Target::Router { .. } | Target::Routers { .. } => 16,
    };
    let users_hint = match plan.workload.arrival() {
        Arrival::ClosedLoop { users } => users as usize,
        Arrival::OpenLoop { .. } => 256,
    };
    let shared = Rc::new(Shared {
        pool: Pool::new(PoolConfig {
            connect_timeout: Duration::from_secs(5),
            max_idle_per_host: users_hint + 8,
            tls: None,
        }),
        plan,
        target,
        started: Instant::now(),
        records: RefCell::new(Vec::new()),
        oracle: RefCell::new(Oracle::new(block_size)),
        probe_us: RefCell::new(Vec::new()),
        calibration: calibration
            .and_then(|setup| Calibrator::new(setup).ok())
            .map(RefCell::new),
        resident,
    });

    let lag_samples = Rc::new(RefCell::new(Vec::new()));
    let stop_probe = Rc::new(std::cell::Cell::new(false));
    let probe = glommio::spawn_local({
        let lag_samples = lag_samples.clone();
        let stop_probe = stop_probe.clone();
        async move {
            while !stop_probe.get() {
                let due = Instant::now() + LAG_PROBE_INTERVAL;
                Timer::new(LAG_PROBE_INTERVAL).await;
                let late = Instant::now().saturating_duration_since(due);
                lag_samples.borrow_mut().push(late.as_micros() as u64);
            }
        }
    });

    let mut tasks = Vec::new();
    match shared.plan.workload.arrival() {
        Arrival::ClosedLoop { users } => {
            for user in 0..users {
                let shared = shared.clone();
                tasks.push(glommio::spawn_local(async move {
                    let start_s = shared.plan.stagger_s * f64::from(user) / f64::from(users.max(1));
                    sleep_until(shared.wall_at_sim_s(start_s)).await;
                    let mut seq = 0u64;
                    loop {
                        let elapsed_s = shared.elapsed_sim_s();
                        if elapsed_s >= shared.plan.duration_s {
                            break;
                        }
                        let request = shared
                            .plan
                            .workload
                            .closed_loop_request(user, seq, elapsed_s);
                        let record = exchange(&shared, user, seq, request, None).await;
                        shared.records.borrow_mut().push(record);
                        seq += 1;
                    }
                }));
            }
        }
        Arrival::OpenLoop { .. } => {
            let mut index = 0;
            while let Some((send_at_s, request)) = shared.plan.workload.open_loop_request(index) {
                if send_at_s >= shared.plan.duration_s {
                    break;
                }
                sleep_until(shared.wall_at_sim_s(send_at_s)).await;
                let shared = shared.clone();
                tasks.push(glommio::spawn_local(async move {
                    let record = exchange(&shared, 0, index as u64, request, Some(send_at_s)).await;
                    shared.records.borrow_mut().push(record);
                }));
                index += 1;
            }
        }
    }
    for task in tasks {
        task.await;
    }
    let wall = shared.started.elapsed();
    stop_probe.set(true);
    probe.await;

    let records = std::mem::take(&mut *shared.records.borrow_mut());
    let cpu_us = thread_cpu_us().saturating_sub(cpu_at_start);
    let loop_lag_us = std::mem::take(&mut *lag_samples.borrow_mut());
    LoadOutcome {
        harness: HarnessCost {
            cpu_us,
            requests: records.len() as u64,
            loop_lag_us,
            oracle_probe_us: std::mem::take(&mut *shared.probe_us.borrow_mut()),
        },
        records,
        wall,
        calibration: shared
            .calibration
            .as_ref()
            .map(|calibrator| calibrator.borrow().finish()),
    }
}

/// Which of `nodes` router nodes a request goes to: closed-loop user `u` always to node
/// `u % nodes` (a user's conversation stays on one node, as behind a sticky load balancer);
/// open-loop (and trace) request `i` (its `seq`) to node `i % nodes`.
pub fn router_node(user: u32, seq: u64, open_loop: bool, nodes: usize) -> usize {
    let nodes = nodes.max(1);
    if open_loop {
        (seq % nodes as u64) as usize
    } else {
        user as usize % nodes
    }
}

async fn sleep_until(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        Timer::new(deadline - now).await;
    }
}

/// Sends one request, streams the answer, and records it (`planned_send_s`: open loop, when
/// the schedule said to send it).
async fn exchange(
    shared: &Shared,
    user: u32,
    seq: u64,
    request: PlannedRequest,
    planned_send_s: Option<f64>,
) -> RequestRecord {
    let plan = &shared.plan;
    let path = endpoint_path(plan.api);
    let reusable_tokens = u32::try_from(plan.workload.reusable_len(&request)).unwrap_or(u32::MAX);
    // The resident-prefix probe, before the clock starts (the oracle leg reads its own probe).
    let mut resident_tokens = match (&shared.resident, &shared.target) {
        (Some(_), Target::Oracle { .. }) | (None, _) => None,
        (Some(probe), _) => {
            let engine_tokens = probe.engine_tokenizer.as_ref().and_then(|tokenizer| {
                tokenizer
                    .engine_tokens(plan.api, plan.prompt, &request, &plan.alphabet)
                    .ok()
            });
            let tokens: &[u32] = engine_tokens.as_deref().unwrap_or(&request.tokens);
            most_cached(&probe.oracle.probe(tokens))
        }
    };
    // The clock starts before the oracle's probe and decision: a router's TTFT includes its
    // routing, so the oracle's includes its own.
    let sent_at = Instant::now();
    let sent_at_us = sent_at.duration_since(shared.started).as_micros() as u64;
    let mut oracle_prediction = None;
    let (url, chosen_engine) = match &shared.target {
        Target::Router { base_url } => (format!("{base_url}{path}"), None),
        Target::Routers { base_urls } => {
            let node = router_node(user, seq, planned_send_s.is_some(), base_urls.len());
            (format!("{}{path}", base_urls[node]), None)
        }
        Target::Oracle {
            engine_urls,
            oracle,
            engine_tokenizer,
            ..
        } => {
            let probe_started = Instant::now();
            // Tokenizing our own words cannot fail; if it did, the planned ids are the best guess.
            let engine_tokens = engine_tokenizer.as_ref().and_then(|tokenizer| {
                tokenizer
                    .engine_tokens(plan.api, plan.prompt, &request, &plan.alphabet)
                    .ok()
            });
            let probe_tokens: &[u32] = engine_tokens.as_deref().unwrap_or(&request.tokens);
            let truths = oracle.probe(probe_tokens);
            if shared.resident.is_some() {
                resident_tokens = most_cached(&truths);
            }
            // The probe answers for every engine the harness knows (validated: at least one).
            let engine = shared
                .oracle
                .borrow_mut()
                .choose(probe_tokens.len(), request.output_tokens, &truths)
                .unwrap_or(0)
                .min(engine_urls.len().saturating_sub(1));
            shared
                .probe_us
                .borrow_mut()
                .push(probe_started.elapsed().as_micros() as u64);
            oracle_prediction = shared
                .oracle
                .borrow()
                .last_predicted_ttft_s()
                .map(|simulated_s| (simulated_s / plan.speedup * 1e6) as u64);
            (format!("{}{path}", engine_urls[engine]), Some(engine))
        }
    };
    let body = request_body(plan.api, plan.prompt, &plan.model, &request, &plan.alphabet);
    let mut record = RequestRecord {
        user,
        seq,
        label: request.label,
        sent_at_us,
        planned_send_s,
        ttft_us: None,
        e2e_us: None,
        prompt_tokens: request.tokens.len() as u32,
        output_tokens: 0,
        cached_tokens: None,
        backend: match (&shared.target, chosen_engine) {
            (Target::Oracle { engine_urls, .. }, Some(engine)) => Some(engine_urls[engine].clone()),
            _ => None,
        },
        outcome: Outcome::Ok,
        reusable_tokens,
        resident_tokens,
        prefix_resident: shared.resident.as_ref().and_then(|probe| {
            RequestRecord::resident_verdict(reusable_tokens, resident_tokens, probe.block_size)
        }),
        predicted_ttft_us: oracle_prediction,
    };
    plan.progress.sent.fetch_add(1, Ordering::Relaxed);
    let mut ticket = shared.calibration.as_ref().map(|calibrator| {
        calibrator
            .borrow_mut()
            .on_send(user, seq, &request.tokens, request.output_tokens)
    });

    let timeout = plan.request_timeout;
    let result = or(
        async {
            Some(stream_response(shared, &url, body, &mut record, sent_at, &mut ticket).await)
        },
        async {
            Timer::new(timeout).await;
            None
        },
    )
    .await;
    record.outcome = match result {
        Some(Ok(())) => Outcome::Ok,
        Some(Err(outcome)) => outcome,
        None => Outcome::TimedOut,
    };
    if record.outcome.is_error() {
        plan.progress.errors.fetch_add(1, Ordering::Relaxed);
    }
    if let (Some(calibrator), Some(ticket)) = (&shared.calibration, ticket) {
        let reported = record.cached_tokens.filter(|_| !record.outcome.is_error());
        calibrator.borrow_mut().on_end(ticket, reported);
    }
    plan.progress.completed.fetch_add(1, Ordering::Relaxed);
    record
}

async fn stream_response(
    shared: &Shared,
    url: &str,
    body: String,
    record: &mut RequestRecord,
    sent_at: Instant,
    ticket: &mut Option<Ticket>,
) -> Result<(), Outcome> {
    let request = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::ACCEPT, "text/event-stream")
        .body(myelin_http::body::full(body))
        .map_err(|error| Outcome::Failed(format!("building request: {error}")))?;
    let response = shared
        .pool
        .send(request)
        .await
        .map_err(|error| Outcome::Failed(error.to_string()))?;
    if let Some(backend) = response
        .headers()
        .get("x-myelin-backend")
        .and_then(|value| value.to_str().ok())
    {
        record.backend = Some(backend.to_string());
    }
    if let Some(predicted) = response
        .headers()
        .get("x-myelin-predicted-ttft-us")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse().ok())
    {
        record.predicted_ttft_us = Some(predicted);
    }
    let status = response.status();
    if let (Some(calibrator), Some(ticket), Some(backend), true) = (
        &shared.calibration,
        ticket.as_mut(),
        &record.backend,
        status.is_success(),
    ) {
        calibrator.borrow_mut().on_head(ticket, backend);
    }
    let mut body = response.into_body();
    if !status.is_success() {
        // Drain the error body so the connection can be reused; the status is what counts.
        while let Some(Ok(_)) = body.frame().await {}
        return Err(Outcome::HttpStatus(status.as_u16()));
    }
    let mut parser = SseParser::new();
    let mut reader = StreamReader::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| Outcome::Failed(format!("reading stream: {error}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if let (Some(calibrator), Some(ticket)) = (&shared.calibration, ticket.as_mut()) {
            calibrator.borrow_mut().on_first_byte(ticket);
        }
        let now = Instant::now();
        for event in parser.feed(&data) {
            reader.on_event(&event, now).map_err(Outcome::Failed)?;
        }
    }
    let ended_at = Instant::now();
    record.e2e_us = Some(ended_at.duration_since(sent_at).as_micros() as u64);
    let summary = match reader.finish() {
        Ok(summary) => summary,
        Err((reason, summary)) => {
            record.ttft_us = summary
                .first_token_at
                .map(|first| first.duration_since(sent_at).as_micros() as u64);
            return Err(Outcome::Failed(reason));
        }
    };
    record.ttft_us = summary
        .first_token_at
        .map(|first| first.duration_since(sent_at).as_micros() as u64);
    record.output_tokens = summary.completion_tokens.unwrap_or(summary.content_chunks);
    if let Some(prompt_tokens) = summary.prompt_tokens {
        record.prompt_tokens = prompt_tokens;
    }
    record.cached_tokens = summary.cached_tokens;
    Ok(())
}

/// The most leading prompt tokens any engine holds.
fn most_cached(truths: &[crate::oracle::EngineTruth]) -> Option<u32> {
    truths
        .iter()
        .map(|truth| u32::try_from(truth.cached_tokens).unwrap_or(u32::MAX))
        .max()
}

/// CPU time consumed by the calling thread, microseconds.
fn thread_cpu_us() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer to a local.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    if status != 0 {
        return 0;
    }
    now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
}

#[cfg(test)]
mod tests {
    use super::router_node;

    #[test]
    fn users_stay_on_one_node_and_open_loop_requests_rotate() {
        // Closed loop: user u on node u % N, whatever its request number.
        for seq in [0, 1, 7] {
            let nodes: Vec<usize> = (0..7)
                .map(|user| router_node(user, seq, false, 3))
                .collect();
            assert_eq!(nodes, [0, 1, 2, 0, 1, 2, 0]);
        }
        // Open loop and traces: request i (its seq; user is 0) on node i % N.
        let nodes: Vec<usize> = (0..5).map(|seq| router_node(0, seq, true, 2)).collect();
        assert_eq!(nodes, [0, 1, 0, 1, 0]);
        // One node (or a degenerate 0) takes everything.
        assert!((0..5).all(|user| router_node(user, 3, false, 1) == 0));
        assert_eq!(router_node(4, 4, true, 0), 0);
    }
}
