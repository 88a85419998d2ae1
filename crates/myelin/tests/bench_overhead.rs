//! `myelin bench overhead` end to end with the real binary: instant engines, the direct leg,
//! `myelin serve` at 1 router core, and an external leg (this same binary started from a
//! command template under `taskset`), on a minimal configuration. Asserts the report's
//! fields and values, the plots, and that no router outlives its leg or a Ctrl-C. Timing
//! never goes into an assertion; waits are bounded polls.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/bench.rs"]
mod bench;

use bench::MYELIN;

/// The minimal run: 0.5 s closed loop, 20 open-loop requests, 1 router core, two shapes.
fn minimal_args(out: &Path) -> Vec<String> {
    [
        "bench",
        "overhead",
        "--duration",
        "0.5",
        "--warmup",
        "0.2",
        "--open-requests",
        "20",
        "--open-warmup",
        "5",
        "--connections",
        "8",
        "--engines",
        "2",
        "--router-cores",
        "1",
        "--shapes",
        "short,shared-prefix-2k",
        "--out",
    ]
    .iter()
    .map(|arg| arg.to_string())
    .chain([out.display().to_string()])
    .collect()
}

/// An external leg that is `myelin serve` again, started by `sh` (so its CPU time is that
/// of a shell's child): backends arrive space-separated, MYELIN_BACKEND wants `;`.
fn external_self() -> String {
    format!(
        "self=MYELIN_BACKEND=$(echo {{backends}} | tr ' ' ';') {MYELIN} serve \
         --listen 127.0.0.1:{{port}} --shards 1 --no-pin"
    )
}

fn number(leg: &Value, field: &str) -> Option<f64> {
    leg.get(field)
        .unwrap_or_else(|| panic!("leg has no field {field}: {leg}"))
        .as_f64()
}

/// Ports the report's router command lines listen on.
fn router_ports(report: &Value) -> Vec<String> {
    report["legs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|leg| leg["command"].as_str())
        .filter_map(|command| {
            let at = command.find("127.0.0.1:")?;
            let port: String = command[at + 10..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            Some(format!("127.0.0.1:{port}"))
        })
        .collect()
}

/// Live (not zombie) processes whose command line contains `needle`.
fn live_processes_with(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let zombie = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let state = stat.rsplit_once(')')?.1.split_whitespace().next()?;
                Some(state == "Z")
            })
            .unwrap_or(true);
        if cmdline.contains(needle) && !zombie {
            found.push(pid);
        }
    }
    found
}

