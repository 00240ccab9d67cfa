//! What stored metadata is checked against when it is loaded: the pool's
//! devices (how many, which hold data, where their data begins and ends).
//! A map entry or a checksum page that names a device the pool does not
//! have, or a place outside a device's data, is corrupt: it is refused
//! where it is read, with a message naming the table, the key and the
//! field, and never reaches the code that would index by it.
//! docs/FORMAT.md ("Validation") lists the rules.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::sync::LockOrAbort;

/// One pool device as stored metadata may name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceExtent {
    /// Fast or capacity: data slots (and their checksums) live here.
    pub holds_data: bool,
    /// Byte offset of its first data chunk (after chunk 0 and any metadata
    /// or log region).
    pub first_data: u64,
    /// Bytes of the device the pool uses (whole chunks).
    pub end: u64,
}

/// The pool's devices, by member index, and what this layer needs to know
/// of the block map's entries and checksummed sectors (the pool gives both:
/// their layout is the block map's own).
#[derive(Debug, Clone)]
pub struct Geometry {
    pub devices: Vec<DeviceExtent>,
    pub entries: EntryLayout,
    /// Bytes of data one stored checksum covers.
    pub sector_bytes: u64,
}

/// A block-map entry's layout, as the pool defines it.
#[derive(Clone, Copy)]
pub struct EntryLayout {
    /// The "mapped" bit.
    pub valid: u64,
    /// Flag bits that must be clear.
    pub must_be_clear: u64,
    /// (device index, byte offset) of a mapped entry.
    pub decode: fn(u64) -> Option<(u8, u64)>,
}

impl std::fmt::Debug for EntryLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "EntryLayout {{ valid: {:#x}, must_be_clear: {:#x} }}",
            self.valid, self.must_be_clear
        )
    }
}

impl Geometry {
    /// Checks a stored block-map entry: 0 (unmapped), or mapped with no
    /// flag set that must be clear, on a data device, inside that device's
    /// data. The error names the field.
    pub fn check_map_entry(&self, entry: u64) -> Result<(), String> {
        if entry == 0 {
            return Ok(());
        }
        if entry & self.entries.valid == 0 {
            return Err(format!("entry {entry:#018x} has bits set but is not mapped"));
        }
        if entry & self.entries.must_be_clear != 0 {
            return Err(format!("entry {entry:#018x} has reserved flag bits set"));
        }
        let Some((device, offset)) = (self.entries.decode)(entry) else {
            return Ok(());
        };
        let Some(extent) = self.devices.get(device as usize) else {
            return Err(format!(
                "entry {entry:#018x} names device {device}; the pool has {}",
                self.devices.len()
            ));
        };
        if !extent.holds_data {
            return Err(format!(
                "entry {entry:#018x} names device {device}, which holds no data"
            ));
        }
        if offset < extent.first_data || offset >= extent.end {
            return Err(format!(
                "entry {entry:#018x} points at offset {offset} of device {device}, outside its data [{}, {})",
                extent.first_data, extent.end
            ));
        }
        Ok(())
    }

    /// The device a stored key names, or why there is none.
    fn device(&self, device: impl Into<u64>) -> Result<&DeviceExtent, String> {
        let device = device.into();
        usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| format!("device {device} does not exist (the pool has {})", self.devices.len()))
    }

    /// Checks the key of a stored checksum page: a data device the pool
    /// has, a page inside it (`sectors_per_page` sectors of 4 KiB each).
    pub fn check_crc_key(&self, device: u32, page: u64, sectors_per_page: u64) -> Result<(), String> {
        let extent = self.device(device)?;
        if !extent.holds_data {
            return Err(format!("device {device} holds no data"));
        }
        let first_byte = page
            .checked_mul(sectors_per_page)
            .and_then(|s| s.checked_mul(self.sector_bytes));
        if first_byte.is_none_or(|at| at >= extent.end) {
            return Err(format!("page {page} lies past the end of device {device}"));
        }
        Ok(())
    }

    /// Checks `count` sectors from byte `offset` of `device` (a replayed
    /// record's): a data device, a sector boundary, inside its data area.
    pub fn check_sectors(&self, device: u8, offset: u64, count: u64) -> Result<(), String> {
        let extent = self.device(device as u64)?;
        if !extent.holds_data {
            return Err(format!("device {device} holds no data"));
        }
        let end = count
            .checked_mul(self.sector_bytes)
            .and_then(|bytes| offset.checked_add(bytes));
        if !offset.is_multiple_of(self.sector_bytes)
            || offset < extent.first_data
            || end.is_none_or(|end| end > extent.end)
        {
            return Err(format!(
                "{count} sectors at {offset} do not lie on sectors of device {device}'s data area [{}, {})",
                extent.first_data, extent.end
            ));
        }
        Ok(())
    }

    /// Checks a (device, chunk) pair of a stored row or a replayed record.
    pub fn check_chunk(&self, device: u64, chunk: u64, chunk_bytes: u64) -> Result<(), String> {
        let extent = self.device(device)?;
        if chunk.checked_mul(chunk_bytes).is_none_or(|at| at >= extent.end) {
            return Err(format!("chunk {chunk} lies past the end of device {device}"));
        }
        Ok(())
    }
}

