//! Prompt -> token ids for routing, with a per-core cache of tokenized segments.
//!
//! Tokenization is the dominant per-request cost. HuggingFace tokenizers split the input on
//! added tokens (`<｜User｜>`, `<|im_start|>`, ...) *before* normalization and pre-tokenization,
//! so the text between two added tokens is tokenized independently of its neighbours. A chat
//! rendered by the model's own template is mostly such segments (system prompt, earlier turns),
//! repeated across the requests of a conversation: we split at added tokens, take each
//! segment's ids from the cache or tokenize it, and concatenate. The result is bit-identical to
//! tokenizing the whole text, and checked to be at startup; the cache is switched off for a
//! tokenizer where the split would not be exact (added tokens that strip neighbouring
//! whitespace or match only whole words, or a normalizer before the split).
//!
//! Trade-off: when the chat template writes no added tokens of the tokenizer (for example the
//! default ChatML template with a tokenizer that lacks `<|im_start|>`), the whole prompt is one
//! segment and the cache only helps exact repeats.

use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use myelin_tokenize::{ChatTemplate, Tokenizer};
use serde_json::Value;

use crate::openai::PromptInput;

/// Segments shorter than this are tokenized directly: a lookup would cost about as much.
const MIN_CACHED_SEGMENT_BYTES: usize = 64;

/// Why a prompt could not be turned into token ids.
#[derive(Debug, thiserror::Error)]
pub enum RouteTokensError {
    #[error("chat template: {0}")]
    Template(#[from] myelin_tokenize::TemplateError),
    #[error("{0}")]
    Tokenize(#[from] myelin_tokenize::TokenizeError),
}

/// Added tokens of a tokenizer, indexed by first byte for leftmost-longest matching.
#[derive(Debug, Default)]
pub struct AddedTokens {
    /// For each first byte: (token text, id), longest first.
    by_first_byte: HashMap<u8, Vec<(Box<str>, u32)>>,
}

impl AddedTokens {
    /// Reads the `added_tokens` of a tokenizer.json. Returns `None` when splitting on them
    /// would not reproduce the tokenizer exactly (see the module docs).
    pub fn from_tokenizer_json(path: &Path) -> Option<AddedTokens> {
        let text = std::fs::read_to_string(path).ok()?;
        let json: Value = serde_json::from_str(&text).ok()?;
        let normalizer_is_identity = match json.get("normalizer") {
            None | Some(Value::Null) => true,
            Some(normalizer) => {
                normalizer.get("type").and_then(Value::as_str) == Some("Sequence")
                    && normalizer
                        .get("normalizers")
                        .and_then(Value::as_array)
                        .is_some_and(Vec::is_empty)
            }
        };
        let mut tokens = AddedTokens::default();
        for token in json.get("added_tokens")?.as_array()? {
            let flag = |name: &str| token.get(name).and_then(Value::as_bool).unwrap_or(false);
            if flag("lstrip") || flag("rstrip") || flag("single_word") {
                return None;
            }
            if flag("normalized") && !normalizer_is_identity {
                return None;
            }
            let content = token.get("content")?.as_str()?;
            let id = u32::try_from(token.get("id")?.as_u64()?).ok()?;
            let Some(&first) = content.as_bytes().first() else {
                continue;
            };
            tokens
                .by_first_byte
                .entry(first)
                .or_default()
                .push((content.into(), id));
        }
        for candidates in tokens.by_first_byte.values_mut() {
            candidates.sort_by_key(|(content, _)| std::cmp::Reverse(content.len()));
        }
        Some(tokens)
    }

    /// Splits `text` into plain segments and added tokens, leftmost-longest like the
    /// tokenizer's own split.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Segment<'a>> {
        let bytes = text.as_bytes();
        let mut segments = Vec::new();
        let mut plain_start = 0;
        let mut position = 0;
        while position < bytes.len() {
            let matched = self
                .by_first_byte
                .get(&bytes[position])
                .and_then(|candidates| {
                    candidates
                        .iter()
                        .find(|(content, _)| bytes[position..].starts_with(content.as_bytes()))
                });
            match matched {
                Some((content, id)) => {
                    if plain_start < position {
                        segments.push(Segment::Plain(&text[plain_start..position]));
                    }
                    segments.push(Segment::Added(*id));
                    position += content.len();
                    plain_start = position;
                }
                None => position += 1,
            }
        }
        if plain_start < bytes.len() {
            segments.push(Segment::Plain(&text[plain_start..]));
        }
        segments
    }
}

/// A piece of a prompt between added tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment<'a> {
    Plain(&'a str),
    Added(u32),
}

/// A bounded cache of segment -> token ids: two generations, the older dropped when the
/// newer fills half the byte budget (an O(1) approximation of LRU).
#[derive(Debug)]
struct SegmentCache {
    budget_bytes: usize,
    current: HashMap<Box<str>, Rc<[u32]>>,
    current_bytes: usize,
    previous: HashMap<Box<str>, Rc<[u32]>>,
}

impl SegmentCache {
    fn new(budget_bytes: usize) -> Self {
        SegmentCache {
            budget_bytes,
            current: HashMap::new(),
            current_bytes: 0,
            previous: HashMap::new(),
        }
    }

