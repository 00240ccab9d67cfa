//! The send stream: what `strata send` writes and `strata receive` reads,
//! as pure functions over bytes (no I/O, no policy). The layout, byte by
//! byte, is in docs/FORMAT.md ("Send streams").
//!
//! A stream is a header, then records in increasing volume offset (WRITE:
//! data for blocks the snapshot maps; HOLE: blocks it does not map that
//! the base did), then one END record. Every part carries a CRC-32C, and
//! END carries the CRC-32C of every byte before it, so a flipped bit, a
//! missing tail or a record out of place is caught before anything is made
//! visible. A continuation (`send -t TOKEN`) is a fresh header with
//! `resume_offset` set, then exactly the bytes of the original stream from
//! that offset on.

/// The first eight bytes of every stream.
pub const MAGIC: [u8; 8] = *b"STRATASD";
/// The version this strata writes and reads.
pub const VERSION: u16 = 1;
/// A record's fixed part.
pub const RECORD_HEADER_BYTES: usize = 32;
/// The largest WRITE payload (and the batch the sender reads in).
pub const MAX_WRITE_BYTES: u64 = 1 << 20;
/// END's payload: the stream CRC and a reserved word.
pub const END_PAYLOAD_BYTES: usize = 8;
/// A header's fixed part, before its names.
const HEADER_FIXED_BYTES: usize = 80;
/// The longest header accepted (names are at most a few hundred bytes).
pub const MAX_HEADER_BYTES: usize = 4096;

pub const FLAG_CONTINUATION: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StreamKind {
    Full,
    Incremental,
}

/// What a stream says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub kind: StreamKind,
    /// Set in a continuation: the offset in the original stream where the
    /// records that follow this header start.
    pub resume_offset: Option<u64>,
    pub volsize: u64,
    pub volblocksize: u32,
    /// The snapshot's identity (stable across send/receive: a received
    /// snapshot keeps the GUID of the one it was received from).
    pub guid: u64,
    /// The base snapshot's GUID (incremental), else 0.
    pub base_guid: u64,
    pub created_unix: u64,
    /// Length of the whole original stream, END included.
    pub stream_bytes: u64,
    /// The source pool's uuid, as `pool status` shows it.
    pub pool_uuid: String,
    /// `POOL/VOLUME` on the sending side.
    pub volume: String,
    pub snapshot: String,
    /// The base snapshot's name (incremental), else empty.
    pub base: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    Write = 1,
    Hole = 2,
    End = 3,
}

/// A record's fixed part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub payload_bytes: u32,
    /// WRITE/HOLE: the volume byte offset; END: how many records came before.
    pub offset: u64,
    /// WRITE/HOLE: the bytes covered; END: the WRITE payload bytes in total.
    pub length: u64,
    pub crc: u32,
}

/// Why a stream is refused: each reads as one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error("not a strata send stream (bad magic)")]
    Foreign,
    #[error("send stream version {0} is not supported (this strata reads version {VERSION})")]
    Version(u16),
    #[error("corrupt send stream: {0}")]
    Corrupt(String),
    #[error("truncated send stream: {0}")]
    Truncated(String),
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    let bytes = name.as_bytes();
    out.extend_from_slice(&(bytes.len().min(u16::MAX as usize) as u16).to_le_bytes());
    out.extend_from_slice(&bytes[..bytes.len().min(u16::MAX as usize)]);
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    crate::bytes::array_at::<2>(bytes, at).map(u16::from_le_bytes)
}

