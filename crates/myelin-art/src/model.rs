//! A naive reference model of the tree's semantics (a map from block-aligned token prefixes to
//! the backends holding them) and a byte-script driver that checks the real tree against it.
//!
//! Used by the property tests and the cargo-fuzz target; not meant for production use.

use std::collections::{BTreeMap, BTreeSet};

use crate::{BackendId, PrefixTree, TreeConfig};

/// Every block-aligned prefix each backend holds, stored as plain token vectors: obviously
/// correct, quadratic, and independent of the tree's hashing and node layout.
#[derive(Debug, Clone, Default)]
pub struct ReferenceModel {
    block_size: usize,
    held: BTreeMap<BackendId, BTreeSet<Vec<u32>>>,
}

impl ReferenceModel {
    /// An empty model; `block_size` must be at least 1 (0 is treated as 1).
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            held: BTreeMap::new(),
        }
    }

    fn full_blocks(&self, tokens: &[u32]) -> usize {
        tokens.len() / self.block_size
    }

    /// `backend` was routed `tokens`: it holds every full-block prefix of them.
    pub fn insert(&mut self, tokens: &[u32], backend: BackendId) {
        let blocks = self.full_blocks(tokens);
        let set = self.held.entry(backend).or_default();
        for count in 1..=blocks {
            set.insert(tokens[..count * self.block_size].to_vec());
        }
    }

    /// Longest full-block prefix of `tokens` that `backend` holds, in blocks.
    pub fn longest_match(&self, tokens: &[u32], backend: BackendId) -> u32 {
        let Some(set) = self.held.get(&backend) else {
            return 0;
        };
        let mut matched = 0;
        for count in 1..=self.full_blocks(tokens) {
            if set.contains(&tokens[..count * self.block_size]) {
                matched = count as u32;
            } else {
                break;
            }
        }
        matched
    }

    /// Every backend's longest match of `tokens` (backends matching nothing omitted).
    pub fn lookup(&self, tokens: &[u32]) -> BTreeMap<BackendId, u32> {
        self.held
            .keys()
            .map(|&backend| (backend, self.longest_match(tokens, backend)))
            .filter(|&(_, matched)| matched > 0)
            .collect()
    }

    /// `backend` loses the last full block of `tokens` and everything extending it.
    pub fn remove_block(&mut self, tokens: &[u32], backend: BackendId) {
        let blocks = self.full_blocks(tokens);
        if blocks == 0 {
            return;
        }
        let target = &tokens[..blocks * self.block_size];
        if let Some(set) = self.held.get_mut(&backend) {
            set.retain(|prefix| !prefix.starts_with(target));
        }
    }

    /// `backend` loses everything.
    pub fn remove_backend(&mut self, backend: BackendId) {
        self.held.remove(&backend);
    }

    /// Distinct prefixes (blocks) held by anyone.
    pub fn stored_blocks(&self) -> usize {
        self.held
            .values()
            .flat_map(|set| set.iter())
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Blocks each backend holds, by backend id (backends holding none left out).
    pub fn blocks_by_backend(&self) -> Vec<(BackendId, usize)> {
        self.held
            .iter()
            .filter(|(_, set)| !set.is_empty())
            .map(|(&backend, set)| (backend, set.len()))
            .collect()
    }

    /// Sum over backends of the blocks each holds.
    pub fn backend_blocks(&self) -> usize {
        self.held.values().map(BTreeSet::len).sum()
    }
}

/// Block size of the scripted trees: small, so scripts build deep, branchy trees quickly.
pub const SCRIPT_BLOCK_SIZE: u32 = 2;
/// Distinct token values in scripts: few, so prefixes are shared and runs split often, but
/// enough that a node can have more than 16 children (6 x 6 = 36 distinct 2-token blocks), so
/// scripts reach the large child index and its shrink back to a vector.
pub const SCRIPT_ALPHABET: u8 = 6;
/// Bound of the evicting tree in scripts.
const SCRIPT_EVICTING_MAX_BLOCKS: usize = 12;

/// What a script exercised in the non-evicting tree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScriptCoverage {
    /// Most nodes with a large child index at once.
    pub most_large_indexes: usize,
    /// Steps after which fewer nodes had a large index than before (a shrink back to a
    /// vector, or a large node freed).
    pub large_index_drops: usize,
}

