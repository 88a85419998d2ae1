//! Decoder tests on real bytes: the literal examples of docs/simulator.md ("vLLM's KV-event wire
//! format"), and the layouts of vLLM 0.9.0, 0.10.2, 0.20, 0.26+ written by hand with `rmp`
//! (hashes of every width and sign, bin digests, map16 headers, unknown fields and tags), plus
//! the errors hostile bytes get.

use myelin_kv_events::decode::{
    DecodeError, DecodedBatch, DecodedEvent, is_mirrored_removed, is_mirrored_stored,
};
use myelin_kv_events::{
    AllBlocksCleared, BlockRemoved, BlockStored, ExtraKey, KvEvent, decode_batch, hash_token_blocks,
};
use rmp::encode;

const HASH_A: u64 = 0x9f3a_1c5e_7b2d_4f60;
const HASH_B: u64 = 0x0123_4567_89ab_cdef;

/// A msgpack writer for hand-built payloads.
#[derive(Default)]
struct Msgpack(Vec<u8>);

impl Msgpack {
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }
    fn array(&mut self, len: u32) -> &mut Self {
        encode::write_array_len(&mut self.0, len).unwrap();
        self
    }
    fn map(&mut self, len: u32) -> &mut Self {
        encode::write_map_len(&mut self.0, len).unwrap();
        self
    }
    fn map16(&mut self, len: u16) -> &mut Self {
        self.0.push(0xde);
        self.raw(&len.to_be_bytes())
    }
    fn str(&mut self, text: &str) -> &mut Self {
        encode::write_str(&mut self.0, text).unwrap();
        self
    }
    fn uint(&mut self, value: u64) -> &mut Self {
        encode::write_uint(&mut self.0, value).unwrap();
        self
    }
    fn u64_wide(&mut self, value: u64) -> &mut Self {
        encode::write_u64(&mut self.0, value).unwrap();
        self
    }
    fn sint(&mut self, value: i64) -> &mut Self {
        encode::write_sint(&mut self.0, value).unwrap();
        self
    }
    fn nil(&mut self) -> &mut Self {
        encode::write_nil(&mut self.0).unwrap();
        self
    }
    fn f64(&mut self, value: f64) -> &mut Self {
        encode::write_f64(&mut self.0, value).unwrap();
        self
    }
    fn bin(&mut self, bytes: &[u8]) -> &mut Self {
        encode::write_bin(&mut self.0, bytes).unwrap();
        self
    }
    fn uints(&mut self, values: &[u64]) -> &mut Self {
        self.array(values.len() as u32);
        for &value in values {
            self.uint(value);
        }
        self
    }
    fn key(&mut self, name: &str) -> &mut Self {
        self.str(name)
    }
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn decode(payload: &[u8]) -> DecodedBatch {
    decode_batch(payload).unwrap_or_else(|error| panic!("decode failed: {error}"))
}

fn gpu() -> Option<String> {
    Some("GPU".to_string())
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> BlockStored {
    BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }
}

fn local(event: KvEvent) -> DecodedEvent {
    DecodedEvent {
        event,
        locality: None,
    }
}

fn doc_hash_pair(out: &mut Msgpack) {
    out.raw(&[0x92]).u64_wide(HASH_A).u64_wide(HASH_B);
}

#[test]
fn doc_example_0_10_2_array_layout() {
    let mut payload = Msgpack::default();
    payload.raw(&[
        0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x40, 0x20, 0x00, 0x00, 0x92, 0x97,
    ]);
    payload.str("BlockStored");
    doc_hash_pair(&mut payload);
    payload.raw(&[0xc0, 0x98, 1, 2, 3, 4, 5, 6, 7, 8, 0x04, 0xc0]);
    payload.str("GPU").raw(&[0x93]).str("BlockRemoved");
    payload
        .raw(&[0x91])
        .u64_wide(HASH_A)
        .str("GPU")
        .raw(&[0x00]);

    let batch = decode(payload.bytes());
    assert_eq!(batch.ts, f64::from_bits(0x41d9_54fc_4020_0000));
    assert_eq!(batch.data_parallel_rank, Some(0));
    assert_eq!(batch.skipped_unknown_events, 0);
    let mut expected_stored = stored(&[HASH_A, HASH_B], None, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
    expected_stored.medium = gpu();
    assert_eq!(
        batch.events,
        vec![
            local(KvEvent::BlockStored(expected_stored)),
            local(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![HASH_A],
                medium: gpu(),
                group_idx: None,
            })),
        ]
    );
    assert!(batch.events.iter().all(DecodedEvent::is_mirrored));
}

