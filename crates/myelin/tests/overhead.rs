//! Router overhead figures for docs/performance.md ("Router overhead"). Measurements, not
//! tests: every function here is `#[ignore]` and prints its figures. Run in release mode:
//!
//! ```text
//! cargo test --release -p myelin --test overhead -- --ignored --nocapture --test-threads 1
//! ```

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use myelin_server::openai::PromptInput;
use myelin_server::route_tokens::{AddedTokens, RouteTokenizer};
use myelin_tokenize::{ChatTemplate, FastBpe, Tokenizer};
use support::engine::{Behavior, Engine};
use support::{HttpResponse, Router, metric_value, request};

/// Requests per second of the open-loop TTFT runs.
const RATE_PER_SECOND: u64 = 100;
/// Requests per TTFT run (10 s at 100 req/s).
const TTFT_REQUESTS: usize = 1_000;
/// Words per generated prompt: about 2k tokens with the bundled tokenizer.
const PROMPT_WORDS: usize = 1_820;

const WORDS: &[&str] = &[
    "cache",
    "router",
    "prefix",
    "engine",
    "token",
    "block",
    "latency",
    "memory",
    "request",
    "stream",
    "model",
    "kernel",
    "tensor",
    "batch",
    "queue",
    "schedule",
    "evict",
    "resident",
    "estimate",
    "verify",
    "shard",
    "core",
    "message",
    "network",
    "policy",
    "score",
    "load",
    "health",
    "probe",
    "drain",
    "signal",
    "metric",
    "histogram",
    "window",
    "sequence",
    "context",
    "prompt",
    "answer",
    "question",
    "system",
    "user",
    "assistant",
    "history",
    "session",
    "turn",
    "document",
    "retrieval",
    "summary",
    "translate",
    "reason",
];

/// xorshift64* (Vigna 2016): reproducible prompts without a dependency.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn random_text(state: &mut u64, words: usize) -> String {
    let mut text = String::with_capacity(words * 8);
    for index in 0..words {
        if index > 0 {
            text.push(if index % 17 == 0 { '.' } else { ' ' });
            if index % 17 == 0 {
                text.push(' ');
            }
        }
        text.push_str(WORDS[(next_random(state) % WORDS.len() as u64) as usize]);
    }
    text
}

fn chat_request(system: &str, user: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "test-model",
        "stream": stream,
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
    })
    .to_string()
}

/// POSTs a chat request body to `addr` (router or engine); panics unless it is answered 200.
fn post_chat(addr: SocketAddr, body: &str) -> HttpResponse {
    let response = request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(body.as_bytes()),
    );
    assert_eq!(response.status, 200);
    response
}

/// Time to the first body chunk of each request, sent open-loop at `rate` per second.
fn ttft_open_loop(addr: SocketAddr, bodies: Vec<String>, rate: u64) -> Vec<Duration> {
    let interval = Duration::from_nanos(1_000_000_000 / rate);
    let start = Instant::now();
    let mut handles = Vec::with_capacity(bodies.len());
    for (index, body) in bodies.into_iter().enumerate() {
        let due = start + interval * index as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        handles.push(std::thread::spawn(move || {
            let sent = Instant::now();
            let mut response = post_chat(addr, &body);
            response.next_chunk().expect("first chunk");
            let ttft = sent.elapsed();
            let _ = response.body();
            ttft
        }));
    }
    handles
        .into_iter()
        .map(|handle| handle.join().expect("request thread"))
        .collect()
}

