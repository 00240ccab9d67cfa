//! Bounded caches of metadata pages over the metadata store.
//!
//! The block map and the checksum table are far too large to keep whole in
//! memory (a 1 TiB volume has 64 Mi blocks of 16 KiB). They are split into
//! pages; the pages in use live here, entries are atomics (readers and
//! writers never lock a page), and a page is loaded from the store on a miss.
//! Clean pages are evicted when a shard is full; dirty pages stay until a
//! checkpoint writes them. The pool bounds the number of dirty pages by
//! checkpointing when there are too many. A page read from the store is
//! cached only if no page of its shard was evicted during the read (it
//! could be older than the copy a checkpoint wrote before evicting it).

use super::geometry::{CorruptionLog, Geometry};
use super::MetaError;
use crate::sync::{Held, Rank, Ranked};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use redb::TableDefinition;

use super::sealed::{key2, seal, unseal, SEAL_BYTES};
use super::store::{read_page, CRC_PAGES, MAP_PAGES};

pub const MAP_ENTRIES_PER_PAGE: u64 = 256;
pub const CRCS_PER_PAGE: u64 = 1024;
const SHARDS: usize = 16;

/// A page kind: how it is stored and what it holds.
pub trait Page: Send + Sync + 'static {
    const TABLE: TableDefinition<'static, (u32, u64), &'static [u8]>;
    /// The table's name, for messages.
    const NAME: &'static str;
    /// Decodes a page stored under `key`, or makes an empty one (`None`).
    /// A stored page of the wrong length, or whose seal is not the
    /// checksum of its key and bytes, is an error naming the field, never
    /// a page of zeros.
    fn decode(key: PageKey, bytes: Option<&[u8]>) -> Result<Self, MetaError>
    where
        Self: Sized;
    /// The page as stored under `key`: its bytes, sealed.
    fn encode(&self, key: PageKey) -> Vec<u8>;
    fn dirty_flag(&self) -> &AtomicBool;
    /// Checks a decoded page stored under `key` against the pool's
    /// devices; the error names the field.
    fn check(&self, key: PageKey, geometry: &Geometry) -> Result<(), String>;
}

/// 256 block-map entries of one volume, in their stored form (the pool
/// reads and sets them as `pool::BlockPtr`).
pub struct MapPage {
    pub entries: Box<[AtomicU64]>,
    dirty: AtomicBool,
    /// The pool's snapshot generation when this page was last made the
    /// volume's own (created, or copied into the volume's newest snapshot
    /// before a change): a page born before the volume's newest snapshot is
    /// shared with it, and copied before it changes (`pool/snapshots/cow.rs`).
    /// 0 for pages of pools that never had a snapshot.
    pub birth: AtomicU64,
    /// Whether the page exists (stored, or made since): a snapshot that
    /// does not have a page sees its newer neighbour's.
    pub present: AtomicBool,
}

impl MapPage {
    /// A page holding `entries` (a copy), born at `birth`.
    pub fn copied(entries: &[AtomicU64], birth: u64) -> Self {
        MapPage {
            entries: entries
                .iter()
                .map(|e| AtomicU64::new(e.load(Ordering::Acquire)))
                .collect(),
            dirty: AtomicBool::new(false),
            birth: AtomicU64::new(birth),
            present: AtomicBool::new(true),
        }
    }
}

/// Bytes of a map page's entries.
const MAP_PAGE_BYTES: usize = MAP_ENTRIES_PER_PAGE as usize * 8;
/// Bytes of a stored map page: its entries, its birth generation, its seal.
pub const SEALED_MAP_PAGE_BYTES: usize = MAP_PAGE_BYTES + 8 + SEAL_BYTES;
/// Bytes of a stored checksum page: its checksums, its seal.
pub const SEALED_CRC_PAGE_BYTES: usize = CRCS_PER_PAGE as usize * 4 + SEAL_BYTES;

