//! Tokenizer loading and chat-template rendering shared by the router, the simulated engine and
//! the harness, so all three compute the same token ids for the same request. No routing here.

pub mod fast_bpe;
pub mod route;
mod template;

pub use fast_bpe::FastBpe;
pub use template::{ChatTemplate, TemplateError};

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The bundled tokenizer, relative to the repository root (where it is embedded from).
pub const BUNDLED_TOKENIZER_RELATIVE: &str = "assets/tokenizers/deepseek-v3/tokenizer.json";

/// The bundled DeepSeek-V3 `tokenizer.json`, embedded in every binary that links this crate:
/// the default tokenizer of `myelin serve`, `myelin sim` and `myelin bench`, so a copied binary
/// needs no assets beside it.
pub const BUNDLED_TOKENIZER_JSON: &str =
    include_str!("../../../assets/tokenizers/deepseek-v3/tokenizer.json");

/// The license of [`BUNDLED_TOKENIZER_JSON`] (MIT, DeepSeek), embedded with it; printed by
/// `myelin --licenses`.
pub const BUNDLED_TOKENIZER_LICENSE: &str =
    include_str!("../../../assets/tokenizers/deepseek-v3/LICENSE");

/// How the bundled tokenizer is named in messages.
pub const BUNDLED_TOKENIZER_NAME: &str = "bundled DeepSeek-V3 tokenizer (embedded)";

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The tokenizer could not be read or parsed.
    #[error("cannot load tokenizer {origin}: {message}")]
    Load {
        /// The file tried, or [`BUNDLED_TOKENIZER_NAME`].
        origin: String,
        /// What the tokenizers crate said.
        message: String,
    },
    /// The embedded tokenizer could not be given a path (see [`bundled_tokenizer_path`]).
    #[error(
        "the bundled tokenizer could not be exposed as a file (no memfd, no {BUNDLED_TOKENIZER_RELATIVE} in the source tree); pass --tokenizer PATH"
    )]
    BundledMissing,
    /// Encoding failed.
    #[error("tokenization failed: {0}")]
    Encode(String),
}

/// Where a `tokenizer.json` comes from: the copy embedded in the binary, or a file
/// (`--tokenizer PATH`), read from disk when loaded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenizerSource {
    /// [`BUNDLED_TOKENIZER_JSON`].
    #[default]
    Bundled,
    /// A `tokenizer.json` on disk.
    File(PathBuf),
}

impl TokenizerSource {
    /// `path`, or the bundled tokenizer when there is none.
    pub fn from_option(path: Option<&Path>) -> Self {
        path.map_or(Self::Bundled, |path| Self::File(path.to_path_buf()))
    }

    /// The file, when it is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Bundled => None,
            Self::File(path) => Some(path),
        }
    }

    /// The JSON text: borrowed from the binary, or read from the file.
    pub fn read(&self) -> Result<Cow<'static, str>, TokenizeError> {
        match self {
            Self::Bundled => Ok(Cow::Borrowed(BUNDLED_TOKENIZER_JSON)),
            Self::File(path) => std::fs::read_to_string(path)
                .map(Cow::Owned)
                .map_err(|error| TokenizeError::Load {
                    origin: path.display().to_string(),
                    message: error.to_string(),
                }),
        }
    }
}

impl std::fmt::Display for TokenizerSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bundled => f.write_str(BUNDLED_TOKENIZER_NAME),
            Self::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A path naming a file that holds [`BUNDLED_TOKENIZER_JSON`], for code that only reads
/// tokenizers from files. On Linux: an anonymous in-memory file (memfd, created once per
/// process, named `/proc/self/fd/N`, so the path is valid in this process only and nothing is
/// written to disk). Elsewhere, or where no memfd can be made: the copy in the source tree the
/// binary was built from, if it is still there. Loaders of the default tokenizer should use
/// [`TokenizerSource::Bundled`] (or [`Tokenizer::bundled`]) instead.
pub fn bundled_tokenizer_path() -> Result<PathBuf, TokenizeError> {
    static PATH: OnceLock<Option<PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| {
        memory_file(
            c"myelin-bundled-tokenizer.json",
            BUNDLED_TOKENIZER_JSON.as_bytes(),
        )
        .or_else(|| {
            let in_source_tree = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(BUNDLED_TOKENIZER_RELATIVE);
            in_source_tree.is_file().then_some(in_source_tree)
        })
    })
    .clone()
    .ok_or(TokenizeError::BundledMissing)
}

