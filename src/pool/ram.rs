//! The RAM tier: memory that holds the write-back cache's dirty sectors.
//!
//! It is a shared mapping of a file (by default in the pool's directory; on
//! tmpfs it is pure RAM), so dirty data outlives the daemon process — a
//! kill -9, a crash or a restart finds it again — but not a reboot or a power
//! loss: the region records the boot it belongs to and is discarded after
//! another one. Without a file it lives on the heap (tests, the simulator,
//! which keeps the heap image across a simulated kill and wipes it for a
//! simulated power loss).
//!
//! Layout (docs/FORMAT.md): a 4 KiB region header, a table of 32-byte slot
//! headers, the 4 KiB slots, then the in-place marks. A slot is written
//! data first, then its header fields, then its magic (after a release
//! fence), so a valid magic means the slot is complete; the data checksum
//! guards the rest. A slot is freed by clearing its magic before it can be
//! reused.
//!
//! The in-place marks say which sectors of the pool's devices were written
//! in place since the last checkpoint (a bounded hash table of chunks, each
//! entry a chunk's 256-part bitmap labelled with its epoch: see
//! [`RamTier::note_in_place`]). They are set before the data is written, so
//! after a process crash they name every sector whose checksum may describe
//! other data than the device holds, and recovery repairs only those; the
//! same reasons that keep the slots valid keep them (a region of the same
//! pool and boot).

use std::alloc::Layout;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::{Rank, Ranked};

pub const SLOT_BYTES: usize = 4096;
const SLOT_HEADER_BYTES: usize = 32;
const REGION_HEADER_BYTES: usize = 4096;
const REGION_MAGIC: u64 = u64::from_le_bytes(*b"STRATRAM");
const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"SRSL");
const VERSION: u32 = 1;
/// Where the header records the data directory: its length (`u16`, 0 when
/// not recorded), then its bytes, up to the header's checksum.
const DATA_DIR_AT: usize = 68;
const MAX_DATA_DIR_BYTES: usize = REGION_HEADER_BYTES - 4 - DATA_DIR_AT - 2;
/// Smallest RAM tier: 64 slots.
pub const MIN_RAM_BYTES: u64 = 1 << 20;
const MARKS_MAGIC: u64 = u64::from_le_bytes(*b"STRAMARK");
const MARKS_HEADER_BYTES: usize = 4096;
/// An in-place mark: key (device and chunk, 0 when never used), epoch
/// label, then the chunk's 256-part bitmap; six `u64`.
const MARK_WORDS: usize = 6;
/// How many entries from a chunk's hash slot it may take.
const MARK_WINDOW: usize = 16;

/// The sectors the in-place marks of a region name, found at open.
#[derive(Debug, Default)]
pub struct CrashMarks {
    /// Per (device, chunk): the parts written in place in an epoch after
    /// the covered one.
    pub chunks: std::collections::HashMap<(u8, u64), super::ChunkParts>,
    /// Some chunk written in place then found no free entry: a chunk with
    /// no entry may have been written anywhere.
    pub overflowed: bool,
}

