//! The packet frame: a fixed header, a payload, optional extension bytes from newer versions,
//! and an HMAC-SHA256 over everything before it (docs/gossip-protocol.md).
//!
//! ```text
//! offset  size  field
//!      0     4  magic "MYGP"
//!      4     1  version (1 here; every version keeps this header)
//!      5     1  packet type
//!      6     2  payload length, big-endian
//!      8     8  sender (hash of the node id), big-endian
//!     16     8  sender boot (incarnation: start time of the process), big-endian
//!     24     8  sequence number (per sender and boot, from 1), big-endian
//!     32     n  payload
//!   32+n     e  extension bytes (a newer version's; ignored here)
//! 32+n+e    32  HMAC-SHA256(cluster key, bytes 0 .. 32+n+e)
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// First four bytes of every packet.
pub const MAGIC: [u8; 4] = *b"MYGP";
/// The version this code writes. Older and newer versions share the header layout.
pub const VERSION: u8 = 1;
/// Largest packet sent or accepted, bytes (under a 1,500-byte Ethernet MTU with IP and UDP
/// headers, and under 1,400 as the protocol promises).
pub const MAX_PACKET_BYTES: usize = 1_392;
/// Fixed header size.
pub const HEADER_BYTES: usize = 32;
/// HMAC-SHA256 tag size.
pub const MAC_BYTES: usize = 32;
/// Largest payload that fits a packet.
pub const MAX_PAYLOAD_BYTES: usize = MAX_PACKET_BYTES - HEADER_BYTES - MAC_BYTES;
/// Shortest cluster key accepted, bytes.
pub const MIN_KEY_BYTES: usize = 16;

/// What a packet carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum PacketType {
    /// A SWIM membership message (foca's bytes).
    Swim = 1,
    /// The sender's load and residency inputs per engine.
    State = 2,
    /// Routes the sender learned (or holds, in an anti-entropy answer).
    Routes = 3,
    /// A digest of the routes the sender holds (anti-entropy).
    Digest = 4,
}

impl PacketType {
    pub fn from_u8(value: u8) -> Option<PacketType> {
        match value {
            1 => Some(PacketType::Swim),
            2 => Some(PacketType::State),
            3 => Some(PacketType::Routes),
            4 => Some(PacketType::Digest),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PacketType::Swim => "swim",
            PacketType::State => "state",
            PacketType::Routes => "routes",
            PacketType::Digest => "digest",
        }
    }
}

/// Why a packet was dropped. Every variant is counted by the caller under [`Self::reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("packet shorter than a header and a MAC")]
    Short,
    #[error("packet longer than {MAX_PACKET_BYTES} bytes")]
    Oversize,
    #[error("bad magic")]
    BadMagic,
    #[error("HMAC does not verify with the cluster key")]
    BadMac,
    #[error("unsupported version {0}")]
    Version(u8),
    #[error("payload length beyond the packet")]
    BadLength,
    #[error("unknown packet type {0}")]
    UnknownType(u8),
    #[error("payload does not decode")]
    Malformed,
    #[error("replayed or out-of-window sequence number")]
    Replayed,
    #[error("state or routes from a node that is not a live member")]
    NotMember,
    #[error("membership message refused")]
    Membership,
    #[error("routes hashed with another block size")]
    BlockSize,
    #[error("another process uses this node's id")]
    DuplicateNode,
    #[error("routes past the sender's budget")]
    RateLimited,
    #[error("membership message naming members past the member cap")]
    MemberCap,
}

impl DecodeError {
    /// Label of the dropped-packets metric.
    pub fn reason(self) -> &'static str {
        match self {
            DecodeError::Short => "short",
            DecodeError::Oversize => "oversize",
            DecodeError::BadMagic => "bad_magic",
            DecodeError::BadMac => "bad_mac",
            DecodeError::Version(_) => "version",
            DecodeError::BadLength => "bad_length",
            DecodeError::UnknownType(_) => "unknown_type",
            DecodeError::Malformed => "malformed",
            DecodeError::Replayed => "replayed",
            DecodeError::NotMember => "not_member",
            DecodeError::Membership => "membership",
            DecodeError::BlockSize => "block_size",
            DecodeError::DuplicateNode => "duplicate_node_id",
            DecodeError::RateLimited => "rate_limited",
            DecodeError::MemberCap => "member_cap",
        }
    }
}

/// A packet that does not fit [`MAX_PACKET_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("payload of {0} bytes exceeds the packet bound")]
pub struct TooLarge(pub usize);

/// The shared secret every node of a cluster holds.
#[derive(Clone)]
pub struct ClusterKey {
    mac: Hmac<Sha256>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

/// A cluster key shorter than [`MIN_KEY_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cluster key of {0} bytes: at least {MIN_KEY_BYTES} are required")]
pub struct WeakKey(pub usize);

impl ClusterKey {
    /// A key from its bytes (at least [`MIN_KEY_BYTES`]).
    pub fn new(bytes: &[u8]) -> Result<ClusterKey, WeakKey> {
        if bytes.len() < MIN_KEY_BYTES {
            return Err(WeakKey(bytes.len()));
        }
        let mac = Hmac::<Sha256>::new_from_slice(bytes).map_err(|_| WeakKey(bytes.len()))?;
        Ok(ClusterKey { mac })
    }

