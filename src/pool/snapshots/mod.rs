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
//!
//! The rooms, one file each:
//! - this file: the registry ([`Snapshots`]: every snapshot by id and by
//!   volume, the clones' origins, which snapshots have copies of which
//!   pages) and what the others share: the pool's lookups of it, placing a
//!   volume's cached writes, the quiet commit of a change made holding a
//!   volume's barrier and placement lock, the cache's floor;
//! - `persist.rs`: the registry as the metadata store holds it (its rows,
//!   loading them, a checkpoint's share);
//! - `take.rs`: taking snapshots;
//! - `cow.rs`: copy-on-write of map pages (`ensure_private` and the copy
//!   itself, for snapshots and clones);
//! - `views.rs`: what a snapshot or a clone sees (its view of a map page,
//!   whose pages a walk of a view goes through);
//! - `destroy.rs`: deleting a snapshot, rolling a volume back to one;
//! - `space.rs`: the space figures of snapshots and volumes, and those
//!   kept between calls;
//! - `diff.rs`: the blocks that changed between two snapshots (send diffs);
//! - `clones.rs`: clones and promotion;
//! - `replay.rs`: replaying the log records whose work is not done by the
//!   same code as the change (taking a snapshot, copying a page).

use super::*;
use std::collections::HashMap;

mod clones;
mod cow;
mod destroy;
mod diff;
mod persist;
mod replay;
mod space;
mod take;
mod views;

pub(super) use persist::{load, save, SnapshotState};
pub use space::VolumeSpace;
use space::{CachedSpace, SpaceFigures};
pub use take::SnapshotRequest;

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
    /// The write-back cache's sequence number when it was taken: the
    /// volume's cached writes below it belong to the snapshot (0: taken by
    /// an older pool, with the cache placed first).
    #[serde(default)]
    pub cache_seq: u64,
}

/// The pool's snapshots (persisted by the checkpoint, changed by the log).
#[derive(Debug, Default)]
pub(in crate::pool) struct Snapshots {
    by_id: HashMap<u32, SnapshotInfo>,
    /// Each volume's snapshots, oldest first (by generation).
    by_volume: HashMap<u32, Vec<u32>>,
    /// The last snapshot generation given out.
    generation: u64,
    /// The next snapshot id's low bits.
    next_id: u32,
    /// Clones: volume -> the snapshot it was cloned from.
    origins: HashMap<u32, u32>,
    /// Changed since the last checkpoint.
    dirty: bool,
    /// The snapshots whose rows changed (added, changed or deleted) since
    /// the last checkpoint took them: a checkpoint writes those rows only.
    changed: HashSet<u32>,
    /// The rows the running (or last) checkpoint took: put back into
    /// `changed` if it fails (checkpoints run one at a time).
    in_flight: Vec<u32>,
    /// Space figures computed before (`Pool::snapshot_space`), kept while
    /// what they depend on cannot change: see [`CachedSpace`].
    space: Mutex<SpaceFigures>,
    /// Bumped by every change of the registry, so that space figures
    /// computed across one are not kept.
    version: u64,
    /// Which snapshots have their own copy of a map page: see [`Copies`].
    copies: Mutex<Copies>,
}

/// Which of a volume's snapshots have their own copy of a map page, by
/// page, learnt the first time a snapshot's view of the page is looked up
/// (`Pool::newer_view`): a snapshot without a copy sees the next newer
/// one that has one (or the volume), found here at once instead of by
/// asking each newer snapshot in turn — with a thousand snapshots, a
/// thousand page lookups per read of a page that rarely changes.
///
/// A page's set is complete from the moment it is kept, or it is not
/// kept: a copy is made into a snapshot by `copy_page_into` (which adds
/// it to a kept set; into an older snapshot than the newest when cached
/// data written between them is placed), handed down to the
/// older neighbour when a snapshot is deleted (`Snapshots::remove`, which
/// moves it), and rearranged by a promotion (which forgets both volumes').
/// Each of these bumps the volume's epoch; a set learnt across a bump is
/// not kept.
#[derive(Debug, Default)]
struct Copies {
    /// volume -> page -> generations of its snapshots with a copy.
    pages: HashMap<u32, HashMap<u64, std::collections::BTreeSet<u64>>>,
    /// volume -> changes of which of its snapshots have copies.
    epochs: HashMap<u32, u64>,
}

