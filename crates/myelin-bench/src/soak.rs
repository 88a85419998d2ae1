//! `myelin bench soak`: churn through `myelin serve` for a long time (an hour by default) with
//! the router's resident memory sampled at a fixed interval. Not part of CI: it is the check
//! that the router's memory stays flat under sustained traffic whose prompts never repeat for
//! long (rotating prefixes, every request a new suffix), so every bounded structure (routing
//! history, KV-event mirror, tokenizer caches, connection pools) has to reach its bound and stay
//! there.
//!
//! Setup: simulated vLLM engines in this process (KV events on, so the router's mirrors follow
//! their evictions) and one `myelin serve` subprocess (2 unpinned shards, residency auto) in
//! front of them; `--clients` closed-loop clients on keep-alive connections send chat requests,
//! streaming and not, alternately. Every answer must be a complete 200 (an SSE stream ending in
//! `[DONE]`, a JSON body with `choices`); anything else is an error.
//!
//! Output in `--out` (default `results/soak-<timestamp>/`): `rss.csv` (one row per sample:
//! seconds since the start, the router's `VmRSS` in KiB, requests answered and errors so far),
//! `rss.png` (the curve, the end of the warm-up and the limit), `summary.md`, and `logs/` with the
//! router's output. The verdict line on stdout is `soak: PASS` or `soak: FAIL` with the
//! figures; the exit status is 0 on PASS, 1 on FAIL.
//!
//! PASS: no error, and the last sample at most `--max-growth-percent` (10) above the first
//! sample taken after `--warm-up` (the caches and the routing history fill during the warm-up).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use plotters::prelude::*;

use crate::router_process::{RouterProcess, free_port};

/// `myelin bench soak` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct SoakArgs {
    /// How long to drive traffic, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub duration: u64,

    /// Seconds after the start whose first sample is the baseline (default: a quarter of
    /// --duration, at most 900: the routing history, LRU-bounded at about a million blocks per
    /// replica, takes minutes of this churn to fill).
    #[arg(long)]
    pub warm_up: Option<u64>,

    /// Seconds between two RSS samples.
    #[arg(long, default_value_t = 10)]
    pub sample_interval: u64,

    /// Largest growth of the last sample over the baseline, in percent, for PASS.
    #[arg(long, default_value_t = 10.0)]
    pub max_growth_percent: f64,

    /// Closed-loop clients (each one request at a time on its own keep-alive connection).
    #[arg(long, default_value_t = 8)]
    pub clients: usize,

    /// Simulated engines behind the router.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,

    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 50.0)]
    pub speedup: f64,

    /// Output directory [default: results/soak-<UTC timestamp>].
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// The myelin executable the router runs from [default: this one].
    #[arg(long)]
    pub router_bin: Option<PathBuf>,
}

