//! A device on a regular file or a block device.
//!
//! O_DIRECT policy ([`DirectIo::Auto`], the default): block devices are
//! opened with O_DIRECT, regular files are buffered. A file-backed pool runs
//! on a file system whose page cache can hold far more of the hot data than
//! the pool's own read cache (64 MiB by default); bypassing it would make
//! every re-read of hot data that the read cache does not hold a device
//! read, and buffered writes coalesce in the page cache until a flush. A
//! block device is the real medium, usually dedicated to us: the page cache
//! would double-cache what the pool caches itself and hide the device's true
//! latency from the tiering decisions. Durability does not depend on the
//! choice: the contract promises nothing before `flush`, and `flush` is
//! fdatasync in both modes.
//!
//! If an O_DIRECT open (or the first O_DIRECT read) fails with EINVAL, the
//! file system does not support it; the device falls back to buffered I/O
//! and says so in the log.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::blocking::run_blocking;
use super::engine::{EngineChoice, IoEngine};
use super::mapped::Mapping;
use super::{
    check_request, BackingSpace, BoxFuture, Device, DeviceError, DeviceInfo, DeviceResult, IoBuf, StickyError,
};

/// `BLKGETSIZE64 = _IOR(0x12, 114, size_t)`: device size in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `BLKDISCARD = _IO(0x12, 119)`: discard a `[start, length]` byte range.
const BLKDISCARD: libc::c_ulong = 0x1277;

/// Whether to bypass the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// O_DIRECT for block devices, buffered for regular files.
    #[default]
    Auto,
    /// O_DIRECT (falls back to buffered where unsupported, with a warning).
    On,
    /// Always buffered.
    Off,
}

/// How to open a [`FileDevice`].
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    pub direct_io: DirectIo,
    pub engine: EngineChoice,
    /// Open read-only: reads work, writes, flushes and discards fail.
    pub read_only: bool,
    /// Take an exclusive `flock` so a second opener (another server, or a
    /// second pool in this one) is refused instead of corrupting the device.
    pub lock: bool,
    /// How long to keep retrying a lock held by someone else before
    /// refusing. A process killed with kill -9 may keep its devices' files
    /// referenced for a moment after it has been reaped (io_uring tears its
    /// ring down, and drops the files its requests held, asynchronously),
    /// so a restart right after a crash must not be refused for that.
    pub lock_wait: std::time::Duration,
    /// Overrides the rotational flag detected from sysfs.
    pub rotational: Option<bool>,
    /// Which requests of a buffered file go through a mapping of it
    /// ([`super::mapped`]); O_DIRECT devices are never mapped.
    pub mapped_io: MappedIo,
}

/// Which requests of a buffered file device go through a `MAP_SHARED`
/// mapping of it (docs/DEVICES.md, "Mapped reads and writes"): a read of
/// cached pages is copied and checksummed in one pass, a small write of
/// cached pages that would wait for another thread's `pwrite` is a memory
/// copy. `strata serve --mapped-io` sets the process's default
/// ([`set_default_mapped_io`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MappedIo {
    /// Reads and writes.
    #[default]
    On,
    /// Reads only: the mapping is read-only and every write is a `pwrite`.
    Reads,
    /// No mapping: every request goes to the I/O engine.
    Off,
}

impl MappedIo {
    /// Every choice, in the order `--mapped-io` lists them.
    pub const ALL: [MappedIo; 3] = [MappedIo::On, MappedIo::Reads, MappedIo::Off];

    pub fn name(self) -> &'static str {
        match self {
            MappedIo::On => "on",
            MappedIo::Reads => "reads",
            MappedIo::Off => "off",
        }
    }

    /// Parses `on`, `reads` or `off`.
    pub fn parse(text: &str) -> Result<MappedIo, String> {
        MappedIo::ALL
            .into_iter()
            .find(|choice| choice.name() == text.trim())
            .ok_or_else(|| format!("{text:?} is not on, reads or off"))
    }
}

