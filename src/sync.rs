//! Locks whose poisoning stops the process.
//!
//! A `Mutex` is poisoned when a thread panicked while holding it: whatever
//! it guards (the allocator's bitmaps, the log's pending records, a cache's
//! entries) may be half updated. Carrying on with it could map a block to a
//! slot that is also free, or commit a record that was never completed, so
//! the engine stops instead: the process aborts and the next start recovers
//! from the last checkpoint and the intent log, which never hold half an
//! update.

use std::sync::{Mutex, MutexGuard};

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
}
