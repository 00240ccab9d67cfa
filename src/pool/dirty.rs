//! The dirty record of a mirror: which units of the member's address space
//! were written since its earliest stale child went stale, so that a child
//! coming back is resilvered only there (ZFS's dirty time log, md's
//! write-intent bitmap). One record per mirror, the union over its stale
//! children (a superset is safe for each of them), kept in memory and on
//! every device the mirror writes, in the free part of the format-3 header.
//! Layout: docs/FORMAT.md, "Dirty record".
//!
//! The rule that makes it crash-safe (ARCHITECTURE.md): while a child that
//! the record is complete for is not up to date, a unit's bit is durable on
//! every written device *before* any write to that unit is issued; and a
//! child that faults has the units of every write it may not hold durably
//! (those since the last flush that covered them, and those in flight)
//! merged into the record, persisted, before its fault is recorded.

use std::collections::HashSet;

use super::vdev::RESYNC_UNIT;

/// Where the two copies of a device's record start (inside the format-3
/// header, after the second superblock copy).
pub const RECORD_OFFSETS: [u64; 2] = [512 << 10, 768 << 10];
/// Room for one copy.
pub const RECORD_SLOT_BYTES: u64 = 256 << 10;
const MAGIC: [u8; 8] = *b"STRATADR";
/// Bytes before the bitmap.
const HEADER: usize = 64;
const CRC_AT: usize = 60;
/// Bits one copy holds.
pub const MAX_UNITS: u64 = (RECORD_SLOT_BYTES - HEADER as u64) * 8;
/// Records are written in whole sectors of this size (direct I/O).
const SECTOR: usize = 4096;

/// The unit of the record of a member of `size_bytes`: [`RESYNC_UNIT`], or
/// the smallest power of two above it whose bitmap fits [`MAX_UNITS`].
pub fn unit_bytes_for(size_bytes: u64) -> u64 {
    let mut unit = RESYNC_UNIT;
    while size_bytes.div_ceil(unit) > MAX_UNITS {
        unit *= 2;
    }
    unit
}

/// What a record is for: the pool, its member, and the member's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordKey {
    pub pool_uuid: [u8; 16],
    pub member: u8,
    pub unit_bytes: u64,
    pub units: u64,
}

impl RecordKey {
    pub fn new(pool_uuid: [u8; 16], member: u8, size_bytes: u64) -> RecordKey {
        let unit_bytes = unit_bytes_for(size_bytes);
        RecordKey {
            pool_uuid,
            member,
            unit_bytes,
            units: size_bytes.div_ceil(unit_bytes),
        }
    }

    fn words(&self) -> usize {
        self.units.div_ceil(64) as usize
    }

    /// The bytes written for one copy: whole sectors.
    pub fn encoded_bytes(&self) -> usize {
        (HEADER + self.units.div_ceil(8) as usize).div_ceil(SECTOR) * SECTOR
    }
}

/// Why a copy read back is not a record of this member.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("no dirty record")]
    Absent,
    #[error("dirty record checksum mismatch")]
    Damaged,
    #[error("dirty record of another pool, member or geometry")]
    Foreign,
}