#[test]
fn doc_example_0_24_map_layout() {
    let mut payload = Msgpack::default();
    payload.raw(&[
        0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x40, 0x20, 0x00, 0x00, 0x91, 0x8a,
    ]);
    payload.str("type").str("BlockStored").str("block_hashes");
    doc_hash_pair(&mut payload);
    payload.str("parent_block_hash").nil();
    payload
        .str("token_ids")
        .raw(&[0x98, 1, 2, 3, 4, 5, 6, 7, 8]);
    payload.str("block_size").uint(4).str("lora_id").nil();
    payload.str("medium").str("GPU").str("lora_name").nil();
    payload.str("group_idx").uint(0);
    payload.str("kv_cache_spec_kind").str("full_attention");
    payload.uint(0);

    let batch = decode(payload.bytes());
    let mut expected = stored(&[HASH_A, HASH_B], None, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
    expected.medium = gpu();
    expected.group_idx = Some(0);
    expected.kv_cache_spec_kind = Some("full_attention".to_string());
    assert_eq!(batch.events, vec![local(KvEvent::BlockStored(expected))]);
    assert!(batch.events[0].is_mirrored());
}

#[test]
fn v0_9_0_python_int_hashes_without_rank_or_medium() {
    let mut payload = Msgpack::default();
    payload.array(2).f64(1_717_000_000.0).array(3);
    payload.array(6).str("BlockStored");
    payload.array(3).sint(-1).sint(i64::MIN).sint(42);
    payload.sint(-123_456_789);
    payload.uints(&[10, 20, 30]).uint(1).nil();
    payload.array(2).str("BlockRemoved").array(1).sint(-1);
    payload.array(1).str("AllBlocksCleared");

    let batch = decode(payload.bytes());
    assert_eq!(batch.data_parallel_rank, None);
    let expected_stored = stored(
        &[u64::MAX, 1 << 63, 42],
        Some((-123_456_789i64) as u64),
        &[10, 20, 30],
        1,
    );
    assert_eq!(
        batch.events,
        vec![
            local(KvEvent::BlockStored(expected_stored)),
            local(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![u64::MAX],
                medium: None,
                group_idx: None,
            })),
            local(KvEvent::AllBlocksCleared(AllBlocksCleared)),
        ]
    );
    // No medium before 0.10.2 means the GPU cache.
    assert!(batch.events.iter().all(DecodedEvent::is_mirrored));
}

#[test]
fn v0_10_2_medium_and_every_int_width() {
    let mut payload = Msgpack::default();
    payload.array(3).uint(1_757_000_000).array(2);
    payload.array(7).str("BlockStored");
    // fixint, u8, u16, u32, u64 and a non-negative value written with a signed marker.
    payload
        .array(6)
        .uint(5)
        .uint(200)
        .uint(60_000)
        .uint(70_000)
        .u64_wide(7);
    payload.raw(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 9]);
    payload
        .uint(4)
        .raw(&[0x92, 0xd0, 0x05, 0xce, 0xff, 0xff, 0xff, 0xff]);
    payload.uint(1).uint(3).str("CPU");
    payload.array(3).str("BlockRemoved").uints(&[5]).str("GPU");
    payload.uint(7);

    let batch = decode(payload.bytes());
    assert_eq!(batch.ts, 1_757_000_000.0);
    assert_eq!(batch.data_parallel_rank, Some(7));
    let KvEvent::BlockStored(first) = &batch.events[0].event else {
        panic!("expected BlockStored, got {:?}", batch.events[0]);
    };
    assert_eq!(first.block_hashes, vec![5, 200, 60_000, 70_000, 7, 9]);
    assert_eq!(first.parent_block_hash, Some(4));
    assert_eq!(first.token_ids, vec![5, u32::MAX]);
    assert_eq!(first.lora_id, Some(3));
    assert_eq!(first.medium.as_deref(), Some("CPU"));
    assert!(!is_mirrored_stored(first), "CPU blocks are not mirrored");
    assert!(!batch.events[0].is_mirrored());
    assert!(batch.events[1].is_mirrored());
}

