//! External engines (`myelin bench --engine SPEC`): a leg runs against engines the user started
//! (vLLM on their GPUs, or `myelin sim` processes) instead of an embedded simulated cluster.
//!
//! Before the run each engine is checked (`GET /health`) and its KV-cache geometry read from
//! vLLM's `vllm:cache_config_info` (block size and blocks); engines that disagree on the block
//! size are refused, and the routers are given the engines' block size. Before every leg the
//! harness waits until the engines are idle and empties their prefix caches
//! (`POST /reset_prefix_cache`; vLLM serves it only with `VLLM_SERVER_DEV_MODE=1`), so that
//! each leg starts cold as it does on simulated engines; an engine without the endpoint is
//! named once and its cache carries over between legs. Counters come from each engine's
//! `/metrics`; evictions, which vLLM does not count, from its KV-event stream where the spec
//! names one (`kv-events=`; [`crate::kv_watch`]), else they are "unmeasured" (the regime
//! line's working set against the engines' stated KV capacity says whether the caches
//! overflow). The same streams give the residency calibration and the resident-prefix probe
//! their truth (what each engine holds). What needs the simulator's whole state (the oracle
//! leg reads the engines' queues too; the open-loop capacity measurement) is not available here.

use std::str::FromStr;
use std::time::{Duration, Instant};

use myelin_http::backend_spec::{BackendSpec, BackendSpecError};

use crate::blocking_http::{self, GetResponse};
use crate::kv_watch::KvWatch;
use crate::oracle::CacheOracle;
use crate::prometheus;
use crate::router_process::BackendEndpoint;
use crate::stats::EngineCounters;

/// How long one control request to an engine may take.
const ENGINE_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the harness waits for an engine to finish the previous leg's requests and accept
/// a cache reset before a leg.
pub const ENGINE_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Between two polls of an engine that is not idle yet.
const IDLE_POLL: Duration = Duration::from_millis(250);

/// Why the external engines cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("--engine: {0}")]
    Spec(BackendSpecError),
    #[error("engine {url}: {problem}")]
    Engine { url: String, problem: String },
    #[error(
        "the engines disagree on the KV block size ({sizes}): the router keys the prefix tree by \
         one block size, so run engines of one block size"
    )]
    BlockSizes { sizes: String },
    #[error("{0}")]
    Unsupported(String),
}

/// One `--engine` flag: the engine as the routers' backend, `capacity-tokens=` included.
pub type EngineSpec = BackendEndpoint;

impl FromStr for BackendEndpoint {
    type Err = EngineError;

    /// The router's own grammar and checks (`myelin serve --backend`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let spec = BackendSpec::parse(text).map_err(EngineError::Spec)?;
        if spec.url.starts_with("https://") {
            // The harness itself reads the engines' metrics and KV events in plain HTTP.
            return Err(EngineError::Unsupported(format!(
                "--engine {text}: the harness reaches engines over http:// only (put the \
                 engine's plain port here; the router's TLS to engines is tested apart)"
            )));
        }
        Ok(BackendEndpoint {
            url: spec.url,
            kv_events: spec.kv_events,
            kv_replay: spec.kv_replay,
            capacity_tokens: spec.capacity_tokens,
        })
    }
}

/// An engine's KV cache as its `vllm:cache_config_info` states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGeometry {
    pub block_size: u32,
    /// `None` where the label is missing or not a number.
    pub num_gpu_blocks: Option<u64>,
}

/// Reads `vllm:cache_config_info`'s `block_size` and `num_gpu_blocks` labels (`None`: no such
/// metric, or no usable block size).
pub fn cache_geometry(metrics: &str) -> Option<CacheGeometry> {
    const INFO: &str = "vllm:cache_config_info";
    let label = |name: &str| -> Option<u64> {
        prometheus::samples_by_label(metrics, INFO, name)
            .keys()
            .find_map(|value| value.parse::<u64>().ok())
    };
    let block_size = label("block_size")
        .and_then(|size| u32::try_from(size).ok())
        .filter(|size| *size > 0)?;
    Some(CacheGeometry {
        block_size,
        num_gpu_blocks: label("num_gpu_blocks").filter(|blocks| *blocks > 0),
    })
}

