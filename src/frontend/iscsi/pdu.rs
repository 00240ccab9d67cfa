//! iSCSI PDU framing (RFC 7143 section 11): the 48-byte basic header segment,
//! additional header segments, CRC32C header and data digests and data
//! segment padding. Everything here is a pure function over bytes, so it can
//! be fuzzed; the connection code only moves bytes between these functions
//! and the socket.

/// Length of the basic header segment.
pub const BHS_BYTES: usize = 48;
/// Length of a CRC32C digest.
pub const DIGEST_BYTES: usize = 4;
/// The "reserved" tag value (no task, no target transfer tag).
pub const RESERVED_TAG: u32 = 0xffff_ffff;
/// Largest data segment length the 24-bit field can express.
pub const MAX_DATA_SEGMENT_FIELD: u32 = (1 << 24) - 1;

/// Opcodes (RFC 7143 11.1.1).
pub mod op {
    pub const NOP_OUT: u8 = 0x00;
    pub const SCSI_COMMAND: u8 = 0x01;
    pub const TASK_MANAGEMENT: u8 = 0x02;
    pub const LOGIN: u8 = 0x03;
    pub const TEXT: u8 = 0x04;
    pub const DATA_OUT: u8 = 0x05;
    pub const LOGOUT: u8 = 0x06;
    pub const SNACK: u8 = 0x10;
    pub const NOP_IN: u8 = 0x20;
    pub const SCSI_RESPONSE: u8 = 0x21;
    pub const TASK_MANAGEMENT_RESPONSE: u8 = 0x22;
    pub const LOGIN_RESPONSE: u8 = 0x23;
    pub const TEXT_RESPONSE: u8 = 0x24;
    pub const DATA_IN: u8 = 0x25;
    pub const LOGOUT_RESPONSE: u8 = 0x26;
    pub const R2T: u8 = 0x31;
    pub const ASYNC_MESSAGE: u8 = 0x32;
    pub const REJECT: u8 = 0x3f;
}

/// Reject reasons (RFC 7143 11.17.1).
pub mod reject {
    pub const DATA_DIGEST_ERROR: u8 = 0x02;
    pub const SNACK_REJECT: u8 = 0x03;
    pub const PROTOCOL_ERROR: u8 = 0x04;
    pub const COMMAND_NOT_SUPPORTED: u8 = 0x05;
    pub const TOO_MANY_IMMEDIATE_COMMANDS: u8 = 0x06;
    pub const TASK_IN_PROGRESS: u8 = 0x07;
    pub const INVALID_PDU_FIELD: u8 = 0x09;
    pub const OUT_OF_RESOURCES: u8 = 0x0a;
    pub const WAITING_FOR_LOGOUT: u8 = 0x0c;
}

/// A basic header segment with typed accessors. Field offsets are the ones
/// shared by most PDUs; opcode-specific meanings are named at the call site.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_BYTES]);

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bhs(op={:#04x}, itt={:#010x})", self.opcode(), self.itt())
    }
}

fn be32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

impl Bhs {
    pub fn new(opcode: u8) -> Self {
        let mut bytes = [0u8; BHS_BYTES];
        bytes[0] = opcode;
        Bhs(bytes)
    }

    pub fn opcode(&self) -> u8 {
        self.0[0] & 0x3f
    }

    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }

    pub fn flags(&self) -> u8 {
        self.0[1]
    }

    /// The F (final) bit.
    pub fn is_final(&self) -> bool {
        self.0[1] & 0x80 != 0
    }

    pub fn total_ahs_bytes(&self) -> usize {
        self.0[4] as usize * 4
    }

    pub fn data_segment_len(&self) -> u32 {
        u32::from_be_bytes([0, self.0[5], self.0[6], self.0[7]])
    }

    pub fn set_data_segment_len(&mut self, len: u32) {
        debug_assert!(len <= MAX_DATA_SEGMENT_FIELD);
        let bytes = len.to_be_bytes();
        self.0[5..8].copy_from_slice(&bytes[1..4]);
    }

    pub fn lun(&self) -> [u8; 8] {
        let mut lun = [0u8; 8];
        lun.copy_from_slice(&self.0[8..16]);
        lun
    }

    pub fn set_lun(&mut self, lun: [u8; 8]) {
        self.0[8..16].copy_from_slice(&lun);
    }

    pub fn itt(&self) -> u32 {
        be32(&self.0, 16)
    }

    pub fn u32_at(&self, at: usize) -> u32 {
        be32(&self.0, at)
    }

    pub fn set_u32(&mut self, at: usize, value: u32) {
        self.0[at..at + 4].copy_from_slice(&value.to_be_bytes());
    }

    /// Word 20: Target Transfer Tag, Expected Data Transfer Length, CID, or
    /// Referenced Task Tag depending on the opcode.
    pub fn word20(&self) -> u32 {
        be32(&self.0, 20)
    }

    pub fn cmdsn(&self) -> u32 {
        be32(&self.0, 24)
    }

    pub fn exp_statsn(&self) -> u32 {
        be32(&self.0, 28)
    }

    pub fn cdb(&self) -> &[u8] {
        &self.0[32..48]
    }
}

