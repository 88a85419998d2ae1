//! Fixtures of the `myelin bench` end-to-end tests: a scratch directory per test and a small
//! churn workload (shared with myelin-bench's own end-to-end tests), and a run of the real
//! binary on it that returns report.json. Included by path (`#[path]`), apart from the
//! `support` module the `myelin serve` tests use.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[path = "../../../myelin-bench/tests/support/small_churn.rs"]
mod small_churn;

// Not every test including this file uses both (the overhead test runs no churn).
#[allow(unused_imports)]
pub use small_churn::{scratch_dir, small_churn};

pub const MYELIN: &str = env!("CARGO_BIN_EXE_myelin");

/// Runs `myelin bench --workload <workload> --no-progress --out <directory>/out <args>` and
/// returns the output directory and its report.json. Exit 0 (valid), 1 (a gate failed) or 3
/// (machine too busy to judge routing) all mean the run completed.
pub fn run_bench(directory: &Path, workload: &str, args: &[&str]) -> (PathBuf, Value) {
    let workload_path = directory.join("workload.toml");
    std::fs::write(&workload_path, workload).unwrap();
    let out = directory.join("out");
    let status = Command::new(MYELIN)
        .args(["bench", "--workload"])
        .arg(&workload_path)
        .args(["--no-progress", "--out"])
        .arg(&out)
        .args(args)
        .status()
        .unwrap();
    assert!(
        matches!(status.code(), Some(0 | 1 | 3)),
        "myelin bench failed to run: {status}"
    );
    let report =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    (out, report)
}
