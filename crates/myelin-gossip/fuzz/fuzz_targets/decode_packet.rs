//! Fuzz target: arbitrary bytes as a gossip datagram, twice: as they are (almost always a MAC
//! failure) and signed with the cluster key, so the payload decoders see them. Decoding must
//! return a packet or a typed error, never panic; a decoded payload must re-encode and decode
//! to the same value; a node fed the bytes must not panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use myelin_gossip::wire::{Header, PacketType, encode_frame};
use myelin_gossip::{
    ClusterKey, GossipConfig, GossipNode, MembershipParams, Payload, decode_packet,
};

fuzz_target!(|data: &[u8]| {
    let key = ClusterKey::new(b"fuzzing cluster key, 32 bytes!!!").expect("key");
    let _ = decode_packet(&key, data);
    let Some((&kind, payload)) = data.split_first() else {
        return;
    };
    let Some(kind) = PacketType::from_u8(kind % 5) else {
        return;
    };
    let header = Header {
        version: 1,
        kind,
        sender: 1,
        boot: 1,
        seq: 1,
    };
    let Ok(packet) = encode_frame(&key, &header, payload, &[]) else {
        return;
    };
    if let Ok((_, decoded)) = decode_packet(&key, &packet) {
        let again = Payload::from_bytes(kind, &decoded.to_bytes()).expect("re-encoded payload");
        assert_eq!(again, decoded);
    }
    let mut node = GossipNode::new(GossipConfig {
        node_name: "fuzz".into(),
        addr: ([127, 0, 0, 1], 1).into(),
        boot: 2,
        key,
        params: MembershipParams::default(),
        block_size: 16,
        seeds: vec![],
    });
    let _ = node.receive(([127, 0, 0, 1], 2).into(), &packet, 0);
});
