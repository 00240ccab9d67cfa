//! The block map and the checksum table: the one place that reads and
//! changes map entries (`volume, block -> device, offset`) and per-sector
//! checksums, through the bounded page caches over the metadata store.

use super::*;

/// Where a block lives: one block-map entry. The bits are this room's
/// alone (docs/FORMAT.md gives them for the stored form): bits 0..48 the
/// slot's first 4 KiB sector on its device, bits 48..56 the device index,
/// bits 56..63 flags (bit 62 `SHARED`, the others zero), bit 63 "mapped".
/// Everything outside reads and changes a pointer through the names below.
/// Only the conversions of stored map pages and log records see its bits
/// ([`BlockPtr::to_bits`], [`BlockPtr::from_bits`]): this room's `MapPage`
/// and `Record` methods (the codecs in `meta/` are below the pool and keep
/// the word), recovery's replay of `Map` and `Relocate` records, and the
/// geometry check of stored entries ([`BlockPtr::LAYOUT`]).
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct BlockPtr(u64);

const OFFSET_BITS: u32 = 48;
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
const DEVICE_SHIFT: u32 = OFFSET_BITS;
const DEVICE_MASK: u64 = 0xff << DEVICE_SHIFT;
/// The flag bits (only `SHARED` is in use): masked off to compare slots.
const FLAGS: u64 = 0x7f << 56;
/// The slot is also mapped by a snapshot of the volume: a write to the
/// block goes to a new slot (copy-on-write), and an unmap or overwrite does
/// not free it (`pool/snapshots/cow.rs`).
const SHARED: u64 = 1 << 62;
const MAPPED: u64 = 1 << 63;
const _: () = assert!(SHARED & FLAGS == SHARED);
// The fields are disjoint and cover the word exactly.
const _: () = assert!(OFFSET_MASK & DEVICE_MASK == 0 && (OFFSET_MASK | DEVICE_MASK) & (FLAGS | MAPPED) == 0);
const _: () = assert!(FLAGS & MAPPED == 0 && (OFFSET_MASK | DEVICE_MASK | FLAGS | MAPPED) == u64::MAX);
// Every pool member's index fits the device field.
const _: () = assert!(superblock::MAX_MEMBERS as u64 <= (DEVICE_MASK >> DEVICE_SHIFT) + 1);
// 2^48 sectors of 4 KiB: devices up to 1 EiB.
const _: () = assert!(SECTOR_SHIFT == 12);

impl BlockPtr {
    /// An unmapped block (reads as zeros; stored as 0).
    pub(crate) const NONE: BlockPtr = BlockPtr(0);

    /// The layout of a stored pointer as the metadata layer's checks see
    /// it (the geometry check of map pages and log records).
    pub(crate) const LAYOUT: crate::meta::geometry::EntryLayout = crate::meta::geometry::EntryLayout {
        valid: MAPPED,
        must_be_clear: FLAGS & !SHARED,
        decode: |bits| BlockPtr(bits).place(),
    };

    /// The pointer to the slot at byte `offset` (4 KiB aligned) of pool
    /// member `device`, not shared.
    pub(crate) fn at(device: u8, offset: u64) -> BlockPtr {
        assert!(
            offset.is_multiple_of(SECTOR_BYTES) && offset >> SECTOR_SHIFT <= OFFSET_MASK,
            "block pointer to offset {offset} of device {device}"
        );
        BlockPtr(MAPPED | (device as u64) << DEVICE_SHIFT | (offset >> SECTOR_SHIFT))
    }

    /// Whether the block has a slot.
    pub(crate) fn is_mapped(self) -> bool {
        self.0 & MAPPED != 0
    }

    /// Whether a snapshot maps the slot too (a write to the block goes to a
    /// new slot and leaves this one).
    pub(crate) fn is_shared(self) -> bool {
        self.0 & SHARED != 0
    }

    /// The pointer marked shared (an unmapped one stays unmapped).
    pub(crate) fn shared(self) -> BlockPtr {
        if self.is_mapped() {
            BlockPtr(self.0 | SHARED)
        } else {
            self
        }
    }

    /// The pointer not marked shared (no snapshot maps the slot any more).
    pub(crate) fn private(self) -> BlockPtr {
        BlockPtr(self.0 & !SHARED)
    }