/// Heap memory for a RAM tier without a file. The simulator keeps an `Arc`
/// of it across a simulated process kill.
pub struct HeapImage {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the image is plain memory; `RamTier` coordinates access to it.
unsafe impl Send for HeapImage {}
// SAFETY: as for `Send` just above.
unsafe impl Sync for HeapImage {}

impl HeapImage {
    pub fn new(bytes: u64) -> Arc<HeapImage> {
        let len = region_len(slots_for(bytes));
        let layout = Layout::from_size_align(len, 4096).expect("ram tier layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Arc::new(HeapImage { ptr, len })
    }

    /// Forgets everything (a simulated power loss).
    ///
    /// Panics unless the caller's handle is the only one: a `RamTier` over
    /// the image holds another, so the image cannot be wiped under a pool
    /// that still uses it.
    pub fn wipe(self: &Arc<Self>) {
        assert_eq!(
            Arc::strong_count(self),
            1,
            "a RAM image is wiped only after every pool using it has been dropped"
        );
        // SAFETY: the assertion shows this `Arc` is the only one (and no
        // `Weak` is ever made of it), so nothing else can reach the memory
        // while we hold `&Arc<Self>`.
        unsafe { std::ptr::write_bytes(self.ptr, 0, self.len) };
    }
}

impl Drop for HeapImage {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, 4096).expect("ram tier layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// Where a pool's RAM tier lives.
#[derive(Clone)]
pub enum RamSource {
    /// A file mapping of `bytes` (created or resized as needed), recording
    /// in its header the data directory it belongs to (so a file left in
    /// /dev/shm can be told apart: `strata ram-tier list`).
    File {
        path: PathBuf,
        bytes: u64,
        data_dir: Option<PathBuf>,
    },
    /// Heap memory.
    Heap(Arc<HeapImage>),
}

enum Backing {
    /// The mapping, and the file whose exclusive flock keeps a second
    /// process from mapping the same region.
    File(#[allow(dead_code)] memmap2::MmapMut, #[allow(dead_code)] std::fs::File),
    Heap(#[allow(dead_code)] Arc<HeapImage>),
}

/// A dirty sector found in the region when it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Survivor {
    pub slot: u32,
    pub volume: u32,
    pub sector: u64,
    pub seq: u64,
    pub crc: u32,
}

pub struct RamTier {
    _backing: Backing,
    base: *mut u8,
    slots: u32,
    free: Ranked<Mutex<Vec<u32>>>,
    free_count: AtomicUsize,
    location: String,
    path: Option<PathBuf>,
    data_dir: Option<PathBuf>,
    /// Whether the in-place marks were found as a process left them.
    marks_intact: bool,
    /// Held to take an in-place marks entry (once per chunk per epoch).
    mark_claim: Mutex<()>,
    /// Debug builds: what each slot is, checked on every change of hands
    /// (a double free, a write to a slot nobody allocated, a read of a
    /// free slot panic at once instead of corrupting another sector).
    #[cfg(debug_assertions)]
    shadow: Ranked<Mutex<Vec<SlotState>>>,
}

/// Shadow state of one slot (kept in debug builds only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Taken by `allocate`, not yet written.
    Allocated,
    /// Written: holds a valid sector image.
    Valid,
}

// SAFETY: slots are only written by the holder of a freshly allocated slot
// and only read or freed under the owning volume's stripe locks (see
// `pool::cache`); the free list is behind a mutex.
unsafe impl Send for RamTier {}
// SAFETY: as for `Send` just above.
unsafe impl Sync for RamTier {}

fn slots_for(bytes: u64) -> u32 {
    let bytes = bytes.max(MIN_RAM_BYTES);
    ((bytes - REGION_HEADER_BYTES as u64) / (SLOT_BYTES + SLOT_HEADER_BYTES) as u64).min(u32::MAX as u64 - 1) as u32
}

fn table_len(slots: u32) -> usize {
    (slots as usize * SLOT_HEADER_BYTES).div_ceil(4096) * 4096
}

/// The header, slot headers and slots: the whole region before the
/// in-place marks were kept, and where they begin.
fn slots_len(slots: u32) -> usize {
    REGION_HEADER_BYTES + table_len(slots) + slots as usize * SLOT_BYTES
}

/// In-place marks entries: one per slot (a power of two), 1,024 to 2^20
/// (48 MiB, marks for 1 TiB of chunks written in place per two epochs).
fn mark_entries(slots: u32) -> usize {
    (slots as usize).next_power_of_two().clamp(1024, 1 << 20)
}

fn marks_len(slots: u32) -> usize {
    MARKS_HEADER_BYTES + (mark_entries(slots) * MARK_WORDS * 8).div_ceil(4096) * 4096
}

fn region_len(slots: u32) -> usize {
    slots_len(slots) + marks_len(slots)
}

/// Whether epoch `label` (0: none) comes after epoch `covered`, counting
/// around the wrap of a `u32`.
fn is_after(label: u64, covered: u32) -> bool {
    label != 0 && (label as u32).wrapping_sub(covered) as i32 > 0
}

fn mark_key(device: u8, chunk: u64) -> u64 {
    ((chunk << 8) | device as u64) + 1
}

fn boot_id() -> [u8; 36] {
    let mut id = [0u8; 36];
    match std::fs::read("/proc/sys/kernel/random/boot_id") {
        Ok(bytes) if bytes.len() >= 36 => id.copy_from_slice(&bytes[..36]),
        // Unknown boot: a region from before can never be trusted.
        _ => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            id[..16].copy_from_slice(&nanos.to_le_bytes());
        }
    }
    id
}

impl RamTier {
    /// Opens the RAM tier for pool `pool_uuid`. Dirty sectors left by an
    /// earlier process of the same boot are returned; anything else in the
    /// region is discarded.
    /// The flag says whether the region was intact (same pool, same boot):
    /// the process died but the machine did not.
    pub fn open(source: &RamSource, pool_uuid: &[u8; 16]) -> std::io::Result<(RamTier, Vec<Survivor>, bool)> {
        let (backing, base, len, boot, location) = match source {
            RamSource::File { path, bytes, .. } => {
                let slots = slots_for(*bytes);
                let len = region_len(slots);
                let file = open_region_file(path, len as u64, slots_len(slots) as u64)?;
                // SAFETY: the file is ours, and its exclusive flock (taken by
                // `open_region_file`) keeps every other process from mapping
                // it. Populating faults every page in now, once, instead of
                // on the write path.
                let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(&file)? };
                let base = map.as_mut_ptr();
                (
                    Backing::File(map, file),
                    base,
                    len,
                    boot_id(),
                    path.display().to_string(),
                )
            }
            RamSource::Heap(image) => {
                let mut boot = [0u8; 36];
                boot[..4].copy_from_slice(b"heap");
                (
                    Backing::Heap(image.clone()),
                    image.ptr,
                    image.len,
                    boot,
                    "heap".to_string(),
                )
            }
        };
        let slots = ((len - REGION_HEADER_BYTES) / (SLOT_BYTES + SLOT_HEADER_BYTES)) as u32;
        let slots = (0..=slots).rev().find(|s| region_len(*s) <= len).unwrap_or(0);
        let mut tier = RamTier {
            _backing: backing,
            base,
            slots,
            free: Ranked::new(Rank::RamFree, 0, Mutex::new(Vec::new())),
            free_count: AtomicUsize::new(0),
            location,
            path: match source {
                RamSource::File { path, .. } => Some(path.clone()),
                RamSource::Heap(_) => None,
            },
            data_dir: match source {
                RamSource::File { data_dir, .. } => data_dir.clone(),
                RamSource::Heap(_) => None,
            },
            marks_intact: false,
            mark_claim: Mutex::new(()),
            #[cfg(debug_assertions)]
            shadow: Ranked::new(Rank::RamShadow, 0, Mutex::new(Vec::new())),
        };
        let expected = tier.region_header(pool_uuid, &boot);
        // SAFETY: the header lies within the region.
        let current = unsafe { std::slice::from_raw_parts(base, REGION_HEADER_BYTES) };
        // The data directory it records is not part of what must match (a
        // region of the same file name is of the same data directory).
        let intact = current[..DATA_DIR_AT] == expected[..DATA_DIR_AT] && header_checksum_holds(current);
        let survivors = if intact {
            let survivors = tier.scan();
            // SAFETY: we are the only user of the region while opening it.
            unsafe { std::ptr::copy_nonoverlapping(expected.as_ptr(), base, REGION_HEADER_BYTES) };
            survivors
        } else {
            if current.iter().any(|b| *b != 0) {
                tracing::info!(
                    "RAM tier {}: belongs to another pool, boot or size; starting empty",
                    tier.location
                );
            }
            // SAFETY: we are the only user of the region while opening it.
            unsafe {
                std::ptr::write_bytes(base.add(REGION_HEADER_BYTES), 0, table_len(slots));
                std::ptr::copy_nonoverlapping(expected.as_ptr(), base, REGION_HEADER_BYTES);
            }
            Vec::new()
        };
        tier.marks_intact = intact && tier.marks_header_holds();
        if !tier.marks_intact {
            // SAFETY: we are the only user of the region while opening it;
            // the marks lie within it (`region_len`).
            unsafe {
                let marks = base.add(slots_len(slots));
                std::ptr::write_bytes(marks, 0, marks_len(slots));
                std::ptr::copy_nonoverlapping(MARKS_MAGIC.to_le_bytes().as_ptr(), marks, 8);
                let entries = mark_entries(slots) as u32;
                std::ptr::copy_nonoverlapping(entries.to_le_bytes().as_ptr(), marks.add(8), 4);
            }
        }
        let used: std::collections::HashSet<u32> = survivors.iter().map(|s| s.slot).collect();
        let free: Vec<u32> = (0..tier.slots).rev().filter(|s| !used.contains(s)).collect();
        tier.free_count = AtomicUsize::new(free.len());
        tier.free = Ranked::new(Rank::RamFree, 0, Mutex::new(free));
        #[cfg(debug_assertions)]
        {
            let shadow = (0..tier.slots)
                .map(|s| {
                    if used.contains(&s) {
                        SlotState::Valid
                    } else {
                        SlotState::Free
                    }
                })
                .collect();
            tier.shadow = Ranked::new(Rank::RamShadow, 0, Mutex::new(shadow));
        }
        Ok((tier, survivors, intact))
    }