impl Header {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_FIXED_BYTES + 128);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(match self.kind {
            StreamKind::Full => 1,
            StreamKind::Incremental => 2,
        });
        out.push(if self.resume_offset.is_some() {
            FLAG_CONTINUATION
        } else {
            0
        });
        out.extend_from_slice(&0u32.to_le_bytes()); // header length, set below
        out.extend_from_slice(&self.volsize.to_le_bytes());
        out.extend_from_slice(&self.volblocksize.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.guid.to_le_bytes());
        out.extend_from_slice(&self.base_guid.to_le_bytes());
        out.extend_from_slice(&self.created_unix.to_le_bytes());
        out.extend_from_slice(&self.stream_bytes.to_le_bytes());
        out.extend_from_slice(&self.resume_offset.unwrap_or(0).to_le_bytes());
        debug_assert_eq!(out.len(), HEADER_FIXED_BYTES - 8);
        out.extend_from_slice(&0u64.to_le_bytes());
        for name in [&self.pool_uuid, &self.volume, &self.snapshot, &self.base] {
            put_name(&mut out, name);
        }
        let length = (out.len() + 4) as u32;
        out[12..16].copy_from_slice(&length.to_le_bytes());
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// The header's length, once its first 16 bytes are known (checks the
    /// magic and version first).
    pub fn length(prefix: &[u8]) -> Result<usize, StreamError> {
        let short = || StreamError::Truncated(format!("{} bytes, shorter than a header", prefix.len()));
        let magic = crate::bytes::array_at::<8>(prefix, 0).ok_or_else(short)?;
        if magic != MAGIC {
            return Err(StreamError::Foreign);
        }
        let version = u16_at(prefix, 8).ok_or_else(short)?;
        if version != VERSION {
            return Err(StreamError::Version(version));
        }
        let length = crate::bytes::u32_at(prefix, 12).ok_or_else(short)? as usize;
        if !(HEADER_FIXED_BYTES + 4 * 2 + 4..=MAX_HEADER_BYTES).contains(&length) {
            return Err(StreamError::Corrupt(format!("header length {length}")));
        }
        Ok(length)
    }

    /// Decodes a whole header (`Header::length` bytes).
    pub fn decode(bytes: &[u8]) -> Result<Header, StreamError> {
        let length = Header::length(bytes)?;
        if bytes.len() < length {
            return Err(StreamError::Truncated(format!(
                "{} bytes of a {length}-byte header",
                bytes.len()
            )));
        }
        let bytes = &bytes[..length];
        let stored = crate::bytes::u32_at(bytes, length - 4).unwrap_or(0);
        if crc32c::crc32c(&bytes[..length - 4]) != stored {
            return Err(StreamError::Corrupt("header checksum mismatch".into()));
        }
        let corrupt = |what: &str| StreamError::Corrupt(format!("header: {what}"));
        let kind = match bytes[10] {
            1 => StreamKind::Full,
            2 => StreamKind::Incremental,
            other => return Err(corrupt(&format!("unknown stream kind {other}"))),
        };
        let flags = bytes[11];
        if flags & !FLAG_CONTINUATION != 0 {
            return Err(corrupt(&format!("unknown flags {flags:#x}")));
        }
        let u64_at = |at| crate::bytes::u64_at(bytes, at).unwrap_or(0);
        if bytes[28..32] != [0; 4] || u64_at(72) != 0 || (flags & FLAG_CONTINUATION == 0 && u64_at(64) != 0) {
            return Err(corrupt("reserved bytes are not zero"));
        }
        let mut names = Vec::with_capacity(4);
        let mut at = HEADER_FIXED_BYTES;
        for _ in 0..4 {
            let len = u16_at(bytes, at).ok_or_else(|| corrupt("names run past the header"))? as usize;
            let text = bytes
                .get(at + 2..at + 2 + len)
                .filter(|_| at + 2 + len <= length - 4)
                .ok_or_else(|| corrupt("names run past the header"))?;
            names.push(
                std::str::from_utf8(text)
                    .map_err(|_| corrupt("a name is not UTF-8"))?
                    .to_string(),
            );
            at += 2 + len;
        }
        if at != length - 4 {
            return Err(corrupt("bytes after the names"));
        }
        let header = Header {
            kind,
            resume_offset: (flags & FLAG_CONTINUATION != 0).then(|| u64_at(64)),
            volsize: u64_at(16),
            volblocksize: crate::bytes::u32_at(bytes, 24).unwrap_or(0),
            guid: u64_at(32),
            base_guid: u64_at(40),
            created_unix: u64_at(48),
            stream_bytes: u64_at(56),
            base: names.pop().unwrap_or_default(),
            snapshot: names.pop().unwrap_or_default(),
            volume: names.pop().unwrap_or_default(),
            pool_uuid: names.pop().unwrap_or_default(),
        };
        header.validate()?;
        Ok(header)
    }

    fn validate(&self) -> Result<(), StreamError> {
        let corrupt = |what: String| Err(StreamError::Corrupt(format!("header: {what}")));
        if !self.volblocksize.is_power_of_two() || !(512..=(1 << 20)).contains(&self.volblocksize) {
            return corrupt(format!("volblocksize {}", self.volblocksize));
        }
        if self.volsize == 0 || !self.volsize.is_multiple_of(self.volblocksize as u64) {
            return corrupt(format!("volume size {}", self.volsize));
        }
        if (self.kind == StreamKind::Incremental) != (self.base_guid != 0) {
            return corrupt("base snapshot identity does not match the stream kind".into());
        }
        if self.snapshot.is_empty() || self.volume.is_empty() {
            return corrupt("no volume or snapshot name".into());
        }
        if let Some(offset) = self.resume_offset.filter(|offset| *offset > self.stream_bytes) {
            return corrupt(format!(
                "a continuation from byte {offset} of a {}-byte stream",
                self.stream_bytes
            ));
        }
        Ok(())
    }
}

