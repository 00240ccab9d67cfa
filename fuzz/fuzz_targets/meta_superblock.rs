//! Fuzzes the superblock decoder (see src/pool/fuzzing.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::pool::fuzzing::superblock_input(data));
