//! vLLM KV-cache event wire format and block hashing.
//!
//! - [`hash`]: vLLM's `sha256_cbor` prefix-cache block hash and its u64 wire form.
//! - [`wire`]: the event types (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and their
//!   msgpack encoding in the byte layouts of vLLM 0.22 (tagged arrays) and 0.33 (maps).
//!
//! Decoding and the subscriber state machine are not here yet.

pub mod hash;
pub mod wire;

pub use hash::{BlockHash, NONE_HASH_SEED, hash_block_tokens, hash_token_blocks, none_hash};
pub use wire::{
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent, MEDIUM_GPU, WireVersion,
    encode_batch,
};