#[test]
fn v0_20_group_idx_and_nested_extra_keys() {
    let mut payload = Msgpack::default();
    payload.array(3).f64(1.5).array(2);
    payload.array(10).str("BlockStored").uints(&[1, 2]).uint(0);
    payload
        .uints(&[7, 8, 9, 10])
        .uint(2)
        .nil()
        .str("GPU")
        .str("my-lora");
    // extra_keys: one tuple per block, nested arrays, maps, bins, floats.
    payload.array(2);
    payload
        .array(2)
        .str("mm-hash")
        .array(2)
        .map(1)
        .str("salt")
        .bin(b"\x00\x01")
        .f64(0.5);
    payload.nil();
    payload.uint(1);
    payload
        .array(4)
        .str("BlockRemoved")
        .uints(&[2])
        .str("GPU")
        .uint(1);
    payload.nil();

    let batch = decode(payload.bytes());
    assert_eq!(batch.data_parallel_rank, None, "nil rank");
    let mut expected = stored(&[1, 2], Some(0), &[7, 8, 9, 10], 2);
    expected.medium = gpu();
    expected.lora_name = Some("my-lora".to_string());
    // String keys are kept (a LoRA name, a salt); any other key is `Other`.
    expected.extra_keys = Some(vec![
        Some(vec![ExtraKey::Str("mm-hash".to_string()), ExtraKey::Other]),
        None,
    ]);
    expected.group_idx = Some(1);
    assert_eq!(
        batch.events,
        vec![
            local(KvEvent::BlockStored(expected)),
            local(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![2],
                medium: gpu(),
                group_idx: Some(1),
            })),
        ]
    );
}

#[test]
fn extra_keys_of_another_shape_decode_as_unknown_instead_of_failing() {
    // A future vLLM writing extra_keys as a map, then as a list of ints per block.
    for shape in [0, 1] {
        let mut payload = Msgpack::default();
        payload.array(3).f64(1.5).array(1);
        payload.array(9).str("BlockStored").uints(&[1]).nil();
        payload.uints(&[7, 8]).uint(2).nil().str("GPU").nil();
        if shape == 0 {
            payload.map(1).str("salt").str("t1");
        } else {
            payload.array(1).uint(5);
        }
        payload.nil();
        let batch = decode(payload.bytes());
        let KvEvent::BlockStored(stored) = &batch.events[0].event else {
            panic!("not stored")
        };
        assert_eq!(stored.extra_keys, Some(vec![Some(vec![ExtraKey::Other])]));
        assert_eq!(stored.token_ids, vec![7, 8]);
    }
}

#[test]
fn v0_26_plus_maps_with_remote_locality_ownership_and_session() {
    let mut payload = Msgpack::default();
    payload.array(3).f64(2.0).array(3);
    // A map16 header with the tag not first, unknown and known-but-unused keys.
    payload.map16(13);
    payload.key("block_hashes").uints(&[100]);
    payload.key("type").str("BlockStored");
    payload.key("parent_block_hash").u64_wide(99);
    payload.key("token_ids").uints(&[1, 2]);
    payload.key("block_size").uint(2);
    payload.key("lora_id").nil();
    payload.key("medium").str("GPU");
    payload.key("lora_name").nil();
    payload.key("locality").str("REMOTE");
    payload
        .key("ownership")
        .map(1)
        .str("owner")
        .array(2)
        .uint(1)
        .nil();
    payload.key("session_id").str("session-7");
    payload.key("lookahead_token_ids").uints(&[3, 4]);
    payload.key("a_future_field").array(1).map(0);
    // A removal from this instance, and one with a non-string key (skipped).
    payload.map(4).key("type").str("BlockRemoved");
    payload
        .key("block_hashes")
        .uints(&[100])
        .key("locality")
        .str("LOCAL");
    payload.uint(17).str("value of an integer key");
    payload.map(1).key("type").str("AllBlocksCleared");
    payload.uint(2);

    let batch = decode(payload.bytes());
    assert_eq!(batch.data_parallel_rank, Some(2));
    let mut expected = stored(&[100], Some(99), &[1, 2], 2);
    expected.medium = gpu();
    assert_eq!(
        batch.events,
        vec![
            DecodedEvent {
                event: KvEvent::BlockStored(expected),
                locality: Some("REMOTE".to_string()),
            },
            DecodedEvent {
                event: KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![100],
                    medium: None,
                    group_idx: None,
                }),
                locality: Some("LOCAL".to_string()),
            },
            local(KvEvent::AllBlocksCleared(AllBlocksCleared)),
        ]
    );
    assert!(batch.events[0].is_remote());
    assert!(!batch.events[0].is_mirrored(), "REMOTE blocks are not ours");
    assert!(batch.events[1].is_mirrored());
}