/// The body of a stored page: unsealed when it has the sealed length
/// (the error names the checksum), as it is otherwise (pages stored by
/// pools from before seals, whose length the caller checks).
///
/// Which form a page has is told by its length alone. A flipped bit in
/// the page's bytes fails the seal; one in the lengths redb keeps moves
/// the boundary between two neighbouring values by a power of two, which
/// leaves one of them of no valid length (a sealed page shortened by its
/// seal keeps its own, intact, bytes).
fn unsealed(key: PageKey, bytes: Option<&[u8]>, sealed_len: usize) -> Result<Option<&[u8]>, MetaError> {
    match bytes {
        Some(bytes) if bytes.len() == sealed_len => unseal(&key2(key), bytes).map(Some).map_err(MetaError::Corrupt),
        other => Ok(other),
    }
}

impl Page for MapPage {
    const TABLE: TableDefinition<'static, (u32, u64), &'static [u8]> = MAP_PAGES;
    const NAME: &'static str = "map_pages";

    fn decode(key: PageKey, bytes: Option<&[u8]>) -> Result<Self, MetaError> {
        let bytes = unsealed(key, bytes, SEALED_MAP_PAGE_BYTES)?;
        // A page with a birth carries it in 8 bytes after its entries
        // (every sealed page; unsealed ones of pools that had snapshots).
        let (bytes, birth) = match bytes {
            Some(bytes) if bytes.len() == MAP_PAGE_BYTES + 8 => (
                Some(&bytes[..MAP_PAGE_BYTES]),
                crate::bytes::u64_at(bytes, MAP_PAGE_BYTES).unwrap_or_default(),
            ),
            other => (other, 0),
        };
        let words: Vec<[u8; 8]> = stored_words("map", bytes, MAP_ENTRIES_PER_PAGE as usize, SEALED_MAP_PAGE_BYTES)?;
        Ok(MapPage {
            entries: words
                .into_iter()
                .map(|w| AtomicU64::new(u64::from_le_bytes(w)))
                .collect(),
            dirty: AtomicBool::new(false),
            birth: AtomicU64::new(birth),
            present: AtomicBool::new(bytes.is_some()),
        })
    }

    fn encode(&self, key: PageKey) -> Vec<u8> {
        let mut out: Vec<u8> = Vec::with_capacity(SEALED_MAP_PAGE_BYTES);
        for entry in self.entries.iter() {
            out.extend_from_slice(&entry.load(Ordering::Acquire).to_le_bytes());
        }
        // Always the birth (0 for pools that never had a snapshot): one
        // sealed length, so that no moved value boundary reads as another
        // valid form (see `unsealed`).
        out.extend_from_slice(&self.birth.load(Ordering::Acquire).to_le_bytes());
        seal(&key2(key), &mut out);
        debug_assert_eq!(out.len(), SEALED_MAP_PAGE_BYTES);
        out
    }

    fn dirty_flag(&self) -> &AtomicBool {
        &self.dirty
    }

    /// Every entry is unmapped or maps a slot inside a data device's data.
    fn check(&self, _key: PageKey, geometry: &Geometry) -> Result<(), String> {
        for (index, entry) in self.entries.iter().enumerate() {
            geometry
                .check_map_entry(entry.load(Ordering::Relaxed))
                .map_err(|e| format!("entry {index}: {e}"))?;
        }
        Ok(())
    }
}

/// 1024 sector checksums of one device (4 MiB of it).
pub struct CrcPage {
    pub crcs: Box<[AtomicU32]>,
    dirty: AtomicBool,
}

impl Page for CrcPage {
    const TABLE: TableDefinition<'static, (u32, u64), &'static [u8]> = CRC_PAGES;
    const NAME: &'static str = "crc_pages";

    fn decode(key: PageKey, bytes: Option<&[u8]>) -> Result<Self, MetaError> {
        let bytes = unsealed(key, bytes, SEALED_CRC_PAGE_BYTES)?;
        let words: Vec<[u8; 4]> = stored_words("checksum", bytes, CRCS_PER_PAGE as usize, SEALED_CRC_PAGE_BYTES)?;
        Ok(CrcPage {
            crcs: words
                .into_iter()
                .map(|w| AtomicU32::new(u32::from_le_bytes(w)))
                .collect(),
            dirty: AtomicBool::new(false),
        })
    }

