//! Fuzzes whole NFSv3 calls against a dataset on an in-memory pool, as the
//! server answers a record. The body lives in
//! `strata::frontend::nfs::fuzzing`, where a unit test replays
//! `fuzz/corpus-seeds/nfs_call/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    strata::frontend::nfs::fuzzing::call_sequence_input(data);
});
