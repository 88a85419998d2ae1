//! The harness's view of external engines from their KV-event streams (`KvWatch`), against
//! simulated engines whose true state the test can read: after traffic that evicts, what the
//! watch says each engine holds for each prompt equals the simulator's own probe, and the
//! evictions it counted equal the engines' own counters. Real HTTP and real ZMQ sockets.

use std::time::{Duration, Instant};

use myelin_bench::blocking_http::{post_empty, post_json};
use myelin_bench::kv_watch::KvWatch;
use myelin_bench::oracle::CacheOracle;
use myelin_sim::{ClusterConfig, EngineConfig, KvEventsConfig, SimCluster};

const BLOCK: usize = 16;

fn complete(engine: &str, prompt: &[u32]) {
    let body = serde_json::json!({
        "model": "sim", "prompt": prompt, "max_tokens": 4, "temperature": 0,
    });
    let answer = post_json(
        &format!("{engine}/v1/completions"),
        &body.to_string(),
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A prompt of `blocks` full blocks after a shared head of `shared` blocks, then 5 tokens.
fn prompt(family: u32, shared: usize, member: u32, blocks: usize) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..shared * BLOCK)
        .map(|i| 1000 + family * 7919 + i as u32)
        .collect();
    tokens.extend(
        (0..(blocks * BLOCK + 5) as u32).map(|i| 50_000 + family * 4099 + member * 331 + i),
    );
    tokens
}

#[test]
fn the_watch_sees_what_the_engines_hold_and_evict() {
    let cluster = SimCluster::start(ClusterConfig {
        engines: 2,
        speedup: 50.0,
        engine: EngineConfig {
            // 48 blocks of 16 tokens: the traffic below needs several times that.
            num_gpu_blocks: 48,
            block_size: BLOCK,
            ..EngineConfig::default()
        },
        kv_events: Some(KvEventsConfig::default()),
        ..ClusterConfig::default()
    })
    .expect("simulated engines");
    let urls = cluster.engine_urls();
    let endpoints: Vec<String> = cluster
        .kv_event_endpoints()
        .iter()
        .map(|endpoints| endpoints.as_ref().expect("KV events on").publish.clone())
        .collect();
    let watch = KvWatch::start(&endpoints, BLOCK as u32).unwrap();

    // A SUB socket misses what is published before it has joined: send fresh prompts until
    // the watch sees one on each engine, then empty the caches as the harness does.
    for (engine, url) in urls.iter().enumerate() {
        let mut probe = 0;
        wait_for("the subscription", || {
            probe += 1;
            let tokens = prompt(900 + engine as u32, 0, probe, 1);
            complete(url, &tokens);
            std::thread::sleep(Duration::from_millis(20));
            watch.probe(&tokens)[engine].cached_tokens > 0
        });
        let reset = post_empty(
            &format!("{url}/reset_prefix_cache"),
            Duration::from_secs(10),
        );
        assert_eq!(reset.unwrap().status, 200);
        watch.cleared(engine);
    }
    let evicted_before: u64 = cluster.counters().iter().map(|c| c.evictions).sum();
    let counted_before = watch.evictions();

    // Four families of prompts sharing a head, several members each, over both engines.
    let mut prompts = Vec::new();
    for round in 0..3u32 {
        for family in 0..4u32 {
            for member in 0..3u32 {
                let tokens = prompt(family, 4, member + 10 * round, 3);
                complete(&urls[((family + member) % 2) as usize], &tokens);
                prompts.push(tokens);
            }
        }
    }
    let evicted: u64 = cluster.counters().iter().map(|c| c.evictions).sum::<u64>() - evicted_before;
    assert!(evicted > 0, "the traffic must evict");
    wait_for("the watch to count every eviction", || {
        watch.evictions() - counted_before == evicted
    });
    // Every prompt, on every engine: the same leading blocks as the simulator's own truth.
    let truth = |tokens: &[u32]| -> Vec<u64> {
        cluster
            .probe(tokens)
            .iter()
            .map(|probe| probe.cached_prefix_tokens as u64)
            .collect()
    };
    let seen = |tokens: &[u32]| -> Vec<u64> {
        watch
            .probe(tokens)
            .iter()
            .map(|engine| engine.cached_tokens)
            .collect()
    };
    wait_for("the mirror to settle", || {
        prompts.iter().all(|tokens| seen(tokens) == truth(tokens))
    });
    let held: u64 = prompts.iter().flat_map(|tokens| truth(tokens)).sum();
    assert!(held > 0, "some prompts are still held");
}