    fn encode(&self, key: PageKey) -> Vec<u8> {
        let mut out: Vec<u8> = Vec::with_capacity(SEALED_CRC_PAGE_BYTES);
        for crc in self.crcs.iter() {
            out.extend_from_slice(&crc.load(Ordering::Acquire).to_le_bytes());
        }
        seal(&key2(key), &mut out);
        out
    }

    fn dirty_flag(&self) -> &AtomicBool {
        &self.dirty
    }

    /// Any checksum value is possible; the key must name a data device
    /// and a page inside it.
    fn check(&self, key: PageKey, geometry: &Geometry) -> Result<(), String> {
        geometry.check_crc_key(key.0, key.1, CRCS_PER_PAGE)
    }
}

/// The `count` little-endian words of a stored page (all zero for a page
/// never stored); a stored page of any other length is an error (naming
/// the sealed length, `sealed_len`, too).
fn stored_words<const N: usize>(
    what: &str,
    bytes: Option<&[u8]>,
    count: usize,
    sealed_len: usize,
) -> Result<Vec<[u8; N]>, MetaError> {
    let Some(bytes) = bytes else {
        return Ok(vec![[0; N]; count]);
    };
    if bytes.len() != count * N {
        return Err(MetaError::Corrupt(format!(
            "field length: stored {what} page is {} bytes, not {sealed_len} (sealed) nor {} ({count} entries of {N} bytes, unsealed)",
            bytes.len(),
            count * N
        )));
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|word| word.try_into().expect("chunks_exact yields N bytes"))
        .collect())
}

pub type PageKey = (u32, u64);
/// A page copied for a checkpoint: its key, its encoded bytes, the page.
pub type TakenPage<P> = (PageKey, Vec<u8>, Arc<P>);

/// Pages copied in two rounds (see [`PageCache::take_dirty`]): the first
/// round's copies, except where the second copied the page again.
pub fn newest_copies<P>(early: Vec<TakenPage<P>>, late: Vec<TakenPage<P>>) -> Vec<TakenPage<P>> {
    let again: std::collections::HashSet<PageKey> = late.iter().map(|(key, _, _)| *key).collect();
    let mut pages: Vec<TakenPage<P>> = early.into_iter().filter(|(key, _, _)| !again.contains(key)).collect();
    pages.extend(late);
    pages
}

pub struct PageCache<P: Page> {
    shards: Vec<Ranked<Mutex<Shard<P>>>>,
    max_pages_per_shard: usize,
    dirty_pages: AtomicUsize,
    /// Pages read from the store (not found cached), since start.
    misses: AtomicU64,
    /// What a page loaded from the store is checked against (`None`: not
    /// checked, for caches without a pool in unit tests).
    geometry: Option<Arc<RwLock<Geometry>>>,
    /// Where corrupt pages met are counted and logged.
    corruption: Arc<CorruptionLog>,
}

/// One shard: its pages, and their indexes by owner (the key's first part),
/// so that the pages of one volume or snapshot are found without a look
/// at every cached key (a pool with thousands of snapshots asks this for
/// each of them).
struct Shard<P> {
    pages: HashMap<PageKey, Arc<P>>,
    by_owner: HashMap<u32, BTreeSet<u64>>,
    /// Pages removed so far (evicted or forgotten): a page read from the
    /// store while one was removed may be older than what a checkpoint
    /// wrote before it was evicted (see [`PageCache::get`]).
    removed: u64,
}

impl<P> Shard<P> {
    fn insert(&mut self, key: PageKey, page: Arc<P>) {
        if self.pages.insert(key, page).is_none() {
            self.by_owner.entry(key.0).or_default().insert(key.1);
        }
    }

