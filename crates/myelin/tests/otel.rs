//! OpenTelemetry traces end to end: the real `myelin serve` exporting OTLP/HTTP JSON to an
//! in-process collector on loopback, in front of the scriptable engine.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use support::engine::{Behavior, Engine};
use support::{PATIENCE, Router, chat_body, metric_value, request, wait_until};

/// An OTLP/HTTP collector: every POSTed body's spans, answered 200. Stops when dropped.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<Value>>>,
    paths: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl Collector {
    fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind collector");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let spans = Arc::new(Mutex::new(Vec::new()));
        let paths = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_spans, thread_paths, thread_stop) =
            (spans.clone(), paths.clone(), stop.clone());
        std::thread::spawn(move || {
            while !thread_stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => receive(stream, &thread_spans, &thread_paths),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Collector {
            url,
            spans,
            paths,
            stop,
        }
    }

    fn spans(&self) -> Vec<Value> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of `trace_id`, once its server span has arrived.
    fn trace(&self, trace_id: &str) -> Vec<Value> {
        wait_until("the request's server span reaches the collector", || {
            self.spans()
                .iter()
                .any(|span| span["traceId"] == trace_id && span["kind"] == 2)
        });
        self.spans()
            .into_iter()
            .filter(|span| span["traceId"] == trace_id)
            .collect()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn receive(stream: TcpStream, spans: &Mutex<Vec<Value>>, paths: &Mutex<Vec<String>>) {
    stream.set_nonblocking(false).expect("blocking");
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).expect("request line");
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header");
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().expect("length");
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("body");
    let value: Value = serde_json::from_slice(&body).expect("an OTLP JSON body");
    let resource = &value["resourceSpans"][0];
    assert_eq!(
        resource["resource"]["attributes"][0]["value"]["stringValue"], "myelin-test",
        "service.name"
    );
    let batch = resource["scopeSpans"][0]["spans"]
        .as_array()
        .expect("spans")
        .clone();
    paths.lock().unwrap().push(
        request_line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string(),
    );
    spans.lock().unwrap().extend(batch);
    let mut stream = reader.into_inner();
    let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}");
}

fn attribute<'a>(span: &'a Value, key: &str) -> &'a Value {
    let attributes = span["attributes"].as_array().expect("attributes");
    let found = attributes
        .iter()
        .find(|attribute| attribute["key"] == key)
        .unwrap_or_else(|| panic!("span {} has no attribute {key}: {span}", span["name"]));
    let value = &found["value"];
    ["stringValue", "intValue", "doubleValue", "boolValue"]
        .iter()
        .map(|kind| &value[kind])
        .find(|value| !value.is_null())
        .expect("a typed value")
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn start(collector: &Collector, engine: &Engine, sample: &str) -> Router {
    Router::start(&[
        "--backend",
        &engine.url(),
        "--otlp-endpoint",
        &collector.url,
        "--trace-sample",
        sample,
        "--otel-service-name",
        "myelin-test",
    ])
}