    /// The slot alone, without any flag: as the log names it and as sets
    /// of slots hold it.
    pub(crate) fn slot(self) -> BlockPtr {
        BlockPtr(self.0 & !FLAGS)
    }

    /// The pointer to `to`'s slot with this pointer's flags (a relocated
    /// block stays as shared as it was).
    pub(crate) fn moved_to(self, to: BlockPtr) -> BlockPtr {
        BlockPtr((to.0 & !FLAGS) | (self.0 & FLAGS))
    }

    /// (device index, byte offset) of the slot of a mapped pointer.
    pub(crate) fn place(self) -> Option<(u8, u64)> {
        if !self.is_mapped() {
            return None;
        }
        Some((
            ((self.0 & DEVICE_MASK) >> DEVICE_SHIFT) as u8,
            (self.0 & OFFSET_MASK) << SECTOR_SHIFT,
        ))
    }

    /// Whether both pointers map the same slot (whatever their flags).
    pub(crate) fn same_slot(self, other: BlockPtr) -> bool {
        self.is_mapped() && other.is_mapped() && self.slot() == other.slot()
    }

    /// Whether the two pointers differ as the block's contents go: one is
    /// mapped and they do not map the same slot.
    pub(crate) fn differs_from(self, other: BlockPtr) -> bool {
        (self.is_mapped() || other.is_mapped()) && !self.same_slot(other)
    }

    /// The stored form: for the conversions of map pages and log records
    /// only.
    pub(crate) fn to_bits(self) -> u64 {
        self.0
    }

    /// A pointer from its stored form: for the conversions of map pages and
    /// log records only (stored pages and records are checked against the
    /// pool's geometry when they are read, [`BlockPtr::LAYOUT`]).
    pub(crate) fn from_bits(bits: u64) -> BlockPtr {
        BlockPtr(bits)
    }
}

impl std::fmt::Debug for BlockPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.place() {
            None if self.0 == 0 => write!(f, "BlockPtr::NONE"),
            None => write!(f, "BlockPtr({:#018x})", self.0),
            Some((device, offset)) => {
                write!(f, "BlockPtr({device}:{offset:#x}")?;
                if self.is_shared() {
                    write!(f, ", shared")?;
                }
                write!(f, ")")
            }
        }
    }
}

/// As the stored word, for messages about stored entries.
impl std::fmt::LowerHex for BlockPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

/// The log records of the block map carry pointers in their stored form
/// (the log's codec is below the pool); these are where they are made and
/// read as pointers.
impl Record {
    /// Block `block` of `volume` maps `new` (with checksums `crcs`) instead
    /// of `old`.
    pub(crate) fn map(volume: u32, block: u64, new: BlockPtr, old: BlockPtr, crcs: Vec<u32>) -> Record {
        Record::Map {
            volume,
            block,
            new: new.to_bits(),
            old: old.to_bits(),
            crcs,
        }
    }

    /// The owners of slot `old` at `block` map `new` (with checksums
    /// `crcs`) instead. The log names the slots without flags.
    pub(crate) fn relocate(block: u64, old: BlockPtr, new: BlockPtr, crcs: Vec<u32>, owners: Vec<u32>) -> Record {
        Record::Relocate {
            block,
            old: old.slot().to_bits(),
            new: new.to_bits(),
            crcs,
            owners,
        }
    }

    /// `(new, old)` of a `Map` or `Relocate` record.
    pub(crate) fn block_ptrs(&self) -> Option<(BlockPtr, BlockPtr)> {
        match self {
            Record::Map { new, old, .. } | Record::Relocate { new, old, .. } => Some((BlockPtr(*new), BlockPtr(*old))),
            _ => None,
        }
    }
}

/// The entries of a map page as block pointers (the page, a metadata type,
/// stores their bits).
impl MapPage {
    /// A page holding `ptrs`, born at `birth`.
    pub(crate) fn of_ptrs(ptrs: &[BlockPtr], birth: u64) -> MapPage {
        let entries: Vec<AtomicU64> = ptrs.iter().map(|p| AtomicU64::new(p.0)).collect();
        MapPage::copied(&entries, birth)
    }

    /// Entry `index`.
    pub(crate) fn ptr(&self, index: usize) -> BlockPtr {
        BlockPtr(self.entries[index].load(Ordering::Acquire))
    }

    /// Sets entry `index` (the caller marks the page dirty).
    pub(crate) fn set_ptr(&self, index: usize, ptr: BlockPtr) {
        self.entries[index].store(ptr.to_bits(), Ordering::Release);
    }

