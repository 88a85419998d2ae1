//! Integration tests of `myelin serve`: the real binary with 2 shards in front of real HTTP
//! engines on loopback. Timing never goes into an assertion; waits are bounded polls.

mod support;

use std::time::Duration;

use serde_json::json;
use support::engine::{Behavior, Engine, chunk_event, dead_backend_url};
use support::{Router, chat_body, metric_value, request, wait_until};

fn normal() -> Behavior {
    Behavior::Normal {
        chunks: 3,
        interval: Duration::from_millis(1),
    }
}

#[test]
fn streams_chunk_by_chunk_without_buffering() {
    let engine = Engine::start("a", Behavior::Gated { chunks: 3 });
    let router = Router::start(&["--backend", &engine.url()]);
    let mut response = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(response.status, 200);
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    // The backend is named by its id, never by its address.
    assert_eq!(response.header("x-myelin-backend"), Some("0"));
    // The engine sends chunk k+1 only after the client has read chunk k through the router:
    // any buffering in the router would stall this loop (and fail on the read timeout).
    let mut received = String::new();
    for index in 0..3 {
        engine.release();
        let expected = chunk_event("a", index);
        while !received.ends_with(&expected) {
            let chunk = response
                .next_chunk()
                .expect("chunk before the next release");
            received.push_str(&String::from_utf8(chunk).unwrap());
        }
    }
    let rest = String::from_utf8(response.body()).unwrap();
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest:?}");
    assert_eq!(engine.completed(), 1);
}

#[test]
fn non_streaming_chat_and_completions_pass_through_with_headers() {
    let engine = Engine::start("a", normal());
    let router = Router::start(&["--backend", &engine.url()]);
    let body = chat_body("hello", false).to_string();
    let response = request(
        router.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer sk-test"),
            ("x-custom", "kept"),
            ("connection", "close, x-hop"),
            ("x-hop", "dropped"),
        ],
        Some(body.as_bytes()),
    );
    assert_eq!(response.status, 200);
    assert_eq!(response.header("x-myelin-backend"), Some("0"));
    let completion = response.json();
    assert_eq!(
        completion["choices"][0]["message"]["content"],
        "hello from a"
    );
    assert_eq!(
        engine.record.last_authorization.lock().unwrap().as_deref(),
        Some("Bearer sk-test")
    );
    assert_eq!(
        engine.record.last_custom_header.lock().unwrap().as_deref(),
        Some("kept")
    );
    // The body reaches the engine unchanged.
    let seen = engine.record.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(seen["messages"][1]["content"], "hello");

    for prompt in [
        json!("a string"),
        json!(["one", "two"]),
        json!([1, 2, 3]),
        json!([[4, 5], [6]]),
    ] {
        let response = router.post_json(
            "/v1/completions",
            &json!({"model": "test-model", "prompt": prompt}),
        );
        assert_eq!(response.status, 200, "prompt {prompt}");
        let seen = engine.record.last_body.lock().unwrap().clone().unwrap();
        assert_eq!(seen["prompt"], prompt);
    }
}

#[test]
fn bodies_sent_in_many_pieces_reach_the_engine_whole() {
    use std::io::Write;
    let engine = Engine::start("a", normal());
    let router = Router::start(&["--backend", &engine.url()]);
    // One frame, a few, and more frames than the router keeps apart before joining them.
    for pieces in [1usize, 3, 40] {
        let content = format!("pieces {pieces}: {}", "some words of a prompt ".repeat(200));
        let body = chat_body(&content, false).to_string();
        let mut stream = std::net::TcpStream::connect(router.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\
                  content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
            )
            .unwrap();
        let size = body.len().div_ceil(pieces);
        for chunk in body.as_bytes().chunks(size) {
            stream
                .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .unwrap();
            stream.write_all(chunk).unwrap();
            stream.write_all(b"\r\n").unwrap();
            stream.flush().unwrap();
            // Apart in time, so that they arrive as separate reads.
            std::thread::sleep(Duration::from_millis(2));
        }
        stream.write_all(b"0\r\n\r\n").unwrap();
        let response = support::read_response(stream);
        assert_eq!(response.status, 200, "{pieces} pieces");
        let seen = engine.record.last_body.lock().unwrap().clone().unwrap();
        assert_eq!(
            seen["messages"][1]["content"],
            content.as_str(),
            "{pieces} pieces"
        );
    }
}

#[test]
fn same_prefix_goes_to_the_same_backend() {
    let engines = [Engine::start("a", normal()), Engine::start("b", normal())];
    let router = Router::start(&[
        "--backend",
        &engines[0].url(),
        "--backend",
        &engines[1].url(),
    ]);
    let long_prompt = "The same long system prompt. ".repeat(60);
    let mut chosen = Vec::new();
    for turn in 0..6 {
        let response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("{long_prompt} question {turn}"), false),
        );
        assert_eq!(response.status, 200);
        chosen.push(response.header("x-myelin-backend").unwrap().to_string());
        // The next request may land on the other data core: once the route learned here is in
        // its replica too and the request has left the load (on a busy machine either can
        // take a moment), it must go the same way.
        wait_until(
            "the learned route in every replica, nothing in flight",
            || {
                let listing = router.admin("GET", "/admin/backends", None).json();
                listing["replicas_agree"] == true
                    && listing["backends"]
                        .as_array()
                        .is_some_and(|all| all.iter().all(|b| b["in_flight_requests"] == 0))
            },
        );
    }
    assert!(chosen.iter().all(|url| url == &chosen[0]), "{chosen:?}");
    let metrics = router.metrics();
    assert!(metric_value(&metrics, &["myelin_router_prefix_match_blocks_count"]) >= 6.0);
}

#[test]
fn long_prompts_are_tokenized_in_full_only_when_their_prefix_matches() {
    let engines = [Engine::start("a", normal()), Engine::start("b", normal())];
    // One shard: every request sees the same history.
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engines[0].url(),
            "--backend",
            &engines[1].url(),
            "--tokenize-prefix-bytes",
            "1024",
        ],
    );
    let shared = "A long shared document about caches and routers. ".repeat(120);
    let unique = |seed: usize| format!("Unrelated text number {seed}. ").repeat(200);
    let mut chosen = Vec::new();
    for turn in 0..4 {
        let response = router.post_json(
            "/v1/chat/completions",
            &chat_body(&format!("{shared} question {turn}"), false),
        );
        assert_eq!(response.status, 200);
        chosen.push(response.header("x-myelin-backend").unwrap().to_string());
    }
    assert!(chosen.iter().all(|url| url == &chosen[0]), "{chosen:?}");
    for seed in 0..3 {
        let response = router.post_json("/v1/chat/completions", &chat_body(&unique(seed), false));
        assert_eq!(response.status, 200);
    }
    let metrics = router.metrics();
    let extent = |name: &str| {
        metric_value(
            &metrics,
            &[
                "myelin_tokenize_prompts_total",
                &format!("extent=\"{name}\""),
            ],
        )
    };
    // The first shared-prefix request and the unique ones stop after the prefix; the second
    // matches it to its end and is tokenized in full; later ones go whole at once.
    assert_eq!(extent("prefix"), 4.0);
    assert_eq!(extent("prefix_then_whole"), 1.0);
    assert_eq!(extent("known_long_prefix"), 2.0);
    // The full-depth match is learned: the last shared request matched far past the prefix.
    let deep_matches = metric_value(
        &metrics,
        &["myelin_router_prefix_match_blocks_bucket", "le=\"512\""],
    ) - metric_value(
        &metrics,
        &["myelin_router_prefix_match_blocks_bucket", "le=\"64\""],
    );
    assert!(deep_matches >= 1.0, "{metrics}");
}

