//! Fixtures shared by the `myelin bench` end-to-end tests of this crate and of the `myelin`
//! crate (which includes this file by path): a scratch directory per test and a small churn
//! workload (two simulated engines, a few users, prefixes of 400-900 tokens).

#![allow(dead_code)]

use std::path::PathBuf;

/// An empty directory under the system's temp dir, unique to `test` and this process.
pub fn scratch_dir(test: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("myelin-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    directory
}

/// A churn of `duration_s` simulated seconds on two engines of `kv_blocks` blocks of 16 tokens:
/// 6 users, 12 prefixes of 400-900 tokens with 4 active, 2 rotated every 5 s, speedup 20.
pub fn small_churn(duration_s: f64, kv_blocks: u32) -> String {
    churn_workload("small-churn", "churn", 6, duration_s, kv_blocks, "")
}

/// The same churn, open loop (`churn-open`), with one user and arrivals at half of a stated
/// capacity of 4 requests per simulated second (no capacity measurement).
pub fn small_churn_open(duration_s: f64, kv_blocks: u32) -> String {
    churn_workload(
        "small-churn-open",
        "churn-open",
        1,
        duration_s,
        kv_blocks,
        "[open_loop]\nrate_fraction = 0.5\ncapacity_rps = 4.0\n",
    )
}

/// The small churn workload file: `extra` holds sections of its own.
fn churn_workload(
    name: &str,
    kind: &str,
    users: u32,
    duration_s: f64,
    kv_blocks: u32,
    extra: &str,
) -> String {
    format!(
        r#"
name = "{name}"
kind = "{kind}"
api = "completions"
prompt = "token-ids"
seed = 7
users = {users}
duration_s = {duration_s:.1}
warmup_s = 5.0
output_tokens = 20

[cluster]
engines = 2
profile = "a100-40gb-llama-3.1-8b"
speedup = 20.0
kv_blocks = {kv_blocks}
block_size = 16

[churn]
population = 12
active = 4
rotate = 2
rotate_every_s = 5.0
prefix_tokens = [400, 900]
suffix_tokens = [8, 32]

{extra}
[quick]
"#
    )
}
