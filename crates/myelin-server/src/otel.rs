//! OpenTelemetry traces of generation requests, exported over OTLP/HTTP with the JSON encoding
//! (`--otlp-endpoint`, `--trace-sample`; docs/operations.md, "Traces").
//!
//! Each sampled request gets a server span carrying its routing decision (GenAI semantic
//! conventions where they apply, `myelin.*` for the router's own evidence), a `tokenize` child
//! and one client span per engine attempt. A W3C `traceparent` from the client is followed: its
//! trace id and sampled flag are kept and the server span hangs under its span; the engine gets
//! a `traceparent` naming the attempt's client span. Data cores hand finished spans to one
//! exporter thread through a bounded channel (`try_send`: a full queue drops and counts, it never
//! blocks a core); the exporter posts batches with a deadline on every step. Off (no endpoint),
//! a request pays one `Option` check.

use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use http::HeaderValue;
use std::fmt::Write as _;

/// The W3C trace-context request header.
pub const TRACEPARENT: &str = "traceparent";

/// Spans a data core may queue for the exporter before new ones are dropped.
const QUEUE_SPANS: usize = 8192;
/// Most spans in one export request.
const BATCH_SPANS: usize = 512;
/// A batch is sent at the latest this long after its first span.
const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// Deadline of each step of an export: connect, write, read.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Most bytes of a collector's answer read (its status line is all that is used).
const MAX_RESPONSE_BYTES: u64 = 64 * 1024;
/// Attribute strings and span names (model names) are cut to this many bytes.
const MAX_ATTRIBUTE_BYTES: usize = 256;
/// How long a stopping router waits for the exporter to send what it holds.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(7);

/// A parsed `traceparent`: the caller's trace, its span and whether it samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl TraceParent {
    /// Parses a W3C `traceparent` (`VV-TRACEID-SPANID-FF`, lowercase hex). Version `00` is
    /// exactly 55 bytes; a later version may append `-...`, which is ignored; `ff`, all-zero ids
    /// and anything else malformed are `None` (the request then starts a new trace).
    pub fn parse(value: &[u8]) -> Option<TraceParent> {
        if value.len() < 55 || (value.len() > 55 && (value[..2] == *b"00" || value[55] != b'-')) {
            return None;
        }
        let version = hex_bytes::<1>(&value[0..2])?;
        if version[0] == 0xff || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let trace_id = hex_bytes::<16>(&value[3..35])?;
        let span_id = hex_bytes::<8>(&value[36..52])?;
        let flags = hex_bytes::<1>(&value[53..55])?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            sampled: flags[0] & 1 == 1,
        })
    }

    /// The header value naming this trace and span.
    pub fn header_value(&self) -> HeaderValue {
        let mut text = String::with_capacity(55);
        text.push_str("00-");
        push_hex_digits(&mut text, &self.trace_id);
        text.push('-');
        push_hex_digits(&mut text, &self.span_id);
        text.push_str(if self.sampled { "-01" } else { "-00" });
        HeaderValue::from_str(&text).expect("hex digits and dashes are a valid header value")
    }
}

