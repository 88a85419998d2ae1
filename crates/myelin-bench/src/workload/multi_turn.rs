//! Growing multi-turn conversations, open loop (`multi-turn`): `conversations` conversations are
//! open at once; each Poisson arrival (the schedule of `churn-open`) is the next turn of one of
//! them, drawn uniformly from `(seed, i)`. Turn `k` of a conversation resends its whole history,
//! the first user message, then every earlier reply (`output_tokens` planned tokens) and user
//! message, plus a new user message: the previous turn's prompt is a prefix of this one, and is
//! what can be reused (the engine's own reply tokens differ from the planned ones, so the reuse
//! stops at the previous prompt's end). A conversation that has had `turns` turns is replaced by
//! a new one. At the start of a leg every conversation has reached a turn drawn from the seed
//! (conversations already under way), so the mix of turns is the steady one from the first
//! request. Which conversation and turn request `i` is depends only on `(seed, i)`, not on the
//! rate, so every leg and the capacity measurement see the same sequence.

use super::churn_open::OpenSchedule;
use super::config::{MAX_TURNS, MultiTurnSettings, WorkloadConfig, WorkloadError};
use super::{PlannedRequest, TokenAlphabet};
use crate::rng::{self, stream};

/// Which conversation and turn each arrival is, in arrival order.
#[derive(Debug, Clone)]
pub struct ConversationSlots {
    seed: u64,
    turns: u32,
    /// Per slot: the open conversation's id and the turn it sends next.
    slots: Vec<(u64, u32)>,
    next_conversation: u64,
    next_index: u64,
}

impl ConversationSlots {
    /// The open conversations at the start: conversation `s` in slot `s`, at a turn drawn from
    /// the seed.
    pub fn new(seed: u64, settings: &MultiTurnSettings) -> Self {
        let turns = settings.turns.max(1);
        let slots = (0..u64::from(settings.conversations.max(1)))
            .map(|slot| {
                let turn =
                    rng::draw_below(seed, stream::CONVERSATION_START, slot, u64::from(turns));
                (slot, turn as u32)
            })
            .collect::<Vec<_>>();
        Self {
            seed,
            turns,
            next_conversation: slots.len() as u64,
            slots,
            next_index: 0,
        }
    }

    /// The next arrival's (conversation, turn), turns from 0.
    pub fn next_turn(&mut self) -> (u64, u32) {
        let slot = rng::draw_below(
            self.seed,
            stream::CONVERSATION_CHOICE,
            self.next_index,
            self.slots.len() as u64,
        ) as usize;
        self.next_index += 1;
        let (conversation, turn) = self.slots[slot];
        self.slots[slot] = if turn + 1 >= self.turns {
            let fresh = (self.next_conversation, 0);
            self.next_conversation += 1;
            fresh
        } else {
            (conversation, turn + 1)
        };
        (conversation, turn)
    }
}

/// The conversations' messages: pure functions of `(seed, conversation, turn)`.
#[derive(Debug, Clone)]
pub struct Conversations {
    seed: u64,
    output_tokens: u32,
    settings: MultiTurnSettings,
    alphabet: TokenAlphabet,
}