/// The counters a leg reads off an engine's `/metrics` (vLLM's names). Evictions are not among
/// them: vLLM exports none (they come from the KV-event stream, [`KvWatch`]).
pub fn engine_counters(metrics: &str) -> EngineCounters {
    let count = |name| prometheus::sum_count(metrics, name).unwrap_or(0);
    EngineCounters {
        prefix_cache_queries: count("vllm:prefix_cache_queries_total"),
        prefix_cache_hits: count("vllm:prefix_cache_hits_total"),
        evictions: None,
        preemptions: count("vllm:num_preemptions_total"),
    }
}

/// Reads of an engine's `/metrics` for one set of counters, at most: a busy engine may miss one
/// deadline, and a leg should not be lost for it.
const METRICS_ATTEMPTS: u32 = 3;
/// Between two reads of `/metrics` that failed.
const METRICS_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// An engine's `/metrics` text, read again (up to [`METRICS_ATTEMPTS`] times) when a read fails
/// or answers other than 200; the last failure is the error.
fn read_metrics(engine: &ExternalEngine) -> Result<String, EngineError> {
    let url = format!("{}/metrics", engine.spec.url);
    let mut attempt = 1;
    loop {
        let failure = match get(&url) {
            Ok(metrics) if metrics.status == 200 => return Ok(metrics.body),
            Ok(metrics) => EngineError::Engine {
                url: engine.spec.url.clone(),
                problem: format!("GET /metrics answered {}", metrics.status),
            },
            Err(error) => error,
        };
        if attempt == METRICS_ATTEMPTS {
            return Err(failure);
        }
        eprintln!("myelin bench: {failure}; reading it again");
        attempt += 1;
        std::thread::sleep(METRICS_RETRY_PAUSE);
    }
}

/// Requests an engine has running or waiting (`None`: it exports neither gauge).
fn requests_in_engine(metrics: &str) -> Option<u64> {
    let running = prometheus::sum_count(metrics, "vllm:num_requests_running");
    let waiting = prometheus::sum_count(metrics, "vllm:num_requests_waiting");
    match (running, waiting) {
        (None, None) => None,
        (running, waiting) => Some(running.unwrap_or(0) + waiting.unwrap_or(0)),
    }
}

/// One external engine, as found before the run.
#[derive(Debug, Clone)]
pub struct ExternalEngine {
    pub spec: EngineSpec,
    /// Whether it serves `/metrics` (vLLM, SGLang do; TensorRT-LLM, Ollama do not).
    pub metrics: bool,
    pub geometry: Option<CacheGeometry>,
}

/// The engines of `--engine`, checked.
#[derive(Debug, Clone)]
pub struct ExternalEngines {
    pub engines: Vec<ExternalEngine>,
    /// The engines' block size (from their metrics, else the workload's).
    pub block_size: u32,
    /// Blocks per engine for the regime line: the smallest any engine reports, else the
    /// capacity given in the specs, else `None`.
    pub kv_blocks: Option<u32>,
    /// Engines that refused `POST /reset_prefix_cache` as unknown (named once).
    pub reset_unsupported: std::cell::RefCell<Vec<String>>,
    /// The engines' KV-event streams (evictions, and the calibration's truth), when every
    /// engine names one.
    pub kv_watch: Option<std::sync::Arc<KvWatch>>,
}

fn get(url: &str) -> Result<GetResponse, EngineError> {
    blocking_http::get(url, ENGINE_REQUEST_TIMEOUT).map_err(|error| EngineError::Engine {
        url: url.to_string(),
        problem: error.to_string(),
    })
}

