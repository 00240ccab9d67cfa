//! Writes and epochs: allocation for writers, the write gate, the marks
//! that make overwrites safe without metadata I/O, and the group commit of
//! the intent log (data devices flushed first).

use super::*;

impl Pool {
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

    /// Allocates a slot, at `hint` if it is free (see
    /// [`alloc::Allocator::allocate_near`]).
    pub(crate) fn allocate_near(&self, slot_shift: u8, hint: Option<alloc::Hint>) -> Option<(u8, u64)> {
        let mut allocator = self.allocator.lock_or_abort();
        allocator.allocate_near(slot_shift, hint).or_else(|| {
            // Space being freed in the background is needed now.
            allocator
                .reclaim_freeing()
                .then(|| allocator.allocate(slot_shift))
                .flatten()
        })
    }

    /// Allocates a slot on a device of tier `role` (a block being moved
    /// there), or `None` when that tier is full.
    pub(crate) fn allocate_in_tier(&self, slot_shift: u8, role: super::superblock::Role) -> Option<(u8, u64)> {
        let mut allocator = self.allocator.lock_or_abort();
        allocator.allocate_in(slot_shift, role).or_else(|| {
            allocator
                .reclaim_freeing()
                .then(|| allocator.allocate_in(slot_shift, role))
                .flatten()
        })
    }

    /// Returns a slot that was never mapped (its write failed).
    pub(crate) fn release_unused(&self, device: u8, offset: u64) {
        let freed = self.allocator.lock_or_abort().free(device, offset);
        assert!(freed, "released slot {device}/{offset} was not allocated");
    }

    pub(crate) fn log_mapping(&self, record: Record) {
        self.log_mapping_in(record, None);
    }

    /// [`Pool::log_mapping`]; with a destage `pass`, held back until the
    /// pass has flushed the data devices ([`Log::defer`]).
    pub(crate) fn log_mapping_in(&self, record: Record, pass: Option<u64>) {
        // A slot a snapshot shares is not freed by the volume's change.
        let free = match (&record, record.block_ptrs()) {
            (Record::Map { .. }, Some((_, old))) if !old.is_shared() => old.place(),
            _ => None,
        };
        match (pass, free) {
            (Some(pass), free) => self.log.defer(pass, record, free),
            (None, Some(slot)) => self.log.append_free(record, slot),
            (None, None) => self.log.append(record),
        }
    }

    /// Commits so that slots freed by records not durable yet become
    /// reusable, the records destage passes hold back included (they are
    /// committed after a data flush, as any other): for a write short of
    /// space.
    pub(crate) async fn commit_for_space(&self) -> Result<(), PoolError> {
        self.log.settle(None);
        self.commit_quiet().await
    }

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

    /// Whether the chunk holding (device, byte offset) has its `Dirty` mark
    /// durable in `epoch`.
    pub(crate) fn is_marked(&self, (device, offset): (u8, u64), epoch: u32) -> bool {
        let chunk = offset / self.chunk_bytes as u64;
        self.devices
            .get(device as usize)
            .and_then(|d| d.chunk_epochs.get(chunk as usize))
            .is_none_or(|slot| slot.load(Ordering::Acquire) == epoch)
    }

    /// Whether the stored checksum of the sector at (device, byte offset)
    /// may differ from the durable one: its chunk may have been written in
    /// place since the last checkpoint (its `Dirty` mark is of this epoch),
    /// or the sector is suspect after a crash. Everything else that sets
    /// checksums logs them (`Map`, `Relocate`).
    pub(crate) fn sums_may_be_unlogged(&self, device: u8, offset: u64) -> bool {
        self.is_marked((device, offset), self.epoch()) || self.is_suspect(device, offset)
    }

    /// Makes durable the stored checksums `sums` (byte offset, checksum as
    /// stored) of sectors of `device`, and the data they describe: `Sums`
    /// records, committed with a flush of the data devices first. Before a
    /// copy on a mirror is rewritten from another (`EngineVolume::heal`).
    pub(crate) async fn commit_sums(&self, device: u8, sums: &[(u64, u32)]) -> Result<(), PoolError> {
        let mut at = 0;
        while at < sums.len() {
            // A run of consecutive sectors, at most one record's worth.
            let first = sums[at].0;
            let mut end = at + 1;
            while end < sums.len()
                && end - at < crate::meta::log::MAX_CRCS_PER_RECORD
                && sums[end].0 == first + (end - at) as u64 * SECTOR_BYTES
            {
                end += 1;
            }
            let crcs = sums[at..end].iter().map(|(_, crc)| *crc).collect();
            self.log.append(Record::Sums {
                device,
                offset: first,
                crcs,
            });
            at = end;
        }
        self.commit_marks().await
    }

