//! A cell's verdict, from the report.json its run wrote: the default leg (prefix+auto) against
//! the better of least-load and prefix+off, on medians across repeats. Targets:
//!
//! - TTFT P99 at most [`P99_TARGET`] (1.0x) the lower of the two baselines' P99s;
//! - TTFT P50 at most [`P50_TARGET`] (1.05x) the lower of their P50s;
//! - throughput not lower than either's, within noise: at least [`THROUGHPUT_NOISE`] below
//!   theirs at worst, or their ranges across repeats overlapping;
//! - 0 errors on every leg of the cell.

use serde::{Deserialize, Serialize};

use crate::regime::Regime;

/// The default leg the grid judges.
pub const DEFAULT_LEG: &str = "prefix+auto";
/// The legs it is judged against.
pub const BASELINES: [&str; 2] = ["least-load", "prefix+off"];
/// The default's TTFT P99 may be at most this times the better baseline's.
pub const P99_TARGET: f64 = 1.0;
/// The default's TTFT P50 may be at most this times the better baseline's.
pub const P50_TARGET: f64 = 1.05;
/// The default's throughput may be this fraction below a baseline's and still count as equal.
pub const THROUGHPUT_NOISE: f64 = 0.02;

/// A figure's median and range across repeats (report.json's `Spread`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// The spreads a verdict reads.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct LegSpread {
    pub ttft_p50_ms: Spread,
    pub ttft_p99_ms: Spread,
    pub throughput_rps: Spread,
}

/// One leg of a cell's report.json, the fields the grid reads.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct LegFigures {
    pub name: String,
    #[serde(default)]
    pub runs: u32,
    pub requests: u64,
    pub errors: u64,
    pub spread: LegSpread,
    #[serde(default)]
    pub cache_hit_rate: Option<f64>,
    #[serde(default)]
    pub prefix_resident_share: Option<f64>,
}

/// A cell's report.json, the fields the grid reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CellReport {
    pub legs: Vec<LegFigures>,
    #[serde(default)]
    pub regime: Option<RegimeFigures>,
    #[serde(default)]
    pub passed: bool,
}

/// report.json's `regime` (see [`Regime`]).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct RegimeFigures {
    pub working_set_tokens: u64,
    pub kv_capacity_tokens: u64,
    pub working_set_ratio: f64,
    #[serde(default)]
    pub offered_rps: Option<f64>,
    #[serde(default)]
    pub capacity_rps: Option<f64>,
    #[serde(default)]
    pub offered_load: Option<f64>,
    #[serde(default)]
    pub prefix_resident_share: Option<f64>,
}

impl From<&Regime> for RegimeFigures {
    fn from(regime: &Regime) -> Self {
        RegimeFigures {
            working_set_tokens: regime.working_set_tokens,
            kv_capacity_tokens: regime.kv_capacity_tokens,
            working_set_ratio: regime.working_set_ratio,
            offered_rps: regime.offered_rps,
            capacity_rps: regime.capacity_rps,
            offered_load: regime.offered_load,
            prefix_resident_share: regime.prefix_resident_share,
        }
    }
}

/// Why a report could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
}

/// Reads a cell's report.json.
pub fn read_report(path: &std::path::Path) -> Result<CellReport, ReportError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReportError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_report(&text).map_err(|source| ReportError::Parse {
        path: path.display().to_string(),
        source,
    })
}

/// Parses report.json text.
pub fn parse_report(text: &str) -> Result<CellReport, serde_json::Error> {
    serde_json::from_str(text)
}

/// A ratio target's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RatioCheck {
    /// The default leg's median.
    pub default_ms: f64,
    /// The better (lower) baseline median, and which leg it was.
    pub baseline_ms: f64,
    pub baseline_leg: String,
    /// `default_ms / baseline_ms`.
    pub ratio: f64,
    pub target: f64,
    pub passed: bool,
}

/// A cell's verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub p99: Option<RatioCheck>,
    pub p50: Option<RatioCheck>,
    /// Per baseline: (leg, its median throughput, the default's, whether within noise).
    pub throughput: Vec<(String, f64, f64, bool)>,
    pub throughput_passed: bool,
    /// Errors over every leg of the cell.
    pub errors: u64,
    /// Legs the verdict needs that the report lacks (or that measured no request).
    pub missing_legs: Vec<String>,
    pub passed: bool,
}