impl ExternalEngines {
    /// Checks every engine (`GET /health` must answer 200) and reads its cache geometry.
    /// `default_block_size` is used when no engine states one.
    pub fn discover(
        specs: Vec<EngineSpec>,
        default_block_size: u32,
    ) -> Result<ExternalEngines, EngineError> {
        let mut engines = Vec::with_capacity(specs.len());
        for spec in specs {
            let health = get(&format!("{}/health", spec.url))?;
            if health.status != 200 {
                return Err(EngineError::Engine {
                    url: spec.url,
                    problem: format!("GET /health answered {}: not ready", health.status),
                });
            }
            let metrics = get(&format!("{}/metrics", spec.url))?;
            let served = metrics.status == 200;
            let geometry = served.then(|| cache_geometry(&metrics.body)).flatten();
            if geometry.is_none() && spec.capacity_tokens.is_none() && served {
                eprintln!(
                    "myelin bench: engine {} states no vllm:cache_config_info; the regime line \
                     needs its capacity (capacity-tokens=N)",
                    spec.url
                );
            }
            engines.push(ExternalEngine {
                spec,
                metrics: served,
                geometry,
            });
        }
        let mut sizes: Vec<u32> = engines
            .iter()
            .filter_map(|engine| engine.geometry.map(|geometry| geometry.block_size))
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let block_size = match sizes.as_slice() {
            [] => default_block_size,
            [size] => *size,
            _ => {
                return Err(EngineError::BlockSizes {
                    sizes: engines
                        .iter()
                        .filter_map(|engine| {
                            engine.geometry.map(|geometry| {
                                format!("{}: {}", engine.spec.url, geometry.block_size)
                            })
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        };
        let kv_blocks = engines
            .iter()
            .filter_map(|engine| {
                engine
                    .geometry
                    .and_then(|geometry| geometry.num_gpu_blocks)
                    .or_else(|| {
                        engine
                            .spec
                            .capacity_tokens
                            .map(|tokens| tokens / u64::from(block_size))
                    })
            })
            .min()
            .and_then(|blocks| u32::try_from(blocks).ok());
        let streams: Option<Vec<String>> = engines
            .iter()
            .map(|engine| engine.spec.kv_events.clone())
            .collect();
        let kv_watch = match streams {
            Some(streams) => Some(std::sync::Arc::new(
                KvWatch::start(&streams, block_size).map_err(EngineError::Unsupported)?,
            )),
            None => {
                eprintln!(
                    "myelin bench: evictions and the residency calibration are not measured: \
                     vLLM counts no evictions, and not every --engine names the kv-events= \
                     stream to read them from"
                );
                None
            }
        };
        Ok(ExternalEngines {
            engines,
            block_size,
            kv_blocks,
            reset_unsupported: Default::default(),
            kv_watch,
        })
    }

    /// The engines as router backends.
    pub fn backends(&self) -> Vec<BackendEndpoint> {
        self.engines
            .iter()
            .map(|engine| BackendEndpoint {
                // A router reads the capacity off the engine's metrics where they state it.
                capacity_tokens: engine
                    .geometry
                    .is_none()
                    .then_some(engine.spec.capacity_tokens)
                    .flatten(),
                ..engine.spec.clone()
            })
            .collect()
    }

    /// The URLs, in order.
    pub fn urls(&self) -> Vec<String> {
        self.engines
            .iter()
            .map(|engine| engine.spec.url.clone())
            .collect()
    }

    /// Before a leg: waits (up to `timeout`) until every engine has no request running or
    /// waiting, then empties its prefix cache. An engine without `/reset_prefix_cache` (404 or
    /// 405: vLLM without `VLLM_SERVER_DEV_MODE=1`) is named once and keeps its cache.
    pub fn prepare_leg(&self, timeout: Duration) -> Result<(), EngineError> {
        let deadline = Instant::now() + timeout;
        for (index, engine) in self.engines.iter().enumerate() {
            let url = &engine.spec.url;
            let timed_out = |what: &str| EngineError::Engine {
                url: url.clone(),
                problem: format!("{what} within {} s of the leg's start", timeout.as_secs()),
            };
            if engine.metrics {
                loop {
                    let metrics = get(&format!("{url}/metrics"))?;
                    if requests_in_engine(&metrics.body).unwrap_or(0) == 0 {
                        break;
                    }
                    if Instant::now() >= deadline {
                        return Err(timed_out("still has requests running or waiting"));
                    }
                    std::thread::sleep(IDLE_POLL);
                }
            }
            if self.reset_unsupported.borrow().contains(url) {
                continue;
            }
            loop {
                let reset_url = format!("{url}/reset_prefix_cache");
                let answer = blocking_http::post_empty(&reset_url, ENGINE_REQUEST_TIMEOUT)
                    .map_err(|error| EngineError::Engine {
                        url: url.clone(),
                        problem: error.to_string(),
                    })?;
                match answer.status {
                    200..=299 => {
                        if let Some(watch) = &self.kv_watch {
                            watch.cleared(index);
                        }
                        break;
                    }
                    404 | 405 => {
                        eprintln!(
                            "myelin bench: engine {url} has no POST /reset_prefix_cache (vLLM \
                             serves it with VLLM_SERVER_DEV_MODE=1): its prefix cache carries \
                             over from one leg to the next, which favours the legs that run later"
                        );
                        self.reset_unsupported.borrow_mut().push(url.clone());
                        break;
                    }
                    // Refused while requests still hold blocks: retried until the deadline.
                    _ if Instant::now() < deadline => std::thread::sleep(IDLE_POLL),
                    status => {
                        return Err(timed_out(&format!(
                            "refused POST /reset_prefix_cache (last answer {status})"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// What the engines hold, from their KV-event streams, for the residency calibration and
    /// the resident-prefix probe (`None` without the streams).
    pub fn truth(&self) -> Option<std::sync::Arc<dyn CacheOracle>> {
        self.kv_watch
            .clone()
            .map(|watch| watch as std::sync::Arc<dyn CacheOracle>)
    }

    /// The engines' counters, summed (engines without metrics count nothing). An engine whose
    /// metrics cannot be read is an error: a leg's figures would silently drop it.
    pub fn counters(&self) -> Result<EngineCounters, EngineError> {
        let mut sum = EngineCounters::default();
        for engine in self.engines.iter().filter(|engine| engine.metrics) {
            sum.add(&engine_counters(&read_metrics(engine)?));
        }
        sum.evictions = self.kv_watch.as_ref().map(|watch| watch.evictions());
        Ok(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let spec: EngineSpec =
            "http://10.0.0.5:8000/,kv-events=tcp://10.0.0.5:5557,kv-replay=tcp://10.0.0.5:5558"
                .parse()
                .unwrap();
        assert_eq!(spec.url, "http://10.0.0.5:8000");
        assert_eq!(spec.kv_events.as_deref(), Some("tcp://10.0.0.5:5557"));
        assert_eq!(spec.kv_replay.as_deref(), Some("tcp://10.0.0.5:5558"));
        assert_eq!(spec.capacity_tokens, None);
        let plain: EngineSpec = "http://h:1,capacity-tokens=32768".parse().unwrap();
        assert_eq!(plain.capacity_tokens, Some(32768));
        // The router's errors (myelin_http::backend_spec has the full set of cases).
        for (bad, says) in [
            ("https://h:1", "http:// only"),
            ("ftp://h:1", "http://"),
            ("h:1", "http://"),
            ("http://h:1/v1", "path"),
            ("http://h:1,kv-events=h:5557", "must start with tcp://"),
            ("http://h:1,kv-replay=tcp://h:2", "needs kv-events"),
            ("http://h:1,capacity-tokens=0", "whole number"),
            ("http://h:1,colour=red", "unknown option"),
            (
                "http://h:1,kv-events=tcp://a:1,kv-events=tcp://b:1",
                "given twice",
            ),
        ] {
            let error = bad.parse::<EngineSpec>().unwrap_err().to_string();
            assert!(error.contains(says), "{bad}: {error}");
            assert!(error.contains(bad), "the error names the flag: {error}");
        }
    }

    #[test]
    fn geometry_and_counters_come_from_vllm_metric_names() {
        let metrics = "\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",num_gpu_blocks=\"767\"} 1.0
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1200.0
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 900.0
vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_running{engine=\"0\"} 2.0
vllm:num_requests_waiting{engine=\"0\"} 1.0
";
        assert_eq!(
            cache_geometry(metrics),
            Some(CacheGeometry {
                block_size: 32,
                num_gpu_blocks: Some(767)
            })
        );
        let counters = engine_counters(metrics);
        assert_eq!(
            (
                counters.prefix_cache_queries,
                counters.prefix_cache_hits,
                counters.preemptions,
                counters.evictions
            ),
            (1200, 900, 3, None)
        );
        assert_eq!(requests_in_engine(metrics), Some(3));
        assert_eq!(cache_geometry("vllm:num_requests_running 0\n"), None);
        assert_eq!(
            cache_geometry("vllm:cache_config_info{block_size=\"0\"} 1\n"),
            None
        );
        assert_eq!(requests_in_engine("other 1\n"), None);
    }

    /// A one-shot engine answering each request from `answers` in turn.
    fn engine(answers: Vec<String>) -> (String, std::thread::JoinHandle<Vec<String>>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for answer in answers {
                let (mut socket, _) = listener.accept().unwrap();
                let mut request = Vec::new();
                let mut buffer = [0u8; 1024];
                while !request.ends_with(b"\r\n\r\n") {
                    let read = socket.read(&mut buffer).unwrap();
                    assert!(read > 0);
                    request.extend_from_slice(&buffer[..read]);
                }
                let head = String::from_utf8_lossy(&request);
                seen.push(head.lines().next().unwrap_or_default().to_string());
                socket.write_all(answer.as_bytes()).unwrap();
            }
            seen
        });
        (url, server)
    }

    fn answer(status: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    fn ok() -> String {
        answer("200 OK", "")
    }

    fn metrics_of(block_size: u32) -> String {
        answer(
            "200 OK",
            &format!(
                "vllm:cache_config_info{{block_size=\"{block_size}\",num_gpu_blocks=\"100\"}} 1.0\n\
                 vllm:num_requests_running 0\n"
            ),
        )
    }

    fn running(requests: u32) -> String {
        answer("200 OK", &format!("vllm:num_requests_running {requests}\n"))
    }

    #[test]
    fn discovery_reads_the_block_size_and_a_leg_waits_for_idle_then_resets() {
        let (url, server) = engine(vec![ok(), metrics_of(32), running(1), running(0), ok()]);
        let spec: EngineSpec = url.parse().unwrap();
        let engines = ExternalEngines::discover(vec![spec], 16).unwrap();
        assert_eq!((engines.block_size, engines.kv_blocks), (32, Some(100)));
        assert_eq!(engines.backends()[0].capacity_tokens, None);
        engines.prepare_leg(Duration::from_secs(10)).unwrap();
        let seen = server.join().unwrap();
        assert_eq!(
            seen,
            [
                "GET /health HTTP/1.1",
                "GET /metrics HTTP/1.1",
                "GET /metrics HTTP/1.1",
                "GET /metrics HTTP/1.1",
                "POST /reset_prefix_cache HTTP/1.1"
            ]
        );
    }

    #[test]
    fn a_failed_metrics_read_is_tried_again_before_the_leg_is_lost() {
        let unavailable = || answer("503 Service Unavailable", "busy");
        let (url, server) = engine(vec![
            ok(),
            metrics_of(32),
            unavailable(),
            metrics_of(32),
            unavailable(),
            unavailable(),
            unavailable(),
        ]);
        let engines = ExternalEngines::discover(vec![url.parse().unwrap()], 16).unwrap();
        // Once refused, then read: the counters come back.
        engines.counters().unwrap();
        // Refused on every attempt: the error names the engine and the answer.
        let error = engines.counters().unwrap_err().to_string();
        assert!(error.contains(&url) && error.contains("503"), "{error}");
        assert_eq!(server.join().unwrap().len(), 7);
    }

    #[test]
    fn an_engine_without_the_reset_is_named_once_and_skipped_after() {
        let not_found = answer("404 Not Found", "");
        let (url, server) = engine(vec![ok(), running(0), running(0), not_found, running(0)]);
        let engines = ExternalEngines::discover(vec![url.parse().unwrap()], 16).unwrap();
        // No cache_config_info: the default block size, no capacity known.
        assert_eq!((engines.block_size, engines.kv_blocks), (16, None));
        engines.prepare_leg(Duration::from_secs(10)).unwrap();
        engines.prepare_leg(Duration::from_secs(10)).unwrap();
        assert_eq!(engines.reset_unsupported.borrow().as_slice(), [url]);
        assert_eq!(server.join().unwrap().len(), 5);
    }

    #[test]
    fn an_unhealthy_engine_and_mixed_block_sizes_are_refused() {
        let (url, server) = engine(vec![answer("503 Busy", "")]);
        let error = ExternalEngines::discover(vec![url.parse().unwrap()], 16).unwrap_err();
        assert!(error.to_string().contains("answered 503"), "{error}");
        server.join().unwrap();
        let (first, first_server) = engine(vec![ok(), metrics_of(32)]);
        let (second, second_server) = engine(vec![ok(), metrics_of(16)]);
        let error =
            ExternalEngines::discover(vec![first.parse().unwrap(), second.parse().unwrap()], 16)
                .unwrap_err();
        assert!(matches!(error, EngineError::BlockSizes { .. }), "{error}");
        assert!(
            error.to_string().contains(&format!("{first}: 32")),
            "{error}"
        );
        first_server.join().unwrap();
        second_server.join().unwrap();
    }
}