    /// Entries `range`.
    pub(crate) fn ptrs_in(&self, range: std::ops::Range<usize>) -> Vec<BlockPtr> {
        self.entries[range]
            .iter()
            .map(|e| BlockPtr(e.load(Ordering::Acquire)))
            .collect()
    }

    /// Every entry.
    pub(crate) fn ptrs(&self) -> Vec<BlockPtr> {
        self.ptrs_in(0..self.entries.len())
    }

    /// Marks every mapped entry shared (a snapshot of the page was taken;
    /// the caller marks the page dirty).
    pub(crate) fn share_all(&self) {
        for entry in self.entries.iter() {
            let ptr = BlockPtr(entry.load(Ordering::Acquire));
            if ptr.is_mapped() {
                entry.store(ptr.shared().0, Ordering::Release);
            }
        }
    }

    /// The number of mapped entries.
    pub(crate) fn mapped_count(&self) -> u64 {
        self.entries
            .iter()
            .filter(|e| BlockPtr(e.load(Ordering::Acquire)).is_mapped())
            .count() as u64
    }
}

/// What the stored checksum of a sector is XORed with: a mix of the
/// sector's place in its volume (volume byte offset / 4 KiB). A map entry
/// that points at the wrong slot — damaged, or written wrong — then fails
/// verification even though the slot holds a valid block of something
/// else: that block was stored under another place's tag. Snapshots,
/// clones and relocation keep a block at the same place, so a shared slot
/// has one tag for every map that points at it. (splitmix64's finaliser,
/// folded to 32 bits.)
pub(crate) fn sector_tag(volume_sector: u64) -> u32 {
    let mut x = volume_sector.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x ^ (x >> 32)) as u32
}

impl Pool {
    /// The device a map entry (or another stored reference) names: a
    /// damaged index is an error, counted and logged once, never a panic.
    pub(crate) fn data_device(&self, index: u8) -> Result<&PoolDevice, MetaError> {
        self.devices
            .at(index)
            .inspect_err(|e| self.corruption.note(&e.to_string()))
    }

    /// Times corrupt metadata was met since the pool was opened (pages
    /// that failed their checks when loaded, references to devices the
    /// pool does not have): each failed the request that met it.
    pub fn metadata_errors(&self) -> u64 {
        self.corruption.count()
    }

    /// Where blocks `first..=last` of `volume` live as the pool sees them
    /// ((device index, byte offset) of each mapped block's slot): for tests
    /// that check what a read returned against what the map says.
    #[doc(hidden)]
    pub fn block_places(&self, volume: u32, first: u64, last: u64) -> Result<Vec<Option<(u8, u64)>>, MetaError> {
        Ok(self
            .lookup_range(volume, first, last)?
            .into_iter()
            .map(BlockPtr::place)
            .collect())
    }

    /// The map page of a volume (never of a snapshot: see `view_page`).
    pub(crate) fn map_page(&self, volume: u32, block: u64) -> Result<Arc<MapPage>, MetaError> {
        debug_assert!(!snapshots::is_snapshot_id(volume), "map_page of snapshot {volume:#x}");
        self.map_pages.get(&self.db, (volume, block / MAP_ENTRIES_PER_PAGE))
    }

    /// Reads entries of the page that `owner` (a volume or a snapshot)
    /// sees at `index`. A snapshot may see its newer neighbour's page,
    /// which can be copied into it and then changed while it is read: the
    /// read is repeated until the page it was served from is still the one
    /// the snapshot sees afterwards (the copy is installed before the
    /// change, so a read that saw the change sees the copy then).
    ///
    /// A clone's page it has no copy of is its origin's view, read the same
    /// way (the clone makes it its own before changing it).
    pub(super) fn read_view<T>(&self, owner: u32, index: u64, read: impl Fn(&MapPage) -> T) -> Result<T, MetaError> {
        if !snapshots::is_snapshot_id(owner) {
            let page = self.map_pages.get(&self.db, (owner, index))?;
            // Without snapshots there are no clones; a page the volume has
            // is its own.
            if !self.has_snapshots() || page.present.load(Ordering::Acquire) {
                return Ok(read(&page));
            }
        }
        loop {
            let page = self.view_page(owner, index)?;
            let value = read(&page);
            if Arc::ptr_eq(&page, &self.view_page(owner, index)?) {
                return Ok(value);
            }
        }
    }

