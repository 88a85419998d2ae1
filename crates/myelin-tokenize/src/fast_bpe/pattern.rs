//! One `Split` pre-tokenizer step compiled for the `regex` engine (regex-automata's meta regex,
//! which the `regex` crate wraps; used directly for anchored searches and per-instance caches),
//! with onig's trailing `\s+(?!\S)|\s+` look-ahead emulated, `(?i:...)` literal groups rewritten
//! into explicit classes, and the vetting that admits only patterns both engines match
//! identically. Byte-level mapping and BPE live elsewhere.
//!
//! Why `regex` agrees with onig on an admitted pattern:
//! - Both report the leftmost match, and among matches starting there the one a backtracking
//!   engine finds first (onig backtracks; `regex` documents leftmost-first as exactly that
//!   preference order). So alternation order and greedy/lazy repetition agree.
//! - Everything whose meaning differs between onig's Ruby syntax and `regex` is refused: flags
//!   (`(?m)` is dot-all in onig, `(?i)` folds case differently; `(?i:...)` is rewritten, see
//!   below), `\d`/`\w` and POSIX classes
//!   (Unicode in onig, ASCII or a different property in `regex`), anchors and `\b`, set
//!   difference `--`/`~~` (literal text in onig), and anything `regex` cannot parse (other
//!   look-arounds, backreferences, atomic groups), and a repetition of a repetition (`a++` is
//!   possessive in onig).
//! - Patterns that can match the empty string are refused: onig and `regex` step past empty
//!   matches differently, and no real tokenizer needs them.
//! - `\s` and `\p{..}` use Unicode 16 tables in both (onig 6.9.9 and regex-syntax 0.8); a test
//!   compares the classes code point by code point against onig.
//!
//! `(?i:...)` is accepted only around alternatives of printable-ASCII literals, and compiled as
//! the case-sensitive group onig's case folding amounts to, each letter becoming a class:
//! `(?i:'s|'re)` is `(?:'[sS\x{17F}]|'[rR][eE])`. Why that is exact:
//! - onig compiles a case-insensitive literal string into the alternatives its fold table
//!   allows at each position, single characters and characters whose full folding is several
//!   letters; alternation order and the rest of the pattern are untouched, so matching a
//!   sequence of per-letter classes is the same wherever no multi-character fold applies.
//! - Single characters: onig's `(?i:c)` matches exactly `case_folded_char`'s class for every
//!   printable ASCII `c` over every code point (tested): the letter in both cases, plus
//!   U+017F LONG S for `s` and U+212A KELVIN SIGN for `k`; not `İ`/`ı` for `i` (their folds
//!   are `i̇` and none outside Turkic folding, which onig does not use by default), not `ς`.
//! - Multi-character folds: onig matches `ß` and `ẞ` for `(?i:ss)`, the ligatures `ﬀ ﬁ ﬂ ﬃ ﬄ
//!   ﬅ ﬆ` for `ff fi fl ffi ffl st st`. Enumerated through onig's own table over every pair and
//!   triple of ASCII letters (Unicode folds are at most three characters long), each holds a
//!   pair of `MULTI_CHARACTER_FOLD_PAIRS`, and a literal holding one is refused; no ASCII
//!   character folds to several, so nothing in the text can match part of a literal.
//! - Non-letters fold to nothing else (tested); a test also substitutes every code point for
//!   each letter of Llama 3's contraction group and compares with onig, and
//!   property tests compare Llama 3's and Qwen 2's whole patterns with HF's `Split`.
//!
//! The look-ahead idiom `A|\s+(?!\S)|\s+` is compiled as `A|\s+` plus a fix-up. Where `A` does
//! not match, onig's `\s+` takes the whole whitespace run `[s, e)`; `(?!\S)` then fails if a
//! non-space follows, so onig backtracks one character and succeeds with `[s, e - 1 char)` when
//! that is non-empty; a run of one character falls through to the last `\s+` and is kept whole.
//! At the end of the piece `(?!\S)` holds and the run is kept whole. Where `A` matches, both
//! engines return `A`'s match, so the fix-up applies only when an anchored `A` fails.