    /// A key from a key file's contents: surrounding whitespace (a trailing newline) is not
    /// part of it.
    pub fn from_file_contents(contents: &[u8]) -> Result<ClusterKey, WeakKey> {
        let start = contents
            .iter()
            .position(|byte| !byte.is_ascii_whitespace())
            .unwrap_or(contents.len());
        let end = contents
            .iter()
            .rposition(|byte| !byte.is_ascii_whitespace())
            .map_or(start, |last| last + 1);
        ClusterKey::new(&contents[start..end])
    }

    fn tag(&self, bytes: &[u8]) -> [u8; MAC_BYTES] {
        let mut mac = self.mac.clone();
        mac.update(bytes);
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, bytes: &[u8], tag: &[u8]) -> bool {
        let mut mac = self.mac.clone();
        mac.update(bytes);
        mac.verify_slice(tag).is_ok()
    }
}

/// The authenticated header fields of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u8,
    pub kind: PacketType,
    pub sender: u64,
    pub boot: u64,
    pub seq: u64,
}

/// Frames `payload` (and `extension`, bytes a newer version appends after it) into a packet.
pub fn encode_frame(
    key: &ClusterKey,
    header: &Header,
    payload: &[u8],
    extension: &[u8],
) -> Result<Vec<u8>, TooLarge> {
    let total = HEADER_BYTES + payload.len() + extension.len() + MAC_BYTES;
    if total > MAX_PACKET_BYTES {
        return Err(TooLarge(payload.len() + extension.len()));
    }
    let length = u16::try_from(payload.len()).map_err(|_| TooLarge(payload.len()))?;
    let mut packet = Vec::with_capacity(total);
    packet.extend_from_slice(&MAGIC);
    packet.push(header.version);
    packet.push(header.kind as u8);
    packet.extend_from_slice(&length.to_be_bytes());
    packet.extend_from_slice(&header.sender.to_be_bytes());
    packet.extend_from_slice(&header.boot.to_be_bytes());
    packet.extend_from_slice(&header.seq.to_be_bytes());
    packet.extend_from_slice(payload);
    packet.extend_from_slice(extension);
    let tag = key.tag(&packet);
    packet.extend_from_slice(&tag);
    Ok(packet)
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(word)
}

/// Checks a packet's frame and MAC; returns its header and payload (extension bytes are
/// skipped). Never panics, whatever the bytes.
pub fn decode_frame<'a>(
    key: &ClusterKey,
    packet: &'a [u8],
) -> Result<(Header, &'a [u8]), DecodeError> {
    if packet.len() < HEADER_BYTES + MAC_BYTES {
        return Err(DecodeError::Short);
    }
    if packet.len() > MAX_PACKET_BYTES {
        return Err(DecodeError::Oversize);
    }
    if packet[..4] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let (signed, tag) = packet.split_at(packet.len() - MAC_BYTES);
    if !key.verify(signed, tag) {
        return Err(DecodeError::BadMac);
    }
    let version = signed[4];
    if version == 0 {
        return Err(DecodeError::Version(version));
    }
    let length = usize::from(u16::from_be_bytes([signed[6], signed[7]]));
    if HEADER_BYTES + length > signed.len() {
        return Err(DecodeError::BadLength);
    }
    let kind = PacketType::from_u8(signed[5]).ok_or(DecodeError::UnknownType(signed[5]))?;
    let header = Header {
        version,
        kind,
        sender: be_u64(signed, 8),
        boot: be_u64(signed, 16),
        seq: be_u64(signed, 24),
    };
    Ok((header, &signed[HEADER_BYTES..HEADER_BYTES + length]))
}

/// Width of the window of recent sequence numbers a sender's packets may arrive out of order
/// in.
pub const REPLAY_WINDOW: u64 = 64;
/// Senders whose sequence window is kept (least recently heard forgotten past it).
pub const MAX_REPLAY_SENDERS: usize = 1_024;

#[derive(Debug, Clone, Copy)]
struct Window {
    boot: u64,
    highest: u64,
    /// Bit i: `highest - i` was seen.
    seen: u64,
    heard: u64,
}

/// Rejects authenticated packets seen before: per sender, packets of an older boot, and
/// sequence numbers already seen or older than the window. Bounded: at most
/// [`MAX_REPLAY_SENDERS`] senders (only authenticated packets reach it, so only key holders
/// can add senders).
#[derive(Debug, Default)]
pub struct ReplayGuard {
    windows: std::collections::HashMap<u64, Window>,
    tick: u64,
}

impl ReplayGuard {
    pub fn new() -> ReplayGuard {
        ReplayGuard::default()
    }

    /// Number of senders tracked.
    pub fn senders(&self) -> usize {
        self.windows.len()
    }

