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
        let mut copies: Vec<(usize, IoBuf)> = Vec::with_capacity(places.len());
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
            match self
                .read_sectors(device, base, length, first_block << self.block_shift, false)
                .await
            {
                Ok(data) => {
                    for (at, &(index, _, _)) in run.iter().enumerate() {
                        let from = at * block_bytes as usize;
                        copies.push((
                            index,
                            IoBuf::copy_from(&data.payload()[from..from + block_bytes as usize]),
                        ));
                    }
                }
                Err(_) => {
                    for &(index, _, _) in run {
                        outcome[index] = Moved::Failed;
                    }
                }
            }
        }
        // Runs of consecutive blocks: one write each (their new slots are
        // taken one after the other, so a run lands as one device write,
        // which matters on a disk that pays per operation).
        copies.sort_by_key(|(index, _)| blocks[*index].0);
        let mut start = 0;
        while start < copies.len() {
            let mut stop = start + 1;
            while stop < copies.len() && blocks[copies[stop].0].0 == blocks[copies[stop - 1].0].0 + 1 {
                stop += 1;
            }
            let run = &copies[start..stop];
            start = stop;
            let mut data = IoBuf::new(run.len() * block_bytes as usize);
            for (at, (_, copy)) in run.iter().enumerate() {
                let from = at * block_bytes as usize;
                data.payload_mut()[from..from + block_bytes as usize].copy_from_slice(copy.payload());
            }
            let offset = blocks[run[0].0].0 << self.block_shift;
            let result = self.write_locked_in(offset, data, None, Some(to)).await;
            if matches!(result, Err(BlockError::NoSpace)) {
                return Err(BlockError::NoSpace);
            }
            // A failed write may have moved some of them (each block is
            // mapped on its own): the map says which.
            for (index, _) in run {
                let entry = self.pool.lookup(self.id, blocks[*index].0).map_err(meta_error)?;
                outcome[*index] = match map_entry::decode(entry) {
                    Some((device, base)) if entry != blocks[*index].1 => Moved::To(device, base),
                    _ if result.is_err() => Moved::Failed,
                    _ => Moved::Skipped,
                };
            }
        }
        Ok(outcome)
    }
}