#[test]
fn bin32_digests_map_to_the_wire_u64() {
    let tokens: Vec<u32> = (0..32).collect();
    let digests = hash_token_blocks(&tokens, 16);
    let mut payload = Msgpack::default();
    payload.array(3).f64(3.0).array(2);
    payload.array(7).str("BlockStored");
    payload.array(2).bin(&digests[0].0).bin(&digests[1].0);
    payload
        .nil()
        .uints(&tokens.iter().map(|&t| u64::from(t)).collect::<Vec<_>>());
    payload.uint(16).nil().str("GPU");
    payload
        .array(2)
        .str("BlockRemoved")
        .array(1)
        .bin(&digests[1].0);
    payload.uint(0);

    let batch = decode(payload.bytes());
    let wire: Vec<u64> = digests.iter().map(|digest| digest.wire_u64()).collect();
    let KvEvent::BlockStored(first) = &batch.events[0].event else {
        panic!("expected BlockStored");
    };
    assert_eq!(first.block_hashes, wire);
    let KvEvent::BlockRemoved(removed) = &batch.events[1].event else {
        panic!("expected BlockRemoved");
    };
    assert_eq!(removed.block_hashes, vec![wire[1]]);
    assert!(is_mirrored_removed(removed));
}

#[test]
fn future_trailing_fields_and_unknown_tags_are_skipped() {
    let mut payload = Msgpack::default();
    // A future EventBatch with a fourth element.
    payload.array(4).f64(4.0).array(5);
    // BlockStored with all 15 known fields plus three future ones.
    payload
        .array(19)
        .str("BlockStored")
        .uints(&[1])
        .nil()
        .uints(&[5])
        .uint(1);
    payload
        .nil()
        .str("GPU")
        .nil()
        .nil()
        .uint(0)
        .str("full_attention")
        .nil();
    payload.nil().nil().nil().uints(&[6]);
    payload.map(1).str("x").array(1).f64(1.0);
    payload.bin(&[1, 2, 3]).raw(&[0xd4, 0x01, 0x00]);
    payload
        .array(3)
        .str("BlockTransferred")
        .uints(&[1])
        .str("CPU");
    payload.map(3).key("type").str("KvCacheStats");
    payload
        .key("usage")
        .f64(0.5)
        .key("nested")
        .array(1)
        .array(1)
        .nil();
    payload.array(1).str("AllBlocksCleared");
    // AllBlocksCleared with a future medium field.
    payload.array(2).str("AllBlocksCleared").str("GPU");
    payload.uint(0).map(0);

    let batch = decode(payload.bytes());
    assert_eq!(batch.skipped_unknown_events, 2);
    assert_eq!(batch.data_parallel_rank, Some(0));
    let mut expected = stored(&[1], None, &[5], 1);
    expected.medium = gpu();
    expected.group_idx = Some(0);
    expected.kv_cache_spec_kind = Some("full_attention".to_string());
    assert_eq!(
        batch.events,
        vec![
            local(KvEvent::BlockStored(expected)),
            local(KvEvent::AllBlocksCleared(AllBlocksCleared)),
            local(KvEvent::AllBlocksCleared(AllBlocksCleared)),
        ]
    );
}

#[test]
fn sliding_window_groups_are_not_mirrored() {
    let mut payload = Msgpack::default();
    payload.array(2).f64(0.0).array(1);
    payload
        .array(12)
        .str("BlockStored")
        .uints(&[1])
        .nil()
        .uints(&[5])
        .uint(1);
    payload
        .nil()
        .str("GPU")
        .nil()
        .nil()
        .uint(1)
        .str("sliding_window")
        .uint(4096);
    let batch = decode(payload.bytes());
    let KvEvent::BlockStored(first) = &batch.events[0].event else {
        panic!("expected BlockStored");
    };
    assert_eq!(first.kv_cache_spec_sliding_window, Some(4096));
    assert!(!batch.events[0].is_mirrored());
}

/// A one-event batch around `event` (already encoded), and the offset where the event starts.
fn one_event(event: &Msgpack) -> (Vec<u8>, usize) {
    let mut payload = Msgpack::default();
    payload.array(2).f64(0.0).array(1);
    let offset = payload.0.len();
    payload.raw(event.bytes());
    (payload.0, offset)
}

