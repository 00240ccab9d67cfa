//! Lock ranks: the order in which the data path takes its locks, checked.
//!
//! Every lock of the data path has a [`Rank`] (docs/LOCKING.md is the same
//! list with the reasons). A lock may be waited
//! for only while every lock its holder holds ranks before it; two locks of
//! one rank only in the order of their ordinals (stripes by index, gate
//! shards by number, barriers by volume id). Two holders that keep this
//! rule cannot wait for each other in a cycle, so the data path cannot
//! deadlock on its own locks.
//!
//! Locks are wrapped in [`Ranked`], whose guards ([`Held`]) record what is
//! held. In builds with debug assertions, and in the crate's own unit tests
//! (which CI runs in release), each wait for a lock is checked against what
//! the same holder holds, and a wrong order panics naming both locks. In
//! other builds `Ranked` is the bare lock and `Held` the bare guard.
//!
//! *The holder* is the tokio task that takes the lock, or the thread where
//! no task runs (a `block_on`, a plain thread): a tokio guard held across
//! an `.await` moves between threads with its task, and a task's id stays
//! the same wherever it runs (`tokio::task::try_id`). A future polled inside
//! another's poll (`block_on` under `block_in_place`) counts as its task,
//! which is right: the task waits for it with its locks held. A try-lock
//! never waits, so it is not checked (a write takes the barrier after its
//! stripes that way), only recorded as held.
//!
//! One limit: sub-futures of one task polled concurrently (`join!`,
//! `select!`, a test polling a future by hand) would count as one holder,
//! so one of them waiting for a lock the other holds would be reported
//! although the other may go on. The engine does not run lock-taking
//! futures concurrently within a task; a test that does wraps each in
//! [`separate`], which makes it a holder of its own.

#[cfg(any(debug_assertions, test))]
use std::collections::HashMap;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, RwLockReadGuard, RwLockWriteGuard};
use std::task::{Context, Poll};

use super::{poisoned, LockOrAbort, WatchedMutex};

/// The data path's locks, outermost first: a lock is waited for only while
/// every lock held ranks before it (or, where [`Rank::sorted`], is of the
/// same rank with a smaller ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// `Pool::making_log_room`: the one caller that makes log room, which
    /// destages every volume and checkpoints under it.
    MakingLogRoom,
    /// `EngineVolume::barrier`: a snapshot's exclusive hold of a volume;
    /// several in volume-id order (one snapshot of many volumes).
    Barrier,
    /// `EngineVolume::placement`: destage and moves shared, snapshot
    /// deletion, rollback and promotion exclusive.
    Placement,
    /// `EngineVolume::stripes`: 1024 per volume, taken in index order.
    Stripes,
    /// The stripes of the other open engines of a volume's family, taken
    /// by a shared block's move while it holds its own volume's.
    FamilyStripes,
    /// `Pool::checkpointing`: one metadata checkpoint at a time.
    Checkpointing,
    /// `Pool::gates`: one shard per change; a checkpoint or scrub closes
    /// all 64 in order.
    Gate,
    /// `Pool::releasing`: a commit shared, a checkpoint exclusive.
    Releasing,
    /// `Log::commit_lock`: the group commit's one writer.
    CommitLock,
    /// `Pool::data_flush`: one flush of the data devices at a time.
    DataFlush,
    /// `Pool::page_copy`: every change of who maps a shared slot.
    PageCopy,
    /// `Pool::snapshots`: the snapshot registry.
    Snapshots,
    /// `Pool::open_engines`: open volumes and snapshot views.
    OpenEngines,
    /// `WriteCache::volumes`: the cache's per-volume parts.
    CacheVolumes,
    /// `VolumeCache::state`: one volume's cached sectors.
    VolumeCache,
    /// `RamTier::free`: the RAM tier's free slots.
    RamFree,
    /// `RamTier::shadow`: the RAM tier's slot states (debug builds).
    RamShadow,
    /// `Pool::allocator`: slots and chunks on the devices.
    Allocator,
    /// `Log::pending`: records appended and not yet committed.
    LogPending,
    /// `PageCache::shards`: the block-map and checksum page caches.
    PageCache,
    /// `Pool::suspect`: chunks whose checksums a crash left untrusted.
    Suspect,
    /// `Pool::destroyed`: destroyed volumes whose pages await a checkpoint.
    Destroyed,
}

