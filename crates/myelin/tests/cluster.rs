//! The peer cluster end to end: real `myelin serve` processes gossiping over loopback UDP in
//! front of the same engines (the scriptable engine fixture). Routes learned on one node are
//! used by the others, load on one node moves the others' choices, a killed node is detected
//! and its load vanishes while its routes stay, a restarted node rejoins and converges, and
//! forged, garbage and replayed datagrams are counted and ignored. Every wait polls with a
//! deadline; nothing asserts on how long something took.

mod support;

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use myelin_gossip::messages::{DIGEST_BUCKETS, DigestPayload, Sender};
use myelin_gossip::{ClusterKey, EngineState, Payload, encode_packet};
use serde_json::{Value, json};
use support::engine::{Behavior, Engine};
use support::{Router, metric_value};

/// An engine that answers at once, in one chunk.
const ONE_CHUNK: Behavior = Behavior::Normal {
    chunks: 1,
    interval: Duration::ZERO,
};

/// Probe period the tests run the failure detector with (`--gossip-probe-interval-ms`).
const PROBE_MS: u64 = 200;
const KEY: &str = "myelin cluster test key: 32 bytes or more";

/// Deadline for waits on the cluster: generous, the machine is shared and busy.
const CLUSTER_PATIENCE: Duration = Duration::from_secs(30);

fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + CLUSTER_PATIENCE;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A cluster key file of one test, removed with its directory when the test ends.
struct KeyFile {
    path: PathBuf,
}

