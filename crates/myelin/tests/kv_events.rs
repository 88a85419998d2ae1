//! The verified residency mirror end to end: simulated vLLM engines publish their KV events on
//! real ZMQ sockets in vLLM's byte format, `myelin serve` subscribes (and replays what the
//! engines buffered before it started), and the admin API reports what the mirror holds.

mod support;

use std::time::{Duration, Instant};

use myelin_sim::{ClusterConfig, KvEventsConfig, SimCluster, WireVersion};
use serde_json::{Value, json};
use support::{Router, metric_value, request};

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
    let urls = cluster.engine_urls();
    let mut args = Vec::new();
    for (url, endpoints) in urls.iter().zip(cluster.kv_event_endpoints()) {
        let endpoints = endpoints.as_ref().expect("events enabled");
        args.push("--backend".to_string());
        args.push(format!(
            "{url},kv-events={},kv-replay={}",
            endpoints.publish, endpoints.replay
        ));
    }
    args
}

fn chat(words: usize, seed: usize) -> Value {
    let text: Vec<String> = (0..words)
        .map(|i| format!("w{}x{}", seed, i % 97))
        .collect();
    json!({
        "model": "sim",
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
        let engine_url = &cluster.engine_urls()[0];
        let addr = engine_url.trim_start_matches("http://").parse().unwrap();
        let answer = request(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            Some(chat(300, 1).to_string().as_bytes()),
        );
        assert_eq!(answer.status, 200);

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
