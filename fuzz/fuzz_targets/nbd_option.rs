//! Fuzzes the NBD handshake parsers: client flags, option headers and every
//! option payload, plus the meta-context matcher. None may panic, and a
//! parsed option must respect the protocol's string bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::frontend::nbd::fuzzing::option_input(data));
