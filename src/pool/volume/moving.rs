//! Moving blocks to another tier (the migrator: `pool/migrate.rs`).

use super::*;

/// What [`EngineVolume::move_blocks`] did with one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moved {
    /// The block is now at this slot (device, byte offset).
    To(u8, u64),
    /// Left where it is: changed since the pass looked, shared with a
    /// snapshot or clone (or about to be), cached writes pending there, or
    /// a snapshot being taken.
    Skipped,
    /// Left where it is: reading or verifying it failed (counted on the
    /// device), or writing its copy did.
    Failed,
}

impl EngineVolume {
    /// Moves `blocks` (block, map entry when the pass looked; one chunk's
    /// worth, sorted by block) to new slots on tier `to`: read in as few
    /// device reads as their places allow (a chunk in one, on a disk that
    /// pays per operation) and verified, written there, and remapped with
    /// `Map` records that free the old slots once committed (the way every
    /// relocated block goes; see `write_locked`). Holds the blocks' stripes
    /// exclusively throughout, so no reader sees an old slot freed and no
    /// write is lost between the read and the remap.
    pub(crate) async fn move_blocks(&self, blocks: &[(u64, u64)], to: Role) -> BlockResult<Vec<Moved>> {
        let mut outcome = vec![Moved::Skipped; blocks.len()];
        if self.is_snapshot() || blocks.is_empty() {
            return Ok(outcome);
        }
        // As the destager: no snapshot is deleted, nor a volume rolled
        // back, while blocks move (they change what shares them).
        let _placement = self.placement.read().await;
        let numbers: Vec<u64> = blocks.iter().map(|(block, _)| *block).collect();
        let _guards = self.lock_blocks_exclusive(&numbers).await;
        // A snapshot being taken: not waited for here (writes take the
        // barrier after their stripes the same way, without blocking).
        let Some(_barrier) = self.try_barrier() else {
            return Ok(outcome);
        };
        let block_bytes = self.block_bytes();
        // Which still are where the pass saw them, the volume's own, and
        // with nothing cached (a block being written is not cold; the
        // destager places it, and the next pass looks again).
        let mut places: Vec<(usize, u8, u64)> = Vec::new();
        for (index, &(block, expected)) in blocks.iter().enumerate() {
            let offset = block << self.block_shift;
            if !self.cached_blocks_in(offset, block_bytes).is_empty() {
                continue;
            }
            let entry = self.pool.lookup(self.id, block).map_err(meta_error)?;
            if entry != expected || entry & map_entry::SHARED != 0 {
                continue;
            }
            let Some((device, base)) = map_entry::decode(entry) else {
                continue;
            };
            if !self.pool.block_is_own(self.id, block).map_err(meta_error)? {
                continue;
            }
            places.push((index, device, base));
        }
        // Runs of slots contiguous on one device: one read each.
        places.sort_by_key(|&(_, device, base)| (device, base));
        let mut start = 0;
        while start < places.len() {
            let mut stop = start + 1;
            while stop < places.len()
                && places[stop].1 == places[start].1
                && places[stop].2 == places[stop - 1].2 + block_bytes
            {
                stop += 1;
            }
            let (_, device, base) = places[start];
            let run = &places[start..stop];
            start = stop;
            let length = run.len() as u64 * block_bytes;
            let first_block = blocks[run[0].0].0;
            let data = match self
                .read_sectors(device, base, length, first_block << self.block_shift, false)
                .await
            {
                Ok(data) => data,
                Err(_) => {
                    for &(index, _, _) in run {
                        outcome[index] = Moved::Failed;
                    }
                    continue;
                }
            };
            for (at, &(index, _, _)) in run.iter().enumerate() {
                let block = blocks[index].0;
                let offset = block << self.block_shift;
                let from = at * block_bytes as usize;
                let copy = IoBuf::copy_from(&data.payload()[from..from + block_bytes as usize]);
                match self.write_locked_in(offset, copy, None, Some(to)).await {
                    Ok(()) => {}
                    Err(BlockError::NoSpace) => return Err(BlockError::NoSpace),
                    Err(_) => {
                        outcome[index] = Moved::Failed;
                        continue;
                    }
                }
                let moved = self.pool.lookup(self.id, block).map_err(meta_error)?;
                if let Some((device, base)) = map_entry::decode(moved) {
                    outcome[index] = Moved::To(device, base);
                }
            }
        }
        Ok(outcome)
    }
}
