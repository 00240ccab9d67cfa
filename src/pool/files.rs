//! File datasets' namespaces in the pool (`fs/`): kept in memory, changed
//! through `Namespace` log records, stored by checkpoints in two tables of
//! the metadata store, loaded at open and brought up to date by replay.

use super::*;
use crate::meta::fsrows::{decode_entry_stored, encode_entry_stored, InodeRow, NsOp, MAX_INODES, ROOT_INO};
use crate::meta::namespace::{Changes, Namespace};
use std::collections::HashMap;

/// Inode rows: (dataset, inode) → the encoded row (`meta/fsrows.rs`).
pub const FS_INODES: TableDefinition<(u32, u64), &[u8]> = TableDefinition::new("fs_inodes");
/// Directory entries: (dataset, directory, cookie) → inode and name.
pub const FS_ENTRIES: TableDefinition<(u32, u64, u64), &[u8]> = TableDefinition::new("fs_entries");

/// One dataset's namespace, shared by its file system and the pool.
pub type SharedNamespace = Arc<Mutex<Namespace>>;

/// What a checkpoint takes from every namespace.
pub(super) type NamespaceChanges = Vec<(u32, Changes)>;

impl Pool {
    /// Dataset `dataset`'s namespace (empty if it has none yet).
    pub fn namespace(&self, dataset: u32) -> SharedNamespace {
        self.namespaces
            .lock_or_abort()
            .entry(dataset)
            .or_insert_with(|| Arc::new(Mutex::new(Namespace::new(dataset))))
            .clone()
    }

    /// Applies `ops` to `namespace` and appends them to the log as one
    /// record. The caller holds the dataset's gate shard (so a checkpoint
    /// sees each change with its record, or neither) and the namespace's
    /// lock (so the log's order is the order they were applied in); it
    /// commits afterwards if the change must be durable before its reply.
    pub fn log_namespace(&self, namespace: &mut Namespace, ops: Vec<NsOp>) {
        debug_assert!(crate::meta::fsrows::ops_len(&ops) <= crate::meta::fsrows::MAX_OPS_BYTES);
        for op in &ops {
            namespace.apply(op);
        }
        self.log.append(Record::Namespace {
            dataset: namespace.dataset,
            ops,
        });
    }

    /// Replay of a namespace record.
    pub(super) fn replay_namespace(&self, dataset: u32, ops: &[NsOp]) {
        if self.destroyed.lock_or_abort().contains(&dataset) {
            return;
        }
        let namespace = self.namespace(dataset);
        let mut namespace = namespace.lock_or_abort();
        for op in ops {
            namespace.apply(op);
        }
    }

    /// A destroyed dataset's (or dataset snapshot's) namespace goes with it
    /// (its rows are deleted by the next checkpoint).
    pub(super) fn forget_namespace(&self, dataset: u32) {
        self.namespaces.lock_or_abort().remove(&dataset);
    }

    /// A snapshot of a file dataset gets a copy of the dataset's namespace
    /// as it is at the snapshot's record (and a clone of such a snapshot a
    /// copy of the snapshot's, at the `Clone` record): called where the
    /// record is appended (under the gate) and where it is replayed, so
    /// both see the namespace at the same place in the log. Nothing for a
    /// volume.
    pub(super) fn copy_namespace(&self, dataset: u32, snapshot: u32) {
        let source = {
            let namespaces = self.namespaces.lock_or_abort();
            if namespaces.contains_key(&snapshot) {
                return;
            }
            match namespaces.get(&dataset) {
                Some(source) => source.clone(),
                None => return,
            }
        };
        let copy = source.lock_or_abort().copy_as(snapshot);
        if let Some(copy) = copy {
            self.namespaces
                .lock_or_abort()
                .entry(snapshot)
                .or_insert_with(|| Arc::new(Mutex::new(copy)));
        }
    }

    /// A rollback of file dataset `dataset` to its snapshot `snapshot`
    /// gives it the snapshot's namespace back: called where the `Rollback`
    /// record is appended (under the gate) and where it is replayed, like
    /// [`Pool::copy_namespace`]. Nothing for a volume.
    pub(super) fn roll_back_namespace(&self, dataset: u32, snapshot: u32) {
        let (Some(live), Some(kept)) = (self.existing_namespace(dataset), self.existing_namespace(snapshot)) else {
            return;
        };
        let kept = kept.lock_or_abort();
        live.lock_or_abort().roll_back_to(&kept);
    }

    /// The namespace of dataset or snapshot `id`, if it has one (never
    /// makes an empty one).
    pub fn existing_namespace(&self, id: u32) -> Option<SharedNamespace> {
        self.namespaces.lock_or_abort().get(&id).cloned()
    }

