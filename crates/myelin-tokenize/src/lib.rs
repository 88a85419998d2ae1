//! Tokenizer loading and chat-template rendering shared by the router, the simulated engine and
//! the harness, so all three compute the same token ids for the same request. No routing here.

pub mod fast_bpe;
mod template;

pub use fast_bpe::FastBpe;
pub use template::{ChatTemplate, TemplateError};

use std::path::{Path, PathBuf};

/// The bundled tokenizer, relative to the repository (or install) root.
pub const BUNDLED_TOKENIZER_RELATIVE: &str = "assets/tokenizers/deepseek-v3/tokenizer.json";

/// Environment variable naming the directory that holds `assets/` (for installed binaries).
pub const ASSETS_ROOT_ENV: &str = "MYELIN_HOME";

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The tokenizer file could not be read or parsed.
    #[error("cannot load tokenizer {path}: {message}")]
    Load {
        /// The file tried.
        path: PathBuf,
        /// What the tokenizers crate said.
        message: String,
    },
    /// No bundled tokenizer was found and none was given.
    #[error(
        "bundled tokenizer not found (looked for {BUNDLED_TOKENIZER_RELATIVE} under ${ASSETS_ROOT_ENV}, beside the executable and in the source tree); pass --tokenizer PATH"
    )]
    BundledMissing,
    /// Encoding failed.
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// Finds the bundled tokenizer: `$MYELIN_HOME/assets/...`, then beside the executable or any of
/// its ancestors (covers `target/debug/myelin` in a checkout), then the source tree it was
/// built from, then the working directory.
pub fn bundled_tokenizer_path() -> Result<PathBuf, TokenizeError> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(home) = std::env::var_os(ASSETS_ROOT_ENV) {
        roots.push(PathBuf::from(home));
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    roots.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    roots
        .into_iter()
        .map(|root| root.join(BUNDLED_TOKENIZER_RELATIVE))
        .find(|candidate| candidate.is_file())
        .ok_or(TokenizeError::BundledMissing)
}

/// A HuggingFace `tokenizer.json` tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let path = path.as_ref();
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|error| TokenizeError::Load {
                path: path.to_path_buf(),
                message: error.to_string(),
            })?;
        Ok(Self { inner })
    }

    /// Loads the bundled DeepSeek-V3 tokenizer.
    pub fn bundled() -> Result<Self, TokenizeError> {
        Self::from_file(bundled_tokenizer_path()?)
    }

    /// Token ids of `text`. `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (the BOS token): engines do so for `/v1/completions` prompts, not for rendered chats,
    /// whose template writes the BOS itself.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        // `encode_fast` skips character offsets, which routing never needs.
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|error| TokenizeError::Encode(error.to_string()))
    }

    /// The ids `encode(text, true)` puts before `text`'s own (usually the BOS), when that is
    /// all it adds (checked on a probe): then `prefix + encode(text, false)` equals
    /// `encode(text, true)`, so callers can tokenize the text by other means (segment
    /// caches, the fast path) and prepend these. `None` when special tokens do more.
    pub fn completion_prefix(&self) -> Option<Vec<u32>> {
        let prefix = self.encode("", true).ok()?;
        let probe = "Probe: the quick brown fox, 42 times.\n";
        let plain = self.encode(probe, false).ok()?;
        let with_special = self.encode(probe, true).ok()?;
        let mut expected = prefix.clone();
        expected.extend_from_slice(&plain);
        (expected == with_special).then_some(prefix)
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.inner
            .decode(ids, true)
            .map_err(|error| TokenizeError::Encode(error.to_string()))
    }

    /// Id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verified_fast_path_is_ready_for_chat_prompts_or_says_why_not() {
        let path = bundled_tokenizer_path().unwrap();
        let hf = Tokenizer::from_file(&path).unwrap();
        let mut fast = FastBpe::verified(&path, &hf).expect("the bundled tokenizer has one");
        assert_eq!(
            fast.cached_words(),
            0,
            "the self-check leaves no words behind"
        );
        let prompt = "<｜User｜>Hello, 12345 routers!<｜Assistant｜>";
        let mut ids = Vec::new();
        fast.encode(prompt, &mut ids);
        assert_eq!(ids, hf.encode(prompt, false).unwrap());
        let missing = std::path::Path::new("/nonexistent/tokenizer.json");
        assert!(matches!(
            FastBpe::verified(missing, &hf),
            Err(fast_bpe::FastPathRefused::Load(_))
        ));
    }

    #[test]
    fn completion_prefix_is_what_special_tokens_prepend() {
        let tokenizer = Tokenizer::bundled().expect("bundled tokenizer in the repo");
        // The bundled tokenizer.json's post-processor adds nothing; whatever it adds, the
        // prefix must be exactly that.
        let prefix = tokenizer.completion_prefix().expect("it only prepends");
        assert_eq!(prefix, tokenizer.encode("", true).unwrap());
        let text = "Once upon a time: 12 ships.";
        let mut expected = prefix;
        expected.extend(tokenizer.encode(text, false).unwrap());
        assert_eq!(tokenizer.encode(text, true).unwrap(), expected);
    }

    #[test]
    fn bundled_tokenizer_round_trips_text() {
        let tokenizer = Tokenizer::bundled().expect("bundled tokenizer in the repo");
        let text = "The quick brown fox jumps over the lazy dog. KV caches evict under pressure.";
        let ids = tokenizer.encode(text, false).expect("encode");
        assert!(
            ids.len() > 10 && ids.len() < text.len(),
            "{} ids",
            ids.len()
        );
        assert_eq!(tokenizer.decode(&ids).expect("decode"), text);
    }

    #[test]
    fn special_tokens_only_prepend() {
        let tokenizer = Tokenizer::bundled().expect("bundled tokenizer");
        let plain = tokenizer.encode("hello world", false).expect("encode");
        let special = tokenizer.encode("hello world", true).expect("encode");
        assert!(special.ends_with(&plain), "{special:?} vs {plain:?}");
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let error = Tokenizer::from_file("/nonexistent/tokenizer.json").expect_err("no file");
        assert!(error.to_string().contains("/nonexistent/tokenizer.json"));
    }
}