/// The process's [`MappedIo`], which [`DeviceOptions::default`] takes.
static DEFAULT_MAPPED_IO: std::sync::OnceLock<MappedIo> = std::sync::OnceLock::new();

/// Sets the process's [`MappedIo`] (`strata serve --mapped-io`), before any
/// device opens; the first call wins. Returns the choice in force.
pub fn set_default_mapped_io(choice: MappedIo) -> MappedIo {
    *DEFAULT_MAPPED_IO.get_or_init(|| choice)
}

/// The process's [`MappedIo`]: what [`set_default_mapped_io`] set, else on.
pub fn default_mapped_io() -> MappedIo {
    DEFAULT_MAPPED_IO.get().copied().unwrap_or_default()
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            direct_io: DirectIo::Auto,
            engine: EngineChoice::Auto,
            read_only: false,
            lock: true,
            lock_wait: LOCK_WAIT,
            rotational: None,
            mapped_io: default_mapped_io(),
        }
    }
}

/// A regular file or a block device served by an [`IoEngine`].
pub struct FileDevice {
    info: DeviceInfo,
    file: Arc<File>,
    /// A mapping of a buffered file, for reads of cached pages with their
    /// checksums in one pass ([`Device::read_now_summed`]) and for writes
    /// of whole cached pages without the inode lock (`write_now`).
    mapping: Option<Mapping>,
    /// Inline `pwrite`s of this file under way (see `write_now`).
    pwrites: AtomicUsize,
    engine: IoEngine,
    is_block_device: bool,
    read_only: bool,
    sticky: StickyError,
}

impl std::fmt::Debug for FileDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDevice").field("info", &self.info).finish()
    }
}

fn io_error(device: &str, offset: u64, source: io::Error) -> DeviceError {
    DeviceError::Io {
        device: device.to_string(),
        offset,
        source,
    }
}

/// Opens `path` with or without O_DIRECT.
fn open_raw(path: &Path, direct: bool, read_only: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(!read_only);
    let mut flags = libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    options.custom_flags(flags);
    options.open(path)
}

/// Opens with O_DIRECT if wanted, and proves it works with one aligned read
/// of `probe_bytes` at offset 0; EINVAL from either step means the file
/// system cannot do O_DIRECT, and the file is reopened buffered. Returns the
/// file and whether it is in O_DIRECT mode.
fn open_direct_or_buffered(
    path: &Path,
    want_direct: bool,
    read_only: bool,
    probe_bytes: impl Fn(&File) -> usize,
    open: &dyn Fn(&Path, bool, bool) -> io::Result<File>,
) -> io::Result<(File, bool)> {
    if !want_direct {
        return Ok((open(path, false, read_only)?, false));
    }
    let reason = match open(path, true, read_only) {
        Ok(file) => {
            let mut probe = IoBuf::new(probe_bytes(&file));
            match file.read_at(probe.payload_mut(), 0) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => format!("an O_DIRECT read failed: {e}"),
                _ => return Ok((file, true)),
            }
        }
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => format!("O_DIRECT open failed: {e}"),
        Err(e) => return Err(e),
    };
    tracing::warn!(
        "{}: {reason}; the file system does not support O_DIRECT, using buffered I/O",
        path.display()
    );
    Ok((open(path, false, read_only)?, false))
}

/// Logical block size for O_DIRECT: the device's sector size, or for a file
/// the file system's direct-I/O offset alignment (statx STATX_DIOALIGN,
/// Linux 6.1+), else 4096 which every file system accepts.
fn direct_block_bytes(file: &File, is_block_device: bool) -> u32 {
    let fd = file.as_raw_fd();
    if is_block_device {
        let mut sector: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int to the pointer we pass.
        let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut sector as *mut libc::c_int) };
        if rc == 0 && sector >= 512 && (sector as u32).is_power_of_two() {
            return sector as u32;
        }
        return 4096;
    }
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid NUL-terminated empty string used with
    // AT_EMPTY_PATH on an open descriptor; statx fills `stx`.
    let rc = unsafe { libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        let align = stx.stx_dio_offset_align;
        if (512..=4096).contains(&align)
            && align.is_power_of_two()
            && stx.stx_dio_mem_align as usize <= super::BUFFER_ALIGN
        {
            return align;
        }
    }
    4096
}

fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 to the pointer we pass.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Reads `queue/rotational` from sysfs for the disk holding `dev`
/// (a partition's own directory has none, so its parent is tried too).
fn detect_rotational(dev: u64) -> bool {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    for suffix in ["queue/rotational", "../queue/rotational"] {
        let path = format!("/sys/dev/block/{major}:{minor}/{suffix}");
        if let Ok(text) = std::fs::read_to_string(&path) {
            return text.trim() == "1";
        }
    }
    false
}

/// Default for [`DeviceOptions::lock_wait`].
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Takes an exclusive `flock` on `file`, retrying for up to `wait` while
/// someone else holds it (see [`DeviceOptions::lock_wait`]).
fn take_lock(file: &File, path: &Path, wait: std::time::Duration) -> io::Result<()> {
    let started = std::time::Instant::now();
    let mut logged = false;
    loop {
        // SAFETY: flock on a descriptor we own; no pointers.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            if logged {
                tracing::info!(device = %path.display(), waited_ms = started.elapsed().as_millis() as u64, "device lock acquired");
            }
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(err);
        }
        if started.elapsed() >= wait {
            return Err(io::Error::new(
                io::ErrorKind::ResourceBusy,
                "device is in use (locked by another open of it, in this or another process)",
            ));
        }
        if !logged {
            tracing::warn!(device = %path.display(), wait_s = wait.as_secs_f64(), "device is locked; waiting in case its holder is a process that just exited");
            logged = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

impl FileDevice {
    /// Opens a regular file or a block device with the engine that
    /// `options.engine` selects (see [`IoEngine::select`]).
    pub fn open(path: impl AsRef<Path>, options: &DeviceOptions) -> DeviceResult<FileDevice> {
        let path = path.as_ref();
        let engine = IoEngine::select(options.engine).map_err(|e| io_error(&path.display().to_string(), 0, e))?;
        Self::open_with_engine(path, options, engine)
    }

    /// Opens with a given engine (`options.engine` is ignored): for
    /// benchmarks comparing engine configurations.
    pub fn open_with_engine(
        path: impl AsRef<Path>,
        options: &DeviceOptions,
        engine: IoEngine,
    ) -> DeviceResult<FileDevice> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let err = |source: io::Error| io_error(&name, 0, source);
        let meta = std::fs::metadata(path).map_err(err)?;
        let is_block_device = meta.file_type().is_block_device();
        if !is_block_device && !meta.file_type().is_file() {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file or a block device",
            )));
        }
        let want_direct = match options.direct_io {
            DirectIo::On => true,
            DirectIo::Off => false,
            DirectIo::Auto => is_block_device,
        };
        let (file, direct_io) = open_direct_or_buffered(
            path,
            want_direct,
            options.read_only,
            |file| direct_block_bytes(file, is_block_device) as usize,
            &open_raw,
        )
        .map_err(err)?;
        if options.lock {
            take_lock(&file, path, options.lock_wait).map_err(err)?;
        }
        let block_bytes = if direct_io {
            direct_block_bytes(&file, is_block_device)
        } else {
            512
        };
        let raw_size = if is_block_device {
            block_device_size(&file).map_err(err)?
        } else {
            file.metadata().map_err(err)?.len()
        };
        let size_bytes = raw_size - raw_size % u64::from(block_bytes);
        let rotational = options
            .rotational
            .unwrap_or_else(|| detect_rotational(if is_block_device { meta.rdev() } else { meta.dev() }));
        let info = DeviceInfo {
            name,
            size_bytes,
            block_bytes,
            direct_io,
            rotational,
            engine: engine.name(),
            regular_file: !is_block_device,
        };
        tracing::debug!(?info, "opened device");
        let file = Arc::new(file);
        let mapping = match options.mapped_io {
            _ if direct_io => None,
            MappedIo::Off => None,
            MappedIo::Reads => Mapping::new(&file, size_bytes, false),
            MappedIo::On => Mapping::new(&file, size_bytes, !options.read_only),
        };
        Ok(FileDevice {
            info,
            file,
            mapping,
            pwrites: AtomicUsize::new(0),
            engine,
            is_block_device,
            read_only: options.read_only,
            sticky: StickyError::new(),
        })
    }

    pub fn is_block_device(&self) -> bool {
        self.is_block_device
    }

    pub fn engine(&self) -> &IoEngine {
        &self.engine
    }

    /// Which requests go through a mapping of the file: what
    /// [`DeviceOptions::mapped_io`] asked for, less what the device cannot
    /// do (O_DIRECT or read-only, or a mapping the kernel refused).
    pub fn mapped_io(&self) -> MappedIo {
        match &self.mapping {
            None => MappedIo::Off,
            Some(mapping) if mapping.writable() => MappedIo::On,
            Some(_) => MappedIo::Reads,
        }
    }

    /// True once a write or flush has failed (see [`DeviceError::Failed`]).
    pub fn has_failed(&self) -> bool {
        self.sticky.is_failed()
    }

    /// Whether a buffered write of `len` bytes at `offset` goes to the
    /// kernel in pieces (`engine::write_in_pieces`): when it crosses a piece
    /// boundary and some page of it is not in the page cache, so that the
    /// folios it brings in stay small. A write into cached pages keeps
    /// their folios whatever its size, and goes whole (one system call).
    fn in_pieces(&self, offset: u64, len: usize) -> bool {
        let piece = super::engine::BUFFERED_PIECE_BYTES as u64;
        !self.info.direct_io
            && offset % piece + len as u64 > piece
            && !self.mapping.as_ref().is_some_and(|mapping| mapping.holds(offset, len))
    }

    fn check_writable(&self, offset: u64) -> DeviceResult<()> {
        if self.read_only {
            return Err(io_error(
                &self.info.name,
                offset,
                io::Error::new(io::ErrorKind::PermissionDenied, "device is open read-only"),
            ));
        }
        self.sticky.check(&self.info.name)
    }

    /// A failed write or flush: sticky (see [`StickyError`]), except a
    /// write the file system refused for lack of space (ENOSPC, EDQUOT).
    /// That write was refused when it was issued, so no completed write
    /// was lost: it fails alone, and writes that need no new space (and
    /// any write once space is freed) go on. A flush failure is always
    /// sticky, whatever its errno.
    fn fail(&self, what: &str, offset: u64, source: io::Error) -> DeviceError {
        let no_space = matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT));
        if !(no_space && what == "write") {
            self.sticky.set(format!("{what} at offset {offset} failed: {source}"));
        }
        io_error(&self.info.name, offset, source)
    }
}

