//! The fast byte-level BPE path against the HuggingFace tokenizer on the bundled DeepSeek-V3
//! tokenizer and on edited copies of it (among them Llama 3's and Qwen 2's pre-tokenizers, with
//! `(?i:...)`, `ignore_merges` and `NFC`): same ids on a fixed corpus, on random mixed-script
//! texts and on arbitrary strings; unsupported configurations refused; character classes equal
//! to onig's for every code point.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use myelin_tokenize::fast_bpe::{FastBpe, SELF_CHECK_CORPUS, Unsupported};
use myelin_tokenize::{Tokenizer, bundled_tokenizer_path};
use proptest::prelude::*;
use serde_json::{Value, json};

struct Fixture {
    hf: Tokenizer,
    fast: Mutex<FastBpe>,
    /// The same with the added tokens attached, for whole prompts.
    fast_with_added: Mutex<FastBpe>,
    /// Contents of the added tokens: texts containing one are outside `encode_plain`'s contract.
    added_tokens: Vec<String>,
}

fn bundled_config() -> &'static Value {
    static CONFIG: OnceLock<Value> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let text = std::fs::read_to_string(bundled_tokenizer_path().expect("bundled tokenizer"))
            .expect("readable");
        serde_json::from_str(&text).expect("json")
    })
}

fn added_tokens(config: &Value) -> Vec<String> {
    config["added_tokens"]
        .as_array()
        .expect("added tokens")
        .iter()
        .filter_map(|token| token["content"].as_str().map(str::to_owned))
        .collect()
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path = bundled_tokenizer_path().expect("bundled tokenizer");
        let hf = Tokenizer::from_file(&path).expect("hf loads");
        let fast = FastBpe::from_tokenizer_json(&path)
            .expect("readable")
            .expect("the bundled tokenizer is supported");
        let fast_with_added = fast
            .clone()
            .with_added_tokens(&hf)
            .expect("the bundled added tokens are supported");
        Fixture {
            hf,
            fast: Mutex::new(fast),
            fast_with_added: Mutex::new(fast_with_added),
            added_tokens: added_tokens(bundled_config()),
        }
    })
}

/// A fixture for an edited copy of the bundled tokenizer.
struct Variant {
    hf: Tokenizer,
    fast: FastBpe,
}

fn write_variant(name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut config = bundled_config().clone();
    edit(&mut config);
    let directory =
        std::env::temp_dir().join(format!("myelin-fast-bpe-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&directory).expect("temp dir");
    let path = directory.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&config).expect("serialize")).expect("write");
    path
}

fn load_variant(path: &Path) -> Result<Variant, Unsupported> {
    let fast = FastBpe::from_tokenizer_json_or_reason(path).expect("readable")?;
    let hf = Tokenizer::from_file(path).expect("hf loads the variant");
    Ok(Variant { hf, fast })
}

fn remove_variant(path: &Path) {
    if let Some(directory) = path.parent() {
        let _ = std::fs::remove_dir_all(directory);
    }
}

fn fast_ids(fast: &mut FastBpe, text: &str) -> Vec<u32> {
    let mut ids = Vec::new();
    fast.encode_plain(text, &mut ids);
    ids
}

fn assert_same(hf: &Tokenizer, fast: &mut FastBpe, text: &str) {
    let expected = hf.encode(text, false).expect("hf encodes");
    assert_eq!(fast_ids(fast, text), expected, "text {text:?}");
}

/// Cases beyond the self-check corpus, aimed at the look-ahead emulation and the splits.
const EDGE_CASES: &[&str] = &[
    "a  b",
    "a   b",
    "a \u{3000}b",
    "a\u{3000}\u{3000}b",
    "x \t y",
    "x\t\t\ty",
    "end  ",
    "  start",
    "  \n  x",
    "!!!\n\n",
    "!!! \n  \n",
    "'s 't 're 've 'm 'll 'd 'S 'T",
    ".Hello $x @y #z _w",
    "1234567 3.14 12345678901 ٣٤٥٦ １２３４",
    "abc123def4567g",
    "中文123日本語abcカタカナ",
    "   中文",
    "word\u{85}word\u{85} \u{85}x",
    "\u{1c}\u{1d}\u{1e}\u{1f} x \u{180e}y\u{200b} z",
    "\r\n\r\n  \r\n\tfoo",
    " \r \n x",
];

