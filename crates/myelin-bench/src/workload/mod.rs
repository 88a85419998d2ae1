//! Workloads: what each simulated user (or trace line, or open-loop arrival) sends, as pure
//! functions of the seed, the user, the request number and the elapsed simulated time, so
//! every leg, every repeat and every user agree on the schedule. Open-loop workloads (trace,
//! churn-open, shared-prefix-open, multi-turn) send the identical requests on every leg;
//! closed-loop ones (churn, shared-prefix) the same requests per (user, request number), but how
//! many each user sends and when depends on the leg's latencies, so legs get statistically
//! identical traffic.

pub mod alphabet;
pub mod churn;
pub mod churn_open;
pub mod config;
pub mod multi_turn;
pub mod shared_prefix;
pub mod trace;
pub mod working_set;

pub use alphabet::TokenAlphabet;
pub use config::{
    Api, OpenLoopSettings, PromptFormat, WorkloadConfig, WorkloadError, WorkloadKind,
};
pub use working_set::{WorkingSet, working_set};

/// One request to send: its prompt as token ids and how many tokens to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedRequest {
    /// The prompt's token ids (for text prompts, the ids of the words that make up the text).
    pub tokens: Vec<u32>,
    /// How many leading tokens are the shared part (prefix or system prompt); the chat API
    /// sends them as the system message.
    pub shared_len: usize,
    /// Tokens to generate (`max_tokens`, with `ignore_eos`).
    pub output_tokens: u32,
    /// What the shared part is: the churn prefix id, the shared-prefix group, or the trace
    /// line. Goes into requests.csv.
    pub label: u64,
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// `users` users, each sending its next request when the previous one finished.
    ClosedLoop { users: u32 },
    /// `requests` requests, each sent at its own time regardless of the others.
    OpenLoop { requests: usize },
}

/// A ready-to-run workload.
#[derive(Debug)]
pub enum Workload {
    Churn(churn::ChurnWorkload),
    ChurnOpen(churn_open::ChurnOpenWorkload),
    SharedPrefix(shared_prefix::SharedPrefixWorkload),
    Trace(trace::TraceWorkload),
    SharedPrefixOpen(shared_prefix::SharedPrefixOpenWorkload),
    MultiTurn(multi_turn::MultiTurnWorkload),
}