impl std::ops::Deref for KeyFile {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn key_file() -> KeyFile {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let test = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("myelin-cluster-test-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("cluster.key");
    std::fs::write(&path, format!("{KEY}\n")).expect("key file");
    KeyFile { path }
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|socket| socket.local_addr())
        .expect("free port")
        .port()
}

fn gossip_addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// Starts one node (one data core) in front of `engines`, joining through `seeds`.
/// A node with the cost in tokens: the test using it steers fresh prompts onto one engine
/// through the token cost's load bound (loads within it tie, and ties follow the rotation),
/// which the cost in seconds does not have (it sends a fresh prompt away from held requests).
fn start_node(name: &str, port: u16, seeds: &[u16], key: &Path, engines: &[&Engine]) -> Router {
    start_node_with(
        name,
        port,
        seeds,
        key,
        engines,
        PROBE_MS,
        &["--cost", "tokens"],
    )
}

fn start_node_probing(
    name: &str,
    port: u16,
    seeds: &[u16],
    key: &Path,
    engines: &[&Engine],
    probe_ms: u64,
) -> Router {
    start_node_with(name, port, seeds, key, engines, probe_ms, &[])
}

fn start_node_with(
    name: &str,
    port: u16,
    seeds: &[u16],
    key: &Path,
    engines: &[&Engine],
    probe_ms: u64,
    extra: &[&str],
) -> Router {
    let listen = gossip_addr(port);
    let key = key.display().to_string();
    let probe = probe_ms.to_string();
    let urls: Vec<String> = engines.iter().map(|engine| engine.url()).collect();
    let seeds: Vec<String> = seeds.iter().map(|&seed| gossip_addr(seed)).collect();
    let mut args = vec![
        "--gossip-listen",
        &listen,
        "--node-id",
        name,
        "--cluster-key-file",
        &key,
        "--gossip-probe-interval-ms",
        &probe,
        // Requests held open at an engine stay in flight for the whole test.
        "--upstream-header-timeout-ms",
        "300000",
    ];
    for url in &urls {
        args.extend(["--backend", url]);
    }
    for seed in &seeds {
        args.extend(["--peer", seed]);
    }
    args.extend_from_slice(extra);
    Router::start_with_shards(1, &args)
}

fn cluster(router: &Router) -> Value {
    router.admin("GET", "/admin/cluster", None).json()
}

/// Members `router` sees up, by node id.
fn members_up(router: &Router) -> Vec<String> {
    let report = cluster(router);
    report["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|member| member["state"] == "up")
        .filter_map(|member| member["node_id"].as_str().map(str::to_string))
        .collect()
}

/// State of the member `node` in `router`'s view (`None`: not listed).
fn member_state(router: &Router, node: &str) -> Option<String> {
    let report = cluster(router);
    report["members"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|member| member["node_id"] == node)
        .and_then(|member| member["state"].as_str().map(str::to_string))
}

/// Requests the other nodes have in flight at the engine `url`, as `router` hears.
fn peer_requests(router: &Router, url: &str) -> u64 {
    let report = cluster(router);
    report["peer_load"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|load| load["url"] == url)
        .and_then(|load| load["requests"].as_u64())
        .unwrap_or(0)
}

/// Blocks `router`'s replica holds as routed to backend `id`.
fn routed_blocks(router: &Router, id: u64) -> u64 {
    router
        .backends()
        .iter()
        .find(|backend| backend["id"] == id)
        .and_then(|backend| backend["routed_blocks"].as_u64())
        .unwrap_or(0)
}

/// Tokens admitted to backend `id` as `router`'s (first) data core's residency estimate counts
/// them.
fn admitted_clock(router: &Router, id: u64) -> u64 {
    router
        .backends()
        .iter()
        .find(|backend| backend["id"] == id)
        .and_then(|backend| backend["residency_estimate"][0]["admitted_tokens_clock"].as_u64())
        .unwrap_or(0)
}

/// A prompt of token ids no other call of this test uses.
fn prompt(seed: u32, tokens: u32) -> Vec<u32> {
    (0..tokens)
        .map(|token| 1_000 + seed * 7_919 + token)
        .collect()
}

fn completion_body(prompt: &[u32]) -> Value {
    json!({"model": "test-model", "prompt": prompt, "max_tokens": 4})
}

/// Sends a completion and returns the backend id that served it.
fn complete(router: &Router, prompt: &[u32]) -> u64 {
    let response = router.post_json("/v1/completions", &completion_body(prompt));
    assert_eq!(response.status, 200);
    response
        .header("x-myelin-backend")
        .expect("backend header")
        .parse()
        .expect("backend id")
}

/// Sends a completion without reading the answer: it stays in flight while the engine holds it.
/// Streaming: a non-streaming request's prompt stops counting as queued prefill once its
/// predicted time to first token has passed, and these must keep their load while held.
fn hold_open(router: &Router, prompt: &[u32]) -> TcpStream {
    let mut body = completion_body(prompt);
    body["stream"] = json!(true);
    router.post_json_unread("/v1/completions", &body)
}

#[test]
fn three_nodes_share_routes_and_load_detect_a_death_and_converge_after_a_restart() {
    let key = key_file();
    let engines = [
        Engine::start("e0", ONE_CHUNK),
        Engine::start("e1", ONE_CHUNK),
    ];
    let engine_refs: Vec<&Engine> = engines.iter().collect();
    let ports = [free_udp_port(), free_udp_port(), free_udp_port()];
    let a = start_node("a", ports[0], &[], &key, &engine_refs);
    let b = start_node("b", ports[1], &[ports[0]], &key, &engine_refs);
    let mut c = Some(start_node("c", ports[2], &[ports[0]], &key, &engine_refs));
    wait_for("every node to see the two others up", || {
        [&a, &b, c.as_ref().unwrap()]
            .iter()
            .all(|node| members_up(node).len() == 2)
    });

    // A route learned on A reaches B. The prompt is long (4096 tokens): its cached prefix
    // outweighs the load the next steps put on its engine.
    let long = prompt(1, 4_096);
    let x = complete(&a, &long);
    let y = 1 - x;
    let blocks = 4_096 / 16;
    wait_for("B to hold A's route", || routed_blocks(&b, x) >= blocks);

    // Load from A: requests held at engine x (one node's only core chooses x for a fresh
    // prompt at equal load: the first decision of a node goes to the same backend on every
    // node of the same configuration, as A's first one did).
    engines[x as usize].set_behavior(Behavior::Hang);
    let held_before = engines[x as usize].requests();
    let mut held = Vec::new();
    for seed in 10..20 {
        if engines[x as usize].requests() >= held_before + 3 {
            break;
        }
        let seen = engines[0].requests() + engines[1].requests();
        held.push(hold_open(&a, &prompt(seed, 1_000)));
        wait_for("the held request to reach an engine", || {
            engines[0].requests() + engines[1].requests() > seen
        });
    }
    wait_for("three requests from A in flight at x", || {
        engines[x as usize].requests() >= held_before + 3
    });
    engines[x as usize].set_behavior(ONE_CHUNK);
    let x_url = engines[x as usize].url();
    wait_for("B to hear of A's load on x", || {
        peer_requests(&b, &x_url) >= 3
    });
    // B's residency estimate counts the tokens A admitted to x (B sent x nothing yet).
    wait_for("B's estimate to count A's admitted tokens on x", || {
        admitted_clock(&b, x) >= 3 * 1_000
    });

    // ... moves B's choice of a fresh prompt away from x (its first decision, which at equal
    // load would have been x).
    assert_eq!(
        complete(&b, &prompt(30, 1_000)),
        y,
        "B counts A's load on x"
    );
    // ... while the prefix A learned still wins on B despite that load.
    assert_eq!(complete(&b, &long), x, "B routes A's prefix to A's engine");

    // C learns a route (to y: x carries A's load) and puts load on y (its next fresh prompt
    // goes to y, the less loaded).
    wait_for("C to hear of A's load on x", || {
        peer_requests(c.as_ref().unwrap(), &x_url) >= 3
    });
    let y_blocks_before = routed_blocks(&a, y);
    let c_long = prompt(2, 4_096);
    assert_eq!(complete(c.as_ref().unwrap(), &c_long), y);
    wait_for("A to hold C's route", || {
        routed_blocks(&a, y) >= y_blocks_before + blocks
    });
    engines[y as usize].set_behavior(Behavior::Hang);
    let y_url = engines[y as usize].url();
    let held_by_c = hold_open(c.as_ref().unwrap(), &prompt(40, 1_000));
    wait_for("A to hear of C's load on y", || {
        peer_requests(&a, &y_url) >= 1
    });
    let routes_before_death = routed_blocks(&a, y);

    // C dies: A detects it, C's load vanishes, C's routes stay.
    drop(c.take());
    drop(held_by_c);
    wait_for("A to declare C down", || {
        member_state(&a, "c").is_none_or(|state| state == "down")
    });
    wait_for("C's load to vanish from A's view", || {
        peer_requests(&a, &y_url) == 0
    });
    assert!(
        routed_blocks(&a, y) >= routes_before_death,
        "a dead node's routes stay"
    );
    assert!(
        peer_requests(&a, &x_url) == 0,
        "A's own load is not a peer's"
    );
    assert!(peer_requests(&b, &x_url) >= 3, "A's load stays in B's view");
    engines[y as usize].set_behavior(ONE_CHUNK);

    // A restarted C (new process, empty replica) rejoins and converges: membership, the
    // others' load, and the routes learned before it started (anti-entropy).
    let c = start_node("c", ports[2], &[ports[0]], &key, &engine_refs);
    wait_for("the restarted C to rejoin", || {
        members_up(&c).len() == 2
            && member_state(&a, "c").as_deref() == Some("up")
            && member_state(&b, "c").as_deref() == Some("up")
    });
    wait_for("the restarted C to hear of A's load", || {
        peer_requests(&c, &x_url) >= 3
    });
    wait_for(
        "the restarted C to hold the routes learned before it",
        // Everything A holds: its own routes and those it learned from B and the dead C.
        || {
            routed_blocks(&c, x) >= routed_blocks(&a, x)
                && routed_blocks(&c, y) >= routed_blocks(&a, y)
        },
    );
    assert_eq!(complete(&c, &long), x, "C routes A's prefix to A's engine");
    drop(held);
}

#[test]
fn forged_garbage_and_replayed_datagrams_are_counted_and_ignored() {
    let key = key_file();
    let engine = Engine::start("solo", ONE_CHUNK);
    let port = free_udp_port();
    // This node's gossip is configured by environment variables only.
    let listen = gossip_addr(port);
    let key_path = key.display().to_string();
    let url = engine.url();
    let node = Router::start_raw(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--shards",
            "1",
            "--no-pin",
            "--backend",
            &url,
        ],
        &[
            ("MYELIN_GOSSIP_LISTEN", &listen),
            ("MYELIN_CLUSTER_KEY_FILE", &key_path),
            ("MYELIN_NODE_ID", "solo"),
        ],
    );
    let target: SocketAddr = gossip_addr(port).parse().unwrap();
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");

    let digest = Payload::Digest(DigestPayload {
        block_size: 16,
        routes: 0,
        buckets: vec![0; DIGEST_BUCKETS],
        reply: true,
    });
    let stranger = Sender { node: 42, boot: 7 };
    let forged_key = ClusterKey::new(b"not the cluster key, but long enough").unwrap();
    let forged = encode_packet(&forged_key, stranger, 1, &digest).unwrap();
    let genuine = encode_packet(
        &ClusterKey::new(KEY.as_bytes()).unwrap(),
        stranger,
        1,
        &digest,
    )
    .unwrap();
    let mut truncated = genuine.clone();
    truncated.truncate(20);
    let mut flipped = genuine.clone();
    flipped[40] ^= 1;
    for datagram in [
        b"hello, is this the gossip port? ".repeat(4),
        vec![0xff; 1_500],
        truncated,
        forged,
        flipped,
        genuine.clone(),
        genuine,
    ] {
        socket.send_to(&datagram, target).expect("send");
    }
    let dropped = |metrics: &str, reason: &str| {
        metric_value(
            metrics,
            &[
                "myelin_gossip_packets_dropped_total",
                &format!("reason=\"{reason}\""),
            ],
        )
    };
    let mut metrics = String::new();
    let counted = |metrics: &mut String| {
        *metrics = node.metrics();
        let text: &str = metrics;
        dropped(text, "bad_magic") >= 1.0
            && dropped(text, "oversize") >= 1.0
            && dropped(text, "short") >= 1.0
            && dropped(text, "bad_mac") >= 2.0
            && dropped(text, "replayed") >= 1.0
            && dropped(text, "not_member") >= 1.0
    };
    let deadline = Instant::now() + CLUSTER_PATIENCE;
    while !counted(&mut metrics) {
        let gossip: Vec<&str> = metrics
            .lines()
            .filter(|line| line.contains("gossip"))
            .collect();
        assert!(
            Instant::now() < deadline,
            "datagrams not counted: {gossip:#?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Nothing a stranger sent made it a member, and the node still serves.
    assert!(members_up(&node).is_empty());
    assert_eq!(cluster(&node)["node_id"], "solo");
    assert_eq!(complete(&node, &prompt(3, 64)), 0);
}

#[test]
fn a_node_stopped_with_sigterm_leaves_the_cluster_at_once() {
    let key = key_file();
    let engine = Engine::start("shared", ONE_CHUNK);
    // Probing every 20 s, the failure detector alone would take over a minute to declare a
    // dead node down: seeing it down sooner means the node said it was leaving.
    let ports = [free_udp_port(), free_udp_port()];
    let a = start_node_probing("a", ports[0], &[], &key, &[&engine], 20_000);
    let mut b = start_node_probing("b", ports[1], &[ports[0]], &key, &[&engine], 20_000);
    wait_for("A and B to see each other", || {
        members_up(&a) == ["b"] && members_up(&b) == ["a"]
    });
    b.terminate();
    assert!(b.wait_exit().success());
    wait_for("A to see B leave", || {
        member_state(&a, "b").as_deref() == Some("down")
    });
}

#[test]
fn gossip_without_a_cluster_key_refuses_to_start() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_myelin"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--backend",
            "http://127.0.0.1:9",
            "--gossip-listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run myelin");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--cluster-key-file"), "{stderr}");
}

/// A peer driven by this test: a real [`GossipNode`] with the cluster key on a real UDP socket,
/// which can say anything the wire format can carry.
struct HostilePeer {
    node: myelin_gossip::GossipNode,
    socket: UdpSocket,
    started: Instant,
    timers: Vec<(u64, myelin_gossip::MembershipTimer)>,
}

impl HostilePeer {
    fn join(target: u16) -> HostilePeer {
        HostilePeer::join_as("hostile", target)
    }