    pub(crate) fn lookup(&self, volume: u32, block: u64) -> Result<BlockPtr, MetaError> {
        self.read_view(volume, block / MAP_ENTRIES_PER_PAGE, |page| {
            page.ptr((block % MAP_ENTRIES_PER_PAGE) as usize)
        })
    }

    /// The map entries of blocks `first..=last`, one page lookup per map
    /// page rather than per block (a megabyte request covers 64 blocks).
    pub(crate) fn lookup_range(&self, volume: u32, first: u64, last: u64) -> Result<Vec<BlockPtr>, MetaError> {
        let mut entries = Vec::with_capacity((last - first + 1) as usize);
        let mut block = first;
        while block <= last {
            let within = (block % MAP_ENTRIES_PER_PAGE) as usize;
            let count = (MAP_ENTRIES_PER_PAGE as usize - within).min((last - block + 1) as usize);
            let part = self.read_view(volume, block / MAP_ENTRIES_PER_PAGE, |page| {
                page.ptrs_in(within..within + count)
            })?;
            entries.extend(part);
            block += count as u64;
        }
        Ok(entries)
    }

    pub(crate) fn set_mapping(&self, volume: u32, block: u64, entry: BlockPtr) -> Result<(), MetaError> {
        #[cfg(test)]
        if self.fail_mapping_after.fetch_sub(1, Ordering::AcqRel) == 0 {
            return Err(MetaError::Failed(format!(
                "injected: map page of volume {volume} block {block} cannot be loaded"
            )));
        }
        assert!(!snapshots::is_snapshot_id(volume), "a snapshot's map is read-only");
        let page = self.map_page(volume, block)?;
        page.set_ptr((block % MAP_ENTRIES_PER_PAGE) as usize, entry);
        if !page.present.load(Ordering::Relaxed) {
            // The volume has this page now (a clone's was made its own
            // before any change: `Pool::ensure_private`).
            page.present.store(true, Ordering::Release);
        }
        self.map_pages.mark_dirty(&page);
        Ok(())
    }

    /// The tag the stored checksum of the sector at volume byte `logical`
    /// carries (0 in pools from before the tags: see [`sector_tag`]).
    pub(crate) fn crc_tag(&self, logical: u64) -> u32 {
        debug_assert!(logical.is_multiple_of(SECTOR_BYTES), "volume offset {logical}");
        if self.checksum_tags {
            sector_tag(logical >> SECTOR_SHIFT)
        } else {
            0
        }
    }

    /// Turns the checksums of consecutive sectors from volume byte
    /// `logical` into their stored form (tagged with their places).
    pub(crate) fn tag_crcs(&self, crcs: &mut [u32], logical: u64) {
        if self.checksum_tags {
            for (index, crc) in crcs.iter_mut().enumerate() {
                *crc ^= self.crc_tag(logical + index as u64 * SECTOR_BYTES);
            }
        }
    }

    fn crc_page(&self, device: u8, sector: u64) -> Result<Arc<CrcPage>, MetaError> {
        self.crc_pages.get(&self.db, (device as u32, sector / CRCS_PER_PAGE))
    }

    /// The stored checksums of `count` sectors from `offset`, one page
    /// lookup per checksum page rather than per sector. Stored checksums
    /// are tagged ([`Pool::tag_crcs`]); so are those given to `set_crc`,
    /// `set_crcs` and `store_crcs`.
    pub(crate) fn crcs(&self, device: u8, offset: u64, count: usize) -> Result<Vec<u32>, MetaError> {
        let mut crcs = Vec::with_capacity(count);
        let mut sector = offset >> SECTOR_SHIFT;
        while crcs.len() < count {
            let page = self.crc_page(device, sector)?;
            let within = (sector % CRCS_PER_PAGE) as usize;
            let take = (CRCS_PER_PAGE as usize - within).min(count - crcs.len());
            crcs.extend(
                page.crcs[within..within + take]
                    .iter()
                    .map(|c| c.load(Ordering::Acquire)),
            );
            sector += take as u64;
        }
        Ok(crcs)
    }

