//! Fault injection against the real `myelin serve` process: hostile clients, engines that hang
//! or stall, and what the router does about each (what the client sees, what is counted).
//! Everything listens on loopback; every wait is bounded by a deadline; no assertion is about
//! how long something took. The scenarios and their outcomes are tabled in
//! docs/operations.md (*Failure behaviour*).

mod support;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::engine::{Behavior, Engine, chunk_event};
use support::{PATIENCE, Router, chat_body, metric_value, read_response, wait_until};

fn normal() -> Behavior {
    Behavior::Normal {
        chunks: 3,
        interval: Duration::from_millis(1),
    }
}

fn timeouts(router: &Router, kind: &str) -> f64 {
    metric_value(
        &router.metrics(),
        &["myelin_timeouts_total", &format!("kind=\"{kind}\"")],
    )
}

fn assert_openai_error_code(body: &serde_json::Value, code: &str) {
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

/// Finding 2: clients that send their body one byte at a time hold no in-flight slot (it is
/// taken once the body is complete), get 408 at the body deadline, and never lock others out.
#[test]
fn slow_uploads_hold_no_slot_and_get_408_at_the_body_deadline() {
    let engine = Engine::start("a", normal());
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.url(),
            "--max-in-flight-per-core",
            "2",
            "--body-read-timeout-ms",
            "1500",
        ],
    );
    // Five uploads announce a body and send a few bytes of it: more than the two slots.
    let mut slow = Vec::new();
    for _ in 0..5 {
        let mut stream = TcpStream::connect(router.addr).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream
            .write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
                  content-length: 100000\r\n\r\n{\"model\":",
            )
            .unwrap();
        slow.push(stream);
    }
    // Normal requests are served meanwhile: no slot is held by the slow uploads.
    for turn in 0..4 {
        let response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("turn {turn}"), false),
        );
        assert_eq!(response.status, 200, "turn {turn}");
    }
    // Each slow upload gets 408 with an OpenAI error once its deadline passes.
    for stream in slow {
        let response = read_response(stream);
        assert_eq!(response.status, 408);
        assert_openai_error_code(&response.json(), "request_timeout");
    }
    assert_eq!(timeouts(&router, "body_read"), 5.0);
    assert_eq!(
        metric_value(&router.metrics(), &["myelin_overload_rejections_total"]),
        0.0
    );
}

/// Bodies count against the core's `--max-body-buffer-bytes-per-core` as they arrive: while a
/// slow upload holds 60 KB of a 100 KB budget, a 50 KB body gets 429 `router_overloaded` at
/// once, a small one is served; once the slow one ends, the whole budget is back (no leak).
#[test]
fn bodies_past_the_cores_buffer_budget_get_429_at_once() {
    let engine = Engine::start("a", normal());
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.url(),
            "--max-body-buffer-bytes-per-core",
            "100000",
            "--body-read-timeout-ms",
            "1500",
        ],
    );
    let mut holder = TcpStream::connect(router.addr).unwrap();
    holder.set_read_timeout(Some(PATIENCE)).unwrap();
    holder
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
              content-length: 90000\r\n\r\n",
        )
        .unwrap();
    holder.write_all(&[b' '; 60_000]).unwrap();
    // Until the router has read the holder's bytes, a 50 KB body fits; then it does not.
    let large = chat_body(&"x".repeat(50_000), false);
    let deadline = Instant::now() + PATIENCE;
    let refused = loop {
        let response = router.post_json("/v1/chat/completions", &large);
        if response.status == 429 {
            break response;
        }
        assert_eq!(response.status, 200);
        assert!(
            Instant::now() < deadline,
            "no 429 while the budget was held"
        );
    };
    assert!(refused.header("retry-after").is_some());
    assert_openai_error_code(&refused.json(), "router_overloaded");
    let small = router.post_json("/v1/chat/completions", &chat_body("small", false));
    assert_eq!(small.status, 200);
    // The holder times out; what it held is given back.
    let response = read_response(holder);
    assert_eq!(response.status, 408);
    let nearly_all = chat_body(&"y".repeat(95_000), false);
    assert_eq!(
        router.post_json("/v1/chat/completions", &nearly_all).status,
        200
    );
    assert!(metric_value(&router.metrics(), &["myelin_body_budget_rejections_total"]) >= 1.0);
}

/// Finding 3: an engine that accepts streaming requests and never answers them. Each attempt
/// on it ends at the header deadline and goes to the other engine; its breaker opens although
/// its health endpoint answers, and stays open (probation: one failure re-opens it).
#[test]
fn an_engine_that_never_answers_is_retried_elsewhere_and_taken_out() {
    let hung = Engine::start("hung", Behavior::Hang);
    let good = Engine::start("good", normal());
    let router = Router::start(&[
        "--routing",
        "round-robin",
        "--backend",
        &hung.url(),
        "--backend",
        &good.url(),
        "--upstream-header-timeout-ms",
        "300",
        "--breaker-failures",
        "2",
        "--breaker-open-ms",
        "200",
        "--health-interval-ms",
        "50",
        "--retry-backoff-ms",
        "1",
    ]);
    for turn in 0..8 {
        let response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("turn {turn}"), true),
        );
        assert_eq!(response.status, 200, "turn {turn}");
        assert_eq!(response.header("x-myelin-backend"), Some("1"));
        assert!(response.text().ends_with("data: [DONE]\n\n"));
    }
    let metrics = router.metrics();
    assert!(timeouts(&router, "upstream_header") >= 2.0, "{metrics}");
    assert!(
        metric_value(
            &metrics,
            &["myelin_retries_total", "reason=\"header_timeout\""]
        ) >= 2.0,
        "{metrics}"
    );
    assert!(
        metric_value(
            &metrics,
            &["myelin_circuit_breaker_transitions_total", "to=\"open\""]
        ) >= 1.0,
        "{metrics}"
    );
    // The health endpoint answers all along: only the breaker knows.
    assert_eq!(
        metric_value(
            &metrics,
            &["myelin_health_check_transitions_total", "to=\"down\""]
        ),
        0.0
    );
    assert!(hung.requests() >= 2);
}

