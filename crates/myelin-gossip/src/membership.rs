//! SWIM membership (failure detection and dissemination) with foca, sans-IO: the caller feeds
//! it the payloads of `Swim` packets and the timers it asked for, and takes back payloads to
//! send (to wrap in authenticated packets) and membership changes.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::num::{NonZeroU8, NonZeroUsize};
use std::time::Duration;

use bytes::{Buf, BufMut};
use foca::{
    AccumulatingRuntime, Codec, Foca, Identity, Member, NoCustomBroadcast, OwnedNotification,
};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde::{Deserialize, Serialize};

use crate::wire::{HEADER_BYTES, MAC_BYTES, MAX_PACKET_BYTES};

/// A node's identity in the membership: its gossip address, the hash of its node id, its
/// boot (process start), and a bump foca renews it with when the cluster declared it down
/// while it was alive.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeIdentity {
    pub addr: SocketAddr,
    pub node: u64,
    pub boot: u64,
    pub bump: u16,
}

impl NodeIdentity {
    /// The placeholder identity of a seed known only by address (its real identity replaces
    /// it once it answers).
    pub fn seed(addr: SocketAddr) -> NodeIdentity {
        NodeIdentity {
            addr,
            node: 0,
            boot: 0,
            bump: 0,
        }
    }
}

impl Identity for NodeIdentity {
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(NodeIdentity {
            bump: self.bump.wrapping_add(1),
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        (self.boot, self.bump) > (adversary.boot, adversary.bump)
    }
}

/// foca's header and member records, as bincode 2 (serde) bytes.
#[derive(Debug, Default, Clone, Copy)]
pub struct BincodeCodec;

/// A foca record that does not decode.
#[derive(Debug, Clone, thiserror::Error)]
#[error("membership record: {0}")]
pub struct CodecError(String);

fn codec_config() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<2048>,
> {
    bincode::config::standard().with_limit::<2048>()
}

fn put<T: Serialize>(value: &T, mut buf: impl BufMut) -> Result<(), CodecError> {
    let bytes = bincode::serde::encode_to_vec(value, codec_config())
        .map_err(|error| CodecError(error.to_string()))?;
    if buf.remaining_mut() < bytes.len() {
        return Err(CodecError("no room".into()));
    }
    buf.put_slice(&bytes);
    Ok(())
}

fn take<T: serde::de::DeserializeOwned>(mut buf: impl Buf) -> Result<T, CodecError> {
    let (value, read) = bincode::serde::decode_from_slice(buf.chunk(), codec_config())
        .map_err(|error| CodecError(error.to_string()))?;
    buf.advance(read);
    Ok(value)
}

impl Codec<NodeIdentity> for BincodeCodec {
    type Error = CodecError;

    fn encode_header(
        &mut self,
        header: &foca::Header<NodeIdentity>,
        buf: impl BufMut,
    ) -> Result<(), CodecError> {
        put(header, buf)
    }

    fn decode_header(&mut self, buf: impl Buf) -> Result<foca::Header<NodeIdentity>, CodecError> {
        take(buf)
    }

    fn encode_member(
        &mut self,
        member: &Member<NodeIdentity>,
        buf: impl BufMut,
    ) -> Result<(), CodecError> {
        put(member, buf)
    }

    fn decode_member(&mut self, buf: impl Buf) -> Result<Member<NodeIdentity>, CodecError> {
        take(buf)
    }
}

/// Failure-detection timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MembershipParams {
    /// A member is probed (pinged) every period, each member in turn.
    pub probe_period: Duration,
    /// How long a direct probe waits before asking others to probe indirectly.
    pub probe_rtt: Duration,
    /// How long a suspect member may refute the suspicion before it is declared down.
    pub suspect_to_down_after: Duration,
    /// Most members (up, suspect or down) the table holds: a message that would add members
    /// past it is refused, so a peer holding the key cannot make this node probe and send
    /// state to any number of addresses.
    pub max_members: usize,
}

/// Default [`MembershipParams::max_members`]: far above any router cluster, far below what
/// would make the periodic sends to every member a flood.
pub const DEFAULT_MAX_MEMBERS: usize = 256;

impl Default for MembershipParams {
    fn default() -> Self {
        MembershipParams {
            probe_period: Duration::from_millis(500),
            probe_rtt: Duration::from_millis(200),
            suspect_to_down_after: Duration::from_millis(1_500),
            max_members: DEFAULT_MAX_MEMBERS,
        }
    }
}

impl MembershipParams {
    /// Longest time from a member's death to it being declared down by a node that probes it,
    /// with `members` members: every member is probed within `members` periods (foca probes
    /// them in a shuffled round), the failed probe ends a period later, then the suspicion
    /// runs out.
    pub fn detection_bound(&self, members: u32) -> Duration {
        self.probe_period * members.max(1) + self.probe_period + self.suspect_to_down_after
    }