    pub(crate) fn set_crc(&self, device: u8, offset: u64, crc: u32) -> Result<(), MetaError> {
        let sector = offset >> SECTOR_SHIFT;
        let page = self.crc_page(device, sector)?;
        page.crcs[(sector % CRCS_PER_PAGE) as usize].store(crc, Ordering::Release);
        self.crc_pages.mark_dirty(&page);
        self.clear_suspect(device, offset, SECTOR_BYTES);
        Ok(())
    }

    /// Sets the checksums of consecutive sectors from `offset`, written
    /// there just now (or verified there): their parts are no longer
    /// suspect.
    pub(crate) fn set_crcs(&self, device: u8, offset: u64, crcs: &[u32]) -> Result<(), MetaError> {
        self.store_crcs(device, offset, crcs)?;
        self.clear_suspect(device, offset, crcs.len() as u64 * SECTOR_BYTES);
        Ok(())
    }

    /// Sets the checksums of consecutive sectors from `offset`, one page
    /// lookup per checksum page rather than per sector, and leaves their
    /// suspicion as it is. Replay uses this: a logged mapping's checksums
    /// describe what was written then, and a later overwrite in place (its
    /// slot already marked in that epoch, so nothing more was logged) may
    /// have been in flight at the crash.
    pub(crate) fn store_crcs(&self, device: u8, offset: u64, crcs: &[u32]) -> Result<(), MetaError> {
        let first = offset >> SECTOR_SHIFT;
        let mut index = 0;
        while index < crcs.len() {
            let sector = first + index as u64;
            let page = self.crc_page(device, sector)?;
            let within = (sector % CRCS_PER_PAGE) as usize;
            let count = (CRCS_PER_PAGE as usize - within).min(crcs.len() - index);
            for (slot, crc) in page.crcs[within..within + count]
                .iter()
                .zip(&crcs[index..index + count])
            {
                slot.store(*crc, Ordering::Release);
            }
            self.crc_pages.mark_dirty(&page);
            index += count;
        }
        Ok(())
    }

    /// The chunk holding `[offset, offset + length)` (which lies in one
    /// chunk) and the bitmap of the chunk's parts it touches.
    pub(crate) fn parts_of(&self, offset: u64, length: u64) -> (u64, ChunkParts) {
        let chunk_bytes = self.chunk_bytes as u64;
        let part_bytes = chunk_bytes / CHUNK_PARTS;
        let chunk = offset / chunk_bytes;
        let within = offset - chunk * chunk_bytes;
        let first = within / part_bytes;
        let last = ((within + length.max(1) - 1) / part_bytes).min(CHUNK_PARTS - 1);
        let mut parts = [0u64; 4];
        for part in first..=last {
            parts[(part / 64) as usize] |= 1 << (part % 64);
        }
        (chunk, parts)
    }

    /// The parts `[offset, offset + length)` covers whole.
    fn whole_parts_of(&self, offset: u64, length: u64) -> (u64, ChunkParts) {
        let part_bytes = self.chunk_bytes as u64 / CHUNK_PARTS;
        let start = offset.next_multiple_of(part_bytes);
        let end = (offset + length) / part_bytes * part_bytes;
        if end <= start {
            return (offset / self.chunk_bytes as u64, [0; 4]);
        }
        self.parts_of(start, end - start)
    }

    /// Notes in the RAM tier's in-place marks that `[offset, offset +
    /// length)` of `device` is about to be overwritten in place in `epoch`
    /// (the caller holds the write gate): see `ram::RamTier::note_in_place`.
    pub(crate) fn note_in_place(&self, device: u8, offset: u64, length: u64, epoch: u32) {
        let chunk_bytes = self.chunk_bytes as u64;
        let covered = self.covered.load(Ordering::Acquire);
        let (mut at, end) = (offset, offset + length);
        while at < end {
            let piece = ((at / chunk_bytes + 1) * chunk_bytes).min(end) - at;
            let (chunk, parts) = self.parts_of(at, piece);
            self.cache.ram.note_in_place(device, chunk, &parts, epoch, covered);
            at += piece;
        }
    }

    /// Marks `[offset, offset + length)` of `device` suspect: its checksums
    /// may describe the data before or after a write that failed part way.
    pub(crate) fn mark_suspect(&self, device: u8, offset: u64, length: u64) {
        let (chunk, parts) = self.parts_of(offset, length);
        let mut suspect = self.suspect.lock_or_abort();
        let entry = suspect.entry((device, chunk)).or_default();
        for (word, add) in entry.iter_mut().zip(parts) {
            *word |= add;
        }
    }

