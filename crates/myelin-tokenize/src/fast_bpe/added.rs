//! Splitting added (and special) tokens off a text the way HF's `AddedVocabulary` does, so the
//! fast path can take whole rendered prompts. Only the matching lives here; the plain pieces
//! between tokens go through the usual pre-tokenizer and BPE.
//!
//! HF, for a normalizer that changes nothing: first the tokens marked `normalized: false` are
//! found in the text (Aho-Corasick, leftmost-longest, non-overlapping), then the tokens marked
//! `normalized: true` in each remaining gap. A found token becomes its id; `lstrip`, `rstrip`
//! and `single_word` change the boundaries, so tokens using them are not supported. The ids are
//! not the `id` fields of the file (HF recomputes them on load): they are asked from HF.

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

use super::load::Unsupported;
use crate::Tokenizer;

/// An added token as declared in `tokenizer.json`.
#[derive(Debug, Clone)]
pub(super) struct AddedTokenSpec {
    content: String,
    normalized: bool,
}

/// Reads `added_tokens`; refuses boundary-changing flags.
pub(super) fn added_token_specs(config: &Value) -> Result<Vec<AddedTokenSpec>, Unsupported> {
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

/// The two passes of HF's added-token extraction.
#[derive(Debug)]
pub(super) struct AddedTokenMatcher {
    passes: Vec<Pass>,
}

/// A run of text: an added token's id, or plain text to tokenize.
pub(super) enum Segment<'t> {
    Token(u32),
    Plain(&'t str),
}

impl AddedTokenMatcher {
    /// Builds the passes, asking `hf` for each token's id.
    pub(super) fn new(specs: &[AddedTokenSpec], hf: &Tokenizer) -> Result<Self, Unsupported> {
        let mut passes = Vec::with_capacity(2);
        for normalized in [false, true] {
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
                continue;
            }
            let automaton = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&patterns)
                .map_err(|error| Unsupported::AddedToken(error.to_string()))?;
            passes.push(Pass { automaton, ids });
        }
        Ok(Self { passes })
    }

    /// Calls `emit` with the segments of `text`, in order (empty plain runs skipped).
    pub(super) fn segments<'t>(&self, text: &'t str, emit: &mut dyn FnMut(Segment<'t>)) {
        self.segments_from(0, text, emit);
    }

    fn segments_from<'t>(&self, pass: usize, text: &'t str, emit: &mut dyn FnMut(Segment<'t>)) {
        let Some(current) = self.passes.get(pass) else {
            if !text.is_empty() {
                emit(Segment::Plain(text));
            }
            return;
        };
        let mut gap_start = 0;
        for found in current.automaton.find_iter(text) {
            self.segments_from(pass + 1, &text[gap_start..found.start()], emit);
            emit(Segment::Token(current.ids[found.pattern().as_usize()]));
            gap_start = found.end();
        }
        self.segments_from(pass + 1, &text[gap_start..], emit);
    }
}
