//! vLLM KV-cache event types and their msgpack encoding, byte for byte as vLLM's msgspec
//! encoder writes them, in two layouts selected by [`WireVersion`].
//!
//! vLLM declares the events as `msgspec.Struct(tag=True, omit_defaults=True)` subclasses and the
//! batch as `EventBatch(array_like=True, omit_defaults=True)`: `[ts, events, dp_rank]`.
//! - Up to 0.23 the events are also `array_like`: `[tag, field, ...]` in declaration order with
//!   the trailing fields that equal their default dropped.
//! - From 0.24 the events are maps: `{"type": tag, field: value, ...}` with every field that
//!   equals its default (`None`) omitted.
//!
//! This file only encodes; [`crate::decode`] reads every layout back.

use std::convert::Infallible;

use rmp::encode::{self, ByteBuf, ValueWriteError};

/// The `medium` vLLM reports for blocks in GPU memory.
pub const MEDIUM_GPU: &str = "GPU";

/// The `kv_cache_spec_kind` of a full-attention KV cache group.
pub const KV_CACHE_SPEC_FULL_ATTENTION: &str = "full_attention";

/// Which vLLM release's byte layout to write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WireVersion {
    /// vLLM 0.22: events as tagged arrays, fields up to `kv_cache_spec_sliding_window`.
    V0_22,
    /// vLLM 0.33: events as maps, fields up to `lookahead_token_ids`.
    #[default]
    V0_33,
}

impl WireVersion {
    /// The version as users write it (`--vllm-wire 0.22`).
    pub fn as_str(self) -> &'static str {
        match self {
            WireVersion::V0_22 => "0.22",
            WireVersion::V0_33 => "0.33",
        }
    }

    /// True when the replay socket answers with the topic frame (vLLM 0.26+).
    pub fn replay_has_topic(self) -> bool {
        matches!(self, WireVersion::V0_33)
    }
}

impl std::str::FromStr for WireVersion {
    type Err = UnknownWireVersion;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().trim_start_matches('v') {
            "0.22" | "0.22.0" => Ok(WireVersion::V0_22),
            "0.33" | "0.33.0" => Ok(WireVersion::V0_33),
            other => Err(UnknownWireVersion(other.to_string())),
        }
    }
}

impl std::fmt::Display for WireVersion {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// A `--vllm-wire` value that is not a supported layout.
#[derive(Debug, thiserror::Error)]
#[error("unsupported vLLM wire version {0:?} (supported: 0.22, 0.33)")]
pub struct UnknownWireVersion(pub String);

/// Full blocks became cached: one event may cover several consecutive blocks of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    /// Wire hashes (u64) of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// Wire hash of the block before the first stored one, `None` for a chain's first block.
    pub parent_block_hash: Option<u64>,
    /// Token ids of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA id (vLLM keeps it for compatibility).
    pub lora_id: Option<u64>,
    /// Where the blocks live: `Some("GPU")` for vLLM's GPU cache.
    pub medium: Option<String>,
    /// LoRA adapter name, when the blocks belong to one.
    pub lora_name: Option<String>,
    /// What vLLM hashed into each block besides its tokens (0.17+): per block `None` or its
    /// keys. vLLM puts the LoRA name in every block's and the request's `cache_salt` in the
    /// first block's, as bare strings; multimodal and prompt-embeds keys are other types.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV cache group index (0 for a model with one full-attention group).
    pub group_idx: Option<u32>,
    /// KV cache spec kind of the group, e.g. `full_attention`.
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding window of the group's spec, for sliding-window groups.
    pub kv_cache_spec_sliding_window: Option<u32>,
}

/// One of a block's extra keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string key: a LoRA name or a cache salt.
    Str(String),
    /// Any other key (a multimodal identifier and offset, a prompt-embeds digest), not
    /// interpreted; written as nil.
    Other,
}