#[test]
fn fails_over_before_the_first_byte() {
    let dead = dead_backend_url();
    let busy = Engine::start("busy", Behavior::Status(503));
    let good = Engine::start("good", normal());
    let router = Router::start(&[
        "--routing",
        "round-robin",
        "--backend",
        &dead,
        "--backend",
        &busy.url(),
        "--backend",
        &good.url(),
        "--retry-backoff-ms",
        "1",
        "--breaker-failures",
        "1000",
    ]);
    for _ in 0..6 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", true));
        assert_eq!(response.status, 200);
        // good is the third backend: id 2.
        assert_eq!(response.header("x-myelin-backend"), Some("2"));
        assert!(response.text().ends_with("data: [DONE]\n\n"));
    }
    let metrics = router.metrics();
    assert!(metric_value(&metrics, &["myelin_retries_total", "reason=\"connect\""]) >= 1.0);
    assert!(metric_value(&metrics, &["myelin_retries_total", "reason=\"status_503\""]) >= 1.0);
    assert!(busy.requests() >= 1);
}

#[test]
fn passes_the_last_failure_through_when_every_backend_fails() {
    let busy = Engine::start("busy", Behavior::Status(503));
    let router = Router::start(&["--backend", &busy.url(), "--backend", &dead_backend_url()]);
    let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
    assert!(matches!(response.status, 502 | 503), "{}", response.status);
    let error = response.json();
    assert!(error["error"]["message"].is_string());
}

#[test]
fn does_not_retry_after_streaming_began() {
    let broken = Engine::start("broken", Behavior::BreakAfter(2));
    let spare = Engine::start("spare", normal());
    // Round-robin starts at the first backend on each core: the broken one.
    let router = Router::start(&[
        "--routing",
        "round-robin",
        "--backend",
        &broken.url(),
        "--backend",
        &spare.url(),
    ]);
    let response = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(response.status, 200);
    assert_eq!(response.header("x-myelin-backend"), Some("0"));
    let text = response.text();
    assert!(text.starts_with(&chunk_event("broken", 0)), "{text:?}");
    assert!(text.contains(&chunk_event("broken", 1)));
    assert!(
        text.trim_end().ends_with('}') && text.contains("event: error\ndata: {\"error\""),
        "{text:?}"
    );
    assert!(!text.contains("[DONE]"));
    assert_eq!(spare.requests(), 0, "a started stream must not be retried");
    let metrics = router.metrics();
    assert_eq!(
        metric_value(&metrics, &["myelin_upstream_stream_errors_total"]),
        1.0
    );
}

#[test]
fn client_disconnect_cancels_the_engine_request() {
    let engine = Engine::start(
        "slow",
        Behavior::Normal {
            chunks: 10_000,
            interval: Duration::from_millis(5),
        },
    );
    let router = Router::start(&["--backend", &engine.url()]);
    let mut response = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(response.status, 200);
    assert!(response.next_chunk().is_some());
    response.abandon();
    wait_until("the engine to see the cancellation", || {
        engine.cancelled() == 1
    });
    assert_eq!(engine.completed(), 0);
    wait_until("the disconnect metric", || {
        metric_value(&router.metrics(), &["myelin_client_disconnects_total"]) >= 1.0
    });
}

#[test]
fn health_checks_take_a_backend_down_and_bring_it_back() {
    let flaky = Engine::start("flaky", normal());
    let steady = Engine::start("steady", normal());
    let router = Router::start(&[
        "--routing",
        "round-robin",
        "--backend",
        &flaky.url(),
        "--backend",
        &steady.url(),
        "--health-interval-ms",
        "20",
        "--unhealthy-threshold",
        "2",
        "--healthy-threshold",
        "2",
    ]);
    let state_of = |url: &str| {
        router
            .backends()
            .into_iter()
            .find(|backend| backend["url"] == url)
            .map(|backend| backend["state"].as_str().unwrap_or_default().to_string())
            .unwrap_or_default()
    };
    assert_eq!(state_of(&flaky.url()), "up");
    flaky.set_healthy(false);
    wait_until("flaky to be down", || state_of(&flaky.url()) == "down");
    let before = flaky.requests();
    for _ in 0..6 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        // steady is backend 1.
        assert_eq!(response.header("x-myelin-backend"), Some("1"));
    }
    assert_eq!(flaky.requests(), before);
    assert_eq!(router.get("/health").status, 200);
    steady.set_healthy(false);
    // State changes reach the cores one message apart: poll instead of racing them.
    wait_until("steady to be down", || state_of(&steady.url()) == "down");
    wait_until("health to fail", || router.get("/health").status == 503);
    wait_until("requests to be refused", || {
        router
            .post_json("/v1/chat/completions", &chat_body("hi", false))
            .status
            == 503
    });
    flaky.set_healthy(true);
    wait_until("flaky to be up again", || state_of(&flaky.url()) == "up");
    wait_until("requests to reach flaky again", || {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        response.header("x-myelin-backend") == Some("0")
    });
    let metrics = router.metrics();
    assert!(
        metric_value(
            &metrics,
            &["myelin_health_check_transitions_total", "to=\"down\""]
        ) >= 1.0
    );
}

#[test]
fn circuit_breaker_opens_on_consecutive_failures_and_closes_after_a_probe() {
    let failing = Engine::start("failing", Behavior::Status(503));
    let steady = Engine::start("steady", normal());
    let router = Router::start(&[
        "--routing",
        "round-robin",
        "--backend",
        &failing.url(),
        "--backend",
        &steady.url(),
        "--breaker-failures",
        "2",
        "--breaker-open-ms",
        "100",
        "--health-interval-ms",
        "60000",
        "--retry-backoff-ms",
        "1",
    ]);
    for _ in 0..4 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        assert_eq!(response.status, 200);
    }
    wait_until("the breaker to open", || {
        metric_value(
            &router.metrics(),
            &["myelin_circuit_breaker_transitions_total", "to=\"open\""],
        ) >= 1.0
    });
    // The probe is GET /health, which this engine passes: the breaker closes again.
    wait_until("the breaker to close", || {
        metric_value(
            &router.metrics(),
            &["myelin_circuit_breaker_transitions_total", "to=\"closed\""],
        ) >= 1.0
    });
}

