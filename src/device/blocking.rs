//! Blocking work (fsync, discard, the thread engine's syscalls) off the
//! async workers.

use std::io;

/// Runs a blocking closure on tokio's blocking pool (which grows with load
/// by itself), or inline when there is no runtime (a plain test thread).
pub(crate) async fn run_blocking<T, F>(f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle
            .spawn_blocking(f)
            .await
            .map_err(|e| io::Error::other(format!("blocking I/O task failed: {e}"))),
        Err(_) => Ok(f()),
    }
}
