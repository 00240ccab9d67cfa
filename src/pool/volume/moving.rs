//! Moving a block to another tier (the migrator: `pool/migrate.rs`).

use super::*;

/// What [`EngineVolume::move_block`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moved {
    /// The block is now at this slot (device, byte offset).
    To(u8, u64),
    /// Left where it is: changed since the pass looked, shared with a
    /// snapshot or clone (or about to be), cached writes pending there, or
    /// a snapshot being taken.
    Skipped,
}

impl EngineVolume {
    /// Moves `block`, mapped at `expected` when the pass looked, to a new
    /// slot on tier `to`: read and verified, written there, and remapped
    /// with a `Map` record that frees the old slot once committed (the way
    /// every relocated block goes; see `write_locked`). Holds the block's
    /// stripe exclusively throughout, so no reader sees the old slot freed
    /// and no write is lost between the read and the remap.
    pub(crate) async fn move_block(&self, block: u64, expected: u64, to: Role) -> BlockResult<Moved> {
        if self.is_snapshot() {
            return Ok(Moved::Skipped);
        }
        // As the destager: no snapshot is deleted, nor a volume rolled
        // back, while the block moves (they change what shares it).
        let _placement = self.placement.read().await;
        let offset = block << self.block_shift;
        let _guards = self.lock_exclusive(offset, self.block_bytes()).await;
        // A snapshot being taken: not waited for here (writes take the
        // barrier after their stripes the same way, without blocking).
        let Some(_barrier) = self.try_barrier() else {
            return Ok(Moved::Skipped);
        };
        // Cached writes of the block go to its place first (the destager):
        // a block being written is not cold, and is looked at next pass.
        if !self.cached_blocks_in(offset, self.block_bytes()).is_empty() {
            return Ok(Moved::Skipped);
        }
        let entry = self.pool.lookup(self.id, block).map_err(meta_error)?;
        if entry != expected || entry & map_entry::SHARED != 0 {
            return Ok(Moved::Skipped);
        }
        let Some((device, base)) = map_entry::decode(entry) else {
            return Ok(Moved::Skipped);
        };
        if !self.pool.block_is_own(self.id, block).map_err(meta_error)? {
            return Ok(Moved::Skipped);
        }
        let data = self
            .read_sectors(device, base, self.block_bytes(), offset, false)
            .await?;
        self.write_locked_in(offset, data, None, Some(to)).await?;
        let moved = self.pool.lookup(self.id, block).map_err(meta_error)?;
        match map_entry::decode(moved) {
            Some((device, base)) => Ok(Moved::To(device, base)),
            None => Ok(Moved::Skipped),
        }
    }
}
