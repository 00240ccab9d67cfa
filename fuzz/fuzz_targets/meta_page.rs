//! Fuzzes the page decoder (see src/meta/fuzzing.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::meta::fuzzing::page_input(data));
