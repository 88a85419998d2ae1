//! Mooncake-format trace replay: one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids` (ids of 512-token prefix blocks). Each block
//! id always expands to the same tokens, so equal ids at the same positions give equal
//! prefixes; the last block is cut to `input_length`.

use serde::Deserialize;

use super::config::{WorkloadConfig, WorkloadError};
use super::{PlannedRequest, TokenAlphabet};
use crate::rng::{self, stream};

/// The 300-request slice of the Mooncake conversation trace shipped with the repository
/// (benches/data/mooncake-slice.jsonl; Apache-2.0, benches/data/mooncake-LICENSE).
pub const BUILTIN_SLICE: &str = include_str!("../../../../benches/data/mooncake-slice.jsonl");

/// The name the built-in slice goes by in reports.
pub const BUILTIN_SLICE_NAME: &str = "benches/data/mooncake-slice.jsonl (built in)";

/// One trace line.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
    /// Line number in the file, from 1 (set by [`parse_trace`]).
    #[serde(skip)]
    pub line: usize,
}

/// Parses JSONL trace text, keeping at most `max_requests` lines (blank lines skipped).
pub fn parse_trace(
    source_name: &str,
    text: &str,
    max_requests: Option<u32>,
) -> Result<Vec<TraceRecord>, WorkloadError> {
    let limit = max_requests.map_or(usize::MAX, |max| max as usize);
    let mut records = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if records.len() >= limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let line_error = |problem: String| WorkloadError::TraceLine {
            path: source_name.to_string(),
            line: index + 1,
            problem,
        };
        let mut record: TraceRecord =
            serde_json::from_str(line).map_err(|error| line_error(error.to_string()))?;
        record.line = index + 1;
        if record.input_length == 0 || record.hash_ids.is_empty() {
            return Err(line_error(
                "input_length and hash_ids must not be empty".into(),
            ));
        }
        if record.output_length == 0 {
            return Err(line_error("output_length must be > 0".into()));
        }
        records.push(record);
    }
    if records.is_empty() {
        return Err(WorkloadError::TraceLine {
            path: source_name.to_string(),
            line: 0,
            problem: "no requests".into(),
        });
    }
    Ok(records)
}

/// Trace lines left out of the replay because the engines would refuse them.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SkippedOverContext {
    /// The engines' context length: prompt plus output tokens may not exceed it.
    pub context_tokens: usize,
    /// How many lines were skipped.
    pub count: usize,
    /// Their line numbers in the file, from 1.
    pub lines: Vec<usize>,
}

/// The trace generator.
#[derive(Debug)]
pub struct TraceWorkload {
    seed: u64,
    block_tokens: u32,
    time_scale: f64,
    source_name: String,
    /// Timestamp of the trace's first line: time zero of the replay, skipped or not.
    first_timestamp: u64,
    records: Vec<TraceRecord>,
    /// Per record: its leading tokens whose block ids an earlier replayed line already sent.
    reusable: Vec<usize>,
    skipped: SkippedOverContext,
    alphabet: TokenAlphabet,
}

/// Per record, in order: how many of its leading tokens are covered by block ids that an
/// earlier record already had (Mooncake's ids hash the whole prefix up to their block, so an
/// id seen before stands for the same leading tokens), cut to its `input_length`.
pub fn reusable_tokens(records: &[TraceRecord], block_tokens: u32) -> Vec<usize> {
    let mut seen = std::collections::HashSet::new();
    records
        .iter()
        .map(|record| {
            let leading = record
                .hash_ids
                .iter()
                .take_while(|id| seen.contains(*id))
                .count();
            seen.extend(record.hash_ids.iter().copied());
            (leading * block_tokens as usize).min(record.input_length as usize)
        })
        .collect()
}

