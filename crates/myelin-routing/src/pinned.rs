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
}