impl RecordHeader {
    /// The fixed part, its CRC covering it and `payload`.
    pub fn encode(kind: RecordKind, offset: u64, length: u64, payload: &[u8]) -> [u8; RECORD_HEADER_BYTES] {
        Self::encode_summed(kind, offset, length, payload.len(), crate::checksum::crc32c(payload))
    }

    /// [`RecordHeader::encode`] for a payload of `payload_bytes` whose
    /// CRC-32C is `payload_crc` (computed once, where it was read).
    pub fn encode_summed(
        kind: RecordKind,
        offset: u64,
        length: u64,
        payload_bytes: usize,
        payload_crc: u32,
    ) -> [u8; RECORD_HEADER_BYTES] {
        let mut out = [0u8; RECORD_HEADER_BYTES];
        out[0] = kind as u8;
        out[4..8].copy_from_slice(&(payload_bytes as u32).to_le_bytes());
        out[8..16].copy_from_slice(&offset.to_le_bytes());
        out[16..24].copy_from_slice(&length.to_le_bytes());
        let crc = crate::checksum::crc32c_combine(crc32c::crc32c(&out[..24]), payload_crc, payload_bytes);
        out[24..28].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes a fixed part (the payload is checked by [`RecordHeader::check`]).
    pub fn decode(bytes: &[u8; RECORD_HEADER_BYTES]) -> Result<RecordHeader, StreamError> {
        let kind = match bytes[0] {
            1 => RecordKind::Write,
            2 => RecordKind::Hole,
            3 => RecordKind::End,
            other => return Err(StreamError::Corrupt(format!("unknown record type {other}"))),
        };
        if bytes[1..4] != [0; 3] || bytes[28..32] != [0; 4] {
            return Err(StreamError::Corrupt("reserved record bytes are not zero".into()));
        }
        let header = RecordHeader {
            kind,
            payload_bytes: crate::bytes::u32_at(bytes, 4).unwrap_or(0),
            offset: crate::bytes::u64_at(bytes, 8).unwrap_or(0),
            length: crate::bytes::u64_at(bytes, 16).unwrap_or(0),
            crc: crate::bytes::u32_at(bytes, 24).unwrap_or(0),
        };
        let expected = match kind {
            RecordKind::Write => header.length,
            RecordKind::Hole => 0,
            RecordKind::End => END_PAYLOAD_BYTES as u64,
        };
        if header.payload_bytes as u64 != expected || header.payload_bytes as u64 > MAX_WRITE_BYTES {
            return Err(StreamError::Corrupt(format!(
                "record payload of {} bytes for a {kind:?} record of {} bytes",
                header.payload_bytes, header.length
            )));
        }
        Ok(header)
    }

    /// Checks the CRC over the fixed part and `payload`.
    pub fn check(&self, fixed: &[u8; RECORD_HEADER_BYTES], payload: &[u8]) -> Result<(), StreamError> {
        self.check_summed(fixed, payload.len(), crate::checksum::crc32c(payload))
    }

    /// [`RecordHeader::check`] with the payload's CRC-32C computed already.
    pub fn check_summed(
        &self,
        fixed: &[u8; RECORD_HEADER_BYTES],
        payload_bytes: usize,
        payload_crc: u32,
    ) -> Result<(), StreamError> {
        let crc = crate::checksum::crc32c_combine(crc32c::crc32c(&fixed[..24]), payload_crc, payload_bytes);
        if crc != self.crc {
            return Err(StreamError::Corrupt(format!(
                "record checksum mismatch ({:?} at offset {})",
                self.kind, self.offset
            )));
        }
        Ok(())
    }
}

/// END's payload for a stream whose bytes before END have CRC `stream_crc`.
pub fn end_payload(stream_crc: u32) -> [u8; END_PAYLOAD_BYTES] {
    let mut out = [0u8; END_PAYLOAD_BYTES];
    out[..4].copy_from_slice(&stream_crc.to_le_bytes());
    out
}

/// How far a receive has read a stream: what the checks of the next
/// record depend on. The receive keeps it (in its `ReceiveRecord`) across
/// interruptions; [`parse`] keeps it over a stream in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    /// Bytes of the original stream read so far, the header included.
    pub offset: u64,
    /// CRC-32C of those bytes.
    pub crc: u32,
    /// Records before `offset`, and the WRITE payload bytes among them.
    pub records: u64,
    pub data_bytes: u64,
    /// Where the last WRITE or HOLE ended in the volume (records come in
    /// increasing offset order).
    pub volume_end: u64,
}

