//! The wire format's properties (round trips, tolerance of newer versions, rejection of
//! forged, garbage and replayed packets, the size bound) and a cluster of nodes on a simulated
//! network (membership, shared load, routes, failure, anti-entropy).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use myelin_gossip::messages::{
    DIGEST_BUCKETS, DigestPayload, Hashes, RouteChunk, RoutesPayload, Sender, StatePayload,
};
use myelin_gossip::state::{MAX_ROUTE_BLOCKS, Reassembly, pack_routes, pack_state};
use myelin_gossip::wire::{Header, MAX_PACKET_BYTES, decode_frame, encode_frame};
use myelin_gossip::{
    ClusterKey, DecodeError, EngineState, GossipConfig, GossipNode, MemberState, MembershipParams,
    MembershipTimer, PacketType, Payload, Received, Route, decode_packet, encode_packet,
};
use proptest::prelude::*;
use serde::Serialize;

fn key() -> ClusterKey {
    ClusterKey::new(b"test cluster key, 32 bytes long!").unwrap()
}

const SENDER: Sender = Sender { node: 11, boot: 5 };

fn engine_state() -> impl Strategy<Value = EngineState> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u32>()),
        any::<u64>(),
    )
        .prop_map(
            |(
                engine,
                requests,
                tokens,
                admitted_tokens,
                capacity_tokens,
                utilization_ppm,
                evicted_below,
            )| {
                EngineState {
                    engine,
                    requests,
                    tokens,
                    admitted_tokens,
                    capacity_tokens,
                    utilization_ppm,
                    evicted_below,
                }
            },
        )
}

fn route() -> impl Strategy<Value = Route> {
    (
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec(any::<u64>(), 1..3_000),
    )
        .prop_map(|(engine, stamp, hashes)| Route {
            engine,
            stamp,
            hashes: hashes.into(),
        })
}

/// The same payload as a newer version could send it: the v1 fields, then new ones.
#[derive(Serialize)]
struct StatePayloadV2 {
    node: String,
    engines: Vec<EngineState>,
    zone: String,
    weights: Vec<u32>,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn state_payloads_roundtrip_within_the_size_bound(
        engines in proptest::collection::vec(engine_state(), 0..200),
        name in "[a-z0-9-]{0,80}",
    ) {
        let payloads = pack_state(&name, &engines);
        let mut decoded_engines = Vec::new();
        for (seq, payload) in payloads.into_iter().enumerate() {
            let packet = encode_packet(&key(), SENDER, seq as u64 + 1, &Payload::State(payload.clone()))
                .expect("packer keeps packets within the bound");
            prop_assert!(packet.len() <= MAX_PACKET_BYTES);
            let (header, decoded) = decode_packet(&key(), &packet).unwrap();
            prop_assert_eq!(header.kind, PacketType::State);
            prop_assert_eq!(header.seq, seq as u64 + 1);
            let Payload::State(state) = decoded else { panic!("not state") };
            prop_assert!(name.starts_with(&state.node));
            decoded_engines.extend(state.engines);
        }
        prop_assert_eq!(decoded_engines, engines);
    }

    #[test]
    fn routes_roundtrip_through_pieces_within_the_size_bound(
        routes in proptest::collection::vec(route(), 1..6),
    ) {
        let mut next_id = 0;
        let payloads = pack_routes(16, &routes, &mut next_id);
        let mut reassembly = Reassembly::default();
        let mut rebuilt = Vec::new();
        for (seq, payload) in payloads.into_iter().enumerate() {
            let packet = encode_packet(&key(), SENDER, seq as u64 + 1, &Payload::Routes(payload))
                .expect("packer keeps packets within the bound");
            prop_assert!(packet.len() <= MAX_PACKET_BYTES, "{} bytes", packet.len());
            let (_, decoded) = decode_packet(&key(), &packet).unwrap();
            let Payload::Routes(routes) = decoded else { panic!("not routes") };
            prop_assert_eq!(routes.block_size, 16);
            for chunk in routes.chunks {
                if let Some(route) = reassembly.add(SENDER.node, chunk, 0).unwrap() {
                    rebuilt.push(route);
                }
            }
        }
        let expected: Vec<Route> = routes
            .iter()
            .map(|route| Route {
                hashes: route.hashes[..route.hashes.len().min(MAX_ROUTE_BLOCKS)].into(),
                ..route.clone()
            })
            .collect();
        prop_assert_eq!(rebuilt, expected);
        prop_assert!(reassembly.is_empty());
    }