#[test]
fn self_check_corpus_matches_hf() {
    let fixture = fixture();
    let mut fast = fixture.fast.lock().expect("lock").clone();
    fast.verify_against(&fixture.hf, SELF_CHECK_CORPUS)
        .expect("the built-in corpus agrees");
    fast.verify_against(&fixture.hf, EDGE_CASES)
        .expect("the edge cases agree");
    for text in SELF_CHECK_CORPUS.iter().chain(EDGE_CASES) {
        assert_same(&fixture.hf, &mut fast, text);
    }
    // The same texts again hit the cache; and all of them in one text.
    let joined = SELF_CHECK_CORPUS.concat() + &EDGE_CASES.concat();
    assert_same(&fixture.hf, &mut fast, &joined);
    assert!(fast.cached_words() > 100, "{} cached", fast.cached_words());
}

#[test]
fn long_words_use_the_heap_and_still_match() {
    let fixture = fixture();
    let mut fast = fixture.fast.lock().expect("lock").clone();
    for text in [
        "a".repeat(300),
        "ab".repeat(200),
        "Donaudampfschifffahrtsgesellschaftskapitän".repeat(8),
        " ".repeat(500) + "x",
        "中".repeat(120),
        "!?".repeat(150),
        "\u{301}".repeat(90),
    ] {
        assert_same(&fixture.hf, &mut fast, &text);
    }
}

#[test]
fn disagreement_is_reported() {
    // A tokenizer with the GPT-2 pattern disagrees with the bundled one on digit runs, so
    // `verify_against` must notice when checked against the wrong HF tokenizer.
    let path = write_variant("wrong-hf", |config| {
        config["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": true});
    });
    let mut other = load_variant(&path).expect("supported");
    remove_variant(&path);
    let fixture = fixture();
    let disagreement = other
        .fast
        .verify_against(&fixture.hf, &["numbers 1234567 here"])
        .expect_err("different pre-tokenizers give different ids");
    assert_eq!(disagreement.sample_index, 0);
}

#[test]
fn word_cache_stays_bounded() {
    let fixture = fixture();
    let mut fast = fixture
        .fast
        .lock()
        .expect("lock")
        .clone()
        .with_cache_generation_entries(16);
    let text: String = (0..400).map(|word| format!(" w{word}x")).collect();
    assert_same(&fixture.hf, &mut fast, &text);
    assert!(fast.cached_words() <= 32, "{} cached", fast.cached_words());
    assert!(fast.cached_words() >= 16, "{} cached", fast.cached_words());
    // Evicted words are recomputed to the same ids.
    assert_same(&fixture.hf, &mut fast, &text);
    fast.clear_cache();
    assert_eq!(fast.cached_words(), 0);
}

