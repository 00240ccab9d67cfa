//! The pool's log: a circular region of 4 KiB blocks holding logical records
//! of metadata changes since the last checkpoint, made durable by group
//! commit. Replay after a crash re-applies the valid prefix.
//!
//! Block layout (docs/FORMAT.md): magic "SLOG", crc32c of bytes 8..4096,
//! LSN (the block's position in the never-wrapping log), pool tag, used
//! bytes, then records. A record never spans blocks, and each commit starts a
//! new block, so a committed block is never rewritten (a torn rewrite could
//! otherwise destroy records that were already acknowledged).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::device::{Device, DeviceError, IoBuf};

pub const LOG_BLOCK_BYTES: u64 = 4096;
const HEADER_BYTES: usize = 32;
const MAGIC: u32 = u32::from_le_bytes(*b"SLOG");
/// A 128 KiB block has 32 sectors of 4 KiB.
pub const MAX_CRCS_PER_RECORD: usize = 32;
/// Most owners a `Relocate` record names (with the most checksums it still
/// fits a log block).
pub const MAX_RELOCATE_OWNERS: usize = 512;
/// Blocks read at once during replay.
const REPLAY_BATCH_BLOCKS: u64 = 256;

/// One logical change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Writes into this chunk may be in flight: its checksums are not to be
    /// trusted after a crash until it is scrubbed.
    Dirty { device: u8, chunk: u64 },
    /// Block `block` of volume `volume` now maps to `new` (0 = unmapped);
    /// it mapped to `old` before (freed by this change). `crcs` are the
    /// checksums of the new block's 4 KiB sectors (empty when unmapping).
    Map {
        volume: u32,
        block: u64,
        new: u64,
        old: u64,
        crcs: Vec<u32>,
    },
    /// Volume `volume` is being destroyed: all its blocks are to be freed.
    Destroy { volume: u32 },
    /// Intent-log data: the 4 KiB sector `sector` of volume `volume` holds
    /// `data` (checksum `crc`). The payload travels in a data block after the
    /// record's block (see docs/FORMAT.md).
    ///
    /// `seq` is the cache's sequence number of that version (what a
    /// snapshot's `cache_seq` is compared with: a version older than a
    /// snapshot belongs to it). 0 in records of pools from before it was
    /// logged (type 4): replay gives those a fresh one.
    Data {
        volume: u32,
        sector: u64,
        crc: u32,
        seq: u64,
        data: Arc<[u8]>,
    },
    /// Sectors `[first_sector, first_sector + count)` of `volume` were written
    /// in place: older `Data` records for them are superseded.
    Written { volume: u32, first_sector: u64, count: u32 },
    /// Snapshots taken together (one consistency point): the pool's
    /// snapshot generation became `generation`. Cached writes with a
    /// sequence number below `cache_seq` were acknowledged before it and
    /// belong to it (0: the record of a pool from before the cache was
    /// left in place, type 6; everything was placed first then).
    Snapshot {
        generation: u64,
        created_unix: u64,
        cache_seq: u64,
        snapshots: Vec<SnapshotEntry>,
    },
    /// Map page `page` of `volume` was copied into its newest snapshot
    /// `snapshot` before a change: the copy is the snapshot's page, every
    /// valid entry of the volume's page is now shared, and the page is born
    /// at `generation`.
    CopyPage {
        volume: u32,
        page: u64,
        snapshot: u32,
        generation: u64,
    },
    /// Snapshot `snapshot` is deleted: what only it mapped is freed.
    DestroySnapshot { snapshot: u32 },
    /// Volume `volume` is rolled back to its newest snapshot `snapshot`:
    /// its map becomes the snapshot's view again; the slots only the volume
    /// mapped are freed.
    Rollback { volume: u32, snapshot: u32 },
    /// Volume `volume` is a new clone of snapshot `origin`: where it has
    /// no map page of its own it sees the origin's.
    Clone { volume: u32, origin: u32 },
    /// Clone `volume` made map page `page` its own before a change: a copy
    /// of its origin's view, every valid entry shared.
    ClonePage { volume: u32, page: u64 },
    /// Clone `volume` is promoted: its origin snapshot `origin` and the
    /// older snapshots of the origin's volume become the clone's, and that
    /// volume becomes a clone of `origin` (the page work is redone from the
    /// state before, `pool/snapshots/clones.rs`).
    Promote { volume: u32, origin: u32 },
    /// Slot `old`, mapped at block `block` by each of `owners` (volumes and
    /// snapshots of one family, `pool/relocate.rs`), was copied to `new`
    /// (checksums `crcs`): each owner's entry now maps `new`, its flags
    /// kept; `old` is freed by this change. A shared block moved by the
    /// migrator, once for all who map it.
    Relocate {
        block: u64,
        old: u64,
        new: u64,
        crcs: Vec<u32>,
        owners: Vec<u32>,
    },
    /// Changes to file dataset `dataset`'s namespace, applied together
    /// (`meta/fsrows.rs`; a rename is one record).
    Namespace {
        dataset: u32,
        ops: Vec<crate::meta::fsrows::NsOp>,
    },
    /// The 4 KiB sectors from byte `offset` of member `device` hold data
    /// whose checksums are `crcs`, as the checksum table stores them
    /// (tagged). Committed before a copy on a mirror is rewritten from
    /// another when those checksums may not be durable yet (written in
    /// place since the last checkpoint): after a power cut during or after
    /// the repair the checksums still tell the good copy from the bad.
    Sums { device: u8, offset: u64, crcs: Vec<u32> },
}

/// One snapshot of a [`Record::Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotEntry {
    pub volume: u32,
    pub snapshot: u32,
    /// The volume's mapped blocks when the snapshot was taken.
    pub mapped_blocks: u64,
    /// The volume's size then.
    pub size_bytes: u64,
    /// At most [`MAX_SNAPSHOT_NAME`] bytes of UTF-8.
    pub name: String,
}

/// Longest snapshot name, in bytes.
pub const MAX_SNAPSHOT_NAME: usize = 64;
/// Most snapshots one record (one atomic `snapshot create`) holds: with the
/// longest names it still fits a log block.
pub const MAX_SNAPSHOTS_PER_RECORD: usize = 32;

impl Record {
    /// Whether the record may be durable only once data written before it
    /// is: a new mapping points at data written to its slot; `Written`
    /// retires `Data` records in favour of data written in place.
    fn needs_durable_data(&self) -> bool {
        match self {
            Record::Map { new, .. } => *new != 0,
            // The checksums describe data that must be durable first.
            Record::Written { .. } | Record::Relocate { .. } | Record::Sums { .. } => true,
            Record::Dirty { .. }
            | Record::Destroy { .. }
            | Record::Data { .. }
            | Record::Snapshot { .. }
            | Record::CopyPage { .. }
            | Record::DestroySnapshot { .. }
            | Record::Rollback { .. }
            | Record::Clone { .. }
            | Record::ClonePage { .. }
            | Record::Promote { .. }
            | Record::Namespace { .. } => false,
        }
    }

    fn encoded_len(&self) -> usize {
        match self {
            Record::Dirty { .. } => 10,
            Record::Map { crcs, .. } => 30 + 4 * crcs.len(),
            Record::Destroy { .. } => 5,
            Record::Data { seq: 0, .. } => 17,
            Record::Data { .. } => 25,
            Record::Written { .. } => 17,
            Record::Snapshot {
                cache_seq, snapshots, ..
            } => {
                let entries = snapshots.iter().map(|s| 25 + s.name.len()).sum::<usize>();
                if *cache_seq == 0 {
                    18 + entries
                } else {
                    26 + entries
                }
            }
            Record::CopyPage { .. } => 25,
            Record::DestroySnapshot { .. } => 5,
            Record::Rollback { .. } => 9,
            Record::Clone { .. } => 9,
            Record::ClonePage { .. } => 13,
            Record::Promote { .. } => 9,
            Record::Relocate { crcs, owners, .. } => 28 + 4 * crcs.len() + 4 * owners.len(),
            Record::Namespace { ops, .. } => 1 + crate::meta::fsrows::ops_len(ops),
            Record::Sums { crcs, .. } => 11 + 4 * crcs.len(),
        }
    }