/// Cached blocks were evicted (vLLM emits one hash per event when a free cached block is reused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRemoved {
    /// Wire hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Where the blocks lived: `Some("GPU")`.
    pub medium: Option<String>,
    /// KV cache group index.
    pub group_idx: Option<u32>,
}

/// The whole prefix cache was dropped (vLLM emits it only on `reset_prefix_cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllBlocksCleared;

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// See [`BlockStored`].
    BlockStored(BlockStored),
    /// See [`BlockRemoved`].
    BlockRemoved(BlockRemoved),
    /// See [`AllBlocksCleared`].
    AllBlocksCleared(AllBlocksCleared),
}

impl KvEvent {
    /// The msgspec tag: the class name.
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared(_) => "AllBlocksCleared",
        }
    }
}

/// The events of one scheduler step, as one published message.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// Wall-clock time of publication, UNIX seconds.
    pub ts: f64,
    /// The events, in the order they happened.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine (vLLM's publisher fills in its rank).
    pub data_parallel_rank: Option<u32>,
}

/// Encodes a batch as the msgpack payload vLLM `version` publishes.
pub fn encode_batch(batch: &EventBatch, version: WireVersion) -> Vec<u8> {
    let mut out = ByteBuf::with_capacity(64 + 32 * batch.events.len());
    // EventBatch is array_like with omit_defaults: a None rank (the default) is dropped.
    let batch_len = if batch.data_parallel_rank.is_some() {
        3
    } else {
        2
    };
    written(encode::write_array_len(&mut out, batch_len));
    written(encode::write_f64(&mut out, batch.ts));
    written(encode::write_array_len(
        &mut out,
        len_u32(batch.events.len()),
    ));
    for event in &batch.events {
        encode_event(&mut out, event, version);
    }
    if let Some(rank) = batch.data_parallel_rank {
        written(encode::write_uint(&mut out, u64::from(rank)));
    }
    out.into_vec()
}

