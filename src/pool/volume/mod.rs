//! A thin volume on the pool: the storage engine's [`BlockDevice`].
//!
//! Logical blocks of `volblocksize` map to slots on the pool's devices. A
//! block is allocated on its first write (the rest of it zero-filled, so
//! every sector of an allocated block has a checksum), overwritten in place
//! afterwards, and unmapped by TRIM. Every 4 KiB sector read from a device is
//! checked against its crc32c.
//!
//! Concurrency: requests on different blocks run in parallel. Striped
//! read/write locks over block numbers keep a read from seeing a block in
//! the middle of being written (data and checksum out of step) and serialise
//! read-modify-write of partial sectors and allocation of the same block.

mod moving;
mod read;
mod write;
pub(crate) use moving::Moved;
mod writeback;

pub(crate) use write::sector_crcs;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::RwLock;

use crate::sync::{Held, Rank, Ranked};

/// Guards of the volume's ranked locks (`crate::sync::rank`).
type RwLockReadGuard<'a, T> = Held<tokio::sync::RwLockReadGuard<'a, T>>;
type RwLockWriteGuard<'a, T> = Held<tokio::sync::RwLockWriteGuard<'a, T>>;

use super::alloc::Hint;
use super::cache::{Entry, VolState, VolumeCache};
use super::superblock::Role;
use super::vdev::Mirror;
use super::{BlockPtr, Pool, PoolError, SECTOR_BYTES};
use crate::block::{BlockDevice, BlockError, BlockResult, BoxFuture, Capabilities, ChangedRun, Extent, ZeroFlags};
use crate::device::{DeviceError, IoBuf};
use crate::meta::log::Record;
use crate::meta::MetaError;

const STRIPES: usize = 1024;
// A stripe's lock ordinal is its volume's id, then its index in 10 bits.
const _: () = assert!(STRIPES <= 1 << 10);
/// Reads up to this size fill the read cache.
const READ_CACHE_MAX_REQUEST: u64 = 128 << 10;
/// Most extents one BLOCK_STATUS answer carries.
const MAX_EXTENTS: usize = 1024;
/// Reads at least this large try the device's copy-and-sum path first
/// ([`EngineVolume::read_summed_now`]); smaller ones gain little from it
/// and would only add page faults on first touch of a mapped page.
const SUMMED_READ_MIN_BYTES: usize = 64 << 10;

pub struct EngineVolume {
    pool: Arc<Pool>,
    id: u32,
    size_bytes: AtomicU64,
    block_shift: u32,
    stripes: Box<[Ranked<RwLock<()>>]>,
    /// Blocks currently mapped (for `used` in `volume list`).
    mapped_blocks: AtomicU64,
    /// This volume's part of the pool's write-back cache.
    cache: Arc<VolumeCache>,
    /// `logbias=throughput`: synchronous writes go to their place, not to
    /// the intent log.
    log_throughput: AtomicBool,
    /// Held shared by every write, trim and zeroing for its whole length,
    /// exclusively while a snapshot of the volume is taken or deleted (so a
    /// write is wholly before or wholly after the snapshot). Destaging does
    /// not take it: taking a snapshot leaves the cache where it is.
    barrier: Ranked<RwLock<()>>,
    /// Held shared while a destage writes cached data to its place (taken
    /// after the barrier, before stripe locks), exclusively while a
    /// snapshot is deleted, a volume rolled back or promoted: those change
    /// which snapshot a page is copied into.
    placement: Ranked<RwLock<()>>,
    /// A snapshot's view: whether the cached writes that belong to it were
    /// placed (they are before it is read, compared or walked).
    settled: AtomicBool,
    /// Where recent reads ended: tells sequential streams from random reads.
    streams: Streams,
}

// The checksums a frontend computes as a payload arrives are sector checksums.
const _: () = assert!(SECTOR_BYTES as usize == crate::device::PIECE_BYTES);

fn io_error(error: DeviceError) -> BlockError {
    if error.is_no_space() {
        BlockError::NoSpace
    } else {
        BlockError::Io(std::io::Error::other(error.to_string()))
    }
}

fn meta_error(error: MetaError) -> BlockError {
    BlockError::Io(std::io::Error::other(format!("metadata: {error}")))
}

fn pool_error(error: PoolError) -> BlockError {
    match error {
        PoolError::Io(e) => io_error(e),
        other => BlockError::Io(std::io::Error::other(other.to_string())),
    }
}

/// Stripe indices (sorted, so locks are always taken in one order) of blocks.
fn stripes_of(blocks: &[u64]) -> Vec<usize> {
    let mut indices: Vec<usize> = blocks.iter().map(|b| (b % STRIPES as u64) as usize).collect();
    indices.sort_unstable();
    indices.dedup();
    indices
}

/// Writes of at least this many blocks whose neighbours are not written yet
/// start a fresh chunk (see [`EngineVolume::first_hint`]); smaller ones (a
/// random 4 KiB write) take the first free slot, so they do not
/// scatter over every chunk of the pool.
const FRESH_CHUNK_MIN_BLOCKS: u64 = 4;

/// Writes of this size or more bypass the write-back cache.
const WRITE_AROUND_BYTES: usize = 128 << 10;

/// The last few read streams of a volume (bcache's `sequential_cutoff`
/// idea): a read that starts near where a recent one stopped continues its
/// stream, and once a stream has covered [`STREAM_MIN_BYTES`] from its
/// first read it is a scan, whose reads add no heat. (Random reads over a
/// hot region much larger than that can pass for a stream now and then,
/// and lose some of their heat.) Several
/// streams, so that a scan among random readers is still seen: a new read
/// replaces the stream read longest ago. Racy by design (a lost update costs one
/// request's heat, or counts it).
struct Streams {
    /// First byte, end, and when it was last read (a tick of `clock`).
    spans: [[AtomicU64; 3]; STREAMS],
    clock: AtomicU64,
}

const STREAMS: usize = 8;
/// How far from a stream's end its next read may start (requests in
/// flight arrive a little out of order); small, so that random reads near
/// each other (a hot region) do not pass for a stream.
const STREAM_GAP: u64 = 128 << 10;
const STREAM_MIN_BYTES: u64 = 256 << 10;

impl Streams {
    fn new() -> Self {
        Streams {
            spans: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            clock: AtomicU64::new(1),
        }
    }

    /// Whether a read of `[offset, offset + length)` belongs to a scan;
    /// remembers it either way.
    #[cfg(test)]
    fn is_sequential(&self, offset: u64, length: u64) -> bool {
        !self.is_random(offset, length)
    }