    /// The payload block a record carries after its block, if any.
    fn payload(&self) -> Option<&Arc<[u8]>> {
        match self {
            Record::Data { data, .. } => Some(data),
            _ => None,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Record::Dirty { device, chunk } => {
                out.push(1);
                out.push(*device);
                out.extend_from_slice(&chunk.to_le_bytes());
            }
            Record::Map {
                volume,
                block,
                new,
                old,
                crcs,
            } => {
                assert!(crcs.len() <= MAX_CRCS_PER_RECORD);
                out.push(2);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&block.to_le_bytes());
                out.extend_from_slice(&new.to_le_bytes());
                out.extend_from_slice(&old.to_le_bytes());
                out.push(crcs.len() as u8);
                for crc in crcs {
                    out.extend_from_slice(&crc.to_le_bytes());
                }
            }
            Record::Destroy { volume } => {
                out.push(3);
                out.extend_from_slice(&volume.to_le_bytes());
            }
            Record::Data {
                volume,
                sector,
                crc,
                seq,
                ..
            } => {
                // Type 4 without the sequence number (older pools), 13 with.
                out.push(if *seq == 0 { 4 } else { 13 });
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&sector.to_le_bytes());
                out.extend_from_slice(&crc.to_le_bytes());
                if *seq != 0 {
                    out.extend_from_slice(&seq.to_le_bytes());
                }
            }
            Record::Written {
                volume,
                first_sector,
                count,
            } => {
                out.push(5);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&first_sector.to_le_bytes());
                out.extend_from_slice(&count.to_le_bytes());
            }
            Record::Snapshot {
                generation,
                created_unix,
                cache_seq,
                snapshots,
            } => {
                assert!(!snapshots.is_empty() && snapshots.len() <= MAX_SNAPSHOTS_PER_RECORD);
                // Type 6 without the cache sequence number (older pools), 14 with.
                out.push(if *cache_seq == 0 { 6 } else { 14 });
                out.extend_from_slice(&generation.to_le_bytes());
                out.extend_from_slice(&created_unix.to_le_bytes());
                if *cache_seq != 0 {
                    out.extend_from_slice(&cache_seq.to_le_bytes());
                }
                out.push(snapshots.len() as u8);
                for entry in snapshots {
                    assert!(entry.name.len() <= MAX_SNAPSHOT_NAME);
                    out.extend_from_slice(&entry.volume.to_le_bytes());
                    out.extend_from_slice(&entry.snapshot.to_le_bytes());
                    out.extend_from_slice(&entry.mapped_blocks.to_le_bytes());
                    out.extend_from_slice(&entry.size_bytes.to_le_bytes());
                    out.push(entry.name.len() as u8);
                    out.extend_from_slice(entry.name.as_bytes());
                }
            }
            Record::CopyPage {
                volume,
                page,
                snapshot,
                generation,
            } => {
                out.push(7);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&page.to_le_bytes());
                out.extend_from_slice(&snapshot.to_le_bytes());
                out.extend_from_slice(&generation.to_le_bytes());
            }
            Record::DestroySnapshot { snapshot } => {
                out.push(8);
                out.extend_from_slice(&snapshot.to_le_bytes());
            }
            Record::Rollback { volume, snapshot } => {
                out.push(9);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&snapshot.to_le_bytes());
            }
            Record::Clone { volume, origin } => {
                out.push(10);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&origin.to_le_bytes());
            }
            Record::ClonePage { volume, page } => {
                out.push(11);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&page.to_le_bytes());
            }
            Record::Promote { volume, origin } => {
                out.push(12);
                out.extend_from_slice(&volume.to_le_bytes());
                out.extend_from_slice(&origin.to_le_bytes());
            }
            Record::Relocate {
                block,
                old,
                new,
                crcs,
                owners,
            } => {
                assert!(crcs.len() <= MAX_CRCS_PER_RECORD && owners.len() <= MAX_RELOCATE_OWNERS);
                out.push(15);
                out.extend_from_slice(&block.to_le_bytes());
                out.extend_from_slice(&old.to_le_bytes());
                out.extend_from_slice(&new.to_le_bytes());
                out.push(crcs.len() as u8);
                for crc in crcs {
                    out.extend_from_slice(&crc.to_le_bytes());
                }
                out.extend_from_slice(&(owners.len() as u16).to_le_bytes());
                for owner in owners {
                    out.extend_from_slice(&owner.to_le_bytes());
                }
            }
            Record::Namespace { dataset, ops } => {
                out.push(16);
                crate::meta::fsrows::encode_ops(*dataset, ops, out);
            }
            Record::Sums { device, offset, crcs } => {
                assert!(!crcs.is_empty() && crcs.len() <= MAX_CRCS_PER_RECORD);
                out.push(17);
                out.push(*device);
                out.extend_from_slice(&offset.to_le_bytes());
                out.push(crcs.len() as u8);
                for crc in crcs {
                    out.extend_from_slice(&crc.to_le_bytes());
                }
            }
        }
    }

    /// Decodes one record; `None` on a malformed one (the block is then
    /// treated as the end of the log).
    fn decode(bytes: &[u8]) -> Option<(Record, usize)> {
        let u32_at = |at: usize| crate::bytes::u32_at(bytes, at);
        let u64_at = |at: usize| crate::bytes::u64_at(bytes, at);
        match bytes.first()? {
            1 => Some((
                Record::Dirty {
                    device: *bytes.get(1)?,
                    chunk: u64_at(2)?,
                },
                10,
            )),
            2 => {
                let count = *bytes.get(29)? as usize;
                if count > MAX_CRCS_PER_RECORD {
                    return None;
                }
                let crcs = (0..count).map(|i| u32_at(30 + 4 * i)).collect::<Option<Vec<u32>>>()?;
                let record = Record::Map {
                    volume: u32_at(1)?,
                    block: u64_at(5)?,
                    new: u64_at(13)?,
                    old: u64_at(21)?,
                    crcs,
                };
                Some((record, 30 + 4 * count))
            }
            3 => Some((Record::Destroy { volume: u32_at(1)? }, 5)),
            // The payload is attached by `decode_block`'s caller.
            4 => Some((
                Record::Data {
                    volume: u32_at(1)?,
                    sector: u64_at(5)?,
                    crc: u32_at(13)?,
                    seq: 0,
                    data: Arc::from(Vec::new()),
                },
                17,
            )),
            13 => {
                // A zero sequence number is written as type 4.
                let seq = u64_at(17).filter(|s| *s != 0)?;
                Some((
                    Record::Data {
                        volume: u32_at(1)?,
                        sector: u64_at(5)?,
                        crc: u32_at(13)?,
                        seq,
                        data: Arc::from(Vec::new()),
                    },
                    25,
                ))
            }
            5 => Some((
                Record::Written {
                    volume: u32_at(1)?,
                    first_sector: u64_at(5)?,
                    count: u32_at(13)?,
                },
                17,
            )),
            kind @ (6 | 14) => {
                // Type 14 has the cache sequence number after the time.
                let (cache_seq, start) = if *kind == 14 {
                    (u64_at(17).filter(|s| *s != 0)?, 25)
                } else {
                    (0, 17)
                };
                let count = *bytes.get(start)? as usize;
                if count == 0 || count > MAX_SNAPSHOTS_PER_RECORD {
                    return None;
                }
                let mut at = start + 1;
                let mut snapshots = Vec::with_capacity(count);
                for _ in 0..count {
                    let length = *bytes.get(at + 24)? as usize;
                    if length > MAX_SNAPSHOT_NAME {
                        return None;
                    }
                    let name = std::str::from_utf8(bytes.get(at + 25..at + 25 + length)?).ok()?;
                    snapshots.push(SnapshotEntry {
                        volume: u32_at(at)?,
                        snapshot: u32_at(at + 4)?,
                        mapped_blocks: u64_at(at + 8)?,
                        size_bytes: u64_at(at + 16)?,
                        name: name.to_string(),
                    });
                    at += 25 + length;
                }
                let record = Record::Snapshot {
                    generation: u64_at(1)?,
                    created_unix: u64_at(9)?,
                    cache_seq,
                    snapshots,
                };
                Some((record, at))
            }
            7 => Some((
                Record::CopyPage {
                    volume: u32_at(1)?,
                    page: u64_at(5)?,
                    snapshot: u32_at(13)?,
                    generation: u64_at(17)?,
                },
                25,
            )),
            8 => Some((Record::DestroySnapshot { snapshot: u32_at(1)? }, 5)),
            9 => Some((
                Record::Rollback {
                    volume: u32_at(1)?,
                    snapshot: u32_at(5)?,
                },
                9,
            )),
            10 => Some((
                Record::Clone {
                    volume: u32_at(1)?,
                    origin: u32_at(5)?,
                },
                9,
            )),
            11 => Some((
                Record::ClonePage {
                    volume: u32_at(1)?,
                    page: u64_at(5)?,
                },
                13,
            )),
            12 => Some((
                Record::Promote {
                    volume: u32_at(1)?,
                    origin: u32_at(5)?,
                },
                9,
            )),
            15 => {
                let count = *bytes.get(25)? as usize;
                if count > MAX_CRCS_PER_RECORD {
                    return None;
                }
                let crcs = (0..count).map(|i| u32_at(26 + 4 * i)).collect::<Option<Vec<u32>>>()?;
                let at = 26 + 4 * count;
                let owner_count = u16::from_le_bytes([*bytes.get(at)?, *bytes.get(at + 1)?]) as usize;
                if owner_count > MAX_RELOCATE_OWNERS {
                    return None;
                }
                let owners = (0..owner_count)
                    .map(|i| u32_at(at + 2 + 4 * i))
                    .collect::<Option<Vec<u32>>>()?;
                let record = Record::Relocate {
                    block: u64_at(1)?,
                    old: u64_at(9)?,
                    new: u64_at(17)?,
                    crcs,
                    owners,
                };
                Some((record, at + 2 + 4 * owner_count))
            }
            16 => {
                let (dataset, ops, used) = crate::meta::fsrows::decode_ops(&bytes[1..])?;
                Some((Record::Namespace { dataset, ops }, 1 + used))
            }
            17 => {
                let count = *bytes.get(10)? as usize;
                if count == 0 || count > MAX_CRCS_PER_RECORD {
                    return None;
                }
                let crcs = (0..count).map(|i| u32_at(11 + 4 * i)).collect::<Option<Vec<u32>>>()?;
                let record = Record::Sums {
                    device: *bytes.get(1)?,
                    offset: u64_at(2)?,
                    crcs,
                };
                Some((record, 11 + 4 * count))
            }
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log device: {0}")]
    Device(#[from] DeviceError),
    #[error("the log is full; a checkpoint must free space first")]
    Full,
}

struct Pending {
    records: Vec<Record>,
    bytes: usize,
    /// Slots released by these records: reusable once the records are durable.
    frees: Vec<(u8, u64)>,
    /// How many of `records` are already staged on the device.
    staged: usize,
    /// Where staging put the record blocks it wrote: (index of the block's
    /// first record, its 4 KiB unit from `next_lsn`), in order. Packing is
    /// greedy, so these blocks stay where they are however many records
    /// follow; a stage re-packs only from the block holding the first
    /// unstaged record (re-packing everything would make a stream of
    /// allocating writes quadratic in the records pending between commits).
    layout: Vec<(usize, u64)>,
    /// Log units (4 KiB) all of `records` take, and the bytes used in the
    /// last record block: `blocks_needed` (a test helper) kept up to date
    /// record by record.
    units: u64,
    last_block_used: usize,
    /// How many of `records` need the data devices flushed before them.
    need_data: usize,
    /// The (volume, block) of every pending allocation's `Map` record.
    allocations: std::collections::HashSet<(u32, u64)>,
    /// Records held back until the data they need is durable (the
    /// destager's; see [`Deferred`]). Kept across `take`.
    deferred: Deferred,
}

/// Records a destage pass holds back from the log until it has flushed the
/// data devices itself: its `Map` records (blocks placed in new slots) and
/// `Written` records (cached data placed), which may become durable only
/// after that data. Appended with the rest, they would make every commit a
/// synchronous writer runs meanwhile flush the data devices first (1-2 ms
/// under the commit lock); held back, they are appended once the pass's
/// own flush is done, and need no flush of anyone.
///
/// Replay applies records in log order, and only the order of records of
/// one block matters (a slot is reused only after the record freeing it is
/// durable). So a record about to be appended or held back that touches a
/// block with records held back by another pass pushes those first, in
/// their order: they then need the data flush, as if never held back (the
/// rare case of a block changed again within a pass's few milliseconds).
/// Records whose block is not known here (snapshots, page copies, destroys)
/// push every record held back.
/// A record held back: (pass, record, the slot it frees once durable).
type HeldRecord = (u64, Record, Option<(u8, u64)>);

#[derive(Default)]
struct Deferred {
    /// In the order held back.
    records: Vec<HeldRecord>,
    /// The pass holding records of each (volume, block).
    blocks: std::collections::HashMap<(u32, u64), u64>,
    /// Sectors per block of the volumes with `Written` records held back
    /// (a `Data` record names a sector).
    per_block: std::collections::HashMap<u32, u32>,
}

/// What a record touches, for the order of held-back records.
enum Touches {
    Nothing,
    Blocks(Vec<(u32, u64)>),
    Everything,
}

impl Deferred {
    fn touches(&self, record: &Record) -> Touches {
        match record {
            // A `Sums` record describes data already in place.
            Record::Dirty { .. } | Record::Namespace { .. } | Record::Sums { .. } => Touches::Nothing,
            Record::Map { volume, block, .. } => Touches::Blocks(vec![(*volume, *block)]),
            Record::Written {
                volume,
                first_sector,
                count,
            } => Touches::Blocks(vec![(*volume, first_sector / (*count).max(1) as u64)]),
            Record::Data { volume, sector, .. } => match self.per_block.get(volume) {
                Some(per_block) => Touches::Blocks(vec![(*volume, sector / *per_block as u64)]),
                None => Touches::Nothing,
            },
            Record::Relocate { block, owners, .. } => {
                Touches::Blocks(owners.iter().map(|owner| (*owner, *block)).collect())
            }
            _ => Touches::Everything,
        }
    }

    /// Takes out, in order, the records held back by passes other than
    /// `keep` that `record` must follow.
    fn conflicting(&mut self, record: &Record, keep: Option<u64>) -> Vec<HeldRecord> {
        if self.records.is_empty() {
            return Vec::new();
        }
        match self.touches(record) {
            Touches::Nothing => Vec::new(),
            Touches::Everything => self.take_where(|_, _| true),
            Touches::Blocks(blocks) => {
                let owners: Vec<u64> = blocks
                    .iter()
                    .filter_map(|block| self.blocks.get(block).copied())
                    .filter(|pass| Some(*pass) != keep)
                    .collect();
                if owners.is_empty() {
                    return Vec::new();
                }
                self.take_where(|pass, key| owners.contains(&pass) && blocks.contains(&key))
            }
        }
    }

    /// Takes out the records `pick(pass, (volume, block))` selects, in order.
    fn take_where(&mut self, pick: impl Fn(u64, (u32, u64)) -> bool) -> Vec<HeldRecord> {
        let mut taken = Vec::new();
        let mut kept = Vec::with_capacity(self.records.len());
        for (pass, record, free) in std::mem::take(&mut self.records) {
            let key = match self.touches(&record) {
                Touches::Blocks(blocks) => blocks[0],
                _ => (u32::MAX, u64::MAX),
            };
            if pick(pass, key) {
                if self.blocks.get(&key) == Some(&pass) {
                    self.blocks.remove(&key);
                }
                taken.push((pass, record, free));
            } else {
                kept.push((pass, record, free));
            }
        }
        self.records = kept;
        if self.records.is_empty() {
            self.blocks.clear();
            self.per_block.clear();
        }
        taken
    }
}

impl Pending {
    fn new() -> Self {
        Pending {
            records: Vec::new(),
            bytes: 0,
            frees: Vec::new(),
            staged: 0,
            layout: Vec::new(),
            units: 1,
            last_block_used: HEADER_BYTES,
            need_data: 0,
            allocations: std::collections::HashSet::new(),
            deferred: Deferred::default(),
        }
    }

    /// Appends `record` after the held-back records it must follow.
    fn push(&mut self, record: Record, extra: usize) {
        for (_, earlier, free) in self.deferred.conflicting(&record, None) {
            self.push_now(earlier, 0, true);
            self.frees.extend(free);
        }
        self.push_now(record, extra, true);
    }

    /// Appends `record`, counting `extra` more bytes for it in `bytes`;
    /// `data_pending`: false for a record whose data is durable already.
    fn push_now(&mut self, record: Record, extra: usize, data_pending: bool) {
        match &record {
            Record::Map { volume, block, new, .. } if *new != 0 => {
                self.allocations.insert((*volume, *block));
            }
            Record::Relocate { block, owners, .. } => {
                self.allocations.extend(owners.iter().map(|owner| (*owner, *block)));
            }
            _ => {}
        }
        let length = record.encoded_len();
        if self.last_block_used + length > LOG_BLOCK_BYTES as usize {
            self.units += 1;
            self.last_block_used = HEADER_BYTES;
        }
        self.last_block_used += length;
        if record.payload().is_some() {
            self.units += 1;
        }
        if data_pending && record.needs_durable_data() {
            self.need_data += 1;
        }
        self.bytes += length + extra;
        self.records.push(record);
    }

    /// Takes every record, leaving nothing pending (held-back records stay
    /// held back).
    fn take(&mut self) -> (Vec<Record>, Vec<(u8, u64)>) {
        let taken = (std::mem::take(&mut self.records), std::mem::take(&mut self.frees));
        let deferred = std::mem::take(&mut self.deferred);
        *self = Pending::new();
        self.deferred = deferred;
        taken
    }

    /// Appends the held-back records `pick` chooses (by the pass that holds
    /// them and their (volume, block)); with `data_pending` their commit
    /// flushes the data devices first.
    fn release_where(&mut self, pick: impl Fn(u64, (u32, u64)) -> bool, data_pending: bool) -> usize {
        let released = self.deferred.take_where(pick);
        let count = released.len();
        for (_, record, free) in released {
            self.push_now(record, 0, data_pending);
            self.frees.extend(free);
        }
        count
    }
}

/// Where the log lives and how far it goes.
pub struct Log {
    device: Arc<dyn Device>,
    offset: u64,
    len: u64,
    pool_tag: u64,
    pending: crate::sync::Ranked<crate::sync::WatchedMutex<Pending>>,
    /// Mirrors `pending.bytes` so callers can check it without the lock.
    pending_bytes: std::sync::atomic::AtomicUsize,
    /// Position of the next block to write.
    next_lsn: AtomicU64,
    /// Oldest position still needed (the last checkpoint's LSN).
    tail_lsn: AtomicU64,
    /// Commit tickets: every `commit` call takes one when it starts; a commit
    /// that begins after a ticket was issued serves it.
    tickets_issued: AtomicU64,
    /// Tickets served by a commit that flushed the data devices first.
    tickets_served: AtomicU64,
    /// Tickets served by any commit (their records are durable, and the
    /// data those records need, but not necessarily other writes).
    records_served: AtomicU64,
    commit_lock: crate::sync::Ranked<tokio::sync::Mutex<()>>,
    /// Destage passes numbered so far ([`Log::new_pass`]).
    passes: AtomicU64,
    /// Bytes written to the log device (for the metadata-cost benchmark).
    pub bytes_written: AtomicU64,
    /// Records appended since start (lets writers tell whether they added any).
    pub appended: AtomicU64,
    /// Bytes handed to the log device by staging (not flushed; rewritten by
    /// the next commit, so the kernel usually merges them in its page cache).
    pub staged_bytes: AtomicU64,
    /// Commits that wrote records, and the records they wrote (their
    /// ratio is the group-commit batch size the dashboard shows).
    pub commits: AtomicU64,
    pub committed_records: AtomicU64,
}

impl Log {
    /// A log over `[offset, offset + len)` of `device`, resuming at `tail_lsn`
    /// (the checkpoint's) and continuing at `next_lsn` (the end of replay).
    pub fn new(device: Arc<dyn Device>, offset: u64, len: u64, pool_tag: u64, tail_lsn: u64, next_lsn: u64) -> Self {
        assert!(
            len.is_multiple_of(LOG_BLOCK_BYTES) && len >= 16 * LOG_BLOCK_BYTES,
            "log region too small"
        );
        assert!(next_lsn >= tail_lsn && next_lsn.is_multiple_of(LOG_BLOCK_BYTES));
        Log {
            device,
            offset,
            len,
            pool_tag,
            pending: crate::sync::Ranked::new(
                crate::sync::Rank::LogPending,
                0,
                crate::sync::WatchedMutex::new(Pending::new()),
            ),
            pending_bytes: std::sync::atomic::AtomicUsize::new(0),
            next_lsn: AtomicU64::new(next_lsn),
            tail_lsn: AtomicU64::new(tail_lsn),
            tickets_issued: AtomicU64::new(0),
            tickets_served: AtomicU64::new(0),
            records_served: AtomicU64::new(0),
            commit_lock: crate::sync::Ranked::new(crate::sync::Rank::CommitLock, 0, tokio::sync::Mutex::new(())),
            passes: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            appended: AtomicU64::new(0),
            staged_bytes: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            committed_records: AtomicU64::new(0),
        }
    }

    /// How often a thread found the pending records' lock held, and the
    /// waits summed (µs): see [`crate::sync::WatchedMutex`].
    pub fn lock_contention(&self) -> (u64, u64) {
        self.pending.contention()
    }

    /// Queues a record; it becomes durable with the next commit.
    pub fn append(&self, record: Record) {
        let mut pending = self.pending.lock_or_abort();
        pending.push(record, 0);
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        self.appended.fetch_add(1, Ordering::Relaxed);
    }

    /// The blocks of `volume` in `first..=last` whose allocation (`Map`
    /// record) is still pending, i.e. at most staged. A write must not
    /// overwrite such a block in place: a staged record is replayed only
    /// if the data it maps matches its checksums, so the block goes to a
    /// new slot instead (see `EngineVolume::write_locked`). No lookups
    /// while no allocation is pending (the usual case for a mapped block).
    ///
    /// Blocks with records held back by a destage pass count too: their
    /// new slot is not even staged.
    pub fn pending_allocations(&self, volume: u32, first: u64, last: u64) -> Vec<u64> {
        let pending = self.pending.lock_or_abort();
        if pending.allocations.is_empty() && pending.deferred.blocks.is_empty() {
            return Vec::new();
        }
        (first..=last)
            .filter(|block| {
                pending.allocations.contains(&(volume, *block))
                    || pending.deferred.blocks.contains_key(&(volume, *block))
            })
            .collect()
    }

    /// A new destage pass's number, for [`Log::defer`].
    pub fn new_pass(&self) -> u64 {
        self.passes.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Holds `record` back for `pass` (freeing `free` once durable) until
    /// [`Log::release`]: see [`Deferred`]. Records of its block that other
    /// passes hold back are appended first.
    pub fn defer(&self, pass: u64, record: Record, free: Option<(u8, u64)>) {
        let mut pending = self.pending.lock_or_abort();
        let earlier = pending.deferred.conflicting(&record, Some(pass));
        let pushed = earlier.len();
        for (_, earlier, free) in earlier {
            pending.push_now(earlier, 0, true);
            pending.frees.extend(free);
        }
        // (Only Map and Written records are held back: one block each.)
        let Touches::Blocks(blocks) = pending.deferred.touches(&record) else {
            pending.push(record, 0);
            pending.frees.extend(free);
            self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
            self.appended.fetch_add(pushed as u64 + 1, Ordering::Relaxed);
            return;
        };
        let key = blocks[0];
        if let Record::Written { volume, count, .. } = &record {
            pending.deferred.per_block.insert(*volume, *count);
        }
        pending.deferred.blocks.insert(key, pass);
        pending.deferred.records.push((pass, record, free));
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        self.appended.fetch_add(pushed as u64, Ordering::Relaxed);
    }

    /// Appends what `pass` held back: with `flushed`, the data devices were
    /// flushed after every data write those records need, so they need no
    /// flush before their commit. Returns how many.
    pub fn release(&self, pass: u64, flushed: bool) -> usize {
        self.release_where(|owner, _| owner == pass, !flushed)
    }

    /// Appends every held-back record (of `volume`'s blocks `first..=last`,
    /// or all with `None`), to be committed after a data flush like any
    /// other: before a commit that must cover every change made so far (a
    /// checkpoint), or that must give slots back.
    pub fn settle(&self, blocks: Option<(u32, u64, u64)>) {
        self.release_where(
            |_, (volume, block)| match blocks {
                Some((v, first, last)) => v == volume && (first..=last).contains(&block),
                None => true,
            },
            true,
        );
    }

    /// Appends the held-back records `pick` chooses (see
    /// [`Pending::release_where`]); returns how many.
    fn release_where(&self, pick: impl Fn(u64, (u32, u64)) -> bool, data_pending: bool) -> usize {
        let mut pending = self.pending.lock_or_abort();
        if pending.deferred.records.is_empty() {
            return 0;
        }
        let count = pending.release_where(pick, data_pending);
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        self.appended.fetch_add(count as u64, Ordering::Relaxed);
        count
    }

    /// Whether `pass` holds records back.
    pub fn holds(&self, pass: u64) -> bool {
        let pending = self.pending.lock_or_abort();
        pending.deferred.records.iter().any(|(owner, _, _)| *owner == pass)
    }

    /// Queues a record that releases a slot; `commit` hands the slot back
    /// once the record is durable (reusing it earlier could let a crash
    /// resurrect the old mapping over someone else's data).
    pub fn append_free(&self, record: Record, slot: (u8, u64)) {
        let mut pending = self.pending.lock_or_abort();
        // The block's new slot is a pending allocation like any other: a
        // rewrite before the commit must not overwrite it in place.
        pending.push(record, 0);
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        pending.frees.push(slot);
        self.appended.fetch_add(1, Ordering::Relaxed);
    }

    /// Queues a record that frees several slots once it is durable.
    pub fn append_frees(&self, record: Record, slots: Vec<(u8, u64)>) {
        let mut pending = self.pending.lock_or_abort();
        pending.push(record, 0);
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        pending.frees.extend(slots);
        self.appended.fetch_add(1, Ordering::Relaxed);
    }

    /// Queues records (in order) under one lock.
    pub fn append_all(&self, records: Vec<Record>) {
        let mut pending = self.pending.lock_or_abort();
        let count = records.len() as u64;
        for record in records {
            let payload = if record.payload().is_some() { 4096 } else { 0 };
            pending.push(record, payload);
        }
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        self.appended.fetch_add(count, Ordering::Relaxed);
    }

    /// Bytes a commit may still add before the log counts as full (pending
    /// records included).
    pub fn room(&self) -> u64 {
        let pending = self.pending.lock_or_abort();
        let used = self.next_lsn() - self.tail_lsn.load(Ordering::Acquire) + pending.units * LOG_BLOCK_BYTES;
        (self.len / 4 * 3).saturating_sub(used)
    }

    /// The oldest position still kept.
    pub fn tail_lsn(&self) -> u64 {
        self.tail_lsn.load(Ordering::Acquire)
    }

    /// Bytes of records waiting for a commit.
    /// Whether slots wait for a commit to become free again.
    pub fn has_pending_frees(&self) -> bool {
        let pending = self.pending.lock_or_abort();
        !pending.frees.is_empty() || pending.deferred.records.iter().any(|(_, _, free)| free.is_some())
    }

    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes.load(Ordering::Relaxed)
    }

    pub fn next_lsn(&self) -> u64 {
        self.next_lsn.load(Ordering::Acquire)
    }

    /// Fraction of the region in use, 0.0 to 1.0.
    pub fn usage(&self) -> f64 {
        (self.next_lsn() - self.tail_lsn.load(Ordering::Acquire)) as f64 / self.len as f64
    }

    /// Frees the log up to `lsn` (after a checkpoint covering it committed).
    pub fn set_tail(&self, lsn: u64) {
        self.tail_lsn.store(lsn, Ordering::Release);
    }

    /// Makes every record appended before this call durable, after running
    /// `before_write` (the pool flushes its data devices there, so a record
    /// never becomes durable before the data it points to, and every data
    /// write completed before the call is durable too). Concurrent calls
    /// are merged: whoever commits serves everyone who asked before it began.
    /// `reserve` lets a checkpoint use the last quarter of the region.
    /// Returns the slots whose release became durable.
    pub async fn commit<F, Fut>(&self, before_write: F, reserve: bool) -> Result<Vec<(u8, u64)>, LogError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), DeviceError>>,
    {
        self.commit_served(before_write, reserve, true).await
    }

    /// [`Log::commit`] for a caller that needs only the records appended
    /// before this call durable, not its other data writes (a synchronous
    /// write whose data is in its `Data` records, a file's namespace
    /// change): `before_write` runs only if a record taken needs data
    /// written before it durable. A commit that took only such records
    /// (Data records, marks, namespace rows) is one log write and one flush
    /// of the log, whatever the destager wrote meanwhile.
    ///
    /// `reserve` as for [`Log::commit`].
    pub async fn commit_records<F, Fut>(&self, before_write: F, reserve: bool) -> Result<Vec<(u8, u64)>, LogError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), DeviceError>>,
    {
        self.commit_served(before_write, reserve, false).await
    }

    /// A commit serving tickets: with `data`, the caller's ticket counts as
    /// served only by a commit that ran `before_write`.
    async fn commit_served<F, Fut>(
        &self,
        before_write: F,
        reserve: bool,
        data: bool,
    ) -> Result<Vec<(u8, u64)>, LogError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), DeviceError>>,
    {
        let ticket = self.tickets_issued.fetch_add(1, Ordering::AcqRel) + 1;
        let _guard = self.commit_lock.lock().await;
        let served = if data {
            &self.tickets_served
        } else {
            &self.records_served
        };
        if served.load(Ordering::Acquire) >= ticket {
            return Ok(Vec::new());
        }
        let covering = self.tickets_issued.load(Ordering::Acquire);
        // The records first, then the data flush: a record appended while
        // the flush is in flight may belong to a write that completed after
        // the flush was issued, so it waits for the next commit (taking the
        // records after the flush committed such mappings with their data
        // not yet durable). Every covered ticket's records are pending by
        // now: a writer appends before it takes its ticket.
        let (records, frees, need_data) = self.take_pending(reserve, false)?.unwrap_or_default();
        let flush = data || need_data;
        if flush {
            if let Err(e) = before_write().await {
                self.restore_pending(records, frees);
                return Err(e.into());
            }
        }
        if !records.is_empty() {
            if let Err(e) = self.write_blocks(&records, true, 0).await {
                self.restore_pending(records, frees);
                return Err(e);
            }
            self.count_commit(records.len());
        }
        if flush {
            self.tickets_served.store(covering, Ordering::Release);
        }
        self.records_served.store(covering, Ordering::Release);
        Ok(frees)
    }

    /// Commits the pending records without flushing the data devices first,
    /// if none of them needs data written before it to be durable (only
    /// `Dirty` marks, unmappings, `Data` records that carry their own
    /// payload, `Destroy`): the `Dirty` mark a write must make durable
    /// before it touches a chunk costs one log write, not an fdatasync of
    /// every data device. `Ok(None)`: a record needs the data flush; use
    /// [`Log::commit`]. It serves no commit tickets: a writer waiting
    /// in `commit` for its completed data to become durable still gets its
    /// data flush.
    pub async fn commit_marks(&self) -> Result<Option<Vec<(u8, u64)>>, LogError> {
        let _guard = self.commit_lock.lock().await;
        let Some((records, frees, _)) = self.take_pending(false, true)? else {
            return Ok(None);
        };
        if !records.is_empty() {
            if let Err(e) = self.write_blocks(&records, true, 0).await {
                self.restore_pending(records, frees);
                return Err(e);
            }
            self.count_commit(records.len());
        }
        Ok(Some(frees))
    }

    fn count_commit(&self, records: usize) {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.committed_records.fetch_add(records as u64, Ordering::Relaxed);
    }

    /// Takes every pending record (and the frees they make) for a commit, if
    /// the log has room for them, and whether one of them needs the data
    /// devices flushed before it. With `only_marks`, takes nothing and
    /// returns `None` when a record needs durable data before it.
    #[allow(clippy::type_complexity)]
    fn take_pending(
        &self,
        reserve: bool,
        only_marks: bool,
    ) -> Result<Option<(Vec<Record>, Vec<(u8, u64)>, bool)>, LogError> {
        let mut pending = self.pending.lock_or_abort();
        if only_marks && pending.need_data > 0 {
            return Ok(None);
        }
        let used = self.next_lsn() - self.tail_lsn.load(Ordering::Acquire);
        let limit = if reserve { self.len } else { self.len / 4 * 3 };
        if used + pending.units * LOG_BLOCK_BYTES > limit {
            return Err(LogError::Full);
        }
        self.pending_bytes.store(0, Ordering::Relaxed);
        let need_data = pending.need_data > 0;
        let (records, frees) = pending.take();
        Ok(Some((records, frees, need_data)))
    }

    /// Puts records whose write failed back in front, so a later commit
    /// retries them.
    fn restore_pending(&self, records: Vec<Record>, frees: Vec<(u8, u64)>) {
        let mut pending = self.pending.lock_or_abort();
        let (later, later_frees) = pending.take();
        // Held-back records stay after them: they came later.
        for record in records.into_iter().chain(later) {
            pending.push_now(record, 0, true);
        }
        self.pending_bytes.store(pending.bytes, Ordering::Relaxed);
        pending.frees = frees;
        pending.frees.extend(later_frees);
    }

    /// Encodes `records` into blocks and writes them from `first_unit`
    /// units past `next_lsn`. Returns where each record block went: (index
    /// of its first record in `records`, its unit from `next_lsn`).
    ///
    /// A commit (`committed`, from unit 0) flushes and advances `next_lsn`;
    /// staging leaves both alone, so the next commit rewrites the same
    /// blocks, marked committed, with more records after them.
    async fn write_blocks(
        &self,
        records: &[Record],
        committed: bool,
        first_unit: u64,
    ) -> Result<Vec<(usize, u64)>, LogError> {
        debug_assert!(!committed || first_unit == 0);
        let start_lsn = self.next_lsn();
        let blocks = pack(records);
        // The 4 KiB units in log order: each record block, then its payloads.
        let mut units: Vec<Unit<'_>> = Vec::new();
        let mut layout = Vec::with_capacity(blocks.len());
        for block in &blocks {
            layout.push((block.first_record, first_unit + units.len() as u64));
            units.push(Unit::Header(block));
            units.extend(block.payloads.iter().map(Unit::Payload));
        }
        let count = units.len() as u64;
        // One device write per contiguous run (two when the region wraps).
        let mut index = 0;
        let mut lsn = start_lsn + first_unit * LOG_BLOCK_BYTES;
        while index < units.len() {
            let physical = lsn % self.len;
            let room = ((self.len - physical) / LOG_BLOCK_BYTES) as usize;
            let run = room.min(units.len() - index);
            let mut buf = IoBuf::new(run * LOG_BLOCK_BYTES as usize);
            for (i, unit) in units[index..index + run].iter().enumerate() {
                let at = i * LOG_BLOCK_BYTES as usize;
                let out = &mut buf.payload_mut()[at..at + LOG_BLOCK_BYTES as usize];
                match unit {
                    Unit::Header(block) => encode_block(
                        out,
                        lsn + i as u64 * LOG_BLOCK_BYTES,
                        self.pool_tag,
                        &block.body,
                        committed,
                        block.payloads.len(),
                    ),
                    Unit::Payload(data) => out.copy_from_slice(data),
                }
            }
            let (_, result) = self.device.write(self.offset + physical, buf).await;
            result?;
            let counter = if committed {
                &self.bytes_written
            } else {
                &self.staged_bytes
            };
            counter.fetch_add(run as u64 * LOG_BLOCK_BYTES, Ordering::Relaxed);
            lsn += run as u64 * LOG_BLOCK_BYTES;
            index += run;
        }
        if committed {
            // Only the log region: on a device that holds data too, a whole
            // flush would also write back every dirty data page (the data
            // devices are flushed separately, when a commit needs it).
            self.device.flush_range(self.offset, self.len).await?;
            self.next_lsn
                .store(start_lsn + count * LOG_BLOCK_BYTES, Ordering::Release);
        }
        Ok(layout)
    }

    /// Hands every pending record to the log device without a flush and
    /// without committing it. This is not durability: it only makes a
    /// completed write survive the death of this process (the kernel keeps
    /// what it was given), so a client that counts a write as done when it
    /// completes (fio's verify state does) finds it after a kill -9 even if
    /// its flush never came. Replay trusts such staged records only when the
    /// data they point at checks out (see `pool::Pool::recover`).
    ///
    /// On a page-cache log device staging is a memory copy the kernel merges
    /// with the next commit's write of the same block; on an O_DIRECT log
    /// device it is one more 4 KiB device write per allocating request
    /// (what a dedicated `log` device is for).
    pub async fn stage(&self) -> Result<(), LogError> {
        let _guard = self.commit_lock.lock().await;
        // Blocks before the one holding the first unstaged record are
        // already on the device exactly as they would be written now: only
        // the records from that block on are copied and written.
        let (tail, first_record, first_unit, units) = {
            let mut pending = self.pending.lock_or_abort();
            if pending.staged == pending.records.len() {
                return Ok(());
            }
            let staged = pending.staged;
            let keep = pending.layout.partition_point(|&(first, _)| first <= staged);
            let (first_record, first_unit) = match keep.checked_sub(1) {
                Some(block) => pending.layout[block],
                None => (0, 0),
            };
            pending.layout.truncate(keep.saturating_sub(1));
            let tail = pending.records[first_record..].to_vec();
            (tail, first_record, first_unit, pending.units)
        };
        let used = self.next_lsn() - self.tail_lsn.load(Ordering::Acquire);
        if used + units * LOG_BLOCK_BYTES > self.len {
            // No room to stage; the records stay pending for the next commit.
            return Ok(());
        }
        let written = self.write_blocks(&tail, false, first_unit).await?;
        // Records appended meanwhile are simply not staged yet (records
        // already pending never change: see `pending_allocations`).
        let mut pending = self.pending.lock_or_abort();
        pending.staged = first_record + tail.len();
        pending
            .layout
            .extend(written.into_iter().map(|(first, unit)| (first_record + first, unit)));
        Ok(())
    }

    /// Makes the block at the next commit position invalid, so that stale
    /// staged blocks left after a crash are never replayed by a later
    /// recovery (they were already applied, or rightly ignored, by this one).
    /// `end` is where the valid blocks read by replay ended.
    pub async fn seal(&self, end: u64) -> Result<(), LogError> {
        let _guard = self.commit_lock.lock().await;
        let mut lsn = self.next_lsn();
        let stop = end.max(lsn + LOG_BLOCK_BYTES);
        while lsn < stop {
            let physical = lsn % self.len;
            let (_, result) = self
                .device
                .write(self.offset + physical, IoBuf::new(LOG_BLOCK_BYTES as usize))
                .await;
            result?;
            lsn += LOG_BLOCK_BYTES;
        }
        self.device.flush().await?;
        Ok(())
    }

    /// Checks one copy of the committed blocks a recovery would replay now
    /// (from the tail to the next commit position), as `device` (the log's
    /// device, or one child of its mirror) holds them: every record block
    /// must decode and every payload match its checksum, as replay wants.
    /// Returns the bytes that do not, counting everything after a record
    /// block that does not decode (its payloads cannot be told apart from
    /// the blocks after them), and only what is still needed when the check
    /// ends: the blocks a checkpoint moved the tail past meanwhile may have
    /// been written again.
    ///
    /// No lock is held while reading: a committed block is never rewritten
    /// until the tail has passed it (the head only takes room past the
    /// tail), and the end is read under the commit lock, so no commit is
    /// halfway through the blocks before it.
    pub async fn check_copy(&self, device: &Arc<dyn Device>) -> Result<u64, DeviceError> {
        let end = {
            let _guard = self.commit_lock.lock().await;
            self.next_lsn()
        };
        let mut reader = UnitReader {
            device,
            offset: self.offset,
            len: self.len,
            window_lsn: 0,
            window: Vec::new(),
        };
        let mut bad: Vec<(u64, u64)> = Vec::new();
        let mut lsn = self.tail_lsn();
        while lsn < end {
            let block = reader.unit(lsn).await?;
            let Some((records, _, payloads)) = decode_block(&block, lsn, self.pool_tag) else {
                bad.push((lsn, end));
                break;
            };
            let mut at = lsn + LOG_BLOCK_BYTES;
            for record in &records {
                if let Record::Data { crc, .. } = record {
                    if at < end && crate::checksum::crc32c(&reader.unit(at).await?) != *crc {
                        bad.push((at, at + LOG_BLOCK_BYTES));
                    }
                    at += LOG_BLOCK_BYTES;
                }
            }
            lsn += (1 + payloads as u64) * LOG_BLOCK_BYTES;
        }
        let tail = self.tail_lsn();
        Ok(bad.iter().map(|&(from, to)| to.saturating_sub(from.max(tail))).sum())
    }

    /// Reads the valid records from `tail_lsn` on. Returns them (each with
    /// whether a commit wrote it, as opposed to staging, and the LSN of its
    /// block), the LSN where the next block should go (after the last
    /// committed block; staged blocks are rewritten by the next commit), and
    /// where the valid blocks end.
    #[allow(clippy::type_complexity)]
    pub async fn replay(
        device: &Arc<dyn Device>,
        offset: u64,
        len: u64,
        pool_tag: u64,
        tail_lsn: u64,
    ) -> Result<(Vec<(Record, bool, u64)>, u64, u64), DeviceError> {
        let mut reader = UnitReader {
            device,
            offset,
            len,
            window_lsn: 0,
            window: Vec::new(),
        };
        let mut records = Vec::new();
        let mut lsn = tail_lsn;
        let mut next = tail_lsn;
        while lsn - tail_lsn < len {
            let block = reader.unit(lsn).await?;
            let Some((mut decoded, committed, payloads)) = decode_block(&block, lsn, pool_tag) else {
                break;
            };
            let units = 1 + payloads as u64;
            if lsn - tail_lsn + units * LOG_BLOCK_BYTES > len {
                break;
            }
            // Attach each Data record's payload; a torn payload ends the log.
            let mut at = lsn + LOG_BLOCK_BYTES;
            let mut intact = true;
            for record in decoded.iter_mut() {
                if let Record::Data { crc, data, .. } = record {
                    let payload = reader.unit(at).await?;
                    if crate::checksum::crc32c(&payload) != *crc {
                        intact = false;
                        break;
                    }
                    *data = Arc::from(payload);
                    at += LOG_BLOCK_BYTES;
                }
            }
            if !intact {
                break;
            }
            records.extend(decoded.into_iter().map(|r| (r, committed, lsn)));
            lsn += units * LOG_BLOCK_BYTES;
            if committed {
                next = lsn;
            }
        }
        Ok((records, next, lsn))
    }
}