fn hex_bytes<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let digit = |byte: u8| match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'a'..=b'f' => Some(byte - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (index, pair) in text.chunks_exact(2).enumerate() {
        out[index] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// `bytes` as lowercase hex digits, appended to `out`.
fn push_hex_digits(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0xf)]));
    }
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum AttributeValue {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// `text` cut to at most [`MAX_ATTRIBUTE_BYTES`], at a character boundary.
fn bounded(text: &str) -> &str {
    let mut end = text.len().min(MAX_ATTRIBUTE_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl From<&str> for AttributeValue {
    fn from(text: &str) -> Self {
        AttributeValue::Str(bounded(text).to_string())
    }
}

impl From<u64> for AttributeValue {
    fn from(value: u64) -> Self {
        AttributeValue::Int(i64::try_from(value).unwrap_or(i64::MAX))
    }
}

impl From<f64> for AttributeValue {
    fn from(value: f64) -> Self {
        AttributeValue::Float(value)
    }
}

impl From<bool> for AttributeValue {
    fn from(value: bool) -> Self {
        AttributeValue::Bool(value)
    }
}

/// OTLP span kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_span_id: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub attributes: Vec<(&'static str, AttributeValue)>,
    /// `Some(message)`: the span's status is an error.
    pub error: Option<String>,
}

/// A data core's tracer: its sampling ratio, its span ids and its end of the exporter's queue.
pub struct Tracer {
    sender: Sender<Span>,
    sample_ratio: f64,
    ids: Cell<u64>,
    dropped: metrics::Counter,
}

impl Tracer {
    /// A tracer for one data core; `seed` makes its ids differ from the other cores'.
    pub fn new(exporter: &ExporterHandle, seed: u64) -> Tracer {
        let clock = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        Tracer {
            sender: exporter.sender.clone(),
            sample_ratio: exporter.sample_ratio,
            ids: Cell::new(
                clock ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(std::process::id()),
            ),
            dropped: metrics::counter!(crate::metrics::OTLP_SPANS_DROPPED_TOTAL, "reason" => "queue_full"),
        }
    }

    /// splitmix64: distinct, well-mixed ids (not secrets; W3C asks only for uniqueness).
    fn next_u64(&self) -> u64 {
        let state = self.ids.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        self.ids.set(state);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn span_id(&self) -> [u8; 8] {
        loop {
            let id = self.next_u64();
            if id != 0 {
                return id.to_be_bytes();
            }
        }
    }

    /// Starts a request's trace, or `None` when it is not sampled: a caller's `traceparent`
    /// decides by its sampled flag; without one, `--trace-sample` does, by the trace id (the
    /// same id always gets the same answer, as OpenTelemetry's ratio sampler).
    pub fn start(&self, parent: Option<TraceParent>, arrived: Instant) -> Option<RequestTrace> {
        let (trace_id, parent_span_id) = match parent {
            Some(parent) if parent.sampled => (parent.trace_id, Some(parent.span_id)),
            Some(_) => return None,
            None => {
                let mut trace_id = [0u8; 16];
                trace_id[..8].copy_from_slice(&self.span_id());
                trace_id[8..].copy_from_slice(&self.span_id());
                if !ratio_samples(self.sample_ratio, &trace_id) {
                    return None;
                }
                (trace_id, None)
            }
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos() as u64);
        Some(RequestTrace {
            sender: self.sender.clone(),
            dropped: self.dropped.clone(),
            trace_id,
            span_id: self.span_id(),
            parent_span_id,
            name: String::new(),
            origin_unix_ns: now.saturating_sub(arrived.elapsed().as_nanos() as u64),
            origin: arrived,
            attributes: Vec::new(),
            children: Vec::new(),
            upstream: None,
            next_child: self.next_u64(),
            error: None,
        })
    }
}

/// Whether a trace id falls in the sampled share: its last 8 bytes, as a number, below
/// `ratio` of their range.
fn ratio_samples(ratio: f64, trace_id: &[u8; 16]) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 || ratio.is_nan() {
        return false;
    }
    let low = u64::from_be_bytes(trace_id[8..].try_into().expect("8 bytes")) >> 1;
    (low as f64) < ratio * (1u64 << 63) as f64
}

/// An engine attempt still open (its response is being relayed).
struct OpenAttempt {
    span_id: [u8; 8],
    started: Instant,
    attributes: Vec<(&'static str, AttributeValue)>,
}

/// One sampled request's spans while it runs; exported when dropped (the server span ends
/// then: after the response body for a relayed answer, at the error for a refused one).
pub struct RequestTrace {
    sender: Sender<Span>,
    dropped: metrics::Counter,
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent_span_id: Option<[u8; 8]>,
    name: String,
    origin_unix_ns: u64,
    origin: Instant,
    attributes: Vec<(&'static str, AttributeValue)>,
    children: Vec<Span>,
    upstream: Option<OpenAttempt>,
    next_child: u64,
    error: Option<String>,
}

impl RequestTrace {
    fn unix_ns(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.origin).as_nanos() as u64;
        self.origin_unix_ns.saturating_add(since)
    }

    fn child_id(&mut self) -> [u8; 8] {
        self.next_child = self.next_child.wrapping_add(1).max(1);
        (self.next_child ^ u64::from_be_bytes(self.span_id))
            .max(1)
            .to_be_bytes()
    }

    /// The server span's name (`{operation} {model}`, GenAI conventions), bounded as an
    /// attribute is.
    pub fn set_name(&mut self, name: &str) {
        self.name = bounded(name).to_string();
    }

    /// Sets an attribute of the server span (a later value replaces an earlier one).
    pub fn set(&mut self, key: &'static str, value: impl Into<AttributeValue>) {
        let value = value.into();
        match self.attributes.iter_mut().find(|(name, _)| *name == key) {
            Some(slot) => slot.1 = value,
            None => self.attributes.push((key, value)),
        }
    }

    /// Marks the server span as failed.
    pub fn fail(&mut self, message: impl Into<String>) {
        self.error = Some(message.into());
    }

    /// Records a finished internal child span.
    pub fn child(
        &mut self,
        name: &str,
        started: Instant,
        ended: Instant,
        attributes: Vec<(&'static str, AttributeValue)>,
    ) {
        let span = Span {
            trace_id: self.trace_id,
            span_id: self.child_id(),
            parent_span_id: Some(self.span_id),
            name: name.to_string(),
            kind: SpanKind::Internal,
            start_unix_ns: self.unix_ns(started),
            end_unix_ns: self.unix_ns(ended),
            attributes,
            error: None,
        };
        self.children.push(span);
    }

    /// Opens the client span of an engine attempt (closing any open one as failed) and returns
    /// the `traceparent` the engine gets: this trace, that span.
    pub fn begin_attempt(
        &mut self,
        attributes: Vec<(&'static str, AttributeValue)>,
    ) -> HeaderValue {
        self.end_attempt(Some("no answer used".into()), Instant::now());
        let span_id = self.child_id();
        self.upstream = Some(OpenAttempt {
            span_id,
            started: Instant::now(),
            attributes,
        });
        TraceParent {
            trace_id: self.trace_id,
            span_id,
            sampled: true,
        }
        .header_value()
    }

    /// Closes the open attempt's client span, failed with `error` or not.
    pub fn end_attempt(&mut self, error: Option<String>, at: Instant) {
        let Some(attempt) = self.upstream.take() else {
            return;
        };
        let span = Span {
            trace_id: self.trace_id,
            span_id: attempt.span_id,
            parent_span_id: Some(self.span_id),
            name: "upstream".into(),
            kind: SpanKind::Client,
            start_unix_ns: self.unix_ns(attempt.started),
            end_unix_ns: self.unix_ns(at),
            attributes: attempt.attributes,
            error,
        };
        self.children.push(span);
    }

    /// Adds an attribute to the open attempt's client span.
    pub fn set_attempt(&mut self, key: &'static str, value: impl Into<AttributeValue>) {
        if let Some(attempt) = self.upstream.as_mut() {
            attempt.attributes.push((key, value.into()));
        }
    }
}

impl Drop for RequestTrace {
    fn drop(&mut self) {
        let now = Instant::now();
        let error = self.error.clone();
        self.end_attempt(error.clone(), now);
        let server = Span {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent_span_id: self.parent_span_id,
            name: std::mem::take(&mut self.name),
            kind: SpanKind::Server,
            start_unix_ns: self.origin_unix_ns,
            end_unix_ns: self.unix_ns(now),
            attributes: std::mem::take(&mut self.attributes),
            error,
        };
        for span in self.children.drain(..).chain(std::iter::once(server)) {
            if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
                self.sender.try_send(span)
            {
                self.dropped.increment(1);
            }
        }
    }
}

/// What the data cores need of the exporter: its queue and the sampling ratio.
#[derive(Clone)]
pub struct ExporterHandle {
    sender: Sender<Span>,
    sample_ratio: f64,
}

/// Where and how spans are exported.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    /// The collector's traces URL (`http://host:port/v1/traces`).
    pub endpoint: OtlpEndpoint,
    /// Share of requests without a caller's decision that are traced (0 to 1).
    pub sample_ratio: f64,
    /// `service.name` of the exported resource.
    pub service_name: String,
}

/// A parsed `--otlp-endpoint`: plain HTTP, host, port and path (`/v1/traces` when none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpEndpoint {
    pub authority: String,
    pub path: String,
}

impl std::str::FromStr for OtlpEndpoint {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let rest = text.strip_prefix("http://").ok_or_else(|| {
            format!("{text:?}: an OTLP endpoint is http://HOST:PORT[/PATH] (OTLP/HTTP, JSON; TLS to the collector is not supported: run a local collector)")
        })?;
        let (authority, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, ""),
        };
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or_else(|| format!("{text:?}: the endpoint needs a port (4318 is OTLP/HTTP's)"))?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |port| port == 0) {
            return Err(format!("{text:?}: bad host or port"));
        }
        let path = if path.is_empty() || path == "/" {
            "/v1/traces".to_string()
        } else {
            path.to_string()
        };
        if path
            .bytes()
            .any(|byte| byte.is_ascii_whitespace() || byte.is_ascii_control())
        {
            return Err(format!(
                "{text:?}: the path has spaces or control characters"
            ));
        }
        Ok(OtlpEndpoint {
            authority: authority.to_string(),
            path,
        })
    }
}