use regex_automata::meta::{Cache, Regex};
use regex_automata::{Anchored, Input};
use regex_syntax::ast::{self, Ast, ClassPerlKind, ClassSetBinaryOp, ClassSetItem, GroupKind};

/// The only look-around accepted: a trailing whitespace run that leaves its last character to
/// the next token (GPT-2 and most of its descendants end their pattern with it).
const WHITESPACE_LOOKAHEAD_SUFFIX: &str = r"\s+(?!\S)|\s+";

/// A pre-tokenizer regex step, applied to each piece of the previous step on its own.
#[derive(Debug)]
pub(super) struct SplitPattern {
    /// The pattern as `regex` compiles it (look-ahead alternative replaced by `\s+`).
    searcher: Regex,
    /// Present when the pattern ends in the look-ahead idiom.
    lookahead: Option<WhitespaceLookahead>,
}

/// The state needed to emulate `\s+(?!\S)`.
#[derive(Debug)]
struct WhitespaceLookahead {
    /// `A`, the alternatives before the idiom (searched anchored); `None` when the idiom is the
    /// whole pattern.
    prefix: Option<Regex>,
}

impl SplitPattern {
    /// Compiles a `Split` step's regex, or says why it is not reproduced exactly.
    pub(super) fn compile(pattern: &str) -> Result<Self, String> {
        let (core, lookahead) = match pattern.strip_suffix(WHITESPACE_LOOKAHEAD_SUFFIX) {
            Some("") => (None, true),
            Some(prefix) => match prefix.strip_suffix('|') {
                Some(alternatives) if !alternatives.is_empty() => (Some(alternatives), true),
                _ => return Err("look-around outside the trailing `\\s+(?!\\S)|\\s+`".into()),
            },
            None => (Some(pattern), false),
        };
        let core = core.map(rewrite_case_insensitive_groups).transpose()?;
        let core = core.as_deref();
        if let Some(core) = core {
            vet(core)?;
        }
        let searched = match (core, lookahead) {
            (Some(core), true) => format!(r"(?:{core})|\s+"),
            (Some(core), false) => core.to_owned(),
            (None, _) => r"\s+".to_owned(),
        };
        let searcher = Regex::new(&searched).map_err(|error| error.to_string())?;
        let lookahead = if lookahead {
            let prefix = match core {
                Some(core) => Some(Regex::new(core).map_err(|error| error.to_string())?),
                None => None,
            };
            Some(WhitespaceLookahead { prefix })
        } else {
            None
        };
        Ok(Self {
            searcher,
            lookahead,
        })
    }

    /// Per-thread search state for [`Self::split_isolated`]: the searches use it instead of the
    /// regexes' internal pools, whose fast path belongs to the thread that first used them
    /// (every other thread, i.e. every data core, took a mutex on each search: 13% of a
    /// shared-prefix request's CPU before this).
    pub(super) fn create_cache(&self) -> SplitCache {
        SplitCache {
            searcher: self.searcher.create_cache(),
            prefix: self
                .lookahead
                .as_ref()
                .and_then(|lookahead| lookahead.prefix.as_ref())
                .map(Regex::create_cache),
        }
    }

    /// The leftmost-first match in `piece[at..]`. Most pieces are covered by matches end to
    /// end, so an anchored search (forward scan only) is tried first; when it finds a match it
    /// is the one the unanchored search would report, as no match can start further left.
    fn find(&self, cache: &mut SplitCache, piece: &str, at: usize) -> Option<(usize, usize)> {
        let cache = &mut cache.searcher;
        let unanchored = Input::new(piece).range(at..);
        let anchored = unanchored.clone().anchored(Anchored::Yes);
        self.searcher
            .search_with(cache, &anchored)
            .or_else(|| self.searcher.search_with(cache, &unanchored))
            .map(|found| (found.start(), found.end()))
    }

