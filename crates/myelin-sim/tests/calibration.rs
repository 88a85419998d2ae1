//! Calibration of the default profile against public A100-40GB / Llama-3.1-8B figures, through
//! the whole sans-IO engine (scheduler, chunked prefill, step overheads), not just the formula.
//! Prints the table shown in docs/simulator.md:
//!   cargo test -p myelin-sim --test calibration -- --nocapture

use std::time::Duration;

use myelin_sim::engine::{EngineConfig, EngineModel, OutputVocabulary, RequestSpec};
use myelin_sim::perf::{A100_LLAMA_8B_PROFILE, profile_by_name};

fn engine() -> EngineModel {
    let profile = profile_by_name(A100_LLAMA_8B_PROFILE).expect("default profile");
    EngineModel::new(
        EngineConfig {
            num_gpu_blocks: 20_000,
            ..EngineConfig::default()
        },
        profile,
        OutputVocabulary::default(),
    )
}

/// Time to first token of one prompt of `prompt_tokens` fresh tokens on an idle engine.
fn ttft(prompt_tokens: u32) -> Duration {
    let mut engine = engine();
    engine
        .add_request(
            1,
            RequestSpec {
                prompt_token_ids: (0..prompt_tokens).collect(),
                max_tokens: Some(2),
                ignore_eos: true,
            },
        )
        .expect("accepted");
    let mut elapsed = Duration::ZERO;
    loop {
        let step = engine.schedule().expect("work to do");
        elapsed += step.step_time;
        if !engine.complete_step(&step).is_empty() {
            return elapsed;
        }
    }
}

/// Mean inter-token latency of `streams` concurrent decodes, each with about `context` tokens.
fn inter_token_latency(streams: u32, context: u32) -> Duration {
    let mut engine = engine();
    for stream in 0..streams {
        let base = stream * 1_000_000;
        engine
            .add_request(
                u64::from(stream),
                RequestSpec {
                    prompt_token_ids: (base..base + context).collect(),
                    max_tokens: Some(40),
                    ignore_eos: true,
                },
            )
            .expect("accepted");
    }
    // Prefill everything first, then time 20 pure decode steps.
    while engine.load().pending_prefill_tokens > 0 {
        let step = engine.schedule().expect("work");
        engine.complete_step(&step);
    }
    let mut total = Duration::ZERO;
    for _ in 0..20 {
        let step = engine.schedule().expect("work");
        assert_eq!(step.requests.len(), streams as usize);
        total += step.step_time;
        engine.complete_step(&step);
    }
    total / 20
}

#[test]
fn ttft_matches_public_prefill_throughput() {
    println!("| prompt tokens | simulated TTFT (ms) | ms / token | public band (ms) |");
    println!("|---:|---:|---:|---:|");
    for prompt_tokens in [128u32, 512, 1024, 2048, 4096, 8192, 16384, 32768] {
        let simulated = ttft(prompt_tokens).as_secs_f64() * 1000.0;
        // 12k to 14k tokens/s batched prefill, never below the ~10 ms weight-read floor.
        let low = (f64::from(prompt_tokens) / 14.0).max(10.0);
        let high = (f64::from(prompt_tokens) / 12.0).max(10.0);
        println!(
            "| {prompt_tokens} | {simulated:.1} | {:.4} | {low:.0} to {high:.0} |",
            simulated / f64::from(prompt_tokens)
        );
        if (1024..=8192).contains(&prompt_tokens) {
            assert!(
                simulated >= low * 0.95 && simulated <= high * 1.05,
                "{prompt_tokens} tokens: {simulated:.1} ms outside {low:.0}..{high:.0}"
            );
        }
        assert!(simulated >= 10.0, "the forward floor");
    }
}

#[test]
fn decode_matches_single_stream_and_batching_gain() {
    println!(
        "| concurrent streams | context tokens | inter-token latency (ms) | throughput vs 1 stream |"
    );
    println!("|---:|---:|---:|---:|");
    let single = inter_token_latency(1, 1000).as_secs_f64() * 1000.0;
    for (streams, context) in [
        (1u32, 1000u32),
        (8, 1000),
        (32, 1000),
        (8, 4000),
        (64, 2000),
    ] {
        let itl = inter_token_latency(streams, context).as_secs_f64() * 1000.0;
        println!(
            "| {streams} | {context} | {itl:.2} | {:.2}x |",
            f64::from(streams) * single / itl
        );
    }
    assert!(
        (13.0..13.6).contains(&single),
        "single stream {single:.2} ms (public: 13.3)"
    );
    let eight = inter_token_latency(8, 1000).as_secs_f64() * 1000.0;
    let gain = 8.0 * single / eight;
    assert!(
        (6.0..7.2).contains(&gain),
        "8 streams give {gain:.2}x (public: about 6.6x)"
    );
}
