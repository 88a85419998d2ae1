//! Step-time models: how long one scheduler step (one forward pass over a batch) takes, given
//! the batch's shape. The default profile, `a100-40gb-llama-3.1-8b`, is calibrated to public
//! measurements (docs/simulator.md has the derivation and the TTFT table).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

/// One request's share of a step: `new_tokens` computed on top of `context_tokens` already in
/// its KV cache (a decode is 1 new token; a prefill chunk is many).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    /// Tokens computed for this request in the step.
    pub new_tokens: usize,
    /// Tokens of this request already computed (cached prefix or earlier chunks).
    pub context_tokens: usize,
}

/// What a performance model sees of a step.
#[derive(Clone, Copy, Debug)]
pub struct StepShape<'a> {
    /// The scheduled requests.
    pub chunks: &'a [ScheduledChunk],
    /// Fraction of KV blocks in use after scheduling (0..=1).
    pub kv_usage: f64,
}

impl StepShape<'_> {
    /// Tokens computed in the step.
    pub fn total_new_tokens(&self) -> usize {
        self.chunks.iter().map(|chunk| chunk.new_tokens).sum()
    }
}

/// A step-time model. Implementations must be pure functions of the shape.
pub trait PerformanceModel: Debug + Send + Sync {
    /// Profile name (`--profile`).
    fn name(&self) -> &str;
    /// Wall time of one forward pass over `shape` on the real hardware (before `--speedup`).
    fn step_time(&self, shape: &StepShape<'_>) -> Duration;
    /// What vLLM's OpenAI server schedules with on this profile's GPU and model when no flag
    /// says otherwise.
    fn scheduler_limits(&self) -> SchedulerLimits;
}

/// A profile's scheduler limits: vLLM's defaults for its GPU, and its model's context length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Token budget of one scheduler step (`max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Running sequences at most (`max_num_seqs`).
    pub max_num_seqs: usize,
    /// The model's context length (`max_model_len`).
    pub max_model_len: usize,
}

/// vLLM's OpenAI-server defaults on an A100 or any GPU under 70 GiB (`EngineArgs`'s
/// usage-context defaults: 2,048 batched tokens and 256 sequences; the offline `LLM` class
/// uses 8,192 tokens there).
pub const VLLM_SERVER_LIMITS_SMALL_GPU: (usize, usize) = (2048, 256);
/// vLLM's OpenAI-server defaults on GPUs of 70 GiB or more other than the A100 (H100, H200,
/// MI300X): 8,192 batched tokens and 1,024 sequences (the `LLM` class: 16,384 tokens).
pub const VLLM_SERVER_LIMITS_LARGE_GPU: (usize, usize) = (8192, 1024);
/// Llama-3.1's context length.
pub const LLAMA_3_1_CONTEXT: usize = 131_072;

/// Names of the built-in profiles.
pub const PROFILE_NAMES: [&str; 3] = [
    A100_LLAMA_8B_PROFILE,
    DYNAMO_MOCKER_H100_PROFILE,
    VLLM_CPU_TINY_LLAMA_PROFILE,
];

/// The default profile name.
pub const A100_LLAMA_8B_PROFILE: &str = "a100-40gb-llama-3.1-8b";

/// NVIDIA Dynamo mocker's published polynomial (H100-class).
pub const DYNAMO_MOCKER_H100_PROFILE: &str = "dynamo-mocker-h100";

/// vLLM's CPU build serving the test model of `scripts/test-vllm`, fitted to its measured
/// step times.
pub const VLLM_CPU_TINY_LLAMA_PROFILE: &str = "vllm-cpu-tiny-llama";

/// The built-in profile called `name`.
pub fn profile_by_name(name: &str) -> Option<Arc<dyn PerformanceModel>> {
    match name {
        A100_LLAMA_8B_PROFILE => Some(Arc::new(A100Llama8B)),
        DYNAMO_MOCKER_H100_PROFILE => Some(Arc::new(DynamoMockerH100)),
        VLLM_CPU_TINY_LLAMA_PROFILE => Some(Arc::new(VllmCpuTinyLlama)),
        _ => None,
    }
}

