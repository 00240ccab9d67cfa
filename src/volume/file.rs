//! The foundation backing: one sparse file per volume.
//!
//! Reads and writes are `pread`/`pwrite` on the file (through the kernel page
//! cache), TRIM punches holes, BLOCK_STATUS asks the file system with
//! `SEEK_DATA`/`SEEK_HOLE`. The calls run inline on the caller's task: on a
//! page-cache hit they take a few microseconds, cheaper than any hand-off to a
//! thread pool. The storage engine (pool of tiered devices, io_uring and a
//! thread-pool engine) replaces this backing behind the same trait.

use std::fs::{File, OpenOptions};
use std::future::ready;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{BlockDevice, BlockError, BlockResult, BoxFuture, Capabilities, Extent, IoBuf, ZeroFlags};

/// Upper bound on the extents one BLOCK_STATUS answer carries, so a client
/// asking about a fragmented range cannot make the reply grow without bound.
const MAX_EXTENTS_PER_STATUS: usize = 1024;
/// Zeros written per `pwrite` when the file system cannot zero a range itself.
const ZERO_WRITE_BYTES: usize = 1 << 20;

pub struct FileBacking {
    file: File,
    size_bytes: AtomicU64,
}

impl FileBacking {
    /// Creates a sparse file of `size_bytes` (refuses to overwrite one) and
    /// makes its existence durable.
    pub fn create(path: &Path, size_bytes: u64) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        file.set_len(size_bytes)?;
        file.sync_all()?;
        Ok(FileBacking {
            file,
            size_bytes: AtomicU64::new(size_bytes),
        })
    }

    /// Opens an existing volume file; its length is the volume size.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let size_bytes = file.metadata()?.len();
        Ok(FileBacking {
            file,
            size_bytes: AtomicU64::new(size_bytes),
        })
    }

    fn sync(&self) -> BlockResult<()> {
        self.file.sync_data().map_err(BlockError::from_io)
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, length: u64) -> std::io::Result<()> {
        // SAFETY: fallocate takes a valid open descriptor and plain integers;
        // it does not touch our memory.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                length as libc::off_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    fn punch_hole(&self, offset: u64, length: u64) -> BlockResult<()> {
        match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, length) {
            Ok(()) => Ok(()),
            Err(e) if is_unsupported(&e) => self.write_zero_bytes(offset, length),
            Err(e) => Err(BlockError::from_io(e)),
        }
    }

    fn write_zero_bytes(&self, offset: u64, length: u64) -> BlockResult<()> {
        let zeros = vec![0u8; ZERO_WRITE_BYTES.min(length as usize)];
        let mut done = 0u64;
        while done < length {
            let step = (length - done).min(zeros.len() as u64) as usize;
            self.file
                .write_all_at(&zeros[..step], offset + done)
                .map_err(BlockError::from_io)?;
            done += step as u64;
        }
        Ok(())
    }

    fn seek(&self, offset: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
        // SAFETY: lseek on a valid descriptor; no memory is passed.
        let rc = unsafe { libc::lseek(self.file.as_raw_fd(), offset as libc::off_t, whence) };
        if rc >= 0 {
            return Ok(Some(rc as u64));
        }
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(error)
        }
    }

    fn extents(&self, offset: u64, length: u64) -> BlockResult<Vec<Extent>> {
        let end = offset + length;
        let mut extents = Vec::new();
        let mut position = offset;
        while position < end && extents.len() < MAX_EXTENTS_PER_STATUS {
            let data_start = match self.seek(position, libc::SEEK_DATA) {
                Ok(found) => found.unwrap_or(end).min(end),
                // A file system without SEEK_DATA: report everything as data.
                Err(e) if is_unsupported(&e) => position,
                Err(e) => return Err(BlockError::from_io(e)),
            };
            if data_start > position {
                extents.push(Extent {
                    length: data_start - position,
                    hole: true,
                    zero: true,
                });
                position = data_start;
                continue;
            }
            let data_end = match self.seek(position, libc::SEEK_HOLE) {
                Ok(found) => found.unwrap_or(end).min(end),
                Err(e) if is_unsupported(&e) => end,
                Err(e) => return Err(BlockError::from_io(e)),
            };
            // SEEK_HOLE never answers with the position itself when it is in
            // data; guard anyway so the loop always advances.
            let data_end = data_end.max(position + 1).min(end);
            extents.push(Extent {
                length: data_end - position,
                hole: false,
                zero: false,
            });
            position = data_end;
        }
        Ok(extents)
    }
}

