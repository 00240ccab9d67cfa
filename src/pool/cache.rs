//! The write-back cache: dirty 4 KiB sectors of every volume of a pool, held
//! in the pool's RAM tier until they are destaged to their place on the data
//! devices.
//!
//! An entry is *unlogged* when its current contents are in RAM only (a FLUSH
//! must log or destage it), and *logged* (`logged_at != 0`) while some `Data`
//! record in the intent log still describes a version of it that nothing
//! durable supersedes yet: `log_lsn` is a lower bound of that record's log
//! position, which keeps the log's tail from passing it.
//!
//! Locking: entries change only under the owning volume's stripe locks
//! (exclusive to write or remove, shared to read a slot), plus the short
//! per-volume mutex around the index. `pool::volume` holds the stripe locks.

use crate::sync::{Held, Rank, Ranked};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::ram::{RamTier, Survivor, SLOT_BYTES};

#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub slot: u32,
    pub seq: u64,
    pub crc: u32,
    /// Contents not in the intent log (a FLUSH must log or destage them).
    pub unlogged: bool,
    /// Ordinal of the last logging whose record is still live; 0 = none.
    pub logged_at: u64,
    /// Lower bound of the oldest live record's log position.
    pub log_lsn: u64,
    /// When the oldest not-yet-destaged contents arrived.
    pub since: Instant,
    /// These contents were written to their place (the entry stays until
    /// the destage that placed it commits, or its log record is superseded).
    pub placed: bool,
}

#[derive(Default)]
pub struct VolState {
    /// The newest cached version of each dirty sector (what reads see).
    pub entries: BTreeMap<u64, Entry>,
    /// Older versions, by (sector, seq): a cached write replaced them while
    /// they belonged to a snapshot (written before it) and were not yet
    /// committed in place. The writer does not wait for them to be placed:
    /// they stay here until a destage of their block places them, oldest
    /// first, each into the view it belongs to, and commits.
    pub older: BTreeMap<(u64, u64), Entry>,
    /// Unmapped blocks with dirty sectors: pool space reserved for each.
    pub reserved: HashSet<u64>,
    /// The volume's block size (set when it is opened).
    pub block_bytes: u64,
    /// The `cache_seq` of the volume's newest snapshot (0: none): entries
    /// below it were written before that snapshot and belong to it.
    pub floor: u64,
    /// Entries below `floor` not placed yet (*pending*): they must reach
    /// the map before the pages they fall in are copied into a snapshot
    /// taken after them (`EngineVolume::destage_blocks`).
    pub pending: usize,
}

impl VolState {
    /// Whether `entry` belongs to the newest snapshot and is not placed.
    pub fn is_pending(&self, entry: &Entry) -> bool {
        entry.seq < self.floor && !entry.placed
    }

