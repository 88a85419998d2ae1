//! The messages cores send each other over the mesh (all `Send`, all owned data).

use crate::backends::{BackendId, BackendInfo, BackendState, Load, LoadUpdate};
use std::collections::BTreeSet;
use std::sync::Arc;

use myelin_routing::WriteOp;

use crate::pins::PinChange;
use crate::routing_glue::{BlockCounts, CacheFigures, TimingFigures};

/// What a data core's replica holds, for the admin API's listing (answer to `Snapshot`).
#[derive(Debug, Clone, Default)]
pub struct ReplicaSnapshot {
    /// Blocks per backend in this replica's tree and mirror.
    pub counts: BlockCounts,
    /// This core's own load on each backend and the residency in effect for it.
    pub backends: Vec<ReplicaBackend>,
}

/// One backend in a [`ReplicaSnapshot`].
#[derive(Debug, Clone, Copy)]
pub struct ReplicaBackend {
    pub id: BackendId,
    /// Load this core put on the backend (not its view of the other cores' load).
    pub local: Load,
    /// `verified` or `estimate` (or the configured mode when it is not `auto`).
    pub residency: &'static str,
    /// This core's residency-estimate figures for it (capacity, correction, admitted tokens).
    pub cache: CacheFigures,
    /// This core's fitted timing for it and the error of its predicted times to first token.
    pub timing: Option<TimingFigures>,
}

/// A route another cluster node learned: `backend` was routed the prompt of `chain`, with the
/// residency stamp `stamp` (the cluster-wide admitted-tokens counter then).
#[derive(Debug, Clone)]
pub struct PeerRoute {
    pub backend: BackendId,
    pub chain: Arc<myelin_routing::BlockChain>,
    pub stamp: u64,
}

/// Every message between cores.
#[derive(Debug)]
pub enum Message {
    // Data core or control core -> every data core.
    /// Writes to the routing state for the receiver's replica, in the order the sender made
    /// them: learned routes from a data core, KV-event mirror changes from the control core.
    /// One shared batch per sender flush.
    Writes(Arc<[WriteOp]>),

    // Control core -> every data core.
    /// KV-event mirror writes (changes, liveness, snapshots) numbered per receiver: a gap in
    /// `seq` tells the receiver a mirror write to it was dropped, so it stops routing on its
    /// mirrors until the snapshots the control core then sends have rebuilt them.
    MirrorWrites { seq: u64, batch: Arc<[WriteOp]> },

    // Data core -> every other data core.
    /// The sender's load on backends whose load changed since its last flush (absolute, so a
    /// dropped update heals).
    Loads(Arc<[LoadUpdate]>),

    // Data core -> control core.
    /// A proxied request's outcome, for the circuit breaker. Successes are coalesced per
    /// scheduling round (a success only resets the breaker's failure count); a failure is sent
    /// at once, after any success still pending for that backend.
    Outcome { backend: BackendId, success: bool },
    /// The engine sent nothing on any of this core's requests in flight there for
    /// `--engine-stall-ms` (`streaming`: some of them stream, so silence is proof).
    Stalled { backend: BackendId, streaming: bool },
    /// Data core `shard` received the backend change of this `version` (applied, or
    /// superseded by a newer one it already had); `cumulative` when it came from a
    /// `BackendSync`, which means every change up to `version` is in.
    Applied {
        shard: usize,
        version: u64,
        cumulative: bool,
    },
    /// Answer to `Snapshot`.
    SnapshotReply {
        request_id: u64,
        snapshot: Box<ReplicaSnapshot>,
    },
    /// Answer to `Explain`: the decision's evidence (JSON), or why there is none.
    ExplainReply {
        request_id: u64,
        answer: Result<serde_json::Value, crate::openai::ApiError>,
    },

    // Control core -> data cores. Every backend change carries a version from one counter on
    // the control core; a data core ignores a change older than the one it last applied for
    // that backend, so a re-sent message never undoes a newer one.
    /// Add or update a backend.
    BackendUpsert { version: u64, info: BackendInfo },
    /// Remove a backend (its shard entries are dropped too; ids are never reused).
    BackendRemove { version: u64, id: BackendId },
    /// Routing state of a backend changed (health, breaker, drain).
    BackendState {
        version: u64,
        id: BackendId,
        state: BackendState,
    },
    /// What the receiver's replica holds (admin API); answered by `SnapshotReply`.
    Snapshot { request_id: u64 },
    /// Where the receiver would route this generation request body now, without routing it
    /// (admin API); answered by `ExplainReply`.
    Explain {
        request_id: u64,
        endpoint: crate::openai::Endpoint,
        body: bytes::Bytes,
    },
    /// The KV capacity a backend's engine reports on its metrics endpoint (`None`: it reports
    /// none, the configured `capacity-tokens` applies), for the residency estimate, and its KV
    /// utilization and queue when this scrape read them (the expected wait for KV memory).
    BackendCache {
        id: BackendId,
        capacity_tokens: Option<u64>,
        memory: Option<crate::engine_metrics::ScrapedMemory>,
        /// What its `GET /v1/models` says (context length, models, adapters); `None` when it
        /// never answered.
        served: Option<crate::engine_metrics::ServedModels>,
    },
    /// Engine host names and their addresses, resolved on the control core's resolver thread
    /// (the whole table, re-sent every second).
    Addresses(Arc<[(String, std::net::SocketAddr)]>),
    /// The other cluster nodes' load on each backend, summed (gossip, control core -> data
    /// cores): absolute, re-sent every second so a dropped one heals. Admitted tokens include
    /// those of nodes that died (the residency stamps' clock never runs backwards).
    PeerLoads(Arc<[(BackendId, Load)]>),
    /// Routes other cluster nodes learned (gossip, control core -> data cores), applied as
    /// history at the receiver's clock.
    PeerRoutes(Arc<[PeerRoute]>),
    /// Pins and unpins of the sender's requests' prompts: the receiver counts the blocks it owns
    /// (data core -> every other data core, with the flush; `pins.rs`).
    Pins(Arc<[PinChange]>),
    /// The keys of the sender's requests in flight (data core -> every other data core, every
    /// resync interval): the receiver releases the sender's other pins (their unpin was lost).
    LivePins { from: usize, keys: BTreeSet<u64> },
    /// Every backend as of change `version` (sent every second, so a dropped change heals):
    /// the receiver makes its table equal to it, then confirms `version` cumulatively.
    BackendSync {
        version: u64,
        backends: Arc<[BackendInfo]>,
    },
}

impl Message {
    /// Label of the cross-core message metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Writes(_) => "writes",
            Message::MirrorWrites { .. } => "mirror_writes",
            Message::Loads(_) => "loads",
            Message::Outcome { .. } => "outcome",
            Message::Stalled { .. } => "stalled",
            Message::Applied { .. } => "applied",
            Message::SnapshotReply { .. } => "snapshot_reply",
            Message::ExplainReply { .. } => "explain_reply",
            Message::BackendUpsert { .. } => "backend_upsert",
            Message::BackendRemove { .. } => "backend_remove",
            Message::BackendState { .. } => "backend_state",
            Message::Snapshot { .. } => "snapshot",
            Message::Explain { .. } => "explain",
            Message::BackendCache { .. } => "backend_cache",
            Message::BackendSync { .. } => "backend_sync",
            Message::Addresses(_) => "addresses",
            Message::PeerLoads(_) => "peer_loads",
            Message::PeerRoutes(_) => "peer_routes",
            Message::Pins(_) => "pins",
            Message::LivePins { .. } => "live_pins",
        }
    }
}
