//! KV-event wire tests: a real engine publishes over real ZMQ sockets; an independent Python
//! decoder (pyzmq + msgspec structs written from vLLM's definitions, tests/kv_events_decode.py)
//! reads the live stream and the replay socket; every field is checked for both wire layouts,
//! plus replay ranges, the end marker, sequence gaps and the restart back to seq 0.
//!
//! Needs python3 with pyzmq and msgspec (scripts/test installs them); fails, with a message
//! saying so, when they are missing.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use myelin_http::body;
use myelin_http::client::{Pool, PoolConfig};
use myelin_http::executor::DEFAULT_IO_MEMORY_BYTES;
use myelin_kv_events::{WireVersion, hash_token_blocks};
use myelin_sim::{ClusterConfig, EngineConfig, FaultConfig, KvEventsConfig, SimCluster};
use serde_json::{Value, json};

const TOPIC: &str = "kv@sim";

/// The Python decoder as a child process, killed on drop.
struct Decoder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Decoder {
    fn start(cluster: &SimCluster, wire: WireVersion) -> Decoder {
        let endpoints = cluster.kv_event_endpoints()[0]
            .clone()
            .expect("KV events are enabled");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_events_decode.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(["--sub", &endpoints.publish, "--replay", &endpoints.replay])
            .args(["--wire", wire.as_str(), "--topic", TOPIC])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "these tests need python3 with pyzmq and msgspec: cannot run python3: {error}"
                )
            });
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut decoder = Decoder {
            child,
            stdin,
            stdout,
        };
        let mut ready = String::new();
        let _ = decoder.stdout.read_line(&mut ready);
        if ready.trim() != "READY" {
            let mut stderr = String::new();
            if let Some(mut pipe) = decoder.child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
            }
            panic!(
                "the Python KV-event decoder did not start (needs python3 with pyzmq and \
                 msgspec: pip install msgspec pyzmq): {stderr}"
            );
        }
        decoder
    }

    fn command(&mut self, command: &str) -> Value {
        writeln!(self.stdin, "{command}").expect("decoder stdin");
        self.stdin.flush().expect("decoder stdin");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("decoder stdout");
        let value: Value = serde_json::from_str(&line)
            .unwrap_or_else(|error| panic!("decoder said {line:?}: {error}"));
        assert!(value.get("error").is_none(), "decoder error: {value}");
        value
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn cluster(wire: WireVersion, faults: FaultConfig) -> SimCluster {
    SimCluster::start(ClusterConfig {
        engines: 1,
        speedup: 100.0,
        engine: EngineConfig {
            // 4 blocks of 16 tokens: the scenario below evicts.
            num_gpu_blocks: 4,
            ..EngineConfig::default()
        },
        kv_events: Some(KvEventsConfig {
            topic: TOPIC.to_string(),
            wire,
            ..KvEventsConfig::default()
        }),
        faults,
        executor_threads: 1,
        ..ClusterConfig::default()
    })
    .expect("cluster starts")
}

/// Sends completions with token-id prompts, one after the other, then resets the prefix cache.
fn run_requests(cluster: &SimCluster, prompts: &[Vec<u32>], reset: bool) {
    let base = cluster.engine_urls()[0].clone();
    let prompts = prompts.to_vec();
    glommio::LocalExecutorBuilder::default()
        .io_memory(DEFAULT_IO_MEMORY_BYTES)
        .make()
        .expect("executor")
        .run(async move {
            let pool = Pool::new(PoolConfig::default());
            for prompt in prompts {
                let request = Request::builder()
                    .method(Method::POST)
                    .uri(format!("{base}/v1/completions"))
                    .body(body::full(
                        json!({"prompt": prompt, "max_tokens": 1}).to_string(),
                    ))
                    .expect("request");
                let response = pool.send(request).await.expect("response");
                assert_eq!(response.status(), StatusCode::OK);
                response.into_body().collect().await.expect("body");
            }
            if reset {
                let request = Request::builder()
                    .method(Method::POST)
                    .uri(format!("{base}/reset_prefix_cache"))
                    .body(body::empty())
                    .expect("request");
                let response = pool.send(request).await.expect("response");
                assert_eq!(response.status(), StatusCode::OK);
            }
        });
}

/// `GET /kv_event_sources` (vLLM 0.31+): status and body.
fn kv_event_sources(cluster: &SimCluster) -> (StatusCode, Value) {
    let url = format!("{}/kv_event_sources", cluster.engine_urls()[0]);
    glommio::LocalExecutorBuilder::default()
        .io_memory(DEFAULT_IO_MEMORY_BYTES)
        .make()
        .expect("executor")
        .run(async move {
            let pool = Pool::new(PoolConfig::default());
            let request = Request::builder()
                .uri(url)
                .body(body::empty())
                .expect("request");
            let response = pool.send(request).await.expect("response");
            let status = response.status();
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            )
        })
}