    fn region_header(&self, pool_uuid: &[u8; 16], boot: &[u8; 36]) -> Vec<u8> {
        let mut header = vec![0u8; REGION_HEADER_BYTES];
        header[0..8].copy_from_slice(&REGION_MAGIC.to_le_bytes());
        header[8..12].copy_from_slice(&VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&self.slots.to_le_bytes());
        header[16..32].copy_from_slice(pool_uuid);
        header[32..68].copy_from_slice(boot);
        if let Some(dir) = &self.data_dir {
            let bytes = dir.as_os_str().as_encoded_bytes();
            if bytes.len() <= MAX_DATA_DIR_BYTES {
                header[DATA_DIR_AT..DATA_DIR_AT + 2].copy_from_slice(&(bytes.len() as u16).to_le_bytes());
                header[DATA_DIR_AT + 2..DATA_DIR_AT + 2 + bytes.len()].copy_from_slice(bytes);
            }
        }
        let crc = crate::checksum::crc32c(&header[..REGION_HEADER_BYTES - 4]);
        header[REGION_HEADER_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
        header
    }

    fn header_ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            slot < self.slots,
            "RAM tier slot {slot} out of range ({} slots)",
            self.slots
        );
        // SAFETY: in bounds for slot < self.slots (asserted).
        unsafe { self.base.add(REGION_HEADER_BYTES + slot as usize * SLOT_HEADER_BYTES) }
    }