/// Opens a file device and returns it as the trait object the pool keeps.
pub fn open_device(path: impl AsRef<Path>, options: &DeviceOptions) -> DeviceResult<Arc<dyn Device>> {
    Ok(Arc::new(FileDevice::open(path, options)?))
}

/// Creates a sparse file of `size_bytes` for a file-backed device. Refuses
/// to overwrite anything that exists.
pub fn create_file(path: impl AsRef<Path>, size_bytes: u64) -> DeviceResult<()> {
    let path = path.as_ref();
    let err = |source: io::Error| io_error(&path.display().to_string(), 0, source);
    // Owner-only from the start: a device file holds every volume's data.
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(err)?;
    if let Err(e) = file.set_len(size_bytes) {
        drop(file);
        let _ = std::fs::remove_file(path);
        return Err(err(e));
    }
    Ok(())
}

impl Drop for FileDevice {
    /// Releases the `flock` now. Closing the descriptor would release it
    /// too, but only when the last reference to the open file goes away,
    /// and io_uring may hold one for a moment after its last completion: a
    /// reopen right after the drop would find the device "in use".
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor we own; no pointers. Unlocking a
        // file we never locked is harmless.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Device for FileDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) = check_request(&self.info, offset, buf.len() as u64) {
                return (buf, Err(e));
            }
            let (buf, result) = self.engine.read(&self.file, offset, buf, self.info.direct_io).await;
            (buf, result.map_err(|e| io_error(&self.info.name, offset, e)))
        })
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            if let Err(e) =
                check_request(&self.info, offset, buf.len() as u64).and_then(|()| self.check_writable(offset))
            {
                return (buf, Err(e));
            }
            let pieces = self.in_pieces(offset, buf.len());
            let (buf, result) = self
                .engine
                .write(&self.file, offset, buf, self.info.direct_io, pieces)
                .await;
            (buf, result.map_err(|e| self.fail("write", offset, e)))
        })
    }

    fn write_now(&self, offset: u64, data: &[u8]) -> Option<DeviceResult<()>> {
        if !self.engine.writes_inline(data.len(), self.info.direct_io) {
            return None;
        }
        if let Err(e) = check_request(&self.info, offset, data.len() as u64).and_then(|()| self.check_writable(offset))
        {
            return Some(Err(e));
        }
        // A write that would wait for another thread's `pwrite` of this
        // file (ext4 serialises them on the inode lock) copies into the
        // mapping instead; one that would not keeps `pwrite`, because a
        // page written through the mapping costs more when it is flushed
        // (write-protected again, a fault on the next store): with a flush
        // every millisecond (synchronous writers) that cost wins. Only
        // here, not in `write`: the pool writes volume data with
        // `write_now`, its log and metadata with `write` (see
        // `device::mapped`).
        if self.pwrites.load(Ordering::Acquire) > 0 && self.mapping.as_ref().is_some_and(|m| m.write(offset, data)) {
            return Some(Ok(()));
        }
        self.pwrites.fetch_add(1, Ordering::AcqRel);
        let pieces = self.in_pieces(offset, data.len());
        let result = self
            .engine
            .write_now(&self.file, offset, data, self.info.direct_io, pieces);
        self.pwrites.fetch_sub(1, Ordering::AcqRel);
        result.map(|result| result.map_err(|e| self.fail("write", offset, e)))
    }

    fn release_lock(&self) {
        // SAFETY: flock on a descriptor this device owns; no pointers.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }

    fn backing_space(&self) -> Option<BackingSpace> {
        if self.is_block_device {
            return None;
        }
        backing_space(&self.file).ok()
    }

    fn preallocate(&self, offset: u64, length: u64) -> DeviceResult<()> {
        if self.is_block_device {
            return Ok(());
        }
        check_request(&self.info, offset, length)?;
        // SAFETY: fallocate takes no pointers.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, offset as libc::off_t, length as libc::off_t) };
        if rc != 0 {
            return Err(DeviceError::Io {
                device: self.info.name.clone(),
                offset,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    fn read_now_summed(&self, offset: u64, dst: &mut [u8], sums: &mut [u32]) -> bool {
        match &self.mapping {
            Some(mapping) => {
                check_request(&self.info, offset, dst.len() as u64).is_ok() && mapping.copy_summing(offset, dst, sums)
            }
            None => false,
        }
    }

    fn read_now(&self, offset: u64, dst: &mut [u8]) -> Option<DeviceResult<()>> {
        if let Err(e) = check_request(&self.info, offset, dst.len() as u64) {
            return Some(Err(e));
        }
        match self
            .engine
            .read_cached_now(&self.file, offset, dst, self.info.direct_io)
        {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e) => Some(Err(io_error(&self.info.name, offset, e))),
        }
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        // The whole file (a range no u32 length covers is a whole fdatasync).
        self.flush_range(0, u64::MAX)
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            if self.read_only {
                // Nothing was written through this handle.
                return Ok(());
            }
            self.check_writable(offset)?;
            self.engine
                .sync_data_range(&self.file, offset, length)
                .await
                .map_err(|e| self.fail("flush", offset, e))
        })
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            check_request(&self.info, offset, length)?;
            self.check_writable(offset)?;
            if length == 0 {
                return Ok(());
            }
            let file = self.file.clone();
            let is_block_device = self.is_block_device;
            let result = run_blocking(move || discard_range(&file, is_block_device, offset, length)).await;
            match result.and_then(|r| r) {
                Ok(()) => Ok(()),
                // Discard is advisory: a file system or device without it
                // keeps the old contents, which the contract allows.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EOPNOTSUPP | libc::ENOTTY | libc::ENOSYS | libc::EINVAL)
                    ) =>
                {
                    Ok(())
                }
                Err(e) => Err(io_error(&self.info.name, offset, e)),
            }
        })
    }
}

