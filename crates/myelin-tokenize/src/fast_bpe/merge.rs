//! The BPE merge loop over one pre-tokenized word: repeatedly merge the adjacent pair of lowest
//! rank, leftmost on ties. No pre-tokenization or caching here.
//!
//! Why this equals HF's `Word::merge_all` (a min-heap of `(rank, position)` entries, stale ones
//! skipped): the pair at a position only changes by growing (its left symbol absorbs its right
//! neighbour, or the right neighbour absorbs the one after it), and every change pushes the new
//! pair, so the live heap entries are exactly the current adjacent pairs with their ranks. HF
//! detects a stale entry by comparing the merged token id, which names the pair's text; that text
//! strictly grows each time the pair at a position changes, so no stale entry passes. Popping the
//! minimum `(rank, position)` is therefore "lowest rank, leftmost", which is what both functions
//! below do: a linear scan for short words, a heap for long ones.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Words longer than this (in symbols) use the heap; shorter ones the quadratic scan, which is
/// faster for them.
const SCAN_MAX_SYMBOLS: usize = 48;

/// Rank and resulting token id of each mergeable pair of token ids.
#[derive(Debug, Default)]
pub(super) struct MergeTable {
    by_pair: HashMap<u64, Merge, foldhash::fast::RandomState>,
}

/// What merging one pair gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Merge {
    /// Position in the merges list: lower merges first.
    pub(super) rank: u32,
    /// Token id of the concatenation.
    pub(super) merged_id: u32,
}

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

impl MergeTable {
    /// Records a merge; a later entry for the same pair replaces the earlier one (HF collects
    /// its merges into a map in list order).
    pub(super) fn insert(&mut self, left: u32, right: u32, merge: Merge) {
        self.by_pair.insert(pair_key(left, right), merge);
    }

    fn get(&self, left: u32, right: u32) -> Option<Merge> {
        self.by_pair.get(&pair_key(left, right)).copied()
    }

    /// Merges `symbols` (initially one token id per byte) in place.
    pub(super) fn merge_word(&self, symbols: &mut Vec<u32>) {
        if symbols.len() <= SCAN_MAX_SYMBOLS {
            self.merge_by_scan(symbols);
        } else {
            self.merge_by_heap(symbols);
        }
    }

    /// Quadratic in the word length, but with the pair ranks cached between rounds.
    pub(super) fn merge_by_scan(&self, symbols: &mut Vec<u32>) {
        if symbols.len() < 2 {
            return;
        }
        let mut pairs: Vec<Option<Merge>> = symbols
            .windows(2)
            .map(|pair| self.get(pair[0], pair[1]))
            .collect();
        loop {
            let mut best: Option<(usize, Merge)> = None;
            for (position, merge) in pairs.iter().enumerate() {
                if let Some(merge) = merge
                    && best.is_none_or(|(_, chosen)| merge.rank < chosen.rank)
                {
                    best = Some((position, *merge));
                }
            }
            let Some((position, merge)) = best else {
                return;
            };
            symbols[position] = merge.merged_id;
            symbols.remove(position + 1);
            pairs.remove(position);
            if position > 0 {
                pairs[position - 1] = self.get(symbols[position - 1], symbols[position]);
            }
            if position < pairs.len() {
                pairs[position] = self.get(symbols[position], symbols[position + 1]);
            }
        }
    }

    /// `O(n log n)`: a doubly linked list of symbols and a min-heap of candidate merges.
    pub(super) fn merge_by_heap(&self, symbols: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let count = symbols.len();
        if count < 2 {
            return;
        }
        let mut previous: Vec<usize> = (0..count).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=count)
            .map(|i| if i == count { NONE } else { i })
            .collect();
        let mut alive = vec![true; count];
        // Entries: (rank, left position, left id, right id), smallest first.
        let mut heap: BinaryHeap<Reverse<(u32, usize, u32, u32)>> = symbols
            .windows(2)
            .enumerate()
            .filter_map(|(position, pair)| {
                self.get(pair[0], pair[1])
                    .map(|merge| Reverse((merge.rank, position, pair[0], pair[1])))
            })
            .collect();
        while let Some(Reverse((_, left, left_id, right_id))) = heap.pop() {
            let right = next[left];
            if !alive[left]
                || right == NONE
                || symbols[left] != left_id
                || symbols[right] != right_id
            {
                continue;
            }
            let Some(merge) = self.get(left_id, right_id) else {
                continue;
            };
            symbols[left] = merge.merged_id;
            alive[right] = false;
            let after = next[right];
            next[left] = after;
            if after != NONE {
                previous[after] = left;
            }
            let before = previous[left];
            if before != NONE
                && let Some(merge) = self.get(symbols[before], symbols[left])
            {
                heap.push(Reverse((
                    merge.rank,
                    before,
                    symbols[before],
                    symbols[left],
                )));
            }
            if after != NONE
                && let Some(merge) = self.get(symbols[left], symbols[after])
            {
                heap.push(Reverse((merge.rank, left, symbols[left], symbols[after])));
            }
        }
        let mut position = 0;
        symbols.retain(|_| {
            let keep = alive[position];
            position += 1;
            keep
        });
    }
}
