//! Benchmark-only baseline: a Leis et al. (ICDE 2013) adaptive radix tree over byte-encoded
//! prompts, answering the same question as `myelin_art::PrefixTree` (every backend's deepest
//! matched block, in one walk). Not part of the library; used by `benches/vs_leis.rs` and
//! checked against `PrefixTree` by `tests/leis_agreement.rs`.
//!
//! Layout, following the paper: keys are byte strings (each token id as 4 big-endian bytes, so a
//! 16-token block is 64 key bytes); inner nodes are Node4 / Node16 (sorted keys, linear search),
//! Node48 (256-byte child index into 48 slots) and Node256 (direct array), grown on insert, and
//! leaves. Path compression is **pessimistic**: each node stores its whole compressed prefix
//! inline, in a fixed array of [`PREFIX_CAPACITY`] = 63 bytes. That suffices because every block
//! boundary of a stored key carries a value and so is a node: between two nodes there are at most
//! 64 key bytes, one of which is the partial key in the parent. (The paper's hybrid, 8 bytes
//! inline and the rest skipped optimistically, would need the full keys stored elsewhere to
//! verify a match: at least the same 64 bytes per block.) Values live in the node that ends on a
//! block boundary, as the paper allows for keys that are prefixes of other keys: a per-backend
//! entry list (one entry inline, a vector beyond: the same layout as `PrefixTree`'s).
//!
//! Nodes live in per-type arenas and are linked by 32-bit tagged indices (the paper uses 64-bit
//! tagged pointers; this makes the baseline smaller, not larger). No shrinking on removal and no
//! eviction: the benchmark only needs insert, lookup and undoing an insert.

use myelin_art::{BackendId, BackendPrefix, TreeMatch};

/// Tokens per block (vLLM's default, the benchmark's block size).
pub const BLOCK_TOKENS: usize = 16;
/// Key bytes per block: 4 bytes per token.
pub const BLOCK_BYTES: usize = BLOCK_TOKENS * 4;
/// Bytes of compressed prefix stored inline in every node.
pub const PREFIX_CAPACITY: usize = BLOCK_BYTES - 1;

/// Encodes the whole blocks of `tokens` as a binary-comparable key (big-endian token ids) into
/// `out`; a trailing partial block is dropped, as `PrefixTree` ignores it.
pub fn encode_key(tokens: &[u32], out: &mut Vec<u8>) {
    let whole_tokens = tokens.len() / BLOCK_TOKENS * BLOCK_TOKENS;
    out.clear();
    // Measured the fastest of three safe encodings on the benchmark machine.
    out.extend(
        tokens[..whole_tokens]
            .iter()
            .flat_map(|token| token.to_be_bytes()),
    );
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Leaf = 0,
    Node4 = 1,
    Node16 = 2,
    Node48 = 3,
    Node256 = 4,
}

/// A node: its type in the top 3 bits, its arena index below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRef(u32);

const EMPTY: NodeRef = NodeRef(u32::MAX);
const KIND_SHIFT: u32 = 29;
const INDEX_MASK: u32 = (1 << KIND_SHIFT) - 1;
/// "No child" in a Node48's byte index.
const NO_SLOT: u8 = u8::MAX;

impl NodeRef {
    fn new(kind: Kind, index: u32) -> Self {
        NodeRef(((kind as u32) << KIND_SHIFT) | index)
    }

    fn kind(self) -> Kind {
        match self.0 >> KIND_SHIFT {
            0 => Kind::Leaf,
            1 => Kind::Node4,
            2 => Kind::Node16,
            3 => Kind::Node48,
            _ => Kind::Node256,
        }
    }

    fn index(self) -> usize {
        (self.0 & INDEX_MASK) as usize
    }
}

/// One backend's use of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    backend: BackendId,
    last_routed_ms: u64,
    residency_stamp: u64,
}

/// A block's entries, sorted by backend; one inline, a vector beyond, empty for no value.
enum Entries {
    One(Entry),
    Many(Vec<Entry>),
}

impl Entries {
    const NONE: Entries = Entries::Many(Vec::new());

    fn as_slice(&self) -> &[Entry] {
        match self {
            Entries::One(only) => std::slice::from_ref(only),
            Entries::Many(many) => many,
        }
    }

