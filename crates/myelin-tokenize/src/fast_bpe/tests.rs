//! Unit tests of the fast path's internals against the bundled tokenizer's tables; the
//! comparisons with HF are in `tests/fast_bpe_exact.rs`.

use proptest::prelude::*;

use super::*;

fn bundled() -> FastBpe {
    let path = crate::bundled_tokenizer_path().expect("bundled tokenizer");
    FastBpe::from_tokenizer_json(&path)
        .expect("readable")
        .expect("bundled tokenizer is supported")
}

fn shared_tables() -> &'static Tables {
    static TABLES: std::sync::OnceLock<FastBpe> = std::sync::OnceLock::new();
    &TABLES.get_or_init(bundled).tables
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The scan (short words) and the heap (long words) pick the same merges.
    #[test]
    fn scan_and_heap_merge_alike(word in "[a-e \n0-9é中]{0,80}") {
        let tables = shared_tables();
        let initial: Vec<u32> = word.bytes().map(|byte| tables.byte_ids[usize::from(byte)]).collect();
        let mut by_scan = initial.clone();
        tables.merges.merge_by_scan(&mut by_scan);
        let mut by_heap = initial;
        tables.merges.merge_by_heap(&mut by_heap);
        prop_assert_eq!(by_scan, by_heap);
    }
}

#[test]
fn repeated_letters_merge_leftmost_first() {
    let tables = shared_tables();
    for length in [2usize, 3, 5, 64, 200] {
        let initial = vec![tables.byte_ids[usize::from(b'a')]; length];
        let mut by_scan = initial.clone();
        tables.merges.merge_by_scan(&mut by_scan);
        let mut by_heap = initial;
        tables.merges.merge_by_heap(&mut by_heap);
        assert_eq!(by_scan, by_heap, "{length} letters");
        assert!(by_scan.len() < length, "{length} letters did not merge");
    }
}

#[test]
fn clones_share_tables_and_start_cold() {
    let mut original = bundled().with_cache_generation_entries(100);
    let mut ids = Vec::new();
    original.encode_plain("hello world", &mut ids);
    assert!(original.cached_words() > 0);
    let clone = original.clone();
    assert!(Arc::ptr_eq(&original.tables, &clone.tables));
    assert_eq!(clone.cached_words(), 0);
    assert_eq!(clone.cache.generation_capacity(), 100);
}

#[test]
fn instances_can_move_to_router_cores() {
    fn assert_send<T: Send>() {}
    assert_send::<FastBpe>();
}