impl Copies {
    fn bump(&mut self, volume: u32) {
        *self.epochs.entry(volume).or_default() += 1;
    }

    fn epoch(&self, volume: u32) -> u64 {
        self.epochs.get(&volume).copied().unwrap_or_default()
    }

    /// Forgets what is known of `volume`'s snapshots' pages.
    fn forget(&mut self, volume: u32) {
        self.pages.remove(&volume);
        self.bump(volume);
    }
}

impl Snapshots {
    /// The newest snapshot of `volume`: (id, generation).
    fn newest(&self, volume: u32) -> Option<(u32, u64)> {
        let id = *self.by_volume.get(&volume)?.last()?;
        Some((id, self.by_id[&id].generation))
    }

    /// The `cache_seq` of `volume`'s newest snapshot (0: none).
    pub(in crate::pool) fn floor(&self, volume: u32) -> u64 {
        self.by_volume
            .get(&volume)
            .and_then(|list| list.last())
            .map_or(0, |id| self.by_id[id].cache_seq)
    }

    /// The snapshot a cached write of `volume` with sequence number `seq`
    /// was made after: the newest one taken before it, (id, generation).
    /// Its place goes into the map as a change after that snapshot.
    fn taken_before(&self, volume: u32, seq: u64) -> Option<(u32, u64)> {
        let list = self.by_volume.get(&volume)?;
        // A binary search over the list (`taken_before_count` without
        // collecting every snapshot's floor: once per write placed).
        let taken = list.partition_point(|id| self.by_id[id].cache_seq <= seq);
        let id = *list.get(taken.checked_sub(1)?)?;
        Some((id, self.by_id[&id].generation))
    }

    /// The highest `cache_seq` of any snapshot (0: none).
    pub(in crate::pool) fn newest_cache_seq(&self) -> u64 {
        self.by_id.values().map(|s| s.cache_seq).max().unwrap_or(0)
    }

    /// Each snapshot's `cache_seq`, oldest first.
    pub(in crate::pool) fn floors(&self, volume: u32) -> Vec<u64> {
        self.by_volume
            .get(&volume)
            .map(|list| list.iter().map(|id| self.by_id[id].cache_seq).collect())
            .unwrap_or_default()
    }

    /// Where `snapshot` is in its volume's list: a binary search by
    /// generation (the list is in generation order), not a walk of it.
    fn position(&self, snapshot: u32) -> Option<(&[u32], usize)> {
        let info = self.by_id.get(&snapshot)?;
        let list = self.by_volume.get(&info.volume)?;
        let at = list.partition_point(|id| self.by_id[id].generation < info.generation);
        if list.get(at) == Some(&snapshot) {
            return Some((list, at));
        }
        // Not reached while the lists stay in generation order.
        debug_assert!(false, "snapshot {snapshot:#x} out of generation order");
        Some((list, list.iter().position(|id| *id == snapshot)?))
    }

    /// The snapshots of the same volume just older and just newer than
    /// `snapshot` (`None`: none older; none newer, i.e. the volume itself).
    fn neighbours(&self, snapshot: u32) -> (Option<u32>, Option<u32>) {
        let Some((list, at)) = self.position(snapshot) else {
            return (None, None);
        };
        (at.checked_sub(1).map(|i| list[i]), list.get(at + 1).copied())
    }

    /// A change of the registry: space figures computed across it are
    /// not kept, and the checkpoint writes it.
    fn bump(&mut self) {
        self.version += 1;
        self.dirty = true;
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
        self.changed.insert(info.id);
        self.by_id.insert(info.id, info);
        self.bump();
    }