    /// Inserts or refreshes `entry`; true if the backend is new to this block.
    fn upsert(&mut self, entry: Entry) -> bool {
        match self {
            Entries::One(only) if only.backend == entry.backend => {
                *only = entry;
                false
            }
            Entries::One(only) => {
                let pair = if only.backend < entry.backend {
                    vec![*only, entry]
                } else {
                    vec![entry, *only]
                };
                *self = Entries::Many(pair);
                true
            }
            Entries::Many(many) if many.is_empty() => {
                *self = Entries::One(entry);
                true
            }
            Entries::Many(many) => match many.binary_search_by_key(&entry.backend, |e| e.backend) {
                Ok(index) => {
                    many[index] = entry;
                    false
                }
                Err(index) => {
                    many.insert(index, entry);
                    true
                }
            },
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Entries::One(_) => 0,
            Entries::Many(many) => many.capacity() * std::mem::size_of::<Entry>(),
        }
    }
}

/// What every node type starts with: the compressed prefix and the value (if on a boundary).
struct Header {
    prefix_len: u8,
    prefix: [u8; PREFIX_CAPACITY],
    entries: Entries,
}

impl Header {
    fn new(prefix: &[u8], entries: Entries) -> Self {
        let mut header = Header {
            prefix_len: 0,
            prefix: [0; PREFIX_CAPACITY],
            entries,
        };
        header.set_prefix(prefix);
        header
    }

    fn set_prefix(&mut self, prefix: &[u8]) {
        assert!(
            prefix.len() <= PREFIX_CAPACITY,
            "a prefix never spans a block boundary"
        );
        self.prefix[..prefix.len()].copy_from_slice(prefix);
        self.prefix_len = prefix.len() as u8;
    }

    fn prefix(&self) -> &[u8] {
        &self.prefix[..usize::from(self.prefix_len)]
    }
}

struct Leaf {
    header: Header,
}

struct Node4 {
    header: Header,
    count: u8,
    keys: [u8; 4],
    children: [NodeRef; 4],
}

struct Node16 {
    header: Header,
    count: u8,
    keys: [u8; 16],
    children: [NodeRef; 16],
}

struct Node48 {
    header: Header,
    count: u8,
    child_index: [u8; 256],
    children: [NodeRef; 48],
}

struct Node256 {
    header: Header,
    count: u16,
    children: [NodeRef; 256],
}

/// One node type's slots; freed slots are reused.
struct Arena<T> {
    slots: Vec<T>,
    free: Vec<u32>,
    live: usize,
}

impl<T> Arena<T> {
    fn new() -> Self {
        Arena {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }

    fn alloc(&mut self, node: T) -> u32 {
        self.live += 1;
        if let Some(index) = self.free.pop() {
            self.slots[index as usize] = node;
            index
        } else {
            self.slots.push(node);
            (self.slots.len() - 1) as u32
        }
    }

    fn release(&mut self, index: u32) {
        self.live -= 1;
        self.free.push(index);
    }

    fn live_bytes(&self) -> usize {
        self.live * std::mem::size_of::<T>()
    }

    fn capacity_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<T>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

/// Where an insert hung its new nodes: undo it with [`LeisArt::detach`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attachment {
    parent: NodeRef,
    byte: u8,
}

/// Effect of one insert.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Blocks the tree did not hold before.
    pub new_blocks: usize,
    /// Where the new nodes hang, if the insert added any below an existing node.
    pub attachment: Option<Attachment>,
}

/// Memory held, counted as the size of every live node (as if each were its own allocation of
/// exactly its type's size) plus the entry vectors on the heap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeisMemory {
    /// Live nodes of each type: leaf, Node4, Node16, Node48, Node256.
    pub nodes_by_kind: [usize; 5],
    /// Sum of live nodes' sizes.
    pub node_bytes: usize,
    /// Heap bytes of entry vectors (blocks held by two or more backends).
    pub entry_heap_bytes: usize,
    /// Bytes the arenas reserve, free slots and growth slack included.
    pub arena_capacity_bytes: usize,
    /// Distinct blocks stored.
    pub stored_blocks: usize,
    /// Sum over blocks of the backends holding them.
    pub backend_blocks: usize,
}