impl std::fmt::Display for OtlpEndpoint {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "http://{}{}", self.authority, self.path)
    }
}

/// The exporter thread, stopped by [`Exporter::finish`].
pub struct Exporter {
    thread: std::thread::JoinHandle<()>,
    stop: Arc<AtomicBool>,
}

impl Exporter {
    /// Asks the exporter to send what its queue holds and end (call it once the data cores
    /// have stopped), and waits for that at most [`SHUTDOWN_WAIT`]: a batch still going to a
    /// slow collector then is lost, not the exit.
    pub fn finish(self) {
        self.stop.store(true, Ordering::Release);
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        while !self.thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.thread.is_finished() {
            let _ = self.thread.join();
        }
    }
}

/// Starts the exporter thread.
pub fn start(config: OtlpConfig) -> std::io::Result<(ExporterHandle, Exporter)> {
    let (sender, receiver) = crossbeam_channel::bounded(QUEUE_SPANS);
    let sample_ratio = config.sample_ratio;
    let stop = Arc::new(AtomicBool::new(false));
    let thread_stop = stop.clone();
    let thread = std::thread::Builder::new()
        .name("myelin-otlp".into())
        .spawn(move || export_loop(&config, &receiver, &thread_stop))?;
    Ok((
        ExporterHandle {
            sender,
            sample_ratio,
        },
        Exporter { thread, stop },
    ))
}

