//! vLLM KV-cache event wire format and block hashing.
//!
//! - [`hash`]: vLLM's `sha256_cbor` prefix-cache block hash and its u64 wire form.
//! - [`wire`]: the event types (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and their
//!   msgpack encoding in the byte layouts of vLLM 0.22 (tagged arrays) and 0.33 (maps).
//! - [`decode`]: the decoder of every vLLM layout (0.9.0 to 0.33) from untrusted bytes, the ZMQ
//!   framing of live and replay messages, and the mirror's filter rules.
//!
//! The subscriber state machine is not here yet.

pub mod decode;
pub mod hash;
pub mod wire;

pub use decode::{
    DecodeError, DecodedBatch, DecodedEvent, LiveMessage, MirrorFilter, ReplayFrame, decode_batch,
    decode_live, decode_replay, replay_request,
};

pub use hash::{
    BlockHash, NONE_HASH_SEED, hash_block_tokens, hash_block_tokens_keyed, hash_token_blocks,
    hash_token_blocks_keyed, none_hash,
};
pub use wire::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, MEDIUM_GPU,
    WireVersion, encode_batch,
};