    #[test]
    fn a_v2_packet_with_appended_fields_decodes_with_the_v1_decoder(
        engines in proptest::collection::vec(engine_state(), 0..10),
        zone in "[a-z]{0,20}",
        weights in proptest::collection::vec(any::<u32>(), 0..20),
        extension in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let v2 = StatePayloadV2 { node: "n2".into(), engines: engines.clone(), zone, weights };
        let payload = bincode::serde::encode_to_vec(&v2, bincode::config::standard()).unwrap();
        let header = Header { version: 2, kind: PacketType::State, sender: 3, boot: 4, seq: 1 };
        let packet = encode_frame(&key(), &header, &payload, &extension).unwrap();
        let (decoded_header, decoded) = decode_packet(&key(), &packet).unwrap();
        prop_assert_eq!(decoded_header.version, 2);
        prop_assert_eq!(decoded, Payload::State(StatePayload { node: "n2".into(), engines }));
    }

    #[test]
    fn garbage_and_forged_packets_are_errors_never_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..1_600),
        kind in 0u8..8,
    ) {
        prop_assert!(decode_packet(&key(), &bytes).is_err());
        // Correctly signed garbage of every type: decodes or is a typed error.
        let header = Header { version: 1, kind: PacketType::Swim, sender: 1, boot: 1, seq: 1 };
        if let Ok(mut packet) = encode_frame(&key(), &header, &bytes, &[]) {
            packet.truncate(packet.len() - myelin_gossip::wire::MAC_BYTES);
            packet[5] = kind;
            let resigned = {
                let payload_end = packet.len();
                let payload = packet[myelin_gossip::wire::HEADER_BYTES..payload_end].to_vec();
                match PacketType::from_u8(kind) {
                    Some(kind) => encode_frame(&key(), &Header { kind, ..header }, &payload, &[]).ok(),
                    None => None,
                }
            };
            if let Some(resigned) = resigned {
                let _ = decode_packet(&key(), &resigned);
                let forged = ClusterKey::new(b"some other key, not the cluster's").unwrap();
                prop_assert_eq!(decode_packet(&forged, &resigned), Err(DecodeError::BadMac));
            }
        }
    }

    #[test]
    fn every_corruption_of_a_valid_packet_is_rejected(
        index in 0usize..200,
        flip in 1u8..=255,
    ) {
        let payload = Payload::Digest(DigestPayload {
            block_size: 16,
            routes: 3,
            buckets: vec![7; DIGEST_BUCKETS],
            reply: false,
        });
        let mut packet = encode_packet(&key(), SENDER, 9, &payload).unwrap();
        let index = index % packet.len();
        packet[index] ^= flip;
        prop_assert!(decode_frame(&key(), &packet).is_err());
    }
}

#[test]
fn malformed_route_pieces_are_refused() {
    let mut reassembly = Reassembly::default();
    let chunk = |offset: u32, total: u32, len: usize| RouteChunk {
        engine: 1,
        stamp: 2,
        id: 3,
        total_blocks: total,
        offset,
        hashes: Hashes(vec![9; len]),
    };
    assert!(reassembly.add(1, chunk(0, 0, 0), 0).is_err());
    assert!(reassembly.add(1, chunk(5, 6, 2), 0).is_err());
    assert!(
        reassembly
            .add(1, chunk(0, MAX_ROUTE_BLOCKS as u32 + 1, 1), 0)
            .is_err()
    );
    assert_eq!(reassembly.add(1, chunk(0, 4, 2), 0), Ok(None));
    let done = reassembly.add(1, chunk(2, 4, 2), 10).unwrap().unwrap();
    assert_eq!(done.hashes.len(), 4);
    // Pieces that never complete expire; the table stays bounded.
    for id in 0..10_000u32 {
        let piece = RouteChunk {
            id,
            ..chunk(0, 100, 1)
        };
        let _ = reassembly.add(7, piece, u64::from(id));
    }
    assert!(reassembly.len() <= myelin_gossip::state::MAX_PENDING_ROUTES);
    // A routes payload with hash bytes not a multiple of 8 is malformed.
    let bad = RoutesPayload {
        block_size: 16,
        chunks: vec![chunk(0, 1, 1)],
    };
    let mut bytes = Payload::Routes(bad).to_bytes();
    let last = bytes.len() - 9;
    bytes[last] = 7;
    assert!(Payload::from_bytes(PacketType::Routes, &bytes).is_err());
}