/// One 4 KiB unit of the log being written.
enum Unit<'a> {
    Header(&'a PackedBlock),
    Payload(&'a Arc<[u8]>),
}

/// Reads log units through a window of `REPLAY_BATCH_BLOCKS` units.
struct UnitReader<'a> {
    device: &'a Arc<dyn Device>,
    offset: u64,
    len: u64,
    window_lsn: u64,
    window: Vec<u8>,
}

impl UnitReader<'_> {
    async fn unit(&mut self, lsn: u64) -> Result<Vec<u8>, DeviceError> {
        let cached = self.window.len() as u64 / LOG_BLOCK_BYTES;
        if lsn < self.window_lsn || lsn >= self.window_lsn + cached {
            let physical = lsn % self.len;
            let blocks = REPLAY_BATCH_BLOCKS.min((self.len - physical) / LOG_BLOCK_BYTES);
            let (buf, result) = self
                .device
                .read(self.offset + physical, IoBuf::new((blocks * LOG_BLOCK_BYTES) as usize))
                .await;
            result?;
            self.window = buf.payload().to_vec();
            self.window_lsn = lsn;
        }
        let at = ((lsn - self.window_lsn) * LOG_BLOCK_BYTES) as usize;
        Ok(self.window[at..at + LOG_BLOCK_BYTES as usize].to_vec())
    }
}

