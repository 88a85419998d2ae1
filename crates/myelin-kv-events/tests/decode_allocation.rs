//! Memory bound of the decoder, measured with a counting global allocator (its own test binary
//! so no other test allocates meanwhile): headers that declare many elements, backed by enough
//! bytes to pass the length check, must not make the decoder reserve memory for all of them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use myelin_kv_events::decode_batch;

struct CountingAllocator;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: delegates to the system allocator and only adds bookkeeping.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Peak bytes allocated (above what was live before) while decoding `payload`.
fn peak_while_decoding(payload: &[u8]) -> usize {
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    PEAK_BYTES.store(before, Ordering::Relaxed);
    let result = decode_batch(payload);
    assert!(result.is_err(), "the payload is invalid by construction");
    drop(result);
    PEAK_BYTES.load(Ordering::Relaxed) - before
}

#[test]
fn declared_lengths_do_not_drive_allocation() {
    const DECLARED: u32 = 1_000_000;
    let header = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
    let padding = vec![0xc1; DECLARED as usize * 2];

    // An events array of a million, then garbage: fails at the first event.
    let mut events = header.to_vec();
    events.push(0xdd);
    events.extend_from_slice(&DECLARED.to_be_bytes());
    events.extend_from_slice(&padding);

    // One removal whose block_hashes array declares a million, then garbage.
    let mut hashes = header.to_vec();
    hashes.extend_from_slice(&[0x91, 0x92, 0xac]);
    hashes.extend_from_slice(b"BlockRemoved");
    hashes.push(0xdd);
    hashes.extend_from_slice(&DECLARED.to_be_bytes());
    hashes.extend_from_slice(&padding);

    for (name, payload) in [("events", events), ("block_hashes", hashes)] {
        let peak = peak_while_decoding(&payload);
        // Reserving for every declared element would take 8 MB (hashes) to 200 MB (events).
        assert!(peak < 256 * 1024, "{name}: {peak} bytes allocated");
    }
}
