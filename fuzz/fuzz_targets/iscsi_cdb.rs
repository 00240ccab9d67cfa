//! Fuzzes the SCSI CDB decoder and the pure page builders it drives.
//! The body lives in `strata::frontend::iscsi::fuzzing`, where a unit test
//! replays `fuzz/corpus-seeds/iscsi_cdb/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    strata::frontend::iscsi::fuzzing::cdb_input(data);
});
