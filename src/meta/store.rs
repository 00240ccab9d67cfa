//! The metadata store: a redb database living in a region of a pool device.
//!
//! redb gives us crash-safe, checksummed, copy-on-write B-trees with a
//! bounded page cache. We only write to it at checkpoints (in large batches);
//! between checkpoints, changes live in the page caches and the log. The
//! database is not a file: [`RegionBackend`] maps redb's storage calls onto a
//! byte range of a [`Device`], so a pool's metadata travels with its devices.
//! Region layout (docs/FORMAT.md): a 4 KiB header holding redb's current
//! length, then redb's bytes.

use super::MetaError;
use crate::sync::LockOrAbort;
use std::future::Future;
use std::io;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use redb::{StorageBackend, TableDefinition};

use crate::device::{Device, IoBuf};

/// Map pages: (volume id, page index) → 256 little-endian u64 entries.
pub const MAP_PAGES: TableDefinition<(u32, u64), &[u8]> = TableDefinition::new("map_pages");
/// Checksum pages: (device index, page index) → 1024 little-endian u32 crc32c.
pub const CRC_PAGES: TableDefinition<(u32, u64), &[u8]> = TableDefinition::new("crc_pages");
/// Chunk allocation: (device index, chunk) → slot shift + used-slot bitmap.
pub const CHUNKS: TableDefinition<(u32, u64), &[u8]> = TableDefinition::new("chunks");
/// Chunks whose checksums are not trusted after a crash, every part of
/// them: (device, chunk) → 0. Written by older versions; read, then emptied.
pub const SUSPECT: TableDefinition<(u32, u64), u8> = TableDefinition::new("suspect");
/// Parts of chunks whose checksums are not trusted after a crash:
/// (device, chunk) → bitmap of the chunk's 256 parts (four `u64`, little
/// endian, part 0 the lowest bit of the first).
pub const SUSPECT_PARTS: TableDefinition<(u32, u64), &[u8]> = TableDefinition::new("suspect_parts");
/// Volumes being destroyed: volume id → 0.
pub const DESTROYED: TableDefinition<u32, u8> = TableDefinition::new("destroyed");
/// Scalars: "checkpoint_lsn", "epoch".
pub const STATE: TableDefinition<&str, u64> = TableDefinition::new("state");
/// Snapshots: id → volume, generation, creation time, mapped blocks, size
/// and name (`pool/snapshots/persist.rs`).
pub const SNAPSHOTS: TableDefinition<u32, &[u8]> = TableDefinition::new("snapshots");
/// Clones: volume id → the snapshot it was cloned from (its origin).
pub const CLONES: TableDefinition<u32, u32> = TableDefinition::new("clones");
/// Snapshot space figures kept between starts: id → (written, used; used
/// `u64::MAX` when not kept), in blocks (`pool/snapshots/space.rs`).
/// Per data chunk (device, chunk): its decayed read and write counts
/// (`pool/migrate.rs`), stored now and then so a restart keeps them.
pub const HEAT: TableDefinition<(u32, u64), u64> = TableDefinition::new("heat");
pub const SNAPSHOT_SPACE: TableDefinition<u32, (u64, u64)> = TableDefinition::new("snapshot_space");

const HEADER_BYTES: u64 = 4096;
const HEADER_MAGIC: [u8; 8] = *b"STRATAMR";

/// Runs a future to completion on the current thread, parking between polls.
/// Used where a synchronous interface (redb's storage backend) sits on top
/// of asynchronous devices. Never call it on a current-thread runtime whose
/// progress the future needs; the simulated device completes at once and the
/// real engines complete on their own threads.
pub fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut context = Context::from_waker(&waker);
    // Opt out of tokio's cooperative budget: when this thread is inside a
    // runtime (a worker, or `Runtime::block_on`), an exhausted budget makes
    // every tokio future answer Pending-and-wake forever, because we never
    // yield back to the scheduler that would refill it.
    let mut future = pin!(tokio::task::unconstrained(future));
    loop {
        match future.as_mut().poll(&mut context) {
            Poll::Ready(output) => return output,
            Poll::Pending => std::thread::park(),
        }
    }
}

/// Runs blocking metadata work (redb calls block on device I/O) without
/// stalling the async workers: on a multi-thread runtime the worker hands its
/// other tasks to a fresh thread for the duration; elsewhere it simply runs.
pub fn blocking_section<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

fn to_io(error: crate::device::DeviceError) -> io::Error {
    io::Error::other(error.to_string())
}

