//! The CDB decoder: a pure function from command descriptor block bytes to a
//! [`Command`] or the sense data that rejects it. It knows nothing about the
//! volume (range checks against the capacity happen when the command runs).

use super::sense::Sense;

/// Operation codes (SPC-4 / SBC-3).
pub mod opcode {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0a;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT_6: u8 = 0x15;
    pub const RESERVE_6: u8 = 0x16;
    pub const RELEASE_6: u8 = 0x17;
    pub const MODE_SENSE_6: u8 = 0x1a;
    pub const START_STOP_UNIT: u8 = 0x1b;
    pub const PREVENT_ALLOW_MEDIUM_REMOVAL: u8 = 0x1e;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2a;
    pub const WRITE_AND_VERIFY_10: u8 = 0x2e;
    pub const VERIFY_10: u8 = 0x2f;
    pub const PREFETCH_10: u8 = 0x34;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const MODE_SELECT_10: u8 = 0x55;
    pub const MODE_SENSE_10: u8 = 0x5a;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5e;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5f;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8a;
    pub const WRITE_AND_VERIFY_16: u8 = 0x8e;
    pub const VERIFY_16: u8 = 0x8f;
    pub const PREFETCH_16: u8 = 0x90;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9e;
    pub const REPORT_LUNS: u8 = 0xa0;
    pub const MAINTENANCE_IN: u8 = 0xa3;
    pub const READ_12: u8 = 0xa8;
    pub const WRITE_12: u8 = 0xaa;
    pub const WRITE_AND_VERIFY_12: u8 = 0xae;
    pub const VERIFY_12: u8 = 0xaf;

    /// SERVICE ACTION IN (16) service actions.
    pub const SA_READ_CAPACITY_16: u8 = 0x10;
    pub const SA_GET_LBA_STATUS: u8 = 0x12;
    /// MAINTENANCE IN service action.
    pub const SA_REPORT_SUPPORTED_OPCODES: u8 = 0x0c;
}

/// Which mode-page values MODE SENSE reports (SPC-4 6.11, PC field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageControl {
    Current,
    Changeable,
    Default,
    Saved,
}

/// A decoded command. Lengths are in logical blocks or bytes as named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    TestUnitReady,
    RequestSense {
        descriptor: bool,
        alloc_len: u32,
    },
    Inquiry {
        evpd: bool,
        page: u8,
        alloc_len: u32,
    },
    ReportLuns {
        select: u8,
        alloc_len: u32,
    },
    ReadCapacity10,
    ReadCapacity16 {
        alloc_len: u32,
    },
    GetLbaStatus {
        lba: u64,
        alloc_len: u32,
    },
    Read {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    Write {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    /// WRITE AND VERIFY: a write that is durable before status (BYTCHK is
    /// trivially satisfied by the data just written).
    WriteAndVerify {
        lba: u64,
        blocks: u32,
    },
    /// VERIFY: `bytchk` 0 checks the medium only, 1 compares `blocks` blocks
    /// of data-out, 3 compares one block of data-out against every block.
    Verify {
        lba: u64,
        blocks: u32,
        bytchk: u8,
    },
    WriteSame {
        lba: u64,
        blocks: u32,
        unmap: bool,
        ndob: bool,
    },
    Unmap {
        param_len: u32,
    },
    CompareAndWrite {
        lba: u64,
        blocks: u32,
        fua: bool,
    },
    SynchronizeCache {
        lba: u64,
        blocks: u32,
    },
    Prefetch {
        lba: u64,
        blocks: u32,
    },
    ModeSense {
        ten: bool,
        dbd: bool,
        llbaa: bool,
        pc: PageControl,
        page: u8,
        subpage: u8,
        alloc_len: u32,
    },
    ModeSelect {
        ten: bool,
        pf: bool,
        sp: bool,
        param_len: u32,
    },
    ReportSupportedOpcodes {
        rctd: bool,
        options: u8,
        opcode: u8,
        service_action: u16,
        alloc_len: u32,
    },
    StartStopUnit {
        immed: bool,
        power_condition: u8,
        loej: bool,
        start: bool,
    },
    PreventAllowMediumRemoval {
        prevent: u8,
    },
    PersistentReserveIn {
        action: u8,
        alloc_len: u32,
    },
    PersistentReserveOut {
        action: u8,
        scope: u8,
        kind: u8,
        param_len: u32,
    },
    Reserve6,
    Release6,
}

/// Direction and size of the data a command transfers, as the CDB states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    None,
    /// Data-in of at most this many bytes (allocation length or blocks).
    In(u64),
    /// Data-out of exactly this many bytes.
    Out(u64),
}