    /// The sectors in `first..=last` with a pending version (a sector once
    /// per such version), current versions first: a walk of the range with
    /// nothing collected, for the checks every write makes while a
    /// snapshot's writes are cached (a map page holds up to 2,048 sectors).
    fn pending_versions(&self, first: u64, last: u64) -> impl Iterator<Item = u64> + '_ {
        let current = self
            .entries
            .range(first..=last)
            .filter(|(_, e)| self.is_pending(e))
            .map(|(s, _)| *s);
        let older = self
            .older
            .range((first, 0)..=(last, u64::MAX))
            .filter(|(_, e)| self.is_pending(e))
            .map(|((s, _), _)| *s);
        current.chain(older)
    }

    /// The sectors in `first..=last` with a pending version, sorted, each once.
    pub fn pending_sectors(&self, first: u64, last: u64) -> Vec<u64> {
        let mut sectors: Vec<u64> = self.pending_versions(first, last).collect();
        sectors.sort_unstable();
        sectors.dedup();
        sectors
    }

    /// Whether any version of a sector in `first..=last` is pending; stops
    /// at the first.
    pub fn any_pending(&self, first: u64, last: u64) -> bool {
        self.pending_versions(first, last).next().is_some()
    }

    /// Sets the floor (a snapshot was taken or deleted) and counts the
    /// pending entries again.
    pub fn set_floor(&mut self, floor: u64) {
        self.floor = floor;
        self.pending = self.all_versions().filter(|e| self.is_pending(e)).count();
    }

    /// Every cached version of every sector, current and older, in no
    /// particular order.
    pub fn all_versions(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values().chain(self.older.values())
    }

    /// Every cached version of sectors `first..=last`, the newest of each
    /// sector last: (sector, entry), sorted by sector, then age.
    pub fn versions(&self, first: u64, last: u64) -> Vec<(u64, Entry)> {
        let mut all: Vec<(u64, Entry)> = self.entries.range(first..=last).map(|(s, e)| (*s, *e)).collect();
        if !self.older.is_empty() {
            all.extend(
                self.older
                    .range((first, 0)..=(last, u64::MAX))
                    .map(|((s, _), e)| (*s, *e)),
            );
            all.sort_unstable_by_key(|(sector, entry)| (*sector, entry.seq));
        }
        all
    }

    /// Puts a version found after a restart (in the RAM tier or the log)
    /// among the sector's versions: the newest is the current one. Returns
    /// the slot of a duplicate of the same version, to release.
    pub fn insert_version(&mut self, sector: u64, entry: Entry) -> Option<u32> {
        match self.entries.get(&sector).copied() {
            Some(current) if current.seq < entry.seq => {
                self.older.insert((sector, current.seq), current);
                self.entries.insert(sector, entry);
                None
            }
            Some(current) if current.seq > entry.seq => self.older.insert((sector, entry.seq), entry).map(|e| e.slot),
            _ => self.entries.insert(sector, entry).map(|e| e.slot),
        }
    }

    /// Removes the older version `(sector, seq)`, keeping the pending count.
    pub fn remove_older(&mut self, sector: u64, seq: u64) -> Option<Entry> {
        let entry = self.older.remove(&(sector, seq))?;
        if self.is_pending(&entry) {
            self.pending -= 1;
        }
        Some(entry)
    }

    /// After a restart, when the volume's snapshots are known: of the
    /// versions of a sector, keeps the newest written before each snapshot
    /// boundary (`floors`, the snapshots' `cache_seq`s, oldest first) and
    /// the newest of all; returns the slots of the others (superseded
    /// within one view: left by a crash between a write and the release of
    /// the version it replaced). Their log positions pass to the version
    /// kept after them, which now holds the log's tail in their place.
    pub fn settle(&mut self, floors: &[u64]) -> Vec<u32> {
        let group = |seq: u64| crate::pool::snapshots::taken_before_count(floors, seq);
        let mut dropped = Vec::new();
        let keys: Vec<(u64, u64)> = self.older.keys().copied().collect();
        for (sector, seq) in keys {
            // The next newer version: another older one, or the current.
            let newer = self
                .older
                .range((sector, seq + 1)..=(sector, u64::MAX))
                .next()
                .map(|(k, e)| (Some(*k), *e))
                .or_else(|| self.entries.get(&sector).map(|e| (None, *e)));
            let Some((newer_key, newer_entry)) = newer else {
                // No newer version: this one is the sector's current one.
                let entry = self.older.remove(&(sector, seq)).expect("listed");
                self.entries.insert(sector, entry);
                continue;
            };
            if group(seq) < group(newer_entry.seq) {
                continue;
            }
            let entry = self.older.remove(&(sector, seq)).expect("listed");
            dropped.push(entry.slot);
            if entry.logged_at != 0 {
                let target = match newer_key {
                    Some(key) => self.older.get_mut(&key),
                    None => self.entries.get_mut(&sector),
                }
                .expect("found above");
                if target.logged_at == 0 {
                    target.logged_at = entry.logged_at;
                    target.log_lsn = entry.log_lsn;
                } else {
                    target.log_lsn = target.log_lsn.min(entry.log_lsn);
                }
            }
        }
        let floor = self.floor;
        self.set_floor(floor);
        dropped
    }

    /// Removes the entry of `sector`, keeping the pending count.
    pub fn remove(&mut self, sector: u64) -> Option<Entry> {
        let entry = self.entries.remove(&sector)?;
        if self.is_pending(&entry) {
            self.pending -= 1;
        }
        Some(entry)
    }
}

pub struct VolumeCache {
    state: Ranked<Mutex<VolState>>,
}

impl Default for VolumeCache {
    fn default() -> Self {
        VolumeCache {
            state: Ranked::new(Rank::VolumeCache, 0, Mutex::default()),
        }
    }
}

impl VolumeCache {
    pub fn lock(&self) -> Held<MutexGuard<'_, VolState>> {
        self.state.lock_or_abort()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().entries.is_empty()
    }
}