/// Why the soak could not run (a FAIL verdict is not an error: it is the exit status).
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("starting the simulated engines: {0}")]
    Engines(#[from] myelin_sim::SimError),
    #[error(transparent)]
    Router(#[from] crate::router_process::RouterError),
    #[error("{0}")]
    Plot(#[from] crate::plot::PlotError),
    #[error("--{0} must be positive")]
    Settings(&'static str),
}

/// One RSS sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Seconds since the traffic started.
    pub elapsed_s: f64,
    pub rss_kib: u64,
    pub requests: u64,
    pub errors: u64,
    /// Blocks of routing history the router's first replica holds, summed over backends
    /// (`routed_blocks` of `GET /admin/backends`; `None` when it did not answer): the bounded
    /// structure that fills slowest (LRU-bounded at `max_blocks` per replica).
    pub routed_blocks: Option<u64>,
    /// Blocks its KV-event mirrors hold, summed over backends (`resident_blocks`).
    pub mirrored_blocks: Option<u64>,
}

/// `routed_blocks` and `resident_blocks` summed over the backends of a `GET /admin/backends`
/// answer.
fn history_blocks(admin: &str) -> (Option<u64>, Option<u64>) {
    let Ok(response) =
        crate::blocking_http::get(&format!("{admin}/admin/backends"), Duration::from_secs(5))
    else {
        return (None, None);
    };
    let Ok(listing) = serde_json::from_str::<serde_json::Value>(&response.body) else {
        return (None, None);
    };
    let sum = |key: &str| {
        listing["backends"].as_array().map(|backends| {
            backends
                .iter()
                .filter_map(|backend| backend[key].as_u64())
                .sum()
        })
    };
    (sum("routed_blocks"), sum("resident_blocks"))
}

/// The soak's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub pass: bool,
    /// The first sample at or after the warm-up.
    pub baseline: Sample,
    /// The last sample.
    pub last: Sample,
    /// `last` over `baseline`, in percent.
    pub growth_percent: f64,
    pub line: String,
}

/// Judges `samples` (in time order): PASS when no request failed and the last sample's RSS is
/// at most `max_growth_percent` above the first one taken at or after `warm_up_s`. `None`
/// without a sample after the warm-up.
pub fn judge(samples: &[Sample], warm_up_s: f64, max_growth_percent: f64) -> Option<Verdict> {
    let baseline = *samples
        .iter()
        .find(|sample| sample.elapsed_s >= warm_up_s)?;
    let last = *samples.last()?;
    let growth_percent = (last.rss_kib as f64 / baseline.rss_kib.max(1) as f64 - 1.0) * 100.0;
    let pass = last.errors == 0 && growth_percent <= max_growth_percent;
    let mib = |kib: u64| kib as f64 / 1024.0;
    let line = format!(
        "soak: {}: {} requests in {:.0} s, {} errors; router RSS {:.1} MiB after the warm-up ({:.0} s), \
         {:.1} MiB at the end ({:+.1}%, limit +{:.0}%)",
        if pass { "PASS" } else { "FAIL" },
        last.requests,
        last.elapsed_s,
        last.errors,
        mib(baseline.rss_kib),
        baseline.elapsed_s,
        mib(last.rss_kib),
        growth_percent,
        max_growth_percent,
    );
    Some(Verdict {
        pass,
        baseline,
        last,
        growth_percent,
        line,
    })
}

/// The router's resident set size in KiB (`VmRSS` of `/proc/PID/status`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Prefixes in use at once; the set rotates (one new prefix in, the oldest out) every
/// [`ROTATE_EVERY`] requests, so over a long run the prompts never stop being new.
const ACTIVE_PREFIXES: u64 = 200;
const ROTATE_EVERY: u64 = 20;
/// Words of a prefix (about 3 tokens each with the bundled tokenizer: ~1,500 tokens).
const PREFIX_WORDS: usize = 500;
/// Deadline of one request (connect, send, whole answer): a hang is an error, not a stall.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The chat request of global request number `sequence` (client `client`).
fn request_body(sequence: u64, client: usize, stream: bool) -> String {
    let first = sequence / ROTATE_EVERY;
    let prefix = first + (sequence.wrapping_mul(2_654_435_761) % ACTIVE_PREFIXES);
    let words: Vec<String> = (0..PREFIX_WORDS)
        .map(|word| format!("p{prefix}w{}", word % 89))
        .collect();
    serde_json::json!({
        "model": myelin_sim::DEFAULT_MODEL_NAME,
        "stream": stream,
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": words.join(" ")},
            {"role": "user", "content": format!("question {sequence} from client {client}")},
        ],
    })
    .to_string()
}

