//! Test support: the real `myelin serve` process, a minimal blocking HTTP/1.1 client that can
//! read a chunked response chunk by chunk, and the engine fixture.

#![allow(dead_code)]

pub mod engine;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Upper bound for any single wait in these tests (they normally take milliseconds).
pub const PATIENCE: Duration = Duration::from_secs(10);
/// Upper bound for a router's startup (the tokenizer's self-checks take seconds on a busy
/// shared machine; normally well under one).
pub const STARTUP_PATIENCE: Duration = Duration::from_secs(60);

/// A running `myelin serve`; killed when dropped.
pub struct Router {
    pub addr: SocketAddr,
    /// The admin API's address (`--admin-listen`, from the listening line).
    pub admin: Option<SocketAddr>,
    child: Child,
    pub stdout_lines: mpsc::Receiver<String>,
}

impl Router {
    /// Starts `myelin serve` with 2 unpinned shards on an ephemeral loopback port plus `args`.
    pub fn start(args: &[&str]) -> Router {
        Router::start_with_shards(2, args)
    }

    /// Starts `myelin serve` with `shards` unpinned shards on an ephemeral loopback port (and
    /// its admin API on another) plus `args`.
    pub fn start_with_shards(shards: usize, args: &[&str]) -> Router {
        let shards = shards.to_string();
        let mut all = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--shards",
            &shards,
            "--no-pin",
        ];
        all.extend_from_slice(args);
        Router::start_raw(&all, &[])
    }

    /// Starts the binary with exactly `args` and extra environment variables.
    pub fn start_raw(args: &[&str], env: &[(&str, &str)]) -> Router {
        let mut command = Command::new(env!("CARGO_BIN_EXE_myelin"));
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("spawn myelin");
        let stdout = child.stdout.take().expect("stdout");
        let (lines_sender, stdout_lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if lines_sender.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + STARTUP_PATIENCE;
        let (addr, admin) = loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let line = match stdout_lines.recv_timeout(remaining) {
                Ok(line) => line,
                Err(_) => {
                    let _ = child.kill();
                    panic!("myelin serve did not print its listening line");
                }
            };
            let after_scheme = |marker: &str| {
                let rest = line.split(marker).nth(1)?;
                rest.strip_prefix("http://")
                    .or_else(|| rest.strip_prefix("https://"))
            };
            if let Some(rest) = after_scheme("listening on ") {
                let addr_text = rest.split_whitespace().next().unwrap_or_default();
                let admin = after_scheme("admin on ").map(|rest| {
                    let end = rest.find([',', ')', ' ']).unwrap_or(rest.len());
                    rest[..end].parse().expect("admin address")
                });
                break (addr_text.parse().expect("listening address"), admin);
            }
        };
        Router {
            addr,
            admin,
            child,
            stdout_lines,
        }
    }

    /// The router's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The router process's resident set size in KiB (`VmRSS` in `/proc/PID/status`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the router's /proc status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// The admin API's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("the router printed no admin address")
    }

    /// A request to the admin API (no token).
    pub fn admin(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> HttpResponse {
        let body = body.map(|body| body.to_string());
        let headers: &[(&str, &str)] = if body.is_some() {
            &[("content-type", "application/json")]
        } else {
            &[]
        };
        request(
            self.admin_addr(),
            method,
            path,
            headers,
            body.as_deref().map(str::as_bytes),
        )
    }

    /// Sends SIGTERM (graceful drain).
    pub fn terminate(&self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "myelin serve did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        request(self.addr, "GET", path, &[], None)
    }

    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> HttpResponse {
        request(
            self.addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            Some(body.to_string().as_bytes()),
        )
    }

    /// POSTs `body` as JSON on a raw connection and leaves the answer unread: the request stays
    /// in flight at the engine that takes it until the stream is dropped.
    pub fn post_json_unread(&self, path: &str, body: &serde_json::Value) -> TcpStream {
        let body = body.to_string();
        let mut stream = TcpStream::connect(self.addr).expect("connect");
        write!(
            stream,
            "POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("write request");
        stream
    }

    /// GET /metrics on the admin API, as text.
    pub fn metrics(&self) -> String {
        let response = self.admin("GET", "/metrics", None);
        let status = response.status;
        let text = response.text();
        assert_eq!(status, 200, "{text}");
        text
    }

    /// The admin view of every backend, with a bearer token.
    pub fn backends_with_token(&self, token: &str) -> Vec<serde_json::Value> {
        let authorization = format!("Bearer {token}");
        let listing = request(
            self.admin_addr(),
            "GET",
            "/admin/backends",
            &[("authorization", &authorization)],
            None,
        )
        .json();
        listing["backends"].as_array().cloned().unwrap_or_default()
    }

    /// The admin view of every backend.
    pub fn backends(&self) -> Vec<serde_json::Value> {
        let listing = self.admin("GET", "/admin/backends", None).json();
        listing["backends"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `condition` every 10 ms until it holds (panics after [`PATIENCE`]).
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A response whose body is read on demand.
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    chunked: bool,
    content_length: Option<usize>,
    finished: bool,
}

/// Sends one request on a fresh connection (`Connection: close`).
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    let stream = TcpStream::connect(addr).expect("connect to router");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    send_on(stream, method, path, headers, body)
}

/// Sends one request on `stream`.
pub fn send_on(
    mut stream: TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("write head");
    if let Some(body) = body {
        // The router may answer (413) and close before reading all of a large body.
        let _ = stream.write_all(body);
    }
    read_response(stream)
}

/// Reads a response from `stream` (after the request was written by hand).
pub fn read_response(stream: TcpStream) -> HttpResponse {
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).expect("status line");
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    };
    let chunked = header("transfer-encoding").is_some_and(|value| value.contains("chunked"));
    let content_length = header("content-length").and_then(|value| value.parse().ok());
    HttpResponse {
        status,
        headers,
        reader,
        chunked,
        content_length,
        finished: false,
    }
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    /// The next chunk of a chunked body (`None` at its end or on a broken stream).
    pub fn next_chunk(&mut self) -> Option<Vec<u8>> {
        if self.finished {
            return None;
        }
        assert!(self.chunked, "not a chunked response");
        let mut size_line = String::new();
        if self.reader.read_line(&mut size_line).ok()? == 0 {
            self.finished = true;
            return None;
        }
        let size = usize::from_str_radix(size_line.trim().split(';').next()?, 16).ok()?;
        if size == 0 {
            self.finished = true;
            return None;
        }
        let mut chunk = vec![0; size + 2];
        self.reader.read_exact(&mut chunk).ok()?;
        chunk.truncate(size);
        Some(chunk)
    }

    /// The whole body (for chunked bodies: until the end or the break).
    pub fn body(mut self) -> Vec<u8> {
        if self.chunked {
            let mut body = Vec::new();
            while let Some(chunk) = self.next_chunk() {
                body.extend(chunk);
            }
            return body;
        }
        let mut body = Vec::new();
        match self.content_length {
            Some(length) => {
                body.resize(length, 0);
                self.reader.read_exact(&mut body).expect("body");
            }
            None => {
                let _ = self.reader.read_to_end(&mut body);
            }
        }
        body
    }

    pub fn text(self) -> String {
        String::from_utf8(self.body()).expect("utf-8 body")
    }

    pub fn json(self) -> serde_json::Value {
        let text = self.text();
        serde_json::from_str(&text).unwrap_or_else(|error| panic!("bad JSON {text:?}: {error}"))
    }

    /// Closes the connection without reading the rest.
    pub fn abandon(self) {
        let stream = self.reader.into_inner();
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

/// A streaming chat request body.
pub fn chat_body(content: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "test-model",
        "stream": stream,
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": "You are a test."},
            {"role": "user", "content": content},
        ],
    })
}

/// Value of a metric line (first sample whose name and labels contain all of `parts`).
pub fn metric_value(metrics: &str, parts: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| parts.iter().all(|part| line.contains(part)))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// `FLAG URL,kv-events=..,kv-replay=..` for every engine of `cluster`, whose KV events must be
/// on: `--backend` for `myelin serve`, `--engine` for `myelin bench`.
pub fn engine_flags(cluster: &myelin_sim::SimCluster, flag: &str) -> Vec<String> {
    let mut args = Vec::new();
    for (url, endpoints) in cluster
        .engine_urls()
        .iter()
        .zip(cluster.kv_event_endpoints())
    {
        let endpoints = endpoints.as_ref().expect("KV events enabled");
        args.push(flag.to_string());
        args.push(format!(
            "{url},kv-events={},kv-replay={}",
            endpoints.publish, endpoints.replay
        ));
    }
    args
}
