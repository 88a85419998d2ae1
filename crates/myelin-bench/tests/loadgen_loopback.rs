//! The load generator against a real HTTP engine fixture on loopback: closed-loop and
//! open-loop traffic, SSE parsing, usage and backend capture, HTTP errors counted as errors.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use glommio::net::TcpListener;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use myelin_bench::loadgen::{self, LoadPlan, LoadProgress, Target};
use myelin_bench::oracle::{CacheOracle, EngineTruth};
use myelin_bench::record::Outcome;
use myelin_bench::workload::{TokenAlphabet, Workload, WorkloadConfig};
use myelin_http::body;
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::server::{ServerConfig, Shutdown, serve};

/// A fake OpenAI engine: streams `max_tokens` completion chunks, then usage and [DONE].
/// Every `fail_every`-th request (if non-zero) gets a 503.
struct Fixture {
    url: String,
    stop: Arc<AtomicBool>,
    requests: Arc<AtomicU64>,
    thread: Option<glommio::ExecutorJoinHandle<()>>,
}

impl Fixture {
    fn start(fail_every: u64) -> Fixture {
        let (url_sender, url_receiver) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let (stop_flag, counter) = (stop.clone(), requests.clone());
        let thread = spawn_executor(ExecutorSpec::unpinned("fixture-engine"), move || async move {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            url_sender.send(format!("http://{}", listener.local_addr().unwrap())).unwrap();
            let shutdown = Shutdown::new();
            shutdown.follow(stop_flag, Duration::from_millis(20));
            let handler = move |request: Request<hyper::body::Incoming>| {
                let number = counter.fetch_add(1, Ordering::Relaxed) + 1;
                async move {
                    let bytes = request.into_body().collect().await.unwrap().to_bytes();
                    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                    if fail_every > 0 && number % fail_every == 0 {
                        return Response::builder()
                            .status(StatusCode::SERVICE_UNAVAILABLE)
                            .body(body::full("{\"error\":{\"message\":\"busy\"}}"))
                            .unwrap();
                    }
                    let max_tokens = json["max_tokens"].as_u64().unwrap();
                    let prompt_tokens = json["prompt"].as_array().map_or(0, Vec::len);
                    assert_eq!(json["stream"], true);
                    let (sender, stream_body) = body::channel(4);
                    glommio::spawn_local(async move {
                        for index in 0..max_tokens {
                            let chunk = format!(
                                "data: {{\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\" t{index}\",\"finish_reason\":null}}]}}\n\n"
                            );
                            if sender.send(chunk).await.is_err() {
                                return;
                            }
                        }
                        let usage = format!(
                            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt_tokens},\"completion_tokens\":{max_tokens},\"prompt_tokens_details\":{{\"cached_tokens\":16}}}}}}\n\ndata: [DONE]\n\n"
                        );
                        let _ = sender.send(usage).await;
                    })
                    .detach();
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .header("x-myelin-backend", "fixture-0")
                        .body(stream_body)
                        .unwrap()
                }
            };
            serve(listener, handler, ServerConfig::default(), shutdown).await;
        })
        .unwrap();
        Fixture {
            url: url_receiver.recv_timeout(Duration::from_secs(10)).unwrap(),
            stop,
            requests,
            thread: Some(thread),
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn small_churn() -> WorkloadConfig {
    let mut config = WorkloadConfig::load("churn").unwrap();
    config.users = 4;
    config.duration_s = 1.5;
    config.warmup_s = 0.2;
    config.output_tokens = 7;
    config.cluster.speedup = 1.0;
    if let Some(churn) = config.churn.as_mut() {
        churn.prefix_tokens = [32, 64];
        churn.suffix_tokens = [4, 8];
        churn.rotate_every_s = 0.5;
    }
    config
}

fn plan(config: &WorkloadConfig) -> LoadPlan {
    let alphabet = TokenAlphabet::token_ids();
    LoadPlan {
        workload: Arc::new(Workload::build(config, alphabet.clone()).unwrap()),
        alphabet: Arc::new(alphabet),
        api: config.api,
        prompt: config.prompt,
        model: "fixture".into(),
        speedup: config.cluster.speedup,
        duration_s: config.duration_s,
        stagger_s: 0.1,
        request_timeout: Duration::from_secs(30),
        progress: Arc::new(LoadProgress::default()),
    }
}

#[test]
fn closed_loop_users_stream_and_record_every_request() {
    let fixture = Fixture::start(0);
    let config = small_churn();
    let plan = plan(&config);
    let progress = plan.progress.clone();
    let outcome = loadgen::start(
        plan,
        Target::Router {
            base_url: fixture.url.clone(),
        },
    )
    .unwrap()
    .join()
    .unwrap();
    assert!(progress.finished.load(Ordering::Acquire));
    assert!(!outcome.records.is_empty());
    assert_eq!(
        outcome.records.len() as u64,
        fixture.requests.load(Ordering::Relaxed)
    );
    assert_eq!(
        outcome.records.len() as u64,
        progress.completed.load(Ordering::Relaxed)
    );
    assert_eq!(outcome.harness.requests, outcome.records.len() as u64);
    for record in &outcome.records {
        assert_eq!(record.outcome, Outcome::Ok, "{record:?}");
        assert_eq!(record.output_tokens, 7);
        assert_eq!(record.cached_tokens, Some(16));
        assert_eq!(record.backend.as_deref(), Some("fixture-0"));
        assert!(record.ttft_us.unwrap() <= record.e2e_us.unwrap());
        assert!(record.prompt_tokens >= 36);
    }
    // Every user ran, each with consecutive request numbers from 0.
    for user in 0..4 {
        let mut seqs: Vec<u64> = outcome
            .records
            .iter()
            .filter(|r| r.user == user)
            .map(|r| r.seq)
            .collect();
        seqs.sort_unstable();
        assert!(!seqs.is_empty());
        assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    }
    assert!(!outcome.harness.loop_lag_us.is_empty());
}

#[test]
fn http_errors_are_recorded_as_errors() {
    let fixture = Fixture::start(3);
    let config = small_churn();
    let plan = plan(&config);
    let progress = plan.progress.clone();
    let outcome = loadgen::start(
        plan,
        Target::Router {
            base_url: fixture.url.clone(),
        },
    )
    .unwrap()
    .join()
    .unwrap();
    let failed = outcome
        .records
        .iter()
        .filter(|record| record.outcome == Outcome::HttpStatus(503))
        .count();
    assert!(failed > 0);
    assert_eq!(failed as u64, progress.errors.load(Ordering::Relaxed));
    assert_eq!(failed as u64, fixture.requests.load(Ordering::Relaxed) / 3);
}

/// Says engine 1 holds everything.
struct SecondEngineHoldsAll;

impl CacheOracle for SecondEngineHoldsAll {
    fn probe(&self, prompt_tokens: &[u32]) -> Vec<EngineTruth> {
        vec![
            EngineTruth::default(),
            EngineTruth {
                cached_tokens: prompt_tokens.len() as u64,
                ..EngineTruth::default()
            },
        ]
    }
}

#[test]
fn open_loop_trace_replay_sends_every_line_and_the_oracle_routes_by_truth() {
    let fixture = Fixture::start(0);
    let mut config = WorkloadConfig::load("trace").unwrap();
    config.cluster.speedup = 1.0;
    config.duration_s = 60.0;
    config.warmup_s = 0.0;
    if let Some(trace) = config.trace.as_mut() {
        trace.max_requests = Some(12);
        // The slice's first 12 lines span 6 s; squeeze them into 60 ms.
        trace.time_scale = 0.01;
    }
    let plan = plan(&config);
    let unreachable_engine = "http://127.0.0.1:9".to_string();
    let outcome = loadgen::start(
        plan,
        Target::Oracle {
            engine_urls: vec![unreachable_engine, fixture.url.clone()],
            oracle: Arc::new(SecondEngineHoldsAll),
            block_size: 16,
            engine_tokenizer: None,
        },
    )
    .unwrap()
    .join()
    .unwrap();
    assert_eq!(outcome.records.len(), 12);
    let mut lines: Vec<u64> = outcome.records.iter().map(|record| record.seq).collect();
    lines.sort_unstable();
    assert_eq!(lines, (0..12).collect::<Vec<u64>>());
    for record in &outcome.records {
        assert_eq!(record.outcome, Outcome::Ok, "{record:?}");
        // The fixture's header wins over the oracle's own note of where it sent the request.
        assert_eq!(record.backend.as_deref(), Some("fixture-0"));
    }
    // The first trace line asks for 500 output tokens and 6,758 prompt tokens.
    let first = outcome
        .records
        .iter()
        .find(|record| record.seq == 0)
        .unwrap();
    assert_eq!((first.prompt_tokens, first.output_tokens), (6758, 500));
}

/// Takes `PROBE` to answer: a slow look at the engines.
struct SlowOracle;

const PROBE: Duration = Duration::from_millis(30);

impl CacheOracle for SlowOracle {
    fn probe(&self, _prompt_tokens: &[u32]) -> Vec<EngineTruth> {
        std::thread::sleep(PROBE);
        vec![EngineTruth::default()]
    }
}

#[test]
fn the_oracles_probe_counts_in_its_own_ttft() {
    let fixture = Fixture::start(0);
    let mut config = WorkloadConfig::load("trace").unwrap();
    config.cluster.speedup = 1.0;
    config.duration_s = 60.0;
    config.warmup_s = 0.0;
    if let Some(trace) = config.trace.as_mut() {
        trace.max_requests = Some(3);
        trace.time_scale = 0.01;
    }
    let outcome = loadgen::start(
        plan(&config),
        Target::Oracle {
            engine_urls: vec![fixture.url.clone()],
            oracle: Arc::new(SlowOracle),
            block_size: 16,
            engine_tokenizer: None,
        },
    )
    .unwrap()
    .join()
    .unwrap();
    assert_eq!(outcome.records.len(), 3);
    for record in &outcome.records {
        assert_eq!(record.outcome, Outcome::Ok, "{record:?}");
        // The fixture answers at once: the time to the first token is at least the probe's.
        let ttft = Duration::from_micros(record.ttft_us.unwrap());
        assert!(
            ttft >= PROBE,
            "TTFT {ttft:?} leaves out the {PROBE:?} probe"
        );
        assert!(record.e2e_us.unwrap() >= record.ttft_us.unwrap());
    }
    assert_eq!(outcome.harness.oracle_probe_us.len(), 3);
}
