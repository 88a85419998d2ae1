//! Property tests of the decoder: every batch the encoder writes (both layouts) decodes back
//! equal; arbitrary bytes, every truncation and every single-byte mutation of a valid payload
//! return Ok or Err without panicking; huge length headers are rejected before any allocation.

use myelin_kv_events::decode::{DecodeError, MAX_SKIP_DEPTH};
use myelin_kv_events::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, WireVersion,
    decode_batch, encode_batch,
};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

fn optional_text() -> impl Strategy<Value = Option<String>> {
    option::of(prop_oneof![
        Just("GPU".to_string()),
        Just("full_attention".to_string()),
        "\\PC{0,40}",
    ])
}

/// `extra_keys`: per block nil or a list of string keys and other keys (written as nil).
fn extra_keys() -> impl Strategy<Value = Option<Vec<Option<Vec<ExtraKey>>>>> {
    let key = prop_oneof!["\\PC{0,20}".prop_map(ExtraKey::Str), Just(ExtraKey::Other),];
    option::of(vec(option::of(vec(key, 0..3)), 0..4))
}

fn block_stored() -> impl Strategy<Value = KvEvent> {
    (
        (vec(any::<u64>(), 0..6), option::of(any::<u64>())),
        (
            vec(any::<u32>(), 0..40),
            any::<u32>(),
            option::of(any::<u64>()),
        ),
        (optional_text(), optional_text(), option::of(any::<u32>())),
        (optional_text(), option::of(any::<u32>()), extra_keys()),
    )
        .prop_map(
            |(
                (block_hashes, parent_block_hash),
                (token_ids, block_size, lora_id),
                (medium, lora_name, group_idx),
                (kv_cache_spec_kind, kv_cache_spec_sliding_window, extra_keys),
            )| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    group_idx,
                    kv_cache_spec_kind,
                    kv_cache_spec_sliding_window,
                })
            },
        )
}

fn block_removed() -> impl Strategy<Value = KvEvent> {
    (
        vec(any::<u64>(), 0..4),
        optional_text(),
        option::of(any::<u32>()),
    )
        .prop_map(|(block_hashes, medium, group_idx)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            })
        })
}

fn event_batch() -> impl Strategy<Value = EventBatch> {
    (
        -1e12f64..1e12,
        vec(
            prop_oneof![
                4 => block_stored(),
                3 => block_removed(),
                1 => Just(KvEvent::AllBlocksCleared(AllBlocksCleared)),
            ],
            0..6,
        ),
        option::of(any::<u32>()),
    )
        .prop_map(|(ts, events, data_parallel_rank)| EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
}

fn wire_version() -> impl Strategy<Value = WireVersion> {
    prop_oneof![Just(WireVersion::V0_22), Just(WireVersion::V0_33)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encoded_batches_decode_back_equal(batch in event_batch(), version in wire_version()) {
        let payload = encode_batch(&batch, version);
        let decoded = decode_batch(&payload).map_err(|error| {
            TestCaseError::fail(format!("{error} for {payload:02x?}"))
        })?;
        prop_assert_eq!(decoded.skipped_unknown_events, 0);
        prop_assert!(decoded.events.iter().all(|event| event.locality.is_none()));
        prop_assert_eq!(decoded.into_event_batch(), batch);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn arbitrary_bytes_behind_a_valid_header_never_panic(bytes in vec(any::<u8>(), 0..256)) {
        // Reach deeper into the decoder than random leading bytes usually do.
        let mut payload = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
        payload.extend_from_slice(&bytes);
        let _ = decode_batch(&payload);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_truncation_is_an_error(batch in event_batch(), version in wire_version()) {
        let payload = encode_batch(&batch, version);
        for len in 0..payload.len() {
            // A strict prefix always lacks a declared element, so it can never decode.
            prop_assert!(decode_batch(&payload[..len]).is_err(), "prefix of {} bytes", len);
        }
    }

    #[test]
    fn every_single_byte_mutation_is_handled(
        batch in event_batch(),
        version in wire_version(),
        replacement in any::<u8>(),
    ) {
        let payload = encode_batch(&batch, version);
        let mut mutated = payload.clone();
        for index in 0..payload.len() {
            for byte in [replacement, 0xdd, 0xdf, 0xc6, 0xdb, 0xc1, payload[index] ^ 0x80] {
                mutated[index] = byte;
                let _ = decode_batch(&mutated);
            }
            mutated[index] = payload[index];
        }
    }
}

/// A string extra key cut short is an error, not a key of unknown meaning: only bytes that
/// are whole but not UTF-8 become [`ExtraKey::Other`].
#[test]
fn a_truncated_extra_key_is_an_error() {
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![],
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 0,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: Some(vec![Some(vec![ExtraKey::Str("\u{1003c}".to_string())])]),
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        })],
        data_parallel_rank: None,
    };
    for version in [WireVersion::V0_22, WireVersion::V0_33] {
        let payload = encode_batch(&batch, version);
        assert_eq!(decode_batch(&payload).unwrap().into_event_batch(), batch);
        for len in 0..payload.len() {
            assert!(
                decode_batch(&payload[..len]).is_err(),
                "prefix of {len} of {} bytes decoded ({version:?})",
                payload.len()
            );
        }
    }
}

