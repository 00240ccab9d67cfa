//! Served volumes: what the block frontends (NBD and iSCSI) talk to.
//!
//! [`BlockDevice`] (in [`crate::block`]) is the boundary between the
//! block frontends and storage; NFS serves file datasets through
//! [`crate::fs`] instead. The block frontends only ever see a
//! [`ServedVolume`], which
//! checks every request against the volume's size and alignment, applies the
//! volume's durability properties (`sync`, `wce`) and forwards to its backing.
//! The backing is the storage engine's thin volume
//! ([`crate::pool::volume::EngineVolume`]); frontends never see it.

pub mod props;
pub mod schedule;
pub mod stats;

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use std::future::Future;

use crate::block::{
    BlockDevice, BlockError, BlockResult, Capabilities, ChangedRun, Extent, IoBuf, ZeroFlags, MAX_REQUEST_BYTES,
    SECTOR_BYTES,
};
use props::{SyncMode, VolumeProps};
use stats::VolumeStats;

/// `pool/name`, the name a volume is exported under.
pub fn full_name(pool: &str, name: &str) -> String {
    format!("{pool}/{name}")
}

/// An open volume as the frontends see it: validation and durability
/// properties in front of a backing [`BlockDevice`].
pub struct ServedVolume {
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

impl ServedVolume {
    pub fn new(pool: &str, name: &str, backing: Arc<dyn BlockDevice>, props: &VolumeProps) -> Self {
        backing.set_log_throughput(props.logbias == props::LogBias::Throughput);
        ServedVolume {
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
    /// clients (see [`ServedVolume::begin_eviction`]). Counted before the check,
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
    /// [`ServedVolume::end_eviction`]. Frontends wait on [`ServedVolume::evictions`]
    /// once per connection, never per request.
    pub(crate) fn begin_eviction(&self) {
        self.refuse_clients();
        self.evictions.send_replace(true);
    }

    /// Refuses new clients and leaves those connected alone, until
    /// [`ServedVolume::end_eviction`].
    pub(crate) fn refuse_clients(&self) {
        self.evicting.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends one [`ServedVolume::refuse_clients`] or [`ServedVolume::begin_eviction`].
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
    /// [`ServedVolume::begin_eviction`]); never otherwise.
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

/// Keeps [`ServedVolume::open_handles`] counted while a frontend uses the volume.
pub struct HandleGuard(Arc<ServedVolume>, Client);

impl HandleGuard {
    pub fn volume(&self) -> &Arc<ServedVolume> {
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