// ---- A cluster on a simulated network -------------------------------------------------------

fn addr(index: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9_000 + index as u16))
}

struct SimNode {
    node: GossipNode,
    alive: bool,
    learned: Vec<Route>,
    /// Why packets to it were dropped.
    refused: Vec<DecodeError>,
}

/// Nodes exchanging datagrams with no loss and 1 ms latency; time advances in 10 ms steps.
struct Sim {
    nodes: Vec<SimNode>,
    now_ms: u64,
    timers: Vec<(u64, usize, MembershipTimer)>,
    in_flight: Vec<(u64, usize, SocketAddr, Vec<u8>)>,
    sent: Vec<(usize, SocketAddr, Vec<u8>)>,
}

fn params() -> MembershipParams {
    MembershipParams {
        probe_period: Duration::from_millis(200),
        probe_rtt: Duration::from_millis(80),
        suspect_to_down_after: Duration::from_millis(600),
        max_members: myelin_gossip::DEFAULT_MAX_MEMBERS,
    }
}

impl Sim {
    fn new(count: usize) -> Sim {
        let mut sim = Sim {
            nodes: Vec::new(),
            now_ms: 0,
            timers: Vec::new(),
            in_flight: Vec::new(),
            sent: Vec::new(),
        };
        for index in 0..count {
            sim.start(index, 1);
        }
        sim
    }

    fn start(&mut self, index: usize, boot: u64) {
        self.start_with(index, boot, params(), addr(0));
    }

    fn start_with(&mut self, index: usize, boot: u64, params: MembershipParams, seed: SocketAddr) {
        let node = GossipNode::new(GossipConfig {
            node_name: format!("node-{index}"),
            addr: addr(index),
            boot,
            key: key(),
            params,
            block_size: 16,
            seeds: vec![seed],
        });
        let sim_node = SimNode {
            node,
            alive: true,
            learned: Vec::new(),
            refused: Vec::new(),
        };
        if index < self.nodes.len() {
            self.nodes[index] = sim_node;
            self.timers.retain(|(_, owner, _)| *owner != index);
        } else {
            self.nodes.push(sim_node);
        }
    }

    fn collect(&mut self, index: usize) {
        let node = &mut self.nodes[index].node;
        for (after, timer) in node.take_timers() {
            self.timers
                .push((self.now_ms + after.as_millis() as u64, index, timer));
        }
        node.take_events();
        for out in node.take_outgoing() {
            self.sent.push((index, out.to, out.packet.clone()));
            self.in_flight
                .push((self.now_ms + 1, index, out.to, out.packet));
        }
    }

