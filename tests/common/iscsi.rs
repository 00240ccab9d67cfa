//! A minimal iSCSI initiator for tests that need to see the wire: login
//! straight to the full feature phase, and SCSI commands sent as immediate
//! commands (they do not advance CmdSN, so a test can still send its own
//! windowed commands from CmdSN 0 afterwards).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use strata::frontend::iscsi::pdu::{self, op, Bhs};

/// A Login Request PDU (ISID 0x800000000001, ITT 1) carrying `text`.
pub fn login_request(text: &str, flags: u8) -> Vec<u8> {
    let mut bhs = Bhs::new(op::LOGIN | 0x40);
    bhs.0[1] = flags;
    bhs.0[8..14].copy_from_slice(&[0x80, 0, 0, 0, 0, 1]);
    bhs.set_u32(16, 1);
    pdu::encode(&bhs, text.as_bytes(), false, false)
}

/// The next PDU: its header and data segment (padding dropped).
pub fn read_response(stream: &mut TcpStream) -> Option<(Bhs, Vec<u8>)> {
    let mut header = [0u8; 48];
    stream.read_exact(&mut header).ok()?;
    let bhs = Bhs(header);
    let len = bhs.data_segment_len() as usize;
    let mut data = vec![0u8; len + pdu::padding_for(len)];
    stream.read_exact(&mut data).ok()?;
    data.truncate(len);
    Some((bhs, data))
}

pub fn connect(address: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(address).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    stream
}

/// Logs in to `target` as `initiator`, straight to the full feature phase.
/// Sends no command: unit attentions stay pending (see [`clear_attentions`]).
pub fn login_as(address: SocketAddr, target: &str, initiator: &str) -> TcpStream {
    let mut stream = connect(address);
    let text = format!("InitiatorName={initiator}\0TargetName={target}\0AuthMethod=None\0");
    stream.write_all(&login_request(&text, 0x81)).expect("send");
    let (bhs, _) = read_response(&mut stream).expect("login response");
    assert_eq!(bhs.0[36], 0, "login status class");
    stream
        .write_all(&login_request("MaxRecvDataSegmentLength=8192\0", 0x87))
        .expect("send");
    let (bhs, _) = read_response(&mut stream).expect("login response");
    assert_eq!(bhs.0[36], 0, "login status class");
    assert_eq!(bhs.0[1] & 0x83, 0x83, "transit to full feature phase");
    stream
}

/// How a SCSI command ended.
#[derive(Debug)]
pub struct Reply {
    pub status: u8,
    /// Sense key, ASC, ASCQ of a CHECK CONDITION (fixed or descriptor format).
    pub sense: Option<(u8, u8, u8)>,
    /// The INFORMATION field of fixed-format sense, when VALID.
    pub information: Option<u32>,
    pub data: Vec<u8>,
}

/// Sends `cdb` as an immediate command (no data out, up to `alloc` bytes
/// in) with task tag `itt` and returns how it ended.
pub fn command(stream: &mut TcpStream, itt: u32, cdb: &[u8], alloc: u32) -> Reply {
    let mut bhs = Bhs::new(op::SCSI_COMMAND | 0x40);
    bhs.0[1] = 0x80 | if alloc > 0 { 0x40 } else { 0 };
    bhs.set_u32(16, itt);
    bhs.set_u32(20, alloc);
    bhs.0[32..32 + cdb.len()].copy_from_slice(cdb);
    stream.write_all(&pdu::encode(&bhs, &[], false, false)).expect("send");
    let mut data = Vec::new();
    loop {
        let (reply, segment) = read_response(stream).expect("response");
        assert_eq!(reply.u32_at(16), itt, "task tag");
        match reply.opcode() {
            op::DATA_IN => {
                data.extend_from_slice(&segment);
                if reply.0[1] & 0x01 != 0 {
                    return Reply {
                        status: reply.0[3],
                        sense: None,
                        information: None,
                        data,
                    };
                }
            }
            op::SCSI_RESPONSE => {
                assert_eq!(reply.0[2], 0, "command completed at target");
                let sense = segment.get(2..).unwrap_or_default();
                let (key, information) = match sense.first().map(|b| b & 0x7f) {
                    Some(0x70) if sense.len() >= 14 => (
                        Some((sense[2] & 0x0f, sense[12], sense[13])),
                        (sense[0] & 0x80 != 0).then(|| u32::from_be_bytes(sense[3..7].try_into().unwrap())),
                    ),
                    Some(0x72) if sense.len() >= 4 => (Some((sense[1] & 0x0f, sense[2], sense[3])), None),
                    _ => (None, None),
                };
                return Reply {
                    status: reply.0[3],
                    sense: key,
                    information,
                    data,
                };
            }
            other => panic!("unexpected PDU opcode {other:#x}"),
        }
    }
}

/// Sends `cdb` as an immediate command carrying `data` as immediate data
/// (W bit, EDTL = its length; the default FirstBurstLength of 64 KiB
/// bounds it) and returns how it ended.
pub fn command_out(stream: &mut TcpStream, itt: u32, cdb: &[u8], data: &[u8]) -> Reply {
    assert!(data.len() <= 65536, "immediate data beyond FirstBurstLength");
    let mut bhs = Bhs::new(op::SCSI_COMMAND | 0x40);
    bhs.0[1] = 0x80 | 0x20;
    bhs.set_u32(16, itt);
    bhs.set_u32(20, data.len() as u32);
    bhs.0[32..32 + cdb.len()].copy_from_slice(cdb);
    stream.write_all(&pdu::encode(&bhs, data, false, false)).expect("send");
    let (reply, segment) = read_response(stream).expect("response");
    assert_eq!(reply.opcode(), op::SCSI_RESPONSE, "a write gets a SCSI Response");
    assert_eq!(reply.u32_at(16), itt, "task tag");
    let sense = segment.get(2..).unwrap_or_default();
    let key = match sense.first().map(|b| b & 0x7f) {
        Some(0x70) if sense.len() >= 14 => Some((sense[2] & 0x0f, sense[12], sense[13])),
        Some(0x72) if sense.len() >= 4 => Some((sense[1] & 0x0f, sense[2], sense[3])),
        _ => None,
    };
    Reply {
        status: reply.0[3],
        sense: key,
        information: None,
        data: Vec::new(),
    }
}

pub const TEST_UNIT_READY: [u8; 6] = [0; 6];

/// TEST UNIT READY until it answers GOOD; returns the unit attentions it
/// got on the way, as (ASC, ASCQ, INFORMATION).
pub fn clear_attentions(stream: &mut TcpStream) -> Vec<(u8, u8, Option<u32>)> {
    let mut attentions = Vec::new();
    for itt in 0x1000.. {
        let reply = command(stream, itt, &TEST_UNIT_READY, 0);
        if reply.status == 0 {
            return attentions;
        }
        match reply.sense {
            Some((0x6, asc, ascq)) if attentions.len() < 16 => attentions.push((asc, ascq, reply.information)),
            _ => panic!("TEST UNIT READY: {reply:?} after unit attentions {attentions:x?}"),
        }
    }
    unreachable!()
}

/// Logs in as `iqn.test:raw` and clears any unit attention (as initiators
/// do after login), so the next command sees only what it causes.
pub fn login(address: SocketAddr, target: &str) -> TcpStream {
    let mut stream = login_as(address, target, "iqn.test:raw");
    clear_attentions(&mut stream);
    stream
}