/// Headers that declare 2^32 - 1 of something, for every msgpack length type.
const HUGE_HEADERS: [&[u8]; 6] = [
    &[0xdd, 0xff, 0xff, 0xff, 0xff],
    &[0xdf, 0xff, 0xff, 0xff, 0xff],
    &[0xdb, 0xff, 0xff, 0xff, 0xff],
    &[0xc6, 0xff, 0xff, 0xff, 0xff],
    &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0xdc, 0xff, 0xff],
];

#[test]
fn huge_length_headers_are_rejected_at_every_position() {
    let head = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
    let mut positions: Vec<Vec<u8>> = Vec::new();
    for header in HUGE_HEADERS {
        // As the batch, the events array, an event, a field, a skipped field, a map value.
        positions.push(header.to_vec());
        positions.push([&head[..], header].concat());
        positions.push([&head[..], &[0x91], header].concat());
        positions.push([&head[..], &[0x91, 0x92, 0xac], b"BlockRemoved", header].concat());
        positions.push([&head[..], &[0x91, 0x92, 0xa1, b'X'], header].concat());
        positions.push([&head[..], &[0x91, 0x81, 0xa1, b'k'], header].concat());
    }
    for payload in positions {
        match decode_batch(&payload) {
            Err(
                DecodeError::LengthExceedsPayload { .. }
                | DecodeError::Truncated { .. }
                | DecodeError::UnexpectedType { .. }
                | DecodeError::MissingTag { .. },
            ) => {}
            other => panic!("{payload:02x?} gave {other:?}"),
        }
    }
}

#[test]
fn a_large_valid_skipped_value_decodes() {
    // An unknown event whose field is an array of 100k nils: linear, no recursion blow-up.
    let count: u32 = 100_000;
    let mut payload = vec![0x92, 0x00, 0x91, 0x92, 0xa1, b'X', 0xdd];
    payload.extend_from_slice(&count.to_be_bytes());
    payload.extend(std::iter::repeat_n(0xc0, count as usize));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.skipped_unknown_events, 1);
    assert!(batch.events.is_empty());
}

#[test]
fn nesting_up_to_the_bound_is_accepted_and_beyond_rejected() {
    let nested = |depth: usize| {
        let mut payload = vec![0x92, 0x00, 0x91, 0x92, 0xa1, b'X'];
        payload.extend(std::iter::repeat_n(0x91, depth));
        payload.push(0xc0);
        decode_batch(&payload)
    };
    assert!(nested(MAX_SKIP_DEPTH).is_ok());
    assert!(matches!(
        nested(MAX_SKIP_DEPTH + 1),
        Err(DecodeError::TooDeep { .. })
    ));
}
