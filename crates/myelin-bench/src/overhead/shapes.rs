//! Prompt shapes of the overhead benchmark: chat request bodies, each a pure function of a
//! request index, cheap enough to build on the load generator's hot path (the 2k-token
//! texts are rendered once up front; per request only a few words are drawn).
//!
//! Text is made of single-token English words of the bundled tokenizer's vocabulary (see
//! [`TokenAlphabet::words_from_tokenizer`]), so a text of N words is about N tokens for the
//! router. Requests that must be unique start with [`INDEX_WORDS`] words that spell the
//! request index in base (number of words): distinct indexes give distinct texts, exactly.

use std::fmt::Write as _;
use std::sync::Arc;

use crate::rng;
use crate::workload::TokenAlphabet;

/// Words spelling a request index (base = alphabet size >= 256: unique below 256^6).
pub const INDEX_WORDS: usize = 6;
/// `short`: system words, user words (with the index words), about 20 tokens in all.
pub const SHORT_SYSTEM_WORDS: usize = 6;
pub const SHORT_USER_WORDS: usize = 14;
/// The ~2,000-token texts.
pub const LONG_WORDS: usize = 2_000;
/// `shared-prefix-2k`: the unique user turn after the shared system prompt.
pub const SHARED_USER_WORDS: usize = 16;
/// `unique-2k`: distinct 2k-token bodies rendered up front; each request is its own index
/// words plus one of these (so no two requests share even their first block).
pub const UNIQUE_BODIES: usize = 64;
/// `multi-turn`: conversations in flight at once, turns before a conversation starts over,
/// and words per system prompt, user turn and (replayed) assistant turn.
pub const CONVERSATIONS: u64 = 16;
pub const TURNS: u64 = 8;
pub const TURN_SYSTEM_WORDS: usize = 48;
pub const TURN_USER_WORDS: usize = 96;
pub const TURN_ASSISTANT_WORDS: usize = 48;

/// The model name requests carry (the instant engines list it in /v1/models).
pub const MODEL: &str = "instant";

/// Randomness streams of the shapes (see [`rng::draw`]).
mod stream {
    pub const SHORT_SYSTEM: u64 = 0x6f73_7973_0000_0000;
    pub const SHORT_USER: u64 = 0x6f73_7573_0000_0000;
    pub const SHARED_SYSTEM: u64 = 0x6f70_7379_0000_0000;
    pub const SHARED_USER: u64 = 0x6f70_7573_0000_0000;
    pub const UNIQUE_BODY: u64 = 0x6f75_626f_0000_0000;
    pub const REPEATED: u64 = 0x6f72_6570_0000_0000;
    pub const TURN_SYSTEM: u64 = 0x6f74_7379_0000_0000;
    pub const TURN_USER: u64 = 0x6f74_7573_0000_0000;
    pub const TURN_ASSISTANT: u64 = 0x6f74_6173_0000_0000;
}

/// A prompt shape (`--shapes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Shape {
    Short,
    SharedPrefix2k,
    Unique2k,
    Repeated2k,
    MultiTurn,
}

impl Shape {
    /// Every shape, in report order.
    pub const ALL: [Shape; 5] = [
        Shape::Short,
        Shape::SharedPrefix2k,
        Shape::Unique2k,
        Shape::Repeated2k,
        Shape::MultiTurn,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Short => "short",
            Shape::SharedPrefix2k => "shared-prefix-2k",
            Shape::Unique2k => "unique-2k",
            Shape::Repeated2k => "repeated-2k",
            Shape::MultiTurn => "multi-turn",
        }
    }

    pub fn from_name(name: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|shape| shape.name() == name)
    }

    /// Parses `--shapes`: comma-separated names, or `all`.
    pub fn parse_list(list: &str) -> Result<Vec<Shape>, String> {
        let mut shapes = Vec::new();
        for name in list.split(',').map(str::trim) {
            if name == "all" {
                for shape in Shape::ALL {
                    if !shapes.contains(&shape) {
                        shapes.push(shape);
                    }
                }
                continue;
            }
            let shape = Shape::from_name(name).ok_or_else(|| {
                format!(
                    "unknown shape {name:?} (known: {}, all)",
                    Shape::ALL.map(Shape::name).join(", ")
                )
            })?;
            if !shapes.contains(&shape) {
                shapes.push(shape);
            }
        }
        if shapes.is_empty() {
            return Err("no shapes".into());
        }
        Ok(shapes)
    }
}