impl Rank {
    /// Whether several locks of this rank may be held at once, taken in
    /// the order of their ordinals.
    pub fn sorted(self) -> bool {
        matches!(
            self,
            Rank::Barrier | Rank::Placement | Rank::Stripes | Rank::FamilyStripes | Rank::Gate | Rank::PageCache
        )
    }
}

/// A lock with its rank (and, for a [`Rank::sorted`] rank, its ordinal
/// within it).
#[derive(Debug)]
pub struct Ranked<L> {
    lock: L,
    #[cfg(any(debug_assertions, test))]
    rank: Rank,
    #[cfg(any(debug_assertions, test))]
    ordinal: u64,
}

/// A guard of a [`Ranked`] lock: while it lives its lock counts as held by
/// the task (or thread) that took it.
#[must_use = "a lock is released when its guard is dropped"]
pub struct Held<G> {
    guard: G,
    _token: Token,
}

impl<G: Deref> Deref for Held<G> {
    type Target = G::Target;

    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: DerefMut> DerefMut for Held<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

impl<G: std::fmt::Debug> std::fmt::Debug for Held<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.guard.fmt(f)
    }
}

impl<L> Ranked<L> {
    /// `lock` at `rank`; `ordinal` orders locks of one sorted rank.
    pub const fn new(rank: Rank, ordinal: u64, lock: L) -> Self {
        #[cfg(not(any(debug_assertions, test)))]
        let _ = (rank, ordinal);
        Ranked {
            lock,
            #[cfg(any(debug_assertions, test))]
            rank,
            #[cfg(any(debug_assertions, test))]
            ordinal,
        }
    }

    /// The bare lock (its guards are not recorded).
    pub fn inner(&self) -> &L {
        &self.lock
    }

    /// Checks and records a wait for the lock at `rank` (the lock's own
    /// if `None`), taken at `at`.
    #[cfg_attr(not(any(debug_assertions, test)), allow(unused_variables))]
    fn wait(&self, rank: Option<Rank>, at: &'static Location<'static>) -> Token {
        #[cfg(any(debug_assertions, test))]
        return check::waiting(rank.unwrap_or(self.rank), self.ordinal, at);
        #[cfg(not(any(debug_assertions, test)))]
        Token::default()
    }

    /// Records the lock as held, taken at `at` without a wait.
    #[cfg_attr(not(any(debug_assertions, test)), allow(unused_variables))]
    fn taken<G>(&self, guard: G, at: &'static Location<'static>) -> Held<G> {
        Held {
            guard,
            #[cfg(any(debug_assertions, test))]
            _token: check::taken(self.rank, self.ordinal, at),
            #[cfg(not(any(debug_assertions, test)))]
            _token: Token::default(),
        }
    }
}

/// A guard for a lock its wait recorded already.
fn held<G>(token: Token, guard: G) -> Held<G> {
    Held { guard, _token: token }
}

// The async acquisitions are plain functions returning a future so that
// `#[track_caller]` names the caller's line (it does not apply to an
// `async fn`).
impl<T> Ranked<tokio::sync::RwLock<T>> {
    #[track_caller]
    pub fn read(&self) -> impl Future<Output = Held<tokio::sync::RwLockReadGuard<'_, T>>> {
        let at = Location::caller();
        async move {
            let token = self.wait(None, at);
            held(token, self.lock.read().await)
        }
    }

    #[track_caller]
    pub fn write(&self) -> impl Future<Output = Held<tokio::sync::RwLockWriteGuard<'_, T>>> {
        self.write_at_rank(None, Location::caller())
    }

    /// [`Self::write`], checked at `rank` rather than the lock's own (a
    /// lock that one caller takes in a documented later place).
    #[track_caller]
    pub fn write_at(&self, rank: Rank) -> impl Future<Output = Held<tokio::sync::RwLockWriteGuard<'_, T>>> {
        self.write_at_rank(Some(rank), Location::caller())
    }

    async fn write_at_rank(
        &self,
        rank: Option<Rank>,
        at: &'static Location<'static>,
    ) -> Held<tokio::sync::RwLockWriteGuard<'_, T>> {
        let token = self.wait(rank, at);
        held(token, self.lock.write().await)
    }

    #[track_caller]
    pub fn try_read(&self) -> Result<Held<tokio::sync::RwLockReadGuard<'_, T>>, tokio::sync::TryLockError> {
        let guard = self.lock.try_read()?;
        Ok(self.taken(guard, Location::caller()))
    }

    #[track_caller]
    pub fn try_write(&self) -> Result<Held<tokio::sync::RwLockWriteGuard<'_, T>>, tokio::sync::TryLockError> {
        let guard = self.lock.try_write()?;
        Ok(self.taken(guard, Location::caller()))
    }
}

