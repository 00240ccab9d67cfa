//! Fuzzes the log block decoder (see src/meta/fuzzing.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::meta::fuzzing::log_block_input(data));
