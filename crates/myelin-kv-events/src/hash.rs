//! vLLM's `sha256_cbor` prefix-cache block hash: the chain hash of full token blocks, and the
//! u64 that vLLM (0.10.2+) puts on the wire for it.
//!
//! vLLM hashes a block as `sha256(cbor2.dumps((parent, tuple(token_ids), extra_keys),
//! canonical=True))` where `parent` is the previous block's 32-byte digest, or `NONE_HASH` for
//! the first block; since vLLM 0.29 `NONE_HASH = sha256_cbor("vllm-none-hash")`. The CBOR
//! needed is tiny (an array of a byte string, an array of unsigned ints, and null), so it is
//! written by hand here. Plain text requests hash `None` as extra keys, as vLLM does; the keyed
//! variants (LoRA name, cache salt) are the simulator's, not byte-identical to vLLM's.

use std::fmt;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// The string vLLM 0.29+ hashes to seed the first block's parent.
pub const NONE_HASH_SEED: &str = "vllm-none-hash";

/// A 32-byte block digest as vLLM computes it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The u64 vLLM publishes in KV events: the last 8 bytes of the digest, big-endian.
    pub fn wire_u64(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "BlockHash({:016x})", self.wire_u64())
    }
}

/// `NONE_HASH` for `sha256_cbor`: SHA-256 of the canonical CBOR text string "vllm-none-hash".
pub fn none_hash() -> BlockHash {
    static NONE_HASH: OnceLock<BlockHash> = OnceLock::new();
    *NONE_HASH.get_or_init(|| {
        let mut cbor = Vec::with_capacity(NONE_HASH_SEED.len() + 9);
        write_cbor_head(&mut cbor, CBOR_MAJOR_TEXT, NONE_HASH_SEED.len() as u64);
        cbor.extend_from_slice(NONE_HASH_SEED.as_bytes());
        BlockHash(Sha256::digest(&cbor).into())
    })
}

/// Hash of one full block: `sha256_cbor((parent or NONE_HASH, tuple(tokens), None))`.
pub fn hash_block_tokens(parent: Option<&BlockHash>, block_token_ids: &[u32]) -> BlockHash {
    hash_block_tokens_keyed(parent, block_token_ids, &[])
}

/// [`hash_block_tokens`] with extra keys (a LoRA adapter's name, a cache salt), hashed as a
/// CBOR array of text strings in place of `None` (none: exactly [`hash_block_tokens`]). vLLM
/// hashes tagged tuples there (the adapter's path too), so keyed hashes are not vLLM's own
/// values; they separate blocks of different keys the way vLLM's do, which is what the
/// simulator needs.
pub fn hash_block_tokens_keyed(
    parent: Option<&BlockHash>,
    block_token_ids: &[u32],
    extra_keys: &[&str],
) -> BlockHash {
    let parent = parent.copied().unwrap_or_else(none_hash);
    // Array(3) + bytes(32) + array(n) + n uints (at most 5 bytes each) + null.
    let mut cbor = Vec::with_capacity(1 + 34 + 9 + 5 * block_token_ids.len() + 1);
    write_cbor_head(&mut cbor, CBOR_MAJOR_ARRAY, 3);
    write_cbor_head(&mut cbor, CBOR_MAJOR_BYTES, parent.0.len() as u64);
    cbor.extend_from_slice(&parent.0);
    write_cbor_head(&mut cbor, CBOR_MAJOR_ARRAY, block_token_ids.len() as u64);
    for &token in block_token_ids {
        write_cbor_head(&mut cbor, CBOR_MAJOR_UNSIGNED, u64::from(token));
    }
    if extra_keys.is_empty() {
        cbor.push(CBOR_NULL);
    } else {
        write_cbor_head(&mut cbor, CBOR_MAJOR_ARRAY, extra_keys.len() as u64);
        for key in extra_keys {
            write_cbor_head(&mut cbor, CBOR_MAJOR_TEXT, key.len() as u64);
            cbor.extend_from_slice(key.as_bytes());
        }
    }
    BlockHash(Sha256::digest(&cbor).into())
}

