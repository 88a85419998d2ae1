//! Reading a `tokenizer.json` into the fast path's tables, accepting only the subset it
//! reproduces exactly and naming the first thing it does not. No encoding here.

use std::collections::HashMap;

use serde_json::Value;

use super::added::{AddedTokenSpec, added_token_specs};
use super::merge::{Merge, MergeTable};
use super::normalize::Normalizer;
use super::pattern::SplitPattern;
use super::unsupported::Unsupported;

/// The pattern HF's `ByteLevel` pre-tokenizer applies when `use_regex` is true.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Everything encoding needs, shared read-only between instances.
#[derive(Debug)]
pub(super) struct Tables {
    /// Applied to each plain run of text before the pre-tokenizer.
    pub(super) normalizer: Option<Normalizer>,
    /// Pre-tokenizer regex steps, applied in order, each to every piece of the previous one.
    pub(super) steps: Vec<SplitPattern>,
    /// Token id of each byte's byte-level character.
    pub(super) byte_ids: [u32; 256],
    /// Byte-level character of each byte (GPT-2's printable remapping).
    pub(super) byte_chars: [char; 256],
    pub(super) merges: MergeTable,
    /// Byte-level token text -> id; consulted whole-piece when `ignore_merges` is set.
    pub(super) vocab: Option<HashMap<String, u32, foldhash::fast::RandomState>>,
    /// The added tokens, or why they cannot be split off as HF does.
    pub(super) added_tokens: Result<Vec<AddedTokenSpec>, Unsupported>,
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
/// themselves, the other 68 bytes to U+0100 onwards in byte order.
pub(super) fn byte_level_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut shifted = 0u32;
    for (byte, slot) in (0u32..).zip(chars.iter_mut()) {
        let printable = matches!(byte, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            byte
        } else {
            shifted += 1;
            0x100 + shifted - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

fn is_null_or_absent(config: &Value, key: &str) -> bool {
    config.get(key).is_none_or(Value::is_null)
}

fn field_str<'a>(config: &'a Value, key: &str) -> Option<&'a str> {
    config.get(key).and_then(Value::as_str)
}

fn read_normalizer(config: &Value) -> Result<Option<Normalizer>, Unsupported> {
    let Some(normalizer) = config.get("normalizer").filter(|value| !value.is_null()) else {
        return Ok(None);
    };
    let is_nfc = |step: &Value| field_str(step, "type") == Some("NFC");
    if is_nfc(normalizer) {
        return Ok(Some(Normalizer::Nfc));
    }
    if field_str(normalizer, "type") == Some("Sequence") {
        match normalizer
            .get("normalizers")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
        {
            Some([]) => return Ok(None),
            Some([only]) if is_nfc(only) => return Ok(Some(Normalizer::Nfc)),
            _ => {}
        }
    }
    Err(Unsupported::Normalizer(compact(normalizer)))
}

fn compact(value: &Value) -> String {
    let mut text = value.to_string();
    if text.len() > 120 {
        let mut cut = 120;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// The regex patterns of the pre-tokenizer, in order.
fn split_patterns(config: &Value) -> Result<Vec<String>, Unsupported> {
    let pre_tokenizer = config
        .get("pre_tokenizer")
        .filter(|value| !value.is_null())
        .ok_or_else(|| Unsupported::PreTokenizer("none (not byte-level)".into()))?;
    let steps: Vec<&Value> = match field_str(pre_tokenizer, "type") {
        Some("Sequence") => pre_tokenizer
            .get("pretokenizers")
            .and_then(Value::as_array)
            .ok_or_else(|| Unsupported::PreTokenizer("sequence without steps".into()))?
            .iter()
            .collect(),
        _ => vec![pre_tokenizer],
    };
    let Some((byte_level, splits)) = steps.split_last() else {
        return Err(Unsupported::PreTokenizer("empty sequence".into()));
    };
    let mut patterns = Vec::with_capacity(steps.len());
    for split in splits {
        patterns.push(split_pattern(split)?);
    }
    if field_str(byte_level, "type") != Some("ByteLevel") {
        return Err(Unsupported::PreTokenizer(format!(
            "last step is not ByteLevel: {}",
            compact(byte_level)
        )));
    }
    if byte_level.get("add_prefix_space").and_then(Value::as_bool) != Some(false) {
        return Err(Unsupported::PreTokenizer(
            "ByteLevel add_prefix_space".into(),
        ));
    }
    // HF's default for `use_regex` is true.
    if byte_level
        .get("use_regex")
        .and_then(Value::as_bool)
        .unwrap_or(true)
    {
        patterns.push(GPT2_PATTERN.to_owned());
    }
    Ok(patterns)
}

fn split_pattern(split: &Value) -> Result<String, Unsupported> {
    let unsupported = || Unsupported::PreTokenizer(compact(split));
    if field_str(split, "type") != Some("Split")
        || field_str(split, "behavior") != Some("Isolated")
        || split.get("invert").and_then(Value::as_bool) != Some(false)
    {
        return Err(unsupported());
    }
    let pattern = split.get("pattern").ok_or_else(unsupported)?;
    if let Some(regex) = field_str(pattern, "Regex") {
        Ok(regex.to_owned())
    } else if let Some(literal) = field_str(pattern, "String").filter(|text| !text.is_empty()) {
        Ok(regex::escape(literal))
    } else {
        Err(unsupported())
    }
}

/// Reads the supported subset out of a parsed `tokenizer.json`. `Err(Ok(reason))` when
/// unsupported, `Err(Err(message))` when malformed (HF would refuse to load it too).
pub(super) fn tables_from_config(config: &Value) -> Result<Tables, Result<Unsupported, String>> {
    let normalizer = read_normalizer(config).map_err(Ok)?;
    if !is_null_or_absent(config, "truncation") || !is_null_or_absent(config, "padding") {
        return Err(Ok(Unsupported::TruncationOrPadding));
    }
    let steps = split_patterns(config)
        .map_err(Ok)?
        .into_iter()
        .map(|pattern| {
            SplitPattern::compile(&pattern)
                .map_err(|reason| Ok(Unsupported::Pattern { pattern, reason }))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let model = config
        .get("model")
        .ok_or_else(|| Err("no model".to_owned()))?;
    check_model(model).map_err(Ok)?;
    let vocab = read_vocab(model)?;
    let byte_chars = byte_level_chars();
    let mut byte_ids = [0u32; 256];
    for (slot, character) in byte_ids.iter_mut().zip(byte_chars) {
        *slot = *vocab
            .get(character.encode_utf8(&mut [0; 4]) as &str)
            .ok_or_else(|| {
                Ok(Unsupported::Model(format!(
                    "byte-level character {character:?} is not in the vocabulary"
                )))
            })?;
    }
    let merges = read_merges(model, &vocab)?;
    let ignore_merges = model
        .get("ignore_merges")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Tables {
        normalizer,
        steps,
        byte_ids,
        byte_chars,
        merges,
        vocab: ignore_merges.then_some(vocab),
        added_tokens: added_token_specs(config),
    })
}

fn check_model(model: &Value) -> Result<(), Unsupported> {
    if field_str(model, "type") != Some("BPE") {
        return Err(Unsupported::Model(format!(
            "type {:?}",
            field_str(model, "type").unwrap_or("missing")
        )));
    }
    for key in ["dropout", "continuing_subword_prefix", "end_of_word_suffix"] {
        if !is_null_or_absent(model, key) {
            return Err(Unsupported::Model(format!("{key} is set")));
        }
    }
    if model.get("byte_fallback").and_then(Value::as_bool) == Some(true) {
        return Err(Unsupported::Model("byte_fallback".into()));
    }
    Ok(())
}

type Vocab = HashMap<String, u32, foldhash::fast::RandomState>;

fn read_vocab(model: &Value) -> Result<Vocab, Result<Unsupported, String>> {
    let entries = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| Err("model has no vocab".to_owned()))?;
    let mut vocab = Vocab::with_capacity_and_hasher(entries.len(), Default::default());
    let mut seen_ids = std::collections::HashSet::with_capacity(entries.len());
    for (token, id) in entries {
        let id = id
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| Err(format!("vocab id of {token:?} is not a u32")))?;
        // The merge loop identifies a pair by the id of its concatenation (as HF does): ids
        // must name one text each.
        if !seen_ids.insert(id) {
            return Err(Ok(Unsupported::Model(format!("id {id} names two tokens"))));
        }
        vocab.insert(token.clone(), id);
    }
    Ok(vocab)
}

fn read_merges(model: &Value, vocab: &Vocab) -> Result<MergeTable, Result<Unsupported, String>> {
    let entries = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| Err("model has no merges".to_owned()))?;
    let mut table = MergeTable::default();
    let mut rank = 0u32;
    for entry in entries {
        let (left, right) = match entry {
            // Legacy "a b" lines; HF skips a `#version` header and needs exactly one space.
            Value::String(line) if line.starts_with("#version") => continue,
            Value::String(line) => match line.split(' ').collect::<Vec<_>>().as_slice() {
                [left, right] => ((*left).to_owned(), (*right).to_owned()),
                _ => return Err(Err(format!("bad merge {line:?}"))),
            },
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(left), Value::String(right)] => (left.clone(), right.clone()),
                _ => return Err(Err(format!("bad merge {}", compact(entry)))),
            },
            _ => return Err(Err(format!("bad merge {}", compact(entry)))),
        };
        let id_of = |token: &str| {
            vocab
                .get(token)
                .copied()
                .ok_or_else(|| Err(format!("merge token {token:?} is not in the vocabulary")))
        };
        let merged_id = id_of(&format!("{left}{right}"))?;
        table.insert(id_of(&left)?, id_of(&right)?, Merge { rank, merged_id });
        rank += 1;
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_chars_are_gpt2s() {
        let chars = byte_level_chars();
        assert_eq!(chars[b'a' as usize], 'a');
        assert_eq!(chars[b' ' as usize], 'Ġ');
        assert_eq!(chars[b'\n' as usize], 'Ċ');
        assert_eq!(chars[0], 'Ā');
        assert_eq!(chars[0xAD], 'Ń');
        let distinct: std::collections::HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
