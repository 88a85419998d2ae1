//! Router legs as subprocesses: `myelin serve` (this same binary) or an external router from a
//! command line, started on a free loopback port, waited for, scraped, and stopped. Every
//! process is started in its own process group and only that group is signalled.

use std::fs::File;
use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::blocking_http;
use crate::legs::{LegKind, external_command};

/// How long a router gets to answer its health check.
pub const ROUTER_START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a router gets to exit after SIGTERM before SIGKILL.
const ROUTER_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a router could not be run.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("finding a free port: {0}")]
    Port(std::io::Error),
    #[error("creating router log {path}: {source}")]
    Log {
        path: String,
        source: std::io::Error,
    },
    #[error("starting router `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("router `{name}` exited before it was ready ({status}); last lines of {log}:\n{tail}")]
    ExitedEarly {
        name: String,
        status: String,
        log: String,
        tail: String,
    },
    #[error("router `{name}` did not answer GET /health within {seconds} s; see {log}")]
    NotReady {
        name: String,
        seconds: u64,
        log: String,
    },
}

/// One engine as a router backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendEndpoint {
    /// `http://HOST:PORT` (loopback for simulated engines).
    pub url: String,
    /// The engine's KV-event publisher, when it has one.
    pub kv_events: Option<String>,
    /// The engine's KV-event replay socket, when it has one.
    pub kv_replay: Option<String>,
    /// `capacity-tokens=` for the router (engines without a metrics endpoint).
    pub capacity_tokens: Option<u64>,
}

/// A running router.
pub struct RouterProcess {
    name: String,
    child: Child,
    base_url: String,
    /// Where readiness and `/metrics` are read in plain HTTP: `base_url`'s `/health` and
    /// `/metrics`, or (a router serving clients over TLS) its `--metrics-listen` port's
    /// `/metrics` for both.
    probe: Probe,
    log_path: PathBuf,
    /// Set once the group has been stopped, so that a drop after `stop` signals nothing.
    stopped: bool,
}

/// Where a router's readiness and metrics are read.
#[derive(Debug, Clone)]
enum Probe {
    /// `GET /health` and `GET /metrics` on the client port.
    ClientPort,
    /// `GET /metrics` on this plain-HTTP base URL, for both.
    MetricsListener(String),
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> Result<u16, RouterError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(RouterError::Port)?;
    listener
        .local_addr()
        .map(|address| address.port())
        .map_err(RouterError::Port)
}

/// The `myelin serve` arguments for a leg.
/// The router's time-based settings, scaled to the simulation's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterTiming {
    /// `--engine-metrics-interval-ms`.
    pub engine_metrics_interval_ms: u64,
    /// `--pending-resident-ms`.
    pub pending_resident_ms: u64,
    /// `--gossip-probe-interval-ms` (peer clusters only).
    pub gossip_probe_interval_ms: u64,
}

impl RouterTiming {
    /// `myelin serve`'s defaults (1 s scrapes, 2 s pending residency, 500 ms gossip probes) in
    /// simulated time: the engines run `speedup` times faster than the router's wall clock.
    pub fn scaled(speedup: f64) -> Self {
        let scale = |ms: f64| (ms / speedup.max(1e-3)).round().max(10.0) as u64;
        RouterTiming {
            engine_metrics_interval_ms: scale(1000.0),
            pending_resident_ms: scale(2000.0),
            gossip_probe_interval_ms: scale(500.0),
        }
    }
}

/// [`serve_args`] for one node of a several-node leg: its own flags ([`node_args`]) before the
/// `--router-arg`s, which stay last; a `--router-arg` setting one of the node's flags replaces
/// it (node flags come in pairs: flag, value).
pub fn node_serve_args(
    kind: LegKind,
    port: u16,
    backends: &[BackendEndpoint],
    timing: &RouterTiming,
    node_args: &[String],
    extra: &[String],
) -> Vec<String> {
    let mut args = serve_args(kind, port, backends, timing, extra);
    let at = args.len() - extra.len();
    let own: Vec<String> = node_args
        .chunks(2)
        .filter(|pair| !overridden(extra, &pair[0]))
        .flatten()
        .cloned()
        .collect();
    args.splice(at..at, own);
    args
}

/// Whether `extra` (`--router-arg`s) sets `flag`.
fn overridden(extra: &[String], flag: &str) -> bool {
    extra
        .iter()
        .any(|arg| arg == flag || arg.starts_with(&format!("{flag}=")))
}