#[test]
fn typed_errors_say_what_and_where() {
    let mut event = Msgpack::default();
    event.array(5).str("BlockStored").uints(&[1]).nil();
    event.array(1).uint(1 << 32).uint(1);
    let (payload, offset) = one_event(&event);
    let token_offset = offset + 1 + 12 + 2 + 1 + 1;
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::OutOfRange {
            offset: token_offset,
            what: "token_ids",
            value: 1 << 32,
        })
    );

    let mut event = Msgpack::default();
    event.array(5).str("BlockStored").uints(&[1]).nil();
    event.array(1).sint(-1).uint(1);
    let (payload, _) = one_event(&event);
    assert!(matches!(
        decode_batch(&payload),
        Err(DecodeError::OutOfRange { value: -1, .. })
    ));

    let mut event = Msgpack::default();
    event.array(3).str("BlockRemoved").uints(&[1]).uint(5);
    let (payload, offset) = one_event(&event);
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::UnexpectedType {
            offset: offset + 1 + 13 + 2,
            what: "medium",
            expected: "str or nil",
            found: "unsigned int",
        })
    );

    let mut event = Msgpack::default();
    event
        .map(2)
        .key("type")
        .str("BlockStored")
        .key("token_ids")
        .uints(&[]);
    let (payload, offset) = one_event(&event);
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::MissingField {
            offset,
            event: "BlockStored",
            field: "block_hashes",
        })
    );

    let mut event = Msgpack::default();
    event.map(1).key("block_hashes").uints(&[1]);
    let (payload, offset) = one_event(&event);
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::MissingTag { offset })
    );

    let (payload, offset) = one_event(Msgpack::default().array(0));
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::MissingTag { offset })
    );

    let mut event = Msgpack::default();
    event.array(2).str("BlockRemoved").array(1).bin(&[]);
    let (payload, _) = one_event(&event);
    assert!(matches!(
        decode_batch(&payload),
        Err(DecodeError::HashLength { len: 0, .. })
    ));

    let mut event = Msgpack::default();
    event.array(2).str("BlockRemoved").array(1).bin(&[7; 65]);
    let (payload, _) = one_event(&event);
    assert!(matches!(
        decode_batch(&payload),
        Err(DecodeError::HashLength { len: 65, .. })
    ));

    let mut event = Msgpack::default();
    event.array(2).str("BlockRemoved").array(1).bin(&[0xaa; 16]);
    let (payload, _) = one_event(&event);
    let removed = &decode(&payload).events[0].event;
    assert_eq!(
        removed,
        &KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![0xaaaa_aaaa_aaaa_aaaa],
            medium: None,
            group_idx: None,
        }),
        "a 16-byte digest maps to its last 8 bytes"
    );

    let mut event = Msgpack::default();
    event.array(2).str("BlockRemoved").raw(&[0x91, 0xa1, b'x']);
    let (payload, _) = one_event(&event);
    assert!(matches!(
        decode_batch(&payload),
        Err(DecodeError::UnexpectedType {
            what: "block_hashes",
            found: "str",
            ..
        })
    ));

    let mut event = Msgpack::default();
    event.array(2).str("BlockRemoved").raw(&[0x91, 0xc1]);
    let (payload, offset) = one_event(&event);
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::ReservedMarker {
            offset: offset + 1 + 13 + 1
        })
    );

    let mut event = Msgpack::default();
    event.array(1).raw(&[0xa2, 0xff, 0xfe]);
    let (payload, offset) = one_event(&event);
    assert_eq!(
        decode_batch(&payload),
        Err(DecodeError::InvalidUtf8 {
            offset: offset + 1,
            what: "event tag",
        })
    );

    let (payload, _) = one_event(Msgpack::default().uint(3));
    assert!(matches!(
        decode_batch(&payload),
        Err(DecodeError::UnexpectedType { what: "event", .. })
    ));

    let mut payload = Msgpack::default();
    payload.array(2).f64(0.0).array(0).uint(1);
    assert_eq!(
        decode_batch(payload.bytes()),
        Err(DecodeError::TrailingBytes {
            offset: 11,
            count: 1
        })
    );
    assert_eq!(
        decode_batch(Msgpack::default().array(1).f64(0.0).bytes()),
        Err(DecodeError::BatchTooShort { offset: 0, len: 1 })
    );
    assert!(matches!(
        decode_batch(Msgpack::default().array(2).str("x").array(0).bytes()),
        Err(DecodeError::UnexpectedType { what: "ts", .. })
    ));
    assert!(matches!(
        decode_batch(&[]),
        Err(DecodeError::Truncated { offset: 0, .. })
    ));
}

#[test]
fn errors_display_their_offset() {
    let message = DecodeError::UnexpectedType {
        offset: 17,
        what: "medium",
        expected: "str or nil",
        found: "unsigned int",
    }
    .to_string();
    assert_eq!(
        message,
        "at byte 17: medium must be str or nil, found unsigned int"
    );
}