/// Negotiated framing parameters that bound and shape incoming PDUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment we accept (our MaxRecvDataSegmentLength).
    pub max_data_segment: u32,
}

impl Framing {
    /// The framing in effect during login: no digests, 8192-byte segments.
    pub const LOGIN: Framing = Framing {
        header_digest: false,
        data_digest: false,
        max_data_segment: 8192,
    };
}

/// Why a PDU could not be framed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("data segment of {len} bytes exceeds the negotiated maximum of {max}")]
    DataSegmentTooLong { len: u32, max: u32 },
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("data digest mismatch")]
    DataDigest,
    #[error("PDU truncated: {have} of {need} bytes")]
    Truncated { have: usize, need: usize },
}

/// Where each part of a PDU lies after the 48-byte BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub ahs_bytes: usize,
    pub header_digest: bool,
    pub data_len: usize,
    pub padding: usize,
    pub data_digest: bool,
}

impl Layout {
    /// Validates a BHS against the framing and computes what follows it.
    /// This is the only place a length from the network is trusted, and it
    /// is bounded here before anything is allocated.
    pub fn of(bhs: &Bhs, framing: &Framing) -> Result<Layout, FrameError> {
        let len = bhs.data_segment_len();
        if len > framing.max_data_segment {
            return Err(FrameError::DataSegmentTooLong {
                len,
                max: framing.max_data_segment,
            });
        }
        let data_len = len as usize;
        Ok(Layout {
            ahs_bytes: bhs.total_ahs_bytes(),
            header_digest: framing.header_digest,
            data_len,
            padding: padding_for(data_len),
            data_digest: framing.data_digest && data_len > 0,
        })
    }

    /// Bytes of AHS plus header digest (read before the data segment).
    pub fn header_tail(&self) -> usize {
        self.ahs_bytes + if self.header_digest { DIGEST_BYTES } else { 0 }
    }

    /// Bytes of padding plus data digest (read after the data segment).
    pub fn data_tail(&self) -> usize {
        if self.data_len == 0 {
            return 0;
        }
        self.padding + if self.data_digest { DIGEST_BYTES } else { 0 }
    }

    /// Total bytes after the BHS.
    pub fn after_bhs(&self) -> usize {
        self.header_tail() + self.data_len + self.data_tail()
    }
}

/// Padding that brings a data segment to a multiple of four bytes.
pub fn padding_for(len: usize) -> usize {
    (4 - len % 4) % 4
}

/// CRC32C as iSCSI uses it, sent least significant byte first.
pub fn digest(parts: &[&[u8]]) -> [u8; 4] {
    crate::checksum::crc32c_of_parts(parts).to_le_bytes()
}

/// Checks the header digest: `header_tail` is AHS followed by the digest.
pub fn check_header_digest(bhs: &Bhs, layout: &Layout, header_tail: &[u8]) -> Result<(), FrameError> {
    if !layout.header_digest {
        return Ok(());
    }
    let ahs = &header_tail[..layout.ahs_bytes];
    let received = &header_tail[layout.ahs_bytes..layout.ahs_bytes + DIGEST_BYTES];
    if digest(&[&bhs.0, ahs]) != received {
        return Err(FrameError::HeaderDigest);
    }
    Ok(())
}

/// Checks the data digest: `data_tail` is padding followed by the digest.
pub fn check_data_digest(layout: &Layout, data: &[u8], data_tail: &[u8]) -> Result<(), FrameError> {
    if !layout.data_digest {
        return Ok(());
    }
    let padding = &data_tail[..layout.padding];
    let received = &data_tail[layout.padding..layout.padding + DIGEST_BYTES];
    if digest(&[data, padding]) != received {
        return Err(FrameError::DataDigest);
    }
    Ok(())
}

/// A whole received PDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    pub bhs: Bhs,
    pub ahs: Vec<u8>,
    pub data: Vec<u8>,
}