    fn data_ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            slot < self.slots,
            "RAM tier slot {slot} out of range ({} slots)",
            self.slots
        );
        // SAFETY: in bounds for slot < self.slots (asserted).
        unsafe {
            self.base
                .add(REGION_HEADER_BYTES + table_len(self.slots) + slot as usize * SLOT_BYTES)
        }
    }

    fn magic(&self, slot: u32) -> &AtomicU32 {
        // SAFETY: the header is 4-byte aligned (4096-aligned table, 32-byte entries).
        unsafe { &*(self.header_ptr(slot) as *const AtomicU32) }
    }

    /// Valid slots, every version of each sector, sorted by volume, sector
    /// and sequence number. Versions a snapshot separates are all needed;
    /// the others (older copies left when the process died between writing
    /// a new copy and freeing the old one) are freed once the volume's
    /// snapshots are known (`VolState::settle`).
    fn scan(&self) -> Vec<Survivor> {
        let mut survivors = Vec::new();
        for slot in 0..self.slots {
            if self.magic(slot).load(Ordering::Acquire) != SLOT_MAGIC {
                continue;
            }
            // SAFETY: the header lies within the region.
            let header = unsafe { std::slice::from_raw_parts(self.header_ptr(slot), SLOT_HEADER_BYTES) };
            let field = |at: usize, n: usize| {
                let mut bytes = [0u8; 8];
                bytes[..n].copy_from_slice(&header[at..at + n]);
                u64::from_le_bytes(bytes)
            };
            let survivor = Survivor {
                slot,
                crc: field(4, 4) as u32,
                volume: field(8, 4) as u32,
                sector: field(16, 8),
                seq: field(24, 8),
            };
            let mut data = vec![0u8; SLOT_BYTES];
            // SAFETY: the tier is being opened; nothing else uses it yet.
            unsafe { self.copy_out(slot, 0, &mut data) };
            if crate::checksum::crc32c(&data) != survivor.crc {
                self.magic(slot).store(0, Ordering::Release);
                continue;
            }
            survivors.push(survivor);
        }
        survivors.sort_by_key(|s| (s.volume, s.sector, s.seq));
        survivors
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    fn marks_header_holds(&self) -> bool {
        // SAFETY: the marks header lies within the region (`region_len`).
        let header = unsafe { std::slice::from_raw_parts(self.base.add(slots_len(self.slots)), 12) };
        header[..8] == MARKS_MAGIC.to_le_bytes() && header[8..12] == (mark_entries(self.slots) as u32).to_le_bytes()
    }

    /// Word `word` of in-place marks entry `entry`; word 0 of entry
    /// `usize::MAX` is the overflow label (in the marks header).
    fn mark_word(&self, entry: usize, word: usize) -> &AtomicU64 {
        assert!(word < MARK_WORDS);
        let at = if entry == usize::MAX {
            16
        } else {
            assert!(entry < mark_entries(self.slots));
            MARKS_HEADER_BYTES + (entry * MARK_WORDS + word) * 8
        };
        // SAFETY: in bounds (asserted; `region_len` includes the marks) and
        // 8-byte aligned (the marks start on a page, words are 8 bytes);
        // every access to these words is atomic.
        unsafe { &*(self.base.add(slots_len(self.slots) + at) as *const AtomicU64) }
    }

    /// The entries chunk `key` may occupy.
    fn mark_window(&self, key: u64) -> impl Iterator<Item = usize> {
        let entries = mark_entries(self.slots);
        let start = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & (entries - 1);
        (0..MARK_WINDOW).map(move |i| (start + i) & (entries - 1))
    }

    /// Notes that `parts` of `chunk` on `device` are about to be written in
    /// place in `epoch`, before they are (the caller holds the pool's write
    /// gate, so the epoch does not change meanwhile). Entries of epochs up
    /// to `covered` (a committed checkpoint holds their checksums) are
    /// free; a chunk finds its entry for the epoch, or takes a free one in
    /// its window. With none free the overflow label says that a chunk
    /// without an entry may have been written anywhere in that epoch.
    ///
    /// Entries are filled key first, then bitmap, then label (release), so
    /// an entry whose label names the current epoch is complete, and a
    /// process that dies part way leaves only an entry of an old epoch.
    pub fn note_in_place(&self, device: u8, chunk: u64, parts: &super::ChunkParts, epoch: u32, covered: u32) {
        let key = mark_key(device, chunk);
        let find = || {
            self.mark_window(key).find(|&entry| {
                self.mark_word(entry, 1).load(Ordering::Acquire) == epoch as u64
                    && self.mark_word(entry, 0).load(Ordering::Relaxed) == key
            })
        };
        let set = |entry: usize| {
            for (word, bits) in parts.iter().enumerate() {
                if *bits != 0 {
                    self.mark_word(entry, 2 + word).fetch_or(*bits, Ordering::AcqRel);
                }
            }
        };
        if let Some(entry) = find() {
            return set(entry);
        }
        use crate::sync::LockOrAbort;
        // A leaf: nothing is taken under it.
        let _claim = self.mark_claim.lock_or_abort();
        if let Some(entry) = find() {
            return set(entry);
        }
        let free = self
            .mark_window(key)
            .find(|&entry| !is_after(self.mark_word(entry, 1).load(Ordering::Acquire), covered));
        match free {
            Some(entry) => {
                self.mark_word(entry, 0).store(key, Ordering::Relaxed);
                for word in 2..MARK_WORDS {
                    self.mark_word(entry, word).store(0, Ordering::Relaxed);
                }
                self.mark_word(entry, 1).store(epoch as u64, Ordering::Release);
                set(entry);
            }
            None => self.mark_word(usize::MAX, 0).store(epoch as u64, Ordering::Release),
        }
    }

    /// What the in-place marks found at open say was written in place in
    /// epochs after `covered`; `None` when they did not survive (another
    /// boot, pool or layout, or a heap region wiped).
    pub fn marks_after(&self, covered: u32) -> Option<CrashMarks> {
        if !self.marks_intact {
            return None;
        }
        let mut found = CrashMarks {
            overflowed: is_after(self.mark_word(usize::MAX, 0).load(Ordering::Acquire), covered),
            ..CrashMarks::default()
        };
        for entry in 0..mark_entries(self.slots) {
            if !is_after(self.mark_word(entry, 1).load(Ordering::Acquire), covered) {
                continue;
            }
            let key = self.mark_word(entry, 0).load(Ordering::Relaxed) - 1;
            let parts = found.chunks.entry(((key & 0xff) as u8, key >> 8)).or_default();
            for (word, bits) in parts.iter_mut().enumerate() {
                *bits |= self.mark_word(entry, 2 + word).load(Ordering::Relaxed);
            }
        }
        Some(found)
    }

    /// At a clean shutdown, once nothing is dirty: removes the region file,
    /// so a stopped daemon holds no RAM in tmpfs (and no disk space for a
    /// file in the pool's directory). The mapping stays valid until the
    /// process exits. Returns whether a file was removed.
    pub fn remove_file_if_clean(&self) -> bool {
        let Some(path) = &self.path else {
            return false;
        };
        if self.free_slots() != self.total_slots() {
            return false;
        }
        match std::fs::remove_file(path) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("cannot remove the RAM tier file {}: {e}", path.display());
                false
            }
        }
    }

    pub fn total_slots(&self) -> usize {
        self.slots as usize
    }

    pub fn free_slots(&self) -> usize {
        self.free_count.load(Ordering::Acquire)
    }

    /// Takes `count` free slots, all or none. The caller owns them until it
    /// writes them (then the cache entry that records the slot owns it) or
    /// gives them back.
    pub fn allocate(&self, count: usize) -> Option<Vec<u32>> {
        let mut free = self.free.lock_or_abort();
        if free.len() < count {
            return None;
        }
        let at = free.len() - count;
        let taken = free.split_off(at);
        self.free_count.store(free.len(), Ordering::Release);
        drop(free);
        self.shadow_change(&taken, &[SlotState::Free], SlotState::Allocated);
        Some(taken)
    }

    /// Returns slots that were allocated and never written.
    pub fn give_back(&self, slots: &[u32]) {
        self.shadow_change(slots, &[SlotState::Allocated], SlotState::Free);
        self.put_free(slots);
    }

    fn put_free(&self, slots: &[u32]) {
        let mut free = self.free.lock_or_abort();
        free.extend_from_slice(slots);
        self.free_count.store(free.len(), Ordering::Release);
    }

    /// Fills a freshly allocated slot and makes it valid.
    ///
    /// # Safety
    /// The caller owns `slot`: it came from [`RamTier::allocate`] and has
    /// been neither written nor given back, so no other thread reads or
    /// writes it. (The slot's range is checked; ownership cannot be, except
    /// by the shadow state of debug builds.)
    pub unsafe fn write(&self, slot: u32, volume: u32, sector: u64, seq: u64, data: &[u8], crc: u32) {
        assert_eq!(data.len(), SLOT_BYTES);
        self.shadow_change(&[slot], &[SlotState::Allocated], SlotState::Valid);
        let (data_ptr, header) = (self.data_ptr(slot), self.header_ptr(slot));
        // SAFETY: both pointers are in bounds (checked by `data_ptr` and
        // `header_ptr`), and the caller owns the slot (this function's
        // contract), so nothing reads these bytes while they are copied.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), data_ptr, SLOT_BYTES);
            std::ptr::copy_nonoverlapping(crc.to_le_bytes().as_ptr(), header.add(4), 4);
            std::ptr::copy_nonoverlapping(volume.to_le_bytes().as_ptr(), header.add(8), 4);
            std::ptr::copy_nonoverlapping(sector.to_le_bytes().as_ptr(), header.add(16), 8);
            std::ptr::copy_nonoverlapping(seq.to_le_bytes().as_ptr(), header.add(24), 8);
        }
        fence(Ordering::Release);
        self.magic(slot).store(SLOT_MAGIC, Ordering::Release);
    }

    /// Copies `dst.len()` bytes of a valid slot from `within`.
    ///
    /// # Safety
    /// The slot holds a valid sector image (written, not released) and the
    /// caller holds what keeps it so for the duration of the call: the
    /// owning volume's stripe lock or cache lock (see `pool::cache`), so no
    /// other thread frees or rewrites it meanwhile.
    pub unsafe fn read(&self, slot: u32, within: usize, dst: &mut [u8]) {
        self.shadow_check(slot, &[SlotState::Valid]);
        // SAFETY: the caller's contract is `copy_out`'s.
        unsafe { self.copy_out(slot, within, dst) }
    }

    /// # Safety
    /// As [`RamTier::read`], without the shadow check (used while opening).
    unsafe fn copy_out(&self, slot: u32, within: usize, dst: &mut [u8]) {
        assert!(within + dst.len() <= SLOT_BYTES);
        let src = self.data_ptr(slot);
        // SAFETY: in bounds (asserted above and in `data_ptr`); the caller
        // keeps the slot from being written meanwhile (the contract).
        unsafe { std::ptr::copy_nonoverlapping(src.add(within), dst.as_mut_ptr(), dst.len()) };
    }

    /// Invalidates a written slot and returns it to the free list.
    ///
    /// # Safety
    /// The caller owns the slot's only reference (the cache entry that
    /// recorded it, now removed) and no reader still uses it: the same
    /// locks as [`RamTier::read`] are held.
    pub unsafe fn release(&self, slot: u32) {
        self.shadow_change(&[slot], &[SlotState::Valid], SlotState::Free);
        self.magic(slot).store(0, Ordering::Release);
        self.put_free(&[slot]);
    }

    /// Debug builds: checks that every slot is in one of `from` and moves it
    /// to `to`; release builds: nothing.
    #[cfg_attr(not(debug_assertions), allow(unused_variables))]
    fn shadow_change(&self, slots: &[u32], from: &[SlotState], to: SlotState) {
        #[cfg(debug_assertions)]
        {
            let mut shadow = self.shadow.lock_or_abort();
            for &slot in slots {
                let state = &mut shadow[slot as usize];
                assert!(
                    from.contains(state),
                    "RAM tier slot {slot} is {state:?}, expected one of {from:?} before it becomes {to:?}"
                );
                *state = to;
            }
        }
    }

    #[cfg_attr(not(debug_assertions), allow(unused_variables))]
    fn shadow_check(&self, slot: u32, expected: &[SlotState]) {
        #[cfg(debug_assertions)]
        {
            let state = self.shadow.lock_or_abort()[slot as usize];
            assert!(
                expected.contains(&state),
                "RAM tier slot {slot} is {state:?}, expected {expected:?}"
            );
        }
    }
}