/// redb storage on a byte range of a device.
pub struct RegionBackend {
    device: Arc<dyn Device>,
    offset: u64,
    capacity: u64,
    block: u64,
    /// redb's current length; serialises writes too (read-modify-write of
    /// partial blocks must not interleave).
    state: Mutex<u64>,
    /// Bytes written to the device (metadata cost accounting).
    written: Arc<AtomicU64>,
    /// How far (region-relative, after the header) the file system under
    /// a sparse device file is known to back the region.
    backed: AtomicU64,
}

/// How much of the region beyond redb's length is kept allocated on the
/// file system under a sparse device file: the store can grow by this much
/// while that file system is full (checkpoints keep working), and the
/// allocation is topped up as it grows.
pub const HEADROOM_BYTES: u64 = 64 << 20;

impl std::fmt::Debug for RegionBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RegionBackend({} @ {} +{})",
            self.device.info().name,
            self.offset,
            self.capacity
        )
    }
}

impl RegionBackend {
    /// Opens the region; a region never written reads as length 0.
    pub fn open(device: Arc<dyn Device>, offset: u64, capacity: u64, written: Arc<AtomicU64>) -> io::Result<Self> {
        let block = device.info().block_bytes.max(512) as u64;
        assert!(
            offset.is_multiple_of(block) && capacity > HEADER_BYTES,
            "misaligned metadata region"
        );
        let (buf, result) = block_on(device.read(offset, IoBuf::new(HEADER_BYTES as usize)));
        result.map_err(to_io)?;
        let header = buf.payload();
        let len = if header[0..8] == HEADER_MAGIC {
            let damaged = || io::Error::new(io::ErrorKind::InvalidData, "metadata region header is damaged");
            let stored = crate::bytes::u64_at(header, 8).ok_or_else(damaged)?;
            let crc = crate::bytes::u32_at(header, 16).ok_or_else(damaged)?;
            if crate::checksum::crc32c(&header[0..16]) != crc {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "metadata region header is damaged",
                ));
            }
            stored
        } else if header.iter().all(|&b| b == 0) {
            0
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "metadata region has no valid header",
            ));
        };
        let region = RegionBackend {
            device,
            offset,
            capacity: capacity - HEADER_BYTES,
            block,
            state: Mutex::new(len),
            written,
            backed: AtomicU64::new(0),
        };
        region.keep_headroom(len);
        Ok(region)
    }

    /// Makes the file system back the region up to `len` plus
    /// [`HEADROOM_BYTES`]. A file system too full for that is logged, not
    /// fatal: the headroom already backed is what the store may still use.
    fn keep_headroom(&self, len: u64) {
        let target = (len + HEADROOM_BYTES).min(self.capacity);
        let backed = self.backed.load(Ordering::Acquire);
        if target <= backed {
            return;
        }
        // From the region's start (the header too): ranges already backed
        // cost the file system nothing.
        match self.device.preallocate(self.offset, HEADER_BYTES + target) {
            Ok(()) => self.backed.store(target, Ordering::Release),
            Err(e) => tracing::warn!(
                "metadata region: cannot reserve {} bytes beyond the store's {} on {}: {e}; \
                 checkpoints will fail once the store grows past what is backed",
                target - len,
                len,
                self.device.info().name
            ),
        }
    }

    fn write_header(&self, len: u64) -> io::Result<()> {
        let mut buf = IoBuf::new(HEADER_BYTES as usize);
        let header = buf.payload_mut();
        header[0..8].copy_from_slice(&HEADER_MAGIC);
        header[8..16].copy_from_slice(&len.to_le_bytes());
        let crc = crate::checksum::crc32c(&header[0..16]);
        header[16..20].copy_from_slice(&crc.to_le_bytes());
        self.written.fetch_add(HEADER_BYTES, Ordering::Relaxed);
        let (_, result) = block_on(self.device.write(self.offset, buf));
        result.map_err(to_io)?;
        block_on(self.device.flush()).map_err(to_io)
    }

    /// Reads the aligned cover of [start, start + len) (region-relative, after the header).
    fn read_cover(&self, start: u64, len: usize) -> io::Result<(IoBuf, usize)> {
        let absolute = self.offset + HEADER_BYTES + start;
        let aligned_start = absolute / self.block * self.block;
        let aligned_end = (absolute + len as u64).div_ceil(self.block) * self.block;
        let (buf, result) = block_on(
            self.device
                .read(aligned_start, IoBuf::new((aligned_end - aligned_start) as usize)),
        );
        result.map_err(to_io)?;
        Ok((buf, (absolute - aligned_start) as usize))
    }

    fn write_range(&self, start: u64, data: &[u8]) -> io::Result<()> {
        self.written.fetch_add(data.len() as u64, Ordering::Relaxed);
        let absolute = self.offset + HEADER_BYTES + start;
        if absolute.is_multiple_of(self.block) && (data.len() as u64).is_multiple_of(self.block) {
            let (_, result) = block_on(self.device.write(absolute, IoBuf::copy_from(data)));
            return result.map_err(to_io);
        }
        let (mut buf, skip) = self.read_cover(start, data.len())?;
        buf.payload_mut()[skip..skip + data.len()].copy_from_slice(data);
        let aligned_start = absolute - skip as u64;
        let (_, result) = block_on(self.device.write(aligned_start, buf));
        result.map_err(to_io)
    }
}