/// Decodes one PDU from the front of `bytes`; returns it and the bytes used.
pub fn decode(bytes: &[u8], framing: &Framing) -> Result<(Pdu, usize), FrameError> {
    if bytes.len() < BHS_BYTES {
        return Err(FrameError::Truncated {
            have: bytes.len(),
            need: BHS_BYTES,
        });
    }
    let mut header = [0u8; BHS_BYTES];
    header.copy_from_slice(&bytes[..BHS_BYTES]);
    let bhs = Bhs(header);
    let layout = Layout::of(&bhs, framing)?;
    let need = BHS_BYTES + layout.after_bhs();
    if bytes.len() < need {
        return Err(FrameError::Truncated {
            have: bytes.len(),
            need,
        });
    }
    let mut at = BHS_BYTES;
    let header_tail = &bytes[at..at + layout.header_tail()];
    check_header_digest(&bhs, &layout, header_tail)?;
    let ahs = header_tail[..layout.ahs_bytes].to_vec();
    at += layout.header_tail();
    let data = &bytes[at..at + layout.data_len];
    at += layout.data_len;
    let data_tail = &bytes[at..at + layout.data_tail()];
    check_data_digest(&layout, data, data_tail)?;
    at += layout.data_tail();
    Ok((
        Pdu {
            bhs,
            ahs,
            data: data.to_vec(),
        },
        at,
    ))
}

/// Serialises a PDU we send (no AHS): header, header digest, data, padding,
/// data digest.
pub fn encode(bhs: &Bhs, data: &[u8], header_digest: bool, data_digest: bool) -> Vec<u8> {
    let mut bhs = *bhs;
    bhs.set_data_segment_len(data.len() as u32);
    let mut out = Vec::with_capacity(BHS_BYTES + 8 + data.len() + 3 + 4);
    out.extend_from_slice(&bhs.0);
    if header_digest {
        out.extend_from_slice(&digest(&[&bhs.0]));
    }
    if !data.is_empty() {
        out.extend_from_slice(data);
        let padding = [0u8; 3];
        let padding = &padding[..padding_for(data.len())];
        out.extend_from_slice(padding);
        if data_digest {
            out.extend_from_slice(&digest(&[data, padding]));
        }
    }
    out
}

/// Serial number arithmetic (RFC 1982) on 32-bit sequence numbers: whether
/// `a` is at or after `b`.
pub fn serial_ge(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) < (1 << 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framing(digests: bool) -> Framing {
        Framing {
            header_digest: digests,
            data_digest: digests,
            max_data_segment: 8192,
        }
    }

    #[test]
    fn round_trip_with_and_without_digests() {
        for digests in [false, true] {
            let mut bhs = Bhs::new(op::NOP_OUT);
            bhs.set_u32(16, 0x1234);
            let bytes = encode(&bhs, b"hello", digests, digests);
            assert_eq!(bytes.len() % 4, 0);
            let (pdu, used) = decode(&bytes, &framing(digests)).unwrap();
            assert_eq!(used, bytes.len());
            assert_eq!(pdu.data, b"hello");
            assert_eq!(pdu.bhs.itt(), 0x1234);
        }
    }

    #[test]
    fn corrupted_digests_are_detected() {
        let bhs = Bhs::new(op::NOP_OUT);
        let mut bytes = encode(&bhs, b"data", true, true);
        bytes[20] ^= 1;
        assert_eq!(decode(&bytes, &framing(true)), Err(FrameError::HeaderDigest));
        let mut bytes = encode(&bhs, b"data", true, true);
        let last = bytes.len() - 5;
        bytes[last] ^= 1;
        assert_eq!(decode(&bytes, &framing(true)), Err(FrameError::DataDigest));
    }

    #[test]
    fn huge_data_segment_is_refused_before_allocation() {
        let mut bhs = Bhs::new(op::SCSI_COMMAND);
        bhs.set_data_segment_len(MAX_DATA_SEGMENT_FIELD);
        assert!(matches!(
            Layout::of(&bhs, &framing(false)),
            Err(FrameError::DataSegmentTooLong { .. })
        ));
    }

    #[test]
    fn truncated_input_is_an_error() {
        let bytes = encode(&Bhs::new(op::NOP_OUT), b"abcdef", false, false);
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], &framing(false)).is_err());
        }
    }

    #[test]
    fn crc32c_matches_the_rfc_example() {
        // RFC 7143 appendix B.4: 32 bytes of zeros.
        assert_eq!(u32::from_le_bytes(digest(&[&[0u8; 32]])), 0x8a9136aa);
    }

    #[test]
    fn serial_arithmetic_wraps() {
        assert!(serial_ge(5, 5));
        assert!(serial_ge(0, u32::MAX));
        assert!(!serial_ge(u32::MAX, 0));
    }
}
