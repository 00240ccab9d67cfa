//! SCSI status codes and sense data (SPC-4 4.5), and the one mapping from
//! [`BlockError`] to sense.

use crate::block::BlockError;

/// SCSI status byte values (SAM-5 5.3).
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const CONDITION_MET: u8 = 0x04;
    pub const BUSY: u8 = 0x08;
    pub const RESERVATION_CONFLICT: u8 = 0x18;
    pub const TASK_SET_FULL: u8 = 0x28;
    pub const TASK_ABORTED: u8 = 0x40;
}

/// Sense keys (SPC-4 table 48).
pub mod key {
    pub const NO_SENSE: u8 = 0x0;
    pub const NOT_READY: u8 = 0x2;
    pub const MEDIUM_ERROR: u8 = 0x3;
    pub const HARDWARE_ERROR: u8 = 0x4;
    pub const ILLEGAL_REQUEST: u8 = 0x5;
    pub const UNIT_ATTENTION: u8 = 0x6;
    pub const DATA_PROTECT: u8 = 0x7;
    pub const ABORTED_COMMAND: u8 = 0xb;
    pub const MISCOMPARE: u8 = 0xe;
}

/// Sense data: a key, an additional sense code and qualifier, and the
/// optional INFORMATION field and sense-key-specific field pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// The INFORMATION field (VALID bit set when present).
    pub information: Option<u64>,
    /// Sense-key specific field pointer: (in the CDB rather than the
    /// parameter list, byte offset, bit).
    pub field_pointer: Option<(bool, u16, Option<u8>)>,
}

/// Length of fixed-format sense data we produce.
pub const FIXED_SENSE_BYTES: usize = 18;

impl Sense {
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Self {
        Sense {
            key,
            asc,
            ascq,
            information: None,
            field_pointer: None,
        }
    }

    pub const INVALID_OPCODE: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x20, 0x00);
    pub const INVALID_FIELD_IN_CDB: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x24, 0x00);
    pub const INVALID_FIELD_IN_PARAMETER_LIST: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x26, 0x00);
    pub const PARAMETER_LIST_LENGTH_ERROR: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x1a, 0x00);
    pub const INVALID_FIELD_IN_INFORMATION_UNIT: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x0e, 0x03);
    pub const LBA_OUT_OF_RANGE: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x21, 0x00);
    pub const LUN_NOT_SUPPORTED: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x25, 0x00);
    pub const SAVING_PARAMETERS_NOT_SUPPORTED: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x39, 0x00);
    pub const MISCOMPARE_DURING_VERIFY: Sense = Sense::new(key::MISCOMPARE, 0x1d, 0x00);
    pub const WRITE_PROTECTED: Sense = Sense::new(key::DATA_PROTECT, 0x27, 0x00);
    pub const SPACE_ALLOCATION_FAILED: Sense = Sense::new(key::DATA_PROTECT, 0x27, 0x07);
    pub const UNRECOVERED_READ_ERROR: Sense = Sense::new(key::MEDIUM_ERROR, 0x11, 0x00);
    pub const WRITE_ERROR: Sense = Sense::new(key::MEDIUM_ERROR, 0x0c, 0x00);
    pub const INTERNAL_TARGET_FAILURE: Sense = Sense::new(key::HARDWARE_ERROR, 0x44, 0x00);
    pub const NOT_READY_NOT_PRESENT: Sense = Sense::new(key::NOT_READY, 0x3a, 0x00);
    pub const POWER_ON_RESET: Sense = Sense::new(key::UNIT_ATTENTION, 0x29, 0x00);
    pub const BUS_DEVICE_RESET: Sense = Sense::new(key::UNIT_ATTENTION, 0x29, 0x03);
    pub const MODE_PARAMETERS_CHANGED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x01);
    pub const RESERVATIONS_PREEMPTED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x03);
    pub const RESERVATIONS_RELEASED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x04);
    pub const REGISTRATIONS_PREEMPTED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x05);
    pub const CAPACITY_DATA_CHANGED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x09);
    /// THIN PROVISIONING SOFT THRESHOLD REACHED; INFORMATION: the byte
    /// offset of the threshold descriptor in its mode page (SBC-4 4.7.3.7.6).
    pub const THIN_PROVISIONING_SOFT_THRESHOLD_REACHED: Sense =
        Sense::new(key::UNIT_ATTENTION, 0x38, 0x07).with_information(super::pages::SOFT_THRESHOLD_DESCRIPTOR_OFFSET);
    pub const COMMANDS_CLEARED_BY_ANOTHER_INITIATOR: Sense = Sense::new(key::UNIT_ATTENTION, 0x2f, 0x00);
    pub const INSUFFICIENT_REGISTRATION_RESOURCES: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x55, 0x04);

    /// The same sense, pointing at `byte` (and optionally `bit`) of the CDB.
    pub const fn in_cdb(self, byte: u16, bit: Option<u8>) -> Self {
        Sense {
            field_pointer: Some((true, byte, bit)),
            ..self
        }
    }

    pub const fn with_information(self, information: u64) -> Self {
        Sense {
            information: Some(information),
            ..self
        }
    }

    /// Fixed-format sense data (response code 0x70).
    pub fn to_fixed(&self) -> [u8; FIXED_SENSE_BYTES] {
        let mut out = [0u8; FIXED_SENSE_BYTES];
        out[0] = 0x70;
        out[2] = self.key & 0x0f;
        if let Some(information) = self.information {
            out[0] |= 0x80;
            // The fixed format has room for 32 bits; larger values are truncated
            // as SPC-4 allows only for the descriptor format, so we saturate.
            let clamped = u32::try_from(information).unwrap_or(u32::MAX);
            out[3..7].copy_from_slice(&clamped.to_be_bytes());
        }
        out[7] = (FIXED_SENSE_BYTES - 8) as u8;
        out[12] = self.asc;
        out[13] = self.ascq;
        if let Some((in_cdb, byte, bit)) = self.field_pointer {
            out[15] = 0x80 | if in_cdb { 0x40 } else { 0 };
            if let Some(bit) = bit {
                out[15] |= 0x08 | (bit & 0x07);
            }
            out[16..18].copy_from_slice(&byte.to_be_bytes());
        }
        out
    }

    /// Descriptor-format sense data (response code 0x72), used when the
    /// control mode page's D_SENSE bit is set.
    pub fn to_descriptor(&self) -> Vec<u8> {
        let mut out = vec![0x72, self.key & 0x0f, self.asc, self.ascq, 0, 0, 0, 0];
        if let Some(information) = self.information {
            out.extend_from_slice(&[0x00, 0x0a, 0x80, 0x00]);
            out.extend_from_slice(&information.to_be_bytes());
        }
        if let Some((in_cdb, byte, bit)) = self.field_pointer {
            let mut flags = 0x80 | if in_cdb { 0x40 } else { 0 };
            if let Some(bit) = bit {
                flags |= 0x08 | (bit & 0x07);
            }
            let field = byte.to_be_bytes();
            out.extend_from_slice(&[0x02, 0x06, 0, 0, flags, field[0], field[1], 0]);
        }
        out[7] = (out.len() - 8) as u8;
        out
    }
}

