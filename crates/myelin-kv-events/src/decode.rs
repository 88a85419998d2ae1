//! Decoder of vLLM KV-cache event batches in every layout vLLM 0.9.0 to 0.33 publishes, and of
//! the ZMQ frames (live PUB messages, replay replies) that carry them. Untrusted bytes in, typed
//! events or a typed error out; no sockets, no clocks (the subscriber lives elsewhere).
//!
//! # Layouts
//! A payload is one msgpack `EventBatch` array `[ts, events, data_parallel_rank]`:
//! - `ts`: float64 as vLLM writes it; float32 and any integer are accepted too.
//! - `data_parallel_rank`: int or nil; absent before vLLM 0.9.1 and whenever it is `None`
//!   (msgspec drops a trailing default). Elements after the third (a future vLLM) are skipped.
//!
//! Each event is detected on its own, by its msgpack type:
//! - vLLM 0.9.0 to 0.23: a tagged ARRAY `[tag, field, ...]` in declaration order, any prefix of
//!   the field list (msgspec drops trailing fields equal to their default).
//! - vLLM 0.24+: a MAP `{"type": tag, field: value, ...}` (fix/16/32 headers), `None`-default
//!   fields omitted. The `"type"` key is found wherever it sits.
//!
//! Field order (each version appends): `BlockStored` = `block_hashes, parent_block_hash,
//! token_ids, block_size, lora_id` (0.9.0), `medium` (0.10.2), `lora_name` (0.14), `extra_keys`
//! (0.17), `group_idx` (0.20), `kv_cache_spec_kind, kv_cache_spec_sliding_window` (0.22),
//! `locality` (0.26), `ownership, session_id` (0.30), `lookahead_token_ids` (0.33).
//! `BlockRemoved` = `block_hashes` (0.9.0), `medium` (0.10.2), `group_idx` (0.20), `locality`
//! (0.26), `ownership` (0.30). `AllBlocksCleared` has no fields.
//!
//! # Tolerance rules
//! - Unknown event tags are skipped (their body is walked, not interpreted) and counted in
//!   [`DecodedBatch::skipped_unknown_events`]: a newer vLLM may add event kinds.
//! - Array fields past the last known one and map keys we do not know are skipped, whatever
//!   their msgpack type. Fields we know but do not use (`ownership`, `session_id`,
//!   `lookahead_token_ids`) are skipped the same way, so their type may change freely.
//!   `extra_keys` (per block: nil or a list of keys; vLLM puts the LoRA name and, on a
//!   chain's first block, the request's `cache_salt` there as bare strings) keeps its string
//!   keys; any other key, or a value of another shape, is kept as [`ExtraKey::Other`].
//! - Fields we use must have the type vLLM declares (nil allowed where vLLM allows `None`);
//!   anything else is an error naming the field and the byte offset.
//! - `block_hashes`, `token_ids` and `block_size` of `BlockStored` and `block_hashes` of
//!   `BlockRemoved` are required (vLLM never omits them); a missing optional field is `None`.
//! - Block hashes: any msgpack integer; a negative one (vLLM 0.9.0 to 0.10.1 sent Python's
//!   signed 64-bit `hash()`) becomes its two's-complement `u64`. A `bin` (vLLM with
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends the raw digest) becomes the integer vLLM
//!   would have sent: its last 8 bytes (fewer if shorter) big-endian, so a 32-byte sha256
//!   digest maps to [`crate::BlockHash::wire_u64`] and a 16-byte xxh3-128 digest to its low
//!   half. An empty `bin` or one longer than [`MAX_HASH_BIN_BYTES`] is an error.
//! - Token ids must fit in `u32`; other integer fields must fit their Rust type.
//! - Bytes after the batch are an error (msgspec rejects them too).
//!
//! # Safety against hostile bytes
//! Never panics. A declared array, map, string or binary length is checked against the bytes
//! that remain before anything is allocated or walked (every msgpack value takes at least one
//! byte), so a header claiming 2^32 elements in a 10-byte payload fails at once. Vectors reserve
//! at most [`MAX_PREALLOCATED_ELEMENTS`] up front, so memory follows what is actually decoded,
//! not what headers claim. Skipped values nest at most [`MAX_SKIP_DEPTH`] deep. Decoding time is
//! linear in the payload length.
//!
//! # Filter rules for a residency mirror
//! [`DecodedEvent::is_mirrored`] keeps what describes the local GPU prefix cache of the main
//! attention group: `medium` is `"GPU"` or absent (absent before 0.10.2), `kv_cache_spec_kind`
//! is `"full_attention"` or absent (absent before 0.22), and `locality` is not `"REMOTE"`
//! (0.26+: blocks held by another instance). A `BlockRemoved` carries only `group_idx`, so
//! [`MirrorFilter`] learns each group's kind from the `BlockStored` events of the same publisher
//! and drops removals from groups known not to be full attention (hybrid models reuse the same
//! block hash in every group).

use crate::wire::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ExtraKey,
    KV_CACHE_SPEC_FULL_ATTENTION, KvEvent, MEDIUM_GPU,
};

/// Deepest nesting of arrays and maps accepted inside a skipped value.
pub const MAX_SKIP_DEPTH: usize = 32;

/// Longest `bin` block hash accepted (a sha512 digest would be 64 bytes).
pub const MAX_HASH_BIN_BYTES: usize = 64;

/// Most elements reserved up front for a decoded array, however many its header declares: a
/// header is checked against the remaining bytes, but one byte of payload can declare an
/// element that takes 200 bytes decoded, so larger vectors grow as their elements arrive.
pub const MAX_PREALLOCATED_ELEMENTS: usize = 256;