    fn foca_config(&self) -> foca::Config {
        let mut config = foca::Config::new_lan(NonZeroU32Ext::three());
        config.probe_period = self.probe_period;
        config.probe_rtt = self.probe_rtt.min(self.probe_period / 2);
        config.suspect_to_down_after = self.suspect_to_down_after;
        config.max_transmissions = NonZeroU8::new(6).unwrap_or(NonZeroU8::MIN);
        // Down members are remembered a while (so a late packet of theirs cannot revive
        // them), then forgotten: the table stays bounded, and their room frees for new ones.
        config.remove_down_after = Some(Duration::from_secs(60));
        config.max_packet_size = NonZeroUsize::new(MAX_PACKET_BYTES - HEADER_BYTES - MAC_BYTES)
            .unwrap_or(NonZeroUsize::MIN);
        config.notify_down_members = true;
        config.periodic_announce = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(10),
            num_members: NonZeroUsize::MIN,
        });
        config.periodic_announce_to_down_members = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(5),
            num_members: NonZeroUsize::MIN.saturating_add(1),
        });
        config.periodic_gossip = Some(foca::PeriodicParams {
            frequency: Duration::from_millis(200),
            num_members: NonZeroUsize::MIN.saturating_add(2),
        });
        config
    }
}

struct NonZeroU32Ext;
impl NonZeroU32Ext {
    fn three() -> std::num::NonZeroU32 {
        std::num::NonZeroU32::new(3).unwrap_or(std::num::NonZeroU32::MIN)
    }
}

/// A timer foca asked for; hand it back to [`Membership::handle_timer`] when it fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipTimer(foca::Timer<NodeIdentity>);

/// A membership change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberEvent {
    Up(NodeIdentity),
    Down(NodeIdentity),
    /// This node was declared down by the others and rejoined under a renewed identity.
    Rejoined(NodeIdentity),
}

/// What a member is to this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    Up,
    Suspect,
    Down,
}

impl MemberState {
    pub fn as_str(self) -> &'static str {
        match self {
            MemberState::Up => "up",
            MemberState::Suspect => "suspect",
            MemberState::Down => "down",
        }
    }
}

/// What the membership asks of the caller after a call.
#[derive(Debug, Default)]
pub struct MembershipOutput {
    /// `Swim` payloads to send, by destination.
    pub send: Vec<(SocketAddr, Vec<u8>)>,
    /// Timers to start.
    pub timers: Vec<(Duration, MembershipTimer)>,
    pub events: Vec<MemberEvent>,
}

/// A membership message from a peer that was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum MembershipError {
    /// foca refused it (does not decode, from ourselves, malformed).
    #[error("membership: {0}")]
    Refused(String),
    /// It names members the table has no room for ([`MembershipParams::max_members`]).
    #[error("membership: the member table is full")]
    MemberCap,
}

/// This node's view of the cluster's membership.
pub struct Membership {
    foca: Foca<NodeIdentity, BincodeCodec, SmallRng, NoCustomBroadcast>,
    runtime: AccumulatingRuntime<NodeIdentity>,
    max_members: usize,
    /// Member updates taken out of payloads because the table was full.
    refused: u64,
}

/// The room a payload's new members may take in the member table.
struct Room {
    /// Addresses in the table (and this node's own).
    known: HashSet<SocketAddr>,
    /// New addresses this payload was let bring in.
    added: HashSet<SocketAddr>,
    /// Entries still free.
    left: usize,
}

impl Room {
    /// Whether `addr` is known, or there is room for it (then taken).
    fn admit(&mut self, addr: SocketAddr) -> bool {
        if self.known.contains(&addr) || self.added.contains(&addr) {
            return true;
        }
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        self.added.insert(addr);
        true
    }
}

impl Membership {
    pub fn new(identity: NodeIdentity, params: MembershipParams, rng_seed: u64) -> Membership {
        Membership {
            foca: Foca::new(
                identity,
                params.foca_config(),
                SmallRng::seed_from_u64(rng_seed),
                BincodeCodec,
            ),
            runtime: AccumulatingRuntime::new(),
            max_members: params.max_members,
            refused: 0,
        }
    }

    pub fn identity(&self) -> &NodeIdentity {
        self.foca.identity()
    }

    /// Members currently up (alive or suspect).
    pub fn active_members(&self) -> usize {
        self.foca.num_members()
    }

    /// Every member known, with its state (down ones until they are forgotten).
    pub fn members(&self) -> Vec<(NodeIdentity, MemberState)> {
        self.foca
            .iter_membership_state()
            .map(|member| {
                let state = match member.state() {
                    foca::State::Alive => MemberState::Up,
                    foca::State::Suspect => MemberState::Suspect,
                    foca::State::Down => MemberState::Down,
                };
                (member.id().clone(), state)
            })
            .collect()
    }

