#!/usr/bin/env bash
# Builds and runs one gossip decoder fuzz target with libFuzzer on *stable* Rust (coverage
# instrumentation only, no sanitizer: the crate has no unsafe code). With nightly, prefer
# `cargo +nightly fuzz run decode_packet`.
# Usage: run-stable.sh [decode_packet] [seconds]   (defaults: decode_packet, 60)
set -euo pipefail
cd "$(dirname "$0")"
name=${1:-decode_packet}
seconds=${2:-60}
target=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks" \
    cargo build --release --target "$target" --bin "$name"
mkdir -p "corpus/$name" "artifacts/$name"
exec "target/$target/release/$name" "corpus/$name" -artifact_prefix="artifacts/$name/" \
    -max_total_time="$seconds" -max_len=4096
