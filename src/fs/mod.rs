//! The file service: datasets of files and directories in a pool, beside
//! its volumes (docs/NFS.md, "Datasets in the pool"). A dataset's namespace
//! (inodes, directory entries) lives in memory, is changed by log records
//! and checkpointed to the metadata store (`pool/files.rs`); its files'
//! data lives in one engine object of the pool (the dataset's id), each
//! file in a 1 TiB range of it at `inode << 40`: thin, checksummed, cached
//! and tiered like a volume's blocks.

pub mod export;
pub mod types;

pub use export::{ClientNet, Export, ExportOptions, Exports, Squash};
pub use types::*;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::block::{BlockDevice, BlockError};
use crate::device::IoBuf;
use crate::meta::fsrows::{InodeRow, NsOp};
use crate::meta::namespace::Namespace;
use crate::pool::files::SharedNamespace;
use crate::pool::snapshots::{SnapshotInfo, SnapshotRequest};
use crate::pool::volume::EngineVolume;
use crate::pool::{Pool, PoolError};
use crate::sync::LockOrAbort;

type FsResult<T> = Result<T, FsError>;

/// The dataset's engine object: every file's 1 TiB range.
const ENGINE_BYTES: u64 = MAX_INODES << FILE_BITS;
/// Alignment of the engine's requests.
const ALIGN: u64 = crate::block::SECTOR_BYTES as u64;
/// Data locks: inodes share one of these by number.
const DATA_LOCKS: usize = 64;
/// Most hard links to one file.
const MAX_LINKS: u32 = 65_535;
/// Directory entries READDIR builds per hold of the namespace lock.
const READDIR_BATCH: usize = 128;
/// The name of the directory of a dataset's snapshots in its root: hidden
/// (not listed, found by LOOKUP), like ZFS's `snapdir=hidden`.
pub const SNAPSHOT_DIR: &[u8] = b".snapshot";
/// Its inode number: one no file ever has (numbers are below
/// `MAX_INODES`).
pub const SNAPSHOT_DIR_INO: u64 = MAX_INODES;

/// The first wait before a failed freeing of a removed file's data is
/// tried again, and the longest (the wait doubles after each failure).
const REAP_RETRY_FIRST: Duration = Duration::from_millis(100);
const REAP_RETRY_MOST: Duration = Duration::from_secs(30);

/// Removed files whose data is still to be freed after the freeing failed
/// (`GET /metrics`: `strata_fs_deferred_frees_*`). The removal itself was
/// committed and answered as done; the freeing is tried again in the
/// background, and at the dataset's next open in any case (the inode
/// stays in the namespace with no links until it is freed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeferredFrees {
    /// Freeings that failed after their removal committed.
    pub deferred: u64,
    /// Of those, freed later by a background retry.
    pub freed: u64,
    /// Background retries that failed again.
    pub retries_failed: u64,
    /// Removed files waiting for a retry now.
    pub pending: u64,
}

static DEFERRED: AtomicU64 = AtomicU64::new(0);
static DEFERRED_FREED: AtomicU64 = AtomicU64::new(0);
static DEFERRED_RETRIES_FAILED: AtomicU64 = AtomicU64::new(0);
static DEFERRED_PENDING: AtomicU64 = AtomicU64::new(0);

/// The process's counters of deferred freeings (every dataset's).
pub fn deferred_frees() -> DeferredFrees {
    DeferredFrees {
        deferred: DEFERRED.load(Ordering::Relaxed),
        freed: DEFERRED_FREED.load(Ordering::Relaxed),
        retries_failed: DEFERRED_RETRIES_FAILED.load(Ordering::Relaxed),
        pending: DEFERRED_PENDING.load(Ordering::Relaxed),
    }
}

/// A dataset's removed files whose freeing waits for a retry.
#[derive(Default)]
struct Deferred {
    inodes: BTreeSet<u64>,
    /// A retry task runs (it ends when `inodes` is empty).
    retrying: bool,
}

/// A dataset's view of one of its snapshots, open or being destroyed.
enum SnapshotView {
    Open(Arc<FileSystem>),
    Destroying,
}

/// One dataset, or one snapshot of a dataset (read-only), as the NFS
/// frontend uses it.
pub struct FileSystem {
    /// The dataset's id, or the snapshot's (in handles).
    dataset: u32,
    /// The pool's tag (in handles and the fsid).
    pool_tag: u64,
    /// A snapshot's dataset (`None`: a live dataset).
    snapshot_of: Option<u32>,
    /// What GETATTR reports: a snapshot's files are in their dataset's
    /// file system (no mount point to cross), their file ids above the
    /// dataset's (the snapshot id in the high 32 bits).
    fsid: u64,
    fileid_base: u64,
    recordsize: u32,
    pool: Arc<Pool>,
    engine: Arc<EngineVolume>,
    namespace: SharedNamespace,
    verifier: [u8; 8],
    /// Bytes the dataset may hold (0: no quota).
    quota: AtomicU64,
    /// Held shared by reads and aligned writes of a file, exclusively by
    /// unaligned writes (their read-modify-write of a sector), truncation
    /// and the freeing of a removed file's data.
    data_locks: Box<[tokio::sync::RwLock<()>]>,
    /// Inodes whose size or times changed since their last log record (a
    /// COMMIT logs them).
    unlogged: Mutex<HashSet<u64>>,
    /// Held shared by every call that reads or changes files' data or the
    /// namespace's durable state, exclusively while a snapshot is taken (so
    /// it sees no call half done) and when the dataset or snapshot goes
    /// away (`true`: gone, calls get NFS3ERR_STALE).
    quiesce: tokio::sync::RwLock<bool>,
    /// This dataset's snapshots that clients opened (under `.snapshot`).
    snapshots: Mutex<HashMap<u32, SnapshotView>>,
    /// Removed files whose data freeing failed, retried in the background.
    deferred: Mutex<Deferred>,
    /// This file system, for the background retry of `deferred`.
    this: Weak<FileSystem>,
}

impl Drop for FileSystem {
    fn drop(&mut self) {
        // Still in the namespace with no links: freed at the next open.
        let left = self.deferred.get_mut().map_or(0, |d| d.inodes.len() as u64);
        DEFERRED_PENDING.fetch_sub(left, Ordering::Relaxed);
    }
}

fn io(error: impl std::fmt::Display) -> FsError {
    FsError::Io(error.to_string())
}

fn block_error(error: BlockError) -> FsError {
    match error {
        BlockError::NoSpace => FsError::NoSpace,
        BlockError::ReadOnly => FsError::ReadOnly,
        other => io(other),
    }
}

fn pool_error(error: PoolError) -> FsError {
    match error {
        PoolError::Io(e) if e.is_no_space() => FsError::NoSpace,
        other => io(other),
    }
}

fn check_name(name: &[u8]) -> FsResult<()> {
    if name.len() > MAX_NAME {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        return Err(FsError::Inval);
    }
    Ok(())
}

/// Whether `cred` has all of `want` (4 read, 2 write, 1 execute) on `row`.
fn permits(row: &InodeRow, cred: &Cred, want: u32) -> bool {
    if cred.uid == 0 {
        // Root reads and writes anything; executes what anyone may.
        return want & 1 == 0 || row.kind == FileType::Directory || row.mode & 0o111 != 0;
    }
    let bits = if cred.uid == row.uid {
        row.mode >> 6
    } else if cred.in_group(row.gid) {
        row.mode >> 3
    } else {
        row.mode
    } & 7;
    bits & want == want
}

/// In a sticky directory only the file's or the directory's owner (or
/// root) may remove or rename an entry.
fn sticky_allows(dir: &InodeRow, file: &InodeRow, cred: &Cred) -> bool {
    dir.mode & 0o1000 == 0 || cred.uid == 0 || cred.uid == dir.uid || cred.uid == file.uid
}

fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

fn set_time(set: SetTime, now: Time) -> Option<Time> {
    match set {
        SetTime::Keep => None,
        SetTime::ServerNow => Some(now),
        SetTime::Client(t) => Some(t),
    }
}

/// The inodes a change touches, copied on first change, logged once each.
struct Changed<'a> {
    ns: &'a Namespace,
    rows: Vec<(u64, InodeRow)>,
}

impl<'a> Changed<'a> {
    fn new(ns: &'a Namespace) -> Self {
        Changed { ns, rows: Vec::new() }
    }

    fn get(&mut self, ino: u64) -> &mut InodeRow {
        let at = match self.rows.iter().position(|(i, _)| *i == ino) {
            Some(at) => at,
            None => {
                self.rows.push((ino, self.ns.inodes[&ino].clone()));
                self.rows.len() - 1
            }
        };
        &mut self.rows[at].1
    }

    fn into_ops(self, mut ops: Vec<NsOp>) -> Vec<NsOp> {
        ops.extend(self.rows.into_iter().map(|(ino, row)| NsOp::Inode { ino, row }));
        ops
    }
}