    /// The write gate's shard of `volume` (see `Pool::gates`). Held shared
    /// it keeps a checkpoint from starting; nobody holds two at once (a
    /// checkpoint waiting for one would then deadlock with it).
    pub(crate) fn gate(&self, volume: u32) -> &Ranked<tokio::sync::RwLock<()>> {
        &self.gates[volume as usize % GATE_SHARDS].0
    }

    /// Enters the write gate for a change to `volume`'s data or map.
    pub(crate) async fn enter_write(&self, volume: u32) -> Held<tokio::sync::RwLockReadGuard<'_, ()>> {
        let gate = self.gate(volume);
        // Without an `.await` when free (see `EngineVolume::read_stripes`).
        match gate.try_read() {
            Ok(guard) => guard,
            Err(_) => gate.read().await,
        }
    }

    /// Closes the write gate: waits for the writes under way in every
    /// volume and keeps new ones out until the guards are dropped. Shards
    /// are taken in order, so two closers cannot deadlock.
    pub(crate) async fn close_gate(&self) -> Vec<Held<tokio::sync::RwLockWriteGuard<'_, ()>>> {
        let mut guards = Vec::with_capacity(self.gates.len());
        for shard in self.gates.iter() {
            guards.push(shard.0.write().await);
        }
        guards
    }

    /// Counts a completed write of `bytes` to data device `device` (see
    /// `flush_data_devices`).
    pub(crate) fn note_data_write(&self, device: u8, bytes: u64) {
        let Some(pool_device) = self.devices.get(device as usize) else {
            return;
        };
        let written = &pool_device.written;
        written.writes.fetch_add(1, Ordering::AcqRel);
        written.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Flushes each data device that a data write completed on since its
    /// last flush (a commit of Data records alone needs only the log
    /// device). One flush at a time: a caller that finds one under way
    /// waits for it and flushes again only the devices where that one began
    /// before the writes it needs completed. (The destager flushes outside
    /// the log's commit lock and writers' commits flush under it; each used
    /// to issue its own `fdatasync` of the same files at the same time.)
    pub(crate) async fn flush_data_devices(&self) -> Result<(), DeviceError> {
        self.flush_data_devices_counted().await.map(|_| ())
    }

    /// [`Pool::flush_data_devices`]; true if it flushed any device (not
    /// when every write was flushed already, by it or another caller).
    async fn flush_data_devices_counted(&self) -> Result<bool, DeviceError> {
        // The writes each device must have flushed (those completed by now).
        let needed: Vec<u64> = self
            .devices
            .into_iter()
            .map(|d| d.written.writes.load(Ordering::Acquire))
            .collect();
        let unflushed = |(device, needed): (&PoolDevice, &u64)| {
            device.member.role.holds_data() && device.written.flushed.load(Ordering::Acquire) < *needed
        };
        if !self.devices.into_iter().zip(&needed).any(unflushed) {
            return Ok(false);
        }
        let _one = self.data_flush.lock().await;
        let mut counted = false;
        for (device, needed) in self.devices.into_iter().zip(&needed) {
            if !unflushed((device, needed)) {
                continue;
            }
            if !counted {
                self.data_flushes.fetch_add(1, Ordering::Relaxed);
                counted = true;
            }
            // Covers every write counted by now, not only those `needed` names.
            let written = device.written.writes.load(Ordering::Acquire);
            if let Err(e) = device.device.flush().await {
                device.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
            device.written.flushed.fetch_max(written, Ordering::AcqRel);
        }
        Ok(counted)
    }

    /// One log commit (data devices flushed first unless `data` is false
    /// and no record taken needs it: see [`Log::commit_records`]) and the
    /// release of the slots its records freed, with no checkpoint in
    /// between (see `Pool::releasing`).
    async fn commit_and_release(&self, reserve: bool, data: bool) -> Result<(), LogError> {
        let _releasing = self.releasing.read().await;
        let waited = std::time::Instant::now();
        let flush = || async {
            let flushed = self.flush_data_devices_counted().await?;
            if flushed {
                self.commit_data_flushes.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        };
        let committed = if data {
            self.log.commit(flush, reserve).await
        } else {
            self.log.commit_records(flush, reserve).await
        };
        crate::analytics::phase::add_commit_wait(waited);
        let frees = committed?;
        self.release_frees(frees).await;
        Ok(())
    }

    /// Makes every completed write durable: flushes the data devices, then
    /// commits the log. Group-committed: concurrent callers share one commit.
    /// A full log is freed by a checkpoint, destaging the data it holds if
    /// that is what keeps it full (backpressure): the caller waits for the
    /// room, made by one writer at a time ([`Pool::make_log_room`]), and
    /// fails only when three rounds in a row free nothing.
    pub async fn commit(&self) -> Result<(), PoolError> {
        self.commit_client(true).await
    }

    /// Makes the log records appended so far durable (and the data they
    /// point to), without flushing other completed writes: for a caller
    /// whose own change is all in records, such as a synchronous write
    /// whose data went into `Data` records or a file's namespace change.
    /// Its commit writes the log only, unless a record it takes (a new
    /// mapping) needs the data devices flushed first. Otherwise as
    /// [`Pool::commit`].
    pub async fn commit_records(&self) -> Result<(), PoolError> {
        self.commit_client(false).await
    }

    async fn commit_client(&self, data: bool) -> Result<(), PoolError> {
        let mut fruitless = 0;
        loop {
            match self.commit_and_release(false, data).await {
                Ok(()) => {
                    self.maybe_checkpoint_soon();
                    return Ok(());
                }
                Err(LogError::Full) => self.log_room_round(0, &mut fruitless).await?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits until the log has room for `bytes` of records a writer is
    /// about to append (synchronous writes' `Data` records), making it if
    /// need be. Writers that append without asking filled the log past
    /// what even the engine's own commits may use (its last quarter):
    /// then no destage could commit, no checkpoint could move the tail,
    /// and every write failed with "the log is full" (256 `sync=always`
    /// writers did it in seconds).
    pub(crate) async fn wait_for_log_room(&self, bytes: u64) -> Result<(), PoolError> {
        if self.log.room() >= bytes {
            return Ok(());
        }
        let waited = std::time::Instant::now();
        let mut fruitless = 0;
        let result = async {
            while self.log.room() < bytes {
                self.log_room_round(bytes, &mut fruitless).await?;
            }
            Ok(())
        }
        .await;
        self.log_room_waits.fetch_add(1, Ordering::Relaxed);
        self.log_room_wait_micros
            .fetch_add(waited.elapsed().as_micros() as u64, Ordering::Relaxed);
        result
    }

    /// One round of [`Pool::make_log_room`] for a caller short of log room;
    /// `fruitless` counts the rounds in a row that freed nothing, and the
    /// third fails with "the log is full".
    async fn log_room_round(&self, bytes: u64, fruitless: &mut u32) -> Result<(), PoolError> {
        if self.make_log_room(bytes).await? {
            *fruitless = 0;
        } else {
            *fruitless += 1;
            if *fruitless >= 3 {
                return Err(LogError::Full.into());
            }
        }
        Ok(())
    }

    /// Frees log space: one caller at a time destages the logged data that
    /// holds the log's tail back and checkpoints ([`Pool::checkpoint`]);
    /// the others wait for it, then look again. Returns whether there was
    /// progress: the tail moved, or `bytes` of room are there now. (A
    /// metadata checkpoint alone frees nothing while logged data pins the
    /// tail, and each one writes to the log: hundreds of writers each
    /// taking one filled the log's reserve and no commit could go on.)
    async fn make_log_room(&self, bytes: u64) -> Result<bool, PoolError> {
        let tail = self.log.tail_lsn();
        let _making = self.making_log_room.lock().await;
        if self.log.tail_lsn() != tail || (bytes > 0 && self.log.room() >= bytes) {
            // Someone else made room meanwhile.
            return Ok(true);
        }
        self.checkpoint().await?;
        Ok(self.log.tail_lsn() != tail)
    }

    /// A commit for the engine's own work (dirty marks, destaging): never
    /// destages, so it can run inside a destage; may use the log's reserve.
    pub(crate) async fn commit_quiet(&self) -> Result<(), PoolError> {
        self.commit_quiet_with(true).await
    }

    /// [`Pool::commit_quiet`] for records only: the data devices are
    /// flushed first only if a record taken needs it (the destager's, once
    /// it has flushed them itself: [`crate::meta::log::Log::release`]).
    pub(crate) async fn commit_quiet_records(&self) -> Result<(), PoolError> {
        self.commit_quiet_with(false).await
    }

    async fn commit_quiet_with(&self, data: bool) -> Result<(), PoolError> {
        // Into the reserve before a metadata checkpoint: while logged data
        // pins the tail, a checkpoint frees nothing and only uses log space.
        for attempt in 0..3 {
            match self.commit_and_release(attempt > 0, data).await {
                Ok(()) => return Ok(()),
                Err(LogError::Full) if attempt == 1 => self.checkpoint_metadata().await?,
                Err(LogError::Full) if attempt == 0 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Err(LogError::Full.into())
    }

    /// Makes the pending `Dirty` marks durable: one log write when nothing
    /// pending needs the data devices flushed first, else a commit of the
    /// records with that flush. (Not a commit of every completed write: a
    /// destage pass marks chunks before each write in place, and such a
    /// commit would flush the data devices under the commit lock, with
    /// synchronous writers queued behind it, for writes nobody asked to
    /// be durable yet.)
    pub(crate) async fn commit_marks(&self) -> Result<(), PoolError> {
        let releasing = self.releasing.read().await;
        let waited = std::time::Instant::now();
        let committed = self.log.commit_marks().await;
        crate::analytics::phase::add_commit_wait(waited);
        match committed {
            Ok(Some(frees)) => {
                self.release_frees(frees).await;
                Ok(())
            }
            Ok(None) | Err(LogError::Full) => {
                drop(releasing);
                self.commit_quiet_records().await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Gives the space of slots about to be freed back to the file system
    /// under sparse device files (punches holes), so a TRIM or a destroyed
    /// volume makes room on a full disk. Called after the commit that frees
    /// them and before the allocator may hand them out again (a punch after
    /// reuse would destroy new data). A failed punch costs only the space.
    pub(super) async fn punch_holes(&self, slots: &[(u8, u64)]) {
        let chunk_shift = self.chunk_bytes.trailing_zeros();
        let mut ranges: Vec<(u8, u64, u64)> = {
            let allocator = self.allocator.lock_or_abort();
            slots
                .iter()
                .filter_map(|&(device, offset)| {
                    let (slot_shift, _) = allocator.slot_shift_of(device, offset >> chunk_shift)?;
                    Some((device, offset, 1u64 << slot_shift))
                })
                .collect()
        };
        ranges.sort_unstable();
        let mut merged: Vec<(u8, u64, u64)> = Vec::with_capacity(ranges.len());
        for (device, offset, length) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == device && last.1 + last.2 == offset => last.2 += length,
                _ => merged.push((device, offset, length)),
            }
        }
        for (index, offset, length) in merged {
            let Some(device) = self.devices.get(index as usize) else {
                continue;
            };
            if !device.device.info().regular_file {
                continue;
            }
            if let Err(e) = device.device.discard(offset, length).await {
                tracing::debug!("pool {}: punching a hole for freed space failed: {e}", self.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::SimDelays;
    use crate::device::SimDevice;
    use crate::pool::superblock::Role;
    use crate::pool::NewDevice;
    use crate::sync::rank::separate;
    use std::future::Future;
    use std::task::{Context, Waker};

    /// Runs `test` on a current-thread runtime.
    fn block_on<F: Future>(test: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(test)
    }

    /// A new pool on simulated devices of 160 MiB, one per role, in order.
    async fn pool_on(roles: &[Role]) -> (Arc<Pool>, Vec<SimDevice>) {
        let sims: Vec<SimDevice> = (0..roles.len())
            .map(|i| SimDevice::new(160 << 20, 7 + i as u64))
            .collect();
        let devices = sims
            .iter()
            .zip(roles)
            .map(|(sim, role)| NewDevice {
                device: sim.as_device(),
                role: *role,
            })
            .collect();
        (Pool::create("test", 1 << 20, devices).await.unwrap(), sims)
    }

    #[test]
    fn concurrent_flushes_of_the_data_devices_share_one_unless_a_write_completed_meanwhile() {
        block_on(async {
            let (pool, sims) = pool_on(&[Role::Fast]).await;
            let sim = &sims[0];
            sim.set_delays(SimDelays::always(4));
            let flushes = || pool.data_flushes.load(Ordering::Relaxed);

            // Nothing written since the last flush: no flush.
            let before = flushes();
            pool.flush_data_devices().await.unwrap();
            assert_eq!(flushes(), before);

            // Two callers need the same completed write: one flush serves both.
            pool.note_data_write(0, 4096);
            let before = flushes();
            let (a, b) = tokio::join!(separate(pool.flush_data_devices()), separate(pool.flush_data_devices()));
            a.unwrap();
            b.unwrap();
            assert_eq!(flushes(), before + 1);

            // A write that completes while a flush is under way is not
            // covered by it: the second caller flushes again.
            pool.note_data_write(0, 4096);
            let before = flushes();
            let mut first = std::pin::pin!(separate(pool.flush_data_devices()));
            assert!(first
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_pending());
            assert_eq!(flushes(), before + 1, "the first flush is under way");
            pool.note_data_write(0, 4096);
            let (a, b) = tokio::join!(first.as_mut(), separate(pool.flush_data_devices()));
            a.unwrap();
            b.unwrap();
            assert_eq!(flushes(), before + 2);
            let written = &pool.devices.at(0).unwrap().written;
            assert_eq!(
                written.flushed.load(Ordering::Acquire),
                written.writes.load(Ordering::Acquire)
            );
        });
    }

    #[test]
    fn a_commit_flushes_only_the_data_devices_written_since_their_last_flush() {
        block_on(async {
            let (pool, sims) = pool_on(&[Role::Fast, Role::Capacity]).await;
            let (fast, capacity) = (&sims[0], &sims[1]);
            pool.flush_data_devices().await.unwrap();
            let flushes = |sim: &SimDevice| sim.stats().flushes;
            let (fast_before, capacity_before) = (flushes(fast), flushes(capacity));

            pool.note_data_write(1, 4096);
            pool.flush_data_devices().await.unwrap();
            assert_eq!(flushes(capacity), capacity_before + 1);
            assert_eq!(flushes(fast), fast_before, "nothing was written to the fast device");

            pool.note_data_write(0, 4096);
            pool.note_data_write(1, 4096);
            pool.flush_data_devices().await.unwrap();
            assert_eq!(flushes(fast), fast_before + 1);
            assert_eq!(flushes(capacity), capacity_before + 2);
            assert_eq!(pool.meta_counters().data_bytes, 3 * 4096);
        });
    }

    #[test]
    fn closing_the_write_gate_waits_for_writes_in_every_shard_and_keeps_new_ones_out() {
        block_on(async {
            let (pool, _sims) = pool_on(&[Role::Fast]).await;
            let mut context = Context::from_waker(Waker::noop());
            // Volumes in different shards write at once.
            let first = pool.enter_write(1).await;
            let second = pool.enter_write(2 + GATE_SHARDS as u32 * 3).await;
            assert!(pool.gate(1).try_write().is_err());
            assert!(pool.gate(2).try_write().is_err(), "volume ids wrap onto the shards");
            assert!(pool.gate(3).try_write().is_ok());
            // (Outside the cooperative budget, which creating the pool spent.)
            let mut closing = std::pin::pin!(tokio::task::unconstrained(separate(pool.close_gate())));
            assert!(closing.as_mut().poll(&mut context).is_pending());
            drop(first);
            assert!(
                closing.as_mut().poll(&mut context).is_pending(),
                "a write in another shard is still under way"
            );
            drop(second);
            let closed = match closing.as_mut().poll(&mut context) {
                std::task::Poll::Ready(guards) => guards,
                std::task::Poll::Pending => panic!("the gate did not close with no write under way"),
            };
            for volume in [0, 1, 63, 64, 1000] {
                assert!(pool.gate(volume).try_read().is_err(), "volume {volume} may write");
            }
            drop(closed);
            assert!(pool.gate(1000).try_read().is_ok());
        });
    }
}