    fn get(&mut self, segment: &str) -> Option<Rc<[u32]>> {
        if let Some(ids) = self.current.get(segment) {
            return Some(ids.clone());
        }
        let ids = self.previous.remove(segment)?;
        self.insert(segment, ids.clone());
        Some(ids)
    }

    fn insert(&mut self, segment: &str, ids: Rc<[u32]>) {
        let cost = segment.len() + ids.len() * 4 + 64;
        if cost * 2 > self.budget_bytes {
            return;
        }
        if self.current_bytes + cost > self.budget_bytes / 2 {
            self.previous = std::mem::take(&mut self.current);
            self.current_bytes = 0;
        }
        self.current_bytes += cost;
        self.current.insert(segment.into(), ids);
    }
}

/// Counters of one tokenization, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeStats {
    pub cached_segments: u32,
    pub tokenized_segments: u32,
}

/// Per-core tokenizer for routing: template rendering, tokenization, segment cache.
pub struct RouteTokenizer {
    tokenizer: Tokenizer,
    template: Arc<ChatTemplate>,
    added_tokens: Option<Arc<AddedTokens>>,
    /// Ids the tokenizer puts before a completion prompt (usually the BOS), when it only
    /// prepends: then a completion prompt is `prefix + segments` and can use the cache too.
    completion_prefix: Option<Vec<u32>>,
    cache: Option<SegmentCache>,
}

impl RouteTokenizer {
    /// Builds one core's tokenizer. `added_tokens` is `None` to disable segment caching.
    pub fn new(
        tokenizer: Tokenizer,
        template: Arc<ChatTemplate>,
        added_tokens: Option<Arc<AddedTokens>>,
        cache_budget_bytes: usize,
    ) -> RouteTokenizer {
        let completion_prefix = Self::probe_completion_prefix(&tokenizer);
        let cache = (cache_budget_bytes > 0 && added_tokens.is_some())
            .then(|| SegmentCache::new(cache_budget_bytes));
        RouteTokenizer {
            tokenizer,
            template,
            added_tokens,
            completion_prefix,
            cache,
        }
    }

    fn probe_completion_prefix(tokenizer: &Tokenizer) -> Option<Vec<u32>> {
        let prefix = tokenizer.encode("", true).ok()?;
        let probe = "Probe: the quick brown fox, 42 times.\n";
        let plain = tokenizer.encode(probe, false).ok()?;
        let with_special = tokenizer.encode(probe, true).ok()?;
        let mut expected = prefix.clone();
        expected.extend_from_slice(&plain);
        (expected == with_special).then_some(prefix)
    }

    /// Token ids of a request's prompt as the engine computes them.
    pub fn prompt_tokens(
        &mut self,
        prompt: &PromptInput,
    ) -> Result<(Vec<u32>, TokenizeStats), RouteTokensError> {
        match prompt {
            PromptInput::Tokens(ids) => Ok((ids.clone(), TokenizeStats::default())),
            PromptInput::Chat(messages) => {
                let text = self.template.render(messages, true)?;
                self.encode(&text, None)
            }
            PromptInput::Text(text) => match self.completion_prefix.clone() {
                Some(prefix) => self.encode(text, Some(prefix)),
                None => Ok((self.tokenizer.encode(text, true)?, TokenizeStats::default())),
            },
        }
    }

