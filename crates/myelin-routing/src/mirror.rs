//! Verified residency mirror: which blocks each backend reports holding (vLLM KV events), keyed
//! by the block's chain hash, with a per-backend "mirror live" flag.
//!
//! Holds state only; decoding events and detecting gaps is the KV-events crate's job.

use std::collections::{BTreeMap, BTreeSet};

use myelin_art::ChainHashMap;

use crate::backend::BackendId;

/// Copies of one block per backend (vLLM can hold several physical copies of one hash).
/// Almost every block has one holder: that case lives inline, with no allocation.
#[derive(Debug, Clone)]
enum Holders {
    One(BackendId, u32),
    Many(Vec<(BackendId, u32)>),
}

impl Holders {
    fn contains(&self, backend: BackendId) -> bool {
        match self {
            Holders::One(holder, _) => *holder == backend,
            Holders::Many(holders) => holders.iter().any(|(holder, _)| *holder == backend),
        }
    }

    fn add_copy(&mut self, backend: BackendId) {
        match self {
            Holders::One(holder, copies) if *holder == backend => {
                *copies = copies.saturating_add(1);
            }
            Holders::One(holder, copies) => {
                *self = Holders::Many(vec![(*holder, *copies), (backend, 1)]);
            }
            Holders::Many(holders) => {
                match holders.iter_mut().find(|(holder, _)| *holder == backend) {
                    Some((_, copies)) => *copies = copies.saturating_add(1),
                    None => holders.push((backend, 1)),
                }
            }
        }
    }

    /// Drops one copy (or all copies with `all`); returns whether anyone still holds it.
    fn drop_copy(&mut self, backend: BackendId, all: bool) -> bool {
        match self {
            Holders::One(holder, copies) => {
                if *holder == backend {
                    *copies = if all { 0 } else { copies.saturating_sub(1) };
                }
                *copies > 0
            }
            Holders::Many(holders) => {
                if let Some(position) = holders.iter().position(|(holder, _)| *holder == backend) {
                    let copies = &mut holders[position].1;
                    *copies = if all { 0 } else { copies.saturating_sub(1) };
                    if *copies == 0 {
                        holders.swap_remove(position);
                    }
                }
                if let [(holder, copies)] = holders.as_slice() {
                    *self = Holders::One(*holder, *copies);
                    return true;
                }
                !holders.is_empty()
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Holders::One(..) => 0,
            Holders::Many(holders) => holders.capacity() * std::mem::size_of::<(BackendId, u32)>(),
        }
    }
}

/// How far routing may trust a backend's mirror (sent by whoever follows its event stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MirrorTrust {
    /// Not followed, out of sync or distrusted: routing ignores the mirror.
    None,
    /// In sync, but the router joined the stream after the engine had cached blocks it never
    /// saw (started against a warm engine beyond its replay buffer, or cleared itself after
    /// lost batches): every block in the mirror is resident; a block missing from it may be
    /// resident too, so the estimate and history decide for those.
    Partial,
    /// In sync since the engine started or last cleared its cache: exactly its blocks.
    Exact,
}

impl MirrorTrust {
    /// Whether routing reads the mirror at all.
    pub fn is_live(self) -> bool {
        self != MirrorTrust::None
    }
}

/// Per block chain hash, which backends hold how many copies; per backend, whether its event
/// stream is live (in sync) so its mirror may be trusted, and whether it is partial.
#[derive(Default)]
pub struct ResidencyMirror {
    blocks: ChainHashMap<Holders>,
    live: BTreeSet<BackendId>,
    /// Live backends whose mirror is [`MirrorTrust::Partial`].
    partial: BTreeSet<BackendId>,
    /// Backends whose mirror may have missed a change (a lost write): not live, whatever
    /// their stream says, until their next clear (a snapshot begins with one).
    untrusted: BTreeSet<BackendId>,
    /// Distinct blocks each backend holds, kept as blocks come and go (the admin view reads
    /// it without walking the blocks).
    per_backend: BTreeMap<BackendId, usize>,
}

impl ResidencyMirror {
    /// Marks `backend`'s mirror live (events in sync) or not (gap, restart, subscriber down).
    /// A mirror that is not live is ignored by routing; its contents are kept for when it
    /// resynchronises (call [`Self::clear_backend`] to drop them).
    /// A backend marked untrusted stays not live until its mirror is cleared.
    pub fn set_live(&mut self, backend: BackendId, live: bool) {
        self.set_trust(
            backend,
            if live {
                MirrorTrust::Exact
            } else {
                MirrorTrust::None
            },
        );
    }

    /// [`Self::set_live`] with partial mirrors: a partial one is live, and routing counts its
    /// blocks as resident without taking a missing block as evicted.
    pub fn set_trust(&mut self, backend: BackendId, trust: MirrorTrust) {
        if trust == MirrorTrust::Partial {
            self.partial.insert(backend);
        } else {
            self.partial.remove(&backend);
        }
        if trust.is_live() {
            if !self.untrusted.contains(&backend) {
                self.live.insert(backend);
            }
        } else {
            self.live.remove(&backend);
        }
    }

