//! `myelin bench regimes` end to end with the real binary: one cell of the grid (rotating churn
//! at 1.5x working set / KV capacity, 60% load) on two simulated engines, one repeat of a few
//! simulated seconds per leg, with the duration check (the cell again at twice its duration).
//! Asserts the grid's files (report.json with the cell's verdict, report.md, the two heatmaps),
//! the cell's own report and workload, and the regime line in the cell's report and on stdout.
//! No timing assertions: the verdict itself may go either way on so short a run.

#[path = "support/bench.rs"]
mod bench;

use std::process::Command;

use serde_json::Value;

#[test]
fn one_cell_of_the_regime_grid_runs_and_reports_its_verdict_and_regime() {
    let directory = bench::scratch_dir("bench-regimes");
    let out = directory.join("out");
    let output = Command::new(bench::MYELIN)
        .args([
            "bench",
            "regimes",
            "--shapes",
            "rotating",
            "--working-sets",
            "1.5",
            "--loads",
            "0.6",
            "--engines",
            "2",
            "--repeat",
            "1",
            "--duration",
            "12",
            "--speedup",
            "10",
            "--duration-check",
            "all",
            "--no-progress",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // 0: every target met; 1: a target missed. Both mean the grid ran.
    assert!(
        matches!(output.status.code(), Some(0 | 1)),
        "{}\n{stdout}\n{stderr}",
        output.status
    );
    let cell = "rotating-ws1.5-load60";
    assert!(
        stdout.contains("regime: working set 1.5") || stdout.contains("regime: working set 1.4"),
        "{stdout}"
    );
    assert!(stdout.contains("regime grid: "), "{stdout}");

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["complete"], true, "{report:#}");
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 1, "{report:#}");
    let outcome = &cells[0];
    assert_eq!(outcome["name"], cell);
    assert!(outcome["error"].is_null(), "{outcome:#}");
    let verdict = &outcome["verdict"];
    assert!(verdict["passed"].is_boolean(), "{outcome:#}");
    assert!(
        verdict["p99"]["ratio"].as_f64().unwrap() > 0.0,
        "{outcome:#}"
    );
    assert_eq!(verdict["errors"], 0, "{outcome:#}");
    let regime = &outcome["regime"];
    let ratio = regime["working_set_ratio"].as_f64().unwrap();
    assert!((1.45..=1.5).contains(&ratio), "{regime:#}");
    assert!(
        (regime["offered_load"].as_f64().unwrap() - 0.6).abs() < 0.01,
        "{regime:#}"
    );
    let resident = regime["prefix_resident_share"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&resident), "{regime:#}");
    let legs: Vec<&str> = outcome["legs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|leg| leg["name"].as_str().unwrap())
        .collect();
    assert_eq!(legs, ["least-load", "prefix+off", "prefix+auto"]);
    // The duration check: the same cell at twice the duration, both verdicts side by side.
    let check = &report["duration_check"][0];
    assert_eq!(check["cell"], cell, "{report:#}");
    assert_eq!(check["longer_duration_s"], 24.0);
    assert!(check["same_verdict"].is_boolean());

    for file in ["heatmap_p99.png", "heatmap_p50.png"] {
        assert!(
            std::fs::read(out.join(file))
                .unwrap()
                .starts_with(b"\x89PNG"),
            "{file}"
        );
    }
    let markdown = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        markdown.contains("![TTFT P99](heatmap_p99.png)"),
        "{markdown}"
    );
    assert!(markdown.contains("## Duration check"), "{markdown}");
    // The cell's own run: its report (with the regime line), its workload, its rerun command.
    for dir in [cell.to_string(), format!("{cell}-2x")] {
        let cell_dir = out.join("cells").join(&dir);
        let cell_report =
            std::fs::read_to_string(cell_dir.join("report.md")).unwrap_or_else(|_| panic!("{dir}"));
        assert!(cell_report.contains("regime: working set"), "{cell_report}");
        assert!(
            cell_report.contains("prefix resident somewhere at send"),
            "{cell_report}"
        );
        let workload: Value =
            serde_json::from_str(&std::fs::read_to_string(cell_dir.join("workload.json")).unwrap())
                .unwrap();
        assert_eq!(workload["kind"], "churn-open");
        assert_eq!(workload["cluster"]["engines"], 2);
        assert!(workload["open_loop"]["rate_rps"].as_f64().unwrap() > 0.0);
    }
    let csv = std::fs::read_to_string(out.join("cells").join(cell).join("requests.csv")).unwrap();
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    assert!(header.contains(&"prefix_resident"), "{header:?}");
    assert!(
        outcome["reproduce"]
            .as_str()
            .unwrap()
            .contains("workload.json")
    );
    let _ = std::fs::remove_dir_all(directory);
}