#[test]
fn unsupported_configurations_are_refused() {
    type Edit = fn(&mut Value);
    let cases: &[(&str, Edit)] = &[
        ("normalizer", |config| {
            config["normalizer"] = json!({"type": "NFKC"});
        }),
        ("normalizer-sequence", |config| {
            config["normalizer"] = json!({"type": "Sequence",
                "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]});
        }),
        ("removed", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["behavior"] = json!("Removed");
        }),
        ("inverted", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["invert"] = json!(true);
        }),
        ("lookbehind", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["pattern"] =
                json!({"Regex": "(?<=a)\\p{N}{1,3}"});
        }),
        ("lookahead-elsewhere", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["pattern"] =
                json!({"Regex": "\\p{N}{1,3}(?!x)|\\s+"});
        }),
        ("case-insensitive-multi-character-fold", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["pattern"] =
                json!({"Regex": "(?i:'s|'st)|\\p{N}{1,3}"});
        }),
        ("case-insensitive-class", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["pattern"] =
                json!({"Regex": "(?i:[a-z]+)|\\p{N}{1,3}"});
        }),
        ("case-insensitive-everywhere", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["pattern"] =
                json!({"Regex": "(?i)'s|\\p{N}{1,3}"});
        }),
        ("digit-class", |config| {
            config["pre_tokenizer"]["pretokenizers"][0]["pattern"] = json!({"Regex": "\\d{1,3}"});
        }),
        ("prefix-space", |config| {
            config["pre_tokenizer"]["pretokenizers"][3]["add_prefix_space"] = json!(true);
        }),
        ("no-byte-level", |config| {
            config["pre_tokenizer"]["pretokenizers"]
                .as_array_mut()
                .expect("steps")
                .pop();
        }),
        ("dropout", |config| {
            config["model"]["dropout"] = json!(0.1);
        }),
        ("byte-fallback", |config| {
            config["model"]["byte_fallback"] = json!(true);
        }),
        ("suffix", |config| {
            config["model"]["end_of_word_suffix"] = json!("</w>");
        }),
        ("rstrip", |config| {
            config["added_tokens"][0]["rstrip"] = json!(true);
        }),
        ("truncation", |config| {
            config["truncation"] = json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0});
        }),
    ];
    for (name, edit) in cases {
        let path = write_variant(name, *edit);
        let loaded = FastBpe::from_tokenizer_json_or_reason(&path).expect("readable");
        let loaded = match (loaded, *name) {
            // Added-token flags only matter once the added tokens are attached.
            (Ok(fast), "rstrip") => {
                let hf = Tokenizer::from_file(&path).expect("hf loads");
                fast.with_added_tokens(&hf)
            }
            (loaded, _) => loaded,
        };
        remove_variant(&path);
        match loaded {
            Ok(_) => panic!("{name}: accepted"),
            Err(reason) => assert!(!reason.to_string().is_empty(), "{name}"),
        }
    }
}

#[test]
fn malformed_files_are_errors() {
    assert!(FastBpe::from_tokenizer_json(Path::new("/nonexistent/tokenizer.json")).is_err());
    let path = write_variant("bad-merge", |config| {
        config["model"]["merges"][0] = json!("Ġ t extra");
    });
    let loaded = FastBpe::from_tokenizer_json(&path);
    remove_variant(&path);
    assert!(loaded.is_err());
}