    /// Accepts (and records) `header`'s sequence number, or says it is a replay.
    pub fn check(&mut self, header: &Header) -> Result<(), DecodeError> {
        self.tick += 1;
        let tick = self.tick;
        let fresh = Window {
            boot: header.boot,
            highest: header.seq,
            seen: 1,
            heard: tick,
        };
        let Some(window) = self.windows.get_mut(&header.sender) else {
            if self.windows.len() >= MAX_REPLAY_SENDERS
                && let Some((&oldest, _)) = self.windows.iter().min_by_key(|(_, w)| w.heard)
            {
                self.windows.remove(&oldest);
            }
            self.windows.insert(header.sender, fresh);
            return Ok(());
        };
        if header.boot < window.boot {
            return Err(DecodeError::Replayed);
        }
        if header.boot > window.boot {
            *window = fresh;
            return Ok(());
        }
        if header.seq > window.highest {
            let shift = header.seq - window.highest;
            window.seen = if shift >= REPLAY_WINDOW {
                0
            } else {
                window.seen << shift
            };
            window.seen |= 1;
            window.highest = header.seq;
            window.heard = tick;
            return Ok(());
        }
        let age = window.highest - header.seq;
        if age >= REPLAY_WINDOW || window.seen & (1 << age) != 0 {
            return Err(DecodeError::Replayed);
        }
        window.seen |= 1 << age;
        window.heard = tick;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ClusterKey {
        ClusterKey::new(b"0123456789abcdef-test-key").unwrap()
    }

    fn header(seq: u64) -> Header {
        Header {
            version: VERSION,
            kind: PacketType::State,
            sender: 7,
            boot: 100,
            seq,
        }
    }

    #[test]
    fn frame_roundtrip_and_extension_bytes_are_skipped() {
        let packet = encode_frame(&key(), &header(1), b"payload", b"newer").unwrap();
        let (decoded, payload) = decode_frame(&key(), &packet).unwrap();
        assert_eq!(decoded, header(1));
        assert_eq!(payload, b"payload");
    }

    #[test]
    fn forged_truncated_and_flipped_packets_are_typed_errors() {
        let packet = encode_frame(&key(), &header(1), b"payload", b"").unwrap();
        let other = ClusterKey::new(b"another-key-of-16-bytes").unwrap();
        assert_eq!(decode_frame(&other, &packet), Err(DecodeError::BadMac));
        assert_eq!(decode_frame(&key(), &packet[..40]), Err(DecodeError::Short));
        for index in 0..packet.len() {
            let mut flipped = packet.clone();
            flipped[index] ^= 0x40;
            assert!(decode_frame(&key(), &flipped).is_err(), "byte {index}");
        }
        assert_eq!(
            decode_frame(&key(), &vec![0u8; MAX_PACKET_BYTES + 1]),
            Err(DecodeError::Oversize)
        );
        assert!(ClusterKey::new(b"short").is_err());
        assert!(ClusterKey::from_file_contents(b"  0123456789abcdef\n").is_ok());
        assert!(ClusterKey::from_file_contents(b"0123456789\n\n\n\n\n\n\n\n").is_err());
    }

    #[test]
    fn unknown_type_and_bad_length_are_rejected_after_the_mac() {
        let mut raw = encode_frame(&key(), &header(1), b"abc", b"").unwrap();
        raw.truncate(raw.len() - MAC_BYTES);
        raw[5] = 99;
        let tag = key().tag(&raw);
        raw.extend_from_slice(&tag);
        assert_eq!(
            decode_frame(&key(), &raw),
            Err(DecodeError::UnknownType(99))
        );
        raw.truncate(raw.len() - MAC_BYTES);
        raw[5] = 2;
        raw[6] = 0xff;
        let tag = key().tag(&raw);
        raw.extend_from_slice(&tag);
        assert_eq!(decode_frame(&key(), &raw), Err(DecodeError::BadLength));
    }

    #[test]
    fn replay_guard_accepts_each_sequence_once_within_the_window() {
        let mut guard = ReplayGuard::new();
        assert_eq!(guard.check(&header(10)), Ok(()));
        assert_eq!(guard.check(&header(10)), Err(DecodeError::Replayed));
        assert_eq!(guard.check(&header(8)), Ok(()));
        assert_eq!(guard.check(&header(8)), Err(DecodeError::Replayed));
        assert_eq!(guard.check(&header(200)), Ok(()));
        assert_eq!(guard.check(&header(100)), Err(DecodeError::Replayed));
        assert_eq!(guard.check(&header(199)), Ok(()));
        // An older boot of the same sender is a replay; a newer one starts afresh.
        let old = Header {
            boot: 99,
            ..header(500)
        };
        assert_eq!(guard.check(&old), Err(DecodeError::Replayed));
        let new = Header {
            boot: 101,
            ..header(1)
        };
        assert_eq!(guard.check(&new), Ok(()));
        assert_eq!(guard.check(&header(201)), Err(DecodeError::Replayed));
    }

    #[test]
    fn replay_guard_is_bounded() {
        let mut guard = ReplayGuard::new();
        for sender in 0..(MAX_REPLAY_SENDERS as u64 + 100) {
            guard
                .check(&Header {
                    sender,
                    ..header(1)
                })
                .unwrap();
        }
        assert_eq!(guard.senders(), MAX_REPLAY_SENDERS);
    }
}