/// Decodes `data` as a sequence of operations, applies them to a non-evicting tree, an evicting
/// tree and the model, and checks after each step that the non-evicting tree agrees exactly with
/// the model and the evicting one holds a subset of it within its bound. Any input is valid.
pub fn check_script(data: &[u8]) -> Result<(), String> {
    check_script_coverage(data).map(|_| ())
}

/// [`check_script`], also saying what the script exercised.
///
/// Each operation is: an op byte (`% 16`: 0 to 7 insert, 8 to 10 remove the prompt's last block
/// and below for the backend, 11 removes the backend, 12 to 15 only look up), a backend byte
/// (`% 4`), a length byte (`% 16` tokens) and that many token bytes (`% SCRIPT_ALPHABET`);
/// missing bytes read as 0. Inserts dominate so random scripts grow nodes past 16 children
/// before removals take them back.
pub fn check_script_coverage(data: &[u8]) -> Result<ScriptCoverage, String> {
    let mut coverage = ScriptCoverage::default();
    let mut exact = PrefixTree::new(TreeConfig {
        block_size: SCRIPT_BLOCK_SIZE,
        max_blocks: usize::MAX,
    })
    .map_err(|error| error.to_string())?;
    let mut evicting = PrefixTree::new(TreeConfig {
        block_size: SCRIPT_BLOCK_SIZE,
        max_blocks: SCRIPT_EVICTING_MAX_BLOCKS,
    })
    .map_err(|error| error.to_string())?;
    let mut model = ReferenceModel::new(SCRIPT_BLOCK_SIZE as usize);
    let mut bytes = data.iter().copied();
    let mut now_ms = 0u64;
    let mut large_before = 0;
    while let Some(op) = bytes.next() {
        let backend = BackendId(u32::from(bytes.next().unwrap_or(0) % 4));
        let length_tokens = usize::from(bytes.next().unwrap_or(0) % 16);
        let tokens: Vec<u32> = (0..length_tokens)
            .map(|_| u32::from(bytes.next().unwrap_or(0) % SCRIPT_ALPHABET))
            .collect();
        now_ms += 1;
        match op % 16 {
            0..=7 => {
                exact.insert(&tokens, backend, now_ms);
                evicting.insert(&tokens, backend, now_ms);
                model.insert(&tokens, backend);
                let want = (tokens.len() / SCRIPT_BLOCK_SIZE as usize)
                    .min(SCRIPT_EVICTING_MAX_BLOCKS) as u32;
                let got = evicting.lookup(&tokens).matched_blocks_of(backend);
                if got != want {
                    return Err(format!(
                        "evicting tree lost the chain just inserted: {got} != {want}"
                    ));
                }
            }
            8..=10 => {
                let chain = exact.chain(&tokens);
                exact.remove_block(chain.hashes(), backend);
                evicting.remove_block(chain.hashes(), backend);
                model.remove_block(&tokens, backend);
            }
            11 => {
                exact.remove_backend(backend);
                evicting.remove_backend(backend);
                model.remove_backend(backend);
            }
            _ => {}
        }
        exact.check_invariants()?;
        evicting.check_invariants()?;
        let want = model.lookup(&tokens);
        let got: BTreeMap<BackendId, u32> = exact
            .lookup(&tokens)
            .backends
            .iter()
            .map(|prefix| (prefix.backend, prefix.matched_blocks))
            .collect();
        if got != want {
            return Err(format!("lookup {tokens:?}: tree {got:?} != model {want:?}"));
        }
        for prefix in evicting.lookup(&tokens).backends {
            if prefix.matched_blocks > model.longest_match(&tokens, prefix.backend) {
                return Err(format!(
                    "evicting tree claims more than the model: {prefix:?}"
                ));
            }
        }
        let stats = exact.stats();
        if stats.stored_blocks != model.stored_blocks()
            || stats.backend_blocks != model.backend_blocks()
        {
            return Err(format!(
                "sizes: tree {}/{} != model {}/{}",
                stats.stored_blocks,
                stats.backend_blocks,
                model.stored_blocks(),
                model.backend_blocks()
            ));
        }
        if evicting.stored_blocks() > SCRIPT_EVICTING_MAX_BLOCKS {
            return Err(format!(
                "evicting tree over its bound: {}",
                evicting.stored_blocks()
            ));
        }
        let large = exact.large_child_indexes();
        if large < large_before {
            coverage.large_index_drops += 1;
        }
        coverage.most_large_indexes = coverage.most_large_indexes.max(large);
        large_before = large;
    }
    Ok(coverage)
}
