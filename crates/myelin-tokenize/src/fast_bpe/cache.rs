//! Bounded cache from a pre-tokenized piece (its original text) to its token ids. Two
//! generations: when the current one fills, it becomes the previous one and the old previous one
//! is dropped, so frequent words survive a rollover and memory stays bounded.

use std::collections::HashMap;

/// Pieces longer than this many bytes are not cached: they are rare, and would make the memory
/// bound depend on the input.
pub(super) const MAX_CACHED_PIECE_BYTES: usize = 64;

type Generation = HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>;

/// Piece -> ids, at most `2 * generation_capacity` entries.
#[derive(Debug)]
pub(super) struct WordCache {
    current: Generation,
    previous: Generation,
    generation_capacity: usize,
}

impl WordCache {
    pub(super) fn new(generation_capacity: usize) -> Self {
        Self {
            current: Generation::default(),
            previous: Generation::default(),
            generation_capacity: generation_capacity.max(1),
        }
    }

    pub(super) fn generation_capacity(&self) -> usize {
        self.generation_capacity
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Appends the cached ids of `piece` to `out`; false when not cached.
    pub(super) fn extend_with(&mut self, piece: &str, out: &mut Vec<u32>) -> bool {
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
        if piece.len() <= MAX_CACHED_PIECE_BYTES {
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
        self.current.clear();
        self.previous.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_bounded_and_keeps_recent_words() {
        let mut cache = WordCache::new(4);
        for word in 0..100u32 {
            cache.insert(&format!("w{word}"), &[word]);
            assert!(cache.len() <= 8, "{} entries", cache.len());
        }
        let mut out = Vec::new();
        assert!(cache.extend_with("w99", &mut out));
        assert!(cache.extend_with("w95", &mut out));
        assert!(!cache.extend_with("w0", &mut out));
        assert_eq!(out, [99, 95]);
    }

    #[test]
    fn a_hit_in_the_previous_generation_survives_the_next_rollover() {
        let mut cache = WordCache::new(2);
        cache.insert("hot", &[1]);
        cache.insert("a", &[2]);
        cache.insert("b", &[3]); // rollover: {hot, a} become previous
        let mut out = Vec::new();
        assert!(cache.extend_with("hot", &mut out)); // promoted into current {b, hot}
        cache.insert("c", &[4]); // rollover: {b, hot} become previous
        assert!(cache.extend_with("hot", &mut out));
        assert!(!cache.extend_with("a", &mut out));
        assert_eq!(out, [1, 1]);
    }

    #[test]
    fn long_pieces_are_not_cached() {
        let mut cache = WordCache::new(8);
        let long = "x".repeat(MAX_CACHED_PIECE_BYTES + 1);
        cache.insert(&long, &[7]);
        assert_eq!(cache.len(), 0);
    }
}
