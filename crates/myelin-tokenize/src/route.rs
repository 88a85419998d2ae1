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
//! Prompts also share leading *bytes* that no added token delimits: the default ChatML
//! template with a tokenizer that lacks `<|im_start|>` makes the whole prompt one segment, and a
//! long system prompt or a conversation's earlier turns are a prefix of the next request either
//! way. The **prefix cache** keeps, for earlier prompts, their token ids at *checkpoints*: the
//! first safe cut at or after every [`CHECKPOINT_SPACING`] bytes. A later prompt starting with
//! the same bytes takes the ids up to its deepest checkpoint held in the cache (found by a hash
//! of the leading bytes, then compared byte for byte) and tokenizes only the rest, chunk by
//! chunk between its own checkpoints. Exactness rests on the cut: a checkpoint sits on an ASCII
//! space between an ASCII letter or digit and an ASCII letter (`word word`), outside any added
//! token. Byte-level BPE pre-tokenizers (GPT-2's, DeepSeek's, Llama 3's, Qwen 2's patterns) end
//! a pre-token there whatever follows, no piece before the cut looks past the letter after
//! it, NFC never composes across an ASCII space, and BPE runs per pre-token: so the ids of the
//! text before the cut are the same whatever comes after it. The cache is switched on only
//! when a self-check on a built-in corpus gives, at every checkpoint, exactly the whole text's
//! ids (on the fast path or on `tokenizers`, whichever this core uses).
//!
//! **Bounded work.** Routing needs only a prompt's prefix, and a data core must not spend
//! seconds on one hostile prompt (`"a" * 7_000_000` is one pre-token, and BPE of one piece
//! costs more per byte the longer it is). So routing's tokenization of a prompt stops at the
//! first of: [`MAX_ROUTED_BYTES`] of text; the start of the first run of one character class
//! (letters, digits, whitespace, other) longer than the piece limit (`--tokenize-max-piece-bytes`:
//! no pre-token can be longer than the run holding it, give or take a leading character); and
//! the fresh-bytes budget (`--tokenize-max-bytes`: bytes actually tokenized, not those served
//! from the caches). The ids up to the stop are exact; the stop itself is handled like a
//! prefix cut (whole blocks kept, minus one). The request is still proxied whole.
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

use crate::{ChatTemplate, FastBpe, Tokenizer};

/// What the router tokenizes for routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// The validated `messages` array, rendered with the chat template before tokenizing
    /// (passed whole, so templates see tool calls and every other field of a message the
    /// engine sees; the request's `tools` go beside it, [`RouteTokenizer::render_with_tools`]).
    Chat(Value),
    /// Completion prompt text (the first prompt of a batch).
    Text(String),
    /// Completion prompt given as token ids (the first prompt of a batch).
    Tokens(Vec<u32>),
}

/// Segments shorter than this are tokenized directly: a lookup would cost about as much.
const MIN_CACHED_SEGMENT_BYTES: usize = 64;
/// Prompt prefixes remembered as matching to their end, per generation (see `PrefixMemo`).
const PREFIX_MEMO_ENTRIES: usize = 32 * 1024;
/// Bytes between the prefix cache's checkpoints: a later prompt re-tokenizes at most about
/// this much of what it shares with an earlier one.
pub const CHECKPOINT_SPACING: usize = 256;
/// Bookkeeping bytes counted per checkpoint of the prefix cache.
const CHECKPOINT_OVERHEAD_BYTES: usize = 64;
/// Routing looks at most this much of a prompt (cached or not): checkpoint scans and prefix
/// hashes are linear in it. 1 MiB is more than any model's context window in text.
pub const MAX_ROUTED_BYTES: usize = 1024 * 1024;
/// Default of `--tokenize-max-bytes`: bytes tokenized afresh per prompt for routing.
pub const DEFAULT_MAX_TOKENIZED_BYTES: usize = 32 * 1024;
/// Default of `--tokenize-max-piece-bytes`: a longer run of one character class ends routing's
/// tokenization where it starts.
pub const DEFAULT_MAX_PIECE_BYTES: usize = 2 * 1024;

/// Why routing's tokenization of a prompt stopped before the end of the text it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    /// [`MAX_ROUTED_BYTES`].
    Length,
    /// A run of one character class longer than `--tokenize-max-piece-bytes`.
    LongPiece,
    /// `--tokenize-max-bytes` of fresh tokenization.
    Budget,
}

impl Truncation {
    pub fn as_str(self) -> &'static str {
        match self {
            Truncation::Length => "length",
            Truncation::LongPiece => "long_piece",
            Truncation::Budget => "budget",
        }
    }
}

