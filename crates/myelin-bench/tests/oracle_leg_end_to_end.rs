//! `myelin bench` end to end on the embedded simulator with the oracle leg (the one leg that
//! needs no router process): workload file, simulated engines, load generator, report files,
//! plots and gates.

use std::path::PathBuf;

use clap::Parser;
use myelin_bench::BenchArgs;

#[derive(Parser)]
struct Command {
    #[command(flatten)]
    args: BenchArgs,
}

/// A small churn: 2 engines with little KV, so they evict within seconds.
const SMALL_CHURN: &str = r#"
name = "small-churn"
kind = "churn"
api = "completions"
prompt = "token-ids"
seed = 7
users = 6
duration_s = 40.0
warmup_s = 5.0
output_tokens = 20

[cluster]
engines = 2
profile = "a100-40gb-llama-3.1-8b"
speedup = 20.0
kv_blocks = 256
block_size = 16

[churn]
population = 12
active = 4
rotate = 2
rotate_every_s = 5.0
prefix_tokens = [400, 900]
suffix_tokens = [8, 32]

[quick]
"#;

fn scratch_dir(name: &str) -> PathBuf {
    let directory =
        std::env::temp_dir().join(format!("myelin-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    directory
}

#[test]
fn oracle_leg_runs_on_simulated_engines_and_writes_a_valid_report() {
    let directory = scratch_dir("oracle");
    let workload = directory.join("small-churn.toml");
    std::fs::write(&workload, SMALL_CHURN).unwrap();
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