    fn step(&mut self) {
        self.now_ms += 10;
        let now = self.now_ms;
        for index in 0..self.nodes.len() {
            if !self.nodes[index].alive {
                continue;
            }
            let node = &mut self.nodes[index].node;
            if now.is_multiple_of(200) {
                node.join_tick();
                node.flush_routes(16);
            }
            if now.is_multiple_of(500) {
                node.anti_entropy();
            }
            self.collect(index);
        }
        let due: Vec<_> = {
            let (due, later) = std::mem::take(&mut self.timers)
                .into_iter()
                .partition(|(at, _, _)| *at <= now);
            self.timers = later;
            due
        };
        for (_, index, timer) in due {
            if self.nodes[index].alive {
                self.nodes[index].node.handle_timer(timer);
                self.collect(index);
            }
        }
        let packets: Vec<_> = {
            let (due, later) = std::mem::take(&mut self.in_flight)
                .into_iter()
                .partition(|(at, _, _, _)| *at <= now);
            self.in_flight = later;
            due
        };
        for (_, from, to, packet) in packets {
            let Some(index) = (0..self.nodes.len()).find(|&index| addr(index) == to) else {
                continue;
            };
            if !self.nodes[index].alive {
                continue;
            }
            match self.nodes[index].node.receive(addr(from), &packet, now) {
                Ok(Received::Routes(routes)) => self.nodes[index].learned.extend(routes),
                Ok(_) => {}
                Err(error) => self.nodes[index].refused.push(error),
            }
            self.collect(index);
        }
    }

    fn run_until(&mut self, limit_ms: u64, mut done: impl FnMut(&Sim) -> bool) -> bool {
        let end = self.now_ms + limit_ms;
        while self.now_ms < end {
            if done(self) {
                return true;
            }
            self.step();
        }
        done(self)
    }

    fn up_members(&self, index: usize) -> usize {
        self.nodes[index]
            .node
            .members()
            .iter()
            .filter(|(_, state)| *state == MemberState::Up)
            .count()
    }
}

fn state(engine: u64, requests: u32, admitted: u64) -> EngineState {
    EngineState {
        engine,
        requests,
        tokens: u64::from(requests) * 100,
        admitted_tokens: admitted,
        capacity_tokens: Some(50_000),
        utilization_ppm: None,
        evicted_below: admitted / 2,
    }
}

#[test]
fn a_simulated_cluster_shares_membership_load_and_routes_and_survives_a_death() {
    let mut sim = Sim::new(3);
    assert!(
        sim.run_until(10_000, |sim| (0..3).all(|index| sim.up_members(index) == 2)),
        "every node sees the two others"
    );

    // Load: node 2 reports its figures on engine 77; the others count them.
    sim.nodes[2].node.send_state(&[state(77, 4, 9_000)]);
    sim.collect(2);
    assert!(sim.run_until(1_000, |sim| {
        sim.nodes[0]
            .node
            .cluster()
            .peer_load()
            .get(&77)
            .map(|load| load.requests)
            == Some(4)
    }));

    // Routes: node 1 learns a long route; nodes 0 and 2 receive it whole.
    let hashes: Arc<[u64]> = (1..=400u64).map(|i| i * 7919).collect();
    sim.nodes[1].node.learned(Route {
        engine: 77,
        stamp: 1_234,
        hashes: hashes.clone(),
    });
    assert!(sim.run_until(2_000, |sim| {
        [0, 2].iter().all(|&index| {
            sim.nodes[index]
                .learned
                .iter()
                .any(|route| route.hashes == hashes && route.stamp == 1_234)
        })
    }));

    // A replayed packet is refused.
    let (from, _, packet) = sim
        .sent
        .iter()
        .find(|(from, to, _)| *from == 1 && *to == addr(0))
        .cloned()
        .unwrap();
    assert_eq!(
        sim.nodes[0].node.receive(addr(from), &packet, sim.now_ms),
        Err(DecodeError::Replayed)
    );

    // Node 2 dies: the others declare it down, its load vanishes, the route stays.
    sim.nodes[2].alive = false;
    assert!(
        sim.run_until(
            params().detection_bound(3).as_millis() as u64 + 2_000,
            |sim| {
                sim.nodes[0]
                    .node
                    .cluster()
                    .peer(myelin_gossip::node_key("node-2"))
                    .is_none()
            }
        ),
        "node 2 declared down within the detection bound"
    );
    let load = sim.nodes[0].node.cluster().peer_load()[&77];
    assert_eq!((load.requests, load.tokens), (0, 0));
    assert_eq!(
        load.admitted_tokens, 9_000,
        "its admitted tokens stay counted"
    );
    assert_eq!(
        sim.nodes[0].node.cluster().peer_evicted().get(&77),
        Some(&4_500),
        "what it learned of the engine's evictions stays true"
    );
    assert!(sim.nodes[0].node.routes().len() == 1);

    // Node 2 restarts (a new boot) with nothing: it rejoins and anti-entropy brings it the
    // route.
    sim.start(2, 2);
    assert!(sim.run_until(10_000, |sim| {
        sim.up_members(2) == 2
            && sim.nodes[2]
                .learned
                .iter()
                .any(|route| route.hashes == hashes)
    }));
    // Its new incarnation's state is accepted.
    sim.nodes[2].node.send_state(&[state(77, 1, 10)]);
    sim.collect(2);
    assert!(sim.run_until(1_000, |sim| {
        sim.nodes[0]
            .node
            .cluster()
            .peer_load()
            .get(&77)
            .map(|load| load.requests)
            == Some(1)
    }));

    // Node 1 leaves: the others know at once (well within one probe period), not after the
    // failure detector's bound. Names of nodes that sent their state stay known for listings.
    sim.nodes[1].node.leave();
    sim.collect(1);
    sim.nodes[1].alive = false;
    let node_1 = myelin_gossip::node_key("node-1");
    assert!(sim.run_until(50, |sim| {
        sim.nodes[0]
            .node
            .members()
            .iter()
            .any(|(id, state)| id.node == node_1 && *state == MemberState::Down)
    }));
    assert!(sim.nodes[0].node.cluster().peer(node_1).is_none());
    assert_eq!(
        sim.nodes[0]
            .node
            .cluster()
            .name(myelin_gossip::node_key("node-2")),
        Some("node-2")
    );
}