/// Supported variants: GPT-2's pattern via a lone `ByteLevel`, `ignore_merges`, pair-format
/// merges and a literal `Split`.
#[test]
fn supported_variants_match_hf() {
    type Edit = fn(&mut Value);
    let cases: &[(&str, Edit)] = &[
        ("gpt2", |config| {
            config["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true});
            config["normalizer"] = Value::Null;
        }),
        ("ignore-merges", |config| {
            config["model"]["ignore_merges"] = json!(true);
        }),
        ("pair-merges", |config| {
            let merges = config["model"]["merges"].as_array_mut().expect("merges");
            for merge in merges.iter_mut() {
                let text = merge.as_str().expect("legacy merge").to_owned();
                let (left, right) = text.split_once(' ').expect("two parts");
                *merge = json!([left, right]);
            }
        }),
        ("literal-split", |config| {
            let steps = config["pre_tokenizer"]["pretokenizers"]
                .as_array_mut()
                .expect("steps");
            steps.insert(
                0,
                json!({"type": "Split", "pattern": {"String": "::"}, "behavior": "Isolated",
                    "invert": false}),
            );
        }),
    ];
    let texts: Vec<&str> = SELF_CHECK_CORPUS
        .iter()
        .chain(EDGE_CASES)
        .copied()
        .chain([
            "std::vec::Vec::new()",
            "Hellohello worldly",
            "aaaaaaaaaaaaaaaaaaaa",
        ])
        .collect();
    for (name, edit) in cases {
        let path = write_variant(name, *edit);
        let loaded = load_variant(&path);
        remove_variant(&path);
        let mut variant = loaded.unwrap_or_else(|reason| panic!("{name}: {reason}"));
        for text in &texts {
            let expected = variant.hf.encode(text, false).expect("hf encodes");
            assert_eq!(
                fast_ids(&mut variant.fast, text),
                expected,
                "{name}: {text:?}"
            );
        }
    }
}

/// Llama 3's pre-tokenizer regex (its `tokenizer.json` has no normalizer and `ignore_merges`).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2 / 2.5's pre-tokenizer regex (after an `NFC` normalizer).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Case variants of contractions (and the characters onig folds to their letters or not) and
/// texts `NFC` changes.
const CASE_AND_NFC_CASES: &[&str] = &[
    "IT'S I'M YOU'RE WE'VE THEY'LL HE'D DON'T",
    "it'S i'M you'Re we'vE they'Ll he'D don'T",
    "x'ſ x'\u{212a} x'K x'k x'ß x'ẞ x'ﬅ x'ﬆ x'ss x'st",
    "'ı 'İ 'i\u{307} 'ς 'Σ 'σ 'ǅ 'ǆ 'Ǆ",
    "ſtraße STRASSE ﬁle ﬂow Kelvin \u{212a}elvin",
    "'s'S'ſ'' 't'",
    "e\u{301}cole \u{212b}ngstr\u{f6}m a\u{323}\u{302} \u{1100}\u{1161}\u{11a8} \u{2126}",
    "'\u{301}s 's\u{301} 'S\u{307}",
    // A contraction is its own piece only when a letter follows; otherwise the letter run
    // alternative takes the same characters.
    "'ſt 'ſa 'Ss 'Sx 'ſſ he'ſd 'LLama 'REal 'vEry 'Mr 'Dr 'Tx '\u{212a}x 'ßx 'ﬅx 'ıx 'İx",
];

/// A pre-tokenizer of one `Split` step before a regex-less `ByteLevel`.
fn set_single_split(config: &mut Value, pattern: &str) {
    config["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
}

/// A supported edited copy of the bundled tokenizer, shared by the tests.
struct SharedVariant {
    hf: Tokenizer,
    fast: Mutex<FastBpe>,
    fast_with_added: Mutex<FastBpe>,
}

fn shared_variant(name: &str, edit: impl FnOnce(&mut Value)) -> SharedVariant {
    let path = write_variant(name, edit);
    let loaded = load_variant(&path);
    remove_variant(&path);
    let Variant { hf, fast } = loaded.unwrap_or_else(|reason| panic!("{name}: {reason}"));
    let fast_with_added = fast
        .clone()
        .with_added_tokens(&hf)
        .unwrap_or_else(|reason| panic!("{name}: {reason}"));
    SharedVariant {
        hf,
        fast: Mutex::new(fast),
        fast_with_added: Mutex::new(fast_with_added),
    }
}

/// Llama 3's pre-tokenizer and `ignore_merges` on the bundled vocabulary.
fn llama3() -> &'static SharedVariant {
    static VARIANT: OnceLock<SharedVariant> = OnceLock::new();
    VARIANT.get_or_init(|| {
        shared_variant("llama3", |config| {
            set_single_split(config, LLAMA3_PATTERN);
            config["normalizer"] = Value::Null;
            config["model"]["ignore_merges"] = json!(true);
        })
    })
}

/// Qwen 2's normalizer and pre-tokenizer on the bundled vocabulary.
fn qwen2() -> &'static SharedVariant {
    static VARIANT: OnceLock<SharedVariant> = OnceLock::new();
    VARIANT.get_or_init(|| {
        shared_variant("qwen2", |config| {
            set_single_split(config, QWEN2_PATTERN);
            config["normalizer"] = json!({"type": "NFC"});
        })
    })
}

/// `text` through `encode_plain` (unless it holds an added token) and through `encode`.
fn check_variant(variant: &SharedVariant, text: &str) -> Result<(), TestCaseError> {
    let expected = variant.hf.encode(text, false).expect("hf encodes");
    let holds_added_token = fixture()
        .added_tokens
        .iter()
        .any(|token| text.contains(token.as_str()));
    if !holds_added_token {
        let mut fast = variant.fast.lock().expect("lock");
        prop_assert_eq!(&fast_ids(&mut fast, text), &expected, "plain {:?}", text);
    }
    let mut ids = Vec::new();
    variant
        .fast_with_added
        .lock()
        .expect("lock")
        .encode(text, &mut ids);
    prop_assert_eq!(ids, expected, "with added tokens {:?}", text);
    Ok(())
}