impl Conversations {
    /// From a validated multi-turn config.
    pub fn new(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Self {
        Self {
            seed: config.seed,
            output_tokens: config.output_tokens,
            settings: config
                .multi_turn
                .clone()
                .unwrap_or_else(|| unreachable!("validated multi-turn config")),
            alphabet,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &MultiTurnSettings {
        &self.settings
    }

    fn message_key(conversation: u64, turn: u32) -> u64 {
        (conversation << 16) | u64::from(turn % MAX_TURNS)
    }

    /// Tokens of user message `turn` of `conversation` (turn 0: the first message).
    fn message(&self, conversation: u64, turn: u32, tokens: &mut Vec<u32>) {
        let key = Self::message_key(conversation, turn);
        let [low, high] = if turn == 0 {
            self.settings.first_tokens
        } else {
            self.settings.turn_tokens
        };
        let length = rng::draw_between(
            self.seed,
            stream::MESSAGE_LENGTH,
            key,
            u64::from(low),
            u64::from(high),
        );
        let message_stream = rng::mix64(stream::MESSAGE_TOKENS ^ rng::mix64(key));
        tokens.extend((0..length).map(|position| {
            self.alphabet
                .pick(rng::draw(self.seed, message_stream, position))
        }));
    }

    /// The planned reply to user message `turn`, as the history resends it.
    fn reply(&self, conversation: u64, turn: u32, tokens: &mut Vec<u32>) {
        let key = Self::message_key(conversation, turn);
        let reply_stream = rng::mix64(stream::REPLY_TOKENS ^ rng::mix64(key));
        tokens.extend((0..u64::from(self.output_tokens)).map(|position| {
            self.alphabet
                .pick(rng::draw(self.seed, reply_stream, position))
        }));
    }

    /// Turn `turn` of `conversation`: the history and the new user message. `shared_len` is the
    /// previous turn's prompt (0 on the first turn).
    pub fn request(&self, conversation: u64, turn: u32) -> PlannedRequest {
        let mut tokens = Vec::new();
        let mut previous_len = 0;
        for earlier in 0..turn {
            self.message(conversation, earlier, &mut tokens);
            previous_len = tokens.len();
            self.reply(conversation, earlier, &mut tokens);
        }
        self.message(conversation, turn, &mut tokens);
        PlannedRequest {
            tokens,
            shared_len: previous_len,
            output_tokens: self.output_tokens,
            label: conversation,
        }
    }

    /// The mean prompt length over a conversation's turns, in expectation: the first message,
    /// plus on average (turns - 1) / 2 earlier replies and later user messages.
    pub fn mean_prompt_tokens(&self) -> f64 {
        let mean = |[low, high]: [u32; 2]| (f64::from(low) + f64::from(high)) / 2.0;
        mean(self.settings.first_tokens)
            + f64::from(self.settings.turns.saturating_sub(1)) / 2.0
                * (f64::from(self.output_tokens) + mean(self.settings.turn_tokens))
    }
}

/// The open-loop multi-turn generator.
#[derive(Debug)]
pub struct MultiTurnWorkload {
    conversations: Conversations,
    schedule: OpenSchedule,
    /// (conversation, turn) of every request in the schedule.
    turns: Vec<(u64, u32)>,
}

impl MultiTurnWorkload {
    /// The schedule at the config's resolved rate and the conversation of every arrival.
    pub fn new(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Result<Self, WorkloadError> {
        let schedule = OpenSchedule::new(config)?;
        let conversations = Conversations::new(config, alphabet);
        let mut slots = ConversationSlots::new(config.seed, conversations.settings());
        let turns = (0..schedule.len()).map(|_| slots.next_turn()).collect();
        Ok(Self {
            conversations,
            schedule,
            turns,
        })
    }

    /// The Poisson schedule.
    pub fn schedule(&self) -> &OpenSchedule {
        &self.schedule
    }

    /// The conversations' messages.
    pub fn conversations(&self) -> &Conversations {
        &self.conversations
    }

    /// Request `index`'s conversation and turn.
    pub fn turn_of(&self, index: usize) -> (u64, u32) {
        self.turns[index]
    }

    /// Request `index`.
    pub fn request(&self, index: usize) -> PlannedRequest {
        let (conversation, turn) = self.turns[index];
        self.conversations.request(conversation, turn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload() -> MultiTurnWorkload {
        let mut config = WorkloadConfig::load("multi-turn").unwrap();
        config.open_loop.as_mut().unwrap().rate_rps = Some(5.0);
        MultiTurnWorkload::new(&config, TokenAlphabet::token_ids()).unwrap()
    }

    #[test]
    fn each_turn_resends_the_previous_prompt_and_grows() {
        let open = workload();
        let settings = open.conversations().settings().clone();
        assert!(open.schedule().len() > 500);
        let mut checked = 0;
        for index in 0..open.schedule().len() {
            let (conversation, turn) = open.turn_of(index);
            assert!(turn < settings.turns);
            let request = open.request(index);
            assert_eq!(request.label, conversation);
            if turn == 0 {
                assert_eq!(request.shared_len, 0);
                let length = request.tokens.len() as u32;
                assert!((settings.first_tokens[0]..=settings.first_tokens[1]).contains(&length));
                continue;
            }
            // The previous turn's prompt is this one's leading part.
            let previous = open.conversations().request(conversation, turn - 1);
            assert_eq!(request.shared_len, previous.tokens.len());
            assert_eq!(request.tokens[..request.shared_len], previous.tokens[..]);
            // Then the planned reply and a new user message.
            let added = request.tokens.len() - previous.tokens.len();
            let reply = open.request(index).output_tokens as usize;
            assert!(added > reply);
            checked += 1;
        }
        assert!(checked > 100, "{checked}");
    }

    #[test]
    fn conversations_advance_one_turn_per_arrival_and_are_replaced_when_done() {
        let open = workload();
        let turns = open.conversations().settings().turns;
        let mut last_turn: std::collections::HashMap<u64, u32> = Default::default();
        for index in 0..open.schedule().len() {
            let (conversation, turn) = open.turn_of(index);
            if let Some(previous) = last_turn.insert(conversation, turn) {
                assert_eq!(turn, previous + 1, "conversation {conversation}");
            }
        }
        // Some conversations ran to their end and new ones started at turn 0.
        let conversations = open.conversations().settings().conversations as u64;
        assert!(last_turn.keys().any(|&id| id >= conversations));
        assert!(last_turn.values().all(|&turn| turn < turns));
        // The sequence does not depend on the rate: a slower schedule is its beginning.
        let mut config = WorkloadConfig::load("multi-turn").unwrap();
        config.open_loop.as_mut().unwrap().rate_rps = Some(1.0);
        let slow = MultiTurnWorkload::new(&config, TokenAlphabet::token_ids()).unwrap();
        for index in 0..slow.schedule().len() {
            assert_eq!(slow.turn_of(index), open.turn_of(index));
        }
        assert_eq!(slow.request(5), open.request(5));
    }

    #[test]
    fn the_mean_prompt_is_the_mean_over_turns() {
        let open = workload();
        let settings = open.conversations().settings().clone();
        let mut total = 0.0;
        let mut count = 0.0;
        for conversation in 0..400 {
            for turn in 0..settings.turns {
                total += open
                    .conversations()
                    .request(conversation, turn)
                    .tokens
                    .len() as f64;
                count += 1.0;
            }
        }
        let expected = open.conversations().mean_prompt_tokens();
        let measured = total / count;
        assert!(
            (measured - expected).abs() < expected * 0.03,
            "{measured} vs {expected}"
        );
    }
}