/// `myelin serve`'s arguments for a router leg; `extra` (`--router-arg`) go last, and a flag
/// among them replaces the harness's own setting of it.
pub fn serve_args(
    kind: LegKind,
    port: u16,
    backends: &[BackendEndpoint],
    timing: &RouterTiming,
    extra: &[String],
) -> Vec<String> {
    let overridden = |flag: &str| overridden(extra, flag);
    let mut args: Vec<String> = [
        "serve",
        "--listen",
        &format!("127.0.0.1:{port}"),
        // The admin API is not used; a free port keeps routers from colliding on its default.
        "--admin-listen",
        "127.0.0.1:0",
        // The harness scrapes /metrics where it sends its requests.
        "--metrics-on-client-port",
        "--no-pin",
    ]
    .iter()
    .map(|arg| arg.to_string())
    .collect();
    // Two data cores, and time-based settings at a real deployment's defaults in simulated time.
    for (flag, value) in [
        ("--shards", 2),
        (
            "--engine-metrics-interval-ms",
            timing.engine_metrics_interval_ms,
        ),
        ("--pending-resident-ms", timing.pending_resident_ms),
    ] {
        if !overridden(flag) {
            args.push(flag.to_string());
            args.push(value.to_string());
        }
    }
    args.extend(kind.router_flags().iter().map(|flag| flag.to_string()));
    for backend in backends {
        args.push("--backend".into());
        let mut spec = backend.url.clone();
        if let (Some(kv_events), true) = (&backend.kv_events, kind.wants_kv_events()) {
            spec.push_str(&format!(",kv-events={kv_events}"));
            if let Some(replay) = &backend.kv_replay {
                spec.push_str(&format!(",kv-replay={replay}"));
            }
        }
        if let Some(capacity) = backend.capacity_tokens {
            spec.push_str(&format!(",capacity-tokens={capacity}"));
        }
        args.push(spec);
    }
    args.extend(extra.iter().cloned());
    args
}

impl RouterProcess {
    /// Starts `myelin serve` for a router leg (with `node_args`, a peer-cluster node's own
    /// flags: see [`node_args`]) and waits until it is healthy.
    #[allow(clippy::too_many_arguments)]
    pub fn start_myelin(
        exe: &Path,
        name: &str,
        kind: LegKind,
        backends: &[BackendEndpoint],
        timing: &RouterTiming,
        node_args: &[String],
        extra: &[String],
        log_path: &Path,
    ) -> Result<Self, RouterError> {
        let port = free_port()?;
        let args = node_serve_args(kind, port, backends, timing, node_args, extra);
        let mut command = Command::new(exe);
        command.args(&args);
        let description = format!("{} {}", exe.display(), args.join(" "));
        Self::spawn(name, command, description, port, log_path)
    }

    /// Starts an external router from its command template (run by `sh -c`) and waits until
    /// it is healthy.
    pub fn start_external(
        name: &str,
        template: &str,
        backends: &[BackendEndpoint],
        log_path: &Path,
    ) -> Result<Self, RouterError> {
        let port = free_port()?;
        let urls: Vec<String> = backends.iter().map(|backend| backend.url.clone()).collect();
        let line = external_command(template, port, &urls);
        let mut command = Command::new("sh");
        command.arg("-c").arg(&line);
        Self::spawn(name, command, line, port, log_path)
    }

    fn spawn(
        name: &str,
        command: Command,
        description: String,
        port: u16,
        log_path: &Path,
    ) -> Result<Self, RouterError> {
        Self::start_command(
            name,
            command,
            description,
            port,
            log_path,
            ROUTER_START_TIMEOUT,
        )
    }

    /// Starts `command` (a router that will listen on `port`) in its own process group with
    /// its output in `log_path`, and waits up to `start_timeout` for GET /health to answer
    /// 200. The process group is stopped when the returned value is dropped.
    pub fn start_command(
        name: &str,
        command: Command,
        description: String,
        port: u16,
        log_path: &Path,
        start_timeout: Duration,
    ) -> Result<Self, RouterError> {
        let base_url = format!("http://127.0.0.1:{port}");
        Self::start_probed(
            name,
            command,
            description,
            base_url,
            Probe::ClientPort,
            log_path,
            start_timeout,
        )
    }