impl LeisMemory {
    /// Node bytes plus entry heap bytes.
    pub fn total_bytes(&self) -> usize {
        self.node_bytes + self.entry_heap_bytes
    }
}

/// A Leis-style ART over byte-encoded prompts with per-backend entries on block boundaries.
pub struct LeisArt {
    leaves: Arena<Leaf>,
    nodes4: Arena<Node4>,
    nodes16: Arena<Node16>,
    nodes48: Arena<Node48>,
    nodes256: Arena<Node256>,
    root: NodeRef,
    stored_blocks: usize,
    backend_blocks: usize,
    key_scratch: Vec<u8>,
}

impl Default for LeisArt {
    fn default() -> Self {
        Self::new()
    }
}

impl LeisArt {
    /// An empty tree; the root is a Node256 with an empty prefix.
    pub fn new() -> Self {
        let mut nodes256 = Arena::new();
        let root_index = nodes256.alloc(Node256 {
            header: Header::new(&[], Entries::NONE),
            count: 0,
            children: [EMPTY; 256],
        });
        LeisArt {
            leaves: Arena::new(),
            nodes4: Arena::new(),
            nodes16: Arena::new(),
            nodes48: Arena::new(),
            nodes256,
            root: NodeRef::new(Kind::Node256, root_index),
            stored_blocks: 0,
            backend_blocks: 0,
            key_scratch: Vec::new(),
        }
    }

    /// Distinct blocks stored.
    pub fn stored_blocks(&self) -> usize {
        self.stored_blocks
    }

    /// Sum over blocks of the backends holding them.
    pub fn backend_blocks(&self) -> usize {
        self.backend_blocks
    }

    fn header(&self, node: NodeRef) -> &Header {
        match node.kind() {
            Kind::Leaf => &self.leaves.slots[node.index()].header,
            Kind::Node4 => &self.nodes4.slots[node.index()].header,
            Kind::Node16 => &self.nodes16.slots[node.index()].header,
            Kind::Node48 => &self.nodes48.slots[node.index()].header,
            Kind::Node256 => &self.nodes256.slots[node.index()].header,
        }
    }

    fn header_mut(&mut self, node: NodeRef) -> &mut Header {
        match node.kind() {
            Kind::Leaf => &mut self.leaves.slots[node.index()].header,
            Kind::Node4 => &mut self.nodes4.slots[node.index()].header,
            Kind::Node16 => &mut self.nodes16.slots[node.index()].header,
            Kind::Node48 => &mut self.nodes48.slots[node.index()].header,
            Kind::Node256 => &mut self.nodes256.slots[node.index()].header,
        }
    }

    #[inline]
    fn find_child(&self, node: NodeRef, byte: u8) -> NodeRef {
        match node.kind() {
            Kind::Leaf => EMPTY,
            Kind::Node4 => {
                let inner = &self.nodes4.slots[node.index()];
                let count = usize::from(inner.count);
                match inner.keys[..count].iter().position(|&key| key == byte) {
                    Some(slot) => inner.children[slot],
                    None => EMPTY,
                }
            }
            Kind::Node16 => {
                let inner = &self.nodes16.slots[node.index()];
                let count = usize::from(inner.count);
                match inner.keys[..count].iter().position(|&key| key == byte) {
                    Some(slot) => inner.children[slot],
                    None => EMPTY,
                }
            }
            Kind::Node48 => {
                let inner = &self.nodes48.slots[node.index()];
                match inner.child_index[usize::from(byte)] {
                    NO_SLOT => EMPTY,
                    slot => inner.children[usize::from(slot)],
                }
            }
            Kind::Node256 => self.nodes256.slots[node.index()].children[usize::from(byte)],
        }
    }