/// Finding 3, non-streaming: the answer's head is the whole completion, so the longer
/// response deadline applies; past it the client gets 504 (no retry: the work may be done).
#[test]
fn a_non_streaming_request_to_a_silent_engine_gets_504_at_its_deadline() {
    let hung = Engine::start("hung", Behavior::Hang);
    let router = Router::start(&[
        "--backend",
        &hung.url(),
        "--upstream-response-timeout-ms",
        "300",
    ]);
    let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
    assert_eq!(response.status, 504);
    let body = response.json();
    assert_openai_error_code(&body, "upstream_timeout");
    assert!(
        !body.to_string().contains("127.0.0.1"),
        "no engine address: {body}"
    );
    assert_eq!(timeouts(&router, "upstream_response"), 1.0);
    assert_eq!(hung.requests(), 1, "not retried");
}

/// An engine that reads each POST (a generation request) whole and closes the connection
/// without an answer (it crashed while running it, or a proxy in front of it dropped it);
/// health checks get 200, other GETs 404. Counts the POSTs it read.
struct Dropper {
    addr: std::net::SocketAddr,
    received: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Dropper {
    fn start() -> Dropper {
        use std::io::{BufRead, BufReader, Read};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let counter = counter.clone();
                std::thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(PATIENCE));
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    loop {
                        let mut head = Vec::new();
                        let mut line = String::new();
                        let mut length = 0usize;
                        loop {
                            line.clear();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            if let Some(value) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = value.trim().parse().unwrap_or(0);
                            }
                            if line == "\r\n" {
                                break;
                            }
                            head.push(line.clone());
                        }
                        let mut body = vec![0u8; length];
                        if reader.read_exact(&mut body).is_err() {
                            return;
                        }
                        // Health checks (200) and the router's scrapes (404) are answered.
                        if head.first().is_some_and(|first| first.starts_with("GET ")) {
                            let answer: &[u8] = if head[0].starts_with("GET /health") {
                                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                            } else {
                                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
                            };
                            let mut writer = &stream;
                            let _ = writer.write_all(answer);
                            continue;
                        }
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = stream.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                });
            }
        });
        Dropper { addr, received }
    }

    fn received(&self) -> usize {
        self.received.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Finding 25.4: a non-streaming request whose bytes reached an engine that then dropped the
/// connection is not sent to a second engine (the first may have run it): the client gets a
/// 502. A streaming one, whose client has seen nothing yet, is retried elsewhere.
#[test]
fn a_non_streaming_request_is_not_run_twice_after_its_bytes_were_sent() {
    let dropper = Dropper::start();
    let steady = Engine::start("steady", normal());
    let router = Router::start(&[
        "--routing",
        "round-robin",
        "--backend",
        &format!("http://{}", dropper.addr),
        "--backend",
        &steady.url(),
        // The breaker must not take the dropper out between requests.
        "--breaker-failures",
        "1000",
    ]);
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        let status = response.status;
        if status == 502 {
            assert_openai_error_code(&response.json(), "upstream_error");
        }
        statuses.push(status);
    }
    let failed = statuses.iter().filter(|status| **status == 502).count();
    let served = statuses.iter().filter(|status| **status == 200).count();
    assert_eq!(failed + served, 4, "{statuses:?}");
    assert!(
        failed >= 1,
        "round-robin sent none to the dropper: {statuses:?}"
    );
    // Each request ran once: the dropped ones never reached the steady engine.
    assert_eq!(dropper.received(), failed, "{statuses:?}");
    assert_eq!(steady.requests(), served);

    let before = (dropper.received(), steady.requests());
    for _ in 0..4 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", true));
        assert_eq!(response.status, 200);
        assert!(response.text().ends_with("data: [DONE]\n\n"));
    }
    let dropped = dropper.received() - before.0;
    assert!(dropped >= 1, "round-robin sent no stream to the dropper");
    // Every stream the dropper took was retried on the steady engine.
    assert_eq!(steady.requests() - before.1, 4);
}

/// Finding 3, mid-stream: the engine sends its head and two chunks, then nothing. The client
/// gets those chunks and an SSE error event, and the engine sees its request aborted.
#[test]
fn a_stream_that_goes_silent_ends_with_an_sse_error_and_aborts_the_engine() {
    let stalling = Engine::start("stall", Behavior::StallAfter(2));
    let router = Router::start(&[
        "--backend",
        &stalling.url(),
        "--stream-idle-timeout-ms",
        "300",
    ]);
    let response = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(response.status, 200);
    let text = response.text();
    assert!(text.starts_with(&chunk_event("stall", 0)), "{text:?}");
    assert!(text.contains(&chunk_event("stall", 1)), "{text:?}");
    assert!(
        text.contains("event: error\ndata: {\"error\"") && text.contains("upstream_timeout"),
        "{text:?}"
    );
    assert!(!text.contains("[DONE]"));
    wait_until("the engine to see the abort", || stalling.cancelled() == 1);
    assert_eq!(timeouts(&router, "stream_idle"), 1.0);
}

