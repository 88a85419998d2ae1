//! `myelin bench` end to end on the embedded simulator with the oracle leg (the one leg that
//! needs no router process): workload file, simulated engines, load generator, report files,
//! plots and gates.

use clap::Parser;
use myelin_bench::BenchArgs;

#[derive(Parser)]
struct Command {
    #[command(flatten)]
    args: BenchArgs,
}

#[path = "support/small_churn.rs"]
mod fixture;

use fixture::scratch_dir;

/// A small churn: 2 engines with little KV, so they evict within seconds.
fn small_churn() -> String {
    fixture::small_churn(40.0, 256)
}

#[test]
fn oracle_leg_runs_on_simulated_engines_and_writes_a_valid_report() {
    let directory = scratch_dir("bench-oracle");
    let workload = directory.join("small-churn.toml");
    std::fs::write(&workload, small_churn()).unwrap();
    let out = directory.join("out");
    let command = Command::parse_from([
        "bench",
        "--workload",
        workload.to_str().unwrap(),
        "--legs",
        "oracle",
        "--out",
        out.to_str().unwrap(),
        "--no-progress",
    ]);
    let exit = myelin_bench::run(command.args).unwrap();
    assert_eq!(exit, std::process::ExitCode::SUCCESS);

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["passed"], true, "{report:#}");
    let leg = &report["legs"][0];
    assert_eq!(leg["name"], "oracle");
    assert_eq!(leg["errors"], 0);
    assert!(leg["requests"].as_u64().unwrap() > 0);
    assert!(leg["evictions"].as_u64().unwrap() > 0);
    // Prefixes repeat: the engines served part of the prompts from cache.
    assert!(leg["cache_hit_rate"].as_f64().unwrap() > 0.0);
    assert!(leg["cached_token_ratio"].as_f64().unwrap() > 0.0);
    assert!(leg["ttft_ms"]["p50"].as_f64().unwrap() <= leg["ttft_ms"]["p99"].as_f64().unwrap());
    assert_eq!(leg["p99_ttft_vs_oracle"], 1.0);

    let csv = std::fs::read_to_string(out.join("requests.csv")).unwrap();
    assert_eq!(
        csv.lines().count() as u64,
        leg["requests_sent"].as_u64().unwrap() + 1
    );
    assert!(
        csv.lines().skip(1).all(|line| line.contains(",ok,")),
        "{csv}"
    );
    for plot in ["ttft_cdf.png", "ttft_over_time.png"] {
        assert!(
            std::fs::read(out.join(plot))
                .unwrap()
                .starts_with(b"\x89PNG")
        );
    }
    assert!(
        std::fs::read_to_string(out.join("report.md"))
            .unwrap()
            .contains("VALID")
    );
    let _ = std::fs::remove_dir_all(directory);
}

#[test]
fn open_loop_churn_sends_identical_requests_on_every_run_and_keeps_each_repeat() {
    let directory = scratch_dir("bench-churn-open");
    let workload = directory.join("small-churn-open.toml");
    std::fs::write(&workload, fixture::small_churn_open(30.0, 256)).unwrap();
    let out = directory.join("out");
    let command = Command::parse_from([
        "bench",
        "--workload",
        workload.to_str().unwrap(),
        "--legs",
        "oracle",
        "--repeat",
        "2",
        "--out",
        out.to_str().unwrap(),
        "--no-progress",
    ]);
    let exit = myelin_bench::run(command.args).unwrap();
    assert_eq!(exit, std::process::ExitCode::SUCCESS);

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["workload"]["open_loop"]["rate_rps"], 2.0);
    let leg = &report["legs"][0];
    let repeats = leg["repeats"].as_array().unwrap();
    assert_eq!(repeats.len(), 2);
    // Both repeats sent every request of the schedule, and measured the same ones (the
    // warm-up cut goes by the planned send time).
    assert_eq!(repeats[0]["requests_sent"], repeats[1]["requests_sent"]);
    assert_eq!(repeats[0]["requests"], repeats[1]["requests"]);
    let spread = &leg["spread"]["ttft_p99_ms"];
    assert!(spread["min"].as_f64().unwrap() <= spread["median"].as_f64().unwrap());
    assert!(spread["median"].as_f64().unwrap() <= spread["max"].as_f64().unwrap());

    // requests.csv: leg,repeat,user,seq,label,send_s,ttft_ms,e2e_ms,prompt_tokens,output_tokens,...
    let csv = std::fs::read_to_string(out.join("requests.csv")).unwrap();
    let mut by_repeat: [Vec<(u64, String, String, String)>; 2] = [Vec::new(), Vec::new()];
    for line in csv.lines().skip(1) {
        let cells: Vec<&str> = line.split(',').collect();
        let repeat: usize = cells[1].parse().unwrap();
        by_repeat[repeat].push((
            cells[3].parse().unwrap(),
            cells[4].to_string(),
            cells[8].to_string(),
            cells[9].to_string(),
        ));
    }
    for requests in &mut by_repeat {
        requests.sort();
    }
    // 30 simulated s at 2 req/s: about 60 requests, the same ones (index, prefix, prompt
    // length, output length) in both repeats.
    assert!(by_repeat[0].len() > 30, "{}", by_repeat[0].len());
    assert_eq!(by_repeat[0], by_repeat[1]);
    let _ = std::fs::remove_dir_all(directory);
}

#[test]
fn trace_lines_over_the_context_are_skipped_and_reported_not_errors() {
    let directory = scratch_dir("bench-over-context");
    // 256 blocks of 16 tokens: a 4,096-token context. Line 3 asks for 5,000 + 10 tokens; the
    // other eleven, 1,500-token prompts of their own, fill the engines' KV so they evict.
    let trace = directory.join("trace.jsonl");
    let lines: Vec<String> = (0..12u64)
        .map(|line| {
            let input = if line == 2 { 5000 } else { 1500 };
            let blocks: Vec<String> = (0..10).map(|block| (line * 100 + block).to_string()).collect();
            format!(
                "{{\"timestamp\":{},\"input_length\":{input},\"output_length\":10,\"hash_ids\":[{}]}}",
                line * 100,
                blocks.join(",")
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let workload = directory.join("trace.toml");
    std::fs::write(
        &workload,
        small_churn()
            .replace("name = \"small-churn\"", "name = \"small-trace\"")
            .replace("kind = \"churn\"", "kind = \"trace\"")
            .replace("[quick]", "[quick]\n")
            + &format!(
                "\n[trace]\npath = {:?}\ntime_scale = 10.0\n",
                trace.to_str().unwrap()
            ),
    )
    .unwrap();
    let out = directory.join("out");
    let command = Command::parse_from([
        "bench",
        "--workload",
        workload.to_str().unwrap(),
        "--legs",
        "oracle",
        "--warmup",
        "0",
        "--out",
        out.to_str().unwrap(),
        "--no-progress",
    ]);
    // The churn section of the small churn stays (unused by a trace): fine for the format.
    let exit = myelin_bench::run(command.args).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(exit, std::process::ExitCode::SUCCESS, "{report:#}");
    let skipped = &report["skipped_over_context"];
    assert_eq!(skipped["count"], 1);
    assert_eq!(skipped["context_tokens"], 4096);
    assert_eq!(skipped["lines"], serde_json::json!([3]));
    let leg = &report["legs"][0];
    assert_eq!(leg["errors"], 0);
    assert_eq!(leg["requests_sent"], 11);
    assert!(
        std::fs::read_to_string(out.join("report.md"))
            .unwrap()
            .contains("Skipped 1 trace line(s)")
    );
    let _ = std::fs::remove_dir_all(directory);
}
