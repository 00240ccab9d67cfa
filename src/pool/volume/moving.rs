//! Moving blocks to another tier (the migrator: `pool/migrate.rs`).

use super::*;

/// What [`EngineVolume::move_blocks`] did with one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Moved {
    /// The block is now at this slot (device, byte offset).
    To(u8, u64),
    /// Left where it is: changed since the pass looked, cached writes
    /// pending there, a snapshot being taken, or (shared) an engine of its
    /// family opened meanwhile or too many owners.
    Skipped,
    /// Left where it is: reading or verifying it failed (counted on the
    /// device), or writing its copy did.
    Failed,
}

impl EngineVolume {
    /// Moves `blocks` (block, the slot the pass found there; one chunk's
    /// worth, sorted by block) to new slots on tier `to`: read in as few
    /// device reads as their places allow (a chunk in one, on a disk that
    /// pays per operation) and verified, then written there. A block only
    /// this volume maps is remapped with a `Map` record that frees the old
    /// slot once committed (the way every relocated block goes; see
    /// `write_locked`). A slot snapshots or clones share (or that only one
    /// of this volume's snapshots still maps) moves once for all of them
    /// ([`Self::move_shared`]). Holds the blocks' stripes exclusively
    /// throughout, so no reader sees an old slot freed and no write is
    /// lost between the read and the remap.
    pub(crate) async fn move_blocks(&self, blocks: &[(u64, BlockPtr)], to: Role) -> BlockResult<Vec<Moved>> {
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
        // Which still are where the pass saw them and with nothing cached
        // (a block being written is not cold; the destager places it, and
        // the next pass looks again); of those, which only this volume maps.
        let mut own: Vec<(usize, u8, u64)> = Vec::new();
        let mut shared: Vec<usize> = Vec::new();
        for (index, &(block, expected)) in blocks.iter().enumerate() {
            let offset = block << self.block_shift;
            if !self.cached_blocks_in(offset, block_bytes).is_empty() {
                continue;
            }
            let entry = self.pool.lookup(self.id, block).map_err(meta_error)?;
            let Some((device, base)) = expected.place() else {
                continue;
            };
            if entry == expected && !entry.is_shared() && self.pool.block_is_own(self.id, block).map_err(meta_error)? {
                own.push((index, device, base));
            } else if self.pool.has_snapshots() {
                shared.push(index);
            }
        }
        let copies = self.read_places(blocks, own, &mut outcome).await;
        self.write_moved(blocks, copies, to, &mut outcome).await?;
        if !shared.is_empty() {
            self.move_shared(blocks, &shared, to, &mut outcome).await?;
        }
        Ok(outcome)
    }