fn u16_at(cdb: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([cdb[at], cdb[at + 1]])
}

fn u32_at(cdb: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([cdb[at], cdb[at + 1], cdb[at + 2], cdb[at + 3]])
}

fn u64_at(cdb: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&cdb[at..at + 8]);
    u64::from_be_bytes(bytes)
}

/// The CDB length implied by an operation code's group (SPC-4 4.2.5.1), or
/// `None` for groups we do not decode (variable length, vendor specific).
pub fn cdb_length(opcode: u8) -> Option<usize> {
    match opcode >> 5 {
        0 => Some(6),
        1 | 2 => Some(10),
        4 => Some(16),
        5 => Some(12),
        _ => None,
    }
}

fn invalid_field(byte: u16, bit: Option<u8>) -> Sense {
    Sense::INVALID_FIELD_IN_CDB.in_cdb(byte, bit)
}

/// Rejects a protection field (RDPROTECT/WRPROTECT/VRPROTECT, byte 1 bits
/// 7-5): volumes are formatted without protection information.
fn no_protection(cdb: &[u8]) -> Result<(), Sense> {
    if cdb[1] & 0xe0 != 0 {
        return Err(invalid_field(1, Some(7)));
    }
    Ok(())
}

/// Decodes `cdb`. Slices shorter than the opcode's CDB length are rejected
/// with INVALID FIELD IN CDB rather than read past.
pub fn decode(cdb: &[u8]) -> Result<Command, Sense> {
    let Some(&op) = cdb.first() else {
        return Err(Sense::INVALID_OPCODE);
    };
    let Some(len) = cdb_length(op) else {
        return Err(Sense::INVALID_OPCODE.in_cdb(0, None));
    };
    if cdb.len() < len {
        return Err(invalid_field(0, None));
    }
    let cdb = &cdb[..len];
    // CONTROL byte: NACA and the obsolete LINK bit are not supported.
    if cdb[len - 1] & 0x05 != 0 {
        return Err(invalid_field(len as u16 - 1, Some(2)));
    }
    use opcode::*;
    let command = match op {
        TEST_UNIT_READY => Command::TestUnitReady,
        REQUEST_SENSE => Command::RequestSense {
            descriptor: cdb[1] & 0x01 != 0,
            alloc_len: cdb[4] as u32,
        },
        INQUIRY => {
            if cdb[1] & 0x02 != 0 {
                // CmdDt is obsolete.
                return Err(invalid_field(1, Some(1)));
            }
            let evpd = cdb[1] & 0x01 != 0;
            if !evpd && cdb[2] != 0 {
                return Err(invalid_field(2, None));
            }
            Command::Inquiry {
                evpd,
                page: cdb[2],
                alloc_len: u16_at(cdb, 3) as u32,
            }
        }
        REPORT_LUNS => Command::ReportLuns {
            select: cdb[2],
            alloc_len: u32_at(cdb, 6),
        },
        READ_CAPACITY_10 => {
            // PMI with a non-zero LBA is obsolete; LBA without PMI is invalid.
            if cdb[8] & 0x01 == 0 && u32_at(cdb, 2) != 0 {
                return Err(invalid_field(2, None));
            }
            Command::ReadCapacity10
        }
        SERVICE_ACTION_IN_16 => match cdb[1] & 0x1f {
            SA_READ_CAPACITY_16 => Command::ReadCapacity16 {
                alloc_len: u32_at(cdb, 10),
            },
            SA_GET_LBA_STATUS => Command::GetLbaStatus {
                lba: u64_at(cdb, 2),
                alloc_len: u32_at(cdb, 10),
            },
            _ => return Err(invalid_field(1, Some(4))),
        },
        READ_6 | WRITE_6 => {
            let lba = (((cdb[1] & 0x1f) as u64) << 16) | u16_at(cdb, 2) as u64;
            // A transfer length of 0 means 256 blocks for the 6-byte commands.
            let blocks = if cdb[4] == 0 { 256 } else { cdb[4] as u32 };
            if op == READ_6 {
                Command::Read {
                    lba,
                    blocks,
                    fua: false,
                }
            } else {
                Command::Write {
                    lba,
                    blocks,
                    fua: false,
                }
            }
        }
        READ_10 | READ_12 | READ_16 | WRITE_10 | WRITE_12 | WRITE_16 => {
            no_protection(cdb)?;
            let (lba, blocks) = lba_and_length(cdb);
            let fua = cdb[1] & 0x08 != 0;
            if matches!(op, READ_10 | READ_12 | READ_16) {
                Command::Read { lba, blocks, fua }
            } else {
                Command::Write { lba, blocks, fua }
            }
        }
        WRITE_AND_VERIFY_10 | WRITE_AND_VERIFY_12 | WRITE_AND_VERIFY_16 => {
            no_protection(cdb)?;
            let (lba, blocks) = lba_and_length(cdb);
            Command::WriteAndVerify { lba, blocks }
        }
        VERIFY_10 | VERIFY_12 | VERIFY_16 => {
            no_protection(cdb)?;
            let bytchk = (cdb[1] >> 1) & 0x03;
            if bytchk == 2 {
                return Err(invalid_field(1, Some(2)));
            }
            let (lba, blocks) = lba_and_length(cdb);
            Command::Verify { lba, blocks, bytchk }
        }
        WRITE_SAME_10 | WRITE_SAME_16 => {
            no_protection(cdb)?;
            if cdb[1] & 0x10 != 0 {
                // ANCHOR: anchored blocks are not supported (ANC_SUP is 0).
                return Err(invalid_field(1, Some(4)));
            }
            let (lba, blocks) = lba_and_length(cdb);
            let ndob = op == WRITE_SAME_16 && cdb[1] & 0x01 != 0;
            Command::WriteSame {
                lba,
                blocks,
                unmap: cdb[1] & 0x08 != 0,
                ndob,
            }
        }
        UNMAP => {
            if cdb[1] & 0x01 != 0 {
                return Err(invalid_field(1, Some(0)));
            }
            Command::Unmap {
                param_len: u16_at(cdb, 7) as u32,
            }
        }
        COMPARE_AND_WRITE => {
            no_protection(cdb)?;
            Command::CompareAndWrite {
                lba: u64_at(cdb, 2),
                blocks: cdb[13] as u32,
                fua: cdb[1] & 0x08 != 0,
            }
        }
        SYNCHRONIZE_CACHE_10 | SYNCHRONIZE_CACHE_16 => {
            let (lba, blocks) = lba_and_length(cdb);
            Command::SynchronizeCache { lba, blocks }
        }
        PREFETCH_10 | PREFETCH_16 => {
            let (lba, blocks) = lba_and_length(cdb);
            Command::Prefetch { lba, blocks }
        }
        MODE_SENSE_6 | MODE_SENSE_10 => {
            let ten = op == MODE_SENSE_10;
            let pc = match cdb[2] >> 6 {
                0 => PageControl::Current,
                1 => PageControl::Changeable,
                2 => PageControl::Default,
                _ => PageControl::Saved,
            };
            Command::ModeSense {
                ten,
                dbd: cdb[1] & 0x08 != 0,
                llbaa: ten && cdb[1] & 0x10 != 0,
                pc,
                page: cdb[2] & 0x3f,
                subpage: cdb[3],
                alloc_len: if ten { u16_at(cdb, 7) as u32 } else { cdb[4] as u32 },
            }
        }
        MODE_SELECT_6 | MODE_SELECT_10 => {
            let ten = op == MODE_SELECT_10;
            Command::ModeSelect {
                ten,
                pf: cdb[1] & 0x10 != 0,
                sp: cdb[1] & 0x01 != 0,
                param_len: if ten { u16_at(cdb, 7) as u32 } else { cdb[4] as u32 },
            }
        }
        MAINTENANCE_IN => match cdb[1] & 0x1f {
            SA_REPORT_SUPPORTED_OPCODES => {
                let options = cdb[2] & 0x07;
                if options > 3 {
                    return Err(invalid_field(2, Some(2)));
                }
                Command::ReportSupportedOpcodes {
                    rctd: cdb[2] & 0x80 != 0,
                    options,
                    opcode: cdb[3],
                    service_action: u16_at(cdb, 4),
                    alloc_len: u32_at(cdb, 6),
                }
            }
            _ => return Err(invalid_field(1, Some(4))),
        },
        START_STOP_UNIT => Command::StartStopUnit {
            immed: cdb[1] & 0x01 != 0,
            power_condition: cdb[4] >> 4,
            loej: cdb[4] & 0x02 != 0,
            start: cdb[4] & 0x01 != 0,
        },
        PREVENT_ALLOW_MEDIUM_REMOVAL => Command::PreventAllowMediumRemoval { prevent: cdb[4] & 0x03 },
        PERSISTENT_RESERVE_IN => Command::PersistentReserveIn {
            action: cdb[1] & 0x1f,
            alloc_len: u16_at(cdb, 7) as u32,
        },
        PERSISTENT_RESERVE_OUT => Command::PersistentReserveOut {
            action: cdb[1] & 0x1f,
            scope: cdb[2] >> 4,
            kind: cdb[2] & 0x0f,
            param_len: u32_at(cdb, 5),
        },
        RESERVE_6 => {
            if cdb[1] & 0x01 != 0 {
                // Third-party reservations are obsolete.
                return Err(invalid_field(1, Some(0)));
            }
            Command::Reserve6
        }
        RELEASE_6 => {
            if cdb[1] & 0x01 != 0 {
                return Err(invalid_field(1, Some(0)));
            }
            Command::Release6
        }
        _ => return Err(Sense::INVALID_OPCODE.in_cdb(0, None)),
    };
    Ok(command)
}

