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
/// `multi-turn-N` and `agentic`: conversations in flight at once (interleaved round-robin).
pub const CONVERSATIONS: u64 = 16;
/// `multi-turn-N`: words per system prompt, user turn and (replayed) assistant turn; a
/// conversation runs N turns, then its slot starts a new one.
pub const TURN_SYSTEM_WORDS: usize = 48;
pub const TURN_USER_WORDS: usize = 96;
pub const TURN_ASSISTANT_WORDS: usize = 48;
/// `agentic`: the tool-definition system prompt every agent shares, the task, the steps an
/// agent takes before its slot starts a new task, the assistant's words before each tool
/// call, and the range of a tool result's words (each step draws one).
pub const AGENT_SYSTEM_WORDS: usize = 10_000;
pub const AGENT_TASK_WORDS: usize = 32;
pub const AGENT_STEPS: u64 = 30;
pub const AGENT_THOUGHT_WORDS: usize = 16;
pub const AGENT_RESULT_WORDS: std::ops::RangeInclusive<usize> = 1_000..=4_000;
/// `agentic`: distinct tool-result texts drawn up front (each result is its own index words
/// plus one of these, so no two results are the same text).
pub const AGENT_RESULT_POOL: usize = 64;
/// Tool names the agent calls.
const AGENT_TOOLS: [&str; 4] = ["search", "read_file", "run_tests", "edit_file"];

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
    pub const AGENT_SYSTEM: u64 = 0x6f61_7379_0000_0000;
    pub const AGENT_TASK: u64 = 0x6f61_7461_0000_0000;
    pub const AGENT_THOUGHT: u64 = 0x6f61_7468_0000_0000;
    pub const AGENT_RESULT: u64 = 0x6f61_7265_0000_0000;
    pub const AGENT_RESULT_LENGTH: u64 = 0x6f61_726c_0000_0000;
}

/// A prompt shape (`--shapes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Shape {
    Short,
    SharedPrefix2k,
    Unique2k,
    Repeated2k,
    /// Growing conversations of 5, 20 or 50 turns.
    MultiTurn5,
    MultiTurn20,
    MultiTurn50,
    /// A tool-using agent: a shared 10k-token tool-definition prompt, then a tool call and a
    /// 1-4k-token tool result per step.
    Agentic,
}

/// `--shapes` names that stand for several shapes.
const GROUPS: [(&str, &[Shape]); 2] = [
    ("all", &Shape::ALL),
    (
        "multi-turn",
        &[Shape::MultiTurn5, Shape::MultiTurn20, Shape::MultiTurn50],
    ),
];