/// An in-memory file holding `bytes`, kept open for the life of the process.
#[cfg(target_os = "linux")]
fn memory_file(name: &std::ffi::CStr, bytes: &[u8]) -> Option<PathBuf> {
    use std::io::Write;
    use std::os::fd::{FromRawFd, IntoRawFd};
    // SAFETY: memfd_create(2) with a NUL-terminated name; a non-negative result is a new file
    // descriptor that nothing else owns, handed to `File` at once.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is open and owned by nobody else (above).
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes).ok()?;
    let path = PathBuf::from(format!("/proc/self/fd/{fd}"));
    // Reopening through /proc needs procfs: check, or fall back.
    let readable = std::fs::metadata(&path).is_ok_and(|meta| meta.len() == bytes.len() as u64);
    if !readable {
        return None;
    }
    // Never closed: the path must stay valid for as long as the process runs.
    let _ = file.into_raw_fd();
    Some(path)
}

#[cfg(not(target_os = "linux"))]
fn memory_file(_name: &std::ffi::CStr, _bytes: &[u8]) -> Option<PathBuf> {
    None
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
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let path = path.as_ref();
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|error| TokenizeError::Load {
                origin: path.display().to_string(),
                message: error.to_string(),
            })?;
        Ok(Self { inner })
    }

    /// Parses the text of a `tokenizer.json`; `origin` names it in errors.
    pub fn from_json(json: &str, origin: &str) -> Result<Self, TokenizeError> {
        let inner: tokenizers::Tokenizer =
            json.parse()
                .map_err(|error: tokenizers::Error| TokenizeError::Load {
                    origin: origin.to_string(),
                    message: error.to_string(),
                })?;
        Ok(Self { inner })
    }

    /// Loads the bundled DeepSeek-V3 tokenizer from the copy embedded in the binary.
    pub fn bundled() -> Result<Self, TokenizeError> {
        Self::from_json(BUNDLED_TOKENIZER_JSON, BUNDLED_TOKENIZER_NAME)
    }

    /// Loads the tokenizer of `source`.
    pub fn load(source: &TokenizerSource) -> Result<Self, TokenizeError> {
        match source {
            TokenizerSource::Bundled => Self::bundled(),
            TokenizerSource::File(path) => Self::from_file(path),
        }
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
    fn the_embedded_tokenizer_is_the_one_in_the_source_tree() {
        let in_tree = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(BUNDLED_TOKENIZER_RELATIVE);
        let text = std::fs::read_to_string(in_tree).expect("source tree copy");
        assert!(text == BUNDLED_TOKENIZER_JSON, "assets/ changed: rebuild");
        assert!(BUNDLED_TOKENIZER_LICENSE.contains("MIT License"));
    }

    #[test]
    fn bundled_tokenizer_path_names_the_embedded_copy() {
        let path = bundled_tokenizer_path().expect("a path");
        let text = std::fs::read_to_string(&path).expect("readable");
        assert!(text == BUNDLED_TOKENIZER_JSON, "{} differs", path.display());
        assert_eq!(
            bundled_tokenizer_path().unwrap(),
            path,
            "made once per process"
        );
        #[cfg(target_os = "linux")]
        assert!(path.starts_with("/proc/self/fd"), "{}", path.display());
    }

    #[test]
    fn bundled_and_file_sources_give_the_same_tokenizer_and_fast_path() {
        let file = TokenizerSource::File(bundled_tokenizer_path().unwrap());
        let bundled = TokenizerSource::from_option(None);
        assert_eq!(bundled, TokenizerSource::Bundled);
        assert_eq!(bundled.to_string(), BUNDLED_TOKENIZER_NAME);
        let prompt = "<｜User｜>Route 42 prompts, please.<｜Assistant｜>";
        let mut ids = Vec::new();
        for source in [&bundled, &file] {
            let hf = Tokenizer::load(source).expect("loads");
            let mut fast = FastBpe::verified_source(source, &hf).expect("fast path");
            let mut fast_ids = Vec::new();
            fast.encode(prompt, &mut fast_ids);
            assert_eq!(fast_ids, hf.encode(prompt, false).unwrap());
            ids.push(fast_ids);
        }
        assert_eq!(ids[0], ids[1]);
        let mut unverified = Vec::new();
        FastBpe::bundled()
            .expect("supported")
            .encode_plain("Route 42 prompts, please.", &mut unverified);
        assert_eq!(
            unverified,
            Tokenizer::bundled()
                .unwrap()
                .encode("Route 42 prompts, please.", false)
                .unwrap()
        );
        let missing = TokenizerSource::File("/nonexistent/tokenizer.json".into());
        let error = Tokenizer::load(&missing).expect_err("no file");
        assert!(
            error.to_string().contains("/nonexistent/tokenizer.json"),
            "{error}"
        );
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let error = Tokenizer::from_file("/nonexistent/tokenizer.json").expect_err("no file");
        assert!(error.to_string().contains("/nonexistent/tokenizer.json"));
    }
}
