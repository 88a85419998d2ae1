//! The workload file format (`benches/*.toml`): parsing, validation, the built-in workloads and
//! the `--quick` overrides. Holds no traffic logic (see the sibling modules).

use serde::{Deserialize, Serialize};

/// The workloads shipped in `benches/`, compiled in so `myelin bench` runs from any directory.
pub const BUILTIN_WORKLOADS: &[(&str, &str)] = &[
    ("churn", include_str!("../../../../benches/churn.toml")),
    (
        "churn-open",
        include_str!("../../../../benches/churn-open.toml"),
    ),
    (
        "shared-prefix",
        include_str!("../../../../benches/shared-prefix.toml"),
    ),
    ("trace", include_str!("../../../../benches/trace.toml")),
    (
        "shared-prefix-open",
        include_str!("../../../../benches/shared-prefix-open.toml"),
    ),
    (
        "multi-turn",
        include_str!("../../../../benches/multi-turn.toml"),
    ),
];

/// Why a workload could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("reading workload file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing workload {name}: {source}")]
    Parse {
        name: String,
        source: Box<toml::de::Error>,
    },
    #[error(
        "unknown workload `{0}` (built in: churn, churn-open, shared-prefix, shared-prefix-open, multi-turn, trace; or a path to a .toml or .json file)"
    )]
    Unknown(String),
    #[error("workload {name}: {problem}")]
    Invalid { name: String, problem: String },
    #[error("trace {path}, line {line}: {problem}")]
    TraceLine {
        path: String,
        line: usize,
        problem: String,
    },
}

/// Which traffic generator a workload uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Closed-loop users over a rotating prefix population (Ranvier's residency benchmark).
    Churn,
    /// The same population, open loop: request i's send time, prefix, suffix and output length
    /// are a pure function of (seed, i), so every leg gets the identical requests.
    ChurnOpen,
    /// Closed-loop users over groups sharing a system prompt (llm-d's shape).
    SharedPrefix,
    /// Open-loop replay of a Mooncake-format trace by timestamp.
    Trace,
    /// The shared-prefix groups, open loop (Poisson arrivals as `churn-open`): request `i` is a
    /// group's system prompt and a question unique to `i`.
    SharedPrefixOpen,
    /// Open-loop growing conversations: each request is the next turn of one of the open
    /// conversations, resending its whole history (first message, then every earlier reply and
    /// user message) plus a new user message.
    MultiTurn,
}

impl WorkloadKind {
    /// Whether the workload's arrivals are a Poisson process at a rate from `[open_loop]`.
    pub fn is_poisson(self) -> bool {
        matches!(
            self,
            WorkloadKind::ChurnOpen | WorkloadKind::SharedPrefixOpen | WorkloadKind::MultiTurn
        )
    }

    /// Whether requests are sent at their own times (Poisson or trace), not by users.
    pub fn is_open_loop(self) -> bool {
        self.is_poisson() || self == WorkloadKind::Trace
    }
}

/// Which OpenAI endpoint requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions` (the shared prefix becomes the system message).
    Chat,
}

/// How prompts are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// Token ids (`"prompt": [ids]`, completions only): no tokenization anywhere, so the CPU of
    /// this machine goes to routing and the simulated engines, not to BPE.
    TokenIds,
    /// Real text, one single-token word per intended token, so the tokenizer gives the intended
    /// token count.
    Text,
}

/// The simulated cluster a workload runs on: the engines' KV capacity is part of the workload
/// because cache pressure is what the benchmark is about.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    /// Number of simulated engines.
    pub engines: u32,
    /// Performance profile of each engine.
    pub profile: String,
    /// Simulated time runs this many times faster than wall time.
    pub speedup: f64,
    /// KV-cache capacity per engine, in blocks.
    pub kv_blocks: u32,
    /// Tokens per KV block.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Whether the engines serve Prometheus metrics (vLLM's KV utilization, queue and
    /// capacity). `false` simulates engines without them (TensorRT-LLM, Ollama, LM Studio): the
    /// router is given each engine's capacity in its backend spec (`capacity-tokens=`, as an
    /// operator would) and sees KV memory only through what it sent.
    #[serde(default = "default_engine_metrics")]
    pub engine_metrics: bool,
}

