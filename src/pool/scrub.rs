//! The scrub after a crash: every block that lies in a suspect part (a
//! write may have been in flight there when the pool stopped) is read back
//! where it lies and verified. A mismatch in a suspect part is repaired
//! from the data, since the crash explains it; a mismatch anywhere else is
//! a checksum error, counted and logged like any read's. Each block holds
//! only its own stripe's read lock while it is read, so clients' writes go
//! on meanwhile.

use super::*;

/// What a scrub did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScrubReport {
    /// Blocks read back and verified.
    pub blocks: u64,
    /// Sectors whose checksums were repaired from the data.
    pub repaired: u64,
    /// Blocks that failed to verify (checksum or read errors, counted on
    /// their devices).
    pub failed: u64,
    /// Chunks with suspect parts left: parts no open volume maps (free
    /// space, or blocks only snapshots keep). A read there repairs them; a
    /// write there clears them.
    pub left: usize,
}

impl Pool {
    /// Reads back and verifies the blocks of every open volume and dataset
    /// that lie in suspect parts.
    pub async fn scrub_suspect(&self) -> Result<ScrubReport, PoolError> {
        let suspect: HashMap<(u8, u64), ChunkParts> = self.suspect.lock_or_abort().clone();
        let mut report = ScrubReport::default();
        if suspect.is_empty() {
            return Ok(report);
        }
        let repaired = |pool: &Pool| -> u64 {
            pool.devices
                .iter()
                .map(|d| d.counters.repaired_after_crash.load(Ordering::Relaxed))
                .sum()
        };
        let repaired_before = repaired(self);
        let chunk_bytes = self.chunk_bytes as u64;
        for engine in self.engines() {
            if engine.is_snapshot() {
                continue;
            }
            let id = engine.id();
            let block_bytes = engine.block_bytes();
            let blocks = crate::volume::BlockDevice::size_bytes(&*engine).div_ceil(block_bytes);
            if blocks == 0 {
                continue;
            }
            let mut wanted = Vec::new();
            for index in self.view_page_indexes(id, blocks).map_err(PoolError::Meta)? {
                let first = index * MAP_ENTRIES_PER_PAGE;
                let last = (first + MAP_ENTRIES_PER_PAGE - 1).min(blocks - 1);
                let entries = self.lookup_range(id, first, last).map_err(PoolError::Meta)?;
                for (block, entry) in (first..).zip(entries) {
                    let Some((device, offset)) = entry.place() else {
                        continue;
                    };
                    let Some(have) = suspect.get(&(device, offset / chunk_bytes)) else {
                        continue;
                    };
                    let (_, parts) = self.parts_of(offset, block_bytes);
                    if have.iter().zip(parts).any(|(have, want)| have & want != 0) {
                        wanted.push(block);
                    }
                }
            }
            report.blocks += wanted.len() as u64;
            report.failed += engine.scrub_blocks(&wanted).await;
        }
        report.repaired = repaired(self) - repaired_before;
        report.left = self.suspect_chunks();
        Ok(report)
    }

    pub(super) fn suspect_snapshot(&self) -> Vec<((u8, u64), ChunkParts)> {
        let mut parts: Vec<_> = self.suspect.lock_or_abort().iter().map(|(k, v)| (*k, *v)).collect();
        parts.sort_unstable();
        parts
    }

    /// Chunks with suspect parts.
    pub fn suspect_chunks(&self) -> usize {
        self.suspect.lock_or_abort().len()
    }
}
