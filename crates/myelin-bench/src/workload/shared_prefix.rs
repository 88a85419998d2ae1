//! The shared-prefix workload (llm-d's shape): `groups` system prompts, each with a pool of
//! `prompts_per_group` questions; each request picks a group and a question at random. Its
//! open-loop form (`shared-prefix-open`) sends Poisson arrivals instead, each a group's system
//! prompt and a question unique to the request (no question pool: only the system prompts are
//! shared).

use std::sync::Arc;

use super::churn_open::{OPEN_KEY, OpenSchedule};
use super::config::{WorkloadConfig, WorkloadError};
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

    /// Number of groups (distinct system prompts).
    pub fn groups(&self) -> u32 {
        self.groups
    }

    /// The request drawn with `request_key`: a group drawn from the key, its system prompt, and
    /// a question of `question_tokens` tokens unique to the key.
    pub fn unique_request(&self, request_key: u64) -> PlannedRequest {
        let group = rng::draw_below(
            self.seed,
            stream::GROUP_CHOICE,
            request_key,
            u64::from(self.groups),
        );
        let system = &self.system_prompts[group as usize];
        let question_stream = rng::mix64(stream::OPEN_QUESTION_TOKENS ^ rng::mix64(request_key));
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

/// The open-loop shared-prefix generator (`shared-prefix-open`): request `i` is sent at the
/// Poisson schedule's `t_i`, with a group drawn from `(seed, i)` and a question unique to `i`.
#[derive(Debug)]
pub struct SharedPrefixOpenWorkload {
    shared: SharedPrefixWorkload,
    schedule: OpenSchedule,
}

impl SharedPrefixOpenWorkload {
    /// The schedule at the config's resolved rate, and the system prompts.
    pub fn new(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Result<Self, WorkloadError> {
        Ok(Self {
            schedule: OpenSchedule::new(config)?,
            shared: SharedPrefixWorkload::new(config, alphabet),
        })
    }

    /// The Poisson schedule.
    pub fn schedule(&self) -> &OpenSchedule {
        &self.schedule
    }

    /// The groups and their system prompts.
    pub fn shared(&self) -> &SharedPrefixWorkload {
        &self.shared
    }

    /// Request `index`.
    pub fn request(&self, index: usize) -> PlannedRequest {
        self.shared.unique_request(OPEN_KEY | index as u64)
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

    #[test]
    fn open_requests_share_only_the_system_prompt() {
        let mut config = WorkloadConfig::load("shared-prefix-open").unwrap();
        config.open_loop.as_mut().unwrap().rate_rps = Some(4.0);
        let open = SharedPrefixOpenWorkload::new(&config, TokenAlphabet::token_ids()).unwrap();
        let shared = config.shared_prefix.clone().unwrap();
        assert!(open.schedule().len() > 100);
        let requests: Vec<PlannedRequest> = (0..300).map(|index| open.request(index)).collect();
        let system = shared.system_tokens as usize;
        for request in &requests {
            assert_eq!(
                request.tokens.len(),
                system + shared.question_tokens as usize
            );
            assert_eq!(request.shared_len, system);
        }
        // Two requests of one group share the system prompt and nothing after it.
        let first = &requests[0];
        let same = requests[1..]
            .iter()
            .find(|other| other.label == first.label)
            .expect("300 draws over the groups repeat one");
        assert_eq!(first.tokens[..system], same.tokens[..system]);
        assert_ne!(first.tokens[system..], same.tokens[system..]);
        let distinct: std::collections::HashSet<&Vec<u32>> =
            requests.iter().map(|request| &request.tokens).collect();
        assert_eq!(distinct.len(), requests.len(), "every question is unique");
        // The same whoever builds it.
        let again = SharedPrefixOpenWorkload::new(&config, TokenAlphabet::token_ids()).unwrap();
        assert_eq!(again.request(17), open.request(17));
    }
}
