//! The token ids prompts are drawn from, and for text prompts the word each id stands for.
//!
//! Text prompts are made of words that the tokenizer keeps as one token each (a leading space
//! plus 3 to 8 lowercase ASCII letters, taken from the tokenizer's own vocabulary), so a prompt
//! of N words tokenizes to exactly N tokens (plus the tokenizer's special tokens) and the ids
//! the harness planned are the ids the engine computes.

use std::collections::HashMap;
use std::path::Path;

/// Byte-level BPE's printable stand-in for a leading space.
const BYTE_LEVEL_SPACE: char = '\u{0120}';

/// Token-id prompts draw from this range: ordinary BPE merges of the bundled tokenizer, well
/// away from its special tokens (ids below 3 and from 128,000 up).
pub const TOKEN_ID_RANGE: std::ops::Range<u32> = 1_000..100_000;

/// Why the text alphabet could not be built.
#[derive(Debug, thiserror::Error)]
pub enum AlphabetError {
    #[error("reading tokenizer {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("tokenizer {path} is not a BPE tokenizer.json with a model.vocab map: {problem}")]
    Format { path: String, problem: String },
    #[error("tokenizer {path} has only {found} single-token words; need at least 256")]
    TooFewWords { path: String, found: usize },
}

/// The ids prompts are drawn from.
#[derive(Debug, Clone)]
pub struct TokenAlphabet {
    ids: Vec<u32>,
    words: Option<HashMap<u32, String>>,
}

impl TokenAlphabet {
    /// Plain token ids, for token-id prompts.
    pub fn token_ids() -> Self {
        Self {
            ids: TOKEN_ID_RANGE.collect(),
            words: None,
        }
    }

    /// Single-token words from a HuggingFace tokenizer.json (byte-level BPE), for text prompts.
    pub fn words_from_tokenizer(path: &Path) -> Result<Self, AlphabetError> {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AlphabetError::Read {
            path: display.clone(),
            source,
        })?;
        let document: serde_json::Value =
            serde_json::from_str(&text).map_err(|error| AlphabetError::Format {
                path: display.clone(),
                problem: error.to_string(),
            })?;
        let vocab = document
            .get("model")
            .and_then(|model| model.get("vocab"))
            .and_then(|vocab| vocab.as_object())
            .ok_or_else(|| AlphabetError::Format {
                path: display.clone(),
                problem: "no model.vocab object".into(),
            })?;
        let mut words: Vec<(u32, String)> = vocab
            .iter()
            .filter_map(|(token, id)| {
                let word = token.strip_prefix(BYTE_LEVEL_SPACE)?;
                let plain = (3..=8).contains(&word.len())
                    && word.bytes().all(|byte| byte.is_ascii_lowercase());
                let id = u32::try_from(id.as_u64()?).ok()?;
                plain.then(|| (id, word.to_string()))
            })
            .collect();
        if words.len() < 256 {
            return Err(AlphabetError::TooFewWords {
                path: display,
                found: words.len(),
            });
        }
        words.sort_unstable();
        Ok(Self {
            ids: words.iter().map(|(id, _)| *id).collect(),
            words: Some(words.into_iter().collect()),
        })
    }

    /// The id picked by a draw.
    pub fn pick(&self, draw: u64) -> u32 {
        self.ids[(draw % self.ids.len() as u64) as usize]
    }

    /// The words of a text alphabet in id order (empty for a token-id alphabet).
    pub fn word_list(&self) -> Vec<String> {
        let Some(words) = &self.words else {
            return Vec::new();
        };
        self.ids
            .iter()
            .filter_map(|id| words.get(id).cloned())
            .collect()
    }

    /// Whether this alphabet can render text.
    pub fn has_words(&self) -> bool {
        self.words.is_some()
    }

    /// The text of a token sequence: each id's word with its leading space. Ids outside the
    /// alphabet render as nothing (they cannot occur in a planned prompt).
    pub fn render(&self, tokens: &[u32]) -> String {
        let Some(words) = &self.words else {
            return String::new();
        };
        let mut text = String::with_capacity(tokens.len() * 7);
        for token in tokens {
            if let Some(word) = words.get(token) {
                text.push(' ');
                text.push_str(word);
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundled_tokenizer() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/tokenizers/deepseek-v3/tokenizer.json")
    }

    #[test]
    fn token_id_alphabet_stays_in_range() {
        let alphabet = TokenAlphabet::token_ids();
        for draw in [0, 1, u64::MAX, 123_456_789] {
            assert!(TOKEN_ID_RANGE.contains(&alphabet.pick(draw)));
        }
        assert!(!alphabet.has_words());
    }

    #[test]
    fn text_prompts_tokenize_to_the_planned_ids() {
        let path = bundled_tokenizer();
        let alphabet = TokenAlphabet::words_from_tokenizer(&path).unwrap();
        let tokenizer = myelin_tokenize::Tokenizer::from_file(&path).unwrap();
        let planned: Vec<u32> = (0..2_000u64)
            .map(|index| alphabet.pick(crate::rng::draw(42, 9, index)))
            .collect();
        let text = alphabet.render(&planned);
        let encoded = tokenizer.encode(&text, true).unwrap();
        // The tokenizer may add special tokens (a BOS) in front: the planned ids must be the
        // rest, exactly.
        assert!(encoded.len() >= planned.len());
        assert_eq!(&encoded[encoded.len() - planned.len()..], &planned[..]);
    }
}
