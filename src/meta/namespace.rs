//! A dataset's namespace in memory: inodes and directories, changed only by
//! applying [`NsOp`]s (the same code path for a live change and for replay
//! of the log), with the rows changed since the last checkpoint.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::fsrows::{FileType, InodeRow, NsOp, MAX_INODES, ROOT_INO};

/// A directory's entries: by name for LOOKUP, by cookie for READDIR.
#[derive(Debug, Default, Clone)]
pub struct Dir {
    pub names: HashMap<Box<[u8]>, u64>,
    pub entries: BTreeMap<u64, (Box<[u8]>, u64)>,
}

/// A directory entry row: (directory, cookie) → (inode, name), `None`
/// when deleted.
pub type EntryChange = ((u64, u64), Option<(u64, Box<[u8]>)>);

/// What a checkpoint stores of a namespace: every inode row and entry
/// changed since the last one (`None`: deleted).
#[derive(Debug, Default)]
pub struct Changes {
    pub inodes: Vec<(u64, Option<InodeRow>)>,
    pub entries: Vec<EntryChange>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.inodes.is_empty() && self.entries.is_empty()
    }
}

/// A set of inode numbers kept as disjoint ranges `start..end`.
#[derive(Debug, Clone, Default)]
struct FreeInos(BTreeMap<u64, u64>);

impl FreeInos {
    /// The range holding `ino`, if any.
    fn containing(&self, ino: u64) -> Option<(u64, u64)> {
        self.0
            .range(..=ino)
            .next_back()
            .filter(|(_, end)| **end > ino)
            .map(|(start, end)| (*start, *end))
    }

    fn insert(&mut self, ino: u64) {
        if self.containing(ino).is_none() {
            self.0.insert(ino, ino + 1);
        }
    }

    /// Adds `start..end`, which holds no number of the set (numbers at or
    /// above every one in it).
    fn insert_range(&mut self, start: u64, end: u64) {
        if start < end {
            self.0.insert(start, end);
        }
    }

    fn remove(&mut self, ino: u64) {
        let Some((start, end)) = self.containing(ino) else {
            return;
        };
        self.0.remove(&start);
        self.insert_range(start, ino);
        self.insert_range(ino + 1, end);
    }

    fn pop_first(&mut self) -> Option<u64> {
        let (start, end) = self.0.pop_first()?;
        self.insert_range(start + 1, end);
        Some(start)
    }
}

#[derive(Debug)]
pub struct Namespace {
    pub dataset: u32,
    pub inodes: HashMap<u64, InodeRow>,
    pub dirs: HashMap<u64, Dir>,
    /// Inode numbers below `next_ino` that are free (removed and reaped,
    /// or skipped), as ranges: a number far above the others costs one
    /// range, not one entry per number skipped.
    free: FreeInos,
    next_ino: u64,
    pub next_generation: u64,
    dirty_inodes: HashSet<u64>,
    dirty_entries: HashSet<(u64, u64)>,
    /// Whether the dataset row (0: the next generation) changed.
    dirty_state: bool,
}

impl Namespace {
    /// An empty namespace (rows are loaded or replayed into it).
    pub fn new(dataset: u32) -> Namespace {
        Namespace {
            dataset,
            inodes: HashMap::new(),
            dirs: HashMap::new(),
            free: FreeInos::default(),
            next_ino: ROOT_INO + 1,
            next_generation: 1,
            dirty_inodes: HashSet::new(),
            dirty_entries: HashSet::new(),
            dirty_state: false,
        }
    }

    /// A path of inode `ino` from the dataset's root (`/a/b`), for
    /// messages: the first name found for it (a file with several links
    /// has several). `None` when no directory names it (removed).
    pub fn path_of(&self, ino: u64) -> Option<String> {
        let name_in = |dir: u64, ino: u64| {
            self.dirs
                .get(&dir)?
                .entries
                .values()
                .find(|(_, i)| *i == ino)
                .map(|(name, _)| String::from_utf8_lossy(name).into_owned())
        };
        let mut names = Vec::new();
        let mut at = ino;
        // A directory's row names its parent; a file's parent is found by
        // its entry. A loop in damaged rows ends at the inode count.
        while at != ROOT_INO && names.len() <= self.inodes.len() {
            let row = self.inodes.get(&at)?;
            let parent = if row.kind == FileType::Directory {
                row.parent
            } else {
                *self
                    .dirs
                    .iter()
                    .find(|(_, dir)| dir.entries.values().any(|(_, i)| *i == at))?
                    .0
            };
            names.push(name_in(parent, at)?);
            at = parent;
        }
        names.reverse();
        Some(format!("/{}", names.join("/")))
    }

