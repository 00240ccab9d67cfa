//! Clones: volumes that start as a snapshot's view and share its blocks
//! until they change them, and their promotion (`zfs promote`), which
//! moves the origin snapshot and the older ones to the clone. Together
//! because a promotion rearranges exactly what a clone set up: the
//! origins and the chains of snapshots.

use super::*;

impl Pool {
    /// Makes volume `volume` (a new id, no blocks yet) a clone of
    /// `origin`: it sees the snapshot's blocks and shares them until it
    /// changes them. One record; nothing is copied.
    pub async fn create_clone(&self, volume: u32, origin: u32) -> Result<(), PoolError> {
        if is_snapshot_id(volume) {
            return Err(PoolError::Invalid(format!("{volume:#x} is not a volume id")));
        }
        // The clone sees the origin's view: complete it first.
        if let Some(info) = self.snapshot(origin) {
            self.place_before(info.volume, info.cache_seq).await?;
        }
        {
            let _gate = self.gate(volume).read().await;
            let snapshots = self.snapshots_read();
            if !snapshots.by_id.contains_key(&origin) {
                return Err(PoolError::Invalid(format!("no snapshot {origin:#x}")));
            }
            if snapshots.origins.contains_key(&volume) || snapshots.by_volume.contains_key(&volume) {
                return Err(PoolError::Invalid(format!("volume {volume} exists")));
            }
            drop(snapshots);
            let _copying = self.page_copy.lock_or_abort();
            self.apply_clone(volume, origin);
            // A clone of a file dataset's snapshot starts with its files.
            self.copy_namespace(origin, volume);
            self.log.append(Record::Clone { volume, origin });
        }
        self.commit().await
    }

    /// The clones' volume ids and origins.
    pub fn clones(&self) -> Vec<(u32, u32)> {
        let mut clones: Vec<(u32, u32)> = self.snapshots_read().origins.iter().map(|(v, o)| (*v, *o)).collect();
        clones.sort_unstable();
        clones
    }

    /// The snapshot `volume` was cloned from, if it is a clone.
    pub fn origin_of(&self, volume: u32) -> Option<u32> {
        self.snapshots_read().origin(volume)
    }

    /// Replays a `Clone` record (and does its work).
    pub(in crate::pool) fn apply_clone(&self, volume: u32, origin: u32) {
        let mut snapshots = self.snapshots_write();
        snapshots.origins.insert(volume, origin);
        // The origin's `used` now leaves out what the clone maps.
        snapshots.forget_space(origin, false);
        snapshots.bump();
    }

    /// A destroyed volume is no clone any more.
    pub(in crate::pool) fn forget_origin(&self, volume: u32) {
        let mut snapshots = self.snapshots_write();
        snapshots.copies.lock_or_abort().forget(volume);
        if let Some(origin) = snapshots.origins.remove(&volume) {
            snapshots.forget_space(origin, false);
            snapshots.bump();
        }
    }

    /// Promotes clone `clone`: it stops depending on its origin snapshot,
    /// which (with the older snapshots of the origin's volume) becomes the
    /// clone's, while that volume becomes a clone of it — `zfs promote`.
    /// After it, the old origin volume can be deleted (its snapshots that
    /// stayed with it first) and the clone keeps every block. No data is
    /// copied; map pages are, where a view would otherwise change: the
    /// origin snapshot gets its own copy of every page it saw through its
    /// newer neighbour, and the clone of every page it saw through the
    /// origin. Writes to both volumes wait meanwhile.
    pub async fn promote(
        &self,
        clone: &Arc<volume::EngineVolume>,
        origin_volume: &Arc<volume::EngineVolume>,
    ) -> Result<(), PoolError> {
        let id = clone.id();
        let origin = {
            let snapshots = self.snapshots_read();
            let Some(origin) = snapshots.origin(id) else {
                return Err(PoolError::Invalid("the volume is not a clone".into()));
            };
            if snapshots.by_id[&origin].volume != origin_volume.id() {
                return Err(PoolError::Invalid("the origin snapshot is not of that volume".into()));
            }
            let moving = self.moving_snapshots(&snapshots, origin);
            let names: HashSet<&str> = snapshots
                .by_volume
                .get(&id)
                .map(|list| list.iter().map(|s| snapshots.by_id[s].name.as_str()).collect())
                .unwrap_or_default();
            if let Some(taken) = moving.iter().find(|s| names.contains(snapshots.by_id[s].name.as_str())) {
                return Err(PoolError::Invalid(format!(
                    "the clone has a snapshot named '{}' like one it would take over: rename or delete it first",
                    snapshots.by_id[taken].name
                )));
            }
            origin
        };
        // Both volumes' writes stop (in id order); their cached data goes
        // to its place, so every change is in the maps.
        let (first, second) = if id < origin_volume.id() {
            (clone, origin_volume)
        } else {
            (origin_volume, clone)
        };
        let _first = first.barrier().write().await;
        let _second = second.barrier().write().await;
        place_cached(clone, "the promotion").await?;
        place_cached(origin_volume, "the promotion").await?;
        let _first_placement = first.placement().write().await;
        let _second_placement = second.placement().write().await;
        {
            let _gate = self.gate(id).read().await;
            let _copying = self.page_copy.lock_or_abort();
            self.apply_promote(id, origin)?;
            self.log.append(Record::Promote { volume: id, origin });
        }
        self.refresh_floor(id);
        self.refresh_floor(origin_volume.id());
        self.read_cache.invalidate_volume(id);
        self.read_cache.invalidate_volume(origin_volume.id());
        // Under the guards: a commit that makes no log room.
        self.commit_holding_placement().await
    }

