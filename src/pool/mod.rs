//! The pool: devices in tiers, the allocator, the metadata store, the log,
//! checkpoints and recovery, the caches and the migrator. Volumes
//! ([`volume::EngineVolume`]) and file datasets' data live on it.
//!
//! How the pieces keep data safe (ARCHITECTURE.md has the long version):
//! - Data is written in place. Every 4 KiB sector of an allocated block has a
//!   crc32c in the checksum table, verified on every read.
//! - A new block's mapping and checksums go to the log as one record. A log
//!   commit that carries such a record flushes the data devices first (a
//!   commit of records that need no flush, such as `Dirty` marks, skips
//!   it), so a durable mapping never points at data that is not durable.
//! - Before the first write in place into a chunk in each checkpoint epoch,
//!   a `Dirty` record for that chunk is committed, and before each write in
//!   place the sectors it covers are noted in the RAM tier's in-place marks
//!   (memory that outlives the process, not the machine). After a crash the
//!   sectors a write may have been in flight on are *suspect*: the noted
//!   ones of the chunks the `Dirty` records name when the process died but
//!   the machine did not, every sector of those chunks when the machine
//!   went down too. A mismatch in a suspect sector is repaired from the
//!   data, since the crash explains it; any other is a checksum error. A
//!   scrub after the crash reads the suspect blocks back. Overwrites
//!   therefore cost no metadata I/O beyond that one record per chunk per
//!   epoch.
//! - A checkpoint writes the changed map, checksum and allocation pages to
//!   the metadata store in one transaction and frees the log up to it.
//! - A freed slot is reused only after the record freeing it is durable.

pub mod alloc;
mod attach;
mod blockmap;
pub mod cache;
mod checkpoint;
mod commit;
mod destage;
pub mod dirty;
pub mod files;
mod freeing;
pub mod fuzzing;
pub mod grow;
pub mod migrate;
pub mod ram;
pub mod readcache;
mod recover;
mod relocate;
pub use attach::{device_named, DeviceSpec};
mod remove;
pub use remove::RemovalStatus;
mod resilver;
pub use resilver::ResilverStatus;
mod scrub;
pub use scrub::{
    ScrubCommand, ScrubCursor, ScrubFault, ScrubJob, ScrubReport, ScrubState, ScrubStatus, SCRUB_MAX_FAULTS,
};
mod send;
pub mod snapshots;
pub mod superblock;
pub mod vdev;
pub mod volume;
mod volumes;

pub(crate) use blockmap::BlockPtr;
use checkpoint::run_blocking;
use recover::{read_superblock, round_up, write_superblock};
pub use send::SendExtent;
use volumes::Release;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::{ReadableTable, TableDefinition};

use crate::device::{BackingSpace, Device, DeviceError, IoBuf};
use crate::meta::log::{Log, LogError, Record};
use crate::meta::pages::{CrcPage, MapPage, Page, PageCache, TakenPage, CRCS_PER_PAGE, MAP_ENTRIES_PER_PAGE};
use crate::meta::store::{self, CHUNKS, CRC_PAGES, MAP_PAGES, STATE, SUSPECT};
use crate::meta::MetaError;
use crate::sync::{Held, LockOrAbort, Rank, Ranked};
use alloc::{Allocator, ChunkState, DeviceSpace};
use superblock::{Member, Role, Superblock, SUPERBLOCK_BYTES, SUPERBLOCK_OFFSETS};

