//! Views: what a snapshot or a clone sees at a map page (its own copy, else
//! its newer neighbour's view, else its origin's), the pages an owner has
//! of its own, and the pages a walk of a view must go through. Read-only:
//! what changes the pages is in `cow.rs`. Every other room (deletion,
//! space, clones, the block map's reads) goes through these lookups.

use super::*;

impl Pool {
    /// The entries `owner` (a snapshot or a volume) sees at map page
    /// `index` (a consistent copy: see `read_view`).
    pub(in crate::pool) fn view_entries(&self, owner: u32, index: u64) -> Result<Vec<BlockPtr>, MetaError> {
        self.read_view(owner, index, |page| page.ptrs())
    }

    /// The map page `owner` sees at `index`: its own (a snapshot's copy, a
    /// volume's page); else a snapshot sees its newer neighbour's view (the
    /// next snapshot's copy, or the volume's page) and a clone its origin's
    /// view; a volume that is no clone sees its own (empty) page.
    pub(in crate::pool) fn view_page(&self, owner: u32, index: u64) -> Result<Arc<MapPage>, MetaError> {
        let first = owner;
        let mut owner = owner;
        // Each step reaches another owner (a newer snapshot, the volume, a
        // clone's origin): more steps than there are snapshots and clones
        // is a cycle that damaged `snapshots` or `clones` rows made.
        let steps = {
            let snapshots = self.snapshots_read();
            snapshots.by_id.len() + snapshots.origins.len() + 2
        };
        for _ in 0..steps {
            let page = self.map_pages.get(&self.db, (owner, index))?;
            if page.present.load(Ordering::Acquire) {
                return Ok(page);
            }
            owner = if is_snapshot_id(owner) {
                match self.newer_view(owner, index)? {
                    Some(next) => next,
                    None => return Ok(page),
                }
            } else {
                match self.snapshots_read().origin(owner) {
                    Some(origin) => origin,
                    None => return Ok(page),
                }
            };
        }
        Err(MetaError::Corrupt(format!(
            "tables snapshots and clones: the views of map page {index} of {first:#x} form a cycle"
        )))
    }

    /// What `snapshot`'s newer neighbour (the oldest newer snapshot with a
    /// copy of map page `index`, else the volume) sees there: the entries
    /// of `snapshot`'s own copy equal to these are shared with it, not
    /// `snapshot`'s alone. `None` if `snapshot` does not exist.
    pub(in crate::pool) fn newer_view_entries(
        &self,
        snapshot: u32,
        index: u64,
    ) -> Result<Option<Vec<BlockPtr>>, MetaError> {
        match self.newer_view(snapshot, index)? {
            Some(owner) => Ok(Some(self.view_entries(owner, index)?)),
            None => Ok(None),
        }
    }

    /// Where `snapshot`, which has no copy of map page `index`, sees it:
    /// the oldest newer snapshot of its volume that has a copy, else the
    /// volume (`None`: no such snapshot). From [`Copies`], learning the
    /// page's set first if need be; the next newer snapshot if the set
    /// could not be learnt (it changed meanwhile).
    fn newer_view(&self, snapshot: u32, index: u64) -> Result<Option<u32>, MetaError> {
        for _ in 0..2 {
            {
                let snapshots = self.snapshots_read();
                let Some(info) = snapshots.by_id.get(&snapshot) else {
                    return Ok(None);
                };
                let copies = snapshots.copies.lock_or_abort();
                if let Some(owners) = copies.pages.get(&info.volume).and_then(|pages| pages.get(&index)) {
                    let Some(&generation) = owners.range(info.generation + 1..).next() else {
                        return Ok(Some(info.volume));
                    };
                    let list = &snapshots.by_volume[&info.volume];
                    let at = list.partition_point(|id| snapshots.by_id[id].generation < generation);
                    if let Some(&id) = list.get(at) {
                        if snapshots.by_id[&id].generation == generation {
                            return Ok(Some(id));
                        }
                    }
                    // Not reached: the set names snapshots of the volume.
                    debug_assert!(false, "page {index} of {:#x}: no snapshot at {generation}", info.volume);
                    break;
                }
            }
            if !self.learn_copies(snapshot, index)? {
                break;
            }
        }
        let snapshots = self.snapshots_read();
        Ok(match snapshots.neighbours(snapshot) {
            (_, Some(newer)) => Some(newer),
            (_, None) => snapshots.by_id.get(&snapshot).map(|info| info.volume),
        })
    }

