//! Writes to the routing state, as every data core's replica applies them.
//!
//! Every data core holds a full replica of the routing state (prefix tree and verified mirror)
//! and answers its own lookups from it, without asking another core. A write happens once, on
//! the core where it is decided (a learned route) or on the control core (KV events), and is
//! then applied by every replica: by the writer at once, by the others when the message
//! arrives (a batch per sender, in the order the sender wrote). Writes commute where it
//! matters: a use keeps the latest time and that use's stamp whatever order two uses arrive
//! in, and KV events of a backend come from one sender in stream order, so replicas that
//! received the same writes hold the same routes. See docs/architecture.md.

use std::sync::Arc;

use myelin_art::BlockChain;

use crate::backend::BackendId;
use crate::mirror::MirrorTrust;

/// One change of a backend's verified mirror, from its KV-event stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorChange {
    /// One more copy of the block with this chain hash.
    Stored(u64),
    /// One copy fewer.
    Removed(u64),
    /// Every block of the backend is gone.
    Cleared,
}

/// One write to the routing state. `Send`, cheap to clone: the payload is shared by the
/// replicas it is sent to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOp {
    /// `backend` was routed the prompt of `chain` at `at_ms` (the writer's clock, shared by
    /// every core), with `residency_stamp` (see [`crate::Shard::learn_chain`]).
    Learn {
        chain: Arc<BlockChain>,
        backend: BackendId,
        at_ms: u64,
        residency_stamp: u64,
    },
    /// KV events of `backend`, in stream order.
    Mirror {
        backend: BackendId,
        changes: Arc<[MirrorChange]>,
    },
    /// `backend`'s KV-event mirror became live (in sync, exact or partial) or stopped being
    /// followed.
    MirrorLive {
        backend: BackendId,
        trust: MirrorTrust,
    },
    /// `backend` reported reusing less of a prompt than history said it held: the first block
    /// it did not reuse was last used at residency stamp `stamp`, so (LRU) every use stamped
    /// below it is gone too. Replicas keep the largest such stamp per backend (commutes).
    Evicted { backend: BackendId, stamp: u64 },
}