#[test]
fn llama3_and_qwen2_variants_match_hf_on_the_corpus() {
    let texts = SELF_CHECK_CORPUS
        .iter()
        .chain(EDGE_CASES)
        .chain(CASE_AND_NFC_CASES);
    for (name, variant) in [("llama3", llama3()), ("qwen2", qwen2())] {
        for text in texts.clone() {
            if let Err(error) = check_variant(variant, text) {
                panic!("{name}: {error}");
            }
        }
        let joined: String = texts.clone().copied().collect();
        if let Err(error) = check_variant(variant, &joined) {
            panic!("{name}: {error}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn llama3_matches_hf_on_mixed_texts(text in mixed_text()) {
        check_variant(llama3(), &text)?;
    }

    #[test]
    fn qwen2_matches_hf_on_mixed_texts(text in mixed_text()) {
        check_variant(qwen2(), &text)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn llama3_and_qwen2_match_hf_on_arbitrary_strings(text in any::<String>()) {
        check_variant(llama3(), &text)?;
        check_variant(qwen2(), &text)?;
    }

    #[test]
    fn llama3_and_qwen2_match_hf_on_prompts(text in prompt_text()) {
        check_variant(llama3(), &text)?;
        check_variant(qwen2(), &text)?;
    }
}

/// Every code point, for each class the bundled and GPT-2 patterns use: onig (what HF runs)
/// and `regex` (what the fast path runs) must match the same characters.
#[test]
fn character_classes_equal_onigs_for_every_code_point() {
    let all_chars: String = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
    let classes = [
        r"\s",
        r"\p{L}",
        r"\p{N}",
        r"\p{P}",
        r"\p{S}",
        r"\p{M}",
        r"[\p{L}\p{M}]",
        r"[^\r\n\p{L}\p{P}\p{S}]",
        r"[^\s\p{L}\p{N}]",
        "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]",
        r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"##,
        r"[A-Za-z]",
        r"[^\r\n\p{L}\p{N}]",
        r"[\r\n]",
    ];
    for class in classes {
        let onig = tokenizers::utils::SysRegex::new(class).expect("onig compiles");
        let fast = regex::Regex::new(class).expect("regex compiles");
        let by_onig: Vec<(usize, usize)> = onig.find_iter(&all_chars).collect();
        let by_regex: Vec<(usize, usize)> = fast
            .find_iter(&all_chars)
            .map(|found| (found.start(), found.end()))
            .collect();
        if by_onig != by_regex {
            let onig_set: std::collections::HashSet<_> = by_onig.iter().collect();
            let regex_set: std::collections::HashSet<_> = by_regex.iter().collect();
            let differing: Vec<String> = onig_set
                .symmetric_difference(&regex_set)
                .take(10)
                .map(|(start, _)| {
                    format!(
                        "U+{:04X}",
                        all_chars[*start..].chars().next().map_or(0, u32::from)
                    )
                })
                .collect();
            panic!(
                "{class}: {} vs {} matches, e.g. {differing:?}",
                by_onig.len(),
                by_regex.len()
            );
        }
    }
}

/// Fragments of the texts routers see, weighted toward the shapes the regexes split on.
fn fragment() -> impl Strategy<Value = &'static str> {
    const WORDS: &[&str] = &[
        "the",
        "Hello",
        "world",
        "router",
        "KV",
        "cache",
        "naïve",
        "über",
        "İstanbul",
        "ǅ",
    ];
    const SPACES: &[&str] = &[
        " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\u{a0}", "\u{3000}",
        "\u{2003}", "\u{85}", "\u{2028}", "\u{b}", "\u{c}", "\u{1f}", "\u{180e}", "\u{200b}",
        "\u{feff}",
    ];
    const NUMBERS: &[&str] = &[
        "1", "12", "1234567", "3.14", "0", "٣", "１２", "½", "Ⅷ", "²",
    ];
    const PUNCTUATION: &[&str] = &[
        "!", "!!!", ".", ",", "?", "'", "'s", "'t", "'re", "\"", "$", "@", "#", "_", "-", "(", ")",
        "{", "}", "[", "]", "<", ">", "=", "+", "*", "/", "\\", "。", "，", "、", "«", "—", "€",
        "©", "→", "∑",
    ];
    const SCRIPTS: &[&str] = &[
        "中文",
        "字",
        "日本語",
        "ひらがな",
        "カタカナ",
        "ｶﾀｶﾅ",
        "한국어",
        "العربية",
        "Русский",
        "Ελληνικά",
        "עברית",
        "हिन्दी",
        "ภาษาไทย",
        "Tiếng",
    ];
    const MARKS_AND_EMOJI: &[&str] = &[
        "\u{301}",
        "\u{308}",
        "\u{200d}",
        "😀",
        "👍🏽",
        "👩‍👩‍👧",
        "🏳️‍🌈",
        "🇫🇷",
        "1️⃣",
        "\u{fe0f}",
        "\u{0}",
        "\u{7f}",
        "\u{1b}",
        "\u{323}",
        "\u{302}",
        "\u{1100}",
        "\u{1161}",
        "\u{212b}",
        "\u{2126}",
    ];
    /// Contractions in several cases, and characters onig's case folding treats specially.
    const CONTRACTIONS: &[&str] = &[
        "'s",
        "'S",
        "'t",
        "'T",
        "'re",
        "'Re",
        "'RE",
        "'ve",
        "'VE",
        "'m",
        "'M",
        "I'M",
        "'ſx",
        "'Sa",
        "'LLx",
        "'ll",
        "'LL",
        "'lL",
        "'d",
        "'D",
        "DON'T",
        "'ſ",
        "'\u{212a}",
        "'K",
        "'ß",
        "'ẞ",
        "'ﬅ",
        "ſ",
        "\u{212a}",
        "ß",
        "ı",
        "İ",
        "i\u{307}",
        "ς",
        "Σ",
        "σ",
        "'ı",
        "'İ",
    ];
    prop_oneof![
        3 => proptest::sample::select(CONTRACTIONS),
        6 => proptest::sample::select(WORDS),
        6 => proptest::sample::select(SPACES),
        3 => proptest::sample::select(NUMBERS),
        4 => proptest::sample::select(PUNCTUATION),
        3 => proptest::sample::select(SCRIPTS),
        2 => proptest::sample::select(MARKS_AND_EMOJI),
    ]
}

fn mixed_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(fragment(), 0..40).prop_map(|fragments| fragments.concat())
}

/// Mixed text with special and added tokens (and near misses) in it, like a rendered chat.
fn prompt_text() -> impl Strategy<Value = String> {
    const TOKENS: &[&str] = &[
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<|EOT|>",
        "<｜fim▁hole｜>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜User",
        "｜>",
        "<|",
        "<｜",
    ];
    let piece = prop_oneof![
        4 => fragment(),
        1 => proptest::sample::select(TOKENS),
    ];
    proptest::collection::vec(piece, 0..40).prop_map(|pieces| pieces.concat())
}

fn check_against_hf(text: &str) -> Result<(), TestCaseError> {
    let fixture = fixture();
    if fixture
        .added_tokens
        .iter()
        .any(|token| text.contains(token.as_str()))
    {
        return Ok(());
    }
    let expected = fixture.hf.encode(text, false).expect("hf encodes");
    let mut fast = fixture.fast.lock().expect("lock");
    prop_assert_eq!(fast_ids(&mut fast, text), expected, "text {:?}", text);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn mixed_texts_match_hf(text in mixed_text()) {
        check_against_hf(&text)?;
    }
}

fn check_prompt_against_hf(text: &str) -> Result<(), TestCaseError> {
    let fixture = fixture();
    let expected = fixture.hf.encode(text, false).expect("hf encodes");
    let mut fast = fixture.fast_with_added.lock().expect("lock");
    let mut ids = Vec::new();
    fast.encode(text, &mut ids);
    prop_assert_eq!(ids, expected, "text {:?}", text);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_strings_match_hf(text in any::<String>()) {
        check_against_hf(&text)?;
        check_prompt_against_hf(&text)?;
    }

    #[test]
    fn prompts_with_added_tokens_match_hf(text in prompt_text()) {
        check_prompt_against_hf(&text)?;
    }
}

#[test]
fn rendered_chat_prompt_matches_hf() {
    let prompt = "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 12 * 34?\n\n                  Show work.<｜Assistant｜></think>12 * 34 = 408.<｜end▁of▁sentence｜><｜User｜>  thanks                    <｜Assistant｜>";
    check_prompt_against_hf(prompt).expect("same ids");
    let fixture = fixture();
    let mut plain_only = fixture.fast.lock().expect("lock").clone();
    let mut ids = Vec::new();
    plain_only.encode(prompt, &mut ids);
    assert_ne!(
        ids,
        fixture.hf.encode(prompt, false).expect("hf encodes"),
        "without attached added tokens, their text is tokenized as text"
    );
}