impl<T> Ranked<tokio::sync::Mutex<T>> {
    #[track_caller]
    pub fn lock(&self) -> impl Future<Output = Held<tokio::sync::MutexGuard<'_, T>>> {
        let at = Location::caller();
        async move {
            let token = self.wait(None, at);
            held(token, self.lock.lock().await)
        }
    }

    #[track_caller]
    pub fn try_lock(&self) -> Result<Held<tokio::sync::MutexGuard<'_, T>>, tokio::sync::TryLockError> {
        let guard = self.lock.try_lock()?;
        Ok(self.taken(guard, Location::caller()))
    }
}

impl<T> Ranked<Mutex<T>> {
    /// [`LockOrAbort::lock_or_abort`], ranked.
    #[track_caller]
    pub fn lock_or_abort(&self) -> Held<MutexGuard<'_, T>> {
        let token = self.wait(None, Location::caller());
        held(token, self.lock.lock_or_abort())
    }
}

impl<T> Ranked<WatchedMutex<T>> {
    /// [`WatchedMutex::lock_or_abort`], ranked.
    #[track_caller]
    pub fn lock_or_abort(&self) -> Held<MutexGuard<'_, T>> {
        let token = self.wait(None, Location::caller());
        held(token, self.lock.lock_or_abort())
    }

    /// See [`WatchedMutex::contention`].
    pub fn contention(&self) -> (u64, u64) {
        self.lock.contention()
    }
}

impl<T> Ranked<std::sync::RwLock<T>> {
    /// Read-locks; a poisoned lock aborts the process (as `lock_or_abort`).
    #[track_caller]
    pub fn read_or_abort(&self) -> Held<RwLockReadGuard<'_, T>> {
        let token = self.wait(None, Location::caller());
        held(token, self.lock.read().unwrap_or_else(|_| poisoned()))
    }

    /// Write-locks; a poisoned lock aborts the process.
    #[track_caller]
    pub fn write_or_abort(&self) -> Held<RwLockWriteGuard<'_, T>> {
        let token = self.wait(None, Location::caller());
        held(token, self.lock.write().unwrap_or_else(|_| poisoned()))
    }
}

/// Makes `future` a holder of its own while it runs: for futures one task
/// polls concurrently (`join!`, or a test polling one by hand while it
/// holds locks), whose waits are not each other's.
pub fn separate<F: Future>(future: F) -> Separate<F> {
    Separate {
        future: Box::pin(future),
        #[cfg(any(debug_assertions, test))]
        id: check::new_scope(),
    }
}

/// See [`separate`].
pub struct Separate<F> {
    future: Pin<Box<F>>,
    #[cfg(any(debug_assertions, test))]
    id: u64,
}

impl<F: Future> Future for Separate<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        #[cfg(any(debug_assertions, test))]
        let _scope = check::enter_scope(self.id);
        self.future.as_mut().poll(cx)
    }
}

/// What a guard records: its entry in its holder's list (nothing when the
/// check is not compiled in).
#[derive(Default)]
struct Token {
    #[cfg(any(debug_assertions, test))]
    entry: Option<(Holder, u64)>,
}

#[cfg(any(debug_assertions, test))]
impl Drop for Token {
    fn drop(&mut self) {
        if let Some((holder, serial)) = self.entry.take() {
            check::released(holder, serial);
        }
    }
}

/// Who holds a lock: a tokio task, or a thread outside any task.
#[cfg(any(debug_assertions, test))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Holder {
    Task(tokio::task::Id),
    Thread(std::thread::ThreadId),
    /// A future made a holder of its own by [`separate`].
    Separate(u64),
}

