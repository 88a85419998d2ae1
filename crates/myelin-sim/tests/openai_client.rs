//! Client compatibility: the official OpenAI Python client (an independent peer) talks to a
//! simulated engine over loopback and must parse every response, streams included
//! (tests/openai_client.py). Needs python3 with the `openai` package (scripts/setup installs
//! it); fails with a message saying so when it is missing.

use std::process::Command;

use myelin_sim::{ClusterConfig, SimCluster};

#[test]
fn the_openai_python_client_parses_every_response() {
    let cluster = SimCluster::start(ClusterConfig {
        speedup: 100.0,
        executor_threads: 1,
        ..ClusterConfig::default()
    })
    .expect("cluster starts");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let output = Command::new("python3")
        .arg(script)
        .arg(&cluster.engine_urls()[0])
        .output()
        .unwrap_or_else(|error| {
            panic!("this test needs python3 with the openai package: cannot run python3: {error}")
        });
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim() == "OK",
        "the OpenAI client check failed (needs python3 with the openai package: pip install \
         openai)\nstdout: {stdout}\nstderr: {stderr}"
    );
}
