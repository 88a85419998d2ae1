//! Fuzz target: arbitrary bytes as a KV-event batch payload. The decoder must return a batch
//! or an error, never panic; a decoded batch must re-encode and decode to the same events in
//! the layout the encoder writes (what the decoder accepted is what it understood).
#![no_main]

use libfuzzer_sys::fuzz_target;
use myelin_kv_events::decode::decode_batch;
use myelin_kv_events::{WireVersion, encode_batch};

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let events: Vec<_> = batch
        .events
        .iter()
        .map(|decoded| decoded.event.clone())
        .collect();
    let original = batch.into_event_batch();
    for version in [WireVersion::V0_22, WireVersion::V0_33] {
        let again = decode_batch(&encode_batch(&original, version)).unwrap_or_else(|error| {
            panic!("re-encoded batch does not decode ({version}): {error}")
        });
        let again: Vec<_> = again
            .events
            .into_iter()
            .map(|decoded| decoded.event)
            .collect();
        assert_eq!(again, events, "round trip through {version}");
    }
});
