//! Deleting a snapshot (its pages handed to its older neighbour, the
//! slots no neighbour maps freed) and rolling a volume back to its newest
//! snapshot. Both hold the volume's writes and destaging until their
//! record is durable, and both are replayed by the same code.

use super::*;

impl Pool {
    /// Deletes a snapshot: its pages go to its older neighbour where that
    /// one has none, and the slots neither neighbour maps are freed once
    /// the record saying so is durable (many of them in the background:
    /// `pool/freeing.rs`). Writes to the volume wait meanwhile (the work is
    /// proportional to the snapshot's own map pages: ~8 ms for 4 GiB).
    pub async fn destroy_snapshot(&self, snapshot: u32) -> Result<(), PoolError> {
        let Some(info) = self.snapshot(snapshot) else {
            return Err(PoolError::Invalid(format!("no snapshot {snapshot:#x}")));
        };
        let clones = self.snapshots_read().clones_of(snapshot);
        if !clones.is_empty() {
            return Err(PoolError::HasClones(clones));
        }
        let live = self
            .engines
            .lock_or_abort()
            .get(&info.volume)
            .and_then(std::sync::Weak::upgrade);
        // Writes wait, and so does the destager (it may be copying a page
        // into this very snapshot, for cached data written after it), until
        // the record is durable: entries the snapshot no longer shares are
        // overwritten in place, and a crash before the record would bring
        // the snapshot back over them. So the commit below runs under both
        // guards, and must never make log room: that destages the volume's
        // logged data, which waits for the placement lock held here
        // ([`Pool::commit_holding_placement`]).
        let _barrier = match &live {
            Some(volume) => Some(volume.barrier().write().await),
            None => None,
        };
        let _placement = match &live {
            Some(volume) => Some(volume.placement().write().await),
            None => None,
        };
        // A promotion that ran while this waited for the barrier moved the
        // snapshot to its clone, whose writes this does not hold.
        if self.snapshot(snapshot).is_some_and(|now| now.volume != info.volume) {
            return Err(PoolError::Invalid(format!(
                "snapshot {snapshot:#x} moved to another volume (a promotion) while it was being deleted: try again"
            )));
        }
        {
            let _gate = self.gate(snapshot).read().await;
            // Who maps a slot changes: not while a shared block moves.
            let _copying = self.page_copy.lock_or_abort();
            let freed = self.apply_destroy_snapshot(snapshot)?;
            self.log.append_frees(Record::DestroySnapshot { snapshot }, freed);
        }
        self.refresh_floor(info.volume);
        self.read_cache.invalidate_volume(snapshot);
        self.commit_holding_placement().await
    }

    /// The work of a snapshot's deletion (also replayed): returns the slots
    /// to free.
    ///
    /// The oldest snapshot of a clone has the clone's origin as its older
    /// neighbour for what stays mapped, but hands it no pages: the origin's
    /// view does not go through the clone.
    pub(in crate::pool) fn apply_destroy_snapshot(&self, snapshot: u32) -> Result<Vec<(u8, u64)>, PoolError> {
        let (info, older, newer, origin) = {
            let snapshots = self.snapshots_read();
            let Some(info) = snapshots.by_id.get(&snapshot).cloned() else {
                return Ok(Vec::new());
            };
            let (older, newer) = snapshots.neighbours(snapshot);
            let origin = snapshots.origin(info.volume);
            (info, older, newer, origin)
        };
        let mut freed = Vec::new();
        for index in self.own_pages(snapshot)? {
            let page = self.map_pages.get(&self.db, (snapshot, index))?;
            let older_page: Option<Vec<BlockPtr>> = match (older, origin) {
                (Some(older), _) => {
                    let older_page = self.map_pages.get(&self.db, (older, index))?;
                    if !older_page.present.load(Ordering::Acquire) {
                        // The older snapshot saw this page through ours: it
                        // is its own now, and every slot in it stays mapped.
                        let copy = self.map_pages.put(
                            (older, index),
                            MapPage::copied(&page.entries, page.birth.load(Ordering::Acquire)),
                        );
                        self.map_pages.mark_dirty(&copy);
                        continue;
                    }
                    Some(older_page.ptrs())
                }
                (None, Some(origin)) => Some(self.view_entries(origin, index)?),
                (None, None) => None,
            };
            let live_page = self.map_pages.get(&self.db, (info.volume, index))?;
            let next_page = match newer {
                Some(newer) => self.view_page(newer, index)?,
                None => live_page.clone(),
            };
            // The newer snapshots may have no copy of this page: they see
            // the volume's, and copy it (sharing its entries again) before
            // it changes.
            let next_is_live = Arc::ptr_eq(&next_page, &live_page);
            let mut live_changed = false;
            for (i, slot) in page.ptrs().into_iter().enumerate() {
                if !slot.is_mapped() {
                    continue;
                }
                let in_older = older_page.as_ref().is_some_and(|p| p[i].same_slot(slot));
                let next = next_page.ptr(i);
                let in_next = next.same_slot(slot);
                if in_next && next_is_live && !in_older {
                    // No snapshot maps the volume's slot any more.
                    next_page.set_ptr(i, next.private());
                    live_changed = true;
                }
                if !in_older && !in_next {
                    freed.extend(slot.place());
                }
            }
            if live_changed {
                self.map_pages.mark_dirty(&next_page);
            }
        }
        self.snapshots_write().remove(snapshot);
        self.has_snapshots
            .store(!self.snapshots_read().is_empty(), Ordering::Release);
        self.map_pages.forget_owner(snapshot);
        self.forget_namespace(snapshot);
        self.destroyed.lock_or_abort().insert(snapshot);
        Ok(freed)
    }