/// What a checked record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    /// A WRITE (its payload is the data) or a HOLE, to apply.
    Extent,
    /// END: the stream is whole and checked.
    End,
}

impl Position {
    /// Where a stream's first record starts, after `header` (as encoded).
    pub fn after_header(header: &[u8]) -> Position {
        Position {
            offset: header.len() as u64,
            crc: crc32c::crc32c(header),
            ..Position::default()
        }
    }

    /// Checks one record (its fixed part `fixed`, decoded as `record`, and
    /// its payload, whose CRC-32C is `payload_crc`) against `header` and
    /// what came before, and moves past it. The checks of a receive: the
    /// record's CRC; a WRITE or HOLE in order, block-aligned, inside the
    /// volume; END counting the records and data bytes that came, at the
    /// stream's announced length, with the CRC of every byte before it.
    pub fn accept(
        &mut self,
        header: &Header,
        fixed: &[u8; RECORD_HEADER_BYTES],
        record: &RecordHeader,
        payload: &[u8],
        payload_crc: u32,
    ) -> Result<Accepted, StreamError> {
        record.check_summed(fixed, payload.len(), payload_crc)?;
        let bytes = (RECORD_HEADER_BYTES + payload.len()) as u64;
        if record.kind == RecordKind::End {
            let stream_crc = crate::bytes::u32_at(payload, 0).unwrap_or(0);
            let ends_right = record.offset == self.records
                && record.length == self.data_bytes
                && self.offset.checked_add(bytes) == Some(header.stream_bytes);
            if !ends_right {
                return Err(StreamError::Corrupt(format!(
                    "END says {} records and {} data bytes, {} bytes of stream came with {} records and {} data bytes",
                    record.offset,
                    record.length,
                    self.offset.saturating_add(bytes),
                    self.records,
                    self.data_bytes
                )));
            }
            if stream_crc != self.crc {
                return Err(StreamError::Corrupt("stream checksum mismatch".into()));
            }
            if payload != end_payload(stream_crc) {
                return Err(StreamError::Corrupt("END's reserved bytes are not zero".into()));
            }
            self.offset += bytes;
            return Ok(Accepted::End);
        }
        let block = header.volblocksize as u64;
        let end = record.offset.saturating_add(record.length);
        if record.offset < self.volume_end {
            return Err(StreamError::Corrupt(format!(
                "record out of order: offset {} comes after {}",
                record.offset, self.volume_end
            )));
        }
        if record.length == 0
            || !record.offset.is_multiple_of(block)
            || end > header.volsize
            || (!end.is_multiple_of(block) && end != header.volsize)
        {
            return Err(StreamError::Corrupt(format!(
                "record [{}, +{}) does not fit the {}-byte volume in {block}-byte blocks",
                record.offset, record.length, header.volsize
            )));
        }
        self.crc = crate::checksum::crc32c_combine(crc32c::crc32c_append(self.crc, fixed), payload_crc, payload.len());
        self.offset += bytes;
        self.records += 1;
        if record.kind == RecordKind::Write {
            self.data_bytes += record.length;
        }
        self.volume_end = end;
        Ok(Accepted::Extent)
    }
}