    /// Points the existing child slot for `byte` at `child`.
    fn replace_child(&mut self, node: NodeRef, byte: u8, child: NodeRef) {
        match node.kind() {
            Kind::Leaf => unreachable!("a leaf has no children"),
            Kind::Node4 => {
                let inner = &mut self.nodes4.slots[node.index()];
                if let Some(slot) = inner.keys[..usize::from(inner.count)]
                    .iter()
                    .position(|&key| key == byte)
                {
                    inner.children[slot] = child;
                }
            }
            Kind::Node16 => {
                let inner = &mut self.nodes16.slots[node.index()];
                if let Some(slot) = inner.keys[..usize::from(inner.count)]
                    .iter()
                    .position(|&key| key == byte)
                {
                    inner.children[slot] = child;
                }
            }
            Kind::Node48 => {
                let inner = &mut self.nodes48.slots[node.index()];
                let slot = inner.child_index[usize::from(byte)];
                if slot != NO_SLOT {
                    inner.children[usize::from(slot)] = child;
                }
            }
            Kind::Node256 => {
                self.nodes256.slots[node.index()].children[usize::from(byte)] = child;
            }
        }
    }

    /// Adds a child under a byte `node` does not have yet, growing `node` to the next type when
    /// full. Returns the node's (possibly new) reference.
    fn add_child(&mut self, node: NodeRef, byte: u8, child: NodeRef) -> NodeRef {
        let index = node.index();
        match node.kind() {
            Kind::Leaf => {
                let header = std::mem::replace(
                    &mut self.leaves.slots[index].header,
                    Header::new(&[], Entries::NONE),
                );
                self.leaves.release(index as u32);
                let grown = NodeRef::new(
                    Kind::Node4,
                    self.nodes4.alloc(Node4 {
                        header,
                        count: 0,
                        keys: [0; 4],
                        children: [EMPTY; 4],
                    }),
                );
                self.add_child(grown, byte, child)
            }
            Kind::Node4 => {
                let inner = &mut self.nodes4.slots[index];
                let count = usize::from(inner.count);
                if count < 4 {
                    let at = inner.keys[..count].partition_point(|&key| key < byte);
                    inner.keys.copy_within(at..count, at + 1);
                    inner.children.copy_within(at..count, at + 1);
                    inner.keys[at] = byte;
                    inner.children[at] = child;
                    inner.count += 1;
                    return node;
                }
                let header = std::mem::replace(&mut inner.header, Header::new(&[], Entries::NONE));
                let mut keys = [0; 16];
                let mut children = [EMPTY; 16];
                keys[..4].copy_from_slice(&inner.keys);
                children[..4].copy_from_slice(&inner.children);
                self.nodes4.release(index as u32);
                let grown = NodeRef::new(
                    Kind::Node16,
                    self.nodes16.alloc(Node16 {
                        header,
                        count: 4,
                        keys,
                        children,
                    }),
                );
                self.add_child(grown, byte, child)
            }
            Kind::Node16 => {
                let inner = &mut self.nodes16.slots[index];
                let count = usize::from(inner.count);
                if count < 16 {
                    let at = inner.keys[..count].partition_point(|&key| key < byte);
                    inner.keys.copy_within(at..count, at + 1);
                    inner.children.copy_within(at..count, at + 1);
                    inner.keys[at] = byte;
                    inner.children[at] = child;
                    inner.count += 1;
                    return node;
                }
                let header = std::mem::replace(&mut inner.header, Header::new(&[], Entries::NONE));
                let mut child_index = [NO_SLOT; 256];
                let mut children = [EMPTY; 48];
                for slot in 0..16 {
                    child_index[usize::from(inner.keys[slot])] = slot as u8;
                    children[slot] = inner.children[slot];
                }
                self.nodes16.release(index as u32);
                let grown = NodeRef::new(
                    Kind::Node48,
                    self.nodes48.alloc(Node48 {
                        header,
                        count: 16,
                        child_index,
                        children,
                    }),
                );
                self.add_child(grown, byte, child)
            }
            Kind::Node48 => {
                let inner = &mut self.nodes48.slots[index];
                if usize::from(inner.count) < 48 {
                    // Slots are reused after a removal, so find a free one.
                    let slot = inner
                        .children
                        .iter()
                        .position(|&existing| existing == EMPTY)
                        .unwrap_or(usize::from(inner.count));
                    inner.children[slot] = child;
                    inner.child_index[usize::from(byte)] = slot as u8;
                    inner.count += 1;
                    return node;
                }
                let header = std::mem::replace(&mut inner.header, Header::new(&[], Entries::NONE));
                let mut children = [EMPTY; 256];
                for (child_slot, &slot) in children.iter_mut().zip(&inner.child_index) {
                    if slot != NO_SLOT {
                        *child_slot = inner.children[usize::from(slot)];
                    }
                }
                self.nodes48.release(index as u32);
                let grown = NodeRef::new(
                    Kind::Node256,
                    self.nodes256.alloc(Node256 {
                        header,
                        count: 48,
                        children,
                    }),
                );
                self.add_child(grown, byte, child)
            }
            Kind::Node256 => {
                let inner = &mut self.nodes256.slots[index];
                inner.children[usize::from(byte)] = child;
                inner.count += 1;
                node
            }
        }
    }