impl FileSystem {
    /// Opens dataset `dataset` of `pool` (creating its root directory the
    /// first time) and frees the data of files removed before a crash.
    pub async fn open(pool: &Arc<Pool>, dataset: u32, recordsize: u32, quota: u64) -> Result<Arc<Self>, PoolError> {
        let engine = pool.open_volume(dataset, ENGINE_BYTES, recordsize)?;
        let namespace = pool.namespace(dataset);
        let now = Time::now();
        let fs =
            Arc::new_cyclic(|this| FileSystem::new(this, pool, dataset, None, recordsize, engine, namespace, quota));
        let missing_root = !fs.namespace.lock_or_abort().has_root();
        if missing_root {
            let gate = pool.enter_write(dataset).await;
            {
                let mut ns = fs.namespace.lock_or_abort();
                // Like /tmp: with root squashed (the default) nobody could
                // otherwise ever write to a new dataset over NFS.
                let row = InodeRow {
                    kind: FileType::Directory,
                    mode: 0o1777,
                    nlink: 2,
                    parent: ROOT_INO,
                    next_cookie: 3,
                    generation: ns.next_generation,
                    atime: now,
                    mtime: now,
                    ctime: now,
                    ..InodeRow::dataset_row(0)
                };
                pool.log_namespace(&mut ns, vec![NsOp::Inode { ino: ROOT_INO, row }]);
            }
            drop(gate);
            pool.commit().await?;
        }
        let reaping = fs.namespace.lock_or_abort().reaping();
        for ino in reaping {
            fs.reap(ino)
                .await
                .map_err(|e| PoolError::Invalid(format!("freeing a removed file: {e}")))?;
        }
        Ok(fs)
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        this: &Weak<FileSystem>,
        pool: &Arc<Pool>,
        dataset: u32,
        snapshot_of: Option<u32>,
        recordsize: u32,
        engine: Arc<EngineVolume>,
        namespace: SharedNamespace,
        quota: u64,
    ) -> FileSystem {
        let mut verifier = [0u8; 8];
        let now = Time::now();
        verifier[..4].copy_from_slice(&(now.seconds as u32).to_le_bytes());
        verifier[4..].copy_from_slice(&(now.nanos ^ std::process::id()).to_le_bytes());
        let pool_tag = pool.handle_tag();
        FileSystem {
            dataset,
            pool_tag,
            snapshot_of,
            // The pool's tag above the dataset's id: another pool's dataset
            // of the same id is another file system to a client.
            fsid: (pool_tag << 32) | snapshot_of.unwrap_or(dataset) as u64,
            fileid_base: if snapshot_of.is_some() {
                (dataset as u64) << 32
            } else {
                0
            },
            recordsize,
            pool: pool.clone(),
            engine,
            namespace,
            verifier,
            quota: AtomicU64::new(quota),
            data_locks: (0..DATA_LOCKS).map(|_| tokio::sync::RwLock::new(())).collect(),
            unlogged: Mutex::new(HashSet::new()),
            quiesce: tokio::sync::RwLock::new(false),
            snapshots: Mutex::new(HashMap::new()),
            deferred: Mutex::new(Deferred::default()),
            this: this.clone(),
        }
    }

    /// The pool's tag in this file system's handles.
    pub fn pool_tag(&self) -> u64 {
        self.pool_tag
    }

    /// The dataset id (in file handles; a snapshot's id for a snapshot).
    pub fn dataset(&self) -> u32 {
        self.dataset
    }

    /// A snapshot's dataset (`None` for a live dataset).
    pub fn snapshot_of(&self) -> Option<u32> {
        self.snapshot_of
    }

