//! An exact fast path for byte-level BPE tokenizers (GPT-2 style: DeepSeek, Llama 3, Qwen 2):
//! the same ids as the HuggingFace `tokenizers` crate for a text without added tokens
//! ([`FastBpe::encode_plain`]), or for any text once the added tokens are attached
//! ([`FastBpe::with_added_tokens`], [`FastBpe::encode`]), about ten times faster. Templates and
//! everything the subset below excludes stay with [`crate::Tokenizer`].
//!
//! # Supported subset
//! Anything else makes [`FastBpe::from_tokenizer_json`] return `None` (with an [`Unsupported`]
//! reason from [`FastBpe::from_tokenizer_json_or_reason`]), and the caller keeps HF:
//! - normalizer: none, an empty `Sequence`, `NFC`, or a `Sequence` of just `NFC`; no truncation
//!   or padding;
//! - pre-tokenizer: `Split` steps (regex or literal, `Isolated`, not inverted) followed by a
//!   `ByteLevel` without prefix space, or a lone `ByteLevel`; `use_regex` adds GPT-2's pattern.
//!   A regex may use `(?i:...)` around alternatives of printable-ASCII literals (Llama 3's and
//!   Qwen 2's `(?i:'s|'t|'re|'ve|'m|'ll|'d)`), except literals onig would also match through a
//!   multi-character case fold (`ss`, `st`, `ff`, `fi`, `fl`); no other inline flag;
//! - model: `BPE` without dropout, byte fallback, subword prefix or word suffix, with every
//!   byte-level character in the vocabulary (so no unknown symbol can occur), ids unique;
//!   `ignore_merges` honoured; merges as `"a b"` strings or `[a, b]` pairs.
//!
//! # Why the ids are the same
//! HF encodes a text without added tokens as: normalize (nothing, or NFC), then each
//! pre-tokenizer step splits every piece of the previous step on its own (the regex never sees
//! across a piece boundary; matches and the gaps between them become pieces, empty ones are
//! dropped), then `ByteLevel` maps each piece's UTF-8 bytes to GPT-2's printable characters,
//! then BPE merges each piece independently and the ids are concatenated. This module does the
//! same steps in the same order. The places an argument is needed are documented where they
//! live:
//! - NFC (HF's own normalization crate and tables, Unicode 9): `normalize.rs`;
//! - regex semantics (`regex` vs onig, the `(?i:...)` rewrite into explicit classes, and the
//!   `\s+(?!\S)` emulation): `pattern.rs`;
//! - the merge order (lowest rank, leftmost on ties, equals HF's heap): `merge.rs`;
//! - added tokens (matched before normalization, or in each normalized gap): `added.rs`.
//!
//! A piece's ids depend only on the piece, so caching them per piece cannot change a result.
//! Tests compare against HF on a fixed corpus, thousands of random texts over a mixed
//! alphabet, arbitrary strings, every code point for the character classes, case folds and NFC
//! used, and the Llama 3 and Qwen 2 pre-tokenizers on edited copies of the bundled tokenizer; a
//! caller should still run [`FastBpe::verify_against`] at startup.

pub(crate) mod added;
mod cache;
mod corpus;
mod load;
mod merge;
mod normalize;
mod pattern;
mod unsupported;

use std::path::Path;
use std::sync::Arc;

pub use corpus::SELF_CHECK_CORPUS;
pub use unsupported::Unsupported;

use crate::{
    BUNDLED_TOKENIZER_JSON, BUNDLED_TOKENIZER_NAME, TokenizeError, Tokenizer, TokenizerSource,
};
use added::{AddedTokenMatcher, Segment};
use cache::WordCache;
use load::Tables;

/// Default entries per cache generation (the cache holds at most twice this many words).
pub const DEFAULT_CACHE_GENERATION_ENTRIES: usize = 32 * 1024;

/// Fast exact byte-level BPE encoder. Tables are shared between clones; each clone has its own
/// word cache, so give each thread (router core) its own clone.
#[derive(Debug)]
pub struct FastBpe {
    tables: Arc<Tables>,
    cache: WordCache,
    /// Reused per-word buffers.
    scratch: Scratch,
    /// Search state of each pre-tokenizer step, in step order.
    split_caches: Vec<pattern::SplitCache>,
    /// Added-token splitting for [`Self::encode`], once attached.
    added_tokens: Option<Arc<AddedTokenMatcher>>,
}

#[derive(Debug, Default)]
struct Scratch {
    symbols: Vec<u32>,
    byte_level_text: String,
}

impl Clone for FastBpe {
    /// Shares the tables; the clone starts with an empty cache of the same capacity.
    fn clone(&self) -> Self {
        Self::with_tables(Arc::clone(&self.tables), self.cache.generation_capacity())
    }
}

