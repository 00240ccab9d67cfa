//! REPORT SUPPORTED OPERATION CODES (SPC-4 6.35): the commands this target
//! implements and the CDB bits each one looks at.

use super::cdb::opcode::*;
use super::sense::Sense;

/// A supported command: opcode, service action (if the opcode has them) and
/// the CDB usage bitmap (its length is the CDB length).
struct Supported {
    opcode: u8,
    service_action: Option<u16>,
    usage: &'static [u8],
}

const fn cmd(opcode: u8, usage: &'static [u8]) -> Supported {
    Supported {
        opcode,
        service_action: None,
        usage,
    }
}

const fn with_sa(opcode: u8, service_action: u16, usage: &'static [u8]) -> Supported {
    Supported {
        opcode,
        service_action: Some(service_action),
        usage,
    }
}

const RW10: &[u8] = &[0, 0x18, 0xff, 0xff, 0xff, 0xff, 0x00, 0xff, 0xff, 0x00];
const RW12: &[u8] = &[0, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00];
const RW16: &[u8] = &[
    0, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00,
];

/// Usage bitmaps start with the opcode itself; `report` fills byte 0.
static SUPPORTED: &[Supported] = &[
    cmd(TEST_UNIT_READY, &[0, 0, 0, 0, 0, 0]),
    cmd(REQUEST_SENSE, &[0, 0x01, 0, 0, 0xff, 0]),
    cmd(READ_6, &[0, 0x1f, 0xff, 0xff, 0xff, 0]),
    cmd(WRITE_6, &[0, 0x1f, 0xff, 0xff, 0xff, 0]),
    cmd(INQUIRY, &[0, 0x01, 0xff, 0xff, 0xff, 0]),
    cmd(MODE_SELECT_6, &[0, 0x11, 0, 0, 0xff, 0]),
    cmd(RESERVE_6, &[0, 0, 0, 0, 0, 0]),
    cmd(RELEASE_6, &[0, 0, 0, 0, 0, 0]),
    cmd(MODE_SENSE_6, &[0, 0x08, 0xff, 0xff, 0xff, 0]),
    cmd(START_STOP_UNIT, &[0, 0x01, 0, 0x0f, 0xf7, 0]),
    cmd(PREVENT_ALLOW_MEDIUM_REMOVAL, &[0, 0, 0, 0, 0x03, 0]),
    cmd(READ_CAPACITY_10, &[0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0x01, 0]),
    cmd(READ_10, RW10),
    cmd(WRITE_10, RW10),
    cmd(
        WRITE_AND_VERIFY_10,
        &[0, 0x12, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    cmd(VERIFY_10, &[0, 0x16, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0]),
    cmd(PREFETCH_10, &[0, 0x02, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0]),
    cmd(
        SYNCHRONIZE_CACHE_10,
        &[0, 0x02, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0],
    ),
    cmd(WRITE_SAME_10, &[0, 0x08, 0xff, 0xff, 0xff, 0xff, 0, 0xff, 0xff, 0]),
    cmd(UNMAP, &[0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    cmd(MODE_SELECT_10, &[0, 0x11, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    cmd(MODE_SENSE_10, &[0, 0x18, 0xff, 0xff, 0, 0, 0, 0xff, 0xff, 0]),
    with_sa(PERSISTENT_RESERVE_IN, 0, &[0, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    with_sa(PERSISTENT_RESERVE_IN, 1, &[0, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    with_sa(PERSISTENT_RESERVE_IN, 2, &[0, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    with_sa(PERSISTENT_RESERVE_IN, 3, &[0, 0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0]),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        0,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        1,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        2,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        3,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        4,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        5,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    with_sa(
        PERSISTENT_RESERVE_OUT,
        6,
        &[0, 0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0],
    ),
    cmd(READ_16, RW16),
    cmd(
        COMPARE_AND_WRITE,
        &[
            0, 0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0xff, 0, 0,
        ],
    ),
    cmd(WRITE_16, RW16),
    cmd(
        WRITE_AND_VERIFY_16,
        &[
            0, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    cmd(
        VERIFY_16,
        &[
            0, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    cmd(
        PREFETCH_16,
        &[
            0, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    cmd(
        SYNCHRONIZE_CACHE_16,
        &[
            0, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    cmd(
        WRITE_SAME_16,
        &[
            0, 0x09, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    with_sa(
        SERVICE_ACTION_IN_16,
        SA_READ_CAPACITY_16 as u16,
        &[0, 0x1f, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
    with_sa(
        SERVICE_ACTION_IN_16,
        SA_GET_LBA_STATUS as u16,
        &[
            0, 0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0,
        ],
    ),
    cmd(REPORT_LUNS, &[0, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0]),
    with_sa(
        MAINTENANCE_IN,
        SA_REPORT_SUPPORTED_OPCODES as u16,
        &[0, 0x1f, 0x87, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
    cmd(READ_12, RW12),
    cmd(WRITE_12, RW12),
    cmd(
        WRITE_AND_VERIFY_12,
        &[0, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
    cmd(
        VERIFY_12,
        &[0, 0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0],
    ),
];

/// Command timeouts descriptor (no timeouts are reported).
fn timeouts() -> [u8; 12] {
    let mut t = [0u8; 12];
    t[1] = 0x0a;
    t
}

fn usage_of(entry: &Supported) -> Vec<u8> {
    let mut usage = entry.usage.to_vec();
    usage[0] = entry.opcode;
    if let Some(sa) = entry.service_action {
        usage[1] = (usage[1] & !0x1f) | (sa as u8 & 0x1f);
    }
    usage
}

/// The parameter data for REPORT SUPPORTED OPERATION CODES.
pub fn report(rctd: bool, options: u8, opcode: u8, service_action: u16) -> Result<Vec<u8>, Sense> {
    if options == 0 {
        let mut data = vec![0u8; 4];
        for entry in SUPPORTED {
            data.push(entry.opcode);
            data.push(0);
            data.extend_from_slice(&entry.service_action.unwrap_or(0).to_be_bytes());
            data.push(0);
            let mut flags = if entry.service_action.is_some() { 0x01 } else { 0 };
            if rctd {
                flags |= 0x02;
            }
            data.push(flags);
            data.extend_from_slice(&(entry.usage.len() as u16).to_be_bytes());
            if rctd {
                data.extend_from_slice(&timeouts());
            }
        }
        let length = (data.len() - 4) as u32;
        data[0..4].copy_from_slice(&length.to_be_bytes());
        return Ok(data);
    }
    let has_service_actions = SUPPORTED
        .iter()
        .any(|e| e.opcode == opcode && e.service_action.is_some());
    let found = match options {
        1 => {
            if has_service_actions {
                return Err(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(2)));
            }
            SUPPORTED.iter().find(|e| e.opcode == opcode)
        }
        2 => {
            if !has_service_actions && SUPPORTED.iter().any(|e| e.opcode == opcode) {
                return Err(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(2)));
            }
            SUPPORTED
                .iter()
                .find(|e| e.opcode == opcode && e.service_action == Some(service_action))
        }
        _ => SUPPORTED
            .iter()
            .find(|e| e.opcode == opcode && (e.service_action.is_none() || e.service_action == Some(service_action))),
    };
    let mut data = vec![0u8; 4];
    match found {
        Some(entry) => {
            data[1] = 0x03 | if rctd { 0x80 } else { 0 };
            let usage = usage_of(entry);
            data[2..4].copy_from_slice(&(usage.len() as u16).to_be_bytes());
            data.extend(usage);
            if rctd {
                data.extend_from_slice(&timeouts());
            }
        }
        None => data[1] = 0x01,
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_commands_listing_has_consistent_length() {
        let data = report(false, 0, 0, 0).unwrap();
        let length = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
        assert_eq!(length, data.len() - 4);
        assert_eq!(length % 8, 0);
    }

    #[test]
    fn one_command_reports_usage() {
        let data = report(false, 1, READ_10, 0).unwrap();
        assert_eq!(data[1] & 0x07, 3);
        assert_eq!(data[4], READ_10);
        assert!(report(false, 1, PERSISTENT_RESERVE_IN, 0).is_err());
        assert!(report(false, 2, PERSISTENT_RESERVE_IN, 1).is_ok());
    }
}