/// Opens (creating or resizing) the region file, locks it for this process
/// and allocates all of it now: a shared mapping of a sparse file whose file
/// system later runs out of space kills the process with SIGBUS, so the
/// space is taken up front, where running out is a clear error.
fn open_region_file(path: &Path, len: u64, grows_from: u64) -> std::io::Result<std::fs::File> {
    use std::os::unix::io::AsRawFd;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    // One left by an older version may be wider.
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    // SAFETY: a plain syscall on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let error = std::io::Error::last_os_error();
        return Err(std::io::Error::new(
            error.kind(),
            format!("{} is in use by another process ({error})", path.display()),
        ));
    }
    let current = file.metadata()?.len();
    if current != len {
        // A region of the same slots from before the in-place marks were
        // kept grows by them and keeps its slots; any other is reset.
        if current != grows_from {
            file.set_len(0)?;
        }
        file.set_len(len)?;
    }
    // SAFETY: a plain syscall on a descriptor we own.
    let result = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    match result {
        0 => {}
        // Some file systems cannot preallocate; the mapping still works.
        libc::EOPNOTSUPP | libc::EINVAL => {
            tracing::warn!("{}: cannot preallocate the RAM tier file", path.display())
        }
        errno => {
            let error = std::io::Error::from_raw_os_error(errno);
            return Err(std::io::Error::new(
                error.kind(),
                format!("cannot allocate {len} bytes for {}: {error}", path.display()),
            ));
        }
    }
    Ok(file)
}

