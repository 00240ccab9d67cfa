//! The pread/pwrite engine: blocking system calls on tokio's blocking pool,
//! which grows with load by itself (no thread-count knob to tune).
//!
//! Page-cache hits do not need a thread hop: for buffered files a read first
//! tries `preadv2(RWF_NOWAIT)` inline on the calling task, which returns at
//! once with the cached bytes or EAGAIN, and only what was not cached goes to
//! the pool. Buffered writes can do the same with `pwritev2(RWF_NOWAIT)`;
//! whether they should is a measured decision recorded in docs/DEVICES.md and
//! in [`ThreadsConfig::default`]. fdatasync always goes to the pool.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use super::blocking::run_blocking;
use super::IoBuf;

/// Fast-path switches of the threads engine. Not a user knob: the defaults
/// are the measured best; the benchmark flips them to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadsConfig {
    /// Try `preadv2(RWF_NOWAIT)` inline before going to the pool (buffered only).
    pub nowait_reads: bool,
    /// Try `pwritev2(RWF_NOWAIT)` inline before going to the pool (buffered only).
    pub nowait_writes: bool,
}

impl Default for ThreadsConfig {
    fn default() -> Self {
        // NOWAIT reads measure 5-7x the IOPS of a pool hop on page-cache
        // hits. NOWAIT writes stay off: ext4 refuses them (EOPNOTSUPP), so
        // they gain nothing there (docs/DEVICES.md).
        ThreadsConfig {
            nowait_reads: true,
            nowait_writes: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ThreadsEngine {
    config: ThreadsConfig,
    /// Whether the file system takes RWF_NOWAIT reads / writes: unknown
    /// until the first try; "no" after EOPNOTSUPP/EINVAL/ENOSYS (ext4, for
    /// one, refuses buffered NOWAIT writes), and then we stop trying.
    nowait_reads: Arc<AtomicU8>,
    nowait_writes: Arc<AtomicU8>,
}

const UNKNOWN: u8 = 0;
const SUPPORTED: u8 = 1;
const UNSUPPORTED: u8 = 2;

enum Nowait {
    /// This many bytes were transferred inline (maybe all, maybe some).
    Done(usize),
    /// Nothing could be done without blocking: use the pool.
    WouldBlock,
    Failed(io::Error),
}

impl ThreadsEngine {
    pub fn new(config: ThreadsConfig) -> Self {
        ThreadsEngine {
            config,
            nowait_reads: Arc::new(AtomicU8::new(UNKNOWN)),
            nowait_writes: Arc::new(AtomicU8::new(UNKNOWN)),
        }
    }

    pub fn config(&self) -> ThreadsConfig {
        self.config
    }

    fn nowait(&self, file: &File, offset: u64, ptr: *mut u8, len: usize, write: bool) -> Nowait {
        let support = if write { &self.nowait_writes } else { &self.nowait_reads };
        if support.load(Ordering::Relaxed) == UNSUPPORTED {
            return Nowait::WouldBlock;
        }
        let iov = libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        };
        let offset = offset as libc::off_t;
        loop {
            // SAFETY: `iov` describes `len` bytes of a live IoBuf payload that
            // the caller holds exclusively (for reads: mutably) for the whole
            // call; the descriptor is open (we hold the File).
            let n = unsafe {
                if write {
                    libc::pwritev2(file.as_raw_fd(), &iov, 1, offset, libc::RWF_NOWAIT)
                } else {
                    libc::preadv2(file.as_raw_fd(), &iov, 1, offset, libc::RWF_NOWAIT)
                }
            };
            if n >= 0 {
                support.store(SUPPORTED, Ordering::Relaxed);
                return if n == 0 {
                    Nowait::WouldBlock
                } else {
                    Nowait::Done(n as usize)
                };
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => {
                    support.store(SUPPORTED, Ordering::Relaxed);
                    return Nowait::WouldBlock;
                }
                Some(libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS) => {
                    support.store(UNSUPPORTED, Ordering::Relaxed);
                    return Nowait::WouldBlock;
                }
                _ => return Nowait::Failed(err),
            }
        }
    }

    /// Reads inline, without blocking, as much of `buf` as the page cache
    /// holds (`preadv2(RWF_NOWAIT)`); returns how many bytes that was (0 when
    /// the fast path is off, unsupported, or nothing is cached). Only for
    /// buffered files. The io_uring engine uses it too: a page-cache hit then
    /// costs one system call on the calling thread and no hand-off.
    pub fn read_cached(&self, file: &File, offset: u64, payload: &mut [u8]) -> io::Result<usize> {
        if !self.config.nowait_reads || payload.is_empty() {
            return Ok(0);
        }
        match self.nowait(file, offset, payload.as_mut_ptr(), payload.len(), false) {
            Nowait::Done(n) => Ok(n),
            Nowait::WouldBlock => Ok(0),
            Nowait::Failed(e) => Err(e),
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub async fn read(&self, file: Arc<File>, offset: u64, mut buf: IoBuf, direct: bool) -> (IoBuf, io::Result<()>) {
        let len = buf.len();
        if len == 0 {
            return (buf, Ok(()));
        }
        let mut done = 0;
        if !direct {
            match self.read_cached(&file, offset, buf.payload_mut()) {
                Ok(n) if n == len => return (buf, Ok(())),
                Ok(n) => done = n,
                Err(e) => return (buf, Err(e)),
            }
        }
        let joined = run_blocking(move || {
            let result = file.read_exact_at(&mut buf.payload_mut()[done..], offset + done as u64);
            (buf, result)
        })
        .await;
        joined.unwrap_or_else(|e| (IoBuf::new(len), Err(e)))
    }

    /// Writes all of `buf` at `offset`.
    pub async fn write(&self, file: Arc<File>, offset: u64, mut buf: IoBuf, direct: bool) -> (IoBuf, io::Result<()>) {
        let len = buf.len();
        if len == 0 {
            return (buf, Ok(()));
        }
        let mut done = 0;
        if self.config.nowait_writes && !direct {
            // The pointer is only read from (pwritev2 takes a const iovec).
            let payload = buf.payload_mut();
            match self.nowait(&file, offset, payload.as_mut_ptr(), len, true) {
                Nowait::Done(n) => done = n,
                Nowait::WouldBlock => {}
                Nowait::Failed(e) => return (buf, Err(e)),
            }
            if done == len {
                return (buf, Ok(()));
            }
        }
        let joined = run_blocking(move || {
            let result = file.write_all_at(&buf.payload()[done..], offset + done as u64);
            (buf, result)
        })
        .await;
        joined.unwrap_or_else(|e| (IoBuf::new(len), Err(e)))
    }

    /// fdatasync on the pool (it blocks for as long as the device takes).
    pub async fn fdatasync(&self, file: Arc<File>) -> io::Result<()> {
        run_blocking(move || file.sync_data()).await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engines() -> Vec<ThreadsEngine> {
        let mut engines = Vec::new();
        for nowait_reads in [false, true] {
            for nowait_writes in [false, true] {
                engines.push(ThreadsEngine::new(ThreadsConfig {
                    nowait_reads,
                    nowait_writes,
                }));
            }
        }
        engines
    }

    #[tokio::test]
    async fn round_trip_with_and_without_fast_paths() {
        for engine in engines() {
            let tmp = tempfile::tempfile().unwrap();
            tmp.set_len(1 << 20).unwrap();
            let file = Arc::new(tmp);
            let data: Vec<u8> = (0..12288u32).map(|i| (i * 7 % 256) as u8).collect();
            let (back, res) = engine.write(file.clone(), 8192, IoBuf::copy_from(&data), false).await;
            res.unwrap();
            assert_eq!(back.payload(), &data[..]);
            engine.fdatasync(file.clone()).await.unwrap();
            let (buf, res) = engine.read(file.clone(), 8192, IoBuf::new(12288), false).await;
            res.unwrap();
            assert_eq!(buf.payload(), &data[..], "{:?}", engine.config());
            // Never-written bytes of a sparse file read as zeros.
            let (buf, res) = engine.read(file.clone(), 512 * 1024, IoBuf::new(4096), false).await;
            res.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn works_without_a_runtime() {
        let engine = ThreadsEngine::new(ThreadsConfig::default());
        let tmp = tempfile::tempfile().unwrap();
        tmp.set_len(65536).unwrap();
        let file = Arc::new(tmp);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        // block_on on a current-thread runtime still has a handle; the
        // no-runtime branch is exercised by polling the future by hand.
        let fut = engine.write(file.clone(), 0, IoBuf::copy_from(&[3u8; 4096]), false);
        let (_, res) = rt.block_on(fut);
        res.unwrap();
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut fut = std::pin::pin!(engine.read(file, 0, IoBuf::new(4096), false));
        match std::future::Future::poll(fut.as_mut(), &mut cx) {
            std::task::Poll::Ready((buf, res)) => {
                res.unwrap();
                assert!(buf.payload().iter().all(|&b| b == 3));
            }
            std::task::Poll::Pending => panic!("without a runtime the engine runs inline"),
        }
    }

    #[tokio::test]
    async fn read_past_end_is_an_error_and_returns_the_buffer() {
        let engine = ThreadsEngine::new(ThreadsConfig::default());
        let file = Arc::new(tempfile::tempfile().unwrap());
        let (buf, res) = engine.read(file, 0, IoBuf::new(4096), false).await;
        assert_eq!(buf.len(), 4096);
        assert_eq!(res.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
