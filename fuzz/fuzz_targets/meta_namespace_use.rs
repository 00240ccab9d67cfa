//! Fuzzes a stored metadata record loaded into a small pool and used
//! (see src/pool/fuzzing.rs, `namespace_use`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::pool::fuzzing::namespace_use(data));