/// The sequence number of the replay socket's end-of-replay marker (`-1` as 8 bytes).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// The `locality` of blocks that another instance holds (vLLM 0.26+).
pub const LOCALITY_REMOTE: &str = "REMOTE";

/// Why a payload or a multipart message could not be decoded. Offsets are byte offsets into
/// the msgpack payload.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload ends inside a value.
    #[error("payload ends at byte {offset} inside {what}")]
    Truncated {
        /// Where the missing bytes should start.
        offset: usize,
        /// What was being read.
        what: &'static str,
    },
    /// A value has another msgpack type than the field needs.
    #[error("at byte {offset}: {what} must be {expected}, found {found}")]
    UnexpectedType {
        /// Where the value starts.
        offset: usize,
        /// What was being read.
        what: &'static str,
        /// The msgpack types accepted there.
        expected: &'static str,
        /// The msgpack type found.
        found: &'static str,
    },
    /// An array or map header declares more elements than the remaining bytes can hold.
    #[error(
        "at byte {offset}: {what} declares {declared} elements but only {remaining} bytes remain"
    )]
    LengthExceedsPayload {
        /// Where the header starts.
        offset: usize,
        /// What was being read.
        what: &'static str,
        /// Elements (map: entries) the header declares.
        declared: u64,
        /// Bytes left after the header.
        remaining: usize,
    },
    /// An integer does not fit the field.
    #[error("at byte {offset}: {what} value {value} is out of range")]
    OutOfRange {
        /// Where the value starts.
        offset: usize,
        /// What was being read.
        what: &'static str,
        /// The value found.
        value: i128,
    },
    /// A `bin` block hash has a length no vLLM hash function produces.
    #[error(
        "at byte {offset}: block hash bin of {len} bytes (accepted: 1 to {MAX_HASH_BIN_BYTES})"
    )]
    HashLength {
        /// Where the value starts.
        offset: usize,
        /// Its length in bytes.
        len: usize,
    },
    /// A string is not UTF-8.
    #[error("at byte {offset}: {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// Where the string starts.
        offset: usize,
        /// What was being read.
        what: &'static str,
    },
    /// The reserved msgpack marker 0xc1.
    #[error("at byte {offset}: reserved msgpack marker 0xc1")]
    ReservedMarker {
        /// Where the marker is.
        offset: usize,
    },
    /// A skipped value nests arrays or maps deeper than [`MAX_SKIP_DEPTH`].
    #[error("at byte {offset}: values nested deeper than {MAX_SKIP_DEPTH} levels")]
    TooDeep {
        /// Where the too-deep value starts.
        offset: usize,
    },
    /// The batch array has fewer than its two required elements.
    #[error("at byte {offset}: event batch has {len} elements (needs ts and events)")]
    BatchTooShort {
        /// Where the batch starts.
        offset: usize,
        /// Elements found.
        len: usize,
    },
    /// An event has no `type` tag (empty array, or a map without a `"type"` key).
    #[error("at byte {offset}: event has no type tag")]
    MissingTag {
        /// Where the event starts.
        offset: usize,
    },
    /// An event lacks a field vLLM always sends.
    #[error("at byte {offset}: {event} lacks its {field} field")]
    MissingField {
        /// Where the event starts.
        offset: usize,
        /// The event's tag.
        event: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// Bytes follow the batch.
    #[error("{count} unexpected bytes after the event batch at byte {offset}")]
    TrailingBytes {
        /// Where the extra bytes start.
        offset: usize,
        /// How many there are.
        count: usize,
    },
    /// A multipart message has the wrong number of frames.
    #[error("{message} has {got} frames (expected {expected})")]
    FrameCount {
        /// Which message shape was expected.
        message: &'static str,
        /// The frame counts accepted.
        expected: &'static str,
        /// Frames received.
        got: usize,
    },
    /// The sequence-number frame is not 8 bytes.
    #[error("sequence frame has {len} bytes (expected 8, big-endian u64)")]
    SequenceLength {
        /// Its length.
        len: usize,
    },
    /// A replay reply does not start with the empty delimiter frame.
    #[error("replay reply starts with a {len}-byte frame (expected the empty delimiter)")]
    ReplayDelimiter {
        /// The first frame's length.
        len: usize,
    },
}

/// One decoded event with the context a mirror needs to filter it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedEvent {
    /// The event.
    pub event: KvEvent,
    /// `locality` (vLLM 0.26+): `Some("REMOTE")` for blocks held by another instance, `None`
    /// when unspecified (local). Always `None` for `AllBlocksCleared`.
    pub locality: Option<String>,
}

impl DecodedEvent {
    /// True when the event describes blocks held by another instance.
    pub fn is_remote(&self) -> bool {
        self.locality
            .as_deref()
            .is_some_and(|locality| locality.eq_ignore_ascii_case(LOCALITY_REMOTE))
    }

    /// True when a mirror of this engine's GPU prefix cache (main attention group) applies the
    /// event; see the module docs. Removals need [`MirrorFilter`] for the group rule.
    pub fn is_mirrored(&self) -> bool {
        if self.is_remote() {
            return false;
        }
        match &self.event {
            KvEvent::BlockStored(stored) => is_mirrored_stored(stored),
            KvEvent::BlockRemoved(removed) => is_mirrored_removed(removed),
            KvEvent::AllBlocksCleared(AllBlocksCleared) => true,
        }
    }
}

/// True for blocks in GPU memory: `medium` `"GPU"`, or absent (vLLM before 0.10.2).
pub fn is_mirrored_medium(medium: Option<&str>) -> bool {
    medium.is_none_or(|medium| medium == MEDIUM_GPU)
}