#[test]
fn overhead_minimal_run_writes_a_sane_report_and_plots() {
    let directory = bench::scratch_dir("bench-overhead-minimal");
    let out = directory.join("out");
    let output = Command::new(MYELIN)
        .args(minimal_args(&out))
        .args(["--external", &external_self()])
        .stdin(Stdio::null())
        .output()
        .expect("run myelin bench overhead");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    // The tables and target lines go to stdout; the pinning and command lines to stderr.
    assert!(stdout.contains("shared-prefix-2k"), "{stdout}");
    assert!(stdout.contains("busiest shard"), "{stdout}");
    assert!(stdout.contains("VALID"), "{stdout}");
    assert!(
        stdout.lines().any(|line| line.starts_with("PASS ")
            || line.starts_with("FAIL ")
            || line.starts_with("SKIP ")),
        "{stdout}"
    );
    assert!(stderr.contains("serve --listen 127.0.0.1:"), "{stderr}");
    assert!(stderr.contains("--cores "), "{stderr}");
    assert!(stderr.contains("taskset -c "), "{stderr}");

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["benchmark"], "overhead");
    assert_eq!(report["valid"], true);
    assert_eq!(report["failures"].as_array().unwrap().len(), 0);
    assert!(report["machine"]["shared"].is_boolean());
    let legs = report["legs"].as_array().unwrap();
    let mut seen = Vec::new();
    for leg in legs {
        let name = leg["name"].as_str().unwrap();
        let kind = leg["kind"].as_str().unwrap();
        let shape = leg["shape"].as_str().unwrap();
        seen.push((name.to_string(), shape.to_string()));
        let context = format!("{name} {shape}: {leg}");
        assert!(number(leg, "rps").unwrap() > 0.0, "{context}");
        assert!(leg["requests"].as_u64().unwrap() > 0, "{context}");
        assert_eq!(leg["errors"].as_u64(), Some(0), "{context}");
        assert_eq!(leg["open_loop_requests"].as_u64(), Some(20), "{context}");
        let (p50, p99) = (
            number(leg, "p50_ms").unwrap(),
            number(leg, "p99_ms").unwrap(),
        );
        assert!(p50 > 0.0 && p99 >= p50, "{context}");
        assert_eq!(leg["repeats"].as_array().unwrap().len(), 1, "{context}");
        let share = number(leg, "busiest_shard_share");
        match kind {
            "direct" => {
                assert!(leg["router_cores"].is_null(), "{context}");
                assert!(number(leg, "added_p50_ms").is_none(), "{context}");
                assert!(number(leg, "cpu_us_per_request").is_none(), "{context}");
                assert!(share.is_none(), "{context}");
            }
            "myelin" | "external" => {
                assert_eq!(leg["router_cores"].as_u64(), Some(1), "{context}");
                assert!(number(leg, "added_p50_ms").is_some(), "{context}");
                assert!(number(leg, "added_p99_ms").is_some(), "{context}");
                assert!(
                    number(leg, "cpu_us_per_request").unwrap() > 0.0,
                    "{context}"
                );
                assert!(leg["command"].as_str().is_some(), "{context}");
                if kind == "myelin" {
                    // One data core serves every lookup (when the router counts them).
                    assert!(share.is_none() || share == Some(1.0), "{context}");
                } else {
                    assert!(share.is_none(), "{context}");
                    assert!(
                        leg["command"].as_str().unwrap().starts_with("taskset -c "),
                        "{context}"
                    );
                }
            }
            other => panic!("unexpected leg kind {other}"),
        }
    }
    for name in ["direct", "myelin", "self"] {
        for shape in ["short", "shared-prefix-2k"] {
            assert!(
                seen.contains(&(name.to_string(), shape.to_string())),
                "no {name} {shape} in {seen:?}"
            );
        }
    }
    let targets = report["targets"].as_array().unwrap();
    assert!(!targets.is_empty());
    for target in targets {
        assert!(
            ["pass", "fail", "skip"].contains(&target["status"].as_str().unwrap()),
            "{target}"
        );
    }
    for plot in [
        "rps_vs_cores.png",
        "added_p50_vs_cores.png",
        "added_p99_vs_cores.png",
    ] {
        let bytes = std::fs::read(out.join(plot)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{plot}");
    }
    assert!(
        std::fs::read_to_string(out.join("report.md"))
            .unwrap()
            .contains("## Targets")
    );
    // Every router was stopped at the end of its leg.
    let ports = router_ports(&report);
    assert_eq!(ports.len(), 4, "{ports:?}");
    for port in ports {
        assert!(
            live_processes_with(&port).is_empty(),
            "a router on {port} outlived the run"
        );
    }
    let _ = std::fs::remove_dir_all(directory);
}

#[test]
fn ctrl_c_stops_the_router_and_exits_non_zero() {
    let directory = bench::scratch_dir("bench-overhead-interrupt");
    let out = directory.join("out");
    let mut args = minimal_args(&out);
    // Only the myelin leg, long enough to be interrupted in the middle.
    let duration = args.iter().position(|arg| arg == "--duration").unwrap() + 1;
    args[duration] = "120".into();
    args.extend(["--legs".to_string(), "myelin".to_string()]);
    let mut bench = Command::new(MYELIN)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run myelin bench overhead");
    // Wait for the myelin leg's router: `myelin serve` started by the bench.
    let needle = "serve --listen 127.0.0.1:";
    let deadline = Instant::now() + Duration::from_secs(120);
    let router = loop {
        let routers: Vec<u32> = live_processes_with(needle)
            .into_iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|stat| {
                        let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
                        ppid.parse::<u32>().ok()
                    })
                    == Some(bench.id())
            })
            .collect();
        if let Some(&router) = routers.first() {
            break router;
        }
        assert!(
            bench.try_wait().unwrap().is_none(),
            "the bench exited before starting its router"
        );
        assert!(Instant::now() < deadline, "no router started");
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(bench.id() as libc::pid_t, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = bench.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = bench.kill();
            panic!("the bench did not exit after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    use std::io::Read;
    bench
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    let alive = std::fs::read_to_string(format!("/proc/{router}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_string();
            Some(state != "Z")
        })
        .unwrap_or(false);
    assert!(!alive, "router {router} outlived the interrupted bench");
    let _ = std::fs::remove_dir_all(directory);
}