    /// Rolls `volume` back to `snapshot`, its newest snapshot: writes wait,
    /// the volume's cached data goes to its place (and is then undone with
    /// the rest), its map becomes the snapshot's view again, and the slots
    /// only the volume mapped are freed once the record is durable.
    pub async fn rollback(&self, volume: &Arc<volume::EngineVolume>, snapshot: u32) -> Result<(), PoolError> {
        let id = volume.id();
        {
            let snapshots = self.snapshots_read();
            match snapshots.by_id.get(&snapshot) {
                Some(info) if info.volume == id => {}
                _ => return Err(PoolError::Invalid(format!("no snapshot {snapshot:#x} of volume {id}"))),
            }
            if snapshots.newest(id).map(|(newest, _)| newest) != Some(snapshot) {
                return Err(PoolError::Invalid(
                    "more recent snapshots exist: delete them first".into(),
                ));
            }
        }
        let _barrier = volume.barrier().write().await;
        place_cached(volume, "the rollback").await?;
        let _placement = volume.placement().write().await;
        {
            let _gate = self.gate(id).read().await;
            let _copying = self.page_copy.lock_or_abort();
            let freed = self.apply_rollback(id, snapshot)?;
            self.roll_back_namespace(id, snapshot);
            self.log.append_frees(Record::Rollback { volume: id, snapshot }, freed);
        }
        self.read_cache.invalidate_volume(id);
        let size = crate::block::BlockDevice::size_bytes(volume.as_ref());
        volume.recount_mapped(self.count_volume_blocks(id, size, volume.volblocksize())?);
        // Under the guards: a commit that makes no log room.
        self.commit_holding_placement().await
    }

    /// The work of a rollback (also replayed): every page the snapshot has
    /// a copy of (the pages the volume changed since) becomes the volume's
    /// again, its entries shared; returns the slots to free (those the
    /// volume mapped and the snapshot does not: written after it, so no
    /// snapshot shares them).
    pub(in crate::pool) fn apply_rollback(&self, volume: u32, snapshot: u32) -> Result<Vec<(u8, u64)>, PoolError> {
        let mut freed = Vec::new();
        for index in self.own_pages(snapshot)? {
            let kept = self.map_pages.get(&self.db, (snapshot, index))?;
            let live = self.map_pages.get(&self.db, (volume, index))?;
            for (i, then) in kept.ptrs().into_iter().enumerate().take(live.entries.len()) {
                let now = live.ptr(i);
                if now.is_mapped() && !now.same_slot(then) {
                    // Written after the snapshot: nothing else maps it.
                    assert!(!now.is_shared(), "a shared slot the snapshot does not map");
                    freed.extend(now.place());
                }
                let restored = if then.is_mapped() {
                    then.shared()
                } else {
                    BlockPtr::NONE
                };
                live.set_ptr(i, restored);
            }
            self.map_pages.mark_dirty(&live);
        }
        Ok(freed)
    }
}
