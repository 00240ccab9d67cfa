//! Snapshots: read-only images of volumes, taken at one consistency point,
//! that share every block with the volume until the volume changes it.
//!
//! The design (ARCHITECTURE.md, "Snapshots"): sharing is tracked per map
//! page, lazily. Taking a snapshot only records it and bumps the pool's
//! snapshot generation — no map walk. A volume's map page born before its
//! newest snapshot is shared with that snapshot; before the first change to
//! it, it is copied into the snapshot (`ensure_private`, a `CopyPage`
//! record) and every valid entry of the volume's page is marked `SHARED`. A
//! write to a shared entry goes to a new slot and leaves the old one to the
//! snapshot; unshared entries are overwritten in place as before. A
//! snapshot without a copy of a page sees its newer neighbour's (the next
//! snapshot's copy, or the volume's page): nothing changed there in
//! between. Deleting a snapshot hands its pages to its older neighbour
//! where that one has none, and frees the slots that neither neighbour
//! maps.

use super::*;
use crate::meta::log::{SnapshotEntry, MAX_SNAPSHOTS_PER_RECORD, MAX_SNAPSHOT_NAME};
use crate::meta::store::SNAPSHOTS;
use std::collections::HashMap;

/// Snapshot ids have the high bit set: apart from volume ids, which the
/// control plane gives out from 1.
pub const SNAPSHOT_ID_BASE: u32 = 0x8000_0000;

pub fn is_snapshot_id(id: u32) -> bool {
    id & SNAPSHOT_ID_BASE != 0
}

/// What the pool knows of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotInfo {
    pub id: u32,
    pub volume: u32,
    pub name: String,
    /// The pool's snapshot generation it was taken at.
    pub generation: u64,
    pub created_unix: u64,
    /// The volume's mapped blocks and size when it was taken.
    pub mapped_blocks: u64,
    pub size_bytes: u64,
}

impl SnapshotInfo {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(36 + self.name.len());
        out.extend_from_slice(&self.volume.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.created_unix.to_le_bytes());
        out.extend_from_slice(&self.mapped_blocks.to_le_bytes());
        out.extend_from_slice(&self.size_bytes.to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out
    }

    fn decode(id: u32, bytes: &[u8]) -> Result<Self, MetaError> {
        let corrupt = || MetaError::Corrupt(format!("snapshot record {id:#x} ({} bytes)", bytes.len()));
        let name = bytes.get(36..).ok_or_else(corrupt)?;
        if name.len() > MAX_SNAPSHOT_NAME {
            return Err(corrupt());
        }
        Ok(SnapshotInfo {
            id,
            volume: crate::bytes::u32_at(bytes, 0).ok_or_else(corrupt)?,
            generation: crate::bytes::u64_at(bytes, 4).ok_or_else(corrupt)?,
            created_unix: crate::bytes::u64_at(bytes, 12).ok_or_else(corrupt)?,
            mapped_blocks: crate::bytes::u64_at(bytes, 20).ok_or_else(corrupt)?,
            size_bytes: crate::bytes::u64_at(bytes, 28).ok_or_else(corrupt)?,
            name: std::str::from_utf8(name).map_err(|_| corrupt())?.to_string(),
        })
    }
}

/// The pool's snapshots (persisted by the checkpoint, changed by the log).
#[derive(Debug, Default)]
pub(crate) struct Snapshots {
    by_id: HashMap<u32, SnapshotInfo>,
    /// Each volume's snapshots, oldest first.
    by_volume: HashMap<u32, Vec<u32>>,
    /// The last snapshot generation given out.
    generation: u64,
    /// The next snapshot id's low bits.
    next_id: u32,
    /// Changed since the last checkpoint.
    dirty: bool,
}

impl Snapshots {
    /// The newest snapshot of `volume`: (id, generation).
    fn newest(&self, volume: u32) -> Option<(u32, u64)> {
        let id = *self.by_volume.get(&volume)?.last()?;
        Some((id, self.by_id[&id].generation))
    }

    /// The snapshots of the same volume just older and just newer than
    /// `snapshot` (`None`: none older; none newer, i.e. the volume itself).
    fn neighbours(&self, snapshot: u32) -> (Option<u32>, Option<u32>) {
        let Some(info) = self.by_id.get(&snapshot) else {
            return (None, None);
        };
        let list = &self.by_volume[&info.volume];
        let at = list
            .iter()
            .position(|id| *id == snapshot)
            .expect("a snapshot is in its volume's list");
        (at.checked_sub(1).map(|i| list[i]), list.get(at + 1).copied())
    }