/// True for the main attention group: `kv_cache_spec_kind` `"full_attention"`, or absent
/// (vLLM before 0.22, or a publisher that does not say).
pub fn is_main_attention_group(kv_cache_spec_kind: Option<&str>) -> bool {
    kv_cache_spec_kind.is_none_or(|kind| kind == KV_CACHE_SPEC_FULL_ATTENTION)
}

/// True when a GPU prefix-cache mirror applies this store (medium and group rules; locality is
/// on [`DecodedEvent`]).
pub fn is_mirrored_stored(stored: &BlockStored) -> bool {
    is_mirrored_medium(stored.medium.as_deref())
        && is_main_attention_group(stored.kv_cache_spec_kind.as_deref())
}

/// True when a GPU prefix-cache mirror applies this removal by its medium alone (the group
/// rule needs what [`MirrorFilter`] learns from stores).
pub fn is_mirrored_removed(removed: &BlockRemoved) -> bool {
    is_mirrored_medium(removed.medium.as_deref())
}

/// Per-publisher filter that also applies the group rule to removals: it remembers which
/// `group_idx` values stores declared with a kind other than full attention. Feed it every
/// decoded event of one publisher (one data-parallel rank), in order.
#[derive(Clone, Debug, Default)]
pub struct MirrorFilter {
    /// Groups whose stores carry a `kv_cache_spec_kind` other than full attention (a model has
    /// a handful of groups, so a vector beats a map).
    other_kind_groups: Vec<u32>,
}

impl MirrorFilter {
    /// True when the mirror applies `event`; learns group kinds from stores as a side effect.
    pub fn accepts(&mut self, event: &DecodedEvent) -> bool {
        match &event.event {
            KvEvent::BlockStored(stored) => {
                if let (Some(group), Some(kind)) =
                    (stored.group_idx, stored.kv_cache_spec_kind.as_deref())
                {
                    let known = self.other_kind_groups.iter().position(|&g| g == group);
                    match (is_main_attention_group(Some(kind)), known) {
                        (false, None) => self.other_kind_groups.push(group),
                        (true, Some(index)) => {
                            self.other_kind_groups.swap_remove(index);
                        }
                        _ => {}
                    }
                }
                event.is_mirrored()
            }
            KvEvent::BlockRemoved(removed) => {
                event.is_mirrored()
                    && removed
                        .group_idx
                        .is_none_or(|group| !self.other_kind_groups.contains(&group))
            }
            KvEvent::AllBlocksCleared(AllBlocksCleared) => event.is_mirrored(),
        }
    }
}

/// One decoded `EventBatch`.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// Publication time, UNIX seconds.
    pub ts: f64,
    /// The known events, in order (unknown tags left out).
    pub events: Vec<DecodedEvent>,
    /// Data-parallel rank of the publisher, when sent.
    pub data_parallel_rank: Option<u32>,
    /// Events with a tag this decoder does not know (a newer vLLM), skipped.
    pub skipped_unknown_events: usize,
}

impl DecodedBatch {
    /// The batch without the per-event context (locality), in the encoder's type.
    pub fn into_event_batch(self) -> EventBatch {
        EventBatch {
            ts: self.ts,
            events: self
                .events
                .into_iter()
                .map(|decoded| decoded.event)
                .collect(),
            data_parallel_rank: self.data_parallel_rank,
        }
    }
}

/// Decodes one msgpack `EventBatch` payload of any vLLM version (see the module docs).
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut reader = Reader::new(payload);
    let batch_offset = reader.offset;
    let batch_len = reader.array_len("event batch")?;
    if batch_len < 2 {
        return Err(DecodeError::BatchTooShort {
            offset: batch_offset,
            len: batch_len,
        });
    }
    let ts = reader.timestamp()?;
    let event_count = reader.array_len("events array")?;
    let mut events = Vec::with_capacity(event_count.min(MAX_PREALLOCATED_ELEMENTS));
    let mut skipped_unknown_events = 0;
    for _ in 0..event_count {
        match decode_event(&mut reader)? {
            Some(event) => events.push(event),
            None => skipped_unknown_events += 1,
        }
    }
    let data_parallel_rank = if batch_len >= 3 {
        reader.optional_u32("data_parallel_rank")?
    } else {
        None
    };
    for _ in 3..batch_len {
        reader.skip_value(0)?;
    }
    if reader.remaining() > 0 {
        return Err(DecodeError::TrailingBytes {
            offset: reader.offset,
            count: reader.remaining(),
        });
    }
    Ok(DecodedBatch {
        ts,
        events,
        data_parallel_rank,
        skipped_unknown_events,
    })
}

/// A live message from the engine's PUB socket.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveMessage {
    /// The topic frame (empty by default in vLLM).
    pub topic: Vec<u8>,
    /// The publisher's sequence number (from 0 per engine process; gaps mean drops).
    pub seq: u64,
    /// The decoded payload.
    pub batch: DecodedBatch,
}

/// Decodes a live PUB message: frames `[topic, seq (8 bytes big-endian), payload]`.
pub fn decode_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<LiveMessage, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount {
            message: "live KV-event message",
            expected: "3",
            got: frames.len(),
        });
    };
    Ok(LiveMessage {
        topic: topic.as_ref().to_vec(),
        seq: sequence(seq.as_ref())?,
        batch: decode_batch(payload.as_ref())?,
    })
}

/// One reply from the engine's replay (ROUTER) socket, as a DEALER receives it.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplayFrame {
    /// A buffered batch.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The decoded payload.
        batch: DecodedBatch,
    },
    /// The end-of-replay marker: every buffered batch from the requested one has been sent.
    End,
}

