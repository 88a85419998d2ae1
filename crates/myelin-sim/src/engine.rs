//! The sans-IO model of one vLLM v1 engine: requests, the scheduler (continuous batching with a
//! token budget, decodes first, chunked prefill, preemption) and the prefix cache on top of the
//! [`BlockPool`]. It never reads a clock or touches a socket: the driver calls
//! [`EngineModel::schedule`], sleeps the returned step time, then calls
//! [`EngineModel::complete_step`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use myelin_kv_events::{
    BlockHash, KvEvent, hash_block_tokens_keyed, hash_token_blocks, hash_token_blocks_keyed,
};

use crate::block_pool::{BlockId, BlockPool, CacheKeys};
use crate::perf::{PerformanceModel, ScheduledChunk, StepShape};

/// An engine-local request id (unique per engine, chosen by the driver).
pub type RequestId = u64;

/// vLLM's default KV block size.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// KV capacity of Llama-3.1-8B on an A100-40GB at `gpu_memory_utilization` 0.5 (~2 to 4 GB
/// left for KV: 1,500 blocks = 24,000 tokens = 3 GB at 128 KiB per token).
pub const DEFAULT_NUM_GPU_BLOCKS: usize = 1500;

/// Static engine configuration.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks on the "GPU".
    pub num_gpu_blocks: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Running sequences at most.
    pub max_num_seqs: usize,
    /// Longest prompt + output accepted (capped by the KV capacity).
    pub max_model_len: usize,
}

impl Default for EngineConfig {
    /// The default profile's (`a100-40gb-llama-3.1-8b`) limits.
    fn default() -> Self {
        EngineConfig::for_profile(&crate::perf::A100Llama8B)
    }
}

impl EngineConfig {
    /// vLLM's defaults for the profile's GPU and model (its [`SchedulerLimits`]), with the
    /// default block size and KV capacity: what `vllm serve` would run with.
    ///
    /// [`SchedulerLimits`]: crate::perf::SchedulerLimits
    pub fn for_profile(profile: &dyn PerformanceModel) -> Self {
        let limits = profile.scheduler_limits();
        EngineConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            num_gpu_blocks: DEFAULT_NUM_GPU_BLOCKS,
            max_num_batched_tokens: limits.max_num_batched_tokens,
            max_num_seqs: limits.max_num_seqs,
            max_model_len: limits.max_model_len,
        }
    }

    /// The context length the engine really accepts: vLLM refuses to start when one maximal
    /// request cannot fit the KV cache, so cap it at the KV capacity.
    pub fn effective_max_model_len(&self) -> usize {
        self.max_model_len
            .min(self.num_gpu_blocks.saturating_mul(self.block_size))
    }
}

/// A request as submitted.
#[derive(Clone, Debug, Default)]
pub struct RequestSpec {
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Most output tokens (`max_tokens`); `None` = up to the context length.
    pub max_tokens: Option<usize>,
    /// Keep generating past the model's natural end (`ignore_eos`).
    pub ignore_eos: bool,
    /// The LoRA adapter it runs on (`None`: the base model): hashed into every block, so its
    /// blocks match only requests to the same adapter.
    pub lora: Option<String>,
    /// `cache_salt`: hashed into the first block, so its blocks match only requests with the
    /// same salt.
    pub cache_salt: Option<String>,
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddRequestError {
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus requested output exceeds the context length (vLLM's 400 message).
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {requested} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). \
         Please reduce the length of the messages or completion."
    )]
    TooLong {
        /// The engine's context length.
        max_model_len: usize,
        /// Prompt plus output tokens requested.
        requested: usize,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens requested.
        max_tokens: usize,
    },
    /// The id is already in use.
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model's natural end (EOS).
    Stop,
    /// `max_tokens` or the context length reached.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One output of a completed step for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOutput {
    /// The request.
    pub request_id: RequestId,
    /// The token sampled in this step.
    pub token_id: u32,
    /// Output tokens so far, including this one.
    pub output_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission (`cached_tokens`).
    pub cached_prompt_tokens: usize,
    /// Set when the request is done.
    pub finished: Option<FinishReason>,
}

/// One step's schedule: which requests compute how many tokens, and how long it takes.
#[derive(Clone, Debug)]
pub struct ScheduledStep {
    /// Scheduled requests and their token counts, in schedule order.
    pub requests: Vec<(RequestId, ScheduledChunk)>,
    /// Duration of the forward pass from the performance model.
    pub step_time: Duration,
    /// Requests preempted while scheduling this step.
    pub preempted: Vec<RequestId>,
}

impl ScheduledStep {
    /// Tokens computed in the step.
    pub fn total_tokens(&self) -> usize {
        self.requests
            .iter()
            .map(|(_, chunk)| chunk.new_tokens)
            .sum()
    }
}

/// Monotonic counters of one engine (vLLM's metric names in brackets).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Prompt tokens looked up in the prefix cache (`prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache (`prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
    /// Requests preempted (`num_preemptions_total`).
    pub preemptions: u64,
    /// Cached blocks evicted (each published a `BlockRemoved`).
    pub evictions: u64,
    /// Requests that finished at their natural end (`request_success_total{stop}`).
    pub finished_stop: u64,
    /// Requests that finished at `max_tokens` (`request_success_total{length}`).
    pub finished_length: u64,
    /// Requests aborted (client gone).
    pub requests_aborted: u64,
    /// Prompt tokens of admitted requests (`prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Output tokens generated (`generation_tokens_total`).
    pub generation_tokens: u64,
    /// Scheduler steps executed.
    pub steps: u64,
}