    /// Calls `emit` with each piece `piece` splits into, in order: every match and every
    /// non-empty gap between matches (HF's `Isolated` behaviour).
    pub(super) fn split_isolated(
        &self,
        cache: &mut SplitCache,
        piece: &str,
        emit: &mut dyn FnMut(&str),
    ) {
        let mut gap_start = 0;
        while gap_start < piece.len() {
            let Some((start, mut end)) = self.find(cache, piece, gap_start) else {
                break;
            };
            if let Some(lookahead) = &self.lookahead {
                end = lookahead.onig_end(cache.prefix.as_mut(), piece, start, end);
            }
            if start > gap_start {
                emit(&piece[gap_start..start]);
            }
            emit(&piece[start..end]);
            gap_start = end;
        }
        if gap_start < piece.len() {
            emit(&piece[gap_start..]);
        }
    }
}

/// Search state of one [`SplitPattern`], owned by one thread.
#[derive(Debug, Clone)]
pub(crate) struct SplitCache {
    searcher: Cache,
    /// For the look-ahead emulation's anchored prefix check.
    prefix: Option<Cache>,
}

impl WhitespaceLookahead {
    /// Where onig's match of `A|\s+(?!\S)|\s+` ends, given that `A|\s+` matched `[start, end)`.
    fn onig_end(&self, cache: Option<&mut Cache>, piece: &str, start: usize, end: usize) -> usize {
        if end == piece.len() {
            return end;
        }
        let matched = &piece[start..end];
        let mut chars = matched.chars();
        let Some(last) = chars.next_back() else {
            return end;
        };
        if chars.as_str().is_empty() {
            return end;
        }
        // An ASCII first character outside `\s` cannot start the `\s+` branch; this skips the
        // anchored search for ordinary words.
        let first = matched.as_bytes()[0];
        if first.is_ascii() && !matches!(first, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ') {
            return end;
        }
        if let (Some(prefix), Some(cache)) = (&self.prefix, cache)
            && prefix
                .search_half_with(
                    cache,
                    &Input::new(piece)
                        .range(start..)
                        .anchored(Anchored::Yes)
                        .earliest(true),
                )
                .is_some()
        {
            return end;
        }
        end - last.len_utf8()
    }
}

/// ASCII letter pairs that are the full case folding of a single character (`ß`, `ẞ` fold to
/// `ss`; the ligatures `ﬀ ﬁ ﬂ ﬃ ﬄ ﬅ ﬆ` to `ff fi fl ffi ffl st st`): onig's `(?i:ss)` matches
/// `ß`, which no per-letter class reproduces, so a literal containing one is refused. Every
/// multi-character fold to ASCII letters contains one of these (tested against onig).
const MULTI_CHARACTER_FOLD_PAIRS: [&str; 5] = ["ss", "st", "ff", "fi", "fl"];

/// Rewrites every `(?i:...)` group of `pattern` into the case-sensitive group onig's case
/// folding is equivalent to, or refuses it (see the module docs).
fn rewrite_case_insensitive_groups(pattern: &str) -> Result<String, String> {
    let parsed = ast::parse::Parser::new()
        .parse(pattern)
        .map_err(|error| error.to_string())?;
    let mut rewrites = Vec::new();
    collect_case_insensitive_groups(&parsed, &mut rewrites)?;
    let mut rewritten = String::with_capacity(pattern.len() + 16 * rewrites.len());
    let mut copied_up_to = 0;
    for (span, replacement) in rewrites {
        rewritten.push_str(&pattern[copied_up_to..span.start]);
        rewritten.push_str(&replacement);
        copied_up_to = span.end;
    }
    rewritten.push_str(&pattern[copied_up_to..]);
    Ok(rewritten)
}