/// Finding 4: a 7 MB prompt that is one "word" is proxied whole, but routing tokenizes only
/// what precedes the word (bytes counted in `myelin_tokenize_bytes_total`), so the core is not
/// held for seconds.
#[test]
fn a_huge_one_word_prompt_is_proxied_whole_and_tokenized_only_up_to_the_word() {
    let engine = Engine::start("a", normal());
    let router = Router::start_with_shards(
        1,
        &["--backend", &engine.url(), "--max-body-bytes", "16000000"],
    );
    let word = "a".repeat(7_000_000);
    for _ in 0..2 {
        let response = router.post_json("/v1/chat/completions", &chat_body(&word, false));
        assert_eq!(response.status, 200);
        let seen = engine.record.last_body.lock().unwrap().clone().unwrap();
        assert_eq!(
            seen["messages"][1]["content"].as_str().map(str::len),
            Some(7_000_000)
        );
    }
    let metrics = router.metrics();
    let tokenized = metric_value(&metrics, &["myelin_tokenize_bytes_total"]);
    assert!(
        tokenized > 0.0 && tokenized < 4096.0,
        "{tokenized} bytes tokenized"
    );
    assert_eq!(
        metric_value(
            &metrics,
            &["myelin_tokenize_truncated_total", "reason=\"long_piece\""]
        ),
        2.0
    );
}

/// Finding 8: requests hyper cannot parse get OpenAI error JSON, not empty bodies.
#[test]
fn unparsable_requests_get_openai_errors() {
    let engine = Engine::start("a", normal());
    let router = Router::start(&["--backend", &engine.url()]);
    let raw = |bytes: &[u8]| {
        let mut stream = TcpStream::connect(router.addr).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let _ = stream.write_all(bytes);
        read_response(stream)
    };
    let long_uri = format!("GET /{} HTTP/1.1\r\nhost: t\r\n\r\n", "a".repeat(100_000));
    let many_headers = format!(
        "GET /health HTTP/1.1\r\nhost: t\r\n{}\r\n",
        (0..200)
            .map(|index| format!("x-h{index}: v\r\n"))
            .collect::<String>()
    );
    for (request, status, code) in [
        (
            &b"GET /health HTTP/1.1\r\nhost: t\r\nbad header line\r\n\r\n"[..],
            400,
            "invalid_http_request",
        ),
        (
            &b"GE\x01T / HTTP/1.1\r\n\r\n"[..],
            400,
            "invalid_http_request",
        ),
        (long_uri.as_bytes(), 414, "uri_too_long"),
        (many_headers.as_bytes(), 431, "headers_too_large"),
    ] {
        let response = raw(request);
        assert_eq!(response.status, status);
        assert_eq!(response.header("content-type"), Some("application/json"));
        assert_openai_error_code(&response.json(), code);
    }
    // Still serving.
    let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
    assert_eq!(response.status, 200);
}

/// Finding 8: a drain that reaches its deadline ends the streams still running with an SSE
/// error event (and aborts them on the engine) before the process exits 0.
#[test]
fn a_drain_past_its_deadline_ends_streams_with_an_sse_error() {
    let engine = Engine::start("gated", Behavior::Gated { chunks: 5 });
    let mut router = Router::start(&["--backend", &engine.url(), "--drain-timeout-ms", "300"]);
    let mut stream = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(stream.status, 200);
    engine.release();
    assert!(stream.next_chunk().is_some());
    router.terminate();
    let rest = String::from_utf8(stream.body()).unwrap();
    assert!(
        rest.contains("event: error") && rest.contains("router_draining"),
        "{rest:?}"
    );
    assert!(!rest.contains("[DONE]"));
    assert_eq!(router.wait_exit().code(), Some(0));
    wait_until("the engine to see the abort", || engine.cancelled() == 1);
}

/// Finding 8: a client that gives up on a non-streaming request before its answer is counted
/// as a disconnect (and the engine's request is dropped).
#[test]
fn an_abandoned_non_streaming_request_is_counted_as_a_disconnect() {
    let hung = Engine::start("hung", Behavior::Hang);
    let router = Router::start(&["--backend", &hung.url()]);
    let stream = router.post_json_unread("/v1/chat/completions", &chat_body("hi", false));
    wait_until("the engine to get the request", || hung.requests() == 1);
    drop(stream);
    wait_until("the disconnect to be counted", || {
        metric_value(&router.metrics(), &["myelin_client_disconnects_total"]) == 1.0
    });
}

fn sim_chat(words: usize, seed: usize) -> serde_json::Value {
    let text: Vec<String> = (0..words)
        .map(|i| format!("w{}x{}", seed, i % 97))
        .collect();
    serde_json::json!({
        "model": myelin_sim::DEFAULT_MODEL_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text.join(" ")}],
    })
}

