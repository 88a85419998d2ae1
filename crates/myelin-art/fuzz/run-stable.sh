#!/usr/bin/env bash
# Builds and runs the prefix-tree fuzz target with libFuzzer on *stable* Rust (coverage
# instrumentation only, no sanitizer: the crate has no unsafe code). With nightly, prefer
# `cargo +nightly fuzz run tree_ops`. Usage: run-stable.sh [seconds] (default 60).
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:-60}
target=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks" \
    cargo build --release --target "$target" --bin tree_ops
mkdir -p corpus/tree_ops artifacts/tree_ops
exec "target/$target/release/tree_ops" corpus/tree_ops -artifact_prefix=artifacts/tree_ops/ \
    -max_total_time="$seconds" -max_len=2048
