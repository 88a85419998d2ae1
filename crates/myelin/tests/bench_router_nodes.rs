//! `myelin bench --router-nodes 2` end to end with the real binary: a small churn on two
//! simulated engines through two `myelin serve` nodes, with gossip (a peer cluster: its own key
//! file in the output directory, one log per node) and without. Asserts report.json's node
//! count and gossip flag, the downgrade counter summed over the nodes' /metrics, that every
//! request was served with its backend recorded, and one log per node. No timing assertions.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const MYELIN: &str = env!("CARGO_BIN_EXE_myelin");

const SMALL_CHURN: &str = r#"
name = "small-churn"
kind = "churn"
api = "completions"
prompt = "token-ids"
seed = 7
users = 6
duration_s = 30.0
warmup_s = 5.0
output_tokens = 20

[cluster]
engines = 2
profile = "a100-40gb-llama-3.1-8b"
speedup = 20.0
kv_blocks = 256
block_size = 16

[churn]
population = 12
active = 4
rotate = 2
rotate_every_s = 5.0
prefix_tokens = [400, 900]
suffix_tokens = [8, 32]

[quick]
"#;

fn scratch_dir(name: &str) -> PathBuf {
    let directory =
        std::env::temp_dir().join(format!("myelin-bench-nodes-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    directory
}

fn run_bench(directory: &Path, extra: &[&str]) -> (PathBuf, Value) {
    let workload = directory.join("small-churn.toml");
    std::fs::write(&workload, SMALL_CHURN).unwrap();
    let out = directory.join("out");
    let status = Command::new(MYELIN)
        .args(["bench", "--workload"])
        .arg(&workload)
        .args([
            "--legs",
            "prefix+auto",
            "--router-nodes",
            "2",
            "--calibration",
            "off",
            "--no-progress",
            "--out",
        ])
        .arg(&out)
        .args(extra)
        .status()
        .unwrap();
    // 0 (valid), 1 (a gate failed) or 3 (machine too busy): the run completed.
    assert!(
        matches!(status.code(), Some(0 | 1 | 3)),
        "myelin bench failed to run: {status}"
    );
    let report =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    (out, report)
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
    let directory = scratch_dir("gossip");
    let (out, report) = run_bench(&directory, &[]);
    check_served_by_both_nodes(&out, &report);
    assert_eq!(report["gossip"], true, "{report:#}");
    let key = std::fs::read_to_string(out.join("cluster.key")).unwrap();
    assert_eq!(key.trim().len(), 64);
    let _ = std::fs::remove_dir_all(directory);
}

#[test]
fn two_nodes_without_gossip_run_independently() {
    let directory = scratch_dir("alone");
    let (out, report) = run_bench(&directory, &["--no-gossip"]);
    check_served_by_both_nodes(&out, &report);
    assert_eq!(report["gossip"], false, "{report:#}");
    assert!(!out.join("cluster.key").exists());
    let _ = std::fs::remove_dir_all(directory);
}
