//! Bounded cache from a pre-tokenized piece (its original text) to its token ids.
//!
//! Most pieces are short words of one to three tokens: those live inline in a flat table of
//! 32-byte slots (the key bytes and the ids in the slot itself, two slots to a cache line), so a
//! lookup touches one cache line instead of a hash map's control bytes, bucket, boxed key and
//! boxed ids (four cache misses when the table is larger than the CPU's caches, which a prompt
//! over a wide vocabulary makes it). A slot is found within [`PROBES`] of its home; a piece that
//! finds none free replaces one of them, so the table never grows and never needs a sweep.
//! Longer pieces go to a map in two generations: when the current one fills, it becomes the
//! previous one and the old previous one is dropped, so frequent words survive a rollover and
//! memory stays bounded.

use std::collections::HashMap;
use std::hash::BuildHasher;

/// Pieces longer than this many bytes are not cached: they are rare, and would make the memory
/// bound depend on the input.
pub(super) const MAX_CACHED_PIECE_BYTES: usize = 64;

type Generation = HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>;

/// Longest piece kept inline, in bytes, and most ids kept inline.
const INLINE_KEY_BYTES: usize = 16;
const INLINE_IDS: usize = 3;
/// Slots a piece may occupy, from its home slot on.
const PROBES: usize = 4;

/// One inline entry: `key_len == 0` is a free slot (pieces are never empty).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(32))]
struct Slot {
    tag: u16,
    key_len: u8,
    ids_len: u8,
    key: [u8; INLINE_KEY_BYTES],
    ids: [u32; INLINE_IDS],
}

/// The flat table of short pieces.
#[derive(Debug)]
struct InlineTable {
    slots: Box<[Slot]>,
    mask: usize,
    hasher: foldhash::fast::RandomState,
    occupied: usize,
    /// Which of a full window's slots the next newcomer replaces (a rotating choice).
    victim: usize,
}

impl InlineTable {
    /// A table of at least `entries` slots (a power of two).
    fn new(entries: usize) -> Self {
        let slots = entries.max(PROBES).next_power_of_two();
        Self {
            slots: vec![Slot::default(); slots].into_boxed_slice(),
            mask: slots - 1,
            hasher: foldhash::fast::RandomState::default(),
            occupied: 0,
            victim: 0,
        }
    }

    fn fits(piece: &str, ids: &[u32]) -> bool {
        piece.len() <= INLINE_KEY_BYTES && !ids.is_empty() && ids.len() <= INLINE_IDS
    }

    /// Home slot and tag of `piece`.
    fn place(&self, piece: &str) -> (usize, u16) {
        let hash = self.hasher.hash_one(piece.as_bytes());
        ((hash as usize) & self.mask, (hash >> 48) as u16)
    }

    fn get(&self, piece: &str) -> Option<&[u32]> {
        if piece.is_empty() || piece.len() > INLINE_KEY_BYTES {
            return None;
        }
        let (home, tag) = self.place(piece);
        for probe in 0..PROBES {
            let slot = &self.slots[(home + probe) & self.mask];
            if slot.key_len == 0 {
                return None;
            }
            if slot.tag == tag
                && usize::from(slot.key_len) == piece.len()
                && &slot.key[..piece.len()] == piece.as_bytes()
            {
                return Some(&slot.ids[..usize::from(slot.ids_len)]);
            }
        }
        None
    }

    /// Stores `piece` (which [`Self::fits`]): in a free slot of its window, else in place of one.
    fn insert(&mut self, piece: &str, ids: &[u32]) {
        let (home, tag) = self.place(piece);
        let mut target = None;
        for probe in 0..PROBES {
            let index = (home + probe) & self.mask;
            let slot = &self.slots[index];
            if slot.key_len == 0
                || (usize::from(slot.key_len) == piece.len()
                    && &slot.key[..piece.len()] == piece.as_bytes())
            {
                target = Some(index);
                break;
            }
        }
        let index = target.unwrap_or_else(|| {
            self.victim = (self.victim + 1) % PROBES;
            (home + self.victim) & self.mask
        });
        let slot = &mut self.slots[index];
        if slot.key_len == 0 {
            self.occupied += 1;
        }
        let mut key = [0u8; INLINE_KEY_BYTES];
        key[..piece.len()].copy_from_slice(piece.as_bytes());
        let mut inline_ids = [0u32; INLINE_IDS];
        inline_ids[..ids.len()].copy_from_slice(ids);
        *slot = Slot {
            tag,
            key_len: piece.len() as u8,
            ids_len: ids.len() as u8,
            key,
            ids: inline_ids,
        };
    }

    fn clear(&mut self) {
        self.slots.fill(Slot::default());
        self.occupied = 0;
    }
}

/// Piece -> ids: short pieces inline (about `2 * generation_capacity` slots), the rest in two
/// generations of at most `generation_capacity` entries each.
#[derive(Debug)]
pub(super) struct WordCache {
    inline: InlineTable,
    current: Generation,
    previous: Generation,
    generation_capacity: usize,
}

impl WordCache {
    pub(super) fn new(generation_capacity: usize) -> Self {
        let generation_capacity = generation_capacity.max(1);
        Self {
            inline: InlineTable::new(2 * generation_capacity),
            current: Generation::default(),
            previous: Generation::default(),
            generation_capacity,
        }
    }