fn export_loop(config: &OtlpConfig, receiver: &Receiver<Span>, stop: &AtomicBool) {
    let exported = metrics::counter!(crate::metrics::OTLP_SPANS_EXPORTED_TOTAL);
    let failed =
        metrics::counter!(crate::metrics::OTLP_SPANS_DROPPED_TOTAL, "reason" => "export_failed");
    let mut batch: Vec<Span> = Vec::with_capacity(BATCH_SPANS);
    loop {
        // Wait for a first span (ending once asked to with the queue empty, or when every
        // sender is gone), then gather until the batch is full or the interval passed.
        match receiver.recv_timeout(FLUSH_INTERVAL) {
            Ok(span) => batch.push(span),
            Err(RecvTimeoutError::Timeout) if !stop.load(Ordering::Acquire) => continue,
            Err(_) => break,
        }
        let deadline = Instant::now() + FLUSH_INTERVAL;
        while batch.len() < BATCH_SPANS {
            match receiver.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(span) => batch.push(span),
                Err(_) => break,
            }
        }
        let body = encode(&batch, &config.service_name);
        match post(&config.endpoint, body.as_bytes()) {
            Ok(()) => exported.increment(batch.len() as u64),
            Err(error) => {
                failed.increment(batch.len() as u64);
                eprintln!(
                    "myelin: OTLP export of {} spans to {} failed: {error}",
                    batch.len(),
                    config.endpoint
                );
            }
        }
        batch.clear();
    }
}