/// Finds the `(?i:...)` groups of `node` in pattern order with their replacements; refuses a
/// group with any other flag combination or with content other than literal alternatives.
fn collect_case_insensitive_groups(
    node: &Ast,
    rewrites: &mut Vec<(std::ops::Range<usize>, String)>,
) -> Result<(), String> {
    match node {
        Ast::Group(group) => match &group.kind {
            GroupKind::NonCapturing(flags) if !flags.items.is_empty() => {
                let only_case_insensitive = matches!(
                    flags.items.as_slice(),
                    [ast::FlagsItem {
                        kind: ast::FlagsItemKind::Flag(ast::Flag::CaseInsensitive),
                        ..
                    }]
                );
                if !only_case_insensitive {
                    return Err("inline flags other than `(?i:...)` differ from onig".into());
                }
                let replacement = case_folded_alternatives(&group.ast)?;
                rewrites.push((group.span.start.offset..group.span.end.offset, replacement));
                Ok(())
            }
            _ => collect_case_insensitive_groups(&group.ast, rewrites),
        },
        Ast::Alternation(alternation) => alternation
            .asts
            .iter()
            .try_for_each(|alternative| collect_case_insensitive_groups(alternative, rewrites)),
        Ast::Concat(concat) => concat
            .asts
            .iter()
            .try_for_each(|item| collect_case_insensitive_groups(item, rewrites)),
        Ast::Repetition(repetition) => collect_case_insensitive_groups(&repetition.ast, rewrites),
        _ => Ok(()),
    }
}

/// The case-sensitive equivalent of `(?i:content)` when `content` is an alternation of
/// non-empty printable-ASCII literals without a multi-character fold, e.g. `(?:'[sSſ]|'[tT])`.
fn case_folded_alternatives(content: &Ast) -> Result<String, String> {
    let refused = || "`(?i:...)` holding other than ASCII literal alternatives".to_owned();
    let alternatives = match content {
        Ast::Alternation(alternation) => alternation.asts.as_slice(),
        single => std::slice::from_ref(single),
    };
    let mut rewritten = String::from("(?:");
    for (index, alternative) in alternatives.iter().enumerate() {
        let items = match alternative {
            Ast::Concat(concat) => concat.asts.as_slice(),
            Ast::Literal(_) => std::slice::from_ref(alternative),
            _ => return Err(refused()),
        };
        let mut text = String::with_capacity(items.len());
        for item in items {
            match item {
                Ast::Literal(literal)
                    if matches!(
                        literal.kind,
                        ast::LiteralKind::Verbatim | ast::LiteralKind::Meta
                    ) && (literal.c.is_ascii_graphic() || literal.c == ' ') =>
                {
                    text.push(literal.c);
                }
                _ => return Err(refused()),
            }
        }
        let lowercase = text.to_ascii_lowercase();
        if let Some(pair) = MULTI_CHARACTER_FOLD_PAIRS
            .iter()
            .find(|pair| lowercase.contains(*pair))
        {
            return Err(format!(
                "`(?i:{text})`: onig also matches the character folding to {pair:?}"
            ));
        }
        if index > 0 {
            rewritten.push('|');
        }
        for character in text.chars() {
            rewritten.push_str(&case_folded_char(character));
        }
    }
    rewritten.push(')');
    Ok(rewritten)
}

/// What onig's `(?i:c)` matches for a printable ASCII `c`, as `regex` syntax: the letter in
/// both cases plus the two non-ASCII characters whose simple case folding is an ASCII letter
/// (U+017F LATIN SMALL LETTER LONG S folds to `s`, U+212A KELVIN SIGN to `k`); a non-letter
/// matches only itself. Tested against onig for every code point.
fn case_folded_char(character: char) -> String {
    if !character.is_ascii_alphabetic() {
        return regex_syntax::escape(character.encode_utf8(&mut [0; 4]));
    }
    let lower = character.to_ascii_lowercase();
    let upper = character.to_ascii_uppercase();
    let other = match lower {
        's' => r"\x{17F}",
        'k' => r"\x{212A}",
        _ => "",
    };
    format!("[{lower}{upper}{other}]")
}

