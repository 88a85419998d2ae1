//! Tokenization cost of prompts of 512, 2,048 and 8,192 tokens with the bundled tokenizer: the
//! dominant per-request cost on the router's request path.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use myelin_tokenize::Tokenizer;

/// English-like prose with varied words, so the BPE merges look like a real prompt's.
fn prose_of_tokens(tokenizer: &Tokenizer, target_tokens: usize) -> String {
    const WORDS: &[&str] = &[
        "the",
        "router",
        "sends",
        "each",
        "request",
        "to",
        "an",
        "engine",
        "that",
        "still",
        "holds",
        "its",
        "prompt",
        "prefix",
        "in",
        "cache",
        "while",
        "evictions",
        "under",
        "pressure",
        "reorder",
        "blocks",
        "and",
        "queues",
        "grow",
        "with",
        "load",
        "latency",
        "matters",
        "for",
        "users",
        "waiting",
        "on",
        "first",
        "tokens",
        "of",
        "answers,",
        "numbers",
        "like",
        "4096",
        "or",
        "3.14",
        "appear",
        "too.",
    ];
    let mut text = String::new();
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    while tokenizer.encode(&text, false).map_or(0, |ids| ids.len()) < target_tokens {
        for _ in 0..64 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            text.push_str(WORDS[(state % WORDS.len() as u64) as usize]);
            text.push(' ');
        }
    }
    text
}

fn encode(c: &mut Criterion) {
    let tokenizer = Tokenizer::bundled().expect("bundled tokenizer");
    let mut group = c.benchmark_group("tokenize");
    for tokens in [512usize, 2048, 8192] {
        let text = prose_of_tokens(&tokenizer, tokens);
        group.bench_with_input(BenchmarkId::from_parameter(tokens), &text, |b, text| {
            b.iter(|| tokenizer.encode(black_box(text), false).expect("encode"))
        });
    }
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
