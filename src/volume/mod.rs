//! Volumes: the block-device contract every frontend speaks to.
//!
//! [`BlockDevice`] is the boundary between the block frontends (NBD and
//! iSCSI) and storage; NFS serves file datasets through [`crate::fs`]
//! instead. The block frontends only ever see a [`Volume`], which
//! checks every request against the volume's size and alignment, applies the
//! volume's durability properties (`sync`, `wce`) and forwards to its backing.
//! The backing is the storage engine's thin volume
//! ([`crate::pool::volume::EngineVolume`]); frontends never see it.

pub mod props;
pub mod schedule;
pub mod stats;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use props::{SyncMode, VolumeProps};
use stats::VolumeStats;

/// A boxed future, so that [`BlockDevice`] stays object safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Sector size every request offset and length must be a multiple of.
pub const SECTOR_BYTES: u32 = 512;
/// Largest single read or write the volume accepts (also advertised to clients).
pub const MAX_REQUEST_BYTES: u32 = 32 << 20;

/// What a device can do. Declared once; NBD transmission flags and SCSI VPD
/// and mode pages are all derived from this one description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// WRITE_ZEROES can report "not fast" instead of writing zeros slowly.
    pub can_fast_zero: bool,
    pub can_cache: bool,
    pub can_block_status: bool,
    pub read_only: bool,
    pub rotational: bool,
    /// An acknowledged write may sit in volatile memory until a flush.
    pub volatile_write_cache: bool,
    /// A flush through any handle makes durable every write completed through
    /// every handle of the same volume (NBD's CAN_MULTI_CONN).
    pub flush_covers_all_handles: bool,
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_request_bytes: u32,
}

#[cfg(test)]
impl Capabilities {
    /// A thin, writable, non-rotational device with a volatile write cache
    /// and 4 KiB preferred blocks (unit tests of what is derived from it).
    pub(crate) fn thin_for_tests() -> Self {
        Capabilities {
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_zero: true,
            can_fast_zero: true,
            can_cache: true,
            can_block_status: true,
            read_only: false,
            rotational: false,
            volatile_write_cache: true,
            flush_covers_all_handles: true,
            min_block_bytes: 512,
            preferred_block_bytes: 4096,
            max_request_bytes: 32 << 20,
        }
    }
}

/// One run of a [`BlockDevice::block_status`] answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// No storage is allocated for this range.
    pub hole: bool,
    /// The range reads as zeros.
    pub zero: bool,
}

/// One run of a [`BlockDevice::changed_since`] answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangedRun {
    pub length: u64,
    /// The range may differ from the older snapshot (its blocks are mapped
    /// differently); false: it is the same data.
    pub changed: bool,
}

/// How WRITE_ZEROES may be carried out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The range may be deallocated (punched) instead of written.
    pub may_trim: bool,
    /// Fail with [`BlockError::NotFast`] rather than write zeros slowly.
    pub fast_only: bool,
    pub fua: bool,
}

