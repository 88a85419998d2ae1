//! The normalizers the fast path reproduces (none, or HF's `NFC`), applied to each plain run of
//! text before it is split. Reading the configuration is in `load.rs`.
//!
//! `NFC` is computed by the crate HF's `NormalizedString::nfc` calls
//! (`unicode-normalization-alignments`, the one version in the lock file, Unicode 9 tables),
//! keeping the characters and dropping the alignments HF tracks beside them, so the text is the
//! same by construction; tests compare every code point and random texts with HF anyway. A newer
//! Unicode table (e.g. the `unicode-normalization` crate's) would differ on characters added
//! since Unicode 9.

use std::borrow::Cow;

use unicode_normalization_alignments::UnicodeNormalization;

/// A normalizer applied before pre-tokenization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Normalizer {
    /// Canonical composition (HF's `NFC`).
    Nfc,
}

impl Normalizer {
    /// `text` as HF's normalizer leaves it. ASCII text is returned as is: no canonical
    /// decomposition or composition involves only ASCII characters.
    pub(super) fn apply(self, text: &str) -> Cow<'_, str> {
        match self {
            Self::Nfc if text.is_ascii() => Cow::Borrowed(text),
            Self::Nfc => Cow::Owned(text.nfc().map(|(character, _)| character).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokenizers::{NormalizedString, Normalizer as _};

    use super::*;

    fn hf_nfc(text: &str) -> String {
        let mut normalized = NormalizedString::from(text);
        tokenizers::normalizers::NFC
            .normalize(&mut normalized)
            .expect("NFC cannot fail");
        normalized.get().to_owned()
    }

    /// Every code point, each followed by NUL (a starter that composes with nothing, so each
    /// is normalized as if alone), and every code point after `a`, `e\u{301}` and `\u{1100}`
    /// (so each is tried as the second half of a composition).
    #[test]
    fn nfc_equals_hfs_for_every_code_point() {
        for before in ["", "a", "e\u{301}", "\u{1100}", "\u{ac00}"] {
            let mut text = String::with_capacity(16 << 20);
            for character in (0..=0x10FFFFu32).filter_map(char::from_u32) {
                text.push_str(before);
                text.push(character);
                text.push('\0');
            }
            assert!(
                Normalizer::Nfc.apply(&text) == hf_nfc(&text),
                "after {before:?}"
            );
        }
    }

    /// Texts dense in marks of several combining classes, Hangul jamo and singletons.
    fn marked_text() -> impl Strategy<Value = String> {
        const PIECES: &[&str] = &[
            "a",
            "e",
            "o",
            "A",
            "u",
            "i",
            "ı",
            "\u{301}",
            "\u{300}",
            "\u{308}",
            "\u{323}",
            "\u{302}",
            "\u{327}",
            "\u{31b}",
            "\u{345}",
            "\u{5b0}",
            "\u{94d}",
            "\u{93c}",
            "\u{1100}",
            "\u{1161}",
            "\u{11a8}",
            "\u{ac00}",
            "\u{212b}",
            "\u{2126}",
            "\u{f900}",
            "\u{1e9b}",
            "\u{3b1}",
            "\u{3c9}",
            "\u{f}",
            "क",
            "ा",
            "\u{ccd}",
            "\u{cd5}",
            "\u{cbf}",
            "\u{11099}",
            "\u{110ba}",
            "\u{1d15e}",
            "\u{fb1d}",
            " ",
            "x",
        ];
        proptest::collection::vec(proptest::sample::select(PIECES), 0..24)
            .prop_map(|pieces| pieces.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn nfc_equals_hfs_on_marked_texts(text in marked_text()) {
            prop_assert_eq!(Normalizer::Nfc.apply(&text), hf_nfc(&text));
        }

        #[test]
        fn nfc_equals_hfs_on_arbitrary_strings(text in any::<String>()) {
            prop_assert_eq!(Normalizer::Nfc.apply(&text), hf_nfc(&text));
        }
    }

    #[test]
    fn nfc_composes_and_reorders() {
        assert_eq!(Normalizer::Nfc.apply("e\u{301}"), "\u{e9}");
        assert_eq!(Normalizer::Nfc.apply("a\u{323}\u{302}"), "\u{1ead}");
        assert_eq!(Normalizer::Nfc.apply("\u{1100}\u{1161}"), "\u{ac00}");
        assert_eq!(Normalizer::Nfc.apply("\u{212b}"), "\u{c5}");
        assert!(matches!(Normalizer::Nfc.apply("plain"), Cow::Borrowed(_)));
    }
}