/// The distinct tokens the records' block ids stand for: each distinct id counts the tokens of
/// its block that some record covers (the last block of a line is cut to its `input_length`).
pub fn distinct_block_tokens(records: &[TraceRecord], block_tokens: u32) -> u64 {
    let mut covered: std::collections::HashMap<u64, u64> = Default::default();
    let block = u64::from(block_tokens);
    for record in records {
        let input = u64::from(record.input_length);
        for (position, id) in record.hash_ids.iter().enumerate() {
            let start = position as u64 * block;
            if start >= input {
                break;
            }
            let tokens = (input - start).min(block);
            let entry = covered.entry(*id).or_default();
            *entry = (*entry).max(tokens);
        }
    }
    covered.values().sum()
}

/// The lines a trace config replays, before the context cut: the file's (or the built-in
/// slice's) first `max_requests`, and the name of where they came from.
pub fn config_records(
    config: &WorkloadConfig,
) -> Result<(String, Vec<TraceRecord>), WorkloadError> {
    let trace = config
        .trace
        .clone()
        .unwrap_or_else(|| unreachable!("validated trace config"));
    Ok(match &trace.path {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Read {
                path: path.clone(),
                source,
            })?;
            (path.clone(), parse_trace(path, &text, trace.max_requests)?)
        }
        None => (
            BUILTIN_SLICE_NAME.to_string(),
            parse_trace(BUILTIN_SLICE_NAME, BUILTIN_SLICE, trace.max_requests)?,
        ),
    })
}

impl TraceWorkload {
    /// Reads the trace the config names (or the built-in slice), keeping the lines the engines
    /// accept: a line whose prompt plus output exceeds the engines' context length (the
    /// profile's, capped by the KV capacity, as the simulated engine caps it) would get a 400,
    /// so it is skipped here, before the run, the same on every leg, and reported.
    pub fn load(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Result<Self, WorkloadError> {
        let trace = config
            .trace
            .clone()
            .unwrap_or_else(|| unreachable!("validated trace config"));
        let (source_name, records) = config_records(config)?;
        let first_timestamp = records.first().map_or(0, |record| record.timestamp);
        let context_tokens = config.cluster.context_tokens();
        let (records, over): (Vec<TraceRecord>, Vec<TraceRecord>) =
            records.into_iter().partition(|record| {
                record.input_length as usize + record.output_length as usize <= context_tokens
            });
        if records.is_empty() {
            return Err(WorkloadError::TraceLine {
                path: source_name,
                line: 0,
                problem: format!(
                    "every line's prompt plus output exceeds the engines' context length of \
                     {context_tokens} tokens"
                ),
            });
        }
        let skipped = SkippedOverContext {
            context_tokens,
            count: over.len(),
            lines: over.iter().map(|record| record.line).collect(),
        };
        Ok(Self {
            seed: config.seed,
            block_tokens: trace.block_tokens,
            time_scale: trace.time_scale,
            source_name,
            first_timestamp,
            reusable: reusable_tokens(&records, trace.block_tokens),
            records,
            skipped,
            alphabet,
        })
    }

    /// The leading tokens of the request of file line `line_index` (0-based, the request's
    /// label) whose block ids an earlier replayed line already sent; 0 for a line not replayed.
    pub fn reusable_len(&self, line_index: usize) -> usize {
        self.records
            .binary_search_by_key(&(line_index + 1), |record| record.line)
            .map_or(0, |position| self.reusable[position])
    }

    /// Mean requests per simulated second over the replay: requests over its span.
    pub fn mean_rate_rps(&self) -> f64 {
        self.records.len() as f64 / self.span_s().max(1e-9)
    }

    /// The replayed lines.
    pub fn records(&self) -> &[TraceRecord] {
        &self.records
    }

    /// The lines left out because they exceed the context length.
    pub fn skipped_over_context(&self) -> &SkippedOverContext {
        &self.skipped
    }

    /// Where the trace came from.
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// Requests in the replay.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the replay is empty (never, once loaded).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Simulated seconds from the start of the leg at which request `index` is sent.
    pub fn send_at_s(&self, index: usize) -> f64 {
        (self.records[index]
            .timestamp
            .saturating_sub(self.first_timestamp)) as f64
            / 1000.0
            * self.time_scale
    }

    /// The simulated seconds the whole replay spans.
    pub fn span_s(&self) -> f64 {
        self.send_at_s(self.records.len() - 1)
    }

    /// The tokens of one block id: the same id always gives the same tokens.
    pub fn block_tokens(&self, block_id: u64) -> impl Iterator<Item = u32> + '_ {
        (0..u64::from(self.block_tokens)).map(move |position| {
            self.alphabet.pick(rng::draw(
                self.seed,
                stream::TRACE_BLOCK_TOKENS ^ block_id,
                position,
            ))
        })
    }