/// A field value as msgspec sees it.
enum FieldValue<'a> {
    Hashes(&'a [u64]),
    Tokens(&'a [u32]),
    Uint(u64),
    OptionalUint(Option<u64>),
    OptionalStr(Option<&'a str>),
    ExtraKeys(Option<&'a [Option<Vec<ExtraKey>>]>),
}

impl FieldValue<'_> {
    fn is_none(&self) -> bool {
        matches!(
            self,
            FieldValue::OptionalUint(None)
                | FieldValue::OptionalStr(None)
                | FieldValue::ExtraKeys(None)
        )
    }
}

/// One struct field: its name, value and whether it is declared with the default `None`.
struct Field<'a> {
    name: &'static str,
    value: FieldValue<'a>,
    defaults_to_none: bool,
}

impl<'a> Field<'a> {
    fn required(name: &'static str, value: FieldValue<'a>) -> Self {
        Field {
            name,
            value,
            defaults_to_none: false,
        }
    }

    fn optional(name: &'static str, value: FieldValue<'a>) -> Self {
        Field {
            name,
            value,
            defaults_to_none: true,
        }
    }

    /// msgspec's `omit_defaults` leaves this field out (maps) or may drop it (array tails).
    fn is_default(&self) -> bool {
        self.defaults_to_none && self.value.is_none()
    }
}

/// The declared fields of `event` in `version`, in declaration order.
fn event_fields(event: &KvEvent, version: WireVersion) -> Vec<Field<'_>> {
    let mut fields = Vec::with_capacity(16);
    match event {
        KvEvent::BlockStored(stored) => {
            fields.push(Field::required(
                "block_hashes",
                FieldValue::Hashes(&stored.block_hashes),
            ));
            fields.push(Field::required(
                "parent_block_hash",
                FieldValue::OptionalUint(stored.parent_block_hash),
            ));
            fields.push(Field::required(
                "token_ids",
                FieldValue::Tokens(&stored.token_ids),
            ));
            fields.push(Field::required(
                "block_size",
                FieldValue::Uint(u64::from(stored.block_size)),
            ));
            fields.push(Field::required(
                "lora_id",
                FieldValue::OptionalUint(stored.lora_id),
            ));
            fields.push(Field::required(
                "medium",
                FieldValue::OptionalStr(stored.medium.as_deref()),
            ));
            fields.push(Field::required(
                "lora_name",
                FieldValue::OptionalStr(stored.lora_name.as_deref()),
            ));
            fields.push(Field::optional(
                "extra_keys",
                FieldValue::ExtraKeys(stored.extra_keys.as_deref()),
            ));
            fields.push(Field::optional(
                "group_idx",
                FieldValue::OptionalUint(stored.group_idx.map(u64::from)),
            ));
            fields.push(Field::optional(
                "kv_cache_spec_kind",
                FieldValue::OptionalStr(stored.kv_cache_spec_kind.as_deref()),
            ));
            fields.push(Field::optional(
                "kv_cache_spec_sliding_window",
                FieldValue::OptionalUint(stored.kv_cache_spec_sliding_window.map(u64::from)),
            ));
            if version == WireVersion::V0_33 {
                // 0.26 locality, 0.30 ownership and session_id, 0.33 lookahead_token_ids: all
                // None for blocks computed locally on the GPU, so never on the wire.
                for name in ["locality", "ownership", "session_id", "lookahead_token_ids"] {
                    fields.push(Field::optional(name, FieldValue::OptionalUint(None)));
                }
            }
        }
        KvEvent::BlockRemoved(removed) => {
            fields.push(Field::required(
                "block_hashes",
                FieldValue::Hashes(&removed.block_hashes),
            ));
            fields.push(Field::required(
                "medium",
                FieldValue::OptionalStr(removed.medium.as_deref()),
            ));
            fields.push(Field::optional(
                "group_idx",
                FieldValue::OptionalUint(removed.group_idx.map(u64::from)),
            ));
            if version == WireVersion::V0_33 {
                for name in ["locality", "ownership"] {
                    fields.push(Field::optional(name, FieldValue::OptionalUint(None)));
                }
            }
        }
        KvEvent::AllBlocksCleared(AllBlocksCleared) => {}
    }
    fields
}

fn encode_event(out: &mut ByteBuf, event: &KvEvent, version: WireVersion) {
    let fields = event_fields(event, version);
    match version {
        WireVersion::V0_22 => {
            // array_like + omit_defaults: trailing default fields are dropped, inner ones kept.
            let kept = fields
                .iter()
                .rposition(|field| !field.is_default())
                .map_or(0, |last| last + 1);
            written(encode::write_array_len(out, len_u32(kept + 1)));
            written(encode::write_str(out, event.tag()));
            for field in &fields[..kept] {
                encode_value(out, &field.value);
            }
        }
        WireVersion::V0_33 => {
            let present: Vec<&Field<'_>> = fields.iter().filter(|f| !f.is_default()).collect();
            written(encode::write_map_len(out, len_u32(present.len() + 1)));
            written(encode::write_str(out, "type"));
            written(encode::write_str(out, event.tag()));
            for field in present {
                written(encode::write_str(out, field.name));
                encode_value(out, &field.value);
            }
        }
    }
}

fn encode_value(out: &mut ByteBuf, value: &FieldValue<'_>) {
    match value {
        FieldValue::Hashes(hashes) => {
            written(encode::write_array_len(out, len_u32(hashes.len())));
            for &hash in hashes.iter() {
                written(encode::write_uint(out, hash));
            }
        }
        FieldValue::Tokens(tokens) => {
            written(encode::write_array_len(out, len_u32(tokens.len())));
            for &token in tokens.iter() {
                written(encode::write_uint(out, u64::from(token)));
            }
        }
        FieldValue::Uint(number) | FieldValue::OptionalUint(Some(number)) => {
            written(encode::write_uint(out, *number));
        }
        FieldValue::OptionalStr(Some(text)) => written(encode::write_str(out, text)),
        FieldValue::ExtraKeys(Some(blocks)) => {
            written(encode::write_array_len(out, len_u32(blocks.len())));
            for block in blocks.iter() {
                let Some(keys) = block else {
                    infallible(encode::write_nil(out));
                    continue;
                };
                written(encode::write_array_len(out, len_u32(keys.len())));
                for key in keys {
                    match key {
                        ExtraKey::Str(text) => written(encode::write_str(out, text)),
                        ExtraKey::Other => infallible(encode::write_nil(out)),
                    }
                }
            }
        }
        FieldValue::OptionalUint(None)
        | FieldValue::OptionalStr(None)
        | FieldValue::ExtraKeys(None) => {
            infallible(encode::write_nil(out));
        }
    }
}

