//! Workloads: what each simulated user (or trace line, or open-loop arrival) sends, as pure
//! functions of the seed, the user, the request number and the elapsed simulated time, so
//! every leg, every repeat and every user agree on the schedule. Open-loop workloads (trace,
//! churn-open) send the identical requests on every leg; closed-loop ones (churn,
//! shared-prefix) the same requests per (user, request number), but how many each user sends
//! and when depends on the leg's latencies, so legs get statistically identical traffic.

pub mod alphabet;
pub mod churn;
pub mod churn_open;
pub mod config;
pub mod shared_prefix;
pub mod trace;

pub use alphabet::TokenAlphabet;
pub use config::{
    Api, OpenLoopSettings, PromptFormat, WorkloadConfig, WorkloadError, WorkloadKind,
};

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
        })
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
            Workload::ChurnOpen(open) => format!(
                "open loop, {} requests at {:.2} req/s{}",
                open.len(),
                open.rate_rps(),
                open.capacity_rps()
                    .map_or(String::new(), |capacity| format!(
                        " ({:.2} of a capacity of {capacity:.2} req/s)",
                        open.rate_rps() / capacity
                    ))
            ),
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
            _ => None,
        }
    }
}