/// A record block being written: its body, the index of its first record,
/// and the payloads of its Data records (written right after it).
struct PackedBlock {
    body: Vec<u8>,
    first_record: usize,
    payloads: Vec<Arc<[u8]>>,
}

/// Splits records into record blocks.
fn pack(records: &[Record]) -> Vec<PackedBlock> {
    let mut blocks = Vec::new();
    let mut current = PackedBlock {
        body: Vec::with_capacity(LOG_BLOCK_BYTES as usize),
        first_record: 0,
        payloads: Vec::new(),
    };
    for (index, record) in records.iter().enumerate() {
        if HEADER_BYTES + current.body.len() + record.encoded_len() > LOG_BLOCK_BYTES as usize {
            let fresh = PackedBlock {
                body: Vec::with_capacity(LOG_BLOCK_BYTES as usize),
                first_record: index,
                payloads: Vec::new(),
            };
            blocks.push(std::mem::replace(&mut current, fresh));
        }
        record.encode(&mut current.body);
        if let Some(payload) = record.payload() {
            current.payloads.push(payload.clone());
        }
    }
    blocks.push(current);
    blocks
}

/// Log units (4 KiB) that `records` take: record blocks plus payloads
/// (what `Pending` counts as records arrive).
#[cfg(test)]
fn blocks_needed(records: &[Record]) -> u64 {
    let mut blocks = 1u64;
    let mut used = HEADER_BYTES;
    for record in records {
        if used + record.encoded_len() > LOG_BLOCK_BYTES as usize {
            blocks += 1;
            used = HEADER_BYTES;
        }
        used += record.encoded_len();
        if record.payload().is_some() {
            blocks += 1;
        }
    }
    blocks
}

