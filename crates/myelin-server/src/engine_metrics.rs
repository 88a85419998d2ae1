//! The engines' KV-cache figures from their Prometheus endpoint (`GET {url}/metrics`), scraped
//! by the control core for the residency estimate (capacity in tokens and utilization) and for
//! the expected wait for KV memory (utilization, running and waiting requests).
//!
//! - vLLM: `vllm:cache_config_info` (an info gauge whose labels carry `num_gpu_blocks` and
//!   `block_size`: capacity = their product), `vllm:kv_cache_usage_perc` (or the older
//!   `vllm:gpu_cache_usage_perc`), a fraction 0..1, `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, and `vllm:generation_tokens_total` (progress).
//! - SGLang: `sglang:max_total_num_tokens` (capacity), `sglang:token_usage` (fraction),
//!   `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:generation_tokens_total`.
//!
//! Engines without these (TensorRT-LLM, Ollama, LM Studio) give nothing: the configured
//! `capacity-tokens=` applies, else the estimate learns one from reuse reports.

use std::sync::Arc;
use std::time::Duration;

use hyper::{Method, Request};
use myelin_http::client::Pool;

/// A scrape that has not answered within this is abandoned.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest metrics page read (vLLM's is ~50-200 KiB with histograms); a larger one is dropped.
pub const MAX_METRICS_BODY_BYTES: usize = 4 * 1024 * 1024;

/// What an engine's metrics say about its KV cache.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCache {
    /// KV-cache capacity in tokens.
    pub capacity_tokens: Option<u64>,
    /// Fraction of the cache in use, 0..1.
    pub utilization: Option<f64>,
    /// Requests running (summed over series).
    pub running: Option<f64>,
    /// Requests waiting for admission (summed over series).
    pub waiting: Option<f64>,
    /// Tokens generated since the engine started (summed over series): the progress
    /// watchdog's evidence that an engine answering nothing is still working.
    pub generation_tokens: Option<f64>,
}

impl EngineCache {
    /// The expected-wait inputs, when the page had all three.
    pub fn memory(&self) -> Option<ScrapedMemory> {
        Some(ScrapedMemory {
            utilization: self.utilization?,
            running: self.running? as u32,
            waiting: self.waiting? as u32,
        })
    }
}

/// An engine's KV utilization and scheduler queue at one scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScrapedMemory {
    pub utilization: f64,
    pub running: u32,
    pub waiting: u32,
}

/// Parses Prometheus exposition text. Several series of a metric (engines, data-parallel
/// ranks) add up for capacity; utilization is their mean.
pub fn parse(text: &str) -> EngineCache {
    let mut capacity: Option<u64> = None;
    let mut usage_sum = 0.0;
    let mut usage_count = 0u32;
    let mut running: Option<f64> = None;
    let mut waiting: Option<f64> = None;
    let mut generation_tokens: Option<f64> = None;
    let add = |total: &mut Option<f64>, value: Option<f64>| {
        if let Some(value) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            *total = Some(total.unwrap_or(0.0) + value);
        }
    };
    let mut add_capacity = |tokens: u64| {
        capacity = Some(capacity.unwrap_or(0).saturating_add(tokens));
    };
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, value) = split_sample(line);
        match name {
            "vllm:cache_config_info" => {
                let blocks = label(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok());
                let size = label(labels, "block_size").and_then(|v| v.parse::<u64>().ok());
                if let (Some(blocks), Some(size)) = (blocks, size) {
                    add_capacity(blocks.saturating_mul(size));
                }
            }
            "sglang:max_total_num_tokens" => {
                if let Some(tokens) = value.filter(|v| v.is_finite() && *v > 0.0) {
                    add_capacity(tokens as u64);
                }
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                if let Some(fraction) = value.filter(|v| v.is_finite()) {
                    usage_sum += fraction.clamp(0.0, 1.0);
                    usage_count += 1;
                }
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => add(&mut running, value),
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => add(&mut waiting, value),
            "vllm:generation_tokens_total" | "sglang:generation_tokens_total" => {
                add(&mut generation_tokens, value)
            }
            _ => {}
        }
    }
    EngineCache {
        capacity_tokens: capacity.filter(|&tokens| tokens > 0),
        utilization: (usage_count > 0).then(|| usage_sum / f64::from(usage_count)),
        running,
        waiting,
        generation_tokens,
    }
}