/// Corrupt metadata met while the pool serves: counted (every time a
/// request meets it) and logged once per distinct finding, so a damaged
/// page that every read trips on does not flood the log.
#[derive(Debug, Default)]
pub struct CorruptionLog {
    count: AtomicU64,
    logged: Mutex<HashSet<String>>,
}

/// Distinct findings logged at most (later ones are counted only).
const MAX_LOGGED: usize = 1024;

impl CorruptionLog {
    /// Counts one meeting with corrupt metadata `what`; logs it the first
    /// time.
    pub fn note(&self, what: &str) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let mut logged = self.logged.lock_or_abort();
        if logged.len() < MAX_LOGGED && logged.insert(what.to_string()) {
            tracing::error!("corrupt metadata: {what}; requests that need it fail with EIO");
        }
    }

    /// Times corrupt metadata was met since the pool was opened.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::BlockPtr;

    /// A stored pointer to `offset` of `device`.
    fn at(device: u8, offset: u64) -> u64 {
        BlockPtr::at(device, offset).to_bits()
    }

    fn geometry() -> Geometry {
        Geometry {
            entries: BlockPtr::LAYOUT,
            sector_bytes: crate::pool::SECTOR_BYTES,
            devices: vec![
                DeviceExtent {
                    holds_data: true,
                    first_data: 97 << 20,
                    end: 128 << 20,
                },
                DeviceExtent {
                    holds_data: false,
                    first_data: 1 << 20,
                    end: 64 << 20,
                },
            ],
        }
    }

    #[test]
    fn map_entries_outside_the_pool_are_refused_with_the_field_named() {
        let g = geometry();
        assert!(g.check_map_entry(0).is_ok());
        assert!(g.check_map_entry(at(0, 97 << 20)).is_ok());
        assert!(g.check_map_entry(BlockPtr::at(0, 97 << 20).shared().to_bits()).is_ok());
        let error = g.check_map_entry(at(7, 97 << 20)).unwrap_err();
        assert!(error.contains("names device 7; the pool has 2"), "{error}");
        assert!(g.check_map_entry(at(1, 2 << 20)).unwrap_err().contains("holds no data"));
        assert!(g.check_map_entry(at(0, 4096)).unwrap_err().contains("outside its data"));
        assert!(g.check_map_entry(at(0, 128 << 20)).unwrap_err().contains("outside"));
        assert!(g.check_map_entry(5).unwrap_err().contains("not mapped"));
        assert!(g
            .check_map_entry(at(0, 97 << 20) | 1 << 56)
            .unwrap_err()
            .contains("reserved"));
        assert!(g.check_crc_key(0, 31, 1024).is_ok());
        assert!(g.check_crc_key(0, 32, 1024).is_err());
        assert!(g.check_crc_key(0, u64::MAX, 1024).is_err());
        assert!(g.check_crc_key(1, 0, 1024).is_err());
        assert!(g.check_crc_key(u32::MAX, 0, 1024).is_err());
        assert!(g.check_chunk(0, 127, 1 << 20).is_ok());
        assert!(g.check_chunk(0, 128, 1 << 20).is_err());
        assert!(g.check_chunk(300, 0, 1 << 20).is_err());
    }

    #[test]
    fn a_finding_is_counted_every_time_and_logged_once() {
        let log = CorruptionLog::default();
        log.note("map page (1, 0): entry 3");
        log.note("map page (1, 0): entry 3");
        assert_eq!(log.count(), 2);
        assert_eq!(log.logged.lock().unwrap().len(), 1);
    }
}