/// A whole stream, parsed and checked ([`parse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub header: Header,
    /// Its WRITEs and HOLEs: (kind, volume offset, length).
    pub records: Vec<PlannedRecord>,
    /// Where END left it: `offset` is the original stream's length.
    pub end: Position,
    /// Bytes of `bytes` read, END included (what follows is ignored, as a
    /// receive ignores it).
    pub consumed: usize,
}

/// Parses and checks a whole stream held in memory, with the receive's
/// checks (the header, then [`Position::accept`] on each record). A
/// continuation (`send -t`) is checked from `resume`, the position its
/// pending receive stopped at; it is refused without one.
pub fn parse(bytes: &[u8], resume: Option<Position>) -> Result<Parsed, StreamError> {
    let header = Header::decode(bytes)?;
    let length = Header::length(bytes)?;
    let mut position = match (header.resume_offset, resume) {
        (None, _) => Position::after_header(&bytes[..length]),
        (Some(offset), Some(resume)) if resume.offset == offset => resume,
        (Some(offset), _) => {
            return Err(StreamError::Corrupt(format!(
                "a continuation from byte {offset} of a receive that is not there"
            )))
        }
    };
    let mut at = length;
    let mut records = Vec::new();
    loop {
        let fixed = crate::bytes::array_at::<RECORD_HEADER_BYTES>(bytes, at)
            .ok_or_else(|| StreamError::Truncated("it ended before its END record".into()))?;
        let record = RecordHeader::decode(&fixed)?;
        let payload = bytes
            .get(at + RECORD_HEADER_BYTES..at + RECORD_HEADER_BYTES + record.payload_bytes as usize)
            .ok_or_else(|| StreamError::Truncated("it ended inside a record".into()))?;
        let accepted = position.accept(&header, &fixed, &record, payload, crate::checksum::crc32c(payload))?;
        at += RECORD_HEADER_BYTES + payload.len();
        match accepted {
            Accepted::End => {
                return Ok(Parsed {
                    header,
                    records,
                    end: position,
                    consumed: at,
                })
            }
            Accepted::Extent => records.push((record.kind, record.offset, record.length)),
        }
    }
}

/// One part of a plan (what the engine says to send).
pub use crate::pool::SendExtent as Extent;

/// One record of a plan: (kind, byte offset, byte length).
pub type PlannedRecord = (RecordKind, u64, u64);