/// Llama-3.1-8B on one A100-40GB (bf16), from public measurements:
/// - non-attention cost per forward of T tokens interpolated between Vidur's A100 profile
///   points (1 -> 9.7 ms, 512 -> 34.6, 2048 -> 145.6, 8192 -> 545), extrapolated linearly;
/// - causal attention, compute-bound for prefill: `ATTENTION_MS_PER_TOKEN_PAIR` per
///   (query, key) pair, so a fresh 2k prompt adds ~4.3% and an 8k one ~18% (published: ~5%,
///   ~20%);
/// - KV reads, memory-bound for decode: 128 KiB per context token at ~1.2 TB/s effective;
/// - fixed CPU work per step (scheduling, sampling, detokenisation) and per sequence, sized so
///   that one decode stream at 1k context takes 13.3 ms and 8 streams ~6.6x the throughput.
#[derive(Clone, Copy, Debug, Default)]
pub struct A100Llama8B;

/// Vidur's A100 non-attention forward times for Llama-3-8B: (tokens, milliseconds).
const VIDUR_A100_POINTS_MS: [(f64, f64); 4] =
    [(1.0, 9.7), (512.0, 34.6), (2048.0, 145.6), (8192.0, 545.0)];
/// Fitted to "+5% at 2k, +20% at 8k": 2048*1024 pairs -> 6.3 ms, 8192*4096 pairs -> 101 ms.
const ATTENTION_MS_PER_TOKEN_PAIR: f64 = 3.0e-6;
/// 128 KiB of K and V per token read at ~1.2 TB/s: 131072 B / 1.2e12 B/s = 1.09e-4 ms.
const KV_READ_MS_PER_TOKEN: f64 = 1.09e-4;
/// Scheduler, sampling and output processing per step.
const STEP_OVERHEAD_MS: f64 = 3.3;
/// Per-sequence bookkeeping per step (sampling, detokenisation).
const PER_SEQUENCE_MS: f64 = 0.2;

impl A100Llama8B {
    fn non_attention_ms(tokens: f64) -> f64 {
        let points = &VIDUR_A100_POINTS_MS;
        if tokens <= points[0].0 {
            return points[0].1;
        }
        for pair in points.windows(2) {
            let ((t0, ms0), (t1, ms1)) = (pair[0], pair[1]);
            if tokens <= t1 {
                return ms0 + (tokens - t0) * (ms1 - ms0) / (t1 - t0);
            }
        }
        let ((t0, ms0), (t1, ms1)) = (points[2], points[3]);
        ms1 + (tokens - t1) * (ms1 - ms0) / (t1 - t0)
    }
}

impl PerformanceModel for A100Llama8B {
    fn name(&self) -> &str {
        A100_LLAMA_8B_PROFILE
    }

    fn scheduler_limits(&self) -> SchedulerLimits {
        let (max_num_batched_tokens, max_num_seqs) = VLLM_SERVER_LIMITS_SMALL_GPU;
        SchedulerLimits {
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len: LLAMA_3_1_CONTEXT,
        }
    }

    fn step_time(&self, shape: &StepShape<'_>) -> Duration {
        if shape.chunks.is_empty() {
            return Duration::ZERO;
        }
        let total_tokens = shape.total_new_tokens() as f64;
        let mut attention_ms = 0.0;
        for chunk in shape.chunks {
            let new = chunk.new_tokens as f64;
            let context = chunk.context_tokens as f64;
            // Each new token attends to the context and to the new tokens before it.
            let compute = ATTENTION_MS_PER_TOKEN_PAIR * new * (context + new / 2.0);
            let memory = KV_READ_MS_PER_TOKEN * (context + new);
            attention_ms += compute.max(memory);
        }
        let milliseconds = Self::non_attention_ms(total_tokens)
            + attention_ms
            + STEP_OVERHEAD_MS
            + PER_SEQUENCE_MS * shape.chunks.len() as f64;
        Duration::from_secs_f64(milliseconds / 1000.0)
    }
}

/// NVIDIA Dynamo mocker's H100-class polynomial: prefill over the step's uncached tokens plus
/// a decode term driven by the fraction of KV capacity in use (added when both happen).
#[derive(Clone, Copy, Debug, Default)]
pub struct DynamoMockerH100;

impl PerformanceModel for DynamoMockerH100 {
    fn name(&self) -> &str {
        DYNAMO_MOCKER_H100_PROFILE
    }

    fn scheduler_limits(&self) -> SchedulerLimits {
        let (max_num_batched_tokens, max_num_seqs) = VLLM_SERVER_LIMITS_LARGE_GPU;
        SchedulerLimits {
            max_num_batched_tokens,
            max_num_seqs,
            // The mocker models no particular model; the simulated engines serve Llama-3.1.
            max_model_len: LLAMA_3_1_CONTEXT,
        }
    }