/// One keep-alive connection to the router.
struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    fn open(addr: &str) -> std::io::Result<Connection> {
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
        stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            reader: BufReader::new(stream),
        })
    }

    /// POSTs `body`; returns the status and the whole body (chunked or with a length).
    /// [`PostError::Stale`] when the request could not be sent or the connection closed before
    /// any byte of an answer (a keep-alive connection the server had closed: sent again on a
    /// new one).
    fn post(&mut self, body: &str) -> Result<(u16, Vec<u8>), PostError> {
        let mut line = String::new();
        self.send(body)
            .and_then(|()| match self.reader.read_line(&mut line) {
                Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => Ok(()),
                Err(error) => Err(error),
            })
            .map_err(|error| match error.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    PostError::Failed(format!("no answer within {REQUEST_TIMEOUT:?}"))
                }
                _ => PostError::Stale(error.to_string()),
            })?;
        self.answer(line).map_err(PostError::Failed)
    }

    fn send(&mut self, body: &str) -> std::io::Result<()> {
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body.as_bytes())
    }

    /// Reads the rest of an answer whose status line is `line`.
    fn answer(&mut self, mut line: String) -> Result<(u16, Vec<u8>), String> {
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| format!("bad status line {line:?}"))?;
        let mut length = None;
        let mut chunked = false;
        loop {
            line.clear();
            self.read_line(&mut line)?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                let value = value.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.parse::<usize>().ok();
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    chunked = value.to_ascii_lowercase().contains("chunked");
                }
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                self.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                    .map_err(|_| format!("bad chunk size {line:?}"))?;
                let mut chunk = vec![0; size + 2];
                self.reader
                    .read_exact(&mut chunk)
                    .map_err(|error| format!("chunk: {error}"))?;
                if size == 0 {
                    break;
                }
                chunk.truncate(size);
                body.extend(chunk);
            }
        } else if let Some(length) = length {
            body.resize(length, 0);
            self.reader
                .read_exact(&mut body)
                .map_err(|error| format!("body: {error}"))?;
        } else {
            return Err("an answer with neither a length nor chunks".into());
        }
        Ok((status, body))
    }

    fn read_line(&mut self, line: &mut String) -> Result<(), String> {
        match self.reader.read_line(line) {
            Ok(0) => Err("connection closed".into()),
            Ok(_) => Ok(()),
            Err(error) => Err(format!("read: {error}")),
        }
    }
}

/// Why a request got no answer.
enum PostError {
    /// Nothing came back on a connection that may have been closed while idle.
    Stale(String),
    Failed(String),
}

/// What the clients share.
struct Traffic {
    addr: String,
    sequence: AtomicU64,
    requests: AtomicU64,
    errors: AtomicU64,
    /// Requests sent again on a new connection because the kept-alive one had been closed.
    resent: AtomicU64,
    stop: AtomicBool,
    /// The first errors, for the summary.
    first_errors: std::sync::Mutex<Vec<String>>,
}

impl Traffic {
    fn error(&self, message: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut first = self
            .first_errors
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if first.len() < 10 {
            first.push(message);
        }
    }
}

fn client_loop(traffic: &Traffic, client: usize) {
    let mut connection: Option<Connection> = None;
    let mut turn = 0usize;
    while !traffic.stop.load(Ordering::Relaxed) {
        turn += 1;
        let stream = (client + turn).is_multiple_of(2);
        let sequence = traffic.sequence.fetch_add(1, Ordering::Relaxed);
        let body = request_body(sequence, client, stream);
        let reused = match connection.take() {
            Some(mut open) => match open.post(&body) {
                Ok(answer) => Some(Ok((open, answer))),
                Err(PostError::Stale(_)) => {
                    traffic.resent.fetch_add(1, Ordering::Relaxed);
                    None
                }
                Err(PostError::Failed(problem)) => Some(Err(problem)),
            },
            None => None,
        };
        let answered = reused.unwrap_or_else(|| {
            let mut open =
                Connection::open(&traffic.addr).map_err(|error| format!("connect: {error}"))?;
            match open.post(&body) {
                Ok(answer) => Ok((open, answer)),
                Err(PostError::Stale(problem) | PostError::Failed(problem)) => Err(problem),
            }
        });
        match answered {
            Ok((open, (200, body))) => {
                let complete = if stream {
                    body.ends_with(b"data: [DONE]\n\n")
                } else {
                    serde_json::from_slice::<serde_json::Value>(&body)
                        .is_ok_and(|value| value["choices"].is_array())
                };
                if complete {
                    traffic.requests.fetch_add(1, Ordering::Relaxed);
                    connection = Some(open);
                } else {
                    traffic.error(format!(
                        "request {sequence}: incomplete answer: {}",
                        String::from_utf8_lossy(&body[body.len().saturating_sub(200)..])
                    ));
                }
            }
            Ok((_, (status, body))) => traffic.error(format!(
                "request {sequence}: status {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(300)])
            )),
            Err(problem) => traffic.error(format!("request {sequence}: {problem}")),
        }
    }
}