    /// Asks the node at `addr` to let this one join (a seed, known by address only).
    pub fn announce(&mut self, addr: SocketAddr) {
        let _ = self
            .foca
            .announce(NodeIdentity::seed(addr), &mut self.runtime);
    }

    /// A `Swim` payload from a peer. Members past the cap are taken out of its updates; the
    /// payload is refused whole when its sender, or the member a probe is about, would be one.
    pub fn handle_data(&mut self, payload: &[u8]) -> Result<(), MembershipError> {
        let admitted = self.admit(payload)?;
        self.foca
            .handle_data(admitted.as_deref().unwrap_or(payload), &mut self.runtime)
            .map_err(|error| MembershipError::Refused(error.to_string()))
    }

    /// Member updates taken out of payloads because the table was full.
    pub fn refused_members(&self) -> u64 {
        self.refused
    }

    /// Checks a payload against the member cap: `None` when it may go to foca as it is, the
    /// payload without the updates about members past the cap otherwise. A payload that does
    /// not decode is left to foca (which refuses it).
    fn admit(&mut self, payload: &[u8]) -> Result<Option<Vec<u8>>, MembershipError> {
        let mut buf = payload;
        let Ok(header) = take::<foca::Header<NodeIdentity>>(&mut buf) else {
            return Ok(None);
        };
        let mut room = Room {
            known: self
                .foca
                .iter_membership_state()
                .map(|member| member.id().addr)
                .chain([self.foca.identity().addr])
                .collect(),
            added: HashSet::new(),
            left: self
                .max_members
                .saturating_sub(self.foca.iter_membership_state().len()),
        };
        let subject = match &header.message {
            foca::Message::PingReq { target, .. } | foca::Message::IndirectAck { target, .. } => {
                Some(target.addr)
            }
            foca::Message::IndirectPing { origin, .. }
            | foca::Message::ForwardedAck { origin, .. } => Some(origin.addr),
            _ => None,
        };
        if !room.admit(header.src.addr) || subject.is_some_and(|addr| !room.admit(addr)) {
            return Err(MembershipError::MemberCap);
        }
        if buf.len() < 2 || header.message == foca::Message::Broadcast {
            return Ok(None);
        }
        let count = u16::from_be_bytes([buf[0], buf[1]]);
        let mut rest = &buf[2..];
        let mut kept = Vec::with_capacity(usize::from(count));
        let mut refused = 0u64;
        for _ in 0..count {
            let Ok(member) = take::<Member<NodeIdentity>>(&mut rest) else {
                return Ok(None);
            };
            if room.admit(member.id().addr) {
                kept.push(member);
            } else {
                refused += 1;
            }
        }
        if refused == 0 {
            return Ok(None);
        }
        self.refused += refused;
        let refuse = |error: CodecError| MembershipError::Refused(error.to_string());
        let mut out = Vec::with_capacity(payload.len());
        put(&header, &mut out).map_err(refuse)?;
        out.extend_from_slice(&u16::try_from(kept.len()).unwrap_or(0).to_be_bytes());
        for member in &kept {
            put(member, &mut out).map_err(refuse)?;
        }
        out.extend_from_slice(rest);
        Ok(Some(out))
    }

    /// A timer asked for earlier fired.
    pub fn handle_timer(&mut self, timer: MembershipTimer) {
        let _ = self.foca.handle_timer(timer.0, &mut self.runtime);
    }

    /// Leaves the cluster (the others learn it at once instead of by failed probes).
    pub fn leave(&mut self) {
        let _ = self.foca.leave_cluster(&mut self.runtime);
    }

    /// Takes what the last calls asked for.
    pub fn take_output(&mut self) -> MembershipOutput {
        let mut output = MembershipOutput::default();
        while let Some((to, bytes)) = self.runtime.to_send() {
            output.send.push((to.addr, bytes.to_vec()));
        }
        while let Some((after, timer)) = self.runtime.to_schedule() {
            output.timers.push((after, MembershipTimer(timer)));
        }
        while let Some(notification) = self.runtime.to_notify() {
            match notification {
                OwnedNotification::MemberUp(id) => output.events.push(MemberEvent::Up(id)),
                OwnedNotification::MemberDown(id) => output.events.push(MemberEvent::Down(id)),
                OwnedNotification::Rename(before, after) => {
                    output.events.push(MemberEvent::Down(before));
                    output.events.push(MemberEvent::Up(after));
                }
                OwnedNotification::Rejoin(id) => output.events.push(MemberEvent::Rejoined(id)),
                _ => {}
            }
        }
        output
    }
}
