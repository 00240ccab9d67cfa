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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::alloc::Hint;
use super::cache::{Entry, VolumeCache};
use super::{map_entry, Pool, PoolError, SECTOR_BYTES};
use crate::device::{DeviceError, IoBuf};
use crate::meta::log::Record;
use crate::volume::{BlockDevice, BlockError, BlockResult, BoxFuture, Capabilities, Extent, ZeroFlags};

const STRIPES: usize = 1024;
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
    stripes: Box<[RwLock<()>]>,
    /// Blocks currently mapped (for `used` in `volume list`).
    mapped_blocks: AtomicU64,
    /// This volume's part of the pool's write-back cache.
    cache: Arc<VolumeCache>,
    /// `logbias=throughput`: synchronous writes go to their place, not to
    /// the intent log.
    log_throughput: AtomicBool,
}

/// One device write planned by a request (one or more volume blocks that
/// are contiguous on the device).
struct PlannedWrite {
    device: u8,
    offset: u64,
    data: Payload,
    /// Checksums of every sector written, in order (the write is whole
    /// sectors).
    crcs: Vec<u32>,
    parts: Vec<Part>,
}

/// The bytes of a planned write: a range of the request's own buffer (no
/// copy: an aligned overwrite, or a first write of whole blocks), or a
/// buffer of their own (a block padded with zeros or with sectors read for a
/// partial write, or a merge of both kinds).
enum Payload {
    Source(std::ops::Range<usize>),
    Owned(IoBuf),
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::Source(range) => range.len(),
            Payload::Owned(buf) => buf.len(),
        }
    }

    fn bytes<'a>(&'a self, source: &'a [u8]) -> &'a [u8] {
        match self {
            Payload::Source(range) => &source[range.clone()],
            Payload::Owned(buf) => buf.payload(),
        }
    }
}

/// The piece of a planned write that belongs to one volume block.
struct Part {
    /// The volume block and the index of this part's first sector in it.
    block: u64,
    first_sector: usize,
    offset: u64,
    /// This part's sectors: indices into the write's `crcs`.
    sectors: std::ops::Range<usize>,
    /// Set for a newly allocated block: its logical block number.
    new_block: Option<u64>,
}

impl PlannedWrite {
    fn release_new_slots(&self, pool: &Pool) {
        for part in &self.parts {
            if part.new_block.is_some() {
                pool.release_unused(self.device, part.offset);
            }
        }
    }

    /// Adds the piece of one block that starts where this write ends on
    /// the device, if both are consecutive ranges of the request's buffer
    /// (an aligned request over blocks laid out in order: the usual case,
    /// one write and no merge afterwards). Returns the piece otherwise.
    fn extend(&mut self, piece: Piece, crcs: &CrcSource<'_>) -> Option<Piece> {
        let next = match (&mut self.data, &piece.data) {
            (Payload::Source(range), Payload::Source(next))
                if piece.device == self.device
                    && self.offset + range.len() as u64 == piece.offset
                    && range.end == next.start =>
            {
                range.end = next.end;
                next.clone()
            }
            _ => return Some(piece),
        };
        let start = self.crcs.len();
        crcs.extend(&mut self.crcs, next);
        self.parts.push(Part {
            block: piece.block,
            first_sector: piece.first_sector,
            offset: piece.offset,
            sectors: start..self.crcs.len(),
            new_block: piece.new_block.then_some(piece.block),
        });
        None
    }

    fn start(piece: Piece, crcs: &CrcSource<'_>) -> Self {
        let mut sums = Vec::new();
        match &piece.data {
            Payload::Source(range) => crcs.extend(&mut sums, range.clone()),
            Payload::Owned(buf) => sums = sector_crcs(buf.payload()),
        }
        PlannedWrite {
            device: piece.device,
            offset: piece.offset,
            parts: vec![Part {
                block: piece.block,
                first_sector: piece.first_sector,
                offset: piece.offset,
                sectors: 0..sums.len(),
                new_block: piece.new_block.then_some(piece.block),
            }],
            crcs: sums,
            data: piece.data,
        }
    }
}

/// What one volume block of a request needs written (whole sectors).
struct Piece {
    device: u8,
    offset: u64,
    data: Payload,
    block: u64,
    first_sector: usize,
    new_block: bool,
}

/// The sector checksums of ranges of a request's payload: the ones
/// computed as it arrived ([`IoBuf::piece_crcs`]) where they line up with
/// the range, else computed now.
struct CrcSource<'a> {
    payload: &'a [u8],
    pieces: Option<&'a [u32]>,
}

// The checksums a frontend computes as a payload arrives are sector checksums.
const _: () = assert!(SECTOR_BYTES as usize == crate::device::PIECE_BYTES);

impl CrcSource<'_> {
    /// Appends the checksums of the payload's `range` (whole sectors).
    fn extend(&self, out: &mut Vec<u32>, range: std::ops::Range<usize>) {
        let sector = SECTOR_BYTES as usize;
        if let Some(pieces) = self.pieces {
            let (first, count) = (range.start / sector, range.len() / sector);
            if range.start.is_multiple_of(sector) && range.len().is_multiple_of(sector) && first + count <= pieces.len()
            {
                out.extend_from_slice(&pieces[first..first + count]);
                return;
            }
        }
        crate::checksum::extend_sector_sums(&self.payload[range], out);
    }
}

/// Merges writes that are still contiguous on one device after planning
/// (a block that needed a buffer of its own next to others) into one
/// device write, copying each run into one buffer.
fn coalesce(planned: Vec<PlannedWrite>, source: &[u8]) -> Vec<PlannedWrite> {
    let mut runs: Vec<Vec<PlannedWrite>> = Vec::new();
    for write in planned {
        match runs.last_mut() {
            Some(run)
                if run.last().is_some_and(|last| {
                    last.device == write.device && last.offset + last.data.len() as u64 == write.offset
                }) =>
            {
                run.push(write)
            }
            _ => runs.push(vec![write]),
        }
    }
    runs.into_iter()
        .map(|run| {
            if run.len() == 1 {
                return run.into_iter().next().expect("one write");
            }
            let total: usize = run.iter().map(|write| write.data.len()).sum();
            let mut data = IoBuf::new(total);
            let mut merged = PlannedWrite {
                device: run[0].device,
                offset: run[0].offset,
                data: Payload::Owned(IoBuf::new(0)),
                crcs: Vec::with_capacity(total / SECTOR_BYTES as usize),
                parts: Vec::new(),
            };
            let mut at = 0;
            for write in run {
                let bytes = write.data.bytes(source);
                data.payload_mut()[at..at + bytes.len()].copy_from_slice(bytes);
                at += bytes.len();
                let shift = merged.crcs.len();
                merged.crcs.extend_from_slice(&write.crcs);
                merged.parts.extend(write.parts.into_iter().map(|mut part| {
                    part.sectors = part.sectors.start + shift..part.sectors.end + shift;
                    part
                }));
            }
            merged.data = Payload::Owned(data);
            merged
        })
        .collect()
}