/// [`hash_token_blocks`] of a request to LoRA adapter `lora` with cache salt `salt`: the
/// adapter's name is an extra key of every block, the salt of the first (as in vLLM).
pub fn hash_token_blocks_keyed(
    token_ids: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<BlockHash> {
    let mut hashes: Vec<BlockHash> = Vec::with_capacity(token_ids.len() / block_size.max(1));
    if block_size == 0 {
        return hashes;
    }
    for (index, block) in token_ids.chunks_exact(block_size).enumerate() {
        let first_salt = salt.filter(|_| index == 0);
        let keys: Vec<&str> = lora.into_iter().chain(first_salt).collect();
        let hash = hash_block_tokens_keyed(hashes.last(), block, &keys);
        hashes.push(hash);
    }
    hashes
}

/// The hash chain of every full block of `token_ids` (a trailing partial block is not hashed).
pub fn hash_token_blocks(token_ids: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut hashes: Vec<BlockHash> = Vec::with_capacity(token_ids.len() / block_size.max(1));
    if block_size == 0 {
        return hashes;
    }
    for block in token_ids.chunks_exact(block_size) {
        let hash = hash_block_tokens(hashes.last(), block);
        hashes.push(hash);
    }
    hashes
}

const CBOR_MAJOR_UNSIGNED: u8 = 0;
const CBOR_MAJOR_BYTES: u8 = 2;
const CBOR_MAJOR_TEXT: u8 = 3;
const CBOR_MAJOR_ARRAY: u8 = 4;
const CBOR_NULL: u8 = 0xf6;

/// A CBOR item head in its shortest form (RFC 8949 §3; canonical CBOR requires the shortest).
fn write_cbor_head(out: &mut Vec<u8>, major: u8, value: u64) {
    let major = major << 5;
    if value < 24 {
        out.push(major | value as u8);
    } else if let Ok(byte) = u8::try_from(value) {
        out.extend_from_slice(&[major | 24, byte]);
    } else if let Ok(short) = u16::try_from(value) {
        out.push(major | 25);
        out.extend_from_slice(&short.to_be_bytes());
    } else if let Ok(word) = u32::try_from(value) {
        out.push(major | 26);
        out.extend_from_slice(&word.to_be_bytes());
    } else {
        out.push(major | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors produced independently with python3 and the cbor2 package:
    //   h = lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
    //   NONE = h("vllm-none-hash")
    //   b1 = h((NONE, tuple(range(16)), None))
    //   b2 = h((b1, (23, 24, 255, 256, 65535, 65536, 128000, 4294967295,
    //                0, 1, 2, 3, 100000, 151643, 7, 9), None))
    //   int.from_bytes(b[-8:], "big")  # the wire u64
    const NONE_HASH_HEX: &str = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0";
    const BLOCK1_HEX: &str = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749";
    const BLOCK1_WIRE: u64 = 2233398808101521225;
    const BLOCK2_HEX: &str = "758ea1dbb4cfbd4dcaa043371cff5d1d6f7921c4802da19e11f559a2e2bbdc90";
    const BLOCK2_WIRE: u64 = 1294039024062422160;
    const BLOCK2_TOKENS: [u32; 16] = [
        23, 24, 255, 256, 65535, 65536, 128000, 4294967295, 0, 1, 2, 3, 100000, 151643, 7, 9,
    ];

    fn hex(hash: &BlockHash) -> String {
        hash.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    #[test]
    fn none_hash_matches_python_cbor2() {
        assert_eq!(hex(&none_hash()), NONE_HASH_HEX);
    }

    #[test]
    fn block_chain_matches_python_cbor2() {
        let first_tokens: Vec<u32> = (0..16).collect();
        let first = hash_block_tokens(None, &first_tokens);
        assert_eq!(hex(&first), BLOCK1_HEX);
        assert_eq!(first.wire_u64(), BLOCK1_WIRE);
        // Every CBOR integer width (inline, 1, 2, 4 bytes) appears in the second block.
        let second = hash_block_tokens(Some(&first), &BLOCK2_TOKENS);
        assert_eq!(hex(&second), BLOCK2_HEX);
        assert_eq!(second.wire_u64(), BLOCK2_WIRE);
    }

    #[test]
    fn token_blocks_hash_only_full_blocks_as_a_chain() {
        let mut tokens: Vec<u32> = (0..16).collect();
        tokens.extend_from_slice(&BLOCK2_TOKENS);
        tokens.extend_from_slice(&[5, 6, 7]);
        let chain = hash_token_blocks(&tokens, 16);
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[0].wire_u64(), BLOCK1_WIRE);
        assert_eq!(chain[1].wire_u64(), BLOCK2_WIRE);
        assert!(hash_token_blocks(&tokens[..15], 16).is_empty());
    }

    #[test]
    fn cbor_heads_are_shortest_form() {
        let mut out = Vec::new();
        for value in [
            0u64,
            23,
            24,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            1 << 32,
        ] {
            write_cbor_head(&mut out, CBOR_MAJOR_UNSIGNED, value);
        }
        assert_eq!(
            out,
            [
                0x00, 0x17, 0x18, 0x18, 0x18, 0xff, 0x19, 0x01, 0x00, 0x19, 0xff, 0xff, 0x1a, 0x00,
                0x01, 0x00, 0x00, 0x1a, 0xff, 0xff, 0xff, 0xff, 0x1b, 0x00, 0x00, 0x00, 0x01, 0x00,
                0x00, 0x00, 0x00
            ]
        );
    }
}
