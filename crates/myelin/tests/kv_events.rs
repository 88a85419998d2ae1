//! The verified residency mirror end to end: simulated vLLM engines publish their KV events on
//! real ZMQ sockets in vLLM's byte format, `myelin serve` subscribes (and replays what the
//! engines buffered before it started), and the admin API reports what the mirror holds.

mod support;

use std::time::{Duration, Instant};

use myelin_sim::{ClusterConfig, KvEventsConfig, SimCluster, WireVersion};
use serde_json::{Value, json};
use support::{Router, metric_value, request};

/// The model the simulated engines serve.
const SIM_MODEL: &str = myelin_sim::DEFAULT_MODEL_NAME;

fn cluster(wire: WireVersion) -> SimCluster {
    SimCluster::start(ClusterConfig {
        engines: 2,
        speedup: 50.0,
        kv_events: Some(KvEventsConfig {
            wire,
            ..KvEventsConfig::default()
        }),
        ..ClusterConfig::default()
    })
    .expect("simulated engines")
}

fn backend_args(cluster: &SimCluster) -> Vec<String> {
    support::engine_flags(cluster, "--backend")
}

fn chat(words: usize, seed: usize) -> Value {
    let text: Vec<String> = (0..words)
        .map(|i| format!("w{}x{}", seed, i % 97))
        .collect();
    json!({
        "model": myelin_sim::DEFAULT_MODEL_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text.join(" ")}],
    })
}