fn header_checksum_holds(header: &[u8]) -> bool {
    crate::checksum::crc32c(&header[..REGION_HEADER_BYTES - 4]).to_le_bytes() == header[REGION_HEADER_BYTES - 4..]
}

/// A RAM tier file found in a RAM directory (`strata ram-tier list`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionFile {
    pub path: PathBuf,
    /// The pool its name is for (`strata-HASH-POOL.ram`).
    pub pool: String,
    /// The data directory its header records, if it does.
    pub data_dir: Option<PathBuf>,
    pub bytes: u64,
    /// The process that has it locked (the daemon using it), if any.
    pub held_by: Option<u32>,
    /// Whether it holds dirty sectors of this boot: writes a daemon
    /// acknowledged and had not placed, which the next start of that data
    /// directory would replay.
    pub dirty: bool,
}

/// The pool of a RAM tier file name `strata-HASH-POOL.ram` (HASH: 8 hex
/// digits), or `None` for another name.
pub fn region_file_pool(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("strata-")?.strip_suffix(".ram")?;
    let (hash, pool) = rest.split_at_checked(8)?;
    let pool = pool.strip_prefix('-')?;
    (hash.bytes().all(|b| b.is_ascii_hexdigit()) && !pool.is_empty()).then_some(pool)
}

/// The RAM tier file at `path`, if its name is one (see [`region_file_pool`]).
pub fn region_file(path: &Path) -> Option<RegionFile> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileExt;
    let pool = region_file_pool(path.file_name()?.to_str()?)?.to_string();
    let metadata = std::fs::symlink_metadata(path).ok()?;
    if !metadata.is_file() {
        return None;
    }
    let mut header = vec![0u8; REGION_HEADER_BYTES];
    let read = std::fs::File::open(path).and_then(|file| file.read_exact_at(&mut header, 0));
    let data_dir = if read.is_ok() && header[0..8] == REGION_MAGIC.to_le_bytes() && header_checksum_holds(&header) {
        let length = u16::from_le_bytes([header[DATA_DIR_AT], header[DATA_DIR_AT + 1]]) as usize;
        let bytes = &header[DATA_DIR_AT + 2..DATA_DIR_AT + 2 + length.min(MAX_DATA_DIR_BYTES)];
        (length > 0).then(|| PathBuf::from(std::ffi::OsStr::from_bytes(bytes)))
    } else {
        None
    };
    Some(RegionFile {
        path: path.to_path_buf(),
        pool,
        data_dir,
        bytes: metadata.len(),
        held_by: lock_holder(&metadata),
        dirty: holds_dirty_sectors(path),
    })
}

/// Every RAM tier file in `ram_dir`, sorted by name.
pub fn region_files(ram_dir: &Path) -> std::io::Result<Vec<RegionFile>> {
    let mut found: Vec<RegionFile> = std::fs::read_dir(ram_dir)?
        .filter_map(|entry| region_file(&entry.ok()?.path()))
        .collect();
    found.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(found)
}

/// The process holding a `flock` on the file `metadata` describes, from
/// /proc/locks (which lists every lock without taking one: a probe by
/// locking would make a daemon opening the file at that moment fail).
fn lock_holder(metadata: &std::fs::Metadata) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let (dev, ino) = (metadata.dev(), metadata.ino());
    let wanted = format!(
        "{:02x}:{:02x}:{ino}",
        libc::major(dev as libc::dev_t),
        libc::minor(dev as libc::dev_t)
    );
    locks.lines().find_map(|line| {
        // `1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF` (a blocked
        // waiter's line has `->` after the number).
        let fields: Vec<&str> = line.split_whitespace().filter(|f| *f != "->").collect();
        (fields.get(1) == Some(&"FLOCK") && fields.get(5).is_some_and(|f| f.eq_ignore_ascii_case(&wanted)))
            .then(|| fields.get(4)?.parse().ok())
            .flatten()
    })
}

/// Why [`remove_region_file`] left a file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoveError {
    #[error("{0} is not a RAM tier file (strata-HASH-POOL.ram)")]
    NotRegion(String),
    #[error("{0} is in use by process {1} (a daemon that has it open)")]
    InUse(String, String),
    #[error(
        "{0} holds writes its daemon acknowledged and had not placed (the next start of data directory {1} replays them); remove it with --force to discard them"
    )]
    Dirty(String, String),
    #[error("cannot remove {0}: {1}")]
    Io(String, String),
}

/// Removes the RAM tier file at `path` unless a process has it open (it
/// is locked while being checked and removed, so no daemon can map it
/// meanwhile) or, without `force`, it holds dirty sectors of this boot.
pub fn remove_region_file(path: &Path, force: bool) -> Result<(), RemoveError> {
    use std::os::unix::io::AsRawFd;
    let shown = path.display().to_string();
    let Some(found) = region_file(path) else {
        return Err(RemoveError::NotRegion(shown));
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(|e| RemoveError::Io(shown.clone(), e.to_string()))?;
    // SAFETY: a plain syscall on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = found.held_by.map_or_else(|| "?".to_string(), |pid| pid.to_string());
        return Err(RemoveError::InUse(shown, holder));
    }
    if found.dirty && !force {
        let owner = found
            .data_dir
            .map_or_else(|| "(not recorded)".to_string(), |d| d.display().to_string());
        return Err(RemoveError::Dirty(shown, owner));
    }
    std::fs::remove_file(path).map_err(|e| RemoveError::Io(shown, e.to_string()))
}

