//! The shared-prefix workload (llm-d's shape): `groups` system prompts, each with a pool of
//! `prompts_per_group` questions; each request picks a group and a question at random.

use std::sync::Arc;

use super::config::WorkloadConfig;
use super::{PlannedRequest, TokenAlphabet};
use crate::rng::{self, stream};

/// The shared-prefix generator.
#[derive(Debug)]
pub struct SharedPrefixWorkload {
    seed: u64,
    users: u32,
    output_tokens: u32,
    groups: u32,
    prompts_per_group: u32,
    question_tokens: u32,
    system_prompts: Vec<Arc<[u32]>>,
    alphabet: TokenAlphabet,
}

impl SharedPrefixWorkload {
    /// Builds the system prompts. The config was validated by `Workload::build`.
    pub fn new(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Self {
        let shared = config
            .shared_prefix
            .clone()
            .unwrap_or_else(|| unreachable!("validated shared-prefix config"));
        let seed = config.seed;
        let system_prompts = (0..shared.groups)
            .map(|group| {
                (0..u64::from(shared.system_tokens))
                    .map(|position| {
                        alphabet.pick(rng::draw(
                            seed,
                            stream::SYSTEM_TOKENS | u64::from(group),
                            position,
                        ))
                    })
                    .collect::<Arc<[u32]>>()
            })
            .collect();
        Self {
            seed,
            users: config.users,
            output_tokens: config.output_tokens,
            groups: shared.groups,
            prompts_per_group: shared.prompts_per_group,
            question_tokens: shared.question_tokens,
            system_prompts,
            alphabet,
        }
    }

    /// Closed-loop users.
    pub fn users(&self) -> u32 {
        self.users
    }

    /// The `seq`-th request of `user`.
    pub fn request(&self, user: u32, seq: u64) -> PlannedRequest {
        let request_key = (u64::from(user) << 40) | seq;
        let group = rng::draw_below(
            self.seed,
            stream::GROUP_CHOICE,
            request_key,
            u64::from(self.groups),
        );
        let question = rng::draw_below(
            self.seed,
            stream::QUESTION_CHOICE,
            request_key,
            u64::from(self.prompts_per_group),
        );
        let system = &self.system_prompts[group as usize];
        let question_stream = stream::QUESTION_TOKENS ^ (group << 20 | question);
        let mut tokens = Vec::with_capacity(system.len() + self.question_tokens as usize);
        tokens.extend_from_slice(system);
        tokens.extend((0..u64::from(self.question_tokens)).map(|position| {
            self.alphabet
                .pick(rng::draw(self.seed, question_stream, position))
        }));
        PlannedRequest {
            tokens,
            shared_len: system.len(),
            output_tokens: self.output_tokens,
            label: group,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_of_a_group_share_the_system_prompt_and_questions_repeat() {
        let config = WorkloadConfig::load("shared-prefix").unwrap();
        let workload = SharedPrefixWorkload::new(&config, TokenAlphabet::token_ids());
        let requests: Vec<PlannedRequest> = (0..400)
            .map(|seq| workload.request(seq as u32 % 32, seq))
            .collect();
        for request in &requests {
            assert_eq!(request.tokens.len(), 2000 + 256);
            assert_eq!(request.shared_len, 2000);
            let same_group = requests
                .iter()
                .find(|other| other.label == request.label)
                .unwrap();
            assert_eq!(&request.tokens[..2000], &same_group.tokens[..2000]);
        }
        let distinct: std::collections::HashSet<&Vec<u32>> =
            requests.iter().map(|request| &request.tokens).collect();
        // 400 draws over 32 x 16 = 512 distinct prompts must repeat some.
        assert!(distinct.len() < requests.len());
        // Any user, leg or repeat builds the same request from (seed, user, seq): a second
        // workload built from the same file (as another leg builds it) agrees, and another
        // seed does not.
        let other_leg = SharedPrefixWorkload::new(&config, TokenAlphabet::token_ids());
        for (user, seq) in [(0, 0), (3, 7), (31, 399)] {
            assert_eq!(workload.request(user, seq), other_leg.request(user, seq));
        }
        let mut reseeded = config.clone();
        reseeded.seed = 43;
        let reseeded = SharedPrefixWorkload::new(&reseeded, TokenAlphabet::token_ids());
        assert_ne!(workload.request(3, 7).tokens, reseeded.request(3, 7).tokens);
    }
}
