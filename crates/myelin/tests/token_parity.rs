//! Tokenization parity end to end: `myelin serve` (ChatML, the default) in front of two
//! simulated engines, one rendering chats with the same template and one with another. Every
//! answer's `usage.prompt_tokens` is compared with the router's own count: the odd engine's
//! mismatches are counted (`myelin_tokenization_mismatch_total{backend}`), the last one is
//! shown by `GET /admin/backends`, and one warning names both counts and the likely cause.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use myelin_sim::{ClusterConfig, SimCluster};
use serde_json::{Value, json};
use support::{metric_value, request};

/// Another chat template than ChatML: plain "### role:" headers, a few tokens apart per
/// message.
const OTHER_TEMPLATE: &str = "{% for message in messages %}### {{ message['role'] }}:\n\
{{ message['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}";

fn engines(chat_template: Option<std::path::PathBuf>) -> SimCluster {
    SimCluster::start(ClusterConfig {
        engines: 1,
        speedup: 50.0,
        chat_template_path: chat_template,
        ..ClusterConfig::default()
    })
    .expect("simulated engine")
}

fn chat(content: &str, stream: bool) -> Value {
    let mut body = json!({
        "model": myelin_sim::DEFAULT_MODEL_NAME,
        "max_tokens": 4,
        "stream": stream,
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": content},
        ],
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

#[test]
fn a_different_chat_template_is_counted_shown_and_logged_once() {
    let directory = std::env::temp_dir().join(format!("myelin-parity-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let template = directory.join("other.jinja");
    std::fs::write(&template, OTHER_TEMPLATE).unwrap();
    let same = engines(None);
    let other = engines(Some(template));
    let (same_url, other_url) = (
        same.engine_urls()[0].clone(),
        other.engine_urls()[0].clone(),
    );

    let stderr_path = directory.join("stderr.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            // One data core: round-robin strictly alternates, 4 requests per engine.
            "--shards",
            "1",
            "--no-pin",
            "--routing",
            "round-robin",
            "--backend",
            &same_url,
            "--backend",
            &other_url,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("spawn myelin serve");
    let stdout = child.stdout.take().unwrap();
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    let line = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("listening line");
        if line.contains("listening on http://") {
            break line;
        }
    };
    let address = |marker: &str| -> std::net::SocketAddr {
        let rest = line
            .split(marker)
            .nth(1)
            .expect("address in the listening line");
        let end = rest.find([',', ')', ' ']).unwrap_or(rest.len());
        rest[..end].parse().expect("address")
    };
    let (addr, admin) = (address("listening on http://"), address("admin on http://"));

    // Wait until both backends are up, then send chats (round-robin reaches both), streaming
    // with include_usage and not.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listing = request(admin, "GET", "/admin/backends", &[], None).json();
        let up = listing["backends"]
            .as_array()
            .is_some_and(|backends| backends.iter().all(|backend| backend["state"] == "up"));
        if up {
            break;
        }
        assert!(Instant::now() < deadline, "backends not up: {listing}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut engine_counts = Vec::new();
    for index in 0..8 {
        // Alternating engines: two plain answers, then two streamed, and again.
        let stream = index % 4 >= 2;
        let body = chat(&format!("Question number {index} about tokens."), stream);
        let response = request(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            Some(body.to_string().as_bytes()),
        );
        assert_eq!(response.status, 200);
        if stream {
            // Read to the end: the usage chunk comes last.
            assert!(response.text().contains("\"usage\""));
        } else {
            engine_counts.push(response.json()["usage"]["prompt_tokens"].as_u64().unwrap());
        }
    }
    // The two templates give the same chat different token counts.
    engine_counts.sort_unstable();
    engine_counts.dedup();
    assert!(engine_counts.len() >= 2, "{engine_counts:?}");

    let listing = request(admin, "GET", "/admin/backends", &[], None).json();
    let backends = listing["backends"].as_array().unwrap().clone();
    let by_url = |url: &str| -> Value {
        backends
            .iter()
            .find(|backend| {
                backend
                    .as_object()
                    .unwrap()
                    .values()
                    .any(|value| value.as_str().is_some_and(|text| text.contains(url)))
            })
            .cloned()
            .unwrap_or_else(|| panic!("{url} not listed: {backends:?}"))
    };
    let matching = by_url(&same_url);
    assert_eq!(matching["tokenization"]["mismatches"], 0, "{matching}");
    assert_eq!(matching["tokenization"]["last_mismatch"], Value::Null);
    let odd = by_url(&other_url);
    let tokenization = &odd["tokenization"];
    // Four requests each (round-robin), streaming ones included (include_usage).
    assert_eq!(tokenization["mismatches"], 4, "{odd}");
    let last = &tokenization["last_mismatch"];
    let (router, engine) = (
        last["router_prompt_tokens"].as_u64().unwrap(),
        last["engine_prompt_tokens"].as_u64().unwrap(),
    );
    assert_ne!(router, engine);
    assert_eq!(last["api"], "chat");
    assert!(
        last["likely_cause"]
            .as_str()
            .unwrap()
            .contains("chat template"),
        "{last}"
    );

    // Series name backends by id (the admin listing maps ids to addresses).
    let metrics = request(admin, "GET", "/metrics", &[], None).text();
    let counted = metric_value(
        &metrics,
        &[
            "myelin_tokenization_mismatch_total",
            &format!("backend=\"{}\"", odd["id"]),
        ],
    );
    assert_eq!(counted, 4.0, "{metrics}");
    // The backend whose counts agree has its series, at 0 (exported from when it was added).
    assert!(metrics.contains(&format!(
        "myelin_tokenization_mismatch_total{{backend=\"{}\"}} 0",
        matching["id"]
    )));

    let _ = child.kill();
    let _ = child.wait();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("tokenization mismatch"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning per backend: {stderr}");
    assert!(warnings[0].contains(&other_url), "{}", warnings[0]);
    // Every chat here has the same length, so the first mismatch's counts are the last's.
    assert!(
        warnings[0].contains(&format!(
            "the router counted {router} prompt tokens, the engine {engine}"
        )),
        "{}",
        warnings[0]
    );
    assert!(warnings[0].contains("chat template"), "{}", warnings[0]);
    let _ = std::fs::remove_dir_all(directory);
}

/// Runs `myelin tokenize ARGS` with `body` on stdin: (exit success, stdout as JSON).
fn tokenize(args: &[&str], body: &Value) -> (bool, Value) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_myelin"))
        .arg("tokenize")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn myelin tokenize");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    let json =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|error| panic!("{error}: {stdout:?}"));
    (output.status.success(), json)
}

#[test]
fn myelin_tokenize_prints_the_ids_the_engine_counts() {
    let directory = std::env::temp_dir().join(format!("myelin-tokenize-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let template = directory.join("other.jinja");
    std::fs::write(&template, OTHER_TEMPLATE).unwrap();
    let template_arg = template.to_str().unwrap();
    let mut body = chat("Which engine holds my prefix?", false);
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "The one that saw it last."}),
        json!({"role": "user", "content": "And after an eviction?"}),
    ]);

    let (ok, printed) = tokenize(&["--chat-template", template_arg], &body);
    assert!(ok, "{printed}");
    let expected_text = "### system:\nYou answer briefly.\n\n\
        ### user:\nWhich engine holds my prefix?\n\n\
        ### assistant:\nThe one that saw it last.\n\n\
        ### user:\nAnd after an eviction?\n\n### assistant:\n";
    assert_eq!(printed["api"], "chat");
    assert_eq!(printed["text"], expected_text);
    // The ids are HuggingFace tokenizers' for the rendered text, whichever path made them.
    let reference = myelin_tokenize::Tokenizer::bundled()
        .unwrap()
        .encode(expected_text, false)
        .unwrap();
    let ids: Vec<u32> = serde_json::from_value(printed["ids"].clone()).unwrap();
    assert_eq!(ids, reference);
    assert_eq!(printed["count"], reference.len());
    assert_eq!(printed["complete"], true);
    let (_, slow) = tokenize(
        &["--chat-template", template_arg, "--no-fast-tokenizer"],
        &body,
    );
    assert_eq!(slow["ids"], printed["ids"]);

    // An engine with the same template counts as many prompt tokens.
    let engine = engines(Some(template.clone()));
    let answer = request(
        engine.engine_urls()[0]
            .trim_start_matches("http://")
            .parse()
            .unwrap(),
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["usage"]["prompt_tokens"], printed["count"]);

    // A completion body: its prompt, special tokens added as the engine adds them.
    let (ok, completion) = tokenize(&[], &json!({"model": "m", "prompt": "hello world"}));
    assert!(ok);
    assert_eq!(completion["api"], "completions");
    assert_eq!(
        completion["ids"],
        json!(
            myelin_tokenize::Tokenizer::bundled()
                .unwrap()
                .encode("hello world", true)
                .unwrap()
        )
    );
    // A body the router refuses is refused the same way.
    let (ok, refused) = tokenize(&["--api", "chat"], &json!({"model": "m"}));
    assert!(!ok);
    assert_eq!(
        refused["error"]["type"], "invalid_request_error",
        "{refused}"
    );
    let _ = std::fs::remove_dir_all(directory);
}

/// A template that writes the request's tools at the head of the prompt (as Llama 3.1's and
/// Qwen's do), then the messages.
const TOOLS_TEMPLATE: &str = "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}\
{% for message in messages %}### {{ message['role'] }}:\n{{ message['content'] }}\n\n{% endfor %}\
{% if add_generation_prompt %}### assistant:\n{% endif %}";

#[test]
fn a_template_that_writes_the_tools_gets_them_in_the_router_as_in_the_engine() {
    let directory = std::env::temp_dir().join(format!("myelin-tools-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let template = directory.join("tools.jinja");
    std::fs::write(&template, TOOLS_TEMPLATE).unwrap();
    let engine = engines(Some(template.clone()));
    let router = support::Router::start(&[
        "--backend",
        &engine.engine_urls()[0],
        "--chat-template",
        template.to_str().unwrap(),
    ]);
    let tools = json!([{"type": "function", "function": {
        "name": "search", "description": "Finds documents about a topic in the archive.",
        "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}}}}]);
    let mut with_tools = chat("Which documents mention the router?", false);
    with_tools["tools"] = tools;
    let without_tools = chat("Which documents mention the router?", false);
    let explained = |body: &Value| {
        let answer = router.admin("POST", "/admin/explain/v1/chat/completions", Some(body));
        assert_eq!(answer.status, 200);
        answer.json()["prompt_tokens"].as_u64().unwrap()
    };
    let (counted_with, counted_without) = (explained(&with_tools), explained(&without_tools));
    assert!(
        counted_with > counted_without + 10,
        "{counted_with} {counted_without}"
    );
    for body in [&with_tools, &without_tools] {
        let answer = router.post_json("/v1/chat/completions", body);
        assert_eq!(answer.status, 200);
        let engine_count = answer.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        let router_count = explained(body);
        assert_eq!(engine_count, router_count, "{body}");
    }
    let metrics = router.metrics();
    assert_eq!(
        metric_value(
            &metrics,
            &["myelin_tokenization_mismatch_total", "backend=\"0\""]
        ),
        0.0,
        "{metrics}"
    );
    drop(router);
    std::fs::remove_dir_all(&directory).ok();
}
