//! Reads: the cached, clean and device paths, and verification of every
//! sector against its stored checksum (repairing what a crash left
//! suspect).

use super::*;
use crate::pool::vdev::MirrorChild;

impl EngineVolume {
    /// Checks the sectors of `data` read from `device` at `offset`. A mismatch
    /// in a part that is suspect after a crash is repaired from the data.
    /// `holding_gate`: the caller already holds the pool's write gate.
    async fn verify(
        &self,
        device: u8,
        offset: u64,
        data: &mut [u8],
        logical: u64,
        holding_gate: bool,
    ) -> BlockResult<()> {
        let stored = self
            .pool
            .crcs(device, offset, data.len() / SECTOR_BYTES as usize)
            .map_err(meta_error)?;
        let mut actuals = sector_crcs(data);
        self.pool.tag_crcs(&mut actuals, logical);
        if actuals == stored {
            return Ok(());
        }
        let pool_device = self.pool.data_device(device).map_err(meta_error)?;
        if let Some(mirror) = pool_device.mirror() {
            // Another copy may hold what the checksums describe.
            self.heal(mirror, device, offset, data, &stored, logical, holding_gate)
                .await;
            actuals = sector_crcs(data);
            self.pool.tag_crcs(&mut actuals, logical);
        }
        for (index, (&actual, &expected)) in actuals.iter().zip(&stored).enumerate() {
            let at = offset + index as u64 * SECTOR_BYTES;
            if actual == expected {
                continue;
            }
            let counters = &pool_device.counters;
            if self.pool.is_suspect(device, at) {
                // The checkpoint's snapshot must not race this page change.
                let _gate = if holding_gate {
                    None
                } else {
                    Some(self.pool.enter_write(self.id).await)
                };
                self.pool.set_crc(device, at, actual).map_err(meta_error)?;
                counters.repaired_after_crash.fetch_add(1, Ordering::Relaxed);
                if pool_device.mirror().is_some() {
                    // No copy matched: the crash explains it, and every copy
                    // is made the one the checksum now describes, durably
                    // (no pool flush covers this write: it is no client's).
                    let from = index * SECTOR_BYTES as usize;
                    let sector = IoBuf::copy_from(&data[from..from + SECTOR_BYTES as usize]);
                    if let (_, Err(e)) = pool_device.device.write(at, sector).await {
                        return Err(io_error(e));
                    }
                    if let Err(e) = pool_device.device.flush_range(at, SECTOR_BYTES).await {
                        return Err(io_error(e));
                    }
                }
                continue;
            }
            counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                "volume {}: checksum mismatch at device {} offset {} (volume offset {})",
                self.id,
                pool_device.device.info().name,
                at,
                logical + index as u64 * SECTOR_BYTES
            );
            return Err(BlockError::Checksum {
                offset: logical + index as u64 * SECTOR_BYTES,
            });
        }
        Ok(())
    }

    /// Looks for the sectors of `data` (read from member `device`, the
    /// mirror `mirror`, at `offset`) whose checksums do not match `stored`
    /// on every up-to-date child of the mirror: a sector one child holds
    /// intact replaces the bad one in `data` and is written over the copies
    /// that do not match (never over one that does). Counted per child.
    /// Sectors no child holds intact stay as they were.
    ///
    /// A power cut during or after a repair must leave checksums that tell
    /// the good copy from the bad, so where they may not be durable yet (see
    /// [`Pool::sums_may_be_unlogged`]) a `Sums` record of them is committed
    /// first. Under the write gate (`holding_gate`: the caller is a write
    /// reading what it overwrites) no commit may wait, so the bad copies are
    /// left for the write itself or a later read or scrub.
    #[allow(clippy::too_many_arguments)]
    async fn heal(
        &self,
        mirror: &Mirror,
        device: u8,
        offset: u64,
        data: &mut [u8],
        stored: &[u32],
        logical: u64,
        holding_gate: bool,
    ) {
        let sector = SECTOR_BYTES as usize;
        let mut copies: Vec<(Arc<MirrorChild>, IoBuf, Vec<u32>)> = Vec::new();
        for child in mirror.online() {
            let (buf, result) = mirror.read_child(&child, offset, IoBuf::new(data.len())).await;
            if result.is_ok() {
                let mut sums = sector_crcs(buf.payload());
                self.pool.tag_crcs(&mut sums, logical);
                copies.push((child, buf, sums));
            }
        }
        // The sectors one copy holds intact, with the children to rewrite.
        let mut repairs: Vec<(usize, Vec<Arc<MirrorChild>>)> = Vec::new();
        for (at, &expected) in stored.iter().enumerate() {
            let Some(good) = copies.iter().position(|(_, _, sums)| sums[at] == expected) else {
                continue;
            };
            let range = at * sector..(at + 1) * sector;
            data[range.clone()].copy_from_slice(&copies[good].1.payload()[range]);
            let bad: Vec<Arc<MirrorChild>> = copies
                .iter()
                .filter(|(_, _, sums)| sums[at] != expected)
                .map(|(child, _, _)| child.clone())
                .collect();
            if bad.is_empty() {
                continue;
            }
            for child in &bad {
                child.counters.checksum_errors.fetch_add(1, Ordering::Relaxed);
            }
            repairs.push((at, bad));
        }
        if repairs.is_empty() {
            return;
        }
        let place = |at: usize| offset + (at * sector) as u64;
        let unlogged: Vec<usize> = repairs
            .iter()
            .map(|(at, _)| *at)
            .filter(|&at| self.pool.sums_may_be_unlogged(device, place(at)))
            .collect();
        let rewrite = if unlogged.is_empty() {
            Ok(())
        } else if holding_gate {
            Err("the write being made rewrites it".to_string())
        } else {
            let sums: Vec<(u64, u32)> = unlogged.iter().map(|&at| (place(at), stored[at])).collect();
            self.pool
                .commit_sums(device, &sums)
                .await
                .map_err(|e| format!("its checksums could not be made durable first: {e}"))
        };
        for (at, bad) in repairs {
            let range = at * sector..(at + 1) * sector;
            for child in bad {
                let where_ = format!(
                    "volume {}: checksum mismatch on {} at offset {} (volume offset {})",
                    self.id,
                    child.name,
                    place(at),
                    logical + (at * sector) as u64
                );
                match &rewrite {
                    Ok(()) => {
                        tracing::warn!("{where_}; rewritten from another copy");
                        if mirror
                            .write_child(&child, place(at), &data[range.clone()])
                            .await
                            .is_ok()
                        {
                            child.counters.repaired.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Err(why) => tracing::warn!("{where_}; read from another copy, not rewritten: {why}"),
                }
            }
        }
    }

    /// Reads whole sectors into `dst` straight from `device`'s memory, their
    /// checksums summed in the same pass (a cached, mapped file: see
    /// `device::mapped`), for reads of at least [`SUMMED_READ_MIN_BYTES`].
    /// `true` if done and every sum matched the stored one. Anything else —
    /// pages not cached, a device that cannot, a mismatch — is `false`, and
    /// the caller reads and verifies the usual way, which alone repairs
    /// suspect sectors and reports and counts errors.
    fn read_summed_now(&self, device: u8, physical: u64, dst: &mut [u8], logical: u64) -> bool {
        const _: () = assert!(SECTOR_BYTES as usize == crate::checksum::SUM_SECTOR_BYTES);
        if dst.len() < SUMMED_READ_MIN_BYTES {
            return false;
        }
        let sectors = dst.len() / SECTOR_BYTES as usize;
        let mut sums = vec![0u32; sectors];
        let Some(pool_device) = self.pool.device(device) else {
            return false;
        };
        if !pool_device.device.read_now_summed(physical, dst, &mut sums) {
            return false;
        }
        self.pool.tag_crcs(&mut sums, logical);
        matches!(self.pool.crcs(device, physical, sectors), Ok(stored) if stored == sums)
    }

    /// Reads `blocks` back where they lie on the devices and verifies them
    /// (the scrub after a crash, `Pool::scrub_suspect`): a mismatch in a
    /// suspect part is repaired from the data, any other is a checksum
    /// error, counted and logged. Each block holds only its own stripe's
    /// read lock meanwhile. Returns how many blocks failed to verify.
    pub(crate) async fn scrub_blocks(&self, blocks: &[u64]) -> u64 {
        let mut failed = 0;
        for &block in blocks {
            let offset = block << self.block_shift;
            let _guards = self.lock_shared(offset, self.block_bytes()).await;
            let entry = match self.pool.lookup(self.id, block) {
                Ok(entry) => entry,
                Err(_) => {
                    failed += 1;
                    continue;
                }
            };
            let Some((device, physical)) = entry.place() else {
                continue;
            };
            match self
                .read_sectors(device, physical, self.block_bytes(), offset, false)
                .await
            {
                // Verified: its checksums describe its data.
                Ok(_) => self.pool.clear_suspect(device, physical, self.block_bytes()),
                // Counted and logged on its device; suspect parts after the
                // failing sector stay suspect (a read repairs them).
                Err(_) => failed += 1,
            }
        }
        failed
    }

    /// Checks block `block` (of this volume, or of its snapshot
    /// `snapshot`'s own map) on every up-to-date copy, if it still lies at
    /// `physical` on `device`: the whole-pool scrub's second look at a
    /// block that did not match in its run. A bad copy on a mirror is
    /// rewritten from a good one (as a client's read does), and a copy that
    /// could not be read is rewritten too; errors are counted and logged on
    /// their devices.
    pub(crate) async fn scrub_block(
        &self,
        device: u8,
        physical: u64,
        block: u64,
        snapshot: Option<u32>,
    ) -> crate::pool::scrub::ScrubBlock {
        use crate::pool::scrub::ScrubBlock;
        let offset = block << self.block_shift;
        let bytes = self.block_bytes();
        // A snapshot's blocks do not change; a volume's are held still.
        let _guards = match snapshot {
            None => Some(self.lock_shared(offset, bytes).await),
            Some(_) => None,
        };
        let still_here = |pool: &Pool| {
            let entry = match snapshot {
                None => pool.lookup(self.id, block),
                Some(snapshot) => pool.own_entry(snapshot, block),
            };
            entry.is_ok_and(|e| e.place() == Some((device, physical)))
        };
        if !still_here(&self.pool) {
            return ScrubBlock::Gone;
        }
        let Ok(pool_device) = self.pool.data_device(device) else {
            return ScrubBlock::Bad;
        };
        let Some(mirror) = pool_device.mirror() else {
            return match self.read_sectors(device, physical, bytes, offset, false).await {
                Ok(_) => ScrubBlock::Good,
                Err(_) if !still_here(&self.pool) => ScrubBlock::Gone,
                Err(_) => ScrubBlock::Bad,
            };
        };
        let Ok(stored) = self.pool.crcs(device, physical, (bytes / SECTOR_BYTES) as usize) else {
            return ScrubBlock::Bad;
        };
        let mut good: Option<IoBuf> = None;
        let mut mismatched: Option<IoBuf> = None;
        let mut unreadable = Vec::new();
        for child in mirror.online() {
            let (buf, result) = mirror.read_child(&child, physical, IoBuf::new(bytes as usize)).await;
            if result.is_err() {
                unreadable.push(child);
                continue;
            }
            let mut sums = sector_crcs(buf.payload());
            self.pool.tag_crcs(&mut sums, offset);
            if sums == stored {
                good.get_or_insert(buf);
            } else {
                mismatched.get_or_insert(buf);
            }
        }
        if let Some(mut data) = mismatched {
            // Verifying a bad copy heals every copy that does not match.
            match self.verify(device, physical, data.payload_mut(), offset, false).await {
                Ok(()) => {
                    good.get_or_insert(data);
                }
                Err(_) if !still_here(&self.pool) => return ScrubBlock::Gone,
                Err(_) => return ScrubBlock::Bad,
            }
        }
        let Some(good) = good else {
            return ScrubBlock::Bad;
        };
        for child in unreadable {
            if mirror.write_child(&child, physical, good.payload()).await.is_ok() {
                child
                    .counters
                    .repaired
                    .fetch_add(bytes / SECTOR_BYTES, Ordering::Relaxed);
            }
        }
        ScrubBlock::Good
    }

    /// Reads whole sectors `[offset, offset + length)` from a device and verifies them.
    pub(super) async fn read_sectors(
        &self,
        device: u8,
        offset: u64,
        length: u64,
        logical: u64,
        holding_gate: bool,
    ) -> BlockResult<IoBuf> {
        debug_assert!(offset.is_multiple_of(SECTOR_BYTES) && length.is_multiple_of(SECTOR_BYTES));
        let mut buf = self.read_device(device, offset, length).await?;
        self.verify(device, offset, buf.payload_mut(), logical, holding_gate)
            .await?;
        Ok(buf)
    }

    /// Reads the slots of `blocks` (volume block numbers), which lie one
    /// after another on `device` from `offset`, in one device read, and
    /// verifies each against its own place: blocks next to each other on
    /// the device need not be next to each other in the volume.
    pub(super) async fn read_slots(&self, device: u8, offset: u64, blocks: &[u64]) -> BlockResult<IoBuf> {
        let bytes = self.block_bytes();
        let mut buf = self.read_device(device, offset, blocks.len() as u64 * bytes).await?;
        for (at, &block) in blocks.iter().enumerate() {
            let from = at * bytes as usize;
            let data = &mut buf.payload_mut()[from..from + bytes as usize];
            self.verify(
                device,
                offset + at as u64 * bytes,
                data,
                block << self.block_shift,
                false,
            )
            .await?;
        }
        Ok(buf)
    }

    async fn read_device(&self, device: u8, offset: u64, length: u64) -> BlockResult<IoBuf> {
        let pool_device = self.pool.data_device(device).map_err(meta_error)?;
        let (buf, result) = pool_device.device.read(offset, IoBuf::new(length as usize)).await;
        if let Err(e) = result {
            pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
            return Err(io_error(e));
        }
        Ok(buf)
    }

    pub(super) async fn read_impl(&self, offset: u64, buf: IoBuf) -> (IoBuf, BlockResult<()>) {
        let _guards = self.lock_shared(offset, buf.len() as u64).await;
        self.read_unlocked(offset, buf).await
    }

    /// Reads through the cache (caller holds the stripe locks): sectors the
    /// cache holds come from RAM, the rest from the devices.
    pub(super) async fn read_unlocked(&self, offset: u64, buf: IoBuf) -> (IoBuf, BlockResult<()>) {
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
            // No heat: the fast tier is for what the read cache does not
            // hold (ARCHITECTURE.md, "Migration (tiering)").
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
            match entry.place() {
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
        // Heat, for the migrator; not from sequential streams (a scan or a
        // backup reads everything once: it would promote nothing useful).
        if self.streams.is_random(offset, length) {
            for (device, physical, _, _) in &segments {
                self.pool.note_heat(*device, *physical, false, 1);
            }
        }
        // Fast path: one sector-aligned run covering the whole request is
        // read straight into the caller's buffer.
        if let [(device, physical, run, 0)] = segments[..] {
            if run == length && physical % SECTOR_BYTES == 0 && run % SECTOR_BYTES == 0 {
                if self.read_summed_now(device, physical, buf.payload_mut(), offset) {
                    return (buf, Ok(()));
                }
                let pool_device = match self.pool.data_device(device) {
                    Ok(pool_device) => pool_device,
                    Err(e) => return (buf, Err(meta_error(e))),
                };
                let (mut buf, result) = pool_device.device.read(physical, buf).await;
                if let Err(e) = result {
                    pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                    return (buf, Err(io_error(e)));
                }
                let verified = self.verify(device, physical, buf.payload_mut(), offset, false).await;
                return (buf, verified);
            }
        }
        for (device, physical, run, at) in segments {
            if physical % SECTOR_BYTES == 0 && run % SECTOR_BYTES == 0 {
                // Whole sectors: straight into their place in `buf` when the
                // device has them in memory.
                let pool_device = match self.pool.data_device(device) {
                    Ok(pool_device) => pool_device,
                    Err(e) => return (buf, Err(meta_error(e))),
                };
                let dst = &mut buf.payload_mut()[at as usize..(at + run) as usize];
                if self.read_summed_now(device, physical, dst, offset + at) {
                    continue;
                }
                match pool_device.device.read_now(physical, dst) {
                    Some(Ok(())) => {
                        let data = &mut buf.payload_mut()[at as usize..(at + run) as usize];
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

    pub(super) fn extents(&self, offset: u64, length: u64) -> BlockResult<Vec<Extent>> {
        let mut extents: Vec<Extent> = Vec::new();
        let end = offset + length;
        let mut position = offset;
        while position < end && extents.len() < MAX_EXTENTS {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let sectors = self.block_bytes() / SECTOR_BYTES;
            let mapped = self.pool.lookup(self.id, block).map_err(meta_error)?.is_mapped()
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