/// A point-in-time view of the engine's load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Running requests (`num_requests_running`).
    pub running: usize,
    /// Waiting requests (`num_requests_waiting`).
    pub waiting: usize,
    /// Fraction of KV blocks held by requests (`kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Prompt (or recompute) tokens still to prefill across all requests, net of what the
    /// prefix cache would serve right now.
    pub pending_prefill_tokens: usize,
    /// The (query, key) pairs of causal attention in that prefill: each uncomputed token
    /// attends to the tokens before it (the cached or computed ones and the new ones ahead of
    /// it), what makes a long prompt's prefill cost more than its tokens.
    pub pending_prefill_pairs: f64,
    /// Output tokens still to generate across all requests.
    pub pending_decode_tokens: usize,
    /// Running requests whose prompt is computed (decoding).
    pub decoding: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RequestState {
    Waiting,
    Running,
}

#[derive(Debug)]
struct Request {
    /// Prompt then output tokens.
    all_token_ids: Vec<u32>,
    /// Hash chain of the full blocks of `all_token_ids`.
    block_hashes: Vec<BlockHash>,
    /// See [`RequestSpec::lora`] and [`RequestSpec::cache_salt`].
    cache_keys: CacheKeys,
    prompt_len: usize,
    max_output_tokens: usize,
    /// Output length at which the model would emit EOS, when EOS is honoured.
    natural_output_tokens: Option<usize>,
    /// Offset into the output vocabulary (deterministic per prompt).
    output_seed: usize,
    num_computed_tokens: usize,
    blocks: Vec<BlockId>,
    /// Leading blocks already registered in the prefix cache.
    num_cached_blocks: usize,
    cached_prompt_tokens: Option<usize>,
    state: RequestState,
    preemptions: u32,
}

impl Request {
    fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    fn output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.prompt_len
    }

    fn remaining_output_tokens(&self) -> usize {
        let limit = self
            .natural_output_tokens
            .map_or(self.max_output_tokens, |natural| {
                natural.min(self.max_output_tokens)
            });
        limit.saturating_sub(self.output_tokens())
    }
}

/// The output tokens the simulated model produces: a fixed vocabulary walked from a per-prompt
/// offset, so outputs are deterministic and re-tokenise to themselves when the vocabulary was
/// made by tokenising ordinary text.
#[derive(Clone, Debug)]
pub struct OutputVocabulary {
    token_ids: Arc<[u32]>,
}

impl OutputVocabulary {
    /// A vocabulary of `token_ids` (an empty list falls back to ids 1000..1256).
    pub fn new(token_ids: Vec<u32>) -> Self {
        let token_ids = if token_ids.is_empty() {
            (1000..1256).collect()
        } else {
            token_ids
        };
        OutputVocabulary {
            token_ids: token_ids.into(),
        }
    }

    fn token(&self, seed: usize, position: usize) -> u32 {
        self.token_ids[(seed + position) % self.token_ids.len()]
    }
}

impl Default for OutputVocabulary {
    fn default() -> Self {
        OutputVocabulary::new(Vec::new())
    }
}

/// The engine model.
#[derive(Debug)]
pub struct EngineModel {
    config: EngineConfig,
    performance: Arc<dyn PerformanceModel>,
    vocabulary: OutputVocabulary,
    pool: BlockPool,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    counters: EngineCounters,
    /// Requests accepted by `add_request` since the engine started.
    received: u64,
}

/// Output length at which a request without `ignore_eos` ends: between 64 and 256 tokens,
/// fixed by its prompt.
fn natural_output_tokens(seed: usize) -> usize {
    64 + seed % 193
}

/// FNV-1a over the prompt: a stable per-prompt seed.
fn prompt_seed(prompt: &[u32]) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &token in prompt {
        for byte in token.to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    (hash >> 1) as usize
}

