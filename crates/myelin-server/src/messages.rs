//! The messages cores send each other over the mesh (all `Send`, all owned data).

use crate::backend_spec::BackendSpec;
use crate::backends::{BackendId, BackendInfo, BackendState, LoadUpdate};
use std::sync::Arc;

use myelin_routing::WriteOp;

use crate::routing_glue::BlockCounts;

/// An operator action from the admin API, executed by the control core.
#[derive(Debug, Clone)]
pub enum AdminOp {
    Add(BackendSpec),
    Remove(BackendId),
    Drain(BackendId),
}

/// What an admin action did.
#[derive(Debug, Clone)]
pub enum AdminOutcome {
    Added(BackendInfo),
    Removed(BackendInfo),
    Draining(BackendInfo),
    NotFound(BackendId),
    Duplicate(String),
}

/// Every message between cores.
#[derive(Debug)]
pub enum Message {
    // Data core or control core -> every data core.
    /// Writes to the routing state for the receiver's replica, in the order the sender made
    /// them: learned routes from a data core, KV-event mirror changes from the control core.
    /// One shared batch per sender flush.
    Writes(Arc<[WriteOp]>),

    // Data core -> data core.
    /// Blocks per backend in the receiver's replica (admin API); answered by `BlockCountsReply`.
    BlockCounts { request_id: u64, reply_to: usize },
    /// Answer to `BlockCounts`.
    BlockCountsReply {
        request_id: u64,
        counts: BlockCounts,
    },

    // Data core -> every other data core.
    /// The sender's load on backends whose load changed since its last flush (absolute, so a
    /// dropped update heals).
    Loads(Arc<[LoadUpdate]>),

    // Data core -> control core.
    /// A proxied request's outcome, for the circuit breaker. Successes are coalesced per
    /// scheduling round (a success only resets the breaker's failure count); a failure is sent
    /// at once, after any success still pending for that backend.
    Outcome { backend: BackendId, success: bool },
    /// An admin action; the control core answers with `AdminReply` once every data core
    /// has applied it.
    Admin {
        request_id: u64,
        reply_to: usize,
        op: AdminOp,
    },
    /// A data core applied a backend change sent with this `change_id`.
    Applied { change_id: u64 },

    // Control core -> data cores.
    /// Add or update a backend. `change_id` 0 needs no acknowledgement.
    BackendUpsert { change_id: u64, info: BackendInfo },
    /// Remove a backend (its shard entries are dropped too).
    BackendRemove { change_id: u64, id: BackendId },
    /// Routing state of a backend changed (health, breaker, drain).
    BackendState { id: BackendId, state: BackendState },
    /// Answer to `Admin`.
    AdminReply {
        request_id: u64,
        outcome: AdminOutcome,
    },
}

impl Message {
    /// Label of the cross-core message metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Writes(_) => "writes",
            Message::BlockCounts { .. } => "block_counts",
            Message::BlockCountsReply { .. } => "block_counts_reply",
            Message::Loads(_) => "loads",
            Message::Outcome { .. } => "outcome",
            Message::Admin { .. } => "admin",
            Message::Applied { .. } => "applied",
            Message::BackendUpsert { .. } => "backend_upsert",
            Message::BackendRemove { .. } => "backend_remove",
            Message::BackendState { .. } => "backend_state",
            Message::AdminReply { .. } => "admin_reply",
        }
    }
}