fn sim_cluster(engines: usize, faults: myelin_sim::FaultConfig) -> myelin_sim::SimCluster {
    myelin_sim::SimCluster::start(myelin_sim::ClusterConfig {
        engines,
        speedup: 50.0,
        kv_events: Some(myelin_sim::KvEventsConfig::default()),
        faults,
        ..myelin_sim::ClusterConfig::default()
    })
    .expect("simulated engines")
}

/// Finding 6: an engine whose KV-event batches get lost and that has no replay socket. The
/// gap is detected; the mirror is cleared at the gap and partial from there (its blocks count,
/// the estimate decides for the rest) until the engine drops its cache (`AllBlocksCleared`),
/// when it is exact again.
#[test]
fn a_kv_event_gap_without_replay_leaves_a_partial_mirror_until_it_is_exact_again() {
    let cluster = sim_cluster(
        1,
        myelin_sim::FaultConfig {
            kv_drop_every: Some(3),
            ..myelin_sim::FaultConfig::default()
        },
    );
    let url = cluster.engine_urls()[0].clone();
    let publish = cluster.kv_event_endpoints()[0]
        .as_ref()
        .expect("events")
        .publish
        .clone();
    // No kv-replay: the gap cannot be filled.
    let backend = format!("{url},kv-events={publish}");
    let router = Router::start(&["--backend", &backend, "--residency", "auto"]);
    let residency = || {
        router.backends()[0]["residency"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let mut seed = 0;
    wait_until("a gap to leave the mirror partial", || {
        seed += 1;
        let response = router.post_json("/v1/chat/completions", &sim_chat(40, seed));
        assert_eq!(response.status, 200);
        metric_value(&router.metrics(), &["myelin_kv_events_unsynced_total"]) >= 1.0
            && residency() == "partial"
    });
    let backend = &router.backends()[0];
    assert_eq!(backend["resident_blocks_source"], "kv-events");
    assert_eq!(backend["kv_events_mirror"]["partial"], true);
    assert!(
        backend["kv_events_mirror"]["reason"]
            .as_str()
            .unwrap()
            .contains("lost"),
        "{backend}"
    );
    // The engine drops its cache: the mirror is exact (empty) again. (The reset's batch may
    // itself be one the fault drops: then the next reset's comes through.)
    wait_until("the mirror to be live again", || {
        cluster.reset_prefix_cache(0);
        std::thread::sleep(Duration::from_millis(50));
        residency() == "verified"
    });
    drop(router);
    cluster.shutdown();
}

/// A mesh queue overflowing: the control core drops every third message it sends to a data
/// core. Dropped mirror writes are seen by the sender and healed by resending the whole
/// mirror of every followed engine to that core; dropped backend changes by the periodic
/// backend sync and the admin API's re-sends. Every replica ends up agreeing.
#[test]
fn dropped_control_messages_are_healed() {
    let cluster = sim_cluster(2, myelin_sim::FaultConfig::default());
    let mut args = support::engine_flags(&cluster, "--backend");
    args.extend(
        [
            "--fault-drop-control-messages",
            "3",
            "--routing",
            "round-robin",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let router = Router::start(&args);
    for seed in 0..12 {
        let response = router.post_json("/v1/chat/completions", &sim_chat(60, seed));
        assert_eq!(response.status, 200);
    }
    // Replicas can agree early by missing the same writes: wait for the resync too.
    wait_until(
        "a mirror resync and the replicas to agree on verified mirrors",
        || {
            let resynced = metric_value(
                &router.metrics(),
                &["myelin_state_resyncs_total", "kind=\"mirror\""],
            ) >= 1.0;
            let listing = router.admin("GET", "/admin/backends", None).json();
            let backends = listing["backends"].as_array().cloned().unwrap_or_default();
            resynced
                && listing["replicas_agree"] == true
                && listing["shards_answered"] == 2
                && backends.iter().all(|backend| {
                    backend["residency"] == "verified"
                        && backend["resident_blocks"].as_u64().unwrap_or(0) > 0
                })
        },
    );
    let metrics = router.metrics();
    assert!(
        metric_value(&metrics, &["myelin_cross_core_dropped_messages_total"]) >= 1.0,
        "{metrics}"
    );
    assert!(
        metric_value(&metrics, &["myelin_state_resyncs_total", "kind=\"mirror\""]) >= 1.0,
        "{metrics}"
    );
    // The data cores saw the holes the drops left in their mirror writes (and routed on the
    // estimate until the snapshots rebuilt their mirrors: verified again above).
    assert!(
        metric_value(&metrics, &["myelin_mirror_write_gaps_total"]) >= 1.0,
        "{metrics}"
    );
    // Admin changes still complete (re-sent until every core confirms).
    let drained = router.admin("POST", "/admin/backends/1/drain", None);
    assert_eq!(drained.status, 200);
    for seed in 100..104 {
        let response = router.post_json("/v1/chat/completions", &sim_chat(10, seed));
        assert_eq!(response.header("x-myelin-backend"), Some("0"));
    }
    drop(router);
    cluster.shutdown();
}

/// Finding 7: engine host names are resolved off the data cores (at startup, then by the
/// control core's resolver thread) and handed to them; requests to a named engine work.
#[test]
fn engines_named_by_host_name_are_resolved_off_the_data_cores() {
    use std::net::ToSocketAddrs;
    let engine = Engine::start("named", normal());
    let named = format!("localhost:{}", engine.addr.port());
    let first = named
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next());
    if first.map(|addr| addr.ip()) != Some(engine.addr.ip()) {
        eprintln!(
            "skipped: localhost does not resolve to {} first here",
            engine.addr.ip()
        );
        return;
    }
    let router = Router::start(&["--backend", &format!("http://{named}")]);
    for turn in 0..3 {
        let response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("turn {turn}"), false),
        );
        assert_eq!(response.status, 200);
    }
    // The resolver thread answered too (at once for a name it had not seen).
    wait_until("the resolver thread's answer", || {
        metric_value(
            &router.metrics(),
            &["myelin_dns_resolutions_total", "result=\"ok\""],
        ) >= 1.0
    });
}

/// An engine's KV publisher restarts (its sequence goes back to 0, as after an engine
/// restart): the mirror is cleared, counted, and live again from the new stream.
#[test]
fn a_kv_publisher_restart_clears_the_mirror_and_follows_the_new_stream() {
    let cluster = sim_cluster(1, myelin_sim::FaultConfig::default());
    let url = cluster.engine_urls()[0].clone();
    let endpoints = cluster.kv_event_endpoints()[0].clone().expect("events");
    let backend = format!(
        "{url},kv-events={},kv-replay={}",
        endpoints.publish, endpoints.replay
    );
    let router = Router::start(&["--backend", &backend]);
    let resident = || {
        router.backends()[0]["resident_blocks"]
            .as_u64()
            .unwrap_or(0)
    };
    let response = router.post_json("/v1/chat/completions", &sim_chat(80, 1));
    assert_eq!(response.status, 200);
    wait_until("blocks in the mirror", || resident() > 0);
    assert!(cluster.restart_kv_publisher(0));
    // The next batches carry small sequence numbers again: a restart.
    let mut seed = 10;
    wait_until("the restart to be seen", || {
        seed += 1;
        let response = router.post_json("/v1/chat/completions", &sim_chat(20, seed));
        assert_eq!(response.status, 200);
        metric_value(&router.metrics(), &["myelin_kv_events_restarts_total"]) >= 1.0
    });
    wait_until("the mirror to be live on the new stream", || {
        router.backends()[0]["residency"] == "verified" && resident() > 0
    });
    drop(router);
    cluster.shutdown();
}

/// An engine that answers 500: passed through to the client as it is (only 502/503 and
/// failures before a head are retried), and counted as a failure for its breaker.
#[test]
fn an_engine_500_is_passed_through_and_counted_by_the_breaker() {
    let failing = Engine::start("failing", Behavior::Status(500));
    let router = Router::start(&[
        "--backend",
        &failing.url(),
        "--breaker-failures",
        "2",
        "--breaker-open-ms",
        "60000",
    ]);
    for _ in 0..2 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        assert_eq!(response.status, 500);
        assert!(response.json()["error"]["message"].is_string());
    }
    wait_until("the breaker to open", || {
        metric_value(
            &router.metrics(),
            &["myelin_circuit_breaker_transitions_total", "to=\"open\""],
        ) >= 1.0
    });
    wait_until("requests to be refused while it is open", || {
        router
            .post_json("/v1/chat/completions", &chat_body("hi", false))
            .status
            == 503
    });
    assert_eq!(failing.requests(), 2);
}

