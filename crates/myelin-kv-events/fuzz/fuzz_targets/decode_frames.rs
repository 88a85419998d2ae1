//! Fuzz target: arbitrary bytes split into ZMQ frames (a frame ends at each 0xFF 0x00 pair), as
//! a live message and as a replay reply. Both decoders must answer without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use myelin_kv_events::decode::{decode_live, decode_replay};

fuzz_target!(|data: &[u8]| {
    let mut frames: Vec<&[u8]> = Vec::new();
    let mut start = 0;
    let mut index = 0;
    while index + 1 < data.len() {
        if data[index] == 0xFF && data[index + 1] == 0x00 {
            frames.push(&data[start..index]);
            start = index + 2;
            index += 2;
        } else {
            index += 1;
        }
    }
    frames.push(&data[start..]);
    let _ = decode_live(&frames);
    let _ = decode_replay(&frames);
});