/// Decodes a replay reply received on a DEALER: `["", seq, payload]` (vLLM up to 0.25) or
/// `["", topic, seq, payload]` (0.26+). A sequence number of [`REPLAY_END_SEQ`] is the end
/// marker; its payload (empty in every vLLM) is ignored.
pub fn decode_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayFrame, DecodeError> {
    let (delimiter, seq, payload) = match frames {
        [delimiter, seq, payload] | [delimiter, _, seq, payload] => (delimiter, seq, payload),
        _ => {
            return Err(DecodeError::FrameCount {
                message: "KV-event replay reply",
                expected: "3 or 4",
                got: frames.len(),
            });
        }
    };
    if !delimiter.as_ref().is_empty() {
        return Err(DecodeError::ReplayDelimiter {
            len: delimiter.as_ref().len(),
        });
    }
    let seq = sequence(seq.as_ref())?;
    if seq == REPLAY_END_SEQ {
        return Ok(ReplayFrame::End);
    }
    Ok(ReplayFrame::Batch {
        seq,
        batch: decode_batch(payload.as_ref())?,
    })
}

/// The frames a DEALER sends to ask the replay socket for every buffered batch with a sequence
/// number at or after `start_seq`: the empty delimiter and the 8-byte big-endian number.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

fn sequence(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SequenceLength { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// The event kinds this decoder knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventKind {
    Stored,
    Removed,
    Cleared,
}

impl EventKind {
    fn from_tag(tag: &str) -> Option<EventKind> {
        match tag {
            "BlockStored" => Some(EventKind::Stored),
            "BlockRemoved" => Some(EventKind::Removed),
            "AllBlocksCleared" => Some(EventKind::Cleared),
            _ => None,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            EventKind::Stored => "BlockStored",
            EventKind::Removed => "BlockRemoved",
            EventKind::Cleared => "AllBlocksCleared",
        }
    }

    /// The fields of the array layout, in declaration order (later versions append).
    fn array_fields(self) -> &'static [Field] {
        match self {
            EventKind::Stored => &STORED_FIELDS,
            EventKind::Removed => &REMOVED_FIELDS,
            EventKind::Cleared => &[],
        }
    }

    /// The field a map key names, for this event kind.
    fn map_field(self, key: &str) -> Field {
        let field = match key {
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::ParentBlockHash,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "lora_id" => Field::LoraId,
            "medium" => Field::Medium,
            "lora_name" => Field::LoraName,
            "extra_keys" => Field::ExtraKeys,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::KvCacheSpecKind,
            "kv_cache_spec_sliding_window" => Field::KvCacheSpecSlidingWindow,
            "locality" => Field::Locality,
            _ => return Field::Unused,
        };
        // A key of another event kind (say `token_ids` in a removal) is not ours to read.
        if self.array_fields().contains(&field) {
            field
        } else {
            Field::Unused
        }
    }
}

/// What the decoder does with one field's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    /// A known field the mirror does not need; skipped whatever its type.
    Ignored,
    /// A field this decoder does not know (a newer vLLM); skipped.
    Unused,
}

const STORED_FIELDS: [Field; 15] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
    Field::KvCacheSpecSlidingWindow,
    Field::Locality,
    Field::Ignored, // ownership
    Field::Ignored, // session_id
    Field::Ignored, // lookahead_token_ids
];

const REMOVED_FIELDS: [Field; 5] = [
    Field::BlockHashes,
    Field::Medium,
    Field::GroupIdx,
    Field::Locality,
    Field::Ignored, // ownership
];

/// The fields of one event as they are read, in any order.
#[derive(Default)]
struct EventFields {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<u64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    kv_cache_spec_sliding_window: Option<u32>,
    locality: Option<String>,
}

impl EventFields {
    fn read(&mut self, reader: &mut Reader<'_>, field: Field) -> Result<(), DecodeError> {
        match field {
            Field::BlockHashes => self.block_hashes = Some(reader.hashes("block_hashes")?),
            Field::ParentBlockHash => {
                self.parent_block_hash = reader.optional_hash("parent_block_hash")?;
            }
            Field::TokenIds => self.token_ids = Some(reader.token_ids("token_ids")?),
            Field::BlockSize => self.block_size = Some(reader.u32("block_size")?),
            Field::LoraId => self.lora_id = reader.optional_u64("lora_id")?,
            Field::Medium => self.medium = reader.optional_string("medium")?,
            Field::LoraName => self.lora_name = reader.optional_string("lora_name")?,
            Field::ExtraKeys => self.extra_keys = reader.extra_keys()?,
            Field::GroupIdx => self.group_idx = reader.optional_u32("group_idx")?,
            Field::KvCacheSpecKind => {
                self.kv_cache_spec_kind = reader.optional_string("kv_cache_spec_kind")?;
            }
            Field::KvCacheSpecSlidingWindow => {
                self.kv_cache_spec_sliding_window =
                    reader.optional_u32("kv_cache_spec_sliding_window")?;
            }
            Field::Locality => self.locality = reader.optional_string("locality")?,
            Field::Ignored | Field::Unused => reader.skip_value(0)?,
        }
        Ok(())
    }

    fn finish(self, kind: EventKind, event_offset: usize) -> Result<DecodedEvent, DecodeError> {
        let missing = |field: &'static str| DecodeError::MissingField {
            offset: event_offset,
            event: kind.tag(),
            field,
        };
        let event = match kind {
            EventKind::Stored => KvEvent::BlockStored(BlockStored {
                block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.ok_or_else(|| missing("token_ids"))?,
                block_size: self.block_size.ok_or_else(|| missing("block_size"))?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window,
            }),
            EventKind::Removed => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
            }),
            EventKind::Cleared => KvEvent::AllBlocksCleared(AllBlocksCleared),
        };
        let locality = match kind {
            EventKind::Cleared => None,
            EventKind::Stored | EventKind::Removed => self.locality,
        };
        Ok(DecodedEvent { event, locality })
    }
}