    pub fn is_live(&self, backend: BackendId) -> bool {
        self.live.contains(&backend)
    }

    /// Whether `backend`'s mirror is live and partial.
    pub fn is_partial(&self, backend: BackendId) -> bool {
        self.is_live(backend) && self.partial.contains(&backend)
    }

    /// Backends whose mirror is live, ascending.
    pub fn live_backends(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.live.iter().copied()
    }

    /// `backend` stored one copy of the block with chain hash `block_hash`.
    pub fn block_stored(&mut self, backend: BackendId, block_hash: u64) {
        let mut new_holder = true;
        self.blocks
            .entry(block_hash)
            .and_modify(|holders| {
                new_holder = !holders.contains(backend);
                holders.add_copy(backend);
            })
            .or_insert(Holders::One(backend, 1));
        if new_holder {
            *self.per_backend.entry(backend).or_default() += 1;
        }
    }

    fn lost_block(&mut self, backend: BackendId) {
        if let Some(blocks) = self.per_backend.get_mut(&backend) {
            *blocks = blocks.saturating_sub(1);
            if *blocks == 0 {
                self.per_backend.remove(&backend);
            }
        }
    }

    /// `backend` evicted one copy of the block; unknown blocks are ignored.
    pub fn block_removed(&mut self, backend: BackendId, block_hash: u64) {
        let Some(holders) = self.blocks.get_mut(&block_hash) else {
            return;
        };
        let held = holders.contains(backend);
        let anyone = holders.drop_copy(backend, false);
        let still = anyone && holders.contains(backend);
        if !anyone {
            self.blocks.remove(&block_hash);
        }
        if held && !still {
            self.lost_block(backend);
        }
    }

    /// A change of `backend`'s mirror may have been lost on the way (the writer's sequence
    /// has a gap): its mirror is not live, and ignores being made live, until it is cleared
    /// (what follows a clear is the whole mirror again: a snapshot, or the engine's own).
    pub fn mark_untrusted(&mut self, backend: BackendId) {
        self.live.remove(&backend);
        self.untrusted.insert(backend);
    }

    /// Whether `backend`'s mirror waits for a clear after a lost change.
    pub fn is_untrusted(&self, backend: BackendId) -> bool {
        self.untrusted.contains(&backend)
    }

    /// Drops every block of `backend` (vLLM AllBlocksCleared, or a mirror being rebuilt); an
    /// untrusted mirror is trusted again from here.
    pub fn clear_backend(&mut self, backend: BackendId) {
        self.untrusted.remove(&backend);
        self.per_backend.remove(&backend);
        self.blocks
            .retain(|_, holders| holders.drop_copy(backend, true));
    }

    /// Whether `backend` holds the block.
    pub fn holds(&self, backend: BackendId, block_hash: u64) -> bool {
        self.blocks
            .get(&block_hash)
            .is_some_and(|holders| holders.contains(backend))
    }

    /// For each live backend, how many leading blocks of `chain` it holds (stops at the first
    /// block it lacks: later blocks are unusable without it). Probes each block once for all
    /// backends and stops as soon as no live backend is still matching.
    pub fn resident_prefixes(&self, chain: &[u64]) -> Vec<(BackendId, u32)> {
        let mut prefixes: Vec<(BackendId, u32)> = self.live.iter().map(|&b| (b, 0)).collect();
        let mut still_matching: Vec<usize> = (0..prefixes.len()).collect();
        for &block_hash in chain {
            if still_matching.is_empty() {
                break;
            }
            let holders = self.blocks.get(&block_hash);
            still_matching.retain(|&index| {
                let backend = prefixes[index].0;
                let held = holders.is_some_and(|holders| holders.contains(backend));
                if held {
                    prefixes[index].1 += 1;
                }
                held
            });
        }
        prefixes
    }

    /// Blocks each backend holds according to its events, by backend id, ascending (kept as
    /// events arrive: O(backends)). Live and stale mirrors alike.
    pub fn blocks_by_backend(&self) -> Vec<(BackendId, usize)> {
        self.per_backend
            .iter()
            .map(|(&backend, &blocks)| (backend, blocks))
            .collect()
    }

    /// Distinct blocks mirrored.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Approximate bytes held (hash table plus holder lists).
    pub fn memory_bytes(&self) -> usize {
        let buckets = match self.blocks.capacity() {
            0 => 0,
            capacity => (capacity * 8 / 7).next_power_of_two(),
        };
        std::mem::size_of::<Self>()
            + buckets * (std::mem::size_of::<(u64, Holders)>() + 1)
            + self.blocks.values().map(Holders::heap_bytes).sum::<usize>()
            + (self.live.len()
                + self.partial.len()
                + self.untrusted.len()
                + self.per_backend.len() * 2)
                * std::mem::size_of::<BackendId>()
                * 2
    }
}