/// `myelin bench soak`.
pub fn run(args: SoakArgs) -> Result<ExitCode, SoakError> {
    if args.duration == 0 {
        return Err(SoakError::Settings("duration"));
    }
    if args.sample_interval == 0 {
        return Err(SoakError::Settings("sample-interval"));
    }
    if args.clients == 0 {
        return Err(SoakError::Settings("clients"));
    }
    if args.engines == 0 {
        return Err(SoakError::Settings("engines"));
    }
    let warm_up = args.warm_up.unwrap_or((args.duration / 4).min(900));
    let crate::runner::RunSetup {
        out_dir,
        router_exe,
        interrupted,
    } = crate::runner::run_setup(
        args.out.as_deref(),
        PathBuf::from("results").join(format!("soak-{}", crate::report::utc_now().1)),
        args.router_bin.as_deref(),
    )
    .map_err(|(what, path, source)| SoakError::Io {
        what,
        path: path.display().to_string(),
        source,
    })?;

    let sim = myelin_sim::SimCluster::start(myelin_sim::ClusterConfig {
        engines: args.engines,
        speedup: args.speedup,
        kv_events: Some(myelin_sim::KvEventsConfig::default()),
        ..myelin_sim::ClusterConfig::default()
    })?;
    let port = free_port()?;
    let admin_port = free_port()?;
    let admin = format!("http://127.0.0.1:{admin_port}");
    let mut serve: Vec<String> = [
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--admin-listen",
        &format!("127.0.0.1:{admin_port}"),
        "--shards",
        "2",
        "--no-pin",
    ]
    .iter()
    .map(|arg| arg.to_string())
    .collect();
    for (url, events) in sim.engine_urls().iter().zip(sim.kv_event_endpoints()) {
        serve.push("--backend".into());
        serve.push(match events {
            Some(events) => format!(
                "{url},kv-events={},kv-replay={}",
                events.publish, events.replay
            ),
            None => url.clone(),
        });
    }
    let description = format!("{} {}", router_exe.display(), serve.join(" "));
    let mut command = Command::new(&router_exe);
    command.args(&serve);
    let router = RouterProcess::start_command(
        "myelin",
        command,
        description.clone(),
        port,
        &out_dir.join("logs").join("router.log"),
        crate::router_process::ROUTER_START_TIMEOUT,
    )?;
    let pid = router.pid();
    eprintln!(
        "myelin bench soak: {} s of churn ({} clients, {} simulated engines at {}x), RSS every {} s, \
         baseline after {warm_up} s; output in {}\n  $ {description}",
        args.duration,
        args.clients,
        args.engines,
        args.speedup,
        args.sample_interval,
        out_dir.display()
    );

    let traffic = Arc::new(Traffic {
        addr: format!("127.0.0.1:{port}"),
        sequence: AtomicU64::new(0),
        requests: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        resent: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        first_errors: std::sync::Mutex::new(Vec::new()),
    });
    let clients: Vec<_> = (0..args.clients)
        .map(|client| {
            let traffic = traffic.clone();
            std::thread::spawn(move || client_loop(&traffic, client))
        })
        .collect();

    let started = Instant::now();
    let interval = Duration::from_secs(args.sample_interval);
    let end = started + Duration::from_secs(args.duration);
    let mut samples = Vec::new();
    let mut next = started;
    let mut stopped_early = false;
    loop {
        let now = Instant::now();
        if now >= next {
            let Some(rss) = rss_kib(pid) else {
                stopped_early = true;
                traffic.error("the router process is gone".into());
                break;
            };
            let (routed_blocks, mirrored_blocks) = history_blocks(&admin);
            let sample = Sample {
                elapsed_s: now.duration_since(started).as_secs_f64(),
                rss_kib: rss,
                requests: traffic.requests.load(Ordering::Relaxed),
                errors: traffic.errors.load(Ordering::Relaxed),
                routed_blocks,
                mirrored_blocks,
            };
            let blocks = |blocks: Option<u64>| blocks.map_or("-".into(), |b| b.to_string());
            eprintln!(
                "  {:>6.0} s  RSS {:>8.1} MiB  {:>9} requests  {} errors  history {} blocks  \
                 mirrors {} blocks",
                sample.elapsed_s,
                rss as f64 / 1024.0,
                sample.requests,
                sample.errors,
                blocks(routed_blocks),
                blocks(mirrored_blocks),
            );
            samples.push(sample);
            if now >= end {
                break;
            }
            next += interval;
            if next > end {
                next = end;
            }
        }
        if interrupted.load(Ordering::Relaxed) {
            stopped_early = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100).min(next.saturating_duration_since(now)));
    }
    traffic.stop.store(true, Ordering::Relaxed);
    for client in clients {
        let _ = client.join();
    }
    router.stop();
    sim.shutdown();

    write_csv(&out_dir.join("rss.csv"), &samples)?;
    let verdict = judge(&samples, warm_up as f64, args.max_growth_percent);
    let limit_kib = verdict
        .as_ref()
        .map(|verdict| verdict.baseline.rss_kib as f64 * (1.0 + args.max_growth_percent / 100.0));
    plot_rss(
        &out_dir.join("rss.png"),
        &samples,
        warm_up as f64,
        limit_kib,
    )?;
    let line = match &verdict {
        Some(verdict) if !stopped_early => verdict.line.clone(),
        Some(verdict) => format!("soak: FAIL: stopped early; {}", verdict.line),
        None => format!(
            "soak: FAIL: no sample after the warm-up ({warm_up} s); {} samples",
            samples.len()
        ),
    };
    let pass = !stopped_early && verdict.as_ref().is_some_and(|verdict| verdict.pass);
    let first_errors = traffic
        .first_errors
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    write_summary(
        &out_dir.join("summary.md"),
        &args,
        warm_up,
        &description,
        &line,
        &samples,
        &first_errors,
        traffic.resent.load(Ordering::Relaxed),
    )?;
    for error in &first_errors {
        eprintln!("  error: {error}");
    }
    println!("{line}");
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SoakError + use<> {
    let path = path.display().to_string();
    move |source| SoakError::Io { what, path, source }
}