impl Shape {
    /// Every shape, in report order.
    pub const ALL: [Shape; 8] = [
        Shape::Short,
        Shape::SharedPrefix2k,
        Shape::Unique2k,
        Shape::Repeated2k,
        Shape::MultiTurn5,
        Shape::MultiTurn20,
        Shape::MultiTurn50,
        Shape::Agentic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Short => "short",
            Shape::SharedPrefix2k => "shared-prefix-2k",
            Shape::Unique2k => "unique-2k",
            Shape::Repeated2k => "repeated-2k",
            Shape::MultiTurn5 => "multi-turn-5",
            Shape::MultiTurn20 => "multi-turn-20",
            Shape::MultiTurn50 => "multi-turn-50",
            Shape::Agentic => "agentic",
        }
    }

    /// Turns (steps, for `agentic`) of a conversation before its slot starts a new one; 1
    /// for the single-turn shapes.
    pub fn turns(self) -> u64 {
        match self {
            Shape::MultiTurn5 => 5,
            Shape::MultiTurn20 => 20,
            Shape::MultiTurn50 => 50,
            Shape::Agentic => AGENT_STEPS,
            Shape::Short | Shape::SharedPrefix2k | Shape::Unique2k | Shape::Repeated2k => 1,
        }
    }

    /// Whether requests are turns of growing conversations (the cost-against-length plot).
    pub fn is_conversation(self) -> bool {
        self.turns() > 1
    }

    pub fn from_name(name: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|shape| shape.name() == name)
    }

    /// Parses `--shapes`: comma-separated names, or `all`.
    pub fn parse_list(list: &str) -> Result<Vec<Shape>, String> {
        let mut shapes = Vec::new();
        for name in list.split(',').map(str::trim) {
            let named: &[Shape] = match GROUPS.iter().find(|(group, _)| *group == name) {
                Some((_, members)) => members,
                None => &[Shape::from_name(name).ok_or_else(|| {
                    format!(
                        "unknown shape {name:?} (known: {}, multi-turn, all)",
                        Shape::ALL.map(Shape::name).join(", ")
                    )
                })?],
            };
            for shape in named {
                if !shapes.contains(shape) {
                    shapes.push(*shape);
                }
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
    /// `unique-2k`: the bodies behind the index words; `agentic`: the tool-result texts.
    pool: Vec<String>,
}

/// One message of a request body.
enum Message<'a> {
    Text {
        role: &'static str,
        text: &'a str,
    },
    /// An assistant turn that calls a tool: its words, then `tool_calls` with one call.
    ToolCall {
        text: &'a str,
        id: &'a str,
        tool: &'static str,
        query: &'a str,
    },
    ToolResult {
        id: &'a str,
        text: &'a str,
    },
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
                generator.fixed = generator.body(&[Message::Text {
                    role: "user",
                    text: &text,
                }]);
            }
            Shape::Unique2k => {
                generator.pool = (0..UNIQUE_BODIES as u64)
                    .map(|body| generator.text(stream::UNIQUE_BODY, body, LONG_WORDS - INDEX_WORDS))
                    .collect();
            }
            Shape::Agentic => {
                generator.fixed = generator.text(stream::AGENT_SYSTEM, 0, AGENT_SYSTEM_WORDS);
                generator.pool = (0..AGENT_RESULT_POOL as u64)
                    .map(|result| {
                        let span = AGENT_RESULT_WORDS.end() - AGENT_RESULT_WORDS.start() + 1;
                        let words = AGENT_RESULT_WORDS.start()
                            + rng::draw_below(
                                seed,
                                stream::AGENT_RESULT_LENGTH,
                                result,
                                span as u64,
                            ) as usize;
                        generator.text(stream::AGENT_RESULT, result, words - INDEX_WORDS)
                    })
                    .collect();
            }
            Shape::Short | Shape::MultiTurn5 | Shape::MultiTurn20 | Shape::MultiTurn50 => {}
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
                self.body(&[
                    Message::Text {
                        role: "system",
                        text: &system,
                    },
                    Message::Text {
                        role: "user",
                        text: &user,
                    },
                ])
            }
            Shape::SharedPrefix2k => {
                let mut user = self.index_words(index);
                user.push_str(&self.text(
                    stream::SHARED_USER,
                    index,
                    SHARED_USER_WORDS - INDEX_WORDS,
                ));
                self.body(&[
                    Message::Text {
                        role: "system",
                        text: &self.fixed,
                    },
                    Message::Text {
                        role: "user",
                        text: &user,
                    },
                ])
            }
            Shape::Unique2k => {
                let body = &self.pool[(index % UNIQUE_BODIES as u64) as usize];
                let mut user = self.index_words(index);
                user.push_str(body);
                self.body(&[Message::Text {
                    role: "user",
                    text: &user,
                }])
            }
            Shape::Repeated2k => self.fixed.clone(),
            Shape::MultiTurn5 | Shape::MultiTurn20 | Shape::MultiTurn50 => {
                let turns = self.shape.turns();
                let (conversation, turn) = conversation_turn(index, turns);
                let system = self.text(stream::TURN_SYSTEM, conversation, TURN_SYSTEM_WORDS);
                let mut texts = vec![("system", system)];
                for earlier in 0..=turn {
                    let key = conversation * turns + earlier;
                    texts.push(("user", self.text(stream::TURN_USER, key, TURN_USER_WORDS)));
                    if earlier < turn {
                        texts.push((
                            "assistant",
                            self.text(stream::TURN_ASSISTANT, key, TURN_ASSISTANT_WORDS),
                        ));
                    }
                }
                let messages: Vec<Message> = texts
                    .iter()
                    .map(|(role, text)| Message::Text { role, text })
                    .collect();
                self.body(&messages)
            }
            Shape::Agentic => self.agent_body(index),
        }
    }

    /// `agentic` request `index`: the shared tool definitions, the agent's task, then one tool
    /// call and its result per step taken so far.
    fn agent_body(&self, index: u64) -> String {
        let (agent, step) = conversation_turn(index, AGENT_STEPS);
        let task = self.text(stream::AGENT_TASK, agent, AGENT_TASK_WORDS);
        struct Step {
            thought: String,
            id: String,
            query: String,
            result: String,
        }
        let steps: Vec<Step> = (0..step)
            .map(|earlier| {
                let key = agent * AGENT_STEPS + earlier;
                let pick =
                    rng::draw_below(self.seed, stream::AGENT_RESULT, key, self.pool.len() as u64);
                let mut result = self.index_words(key);
                result.push_str(&self.pool[pick as usize]);
                Step {
                    thought: self.text(stream::AGENT_THOUGHT, key, AGENT_THOUGHT_WORDS),
                    id: format!("call_{key}"),
                    query: self.text(stream::AGENT_THOUGHT, key ^ (1 << 63), 4),
                    result,
                }
            })
            .collect();
        let mut messages = vec![
            Message::Text {
                role: "system",
                text: &self.fixed,
            },
            Message::Text {
                role: "user",
                text: &task,
            },
        ];
        for (earlier, step) in steps.iter().enumerate() {
            messages.push(Message::ToolCall {
                text: &step.thought,
                id: &step.id,
                tool: AGENT_TOOLS[earlier % AGENT_TOOLS.len()],
                query: step.query.trim_start(),
            });
            messages.push(Message::ToolResult {
                id: &step.id,
                text: &step.result,
            });
        }
        self.body(&messages)
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

    /// A chat completions body with these messages. Texts are the alphabet's lowercase ASCII
    /// words and spaces, which JSON needs no escaping for.
    fn body(&self, messages: &[Message]) -> String {
        let length: usize = messages
            .iter()
            .map(|message| match message {
                Message::Text { text, .. } | Message::ToolResult { text, .. } => text.len() + 32,
                Message::ToolCall { text, query, .. } => text.len() + query.len() + 160,
            })
            .sum();
        let mut body = String::with_capacity(length + 96);
        let _ = write!(
            body,
            r#"{{"model":"{MODEL}","max_tokens":{},"stream":{},"messages":["#,
            self.max_tokens, self.stream
        );
        for (position, message) in messages.iter().enumerate() {
            if position > 0 {
                body.push(',');
            }
            let _ = match message {
                Message::Text { role, text } => write!(
                    body,
                    r#"{{"role":"{role}","content":"{}"}}"#,
                    plain(text).trim_start()
                ),
                Message::ToolCall {
                    text,
                    id,
                    tool,
                    query,
                } => write!(
                    body,
                    r#"{{"role":"assistant","content":"{}","tool_calls":[{{"id":"{id}","type":"function","function":{{"name":"{tool}","arguments":"{{\"query\":\"{}\"}}"}}}}]}}"#,
                    plain(text).trim_start(),
                    plain(query)
                ),
                Message::ToolResult { id, text } => write!(
                    body,
                    r#"{{"role":"tool","tool_call_id":"{id}","content":"{}"}}"#,
                    plain(text).trim_start()
                ),
            };
        }
        body.push_str("]}");
        body
    }
}