    /// A stored inode row (loading): row 0 holds the next generation.
    pub fn load_inode(&mut self, ino: u64, row: InodeRow) {
        if ino == 0 {
            self.next_generation = self.next_generation.max(row.generation);
            return;
        }
        self.insert_inode(ino, row);
    }

    /// A stored directory entry (loading).
    pub fn load_entry(&mut self, dir: u64, cookie: u64, ino: u64, name: &[u8]) {
        let entries = self.dirs.entry(dir).or_default();
        entries.names.insert(name.into(), cookie);
        entries.entries.insert(cookie, (name.into(), ino));
    }

    /// After loading: the free inode numbers are the gaps.
    /// Returns how many stored rows broke the namespace's invariants and
    /// were set aside (an entry of a missing directory or naming a missing
    /// or removed inode; a directory whose parent is gone hangs from the
    /// root): the file service indexes by them and must never find one
    /// missing.
    pub fn finish_loading(&mut self) -> usize {
        let mut damaged = 0;
        let live = |ns: &HashMap<u64, InodeRow>, ino: &u64| ns.get(ino).is_some_and(|row| row.nlink > 0);
        self.dirs.retain(|dir, entries| {
            let keep = live(&self.inodes, dir);
            damaged += if keep { 0 } else { entries.entries.len() };
            keep
        });
        for entries in self.dirs.values_mut() {
            let before = entries.entries.len();
            entries.entries.retain(|_, (_, ino)| live(&self.inodes, ino));
            entries.names.retain(|_, cookie| entries.entries.contains_key(cookie));
            damaged += before - entries.entries.len();
        }
        let orphans: Vec<u64> = self
            .inodes
            .iter()
            .filter(|(_, row)| row.kind == FileType::Directory && row.nlink > 0 && !live(&self.inodes, &row.parent))
            .map(|(ino, _)| *ino)
            .collect();
        damaged += orphans.len();
        for ino in orphans {
            if let Some(row) = self.inodes.get_mut(&ino) {
                row.parent = ROOT_INO;
            }
        }
        self.next_ino = self.inodes.keys().copied().max().unwrap_or(ROOT_INO).max(ROOT_INO) + 1;
        let mut used: Vec<u64> = self.inodes.keys().copied().filter(|ino| *ino > ROOT_INO).collect();
        used.sort_unstable();
        self.free = FreeInos::default();
        let mut next = ROOT_INO + 1;
        for ino in used {
            self.free.insert_range(next, ino);
            next = ino + 1;
        }
        damaged
    }

    fn insert_inode(&mut self, ino: u64, row: InodeRow) {
        // Decoders refuse numbers past the limit (stored rows, log
        // records); one here would make the free list below that long.
        if ino >= MAX_INODES {
            tracing::error!("dataset {}: inode {ino} past the inode limit ignored", self.dataset);
            return;
        }
        self.next_generation = self.next_generation.max(row.generation + 1);
        if ino >= self.next_ino {
            self.free.insert_range(self.next_ino, ino);
            self.next_ino = ino + 1;
        }
        self.free.remove(ino);
        if row.kind == FileType::Directory && row.nlink > 0 {
            self.dirs.entry(ino).or_default();
        }
        self.inodes.insert(ino, row);
    }

    /// Whether the dataset has its root directory (a new one does not).
    pub fn has_root(&self) -> bool {
        self.inodes.contains_key(&ROOT_INO)
    }

    /// An inode number for a new file, and its generation (taken: the
    /// next `Inode` operation for it must follow).
    pub fn allocate(&mut self) -> Option<(u64, u64)> {
        let ino = match self.free.pop_first() {
            Some(ino) => ino,
            None if self.next_ino < MAX_INODES => {
                self.next_ino += 1;
                self.next_ino - 1
            }
            None => return None,
        };
        let generation = self.next_generation;
        self.next_generation += 1;
        self.dirty_state = true;
        Some((ino, generation))
    }

    /// Gives back a number [`Namespace::allocate`] handed out that no
    /// operation used (the change failed before it was logged).
    pub fn unallocate(&mut self, ino: u64) {
        if !self.inodes.contains_key(&ino) {
            self.free.insert(ino);
        }
    }

    /// Live inodes (the root included).
    pub fn files(&self) -> u64 {
        self.inodes.values().filter(|row| row.nlink > 0).count() as u64
    }