pub const DEFAULT_CHUNK_BYTES: u32 = 1 << 20;
pub const SECTOR_SHIFT: u32 = 12;
pub const SECTOR_BYTES: u64 = 1 << SECTOR_SHIFT;
const DEFAULT_LOG_BYTES: u64 = 64 << 20;
const MIN_META_BYTES: u64 = 32 << 20;
const MAX_META_BYTES: u64 = 16 << 30;
/// The block-map and checksum page caches of a pool opened without a size
/// for them (tests, tools): 8192 map pages of 2 KiB and 4096 checksum pages
/// of 4 KiB, the pages of 8 GiB of written data.
pub const DEFAULT_META_CACHE_BYTES: u64 = 32 << 20;
/// Checkpoint when this many pages are dirty (bounds memory).
const MAX_DIRTY_PAGES: usize = 16384;
/// The parts of a chunk, one bit each (part 0 the lowest bit of the first
/// word): suspect sectors, in-place marks. A chunk has [`CHUNK_PARTS`]
/// parts, 4 KiB each in a 1 MiB chunk.
pub(crate) type ChunkParts = [u64; 4];
pub(crate) const CHUNK_PARTS: u64 = 256;
pub(crate) const ALL_PARTS: ChunkParts = [u64::MAX; 4];
/// How far past a chunk that continues a sequential stream
/// [`Pool::mark_dirty`] marks the chunks after it, in bytes.
const MARK_AHEAD_BYTES: u64 = 16 << 20;
const STORE_CACHE_BYTES: usize = 32 << 20;
/// RAM tier of a pool opened without one configured (tests, tools).
pub const DEFAULT_RAM_BYTES: u64 = 64 << 20;
/// Read cache of a pool opened without one configured.
pub const DEFAULT_READ_CACHE_BYTES: u64 = 64 << 20;
/// Dirty data older than this is destaged (the commit interval).
pub const COMMIT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// How a pool is opened beyond its devices.
#[derive(Clone)]
pub struct PoolOptions {
    /// The RAM tier (write-back cache); `None` = a heap region of
    /// `DEFAULT_RAM_BYTES`.
    pub ram: Option<ram::RamSource>,
    /// Run the background destager (needs a multi-thread runtime).
    pub background: bool,
    /// Bytes of the clean-data read cache (0 = none).
    pub read_cache_bytes: u64,
    /// Bytes of the block-map and checksum page caches (see
    /// [`meta_cache_pages`]).
    pub meta_cache_bytes: u64,
    /// Frees of more slots than this at once are queued for the background
    /// freer; `None` = `freeing::BACKGROUND_FREE_ABOVE` once the freer runs,
    /// all at once without it. (The simulator sets a small value and drives
    /// the queue itself with `Pool::free_queued_batch`.)
    pub background_free_above: Option<usize>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            ram: None,
            background: true,
            read_cache_bytes: DEFAULT_READ_CACHE_BYTES,
            meta_cache_bytes: DEFAULT_META_CACHE_BYTES,
            background_free_above: None,
        }
    }
}

