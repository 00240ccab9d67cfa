//! Volumes on the pool: opening one (its reservations restored), counting
//! its blocks, destroying it (its blocks freed).

use super::*;

/// How a destroyed volume's slots are freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Release {
    /// At once (their holes already punched).
    Now,
    /// Through the freeing queue (`pool/freeing.rs`): a large volume.
    Background,
    /// Replaying the log: a change may already be in the checkpoint, and
    /// freeing a free slot is expected rather than a bug.
    Replaying,
}

impl Pool {
    /// Opens volume `id` (its blocks are looked up lazily).
    pub fn open_volume(
        self: &Arc<Self>,
        id: u32,
        size_bytes: u64,
        volblocksize: u32,
    ) -> Result<Arc<volume::EngineVolume>, PoolError> {
        if !volblocksize.is_power_of_two() || !(4096..=128 << 10).contains(&volblocksize) {
            return Err(PoolError::Invalid(format!(
                "volblocksize {volblocksize} is not supported"
            )));
        }
        let mapped = self.count_volume_blocks(id, size_bytes, volblocksize)?;
        let engine = Arc::new(volume::EngineVolume::new(
            self.clone(),
            id,
            size_bytes,
            volblocksize,
            mapped,
        ));
        self.restore_reservations(&engine)?;
        // Cached writes restored after a crash may belong to its snapshots:
        // of a sector's versions, those a snapshot boundary separates stay.
        let (floor, floors) = {
            let snapshots = self.snapshots_read();
            (snapshots.floor(id), snapshots.floors(id))
        };
        let dropped = {
            let cache = self.cache.volume(id);
            let mut state = cache.lock();
            state.floor = floor;
            state.settle(&floors)
        };
        for slot in dropped {
            // SAFETY: `settle` removed the only entry that referred to it,
            // and the volume is not open yet: nobody reads its slots.
            unsafe { self.cache.ram.release(slot) };
        }
        self.register_volume(id, Arc::downgrade(&engine));
        self.register_open_engine(&engine);
        Ok(engine)
    }

    /// The blocks volume `id` maps; a clone counts those it sees through
    /// its origin too.
    pub(super) fn count_volume_blocks(&self, id: u32, size_bytes: u64, volblocksize: u32) -> Result<u64, PoolError> {
        if self.origin_of(id).is_some() {
            Ok(self.count_view_blocks(id, size_bytes, volblocksize)?)
        } else {
            self.count_mapped_blocks(id)
        }
    }

    /// Opens snapshot `id` (read-only) of a volume of `volblocksize`.
    pub fn open_snapshot(self: &Arc<Self>, id: u32, volblocksize: u32) -> Result<Arc<volume::EngineVolume>, PoolError> {
        let info = self
            .snapshot(id)
            .ok_or_else(|| PoolError::Invalid(format!("no snapshot {id:#x}")))?;
        let engine = Arc::new(volume::EngineVolume::new(
            self.clone(),
            id,
            info.size_bytes,
            volblocksize,
            info.mapped_blocks,
        ));
        self.register_open_engine(&engine);
        Ok(engine)
    }

    /// Reserves pool space again for the unmapped blocks that the cache
    /// holds dirty sectors of after a restart (restored from the RAM tier or
    /// the intent log). They were accepted, with space reserved, before the
    /// crash, so they fit: the reservation is taken even past the free
    /// space, before any new write can claim it.
    fn restore_reservations(&self, engine: &volume::EngineVolume) -> Result<(), PoolError> {
        let cache = self.cache.volume(engine.id());
        let per_block = engine.sectors_per_block();
        let mut blocks: Vec<u64> = {
            let state = cache.lock();
            state
                .entries
                .keys()
                .map(|sector| sector / per_block)
                .filter(|block| !state.reserved.contains(block))
                .collect()
        };
        blocks.dedup();
        let mut unmapped = Vec::new();
        for block in blocks {
            if !self.lookup(engine.id(), block).map_err(PoolError::Meta)?.is_mapped() {
                unmapped.push(block);
            }
        }
        if !unmapped.is_empty() {
            self.reserved_bytes
                .fetch_add(unmapped.len() as u64 * engine.volblocksize() as u64, Ordering::AcqRel);
            cache.lock().reserved.extend(unmapped);
        }
        Ok(())
    }