    /// As [`RouterProcess::start_command`], for a `myelin serve` that serves clients over TLS
    /// on `port` and its metrics in plain HTTP on `metrics_port` (`--metrics-listen`): ready
    /// once `GET /metrics` answers there, which is where its metrics are read.
    pub fn start_command_tls(
        name: &str,
        command: Command,
        description: String,
        (port, metrics_port): (u16, u16),
        log_path: &Path,
        start_timeout: Duration,
    ) -> Result<Self, RouterError> {
        Self::start_probed(
            name,
            command,
            description,
            format!("https://127.0.0.1:{port}"),
            Probe::MetricsListener(format!("http://127.0.0.1:{metrics_port}")),
            log_path,
            start_timeout,
        )
    }

    fn start_probed(
        name: &str,
        mut command: Command,
        description: String,
        base_url: String,
        probe: Probe,
        log_path: &Path,
        start_timeout: Duration,
    ) -> Result<Self, RouterError> {
        let log_error = |source| RouterError::Log {
            path: log_path.display().to_string(),
            source,
        };
        let log = File::create(log_path).map_err(log_error)?;
        let log_for_stderr = log.try_clone().map_err(log_error)?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_for_stderr))
            // Its own process group, so stopping it reaches the children a shell starts.
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
        // which is async-signal-safe. It asks the kernel to kill the router if this process
        // dies without stopping it (SIGKILL, a crash), so no router outlives the harness.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|source| RouterError::Spawn {
            command: description,
            source,
        })?;
        let mut router = RouterProcess {
            name: name.to_string(),
            child,
            base_url,
            probe,
            log_path: log_path.to_path_buf(),
            stopped: false,
        };
        router.wait_ready(start_timeout)?;
        Ok(router)
    }

    /// `http://127.0.0.1:PORT` (`https://` for a router started with
    /// [`RouterProcess::start_command_tls`]).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The process id of the router (for an external router, of the shell or wrapper that
    /// leads its process group; the group id is the same number).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), RouterError> {
        let deadline = Instant::now() + timeout;
        let health = match &self.probe {
            Probe::ClientPort => format!("{}/health", self.base_url),
            Probe::MetricsListener(url) => format!("{url}/metrics"),
        };
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(RouterError::ExitedEarly {
                    name: self.name.clone(),
                    status: status.to_string(),
                    log: self.log_path.display().to_string(),
                    tail: log_tail(&self.log_path, 20),
                });
            }
            if let Ok(response) = blocking_http::get(&health, Duration::from_secs(2))
                && response.status == 200
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(RouterError::NotReady {
            name: self.name.clone(),
            seconds: timeout.as_secs(),
            log: self.log_path.display().to_string(),
        })
    }

    /// The router's /metrics text, or `None` if it has none or did not answer.
    pub fn scrape_metrics(&self) -> Option<String> {
        let base = match &self.probe {
            Probe::ClientPort => &self.base_url,
            Probe::MetricsListener(url) => url,
        };
        let response =
            blocking_http::get(&format!("{base}/metrics"), Duration::from_secs(5)).ok()?;
        (response.status == 200).then_some(response.body)
    }

    /// Stops the router: SIGTERM to its process group, SIGKILL if it is still there after the
    /// drain deadline.
    pub fn stop(mut self) {
        self.terminate();
    }

    /// SIGTERM to the process group, then SIGKILL to whatever of the group is left once the
    /// leader has exited or the drain deadline has passed: a wrapper (a shell, a Python
    /// launcher) can exit on SIGTERM before the server it started, and a server left behind
    /// keeps its ports (an external router's metrics port made the next repeat's start fail).
    fn terminate(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let group = self.child.id() as libc::pid_t;
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            // SAFETY: kill(2) on the process group this harness created for its own child.
            unsafe {
                libc::kill(-group, libc::SIGTERM);
            }
            let deadline = Instant::now() + ROUTER_STOP_TIMEOUT;
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // SAFETY: as above. Linux does not hand out a pid while a process group of that id
        // has members, so after the leader is reaped the id names only what is left of this
        // group (ESRCH when nothing is).
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// Distinct loopback UDP ports nobody listens on right now (all bound at once, then freed).
pub fn free_udp_ports(count: usize) -> Result<Vec<u16>, RouterError> {
    let sockets = (0..count)
        .map(|_| UdpSocket::bind("127.0.0.1:0").map_err(RouterError::Port))
        .collect::<Result<Vec<_>, _>>()?;
    sockets
        .iter()
        .map(|socket| {
            socket
                .local_addr()
                .map(|address| address.port())
                .map_err(RouterError::Port)
        })
        .collect()
}

/// Writes a fresh random cluster key (32 bytes from /dev/urandom, hex: 64 characters) to
/// `path`.
pub fn write_cluster_key(path: &Path) -> Result<(), RouterError> {
    let log_error = |source| RouterError::Log {
        path: path.display().to_string(),
        source,
    };
    let mut bytes = [0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut random| random.read_exact(&mut bytes))
        .map_err(log_error)?;
    let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    std::fs::write(path, hex + "\n").map_err(log_error)
}

/// How the nodes of a several-node router leg find each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gossip {
    /// Every node's gossip UDP port on 127.0.0.1, by node index.
    pub ports: Vec<u16>,
    /// The cluster key file, the same for every node.
    pub key_file: PathBuf,
    /// `--gossip-probe-interval-ms`.
    pub probe_interval_ms: u64,
}

