//! The overhead benchmark's figures of a leg and shape, as the report and the targets read
//! them.

use serde::Serialize;

/// What carries a leg's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LegKind {
    /// The load generator straight to an instant engine: the baseline.
    Direct,
    /// `myelin serve`.
    Myelin,
    /// An `--external` router.
    External,
}

/// One run's figures of a leg and shape (or their medians).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Figures {
    /// Closed-loop requests per second in the measured window.
    pub rps: f64,
    /// Closed-loop requests completed in the measured window.
    pub requests: u64,
    /// Failed requests (non-2xx, transport errors, timeouts), closed and open loop, warm-ups
    /// included.
    pub errors: u64,
    /// Open loop: send to the end of the response.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Open loop: send to the first body byte.
    pub first_byte_p50_ms: Option<f64>,
    pub first_byte_p99_ms: Option<f64>,
    /// `p50_ms` / `p99_ms` minus the direct leg's for the same shape and repeat.
    pub added_p50_ms: Option<f64>,
    pub added_p99_ms: Option<f64>,
    /// Router process group CPU time over the measured window, per request completed in it.
    pub cpu_us_per_request: Option<f64>,
    /// The busiest data core's share of `myelin_router_lookups_total` over the window.
    pub busiest_shard_share: Option<f64>,
    /// That counter's increase per shard over the window, by shard index.
    pub shard_lookups: Option<Vec<u64>>,
    /// Open-loop requests measured.
    pub open_loop_requests: u64,
    /// Length of the closed loop's measured window, seconds.
    pub measured_s: f64,
}

/// A leg and shape: the medians over repeats, and every repeat.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LegResult {
    pub name: String,
    pub kind: LegKind,
    /// Data cores of the router (None for `direct`).
    pub router_cores: Option<usize>,
    pub shape: String,
    /// The router's CPUs (data cores and control core).
    pub cpus: Option<String>,
    /// The router's command line.
    pub command: Option<String>,
    /// Medians over repeats (`requests` and `errors`: totals).
    #[serde(flatten)]
    pub figures: Figures,
    pub repeats: Vec<Figures>,
}