    /// Learns which snapshots of `snapshot`'s volume have a copy of map
    /// page `index` (one look per snapshot, in the cache, then in the
    /// store); false if it changed meanwhile (not kept then).
    fn learn_copies(&self, snapshot: u32, index: u64) -> Result<bool, MetaError> {
        let (volume, chain, epoch) = {
            let snapshots = self.snapshots_read();
            let Some(info) = snapshots.by_id.get(&snapshot) else {
                return Ok(false);
            };
            let chain: Vec<(u32, u64)> = snapshots.by_volume[&info.volume]
                .iter()
                .map(|id| (*id, snapshots.by_id[id].generation))
                .collect();
            let epoch = snapshots.copies.lock_or_abort().epoch(info.volume);
            (info.volume, chain, epoch)
        };
        // The cache first, then the store: a page evicted from the cache
        // after it was looked at there was written to the store before
        // (a dirty page is never evicted), so a read of the store begun
        // after every look at the cache finds it.
        let mut has: Vec<Option<bool>> = chain
            .iter()
            .map(|(id, _)| {
                self.map_pages
                    .peek((*id, index))
                    .map(|page| page.present.load(Ordering::Acquire))
            })
            .collect();
        store::guarded(format_args!("table map_pages key ({volume}, {index})"), || {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(MAP_PAGES)?;
            for ((id, _), known) in chain.iter().zip(has.iter_mut()) {
                if known.is_none() {
                    *known = Some(table.get((*id, index))?.is_some());
                }
            }
            Ok::<(), MetaError>(())
        })?;
        let owners: std::collections::BTreeSet<u64> = chain
            .iter()
            .zip(&has)
            .filter(|(_, has)| **has == Some(true))
            .map(|((_, generation), _)| *generation)
            .collect();
        let snapshots = self.snapshots_read();
        let mut copies = snapshots.copies.lock_or_abort();
        if copies.epoch(volume) != epoch {
            return Ok(false);
        }
        copies.pages.entry(volume).or_default().insert(index, owners);
        Ok(true)
    }

    /// The map pages `owner` has: a snapshot's copies, a volume's pages
    /// (stored, or made since). A range of the store and the cache's
    /// index of the owner's pages (a page made since the last checkpoint is
    /// dirty, or being written by a checkpoint, and stays cached till
    /// then): the work is the owner's pages, whatever else the pool holds.
    pub(in crate::pool) fn own_pages(&self, owner: u32) -> Result<Vec<u64>, MetaError> {
        let mut pages: std::collections::BTreeSet<u64> = std::collections::BTreeSet::new();
        store::guarded(format_args!("table map_pages pages of {owner}"), || {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(MAP_PAGES)?;
            for row in table.range((owner, 0)..=(owner, u64::MAX))? {
                let (key, _) = row?;
                pages.insert(key.value().1);
            }
            Ok::<(), MetaError>(())
        })?;
        for index in self.map_pages.keys_of(owner) {
            if !pages.contains(&index)
                && self
                    .map_pages
                    .get(&self.db, (owner, index))?
                    .present
                    .load(Ordering::Acquire)
            {
                pages.insert(index);
            }
        }
        Ok(pages.into_iter().collect())
    }