    fn remove(&mut self, snapshot: u32) -> Option<SnapshotInfo> {
        // Its neighbours get new ones: the older its `used`, the newer
        // both figures.
        let (older, newer) = self.neighbours(snapshot);
        if let Some(info) = self.by_id.get(&snapshot) {
            // Its copies went to the older neighbour, which has a copy of
            // each of those pages now (`apply_destroy_snapshot`).
            let older_generation = older.map(|id| self.by_id[&id].generation);
            let mut copies = self.copies.lock_or_abort();
            copies.bump(info.volume);
            if let Some(pages) = copies.pages.get_mut(&info.volume) {
                for owners in pages.values_mut() {
                    if owners.remove(&info.generation) {
                        owners.extend(older_generation);
                    }
                }
            }
        }
        let info = self.by_id.remove(&snapshot)?;
        if let Some(list) = self.by_volume.get_mut(&info.volume) {
            list.retain(|id| *id != snapshot);
            if list.is_empty() {
                self.by_volume.remove(&info.volume);
            }
        }
        self.forget_space(snapshot, true);
        if let Some(older) = older {
            self.forget_space(older, false);
        }
        if let Some(newer) = newer {
            self.forget_space(newer, true);
        }
        self.changed.insert(snapshot);
        self.bump();
        Some(info)
    }

    pub(in crate::pool) fn has_volume(&self, volume: u32) -> bool {
        self.by_volume.contains_key(&volume)
    }

    pub(in crate::pool) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The snapshot volume `volume` was cloned from, if it is a clone.
    pub(in crate::pool) fn origin(&self, volume: u32) -> Option<u32> {
        self.origins.get(&volume).copied()
    }

    /// Every volume and snapshot that may map a slot `volume` maps: the
    /// volume nothing in its line was cloned from, its snapshots, their
    /// clones, theirs, and so on (`pool/relocate.rs`).
    pub(in crate::pool) fn family(&self, volume: u32) -> Vec<u32> {
        let mut root = volume;
        while let Some(origin) = self.origin(root) {
            match self.by_id.get(&origin) {
                Some(info) => root = info.volume,
                None => break,
            }
        }
        let mut volumes = vec![root];
        let mut ids = Vec::new();
        let mut next = 0;
        while next < volumes.len() {
            let volume = volumes[next];
            next += 1;
            ids.push(volume);
            for &snapshot in self.by_volume.get(&volume).into_iter().flatten() {
                ids.push(snapshot);
                volumes.extend(self.clones_of(snapshot));
            }
        }
        ids
    }

    /// The clones of `snapshot`, by volume id.
    fn clones_of(&self, snapshot: u32) -> Vec<u32> {
        let mut clones: Vec<u32> = self
            .origins
            .iter()
            .filter(|(_, origin)| **origin == snapshot)
            .map(|(volume, _)| *volume)
            .collect();
        clones.sort_unstable();
        clones
    }

    /// What the clone chain of `volume` starts with: its oldest snapshot,
    /// else the volume itself (the view that sees its origin's pages).
    fn first_of_chain(&self, volume: u32) -> u32 {
        self.by_volume
            .get(&volume)
            .and_then(|list| list.first().copied())
            .unwrap_or(volume)
    }
}

/// Destages everything `volume` has in the RAM cache (its writes wait at
/// the barrier, which the caller holds), before `what`.
async fn place_cached(volume: &volume::EngineVolume, what: &str) -> Result<(), PoolError> {
    place_cached_where(volume, |_| true, what).await
}

/// Destages `volume`'s cached entries that match `filter` until none is
/// left (new ones that match must not appear meanwhile).
async fn place_cached_where(
    volume: &volume::EngineVolume,
    filter: impl Fn(&super::cache::Entry) -> bool + Copy,
    what: &str,
) -> Result<(), PoolError> {
    loop {
        let blocks = volume.cached_blocks(filter, 512);
        if blocks.is_empty() {
            return Ok(());
        }
        volume
            .destage_blocks(&blocks)
            .await
            .map_err(|e| PoolError::Invalid(format!("placing cached writes before {what}: {e}")))?;
    }
}

/// How many of a volume's snapshots (their `cache_seq`s, oldest first)
/// were taken before the cached write with sequence number `seq`.
pub(in crate::pool) fn taken_before_count(floors: &[u64], seq: u64) -> usize {
    floors.partition_point(|floor| *floor <= seq)
}