impl Workload {
    /// Builds the generator a config describes (validating it first).
    pub fn build(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Result<Self, WorkloadError> {
        config.validate()?;
        Ok(match config.kind {
            WorkloadKind::Churn => Workload::Churn(churn::ChurnWorkload::new(config, alphabet)),
            WorkloadKind::ChurnOpen => {
                Workload::ChurnOpen(churn_open::ChurnOpenWorkload::new(config, alphabet)?)
            }
            WorkloadKind::SharedPrefix => {
                Workload::SharedPrefix(shared_prefix::SharedPrefixWorkload::new(config, alphabet))
            }
            WorkloadKind::Trace => Workload::Trace(trace::TraceWorkload::load(config, alphabet)?),
            WorkloadKind::SharedPrefixOpen => Workload::SharedPrefixOpen(
                shared_prefix::SharedPrefixOpenWorkload::new(config, alphabet)?,
            ),
            WorkloadKind::MultiTurn => {
                Workload::MultiTurn(multi_turn::MultiTurnWorkload::new(config, alphabet)?)
            }
        })
    }

    /// The Poisson schedule of a Poisson workload (churn-open, shared-prefix-open, multi-turn).
    pub fn schedule(&self) -> Option<&churn_open::OpenSchedule> {
        match self {
            Workload::ChurnOpen(open) => Some(open.schedule()),
            Workload::SharedPrefixOpen(open) => Some(open.schedule()),
            Workload::MultiTurn(open) => Some(open.schedule()),
            Workload::Churn(_) | Workload::SharedPrefix(_) | Workload::Trace(_) => None,
        }
    }

    /// The leading tokens of `request` that an earlier request may have left in a cache: the
    /// churn prefix, the system prompt, the previous turn's prompt, or (trace) the leading
    /// blocks whose ids an earlier line of the trace already sent.
    pub fn reusable_len(&self, request: &PlannedRequest) -> usize {
        match self {
            Workload::Trace(trace) => trace.reusable_len(request.label as usize),
            _ => request.shared_len,
        }
        .min(request.tokens.len())
    }

    /// How requests arrive.
    pub fn arrival(&self) -> Arrival {
        match self {
            Workload::Churn(churn) => Arrival::ClosedLoop {
                users: churn.users(),
            },
            Workload::SharedPrefix(shared) => Arrival::ClosedLoop {
                users: shared.users(),
            },
            Workload::Trace(trace) => Arrival::OpenLoop {
                requests: trace.len(),
            },
            Workload::ChurnOpen(open) => Arrival::OpenLoop {
                requests: open.len(),
            },
            Workload::SharedPrefixOpen(open) => Arrival::OpenLoop {
                requests: open.schedule().len(),
            },
            Workload::MultiTurn(open) => Arrival::OpenLoop {
                requests: open.schedule().len(),
            },
        }
    }

    /// Simulated seconds during which requests are sent, given the configured duration: a
    /// trace replay ends with its last request.
    pub fn traffic_s(&self, duration_s: f64) -> f64 {
        match self {
            Workload::Trace(trace) => duration_s.min(trace.span_s()),
            _ => duration_s,
        }
    }

    /// What drives the traffic, in words (for the run's first line).
    pub fn describe(&self) -> String {
        match self {
            Workload::Churn(churn) => format!("{} closed-loop users", churn.users()),
            Workload::ChurnOpen(_) | Workload::SharedPrefixOpen(_) | Workload::MultiTurn(_) => {
                let open = self
                    .schedule()
                    .unwrap_or_else(|| unreachable!("a Poisson workload"));
                format!(
                    "open loop, {} requests at {:.2} req/s{}",
                    open.len(),
                    open.rate_rps(),
                    open.capacity_rps()
                        .map_or(String::new(), |capacity| format!(
                            " ({:.2} of a capacity of {capacity:.2} req/s)",
                            open.rate_rps() / capacity
                        ))
                )
            }
            Workload::SharedPrefix(shared) => format!("{} closed-loop users", shared.users()),
            Workload::Trace(trace) => format!(
                "{} requests over {:.0} simulated s from {}",
                trace.len(),
                trace.span_s(),
                trace.source_name()
            ),
        }
    }

    /// Trace lines left out because prompt plus output exceed the engines' context (`None`
    /// for workloads that are not trace replays).
    pub fn skipped_over_context(&self) -> Option<&trace::SkippedOverContext> {
        match self {
            Workload::Trace(trace) => Some(trace.skipped_over_context()),
            _ => None,
        }
    }

    /// The `seq`-th request of closed-loop user `user`, sent `elapsed_s` simulated seconds into
    /// the leg. A trace workload answers with its requests in order.
    pub fn closed_loop_request(&self, user: u32, seq: u64, elapsed_s: f64) -> PlannedRequest {
        match self {
            Workload::Churn(churn) => churn.request(user, seq, elapsed_s),
            Workload::SharedPrefix(shared) => shared.request(user, seq),
            Workload::Trace(trace) => trace.request(seq as usize % trace.len().max(1)),
            Workload::ChurnOpen(open) => open.request(seq as usize % open.len().max(1)),
            Workload::SharedPrefixOpen(open) => {
                open.request(seq as usize % open.schedule().len().max(1))
            }
            Workload::MultiTurn(open) => open.request(seq as usize % open.schedule().len().max(1)),
        }
    }

    /// The open-loop request number `index`: when to send it (simulated seconds into the leg)
    /// and what it is. `None` past the end, or for closed-loop workloads.
    pub fn open_loop_request(&self, index: usize) -> Option<(f64, PlannedRequest)> {
        match self {
            Workload::Trace(trace) if index < trace.len() => {
                Some((trace.send_at_s(index), trace.request(index)))
            }
            Workload::ChurnOpen(open) if index < open.len() => {
                Some((open.send_at_s(index), open.request(index)))
            }
            Workload::SharedPrefixOpen(open) if index < open.schedule().len() => {
                Some((open.schedule().send_at_s(index), open.request(index)))
            }
            Workload::MultiTurn(open) if index < open.schedule().len() => {
                Some((open.schedule().send_at_s(index), open.request(index)))
            }
            _ => None,
        }
    }
}