/// Errors a block request can end with. Each frontend maps these to its wire
/// codes in exactly one place (NBD: `frontend::nbd::proto::errno_for`).
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("request [{offset}, +{length}) is beyond the end of the volume ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("request offset {offset} or length {length} is not a multiple of {alignment} bytes")]
    Misaligned { offset: u64, length: u64, alignment: u32 },
    #[error("request of {length} bytes exceeds the maximum of {max} bytes")]
    TooLarge { length: u64, max: u32 },
    #[error("no space left (in the pool, or on the file system under its devices)")]
    NoSpace,
    #[error("zeroing cannot be done quickly")]
    NotFast,
    #[error("operation not supported: {0}")]
    NotSupported(&'static str),
    #[error("volume is read-only")]
    ReadOnly,
    #[error("checksum mismatch reading offset {offset}")]
    Checksum { offset: u64 },
    #[error("volume has been deleted")]
    Gone,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub type BlockResult<T> = Result<T, BlockError>;

pub use crate::device::IoBuf;

/// The block-device contract. Every method may complete asynchronously; a
/// frontend may have many calls in flight on one device and they complete in
/// any order. Callers (the [`Volume`]) have already checked ranges and
/// alignment; the engine asserts them again (a bug above must not reach the
/// blocks of another volume).
///
/// Durability: a `write` with `fua` is durable when its future completes; a
/// `flush` makes durable every write that completed before the flush began.
pub trait BlockDevice: Send + Sync {
    fn capabilities(&self) -> Capabilities;
    fn size_bytes(&self) -> u64;
    /// Fills `buf.payload()` with the bytes at `offset`. Never-written ranges read as zeros.
    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, BlockResult<()>)>;
    fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BoxFuture<'_, BlockResult<()>>;
    fn flush(&self) -> BoxFuture<'_, BlockResult<()>>;
    /// Deallocates the range; it reads back as zeros afterwards.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> BoxFuture<'_, BlockResult<()>>;
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>>;
    /// Prefetches the range into cache; a hint with no visible effect.
    fn cache(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<()>>;
    /// Describes allocation from `offset`; the extents cover at least one byte
    /// and at most `length` bytes.
    fn block_status(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<Vec<Extent>>>;
    /// Changes the size. Growing exposes zeros.
    fn resize(&self, new_size_bytes: u64) -> BlockResult<()>;

    /// For a snapshot: which parts of `offset..offset + length` changed
    /// since `older`, an older snapshot of the same volume (by engine id).
    /// The runs cover at least one byte and at most `length` bytes. Others
    /// do not track changes.
    fn changed_since(&self, _older: u32, _offset: u64, _length: u64) -> BoxFuture<'_, BlockResult<Vec<ChangedRun>>> {
        Box::pin(std::future::ready(Err(BlockError::NotSupported(
            "changed-block tracking (snapshots only)",
        ))))
    }

    /// `logbias=throughput` (true) or `latency`: where synchronous writes go
    /// first. Backings without an intent log ignore it.
    fn set_log_throughput(&self, _throughput: bool) {}

    /// Whether the space the backing draws on is running low (for the
    /// engine: the file system under the pool's sparse device files, as
    /// `pool status` warns). Called per SCSI command: must be as cheap as
    /// an atomic load, never compute anything.
    fn backing_space_low(&self) -> bool {
        false
    }
}

/// `pool/name`, the name a volume is exported under.
pub fn full_name(pool: &str, name: &str) -> String {
    format!("{pool}/{name}")
}

/// An open volume as the frontends see it: validation and durability
/// properties in front of a backing [`BlockDevice`].
pub struct Volume {
    pool: String,
    name: String,
    full_name: String,
    backing: Arc<dyn BlockDevice>,
    size_bytes: AtomicU64,
    volblocksize: u32,
    sync_mode: AtomicU8,
    wce: AtomicU8,
    open_handles: AtomicUsize,
    /// Of `open_handles`, the iSCSI sessions.
    iscsi_handles: AtomicUsize,
    deleted: std::sync::atomic::AtomicBool,
    /// How many rollbacks refuse new clients now (`rollback --force` also
    /// drops the open ones: `evictions` tells them to end). A count, so
    /// one that ends does not readmit clients another still refuses.
    evicting: AtomicUsize,
    evictions: tokio::sync::watch::Sender<bool>,
    stats: VolumeStats,
}

/// Which frontend holds a [`HandleGuard`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    Nbd,
    Iscsi,
}

impl Volume {
    pub fn new(pool: &str, name: &str, backing: Arc<dyn BlockDevice>, props: &VolumeProps) -> Self {
        backing.set_log_throughput(props.logbias == props::LogBias::Throughput);
        Volume {
            pool: pool.to_string(),
            name: name.to_string(),
            full_name: full_name(pool, name),
            size_bytes: AtomicU64::new(backing.size_bytes()),
            backing,
            volblocksize: props.volblocksize,
            sync_mode: AtomicU8::new(props.sync as u8),
            wce: AtomicU8::new(props.wce as u8),
            open_handles: AtomicUsize::new(0),
            iscsi_handles: AtomicUsize::new(0),
            deleted: std::sync::atomic::AtomicBool::new(false),
            evicting: AtomicUsize::new(0),
            evictions: tokio::sync::watch::Sender::new(false),
            stats: VolumeStats::default(),
        }
    }

    pub fn pool(&self) -> &str {
        &self.pool
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `pool/name`.
    pub fn full_name(&self) -> &str {
        &self.full_name
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    pub fn volblocksize(&self) -> u32 {
        self.volblocksize
    }

    pub fn stats(&self) -> &VolumeStats {
        &self.stats
    }

    pub fn sync_mode(&self) -> SyncMode {
        SyncMode::from_u8(self.sync_mode.load(Ordering::Acquire))
    }

    pub fn wce(&self) -> bool {
        self.wce.load(Ordering::Acquire) != 0
    }

    /// Applies changed `sync`/`wce` properties to the open volume.
    pub fn apply_props(&self, props: &VolumeProps) {
        self.sync_mode.store(props.sync as u8, Ordering::Release);
        self.wce.store(props.wce as u8, Ordering::Release);
        self.backing
            .set_log_throughput(props.logbias == props::LogBias::Throughput);
    }

    /// Whether the space under the volume's pool is running low (see
    /// [`BlockDevice::backing_space_low`]); cheap enough for every command.
    pub fn backing_space_low(&self) -> bool {
        self.backing.backing_space_low()
    }

    /// Number of frontend handles (NBD connections, iSCSI sessions) open
    /// on this volume.
    pub fn open_handles(&self) -> usize {
        self.open_handles.load(Ordering::Acquire)
    }

    /// The open handles by frontend: (NBD connections, iSCSI sessions).
    pub fn clients(&self) -> (usize, usize) {
        let iscsi = self.iscsi_handles.load(Ordering::SeqCst);
        (self.open_handles.load(Ordering::SeqCst).saturating_sub(iscsi), iscsi)
    }

    /// Registers a frontend handle; dropping the guard releases it.
    pub fn open_handle(self: &Arc<Self>) -> HandleGuard {
        self.open_handles.fetch_add(1, Ordering::SeqCst);
        HandleGuard(self.clone(), Client::Nbd)
    }

    /// Registers a handle of `client` unless the volume is dropping its
    /// clients (see [`Volume::begin_eviction`]). Counted before the check,
    /// so an eviction either sees the handle or the handle sees the
    /// eviction.
    pub fn try_open_handle(self: &Arc<Self>, client: Client) -> Option<HandleGuard> {
        self.open_handles.fetch_add(1, Ordering::SeqCst);
        if client == Client::Iscsi {
            self.iscsi_handles.fetch_add(1, Ordering::SeqCst);
        }
        let guard = HandleGuard(self.clone(), client);
        if self.evicting.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(guard)
    }

    /// Tells the frontends to end every connection to this volume (after
    /// the replies to the requests in flight) and refuses new ones, until
    /// [`Volume::end_eviction`]. Frontends wait on [`Volume::evictions`]
    /// once per connection, never per request.
    pub(crate) fn begin_eviction(&self) {
        self.refuse_clients();
        self.evictions.send_replace(true);
    }

    /// Refuses new clients and leaves those connected alone, until
    /// [`Volume::end_eviction`].
    pub(crate) fn refuse_clients(&self) {
        self.evicting.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends one [`Volume::refuse_clients`] or [`Volume::begin_eviction`].
    pub(crate) fn end_eviction(&self) {
        if self.evicting.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.evictions.send_replace(false);
        }
    }

    /// Whether new clients are refused (an eviction is under way).
    pub fn is_evicting(&self) -> bool {
        self.evicting.load(Ordering::SeqCst) > 0
    }

    /// Resolves when the volume's clients are told to go (see
    /// [`Volume::begin_eviction`]); never otherwise.
    pub fn evicted(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut evictions = self.evictions.subscribe();
        async move {
            if evictions.wait_for(|evicting| *evicting).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    pub(crate) fn mark_deleted(&self) {
        self.deleted.store(true, Ordering::Release);
    }

    /// Whether the volume (or snapshot) was deleted: every request on it
    /// fails with [`BlockError::Gone`].
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    /// The capabilities the frontends advertise: the backing's, adjusted for
    /// the volume's properties. `sync=always` or `wce=off` make every write
    /// durable before it is acknowledged, so there is no volatile cache.
    pub fn capabilities(&self) -> Capabilities {
        let mut caps = self.backing.capabilities();
        // sync=disabled ignores flushes: it is always a volatile cache.
        let write_through = match self.sync_mode() {
            SyncMode::Disabled => false,
            SyncMode::Always => true,
            SyncMode::Standard => !self.wce(),
        };
        caps.volatile_write_cache = caps.volatile_write_cache && !write_through;
        caps.min_block_bytes = caps.min_block_bytes.max(SECTOR_BYTES);
        caps.max_request_bytes = caps.max_request_bytes.min(MAX_REQUEST_BYTES);
        caps
    }

    /// Checks a request's range: in bounds, sector aligned, and (for requests
    /// that carry data) no larger than the request maximum.
    pub fn check_range(&self, offset: u64, length: u64, carries_data: bool) -> BlockResult<()> {
        if self.deleted.load(Ordering::Acquire) {
            return Err(BlockError::Gone);
        }
        let size = self.size_bytes();
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(BlockError::OutOfRange { offset, length, size });
        }
        let alignment = SECTOR_BYTES;
        if !offset.is_multiple_of(alignment as u64) || !length.is_multiple_of(alignment as u64) {
            return Err(BlockError::Misaligned {
                offset,
                length,
                alignment,
            });
        }
        if carries_data && length > MAX_REQUEST_BYTES as u64 {
            return Err(BlockError::TooLarge {
                length,
                max: MAX_REQUEST_BYTES,
            });
        }
        Ok(())
    }

    /// Whether a write must be durable before it is acknowledged.
    fn write_must_be_durable(&self, fua: bool) -> bool {
        match self.sync_mode() {
            SyncMode::Always => true,
            SyncMode::Disabled => false,
            SyncMode::Standard => fua || !self.wce(),
        }
    }

    pub async fn read(&self, offset: u64, buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        if let Err(e) = self.check_range(offset, buf.len() as u64, true) {
            return (buf, Err(e));
        }
        if buf.is_empty() {
            return (buf, Ok(()));
        }
        self.backing.read(offset, buf).await
    }

    pub async fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BlockResult<()> {
        self.check_range(offset, data.len() as u64, true)?;
        if data.is_empty() {
            return Ok(());
        }
        let durable = self.write_must_be_durable(fua);
        self.backing.write(offset, data, durable).await
    }

    pub async fn flush(&self) -> BlockResult<()> {
        if self.deleted.load(Ordering::Acquire) {
            return Err(BlockError::Gone);
        }
        if self.sync_mode() == SyncMode::Disabled {
            return Ok(());
        }
        self.backing.flush().await
    }

    pub async fn trim(&self, offset: u64, length: u64, fua: bool) -> BlockResult<()> {
        self.check_range(offset, length, false)?;
        if length == 0 {
            return Ok(());
        }
        let durable = self.write_must_be_durable(fua);
        self.backing.trim(offset, length, durable).await
    }

    pub async fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BlockResult<()> {
        self.check_range(offset, length, false)?;
        if length == 0 {
            return Ok(());
        }
        let flags = ZeroFlags {
            fua: self.write_must_be_durable(flags.fua),
            ..flags
        };
        self.backing.write_zeroes(offset, length, flags).await
    }

    pub async fn cache(&self, offset: u64, length: u64) -> BlockResult<()> {
        self.check_range(offset, length, false)?;
        if length == 0 {
            return Ok(());
        }
        self.backing.cache(offset, length).await
    }

    pub async fn block_status(&self, offset: u64, length: u64) -> BlockResult<Vec<Extent>> {
        self.check_range(offset, length, false)?;
        if length == 0 {
            return Ok(Vec::new());
        }
        self.backing.block_status(offset, length).await
    }

    /// Which parts of a range changed since snapshot `older` (see
    /// [`BlockDevice::changed_since`]).
    pub async fn changed_since(&self, older: u32, offset: u64, length: u64) -> BlockResult<Vec<ChangedRun>> {
        self.check_range(offset, length, false)?;
        if length == 0 {
            return Ok(Vec::new());
        }
        self.backing.changed_since(older, offset, length).await
    }

    /// Grows the volume. Shrinking is refused by the manager before this.
    pub fn resize(&self, new_size_bytes: u64) -> BlockResult<()> {
        self.backing.resize(new_size_bytes)?;
        self.size_bytes.store(new_size_bytes, Ordering::Release);
        Ok(())
    }
}

/// Keeps [`Volume::open_handles`] counted while a frontend uses the volume.
pub struct HandleGuard(Arc<Volume>, Client);

impl HandleGuard {
    pub fn volume(&self) -> &Arc<Volume> {
        &self.0
    }
}

impl Drop for HandleGuard {
    fn drop(&mut self) {
        if self.1 == Client::Iscsi {
            self.0.iscsi_handles.fetch_sub(1, Ordering::SeqCst);
        }
        self.0.open_handles.fetch_sub(1, Ordering::SeqCst);
    }
}
