//! The pool: devices in tiers, the allocator, the metadata store, the log,
//! checkpoints and recovery. Volumes ([`volume::EngineVolume`]) live on it.
//!
//! How the pieces keep data safe (ARCHITECTURE.md has the long version):
//! - Data is written in place. Every 4 KiB sector of an allocated block has a
//!   crc32c in the checksum table, verified on every read.
//! - A new block's mapping and checksums go to the log as one record. Every
//!   log commit first flushes the data devices, so a durable mapping never
//!   points at data that is not durable.
//! - Before the first write into a chunk in each checkpoint epoch, a `Dirty`
//!   record for that chunk is committed. After a crash the chunks named by
//!   such records are *suspect*: their checksums may describe the data before
//!   or after writes that were in flight, so a mismatch there is repaired
//!   from the data instead of reported (and a scrub re-verifies them).
//!   Overwrites therefore cost no metadata I/O beyond that one record per
//!   chunk per epoch.
//! - A checkpoint writes the changed map, checksum and allocation pages to
//!   the metadata store in one transaction and frees the log up to it.
//! - A freed slot is reused only after the record freeing it is durable.

pub mod alloc;
pub mod cache;
mod destage;
pub mod grow;
pub mod ram;
pub mod readcache;
pub mod superblock;
pub mod volume;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::{ReadableTable, TableDefinition};

use crate::device::{Device, DeviceError, IoBuf};
use crate::meta::log::{Log, LogError, Record};
use crate::meta::pages::{CrcPage, MapPage, Page, PageCache, TakenPage, CRCS_PER_PAGE, MAP_ENTRIES_PER_PAGE};
use crate::meta::store::{self, CHUNKS, CRC_PAGES, MAP_PAGES, STATE, SUSPECT};
use crate::sync::LockOrAbort;
use alloc::{Allocator, ChunkState, DeviceSpace};
use superblock::{Member, Role, Superblock, SUPERBLOCK_BYTES, SUPERBLOCK_OFFSETS};

pub const DEFAULT_CHUNK_BYTES: u32 = 1 << 20;
pub const SECTOR_SHIFT: u32 = 12;
pub const SECTOR_BYTES: u64 = 1 << SECTOR_SHIFT;
const DEFAULT_LOG_BYTES: u64 = 64 << 20;
const MIN_META_BYTES: u64 = 32 << 20;
const MAX_META_BYTES: u64 = 16 << 30;
/// Page cache sizes (pages): 8192 map pages of 2 KiB, 4096 checksum pages of 4 KiB.
const MAP_CACHE_PAGES: usize = 8192;
const CRC_CACHE_PAGES: usize = 4096;
/// Checkpoint when this many pages are dirty (bounds memory).
const MAX_DIRTY_PAGES: usize = 16384;
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
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            ram: None,
            background: true,
            read_cache_bytes: DEFAULT_READ_CACHE_BYTES,
        }
    }
}

/// A block-map entry is one `u64`: bits 0..48 the slot's first 4 KiB sector
/// on its device, bits 48..56 the device index, bits 56..63 reserved (zero
/// today; snapshots will use them), bit 63 "mapped".
pub mod map_entry {
    const OFFSET_BITS: u32 = 48;
    const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
    const DEVICE_SHIFT: u32 = OFFSET_BITS;
    const DEVICE_MASK: u64 = 0xff << DEVICE_SHIFT;
    /// Reserved for snapshots and clones (ARCHITECTURE.md, last section).
    pub const RESERVED: u64 = 0x7f << 56;
    pub const VALID: u64 = 1 << 63;

    // The fields are disjoint and cover the word exactly.
    const _: () = assert!(OFFSET_MASK & DEVICE_MASK == 0 && (OFFSET_MASK | DEVICE_MASK) & (RESERVED | VALID) == 0);
    const _: () = assert!(RESERVED & VALID == 0 && (OFFSET_MASK | DEVICE_MASK | RESERVED | VALID) == u64::MAX);
    // Every pool member's index fits the device field.
    const _: () = assert!(super::superblock::MAX_MEMBERS as u64 <= (DEVICE_MASK >> DEVICE_SHIFT) + 1);
    // 2^48 sectors of 4 KiB: devices up to 1 EiB.
    const _: () = assert!(super::SECTOR_SHIFT == 12);

    pub fn encode(device: u8, offset: u64) -> u64 {
        assert!(
            offset.is_multiple_of(super::SECTOR_BYTES) && offset >> super::SECTOR_SHIFT <= OFFSET_MASK,
            "map entry for offset {offset} of device {device}"
        );
        VALID | (device as u64) << DEVICE_SHIFT | (offset >> super::SECTOR_SHIFT)
    }

    /// (device index, byte offset) of a valid entry.
    pub fn decode(entry: u64) -> Option<(u8, u64)> {
        if entry & VALID == 0 {
            return None;
        }
        Some((
            ((entry & DEVICE_MASK) >> DEVICE_SHIFT) as u8,
            (entry & OFFSET_MASK) << super::SECTOR_SHIFT,
        ))
    }
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
    #[error("metadata: {0}")]
    Meta(String),
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

pub struct PoolDevice {
    pub device: Arc<dyn Device>,
    pub member: Member,
    pub counters: DeviceCounters,
    /// Per chunk: the epoch in which a `Dirty` record was last committed.
    chunk_epochs: Vec<AtomicU32>,
}

/// What `pool status` shows per device.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
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
}

pub struct Pool {
    name: String,
    uuid: [u8; 16],
    chunk_bytes: u32,
    /// Append-only: `pool add-device` adds devices while the pool runs.
    devices: grow::DeviceList,
    meta_device: u8,
    db: redb::Database,
    log: Log,
    map_pages: PageCache<MapPage>,
    crc_pages: PageCache<CrcPage>,
    allocator: Mutex<Allocator>,
    epoch: AtomicU32,
    /// Chunks whose checksums are not trusted (after a crash, until scrubbed).
    suspect: Mutex<HashSet<(u8, u64)>>,
    /// Destroyed volumes whose pages the next checkpoint deletes.
    destroyed: Mutex<HashSet<u32>>,
    /// Held shared by every write, exclusively by a checkpoint while it takes
    /// its snapshot (so the snapshot is consistent).
    gate: tokio::sync::RwLock<()>,
    checkpointing: tokio::sync::Mutex<()>,
    checkpoints: AtomicU64,
    checkpoint_pages: AtomicU64,
    checkpoint_scheduled: std::sync::atomic::AtomicBool,
    store_bytes: Arc<AtomicU64>,
    pub(crate) data_bytes: AtomicU64,
    /// The write-back cache in the RAM tier.
    pub(crate) cache: cache::WriteCache,
    /// Clean sectors recently read, shared by all volumes.
    pub(crate) read_cache: readcache::ReadCache,
    /// Pool space promised to cached writes into unmapped blocks.
    reserved_bytes: AtomicU64,
    /// Data-device writes completed, and how many of them a flush covered:
    /// a commit flushes the data devices only when they differ.
    data_writes: AtomicU64,
    data_flushed: AtomicU64,
    /// Where replay of Data records starts (at or before the checkpoint LSN).
    data_tail: AtomicU64,
    /// Lets `&self` methods start background work that needs an `Arc<Pool>`.
    self_ref: std::sync::OnceLock<std::sync::Weak<Pool>>,
    /// Unit tests: `set_mapping` fails once this many more calls have
    /// succeeded (negative: never), standing in for a map page that cannot
    /// be loaded.
    #[cfg(test)]
    pub(crate) fail_mapping_after: std::sync::atomic::AtomicI64,
}