    fn join_as(name: &str, target: u16) -> HostilePeer {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
        socket
            .set_read_timeout(Some(Duration::from_millis(5)))
            .expect("timeout");
        let node = myelin_gossip::GossipNode::new(myelin_gossip::GossipConfig {
            node_name: name.into(),
            addr: socket.local_addr().expect("addr"),
            boot: 1,
            key: ClusterKey::new(KEY.as_bytes()).unwrap(),
            params: myelin_gossip::MembershipParams {
                probe_period: Duration::from_millis(PROBE_MS),
                probe_rtt: Duration::from_millis(PROBE_MS / 2),
                suspect_to_down_after: Duration::from_millis(PROBE_MS * 5),
                max_members: myelin_gossip::DEFAULT_MAX_MEMBERS,
            },
            block_size: 16,
            seeds: vec![gossip_addr(target).parse().unwrap()],
        });
        HostilePeer {
            node,
            socket,
            started: Instant::now(),
            timers: Vec::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Sends what the node has to send, fires its due timers, takes in what arrived.
    fn pump(&mut self) {
        let now = self.now_ms();
        self.node.join_tick();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.timers)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.timers = later;
        for (_, timer) in due {
            self.node.handle_timer(timer);
        }
        let mut buffer = [0u8; 2048];
        while let Ok((len, from)) = self.socket.recv_from(&mut buffer) {
            let _ = self.node.receive(from, &buffer[..len], self.now_ms());
        }
        for (after, timer) in self.node.take_timers() {
            self.timers.push((now + after.as_millis() as u64, timer));
        }
        self.node.take_events();
        for out in self.node.take_outgoing() {
            let _ = self.socket.send_to(&out.packet, out.to);
        }
    }

    /// Pumps until `condition` holds (deadline: [`CLUSTER_PATIENCE`]).
    fn pump_until(&mut self, what: &str, mut condition: impl FnMut(&mut Self) -> bool) {
        let deadline = Instant::now() + CLUSTER_PATIENCE;
        while !condition(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            self.pump();
        }
    }
}

/// A flood of forged datagrams that pass the magic check and fail the HMAC (the costliest a
/// sender without the key can make): the control core's other tasks still run (each receive
/// is an io_uring completion, and the loop yields every 64 datagrams besides), so the admin
/// API answers while the flood is still going (the flood stops when it has, or after 20 s: an
/// answer that waited for the flood to end fails the test), and requests are served.
#[test]
fn a_flood_of_forged_gossip_does_not_starve_the_control_core() {
    let key = key_file();
    let engine = Engine::start("flooded", ONE_CHUNK);
    let port = free_udp_port();
    let node = start_node_probing("flooded", port, &[], &key, &[&engine], PROBE_MS);
    let forged = encode_packet(
        &ClusterKey::new(b"not the cluster key, but long enough").unwrap(),
        Sender { node: 7, boot: 1 },
        1,
        &Payload::Digest(DigestPayload {
            block_size: 16,
            routes: 0,
            buckets: vec![0; DIGEST_BUCKETS],
            reply: true,
        }),
    )
    .unwrap();
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let answered = answered.clone();
        let target: SocketAddr = gossip_addr(port).parse().unwrap();
        std::thread::spawn(move || {
            let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
            let until = Instant::now() + Duration::from_secs(20);
            let mut sent = 0u64;
            while !answered.load(std::sync::atomic::Ordering::SeqCst) {
                if Instant::now() > until {
                    return (sent, false);
                }
                for _ in 0..256 {
                    let _ = socket.send_to(&forged, target);
                }
                sent += 256;
            }
            (sent, true)
        })
    };
    // Let the flood reach the node, then ask the admin API and send a request meanwhile.
    let before = Instant::now();
    while metric_value(
        &node.metrics(),
        &["myelin_gossip_packets_dropped_total", "reason=\"bad_mac\""],
    ) < 1_000.0
    {
        assert!(
            before.elapsed() < CLUSTER_PATIENCE,
            "the flood never arrived"
        );
    }
    assert_eq!(node.admin("GET", "/admin/backends", None).status, 200);
    assert_eq!(complete(&node, &prompt(5, 64)), 0);
    answered.store(true, std::sync::atomic::Ordering::SeqCst);
    let (sent, during) = flood.join().expect("flood thread");
    assert!(
        during,
        "the admin API answered only after the flood ({sent} datagrams)"
    );
}

/// Peers holding the key, more than `--gossip-max-members`: the node's member table holds
/// the cap and no more (so it probes and sends state to no more addresses than that), the
/// rest are refused and counted, and the node still serves.
#[test]
fn peers_past_the_member_cap_are_refused() {
    let key = key_file();
    let engine = Engine::start("capped", ONE_CHUNK);
    let port = free_udp_port();
    let node = start_node_with(
        "capped",
        port,
        &[],
        &key,
        &[&engine],
        PROBE_MS,
        &["--gossip-max-members", "2"],
    );
    let mut peers: Vec<HostilePeer> = (0..4)
        .map(|index| HostilePeer::join_as(&format!("peer-{index}"), port))
        .collect();
    let member_cap = |node: &Router| {
        metric_value(
            &node.metrics(),
            &[
                "myelin_gossip_packets_dropped_total",
                "reason=\"member_cap\"",
            ],
        )
    };
    let deadline = Instant::now() + CLUSTER_PATIENCE;
    loop {
        for peer in &mut peers {
            peer.pump();
        }
        let report = cluster(&node);
        let held = report["members"].as_array().map_or(0, Vec::len);
        assert!(held <= 2, "past the cap: {report}");
        if report["members_up"] == 2 && member_cap(&node) >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "two members and refusals: {report}"
        );
    }
    // A while later: still two, and the node still routes.
    let until = Instant::now() + Duration::from_millis(PROBE_MS * 6);
    while Instant::now() < until {
        for peer in &mut peers {
            peer.pump();
        }
    }
    let report = cluster(&node);
    assert!(
        report["members"].as_array().map_or(0, Vec::len) <= 2,
        "{report}"
    );
    assert_eq!(complete(&node, &prompt(3, 64)), 0);
}