/// `rss.csv`: one row per sample.
fn write_csv(path: &Path, samples: &[Sample]) -> Result<(), SoakError> {
    let mut text =
        String::from("elapsed_s,rss_kib,requests,errors,routed_blocks,mirrored_blocks\n");
    let blocks = |blocks: Option<u64>| blocks.map_or(String::new(), |b| b.to_string());
    for sample in samples {
        text.push_str(&format!(
            "{:.1},{},{},{},{},{}\n",
            sample.elapsed_s,
            sample.rss_kib,
            sample.requests,
            sample.errors,
            blocks(sample.routed_blocks),
            blocks(sample.mirrored_blocks),
        ));
    }
    std::fs::write(path, text).map_err(io_error("writing", path))
}

#[allow(clippy::too_many_arguments)]
fn write_summary(
    path: &Path,
    args: &SoakArgs,
    warm_up: u64,
    router_command: &str,
    line: &str,
    samples: &[Sample],
    first_errors: &[String],
    resent: u64,
) -> Result<(), SoakError> {
    let mut text = format!(
        "# myelin bench soak\n\n{line}\n\n- command: `{}`\n- router: `{router_command}`\n\
         - {} s, {} clients, {} simulated engines at {}x, RSS every {} s, baseline: the first \
         sample at or after {warm_up} s, limit +{}%\n- requests sent again on a new connection because the \
         router had closed the kept-alive one before answering: {resent}\n\n\
         | s | RSS (MiB) | requests | errors | history blocks | mirror blocks |\n\
         |---|---|---|---|---|---|\n",
        std::env::args().collect::<Vec<_>>().join(" "),
        args.duration,
        args.clients,
        args.engines,
        args.speedup,
        args.sample_interval,
        args.max_growth_percent,
    );
    for sample in samples {
        let blocks = |blocks: Option<u64>| blocks.map_or("-".into(), |b| b.to_string());
        text.push_str(&format!(
            "| {:.0} | {:.1} | {} | {} | {} | {} |\n",
            sample.elapsed_s,
            sample.rss_kib as f64 / 1024.0,
            sample.requests,
            sample.errors,
            blocks(sample.routed_blocks),
            blocks(sample.mirrored_blocks),
        ));
    }
    if !first_errors.is_empty() {
        text.push_str("\nFirst errors:\n\n");
        for error in first_errors {
            text.push_str(&format!("- {error}\n"));
        }
    }
    std::fs::write(path, text).map_err(io_error("writing", path))
}