fn range(start: u32, end: u32) -> Vec<u32> {
    (start..end).collect()
}

/// A: 2 blocks; B: 2 blocks; C: 2 blocks evicting A (tail first); D: B's 2 blocks hit plus one
/// new block evicting C's last block; then a reset.
fn scenario_prompts() -> Vec<Vec<u32>> {
    let mut d = range(100, 132);
    d.extend(range(300, 316));
    vec![range(0, 32), range(100, 132), range(200, 232), d]
}

fn wire_hashes(tokens: &[u32]) -> Vec<u64> {
    hash_token_blocks(tokens, 16)
        .iter()
        .map(|hash| hash.wire_u64())
        .collect()
}

/// One expected event: (type, wire hashes, parent hash, token ids).
type ExpectedEvent = (&'static str, Vec<u64>, Option<u64>, Vec<u32>);

/// The five batches vLLM would publish for the scenario.
fn expected_batches() -> Vec<Vec<ExpectedEvent>> {
    let prompts = scenario_prompts();
    let a = wire_hashes(&prompts[0]);
    let b = wire_hashes(&prompts[1]);
    let c = wire_hashes(&prompts[2]);
    let d = wire_hashes(&prompts[3]);
    vec![
        vec![("BlockStored", a.clone(), None, prompts[0].clone())],
        vec![("BlockStored", b.clone(), None, prompts[1].clone())],
        vec![
            ("BlockRemoved", vec![a[1]], None, vec![]),
            ("BlockRemoved", vec![a[0]], None, vec![]),
            ("BlockStored", c.clone(), None, prompts[2].clone()),
        ],
        vec![
            // C was freed tail first, so its last block is the least recently freed.
            ("BlockRemoved", vec![c[1]], None, vec![]),
            ("BlockStored", vec![d[2]], Some(b[1]), range(300, 316)),
        ],
        vec![("AllBlocksCleared", vec![], None, vec![])],
    ]
}

fn check_message(message: &Value, seq: i64, wire: WireVersion, with_topic: bool) {
    assert_eq!(message["seq"], seq, "{message}");
    if with_topic {
        assert_eq!(message["topic"], TOPIC);
    }
    assert_eq!(message["dp_rank"], 0);
    assert_eq!(message["batch_len"], 3, "[ts, events, dp_rank]");
    assert!(
        message["ts"].as_f64().is_some_and(|ts| ts > 1.0e9),
        "{message}"
    );
    let expected = &expected_batches()[usize::try_from(seq).expect("seq")];
    let events = message["events"].as_array().expect("events");
    assert_eq!(events.len(), expected.len(), "batch {seq}: {message}");
    for (event, (kind, hashes, parent, tokens)) in events.iter().zip(expected) {
        assert_eq!(event["type"], *kind, "{event}");
        match *kind {
            "BlockStored" => {
                assert_eq!(event["block_hashes"], json!(hashes));
                assert_eq!(event["parent_block_hash"], json!(parent));
                assert_eq!(event["token_ids"], json!(tokens));
                assert_eq!(event["block_size"], 16);
                assert_eq!(event["lora_id"], Value::Null);
                assert_eq!(event["medium"], "GPU");
                assert_eq!(event["lora_name"], Value::Null);
                assert_eq!(event["extra_keys"], Value::Null);
                assert_eq!(event["group_idx"], 0);
                assert_eq!(event["kv_cache_spec_kind"], "full_attention");
                assert_eq!(event["kv_cache_spec_sliding_window"], Value::Null);
                match wire {
                    // Tag + 10 fields: the sliding window (a trailing default) is dropped.
                    WireVersion::V0_22 => assert_eq!(event["raw"], 11),
                    WireVersion::V0_33 => {
                        for field in ["locality", "ownership", "session_id", "lookahead_token_ids"]
                        {
                            assert_eq!(event[field], Value::Null);
                        }
                        assert_eq!(
                            event["raw"],
                            json!([
                                "block_hashes",
                                "block_size",
                                "group_idx",
                                "kv_cache_spec_kind",
                                "lora_id",
                                "lora_name",
                                "medium",
                                "parent_block_hash",
                                "token_ids",
                                "type"
                            ])
                        );
                    }
                }
            }
            "BlockRemoved" => {
                assert_eq!(
                    event["block_hashes"],
                    json!(hashes),
                    "batch {seq}: {message}"
                );
                assert_eq!(event["medium"], "GPU");
                assert_eq!(event["group_idx"], 0);
                match wire {
                    WireVersion::V0_22 => assert_eq!(event["raw"], 4),
                    WireVersion::V0_33 => assert_eq!(
                        event["raw"],
                        json!(["block_hashes", "group_idx", "medium", "type"])
                    ),
                }
            }
            _ => match wire {
                WireVersion::V0_22 => assert_eq!(event["raw"], 1),
                WireVersion::V0_33 => assert_eq!(event["raw"], json!(["type"])),
            },
        }
    }
}

fn check_wire_version(wire: WireVersion) {
    let cluster = cluster(wire, FaultConfig::default());
    let (status, sources) = kv_event_sources(&cluster);
    match wire {
        WireVersion::V0_22 => assert_eq!(status, StatusCode::NOT_FOUND, "added in vLLM 0.31"),
        WireVersion::V0_33 => {
            assert_eq!(status, StatusCode::OK);
            assert_eq!(sources["0"]["topic"], TOPIC);
            let port = cluster.kv_event_endpoints()[0]
                .as_ref()
                .and_then(|endpoints| endpoints.publish.rsplit(':').next().map(str::to_string))
                .expect("endpoint");
            assert!(
                sources["0"]["endpoint"]
                    .as_str()
                    .is_some_and(|e| e.ends_with(&port))
            );
        }
    }
    let mut decoder = Decoder::start(&cluster, wire);
    run_requests(&cluster, &scenario_prompts(), true);

    let live = decoder.command("collect 5");
    let live = live["live"].as_array().expect("live");
    for (seq, message) in live.iter().enumerate() {
        assert_eq!(message["frames"], 3, "[topic, seq, payload]");
        check_message(message, seq as i64, wire, true);
    }

    let replay = decoder.command("replay 2");
    let replayed = replay["replay"].as_array().expect("replay");
    assert_eq!(replayed.len(), 3, "seq 2, 3 and 4: {replay}");
    let frames = if wire == WireVersion::V0_33 { 4 } else { 3 };
    for (offset, message) in replayed.iter().enumerate() {
        assert_eq!(message["frames"], frames);
        check_message(message, 2 + offset as i64, wire, wire == WireVersion::V0_33);
    }
    assert_eq!(replay["end"]["seq"], -1);
    assert_eq!(replay["end"]["payload_len"], 0);
    assert_eq!(replay["end"]["frames"], frames);

    // A publisher restart begins again at seq 0 with an empty replay buffer.
    assert!(cluster.restart_kv_publisher(0));
    run_requests(&cluster, &[range(500, 532)], false);
    let after = decoder.command("collect 1");
    let message = &after["live"][0];
    assert_eq!(message["seq"], 0);
    assert_eq!(message["events"][0]["type"], "BlockStored");
    assert_eq!(
        message["events"][0]["block_hashes"],
        json!(wire_hashes(&range(500, 532)))
    );
    let replay = decoder.command("replay 0");
    assert_eq!(
        replay["replay"].as_array().map(Vec::len),
        Some(1),
        "{replay}"
    );
    assert_eq!(replay["end"]["seq"], -1);
}

#[test]
fn wire_0_33_every_field_replay_and_restart() {
    check_wire_version(WireVersion::V0_33);
}

#[test]
fn wire_0_22_every_field_replay_and_restart() {
    check_wire_version(WireVersion::V0_22);
}

#[test]
fn dropped_batches_make_gaps_that_replay_fills() {
    let wire = WireVersion::V0_33;
    let faults = FaultConfig {
        kv_drop_every: Some(2),
        ..FaultConfig::default()
    };
    let cluster = cluster(wire, faults);
    let mut decoder = Decoder::start(&cluster, wire);
    run_requests(&cluster, &scenario_prompts(), true);
    let live = decoder.command("collect 3");
    let seqs: Vec<i64> = live["live"]
        .as_array()
        .expect("live")
        .iter()
        .map(|message| message["seq"].as_i64().expect("seq"))
        .collect();
    assert_eq!(seqs, vec![0, 2, 4], "every second batch is missing live");
    let replay = decoder.command("replay 0");
    let replayed = replay["replay"].as_array().expect("replay");
    assert_eq!(replayed.len(), 5);
    for (seq, message) in replayed.iter().enumerate() {
        check_message(message, seq as i64, wire, true);
    }
}
