//! Cache namespaces: what an engine keys its prefix cache by besides the tokens. vLLM hashes a
//! LoRA adapter's name into every block of a request to that adapter, and a request's
//! `cache_salt` into its first block, so two requests with the same tokens share no cached
//! block unless they name the same adapter (or none) and the same salt (or none). The router
//! hashes prompts from a per-namespace root ([`namespace_root`]), the KV-event mirror hashes
//! the engine's blocks from the root of the namespace their extra keys name, and so neither
//! history nor residency of one namespace counts for another.

/// The chain root of the namespace of `adapter` (a LoRA adapter's name, `None` for the base
/// model) and `salt` (the request's `cache_salt`; `None` or empty: unsalted, as in vLLM). The
/// plain namespace (neither) is [`crate::ROOT_CHAIN_HASH`], the root of every chain before
/// namespaces existed.
pub fn namespace_root(adapter: Option<&str>, salt: Option<&str>) -> u64 {
    let salt = salt.filter(|salt| !salt.is_empty());
    if adapter.is_none() && salt.is_none() {
        return myelin_art::ROOT_CHAIN_HASH;
    }
    let mut words = Vec::new();
    for (tag, part) in [(1u32, adapter), (2, salt)] {
        let Some(part) = part else { continue };
        words.push(tag);
        words.push(u32::try_from(part.len()).unwrap_or(u32::MAX));
        for chunk in part.as_bytes().chunks(4) {
            let mut word = [0u8; 4];
            word[..chunk.len()].copy_from_slice(chunk);
            words.push(u32::from_le_bytes(word));
        }
    }
    myelin_art::namespace_root(&words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_adapter_and_salt_has_its_own_root_and_none_is_the_plain_one() {
        let plain = myelin_art::ROOT_CHAIN_HASH;
        assert_eq!(namespace_root(None, None), plain);
        assert_eq!(
            namespace_root(None, Some("")),
            plain,
            "an empty salt is no salt"
        );
        let roots = [
            namespace_root(Some("sql-lora"), None),
            namespace_root(None, Some("sql-lora")),
            namespace_root(Some("sql-lora"), Some("tenant-1")),
            namespace_root(Some("sql-lora"), Some("tenant-2")),
            namespace_root(None, Some("tenant-1")),
            // Lengths are part of the key: a shorter name padded with zero bytes differs.
            namespace_root(Some("ab"), None),
            namespace_root(Some("ab\0\0"), None),
        ];
        for (i, a) in roots.iter().enumerate() {
            assert_ne!(*a, plain);
            for b in &roots[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(
            namespace_root(Some("sql-lora"), Some("tenant-1")),
            roots[2],
            "stable"
        );
    }
}