fn default_block_size() -> u32 {
    16
}

fn default_engine_metrics() -> bool {
    true
}

impl ClusterSettings {
    /// The engines' context length: the profile's `max_model_len` capped by the KV capacity,
    /// as the simulated engine caps it (a request whose prompt plus output exceeds it gets a
    /// 400). An unknown profile (refused when the cluster starts) counts as the default one.
    pub fn context_tokens(&self) -> usize {
        let defaults = myelin_sim::perf::profile_by_name(&self.profile)
            .map(|profile| myelin_sim::EngineConfig::for_profile(profile.as_ref()))
            .unwrap_or_default();
        myelin_sim::EngineConfig {
            block_size: self.block_size as usize,
            num_gpu_blocks: self.kv_blocks as usize,
            ..defaults
        }
        .effective_max_model_len()
    }
}

/// The churn population.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChurnSettings {
    /// Prefixes in the population.
    pub population: u32,
    /// Prefixes active at any time.
    pub active: u32,
    /// Prefixes rotated out (and as many in) at each rotation.
    pub rotate: u32,
    /// Simulated seconds between rotations.
    pub rotate_every_s: f64,
    /// Prefix length range in tokens, inclusive.
    pub prefix_tokens: [u32; 2],
    /// Unique suffix length range in tokens, inclusive.
    pub suffix_tokens: [u32; 2],
}

/// Open-loop arrivals (`churn-open`): a Poisson process at a rate set as a fraction of the
/// cluster's capacity.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OpenLoopSettings {
    /// Requests per simulated second as a fraction of `capacity_rps`.
    pub rate_fraction: f64,
    /// Requests per simulated second the cluster completes under round-robin routing with
    /// every engine saturated; measured on the engine model before the run when absent (see
    /// `crate::capacity`).
    #[serde(default)]
    pub capacity_rps: Option<f64>,
    /// Requests per simulated second; `rate_fraction x capacity_rps` when absent.
    #[serde(default)]
    pub rate_rps: Option<f64>,
}

/// Groups sharing a system prompt.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SharedPrefixSettings {
    /// Number of groups (distinct system prompts).
    pub groups: u32,
    /// Distinct questions per group.
    pub prompts_per_group: u32,
    /// System prompt length in tokens.
    pub system_tokens: u32,
    /// Question length in tokens.
    pub question_tokens: u32,
}

/// Most turns a conversation may have (the generator's message keys hold the turn in 16
/// bits).
pub const MAX_TURNS: u32 = 1 << 16;

/// Growing multi-turn conversations (`multi-turn`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MultiTurnSettings {
    /// Conversations open at once: each arrival is the next turn of one of them, drawn
    /// uniformly; a conversation that has had `turns` turns is replaced by a new one.
    pub conversations: u32,
    /// Turns per conversation.
    pub turns: u32,
    /// Length range of a conversation's first user message, tokens, inclusive.
    pub first_tokens: [u32; 2],
    /// Length range of every later user message, tokens, inclusive.
    pub turn_tokens: [u32; 2],
}

/// A Mooncake-format trace replay.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSettings {
    /// JSONL trace file; absent = the Mooncake slice compiled into the binary.
    #[serde(default)]
    pub path: Option<String>,
    /// Multiplies the trace's timestamps (0.5 replays twice as fast).
    #[serde(default = "default_time_scale")]
    pub time_scale: f64,
    /// Replay only the first N requests.
    #[serde(default)]
    pub max_requests: Option<u32>,
    /// Tokens per hash id.
    #[serde(default = "default_trace_block_tokens")]
    pub block_tokens: u32,
    /// Requests per simulated second the cluster completes on the trace's lines under
    /// round-robin with every engine saturated (see `crate::capacity`), for the offered load
    /// of the regime line; measured before the run when absent.
    #[serde(default)]
    pub capacity_rps: Option<f64>,
}

