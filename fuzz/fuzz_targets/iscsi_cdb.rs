//! Fuzzes the SCSI CDB decoder and the pure page builders it drives.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata::scsi::cdb::{self, Command, Transfer};
use strata::scsi::opcodes;

fuzz_target!(|data: &[u8]| {
    if let Ok(command) = cdb::decode(data) {
        match command.transfer(512) {
            Transfer::Out(bytes) | Transfer::In(bytes) => assert!(bytes <= 2 * u32::MAX as u64 * 512),
            Transfer::None => {}
        }
        if let Command::ReportSupportedOpcodes {
            rctd,
            options,
            opcode,
            service_action,
            ..
        } = command
        {
            let _ = opcodes::report(rctd, options, opcode, service_action);
        }
    }
});