/// Encodes `bits` (one per unit, `key.units` of them, little-endian words)
/// into [`RecordKey::encoded_bytes`] bytes.
pub fn encode(key: &RecordKey, bits: &[u64]) -> Vec<u8> {
    assert_eq!(bits.len(), key.words(), "a bitmap of the member's units");
    assert!(key.units <= MAX_UNITS);
    let mut out = vec![0u8; key.encoded_bytes()];
    out[0..8].copy_from_slice(&MAGIC);
    out[8..24].copy_from_slice(&key.pool_uuid);
    out[24..32].copy_from_slice(&key.unit_bytes.to_le_bytes());
    out[32..40].copy_from_slice(&key.units.to_le_bytes());
    out[40] = key.member;
    let map_bytes = key.units.div_ceil(8) as usize;
    for (i, byte) in out[HEADER..HEADER + map_bytes].iter_mut().enumerate() {
        *byte = (bits[i / 8] >> ((i % 8) * 8)) as u8;
    }
    let crc = checksum(&out, map_bytes);
    out[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    out
}

fn checksum(bytes: &[u8], map_bytes: usize) -> u32 {
    let mut covered = Vec::with_capacity(CRC_AT + map_bytes);
    covered.extend_from_slice(&bytes[..CRC_AT]);
    covered.extend_from_slice(&bytes[HEADER..HEADER + map_bytes]);
    crate::checksum::crc32c(&covered)
}

/// Decodes one copy written by [`encode`] for `key`; a copy for another
/// pool, member or geometry, or whose checksum fails, is no record.
pub fn decode(key: &RecordKey, bytes: &[u8]) -> Result<Vec<u64>, RecordError> {
    if bytes.len() < HEADER || bytes[0..8] != MAGIC {
        return Err(RecordError::Absent);
    }
    let unit_bytes = crate::bytes::u64_at(bytes, 24).ok_or(RecordError::Damaged)?;
    let units = crate::bytes::u64_at(bytes, 32).ok_or(RecordError::Damaged)?;
    let map_bytes = units.min(MAX_UNITS).div_ceil(8) as usize;
    if bytes.len() < HEADER + map_bytes {
        return Err(RecordError::Damaged);
    }
    let stored = crate::bytes::u32_at(bytes, CRC_AT).ok_or(RecordError::Damaged)?;
    if checksum(bytes, map_bytes) != stored {
        return Err(RecordError::Damaged);
    }
    if bytes[8..24] != key.pool_uuid || bytes[40] != key.member || unit_bytes != key.unit_bytes || units != key.units {
        return Err(RecordError::Foreign);
    }
    let mut bits = vec![0u64; key.words()];
    for (i, &byte) in bytes[HEADER..HEADER + map_bytes].iter().enumerate() {
        bits[i / 8] |= u64::from(byte) << ((i % 8) * 8);
    }
    Ok(bits)
}

/// A mirror's record in memory, and what it knows of its copies on disk.
/// Kept under one lock with the units written since the last flush, so a
/// fault's merge and a write's check see one order.
#[derive(Default)]
pub(crate) struct DirtyState {
    /// Some child the record is complete for is not up to date: writes
    /// set bits, and wait for them to be durable.
    pub tracking: bool,
    /// Units written while tracking (and merged at faults).
    pub marked: Vec<u64>,
    /// The part of `marked` that is durable on every written device.
    pub durable: Vec<u64>,
    /// Units written (or being written) since the last flush began: a
    /// device that faults may not hold them durably.
    pub recent: HashSet<u64>,
    /// `recent` as each flush under way took it, by flush.
    pub flushing: Vec<(u64, HashSet<u64>)>,
    pub next_flush: u64,
}

impl DirtyState {
    fn ensure_sized(&mut self, words: usize) {
        if self.marked.len() != words {
            self.marked = vec![0; words];
            self.durable = vec![0; words];
        }
    }

    /// Notes a write of units `units` about to be issued (or done): in
    /// `recent` always, in `marked` while tracking. Returns whether some
    /// of them are marked but not yet durable.
    pub fn note(&mut self, units: std::ops::RangeInclusive<u64>, words: usize) -> bool {
        let mut pending = false;
        if self.tracking {
            self.ensure_sized(words);
        }
        for unit in units {
            self.recent.insert(unit);
            if self.tracking {
                let (word, bit) = ((unit / 64) as usize, 1u64 << (unit % 64));
                if let Some(w) = self.marked.get_mut(word) {
                    *w |= bit;
                }
                pending |= self.durable.get(word).is_some_and(|w| w & bit == 0);
            }
        }
        pending
    }

    /// Whether every unit in `units` is durable in the record (or nothing
    /// is tracked): a write there needs no persist first.
    pub fn covered(&self, units: std::ops::RangeInclusive<u64>) -> bool {
        !self.tracking
            || units.into_iter().all(|unit| {
                self.durable
                    .get((unit / 64) as usize)
                    .is_some_and(|w| w & (1 << (unit % 64)) != 0)
            })
    }

    /// Starts tracking (a child the record is complete for stopped being
    /// up to date), merging every unit a faulted device may lack.
    pub fn start(&mut self, words: usize) {
        self.ensure_sized(words);
        self.tracking = true;
        let unflushed: Vec<u64> = self
            .recent
            .iter()
            .chain(self.flushing.iter().flat_map(|(_, set)| set.iter()))
            .copied()
            .collect();
        for unit in unflushed {
            if let Some(w) = self.marked.get_mut((unit / 64) as usize) {
                *w |= 1 << (unit % 64);
            }
        }
    }

    /// No child the record is complete for is behind any more: it starts
    /// afresh the next time one is.
    pub fn stop(&mut self) {
        self.tracking = false;
        self.marked.iter_mut().for_each(|w| *w = 0);
        self.durable.iter_mut().for_each(|w| *w = 0);
    }

    /// Whether `marked` has bits `durable` lacks.
    pub fn behind(&self) -> bool {
        self.marked.iter().zip(&self.durable).any(|(m, d)| m & !d != 0)
    }

    pub fn begin_flush(&mut self) -> u64 {
        let id = self.next_flush;
        self.next_flush += 1;
        let taken = std::mem::take(&mut self.recent);
        self.flushing.push((id, taken));
        id
    }

    pub fn end_flush(&mut self, id: u64) {
        self.flushing.retain(|(i, _)| *i != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(size_bytes: u64) -> RecordKey {
        RecordKey::new([5; 16], 2, size_bytes)
    }

    #[test]
    fn a_record_round_trips_and_is_refused_when_damaged_or_foreign() {
        let key = key(160 << 20);
        assert_eq!((key.unit_bytes, key.units), (RESYNC_UNIT, 160));
        let mut bits = vec![0u64; 3];
        for unit in [0u64, 1, 63, 64, 100, 159] {
            bits[(unit / 64) as usize] |= 1 << (unit % 64);
        }
        let bytes = encode(&key, &bits);
        assert_eq!(bytes.len(), 4096);
        assert_eq!(decode(&key, &bytes), Ok(bits.clone()));
        // One bit flipped in the bitmap, or in the header: refused.
        for at in [HEADER + 3, 30] {
            let mut rotten = bytes.clone();
            rotten[at] ^= 0x10;
            assert_eq!(decode(&key, &rotten), Err(RecordError::Damaged), "byte {at}");
        }
        assert_eq!(decode(&key, &vec![0u8; 4096]), Err(RecordError::Absent));
        let other_member = RecordKey { member: 3, ..key };
        assert_eq!(decode(&other_member, &bytes), Err(RecordError::Foreign));
        let other_pool = RecordKey {
            pool_uuid: [6; 16],
            ..key
        };
        assert_eq!(decode(&other_pool, &bytes), Err(RecordError::Foreign));
        let bigger = self::key(161 << 20);
        assert_eq!(decode(&bigger, &bytes), Err(RecordError::Foreign));
    }

    #[test]
    fn a_device_too_large_for_the_bitmap_gets_a_coarser_unit() {
        let fits = MAX_UNITS * RESYNC_UNIT;
        assert_eq!(unit_bytes_for(fits), RESYNC_UNIT);
        assert_eq!(unit_bytes_for(fits + 1), 2 * RESYNC_UNIT);
        let huge = key(64 << 40);
        assert!(huge.units <= MAX_UNITS && huge.unit_bytes.is_power_of_two());
        assert!(huge.encoded_bytes() as u64 <= RECORD_SLOT_BYTES);
        let bits = vec![u64::MAX; huge.words()];
        let mut expected = bits.clone();
        // Bits past the last unit are not stored.
        if !huge.units.is_multiple_of(64) {
            *expected.last_mut().unwrap() = (1 << (huge.units % 64)) - 1;
        }
        assert_eq!(decode(&huge, &encode(&huge, &bits)), Ok(expected));
    }

    #[test]
    fn a_fault_merges_what_was_written_since_the_last_flush_began() {
        let mut state = DirtyState::default();
        assert!(!state.note(3..=4, 1), "nothing tracked: no persist");
        let flush = state.begin_flush();
        state.note(9..=9, 1);
        state.start(1);
        // Both the flush under way and what came after it.
        assert_eq!(state.marked[0], 1 << 3 | 1 << 4 | 1 << 9);
        assert!(state.behind());
        assert!(!state.covered(9..=9));
        state.durable = state.marked.clone();
        assert!(state.covered(3..=4) && !state.behind());
        assert!(state.note(10..=10, 1), "a new bit must be persisted first");
        assert!(state.note(10..=10, 1), "and waits until it is");
        assert!(!state.covered(10..=10));
        state.end_flush(flush);
        state.stop();
        assert!(state.covered(10..=10) && state.marked[0] == 0);
    }
}