/// Lengths beyond u32 cannot occur for one scheduler step's events; saturate rather than panic.
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Writes into a `ByteBuf` cannot fail (its error type is `Infallible`).
fn written<T>(result: Result<T, ValueWriteError<Infallible>>) {
    match result {
        Ok(_) => {}
        Err(
            ValueWriteError::InvalidMarkerWrite(never) | ValueWriteError::InvalidDataWrite(never),
        ) => match never {},
    }
}

fn infallible(result: Result<(), Infallible>) {
    match result {
        Ok(()) => {}
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored_example() -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![0x9f3a_1c5e_7b2d_4f60, 0x0123_4567_89ab_cdef],
            parent_block_hash: None,
            token_ids: (1..=8).collect(),
            block_size: 4,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_string()),
            lora_name: None,
            extra_keys: None,
            group_idx: Some(0),
            kv_cache_spec_kind: Some(KV_CACHE_SPEC_FULL_ATTENTION.to_string()),
            kv_cache_spec_sliding_window: None,
        })
    }

    fn removed_example() -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![0x9f3a_1c5e_7b2d_4f60],
            medium: Some(MEDIUM_GPU.to_string()),
            group_idx: Some(0),
        })
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 1_700_000_000.5,
            events,
            data_parallel_rank: Some(0),
        }
    }

    fn str_bytes(out: &mut Vec<u8>, text: &str) {
        assert!(text.len() < 32);
        out.push(0xa0 | text.len() as u8);
        out.extend_from_slice(text.as_bytes());
    }

    fn hash_bytes(out: &mut Vec<u8>) {
        out.extend_from_slice(&[0x92, 0xcf, 0x9f, 0x3a, 0x1c, 0x5e, 0x7b, 0x2d, 0x4f, 0x60]);
        out.extend_from_slice(&[0xcf, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef]);
    }

    fn batch_head() -> Vec<u8> {
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1_700_000_000.5f64.to_be_bytes());
        expected
    }

    #[test]
    fn v0_33_block_stored_is_a_map_without_none_defaults() {
        // The reference layout for 0.24+ from docs/simulator.md ("vLLM's KV-event wire format").
        let mut expected = batch_head();
        expected.push(0x91);
        expected.push(0x8a);
        str_bytes(&mut expected, "type");
        str_bytes(&mut expected, "BlockStored");
        str_bytes(&mut expected, "block_hashes");
        hash_bytes(&mut expected);
        str_bytes(&mut expected, "parent_block_hash");
        expected.push(0xc0);
        str_bytes(&mut expected, "token_ids");
        expected.extend_from_slice(&[0x98, 1, 2, 3, 4, 5, 6, 7, 8]);
        str_bytes(&mut expected, "block_size");
        expected.push(0x04);
        str_bytes(&mut expected, "lora_id");
        expected.push(0xc0);
        str_bytes(&mut expected, "medium");
        str_bytes(&mut expected, "GPU");
        str_bytes(&mut expected, "lora_name");
        expected.push(0xc0);
        str_bytes(&mut expected, "group_idx");
        expected.push(0x00);
        str_bytes(&mut expected, "kv_cache_spec_kind");
        str_bytes(&mut expected, "full_attention");
        expected.push(0x00);
        let encoded = encode_batch(&batch(vec![stored_example()]), WireVersion::V0_33);
        assert_eq!(encoded, expected);
    }

    #[test]
    fn v0_22_block_stored_is_an_array_keeping_inner_defaults() {
        // extra_keys (None) sits before group_idx so it stays; the sliding window is dropped.
        let mut expected = batch_head();
        expected.push(0x91);
        expected.push(0x9b);
        str_bytes(&mut expected, "BlockStored");
        hash_bytes(&mut expected);
        expected.push(0xc0);
        expected.extend_from_slice(&[0x98, 1, 2, 3, 4, 5, 6, 7, 8]);
        expected.push(0x04);
        expected.push(0xc0);
        str_bytes(&mut expected, "GPU");
        expected.push(0xc0);
        expected.push(0xc0);
        expected.push(0x00);
        str_bytes(&mut expected, "full_attention");
        expected.push(0x00);
        let encoded = encode_batch(&batch(vec![stored_example()]), WireVersion::V0_22);
        assert_eq!(encoded, expected);
    }

    #[test]
    fn block_removed_and_cleared_in_both_layouts() {
        let events = vec![
            removed_example(),
            KvEvent::AllBlocksCleared(AllBlocksCleared),
        ];
        let mut expected = batch_head();
        expected.push(0x92);
        expected.push(0x94);
        str_bytes(&mut expected, "BlockRemoved");
        expected.extend_from_slice(&[0x91, 0xcf, 0x9f, 0x3a, 0x1c, 0x5e, 0x7b, 0x2d, 0x4f, 0x60]);
        str_bytes(&mut expected, "GPU");
        expected.push(0x00);
        expected.push(0x91);
        str_bytes(&mut expected, "AllBlocksCleared");
        expected.push(0x00);
        assert_eq!(
            encode_batch(&batch(events.clone()), WireVersion::V0_22),
            expected
        );

        let mut expected = batch_head();
        expected.push(0x92);
        expected.push(0x84);
        str_bytes(&mut expected, "type");
        str_bytes(&mut expected, "BlockRemoved");
        str_bytes(&mut expected, "block_hashes");
        expected.extend_from_slice(&[0x91, 0xcf, 0x9f, 0x3a, 0x1c, 0x5e, 0x7b, 0x2d, 0x4f, 0x60]);
        str_bytes(&mut expected, "medium");
        str_bytes(&mut expected, "GPU");
        str_bytes(&mut expected, "group_idx");
        expected.push(0x00);
        expected.push(0x81);
        str_bytes(&mut expected, "type");
        str_bytes(&mut expected, "AllBlocksCleared");
        expected.push(0x00);
        assert_eq!(encode_batch(&batch(events), WireVersion::V0_33), expected);
    }

    #[test]
    fn v0_22_drops_trailing_defaults_only() {
        // Without group_idx and spec kind, everything after lora_name is a default: 8 elements.
        let event = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![7],
            parent_block_hash: Some(3),
            token_ids: vec![300],
            block_size: 1,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_string()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        });
        let encoded = encode_batch(
            &EventBatch {
                ts: 0.0,
                events: vec![event],
                data_parallel_rank: None,
            },
            WireVersion::V0_22,
        );
        let mut expected = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x98];
        str_bytes(&mut expected, "BlockStored");
        expected.extend_from_slice(&[0x91, 0x07, 0x03, 0x91, 0xcd, 0x01, 0x2c, 0x01, 0xc0]);
        str_bytes(&mut expected, "GPU");
        expected.push(0xc0);
        assert_eq!(encoded, expected);
    }

    #[test]
    fn wire_versions_parse() {
        assert_eq!("0.22".parse::<WireVersion>().ok(), Some(WireVersion::V0_22));
        assert_eq!("0.33".parse::<WireVersion>().ok(), Some(WireVersion::V0_33));
        assert!("0.9".parse::<WireVersion>().is_err());
    }
}