impl EngineModel {
    /// A fresh engine with an empty cache.
    pub fn new(
        config: EngineConfig,
        performance: Arc<dyn PerformanceModel>,
        vocabulary: OutputVocabulary,
    ) -> Self {
        let pool = BlockPool::new(config.num_gpu_blocks, config.block_size.max(1));
        EngineModel {
            config,
            performance,
            vocabulary,
            pool,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: EngineCounters::default(),
            received: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The performance model.
    pub fn performance(&self) -> &Arc<dyn PerformanceModel> {
        &self.performance
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Counters so far.
    pub fn counters(&self) -> EngineCounters {
        EngineCounters {
            evictions: self.pool.evictions(),
            ..self.counters
        }
    }

    /// True when nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// True when `id` is waiting or running.
    pub fn contains(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// Blocks held by request `id` (empty when unknown).
    pub fn request_blocks(&self, id: RequestId) -> usize {
        self.requests
            .get(&id)
            .map_or(0, |request| request.blocks.len())
    }

    /// Queues a request (FCFS).
    pub fn add_request(&mut self, id: RequestId, spec: RequestSpec) -> Result<(), AddRequestError> {
        if self.requests.contains_key(&id) {
            return Err(AddRequestError::DuplicateId(id));
        }
        let prompt_len = spec.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(AddRequestError::EmptyPrompt);
        }
        let max_model_len = self.config.effective_max_model_len();
        let room = max_model_len.saturating_sub(prompt_len);
        // vLLM requires at least one output token; a missing max_tokens fills the context.
        let max_output_tokens = spec.max_tokens.unwrap_or(room).max(1);
        if prompt_len + max_output_tokens > max_model_len {
            return Err(AddRequestError::TooLong {
                max_model_len,
                requested: prompt_len + max_output_tokens,
                prompt_tokens: prompt_len,
                max_tokens: max_output_tokens,
            });
        }
        let output_seed = prompt_seed(&spec.prompt_token_ids);
        let cache_keys = CacheKeys {
            lora: spec.lora,
            salt: spec.cache_salt.filter(|salt| !salt.is_empty()),
        };
        let block_hashes = hash_token_blocks_keyed(
            &spec.prompt_token_ids,
            self.config.block_size,
            cache_keys.lora.as_deref(),
            cache_keys.salt.as_deref(),
        );
        let request = Request {
            all_token_ids: spec.prompt_token_ids,
            block_hashes,
            cache_keys,
            prompt_len,
            max_output_tokens,
            natural_output_tokens: (!spec.ignore_eos).then(|| natural_output_tokens(output_seed)),
            output_seed,
            num_computed_tokens: 0,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            cached_prompt_tokens: None,
            state: RequestState::Waiting,
            preemptions: 0,
        };
        self.requests.insert(id, request);
        self.waiting.push_back(id);
        self.received += 1;
        Ok(())
    }

    /// Requests accepted since the engine started (a client that counts what it sent can tell
    /// how many are still on their way).
    pub fn requests_received(&self) -> u64 {
        self.received
    }

    /// Aborts a request (client gone): frees its blocks. False if it was not known.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(request) = self.requests.remove(&id) else {
            return false;
        };
        match request.state {
            RequestState::Waiting => self.waiting.retain(|&queued| queued != id),
            RequestState::Running => self.running.retain(|&running| running != id),
        }
        self.pool.free(&request.blocks);
        self.counters.requests_aborted += 1;
        true
    }

    /// vLLM's `reset_prefix_cache`: drops every cached block when no request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// KV events recorded since the last call (one published batch).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Tokens of `token_ids` whose full blocks are in the prefix cache now (the longest cached
    /// chain, not capped by the last-token rule).
    pub fn cached_prefix_tokens(&self, token_ids: &[u32]) -> usize {
        let chain = hash_token_blocks(token_ids, self.config.block_size);
        self.cached_prefix_tokens_of_chain(&chain)
    }

    /// Like [`EngineModel::cached_prefix_tokens`] for an already hashed chain of full blocks
    /// (of this engine's block size).
    pub fn cached_prefix_tokens_of_chain(&self, chain: &[BlockHash]) -> usize {
        self.pool.cached_prefix_blocks(chain) * self.config.block_size
    }

    /// Of [`EngineModel::cached_prefix_tokens_of_chain`], the leading tokens whose blocks
    /// requests in flight hold right now (shared with them: a request with this prefix needs
    /// no new KV memory for them).
    pub fn held_prefix_tokens_of_chain(&self, chain: &[BlockHash]) -> usize {
        let held = chain
            .iter()
            .map_while(|hash| self.pool.cached_block(hash))
            .take_while(|&block| self.pool.ref_count(block) > 0)
            .count();
        held * self.config.block_size
    }

    /// KV capacity in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.num_blocks() * self.config.block_size
    }

    /// Requests waiting to be admitted (or readmitted after preemption); cheaper than
    /// [`EngineModel::load`].
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Current load.
    pub fn load(&self) -> EngineLoad {
        let mut pending_prefill_tokens = 0;
        let mut pending_prefill_pairs = 0.0;
        let mut pending_decode_tokens = 0;
        let mut decoding = 0;
        for request in self.requests.values() {
            pending_decode_tokens += request.remaining_output_tokens();
            if request.state == RequestState::Running
                && request.num_computed_tokens >= request.prompt_len
            {
                decoding += 1;
            }
            let uncomputed = request.num_tokens() - request.num_computed_tokens;
            let (pending, context) = match request.state {
                // A decoding request has exactly its last sampled token uncomputed.
                RequestState::Running => {
                    (uncomputed.saturating_sub(1), request.num_computed_tokens)
                }
                RequestState::Waiting => {
                    let cached = self.lookup_prefix(request).1;
                    (request.num_tokens() - cached, cached)
                }
            };
            pending_prefill_tokens += pending;
            let pending = pending as f64;
            pending_prefill_pairs += pending * (context as f64 + pending / 2.0);
        }
        EngineLoad {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: self.pool.usage(),
            pending_prefill_tokens,
            pending_prefill_pairs,
            pending_decode_tokens,
            decoding,
        }
    }

    /// The longest cached chain usable by `request`: at most `num_tokens - 1` tokens, so the
    /// last prompt token is always recomputed (it must produce logits).
    fn lookup_prefix(&self, request: &Request) -> (Vec<BlockId>, usize) {
        let block_size = self.config.block_size;
        let max_hit_blocks = (request.num_tokens() - 1) / block_size;
        let blocks: Vec<BlockId> = request
            .block_hashes
            .iter()
            .take(max_hit_blocks)
            .map_while(|hash| self.pool.cached_block(hash))
            .collect();
        let hit_tokens = blocks.len() * block_size;
        (blocks, hit_tokens)
    }

