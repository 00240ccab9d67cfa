//! Replay of the log records whose work is not the live code's own: a
//! `Snapshot` record (the registry entries), a `CopyPage` and a `ClonePage`
//! (the copy, unless the checkpoint already holds it). Deletion, rollback,
//! clones and promotion replay through their rooms' `apply_*`.

use super::*;
use crate::meta::log::SnapshotEntry;

impl Pool {
    /// Replays a `Snapshot` record.
    pub(in crate::pool) fn apply_snapshot_record(
        &self,
        generation: u64,
        created_unix: u64,
        cache_seq: u64,
        entries: Vec<SnapshotEntry>,
    ) {
        let mut snapshots = self.snapshots_write();
        for entry in entries {
            if snapshots.by_id.contains_key(&entry.snapshot) {
                continue;
            }
            self.copy_namespace(entry.volume, entry.snapshot);
            snapshots.insert(SnapshotInfo {
                id: entry.snapshot,
                volume: entry.volume,
                name: entry.name,
                generation,
                created_unix,
                mapped_blocks: entry.mapped_blocks,
                size_bytes: entry.size_bytes,
                cache_seq,
            });
        }
        self.has_snapshots.store(!snapshots.is_empty(), Ordering::Release);
    }

    /// Replays a `CopyPage` record.
    pub(in crate::pool) fn apply_copy_page(
        &self,
        volume: u32,
        index: u64,
        snapshot: u32,
        generation: u64,
    ) -> Result<(), MetaError> {
        let page = self.map_pages.get(&self.db, (volume, index))?;
        if page.birth.load(Ordering::Acquire) >= generation {
            // The checkpoint already holds the copy.
            return Ok(());
        }
        self.copy_page_into(&page, index, snapshot, generation);
        Ok(())
    }

    /// Replays a `ClonePage` record.
    pub(in crate::pool) fn apply_clone_page(&self, volume: u32, index: u64) -> Result<(), MetaError> {
        let page = self.map_pages.get(&self.db, (volume, index))?;
        if page.present.load(Ordering::Acquire) {
            // The checkpoint already holds it.
            return Ok(());
        }
        let Some(origin) = self.snapshots_read().origin(volume) else {
            return Err(MetaError::Corrupt(format!(
                "log: a page of clone {volume}, which has no origin"
            )));
        };
        let entries = self.view_entries(origin, index)?;
        self.clone_page_into(&page, &entries);
        Ok(())
    }
}
