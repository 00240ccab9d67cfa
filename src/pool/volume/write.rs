//! Writes in place: planning where each block goes (overwrite, or a new
//! slot near its neighbours), coalescing contiguous runs into one device
//! write, and recording new mappings and checksums; trim and zeroing.

use super::*;

/// One device write planned by a request (one or more volume blocks that
/// are contiguous on the device).
pub(super) struct PlannedWrite {
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
    offset: u64,
    /// The volume byte offset of the part's first sector (what its stored
    /// checksums are tagged with).
    logical: u64,
    /// This part's sectors: indices into the write's `crcs`.
    sectors: std::ops::Range<usize>,
    /// Set for a newly allocated block: its logical block number.
    new_block: Option<u64>,
    /// For a new block: the map entry it replaces (a slot a snapshot
    /// shares, or a relocated block's own; `BlockPtr::NONE` for a first
    /// write).
    replaces: BlockPtr,
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
            offset: piece.offset,
            logical: piece.logical,
            sectors: start..self.crcs.len(),
            new_block: piece.new_block.then_some(piece.block),
            replaces: piece.replaces,
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
                offset: piece.offset,
                logical: piece.logical,
                sectors: 0..sums.len(),
                new_block: piece.new_block.then_some(piece.block),
                replaces: piece.replaces,
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
    /// The volume byte offset of `offset`.
    logical: u64,
    data: Payload,
    block: u64,
    new_block: bool,
    /// See [`Part::replaces`].
    replaces: BlockPtr,
}