/// `name{labels} value [timestamp]` → (name, labels without braces, value).
fn split_sample(line: &str) -> (&str, &str, Option<f64>) {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => match line[open..].find('}') {
            Some(close) => (
                &line[..open],
                &line[open + 1..open + close],
                &line[open + close + 1..],
            ),
            None => return (&line[..open], "", None),
        },
        None => match line.split_once(char::is_whitespace) {
            Some((name, rest)) => (name, "", rest),
            None => return (line, "", None),
        },
    };
    let value = rest
        .split_whitespace()
        .next()
        .and_then(|v| v.parse::<f64>().ok());
    (name.trim(), labels, value)
}

/// The value of `key` in a label set (`a="1",b="2"`); label values here never hold quotes.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (name, value) = pair.split_once('=')?;
        (name.trim() == key).then(|| value.trim().trim_matches('"'))
    })
}

/// Largest `GET /v1/models` page read for the context length.
const MAX_MODELS_BODY_BYTES: usize = 1024 * 1024;
/// A context length an engine may report, at most (no served model comes near 2^24 tokens): a
/// larger figure is taken as broken and ignored.
pub const MAX_CONTEXT_TOKENS: u64 = 1 << 24;

/// Models (LoRA adapters included) kept per engine, at most (the rest of a longer list is
/// ignored).
pub const MAX_ADAPTERS: usize = 1_024;
/// Longest model or adapter name kept, bytes (a longer one is ignored).
pub const MAX_ADAPTER_NAME_BYTES: usize = 256;

/// What an engine's `GET /v1/models` says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServedModels {
    /// The context length it serves: the largest `max_model_len` of the models it lists
    /// (vLLM and the simulator report it; other engines give `None`).
    pub max_model_len: Option<u64>,
    /// The LoRA adapters it serves: the models listed with a `parent` (vLLM lists each loaded
    /// adapter under its name, with the base model as parent). A request naming one is keyed
    /// by the adapter as well as its tokens (docs/routing.md, "Cache namespaces").
    pub adapters: Arc<[String]>,
    /// Every model it lists (adapters included): a request naming one of them goes only to
    /// the engines that list it (docs/routing.md, "Which engines serve a model").
    pub models: Arc<[String]>,
}

/// Parses a `GET /v1/models` page; `None` if it is not one (no `data` list).
pub fn parse_models(body: &[u8]) -> Option<ServedModels> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let models = value.get("data")?.as_array()?;
    let max_model_len = models
        .iter()
        .filter_map(|model| model.get("max_model_len")?.as_u64())
        .filter(|&tokens| tokens > 0 && tokens <= MAX_CONTEXT_TOKENS)
        .max();
    let names = |adapters_only: bool| -> Arc<[String]> {
        models
            .iter()
            .filter(|model| {
                !adapters_only || model.get("parent").is_some_and(|parent| parent.is_string())
            })
            .filter_map(|model| model.get("id")?.as_str())
            .filter(|name| !name.is_empty() && name.len() <= MAX_ADAPTER_NAME_BYTES)
            .take(MAX_ADAPTERS)
            .map(str::to_string)
            .collect()
    };
    Some(ServedModels {
        max_model_len,
        adapters: names(true),
        models: names(false),
    })
}

/// GET `{base_url}/v1/models`, bounded in time and size.
pub async fn fetch_models(pool: &Pool, base_url: &str) -> Option<ServedModels> {
    let body = get_limited(
        pool,
        &format!("{base_url}/v1/models"),
        MAX_MODELS_BODY_BYTES,
    )
    .await?;
    parse_models(&body)
}

/// GET `{base_url}/metrics`, bounded in time and size. `None`: no answer, not 2xx, too large.
pub async fn scrape(pool: &Pool, base_url: &str) -> Option<EngineCache> {
    let body = get_limited(pool, &format!("{base_url}/metrics"), MAX_METRICS_BODY_BYTES).await?;
    Some(parse(&String::from_utf8_lossy(&body)))
}