/// A node whose member table holds 2 in a cluster of 5: whatever the others send it, its
/// table never holds more; updates about the others are left out of their packets and packets
/// from senders past the cap are refused, both counted; the others still see each other. (The
/// capped node itself is not a stable member of a cluster bigger than its cap: the members it
/// refuses find it silent. Size the cap above the cluster.)
#[test]
fn the_member_table_never_grows_past_its_cap() {
    let mut sim = Sim::new(5);
    assert!(
        sim.run_until(20_000, |sim| (0..5).all(|index| sim.up_members(index) == 4)),
        "every node sees the four others"
    );
    // Node 0 restarts with room for two and joins through node 1, whose answer lists every
    // member; the three others keep probing it.
    sim.start_with(
        0,
        2,
        MembershipParams {
            max_members: 2,
            ..params()
        },
        addr(1),
    );
    for _ in 0..1_000 {
        sim.step();
        let held = sim.nodes[0].node.members().len();
        assert!(held <= 2, "node 0 holds {held} members");
    }
    assert!(sim.up_members(0) >= 1, "node 0 joined");
    assert!(
        sim.nodes[0].node.counters().members_refused > 0,
        "updates about the others were left out"
    );
    assert!(
        sim.nodes[0].refused.contains(&DecodeError::MemberCap),
        "packets from senders past the cap are refused: {:?}",
        sim.nodes[0].refused
    );
    assert!((1..5).all(|index| sim.up_members(index) >= 3));
}

#[test]
fn packets_from_another_process_with_this_node_id_are_refused() {
    let mut node = GossipNode::new(GossipConfig {
        node_name: "twin".into(),
        addr: addr(60),
        boot: 5,
        key: key(),
        params: params(),
        block_size: 16,
        seeds: vec![],
    });
    let twin = Sender {
        node: myelin_gossip::node_key("twin"),
        boot: 6,
    };
    let payload = Payload::Digest(DigestPayload {
        block_size: 16,
        routes: 0,
        buckets: vec![0; DIGEST_BUCKETS],
        reply: false,
    });
    let packet = encode_packet(&key(), twin, 1, &payload).unwrap();
    assert_eq!(
        node.receive(addr(61), &packet, 0),
        Err(DecodeError::DuplicateNode)
    );
}