/// `rss.png`: RSS over time, the end of the warm-up and the PASS limit.
fn plot_rss(
    path: &Path,
    samples: &[Sample],
    warm_up_s: f64,
    limit_kib: Option<f64>,
) -> Result<(), SoakError> {
    crate::plot::register_font()?;
    let draw = |error: String| crate::plot::PlotError::Draw {
        path: path.display().to_string(),
        message: error,
    };
    let mib = |kib: f64| kib / 1024.0;
    let points: Vec<(f64, f64)> = samples
        .iter()
        .map(|sample| (sample.elapsed_s, mib(sample.rss_kib as f64)))
        .collect();
    let x_high = points.last().map_or(1.0, |point| point.0).max(1.0);
    let y_high = points
        .iter()
        .map(|point| point.1)
        .chain(limit_kib.map(mib))
        .fold(1.0f64, f64::max)
        * 1.15;
    let root = BitMapBackend::new(path, (1200, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|error| draw(error.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("myelin serve RSS under churn", ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(90)
        .build_cartesian_2d(0.0..x_high, 0.0..y_high)
        .map_err(|error| draw(error.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the start")
        .y_desc("RSS (MiB)")
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    chart
        .draw_series(LineSeries::new(points.clone(), BLUE.stroke_width(3)))
        .map_err(|error| draw(error.to_string()))?
        .label("router RSS")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLUE.stroke_width(3)));
    chart
        .draw_series(
            points
                .iter()
                .map(|&point| Circle::new(point, 3, BLUE.filled())),
        )
        .map_err(|error| draw(error.to_string()))?;
    chart
        .draw_series(LineSeries::new(
            vec![(warm_up_s, 0.0), (warm_up_s, y_high)],
            BLACK.stroke_width(1),
        ))
        .map_err(|error| draw(error.to_string()))?
        .label("end of the warm-up")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(1)));
    if let Some(limit) = limit_kib {
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, mib(limit)), (x_high, mib(limit))],
                RED.stroke_width(2),
            ))
            .map_err(|error| draw(error.to_string()))?
            .label("PASS limit")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], RED.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|error| draw(error.to_string()))?;
    root.present().map_err(|error| draw(error.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(elapsed_s: f64, rss_kib: u64, errors: u64) -> Sample {
        Sample {
            elapsed_s,
            rss_kib,
            requests: (elapsed_s * 10.0) as u64,
            errors,
            routed_blocks: None,
            mirrored_blocks: None,
        }
    }

    #[test]
    fn judges_against_the_first_sample_after_the_warm_up() {
        let flat = [
            sample(0.0, 50_000, 0),
            sample(10.0, 100_000, 0),
            sample(20.0, 104_000, 0),
            sample(30.0, 109_000, 0),
        ];
        let verdict = judge(&flat, 10.0, 10.0).unwrap();
        assert!(verdict.pass, "{}", verdict.line);
        assert_eq!(verdict.baseline.rss_kib, 100_000);
        assert!(verdict.line.starts_with("soak: PASS"), "{}", verdict.line);
        // The growth before the warm-up's end does not count; after it, it does.
        let growing = [
            sample(0.0, 50_000, 0),
            sample(10.0, 100_000, 0),
            sample(30.0, 111_000, 0),
        ];
        let verdict = judge(&growing, 5.0, 10.0).unwrap();
        assert!(!verdict.pass);
        assert!(verdict.line.starts_with("soak: FAIL"), "{}", verdict.line);
        // One error fails a flat run.
        let erred = [sample(10.0, 100_000, 0), sample(20.0, 100_000, 1)];
        assert!(!judge(&erred, 0.0, 10.0).unwrap().pass);
        // No sample after the warm-up: no verdict.
        assert_eq!(judge(&flat, 40.0, 10.0), None);
    }

    #[test]
    fn prompts_rotate_and_never_repeat() {
        let body = |sequence| request_body(sequence, 0, false);
        assert_ne!(body(1), body(2));
        let prefix_of = |text: String| {
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            value["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        // Early prefixes leave the active set as the run goes on.
        let early: std::collections::HashSet<String> =
            (0..200).map(|s| prefix_of(body(s))).collect();
        let late: std::collections::HashSet<String> =
            (100_000..100_200).map(|s| prefix_of(body(s))).collect();
        assert!(early.is_disjoint(&late));
        assert!(early.len() > 50, "{} prefixes", early.len());
    }

    #[test]
    fn reads_this_process_rss() {
        assert!(rss_kib(std::process::id()).is_some_and(|rss| rss > 0));
    }
}