/// Why a prompt could not be turned into token ids.
#[derive(Debug, thiserror::Error)]
pub enum RouteTokensError {
    #[error("chat template: {0}")]
    Template(#[from] crate::TemplateError),
    #[error("{0}")]
    Tokenize(#[from] crate::TokenizeError),
}

/// Added tokens of a tokenizer, with the matchers the split and the prefix cache use.
#[derive(Debug, Default)]
pub struct AddedTokens {
    /// Token id of each pattern, by pattern index.
    ids: Vec<u32>,
    /// Leftmost-longest matcher: the tokenizer's own split (one pass, SIMD prefilter; probing
    /// every byte against the tokens sharing its first byte cost ~9% of a shared-prefix
    /// request with DeepSeek's ~800 `<｜...｜>` tokens).
    split_matcher: Option<AhoCorasick>,
    /// Every occurrence, overlapping (for [`Self::spans`]).
    any_matcher: Option<AhoCorasick>,
    /// Bytes of the longest added token.
    max_len: usize,
}

impl AddedTokens {
    /// Reads the `added_tokens` of a tokenizer.json. Returns `None` when splitting on them
    /// would not reproduce the tokenizer exactly (see the module docs).
    pub fn from_tokenizer_json(path: &Path) -> Option<AddedTokens> {
        AddedTokens::from_tokenizer_json_str(&std::fs::read_to_string(path).ok()?)
    }

    /// [`Self::from_tokenizer_json`] of a tokenizer.json's text (e.g. the embedded one).
    pub fn from_tokenizer_json_str(text: &str) -> Option<AddedTokens> {
        let json: Value = serde_json::from_str(text).ok()?;
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
        // No `added_tokens` list at all: not a tokenizer.json this split can be sure of.
        json.get("added_tokens")?.as_array()?;
        let mut tokens = Vec::new();
        for spec in crate::fast_bpe::added::added_token_specs(&json).ok()? {
            if spec.normalized && !normalizer_is_identity {
                return None;
            }
            tokens.push((spec.content, spec.id?));
        }
        AddedTokens::from_tokens(tokens)
    }

    /// Added tokens from (text, id) pairs (empty texts are ignored). `None` if the matchers
    /// cannot be built.
    pub fn from_tokens(tokens: Vec<(String, u32)>) -> Option<AddedTokens> {
        let tokens: Vec<(String, u32)> = tokens
            .into_iter()
            .filter(|(content, _)| !content.is_empty())
            .collect();
        if tokens.is_empty() {
            return Some(AddedTokens::default());
        }
        let patterns: Vec<&str> = tokens.iter().map(|(content, _)| content.as_str()).collect();
        let split_matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .ok()?;
        let any_matcher = AhoCorasick::new(&patterns).ok()?;
        Some(AddedTokens {
            ids: tokens.iter().map(|(_, id)| *id).collect(),
            max_len: patterns
                .iter()
                .map(|pattern| pattern.len())
                .max()
                .unwrap_or(0),
            split_matcher: Some(split_matcher),
            any_matcher: Some(any_matcher),
        })
    }

    /// Whether an added token occurring in `bytes` would cover both `bytes[cut - 1]` and
    /// `bytes[cut]` (then cutting there could change the split).
    fn spans(&self, bytes: &[u8], cut: usize) -> bool {
        let Some(matcher) = &self.any_matcher else {
            return false;
        };
        let first = cut.saturating_sub(self.max_len.saturating_sub(1));
        let last = (cut + self.max_len).min(bytes.len());
        matcher
            .find_overlapping_iter(&bytes[first..last])
            .any(|found| first + found.start() < cut && cut < first + found.end())
    }

    /// Splits `text` into plain segments and added tokens, leftmost-longest like the
    /// tokenizer's own split.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Segment<'a>> {
        let Some(matcher) = &self.split_matcher else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Segment::Plain(text)]
            };
        };
        let mut segments = Vec::new();
        let mut plain_start = 0;
        for found in matcher.find_iter(text) {
            if plain_start < found.start() {
                segments.push(Segment::Plain(&text[plain_start..found.start()]));
            }
            segments.push(Segment::Added(self.ids[found.pattern().as_usize()]));
            plain_start = found.end();
        }
        if plain_start < text.len() {
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

/// Two generations of a byte-bounded map, the older dropped when the newer fills half the
/// budget (an O(1) approximation of LRU): the segment and prefix caches' bookkeeping.
#[derive(Debug)]
struct Generations<K, V> {
    budget_bytes: usize,
    current: HashMap<K, V, foldhash::fast::RandomState>,
    current_bytes: usize,
    previous: HashMap<K, V, foldhash::fast::RandomState>,
    previous_bytes: usize,
}

impl<K: Hash + Eq, V: Clone> Generations<K, V> {
    fn new(budget_bytes: usize) -> Self {
        Generations {
            budget_bytes,
            current: HashMap::default(),
            current_bytes: 0,
            previous: HashMap::default(),
            previous_bytes: 0,
        }
    }

    fn bytes(&self) -> usize {
        self.current_bytes + self.previous_bytes
    }

    /// Whether something of `cost` bytes may be kept at all (at most half the budget).
    fn fits(&self, cost: usize) -> bool {
        cost * 2 <= self.budget_bytes
    }

    /// The value of `key`. One found in the older generation is still in use: it moves to
    /// the newer one, charged `cost` of it, to survive the next rotation.
    fn get<Q>(&mut self, key: &Q, cost: impl Fn(&V) -> usize) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if let Some(value) = self.current.get(key) {
            return Some(value.clone());
        }
        let (key, value) = self.previous.remove_entry(key)?;
        self.charge(cost(&value));
        self.current.insert(key, value.clone());
        Some(value)
    }

    /// Counts `cost` bytes into the newer generation, rotating first when it would overflow.
    fn charge(&mut self, cost: usize) {
        if self.current_bytes + cost > self.budget_bytes / 2 {
            self.rotate();
        }
        self.current_bytes += cost;
    }

    /// Drops the older generation; the newer one becomes it.
    fn rotate(&mut self) {
        self.previous = std::mem::take(&mut self.current);
        self.previous_bytes = self.current_bytes;
        self.current_bytes = 0;
    }

    /// Entries held.
    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Stores `value` in the newer generation (its bytes charged by the caller).
    fn put(&mut self, key: K, value: V) {
        self.current.insert(key, value);
    }
}

/// A bounded cache of segment -> token ids.
#[derive(Debug)]
struct SegmentCache {
    generations: Generations<Box<str>, Rc<[u32]>>,
}

impl SegmentCache {
    fn new(budget_bytes: usize) -> Self {
        SegmentCache {
            generations: Generations::new(budget_bytes),
        }
    }

    fn bytes(&self) -> usize {
        self.generations.bytes()
    }

    fn cost(segment: &str, ids: &[u32]) -> usize {
        segment.len() + ids.len() * 4 + 64
    }

    fn get(&mut self, segment: &str) -> Option<Rc<[u32]>> {
        self.generations
            .get(segment, |ids| Self::cost(segment, ids))
    }

    fn insert(&mut self, segment: &str, ids: Rc<[u32]>) {
        let cost = Self::cost(segment, &ids);
        if !self.generations.fits(cost) {
            return;
        }
        self.generations.charge(cost);
        self.generations.put(segment.into(), ids);
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
    /// Leading bytes whose ids came from the prefix cache.
    pub cached_prefix_bytes: u32,
    /// Bytes tokenized afresh (not from a cache): the work done.
    pub tokenized_bytes: u64,
    /// Why tokenization stopped before the end of the text it was asked for, if it did
    /// (not counting a prefix-first limit the caller asked for).
    pub truncation: Option<Truncation>,
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
    /// Ids of earlier prompts at checkpoints (`None`: off, or not exact for this tokenizer).
    prefixes: Option<PrefixCache>,
    block_size: usize,
    long_prefixes: PrefixMemo,
    /// `--tokenize-max-bytes` (fresh bytes per prompt).
    max_tokenized_bytes: usize,
    /// `--tokenize-max-piece-bytes`.
    max_piece_bytes: usize,
}

/// What is left of a prompt's fresh-tokenization budget.
#[derive(Debug, Clone, Copy)]
struct Budget {
    left: usize,
}

impl Budget {
    const UNLIMITED: Budget = Budget { left: usize::MAX };
}

impl RouteTokenizer {
    /// Builds one core's tokenizer. `added_tokens` is `None` when splitting at added tokens is
    /// not exact for this tokenizer: then prompts are tokenized whole by `tokenizer`, without
    /// the segment cache, the prefix cache or the fast path. `fast` (verified against
    /// `tokenizer` by the caller) tokenizes the plain segments. `cache_budget_bytes` bounds
    /// each of the two caches (0 turns both off); the prefix cache also needs its self-check.
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
        let mut routed = RouteTokenizer {
            tokenizer,
            fast: added_tokens.is_some().then_some(fast).flatten(),
            template,
            added_tokens,
            completion_prefix,
            cache,
            prefixes: None,
            block_size: block_size.max(1),
            long_prefixes: PrefixMemo::default(),
            max_tokenized_bytes: DEFAULT_MAX_TOKENIZED_BYTES,
            max_piece_bytes: DEFAULT_MAX_PIECE_BYTES,
        };
        if cache_budget_bytes > 0 && routed.added_tokens.is_some() {
            match routed.prefix_cuts_are_exact() {
                Ok(()) => routed.prefixes = Some(PrefixCache::new(cache_budget_bytes)),
                Err(reason) => eprintln!("myelin: tokenizer prefix cache off ({reason})"),
            }
        }
        routed
    }