#[test]
fn a_hostile_peer_with_the_key_cannot_poison_the_shared_state() {
    let key = key_file();
    let engine = Engine::start("target", ONE_CHUNK);
    let port = free_udp_port();
    let node = start_node_probing("honest", port, &[], &key, &[&engine], PROBE_MS);
    let mut peer = HostilePeer::join(port);
    // (A member's node id shows once its first state arrived: count members instead.)
    peer.pump_until("the hostile peer to be a member", |peer| {
        peer.node.active_members() == 1 && cluster(&node)["members_up"] == 1
    });
    // Some traffic of the node's own: its clock moves.
    complete(&node, &prompt(1, 64));
    wait_for("the node's own clock", || admitted_clock(&node, 0) > 0);

    // Every figure at its maximum, and a route stamped at the end of time.
    let url = engine.url();
    let engine_key = myelin_gossip::engine_key(&url);
    peer.node.send_state(&[EngineState {
        engine: engine_key,
        requests: u32::MAX,
        tokens: u64::MAX,
        admitted_tokens: u64::MAX,
        capacity_tokens: Some(u64::MAX),
        utilization_ppm: Some(u32::MAX),
        evicted_below: u64::MAX,
    }]);
    peer.node.learned(myelin_gossip::Route {
        engine: engine_key,
        stamp: u64::MAX,
        hashes: (1..=32u64).map(|block| block * 104_729).collect(),
    });
    peer.node.flush_routes(8);
    let clamped = |node: &Router| {
        metric_value(
            &node.metrics(),
            &["myelin_gossip_peer_values_clamped_total"],
        )
    };
    peer.pump_until("the hostile figures to be clamped", |_| {
        clamped(&node) >= 7.0
            && metric_value(&node.metrics(), &["myelin_gossip_routes_applied_total"]) >= 1.0
    });

    // What the node took in is bounded: in-flight requests, the clock, the evicted stamp.
    assert_eq!(
        peer_requests(&node, &url),
        u64::from(myelin_gossip::state::MAX_PEER_REQUESTS)
    );
    let bound = myelin_gossip::state::MAX_FIRST_ADMITTED_TOKENS + 1_000_000;
    wait_for("the peer's counter in the node's clock", || {
        admitted_clock(&node, 0) > myelin_gossip::state::MAX_FIRST_ADMITTED_TOKENS
    });
    let estimate = &node.backends()[0]["residency_estimate"][0];
    let clock = estimate["admitted_tokens_clock"].as_u64().unwrap();
    let evicted = estimate["evicted_below_stamp"].as_u64().unwrap();
    assert!(clock < bound, "clock {clock}");
    assert!(evicted < bound, "evicted below {evicted}");
    // The node still answers and routes.
    assert_eq!(complete(&node, &prompt(2, 64)), 0);

    // Routes from a node that is not a member are refused and counted.
    let stranger = Sender {
        node: 4_242,
        boot: 1,
    };
    let mut next_id = 0;
    let payloads = myelin_gossip::state::pack_routes(
        16,
        &[myelin_gossip::Route {
            engine: engine_key,
            stamp: 1,
            hashes: (1..=8u64).collect(),
        }],
        &mut next_id,
    );
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let before = metric_value(
        &node.metrics(),
        &[
            "myelin_gossip_packets_dropped_total",
            "reason=\"not_member\"",
        ],
    );
    for (seq, payload) in payloads.into_iter().enumerate() {
        let packet = encode_packet(
            &ClusterKey::new(KEY.as_bytes()).unwrap(),
            stranger,
            seq as u64 + 1,
            &Payload::Routes(payload),
        )
        .unwrap();
        socket
            .send_to(&packet, gossip_addr(port).parse::<SocketAddr>().unwrap())
            .expect("send");
    }
    wait_for("the stranger's routes to be refused", || {
        metric_value(
            &node.metrics(),
            &[
                "myelin_gossip_packets_dropped_total",
                "reason=\"not_member\"",
            ],
        ) > before
    });
}