/// Refuses patterns whose meaning differs between onig and `regex` (see the module docs).
fn vet(pattern: &str) -> Result<(), String> {
    let parsed = ast::parse::Parser::new()
        .parse(pattern)
        .map_err(|error| error.to_string())?;
    ast::visit(&parsed, OnigCompatible)?;
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .map_err(|error| error.to_string())?;
    if !hir.properties().look_set().is_empty() {
        return Err("anchors and word boundaries mean other things in onig".into());
    }
    if hir.properties().minimum_len().unwrap_or(0) == 0 {
        return Err("the pattern can match the empty string".into());
    }
    Ok(())
}

/// AST visitor refusing constructs onig reads differently.
struct OnigCompatible;

impl ast::Visitor for OnigCompatible {
    type Output = ();
    type Err = String;

    fn finish(self) -> Result<(), String> {
        Ok(())
    }

    fn visit_pre(&mut self, node: &Ast) -> Result<(), String> {
        match node {
            Ast::Flags(_) => Err("inline flags differ between onig and regex".into()),
            Ast::Group(group) => match &group.kind {
                GroupKind::NonCapturing(flags) if !flags.items.is_empty() => {
                    Err("inline flags differ between onig and regex".into())
                }
                _ => Ok(()),
            },
            Ast::Assertion(_) => Err("anchors and word boundaries differ".into()),
            // `a++`, `a*+`, `a?+` are possessive in onig, nested repetitions in `regex`.
            Ast::Repetition(repetition) if matches!(*repetition.ast, Ast::Repetition(_)) => {
                Err("repetition of a repetition (possessive in onig)".into())
            }
            Ast::ClassPerl(class) => perl_class_ok(class.kind.clone()),
            _ => Ok(()),
        }
    }

    fn visit_class_set_item_pre(&mut self, item: &ClassSetItem) -> Result<(), String> {
        match item {
            ClassSetItem::Ascii(_) => Err("POSIX classes are Unicode in onig".into()),
            ClassSetItem::Perl(class) => perl_class_ok(class.kind.clone()),
            _ => Ok(()),
        }
    }

    fn visit_class_set_binary_op_pre(&mut self, op: &ClassSetBinaryOp) -> Result<(), String> {
        match op.kind {
            ast::ClassSetBinaryOpKind::Intersection => Ok(()),
            _ => Err("class difference is literal text in onig".into()),
        }
    }
}