    fn step_time(&self, shape: &StepShape<'_>) -> Duration {
        let prefill_tokens: usize = shape
            .chunks
            .iter()
            .filter(|chunk| chunk.new_tokens > 1)
            .map(|chunk| chunk.new_tokens)
            .sum();
        let decodes = shape.chunks.iter().any(|chunk| chunk.new_tokens == 1);
        let mut milliseconds = 0.0;
        if prefill_tokens > 0 {
            let t = prefill_tokens as f64;
            milliseconds += 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142;
        }
        if decodes {
            let u = shape.kv_usage.clamp(0.0, 1.0);
            milliseconds += (-25.74 * u * u + 54.01 * u + 5.74).max(1.0);
        }
        Duration::from_secs_f64(milliseconds / 1000.0)
    }
}

/// vLLM 0.32's CPU build (one OpenMP thread, float32) serving the random-weight two-layer
/// Llama of `scripts/test-vllm`, two engines on the 2-vCPU test machine as `scripts/bench-vllm`
/// starts them: a least-squares fit of 16 step times measured from the client by
/// `scripts/vllm/steps.py`, on both engines at once (fresh prefills of 16 to 3,072 tokens, 1 to
/// 8 streams decoding at 150 and 790 tokens of context; docs/simulator.md has the points and
/// the fit's error): `19.07 ms + 0.0471 ms per token + 4.71e-5 ms per (query, key) pair +
/// 17.0 ms per prefill chunk`. Decode steps of 1 to 8 streams took 16-23 ms with no trend in
/// the batch size, so there is no term per sequence.
#[derive(Clone, Copy, Debug, Default)]
pub struct VllmCpuTinyLlama;

/// Fixed cost of one step of the CPU engine (a decode step is about this).
const CPU_STEP_OVERHEAD_MS: f64 = 19.07;
/// Cost per token computed in a step.
const CPU_MS_PER_TOKEN: f64 = 0.04708;
/// Cost per (query, key) pair of causal attention.
const CPU_MS_PER_TOKEN_PAIR: f64 = 4.707e-5;
/// Cost per prefill chunk (a request computing more than one token in the step).
const CPU_MS_PER_PREFILL_CHUNK: f64 = 17.03;
/// vLLM's OpenAI-server defaults on CPU (`EngineArgs`: 2,048 batched tokens, 128 sequences).
const VLLM_SERVER_LIMITS_CPU: (usize, usize) = (2048, 128);
/// `--max-model-len` of the test engines.
const TEST_MODEL_CONTEXT: usize = 4096;

impl PerformanceModel for VllmCpuTinyLlama {
    fn name(&self) -> &str {
        VLLM_CPU_TINY_LLAMA_PROFILE
    }

    fn scheduler_limits(&self) -> SchedulerLimits {
        let (max_num_batched_tokens, max_num_seqs) = VLLM_SERVER_LIMITS_CPU;
        SchedulerLimits {
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len: TEST_MODEL_CONTEXT,
        }
    }