    /// Enters a call that reads or changes data or logs namespace changes
    /// (never while holding another entry: the lock is fair, a waiting
    /// snapshot would stop the second).
    async fn enter(&self) -> FsResult<tokio::sync::RwLockReadGuard<'_, bool>> {
        let guard = self.quiesce.read().await;
        if *guard {
            return Err(FsError::Stale);
        }
        Ok(guard)
    }

    /// Enters a call that changes something: refused in a snapshot.
    async fn enter_change(&self) -> FsResult<tokio::sync::RwLockReadGuard<'_, bool>> {
        if self.snapshot_of.is_some() {
            return Err(FsError::ReadOnly);
        }
        self.enter().await
    }

    /// Waits for the calls under way, then refuses every later one with
    /// NFS3ERR_STALE (the dataset or snapshot is being destroyed).
    pub async fn retire(&self) {
        *self.quiesce.write().await = true;
    }

    /// Takes snapshot `name` of the dataset: every write acknowledged
    /// before it and every namespace change are in it, nothing after.
    /// Calls wait meanwhile: the files' sizes and times still only in
    /// memory are logged, the data cached in RAM is made durable, then the
    /// pool's snapshot record (which copies the namespace) is committed.
    pub async fn snapshot(&self, name: &str) -> Result<SnapshotInfo, FsError> {
        if self.snapshot_of.is_some() {
            return Err(FsError::ReadOnly);
        }
        check_name(name.as_bytes())?;
        if name.as_bytes() == SNAPSHOT_DIR {
            return Err(FsError::Inval);
        }
        let quiet = self.quiesce.write().await;
        if *quiet {
            return Err(FsError::Stale);
        }
        let unlogged: Vec<u64> = self.unlogged.lock_or_abort().drain().collect();
        for ino in unlogged {
            self.log_row(ino).await;
        }
        self.engine.flush().await.map_err(block_error)?;
        let taken = self
            .pool
            .create_snapshots(&[SnapshotRequest {
                volume: &self.engine,
                name: name.to_string(),
            }])
            .await
            .map_err(|e| match e {
                PoolError::Invalid(message) => FsError::Io(message),
                other => pool_error(other),
            })?;
        drop(quiet);
        Ok(taken.into_iter().next().expect("one snapshot per request"))
    }

    /// Logs inode `ino`'s row as it is now (its size and times were only
    /// in memory), unless the file is removed.
    async fn log_row(&self, ino: u64) {
        let gate = self.pool.enter_write(self.dataset).await;
        let mut ns = self.namespace.lock_or_abort();
        if let Some(row) = ns.inodes.get(&ino).filter(|r| r.nlink > 0).cloned() {
            self.pool.log_namespace(&mut ns, vec![NsOp::Inode { ino, row }]);
        }
        drop(gate);
    }

    pub fn recordsize(&self) -> u32 {
        self.recordsize
    }

    /// The space of this dataset's snapshots, in records: (snapshot id,
    /// what destroying it would free, what it maps that the one before
    /// does not).
    pub fn snapshot_space(&self) -> Vec<(u32, u64, u64)> {
        self.pool.snapshot_space(self.dataset).unwrap_or_default()
    }

    /// This dataset's snapshots, oldest first.
    pub fn snapshot_list(&self) -> Vec<SnapshotInfo> {
        self.pool.snapshots_of(self.dataset)
    }

    /// Destroys snapshot `name` of the dataset: calls in its files finish
    /// first, later ones get NFS3ERR_STALE.
    pub async fn destroy_snapshot(&self, name: &str) -> Result<(), FsError> {
        let info = self.pool.snapshot_named(self.dataset, name).ok_or(FsError::NoEnt)?;
        let open = self.snapshots.lock_or_abort().insert(info.id, SnapshotView::Destroying);
        if let Some(SnapshotView::Open(view)) = open {
            view.retire().await;
        }
        let result = self.pool.destroy_snapshot(info.id).await.map_err(pool_error);
        self.snapshots.lock_or_abort().remove(&info.id);
        result
    }

    /// Rolls the dataset back to snapshot `name`, its newest: its files,
    /// directories and data become the snapshot's again, and everything
    /// written since is discarded (committed or not). Calls under way
    /// finish first. Handles of files the snapshot has stay valid (their
    /// contents and times go back); those of files made since get
    /// NFS3ERR_STALE.
    pub async fn rollback(&self, name: &str) -> Result<(), FsError> {
        if self.snapshot_of.is_some() {
            return Err(FsError::ReadOnly);
        }
        let info = self.pool.snapshot_named(self.dataset, name).ok_or(FsError::NoEnt)?;
        let quiet = self.quiesce.write().await;
        if *quiet {
            return Err(FsError::Stale);
        }
        // Sizes and times only in memory belong to what is undone.
        self.unlogged.lock_or_abort().clear();
        self.pool.rollback(&self.engine, info.id).await.map_err(|e| match e {
            PoolError::Invalid(message) => FsError::Io(message),
            other => pool_error(other),
        })?;
        drop(quiet);
        // Files the snapshot holds removed but not yet freed.
        let reaping = self.namespace.lock_or_abort().reaping();
        for ino in reaping {
            self.reap(ino).await?;
        }
        Ok(())
    }

    /// Promotes this dataset, a clone, over `origin`, the dataset its
    /// origin snapshot belongs to (`zfs promote`): that snapshot and
    /// `origin`'s older ones become this dataset's, with their names, and
    /// `origin` becomes a clone of the snapshot. Returns the ids of the
    /// snapshots that moved, oldest first.
    ///
    /// No file changes: both live namespaces stay as they are, and a
    /// snapshot's namespace copy is kept under the snapshot's id, which
    /// does not change, so replay of the pool's `Promote` record and a
    /// checkpoint need nothing of the file service. Calls to both datasets,
    /// and to `origin`'s open views of the moving snapshots, finish first
    /// and wait meanwhile. Handles of files in a moved snapshot name the
    /// snapshot, not its dataset: they stay valid and are served by this
    /// dataset from then on (its fsid, its export's rules), same files,
    /// same data.
    pub async fn promote(&self, origin: &FileSystem) -> Result<Vec<u32>, FsError> {
        if self.snapshot_of.is_some() || origin.snapshot_of.is_some() {
            return Err(FsError::ReadOnly);
        }
        let snapshot = self
            .pool
            .origin_of(self.dataset)
            .and_then(|id| self.pool.snapshot(id))
            .ok_or_else(|| FsError::Io("the dataset is not a clone".into()))?;
        if snapshot.volume != origin.dataset {
            return Err(FsError::Io("the origin snapshot is not of that dataset".into()));
        }
        // Both datasets' calls (in id order, as the pool takes their
        // barriers), then the origin's views of what moves.
        let (first, second) = if self.dataset < origin.dataset {
            (self, origin)
        } else {
            (origin, self)
        };
        let first = first.quiesce.write().await;
        let second = second.quiesce.write().await;
        if *first || *second {
            return Err(FsError::Stale);
        }
        let moving: Vec<u32> = origin
            .snapshot_list()
            .iter()
            .filter(|s| s.generation <= snapshot.generation)
            .map(|s| s.id)
            .collect();
        let views: Vec<Arc<FileSystem>> = {
            let views = origin.snapshots.lock_or_abort();
            let mut open = Vec::new();
            for id in &moving {
                match views.get(id) {
                    Some(SnapshotView::Open(view)) => open.push(view.clone()),
                    Some(SnapshotView::Destroying) => {
                        return Err(FsError::Io(format!(
                            "snapshot {id:#x}, which would move, is being destroyed"
                        )))
                    }
                    None => {}
                }
            }
            open
        };
        let mut quiet_views = Vec::with_capacity(views.len());
        for view in &views {
            quiet_views.push(view.quiesce.write().await);
        }
        self.pool
            .promote(&self.engine, &origin.engine)
            .await
            .map_err(|e| match e {
                PoolError::Invalid(message) => FsError::Io(message),
                other => pool_error(other),
            })?;
        // The moved snapshots are this dataset's now: the origin forgets
        // its views of them (a call that found one already finishes on it,
        // reading the same files), and this dataset opens its own, in its
        // fsid, when a client next comes with one of their handles.
        origin.snapshots.lock_or_abort().retain(|id, _| !moving.contains(id));
        drop(quiet_views);
        drop((first, second));
        Ok(moving)
    }

    /// The read-only file system of snapshot `id` of this dataset (opened
    /// on first use); `None` if the dataset has no such snapshot.
    pub fn snapshot_fs(&self, id: u32) -> Option<Arc<FileSystem>> {
        if self.snapshot_of.is_some() || !crate::pool::snapshots::is_snapshot_id(id) {
            return None;
        }
        let mut views = self.snapshots.lock_or_abort();
        match views.get(&id) {
            Some(SnapshotView::Open(fs)) => return Some(fs.clone()),
            Some(SnapshotView::Destroying) => return None,
            None => {}
        }
        let info = self.pool.snapshot(id).filter(|info| info.volume == self.dataset)?;
        let namespace = self.pool.existing_namespace(info.id)?;
        let engine = self.pool.open_snapshot(info.id, self.recordsize).ok()?;
        let fs = Arc::new_cyclic(|this| {
            FileSystem::new(
                this,
                &self.pool,
                info.id,
                Some(self.dataset),
                self.recordsize,
                engine,
                namespace,
                0,
            )
        });
        views.insert(id, SnapshotView::Open(fs.clone()));
        Some(fs)
    }

    /// The `.snapshot` directory's attributes: read-only, its times
    /// changed by every snapshot taken or destroyed (so clients' caches of
    /// its listing go stale).
    fn snapshot_dir_attr(&self, snapshots: &[SnapshotInfo]) -> Attr {
        let newest = snapshots.iter().map(|s| s.created_unix).max().unwrap_or(0);
        let time = Time {
            seconds: newest,
            nanos: snapshots.len() as u32,
        };
        Attr {
            kind: FileType::Directory,
            mode: 0o555,
            nlink: 2,
            uid: 0,
            gid: 0,
            size: 4096,
            used: 4096,
            rdev: (0, 0),
            fsid: self.fsid,
            fileid: SNAPSHOT_DIR_INO,
            atime: time,
            mtime: time,
            ctime: time,
        }
    }

    fn snapshot_dir_handle(&self) -> Handle {
        Handle {
            pool: self.pool_tag,
            dataset: self.snapshot_of.unwrap_or(self.dataset),
            ino: SNAPSHOT_DIR_INO,
            generation: 0,
        }
    }

    /// Whether `handle` names this dataset's `.snapshot` directory.
    fn is_snapshot_dir(&self, handle: &Handle) -> bool {
        self.snapshot_of.is_none() && self.names_this(handle) && handle.ino == SNAPSHOT_DIR_INO
    }

    /// A snapshot's root directory, as its dataset's `.snapshot` lists it.
    fn snapshot_root(&self, info: &SnapshotInfo) -> Option<(Handle, Attr)> {
        let fs = self.snapshot_fs(info.id)?;
        let root = fs.root();
        let attr = fs.getattr(&root).ok()?;
        Some((root, attr))
    }

    /// LOOKUP in `.snapshot`.
    fn snapshot_dir_lookup(&self, name: &[u8]) -> FsResult<(Handle, Attr)> {
        let snapshots = self.snapshot_list();
        match name {
            b"." => Ok((self.snapshot_dir_handle(), self.snapshot_dir_attr(&snapshots))),
            b".." => {
                let root = self.root();
                let attr = self.getattr(&root)?;
                Ok((root, attr))
            }
            _ => {
                let name = std::str::from_utf8(name).map_err(|_| FsError::NoEnt)?;
                let info = snapshots.iter().find(|s| s.name == name).ok_or(FsError::NoEnt)?;
                self.snapshot_root(info).ok_or(FsError::NoEnt)
            }
        }
    }

    /// READDIR of `.snapshot`: `.`, `..`, then the snapshots oldest first
    /// (cookie: 3 + the snapshot's number, so a listing resumes right).
    fn snapshot_dir_readdir(&self, cookie: u64, max: usize) -> FsResult<(Vec<DirEntry>, bool)> {
        let snapshots = self.snapshot_list();
        let mut out = Vec::new();
        if cookie == 0 {
            let attr = self.snapshot_dir_attr(&snapshots);
            out.push(DirEntry {
                cookie: 1,
                name: b".".to_vec(),
                fileid: attr.fileid,
                handle: self.snapshot_dir_handle(),
                attr,
            });
        }
        if cookie <= 1 {
            let root = self.root();
            let attr = self.getattr(&root)?;
            out.push(DirEntry {
                cookie: 2,
                name: b"..".to_vec(),
                fileid: attr.fileid,
                handle: root,
                attr,
            });
        }
        for info in &snapshots {
            let at = 3 + (info.id & !crate::pool::snapshots::SNAPSHOT_ID_BASE) as u64;
            if at <= cookie {
                continue;
            }
            if out.len() >= max {
                return Ok((out, false));
            }
            if let Some((handle, attr)) = self.snapshot_root(info) {
                out.push(DirEntry {
                    cookie: at,
                    name: info.name.as_bytes().to_vec(),
                    fileid: attr.fileid,
                    handle,
                    attr,
                });
            }
        }
        Ok((out, true))
    }

    /// The root directory's handle.
    pub fn root(&self) -> Handle {
        let ns = self.namespace.lock_or_abort();
        Handle {
            pool: self.pool_tag,
            dataset: self.dataset,
            ino: ROOT_INO,
            generation: ns.inodes.get(&ROOT_INO).map_or(0, |row| row.generation),
        }
    }

    /// This daemon instance's write verifier: a new one at every start, so
    /// clients resend UNSTABLE writes they had not committed before it.
    pub fn write_verifier(&self) -> [u8; 8] {
        self.verifier
    }

    pub fn set_quota(&self, bytes: u64) {
        self.quota.store(bytes, Ordering::Relaxed);
    }

    fn data_lock(&self, ino: u64) -> &tokio::sync::RwLock<()> {
        &self.data_locks[ino as usize % DATA_LOCKS]
    }

    /// The live inode a handle names.
    fn row<'a>(&self, ns: &'a Namespace, handle: &Handle) -> FsResult<&'a InodeRow> {
        if self.is_snapshot_dir(handle) {
            // Nothing in `.snapshot` changes but by the admin's commands.
            return Err(FsError::ReadOnly);
        }
        if !self.names_this(handle) {
            return Err(FsError::Stale);
        }
        match ns.inodes.get(&handle.ino) {
            Some(row) if row.generation == handle.generation && row.nlink > 0 => Ok(row),
            _ => Err(FsError::Stale),
        }
    }

    fn dir_row<'a>(&self, ns: &'a Namespace, handle: &Handle) -> FsResult<&'a InodeRow> {
        let row = self.row(ns, handle)?;
        if row.kind != FileType::Directory {
            return Err(FsError::NotDir);
        }
        Ok(row)
    }

    fn attr(&self, ino: u64, row: &InodeRow) -> Attr {
        let used = match row.kind {
            FileType::Regular => round_up(row.size, 4096),
            FileType::Directory => 4096,
            _ => 0,
        };
        Attr {
            kind: row.kind,
            mode: row.mode & 0o7777,
            nlink: row.nlink,
            uid: row.uid,
            gid: row.gid,
            size: match row.kind {
                FileType::Directory => 4096,
                FileType::Symlink => row.target.len() as u64,
                _ => row.size,
            },
            used,
            rdev: row.rdev,
            fsid: self.fsid,
            fileid: self.fileid_base | ino,
            atime: row.atime,
            mtime: row.mtime,
            ctime: row.ctime,
        }
    }

    /// Whether `handle` is of this dataset (or snapshot): its id, and its
    /// pool's tag unless it is a handle of the first version (without one).
    fn names_this(&self, handle: &Handle) -> bool {
        handle.dataset == self.dataset && (handle.pool == self.pool_tag || handle.pool == 0)
    }

    fn handle(&self, ino: u64, row: &InodeRow) -> Handle {
        Handle {
            pool: self.pool_tag,
            dataset: self.dataset,
            ino,
            generation: row.generation,
        }
    }

    /// Runs a namespace change: `change` checks and returns the operations
    /// (applied and logged as one record) and its result; the record is
    /// durable before this returns. Returns with it the attributes of the
    /// `watched` objects right before and after the change, taken under
    /// the namespace lock with it (`None`: the object is gone).
    async fn change<T, const N: usize>(
        &self,
        watched: [&Handle; N],
        change: impl FnOnce(&mut Namespace, Time) -> FsResult<(Vec<NsOp>, T)>,
    ) -> FsResult<(T, [Option<Wcc>; N])> {
        let _entered = self.enter_change().await?;
        self.change_entered(watched, change).await
    }

    /// [`FileSystem::change`] in a call that entered already.
    async fn change_entered<T, const N: usize>(
        &self,
        watched: [&Handle; N],
        change: impl FnOnce(&mut Namespace, Time) -> FsResult<(Vec<NsOp>, T)>,
    ) -> FsResult<(T, [Option<Wcc>; N])> {
        let gate = self.pool.enter_write(self.dataset).await;
        let value = {
            let mut ns = self.namespace.lock_or_abort();
            let before = watched.map(|handle| self.live_attr(&ns, handle));
            let (ops, value) = change(&mut ns, Time::now())?;
            if !ops.is_empty() {
                self.pool.log_namespace(&mut ns, ops);
            }
            let mut wcc = [None; N];
            for (i, handle) in watched.iter().enumerate() {
                wcc[i] = self.live_attr(&ns, handle).map(|after| Wcc {
                    before: before[i].as_ref().map(PreAttr::from),
                    after,
                });
            }
            (value, wcc)
        };
        drop(gate);
        // A namespace change is all in its record (a truncation made its
        // data changes durable before: see `setattr`).
        self.pool.commit_records().await.map_err(pool_error)?;
        Ok(value)
    }

    /// The attributes of the live object `handle` names, if it does.
    fn live_attr(&self, ns: &Namespace, handle: &Handle) -> Option<Attr> {
        if !self.names_this(handle) {
            return None;
        }
        let row = ns.inodes.get(&handle.ino)?;
        (row.generation == handle.generation && row.nlink > 0).then(|| self.attr(handle.ino, row))
    }

    pub fn getattr(&self, handle: &Handle) -> FsResult<Attr> {
        if self.is_snapshot_dir(handle) {
            return Ok(self.snapshot_dir_attr(&self.snapshot_list()));
        }
        let ns = self.namespace.lock_or_abort();
        let row = self.row(&ns, handle)?;
        Ok(self.attr(handle.ino, row))
    }

    /// Sets attributes. `guard`: SETATTR's ctime guard (seconds compared
    /// as NFS's 32 bits carry them): `NotSync` when the file's differs.
    /// Returns the file's attributes around the change.
    pub async fn setattr(&self, handle: &Handle, cred: &Cred, set: SetAttrs, guard: Option<Time>) -> FsResult<Wcc> {
        let guarded = |row: &InodeRow| match guard {
            Some(t) if (row.ctime.seconds as u32, row.ctime.nanos) != (t.seconds as u32, t.nanos) => {
                Err(FsError::NotSync)
            }
            _ => Ok(()),
        };
        let _entered = self.enter_change().await?;
        let _data = match set.size {
            Some(_) => Some(self.data_lock(handle.ino).write().await),
            None => None,
        };
        // Check and learn the old size first; the truncation's zeroing and
        // freeing happen before the size is logged.
        let old_size = {
            let ns = self.namespace.lock_or_abort();
            let row = self.row(&ns, handle)?;
            guarded(row)?;
            self.check_setattr(row, cred, &set)?;
            row.size
        };
        if let Some(size) = set.size {
            if size < old_size {
                self.discard(handle.ino, size, old_size).await?;
                // The zeroed tail, wherever it went, durable with the
                // trims before the smaller size is.
                self.pool.commit().await.map_err(pool_error)?;
            }
        }
        let ((), [wcc]) = self
            .change_entered([handle], |ns, now| {
                let row = self.row(ns, handle)?.clone();
                guarded(&row)?;
                self.check_setattr(&row, cred, &set)?;
                let mut row = row;
                if let Some(mode) = set.mode {
                    row.mode = mode & 0o7777;
                }
                if let Some(uid) = set.uid {
                    if uid != row.uid && cred.uid != 0 {
                        row.mode &= !0o6000;
                    }
                    row.uid = uid;
                }
                if let Some(gid) = set.gid {
                    if gid != row.gid && cred.uid != 0 {
                        row.mode &= !0o6000;
                    }
                    row.gid = gid;
                }
                if let Some(size) = set.size {
                    if size != row.size {
                        row.mtime = now;
                    }
                    row.size = size;
                }
                if let Some(t) = set_time(set.atime, now) {
                    row.atime = t;
                }
                if let Some(t) = set_time(set.mtime, now) {
                    row.mtime = t;
                }
                row.ctime = now;
                // The row logged holds every write so far, so COMMIT need
                // not log it again. Cleared here, under the namespace lock:
                // after the commit's wait it would also clear the mark of a
                // write that ran meanwhile, whose size no record would hold.
                self.unlogged.lock_or_abort().remove(&handle.ino);
                Ok((vec![NsOp::Inode { ino: handle.ino, row }], ()))
            })
            .await?;
        // The file was live under the lock with the change.
        wcc.ok_or(FsError::Stale)
    }

    fn check_setattr(&self, row: &InodeRow, cred: &Cred, set: &SetAttrs) -> FsResult<()> {
        let owner = cred.uid == 0 || cred.uid == row.uid;
        if set.mode.is_some() && !owner {
            return Err(FsError::Perm);
        }
        if let Some(uid) = set.uid {
            if uid != row.uid && cred.uid != 0 {
                return Err(FsError::Perm);
            }
        }
        if let Some(gid) = set.gid {
            if gid != row.gid && !(cred.uid == 0 || (cred.uid == row.uid && cred.in_group(gid))) {
                return Err(FsError::Perm);
            }
        }
        if let Some(size) = set.size {
            match row.kind {
                FileType::Regular => {}
                FileType::Directory => return Err(FsError::IsDir),
                _ => return Err(FsError::Inval),
            }
            if size > MAX_FILE_SIZE {
                return Err(FsError::FBig);
            }
            if !owner && !permits(row, cred, 2) {
                return Err(FsError::Access);
            }
        }
        let times_to_now = matches!(set.atime, SetTime::ServerNow) || matches!(set.mtime, SetTime::ServerNow);
        let times_given = matches!(set.atime, SetTime::Client(_)) || matches!(set.mtime, SetTime::Client(_));
        if times_given && !owner {
            return Err(FsError::Perm);
        }
        if times_to_now && !owner && !permits(row, cred, 2) {
            return Err(FsError::Access);
        }
        Ok(())
    }

    /// Zeroes file `ino` from `from` and frees its blocks up to `to`.
    async fn discard(&self, ino: u64, from: u64, to: u64) -> FsResult<()> {
        let base = ino << FILE_BITS;
        let aligned = round_up(from, ALIGN);
        if aligned > from {
            // The rest of the sector `from` falls in reads back as zeros.
            let start = aligned - ALIGN;
            let (mut buf, result) = self.engine.read(base + start, IoBuf::new(ALIGN as usize)).await;
            result.map_err(block_error)?;
            buf.payload_mut()[(from - start) as usize..].fill(0);
            self.engine.write(base + start, buf, false).await.map_err(block_error)?;
        }
        let end = round_up(to, ALIGN);
        if end > aligned {
            self.engine
                .trim(base + aligned, end - aligned, false)
                .await
                .map_err(block_error)?;
        }
        Ok(())
    }

    pub fn lookup(&self, dir: &Handle, name: &[u8], cred: &Cred) -> FsResult<(Handle, Attr)> {
        if self.is_snapshot_dir(dir) {
            return self.snapshot_dir_lookup(name);
        }
        let ns = self.namespace.lock_or_abort();
        let dir_row = self.dir_row(&ns, dir)?;
        if !permits(dir_row, cred, 1) {
            return Err(FsError::Access);
        }
        let ino = match name {
            b"." => dir.ino,
            b".." if dir.ino == ROOT_INO && self.snapshot_of.is_some() => {
                // A snapshot's root is in its dataset's `.snapshot`.
                drop(ns);
                let parent = self.snapshot_of.unwrap_or(self.dataset);
                let attr = self.snapshot_dir_attr(&self.pool.snapshots_of(parent));
                return Ok((self.snapshot_dir_handle(), attr));
            }
            SNAPSHOT_DIR if dir.ino == ROOT_INO && self.snapshot_of.is_none() => {
                drop(ns);
                return self.snapshot_dir_lookup(b".");
            }
            b".." => dir_row.parent,
            _ => {
                if name.len() > MAX_NAME {
                    return Err(FsError::NameTooLong);
                }
                let entries = ns.dirs.get(&dir.ino).ok_or(FsError::NoEnt)?;
                let cookie = entries.names.get(name).ok_or(FsError::NoEnt)?;
                entries.entries[cookie].1
            }
        };
        let row = ns.inodes.get(&ino).ok_or(FsError::NoEnt)?;
        Ok((self.handle(ino, row), self.attr(ino, row)))
    }

    /// The subset of `mask` (ACCESS3 bits) `cred` is granted.
    pub fn access(&self, handle: &Handle, cred: &Cred, mask: u32) -> FsResult<u32> {
        if self.is_snapshot_dir(handle) {
            return Ok((access::READ | access::LOOKUP) & mask);
        }
        let ns = self.namespace.lock_or_abort();
        let row = self.row(&ns, handle)?;
        let dir = row.kind == FileType::Directory;
        let mut granted = 0;
        if permits(row, cred, 4) {
            granted |= access::READ;
        }
        if permits(row, cred, 2) {
            granted |= access::MODIFY | access::EXTEND;
            if dir {
                granted |= access::DELETE;
            }
        }
        if permits(row, cred, 1) {
            granted |= if dir { access::LOOKUP } else { access::EXECUTE };
        }
        Ok(granted & mask)
    }

    pub fn readlink(&self, handle: &Handle) -> FsResult<Vec<u8>> {
        let ns = self.namespace.lock_or_abort();
        let row = self.row(&ns, handle)?;
        if row.kind != FileType::Symlink {
            return Err(FsError::Inval);
        }
        Ok(row.target.clone())
    }

    /// The regular file a data request is for, checked.
    fn data_row(&self, handle: &Handle, cred: &Cred, want: u32) -> FsResult<InodeRow> {
        if self.is_snapshot_dir(handle) {
            return Err(FsError::IsDir);
        }
        let ns = self.namespace.lock_or_abort();
        let row = self.row(&ns, handle)?;
        match row.kind {
            FileType::Regular => {}
            FileType::Directory => return Err(FsError::IsDir),
            _ => return Err(FsError::Inval),
        }
        // The owner may read and write a file whatever its mode (it was
        // checked when the client opened it; knfsd does the same).
        if !(permits(row, cred, want) || cred.uid == row.uid) {
            return Err(FsError::Access);
        }
        Ok(row.clone())
    }

    /// Up to `count` bytes at `offset`; `true` when the read reached the
    /// end of the file.
    pub async fn read(&self, handle: &Handle, cred: &Cred, offset: u64, count: u32) -> FsResult<(Vec<u8>, bool)> {
        let (data, eof) = self.read_data(handle, cred, offset, count).await?;
        Ok((data.bytes().to_vec(), eof))
    }

    /// [`FileSystem::read`] without a copy: the bytes stay in the buffer
    /// the engine read them into (the NFS server sends them from there).
    pub async fn read_data(&self, handle: &Handle, cred: &Cred, offset: u64, count: u32) -> FsResult<(FileData, bool)> {
        let _entered = self.enter().await?;
        let _data = self.data_lock(handle.ino).read().await;
        let row = self.data_row(handle, cred, 4)?;
        if offset >= row.size {
            return Ok((FileData::empty(), true));
        }
        let end = row.size.min(offset.saturating_add(count as u64));
        let start = offset / ALIGN * ALIGN;
        let base = handle.ino << FILE_BITS;
        let length = round_up(end, ALIGN) - start;
        let (buf, result) = self.engine.read(base + start, IoBuf::new(length as usize)).await;
        result.map_err(block_error)?;
        let skip = (offset - start) as usize;
        let data = FileData {
            buf,
            range: skip..skip + (end - offset) as usize,
        };
        Ok((data, end >= row.size))
    }

    /// Returns the bytes written, how durable they are and the file's
    /// attributes around the write.
    pub async fn write(
        &self,
        handle: &Handle,
        cred: &Cred,
        offset: u64,
        data: &[u8],
        stable: Stable,
    ) -> FsResult<(u32, Stable, Wcc)> {
        let end = offset.checked_add(data.len() as u64).ok_or(FsError::FBig)?;
        if end > MAX_FILE_SIZE {
            return Err(FsError::FBig);
        }
        let aligned = offset.is_multiple_of(ALIGN) && end.is_multiple_of(ALIGN);
        let _entered = self.enter_change().await?;
        let lock = self.data_lock(handle.ino);
        let (_shared, _exclusive) = if aligned {
            (Some(lock.read().await), None)
        } else {
            (None, Some(lock.write().await))
        };
        let row = self.data_row(handle, cred, 2)?;
        if data.is_empty() {
            // Nothing changes: one read of the attributes is both.
            let after = self.attr(handle.ino, &row);
            let before = Some(PreAttr::from(&after));
            return Ok((0, stable, Wcc { before, after }));
        }
        let quota = self.quota.load(Ordering::Relaxed);
        if quota != 0 && end > row.size && self.engine_used() + (end - row.size) > quota {
            return Err(FsError::DQuot);
        }
        let durable = stable != Stable::Unstable;
        // A FILE_SYNC write, or a DATA_SYNC one that extends the file, makes
        // the file's row durable with its data: the row is logged first, so
        // the data's own commit carries both (one commit, not two in turn).
        let log_row = stable == Stable::FileSync || (stable == Stable::DataSync && end > row.size);
        let now = Time::now();
        let logged = if log_row {
            Some(self.log_row_update(handle, end, now).await?)
        } else {
            None
        };
        let base = handle.ino << FILE_BITS;
        let written = if aligned {
            self.engine
                .write(base + offset, IoBuf::copy_from(data), durable)
                .await
                .map_err(block_error)
        } else {
            self.write_unaligned(base, &row, offset, end, data, durable).await
        };
        if let Err(e) = written {
            if let Some((size, _, _)) = logged {
                // The size logged ahead goes back (unless a later write
                // grew the file further meanwhile).
                let _ = self.undo_row_update(handle, size, end).await;
            }
            return Err(e);
        }
        let wcc = {
            let gate = self.pool.enter_write(self.dataset).await;
            let mut ns = self.namespace.lock_or_abort();
            let row = match ns.inodes.get_mut(&handle.ino) {
                Some(row) if row.generation == handle.generation => row,
                _ => return Err(FsError::Stale),
            };
            let before = match logged {
                // The row was changed when it was logged: `before` holds
                // only if nothing changed it since (else the client would
                // take another's change for its own).
                Some((_, before, after)) => {
                    let now_is = (row.size, row.mtime, row.ctime);
                    (now_is == (after.size, after.mtime, after.ctime)).then_some(before)
                }
                None => Some(PreAttr::from(&self.attr(handle.ino, row))),
            };
            if !log_row {
                row.size = row.size.max(end);
                row.mtime = now;
                row.ctime = now;
                ns.touch(handle.ino);
                self.unlogged.lock_or_abort().insert(handle.ino);
            }
            let row = &ns.inodes[&handle.ino];
            let after = self.attr(handle.ino, row);
            drop(gate);
            Wcc { before, after }
        };
        Ok((data.len() as u32, stable.max(Stable::Unstable), wcc))
    }

    /// A write of a partial sector: read, merge, write the sectors whole
    /// (under the file's exclusive data lock).
    async fn write_unaligned(
        &self,
        base: u64,
        row: &InodeRow,
        offset: u64,
        end: u64,
        data: &[u8],
        durable: bool,
    ) -> FsResult<()> {
        let start = offset / ALIGN * ALIGN;
        let length = round_up(end, ALIGN) - start;
        let (mut buf, result) = self.engine.read(base + start, IoBuf::new(length as usize)).await;
        result.map_err(block_error)?;
        // Bytes past the end of the file read as zeros whatever the
        // sector holds.
        let valid = row.size.saturating_sub(start).min(length) as usize;
        buf.payload_mut()[valid..].fill(0);
        let at = (offset - start) as usize;
        buf.payload_mut()[at..at + data.len()].copy_from_slice(data);
        self.engine.write(base + start, buf, durable).await.map_err(block_error)
    }

    /// Grows the file's size to `end` and sets its times, logging its row
    /// (not committed: the write's commit that follows carries it).
    /// Returns the size before, and the size and times before and after.
    async fn log_row_update(&self, handle: &Handle, end: u64, now: Time) -> FsResult<(u64, PreAttr, PreAttr)> {
        let gate = self.pool.enter_write(self.dataset).await;
        let mut ns = self.namespace.lock_or_abort();
        let row = match ns.inodes.get_mut(&handle.ino) {
            Some(row) if row.generation == handle.generation && row.nlink > 0 => row,
            _ => return Err(FsError::Stale),
        };
        let before = row.size;
        let pre = |row: &InodeRow| PreAttr::from(&self.attr(handle.ino, row));
        let pre_before = pre(row);
        row.size = row.size.max(end);
        row.mtime = now;
        row.ctime = now;
        let pre_after = pre(row);
        let row = row.clone();
        self.pool
            .log_namespace(&mut ns, vec![NsOp::Inode { ino: handle.ino, row }]);
        self.unlogged.lock_or_abort().remove(&handle.ino);
        drop(gate);
        Ok((before, pre_before, pre_after))
    }

    /// A write whose row was logged ahead failed: its size goes back to
    /// `before` if it is still the `end` that write set, and is committed.
    async fn undo_row_update(&self, handle: &Handle, before: u64, end: u64) -> FsResult<()> {
        let changed = {
            let gate = self.pool.enter_write(self.dataset).await;
            let mut ns = self.namespace.lock_or_abort();
            let changed = match ns.inodes.get_mut(&handle.ino) {
                Some(row) if row.generation == handle.generation && row.size == end && before < end => {
                    row.size = before;
                    Some(row.clone())
                }
                _ => None,
            };
            if let Some(row) = &changed {
                let row = row.clone();
                self.pool
                    .log_namespace(&mut ns, vec![NsOp::Inode { ino: handle.ino, row }]);
            }
            drop(gate);
            changed.is_some()
        };
        if changed {
            self.pool.commit_records().await.map_err(pool_error)?;
        }
        Ok(())
    }

    /// Pool space the dataset's files take (for the quota).
    fn engine_used(&self) -> u64 {
        self.engine.used_bytes()
    }

    /// Makes every write to the file durable (COMMIT): its size and times
    /// logged, the dataset's cached writes logged or placed, one commit.
    pub async fn commit(&self, handle: &Handle) -> FsResult<()> {
        if self.snapshot_of.is_some() {
            // Nothing in a snapshot is ever unstable.
            return Ok(());
        }
        let _entered = self.enter().await?;
        {
            let ns = self.namespace.lock_or_abort();
            self.row(&ns, handle)?;
        }
        if self.unlogged.lock_or_abort().remove(&handle.ino) {
            self.log_row(handle.ino).await;
        }
        self.engine.flush().await.map_err(block_error)?;
        self.pool.commit().await.map_err(pool_error)
    }

    /// A new inode's row, owned by `cred`.
    fn new_row(ns: &Namespace, dir: u64, kind: FileType, cred: &Cred, attrs: &SetAttrs, now: Time) -> InodeRow {
        let dir_row = &ns.inodes[&dir];
        // A set-group-id directory gives its group to what is made in it.
        let gid = if dir_row.mode & 0o2000 != 0 {
            dir_row.gid
        } else {
            attrs.gid.unwrap_or(cred.gid)
        };
        let default_mode = match kind {
            FileType::Directory => 0o755,
            FileType::Symlink => 0o777,
            _ => 0o644,
        };
        let mut mode = attrs.mode.unwrap_or(default_mode) & 0o7777;
        if kind == FileType::Directory && dir_row.mode & 0o2000 != 0 {
            mode |= 0o2000;
        }
        InodeRow {
            generation: 0,
            kind,
            mode,
            uid: if cred.uid == 0 {
                attrs.uid.unwrap_or(0)
            } else {
                cred.uid
            },
            gid,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            size: 0,
            atime: set_time(attrs.atime, now).unwrap_or(now),
            mtime: set_time(attrs.mtime, now).unwrap_or(now),
            ctime: now,
            rdev: (0, 0),
            parent: if kind == FileType::Directory { dir } else { 0 },
            next_cookie: if kind == FileType::Directory { 3 } else { 0 },
            verifier: 0,
            target: Vec::new(),
        }
    }

    /// Checks that `cred` may add `name` to `dir`; returns the inode it
    /// names now, if any.
    fn check_insert(&self, ns: &Namespace, dir: &Handle, name: &[u8], cred: &Cred) -> FsResult<Option<u64>> {
        check_name(name)?;
        if dir.ino == ROOT_INO && name == SNAPSHOT_DIR && self.snapshot_of.is_none() {
            return Err(FsError::Exist);
        }
        let dir_row = self.dir_row(ns, dir)?;
        if !permits(dir_row, cred, 3) {
            return Err(FsError::Access);
        }
        let entries = ns.dirs.get(&dir.ino).ok_or(FsError::Stale)?;
        Ok(entries.names.get(name).map(|cookie| entries.entries[cookie].1))
    }

    /// Makes a new inode `row` and links it as `name` in `dir`.
    fn insert_new(
        &self,
        ns: &mut Namespace,
        dir: u64,
        name: &[u8],
        mut row: InodeRow,
        now: Time,
    ) -> FsResult<(Vec<NsOp>, (Handle, Attr))> {
        let (ino, generation) = ns.allocate().ok_or(FsError::NoSpace)?;
        row.generation = generation;
        let mut changed = Changed::new(ns);
        let dir_row = changed.get(dir);
        let cookie = dir_row.next_cookie;
        dir_row.next_cookie += 1;
        if row.kind == FileType::Directory {
            dir_row.nlink += 1;
        }
        dir_row.mtime = now;
        dir_row.ctime = now;
        let result = (self.handle(ino, &row), self.attr(ino, &row));
        let ops = vec![
            NsOp::Inode { ino, row },
            NsOp::Link {
                dir,
                cookie,
                ino,
                name: name.to_vec(),
            },
        ];
        Ok((changed.into_ops(ops), result))
    }

    /// Creates (or, as `how` allows, finds) a regular file: its handle and
    /// attributes, and the directory's attributes around the change.
    pub async fn create(
        &self,
        dir: &Handle,
        name: &[u8],
        cred: &Cred,
        how: CreateHow,
    ) -> FsResult<(Handle, Attr, Option<Wcc>)> {
        let ((handle, attr, truncate), [dir_wcc]) = self
            .change([dir], |ns, now| {
                let existing = self.check_insert(ns, dir, name, cred)?;
                if let Some(ino) = existing {
                    let row = &ns.inodes[&ino];
                    let found = (self.handle(ino, row), self.attr(ino, row));
                    return match how {
                        CreateHow::Guarded(_) => Err(FsError::Exist),
                        CreateHow::Exclusive(verifier)
                            if row.verifier == u64::from_le_bytes(verifier) && row.kind == FileType::Regular =>
                        {
                            Ok((Vec::new(), (found.0, found.1, None)))
                        }
                        CreateHow::Exclusive(_) => Err(FsError::Exist),
                        CreateHow::Unchecked(attrs) => match row.kind {
                            FileType::Regular => Ok((Vec::new(), (found.0, found.1, attrs.size))),
                            FileType::Directory => Err(FsError::IsDir),
                            _ => Err(FsError::Exist),
                        },
                    };
                }
                let (attrs, verifier) = match how {
                    CreateHow::Unchecked(attrs) | CreateHow::Guarded(attrs) => (attrs, 0),
                    CreateHow::Exclusive(verifier) => (SetAttrs::default(), u64::from_le_bytes(verifier)),
                };
                let mut row = Self::new_row(ns, dir.ino, FileType::Regular, cred, &attrs, now);
                row.verifier = verifier;
                let (ops, (handle, attr)) = self.insert_new(ns, dir.ino, name, row, now)?;
                Ok((ops, (handle, attr, None)))
            })
            .await?;
        match truncate {
            Some(size) if size != attr.size => {
                let set = SetAttrs {
                    size: Some(size),
                    ..SetAttrs::default()
                };
                let attr = self.setattr(&handle, cred, set, None).await?.after;
                Ok((handle, attr, dir_wcc))
            }
            _ => Ok((handle, attr, dir_wcc)),
        }
    }

    pub async fn mkdir(
        &self,
        dir: &Handle,
        name: &[u8],
        cred: &Cred,
        attrs: SetAttrs,
    ) -> FsResult<(Handle, Attr, Option<Wcc>)> {
        self.make(dir, name, cred, FileType::Directory, attrs, |_| {}).await
    }

    pub async fn symlink(
        &self,
        dir: &Handle,
        name: &[u8],
        cred: &Cred,
        target: &[u8],
        attrs: SetAttrs,
    ) -> FsResult<(Handle, Attr, Option<Wcc>)> {
        if target.len() > MAX_SYMLINK {
            return Err(FsError::NameTooLong);
        }
        if target.is_empty() {
            return Err(FsError::Inval);
        }
        let attrs = SetAttrs {
            mode: Some(0o777),
            ..attrs
        };
        self.make(dir, name, cred, FileType::Symlink, attrs, |row| {
            row.target = target.to_vec()
        })
        .await
    }

    /// A device, socket or FIFO special file.
    pub async fn mknod(
        &self,
        dir: &Handle,
        name: &[u8],
        cred: &Cred,
        kind: FileType,
        rdev: (u32, u32),
        attrs: SetAttrs,
    ) -> FsResult<(Handle, Attr, Option<Wcc>)> {
        match kind {
            FileType::Block | FileType::Char => {
                if cred.uid != 0 {
                    return Err(FsError::Perm);
                }
            }
            FileType::Socket | FileType::Fifo => {}
            _ => return Err(FsError::BadType),
        }
        self.make(dir, name, cred, kind, attrs, |row| row.rdev = rdev).await
    }

    async fn make(
        &self,
        dir: &Handle,
        name: &[u8],
        cred: &Cred,
        kind: FileType,
        attrs: SetAttrs,
        finish: impl FnOnce(&mut InodeRow),
    ) -> FsResult<(Handle, Attr, Option<Wcc>)> {
        self.change([dir], |ns, now| {
            if self.check_insert(ns, dir, name, cred)?.is_some() {
                return Err(FsError::Exist);
            }
            let mut row = Self::new_row(ns, dir.ino, kind, cred, &attrs, now);
            finish(&mut row);
            if kind == FileType::Directory && ns.inodes[&dir.ino].nlink >= MAX_LINKS {
                return Err(FsError::MLink);
            }
            self.insert_new(ns, dir.ino, name, row, now)
        })
        .await
        .map(|((handle, attr), [dir_wcc])| (handle, attr, dir_wcc))
    }

    /// Checks that `cred` may remove `name` from `dir`: its cookie and inode.
    fn check_remove(&self, ns: &Namespace, dir: &Handle, name: &[u8], cred: &Cred) -> FsResult<(u64, u64)> {
        if name == b"." || name == b".." {
            return Err(FsError::Inval);
        }
        if name.len() > MAX_NAME {
            return Err(FsError::NameTooLong);
        }
        let dir_row = self.dir_row(ns, dir)?;
        if !permits(dir_row, cred, 3) {
            return Err(FsError::Access);
        }
        let entries = ns.dirs.get(&dir.ino).ok_or(FsError::Stale)?;
        let cookie = *entries.names.get(name).ok_or(FsError::NoEnt)?;
        let ino = entries.entries[&cookie].1;
        if !sticky_allows(dir_row, &ns.inodes[&ino], cred) {
            return Err(FsError::Access);
        }
        Ok((cookie, ino))
    }

    /// One link fewer for `ino` (two for a directory, whose `.` goes too);
    /// returns whether it was the last (the inode freed).
    fn drop_link(changed: &mut Changed, ops: &mut Vec<NsOp>, ino: u64, now: Time) -> bool {
        let row = changed.get(ino);
        let dir = row.kind == FileType::Directory;
        row.nlink = row.nlink.saturating_sub(if dir { 2 } else { 1 });
        row.ctime = now;
        if row.nlink > 0 {
            return false;
        }
        let has_data = row.kind == FileType::Regular;
        changed.rows.retain(|(i, _)| *i != ino);
        ops.push(NsOp::Free { ino });
        if !has_data {
            ops.push(NsOp::Reaped { ino });
        }
        has_data
    }

    /// Removes a name (not a directory's): the directory's attributes
    /// around the change.
    pub async fn remove(&self, dir: &Handle, name: &[u8], cred: &Cred) -> FsResult<Option<Wcc>> {
        let (freed, [dir_wcc]) = self
            .change([dir], |ns, now| {
                let (cookie, ino) = self.check_remove(ns, dir, name, cred)?;
                if ns.inodes[&ino].kind == FileType::Directory {
                    return Err(FsError::IsDir);
                }
                let mut ops = vec![NsOp::Unlink { dir: dir.ino, cookie }];
                let mut changed = Changed::new(ns);
                let dir_row = changed.get(dir.ino);
                dir_row.mtime = now;
                dir_row.ctime = now;
                let freed = Self::drop_link(&mut changed, &mut ops, ino, now).then_some(ino);
                Ok((changed.into_ops(ops), freed))
            })
            .await?;
        // The removal is committed: it is answered as done whatever
        // freeing the data does.
        if let Some(ino) = freed {
            self.reap_or_defer(ino).await;
        }
        Ok(dir_wcc)
    }

    /// Removes an empty directory: its parent's attributes around the
    /// change.
    pub async fn rmdir(&self, dir: &Handle, name: &[u8], cred: &Cred) -> FsResult<Option<Wcc>> {
        self.change([dir], |ns, now| {
            let (cookie, ino) = self.check_remove(ns, dir, name, cred)?;
            if ns.inodes[&ino].kind != FileType::Directory {
                return Err(FsError::NotDir);
            }
            if ns.dirs.get(&ino).is_some_and(|d| !d.entries.is_empty()) {
                return Err(FsError::NotEmpty);
            }
            let mut ops = vec![NsOp::Unlink { dir: dir.ino, cookie }];
            let mut changed = Changed::new(ns);
            let dir_row = changed.get(dir.ino);
            dir_row.nlink -= 1;
            dir_row.mtime = now;
            dir_row.ctime = now;
            Self::drop_link(&mut changed, &mut ops, ino, now);
            Ok((changed.into_ops(ops), ()))
        })
        .await
        .map(|((), [dir_wcc])| dir_wcc)
    }

    pub async fn rename(
        &self,
        from_dir: &Handle,
        from_name: &[u8],
        to_dir: &Handle,
        to_name: &[u8],
        cred: &Cred,
    ) -> FsResult<[Option<Wcc>; 2]> {
        let (freed, dirs_wcc) = self
            .change([from_dir, to_dir], |ns, now| {
                let (from_cookie, ino) = self.check_remove(ns, from_dir, from_name, cred)?;
                let existing = self.check_insert(ns, to_dir, to_name, cred)?;
                let moving_dir = ns.inodes[&ino].kind == FileType::Directory;
                if existing == Some(ino) {
                    // Two links to one file, or a name renamed to itself.
                    return Ok((Vec::new(), None));
                }
                if moving_dir {
                    // Not into itself or below it.
                    let mut at = to_dir.ino;
                    loop {
                        if at == ino {
                            return Err(FsError::Inval);
                        }
                        if at == ROOT_INO {
                            break;
                        }
                        at = ns.inodes[&at].parent;
                    }
                }
                let mut ops = vec![NsOp::Unlink {
                    dir: from_dir.ino,
                    cookie: from_cookie,
                }];
                let mut changed = Changed::new(ns);
                let mut freed = None;
                if let Some(target) = existing {
                    let target_row = &ns.inodes[&target];
                    let target_dir = target_row.kind == FileType::Directory;
                    if !sticky_allows(&ns.inodes[&to_dir.ino], target_row, cred) {
                        return Err(FsError::Access);
                    }
                    match (moving_dir, target_dir) {
                        (true, false) => return Err(FsError::NotDir),
                        (false, true) => return Err(FsError::IsDir),
                        (true, true) if ns.dirs.get(&target).is_some_and(|d| !d.entries.is_empty()) => {
                            return Err(FsError::NotEmpty)
                        }
                        _ => {}
                    }
                    let cookie = ns.dirs[&to_dir.ino].names[to_name];
                    ops.push(NsOp::Unlink {
                        dir: to_dir.ino,
                        cookie,
                    });
                    if target_dir {
                        changed.get(to_dir.ino).nlink -= 1;
                    }
                    if Self::drop_link(&mut changed, &mut ops, target, now) {
                        freed = Some(target);
                    }
                }
                let to_row = changed.get(to_dir.ino);
                let cookie = to_row.next_cookie;
                to_row.next_cookie += 1;
                to_row.mtime = now;
                to_row.ctime = now;
                if moving_dir && from_dir.ino != to_dir.ino {
                    to_row.nlink += 1;
                    changed.get(from_dir.ino).nlink -= 1;
                    changed.get(ino).parent = to_dir.ino;
                }
                let from_row = changed.get(from_dir.ino);
                from_row.mtime = now;
                from_row.ctime = now;
                changed.get(ino).ctime = now;
                ops.push(NsOp::Link {
                    dir: to_dir.ino,
                    cookie,
                    ino,
                    name: to_name.to_vec(),
                });
                Ok((changed.into_ops(ops), freed))
            })
            .await?;
        // The rename is committed: answered as done whatever freeing the
        // replaced file's data does.
        if let Some(ino) = freed {
            self.reap_or_defer(ino).await;
        }
        Ok(dirs_wcc)
    }

    /// A new name for a file: the directory's attributes around the
    /// change.
    pub async fn link(&self, file: &Handle, dir: &Handle, name: &[u8], cred: &Cred) -> FsResult<Option<Wcc>> {
        self.change([dir], |ns, now| {
            let row = self.row(ns, file)?;
            if row.kind == FileType::Directory {
                return Err(FsError::IsDir);
            }
            if row.nlink >= MAX_LINKS {
                return Err(FsError::MLink);
            }
            if self.check_insert(ns, dir, name, cred)?.is_some() {
                return Err(FsError::Exist);
            }
            let mut changed = Changed::new(ns);
            let row = changed.get(file.ino);
            row.nlink += 1;
            row.ctime = now;
            let dir_row = changed.get(dir.ino);
            let cookie = dir_row.next_cookie;
            dir_row.next_cookie += 1;
            dir_row.mtime = now;
            dir_row.ctime = now;
            let ops = vec![NsOp::Link {
                dir: dir.ino,
                cookie,
                ino: file.ino,
                name: name.to_vec(),
            }];
            Ok((changed.into_ops(ops), ()))
        })
        .await
        .map(|((), [dir_wcc])| dir_wcc)
    }

    /// Frees a removed file's data; if that fails, counts and logs it and
    /// leaves it to a background retry (the removal is committed already).
    async fn reap_or_defer(&self, ino: u64) {
        let Err(error) = self.reap(ino).await else {
            return;
        };
        DEFERRED.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "dataset {}: freeing the data of removed file {ino} failed ({error}); it is retried in the background",
            self.dataset
        );
        let start = {
            let mut deferred = self.deferred.lock_or_abort();
            if deferred.inodes.insert(ino) {
                DEFERRED_PENDING.fetch_add(1, Ordering::Relaxed);
            }
            !std::mem::replace(&mut deferred.retrying, true)
        };
        if !start {
            return;
        }
        // Without a runtime to retry on, the next open frees it.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.deferred.lock_or_abort().retrying = false;
            return;
        };
        runtime.spawn(Self::retry_deferred(self.this.clone()));
    }

    /// Tries the deferred freeings again, waiting longer after each round
    /// that leaves some, until none is left or the file system is gone.
    async fn retry_deferred(this: Weak<FileSystem>) {
        let mut wait = REAP_RETRY_FIRST;
        loop {
            tokio::time::sleep(wait).await;
            let Some(fs) = this.upgrade() else {
                return;
            };
            let inodes: Vec<u64> = fs.deferred.lock_or_abort().inodes.iter().copied().collect();
            for ino in inodes {
                match fs.reap(ino).await {
                    Ok(()) => {
                        if fs.deferred.lock_or_abort().inodes.remove(&ino) {
                            DEFERRED_PENDING.fetch_sub(1, Ordering::Relaxed);
                        }
                        DEFERRED_FREED.fetch_add(1, Ordering::Relaxed);
                        tracing::info!("dataset {}: freed the data of removed file {ino}", fs.dataset);
                    }
                    // Retired (destroyed or going away): the next open, if
                    // any, frees what is left.
                    Err(FsError::Stale) => {
                        fs.deferred.lock_or_abort().retrying = false;
                        return;
                    }
                    Err(error) => {
                        DEFERRED_RETRIES_FAILED.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(
                            "dataset {}: freeing removed file {ino} failed again: {error}",
                            fs.dataset
                        );
                    }
                }
            }
            {
                let mut deferred = fs.deferred.lock_or_abort();
                if deferred.inodes.is_empty() {
                    deferred.retrying = false;
                    return;
                }
            }
            drop(fs);
            wait = (wait * 2).min(REAP_RETRY_MOST);
        }
    }

    /// Frees a removed file's data, then lets its number be used again.
    async fn reap(&self, ino: u64) -> FsResult<()> {
        let _entered = self.enter().await?;
        let _data = self.data_lock(ino).write().await;
        let size = match self.namespace.lock_or_abort().inodes.get(&ino) {
            Some(row) if row.nlink == 0 => row.size,
            _ => return Ok(()),
        };
        self.discard(ino, 0, size).await?;
        let gate = self.pool.enter_write(self.dataset).await;
        let mut ns = self.namespace.lock_or_abort();
        self.pool.log_namespace(&mut ns, vec![NsOp::Reaped { ino }]);
        drop(gate);
        Ok(())
    }

    /// Entries after `cookie` (0: from the start; `.` and `..` are cookies
    /// 1 and 2), at most `max` of them; `true` when the listing is complete.
    ///
    /// The namespace lock, which every READ and WRITE of the dataset takes
    /// too, is held for [`READDIR_BATCH`] entries at a time: between two
    /// batches the listing goes on from the last cookie, as a client's next
    /// READDIR would.
    pub fn readdir(&self, dir: &Handle, cred: &Cred, cookie: u64, max: usize) -> FsResult<(Vec<DirEntry>, bool)> {
        if self.is_snapshot_dir(dir) {
            return self.snapshot_dir_readdir(cookie, max);
        }
        let mut out = Vec::new();
        let mut after = cookie;
        loop {
            let ns = self.namespace.lock_or_abort();
            let dir_row = match self.dir_row(&ns, dir) {
                Ok(row) => row,
                // Removed since the last batch: what was listed stands.
                Err(_) if !out.is_empty() => return Ok((out, false)),
                Err(e) => return Err(e),
            };
            if !permits(dir_row, cred, 4) {
                return Err(FsError::Access);
            }
            let batch_end = out.len().saturating_add(READDIR_BATCH).min(max);
            let entry = |ino: u64, cookie: u64, name: &[u8]| -> Option<DirEntry> {
                let row = ns.inodes.get(&ino)?;
                Some(DirEntry {
                    cookie,
                    name: name.to_vec(),
                    fileid: self.fileid_base | ino,
                    handle: self.handle(ino, row),
                    attr: self.attr(ino, row),
                })
            };
            if after == 0 && out.len() < batch_end {
                out.extend(entry(dir.ino, 1, b"."));
                after = 1;
            }
            if after == 1 && out.len() < batch_end {
                out.extend(entry(dir_row.parent, 2, b".."));
                after = 2;
            }
            let Some(entries) = ns.dirs.get(&dir.ino) else {
                return Ok((out, true));
            };
            // Nothing follows the largest cookie (a client's, never one
            // given out: cookies count up from 3).
            let Some(first) = after.max(2).checked_add(1) else {
                return Ok((out, true));
            };
            let mut exhausted = true;
            for (cookie, (name, ino)) in entries.entries.range(first..) {
                if out.len() >= batch_end {
                    exhausted = false;
                    break;
                }
                out.extend(entry(*ino, *cookie, name));
                after = *cookie;
            }
            if exhausted {
                return Ok((out, true));
            }
            if out.len() >= max {
                return Ok((out, false));
            }
            drop(ns);
        }
    }

    pub fn fsstat(&self) -> FsStat {
        let (total, used) = self
            .pool
            .status()
            .iter()
            .filter(|d| d.role.holds_data())
            .fold((0, 0), |(t, u), d| (t + d.data_bytes, u + d.used_bytes));
        let mut free = total.saturating_sub(used);
        let mut total_bytes = total;
        let quota = self.quota.load(Ordering::Relaxed);
        if quota != 0 {
            total_bytes = quota;
            free = free.min(quota.saturating_sub(self.engine_used()));
        }
        let files = self.namespace.lock_or_abort().files();
        FsStat {
            total_bytes,
            free_bytes: free,
            avail_bytes: free,
            total_files: MAX_INODES,
            free_files: MAX_INODES.saturating_sub(files),
        }
    }

    /// Files and bytes (for `fs list`).
    pub fn usage(&self) -> (u64, u64) {
        (self.namespace.lock_or_abort().files(), self.engine_used())
    }
}

#[cfg(test)]
mod tests;