#[test]
fn a_request_is_one_trace_continuing_the_clients_with_the_decision_as_attributes() {
    let collector = Collector::start();
    let engine = Engine::start(
        "a",
        Behavior::Normal {
            chunks: 3,
            interval: Duration::from_millis(1),
        },
    );
    let router = start(&collector, &engine, "0");
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let body = chat_body("Trace this request through the router.", true).to_string();
    let response = request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
        Some(body.as_bytes()),
    );
    assert_eq!(response.status, 200);
    let _ = response.body();

    let spans = collector.trace(CLIENT_TRACE);
    let server = spans.iter().find(|span| span["kind"] == 2).unwrap();
    assert_eq!(
        server["parentSpanId"], CLIENT_SPAN,
        "under the client's span"
    );
    assert_eq!(server["name"], "chat test-model");
    assert_eq!(server["status"]["code"], 0);
    assert_eq!(attribute(server, "gen_ai.operation.name"), "chat");
    assert_eq!(attribute(server, "gen_ai.request.model"), "test-model");
    assert_eq!(attribute(server, "gen_ai.request.max_tokens"), "16");
    assert_eq!(attribute(server, "http.response.status_code"), "200");
    assert_eq!(attribute(server, "myelin.backend"), "0");
    assert_eq!(attribute(server, "myelin.retries"), "0");
    assert_eq!(attribute(server, "myelin.residency_downgrade"), false);
    assert!(attribute(server, "myelin.matched_blocks").is_string());
    assert!(
        attribute(server, "myelin.predicted_ttft_ms")
            .as_f64()
            .unwrap()
            >= 0.0
    );
    assert!(
        attribute(server, "myelin.time_to_first_byte_ms")
            .as_f64()
            .unwrap()
            > 0.0
    );
    let start = |span: &Value| {
        span["startTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    let end = |span: &Value| {
        span["endTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };

    let children: Vec<&Value> = spans.iter().filter(|span| span["kind"] != 2).collect();
    assert_eq!(children.len(), 2, "tokenize and one attempt: {spans:?}");
    for child in &children {
        assert_eq!(child["parentSpanId"], server["spanId"]);
        assert!(
            start(child) >= start(server) && end(child) <= end(server),
            "{child}"
        );
    }
    let tokenize = children
        .iter()
        .find(|span| span["name"] == "tokenize")
        .unwrap();
    assert_eq!(tokenize["kind"], 1);
    assert!(
        attribute(tokenize, "myelin.prompt_tokens")
            .as_str()
            .unwrap()
            != "0"
    );
    let attempt = children.iter().find(|span| span["kind"] == 3).unwrap();
    assert_eq!(attribute(attempt, "myelin.backend"), "0");
    assert_eq!(attribute(attempt, "http.response.status_code"), "200");
    // The engine got the trace, under the attempt's span.
    let forwarded = engine
        .record
        .last_traceparent
        .lock()
        .unwrap()
        .clone()
        .unwrap();
    assert_eq!(
        forwarded,
        format!(
            "00-{CLIENT_TRACE}-{}-01",
            attempt["spanId"].as_str().unwrap()
        )
    );
    assert_eq!(collector.paths.lock().unwrap()[0], "/v1/traces");
    wait_until("the exported spans are counted", || {
        metric_value(&router.metrics(), &["myelin_otlp_spans_exported_total"]) >= 3.0
    });
}

#[test]
fn sampling_follows_the_clients_flag_and_refusals_are_traced_as_errors() {
    let collector = Collector::start();
    let engine = Engine::start(
        "a",
        Behavior::Normal {
            chunks: 1,
            interval: Duration::from_millis(1),
        },
    );
    // Ratio 0: only a client's sampled flag traces.
    let router = start(&collector, &engine, "0");
    let body = chat_body("Not traced.", false).to_string();
    let post = |traceparent: Option<&str>, body: &[u8]| {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(traceparent) = traceparent {
            headers.push(("traceparent", traceparent));
        }
        request(
            router.addr,
            "POST",
            "/v1/chat/completions",
            &headers,
            Some(body),
        )
    };
    let unsampled = "00-11111111111111111111111111111111-2222222222222222-00";
    assert_eq!(post(None, body.as_bytes()).status, 200);
    assert_eq!(post(Some(unsampled), body.as_bytes()).status, 200);
    // Not traced either way, the client's own traceparent reaches the engine as it was.
    assert_eq!(
        engine.record.last_traceparent.lock().unwrap().as_deref(),
        Some(unsampled)
    );
    // A malformed one starts a new trace (sampled at ratio 0: none).
    assert_eq!(post(Some("00-xyz-01"), body.as_bytes()).status, 200);

    // A refused body, sampled by its client: the server span alone, failed, with the status.
    let refused = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    assert_eq!(post(Some(&refused), b"{not json").status, 400);
    let spans = collector.trace(CLIENT_TRACE);
    assert_eq!(spans.len(), 1, "{spans:?}");
    assert_eq!(spans[0]["status"]["code"], 2);
    assert_eq!(attribute(&spans[0], "http.response.status_code"), "400");
    // Spans go through one queue in order: nothing of the unsampled requests came before.
    assert!(
        collector
            .spans()
            .iter()
            .all(|span| span["traceId"] == CLIENT_TRACE),
        "{:?}",
        collector.spans()
    );
    assert_eq!(engine.requests(), 3);

    // A model name from the client is bounded in the span's name and attributes (no engine
    // lists it: the router's 404, traced as an error).
    let long_trace = "6bf92f3577b34da6a3ce929d0e0e4736";
    let mut long = chat_body("Long model name.", false);
    long["model"] = Value::String("m".repeat(10_000));
    wait_until("the engine's models known (an unknown one refused)", || {
        post(None, long.to_string().as_bytes()).status == 404
    });
    let traced = format!("00-{long_trace}-{CLIENT_SPAN}-01");
    assert_eq!(post(Some(&traced), long.to_string().as_bytes()).status, 404);
    let spans = collector.trace(long_trace);
    let server = spans.iter().find(|span| span["kind"] == 2).unwrap();
    assert!(server["name"].as_str().unwrap().len() <= 256);
    assert!(
        attribute(server, "gen_ai.request.model")
            .as_str()
            .unwrap()
            .len()
            <= 256
    );

    // An engine's error, relayed as it came, fails the server span too.
    engine.set_behavior(Behavior::Status(500));
    let failing_trace = "5bf92f3577b34da6a3ce929d0e0e4736";
    let failing = format!("00-{failing_trace}-{CLIENT_SPAN}-01");
    assert_eq!(post(Some(&failing), body.as_bytes()).status, 500);
    let spans = collector.trace(failing_trace);
    let server = spans.iter().find(|span| span["kind"] == 2).unwrap();
    assert_eq!(server["status"]["code"], 2);
    assert_eq!(attribute(server, "http.response.status_code"), "500");
    let attempt = spans.iter().find(|span| span["kind"] == 3).unwrap();
    assert_eq!(attribute(attempt, "http.response.status_code"), "500");
}

#[test]
fn a_collector_that_is_down_costs_the_requests_nothing_and_is_counted() {
    // Nothing listens on the endpoint.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let engine = Engine::start(
        "a",
        Behavior::Normal {
            chunks: 1,
            interval: Duration::from_millis(1),
        },
    );
    let router = Router::start(&[
        "--backend",
        &engine.url(),
        "--otlp-endpoint",
        &url,
        "--trace-sample",
        "1",
    ]);
    let body = chat_body("Traced into the void.", false).to_string();
    for _ in 0..3 {
        let response = request(
            router.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            Some(body.as_bytes()),
        );
        assert_eq!(response.status, 200);
    }
    wait_until("the failed export is counted", || {
        metric_value(
            &router.metrics(),
            &["myelin_otlp_spans_dropped_total", "export_failed"],
        ) >= 3.0
    });
    // The router still drains and exits on SIGTERM (it waits a bounded time for the exporter).
    let mut router = router;
    router.terminate();
    assert!(router.wait_exit().success());
}

#[test]
fn a_bad_endpoint_or_ratio_is_refused_at_startup() {
    for (flag, value) in [
        ("--otlp-endpoint", "https://collector:4318"),
        ("--otlp-endpoint", "collector:4318"),
        ("--trace-sample", "1.5"),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
            .args(["serve", "--listen", "127.0.0.1:0", flag, value])
            .output()
            .expect("run myelin");
        assert!(!output.status.success(), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
    }
}