    fn remove(&mut self, key: PageKey) -> Option<Arc<P>> {
        let page = self.pages.remove(&key)?;
        self.removed += 1;
        if let Some(indexes) = self.by_owner.get_mut(&key.0) {
            indexes.remove(&key.1);
            if indexes.is_empty() {
                self.by_owner.remove(&key.0);
            }
        }
        Some(page)
    }
}

impl<P: Page> PageCache<P> {
    /// A cache holding about `max_pages` clean pages.
    pub fn new(max_pages: usize) -> Self {
        PageCache {
            shards: (0..SHARDS)
                .map(|shard| {
                    let shard_state = Shard {
                        pages: HashMap::new(),
                        by_owner: HashMap::new(),
                        removed: 0,
                    };
                    Ranked::new(Rank::PageCache, shard as u64, Mutex::new(shard_state))
                })
                .collect(),
            max_pages_per_shard: (max_pages / SHARDS).max(4),
            dirty_pages: AtomicUsize::new(0),
            misses: AtomicU64::new(0),
            geometry: None,
            corruption: Arc::default(),
        }
    }

    /// This cache, checking every page it loads against `geometry` and
    /// counting corrupt ones in `corruption`.
    pub fn checked(mut self, geometry: Arc<RwLock<Geometry>>, corruption: Arc<CorruptionLog>) -> Self {
        self.geometry = Some(geometry);
        self.corruption = corruption;
        self
    }

    /// Decodes and checks a page stored under `key` (`None`: never stored).
    /// A corrupt page is an error naming the table, the key and the field,
    /// counted and logged once.
    pub fn decode_checked(&self, key: PageKey, stored: Option<&[u8]>) -> Result<P, MetaError> {
        let page = P::decode(key, stored).and_then(|page| {
            if let (Some(geometry), Some(_)) = (&self.geometry, stored) {
                let geometry = geometry.read().unwrap_or_else(|_| crate::sync::poisoned());
                page.check(key, &geometry).map_err(MetaError::Corrupt)?;
            }
            Ok(page)
        });
        page.map_err(|e| match e {
            MetaError::Corrupt(what) => {
                let what = format!("table {} key {key:?}: {what}", P::NAME);
                self.corruption.note(&what);
                MetaError::Corrupt(what)
            }
            other => other,
        })
    }

    fn shard(&self, key: PageKey) -> Held<std::sync::MutexGuard<'_, Shard<P>>> {
        let hash = (key.0 as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ key.1.wrapping_mul(0xff51_afd7_ed55_8ccd);
        self.shards[(hash >> 32) as usize % SHARDS].lock_or_abort()
    }

    /// The page, from the cache or loaded from the store.
    pub fn get(&self, db: &redb::Database, key: PageKey) -> Result<Arc<P>, MetaError> {
        loop {
            let removed = {
                let shard = self.shard(key);
                if let Some(page) = shard.pages.get(&key) {
                    return Ok(page.clone());
                }
                shard.removed
            };
            self.misses.fetch_add(1, Ordering::Relaxed);
            let stored = read_page(db, P::TABLE, key)?;
            let page = Arc::new(self.decode_checked(key, stored.as_deref())?);
            if let Some(page) = self.install(key, page, removed) {
                return Ok(page);
            }
        }
    }

    /// Caches a page read from the store, unless the cache has it by now
    /// (that copy is returned) or a page of its shard was removed since
    /// `removed` was counted, before the read began (`None`: read again).
    /// The removed page may have been this one: loaded by another thread
    /// meanwhile, changed, written by a checkpoint and evicted, all while
    /// this read saw the store as it was before; cached, the older copy
    /// would hide those changes, and the next checkpoint would store it
    /// with them lost.
    fn install(&self, key: PageKey, page: Arc<P>, removed: u64) -> Option<Arc<P>> {
        let mut shard = self.shard(key);
        if let Some(existing) = shard.pages.get(&key) {
            return Some(existing.clone());
        }
        if shard.removed != removed {
            return None;
        }
        if shard.pages.len() >= self.max_pages_per_shard {
            evict(&mut shard);
        }
        shard.insert(key, page.clone());
        Some(page)
    }