/// The seed writer of `pool::fuzzing` encodes records with this.
#[cfg(test)]
pub(crate) fn encode_record_for_fuzzing(record: &Record, out: &mut Vec<u8>) {
    record.encode(out);
}

/// Fuzz entry point (see `pool::fuzzing`): `data` becomes the body and
/// flags of a block with a valid header and checksum, so the record decoder
/// is reached; whatever decodes must encode back to the same body.
#[doc(hidden)]
pub fn fuzz_block(data: &[u8]) {
    let (flags, body) = match data {
        [a, b, c, d, rest @ ..] => (u32::from_le_bytes([*a, *b, *c, *d]), rest),
        _ => return,
    };
    let body = &body[..body.len().min(LOG_BLOCK_BYTES as usize - HEADER_BYTES)];
    let mut block = vec![0u8; LOG_BLOCK_BYTES as usize];
    encode_block(&mut block, 7, 9, body, false, 0);
    block[28..32].copy_from_slice(&flags.to_le_bytes());
    let crc = crate::checksum::crc32c(&block[8..]);
    block[4..8].copy_from_slice(&crc.to_le_bytes());
    if let Some((records, committed, payloads)) = decode_block(&block, 7, 9) {
        assert_eq!(committed, flags & FLAG_COMMITTED != 0);
        assert_eq!(payloads, (flags >> PAYLOAD_SHIFT) as usize);
        let mut again = Vec::new();
        for record in &records {
            record.encode(&mut again);
        }
        assert_eq!(again, body, "a decoded body re-encodes to itself");
    }
    // The same bytes as a block of another LSN or pool are refused.
    assert!(decode_block(&block, 8, 9).is_none() && decode_block(&block, 7, 10).is_none());
    // Every shorter prefix of the body decodes to records or nothing.
    let _ = Record::decode(body);
}