    /// Tokenizes `text` without special tokens, segment by segment, after `prefix`.
    fn encode(
        &mut self,
        text: &str,
        prefix: Option<Vec<u32>>,
    ) -> Result<(Vec<u32>, TokenizeStats), RouteTokensError> {
        let mut stats = TokenizeStats::default();
        let (Some(added_tokens), Some(cache)) = (&self.added_tokens, &mut self.cache) else {
            let ids = match prefix {
                Some(_) => self.tokenizer.encode(text, true)?,
                None => self.tokenizer.encode(text, false)?,
            };
            stats.tokenized_segments = 1;
            return Ok((ids, stats));
        };
        let mut ids = prefix.unwrap_or_default();
        for segment in added_tokens.split(text) {
            match segment {
                Segment::Added(id) => ids.push(id),
                Segment::Plain(plain) if plain.len() < MIN_CACHED_SEGMENT_BYTES => {
                    ids.extend(self.tokenizer.encode(plain, false)?);
                    stats.tokenized_segments += 1;
                }
                Segment::Plain(plain) => match cache.get(plain) {
                    Some(cached) => {
                        ids.extend_from_slice(&cached);
                        stats.cached_segments += 1;
                    }
                    None => {
                        let fresh: Rc<[u32]> = self.tokenizer.encode(plain, false)?.into();
                        ids.extend_from_slice(&fresh);
                        cache.insert(plain, fresh);
                        stats.tokenized_segments += 1;
                    }
                },
            }
        }
        Ok((ids, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bundled() -> (Tokenizer, Arc<AddedTokens>) {
        let path = myelin_tokenize::bundled_tokenizer_path().unwrap();
        let tokenizer = Tokenizer::from_file(&path).unwrap();
        let added = AddedTokens::from_tokenizer_json(&path).expect("deepseek-v3 splits exactly");
        (tokenizer, Arc::new(added))
    }

    const DEEPSEEK_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% else %}{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}";

    #[test]
    fn split_finds_added_tokens_leftmost_longest() {
        let (_, added) = bundled();
        let segments = added.split("<｜User｜>hi<｜Assistant｜>");
        assert_eq!(segments.len(), 3);
        assert_eq!(segments[1], Segment::Plain("hi"));
        assert!(matches!(segments[0], Segment::Added(_)));
        assert_eq!(
            added.split("no special"),
            vec![Segment::Plain("no special")]
        );
    }

    #[test]
    fn segmented_tokens_equal_whole_text_tokens() {
        let (tokenizer, added) = bundled();
        let template = Arc::new(
            ChatTemplate::from_source(
                DEEPSEEK_TEMPLATE.into(),
                "<｜begin▁of▁sentence｜>".into(),
                "<｜end▁of▁sentence｜>".into(),
            )
            .unwrap(),
        );
        let mut routed =
            RouteTokenizer::new(tokenizer.clone(), template.clone(), Some(added), 1 << 20);
        let system = "You are a careful assistant. Answer in full sentences, cite sources, and  keep\n\n  whitespace   odd 12345 ünïcödé 漢字 テスト.";
        let messages = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "  What is 2+2?\n"},
            {"role": "assistant", "content": "4. It is four — obviously!\r\n"},
            {"role": "user", "content": "And <b>3+3</b>?  "}
        ]);
        for round in 0..2 {
            let (ids, stats) = routed
                .prompt_tokens(&PromptInput::Chat(messages.clone()))
                .unwrap();
            let whole = tokenizer
                .encode(&template.render(&messages, true).unwrap(), false)
                .unwrap();
            assert_eq!(ids, whole, "round {round}");
            if round == 1 {
                assert!(stats.cached_segments >= 1, "{stats:?}");
            }
        }
        let text = format!("{system} and then some more text to complete");
        let (ids, _) = routed
            .prompt_tokens(&PromptInput::Text(text.clone()))
            .unwrap();
        assert_eq!(ids, tokenizer.encode(&text, true).unwrap());
    }

    #[test]
    fn cache_is_bounded() {
        let mut cache = SegmentCache::new(10_000);
        for index in 0..1_000 {
            let key = format!("segment number {index:05}");
            cache.insert(&key, Rc::from(vec![index as u32; 10]));
        }
        assert!(cache.current_bytes <= 5_000);
        assert!(cache.current.len() + cache.previous.len() < 200);
        assert!(cache.get("segment number 00999").is_some());
        assert!(cache.get("segment number 00000").is_none());
    }
}
