//! Tree nodes: a path-compressed run of block hashes, adaptive child index, per-backend entries.
//!
//! Holds no tree-level logic (walks, splits, eviction live in `tree.rs`).

use std::hash::BuildHasherDefault;

use crate::hash::ChainHashMap;

/// Index of a node in the tree's arena.
pub(crate) type NodeId = u32;
/// "No node" in parent and LRU links.
pub(crate) const NIL: NodeId = u32::MAX;

/// A backend (inference engine) as the router numbers it: stable within one router process,
/// never reused after removal. Shown as its number, as the router names backends everywhere
/// (metrics labels, the `x-myelin-backend` header, the admin API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BackendId(pub u32);

impl std::fmt::Display for BackendId {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}", self.0)
    }
}

/// One backend's claim on a node: it was routed the first `covered_blocks` blocks of the run.
///
/// Claims are prefix-closed: a backend holding block k of a path holds every block before it,
/// so one count per node says exactly which of the node's blocks it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) backend: BackendId,
    pub(crate) covered_blocks: u32,
    pub(crate) last_routed_ms: u64,
    pub(crate) residency_stamp: u64,
}

/// A node's entries, sorted by backend. Most nodes have exactly one (a conversation's own
/// blocks): that case lives inline, with no allocation.
#[derive(Debug, Clone)]
pub(crate) enum Entries {
    One(Entry),
    Many(Vec<Entry>),
}

impl Entries {
    pub(crate) const fn new() -> Self {
        Entries::Many(Vec::new())
    }

    pub(crate) fn insert(&mut self, index: usize, entry: Entry) {
        match self {
            Entries::One(only) => {
                let mut many = Vec::with_capacity(2);
                many.push(*only);
                many.insert(index, entry);
                *self = Entries::Many(many);
            }
            Entries::Many(many) if many.is_empty() => *self = Entries::One(entry),
            Entries::Many(many) => many.insert(index, entry),
        }
    }

    pub(crate) fn remove(&mut self, index: usize) -> Entry {
        match self {
            Entries::One(only) => {
                let removed = *only;
                *self = Entries::new();
                removed
            }
            Entries::Many(many) => {
                let removed = many.remove(index);
                if let [only] = many.as_slice() {
                    *self = Entries::One(*only);
                }
                removed
            }
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Entries::One(_) => 0,
            Entries::Many(many) => many.capacity() * std::mem::size_of::<Entry>(),
        }
    }
}

impl From<Vec<Entry>> for Entries {
    fn from(mut entries: Vec<Entry>) -> Self {
        match entries.as_slice() {
            [only] => Entries::One(*only),
            _ => {
                entries.shrink_to_fit();
                Entries::Many(entries)
            }
        }
    }
}

impl std::ops::Deref for Entries {
    type Target = [Entry];

    fn deref(&self) -> &[Entry] {
        match self {
            Entries::One(only) => std::slice::from_ref(only),
            Entries::Many(many) => many,
        }
    }
}

impl std::ops::DerefMut for Entries {
    fn deref_mut(&mut self) -> &mut [Entry] {
        match self {
            Entries::One(only) => std::slice::from_mut(only),
            Entries::Many(many) => many,
        }
    }
}

/// Children with at most this many entries live in a linear-scanned vector (Node4/Node16's
/// role in Leis et al.); beyond it a hash map keyed by the child's first block hash (Node48/256).
pub(crate) const SMALL_CHILDREN_MAX: usize = 16;
/// A large index shrinks back to a vector at this size (hysteresis against flapping).
const LARGE_CHILDREN_SHRINK_AT: usize = 8;

type LargeIndex = ChainHashMap<NodeId>;

/// Child index keyed by the chain hash of the child's first block. Sized to the fan-out: none
/// and one child inline (most nodes: leaves and conversation chains), a vector up to
/// [`SMALL_CHILDREN_MAX`], a hash map beyond.
pub(crate) enum Children {
    None,
    One(u64, NodeId),
    Small(Vec<(u64, NodeId)>),
    Large(Box<LargeIndex>),
}

