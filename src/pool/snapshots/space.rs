//! Space accounting: each snapshot's `used` and `written`, a volume's
//! `usedbydataset`, `usedbysnapshots` and `written` (as ZFS reports them),
//! counted over the snapshots' own pages, and the figures kept between
//! calls (and checkpoints) while what they depend on cannot change. Its
//! own room because it only reads: no change to a map or the registry
//! starts here, only the forgetting of figures a change invalidates.

use super::*;

/// A snapshot's space figures, kept between calls. Snapshots never change
/// (a snapshot's view is fixed when it is taken), so `written` — what it
/// maps that its older neighbour (or origin) does not — holds until that
/// neighbour changes (a deletion, a promotion). `used` — what only it maps
/// — also depends on its newer neighbour and its clones: it is kept only
/// for a snapshot that has a newer one (the newest's changes with every
/// write to the volume) and no clone (whose writes change it), until a
/// neighbour changes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct CachedSpace {
    pub(super) used: Option<u64>,
    pub(super) written: Option<u64>,
}

/// The kept figures, saved by checkpoints (the `snapshot_space` table) so
/// that a restart does not have to walk every snapshot's pages again.
#[derive(Debug, Default)]
pub(super) struct SpaceFigures {
    pub(super) kept: HashMap<u32, CachedSpace>,
    /// Snapshots whose figures changed since a checkpoint took them.
    pub(super) changed: HashSet<u32>,
    /// What the running (or last) checkpoint took.
    pub(super) in_flight: Vec<u32>,
}

impl SpaceFigures {
    pub(super) fn get(&self, id: u32) -> CachedSpace {
        self.kept.get(&id).copied().unwrap_or_default()
    }

    fn set(&mut self, id: u32, figures: CachedSpace) {
        if self.get(id) == figures {
            return;
        }
        if figures == CachedSpace::default() {
            self.kept.remove(&id);
        } else {
            self.kept.insert(id, figures);
        }
        self.changed.insert(id);
    }

    pub(super) fn clear(&mut self) {
        self.changed.extend(self.kept.keys().copied());
        self.kept.clear();
    }
}

/// A volume's snapshots as the space figures need them (`Pool::chain`).
struct Chain {
    volume: u32,
    /// Oldest first.
    ids: Vec<u32>,
    mapped: Vec<u64>,
    origin: Option<u32>,
    /// The views that see each snapshot through a clone of it.
    dependents: Vec<Vec<u32>>,
    /// The figures kept from before.
    kept: Vec<CachedSpace>,
    /// The registry's version these were read at.
    version: u64,
    /// `Pool::relocations` when these were read.
    relocations: u64,
    /// The lowest sequence number of the volume's cached writes that
    /// belong to a snapshot and are not placed yet (`u64::MAX`: none).
    /// Placing them changes the views of the snapshots taken after them,
    /// so those snapshots' figures (and their neighbours' `used`) are not
    /// kept until then.
    oldest_pending: u64,
    /// Each snapshot's `cache_seq`.
    floors: Vec<u64>,
}

/// A volume's space as ZFS reports it, in blocks (placed data only: writes
/// still in the RAM cache are counted once placed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VolumeSpace {
    /// What the volume maps that no snapshot and no origin does: what
    /// deleting the volume alone would free (`usedbydataset`).
    pub dataset: u64,
    /// What only its snapshots map: what deleting all of them would free
    /// (`usedbysnapshots`).
    pub snapshots: u64,
    /// What it maps that its newest snapshot (or, with none, its origin)
    /// does not (`written`).
    pub written: u64,
}

impl Snapshots {
    /// Forgets the kept space figures of `snapshot` (`used` only, or both).
    pub(super) fn forget_space(&self, snapshot: u32, written_too: bool) {
        let mut space = self.space.lock_or_abort();
        let kept = space.get(snapshot);
        let written = if written_too { None } else { kept.written };
        space.set(snapshot, CachedSpace { used: None, written });
    }
}