/// How many map and checksum pages `bytes` of page cache hold: half the
/// bytes each, at least [`DEFAULT_META_CACHE_BYTES`] in all. A map page
/// (2 KiB) covers 1 MiB of a volume, a checksum page (4 KiB) 4 MiB.
pub fn meta_cache_pages(bytes: u64) -> (usize, usize) {
    let half = bytes.max(DEFAULT_META_CACHE_BYTES) / 2;
    (
        (half / (MAP_ENTRIES_PER_PAGE * 8)) as usize,
        (half / (CRCS_PER_PAGE * 4)) as usize,
    )
}

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("{device}: {reason}")]
    Device { device: String, reason: String },
    #[error("{device} belongs to pool '{found}' ({found_uuid}), not to this pool '{expected}'")]
    Foreign {
        device: String,
        found: String,
        found_uuid: String,
        expected: String,
    },
    #[error("pool '{pool}' is missing its {role} device {uuid} (device {index} of {count})")]
    Missing {
        pool: String,
        role: &'static str,
        uuid: String,
        index: u8,
        count: usize,
    },
    #[error("{0} is already part of a strata pool; refusing to overwrite it")]
    InUse(String),
    #[error("{0}")]
    Invalid(String),
    /// No such device in the pool.
    #[error("{0}")]
    NotFound(String),
    /// Another change of the same kind is under way.
    #[error("{0}")]
    Busy(String),
    /// A snapshot that clones depend on (their volume ids) cannot go.
    #[error("the snapshot has clones (volumes {0:?}): promote or delete them first")]
    HasClones(Vec<u32>),
    #[error("metadata: {0}")]
    Meta(#[from] MetaError),
    #[error(transparent)]
    Io(#[from] DeviceError),
    #[error(transparent)]
    Log(#[from] LogError),
}

fn uuid_text(uuid: &[u8; 16]) -> String {
    uuid.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_uuid() -> [u8; 16] {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_err()
    {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = (nanos ^ (std::process::id() as u128) << 64).to_le_bytes();
    }
    bytes
}

/// Per-device counters for `pool status`.
#[derive(Debug, Default)]
pub struct DeviceCounters {
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub checksum_errors: AtomicU64,
    /// Mismatches in suspect chunks after a crash, repaired from the data.
    pub repaired_after_crash: AtomicU64,
}

/// Shards of the write gate: volumes whose ids differ by a multiple of this
/// share one.
const GATE_SHARDS: usize = 64;

/// One shard of the write gate, in cache lines of its own (writes of
/// volumes in different shards touch no common line).
#[repr(align(128))]
struct GateShard(Ranked<tokio::sync::RwLock<()>>);

fn new_gates() -> Box<[GateShard]> {
    (0..GATE_SHARDS)
        .map(|shard| GateShard(Ranked::new(Rank::Gate, shard as u64, tokio::sync::RwLock::new(()))))
        .collect()
}

pub struct PoolDevice {
    /// What the pool reads and writes: the member ([`vdev::Vdev`]: its
    /// device, or its mirror once it is one), as a `Device`.
    pub device: Arc<dyn Device>,
    /// The same object as `device`.
    pub vdev: Arc<vdev::Vdev>,
    pub member: Member,
    pub counters: DeviceCounters,
    /// Per chunk: the epoch in which a `Dirty` record was last committed.
    chunk_epochs: Vec<AtomicU32>,
    /// Per chunk: decayed reads and writes (`pool/migrate.rs`).
    pub(crate) heat: migrate::Heat,
    /// Data written here, and how much of it a flush covered.
    written: DataWrites,
    /// Its [`superblock::MemberState`] as of now (`pool/remove.rs`).
    state: std::sync::atomic::AtomicU8,
}

impl PoolDevice {
    /// The member's mirror, when it is one (it may become one while the
    /// pool runs, never the other way).
    pub fn mirror(&self) -> Option<&Arc<vdev::Mirror>> {
        self.vdev.mirror()
    }

    fn new(vdev: Arc<vdev::Vdev>, member: Member, chunks: u64) -> PoolDevice {
        PoolDevice {
            device: vdev.clone(),
            vdev,
            member,
            counters: DeviceCounters::default(),
            chunk_epochs: (0..chunks).map(|_| AtomicU32::new(0)).collect(),
            heat: migrate::Heat::new(chunks),
            written: Default::default(),
            state: std::sync::atomic::AtomicU8::new(member.state as u8),
        }
    }
}

/// A device's completed data writes (count and bytes) and the count the
/// last flush covered: a commit flushes a device only when they differ.
/// Per device, so writes to different devices share no counter, and a
/// commit flushes only the devices written since their last flush.
#[derive(Default)]
struct DataWrites {
    writes: AtomicU64,
    flushed: AtomicU64,
    bytes: AtomicU64,
}

/// What `pool status` shows per device.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct DeviceStatus {
    pub index: u8,
    pub name: String,
    pub role: Role,
    pub size_bytes: u64,
    pub data_bytes: u64,
    pub used_bytes: u64,
    pub engine: String,
    pub read_errors: u64,
    pub write_errors: u64,
    pub checksum_errors: u64,
    pub repaired_after_crash: u64,
    /// A sparse file device: what its file system has allocated of it and
    /// has free (see [`BackingSpace`]).
    #[serde(default)]
    pub backing: Option<BackingSpace>,
    /// How much more the pool's device files on this device's file system
    /// may still grow by than that file system has free (0 when it can hold
    /// them all, or for block devices).
    #[serde(default)]
    pub unbackable_bytes: u64,
    /// `ONLINE`, or `DEGRADED` for a mirror with a child that is not up to
    /// date.
    #[serde(default = "online")]
    pub state: String,
    /// A mirror's devices (empty for a single device).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ChildStatus>,
    /// The resilver under way on this mirror.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resilver: Option<ResilverStatus>,
    /// Its removal (`pool remove`), under way or stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removal: Option<RemovalStatus>,
}

fn online() -> String {
    "ONLINE".into()
}

/// One device of a mirror in `pool status`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct ChildStatus {
    pub name: String,
    pub state: vdev::Health,
    pub write_mostly: bool,
    pub read_errors: u64,
    pub write_errors: u64,
    pub checksum_errors: u64,
    /// 4 KiB sectors rewritten from another copy.
    pub repaired_sectors: u64,
    #[serde(default)]
    pub backing: Option<BackingSpace>,
    /// Being replaced (`pool replace`): detached once its replacement is
    /// resilvered.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replaced: bool,
    /// The device replacing the mirror's `replaced` one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replacement: bool,
    /// For a device not up to date: at most how much its resilver copies
    /// (what changed while it was away, from the mirror's dirty record).
    /// Absent: it is resilvered in full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed_bytes: Option<u64>,
}

impl DeviceStatus {
    /// The file system under this sparse device file has under 10 % free.
    pub fn backing_low(&self) -> bool {
        self.backing.is_some_and(|b| b.fs_free_bytes < b.fs_size_bytes / 10)
    }

    /// Why the file system under this device needs attention, if it does:
    /// less free space than the device could still ask of it, or under 10 %.
    pub fn backing_warning(&self) -> Option<String> {
        let backing = self.backing?;
        let unbacked = self.size_bytes.saturating_sub(backing.backed_bytes);
        let low = self.backing_low();
        if self.unbackable_bytes == 0 && !low {
            return None;
        }
        Some(format!(
            "{}: its file system has {} free of {}; this device file may still grow by {}{}",
            self.name,
            crate::units::format_size(backing.fs_free_bytes),
            crate::units::format_size(backing.fs_size_bytes),
            crate::units::format_size(unbacked),
            if self.unbackable_bytes > 0 {
                format!(
                    "; with the pool's other files there, {} more than it can hold: \
                     writes into new space will fail with ENOSPC once it is full",
                    crate::units::format_size(self.unbackable_bytes)
                )
            } else {
                String::new()
            }
        ))
    }
}

/// Metadata I/O counters (for the "metadata bytes per write" benchmark).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MetaCounters {
    /// Bytes written to the log by commits.
    pub log_bytes: u64,
    /// Bytes handed to the log device by staging (see `Log::stage`).
    pub staged_log_bytes: u64,
    /// Bytes written to the metadata store (checkpoints).
    pub store_bytes: u64,
    /// Bytes of volume data written to the devices.
    pub data_bytes: u64,
    pub checkpoints: u64,
    pub checkpoint_pages: u64,
    /// Log commits that wrote records, and the records they wrote.
    pub log_commits: u64,
    pub log_records: u64,
    /// Flushes of the data devices (each an `fdatasync` of every data
    /// device file): what a commit pays beyond its log write.
    pub data_flushes: u64,
    /// Those made by a log commit, under its lock (the others: the
    /// destager's, before it appends its records).
    pub commit_data_flushes: u64,
    /// Writes that waited for log room ([`Pool::wait_for_log_room`]), and
    /// their waits summed (µs).
    pub log_room_waits: u64,
    pub log_room_wait_micros: u64,
    /// Times a thread found the allocator's lock held, and their waits
    /// summed (µs); the same for the lock on the log's pending records.
    /// Both locks are shared by all volumes' writes (a write that
    /// allocates takes each once).
    pub allocator_lock_waits: u64,
    pub allocator_lock_wait_micros: u64,
    pub log_lock_waits: u64,
    pub log_lock_wait_micros: u64,
    /// The block-map and checksum page caches: pages cached, the most they
    /// hold, and pages read from the metadata store because they were not
    /// cached (since start).
    pub map_cache_pages: u64,
    pub map_cache_max_pages: u64,
    pub map_cache_misses: u64,
    pub crc_cache_pages: u64,
    pub crc_cache_max_pages: u64,
    pub crc_cache_misses: u64,
    /// Corrupt metadata met since start ([`Pool::metadata_errors`]).
    pub metadata_errors: u64,
}