#[cfg(any(debug_assertions, test))]
mod check {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A lock held: its rank, ordinal and the serial number its guard
    /// releases it by.
    #[derive(Clone, Copy)]
    struct Entry {
        rank: Rank,
        ordinal: u64,
        serial: u64,
        at: &'static Location<'static>,
    }

    /// Every holder's locks. One map for the process: a task's entries
    /// must be found from whichever thread polls it next.
    static HELD: Mutex<Option<HashMap<Holder, Vec<Entry>>>> = Mutex::new(None);
    static SERIAL: AtomicU64 = AtomicU64::new(1);

    std::thread_local! {
        /// The [`separate`] future being polled on this thread, if any.
        static SCOPE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    }

    pub(super) fn new_scope() -> u64 {
        SERIAL.fetch_add(1, Ordering::Relaxed)
    }

    /// Makes scope `id` the holder on this thread until dropped.
    pub(super) fn enter_scope(id: u64) -> ScopeGuard {
        ScopeGuard(SCOPE.with(|scope| scope.replace(Some(id))))
    }

    pub(super) struct ScopeGuard(Option<u64>);

    impl Drop for ScopeGuard {
        fn drop(&mut self) {
            SCOPE.with(|scope| scope.set(self.0));
        }
    }

    fn holder() -> Holder {
        if let Some(id) = SCOPE.with(|scope| scope.get()) {
            return Holder::Separate(id);
        }
        match tokio::task::try_id() {
            Some(id) => Holder::Task(id),
            None => Holder::Thread(std::thread::current().id()),
        }
    }

    fn with_held<R>(f: impl FnOnce(&mut HashMap<Holder, Vec<Entry>>) -> R) -> R {
        // Never poisoned by the check itself (it panics outside the lock).
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        f(held.get_or_insert_with(HashMap::new))
    }

    fn describe(rank: Rank, ordinal: u64, at: &Location<'_>) -> String {
        if rank.sorted() {
            format!("{rank:?} #{ordinal} ({at})")
        } else {
            format!("{rank:?} ({at})")
        }
    }

    /// About to wait for a lock of `rank`: panics if its holder holds one
    /// it must not wait under, else records it (the wait then holds it).
    pub(super) fn waiting(rank: Rank, ordinal: u64, at: &'static Location<'static>) -> Token {
        let holder = holder();
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let conflict = with_held(|held| {
            let list = held.entry(holder).or_default();
            let conflict = list
                .iter()
                .find(|e| e.rank > rank || (e.rank == rank && !(rank.sorted() && e.ordinal < ordinal)))
                .copied();
            if conflict.is_none() {
                list.push(Entry {
                    rank,
                    ordinal,
                    serial,
                    at,
                });
            } else if list.is_empty() {
                held.remove(&holder);
            }
            conflict
        });
        if let Some(e) = conflict {
            panic!(
                "lock order violated: waiting for {} while holding {} (see docs/LOCKING.md)",
                describe(rank, ordinal, at),
                describe(e.rank, e.ordinal, e.at),
            );
        }
        Token {
            entry: Some((holder, serial)),
        }
    }