fn io_error(error: DeviceError) -> BlockError {
    if error.is_no_space() {
        BlockError::NoSpace
    } else {
        BlockError::Io(std::io::Error::other(error.to_string()))
    }
}

fn meta_error(error: String) -> BlockError {
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
/// random 4 KiB write) take the first free slot as before, so they do not
/// scatter over every chunk of the pool.
const FRESH_CHUNK_MIN_BLOCKS: u64 = 4;

/// Writes of this size or more bypass the write-back cache.
const WRITE_AROUND_BYTES: usize = 128 << 10;

fn sector_crcs(bytes: &[u8]) -> Vec<u32> {
    let mut sums = Vec::with_capacity(bytes.len() / SECTOR_BYTES as usize);
    crate::checksum::extend_sector_sums(bytes, &mut sums);
    sums
}

impl EngineVolume {
    pub(crate) fn new(pool: Arc<Pool>, id: u32, size_bytes: u64, volblocksize: u32, mapped_blocks: u64) -> Self {
        let cache = pool.cache.volume(id);
        cache.lock().block_bytes = volblocksize as u64;
        EngineVolume {
            id,
            size_bytes: AtomicU64::new(size_bytes),
            block_shift: volblocksize.trailing_zeros(),
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
            mapped_blocks: AtomicU64::new(mapped_blocks),
            cache,
            log_throughput: AtomicBool::new(false),
            pool,
        }
    }

    /// The block-map entry of logical block `block` (see `pool::map_entry`).
    pub fn lookup_entry(&self, block: u64) -> Result<u64, String> {
        self.pool.lookup(self.id, block)
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

    /// The engine's own check of what the `Volume` validated (in range,
    /// sector aligned): a request that gets here otherwise is a bug above,
    /// and is stopped before it can touch another volume's blocks.
    fn assert_in_range(&self, offset: u64, length: u64) {
        let size = self.size_bytes.load(Ordering::Acquire);
        let sector = crate::volume::SECTOR_BYTES as u64;
        assert!(
            offset.checked_add(length).is_some_and(|end| end <= size)
                && offset.is_multiple_of(sector)
                && length.is_multiple_of(sector),
            "volume {}: request at {offset} +{length} is outside the volume ({size} bytes) or not sector aligned",
            self.id
        );
    }

    fn block_bytes(&self) -> u64 {
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
    /// locks 64 stripes, so awaiting every one made the second or third
    /// request in a poll yield and be spawned although nothing was held.
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

    /// Checks the sectors of `data` read from `device` at `offset`. A mismatch
    /// in a chunk that is suspect after a crash is repaired from the data.
    /// `holding_gate`: the caller already holds the pool's write gate.
    async fn verify(&self, device: u8, offset: u64, data: &[u8], logical: u64, holding_gate: bool) -> BlockResult<()> {
        let stored = self
            .pool
            .crcs(device, offset, data.len() / SECTOR_BYTES as usize)
            .map_err(meta_error)?;
        let actuals = sector_crcs(data);
        for (index, (&actual, &expected)) in actuals.iter().zip(&stored).enumerate() {
            let at = offset + index as u64 * SECTOR_BYTES;
            if actual == expected {
                continue;
            }
            let counters = &self.pool.devices[device as usize].counters;
            if self.pool.is_suspect(device, at) {
                // The checkpoint's snapshot must not race this page change.
                let _gate = if holding_gate {
                    None
                } else {
                    Some(self.pool.enter_write().await)
                };
                self.pool.set_crc(device, at, actual).map_err(meta_error)?;
                counters.repaired_after_crash.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                "volume {}: checksum mismatch at device {} offset {} (volume offset {})",
                self.id,
                self.pool.devices[device as usize].device.info().name,
                at,
                logical + index as u64 * SECTOR_BYTES
            );
            return Err(BlockError::Checksum {
                offset: logical + index as u64 * SECTOR_BYTES,
            });
        }
        Ok(())
    }

    /// Reads whole sectors into `dst` straight from `device`'s memory, their
    /// checksums summed in the same pass (a cached, mapped file: see
    /// `device::mapped`), for reads of at least [`SUMMED_READ_MIN_BYTES`].
    /// `true` if done and every sum matched the stored one. Anything else —
    /// pages not cached, a device that cannot, a mismatch — is `false`, and
    /// the caller reads and verifies the usual way, which alone repairs
    /// suspect sectors and reports and counts errors.
    fn read_summed_now(&self, device: u8, physical: u64, dst: &mut [u8]) -> bool {
        const _: () = assert!(SECTOR_BYTES as usize == crate::checksum::SUM_SECTOR_BYTES);
        if dst.len() < SUMMED_READ_MIN_BYTES {
            return false;
        }
        let sectors = dst.len() / SECTOR_BYTES as usize;
        let mut sums = vec![0u32; sectors];
        if !self.pool.devices[device as usize]
            .device
            .read_now_summed(physical, dst, &mut sums)
        {
            return false;
        }
        matches!(self.pool.crcs(device, physical, sectors), Ok(stored) if stored == sums)
    }

    /// Reads whole sectors `[offset, offset + length)` from a device and verifies them.
    async fn read_sectors(
        &self,
        device: u8,
        offset: u64,
        length: u64,
        logical: u64,
        holding_gate: bool,
    ) -> BlockResult<IoBuf> {
        debug_assert!(offset.is_multiple_of(SECTOR_BYTES) && length.is_multiple_of(SECTOR_BYTES));
        let pool_device = &self.pool.devices[device as usize];
        let (buf, result) = pool_device.device.read(offset, IoBuf::new(length as usize)).await;
        if let Err(e) = result {
            pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
            return Err(io_error(e));
        }
        self.verify(device, offset, buf.payload(), logical, holding_gate)
            .await?;
        Ok(buf)
    }

    async fn read_impl(&self, offset: u64, buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        let _guards = self.lock_shared(offset, buf.len() as u64).await;
        self.read_unlocked(offset, buf).await
    }

    /// Reads through the cache (caller holds the stripe locks): sectors the
    /// cache holds come from RAM, the rest from the devices.
    async fn read_unlocked(&self, offset: u64, buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        let length = buf.len() as u64;
        let first = offset / SECTOR_BYTES;
        let last = (offset + length - 1) / SECTOR_BYTES;
        let cached = self.cache.lock().entries.range(first..=last).count() as u64;
        if cached == 0 {
            return self.read_clean(offset, buf).await;
        }
        let (mut buf, result) = if cached == last - first + 1 {
            (buf, Ok(()))
        } else {
            self.read_disk(offset, buf).await
        };
        if result.is_ok() {
            self.pool.cache.overlay(&self.cache, offset, buf.payload_mut());
        }
        (buf, result)
    }

    /// Reads sectors nobody has dirty in RAM: from the read cache when it
    /// has them all, else from the devices (small aligned reads then fill
    /// the read cache; large ones, mostly scans, do not).
    async fn read_clean(&self, offset: u64, mut buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        let cache = &self.pool.read_cache;
        let length = buf.len() as u64;
        let cacheable = !cache.is_disabled()
            && offset.is_multiple_of(SECTOR_BYTES)
            && length.is_multiple_of(SECTOR_BYTES)
            && length <= READ_CACHE_MAX_REQUEST;
        if !cacheable {
            return self.read_disk(offset, buf).await;
        }
        let first = offset / SECTOR_BYTES;
        let all_hit = buf
            .payload_mut()
            .chunks_mut(SECTOR_BYTES as usize)
            .enumerate()
            .all(|(i, dst)| cache.get_into(self.id, first + i as u64, dst));
        if all_hit {
            return (buf, Ok(()));
        }
        let (buf, result) = self.read_disk(offset, buf).await;
        if result.is_ok() {
            for (i, sector) in buf.payload().chunks(SECTOR_BYTES as usize).enumerate() {
                cache.offer(self.id, first + i as u64, sector);
            }
        }
        (buf, result)
    }

    async fn read_disk(&self, offset: u64, mut buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        let length = buf.len() as u64;
        if length == 0 {
            return (buf, Ok(()));
        }
        // (device, physical offset, length, position in buf)
        let mut segments: Vec<(u8, u64, u64, u64)> = Vec::new();
        let mut position = offset;
        let end = offset + length;
        let first = offset >> self.block_shift;
        let entries = match self.pool.lookup_range(self.id, first, (end - 1) >> self.block_shift) {
            Ok(entries) => entries,
            Err(e) => return (buf, Err(meta_error(e))),
        };
        while position < end {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let entry = entries[(block - first) as usize];
            let at = position - offset;
            match map_entry::decode(entry) {
                None => buf.payload_mut()[at as usize..(at + step) as usize].fill(0),
                Some((device, base)) => {
                    let physical = base + within;
                    match segments.last_mut() {
                        Some(last) if last.0 == device && last.1 + last.2 == physical && last.3 + last.2 == at => {
                            last.2 += step
                        }
                        _ => segments.push((device, physical, step, at)),
                    }
                }
            }
            position += step;
        }
        // Fast path: one sector-aligned run covering the whole request is
        // read straight into the caller's buffer.
        if let [(device, physical, run, 0)] = segments[..] {
            if run == length && physical % SECTOR_BYTES == 0 && run % SECTOR_BYTES == 0 {
                if self.read_summed_now(device, physical, buf.payload_mut()) {
                    return (buf, Ok(()));
                }
                let pool_device = &self.pool.devices[device as usize];
                let (buf, result) = pool_device.device.read(physical, buf).await;
                if let Err(e) = result {
                    pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                    return (buf, Err(io_error(e)));
                }
                let verified = self.verify(device, physical, buf.payload(), offset, false).await;
                return (buf, verified);
            }
        }
        for (device, physical, run, at) in segments {
            if physical % SECTOR_BYTES == 0 && run % SECTOR_BYTES == 0 {
                // Whole sectors: straight into their place in `buf` when the
                // device has them in memory.
                let pool_device = &self.pool.devices[device as usize];
                let dst = &mut buf.payload_mut()[at as usize..(at + run) as usize];
                if self.read_summed_now(device, physical, dst) {
                    continue;
                }
                match pool_device.device.read_now(physical, dst) {
                    Some(Ok(())) => {
                        let data = &buf.payload()[at as usize..(at + run) as usize];
                        if let Err(e) = self.verify(device, physical, data, offset + at, false).await {
                            return (buf, Err(e));
                        }
                        continue;
                    }
                    Some(Err(e)) => {
                        pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                        return (buf, Err(io_error(e)));
                    }
                    None => {}
                }
            }
            let start = physical / SECTOR_BYTES * SECTOR_BYTES;
            let stop = (physical + run).div_ceil(SECTOR_BYTES) * SECTOR_BYTES;
            let logical = offset + at - (physical - start);
            let cover = match self.read_sectors(device, start, stop - start, logical, false).await {
                Ok(cover) => cover,
                Err(e) => return (buf, Err(e)),
            };
            let skip = (physical - start) as usize;
            buf.payload_mut()[at as usize..(at + run) as usize]
                .copy_from_slice(&cover.payload()[skip..skip + run as usize]);
        }
        (buf, Ok(()))
    }

    /// Where the first new block of a write of `blocks` blocks at `offset`
    /// should go: after the logical block before it, else before the one
    /// after it, else (a write of several blocks with neither neighbour
    /// written) a fresh chunk at the matching place.
    fn first_hint(&self, offset: u64, blocks: u64) -> BlockResult<Option<Hint>> {
        let first = offset >> self.block_shift;
        if first > 0 {
            if let Some((device, base)) = map_entry::decode(self.pool.lookup(self.id, first - 1).map_err(meta_error)?) {
                return Ok(Some(Hint::At(device, base + self.block_bytes())));
            }
        }
        let after = first + blocks;
        if after < self.size_bytes().div_ceil(self.block_bytes()) {
            if let Some((device, base)) = map_entry::decode(self.pool.lookup(self.id, after).map_err(meta_error)?) {
                if let Some(start) = base.checked_sub(blocks * self.block_bytes()) {
                    return Ok(Some(Hint::At(device, start)));
                }
            }
        }
        Ok((blocks >= FRESH_CHUNK_MIN_BLOCKS).then_some(Hint::FreshChunk { logical_slot: first }))
    }

    /// Plans the device writes that store `data` at volume `offset`. Caller
    /// holds the stripe locks and the pool's write gate.
    async fn plan(
        &self,
        offset: u64,
        data: &[u8],
        pieces: Option<&[u32]>,
        entries: &[u64],
    ) -> BlockResult<Vec<PlannedWrite>> {
        let crcs = CrcSource { payload: data, pieces };
        let mut planned: Vec<PlannedWrite> = Vec::new();
        let mut position = offset;
        let end = offset + data.len() as u64;
        let mut index = 0;
        // A new block goes right after the previous logical block's slot if
        // that is free: a volume written front to back is laid out front to
        // back, and a large request later is one device run, not many.
        // Every block sets the hint for the next, so it is missing only at
        // the request's first block, and looked up only if that is new.
        let mut hint = None;
        while position < end {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let at = (position - offset) as usize;
            let source = &data[at..at + step as usize];
            let piece = match map_entry::decode(entries[index]) {
                Some((device, base)) => {
                    // Overwrite in place, widened to whole sectors.
                    let start = within / SECTOR_BYTES * SECTOR_BYTES;
                    let stop = (within + step).div_ceil(SECTOR_BYTES) * SECTOR_BYTES;
                    let sectors = if start == within && stop == within + step {
                        Payload::Source(at..at + step as usize)
                    } else {
                        let logical = (block << self.block_shift) + start;
                        let mut sectors = match self
                            .read_sectors(device, base + start, stop - start, logical, true)
                            .await
                        {
                            Ok(sectors) => sectors,
                            Err(e) => {
                                for write in &planned {
                                    write.release_new_slots(&self.pool);
                                }
                                return Err(e);
                            }
                        };
                        let skip = (within - start) as usize;
                        sectors.payload_mut()[skip..skip + source.len()].copy_from_slice(source);
                        Payload::Owned(sectors)
                    };
                    hint = Some(Hint::At(device, base + self.block_bytes()));
                    Piece {
                        device,
                        offset: base + start,
                        data: sectors,
                        block,
                        first_sector: (start / SECTOR_BYTES) as usize,
                        new_block: false,
                    }
                }
                None => {
                    // First write: allocate and write the whole block.
                    if hint.is_none() {
                        hint = self.first_hint(offset, entries.len() as u64)?;
                    }
                    let Some((device, base)) = self.pool.allocate_near(self.block_shift as u8, hint) else {
                        for write in &planned {
                            write.release_new_slots(&self.pool);
                        }
                        return Err(BlockError::NoSpace);
                    };
                    let whole = if step == self.block_bytes() {
                        Payload::Source(at..at + step as usize)
                    } else {
                        let mut whole = IoBuf::new(self.block_bytes() as usize);
                        whole.payload_mut()[within as usize..(within + step) as usize].copy_from_slice(source);
                        Payload::Owned(whole)
                    };
                    hint = Some(Hint::At(device, base + self.block_bytes()));
                    Piece {
                        device,
                        offset: base,
                        data: whole,
                        block,
                        first_sector: 0,
                        new_block: true,
                    }
                }
            };
            let piece = match planned.last_mut() {
                Some(last) => last.extend(piece, &crcs),
                None => Some(piece),
            };
            if let Some(piece) = piece {
                planned.push(PlannedWrite::start(piece, &crcs));
            }
            position += step;
            index += 1;
        }
        Ok(coalesce(planned, data))
    }

    /// Writes `data` at `offset` (caller holds the stripe locks).
    async fn write_locked(&self, offset: u64, data: IoBuf) -> BlockResult<()> {
        self.invalidate_read_cache(offset, data.len() as u64);
        let first = offset >> self.block_shift;
        let last = (offset + data.len() as u64 - 1) >> self.block_shift;
        let entries = self.pool.lookup_range(self.id, first, last).map_err(meta_error)?;
        let places: Vec<(u8, u64)> = entries.iter().filter_map(|e| map_entry::decode(*e)).collect();
        // The chunks we overwrite must be durably marked dirty first; the
        // mark belongs to an epoch, so re-check after entering the gate.
        let gate = loop {
            let epoch = self.pool.mark_dirty(&places).await.map_err(pool_error)?;
            let gate = self.pool.enter_write().await;
            if self.pool.epoch() == epoch {
                break gate;
            }
        };
        let planned = self.plan(offset, data.payload(), data.piece_crcs(), &entries).await?;
        // New blocks land in chunks that may hold mapped data of other
        // blocks; their records carry checksums, so no mark is needed.
        let mut failure = None;
        let mut done = Vec::with_capacity(planned.len());
        // The request's buffer goes to the device itself when one write
        // covers all of it (the usual case); else ranges of it are copied.
        let mut source = Some(data);
        for mut write in planned {
            if failure.is_some() {
                write.release_new_slots(&self.pool);
                continue;
            }
            let pool_device = &self.pool.devices[write.device as usize];
            let whole_source = source.as_ref().is_some_and(|buf| match &write.data {
                Payload::Source(range) => range.start == 0 && range.end == buf.len(),
                Payload::Owned(_) => false,
            });
            let payload = std::mem::replace(&mut write.data, Payload::Source(0..0));
            // A part of the request's buffer: written from it in place if
            // the device takes borrowed memory, else from a copy.
            let in_place = match &payload {
                Payload::Source(range) if !whole_source => {
                    let bytes = &source.as_ref().expect("the request's buffer").payload()[range.clone()];
                    pool_device
                        .device
                        .write_now(write.offset, bytes)
                        .map(|result| (result, bytes.len() as u64))
                }
                _ => None,
            };
            let (result, length) = match in_place {
                Some(done) => done,
                None => {
                    let buffer = match payload {
                        _ if whole_source => source.take().expect("the request's buffer"),
                        Payload::Source(range) => {
                            IoBuf::copy_from(&source.as_ref().expect("the request's buffer").payload()[range])
                        }
                        Payload::Owned(buf) => buf,
                    };
                    let (buffer, result) = pool_device.device.write(write.offset, buffer).await;
                    let length = buffer.len() as u64;
                    if whole_source {
                        source = Some(buffer);
                    }
                    (result, length)
                }
            };
            match result {
                Ok(()) => {
                    self.pool.note_data_write();
                    self.pool.data_bytes.fetch_add(length, Ordering::Relaxed);
                    done.push(write)
                }
                Err(e) => {
                    pool_device.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                    write.release_new_slots(&self.pool);
                    failure = Some(io_error(e));
                }
            }
        }
        // Whatever reached the device is accounted for, even if a later part
        // failed. If the metadata cannot take a write (a map or crc page
        // that cannot be loaded), the new slots not mapped yet are given
        // back: written, but referenced by nothing.
        let mut done = done.into_iter();
        for write in done.by_ref() {
            if let Err(e) = self.account_write(&write) {
                failure = Some(meta_error(e));
                break;
            }
        }
        for write in done {
            write.release_new_slots(&self.pool);
        }
        drop(gate);
        self.pool.maybe_checkpoint_soon();
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records one completed device write: its sectors' checksums, then a
    /// map entry and log record for each block it newly placed. On an error
    /// the new blocks not mapped yet are given back to the allocator.
    fn account_write(&self, write: &PlannedWrite) -> Result<(), String> {
        if let Err(e) = self.pool.set_crcs(write.device, write.offset, &write.crcs) {
            write.release_new_slots(&self.pool);
            return Err(e);
        }
        let overwrites = write.parts.iter().filter(|part| part.new_block.is_none());
        self.pool.note_overwrites(
            self.id,
            overwrites.map(|part| (part.block, part.first_sector, &write.crcs[part.sectors.clone()])),
        );
        for (index, part) in write.parts.iter().enumerate() {
            let Some(block) = part.new_block else { continue };
            let entry = map_entry::encode(write.device, part.offset);
            if let Err(e) = self.pool.set_mapping(self.id, block, entry) {
                for unmapped in &write.parts[index..] {
                    if unmapped.new_block.is_some() {
                        self.pool.release_unused(write.device, unmapped.offset);
                    }
                }
                return Err(e);
            }
            self.mapped_blocks.fetch_add(1, Ordering::Relaxed);
            self.pool.log_mapping(Record::Map {
                volume: self.id,
                block,
                new: entry,
                old: 0,
                crcs: write.crcs[part.sectors.clone()].to_vec(),
            });
        }
        Ok(())
    }

    /// Unmaps whole blocks and zeroes partial ones in `[offset, offset + length)`.
    async fn trim_locked(&self, offset: u64, length: u64) -> BlockResult<()> {
        let end = offset + length;
        let mut position = offset;
        while position < end {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let entry = self.pool.lookup(self.id, block).map_err(meta_error)?;
            if entry & map_entry::VALID != 0 {
                if step == self.block_bytes() {
                    self.invalidate_read_cache(position, step);
                    let _gate = self.pool.enter_write().await;
                    self.pool.set_mapping(self.id, block, 0).map_err(meta_error)?;
                    self.mapped_blocks.fetch_sub(1, Ordering::Relaxed);
                    self.pool.log_mapping(Record::Map {
                        volume: self.id,
                        block,
                        new: 0,
                        old: entry,
                        crcs: Vec::new(),
                    });
                } else {
                    self.write_locked(position, IoBuf::new(step as usize)).await?;
                }
            }
            position += step;
        }
        self.pool.maybe_checkpoint_soon();
        Ok(())
    }

    /// Writes zeros without deallocating (WRITE_ZEROES with NO_HOLE).
    async fn zero_locked(&self, offset: u64, length: u64) -> BlockResult<()> {
        let end = offset + length;
        let mut position = offset;
        while position < end {
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            self.write_locked(position, IoBuf::new(step as usize)).await?;
            position += step;
        }
        Ok(())
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

    async fn lock_blocks_exclusive(&self, blocks: &[u64]) -> Vec<RwLockWriteGuard<'_, ()>> {
        self.write_stripes(stripes_of(blocks)).await
    }

    /// Blocks (sorted) holding cached sectors that match `filter`, at most `limit`.
    pub(crate) fn cached_blocks(&self, filter: impl Fn(&Entry) -> bool, limit: usize) -> Vec<u64> {
        let per_block = self.sectors_per_block();
        let state = self.cache.lock();
        let mut blocks: Vec<u64> = Vec::new();
        for (sector, entry) in state.entries.iter() {
            if blocks.len() >= limit {
                break;
            }
            let block = sector / per_block;
            if blocks.last() != Some(&block) && filter(entry) {
                blocks.push(block);
            }
        }
        blocks
    }

    /// Blocks of `[offset, offset + length)` holding cached sectors.
    fn cached_blocks_in(&self, offset: u64, length: u64) -> Vec<u64> {
        let per_block = self.sectors_per_block();
        let first = offset / SECTOR_BYTES;
        let last = (offset + length.max(1) - 1) / SECTOR_BYTES;
        let mut blocks: Vec<u64> = self
            .cache
            .lock()
            .entries
            .range(first..=last)
            .map(|(sector, _)| sector / per_block)
            .collect();
        blocks.dedup();
        blocks
    }

    /// Writes the cached sectors of `blocks` (sorted) to their place, commits
    /// (so they are durable and their log records superseded), then drops
    /// the entries nobody rewrote meanwhile.
    pub(crate) async fn destage_blocks(&self, blocks: &[u64]) -> BlockResult<()> {
        let per_block = self.sectors_per_block();
        let guards = self.lock_blocks_exclusive(blocks).await;
        let snap_lsn = self.pool.log.next_lsn();
        let snapshot: Vec<(u64, Entry)> = {
            let state = self.cache.lock();
            blocks
                .iter()
                .flat_map(|block| {
                    state
                        .entries
                        .range(block * per_block..(block + 1) * per_block)
                        .map(|(s, e)| (*s, *e))
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        if snapshot.is_empty() {
            return Ok(());
        }
        let appends = self.pool.log_appends();
        // Contiguous runs of sectors become one write each.
        let mut start = 0;
        while start < snapshot.len() {
            let mut stop = start + 1;
            while stop < snapshot.len() && snapshot[stop].0 == snapshot[stop - 1].0 + 1 {
                stop += 1;
            }
            let mut buf = IoBuf::new((stop - start) * SECTOR_BYTES as usize);
            for (i, (_, entry)) in snapshot[start..stop].iter().enumerate() {
                let at = i * SECTOR_BYTES as usize;
                let dst = &mut buf.payload_mut()[at..at + SECTOR_BYTES as usize];
                // SAFETY: the exclusive block locks held here keep these
                // entries' slots from being rewritten or released.
                unsafe { self.pool.cache.ram.read(entry.slot, 0, dst) };
            }
            self.write_locked(snapshot[start].0 * SECTOR_BYTES, buf).await?;
            start = stop;
        }
        // Older Data records of these blocks are superseded once this is
        // committed (after the data devices are flushed).
        let mut written = Vec::new();
        let mut last_block = None;
        for (sector, entry) in &snapshot {
            let block = sector / per_block;
            if entry.logged_at != 0 && last_block != Some(block) {
                written.push(Record::Written {
                    volume: self.id,
                    first_sector: block * per_block,
                    count: per_block as u32,
                });
                last_block = Some(block);
            }
        }
        let written_records = !written.is_empty();
        if written_records {
            self.pool.log.append_all(written);
        }
        let released = {
            let mut state = self.cache.lock();
            let before = state.reserved.len();
            for block in blocks {
                state.reserved.remove(block);
            }
            before - state.reserved.len()
        };
        self.pool.unreserve(released as u64 * self.block_bytes());
        drop(guards);
        if written_records || self.pool.log_appends() != appends {
            // Written records supersede Data records only once the data is
            // durable in place, and new mappings (Map records) must not be
            // left staged: a staged mapping is replayed only if the data it
            // maps still matches it, which a later overwrite in place breaks.
            // Commit (data devices flushed first). The destager flushes
            // them itself, before the commit: the commit does it under the
            // log's commit lock, where synchronous writers would queue behind
            // a flush of everything this pass wrote.
            self.pool.flush_data_devices().await.map_err(io_error)?;
            self.pool.commit_quiet().await.map_err(pool_error)?;
        }
        // Otherwise only never-logged sectors of mapped blocks were written
        // in place: no record, no durability promised yet, nothing to
        // commit (the next FLUSH or commit flushes the data devices).
        self.pool
            .cache
            .destaged_bytes
            .fetch_add(snapshot.len() as u64 * SECTOR_BYTES, Ordering::Relaxed);
        let guards = self.lock_blocks_exclusive(blocks).await;
        let mut freed = Vec::new();
        {
            let now = std::time::Instant::now();
            let mut state = self.cache.lock();
            for (sector, entry) in &snapshot {
                let Some(current) = state.entries.get_mut(sector) else {
                    continue;
                };
                if current.seq == entry.seq {
                    freed.push(current.slot);
                    state.entries.remove(sector);
                } else {
                    // Rewritten meanwhile: what it logged before is superseded.
                    if current.logged_at == entry.logged_at {
                        current.logged_at = 0;
                    } else if current.logged_at != 0 {
                        current.log_lsn = current.log_lsn.max(snap_lsn);
                    }
                    current.since = now;
                }
            }
        }
        drop(guards);
        for slot in freed {
            // SAFETY: the entries that referred to these slots were removed
            // above under the exclusive block locks; no reader holds them.
            unsafe { self.pool.cache.ram.release(slot) };
        }
        self.pool.cache.space.notify_waiters();
        Ok(())
    }

    /// Destages every cached block of a range (before it is trimmed, zeroed
    /// or written around the cache) and returns its locks with no cached
    /// sector left in it.
    async fn clear_cached(&self, offset: u64, length: u64) -> BlockResult<Vec<RwLockWriteGuard<'_, ()>>> {
        loop {
            let blocks = self.cached_blocks_in(offset, length);
            for batch in blocks.chunks(512) {
                self.destage_blocks(batch).await?;
            }
            let guards = self.lock_exclusive(offset, length).await;
            if self.cached_blocks_in(offset, length).is_empty() {
                return Ok(guards);
            }
        }
    }

    /// A write through the cache. `durable`: acknowledged only once durable
    /// (logged, or written in place with `logbias=throughput`).
    async fn write_cached(&self, offset: u64, data: IoBuf, durable: bool) -> BlockResult<()> {
        let length = data.len() as u64;
        let end = offset + length;
        let first = offset / SECTOR_BYTES;
        let last = (end - 1) / SECTOR_BYTES;
        let count = (last - first + 1) as usize;
        // Large writes go to their place directly (like ZFS's immediate
        // writes): copying them through RAM and the log costs more than it
        // saves. So do all plain writes while the RAM tier is more than half
        // dirty: the destager is behind, and making writers wait for it
        // would be slower than writing through.
        let ram = &self.pool.cache.ram;
        if count * SECTOR_BYTES as usize >= WRITE_AROUND_BYTES
            || count > ram.total_slots() / 4
            || (!durable && ram.free_slots() < ram.total_slots() / 2)
        {
            return self.write_through(offset, data, durable).await;
        }
        // Space for blocks that are not mapped yet is promised before the
        // write is accepted, so the destage cannot run out of it later. When
        // the pool is full but trims or overwrites have freed slots that only
        // a commit makes reusable, commit once and try again.
        let mut committed_for_space = false;
        let (slots, guards, reserved) = loop {
            let slots = loop {
                self.pool.make_room(count).await.map_err(pool_error)?;
                if let Some(slots) = self.pool.cache.ram.allocate(count) {
                    break slots;
                }
            };
            let guards = self.lock_exclusive(offset, length).await;
            match self.reserve_unmapped(offset, end) {
                Ok(reserved) => break (slots, guards, reserved),
                Err(e) => {
                    self.pool.cache.ram.give_back(&slots);
                    drop(guards);
                    if matches!(e, BlockError::NoSpace) && !committed_for_space && self.pool.log.has_pending_frees() {
                        committed_for_space = true;
                        self.pool.commit_quiet().await.map_err(pool_error)?;
                        continue;
                    }
                    return Err(e);
                }
            }
        };
        let images = if offset.is_multiple_of(SECTOR_BYTES) && end.is_multiple_of(SECTOR_BYTES) {
            data
        } else {
            // Partial sectors: merge with what the volume holds now.
            let (mut cover, result) = self
                .read_unlocked(first * SECTOR_BYTES, IoBuf::new(count * SECTOR_BYTES as usize))
                .await;
            if let Err(e) = result {
                self.pool.cache.ram.give_back(&slots);
                self.unreserve_blocks(&reserved);
                return Err(e);
            }
            let at = (offset - first * SECTOR_BYTES) as usize;
            cover.payload_mut()[at..at + length as usize].copy_from_slice(data.payload());
            cover
        };
        let (first_block, last_block) = (offset >> self.block_shift, (end - 1) >> self.block_shift);
        self.invalidate_read_cache(offset, length);
        let log_data = durable && !self.log_throughput.load(Ordering::Acquire);
        let gate = if log_data {
            Some(self.pool.enter_write().await)
        } else {
            None
        };
        let logged = log_data.then(|| (self.pool.cache.next_ordinal(), self.pool.log.next_lsn()));
        let crcs = self
            .pool
            .cache
            .put(self.id, &self.cache, first, images.payload(), &slots, logged);
        if log_data {
            let records = images
                .payload()
                .chunks(SECTOR_BYTES as usize)
                .zip(&crcs)
                .enumerate()
                .map(|(i, (image, crc))| Record::Data {
                    volume: self.id,
                    sector: first + i as u64,
                    crc: *crc,
                    data: Arc::from(image),
                })
                .collect();
            self.pool.log.append_all(records);
            self.pool
                .cache
                .logged_bytes
                .fetch_add(count as u64 * SECTOR_BYTES, Ordering::Relaxed);
        }
        drop(gate);
        drop(guards);
        if durable {
            if log_data {
                self.pool.commit().await.map_err(pool_error)?;
            } else {
                let blocks: Vec<u64> = (first_block..=last_block).collect();
                self.destage_blocks(&blocks).await?;
                // A destage commits only what it logged; an in-place
                // overwrite logs nothing, so make the data durable here.
                self.pool.commit().await.map_err(pool_error)?;
            }
        }
        Ok(())
    }

    /// Reserves pool space for the blocks of `[offset, end)` that are
    /// neither mapped nor reserved yet (caller holds their stripes
    /// exclusively). Returns the blocks it reserved.
    fn reserve_unmapped(&self, offset: u64, end: u64) -> BlockResult<Vec<u64>> {
        let first_block = offset >> self.block_shift;
        let last_block = (end - 1) >> self.block_shift;
        let needed: Vec<u64> = {
            let state = self.cache.lock();
            (first_block..=last_block)
                .filter(|block| !state.reserved.contains(block))
                .collect()
        };
        let mut unmapped = Vec::new();
        for block in needed {
            if self.pool.lookup(self.id, block).map_err(meta_error)? & map_entry::VALID == 0 {
                unmapped.push(block);
            }
        }
        if !unmapped.is_empty() {
            if !self.pool.reserve(unmapped.len() as u64 * self.block_bytes()) {
                return Err(BlockError::NoSpace);
            }
            self.cache.lock().reserved.extend(unmapped.iter().copied());
        }
        Ok(unmapped)
    }

    /// Gives back reservations taken for a write that then failed.
    fn unreserve_blocks(&self, blocks: &[u64]) {
        if blocks.is_empty() {
            return;
        }
        {
            let mut state = self.cache.lock();
            for block in blocks {
                state.reserved.remove(block);
            }
        }
        self.pool.unreserve(blocks.len() as u64 * self.block_bytes());
    }

    /// A write that bypasses the cache goes to its place directly.
    async fn write_through(&self, offset: u64, data: IoBuf, durable: bool) -> BlockResult<()> {
        let appends = self.pool.log_appends();
        let end = offset + data.len() as u64;
        // The blocks it will allocate are reserved first, like a cached
        // write's: space promised to cached writes is never taken. Slots
        // freed by trims are reusable only once committed: on a full pool,
        // commit them once and try again.
        let mut committed_for_space = false;
        let (guards, reserved) = loop {
            let guards = self.clear_cached(offset, data.len() as u64).await?;
            match self.reserve_unmapped(offset, end) {
                Ok(reserved) => break (guards, reserved),
                Err(BlockError::NoSpace) if !committed_for_space && self.pool.log.has_pending_frees() => {
                    drop(guards);
                    committed_for_space = true;
                    self.pool.commit_quiet().await.map_err(pool_error)?;
                }
                Err(e) => return Err(e),
            }
        };
        let result = self.write_locked(offset, data).await;
        // Allocated now (or failed): the promise is no longer needed.
        self.unreserve_blocks(&reserved);
        drop(guards);
        self.finish(result, durable, appends).await
    }

    /// FLUSH: makes every write completed before it durable. The cache's
    /// unlogged sectors go to the intent log in one group commit, or, when
    /// they are many (or `logbias=throughput`), to their place.
    async fn flush_cached(&self) -> BlockResult<()> {
        let per_block = self.sectors_per_block();
        let sectors: Vec<u64> = self
            .cache
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.unlogged)
            .map(|(s, _)| *s)
            .collect();
        if sectors.is_empty() {
            return self.pool.commit().await.map_err(pool_error);
        }
        let mut blocks: Vec<u64> = sectors.iter().map(|s| s / per_block).collect();
        blocks.dedup();
        let bytes = sectors.len() as u64 * (SECTOR_BYTES + 64);
        if self.log_throughput.load(Ordering::Acquire) || bytes > self.pool.log.room() / 2 {
            for batch in blocks.chunks(512) {
                self.destage_blocks(batch).await?;
            }
            return self.pool.commit().await.map_err(pool_error);
        }
        let guards = self.lock_blocks_shared(&blocks).await;
        let gate = self.pool.enter_write().await;
        let bound = self.pool.log.next_lsn();
        let ordinal = self.pool.cache.next_ordinal();
        let mut records = Vec::new();
        {
            let mut state = self.cache.lock();
            for sector in sectors {
                let Some(entry) = state.entries.get_mut(&sector) else {
                    continue;
                };
                if !entry.unlogged {
                    continue;
                }
                let mut data = vec![0u8; SECTOR_BYTES as usize];
                // SAFETY: the entry is in the map under its lock, which we
                // hold, and the block locks keep it from being released.
                unsafe { self.pool.cache.ram.read(entry.slot, 0, &mut data) };
                records.push(Record::Data {
                    volume: self.id,
                    sector,
                    crc: entry.crc,
                    data: Arc::from(data),
                });
                entry.unlogged = false;
                if entry.logged_at == 0 {
                    entry.log_lsn = bound;
                }
                entry.logged_at = ordinal;
            }
        }
        self.pool
            .cache
            .logged_bytes
            .fetch_add(records.len() as u64 * SECTOR_BYTES, Ordering::Relaxed);
        self.pool.log.append_all(records);
        drop(gate);
        drop(guards);
        self.pool.commit().await.map_err(pool_error)
    }

    fn extents(&self, offset: u64, length: u64) -> BlockResult<Vec<Extent>> {
        let mut extents: Vec<Extent> = Vec::new();
        let end = offset + length;
        let mut position = offset;
        while position < end && extents.len() < MAX_EXTENTS {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let sectors = self.block_bytes() / SECTOR_BYTES;
            let mapped = self.pool.lookup(self.id, block).map_err(meta_error)? & map_entry::VALID != 0
                || self
                    .cache
                    .lock()
                    .entries
                    .range(block * sectors..(block + 1) * sectors)
                    .next()
                    .is_some();
            match extents.last_mut() {
                Some(last) if last.hole != mapped => last.length += step,
                _ => extents.push(Extent {
                    length: step,
                    hole: !mapped,
                    zero: !mapped,
                }),
            }
            position += step;
        }
        Ok(extents)
    }
}

impl BlockDevice for EngineVolume {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_zero: true,
            can_fast_zero: true,
            can_cache: true,
            can_block_status: true,
            read_only: false,
            rotational: self.pool.rotational(),
            // Completed writes are durable only after a flush (device caches,
            // page cache, and the log's group commit).
            volatile_write_cache: true,
            // A flush commits the whole pool: every device and the log.
            flush_covers_all_handles: true,
            min_block_bytes: crate::volume::SECTOR_BYTES,
            preferred_block_bytes: SECTOR_BYTES as u32,
            max_request_bytes: crate::volume::MAX_REQUEST_BYTES,
        }
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, BlockResult<()>)> {
        self.assert_in_range(offset, buf.len() as u64);
        Box::pin(self.read_impl(offset, buf))
    }

    fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        self.assert_in_range(offset, data.len() as u64);
        Box::pin(self.write_cached(offset, data, fua))
    }

    fn flush(&self) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(self.flush_cached())
    }

    fn set_log_throughput(&self, throughput: bool) {
        self.log_throughput.store(throughput, Ordering::Release);
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        self.assert_in_range(offset, length);
        Box::pin(async move {
            let appends = self.pool.log_appends();
            let _guards = self.clear_cached(offset, length).await?;
            let result = self.trim_locked(offset, length).await;
            drop(_guards);
            self.finish(result, fua, appends).await
        })
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>> {
        self.assert_in_range(offset, length);
        Box::pin(async move {
            if !flags.may_trim && flags.fast_only {
                return Err(BlockError::NotFast);
            }
            let appends = self.pool.log_appends();
            let _guards = self.clear_cached(offset, length).await?;
            let result = if flags.may_trim {
                self.trim_locked(offset, length).await
            } else {
                self.zero_locked(offset, length).await
            };
            drop(_guards);
            self.finish(result, flags.fua, appends).await
        })
    }

    /// Prefetch: reads the range (up to 32 MiB of it; the rest of a larger
    /// hint is ignored), which loads its map pages and warms device caches.
    fn cache(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(async move {
            let length = length.min(crate::volume::MAX_REQUEST_BYTES as u64);
            let (_, result) = self.read_impl(offset, IoBuf::new(length as usize)).await;
            result
        })
    }

    fn block_status(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<Vec<Extent>>> {
        Box::pin(std::future::ready(self.extents(offset, length)))
    }

    fn resize(&self, new_size_bytes: u64) -> BlockResult<()> {
        self.size_bytes.store(new_size_bytes, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::pool::superblock::Role;
    use crate::pool::NewDevice;
    use crate::volume::BlockDevice;

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

    #[test]
    fn crc_source_takes_the_arrived_checksums_only_where_they_line_up() {
        let sector = SECTOR_BYTES as usize;
        let payload: Vec<u8> = (0..6 * sector as u32).map(|i| (i % 241) as u8).collect();
        let pieces = sector_crcs(&payload);
        let sums = |pieces: Option<&[u32]>, range: std::ops::Range<usize>| {
            let mut out = vec![7];
            CrcSource {
                payload: &payload,
                pieces,
            }
            .extend(&mut out, range);
            assert_eq!(out.remove(0), 7, "appended, not replaced");
            out
        };
        // Sectors 2..5 of the payload: the arrived ones, identical to computing them.
        assert_eq!(sums(Some(&pieces), 2 * sector..5 * sector), pieces[2..5].to_vec());
        // Pieces that were tampered with show that they are the ones used...
        let mut marked = pieces.clone();
        marked[3] ^= 1;
        assert_eq!(sums(Some(&marked), 2 * sector..5 * sector)[1], pieces[3] ^ 1);
        // ...and where they do not line up (a range that starts inside a
        // sector, or pieces that run out), the checksums are computed.
        let odd = 100..100 + 2 * sector;
        assert_eq!(sums(Some(&marked), odd.clone()), sector_crcs(&payload[odd]));
        assert_eq!(sums(Some(&marked[..4]), 2 * sector..5 * sector), pieces[2..5].to_vec());
        assert_eq!(sums(None, 2 * sector..5 * sector), pieces[2..5].to_vec());
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
    fn megabyte_requests_run_to_the_end_in_one_poll_when_nothing_is_held() {
        // The NBD reader polls each request once in its own task and spawns
        // it only if it waits. A 1 MiB request locks 64 stripes; awaiting
        // each tokio lock spent the task's cooperative budget (128 per
        // poll), so the second or third request of a poll yielded although
        // nothing was held, and was spawned (a task and a woken worker each).
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
            let one_by_one: Vec<u64> = (0..blocks).map(|b| pool.lookup(1, b).unwrap()).collect();
            assert!(one_by_one.iter().filter(|&&e| e != 0).count() as u64 == blocks.div_ceil(7));
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
    fn coalesce_copies_each_contiguous_run_once_and_keeps_every_parts_checksums() {
        let sector = SECTOR_BYTES as usize;
        let source: Vec<u8> = (0..8 * sector as u32).map(|i| (i % 251) as u8).collect();
        let owned = |byte: u8, sectors: usize| IoBuf::copy_from(&vec![byte; sectors * sector]);
        let write = |offset: u64, data: Payload, block: u64| {
            let crcs = sector_crcs(data.bytes(&source));
            PlannedWrite {
                device: 0,
                offset,
                parts: vec![Part {
                    block,
                    first_sector: 0,
                    offset,
                    sectors: 0..crcs.len(),
                    new_block: None,
                }],
                crcs,
                data,
            }
        };
        let s = SECTOR_BYTES;
        // An own buffer, a range of the request, an own buffer: contiguous on
        // device 0; then a gap and one more range.
        let planned = vec![
            write(0, Payload::Owned(owned(1, 1)), 10),
            write(s, Payload::Source(sector..4 * sector), 11),
            write(4 * s, Payload::Owned(owned(2, 2)), 12),
            write(100 * s, Payload::Source(6 * sector..8 * sector), 13),
        ];
        let merged = coalesce(planned, &source);
        assert_eq!(merged.len(), 2);
        let mut expected = vec![1u8; sector];
        expected.extend_from_slice(&source[sector..4 * sector]);
        expected.extend(vec![2u8; 2 * sector]);
        assert_eq!(merged[0].offset, 0);
        assert_eq!(merged[0].data.bytes(&source), &expected[..]);
        assert_eq!(merged[0].crcs, sector_crcs(&expected));
        let parts: Vec<(u64, u64, std::ops::Range<usize>)> = merged[0]
            .parts
            .iter()
            .map(|part| (part.block, part.offset, part.sectors.clone()))
            .collect();
        assert_eq!(parts, vec![(10, 0, 0..1), (11, s, 1..4), (12, 4 * s, 4..6)]);
        assert!(matches!(&merged[1].data, Payload::Source(range) if *range == (6 * sector..8 * sector)));
        assert_eq!(merged[1].crcs, sector_crcs(&source[6 * sector..]));
    }

    #[test]
    fn a_sequential_stream_marks_the_chunks_ahead_in_one_log_write_and_random_writes_mark_only_their_own() {
        current_thread().block_on(async {
            let (_sim, pool) = sim_pool(7).await;
            let chunk = 1u64 << 20;
            let ahead = super::super::MARK_AHEAD_BYTES / chunk;
            let log_writes = |pool: &Pool| pool.log.next_lsn();
            let marked = |pool: &Pool, index: u64| {
                pool.devices[0].chunk_epochs[index as usize].load(Ordering::Acquire) == pool.epoch()
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
            let chunks = pool.devices[0].chunk_epochs.len() as u64;
            pool.mark_dirty(&[(0, (chunks - 2) * chunk)]).await.unwrap();
            pool.mark_dirty(&[(0, (chunks - 1) * chunk)]).await.unwrap();
            assert!(marked(&pool, chunks - 1));
            // A new epoch (a checkpoint) needs every mark again.
            pool.checkpoint().await.unwrap();
            assert!(!marked(&pool, 0));
        });
    }
}