/// A sector restored from a Data record.
pub struct Replayed {
    pub volume: u32,
    pub sector: u64,
    pub crc: u32,
    /// The version's cache sequence number (0: unknown, an older pool's).
    pub seq: u64,
    pub data: Arc<[u8]>,
    pub lsn: u64,
}

/// The Data records replay must restore: each version of a sector (by its
/// sequence number: a snapshot taken between two versions needs both)
/// unless a committed `Written` record or a volume's destruction after it
/// supersedes it. The volume's `settle` later keeps only the versions a
/// snapshot boundary separates.
pub fn live_data_records(records: &[(crate::meta::log::Record, bool, u64)]) -> Vec<Replayed> {
    use crate::meta::log::Record;
    let mut live: BTreeMap<(u32, u64, u64), Replayed> = BTreeMap::new();
    for (record, committed, lsn) in records {
        match record {
            Record::Data {
                volume,
                sector,
                crc,
                seq,
                data,
            } => {
                live.insert(
                    (*volume, *sector, *seq),
                    Replayed {
                        volume: *volume,
                        sector: *sector,
                        crc: *crc,
                        seq: *seq,
                        data: data.clone(),
                        lsn: *lsn,
                    },
                );
            }
            Record::Written {
                volume,
                first_sector,
                count,
            } if *committed => {
                let keys: Vec<(u32, u64, u64)> = live
                    .range((*volume, *first_sector, 0)..(*volume, first_sector + *count as u64, 0))
                    .map(|(k, _)| *k)
                    .collect();
                for key in keys {
                    live.remove(&key);
                }
            }
            Record::Destroy { volume } => {
                live.retain(|(v, _, _), _| v != volume);
            }
            _ => {}
        }
    }
    live.into_values().collect()
}

/// Counters for `pool status` and metrics.
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct CacheStats {
    pub ram_bytes: u64,
    pub dirty_bytes: u64,
    /// Bytes written into the cache by clients.
    pub written_bytes: u64,
    /// Bytes logged to the intent log (Data records).
    pub logged_bytes: u64,
    /// Bytes destaged to the data devices.
    pub destaged_bytes: u64,
    /// Writes that waited for space (backpressure).
    pub stalls: u64,
}

pub struct WriteCache {
    pub ram: RamTier,
    volumes: Ranked<Mutex<HashMap<u32, Arc<VolumeCache>>>>,
    seq: AtomicU64,
    ordinal: AtomicU64,
    pub space: tokio::sync::Notify,
    pub written_bytes: AtomicU64,
    pub logged_bytes: AtomicU64,
    pub destaged_bytes: AtomicU64,
    pub stalls: AtomicU64,
    /// Round-robin position of the destager over volumes.
    pub(crate) cursor: AtomicU64,
}

impl WriteCache {
    /// A cache over `ram`, holding what survived in it (a process kill):
    /// those sectors count as unlogged and as possibly described by live log
    /// records from `log_tail` on.
    pub fn new(ram: RamTier, survivors: &[Survivor], log_tail: u64) -> WriteCache {
        let cache = WriteCache {
            ram,
            volumes: Ranked::new(Rank::CacheVolumes, 0, Mutex::new(HashMap::new())),
            seq: AtomicU64::new(survivors.iter().map(|s| s.seq).max().unwrap_or(0) + 1),
            ordinal: AtomicU64::new(1),
            space: tokio::sync::Notify::new(),
            written_bytes: AtomicU64::new(0),
            logged_bytes: AtomicU64::new(0),
            destaged_bytes: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            cursor: AtomicU64::new(0),
        };
        let now = Instant::now();
        for survivor in survivors {
            let volume = cache.volume(survivor.volume);
            // Versions of one sector split by a snapshot all survive; the
            // volume's `settle` drops the superseded ones once it is open.
            let duplicate = volume.lock().insert_version(
                survivor.sector,
                Entry {
                    slot: survivor.slot,
                    seq: survivor.seq,
                    crc: survivor.crc,
                    unlogged: true,
                    logged_at: cache.next_ordinal(),
                    log_lsn: log_tail,
                    since: now,
                    placed: false,
                },
            );
            if let Some(slot) = duplicate {
                // SAFETY: no entry refers to it any more (replaced above).
                unsafe { cache.ram.release(slot) };
            }
        }
        cache
    }