    /// Request `index`: its blocks' tokens, cut to `input_length`. A line whose input is longer
    /// than its blocks (outside the format's guarantee) gets the missing tail from tokens unique
    /// to that line.
    pub fn request(&self, index: usize) -> PlannedRequest {
        let record = &self.records[index];
        let input_length = record.input_length as usize;
        let mut tokens = Vec::with_capacity(input_length);
        for &block_id in &record.hash_ids {
            if tokens.len() >= input_length {
                break;
            }
            tokens.extend(self.block_tokens(block_id));
        }
        tokens.truncate(input_length);
        // Keyed by the line, so skipping other lines changes nothing here.
        let line_index = record.line.saturating_sub(1) as u64;
        let tail_stream = stream::SUFFIX_TOKENS ^ (u64::MAX - line_index);
        let mut position = 0;
        while tokens.len() < input_length {
            tokens.push(
                self.alphabet
                    .pick(rng::draw(self.seed, tail_stream, position)),
            );
            position += 1;
        }
        // The shared part: every full block (the last, partial one is this line's own).
        let shared_len = (input_length / self.block_tokens as usize) * self.block_tokens as usize;
        PlannedRequest {
            tokens,
            shared_len: shared_len.min(input_length),
            output_tokens: record.output_length,
            label: line_index,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(max_requests: Option<u32>) -> TraceWorkload {
        let mut config = WorkloadConfig::load("trace").unwrap();
        if let Some(trace) = config.trace.as_mut() {
            trace.max_requests = max_requests;
        }
        TraceWorkload::load(&config, TokenAlphabet::token_ids()).unwrap()
    }

    #[test]
    fn builtin_slice_parses_and_slices() {
        assert_eq!(workload(None).len(), 300);
        assert_eq!(workload(Some(25)).len(), 25);
        let replay = workload(None);
        assert_eq!(replay.send_at_s(0), 0.0);
        assert!(replay.span_s() > 60.0);
        assert!(
            (1..replay.len()).all(|index| replay.send_at_s(index) >= replay.send_at_s(index - 1))
        );
    }

    #[test]
    fn requests_have_the_trace_lengths_and_shared_blocks_give_shared_tokens() {
        let replay = workload(Some(50));
        let first = replay.request(0);
        let second = replay.request(1);
        assert_eq!(first.tokens.len(), 6758);
        assert_eq!(second.tokens.len(), 7322);
        assert_eq!(first.output_tokens, 500);
        // Both lines start with block id 0 and then differ.
        assert_eq!(&first.tokens[..512], &second.tokens[..512]);
        assert_ne!(&first.tokens[512..1024], &second.tokens[512..1024]);
        assert_eq!(replay.request(7), workload(Some(50)).request(7));
    }

    #[test]
    fn time_scale_stretches_the_schedule() {
        let mut config = WorkloadConfig::load("trace").unwrap();
        if let Some(trace) = config.trace.as_mut() {
            trace.time_scale = 0.5;
        }
        let fast = TraceWorkload::load(&config, TokenAlphabet::token_ids()).unwrap();
        if let Some(trace) = config.trace.as_mut() {
            trace.time_scale = 1.0;
        }
        let normal = TraceWorkload::load(&config, TokenAlphabet::token_ids()).unwrap();
        assert_eq!(fast.send_at_s(200) * 2.0, normal.send_at_s(200));
        assert_eq!(normal.send_at_s(299), 102.0);
    }

    #[test]
    fn lines_over_the_context_are_skipped_and_the_rest_is_unchanged() {
        let full = workload(Some(100));
        assert_eq!(full.skipped_over_context().count, 0);
        assert_eq!(full.skipped_over_context().context_tokens, 131_072);
        // 500 blocks of 16 tokens: an 8,000-token context (the KV capacity caps it).
        let mut config = WorkloadConfig::load("trace").unwrap();
        config.cluster.kv_blocks = 500;
        if let Some(trace) = config.trace.as_mut() {
            trace.max_requests = Some(100);
        }
        let cut = TraceWorkload::load(&config, TokenAlphabet::token_ids()).unwrap();
        let skipped = cut.skipped_over_context();
        assert_eq!(skipped.context_tokens, 8000);
        assert!(skipped.count > 0 && !cut.is_empty());
        assert_eq!(cut.len() + skipped.count, 100);
        assert_eq!(skipped.lines.len(), skipped.count);
        // Exactly the lines over the context went, and every kept one is the same request at
        // the same time as in the full replay.
        let mut kept = 0;
        for index in 0..full.len() {
            let record = &full.records[index];
            let total = (record.input_length + record.output_length) as usize;
            if total > 8000 {
                assert!(skipped.lines.contains(&record.line));
                continue;
            }
            assert_eq!(cut.request(kept), full.request(index));
            assert_eq!(cut.send_at_s(kept), full.send_at_s(index));
            kept += 1;
        }
        assert_eq!(kept, cut.len());
        // A context no line fits is an error, not an empty run.
        config.cluster.kv_blocks = 1;
        assert!(TraceWorkload::load(&config, TokenAlphabet::token_ids()).is_err());
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let text =
            "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[1]}\n{oops}\n";
        let error = parse_trace("t.jsonl", text, None).unwrap_err();
        assert!(
            matches!(error, WorkloadError::TraceLine { line: 2, .. }),
            "{error}"
        );
        let cut = parse_trace("t.jsonl", text, Some(1)).unwrap();
        assert_eq!(cut.len(), 1);
    }

    #[test]
    fn reuse_counts_the_leading_blocks_an_earlier_line_sent() {
        let text = "{\"timestamp\":0,\"input_length\":1000,\"output_length\":1,\"hash_ids\":[1,2]}\n\
                    {\"timestamp\":1,\"input_length\":1200,\"output_length\":1,\"hash_ids\":[1,2,3]}\n\
                    {\"timestamp\":2,\"input_length\":900,\"output_length\":1,\"hash_ids\":[1,4]}\n\
                    {\"timestamp\":3,\"input_length\":300,\"output_length\":1,\"hash_ids\":[1,2,3]}\n";
        let records = parse_trace("t.jsonl", text, None).unwrap();
        // Line 2 reuses both blocks of line 1 (1,000 tokens: line 1's second block is cut to
        // 488 tokens, but line 2 holds 512 of it); line 3 block 1; line 4 all of its 300.
        assert_eq!(reusable_tokens(&records, 512), [0, 1024, 512, 300]);
        // Distinct ids 1, 2, 3, 4: 512 + 512 + (1,200 - 1,024) + (900 - 512).
        assert_eq!(distinct_block_tokens(&records, 512), 512 + 512 + 176 + 388);
        let replay = workload(Some(300));
        assert_eq!(replay.reusable_len(0), 0);
        assert_eq!(
            replay.reusable_len(1),
            512,
            "line 2 starts with line 1's block 0"
        );
        // The built-in workload replays at a quarter of the trace's rate (time_scale 4).
        assert!((replay.mean_rate_rps() - 300.0 / (102.0 * 4.0)).abs() < 1e-9);
    }
}