/// How long the overload scenario drives three times the in-flight limit by default: a few
/// seconds keep the test short on a shared machine; `MYELIN_FAULTS_OVERLOAD_SECONDS=30` runs
/// it for 30 s.
const OVERLOAD_DURATION: Duration = Duration::from_secs(3);

fn overload_duration() -> Duration {
    std::env::var("MYELIN_FAULTS_OVERLOAD_SECONDS")
        .ok()
        .and_then(|seconds| seconds.parse().ok())
        .map_or(OVERLOAD_DURATION, Duration::from_secs)
}

/// What an overload run's clients got.
#[derive(Debug, Default, Clone, Copy)]
struct OverloadOutcome {
    served: usize,
    rejected: usize,
}

/// `clients` threads send chat requests (streaming and not, alternately) to `router` as fast as
/// they are answered, for `duration`. Every answer must be a complete 200 (the SSE stream ends
/// with `[DONE]`, the JSON parses) or a 429 `router_overloaded` with `Retry-After`; a request
/// that hangs fails on the client's read timeout ([`PATIENCE`], the hang guard).
fn overload(router: &Router, clients: usize, duration: Duration) -> OverloadOutcome {
    let addr = router.addr;
    let until = std::time::Instant::now() + duration;
    let outcomes: Vec<OverloadOutcome> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..clients)
            .map(|client| {
                scope.spawn(move || {
                    let mut outcome = OverloadOutcome::default();
                    let mut turn = 0usize;
                    while std::time::Instant::now() < until {
                        turn += 1;
                        let stream = (client + turn).is_multiple_of(2);
                        // A few distinct prompts: the routing state and tokenizer caches stop
                        // growing after the first round (the memory test relies on it).
                        let body = chat_body(&format!("overload prompt {}", turn % 8), stream);
                        let response = support::request(
                            addr,
                            "POST",
                            "/v1/chat/completions",
                            &[("content-type", "application/json")],
                            Some(body.to_string().as_bytes()),
                        );
                        match response.status {
                            200 if stream => {
                                let text = response.text();
                                assert!(text.ends_with("data: [DONE]\n\n"), "{text:?}");
                                outcome.served += 1;
                            }
                            200 => {
                                assert!(response.json()["choices"].is_array());
                                outcome.served += 1;
                            }
                            429 => {
                                assert!(response.header("retry-after").is_some());
                                assert_openai_error_code(&response.json(), "router_overloaded");
                                outcome.rejected += 1;
                                // Not a pure busy loop on a shared machine.
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            other => panic!("status {other} under overload"),
                        }
                    }
                    outcome
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| thread.join().expect("overload client"))
            .collect()
    });
    outcomes
        .iter()
        .fold(OverloadOutcome::default(), |total, outcome| {
            OverloadOutcome {
                served: total.served + outcome.served,
                rejected: total.rejected + outcome.rejected,
            }
        })
}

/// `count` streaming requests at once; returns their statuses (each stream read to its end).
fn concurrent_streams(router: &Router, count: usize) -> Vec<u16> {
    let addr = router.addr;
    let barrier = std::sync::Barrier::new(count);
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..count)
            .map(|index| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let body = chat_body(&format!("after {index}"), true).to_string();
                    let response = support::request(
                        addr,
                        "POST",
                        "/v1/chat/completions",
                        &[("content-type", "application/json")],
                        Some(body.as_bytes()),
                    );
                    let status = response.status;
                    let text = response.text();
                    if status == 200 {
                        assert!(text.ends_with("data: [DONE]\n\n"), "{text:?}");
                    }
                    status
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| thread.join().expect("client"))
            .collect()
    })
}

