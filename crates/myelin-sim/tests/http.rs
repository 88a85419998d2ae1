//! HTTP tests on loopback: a real simulated engine (glommio, hyper, the bundled tokenizer)
//! driven by myelin-http's client: vLLM's response and chunk shapes, cached tokens on a repeated
//! prompt, `/metrics` names, client disconnect freeing blocks, faults.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use myelin_http::body;
use myelin_http::client::{Pool, PoolConfig};
use myelin_http::executor::DEFAULT_IO_MEMORY_BYTES;
use myelin_http::sse::SseParser;
use myelin_sim::{ClusterConfig, EngineConfig, FaultConfig, SimCluster};
use serde_json::{Value, json};

/// Longest a test waits for an engine to reach a state (never part of an assertion).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

fn cluster(speedup: f64, faults: FaultConfig) -> SimCluster {
    SimCluster::start(ClusterConfig {
        engines: 1,
        speedup,
        faults,
        engine: EngineConfig {
            num_gpu_blocks: 2000,
            ..EngineConfig::default()
        },
        executor_threads: 1,
        ..ClusterConfig::default()
    })
    .expect("cluster starts")
}

/// Runs `test` on a glommio executor on this thread.
fn on_executor<F, Fut>(test: F)
where
    F: FnOnce(Pool) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    glommio::LocalExecutorBuilder::default()
        .io_memory(DEFAULT_IO_MEMORY_BYTES)
        .make()
        .expect("executor")
        .run(test(Pool::new(PoolConfig::default())));
}

async fn send(
    pool: &Pool,
    method: Method,
    url: String,
    body: Option<Value>,
) -> (StatusCode, Bytes) {
    let request = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(match body {
            Some(value) => body::full(value.to_string()),
            None => body::empty(),
        })
        .expect("request");
    let response = pool.send(request).await.expect("response");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, bytes)
}

async fn post_json(pool: &Pool, url: String, body: Value) -> (StatusCode, Value) {
    let (status, bytes) = send(pool, Method::POST, url, Some(body)).await;
    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, value)
}

fn sse_values(bytes: &[u8]) -> (Vec<Value>, bool) {
    let mut parser = SseParser::new();
    let events = parser.feed(bytes);
    let done = events.last().is_some_and(|event| event.is_done());
    let values = events
        .iter()
        .filter(|event| !event.is_done())
        .map(|event| serde_json::from_str(&event.data).expect("chunk is JSON"))
        .collect();
    (values, done)
}