impl Children {
    pub(crate) const fn new() -> Self {
        Children::None
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<NodeId> {
        match self {
            Children::None => None,
            Children::One(only_key, id) => (*only_key == key).then_some(*id),
            Children::Small(slots) => slots
                .iter()
                .find(|(slot_key, _)| *slot_key == key)
                .map(|&(_, id)| id),
            Children::Large(map) => map.get(&key).copied(),
        }
    }

    pub(crate) fn insert(&mut self, key: u64, id: NodeId) {
        match self {
            Children::None => *self = Children::One(key, id),
            Children::One(only_key, only_id) => {
                if *only_key == key {
                    *only_id = id;
                } else {
                    *self = Children::Small(vec![(*only_key, *only_id), (key, id)]);
                }
            }
            Children::Small(slots) => {
                if let Some(slot) = slots.iter_mut().find(|(slot_key, _)| *slot_key == key) {
                    slot.1 = id;
                } else if slots.len() < SMALL_CHILDREN_MAX {
                    slots.push((key, id));
                } else {
                    let mut map = LargeIndex::with_capacity_and_hasher(
                        2 * SMALL_CHILDREN_MAX,
                        BuildHasherDefault::default(),
                    );
                    map.extend(slots.iter().copied());
                    map.insert(key, id);
                    *self = Children::Large(Box::new(map));
                }
            }
            Children::Large(map) => {
                map.insert(key, id);
            }
        }
    }

    pub(crate) fn remove(&mut self, key: u64) -> Option<NodeId> {
        match self {
            Children::None => None,
            Children::One(only_key, id) => {
                let id = *id;
                (*only_key == key).then(|| {
                    *self = Children::None;
                    id
                })
            }
            Children::Small(slots) => {
                let position = slots.iter().position(|(slot_key, _)| *slot_key == key)?;
                let (_, id) = slots.swap_remove(position);
                if let [(only_key, only_id)] = slots.as_slice() {
                    *self = Children::One(*only_key, *only_id);
                }
                Some(id)
            }
            Children::Large(map) => {
                let removed = map.remove(&key);
                if map.len() <= LARGE_CHILDREN_SHRINK_AT {
                    let slots: Vec<(u64, NodeId)> = map.iter().map(|(&k, &v)| (k, v)).collect();
                    *self = Children::Small(slots);
                }
                removed
            }
        }
    }

    /// Whether the index is the large (hash map) form.
    pub(crate) fn is_large(&self) -> bool {
        matches!(self, Children::Large(_))
    }

    /// Child ids, in no particular order.
    pub(crate) fn ids(&self) -> Vec<NodeId> {
        match self {
            Children::None => Vec::new(),
            Children::One(_, id) => vec![*id],
            Children::Small(slots) => slots.iter().map(|&(_, id)| id).collect(),
            Children::Large(map) => map.values().copied().collect(),
        }
    }

    /// (key, id) pairs, in no particular order.
    pub(crate) fn pairs(&self) -> Vec<(u64, NodeId)> {
        match self {
            Children::None => Vec::new(),
            Children::One(key, id) => vec![(*key, *id)],
            Children::Small(slots) => slots.clone(),
            Children::Large(map) => map.iter().map(|(&k, &v)| (k, v)).collect(),
        }
    }

    /// Heap bytes held by the index.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Children::None | Children::One(..) => 0,
            Children::Small(slots) => slots.capacity() * std::mem::size_of::<(u64, NodeId)>(),
            Children::Large(map) => {
                // hashbrown: buckets = next_pow2(capacity * 8 / 7), one control byte per bucket.
                let buckets = (map.capacity() * 8 / 7).next_power_of_two();
                std::mem::size_of::<LargeIndex>()
                    + buckets * (std::mem::size_of::<(u64, NodeId)>() + 1)
            }
        }
    }
}

/// A node: the run of blocks on the edge into it, its children and who holds its blocks.
///
/// Invariants (checked by `PrefixTree::check_invariants`): a non-root node's run is non-empty
/// and as long as its longest entry; entries are sorted by backend, each covers 1..=run blocks;
/// every backend with an entry in a child covers the whole run of this node.
pub(crate) struct Node {
    /// Chain hashes of this node's blocks (path compression: one node per branch-free run).
    pub(crate) hashes: Box<[u64]>,
    pub(crate) children: Children,
    /// Sorted by backend id.
    pub(crate) entries: Entries,
    pub(crate) parent: NodeId,
    /// Recency list links (more recent towards the head); root and free nodes are unlinked.
    pub(crate) lru_prev: NodeId,
    pub(crate) lru_next: NodeId,
    pub(crate) live: bool,
}

impl Node {
    pub(crate) fn empty() -> Self {
        Node {
            hashes: Box::new([]),
            children: Children::new(),
            entries: Entries::new(),
            parent: NIL,
            lru_prev: NIL,
            lru_next: NIL,
            live: false,
        }
    }

    pub(crate) fn entry_index(&self, backend: BackendId) -> Result<usize, usize> {
        self.entries
            .binary_search_by_key(&backend, |entry| entry.backend)
    }

    pub(crate) fn max_covered(&self) -> u32 {
        self.entries
            .iter()
            .map(|entry| entry.covered_blocks)
            .max()
            .unwrap_or(0)
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.hashes.len() * std::mem::size_of::<u64>()
            + self.entries.heap_bytes()
            + self.children.heap_bytes()
    }
}
