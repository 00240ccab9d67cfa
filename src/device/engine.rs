//! The I/O engine behind a [`FileDevice`](super::FileDevice): io_uring when
//! the kernel allows it, a pread/pwrite engine on tokio's blocking pool
//! otherwise. Both are variants of one enum (as in Firecracker's block
//! device), chosen once when a device is opened, and both move the caller's
//! [`IoBuf`] into the engine and hand it back with the result.

use std::fs::File;
use std::io;
use std::sync::{Arc, Once};

use super::threads::{ThreadsConfig, ThreadsEngine};
use super::uring::UringEngine;
use super::IoBuf;

/// Which engine to use. `Auto` honours the `STRATA_IO_ENGINE` environment
/// variable (`io_uring` or `threads`) and otherwise picks io_uring when it
/// probes fine, the threads engine when it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    #[default]
    Auto,
    IoUring,
    Threads,
}

impl EngineChoice {
    /// The environment variable that forces an engine for `Auto`.
    pub const ENV_VAR: &'static str = "STRATA_IO_ENGINE";

    /// Parses `auto`, `io_uring` (or `uring`) and `threads`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(EngineChoice::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(EngineChoice::IoUring),
            "threads" | "thread" | "pread" => Ok(EngineChoice::Threads),
            other => Err(format!(
                "unknown I/O engine '{other}': expected auto, io_uring or threads"
            )),
        }
    }

    /// The choice `STRATA_IO_ENGINE` asks for (`Auto` when it is unset).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(Self::ENV_VAR) {
            Ok(value) => Self::parse(&value).map_err(|e| format!("{}: {e}", Self::ENV_VAR)),
            Err(_) => Ok(EngineChoice::Auto),
        }
    }
}

/// Largest buffered write done inline by the calling thread.
pub const INLINE_WRITE_MAX: usize = 1 << 20;

/// An I/O engine. Cloning is cheap (the io_uring variant shares one ring
/// thread per process).
///
/// The io_uring variant carries a threads engine too, for its one measured
/// weak spot: page-cache hits. A buffered read first tries
/// `preadv2(RWF_NOWAIT)` inline on the calling task (about twice the IOPS
/// of a trip through the ring thread when the data is cached, see
/// docs/DEVICES.md); only what is not cached goes to the ring.
#[derive(Clone)]
pub enum IoEngine {
    IoUring(Arc<UringEngine>, ThreadsEngine),
    Threads(ThreadsEngine),
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl IoEngine {
    /// Resolves a choice to a running engine.
    ///
    /// `Auto` reads `STRATA_IO_ENGINE`; without it, io_uring if it probes
    /// fine (measured faster, see docs/DEVICES.md), else threads with one
    /// warning per process. An explicit `IoUring` (argument or environment)
    /// that cannot start is an error rather than a silent fallback, so a
    /// forced engine is really the one being tested.
    pub fn select(choice: EngineChoice) -> io::Result<IoEngine> {
        let choice = match choice {
            EngineChoice::Auto => {
                EngineChoice::from_env().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
            }
            other => other,
        };
        match choice {
            EngineChoice::Threads => Ok(IoEngine::threads()),
            EngineChoice::IoUring => UringEngine::shared()
                .map(IoEngine::io_uring)
                .map_err(|e| io::Error::new(io::ErrorKind::Unsupported, format!("io_uring unavailable: {e}"))),
            EngineChoice::Auto => match UringEngine::shared() {
                Ok(engine) => Ok(IoEngine::io_uring(engine)),
                Err(reason) => {
                    static WARN: Once = Once::new();
                    WARN.call_once(|| {
                        tracing::warn!("io_uring unavailable ({reason}); using the pread/pwrite thread engine")
                    });
                    Ok(IoEngine::threads())
                }
            },
        }
    }

    /// An io_uring engine on `ring` (with its buffered-read helper).
    pub fn io_uring(ring: Arc<UringEngine>) -> IoEngine {
        IoEngine::IoUring(ring, ThreadsEngine::new(ThreadsConfig::default()))
    }

    /// The threads engine with its measured default configuration.
    pub fn threads() -> IoEngine {
        IoEngine::Threads(ThreadsEngine::new(ThreadsConfig::default()))
    }

    /// Whether io_uring works in this process (probed once).
    pub fn io_uring_available() -> bool {
        UringEngine::shared().is_ok()
    }

    pub fn name(&self) -> &'static str {
        match self {
            IoEngine::IoUring(..) => "io_uring",
            IoEngine::Threads(_) => "threads",
        }
    }

    /// Reads `buf.len()` bytes at `offset` into the buffer. `direct` says the
    /// file was opened with O_DIRECT (the threads engine then skips its
    /// page-cache fast path).
    pub async fn read(&self, file: &Arc<File>, offset: u64, buf: IoBuf, direct: bool) -> (IoBuf, io::Result<()>) {
        match self {
            IoEngine::IoUring(ring, helper) => {
                let mut buf = buf;
                let mut done = 0;
                if !direct {
                    match helper.read_cached(file, offset, buf.payload_mut()) {
                        Ok(n) if n == buf.len() => return (buf, Ok(())),
                        Ok(n) => done = n,
                        Err(e) => return (buf, Err(e)),
                    }
                }
                ring.read_rest(file.clone(), offset, buf, done).await
            }
            IoEngine::Threads(engine) => engine.read(file.clone(), offset, buf, direct).await,
        }
    }

