//! The 100k-prefix dataset shared by the prefix-tree, Leis-comparison and routing benchmarks
//! (included with `#[path]`), so their figures are comparable: 98k chats (one of 256 system
//! prompts + a user turn, 512 tokens) and 2k long conversations (8,192 tokens).

pub const SYSTEM_PROMPTS: usize = 256;
pub const SYSTEM_TOKENS: usize = 256;
pub const CHAT_PREFIXES: usize = 98_000;
pub const CHAT_TOKENS: usize = 512;
pub const LONG_PREFIXES: usize = 2_000;
pub const LONG_TOKENS: usize = 8_192;
pub const BACKENDS: u32 = 8;

/// xorshift64* (Vigna 2016): deterministic tokens, no dependency.
pub struct Tokens(pub u64);

impl Tokens {
    pub fn next(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as u32 % 128_000
    }

    /// `system` followed by random tokens up to `total`.
    pub fn prompt(&mut self, system: &[u32], total: usize) -> Vec<u32> {
        let mut tokens = system.to_vec();
        while tokens.len() < total {
            tokens.push(self.next());
        }
        tokens
    }
}

/// The prompts of the dataset.
pub struct Corpus {
    pub systems: Vec<Vec<u32>>,
    pub chats: Vec<Vec<u32>>,
    pub longs: Vec<Vec<u32>>,
}

impl Corpus {
    /// Every stored prefix, chats first: the index is what [`backend_index`] takes.
    pub fn prefixes(&self) -> impl Iterator<Item = &Vec<u32>> {
        self.chats.iter().chain(&self.longs)
    }
}

/// Builds the dataset from `seed`.
pub fn corpus(seed: u64) -> Corpus {
    let mut random = Tokens(seed);
    let systems: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
        .map(|_| random.prompt(&[], SYSTEM_TOKENS))
        .collect();
    let chats = (0..CHAT_PREFIXES)
        .map(|index| random.prompt(&systems[index % SYSTEM_PROMPTS], CHAT_TOKENS))
        .collect();
    let longs = (0..LONG_PREFIXES)
        .map(|index| random.prompt(&systems[index % SYSTEM_PROMPTS], LONG_TOKENS))
        .collect();
    Corpus {
        systems,
        chats,
        longs,
    }
}

/// Prefix `index` goes to this backend: consecutive users of one system prompt land on
/// different backends, so shared blocks carry several entries.
pub fn backend_index(index: usize) -> u32 {
    (index / SYSTEM_PROMPTS) as u32 % BACKENDS
}

/// Minimum over `batches` of the mean time of `per_batch` calls, in ns: an estimate of the
/// uncontended cost on a shared machine, where criterion's means include other processes.
pub fn min_nanos(batches: usize, per_batch: usize, mut operation: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..batches {
        let start = std::time::Instant::now();
        for _ in 0..per_batch {
            operation();
        }
        best = best.min(start.elapsed().as_nanos() as f64 / per_batch as f64);
    }
    best
}