    /// Plans the next step: running requests first (decodes and unfinished prefill chunks),
    /// preempting the newest running request when blocks run out, then waiting requests in
    /// arrival order while the token budget and `max_num_seqs` allow. `None` when idle.
    pub fn schedule(&mut self) -> Option<ScheduledStep> {
        if self.is_idle() {
            return None;
        }
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<(RequestId, ScheduledChunk)> = Vec::new();
        let mut preempted = Vec::new();

        let mut index = 0;
        while index < self.running.len() && budget > 0 {
            let id = self.running[index];
            let Some(request) = self.requests.get(&id) else {
                index += 1;
                continue;
            };
            let context_tokens = request.num_computed_tokens;
            let new_tokens = (request.num_tokens() - context_tokens).min(budget);
            if new_tokens == 0 {
                index += 1;
                continue;
            }
            let mut can_schedule = true;
            while !self.allocate_slots(id, new_tokens, &[]) {
                let Some(victim) = self.running.pop() else {
                    can_schedule = false;
                    break;
                };
                self.preempt(victim);
                preempted.push(victim);
                if victim == id {
                    can_schedule = false;
                    break;
                }
            }
            if !can_schedule {
                break;
            }
            scheduled.push((
                id,
                ScheduledChunk {
                    new_tokens,
                    context_tokens,
                },
            ));
            budget -= new_tokens;
            index += 1;
        }

        // Like vLLM, admit nothing new in a step that had to preempt.
        if preempted.is_empty() {
            while budget > 0 && self.running.len() < self.config.max_num_seqs {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                let Some(request) = self.requests.get(&id) else {
                    self.waiting.pop_front();
                    continue;
                };
                let (hit_blocks, hit_tokens) = if request.num_computed_tokens == 0 {
                    self.lookup_prefix(request)
                } else {
                    (Vec::new(), request.num_computed_tokens)
                };
                let new_tokens = (request.num_tokens() - hit_tokens).min(budget);
                if !self.allocate_slots(id, new_tokens, &hit_blocks) {
                    break;
                }
                self.waiting.pop_front();
                self.running.push(id);
                let Some(request) = self.requests.get_mut(&id) else {
                    break;
                };
                request.state = RequestState::Running;
                request.num_computed_tokens = hit_tokens;
                if request.preemptions == 0 {
                    request.cached_prompt_tokens = Some(hit_tokens);
                    self.counters.prefix_cache_queries += request.num_tokens() as u64;
                    self.counters.prefix_cache_hits += hit_tokens as u64;
                    self.counters.prompt_tokens += request.prompt_len as u64;
                }
                scheduled.push((
                    id,
                    ScheduledChunk {
                        new_tokens,
                        context_tokens: hit_tokens,
                    },
                ));
                budget -= new_tokens;
            }
        }

        if scheduled.is_empty() && preempted.is_empty() {
            // Blocked: nothing fits (the cache is full of running requests' blocks).
            return None;
        }
        let chunks: Vec<ScheduledChunk> = scheduled.iter().map(|(_, chunk)| *chunk).collect();
        let step_time = self.performance.step_time(&StepShape {
            chunks: &chunks,
            kv_usage: self.pool.usage(),
        });
        Some(ScheduledStep {
            requests: scheduled,
            step_time,
            preempted,
        })
    }

    /// Applies a finished forward pass: advances computed tokens, samples one token for every
    /// request whose prompt (or recompute) is fully computed, finishes and frees the done ones.
    /// Requests aborted since [`EngineModel::schedule`] are skipped.
    pub fn complete_step(&mut self, step: &ScheduledStep) -> Vec<RequestOutput> {
        self.counters.steps += 1;
        let mut outputs = Vec::new();
        let max_model_len = self.config.effective_max_model_len();
        for &(id, chunk) in &step.requests {
            let Some(request) = self.requests.get_mut(&id) else {
                continue;
            };
            if request.state != RequestState::Running {
                continue;
            }
            request.num_computed_tokens += chunk.new_tokens;
            if request.num_computed_tokens < request.num_tokens() {
                continue; // A prefill chunk that does not finish the prompt samples nothing.
            }
            let position = request.output_tokens();
            let token_id = self.vocabulary.token(request.output_seed, position);
            request.all_token_ids.push(token_id);
            let block_size = self.config.block_size;
            if request.all_token_ids.len() % block_size == 0 {
                let start = request.all_token_ids.len() - block_size;
                let keys = request.cache_keys.of_block(request.block_hashes.len());
                let hash = hash_block_tokens_keyed(
                    request.block_hashes.last(),
                    &request.all_token_ids[start..],
                    &keys,
                );
                request.block_hashes.push(hash);
            }
            self.counters.generation_tokens += 1;
            let output_tokens = request.output_tokens();
            let finished = if request
                .natural_output_tokens
                .is_some_and(|natural| output_tokens >= natural)
            {
                Some(FinishReason::Stop)
            } else if output_tokens >= request.max_output_tokens
                || request.num_tokens() >= max_model_len
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            outputs.push(RequestOutput {
                request_id: id,
                token_id,
                output_tokens,
                cached_prompt_tokens: request.cached_prompt_tokens.unwrap_or(0),
                finished,
            });
            match finished {
                Some(FinishReason::Stop) => self.counters.finished_stop += 1,
                Some(FinishReason::Length) => self.counters.finished_length += 1,
                None => {}
            }
            if finished.is_some() {
                self.finish(id);
            }
        }
        outputs
    }

