//! Fuzz target: arbitrary bytes decoded as insert/lookup/remove scripts, the tree checked after
//! every step against the naive reference model and its own structural invariants.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(mismatch) = myelin_art::model::check_script(data) {
        panic!("prefix tree diverged from the reference model: {mismatch}");
    }
});
