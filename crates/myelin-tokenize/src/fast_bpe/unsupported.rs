//! Why a tokenizer is left to the HuggingFace implementation: what reading it (`load.rs`) and
//! its added tokens (`added.rs`) refuse.

/// Why a tokenizer is left to the HuggingFace implementation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    /// A normalizer other than none, `NFC`, or a `Sequence` of at most one `NFC`.
    #[error("normalizer is not reproduced: {0}")]
    Normalizer(String),
    /// A pre-tokenizer other than `Split`s followed by `ByteLevel`.
    #[error("pre-tokenizer is not reproduced: {0}")]
    PreTokenizer(String),
    /// A `Split` regex the `regex` crate would not match exactly as onig does.
    #[error("split pattern {pattern:?} is not reproduced: {reason}")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// What about it.
        reason: String,
    },
    /// A model other than plain byte-level BPE.
    #[error("model is not reproduced: {0}")]
    Model(String),
    /// An added token HF matches in a way not reproduced (only for [`super::FastBpe::with_added_tokens`]).
    #[error("added token is not reproduced: {0}")]
    AddedToken(String),
    /// Truncation or padding would change the ids.
    #[error("truncation or padding is configured")]
    TruncationOrPadding,
}