#[test]
fn state_from_a_non_member_is_refused() {
    let mut lonely = GossipNode::new(GossipConfig {
        node_name: "lonely".into(),
        addr: addr(50),
        boot: 1,
        key: key(),
        params: params(),
        block_size: 16,
        seeds: vec![],
    });
    let payload = Payload::State(StatePayload {
        node: "stranger".into(),
        engines: vec![state(1, 1, 1)],
    });
    let packet = encode_packet(&key(), Sender { node: 99, boot: 1 }, 1, &payload).unwrap();
    assert_eq!(
        lonely.receive(addr(51), &packet, 0),
        Err(DecodeError::NotMember)
    );
    assert!(lonely.cluster().peer_load().is_empty());
}

#[test]
fn a_late_joiner_gets_every_route_by_anti_entropy_even_beyond_one_exchange() {
    let mut sim = Sim::new(1);
    // 300 routes of 100 blocks: over ten times what one anti-entropy answer carries.
    for route in 0..300u64 {
        let hashes: Arc<[u64]> = (0..100u64).map(|block| route << 32 | block).collect();
        sim.nodes[0].node.learned(Route {
            engine: 5,
            stamp: route,
            hashes,
        });
    }
    sim.run_until(500, |_| false);
    assert_eq!(sim.nodes[0].node.routes().len(), 300);
    sim.start(1, 1);
    assert!(
        sim.run_until(60_000, |sim| sim.nodes[1].node.routes().len() == 300),
        "the joiner holds {} of 300 routes",
        sim.nodes[1].node.routes().len()
    );
    assert_eq!(sim.nodes[1].learned.len(), 300);
}

#[test]
fn routes_from_a_non_member_are_refused() {
    let mut lonely = GossipNode::new(GossipConfig {
        node_name: "lonely".into(),
        addr: addr(52),
        boot: 1,
        key: key(),
        params: params(),
        block_size: 16,
        seeds: vec![],
    });
    let mut next_id = 0;
    let payloads = pack_routes(
        16,
        &[Route {
            engine: 1,
            stamp: u64::MAX,
            hashes: (1..=8u64).collect(),
        }],
        &mut next_id,
    );
    for (seq, payload) in payloads.into_iter().enumerate() {
        let packet = encode_packet(
            &key(),
            Sender { node: 98, boot: 1 },
            seq as u64 + 1,
            &Payload::Routes(payload),
        )
        .unwrap();
        assert_eq!(
            lonely.receive(addr(53), &packet, 0),
            Err(DecodeError::NotMember)
        );
    }
    assert!(lonely.routes().is_empty());
}