    fn insert(&mut self, info: SnapshotInfo) {
        self.next_id = self.next_id.max((info.id & !SNAPSHOT_ID_BASE) + 1);
        self.generation = self.generation.max(info.generation);
        // Oldest first. New snapshots and the store's rows (by id, given out
        // in creation order) arrive in order: a push, not a sort per insert,
        // so opening a pool with thousands of snapshots stays linear.
        let list = self.by_volume.entry(info.volume).or_default();
        let by_id = &self.by_id;
        let at = list.partition_point(|id| by_id[id].generation <= info.generation);
        list.insert(at, info.id);
        self.by_id.insert(info.id, info);
        self.dirty = true;
    }

    fn remove(&mut self, snapshot: u32) -> Option<SnapshotInfo> {
        let info = self.by_id.remove(&snapshot)?;
        if let Some(list) = self.by_volume.get_mut(&info.volume) {
            list.retain(|id| *id != snapshot);
            if list.is_empty() {
                self.by_volume.remove(&info.volume);
            }
        }
        self.dirty = true;
        Some(info)
    }

    pub(crate) fn has_volume(&self, volume: u32) -> bool {
        self.by_volume.contains_key(&volume)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// Loads the pool's snapshots from the metadata store.
pub(super) fn load(db: &redb::Database) -> Result<Snapshots, MetaError> {
    let mut snapshots = Snapshots::default();
    let txn = db.begin_read()?;
    let table = txn.open_table(SNAPSHOTS)?;
    for row in table.iter()? {
        let (id, value) = row?;
        snapshots.insert(SnapshotInfo::decode(id.value(), value.value())?);
    }
    snapshots.generation = snapshots.generation.max(store::read_state(db, "snapshot_generation")?);
    snapshots.next_id = snapshots.next_id.max(store::read_state(db, "next_snapshot_id")? as u32);
    snapshots.dirty = false;
    Ok(snapshots)
}

/// Writes the pool's snapshots into a checkpoint's transaction (all of
/// them: a few thousand small rows at most).
pub(super) fn save(
    txn: &redb::WriteTransaction,
    snapshots: &[SnapshotInfo],
    generation: u64,
    next_id: u32,
) -> Result<(), MetaError> {
    let mut table = txn.open_table(SNAPSHOTS)?;
    table.retain(|_, _| false)?;
    for info in snapshots {
        table.insert(info.id, info.encode().as_slice())?;
    }
    let mut state = txn.open_table(STATE)?;
    state.insert("snapshot_generation", generation)?;
    state.insert("next_snapshot_id", next_id as u64)?;
    Ok(())
}

/// Destages everything `volume` has in the RAM cache (its writes wait at
/// the barrier, which the caller holds), before `what`.
async fn place_cached(volume: &volume::EngineVolume, what: &str) -> Result<(), PoolError> {
    loop {
        let blocks = volume.cached_blocks(|_| true, 512);
        if blocks.is_empty() {
            return Ok(());
        }
        volume
            .destage_blocks(&blocks)
            .await
            .map_err(|e| PoolError::Invalid(format!("placing cached writes before {what}: {e}")))?;
    }
}

/// What a new snapshot needs from its volume.
pub struct SnapshotRequest<'a> {
    pub volume: &'a Arc<volume::EngineVolume>,
    pub name: String,
}

impl Pool {
    /// Every snapshot of the pool, oldest first per volume.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let snapshots = self.snapshots.read().unwrap_or_else(|_| crate::sync::poisoned());
        let mut all: Vec<SnapshotInfo> = snapshots.by_id.values().cloned().collect();
        all.sort_by_key(|s| (s.volume, s.generation, s.id));
        all
    }

    pub fn snapshot(&self, id: u32) -> Option<SnapshotInfo> {
        self.snapshots_read().by_id.get(&id).cloned()
    }

    /// Whether the pool has any snapshot (writes skip the snapshot checks
    /// when not).
    pub(crate) fn has_snapshots(&self) -> bool {
        self.has_snapshots.load(Ordering::Acquire)
    }