fn default_time_scale() -> f64 {
    1.0
}

fn default_trace_block_tokens() -> u32 {
    512
}

/// What `--quick` changes.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QuickOverrides {
    pub users: Option<u32>,
    pub duration_s: Option<f64>,
    pub warmup_s: Option<f64>,
    pub engines: Option<u32>,
    pub speedup: Option<f64>,
    pub max_requests: Option<u32>,
}

/// One workload file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadConfig {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub kind: WorkloadKind,
    pub api: Api,
    pub prompt: PromptFormat,
    /// Seed of every draw.
    pub seed: u64,
    /// Closed-loop users (ignored by the open-loop workloads: trace and churn-open).
    pub users: u32,
    /// Simulated seconds of traffic per leg (a trace replay stops at the end of the trace).
    pub duration_s: f64,
    /// Simulated seconds at the start of a leg excluded from latency statistics.
    pub warmup_s: f64,
    /// Output tokens per request (the trace replay uses the trace's own).
    pub output_tokens: u32,
    /// Model name sent in requests; absent = the first model the engines list.
    #[serde(default)]
    pub model: Option<String>,
    pub cluster: ClusterSettings,
    #[serde(default)]
    pub churn: Option<ChurnSettings>,
    #[serde(default)]
    pub open_loop: Option<OpenLoopSettings>,
    #[serde(default)]
    pub shared_prefix: Option<SharedPrefixSettings>,
    #[serde(default)]
    pub trace: Option<TraceSettings>,
    #[serde(default)]
    pub multi_turn: Option<MultiTurnSettings>,
    #[serde(default, skip_serializing)]
    pub quick: Option<QuickOverrides>,
}

impl WorkloadConfig {
    /// Loads a built-in workload by name, or a workload file by path: TOML, or JSON when the
    /// name ends in `.json` (the form `myelin bench regimes` writes each cell's workload in).
    pub fn load(name_or_path: &str) -> Result<Self, WorkloadError> {
        if let Some((name, text)) = BUILTIN_WORKLOADS
            .iter()
            .find(|(name, _)| *name == name_or_path)
        {
            return Self::parse(name, text);
        }
        if !name_or_path.ends_with(".toml") && !std::path::Path::new(name_or_path).exists() {
            return Err(WorkloadError::Unknown(name_or_path.to_string()));
        }
        let text = std::fs::read_to_string(name_or_path).map_err(|source| WorkloadError::Read {
            path: name_or_path.to_string(),
            source,
        })?;
        if name_or_path.ends_with(".json") {
            return Self::parse_json(name_or_path, &text);
        }
        Self::parse(name_or_path, &text)
    }