/// Whether the log is being replayed: then a change may already be in the
/// checkpoint, and freeing a free slot is expected rather than a bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replaying {
    Yes,
    No,
}

/// A device and the role it should have in a new pool.
pub struct NewDevice {
    pub device: Arc<dyn Device>,
    pub role: Role,
}

fn round_up(value: u64, unit: u64) -> u64 {
    value.div_ceil(unit) * unit
}

async fn read_superblock(device: &Arc<dyn Device>) -> Result<(Superblock, bool), PoolError> {
    let mut copies = Vec::new();
    for offset in SUPERBLOCK_OFFSETS {
        let (buf, result) = device.read(offset, IoBuf::new(SUPERBLOCK_BYTES)).await;
        match result {
            Ok(()) => copies.push(buf.payload().to_vec()),
            Err(_) => copies.push(vec![0xff; SUPERBLOCK_BYTES]),
        }
    }
    superblock::choose([&copies[0], &copies[1]]).map_err(|e| PoolError::Device {
        device: device.info().name.clone(),
        reason: e.to_string(),
    })
}

async fn write_superblock(device: &Arc<dyn Device>, superblock: &Superblock) -> Result<(), DeviceError> {
    let bytes = superblock.encode();
    for offset in SUPERBLOCK_OFFSETS {
        let (_, result) = device.write(offset, IoBuf::copy_from(&bytes)).await;
        result?;
        // Flush between copies: a crash can tear at most one of them.
        device.flush().await?;
    }
    Ok(())
}

/// Runs metadata-store work off the async workers when there are threads to
/// spare; inline on a current-thread runtime (the simulator's devices
/// complete at once, so nothing there would wait).
async fn run_blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            match tokio::task::spawn_blocking(work).await {
                Ok(value) => value,
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        _ => work(),
    }
}

impl Pool {
    /// Initialises a pool on `devices` (which must not already be strata
    /// devices) and opens it.
    pub async fn create(name: &str, chunk_bytes: u32, devices: Vec<NewDevice>) -> Result<Arc<Pool>, PoolError> {
        Self::create_with(name, chunk_bytes, devices, PoolOptions::default()).await
    }

