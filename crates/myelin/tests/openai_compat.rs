//! Compatibility with the official `openai` Python client, against `myelin serve --sim 2`.

mod support;

use std::process::Command;

use support::Router;

#[test]
fn official_openai_client_works_through_the_router() {
    let router = Router::start(&["--sim", "2", "--sim-speedup", "20"]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/openai_compat.py"
    );
    let output = Command::new("python3")
        .arg(script)
        .arg(format!("http://{}", router.addr))
        .output()
        .expect("python3 must be installed (scripts/test installs the openai package)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim_end().ends_with("ok"),
        "openai client failed (is `pip install openai` done?)\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}
