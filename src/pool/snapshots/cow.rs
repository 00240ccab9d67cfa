//! Copy-on-write of map pages: before the first change to a volume's map
//! page shared with a snapshot, the page is copied into that snapshot and
//! its entries marked shared (`CopyPage`); a clone first makes a page it
//! sees through its origin its own (`ClonePage`). The copies themselves
//! are here too, because replay and promotion make them the same way.

use super::*;

impl Pool {
    /// Before block `block` of `volume` changes: if its map page is shared
    /// with the snapshot the change comes after, copies it into that
    /// snapshot and marks the page's entries shared. That snapshot is the
    /// newest (`written_at: None`: a change made now, by a caller holding
    /// the volume's barrier, so no snapshot is being taken) or, for cached
    /// data being placed, the newest one taken before the data was written
    /// (`Some(seq)`: possibly an older one; snapshots taken since see the
    /// change through the volume's page, as they must). Caller holds the
    /// write gate (so a checkpoint sees the copy and the record together).
    ///
    /// A clone first makes a page it sees through its origin its own: a
    /// copy of the origin's view, every valid entry shared (a `ClonePage`
    /// record).
    /// Whether [`Pool::ensure_private`] would copy the map page of `block`
    /// into a snapshot now (making its entries shared). A hint for what a
    /// write will overwrite in place, taken before the write's gate.
    pub(in crate::pool) fn page_will_be_copied(
        &self,
        volume: u32,
        block: u64,
        written_at: Option<u64>,
    ) -> Result<bool, MetaError> {
        if !self.has_snapshots.load(Ordering::Acquire) {
            return Ok(false);
        }
        let generation = {
            let snapshots = self.snapshots_read();
            let target = match written_at {
                None => snapshots.newest(volume),
                Some(seq) => snapshots.taken_before(volume, seq),
            };
            match target {
                Some((_, generation)) => generation,
                None => return Ok(false),
            }
        };
        Ok(self.map_page(volume, block)?.birth.load(Ordering::Acquire) < generation)
    }

    pub(in crate::pool) fn ensure_private(
        &self,
        volume: u32,
        block: u64,
        written_at: Option<u64>,
    ) -> Result<(), MetaError> {
        if !self.has_snapshots.load(Ordering::Acquire) {
            return Ok(());
        }
        let (newest, origin) = {
            let snapshots = self.snapshots_read();
            let target = match written_at {
                None => snapshots.newest(volume),
                Some(seq) => snapshots.taken_before(volume, seq),
            };
            (
                target.map(|(id, generation)| (id, generation, snapshots.by_id[&id].cache_seq)),
                snapshots.origin(volume),
            )
        };
        let page = self.map_page(volume, block)?;
        let index = block / MAP_ENTRIES_PER_PAGE;
        // In both copies below the record is appended before the copy is
        // made visible: a write to another block of the page that finds
        // it copied (and so copies nothing) logs its mapping after the
        // record, so replay copies the page as it was before that write.
        // The other way round, such a write could log its mapping first
        // and replay would copy its new block into the snapshot (or, for
        // a clone, find the page present and skip the origin's entries).
        if let Some(origin) = origin {
            if !page.present.load(Ordering::Acquire) {
                let _copying = self.page_copy.lock_or_abort();
                if !page.present.load(Ordering::Acquire) {
                    let entries = self.view_entries(origin, index)?;
                    self.log.append(Record::ClonePage { volume, page: index });
                    #[cfg(test)]
                    self.pause_in_page_copy();
                    self.clone_page_into(&page, &entries);
                }
            }
        }
        let Some((snapshot, generation, cache_seq)) = newest else {
            return Ok(());
        };
        if page.birth.load(Ordering::Acquire) >= generation {
            return Ok(());
        }
        let _copying = self.page_copy.lock_or_abort();
        if page.birth.load(Ordering::Acquire) >= generation {
            return Ok(());
        }
        // What the cache holds of this page from before the snapshot must
        // be in the copy: placed first (`EngineVolume::destage_blocks`).
        // Checked here, where a mistake would make the snapshot lose it.
        {
            let cache = self.cache.volume(volume);
            let state = cache.lock();
            let sectors = MAP_ENTRIES_PER_PAGE * state.block_bytes / crate::pool::ram::SLOT_BYTES as u64;
            let first = index * sectors;
            if state
                .versions(first, first + sectors - 1)
                .iter()
                .any(|(_, e)| e.seq < cache_seq && !e.placed)
            {
                return Err(MetaError::Corrupt(format!(
                    "map page {index} of volume {volume} would be copied into snapshot {snapshot:#x} \
                     before the cached writes it holds from before that snapshot are placed"
                )));
            }
        }
        // Born at the snapshot's generation, not the pool's: a snapshot
        // taken meanwhile must still see this page change.
        self.log.append(Record::CopyPage {
            volume,
            page: index,
            snapshot,
            generation,
        });
        #[cfg(test)]
        self.pause_in_page_copy();
        self.copy_page_into(&page, index, snapshot, generation);
        Ok(())
    }

    #[cfg(test)]
    fn pause_in_page_copy(&self) {
        let pause = self.page_copy_pause.lock_or_abort().take();
        if let Some(pause) = pause {
            pause();
        }
    }

    /// The copy itself (also replayed): the snapshot gets the page as it is,
    /// the volume's valid entries become shared, and its page is born now.
    /// The snapshot's page is installed before the volume's changes, so a
    /// reader of the snapshot that saw a change also sees the copy.
    pub(super) fn copy_page_into(&self, page: &MapPage, index: u64, snapshot: u32, generation: u64) {
        let copy = self
            .map_pages
            .put((snapshot, index), MapPage::copied(&page.entries, generation));
        self.map_pages.mark_dirty(&copy);
        {
            let snapshots = self.snapshots_read();
            if let Some(info) = snapshots.by_id.get(&snapshot) {
                let mut copies = snapshots.copies.lock_or_abort();
                copies.bump(info.volume);
                if let Some(owners) = copies
                    .pages
                    .get_mut(&info.volume)
                    .and_then(|pages| pages.get_mut(&index))
                {
                    owners.insert(info.generation);
                }
            }
        }
        page.share_all();
        page.birth.store(generation, Ordering::Release);
        self.map_pages.mark_dirty(page);
    }

    /// A clone's page made its own (also replayed): `entries`, its
    /// origin's view of the page, every valid entry shared with the origin. Born at 0, that
    /// is before any snapshot of the clone (which saw the origin's view
    /// there, and gets a copy before the page changes). The entries are
    /// filled in place before the page says it is present, so a reader
    /// that sees it present sees them.
    pub(super) fn clone_page_into(&self, page: &MapPage, entries: &[BlockPtr]) {
        for (i, &ptr) in entries.iter().enumerate().take(page.entries.len()) {
            let shared = if ptr.is_mapped() { ptr.shared() } else { BlockPtr::NONE };
            page.set_ptr(i, shared);
        }
        page.birth.store(0, Ordering::Release);
        page.present.store(true, Ordering::Release);
        self.map_pages.mark_dirty(page);
    }
}