    /// Reads and verifies the blocks at `places` (index into `blocks`,
    /// device, byte offset), runs of slots contiguous on one device in one
    /// read each; a failed read marks its blocks `Failed`. Returns the
    /// copies by index.
    async fn read_places(
        &self,
        blocks: &[(u64, BlockPtr)],
        mut places: Vec<(usize, u8, u64)>,
        outcome: &mut [Moved],
    ) -> Vec<(usize, IoBuf)> {
        let block_bytes = self.block_bytes();
        places.sort_by_key(|&(_, device, base)| (device, base));
        let mut copies: Vec<(usize, IoBuf)> = Vec::with_capacity(places.len());
        for run in places.chunk_by(|a, b| b.1 == a.1 && b.2 == a.2 + block_bytes) {
            let (_, device, base) = run[0];
            let run_blocks: Vec<u64> = run.iter().map(|&(index, _, _)| blocks[index].0).collect();
            match self.read_slots(device, base, &run_blocks).await {
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
        copies.sort_by_key(|(index, _)| blocks[*index].0);
        copies
    }

    /// Writes the copies of blocks only this volume maps to new slots on
    /// tier `to` and remaps them (`write_locked_in`). Runs of consecutive
    /// blocks go in one write each (their new slots are taken one after
    /// the other, so a run lands as one device write, which matters on a
    /// disk that pays per operation).
    async fn write_moved(
        &self,
        blocks: &[(u64, BlockPtr)],
        copies: Vec<(usize, IoBuf)>,
        to: Role,
        outcome: &mut [Moved],
    ) -> BlockResult<()> {
        let block_bytes = self.block_bytes();
        for run in copies.chunk_by(|a, b| blocks[b.0].0 == blocks[a.0].0 + 1) {
            let mut data = IoBuf::new(run.len() * block_bytes as usize);
            for (at, (_, copy)) in run.iter().enumerate() {
                let from = at * block_bytes as usize;
                data.payload_mut()[from..from + block_bytes as usize].copy_from_slice(copy.payload());
            }
            let offset = blocks[run[0].0].0 << self.block_shift;
            let result = self.write_locked_in(offset, data, None, Some(to), None).await;
            if matches!(result, Err(BlockError::NoSpace)) {
                return Err(BlockError::NoSpace);
            }
            // A failed write may have moved some of them (each block is
            // mapped on its own): the map says which.
            for (index, _) in run {
                let entry = self.pool.lookup(self.id, blocks[*index].0).map_err(meta_error)?;
                outcome[*index] = match entry.place() {
                    Some((device, base)) if entry != blocks[*index].1 => Moved::To(device, base),
                    _ if result.is_err() => Moved::Failed,
                    _ => Moved::Skipped,
                };
            }
        }
        Ok(())
    }

    /// Moves the slots at `indices` of `blocks` that snapshots or clones
    /// map (as well as, or instead of, this volume): each is copied once
    /// to a new slot on tier `to` and every volume and snapshot of the
    /// family that maps it is remapped by one `Relocate` record
    /// (`Pool::relocate`). The block's stripes are held in every open
    /// engine of the family (clones, snapshot views) as well as in this
    /// one, so none of their readers is reading the old slot when the
    /// commit frees it; their writes to the block (copies on write, as the
    /// slot is shared) wait too. The caller holds this volume's stripes.
    async fn move_shared(
        &self,
        blocks: &[(u64, BlockPtr)],
        indices: &[usize],
        to: Role,
        outcome: &mut [Moved],
    ) -> BlockResult<()> {
        let family = self.pool.family(self.id);
        let mut others: Vec<Arc<EngineVolume>> = self
            .pool
            .open_engines_in(&family)
            .into_iter()
            .filter(|engine| !std::ptr::eq(Arc::as_ptr(engine), self))
            .collect();
        // In id order: the lock order of several engines' stripes.
        others.sort_by_key(|engine| engine.id());
        let numbers: Vec<u64> = indices.iter().map(|&index| blocks[index].0).collect();
        let mut held = Vec::with_capacity(others.len());
        for engine in &others {
            held.push(engine.lock_family_blocks_exclusive(&numbers).await);
        }
        let block_bytes = self.block_bytes();
        let mut places = Vec::with_capacity(indices.len());
        for &index in indices {
            let (block, slot) = blocks[index];
            let offset = block << self.block_shift;
            // A clone's cached writes: as for this volume's, the next pass.
            if others
                .iter()
                .any(|engine| !engine.is_snapshot() && !engine.cached_blocks_in(offset, block_bytes).is_empty())
            {
                continue;
            }
            let Some((device, base)) = slot.place() else {
                continue;
            };
            if !self.pool.slot_is_mapped(&family, block, slot).map_err(meta_error)? {
                continue;
            }
            places.push((index, device, base));
        }
        let copies = self.read_places(blocks, places, outcome).await;
        let mut locked: Vec<&EngineVolume> = others.iter().map(|engine| &**engine).collect();
        locked.push(self);
        // New slots for all, then one device write per run of them that
        // lies together (a disk pays per operation), then the remaps.
        let slot_shift = block_bytes.trailing_zeros() as u8;
        let mut targets: Vec<(usize, IoBuf, u8, u64)> = Vec::with_capacity(copies.len());
        for (index, data) in copies {
            let Some((device, offset)) = self.pool.allocate_in_tier(slot_shift, to) else {
                for (_, _, device, offset) in &targets {
                    self.pool.release_unused(*device, *offset);
                }
                return Err(BlockError::NoSpace);
            };
            targets.push((index, data, device, offset));
        }
        let bytes = block_bytes as usize;
        let mut runs = targets.chunk_by(|a, b| b.2 == a.2 && b.3 == a.3 + block_bytes);
        while let Some(run) = runs.next() {
            let mut buf = IoBuf::new(run.len() * bytes);
            for (at, (_, data, _, _)) in run.iter().enumerate() {
                buf.payload_mut()[at * bytes..(at + 1) * bytes].copy_from_slice(data.payload());
            }
            let pool_device = self.pool.data_device(run[0].2);
            let (buf, result) = match &pool_device {
                Ok(pool_device) => pool_device.device.write(run[0].3, buf).await,
                Err(e) => (
                    buf,
                    Err(crate::device::DeviceError::Failed {
                        device: format!("device {}", run[0].2),
                        reason: e.to_string(),
                    }),
                ),
            };
            if result.is_err() {
                if let Ok(pool_device) = pool_device {
                    pool_device.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                }
                for (index, _, device, offset) in run {
                    self.pool.release_unused(*device, *offset);
                    outcome[*index] = Moved::Failed;
                }
                continue;
            }
            self.pool.note_data_write(run[0].2, buf.len() as u64);
            let _gate = self.pool.enter_write(self.id).await;
            for (at, (index, _, device, offset)) in run.iter().enumerate() {
                let (block, old) = blocks[*index];
                let crcs = sector_crcs(&buf.payload()[at * bytes..(at + 1) * bytes]);
                let new = BlockPtr::at(*device, *offset);
                match self.pool.relocate(self.id, &locked, block, old, new, crcs) {
                    Ok(true) => outcome[*index] = Moved::To(*device, *offset),
                    Ok(false) => self.pool.release_unused(*device, *offset),
                    Err(e) => {
                        // This one and every later one are mapped by
                        // nobody.
                        for (_, _, device, offset) in run[at..].iter().chain(runs.flatten()) {
                            self.pool.release_unused(*device, *offset);
                        }
                        return Err(meta_error(e));
                    }
                }
            }
        }
        drop(held);
        Ok(())
    }
}
