//! Criterion benchmark of reading a generation request body (`parse_generation_request`),
//! beside parsing the same body whole into a `serde_json::Value` (what the router did before
//! 2026-12-07, before any validation: a floor of its old cost).
//!
//! Bodies: completions with a prompt of 2k, 8k and 67k token ids (the harness's prompts, the
//! Mooncake trace's longest), a completion with a 32 KB text prompt, and a chat of 50 turns
//! (~25 KB of messages), and an agent's chat of 4 messages with 60 tool definitions (~40 KB the
//! router does not read).
//!
//! `cargo bench -p myelin-server --bench request_parse`

/// The `myelin` binary's allocator, so the figures are the router's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use myelin_server::openai::{Endpoint, parse_generation_request};
use serde_json::{Value, json};

fn ids(count: usize) -> Vec<u32> {
    // A fixed LCG: ids spread over a 128k vocabulary, 3-6 digits like real ones.
    let mut state = 0x2545_f491_u64;
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            ((state >> 33) % 128_000) as u32
        })
        .collect()
}

fn bodies() -> Vec<(&'static str, Endpoint, Vec<u8>)> {
    let model = "meta-llama/Llama-3.1-8B-Instruct";
    let completion = |prompt: Value| {
        json!({"model": model, "prompt": prompt, "max_tokens": 200, "stream": true})
            .to_string()
            .into_bytes()
    };
    let words = "the router sends each request to the engine that still holds its prefix ";
    let turns: Vec<Value> = (0..100)
        .map(|turn| {
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": words.repeat(3)})
        })
        .collect();
    // An agent's request: 60 tool definitions (~40 KB) the router does not read, 4 messages.
    let tools: Vec<Value> = (0..60)
        .map(|tool| {
            json!({"type": "function", "function": {
                "name": format!("tool_{tool}"),
                "description": words.repeat(6),
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": words},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 1000}
                }, "required": ["path"]}
            }})
        })
        .collect();
    vec![
        (
            "chat_tools_40k",
            Endpoint::ChatCompletions,
            json!({"model": model, "messages": &turns[..4], "tools": tools, "stream": true})
                .to_string()
                .into_bytes(),
        ),
        (
            "ids_2k",
            Endpoint::Completions,
            completion(json!(ids(2_048))),
        ),
        (
            "ids_8k",
            Endpoint::Completions,
            completion(json!(ids(8_192))),
        ),
        (
            "ids_67k",
            Endpoint::Completions,
            completion(json!(ids(67_220))),
        ),
        (
            "text_32k",
            Endpoint::Completions,
            completion(json!(words.repeat(32 * 1024 / words.len()))),
        ),
        (
            "chat_50_turns",
            Endpoint::ChatCompletions,
            json!({"model": model, "messages": turns, "stream": true})
                .to_string()
                .into_bytes(),
        ),
    ]
}

fn request_parse(c: &mut Criterion) {
    let mut group = c.benchmark_group("request_parse");
    for (name, endpoint, body) in bodies() {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(format!("{name}/parse_generation_request"), |b| {
            b.iter(|| parse_generation_request(endpoint, &body).unwrap())
        });
        group.bench_function(format!("{name}/whole_value"), |b| {
            b.iter(|| serde_json::from_slice::<Value>(&body).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, request_parse);
criterion_main!(benches);