/// Three times the in-flight limit for [`OVERLOAD_DURATION`] (or `overload_duration()`): every request is either served
/// (200, complete) or refused at once (429 with Retry-After), none hangs, every refusal is
/// counted, and afterwards the router serves a full limit's worth of requests at once (no
/// in-flight slot leaked).
#[test]
fn three_times_the_in_flight_limit_gets_200s_and_429s_and_nothing_hangs() {
    const LIMIT: usize = 8;
    let engine = Engine::start(
        "a",
        Behavior::Normal {
            chunks: 10,
            interval: Duration::from_millis(20),
        },
    );
    let limit = LIMIT.to_string();
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.url(),
            "--max-in-flight-per-core",
            &limit,
        ],
    );
    let outcome = overload(&router, 3 * LIMIT, overload_duration());
    eprintln!("3x overload: {outcome:?}");
    assert!(outcome.served > 0, "{outcome:?}");
    assert!(outcome.rejected > 0, "three times the limit: {outcome:?}");
    let metrics = router.metrics();
    let chat = "route=\"/v1/chat/completions\"";
    assert_eq!(
        metric_value(&metrics, &["myelin_overload_rejections_total"]),
        outcome.rejected as f64,
        "{outcome:?}"
    );
    assert_eq!(
        metric_value(&metrics, &["myelin_requests_total", chat, "status=\"429\""]),
        outcome.rejected as f64
    );
    assert_eq!(
        metric_value(&metrics, &["myelin_requests_total", chat, "status=\"200\""]),
        outcome.served as f64
    );
    // Afterwards: nothing in flight, and a whole limit's worth served at once.
    let in_flight = "myelin_backend_in_flight_requests{backend=\"0\"} 0";
    wait_until("the in-flight gauge to return to 0", || {
        router.metrics().lines().any(|line| line == in_flight)
    });
    engine.set_behavior(Behavior::Normal {
        chunks: 2,
        interval: Duration::from_millis(200),
    });
    assert_eq!(concurrent_streams(&router, LIMIT), vec![200; LIMIT]);
    assert_eq!(router.get("/health").status, 200);
}

/// Passes of every scenario in the memory test before its baseline reading (the allocator's
/// footprint under this mix levels off within two: measured over eight passes on a shared
/// 2-core machine, it grew ~10 MiB over the first two and stayed within ~5 MiB after).
const WARM_UP_PASSES: usize = 2;
/// Passes of every scenario after the baseline reading in the memory test.
const MEMORY_PASSES: usize = 3;
/// Absolute allowance on top of 10% in the memory test. mimalloc keeps pages a thread freed
/// for its own reuse and returns them to the system lazily, and the first time a burst of
/// connections, a 7 MB body or a new code path needs memory it commits segments it keeps: that
/// is allocator warm-up, not a leak, and varies by a few MiB with how the scheduler happened to
/// interleave the threads. A leak grows with every pass; this floor does not.
const MEMORY_FLOOR_KIB: u64 = 8 * 1024;