/// Node `index`'s own `myelin serve` flags: with gossip, its gossip address, every other
/// node as a `--peer`, `--node-id node<index>`, the key file and the probe interval; without,
/// none (the nodes run independently).
pub fn node_args(index: usize, gossip: Option<&Gossip>) -> Vec<String> {
    let Some(gossip) = gossip else {
        return Vec::new();
    };
    let mut args = vec![
        "--gossip-listen".to_string(),
        format!("127.0.0.1:{}", gossip.ports[index]),
        "--node-id".to_string(),
        format!("node{index}"),
        "--cluster-key-file".to_string(),
        gossip.key_file.display().to_string(),
        "--gossip-probe-interval-ms".to_string(),
        gossip.probe_interval_ms.to_string(),
    ];
    for (other, port) in gossip.ports.iter().enumerate() {
        if other != index {
            args.push("--peer".to_string());
            args.push(format!("127.0.0.1:{port}"));
        }
    }
    args
}

/// The last `lines` lines of a log file.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legs::Residency;

    fn backends() -> Vec<BackendEndpoint> {
        vec![
            BackendEndpoint {
                url: "http://127.0.0.1:9001".into(),
                kv_events: Some("tcp://127.0.0.1:5557".into()),
                kv_replay: Some("tcp://127.0.0.1:5558".into()),
                capacity_tokens: None,
            },
            BackendEndpoint {
                url: "http://127.0.0.1:9002".into(),
                kv_events: None,
                kv_replay: None,
                capacity_tokens: Some(32_768),
            },
        ]
    }

    #[test]
    fn serve_args_name_the_policy_and_kv_events_only_where_used() {
        let timing = RouterTiming::scaled(10.0);
        assert_eq!(
            timing,
            RouterTiming {
                engine_metrics_interval_ms: 100,
                pending_resident_ms: 200,
                gossip_probe_interval_ms: 50,
            }
        );
        let args = serve_args(
            LegKind::Prefix(Residency::Off),
            8000,
            &backends(),
            &timing,
            &[],
        )
        .join(" ");
        assert_eq!(
            args,
            "serve --listen 127.0.0.1:8000 --admin-listen 127.0.0.1:0 --metrics-on-client-port \
             --no-pin --shards 2 \
             --engine-metrics-interval-ms 100 --pending-resident-ms 200 --routing prefix --residency off \
             --backend http://127.0.0.1:9001 --backend http://127.0.0.1:9002,capacity-tokens=32768"
        );
        let verified = serve_args(
            LegKind::Prefix(Residency::Verified),
            8000,
            &backends(),
            &timing,
            &[],
        )
        .join(" ");
        assert!(verified.contains(
            "--backend http://127.0.0.1:9001,kv-events=tcp://127.0.0.1:5557,\
                 kv-replay=tcp://127.0.0.1:5558"
        ));
        // A --router-arg replaces the harness's own setting of the same flag, and goes last.
        let extra = ["--pending-resident-ms=0".to_string()];
        let args = serve_args(
            LegKind::Prefix(Residency::Off),
            8000,
            &backends(),
            &timing,
            &extra,
        );
        assert!(
            !args.iter().any(|arg| arg == "--pending-resident-ms"),
            "{args:?}"
        );
        assert_eq!(
            args.last().map(String::as_str),
            Some("--pending-resident-ms=0")
        );
        assert!(args.iter().any(|arg| arg == "--engine-metrics-interval-ms"));
    }

    #[test]
    fn every_node_gossips_on_its_own_port_with_the_others_as_peers() {
        let dir = std::env::temp_dir().join(format!("myelin-bench-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key_file = dir.join("cluster.key");
        write_cluster_key(&key_file).unwrap();
        let key = std::fs::read_to_string(&key_file).unwrap();
        assert_eq!(key.trim().len(), 64, "{key}");
        assert!(key.trim().chars().all(|c| c.is_ascii_hexdigit()), "{key}");
        let ports = free_udp_ports(3).unwrap();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "{ports:?}");
        let gossip = Gossip {
            ports: ports.clone(),
            key_file: key_file.clone(),
            probe_interval_ms: RouterTiming::scaled(10.0).gossip_probe_interval_ms,
        };
        let value = |args: &[String], flag: &str| -> Vec<String> {
            args.windows(2)
                .filter(|pair| pair[0] == flag)
                .map(|pair| pair[1].clone())
                .collect()
        };
        for index in 0..3 {
            let args = node_args(index, Some(&gossip));
            assert_eq!(
                value(&args, "--gossip-listen"),
                [format!("127.0.0.1:{}", ports[index])]
            );
            assert_eq!(value(&args, "--node-id"), [format!("node{index}")]);
            assert_eq!(
                value(&args, "--cluster-key-file"),
                [key_file.display().to_string()]
            );
            assert_eq!(value(&args, "--gossip-probe-interval-ms"), ["50"]);
            let peers: Vec<String> = (0..3)
                .filter(|other| *other != index)
                .map(|other| format!("127.0.0.1:{}", ports[other]))
                .collect();
            assert_eq!(value(&args, "--peer"), peers);
        }
        assert!(node_args(1, None).is_empty());
        // In the full command line: before the --router-args, and replaced by one of them.
        let extra = ["--gossip-probe-interval-ms=200".to_string()];
        let args = node_serve_args(
            LegKind::Prefix(Residency::Auto),
            8000,
            &backends(),
            &RouterTiming::scaled(10.0),
            &node_args(2, Some(&gossip)),
            &extra,
        );
        assert!(!args.iter().any(|arg| arg == "--gossip-probe-interval-ms"));
        assert_eq!(value(&args, "--node-id"), ["node2"]);
        assert_eq!(value(&args, "--peer").len(), 2);
        assert_eq!(args.last(), extra.last());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_router_that_dies_is_reported_with_its_log() {
        let log =
            std::env::temp_dir().join(format!("myelin-bench-test-{}.log", std::process::id()));
        let error = RouterProcess::start_external(
            "broken",
            "echo no such router {port}; exit 3",
            &backends(),
            &log,
        )
        .err()
        .unwrap();
        match error {
            RouterError::ExitedEarly { tail, .. } => {
                assert!(tail.starts_with("no such router "), "{tail}")
            }
            other => panic!("unexpected {other}"),
        }
        let _ = std::fs::remove_file(log);
    }

    /// A wrapper that exits on SIGTERM before the server it started (which ignores SIGTERM):
    /// stopping the leg must still stop the server and free its port.
    #[test]
    fn stopping_a_wrapper_stops_the_server_it_left_behind() {
        let dir = std::env::temp_dir().join(format!("myelin-bench-wrapper-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let server = dir.join("server.py");
        std::fs::write(
            &server,
            "import http.server, signal, sys\n\
             signal.signal(signal.SIGTERM, signal.SIG_IGN)\n\
             class Health(http.server.BaseHTTPRequestHandler):\n\
             \x20   def do_GET(self):\n\
             \x20       self.send_response(200)\n\
             \x20       self.send_header('content-length', '0')\n\
             \x20       self.end_headers()\n\
             \x20   def log_message(self, *args):\n\
             \x20       pass\n\
             http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), Health).serve_forever()\n",
        )
        .unwrap();
        let template = format!(
            "python3 {} {{port}} & trap 'exit 0' TERM; wait",
            server.display()
        );
        let router =
            RouterProcess::start_external("wrapper", &template, &backends(), &dir.join("log"))
                .unwrap();
        let port: u16 = router
            .base_url()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        router.stop();
        // SIGKILL is delivered asynchronously: wait (with a deadline) for the listener to go.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut still_listening = true;
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                still_listening = false;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !still_listening,
            "the server the wrapper started still listens on {port}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