    /// Applies one change (live or replayed; replaying one already in the
    /// stored rows changes nothing).
    pub fn apply(&mut self, op: &NsOp) {
        match op {
            NsOp::Inode { ino, row } => {
                self.insert_inode(*ino, row.clone());
                self.dirty_inodes.insert(*ino);
                self.dirty_state = true;
            }
            NsOp::Free { ino } => {
                if let Some(row) = self.inodes.get_mut(ino) {
                    row.nlink = 0;
                }
                self.dirs.remove(ino);
                self.dirty_inodes.insert(*ino);
            }
            NsOp::Reaped { ino } => {
                if self.inodes.get(ino).is_some_and(|row| row.nlink == 0) {
                    self.inodes.remove(ino);
                    if *ino < self.next_ino {
                        self.free.insert(*ino);
                    }
                    self.dirty_inodes.insert(*ino);
                }
            }
            NsOp::Link { dir, cookie, ino, name } => {
                let entries = self.dirs.entry(*dir).or_default();
                if let Some((old, _)) = entries.entries.insert(*cookie, (name.as_slice().into(), *ino)) {
                    entries.names.remove(&old);
                }
                entries.names.insert(name.as_slice().into(), *cookie);
                self.dirty_entries.insert((*dir, *cookie));
            }
            NsOp::Unlink { dir, cookie } => {
                if let Some(entries) = self.dirs.get_mut(dir) {
                    if let Some((name, _)) = entries.entries.remove(cookie) {
                        entries.names.remove(&name);
                    }
                }
                self.dirty_entries.insert((*dir, *cookie));
            }
        }
    }

    /// Marks an inode changed in memory only (a write's times and size):
    /// the next checkpoint stores it.
    pub fn touch(&mut self, ino: u64) {
        self.dirty_inodes.insert(ino);
    }

    /// The rows changed since the last call, with their current values.
    pub fn take_changes(&mut self) -> Changes {
        let mut changes = Changes::default();
        for ino in self.dirty_inodes.drain() {
            changes.inodes.push((ino, self.inodes.get(&ino).cloned()));
        }
        if std::mem::take(&mut self.dirty_state) {
            changes
                .inodes
                .push((0, Some(InodeRow::dataset_row(self.next_generation))));
        }
        for (dir, cookie) in self.dirty_entries.drain() {
            let entry = self
                .dirs
                .get(&dir)
                .and_then(|d| d.entries.get(&cookie))
                .map(|(name, ino)| (*ino, name.clone()));
            changes.entries.push(((dir, cookie), entry));
        }
        changes
    }

    /// A checkpoint that failed: its rows are stored again next time.
    pub fn restore_changes(&mut self, changes: &Changes) {
        for (ino, _) in &changes.inodes {
            if *ino == 0 {
                self.dirty_state = true;
            } else {
                self.dirty_inodes.insert(*ino);
            }
        }
        self.dirty_entries.extend(changes.entries.iter().map(|(key, _)| *key));
    }

    /// A copy of this namespace for snapshot `snapshot` of the dataset,
    /// every row marked changed (the next checkpoint stores them under the
    /// snapshot's id); `None` when there is nothing to copy (no root: not a
    /// file dataset).
    pub fn copy_as(&self, snapshot: u32) -> Option<Namespace> {
        if !self.has_root() {
            return None;
        }
        let dirty_entries = self
            .dirs
            .iter()
            .flat_map(|(dir, entries)| entries.entries.keys().map(move |cookie| (*dir, *cookie)))
            .collect();
        Some(Namespace {
            dataset: snapshot,
            inodes: self.inodes.clone(),
            dirs: self.dirs.clone(),
            free: self.free.clone(),
            next_ino: self.next_ino,
            next_generation: self.next_generation,
            dirty_inodes: self.inodes.keys().copied().collect(),
            dirty_entries,
            dirty_state: true,
        })
    }

    /// Becomes `kept`'s tree again (a rollback to the snapshot that holds
    /// it), under its own dataset id. The next generation stays the larger
    /// of the two: a handle of a file made after the snapshot must never
    /// name a file made after the rollback. Every row either tree has is
    /// marked changed, so the next checkpoint replaces the stored rows.
    pub fn roll_back_to(&mut self, kept: &Namespace) {
        let old_entries: Vec<(u64, u64)> = self
            .dirs
            .iter()
            .flat_map(|(dir, entries)| entries.entries.keys().map(move |cookie| (*dir, *cookie)))
            .collect();
        self.dirty_entries.extend(old_entries);
        self.dirty_entries.extend(
            kept.dirs
                .iter()
                .flat_map(|(dir, entries)| entries.entries.keys().map(move |cookie| (*dir, *cookie))),
        );
        self.dirty_inodes.extend(self.inodes.keys().copied());
        self.dirty_inodes.extend(kept.inodes.keys().copied());
        self.dirty_state = true;
        self.inodes = kept.inodes.clone();
        self.dirs = kept.dirs.clone();
        self.free = kept.free.clone();
        self.next_ino = kept.next_ino;
        self.next_generation = self.next_generation.max(kept.next_generation);
    }

    /// Removed inodes whose data is not freed yet (after a restart).
    pub fn reaping(&self) -> Vec<u64> {
        let mut inos: Vec<u64> = self
            .inodes
            .iter()
            .filter(|(_, row)| row.nlink == 0)
            .map(|(ino, _)| *ino)
            .collect();
        inos.sort_unstable();
        inos
    }
}