/// The sector checksums of ranges of a request's payload: the ones
/// computed as it arrived ([`IoBuf::piece_crcs`]) where they line up with
/// the range, else computed now.
pub(super) struct CrcSource<'a> {
    payload: &'a [u8],
    pieces: Option<&'a [u32]>,
}

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
pub(super) fn coalesce(planned: Vec<PlannedWrite>, source: &[u8]) -> Vec<PlannedWrite> {
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

/// Whether a write to `block` (map `entry`) may overwrite it where it is,
/// if it is mapped: not shared with a snapshot and not to be relocated
/// (its allocation still pending: see `EngineVolume::write_locked`).
fn stays_in_place(entry: BlockPtr, block: u64, relocate: &[u64]) -> bool {
    !entry.is_shared() && !relocate.contains(&block)
}

pub(crate) fn sector_crcs(bytes: &[u8]) -> Vec<u32> {
    let mut sums = Vec::with_capacity(bytes.len() / SECTOR_BYTES as usize);
    crate::checksum::extend_sector_sums(bytes, &mut sums);
    sums
}

impl EngineVolume {
    /// Where the first new block of a write of `blocks` blocks at `offset`
    /// should go: after the logical block before it, else before the one
    /// after it, else (a write of several blocks with neither neighbour
    /// written) a fresh chunk at the matching place.
    fn first_hint(&self, offset: u64, blocks: u64) -> BlockResult<Option<Hint>> {
        let first = offset >> self.block_shift;
        if first > 0 {
            if let Some((device, base)) = self.pool.lookup(self.id, first - 1).map_err(meta_error)?.place() {
                return Ok(Some(Hint::At(device, base + self.block_bytes())));
            }
        }
        let after = first + blocks;
        if after < self.size_bytes().div_ceil(self.block_bytes()) {
            if let Some((device, base)) = self.pool.lookup(self.id, after).map_err(meta_error)?.place() {
                if let Some(start) = base.checked_sub(blocks * self.block_bytes()) {
                    return Ok(Some(Hint::At(device, start)));
                }
            }
        }
        Ok((blocks >= FRESH_CHUNK_MIN_BLOCKS).then_some(Hint::FreshChunk { logical_slot: first }))
    }

    /// Plans the device writes that store `data` at volume `offset`; the
    /// blocks in `relocate` go to new slots. Caller holds the stripe locks
    /// and the pool's write gate.
    async fn plan(
        &self,
        offset: u64,
        data: &[u8],
        pieces: Option<&[u32]>,
        entries: &[BlockPtr],
        relocate: &[u64],
        tier: Option<Role>,
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
            let in_place = stays_in_place(entries[index], block, relocate);
            let piece = match entries[index].place() {
                Some((device, base)) if in_place => {
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
                        logical: (block << self.block_shift) + start,
                        data: sectors,
                        block,
                        new_block: false,
                        replaces: BlockPtr::NONE,
                    }
                }
                old => {
                    // First write (allocate and write the whole block), or
                    // a write to a block a snapshot shares (or to be
                    // relocated): the same into a new slot, the rest of the
                    // block copied from the old one, which stays the
                    // snapshot's (or is freed by the new mapping's commit).
                    if hint.is_none() {
                        hint = self.first_hint(offset, entries.len() as u64)?;
                    }
                    let slot = match tier {
                        Some(role) => self.pool.allocate_in_tier(self.block_shift as u8, role),
                        None => self.pool.allocate_near(self.block_shift as u8, hint),
                    };
                    let Some((device, base)) = slot else {
                        for write in &planned {
                            write.release_new_slots(&self.pool);
                        }
                        return Err(BlockError::NoSpace);
                    };
                    let whole = if step == self.block_bytes() {
                        Payload::Source(at..at + step as usize)
                    } else {
                        let mut whole = match old {
                            Some((old_device, old_base)) => {
                                let logical = block << self.block_shift;
                                match self
                                    .read_sectors(old_device, old_base, self.block_bytes(), logical, true)
                                    .await
                                {
                                    Ok(whole) => whole,
                                    Err(e) => {
                                        self.pool.release_unused(device, base);
                                        for write in &planned {
                                            write.release_new_slots(&self.pool);
                                        }
                                        return Err(e);
                                    }
                                }
                            }
                            None => IoBuf::new(self.block_bytes() as usize),
                        };
                        whole.payload_mut()[within as usize..(within + step) as usize].copy_from_slice(source);
                        Payload::Owned(whole)
                    };
                    hint = Some(Hint::At(device, base + self.block_bytes()));
                    Piece {
                        device,
                        offset: base,
                        logical: block << self.block_shift,
                        data: whole,
                        block,
                        new_block: true,
                        replaces: entries[index],
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
    /// `written_at`: for cached data being placed, its cache sequence
    /// number (which snapshot the change comes after: `Pool::ensure_private`);
    /// `None` for a change made now.
    pub(super) async fn write_locked(&self, offset: u64, data: IoBuf, written_at: Option<u64>) -> BlockResult<()> {
        self.write_locked_in(offset, data, written_at, None, None).await
    }

    /// [`Self::write_locked`]; with a `tier`, every block of the range goes
    /// to a new slot on that tier (the migrator moving blocks: whole
    /// blocks of their own data), and the write adds no heat. With a
    /// destage `pass`, the `Map` records are held back for it
    /// ([`crate::meta::log::Log::defer`]).
    pub(super) async fn write_locked_in(
        &self,
        offset: u64,
        data: IoBuf,
        written_at: Option<u64>,
        tier: Option<Role>,
        pass: Option<u64>,
    ) -> BlockResult<()> {
        self.invalidate_read_cache(offset, data.len() as u64);
        let first = offset >> self.block_shift;
        let last = (offset + data.len() as u64 - 1) >> self.block_shift;
        // A block whose allocation is not committed yet (its `Map` record at
        // most staged) goes to a new slot, as if a snapshot shared it:
        // recovery after a kill -9 replays a staged mapping only if its data
        // still matches the record's checksums, and an overwrite in place
        // would break that, losing the block. Its old slot is freed by the
        // commit of the new mapping. (On a pool short of space, commit
        // instead, and overwrite in place.)
        //
        // Such a new slot is promised to nobody: on a full pool it may be
        // the last one, which a cached write's reservation counted on (two
        // destages of one block overlapping, or a rewrite just after a first
        // write). So when the slots run out and a commit would give some
        // back (staged mappings then overwrite in place; slots that trims or
        // overwrites freed become reusable), commit once and plan again.
        let mut retried = false;
        let (gate, planned) = loop {
            let mut entries = self.pool.lookup_range(self.id, first, last).map_err(meta_error)?;
            // (No look at the log's pending records, and no lock, for a
            // write that overwrites nothing: a first write.)
            let mut relocate = if entries.iter().any(|e| e.is_mapped()) {
                self.pool.log.pending_allocations(self.id, first, last)
            } else {
                Vec::new()
            };
            if !relocate.is_empty() && (retried || self.pool.space_short()) && tier.is_none() {
                self.pool.commit_for_space().await.map_err(pool_error)?;
                relocate.clear();
            }
            if tier.is_some() {
                relocate = (first..=last).collect();
            }
            // The chunks it overwrites in place must be durably marked dirty
            // first. A block a snapshot shares (or will, once its page is
            // copied into the snapshot) goes to a new slot and needs no mark:
            // after a snapshot, a mark per chunk would often cost a full
            // commit. The mark belongs to an epoch, and what is overwritten in
            // place is known only once pages are copied (under the gate): both
            // are checked there, and the marks taken again if needed.
            let gate = loop {
                let places = self.in_place_candidates(first, &entries, written_at, &relocate)?;
                let epoch = self.pool.mark_dirty(&places).await.map_err(pool_error)?;
                let gate = self.pool.enter_write(self.id).await;
                if self.pool.epoch() != epoch {
                    continue;
                }
                // Pages shared with a snapshot are copied into it first; their
                // entries are then shared, and those blocks go to new slots.
                if self.make_private(first, last, written_at)? {
                    entries = self.pool.lookup_range(self.id, first, last).map_err(meta_error)?;
                }
                let in_place = (first..)
                    .zip(&entries)
                    .filter(|(block, e)| stays_in_place(**e, *block, &relocate));
                if in_place
                    .filter_map(|(_, e)| e.place())
                    .all(|place| self.pool.is_marked(place, epoch))
                {
                    break gate;
                }
            };
            match self
                .plan(offset, data.payload(), data.piece_crcs(), &entries, &relocate, tier)
                .await
            {
                Ok(planned) => break (gate, planned),
                Err(BlockError::NoSpace)
                    if tier.is_none() && !retried && (!relocate.is_empty() || self.pool.log.has_pending_frees()) =>
                {
                    drop(gate);
                    self.pool.commit_for_space().await.map_err(pool_error)?;
                    retried = true;
                }
                Err(e) => return Err(e),
            }
        };
        // New blocks land in chunks that may hold mapped data of other
        // blocks; their records carry checksums, so no mark is needed. The
        // sectors overwritten in place are noted first (under the gate, in
        // this epoch): were the process to die during the write, recovery
        // repairs their checksums from the data, and only theirs.
        let epoch = self.pool.epoch();
        for write in &planned {
            for part in write.parts.iter().filter(|part| part.new_block.is_none()) {
                let length = part.sectors.len() as u64 * SECTOR_BYTES;
                self.pool.note_in_place(write.device, part.offset, length, epoch);
            }
        }
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
            let pool_device = match self.pool.data_device(write.device) {
                Ok(pool_device) => pool_device,
                Err(e) => {
                    write.release_new_slots(&self.pool);
                    failure = Some(meta_error(e));
                    continue;
                }
            };
            let whole_source = source.as_ref().is_some_and(|buf| match &write.data {
                Payload::Source(range) => range.start == 0 && range.end == buf.len(),
                Payload::Owned(_) => false,
            });
            let payload = std::mem::replace(&mut write.data, Payload::Source(0..0));
            // Written from the memory it is in if the device takes borrowed
            // memory (a buffered file: a copy into its mapping, or `pwrite`;
            // only data takes the mapping, see `device::mapped`), else from
            // the request's buffer or a copy of its part.
            let bytes = match &payload {
                Payload::Source(range) => &source.as_ref().expect("the request's buffer").payload()[range.clone()],
                Payload::Owned(buf) => buf.payload(),
            };
            let in_place = pool_device
                .device
                .write_now(write.offset, bytes)
                .map(|result| (result, bytes.len() as u64));
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
                    if tier.is_none() {
                        self.pool.note_heat(write.device, write.offset, true, 1);
                    }
                    self.pool.note_data_write(write.device, length);
                    done.push(write)
                }
                Err(e) => {
                    pool_device.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                    write.release_new_slots(&self.pool);
                    // An overwrite in place may have reached the device in
                    // part (a file system out of space refuses the rest):
                    // its chunk's checksums are not trusted until the data
                    // is read (and the checksums repaired from it) or
                    // rewritten, as after a crash.
                    for part in write.parts.iter().filter(|part| part.new_block.is_none()) {
                        let length = part.sectors.len() as u64 * SECTOR_BYTES;
                        self.pool.mark_suspect(write.device, part.offset, length);
                    }
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
            if let Err(e) = self.account_write(&write, pass) {
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
    fn account_write(&self, write: &PlannedWrite, pass: Option<u64>) -> Result<(), MetaError> {
        let mut stored = write.crcs.clone();
        for part in &write.parts {
            self.pool.tag_crcs(&mut stored[part.sectors.clone()], part.logical);
        }
        if let Err(e) = self.pool.set_crcs(write.device, write.offset, &stored) {
            write.release_new_slots(&self.pool);
            return Err(e);
        }
        for (index, part) in write.parts.iter().enumerate() {
            let Some(block) = part.new_block else { continue };
            let entry = BlockPtr::at(write.device, part.offset);
            if let Err(e) = self.pool.set_mapping(self.id, block, entry) {
                for unmapped in &write.parts[index..] {
                    if unmapped.new_block.is_some() {
                        self.pool.release_unused(write.device, unmapped.offset);
                    }
                }
                return Err(e);
            }
            // A block copied on write was mapped already.
            if part.replaces == BlockPtr::NONE {
                self.mapped_blocks.fetch_add(1, Ordering::Relaxed);
            }
            self.pool.log_mapping_in(
                Record::map(
                    self.id,
                    block,
                    entry,
                    part.replaces,
                    write.crcs[part.sectors.clone()].to_vec(),
                ),
                pass,
            );
        }
        Ok(())
    }

    /// Makes durable the `Dirty` marks a write of `[offset, end)` made now
    /// needs (see `write_locked`, which checks them under its gate).
    pub(super) async fn mark_in_place(&self, offset: u64, end: u64) -> BlockResult<()> {
        let (first, last) = (offset >> self.block_shift, (end - 1) >> self.block_shift);
        let entries = self.pool.lookup_range(self.id, first, last).map_err(meta_error)?;
        let places = self.in_place_candidates(first, &entries, None, &[])?;
        self.pool.mark_dirty(&places).await.map_err(pool_error)?;
        Ok(())
    }

    /// The places of the blocks from `first` (their map `entries`) a write
    /// may overwrite in place: mapped, not shared with a snapshot, not in a
    /// page about to be copied into one (see `make_private`), and not among
    /// the blocks it moves to new slots (`relocate`).
    fn in_place_candidates(
        &self,
        first: u64,
        entries: &[BlockPtr],
        written_at: Option<u64>,
        relocate: &[u64],
    ) -> BlockResult<Vec<(u8, u64)>> {
        let mut places = Vec::with_capacity(entries.len());
        let mut copied_page = None;
        for (block, entry) in (first..).zip(entries) {
            if !stays_in_place(*entry, block, relocate) {
                continue;
            }
            let Some(place) = entry.place() else {
                continue;
            };
            let page = block / crate::pool::MAP_ENTRIES_PER_PAGE;
            let copied = match copied_page {
                Some((known, copied)) if known == page => copied,
                _ => {
                    let copied = self
                        .pool
                        .page_will_be_copied(self.id, block, written_at)
                        .map_err(meta_error)?;
                    copied_page = Some((page, copied));
                    copied
                }
            };
            if !copied {
                places.push(place);
            }
        }
        Ok(places)
    }

    /// Makes the map pages of blocks `first..=last` the volume's own (see
    /// `Pool::ensure_private`); true if the volume has snapshots (its
    /// entries may have become shared: look them up again). Caller holds
    /// the write gate.
    fn make_private(&self, first: u64, last: u64, written_at: Option<u64>) -> BlockResult<bool> {
        if !self.pool.has_snapshots() {
            return Ok(false);
        }
        let mut block = first;
        while block <= last {
            self.pool
                .ensure_private(self.id, block, written_at)
                .map_err(meta_error)?;
            block = (block / crate::pool::MAP_ENTRIES_PER_PAGE + 1) * crate::pool::MAP_ENTRIES_PER_PAGE;
        }
        Ok(true)
    }

    /// Unmaps whole blocks and zeroes partial ones in `[offset, offset + length)`.
    pub(super) async fn trim_locked(&self, offset: u64, length: u64) -> BlockResult<()> {
        let end = offset + length;
        let mut position = offset;
        while position < end {
            let block = position >> self.block_shift;
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            let entry = self.pool.lookup(self.id, block).map_err(meta_error)?;
            if entry.is_mapped() {
                if step == self.block_bytes() {
                    self.invalidate_read_cache(position, step);
                    let _gate = self.pool.enter_write(self.id).await;
                    // A slot a snapshot shares is unmapped, not freed.
                    let entry = if self.make_private(block, block, None)? {
                        self.pool.lookup(self.id, block).map_err(meta_error)?
                    } else {
                        entry
                    };
                    self.pool
                        .set_mapping(self.id, block, BlockPtr::NONE)
                        .map_err(meta_error)?;
                    self.mapped_blocks.fetch_sub(1, Ordering::Relaxed);
                    self.pool
                        .log_mapping(Record::map(self.id, block, BlockPtr::NONE, entry, Vec::new()));
                } else {
                    self.write_locked(position, IoBuf::new(step as usize), None).await?;
                }
            }
            position += step;
        }
        self.pool.maybe_checkpoint_soon();
        Ok(())
    }

    /// Writes zeros without deallocating (WRITE_ZEROES with NO_HOLE).
    pub(super) async fn zero_locked(&self, offset: u64, length: u64) -> BlockResult<()> {
        let end = offset + length;
        let mut position = offset;
        while position < end {
            let within = position & (self.block_bytes() - 1);
            let step = (self.block_bytes() - within).min(end - position);
            self.write_locked(position, IoBuf::new(step as usize), None).await?;
            position += step;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                    offset,
                    logical: block * 4096,
                    sectors: 0..crcs.len(),
                    new_block: Some(block),
                    replaces: BlockPtr::NONE,
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
        let parts: Vec<(Option<u64>, u64, std::ops::Range<usize>)> = merged[0]
            .parts
            .iter()
            .map(|part| (part.new_block, part.offset, part.sectors.clone()))
            .collect();
        assert_eq!(
            parts,
            vec![(Some(10), 0, 0..1), (Some(11), s, 1..4), (Some(12), 4 * s, 4..6)]
        );
        assert!(matches!(&merged[1].data, Payload::Source(range) if *range == (6 * sector..8 * sector)));
        assert_eq!(merged[1].crcs, sector_crcs(&source[6 * sector..]));
    }
}