    /// Whether the 4 KiB sector at `offset` of `device` lies in a suspect
    /// part (a crash may have left its checksum describing other data).
    pub(crate) fn is_suspect(&self, device: u8, offset: u64) -> bool {
        let (chunk, parts) = self.parts_of(offset, SECTOR_BYTES);
        let suspect = self.suspect.lock_or_abort();
        suspect
            .get(&(device, chunk))
            .is_some_and(|have| have.iter().zip(parts).any(|(have, want)| have & want != 0))
    }

    /// Takes the parts `[offset, offset + length)` of `device` covers whole
    /// out of the suspect ones: their checksums were just set from the data
    /// written there (or, repaired, read there).
    pub(crate) fn clear_suspect(&self, device: u8, offset: u64, length: u64) {
        let mut suspect = self.suspect.lock_or_abort();
        if suspect.is_empty() {
            return;
        }
        let chunk_bytes = self.chunk_bytes as u64;
        let (mut at, end) = (offset, offset + length);
        while at < end {
            let piece = ((at / chunk_bytes + 1) * chunk_bytes).min(end) - at;
            let (chunk, parts) = self.whole_parts_of(at, piece);
            if let Some(have) = suspect.get_mut(&(device, chunk)) {
                for (word, clear) in have.iter_mut().zip(parts) {
                    *word &= !clear;
                }
                if have.iter().all(|word| *word == 0) {
                    suspect.remove(&(device, chunk));
                }
            }
            at += piece;
        }
    }

    /// Counts the mapped blocks of volume `id` (stored pages, with cached
    /// pages taking precedence).
    pub(super) fn count_mapped_blocks(&self, id: u32) -> Result<u64, PoolError> {
        let cached: HashSet<(u32, u64)> = self
            .map_pages
            .keys_of(id)
            .into_iter()
            .map(|index| (id, index))
            .collect();
        let mut total = 0;
        for key in &cached {
            total += self
                .map_pages
                .get(&self.db, *key)
                .map_err(PoolError::Meta)?
                .mapped_count();
        }
        crate::meta::store::guarded(format_args!("table map_pages pages of {id}"), || {
            let txn = self.db.begin_read().map_err(MetaError::from)?;
            let table = txn.open_table(MAP_PAGES).map_err(MetaError::from)?;
            for row in table.range((id, 0)..=(id, u64::MAX)).map_err(MetaError::from)? {
                let (key, value) = row.map_err(MetaError::from)?;
                if cached.contains(&key.value()) {
                    continue;
                }
                let page = self.map_pages.decode_checked(key.value(), Some(value.value()))?;
                total += page.mapped_count();
            }
            Ok(total)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_ptr_keeps_its_place_and_flags_in_the_stored_layout() {
        let ptr = BlockPtr::at(3, 97 << 20);
        assert_eq!(
            ptr.to_bits(),
            1 << 63 | 3 << 48 | (97 << 20 >> 12),
            "docs/FORMAT.md's layout"
        );
        assert_eq!(ptr.place(), Some((3, 97 << 20)));
        assert!(ptr.is_mapped() && !ptr.is_shared());
        let shared = ptr.shared();
        assert_eq!(shared.to_bits(), ptr.to_bits() | 1 << 62);
        assert!(shared.is_shared() && shared.place() == ptr.place());
        assert_eq!(shared.private(), ptr);
        assert_eq!(shared.slot(), ptr);
        assert!(shared.same_slot(ptr) && !shared.differs_from(ptr));
        assert_eq!(
            BlockPtr::NONE.shared(),
            BlockPtr::NONE,
            "an unmapped pointer stays unmapped"
        );
        assert_eq!(BlockPtr::NONE.place(), None);
        assert!(!BlockPtr::NONE.same_slot(BlockPtr::NONE) && !BlockPtr::NONE.differs_from(BlockPtr::NONE));
        assert!(ptr.differs_from(BlockPtr::NONE) && BlockPtr::NONE.differs_from(ptr));
        let other = BlockPtr::at(3, (97 << 20) + 4096);
        assert!(!ptr.same_slot(other) && ptr.differs_from(other));
        let moved = shared.moved_to(other);
        assert!(moved.is_shared() && moved.place() == other.place());
        assert_eq!(format!("{shared:#018x}"), format!("{:#018x}", shared.to_bits()));
    }
}