impl InodeRow {
    /// Row 0: not a file, only the dataset's next generation.
    pub fn dataset_row(next_generation: u64) -> InodeRow {
        InodeRow {
            generation: next_generation,
            kind: FileType::Directory,
            mode: 0,
            uid: 0,
            gid: 0,
            nlink: 0,
            size: 0,
            atime: Default::default(),
            mtime: Default::default(),
            ctime: Default::default(),
            rdev: (0, 0),
            parent: 0,
            next_cookie: 0,
            verifier: 0,
            target: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(generation: u64) -> InodeRow {
        InodeRow {
            kind: FileType::Regular,
            mode: 0o644,
            nlink: 1,
            ..InodeRow::dataset_row(generation)
        }
    }

    #[test]
    fn applied_changes_are_taken_once_and_numbers_are_reused_after_reaping() {
        let mut ns = Namespace::new(3);
        let root = InodeRow {
            kind: FileType::Directory,
            nlink: 2,
            parent: ROOT_INO,
            next_cookie: 3,
            ..InodeRow::dataset_row(1)
        };
        ns.apply(&NsOp::Inode {
            ino: ROOT_INO,
            row: root,
        });
        let (ino, generation) = ns.allocate().unwrap();
        assert_eq!((ino, generation), (2, 2));
        ns.apply(&NsOp::Inode {
            ino,
            row: file(generation),
        });
        ns.apply(&NsOp::Link {
            dir: ROOT_INO,
            cookie: 3,
            ino,
            name: b"a".to_vec(),
        });
        assert_eq!(ns.dirs[&ROOT_INO].names[&b"a"[..]], 3);
        let changes = ns.take_changes();
        assert_eq!(changes.inodes.len(), 3, "root, file, dataset row");
        assert_eq!(changes.entries.len(), 1);
        assert!(ns.take_changes().is_empty());

        ns.apply(&NsOp::Unlink {
            dir: ROOT_INO,
            cookie: 3,
        });
        ns.apply(&NsOp::Free { ino });
        assert_eq!(ns.reaping(), vec![ino]);
        // Not reusable before its data is freed.
        assert_eq!(ns.allocate().unwrap().0, 3);
        ns.apply(&NsOp::Reaped { ino });
        let (again, generation2) = ns.allocate().unwrap();
        assert_eq!(again, ino);
        assert!(generation2 > generation);
        let changes = ns.take_changes();
        assert!(changes.inodes.contains(&(ino, None)));
        assert!(changes.entries.contains(&((ROOT_INO, 3), None)));

        // Loading the rows back gives the same free numbers.
        let mut loaded = Namespace::new(3);
        for (ino, row) in &ns.inodes {
            loaded.load_inode(*ino, row.clone());
        }
        loaded.load_inode(0, InodeRow::dataset_row(ns.next_generation));
        // Damaged rows: an entry naming a missing inode, one in a missing
        // directory. Set aside, never left for a later lookup to trip on.
        loaded.load_entry(ROOT_INO, 9, 77, b"ghost");
        loaded.load_entry(55, 3, ROOT_INO, b"lost");
        assert_eq!(loaded.finish_loading(), 2);
        assert!(loaded.dirs[&ROOT_INO].names.is_empty());
        assert!(!loaded.dirs.contains_key(&55));
        assert_eq!(loaded.next_generation, ns.next_generation);
        assert_eq!(loaded.allocate().unwrap().0, 2);
    }

    /// A stored or replayed inode far above the others (a damaged number
    /// inside the limit) costs a range of free numbers, not one entry per
    /// number: open stays quick and small, and the numbers below it are
    /// handed out in order.
    #[test]
    fn an_inode_far_above_the_others_costs_one_free_range() {
        let started = std::time::Instant::now();
        let mut replayed = Namespace::new(3);
        replayed.apply(&NsOp::Inode {
            ino: MAX_INODES - 1,
            row: file(1),
        });
        let mut loaded = Namespace::new(3);
        loaded.load_inode(MAX_INODES - 1, file(1));
        loaded.load_inode(4, file(2));
        loaded.finish_loading();
        assert!(
            started.elapsed() < std::time::Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(replayed.allocate().unwrap().0, 2);
        assert_eq!(loaded.allocate().unwrap().0, 2);
        assert_eq!(loaded.allocate().unwrap().0, 3);
        assert_eq!(loaded.allocate().unwrap().0, 5, "4 is in use");
        // Past the limit: ignored, never a free list that long.
        let mut ns = Namespace::new(3);
        ns.apply(&NsOp::Inode {
            ino: u64::MAX - 1,
            row: file(1),
        });
        assert_eq!(ns.allocate().unwrap().0, 2);
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
}