    /// Parses and validates a workload written as JSON (the serialised config).
    pub fn parse_json(name: &str, text: &str) -> Result<Self, WorkloadError> {
        let config: WorkloadConfig =
            serde_json::from_str(text).map_err(|error| WorkloadError::Invalid {
                name: name.to_string(),
                problem: format!("parsing JSON: {error}"),
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Parses and validates workload TOML.
    pub fn parse(name: &str, text: &str) -> Result<Self, WorkloadError> {
        let config: WorkloadConfig =
            toml::from_str(text).map_err(|source| WorkloadError::Parse {
                name: name.to_string(),
                source: Box::new(source),
            })?;
        config.validate()?;
        Ok(config)
    }

    /// Applies the file's `[quick]` section.
    pub fn apply_quick(&mut self) {
        let Some(quick) = self.quick.clone() else {
            return;
        };
        if let Some(users) = quick.users {
            self.users = users;
        }
        if let Some(duration_s) = quick.duration_s {
            self.duration_s = duration_s;
        }
        if let Some(warmup_s) = quick.warmup_s {
            self.warmup_s = warmup_s;
        }
        if let Some(engines) = quick.engines {
            self.cluster.engines = engines;
        }
        if let Some(speedup) = quick.speedup {
            self.cluster.speedup = speedup;
        }
        if let (Some(max_requests), Some(trace)) = (quick.max_requests, self.trace.as_mut()) {
            trace.max_requests = Some(max_requests);
        }
    }

    fn invalid(&self, problem: impl Into<String>) -> WorkloadError {
        WorkloadError::Invalid {
            name: self.name.clone(),
            problem: problem.into(),
        }
    }

    /// Checks every field for values the generators cannot honour.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let finite_positive = |value: f64| value.is_finite() && value > 0.0;
        if !finite_positive(self.duration_s) {
            return Err(self.invalid("duration_s must be > 0"));
        }
        if !(self.warmup_s.is_finite() && self.warmup_s >= 0.0 && self.warmup_s < self.duration_s) {
            return Err(self.invalid("warmup_s must be >= 0 and below duration_s"));
        }
        if !finite_positive(self.cluster.speedup) {
            return Err(self.invalid("cluster.speedup must be > 0"));
        }
        if self.cluster.engines == 0 || self.cluster.kv_blocks == 0 || self.cluster.block_size == 0
        {
            return Err(self.invalid("cluster.engines, kv_blocks and block_size must be > 0"));
        }
        if self.output_tokens == 0 {
            return Err(self.invalid("output_tokens must be > 0"));
        }
        if self.api == Api::Chat && self.prompt == PromptFormat::TokenIds {
            return Err(self.invalid("token-id prompts need api = \"completions\""));
        }
        if matches!(self.kind, WorkloadKind::Churn | WorkloadKind::SharedPrefix) && self.users == 0
        {
            return Err(self.invalid("users must be > 0"));
        }
        if self.kind.is_poisson() {
            let Some(open) = &self.open_loop else {
                return Err(self.invalid(format!(
                    "kind = \"{}\" needs an [open_loop] section",
                    self.kind_name()
                )));
            };
            if !finite_positive(open.rate_fraction) {
                return Err(self.invalid("open_loop: rate_fraction must be > 0"));
            }
            if !open.capacity_rps.is_none_or(finite_positive)
                || !open.rate_rps.is_none_or(finite_positive)
            {
                return Err(self.invalid("open_loop: capacity_rps and rate_rps must be > 0"));
            }
        }
        match self.kind {
            WorkloadKind::Churn | WorkloadKind::ChurnOpen => {
                let Some(churn) = &self.churn else {
                    return Err(self.invalid("kind = \"churn\" needs a [churn] section"));
                };
                if churn.population == 0 || churn.active == 0 || churn.active > churn.population {
                    return Err(self.invalid("churn: need 0 < active <= population"));
                }
                if churn.rotate > churn.active {
                    return Err(self.invalid("churn: rotate must be <= active"));
                }
                if !finite_positive(churn.rotate_every_s) {
                    return Err(self.invalid("churn: rotate_every_s must be > 0"));
                }
                if churn.prefix_tokens[0] == 0 || churn.prefix_tokens[0] > churn.prefix_tokens[1] {
                    return Err(
                        self.invalid("churn: prefix_tokens must be [min, max] with 0 < min <= max")
                    );
                }
                if churn.suffix_tokens[0] == 0 || churn.suffix_tokens[0] > churn.suffix_tokens[1] {
                    return Err(
                        self.invalid("churn: suffix_tokens must be [min, max] with 0 < min <= max")
                    );
                }
            }
            WorkloadKind::SharedPrefix | WorkloadKind::SharedPrefixOpen => {
                let Some(shared) = &self.shared_prefix else {
                    return Err(self.invalid(format!(
                        "kind = \"{}\" needs a [shared_prefix] section",
                        self.kind_name()
                    )));
                };
                if shared.groups == 0
                    || shared.prompts_per_group == 0
                    || shared.system_tokens == 0
                    || shared.question_tokens == 0
                {
                    return Err(self.invalid("shared_prefix: every field must be > 0"));
                }
            }
            WorkloadKind::Trace => {
                let Some(trace) = &self.trace else {
                    return Err(self.invalid("kind = \"trace\" needs a [trace] section"));
                };
                if !finite_positive(trace.time_scale) {
                    return Err(self.invalid("trace: time_scale must be > 0"));
                }
                if trace.block_tokens == 0 {
                    return Err(self.invalid("trace: block_tokens must be > 0"));
                }
                if !trace.capacity_rps.is_none_or(finite_positive) {
                    return Err(self.invalid("trace: capacity_rps must be > 0"));
                }
            }
            WorkloadKind::MultiTurn => {
                let Some(multi) = &self.multi_turn else {
                    return Err(self.invalid("kind = \"multi-turn\" needs a [multi_turn] section"));
                };
                if multi.conversations == 0 || multi.turns == 0 {
                    return Err(self.invalid("multi_turn: conversations and turns must be > 0"));
                }
                if multi.turns > MAX_TURNS {
                    return Err(
                        self.invalid(format!("multi_turn: turns must be at most {}", MAX_TURNS))
                    );
                }
                for (name, range) in [
                    ("first_tokens", multi.first_tokens),
                    ("turn_tokens", multi.turn_tokens),
                ] {
                    if range[0] == 0 || range[0] > range[1] {
                        return Err(self.invalid(format!(
                            "multi_turn: {name} must be [min, max] with 0 < min <= max"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The kind as the workload file spells it.
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            WorkloadKind::Churn => "churn",
            WorkloadKind::ChurnOpen => "churn-open",
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::Trace => "trace",
            WorkloadKind::SharedPrefixOpen => "shared-prefix-open",
            WorkloadKind::MultiTurn => "multi-turn",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_workload_parses_and_validates() {
        for (name, text) in BUILTIN_WORKLOADS {
            let config = WorkloadConfig::parse(name, text).unwrap();
            assert_eq!(&config.name, name);
            assert!(config.quick.is_some(), "{name} has no [quick] section");
        }
    }

    #[test]
    fn churn_defaults_match_the_published_setup() {
        let config = WorkloadConfig::load("churn").unwrap();
        let churn = config.churn.unwrap();
        assert_eq!(config.kind, WorkloadKind::Churn);
        assert_eq!(
            (config.users, config.output_tokens, config.seed),
            (60, 400, 42)
        );
        assert_eq!((churn.population, churn.active, churn.rotate), (200, 24, 8));
        assert_eq!(churn.rotate_every_s, 20.0);
        assert_eq!(churn.prefix_tokens, [2000, 8000]);
        assert_eq!(config.cluster.engines, 8);
        assert_eq!(config.cluster.profile, "a100-40gb-llama-3.1-8b");
    }

    #[test]
    fn quick_overrides_shorten_the_run() {
        let mut config = WorkloadConfig::load("churn").unwrap();
        let full = config.duration_s;
        config.apply_quick();
        assert!(config.duration_s < full);
        config.validate().unwrap();
    }

    #[test]
    fn invalid_files_are_rejected_with_the_reason() {
        let text =
            include_str!("../../../../benches/churn.toml").replace("active = 24", "active = 400");
        let error = WorkloadConfig::parse("bad", &text).unwrap_err();
        assert!(
            error.to_string().contains("active <= population"),
            "{error}"
        );
        let error = WorkloadConfig::parse("typo", "name = \"x\"\nkindd = 1").unwrap_err();
        assert!(matches!(error, WorkloadError::Parse { .. }));
        assert!(matches!(
            WorkloadConfig::load("nope"),
            Err(WorkloadError::Unknown(_))
        ));
    }
}
