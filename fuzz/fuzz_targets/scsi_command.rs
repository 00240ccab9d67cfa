//! Fuzzes whole SCSI commands against a logical unit on an in-memory
//! volume: decoding, the analytics count, data-out fitting and execution.
//! The body lives in `strata::frontend::iscsi::fuzzing`, where a unit test
//! replays `fuzz/corpus-seeds/scsi_command/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    strata::frontend::iscsi::fuzzing::scsi_input(data);
});