/// One pass of the scenarios the memory test repeats on one router: 3x overload, slow uploads,
/// abandoned streams, unparsable requests, a huge one-word prompt, streams that go silent.
fn fault_pass(router: &Router, engine: &Engine) {
    let normal_slow = Behavior::Normal {
        chunks: 5,
        interval: Duration::from_millis(10),
    };
    engine.set_behavior(normal_slow.clone());
    // A 7 MB one-word prompt, proxied whole.
    let word = "a".repeat(7_000_000);
    let response = router.post_json("/v1/chat/completions", &chat_body(&word, false));
    assert_eq!(response.status, 200);
    assert!(response.json()["choices"].is_array());
    // 3x overload (2 shards x 4 in flight).
    let outcome = overload(router, 24, Duration::from_secs(1));
    assert!(outcome.served > 0, "{outcome:?}");
    // Slow uploads: 408 at the body deadline.
    let slow: Vec<TcpStream> = (0..6)
        .map(|_| {
            let mut stream = TcpStream::connect(router.addr).unwrap();
            stream.set_read_timeout(Some(PATIENCE)).unwrap();
            stream
                .write_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n\
                      content-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"m",
                )
                .unwrap();
            stream
        })
        .collect();
    for stream in slow {
        assert_eq!(read_response(stream).status, 408);
    }
    // Streams abandoned after their first chunk.
    for index in 0..10 {
        let mut response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("gone {index}"), true),
        );
        assert_eq!(response.status, 200);
        assert!(response.next_chunk().is_some());
        response.abandon();
    }
    // Requests hyper cannot parse.
    for request in [
        &b"GET /health HTTP/1.1\r\nhost: t\r\nbad header line\r\n\r\n"[..],
        &format!("GET /{} HTTP/1.1\r\nhost: t\r\n\r\n", "a".repeat(100_000)).into_bytes(),
    ] {
        let mut stream = TcpStream::connect(router.addr).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        let _ = stream.write_all(request);
        assert!(read_response(stream).status >= 400);
    }
    // Streams that go silent: an SSE error at the idle deadline.
    engine.set_behavior(Behavior::StallAfter(1));
    for _ in 0..4 {
        let text = router
            .post_json("/v1/chat/completions", &chat_body("stall", true))
            .text();
        assert!(text.contains("upstream_timeout"), "{text:?}");
    }
    engine.set_behavior(normal_slow);
}

/// The router's RSS once nothing is in flight: after some light traffic (mimalloc returns a
/// thread's freed pages to the system when that thread allocates again, so an idle core would
/// keep the peak of its last burst, such as a 7 MB body's copies), the smallest of a few
/// readings (a leak shows in every reading).
fn settled_rss_kib(router: &Router) -> u64 {
    for turn in 0..40 {
        let response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("overload prompt {}", turn % 8), false),
        );
        assert_eq!(response.status, 200);
    }
    (0..5)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(200));
            router.rss_kib()
        })
        .min()
        .unwrap_or(u64::MAX)
}

/// The router's RSS after repeated passes of the fault scenarios stays within 10% (plus the
/// allocator's floor) of its RSS after warm-up passes of the same scenarios (so the memory
/// first touched by each path, and the routing state and tokenizer caches of the prompts used,
/// are in the baseline).
#[test]
fn the_routers_memory_is_flat_across_the_fault_scenarios() {
    let engine = Engine::start("a", normal());
    let router = Router::start(&[
        "--backend",
        &engine.url(),
        "--max-in-flight-per-core",
        "4",
        "--max-body-bytes",
        "16000000",
        "--body-read-timeout-ms",
        "300",
        "--stream-idle-timeout-ms",
        "300",
        // The stalls must not take the only engine out of routing.
        "--breaker-failures",
        "1000000",
    ]);
    let idle = router.rss_kib();
    for _ in 0..WARM_UP_PASSES {
        fault_pass(&router, &engine);
    }
    let in_flight = "myelin_backend_in_flight_requests{backend=\"0\"} 0";
    let settle = || {
        wait_until("nothing in flight", || {
            router.metrics().lines().any(|line| line == in_flight)
        });
        settled_rss_kib(&router)
    };
    let before = settle();
    for _ in 0..MEMORY_PASSES {
        fault_pass(&router, &engine);
    }
    let after = settle();
    eprintln!(
        "router RSS: {idle} KiB at start, {before} KiB after {WARM_UP_PASSES} warm-up passes, \
         {after} KiB after {MEMORY_PASSES} more passes"
    );
    assert!(
        after <= before + before / 10 + MEMORY_FLOOR_KIB,
        "RSS grew from {before} KiB to {after} KiB"
    );
    // Still serving normally.
    assert_eq!(
        router
            .post_json("/v1/chat/completions", &chat_body("after", false))
            .status,
        200
    );
}