/// The runtime the pool's background tasks (destager, freer, migrator)
/// run on: the current one if it has worker threads, else none (a
/// single-threaded test runtime drives that work itself).
fn background_runtime() -> Option<tokio::runtime::Handle> {
    let handle = tokio::runtime::Handle::try_current().ok()?;
    (handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread).then_some(handle)
}

pub struct Pool {
    name: String,
    uuid: [u8; 16],
    chunk_bytes: u32,
    /// Append-only: `pool add-device` adds devices while the pool runs.
    devices: grow::DeviceList,
    meta_device: u8,
    db: crate::meta::store::Store,
    log: Log,
    map_pages: PageCache<MapPage>,
    crc_pages: PageCache<CrcPage>,
    /// Whether stored checksums are tagged with their sector's place in its
    /// volume (every pool created since the tags exist; see
    /// `blockmap::sector_tag`).
    checksum_tags: bool,
    /// The membership as the superblocks record it (`pool/vdev.rs`).
    membership: Arc<vdev::Membership>,
    /// Where the metadata and log regions are (fixed at creation).
    regions: Regions,
    /// Resilvers under way, by member (`pool/resilver.rs`).
    resilvers: Mutex<HashMap<u8, resilver::ResilverStatus>>,
    /// Background work runs (`PoolOptions::background`): an attach starts
    /// its resilver at once.
    background: bool,
    /// Held by the one resilver that runs at a time.
    resilvering: tokio::sync::Mutex<()>,
    /// Devices taken out of the pool (a replaced device detached when its
    /// replacement was resilvered, or one given at open that the newest
    /// superblock no longer names), for the caller to forget and clear
    /// ([`Pool::take_detached`]).
    detached: Mutex<Vec<Arc<dyn Device>>>,
    /// The removal under way, or the last one that failed (`pool/remove.rs`).
    removal: Mutex<Option<RemovalStatus>>,
    /// The scrub running or last run since the pool opened (`pool/scrub.rs`).
    scrub: Mutex<Option<Arc<scrub::ScrubJob>>>,
    /// The devices as stored metadata is checked against (grows with
    /// `pool add-device`).
    geometry: Arc<std::sync::RwLock<crate::meta::geometry::Geometry>>,
    /// Corrupt metadata met while serving: counted, each finding logged
    /// once.
    corruption: Arc<crate::meta::geometry::CorruptionLog>,
    allocator: Ranked<crate::sync::WatchedMutex<Allocator>>,
    epoch: AtomicU32,
    /// Parts of chunks whose checksums are not trusted after a crash (a
    /// write may have been in flight there), until read back or rewritten.
    suspect: Ranked<Mutex<HashMap<(u8, u64), ChunkParts>>>,
    /// The highest epoch whose writes in place a committed checkpoint
    /// covers: in-place marks of it and earlier epochs are no longer needed.
    covered: AtomicU32,
    /// While the log is replayed at open: the sectors the RAM tier's
    /// in-place marks name for each chunk (`None`: the marks did not
    /// survive, so every sector of a `Dirty` chunk is suspect).
    crash_marks: Mutex<Option<ram::CrashMarks>>,
    /// Destroyed volumes whose pages the next checkpoint deletes.
    destroyed: Ranked<Mutex<HashSet<u32>>>,
    /// The write gate, in shards by volume id ([`Pool::gate`]): held shared
    /// by every write (in its volume's shard), exclusively by a checkpoint
    /// while it takes its snapshot (every shard, so the snapshot is
    /// consistent). One lock for all volumes would make every write of
    /// every volume take (and release: tokio's release locks its wait list)
    /// the same lock.
    gates: Box<[GateShard]>,
    checkpointing: Ranked<tokio::sync::Mutex<()>>,
    /// Held by the one writer that makes room in a full log (see
    /// `Pool::make_log_room`); the others wait for it instead of each
    /// destaging and checkpointing.
    making_log_room: Ranked<tokio::sync::Mutex<()>>,
    /// Held shared by a commit from its log write until the slots its
    /// records freed are released in the allocator, exclusively by a
    /// checkpoint around its own commit and its snapshot of the allocator:
    /// a checkpoint taken in between would store those slots as in use and
    /// move the log's tail past the records freeing them, leaking them if
    /// the daemon died before the next checkpoint.
    releasing: Ranked<tokio::sync::RwLock<()>>,
    checkpoints: AtomicU64,
    checkpoint_pages: AtomicU64,
    checkpoint_scheduled: std::sync::atomic::AtomicBool,
    /// Frees of more slots than this go to the freeing queue
    /// (`pool/freeing.rs`).
    free_above: std::sync::atomic::AtomicUsize,
    /// Wakes the freer; one freeing batch at a time.
    freer_wake: Arc<tokio::sync::Notify>,
    freer: tokio::sync::Mutex<()>,
    /// The file system under a sparse device has less free space than the
    /// pool's files there may still grow by, or under 10 % free (any
    /// device's [`DeviceStatus::backing_warning`]). Kept by the destager's
    /// periodic check, read per SCSI command (thin provisioning threshold).
    backing_low: std::sync::atomic::AtomicBool,
    store_bytes: Arc<AtomicU64>,
    /// The write-back cache in the RAM tier.
    pub(crate) cache: cache::WriteCache,
    /// Clean sectors recently read, shared by all volumes.
    pub(crate) read_cache: readcache::ReadCache,
    /// Pool space promised to cached writes into unmapped blocks.
    reserved_bytes: AtomicU64,
    /// A device write failed for lack of space (the pool's, or the file
    /// system's under a file device): until the destager sees room again,
    /// writes bypass the cache, so none is acknowledged into RAM that could
    /// not be placed later (see `Pool::space_short`).
    space_short: std::sync::atomic::AtomicBool,
    /// Snapshots of the pool's volumes (`pool/snapshots/`).
    snapshots: Ranked<std::sync::RwLock<snapshots::Snapshots>>,
    /// Whether there are any: writes skip the snapshot checks when not.
    has_snapshots: std::sync::atomic::AtomicBool,
    /// Serialises copying a map page into a snapshot, and every other
    /// change of who maps a shared slot: snapshot deletion, rollback,
    /// promotion, a volume's destruction, a shared block's move.
    page_copy: Ranked<Mutex<()>>,
    /// Shared blocks remapped (`pool/relocate.rs`): odd while one is
    /// under way.
    relocations: AtomicU64,
    /// Every open engine, volumes and snapshot views, by id (weak).
    open_engines: Ranked<Mutex<Vec<OpenEngine>>>,
    /// Flushes of the data devices done (see `MetaCounters::data_flushes`).
    data_flushes: AtomicU64,
    /// Of those, the ones a log commit made (`MetaCounters::commit_data_flushes`).
    commit_data_flushes: AtomicU64,
    /// See `MetaCounters::log_room_waits`.
    log_room_waits: AtomicU64,
    log_room_wait_micros: AtomicU64,
    /// Held by the one flush of the data devices under way.
    data_flush: Ranked<tokio::sync::Mutex<()>>,
    /// Where replay of Data records starts (at or before the checkpoint LSN).
    data_tail: AtomicU64,
    /// Automatic tiering (`pool/migrate.rs`).
    pub(crate) migrator: migrate::Migrator,
    /// Open volumes, for the destager (weak: a volume's owner closes it).
    engines: Mutex<std::collections::HashMap<u32, std::sync::Weak<volume::EngineVolume>>>,
    /// File datasets' namespaces (`pool/files.rs`).
    namespaces: Mutex<std::collections::HashMap<u32, files::SharedNamespace>>,
    /// Lets `&self` methods start background work that needs an `Arc<Pool>`.
    self_ref: std::sync::OnceLock<std::sync::Weak<Pool>>,
    /// Unit tests: `set_mapping` fails once this many more calls have
    /// succeeded (negative: never), standing in for a map page that cannot
    /// be loaded.
    #[cfg(test)]
    pub(crate) fail_mapping_after: std::sync::atomic::AtomicI64,
    /// Unit tests: run once by the next copy of a map page into a snapshot
    /// or clone, between logging the copy and making it visible.
    #[cfg(test)]
    pub(crate) page_copy_pause: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// The metadata and log regions: (byte offset, bytes) on their devices.
#[derive(Debug, Clone, Copy)]
struct Regions {
    meta: (u64, u64),
    log_device: u8,
    log: (u64, u64),
}

/// An open engine in `Pool::open_engines`: its id, and the engine (weak).
type OpenEngine = (u32, std::sync::Weak<volume::EngineVolume>);

/// A device and the role it should have in a new pool.
pub struct NewDevice {
    pub device: Arc<dyn Device>,
    pub role: Role,
}

/// A member of a new pool: one device, or a mirror of several.
pub struct NewVdev {
    pub role: Role,
    pub devices: Vec<Arc<dyn Device>>,
    /// Per device: a mirror's device that takes reads only when no other
    /// can (empty: none).
    pub write_mostly: Vec<bool>,
}

impl Pool {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn uuid(&self) -> String {
        uuid_text(&self.uuid)
    }