    fn step_time(&self, shape: &StepShape<'_>) -> Duration {
        if shape.chunks.is_empty() {
            return Duration::ZERO;
        }
        let mut milliseconds = CPU_STEP_OVERHEAD_MS;
        for chunk in shape.chunks {
            let new = chunk.new_tokens as f64;
            let context = chunk.context_tokens as f64;
            milliseconds +=
                CPU_MS_PER_TOKEN * new + CPU_MS_PER_TOKEN_PAIR * new * (context + new / 2.0);
            if chunk.new_tokens > 1 {
                milliseconds += CPU_MS_PER_PREFILL_CHUNK;
            }
        }
        Duration::from_secs_f64(milliseconds / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(model: &dyn PerformanceModel, chunks: &[ScheduledChunk]) -> f64 {
        model
            .step_time(&StepShape {
                chunks,
                kv_usage: 0.1,
            })
            .as_secs_f64()
            * 1000.0
    }

    fn fresh(tokens: usize) -> ScheduledChunk {
        ScheduledChunk {
            new_tokens: tokens,
            context_tokens: 0,
        }
    }

    #[test]
    fn interpolation_hits_the_vidur_points() {
        for (tokens, expected) in VIDUR_A100_POINTS_MS {
            assert!((A100Llama8B::non_attention_ms(tokens) - expected).abs() < 1e-9);
        }
        assert!(A100Llama8B::non_attention_ms(16384.0) > 545.0);
    }

    #[test]
    fn prefill_throughput_is_in_the_published_band() {
        for tokens in [2048usize, 4096, 8192] {
            let per_token = ms(&A100Llama8B, &[fresh(tokens)]) / tokens as f64;
            assert!(
                (0.07..=0.08).contains(&per_token),
                "{tokens}: {per_token} ms/token"
            );
        }
        // Attention share: ~5% at 2k, ~20% at 8k.
        let attention_2k = ATTENTION_MS_PER_TOKEN_PAIR * 2048.0 * 1024.0 / 145.6;
        let attention_8k = ATTENTION_MS_PER_TOKEN_PAIR * 8192.0 * 4096.0 / 545.0;
        assert!((0.035..0.06).contains(&attention_2k));
        assert!((0.15..0.22).contains(&attention_8k));
    }

    #[test]
    fn decode_matches_single_stream_and_batching_gain() {
        let one = ms(
            &A100Llama8B,
            &[ScheduledChunk {
                new_tokens: 1,
                context_tokens: 1000,
            }],
        );
        assert!((13.0..13.6).contains(&one), "single stream {one} ms");
        let eight = ms(
            &A100Llama8B,
            &[ScheduledChunk {
                new_tokens: 1,
                context_tokens: 1000,
            }; 8],
        );
        let gain = 8.0 * one / eight;
        assert!((6.0..7.2).contains(&gain), "8-stream gain {gain}");
        // Decode slows down as the batch's KV grows.
        let long = ms(
            &A100Llama8B,
            &[ScheduledChunk {
                new_tokens: 1,
                context_tokens: 8000,
            }; 8],
        );
        assert!(long > eight);
    }

    #[test]
    fn cached_context_is_cheaper_than_recompute() {
        let recompute = ms(&A100Llama8B, &[fresh(4096)]);
        let cached = ms(
            &A100Llama8B,
            &[ScheduledChunk {
                new_tokens: 16,
                context_tokens: 4080,
            }],
        );
        assert!(cached * 10.0 < recompute);
    }

    #[test]
    fn the_cpu_profile_reproduces_its_measured_points() {
        // Medians measured by scripts/vllm/steps.py on two engines at once (2026-12-04,
        // docs/measurements/2026-12-04-vllm-cpu-steps.json): fresh prefills, and steps of 1 and
        // 8 decodes at 148 tokens of context.
        for (tokens, measured_ms) in [(512usize, 71.4), (1024, 127.6), (1536, 180.7)] {
            let modelled = ms(&VllmCpuTinyLlama, &[fresh(tokens)]);
            assert!(
                (modelled / measured_ms - 1.0).abs() < 0.16,
                "{tokens}: {modelled} ms against {measured_ms}"
            );
        }
        let decode = ScheduledChunk {
            new_tokens: 1,
            context_tokens: 148,
        };
        let one = ms(&VllmCpuTinyLlama, &[decode]);
        let eight = ms(&VllmCpuTinyLlama, &[decode; 8]);
        assert!((16.0..24.0).contains(&one) && (16.0..24.0).contains(&eight));
        // A 3,072-token prompt is two steps (the 2,048-token budget): the second attends to
        // the first's 2,048 tokens.
        let second = ms(
            &VllmCpuTinyLlama,
            &[ScheduledChunk {
                new_tokens: 1024,
                context_tokens: 2048,
            }],
        );
        let both = ms(&VllmCpuTinyLlama, &[fresh(2048)]) + second;
        assert!((both / 449.1 - 1.0).abs() < 0.1, "{both}");
        assert_eq!(
            VllmCpuTinyLlama.scheduler_limits().max_num_batched_tokens,
            2048
        );
    }

    #[test]
    fn profiles_resolve_by_name() {
        for name in PROFILE_NAMES {
            let profile = profile_by_name(name).expect("built-in profile");
            assert_eq!(profile.name(), name);
        }
        assert!(profile_by_name("h200").is_none());
        // vLLM's OpenAI-server defaults: A100 2,048 tokens / 256 sequences, H100 8,192 / 1,024.
        let a100 = A100Llama8B.scheduler_limits();
        assert_eq!(
            (a100.max_num_batched_tokens, a100.max_num_seqs),
            (2048, 256)
        );
        let h100 = DynamoMockerH100.scheduler_limits();
        assert_eq!(
            (h100.max_num_batched_tokens, h100.max_num_seqs),
            (8192, 1024)
        );
        let dynamo = ms(&DynamoMockerH100, &[fresh(1000)]);
        assert!((dynamo - (4.209989e-7 * 1e6 + 15.18344 + 16.50142)).abs() < 1e-6);
    }
}