    /// Every namespace's changes since the last checkpoint (under the gate).
    pub(super) fn take_namespace_changes(&self) -> NamespaceChanges {
        let namespaces: Vec<SharedNamespace> = self.namespaces.lock_or_abort().values().cloned().collect();
        namespaces
            .iter()
            .filter_map(|ns| {
                let mut ns = ns.lock_or_abort();
                let changes = ns.take_changes();
                (!changes.is_empty()).then(|| (ns.dataset, changes))
            })
            .collect()
    }

    /// A checkpoint that failed: the rows are stored next time.
    pub(super) fn restore_namespace_changes(&self, changes: &NamespaceChanges) {
        for (dataset, changes) in changes {
            self.namespace(*dataset).lock_or_abort().restore_changes(changes);
        }
    }
}

/// Writes the namespaces' changed rows and deletes destroyed datasets' rows.
pub(super) fn write_namespaces(
    txn: &redb::WriteTransaction,
    changes: &NamespaceChanges,
    destroyed: &[u32],
) -> Result<(), MetaError> {
    let mut inodes = txn.open_table(FS_INODES)?;
    let mut entries = txn.open_table(FS_ENTRIES)?;
    for (dataset, changes) in changes {
        for (ino, row) in &changes.inodes {
            match row {
                Some(row) => {
                    let key = (*dataset, *ino);
                    inodes.insert(key, row.encode_stored(key).as_slice())?;
                }
                None => {
                    inodes.remove((*dataset, *ino))?;
                }
            }
        }
        for ((dir, cookie), entry) in &changes.entries {
            match entry {
                Some((ino, name)) => {
                    let key = (*dataset, *dir, *cookie);
                    entries.insert(key, encode_entry_stored(key, *ino, name).as_slice())?;
                }
                None => {
                    entries.remove((*dataset, *dir, *cookie))?;
                }
            }
        }
    }
    for dataset in destroyed {
        let keys: Vec<(u32, u64)> = inodes
            .range((*dataset, 0)..=(*dataset, u64::MAX))?
            .filter_map(|row| row.ok().map(|(k, _)| k.value()))
            .collect();
        for key in keys {
            inodes.remove(key)?;
        }
        let keys: Vec<(u32, u64, u64)> = entries
            .range((*dataset, 0, 0)..=(*dataset, u64::MAX, u64::MAX))?
            .filter_map(|row| row.ok().map(|(k, _)| k.value()))
            .collect();
        for key in keys {
            entries.remove(key)?;
        }
    }
    Ok(())
}

/// Every stored namespace (at open, before replay).
pub(super) fn load_namespaces(db: &redb::Database) -> Result<HashMap<u32, SharedNamespace>, MetaError> {
    crate::meta::store::guarded("loading the namespace tables", || load_namespaces_now(db))
}