fn percentile(sorted: &[Duration], fraction: f64) -> Duration {
    let index = ((sorted.len() as f64 * fraction).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn summary(name: &str, mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let (p50, p99) = (percentile(&samples, 0.50), percentile(&samples, 0.99));
    println!(
        "{name:<38} n={:<5} p50={:>7.3} ms  p99={:>7.3} ms  max={:>7.3} ms",
        samples.len(),
        millis(p50),
        millis(p99),
        millis(*samples.last().unwrap_or(&Duration::ZERO)),
    );
    (p50, p99)
}

/// The smallest histogram bucket bound covering `fraction` of the samples of `metric`.
fn histogram_quantile(metrics: &str, metric: &str, fraction: f64) -> Option<f64> {
    let bucket_prefix = format!("{metric}_bucket{{");
    let buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|line| line.starts_with(&bucket_prefix))
        .filter_map(|line| {
            let bound = line.split("le=\"").nth(1)?.split('"').next()?;
            let bound: f64 = if bound == "+Inf" {
                f64::INFINITY
            } else {
                bound.parse().ok()?
            };
            let count: f64 = line.rsplit(' ').next()?.parse().ok()?;
            Some((bound, count))
        })
        .collect();
    let total = buckets.last()?.1;
    buckets
        .iter()
        .find(|(_, count)| *count >= total * fraction)
        .map(|(bound, _)| *bound)
}

/// The p50 and p99 bucket bounds of `_seconds` histogram `metric`, in milliseconds (NaN when
/// the metric is missing).
fn histogram_p50_p99_ms(metrics: &str, metric: &str) -> (f64, f64) {
    let bound_ms =
        |fraction| histogram_quantile(metrics, metric, fraction).unwrap_or(f64::NAN) * 1e3;
    (bound_ms(0.50), bound_ms(0.99))
}

/// Added TTFT of the router vs going straight to the engine, 2k-token prompts, 100 req/s,
/// one data core; also the router's own tokenize and decision histograms for the run.
#[test]
#[ignore = "measurement; run in release mode (see the module docs)"]
fn added_ttft_vs_direct() {
    let engine = Engine::start(
        "fast",
        Behavior::Normal {
            chunks: 2,
            interval: Duration::from_millis(1),
        },
    );
    let router = Router::start_with_shards(1, &["--backend", &engine.url()]);
    let mut state = 0x5eed_u64;
    let system = random_text(&mut state, 40);
    let bodies = |state: &mut u64| -> Vec<String> {
        (0..TTFT_REQUESTS)
            .map(|_| chat_request(&system, &random_text(state, PROMPT_WORDS), true))
            .collect()
    };
    // Warm both paths (connections, caches, page faults).
    ttft_open_loop(
        engine.addr,
        bodies(&mut state)[..50].to_vec(),
        RATE_PER_SECOND,
    );
    ttft_open_loop(
        router.addr,
        bodies(&mut state)[..50].to_vec(),
        RATE_PER_SECOND,
    );

    println!("\n2k-token unique chat prompts, {RATE_PER_SECOND} req/s, 1 data core:");
    let direct = summary(
        "direct to engine",
        ttft_open_loop(engine.addr, bodies(&mut state), RATE_PER_SECOND),
    );
    let routed = summary(
        "through myelin",
        ttft_open_loop(router.addr, bodies(&mut state), RATE_PER_SECOND),
    );
    println!(
        "{:<38} p50=+{:.3} ms  p99=+{:.3} ms",
        "added by the router",
        millis(routed.0.saturating_sub(direct.0)),
        millis(routed.1.saturating_sub(direct.1)),
    );
    let metrics = router.metrics();
    for (name, metric) in [
        ("tokenize (router histogram)", "myelin_tokenize_seconds"),
        (
            "routing decision (router histogram)",
            "myelin_routing_decision_seconds",
        ),
    ] {
        let (p50, p99) = histogram_p50_p99_ms(&metrics, metric);
        println!("{name:<38} p50<={p50:.3} ms  p99<={p99:.3} ms (bucket bounds)");
    }
}

/// Requests per second one data core sustains with small prompts (closed loop).
#[test]
#[ignore = "measurement; run in release mode (see the module docs)"]
fn requests_per_second_per_core() {
    let engine = Engine::start(
        "fast",
        Behavior::Normal {
            chunks: 1,
            interval: Duration::ZERO,
        },
    );
    let router = Router::start_with_shards(1, &["--backend", &engine.url()]);
    const CLIENTS: usize = 16;
    const DURATION: Duration = Duration::from_secs(5);
    let stop = Arc::new(AtomicBool::new(false));
    let completed = Arc::new(AtomicU64::new(0));
    let body = chat_request("Be brief.", "What is a KV cache?", false);
    for (name, addr) in [
        ("direct to engine", engine.addr),
        ("through myelin", router.addr),
    ] {
        stop.store(false, Ordering::SeqCst);
        completed.store(0, Ordering::SeqCst);
        let started = Instant::now();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (stop, completed, body) = (stop.clone(), completed.clone(), body.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let response = post_chat(addr, &body);
                        let _ = response.body();
                        completed.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        std::thread::sleep(DURATION);
        stop.store(true, Ordering::SeqCst);
        for client in clients {
            client.join().expect("client");
        }
        let rate = completed.load(Ordering::SeqCst) as f64 / started.elapsed().as_secs_f64();
        println!(
            "{name:<38} {rate:>8.0} req/s ({CLIENTS} closed-loop clients, new connection per request)"
        );
    }
    let metrics = router.metrics();
    let decisions = metric_value(&metrics, &["myelin_routing_decision_seconds_count"]);
    println!("routing decisions recorded: {decisions}");
}

/// Tokenization cost of a 2k-token prompt: whole text vs the segment cache.
#[test]
#[ignore = "measurement; run in release mode (see the module docs)"]
fn tokenization_cost() {
    let path = myelin_tokenize::bundled_tokenizer_path().expect("bundled tokenizer");
    let tokenizer = Tokenizer::from_file(&path).expect("tokenizer");
    let added = AddedTokens::from_tokenizer_json(&path).map(Arc::new);
    let deepseek_style = Arc::new(
        ChatTemplate::from_source(
            "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% else %}{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}".into(),
            "<｜begin▁of▁sentence｜>".into(),
            "<｜end▁of▁sentence｜>".into(),
        )
        .expect("template"),
    );
    let chatml = Arc::new(ChatTemplate::chatml());
    let mut state = 0xfeed_u64;
    let long_history = random_text(&mut state, PROMPT_WORDS - 30);
    let turn = |state: &mut u64| {
        PromptInput::Chat(serde_json::json!([
            {"role": "system", "content": long_history},
            {"role": "user", "content": random_text(state, 30)},
        ]))
    };
    let iterations = 200;
    let fast = FastBpe::from_tokenizer_json(&path)
        .expect("tokenizer.json")
        .expect("the bundled tokenizer has a fast path");
    let mut measure = |name: &str,
                       fast: Option<&FastBpe>,
                       template: &Arc<ChatTemplate>,
                       cache_bytes: usize,
                       prefix_bytes: Option<usize>| {
        let mut routed = RouteTokenizer::new(
            tokenizer.clone(),
            fast.cloned(),
            template.clone(),
            added.clone(),
            cache_bytes,
            16,
        );
        let rendered = routed.render(&turn(&mut state)).expect("render");
        let tokens = routed.tokens(&rendered, prefix_bytes).expect("tokens");
        let mut samples = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            let prompt = turn(&mut state);
            let started = Instant::now();
            let rendered = routed.render(&prompt).expect("render");
            routed.tokens(&rendered, prefix_bytes).expect("tokens");
            samples.push(started.elapsed());
        }
        summary(
            &format!(
                "{name} ({} of ~{} tokens)",
                tokens.ids.len(),
                tokens.estimated_total
            ),
            samples,
        );
    };
    println!("\nrender + tokenize one chat request: same 2k-token history, new 30-word turn:");
    for (path_name, fast) in [("HF", None), ("fast", Some(&fast))] {
        measure(
            &format!("{path_name}: ChatML, whole prompt"),
            fast,
            &chatml,
            0,
            None,
        );
        measure(
            &format!("{path_name}: ChatML, first 2048 bytes"),
            fast,
            &chatml,
            0,
            Some(2048),
        );
        measure(
            &format!("{path_name}: DeepSeek template, whole prompt"),
            fast,
            &deepseek_style,
            0,
            None,
        );
        measure(
            &format!("{path_name}: DeepSeek template, segment cache"),
            fast,
            &deepseek_style,
            16 << 20,
            None,
        );
    }
}

/// How old load updates are when another data core applies them (2 data cores, closed loop).
#[test]
#[ignore = "measurement; run in release mode (see the module docs)"]
fn load_view_staleness() {
    let engine = Engine::start(
        "fast",
        Behavior::Normal {
            chunks: 1,
            interval: Duration::ZERO,
        },
    );
    let router = Router::start(&["--backend", &engine.url()]);
    let body = chat_request("Be brief.", "What is a KV cache?", false);
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let body = body.clone();
            let addr = router.addr;
            std::thread::spawn(move || {
                for _ in 0..500 {
                    let response = post_chat(addr, &body);
                    let _ = response.body();
                }
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client");
    }
    let metrics = router.metrics();
    let metric = "myelin_load_view_staleness_seconds";
    let count = metric_value(&metrics, &[&format!("{metric}_count")]);
    let (p50, p99) = histogram_p50_p99_ms(&metrics, metric);
    println!(
        "\nload-view staleness, 2 data cores, 4,000 requests: {count} updates, p50<={p50:.3} ms p99<={p99:.3} ms (bucket bounds)"
    );
    let (p50, p99) = histogram_p50_p99_ms(&metrics, "myelin_routing_decision_seconds");
    println!(
        "routing decision, 2 data cores (half the lookups cross cores): p50<={p50:.3} ms p99<={p99:.3} ms (bucket bounds)"
    );
}