/// Decodes one event; `None` for an unknown tag (its body skipped).
fn decode_event(reader: &mut Reader<'_>) -> Result<Option<DecodedEvent>, DecodeError> {
    let event_offset = reader.offset;
    match reader.header("event")? {
        Header::Array(len) => {
            let len = reader.checked_len(len, 1, event_offset, "event array")?;
            if len == 0 {
                return Err(DecodeError::MissingTag {
                    offset: event_offset,
                });
            }
            let tag = reader.str("event tag")?;
            let Some(kind) = EventKind::from_tag(tag) else {
                for _ in 1..len {
                    reader.skip_value(0)?;
                }
                return Ok(None);
            };
            let layout = kind.array_fields();
            let mut fields = EventFields::default();
            for index in 0..len - 1 {
                let field = layout.get(index).copied().unwrap_or(Field::Unused);
                fields.read(reader, field)?;
            }
            fields.finish(kind, event_offset).map(Some)
        }
        Header::Map(len) => {
            let entries = reader.checked_len(len, 2, event_offset, "event map")?;
            let body_offset = reader.offset;
            let Some(tag) = find_map_tag(reader, entries)? else {
                return Err(DecodeError::MissingTag {
                    offset: event_offset,
                });
            };
            let kind = EventKind::from_tag(tag);
            reader.offset = body_offset;
            let mut fields = EventFields::default();
            for _ in 0..entries {
                let field = match reader.map_key()? {
                    Some("type") | None => Field::Unused,
                    Some(key) => kind.map_or(Field::Unused, |kind| kind.map_field(key)),
                };
                fields.read(reader, field)?;
            }
            match kind {
                Some(kind) => fields.finish(kind, event_offset).map(Some),
                None => Ok(None),
            }
        }
        other => Err(reader.unexpected(event_offset, "event", "array or map", &other)),
    }
}

/// Finds the `"type"` value among a map's entries (msgspec writes it first, so this usually
/// stops at the first key). Leaves the reader somewhere inside the map.
fn find_map_tag<'a>(
    reader: &mut Reader<'a>,
    entries: usize,
) -> Result<Option<&'a str>, DecodeError> {
    for _ in 0..entries {
        if reader.map_key()? == Some("type") {
            return reader.str("event type tag").map(Some);
        }
        reader.skip_value(0)?;
    }
    Ok(None)
}

/// A msgpack value's header: its type and, for containers and byte strings, its declared length.
#[derive(Clone, Copy, Debug)]
enum Header {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    F32(f32),
    F64(f64),
    Str(u32),
    Bin(u32),
    Array(u32),
    Map(u32),
    /// An extension value: the bytes that follow (type byte and data).
    Ext(u32),
}

impl Header {
    fn type_name(&self) -> &'static str {
        match self {
            Header::Nil => "nil",
            Header::Bool => "bool",
            Header::Uint(_) => "unsigned int",
            Header::Int(_) => "int",
            Header::F32(_) => "float32",
            Header::F64(_) => "float64",
            Header::Str(_) => "str",
            Header::Bin(_) => "bin",
            Header::Array(_) => "array",
            Header::Map(_) => "map",
            Header::Ext(_) => "ext",
        }
    }
}