/// Every core's replica learns every route, whichever core routed it: token-id prompts of
/// exactly four blocks, alternated over two backends, counted by the admin listing, whose
/// replicas all agree once the learn batches have landed.
#[test]
fn admin_counts_routed_blocks_in_every_replica() {
    let first = Engine::start("first", normal());
    let second = Engine::start("second", normal());
    let router = Router::start(&[
        "--backend",
        &first.url(),
        "--backend",
        &second.url(),
        "--routing",
        "round-robin",
        "--block-size",
        "16",
    ]);
    let before = router.admin("GET", "/admin/backends", None).json();
    assert_eq!(before["shards_answered"], 2);
    for backend in before["backends"].as_array().unwrap() {
        assert_eq!(backend["routed_blocks"], 0);
    }
    let mut sent_to: std::collections::BTreeMap<String, u64> = Default::default();
    for prompt in 0..6u32 {
        let ids: Vec<u32> = (0..64).map(|token| 1_000 + prompt * 100 + token).collect();
        let response = router.post_json(
            "/v1/completions",
            &json!({"model": "test-model", "prompt": ids, "max_tokens": 4}),
        );
        assert_eq!(response.status, 200);
        let backend = response.header("x-myelin-backend").unwrap().to_string();
        *sent_to.entry(backend).or_default() += 1;
    }
    // A route reaches the other replica by message: give the last one a moment to land.
    let expected_total = 6 * 4;
    let mut listing = router.admin("GET", "/admin/backends", None).json();
    for _ in 0..40 {
        let total: u64 = listing["backends"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|backend| backend["routed_blocks"].as_u64())
            .sum();
        if total == expected_total && listing["replicas_agree"] == true {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        listing = router.admin("GET", "/admin/backends", None).json();
    }
    assert_eq!(listing["shards"], 2);
    assert_eq!(listing["shards_answered"], 2);
    assert_eq!(listing["replicas_agree"], true, "{listing}");
    for backend in listing["backends"].as_array().unwrap() {
        let id = backend["id"].to_string();
        let prompts = sent_to.get(&id).copied().unwrap_or(0);
        assert_eq!(backend["routed_blocks"], prompts * 4, "{backend}");
        assert_eq!(backend["resident_blocks"], prompts * 4, "{backend}");
        assert_eq!(backend["resident_blocks_source"], "routes");
    }
}

#[test]
fn admin_adds_drains_and_removes_backends() {
    let first = Engine::start("first", normal());
    let second = Engine::start("second", normal());
    let router = Router::start(&["--backend", &first.url()]);
    let listed = router.backends();
    assert_eq!(listed.len(), 1);
    for key in [
        "id",
        "url",
        "state",
        "in_flight_requests",
        "in_flight_tokens",
        "residency",
        "routed_blocks",
        "resident_blocks",
        "resident_blocks_source",
    ] {
        assert!(listed[0].get(key).is_some(), "missing {key}");
    }
    assert_eq!(listed[0]["residency"], "estimate");

    let add = |url: &str| router.admin("POST", "/admin/backends", Some(&json!({"url": url})));
    let added = add(&second.url());
    assert_eq!(added.status, 201);
    let added = added.json();
    let second_id = added["id"].as_u64().unwrap();
    assert_eq!(router.backends().len(), 2);
    assert_eq!(add(&second.url()).status, 409);
    assert_eq!(add("ftp://x").status, 400);

    let first_id = listed[0]["id"].as_u64().unwrap();
    let removed = router.admin("DELETE", &format!("/admin/backends/{first_id}"), None);
    assert_eq!(removed.status, 200);
    // Every core applied the removal before the admin call returned: all traffic goes to second.
    for _ in 0..6 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        assert_eq!(
            response.header("x-myelin-backend"),
            Some(second_id.to_string().as_str())
        );
    }
    let missing = router.admin("DELETE", &format!("/admin/backends/{first_id}"), None);
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "backend_not_found");

    let drained = router.admin("POST", &format!("/admin/backends/{second_id}/drain"), None);
    assert_eq!(drained.status, 200);
    assert_eq!(drained.json()["state"], "draining");
    let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
    assert_eq!(response.status, 503);
    assert_eq!(response.json()["error"]["code"], "no_backend_available");
}

/// The admin API lives on its own listener with a bearer token; clients see backend ids, never
/// engine addresses; URLs with credentials or bad ports are refused.
#[test]
fn admin_api_is_separate_authenticated_and_never_leaks_engine_addresses() {
    let engine = Engine::start("a", normal());
    let dir = std::env::temp_dir().join(format!("myelin-admin-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_path = dir.join("admin-token");
    std::fs::write(&token_path, "tok-123\n").unwrap();
    let dead = dead_backend_url();
    let router = Router::start(&[
        "--backend",
        &dead,
        "--backend",
        &engine.url(),
        "--routing",
        "round-robin",
        "--retry-backoff-ms",
        "1",
        "--max-retries",
        "0",
        "--admin-token-file",
        token_path.to_str().unwrap(),
    ]);
    let admin = router.admin_addr();
    assert_ne!(admin.port(), router.addr.port());
    let with_token = |method: &str, path: &str, token: Option<&str>, body: Option<&str>| {
        let authorization = token.map(|token| format!("Bearer {token}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(value) = &authorization {
            headers.push(("authorization", value.as_str()));
        }
        request(admin, method, path, &headers, body.map(str::as_bytes))
    };
    // No token, a wrong one: 401, whatever the path.
    for token in [None, Some("tok-12"), Some("tok-1234")] {
        let refused = with_token("GET", "/admin/backends", token, None);
        assert_eq!(refused.header("www-authenticate"), Some("Bearer"));
        assert_openai_error(refused, 401, None);
    }
    assert_eq!(
        with_token("DELETE", "/admin/backends/0", None, None).status,
        401
    );
    // /metrics is behind the same token.
    assert_eq!(with_token("GET", "/metrics", None, None).status, 401);
    let scraped = with_token("GET", "/metrics", Some("tok-123"), None);
    assert_eq!(scraped.status, 200);
    assert!(
        scraped
            .text()
            .contains("myelin_backend_up{backend=\"1\"} 1")
    );
    let listing = with_token("GET", "/admin/backends", Some("tok-123"), None);
    assert_eq!(listing.status, 200);
    let listing = listing.json();
    // Operators still see the URLs.
    assert_eq!(listing["backends"][1]["url"], engine.url());

    // Not on the client port, with or without the token.
    for method in ["GET", "POST", "DELETE"] {
        let response = request(
            router.addr,
            method,
            "/admin/backends/0",
            &[("authorization", "Bearer tok-123")],
            None,
        );
        assert_eq!(response.status, 404, "{method}");
    }

    // Validation: credentials (never echoed), port range, scheme.
    let add = |url: &str| {
        let body = json!({ "url": url }).to_string();
        with_token("POST", "/admin/backends", Some("tok-123"), Some(&body))
    };
    let with_password = add("http://user:hunter2@127.0.0.1:9");
    assert_eq!(with_password.status, 400);
    let text = with_password.text();
    assert!(
        text.contains("credentials") && !text.contains("hunter2"),
        "{text}"
    );
    for bad in [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "ftp://h:1",
        "http://:80",
    ] {
        assert_eq!(add(bad).status, 400, "{bad}");
    }
    // Another scheme is refused with the reason.
    let gopher = add("gopher://127.0.0.1:70");
    assert_eq!(gopher.status, 400);
    let text = gopher.text();
    assert!(
        text.contains("must start with http:// or https://"),
        "{text}"
    );
    assert_eq!(router.backends_with_token("tok-123").len(), 2);

    // A body that is not declared JSON (what an HTML form sends) is refused: 415.
    let body = json!({ "url": "http://127.0.0.1:9" }).to_string();
    let form = request(
        admin,
        "POST",
        "/admin/backends",
        &[
            ("content-type", "text/plain"),
            ("authorization", "Bearer tok-123"),
        ],
        Some(body.as_bytes()),
    );
    assert_openai_error(form, 415, None);
    // Anything a browser sends (Origin, Sec-Fetch-Site) is refused, even with the token.
    for header in [
        ("origin", "http://evil.example"),
        ("sec-fetch-site", "cross-site"),
    ] {
        let from_page = request(
            admin,
            "POST",
            "/admin/backends/0/drain",
            &[header, ("authorization", "Bearer tok-123")],
            None,
        );
        assert_openai_error(from_page, 403, None);
    }
    assert_eq!(router.backends_with_token("tok-123").len(), 2);

    // Clients get ids: the header and the 502 of a dead engine never carry its address.
    let engine_port = engine.addr.port().to_string();
    let dead_port = dead.rsplit(':').next().unwrap().to_string();
    let mut saw_502 = false;
    for _ in 0..4 {
        let response = router.post_json("/v1/chat/completions", &chat_body("hi", false));
        let header = response.header("x-myelin-backend").map(str::to_string);
        let status = response.status;
        let text = response.text();
        assert!(!text.contains("127.0.0.1"), "{text}");
        match status {
            200 => assert_eq!(header.as_deref(), Some("1")),
            502 => {
                saw_502 = true;
                assert!(
                    text.contains("backend 0") && !text.contains(&dead_port),
                    "{text}"
                );
            }
            other => panic!("unexpected status {other}: {text}"),
        }
        if let Some(header) = header {
            assert!(!header.contains(&engine_port), "{header}");
        }
    }
    assert!(
        saw_502,
        "round-robin with no retry reaches the dead backend"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn refuses_an_unauthenticated_admin_api_off_loopback_and_urls_with_credentials() {
    let run = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
            .args(args)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{args:?} started");
        String::from_utf8(output.stderr).unwrap()
    };
    let stderr = run(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "0.0.0.0:0",
        "--backend",
        "http://127.0.0.1:1",
    ]);
    assert!(stderr.contains("--admin-token-file"), "{stderr}");
    let stderr = run(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--backend",
        "http://admin:hunter2@127.0.0.1:1",
    ]);
    assert!(
        stderr.contains("credentials") && !stderr.contains("hunter2"),
        "{stderr}"
    );
    let stderr = run(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--backend",
        "http://127.0.0.1:99999",
    ]);
    assert!(stderr.contains("port"), "{stderr}");
}

fn assert_openai_error(response: support::HttpResponse, status: u16, param: Option<&str>) {
    assert_eq!(response.status, status);
    let body = response.json();
    let error = &body["error"];
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|message| !message.is_empty()),
        "{body}"
    );
    assert!(error["type"].is_string(), "{body}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{body}"
    );
    if let Some(param) = param {
        assert_eq!(error["param"], param, "{body}");
    }
}