    /// Puts sectors restored from the intent log into the cache as logged
    /// dirty entries (they stay until destaged, holding the log's tail).
    ///
    /// A version whose record lies at or after `committed_end` came from a
    /// staged block: recovery's next commits write over that part of the
    /// log (and it seals it), so it counts as not logged — the next FLUSH
    /// logs it again — as a version that survived in the RAM tier does.
    /// Counting it as logged lost it at the crash after
    /// (`tests/engine_sim_concurrent.rs`, 3000 seeds: seed 887).
    pub fn restore(&self, replayed: Vec<Replayed>, committed_end: u64) {
        let Some(slots) = self.ram.allocate(replayed.len()) else {
            // `Pool::recover` sized the tier for them.
            panic!("RAM tier too small for the replayed intent log");
        };
        let now = Instant::now();
        // Versions keep their sequence numbers (a snapshot's `cache_seq`
        // says which belong to it); new ones come after all of them.
        if let Some(newest) = replayed.iter().map(|r| r.seq).max() {
            self.advance_seq(newest + 1);
        }
        for (record, slot) in replayed.into_iter().zip(slots) {
            // An older pool's record (no number): after every snapshot,
            // which that pool took only with the cache placed.
            let seq = if record.seq != 0 { record.seq } else { self.next_seq(1) };
            // SAFETY: `slot` was just allocated above and is written once.
            unsafe {
                self.ram
                    .write(slot, record.volume, record.sector, seq, &record.data, record.crc)
            };
            let volume = self.volume(record.volume);
            let duplicate = volume.lock().insert_version(
                record.sector,
                Entry {
                    slot,
                    seq,
                    crc: record.crc,
                    unlogged: record.lsn >= committed_end,
                    logged_at: self.next_ordinal(),
                    log_lsn: record.lsn.min(committed_end),
                    since: now,
                    placed: false,
                },
            );
            if let Some(slot) = duplicate {
                // SAFETY: no entry refers to it any more (replaced above).
                unsafe { self.ram.release(slot) };
            }
        }
    }

    pub fn next_seq(&self, count: u64) -> u64 {
        self.seq.fetch_add(count, Ordering::AcqRel)
    }

