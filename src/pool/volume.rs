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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{map_entry, Pool, PoolError, SECTOR_BYTES};
use crate::device::{DeviceError, IoBuf};
use crate::meta::log::Record;
use crate::volume::{BlockDevice, BlockError, BlockResult, BoxFuture, Capabilities, Extent, ZeroFlags};

const STRIPES: usize = 1024;
/// Most extents one BLOCK_STATUS answer carries.
const MAX_EXTENTS: usize = 1024;

pub struct EngineVolume {
    pool: Arc<Pool>,
    id: u32,
    size_bytes: AtomicU64,
    block_shift: u32,
    stripes: Box<[RwLock<()>]>,
    /// Blocks currently mapped (for `used` in `volume list`).
    mapped_blocks: AtomicU64,
}

/// One device write planned by a request (one or more volume blocks that
/// are contiguous on the device).
struct PlannedWrite {
    device: u8,
    offset: u64,
    data: IoBuf,
    parts: Vec<Part>,
}

/// The piece of a planned write that belongs to one volume block.
struct Part {
    /// The volume block and the index of this part's first sector in it.
    block: u64,
    first_sector: usize,
    offset: u64,
    /// Checksums of this part's sectors, in order.
    crcs: Vec<u32>,
    /// Set for a newly allocated block: its logical block number.
    new_block: Option<u64>,
}

impl PlannedWrite {
    #[allow(clippy::too_many_arguments)]
    fn single(
        device: u8,
        offset: u64,
        data: IoBuf,
        crcs: Vec<u32>,
        block: u64,
        first_sector: usize,
        new_block: bool,
    ) -> Self {
        PlannedWrite {
            device,
            offset,
            data,
            parts: vec![Part {
                block,
                first_sector,
                offset,
                crcs,
                new_block: new_block.then_some(block),
            }],
        }
    }

    fn release_new_slots(&self, pool: &Pool) {
        for part in &self.parts {
            if part.new_block.is_some() {
                pool.release_unused(self.device, part.offset);
            }
        }
    }
}