    /// Writes the whole buffer at `offset`.
    ///
    /// Buffered writes up to [`INLINE_WRITE_MAX`] are done inline with
    /// `pwrite`: on a page-cache file they are a memory copy, cheaper than
    /// any hand-off (io_uring punts buffered writes to kernel worker threads,
    /// which cost a wake-up per write). Like nbdkit's worker threads, this
    /// can block the calling thread while the kernel throttles dirty pages.
    pub async fn write(&self, file: &Arc<File>, offset: u64, buf: IoBuf, direct: bool) -> (IoBuf, io::Result<()>) {
        if let Some(result) = self.write_now(file, offset, buf.payload(), direct) {
            return (buf, result);
        }
        match self {
            IoEngine::IoUring(ring, _) => ring.write(file.clone(), offset, buf).await,
            IoEngine::Threads(engine) => engine.write(file.clone(), offset, buf, direct).await,
        }
    }

    /// Fills `dst` from `offset` if the page cache holds all of it (buffered
    /// files only, `preadv2(RWF_NOWAIT)`), without blocking: `Ok(false)`
    /// when it does not (some of `dst` may then be written).
    pub fn read_cached_now(&self, file: &File, offset: u64, dst: &mut [u8], direct: bool) -> io::Result<bool> {
        if direct {
            return Ok(false);
        }
        let helper = match self {
            IoEngine::IoUring(_, helper) | IoEngine::Threads(helper) => helper,
        };
        let mut done = 0;
        while done < dst.len() {
            match helper.read_cached(file, offset + done as u64, &mut dst[done..])? {
                0 => return Ok(false),
                n => done += n,
            }
        }
        Ok(true)
    }

    /// Writes `data` at `offset` on the calling thread if this write is one
    /// done inline ([`IoEngine::writes_inline`]); `None` if it is not.
    pub fn write_now(&self, file: &File, offset: u64, data: &[u8], direct: bool) -> Option<io::Result<()>> {
        use std::os::unix::fs::FileExt;
        self.writes_inline(data.len(), direct)
            .then(|| file.write_all_at(data, offset))
    }

    /// Whether a write of `len` bytes is done inline by the calling thread
    /// (a buffered write up to [`INLINE_WRITE_MAX`]).
    pub fn writes_inline(&self, len: usize, direct: bool) -> bool {
        !direct && len <= INLINE_WRITE_MAX
    }

    /// Makes completed writes in `[offset, offset + len)` durable: a ranged
    /// fdatasync through io_uring (a length no `u32` holds, or 0, is the
    /// whole file); the thread engine has no ranged fdatasync system call
    /// to use and syncs the whole file.
    pub async fn sync_data_range(&self, file: &Arc<File>, offset: u64, len: u64) -> io::Result<()> {
        match self {
            IoEngine::IoUring(ring, _) => match u32::try_from(len) {
                Ok(len) if len > 0 => ring.fdatasync_range(file.clone(), offset, len).await,
                _ => ring.fdatasync(file.clone()).await,
            },
            IoEngine::Threads(engine) => engine.fdatasync(file.clone()).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn parse_choices() {
        assert_eq!(EngineChoice::parse("io_uring"), Ok(EngineChoice::IoUring));
        assert_eq!(EngineChoice::parse(" Threads "), Ok(EngineChoice::Threads));
        assert_eq!(EngineChoice::parse(""), Ok(EngineChoice::Auto));
        assert!(EngineChoice::parse("spdk").is_err());
    }

    #[test]
    fn explicit_threads_engine_is_threads() {
        let engine = IoEngine::select(EngineChoice::Threads).expect("threads engine always starts");
        assert_eq!(engine.name(), "threads");
    }

    #[tokio::test]
    async fn io_uring_reads_cached_data_inline_and_the_rest_through_the_ring() {
        let Ok(engine) = IoEngine::select(EngineChoice::IoUring) else {
            return;
        };
        let tmp = tempfile::tempfile().unwrap();
        tmp.set_len(1 << 20).unwrap();
        let file = Arc::new(tmp);
        let data: Vec<u8> = (0..65536u32).map(|i| (i % 253) as u8).collect();
        let (_, res) = engine.write(&file, 0, IoBuf::copy_from(&data), false).await;
        res.unwrap();
        // Cached: served inline. Then a read spanning cached and (after
        // dropping the cache) uncached pages still returns the right bytes.
        let (buf, res) = engine.read(&file, 4096, IoBuf::new(8192), false).await;
        res.unwrap();
        assert_eq!(buf.payload(), &data[4096..12288]);
        engine.sync_data_range(&file, 0, u64::MAX).await.unwrap();
        // SAFETY: posix_fadvise takes no pointers.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 32768, 0, libc::POSIX_FADV_DONTNEED) };
        let (buf, res) = engine.read(&file, 16384, IoBuf::new(49152), false).await;
        res.unwrap();
        assert_eq!(buf.payload(), &data[16384..]);
    }

    #[test]
    fn explicit_uring_matches_probe() {
        match IoEngine::select(EngineChoice::IoUring) {
            Ok(engine) => {
                assert_eq!(engine.name(), "io_uring");
                assert!(IoEngine::io_uring_available());
            }
            Err(e) => {
                assert_eq!(e.kind(), io::ErrorKind::Unsupported);
                assert!(!IoEngine::io_uring_available());
            }
        }
    }
}