    /// Pool space promised to cached writes whose blocks are not placed yet.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes.load(Ordering::Acquire)
    }

    /// Destroys volume `id`: frees every block once the record saying so is
    /// durable; the next checkpoint deletes its pages.
    pub async fn destroy_volume(&self, id: u32) -> Result<(), PoolError> {
        if self.snapshots_read().has_volume(id) {
            return Err(PoolError::Invalid("the volume has snapshots: delete them first".into()));
        }
        self.engines.lock_or_abort().remove(&id);
        let (_, reserved_bytes) = self.cache.forget_volume(id);
        self.read_cache.invalidate_volume(id);
        self.unreserve(reserved_bytes);
        self.log.append(Record::Destroy { volume: id });
        self.commit().await?;
        // Nothing maps its slots now and nothing can allocate them until
        // they are freed: give their space back to the file system first
        // (a large volume's in the background, see `pool/freeing.rs`).
        let slots = self.volume_slots(id)?;
        let release = if slots.len() > self.free_above() {
            Release::Background
        } else {
            self.punch_holes(&slots).await;
            Release::Now
        };
        let _gate = self.close_gate().await;
        // Not while a shared block of its family moves (`Pool::relocate`).
        let _copying = self.page_copy.lock_or_abort();
        self.free_volume_blocks(id, release)?;
        Ok(())
    }

    /// The slots volume `id` maps that nothing else does (a volume with
    /// no snapshot shares only a clone's slots, with its origin).
    fn volume_slots(&self, id: u32) -> Result<Vec<(u8, u64)>, PoolError> {
        let mut slots = Vec::new();
        for key in self.volume_page_keys(id)? {
            let page = self.map_pages.get(&self.db, key).map_err(PoolError::Meta)?;
            slots.extend(page.ptrs().into_iter().filter_map(own_slot));
        }
        Ok(slots)
    }

    /// The keys of volume `id`'s map pages, stored or cached.
    fn volume_page_keys(&self, id: u32) -> Result<HashSet<(u32, u64)>, PoolError> {
        let mut keys: HashSet<(u32, u64)> = HashSet::new();
        crate::meta::store::guarded(format_args!("table map_pages pages of {id}"), || {
            let txn = self.db.begin_read().map_err(MetaError::from)?;
            let table = txn.open_table(MAP_PAGES).map_err(MetaError::from)?;
            for row in table.range((id, 0)..=(id, u64::MAX)).map_err(MetaError::from)? {
                let (key, _) = row.map_err(MetaError::from)?;
                keys.insert(key.value());
            }
            Ok::<(), PoolError>(())
        })?;
        for (owner, page) in self.map_pages.keys() {
            if owner == id {
                keys.insert((owner, page));
            }
        }
        Ok(keys)
    }

    /// Frees (or queues for freeing) every block a volume maps, in the
    /// same step as its pages are forgotten (so a checkpoint sees both or
    /// neither). Replaying the log, a block may already be free (the
    /// checkpoint came after the record); otherwise a block that is not in
    /// use is a double mapping, and stops the engine.
    pub(super) fn free_volume_blocks(&self, id: u32, release: Release) -> Result<(), PoolError> {
        let keys = self.volume_page_keys(id)?;
        let mut slots = Vec::new();
        for key in keys {
            let page = self.map_pages.get(&self.db, key).map_err(PoolError::Meta)?;
            slots.extend(page.ptrs().into_iter().filter_map(own_slot));
        }
        let mut allocator = self.allocator.lock_or_abort();
        let double = match release {
            Release::Background => allocator.defer_frees(&mut slots).err(),
            Release::Now | Release::Replaying => {
                let mut double = None;
                for &(device, offset) in &slots {
                    if !allocator.free(device, offset) {
                        double = double.or(Some((device, offset)));
                    }
                }
                double
            }
        };
        drop(allocator);
        if let Some((device, offset)) = double.filter(|_| release != Release::Replaying) {
            panic!("volume {id} maps slot {device}/{offset}, which is not in use");
        }
        if release == Release::Background {
            self.freer_wake.notify_one();
        }
        self.map_pages.forget_owner(id);
        self.forget_namespace(id);
        self.destroyed.lock_or_abort().insert(id);
        self.forget_origin(id);
        Ok(())
    }
}

/// The slot of a map entry that only its volume maps.
fn own_slot(entry: BlockPtr) -> Option<(u8, u64)> {
    if entry.is_shared() {
        return None;
    }
    entry.place()
}
