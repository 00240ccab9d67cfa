//! Volumes on the pool: opening one (its reservations restored), counting
//! its blocks, destroying it (its blocks freed).

use super::*;

/// Whether the log is being replayed: then a change may already be in the
/// checkpoint, and freeing a free slot is expected rather than a bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Replaying {
    Yes,
    No,
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
        let mapped = self.count_mapped_blocks(id)?;
        let engine = Arc::new(volume::EngineVolume::new(
            self.clone(),
            id,
            size_bytes,
            volblocksize,
            mapped,
        ));
        self.restore_reservations(&engine)?;
        self.register_volume(id, Arc::downgrade(&engine));
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
            if self.lookup(engine.id(), block).map_err(PoolError::Meta)? & map_entry::VALID == 0 {
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
        self.engines.lock_or_abort().remove(&id);
        let (_, reserved_bytes) = self.cache.forget_volume(id);
        self.read_cache.invalidate_volume(id);
        self.unreserve(reserved_bytes);
        self.log.append(Record::Destroy { volume: id });
        self.commit().await?;
        // Nothing maps its slots now and nothing can allocate them until
        // they are freed: give their space back to the file system first.
        let slots = self.volume_slots(id)?;
        self.punch_holes(&slots).await;
        let _gate = self.gate.write().await;
        self.free_volume_blocks(id, Replaying::No)?;
        Ok(())
    }

    /// The slots volume `id` maps.
    fn volume_slots(&self, id: u32) -> Result<Vec<(u8, u64)>, PoolError> {
        let mut slots = Vec::new();
        for key in self.volume_page_keys(id)? {
            let page = self.map_pages.get(&self.db, key).map_err(PoolError::Meta)?;
            slots.extend(
                page.entries
                    .iter()
                    .filter_map(|e| map_entry::decode(e.load(Ordering::Acquire))),
            );
        }
        Ok(slots)
    }

    /// The keys of volume `id`'s map pages, stored or cached.
    fn volume_page_keys(&self, id: u32) -> Result<HashSet<(u32, u64)>, PoolError> {
        let mut keys: HashSet<(u32, u64)> = HashSet::new();
        {
            let txn = self.db.begin_read().map_err(MetaError::from)?;
            let table = txn.open_table(MAP_PAGES).map_err(MetaError::from)?;
            for row in table.range((id, 0)..=(id, u64::MAX)).map_err(MetaError::from)? {
                let (key, _) = row.map_err(MetaError::from)?;
                keys.insert(key.value());
            }
        }
        for (owner, page) in self.map_pages.keys() {
            if owner == id {
                keys.insert((owner, page));
            }
        }
        Ok(keys)
    }

    /// Frees every block a volume maps. Replaying the log, a block may
    /// already be free (the checkpoint came after the record); otherwise a
    /// block that is not in use is a double mapping, and stops the engine.
    pub(super) fn free_volume_blocks(&self, id: u32, replaying: Replaying) -> Result<(), PoolError> {
        let keys = self.volume_page_keys(id)?;
        let mut allocator = self.allocator.lock_or_abort();
        for key in keys {
            let page = self.map_pages.get(&self.db, key).map_err(PoolError::Meta)?;
            for entry in page.entries.iter() {
                if let Some((device, offset)) = map_entry::decode(entry.load(Ordering::Acquire)) {
                    let freed = allocator.free(device, offset);
                    assert!(
                        freed || replaying == Replaying::Yes,
                        "volume {id} maps slot {device}/{offset}, which is not in use"
                    );
                }
            }
        }
        drop(allocator);
        self.map_pages.forget_owner(id);
        self.destroyed.lock_or_abort().insert(id);
        Ok(())
    }
}