/// LBA and transfer length of a 10, 12 or 16 byte block command.
fn lba_and_length(cdb: &[u8]) -> (u64, u32) {
    match cdb.len() {
        10 => (u32_at(cdb, 2) as u64, u16_at(cdb, 7) as u32),
        12 => (u32_at(cdb, 2) as u64, u32_at(cdb, 6)),
        _ => (u64_at(cdb, 2), u32_at(cdb, 10)),
    }
}

impl Command {
    /// What the CDB says about the data transfer, given the logical block size.
    pub fn transfer(&self, block_bytes: u32) -> Transfer {
        let blocks = |n: u32| n as u64 * block_bytes as u64;
        match *self {
            Command::Read { blocks: n, .. } => Transfer::In(blocks(n)),
            Command::Write { blocks: n, .. } | Command::WriteAndVerify { blocks: n, .. } => Transfer::Out(blocks(n)),
            Command::Verify { blocks: n, bytchk, .. } => match bytchk {
                0 => Transfer::None,
                3 => Transfer::Out(if n == 0 { 0 } else { block_bytes as u64 }),
                _ => Transfer::Out(blocks(n)),
            },
            Command::WriteSame { ndob, .. } => {
                if ndob {
                    Transfer::None
                } else {
                    Transfer::Out(block_bytes as u64)
                }
            }
            Command::CompareAndWrite { blocks: n, .. } => Transfer::Out(2 * blocks(n)),
            Command::Unmap { param_len }
            | Command::ModeSelect { param_len, .. }
            | Command::PersistentReserveOut { param_len, .. } => {
                if param_len == 0 {
                    Transfer::None
                } else {
                    Transfer::Out(param_len as u64)
                }
            }
            Command::RequestSense { alloc_len, .. }
            | Command::Inquiry { alloc_len, .. }
            | Command::ReportLuns { alloc_len, .. }
            | Command::ReadCapacity16 { alloc_len }
            | Command::GetLbaStatus { alloc_len, .. }
            | Command::ModeSense { alloc_len, .. }
            | Command::ReportSupportedOpcodes { alloc_len, .. }
            | Command::PersistentReserveIn { alloc_len, .. } => Transfer::In(alloc_len as u64),
            Command::ReadCapacity10 => Transfer::In(8),
            Command::TestUnitReady
            | Command::SynchronizeCache { .. }
            | Command::Prefetch { .. }
            | Command::StartStopUnit { .. }
            | Command::PreventAllowMediumRemoval { .. }
            | Command::Reserve6
            | Command::Release6 => Transfer::None,
        }
    }

