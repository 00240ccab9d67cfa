//! Fuzzes the log block decoder (see src/pool/fuzzing.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::pool::fuzzing::log_block_input(data));
