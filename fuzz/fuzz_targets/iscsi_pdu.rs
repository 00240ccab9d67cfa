//! Fuzzes PDU framing: header/data-segment layout, digests, padding.
//! The body lives in `strata::frontend::iscsi::fuzzing`, where a unit test
//! replays `fuzz/corpus-seeds/iscsi_pdu/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    strata::frontend::iscsi::fuzzing::pdu_input(data);
});
