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

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use myelin_tokenize::{ChatTemplate, FastBpe, Tokenizer};
use serde_json::Value;

use crate::openai::PromptInput;

/// Segments shorter than this are tokenized directly: a lookup would cost about as much.
const MIN_CACHED_SEGMENT_BYTES: usize = 64;
/// Prompt prefixes remembered as matching to their end, per generation (see `PrefixMemo`).
const PREFIX_MEMO_ENTRIES: usize = 32 * 1024;

/// Why a prompt could not be turned into token ids.
#[derive(Debug, thiserror::Error)]
pub enum RouteTokensError {
    #[error("chat template: {0}")]
    Template(#[from] myelin_tokenize::TemplateError),
    #[error("{0}")]
    Tokenize(#[from] myelin_tokenize::TokenizeError),
}

/// Added tokens of a tokenizer, indexed by first byte for leftmost-longest matching.
#[derive(Debug)]
pub struct AddedTokens {
    /// For each first byte (the index): (token text, id), longest first. Indexed, not hashed:
    /// the split probes it once per byte of every prompt.
    by_first_byte: Vec<Vec<(Box<str>, u32)>>,
}

impl Default for AddedTokens {
    fn default() -> Self {
        AddedTokens {
            by_first_byte: vec![Vec::new(); 256],
        }
    }
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
            tokens.by_first_byte[usize::from(first)].push((content.into(), id));
        }
        for candidates in &mut tokens.by_first_byte {
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
            let matched = self.by_first_byte[usize::from(bytes[position])]
                .iter()
                .find(|(content, _)| bytes[position..].starts_with(content.as_bytes()));
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

/// Hashes of prompt prefixes (their leading bytes) whose match reached their end, so the next
/// prompt starting with the same bytes is tokenized whole at once instead of prefix first.
/// Two generations of bounded sets: the older is dropped when the newer is full.
#[derive(Debug, Default)]
struct PrefixMemo {
    current: HashSet<u64>,
    previous: HashSet<u64>,
}

impl PrefixMemo {
    fn contains(&mut self, key: u64) -> bool {
        if self.current.contains(&key) {
            return true;
        }
        if self.previous.remove(&key) {
            self.insert(key);
            return true;
        }
        false
    }

    fn insert(&mut self, key: u64) {
        if self.current.len() >= PREFIX_MEMO_ENTRIES {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(key);
    }
}

/// Counters of one tokenization, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeStats {
    pub cached_segments: u32,
    pub tokenized_segments: u32,
}

/// A prompt ready to tokenize: rendered chat or completion text, or ids given by the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenderedPrompt {
    /// Text; `add_special_tokens` for completion prompts (the engine adds the BOS), not for
    /// rendered chats (the template writes it).
    Text {
        text: String,
        add_special_tokens: bool,
    },
    /// Token ids from the request.
    Tokens(Vec<u32>),
}

/// Token ids of a prompt, or of its leading part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    /// Exact ids of the prompt, or of its first whole blocks when `complete` is false.
    pub ids: Vec<u32>,
    /// True when `ids` are the whole prompt.
    pub complete: bool,
    /// Prompt length in tokens: exact when complete, extrapolated from the bytes covered
    /// otherwise.
    pub estimated_total: usize,
    pub stats: TokenizeStats,
}

/// Per-core tokenizer for routing: template rendering, tokenization, segment cache.
pub struct RouteTokenizer {
    tokenizer: Tokenizer,
    /// The exact fast path for plain segments, when the tokenizer is one it reproduces.
    fast: Option<FastBpe>,
    template: Arc<ChatTemplate>,
    added_tokens: Option<Arc<AddedTokens>>,
    /// Ids the tokenizer puts before a completion prompt (usually the BOS), when it only
    /// prepends: then a completion prompt is `prefix + segments` and can use the cache too.
    completion_prefix: Option<Vec<u32>>,
    cache: Option<SegmentCache>,
    block_size: usize,
    long_prefixes: PrefixMemo,
}

impl RouteTokenizer {
    /// Builds one core's tokenizer. `added_tokens` is `None` when splitting at added tokens is
    /// not exact for this tokenizer: then prompts are tokenized whole by `tokenizer`, without
    /// the segment cache or the fast path. `fast` (verified against `tokenizer` by the caller)
    /// tokenizes the plain segments.
    pub fn new(
        tokenizer: Tokenizer,
        fast: Option<FastBpe>,
        template: Arc<ChatTemplate>,
        added_tokens: Option<Arc<AddedTokens>>,
        cache_budget_bytes: usize,
        block_size: usize,
    ) -> RouteTokenizer {
        let completion_prefix = tokenizer.completion_prefix();
        let cache = (cache_budget_bytes > 0 && added_tokens.is_some())
            .then(|| SegmentCache::new(cache_budget_bytes));
        RouteTokenizer {
            tokenizer,
            fast: added_tokens.is_some().then_some(fast).flatten(),
            template,
            added_tokens,
            completion_prefix,
            cache,
            block_size: block_size.max(1),
            long_prefixes: PrefixMemo::default(),
        }
    }