#[test]
fn every_bad_input_gets_an_openai_error() {
    let engine = Engine::start("a", normal());
    let router = Router::start(&["--backend", &engine.url(), "--max-body-bytes", "2000"]);
    let post = |path: &str, body: &str| {
        request(
            router.addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            Some(body.as_bytes()),
        )
    };
    let chat = "/v1/chat/completions";
    assert_openai_error(post(chat, "{not json"), 400, None);
    assert_openai_error(post(chat, "[1,2]"), 400, None);
    assert_openai_error(
        post(chat, r#"{"messages":[{"role":"user","content":"x"}]}"#),
        400,
        Some("model"),
    );
    assert_openai_error(
        post(
            chat,
            r#"{"model":7,"messages":[{"role":"user","content":"x"}]}"#,
        ),
        400,
        Some("model"),
    );
    assert_openai_error(
        post(chat, r#"{"model":"test-model"}"#),
        400,
        Some("messages"),
    );
    assert_openai_error(
        post(chat, r#"{"model":"test-model","messages":"hi"}"#),
        400,
        Some("messages"),
    );
    assert_openai_error(
        post(
            chat,
            r#"{"model":"test-model","messages":[{"content":"x"}]}"#,
        ),
        400,
        Some("messages[0].role"),
    );
    assert_openai_error(
        post(
            chat,
            r#"{"model":"test-model","messages":[{"role":"user","content":3}]}"#,
        ),
        400,
        Some("messages[0].content"),
    );
    assert_openai_error(
        post(
            chat,
            r#"{"model":"test-model","stream":"yes","messages":[{"role":"user","content":"x"}]}"#,
        ),
        400,
        Some("stream"),
    );
    assert_openai_error(
        post(
            chat,
            r#"{"model":"test-model","max_tokens":"9","messages":[{"role":"user","content":"x"}]}"#,
        ),
        400,
        Some("max_tokens"),
    );
    let completions = "/v1/completions";
    assert_openai_error(
        post(completions, r#"{"model":"test-model"}"#),
        400,
        Some("prompt"),
    );
    assert_openai_error(
        post(completions, r#"{"model":"test-model","prompt":{"a":1}}"#),
        400,
        Some("prompt"),
    );
    assert_openai_error(
        post(completions, r#"{"model":"test-model","prompt":[1,"x"]}"#),
        400,
        Some("prompt"),
    );
    assert_openai_error(
        post(completions, r#"{"model":"test-model","prompt":[-1]}"#),
        400,
        Some("prompt"),
    );
    let oversized = format!(
        r#"{{"model":"test-model","prompt":"{}"}}"#,
        "x".repeat(5000)
    );
    assert_openai_error(post(completions, &oversized), 413, None);
    assert_openai_error(router.get("/v1/nothing"), 404, None);
    assert_openai_error(router.get("/v1/chat/completions"), 405, None);
    assert_openai_error(post("/v1/models", "{}"), 405, None);
    // The admin API is not on the client port.
    assert_openai_error(router.get("/admin/backends"), 404, None);
    assert_openai_error(
        request(router.addr, "PUT", "/admin/backends", &[], None),
        404,
        None,
    );
    assert_eq!(engine.requests(), 0, "no bad request reaches the engine");
    // Still serving.
    assert_eq!(
        router.post_json(chat, &chat_body("fine", false)).status,
        200
    );
}

#[test]
fn per_core_in_flight_limit_answers_429_with_retry_after() {
    let engine = Engine::start("gated", Behavior::Gated { chunks: 1 });
    let router = Router::start_with_shards(
        1,
        &[
            "--backend",
            &engine.url(),
            "--max-in-flight-per-core",
            "1",
            "--retry-after-seconds",
            "7",
        ],
    );
    let mut held = router.post_json("/v1/chat/completions", &chat_body("hold", true));
    assert_eq!(held.status, 200);
    let rejected = router.post_json("/v1/chat/completions", &chat_body("more", true));
    assert_eq!(rejected.header("retry-after"), Some("7"));
    assert_openai_error(rejected, 429, None);
    engine.release();
    assert!(held.next_chunk().is_some());
    let _ = held.body();
    wait_until("the slot to free up", || {
        router
            .post_json("/v1/chat/completions", &chat_body("again", false))
            .status
            == 200
    });
}

#[test]
fn models_is_the_union_of_the_backends() {
    let engines = [Engine::start("a", normal()), Engine::start("b", normal())];
    let router = Router::start(&[
        "--backend",
        &engines[0].url(),
        "--backend",
        &engines[1].url(),
    ]);
    let models = router.get("/v1/models").json();
    let mut ids: Vec<String> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| model["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["model-a", "model-b", "test-model"]);
    assert_eq!(router.get("/health").status, 200);
}

/// /metrics is on the admin API (and `--metrics-listen`), not on the client port unless
/// `--metrics-on-client-port`; its series name backends by id, never by address.
#[test]
fn metrics_are_served_on_the_admin_api_and_metrics_listen_not_to_clients() {
    let engine = Engine::start("a", normal());
    let metrics_listen = support::engine::free_loopback_addr().to_string();
    let router = Router::start(&[
        "--backend",
        &engine.url(),
        "--metrics-listen",
        &metrics_listen,
    ]);
    // Unlabelled counters exist from the start: a scrape before any event reads 0.
    let before = router.metrics();
    assert!(
        before
            .lines()
            .any(|line| line == "myelin_router_residency_route_downgrades_total 0"),
        "{before}"
    );
    let streamed = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(streamed.status, 200);
    // Read to the end: the duration is recorded when the body ends.
    assert!(streamed.text().ends_with("data: [DONE]\n\n"));
    let text = router.metrics();
    for name in [
        "myelin_requests_total{route=\"/v1/chat/completions\",status=\"200\"}",
        "myelin_request_ttft_seconds_bucket",
        "myelin_request_duration_seconds_bucket",
        "myelin_routing_decision_seconds_bucket",
        "myelin_tokenize_seconds_bucket",
        "myelin_backend_selected_total",
        "myelin_backend_in_flight_requests",
        "myelin_router_prefix_match_blocks_bucket",
        "myelin_cross_core_messages_total",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
    // The data cores record through handles registered once per core (per backend when it is
    // added): the values still land in the shared series, once per event.
    let backend = "backend=\"0\"";
    assert!(
        !text.contains(&engine.url()),
        "an engine address in\n{text}"
    );
    let chat = "route=\"/v1/chat/completions\"";
    assert_eq!(
        metric_value(&text, &["myelin_requests_total", chat, "status=\"200\""]),
        1.0
    );
    assert_eq!(
        metric_value(&text, &["myelin_backend_selected_total", backend]),
        1.0
    );
    assert_eq!(
        metric_value(&text, &["myelin_request_ttft_seconds_count", chat]),
        1.0
    );
    assert_eq!(
        metric_value(
            &text,
            &["myelin_tokenize_prompts_total", "extent=\"whole\""]
        ),
        1.0
    );
    // The in-flight gauge goes back to 0 and the duration is recorded once the relay ends.
    wait_until("the stream's end to be recorded", || {
        let text = router.metrics();
        let in_flight = format!("myelin_backend_in_flight_requests{{{backend}}} 0");
        text.lines().any(|line| line == in_flight)
            && metric_value(&text, &["myelin_request_duration_seconds_count", chat]) == 1.0
    });
    let separate = request(
        metrics_listen.parse().unwrap(),
        "GET",
        "/metrics",
        &[],
        None,
    );
    assert_eq!(separate.status, 200);
    assert!(separate.text().contains("myelin_requests_total"));
    // Clients get a 404 in OpenAI's shape.
    let client = router.get("/metrics");
    assert_eq!(client.status, 404);
    assert_eq!(client.json()["error"]["code"], "unknown_url");
    drop(router);

    let open = Router::start(&["--backend", &engine.url(), "--metrics-on-client-port"]);
    let client = open.get("/metrics");
    assert_eq!(client.status, 200);
    assert!(
        client
            .text()
            .contains("myelin_backend_selected_total{backend=\"0\"} 0")
    );
}

#[test]
fn sigterm_drains_in_flight_streams_then_exits_zero() {
    let engine = Engine::start("gated", Behavior::Gated { chunks: 3 });
    let mut router = Router::start(&["--backend", &engine.url(), "--drain-timeout-ms", "10000"]);
    let mut stream = router.post_json("/v1/chat/completions", &chat_body("hi", true));
    assert_eq!(stream.status, 200);
    engine.release();
    assert!(stream.next_chunk().is_some());
    router.terminate();
    // New connections are refused once the listeners close.
    wait_until("the listener to close", || {
        std::net::TcpStream::connect(router.addr).is_err()
    });
    // The stream in flight still completes.
    engine.release();
    engine.release();
    let rest = String::from_utf8(stream.body()).unwrap();
    assert!(rest.ends_with("data: [DONE]\n\n"), "{rest:?}");
    let status = router.wait_exit();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn config_file_and_environment_configure_the_server() {
    let engine = Engine::start("a", normal());
    let dir = std::env::temp_dir().join(format!("myelin-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("myelin.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\nadmin-listen = \"127.0.0.1:0\"\nshards = 2\nno-pin = true\nrouting = \"least-load\"\nmax-body-bytes = 100\nbackend = [\"{}\"]\n",
            engine.url()
        ),
    )
    .unwrap();
    let router = Router::start_raw(
        &[
            "serve",
            "--config",
            path.to_str().unwrap(),
            "--max-body-bytes",
            "300",
        ],
        &[("MYELIN_RESIDENCY", "off")],
    );
    let line = format!("{}", router.addr);
    assert!(line.starts_with("127.0.0.1:"));
    // The flag (300) overrides the file (100).
    let body = chat_body(&"x".repeat(150), false);
    assert_eq!(router.post_json("/v1/chat/completions", &body).status, 200);
    let too_big = chat_body(&"x".repeat(400), false);
    assert_eq!(
        router.post_json("/v1/chat/completions", &too_big).status,
        413
    );
    assert_eq!(router.backends()[0]["residency"], "off");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn help_documents_defaults() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(output.stdout).unwrap();
    for needle in [
        "--listen",
        "[default: 0.0.0.0:8080]",
        "--routing",
        "[default: prefix]",
        "--residency",
        "[default: auto]",
        "--backend",
        "--sim",
        "--max-body-bytes",
        "MYELIN_LISTEN",
    ] {
        assert!(help.contains(needle), "help lacks {needle}:\n{help}");
    }
}

#[test]
fn bad_configuration_is_reported_not_panicked() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("no backends"), "{stderr}");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args(["serve", "--backend", "tcp://x:1"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("must start with http:// or https://"),
        "{stderr}"
    );
    // A TLS file that does not load is named with its flag.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args([
            "serve",
            "--backend",
            "http://x:1",
            "--tls-cert",
            "/nonexistent/cert.pem",
            "--tls-key",
            "/nonexistent/key.pem",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("--tls-cert/--tls-key") && stderr.contains("/nonexistent/cert.pem"),
        "{stderr}"
    );
}

/// One request over a Unix socket (`Connection: close`): status and body.
fn unix_request(
    socket: &std::path::Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(support::PATIENCE))
        .expect("timeout");
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad response {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn admin_api_on_a_unix_socket() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let engine = Engine::start("a", normal());
    let dir = std::env::temp_dir().join(format!("myelin-admin-unix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("admin.sock");
    // A socket file left behind by a process that is gone: replaced at start.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let listen = format!("unix:{}", socket.display());
    let serve = |extra: &[&str]| {
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            &listen,
            "--shards",
            "2",
            "--no-pin",
        ];
        args.extend_from_slice(extra);
        args.iter().map(|arg| arg.to_string()).collect::<Vec<_>>()
    };
    let args = serve(&["--backend", &engine.url()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut router = Router::start_raw(&args, &[]);
    assert_eq!(router.admin, None, "no TCP admin listener");
    let metadata = std::fs::metadata(&socket).unwrap();
    assert!(metadata.file_type().is_socket());
    assert_eq!(metadata.permissions().mode() & 0o777, 0o600);

    // The admin API over the socket, without a token (only this host's users that may open
    // the file reach it).
    let (status, body) = unix_request(&socket, "GET", "/admin/backends", None);
    assert_eq!(status, 200, "{body}");
    let listing: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listing["backends"][0]["url"], engine.url());
    let second = Engine::start("b", normal());
    let add = json!({ "url": second.url() }).to_string();
    let (status, body) = unix_request(&socket, "POST", "/admin/backends", Some(&add));
    assert_eq!(status, 201, "{body}");
    let (status, body) = unix_request(&socket, "POST", "/admin/backends/0/drain", None);
    assert_eq!(status, 200, "{body}");
    let (_, body) = unix_request(&socket, "GET", "/admin/backends", None);
    let listing: serde_json::Value = serde_json::from_str(&body).unwrap();
    let states: Vec<&str> = listing["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|backend| backend["state"].as_str().unwrap())
        .collect();
    assert_eq!(states.len(), 2, "{listing}");
    assert_eq!(states[0], "draining", "{listing}");
    // The client port still refuses admin paths.
    assert_eq!(router.get("/admin/backends").status, 404);
    let response = router.post_json("/admin/backends", &json!({ "url": second.url() }));
    assert_eq!(response.status, 404);

    // A second router does not take over a live socket.
    let args = serve(&["--backend", &engine.url()]);
    let mut other = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + support::STARTUP_PATIENCE;
    let status = loop {
        if let Some(status) = other.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = other.kill();
            panic!("a second router on a live admin socket kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut other.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("in use"), "{stderr}");
    let (status, _) = unix_request(&socket, "GET", "/admin/backends", None);
    assert_eq!(status, 200, "the first router still serves its socket");

    // Removed at shutdown.
    router.terminate();
    assert_eq!(router.wait_exit().code(), Some(0));
    assert!(!socket.exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn load_counts_the_prompt_until_the_first_token_then_only_the_output() {
    let engine = Engine::start("gated", Behavior::Gated { chunks: 2 });
    let router = Router::start(&["--backend", &engine.url()]);
    let prompt: Vec<u32> = (1000..1100).collect();
    let body = json!({"model": "test-model", "prompt": prompt, "max_tokens": 7, "stream": true});
    let in_flight_tokens = || router.backends()[0]["in_flight_tokens"].as_u64().unwrap();

    let mut stream = router.post_json("/v1/completions", &body);
    assert_eq!(stream.status, 200);
    // Nothing cached anywhere yet: the whole prompt is queued prefill, plus the output.
    wait_until("the request's load to show", || in_flight_tokens() == 107);
    engine.release();
    assert!(stream.next_chunk().is_some());
    // The first token means the prompt is prefilled: only the decode work remains queued.
    wait_until("the prefill part to leave the load", || {
        in_flight_tokens() == 7
    });
    engine.release();
    let _ = stream.body();
    wait_until("the load to clear", || in_flight_tokens() == 0);
}

#[test]
fn prompts_in_flight_hold_a_shared_prefix_once_across_cores() {
    let engine = Engine::start("gated", Behavior::Gated { chunks: 1 });
    let router = Router::start(&["--backend", &engine.url()]);
    let pinned = || {
        router.backends()[0]["kv_pinned_prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    // Six siblings: a 160-token (10-block) prefix, then 40 tokens of their own (2 blocks and 8
    // tokens), each on its own connection (spread over both data cores).
    let siblings = 6u64;
    let mut streams: Vec<_> = (0..siblings as u32)
        .map(|sibling| {
            let mut prompt: Vec<u32> = (0..160).collect();
            prompt.extend((0..40).map(|offset| 10_000 + sibling * 100 + offset));
            let body =
                json!({"model": "test-model", "prompt": prompt, "max_tokens": 1, "stream": true});
            let stream = router.post_json("/v1/completions", &body);
            assert_eq!(stream.status, 200);
            stream
        })
        .collect();
    // Counted per core, the prefix would be held once per core (up to 2 x 160 + 6 x 40).
    let expected = 160 + siblings * 40;
    wait_until("every prompt to be pinned once", || pinned() == expected);
    for _ in 0..siblings {
        engine.release();
    }
    for stream in streams.drain(..) {
        let _ = stream.body();
    }
    wait_until("the pins to be released", || pinned() == 0);
}

#[test]
fn a_client_s_max_tokens_moves_load_and_the_admitted_clock_by_a_bounded_amount() {
    // Issue 25's poisoning request: a max_tokens of 2^62 would add 2^62 to the backend's load
    // and to the residency estimate's clock. It counts as at most 2^20 output tokens.
    let engine = Engine::start("gated", Behavior::Gated { chunks: 1 });
    let router = Router::start(&["--backend", &engine.url()]);
    let prompt: Vec<u32> = (1000..1100).collect();
    let body = json!({"model": "test-model", "prompt": prompt, "max_tokens": 4_611_686_018_427_387_904u64,
                      "stream": true});
    let stream = router.post_json("/v1/completions", &body);
    assert_eq!(stream.status, 200);
    let bound = 100 + (1 << 20);
    wait_until("the request's load to show", || {
        router.backends()[0]["in_flight_tokens"].as_u64() == Some(bound)
    });
    let admitted = router.backends()[0]["admitted_tokens"].as_u64().unwrap();
    assert!(admitted <= bound, "admitted {admitted}");
    engine.release();
    let _ = stream.body();
    wait_until("the load to clear", || {
        router.backends()[0]["in_flight_tokens"].as_u64() == Some(0)
    });
}

#[test]
fn with_the_models_context_known_an_impossible_request_is_refused_before_it_counts() {
    let engine = Engine::start("a", normal());
    let router = Router::start(&["--backend", &engine.url(), "--max-model-len", "4096"]);
    let huge = json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 4_611_686_018_427_387_904u64});
    let response = router.post_json("/v1/completions", &huge);
    assert_eq!(response.status, 400);
    let body = response.json();
    assert_eq!(body["error"]["param"], "max_tokens", "{body}");
    let long: Vec<u32> = (0..4096).collect();
    let response = router.post_json(
        "/v1/completions",
        &json!({"model": "test-model", "prompt": long, "max_tokens": 8}),
    );
    assert_eq!(response.status, 400);
    assert_eq!(response.json()["error"]["code"], "context_length_exceeded");
    // Neither reached the engine or moved anything.
    assert_eq!(engine.requests(), 0);
    let backend = &router.backends()[0];
    assert_eq!(backend["admitted_tokens"], 0, "{backend}");
    assert_eq!(backend["in_flight_tokens"], 0, "{backend}");
    // One that fits is served.
    let fits = json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 4000});
    assert_eq!(router.post_json("/v1/completions", &fits).status, 200);
}

/// Without `--max-model-len`, the context length comes from the engines' `GET /v1/models`
/// (vLLM reports `max_model_len`): the smallest of them applies, and a backend that reports a
/// broken figure (0) is left out.
#[test]
fn the_context_length_is_read_from_the_engines_when_not_configured() {
    let small = Engine::start("small", normal());
    let large = Engine::start("large", normal());
    let broken = Engine::start("broken", normal());
    small
        .record
        .max_model_len
        .store(2048, std::sync::atomic::Ordering::SeqCst);
    large
        .record
        .max_model_len
        .store(8192, std::sync::atomic::Ordering::SeqCst);
    let router = Router::start(&[
        "--backend",
        &small.url(),
        "--backend",
        &large.url(),
        "--backend",
        &broken.url(),
        "--engine-metrics-interval-ms",
        "50",
    ]);
    wait_until("the engines' context lengths", || {
        let lens: Vec<serde_json::Value> = router
            .backends()
            .iter()
            .map(|backend| backend["max_model_len_reported"].clone())
            .collect();
        lens == [json!(2048), json!(8192), serde_json::Value::Null]
    });
    // The smallest applies: a request past it is refused before it counts.
    let long: Vec<u32> = (0..2048).collect();
    let mut refused = None;
    wait_until("the data cores to apply it", || {
        let response = router.post_json(
            "/v1/completions",
            &json!({"model": "test-model", "prompt": long, "max_tokens": 8}),
        );
        let status = response.status;
        refused = Some(response.json());
        status == 400
    });
    assert_eq!(refused.unwrap()["error"]["code"], "context_length_exceeded");
    let fits = json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2000});
    assert_eq!(router.post_json("/v1/completions", &fits).status, 200);
    let too_many = json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 3000});
    assert_eq!(router.post_json("/v1/completions", &too_many).status, 400);
}

#[test]
fn streamed_first_tokens_teach_the_ttft_model_and_every_answer_carries_its_prediction() {
    let engine = Engine::start("normal", normal());
    let router = Router::start(&["--backend", &engine.url()]);
    let requests = 12u64;
    for request in 0..requests as u32 {
        let prompt: Vec<u32> = (0..96)
            .map(|token| 2_000 + request * 1000 + token)
            .collect();
        let body =
            json!({"model": "test-model", "prompt": prompt, "max_tokens": 4, "stream": true});
        let response = router.post_json("/v1/completions", &body);
        assert_eq!(response.status, 200);
        let predicted: u64 = response
            .header("x-myelin-predicted-ttft-us")
            .expect("the prediction header")
            .parse()
            .unwrap();
        assert!(predicted > 0);
        let _ = response.body();
    }
    // Non-streaming answers carry it too, and teach nothing.
    let response = router.post_json(
        "/v1/completions",
        &json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2}),
    );
    assert_eq!(response.status, 200);
    assert!(response.header("x-myelin-predicted-ttft-us").is_some());
    let observations = || -> u64 {
        router.backends()[0]["ttft_model"]
            .as_array()
            .unwrap()
            .iter()
            .map(|core| core["observations"].as_u64().unwrap())
            .sum()
    };
    wait_until("every streamed first token to be learned from", || {
        observations() == requests
    });
    let model = &router.backends()[0]["ttft_model"];
    for core in model.as_array().unwrap() {
        assert!(
            core["prefill_ms_per_1k_tokens"].as_f64().unwrap() > 0.0
                && core["prefill_ms_per_1m_pairs"].as_f64().unwrap() > 0.0,
            "{core}"
        );
        assert!(core["step_ms"].as_f64().unwrap() > 0.0, "{core}");
        assert_eq!(core["step_tokens"], 2048);
        assert!(core["error_mean_abs_ms"].as_f64().unwrap().is_finite());
    }
}

/// Labelled counters exist at 0 before anything counted them, so an alert on them sees a
/// series from the start: per backend (tokenization mismatches, health transitions) and for
/// every known reason (retries, skipped KV blocks).
#[test]
fn labelled_series_are_exported_at_zero_before_they_count() {
    let engine = Engine::start("a", normal());
    let router = Router::start(&["--backend", &engine.url()]);
    let metrics = router.metrics();
    for series in [
        "myelin_tokenization_mismatch_total{backend=\"0\"} 0".to_string(),
        "myelin_health_check_transitions_total{backend=\"0\",to=\"down\"} 0".to_string(),
        "myelin_retries_total{reason=\"connect\"} 0".to_string(),
        "myelin_retries_total{reason=\"header_timeout\"} 0".to_string(),
        "myelin_kv_events_skipped_blocks_total{reason=\"orphan\"} 0".to_string(),
    ] {
        assert!(
            metrics.lines().any(|line| line == series),
            "missing `{series}` in:\n{metrics}"
        );
    }
}

/// The `x-myelin-decision` header of one completion of `prompt` (token ids), sent with
/// `x-myelin-trace: 1`, and the backend that served it.
fn traced_completion(router: &Router, prompt: &[u32]) -> (Option<serde_json::Value>, String) {
    let body = json!({"model": myelin_sim::DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 1})
        .to_string();
    let answer = request(
        router.addr,
        "POST",
        "/v1/completions",
        &[
            ("content-type", "application/json"),
            ("x-myelin-trace", "1"),
        ],
        Some(body.as_bytes()),
    );
    assert_eq!(answer.status, 200);
    let trace = answer
        .header("x-myelin-decision")
        .map(|value| serde_json::from_str(value).expect("the trace is JSON"));
    (
        trace,
        answer.header("x-myelin-backend").unwrap().to_string(),
    )
}

#[test]
fn a_traced_request_gets_its_decisions_evidence_only_when_the_flag_allows() {
    let prompt: Vec<u32> = (500..820).collect();
    let router = Router::start(&["--sim", "2", "--sim-speedup", "20", "--decision-trace"]);
    let (first, _) = traced_completion(&router, &prompt);
    let first = first.expect("traced with --decision-trace");
    assert_eq!(first["policy"], "prefix");
    assert_eq!(first["cost_unit"], "seconds");
    assert_eq!(first["candidates"].as_array().unwrap().len(), 2);
    // The same prompt again: the engine that holds it is chosen, and the trace says why. Its
    // blocks count once the engine's KV events reached the mirror (asynchronous: asked again
    // until then).
    let mut again = (serde_json::Value::Null, 0);
    wait_until(
        "a repeat's trace shows the 20 blocks its engine holds",
        || {
            let (trace, backend) = traced_completion(&router, &prompt);
            again = (trace.unwrap(), backend.parse().unwrap());
            again.0["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .any(|candidate| {
                    candidate["backend"] == again.1 && candidate["matched_blocks"] == 20
                })
        },
    );
    let (again, backend) = again;
    assert_eq!(again["chosen"], backend);
    let candidates = again["candidates"].as_array().unwrap();
    let chosen = candidates
        .iter()
        .find(|candidate| candidate["backend"] == backend)
        .unwrap();
    assert!(
        chosen["expected_cached_tokens"].as_f64().unwrap() >= 304.0,
        "{again}"
    );
    // The chosen engine is the cheapest and matches the most. The other may hold the prompt
    // too (a repeat sent before the mirror caught up can land there); if it holds none, it
    // must cost strictly more.
    let chosen_cost = chosen["cost"].as_f64().unwrap();
    for candidate in candidates {
        assert!(
            candidate["cost"].as_f64().unwrap() >= chosen_cost,
            "{again}"
        );
        if candidate["matched_blocks"] == 0 {
            assert!(candidate["cost"].as_f64().unwrap() > chosen_cost, "{again}");
        }
    }
    // No header asked: no trace.
    let plain = router.post_json(
        "/v1/completions",
        &json!({"model": myelin_sim::DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 1}),
    );
    assert_eq!(plain.header("x-myelin-decision"), None);
    drop(router);

    // Without the flag the request header is ignored.
    let router = Router::start(&["--sim", "2", "--sim-speedup", "20"]);
    assert_eq!(traced_completion(&router, &prompt).0, None);
}

/// A word-level tokenizer.json (whitespace words; unknown words are `[UNK]`) and a chat
/// template that writes only the messages' contents, in a fresh directory.
fn word_tokenizer_files(name: &str) -> (std::path::PathBuf, String, String) {
    let dir = std::env::temp_dir().join(format!("myelin-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    std::fs::write(
        &tokenizer,
        json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "where": 1, "would": 2, "I": 3, "go": 4},
                      "unk_token": "[UNK]"}
        })
        .to_string(),
    )
    .unwrap();
    let template = dir.join("words.jinja");
    std::fs::write(
        &template,
        "{% for message in messages %}{{ message['content'] }} {% endfor %}",
    )
    .unwrap();
    let path = |path: std::path::PathBuf| path.to_str().unwrap().to_string();
    (dir, path(tokenizer), path(template))
}

#[test]
fn a_model_named_by_model_tokenizer_is_tokenized_with_its_own_files() {
    let (dir, tokenizer, template) = word_tokenizer_files("model-tokenizer");
    let model = myelin_sim::DEFAULT_MODEL_NAME;
    let own = format!("{model}={tokenizer}");
    let own_template = format!("{model}={template}");
    let explain = |router: &Router, path: &str, body: serde_json::Value| {
        let answer = router.admin("POST", path, Some(&body));
        assert_eq!(answer.status, 200);
        answer.json()["prompt_tokens"].as_u64().unwrap()
    };
    let chat = json!({"model": model, "messages": [
        {"role": "system", "content": "where would"},
        {"role": "user", "content": "I go qqqzx"}]});
    let completion = json!({"model": model, "prompt": "where would qqqzx zzqv", "max_tokens": 1});

    // The model's own tokenizer and template: a word per token, the template writes only the
    // contents.
    let router = Router::start(&[
        "--sim",
        "1",
        "--sim-speedup",
        "20",
        "--model-tokenizer",
        &own,
        "--model-chat-template",
        &own_template,
    ]);
    assert_eq!(
        explain(&router, "/admin/explain/v1/chat/completions", chat.clone()),
        5
    );
    assert_eq!(
        explain(&router, "/admin/explain/v1/completions", completion.clone()),
        4
    );
    // Requests for it are served (the engine tokenizes them its own way) and counted by model.
    assert_eq!(router.post_json("/v1/completions", &completion).status, 200);
    let label = format!("model=\"{model}\"");
    assert_eq!(
        metric_value(&router.metrics(), &["myelin_model_requests_total", &label]),
        1.0
    );
    assert_eq!(
        metric_value(
            &router.metrics(),
            &["myelin_model_ttft_seconds_count", &label]
        ),
        1.0
    );
    drop(router);

    // Without the flags the same bodies are tokenized by the router-wide tokenizer (byte
    // pairs: more tokens) in ChatML.
    let router = Router::start(&["--sim", "1", "--sim-speedup", "20"]);
    let plain_chat = explain(&router, "/admin/explain/v1/chat/completions", chat.clone());
    let plain_completion = explain(&router, "/admin/explain/v1/completions", completion.clone());
    assert!(
        plain_chat > 5 && plain_completion > 4,
        "{plain_chat} {plain_completion}"
    );
    drop(router);

    // Only a template of its own: the router-wide tokenizer renders its contents alone.
    let router = Router::start(&[
        "--sim",
        "1",
        "--sim-speedup",
        "20",
        "--model-chat-template",
        &own_template,
    ]);
    let templated = explain(&router, "/admin/explain/v1/chat/completions", chat.clone());
    assert!(templated < plain_chat, "{templated} {plain_chat}");
    assert_eq!(
        explain(&router, "/admin/explain/v1/completions", completion),
        plain_completion
    );
    drop(router);

    // A file that does not load stops the start, naming the model; so does a model named
    // twice.
    for (args, needle) in [
        (
            vec![format!(
                "--model-tokenizer={model}=/nonexistent/tokenizer.json"
            )],
            format!("model {model}"),
        ),
        (
            vec![
                format!("--model-tokenizer={own}"),
                format!("--model-tokenizer={own}"),
            ],
            format!("model {model} is named twice"),
        ),
        (
            vec!["--model-tokenizer=no-equals-sign".into()],
            "is not MODEL=PATH".into(),
        ),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
            .args(["serve", "--sim", "1", "--listen", "127.0.0.1:0"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!output.status.success());
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert!(stderr.contains(&needle), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_admin_api_explains_where_a_prompt_would_go_without_sending_it() {
    let prompt: Vec<u32> = (900..1_220).collect();
    let router = Router::start(&["--sim", "2", "--sim-speedup", "20"]);
    let body = json!({"model": myelin_sim::DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 1});
    let explain = |body: &serde_json::Value| {
        let answer = router.admin("POST", "/admin/explain/v1/completions", Some(body));
        let status = answer.status;
        (status, answer.json())
    };
    let lookups = |router: &Router| {
        (0..2)
            .map(|shard| {
                metric_value(
                    &router.metrics(),
                    &["myelin_router_lookups_total", &format!("shard=\"{shard}\"")],
                )
            })
            .sum::<f64>()
    };

    // Nothing sent yet: no engine holds the prompt, and explaining it routes nothing.
    let before = lookups(&router);
    let (status, first) = explain(&body);
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["prompt_tokens"], 320);
    assert_eq!(first["policy"], "prefix");
    let candidates = first["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 2, "{first}");
    assert!(
        candidates.iter().all(|c| c["matched_blocks"] == 0),
        "{first}"
    );
    assert!(first["chosen"].is_u64(), "{first}");
    assert_eq!(
        lookups(&router),
        before,
        "an explained prompt is not a lookup"
    );

    // Sent: the engine that took it is where the same prompt would go next, and why.
    let served = router.post_json("/v1/completions", &body);
    assert_eq!(served.status, 200);
    let backend: u64 = served.header("x-myelin-backend").unwrap().parse().unwrap();
    let mut last = json!(null);
    wait_until("the explained decision to follow the learned route", || {
        last = explain(&body).1;
        last["chosen"] == backend
            && last["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["backend"] == backend && c["matched_blocks"] == 20)
    });

    // A chat body on the chat path; the router's errors as on the client port.
    let chat = router.admin(
        "POST",
        "/admin/explain/v1/chat/completions",
        Some(&json!({"model": myelin_sim::DEFAULT_MODEL_NAME,
                     "messages": [{"role": "user", "content": "Where would I go?"}]})),
    );
    assert_eq!(chat.status, 200);
    assert!(chat.json()["prompt_tokens"].as_u64().unwrap() > 0);
    let (status, invalid) = explain(&json!({"model": myelin_sim::DEFAULT_MODEL_NAME}));
    assert_eq!(status, 400, "{invalid}");
    assert_eq!(invalid["error"]["param"], "prompt");
    wait_until("an unknown model refused", || {
        explain(&json!({"model": "nobody-serves-this", "prompt": "x"})).0 == 404
    });
    assert_eq!(
        router
            .admin("GET", "/admin/explain/v1/completions", None)
            .status,
        405
    );
    assert_eq!(
        router
            .admin("POST", "/admin/explain/v1/embeddings", Some(&body))
            .status,
        404
    );
}