    /// Whether a read of `[offset, offset + length)` is not part of a
    /// scan; remembers it either way.
    fn is_random(&self, offset: u64, length: u64) -> bool {
        let end = offset + length;
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        for [start, last, touched] in &self.spans {
            let last_end = last.load(Ordering::Relaxed);
            // Near the stream's end (either side: requests in flight
            // arrive out of order). A block read again and again stays
            // near its own end, but covers no more than itself: no scan.
            if last_end != 0 && offset + STREAM_GAP >= last_end && offset <= last_end + STREAM_GAP {
                let last_end = if end > last_end {
                    last.store(end, Ordering::Relaxed);
                    end
                } else {
                    last_end
                };
                touched.store(now, Ordering::Relaxed);
                let scan = last_end - start.load(Ordering::Relaxed).min(last_end) >= STREAM_MIN_BYTES;
                return !scan;
            }
        }
        let [start, last, touched] = self
            .spans
            .iter()
            .min_by_key(|span| span[2].load(Ordering::Relaxed))
            .expect("streams");
        start.store(offset, Ordering::Relaxed);
        last.store(end, Ordering::Relaxed);
        touched.store(now, Ordering::Relaxed);
        true
    }
}

impl EngineVolume {
    pub(crate) fn new(pool: Arc<Pool>, id: u32, size_bytes: u64, volblocksize: u32, mapped_blocks: u64) -> Self {
        let cache = pool.cache.volume(id);
        cache.lock().block_bytes = volblocksize as u64;
        EngineVolume {
            id,
            size_bytes: AtomicU64::new(size_bytes),
            block_shift: volblocksize.trailing_zeros(),
            // Ordinals: by volume, then by index (a shared block's move
            // holds the same stripes of several volumes).
            stripes: (0..STRIPES)
                .map(|index| Ranked::new(Rank::Stripes, (id as u64) << 10 | index as u64, RwLock::new(())))
                .collect(),
            mapped_blocks: AtomicU64::new(mapped_blocks),
            cache,
            log_throughput: AtomicBool::new(false),
            barrier: Ranked::new(Rank::Barrier, id as u64, RwLock::new(())),
            placement: Ranked::new(Rank::Placement, id as u64, RwLock::new(())),
            settled: AtomicBool::new(false),
            streams: Streams::new(),
            pool,
        }
    }

    pub(crate) fn barrier(&self) -> &Ranked<RwLock<()>> {
        &self.barrier
    }

    pub(crate) fn placement(&self) -> &Ranked<RwLock<()>> {
        &self.placement
    }

    /// For a snapshot: places the volume's cached writes that belong to
    /// it, once, before its view is first used (a snapshot's view never
    /// changes after that: writes cached later are after it).
    pub(crate) async fn settle(&self) -> BlockResult<()> {
        if !self.is_snapshot() || self.settled.load(Ordering::Acquire) {
            return Ok(());
        }
        if let Some(info) = self.pool.snapshot(self.id) {
            self.pool
                .place_before(info.volume, info.cache_seq)
                .await
                .map_err(pool_error)?;
        }
        self.settled.store(true, Ordering::Release);
        Ok(())
    }

    /// The barrier, shared, for a change whose stripes the caller holds:
    /// only if it is free. `None` when a snapshot (or another exclusive
    /// holder) has it or waits for it: the caller drops its stripes, waits
    /// in [`Self::pass_barrier`] and tries again. A change never waits at
    /// the barrier holding stripes, nor for stripes holding the barrier, so
    /// a snapshot waits only for changes already under way, never for the
    /// destage batches or write-arounds those would wait behind.
    pub(super) fn try_barrier(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.barrier.try_read().ok()
    }

    /// Waits until the barrier's exclusive holder is done.
    pub(super) async fn pass_barrier(&self) {
        drop(self.barrier.read().await);
    }

    /// Sets the mapped-block count (after a rollback changed the map).
    pub(crate) fn recount_mapped(&self, blocks: u64) {
        self.mapped_blocks.store(blocks, Ordering::Release);
    }

    /// Whether this is a snapshot (read-only).
    pub fn is_snapshot(&self) -> bool {
        super::snapshots::is_snapshot_id(self.id)
    }

    /// Where logical block `block` lives ((device index, byte offset) of
    /// its slot; `None` unmapped): for tests that look at the device.
    #[doc(hidden)]
    pub fn block_place(&self, block: u64) -> Result<Option<(u8, u64)>, MetaError> {
        Ok(self.pool.lookup(self.id, block)?.place())
    }

    /// Bytes of pool space the volume takes: its mapped blocks, and the
    /// blocks its cached writes will take when destaged (reserved already).
    pub fn used_bytes(&self) -> u64 {
        let reserved = self.cache.lock().reserved.len() as u64;
        (self.mapped_blocks.load(Ordering::Relaxed) + reserved) << self.block_shift
    }

    pub fn volblocksize(&self) -> u32 {
        1 << self.block_shift
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The engine's own check of what the `ServedVolume` validated (in range,
    /// sector aligned): a request that gets here otherwise is a bug above,
    /// and is stopped before it can touch another volume's blocks.
    fn assert_in_range(&self, offset: u64, length: u64) {
        let size = self.size_bytes.load(Ordering::Acquire);
        let sector = crate::block::SECTOR_BYTES as u64;
        assert!(
            offset.checked_add(length).is_some_and(|end| end <= size)
                && offset.is_multiple_of(sector)
                && length.is_multiple_of(sector),
            "volume {}: request at {offset} +{length} is outside the volume ({size} bytes) or not sector aligned",
            self.id
        );
    }

    pub(crate) fn block_bytes(&self) -> u64 {
        1 << self.block_shift
    }

    fn stripe_indices(&self, offset: u64, length: u64) -> Vec<usize> {
        let first = offset >> self.block_shift;
        let last = (offset + length.max(1) - 1) >> self.block_shift;
        if last - first + 1 >= STRIPES as u64 {
            return (0..STRIPES).collect();
        }
        let mut indices: Vec<usize> = (first..=last).map(|b| (b % STRIPES as u64) as usize).collect();
        indices.sort_unstable();
        indices.dedup();
        indices
    }

    async fn lock_shared(&self, offset: u64, length: u64) -> Vec<RwLockReadGuard<'_, ()>> {
        self.read_stripes(self.stripe_indices(offset, length)).await
    }

