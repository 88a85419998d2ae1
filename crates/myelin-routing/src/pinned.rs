//! Prompt blocks held by requests in flight, counted once however many requests share them:
//! the router's view of an engine's KV memory (myelin-server's `pins.rs`) and the harness's
//! pinned-blocks diagnostic.

use myelin_art::ChainHashMap;

/// The distinct prompt blocks of requests in flight on one backend, by chain hash: requests sharing a prefix hold its blocks once, as the engine's KV memory does
/// (vLLM's prefix caching gives every running request with the same prefix the same blocks).
#[derive(Debug, Clone, Default)]
pub struct PinnedBlocks {
    holders: ChainHashMap<u32>,
}

impl PinnedBlocks {
    /// Counts a request's prompt blocks; returns how many of them no other request held.
    pub fn pin(&mut self, hashes: impl Iterator<Item = u64>) -> u64 {
        let mut new = 0;
        for hash in hashes {
            let holders = self.holders.entry(hash).or_insert(0);
            if *holders == 0 {
                new += 1;
            }
            *holders += 1;
        }
        new
    }

    /// Releases a request's prompt blocks (as pinned); returns how many no request holds now.
    pub fn unpin(&mut self, hashes: impl Iterator<Item = u64>) -> u64 {
        let mut freed = 0;
        for hash in hashes {
            if let Some(holders) = self.holders.get_mut(&hash) {
                *holders -= 1;
                if *holders == 0 {
                    self.holders.remove(&hash);
                    freed += 1;
                }
            }
        }
        freed
    }

    /// Blocks held by at least one request.
    pub fn distinct(&self) -> usize {
        self.holders.len()
    }

    /// How many leading blocks of a prompt (its chain `hashes`) requests in flight hold, as
    /// far as the blocks this counter sees tell (`counted`: whether a hash is counted here;
    /// each data core counts the blocks it owns). A request holds a prefix of its own prompt,
    /// so held-ness is prefix-closed along a chain: a binary search over the counted blocks
    /// finds the deepest held one, in O(log n) lookups. 0 when no counted block is held.
    pub fn held_prefix_blocks(&self, hashes: &[u64], counted: impl Fn(u64) -> bool) -> usize {
        // The counted block at or before `index`, if any (owners are spread by hash, so the
        // walk back is a few steps).
        let counted_at_or_before = |index: usize| {
            (0..=index)
                .rev()
                .take(64)
                .find(|&position| counted(hashes[position]))
        };
        let held = |position: usize| self.holders.contains_key(&hashes[position]);
        let (mut low, mut high) = (0usize, hashes.len());
        // Invariant: every counted block before `low` is held; no counted block at or after
        // `high` is.
        while low < high {
            let middle = low + (high - low) / 2;
            match counted_at_or_before(middle) {
                Some(position) if position >= low => {
                    if held(position) {
                        low = middle + 1;
                    } else {
                        high = position;
                    }
                }
                // Nothing counted in [low, middle]: look further right.
                _ => low = middle + 1,
            }
        }
        // `low` is one past the deepest held counted block's neighbourhood: back off to it.
        match (0..low).rev().find(|&position| counted(hashes[position])) {
            Some(position) if held(position) => position + 1,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_shared_by_requests_in_flight_is_pinned_once() {
        let mut pinned = PinnedBlocks::default();
        fn hashes(list: &[u64]) -> impl Iterator<Item = u64> + '_ {
            list.iter().copied()
        }
        assert_eq!(pinned.pin(hashes(&[1, 2, 3])), 3);
        // A sibling with the same two-block prefix adds only its own block.
        assert_eq!(pinned.pin(hashes(&[1, 2, 4])), 1);
        // The first request ends: its own block is freed, the shared prefix stays held.
        assert_eq!(pinned.unpin(hashes(&[1, 2, 3])), 1);
        assert_eq!(pinned.pin(hashes(&[1, 2])), 0);
        assert_eq!(pinned.unpin(hashes(&[1, 2, 4])), 1);
        assert_eq!(pinned.unpin(hashes(&[1, 2])), 2);
        // Releasing what is not held changes nothing.
        assert_eq!(pinned.unpin(hashes(&[1])), 0);
        assert_eq!(pinned.pin(hashes(&[1])), 1);
        assert_eq!(pinned.distinct(), 1);
    }

    #[test]
    fn the_held_prefix_of_a_prompt_is_found_among_the_counted_blocks() {
        let chain: Vec<u64> = (100..140).collect();
        let mut pinned = PinnedBlocks::default();
        // Every block counted here: a request in flight holds the first 25 blocks.
        pinned.pin(chain[..25].iter().copied());
        assert_eq!(pinned.held_prefix_blocks(&chain, |_| true), 25);
        // Only the even hashes are counted here (another core counts the odd ones): the
        // deepest counted held block is the 25th (hash 124).
        let mut even = PinnedBlocks::default();
        even.pin(chain[..25].iter().copied().filter(|hash| hash % 2 == 0));
        assert_eq!(even.held_prefix_blocks(&chain, |hash| hash % 2 == 0), 25);
        // Nothing held, nothing counted, an empty chain: 0.
        assert_eq!(
            PinnedBlocks::default().held_prefix_blocks(&chain, |_| true),
            0
        );
        assert_eq!(pinned.held_prefix_blocks(&chain, |_| false), 0);
        assert_eq!(pinned.held_prefix_blocks(&[], |_| true), 0);
        // The whole chain held.
        pinned.pin(chain.iter().copied());
        assert_eq!(pinned.held_prefix_blocks(&chain, |_| true), 40);
        // Against a linear scan, for every held length.
        for length in 0..=chain.len() {
            let mut pins = PinnedBlocks::default();
            pins.pin(chain[..length].iter().copied());
            let counted = |hash: u64| hash % 3 != 1;
            let linear = chain
                .iter()
                .enumerate()
                .filter(|&(_, &hash)| counted(hash) && pins.holders.contains_key(&hash))
                .map(|(position, _)| position + 1)
                .max()
                .unwrap_or(0);
            assert_eq!(pins.held_prefix_blocks(&chain, counted), linear, "{length}");
        }
    }
}
