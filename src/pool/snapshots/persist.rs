//! The snapshot registry as the metadata store holds it: a row per
//! snapshot (sealed; the older layouts still decode), the clones, the kept
//! space figures and the counters — loaded when the pool opens, and the
//! rows that changed written by each checkpoint. Apart from the registry
//! itself (`mod.rs`) because it is the one room that knows the tables'
//! layout.

use super::*;
use crate::meta::log::MAX_SNAPSHOT_NAME;
use crate::meta::store::{CLONES, SNAPSHOTS, SNAPSHOT_SPACE};

/// A snapshot row of the newer layout has this bit set in its first word
/// (a volume id, which never has it) and `cache_seq` after `size_bytes`.
const ROW_WITH_CACHE_SEQ: u32 = 0x8000_0000;
/// A sealed row (the newer layout, then a seal, `meta/sealed.rs`) has
/// these three bits set in its first word. Volume ids stay below 2^29, so
/// an unsealed row has neither of the two lower ones, and no single
/// flipped bit turns one form into the other.
const SEALED_ROW: u32 = 0xe000_0000;
const SEALED_ONLY: u32 = SEALED_ROW & !ROW_WITH_CACHE_SEQ;

impl SnapshotInfo {
    /// The row as stored under the snapshot's id: sealed.
    fn encode(&self) -> Vec<u8> {
        debug_assert!(self.volume & SEALED_ROW == 0, "volume id {:#x}", self.volume);
        let mut out = Vec::with_capacity(48 + self.name.len());
        out.extend_from_slice(&(self.volume | SEALED_ROW).to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.created_unix.to_le_bytes());
        out.extend_from_slice(&self.mapped_blocks.to_le_bytes());
        out.extend_from_slice(&self.size_bytes.to_le_bytes());
        out.extend_from_slice(&self.cache_seq.to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        crate::meta::sealed::seal(&self.id.to_le_bytes(), &mut out);
        out
    }

    fn decode(id: u32, stored: &[u8]) -> Result<Self, MetaError> {
        let field = |what: String| MetaError::Corrupt(format!("table snapshots key {id:#x}: {what}"));
        let first = crate::bytes::u32_at(stored, 0).unwrap_or_default();
        let bytes = if first & SEALED_ROW == SEALED_ROW {
            crate::meta::sealed::unseal(&id.to_le_bytes(), stored).map_err(field)?
        } else if first & SEALED_ONLY != 0 {
            return Err(field(format!(
                "field volume: {first:#x} is neither a sealed row's nor an unsealed one's"
            )));
        } else {
            stored
        };
        let corrupt = || MetaError::Corrupt(format!("snapshot record {id:#x} ({} bytes)", stored.len()));
        let first = crate::bytes::u32_at(bytes, 0).ok_or_else(corrupt)?;
        let volume = first & !SEALED_ROW;
        let (cache_seq, name_at) = if first & ROW_WITH_CACHE_SEQ != 0 {
            (crate::bytes::u64_at(bytes, 36).ok_or_else(corrupt)?, 44)
        } else {
            (0, 36)
        };
        let name = bytes.get(name_at..).ok_or_else(corrupt)?;
        if name.len() > MAX_SNAPSHOT_NAME {
            return Err(corrupt());
        }
        if !is_snapshot_id(id) {
            return Err(field("the key is not a snapshot id".into()));
        }
        Ok(SnapshotInfo {
            id,
            volume,
            generation: crate::bytes::u64_at(bytes, 4).ok_or_else(corrupt)?,
            created_unix: crate::bytes::u64_at(bytes, 12).ok_or_else(corrupt)?,
            mapped_blocks: crate::bytes::u64_at(bytes, 20).ok_or_else(corrupt)?,
            size_bytes: crate::bytes::u64_at(bytes, 28).ok_or_else(corrupt)?,
            cache_seq,
            name: std::str::from_utf8(name).map_err(|_| corrupt())?.to_string(),
        })
    }
}

/// The registry as a checkpoint stores it: the rows that changed.
pub(in crate::pool) struct SnapshotState {
    /// Rows to write (`Some`) or delete (`None`), by snapshot id.
    pub rows: Vec<(u32, Option<SnapshotInfo>)>,
    pub generation: u64,
    pub next_id: u32,
    pub origins: Vec<(u32, u32)>,
    /// Kept space figures that changed: (written, used or `u64::MAX`), or
    /// `None` to delete the row.
    pub space: Vec<(u32, Option<(u64, u64)>)>,
}

/// Loads the pool's snapshots from the metadata store.
pub(in crate::pool) fn load(db: &redb::Database) -> Result<Snapshots, MetaError> {
    store::guarded("loading the snapshot tables", || load_now(db))
}

fn load_now(db: &redb::Database) -> Result<Snapshots, MetaError> {
    let mut snapshots = Snapshots::default();
    let txn = db.begin_read()?;
    let table = txn.open_table(SNAPSHOTS)?;
    for row in table.iter()? {
        let (id, value) = row?;
        snapshots.insert(SnapshotInfo::decode(id.value(), value.value())?);
    }
    snapshots.generation = snapshots.generation.max(store::read_state(db, "snapshot_generation")?);
    snapshots.next_id = snapshots.next_id.max(store::read_state(db, "next_snapshot_id")? as u32);
    let clones = txn.open_table(CLONES)?;
    for row in clones.iter()? {
        let (volume, origin) = row?;
        let (volume, origin) = (volume.value(), origin.value());
        if is_snapshot_id(volume) || !is_snapshot_id(origin) {
            return Err(MetaError::Corrupt(format!(
                "table clones key {volume:#x}: a clone is a volume and its origin ({origin:#x}) a snapshot"
            )));
        }
        snapshots.origins.insert(volume, origin);
    }
    {
        let table = txn.open_table(SNAPSHOT_SPACE)?;
        let space = snapshots.space.get_mut().unwrap_or_else(|_| crate::sync::poisoned());
        for row in table.iter()? {
            let (id, figures) = row?;
            let (id, (written, used)) = (id.value(), figures.value());
            if snapshots.by_id.contains_key(&id) {
                space.kept.insert(
                    id,
                    CachedSpace {
                        written: Some(written),
                        used: (used != u64::MAX).then_some(used),
                    },
                );
            }
        }
    }
    snapshots.dirty = false;
    snapshots.changed.clear();
    Ok(snapshots)
}

/// Writes the pool's snapshots into a checkpoint's transaction: the rows
/// that changed since the last one (a pool may hold thousands), the
/// clones (few) and the counters.
pub(in crate::pool) fn save(txn: &redb::WriteTransaction, state: &SnapshotState) -> Result<(), MetaError> {
    let mut table = txn.open_table(SNAPSHOTS)?;
    for (id, row) in &state.rows {
        match row {
            Some(info) => {
                table.insert(*id, info.encode().as_slice())?;
            }
            None => {
                table.remove(*id)?;
            }
        }
    }
    let mut clones = txn.open_table(CLONES)?;
    clones.retain(|_, _| false)?;
    for (volume, origin) in &state.origins {
        clones.insert(*volume, *origin)?;
    }
    let mut space = txn.open_table(SNAPSHOT_SPACE)?;
    for (id, figures) in &state.space {
        match figures {
            Some(figures) => {
                space.insert(*id, *figures)?;
            }
            None => {
                space.remove(*id)?;
            }
        }
    }
    let mut scalars = txn.open_table(STATE)?;
    scalars.insert("snapshot_generation", state.generation)?;
    scalars.insert("next_snapshot_id", state.next_id as u64)?;
    Ok(())
}

impl Pool {
    /// The registry as a checkpoint stores it, if it changed since the last
    /// one (then it is marked clean; `restore` marks it dirty again).
    pub(in crate::pool) fn take_snapshot_state(&self) -> Option<SnapshotState> {
        let mut snapshots = self.snapshots_write();
        let space = {
            let mut figures = snapshots.space.lock_or_abort();
            let mut ids: Vec<u32> = figures.changed.drain().collect();
            ids.sort_unstable();
            let space: Vec<(u32, Option<(u64, u64)>)> = ids
                .iter()
                .map(|id| {
                    let kept = figures.get(*id);
                    let row = kept.written.map(|written| (written, kept.used.unwrap_or(u64::MAX)));
                    (*id, row)
                })
                .collect();
            figures.in_flight = ids;
            space
        };
        if !snapshots.dirty && space.is_empty() {
            return None;
        }
        snapshots.dirty = false;
        let mut ids: Vec<u32> = snapshots.changed.drain().collect();
        ids.sort_unstable();
        let rows = ids.iter().map(|id| (*id, snapshots.by_id.get(id).cloned())).collect();
        snapshots.in_flight = ids;
        Some(SnapshotState {
            rows,
            generation: snapshots.generation,
            next_id: snapshots.next_id,
            origins: snapshots.origins.iter().map(|(v, o)| (*v, *o)).collect(),
            space,
        })
    }

