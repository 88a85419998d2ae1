//! `myelin bench --engine SPEC` end to end with the real binary: the engines are ones the user
//! started (here two simulated vLLM engines in this process, with KV events on real ZMQ
//! sockets), not the bench's own. Asserts that every leg ran on them (their request counters
//! moved), that the report names them and their measured figures (hit rate from their
//! /metrics, evictions and the calibration's truth from their KV-event streams), and that what cannot run on external engines (the oracle
//! leg, an engine that is down) is refused with a clear error. No timing assertions.

#[path = "support/bench.rs"]
mod bench;
mod support;

use std::process::Command;

use myelin_sim::{ClusterConfig, EngineConfig, KvEventsConfig, SimCluster};

/// Speedup of the engines and of the bench alike (`--speedup`), as with `myelin sim`.
const SPEEDUP: f64 = 20.0;

fn engines() -> SimCluster {
    SimCluster::start(ClusterConfig {
        engines: 2,
        speedup: SPEEDUP,
        engine: EngineConfig {
            // 2 x 128 blocks of 16 tokens: less than the 12 prefixes of 400-900 tokens, so
            // the engines evict.
            num_gpu_blocks: 128,
            ..EngineConfig::default()
        },
        kv_events: Some(KvEventsConfig::default()),
        ..ClusterConfig::default()
    })
    .expect("simulated engines")
}

/// One `--engine` value per engine, with its KV-event endpoints.
fn engine_args(cluster: &SimCluster) -> Vec<String> {
    support::engine_flags(cluster, "--engine")
}

fn requests_received(cluster: &SimCluster) -> u64 {
    cluster
        .probe(&[])
        .iter()
        .map(|probe| probe.requests_received)
        .sum()
}

#[test]
fn every_leg_runs_on_the_engines_given() {
    let cluster = engines();
    let directory = bench::scratch_dir("bench-external");
    let speedup = SPEEDUP.to_string();
    let mut args = vec![
        "--legs".to_string(),
        "least-load,prefix+auto".to_string(),
        "--speedup".to_string(),
        speedup,
    ];
    args.extend(engine_args(&cluster));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The workload's own cluster (two engines of 64 blocks) is replaced by the engines given:
    // the block count comes from their /metrics.
    let (_out, report) = bench::run_bench(&directory, &bench::small_churn(20.0, 64), &args);

    assert_eq!(
        report["external_engines"],
        serde_json::json!(cluster.engine_urls()),
        "{report:#}"
    );
    assert_eq!(report["time_unit"], "simulated", "{report:#}");
    assert_eq!(
        report["workload"]["cluster"]["kv_blocks"], 128,
        "{report:#}"
    );
    let legs = report["legs"].as_array().unwrap();
    let names: Vec<&str> = legs
        .iter()
        .map(|leg| leg["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["least-load", "prefix+auto"], "{report:#}");
    let mut served = 0;
    let mut evicted = 0;
    for leg in legs {
        assert_eq!(leg["errors"], 0, "{leg:#}");
        let requests = leg["requests"].as_u64().unwrap();
        assert!(requests > 0, "{leg:#}");
        served += requests;
        // Read from the engines' vLLM counters.
        let hit_rate = leg["cache_hit_rate"].as_f64().expect("a hit rate");
        assert!((0.0..=1.0).contains(&hit_rate), "{leg:#}");
        // vLLM exports no eviction counter: counted from the engines' KV-event streams.
        evicted += leg["evictions"].as_u64().expect("evictions measured");
    }
    // Every request measured reached these engines (warm-up requests come on top).
    assert!(requests_received(&cluster) >= served);
    // The legs' windows evicted some of what the engines evicted in all (warm-up included),
    // never more: each removal counted once.
    let engine_total: u64 = cluster
        .counters()
        .iter()
        .map(|counters| counters.evictions)
        .sum();
    assert!(
        evicted > 0 && evicted <= engine_total,
        "{evicted} of {engine_total}"
    );
    // The residency calibration ran on the engines' own KV events as its truth.
    let calibration = report["calibration"].as_array().expect("calibration[]");
    assert_eq!(calibration.len(), 1, "{calibration:#?}");
    assert_eq!(calibration[0]["leg"], "prefix+auto");
    assert!(
        calibration[0]["sampled_pairs"].as_u64().unwrap() > 0,
        "{calibration:#?}"
    );
    // And the regime line's resident-prefix probe.
    assert!(
        report["regime"]["prefix_resident_share"].is_number(),
        "{:#}",
        report["regime"]
    );
    let text = std::fs::read_to_string(directory.join("out/report.md")).unwrap();
    assert!(text.contains("2 external engines"), "{text}");
    let _ = std::fs::remove_dir_all(directory);
}

#[test]
fn what_cannot_run_on_external_engines_is_refused() {
    let cluster = engines();
    let directory = bench::scratch_dir("bench-external-refused");
    let workload = directory.join("workload.toml");
    std::fs::write(&workload, bench::small_churn(10.0, 64)).unwrap();
    let bench = |extra: &[String]| {
        let output = Command::new(bench::MYELIN)
            .args(["bench", "--no-progress", "--workload"])
            .arg(&workload)
            .arg("--out")
            .arg(directory.join("out"))
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("myelin: error:"), "{stderr}");
        assert!(
            !directory.join("out/report.json").exists(),
            "no run: {stderr}"
        );
        stderr
    };

    let mut oracle = vec!["--legs".to_string(), "oracle,least-load".to_string()];
    oracle.extend(engine_args(&cluster));
    let error = bench(&oracle);
    assert!(error.contains("oracle"), "{error}");
    assert!(error.contains("external engines"), "{error}");

    // An engine that does not answer: named, before any leg starts.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let mut args = engine_args(&cluster)[..2].to_vec();
    args.extend(["--engine".to_string(), down.clone()]);
    let error = bench(&args);
    assert!(error.contains(&down), "{error}");
    assert_eq!(requests_received(&cluster), 0, "no leg ran");
    let _ = std::fs::remove_dir_all(directory);
}