/// `f_type` of tmpfs (and of /dev/shm on every common distribution).
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Bytes free on the file system holding `dir`, and whether it is tmpfs.
fn free_bytes(dir: &Path) -> Option<(u64, bool)> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs fills the zeroed struct; `path` is a valid C string.
    let mut stats: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(path.as_ptr(), &mut stats) } != 0 {
        return None;
    }
    let free = stats.f_bavail as u64 * stats.f_bsize as u64;
    Some((free, stats.f_type as i64 == TMPFS_MAGIC))
}

/// Whether the region file at `path` holds dirty sectors of this boot (a
/// file from another boot, or one that cannot be read, holds nothing that
/// can be trusted; the log's Data records cover what it held).
fn holds_dirty_sectors(path: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let mut header = vec![0u8; REGION_HEADER_BYTES];
    if file.read_exact_at(&mut header, 0).is_err()
        || header[0..8] != REGION_MAGIC.to_le_bytes()
        || header[32..68] != boot_id()
        || !header_checksum_holds(&header)
    {
        return false;
    }
    let slots = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes"));
    let mut table = vec![0u8; table_len(slots)];
    if file.read_exact_at(&mut table, REGION_HEADER_BYTES as u64).is_err() {
        return false;
    }
    table
        .chunks(SLOT_HEADER_BYTES)
        .take(slots as usize)
        .any(|entry| entry[0..4] == SLOT_MAGIC.to_le_bytes())
}