/// Builds the request bodies of one shape.
pub struct ShapeGenerator {
    shape: Shape,
    words: Arc<Vec<String>>,
    seed: u64,
    max_tokens: u32,
    stream: bool,
    /// `shared-prefix-2k`: the system prompt; `repeated-2k`: the whole body.
    fixed: String,
    /// `unique-2k`: the bodies behind the index words.
    pool: Vec<String>,
}

impl ShapeGenerator {
    /// A generator drawing from `alphabet`'s words (it must be a text alphabet with at least
    /// 256 words).
    pub fn new(
        shape: Shape,
        alphabet: &TokenAlphabet,
        seed: u64,
        max_tokens: u32,
        stream: bool,
    ) -> Result<Self, String> {
        let words = alphabet.word_list();
        if words.len() < 256 {
            return Err(format!(
                "prompt shapes need a text alphabet of at least 256 words, got {}",
                words.len()
            ));
        }
        Ok(Self::from_words(
            shape,
            Arc::new(words),
            seed,
            max_tokens,
            stream,
        ))
    }

    fn from_words(
        shape: Shape,
        words: Arc<Vec<String>>,
        seed: u64,
        max_tokens: u32,
        stream: bool,
    ) -> Self {
        let mut generator = Self {
            shape,
            words,
            seed,
            max_tokens,
            stream,
            fixed: String::new(),
            pool: Vec::new(),
        };
        match shape {
            Shape::SharedPrefix2k => {
                generator.fixed = generator.text(stream::SHARED_SYSTEM, 0, LONG_WORDS);
            }
            Shape::Repeated2k => {
                let text = generator.text(stream::REPEATED, 0, LONG_WORDS);
                generator.fixed = generator.body(&[("user", &text)]);
            }
            Shape::Unique2k => {
                generator.pool = (0..UNIQUE_BODIES as u64)
                    .map(|body| generator.text(stream::UNIQUE_BODY, body, LONG_WORDS - INDEX_WORDS))
                    .collect();
            }
            Shape::Short | Shape::MultiTurn => {}
        }
        generator
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The JSON body of request `index`.
    pub fn request_body(&self, index: u64) -> String {
        match self.shape {
            Shape::Short => {
                let system = self.text(stream::SHORT_SYSTEM, index, SHORT_SYSTEM_WORDS);
                let mut user = self.index_words(index);
                user.push_str(&self.text(
                    stream::SHORT_USER,
                    index,
                    SHORT_USER_WORDS - INDEX_WORDS,
                ));
                self.body(&[("system", &system), ("user", &user)])
            }
            Shape::SharedPrefix2k => {
                let mut user = self.index_words(index);
                user.push_str(&self.text(
                    stream::SHARED_USER,
                    index,
                    SHARED_USER_WORDS - INDEX_WORDS,
                ));
                self.body(&[("system", &self.fixed), ("user", &user)])
            }
            Shape::Unique2k => {
                let body = &self.pool[(index % UNIQUE_BODIES as u64) as usize];
                let mut user = self.index_words(index);
                user.push_str(body);
                self.body(&[("user", &user)])
            }
            Shape::Repeated2k => self.fixed.clone(),
            Shape::MultiTurn => {
                let (conversation, turn) = conversation_turn(index);
                let system = self.text(stream::TURN_SYSTEM, conversation, TURN_SYSTEM_WORDS);
                let mut texts = vec![("system", system)];
                for earlier in 0..=turn {
                    let key = conversation * TURNS + earlier;
                    texts.push(("user", self.text(stream::TURN_USER, key, TURN_USER_WORDS)));
                    if earlier < turn {
                        texts.push((
                            "assistant",
                            self.text(stream::TURN_ASSISTANT, key, TURN_ASSISTANT_WORDS),
                        ));
                    }
                }
                let messages: Vec<(&str, &str)> = texts
                    .iter()
                    .map(|(role, text)| (*role, text.as_str()))
                    .collect();
                self.body(&messages)
            }
        }
    }

    /// `count` words drawn from (stream, key), each with a leading space.
    fn text(&self, stream: u64, key: u64, count: usize) -> String {
        let mut text = String::with_capacity(count * 8);
        let base = key.wrapping_mul(LONG_WORDS as u64 * 4);
        for position in 0..count as u64 {
            let draw = rng::draw_below(
                self.seed,
                stream,
                base.wrapping_add(position),
                self.words.len() as u64,
            );
            text.push(' ');
            text.push_str(&self.words[draw as usize]);
        }
        text
    }

    /// [`INDEX_WORDS`] words spelling `index` in base (number of words), least significant
    /// first.
    fn index_words(&self, index: u64) -> String {
        let base = self.words.len() as u64;
        let mut rest = index;
        let mut text = String::with_capacity(INDEX_WORDS * 8);
        for _ in 0..INDEX_WORDS {
            text.push(' ');
            text.push_str(&self.words[(rest % base) as usize]);
            rest /= base;
        }
        text
    }

    /// A chat completions body with these messages. Contents are the alphabet's lowercase
    /// ASCII words and spaces, which JSON needs no escaping for.
    fn body(&self, messages: &[(&str, &str)]) -> String {
        let length: usize = messages.iter().map(|(_, text)| text.len() + 32).sum();
        let mut body = String::with_capacity(length + 96);
        let _ = write!(
            body,
            r#"{{"model":"{MODEL}","max_tokens":{},"stream":{},"messages":["#,
            self.max_tokens, self.stream
        );
        for (position, (role, text)) in messages.iter().enumerate() {
            if position > 0 {
                body.push(',');
            }
            debug_assert!(
                text.bytes()
                    .all(|byte| byte == b' ' || byte.is_ascii_alphabetic())
            );
            let _ = write!(
                body,
                r#"{{"role":"{role}","content":"{}"}}"#,
                text.trim_start()
            );
        }
        body.push_str("]}");
        body
    }
}

/// The (conversation, turn) of multi-turn request `index`: [`CONVERSATIONS`] conversations
/// interleaved round-robin; each runs [`TURNS`] turns, then its slot starts a new one.
pub fn conversation_turn(index: u64) -> (u64, u64) {
    let slot = index % CONVERSATIONS;
    let round = index / CONVERSATIONS;
    let generation = round / TURNS;
    (generation * CONVERSATIONS + slot, round % TURNS)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn words() -> Arc<Vec<String>> {
        // 300 distinct lowercase words: "aaa", "aab", ...
        Arc::new(
            (0..300u32)
                .map(|index| {
                    let letter = |value: u32| char::from(b'a' + (value % 26) as u8);
                    [letter(index / 676), letter(index / 26), letter(index)]
                        .iter()
                        .collect()
                })
                .collect(),
        )
    }

    fn generator(shape: Shape) -> ShapeGenerator {
        ShapeGenerator::from_words(shape, words(), 42, 16, false)
    }

    fn messages(body: &str) -> Vec<(String, String)> {
        let value: serde_json::Value = serde_json::from_str(body).expect("valid JSON");
        assert_eq!(value["model"], MODEL);
        assert_eq!(value["max_tokens"], 16);
        assert_eq!(value["stream"], false);
        value["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|message| {
                (
                    message["role"].as_str().unwrap().to_string(),
                    message["content"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    fn word_count(text: &str) -> usize {
        text.split_whitespace().count()
    }

    #[test]
    fn shape_lists_parse_names_and_all() {
        assert_eq!(Shape::parse_list("all").unwrap(), Shape::ALL);
        assert_eq!(
            Shape::parse_list("short, shared-prefix-2k,short").unwrap(),
            [Shape::Short, Shape::SharedPrefix2k]
        );
        assert!(Shape::parse_list("short,long").is_err());
        for shape in Shape::ALL {
            assert_eq!(Shape::from_name(shape.name()), Some(shape));
        }
    }

    #[test]
    fn short_requests_are_small_and_unique() {
        let generator = generator(Shape::Short);
        let bodies: HashSet<String> = (0..2_000).map(|i| generator.request_body(i)).collect();
        assert_eq!(bodies.len(), 2_000);
        let chat = messages(&generator.request_body(7));
        let roles: Vec<&str> = chat.iter().map(|(role, _)| role.as_str()).collect();
        assert_eq!(roles, ["system", "user"]);
        let words: usize = chat.iter().map(|(_, text)| word_count(text)).sum();
        assert_eq!(words, SHORT_SYSTEM_WORDS + SHORT_USER_WORDS);
    }

    #[test]
    fn shared_prefix_requests_share_their_system_prompt_exactly() {
        let generator = generator(Shape::SharedPrefix2k);
        let first = messages(&generator.request_body(0));
        assert_eq!(first[0].0, "system");
        assert_eq!(word_count(&first[0].1), LONG_WORDS);
        let mut users = HashSet::new();
        for index in [0, 1, 2, 299, 300, 1_000_000] {
            let chat = messages(&generator.request_body(index));
            assert_eq!(chat.len(), 2);
            assert_eq!(chat[0], first[0], "system prompt differs at {index}");
            assert_eq!(chat[1].0, "user");
            assert_eq!(word_count(&chat[1].1), SHARED_USER_WORDS);
            users.insert(chat[1].1.clone());
        }
        assert_eq!(users.len(), 6, "user turns must be unique");
    }

    #[test]
    fn unique_requests_are_distinct_from_their_first_words() {
        let generator = generator(Shape::Unique2k);
        let mut heads = HashSet::new();
        for index in 0..(3 * UNIQUE_BODIES as u64) {
            let chat = messages(&generator.request_body(index));
            assert_eq!(chat.len(), 1);
            assert_eq!(word_count(&chat[0].1), LONG_WORDS);
            let head: Vec<&str> = chat[0].1.split_whitespace().take(INDEX_WORDS).collect();
            assert!(heads.insert(head.join(" ")), "repeated head at {index}");
        }
        // Far-apart indexes too (the open loop starts at a large offset).
        assert_ne!(
            generator.request_body(1 << 33),
            generator.request_body((1 << 33) + 300 * 300)
        );
    }

    #[test]
    fn repeated_requests_are_identical() {
        let generator = generator(Shape::Repeated2k);
        let first = generator.request_body(0);
        assert_eq!(first, generator.request_body(12_345));
        let chat = messages(&first);
        assert_eq!(word_count(&chat[0].1), LONG_WORDS);
    }

    #[test]
    fn multi_turn_conversations_grow_by_one_turn_and_keep_their_history() {
        let generator = generator(Shape::MultiTurn);
        // Request i and i + CONVERSATIONS are consecutive turns of one conversation.
        let mut previous = messages(&generator.request_body(3));
        assert_eq!(previous.len(), 2);
        for turn in 1..TURNS {
            let chat = messages(&generator.request_body(3 + turn * CONVERSATIONS));
            assert_eq!(chat.len(), previous.len() + 2, "turn {turn}");
            assert_eq!(chat[..previous.len()], previous[..], "history changed");
            assert_eq!(chat[chat.len() - 2].0, "assistant");
            assert_eq!(chat[chat.len() - 1].0, "user");
            previous = chat;
        }
        // After TURNS turns the slot starts a new conversation: a new system prompt.
        let next = messages(&generator.request_body(3 + TURNS * CONVERSATIONS));
        assert_eq!(next.len(), 2);
        assert_ne!(next[0], previous[0]);
        // Interleaved conversations differ.
        assert_ne!(
            messages(&generator.request_body(4))[0],
            messages(&generator.request_body(3))[0]
        );
    }

    #[test]
    fn conversation_turns_interleave_round_robin() {
        assert_eq!(conversation_turn(0), (0, 0));
        assert_eq!(conversation_turn(CONVERSATIONS - 1), (CONVERSATIONS - 1, 0));
        assert_eq!(conversation_turn(CONVERSATIONS), (0, 1));
        assert_eq!(conversation_turn(CONVERSATIONS * TURNS), (CONVERSATIONS, 0));
    }

    #[test]
    fn stream_and_max_tokens_reach_the_body() {
        let generator = ShapeGenerator::from_words(Shape::Short, words(), 1, 3, true);
        let value: serde_json::Value = serde_json::from_str(&generator.request_body(0)).unwrap();
        assert_eq!(
            (value["stream"].as_bool(), value["max_tokens"].as_u64()),
            (Some(true), Some(3))
        );
    }

    #[test]
    fn the_bundled_tokenizer_gives_about_one_token_per_word() {
        let path = myelin_tokenize::bundled_tokenizer_path().unwrap();
        let alphabet = TokenAlphabet::words_from_tokenizer(&path).unwrap();
        let generator = ShapeGenerator::new(Shape::Repeated2k, &alphabet, 42, 16, false).unwrap();
        let tokenizer = myelin_tokenize::Tokenizer::from_file(&path).unwrap();
        let chat = messages(&generator.request_body(0));
        let tokens = tokenizer.encode(&chat[0].1, false).unwrap();
        assert!(
            (LONG_WORDS..LONG_WORDS + 4).contains(&tokens.len()),
            "{} tokens",
            tokens.len()
        );
    }
}