fn long_prompt() -> String {
    (0..120)
        .map(|index| format!("word{index} is followed by more words"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
fn streaming_chat_has_vllm_chunk_shapes_and_usage() {
    let cluster = cluster(100.0, FaultConfig::default());
    let url = format!("{}/v1/chat/completions", cluster.engine_urls()[0]);
    on_executor(|pool| async move {
        let body = json!({
            "model": "sim",
            "messages": [{"role": "user", "content": "Tell me about the harbour."}],
            "max_tokens": 5,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let (status, bytes) = send(&pool, Method::POST, url, Some(body)).await;
        assert_eq!(status, StatusCode::OK);
        let (chunks, done) = sse_values(&bytes);
        assert!(done, "the stream ends with data: [DONE]");
        assert_eq!(chunks.len(), 1 + 5 + 1, "role, 5 tokens, usage: {chunks:?}");
        let id = chunks[0]["id"].as_str().expect("id");
        assert!(id.starts_with("chatcmpl-"));
        for chunk in &chunks {
            assert_eq!(chunk["id"], id);
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["model"], "sim");
            assert!(chunk["created"].is_u64());
        }
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);
        let mut text = String::new();
        for (position, chunk) in chunks[1..6].iter().enumerate() {
            let choice = &chunk["choices"][0];
            assert_eq!(choice["index"], 0);
            assert!(choice["logprobs"].is_null());
            text.push_str(choice["delta"]["content"].as_str().expect("content"));
            if position == 4 {
                assert_eq!(choice["finish_reason"], "length");
                assert!(
                    choice
                        .as_object()
                        .expect("choice")
                        .contains_key("stop_reason")
                );
            } else {
                assert!(choice["finish_reason"].is_null());
                assert!(
                    !choice
                        .as_object()
                        .expect("choice")
                        .contains_key("stop_reason")
                );
            }
        }
        assert!(!text.trim().is_empty());
        let usage_chunk = &chunks[6];
        assert_eq!(usage_chunk["choices"], json!([]));
        let usage = &usage_chunk["usage"];
        assert_eq!(usage["completion_tokens"], 5);
        let prompt_tokens = usage["prompt_tokens"].as_u64().expect("prompt tokens");
        assert!(prompt_tokens > 5);
        assert_eq!(usage["total_tokens"].as_u64(), Some(prompt_tokens + 5));
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    });
}

#[test]
fn streaming_completion_chunks_and_no_usage_without_the_option() {
    let cluster = cluster(100.0, FaultConfig::default());
    let url = format!("{}/v1/completions", cluster.engine_urls()[0]);
    on_executor(|pool| async move {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": true, "stream": true});
        let (status, bytes) = send(&pool, Method::POST, url, Some(body)).await;
        assert_eq!(status, StatusCode::OK);
        let (chunks, done) = sse_values(&bytes);
        assert!(done);
        assert_eq!(chunks.len(), 3);
        for (position, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk["object"], "text_completion");
            assert!(
                chunk["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("cmpl-"))
            );
            assert!(chunk["usage"].is_null());
            let choice = &chunk["choices"][0];
            assert!(choice["text"].is_string());
            assert!(choice["stop_reason"].is_null());
            let expected = if position == 2 {
                json!("length")
            } else {
                Value::Null
            };
            assert_eq!(choice["finish_reason"], expected);
        }
    });
}

#[test]
fn a_repeated_prompt_reports_cached_tokens() {
    let cluster = cluster(100.0, FaultConfig::default());
    let url = format!("{}/v1/completions", cluster.engine_urls()[0]);
    let prompt = long_prompt();
    on_executor(|pool| async move {
        let body = json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true});
        let (status, first) = post_json(&pool, url.clone(), body.clone()).await;
        assert_eq!(status, StatusCode::OK, "{first}");
        assert_eq!(first["object"], "text_completion");
        assert_eq!(first["choices"][0]["finish_reason"], "length");
        assert!(first["choices"][0]["logprobs"].is_null());
        assert_eq!(first["usage"]["completion_tokens"], 2);
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let prompt_tokens = first["usage"]["prompt_tokens"]
            .as_u64()
            .expect("prompt tokens");
        let (_, second) = post_json(&pool, url, body).await;
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached tokens");
        // Every full block but the one holding the last prompt token.
        assert_eq!(cached, (prompt_tokens - 1) / 16 * 16);
        assert!(cached > 0);
        assert_eq!(
            second["choices"][0]["text"], first["choices"][0]["text"],
            "deterministic"
        );
    });
}

#[test]
fn completions_accept_token_ids_and_batches() {
    let cluster = cluster(100.0, FaultConfig::default());
    let url = format!("{}/v1/completions", cluster.engine_urls()[0]);
    let tokens: Vec<u32> = (100..164).collect();
    let probe_tokens = tokens.clone();
    on_executor(|pool| async move {
        let (status, single) = post_json(
            &pool,
            url.clone(),
            json!({"prompt": tokens, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{single}");
        assert_eq!(single["usage"]["prompt_tokens"], 64);
        let (status, batch) = post_json(
            &pool,
            url.clone(),
            json!({"prompt": ["first prompt", "second prompt"], "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{batch}");
        let choices = batch["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 2);
        assert_eq!(choices[0]["index"], 0);
        assert_eq!(choices[1]["index"], 1);
        assert_eq!(batch["usage"]["completion_tokens"], 4);
        let (status, error) = post_json(&pool, url, json!({"prompt": {"bad": 1}})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(error["error"]["code"], 400);
    });
    // The oracle sees the token-id prompt's full blocks (64 tokens = 4 blocks, last recomputed
    // but cached once computed).
    let probe = cluster.probe(&probe_tokens);
    assert_eq!(probe[0].cached_prefix_tokens, 64);
    assert_eq!(probe[0].prompt_hit_tokens, 48);
}

#[test]
fn metrics_models_health_and_reset() {
    let cluster = cluster(100.0, FaultConfig::default());
    let base = cluster.engine_urls()[0].clone();
    on_executor(|pool| async move {
        let (status, _) = post_json(
            &pool,
            format!("{base}/v1/completions"),
            json!({"prompt": long_prompt(), "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let (status, metrics) = send(&pool, Method::GET, format!("{base}/metrics"), None).await;
        assert_eq!(status, StatusCode::OK);
        let metrics = String::from_utf8_lossy(&metrics);
        for name in [
            "vllm:kv_cache_usage_perc{",
            "vllm:num_requests_running{",
            "vllm:num_requests_waiting{",
            "vllm:prefix_cache_queries_total{",
            "vllm:prefix_cache_hits_total{",
            "vllm:num_preemptions_total{",
            "vllm:cache_config_info{block_size=\"16\"",
        ] {
            assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
        }
        assert!(metrics.contains("num_gpu_blocks=\"2000\""));
        let queries_line = metrics
            .lines()
            .find(|line| line.starts_with("vllm:prefix_cache_queries_total{"))
            .expect("queries line");
        assert!(!queries_line.ends_with(" 0.0"), "{queries_line}");

        let (status, models) = send(&pool, Method::GET, format!("{base}/v1/models"), None).await;
        assert_eq!(status, StatusCode::OK);
        let models: Value = serde_json::from_slice(&models).expect("json");
        assert_eq!(models["object"], "list");
        assert_eq!(models["data"][0]["id"], myelin_sim::DEFAULT_MODEL_NAME);
        assert_eq!(models["data"][0]["owned_by"], "vllm");

        let (status, _) = send(&pool, Method::GET, format!("{base}/health"), None).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _) = send(&pool, Method::GET, format!("{base}/nope"), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, _) = send(
            &pool,
            Method::POST,
            format!("{base}/reset_prefix_cache"),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    });
    assert_eq!(cluster.probe(&[1, 2, 3])[0].load.kv_usage, 0.0);
    assert!(cluster.counters()[0].prefix_cache_queries > 0);
}

#[test]
fn a_client_disconnect_aborts_the_request_and_frees_its_blocks() {
    let cluster = cluster(20.0, FaultConfig::default());
    let url = format!("{}/v1/completions", cluster.engine_urls()[0]);
    on_executor(|pool| async move {
        let request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .body(body::full(
                json!({"prompt": long_prompt(), "max_tokens": 4000, "ignore_eos": true, "stream": true})
                    .to_string(),
            ))
            .expect("request");
        let response = pool.send(request).await.expect("response");
        let mut body = response.into_body();
        let first = body.frame().await.expect("a first chunk").expect("chunk");
        assert!(
            first
                .data_ref()
                .is_some_and(|data| data.starts_with(b"data: "))
        );
        drop(body);
    });
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    while cluster.counters()[0].requests_aborted == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(cluster.counters()[0].requests_aborted, 1);
    let probe = &cluster.probe(&[1])[0];
    assert_eq!(probe.load.running, 0);
    assert_eq!(probe.load.kv_usage, 0.0, "every block is free again");
}

#[test]
fn a_client_that_gives_up_on_a_whole_response_aborts_it() {
    let cluster = cluster(20.0, FaultConfig::default());
    let url = format!("{}/v1/completions", cluster.engine_urls()[0]);
    on_executor(|pool| async move {
        let request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .body(body::full(
                json!({"prompt": long_prompt(), "max_tokens": 4000, "ignore_eos": true})
                    .to_string(),
            ))
            .expect("request");
        let gave_up = futures_lite::future::or(
            async {
                let _ = pool.send(request).await;
                false
            },
            async {
                glommio::timer::Timer::new(Duration::from_millis(300)).await;
                true
            },
        )
        .await;
        assert!(
            gave_up,
            "4000 tokens take far longer than 300 ms even at 20x"
        );
        drop(pool);
    });
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    while cluster.counters()[0].requests_aborted == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(cluster.counters()[0].requests_aborted, 1);
    assert_eq!(cluster.probe(&[1])[0].load.kv_usage, 0.0);
}

#[test]
fn an_engine_without_metrics_answers_404_and_still_serves() {
    let cluster = cluster(
        100.0,
        FaultConfig {
            no_metrics: true,
            ..FaultConfig::default()
        },
    );
    let base = cluster.engine_urls()[0].clone();
    on_executor(|pool| async move {
        let (status, body) = send(&pool, Method::GET, format!("{base}/metrics"), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(!String::from_utf8_lossy(&body).contains("vllm:"));
        let (status, _) = post_json(
            &pool,
            format!("{base}/v1/completions"),
            json!({"prompt": "hello", "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    });
}

#[test]
fn injected_faults_fail_and_cut_responses() {
    let cluster = cluster(
        100.0,
        FaultConfig {
            die_mid_stream_after: Some(1),
            fail_after: Some(2),
            ..FaultConfig::default()
        },
    );
    let url = format!("{}/v1/completions", cluster.engine_urls()[0]);
    on_executor(|pool| async move {
        let body = json!({"prompt": "hello", "max_tokens": 3, "ignore_eos": true, "stream": true});
        let (status, bytes) = send(&pool, Method::POST, url.clone(), Some(body.clone())).await;
        assert_eq!(status, StatusCode::OK);
        assert!(sse_values(&bytes).1, "the first request is served whole");

        let request = Request::builder()
            .method(Method::POST)
            .uri(url.clone())
            .body(body::full(body.to_string()))
            .expect("request");
        let response = pool.send(request).await.expect("response head");
        assert_eq!(response.status(), StatusCode::OK);
        assert!(
            response.into_body().collect().await.is_err(),
            "the second stream breaks"
        );

        let (status, error) = post_json(&pool, url, body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(error["error"]["code"], 503);
    });
}

#[test]
fn several_engines_share_executor_threads_and_keep_separate_caches() {
    let cluster = SimCluster::start(ClusterConfig {
        engines: 3,
        speedup: 100.0,
        executor_threads: 2,
        ..ClusterConfig::default()
    })
    .expect("cluster starts");
    let urls = cluster.engine_urls();
    assert_eq!(urls.len(), 3);
    let prompt: Vec<u32> = (7000..7100).collect();
    let target = urls[1].clone();
    let all = urls.clone();
    let sent = prompt.clone();
    on_executor(|pool| async move {
        for url in all {
            let (status, _) = send(&pool, Method::GET, format!("{url}/health"), None).await;
            assert_eq!(status, StatusCode::OK);
        }
        let (status, _) = post_json(
            &pool,
            format!("{target}/v1/completions"),
            json!({"prompt": sent, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    });
    let probes = cluster.probe(&prompt);
    let cached: Vec<usize> = probes
        .iter()
        .map(|probe| probe.cached_prefix_tokens)
        .collect();
    assert_eq!(
        cached,
        vec![0, 96, 0],
        "only engine 1 holds the prompt's 6 full blocks"
    );
    let counters = cluster.counters();
    assert_eq!(counters[1].prefix_cache_queries, 100);
    assert_eq!(counters[0].prefix_cache_queries, 0);
}