impl Pool {
    /// What the space figures of `volume`'s snapshots need from the
    /// registry, read at once (with the figures kept from before).
    fn chain(&self, volume: u32) -> Chain {
        let snapshots = self.snapshots_read();
        let ids: Vec<u32> = snapshots.by_volume.get(&volume).cloned().unwrap_or_default();
        let mapped: Vec<u64> = ids.iter().map(|id| snapshots.by_id[id].mapped_blocks).collect();
        // The views of each snapshot's clones that see its pages.
        let dependents: Vec<Vec<u32>> = ids
            .iter()
            .map(|id| {
                snapshots
                    .clones_of(*id)
                    .into_iter()
                    .map(|clone| snapshots.first_of_chain(clone))
                    .collect()
            })
            .collect();
        let kept = {
            let space = snapshots.space.lock_or_abort();
            ids.iter().map(|id| space.get(*id)).collect()
        };
        let oldest_pending = self.oldest_pending(volume);
        let floors = ids.iter().map(|id| snapshots.by_id[id].cache_seq).collect();
        Chain {
            volume,
            ids,
            mapped,
            origin: snapshots.origin(volume),
            dependents,
            kept,
            version: snapshots.version,
            relocations: self.relocations.load(Ordering::Acquire),
            oldest_pending,
            floors,
        }
    }

    /// Keeps the figures just computed for `chain` (`used` only where it
    /// cannot change without a change of the registry), unless the
    /// registry changed meanwhile.
    fn keep_space(&self, chain: &Chain, figures: &[(Option<u64>, u64)]) {
        let snapshots = self.snapshots_read();
        if snapshots.version != chain.version || self.relocated_since(chain.relocations) {
            return;
        }
        let mut space = snapshots.space.lock_or_abort();
        // A view that pending cached writes will still change (those of
        // snapshots taken after the oldest of them) does not keep figures
        // that depend on it.
        let settled = |k: usize| chain.floors.get(k).is_none_or(|floor| *floor <= chain.oldest_pending);
        for (k, (used, written)) in figures.iter().enumerate() {
            if !settled(k) {
                continue;
            }
            let mut entry = space.get(chain.ids[k]);
            entry.written = Some(*written);
            let lasting = k + 1 < chain.ids.len() && chain.dependents[k].is_empty() && settled(k + 1);
            if lasting && used.is_some() {
                entry.used = *used;
            }
            space.set(chain.ids[k], entry);
        }
    }