/// `\s` is the same set in both engines (tested); `\d` and `\w` are not.
fn perl_class_ok(kind: ClassPerlKind) -> Result<(), String> {
    match kind {
        ClassPerlKind::Space => Ok(()),
        ClassPerlKind::Digit | ClassPerlKind::Word => Err("\\d and \\w differ from onig".into()),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn pieces(pattern: &str, text: &str) -> Vec<String> {
        let compiled = SplitPattern::compile(pattern).expect("supported pattern");
        let mut cache = compiled.create_cache();
        let mut out = Vec::new();
        compiled.split_isolated(&mut cache, text, &mut |piece| out.push(piece.to_owned()));
        out
    }

    #[test]
    fn lookahead_leaves_the_last_space_to_the_next_word() {
        let gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
        assert_eq!(pieces(gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(pieces(gpt2, "a \u{3000}b"), ["a", " ", "\u{3000}", "b"]);
        assert_eq!(pieces(gpt2, "a   "), ["a", "   "]);
        assert_eq!(pieces(gpt2, "a \tb"), ["a", " ", "\t", "b"]);
        assert_eq!(pieces(gpt2, "a\n\n  b"), ["a", "\n\n ", " b"]);
    }

    #[test]
    fn lookahead_alone_splits_whitespace_runs() {
        assert_eq!(
            pieces(WHITESPACE_LOOKAHEAD_SUFFIX, "x   y "),
            ["x", "  ", " ", "y", " "]
        );
    }

    /// Every code point, in order.
    fn every_code_point() -> String {
        (0..=0x10FFFFu32).filter_map(char::from_u32).collect()
    }

    fn onig_matches(pattern: &str, haystack: &str) -> Vec<(usize, usize)> {
        tokenizers::utils::SysRegex::new(pattern)
            .expect("onig compiles")
            .find_iter(haystack)
            .collect()
    }

    fn regex_matches(pattern: &str, haystack: &str) -> Vec<(usize, usize)> {
        regex::Regex::new(pattern)
            .expect("regex compiles")
            .find_iter(haystack)
            .map(|found| (found.start(), found.end()))
            .collect()
    }

    /// Panics naming the first match where onig and the rewrite differ.
    fn assert_same_matches(
        what: &str,
        haystack: &str,
        onig: &[(usize, usize)],
        rewritten: &[(usize, usize)],
    ) {
        let text = |found: Option<&(usize, usize)>| {
            found.map(|(start, end)| format!("{:?} at {start}", &haystack[*start..*end]))
        };
        if let Some(index) = (0..onig.len().max(rewritten.len()))
            .find(|index| onig.get(*index) != rewritten.get(*index))
        {
            panic!(
                "{what}: match {index}: onig {:?}, rewrite {:?}",
                text(onig.get(index)),
                text(rewritten.get(index))
            );
        }
    }

    /// For every printable ASCII character `c` and every code point, onig's `(?i:c)` matches
    /// exactly what [`case_folded_char`] does.
    #[test]
    fn case_folded_chars_equal_onigs_for_every_code_point() {
        let haystack = every_code_point();
        for letter in ('a'..='z').chain('A'..='Z') {
            let onig = onig_matches(&format!("(?i:{letter})"), &haystack);
            let rewritten = regex_matches(&case_folded_char(letter), &haystack);
            assert_same_matches(&letter.to_string(), &haystack, &onig, &rewritten);
        }
        // The other printable ASCII characters fold to nothing else (checked as a class in
        // onig, so one pass; each one's rewrite is checked to be itself).
        let others: String = (' '..='~')
            .filter(|character| !character.is_ascii_alphabetic())
            .collect();
        let class = format!("[{}]", regex_syntax::escape(&others).replace(' ', "\\x20"));
        assert_same_matches(
            &class,
            &haystack,
            &onig_matches(&format!("(?i:{class})"), &haystack),
            &regex_matches(&class, &haystack),
        );
        for character in others.chars() {
            let rewritten = case_folded_char(character);
            assert_eq!(
                regex_matches(&rewritten, &others),
                regex_matches(&regex_syntax::escape(&character.to_string()), &others),
            );
        }
    }

    /// onig matches one character against several where Unicode's full case folding maps it
    /// to them; for printable ASCII exactly `ß ẞ ﬀ ﬁ ﬂ ﬅ ﬆ` (pairs) and `ﬃ ﬄ` (triples), each
    /// containing a pair of [`MULTI_CHARACTER_FOLD_PAIRS`]. No fold is longer than three.
    /// Enumerated through onig's own fold table: a case-insensitive class of all non-ASCII
    /// characters matches, besides single characters, the multi-character fold of each one.
    /// Folds are lower case, so upper-case letters are left out of the enumeration.
    #[test]
    fn multi_character_folds_to_ascii_contain_a_refused_pair() {
        let non_ascii = tokenizers::utils::SysRegex::new(r"\A(?i:[\x{80}-\x{10FFFF}])\z")
            .expect("onig compiles");
        let folded_ascii: Vec<char> = (' '..='~')
            .filter(|character| !character.is_ascii_uppercase())
            .collect();
        let pairs: Vec<String> = folded_ascii
            .iter()
            .flat_map(|first| {
                folded_ascii
                    .iter()
                    .map(move |second| format!("{first}{second}"))
            })
            .collect();
        let triples: Vec<String> = pairs
            .iter()
            .flat_map(|pair| {
                folded_ascii
                    .iter()
                    .map(move |third| format!("{pair}{third}"))
            })
            .collect();
        let folds: Vec<&str> = pairs
            .iter()
            .chain(&triples)
            .filter(|letters| non_ascii.find_iter(letters).next().is_some())
            .map(String::as_str)
            .collect();
        assert_eq!(folds, ["ff", "fi", "fl", "ss", "st", "ffi", "ffl"]);
        for fold in folds {
            assert!(
                MULTI_CHARACTER_FOLD_PAIRS
                    .iter()
                    .any(|pair| fold.contains(pair)),
                "{fold}"
            );
        }
        for (folded, pair) in [
            ("ß", "ss"),
            ("ẞ", "ss"),
            ("ﬀ", "ff"),
            ("ﬁ", "fi"),
            ("ﬂ", "fl"),
            ("ﬃ", "ff"),
            ("ﬄ", "ff"),
            ("ﬅ", "st"),
            ("ﬆ", "st"),
        ] {
            assert!(MULTI_CHARACTER_FOLD_PAIRS.contains(&pair));
            let full = match folded {
                "ﬃ" => "ffi",
                "ﬄ" => "ffl",
                _ => pair,
            };
            assert_eq!(
                onig_matches(&format!("(?i:{full})"), folded),
                [(0, folded.len())]
            );
        }
    }

    /// The contraction groups of Llama 3 and Qwen 2: onig's match and the rewrite's agree on
    /// every code point put in place of each letter (and of each letter pair) of each
    /// alternative, and on the case variants routers see.
    #[test]
    fn contraction_group_equals_onigs_with_any_character_substituted() {
        let group = "(?i:'s|'t|'re|'ve|'m|'ll|'d)";
        let rewritten = rewrite_case_insensitive_groups(group).expect("supported");
        assert_eq!(
            rewritten,
            r"(?:'[sS\x{17F}]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        );
        let mut haystack = String::with_capacity(48 << 20);
        for character in (0..=0x10FFFFu32).filter_map(char::from_u32) {
            for (before, after) in [("'", ""), ("'", "e"), ("'r", ""), ("'", "l"), ("'l", "")] {
                haystack.push_str(before);
                haystack.push(character);
                haystack.push_str(after);
                haystack.push('\0');
            }
        }
        haystack.push_str("'S 'LL 'Re I'M 'ſ 'K 'ß 'ı 'İ 'Σ 'ς 'ﬅ 'sT 'VE 'D");
        let onig = onig_matches(group, &haystack);
        let fast = regex_matches(&rewritten, &haystack);
        assert_same_matches(group, &haystack, &onig, &fast);
        // Per code point, `'c`, `'ce`, `'cl` match for `c` in `sSſtTmMdD` (9 each), `'ce` also
        // for `rRvV`, `'re` for `eE`, `'cl` and `'lc` for `lL`: 37, plus 8 in the tail.
        assert_eq!(onig.len(), 45);
    }

    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// A pattern compiled by the fast path and by HF's `Split` (onig).
    struct BothEngines {
        fast: SplitPattern,
        hf: tokenizers::pre_tokenizers::split::Split,
    }

    impl BothEngines {
        fn new(pattern: &str) -> Self {
            let hf = tokenizers::pre_tokenizers::split::Split::new(
                tokenizers::pre_tokenizers::split::SplitPattern::Regex(pattern.to_owned()),
                tokenizers::SplitDelimiterBehavior::Isolated,
                false,
            )
            .expect("onig compiles");
            let fast = SplitPattern::compile(pattern).expect("supported pattern");
            Self { fast, hf }
        }

        fn fast_pieces(&self, text: &str) -> Vec<String> {
            let mut cache = self.fast.create_cache();
            let mut out = Vec::new();
            self.fast
                .split_isolated(&mut cache, text, &mut |piece| out.push(piece.to_owned()));
            out
        }

        fn hf_pieces(&self, text: &str) -> Vec<String> {
            use tokenizers::{
                OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _,
            };
            let mut pretokenized = PreTokenizedString::from(text);
            self.hf.pre_tokenize(&mut pretokenized).expect("splits");
            pretokenized
                .get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(piece, _, _)| piece.to_owned())
                .collect()
        }
    }

    fn llama3_and_qwen2() -> &'static [BothEngines; 2] {
        static ENGINES: std::sync::OnceLock<[BothEngines; 2]> = std::sync::OnceLock::new();
        ENGINES.get_or_init(|| [BothEngines::new(LLAMA3), BothEngines::new(QWEN2)])
    }

    /// Texts dense in contractions, their case variants and the characters case folding
    /// relates to their letters, in every context the other alternatives care about.
    fn contraction_text() -> impl Strategy<Value = String> {
        const PIECES: &[&str] = &[
            "'", "'", "'", "s", "S", "ſ", "t", "T", "r", "R", "e", "E", "v", "V", "m", "M", "l",
            "L", "d", "D", "k", "K", "\u{212a}", "ß", "ẞ", "ﬅ", "ﬆ", "ı", "İ", "i", "\u{307}", "ς",
            "Σ", "x", "é", "\u{301}", "1", "123456", " ", " ", "  ", "\n", "\r\n", "\t", "\u{a0}",
            "!", "?!", "中", "😀",
        ];
        proptest::collection::vec(proptest::sample::select(PIECES), 0..32)
            .prop_map(|pieces| pieces.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Llama 3's and Qwen 2's whole patterns split like HF's `Split` (onig).
        #[test]
        fn llama3_and_qwen2_patterns_split_like_hf(text in contraction_text()) {
            for engines in llama3_and_qwen2() {
                prop_assert_eq!(engines.fast_pieces(&text), engines.hf_pieces(&text));
            }
        }

        #[test]
        fn llama3_and_qwen2_patterns_split_arbitrary_strings_like_hf(text in any::<String>()) {
            for engines in llama3_and_qwen2() {
                prop_assert_eq!(engines.fast_pieces(&text), engines.hf_pieces(&text));
            }
        }
    }

    #[test]
    fn case_insensitive_literal_groups_are_rewritten() {
        assert_eq!(
            rewrite_case_insensitive_groups(r"x(?i:ok|a\.b)+|(?:y)").expect("supported"),
            r"x(?:[oO][kK\x{212A}]|[aA]\.[bB])+|(?:y)"
        );
        assert_eq!(
            pieces(
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\s+(?!\S)|\s+",
                "IT'S I'M we'Re x'ſ 'ß"
            ),
            ["IT", "'S", " I", "'M", " we", "'Re", " x", "'ſ", " ", "'ß"]
        );
        for pattern in [
            r"(?i:'ss)",
            r"(?i:ST)",
            r"(?i:fix)",
            r"(?i:a+)",
            r"(?i:[a-z])",
            r"(?i:a|)",
            r"(?i:é)",
            r"(?i:\x41)",
            r"(?i-m:a)",
            r"(?im:a)",
            r"(?-i:a)",
            r"(?s:a)",
        ] {
            assert!(
                SplitPattern::compile(pattern).is_err(),
                "{pattern} accepted"
            );
        }
    }

    #[test]
    fn divergent_syntax_is_refused() {
        for pattern in [
            r"(?i)'s",
            r"\d+",
            r"\w+",
            r"[[:alpha:]]+",
            r"^a",
            r"a\b",
            r"a|",
            r"a*",
            r"[a-z--c]",
            r"(?<=a)b",
            r"a(?=b)",
            r"a++",
            r"a*+",
            r"(a)\1",
            r"\s+(?!\S)",
            r"a|\s+(?!\S)",
        ] {
            assert!(
                SplitPattern::compile(pattern).is_err(),
                "{pattern} accepted"
            );
        }
        assert!(SplitPattern::compile(r"[a-z&&[^c]]+|\s+").is_ok());
        assert!(SplitPattern::compile(r"(?:ab+)+").is_ok());
    }
}