    /// [`Pool::own_pages`] a window at a time: `owner`'s page indexes from
    /// `from` on, at most `max` of each source (the store, the cache), and
    /// where the next window starts (`None`: none left). What the
    /// migrator's walk holds of the page list is then bounded by `max`.
    pub(in crate::pool) fn own_pages_from(
        &self,
        owner: u32,
        from: u64,
        max: usize,
    ) -> Result<(Vec<u64>, Option<u64>), MetaError> {
        let mut stored: Vec<u64> = Vec::new();
        store::guarded(format_args!("table map_pages pages of {owner}"), || {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(MAP_PAGES)?;
            for row in table.range((owner, from)..=(owner, u64::MAX))?.take(max) {
                let (key, _) = row?;
                stored.push(key.value().1);
            }
            Ok::<(), MetaError>(())
        })?;
        let cached = self.map_pages.keys_of_from(owner, from, max);
        // A source cut at `max` is complete only up to its last index.
        let last = [&stored, &cached]
            .into_iter()
            .filter(|source| source.len() >= max)
            .filter_map(|source| source.last().copied())
            .min();
        let within = |index: &u64| last.is_none_or(|last| *index <= last);
        let mut pages: std::collections::BTreeSet<u64> = stored.into_iter().filter(within).collect();
        for index in cached.into_iter().filter(within) {
            if !pages.contains(&index)
                && self
                    .map_pages
                    .get(&self.db, (owner, index))?
                    .present
                    .load(Ordering::Acquire)
            {
                pages.insert(index);
            }
        }
        Ok((pages.into_iter().collect(), last.map(|last| last + 1)))
    }

    /// The blocks volume `volume` maps, looked up through its view (a
    /// clone sees its origin's where it has no page of its own).
    pub(in crate::pool) fn count_view_blocks(
        &self,
        volume: u32,
        size_bytes: u64,
        volblocksize: u32,
    ) -> Result<u64, MetaError> {
        let blocks = size_bytes.div_ceil(volblocksize as u64);
        let mut mapped = 0;
        for index in self.view_page_indexes(volume, blocks)? {
            mapped += self
                .view_entries(volume, index)?
                .iter()
                .filter(|e| e.is_mapped())
                .count() as u64;
        }
        Ok(mapped)
    }

    /// The map page indexes (of the first `blocks` blocks) where volume
    /// `volume`'s view can map anything, in order: every walk of a view
    /// goes through these rather than through every index of its size (a
    /// file dataset's engine object is so large that such a walk would
    /// never end). Only pages someone in its ancestry has can map
    /// anything: its own, and those of each origin's volume and that
    /// volume's snapshots, up the chain of origins.
    pub(in crate::pool) fn view_page_indexes(&self, volume: u32, blocks: u64) -> Result<Vec<u64>, MetaError> {
        let pages = blocks.div_ceil(MAP_ENTRIES_PER_PAGE);
        let owners = self.view_owners(volume);
        let mut indexes = std::collections::BTreeSet::new();
        for owner in owners {
            indexes.extend(self.own_pages(owner)?.into_iter().filter(|index| *index < pages));
        }
        Ok(indexes.into_iter().collect())
    }

    /// Whose pages can map something in volume `volume`'s view: itself,
    /// and each origin's volume with that volume's snapshots, up the chain
    /// of origins.
    fn view_owners(&self, volume: u32) -> Vec<u32> {
        let mut owners = vec![volume];
        let mut next = self.origin_of(volume);
        while let Some(origin) = next.filter(|o| !owners.contains(o)) {
            let Some(info) = self.snapshot(origin) else { break };
            owners.push(info.volume);
            owners.extend(self.snapshots_of(info.volume).into_iter().map(|s| s.id));
            next = self.origin_of(info.volume);
        }
        owners
    }

    /// [`Pool::view_page_indexes`] a window at a time (`own_pages_from`):
    /// the indexes from `from` on, and where the next window starts.
    pub(in crate::pool) fn view_page_indexes_from(
        &self,
        volume: u32,
        blocks: u64,
        from: u64,
        max: usize,
    ) -> Result<(Vec<u64>, Option<u64>), MetaError> {
        let pages = blocks.div_ceil(MAP_ENTRIES_PER_PAGE);
        let owners = self.view_owners(volume);
        let mut indexes = std::collections::BTreeSet::new();
        let mut resume: Option<u64> = None;
        for owner in owners {
            let (own, more) = self.own_pages_from(owner, from, max)?;
            indexes.extend(own);
            if let Some(more) = more {
                resume = Some(resume.map_or(more, |r| r.min(more)));
            }
        }
        let resume = resume.filter(|r| *r < pages);
        let end = resume.unwrap_or(pages).min(pages);
        Ok((indexes.into_iter().filter(|index| *index < end).collect(), resume))
    }
}