    /// The lowest sequence number among `volume`'s pending cache entries
    /// (`u64::MAX`: none).
    fn oldest_pending(&self, volume: u32) -> u64 {
        let cache = self.cache.volume(volume);
        let state = cache.lock();
        if state.pending == 0 {
            return u64::MAX;
        }
        state
            .all_versions()
            .filter(|e| state.is_pending(e))
            .map(|e| e.seq)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The `written` of the `k`th snapshot of `chain`: kept, or counted.
    fn chain_written(&self, chain: &Chain, k: usize) -> Result<u64, MetaError> {
        if let Some(written) = chain.kept[k].written {
            return Ok(written);
        }
        let id = chain.ids[k];
        let older = k.checked_sub(1).map(|i| chain.ids[i]);
        Ok(match (older, chain.origin) {
            (None, None) => chain.mapped[k],
            // It differs from the older one only where that one has
            // copies (the pages changed between them).
            (Some(older), _) => self.count_written(id, older, self.own_pages(older)?)?,
            // From its origin only where the clone has pages of its own.
            (None, Some(origin)) => {
                let mut pages: std::collections::BTreeSet<u64> = self.own_pages(id)?.into_iter().collect();
                pages.extend(self.own_pages(chain.volume)?);
                self.count_written(id, origin, pages)?
            }
        })
    }

    /// The `used` of the `k`th snapshot of `chain`: kept, or counted over
    /// its own pages.
    fn chain_used(&self, chain: &Chain, k: usize) -> Result<u64, MetaError> {
        if let Some(used) = chain.kept[k].used {
            return Ok(used);
        }
        let id = chain.ids[k];
        let older = k.checked_sub(1).map(|i| chain.ids[i]);
        let newer = chain.ids.get(k + 1).copied();
        let mut used = 0;
        for index in self.own_pages(id)? {
            let page = self.map_pages.get(&self.db, (id, index))?;
            let mut others: Vec<Vec<BlockPtr>> = Vec::new();
            match (older, chain.origin) {
                (Some(older), _) => {
                    let older_page = self.map_pages.get(&self.db, (older, index))?;
                    if !older_page.present.load(Ordering::Acquire) {
                        // Deleting would hand this page down, whole.
                        continue;
                    }
                    others.push(older_page.ptrs());
                }
                (None, Some(origin)) => others.push(self.view_entries(origin, index)?),
                (None, None) => {}
            }
            others.push(self.view_entries(newer.unwrap_or(chain.volume), index)?);
            for dependent in &chain.dependents[k] {
                others.push(self.view_entries(*dependent, index)?);
            }
            for (i, slot) in page.ptrs().into_iter().enumerate() {
                if slot.is_mapped() && !others.iter().any(|other| other[i].same_slot(slot)) {
                    used += 1;
                }
            }
        }
        Ok(used)
    }

    /// The space of `volume`'s snapshots, in blocks, oldest first: for each
    /// (id, `used`: what deleting it would free, `written`: what it maps
    /// that the snapshot before it does not — for the oldest, what it maps
    /// that the volume's origin does not, all it maps when the volume is no
    /// clone). A snapshot that clones depend on cannot be deleted; its
    /// `used` counts what it maps that neither neighbour nor a clone does.
    /// Exact when no write to the volume runs meanwhile; a walk of the
    /// snapshots' own pages, no data read — of those whose figures are not
    /// kept from an earlier call (`CachedSpace`): after the first call,
    /// the newest snapshot's pages and those of the snapshots a deletion
    /// gave new neighbours.
    pub fn snapshot_space(&self, volume: u32) -> Result<Vec<(u32, u64, u64)>, MetaError> {
        let chain = self.chain(volume);
        let mut figures = Vec::with_capacity(chain.ids.len());
        for k in 0..chain.ids.len() {
            figures.push((Some(self.chain_used(&chain, k)?), self.chain_written(&chain, k)?));
        }
        self.keep_space(&chain, &figures);
        Ok(chain
            .ids
            .iter()
            .zip(figures)
            .map(|(id, (used, written))| (*id, used.unwrap_or_default(), written))
            .collect())
    }

    /// `volume`'s space: `usedbydataset`, `usedbysnapshots` and `written`
    /// (`VolumeSpace`), in blocks. For a volume with snapshots and no
    /// origin, from the snapshots' `written` (kept between calls) and a
    /// walk of the newest snapshot's own pages: a slot is mapped by a
    /// contiguous run of the chain (oldest snapshot .. volume), so the
    /// slots the snapshots map are counted once each by the `written` of
    /// the snapshot their run starts at, and those the volume maps too are
    /// the ones the newest snapshot shares with it; what the volume maps
    /// that the newest does not is both its `written` and what only it
    /// maps. Otherwise [`Self::volume_space_walk`].
    pub fn volume_space(&self, volume: u32) -> Result<VolumeSpace, MetaError> {
        let chain = self.chain(volume);
        let Some(&newest) = chain.ids.last() else {
            return self.volume_space_walk(volume);
        };
        if chain.origin.is_some() {
            return self.volume_space_walk(volume);
        }
        let mut figures = Vec::with_capacity(chain.ids.len());
        for k in 0..chain.ids.len() {
            figures.push((chain.kept[k].used, self.chain_written(&chain, k)?));
        }
        self.keep_space(&chain, &figures);
        let in_snapshots: u64 = figures.iter().map(|(_, written)| written).sum();
        // Elsewhere the newest snapshot sees the volume's own page.
        let (mut only_live, mut only_newest) = (0, 0);
        for index in self.own_pages(newest)? {
            let live = self.view_entries(volume, index)?;
            let kept = self.map_pages.get(&self.db, (newest, index))?;
            for (slot, theirs) in live.iter().zip(kept.ptrs()) {
                if slot.is_mapped() && !slot.same_slot(theirs) {
                    only_live += 1;
                }
                if theirs.is_mapped() && !slot.same_slot(theirs) {
                    only_newest += 1;
                }
            }
        }
        let shared = chain.mapped[chain.ids.len() - 1].saturating_sub(only_newest);
        Ok(VolumeSpace {
            dataset: only_live,
            snapshots: in_snapshots.saturating_sub(shared),
            written: only_live,
        })
    }

    /// [`Self::volume_space`] by a walk of the volume's and its snapshots'
    /// own map pages (a slot is only ever mapped at one block number, so
    /// each block is compared across them); no data read. For clones,
    /// which share with their origin too, and volumes without snapshots.
    fn volume_space_walk(&self, volume: u32) -> Result<VolumeSpace, MetaError> {
        let (ids, origin) = {
            let snapshots = self.snapshots_read();
            let ids: Vec<u32> = snapshots.by_volume.get(&volume).cloned().unwrap_or_default();
            (ids, snapshots.origin(volume))
        };
        let mut space = VolumeSpace::default();
        let mut pages: std::collections::BTreeSet<u64> = self.own_pages(volume)?.into_iter().collect();
        let mut owned: HashMap<u32, HashSet<u64>> = HashMap::new();
        for id in &ids {
            let own: HashSet<u64> = self.own_pages(*id)?.into_iter().collect();
            pages.extend(own.iter().copied());
            owned.insert(*id, own);
        }
        let newest = ids.last().copied();
        for index in pages {
            let live = self.view_entries(volume, index)?;
            let base = match origin {
                Some(origin) => Some(self.view_entries(origin, index)?),
                None => None,
            };
            // The slots the snapshots map here that the volume does not.
            let mut copies = Vec::new();
            for id in &ids {
                if owned[id].contains(&index) {
                    copies.push(self.map_pages.get(&self.db, (*id, index))?);
                }
            }
            // The newest snapshot sees the volume's page itself when it has
            // no copy of it: then every block of it is shared.
            let newest_sees_live = newest.is_some_and(|id| !owned[&id].contains(&index));
            let newest_entries: Option<Vec<BlockPtr>> = match newest {
                Some(id) => Some(self.view_entries(id, index)?),
                None => base.clone(),
            };
            // A clone's page it has none of is its origin's.
            let own_page = origin.is_none()
                || self
                    .map_pages
                    .get(&self.db, (volume, index))?
                    .present
                    .load(Ordering::Acquire);
            for (i, &slot) in live.iter().enumerate() {
                let in_base = base.as_ref().is_some_and(|b| b[i].same_slot(slot));
                let in_snapshots = copies.iter().any(|c| c.ptr(i).same_slot(slot));
                if slot.is_mapped() && own_page && !newest_sees_live && !in_base && !in_snapshots {
                    space.dataset += 1;
                }
                if slot.is_mapped() && !newest_entries.as_ref().is_some_and(|n| n[i].same_slot(slot)) {
                    space.written += 1;
                }
                let mut counted: Vec<BlockPtr> = Vec::new();
                for copy in &copies {
                    let theirs = copy.ptr(i);
                    if !theirs.is_mapped()
                        || theirs.same_slot(slot)
                        || base.as_ref().is_some_and(|b| b[i].same_slot(theirs))
                        || counted.iter().any(|c| c.same_slot(theirs))
                    {
                        continue;
                    }
                    counted.push(theirs);
                    space.snapshots += 1;
                }
            }
        }
        Ok(space)
    }

    /// The blocks `view` maps differently from `base` in map pages `pages`.
    fn count_written(&self, view: u32, base: u32, pages: impl IntoIterator<Item = u64>) -> Result<u64, MetaError> {
        let mut written = 0;
        for index in pages {
            let before = self.view_entries(base, index)?;
            let after = self.view_entries(view, index)?;
            written += after
                .iter()
                .zip(&before)
                .filter(|(a, b)| a.is_mapped() && !a.same_slot(**b))
                .count() as u64;
        }
        Ok(written)
    }
}
