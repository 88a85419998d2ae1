//! Tokenization cost of prompts of 512, 2,048 and 8,192 tokens with the bundled tokenizer: the
//! dominant per-request cost on the router's request path. HF's tokenizer next to the fast
//! byte-level BPE path with a warm word cache and with an empty one, on English-like prose and on
//! a mixed text (code, numbers, several scripts, emoji).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use myelin_tokenize::fast_bpe::{FastBpe, SELF_CHECK_CORPUS};
use myelin_tokenize::{Tokenizer, bundled_tokenizer_path};

/// The `myelin` binary's allocator: HF's tokenizer allocates per piece, and its cost depends on
/// the allocator (about 1.7x slower on glibc's; docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

/// The self-check corpus (code, JSON, numbers, CJK, Arabic, emoji, odd whitespace) repeated.
fn mixed_of_tokens(tokenizer: &Tokenizer, target_tokens: usize) -> String {
    let mut text = String::new();
    while tokenizer.encode(&text, false).map_or(0, |ids| ids.len()) < target_tokens {
        for sample in SELF_CHECK_CORPUS {
            text.push_str(sample);
            text.push('\n');
        }
    }
    text
}

fn encode(c: &mut Criterion) {
    let tokenizer = Tokenizer::bundled().expect("bundled tokenizer");
    let path = bundled_tokenizer_path().expect("bundled tokenizer");
    let mut fast = FastBpe::from_tokenizer_json(&path)
        .expect("readable")
        .expect("supported");
    let mut group = c.benchmark_group("tokenize");
    for tokens in [512usize, 2048, 8192] {
        for (kind, text) in [
            ("prose", prose_of_tokens(&tokenizer, tokens)),
            ("mixed", mixed_of_tokens(&tokenizer, tokens)),
        ] {
            let mut ids = Vec::new();
            fast.encode_plain(&text, &mut ids);
            assert_eq!(ids, tokenizer.encode(&text, false).expect("encode"));
            group.bench_with_input(
                BenchmarkId::new(format!("hf/{kind}"), tokens),
                &text,
                |b, text| b.iter(|| tokenizer.encode(black_box(text), false).expect("encode")),
            );
            group.bench_with_input(
                BenchmarkId::new(format!("fast_warm/{kind}"), tokens),
                &text,
                |b, text| {
                    b.iter(|| {
                        ids.clear();
                        fast.encode_plain(black_box(text), &mut ids);
                        ids.len()
                    })
                },
            );
            // Cold: an empty word cache each iteration (emptied outside the timed region); the
            // regex engines' lazy DFA states stay warm, as they do on a running router core.
            group.bench_with_input(
                BenchmarkId::new(format!("fast_cold/{kind}"), tokens),
                &text,
                |b, text| {
                    b.iter_custom(|iterations| {
                        let mut timed = Duration::ZERO;
                        for _ in 0..iterations {
                            fast.clear_cache();
                            ids.clear();
                            let started = Instant::now();
                            fast.encode_plain(black_box(text), &mut ids);
                            timed += started.elapsed();
                        }
                        timed
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