/// The one mapping from block-layer errors to SCSI sense.
pub fn sense_for(error: &BlockError) -> Sense {
    match error {
        BlockError::OutOfRange { .. } => Sense::LBA_OUT_OF_RANGE,
        BlockError::Misaligned { .. } | BlockError::TooLarge { .. } => Sense::INVALID_FIELD_IN_CDB,
        BlockError::NoSpace => Sense::SPACE_ALLOCATION_FAILED,
        BlockError::NotFast | BlockError::NotSupported(_) => Sense::INVALID_OPCODE,
        BlockError::ReadOnly => Sense::WRITE_PROTECTED,
        BlockError::Checksum { offset } => {
            Sense::UNRECOVERED_READ_ERROR.with_information(offset / crate::block::SECTOR_BYTES as u64)
        }
        BlockError::Gone => Sense::NOT_READY_NOT_PRESENT,
        BlockError::Io(_) => Sense::INTERNAL_TARGET_FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_sense_layout() {
        let bytes = Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(5)).to_fixed();
        assert_eq!(bytes[0], 0x70);
        assert_eq!(bytes[2], key::ILLEGAL_REQUEST);
        assert_eq!(bytes[7], 10);
        assert_eq!((bytes[12], bytes[13]), (0x24, 0));
        assert_eq!(bytes[15], 0x80 | 0x40 | 0x08 | 5);
        assert_eq!(&bytes[16..18], &[0, 2]);
    }

    #[test]
    fn information_sets_valid() {
        let bytes = Sense::MISCOMPARE_DURING_VERIFY.with_information(7).to_fixed();
        assert_eq!(bytes[0], 0xf0);
        assert_eq!(&bytes[3..7], &[0, 0, 0, 7]);
    }

    #[test]
    fn block_errors_map_to_sense() {
        let error = BlockError::OutOfRange {
            offset: 0,
            length: 1,
            size: 0,
        };
        assert_eq!(sense_for(&error), Sense::LBA_OUT_OF_RANGE);
        assert_eq!(sense_for(&BlockError::NoSpace).key, key::DATA_PROTECT);
    }
}
