//! Packet payloads: serde structs encoded with bincode 2 (standard configuration: little-endian
//! varints). A newer version may append fields at the end of a payload's top-level struct;
//! this version decodes the fields it knows and ignores the bytes after them.

use serde::{Deserialize, Serialize};

use crate::wire::{
    ClusterKey, DecodeError, Header, MAX_PAYLOAD_BYTES, PacketType, TooLarge, VERSION,
    decode_frame, encode_frame,
};

/// bincode configuration of every payload: allocations bounded by the largest packet.
fn config() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<2048>,
> {
    bincode::config::standard().with_limit::<2048>()
}

/// Longest node id carried, bytes (longer ones are cut).
pub const MAX_NODE_NAME_BYTES: usize = 64;

/// Chain hashes, written as raw little-endian bytes (8 per hash, no varint: hashes are
/// uniformly random, so a varint would cost 9).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hashes(pub Vec<u64>);

impl Serialize for Hashes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut bytes = Vec::with_capacity(self.0.len() * 8);
        for hash in &self.0 {
            bytes.extend_from_slice(&hash.to_le_bytes());
        }
        serializer.serialize_bytes(&bytes)
    }
}

impl<'de> Deserialize<'de> for Hashes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Hashes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte string of 8-byte hashes")
            }
            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Hashes, E> {
                if !bytes.len().is_multiple_of(8) {
                    return Err(E::custom("hash bytes not a multiple of 8"));
                }
                Ok(Hashes(
                    bytes
                        .chunks_exact(8)
                        .map(|chunk| {
                            let mut word = [0u8; 8];
                            word.copy_from_slice(chunk);
                            u64::from_le_bytes(word)
                        })
                        .collect(),
                ))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<Hashes, E> {
                self.visit_bytes(&bytes)
            }
        }
        deserializer.deserialize_bytes(Visitor)
    }
}

/// One node's figures for one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineState {
    /// The engine's key: [`crate::engine_key`] of its URL.
    pub engine: u64,
    /// Requests the node has in flight there.
    pub requests: u32,
    /// Tokens of work they still queue there.
    pub tokens: u64,
    /// Tokens the node ever admitted there (only grows while the node lives).
    pub admitted_tokens: u64,
    /// KV capacity the node scraped from the engine, tokens.
    pub capacity_tokens: Option<u64>,
    /// KV utilization the node scraped, parts per million.
    pub utilization_ppm: Option<u32>,
    /// The engine's reuse reports to the node showed that every use stamped below this was
    /// evicted (0: none known). Stamps share one clock over the cluster, so every node may
    /// apply it.
    pub evicted_below: u64,
}

/// `State`: a node's figures for some of its engines (absolute values: a lost packet heals
/// with the next).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatePayload {
    /// The sender's node id (`--node-id`), at most [`MAX_NODE_NAME_BYTES`].
    pub node: String,
    pub engines: Vec<EngineState>,
}

/// A piece of one route: blocks `offset .. offset + hashes.len()` of a chain of `total_blocks`
/// blocks routed to `engine`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteChunk {
    pub engine: u64,
    /// Residency stamp of the use: the engine's cluster-wide admitted-tokens counter when it
    /// was routed.
    pub stamp: u64,
    /// The sender's number for the route: every piece of one route carries the same.
    pub id: u32,
    pub total_blocks: u32,
    pub offset: u32,
    pub hashes: Hashes,
}

/// `Routes`: routes (or pieces of long ones), all hashed with `block_size`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutesPayload {
    pub block_size: u32,
    pub chunks: Vec<RouteChunk>,
}

/// Number of buckets of a route digest.
pub const DIGEST_BUCKETS: usize = 128;

/// `Digest`: per bucket, a digest of the route keys the sender holds (anti-entropy).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DigestPayload {
    pub block_size: u32,
    /// Routes the sender holds.
    pub routes: u32,
    /// [`DIGEST_BUCKETS`] digests.
    pub buckets: Vec<u64>,
    /// Whether this answers a digest (an answer is not answered again).
    pub reply: bool,
}

/// A decoded packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// foca's bytes, unchanged.
    Swim(Vec<u8>),
    State(StatePayload),
    Routes(RoutesPayload),
    Digest(DigestPayload),
}

impl Payload {
    pub fn kind(&self) -> PacketType {
        match self {
            Payload::Swim(_) => PacketType::Swim,
            Payload::State(_) => PacketType::State,
            Payload::Routes(_) => PacketType::Routes,
            Payload::Digest(_) => PacketType::Digest,
        }
    }

    /// The payload's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let encoded = match self {
            Payload::Swim(bytes) => return bytes.clone(),
            Payload::State(state) => bincode::serde::encode_to_vec(state, config()),
            Payload::Routes(routes) => bincode::serde::encode_to_vec(routes, config()),
            Payload::Digest(digest) => bincode::serde::encode_to_vec(digest, config()),
        };
        // Encoding owned structs into a Vec only fails past the size limit, which the
        // packers keep far below (and which encode_packet reports as too large).
        encoded.unwrap_or_else(|_| vec![0; MAX_PAYLOAD_BYTES + 1])
    }

    /// Decodes a payload of type `kind`; bytes after the fields this version knows are
    /// ignored.
    pub fn from_bytes(kind: PacketType, bytes: &[u8]) -> Result<Payload, DecodeError> {
        fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
            bincode::serde::decode_from_slice(bytes, config())
                .map(|(value, _read)| value)
                .map_err(|_| DecodeError::Malformed)
        }
        Ok(match kind {
            PacketType::Swim => Payload::Swim(bytes.to_vec()),
            PacketType::State => {
                let state: StatePayload = decode(bytes)?;
                if state.node.len() > MAX_NODE_NAME_BYTES {
                    return Err(DecodeError::Malformed);
                }
                Payload::State(state)
            }
            PacketType::Routes => Payload::Routes(decode(bytes)?),
            PacketType::Digest => {
                let digest: DigestPayload = decode(bytes)?;
                if digest.buckets.len() != DIGEST_BUCKETS {
                    return Err(DecodeError::Malformed);
                }
                Payload::Digest(digest)
            }
        })
    }
}

/// Who sends: the header fields every packet of a node carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sender {
    pub node: u64,
    pub boot: u64,
}

/// Encodes and authenticates one packet.
pub fn encode_packet(
    key: &ClusterKey,
    sender: Sender,
    seq: u64,
    payload: &Payload,
) -> Result<Vec<u8>, TooLarge> {
    let header = Header {
        version: VERSION,
        kind: payload.kind(),
        sender: sender.node,
        boot: sender.boot,
        seq,
    };
    encode_frame(key, &header, &payload.to_bytes(), &[])
}

/// Checks and decodes one packet (frame, MAC, payload). Replays are the caller's
/// [`crate::wire::ReplayGuard`]'s business.
pub fn decode_packet(key: &ClusterKey, packet: &[u8]) -> Result<(Header, Payload), DecodeError> {
    let (header, payload) = decode_frame(key, packet)?;
    Ok((header, Payload::from_bytes(header.kind, payload)?))
}

/// Cuts a node id to what a packet carries (on a character boundary).
pub fn node_name(name: &str) -> String {
    let mut end = name.len().min(MAX_NODE_NAME_BYTES);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].to_string()
}
