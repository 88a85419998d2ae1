//! Verified residency mirror: which blocks each backend reports holding (vLLM KV events), keyed
//! by the block's chain hash, with a per-backend "mirror live" flag.
//!
//! Holds state only; decoding events and detecting gaps is the KV-events crate's job.

use std::collections::BTreeSet;

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

/// Per block chain hash, which backends hold how many copies; per backend, whether its event
/// stream is live (in sync) so its mirror may be trusted.
#[derive(Default)]
pub struct ResidencyMirror {
    blocks: ChainHashMap<Holders>,
    live: BTreeSet<BackendId>,
}

impl ResidencyMirror {
    /// Marks `backend`'s mirror live (events in sync) or not (gap, restart, subscriber down).
    /// A mirror that is not live is ignored by routing; its contents are kept for when it
    /// resynchronises (call [`Self::clear_backend`] to drop them).
    pub fn set_live(&mut self, backend: BackendId, live: bool) {
        if live {
            self.live.insert(backend);
        } else {
            self.live.remove(&backend);
        }
    }

    pub fn is_live(&self, backend: BackendId) -> bool {
        self.live.contains(&backend)
    }

    /// Backends whose mirror is live, ascending.
    pub fn live_backends(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.live.iter().copied()
    }

    /// `backend` stored one copy of the block with chain hash `block_hash`.
    pub fn block_stored(&mut self, backend: BackendId, block_hash: u64) {
        self.blocks
            .entry(block_hash)
            .and_modify(|holders| holders.add_copy(backend))
            .or_insert(Holders::One(backend, 1));
    }

    /// `backend` evicted one copy of the block; unknown blocks are ignored.
    pub fn block_removed(&mut self, backend: BackendId, block_hash: u64) {
        let Some(holders) = self.blocks.get_mut(&block_hash) else {
            return;
        };
        if !holders.drop_copy(backend, false) {
            self.blocks.remove(&block_hash);
        }
    }

    /// Drops every block of `backend` (vLLM AllBlocksCleared, or a mirror being rebuilt).
    pub fn clear_backend(&mut self, backend: BackendId) {
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

    /// Blocks each backend holds according to its events, by backend id (walks the mirror:
    /// for the admin API, not the request path). Live and stale mirrors alike.
    pub fn blocks_by_backend(&self) -> Vec<(BackendId, usize)> {
        let mut counts: Vec<(BackendId, usize)> = Vec::new();
        let mut count = |backend: BackendId| match counts.iter_mut().find(|(b, _)| *b == backend) {
            Some((_, blocks)) => *blocks += 1,
            None => counts.push((backend, 1)),
        };
        for holders in self.blocks.values() {
            match holders {
                Holders::One(holder, _) => count(*holder),
                Holders::Many(holders) => holders.iter().for_each(|(holder, _)| count(*holder)),
            }
        }
        counts.sort_unstable_by_key(|(backend, _)| *backend);
        counts
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
            + self.live.len() * std::mem::size_of::<BackendId>() * 2
    }
}
