//! What the harness records about each request, and requests.csv.

use std::io::Write;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Streamed to the end with at least one content token.
    Ok,
    /// The router or engine answered with a non-2xx status.
    HttpStatus(u16),
    /// Connecting, sending or reading failed, or the stream broke or carried an error event.
    Failed(String),
    /// No answer within the request timeout.
    TimedOut,
}

impl Outcome {
    /// Whether the request counts as an error.
    pub fn is_error(&self) -> bool {
        !matches!(self, Outcome::Ok)
    }

    /// The short form written to requests.csv.
    pub fn describe(&self) -> String {
        match self {
            Outcome::Ok => "ok".into(),
            Outcome::HttpStatus(status) => format!("http {status}"),
            Outcome::Failed(reason) => format!("failed: {reason}"),
            Outcome::TimedOut => "timeout".into(),
        }
    }
}

/// One request as the harness saw it. Times are wall-clock microseconds measured by the
/// harness; reports convert them to simulated milliseconds with the leg's speedup.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// Closed-loop user (or 0 for open loop).
    pub user: u32,
    /// The user's request number (open loop: the trace line).
    pub seq: u64,
    /// What the shared prefix was (see `PlannedRequest::label`).
    pub label: u64,
    /// When the request was sent, wall microseconds since the leg started.
    pub sent_at_us: u64,
    /// Open loop: when the schedule said to send it, simulated seconds since the leg started
    /// (the same on every leg, so the warm-up cut is too; the timer sends a little later).
    pub planned_send_s: Option<f64>,
    /// Send to the first content token, wall microseconds.
    pub ttft_us: Option<u64>,
    /// Send to the end of the stream, wall microseconds.
    pub e2e_us: Option<u64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens` as the engine reported it.
    pub cached_tokens: Option<u32>,
    /// The engine that served it (`x-myelin-backend`, or the oracle's choice).
    pub backend: Option<String>,
    pub outcome: Outcome,
    /// Its leading prompt tokens that an earlier request may have left in a cache (the churn
    /// prefix, the system prompt, the previous turn; see `Workload::reusable_len`).
    pub reusable_tokens: u32,
    /// At send time, the most leading prompt tokens any engine held in full KV blocks (the
    /// simulator's truth; `None`: not probed).
    pub resident_tokens: Option<u32>,
    /// Whether, at send time, some engine held every full block of its reusable prefix
    /// (`None`: not probed, or a reusable prefix shorter than one block).
    pub prefix_resident: Option<bool>,
    /// The time to first token the router predicted for it on the engine it chose, wall
    /// microseconds (`x-myelin-predicted-ttft-us`; the oracle's own prediction on its leg;
    /// `None` for routers that give none).
    pub predicted_ttft_us: Option<u64>,
}

impl RequestRecord {
    /// Whether `resident_tokens` cover every full `block_size` block of `reusable_tokens`
    /// (`None` when not probed or the reusable prefix is shorter than a block).
    pub fn resident_verdict(
        reusable_tokens: u32,
        resident_tokens: Option<u32>,
        block_size: u32,
    ) -> Option<bool> {
        let block_size = block_size.max(1);
        let needed = reusable_tokens / block_size * block_size;
        resident_tokens
            .filter(|_| needed > 0)
            .map(|resident| resident >= needed)
    }
}

/// A record with the leg it belongs to, for the CSV.
pub struct LegRecords<'a> {
    pub leg: &'a str,
    pub repeat: u32,
    pub speedup: f64,
    pub warmup_s: f64,
    pub records: &'a [RequestRecord],
}

/// The requests.csv header.
pub const CSV_HEADER: &str = "leg,repeat,user,seq,label,send_s,ttft_ms,e2e_ms,prompt_tokens,output_tokens,cached_tokens,backend,status,in_warmup,ttft_wall_us,reusable_tokens,resident_tokens,prefix_resident,predicted_ttft_ms";

/// Writes requests.csv: one line per request, times in simulated units.
pub fn write_csv(mut out: impl Write, legs: &[LegRecords<'_>]) -> std::io::Result<()> {
    writeln!(out, "{CSV_HEADER}")?;
    for leg in legs {
        let to_sim_ms = |wall_us: u64| wall_us as f64 * leg.speedup / 1000.0;
        for record in leg.records {
            let send_s = to_sim_ms(record.sent_at_us) / 1000.0;
            let optional_ms = |value: Option<u64>| {
                value.map_or(String::new(), |us| format!("{:.3}", to_sim_ms(us)))
            };
            writeln!(
                out,
                "{},{},{},{},{},{:.3},{},{},{},{},{},{},{},{},{},{},{},{},{}",
                csv_field(leg.leg),
                leg.repeat,
                record.user,
                record.seq,
                record.label,
                send_s,
                optional_ms(record.ttft_us),
                optional_ms(record.e2e_us),
                record.prompt_tokens,
                record.output_tokens,
                record
                    .cached_tokens
                    .map_or(String::new(), |cached| cached.to_string()),
                csv_field(record.backend.as_deref().unwrap_or("")),
                csv_field(&record.outcome.describe()),
                record.planned_send_s.unwrap_or(send_s) < leg.warmup_s,
                record.ttft_us.map_or(String::new(), |us| us.to_string()),
                record.reusable_tokens,
                record
                    .resident_tokens
                    .map_or(String::new(), |tokens| tokens.to_string()),
                record
                    .prefix_resident
                    .map_or(String::new(), |resident| resident.to_string()),
                optional_ms(record.predicted_ttft_us),
            )?;
        }
    }
    Ok(())
}

/// Quotes a CSV field when it needs it.
fn csv_field(value: &str) -> String {
    if value.contains([',', '"', '\n']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_converts_to_simulated_time_and_quotes_fields() {
        let record = RequestRecord {
            user: 3,
            seq: 9,
            label: 17,
            sent_at_us: 2_000_000,
            planned_send_s: None,
            ttft_us: Some(12_500),
            e2e_us: Some(400_000),
            prompt_tokens: 5000,
            output_tokens: 400,
            cached_tokens: Some(4992),
            backend: Some("http://127.0.0.1:9000".into()),
            outcome: Outcome::Failed("reset, by peer".into()),
            reusable_tokens: 4000,
            resident_tokens: Some(3984),
            prefix_resident: Some(false),
            predicted_ttft_us: Some(1500),
        };
        let mut out = Vec::new();
        let legs = [LegRecords {
            leg: "prefix+off",
            repeat: 0,
            speedup: 10.0,
            warmup_s: 30.0,
            records: std::slice::from_ref(&record),
        }];
        write_csv(&mut out, &legs).unwrap();
        let text = String::from_utf8(out).unwrap();
        let line = text.lines().nth(1).unwrap();
        assert_eq!(
            line,
            "prefix+off,0,3,9,17,20.000,125.000,4000.000,5000,400,4992,http://127.0.0.1:9000,\"failed: reset, by peer\",true,12500,4000,3984,false,15.000"
        );
        assert_eq!(text.lines().next().unwrap(), CSV_HEADER);
    }

    #[test]
    fn a_prefix_is_resident_when_every_full_block_of_it_is() {
        // 4,000 reusable tokens: 250 full blocks of 16, all needed.
        assert_eq!(
            RequestRecord::resident_verdict(4000, Some(4000), 16),
            Some(true)
        );
        assert_eq!(
            RequestRecord::resident_verdict(4000, Some(3984), 16),
            Some(false)
        );
        // The partial last block does not count: 4,010 tokens need the same 250 blocks.
        assert_eq!(
            RequestRecord::resident_verdict(4010, Some(4000), 16),
            Some(true)
        );
        // Less than a block to reuse, or not probed: no verdict.
        assert_eq!(RequestRecord::resident_verdict(15, Some(100), 16), None);
        assert_eq!(RequestRecord::resident_verdict(4000, None, 16), None);
    }
}