impl StorageBackend for RegionBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(*self.state.lock_or_abort())
    }

    fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let current = self.len()?;
        if offset + len as u64 > current {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the metadata region",
            ));
        }
        let (buf, skip) = self.read_cover(offset, len)?;
        Ok(buf.payload()[skip..skip + len].to_vec())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut current = self.state.lock_or_abort();
        if len > self.capacity {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!("metadata region is full ({} bytes)", self.capacity),
            ));
        }
        if len > *current {
            // redb expects new space to read as zeros; the region may hold
            // anything from earlier use.
            let zeros = vec![0u8; 1 << 20];
            let mut at = *current;
            while at < len {
                let step = (len - at).min(zeros.len() as u64) as usize;
                self.write_range(at, &zeros[..step])?;
                at += step as u64;
            }
            block_on(self.device.flush()).map_err(to_io)?;
            self.keep_headroom(len);
        }
        self.write_header(len)?;
        *current = len;
        Ok(())
    }

    fn sync_data(&self, _eventual: bool) -> io::Result<()> {
        block_on(self.device.flush()).map_err(to_io)
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let _serialise = self.state.lock_or_abort();
        self.write_range(offset, data)
    }
}

/// redb panics (an `unreachable!`) rather than returning an error when a
/// B-tree page it walks has a damaged type or layout (redb 2.6.4: an
/// insert in `btree_mutator.rs`, a range in `btree_iters.rs`): it verifies
/// its page checksums only when repairing. Every call strata makes into
/// redb runs under [`guarded`], which turns such a panic into a
/// [`MetaError::Corrupt`] naming the operation, so a damaged store fails
/// the request (or the open) that met it and never the daemon. This counts
/// the panics caught, process-wide.
static CAUGHT_PANICS: AtomicU64 = AtomicU64::new(0);

/// Panics inside redb caught by [`guarded`] since the process started.
pub fn caught_panics() -> u64 {
    CAUGHT_PANICS.load(Ordering::Relaxed)
}

/// Runs `work` (calls into redb); a panic inside it is the outer error,
/// one line naming `what`.
fn catch<T, E>(what: impl std::fmt::Display, work: impl FnOnce() -> Result<T, E>) -> Result<Result<T, E>, MetaError> {
    catch_unwind(AssertUnwindSafe(work)).map_err(|payload| {
        CAUGHT_PANICS.fetch_add(1, Ordering::Relaxed);
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".to_string());
        MetaError::Corrupt(format!(
            "{what}: the store's B-tree is damaged (redb panicked: {})",
            message.replace('\n', " ")
        ))
    })
}

/// Runs `work`, a read of the store (or an open), turning a panic inside
/// redb into [`MetaError::Corrupt`] naming `what` (see [`CAUGHT_PANICS`]).
/// A read changes nothing, so after a caught panic the store stays usable
/// for every other read.
pub fn guarded<T, E: From<MetaError>>(
    what: impl std::fmt::Display,
    work: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    catch(what, work).map_err(E::from).and_then(|result| result)
}

/// A pool's metadata store: redb's database, and whether a write
/// transaction panicked inside redb. After such a panic redb's in-memory
/// state (its allocator, the transaction it was committing) cannot be
/// trusted, so the store is failed for good: every later write
/// ([`Store::write`]) fails at once, reads go on serving what they can,
/// and the database is not written again, not even by redb's own drop.
pub struct Store {
    db: ManuallyDrop<redb::Database>,
    failed: AtomicBool,
}

impl Store {
    pub fn new(db: redb::Database) -> Self {
        Store {
            db: ManuallyDrop::new(db),
            failed: AtomicBool::new(false),
        }
    }