    /// Unlinks the child under `byte` (no shrinking: the baseline only undoes inserts).
    fn remove_child(&mut self, node: NodeRef, byte: u8) -> NodeRef {
        match node.kind() {
            Kind::Leaf => EMPTY,
            Kind::Node4 => {
                let inner = &mut self.nodes4.slots[node.index()];
                let count = usize::from(inner.count);
                let Some(slot) = inner.keys[..count].iter().position(|&key| key == byte) else {
                    return EMPTY;
                };
                let child = inner.children[slot];
                inner.keys.copy_within(slot + 1..count, slot);
                inner.children.copy_within(slot + 1..count, slot);
                inner.children[count - 1] = EMPTY;
                inner.count -= 1;
                child
            }
            Kind::Node16 => {
                let inner = &mut self.nodes16.slots[node.index()];
                let count = usize::from(inner.count);
                let Some(slot) = inner.keys[..count].iter().position(|&key| key == byte) else {
                    return EMPTY;
                };
                let child = inner.children[slot];
                inner.keys.copy_within(slot + 1..count, slot);
                inner.children.copy_within(slot + 1..count, slot);
                inner.children[count - 1] = EMPTY;
                inner.count -= 1;
                child
            }
            Kind::Node48 => {
                let inner = &mut self.nodes48.slots[node.index()];
                let slot = inner.child_index[usize::from(byte)];
                if slot == NO_SLOT {
                    return EMPTY;
                }
                inner.child_index[usize::from(byte)] = NO_SLOT;
                let child = std::mem::replace(&mut inner.children[usize::from(slot)], EMPTY);
                inner.count -= 1;
                child
            }
            Kind::Node256 => {
                let inner = &mut self.nodes256.slots[node.index()];
                let child = std::mem::replace(&mut inner.children[usize::from(byte)], EMPTY);
                if child != EMPTY {
                    inner.count -= 1;
                }
                child
            }
        }
    }

    fn children_of(&self, node: NodeRef) -> Vec<NodeRef> {
        let all: &[NodeRef] = match node.kind() {
            Kind::Leaf => &[],
            Kind::Node4 => {
                let inner = &self.nodes4.slots[node.index()];
                &inner.children[..usize::from(inner.count)]
            }
            Kind::Node16 => {
                let inner = &self.nodes16.slots[node.index()];
                &inner.children[..usize::from(inner.count)]
            }
            Kind::Node48 => &self.nodes48.slots[node.index()].children,
            Kind::Node256 => &self.nodes256.slots[node.index()].children,
        };
        all.iter()
            .copied()
            .filter(|&child| child != EMPTY)
            .collect()
    }

    fn release(&mut self, node: NodeRef) {
        let entries = std::mem::replace(&mut self.header_mut(node).entries, Entries::NONE);
        let claims = entries.as_slice().len();
        if claims > 0 {
            self.stored_blocks -= 1;
            self.backend_blocks -= claims;
        }
        let index = node.index() as u32;
        match node.kind() {
            Kind::Leaf => self.leaves.release(index),
            Kind::Node4 => self.nodes4.release(index),
            Kind::Node16 => self.nodes16.release(index),
            Kind::Node48 => self.nodes48.release(index),
            Kind::Node256 => self.nodes256.release(index),
        }
    }

    /// Undoes an insert: unlinks and frees the nodes it hung at `attachment`.
    pub fn detach(&mut self, attachment: Attachment) {
        let mut pending = vec![self.remove_child(attachment.parent, attachment.byte)];
        while let Some(node) = pending.pop() {
            if node == EMPTY {
                continue;
            }
            pending.extend(self.children_of(node));
            self.release(node);
        }
    }