    /// Renders a chat with the chat template (generation prompt on, as engines do).
    pub fn render(&self, prompt: &PromptInput) -> Result<RenderedPrompt, RouteTokensError> {
        Ok(match prompt {
            PromptInput::Chat(messages) => RenderedPrompt::Text {
                text: self.template.render(messages, true)?,
                add_special_tokens: false,
            },
            PromptInput::Text(text) => RenderedPrompt::Text {
                text: text.clone(),
                add_special_tokens: true,
            },
            PromptInput::Tokens(ids) => RenderedPrompt::Tokens(ids.clone()),
        })
    }

    /// Token ids of a request's prompt as the engine computes them.
    ///
    /// With `byte_limit`, only the first `byte_limit` bytes of a longer text are tokenized and
    /// the ids are cut back to whole blocks, minus one block: the text cut can change the last
    /// tokens before it (the tokenizer would have merged across it), never tokens a block
    /// before it unless one pre-token (a run of letters without a space) is longer than a block.
    pub fn tokens(
        &mut self,
        prompt: &RenderedPrompt,
        byte_limit: Option<usize>,
    ) -> Result<PromptTokens, RouteTokensError> {
        let (text, add_special_tokens) = match prompt {
            RenderedPrompt::Tokens(ids) => {
                return Ok(PromptTokens {
                    ids: ids.clone(),
                    complete: true,
                    estimated_total: ids.len(),
                    stats: TokenizeStats::default(),
                });
            }
            RenderedPrompt::Text {
                text,
                add_special_tokens,
            } => (text.as_str(), *add_special_tokens),
        };
        let piece = match byte_limit {
            Some(limit) if text.len() > limit => &text[..text.floor_char_boundary(limit)],
            _ => text,
        };
        let (mut ids, stats) = self.encode(piece, add_special_tokens)?;
        if piece.len() == text.len() {
            let total = ids.len();
            return Ok(PromptTokens {
                ids,
                complete: true,
                estimated_total: total,
                stats,
            });
        }
        let piece_tokens = ids.len();
        let estimated_total = (piece_tokens * text.len()).div_ceil(piece.len().max(1));
        let kept_blocks = piece_tokens.saturating_sub(self.block_size) / self.block_size;
        ids.truncate(kept_blocks * self.block_size);
        Ok(PromptTokens {
            ids,
            complete: false,
            estimated_total,
            stats,
        })
    }

    /// Key of a prompt's leading `limit` bytes, when the prompt is longer than that.
    fn prefix_key(prompt: &RenderedPrompt, limit: usize) -> Option<u64> {
        let RenderedPrompt::Text { text, .. } = prompt else {
            return None;
        };
        if text.len() <= limit {
            return None;
        }
        let mut hasher = DefaultHasher::new();
        text[..text.floor_char_boundary(limit)].hash(&mut hasher);
        Some(hasher.finish())
    }

    /// Whether a prompt with the same leading `limit` bytes matched some backend to the end
    /// of that prefix before (then tokenizing the prefix alone would be wasted).
    pub fn is_known_long_prefix(&mut self, prompt: &RenderedPrompt, limit: usize) -> bool {
        Self::prefix_key(prompt, limit).is_some_and(|key| self.long_prefixes.contains(key))
    }

