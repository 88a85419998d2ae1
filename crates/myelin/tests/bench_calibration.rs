//! `myelin bench --calibration` end to end with the real binary: a small churn on two simulated
//! engines with little KV (they evict within seconds), a `prefix+estimate` leg whose router is
//! this binary. Asserts report.json's `calibration` (reliability tables consistent with their
//! totals, Brier scores in range, the truth showing both resident and evicted blocks, the
//! predicted-vs-reported error over the served requests), report.md's section and the
//! reliability diagram; and that `--calibration off` leaves the field out. No timing
//! assertions.

#[path = "support/bench.rs"]
mod bench;

use std::path::Path;

use serde_json::Value;

/// Two engines of 128 blocks: they evict within seconds.
fn run_bench(directory: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["--legs", "prefix+estimate"];
    args.extend_from_slice(extra);
    bench::run_bench(directory, &bench::small_churn(40.0, 128), &args).1
}

fn number(value: &Value) -> f64 {
    value
        .as_f64()
        .unwrap_or_else(|| panic!("not a number: {value}"))
}

#[test]
fn estimate_leg_reports_calibration_against_the_simulator() {
    let directory = bench::scratch_dir("bench-calibration-on");
    let report = run_bench(&directory, &["--calibration-every", "2"]);
    let calibration = report["calibration"].as_array().expect("calibration[]");
    assert_eq!(calibration.len(), 1, "{calibration:#?}");
    // One leg run: nothing to pool in the report.
    assert!(report.get("calibration_pooled").is_none(), "{report:#}");
    let leg = &calibration[0];
    assert_eq!(leg["leg"], "prefix+estimate");
    assert_eq!(leg["repeat"], 1);
    assert_eq!(leg["sample_every"], 2);
    assert!(number(&leg["sampled_requests"]) > 0.0);
    assert!(number(&leg["sampled_pairs"]) > 0.0);
    assert_eq!(number(&leg["capacity_tokens"]), 128.0 * 16.0);

    let predictors = leg["predictors"].as_array().unwrap();
    let names: Vec<&str> = predictors
        .iter()
        .map(|predictor| predictor["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "pressure",
            "one_minus_utilization",
            "ttl_150s",
            "lru_capacity",
            "pressure_pinned_blocks"
        ]
    );
    let mut resident_fraction = None;
    for predictor in predictors {
        let samples = number(&predictor["samples"]);
        assert!(samples > 0.0, "{predictor:#}");
        let brier = number(&predictor["brier"]);
        assert!((0.0..=1.0).contains(&brier), "{predictor:#}");
        let buckets = predictor["buckets"].as_array().unwrap();
        assert_eq!(buckets.len(), 10);
        let in_buckets: f64 = buckets
            .iter()
            .map(|bucket| number(&bucket["samples"]))
            .sum();
        assert_eq!(in_buckets, samples, "{predictor:#}");
        // Every predictor is scored against the same truth: the same fraction resident.
        let resident: f64 = buckets
            .iter()
            .filter(|bucket| number(&bucket["samples"]) > 0.0)
            .map(|bucket| number(&bucket["observed"]) * number(&bucket["samples"]))
            .sum::<f64>()
            / samples;
        match resident_fraction {
            None => resident_fraction = Some(resident),
            Some(first) => assert!((first - resident).abs() < 1e-9, "{first} vs {resident}"),
        }
        for bucket in buckets.iter().filter(|b| number(&b["samples"]) > 0.0) {
            let predicted = number(&bucket["mean_predicted"]);
            assert!(
                predicted >= number(&bucket["lower"]) - 1e-9
                    && predicted <= number(&bucket["upper"]) + 1e-9,
                "{bucket}"
            );
            // The sampling noise of a calibrated predictor with this many pairs.
            let pairs = number(&bucket["pairs"]);
            let noise = number(&bucket["noise_95"]);
            let expected = 1.96 * (predicted * (1.0 - predicted) / pairs).sqrt();
            assert!((noise - expected).abs() < 1e-9, "{bucket}");
        }
        // Bucket counts: those within tolerance and those off beyond noise are among the
        // counted ones.
        let counted = number(&predictor["buckets_counted"]);
        assert!(counted <= 10.0, "{predictor:#}");
        assert!(number(&predictor["buckets_within_tolerance"]) <= counted);
        assert!(number(&predictor["buckets_beyond_noise"]) <= counted);
    }
    // The engines evict continuously on this workload: the truth has both outcomes.
    let resident = resident_fraction.unwrap();
    assert!(
        resident > 0.0 && resident < 1.0,
        "resident fraction {resident}"
    );

    let errors = &leg["cached_tokens"];
    let served = number(&report["legs"][0]["requests"]);
    assert!(
        number(&errors["requests"]) >= served,
        "{errors} vs {served}"
    );
    assert!(number(&errors["mean_absolute_error_tokens"]) >= 0.0);
    assert!(number(&errors["mean_reported_tokens"]) > 0.0, "{errors}");

    let out = directory.join("out");
    let markdown = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(markdown.contains("## Residency calibration against the simulator's truth"));
    assert!(markdown.contains("### Reliability: prefix+estimate (repeat 1)"));
    let png = std::fs::read(out.join("reliability.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");

    // `myelin bench calibration` pools reports: the same report twice doubles every count.
    let report_json = out.join("report.json");
    let pooled = std::process::Command::new(bench::MYELIN)
        .args(["bench", "calibration"])
        .arg(&report_json)
        .arg(&report_json)
        .output()
        .unwrap();
    assert!(pooled.status.success(), "{pooled:?}");
    let pooled = String::from_utf8(pooled.stdout).unwrap();
    let pressure = &leg["predictors"][0];
    let row = format!(
        "| prefix+estimate | 2 | {} | {} | pressure | {} | {:.4} |",
        2.0 * number(&leg["sampled_requests"]),
        2.0 * number(&leg["sampled_pairs"]),
        2.0 * number(&pressure["samples"]),
        number(&pressure["brier"])
    );
    assert!(pooled.contains(&row), "{row} not in:\n{pooled}");
    assert!(pooled.contains("### Pooled reliability: prefix+estimate (2 runs)"));
    // A leg no report has: a clear error, not an empty table.
    let missing = std::process::Command::new(bench::MYELIN)
        .args(["bench", "calibration", "--leg", "oracle"])
        .arg(&report_json)
        .output()
        .unwrap();
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("no calibration to pool for leg oracle"),
        "{stderr}"
    );
    // A file that is not a report, and one that is not there: named, not a panic.
    let garbage = directory.join("garbage.json");
    std::fs::write(&garbage, "{\"calibration\": [{\"leg\": 3}]}").unwrap();
    for (path, expected) in [
        (garbage.clone(), "is not a myelin bench report.json"),
        (directory.join("missing.json"), "reading"),
    ] {
        let failed = std::process::Command::new(bench::MYELIN)
            .args(["bench", "calibration"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!failed.status.success());
        let stderr = String::from_utf8_lossy(&failed.stderr);
        assert!(stderr.contains(expected), "{stderr}");
        assert!(stderr.contains(path.to_str().unwrap()), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&directory);
}

#[test]
fn calibration_off_leaves_the_report_as_it_was() {
    let directory = bench::scratch_dir("bench-calibration-off");
    let report = run_bench(&directory, &["--calibration", "off"]);
    assert!(report.get("calibration").is_none(), "{report:#}");
    assert!(!directory.join("out").join("reliability.png").exists());
    let _ = std::fs::remove_dir_all(&directory);
}
