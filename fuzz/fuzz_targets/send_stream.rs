//! Fuzzes the send stream parser (see src/control/fuzzing.rs): the header,
//! every record's checks and END, as `strata receive` applies them.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| strata::control::fuzzing::stream_input(data));
