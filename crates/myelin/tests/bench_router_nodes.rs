//! `myelin bench --router-nodes 2` end to end with the real binary: a small churn on two
//! simulated engines through two `myelin serve` nodes, with gossip (a peer cluster: its own key
//! file in the output directory, one log per node) and without. Asserts report.json's node
//! count and gossip flag, the downgrade counter summed over the nodes' /metrics, that every
//! request was served with its backend recorded, and one log per node. No timing assertions.

#[path = "support/bench.rs"]
mod bench;

use std::path::{Path, PathBuf};

use serde_json::Value;

fn run_bench(directory: &Path, extra: &[&str]) -> (PathBuf, Value) {
    let mut args = vec![
        "--legs",
        "prefix+auto",
        "--router-nodes",
        "2",
        "--calibration",
        "off",
    ];
    args.extend_from_slice(extra);
    bench::run_bench(directory, &bench::small_churn(30.0, 256), &args)
}

fn check_served_by_both_nodes(out: &Path, report: &Value) {
    assert_eq!(report["router_nodes"], 2, "{report:#}");
    let leg = &report["legs"][0];
    assert_eq!(leg["name"], "prefix+auto");
    assert_eq!(leg["errors"], 0, "{leg:#}");
    assert!(leg["requests"].as_u64().unwrap() > 0, "{leg:#}");
    // Counters summed over the nodes' /metrics: present (a number), not missing.
    assert!(leg["downgrades"].is_u64(), "{leg:#}");
    // Every request names the engine that served it (x-myelin-backend through either node).
    let csv = std::fs::read_to_string(out.join("requests.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let backend = header.iter().position(|name| *name == "backend").unwrap();
    let status = header.iter().position(|name| *name == "status").unwrap();
    let mut served = 0;
    for line in lines {
        let fields: Vec<&str> = line.split(',').collect();
        if fields[status] == "ok" {
            assert!(!fields[backend].is_empty(), "{line}");
            served += 1;
        }
    }
    assert!(served > 0);
    // One log per node.
    for node in ["node0", "node1"] {
        let log = out.join("logs").join(format!("prefix_auto-1-{node}.log"));
        assert!(log.exists(), "{} missing", log.display());
    }
}

#[test]
fn two_nodes_with_gossip_share_the_users_and_a_cluster_key() {
    let directory = bench::scratch_dir("bench-nodes-gossip");
    let (out, report) = run_bench(&directory, &[]);
    check_served_by_both_nodes(&out, &report);
    assert_eq!(report["gossip"], true, "{report:#}");
    let key = std::fs::read_to_string(out.join("cluster.key")).unwrap();
    assert_eq!(key.trim().len(), 64);
    let _ = std::fs::remove_dir_all(directory);
}

#[test]
fn two_nodes_without_gossip_run_independently() {
    let directory = bench::scratch_dir("bench-nodes-alone");
    let (out, report) = run_bench(&directory, &["--no-gossip"]);
    check_served_by_both_nodes(&out, &report);
    assert_eq!(report["gossip"], false, "{report:#}");
    assert!(!out.join("cluster.key").exists());
    let _ = std::fs::remove_dir_all(directory);
}
