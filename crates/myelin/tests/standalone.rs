//! The binary runs alone: copied into an empty directory and started there (working directory
//! that directory, `MYELIN_HOME` unset, a `PATH` without the repository), `myelin serve --sim 1`
//! loads the tokenizer embedded in the binary, serves, and routes a chat completion to its
//! simulated engine; `myelin --licenses` prints the embedded files' licenses. Every wait has a
//! deadline and the process is killed at the end (or on failure, when the guard drops).

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::{chat_body, request};

/// Startup parses the tokenizer a few times and verifies the fast path; generous for a loaded
/// machine, still a deadline.
const STARTUP_DEADLINE: Duration = Duration::from_secs(90);

/// Runs `start` again while the copy is "text file busy": another test thread forking at the
/// moment the copy's file was still open for writing holds that descriptor until its child
/// execs, and an exec of the copy meanwhile fails with ETXTBSY. Bounded by a deadline.
fn while_busy<T>(mut start: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match start() {
            Err(error)
                if error.kind() == std::io::ErrorKind::ExecutableFileBusy
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

/// An empty directory holding only a copy of the binary; removed when dropped.
struct Lonely {
    dir: PathBuf,
}

impl Lonely {
    fn new(name: &str) -> Lonely {
        let dir = std::env::temp_dir().join(format!(
            "myelin-standalone-{name}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::copy(env!("CARGO_BIN_EXE_myelin"), dir.join("myelin")).expect("copy binary");
        Lonely { dir }
    }

    /// The copy, to run with the working directory `self.dir`, no `MYELIN_HOME`, and a `PATH`
    /// of system directories only.
    fn command(&self) -> Command {
        let mut command = Command::new(self.dir.join("myelin"));
        command
            .current_dir(&self.dir)
            .env_remove("MYELIN_HOME")
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null());
        command
    }

    /// The directory holds nothing but the binary: nothing was unpacked beside it.
    fn assert_only_the_binary(&self) {
        let entries: Vec<String> = std::fs::read_dir(&self.dir)
            .expect("read dir")
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(entries, ["myelin"], "{}", self.dir.display());
    }
}

impl Drop for Lonely {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Kills the child when dropped, so a failing assertion leaves no process behind.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn assert_outside_repository(dir: &Path) {
    let repository = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let repository = repository.canonicalize().unwrap();
    assert!(
        !dir.canonicalize().unwrap().starts_with(&repository),
        "{} is inside the repository",
        dir.display()
    );
}

#[test]
fn a_copied_binary_serves_with_its_embedded_tokenizer() {
    let lonely = Lonely::new("serve");
    assert_outside_repository(&lonely.dir);
    let mut command = lonely.command();
    command
        .args([
            "serve",
            "--sim",
            "1",
            "--sim-speedup",
            "50",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--shards",
            "1",
            "--no-pin",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = while_busy(|| command.spawn()).expect("spawn the copy");
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let child = Killed(child);
    let (lines_sender, lines) = mpsc::channel();
    for stream in [
        Box::new(stdout) as Box<dyn std::io::Read + Send>,
        Box::new(stderr),
    ] {
        let sender = lines_sender.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
    }

    let deadline = Instant::now() + STARTUP_DEADLINE;
    let mut output = Vec::new();
    let addr: SocketAddr = loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = lines.recv_timeout(remaining) else {
            panic!(
                "the copied binary did not reach serving within {STARTUP_DEADLINE:?}:\n{}",
                output.join("\n")
            );
        };
        output.push(line.clone());
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let addr_text = rest.split_whitespace().next().unwrap_or_default();
            break addr_text.parse().expect("listening address");
        }
    };
    let output = output.join("\n");
    assert!(
        output.contains("tokenizer bundled DeepSeek-V3 tokenizer (embedded)"),
        "{output}"
    );
    assert!(output.contains("tokenizer fast path on"), "{output}");
    assert!(!output.contains("not found"), "{output}");

    // A routed, tokenized request: the router and the simulated engine both tokenize it.
    let response = request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(
            {
                // The in-process simulated engines serve the simulator's model.
                let mut body = chat_body("Say hello from a lonely binary.", false);
                body["model"] = myelin_sim::DEFAULT_MODEL_NAME.into();
                body
            }
            .to_string()
            .as_bytes(),
        ),
    );
    assert_eq!(response.status, 200);
    let completion = response.json();
    assert!(
        completion["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 5,
        "{completion}"
    );
    drop(child);
    lonely.assert_only_the_binary();
}

#[test]
fn a_copied_binary_prints_the_embedded_licenses() {
    let lonely = Lonely::new("licenses");
    let mut command = lonely.command();
    command.arg("--licenses");
    let output = while_busy(|| command.output()).expect("run the copy");
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    for needle in [
        "Apache-2.0",
        "DeepSeek-V3",
        "MIT License",
        "Copyright (c) 2023 DeepSeek",
        "Bitstream Vera",
    ] {
        assert!(text.contains(needle), "--licenses lacks {needle}:\n{text}");
    }
}