/// The OTLP/HTTP JSON body of `spans` (ids as lowercase hex, 64-bit numbers as strings, as
/// the OTLP JSON encoding has them), written straight into one buffer.
pub fn encode(spans: &[Span], service_name: &str) -> String {
    let mut out = String::with_capacity(256 + spans.len() * 640);
    out.push_str(r#"{"resourceSpans":[{"resource":{"attributes":["#);
    push_attribute(
        &mut out,
        "service.name",
        &AttributeValue::from(service_name),
    );
    out.push_str(r#"]},"scopeSpans":[{"scope":{"name":"myelin","version":""#);
    out.push_str(env!("CARGO_PKG_VERSION"));
    out.push_str(r#""},"spans":["#);
    for (index, span) in spans.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        push_span(&mut out, span);
    }
    out.push_str("]}]}]}");
    out
}

/// `text` as a JSON string.
fn push_string(out: &mut String, text: &str) {
    out.push('"');
    for character in text.chars() {
        match character {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            control if u32::from(control) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(control));
            }
            other => out.push(other),
        }
    }
    out.push('"');
}

/// `bytes` as a JSON string of lowercase hex digits.
fn push_hex(out: &mut String, bytes: &[u8]) {
    out.push('"');
    push_hex_digits(out, bytes);
    out.push('"');
}

