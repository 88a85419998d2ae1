//! Prometheus text for one engine's `/metrics`, with vLLM's metric names and labels. Rendered
//! from the engine's own state (not a process-global recorder: one process hosts many engines).

use std::fmt::Write;

use crate::engine::{EngineCounters, EngineLoad};

/// What the metrics page shows.
#[derive(Clone, Debug)]
pub struct MetricsSnapshot<'a> {
    /// Served model name (`model_name` label).
    pub model_name: &'a str,
    /// Engine index (`engine` label).
    pub engine: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the KV cache.
    pub num_gpu_blocks: usize,
    /// Counters.
    pub counters: EngineCounters,
    /// Gauges.
    pub load: EngineLoad,
}

/// Renders the exposition text.
pub fn render(snapshot: &MetricsSnapshot<'_>) -> String {
    let labels = format!(
        "engine=\"{}\",model_name=\"{}\"",
        snapshot.engine,
        escape_label(snapshot.model_name)
    );
    let mut out = String::with_capacity(4096);
    let counters = &snapshot.counters;
    let load = &snapshot.load;
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        load.running as f64,
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        load.waiting as f64,
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        load.kv_usage,
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        counters.prefix_cache_queries as f64,
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        counters.prefix_cache_hits as f64,
    );
    metric(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        counters.preemptions as f64,
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        counters.prompt_tokens as f64,
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        counters.generation_tokens as f64,
    );
    metric(
        "myelin_sim_kv_cache_evictions_total",
        "counter",
        "Cached KV blocks evicted (each published a BlockRemoved event).",
        counters.evictions as f64,
    );
    metric(
        "myelin_sim_requests_aborted_total",
        "counter",
        "Requests aborted because the client went away.",
        counters.requests_aborted as f64,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests."
    );
    let _ = writeln!(out, "# TYPE vllm:request_success_total counter");
    for (reason, count) in [
        ("stop", counters.finished_stop),
        ("length", counters.finished_length),
    ] {
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {:?}",
            count as f64
        );
    }
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig"
    );
    let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
         engine=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256_cbor\"}} 1.0",
        snapshot.block_size, snapshot.engine, snapshot.num_gpu_blocks
    );
    out
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_engine_labels() {
        let text = render(&MetricsSnapshot {
            model_name: "m\"x",
            engine: 3,
            block_size: 16,
            num_gpu_blocks: 1500,
            counters: EngineCounters {
                prefix_cache_queries: 100,
                prefix_cache_hits: 48,
                preemptions: 2,
                ..EngineCounters::default()
            },
            load: EngineLoad {
                running: 4,
                waiting: 1,
                kv_usage: 0.25,
                ..EngineLoad::default()
            },
        });
        assert!(text.contains("vllm:num_requests_running{engine=\"3\",model_name=\"m\\\"x\"} 4.0"));
        assert!(text.contains("vllm:kv_cache_usage_perc{engine=\"3\",model_name=\"m\\\"x\"} 0.25"));
        assert!(
            text.contains("vllm:prefix_cache_hits_total{engine=\"3\",model_name=\"m\\\"x\"} 48.0")
        );
        assert!(
            text.contains("vllm:num_preemptions_total{engine=\"3\",model_name=\"m\\\"x\"} 2.0")
        );
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"1500\""));
    }
}