    pub(crate) fn snapshots_read(&self) -> std::sync::RwLockReadGuard<'_, Snapshots> {
        self.snapshots.read().unwrap_or_else(|_| crate::sync::poisoned())
    }

    fn snapshots_write(&self) -> std::sync::RwLockWriteGuard<'_, Snapshots> {
        self.snapshots.write().unwrap_or_else(|_| crate::sync::poisoned())
    }

    /// Takes snapshots of several volumes at one consistency point: every
    /// write acknowledged before it returns is in them, none that a client
    /// sends after it started. Writes to those volumes wait meanwhile; their
    /// cached data goes to its place first (it belongs to the snapshot).
    pub async fn create_snapshots(&self, requests: &[SnapshotRequest<'_>]) -> Result<Vec<SnapshotInfo>, PoolError> {
        if requests.is_empty() || requests.len() > MAX_SNAPSHOTS_PER_RECORD {
            return Err(PoolError::Invalid(format!(
                "one snapshot command takes 1 to {MAX_SNAPSHOTS_PER_RECORD} volumes"
            )));
        }
        let mut volumes: Vec<&Arc<volume::EngineVolume>> = requests.iter().map(|r| r.volume).collect();
        volumes.sort_by_key(|v| v.id());
        volumes.dedup_by_key(|v| v.id());
        if volumes.len() != requests.len() {
            return Err(PoolError::Invalid("a volume is named twice".into()));
        }
        {
            let snapshots = self.snapshots_read();
            for request in requests {
                let id = request.volume.id();
                if is_snapshot_id(id) {
                    return Err(PoolError::Invalid("a snapshot cannot be snapshotted".into()));
                }
                if request.name.is_empty() || request.name.len() > MAX_SNAPSHOT_NAME {
                    return Err(PoolError::Invalid(format!(
                        "a snapshot name has 1 to {MAX_SNAPSHOT_NAME} bytes"
                    )));
                }
                let taken = snapshots
                    .by_volume
                    .get(&id)
                    .is_some_and(|list| list.iter().any(|s| snapshots.by_id[s].name == request.name));
                if taken {
                    return Err(PoolError::Invalid(format!("snapshot '{}' exists", request.name)));
                }
            }
        }
        // Writes stop (in id order, so two commands cannot deadlock); what
        // they left in the cache goes to its place.
        let mut barriers = Vec::with_capacity(volumes.len());
        for volume in &volumes {
            barriers.push(volume.barrier().write().await);
        }
        for volume in &volumes {
            place_cached(volume, "the snapshot").await?;
        }
        let created_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let taken = {
            let _gate = self.gate.read().await;
            let mut snapshots = self.snapshots_write();
            snapshots.generation += 1;
            let generation = snapshots.generation;
            let mut entries = Vec::with_capacity(requests.len());
            let mut taken = Vec::with_capacity(requests.len());
            for request in requests {
                let id = SNAPSHOT_ID_BASE | snapshots.next_id;
                let info = SnapshotInfo {
                    id,
                    volume: request.volume.id(),
                    name: request.name.clone(),
                    generation,
                    created_unix,
                    mapped_blocks: request.volume.used_bytes() / request.volume.volblocksize() as u64,
                    size_bytes: crate::volume::BlockDevice::size_bytes(request.volume.as_ref()),
                };
                entries.push(SnapshotEntry {
                    volume: info.volume,
                    snapshot: id,
                    mapped_blocks: info.mapped_blocks,
                    size_bytes: info.size_bytes,
                    name: info.name.clone(),
                });
                snapshots.insert(info.clone());
                taken.push(info);
            }
            self.has_snapshots.store(true, Ordering::Release);
            self.log.append(Record::Snapshot {
                generation,
                created_unix,
                snapshots: entries,
            });
            taken
        };
        self.commit().await?;
        drop(barriers);
        Ok(taken)
    }

    /// Before block `block` of `volume` changes: if its map page is shared
    /// with the volume's newest snapshot, copies it into that snapshot and
    /// marks the page's entries shared. Caller holds the write gate (so a
    /// checkpoint sees the copy and the record together) and the volume's
    /// barrier (so no snapshot is being taken).
    pub(crate) fn ensure_private(&self, volume: u32, block: u64) -> Result<(), MetaError> {
        if !self.has_snapshots.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some((snapshot, generation)) = self.snapshots_read().newest(volume) else {
            return Ok(());
        };
        let page = self.map_page(volume, block)?;
        if page.birth.load(Ordering::Acquire) >= generation {
            return Ok(());
        }
        let _copying = self.page_copy.lock_or_abort();
        if page.birth.load(Ordering::Acquire) >= generation {
            return Ok(());
        }
        let index = block / MAP_ENTRIES_PER_PAGE;
        let now = self.snapshots_read().generation;
        self.copy_page_into(&page, index, snapshot, now);
        self.log.append(Record::CopyPage {
            volume,
            page: index,
            snapshot,
            generation: now,
        });
        Ok(())
    }

    /// The copy itself (also replayed): the snapshot gets the page as it is,
    /// the volume's valid entries become shared, and its page is born now.
    /// The snapshot's page is installed before the volume's changes, so a
    /// reader of the snapshot that saw a change also sees the copy.
    fn copy_page_into(&self, page: &MapPage, index: u64, snapshot: u32, generation: u64) {
        let copy = self
            .map_pages
            .put((snapshot, index), MapPage::copied(&page.entries, generation));
        self.map_pages.mark_dirty(&copy);
        for entry in page.entries.iter() {
            let value = entry.load(Ordering::Acquire);
            if value & map_entry::VALID != 0 {
                entry.store(value | map_entry::SHARED, Ordering::Release);
            }
        }
        page.birth.store(generation, Ordering::Release);
        self.map_pages.mark_dirty(page);
    }

    /// The map page a snapshot sees at `index`: its own copy, else its
    /// newer neighbour's view (the next snapshot's copy, or the volume's
    /// page).
    pub(crate) fn snapshot_page(&self, snapshot: u32, index: u64) -> Result<Arc<MapPage>, MetaError> {
        let mut owner = snapshot;
        loop {
            let page = self.map_pages.get(&self.db, (owner, index))?;
            if page.present.load(Ordering::Acquire) || !is_snapshot_id(owner) {
                return Ok(page);
            }
            let snapshots = self.snapshots_read();
            owner = match snapshots.neighbours(owner) {
                (_, Some(newer)) => newer,
                (_, None) => match snapshots.by_id.get(&owner) {
                    Some(info) => info.volume,
                    None => return Ok(page),
                },
            };
        }
    }

    /// Deletes a snapshot: its pages go to its older neighbour where that
    /// one has none, and the slots neither neighbour maps are freed once
    /// the record saying so is durable. Writes to the volume wait meanwhile
    /// (the work is proportional to what changed after the snapshot).
    pub async fn destroy_snapshot(&self, snapshot: u32) -> Result<(), PoolError> {
        let Some(info) = self.snapshot(snapshot) else {
            return Err(PoolError::Invalid(format!("no snapshot {snapshot:#x}")));
        };
        let live = self
            .engines
            .lock_or_abort()
            .get(&info.volume)
            .and_then(std::sync::Weak::upgrade);
        let _barrier = match &live {
            Some(volume) => Some(volume.barrier().write().await),
            None => None,
        };
        {
            let _gate = self.gate.read().await;
            let freed = self.apply_destroy_snapshot(snapshot)?;
            self.log.append_frees(Record::DestroySnapshot { snapshot }, freed);
        }
        self.read_cache.invalidate_volume(snapshot);
        self.commit().await
    }

    /// The work of a snapshot's deletion (also replayed): returns the slots
    /// to free.
    pub(super) fn apply_destroy_snapshot(&self, snapshot: u32) -> Result<Vec<(u8, u64)>, PoolError> {
        let (info, older, newer) = {
            let snapshots = self.snapshots_read();
            let Some(info) = snapshots.by_id.get(&snapshot).cloned() else {
                return Ok(Vec::new());
            };
            let (older, newer) = snapshots.neighbours(snapshot);
            (info, older, newer)
        };
        let mut freed = Vec::new();
        for index in self.own_pages(snapshot)? {
            let page = self.map_pages.get(&self.db, (snapshot, index))?;
            let older_page = match older {
                Some(older) => {
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
                    Some(older_page)
                }
                None => None,
            };
            let live_page = self.map_pages.get(&self.db, (info.volume, index))?;
            let next_page = match newer {
                Some(newer) => self.snapshot_page(newer, index)?,
                None => live_page.clone(),
            };
            // The newer snapshots may have no copy of this page: they see
            // the volume's, and copy it (sharing its entries again) before
            // it changes.
            let next_is_live = Arc::ptr_eq(&next_page, &live_page);
            let mut live_changed = false;
            for (i, entry) in page.entries.iter().enumerate() {
                let slot = entry.load(Ordering::Acquire);
                if slot & map_entry::VALID == 0 {
                    continue;
                }
                let in_older = older_page
                    .as_ref()
                    .is_some_and(|p| map_entry::same_slot(p.entries[i].load(Ordering::Acquire), slot));
                let next = next_page.entries[i].load(Ordering::Acquire);
                let in_next = map_entry::same_slot(next, slot);
                if in_next && next_is_live && !in_older {
                    // No snapshot maps the volume's slot any more.
                    next_page.entries[i].store(next & !map_entry::SHARED, Ordering::Release);
                    live_changed = true;
                }
                if !in_older && !in_next {
                    freed.extend(map_entry::decode(slot));
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
        {
            let _gate = self.gate.read().await;
            let freed = self.apply_rollback(id, snapshot)?;
            self.log.append_frees(Record::Rollback { volume: id, snapshot }, freed);
        }
        self.read_cache.invalidate_volume(id);
        volume.recount_mapped(self.count_mapped_blocks(id)?);
        self.commit().await
    }

    /// The work of a rollback (also replayed): every page the snapshot has
    /// a copy of (the pages the volume changed since) becomes the volume's
    /// again, its entries shared; returns the slots to free (those the
    /// volume mapped and the snapshot does not: written after it, so no
    /// snapshot shares them).
    pub(super) fn apply_rollback(&self, volume: u32, snapshot: u32) -> Result<Vec<(u8, u64)>, PoolError> {
        let mut freed = Vec::new();
        for index in self.own_pages(snapshot)? {
            let kept = self.map_pages.get(&self.db, (snapshot, index))?;
            let live = self.map_pages.get(&self.db, (volume, index))?;
            for (entry, kept) in live.entries.iter().zip(kept.entries.iter()) {
                let now = entry.load(Ordering::Acquire);
                let then = kept.load(Ordering::Acquire);
                if now & map_entry::VALID != 0 && !map_entry::same_slot(now, then) {
                    // Written after the snapshot: nothing else maps it.
                    assert_eq!(now & map_entry::SHARED, 0, "a shared slot the snapshot does not map");
                    freed.extend(map_entry::decode(now));
                }
                let restored = if then & map_entry::VALID != 0 {
                    then | map_entry::SHARED
                } else {
                    0
                };
                entry.store(restored, Ordering::Release);
            }
            self.map_pages.mark_dirty(&live);
        }
        Ok(freed)
    }

    /// The space of `volume`'s snapshots, in blocks, oldest first: for each
    /// (id, `used`: what deleting it would free, `written`: what it maps
    /// that the snapshot before it does not — all it maps for the first).
    /// Exact when no write to the volume runs meanwhile; a walk of the
    /// snapshots' own pages, no data read.
    pub fn snapshot_space(&self, volume: u32) -> Result<Vec<(u32, u64, u64)>, MetaError> {
        let (ids, mapped): (Vec<u32>, Vec<u64>) = {
            let snapshots = self.snapshots_read();
            let ids = snapshots.by_volume.get(&volume).cloned().unwrap_or_default();
            let mapped = ids.iter().map(|id| snapshots.by_id[id].mapped_blocks).collect();
            (ids, mapped)
        };
        let mut space = Vec::with_capacity(ids.len());
        for (k, &id) in ids.iter().enumerate() {
            let older = k.checked_sub(1).map(|i| ids[i]);
            let newer = ids.get(k + 1).copied();
            let mut used = 0;
            for index in self.own_pages(id)? {
                let page = self.map_pages.get(&self.db, (id, index))?;
                let older_page = match older {
                    Some(older) => {
                        let older_page = self.map_pages.get(&self.db, (older, index))?;
                        if !older_page.present.load(Ordering::Acquire) {
                            // Deleting would hand this page down, whole.
                            continue;
                        }
                        Some(older_page)
                    }
                    None => None,
                };
                let next_page = match newer {
                    Some(newer) => self.snapshot_page(newer, index)?,
                    None => self.map_pages.get(&self.db, (volume, index))?,
                };
                for (i, entry) in page.entries.iter().enumerate() {
                    let slot = entry.load(Ordering::Acquire);
                    let elsewhere =
                        |other: &MapPage| map_entry::same_slot(other.entries[i].load(Ordering::Acquire), slot);
                    if slot & map_entry::VALID != 0
                        && !older_page.as_deref().is_some_and(elsewhere)
                        && !elsewhere(&next_page)
                    {
                        used += 1;
                    }
                }
            }
            let written = match older {
                None => mapped[k],
                // It differs from the older one only where that one has
                // copies (the pages changed between them).
                Some(older) => {
                    let mut written = 0;
                    for index in self.own_pages(older)? {
                        let before = self.map_pages.get(&self.db, (older, index))?;
                        let after = self.snapshot_page(id, index)?;
                        written += after
                            .entries
                            .iter()
                            .zip(before.entries.iter())
                            .filter(|(a, b)| {
                                let a = a.load(Ordering::Acquire);
                                a & map_entry::VALID != 0 && !map_entry::same_slot(a, b.load(Ordering::Acquire))
                            })
                            .count() as u64;
                    }
                    written
                }
            };
            space.push((id, used, written));
        }
        Ok(space)
    }

    /// The runs of blocks in `first..=last` whose contents may differ
    /// between `older` (a snapshot; `None`: an empty volume) and `newer` (a
    /// later snapshot of the same volume; a volume's writes still in the
    /// RAM cache are not in its map): `(first
    /// block, count)`, in order. A block counts as changed when the two map
    /// it to different slots or only one maps it; a block both map to the
    /// same slot did not change (a slot a snapshot maps is never written in
    /// place). What `send -i` and the NBD changed-block context report.
    /// Reads map pages only, no data.
    pub fn changed_blocks(
        &self,
        older: Option<u32>,
        newer: u32,
        first: u64,
        last: u64,
    ) -> Result<Vec<(u64, u64)>, MetaError> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut block = first;
        while block <= last {
            let end = (block / MAP_ENTRIES_PER_PAGE + 1) * MAP_ENTRIES_PER_PAGE - 1;
            let end = end.min(last);
            let after = self.lookup_range(newer, block, end)?;
            let before = match older {
                Some(older) => self.lookup_range(older, block, end)?,
                None => vec![0; after.len()],
            };
            for (i, (a, b)) in after.iter().zip(&before).enumerate() {
                let unchanged =
                    (a & map_entry::VALID == 0 && b & map_entry::VALID == 0) || map_entry::same_slot(*a, *b);
                if unchanged {
                    continue;
                }
                let at = block + i as u64;
                match runs.last_mut() {
                    Some((start, count)) if *start + *count == at => *count += 1,
                    _ => runs.push((at, 1)),
                }
            }
            block = end + 1;
        }
        Ok(runs)
    }

    /// The pages a snapshot has copies of (stored or made since).
    fn own_pages(&self, snapshot: u32) -> Result<Vec<u64>, MetaError> {
        let mut pages: std::collections::BTreeSet<u64> = std::collections::BTreeSet::new();
        {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(MAP_PAGES)?;
            for row in table.range((snapshot, 0)..=(snapshot, u64::MAX))? {
                let (key, _) = row?;
                pages.insert(key.value().1);
            }
        }
        for (owner, index) in self.map_pages.keys() {
            if owner == snapshot
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

    /// Replays a `Snapshot` record.
    pub(super) fn apply_snapshot_record(&self, generation: u64, created_unix: u64, entries: Vec<SnapshotEntry>) {
        let mut snapshots = self.snapshots_write();
        for entry in entries {
            if snapshots.by_id.contains_key(&entry.snapshot) {
                continue;
            }
            snapshots.insert(SnapshotInfo {
                id: entry.snapshot,
                volume: entry.volume,
                name: entry.name,
                generation,
                created_unix,
                mapped_blocks: entry.mapped_blocks,
                size_bytes: entry.size_bytes,
            });
        }
        self.has_snapshots.store(!snapshots.is_empty(), Ordering::Release);
    }

    /// Replays a `CopyPage` record.
    pub(super) fn apply_copy_page(
        &self,
        volume: u32,
        index: u64,
        snapshot: u32,
        generation: u64,
    ) -> Result<(), MetaError> {
        let page = self.map_pages.get(&self.db, (volume, index))?;
        if page.birth.load(Ordering::Acquire) >= generation {
            // The checkpoint already holds the copy.
            return Ok(());
        }
        self.copy_page_into(&page, index, snapshot, generation);
        Ok(())
    }

    /// The registry as a checkpoint stores it, if it changed since the last
    /// one (then it is marked clean; `restore` marks it dirty again).
    pub(super) fn take_snapshot_state(&self) -> Option<(Vec<SnapshotInfo>, u64, u32)> {
        let mut snapshots = self.snapshots_write();
        if !snapshots.dirty {
            return None;
        }
        snapshots.dirty = false;
        Some((
            snapshots.by_id.values().cloned().collect(),
            snapshots.generation,
            snapshots.next_id,
        ))
    }

    pub(super) fn restore_snapshot_state(&self) {
        self.snapshots_write().dirty = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::pool::superblock::Role;
    use crate::pool::NewDevice;
    use crate::volume::{BlockDevice, BlockError};

    const MIB: u64 = 1 << 20;
    const VOLUME: u64 = 4 * MIB;
    const BLOCK: u32 = 8192;

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    async fn read_all(volume: &volume::EngineVolume) -> Vec<u8> {
        let size = volume.size_bytes();
        let (buf, result) = volume.read(0, IoBuf::new(size as usize)).await;
        result.unwrap();
        buf.payload().to_vec()
    }

    /// Slots mapped by the volume or any of its snapshots, and the bytes
    /// the pool has placed: they must agree (nothing leaked, nothing freed
    /// that is still mapped).
    fn check_space(pool: &Pool, volume: u32) {
        let blocks = VOLUME / BLOCK as u64;
        let mut slots = HashSet::new();
        let mut owners = vec![volume];
        owners.extend(pool.snapshots().iter().map(|s| s.id));
        for owner in owners {
            for entry in pool.lookup_range(owner, 0, blocks - 1).unwrap() {
                if entry & map_entry::VALID != 0 {
                    slots.insert(entry & !map_entry::RESERVED);
                }
            }
        }
        let placed: u64 = pool.status().iter().map(|d| d.used_bytes).sum();
        assert_eq!(
            placed,
            slots.len() as u64 * BLOCK as u64,
            "placed bytes against mapped slots"
        );
    }

    /// The bytes of the blocks volume 1 maps.
    fn mapped_bytes(pool: &Pool) -> u64 {
        let mapped = pool
            .lookup_range(1, 0, VOLUME / BLOCK as u64 - 1)
            .unwrap()
            .iter()
            .filter(|e| *e & map_entry::VALID != 0)
            .count() as u64;
        mapped * BLOCK as u64
    }

    fn id_of(pool: &Pool, name: &str) -> u32 {
        pool.snapshots()
            .iter()
            .find(|s| s.name == name)
            .expect("snapshot listed")
            .id
    }

    /// `written` of each snapshot against a block-by-block comparison of
    /// its view with the one before it.
    fn check_written(pool: &Pool, volume: u32) {
        let blocks = VOLUME / BLOCK as u64;
        let space = pool.snapshot_space(volume).unwrap();
        let mut before: Option<Vec<u64>> = None;
        for (id, _, written) in space {
            let view = pool.lookup_range(id, 0, blocks - 1).unwrap();
            let expected = match &before {
                None => view.iter().filter(|e| *e & map_entry::VALID != 0).count(),
                Some(before) => view
                    .iter()
                    .zip(before)
                    .filter(|(a, b)| *a & map_entry::VALID != 0 && !map_entry::same_slot(**a, **b))
                    .count(),
            };
            assert_eq!(written, expected as u64, "written of snapshot {id:#x}");
            before = Some(view);
        }
    }

    /// `changed_blocks` between each snapshot and the next misses no block whose contents differ, and reports only
    /// blocks whose mappings differ.
    fn check_changed(pool: &Pool, snapshots: &[(String, Vec<u8>)], seed: u64, step: u32) {
        let blocks = VOLUME / BLOCK as u64;
        let mut chain: Vec<(Option<u32>, &[u8])> = vec![(None, &[])];
        for (name, image) in snapshots {
            chain.push((Some(id_of(pool, name)), image));
        }
        let zeros = vec![0u8; VOLUME as usize];
        for pair in chain.windows(2) {
            let (older, before) = pair[0];
            let (newer, after) = (pair[1].0.unwrap(), pair[1].1);
            let before = if older.is_none() { &zeros[..] } else { before };
            let runs = pool.changed_blocks(older, newer, 0, blocks - 1).unwrap();
            let changed: HashSet<u64> = runs.iter().flat_map(|(b, n)| *b..*b + *n).collect();
            let after_map = pool.lookup_range(newer, 0, blocks - 1).unwrap();
            let before_map = match older {
                Some(older) => pool.lookup_range(older, 0, blocks - 1).unwrap(),
                None => vec![0; blocks as usize],
            };
            for block in 0..blocks {
                let range = (block * BLOCK as u64) as usize..((block + 1) * BLOCK as u64) as usize;
                if before[range.clone()] != after[range] {
                    assert!(
                        changed.contains(&block),
                        "seed {seed} step {step}: block {block} differs but is not reported changed"
                    );
                }
                let (a, b) = (after_map[block as usize], before_map[block as usize]);
                let differs = (a | b) & map_entry::VALID != 0 && !map_entry::same_slot(a, b);
                assert_eq!(
                    changed.contains(&block),
                    differs,
                    "seed {seed} step {step}: block {block}"
                );
            }
        }
    }

    /// A random mix of writes (whole and partial blocks), trims, snapshot
    /// creations and deletions, and power losses after a commit, checked
    /// against a model of the volume and every snapshot, and against the
    /// space the pool says it uses.
    #[test]
    fn snapshots_keep_their_contents_through_writes_deletes_and_crashes() {
        // More with STRATA_SNAPSHOT_SEEDS=N (the soak runs thousands).
        let seeds = std::env::var("STRATA_SNAPSHOT_SEEDS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(12u64);
        for seed in 1..=seeds {
            current_thread().block_on(run(seed));
        }
    }

    async fn run(seed: u64) {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let sim = SimDevice::new(160 * MIB, seed);
        let device = NewDevice {
            device: sim.as_device(),
            role: Role::Fast,
        };
        let mut pool = Pool::create("test", 1 << 20, vec![device]).await.unwrap();
        let mut volume = pool.open_volume(1, VOLUME, BLOCK).unwrap();
        let mut model = vec![0u8; VOLUME as usize];
        // Snapshot name -> its expected contents.
        let mut snapshots: Vec<(String, Vec<u8>)> = Vec::new();
        let mut taken = 0;
        let mut ops: Vec<String> = Vec::new();
        for step in 0..120 {
            let op = rng.below(22);
            ops.push(format!("{op}"));
            match op {
                0..=9 => {
                    let offset = rng.below(VOLUME / 4096) * 4096;
                    let length = ((rng.below(6) + 1) * 4096).min(VOLUME - offset);
                    let byte = rng.below(255) as u8 + 1;
                    volume
                        .write(offset, IoBuf::copy_from(&vec![byte; length as usize]), false)
                        .await
                        .unwrap();
                    model[offset as usize..(offset + length) as usize].fill(byte);
                    ops.push(format!("write {offset} +{length} = {byte}"));
                }
                10..=11 => {
                    let offset = rng.below(VOLUME / BLOCK as u64) * BLOCK as u64;
                    let length = ((rng.below(4) + 1) * BLOCK as u64).min(VOLUME - offset);
                    volume.trim(offset, length, false).await.unwrap();
                    model[offset as usize..(offset + length) as usize].fill(0);
                    ops.push(format!("trim {offset} +{length}"));
                }
                12..=14 if snapshots.len() < 5 => {
                    taken += 1;
                    let name = format!("s{taken}");
                    pool.create_snapshots(&[SnapshotRequest {
                        volume: &volume,
                        name: name.clone(),
                    }])
                    .await
                    .unwrap();
                    ops.push(format!("snapshot {name}"));
                    snapshots.push((name, model.clone()));
                }
                15..=16 if !snapshots.is_empty() => {
                    let at = rng.below(snapshots.len() as u64) as usize;
                    let (name, _) = snapshots.remove(at);
                    let id = id_of(&pool, &name);
                    // `used` is exactly what the deletion frees (cached
                    // writes placed first, so none lands meanwhile).
                    volume.flush().await.unwrap();
                    pool.destage_all().await.unwrap();
                    pool.commit().await.unwrap();
                    let space = pool.snapshot_space(1).unwrap();
                    let used = space.iter().find(|s| s.0 == id).unwrap().1;
                    // Nothing cached: what the volume says it uses is what
                    // it maps (copies on write map no new block).
                    assert_eq!(volume.used_bytes(), mapped_bytes(&pool), "seed {seed} step {step}");
                    let placed = || pool.status().iter().map(|d| d.used_bytes).sum::<u64>();
                    let before = placed();
                    pool.destroy_snapshot(id).await.unwrap();
                    pool.commit().await.unwrap();
                    assert_eq!(
                        before - placed(),
                        used * BLOCK as u64,
                        "seed {seed} step {step}: what deleting {name} freed"
                    );
                    ops.push(format!("delete {name}"));
                }
                17 => {
                    // Power loss after a flush: everything written is durable.
                    volume.flush().await.unwrap();
                    drop(volume);
                    drop(pool);
                    sim.crash();
                    pool = Pool::open(vec![sim.as_device()]).await.unwrap();
                    volume = pool.open_volume(1, VOLUME, BLOCK).unwrap();
                }
                18 => pool.checkpoint().await.unwrap(),
                19..=20 if !snapshots.is_empty() => {
                    // Back to a snapshot; the newer ones are deleted first
                    // (`rollback -r`).
                    let at = rng.below(snapshots.len() as u64) as usize;
                    for (name, _) in snapshots.drain(at + 1..) {
                        let id = id_of(&pool, &name);
                        pool.destroy_snapshot(id).await.unwrap();
                    }
                    let (name, image) = &snapshots[at];
                    let id = id_of(&pool, name);
                    pool.rollback(&volume, id).await.unwrap();
                    model = image.clone();
                    // Nothing cached is left after a rollback: what the
                    // volume says it uses is what it maps.
                    assert_eq!(volume.used_bytes(), mapped_bytes(&pool), "seed {seed} step {step}");
                    ops.push(format!("rollback {name}"));
                }
                _ => {}
            }
            let now = read_all(&volume).await;
            if now != model {
                let at = now.iter().zip(&model).position(|(a, b)| a != b).unwrap();
                panic!(
                    "seed {seed} step {step}: the volume differs at {at} ({} != {}); ops {ops:?}",
                    now[at], model[at]
                );
            }
            let infos = pool.snapshots();
            assert_eq!(infos.len(), snapshots.len(), "seed {seed} step {step}");
            for (name, expected) in &snapshots {
                let info = infos.iter().find(|s| &s.name == name).expect("snapshot listed");
                let view = pool.open_snapshot(info.id, BLOCK).unwrap();
                let seen = read_all(&view).await;
                if seen != *expected {
                    let at = seen.iter().zip(expected).position(|(a, b)| a != b).unwrap();
                    panic!(
                        "seed {seed} step {step}: snapshot {name} differs at {at} ({} != {}); ops {ops:?}",
                        seen[at], expected[at]
                    );
                }
                let write = view.write(0, IoBuf::new(4096), false).await;
                assert!(matches!(write, Err(BlockError::ReadOnly)));
            }
            check_changed(&pool, &snapshots, seed, step);
            pool.commit().await.unwrap();
            check_space(&pool, 1);
            check_written(&pool, 1);
        }
        // Every snapshot deleted: the pool holds the volume's blocks only,
        // and overwrites go in place again.
        for info in pool.snapshots() {
            pool.destroy_snapshot(info.id).await.unwrap();
        }
        pool.commit().await.unwrap();
        check_space(&pool, 1);
        let blocks = VOLUME / BLOCK as u64;
        for entry in pool.lookup_range(1, 0, blocks - 1).unwrap() {
            assert_eq!(
                entry & map_entry::SHARED,
                0,
                "seed {seed}: a shared entry with no snapshot left"
            );
        }
    }
}
