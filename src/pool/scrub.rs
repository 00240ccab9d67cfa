//! Scrubbing the chunks a crash left suspect: their checksums recomputed
//! from the data.

use super::*;

impl Pool {
    /// Re-verifies suspect chunks: recomputes the checksums of their used
    /// slots from the data and clears them. Returns how many were scrubbed.
    pub async fn scrub_suspect(&self) -> Result<usize, PoolError> {
        let chunks = self.suspect_snapshot();
        let mut done = 0;
        for (device, chunk) in chunks {
            let _gate = self.close_gate().await;
            let layout = self.allocator.lock_or_abort().slot_shift_of(device, chunk);
            if let Some((slot_shift, used)) = layout {
                let pool_device = self.devices.at(device)?;
                let chunk_offset = chunk * self.chunk_bytes as u64;
                let (buf, result) = pool_device
                    .device
                    .read(chunk_offset, IoBuf::new(self.chunk_bytes as usize))
                    .await;
                if let Err(e) = result {
                    pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e.into());
                }
                let slots = (self.chunk_bytes as u64 >> slot_shift).min(alloc::MAX_SLOTS_PER_CHUNK);
                for slot in 0..slots {
                    if used[(slot / 64) as usize] & (1 << (slot % 64)) == 0 {
                        continue;
                    }
                    let start = (slot << slot_shift) as usize;
                    for sector in 0..(1usize << slot_shift) / SECTOR_BYTES as usize {
                        let at = start + sector * SECTOR_BYTES as usize;
                        let crc = crate::checksum::crc32c(&buf.payload()[at..at + SECTOR_BYTES as usize]);
                        self.set_crc(device, chunk_offset + at as u64, crc)
                            .map_err(PoolError::Meta)?;
                    }
                }
            }
            self.suspect.lock_or_abort().remove(&(device, chunk));
            done += 1;
        }
        Ok(done)
    }

    pub(super) fn suspect_snapshot(&self) -> Vec<(u8, u64)> {
        self.suspect.lock_or_abort().iter().copied().collect()
    }

    pub fn suspect_chunks(&self) -> usize {
        self.suspect.lock_or_abort().len()
    }
}
