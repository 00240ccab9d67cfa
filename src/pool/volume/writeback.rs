//! The RAM write-back cache of a volume: cached writes (logged when they
//! must be durable), destaging blocks to their place, and flushes.

use super::*;
use crate::pool::MAP_ENTRIES_PER_PAGE;

/// What one locked step of a destage wrote (`EngineVolume::place_unit`):
/// released after the commit.
struct Placed {
    /// The blocks it locked (sorted).
    blocks: Vec<u64>,
    /// Every version it wrote, by sector then sequence number.
    versions: Vec<(u64, Entry)>,
    /// Which of `versions` were older versions of their sector then.
    was_older: Vec<bool>,
    /// Whether it appended `Written` records (superseding `Data` records
    /// once committed).
    superseding: bool,
}

impl EngineVolume {
    /// Blocks (sorted) holding cached sectors (any version) that match
    /// `filter`, at most `limit`.
    pub(crate) fn cached_blocks(&self, filter: impl Fn(&Entry) -> bool, limit: usize) -> Vec<u64> {
        let per_block = self.sectors_per_block();
        let state = self.cache.lock();
        let mut blocks: Vec<u64> = Vec::new();
        for (sector, entry) in state.entries.iter() {
            if blocks.len() >= limit && state.older.is_empty() {
                break;
            }
            let block = sector / per_block;
            if blocks.last() != Some(&block) && filter(entry) {
                blocks.push(block);
            }
        }
        if !state.older.is_empty() {
            blocks.extend(
                state
                    .older
                    .iter()
                    .filter(|(_, e)| filter(e))
                    .map(|((sector, _), _)| sector / per_block),
            );
            blocks.sort_unstable();
            blocks.dedup();
            blocks.truncate(limit);
        }
        blocks
    }

    /// Blocks of `[offset, offset + length)` holding cached sectors, and
    /// the blocks of its map pages holding cached writes of a snapshot (a
    /// change of the range copies those pages into the newest snapshot).
    pub(super) fn cached_blocks_in(&self, offset: u64, length: u64) -> Vec<u64> {
        let per_block = self.sectors_per_block();
        let first = offset / SECTOR_BYTES;
        let last = (offset + length.max(1) - 1) / SECTOR_BYTES;
        let state = self.cache.lock();
        let mut blocks: Vec<u64> = state
            .entries
            .range(first..=last)
            .map(|(sector, _)| sector / per_block)
            .collect();
        if state.pending > 0 {
            let pages = (first / per_block) / MAP_ENTRIES_PER_PAGE..=(last / per_block) / MAP_ENTRIES_PER_PAGE;
            blocks.extend(Self::pending_in_pages(&state, per_block, pages));
            blocks.sort_unstable();
        }
        blocks.dedup();
        blocks
    }

    /// Blocks holding pending entries (cached writes of a snapshot, not
    /// placed) in map pages `pages`, sorted.
    fn pending_in_pages(state: &VolState, per_block: u64, pages: impl IntoIterator<Item = u64>) -> Vec<u64> {
        let per_page = MAP_ENTRIES_PER_PAGE * per_block;
        let mut blocks = Vec::new();
        for page in pages {
            for sector in state.pending_sectors(page * per_page, (page + 1) * per_page - 1) {
                let block = sector / per_block;
                if blocks.last() != Some(&block) {
                    blocks.push(block);
                }
            }
        }
        blocks
    }