    /// The sequence number the next cached write gets: every entry written
    /// so far is below it.
    pub fn current_seq(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    /// Makes the next sequence numbers at least `at` (after a restart:
    /// above every snapshot's `cache_seq` and every restored version).
    pub fn advance_seq(&self, at: u64) {
        self.seq.fetch_max(at, Ordering::AcqRel);
    }

    pub fn next_ordinal(&self) -> u64 {
        self.ordinal.fetch_add(1, Ordering::AcqRel)
    }

    pub fn volume(&self, id: u32) -> Arc<VolumeCache> {
        self.volumes.lock_or_abort().entry(id).or_default().clone()
    }

    /// Drops every entry of a volume (destroyed): frees its slots. Returns
    /// the entries dropped and the pool space reserved for them.
    pub fn forget_volume(&self, id: u32) -> (usize, u64) {
        let Some(volume) = self.volumes.lock_or_abort().remove(&id) else {
            return (0, 0);
        };
        let mut state = volume.lock();
        let count = state.entries.len() + state.older.len();
        let reserved = state.reserved.len() as u64 * state.block_bytes;
        state.reserved.clear();
        for entry in state.all_versions() {
            // SAFETY: the volume is destroyed (no reader is left) and its
            // entries, the slots' only references, are cleared below.
            unsafe { self.ram.release(entry.slot) };
        }
        state.entries.clear();
        state.older.clear();
        state.pending = 0;
        self.space.notify_waiters();
        (count, reserved)
    }

    /// Puts sector images into freshly allocated `slots` (caller holds the
    /// stripe locks exclusively). `logged`: the images are being logged now,
    /// with this ordinal and log-position bound. Returns the sectors'
    /// checksums and the sequence number of the first (the others follow).
    pub fn put(
        &self,
        volume_id: u32,
        volume: &VolumeCache,
        first_sector: u64,
        images: &[u8],
        slots: &[u32],
        logged: Option<(u64, u64)>,
    ) -> (Vec<u32>, u64) {
        let count = images.len() / SLOT_BYTES;
        debug_assert_eq!(count, slots.len());
        let seq = self.next_seq(count as u64);
        let mut crcs = Vec::with_capacity(count);
        for (i, image) in images.chunks(SLOT_BYTES).enumerate() {
            let crc = crate::checksum::crc32c(image);
            // SAFETY: the caller allocated `slots` for this call (see the doc).
            unsafe {
                self.ram
                    .write(slots[i], volume_id, first_sector + i as u64, seq + i as u64, image, crc)
            };
            crcs.push(crc);
        }
        let now = Instant::now();
        let mut state = volume.lock();
        let mut freed = Vec::new();
        for i in 0..count {
            let sector = first_sector + i as u64;
            let old = state.entries.get(&sector).copied();
            // A version that belongs to a snapshot (written before it) is
            // kept, not replaced, until a destage has placed and committed
            // it: it keeps its own log position.
            let keep_old = old.is_some_and(|o| o.seq < state.floor);
            let (mut logged_at, mut log_lsn) = match old {
                Some(o) if !keep_old => (o.logged_at, o.log_lsn),
                _ => (0, 0),
            };
            if let Some((ordinal, lsn)) = logged {
                if logged_at == 0 {
                    log_lsn = lsn;
                }
                logged_at = ordinal;
            }
            state.entries.insert(
                sector,
                Entry {
                    slot: slots[i],
                    seq: seq + i as u64,
                    crc: crcs[i],
                    unlogged: logged.is_none(),
                    logged_at,
                    log_lsn,
                    since: old.map(|o| o.since).unwrap_or(now),
                    placed: false,
                },
            );
            match old {
                Some(old) if keep_old => {
                    // Still pending (if it was): counted as before.
                    state.older.insert((sector, old.seq), old);
                }
                Some(old) => freed.push(old.slot),
                None => {}
            }
        }
        drop(state);
        for slot in &freed {
            // SAFETY: the entries that referred to these slots were replaced
            // above, and the caller's exclusive stripe locks keep readers
            // (who read slots under shared ones) away.
            unsafe { self.ram.release(*slot) };
        }
        self.written_bytes
            .fetch_add((count * SLOT_BYTES) as u64, Ordering::Relaxed);
        (crcs, seq)
    }

    /// Copies cached sectors over `buf`, which holds volume bytes from
    /// `offset` (caller holds the stripe locks). Returns how many bytes came
    /// from the cache.
    pub fn overlay(&self, volume: &VolumeCache, offset: u64, buf: &mut [u8]) -> usize {
        let end = offset + buf.len() as u64;
        let first = offset / SLOT_BYTES as u64;
        let last = (end - 1) / SLOT_BYTES as u64;
        let state = volume.lock();
        let mut covered = 0;
        for (&sector, entry) in state.entries.range(first..=last) {
            let start = (sector * SLOT_BYTES as u64).max(offset);
            let stop = ((sector + 1) * SLOT_BYTES as u64).min(end);
            let within = (start - sector * SLOT_BYTES as u64) as usize;
            let at = (start - offset) as usize;
            let len = (stop - start) as usize;
            // SAFETY: the entry is in the map under the cache lock we hold,
            // and the caller's stripe locks keep it from being released.
            unsafe { self.ram.read(entry.slot, within, &mut buf[at..at + len]) };
            covered += len;
        }
        covered
    }

    /// The oldest log position a live Data record may have, if any.
    pub fn oldest_log_lsn(&self) -> Option<u64> {
        let volumes: Vec<Arc<VolumeCache>> = self.volumes.lock_or_abort().values().cloned().collect();
        volumes
            .iter()
            .filter_map(|v| {
                v.lock()
                    .all_versions()
                    .filter(|e| e.logged_at != 0)
                    .map(|e| e.log_lsn)
                    .min()
            })
            .min()
    }

    pub fn dirty_slots(&self) -> usize {
        self.ram.total_slots() - self.ram.free_slots()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            ram_bytes: (self.ram.total_slots() * SLOT_BYTES) as u64,
            dirty_bytes: (self.dirty_slots() * SLOT_BYTES) as u64,
            written_bytes: self.written_bytes.load(Ordering::Relaxed),
            logged_bytes: self.logged_bytes.load(Ordering::Relaxed),
            destaged_bytes: self.destaged_bytes.load(Ordering::Relaxed),
            stalls: self.stalls.load(Ordering::Relaxed),
        }
    }
}