    async fn lock_exclusive(&self, offset: u64, length: u64) -> Vec<RwLockWriteGuard<'_, ()>> {
        self.write_stripes(self.stripe_indices(offset, length)).await
    }

    /// Read-locks the stripes `indices` (sorted). A free stripe is taken
    /// without an `.await`: each awaited tokio lock spends one unit of the
    /// task's cooperative budget (128 per poll), and a megabyte request
    /// locks 64 stripes, so awaiting every one would make the second or
    /// third request in a poll yield and be spawned although nothing was
    /// held.
    /// `try_read` does not pass a queued writer (the lock is fair).
    async fn read_stripes(&self, indices: Vec<usize>) -> Vec<RwLockReadGuard<'_, ()>> {
        let mut guards = Vec::with_capacity(indices.len());
        for index in indices {
            let stripe = &self.stripes[index];
            guards.push(match stripe.try_read() {
                Ok(guard) => guard,
                Err(_) => stripe.read().await,
            });
        }
        guards
    }

    /// Write-locks the stripes `indices` (sorted); see [`Self::read_stripes`].
    async fn write_stripes(&self, indices: Vec<usize>) -> Vec<RwLockWriteGuard<'_, ()>> {
        let mut guards = Vec::with_capacity(indices.len());
        for index in indices {
            let stripe = &self.stripes[index];
            guards.push(match stripe.try_write() {
                Ok(guard) => guard,
                Err(_) => stripe.write().await,
            });
        }
        guards
    }

    /// Completes a write-type request: commit when it must be durable; else,
    /// if it changed the map, stage the records so a completed write
    /// survives a kill -9 of the daemon.
    async fn finish(&self, result: BlockResult<()>, fua: bool, mapped_before: u64) -> BlockResult<()> {
        result?;
        if fua {
            self.pool.commit().await.map_err(pool_error)?;
        } else if self.pool.log_appends() != mapped_before {
            self.pool.stage().await.map_err(pool_error)?;
        }
        Ok(())
    }

    fn invalidate_read_cache(&self, offset: u64, length: u64) {
        let first = offset / SECTOR_BYTES;
        let last = (offset + length.max(1) - 1) / SECTOR_BYTES;
        self.pool.read_cache.invalidate(self.id, first, last - first + 1);
    }

    pub(crate) fn sectors_per_block(&self) -> u64 {
        self.block_bytes() / SECTOR_BYTES
    }

    async fn lock_blocks_shared(&self, blocks: &[u64]) -> Vec<RwLockReadGuard<'_, ()>> {
        self.read_stripes(stripes_of(blocks)).await
    }

    pub(crate) async fn lock_blocks_exclusive(&self, blocks: &[u64]) -> Vec<RwLockWriteGuard<'_, ()>> {
        self.write_stripes(stripes_of(blocks)).await
    }

    /// [`Self::lock_blocks_exclusive`] for a shared block's move, which
    /// holds its own volume's stripes and takes these in another engine of
    /// the family (engines in id order: `Rank::FamilyStripes`).
    pub(crate) async fn lock_family_blocks_exclusive(&self, blocks: &[u64]) -> Vec<RwLockWriteGuard<'_, ()>> {
        let mut guards = Vec::new();
        for index in stripes_of(blocks) {
            guards.push(self.stripes[index].write_at(Rank::FamilyStripes).await);
        }
        guards
    }
}

impl BlockDevice for EngineVolume {
    fn capabilities(&self) -> Capabilities {
        let writable = !self.is_snapshot();
        Capabilities {
            can_flush: true,
            can_fua: writable,
            can_trim: writable,
            can_zero: writable,
            can_fast_zero: writable,
            can_cache: true,
            can_block_status: true,
            read_only: !writable,
            rotational: self.pool.rotational(),
            // Completed writes are durable only after a flush (device caches,
            // page cache, and the log's group commit).
            volatile_write_cache: true,
            // A flush commits the whole pool: every device and the log.
            flush_covers_all_handles: true,
            min_block_bytes: crate::block::SECTOR_BYTES,
            preferred_block_bytes: SECTOR_BYTES as u32,
            max_request_bytes: crate::block::MAX_REQUEST_BYTES,
        }
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, BlockResult<()>)> {
        self.assert_in_range(offset, buf.len() as u64);
        if !self.settled.load(Ordering::Acquire) && self.is_snapshot() {
            return Box::pin(async move {
                if let Err(e) = self.settle().await {
                    return (buf, Err(e));
                }
                self.read_impl(offset, buf).await
            });
        }
        Box::pin(self.read_impl(offset, buf))
    }

    fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        self.assert_in_range(offset, data.len() as u64);
        Box::pin(async move {
            if self.is_snapshot() {
                return Err(BlockError::ReadOnly);
            }
            // Takes the barrier itself, for the part that changes anything.
            self.write_cached(offset, data, fua).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(self.flush_cached())
    }

    fn set_log_throughput(&self, throughput: bool) {
        self.log_throughput.store(throughput, Ordering::Release);
    }

    fn backing_space_low(&self) -> bool {
        self.pool.backing_space_low()
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        self.assert_in_range(offset, length);
        Box::pin(async move {
            if self.is_snapshot() {
                return Err(BlockError::ReadOnly);
            }
            // What is cached there goes to its place first, before the
            // barrier: a snapshot need not wait for that.
            self.place_cached_in(offset, length).await?;
            let (barrier, _guards) = self.lock_for_change(offset, length, false).await?;
            let appends = self.pool.log_appends();
            let result = self.trim_locked(offset, length).await;
            drop(_guards);
            drop(barrier);
            self.finish(result, fua, appends).await
        })
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>> {
        self.assert_in_range(offset, length);
        Box::pin(async move {
            if self.is_snapshot() {
                return Err(BlockError::ReadOnly);
            }
            if !flags.may_trim && flags.fast_only {
                return Err(BlockError::NotFast);
            }
            self.place_cached_in(offset, length).await?;
            let (barrier, _guards) = self.lock_for_change(offset, length, !flags.may_trim).await?;
            let appends = self.pool.log_appends();
            let result = if flags.may_trim {
                self.trim_locked(offset, length).await
            } else {
                self.zero_locked(offset, length).await
            };
            drop(_guards);
            drop(barrier);
            self.finish(result, flags.fua, appends).await
        })
    }

    /// Prefetch: reads the range (up to 32 MiB of it; the rest of a larger
    /// hint is ignored), which loads its map pages and warms device caches.
    fn cache(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(async move {
            self.settle().await?;
            let length = length.min(crate::block::MAX_REQUEST_BYTES as u64);
            let (_, result) = self.read_impl(offset, IoBuf::new(length as usize)).await;
            result
        })
    }

    fn block_status(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<Vec<Extent>>> {
        Box::pin(async move {
            self.settle().await?;
            self.extents(offset, length)
        })
    }

    fn resize(&self, new_size_bytes: u64) -> BlockResult<()> {
        self.size_bytes.store(new_size_bytes, Ordering::Release);
        Ok(())
    }

    fn changed_since(&self, older: u32, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<Vec<ChangedRun>>> {
        Box::pin(async move {
            self.settle().await?;
            self.changed_runs(older, offset, length)
        })
    }
}

/// Most blocks one [`EngineVolume::changed_runs`] call looks at: the answer
/// covers a prefix of a longer range (NBD allows it), so one request
/// cannot walk a whole large volume's map.
const MAX_CHANGED_BLOCKS: u64 = 1 << 20;

impl EngineVolume {
    /// `changed_since` for a snapshot: the pool's `changed_blocks` between
    /// `older` and this snapshot, in bytes, from `offset`. Refused unless
    /// both exist and `older` is an older snapshot of the same volume
    /// (checked again after the walk: a delete of `older` meanwhile moves
    /// its pages, and the answer could be wrong).
    fn changed_runs(&self, older: u32, offset: u64, length: u64) -> BlockResult<Vec<ChangedRun>> {
        let valid = || match (self.pool.snapshot(self.id), self.pool.snapshot(older)) {
            (Some(this), Some(before)) => before.volume == this.volume && before.generation < this.generation,
            _ => false,
        };
        if !valid() {
            return Err(BlockError::NotSupported("the older snapshot no longer exists"));
        }
        let shift = self.block_shift;
        let end = offset + length;
        let first = offset >> shift;
        let last = ((end - 1) >> shift).min(first + MAX_CHANGED_BLOCKS - 1);
        let end = end.min((last + 1) << shift);
        let runs = self
            .pool
            .changed_blocks(Some(older), self.id, first, last)
            .map_err(meta_error)?;
        if !valid() {
            return Err(BlockError::NotSupported("the older snapshot no longer exists"));
        }
        let mut out: Vec<ChangedRun> = Vec::with_capacity(2 * runs.len() + 1);
        let mut at = offset;
        for (block, count) in runs {
            let start = (block << shift).max(offset);
            let stop = ((block + count) << shift).min(end);
            if start > at {
                out.push(ChangedRun {
                    length: start - at,
                    changed: false,
                });
            }
            out.push(ChangedRun {
                length: stop - start,
                changed: true,
            });
            at = stop;
        }
        if at < end {
            out.push(ChangedRun {
                length: end - at,
                changed: false,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::BlockDevice;
    use crate::device::SimDevice;
    use crate::pool::superblock::Role;
    use crate::pool::NewDevice;

    const MIB: u64 = 1 << 20;

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A pool of 1 MiB chunks on one simulated 160 MiB fast device.
    async fn sim_pool(seed: u64) -> (SimDevice, Arc<Pool>) {
        let sim = SimDevice::new(160 * MIB, seed);
        let device = NewDevice {
            device: sim.as_device(),
            role: Role::Fast,
        };
        let pool = Pool::create("test", 1 << 20, vec![device]).await.unwrap();
        (sim, pool)
    }

    /// A kill -9 of the process: every write it made reaches the device.
    fn crash_keeping_every_write(sim: &SimDevice) {
        sim.set_crash_model(crate::device::sim::CrashModel {
            drop_weight: 0,
            apply_weight: 1,
            tear_weight: 0,
        });
        sim.crash();
    }

    /// A fast device and a dedicated log device, for `Pool::create`.
    fn fast_and_log(fast: &SimDevice, log: &SimDevice) -> Vec<NewDevice> {
        vec![
            NewDevice {
                device: fast.as_device(),
                role: Role::Fast,
            },
            NewDevice {
                device: log.as_device(),
                role: Role::Log,
            },
        ]
    }

    #[test]
    fn scans_are_told_from_random_reads_and_from_blocks_read_again() {
        let streams = Streams::new();
        let k = 1u64 << 10;
        // A block read again and again, and its neighbour: never a scan.
        for _ in 0..100 {
            assert!(!streams.is_sequential(64 * MIB, 16 * k));
        }
        assert!(!streams.is_sequential(64 * MIB + 16 * k, 16 * k));
        // A 4K scan, with random reads in between: a scan once it has
        // covered 256 KiB, its reads arriving a little out of order.
        let mut scan = Vec::new();
        for i in 0..256u64 {
            let at = 200 * MIB + (i ^ 1) * 4 * k;
            scan.push(streams.is_sequential(at, 4 * k));
            streams.is_sequential((i * 7919 % 40) * 10 * MIB, 4 * k);
        }
        assert!(scan[..60].iter().all(|s| !s), "{scan:?}");
        assert!(scan[70..].iter().all(|s| *s), "{scan:?}");
    }

    #[test]
    fn a_write_whose_mapping_fails_gives_back_every_slot_it_did_not_map() {
        current_thread().block_on(async {
            let (_sim, pool) = sim_pool(5).await;
            let volume = pool.open_volume(1, 16 * MIB, 4096).unwrap();
            let used = || pool.status().iter().map(|d| d.used_bytes).sum::<u64>();
            let before = used();
            // The 6th of the 256 new mappings of a 1 MiB write fails.
            pool.fail_mapping_after.store(5, Ordering::Release);
            let result = volume.write(0, IoBuf::copy_from(&vec![7u8; MIB as usize]), false).await;
            assert!(matches!(result, Err(BlockError::Io(_))), "{result:?}");
            pool.fail_mapping_after.store(-1, Ordering::Release);
            // Five blocks were mapped; nothing else stays allocated.
            assert_eq!(volume.mapped_blocks.load(Ordering::Acquire), 5);
            assert_eq!(used() - before, 5 * 4096);
            // The volume still works, and the range can be written again.
            volume
                .write(0, IoBuf::copy_from(&vec![8u8; MIB as usize]), false)
                .await
                .unwrap();
            assert_eq!(used() - before, MIB);
        });
    }

    #[test]
    fn a_map_entry_pointing_at_another_blocks_slot_fails_its_read() {
        // Pools created now tag their checksums with each sector's place;
        // a pool of format 1 keeps plain checksums, and there the
        // misdirected entry reads the other block's data.
        for tagged in [true, false] {
            current_thread().block_on(async {
                let (sim, mut pool) = sim_pool(23).await;
                if !tagged {
                    drop(pool);
                    let device = sim.as_device();
                    let (superblock, _) = crate::pool::recover::read_superblock(&device).await.unwrap();
                    let old = crate::pool::superblock::Superblock {
                        format: 1,
                        ..superblock
                    };
                    crate::pool::recover::write_superblock(&device, &old).await.unwrap();
                    pool = Pool::open(vec![device]).await.unwrap();
                }
                assert_eq!(pool.checksum_tags, tagged);
                let volume = pool.open_volume(1, 16 * MIB, 4096).unwrap();
                for (block, byte) in [(0u64, 0x11u8), (1, 0x22)] {
                    volume
                        .write(block * 4096, IoBuf::copy_from(&[byte; 4096]), false)
                        .await
                        .unwrap();
                }
                pool.destage_all().await.unwrap();
                drop(volume);
                // Block 0's entry damaged to name block 1's slot (a valid
                // block whose checksum matches its own data).
                let other = pool.lookup(1, 1).unwrap();
                pool.set_mapping(1, 0, other).unwrap();
                let volume = pool.open_volume(1, 16 * MIB, 4096).unwrap();
                let errors = || pool.status().iter().map(|d| d.checksum_errors).sum::<u64>();
                let (buf, result) = volume.read(0, IoBuf::new(4096)).await;
                if tagged {
                    assert!(matches!(result, Err(BlockError::Checksum { offset: 0 })), "{result:?}");
                    assert_eq!(errors(), 1);
                } else {
                    result.unwrap();
                    assert!(buf.payload().iter().all(|&b| b == 0x22));
                    assert_eq!(errors(), 0);
                }
                // Block 1 itself still reads back right.
                let (buf, result) = volume.read(4096, IoBuf::new(4096)).await;
                result.unwrap();
                assert!(buf.payload().iter().all(|&b| b == 0x22));
            });
        }
    }

    #[test]
    fn megabyte_requests_run_to_the_end_in_one_poll_when_nothing_is_held() {
        // The NBD reader polls each request once in its own task and spawns
        // it only if it waits. A 1 MiB request locks 64 stripes; awaiting
        // each tokio lock would spend the task's cooperative budget (128 per
        // poll), so the second or third request of a poll would yield
        // although nothing was held, and be spawned (a task and a woken
        // worker each).
        current_thread().block_on(async {
            let (_sim, pool) = sim_pool(3).await;
            let volume = pool.open_volume(1, 16 * MIB, 16 << 10).unwrap();
            let data = |round: u8| IoBuf::copy_from(&vec![round; MIB as usize]);
            // First writes allocate and mark chunks dirty: they may wait.
            for at in 0..4 {
                volume.write(at * MIB, data(0), false).await.unwrap();
            }
            let mut context = std::task::Context::from_waker(std::task::Waker::noop());
            for round in 1..=8u8 {
                for at in 0..4 {
                    let mut write = volume.write(at * MIB, data(round), false);
                    let std::task::Poll::Ready(result) = write.as_mut().poll(&mut context) else {
                        panic!("round {round}: the write at {at} MiB waited");
                    };
                    result.unwrap();
                    let mut read = volume.read(at * MIB, IoBuf::new(MIB as usize));
                    let std::task::Poll::Ready((buf, result)) = read.as_mut().poll(&mut context) else {
                        panic!("round {round}: the read at {at} MiB waited");
                    };
                    result.unwrap();
                    assert!(buf.payload().iter().all(|&byte| byte == round));
                }
            }
        });
    }

    /// kill -9 after a rewrite of blocks whose mappings are only staged
    /// (their chunk already marked dirty, so nothing committed them) and
    /// before the log write that follows it: the device holds the rewrite's
    /// data, the log what it held before. Every acknowledged write must
    /// read back: an overwrite in place must not break the staged records'
    /// checksums, or recovery drops the blocks (they read back as zeros).
    #[test]
    fn a_kill_after_a_rewrite_of_blocks_whose_mappings_are_only_staged_loses_nothing() {
        current_thread().block_on(async {
            const BLOCK: u32 = 16 << 10;
            let (sim, pool) = sim_pool(11).await;
            let volume = pool.open_volume(1, 16 * MIB, BLOCK).unwrap();
            let big = WRITE_AROUND_BYTES;
            let data = |byte: u8| IoBuf::copy_from(&vec![byte; big]);
            // Blocks 0-7 mapped, then overwritten in place: their chunk is
            // marked dirty (and their mappings committed with the mark).
            volume.write(0, data(1), false).await.unwrap();
            volume.write(0, data(2), false).await.unwrap();
            // Blocks 8-15: new, in the same chunk, their mappings staged.
            volume.write(big as u64, data(3), false).await.unwrap();
            let blocks = big as u64 / BLOCK as u64;
            let places = || -> Vec<u64> {
                pool.lookup_range(1, blocks, 2 * blocks - 1)
                    .unwrap()
                    .iter()
                    .map(|entry| entry.place().expect("mapped").1)
                    .collect()
            };
            let mut slots = places();
            assert!(slots.iter().all(|at| pool.is_marked((0, *at), pool.epoch())));
            let before = sim.snapshot();
            let committed = pool.log.next_lsn();
            // Needs no new mark: nothing is committed, only staged.
            volume.write(big as u64, data(4), false).await.unwrap();
            assert_eq!(pool.log.next_lsn(), committed, "the rewrite committed the log");
            slots.extend(places());
            let data_sector = |sector: u64| slots.iter().any(|&at| (at..at + BLOCK as u64).contains(&sector));
            drop(volume);
            drop(pool);
            // What the killed process left: every data write it made reached
            // the file, the log as it was before the rewrite.
            crash_keeping_every_write(&sim);
            let after = sim.snapshot();
            let (mut kept, mut restored) = (0, 0);
            for sector in after.differing_sectors(&before) {
                if data_sector(sector) {
                    kept += 1;
                } else {
                    sim.write_durable(sector, &before.read(sector, 512));
                    restored += 1;
                }
            }
            assert!(
                kept > 0 && restored > 0,
                "{kept} data sectors and {restored} log sectors written"
            );
            let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
            let volume = pool.open_volume(1, 16 * MIB, BLOCK).unwrap();
            let (buf, result) = volume.read(big as u64, IoBuf::new(big)).await;
            result.unwrap();
            let first = buf.payload()[0];
            assert!(first == 3 || first == 4, "read back {first:#x}, not 3 or 4");
            assert!(buf.payload().iter().all(|&b| b == first));
        });
    }

    /// A full pool whose newest blocks' mappings are only staged: a rewrite
    /// of them would go to new slots (see `write_locked`) and there are
    /// none. It commits and overwrites in place instead of failing with
    /// ENOSPC. (Two destages of one block overlapping on a nearly full pool,
    /// the second taking a slot a cached write counted on, failed a FLUSH
    /// with NoSpace this way: tests/pools.rs, under load.)
    #[test]
    fn a_rewrite_of_staged_blocks_on_a_full_pool_commits_instead_of_failing() {
        current_thread().block_on(async {
            const BLOCK: u32 = 64 << 10;
            let (_sim, pool) = sim_pool(13).await;
            let data_bytes: u64 = pool.status().iter().map(|d| d.data_bytes).sum();
            let volume = pool.open_volume(1, 2 * data_bytes, BLOCK).unwrap();
            let big = WRITE_AROUND_BYTES as u64;
            assert_eq!(data_bytes % big, 0);
            let data = |byte: u8| IoBuf::copy_from(&vec![byte; big as usize]);
            // Every slot of the pool, written around the cache; the last
            // chunk's first blocks twice (an overwrite in place: the chunk
            // is marked dirty and the mappings committed) before its last
            // blocks are written (staged mappings, in the marked chunk).
            let last = data_bytes - big;
            for at in (0..last).step_by(big as usize) {
                volume.write(at, data(1), false).await.unwrap();
            }
            volume.write(last - big, data(1), false).await.unwrap();
            volume.write(last, data(1), false).await.unwrap();
            let used: u64 = pool.status().iter().map(|d| d.used_bytes).sum();
            assert_eq!(used, data_bytes, "the pool is full");
            assert!(!pool.space_short());
            let blocks = (last / BLOCK as u64, (data_bytes - 1) / BLOCK as u64);
            assert!(
                !pool.log.pending_allocations(1, blocks.0, blocks.1).is_empty(),
                "the last blocks' mappings are staged, not committed"
            );
            let committed = pool.log.next_lsn();
            volume.write(last, data(2), false).await.unwrap();
            assert_ne!(pool.log.next_lsn(), committed, "the rewrite committed the log");
            let (buf, result) = volume.read(last, IoBuf::new(big as usize)).await;
            result.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 2));
            let (buf, result) = volume.read(0, IoBuf::new(big as usize)).await;
            result.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 1));
            // Nothing else may be written: the pool is still full.
            let more = volume.write(data_bytes, data(3), false).await;
            assert!(matches!(more, Err(BlockError::NoSpace)), "{more:?}");
        });
    }

    /// A dedicated log device too small to hold a log is refused with a
    /// message that says so (before: "superblock is inconsistent: log
    /// region [1048576, +0) outside device 1").
    #[test]
    fn a_log_device_under_two_chunks_is_refused() {
        current_thread().block_on(async {
            let fast = SimDevice::new(160 * MIB, 1);
            let log = SimDevice::new(MIB + MIB / 2, 2);
            let devices = fast_and_log(&fast, &log);
            match Pool::create("test", 1 << 20, devices).await {
                Err(crate::pool::PoolError::Invalid(message)) => {
                    assert!(message.contains("too small for a log"), "{message}")
                }
                Err(e) => panic!("unexpected error: {e}"),
                Ok(_) => panic!("a pool was made with a 1.5 MiB log device"),
            }
        });
    }

    #[test]
    fn lookup_range_matches_lookups_across_map_pages() {
        current_thread().block_on(async {
            let (_sim, pool) = sim_pool(5).await;
            // 4 KiB blocks: 4096 of them, several map pages.
            let volume = pool.open_volume(1, 16 * MIB, 4096).unwrap();
            let blocks = 16 * MIB / 4096;
            assert!(blocks > 2 * crate::meta::pages::MAP_ENTRIES_PER_PAGE);
            for block in (0..blocks).step_by(7) {
                volume
                    .write(block * 4096, IoBuf::copy_from(&[1u8; 4096]), false)
                    .await
                    .unwrap();
            }
            // Out of the write-back cache, into the map.
            pool.destage_all().await.unwrap();
            let one_by_one: Vec<BlockPtr> = (0..blocks).map(|b| pool.lookup(1, b).unwrap()).collect();
            assert!(one_by_one.iter().filter(|e| e.is_mapped()).count() as u64 == blocks.div_ceil(7));
            let page = crate::meta::pages::MAP_ENTRIES_PER_PAGE;
            for (first, last) in [
                (0, blocks - 1),
                (page - 3, page + 2),
                (page, page),
                (5, 5),
                (page - 1, 2 * page),
            ] {
                assert_eq!(
                    pool.lookup_range(1, first, last).unwrap(),
                    one_by_one[first as usize..=last as usize],
                    "{first}..={last}"
                );
            }
        });
    }

    #[test]
    fn synchronous_writers_short_of_log_room_wait_for_it_and_are_counted() {
        current_thread().block_on(async {
            // A 3 MiB log (a 4 MiB log device less its superblock chunk).
            let fast = SimDevice::new(160 * MIB, 13);
            let log = SimDevice::new(4 * MIB, 14);
            let devices = fast_and_log(&fast, &log);
            let pool = Pool::create("test", 1 << 20, devices).await.unwrap();
            let volume = pool.open_volume(1, 32 * MIB, 16 << 10).unwrap();
            let counters = pool.meta_counters();
            assert_eq!((counters.log_room_waits, counters.log_room_wait_micros), (0, 0));
            // 8 MiB of synchronous 4K writes: their Data records fill the
            // log more than twice over.
            let count = 2048u64;
            for index in 0..count {
                let data = IoBuf::copy_from(&[(index % 251) as u8 + 1; 4096]);
                volume.write(index * 4096 * 3, data, true).await.unwrap();
            }
            assert!(pool.meta_counters().log_room_waits > 0);
            for index in 0..count {
                let (buf, result) = volume.read(index * 4096 * 3, IoBuf::new(4096)).await;
                result.unwrap();
                assert!(
                    buf.payload().iter().all(|&b| b == (index % 251) as u8 + 1),
                    "write {index}"
                );
            }
        });
    }

    #[test]
    fn a_destage_pass_marks_the_chunks_it_overwrites_in_one_commit() {
        current_thread().block_on(async {
            let (_sim, pool) = sim_pool(11).await;
            let block = 16 * 1024u64;
            let volume = pool.open_volume(1, 32 * MIB, block as u32).unwrap();
            let blocks = 32 * MIB / block;
            for index in 0..blocks {
                volume
                    .write(index * block, IoBuf::copy_from(&vec![1u8; block as usize]), false)
                    .await
                    .unwrap();
            }
            pool.destage_all().await.unwrap();
            // A new epoch: every chunk needs its mark again.
            pool.checkpoint().await.unwrap();
            // The blocks in every other chunk, so that no mark is one of a
            // stream's marked ahead (`Pool::mark_dirty`): one by one, each
            // chunk would cost a commit of its own.
            let chunk_of = |index: u64| {
                let (_, offset) = pool.lookup(1, index).unwrap().place().unwrap();
                offset / MIB
            };
            let chosen: Vec<u64> = (0..blocks).filter(|&index| chunk_of(index) % 2 == 0).collect();
            let mut chunks: Vec<u64> = chosen.iter().map(|&index| chunk_of(index)).collect();
            chunks.dedup();
            assert!(chunks.len() >= 8, "{} chunks", chunks.len());
            for &index in &chosen {
                volume
                    .write(index * block, IoBuf::copy_from(&[2u8; 4096]), false)
                    .await
                    .unwrap();
            }
            let commits = pool.log.commits.load(Ordering::Relaxed);
            pool.destage_all().await.unwrap();
            let commits = pool.log.commits.load(Ordering::Relaxed) - commits;
            // Per pass of up to 512 blocks: the marks, then the records.
            let passes = chosen.len().div_ceil(512) as u64;
            assert!(
                commits <= 2 * passes,
                "{commits} commits for {passes} passes over {} chunks",
                chunks.len()
            );
            // Overwritten in place, and read back.
            for &index in &chosen {
                assert_eq!(chunk_of(index) % 2, 0);
                let (buf, result) = volume.read(index * block, IoBuf::new(8192)).await;
                result.unwrap();
                assert!(buf.payload()[..4096].iter().all(|&b| b == 2));
                assert!(buf.payload()[4096..].iter().all(|&b| b == 1));
            }
        });
    }

    /// The scrub after a crash reads a suspect block under its own stripe
    /// lock only: a writer holding its gate shard (any volume's) does not
    /// hold it up. Of a block, only the suspect parts are repaired from the
    /// data: a mismatch elsewhere in the same chunk is an error.
    #[test]
    fn the_scrub_repairs_only_suspect_parts_and_holds_no_gate() {
        current_thread().block_on(async {
            let (sim, pool) = sim_pool(5).await;
            let block = 16u64 << 10;
            let volume = pool.open_volume(1, 4 * MIB, block as u32).unwrap();
            volume
                .write(0, IoBuf::copy_from(&vec![7u8; MIB as usize]), true)
                .await
                .unwrap();
            pool.destage_all().await.unwrap();
            pool.checkpoint().await.unwrap();
            let place = |index: u64| pool.lookup(1, index).unwrap().place().unwrap();
            let (device, first) = place(0);
            let (_, second) = place(1);
            assert_eq!(first >> 20, second >> 20, "blocks 0 and 1 in one chunk");
            // Block 0's slot rewritten behind the checksums' back, as a
            // write in flight at a crash leaves it, and marked suspect as
            // replay marks it; block 1's slot rotten, not suspect.
            sim.write_durable(first, &vec![8u8; block as usize]);
            sim.write_durable(second + 100, &[9u8]);
            pool.mark_suspect(device, first, block);
            let errors = || {
                pool.devices
                    .at(0)
                    .unwrap()
                    .counters
                    .checksum_errors
                    .load(Ordering::Relaxed)
            };
            let writer = pool.enter_write(2).await;
            let report = tokio::time::timeout(std::time::Duration::from_secs(10), pool.scrub_suspect())
                .await
                .expect("the scrub waited for a writer's gate")
                .unwrap();
            drop(writer);
            assert_eq!((report.blocks, report.failed, report.left), (1, 0, 0), "{report:?}");
            assert_eq!(report.repaired, block / SECTOR_BYTES);
            assert_eq!(pool.suspect_chunks(), 0);
            let (buf, result) = volume.read(0, IoBuf::new(block as usize)).await;
            result.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 8));
            assert_eq!(errors(), 0);
            let (_, result) = volume.read(block, IoBuf::new(block as usize)).await;
            assert!(matches!(result, Err(BlockError::Checksum { .. })), "{result:?}");
            assert_eq!(errors(), 1);
        });
    }

    /// A process that dies during writes in place, its RAM tier surviving
    /// (a kill -9): after recovery only the sectors it was writing are
    /// suspect, so a byte flipped in another block of the same chunk is a
    /// checksum error, not "repaired". When the RAM tier is lost too (the
    /// machine went down), the in-place marks are gone and every sector of
    /// the chunk is suspect.
    #[test]
    fn after_a_kill_only_the_sectors_written_in_place_are_repaired() {
        for machine_survives in [true, false] {
            current_thread().block_on(async {
                const BLOCK: u64 = 16 << 10;
                let sim = SimDevice::new(160 * MIB, 17);
                let image = crate::pool::ram::HeapImage::new(crate::pool::DEFAULT_RAM_BYTES);
                let options = || crate::pool::PoolOptions {
                    ram: Some(crate::pool::ram::RamSource::Heap(image.clone())),
                    ..Default::default()
                };
                let device = NewDevice {
                    device: sim.as_device(),
                    role: Role::Fast,
                };
                let pool = Pool::create_with("test", 1 << 20, vec![device], options())
                    .await
                    .unwrap();
                let volume = pool.open_volume(1, 4 * MIB, BLOCK as u32).unwrap();
                let pattern = |block: u64| 0x10 + block as u8;
                for block in 0..64 {
                    volume
                        .write(
                            block * BLOCK,
                            IoBuf::copy_from(&[pattern(block); BLOCK as usize]),
                            false,
                        )
                        .await
                        .unwrap();
                }
                pool.destage_all().await.unwrap();
                pool.checkpoint().await.unwrap();
                let place = |block: u64| pool.lookup(1, block).unwrap().place().unwrap().1;
                let slots: Vec<u64> = (0..64).map(place).collect();
                // Blocks 0-7 rewritten around the cache, in place: their
                // checksums only in memory when the process dies.
                let big = WRITE_AROUND_BYTES as u64;
                volume
                    .write(0, IoBuf::copy_from(&vec![0xaa; big as usize]), false)
                    .await
                    .unwrap();
                assert_eq!(place(0), slots[0], "the rewrite went in place");
                let chunk = slots[0] >> 20;
                let untouched = (big / BLOCK..64)
                    .find(|&block| slots[block as usize] >> 20 == chunk)
                    .expect("a block the rewrite did not touch, in its chunk");
                drop(volume);
                drop(pool);
                crash_keeping_every_write(&sim);
                if !machine_survives {
                    image.wipe();
                }
                // Rot in the untouched block.
                sim.write_durable(slots[untouched as usize] + 100, &[!pattern(untouched)]);
                let pool = Pool::open_with(vec![sim.as_device()], options()).await.unwrap();
                let volume = pool.open_volume(1, 4 * MIB, BLOCK as u32).unwrap();
                let suspect = pool.suspect_snapshot();
                let parts: u32 = suspect.iter().flat_map(|(_, p)| p).map(|w| w.count_ones()).sum();
                if machine_survives {
                    assert_eq!(parts as u64, big / SECTOR_BYTES, "suspect: {suspect:?}");
                } else {
                    assert_eq!(suspect, vec![((0, chunk), crate::pool::ALL_PARTS)]);
                }
                let report = pool.scrub_suspect().await.unwrap();
                // It reads back only the blocks in suspect parts: those the
                // rewrite covered (or, without the marks, every block of the
                // chunk, the rotten one repaired as the crash may explain).
                assert_eq!(report.failed, 0, "{report:?}");
                if machine_survives {
                    assert_eq!(report.blocks, big / BLOCK, "{report:?}");
                } else {
                    assert!(report.blocks > big / BLOCK, "{report:?}");
                }
                let (buf, result) = volume.read(0, IoBuf::new(big as usize)).await;
                result.unwrap();
                assert!(buf.payload().iter().all(|&b| b == 0xaa));
                let (buf, result) = volume.read(untouched * BLOCK, IoBuf::new(BLOCK as usize)).await;
                let errors = pool
                    .devices
                    .at(0)
                    .unwrap()
                    .counters
                    .checksum_errors
                    .load(Ordering::Relaxed);
                if machine_survives {
                    assert!(matches!(result, Err(BlockError::Checksum { .. })), "{result:?}");
                    assert!(errors >= 1, "the rot is counted");
                } else {
                    // Documented: without the marks the crash explains
                    // every sector of the chunk, so the rot is taken as data.
                    result.unwrap();
                    assert_eq!(buf.payload()[100], !pattern(untouched));
                }
                // Every other block reads back as written.
                for block in (big / BLOCK..64).filter(|&b| b != untouched) {
                    let (buf, result) = volume.read(block * BLOCK, IoBuf::new(BLOCK as usize)).await;
                    result.unwrap();
                    assert!(buf.payload().iter().all(|&b| b == pattern(block)), "block {block}");
                }
            });
        }
    }

    /// The in-place marks are a bounded table: entries of epochs a
    /// checkpoint covers are reused, and a chunk that finds no room says
    /// so (recovery then trusts none of such a chunk's sectors).
    #[test]
    fn in_place_marks_reuse_covered_entries_and_report_overflow() {
        let image = crate::pool::ram::HeapImage::new(crate::pool::ram::MIN_RAM_BYTES);
        let source = crate::pool::ram::RamSource::Heap(image);
        let uuid = [7u8; 16];
        let (tier, _, _) = crate::pool::ram::RamTier::open(&source, &uuid).unwrap();
        let one = |part: u64| {
            let mut parts = [0u64; 4];
            parts[(part / 64) as usize] |= 1 << (part % 64);
            parts
        };
        // Epoch 5, nothing covered past 4: two chunks, two parts of one.
        tier.note_in_place(0, 3, &one(1), 5, 4);
        tier.note_in_place(0, 3, &one(200), 5, 4);
        tier.note_in_place(1, 9, &one(0), 5, 4);
        drop(tier);
        let (tier, _, intact) = crate::pool::ram::RamTier::open(&source, &uuid).unwrap();
        assert!(intact);
        let marks = tier.marks_after(4).expect("the marks survived");
        assert!(!marks.overflowed);
        let mut want = one(1);
        want[3] |= one(200)[3];
        assert_eq!(marks.chunks.get(&(0, 3)), Some(&want));
        assert_eq!(marks.chunks.get(&(1, 9)), Some(&one(0)));
        assert_eq!(marks.chunks.len(), 2);
        // Once epoch 5 is covered, nothing is named, and 5,000 chunks in
        // epoch 7 fill what 1,024 entries hold: the overflow is reported.
        assert!(tier.marks_after(5).unwrap().chunks.is_empty());
        for chunk in 0..5000 {
            tier.note_in_place(0, chunk, &one(0), 7, 5);
        }
        drop(tier);
        let (tier, _, _) = crate::pool::ram::RamTier::open(&source, &uuid).unwrap();
        let marks = tier.marks_after(5).unwrap();
        assert!(marks.overflowed);
        assert!(
            marks.chunks.len() >= 1000 && marks.chunks.len() <= 1024,
            "{}",
            marks.chunks.len()
        );
        assert!(
            !tier.marks_after(7).unwrap().overflowed,
            "covered, the overflow no longer counts"
        );
        // Another pool's region: no marks at all.
        drop(tier);
        let (tier, _, intact) = crate::pool::ram::RamTier::open(&source, &[8u8; 16]).unwrap();
        assert!(!intact);
        assert!(tier.marks_after(0).is_none());
    }

    #[test]
    fn a_sequential_stream_marks_the_chunks_ahead_in_one_log_write_and_random_writes_mark_only_their_own() {
        current_thread().block_on(async {
            let (_sim, pool) = sim_pool(7).await;
            let chunk = 1u64 << 20;
            let ahead = super::super::MARK_AHEAD_BYTES / chunk;
            let log_writes = |pool: &Pool| pool.log.next_lsn();
            let marked = |pool: &Pool, index: u64| {
                pool.devices.at(0).unwrap().chunk_epochs[index as usize].load(Ordering::Acquire) == pool.epoch()
            };
            // The first chunk of a stream: only itself.
            let before = log_writes(&pool);
            pool.mark_dirty(&[(0, 0)]).await.unwrap();
            assert!(log_writes(&pool) > before, "a mark is a log write");
            assert!(marked(&pool, 0));
            assert!(!marked(&pool, 1));
            // Its successor continues a stream: it and the next chunks.
            pool.mark_dirty(&[(0, chunk + 4096)]).await.unwrap();
            for index in 1..=1 + ahead {
                assert!(marked(&pool, index), "chunk {index} marked ahead");
            }
            assert!(!marked(&pool, 2 + ahead));
            // The stream's next chunks then cost no log write at all.
            let before = log_writes(&pool);
            for index in 2..=1 + ahead {
                pool.mark_dirty(&[(0, index * chunk)]).await.unwrap();
            }
            assert_eq!(log_writes(&pool), before);
            // A write far away (its predecessor unmarked) marks its own chunk only.
            pool.mark_dirty(&[(0, 100 * chunk)]).await.unwrap();
            assert!(marked(&pool, 100));
            assert!(!marked(&pool, 101));
            // Near the end of the device nothing past it is marked (or panics).
            let chunks = pool.devices.at(0).unwrap().chunk_epochs.len() as u64;
            pool.mark_dirty(&[(0, (chunks - 2) * chunk)]).await.unwrap();
            pool.mark_dirty(&[(0, (chunks - 1) * chunk)]).await.unwrap();
            assert!(marked(&pool, chunks - 1));
            // A new epoch (a checkpoint) needs every mark again.
            pool.checkpoint().await.unwrap();
            assert!(!marked(&pool, 0));
        });
    }
}
