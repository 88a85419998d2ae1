//! Adaptive radix tree over token-id prefixes, block-granular, bounded memory.