fn push_attribute(out: &mut String, key: &str, value: &AttributeValue) {
    out.push_str(r#"{"key":"#);
    push_string(out, key);
    out.push_str(r#","value":{"#);
    match value {
        AttributeValue::Str(text) => {
            out.push_str(r#""stringValue":"#);
            push_string(out, text);
        }
        AttributeValue::Int(number) => {
            let _ = write!(out, r#""intValue":"{number}""#);
        }
        AttributeValue::Float(number) if number.is_finite() => {
            let _ = write!(out, r#""doubleValue":{number}"#);
        }
        AttributeValue::Float(_) => out.push_str(r#""stringValue":"NaN""#),
        AttributeValue::Bool(flag) => {
            let _ = write!(out, r#""boolValue":{flag}"#);
        }
    }
    out.push_str("}}");
}

fn push_span(out: &mut String, span: &Span) {
    out.push_str(r#"{"traceId":"#);
    push_hex(out, &span.trace_id);
    out.push_str(r#","spanId":"#);
    push_hex(out, &span.span_id);
    if let Some(parent) = span.parent_span_id {
        out.push_str(r#","parentSpanId":"#);
        push_hex(out, &parent);
    }
    out.push_str(r#","name":"#);
    push_string(out, &span.name);
    let _ = write!(
        out,
        r#","kind":{},"startTimeUnixNano":"{}","endTimeUnixNano":"{}","attributes":["#,
        span.kind as u8,
        span.start_unix_ns,
        span.end_unix_ns.max(span.start_unix_ns)
    );
    for (index, (key, value)) in span.attributes.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        push_attribute(out, key, value);
    }
    out.push_str(r#"],"status":"#);
    match &span.error {
        Some(message) => {
            out.push_str(r#"{"code":2,"message":"#);
            push_string(out, message);
            out.push('}');
        }
        None => out.push_str(r#"{"code":0}"#),
    }
    out.push('}');
}

/// One POST to the collector, each step within [`EXPORT_TIMEOUT`]; a 2xx answer is success.
fn post(endpoint: &OtlpEndpoint, body: &[u8]) -> Result<(), String> {
    let addresses: Vec<SocketAddr> = endpoint
        .authority
        .to_socket_addrs()
        .map_err(|error| format!("cannot resolve {}: {error}", endpoint.authority))?
        .collect();
    let mut last_error = format!("{} resolves to no address", endpoint.authority);
    for address in addresses {
        match TcpStream::connect_timeout(&address, EXPORT_TIMEOUT) {
            Ok(stream) => return exchange(stream, endpoint, body),
            Err(error) => last_error = format!("connect {address}: {error}"),
        }
    }
    Err(last_error)
}

fn exchange(mut stream: TcpStream, endpoint: &OtlpEndpoint, body: &[u8]) -> Result<(), String> {
    let io = |error: std::io::Error| error.to_string();
    stream.set_write_timeout(Some(EXPORT_TIMEOUT)).map_err(io)?;
    stream.set_read_timeout(Some(EXPORT_TIMEOUT)).map_err(io)?;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        endpoint.path,
        endpoint.authority,
        body.len()
    );
    stream.write_all(head.as_bytes()).map_err(io)?;
    stream.write_all(body).map_err(io)?;
    let mut answer = Vec::new();
    let mut limited = (&mut stream).take(MAX_RESPONSE_BYTES);
    // The status line is enough: read until it is complete (or the answer ends).
    let mut chunk = [0u8; 1024];
    while !answer.contains(&b'\n') {
        let read = limited.read(&mut chunk).map_err(io)?;
        if read == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..read]);
    }
    let line = answer
        .split(|&byte| byte == b'\n')
        .next()
        .unwrap_or_default();
    let status = std::str::from_utf8(line)
        .ok()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok());
    match status {
        Some(code) if (200..300).contains(&code) => Ok(()),
        Some(code) => Err(format!("the collector answered {code}")),
        None => Err("the collector sent no HTTP status line".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        let mut out = String::new();
        push_hex_digits(&mut out, bytes);
        out
    }

    #[test]
    fn traceparent_round_trips_and_refuses_malformed_values() {
        let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parent = TraceParent::parse(text.as_bytes()).expect("valid");
        assert!(parent.sampled);
        assert_eq!(hex(&parent.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&parent.span_id), "00f067aa0ba902b7");
        assert_eq!(parent.header_value(), text);
        let unsampled = TraceParent::parse(&text.replace("-01", "-00").into_bytes()).unwrap();
        assert!(!unsampled.sampled);
        // A later version may carry more fields after a dash; version 00 may not.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
        assert_eq!(
            TraceParent::parse(later.as_bytes()).unwrap().trace_id,
            parent.trace_id
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            assert_eq!(TraceParent::parse(bad.as_bytes()), None, "{bad:?}");
        }
    }

    #[test]
    fn the_ratio_sampler_keeps_about_its_share_and_decides_by_id() {
        let (sender, _receiver) = crossbeam_channel::bounded(1);
        let handle = ExporterHandle {
            sender,
            sample_ratio: 0.25,
        };
        let tracer = Tracer::new(&handle, 7);
        let sampled = (0..4000)
            // Dropped at once: past the first, this test's queue refuses them (counted).
            .filter_map(|_| tracer.start(None, Instant::now()))
            .count();
        assert!(
            (800..1200).contains(&sampled),
            "{sampled} of 4000 sampled at 0.25"
        );
        let id = [7u8; 16];
        assert_eq!(ratio_samples(0.5, &id), ratio_samples(0.5, &id));
        assert!(ratio_samples(1.0, &id) && !ratio_samples(0.0, &id));
    }

    #[test]
    fn a_callers_flag_decides_and_its_trace_is_continued() {
        let (sender, receiver) = crossbeam_channel::bounded(16);
        let handle = ExporterHandle {
            sender,
            sample_ratio: 0.0,
        };
        let tracer = Tracer::new(&handle, 1);
        let parent =
            TraceParent::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let unsampled = TraceParent {
            sampled: false,
            ..parent
        };
        assert!(tracer.start(Some(unsampled), Instant::now()).is_none());
        assert!(tracer.start(None, Instant::now()).is_none(), "ratio 0");
        let started = Instant::now();
        let mut trace = tracer.start(Some(parent), started).expect("sampled parent");
        trace.set_name("chat m");
        trace.set("gen_ai.request.model", "m");
        trace.child("tokenize", started, Instant::now(), vec![]);
        let first = trace.begin_attempt(vec![("myelin.backend", 0u64.into())]);
        let second = trace.begin_attempt(vec![("myelin.backend", 1u64.into())]);
        assert_ne!(first, second);
        let engine_parent = TraceParent::parse(second.as_bytes()).unwrap();
        assert_eq!(engine_parent.trace_id, parent.trace_id);
        drop(trace);
        let spans: Vec<Span> = receiver.try_iter().collect();
        assert_eq!(spans.len(), 4, "{spans:?}");
        let server = spans
            .iter()
            .find(|span| span.kind == SpanKind::Server)
            .unwrap();
        assert_eq!(server.parent_span_id, Some(parent.span_id));
        assert_eq!(server.name, "chat m");
        for span in &spans {
            assert_eq!(span.trace_id, parent.trace_id);
            if span.kind != SpanKind::Server {
                assert_eq!(span.parent_span_id, Some(server.span_id));
            }
        }
        let attempts: Vec<&Span> = spans
            .iter()
            .filter(|s| s.kind == SpanKind::Client)
            .collect();
        assert_eq!(attempts.len(), 2);
        assert!(attempts[0].error.is_some(), "the replaced attempt failed");
        assert_eq!(attempts[1].span_id, engine_parent.span_id);
        let ids: std::collections::BTreeSet<_> = spans.iter().map(|s| s.span_id).collect();
        assert_eq!(ids.len(), 4, "span ids are distinct");
    }

    #[test]
    fn encoding_is_otlp_json() {
        let span = Span {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_span_id: None,
            name: "chat m".into(),
            kind: SpanKind::Server,
            start_unix_ns: 10,
            end_unix_ns: 5,
            attributes: vec![
                ("a", 3u64.into()),
                ("b", true.into()),
                ("c", 0.5.into()),
                ("d", "é".repeat(200).as_str().into()),
            ],
            error: Some("boom".into()),
        };
        let body: serde_json::Value = serde_json::from_str(&encode(&[span], "svc")).unwrap();
        let resource = &body["resourceSpans"][0];
        assert_eq!(
            resource["resource"]["attributes"][0]["value"]["stringValue"],
            "svc"
        );
        let span = &resource["scopeSpans"][0]["spans"][0];
        assert_eq!(span["traceId"], "01".repeat(16));
        assert_eq!(span["spanId"], "02".repeat(8));
        assert!(span.get("parentSpanId").is_none());
        assert_eq!(span["kind"], 2);
        assert_eq!(span["endTimeUnixNano"], "10", "never before its start");
        assert_eq!(span["attributes"][0]["value"]["intValue"], "3");
        assert_eq!(span["attributes"][1]["value"]["boolValue"], true);
        assert_eq!(span["attributes"][2]["value"]["doubleValue"], 0.5);
        let long = span["attributes"][3]["value"]["stringValue"]
            .as_str()
            .unwrap();
        assert!(long.len() <= MAX_ATTRIBUTE_BYTES && long.chars().all(|c| c == 'é'));
        assert_eq!(span["status"]["code"], 2);
        assert_eq!(span["status"]["message"], "boom");
    }

    #[test]
    fn strings_are_escaped_and_several_spans_are_one_list() {
        let name = "a \"quoted\" back\\slash\nline\ttab\u{1}bell é";
        let span = |id: u8| Span {
            trace_id: [id; 16],
            span_id: [id; 8],
            parent_span_id: Some([9; 8]),
            name: name.into(),
            kind: SpanKind::Client,
            start_unix_ns: 1,
            end_unix_ns: 2,
            attributes: vec![("k", name.into()), ("f", f64::NAN.into())],
            error: None,
        };
        let body: serde_json::Value =
            serde_json::from_str(&encode(&[span(1), span(2)], "s\"vc")).unwrap();
        let spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .unwrap();
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[1]["spanId"], "02".repeat(8));
        assert_eq!(spans[0]["parentSpanId"], "09".repeat(8));
        assert_eq!(spans[0]["name"], name);
        assert_eq!(spans[0]["attributes"][0]["value"]["stringValue"], name);
        assert_eq!(spans[0]["attributes"][1]["value"]["stringValue"], "NaN");
        assert_eq!(spans[0]["status"]["code"], 0);
    }

    #[test]
    fn endpoints_parse_with_a_default_path() {
        let parsed: OtlpEndpoint = "http://127.0.0.1:4318".parse().unwrap();
        assert_eq!(parsed.to_string(), "http://127.0.0.1:4318/v1/traces");
        let custom: OtlpEndpoint = "http://collector:4318/otlp/v1/traces".parse().unwrap();
        assert_eq!(custom.path, "/otlp/v1/traces");
        for bad in [
            "https://c:4318",
            "c:4318",
            "http://c",
            "http://:4318",
            "http://c:0",
            "http://c:4318/a b",
        ] {
            assert!(bad.parse::<OtlpEndpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_collector_that_is_down_or_refuses_is_an_error_not_a_hang() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint: OtlpEndpoint = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buffer = [0u8; 4096];
            let _ = stream.read(&mut buffer);
            stream
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .unwrap();
        });
        let refused = post(&endpoint, b"{}").unwrap_err();
        assert!(refused.contains("400"), "{refused}");
        server.join().unwrap();
        // Nothing listens there now.
        assert!(post(&endpoint, b"{}").is_err());
    }
}