    /// Remembers that this prompt's leading `limit` bytes matched to their end.
    pub fn remember_long_prefix(&mut self, prompt: &RenderedPrompt, limit: usize) {
        if let Some(key) = Self::prefix_key(prompt, limit) {
            self.long_prefixes.insert(key);
        }
    }

    /// Tokenizes `text` segment by segment (special tokens first when asked).
    fn encode(
        &mut self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, TokenizeStats), RouteTokensError> {
        let mut stats = TokenizeStats::default();
        let prefix = if add_special_tokens {
            self.completion_prefix.clone()
        } else {
            Some(Vec::new())
        };
        let (Some(added_tokens), Some(prefix)) = (&self.added_tokens, prefix) else {
            stats.tokenized_segments = 1;
            return Ok((self.tokenizer.encode(text, add_special_tokens)?, stats));
        };
        let mut ids = prefix;
        for segment in added_tokens.split(text) {
            let plain = match segment {
                Segment::Added(id) => {
                    ids.push(id);
                    continue;
                }
                Segment::Plain(plain) => plain,
            };
            let cache = self
                .cache
                .as_mut()
                .filter(|_| plain.len() >= MIN_CACHED_SEGMENT_BYTES);
            if let Some(cache) = cache {
                if let Some(cached) = cache.get(plain) {
                    ids.extend_from_slice(&cached);
                    stats.cached_segments += 1;
                    continue;
                }
                let start = ids.len();
                encode_plain(&self.tokenizer, self.fast.as_mut(), plain, &mut ids)?;
                cache.insert(plain, ids[start..].into());
            } else {
                encode_plain(&self.tokenizer, self.fast.as_mut(), plain, &mut ids)?;
            }
            stats.tokenized_segments += 1;
        }
        Ok((ids, stats))
    }
}

/// Appends the ids of `plain` (text without added tokens): the fast path when there is one.
fn encode_plain(
    tokenizer: &Tokenizer,
    fast: Option<&mut FastBpe>,
    plain: &str,
    ids: &mut Vec<u32>,
) -> Result<(), RouteTokensError> {
    match fast {
        Some(fast) => fast.encode_plain(plain, ids),
        None => ids.extend(tokenizer.encode(plain, false)?),
    }
    Ok(())
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

    fn fast_path() -> FastBpe {
        let path = myelin_tokenize::bundled_tokenizer_path().unwrap();
        FastBpe::from_tokenizer_json(&path)
            .unwrap()
            .expect("the bundled tokenizer has a fast path")
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
        for fast in [None, Some(fast_path())] {
            segmented_tokens_equal_whole_text_tokens_with(fast);
        }
    }

    fn segmented_tokens_equal_whole_text_tokens_with(fast: Option<FastBpe>) {
        let (tokenizer, added) = bundled();
        let template = Arc::new(
            ChatTemplate::from_source(
                DEEPSEEK_TEMPLATE.into(),
                "<｜begin▁of▁sentence｜>".into(),
                "<｜end▁of▁sentence｜>".into(),
            )
            .unwrap(),
        );
        let mut routed = RouteTokenizer::new(
            tokenizer.clone(),
            fast,
            template.clone(),
            Some(added),
            1 << 20,
            16,
        );
        let system = "You are a careful assistant. Answer in full sentences, cite sources, and  keep\n\n  whitespace   odd 12345 ünïcödé 漢字 テスト.";
        let messages = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "  What is 2+2?\n"},
            {"role": "assistant", "content": "4. It is four — obviously!\r\n"},
            {"role": "user", "content": "And <b>3+3</b>?  "}
        ]);
        let chat = routed.render(&PromptInput::Chat(messages.clone())).unwrap();
        for round in 0..2 {
            let tokens = routed.tokens(&chat, None).unwrap();
            let whole = tokenizer
                .encode(&template.render(&messages, true).unwrap(), false)
                .unwrap();
            assert_eq!(tokens.ids, whole, "round {round}");
            assert!(tokens.complete);
            assert_eq!(tokens.estimated_total, whole.len());
            if round == 1 {
                assert!(tokens.stats.cached_segments >= 1, "{:?}", tokens.stats);
            }
        }
        let text = format!("{system} and then some more text to complete");
        let completion = routed.render(&PromptInput::Text(text.clone())).unwrap();
        let tokens = routed.tokens(&completion, None).unwrap();
        assert_eq!(tokens.ids, tokenizer.encode(&text, true).unwrap());
        let ids = routed
            .tokens(&RenderedPrompt::Tokens(vec![5, 6, 7]), Some(1))
            .unwrap();
        assert!(ids.complete);
        assert_eq!(ids.ids, vec![5, 6, 7]);
    }

    #[test]
    fn a_prefix_tokenization_is_an_exact_prefix_in_whole_blocks() {
        for fast in [None, Some(fast_path())] {
            a_prefix_tokenization_is_an_exact_prefix_with(fast);
        }
    }

    fn a_prefix_tokenization_is_an_exact_prefix_with(fast: Option<FastBpe>) {
        let (tokenizer, added) = bundled();
        let template = Arc::new(ChatTemplate::chatml());
        let sentence = "Routers tokenize prompts; engines cache their blocks. Numbers like 123456 \
                        and punctuation (a, b; c!) and  double  spaces\n\nand newlines. ";
        let messages = json!([
            {"role": "system", "content": sentence.repeat(20)},
            {"role": "user", "content": "question?"}
        ]);
        let mut routed = RouteTokenizer::new(tokenizer, fast, template, Some(added), 1 << 20, 16);
        let chat = routed.render(&PromptInput::Chat(messages)).unwrap();
        let whole = routed.tokens(&chat, None).unwrap();
        for limit in [100, 777, 1000, 1500, 2048] {
            let part = routed.tokens(&chat, Some(limit)).unwrap();
            assert!(!part.complete, "limit {limit}");
            assert_eq!(part.ids.len() % 16, 0);
            assert!(!part.ids.is_empty() || limit < 200);
            assert_eq!(&whole.ids[..part.ids.len()], &part.ids[..], "limit {limit}");
            let error = part.estimated_total.abs_diff(whole.ids.len());
            assert!(
                error * 5 < whole.ids.len(),
                "estimate {} vs {}",
                part.estimated_total,
                whole.ids.len()
            );
        }
        let beyond = routed.tokens(&chat, Some(1 << 20)).unwrap();
        assert!(beyond.complete);
        assert_eq!(beyond.ids, whole.ids);
    }

    #[test]
    fn long_prefixes_are_remembered_by_their_leading_bytes() {
        let (tokenizer, added) = bundled();
        let mut routed = RouteTokenizer::new(
            tokenizer,
            None,
            Arc::new(ChatTemplate::chatml()),
            Some(added),
            0,
            16,
        );
        let text = |tail: &str| RenderedPrompt::Text {
            text: format!("{}{tail}", "shared ".repeat(100)),
            add_special_tokens: false,
        };
        assert!(!routed.is_known_long_prefix(&text("a"), 256));
        routed.remember_long_prefix(&text("a"), 256);
        assert!(
            routed.is_known_long_prefix(&text("b"), 256),
            "same first 256 bytes"
        );
        assert!(
            !routed.is_known_long_prefix(&text("b"), 512),
            "other limit, other key"
        );
        let short = RenderedPrompt::Text {
            text: "short".into(),
            add_special_tokens: false,
        };
        routed.remember_long_prefix(&short, 256);
        assert!(
            !routed.is_known_long_prefix(&short, 256),
            "short prompts are never prefixes"
        );
        let mut memo = PrefixMemo::default();
        for key in 0..(PREFIX_MEMO_ENTRIES as u64 * 3) {
            memo.insert(key);
        }
        assert!(memo.current.len() + memo.previous.len() <= 2 * PREFIX_MEMO_ENTRIES);
        assert!(!memo.contains(0));
        assert!(memo.contains(PREFIX_MEMO_ENTRIES as u64 * 3 - 1));
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