    fn finish(&mut self, id: RequestId) {
        if let Some(request) = self.requests.remove(&id) {
            self.running.retain(|&running| running != id);
            self.waiting.retain(|&queued| queued != id);
            self.pool.free(&request.blocks);
        }
    }

    fn preempt(&mut self, id: RequestId) {
        let Some(request) = self.requests.get_mut(&id) else {
            return;
        };
        self.pool.free(&request.blocks);
        request.blocks.clear();
        request.num_computed_tokens = 0;
        request.num_cached_blocks = 0;
        request.state = RequestState::Waiting;
        request.preemptions += 1;
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
    }

    /// vLLM's `allocate_slots`: takes the prefix-hit blocks, allocates the blocks needed for
    /// `new_tokens` more tokens, and caches the blocks that become full. False (and no change)
    /// if the free blocks do not suffice.
    fn allocate_slots(&mut self, id: RequestId, new_tokens: usize, hit_blocks: &[BlockId]) -> bool {
        let block_size = self.config.block_size;
        let Some(request) = self.requests.get_mut(&id) else {
            return false;
        };
        let computed_tokens = request.num_computed_tokens + hit_blocks.len() * block_size;
        let total_tokens = computed_tokens + new_tokens;
        let required_blocks = total_tokens.div_ceil(block_size);
        let held_blocks = request.blocks.len() + hit_blocks.len();
        let new_blocks = required_blocks.saturating_sub(held_blocks);
        // Touching a free cached hit block takes it out of the free queue too.
        let free_hit_blocks = hit_blocks
            .iter()
            .filter(|&&block| self.pool.ref_count(block) == 0)
            .count();
        if new_blocks > self.pool.num_free().saturating_sub(free_hit_blocks) {
            return false;
        }
        self.pool.touch(hit_blocks);
        request.blocks.extend_from_slice(hit_blocks);
        // Prefix hits are already in the cache: never announced again.
        request.num_cached_blocks += hit_blocks.len();
        if let Some(allocated) = self.pool.allocate(new_blocks) {
            request.blocks.extend(allocated);
        }
        // Blocks whose tokens are all known and computed by the end of this step are cached
        // now (vLLM caches at allocation time, so later arrivals hit them immediately).
        let cacheable_tokens = total_tokens.min(request.num_tokens());
        let full_blocks = (cacheable_tokens / block_size).min(request.block_hashes.len());
        if full_blocks > request.num_cached_blocks {
            let first = request.num_cached_blocks;
            let parent = first
                .checked_sub(1)
                .map(|previous| request.block_hashes[previous]);
            self.pool.cache_full_blocks(
                &request.blocks[first..full_blocks],
                &request.block_hashes[first..full_blocks],
                parent,
                &request.all_token_ids[first * block_size..full_blocks * block_size],
                &request.cache_keys,
                first,
            );
            request.num_cached_blocks = full_blocks;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::A100Llama8B;
    use myelin_kv_events::{BlockRemoved, BlockStored, MEDIUM_GPU};

    fn engine(num_gpu_blocks: usize, block_size: usize) -> EngineModel {
        EngineModel::new(
            EngineConfig {
                block_size,
                num_gpu_blocks,
                ..EngineConfig::default()
            },
            Arc::new(A100Llama8B),
            OutputVocabulary::default(),
        )
    }

    fn spec(prompt: Vec<u32>, max_tokens: usize) -> RequestSpec {
        RequestSpec {
            prompt_token_ids: prompt,
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..RequestSpec::default()
        }
    }

    /// Runs steps until idle; returns every output.
    fn run_to_idle(engine: &mut EngineModel) -> Vec<RequestOutput> {
        let mut outputs = Vec::new();
        for _ in 0..10_000 {
            let Some(step) = engine.schedule() else {
                break;
            };
            outputs.extend(engine.complete_step(&step));
        }
        assert!(engine.is_idle(), "engine did not drain");
        outputs
    }

    fn cached_tokens_of(outputs: &[RequestOutput], id: RequestId) -> usize {
        outputs
            .iter()
            .find(|output| output.request_id == id)
            .map(|output| output.cached_prompt_tokens)
            .expect("request produced output")
    }

    fn stored(events: &[KvEvent]) -> Vec<&BlockStored> {
        events
            .iter()
            .filter_map(|event| match event {
                KvEvent::BlockStored(stored) => Some(stored),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn adapters_and_salts_share_no_cached_block_and_their_events_say_so() {
        use myelin_kv_events::ExtraKey;
        let mut engine = engine(100, 16);
        let prompt: Vec<u32> = (0..40).collect();
        let keyed = |lora: Option<&str>, salt: Option<&str>| RequestSpec {
            lora: lora.map(str::to_string),
            cache_salt: salt.map(str::to_string),
            ..spec(prompt.clone(), 1)
        };
        let mut id = 0;
        let mut cached = |engine: &mut EngineModel, spec: RequestSpec| {
            id += 1;
            engine.add_request(id, spec).expect("accepted");
            cached_tokens_of(&run_to_idle(engine), id)
        };
        assert_eq!(cached(&mut engine, keyed(None, None)), 0);
        // Another adapter, another salt, both: a miss each; the same key again: a hit.
        assert_eq!(cached(&mut engine, keyed(Some("sql"), None)), 0);
        assert_eq!(cached(&mut engine, keyed(None, Some("t1"))), 0);
        assert_eq!(cached(&mut engine, keyed(Some("sql"), Some("t1"))), 0);
        for (lora, salt) in [(None, None), (Some("sql"), None), (None, Some("t1"))] {
            assert_eq!(
                cached(&mut engine, keyed(lora, salt)),
                32,
                "{lora:?} {salt:?}"
            );
        }
        let events = engine.take_events();
        let stored = stored(&events);
        assert_eq!(stored.len(), 4, "each key stored its own blocks once");
        let key = |text: &str| ExtraKey::Str(text.to_string());
        assert_eq!(stored[0].extra_keys, None);
        assert_eq!(stored[1].lora_name.as_deref(), Some("sql"));
        assert_eq!(
            stored[1].extra_keys,
            Some(vec![Some(vec![key("sql")]), Some(vec![key("sql")])])
        );
        assert_eq!(
            stored[2].extra_keys,
            Some(vec![Some(vec![key("t1")]), None])
        );
        assert_eq!(
            stored[3].extra_keys,
            Some(vec![
                Some(vec![key("sql"), key("t1")]),
                Some(vec![key("sql")])
            ])
        );
    }

    #[test]
    fn repeated_prompt_hits_all_full_blocks_but_the_last_token() {
        let mut engine = engine(100, 16);
        let prompt: Vec<u32> = (0..40).collect();
        engine
            .add_request(1, spec(prompt.clone(), 1))
            .expect("accepted");
        let first = run_to_idle(&mut engine);
        assert_eq!(cached_tokens_of(&first, 1), 0);
        let events = engine.take_events();
        let stored = stored(&events);
        assert_eq!(stored.len(), 1);
        let chain = hash_token_blocks(&prompt, 16);
        assert_eq!(
            stored[0].block_hashes,
            vec![chain[0].wire_u64(), chain[1].wire_u64()]
        );
        assert_eq!(stored[0].parent_block_hash, None);
        assert_eq!(stored[0].token_ids, prompt[..32].to_vec());
        assert_eq!(stored[0].medium.as_deref(), Some(MEDIUM_GPU));

        engine
            .add_request(2, spec(prompt.clone(), 1))
            .expect("accepted");
        let second = run_to_idle(&mut engine);
        // 40 tokens: the two full blocks (32) hit; the partial block is recomputed.
        assert_eq!(cached_tokens_of(&second, 2), 32);
        assert!(stored_none(&engine.take_events()));

        // An exact multiple of the block size: the last block is recomputed for its last token.
        let exact: Vec<u32> = (0..32).collect();
        engine.add_request(3, spec(exact, 1)).expect("accepted");
        let third = run_to_idle(&mut engine);
        assert_eq!(cached_tokens_of(&third, 3), 16);
        let counters = engine.counters();
        assert_eq!(counters.prefix_cache_queries, 40 + 40 + 32);
        assert_eq!(counters.prefix_cache_hits, 32 + 16);
    }

    fn stored_none(events: &[KvEvent]) -> bool {
        stored(events).is_empty()
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_blocks_first() {
        // 4 blocks of 4 tokens; each request uses 2 blocks.
        let mut engine = engine(4, 4);
        engine
            .add_request(1, spec(vec![1; 8], 1))
            .expect("accepted");
        run_to_idle(&mut engine);
        engine
            .add_request(2, spec(vec![2; 8], 1))
            .expect("accepted");
        run_to_idle(&mut engine);
        let a = hash_token_blocks(&[1; 8], 4);
        let b = hash_token_blocks(&[2; 8], 4);
        assert_eq!(engine.cached_prefix_tokens(&[1; 8]), 8);
        assert_eq!(engine.cached_prefix_tokens(&[2; 8]), 8);
        engine.take_events();

        engine
            .add_request(3, spec(vec![3; 8], 1))
            .expect("accepted");
        run_to_idle(&mut engine);
        let removed: Vec<u64> = engine
            .take_events()
            .into_iter()
            .filter_map(|event| match event {
                KvEvent::BlockRemoved(BlockRemoved { block_hashes, .. }) => Some(block_hashes),
                _ => None,
            })
            .flatten()
            .collect();
        // Request 1 was freed first, tail block first.
        assert_eq!(removed, vec![a[1].wire_u64(), a[0].wire_u64()]);
        assert_eq!(engine.cached_prefix_tokens(&[1; 8]), 0);
        assert_eq!(engine.cached_prefix_tokens(&[2; 8]), 8);
        assert_eq!(engine.counters().evictions, 2);
        assert!(b.iter().all(|hash| !removed.contains(&hash.wire_u64())));
    }

    #[test]
    fn the_newest_request_is_preempted_and_recomputed_when_blocks_run_out() {
        // 4 blocks of 4 tokens = 16 tokens; two requests growing to 14 tokens cannot coexist.
        let mut engine = engine(4, 4);
        engine
            .add_request(1, spec(vec![1, 2, 3, 4], 10))
            .expect("accepted");
        engine
            .add_request(2, spec(vec![5, 6, 7, 8], 10))
            .expect("accepted");
        let mut preempted = Vec::new();
        let mut outputs = Vec::new();
        for _ in 0..1000 {
            let Some(step) = engine.schedule() else {
                break;
            };
            preempted.extend(step.preempted.iter().copied());
            outputs.extend(engine.complete_step(&step));
        }
        assert!(engine.is_idle());
        assert!(engine.counters().preemptions >= 1);
        assert_eq!(preempted.first(), Some(&2), "the newest request goes first");
        for id in [1, 2] {
            let tokens: Vec<u32> = outputs
                .iter()
                .filter(|output| output.request_id == id)
                .map(|output| output.token_id)
                .collect();
            assert_eq!(tokens.len(), 10, "request {id} produced every token once");
            assert_eq!(
                outputs
                    .iter()
                    .filter(|output| output.request_id == id && output.finished.is_some())
                    .count(),
                1
            );
        }
        assert_eq!(engine.pool().num_free(), 4);
    }

    #[test]
    fn abort_frees_the_blocks_even_mid_step() {
        let mut engine = engine(64, 16);
        engine
            .add_request(7, spec((0..100).collect(), 50))
            .expect("accepted");
        let step = engine.schedule().expect("scheduled");
        assert!(engine.request_blocks(7) > 0);
        assert!(engine.pool().num_free() < 64);
        assert!(engine.abort(7));
        assert_eq!(engine.pool().num_free(), 64);
        assert!(engine.complete_step(&step).is_empty());
        assert!(engine.is_idle());
        assert!(!engine.abort(7));
        assert_eq!(engine.counters().requests_aborted, 1);
        // Its full prompt blocks stay cached (free) after the abort.
        assert_eq!(
            engine.cached_prefix_tokens(&(0..100).collect::<Vec<_>>()),
            96
        );
    }

    #[test]
    fn step_time_comes_from_the_profile() {
        let mut engine = engine(1000, 16);
        engine
            .add_request(1, spec((0..2048).collect(), 2))
            .expect("accepted");
        let step = engine.schedule().expect("scheduled");
        let chunk = ScheduledChunk {
            new_tokens: 2048,
            context_tokens: 0,
        };
        let expected = A100Llama8B.step_time(&StepShape {
            chunks: &[chunk],
            kv_usage: engine.pool().usage(),
        });
        assert_eq!(step.step_time, expected);
        assert_eq!(step.requests, vec![(1, chunk)]);
    }

    #[test]
    fn long_prompts_are_chunked_and_decodes_go_first() {
        let mut engine = engine(2000, 16);
        let budget = engine.config().max_num_batched_tokens;
        assert_eq!(budget, 2048, "vLLM's OpenAI-server default on an A100");
        engine
            .add_request(1, spec((0..100).collect(), 5))
            .expect("accepted");
        let step = engine.schedule().expect("scheduled");
        assert_eq!(engine.complete_step(&step).len(), 1);
        let prompt = budget as u32 + 1000;
        engine
            .add_request(2, spec((1000..1000 + prompt).collect(), 5))
            .expect("accepted");
        let step = engine.schedule().expect("scheduled");
        assert_eq!(step.requests[0].0, 1, "the decode comes first");
        assert_eq!(step.requests[0].1.new_tokens, 1);
        assert_eq!(
            step.requests[1].1.new_tokens,
            budget - 1,
            "the prefill takes the rest"
        );
        let outputs = engine.complete_step(&step);
        assert!(outputs.iter().all(|output| output.request_id == 1));
        let step = engine.schedule().expect("scheduled");
        assert_eq!(
            step.requests[1].1.new_tokens,
            prompt as usize - (budget - 1)
        );
        assert_eq!(step.requests[1].1.context_tokens, budget - 1);
        let outputs = engine.complete_step(&step);
        assert!(outputs.iter().any(|output| output.request_id == 2));
    }

    #[test]
    fn max_num_seqs_bounds_the_running_batch() {
        let mut engine = EngineModel::new(
            EngineConfig {
                num_gpu_blocks: 1000,
                max_num_seqs: 2,
                ..EngineConfig::default()
            },
            Arc::new(A100Llama8B),
            OutputVocabulary::default(),
        );
        for id in 0..3 {
            engine
                .add_request(id, spec(vec![id as u32 + 1; 20], 3))
                .expect("accepted");
        }
        let step = engine.schedule().expect("scheduled");
        assert_eq!(step.requests.len(), 2);
        assert_eq!(engine.load().waiting, 1);
        assert_eq!(engine.load().running, 2);
        run_to_idle(&mut engine);
    }

    #[test]
    fn outputs_are_deterministic_and_eos_is_honoured() {
        let mut first = engine(100, 16);
        let mut second = engine(100, 16);
        let natural = RequestSpec {
            prompt_token_ids: (0..30).collect(),
            max_tokens: Some(1000),
            ignore_eos: false,
            ..RequestSpec::default()
        };
        first.add_request(1, natural.clone()).expect("accepted");
        second.add_request(9, natural).expect("accepted");
        let a: Vec<(u32, Option<FinishReason>)> = run_to_idle(&mut first)
            .into_iter()
            .map(|output| (output.token_id, output.finished))
            .collect();
        let b: Vec<(u32, Option<FinishReason>)> = run_to_idle(&mut second)
            .into_iter()
            .map(|output| (output.token_id, output.finished))
            .collect();
        assert_eq!(a, b);
        assert!((64..=256).contains(&a.len()));
        assert_eq!(
            a.last().and_then(|(_, finished)| *finished),
            Some(FinishReason::Stop)
        );
    }

    #[test]
    fn too_long_requests_are_refused() {
        let mut engine = engine(4, 4);
        let refused = engine.add_request(1, spec(vec![1; 10], 10));
        assert!(matches!(
            refused,
            Err(AddRequestError::TooLong {
                max_model_len: 16,
                ..
            })
        ));
        assert_eq!(
            engine.add_request(2, spec(Vec::new(), 1)),
            Err(AddRequestError::EmptyPrompt)
        );
    }

    #[test]
    fn output_blocks_are_cached_as_they_fill() {
        let mut engine = engine(100, 4);
        engine
            .add_request(1, spec(vec![9, 9, 9], 6))
            .expect("accepted");
        let outputs = run_to_idle(&mut engine);
        let mut all: Vec<u32> = vec![9, 9, 9];
        all.extend(outputs.iter().map(|output| output.token_id));
        // 9 tokens: the last sampled one is never computed, so 8 are cached = 2 blocks.
        assert_eq!(engine.cached_prefix_tokens(&all), 8);
        let events = engine.take_events();
        let stored = stored(&events);
        assert_eq!(stored.len(), 2);
        assert_eq!(stored[1].parent_block_hash, Some(stored[0].block_hashes[0]));
    }

    #[test]
    fn reset_prefix_cache_clears_when_idle() {
        let mut engine = engine(10, 4);
        engine
            .add_request(1, spec(vec![4; 8], 1))
            .expect("accepted");
        run_to_idle(&mut engine);
        engine.take_events();
        assert!(engine.reset_prefix_cache());
        assert_eq!(engine.cached_prefix_tokens(&[4; 8]), 0);
        assert_eq!(
            engine.take_events(),
            vec![KvEvent::AllBlocksCleared(
                myelin_kv_events::AllBlocksCleared
            )]
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        #[derive(Clone, Debug)]
        enum Operation {
            Add {
                family: u32,
                prompt_len: usize,
                max_tokens: usize,
            },
            Step,
            Abort(usize),
            Reset,
        }

        fn operation() -> impl Strategy<Value = Operation> {
            prop_oneof![
                3 => (0u32..4, 1usize..28, 1usize..8).prop_map(|(family, prompt_len, max_tokens)| {
                    Operation::Add { family, prompt_len, max_tokens }
                }),
                5 => Just(Operation::Step),
                1 => (0usize..16).prop_map(Operation::Abort),
                1 => Just(Operation::Reset),
            ]
        }

        /// A consumer's mirror: copies per hash, from the event stream alone.
        fn apply(mirror: &mut HashMap<u64, usize>, events: Vec<KvEvent>) {
            for event in events {
                match event {
                    KvEvent::BlockStored(stored) => {
                        for hash in stored.block_hashes {
                            *mirror.entry(hash).or_default() += 1;
                        }
                    }
                    KvEvent::BlockRemoved(removed) => {
                        for hash in removed.block_hashes {
                            let copies = mirror.get_mut(&hash).expect("removed a known hash");
                            *copies -= 1;
                            if *copies == 0 {
                                mirror.remove(&hash);
                            }
                        }
                    }
                    KvEvent::AllBlocksCleared(_) => mirror.clear(),
                }
            }
        }

        fn check_invariants(engine: &EngineModel, mirror: &HashMap<u64, usize>) {
            assert_eq!(
                &engine.pool().cached_copies(),
                mirror,
                "events describe the cache"
            );
            let held: usize = engine
                .requests
                .values()
                .map(|request| request.blocks.len())
                .sum();
            assert_eq!(engine.pool().total_references(), held as u64);
            assert!(engine.running.len() <= engine.config().max_num_seqs);
            for request in engine.requests.values() {
                let needed = request
                    .num_computed_tokens
                    .div_ceil(engine.config().block_size);
                assert!(request.blocks.len() >= needed);
            }
        }

        proptest! {
            #[test]
            fn the_event_stream_mirrors_the_cache_and_blocks_balance(
                operations in proptest::collection::vec(operation(), 1..120)
            ) {
                let mut engine = EngineModel::new(
                    EngineConfig {
                        block_size: 4,
                        num_gpu_blocks: 10,
                        max_num_batched_tokens: 16,
                        max_num_seqs: 3,
                        ..EngineConfig::default()
                    },
                    Arc::new(A100Llama8B),
                    OutputVocabulary::default(),
                );
                let mut mirror = HashMap::new();
                let mut next_id = 0;
                let mut pending: Option<ScheduledStep> = None;
                for operation in operations {
                    match operation {
                        Operation::Add { family, prompt_len, max_tokens } => {
                            let prompt: Vec<u32> =
                                (0..prompt_len as u32).map(|i| family * 1000 + i).collect();
                            let _ = engine.add_request(next_id, spec(prompt, max_tokens));
                            next_id += 1;
                        }
                        Operation::Step => {
                            if let Some(step) = pending.take() {
                                engine.complete_step(&step);
                            } else {
                                pending = engine.schedule();
                            }
                        }
                        Operation::Abort(index) => {
                            let ids: Vec<RequestId> = engine.requests.keys().copied().collect();
                            if !ids.is_empty() {
                                engine.abort(ids[index % ids.len()]);
                            }
                        }
                        Operation::Reset => {
                            engine.reset_prefix_cache();
                        }
                    }
                    apply(&mut mirror, engine.take_events());
                    check_invariants(&engine, &mirror);
                }
                if let Some(step) = pending.take() {
                    engine.complete_step(&step);
                }
                run_to_idle(&mut engine);
                apply(&mut mirror, engine.take_events());
                check_invariants(&engine, &mirror);
                prop_assert_eq!(engine.pool().num_free(), 10);
            }
        }
    }
}