    /// `create` with options for the opened pool.
    pub async fn create_with(
        name: &str,
        chunk_bytes: u32,
        devices: Vec<NewDevice>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>, PoolError> {
        if devices.is_empty() || devices.len() > superblock::MAX_MEMBERS {
            return Err(PoolError::Invalid(format!(
                "a pool needs 1 to {} devices",
                superblock::MAX_MEMBERS
            )));
        }
        if !chunk_bytes.is_power_of_two() || !(64 << 10..=64 << 20).contains(&chunk_bytes) {
            return Err(PoolError::Invalid(format!(
                "chunk size {chunk_bytes} must be a power of two from 64K to 64M"
            )));
        }
        if !devices.iter().any(|d| d.role.holds_data()) {
            return Err(PoolError::Invalid(
                "a pool needs at least one fast or capacity device".into(),
            ));
        }
        for new in &devices {
            if read_superblock(&new.device).await.is_ok() {
                return Err(PoolError::InUse(new.device.info().name.clone()));
            }
        }
        let chunk = chunk_bytes as u64;
        let members: Vec<Member> = devices
            .iter()
            .enumerate()
            .map(|(index, new)| Member {
                uuid: random_uuid(),
                role: new.role,
                index: index as u8,
                size_bytes: new.device.info().size_bytes / chunk * chunk,
            })
            .collect();
        // Metadata on the first fast device (else the first data device).
        let meta_device = members
            .iter()
            .find(|m| m.role == Role::Fast)
            .or_else(|| members.iter().find(|m| m.role.holds_data()))
            .map(|m| m.index)
            .unwrap_or(0);
        let data_bytes: u64 = members
            .iter()
            .filter(|m| m.role.holds_data())
            .map(|m| m.size_bytes)
            .sum();
        // Metadata needs about 1/128 of the data; four times that leaves
        // room to grow the pool fourfold with `pool add-device`.
        let meta_bytes = round_up((data_bytes / 32).clamp(MIN_META_BYTES, MAX_META_BYTES), chunk);
        let meta_offset = chunk;
        let (log_device, log_offset, log_bytes) = match members.iter().find(|m| m.role == Role::Log) {
            Some(log) => (log.index, chunk, round_up((log.size_bytes - chunk).min(1 << 30), chunk)),
            None => (
                meta_device,
                meta_offset + meta_bytes,
                round_up(DEFAULT_LOG_BYTES, chunk),
            ),
        };
        for member in &members {
            let mut reserved = chunk;
            if member.index == meta_device {
                reserved += meta_bytes;
            }
            if member.index == log_device {
                reserved = reserved.max(log_offset + log_bytes);
            }
            if member.size_bytes < reserved + if member.role.holds_data() { 4 * chunk } else { 0 } {
                return Err(PoolError::Invalid(format!(
                    "{} is too small ({} bytes; needs at least {} for its role)",
                    devices[member.index as usize].device.info().name,
                    member.size_bytes,
                    reserved + 4 * chunk
                )));
            }
        }
        let pool_uuid = random_uuid();
        let created_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // An empty header makes the metadata region start empty.
        let meta = &devices[meta_device as usize].device;
        let (_, result) = meta.write(meta_offset, IoBuf::new(4096)).await;
        result?;
        meta.flush().await?;
        // On a regular file, write the log region once now: otherwise each
        // commit's first pass over it makes the file system allocate blocks,
        // and the commit's fdatasync then also commits the file system's
        // journal (measured: a 4K sync write's p50 375 µs on a sparse log
        // file against 243 µs on a written one).
        let log_dev = &devices[log_device as usize].device;
        if log_dev.info().regular_file {
            let mut zeros = IoBuf::new(1 << 20);
            let mut at = 0;
            while at < log_bytes {
                let length = (log_bytes - at).min(1 << 20) as usize;
                if zeros.len() != length {
                    zeros = IoBuf::new(length);
                }
                let (buf, result) = log_dev.write(log_offset + at, zeros).await;
                result?;
                zeros = buf;
                at += length as u64;
            }
            log_dev.flush().await?;
        }
        for (index, new) in devices.iter().enumerate() {
            let superblock = Superblock {
                pool_uuid,
                pool_name: name.to_string(),
                generation: 1,
                created_unix,
                chunk_bytes,
                device_index: index as u8,
                meta_device,
                meta_offset,
                meta_bytes,
                log_device,
                log_offset,
                log_bytes,
                members: members.clone(),
            };
            write_superblock(&new.device, &superblock).await?;
        }
        Self::open_with(devices.into_iter().map(|d| d.device).collect(), options).await
    }

    /// Opens a pool from its devices (in any order), replaying the log.
    pub async fn open(devices: Vec<Arc<dyn Device>>) -> Result<Arc<Pool>, PoolError> {
        Self::open_with(devices, PoolOptions::default()).await
    }

    /// `open` with a RAM tier and background work as given.
    pub async fn open_with(devices: Vec<Arc<dyn Device>>, options: PoolOptions) -> Result<Arc<Pool>, PoolError> {
        let mut found = Vec::new();
        for device in &devices {
            let (superblock, repair) = read_superblock(device).await?;
            found.push((device.clone(), superblock, repair));
        }
        // The newest superblock describes the pool; every device must agree.
        let reference = found
            .iter()
            .max_by_key(|(_, s, _)| s.generation)
            .map(|(_, s, _)| s.clone())
            .ok_or_else(|| PoolError::Invalid("no devices given".into()))?;
        let mut slots: Vec<Option<Arc<dyn Device>>> = vec![None; reference.members.len()];
        for (device, superblock, repair) in &found {
            if superblock.pool_uuid != reference.pool_uuid {
                return Err(PoolError::Foreign {
                    device: device.info().name.clone(),
                    found: superblock.pool_name.clone(),
                    found_uuid: uuid_text(&superblock.pool_uuid),
                    expected: reference.pool_name.clone(),
                });
            }
            let member = superblock
                .this_member()
                .ok_or_else(|| PoolError::Invalid("superblock without its own member entry".into()))?;
            match reference.members.get(member.index as usize) {
                Some(expected) if expected.uuid == member.uuid => {}
                _ => {
                    return Err(PoolError::Invalid(format!(
                        "{} claims to be device {} of pool '{}' but the pool does not list it",
                        device.info().name,
                        member.index,
                        reference.pool_name
                    )))
                }
            }
            if slots[member.index as usize].is_some() {
                return Err(PoolError::Invalid(format!(
                    "device {} of pool '{}' was given twice",
                    member.index, reference.pool_name
                )));
            }
            if *repair || superblock.generation < reference.generation {
                let mut fixed = reference.clone();
                fixed.device_index = member.index;
                write_superblock(device, &fixed).await?;
                tracing::warn!("{}: rewrote a damaged or stale superblock copy", device.info().name);
            }
            slots[member.index as usize] = Some(device.clone());
        }
        let mut pool_devices = Vec::new();
        for (index, slot) in slots.into_iter().enumerate() {
            let member = reference.members[index];
            let Some(device) = slot else {
                return Err(PoolError::Missing {
                    pool: reference.pool_name.clone(),
                    role: member.role.as_str(),
                    uuid: uuid_text(&member.uuid),
                    index: index as u8,
                    count: reference.members.len(),
                });
            };
            if device.info().size_bytes < member.size_bytes {
                return Err(PoolError::Device {
                    device: device.info().name.clone(),
                    reason: format!(
                        "is {} bytes but the pool recorded {} (truncated or wrong device)",
                        device.info().size_bytes,
                        member.size_bytes
                    ),
                });
            }
            let chunks = member.size_bytes / reference.chunk_bytes as u64;
            pool_devices.push(PoolDevice {
                device,
                member,
                counters: DeviceCounters::default(),
                chunk_epochs: (0..chunks).map(|_| AtomicU32::new(0)).collect(),
            });
        }
        Self::recover(reference, pool_devices, options).await
    }

    async fn recover(
        superblock: Superblock,
        devices: Vec<PoolDevice>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>, PoolError> {
        let chunk = superblock.chunk_bytes as u64;
        let meta_dev = devices[superblock.meta_device as usize].device.clone();
        let (meta_offset, meta_bytes) = (superblock.meta_offset, superblock.meta_bytes);
        let store_bytes = Arc::new(AtomicU64::new(0));
        let written = store_bytes.clone();
        let db =
            run_blocking(move || store::open_database(meta_dev, meta_offset, meta_bytes, STORE_CACHE_BYTES, written))
                .await
                .map_err(PoolError::Meta)?;
        let checkpoint_lsn = store::read_state(&db, "checkpoint_lsn").map_err(PoolError::Meta)?;
        // Pools checkpointed before the intent log carried data have no
        // separate data tail (0 = the checkpoint LSN).
        let data_tail = match store::read_state(&db, "has_data_tail").map_err(PoolError::Meta)? {
            0 => checkpoint_lsn,
            _ => store::read_state(&db, "data_tail")
                .map_err(PoolError::Meta)?
                .min(checkpoint_lsn),
        };
        let epoch = store::read_state(&db, "epoch").map_err(PoolError::Meta)? as u32;

        // Space: every data device minus chunk 0 and the metadata/log regions.
        let spaces = devices
            .iter()
            .filter(|d| d.member.role.holds_data())
            .map(|d| {
                let mut first = 1u64;
                if d.member.index == superblock.meta_device {
                    first = first.max((superblock.meta_offset + superblock.meta_bytes) / chunk);
                }
                if d.member.index == superblock.log_device {
                    first = first.max((superblock.log_offset + superblock.log_bytes) / chunk);
                }
                DeviceSpace::new(d.member.index, d.member.role, first, d.member.size_bytes / chunk)
            })
            .collect();
        let mut allocator = Allocator::new(superblock.chunk_bytes, spaces);
        let mut suspect = HashSet::new();
        {
            let txn = db.begin_read().map_err(|e| PoolError::Meta(e.to_string()))?;
            let chunks = txn.open_table(CHUNKS).map_err(|e| PoolError::Meta(e.to_string()))?;
            for row in chunks.iter().map_err(|e| PoolError::Meta(e.to_string()))? {
                let (key, value) = row.map_err(|e| PoolError::Meta(e.to_string()))?;
                let (device, chunk_index) = key.value();
                let state = ChunkState::decode(value.value())
                    .ok_or_else(|| PoolError::Meta(format!("damaged chunk record {device}/{chunk_index}")))?;
                allocator
                    .load_chunk(device as u8, chunk_index, state)
                    .map_err(|e| PoolError::Meta(format!("chunk record {device}/{chunk_index}: {e}")))?;
            }
            let table = txn.open_table(SUSPECT).map_err(|e| PoolError::Meta(e.to_string()))?;
            for row in table.iter().map_err(|e| PoolError::Meta(e.to_string()))? {
                let (key, _) = row.map_err(|e| PoolError::Meta(e.to_string()))?;
                let (device, chunk_index) = key.value();
                suspect.insert((device as u8, chunk_index));
            }
        }
        allocator.take_dirty();

        let log_device = devices[superblock.log_device as usize].device.clone();
        let pool_tag = u64::from_le_bytes(superblock.pool_uuid[0..8].try_into().unwrap_or([0; 8]));
        let (records, end_lsn, valid_end) = Log::replay(
            &log_device,
            superblock.log_offset,
            superblock.log_bytes,
            pool_tag,
            data_tail,
        )
        .await?;
        let log = Log::new(
            log_device,
            superblock.log_offset,
            superblock.log_bytes,
            pool_tag,
            data_tail,
            end_lsn,
        );
        // The RAM tier: if it survived (the process died, the machine did
        // not), it holds the newest contents of every dirty sector and the
        // log's Data records are not needed. Otherwise the live Data records
        // rebuild the cache.
        let source = options
            .ram
            .clone()
            .unwrap_or_else(|| ram::RamSource::Heap(ram::HeapImage::new(DEFAULT_RAM_BYTES)));
        let (ram_tier, survivors, intact) = ram::RamTier::open(&source, &superblock.pool_uuid)
            .map_err(|e| PoolError::Invalid(format!("cannot open the RAM tier: {e}")))?;
        let replayed_data = if intact {
            Vec::new()
        } else {
            cache::live_data_records(&records)
        };
        let (ram_tier, survivors) = if replayed_data.len() > ram_tier.total_slots() {
            // Smaller than the data the log still holds: grow it for now.
            tracing::warn!(
                "RAM tier {} is smaller than the {} sectors to replay; using a larger heap region",
                ram_tier.location(),
                replayed_data.len()
            );
            let image = ram::HeapImage::new((replayed_data.len() as u64 + 64) * ram::SLOT_BYTES as u64 * 2);
            let (tier, survivors, _) = ram::RamTier::open(&ram::RamSource::Heap(image), &superblock.pool_uuid)
                .map_err(|e| PoolError::Invalid(format!("cannot open the RAM tier: {e}")))?;
            (tier, survivors)
        } else {
            (ram_tier, survivors)
        };
        if !survivors.is_empty() {
            tracing::info!(
                "pool {}: {} dirty sectors survived in the RAM tier {}",
                superblock.pool_name,
                survivors.len(),
                ram_tier.location()
            );
        }
        let write_cache = cache::WriteCache::new(ram_tier, &survivors, data_tail);
        let pool = Arc::new(Pool {
            name: superblock.pool_name.clone(),
            uuid: superblock.pool_uuid,
            chunk_bytes: superblock.chunk_bytes,
            meta_device: superblock.meta_device,
            devices: devices.into(),
            db,
            log,
            map_pages: PageCache::new(MAP_CACHE_PAGES),
            crc_pages: PageCache::new(CRC_CACHE_PAGES),
            allocator: Mutex::new(allocator),
            epoch: AtomicU32::new(epoch.wrapping_add(1).max(1)),
            suspect: Mutex::new(suspect),
            destroyed: Mutex::new(HashSet::new()),
            gate: tokio::sync::RwLock::new(()),
            checkpointing: tokio::sync::Mutex::new(()),
            checkpoints: AtomicU64::new(0),
            checkpoint_pages: AtomicU64::new(0),
            checkpoint_scheduled: std::sync::atomic::AtomicBool::new(false),
            store_bytes,
            data_bytes: AtomicU64::new(0),
            cache: write_cache,
            read_cache: readcache::ReadCache::new(options.read_cache_bytes),
            reserved_bytes: AtomicU64::new(0),
            data_writes: AtomicU64::new(0),
            data_flushed: AtomicU64::new(0),
            data_tail: AtomicU64::new(data_tail),
            self_ref: std::sync::OnceLock::new(),
            #[cfg(test)]
            fail_mapping_after: std::sync::atomic::AtomicI64::new(-1),
        });
        let _ = pool.self_ref.set(Arc::downgrade(&pool));
        let replayed = records.len();
        let mut staged_dropped = 0;
        for (record, committed, lsn) in records {
            // Records before the checkpoint were kept for their data only.
            if lsn < checkpoint_lsn || matches!(record, Record::Data { .. } | Record::Written { .. }) {
                continue;
            }
            // A staged record (never committed) counts only if the data it
            // maps made it to the device intact: staging has no data flush
            // before it, so after a power loss the mapping may have landed
            // without its data.
            if !committed && !pool.staged_data_present(&record).await {
                staged_dropped += 1;
                continue;
            }
            pool.apply_replayed(record)?;
        }
        if staged_dropped > 0 {
            tracing::info!(
                "pool {}: ignored {staged_dropped} uncommitted mappings whose data never landed",
                pool.name
            );
        }
        if replayed > 0 {
            tracing::info!(
                "pool {}: replayed {replayed} log records ({} suspect chunks)",
                pool.name,
                pool.suspect.lock_or_abort().len()
            );
        }
        if !replayed_data.is_empty() {
            tracing::info!(
                "pool {}: {} sectors of acknowledged synchronous writes restored from the intent log",
                pool.name,
                replayed_data.len()
            );
            pool.cache.restore(replayed_data);
        }
        // Persist what replay rebuilt and start the log afresh; blocks staged
        // before the crash must not be replayed again by a later recovery.
        pool.checkpoint().await?;
        pool.log.seal(valid_end).await?;
        if options.background {
            pool.start_destager();
        }
        Ok(pool)
    }

    /// Whether the data a staged `Map` record points at matches its checksums.
    async fn staged_data_present(&self, record: &Record) -> bool {
        let Record::Map { new, crcs, .. } = record else {
            return true;
        };
        let Some((device, offset)) = map_entry::decode(*new) else {
            return true;
        };
        let Some(pool_device) = self.devices.get(device as usize) else {
            return false;
        };
        let length = crcs.len() * SECTOR_BYTES as usize;
        let (buf, result) = pool_device.device.read(offset, IoBuf::new(length)).await;
        result.is_ok()
            && buf
                .payload()
                .chunks(SECTOR_BYTES as usize)
                .zip(crcs)
                .all(|(sector, crc)| crate::checksum::crc32c(sector) == *crc)
    }

    /// See `Log::update_pending_allocations`.
    pub(crate) fn note_overwrites<'a>(
        &self,
        volume: u32,
        overwrites: impl IntoIterator<Item = (u64, usize, &'a [u32])>,
    ) {
        self.log.update_pending_allocations(volume, overwrites);
    }

    /// Records appended to the log so far.
    pub(crate) fn log_appends(&self) -> u64 {
        self.log.appended.load(Ordering::Relaxed)
    }

    /// Gives pending log records to the log device without a flush, so that
    /// completed writes survive the death of this process (see
    /// `Log::stage`). Durability still comes only from `commit`.
    pub(crate) async fn stage(&self) -> Result<(), PoolError> {
        self.log.stage().await.map_err(PoolError::from)
    }

    fn apply_replayed(&self, record: Record) -> Result<(), PoolError> {
        match record {
            Record::Dirty { device, chunk } => {
                self.suspect.lock_or_abort().insert((device, chunk));
            }
            Record::Map {
                volume,
                block,
                new,
                old,
                crcs,
            } => {
                let page = self.map_page(volume, block).map_err(PoolError::Meta)?;
                let slot = &page.entries[(block % MAP_ENTRIES_PER_PAGE) as usize];
                slot.store(new, Ordering::Release);
                self.map_pages.mark_dirty(&page);
                let mut allocator = self.allocator.lock_or_abort();
                if let Some((device, offset)) = map_entry::decode(old) {
                    // Already free if the checkpoint came after this record.
                    let _ = allocator.free(device, offset);
                }
                if let Some((device, offset)) = map_entry::decode(new) {
                    let slot_shift = (crcs.len().max(1) as u64 * SECTOR_BYTES).trailing_zeros() as u8;
                    match allocator.mark_used(device, offset, slot_shift) {
                        // Already used if the checkpoint came after this record.
                        Ok(()) | Err(alloc::AllocError::AlreadyUsed { .. }) => {}
                        Err(e) => {
                            return Err(PoolError::Meta(format!(
                                "log record mapping volume {volume} block {block}: {e}"
                            )))
                        }
                    }
                    drop(allocator);
                    for (i, crc) in crcs.iter().enumerate() {
                        self.set_crc(device, offset + i as u64 * SECTOR_BYTES, *crc)
                            .map_err(PoolError::Meta)?;
                    }
                }
            }
            Record::Destroy { volume } => self.free_volume_blocks(volume, Replaying::Yes)?,
            Record::Data { .. } | Record::Written { .. } => {}
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn uuid(&self) -> String {
        uuid_text(&self.uuid)
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
            .any(|d| d.member.role.holds_data() && d.device.info().rotational)
    }

    pub fn status(&self) -> Vec<DeviceStatus> {
        let allocator = self.allocator.lock_or_abort();
        self.devices
            .iter()
            .map(|d| {
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
                }
            })
            .collect()
    }

    pub fn meta_counters(&self) -> MetaCounters {
        MetaCounters {
            log_bytes: self.log.bytes_written.load(Ordering::Relaxed),
            staged_log_bytes: self.log.staged_bytes.load(Ordering::Relaxed),
            store_bytes: self.store_bytes.load(Ordering::Relaxed),
            data_bytes: self.data_bytes.load(Ordering::Relaxed),
            checkpoints: self.checkpoints.load(Ordering::Relaxed),
            checkpoint_pages: self.checkpoint_pages.load(Ordering::Relaxed),
        }
    }

    // ---- block map and checksums -------------------------------------------------

    pub(crate) fn map_page(&self, volume: u32, block: u64) -> Result<Arc<MapPage>, String> {
        self.map_pages.get(&self.db, (volume, block / MAP_ENTRIES_PER_PAGE))
    }

    pub(crate) fn lookup(&self, volume: u32, block: u64) -> Result<u64, String> {
        let page = self.map_page(volume, block)?;
        Ok(page.entries[(block % MAP_ENTRIES_PER_PAGE) as usize].load(Ordering::Acquire))
    }

    /// The map entries of blocks `first..=last`, one page lookup per map
    /// page rather than per block (a megabyte request covers 64 blocks).
    pub(crate) fn lookup_range(&self, volume: u32, first: u64, last: u64) -> Result<Vec<u64>, String> {
        let mut entries = Vec::with_capacity((last - first + 1) as usize);
        let mut block = first;
        while block <= last {
            let page = self.map_page(volume, block)?;
            let within = (block % MAP_ENTRIES_PER_PAGE) as usize;
            let count = (MAP_ENTRIES_PER_PAGE as usize - within).min((last - block + 1) as usize);
            entries.extend(
                page.entries[within..within + count]
                    .iter()
                    .map(|e| e.load(Ordering::Acquire)),
            );
            block += count as u64;
        }
        Ok(entries)
    }

    pub(crate) fn set_mapping(&self, volume: u32, block: u64, entry: u64) -> Result<(), String> {
        #[cfg(test)]
        if self.fail_mapping_after.fetch_sub(1, Ordering::AcqRel) == 0 {
            return Err(format!(
                "injected: map page of volume {volume} block {block} cannot be loaded"
            ));
        }
        let page = self.map_page(volume, block)?;
        page.entries[(block % MAP_ENTRIES_PER_PAGE) as usize].store(entry, Ordering::Release);
        self.map_pages.mark_dirty(&page);
        Ok(())
    }

    fn crc_page(&self, device: u8, sector: u64) -> Result<Arc<CrcPage>, String> {
        self.crc_pages.get(&self.db, (device as u32, sector / CRCS_PER_PAGE))
    }

    /// The stored checksums of `count` sectors from `offset`, one page
    /// lookup per checksum page rather than per sector.
    pub(crate) fn crcs(&self, device: u8, offset: u64, count: usize) -> Result<Vec<u32>, String> {
        let mut crcs = Vec::with_capacity(count);
        let mut sector = offset >> SECTOR_SHIFT;
        while crcs.len() < count {
            let page = self.crc_page(device, sector)?;
            let within = (sector % CRCS_PER_PAGE) as usize;
            let take = (CRCS_PER_PAGE as usize - within).min(count - crcs.len());
            crcs.extend(
                page.crcs[within..within + take]
                    .iter()
                    .map(|c| c.load(Ordering::Acquire)),
            );
            sector += take as u64;
        }
        Ok(crcs)
    }

    pub(crate) fn set_crc(&self, device: u8, offset: u64, crc: u32) -> Result<(), String> {
        let sector = offset >> SECTOR_SHIFT;
        let page = self.crc_page(device, sector)?;
        page.crcs[(sector % CRCS_PER_PAGE) as usize].store(crc, Ordering::Release);
        self.crc_pages.mark_dirty(&page);
        Ok(())
    }

    /// Sets the checksums of consecutive sectors from `offset`, one page
    /// lookup per checksum page rather than per sector.
    pub(crate) fn set_crcs(&self, device: u8, offset: u64, crcs: &[u32]) -> Result<(), String> {
        let first = offset >> SECTOR_SHIFT;
        let mut index = 0;
        while index < crcs.len() {
            let sector = first + index as u64;
            let page = self.crc_page(device, sector)?;
            let within = (sector % CRCS_PER_PAGE) as usize;
            let count = (CRCS_PER_PAGE as usize - within).min(crcs.len() - index);
            for (slot, crc) in page.crcs[within..within + count]
                .iter()
                .zip(&crcs[index..index + count])
            {
                slot.store(*crc, Ordering::Release);
            }
            self.crc_pages.mark_dirty(&page);
            index += count;
        }
        Ok(())
    }

    pub(crate) fn is_suspect(&self, device: u8, offset: u64) -> bool {
        let chunk = offset / self.chunk_bytes as u64;
        self.suspect.lock_or_abort().contains(&(device, chunk))
    }

    // ---- allocation --------------------------------------------------------------

    /// Allocates a slot, at `hint` if it is free (see
    /// [`alloc::Allocator::allocate_near`]).
    pub(crate) fn allocate_near(&self, slot_shift: u8, hint: Option<alloc::Hint>) -> Option<(u8, u64)> {
        self.allocator.lock_or_abort().allocate_near(slot_shift, hint)
    }

    /// Returns a slot that was never mapped (its write failed).
    pub(crate) fn release_unused(&self, device: u8, offset: u64) {
        let freed = self.allocator.lock_or_abort().free(device, offset);
        assert!(freed, "released slot {device}/{offset} was not allocated");
    }

    pub(crate) fn log_mapping(&self, record: Record) {
        match &record {
            Record::Map { old, .. } if *old & map_entry::VALID != 0 => {
                let slot = map_entry::decode(*old).unwrap_or((0, 0));
                self.log.append_free(record, slot);
            }
            _ => self.log.append(record),
        }
    }

    // ---- epochs, dirty chunks, the write gate --------------------------------------

    pub(crate) fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Makes sure a `Dirty` record is durable for each chunk (device, byte
    /// offset) in the current epoch before data is written there. Returns the
    /// epoch it made sure of.
    ///
    /// A chunk whose predecessor on the device is already marked in this
    /// epoch is most likely part of a sequential stream: the marks for the
    /// chunks after it (up to [`MARK_AHEAD_BYTES`]) go into the same log
    /// write, so a stream pays one log flush per 16 MiB instead of one per
    /// chunk. Marking a chunk nobody writes costs nothing but this: were the
    /// pool to crash in this epoch, that chunk's checksum mismatches would be
    /// repaired from the data (as in every chunk written in the epoch)
    /// instead of reported.
    pub(crate) async fn mark_dirty(&self, places: &[(u8, u64)]) -> Result<u32, PoolError> {
        let ahead = (MARK_AHEAD_BYTES / self.chunk_bytes as u64).max(1);
        loop {
            let epoch = self.epoch();
            let mut marked: Vec<(u8, u64)> = Vec::new();
            for &(device, offset) in places {
                let chunk = offset / self.chunk_bytes as u64;
                let Some(epochs) = self.devices.get(device as usize).map(|d| &d.chunk_epochs) else {
                    continue;
                };
                let is_marked = |chunk: u64| {
                    epochs
                        .get(chunk as usize)
                        .is_none_or(|slot| slot.load(Ordering::Acquire) == epoch)
                };
                if is_marked(chunk) || marked.contains(&(device, chunk)) {
                    continue;
                }
                marked.push((device, chunk));
                if chunk > 0 && is_marked(chunk - 1) {
                    for next in chunk + 1..=chunk + ahead {
                        if !is_marked(next) && !marked.contains(&(device, next)) {
                            marked.push((device, next));
                        }
                    }
                }
            }
            if marked.is_empty() {
                return Ok(epoch);
            }
            for &(device, chunk) in &marked {
                self.log.append(Record::Dirty { device, chunk });
            }
            self.commit_marks().await?;
            for &(device, chunk) in &marked {
                if let Some(slot) = self
                    .devices
                    .get(device as usize)
                    .and_then(|d| d.chunk_epochs.get(chunk as usize))
                {
                    slot.store(epoch, Ordering::Release);
                }
            }
            if self.epoch() == epoch {
                return Ok(epoch);
            }
        }
    }

    pub(crate) async fn enter_write(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        // Without an `.await` when free (see `EngineVolume::read_stripes`).
        match self.gate.try_read() {
            Ok(guard) => guard,
            Err(_) => self.gate.read().await,
        }
    }

    // ---- durability --------------------------------------------------------------

    /// Counts a completed data-device write (see `flush_data_devices`).
    pub(crate) fn note_data_write(&self) {
        self.data_writes.fetch_add(1, Ordering::AcqRel);
    }

    /// Flushes the data devices if any data write completed since the last
    /// flush (a commit of Data records alone needs only the log device).
    pub(crate) async fn flush_data_devices(&self) -> Result<(), DeviceError> {
        let written = self.data_writes.load(Ordering::Acquire);
        if written == self.data_flushed.load(Ordering::Acquire) {
            return Ok(());
        }
        self.flush_data_devices_now().await?;
        self.data_flushed.fetch_max(written, Ordering::AcqRel);
        Ok(())
    }

    async fn flush_data_devices_now(&self) -> Result<(), DeviceError> {
        for device in &self.devices {
            if device.member.role.holds_data() {
                if let Err(e) = device.device.flush().await {
                    device.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Makes every completed write durable: flushes the data devices, then
    /// commits the log. Group-committed: concurrent callers share one commit.
    /// A full log is freed by a checkpoint, destaging the data it holds if
    /// that is what keeps it full (backpressure).
    pub async fn commit(&self) -> Result<(), PoolError> {
        for attempt in 0..4 {
            match self.log.commit(|| self.flush_data_devices(), false).await {
                Ok(frees) => {
                    self.release_frees(frees).await;
                    self.maybe_checkpoint_soon();
                    return Ok(());
                }
                Err(LogError::Full) if attempt == 0 => self.checkpoint_metadata().await?,
                Err(LogError::Full) => self.checkpoint().await?,
                Err(e) => return Err(e.into()),
            }
        }
        Err(LogError::Full.into())
    }

    /// A commit for the engine's own work (dirty marks, destaging): never
    /// destages, so it can run inside a destage; may use the log's reserve.
    pub(crate) async fn commit_quiet(&self) -> Result<(), PoolError> {
        for attempt in 0..3 {
            match self.log.commit(|| self.flush_data_devices(), attempt > 0).await {
                Ok(frees) => {
                    self.release_frees(frees).await;
                    return Ok(());
                }
                Err(LogError::Full) if attempt < 2 => self.checkpoint_metadata().await?,
                Err(e) => return Err(e.into()),
            }
        }
        Err(LogError::Full.into())
    }

    /// Makes the pending `Dirty` marks durable: one log write when nothing
    /// pending needs the data devices flushed first, else a full commit.
    async fn commit_marks(&self) -> Result<(), PoolError> {
        match self.log.commit_marks().await {
            Ok(Some(frees)) => {
                self.release_frees(frees).await;
                Ok(())
            }
            Ok(None) | Err(LogError::Full) => self.commit_quiet().await,
            Err(e) => Err(e.into()),
        }
    }

    async fn release_frees(&self, frees: Vec<(u8, u64)>) {
        if frees.is_empty() {
            return;
        }
        let mut allocator = self.allocator.lock_or_abort();
        for (device, offset) in frees {
            assert!(
                allocator.free(device, offset),
                "slot {device}/{offset} replaced by a committed write was not in use"
            );
        }
    }

    fn wants_checkpoint(&self) -> bool {
        self.log.usage() > 0.5
            || self.map_pages.dirty_count() + self.crc_pages.dirty_count() > MAX_DIRTY_PAGES
            || self.log.pending_bytes() > 1 << 20
    }

    /// Starts a checkpoint in the background when the log or the dirty pages
    /// grow large (needs a multi-thread runtime; the simulator checkpoints
    /// explicitly).
    pub(crate) fn maybe_checkpoint_soon(&self) {
        if !self.wants_checkpoint() || self.checkpoint_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = self.self_ref.get().and_then(|weak| weak.upgrade());
        match (pool, tokio::runtime::Handle::try_current()) {
            (Some(pool), Ok(handle)) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                handle.spawn(async move {
                    if let Err(e) = pool.checkpoint().await {
                        tracing::error!("pool {}: background checkpoint failed: {e}", pool.name);
                    }
                    pool.checkpoint_scheduled.store(false, Ordering::Release);
                });
            }
            _ => self.checkpoint_scheduled.store(false, Ordering::Release),
        }
    }

    /// Destages the data the intent log holds, then writes every change
    /// since the last checkpoint to the metadata store and frees the log.
    pub async fn checkpoint(&self) -> Result<(), PoolError> {
        if let Err(e) = self.destage_logged().await {
            tracing::warn!("pool {}: destaging before a checkpoint failed: {e}", self.name);
        }
        self.checkpoint_metadata().await
    }

    /// The metadata part of a checkpoint. The log is freed up to the
    /// checkpoint, or up to the oldest Data record still needed.
    pub(crate) async fn checkpoint_metadata(&self) -> Result<(), PoolError> {
        let _one = self.checkpointing.lock().await;
        let gate = self.gate.write().await;
        // Everything logged so far becomes durable first, so the checkpoint
        // LSN is a position every earlier record precedes.
        let frees = self.log.commit(|| self.flush_data_devices(), true).await?;
        self.release_frees(frees).await;
        let lsn = self.log.next_lsn();
        let epoch = self.epoch.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        let map = self.map_pages.take_dirty();
        let crcs = self.crc_pages.take_dirty();
        let chunks = self.allocator.lock_or_abort().take_dirty();
        let suspect = self.suspect_snapshot();
        // Data records are appended under the gate, so none is in flight.
        let data_tail = self.cache.oldest_log_lsn().map_or(lsn, |oldest| oldest.min(lsn));
        let destroyed: Vec<u32> = self.destroyed.lock_or_abort().iter().copied().collect();
        drop(gate);

        let pages = (map.len() + crcs.len()) as u64;
        let result = store::blocking_section(|| {
            self.write_checkpoint(&map, &crcs, &chunks, &suspect, &destroyed, (lsn, data_tail), epoch)
        });
        match result {
            Ok(()) => {
                self.log.set_tail(data_tail);
                self.data_tail.store(data_tail, Ordering::Release);
                let mut pending = self.destroyed.lock_or_abort();
                for volume in destroyed {
                    pending.remove(&volume);
                }
                self.checkpoints.fetch_add(1, Ordering::Relaxed);
                self.checkpoint_pages.fetch_add(pages, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.map_pages.restore_dirty(&map);
                self.crc_pages.restore_dirty(&crcs);
                self.allocator
                    .lock_or_abort()
                    .restore_dirty(chunks.iter().map(|(key, _)| *key));
                Err(PoolError::Meta(format!("checkpoint failed: {e}")))
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write_checkpoint(
        &self,
        map: &[TakenPage<MapPage>],
        crcs: &[TakenPage<CrcPage>],
        chunks: &[((u8, u64), Option<ChunkState>)],
        suspect: &[(u8, u64)],
        destroyed: &[u32],
        (lsn, data_tail): (u64, u64),
        epoch: u32,
    ) -> Result<(), String> {
        // The store's backend blocks on device I/O; the simulator's devices
        // complete at once and real engines complete on their own threads.
        let txn = self.db.begin_write().map_err(|e| e.to_string())?;
        {
            let mut table = txn.open_table(MAP_PAGES).map_err(|e| e.to_string())?;
            for (key, bytes, _) in map {
                table.insert(*key, bytes.as_slice()).map_err(|e| e.to_string())?;
            }
            for volume in destroyed {
                let keys: Vec<(u32, u64)> = table
                    .range((*volume, 0)..=(*volume, u64::MAX))
                    .map_err(|e| e.to_string())?
                    .filter_map(|row| row.ok().map(|(k, _)| k.value()))
                    .collect();
                for key in keys {
                    table.remove(key).map_err(|e| e.to_string())?;
                }
            }
        }
        write_pages(&txn, CRC_PAGES, crcs)?;
        {
            let mut table = txn.open_table(CHUNKS).map_err(|e| e.to_string())?;
            for ((device, chunk), state) in chunks {
                match state {
                    Some(state) => {
                        table
                            .insert((*device as u32, *chunk), state.encode().as_slice())
                            .map_err(|e| e.to_string())?;
                    }
                    None => {
                        table.remove((*device as u32, *chunk)).map_err(|e| e.to_string())?;
                    }
                }
            }
        }
        {
            let mut table = txn.open_table(SUSPECT).map_err(|e| e.to_string())?;
            table.retain(|_, _| false).map_err(|e| e.to_string())?;
            for (device, chunk) in suspect {
                table.insert((*device as u32, *chunk), 0).map_err(|e| e.to_string())?;
            }
        }
        {
            let mut table = txn.open_table(STATE).map_err(|e| e.to_string())?;
            table.insert("checkpoint_lsn", lsn).map_err(|e| e.to_string())?;
            table.insert("data_tail", data_tail).map_err(|e| e.to_string())?;
            table.insert("has_data_tail", 1).map_err(|e| e.to_string())?;
            table.insert("epoch", epoch as u64).map_err(|e| e.to_string())?;
        }
        txn.commit().map_err(|e| e.to_string())
    }

    // ---- volumes -------------------------------------------------------------------

    /// Opens volume `id` (its blocks are looked up lazily).
    pub fn open_volume(
        self: &Arc<Self>,
        id: u32,
        size_bytes: u64,
        volblocksize: u32,
    ) -> Result<Arc<volume::EngineVolume>, PoolError> {
        if !volblocksize.is_power_of_two() || !(4096..=128 << 10).contains(&volblocksize) {
            return Err(PoolError::Invalid(format!(
                "volblocksize {volblocksize} is not supported"
            )));
        }
        let mapped = self.count_mapped_blocks(id)?;
        let engine = Arc::new(volume::EngineVolume::new(
            self.clone(),
            id,
            size_bytes,
            volblocksize,
            mapped,
        ));
        self.restore_reservations(&engine)?;
        self.register_volume(id, Arc::downgrade(&engine));
        Ok(engine)
    }

    /// Reserves pool space again for the unmapped blocks that the cache
    /// holds dirty sectors of after a restart (restored from the RAM tier or
    /// the intent log). They were accepted, with space reserved, before the
    /// crash, so they fit: the reservation is taken even past the free
    /// space, before any new write can claim it.
    fn restore_reservations(&self, engine: &volume::EngineVolume) -> Result<(), PoolError> {
        let cache = self.cache.volume(engine.id());
        let per_block = engine.sectors_per_block();
        let mut blocks: Vec<u64> = {
            let state = cache.lock();
            state
                .entries
                .keys()
                .map(|sector| sector / per_block)
                .filter(|block| !state.reserved.contains(block))
                .collect()
        };
        blocks.dedup();
        let mut unmapped = Vec::new();
        for block in blocks {
            if self.lookup(engine.id(), block).map_err(PoolError::Meta)? & map_entry::VALID == 0 {
                unmapped.push(block);
            }
        }
        if !unmapped.is_empty() {
            self.reserved_bytes
                .fetch_add(unmapped.len() as u64 * engine.volblocksize() as u64, Ordering::AcqRel);
            cache.lock().reserved.extend(unmapped);
        }
        Ok(())
    }

    /// Pool space promised to cached writes whose blocks are not placed yet.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes.load(Ordering::Acquire)
    }

    /// Counts the mapped blocks of volume `id` (stored pages, with cached
    /// pages taking precedence).
    fn count_mapped_blocks(&self, id: u32) -> Result<u64, PoolError> {
        let count_page = |entries: &[AtomicU64]| {
            entries
                .iter()
                .filter(|e| e.load(Ordering::Acquire) & map_entry::VALID != 0)
                .count() as u64
        };
        let cached: HashSet<(u32, u64)> = self.map_pages.keys().into_iter().filter(|k| k.0 == id).collect();
        let mut total = 0;
        for key in &cached {
            total += count_page(&self.map_pages.get(&self.db, *key).map_err(PoolError::Meta)?.entries);
        }
        let txn = self.db.begin_read().map_err(|e| PoolError::Meta(e.to_string()))?;
        let table = txn.open_table(MAP_PAGES).map_err(|e| PoolError::Meta(e.to_string()))?;
        for row in table
            .range((id, 0)..=(id, u64::MAX))
            .map_err(|e| PoolError::Meta(e.to_string()))?
        {
            let (key, value) = row.map_err(|e| PoolError::Meta(e.to_string()))?;
            if cached.contains(&key.value()) {
                continue;
            }
            total += count_page(&MapPage::decode(Some(value.value())).entries);
        }
        Ok(total)
    }

    /// Destroys volume `id`: frees every block once the record saying so is
    /// durable; the next checkpoint deletes its pages.
    pub async fn destroy_volume(&self, id: u32) -> Result<(), PoolError> {
        self.cache.engines.lock_or_abort().remove(&id);
        let (_, reserved_bytes) = self.cache.forget_volume(id);
        self.read_cache.invalidate_volume(id);
        self.unreserve(reserved_bytes);
        self.log.append(Record::Destroy { volume: id });
        self.commit().await?;
        let _gate = self.gate.write().await;
        self.free_volume_blocks(id, Replaying::No)?;
        Ok(())
    }

    /// Frees every block a volume maps. Replaying the log, a block may
    /// already be free (the checkpoint came after the record); otherwise a
    /// block that is not in use is a double mapping, and stops the engine.
    fn free_volume_blocks(&self, id: u32, replaying: Replaying) -> Result<(), PoolError> {
        let mut keys: HashSet<(u32, u64)> = HashSet::new();
        {
            let txn = self.db.begin_read().map_err(|e| PoolError::Meta(e.to_string()))?;
            let table = txn.open_table(MAP_PAGES).map_err(|e| PoolError::Meta(e.to_string()))?;
            for row in table
                .range((id, 0)..=(id, u64::MAX))
                .map_err(|e| PoolError::Meta(e.to_string()))?
            {
                let (key, _) = row.map_err(|e| PoolError::Meta(e.to_string()))?;
                keys.insert(key.value());
            }
        }
        for (owner, page) in self.map_pages.keys() {
            if owner == id {
                keys.insert((owner, page));
            }
        }
        let mut allocator = self.allocator.lock_or_abort();
        for key in keys {
            let page = self.map_pages.get(&self.db, key).map_err(PoolError::Meta)?;
            for entry in page.entries.iter() {
                if let Some((device, offset)) = map_entry::decode(entry.load(Ordering::Acquire)) {
                    let freed = allocator.free(device, offset);
                    assert!(
                        freed || replaying == Replaying::Yes,
                        "volume {id} maps slot {device}/{offset}, which is not in use"
                    );
                }
            }
        }
        drop(allocator);
        self.map_pages.forget_owner(id);
        self.destroyed.lock_or_abort().insert(id);
        Ok(())
    }

    /// Re-verifies suspect chunks: recomputes the checksums of their used
    /// slots from the data and clears them. Returns how many were scrubbed.
    pub async fn scrub_suspect(&self) -> Result<usize, PoolError> {
        let chunks = self.suspect_snapshot();
        let mut done = 0;
        for (device, chunk) in chunks {
            let _gate = self.gate.write().await;
            let layout = self.allocator.lock_or_abort().slot_shift_of(device, chunk);
            if let Some((slot_shift, used)) = layout {
                let pool_device = &self.devices[device as usize];
                let chunk_offset = chunk * self.chunk_bytes as u64;
                let (buf, result) = pool_device
                    .device
                    .read(chunk_offset, IoBuf::new(self.chunk_bytes as usize))
                    .await;
                if let Err(e) = result {
                    pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e.into());
                }
                let slots = (self.chunk_bytes as u64 >> slot_shift).min(alloc::MAX_SLOTS_PER_CHUNK);
                for slot in 0..slots {
                    if used[(slot / 64) as usize] & (1 << (slot % 64)) == 0 {
                        continue;
                    }
                    let start = (slot << slot_shift) as usize;
                    for sector in 0..(1usize << slot_shift) / SECTOR_BYTES as usize {
                        let at = start + sector * SECTOR_BYTES as usize;
                        let crc = crate::checksum::crc32c(&buf.payload()[at..at + SECTOR_BYTES as usize]);
                        self.set_crc(device, chunk_offset + at as u64, crc)
                            .map_err(PoolError::Meta)?;
                    }
                }
            }
            self.suspect.lock_or_abort().remove(&(device, chunk));
            done += 1;
        }
        Ok(done)
    }

    fn suspect_snapshot(&self) -> Vec<(u8, u64)> {
        self.suspect.lock_or_abort().iter().copied().collect()
    }

    pub fn suspect_chunks(&self) -> usize {
        self.suspect.lock_or_abort().len()
    }

    /// The device holding the metadata store.
    pub fn meta_device(&self) -> u8 {
        self.meta_device
    }
}

fn write_pages<P: Page>(
    txn: &redb::WriteTransaction,
    definition: TableDefinition<(u32, u64), &[u8]>,
    pages: &[TakenPage<P>],
) -> Result<(), String> {
    let mut table = txn.open_table(definition).map_err(|e| e.to_string())?;
    for (key, bytes, _) in pages {
        table.insert(*key, bytes.as_slice()).map_err(|e| e.to_string())?;
    }
    Ok(())
}