    pub(super) fn generation_capacity(&self) -> usize {
        self.generation_capacity
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.inline.occupied + self.current.len() + self.previous.len()
    }

    /// Appends the cached ids of `piece` to `out`; false when not cached.
    pub(super) fn extend_with(&mut self, piece: &str, out: &mut Vec<u32>) -> bool {
        if let Some(ids) = self.inline.get(piece) {
            out.extend_from_slice(ids);
            return true;
        }
        if let Some(ids) = self.current.get(piece) {
            out.extend_from_slice(ids);
            return true;
        }
        let Some((key, ids)) = self.previous.remove_entry(piece) else {
            return false;
        };
        out.extend_from_slice(&ids);
        self.insert_entry(key, ids);
        true
    }

    /// Caches the ids of `piece` (skipped for long pieces).
    pub(super) fn insert(&mut self, piece: &str, ids: &[u32]) {
        if InlineTable::fits(piece, ids) {
            self.inline.insert(piece, ids);
        } else if piece.len() <= MAX_CACHED_PIECE_BYTES {
            self.insert_entry(piece.into(), ids.into());
        }
    }

    fn insert_entry(&mut self, piece: Box<str>, ids: Box<[u32]>) {
        if self.current.len() >= self.generation_capacity {
            self.previous = std::mem::take(&mut self.current);
        }
        self.current.insert(piece, ids);
    }

    pub(super) fn clear(&mut self) {
        self.inline.clear();
        self.current.clear();
        self.previous.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A piece too long for the inline table.
    fn long(name: &str) -> String {
        format!("{name}-{}", "x".repeat(INLINE_KEY_BYTES))
    }

    #[test]
    fn stays_bounded_and_keeps_recent_words() {
        let mut cache = WordCache::new(4);
        for word in 0..100u32 {
            cache.insert(&long(&format!("w{word}")), &[word]);
            assert!(cache.len() <= 8, "{} entries", cache.len());
        }
        let mut out = Vec::new();
        assert!(cache.extend_with(&long("w99"), &mut out));
        assert!(cache.extend_with(&long("w95"), &mut out));
        assert!(!cache.extend_with(&long("w0"), &mut out));
        assert_eq!(out, [99, 95]);
    }

    #[test]
    fn a_hit_in_the_previous_generation_survives_the_next_rollover() {
        let mut cache = WordCache::new(2);
        cache.insert(&long("hot"), &[1]);
        cache.insert(&long("a"), &[2]);
        cache.insert(&long("b"), &[3]); // rollover: {hot, a} become previous
        let mut out = Vec::new();
        assert!(cache.extend_with(&long("hot"), &mut out)); // promoted into current {b, hot}
        cache.insert(&long("c"), &[4]); // rollover: {b, hot} become previous
        assert!(cache.extend_with(&long("hot"), &mut out));
        assert!(!cache.extend_with(&long("a"), &mut out));
        assert_eq!(out, [1, 1]);
    }

    #[test]
    fn short_pieces_live_inline_bounded_and_never_answer_for_another_piece() {
        let mut cache = WordCache::new(64);
        let slots = cache.inline.slots.len();
        assert_eq!(slots, 128);
        let ids_of = |word: u32| -> Vec<u32> { (0..1 + word % 3).map(|i| word * 10 + i).collect() };
        for word in 0..10_000u32 {
            let piece = format!(" w{word}");
            cache.insert(&piece, &ids_of(word));
            assert!(cache.len() <= slots);
            // The newest piece is always found, with its own ids.
            let mut out = Vec::new();
            assert!(cache.extend_with(&piece, &mut out), "{piece}");
            assert_eq!(out, ids_of(word));
        }
        assert_eq!(cache.current.len() + cache.previous.len(), 0);
        // Whatever survived answers with its own ids; the rest miss.
        let mut found = 0;
        for word in 0..10_000u32 {
            let mut out = Vec::new();
            if cache.extend_with(&format!(" w{word}"), &mut out) {
                assert_eq!(out, ids_of(word));
                found += 1;
            }
        }
        assert!(found > slots / 2 && found <= slots, "{found} of {slots}");
        // Re-inserting a piece updates its slot rather than taking another.
        let before = cache.len();
        cache.insert(" w9999", &[7]);
        assert_eq!(cache.len(), before);
        // Four ids, or a 17-byte piece, go to the generations instead.
        cache.insert(" many", &[1, 2, 3, 4]);
        cache.insert(&long(""), &[5]);
        assert_eq!(cache.current.len(), 2);
        let mut out = Vec::new();
        assert!(cache.extend_with(" many", &mut out) && cache.extend_with(&long(""), &mut out));
        assert_eq!(out, [1, 2, 3, 4, 5]);
        cache.clear();
        assert_eq!(cache.len(), 0);
        assert!(!cache.extend_with(" w9999", &mut out));
    }

    #[test]
    fn long_pieces_are_not_cached() {
        let mut cache = WordCache::new(8);
        let long = "x".repeat(MAX_CACHED_PIECE_BYTES + 1);
        cache.insert(&long, &[7]);
        assert_eq!(cache.len(), 0);
    }
}