/// Block flag: written by a commit (data devices were flushed first).
const FLAG_COMMITTED: u32 = 1;

/// Header flags bits 16..31: how many payload blocks follow the block.
const PAYLOAD_SHIFT: u32 = 16;

fn encode_block(out: &mut [u8], lsn: u64, pool_tag: u64, body: &[u8], committed: bool, payloads: usize) {
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[8..16].copy_from_slice(&lsn.to_le_bytes());
    out[16..24].copy_from_slice(&pool_tag.to_le_bytes());
    out[24..28].copy_from_slice(&(body.len() as u32).to_le_bytes());
    let flags = if committed { FLAG_COMMITTED } else { 0 } | (payloads as u32) << PAYLOAD_SHIFT;
    out[28..32].copy_from_slice(&flags.to_le_bytes());
    out[HEADER_BYTES..HEADER_BYTES + body.len()].copy_from_slice(body);
    let crc = crate::checksum::crc32c(&out[8..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// Decodes a block if it is a valid block of this pool at `lsn`: its records
/// (Data records without their payloads), whether a commit wrote it, and how
/// many payload blocks follow it.
fn decode_block(block: &[u8], lsn: u64, pool_tag: u64) -> Option<(Vec<Record>, bool, usize)> {
    if block.len() != LOG_BLOCK_BYTES as usize {
        return None;
    }
    let u32_at = |at: usize| crate::bytes::u32_at(block, at);
    let u64_at = |at: usize| crate::bytes::u64_at(block, at);
    if u32_at(0)? != MAGIC
        || u64_at(8)? != lsn
        || u64_at(16)? != pool_tag
        || crate::checksum::crc32c(&block[8..]) != u32_at(4)?
    {
        return None;
    }
    let used = u32_at(24)? as usize;
    let body = block.get(HEADER_BYTES..HEADER_BYTES + used)?;
    let mut records = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let (record, length) = Record::decode(&body[at..])?;
        records.push(record);
        at += length;
    }
    let flags = u32_at(28)?;
    let payloads = (flags >> PAYLOAD_SHIFT) as usize;
    if records.iter().filter(|r| matches!(r, Record::Data { .. })).count() != payloads {
        return None;
    }
    Some((records, flags & FLAG_COMMITTED != 0, payloads))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_round_trip_and_rejections() {
        let records = vec![
            Record::Dirty { device: 1, chunk: 77 },
            Record::Map {
                volume: 3,
                block: 9,
                new: 1 << 63 | 5,
                old: 0,
                crcs: vec![1, 2, 3, 4],
            },
            Record::Map {
                volume: 3,
                block: 10,
                new: 0,
                old: 1 << 63 | 5,
                crcs: vec![],
            },
            Record::Destroy { volume: 4 },
            Record::Snapshot {
                generation: 3,
                created_unix: 1_700_000_000,
                cache_seq: 0,
                snapshots: vec![SnapshotEntry {
                    volume: 3,
                    snapshot: 0x8000_0003,
                    mapped_blocks: 1,
                    size_bytes: 1 << 20,
                    name: "from-an-older-pool".into(),
                }],
            },
            Record::Snapshot {
                generation: 4,
                created_unix: 1_700_000_000,
                cache_seq: 981,
                snapshots: vec![
                    SnapshotEntry {
                        volume: 3,
                        snapshot: 0x8000_0001,
                        mapped_blocks: 12,
                        size_bytes: 1 << 30,
                        name: "before-upgrade".into(),
                    },
                    SnapshotEntry {
                        volume: 4,
                        snapshot: 0x8000_0002,
                        mapped_blocks: 0,
                        size_bytes: 4096,
                        name: "é".into(),
                    },
                ],
            },
            Record::CopyPage {
                volume: 3,
                page: 1,
                snapshot: 0x8000_0001,
                generation: 3,
            },
            Record::DestroySnapshot { snapshot: 0x8000_0002 },
            Record::Rollback {
                volume: 3,
                snapshot: 0x8000_0001,
            },
            Record::Clone {
                volume: 5,
                origin: 0x8000_0001,
            },
            Record::ClonePage { volume: 5, page: 9 },
            Record::Promote {
                volume: 5,
                origin: 0x8000_0001,
            },
            Record::Relocate {
                block: 77,
                old: (1 << 63) | 5,
                new: (1 << 63) | (1 << 48) | 9,
                crcs: vec![1, 2, 3, 4],
                owners: vec![3, 0x8000_0001, 0x8000_0004],
            },
            Record::Sums {
                device: 2,
                offset: 1 << 30,
                crcs: vec![5, 6, 7],
            },
        ];
        for record in &records {
            let mut one = Vec::new();
            record.encode(&mut one);
            assert_eq!(one.len(), record.encoded_len(), "{record:?}");
        }
        let mut body = Vec::new();
        for r in &records {
            r.encode(&mut body);
        }
        let mut block = vec![0u8; LOG_BLOCK_BYTES as usize];
        encode_block(&mut block, 8192, 42, &body, true, 0);
        assert_eq!(decode_block(&block, 8192, 42), Some((records.clone(), true, 0)));
        let mut staged = vec![0u8; LOG_BLOCK_BYTES as usize];
        encode_block(&mut staged, 8192, 42, &body, false, 0);
        assert_eq!(decode_block(&staged, 8192, 42), Some((records, false, 0)));
        assert_eq!(decode_block(&block, 4096, 42), None, "wrong position");
        assert_eq!(decode_block(&block, 8192, 43), None, "another pool");
        block[100] ^= 1;
        assert_eq!(decode_block(&block, 8192, 42), None, "corrupt");
    }

    #[test]
    fn data_records_carry_their_cache_sequence_number() {
        for seq in [0u64, 77] {
            let record = Record::Data {
                volume: 2,
                sector: 900,
                crc: 0xdead_beef,
                seq,
                data: Arc::from(Vec::new()),
            };
            let mut bytes = Vec::new();
            record.encode(&mut bytes);
            assert_eq!(bytes.len(), record.encoded_len());
            assert_eq!(bytes[0], if seq == 0 { 4 } else { 13 });
            assert_eq!(Record::decode(&bytes), Some((record, bytes.len())));
        }
        // A zero written in the newer form is malformed (it would not
        // encode back to the same bytes).
        let mut bytes = Vec::new();
        Record::Data {
            volume: 2,
            sector: 900,
            crc: 1,
            seq: 5,
            data: Arc::from(Vec::new()),
        }
        .encode(&mut bytes);
        bytes[17..25].fill(0);
        assert_eq!(Record::decode(&bytes), None);
    }

    /// A log of 64 blocks at the start of a simulated 1 MiB device.
    fn small_log() -> (Arc<dyn Device>, Log) {
        let device: Arc<dyn Device> = Arc::new(crate::device::SimDevice::new(1 << 20, 1));
        let log = Log::new(device.clone(), 0, 64 * LOG_BLOCK_BYTES, 7, 0, 0);
        (device, log)
    }

    /// A `Map` record giving block 3 of volume 1 a new slot (a new mapping:
    /// a commit that takes it must flush data first).
    fn new_mapping() -> Record {
        Record::Map {
            volume: 1,
            block: 3,
            new: 1 << 63 | 6,
            old: 0,
            crcs: vec![1, 2, 3, 4],
        }
    }

    #[test]
    fn a_records_commit_flushes_data_only_for_records_that_need_it() {
        use std::sync::atomic::AtomicUsize;
        let (device, log) = small_log();
        let data_flushes = AtomicUsize::new(0);
        let flush_data = || async {
            data_flushes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        let data = |sector: u64| Record::Data {
            volume: 1,
            sector,
            crc: crate::checksum::crc32c(&[sector as u8; 4096]),
            seq: sector,
            data: Arc::from(vec![sector as u8; 4096]),
        };
        crate::meta::store::block_on(async {
            // A synchronous write's Data records: one log write, no data flush.
            log.append(data(8));
            log.commit_records(flush_data, false).await.unwrap();
            assert_eq!(data_flushes.load(Ordering::SeqCst), 0);
            let after_data = log.next_lsn();
            assert!(after_data > 0, "the Data record was written");
            // A records commit that takes a new mapping flushes data first.
            log.append(data(9));
            log.append(new_mapping());
            log.commit_records(flush_data, false).await.unwrap();
            assert_eq!(data_flushes.load(Ordering::SeqCst), 1);
            // A caller that needs its in-place writes durable (a FLUSH) gets
            // a data flush even with nothing pending: a records commit
            // served nobody's data ticket.
            log.append(data(10));
            log.commit_records(flush_data, false).await.unwrap();
            assert_eq!(data_flushes.load(Ordering::SeqCst), 1);
            log.commit(flush_data, false).await.unwrap();
            assert_eq!(data_flushes.load(Ordering::SeqCst), 2);
        });
        // Everything committed is what replay finds, in order.
        let (records, _, _) =
            crate::meta::store::block_on(Log::replay(&device, 0, 64 * LOG_BLOCK_BYTES, 7, 0)).unwrap();
        let sectors: Vec<u64> = records
            .iter()
            .filter_map(|(r, committed, _)| match r {
                Record::Data { sector, .. } if *committed => Some(*sector),
                _ => None,
            })
            .collect();
        assert_eq!(sectors, vec![8, 9, 10]);
    }

    #[test]
    fn dirty_marks_commit_without_a_data_flush_and_serve_no_flush() {
        use std::sync::atomic::AtomicUsize;
        let (_device, log) = small_log();
        let data_flushes = AtomicUsize::new(0);
        let flush_data = || async {
            data_flushes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        crate::meta::store::block_on(async {
            // Marks only: written and flushed to the log, no data flush.
            log.append(Record::Dirty { device: 0, chunk: 3 });
            log.append(Record::Map {
                volume: 1,
                block: 2,
                new: 0,
                old: 1 << 63 | 5,
                crcs: vec![],
            });
            assert!(log.commit_marks().await.unwrap().is_some());
            let after_marks = log.next_lsn();
            assert!(after_marks > 0, "the marks were written");
            assert_eq!(data_flushes.load(Ordering::SeqCst), 0);
            // A writer that completed data before the marks commit and asks
            // for durability still gets its data flush.
            log.commit(flush_data, false).await.unwrap();
            assert_eq!(data_flushes.load(Ordering::SeqCst), 1);
            // A new mapping points at data: the marks commit declines and
            // writes nothing; a full commit flushes data first.
            log.append(Record::Dirty { device: 0, chunk: 4 });
            log.append(new_mapping());
            assert!(log.commit_marks().await.unwrap().is_none());
            assert_eq!(log.next_lsn(), after_marks, "nothing written");
            log.commit(flush_data, false).await.unwrap();
            assert_eq!(data_flushes.load(Ordering::SeqCst), 2);
            assert!(log.next_lsn() > after_marks);
            // `Written` retires Data records in favour of data in place.
            log.append(Record::Written {
                volume: 1,
                first_sector: 0,
                count: 4,
            });
            assert!(log.commit_marks().await.unwrap().is_none());
        });
    }

    fn map_of(volume: u32, block: u64, slot: u64) -> Record {
        Record::Map {
            volume,
            block,
            new: 1 << 63 | slot,
            old: 0,
            crcs: vec![7; 8],
        }
    }

    fn data_of(volume: u32, sector: u64) -> Record {
        Record::Data {
            volume,
            sector,
            crc: 1,
            seq: 9,
            data: Arc::from(vec![0u8; 4096]),
        }
    }

    fn pending_records(log: &Log) -> Vec<Record> {
        log.pending.lock_or_abort().records.clone()
    }

    #[test]
    fn held_back_records_wait_for_their_pass_and_then_need_no_data_flush() {
        let (_device, log) = small_log();
        let pass = log.new_pass();
        log.defer(pass, map_of(1, 5, 40), Some((0, 4096)));
        log.defer(
            pass,
            Record::Written {
                volume: 1,
                first_sector: 40,
                count: 8,
            },
            None,
        );
        assert!(log.holds(pass));
        // Nothing pending: a writer's commit meanwhile needs no data flush.
        let data = data_of(2, 41);
        log.append(data.clone());
        assert_eq!(pending_records(&log), vec![data.clone()]);
        assert_eq!(log.pending.lock_or_abort().need_data, 0);
        // A held-back allocation is one a write must not overwrite in place.
        assert_eq!(log.pending_allocations(1, 0, 9), vec![5]);
        assert!(log.has_pending_frees(), "the old slot comes back with the commit");
        // Released after the pass's own data flush: appended in order, with
        // the slot they free, and no data flush needed for them.
        assert_eq!(log.release(pass, true), 2);
        assert!(!log.holds(pass));
        let records = pending_records(&log);
        assert_eq!(records.len(), 3);
        assert_eq!(records[1], map_of(1, 5, 40));
        assert!(matches!(records[2], Record::Written { first_sector: 40, .. }));
        let pending = log.pending.lock_or_abort();
        assert_eq!(pending.need_data, 0);
        assert_eq!(pending.frees, vec![(0, 4096)]);
        assert!(pending.allocations.contains(&(1, 5)), "pending until committed");
    }

    #[test]
    fn a_change_of_a_held_back_block_appends_its_records_first() {
        let (_device, log) = small_log();
        let first = log.new_pass();
        log.defer(first, map_of(1, 5, 40), None);
        log.defer(
            first,
            Record::Written {
                volume: 1,
                first_sector: 40,
                count: 8,
            },
            None,
        );
        log.defer(first, map_of(1, 6, 41), None);
        // The same pass's records of one block stay held back, in order.
        assert!(pending_records(&log).is_empty());
        // A newer synchronous write of a sector of block 5 logs its Data:
        // block 5's records go first (the Written record must not land
        // after it, or replay would retire it), block 6's stay held back.
        let data = data_of(1, 43);
        log.append(data.clone());
        let records = pending_records(&log);
        assert_eq!(records.len(), 3);
        assert_eq!(records[0], map_of(1, 5, 40));
        assert!(matches!(records[1], Record::Written { first_sector: 40, .. }));
        assert_eq!(records[2], data);
        assert_eq!(log.pending.lock_or_abort().need_data, 2, "pushed out before the flush");
        // Another pass placing block 6 again: the first pass's record goes
        // first, the second's is held back.
        let second = log.new_pass();
        log.defer(second, map_of(1, 6, 42), None);
        assert_eq!(pending_records(&log)[3], map_of(1, 6, 41));
        assert!(!log.holds(first));
        assert!(log.holds(second));
        // A record whose blocks the log cannot tell (a snapshot's page
        // copy) appends everything held back first.
        log.append(Record::CopyPage {
            volume: 1,
            page: 0,
            snapshot: 0x8000_0001,
            generation: 2,
        });
        let records = pending_records(&log);
        assert_eq!(records[4], map_of(1, 6, 42));
        assert!(matches!(records[5], Record::CopyPage { .. }));
        assert!(!log.holds(second));
        // A pass that ends without its flush (an error) appends what it
        // holds as records that still need it.
        let third = log.new_pass();
        log.defer(third, map_of(2, 1, 50), None);
        let before = log.pending.lock_or_abort().need_data;
        assert_eq!(log.release(third, false), 1);
        assert_eq!(log.pending.lock_or_abort().need_data, before + 1);
        // `settle` appends them all, for a checkpoint or a write short of space.
        let fourth = log.new_pass();
        log.defer(fourth, map_of(2, 2, 51), None);
        log.defer(fourth, map_of(3, 2, 52), None);
        log.settle(Some((3, 0, 9)));
        assert_eq!(pending_records(&log).last(), Some(&map_of(3, 2, 52)));
        assert!(log.holds(fourth));
        log.settle(None);
        assert!(!log.holds(fourth));
    }

    #[test]
    fn held_back_records_stay_out_of_other_commits_until_released() {
        let (_device, log) = small_log();
        crate::meta::store::block_on(async {
            let pass = log.new_pass();
            log.defer(pass, map_of(1, 5, 40), None);
            log.append(Record::Dirty { device: 0, chunk: 3 });
            // A commit meanwhile takes the pending records only.
            assert!(log.commit_marks().await.unwrap().is_some());
            assert!(log.holds(pass));
            log.release(pass, true);
            // Released after the flush: the marks-only commit takes them.
            assert!(log.commit_marks().await.unwrap().is_some());
            assert!(pending_records(&log).is_empty());
        });
    }

    /// Staging re-packs only from the block holding the first unstaged
    /// record: whatever mix of appends and stages, replay finds exactly the
    /// pending records, and the running unit count is the packing's.
    #[test]
    fn incremental_staging_leaves_the_pending_records_on_the_device() {
        use crate::device::SimDevice;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for round in 0..20 {
            let device: Arc<dyn Device> = Arc::new(SimDevice::new(8 << 20, round));
            let len = 1024 * LOG_BLOCK_BYTES;
            let log = Log::new(device.clone(), 0, len, 7, 0, 0);
            let mut expected: Vec<Record> = Vec::new();
            crate::meta::store::block_on(async {
                for _ in 0..400 {
                    match next(10) {
                        0..=5 => {
                            let block = next(64);
                            let record = match next(8) {
                                0 => Record::Dirty {
                                    device: 0,
                                    chunk: block,
                                },
                                1 => Record::Data {
                                    volume: 1,
                                    sector: block,
                                    crc: crate::checksum::crc32c(&[block as u8; 4096]),
                                    seq: block + 1,
                                    data: Arc::from(vec![block as u8; 4096]),
                                },
                                _ => Record::Map {
                                    volume: 1,
                                    block,
                                    new: 1 << 63 | (block + 1000),
                                    old: 0,
                                    crcs: vec![0; 1 + next(32) as usize],
                                },
                            };
                            log.append(record.clone());
                            expected.push(record);
                        }
                        6 => {
                            // The pending allocations a write would see.
                            let mut allocated: Vec<u64> = expected
                                .iter()
                                .filter_map(|r| match r {
                                    Record::Map { block, new, .. } if *new != 0 => Some(*block),
                                    _ => None,
                                })
                                .collect();
                            allocated.sort_unstable();
                            allocated.dedup();
                            assert_eq!(log.pending_allocations(1, 0, 63), allocated);
                            assert!(log.pending_allocations(2, 0, 63).is_empty());
                        }
                        _ => log.stage().await.unwrap(),
                    }
                    {
                        let pending = log.pending.lock_or_abort();
                        assert_eq!(pending.units, blocks_needed(&pending.records));
                        assert_eq!(pending.records, expected);
                    }
                }
                log.stage().await.unwrap();
                let (replayed, next_lsn, _) = Log::replay(&device, 0, len, 7, 0).await.unwrap();
                assert_eq!(next_lsn, 0, "nothing committed");
                assert!(replayed.iter().all(|(_, committed, _)| !committed));
                let replayed: Vec<Record> = replayed.into_iter().map(|(r, _, _)| r).collect();
                assert_eq!(replayed, expected, "round {round}");
            });
        }
    }

    #[test]
    fn blocks_needed_counts_splits() {
        let map = Record::Map {
            volume: 0,
            block: 0,
            new: 0,
            old: 0,
            crcs: vec![],
        };
        let per_block = (LOG_BLOCK_BYTES as usize - HEADER_BYTES) / 30;
        assert_eq!(blocks_needed(&vec![map.clone(); per_block]), 1);
        assert_eq!(blocks_needed(&vec![map; per_block + 1]), 2);
    }
}