impl Verdict {
    /// `PASS`, or `FAIL (p99, p50, ...)` naming the targets missed.
    pub fn describe(&self) -> String {
        if self.passed {
            return "PASS".into();
        }
        let mut missed = Vec::new();
        if !self.missing_legs.is_empty() {
            missed.push(format!("missing legs {}", self.missing_legs.join(", ")));
        }
        if self.p99.as_ref().is_some_and(|check| !check.passed) {
            missed.push("p99".to_string());
        }
        if self.p50.as_ref().is_some_and(|check| !check.passed) {
            missed.push("p50".to_string());
        }
        if !self.throughput_passed {
            missed.push("throughput".to_string());
        }
        if self.errors > 0 {
            missed.push(format!("{} errors", self.errors));
        }
        format!("FAIL ({})", missed.join(", "))
    }
}

fn ratio_check(
    default: &LegFigures,
    baselines: &[&LegFigures],
    pick: fn(&LegSpread) -> Spread,
    target: f64,
) -> Option<RatioCheck> {
    let best = baselines
        .iter()
        .min_by(|a, b| pick(&a.spread).median.total_cmp(&pick(&b.spread).median))?;
    let default_ms = pick(&default.spread).median;
    let baseline_ms = pick(&best.spread).median;
    let ratio = if baseline_ms > 0.0 {
        default_ms / baseline_ms
    } else if default_ms > 0.0 {
        f64::INFINITY
    } else {
        1.0
    };
    Some(RatioCheck {
        default_ms,
        baseline_ms,
        baseline_leg: best.name.clone(),
        ratio,
        target,
        passed: ratio <= target,
    })
}

/// Whether the default's throughput is not lower than a baseline's within noise.
pub fn throughput_within_noise(default: &Spread, baseline: &Spread) -> bool {
    default.median >= baseline.median * (1.0 - THROUGHPUT_NOISE) || default.max >= baseline.min
}