    /// The blocks outside `blocks` (sorted) holding pending entries older
    /// than what `blocks` hold in the same map pages: those must reach the
    /// map first (placing the newer copies the pages into a later
    /// snapshot). Exact while the caller holds the stripes of `blocks`.
    fn older_pending_outside(&self, blocks: &[u64]) -> Vec<u64> {
        if self.cache.lock().pending == 0 {
            return Vec::new();
        }
        let floors = self.pool.snapshots_read().floors(self.id);
        let after = |seq: u64| crate::pool::snapshots::taken_before_count(&floors, seq);
        let per_block = self.sectors_per_block();
        let per_page = MAP_ENTRIES_PER_PAGE * per_block;
        let state = self.cache.lock();
        // The newest snapshot each page's entries here come after.
        let mut newest: Vec<(u64, usize)> = Vec::new();
        for block in blocks {
            let page = block / MAP_ENTRIES_PER_PAGE;
            let group = state
                .entries
                .range(block * per_block..(block + 1) * per_block)
                .map(|(_, e)| after(e.seq))
                .max()
                .unwrap_or(0);
            match newest.last_mut() {
                Some((last, at)) if *last == page => *at = (*at).max(group),
                _ => newest.push((page, group)),
            }
        }
        let mut outside = Vec::new();
        for (page, group) in newest {
            for (sector, entry) in state.versions(page * per_page, (page + 1) * per_page - 1) {
                let block = sector / per_block;
                if state.is_pending(&entry)
                    && after(entry.seq) < group
                    && outside.last() != Some(&block)
                    && blocks.binary_search(&block).is_err()
                {
                    outside.push(block);
                }
            }
        }
        outside
    }

    /// Whether the map pages of `[offset, offset + length)` hold pending
    /// entries (a change there would place them first).
    fn pages_have_pending(&self, offset: u64, length: u64) -> bool {
        let per_block = self.sectors_per_block();
        let state = self.cache.lock();
        if state.pending == 0 {
            return false;
        }
        let per_page = MAP_ENTRIES_PER_PAGE * per_block;
        let first = offset / SECTOR_BYTES / per_page;
        let last = (offset + length - 1) / SECTOR_BYTES / per_page;
        state.any_pending(first * per_page, (last + 1) * per_page - 1)
    }

    /// Writes the cached sectors of `blocks` (sorted) to their place, commits
    /// (so they are durable and their log records superseded), then drops
    /// the entries nobody rewrote meanwhile.
    ///
    /// Cached writes that belong to a snapshot (written before it was
    /// taken) go in first, each as a change after the snapshot that was
    /// the newest when it was written: oldest first, and with every such
    /// entry of the same map pages, so a page is copied into a snapshot
    /// only once all it held before that snapshot is in it.
    ///
    /// While the cache holds such writes, the blocks are written a map page
    /// at a time, each page's stripes locked only while its blocks are
    /// written: a batch grows by the older versions of its pages (often
    /// tens of times its size), and holding all its stripes for all its
    /// writes would make every foreground write wait for the whole batch. The
    /// order that matters is within a page; one commit covers them all.
    pub(crate) async fn destage_blocks(&self, blocks: &[u64]) -> BlockResult<()> {
        // Without an `.await` when free (as the barrier and the stripes:
        // an awaited tokio lock spends the task's cooperative budget; this
        // one awaited per destage costs 25 % more CPU per cached 4K write).
        let _placement = match self.placement.try_read() {
            Ok(guard) => guard,
            Err(_) => self.placement.read().await,
        };
        // Log records appended from here on are newer than any Data record
        // the writes below supersede.
        let snap_lsn = self.pool.log.next_lsn();
        let appends = self.pool.log_appends();
        // The pass's Map and Written records are held back until its own
        // data flush below (`Log::defer`): appended with the rest, every
        // synchronous writer's commit meanwhile would flush the data
        // devices first, under the commit lock. On any way out before that
        // (an error, the task dropped), the guard appends them as records
        // that still need the flush.
        let pass = HeldBack::new(&self.pool.log);
        self.mark_pass(blocks).await?;
        let units: Vec<&[u64]> = blocks
            .chunk_by(|a, b| a / MAP_ENTRIES_PER_PAGE == b / MAP_ENTRIES_PER_PAGE)
            .collect();
        let mut placed = Vec::with_capacity(units.len());
        for unit in units {
            if let Some(done) = self.place_unit(unit, pass.id).await? {
                placed.push(done);
            }
        }
        if placed.is_empty() {
            return Ok(());
        }
        let written_records = placed.iter().any(|done| done.superseding);
        drop(_placement);
        if written_records || self.pool.log.holds(pass.id) || self.pool.log_appends() != appends {
            // Written records supersede Data records only once the data is
            // durable in place, and new mappings (Map records) are
            // committed so that later writes can overwrite their blocks in
            // place (a block whose mapping is pending goes to a new slot:
            // see `write_locked`). The destager flushes the data devices
            // itself, then appends its records, which need no flush of
            // anyone after that, and commits them: a commit of records
            // only, which flushes the data devices under the commit lock
            // only if some record taken still needs it (one a change of
            // its block pushed out before the flush).
            self.pool.flush_data_devices().await.map_err(io_error)?;
            pass.release_flushed();
            self.pool.commit_quiet_records().await.map_err(pool_error)?;
        }
        // Otherwise only never-logged sectors of mapped blocks were written
        // in place: no record, no durability promised yet, nothing to
        // commit (the next FLUSH or commit flushes the data devices).
        for done in placed {
            self.pool
                .cache
                .destaged_bytes
                .fetch_add(done.versions.len() as u64 * SECTOR_BYTES, Ordering::Relaxed);
            self.release_placed(done, snap_lsn).await;
        }
        self.pool.cache.space.notify_waiters();
        Ok(())
    }