/// `text`, checked (in debug builds) to need no JSON escaping.
fn plain(text: &str) -> &str {
    debug_assert!(
        text.bytes()
            .all(|byte| byte == b' ' || byte.is_ascii_alphabetic())
    );
    text
}

/// The (conversation, turn) of request `index` of a conversation shape: [`CONVERSATIONS`]
/// conversations interleaved round-robin; each runs `turns` turns, then its slot starts a new
/// one.
pub fn conversation_turn(index: u64, turns: u64) -> (u64, u64) {
    let slot = index % CONVERSATIONS;
    let round = index / CONVERSATIONS;
    let generation = round / turns;
    (generation * CONVERSATIONS + slot, round % turns)
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
        assert_eq!(
            Shape::parse_list("multi-turn,agentic,multi-turn-20").unwrap(),
            [
                Shape::MultiTurn5,
                Shape::MultiTurn20,
                Shape::MultiTurn50,
                Shape::Agentic
            ]
        );
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
        for shape in [Shape::MultiTurn5, Shape::MultiTurn20, Shape::MultiTurn50] {
            let generator = generator(shape);
            let turns = shape.turns();
            // Request i and i + CONVERSATIONS are consecutive turns of one conversation.
            let mut previous = messages(&generator.request_body(3));
            assert_eq!(previous.len(), 2);
            for turn in 1..turns {
                let chat = messages(&generator.request_body(3 + turn * CONVERSATIONS));
                assert_eq!(chat.len(), previous.len() + 2, "{shape:?} turn {turn}");
                assert_eq!(chat[..previous.len()], previous[..], "history changed");
                assert_eq!(chat[chat.len() - 2].0, "assistant");
                assert_eq!(chat[chat.len() - 1].0, "user");
                previous = chat;
            }
            assert_eq!(previous.len() as u64, 2 * turns);
            // After its turns the slot starts a new conversation: a new system prompt.
            let next = messages(&generator.request_body(3 + turns * CONVERSATIONS));
            assert_eq!(next.len(), 2);
            assert_ne!(next[0], previous[0]);
            // Interleaved conversations differ.
            assert_ne!(
                messages(&generator.request_body(4))[0],
                messages(&generator.request_body(3))[0]
            );
        }
    }

    #[test]
    fn agents_append_a_tool_call_and_its_result_per_step() {
        let generator = generator(Shape::Agentic);
        let body = |index: u64| -> serde_json::Value {
            serde_json::from_str(&generator.request_body(index)).expect("valid JSON")
        };
        let first = body(5);
        let system = first["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(word_count(&system), AGENT_SYSTEM_WORDS);
        assert_eq!(first["messages"].as_array().unwrap().len(), 2);
        let mut previous = first["messages"].as_array().unwrap().clone();
        let mut results = HashSet::new();
        for step in 1..AGENT_STEPS {
            let chat = body(5 + step * CONVERSATIONS)["messages"]
                .as_array()
                .unwrap()
                .clone();
            assert_eq!(chat.len(), previous.len() + 2, "step {step}");
            assert_eq!(chat[..previous.len()], previous[..], "history changed");
            let call = &chat[chat.len() - 2];
            let result = &chat[chat.len() - 1];
            assert_eq!(call["role"], "assistant");
            let id = call["tool_calls"][0]["id"].as_str().unwrap();
            let arguments = call["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap();
            let arguments: serde_json::Value = serde_json::from_str(arguments).unwrap();
            assert_eq!(word_count(arguments["query"].as_str().unwrap()), 4);
            assert_eq!(result["role"], "tool");
            assert_eq!(result["tool_call_id"], id);
            let words = word_count(result["content"].as_str().unwrap());
            assert!(AGENT_RESULT_WORDS.contains(&words), "{words} words");
            assert!(results.insert(result["content"].as_str().unwrap().to_string()));
            previous = chat;
        }
        // Every agent shares the tool definitions; the next task starts over.
        let other = body(6);
        assert_eq!(other["messages"][0]["content"], system.as_str());
        assert_ne!(other["messages"][1], first["messages"][1]);
        assert_eq!(
            body(5 + AGENT_STEPS * CONVERSATIONS)["messages"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn conversation_turns_interleave_round_robin() {
        assert_eq!(conversation_turn(0, 8), (0, 0));
        assert_eq!(
            conversation_turn(CONVERSATIONS - 1, 8),
            (CONVERSATIONS - 1, 0)
        );
        assert_eq!(conversation_turn(CONVERSATIONS, 8), (0, 1));
        assert_eq!(conversation_turn(CONVERSATIONS * 8, 8), (CONVERSATIONS, 0));
        assert_eq!(conversation_turn(CONVERSATIONS * 8, 50), (0, 8));
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