/// The fast path gave other ids than HF for a sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fast tokenizer disagrees with HF on sample {sample_index}: {fast:?} vs {hf:?}")]
pub struct Disagreement {
    /// Index in the samples given.
    pub sample_index: usize,
    /// First ids of the fast path (at most 16).
    pub fast: Vec<u32>,
    /// First ids of HF (at most 16), empty if HF failed.
    pub hf: Vec<u32>,
}

/// Why [`FastBpe::verified`] gives no fast path.
#[derive(Debug, thiserror::Error)]
pub enum FastPathRefused {
    /// The `tokenizer.json` could not be read or parsed.
    #[error(transparent)]
    Load(#[from] TokenizeError),
    /// The tokenizer (or one of its added tokens) uses something not reproduced exactly.
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    /// The fast path gave other ids than HF on the self-check corpus.
    #[error(transparent)]
    Disagrees(#[from] Disagreement),
}

impl FastBpe {
    /// The fast path for the `tokenizer.json` at `path`, ready for prompts with added tokens:
    /// loaded, its added tokens attached from `hf` (the same file loaded by HF), and checked
    /// against `hf` on [`SELF_CHECK_CORPUS`] (word cache emptied afterwards). What every user
    /// of the fast path should call.
    pub fn verified(path: &Path, hf: &Tokenizer) -> Result<Self, FastPathRefused> {
        Self::verified_source(&TokenizerSource::File(path.to_path_buf()), hf)
    }

    /// As [`Self::verified`], for the `tokenizer.json` of `source` (the embedded bundled one
    /// is parsed from memory).
    pub fn verified_source(
        source: &TokenizerSource,
        hf: &Tokenizer,
    ) -> Result<Self, FastPathRefused> {
        let json = source.read()?;
        let mut fast =
            Self::from_tokenizer_json_str(&json, &source.to_string())??.with_added_tokens(hf)?;
        fast.verify_against(hf, SELF_CHECK_CORPUS)?;
        fast.clear_cache();
        Ok(fast)
    }

    /// Reads a `tokenizer.json`; `Ok(None)` when it uses anything not reproduced exactly (see
    /// the module docs), `Err` when it cannot be read or is malformed.
    pub fn from_tokenizer_json(path: &Path) -> Result<Option<Self>, TokenizeError> {
        Ok(Self::from_tokenizer_json_or_reason(path)?.ok())
    }

    /// As [`Self::from_tokenizer_json`], saying why a tokenizer is not supported.
    pub fn from_tokenizer_json_or_reason(
        path: &Path,
    ) -> Result<Result<Self, Unsupported>, TokenizeError> {
        let json = TokenizerSource::File(path.to_path_buf()).read()?;
        Self::from_tokenizer_json_str(&json, &path.display().to_string())
    }

    /// The fast path of the bundled tokenizer, from the copy embedded in the binary (not
    /// verified: see [`Self::verified_source`]).
    pub fn bundled() -> Result<Self, TokenizeError> {
        Self::from_tokenizer_json_str(BUNDLED_TOKENIZER_JSON, BUNDLED_TOKENIZER_NAME)?.map_err(
            |unsupported| TokenizeError::Load {
                origin: BUNDLED_TOKENIZER_NAME.into(),
                message: unsupported.to_string(),
            },
        )
    }

    /// As [`Self::from_tokenizer_json_or_reason`], from the text of a `tokenizer.json`;
    /// `origin` names it in errors.
    pub fn from_tokenizer_json_str(
        json: &str,
        origin: &str,
    ) -> Result<Result<Self, Unsupported>, TokenizeError> {
        let load_error = |message: String| TokenizeError::Load {
            origin: origin.to_string(),
            message,
        };
        let config: serde_json::Value =
            serde_json::from_str(json).map_err(|error| load_error(error.to_string()))?;
        match load::tables_from_config(&config) {
            Ok(tables) => Ok(Ok(Self::with_tables(
                Arc::new(tables),
                DEFAULT_CACHE_GENERATION_ENTRIES,
            ))),
            Err(Ok(unsupported)) => Ok(Err(unsupported)),
            Err(Err(message)) => Err(load_error(message)),
        }
    }

    fn with_tables(tables: Arc<Tables>, cache_generation_entries: usize) -> Self {
        let split_caches = tables
            .steps
            .iter()
            .map(|step| step.create_cache())
            .collect();
        Self {
            tables,
            cache: WordCache::new(cache_generation_entries),
            scratch: Scratch::default(),
            split_caches,
            added_tokens: None,
        }
    }

    /// Makes [`Self::encode`] split off the tokenizer's added and special tokens as HF does,
    /// taking their ids from `hf` (the same `tokenizer.json` loaded by HF: HF assigns added
    /// tokens their ids on load). Refused when a token uses `lstrip`, `rstrip` or `single_word`.
    pub fn with_added_tokens(mut self, hf: &Tokenizer) -> Result<Self, Unsupported> {
        let specs = self.tables.added_tokens.as_ref().map_err(Clone::clone)?;
        self.added_tokens = Some(Arc::new(AddedTokenMatcher::new(specs, hf)?));
        Ok(self)
    }

    /// Sets the entries per cache generation (at most twice this many are held) and empties
    /// the cache.
    pub fn with_cache_generation_entries(mut self, entries: usize) -> Self {
        self.cache = WordCache::new(entries);
        self
    }

    /// Words currently cached.
    pub fn cached_words(&self) -> usize {
        self.cache.len()
    }

    /// Empties the word cache (for cold-cache measurements).
    pub fn clear_cache(&mut self) {
        self.cache.clear();
    }

    /// Appends to `out` the ids HF's `encode(text, add_special_tokens = false)` gives. `text`
    /// must contain no added or special token (nor, for a token marked `normalized`, one once
    /// normalized): the caller splits those off first (HF would emit their ids where this
    /// tokenizes their text).
    pub fn encode_plain(&mut self, text: &str, out: &mut Vec<u32>) {
        match self.tables.normalizer {
            Some(normalizer) => self.encode_normalized(&normalizer.apply(text), out),
            None => self.encode_normalized(text, out),
        }
    }

    /// [`Self::encode_plain`] of a text already normalized.
    fn encode_normalized(&mut self, text: &str, out: &mut Vec<u32>) {
        let Self {
            tables,
            cache,
            scratch,
            split_caches,
            ..
        } = self;
        let tables: &Tables = tables;
        let mut encode_piece = |piece: &str| {
            if cache.extend_with(piece, out) {
                return;
            }
            let start = out.len();
            encode_word(tables, scratch, piece, out);
            cache.insert(piece, &out[start..]);
        };
        split_from(&tables.steps, split_caches, text, &mut encode_piece);
    }

    /// Appends to `out` the ids HF's `encode(text, add_special_tokens = false)` gives for any
    /// text, added tokens included, once [`Self::with_added_tokens`] attached them; before
    /// that, the same as [`Self::encode_plain`].
    pub fn encode(&mut self, text: &str, out: &mut Vec<u32>) {
        let Some(added_tokens) = self.added_tokens.clone() else {
            self.encode_plain(text, out);
            return;
        };
        let normalizer = self.tables.normalizer;
        added_tokens.segments(text, normalizer, &mut |segment| match segment {
            Segment::Token(id) => out.push(id),
            Segment::Plain(plain) => self.encode_normalized(plain, out),
        });
    }

    /// Compares with HF on `samples` (e.g. [`SELF_CHECK_CORPUS`]); the caller should refuse the
    /// fast path on a disagreement. Uses [`Self::encode`]: samples may contain added tokens
    /// only once they are attached.
    pub fn verify_against(&mut self, hf: &Tokenizer, samples: &[&str]) -> Result<(), Disagreement> {
        let mut fast = Vec::new();
        for (sample_index, sample) in samples.iter().enumerate() {
            fast.clear();
            self.encode(sample, &mut fast);
            let expected = hf.encode(sample, false).ok();
            if expected.as_deref() != Some(fast.as_slice()) {
                let first = |ids: &[u32]| ids.iter().take(16).copied().collect();
                return Err(Disagreement {
                    sample_index,
                    fast: first(&fast),
                    hf: expected.as_deref().map(first).unwrap_or_default(),
                });
            }
        }
        Ok(())
    }
}

/// Runs pre-tokenizer `steps` (with their `caches`) over `piece`, calling `emit` with each
/// final piece.
fn split_from(
    steps: &[pattern::SplitPattern],
    caches: &mut [pattern::SplitCache],
    piece: &str,
    emit: &mut dyn FnMut(&str),
) {
    match (steps.split_first(), caches.split_first_mut()) {
        (Some((step, later_steps)), Some((cache, later_caches))) => {
            step.split_isolated(cache, piece, &mut |sub_piece| {
                split_from(later_steps, later_caches, sub_piece, emit)
            })
        }
        _ => emit(piece),
    }
}

/// BPE of one pre-tokenized piece (given as its original text; byte-level mapping is implied
/// by starting from each byte's token id).
fn encode_word(tables: &Tables, scratch: &mut Scratch, piece: &str, out: &mut Vec<u32>) {
    if let Some(vocab) = &tables.vocab {
        let text = &mut scratch.byte_level_text;
        text.clear();
        text.extend(
            piece
                .bytes()
                .map(|byte| tables.byte_chars[usize::from(byte)]),
        );
        if let Some(id) = vocab.get(text.as_str()) {
            out.push(*id);
            return;
        }
    }
    let symbols = &mut scratch.symbols;
    symbols.clear();
    symbols.extend(piece.bytes().map(|byte| tables.byte_ids[usize::from(byte)]));
    tables.merges.merge_word(symbols);
    out.extend_from_slice(symbols);
}

#[cfg(test)]
mod tests;
