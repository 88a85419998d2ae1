//! One `Split` pre-tokenizer step compiled for the `regex` engine (regex-automata's meta regex,
//! which the `regex` crate wraps; used directly for anchored searches and per-instance caches),
//! with onig's trailing `\s+(?!\S)|\s+` look-ahead emulated, and the vetting that admits only
//! patterns both engines match identically. Byte-level mapping and BPE live elsewhere.
//!
//! Why `regex` agrees with onig on an admitted pattern:
//! - Both report the leftmost match, and among matches starting there the one a backtracking
//!   engine finds first (onig backtracks; `regex` documents leftmost-first as exactly that
//!   preference order). So alternation order and greedy/lazy repetition agree.
//! - Everything whose meaning differs between onig's Ruby syntax and `regex` is refused: flags
//!   (`(?m)` is dot-all in onig, `(?i)` folds case differently), `\d`/`\w` and POSIX classes
//!   (Unicode in onig, ASCII or a different property in `regex`), anchors and `\b`, set
//!   difference `--`/`~~` (literal text in onig), and anything `regex` cannot parse (other
//!   look-arounds, backreferences, atomic groups), and a repetition of a repetition (`a++` is
//!   possessive in onig).
//! - Patterns that can match the empty string are refused: onig and `regex` step past empty
//!   matches differently, and no real tokenizer needs them.
//! - `\s` and `\p{..}` use Unicode 16 tables in both (onig 6.9.9 and regex-syntax 0.8); a test
//!   compares the classes code point by code point against onig.
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

    /// Per-thread search state for [`Self::split_isolated`].
    pub(super) fn create_cache(&self) -> Cache {
        self.searcher.create_cache()
    }

    /// The leftmost-first match in `piece[at..]`. Most pieces are covered by matches end to
    /// end, so an anchored search (forward scan only) is tried first; when it finds a match it
    /// is the one the unanchored search would report, as no match can start further left.
    fn find(&self, cache: &mut Cache, piece: &str, at: usize) -> Option<(usize, usize)> {
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
        cache: &mut Cache,
        piece: &str,
        emit: &mut dyn FnMut(&str),
    ) {
        let mut gap_start = 0;
        while gap_start < piece.len() {
            let Some((start, mut end)) = self.find(cache, piece, gap_start) else {
                break;
            };
            if let Some(lookahead) = &self.lookahead {
                end = lookahead.onig_end(piece, start, end);
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

impl WhitespaceLookahead {
    /// Where onig's match of `A|\s+(?!\S)|\s+` ends, given that `A|\s+` matched `[start, end)`.
    fn onig_end(&self, piece: &str, start: usize, end: usize) -> usize {
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
        if let Some(prefix) = &self.prefix
            && prefix.is_match(Input::new(piece).range(start..).anchored(Anchored::Yes))
        {
            return end;
        }
        end - last.len_utf8()
    }
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
