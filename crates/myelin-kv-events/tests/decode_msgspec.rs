//! Cross-check against msgspec, the encoder vLLM itself uses: tests/msgspec_batches.py writes
//! batches in the struct layouts of vLLM 0.9.0, 0.10.2, 0.22 (bin digests) and 0.33 (maps with
//! locality, ownership, session and lookahead fields) and says what they hold; every payload
//! must decode to exactly that. Needs python3 with msgspec (scripts/setup installs it); fails,
//! with a message saying so, when either is missing, like the other Python-backed tests.

use std::process::Command;

use myelin_kv_events::{DecodedEvent, KvEvent, decode_batch};
use serde_json::{Value, json};

fn event_json(decoded: &DecodedEvent) -> Value {
    match &decoded.event {
        KvEvent::BlockStored(stored) => {
            let mut value = json!({
                "tag": "BlockStored",
                "block_hashes": stored.block_hashes,
                "parent_block_hash": stored.parent_block_hash,
                "token_ids": stored.token_ids,
                "block_size": stored.block_size,
                "lora_id": stored.lora_id,
            });
            // Fields of later releases appear when the Python layout declares them.
            let optional = [
                ("medium", json!(stored.medium)),
                ("lora_name", json!(stored.lora_name)),
                ("group_idx", json!(stored.group_idx)),
                ("kv_cache_spec_kind", json!(stored.kv_cache_spec_kind)),
                (
                    "kv_cache_spec_sliding_window",
                    json!(stored.kv_cache_spec_sliding_window),
                ),
                ("locality", json!(decoded.locality)),
            ];
            for (name, field) in optional {
                value[name] = field;
            }
            value
        }
        KvEvent::BlockRemoved(removed) => json!({
            "tag": "BlockRemoved",
            "block_hashes": removed.block_hashes,
            "medium": removed.medium,
            "group_idx": removed.group_idx,
            "locality": decoded.locality,
        }),
        KvEvent::AllBlocksCleared(_) => json!({"tag": "AllBlocksCleared"}),
    }
}

/// Keeps only the keys the Python side declared (older layouts have fewer fields).
fn project(actual: &Value, expected: &Value) -> Value {
    let (Some(actual), Some(expected)) = (actual.as_object(), expected.as_object()) else {
        return actual.clone();
    };
    Value::Object(
        expected
            .keys()
            .map(|key| (key.clone(), actual.get(key).cloned().unwrap_or(Value::Null)))
            .collect(),
    )
}

fn hex_bytes(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|index| u8::from_str_radix(&text[index..index + 2], 16).expect("hex from python"))
        .collect()
}

#[test]
fn msgspec_encoded_batches_of_four_releases_decode_exactly() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/msgspec_batches.py");
    let output = Command::new("python3")
        .arg(script)
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "this test needs python3 with msgspec (scripts/setup installs it): cannot run \
                 python3: {error}"
            )
        });
    assert!(
        output.status.success(),
        "msgspec_batches.py failed (needs msgspec: pip install -r scripts/requirements-test.txt): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).expect("utf-8 from python");
    let mut cases = 0;
    for line in stdout.lines() {
        let case: Value = serde_json::from_str(line).expect("json from python");
        let name = case["name"].as_str().expect("case name");
        let payload = hex_bytes(case["payload_hex"].as_str().expect("payload"));
        let expected = &case["expected"];
        let batch = decode_batch(&payload).unwrap_or_else(|error| panic!("{name}: {error}"));
        assert_eq!(batch.skipped_unknown_events, 0, "{name}");
        assert_eq!(json!(batch.ts), expected["ts"], "{name}: ts");
        assert_eq!(
            json!(batch.data_parallel_rank),
            expected["data_parallel_rank"],
            "{name}: rank"
        );
        let expected_events = expected["events"].as_array().expect("events");
        assert_eq!(batch.events.len(), expected_events.len(), "{name}");
        for (decoded, expected_event) in batch.events.iter().zip(expected_events) {
            let actual = project(&event_json(decoded), expected_event);
            assert_eq!(&actual, expected_event, "{name}");
        }
        cases += 1;
    }
    assert_eq!(cases, 4, "every layout was written");
}
