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

/// The most a buffered write hands the kernel in one call, and the
/// boundary its pieces never cross (see [`write_in_pieces`]).
pub const BUFFERED_PIECE_BYTES: usize = 64 << 10;

/// Writes all of `data` at `offset` of a buffered file, in pieces that
/// never cross a [`BUFFERED_PIECE_BYTES`] boundary.
///
/// Why: ext4 on Linux 6.16 and later caches a regular file in folios as
/// large as the write that brought them in (up to 2 MiB), and every later
/// write into a large folio, however small, walks all of that folio's
/// buffer heads, once to prepare the write and once to commit it, and
/// writeback walks them again. A volume filled with 1 MiB writes leaves its
/// device file in 1 MiB folios, and each 4 KiB block the destager then
/// writes there pays for 256 buffer heads: 26-38 % of the daemon's CPU on
/// 4K random writes (BENCHMARKS.md, "NBD").
/// Pieces of 64 KiB keep folios at 16 buffer heads or fewer, for 16 system
/// calls a megabyte instead of one; only a write that brings pages into
/// the cache needs them (the caller decides: `FileDevice` asks the page
/// cache first), since a write into cached pages keeps their folios.
pub fn write_in_pieces(file: &File, data: &[u8], offset: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    for (start, end) in pieces(offset, data.len()) {
        file.write_all_at(&data[start..end], offset + start as u64)?;
    }
    Ok(())
}

/// The pieces of a write of `len` bytes at `offset`, as ranges of its
/// data: each ends at a [`BUFFERED_PIECE_BYTES`] boundary of the file or
/// at the end of the data.
fn pieces(offset: u64, len: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut done = 0;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let at = offset + done as u64;
        let to_boundary = BUFFERED_PIECE_BYTES - (at % BUFFERED_PIECE_BYTES as u64) as usize;
        let piece = (done, len.min(done + to_boundary));
        done = piece.1;
        Some(piece)
    })
}

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
    /// With `pieces`, a buffered write goes in 64 KiB pieces
    /// ([`write_in_pieces`]), and one larger than an inline write runs on
    /// the blocking pool.
    pub async fn write(
        &self,
        file: &Arc<File>,
        offset: u64,
        buf: IoBuf,
        direct: bool,
        pieces: bool,
    ) -> (IoBuf, io::Result<()>) {
        if let Some(result) = self.write_now(file, offset, buf.payload(), direct, pieces) {
            return (buf, result);
        }
        if !direct && pieces {
            // Larger than an inline write: the same pieces, on the blocking
            // pool (io_uring would hand a buffered write to a kernel worker
            // thread all the same).
            let file = file.clone();
            let len = buf.len();
            let joined = super::blocking::run_blocking(move || {
                let result = write_in_pieces(&file, buf.payload(), offset);
                (buf, result)
            })
            .await;
            return joined.unwrap_or_else(|e| (IoBuf::new(len), Err(e)));
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
    /// done inline ([`IoEngine::writes_inline`]), in pieces with `pieces`;
    /// `None` if it is not.
    pub fn write_now(
        &self,
        file: &File,
        offset: u64,
        data: &[u8],
        direct: bool,
        pieces: bool,
    ) -> Option<io::Result<()>> {
        use std::os::unix::fs::FileExt;
        self.writes_inline(data.len(), direct).then(|| {
            if pieces {
                write_in_pieces(file, data, offset)
            } else {
                file.write_all_at(data, offset)
            }
        })
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
        let (_, res) = engine.write(&file, 0, IoBuf::copy_from(&data), false, true).await;
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
    fn buffered_writes_go_in_pieces_that_end_at_64k_boundaries() {
        let piece = BUFFERED_PIECE_BYTES;
        // Aligned and a whole number of pieces.
        let all: Vec<_> = pieces(0, 3 * piece).collect();
        assert_eq!(all, [(0, piece), (piece, 2 * piece), (2 * piece, 3 * piece)]);
        // Unaligned at both ends: the first piece runs to the boundary.
        let all: Vec<_> = pieces(piece as u64 - 4096, 4096 + piece + 100).collect();
        assert_eq!(
            all,
            [(0, 4096), (4096, 4096 + piece), (4096 + piece, 4096 + piece + 100)]
        );
        // Small writes are one piece; nothing for an empty one.
        assert_eq!(pieces(8192, 4096).collect::<Vec<_>>(), [(0, 4096)]);
        assert_eq!(pieces(8192, 0).count(), 0);
    }

    #[tokio::test]
    async fn writes_in_pieces_land_whole_inline_and_on_the_blocking_pool() {
        for choice in [EngineChoice::Threads, EngineChoice::IoUring] {
            let Ok(engine) = IoEngine::select(choice) else {
                continue;
            };
            let file = Arc::new(tempfile::tempfile().unwrap());
            file.set_len(4 << 20).unwrap();
            // One inline (under 1 MiB), one larger than an inline write;
            // both start and end off a piece boundary.
            for (offset, len) in [(12_345u64, 300_000usize), (1 << 20, INLINE_WRITE_MAX + 70_001)] {
                let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ offset as u8).collect();
                let (_, res) = engine.write(&file, offset, IoBuf::copy_from(&data), false, true).await;
                res.unwrap();
                let mut back = vec![0u8; len];
                use std::os::unix::fs::FileExt;
                file.read_exact_at(&mut back, offset).unwrap();
                assert!(
                    back == data,
                    "{} engine: {len} bytes at {offset} read back different",
                    engine.name()
                );
            }
        }
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