    /// Whether a write transaction panicked inside redb (the store takes
    /// no more writes).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Runs `work`, a write transaction named `what`, unless the store has
    /// failed; a panic inside redb fails the store (logged once) and is
    /// returned as [`MetaError::Corrupt`].
    pub fn write<T>(
        &self,
        what: &str,
        work: impl FnOnce(&redb::Database) -> Result<T, MetaError>,
    ) -> Result<T, MetaError> {
        if self.failed() {
            return Err(MetaError::Corrupt(format!(
                "{what}: the metadata store failed earlier (redb panicked on a damaged B-tree); \
                 it takes no more writes"
            )));
        }
        catch(what, || work(&self.db)).unwrap_or_else(|panic| {
            if !self.failed.swap(true, Ordering::AcqRel) {
                tracing::error!("{panic}; the metadata store takes no more writes (checkpoints stop)");
            }
            Err(panic)
        })
    }
}

impl std::ops::Deref for Store {
    type Target = redb::Database;

    fn deref(&self) -> &redb::Database {
        &self.db
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if self.failed() {
            // redb's drop commits its allocator state: not on a store it
            // panicked writing. The database's memory (its cache) is left
            // behind, once per failed store.
            return;
        }
        // SAFETY: `drop` runs once and nothing uses `self.db` after it.
        let db = unsafe { ManuallyDrop::take(&mut self.db) };
        // redb's drop walks the allocator's tree to save its state; a
        // damaged one panics there like anywhere else.
        if let Err(e) = catch("closing the store", || {
            drop(db);
            Ok::<(), MetaError>(())
        }) {
            tracing::error!("{e}");
        }
    }
}

/// Opens (or initialises) the metadata database on a device region.
pub fn open_database(
    device: Arc<dyn Device>,
    offset: u64,
    capacity: u64,
    cache_bytes: usize,
    written: Arc<AtomicU64>,
) -> Result<Store, MetaError> {
    let backend = RegionBackend::open(device, offset, capacity, written)
        .map_err(|e| MetaError::Failed(format!("metadata region: {e}")))?;
    let db = guarded("opening the store", || {
        redb::Builder::new()
            .set_cache_size(cache_bytes)
            .create_with_backend(backend)
            .map_err(MetaError::from)
    })?;
    let store = Store::new(db);
    // Make sure every table exists so readers never see "table missing".
    store.write("creating the tables", |db| {
        let txn = db.begin_write()?;
        {
            let open = |result: Result<(), redb::TableError>| result.map_err(MetaError::from);
            open(txn.open_table(MAP_PAGES).map(|_| ()))?;
            open(txn.open_table(CRC_PAGES).map(|_| ()))?;
            open(txn.open_table(CHUNKS).map(|_| ()))?;
            open(txn.open_table(SUSPECT).map(|_| ()))?;
            open(txn.open_table(SUSPECT_PARTS).map(|_| ()))?;
            open(txn.open_table(DESTROYED).map(|_| ()))?;
            open(txn.open_table(SNAPSHOTS).map(|_| ()))?;
            open(txn.open_table(CLONES).map(|_| ()))?;
            open(txn.open_table(SNAPSHOT_SPACE).map(|_| ()))?;
            open(txn.open_table(STATE).map(|_| ()))?;
        }
        txn.commit()?;
        Ok(())
    })?;
    Ok(store)
}

/// Reads one scalar from the STATE table (0 when absent).
pub fn read_state(db: &redb::Database, key: &str) -> Result<u64, MetaError> {
    guarded(format_args!("table state key {key:?}"), || {
        let txn = db.begin_read().map_err(MetaError::from)?;
        let table = txn.open_table(STATE).map_err(MetaError::from)?;
        Ok(table.get(key).map_err(MetaError::from)?.map(|v| v.value()).unwrap_or(0))
    })
}

/// Reads one page blob.
pub fn read_page(
    db: &redb::Database,
    table: TableDefinition<(u32, u64), &[u8]>,
    key: (u32, u64),
) -> Result<Option<Vec<u8>>, MetaError> {
    blocking_section(|| {
        guarded(
            format_args!("table {} key {key:?}", redb::TableHandle::name(&table)),
            || read_page_now(db, table, key),
        )
    })
}

fn read_page_now(
    db: &redb::Database,
    table: TableDefinition<(u32, u64), &[u8]>,
    key: (u32, u64),
) -> Result<Option<Vec<u8>>, MetaError> {
    let txn = db.begin_read().map_err(MetaError::from)?;
    let table = txn.open_table(table).map_err(MetaError::from)?;
    let value = table.get(key).map_err(MetaError::from)?;
    Ok(value.map(|v| v.value().to_vec()))
}