/// Polls the admin listing until `done` holds for it, or panics after 10 s.
fn wait_for(router: &Router, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let backends = router.backends();
        if done(&backends) {
            return backends;
        }
        assert!(Instant::now() < deadline, "{what}: {backends:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn resident(backend: &Value) -> u64 {
    backend["resident_blocks"].as_u64().unwrap_or(0)
}

#[test]
fn the_mirror_follows_engine_events_and_replays_history() {
    for wire in [WireVersion::V0_22, WireVersion::V0_33] {
        let cluster = cluster(wire);
        // Cached before the router exists: only the replay socket can tell it.
        chat_engine(&cluster, 300, 1);

        let args = backend_args(&cluster);
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend(["--residency", "auto"]);
        let router = Router::start(&all);
        let backends = wait_for(&router, "replayed history", |backends| {
            backends[0]["residency"] == "verified" && resident(&backends[0]) > 0
        });
        assert_eq!(backends[0]["resident_blocks_source"], "kv-events");
        assert_eq!(backends[0]["routed_blocks"], 0, "nothing was routed yet");
        let replayed = resident(&backends[0]);
        // 300 words are several hundred tokens: tens of 16-token blocks.
        assert!(replayed >= 10, "{wire}: {replayed}");

        // Live events: requests through the router add blocks on the engines that serve them.
        for seed in 2..8 {
            let response = router.post_json("/v1/chat/completions", &chat(200, seed));
            assert_eq!(response.status, 200);
        }
        let before: u64 = backends.iter().map(resident).sum();
        wait_for(&router, "live events", |backends| {
            backends.iter().map(resident).sum::<u64>() > before
                && backends
                    .iter()
                    .all(|backend| backend["residency"] == "verified")
        });
        let metrics = router.metrics();
        assert!(metric_value(&metrics, &["myelin_kv_events_batches_total"]) > 0.0);
        assert_eq!(
            metric_value(&metrics, &["myelin_kv_events_decode_errors_total"]),
            0.0
        );

        // The engine drops its prefix cache: AllBlocksCleared empties its mirror.
        assert!(cluster.reset_prefix_cache(0));
        wait_for(&router, "cleared", |backends| resident(&backends[0]) == 0);
        drop(router);
        cluster.shutdown();
    }
}

/// The `kv_events_mirror` of the first backend in the admin listing.
fn mirror(backends: &[Value]) -> &Value {
    &backends[0]["kv_events_mirror"]
}

fn reason(backends: &[Value]) -> String {
    mirror(backends)["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Sends one chat of `words` words straight to engine 0 of `cluster` (not through the router),
/// so that it publishes new blocks.
fn chat_engine(cluster: &SimCluster, words: usize, seed: usize) {
    let addr = cluster.engine_urls()[0]
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let answer = request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(chat(words, seed).to_string().as_bytes()),
    );
    assert_eq!(answer.status, 200);
}

#[test]
fn an_engine_of_another_block_size_is_not_mirrored_and_says_why() {
    let cluster = cluster(WireVersion::V0_33);
    let args = backend_args(&cluster);
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    // The simulated engines' blocks are 16 tokens.
    all.extend(["--residency", "auto", "--block-size", "32"]);
    let router = Router::start(&all);
    chat_engine(&cluster, 200, 1);
    let backends = wait_for(&router, "the block size refused", |backends| {
        mirror(backends)["live"] == false && reason(backends).contains("16 tokens")
    });
    assert!(
        reason(&backends).contains("--block-size is 32"),
        "{backends:?}"
    );
    assert_eq!(resident(&backends[0]), 0);
    // `auto` routes that engine on the estimate.
    assert_eq!(backends[0]["residency"], "estimate");
    let metrics = router.metrics();
    assert_eq!(
        metric_value(
            &metrics,
            &[
                "myelin_kv_events_block_size_mismatch",
                &format!("backend=\"{}\"", backends[0]["id"])
            ]
        ),
        16.0
    );
    assert!(
        metric_value(
            &metrics,
            &[
                "myelin_kv_events_skipped_blocks_total",
                "reason=\"block_size\""
            ]
        ) > 0.0
    );
    drop(router);
    cluster.shutdown();
}

/// The backend's HTTP side is a scriptable engine whose health the test sets, its KV events
/// are a simulated engine's stream: when the backend goes down its mirror leaves routing,
/// and the stream's next batch decides how it comes back.
#[test]
fn a_backend_that_goes_down_takes_its_mirror_out_of_routing_until_its_stream_speaks() {
    let cluster = cluster(WireVersion::V0_33);
    let events = cluster.kv_event_endpoints()[0].clone().expect("events");
    let engine = support::engine::Engine::start(
        "http-side",
        support::engine::Behavior::Normal {
            chunks: 2,
            interval: Duration::from_millis(1),
        },
    );
    let backend = format!(
        "{},kv-events={},kv-replay={}",
        engine.url(),
        events.publish,
        events.replay
    );
    let router = Router::start(&[
        "--backend",
        &backend,
        "--residency",
        "auto",
        "--health-interval-ms",
        "20",
        "--unhealthy-threshold",
        "2",
        "--healthy-threshold",
        "2",
    ]);
    chat_engine(&cluster, 200, 1);
    let live = wait_for(&router, "the mirror live", |backends| {
        mirror(backends)["live"] == true && resident(&backends[0]) > 0
    });
    let held = resident(&live[0]);

    engine.set_healthy(false);
    wait_for(&router, "the mirror out of routing", |backends| {
        backends[0]["state"] == "down"
            && mirror(backends)["live"] == false
            && reason(backends).contains("went down")
    });
    engine.set_healthy(true);
    wait_for(&router, "the backend up again", |backends| {
        backends[0]["state"] == "up" && backends[0]["residency"] == "estimate"
    });
    // The same engine process goes on (its sequence continues): the mirror is live again,
    // with the blocks it held and the new ones.
    chat_engine(&cluster, 200, 2);
    let back = wait_for(&router, "the mirror live again", |backends| {
        mirror(backends)["live"] == true && resident(&backends[0]) > held
    });
    assert_eq!(back[0]["residency"], "verified");

    // Down again, and this time the engine restarts (its sequence starts again): the mirror
    // is cleared before it is live.
    engine.set_healthy(false);
    wait_for(&router, "down again", |backends| {
        mirror(backends)["live"] == false
    });
    engine.set_healthy(true);
    assert!(cluster.restart_kv_publisher(0));
    chat_engine(&cluster, 200, 3);
    wait_for(&router, "restarted and live", |backends| {
        mirror(backends)["live"] == true
    });
    let metrics = router.metrics();
    assert!(metric_value(&metrics, &["myelin_kv_events_restarts_total"]) >= 1.0);
    drop(router);
    cluster.shutdown();
}

/// Warm start: the router subscribes to an engine that cached blocks in more batches than its
/// replay buffer still holds. The mirror is partial (live; its blocks count, the estimate
/// decides for the rest) and says why, until the engine has stored more blocks than its
/// capacity since (here the spec's `capacity-tokens`), when it is exact.
#[test]
fn a_router_started_against_a_warm_engine_has_a_partial_mirror_until_the_cache_turns_over() {
    let cluster = SimCluster::start(ClusterConfig {
        engines: 1,
        speedup: 50.0,
        kv_events: Some(KvEventsConfig {
            buffer_steps: 2,
            ..KvEventsConfig::default()
        }),
        ..ClusterConfig::default()
    })
    .expect("simulated engines");
    // Several requests, each at least one batch: more than the replay buffer's two.
    for seed in 1..6 {
        chat_engine(&cluster, 100, seed);
    }
    let events = cluster.kv_event_endpoints()[0].clone().expect("events");
    // 40 blocks of 16 tokens.
    let backend = format!(
        "{},kv-events={},kv-replay={},capacity-tokens=640",
        cluster.engine_urls()[0],
        events.publish,
        events.replay
    );
    let router = Router::start(&["--backend", &backend, "--residency", "auto"]);
    let partial = wait_for(&router, "a partial mirror", |backends| {
        backends[0]["residency"] == "partial"
    });
    assert_eq!(mirror(&partial)["live"], true);
    assert_eq!(mirror(&partial)["partial"], true);
    assert!(reason(&partial).contains("not 0"), "{partial:?}");
    assert_eq!(partial[0]["resident_blocks_source"], "kv-events");
    assert_eq!(
        metric_value(&router.metrics(), &["myelin_kv_events_partial"]),
        1.0
    );
    // Requests through the router: the engine stores more than 40 blocks (each chat of 300
    // words is tens of blocks), so whatever it held before has been evicted or used again.
    for seed in 10..14 {
        let response = router.post_json("/v1/chat/completions", &chat(300, seed));
        assert_eq!(response.status, 200);
    }
    let exact = wait_for(&router, "the mirror exact", |backends| {
        backends[0]["residency"] == "verified"
    });
    assert_eq!(mirror(&exact)["partial"], false);
    assert_eq!(
        metric_value(&router.metrics(), &["myelin_kv_events_partial"]),
        0.0
    );
    drop(router);
    cluster.shutdown();
}

/// The engine restarts before any of its batches came live to the router (everything it had
/// was replayed at the router's start): its new stream's numbers are ones the replay already
/// gave, with other bytes. That is a restart (the mirror is cleared and follows the new
/// stream), not batches to skip as already applied.
#[test]
fn an_engine_restarted_before_any_batch_came_live_is_seen_as_a_restart() {
    let cluster = cluster(WireVersion::V0_33);
    // Batches 0.. are published before the router exists; it gets them from the replay socket.
    for seed in 1..4 {
        chat_engine(&cluster, 200, seed);
    }
    let args = backend_args(&cluster);
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(["--residency", "auto"]);
    let router = Router::start(&all);
    let replayed = wait_for(&router, "the replayed mirror", |backends| {
        backends[0]["residency"] == "verified" && resident(&backends[0]) > 0
    });
    let before = resident(&replayed[0]);
    assert!(cluster.restart_kv_publisher(0));
    // One small request: the new process's first batches, numbered from 0 again.
    chat_engine(&cluster, 20, 9);
    wait_for(
        &router,
        "the restart seen and the mirror rebuilt",
        |backends| {
            let restarts = metric_value(&router.metrics(), &["myelin_kv_events_restarts_total"]);
            restarts >= 1.0 && resident(&backends[0]) > 0 && resident(&backends[0]) < before
        },
    );
    drop(router);
    cluster.shutdown();
}

/// History-matched prompt tokens the router has counted so far.
fn history_matched(router: &Router) -> f64 {
    metric_value(
        &router.metrics(),
        &["myelin_router_history_matched_tokens_total"],
    )
}

#[test]
fn lora_adapters_and_cache_salts_are_cache_namespaces_of_their_own() {
    let cluster = SimCluster::start(ClusterConfig {
        engines: 2,
        speedup: 50.0,
        kv_events: Some(KvEventsConfig::default()),
        lora_adapters: vec!["sql".to_string()],
        ..ClusterConfig::default()
    })
    .expect("simulated engines");
    let args = backend_args(&cluster);
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(["--residency", "auto"]);
    let router = Router::start(&all);
    wait_for(&router, "the adapter listed", |backends| {
        backends
            .iter()
            .all(|backend| backend["lora_adapters"] == json!(["sql"]))
    });

    // One prompt of 20 blocks, sent as token ids in four namespaces.
    let prompt: Vec<u32> = (1_000..1_320).collect();
    let send = |model: &str, salt: Option<&str>| -> (f64, u64) {
        let mut body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let before = history_matched(&router);
        let answer = router.post_json("/v1/completions", &body);
        assert_eq!(answer.status, 200);
        let usage = answer.json()["usage"].clone();
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        (history_matched(&router) - before, cached)
    };
    let resident_total = |router: &Router| -> u64 { router.backends().iter().map(resident).sum() };

    assert_eq!(
        send(SIM_MODEL, None),
        (0.0, 0),
        "a first request matches nothing"
    );
    wait_for(&router, "the base model's blocks mirrored", |backends| {
        backends.iter().map(resident).sum::<u64>() >= 20
    });
    // The same tokens to the adapter, with a salt, with both: nothing of the base model's
    // (or each other's) history matches, and the engine has nothing cached for them either.
    for (model, salt) in [
        ("sql", None),
        (SIM_MODEL, Some("tenant-1")),
        ("sql", Some("tenant-1")),
    ] {
        assert_eq!(send(model, salt), (0.0, 0), "{model} {salt:?}");
    }
    // Their blocks are mirrored in their own namespaces, not skipped.
    wait_for(&router, "every namespace's blocks mirrored", |backends| {
        backends.iter().map(resident).sum::<u64>() >= 80
    });
    assert_eq!(
        metric_value(
            &router.metrics(),
            &["myelin_kv_events_skipped_blocks_total", "reason=\"lora\""]
        ),
        0.0
    );
    // Each namespace again: its own history matches, and the engine it went to hits.
    for (model, salt) in [
        (SIM_MODEL, None),
        ("sql", None),
        (SIM_MODEL, Some("tenant-1")),
        ("sql", Some("tenant-1")),
    ] {
        let (matched, cached) = send(model, salt);
        assert!(
            matched >= 304.0,
            "{model} {salt:?}: {matched} history-matched tokens"
        );
        assert_eq!(cached, 304, "{model} {salt:?}: the engine's cached tokens");
    }
    assert!(resident_total(&router) >= 80);
    drop(router);
    cluster.shutdown();
}

#[test]
fn requests_go_only_to_the_engines_that_list_their_model() {
    // Two engines serve model "a" (one also the adapter "a-lora"), one serves model "b".
    let start = |model: &str, engines: usize, adapters: &[&str]| {
        SimCluster::start(ClusterConfig {
            engines,
            speedup: 50.0,
            model_name: model.to_string(),
            lora_adapters: adapters.iter().map(|name| name.to_string()).collect(),
            ..ClusterConfig::default()
        })
        .expect("simulated engines")
    };
    let a = start("a", 2, &["a-lora"]);
    let b = start("b", 1, &[]);
    let urls: Vec<String> = a.engine_urls().into_iter().chain(b.engine_urls()).collect();
    let mut args: Vec<&str> = Vec::new();
    for url in &urls {
        args.extend(["--backend", url.as_str()]);
    }
    let router = Router::start(&args);
    wait_for(&router, "every engine's models known", |backends| {
        backends.len() == 3
            && backends
                .iter()
                .all(|backend| backend["max_model_len_reported"].is_u64())
            && backends[0]["lora_adapters"] == json!(["a-lora"])
    });
    let served_by = |model: &str| -> std::collections::BTreeSet<String> {
        (0..12)
            .map(|seed| {
                let body = json!({"model": model, "prompt": format!("prompt {seed} for {model}"),
                    "max_tokens": 1});
                let answer = router.post_json("/v1/completions", &body);
                assert_eq!(answer.status, 200, "{model}");
                answer.header("x-myelin-backend").unwrap().to_string()
            })
            .collect()
    };
    // Backends are numbered in flag order: 0 and 1 serve "a", 2 serves "b".
    assert_eq!(served_by("a"), ["0", "1"].map(String::from).into());
    assert_eq!(served_by("a-lora"), ["0", "1"].map(String::from).into());
    assert_eq!(served_by("b"), ["2"].map(String::from).into());
    // A name no engine lists: the router's 404 in OpenAI's shape, no engine asked (once
    // every data core has every engine's list).
    let unknown = json!({"model": "unlisted", "prompt": "who serves me", "max_tokens": 1});
    let mut answer = json!(null);
    support::wait_until("the unknown model refused by the router", || {
        let response = router.post_json("/v1/completions", &unknown);
        let status = response.status;
        answer = response.json();
        status == 404
    });
    assert_eq!(answer["error"]["code"], "model_not_found", "{answer}");
    assert_eq!(answer["error"]["param"], "model");
    assert_eq!(answer["error"]["type"], "invalid_request_error");
    drop(router);
    a.shutdown();
    b.shutdown();
}
