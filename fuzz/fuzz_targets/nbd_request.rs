//! Fuzzes the NBD transmission request parser and its validity check.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::frontend::nbd::fuzzing::request_input(data));