    /// The snapshots a promotion moves: the origin and the older ones of
    /// its volume, oldest first.
    fn moving_snapshots(&self, snapshots: &Snapshots, origin: u32) -> Vec<u32> {
        let (list, at) = snapshots.position(origin).expect("a snapshot is in its volume's list");
        list[..=at].to_vec()
    }

    /// The work of a promotion (also replayed; nothing to do if the
    /// checkpoint already holds it).
    pub(in crate::pool) fn apply_promote(&self, clone: u32, origin: u32) -> Result<(), PoolError> {
        let (old_volume, moving, staying, clone_snapshots, origin_generation, grand_origin) = {
            let snapshots = self.snapshots_read();
            if snapshots.origin(clone) != Some(origin) {
                return Ok(());
            }
            let info = &snapshots.by_id[&origin];
            let moving = self.moving_snapshots(&snapshots, origin);
            let staying: Vec<u32> = snapshots.by_volume[&info.volume][moving.len()..].to_vec();
            let clone_snapshots = snapshots.by_volume.get(&clone).cloned().unwrap_or_default();
            (
                info.volume,
                moving,
                staying,
                clone_snapshots,
                info.generation,
                snapshots.origin(info.volume),
            )
        };
        // Every page whose view may change: where the origin's newer
        // neighbours, the old volume or the clone have pages. Elsewhere all
        // of them see the old volume's origin (or nothing).
        let mut pages: std::collections::BTreeSet<u64> = std::collections::BTreeSet::new();
        for owner in std::iter::once(origin)
            .chain(staying.iter().copied())
            .chain([old_volume, clone])
        {
            pages.extend(self.own_pages(owner)?);
        }
        let now = self.snapshots_read().generation;
        for &index in &pages {
            let view = self.view_entries(origin, index)?;
            let kept = self.map_pages.get(&self.db, (origin, index))?;
            if !kept.present.load(Ordering::Acquire) {
                let copy = self.map_pages.put((origin, index), MapPage::of_ptrs(&view, now));
                self.map_pages.mark_dirty(&copy);
            }
            let page = self.map_pages.get(&self.db, (clone, index))?;
            if !page.present.load(Ordering::Acquire) {
                self.clone_page_into(&page, &view);
            }
        }
        // The origin now has its own copy of each of the clone's pages: a
        // page born before it is born at it (its birth still comes before
        // the clone's own snapshots, which see it through the clone), so
        // that the origin, once the clone's newest, gets no copy over its
        // own.
        for index in self.own_pages(clone)? {
            let page = self.map_pages.get(&self.db, (clone, index))?;
            if page.birth.load(Ordering::Acquire) < origin_generation {
                page.birth.store(origin_generation, Ordering::Release);
                self.map_pages.mark_dirty(&page);
            }
        }
        // The old volume's pages born before the origin were shared with
        // it whole; the volume now sees the origin as a clone does, and
        // shares with it by entry (its own newer snapshots, if any, still
        // see those pages through it: their births stay).
        for index in self.own_pages(old_volume)? {
            let page = self.map_pages.get(&self.db, (old_volume, index))?;
            if page.birth.load(Ordering::Acquire) < origin_generation {
                page.share_all();
                self.map_pages.mark_dirty(&page);
            }
        }
        let mut snapshots = self.snapshots_write();
        for id in &moving {
            if let Some(info) = snapshots.by_id.get_mut(id) {
                info.volume = clone;
            }
        }
        snapshots.changed.extend(moving.iter().copied());
        // Chains and origins change: every kept space figure goes, and
        // what is known of both volumes' copies.
        snapshots.space.lock_or_abort().clear();
        {
            let mut copies = snapshots.copies.lock_or_abort();
            copies.forget(clone);
            copies.forget(old_volume);
        }
        let mut chain = moving;
        chain.extend(clone_snapshots);
        snapshots.by_volume.insert(clone, chain);
        if staying.is_empty() {
            snapshots.by_volume.remove(&old_volume);
        } else {
            snapshots.by_volume.insert(old_volume, staying);
        }
        snapshots.origins.remove(&clone);
        if let Some(grand) = grand_origin {
            snapshots.origins.insert(clone, grand);
        }
        snapshots.origins.insert(old_volume, origin);
        snapshots.bump();
        Ok(())
    }
}
