//! Fuzzes the superblock decoder (see src/meta/fuzzing.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::meta::fuzzing::superblock_input(data));