    /// The pool's tag in NFS file handles and fsids: the first 8 bytes of
    /// its uuid (never 0, which marks a handle that names no pool).
    /// Volume and dataset ids are the pool's own, so two pools' datasets
    /// may share an id; the tag tells them apart.
    pub fn handle_tag(&self) -> u64 {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&self.uuid[..8]);
        u64::from_le_bytes(bytes).max(1)
    }

    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }

    pub fn device(&self, index: u8) -> Option<&PoolDevice> {
        self.devices.get(index as usize)
    }

    /// Whether every persistent data device is non-rotational.
    pub fn rotational(&self) -> bool {
        self.devices
            .iter()
            .any(|d| d.member.role.holds_data() && !d.is_removed() && d.device.info().rotational)
    }

    pub fn status(&self) -> Vec<DeviceStatus> {
        let allocator = self.allocator.lock_or_abort();
        let removal = self.removal_status();
        let mut statuses: Vec<DeviceStatus> = self
            .devices
            .iter()
            .filter(|d| !d.is_removed())
            .map(|d| {
                let removal = removal.clone().filter(|r| r.index == d.member.index);
                let removing = d.state() == superblock::MemberState::Evacuating;
                let space = allocator.devices().iter().find(|s| s.index == d.member.index);
                DeviceStatus {
                    index: d.member.index,
                    name: d.device.info().name.clone(),
                    role: d.member.role,
                    size_bytes: d.member.size_bytes,
                    data_bytes: space.map(|s| s.data_chunks() * self.chunk_bytes as u64).unwrap_or(0),
                    used_bytes: space.map(|s| s.used_bytes()).unwrap_or(0),
                    engine: d.device.info().engine.to_string(),
                    read_errors: d.counters.read_errors.load(Ordering::Relaxed),
                    write_errors: d.counters.write_errors.load(Ordering::Relaxed),
                    checksum_errors: d.counters.checksum_errors.load(Ordering::Relaxed),
                    repaired_after_crash: d.counters.repaired_after_crash.load(Ordering::Relaxed),
                    backing: d.device.backing_space(),
                    unbackable_bytes: 0,
                    resilver: self.resilver_status(d.member.index),
                    removal,
                    state: if removing {
                        "REMOVING".into()
                    } else if d.mirror().is_some_and(|m| m.degraded()) {
                        "DEGRADED".into()
                    } else {
                        online()
                    },
                    children: d.mirror().map_or_else(Vec::new, |m| {
                        m.children()
                            .iter()
                            .map(|c| ChildStatus {
                                name: c.name.clone(),
                                state: c.health(),
                                write_mostly: c.write_mostly,
                                read_errors: c.counters.read_errors.load(Ordering::Relaxed),
                                write_errors: c.counters.write_errors.load(Ordering::Relaxed),
                                checksum_errors: c.counters.checksum_errors.load(Ordering::Relaxed),
                                repaired_sectors: c.counters.repaired.load(Ordering::Relaxed),
                                backing: c.device.as_ref().and_then(|d| d.backing_space()),
                                replaced: c.replacing().0,
                                replacement: c.replacing().1,
                                changed_bytes: (c.health() != vdev::Health::Online)
                                    .then(|| m.changed_bytes(c))
                                    .flatten(),
                            })
                            .collect()
                    }),
                }
            })
            .collect();
        drop(allocator);
        // Devices on one file system share its free space: what all of
        // them may still grow by, past that free space, is its shortfall.
        let shortfall = |fs_id: u64| {
            let mut unbacked = 0u64;
            let mut free = 0u64;
            for device in &statuses {
                if let Some(backing) = device.backing.filter(|b| b.fs_id == fs_id) {
                    unbacked += device.size_bytes.saturating_sub(backing.backed_bytes);
                    free = backing.fs_free_bytes;
                }
            }
            unbacked.saturating_sub(free)
        };
        let shortfalls: Vec<u64> = statuses
            .iter()
            .map(|d| d.backing.map_or(0, |b| shortfall(b.fs_id)))
            .collect();
        for (status, shortfall) in statuses.iter_mut().zip(shortfalls) {
            status.unbackable_bytes = shortfall;
        }
        statuses
    }

    pub fn meta_counters(&self) -> MetaCounters {
        let (allocator_lock_waits, allocator_lock_wait_micros) = self.allocator.contention();
        let (log_lock_waits, log_lock_wait_micros) = self.log.lock_contention();
        MetaCounters {
            log_bytes: self.log.bytes_written.load(Ordering::Relaxed),
            staged_log_bytes: self.log.staged_bytes.load(Ordering::Relaxed),
            store_bytes: self.store_bytes.load(Ordering::Relaxed),
            data_bytes: self
                .devices
                .into_iter()
                .map(|d| d.written.bytes.load(Ordering::Relaxed))
                .sum(),
            checkpoints: self.checkpoints.load(Ordering::Relaxed),
            checkpoint_pages: self.checkpoint_pages.load(Ordering::Relaxed),
            log_commits: self.log.commits.load(Ordering::Relaxed),
            log_records: self.log.committed_records.load(Ordering::Relaxed),
            data_flushes: self.data_flushes.load(Ordering::Relaxed),
            commit_data_flushes: self.commit_data_flushes.load(Ordering::Relaxed),
            log_room_waits: self.log_room_waits.load(Ordering::Relaxed),
            log_room_wait_micros: self.log_room_wait_micros.load(Ordering::Relaxed),
            allocator_lock_waits,
            allocator_lock_wait_micros,
            log_lock_waits,
            log_lock_wait_micros,
            map_cache_pages: self.map_pages.len() as u64,
            map_cache_max_pages: self.map_pages.capacity() as u64,
            map_cache_misses: self.map_pages.misses(),
            crc_cache_pages: self.crc_pages.len() as u64,
            crc_cache_max_pages: self.crc_pages.capacity() as u64,
            crc_cache_misses: self.crc_pages.misses(),
            metadata_errors: self.corruption.count(),
        }
    }

    // ---- block map and checksums -------------------------------------------------

    // ---- allocation --------------------------------------------------------------

    // ---- epochs, dirty chunks, the write gate --------------------------------------

    // ---- durability --------------------------------------------------------------

    // ---- volumes -------------------------------------------------------------------

    /// Whether the space under the pool's sparse device files is low, as of
    /// the destager's last check (every 10 s): one atomic load.
    pub fn backing_space_low(&self) -> bool {
        self.backing_low.load(Ordering::Relaxed)
    }

    pub(crate) fn set_backing_space_low(&self, low: bool) {
        self.backing_low.store(low, Ordering::Relaxed);
    }

    /// The device holding the metadata store.
    pub fn meta_device(&self) -> u8 {
        self.meta_device
    }
}
