//! The peer cluster protocol of myelin routers, with no I/O: several routers in front of the
//! same engines share their load on each engine, their residency inputs (admitted-token
//! counters, scraped KV capacity) and the routes they learned, so each scores with the
//! cluster's view instead of its own.
//!
//! - [`wire`]: the packet frame (magic, version, type, length, sender, boot, sequence),
//!   HMAC-SHA256 with the cluster key, and the replay guard;
//! - [`messages`]: the bincode 2 payloads (tolerant of fields appended by newer versions);
//! - [`membership`]: SWIM failure detection and dissemination (foca), sans-IO;
//! - [`state`]: what is shared and its bounded tables (peer load, routes, reassembly,
//!   anti-entropy digests) and the packers that keep packets under the size bound;
//! - [`node`]: one node, tying them together: datagrams and timers in, datagrams, timers,
//!   membership changes and peers' routes out.
//!
//! The protocol is described in docs/gossip-protocol.md.
//!
//! ```
//! use myelin_gossip::{ClusterKey, GossipConfig, GossipNode, MembershipParams, Route};
//!
//! let key = ClusterKey::new(b"a cluster key of 32 bytes or so.")?;
//! let node = |name: &str, port: u16, seeds: Vec<std::net::SocketAddr>| {
//!     GossipNode::new(GossipConfig {
//!         node_name: name.into(),
//!         addr: ([127, 0, 0, 1], port).into(),
//!         boot: 1,
//!         key: key.clone(),
//!         params: MembershipParams::default(),
//!         block_size: 16,
//!         seeds,
//!     })
//! };
//! let mut a = node("a", 7001, vec![]);
//! let mut b = node("b", 7002, vec![([127, 0, 0, 1], 7001).into()]);
//! // b announces itself to its seed; a answers; both know each other.
//! b.join_tick();
//! for _ in 0..4 {
//!     for out in b.take_outgoing() {
//!         a.receive(([127, 0, 0, 1], 7002).into(), &out.packet, 0)?;
//!     }
//!     for out in a.take_outgoing() {
//!         b.receive(([127, 0, 0, 1], 7001).into(), &out.packet, 0)?;
//!     }
//! }
//! assert_eq!((a.active_members(), b.active_members()), (1, 1));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod membership;
pub mod messages;
pub mod node;
pub mod state;
pub mod wire;

pub use membership::{
    DEFAULT_MAX_MEMBERS, MemberEvent, MemberState, MembershipParams, MembershipTimer, NodeIdentity,
};
pub use messages::{EngineState, Payload, decode_packet, encode_packet};
pub use node::{GossipConfig, GossipNode, NodeCounters, Outgoing, Received};
pub use state::{ClusterState, PeerLoad, PeerState, Route, RouteKey, engine_key, node_key};
pub use wire::{ClusterKey, DecodeError, MAX_PACKET_BYTES, PacketType};