/// Where a pool's RAM tier file goes. Preferred: `ram_dir` (normally
/// /dev/shm, which must then be tmpfs: `require_tmpfs`) when it has room for
/// the region, under a name unique to this data directory and pool (`key`):
/// pure RAM, never written back to a disk, gone at a reboot as the tier's
/// contents must be. Otherwise, or while a file in the pool's directory
/// still holds dirty sectors of this boot, `pool_dir/ram.tier`. A clean
/// `ram.tier` is removed when the tier moves.
pub fn choose_location(pool_dir: &Path, ram_dir: &Path, require_tmpfs: bool, key: &str, bytes: u64) -> PathBuf {
    let local = pool_dir.join("ram.tier");
    if holds_dirty_sectors(&local) {
        return local;
    }
    let shared = ram_dir.join(format!("strata-{key}.ram"));
    let slots = slots_for(bytes);
    let needed = region_len(slots) as u64;
    let room =
        shared.exists() || free_bytes(ram_dir).is_some_and(|(free, tmpfs)| free >= needed && (tmpfs || !require_tmpfs));
    if !room {
        return local;
    }
    // Allocate it now: if that fails (the RAM directory filled up since the
    // check, or cannot hold the file), the pool still opens, with its RAM
    // tier in its own directory.
    let existed = shared.exists();
    if let Err(e) = open_region_file(&shared, needed, slots_len(slots) as u64) {
        tracing::warn!(
            "cannot place the RAM tier in {} ({e}); using {}",
            ram_dir.display(),
            local.display()
        );
        if !existed {
            let _ = std::fs::remove_file(&shared);
        }
        return local;
    }
    if local.exists() {
        if let Err(e) = std::fs::remove_file(&local) {
            tracing::warn!("cannot remove the old RAM tier file {}: {e}", local.display());
            return local;
        }
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survivors_come_back_with_every_version_and_torn_slots_are_freed() {
        let image = HeapImage::new(MIN_RAM_BYTES);
        let uuid = [7u8; 16];
        // Each open takes its own handle, dropped with the tier, so the
        // image can be wiped once every tier over it is gone.
        let source = || RamSource::Heap(image.clone());
        let (tier, survivors, _) = RamTier::open(&source(), &uuid).unwrap();
        assert!(survivors.is_empty());
        let slots = tier.allocate(3).unwrap();
        let a = vec![1u8; SLOT_BYTES];
        let b = vec![2u8; SLOT_BYTES];
        // SAFETY: a freshly allocated slot, written once.
        unsafe { tier.write(slots[0], 1, 10, 1, &a, crate::checksum::crc32c(&a)) };
        // A newer copy of the same sector whose old copy was never freed.
        // SAFETY: a freshly allocated slot, written once.
        unsafe { tier.write(slots[1], 1, 10, 2, &b, crate::checksum::crc32c(&b)) };
        // A torn slot: wrong checksum.
        // SAFETY: a freshly allocated slot, written once.
        unsafe { tier.write(slots[2], 1, 11, 3, &a, 0xdead) };
        drop(tier);
        let (tier, survivors, intact) = RamTier::open(&source(), &uuid).unwrap();
        assert!(intact);
        // Both versions come back, oldest first (which of them a snapshot
        // needs is decided once the snapshots are known); the torn one not.
        assert_eq!(survivors.len(), 2);
        assert_eq!((survivors[0].sector, survivors[0].seq), (10, 1));
        assert_eq!((survivors[1].sector, survivors[1].seq), (10, 2));
        let mut out = vec![0u8; SLOT_BYTES];
        // SAFETY: a survivor is valid; nothing else uses the tier.
        unsafe { tier.read(survivors[1].slot, 0, &mut out) };
        assert_eq!(out, b);
        assert_eq!(tier.free_slots(), tier.total_slots() - 2);
        drop(tier);
        // Another pool's region starts empty; so does a wiped one.
        let (_, survivors, intact) = RamTier::open(&source(), &[8u8; 16]).unwrap();
        assert!(survivors.is_empty() && !intact);
        image.wipe();
        let (_, survivors, intact) = RamTier::open(&source(), &uuid).unwrap();
        assert!(survivors.is_empty() && !intact);
    }

    #[test]
    fn file_region_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let source = RamSource::File {
            path: dir.path().join("ram.tier"),
            bytes: 2 << 20,
            data_dir: None,
        };
        let uuid = [3u8; 16];
        let (tier, _, _) = RamTier::open(&source, &uuid).unwrap();
        let slot = tier.allocate(1).unwrap()[0];
        let data = vec![9u8; SLOT_BYTES];
        // SAFETY: a freshly allocated slot, written once.
        unsafe { tier.write(slot, 4, 99, 5, &data, crate::checksum::crc32c(&data)) };
        drop(tier);
        let (_, survivors, intact) = RamTier::open(&source, &uuid).unwrap();
        assert!(intact);
        assert_eq!(survivors.len(), 1);
        assert_eq!(survivors[0].volume, 4);
    }

    #[test]
    fn a_region_file_is_mapped_by_one_process_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let source = RamSource::File {
            path: dir.path().join("ram.tier"),
            bytes: 2 << 20,
            data_dir: None,
        };
        let (tier, _, _) = RamTier::open(&source, &[1u8; 16]).unwrap();
        // flock is per open file description: a second open in this process
        // stands for another process.
        let error = RamTier::open(&source, &[1u8; 16])
            .err()
            .expect("a second mapping is refused");
        assert!(error.to_string().contains("in use by another process"), "{error}");
        drop(tier);
        assert!(RamTier::open(&source, &[1u8; 16]).is_ok());
    }

    #[test]
    fn location_prefers_the_ram_dir_unless_the_pool_file_holds_dirty_sectors() {
        let dir = tempfile::tempdir().unwrap();
        let pool_dir = dir.path().join("pool");
        let ram_dir = dir.path().join("shm");
        std::fs::create_dir_all(&pool_dir).unwrap();
        std::fs::create_dir_all(&ram_dir).unwrap();
        let local = pool_dir.join("ram.tier");
        let shared = ram_dir.join("strata-k.ram");
        let bytes = 2 << 20;
        // A file system that is not tmpfs is refused when tmpfs is required.
        assert_eq!(choose_location(&pool_dir, &ram_dir, true, "k", bytes), local);
        assert_eq!(choose_location(&pool_dir, &ram_dir, false, "k", bytes), shared);
        // No room (a directory that does not exist reports none): the pool's directory.
        assert_eq!(
            choose_location(&pool_dir, &dir.path().join("missing"), false, "k", bytes),
            local
        );
        // Room reported, but the file cannot be made there (the "directory"
        // is a file): the pool's directory too.
        let not_a_dir = dir.path().join("plain-file");
        std::fs::write(&not_a_dir, b"x").unwrap();
        assert_eq!(choose_location(&pool_dir, &not_a_dir, false, "k", bytes), local);
        std::fs::remove_file(&shared).ok();

        // A pool file with a dirty sector of this boot keeps the tier where it is.
        let source = RamSource::File {
            path: local.clone(),
            bytes,
            data_dir: None,
        };
        let (tier, _, _) = RamTier::open(&source, &[2u8; 16]).unwrap();
        let slot = tier.allocate(1).unwrap()[0];
        let data = vec![1u8; SLOT_BYTES];
        // SAFETY: a freshly allocated slot, written once.
        unsafe { tier.write(slot, 1, 5, 1, &data, crate::checksum::crc32c(&data)) };
        assert!(!tier.remove_file_if_clean(), "a dirty tier keeps its file");
        drop(tier);
        assert_eq!(choose_location(&pool_dir, &ram_dir, false, "k", bytes), local);
        assert!(local.exists());

        // Once clean, it moves, and the old file is removed.
        let (tier, survivors, _) = RamTier::open(&source, &[2u8; 16]).unwrap();
        assert_eq!(survivors.len(), 1);
        // SAFETY: a valid survivor that nothing else refers to.
        unsafe { tier.release(survivors[0].slot) };
        drop(tier);
        assert_eq!(choose_location(&pool_dir, &ram_dir, false, "k", bytes), shared);
        assert!(!local.exists());

        // A clean tier removes its file at shutdown.
        let source = RamSource::File {
            path: shared.clone(),
            bytes,
            data_dir: None,
        };
        let (tier, _, _) = RamTier::open(&source, &[2u8; 16]).unwrap();
        assert!(shared.exists());
        assert!(tier.remove_file_if_clean());
        assert!(!shared.exists());
    }

    fn heap_tier() -> RamTier {
        RamTier::open(&RamSource::Heap(HeapImage::new(MIN_RAM_BYTES)), &[5u8; 16])
            .unwrap()
            .0
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_slot_past_the_end_is_refused_in_every_build() {
        let tier = heap_tier();
        let mut out = vec![0u8; 16];
        // SAFETY: the call must panic before touching memory; that is the test.
        unsafe { tier.copy_out(tier.total_slots() as u32, 0, &mut out) };
    }

    #[test]
    #[should_panic(expected = "a RAM image is wiped only after")]
    fn an_image_cannot_be_wiped_under_a_live_tier() {
        let image = HeapImage::new(MIN_RAM_BYTES);
        let _tier = RamTier::open(&RamSource::Heap(image.clone()), &[5u8; 16]).unwrap();
        image.wipe();
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "is Free, expected one of [Valid]")]
    fn a_double_release_is_caught_by_the_shadow_state() {
        let tier = heap_tier();
        let slot = tier.allocate(1).unwrap()[0];
        let data = vec![3u8; SLOT_BYTES];
        // SAFETY: a freshly allocated slot, written once, then released
        // once; the second release is the bug the shadow state catches
        // before the slot reaches the free list twice.
        unsafe {
            tier.write(slot, 1, 1, 1, &data, 0);
            tier.release(slot);
            tier.release(slot);
        }
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "is Free, expected one of [Allocated]")]
    fn a_write_to_a_slot_nobody_allocated_is_caught_by_the_shadow_state() {
        let tier = heap_tier();
        let data = vec![3u8; SLOT_BYTES];
        // SAFETY: the shadow state panics before the write; that is the test.
        unsafe { tier.write(0, 1, 1, 1, &data, 0) };
    }
}