/// The body of `GET uri`, within [`SCRAPE_TIMEOUT`] and `limit` bytes. `None`: no answer, not
/// 2xx, too large.
async fn get_limited(pool: &Pool, uri: &str, limit: usize) -> Option<bytes::Bytes> {
    let request = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(myelin_http::body::empty())
        .ok()?;
    let attempt = async {
        let response = pool.send(request).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        crate::proxy::collect_limited(response.into_body(), limit).await
    };
    myelin_http::rt::timeout(SCRAPE_TIMEOUT, attempt)
        .await
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_max_model_len(body: &[u8]) -> Option<u64> {
        parse_models(body)?.max_model_len
    }

    #[test]
    fn vllm_page() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"1500\"} 1.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 4.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            # TYPE vllm:generation_tokens_total counter\n\
            vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 12345.0\n";
        let parsed = parse(text);
        assert_eq!(
            parsed,
            EngineCache {
                capacity_tokens: Some(24_000),
                utilization: Some(0.25),
                running: Some(4.0),
                waiting: Some(2.0),
                generation_tokens: Some(12_345.0),
            }
        );
        assert_eq!(
            parsed.memory(),
            Some(ScrapedMemory {
                utilization: 0.25,
                running: 4,
                waiting: 2
            })
        );
        // Without the queue gauges there is no expected wait to compute.
        let partial = "vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_running 3\n";
        assert_eq!(parse(partial).memory(), None);
    }

    #[test]
    fn the_context_length_comes_from_v1_models_within_bounds() {
        let vllm = br#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":8192},
            {"id":"m-lora","object":"model","max_model_len":4096}]}"#;
        assert_eq!(parse_max_model_len(vllm), Some(8192));
        for broken in [
            &br#"{"data":[{"id":"m"}]}"#[..],
            br#"{"data":[{"id":"m","max_model_len":0}]}"#,
            br#"{"data":[{"id":"m","max_model_len":99999999999}]}"#,
            br#"{"data":[{"id":"m","max_model_len":-5}]}"#,
            br#"{"data":[{"id":"m","max_model_len":"8192"}]}"#,
            b"not json",
        ] {
            assert_eq!(parse_max_model_len(broken), None);
        }
    }

    #[test]
    fn lora_adapters_are_the_models_listed_with_a_parent() {
        // vLLM 0.32's page with one adapter loaded (--enable-lora --lora-modules sql=...).
        let vllm = br#"{"object":"list","data":[
            {"id":"llama","object":"model","root":"/models/llama","parent":null,"max_model_len":8192},
            {"id":"sql","object":"model","root":"/adapters/sql","parent":"llama","max_model_len":8192},
            {"id":"","parent":"llama"},{"id":7,"parent":"llama"}]}"#;
        let served = parse_models(vllm).unwrap();
        assert_eq!(served.max_model_len, Some(8192));
        assert_eq!(&*served.adapters, ["sql".to_string()]);
        assert_eq!(&*served.models, ["llama".to_string(), "sql".to_string()]);
        let long = format!(
            r#"{{"data":[{{"id":"{}","parent":"m"}}]}}"#,
            "x".repeat(MAX_ADAPTER_NAME_BYTES + 1)
        );
        assert!(parse_models(long.as_bytes()).unwrap().adapters.is_empty());
        let many: Vec<String> = (0..MAX_ADAPTERS + 5)
            .map(|index| format!(r#"{{"id":"a{index}","parent":"m"}}"#))
            .collect();
        let many = format!(r#"{{"data":[{}]}}"#, many.join(","));
        assert_eq!(
            parse_models(many.as_bytes()).unwrap().adapters.len(),
            MAX_ADAPTERS
        );
        assert_eq!(parse_models(b"[]"), None);
    }

    #[test]
    fn older_vllm_and_sglang_pages_and_nothing() {
        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n";
        assert_eq!(parse(old).utilization, Some(0.5));
        assert_eq!(parse(old).capacity_tokens, None);
        let sglang = "sglang:max_total_num_tokens{model_name=\"m\"} 500000.0\n\
            sglang:token_usage{model_name=\"m\"} 0.1\n\
            sglang:num_running_reqs{model_name=\"m\"} 7\n\
            sglang:num_queue_reqs{model_name=\"m\"} 0\n";
        assert_eq!(
            parse(sglang),
            EngineCache {
                capacity_tokens: Some(500_000),
                utilization: Some(0.1),
                running: Some(7.0),
                waiting: Some(0.0),
                generation_tokens: None,
            }
        );
        assert_eq!(parse("garbage {{{\nfoo 1\n"), EngineCache::default());
        // Two data-parallel ranks: capacities add up, utilization averages.
        let two = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"10\"} 1\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"20\"} 1\n\
            vllm:kv_cache_usage_perc 0.2\nvllm:kv_cache_usage_perc 0.4\n";
        let parsed = parse(two);
        assert_eq!(parsed.capacity_tokens, Some(480));
        assert!((parsed.utilization.unwrap() - 0.3).abs() < 1e-12);
    }

    #[test]
    fn the_simulators_page_parses() {
        let text = myelin_sim::metrics::render(&myelin_sim::metrics::MetricsSnapshot {
            model_name: "m",
            engine: 0,
            block_size: 16,
            num_gpu_blocks: 1500,
            counters: Default::default(),
            load: Default::default(),
        });
        let parsed = parse(&text);
        assert_eq!(parsed.capacity_tokens, Some(24_000));
        assert_eq!(parsed.utilization, Some(0.0));
        assert_eq!(parsed.running, Some(0.0));
        assert_eq!(parsed.waiting, Some(0.0));
        assert_eq!(parsed.generation_tokens, Some(0.0));
    }
}