    /// Makes the `Dirty` marks of the chunks a pass over `blocks` may
    /// overwrite in place durable in one commit, before it places
    /// anything. Each placement marks its own chunks too, but one at a
    /// time: alone, after every checkpoint (a new epoch), a pass over a
    /// volume's mapped blocks would wait for a log commit per chunk it came
    /// to (measured: 82-96 µs of each placement's 102-116 µs, the writers
    /// meanwhile queued for log room). Marking a chunk that is not
    /// overwritten after all (a block that goes to a new slot) costs only
    /// the mark.
    async fn mark_pass(&self, blocks: &[u64]) -> BlockResult<()> {
        let chunk_bytes = self.pool.chunk_bytes as u64;
        let mut places = Vec::new();
        for &block in blocks {
            let entry = self.pool.lookup(self.id, block).map_err(meta_error)?;
            if entry.is_shared() {
                continue;
            }
            if let Some((device, offset)) = entry.place() {
                places.push((device, offset / chunk_bytes * chunk_bytes));
            }
        }
        places.sort_unstable();
        places.dedup();
        self.pool.mark_dirty(&places).await.map_err(pool_error)?;
        Ok(())
    }

    /// Writes the cached versions of `blocks` (sorted; with snapshots'
    /// writes cached, all in one map page) and of the older versions of
    /// their pages, holding their stripes only meanwhile. `None` when
    /// nothing was cached there any more.
    async fn place_unit(&self, blocks: &[u64], pass: u64) -> BlockResult<Option<Placed>> {
        let per_block = self.sectors_per_block();
        // The blocks, and the older pending entries of their pages (found
        // with the blocks locked, so what they hold cannot change; others
        // can only be placed meanwhile, or become pending as newer ones).
        let mut expanded = blocks.to_vec();
        let guards = loop {
            let guards = self.lock_blocks_exclusive(&expanded).await;
            let outside = self.older_pending_outside(&expanded);
            if outside.is_empty() {
                break guards;
            }
            drop(guards);
            expanded.extend(outside);
            expanded.sort_unstable();
            expanded.dedup();
        };
        let blocks = expanded;
        let versions: Vec<(u64, Entry)> = {
            let state = self.cache.lock();
            blocks
                .iter()
                .flat_map(|block| state.versions(block * per_block, (block + 1) * per_block - 1))
                .collect()
        };
        if versions.is_empty() {
            return Ok(None);
        }
        // Which of them were older versions (`versions` lists a sector's
        // current entry after them): after the commit they are released,
        // and never confused with whatever the current entry is by then.
        let was_older: Vec<bool> = (0..versions.len())
            .map(|i| versions.get(i + 1).is_some_and(|(next, _)| *next == versions[i].0))
            .collect();
        // By the snapshot each entry came after (its index among the
        // volume's snapshots' `cache_seq`s), oldest first, then by sector.
        let floors = if self.pool.has_snapshots() {
            self.pool.snapshots_read().floors(self.id)
        } else {
            Vec::new()
        };
        let after = |seq: u64| crate::pool::snapshots::taken_before_count(&floors, seq);
        // An older version placed before is not written again. That happens
        // when two destages of a block overlap: the first placed the block's
        // versions and waits for its commit, not released yet, when a second
        // collects them all again. By then a newer version was placed too
        // (the page copied into the snapshot), and writing the older again
        // put it in the volume's own block over the newer. The second
        // destage's commit covers the first's writes; it releases the
        // skipped version with the others.
        let mut order: Vec<(usize, u64, Entry)> = versions
            .iter()
            .zip(&was_older)
            .filter(|((_, entry), was_older)| !(**was_older && entry.placed))
            .map(|((s, e), _)| (after(e.seq), *s, *e))
            .collect();
        // Two versions of a sector fall in different groups unless the
        // snapshot between them was deleted: then the older goes first.
        order.sort_unstable_by_key(|(group, sector, entry)| (*group, *sector, entry.seq));
        // Contiguous runs of sectors of one group become one write each.
        let mut start = 0;
        while start < order.len() {
            let mut stop = start + 1;
            while stop < order.len() && order[stop].0 == order[start].0 && order[stop].1 == order[stop - 1].1 + 1 {
                stop += 1;
            }
            let mut buf = IoBuf::new((stop - start) * SECTOR_BYTES as usize);
            for (i, (_, _, entry)) in order[start..stop].iter().enumerate() {
                let at = i * SECTOR_BYTES as usize;
                let dst = &mut buf.payload_mut()[at..at + SECTOR_BYTES as usize];
                // SAFETY: the exclusive block locks held here keep these
                // entries' slots from being rewritten or released.
                unsafe { self.pool.cache.ram.read(entry.slot, 0, dst) };
            }
            let written_at = order[start].2.seq;
            self.write_locked_in(order[start].1 * SECTOR_BYTES, buf, Some(written_at), None, Some(pass))
                .await?;
            // Placed: no longer holding a snapshot's page back. (Only
            // where snapshots exist: an entry of a volume without any that
            // one taken meanwhile finds unmarked is placed again, which is
            // harmless; the cache's lock is not taken once more per write.)
            if !floors.is_empty() {
                let mut state = self.cache.lock();
                let floor = state.floor;
                let mut placed = 0;
                for (_, sector, entry) in &order[start..stop] {
                    let version = match state.entries.get_mut(sector) {
                        Some(current) if current.seq == entry.seq => Some(current),
                        _ => state.older.get_mut(&(*sector, entry.seq)),
                    };
                    if let Some(version) = version {
                        if !version.placed {
                            version.placed = true;
                            placed += usize::from(version.seq < floor);
                        }
                    }
                }
                state.pending -= placed;
            }
            start = stop;
        }
        // Older Data records of these blocks are superseded once this is
        // committed (after the data devices are flushed). Held back with
        // the stripes still held: a newer write of one of these blocks
        // that logs its Data then appends this record first (`Log::defer`),
        // and a record appended after such a Data record would supersede
        // it too.
        let mut written = Vec::new();
        let mut last_block = None;
        for (sector, entry) in &versions {
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
        let superseding = !written.is_empty();
        for record in written {
            self.pool.log.defer(pass, record, None);
        }
        let released = {
            let mut state = self.cache.lock();
            let before = state.reserved.len();
            for block in &blocks {
                state.reserved.remove(block);
            }
            before - state.reserved.len()
        };
        self.pool.unreserve(released as u64 * self.block_bytes());
        drop(guards);
        Ok(Some(Placed {
            blocks,
            versions,
            was_older,
            superseding,
        }))
    }

    /// After the commit that made them durable in place: drops the versions
    /// a [`Self::place_unit`] wrote that nobody rewrote meanwhile, and frees
    /// their slots. `snap_lsn`: the log's end before they were collected.
    async fn release_placed(&self, done: Placed, snap_lsn: u64) {
        let Placed {
            blocks,
            versions,
            was_older,
            ..
        } = done;
        let guards = self.lock_blocks_exclusive(&blocks).await;
        // Older versions are released before the newer ones: a kill between
        // two releases may leave a newer version without its older one
        // (placed again after a restart: harmless) but never the other way
        // round (the older one would be placed over the newer).
        let mut freed_older = Vec::new();
        let mut freed = Vec::new();
        {
            let now = std::time::Instant::now();
            let mut state = self.cache.lock();
            for ((sector, entry), was_older) in versions.iter().zip(&was_older) {
                if state.older.contains_key(&(*sector, entry.seq)) {
                    // Replaced by a newer version (before this destage, or
                    // since): written above, and committed; nothing reads
                    // it any more.
                    let older = state.remove_older(*sector, entry.seq).expect("present");
                    freed_older.push(older.slot);
                    continue;
                }
                if *was_older {
                    // Released by another destage of the block meanwhile.
                    continue;
                }
                let Some(current) = state.entries.get_mut(sector) else {
                    continue;
                };
                if current.seq == entry.seq && current.logged_at == entry.logged_at {
                    freed.push(current.slot);
                    state.remove(*sector);
                } else if current.seq == entry.seq {
                    // Logged meanwhile (a FLUSH between our two locked
                    // phases): its new Data record comes after our Written
                    // record, so recovery would replay it over whatever
                    // later trims or overwrites do. Keep the entry: the next
                    // destage writes it again and supersedes that record.
                    current.since = now;
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
        for slot in freed_older.into_iter().chain(freed) {
            // SAFETY: the entries that referred to these slots were removed
            // above under the exclusive block locks; no reader holds them.
            unsafe { self.pool.cache.ram.release(slot) };
        }
    }

    /// Destages the cached blocks of a range (and pending entries of its
    /// map pages) without holding any lock: done before a change of the
    /// range takes the barrier, so that a snapshot does not wait for it
    /// (`clear_cached`, under the barrier, then usually finds nothing).
    pub(super) async fn place_cached_in(&self, offset: u64, length: u64) -> BlockResult<()> {
        let blocks = self.cached_blocks_in(offset, length);
        for batch in blocks.chunks(512) {
            self.destage_blocks(batch).await?;
        }
        Ok(())
    }

    /// Whether the volume's cache holds writes of a snapshot not placed yet.
    pub(crate) fn has_pending(&self) -> bool {
        self.cache.lock().pending > 0
    }

    /// The barrier and the range's stripes, with no cached sector left in
    /// it (see [`Self::try_barrier`]), for a change that bypasses the cache.
    /// With `in_place`, the `Dirty` marks for overwriting the range's blocks
    /// in place are made durable first, before the barrier (their commit
    /// may wait for a data flush).
    pub(super) async fn lock_for_change(
        &self,
        offset: u64,
        length: u64,
        in_place: bool,
    ) -> BlockResult<(RwLockReadGuard<'_, ()>, Vec<RwLockWriteGuard<'_, ()>>)> {
        match self.lock_for_change_unless(offset, length, in_place, &|| false).await? {
            Some(locked) => Ok(locked),
            None => unreachable!("no reason to give way"),
        }
    }

    /// [`Self::lock_for_change`], or `None` (holding nothing) as soon as
    /// `give_way` says so before a round of clearing the range.
    async fn lock_for_change_unless(
        &self,
        offset: u64,
        length: u64,
        in_place: bool,
        give_way: &(dyn Fn() -> bool + Sync),
    ) -> BlockResult<Option<(RwLockReadGuard<'_, ()>, Vec<RwLockWriteGuard<'_, ()>>)>> {
        loop {
            if give_way() {
                return Ok(None);
            }
            let guards = self.clear_cached(offset, length).await?;
            if in_place {
                self.mark_in_place(offset, offset + length).await?;
            }
            if let Some(barrier) = self.try_barrier() {
                // A snapshot taken since the range was cleared made the
                // cached writes of its pages (outside the range) pending:
                // placed first, so no page is copied before them.
                if self.cached_blocks_in(offset, length).is_empty() {
                    return Ok(Some((barrier, guards)));
                }
                drop(barrier);
                drop(guards);
                continue;
            }
            drop(guards);
            self.pass_barrier().await;
        }
    }

    /// Destages every cached block of a range (before it is trimmed, zeroed
    /// or written around the cache) and returns its locks with no cached
    /// sector left in it.
    pub(super) async fn clear_cached(&self, offset: u64, length: u64) -> BlockResult<Vec<RwLockWriteGuard<'_, ()>>> {
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
    /// (logged, or written in place with `logbias=throughput`). Holds the
    /// volume's barrier only while it changes the cache or the map: what it
    /// waits for first (room in the RAM tier) does not hold up a snapshot.
    /// A cached version it replaces that belongs to a snapshot is not
    /// placed first: the cache keeps it beside the new one (`VolState::older`)
    /// until the destager places both, so the writer never waits for a
    /// destage or a commit.
    pub(super) async fn write_cached(&self, offset: u64, data: IoBuf, durable: bool) -> BlockResult<()> {
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
        // And so do all writes while the pool is short of space: a write
        // that needs new space then fails now, not after its acknowledgement.
        // Except where the cache holds a snapshot's writes not placed yet
        // in the same map pages: a write around the cache would place them
        // first, with the client waiting.
        let must_go_around = count * SECTOR_BYTES as usize >= WRITE_AROUND_BYTES
            || count > ram.total_slots() / 4
            || self.pool.space_short();
        let data = if must_go_around
            || (!durable
                && ram.free_slots() < ram.total_slots() / 2
                && !(self.pool.has_snapshots() && self.pages_have_pending(offset, length)))
        {
            match self.write_through(offset, data, durable, !must_go_around).await? {
                None => return Ok(()),
                // A snapshot made the pages' cached writes pending meanwhile.
                Some(data) => data,
            }
        } else {
            data
        };
        // A synchronous write's data goes to the log: room for it first
        // (holding nothing: making room destages and checkpoints).
        if durable && !self.log_throughput.load(Ordering::Acquire) {
            self.pool
                .wait_for_log_room(count as u64 * (SECTOR_BYTES + 64))
                .await
                .map_err(pool_error)?;
        }
        // Space for blocks that are not mapped yet is promised before the
        // write is accepted, so the destage cannot run out of it later. When
        // the pool is full but trims or overwrites have freed slots that only
        // a commit makes reusable, commit once and try again.
        let mut committed_for_space = false;
        let (slots, barrier, guards, reserved) = loop {
            let slots = loop {
                self.pool.make_room(count).await.map_err(pool_error)?;
                if let Some(slots) = self.pool.cache.ram.allocate(count) {
                    break slots;
                }
            };
            let (guards, barrier) = loop {
                let guards = self.lock_exclusive(offset, length).await;
                if let Some(barrier) = self.try_barrier() {
                    break (guards, barrier);
                }
                drop(guards);
                self.pass_barrier().await;
            };
            match self.reserve_unmapped(offset, end) {
                Ok(reserved) => break (slots, barrier, guards, reserved),
                Err(e) => {
                    self.pool.cache.ram.give_back(&slots);
                    drop(guards);
                    drop(barrier);
                    if matches!(e, BlockError::NoSpace) && !committed_for_space && self.pool.log.has_pending_frees() {
                        committed_for_space = true;
                        self.pool.commit_for_space().await.map_err(pool_error)?;
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
            Some(self.pool.enter_write(self.id).await)
        } else {
            None
        };
        let logged = log_data.then(|| (self.pool.cache.next_ordinal(), self.pool.log.next_lsn()));
        let (crcs, seq) = self
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
                    seq: seq + i as u64,
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
        drop(barrier);
        if durable {
            if log_data {
                // The data is in its Data records: they are what must be
                // durable, not whatever the destager wrote meanwhile.
                self.pool.commit_records().await.map_err(pool_error)?;
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
            if !self.pool.lookup(self.id, block).map_err(meta_error)?.is_mapped() {
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

    /// A write that bypasses the cache goes to its place directly. With
    /// `give_way` (a write sent around the cache only because the RAM tier
    /// is busy), it hands its data back (`Some`) to go through the cache
    /// when the map pages of its range hold cached writes of a snapshot,
    /// as it would have if they had when it was sent: going around would
    /// place those first (all of its pages' pending writes, then a data
    /// flush and a commit) with the client waiting. A snapshot taken while
    /// writes went around stopped every one of them for 0.4 s that way.
    async fn write_through(
        &self,
        offset: u64,
        data: IoBuf,
        durable: bool,
        give_way: bool,
    ) -> BlockResult<Option<IoBuf>> {
        let length = data.len() as u64;
        let pending_ahead = || give_way && self.pool.has_snapshots() && self.pages_have_pending(offset, length);
        if pending_ahead() {
            return Ok(Some(data));
        }
        self.place_cached_in(offset, length).await?;
        let end = offset + length;
        // The blocks it will allocate are reserved first, like a cached
        // write's: space promised to cached writes is never taken. Slots
        // freed by trims are reusable only once committed: on a full pool,
        // commit them once and try again.
        let mut committed_for_space = false;
        let (barrier, guards, reserved) = loop {
            let Some((barrier, guards)) = self
                .lock_for_change_unless(offset, length, true, &pending_ahead)
                .await?
            else {
                return Ok(Some(data));
            };
            match self.reserve_unmapped(offset, end) {
                Ok(reserved) => break (barrier, guards, reserved),
                Err(BlockError::NoSpace) if !committed_for_space && self.pool.log.has_pending_frees() => {
                    drop(guards);
                    drop(barrier);
                    committed_for_space = true;
                    self.pool.commit_for_space().await.map_err(pool_error)?;
                }
                Err(e) => return Err(e),
            }
        };
        let appends = self.pool.log_appends();
        let result = self.write_locked(offset, data, None).await;
        if matches!(result, Err(BlockError::NoSpace)) {
            self.pool.note_no_space();
        }
        // Allocated now (or failed): the promise is no longer needed.
        self.unreserve_blocks(&reserved);
        drop(guards);
        drop(barrier);
        self.finish(result, durable, appends).await.map(|()| None)
    }

    /// FLUSH: makes every write completed before it durable. The cache's
    /// unlogged sectors go to the intent log in one group commit, or, when
    /// they are many (or `logbias=throughput`), to their place.
    pub(super) async fn flush_cached(&self) -> BlockResult<()> {
        let per_block = self.sectors_per_block();
        // A snapshot's versions that newer writes replaced are placed (with
        // their blocks), not logged: a Data record of an older version could
        // land after the `Written` record of a destage that placed a newer
        // one, and replay would restore the older over it.
        let older: Vec<u64> = {
            let state = self.cache.lock();
            let mut blocks: Vec<u64> = state
                .older
                .iter()
                .filter(|(_, e)| e.unlogged && !e.placed)
                .map(|((sector, _), _)| sector / per_block)
                .collect();
            blocks.dedup();
            blocks
        };
        for batch in older.chunks(512) {
            self.destage_blocks(batch).await?;
        }
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
        let gate = self.pool.enter_write(self.id).await;
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
                    seq: entry.seq,
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
}

/// A destage pass's number for the records it holds back; appends them on
/// drop (needing the data flush still) unless released after the flush.
struct HeldBack<'a> {
    log: &'a crate::meta::log::Log,
    id: u64,
    released: bool,
}

impl<'a> HeldBack<'a> {
    fn new(log: &'a crate::meta::log::Log) -> Self {
        HeldBack {
            log,
            id: log.new_pass(),
            released: false,
        }
    }

    /// After a flush of the data devices that began once every write of
    /// the pass was done.
    fn release_flushed(mut self) {
        self.log.release(self.id, true);
        self.released = true;
    }
}

impl Drop for HeldBack<'_> {
    fn drop(&mut self) {
        if !self.released {
            self.log.release(self.id, false);
        }
    }
}