    /// The page if it is cached (never loaded from the store).
    pub fn peek(&self, key: PageKey) -> Option<Arc<P>> {
        self.shard(key).pages.get(&key).cloned()
    }

    /// Installs a page (replay and tests); replaces any cached copy.
    pub fn put(&self, key: PageKey, page: P) -> Arc<P> {
        let page = Arc::new(page);
        self.shard(key).insert(key, page.clone());
        page
    }

    /// Marks a page dirty (it stays cached until a checkpoint writes it).
    pub fn mark_dirty(&self, page: &P) {
        if !page.dirty_flag().swap(true, Ordering::AcqRel) {
            self.dirty_pages.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn dirty_count(&self) -> usize {
        self.dirty_pages.load(Ordering::Relaxed)
    }

    /// Takes a copy of every dirty page and marks them clean. The copy is
    /// consistent when the caller holds the pool's write gate (nothing
    /// changes a page meanwhile). Without the gate a page may change while
    /// it is copied; it is then dirty again (a change stores its entries
    /// before it marks the page), so a later call under the gate takes it
    /// again (see `Pool::checkpoint_metadata`). If writing the copy fails
    /// the caller calls [`Self::restore_dirty`].
    pub fn take_dirty(&self) -> Vec<TakenPage<P>> {
        // Encoded outside the shard locks: lookups of other pages go on.
        let mut pages = Vec::new();
        for shard in &self.shards {
            let shard = shard.lock_or_abort();
            for (key, page) in shard.pages.iter() {
                if page.dirty_flag().swap(false, Ordering::AcqRel) {
                    self.dirty_pages.fetch_sub(1, Ordering::Relaxed);
                    pages.push((*key, page.clone()));
                }
            }
        }
        pages
            .into_iter()
            .map(|(key, page)| (key, page.encode(key), page))
            .collect()
    }

    pub fn restore_dirty(&self, taken: &[TakenPage<P>]) {
        for (_, _, page) in taken {
            self.mark_dirty(page);
        }
    }

    /// Drops every cached page whose key's first part is `owner` (a
    /// destroyed volume or snapshot): the work is its own pages, not the
    /// whole cache.
    pub fn forget_owner(&self, owner: u32) {
        for shard in &self.shards {
            let mut shard = shard.lock_or_abort();
            let Some(indexes) = shard.by_owner.remove(&owner) else {
                continue;
            };
            for index in indexes {
                if let Some(page) = shard.pages.remove(&(owner, index)) {
                    shard.removed += 1;
                    if page.dirty_flag().swap(false, Ordering::AcqRel) {
                        self.dirty_pages.fetch_sub(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// Keys of every cached page.
    pub fn keys(&self) -> Vec<PageKey> {
        self.shards
            .iter()
            .flat_map(|s| s.lock_or_abort().pages.keys().copied().collect::<Vec<_>>())
            .collect()
    }

    /// The pages of `owner` in the cache (page indexes, in order), from
    /// the per-owner index: proportional to the owner's pages.
    pub fn keys_of(&self, owner: u32) -> Vec<u64> {
        let mut indexes: Vec<u64> = Vec::new();
        for shard in &self.shards {
            if let Some(own) = shard.lock_or_abort().by_owner.get(&owner) {
                indexes.extend(own.iter().copied());
            }
        }
        indexes.sort_unstable();
        indexes
    }

    /// The first `max` cached page indexes of `owner` from `from` on, in
    /// order (what `keys_of` gives, a window at a time).
    pub fn keys_of_from(&self, owner: u32, from: u64, max: usize) -> Vec<u64> {
        let mut indexes: Vec<u64> = Vec::new();
        for shard in &self.shards {
            if let Some(own) = shard.lock_or_abort().by_owner.get(&owner) {
                indexes.extend(own.range(from..).take(max).copied());
            }
        }
        indexes.sort_unstable();
        indexes.truncate(max);
        indexes
    }

    /// Pages read from the store since start because they were not cached.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// The most pages it holds (clean ones are evicted past it).
    pub fn capacity(&self) -> usize {
        self.max_pages_per_shard * SHARDS
    }

    /// Number of cached pages.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock_or_abort().pages.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Removes up to a few clean pages nobody else holds.
fn evict<P: Page>(shard: &mut Shard<P>) {
    let victims: Vec<PageKey> = shard
        .pages
        .iter()
        .filter(|(_, page)| !page.dirty_flag().load(Ordering::Acquire) && Arc::strong_count(page) == 1)
        .map(|(key, _)| *key)
        .take(8)
        .collect();
    for key in victims {
        shard.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader misses a page and reads the store; meanwhile another
    /// loads the page, changes it, a checkpoint writes it and it is
    /// evicted. The reader's copy (the store before that checkpoint) must
    /// not be cached: it would hide the change, and the next checkpoint
    /// would store it without.
    #[test]
    fn a_page_read_before_a_checkpoint_is_not_cached_after_the_newer_copy_was_evicted() {
        let cache: PageCache<MapPage> = PageCache::new(64);
        let key = (1, 5);
        let blank = || MapPage::decode((0, 0), None).unwrap();
        let removed = cache.shard(key).removed;
        let stale = Arc::new(blank());
        // The other thread's load, change and checkpoint, then eviction.
        let page = cache.put(key, blank());
        page.entries[0].store(7, Ordering::Release);
        cache.mark_dirty(&page);
        drop(cache.take_dirty());
        drop(page);
        evict(&mut cache.shard(key));
        assert!(cache.peek(key).is_none(), "evicted");
        assert!(
            cache.install(key, stale, removed).is_none(),
            "the older copy was cached"
        );
        // A read that began after the eviction is cached.
        let removed = cache.shard(key).removed;
        let fresh = Arc::new(blank());
        fresh.entries[0].store(7, Ordering::Release);
        let cached = cache.install(key, fresh, removed).expect("cached");
        assert_eq!(cache.peek(key).unwrap().entries[0].load(Ordering::Acquire), 7);
        // And a read that finds the page cached by then gets that copy.
        assert!(Arc::ptr_eq(
            &cache.install(key, Arc::new(blank()), removed).unwrap(),
            &cached
        ));
    }

    #[test]
    fn the_owner_index_follows_the_cache() {
        let cache: PageCache<MapPage> = PageCache::new(64);
        let page = || MapPage::decode((0, 0), None).unwrap();
        for index in [7, 3, 300, 5] {
            cache.put((1, index), page());
        }
        cache.put((2, 3), page());
        // Replacing a page keeps one key.
        cache.put((1, 3), page());
        assert_eq!(cache.keys_of(1), vec![3, 5, 7, 300]);
        assert_eq!(cache.keys_of(2), vec![3]);
        assert!(cache.keys_of(9).is_empty());
        let dirty = cache.put((1, 5), page());
        cache.mark_dirty(&dirty);
        drop(dirty);
        assert_eq!(cache.dirty_count(), 1);
        cache.forget_owner(1);
        assert!(cache.keys_of(1).is_empty());
        assert_eq!(cache.dirty_count(), 0, "a forgotten dirty page is not counted");
        assert_eq!(cache.keys(), vec![(2, 3)]);
        assert_eq!(cache.len(), 1);
        // Eviction (shards of 4 pages here) drops pages from the index too.
        for index in 0..200 {
            cache.put((3, index), page());
            // What `get` does on a miss: make room first.
            let mut shard = cache.shard((3, index));
            if shard.pages.len() > cache.max_pages_per_shard {
                evict(&mut shard);
            }
        }
        let cached: Vec<u64> = cache
            .keys()
            .into_iter()
            .filter(|key| key.0 == 3)
            .map(|key| key.1)
            .collect();
        assert!(cached.len() < 200, "{} cached", cached.len());
        let mut sorted = cached;
        sorted.sort_unstable();
        assert_eq!(cache.keys_of(3), sorted);
    }

    /// A checkpoint copies the dirty pages before it stops writers and
    /// again under its gate: a page changed between the two rounds is dirty
    /// again, and its second copy is the one stored.
    #[test]
    fn a_page_changed_after_it_was_copied_is_copied_again_and_that_copy_wins() {
        let cache: PageCache<MapPage> = PageCache::new(64);
        let page = |entry: u64| {
            let page = MapPage::decode((0, 0), None).unwrap();
            page.entries[0].store(entry, Ordering::Relaxed);
            page
        };
        let changed = cache.put((1, 0), page(10));
        let unchanged = cache.put((1, 1), page(20));
        cache.mark_dirty(&changed);
        cache.mark_dirty(&unchanged);
        let early = cache.take_dirty();
        assert_eq!(early.len(), 2);
        assert_eq!(cache.dirty_count(), 0);
        // A writer changes one page after the first round (entry first,
        // then the mark, as `Pool::set_mapping` does).
        changed.entries[0].store(11, Ordering::Release);
        cache.mark_dirty(&changed);
        let late = cache.take_dirty();
        assert_eq!(late.len(), 1, "only the changed page is taken again");
        let mut pages = newest_copies(early, late);
        pages.sort_by_key(|(key, _, _)| *key);
        let first_entry = |bytes: &[u8]| u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!(pages.len(), 2);
        assert_eq!(pages[0].0, (1, 0));
        assert_eq!(first_entry(&pages[0].1), 11, "the copy taken after the change");
        assert_eq!(first_entry(&pages[1].1), 20);
        // A failed checkpoint marks every copied page dirty again.
        cache.restore_dirty(&pages);
        assert_eq!(cache.dirty_count(), 2);
    }

    #[test]
    fn a_stored_page_of_the_wrong_length_is_an_error_not_zeros() {
        // An unsealed map page (as pools from before seals stored them)
        // with one entry fewer than it should have: its last entry must
        // not decode as unmapped.
        let key = (1, 0);
        let mut bytes = Vec::new();
        for i in 0..MAP_ENTRIES_PER_PAGE {
            bytes.extend_from_slice(&(i | 1 << 63).to_le_bytes());
        }
        let page = MapPage::decode(key, Some(&bytes)).unwrap();
        assert_eq!(page.entries[5].load(Ordering::Relaxed), 5 | 1 << 63);
        let error = MapPage::decode(key, Some(&bytes[..bytes.len() - 8]))
            .err()
            .expect("short page refused");
        assert!(matches!(error, MetaError::Corrupt(_)));
        let error = error.to_string();
        assert!(
            error.contains("field length: stored map page is 2040 bytes, not 2060 (sealed) nor 2048"),
            "{error}"
        );
        assert!(MapPage::decode(key, Some(&[0u8; 2049])).is_err());
        // An unsealed page with a birth generation: 8 more bytes.
        let mut born = bytes.clone();
        born.extend_from_slice(&7u64.to_le_bytes());
        let page = MapPage::decode(key, Some(&born)).unwrap();
        assert_eq!(page.birth.load(Ordering::Relaxed), 7);
        assert!(page.present.load(Ordering::Relaxed));
        assert!(!MapPage::decode(key, None).unwrap().present.load(Ordering::Relaxed));
        let error = CrcPage::decode(key, Some(&[0u8; 10]))
            .err()
            .expect("short page refused")
            .to_string();
        assert!(error.contains("checksum page is 10 bytes"), "{error}");
        // A page never stored is empty.
        let empty = CrcPage::decode(key, None).unwrap();
        assert!(empty.crcs.iter().all(|c| c.load(Ordering::Relaxed) == 0));
        assert_eq!(empty.crcs.len(), CRCS_PER_PAGE as usize);
    }

    /// Pages are written sealed; older unsealed pages still decode, and
    /// are sealed when next written.
    #[test]
    fn pages_are_stored_sealed_and_unsealed_ones_still_decode() {
        let key = (1, 9);
        let entries: Vec<u8> = (0..MAP_ENTRIES_PER_PAGE)
            .flat_map(|i| (i | 1 << 63).to_le_bytes())
            .collect();
        for birth in [0u64, 7] {
            let mut old = entries.clone();
            if birth != 0 {
                old.extend_from_slice(&birth.to_le_bytes());
            }
            let page = MapPage::decode(key, Some(&old)).unwrap();
            let sealed = page.encode(key);
            assert_eq!(sealed.len(), SEALED_MAP_PAGE_BYTES);
            assert_eq!(sealed[..MAP_PAGE_BYTES], entries[..]);
            assert_eq!(sealed[MAP_PAGE_BYTES..MAP_PAGE_BYTES + 8], birth.to_le_bytes());
            let again = MapPage::decode(key, Some(&sealed)).unwrap();
            assert_eq!(again.birth.load(Ordering::Relaxed), birth);
            assert_eq!(again.encode(key), sealed);
            // Under another key the seal fails: a page found where it does
            // not belong is not used.
            let error = MapPage::decode((1, 10), Some(&sealed))
                .err()
                .expect("moved page refused");
            assert!(error.to_string().contains("checksum: stored"), "{error}");
        }
        let crcs: Vec<u8> = (0..CRCS_PER_PAGE as u32).flat_map(|i| i.to_le_bytes()).collect();
        let page = CrcPage::decode(key, Some(&crcs)).unwrap();
        let sealed = page.encode(key);
        assert_eq!(sealed.len(), SEALED_CRC_PAGE_BYTES);
        assert_eq!(sealed[..crcs.len()], crcs[..]);
        assert_eq!(CrcPage::decode(key, Some(&sealed)).unwrap().encode(key), sealed);
    }

    /// One flipped bit anywhere in a stored page (entries, birth, seal)
    /// fails its load with a corrupt-metadata error naming the table, the
    /// key and the checksum; the page loaded before the flip.
    fn a_flipped_bit_fails_the_load<P: Page>(page: &P, key: PageKey) {
        let cache: PageCache<P> = PageCache::new(64);
        let stored = page.encode(key);
        assert!(cache.decode_checked(key, Some(&stored)).is_ok(), "the page as stored");
        for bit in 0..stored.len() * 8 {
            let mut flipped = stored.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let error = cache
                .decode_checked(key, Some(&flipped))
                .err()
                .unwrap_or_else(|| panic!("bit {bit} flipped, the page still loads"));
            assert!(matches!(error, MetaError::Corrupt(_)));
            let text = error.to_string();
            let named = format!("corrupt metadata: table {} key {key:?}: checksum: stored", P::NAME);
            assert!(text.starts_with(&named), "{text}");
        }
        assert!(cache.corruption.count() > 0, "each failure is counted");
    }

    #[test]
    fn a_flipped_bit_in_a_stored_map_page_fails_its_load() {
        let page = MapPage::decode((2, 3), None).unwrap();
        for (i, entry) in page.entries.iter().enumerate() {
            entry.store(1 << 63 | (i as u64 + 100), Ordering::Relaxed);
        }
        page.birth.store(5, Ordering::Relaxed);
        a_flipped_bit_fails_the_load(&page, (2, 3));
        // A page of a pool that never had a snapshot (birth 0) too.
        a_flipped_bit_fails_the_load(&MapPage::decode((2, 4), None).unwrap(), (2, 4));
    }

    #[test]
    fn a_flipped_bit_in_a_stored_checksum_page_fails_its_load() {
        let page = CrcPage::decode((1, 30), None).unwrap();
        for (i, crc) in page.crcs.iter().enumerate() {
            crc.store(i as u32 * 0x9e37_79b9, Ordering::Relaxed);
        }
        a_flipped_bit_fails_the_load(&page, (1, 30));
    }
}
