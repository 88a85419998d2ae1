//! The working set of a workload: the distinct prompt tokens that later requests can reuse and
//! that are live at once, which is what the cluster's KV would have to hold for every such reuse
//! to hit (each on one engine). Against the cluster's KV capacity (engines x blocks x block
//! size) it places a run in a regime: below 1 the reusable prompts fit, above 1 they cannot.
//! docs/reference/benchmark.md ("Definitions") gives the definitions:
//!
//! - `churn`, `churn-open`: `active` prefixes x the population's mean prefix length (the active
//!   set is what requests draw from at any time);
//! - `shared-prefix`: `groups` x (system prompt + `prompts_per_group` x question), the questions
//!   repeating from their pools; `shared-prefix-open`: `groups` x system prompt (every question
//!   is unique);
//! - `multi-turn`: `conversations` x the mean prompt over a conversation's turns (each open
//!   conversation's latest prompt is what its next turn reuses);
//! - `trace`: the distinct tokens of every block id the replayed lines send (the whole replay
//!   is one window: 1.0 means every block of the trace fits at once).

use serde::Serialize;

use super::churn::ChurnWorkload;
use super::config::{WorkloadConfig, WorkloadError, WorkloadKind};
use super::multi_turn::Conversations;
use super::{TokenAlphabet, trace};

/// A workload's working set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkingSet {
    /// Distinct reusable prompt tokens live at once.
    pub tokens: u64,
    /// How they were counted, in words.
    pub definition: String,
}

/// The working set of `config` (see the module).
pub fn working_set(config: &WorkloadConfig) -> Result<WorkingSet, WorkloadError> {
    Ok(match config.kind {
        WorkloadKind::Churn | WorkloadKind::ChurnOpen => {
            let churn = ChurnWorkload::new(config, TokenAlphabet::token_ids());
            let settings = config
                .churn
                .as_ref()
                .unwrap_or_else(|| unreachable!("validated churn config"));
            let mean = (0..settings.population)
                .map(|prefix| churn.prefix_tokens(prefix).len() as f64)
                .sum::<f64>()
                / f64::from(settings.population.max(1));
            WorkingSet {
                tokens: (f64::from(settings.active) * mean).round() as u64,
                definition: format!(
                    "{} active prefixes x {mean:.0} mean tokens",
                    settings.active
                ),
            }
        }
        WorkloadKind::SharedPrefix | WorkloadKind::SharedPrefixOpen => {
            let shared = config
                .shared_prefix
                .as_ref()
                .unwrap_or_else(|| unreachable!("validated shared-prefix config"));
            let system = u64::from(shared.system_tokens);
            if config.kind == WorkloadKind::SharedPrefix {
                let pool = u64::from(shared.prompts_per_group) * u64::from(shared.question_tokens);
                WorkingSet {
                    tokens: u64::from(shared.groups) * (system + pool),
                    definition: format!(
                        "{} groups x ({system} system + {} x {} question tokens)",
                        shared.groups, shared.prompts_per_group, shared.question_tokens
                    ),
                }
            } else {
                WorkingSet {
                    tokens: u64::from(shared.groups) * system,
                    definition: format!("{} system prompts x {system} tokens", shared.groups),
                }
            }
        }
        WorkloadKind::MultiTurn => {
            let conversations = Conversations::new(config, TokenAlphabet::token_ids());
            let open = conversations.settings().conversations;
            let mean = conversations.mean_prompt_tokens();
            WorkingSet {
                tokens: (f64::from(open) * mean).round() as u64,
                definition: format!("{open} open conversations x {mean:.0} mean prompt tokens"),
            }
        }
        WorkloadKind::Trace => {
            let (_, records) = trace::config_records(config)?;
            let block_tokens = config
                .trace
                .as_ref()
                .map_or(512, |trace| trace.block_tokens);
            let tokens = trace::distinct_block_tokens(&records, block_tokens);
            WorkingSet {
                tokens,
                definition: format!(
                    "the distinct {block_tokens}-token blocks of the {} replayed lines",
                    records.len()
                ),
            }
        }
    })
}

/// The cluster's KV capacity in tokens: engines x blocks x block size.
pub fn kv_capacity_tokens(config: &WorkloadConfig) -> u64 {
    u64::from(config.cluster.engines)
        * u64::from(config.cluster.kv_blocks)
        * u64::from(config.cluster.block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_has_a_working_set_and_the_definitions_hold() {
        for (name, _) in super::super::config::BUILTIN_WORKLOADS {
            let config = WorkloadConfig::load(name).unwrap();
            let set = working_set(&config).unwrap();
            assert!(set.tokens > 0, "{name}");
        }
        // Churn: 24 active of prefixes averaging about 5,000 tokens.
        let churn = working_set(&WorkloadConfig::load("churn").unwrap()).unwrap();
        assert!((110_000..130_000).contains(&churn.tokens), "{churn:?}");
        // Shared prefix, closed loop: 32 x (2,000 + 16 x 256), the figure its file states.
        let shared = working_set(&WorkloadConfig::load("shared-prefix").unwrap()).unwrap();
        assert_eq!(shared.tokens, 32 * (2000 + 16 * 256));
        let open = working_set(&WorkloadConfig::load("shared-prefix-open").unwrap()).unwrap();
        assert_eq!(open.tokens, 64 * 3750);
        // Multi-turn: 100 x (1,500 + 2.5 x (200 + 160)).
        let multi = working_set(&WorkloadConfig::load("multi-turn").unwrap()).unwrap();
        assert_eq!(multi.tokens, 240_000);
        // The Mooncake slice: 7,814 distinct block ids, almost all full 512-token blocks.
        let trace = working_set(&WorkloadConfig::load("trace").unwrap()).unwrap();
        assert!(
            (3_500_000..=7814 * 512).contains(&trace.tokens),
            "{trace:?}"
        );
        let config = WorkloadConfig::load("multi-turn").unwrap();
        assert_eq!(kv_capacity_tokens(&config), 8 * 1875 * 16);
    }
}
