//! Splitting added (and special) tokens off a text the way HF's `AddedVocabulary` does, so the
//! fast path can take whole rendered prompts. Only the matching lives here; the plain pieces
//! between tokens go through the usual pre-tokenizer and BPE.
//!
//! HF first finds the tokens marked `normalized: false` in the raw text (Aho-Corasick,
//! leftmost-longest, non-overlapping), then normalizes each remaining gap on its own and finds
//! the tokens marked `normalized: true` in the normalized gap; the plain runs left are already
//! normalized and go straight to the pre-tokenizer. A found token becomes its id; `lstrip`,
//! `rstrip` and `single_word` change the boundaries, so tokens using them are not supported.
//! The ids are not the `id` fields of the file (HF recomputes them on load): they are asked
//! from HF.

use std::borrow::Cow;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

use super::normalize::Normalizer;
use super::unsupported::Unsupported;
use crate::Tokenizer;

/// An added token as declared in `tokenizer.json`.
#[derive(Debug, Clone)]
pub(crate) struct AddedTokenSpec {
    pub(crate) content: String,
    /// Matched in normalized text (HF's default: `!special`).
    pub(crate) normalized: bool,
    /// Its `id` field (the fast path asks HF instead; the routing split uses it).
    pub(crate) id: Option<u32>,
}

/// Reads `added_tokens` (empty contents skipped); refuses boundary-changing flags. The one
/// reading of them: the fast path's matcher and the routing split
/// ([`crate::route::AddedTokens`]) share it.
pub(crate) fn added_token_specs(config: &Value) -> Result<Vec<AddedTokenSpec>, Unsupported> {
    let Some(tokens) = config.get("added_tokens").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    let mut specs = Vec::with_capacity(tokens.len());
    for token in tokens {
        let flag = |key: &str| token.get(key).and_then(Value::as_bool).unwrap_or(false);
        let Some(content) = token.get("content").and_then(Value::as_str) else {
            return Err(Unsupported::AddedToken(
                "an added token without content".into(),
            ));
        };
        if flag("lstrip") || flag("rstrip") || flag("single_word") {
            return Err(Unsupported::AddedToken(format!(
                "{content:?} uses lstrip, rstrip or single_word"
            )));
        }
        if !content.is_empty() {
            specs.push(AddedTokenSpec {
                content: content.to_owned(),
                // HF's default for `normalized` is `!special`.
                normalized: token
                    .get("normalized")
                    .and_then(Value::as_bool)
                    .unwrap_or(!flag("special")),
                id: token
                    .get("id")
                    .and_then(Value::as_u64)
                    .and_then(|id| u32::try_from(id).ok()),
            });
        }
    }
    Ok(specs)
}

/// One Aho-Corasick pass and the id of each pattern.
#[derive(Debug)]
struct Pass {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

/// The two passes of HF's added-token extraction (absent when no token is in a pass).
#[derive(Debug)]
pub(super) struct AddedTokenMatcher {
    /// Tokens matched in the raw text.
    unnormalized: Option<Pass>,
    /// Tokens matched in the normalized gaps.
    normalized: Option<Pass>,
}

/// A run of text: an added token's id, or plain, normalized text to pre-tokenize.
pub(super) enum Segment<'t> {
    Token(u32),
    Plain(&'t str),
}

impl AddedTokenMatcher {
    /// Builds the passes, asking `hf` for each token's id.
    pub(super) fn new(specs: &[AddedTokenSpec], hf: &Tokenizer) -> Result<Self, Unsupported> {
        let pass = |normalized: bool| -> Result<Option<Pass>, Unsupported> {
            let mut patterns = Vec::new();
            let mut ids = Vec::new();
            for spec in specs.iter().filter(|spec| spec.normalized == normalized) {
                let id = hf.token_to_id(&spec.content).ok_or_else(|| {
                    Unsupported::AddedToken(format!("{:?} has no id in HF", spec.content))
                })?;
                patterns.push(spec.content.as_str());
                ids.push(id);
            }
            if patterns.is_empty() {
                return Ok(None);
            }
            let automaton = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&patterns)
                .map_err(|error| Unsupported::AddedToken(error.to_string()))?;
            Ok(Some(Pass { automaton, ids }))
        };
        Ok(Self {
            unnormalized: pass(false)?,
            normalized: pass(true)?,
        })
    }

    /// Calls `emit` with the segments of `text`, in order (empty plain runs skipped), plain
    /// runs normalized by `normalizer`.
    pub(super) fn segments(
        &self,
        text: &str,
        normalizer: Option<Normalizer>,
        emit: &mut dyn FnMut(Segment<'_>),
    ) {
        split_with(
            self.unnormalized.as_ref(),
            text,
            &mut |segment| match segment {
                Segment::Token(id) => emit(Segment::Token(id)),
                Segment::Plain(gap) => {
                    let gap = match normalizer {
                        Some(normalizer) => normalizer.apply(gap),
                        None => Cow::Borrowed(gap),
                    };
                    split_with(self.normalized.as_ref(), &gap, emit);
                }
            },
        );
    }
}

/// Splits `text` on the tokens of `pass` (none: `text` is one plain run).
fn split_with(pass: Option<&Pass>, text: &str, emit: &mut dyn FnMut(Segment<'_>)) {
    let mut gap_start = 0;
    if let Some(pass) = pass {
        for found in pass.automaton.find_iter(text) {
            if found.start() > gap_start {
                emit(Segment::Plain(&text[gap_start..found.start()]));
            }
            emit(Segment::Token(pass.ids[found.pattern().as_usize()]));
            gap_start = found.end();
        }
    }
    if gap_start < text.len() {
        emit(Segment::Plain(&text[gap_start..]));
    }
}