/// The file's allocated bytes and its file system's free and total bytes,
/// through the open descriptor.
fn backing_space(file: &File) -> io::Result<BackingSpace> {
    use std::os::unix::fs::MetadataExt;
    let metadata = file.metadata()?;
    let backed_bytes = metadata.blocks() * 512;
    // SAFETY: `statvfs` is plain C data; all zeros is a valid value.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatvfs fills `stats` for a descriptor we own.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut stats) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(BackingSpace {
        backed_bytes,
        fs_free_bytes: stats.f_bavail as u64 * stats.f_frsize as u64,
        fs_size_bytes: stats.f_blocks as u64 * stats.f_frsize as u64,
        fs_id: metadata.dev(),
    })
}

fn discard_range(file: &File, is_block_device: bool, offset: u64, length: u64) -> io::Result<()> {
    let fd = file.as_raw_fd();
    let rc = if is_block_device {
        let range: [u64; 2] = [offset, length];
        // SAFETY: BLKDISCARD reads two u64 (start, length) from the pointer.
        unsafe { libc::ioctl(fd, BLKDISCARD as _, range.as_ptr()) }
    } else {
        // SAFETY: fallocate takes no pointers.
        unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                length as libc::off_t,
            )
        }
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(direct_io: DirectIo) -> DeviceOptions {
        DeviceOptions {
            direct_io,
            ..DeviceOptions::default()
        }
    }

    #[test]
    fn create_file_is_sparse_and_refuses_to_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 30).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), 1 << 30);
        assert!(meta.blocks() * 512 < 1 << 20, "the file should be sparse");
        let err = create_file(&path, 4096).unwrap_err();
        assert!(matches!(&err, DeviceError::Io { source, .. } if source.kind() == io::ErrorKind::AlreadyExists));
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            1 << 30,
            "existing file untouched"
        );
    }

    #[tokio::test]
    async fn borrowed_memory_reads_and_writes_match_the_owned_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 20).unwrap();
        let dev = FileDevice::open(&path, &options(DirectIo::Off)).unwrap();
        let data: Vec<u8> = (0..16384u32).map(|i| (i % 253) as u8).collect();
        assert!(matches!(dev.write_now(8192, &data), Some(Ok(()))));
        // What `write_now` wrote, `read` sees; what `write` wrote, `read_now` sees.
        let (buf, result) = dev.read(8192, IoBuf::new(16384)).await;
        result.unwrap();
        assert_eq!(buf.payload(), &data[..]);
        let (_, result) = dev.write(65536, IoBuf::copy_from(&data[..4096])).await;
        result.unwrap();
        let mut back = vec![0u8; 4096];
        assert!(matches!(dev.read_now(65536, &mut back), Some(Ok(()))));
        assert_eq!(back, &data[..4096]);
        // Same checks as the owned calls.
        assert!(matches!(
            dev.write_now(1 << 20, &data[..4096]),
            Some(Err(DeviceError::OutOfRange { .. }))
        ));
        assert!(matches!(
            dev.read_now(100, &mut back),
            Some(Err(DeviceError::Misaligned { .. }))
        ));
        // Larger than an inline write: the caller must use `write`.
        assert!(dev
            .write_now(0, &vec![0u8; crate::device::engine::INLINE_WRITE_MAX + 4096])
            .is_none());
    }

    #[tokio::test]
    async fn large_writes_into_uncached_pages_go_in_pieces_and_into_cached_ones_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 4 << 20).unwrap();
        let dev = FileDevice::open(&path, &options(DirectIo::Off)).unwrap();
        let piece = crate::device::engine::BUFFERED_PIECE_BYTES;
        // Within one piece: whole, cached or not.
        assert!(!dev.in_pieces(4096, piece - 4096));
        // Across a boundary of a sparse file never touched: nothing cached.
        assert!(dev.in_pieces(0, 1 << 20));
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        let (_, result) = dev.write(0, IoBuf::copy_from(&data)).await;
        result.unwrap();
        let (buf, result) = dev.read(0, IoBuf::new(1 << 20)).await;
        result.unwrap();
        assert!(buf.payload() == &data[..]);
        if dev.mapping.is_some() {
            // Just written, so cached: the next write there goes whole.
            assert!(!dev.in_pieces(0, 1 << 20));
            assert!(!dev.in_pieces(4096, 300_000));
        }
        // Direct I/O has no page cache to keep small.
        let direct = dir.path().join("direct.img");
        create_file(&direct, 4 << 20).unwrap();
        if let Ok(dev) = FileDevice::open(&direct, &options(DirectIo::On)) {
            // (On a file system without O_DIRECT the device falls back to
            // buffered I/O, and pieces again.)
            assert_eq!(dev.in_pieces(0, 1 << 20), !dev.info.direct_io);
        }
    }

    #[tokio::test]
    async fn a_write_that_would_wait_for_another_pwrite_goes_through_the_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 20).unwrap();
        let dev = FileDevice::open(&path, &options(DirectIo::Off)).unwrap();
        if dev.mapping.is_none() {
            eprintln!("no mapping on this CPU: nothing to test");
            return;
        }
        let first: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
        // Alone: pwrite (which also makes the pages resident).
        assert!(matches!(dev.write_now(8192, &first), Some(Ok(()))));
        assert_eq!(dev.pwrites.load(Ordering::Acquire), 0);
        // Another thread inside a pwrite of the file: the copy goes through
        // the mapping, and every way of reading the file sees it.
        dev.pwrites.fetch_add(1, Ordering::AcqRel);
        let second: Vec<u8> = (0..16384u32).map(|i| (i % 241) as u8 ^ 0x5a).collect();
        assert!(matches!(dev.write_now(8192, &second), Some(Ok(()))));
        dev.pwrites.fetch_sub(1, Ordering::AcqRel);
        let (buf, result) = dev.read(8192, IoBuf::new(16384)).await;
        result.unwrap();
        assert_eq!(buf.payload(), &second[..]);
        let mut back = vec![0u8; 16384];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut back, 8192)
            .unwrap();
        assert_eq!(back, second);
        dev.flush().await.unwrap();
        // Out of range is refused before either way is tried.
        dev.pwrites.fetch_add(1, Ordering::AcqRel);
        assert!(matches!(
            dev.write_now(1 << 20, &second[..4096]),
            Some(Err(DeviceError::OutOfRange { .. }))
        ));
    }

    #[test]
    fn open_refuses_directories_and_missing_paths() {
        let dir = tempfile::tempdir().unwrap();
        assert!(FileDevice::open(dir.path(), &DeviceOptions::default()).is_err());
        assert!(FileDevice::open(dir.path().join("missing"), &DeviceOptions::default()).is_err());
    }

    #[test]
    fn auto_is_buffered_for_files_and_size_rounds_down() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1_000_000).unwrap();
        let dev = FileDevice::open(&path, &options(DirectIo::Auto)).unwrap();
        assert!(!dev.info().direct_io);
        assert_eq!(dev.info().block_bytes, 512);
        assert_eq!(dev.info().size_bytes, 1_000_000 / 512 * 512);
        assert!(!dev.is_block_device());
    }

    #[test]
    fn second_open_is_refused_while_locked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 20).unwrap();
        let first = FileDevice::open(&path, &DeviceOptions::default()).unwrap();
        let quick = DeviceOptions {
            lock_wait: std::time::Duration::from_millis(100),
            ..DeviceOptions::default()
        };
        let started = std::time::Instant::now();
        let err = FileDevice::open(&path, &quick).unwrap_err();
        assert!(matches!(&err, DeviceError::Io { source, .. } if source.kind() == io::ErrorKind::ResourceBusy));
        assert!(
            started.elapsed() >= std::time::Duration::from_millis(100),
            "refused before the wait was over"
        );
        // A holder that lets go while we wait: the open succeeds.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(first);
        });
        FileDevice::open(&path, &DeviceOptions::default()).unwrap();
        releaser.join().unwrap();
    }

    #[test]
    fn einval_on_direct_open_falls_back_to_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 20).unwrap();
        let refuse_direct = |p: &Path, direct: bool, ro: bool| {
            if direct {
                Err(io::Error::from_raw_os_error(libc::EINVAL))
            } else {
                open_raw(p, false, ro)
            }
        };
        let (_, direct) = open_direct_or_buffered(&path, true, false, |_| 4096, &refuse_direct).unwrap();
        assert!(!direct);
        // Other errors are not papered over.
        let deny = |_: &Path, _: bool, _: bool| -> io::Result<File> { Err(io::Error::from_raw_os_error(libc::EACCES)) };
        assert!(open_direct_or_buffered(&path, true, false, |_| 4096, &deny).is_err());
        // A misaligned probe read is EINVAL under O_DIRECT: also a fallback
        // (stands in for a file system that accepts the flag but not the
        // I/O). The block must be allocated: reads of holes skip the check.
        std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
        match open_direct_or_buffered(&path, true, false, |_| 100, &open_raw) {
            Ok((_, direct)) => assert!(!direct, "a 100-byte O_DIRECT read cannot succeed"),
            Err(e) => panic!("fallback expected, got {e}"),
        }
    }

    #[tokio::test]
    async fn read_only_refuses_writes_without_going_sticky() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 20).unwrap();
        let opts = DeviceOptions {
            read_only: true,
            ..DeviceOptions::default()
        };
        let dev = FileDevice::open(&path, &opts).unwrap();
        let (_, res) = dev.write(0, IoBuf::new(4096)).await;
        assert!(matches!(res, Err(DeviceError::Io { .. })));
        assert!(!dev.has_failed());
        let (_, res) = dev.read(0, IoBuf::new(4096)).await;
        res.unwrap();
        dev.flush().await.unwrap();
        assert!(dev.discard(0, 4096).await.is_err());
    }

    #[tokio::test]
    async fn discard_punches_a_hole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev.img");
        create_file(&path, 1 << 20).unwrap();
        let dev = FileDevice::open(&path, &DeviceOptions::default()).unwrap();
        let (_, res) = dev.write(0, IoBuf::copy_from(&[9u8; 65536])).await;
        res.unwrap();
        dev.discard(4096, 8192).await.unwrap();
        let (buf, res) = dev.read(0, IoBuf::new(16384)).await;
        res.unwrap();
        assert!(buf.payload()[..4096].iter().all(|&b| b == 9));
        assert!(buf.payload()[4096..12288].iter().all(|&b| b == 0));
        assert!(buf.payload()[12288..].iter().all(|&b| b == 9));
        assert!(matches!(
            dev.discard(100, 512).await,
            Err(DeviceError::Misaligned { .. })
        ));
    }
}