    /// The checkpoint that took the state failed: its rows are written by
    /// the next one.
    pub(in crate::pool) fn restore_snapshot_state(&self) {
        let mut snapshots = self.snapshots_write();
        let in_flight = std::mem::take(&mut snapshots.in_flight);
        snapshots.changed.extend(in_flight);
        snapshots.dirty = true;
        let mut figures = snapshots.space.lock_or_abort();
        let in_flight = std::mem::take(&mut figures.in_flight);
        figures.changed.extend(in_flight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> SnapshotInfo {
        SnapshotInfo {
            id: SNAPSHOT_ID_BASE | 7,
            volume: 3,
            name: "nightly".into(),
            generation: 12,
            created_unix: 1_700_000_000,
            mapped_blocks: 99,
            size_bytes: 4 << 20,
            cache_seq: 41,
        }
    }

    /// Rows are stored sealed; rows of both older layouts still decode.
    #[test]
    fn snapshot_rows_are_stored_sealed_and_older_rows_still_decode() {
        let info = info();
        let stored = info.encode();
        assert_eq!(SnapshotInfo::decode(info.id, &stored).unwrap(), info);
        // The layout with the cache sequence number, unsealed.
        let mut older = stored[..stored.len() - crate::meta::sealed::SEAL_BYTES].to_vec();
        older[..4].copy_from_slice(&(info.volume | ROW_WITH_CACHE_SEQ).to_le_bytes());
        assert_eq!(SnapshotInfo::decode(info.id, &older).unwrap(), info);
        // The first layout: no cache sequence number (read as 0).
        let mut first = older[..36].to_vec();
        first[..4].copy_from_slice(&info.volume.to_le_bytes());
        first.extend_from_slice(info.name.as_bytes());
        let decoded = SnapshotInfo::decode(info.id, &first).unwrap();
        assert_eq!((decoded.cache_seq, decoded.name.as_str()), (0, "nightly"));
    }

    /// One flipped bit anywhere in a stored snapshot row fails its load
    /// with an error naming the table and key (the seal, or the marker
    /// bits that tell a sealed row from an older one).
    #[test]
    fn a_flipped_bit_in_a_stored_snapshot_row_fails_its_load() {
        let info = info();
        let stored = info.encode();
        for bit in 0..stored.len() * 8 {
            let mut flipped = stored.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let error = SnapshotInfo::decode(info.id, &flipped)
                .expect_err("a flipped bit")
                .to_string();
            assert!(
                error.starts_with("corrupt metadata: table snapshots key 0x80000007: "),
                "bit {bit}: {error}"
            );
            assert!(
                error.contains("checksum: stored") || error.contains("field volume"),
                "bit {bit}: {error}"
            );
        }
        // Stored under another id, the row fails too.
        assert!(SnapshotInfo::decode(info.id + 1, &stored).is_err());
    }
}