/// Merges writes that are contiguous on one device into one device write
/// (a sequential request over freshly allocated or sequentially allocated
/// blocks becomes one I/O instead of one per block).
fn coalesce(planned: Vec<PlannedWrite>) -> Vec<PlannedWrite> {
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
        .map(|mut run| {
            if run.len() == 1 {
                return run.pop().expect("one write");
            }
            let total: usize = run.iter().map(|w| w.data.len()).sum();
            let mut data = IoBuf::new(total);
            let mut at = 0;
            let mut parts = Vec::with_capacity(run.len());
            for write in &mut run {
                data.payload_mut()[at..at + write.data.len()].copy_from_slice(write.data.payload());
                at += write.data.len();
                parts.append(&mut write.parts);
            }
            PlannedWrite {
                device: run[0].device,
                offset: run[0].offset,
                data,
                parts,
            }
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

fn sector_crcs(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks(SECTOR_BYTES as usize).map(crc32c::crc32c).collect()
}

impl EngineVolume {
    pub(crate) fn new(pool: Arc<Pool>, id: u32, size_bytes: u64, volblocksize: u32, mapped_blocks: u64) -> Self {
        EngineVolume {
            pool,
            id,
            size_bytes: AtomicU64::new(size_bytes),
            block_shift: volblocksize.trailing_zeros(),
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
            mapped_blocks: AtomicU64::new(mapped_blocks),
        }
    }

    /// The block-map entry of logical block `block` (see `pool::map_entry`).
    pub fn lookup_entry(&self, block: u64) -> Result<u64, String> {
        self.pool.lookup(self.id, block)
    }

    /// Bytes of pool space the volume's mapped blocks take.
    pub fn used_bytes(&self) -> u64 {
        self.mapped_blocks.load(Ordering::Relaxed) << self.block_shift
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
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
        let mut guards = Vec::new();
        for index in self.stripe_indices(offset, length) {
            guards.push(self.stripes[index].read().await);
        }
        guards
    }

    async fn lock_exclusive(&self, offset: u64, length: u64) -> Vec<RwLockWriteGuard<'_, ()>> {
        let mut guards = Vec::new();
        for index in self.stripe_indices(offset, length) {
            guards.push(self.stripes[index].write().await);
        }
        guards
    }

    /// Checks the sectors of `data` read from `device` at `offset`. A mismatch
    /// in a chunk that is suspect after a crash is repaired from the data.
    /// `holding_gate`: the caller already holds the pool's write gate.
    async fn verify(&self, device: u8, offset: u64, data: &[u8], logical: u64, holding_gate: bool) -> BlockResult<()> {
        for (index, sector) in data.chunks(SECTOR_BYTES as usize).enumerate() {
            let at = offset + index as u64 * SECTOR_BYTES;
            let expected = self.pool.crc(device, at).map_err(meta_error)?;
            let actual = crc32c::crc32c(sector);
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

    /// Reads whole sectors `[offset, offset + length)` from a device and verifies them.
    async fn read_sectors(
        &self,
        device: u8,
        offset: u64,
        length: u64,
        logical: u64,
        holding_gate: bool,
    ) -> BlockResult<IoBuf> {
        debug_assert!(offset % SECTOR_BYTES == 0 && length % SECTOR_BYTES == 0);
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

    async fn read_impl(&self, offset: u64, mut buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        let length = buf.len() as u64;
        let _guards = self.lock_shared(offset, length).await;
        // (device, physical offset, length, position in buf)
        let mut segments: Vec<(u8, u64, u64, u64)> = Vec::new();
        let mut position = offset;
        let end = offset + length;
        while position < end {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let entry = match self.pool.lookup(self.id, block) {
                Ok(entry) => entry,
                Err(e) => return (buf, Err(meta_error(e))),
            };
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

    /// Plans the device writes that store `data` at volume `offset`. Caller
    /// holds the stripe locks and the pool's write gate.
    async fn plan(&self, offset: u64, data: &[u8], entries: &[u64]) -> BlockResult<Vec<PlannedWrite>> {
        let mut planned = Vec::new();
        let mut position = offset;
        let end = offset + data.len() as u64;
        let mut index = 0;
        while position < end {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let source = &data[(position - offset) as usize..(position - offset + step) as usize];
            match map_entry::decode(entries[index]) {
                Some((device, base)) => {
                    // Overwrite in place, widened to whole sectors.
                    let start = within / SECTOR_BYTES * SECTOR_BYTES;
                    let stop = (within + step).div_ceil(SECTOR_BYTES) * SECTOR_BYTES;
                    let mut sectors = if start == within && stop == within + step {
                        IoBuf::copy_from(source)
                    } else {
                        let logical = (block << self.block_shift) + start;
                        self.read_sectors(device, base + start, stop - start, logical, true)
                            .await?
                    };
                    let skip = (within - start) as usize;
                    sectors.payload_mut()[skip..skip + source.len()].copy_from_slice(source);
                    let crcs = sector_crcs(sectors.payload());
                    let first_sector = (start / SECTOR_BYTES) as usize;
                    planned.push(PlannedWrite::single(
                        device,
                        base + start,
                        sectors,
                        crcs,
                        block,
                        first_sector,
                        false,
                    ));
                }
                None => {
                    // First write: allocate and write the whole block.
                    let Some((device, base)) = self.pool.allocate(self.block_shift as u8) else {
                        for write in &planned {
                            write.release_new_slots(&self.pool);
                        }
                        return Err(BlockError::NoSpace);
                    };
                    let mut whole = IoBuf::new(self.block_bytes() as usize);
                    whole.payload_mut()[within as usize..(within + step) as usize].copy_from_slice(source);
                    let crcs = sector_crcs(whole.payload());
                    planned.push(PlannedWrite::single(device, base, whole, crcs, block, 0, true));
                }
            }
            position += step;
            index += 1;
        }
        Ok(coalesce(planned))
    }

    /// Writes `data` at `offset` (caller holds the stripe locks).
    async fn write_locked(&self, offset: u64, data: IoBuf) -> BlockResult<()> {
        let first = offset >> self.block_shift;
        let last = (offset + data.len() as u64 - 1) >> self.block_shift;
        let mut entries = Vec::with_capacity((last - first + 1) as usize);
        for block in first..=last {
            entries.push(self.pool.lookup(self.id, block).map_err(meta_error)?);
        }
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
        let planned = self.plan(offset, data.payload(), &entries).await?;
        // New blocks land in chunks that may hold mapped data of other
        // blocks; their records carry checksums, so no mark is needed.
        let mut failure = None;
        let mut done = Vec::with_capacity(planned.len());
        for write in planned {
            if failure.is_some() {
                write.release_new_slots(&self.pool);
                continue;
            }
            let pool_device = &self.pool.devices[write.device as usize];
            let PlannedWrite {
                device,
                offset,
                data,
                parts,
            } = write;
            let (data, result) = pool_device.device.write(offset, data).await;
            let write = PlannedWrite {
                device,
                offset,
                data,
                parts,
            };
            match result {
                Ok(()) => {
                    self.pool
                        .data_bytes
                        .fetch_add(write.data.len() as u64, Ordering::Relaxed);
                    done.push(write)
                }
                Err(e) => {
                    pool_device.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                    write.release_new_slots(&self.pool);
                    failure = Some(io_error(e));
                }
            }
        }
        // Whatever reached the device is accounted for, even if a later part failed.
        for write in done {
            for part in write.parts {
                self.pool
                    .set_crcs(write.device, part.offset, &part.crcs)
                    .map_err(meta_error)?;
                if part.new_block.is_none() {
                    self.pool
                        .note_overwrite(self.id, part.block, part.first_sector, &part.crcs);
                }
                if let Some(block) = part.new_block {
                    let entry = map_entry::encode(write.device, part.offset);
                    self.pool.set_mapping(self.id, block, entry).map_err(meta_error)?;
                    self.mapped_blocks.fetch_add(1, Ordering::Relaxed);
                    self.pool.log_mapping(Record::Map {
                        volume: self.id,
                        block,
                        new: entry,
                        old: 0,
                        crcs: part.crcs,
                    });
                }
            }
        }
        drop(gate);
        self.pool.maybe_checkpoint_soon();
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
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

    fn extents(&self, offset: u64, length: u64) -> BlockResult<Vec<Extent>> {
        let mut extents: Vec<Extent> = Vec::new();
        let end = offset + length;
        let mut position = offset;
        while position < end && extents.len() < MAX_EXTENTS {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let mapped = self.pool.lookup(self.id, block).map_err(meta_error)? & map_entry::VALID != 0;
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
        Box::pin(self.read_impl(offset, buf))
    }

    fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(async move {
            let appends = self.pool.log_appends();
            let _guards = self.lock_exclusive(offset, data.len() as u64).await;
            let result = self.write_locked(offset, data).await;
            drop(_guards);
            self.finish(result, fua, appends).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(async move { self.pool.commit().await.map_err(pool_error) })
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(async move {
            let appends = self.pool.log_appends();
            let _guards = self.lock_exclusive(offset, length).await;
            let result = self.trim_locked(offset, length).await;
            drop(_guards);
            self.finish(result, fua, appends).await
        })
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(async move {
            if !flags.may_trim && flags.fast_only {
                return Err(BlockError::NotFast);
            }
            let appends = self.pool.log_appends();
            let _guards = self.lock_exclusive(offset, length).await;
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