    /// Whether the command changes the medium (the logical blocks), which a
    /// write-protected unit refuses with DATA PROTECT, WRITE PROTECTED.
    pub fn writes_medium(&self) -> bool {
        matches!(
            self,
            Command::Write { .. }
                | Command::WriteAndVerify { .. }
                | Command::WriteSame { .. }
                | Command::Unmap { .. }
                | Command::CompareAndWrite { .. }
        )
    }

    /// Whether the command only reads state, so it may run while a
    /// reservation held by another initiator excludes writers.
    pub fn is_read_only(&self) -> bool {
        !matches!(
            self,
            Command::Write { .. }
                | Command::WriteAndVerify { .. }
                | Command::WriteSame { .. }
                | Command::Unmap { .. }
                | Command::CompareAndWrite { .. }
                | Command::SynchronizeCache { .. }
                | Command::ModeSelect { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cdb16(bytes: &[u8]) -> [u8; 16] {
        let mut cdb = [0u8; 16];
        cdb[..bytes.len()].copy_from_slice(bytes);
        cdb
    }

    #[test]
    fn read10_decodes_lba_length_and_fua() {
        let cdb = cdb16(&[0x28, 0x08, 0, 0, 0x12, 0x34, 0, 0, 8, 0]);
        assert_eq!(
            decode(&cdb),
            Ok(Command::Read {
                lba: 0x1234,
                blocks: 8,
                fua: true
            })
        );
    }

    #[test]
    fn read6_zero_length_means_256() {
        let cdb = cdb16(&[0x08, 0x01, 0x02, 0x03, 0, 0]);
        assert_eq!(
            decode(&cdb),
            Ok(Command::Read {
                lba: 0x010203,
                blocks: 256,
                fua: false
            })
        );
    }

    #[test]
    fn write16_with_wrprotect_is_invalid_field() {
        let cdb = cdb16(&[0x8a, 0x20]);
        assert_eq!(decode(&cdb).unwrap_err().asc, 0x24);
    }

    #[test]
    fn unknown_opcode_is_invalid_opcode() {
        assert_eq!(decode(&cdb16(&[0x02])).unwrap_err().asc, 0x20);
        assert_eq!(decode(&cdb16(&[0xff])).unwrap_err().asc, 0x20);
        assert_eq!(decode(&[]).unwrap_err().asc, 0x20);
    }

    #[test]
    fn short_cdb_is_rejected_not_read_past() {
        assert!(decode(&[0x88, 0, 0]).is_err());
    }

    #[test]
    fn naca_is_rejected() {
        let cdb = cdb16(&[0x00, 0, 0, 0, 0, 0x04]);
        assert_eq!(decode(&cdb).unwrap_err().asc, 0x24);
    }

    #[test]
    fn compare_and_write_transfers_twice_the_blocks() {
        let cdb = cdb16(&[0x89, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0]);
        let command = decode(&cdb).unwrap();
        assert_eq!(command.transfer(512), Transfer::Out(2048));
    }

    #[test]
    fn decoder_never_panics_on_any_short_input() {
        for op in 0..=255u8 {
            for len in 0..=16 {
                let mut cdb = vec![0xffu8; len];
                if let Some(first) = cdb.first_mut() {
                    *first = op;
                }
                let _ = decode(&cdb);
            }
        }
    }
}