/// The verdict of a cell's legs (see the module).
pub fn judge(legs: &[LegFigures]) -> Verdict {
    let find = |name: &str| legs.iter().find(|leg| leg.name == name && leg.requests > 0);
    let mut missing_legs = Vec::new();
    let default = find(DEFAULT_LEG);
    if default.is_none() {
        missing_legs.push(DEFAULT_LEG.to_string());
    }
    let baselines: Vec<&LegFigures> = BASELINES
        .iter()
        .filter_map(|name| {
            let leg = find(name);
            if leg.is_none() {
                missing_legs.push(name.to_string());
            }
            leg
        })
        .collect();
    let errors = legs.iter().map(|leg| leg.errors).sum();
    let (p99, p50, throughput) = match default {
        Some(default) if !baselines.is_empty() => (
            ratio_check(default, &baselines, |spread| spread.ttft_p99_ms, P99_TARGET),
            ratio_check(default, &baselines, |spread| spread.ttft_p50_ms, P50_TARGET),
            baselines
                .iter()
                .map(|baseline| {
                    (
                        baseline.name.clone(),
                        baseline.spread.throughput_rps.median,
                        default.spread.throughput_rps.median,
                        throughput_within_noise(
                            &default.spread.throughput_rps,
                            &baseline.spread.throughput_rps,
                        ),
                    )
                })
                .collect::<Vec<_>>(),
        ),
        _ => (None, None, Vec::new()),
    };
    let throughput_passed = !throughput.is_empty() && throughput.iter().all(|entry| entry.3);
    let passed = missing_legs.is_empty()
        && p99.as_ref().is_some_and(|check| check.passed)
        && p50.as_ref().is_some_and(|check| check.passed)
        && throughput_passed
        && errors == 0;
    Verdict {
        p99,
        p50,
        throughput,
        throughput_passed,
        errors,
        missing_legs,
        passed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(name: &str, p50: f64, p99: f64, rps: [f64; 3]) -> LegFigures {
        LegFigures {
            name: name.into(),
            runs: 3,
            requests: 100,
            errors: 0,
            spread: LegSpread {
                ttft_p50_ms: Spread {
                    median: p50,
                    min: p50,
                    max: p50,
                },
                ttft_p99_ms: Spread {
                    median: p99,
                    min: p99,
                    max: p99,
                },
                throughput_rps: Spread {
                    median: rps[0],
                    min: rps[1],
                    max: rps[2],
                },
            },
            cache_hit_rate: None,
            prefix_resident_share: None,
        }
    }

    const STEADY: [f64; 3] = [5.0, 4.95, 5.05];

    #[test]
    fn the_default_is_judged_against_the_better_baseline() {
        let legs = [
            leg("least-load", 80.0, 900.0, STEADY),
            leg("prefix+off", 50.0, 1500.0, STEADY),
            leg("prefix+auto", 52.0, 850.0, STEADY),
        ];
        let verdict = judge(&legs);
        // P99 against least-load's 900 (the lower), P50 against prefix+off's 50.
        let p99 = verdict.p99.clone().unwrap();
        assert_eq!(p99.baseline_leg, "least-load");
        assert!((p99.ratio - 850.0 / 900.0).abs() < 1e-12);
        let p50 = verdict.p50.clone().unwrap();
        assert_eq!(p50.baseline_leg, "prefix+off");
        assert!((p50.ratio - 1.04).abs() < 1e-12 && p50.passed);
        assert!(verdict.passed, "{verdict:?}");
        assert_eq!(verdict.describe(), "PASS");
    }

    #[test]
    fn each_target_can_fail_on_its_own() {
        let base = |p50, p99, rps| {
            [
                leg("least-load", 80.0, 900.0, STEADY),
                leg("prefix+off", 50.0, 1500.0, STEADY),
                leg("prefix+auto", p50, p99, rps),
            ]
        };
        // P99 above 1.0x: 901 against 900.
        let verdict = judge(&base(50.0, 901.0, STEADY));
        assert!(
            !verdict.passed && verdict.describe() == "FAIL (p99)",
            "{verdict:?}"
        );
        // P50 above 1.05x: 52.6 against 50.
        assert_eq!(judge(&base(52.6, 800.0, STEADY)).describe(), "FAIL (p50)");
        // Throughput 3% lower with ranges apart: a failure; 1.5% lower, or ranges that overlap,
        // within noise.
        assert_eq!(
            judge(&base(50.0, 800.0, [4.85, 4.84, 4.86])).describe(),
            "FAIL (throughput)"
        );
        assert!(judge(&base(50.0, 800.0, [4.93, 4.92, 4.94])).passed);
        assert!(judge(&base(50.0, 800.0, [4.8, 4.7, 4.96])).passed);
        // Errors on any leg.
        let mut legs = base(50.0, 800.0, STEADY);
        legs[0].errors = 2;
        assert_eq!(judge(&legs).describe(), "FAIL (2 errors)");
        // A missing leg.
        let verdict = judge(&base(50.0, 800.0, STEADY)[1..]);
        assert!(!verdict.passed);
        assert!(
            verdict.describe().contains("missing legs least-load"),
            "{verdict:?}"
        );
        let verdict = judge(&base(50.0, 800.0, STEADY)[..2]);
        assert!(verdict.p99.is_none() && !verdict.passed);
    }

    #[test]
    fn a_report_parses_into_the_figures_the_verdict_reads() {
        let text = r#"{"schema_version": 2, "passed": false, "unknown": 1,
            "regime": {"working_set_tokens": 360000, "working_set": "x",
                       "kv_capacity_tokens": 240000, "working_set_ratio": 1.5,
                       "offered_rps": 3.0, "capacity_rps": 5.0, "offered_load": 0.6,
                       "closed_loop_users": null, "prefix_reusable_requests": 10,
                       "prefix_resident_share": 0.4},
            "legs": [{"name": "prefix+auto", "runs": 3, "requests": 900, "errors": 0,
                      "cache_hit_rate": 0.8, "prefix_resident_share": 0.5,
                      "spread": {"ttft_p50_ms": {"median": 50, "min": 48, "max": 55},
                                 "ttft_p99_ms": {"median": 700, "min": 650, "max": 800},
                                 "throughput_rps": {"median": 3.0, "min": 2.9, "max": 3.1},
                                 "ttft_p90_ms": {"median": 1, "min": 1, "max": 1}}}]}"#;
        let report = parse_report(text).unwrap();
        assert!(!report.passed);
        let regime = report.regime.unwrap();
        assert_eq!(regime.offered_load, Some(0.6));
        assert_eq!(regime.prefix_resident_share, Some(0.4));
        let leg = &report.legs[0];
        assert_eq!(leg.spread.ttft_p99_ms.median, 700.0);
        assert_eq!(leg.spread.throughput_rps.min, 2.9);
        assert_eq!(leg.prefix_resident_share, Some(0.5));
        assert!(parse_report("{\"legs\": 3}").is_err());
    }
}