fn load_namespaces_now(db: &redb::Database) -> Result<HashMap<u32, SharedNamespace>, MetaError> {
    let mut namespaces: HashMap<u32, Namespace> = HashMap::new();
    let txn = db.begin_read()?;
    match txn.open_table(FS_INODES) {
        Ok(table) => {
            for row in table.iter()? {
                let (key, value) = row?;
                let (dataset, ino) = key.value();
                let corrupt =
                    |what: String| MetaError::Corrupt(format!("table fs_inodes key ({dataset}, {ino}): {what}"));
                // Row 0 holds the dataset's next generation; files are 1..MAX_INODES.
                if ino >= MAX_INODES {
                    return Err(corrupt(format!("inode {ino} is past the inode limit ({MAX_INODES})")));
                }
                let inode = InodeRow::decode_stored((dataset, ino), value.value()).map_err(corrupt)?;
                namespaces
                    .entry(dataset)
                    .or_insert_with(|| Namespace::new(dataset))
                    .load_inode(ino, inode);
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(HashMap::new()),
        Err(e) => return Err(e.into()),
    }
    if let Ok(table) = txn.open_table(FS_ENTRIES) {
        for row in table.iter()? {
            let (key, value) = row?;
            let (dataset, dir, cookie) = key.value();
            let corrupt =
                |what: String| MetaError::Corrupt(format!("table fs_entries key ({dataset}, {dir}, {cookie}): {what}"));
            let (ino, name) = decode_entry_stored((dataset, dir, cookie), value.value()).map_err(corrupt)?;
            if !(ROOT_INO..MAX_INODES).contains(&dir) {
                return Err(corrupt(format!(
                    "directory {dir} is outside the inode range 1..{MAX_INODES}"
                )));
            }
            if !(ROOT_INO..MAX_INODES).contains(&ino) {
                return Err(corrupt(format!(
                    "field inode: {ino} is outside the inode range 1..{MAX_INODES}"
                )));
            }
            namespaces
                .entry(dataset)
                .or_insert_with(|| Namespace::new(dataset))
                .load_entry(dir, cookie, ino, name);
        }
    }
    Ok(namespaces
        .into_iter()
        .map(|(dataset, mut ns)| {
            let damaged = ns.finish_loading();
            if damaged > 0 {
                tracing::error!(
                    "dataset {dataset}: {damaged} damaged namespace rows (entries naming missing files or \
                     directories) set aside"
                );
            }
            (dataset, Arc::new(Mutex::new(ns)))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::fsrows::{FileType, Time};

    fn row(kind: FileType) -> InodeRow {
        InodeRow {
            generation: 5,
            kind,
            mode: 0o755,
            uid: 1000,
            gid: 100,
            nlink: 2,
            size: 4096,
            atime: Time { seconds: 1, nanos: 2 },
            mtime: Time { seconds: 3, nanos: 4 },
            ctime: Time { seconds: 5, nanos: 6 },
            rdev: (0, 0),
            parent: ROOT_INO,
            next_cookie: 4,
            verifier: 0,
            target: Vec::new(),
        }
    }

    /// A store holding dataset 2's root, one file and its entry, as
    /// `write_namespaces` stores them (sealed), or as older pools did.
    fn store(sealed: bool) -> redb::Database {
        let db = redb::Builder::new()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut inodes = txn.open_table(FS_INODES).unwrap();
            let mut entries = txn.open_table(FS_ENTRIES).unwrap();
            for (ino, row) in [(ROOT_INO, row(FileType::Directory)), (7, row(FileType::Regular))] {
                let key = (2, ino);
                let bytes = if sealed {
                    row.encode_stored(key)
                } else {
                    let mut bytes = Vec::new();
                    row.encode(&mut bytes);
                    bytes
                };
                inodes.insert(key, bytes.as_slice()).unwrap();
            }
            let key = (2, ROOT_INO, 3);
            let bytes = if sealed {
                encode_entry_stored(key, 7, b"file")
            } else {
                crate::meta::fsrows::encode_entry(7, b"file")
            };
            entries.insert(key, bytes.as_slice()).unwrap();
        }
        txn.commit().unwrap();
        db
    }

    /// Flips `bit` of the value stored under `key` in `table`.
    fn flip<K: redb::Key + 'static>(
        db: &redb::Database,
        table: TableDefinition<K, &[u8]>,
        key: K::SelfType<'_>,
        bit: usize,
    ) where
        for<'a> K::SelfType<'a>: Clone,
    {
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(table).unwrap();
            let mut bytes = table.get(key.clone()).unwrap().unwrap().value().to_vec();
            bytes[bit / 8] ^= 1 << (bit % 8);
            table.insert(key, bytes.as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }

    fn loaded(db: &redb::Database) -> Result<(), String> {
        let namespaces = load_namespaces(db).map_err(|e| e.to_string())?;
        let namespace = namespaces[&2].lock_or_abort();
        assert_eq!(namespace.inodes[&7].size, 4096);
        let root = &namespace.dirs[&ROOT_INO];
        assert_eq!(root.entries.get(&3).map(|(_, ino)| *ino), Some(7));
        Ok(())
    }

    #[test]
    fn namespace_rows_are_stored_sealed_and_unsealed_ones_still_load() {
        loaded(&store(true)).unwrap();
        loaded(&store(false)).unwrap();
    }

    /// One flipped bit anywhere in a stored inode row fails the load with
    /// an error naming the table, the key and the checksum (or the marker
    /// bits: then the kind is not one).
    #[test]
    fn a_flipped_bit_in_a_stored_inode_row_fails_its_load() {
        let length = row(FileType::Regular).encode_stored((2, 7)).len();
        for bit in 0..length * 8 {
            let db = store(true);
            flip(&db, FS_INODES, (2, 7), bit);
            let error = loaded(&db).expect_err("a flipped bit");
            assert!(
                error.starts_with("corrupt metadata: table fs_inodes key (2, 7): "),
                "bit {bit}: {error}"
            );
            assert!(
                error.contains("checksum: stored") || error.contains("unknown kind"),
                "bit {bit}: {error}"
            );
        }
    }

    /// One flipped bit anywhere in a stored directory entry fails the
    /// load naming the table, the key and the checksum (or, a marker bit
    /// flipped, the inode).
    #[test]
    fn a_flipped_bit_in_a_stored_entry_row_fails_its_load() {
        let length = encode_entry_stored((2, ROOT_INO, 3), 7, b"file").len();
        for bit in 0..length * 8 {
            let db = store(true);
            flip(&db, FS_ENTRIES, (2, ROOT_INO, 3), bit);
            let error = loaded(&db).expect_err("a flipped bit");
            assert!(
                error.starts_with("corrupt metadata: table fs_entries key (2, 1, 3): "),
                "bit {bit}: {error}"
            );
            assert!(
                error.contains("checksum: stored") || error.contains("field inode"),
                "bit {bit}: {error}"
            );
        }
    }
}