fn is_unsupported(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL)
    )
}

impl BlockDevice for FileBacking {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_zero: true,
            can_fast_zero: true,
            can_cache: true,
            can_block_status: true,
            read_only: false,
            rotational: false,
            // Acknowledged writes sit in the kernel page cache until fdatasync.
            volatile_write_cache: true,
            // One file shared by all connections: fdatasync covers every write
            // that any connection completed.
            flush_covers_all_handles: true,
            min_block_bytes: super::SECTOR_BYTES,
            preferred_block_bytes: 4096,
            max_request_bytes: super::MAX_REQUEST_BYTES,
        }
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    fn read(&self, offset: u64, mut buf: IoBuf) -> BoxFuture<'_, (IoBuf, BlockResult<()>)> {
        let result = read_fully(&self.file, buf.payload_mut(), offset);
        Box::pin(ready((buf, result)))
    }

    fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        let mut result = self
            .file
            .write_all_at(data.payload(), offset)
            .map_err(BlockError::from_io);
        if result.is_ok() && fua {
            result = self.sync();
        }
        Box::pin(ready(result))
    }

    fn flush(&self) -> BoxFuture<'_, BlockResult<()>> {
        Box::pin(ready(self.sync()))
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BoxFuture<'_, BlockResult<()>> {
        let mut result = self.punch_hole(offset, length);
        if result.is_ok() && fua {
            result = self.sync();
        }
        Box::pin(ready(result))
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>> {
        let result = if flags.may_trim {
            self.punch_hole(offset, length)
        } else {
            match self.fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, offset, length) {
                Ok(()) => Ok(()),
                Err(e) if is_unsupported(&e) && flags.fast_only => Err(BlockError::NotFast),
                Err(e) if is_unsupported(&e) => self.write_zero_bytes(offset, length),
                Err(e) => Err(BlockError::from_io(e)),
            }
        };
        let result = match result {
            Ok(()) if flags.fua => self.sync(),
            other => other,
        };
        Box::pin(ready(result))
    }

    fn cache(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<()>> {
        // SAFETY: posix_fadvise on a valid descriptor; no memory is passed.
        let rc = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                length as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        let result = if rc == 0 {
            Ok(())
        } else {
            Err(BlockError::Io(std::io::Error::from_raw_os_error(rc)))
        };
        Box::pin(ready(result))
    }

    fn block_status(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<Vec<Extent>>> {
        Box::pin(ready(self.extents(offset, length)))
    }

    fn resize(&self, new_size_bytes: u64) -> BlockResult<()> {
        self.file.set_len(new_size_bytes).map_err(BlockError::from_io)?;
        self.sync()?;
        self.size_bytes.store(new_size_bytes, Ordering::Release);
        Ok(())
    }
}

fn read_fully(file: &File, mut buf: &mut [u8], mut offset: u64) -> BlockResult<()> {
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            // Past the end of the file (cannot happen while the file has the
            // volume's length, but a short file must still read as zeros).
            Ok(0) => {
                buf.fill(0);
                return Ok(());
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BlockError::from_io(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    #[test]
    fn write_read_trim_status() {
        let dir = tempfile::tempdir().unwrap();
        let backing = FileBacking::create(&dir.path().join("v.img"), 1 << 20).unwrap();
        block_on(async {
            let (buf, r) = backing.read(0, IoBuf::with_headroom(16, 4096)).await;
            r.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 0));
            backing
                .write(65536, IoBuf::from_vec(vec![0xab; 4096]), true)
                .await
                .unwrap();
            let (buf, r) = backing.read(65536, IoBuf::with_headroom(0, 4096)).await;
            r.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 0xab));
            let extents = backing.block_status(0, 1 << 20).await.unwrap();
            assert!(extents[0].hole, "{extents:?}");
            assert!(extents.iter().any(|e| !e.hole), "{extents:?}");
            assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 1 << 20);
            backing.trim(0, 1 << 20, false).await.unwrap();
            let extents = backing.block_status(0, 1 << 20).await.unwrap();
            assert_eq!(
                extents,
                vec![Extent {
                    length: 1 << 20,
                    hole: true,
                    zero: true
                }]
            );
            let (buf, r) = backing.read(65536, IoBuf::with_headroom(0, 4096)).await;
            r.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 0));
        });
    }
}