    /// Records that `backend` was routed `tokens` (whole blocks) at `now_ms`.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        backend: BackendId,
        now_ms: u64,
        residency_stamp: u64,
    ) -> Inserted {
        let mut key = std::mem::take(&mut self.key_scratch);
        encode_key(tokens, &mut key);
        let inserted = self.insert_key(
            &key,
            Entry {
                backend,
                last_routed_ms: now_ms,
                residency_stamp,
            },
        );
        self.key_scratch = key;
        inserted
    }

    fn insert_key(&mut self, key: &[u8], entry: Entry) -> Inserted {
        let mut inserted = Inserted::default();
        // (node, byte) whose child slot holds `node`; the root has none.
        let mut parent: Option<(NodeRef, u8)> = None;
        let mut node = self.root;
        let mut depth = 0usize;
        loop {
            let header = self.header(node);
            let prefix_len = usize::from(header.prefix_len);
            let matched = header
                .prefix()
                .iter()
                .zip(&key[depth..])
                .take_while(|(stored, wanted)| stored == wanted)
                .count();
            if matched < prefix_len {
                // The key leaves (or ends inside) the compressed prefix: split it with a Node4.
                let old_prefix = header.prefix;
                self.header_mut(node)
                    .set_prefix(&old_prefix[matched + 1..prefix_len]);
                let upper = NodeRef::new(
                    Kind::Node4,
                    self.nodes4.alloc(Node4 {
                        header: Header::new(&old_prefix[..matched], Entries::NONE),
                        count: 1,
                        keys: [old_prefix[matched], 0, 0, 0],
                        children: [node, EMPTY, EMPTY, EMPTY],
                    }),
                );
                let Some((parent_node, parent_byte)) = parent else {
                    unreachable!("the root's prefix is empty");
                };
                self.replace_child(parent_node, parent_byte, upper);
                node = upper;
            }
            depth += matched;
            if depth > 0 && depth.is_multiple_of(BLOCK_BYTES) {
                let entries = &mut self.header_mut(node).entries;
                let new_block = entries.as_slice().is_empty();
                if entries.upsert(entry) {
                    self.backend_blocks += 1;
                }
                if new_block {
                    self.stored_blocks += 1;
                    inserted.new_blocks += 1;
                }
            }
            if depth == key.len() {
                return inserted;
            }
            let byte = key[depth];
            let child = self.find_child(node, byte);
            if child != EMPTY {
                parent = Some((node, byte));
                node = child;
                depth += 1;
                continue;
            }
            let chain = self.build_chain(key, depth + 1, entry);
            inserted.new_blocks += key.len().div_ceil(BLOCK_BYTES) - depth / BLOCK_BYTES;
            let grown = self.add_child(node, byte, chain);
            if grown != node {
                match parent {
                    Some((parent_node, parent_byte)) => {
                        self.replace_child(parent_node, parent_byte, grown);
                    }
                    None => self.root = grown,
                }
            }
            inserted.attachment = Some(Attachment {
                parent: grown,
                byte,
            });
            return inserted;
        }
    }

    /// New nodes for `key[start..]`: one per remaining block boundary, each with `entry`.
    fn build_chain(&mut self, key: &[u8], start: usize, entry: Entry) -> NodeRef {
        let first_end = start.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let mut below = EMPTY;
        let chain_nodes = (key.len() - first_end) / BLOCK_BYTES + 1;
        for end in (0..chain_nodes)
            .rev()
            .map(|node| first_end + node * BLOCK_BYTES)
        {
            let begin = if end == first_end {
                start
            } else {
                end - PREFIX_CAPACITY
            };
            let header = Header::new(&key[begin..end], Entries::One(entry));
            self.stored_blocks += 1;
            self.backend_blocks += 1;
            below = if below == EMPTY {
                NodeRef::new(Kind::Leaf, self.leaves.alloc(Leaf { header }))
            } else {
                NodeRef::new(
                    Kind::Node4,
                    self.nodes4.alloc(Node4 {
                        header,
                        count: 1,
                        keys: [key[end], 0, 0, 0],
                        children: [below, EMPTY, EMPTY, EMPTY],
                    }),
                )
            };
        }
        below
    }

    /// Every backend's deepest matched block of `tokens`, in one walk (see [`Self::lookup_key`]).
    pub fn lookup(&self, tokens: &[u32], key_scratch: &mut Vec<u8>, out: &mut TreeMatch) {
        encode_key(tokens, key_scratch);
        self.lookup_key(key_scratch, out);
    }

    /// One walk from the root along an encoded key: check each node's prefix, merge the entries
    /// of every node ending on a block boundary, follow the next byte. Fills `out.backends` and
    /// `out.matched_blocks` (not `segments`: that would be one per block here).
    pub fn lookup_key(&self, key: &[u8], out: &mut TreeMatch) {
        out.clear();
        let mut node = self.root;
        let mut depth = 0usize;
        loop {
            let header = self.header(node);
            let prefix = header.prefix();
            let rest = &key[depth..];
            if rest.len() < prefix.len() || rest[..prefix.len()] != *prefix {
                break;
            }
            depth += prefix.len();
            if depth > 0 && depth.is_multiple_of(BLOCK_BYTES) {
                merge_block(header.entries.as_slice(), (depth / BLOCK_BYTES) as u32, out);
            }
            if depth == key.len() {
                break;
            }
            let child = self.find_child(node, key[depth]);
            if child == EMPTY {
                break;
            }
            node = child;
            depth += 1;
        }
        out.matched_blocks = out
            .backends
            .iter()
            .map(|prefix| prefix.matched_blocks)
            .max()
            .unwrap_or(0);
    }

    /// Node and entry bytes (walks every arena slot: for reporting only).
    pub fn memory(&self) -> LeisMemory {
        let mut entry_heap_bytes = 0;
        for leaf in &self.leaves.slots {
            entry_heap_bytes += leaf.header.entries.heap_bytes();
        }
        for inner in &self.nodes4.slots {
            entry_heap_bytes += inner.header.entries.heap_bytes();
        }
        for inner in &self.nodes16.slots {
            entry_heap_bytes += inner.header.entries.heap_bytes();
        }
        for inner in &self.nodes48.slots {
            entry_heap_bytes += inner.header.entries.heap_bytes();
        }
        for inner in &self.nodes256.slots {
            entry_heap_bytes += inner.header.entries.heap_bytes();
        }
        LeisMemory {
            nodes_by_kind: [
                self.leaves.live,
                self.nodes4.live,
                self.nodes16.live,
                self.nodes48.live,
                self.nodes256.live,
            ],
            node_bytes: self.leaves.live_bytes()
                + self.nodes4.live_bytes()
                + self.nodes16.live_bytes()
                + self.nodes48.live_bytes()
                + self.nodes256.live_bytes(),
            entry_heap_bytes,
            arena_capacity_bytes: self.leaves.capacity_bytes()
                + self.nodes4.capacity_bytes()
                + self.nodes16.capacity_bytes()
                + self.nodes48.capacity_bytes()
                + self.nodes256.capacity_bytes(),
            stored_blocks: self.stored_blocks,
            backend_blocks: self.backend_blocks,
        }
    }
}

/// Merges one block's entries (sorted by backend) into the sorted result: each backend's match
/// becomes this block. Backends of a block are a subset of its parent block's (claims are
/// prefix-closed), so one linear pass suffices, as in `PrefixTree`'s walk.
#[inline]
fn merge_block(entries: &[Entry], block: u32, out: &mut TreeMatch) {
    let mut cursor = 0usize;
    for entry in entries {
        let prefix = BackendPrefix {
            backend: entry.backend,
            matched_blocks: block,
            last_routed_ms: entry.last_routed_ms,
            residency_stamp: entry.residency_stamp,
        };
        while cursor < out.backends.len() && out.backends[cursor].backend < entry.backend {
            cursor += 1;
        }
        if cursor < out.backends.len() && out.backends[cursor].backend == entry.backend {
            out.backends[cursor] = prefix;
        } else {
            out.backends.insert(cursor, prefix);
        }
        cursor += 1;
    }
}
