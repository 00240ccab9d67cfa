//! Locks whose poisoning stops the process.
//!
//! A `Mutex` is poisoned when a thread panicked while holding it: whatever
//! it guards (the allocator's bitmaps, the log's pending records, a cache's
//! entries) may be half updated. Carrying on with it could map a block to a
//! slot that is also free, or commit a record that was never completed, so
//! the engine stops instead: the process aborts and the next start recovers
//! from the last checkpoint and the intent log, which never hold half an
//! update.
//!
//! The data path's locks are also ranked ([`rank`]): the order in which
//! they may be taken is checked in debug builds and unit tests.

pub mod rank;
pub use rank::{Held, Rank, Ranked};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Instant;

/// `lock_or_abort` for the engine's mutexes.
pub trait LockOrAbort<T> {
    /// Locks the mutex; if a thread panicked while holding it, says so and
    /// aborts the process.
    fn lock_or_abort(&self) -> MutexGuard<'_, T>;
}

impl<T> LockOrAbort<T> for Mutex<T> {
    fn lock_or_abort(&self) -> MutexGuard<'_, T> {
        match self.lock() {
            Ok(guard) => guard,
            Err(_) => poisoned(),
        }
    }
}

/// A mutex shared by every volume's writes (the pool's allocator, the
/// log's pending records) that counts how often a thread found it held and
/// how long such threads waited: the `strata_pool_*_lock_waits_total`
/// metrics, which say on a given machine whether the lock is worth
/// splitting.
#[derive(Debug, Default)]
pub struct WatchedMutex<T> {
    mutex: Mutex<T>,
    waits: AtomicU64,
    waited_nanos: AtomicU64,
}

impl<T> WatchedMutex<T> {
    pub fn new(value: T) -> Self {
        WatchedMutex {
            mutex: Mutex::new(value),
            waits: AtomicU64::new(0),
            waited_nanos: AtomicU64::new(0),
        }
    }

    /// Locks like [`LockOrAbort::lock_or_abort`]; an uncontended lock costs
    /// one `try_lock`, a contended one also two clock reads.
    pub fn lock_or_abort(&self) -> MutexGuard<'_, T> {
        match self.mutex.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(_)) => poisoned(),
            Err(TryLockError::WouldBlock) => {
                let started = Instant::now();
                let guard = self.mutex.lock_or_abort();
                let waited = started.elapsed().as_nanos().min(u64::MAX as u128) as u64;
                self.waits.fetch_add(1, Ordering::Relaxed);
                self.waited_nanos.fetch_add(waited, Ordering::Relaxed);
                guard
            }
        }
    }

    /// Times a thread found the lock held, and their waits summed (µs).
    pub fn contention(&self) -> (u64, u64) {
        (
            self.waits.load(Ordering::Relaxed),
            self.waited_nanos.load(Ordering::Relaxed) / 1000,
        )
    }
}

#[cold]
pub(crate) fn poisoned() -> ! {
    let message = "a thread panicked while updating engine state (a poisoned lock); \
                   stopping so that the next start recovers from the intent log";
    tracing::error!("{message}");
    eprintln!("strata: {message}");
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const CHILD: &str = "STRATA_TEST_POISON_CHILD";

    #[test]
    fn an_unpoisoned_lock_is_just_a_lock() {
        let mutex = Mutex::new(1);
        *mutex.lock_or_abort() += 1;
        assert_eq!(*mutex.lock_or_abort(), 2);
    }

    /// Runs itself in a child process, which poisons a mutex and locks it:
    /// the child must die of SIGABRT, not carry on.
    #[test]
    fn a_poisoned_lock_aborts_the_process() {
        if std::env::var_os(CHILD).is_some() {
            let mutex = Arc::new(Mutex::new(0u32));
            let other = mutex.clone();
            let _ = std::thread::spawn(move || {
                let _guard = other.lock().unwrap();
                panic!("poisoning on purpose");
            })
            .join();
            let _guard = mutex.lock_or_abort();
            // Not reached: `lock` aborts.
            std::process::exit(0);
        }
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sync::tests::a_poisoned_lock_aborts_the_process",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(output.status.signal(), Some(libc::SIGABRT), "{output:?}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("poisoned lock"));
    }

    #[test]
    fn a_watched_mutex_counts_only_the_waits() {
        let mutex = Arc::new(WatchedMutex::new(0u32));
        *mutex.lock_or_abort() += 1;
        assert_eq!(mutex.contention(), (0, 0), "an uncontended lock is no wait");
        let guard = mutex.lock_or_abort();
        let other = mutex.clone();
        let waiter = std::thread::spawn(move || *other.lock_or_abort() += 1);
        // Held until the other thread has certainly found it held (it
        // counts its wait once it has the lock).
        std::thread::sleep(std::time::Duration::from_millis(200));
        drop(guard);
        waiter.join().unwrap();
        let (waits, micros) = mutex.contention();
        assert_eq!(waits, 1);
        assert!(micros > 0, "a wait of {micros} µs");
        assert_eq!(*mutex.lock_or_abort(), 2);
    }
}