/// Garbage on an engine's KV-event socket (wrong frame counts, a bad sequence frame, payloads
/// that are not msgpack or not an event batch): each message is counted and skipped, the
/// subscriber keeps going (a valid batch after them is mirrored and the mirror goes live), and
/// clients are served throughout.
#[test]
fn garbage_kv_event_payloads_are_counted_and_skipped() {
    use myelin_kv_events::wire::{
        BlockStored, EventBatch, KV_CACHE_SPEC_FULL_ATTENTION, KvEvent, WireVersion, encode_batch,
    };
    let engine = Engine::start("a", normal());
    let context = zmq::Context::new();
    let publisher = context.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let backend = format!("{},kv-events={endpoint}", engine.url());
    let router = Router::start(&["--backend", &backend]);
    let decode_errors =
        || metric_value(&router.metrics(), &["myelin_kv_events_decode_errors_total"]);
    let seq = |seq: u64| seq.to_be_bytes().to_vec();
    let garbage: Vec<Vec<Vec<u8>>> = vec![
        // Not msgpack (0xc1 is never used).
        vec![b"kv".to_vec(), seq(0), vec![0xc1, 0xc1, 0xc1]],
        // msgpack, but not an event batch.
        vec![b"kv".to_vec(), seq(0), vec![0x92, 0x01, 0x02]],
        // A sequence frame that is not 8 bytes.
        vec![b"kv".to_vec(), b"seq".to_vec(), vec![0x90]],
        // One frame.
        vec![b"not a kv event".to_vec()],
        // Four frames of noise.
        vec![vec![0xff; 64], vec![0x00; 3], vec![0x42; 1000], Vec::new()],
    ];
    // A SUB socket misses what is published before it connects: send until one is counted.
    wait_until("the first garbage message to be counted", || {
        publisher.send_multipart(&garbage[0], 0).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        decode_errors() >= 1.0
    });
    // Connected now: every one of these is counted once.
    let before = decode_errors();
    for message in &garbage {
        publisher.send_multipart(message, 0).unwrap();
    }
    wait_until("every garbage message to be counted", || {
        decode_errors() == before + garbage.len() as f64
    });
    assert_eq!(
        router
            .post_json("/v1/chat/completions", &chat_body("hi", false))
            .status,
        200
    );
    // A valid batch after the garbage is applied: the subscriber kept going.
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![11, 12],
            parent_block_hash: None,
            token_ids: (1000..1032).collect(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: Some(0),
            kv_cache_spec_kind: Some(KV_CACHE_SPEC_FULL_ATTENTION.into()),
            kv_cache_spec_sliding_window: None,
        })],
        data_parallel_rank: None,
    };
    let payload = encode_batch(&batch, WireVersion::default());
    publisher
        .send_multipart([b"kv".to_vec(), seq(0), payload], 0)
        .unwrap();
    wait_until("the valid batch to be mirrored", || {
        let metrics = router.metrics();
        metric_value(
            &metrics,
            &["myelin_kv_events_blocks_total", "event=\"stored\""],
        ) == 2.0
            && metric_value(&metrics, &["myelin_kv_events_live"]) == 1.0
    });
    assert_eq!(decode_errors(), before + garbage.len() as f64);
    assert_eq!(
        router
            .post_json("/v1/chat/completions", &chat_body("after", true))
            .status,
        200
    );
}

/// `myelin_engine_stalls_total` of backend `id` with this `evidence`.
fn stalls(router: &Router, id: u32, evidence: &str) -> f64 {
    metric_value(
        &router.metrics(),
        &[
            "myelin_engine_stalls_total",
            &format!("backend=\"{id}\""),
            &format!("evidence=\"{evidence}\""),
        ],
    )
}

/// Issue 25, wedged engines: an engine that accepts requests and never answers, while its
/// health endpoint does. With requests in flight there and nothing sent back on any of them
/// for `--engine-stall-ms`, its breaker opens long before any request deadline: new requests
/// go elsewhere. The engine's generated-tokens counter decides where it has one (the fixture's
/// `/metrics` counts answered requests): still as long, wedged. Without one, a stream's silence
/// is proof.
#[test]
fn the_progress_watchdog_takes_a_wedged_engine_out_streaming_and_non_streaming() {
    for (stream, counter, evidence) in [
        (true, true, "progress_counter_still"),
        (false, true, "progress_counter_still"),
        (true, false, "streams_silent"),
    ] {
        let hung = Engine::start("hung", Behavior::Hang);
        hung.record
            .no_metrics
            .store(!counter, std::sync::atomic::Ordering::SeqCst);
        let good = Engine::start("good", normal());
        let router = Router::start_with_shards(
            1,
            &[
                "--routing",
                "round-robin",
                "--backend",
                &hung.url(),
                "--backend",
                &good.url(),
                "--engine-stall-ms",
                "300",
                "--engine-metrics-interval-ms",
                "50",
                // Far beyond the test: only the watchdog can act in time.
                "--upstream-header-timeout-ms",
                "100000",
                "--upstream-response-timeout-ms",
                "100000",
                "--breaker-open-ms",
                "100000",
            ],
        );
        // Two requests: round-robin puts one on each engine; the hung one holds its own.
        let held: Vec<TcpStream> = (0..2)
            .map(|turn| {
                router.post_json_unread(
                    "/v1/chat/completions",
                    &chat_body(&format!("held {turn}"), stream),
                )
            })
            .collect();
        wait_until("the hung engine to hold a request", || hung.requests() == 1);
        wait_until("the watchdog to find the hung engine", || {
            stalls(&router, 0, evidence) >= 1.0
        });
        assert!(
            metric_value(
                &router.metrics(),
                &["myelin_circuit_breaker_transitions_total", "to=\"open\""]
            ) >= 1.0
        );
        // The health endpoint answers all along: only the watchdog knew.
        assert_eq!(
            metric_value(
                &router.metrics(),
                &["myelin_health_check_transitions_total", "to=\"down\""]
            ),
            0.0
        );
        // Every new request goes to the other engine.
        for turn in 0..4 {
            let response = router.post_json(
                "/v1/chat/completions",
                &chat_body(&format!("turn {turn}"), stream),
            );
            assert_eq!(response.status, 200, "turn {turn} (stream: {stream})");
            assert_eq!(response.header("x-myelin-backend"), Some("1"));
        }
        assert_eq!(hung.requests(), 1, "nothing new sent to the wedged engine");
        // The other engine answered: never taken for wedged.
        assert_eq!(stalls(&router, 1, evidence), 0.0);
        drop(held);
    }
}