    /// Sets the bounds of routing's work per prompt (see the module docs): fresh bytes
    /// tokenized, and the longest run of one character class tokenized; 0 means no bound.
    pub fn with_limits(mut self, max_tokenized_bytes: usize, max_piece_bytes: usize) -> Self {
        let unbounded = |limit: usize| if limit == 0 { usize::MAX } else { limit };
        self.max_tokenized_bytes = unbounded(max_tokenized_bytes);
        self.max_piece_bytes = unbounded(max_piece_bytes);
        self
    }

    /// Whether the prefix cache is on (its self-check passed).
    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefixes.is_some()
    }

    /// Bytes held by the segment cache and the prefix cache (as counted against the budget).
    pub fn cache_bytes(&self) -> (usize, usize) {
        (
            self.cache.as_ref().map_or(0, SegmentCache::bytes),
            self.prefixes.as_ref().map_or(0, PrefixCache::bytes),
        )
    }

    /// The self-check of the prefix cache: for every text of a built-in corpus (and of the
    /// fast path's), the ids tokenized chunk by chunk between checkpoints equal the ids of the
    /// whole text, on the path this tokenizer uses.
    fn prefix_cuts_are_exact(&mut self) -> Result<(), String> {
        let Some(added_tokens) = self.added_tokens.clone() else {
            return Err("no exact added-token split".into());
        };
        let mut checked_cuts = 0usize;
        for sample in PREFIX_SELF_CHECK
            .iter()
            .chain(crate::fast_bpe::SELF_CHECK_CORPUS)
        {
            // Small spacing: many cuts per sample.
            let text = sample.repeat(3);
            let cuts = checkpoints(&text, &added_tokens, 16);
            let mut whole = Vec::new();
            let mut stats = TokenizeStats::default();
            let mut budget = Budget::UNLIMITED;
            self.encode_segments(&text, &mut whole, &mut stats, &mut budget)
                .map_err(|error| error.to_string())?;
            let mut chunked = Vec::new();
            let mut position = 0;
            for &cut in cuts.iter().chain(std::iter::once(&text.len())) {
                self.encode_segments(&text[position..cut], &mut chunked, &mut stats, &mut budget)
                    .map_err(|error| error.to_string())?;
                position = cut;
            }
            if chunked != whole {
                return Err(format!(
                    "cutting at checkpoints changes the ids of {:?}",
                    sample.chars().take(40).collect::<String>()
                ));
            }
            checked_cuts += cuts.len();
        }
        if let Some(cache) = &mut self.cache {
            *cache = SegmentCache::new(cache.generations.budget_bytes);
        }
        if checked_cuts == 0 {
            return Err("the self-check found no checkpoint".into());
        }
        Ok(())
    }

    /// Renders a chat with the chat template (generation prompt on, as engines do).
    pub fn render(&self, prompt: &PromptInput) -> Result<RenderedPrompt, RouteTokensError> {
        self.render_with_tools(prompt, None)
    }

    /// Whether the chat template reads the request's `tools` (then render with them:
    /// [`Self::render_with_tools`]).
    pub fn template_uses_tools(&self) -> bool {
        self.template.uses_tools()
    }

    /// [`Self::render`] with a chat request's `tools`, which the chat template may write into
    /// the prompt (as the engine's rendering does).
    pub fn render_with_tools(
        &self,
        prompt: &PromptInput,
        tools: Option<&Value>,
    ) -> Result<RenderedPrompt, RouteTokensError> {
        Ok(match prompt {
            PromptInput::Chat(messages) => RenderedPrompt::Text {
                text: self.template.render_with_tools(messages, tools, true)?,
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
    /// The bounds on work (see the module docs) may stop it earlier, the same way.
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
        let asked = byte_limit.unwrap_or(usize::MAX).min(text.len());
        let mut truncation = None;
        let mut end = asked;
        if end > MAX_ROUTED_BYTES {
            end = MAX_ROUTED_BYTES;
            truncation = Some(Truncation::Length);
        }
        // A run that starts before `end` and is too long shows within `end + limit` bytes.
        let scan_to = end.saturating_add(self.max_piece_bytes).min(text.len());
        if let Some(start) = first_long_run(
            &text[..text.floor_char_boundary(scan_to)],
            self.max_piece_bytes,
        ) && start < end
        {
            end = start;
            truncation = Some(Truncation::LongPiece);
        }
        let piece = &text[..text.floor_char_boundary(end)];
        let mut budget = Budget {
            left: self.max_tokenized_bytes,
        };
        let (mut ids, mut stats, stopped_at) =
            self.encode(piece, add_special_tokens, &mut budget)?;
        let covered = match stopped_at {
            Some(at) => {
                truncation = Some(Truncation::Budget);
                at
            }
            None => piece.len(),
        };
        stats.truncation = truncation;
        if covered == text.len() {
            let total = ids.len();
            return Ok(PromptTokens {
                ids,
                complete: true,
                estimated_total: total,
                stats,
            });
        }
        let piece_tokens = ids.len();
        // Extrapolated from what was covered; from too little text, about 4 bytes a token.
        let estimated_total = if covered >= 1024 {
            (piece_tokens * text.len()).div_ceil(covered)
        } else {
            piece_tokens.max(text.len() / 4)
        };
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

    /// Tokenizes `text` segment by segment (special tokens first when asked), starting from
    /// the deepest checkpoint the prefix cache holds for its leading bytes, within `budget`
    /// fresh bytes. Returns the ids, the counters, and where in `text` the budget stopped it
    /// (`None`: it reached the end).
    #[allow(clippy::type_complexity)]
    fn encode(
        &mut self,
        text: &str,
        add_special_tokens: bool,
        budget: &mut Budget,
    ) -> Result<(Vec<u32>, TokenizeStats, Option<usize>), RouteTokensError> {
        let mut stats = TokenizeStats::default();
        let prefix = if add_special_tokens {
            self.completion_prefix.clone()
        } else {
            Some(Vec::new())
        };
        let (Some(added_tokens), Some(prefix)) = (self.added_tokens.clone(), prefix) else {
            stats.tokenized_segments = 1;
            let (part, stopped_at) = if text.len() > budget.left {
                let end = text.floor_char_boundary(budget.left);
                (&text[..end], Some(end))
            } else {
                (text, None)
            };
            budget.left -= part.len();
            stats.tokenized_bytes = part.len() as u64;
            return Ok((
                self.tokenizer.encode(part, add_special_tokens)?,
                stats,
                stopped_at,
            ));
        };
        if self.prefixes.is_none() {
            let mut ids = prefix;
            let stopped_at = self.encode_segments(text, &mut ids, &mut stats, budget)?;
            return Ok((ids, stats, stopped_at));
        }
        let cuts = checkpoints(text, &added_tokens, CHECKPOINT_SPACING);
        let keys = prefix_keys(text.as_bytes(), &cuts, add_special_tokens);
        let hit = self
            .prefixes
            .as_mut()
            .and_then(|prefixes| prefixes.deepest(text, &cuts, &keys));
        let (mut ids, start_index, continued) = match hit {
            Some((index, cached, continued)) => {
                stats.cached_prefix_bytes = u32::try_from(cuts[index]).unwrap_or(u32::MAX);
                (cached, index + 1, Some(continued))
            }
            None => (prefix, 0, None),
        };
        let mut position = start_index.checked_sub(1).map_or(0, |index| cuts[index]);
        let mut marks = Vec::with_capacity(cuts.len() - start_index);
        let mut stopped_at = None;
        for (&cut, &key) in cuts[start_index..].iter().zip(&keys[start_index..]) {
            let stop = self.encode_segments(&text[position..cut], &mut ids, &mut stats, budget)?;
            if let Some(offset) = stop {
                stopped_at = Some(position + offset);
                break;
            }
            marks.push((key, cut, ids.len()));
            position = cut;
        }
        if let (Some(prefixes), Some(&(_, last_cut, last_len))) =
            (self.prefixes.as_mut(), marks.last())
        {
            prefixes.insert(&text[..last_cut], &ids[..last_len], &marks, continued);
        }
        if stopped_at.is_none() {
            stopped_at = self
                .encode_segments(&text[position..], &mut ids, &mut stats, budget)?
                .map(|offset| position + offset);
        }
        Ok((ids, stats, stopped_at))
    }

    /// Appends the ids of `text` (no completion prefix): added tokens split off, plain
    /// segments from the segment cache or tokenized, within `budget` fresh bytes. Returns
    /// where in `text` the budget stopped it (`None`: it reached the end).
    fn encode_segments(
        &mut self,
        text: &str,
        ids: &mut Vec<u32>,
        stats: &mut TokenizeStats,
        budget: &mut Budget,
    ) -> Result<Option<usize>, RouteTokensError> {
        let Some(added_tokens) = self.added_tokens.clone() else {
            let end = text.floor_char_boundary(budget.left.min(text.len()));
            ids.extend(self.tokenizer.encode(&text[..end], false)?);
            stats.tokenized_segments += 1;
            stats.tokenized_bytes += end as u64;
            budget.left -= end;
            return Ok((end < text.len()).then_some(end));
        };
        for segment in added_tokens.split(text) {
            let plain = match segment {
                Segment::Added(id) => {
                    ids.push(id);
                    continue;
                }
                Segment::Plain(plain) => plain,
            };
            let cacheable = plain.len() >= MIN_CACHED_SEGMENT_BYTES;
            if cacheable
                && let Some(cached) = self.cache.as_mut().and_then(|cache| cache.get(plain))
            {
                ids.extend_from_slice(&cached);
                stats.cached_segments += 1;
                continue;
            }
            stats.tokenized_segments += 1;
            if plain.len() > budget.left {
                // Out of budget: tokenize what it allows of this segment and stop there.
                let end = plain.floor_char_boundary(budget.left);
                encode_plain(&self.tokenizer, self.fast.as_mut(), &plain[..end], ids)?;
                stats.tokenized_bytes += end as u64;
                budget.left -= end;
                let offset = plain.as_ptr() as usize - text.as_ptr() as usize;
                return Ok(Some(offset + end));
            }
            let start = ids.len();
            encode_plain(&self.tokenizer, self.fast.as_mut(), plain, ids)?;
            stats.tokenized_bytes += plain.len() as u64;
            budget.left -= plain.len();
            if cacheable && let Some(cache) = self.cache.as_mut() {
                cache.insert(plain, ids[start..].into());
            }
        }
        Ok(None)
    }
}

/// Texts the prefix cache's self-check cuts at every checkpoint: prose, contractions, numbers,
/// code, markup, whitespace runs and non-Latin scripts around the cuts.
const PREFIX_SELF_CHECK: &[&str] = &[
    "You are a helpful assistant. Answer briefly, cite sources, and say when you don't know. It's \
     fine to ask what they'd like; we'll check. Numbers 12345 and 3.14159 stay exact. ",
    "Tools: get_weather(city) returns JSON like {\"temp\": 21, \"unit\": \"C\"}; call it when asked \
     about weather. Do not call tools otherwise.\n\nRules:\n  1. Be kind\n  2. Be brief\n",
    "Ünïcödé wörds and café naïve résumé, 漢字 テスト mixed with English words and   spaces\t\
     tabs\r\nand CRLF lines, emoji 🎉 then words again, ÀB and aB and Ab cases. ",
    "def route(prompt, engines):\n    best = min(engines, key=lambda e: e.cost(prompt))\n    return \
     best  # pick the cheapest engine for this prompt\n",
    "I'll say it's 'quoted' and it'S odd: DON'T, They'RE, we've, you'd, I'm here at 10am or 10 am. ",
];

/// Class of a character for [`first_long_run`]: whitespace, letters (any script), digits, the
/// rest. Pre-tokenizers split where these change, so a pre-token is no longer than the run of
/// one class holding it, give or take a leading character.
fn char_class(c: char) -> u8 {
    if c.is_ascii() {
        let byte = c as u8;
        if byte.is_ascii_whitespace() {
            0
        } else if byte.is_ascii_alphabetic() {
            1
        } else if byte.is_ascii_digit() {
            2
        } else {
            3
        }
    } else if c.is_whitespace() {
        0
    } else if c.is_alphabetic() {
        1
    } else if c.is_numeric() {
        2
    } else {
        3
    }
}

/// Start of the first run of characters of one class (see [`char_class`]) longer than
/// `max_run` bytes in `text`, if any.
///
/// Every request's prompt passes here, so it does not classify every character: it probes
/// one position every `max_run / 2` bytes and scans only from a probe to the end of the run
/// holding it (a few bytes in ordinary text). A run longer than `max_run` bytes starting at `s`
/// always holds a probe in `[s, s + max_run / 2)` whose run reaches past the next probe, so the
/// first such run is found (the proof is in the test against the plain scan).
fn first_long_run(text: &str, max_run: usize) -> Option<usize> {
    if text.len() <= max_run {
        return None;
    }
    let step = (max_run / 2).max(1);
    let mut probe = 0;
    while probe + step < text.len() {
        let at = text.floor_char_boundary(probe);
        let class = text[at..].chars().next().map(char_class);
        let end = text[at..]
            .char_indices()
            .find(|&(_, c)| Some(char_class(c)) != class)
            .map_or(text.len(), |(offset, _)| at + offset);
        if end <= at + step {
            probe = at + step;
            continue;
        }
        let start = text[..at]
            .char_indices()
            .rev()
            .take_while(|&(_, c)| Some(char_class(c)) == class)
            .last()
            .map_or(at, |(index, _)| index);
        if end - start > max_run {
            return Some(start);
        }
        probe = end;
    }
    None
}

/// Checkpoints of `text`: for every multiple of `spacing`, the first safe cut at or after it
/// (see the module docs), strictly increasing, each followed by at least one byte.
fn checkpoints(text: &str, added_tokens: &AddedTokens, spacing: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut cuts = Vec::new();
    let mut target = spacing;
    while target + 1 < bytes.len() {
        let end = (target + spacing).min(bytes.len() - 1);
        let found = (target..end).find(|&cut| is_safe_cut(bytes, cut, added_tokens));
        match found {
            Some(cut) => {
                cuts.push(cut);
                target = (cut / spacing + 1) * spacing;
            }
            None => target += spacing,
        }
    }
    cuts
}

/// A cut before `bytes[cut]`: an ASCII space between an ASCII letter or digit and an ASCII
/// letter, inside no added token.
fn is_safe_cut(bytes: &[u8], cut: usize, added_tokens: &AddedTokens) -> bool {
    cut >= 1
        && cut + 1 < bytes.len()
        && bytes[cut] == b' '
        && bytes[cut - 1].is_ascii_alphanumeric()
        && bytes[cut + 1].is_ascii_alphabetic()
        && !added_tokens.spans(bytes, cut)
}

/// Keys of `bytes[..cut]` for each cut (one pass; `completion` tells prompts that get the
/// completion prefix apart from the rest).
fn prefix_keys(bytes: &[u8], cuts: &[usize], completion: bool) -> Vec<u64> {
    const MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;
    fn mix(value: u64) -> u64 {
        let value = value.wrapping_mul(MULTIPLIER);
        value ^ (value >> 29)
    }
    let mut keys = Vec::with_capacity(cuts.len());
    let mut state = if completion { 0x5eed_0001 } else { 0x5eed_0000 };
    let mut position = 0;
    for &cut in cuts {
        let whole = cut & !7;
        while position < whole {
            let word =
                u64::from_le_bytes(bytes[position..position + 8].try_into().unwrap_or([0; 8]));
            state = mix(state ^ word);
            position += 8;
        }
        let mut tail = [0u8; 8];
        tail[..cut - whole].copy_from_slice(&bytes[whole..cut]);
        keys.push(mix(mix(state ^ u64::from_le_bytes(tail)) ^ cut as u64));
    }
    keys
}

/// Part of an earlier prompt's leading text and its ids: the bytes from `start` (where its
/// parent's shared part ends) up to the prompt's last checkpoint. A prompt that continues an
/// earlier one (the next turn of a conversation, an agent's next step) stores only what it
/// adds and links to the entry it continued, so a conversation's cache is its text once, not
/// once per turn.
#[derive(Debug)]
struct PrefixEntry {
    /// The entry whose text (up to `start`) precedes this one's.
    parent: Option<Rc<PrefixEntry>>,
    /// Byte offset in the prompt of `text[0]`, and the number of ids before `ids[0]`.
    start: usize,
    ids_start: usize,
    text: Box<str>,
    ids: Box<[u32]>,
    /// The cache's count of live bytes, which this entry leaves when dropped.
    live: Rc<Cell<usize>>,
}

impl PrefixEntry {
    fn cost(&self) -> usize {
        self.text.len() + self.ids.len() * 4 + PREFIX_ENTRY_OVERHEAD_BYTES
    }

    /// Whether `text[..cut]` is this entry's chain of texts up to `cut` (byte for byte).
    fn matches(self: &Rc<Self>, text: &[u8], cut: usize) -> bool {
        let mut end = cut;
        let mut link = self;
        loop {
            let own = end - link.start;
            if end > text.len()
                || own > link.text.len()
                || text[link.start..end] != link.text.as_bytes()[..own]
            {
                return false;
            }
            match &link.parent {
                Some(parent) => {
                    end = link.start;
                    link = parent;
                }
                None => return link.start == 0,
            }
        }
    }

    /// The first `ids_len` ids of this entry's chain.
    fn ids_before(self: &Rc<Self>, ids_len: usize) -> Vec<u32> {
        let mut parts = Vec::new();
        let mut end = ids_len;
        let mut link = self;
        loop {
            parts.push(&link.ids[..end - link.ids_start]);
            match &link.parent {
                Some(parent) => {
                    end = link.ids_start;
                    link = parent;
                }
                None => break,
            }
        }
        let mut ids = Vec::with_capacity(ids_len);
        for part in parts.iter().rev() {
            ids.extend_from_slice(part);
        }
        ids
    }
}

impl Drop for PrefixEntry {
    fn drop(&mut self) {
        self.live.set(self.live.get() - self.cost());
        // Unlink the chain iteratively: a long conversation must not recurse once per turn.
        let mut parent = self.parent.take();
        while let Some(entry) = parent {
            parent = match Rc::try_unwrap(entry) {
                Ok(mut entry) => entry.parent.take(),
                Err(_) => None,
            };
        }
    }
}

/// One checkpoint: the entry it is in, its byte offset and the ids before it.
#[derive(Debug, Clone)]
struct Mark {
    entry: Rc<PrefixEntry>,
    cut: usize,
    ids_len: usize,
}

/// Bookkeeping bytes counted per entry of the prefix cache.
const PREFIX_ENTRY_OVERHEAD_BYTES: usize = 96;

/// Where a prompt continues an earlier one: the entry holding its deepest cached checkpoint,
/// the checkpoint's byte offset and the ids before it.
struct Continued {
    entry: Rc<PrefixEntry>,
    cut: usize,
    ids_len: usize,
}

/// Checkpoints of earlier prompts by key of their leading bytes, in two generations: the
/// older is dropped when the newer has taken half the budget, and again while the bytes held
/// pass it. The bytes are those of the entries alive (an entry stays alive while a checkpoint
/// or a later entry that continues it does), counted exactly as they are created and dropped.
#[derive(Debug)]
struct PrefixCache {
    live: Rc<Cell<usize>>,
    generations: Generations<u64, Mark>,
}

impl PrefixCache {
    fn new(budget_bytes: usize) -> Self {
        PrefixCache {
            live: Rc::new(Cell::new(0)),
            generations: Generations::new(budget_bytes),
        }
    }

    fn bytes(&self) -> usize {
        self.live.get() + self.generations.len() * CHECKPOINT_OVERHEAD_BYTES
    }

    /// The deepest checkpoint of `text` held: its index in `cuts`, the ids before it, and the
    /// entry to continue.
    fn deepest(
        &mut self,
        text: &str,
        cuts: &[usize],
        keys: &[u64],
    ) -> Option<(usize, Vec<u32>, Continued)> {
        for index in (0..cuts.len()).rev() {
            let (key, cut) = (keys[index], cuts[index]);
            // Its bytes are counted in `live` already: moving it costs nothing.
            let Some(mark) = self.generations.get(&key, |_| 0) else {
                continue;
            };
            if mark.cut == cut && mark.entry.matches(text.as_bytes(), cut) {
                let ids = mark.entry.ids_before(mark.ids_len);
                return Some((
                    index,
                    ids,
                    Continued {
                        entry: mark.entry,
                        cut,
                        ids_len: mark.ids_len,
                    },
                ));
            }
        }
        None
    }

    /// Remembers `text` (up to the last of `marks`) with its `ids` and its checkpoints
    /// `(key, cut, ids before it)`; with `continued`, only what follows that checkpoint is
    /// stored, linked to the entry it continues.
    fn insert(
        &mut self,
        text: &str,
        ids: &[u32],
        marks: &[(u64, usize, usize)],
        continued: Option<Continued>,
    ) {
        let (parent, start, ids_start) = match continued {
            Some(Continued {
                entry,
                cut,
                ids_len,
            }) => (Some(entry), cut, ids_len),
            None => (None, 0, 0),
        };
        let own_cost = text.len() - start
            + (ids.len() - ids_start) * 4
            + PREFIX_ENTRY_OVERHEAD_BYTES
            + marks.len() * CHECKPOINT_OVERHEAD_BYTES;
        if !self.generations.fits(own_cost) {
            return;
        }
        let entry = Rc::new(PrefixEntry {
            parent,
            start,
            ids_start,
            text: text[start..].into(),
            ids: ids[ids_start..].into(),
            live: self.live.clone(),
        });
        self.live.set(self.live.get() + entry.cost());
        self.generations.charge(own_cost);
        for &(key, cut, ids_len) in marks {
            self.generations.put(
                key,
                Mark {
                    entry: entry.clone(),
                    cut,
                    ids_len,
                },
            );
        }
        drop(entry);
        // Entries older than both generations stay alive while a newer one continues them:
        // rotate again while that is over budget (twice empties the cache).
        while self.bytes() > self.generations.budget_bytes && self.generations.len() > 0 {
            self.generations.rotate();
        }
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
        let path = crate::bundled_tokenizer_path().unwrap();
        let tokenizer = Tokenizer::from_file(&path).unwrap();
        let added = AddedTokens::from_tokenizer_json(&path).expect("deepseek-v3 splits exactly");
        (tokenizer, Arc::new(added))
    }

    fn fast_path() -> FastBpe {
        let path = crate::bundled_tokenizer_path().unwrap();
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
        assert!(cache.generations.current_bytes <= 5_000);
        assert!(cache.generations.current.len() + cache.generations.previous.len() < 200);
        assert!(cache.get("segment number 00999").is_some());
        assert!(cache.get("segment number 00000").is_none());
    }

    const PROSE: &str = "The router keeps a replica of every learned route on each core, so a \
        lookup never waits for another core. Engines evict blocks under pressure; it's why \
        residency matters more than history. Numbers like 2048 or 3.14 and words like don't, \
        we'll and they're appear too.\n\n";

    /// Renders `messages` with `routed`'s template and tokenizes the whole text.
    fn render_and_tokenize(
        routed: &mut RouteTokenizer,
        messages: &[Value],
    ) -> (String, PromptTokens) {
        let chat = routed
            .render(&PromptInput::Chat(Value::Array(messages.to_vec())))
            .unwrap();
        let tokens = routed.tokens(&chat, None).unwrap();
        let RenderedPrompt::Text { text, .. } = chat else {
            unreachable!()
        };
        (text, tokens)
    }

    fn chatml_router(fast: Option<FastBpe>, budget: usize) -> (RouteTokenizer, Tokenizer) {
        let (tokenizer, added) = bundled();
        let routed = RouteTokenizer::new(
            tokenizer.clone(),
            fast,
            Arc::new(ChatTemplate::chatml()),
            Some(added),
            budget,
            16,
        );
        (routed, tokenizer)
    }

    #[test]
    fn shared_prefixes_are_tokenized_once_with_exact_ids() {
        for fast in [None, Some(fast_path())] {
            let fast_path_on = fast.is_some();
            let (mut routed, tokenizer) = chatml_router(fast, 1 << 20);
            assert!(routed.prefix_cache_enabled());
            let system = PROSE.repeat(20);
            let mut first_cached = None;
            for user in 0..4 {
                let messages = json!([
                    {"role": "system", "content": system},
                    {"role": "user", "content": format!("question number {user}: why?")}
                ]);
                let chat = routed.render(&PromptInput::Chat(messages.clone())).unwrap();
                let tokens = routed.tokens(&chat, None).unwrap();
                let RenderedPrompt::Text { text, .. } = &chat else {
                    unreachable!()
                };
                assert_eq!(
                    tokens.ids,
                    tokenizer.encode(text, false).unwrap(),
                    "fast {fast_path_on}, user {user}"
                );
                let cached = tokens.stats.cached_prefix_bytes as usize;
                if user == 0 {
                    assert_eq!(cached, 0);
                } else {
                    // Everything but the last checkpoint interval of the shared part.
                    assert!(
                        cached + 2 * CHECKPOINT_SPACING >= system.len(),
                        "cached {cached} of {}",
                        system.len()
                    );
                    first_cached.get_or_insert(cached);
                }
            }
            // Completion prompts (BOS added) are keyed apart and exact too.
            for tail in ["first tail", "second tail"] {
                let text = format!("{system}{tail}");
                let prompt = routed.render(&PromptInput::Text(text.clone())).unwrap();
                let tokens = routed.tokens(&prompt, None).unwrap();
                assert_eq!(tokens.ids, tokenizer.encode(&text, true).unwrap());
                if tail == "second tail" {
                    assert!(tokens.stats.cached_prefix_bytes > 0);
                }
            }
            assert!(first_cached.is_some());
            let (_, prefix_bytes) = routed.cache_bytes();
            assert!(prefix_bytes > 0 && prefix_bytes <= 1 << 20);
        }
    }

    #[test]
    fn a_growing_conversation_pays_only_for_its_new_turns() {
        let (mut routed, tokenizer) = chatml_router(Some(fast_path()), 1 << 20);
        let mut messages = vec![json!({"role": "system", "content": PROSE.repeat(4)})];
        let mut previous_len = 0;
        for turn in 0..6 {
            messages.push(json!({"role": "user", "content": format!("turn {turn}: {}", PROSE)}));
            let (text, tokens) = render_and_tokenize(&mut routed, &messages);
            assert_eq!(
                tokens.ids,
                tokenizer.encode(&text, false).unwrap(),
                "turn {turn}"
            );
            if turn > 0 {
                let cached = tokens.stats.cached_prefix_bytes as usize;
                assert!(
                    cached + 2 * CHECKPOINT_SPACING >= previous_len,
                    "turn {turn}"
                );
            }
            messages
                .push(json!({"role": "assistant", "content": format!("answer {turn}. {}", PROSE)}));
            previous_len = text.len();
        }
    }

    #[test]
    fn a_conversation_is_cached_once_not_once_per_turn() {
        // Sixteen interleaved conversations of 30 turns in a budget that could not hold each
        // turn's whole text: every turn still starts from the previous turn's checkpoints.
        // About twice the conversations' text and ids at their last turn; holding each turn
        // whole would need well over 3 MiB.
        let budget: usize = 3 << 19;
        let (mut routed, tokenizer) = chatml_router(Some(fast_path()), budget);
        let mut previous = [0usize; 16];
        let mut conversations: Vec<Vec<Value>> = (0..16)
            .map(|c| {
                vec![
                    json!({"role": "system", "content": format!("agent {c}. {}", PROSE.repeat(8))}),
                ]
            })
            .collect();
        for turn in 0..30 {
            for (c, messages) in conversations.iter_mut().enumerate() {
                messages.push(json!({"role": "user", "content": format!("step {turn} of {c}: {}", PROSE.repeat(2))}));
                let (text, tokens) = render_and_tokenize(&mut routed, messages);
                if turn % 7 == 0 {
                    assert_eq!(tokens.ids, tokenizer.encode(&text, false).unwrap());
                }
                if turn > 0 {
                    // Read from the prefix cache: all but the last checkpoint's worth of what
                    // this conversation sent before.
                    let cached = tokens.stats.cached_prefix_bytes as usize;
                    assert!(
                        cached + 2 * CHECKPOINT_SPACING >= previous[c],
                        "conversation {c} turn {turn}: {cached} bytes from the cache of {}",
                        previous[c]
                    );
                }
                previous[c] = text.len();
                messages.push(
                    json!({"role": "assistant", "content": format!("done {turn}. {}", PROSE)}),
                );
            }
            assert!(routed.cache_bytes().1 <= budget);
        }
    }

    #[test]
    fn continued_entries_are_verified_to_their_root_and_bounded() {
        let words = |n: usize, tag: &str| format!("{tag} {}", "alpha beta gamma ".repeat(n));
        let mut cache = PrefixCache::new(1 << 20);
        let root_text = words(40, "root");
        let cuts_of =
            |text: &str| -> Vec<usize> { (1..text.len() / 100).map(|i| i * 100).collect() };
        let marks_of = |text: &str, cuts: &[usize]| -> Vec<(u64, usize, usize)> {
            let keys = prefix_keys(text.as_bytes(), cuts, false);
            cuts.iter()
                .zip(keys)
                .map(|(&cut, key)| (key, cut, cut))
                .collect()
        };
        let ids_of = |text: &str| -> Vec<u32> { (0..text.len() as u32).collect() };
        let cuts = cuts_of(&root_text);
        cache.insert(
            &root_text[..*cuts.last().unwrap()],
            &ids_of(&root_text),
            &marks_of(&root_text, &cuts),
            None,
        );
        let before = cache.bytes();
        // A continuation stores only its own part and reads back the whole chain's ids.
        let child_text = format!("{root_text}{}", words(40, "child"));
        let child_cuts = cuts_of(&child_text);
        let keys = prefix_keys(child_text.as_bytes(), &child_cuts, false);
        let (index, ids, continued) = cache.deepest(&child_text, &child_cuts, &keys).unwrap();
        assert_eq!(child_cuts[index], *cuts.last().unwrap());
        assert_eq!(ids, ids_of(&child_text)[..child_cuts[index]]);
        let new_marks: Vec<_> = marks_of(&child_text, &child_cuts)[index + 1..].to_vec();
        let last = *child_cuts.last().unwrap();
        cache.insert(
            &child_text[..last],
            &ids_of(&child_text)[..last],
            &new_marks,
            Some(continued),
        );
        let added = cache.bytes() - before;
        assert!(
            added < child_text.len() * 5 - root_text.len() * 4,
            "{added} bytes added"
        );
        let (deep, ids, _) = cache.deepest(&child_text, &child_cuts, &keys).unwrap();
        assert_eq!(
            (deep, ids),
            (child_cuts.len() - 1, ids_of(&child_text)[..last].to_vec())
        );
        // The same keys over a text whose root part differs: verified through the link.
        let mut forged = child_text.clone().into_bytes();
        forged[5] = b'X';
        let forged = String::from_utf8(forged).unwrap();
        assert!(cache.deepest(&forged, &child_cuts, &keys).is_none());
    }

    #[test]
    fn a_long_chain_is_dropped_without_recursion_and_the_bytes_return_to_zero() {
        let mut cache = PrefixCache::new(64 << 20);
        let mut text = String::new();
        let mut continued = None;
        for link in 0..20_000usize {
            let start = text.len();
            text.push_str(&format!("link {link:06} words "));
            let cut = text.len();
            let key = prefix_keys(text.as_bytes(), &[cut], false)[0];
            let ids: Vec<u32> = vec![link as u32; cut];
            cache.insert(&text, &ids, &[(key, cut, cut)], continued.take());
            let (_, _, next) = cache.deepest(&text, &[cut], &[key]).unwrap();
            assert_eq!(next.cut, cut);
            assert!(next.entry.start == start || link == 0);
            continued = Some(next);
        }
        drop(continued);
        assert!(cache.bytes() > 0);
        let live = cache.live.clone();
        drop(cache);
        // Dropping 20,000 linked entries returned (recursion would overflow the stack) and
        // every entry left the live count.
        assert_eq!(live.get(), 0);
    }

    #[test]
    fn checkpoints_are_safe_cuts_outside_added_tokens() {
        let added =
            AddedTokens::from_tokens(vec![("<|x y|>".into(), 1), ("ab cd".into(), 2)]).unwrap();
        let text = "word <|x y|> then ab cd and 12 go, a\u{301} b ".repeat(40);
        let cuts = checkpoints(&text, &added, 16);
        assert!(cuts.len() > 20, "{}", cuts.len());
        let bytes = text.as_bytes();
        for &cut in &cuts {
            assert_eq!(bytes[cut], b' ');
            assert!(bytes[cut - 1].is_ascii_alphanumeric() && bytes[cut + 1].is_ascii_alphabetic());
            for (content, _) in [("<|x y|>", 1), ("ab cd", 2)] {
                for (start, _) in text.match_indices(content) {
                    assert!(
                        !(start < cut && cut < start + content.len()),
                        "cut {cut} in {content}"
                    );
                }
            }
        }
        assert!(cuts.windows(2).all(|pair| pair[0] < pair[1]));
        // One per spacing interval at most.
        assert!(cuts.windows(2).all(|pair| pair[0] / 16 < pair[1] / 16));
    }

    #[test]
    fn prefix_cache_is_bounded_and_verifies_bytes() {
        let mut cache = PrefixCache::new(64 * 1024);
        for index in 0..2_000u32 {
            let text = format!("{index:08} {}", "shared words ".repeat(40));
            let cuts = [100usize, 300, 500];
            let keys = prefix_keys(text.as_bytes(), &cuts, false);
            let marks: Vec<_> = cuts
                .iter()
                .zip(&keys)
                .map(|(&cut, &key)| (key, cut, cut / 4))
                .collect();
            cache.insert(&text[..500], &vec![index; 125], &marks, None);
            assert!(cache.bytes() <= 64 * 1024);
        }
        // A key collision cannot return another text's ids: bytes are compared.
        let text = format!("{:08} {}", 1_999, "shared words ".repeat(40));
        let cuts = [100usize, 300, 500];
        let keys = prefix_keys(text.as_bytes(), &cuts, false);
        let (index, ids, _) = cache.deepest(&text, &cuts, &keys).unwrap();
        assert_eq!((index, ids.len()), (2, 125));
        let forged = format!("{:08} {}", 7_777, "shared words ".repeat(40));
        assert!(cache.deepest(&forged, &cuts, &keys).is_none());
        assert!(
            cache
                .deepest(&text, &cuts, &prefix_keys(text.as_bytes(), &cuts, true))
                .is_none()
        );
    }

    /// The plain scan [`first_long_run`] must agree with: classify every character.
    fn first_long_run_plain(text: &str, max_run: usize) -> Option<usize> {
        let mut run_start = 0;
        let mut run_class = None;
        for (index, c) in text.char_indices() {
            let class = char_class(c);
            if run_class != Some(class) {
                if index - run_start > max_run {
                    return Some(run_start);
                }
                run_start = index;
                run_class = Some(class);
            }
        }
        (text.len() - run_start > max_run).then_some(run_start)
    }

    proptest::proptest! {
        #[test]
        fn sampled_long_run_search_agrees_with_the_plain_scan(
            pieces in proptest::collection::vec(
                (proptest::sample::select(vec!["a", "Z", "é", "漢", " ", "\n", "7", "!", "🎉"]), 1usize..40),
                0..24,
            ),
            max_run in 1usize..48,
        ) {
            let text: String = pieces
                .iter()
                .map(|(piece, count)| piece.repeat(*count))
                .collect();
            proptest::prop_assert_eq!(
                first_long_run(&text, max_run),
                first_long_run_plain(&text, max_run),
                "{:?} at {}", text, max_run
            );
        }
    }

    #[test]
    fn long_runs_are_found_by_character_class() {
        assert_eq!(first_long_run("short", 8), None);
        assert_eq!(first_long_run("ab cd ef gh ij kl", 4), None);
        assert_eq!(first_long_run("ab aaaaaaaaaa cd", 8), Some(3));
        assert_eq!(
            first_long_run("x          y", 8),
            Some(1),
            "whitespace runs"
        );
        assert_eq!(first_long_run("a1234567890", 8), Some(1), "digit runs");
        assert_eq!(
            first_long_run("ok!!!!!!!!!!", 8),
            Some(2),
            "punctuation runs"
        );
        assert_eq!(
            first_long_run("漢字テスト漢字", 12),
            Some(0),
            "letters of any script"
        );
        assert_eq!(
            first_long_run("漢字，テスト。漢字", 12),
            None,
            "split by CJK punctuation"
        );
        assert_eq!(
            first_long_run("tail aaaaaaaaaaaa", 8),
            Some(5),
            "a run to the end"
        );
    }

    fn chat_prompt(routed: &RouteTokenizer, content: String) -> RenderedPrompt {
        let messages = json!([{"role": "user", "content": content}]);
        routed.render(&PromptInput::Chat(messages)).unwrap()
    }

    /// Finding 4: a 7 MB prompt that is one "word" is routed on what precedes the word; the
    /// core tokenizes only that (a few bytes), not the 7 MB.
    #[test]
    fn a_huge_one_word_prompt_costs_only_what_precedes_the_word() {
        for fast in [None, Some(fast_path())] {
            let (routed, _) = chatml_router(fast, 1 << 20);
            let mut routed = routed.with_limits(32 * 1024, 2048);
            let prompt = chat_prompt(&routed, "a".repeat(7_000_000));
            for byte_limit in [Some(2048), None] {
                let tokens = routed.tokens(&prompt, byte_limit).unwrap();
                assert!(!tokens.complete);
                assert_eq!(tokens.stats.truncation, Some(Truncation::LongPiece));
                // The ChatML header before the word, nothing of the word.
                assert!(
                    tokens.stats.tokenized_bytes < 64,
                    "{}",
                    tokens.stats.tokenized_bytes
                );
                assert!(
                    tokens.estimated_total >= 1_000_000,
                    "{}",
                    tokens.estimated_total
                );
            }
        }
    }

    /// Honest long prompts: at most `--tokenize-max-bytes` are tokenized per request, the ids
    /// are an exact prefix of the whole text's, and each request sharing the prompt goes
    /// deeper, from the prefix cache.
    #[test]
    fn the_budget_bounds_fresh_bytes_and_cached_bytes_carry_the_prefix_deeper() {
        let (routed, _) = chatml_router(Some(fast_path()), 16 << 20);
        let mut routed = routed.with_limits(8 * 1024, 2048);
        // No repeats: repeated chunks would come from the segment cache, for free.
        let content: String = (0..3000)
            .map(|index| format!("Sentence number {index} is about routers and caches. "))
            .collect();
        let prompt = chat_prompt(&routed, content);
        let RenderedPrompt::Text { text, .. } = &prompt else {
            panic!("text")
        };
        let whole = {
            let (reference, _) = chatml_router(Some(fast_path()), 0);
            let mut reference = reference.with_limits(0, 0);
            reference.tokens(&prompt, None).unwrap()
        };
        assert!(whole.complete && text.len() > 64 * 1024);
        let mut depths = Vec::new();
        for _ in 0..4 {
            let tokens = routed.tokens(&prompt, None).unwrap();
            assert!(!tokens.complete);
            assert_eq!(tokens.stats.truncation, Some(Truncation::Budget));
            assert!(tokens.stats.tokenized_bytes <= 8 * 1024);
            assert_eq!(&whole.ids[..tokens.ids.len()], &tokens.ids[..]);
            assert_eq!(tokens.ids.len() % 16, 0);
            depths.push(tokens.ids.len());
        }
        assert!(
            depths.windows(2).all(|pair| pair[0] < pair[1]),
            "{depths:?}"
        );
        // A long run in the middle: exact ids up to it, nothing of it tokenized.
        let mut routed = routed.with_limits(0, 1024);
        let content = format!("{} {} and more", PROSE.repeat(3), "z".repeat(5000));
        let prompt = chat_prompt(&routed, content);
        let tokens = routed.tokens(&prompt, None).unwrap();
        assert_eq!(tokens.stats.truncation, Some(Truncation::LongPiece));
        let (reference, _) = chatml_router(Some(fast_path()), 0);
        let whole = reference.with_limits(0, 0).tokens(&prompt, None).unwrap();
        assert!(!tokens.ids.is_empty());
        assert_eq!(&whole.ids[..tokens.ids.len()], &tokens.ids[..]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

        /// Prompts sharing random prefixes, tokenized one after another through the caches,
        /// always give the ids of the whole text.
        #[test]
        fn prompts_sharing_prefixes_get_whole_text_ids(
            shared in "([a-zA-Z]{1,9}|[0-9]{1,5}|[ ]{1,3}|[\n\t]|[.,;:!?'\"()-]|é|漢字|🎉|n't|'s){40,400}",
            tails in proptest::collection::vec("([a-zA-Z]{1,9}|[ ]{1,2}|[0-9]{1,4}|[.,!?\n]|ü){0,80}", 1..4),
        ) {
            let (mut routed, tokenizer) = chatml_router(Some(fast_path()), 1 << 20);
            for tail in &tails {
                let text = format!("{shared}{tail}");
                let prompt = RenderedPrompt::Text { text: text.clone(), add_special_tokens: false };
                let tokens = routed.tokens(&prompt, None).unwrap();
                proptest::prop_assert_eq!(tokens.ids, tokenizer.encode(&text, false).unwrap());
            }
        }
    }
}