#[test]
fn a_peers_figures_are_bounded_where_they_enter() {
    use myelin_gossip::state::{
        ClusterState, MAX_ADMITTED_TOKENS_PER_S, MAX_FIRST_ADMITTED_TOKENS, MAX_PEER_REQUESTS,
        MAX_PEER_TOKENS,
    };
    let hostile = |admitted_tokens, evicted_below| StatePayload {
        node: "hostile".into(),
        engines: vec![EngineState {
            engine: 5,
            requests: u32::MAX,
            tokens: u64::MAX,
            admitted_tokens,
            capacity_tokens: Some(u64::MAX),
            utilization_ppm: Some(u32::MAX),
            evicted_below,
        }],
    };
    let mut cluster = ClusterState::new();
    cluster.set_own_admitted(5, 1_000);
    assert!(cluster.apply_state(7, 1, hostile(u64::MAX, u64::MAX), 1_000));
    let engine = &cluster.peer(7).unwrap().engines[&5];
    assert_eq!(engine.requests, MAX_PEER_REQUESTS);
    assert_eq!(engine.tokens, MAX_PEER_TOKENS);
    assert_eq!(engine.capacity_tokens, Some(MAX_PEER_TOKENS));
    assert_eq!(engine.utilization_ppm, Some(1_000_000));
    assert_eq!(engine.admitted_tokens, MAX_FIRST_ADMITTED_TOKENS);
    // An evicted-below stamp is never ahead of the clock (own 1,000 + the peer's counter).
    assert_eq!(
        cluster.peer_evicted()[&5],
        1_000 + MAX_FIRST_ADMITTED_TOKENS
    );
    assert_eq!(cluster.clamped_values(), 6);
    // Many such peers cannot wrap the sums.
    for node in 100..300 {
        cluster.apply_state(node, 1, hostile(u64::MAX, 0), 1_000);
    }
    let load = cluster.peer_load()[&5];
    assert_eq!(load.requests, 201 * MAX_PEER_REQUESTS);
    assert_eq!(load.admitted_tokens, 201 * MAX_FIRST_ADMITTED_TOKENS);

    // The counter grows at most at the bounded rate and never goes back.
    let mut cluster = ClusterState::new();
    assert!(cluster.apply_state(7, 1, hostile(10_000, 0), 0));
    cluster.apply_state(7, 1, hostile(u64::MAX, 0), 2_000);
    let grown = cluster.peer(7).unwrap().engines[&5].admitted_tokens;
    assert_eq!(grown, 10_000 + 3 * MAX_ADMITTED_TOKENS_PER_S);
    cluster.apply_state(7, 1, hostile(5, 0), 2_100);
    assert_eq!(cluster.peer(7).unwrap().engines[&5].admitted_tokens, grown);
    // A plausible report passes untouched.
    let before = cluster.clamped_values();
    cluster.apply_state(7, 1, hostile(grown + 500, grown / 2), 2_200);
    let engine = &cluster.peer(7).unwrap().engines[&5];
    assert_eq!(engine.admitted_tokens, grown + 500);
    assert_eq!(cluster.peer_evicted()[&5], grown / 2);
    // (requests, tokens, capacity and utilization are still past their bounds: 4 clamps)
    assert_eq!(cluster.clamped_values(), before + 4);
    // A restart (a later boot) starts its counters afresh.
    cluster.apply_state(7, 2, hostile(42, 0), 2_300);
    assert_eq!(cluster.peer(7).unwrap().engines[&5].admitted_tokens, 42);
}

#[test]
fn a_peer_sending_routes_past_its_budget_is_refused_until_the_budget_refills() {
    use myelin_gossip::node::MAX_ROUTE_BLOCKS_PER_PEER_PER_S;
    let mut sim = Sim::new(2);
    assert!(
        sim.run_until(10_000, |sim| sim.up_members(0) == 1
            && sim.up_members(1) == 1),
        "the two nodes see each other"
    );
    let sender = Sender {
        node: myelin_gossip::node_key("node-1"),
        boot: 1,
    };
    let routes: Vec<Route> = (0..200u64)
        .map(|index| Route {
            engine: 77,
            stamp: index,
            hashes: (0..2_000u64).map(|block| index << 32 | block).collect(),
        })
        .collect();
    let mut next_id = 0;
    let payloads = pack_routes(16, &routes, &mut next_id);
    let now = sim.now_ms;
    let mut accepted_blocks = 0u64;
    let mut refused = 0;
    for (seq, payload) in payloads.iter().enumerate() {
        let blocks: u64 = payload
            .chunks
            .iter()
            .map(|chunk| chunk.hashes.0.len() as u64)
            .sum();
        let packet = encode_packet(
            &key(),
            sender,
            1_000_000 + seq as u64,
            &Payload::Routes(payload.clone()),
        )
        .unwrap();
        match sim.nodes[0].node.receive(addr(1), &packet, now) {
            Ok(_) => accepted_blocks += blocks,
            Err(DecodeError::RateLimited) => refused += 1,
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert!(
        accepted_blocks <= MAX_ROUTE_BLOCKS_PER_PEER_PER_S,
        "{accepted_blocks}"
    );
    assert!(
        accepted_blocks > MAX_ROUTE_BLOCKS_PER_PEER_PER_S / 2,
        "{accepted_blocks}"
    );
    assert!(refused > 0);
    // A second later the budget has refilled.
    let later = encode_packet(
        &key(),
        sender,
        2_000_000,
        &Payload::Routes(payloads[payloads.len() - 1].clone()),
    )
    .unwrap();
    assert!(
        sim.nodes[0]
            .node
            .receive(addr(1), &later, now + 1_000)
            .is_ok()
    );
}