    /// A lock of `rank` taken without waiting: recorded, not checked.
    pub(super) fn taken(rank: Rank, ordinal: u64, at: &'static Location<'static>) -> Token {
        let holder = holder();
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            rank,
            ordinal,
            serial,
            at,
        };
        with_held(|held| held.entry(holder).or_default().push(entry));
        Token {
            entry: Some((holder, serial)),
        }
    }

    pub(super) fn released(holder: Holder, serial: u64) {
        with_held(|held| {
            if let Some(list) = held.get_mut(&holder) {
                list.retain(|e| e.serial != serial);
                if list.is_empty() {
                    held.remove(&holder);
                }
            }
        });
    }

    /// The ranks the current task or thread holds (tests).
    #[cfg(test)]
    pub(crate) fn held_ranks() -> Vec<Rank> {
        let holder = holder();
        with_held(|held| {
            held.get(&holder)
                .map_or_else(Vec::new, |l| l.iter().map(|e| e.rank).collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locks_taken_in_rank_order_are_recorded_and_released() {
        let outer = Ranked::new(Rank::PageCopy, 0, Mutex::new(()));
        let inner = Ranked::new(Rank::Allocator, 0, Mutex::new(1));
        {
            let _a = outer.lock_or_abort();
            let b = inner.lock_or_abort();
            assert_eq!(*b, 1);
            assert_eq!(check::held_ranks(), vec![Rank::PageCopy, Rank::Allocator]);
        }
        assert!(check::held_ranks().is_empty());
    }

    #[test]
    #[should_panic(expected = "lock order violated: waiting for PageCopy (src/sync/rank.rs:")]
    fn a_lock_waited_for_under_a_later_one_panics() {
        let outer = Ranked::new(Rank::PageCopy, 0, Mutex::new(()));
        let inner = Ranked::new(Rank::Allocator, 0, Mutex::new(()));
        let _b = inner.lock_or_abort();
        let _a = outer.lock_or_abort();
    }

    #[test]
    #[should_panic(expected = ") while holding LogPending (src/sync/rank.rs:")]
    fn one_unsorted_rank_is_taken_once() {
        let a = Ranked::new(Rank::LogPending, 0, Mutex::new(()));
        let b = Ranked::new(Rank::LogPending, 1, Mutex::new(()));
        let _a = a.lock_or_abort();
        let _b = b.lock_or_abort();
    }

    #[test]
    fn sorted_locks_go_in_ordinal_order_and_try_locks_are_not_checked() {
        let stripes: Vec<_> = (0..4)
            .map(|i| Ranked::new(Rank::Stripes, i, tokio::sync::RwLock::new(())))
            .collect();
        let barrier = Ranked::new(Rank::Barrier, 0, tokio::sync::RwLock::new(()));
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let _one = stripes[1].write().await;
            let _three = stripes[3].write().await;
            // Outer, but without a wait: as a write takes the barrier.
            let _barrier = barrier.try_read().unwrap();
            assert_eq!(check::held_ranks(), vec![Rank::Stripes, Rank::Stripes, Rank::Barrier]);
        });
        assert!(check::held_ranks().is_empty());
    }

    #[test]
    #[should_panic(expected = "while holding Stripes #3 (src/sync/rank.rs:")]
    fn sorted_locks_out_of_order_panic() {
        let stripes: Vec<_> = (0..4)
            .map(|i| Ranked::new(Rank::Stripes, i, tokio::sync::RwLock::new(())))
            .collect();
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let _three = stripes[3].read().await;
            let _one = stripes[1].read().await;
        });
    }

    /// A task's locks go with it from thread to thread: what it holds
    /// across an `.await` is checked wherever it is polled next, and
    /// another task on the same threads holds nothing of it.
    #[test]
    fn a_task_holds_its_locks_across_threads() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let gate = std::sync::Arc::new(Ranked::new(Rank::Gate, 0, tokio::sync::RwLock::new(())));
        let placement = std::sync::Arc::new(Ranked::new(Rank::Placement, 0, tokio::sync::RwLock::new(())));
        let result = runtime.block_on(async {
            let mut tasks = Vec::new();
            for _ in 0..8 {
                let (gate, placement) = (gate.clone(), placement.clone());
                tasks.push(tokio::spawn(async move {
                    for _ in 0..50 {
                        let _placement = placement.read().await;
                        tokio::task::yield_now().await;
                        let _gate = gate.read().await;
                        tokio::task::yield_now().await;
                        assert_eq!(check::held_ranks(), vec![Rank::Placement, Rank::Gate]);
                    }
                }));
            }
            for task in tasks {
                task.await.unwrap();
            }
            let gate = gate.clone();
            let placement = placement.clone();
            tokio::spawn(async move {
                let _gate = gate.read().await;
                tokio::task::yield_now().await;
                let _placement = placement.read().await;
            })
            .await
        });
        let panic = result.expect_err("placement waited for under the gate");
        let message = panic.into_panic();
        let message = message.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            message.contains("waiting for Placement #0 (src/sync/rank.rs:")
                && message.contains("while holding Gate #0 (src/sync/rank.rs:"),
            "{message}"
        );
    }
}