/// A cursor over untrusted msgpack bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, offset: 0 }
    }

    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.offset)
    }

    fn take(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let truncated = DecodeError::Truncated {
            offset: self.offset,
            what,
        };
        let end = self.offset.checked_add(len).ok_or(truncated.clone())?;
        let slice = self.bytes.get(self.offset..end).ok_or(truncated)?;
        self.offset = end;
        Ok(slice)
    }

    fn fixed<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let slice = self.take(N, what)?;
        let mut bytes = [0; N];
        bytes.copy_from_slice(slice);
        Ok(bytes)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.fixed::<1>(what).map(|[byte]| byte)
    }

    fn u16(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.fixed(what)
            .map(|bytes| u32::from(u16::from_be_bytes(bytes)))
    }

    fn u32_raw(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.fixed(what).map(u32::from_be_bytes)
    }

    /// Reads a marker and whatever length or scalar follows it.
    fn header(&mut self, what: &'static str) -> Result<Header, DecodeError> {
        let marker_offset = self.offset;
        let marker = self.u8(what)?;
        Ok(match marker {
            0x00..=0x7f => Header::Uint(u64::from(marker)),
            0x80..=0x8f => Header::Map(u32::from(marker & 0x0f)),
            0x90..=0x9f => Header::Array(u32::from(marker & 0x0f)),
            0xa0..=0xbf => Header::Str(u32::from(marker & 0x1f)),
            0xc0 => Header::Nil,
            0xc1 => {
                return Err(DecodeError::ReservedMarker {
                    offset: marker_offset,
                });
            }
            0xc2 | 0xc3 => Header::Bool,
            0xc4 => Header::Bin(u32::from(self.u8(what)?)),
            0xc5 => Header::Bin(self.u16(what)?),
            0xc6 => Header::Bin(self.u32_raw(what)?),
            // ext 8/16/32: the length counts the data only; a type byte precedes it.
            0xc7 => Header::Ext(u32::from(self.u8(what)?).saturating_add(1)),
            0xc8 => Header::Ext(self.u16(what)?.saturating_add(1)),
            0xc9 => Header::Ext(self.u32_raw(what)?.saturating_add(1)),
            0xca => Header::F32(f32::from_be_bytes(self.fixed(what)?)),
            0xcb => Header::F64(f64::from_be_bytes(self.fixed(what)?)),
            0xcc => Header::Uint(u64::from(self.u8(what)?)),
            0xcd => Header::Uint(u64::from(self.u16(what)?)),
            0xce => Header::Uint(u64::from(self.u32_raw(what)?)),
            0xcf => Header::Uint(u64::from_be_bytes(self.fixed(what)?)),
            0xd0 => Header::Int(i64::from(i8::from_be_bytes(self.fixed(what)?))),
            0xd1 => Header::Int(i64::from(i16::from_be_bytes(self.fixed(what)?))),
            0xd2 => Header::Int(i64::from(i32::from_be_bytes(self.fixed(what)?))),
            0xd3 => Header::Int(i64::from_be_bytes(self.fixed(what)?)),
            // fixext 1/2/4/8/16: type byte plus 2^(marker - 0xd4) data bytes.
            0xd4..=0xd8 => Header::Ext(1 + (1 << (marker - 0xd4))),
            0xd9 => Header::Str(u32::from(self.u8(what)?)),
            0xda => Header::Str(self.u16(what)?),
            0xdb => Header::Str(self.u32_raw(what)?),
            0xdc => Header::Array(self.u16(what)?),
            0xdd => Header::Array(self.u32_raw(what)?),
            0xde => Header::Map(self.u16(what)?),
            0xdf => Header::Map(self.u32_raw(what)?),
            0xe0..=0xff => Header::Int(i64::from(i8::from_be_bytes([marker]))),
        })
    }

    fn unexpected(
        &self,
        offset: usize,
        what: &'static str,
        expected: &'static str,
        found: &Header,
    ) -> DecodeError {
        DecodeError::UnexpectedType {
            offset,
            what,
            expected,
            found: found.type_name(),
        }
    }

    /// Checks that `declared` elements of at least `min_bytes_each` fit in the remaining bytes.
    fn checked_len(
        &self,
        declared: u32,
        min_bytes_each: usize,
        header_offset: usize,
        what: &'static str,
    ) -> Result<usize, DecodeError> {
        let declared_len = usize::try_from(declared).unwrap_or(usize::MAX);
        if declared_len.saturating_mul(min_bytes_each) > self.remaining() {
            return Err(DecodeError::LengthExceedsPayload {
                offset: header_offset,
                what,
                declared: u64::from(declared),
                remaining: self.remaining(),
            });
        }
        Ok(declared_len)
    }

    fn array_len(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let offset = self.offset;
        match self.header(what)? {
            Header::Array(len) => self.checked_len(len, 1, offset, what),
            other => Err(self.unexpected(offset, what, "array", &other)),
        }
    }

    fn byte_string(&mut self, len: u32, what: &'static str) -> Result<&'a [u8], DecodeError> {
        self.take(usize::try_from(len).unwrap_or(usize::MAX), what)
    }

    fn str(&mut self, what: &'static str) -> Result<&'a str, DecodeError> {
        let offset = self.offset;
        match self.header(what)? {
            Header::Str(len) => self.utf8(len, offset, what),
            other => Err(self.unexpected(offset, what, "str", &other)),
        }
    }

    fn utf8(
        &mut self,
        len: u32,
        offset: usize,
        what: &'static str,
    ) -> Result<&'a str, DecodeError> {
        let bytes = self.byte_string(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { offset, what })
    }

    fn optional_string(&mut self, what: &'static str) -> Result<Option<String>, DecodeError> {
        let offset = self.offset;
        match self.header(what)? {
            Header::Nil => Ok(None),
            Header::Str(len) => self
                .utf8(len, offset, what)
                .map(|text| Some(text.to_owned())),
            other => Err(self.unexpected(offset, what, "str or nil", &other)),
        }
    }

    /// A map key: `Some` for a string key, `None` (key skipped) for any other type.
    fn map_key(&mut self) -> Result<Option<&'a str>, DecodeError> {
        let offset = self.offset;
        match self.header("map key")? {
            Header::Str(len) => self.utf8(len, offset, "map key").map(Some),
            other => {
                self.skip_body(other, offset, 0)?;
                Ok(None)
            }
        }
    }

    fn timestamp(&mut self) -> Result<f64, DecodeError> {
        let offset = self.offset;
        match self.header("ts")? {
            Header::F64(value) => Ok(value),
            Header::F32(value) => Ok(f64::from(value)),
            // Integer seconds; precision loss above 2^53 s is irrelevant for a timestamp.
            Header::Uint(value) => Ok(value as f64),
            Header::Int(value) => Ok(value as f64),
            other => Err(self.unexpected(offset, "ts", "float or int", &other)),
        }
    }

    /// An integer that must be non-negative and at most `max`.
    fn bounded_uint(
        &self,
        header: Header,
        offset: usize,
        what: &'static str,
        max: u64,
    ) -> Result<u64, DecodeError> {
        let out_of_range = |value: i128| DecodeError::OutOfRange {
            offset,
            what,
            value,
        };
        match header {
            Header::Uint(value) if value <= max => Ok(value),
            Header::Uint(value) => Err(out_of_range(i128::from(value))),
            Header::Int(value) => match u64::try_from(value) {
                Ok(value) if value <= max => Ok(value),
                _ => Err(out_of_range(i128::from(value))),
            },
            other => Err(self.unexpected(offset, what, "int", &other)),
        }
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let offset = self.offset;
        let header = self.header(what)?;
        let value = self.bounded_uint(header, offset, what, u64::from(u32::MAX))?;
        Ok(u32::try_from(value).unwrap_or(u32::MAX))
    }

    fn optional_u32(&mut self, what: &'static str) -> Result<Option<u32>, DecodeError> {
        if self.bytes.get(self.offset) == Some(&0xc0) {
            self.offset += 1;
            return Ok(None);
        }
        self.u32(what).map(Some)
    }

    fn optional_u64(&mut self, what: &'static str) -> Result<Option<u64>, DecodeError> {
        let offset = self.offset;
        match self.header(what)? {
            Header::Nil => Ok(None),
            header => self.bounded_uint(header, offset, what, u64::MAX).map(Some),
        }
    }

    /// A block hash from an already read header (see the module docs for the mapping).
    fn hash_from(
        &mut self,
        header: Header,
        offset: usize,
        what: &'static str,
    ) -> Result<u64, DecodeError> {
        match header {
            Header::Uint(value) => Ok(value),
            // Python's signed 64-bit hash(): keep its bits.
            Header::Int(value) => Ok(value as u64),
            Header::Bin(len) => {
                let digest = self.byte_string(len, what)?;
                if digest.is_empty() || digest.len() > MAX_HASH_BIN_BYTES {
                    return Err(DecodeError::HashLength {
                        offset,
                        len: digest.len(),
                    });
                }
                // vLLM's int form: int.from_bytes(digest[-8:], "big").
                let tail = &digest[digest.len().saturating_sub(8)..];
                Ok(tail
                    .iter()
                    .fold(0u64, |value, &byte| (value << 8) | u64::from(byte)))
            }
            other => Err(self.unexpected(offset, what, "int or bin", &other)),
        }
    }

    fn optional_hash(&mut self, what: &'static str) -> Result<Option<u64>, DecodeError> {
        let offset = self.offset;
        match self.header(what)? {
            Header::Nil => Ok(None),
            header => self.hash_from(header, offset, what).map(Some),
        }
    }

    fn hashes(&mut self, what: &'static str) -> Result<Vec<u64>, DecodeError> {
        let len = self.array_len(what)?;
        let mut hashes = Vec::with_capacity(len.min(MAX_PREALLOCATED_ELEMENTS));
        for _ in 0..len {
            // Fast path: vLLM's int hashes are uniform 64-bit values, nearly all uint64.
            if let Some(&[0xcf, b0, b1, b2, b3, b4, b5, b6, b7]) = self.rest().first_chunk() {
                self.offset += 9;
                hashes.push(u64::from_be_bytes([b0, b1, b2, b3, b4, b5, b6, b7]));
                continue;
            }
            let offset = self.offset;
            let header = self.header(what)?;
            hashes.push(self.hash_from(header, offset, what)?);
        }
        Ok(hashes)
    }

    fn token_ids(&mut self, what: &'static str) -> Result<Vec<u32>, DecodeError> {
        let len = self.array_len(what)?;
        let mut tokens = Vec::with_capacity(len.min(MAX_PREALLOCATED_ELEMENTS));
        for _ in 0..len {
            // Fast paths for the encodings msgpack writers pick for non-negative ids (positive
            // fixint, uint8, uint16, uint32: a 128k vocabulary is mostly uint16 and uint32);
            // anything else, and every error, takes the general path.
            let (token, width) = match *self.rest() {
                [byte @ 0x00..=0x7f, ..] => (u32::from(byte), 1),
                [0xcc, byte, ..] => (u32::from(byte), 2),
                [0xcd, b0, b1, ..] => (u32::from(u16::from_be_bytes([b0, b1])), 3),
                [0xce, b0, b1, b2, b3, ..] => (u32::from_be_bytes([b0, b1, b2, b3]), 5),
                _ => {
                    tokens.push(self.u32(what)?);
                    continue;
                }
            };
            self.offset += width;
            tokens.push(token);
        }
        Ok(tokens)
    }

    /// `extra_keys`: nil, or per block nil or a list of keys; a string key is kept, any
    /// other (a multimodal `(identifier, offset)` pair, a prompt-embeds digest) is
    /// [`ExtraKey::Other`]. A value of another shape than vLLM's (a newer vLLM) is read as one
    /// block of one `Other` key rather than refused: the field's meaning is then unknown, so
    /// its blocks are not trusted as plain text, and the event still decodes.
    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, DecodeError> {
        let unknown = || Some(vec![Some(vec![ExtraKey::Other])]);
        let offset = self.offset;
        let len = match self.header("extra_keys")? {
            Header::Nil => return Ok(None),
            Header::Array(len) => self.checked_len(len, 1, offset, "extra_keys")?,
            other => {
                self.skip_body(other, offset, 0)?;
                return Ok(unknown());
            }
        };
        let mut blocks = Vec::with_capacity(len);
        for _ in 0..len {
            let offset = self.offset;
            let count = match self.header("extra_keys entry")? {
                Header::Nil => {
                    blocks.push(None);
                    continue;
                }
                Header::Array(count) => self.checked_len(count, 1, offset, "extra_keys entry")?,
                other => {
                    self.skip_body(other, offset, 1)?;
                    blocks.push(Some(vec![ExtraKey::Other]));
                    continue;
                }
            };
            let mut keys = Vec::with_capacity(count);
            for _ in 0..count {
                let offset = self.offset;
                let key = match self.header("extra key")? {
                    // Bytes that are not UTF-8 are a key of unknown meaning; too few bytes
                    // (a truncated payload) are an error like anywhere else.
                    Header::Str(len) => match self.utf8(len, offset, "extra key") {
                        Ok(text) => ExtraKey::Str(text.to_owned()),
                        Err(DecodeError::InvalidUtf8 { .. }) => ExtraKey::Other,
                        Err(error) => return Err(error),
                    },
                    other => {
                        self.skip_body(other, offset, 2)?;
                        ExtraKey::Other
                    }
                };
                keys.push(key);
            }
            blocks.push(Some(keys));
        }
        Ok(Some(blocks))
    }

    /// The bytes not read yet.
    fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.offset..).unwrap_or_default()
    }

    /// Skips one value of any type.
    fn skip_value(&mut self, depth: usize) -> Result<(), DecodeError> {
        let offset = self.offset;
        let header = self.header("skipped value")?;
        self.skip_body(header, offset, depth)
    }

    /// Skips what follows an already read header.
    fn skip_body(
        &mut self,
        header: Header,
        offset: usize,
        depth: usize,
    ) -> Result<(), DecodeError> {
        match header {
            Header::Str(len) | Header::Bin(len) | Header::Ext(len) => {
                self.byte_string(len, "skipped value")?;
            }
            Header::Array(len) | Header::Map(len) => {
                if depth >= MAX_SKIP_DEPTH {
                    return Err(DecodeError::TooDeep { offset });
                }
                let per_element = if matches!(header, Header::Map(_)) {
                    2
                } else {
                    1
                };
                let len = self.checked_len(len, per_element, offset, "skipped value")?;
                for _ in 0..len * per_element {
                    self.skip_value(depth + 1)?;
                }
            }
            Header::Nil
            | Header::Bool
            | Header::Uint(_)
            | Header::Int(_)
            | Header::F32(_)
            | Header::F64(_) => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_array_header_in_a_tiny_payload_is_rejected() {
        let payload = [
            0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
        ];
        assert_eq!(
            decode_batch(&payload),
            Err(DecodeError::LengthExceedsPayload {
                offset: 10,
                what: "events array",
                declared: u64::from(u32::MAX),
                remaining: 0,
            })
        );
    }

    #[test]
    fn skipping_stops_at_the_depth_bound() {
        // An unknown event tag whose only field is 40 nested arrays.
        let mut payload = vec![0x92, 0x00, 0x91, 0x92, 0xa1, b'X'];
        payload.extend(std::iter::repeat_n(0x91, 40));
        payload.push(0xc0);
        assert!(matches!(
            decode_batch(&payload),
            Err(DecodeError::TooDeep { .. })
        ));
    }

    #[test]
    fn bin_hashes_map_like_vllm_int_conversion() {
        let mut reader = Reader::new(&[0xc4, 3, 0x01, 0x02, 0x03]);
        let header = reader.header("hash").unwrap();
        assert_eq!(reader.hash_from(header, 0, "hash"), Ok(0x0001_0203));
        let mut reader = Reader::new(&[0xc4, 0]);
        let header = reader.header("hash").unwrap();
        assert_eq!(
            reader.hash_from(header, 0, "hash"),
            Err(DecodeError::HashLength { offset: 0, len: 0 })
        );
    }

    #[test]
    fn token_and_hash_fast_paths_agree_with_the_general_path() {
        // Token ids in every width a writer may pick, minimal or not: fixint, uint8, uint16,
        // uint32 (fast paths), then uint64 and int8 (general path).
        let tokens = [
            0x90 | 8,
            0x05,
            0xcc,
            0x80,
            0xcd,
            0x01,
            0x00,
            0xce,
            0x00,
            0x01,
            0x00,
            0x00,
            0xce,
            0xff,
            0xff,
            0xff,
            0xff,
            0xcf,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0x2a,
            0xd0,
            0x07,
            0xcc,
            0x05,
        ];
        let mut reader = Reader::new(&tokens);
        assert_eq!(
            reader.token_ids("token_ids"),
            Ok(vec![5, 0x80, 0x100, 0x1_0000, u32::MAX, 42, 7, 5])
        );
        assert_eq!(reader.remaining(), 0);
        // Out of range and truncated values still fail with their general-path errors.
        let mut reader = Reader::new(&[0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert!(matches!(
            reader.token_ids("token_ids"),
            Err(DecodeError::OutOfRange { offset: 1, .. })
        ));
        let mut reader = Reader::new(&[0x92, 0x01, 0xcd, 0x01]);
        assert!(matches!(
            reader.token_ids("token_ids"),
            Err(DecodeError::Truncated { offset: 3, .. })
        ));
        let mut hashes = vec![0x92, 0xcf];
        hashes.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        hashes.push(0x07);
        let mut reader = Reader::new(&hashes);
        assert_eq!(
            reader.hashes("block_hashes"),
            Ok(vec![0x0102_0304_0506_0708, 7])
        );
        let mut reader = Reader::new(&[0x91, 0xcf, 1, 2, 3]);
        assert!(matches!(
            reader.hashes("block_hashes"),
            Err(DecodeError::Truncated { offset: 2, .. })
        ));
    }

    #[test]
    fn mirror_filter_learns_sliding_window_groups() {
        let stored = |group: u32, kind: &str| DecodedEvent {
            event: KvEvent::BlockStored(BlockStored {
                block_hashes: vec![1],
                parent_block_hash: None,
                token_ids: vec![1],
                block_size: 1,
                lora_id: None,
                medium: Some(MEDIUM_GPU.to_string()),
                lora_name: None,
                extra_keys: None,
                group_idx: Some(group),
                kv_cache_spec_kind: Some(kind.to_string()),
                kv_cache_spec_sliding_window: None,
            }),
            locality: None,
        };
        let removed = |group: u32| DecodedEvent {
            event: KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![1],
                medium: Some(MEDIUM_GPU.to_string()),
                group_idx: Some(group),
            }),
            locality: None,
        };
        let mut filter = MirrorFilter::default();
        assert!(filter.accepts(&removed(1)), "unknown group: applied");
        assert!(filter.accepts(&stored(0, "full_attention")));
        assert!(!filter.accepts(&stored(1, "sliding_window")));
        assert!(filter.accepts(&removed(0)));
        assert!(!filter.accepts(&removed(1)));
        assert!(filter.accepts(&stored(1, "full_attention")));
        assert!(filter.accepts(&removed(1)), "group 1 changed kind");
    }
}