impl Pool {
    /// Every snapshot of the pool, oldest first per volume.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let snapshots = self.snapshots.read_or_abort();
        let mut all: Vec<SnapshotInfo> = snapshots.by_id.values().cloned().collect();
        all.sort_by_key(|s| (s.volume, s.generation, s.id));
        all
    }

    pub fn snapshot(&self, id: u32) -> Option<SnapshotInfo> {
        self.snapshots_read().by_id.get(&id).cloned()
    }

    /// The snapshots of `volume`, oldest first (without a copy of the
    /// pool's others).
    pub fn snapshots_of(&self, volume: u32) -> Vec<SnapshotInfo> {
        let snapshots = self.snapshots_read();
        snapshots
            .by_volume
            .get(&volume)
            .map(|list| list.iter().map(|id| snapshots.by_id[id].clone()).collect())
            .unwrap_or_default()
    }

    /// Snapshot `name` of `volume`.
    pub fn snapshot_named(&self, volume: u32, name: &str) -> Option<SnapshotInfo> {
        let snapshots = self.snapshots_read();
        let list = snapshots.by_volume.get(&volume)?;
        list.iter()
            .map(|id| &snapshots.by_id[id])
            .find(|info| info.name == name)
            .cloned()
    }

    /// Whether `volume` has snapshots.
    pub fn has_snapshots_of(&self, volume: u32) -> bool {
        self.snapshots_read().has_volume(volume)
    }

    /// Whether the pool has any snapshot (writes skip the snapshot checks
    /// when not).
    pub(in crate::pool) fn has_snapshots(&self) -> bool {
        self.has_snapshots.load(Ordering::Acquire)
    }

    pub(in crate::pool) fn snapshots_read(&self) -> Held<std::sync::RwLockReadGuard<'_, Snapshots>> {
        self.snapshots.read_or_abort()
    }

    fn snapshots_write(&self) -> Held<std::sync::RwLockWriteGuard<'_, Snapshots>> {
        self.snapshots.write_or_abort()
    }

    /// The commit of a change made holding a volume's barrier and
    /// placement lock exclusively (a snapshot's deletion, a rollback, a
    /// promotion), durable before writes and destaging resume: a quiet one
    /// ([`Pool::commit_quiet`]: into the log's reserve, a metadata
    /// checkpoint if even that is full), never one that makes log room.
    /// Making room destages every volume's logged data, and the destage of
    /// this volume waits for the placement lock its caller holds: the
    /// commit would wait for itself, or for another writer making room
    /// that waits there (holding `making_log_room`), whether or not the
    /// caller placed the volume's cached data first.
    async fn commit_holding_placement(&self) -> Result<(), PoolError> {
        self.commit_quiet().await?;
        self.maybe_checkpoint_soon();
        Ok(())
    }

    /// Sets the cache's floor of `volume` from its newest snapshot (after
    /// a deletion or a promotion changed which that is).
    fn refresh_floor(&self, volume: u32) {
        let floor = self.snapshots_read().floor(volume);
        self.cache.volume(volume).lock().set_floor(floor);
    }

    /// Places `volume`'s cached writes from before `cache_seq` (those of a
    /// snapshot taken at it, and of older ones), so that the snapshot's
    /// view is complete in the map: before it is read, compared or cloned.
    /// The volume must be open (the daemon opens every volume).
    pub(crate) async fn place_before(&self, volume: u32, cache_seq: u64) -> Result<(), PoolError> {
        let engine = self
            .engines
            .lock_or_abort()
            .get(&volume)
            .and_then(std::sync::Weak::upgrade);
        let Some(engine) = engine else {
            let cache = self.cache.volume(volume);
            let state = cache.lock();
            if state.all_versions().any(|e| e.seq < cache_seq && !e.placed) {
                return Err(PoolError::Invalid(format!(
                    "volume {volume} holds cached writes of its snapshot but is not open"
                )));
            }
            return Ok(());
        };
        place_cached_where(&engine, |e| e.seq < cache_seq && !e.placed, "reading a snapshot").await
    }
}

#[cfg(test)]
mod tests;
