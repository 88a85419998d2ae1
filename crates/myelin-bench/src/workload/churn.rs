//! The churn workload: a population of long prefixes of which a rotating subset is active.
//!
//! The population is put in a seeded order; at rotation epoch `e = floor(t / rotate_every)` the
//! active prefixes are the `active` consecutive entries starting at `e * rotate` (wrapping).
//! Each rotation retires the `rotate` oldest and brings in `rotate` new ones, so a prefix is
//! hot for `active / rotate` epochs and returns after `population / rotate` epochs. The active
//! set depends only on the elapsed simulated time: every user agrees without talking.

use std::sync::Arc;

use super::config::WorkloadConfig;
use super::{PlannedRequest, TokenAlphabet};
use crate::rng::{self, stream};

/// The churn generator.
#[derive(Debug)]
pub struct ChurnWorkload {
    seed: u64,
    users: u32,
    output_tokens: u32,
    population: u32,
    active: u32,
    rotate: u32,
    rotate_every_s: f64,
    suffix_tokens: [u32; 2],
    /// The population in rotation order.
    rotation_order: Vec<u32>,
    /// Token ids of every prefix, by prefix id.
    prefixes: Vec<Arc<[u32]>>,
    alphabet: TokenAlphabet,
}

impl ChurnWorkload {
    /// Builds the population. Panics only if the config was not validated (it always is: see
    /// `Workload::build`).
    pub fn new(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Self {
        let churn = config
            .churn
            .clone()
            .unwrap_or_else(|| unreachable!("validated churn config"));
        let seed = config.seed;
        let prefixes = (0..churn.population)
            .map(|prefix| {
                let length = rng::draw_between(
                    seed,
                    stream::PREFIX_LENGTH,
                    u64::from(prefix),
                    u64::from(churn.prefix_tokens[0]),
                    u64::from(churn.prefix_tokens[1]),
                );
                (0..length)
                    .map(|position| {
                        alphabet.pick(rng::draw(
                            seed,
                            stream::PREFIX_TOKENS | u64::from(prefix),
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
            population: churn.population,
            active: churn.active,
            rotate: churn.rotate,
            rotate_every_s: churn.rotate_every_s,
            suffix_tokens: churn.suffix_tokens,
            rotation_order: rng::permutation(seed, stream::PERMUTATION, churn.population as usize),
            prefixes,
            alphabet,
        }
    }

    /// Closed-loop users.
    pub fn users(&self) -> u32 {
        self.users
    }

    /// The rotation epoch at `elapsed_s` simulated seconds.
    pub fn epoch(&self, elapsed_s: f64) -> u64 {
        (elapsed_s.max(0.0) / self.rotate_every_s).floor() as u64
    }

    /// The prefix ids active at `elapsed_s`, oldest first.
    pub fn active_set(&self, elapsed_s: f64) -> Vec<u32> {
        let start = self.epoch(elapsed_s) * u64::from(self.rotate);
        (0..u64::from(self.active))
            .map(|offset| {
                self.rotation_order[((start + offset) % u64::from(self.population)) as usize]
            })
            .collect()
    }

    /// The token ids of a prefix.
    pub fn prefix_tokens(&self, prefix: u32) -> &[u32] {
        &self.prefixes[prefix as usize]
    }

    /// The `seq`-th request of `user`, sent at `elapsed_s`: an active prefix and a suffix
    /// unique to (user, seq).
    pub fn request(&self, user: u32, seq: u64, elapsed_s: f64) -> PlannedRequest {
        self.keyed_request((u64::from(user) << 40) | seq, elapsed_s)
    }

    /// The request drawn with `request_key` (what makes it unique), sent at `elapsed_s`: a
    /// prefix of the active set at that time and a suffix drawn from the key.
    pub fn keyed_request(&self, request_key: u64, elapsed_s: f64) -> PlannedRequest {
        let active = self.active_set(elapsed_s);
        let prefix = active[rng::draw_below(
            self.seed,
            stream::PREFIX_CHOICE,
            request_key,
            active.len() as u64,
        ) as usize];
        let prefix_tokens = self.prefix_tokens(prefix);
        let suffix_len = rng::draw_between(
            self.seed,
            stream::SUFFIX_LENGTH,
            request_key,
            u64::from(self.suffix_tokens[0]),
            u64::from(self.suffix_tokens[1]),
        );
        let mut tokens = Vec::with_capacity(prefix_tokens.len() + suffix_len as usize);
        tokens.extend_from_slice(prefix_tokens);
        let suffix_stream = stream::SUFFIX_TOKENS ^ request_key;
        tokens.extend((0..suffix_len).map(|position| {
            self.alphabet
                .pick(rng::draw(self.seed, suffix_stream, position))
        }));
        PlannedRequest {
            tokens,
            shared_len: prefix_tokens.len(),
            output_tokens: self.output_tokens,
            label: u64::from(prefix),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn churn() -> ChurnWorkload {
        let config = WorkloadConfig::load("churn").unwrap();
        ChurnWorkload::new(&config, TokenAlphabet::token_ids())
    }

    #[test]
    fn active_set_has_the_configured_size_and_rotates_eight_every_twenty_seconds() {
        let churn = churn();
        let first: HashSet<u32> = churn.active_set(0.0).into_iter().collect();
        assert_eq!(first.len(), 24);
        assert_eq!(churn.active_set(19.999), churn.active_set(0.0));
        let second: HashSet<u32> = churn.active_set(20.0).into_iter().collect();
        assert_eq!(second.len(), 24);
        assert_eq!(first.intersection(&second).count(), 16);
    }

    #[test]
    fn a_prefix_is_hot_sixty_seconds_then_idle_four_hundred_forty() {
        let churn = churn();
        let prefix = churn.active_set(0.0)[23]; // the newest at epoch 0
        let hot_epochs: Vec<u64> = (0..50)
            .filter(|epoch| churn.active_set(*epoch as f64 * 20.0).contains(&prefix))
            .collect();
        // Hot for 3 epochs (60 s), back 25 epochs (500 s) later.
        assert_eq!(hot_epochs, vec![0, 1, 2, 25, 26, 27]);
    }

    #[test]
    fn every_prefix_of_the_population_comes_around() {
        let churn = churn();
        let seen: HashSet<u32> = (0..25)
            .flat_map(|epoch| churn.active_set(epoch as f64 * 20.0))
            .collect();
        assert_eq!(seen.len(), 200);
    }

    #[test]
    fn users_agree_on_the_schedule_and_requests_are_deterministic() {
        let churn = churn();
        let again = self::churn();
        for elapsed_s in [0.0, 5.0, 33.0, 499.0, 1234.5] {
            let active = churn.active_set(elapsed_s);
            for user in 0..60 {
                let request = churn.request(user, 3, elapsed_s);
                assert!(active.contains(&(request.label as u32)));
                assert_eq!(request, again.request(user, 3, elapsed_s));
            }
        }
    }

    #[test]
    fn requests_are_prefix_plus_unique_suffix_within_bounds() {
        let churn = churn();
        let mut suffixes = HashSet::new();
        for user in 0..60 {
            for seq in 0..20 {
                let request = churn.request(user, seq, 100.0);
                let prefix = churn.prefix_tokens(request.label as u32);
                assert!((2000..=8000).contains(&prefix.len()));
                assert_eq!(&request.tokens[..request.shared_len], prefix);
                let suffix = &request.tokens[request.shared_len..];
                assert!((32..=256).contains(&suffix.len()));
                assert!(
                    suffixes.insert(suffix.to_vec()),
                    "suffix repeated for user {user} seq {seq}"
                );
                assert_eq!(request.output_tokens, 400);
            }
        }
    }

    #[test]
    fn prefix_lengths_span_the_configured_range() {
        let churn = churn();
        let lengths: Vec<usize> = (0..200)
            .map(|prefix| churn.prefix_tokens(prefix).len())
            .collect();
        assert!(lengths.iter().any(|&length| length < 3000));
        assert!(lengths.iter().any(|&length| length > 7000));
    }
}