/// The records a plan becomes, in order (END excluded): a mapped extent
/// is cut into WRITEs of at most [`MAX_WRITE_BYTES`], a hole is one HOLE.
/// Deterministic, so a continuation finds the same record boundaries.
pub fn records(extents: &[Extent], volblocksize: u32, volsize: u64) -> Vec<PlannedRecord> {
    let block = volblocksize as u64;
    let per_write = (MAX_WRITE_BYTES / block).max(1);
    let mut out = Vec::new();
    for extent in extents {
        let start = extent.first * block;
        let end = ((extent.first + extent.count) * block).min(volsize);
        if start >= end {
            continue;
        }
        if !extent.mapped {
            out.push((RecordKind::Hole, start, end - start));
            continue;
        }
        let mut at = start;
        while at < end {
            let length = (per_write * block).min(end - at);
            out.push((RecordKind::Write, at, length));
            at += length;
        }
    }
    out
}

/// The length of a whole stream with `header_bytes` of header and `records`.
pub fn stream_bytes(header_bytes: usize, records: &[PlannedRecord]) -> u64 {
    let body: u64 = records
        .iter()
        .map(|(kind, _, length)| RECORD_HEADER_BYTES as u64 + if *kind == RecordKind::Write { *length } else { 0 })
        .sum();
    header_bytes as u64 + body + (RECORD_HEADER_BYTES + END_PAYLOAD_BYTES) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            kind: StreamKind::Incremental,
            resume_offset: Some(4096),
            volsize: 64 << 20,
            volblocksize: 16384,
            guid: 7,
            base_guid: 9,
            created_unix: 1_700_000_000,
            stream_bytes: 1 << 30,
            pool_uuid: "8c1f".into(),
            volume: "default/db".into(),
            snapshot: "b".into(),
            base: "a".into(),
        }
    }

    #[test]
    fn headers_round_trip_and_any_flipped_bit_is_refused() {
        let bytes = header().encode();
        assert_eq!(Header::length(&bytes[..16]).unwrap(), bytes.len());
        assert_eq!(Header::decode(&bytes).unwrap(), header());
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[at] ^= 1 << bit;
                assert!(Header::decode(&bad).is_err(), "flip at {at} bit {bit} accepted");
            }
        }
        for cut in 0..bytes.len() {
            assert!(Header::decode(&bytes[..cut]).is_err());
        }
        assert_eq!(Header::decode(b"GIF89a.........."), Err(StreamError::Foreign));
    }

    #[test]
    fn records_round_trip_and_check_their_payload() {
        let payload = vec![0xabu8; 8192];
        let fixed = RecordHeader::encode(RecordKind::Write, 16384, 8192, &payload);
        let header = RecordHeader::decode(&fixed).unwrap();
        assert_eq!(
            (header.kind, header.offset, header.length),
            (RecordKind::Write, 16384, 8192)
        );
        header.check(&fixed, &payload).unwrap();
        let mut bad = payload.clone();
        bad[100] ^= 4;
        assert!(header.check(&fixed, &bad).is_err());
        let mut lying = fixed;
        lying[5] = 0;
        assert!(RecordHeader::decode(&lying).is_err());
        let mut unknown = fixed;
        unknown[0] = 9;
        assert!(RecordHeader::decode(&unknown).is_err());
    }

    #[test]
    fn plans_cut_writes_at_a_mebibyte_and_keep_holes_whole() {
        let extents = [
            Extent {
                first: 0,
                count: 100,
                mapped: true,
            },
            Extent {
                first: 100,
                count: 1000,
                mapped: false,
            },
        ];
        let planned = records(&extents, 16384, 64 << 20);
        assert_eq!(planned[0], (RecordKind::Write, 0, 1 << 20));
        assert_eq!(planned[1], (RecordKind::Write, 1 << 20, 36 * 16384));
        assert_eq!(planned[2], (RecordKind::Hole, 100 * 16384, 1000 * 16384));
        assert_eq!(planned.len(), 3);
    }
}
