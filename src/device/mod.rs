//! Devices: where bytes finally live. A [`Device`] is a flat array of bytes
//! (a file, a block device, a simulated disk) with asynchronous positional
//! reads and writes on owned buffers, and a flush that makes completed writes
//! durable. The pool builds tiers, chunks and the block map on top; wrappers
//! (delay, throttle, error injection) stack on any device like nbdkit filters.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;

mod blocking;
pub mod engine;
pub mod file;
pub mod mapped;
pub mod signature;
pub mod sim;
pub mod threads;
pub mod uring;
pub mod wrappers;

pub use engine::{EngineChoice, IoEngine};
pub use file::{
    create_file, default_mapped_io, open_device, set_default_mapped_io, DeviceOptions, DirectIo, FileDevice, MappedIo,
};
pub use sim::{SimConfig, SimDevice, SimRng};
pub use wrappers::{
    DelayConfig, DelayDevice, DeviceWraps, ErrorDevice, ErrorRule, IoOp, ThrottleConfig, ThrottleDevice, WrapperSpec,
};

/// A boxed future, so that [`Device`] stays object safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Alignment of every [`IoBuf`] payload: enough for O_DIRECT on any device.
pub const BUFFER_ALIGN: usize = 4096;

/// An owned, zero-initialised byte buffer whose payload starts on a
/// [`BUFFER_ALIGN`] boundary, so it can go straight to an O_DIRECT device or
/// into an io_uring submission. Buffers move into the device and come back
/// with the result, so the kernel may own them while an I/O is in flight.
///
/// `headroom` bytes directly in front of the payload are reserved for the
/// caller (the NBD frontend writes its reply header there and sends header
/// and data with no copy); devices only touch [`IoBuf::payload`].
pub struct IoBuf {
    ptr: *mut u8,
    /// Offset of the payload from `ptr`; a multiple of BUFFER_ALIGN.
    payload_offset: usize,
    headroom: usize,
    len: usize,
    layout: Layout,
    /// CRC-32C of each whole [`PIECE_BYTES`] piece of the payload, computed
    /// by [`IoBuf::read_from_summing`] as the bytes arrived; dropped by any
    /// access that could change the payload.
    piece_crcs: Option<Vec<u32>>,
}

/// The pieces [`IoBuf::piece_crcs`] covers: the pool's checksum sector.
pub const PIECE_BYTES: usize = 4096;

// SAFETY: IoBuf uniquely owns its allocation, like Box<[u8]>.
unsafe impl Send for IoBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// A zero-filled buffer with `headroom` bytes in front of `len` payload bytes.
    pub fn with_headroom(headroom: usize, len: usize) -> Self {
        let payload_offset = headroom.div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
        let total = (payload_offset + len).max(1);
        let layout = Layout::from_size_align(total, BUFFER_ALIGN).expect("buffer size overflows");
        let ptr = allocate(layout, true);
        IoBuf {
            ptr,
            payload_offset,
            headroom,
            len,
            layout,
            piece_crcs: None,
        }
    }

    /// A zero-filled buffer of `len` payload bytes.
    pub fn new(len: usize) -> Self {
        Self::with_headroom(0, len)
    }

    /// A buffer holding a copy of `bytes` (allocated without zeroing: every
    /// byte is written before anyone can read it).
    pub fn copy_from(bytes: &[u8]) -> Self {
        let len = bytes.len();
        let layout = Layout::from_size_align(len.max(1), BUFFER_ALIGN).expect("buffer size overflows");
        let ptr = allocate(layout, false);
        // SAFETY: `ptr` has room for `len` bytes and does not overlap `bytes`;
        // after the copy every payload byte is initialised (a zero-length
        // buffer exposes no bytes).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, len) };
        IoBuf {
            ptr,
            payload_offset: 0,
            headroom: 0,
            len,
            layout,
            piece_crcs: None,
        }
    }

    /// A buffer of `len` payload bytes read from `reader` (allocated without
    /// zeroing: tokio's `ReadBuf` tracks which bytes the reads have
    /// initialised, and the payload is exposed only once all of them are).
    /// A stream that ends first is `UnexpectedEof`.
    pub async fn read_from<R: tokio::io::AsyncRead + Unpin>(reader: &mut R, len: usize) -> std::io::Result<IoBuf> {
        Self::read_from_inner(reader, len, false).await
    }

    /// [`IoBuf::read_from`] that also checksums each whole
    /// [`PIECE_BYTES`] piece as soon as it has arrived (while it is still in
    /// cache, and while the rest of the payload is on its way), for
    /// [`IoBuf::piece_crcs`].
    pub async fn read_from_summing<R: tokio::io::AsyncRead + Unpin>(
        reader: &mut R,
        len: usize,
    ) -> std::io::Result<IoBuf> {
        Self::read_from_inner(reader, len, true).await
    }

    async fn read_from_inner<R: tokio::io::AsyncRead + Unpin>(
        reader: &mut R,
        len: usize,
        sum: bool,
    ) -> std::io::Result<IoBuf> {
        let layout = Layout::from_size_align(len.max(1), BUFFER_ALIGN).expect("buffer size overflows");
        let ptr = allocate(layout, false);
        // Owns the allocation from here on (frees it on an error); exposes
        // no bytes until `len` is set below.
        let mut buf = IoBuf {
            ptr,
            payload_offset: 0,
            headroom: 0,
            len: 0,
            layout,
            piece_crcs: None,
        };
        // SAFETY: the allocation has room for `len` bytes, which
        // `MaybeUninit<u8>` allows to be uninitialised.
        let spare = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<std::mem::MaybeUninit<u8>>(), len) };
        let mut read_buf = tokio::io::ReadBuf::uninit(spare);
        let mut crcs = Vec::with_capacity(if sum { len / PIECE_BYTES } else { 0 });
        while read_buf.remaining() > 0 {
            let before = read_buf.filled().len();
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut *reader).poll_read(cx, &mut read_buf)).await?;
            if read_buf.filled().len() == before {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            if sum {
                let whole = read_buf.filled().len() / PIECE_BYTES;
                let arrived = &read_buf.filled()[crcs.len() * PIECE_BYTES..whole * PIECE_BYTES];
                crate::checksum::extend_sector_sums(arrived, &mut crcs);
            }
        }
        // Every byte is now initialised: `filled` covers all `len`.
        buf.len = len;
        if sum {
            buf.piece_crcs = Some(crcs);
        }
        Ok(buf)
    }

    /// A buffer holding a copy of `bytes` (kept for callers holding a Vec).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        Self::copy_from(&bytes)
    }

    pub fn payload(&self) -> &[u8] {
        // SAFETY: [payload_offset, payload_offset + len) lies inside the
        // allocation, and every constructor initialises those bytes before
        // `len` covers them: `with_headroom` zeroes the allocation,
        // `copy_from` copies into all of it, `read_from*` sets `len` only
        // once the reads have filled every byte; `truncate` only shortens.
        unsafe { std::slice::from_raw_parts(self.ptr.add(self.payload_offset), self.len) }
    }

    pub fn payload_mut(&mut self) -> &mut [u8] {
        self.piece_crcs = None;
        // SAFETY: as in `payload`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(self.payload_offset), self.len) }
    }

    /// The `headroom` bytes directly in front of the payload.
    pub fn headroom_mut(&mut self) -> &mut [u8] {
        // SAFETY: payload_offset >= headroom, so the range is inside the allocation.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(self.payload_offset - self.headroom), self.headroom) }
    }

    /// Bytes of headroom in front of the payload.
    pub fn headroom(&self) -> usize {
        self.headroom
    }

    /// Headroom and payload as one contiguous slice.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the range [payload_offset - headroom, payload_offset + len) is inside the allocation.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.add(self.payload_offset - self.headroom),
                self.headroom + self.len,
            )
        }
    }

    /// A copy of the payload as a Vec (for callers that need one).
    pub fn into_vec(self) -> Vec<u8> {
        self.payload().to_vec()
    }

    /// Payload length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CRC-32C of each whole [`PIECE_BYTES`] piece of the payload, in
    /// order, if the buffer was filled by [`IoBuf::read_from_summing`] and
    /// not handed out mutably since.
    pub fn piece_crcs(&self) -> Option<&[u32]> {
        self.piece_crcs.as_deref()
    }

    /// Shortens the payload to `len` bytes (never grows it).
    pub fn truncate(&mut self, len: usize) {
        self.piece_crcs = None;
        self.len = self.len.min(len);
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if !spares::keep(self.ptr, self.layout) {
            // SAFETY: ptr was allocated with exactly this layout and is freed once.
            unsafe { dealloc(self.ptr, self.layout) }
        }
    }
}

/// Large read buffers of one reader (an NBD connection, a send stream),
/// kept for its next reads: a new megabyte buffer must be zeroed (it may
/// hold anything the process freed), which costs as much as checksumming
/// it. A kept buffer holds only bytes this reader was already sent, and
/// every read fills the whole payload anyway.
pub struct ReadBuffers {
    free: std::sync::Mutex<Vec<IoBuf>>,
    /// Bytes kept at most.
    limit: usize,
}

/// Read buffers smaller than this are not kept (zeroing them is cheap).
const KEEP_READ_BUFFER_MIN_BYTES: usize = 64 << 10;

impl ReadBuffers {
    /// Keeps up to `limit` bytes of buffers.
    pub fn new(limit: usize) -> Self {
        ReadBuffers {
            free: std::sync::Mutex::new(Vec::new()),
            limit,
        }
    }

    /// A buffer for `len` payload bytes behind `headroom`: a kept one of
    /// that shape, else a new zeroed one.
    pub fn take(&self, headroom: usize, len: usize) -> IoBuf {
        if len >= KEEP_READ_BUFFER_MIN_BYTES {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(index) = free.iter().position(|b| b.len() == len && b.headroom() == headroom) {
                return free.swap_remove(index);
            }
        }
        IoBuf::with_headroom(headroom, len)
    }

    /// Keeps `buf` for a later [`ReadBuffers::take`] if it is large and
    /// there is room.
    pub fn give_back(&self, buf: IoBuf) {
        if buf.len() < KEEP_READ_BUFFER_MIN_BYTES {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let kept: usize = free.iter().map(IoBuf::len).sum();
        if kept + buf.len() <= self.limit {
            free.push(buf);
        }
    }
}

/// Memory for a buffer of `layout` (non-zero size), zero-filled if asked:
/// a kept spare of that layout ([`spares`]) or a new allocation.
fn allocate(layout: Layout, zeroed: bool) -> *mut u8 {
    if let Some(ptr) = spares::take(layout) {
        if zeroed {
            // SAFETY: the spare is an allocation of `layout.size()` bytes that nothing else uses.
            unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
        }
        return ptr;
    }
    // SAFETY: callers pass layouts of non-zero size.
    let ptr = unsafe {
        if zeroed {
            alloc_zeroed(layout)
        } else {
            std::alloc::alloc(layout)
        }
    };
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    ptr
}

/// Large buffers freed recently, kept for the next buffer of the same
/// layout. A megabyte request allocates and frees a megabyte buffer; from a
/// heap fragmented by many small ones (a full read cache) that cost
/// measurably more than the request's checksums, and a reused buffer is
/// often still in cache. A spare holds whatever its last user left there:
/// every constructor zero-fills it, overwrites it whole, or (reading from a
/// stream) exposes no byte it has not written.
mod spares {
    use std::alloc::Layout;
    use std::sync::Mutex;

    /// Buffers smaller than this go back to the allocator.
    pub const MIN_BYTES: usize = 256 << 10;
    /// Bytes of spares kept at most, process-wide.
    pub const MAX_KEPT_BYTES: usize = 64 << 20;

    /// (layout, address) of each spare; most recently freed last.
    static SPARES: Mutex<Vec<(Layout, usize)>> = Mutex::new(Vec::new());

    fn spares() -> std::sync::MutexGuard<'static, Vec<(Layout, usize)>> {
        SPARES.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    pub fn kept_bytes() -> usize {
        spares().iter().map(|(layout, _)| layout.size()).sum()
    }

    /// A kept allocation of exactly `layout`, if there is one.
    pub fn take(layout: Layout) -> Option<*mut u8> {
        if layout.size() < MIN_BYTES {
            return None;
        }
        let mut spares = spares();
        let index = spares.iter().rposition(|&(kept, _)| kept == layout)?;
        Some(spares.remove(index).1 as *mut u8)
    }

    /// Keeps the allocation `ptr` of `layout` if it is large, freeing the
    /// oldest spares to make room (what is freed now is what is wanted
    /// next); `false` if the caller must free it.
    pub fn keep(ptr: *mut u8, layout: Layout) -> bool {
        if layout.size() < MIN_BYTES || layout.size() > MAX_KEPT_BYTES {
            return false;
        }
        let mut spares = spares();
        let mut kept: usize = spares.iter().map(|(layout, _)| layout.size()).sum();
        while kept + layout.size() > MAX_KEPT_BYTES {
            let (old_layout, old) = spares.remove(0);
            kept -= old_layout.size();
            // SAFETY: a spare is an allocation of its layout that nothing uses.
            unsafe { std::alloc::dealloc(old as *mut u8, old_layout) };
        }
        spares.push((layout, ptr as usize));
        true
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoBuf")
            .field("headroom", &self.headroom)
            .field("len", &self.len)
            .finish()
    }
}

impl Default for IoBuf {
    fn default() -> Self {
        Self::new(0)
    }
}

/// Errors a device operation can end with.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{device}: I/O error at offset {offset}: {source}")]
    Io {
        device: String,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("{device}: request [{offset}, +{length}) is outside the device ({size} bytes)")]
    OutOfRange {
        device: String,
        offset: u64,
        length: u64,
        size: u64,
    },
    #[error("{device}: request at {offset} (+{length}) is not aligned to {alignment} bytes")]
    Misaligned {
        device: String,
        offset: u64,
        length: u64,
        alignment: u32,
    },
    /// An error injected by the `error` wrapper or the simulator.
    #[error("{device}: injected I/O error at offset {offset}")]
    Injected { device: String, offset: u64 },
    /// The device has failed a write or flush before; it refuses further
    /// writes until reopened (errors are sticky, so a lost write is never
    /// followed by a flush that appears to succeed).
    #[error("{device}: device failed earlier and is read-only until reopened: {reason}")]
    Failed { device: String, reason: String },
}

impl DeviceError {
    /// ENOSPC from the file system under a file-backed device.
    pub fn is_no_space(&self) -> bool {
        matches!(self, DeviceError::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

pub type DeviceResult<T> = Result<T, DeviceError>;

/// The space a file device stands on (see [`Device::backing_space`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct BackingSpace {
    /// Bytes of the file the file system has allocated.
    pub backed_bytes: u64,
    /// Free bytes of the file system (for unprivileged users, as `df`).
    pub fs_free_bytes: u64,
    /// Size of that file system.
    pub fs_size_bytes: u64,
    /// Which file system (`st_dev` of the file): devices on the same one
    /// share its free space.
    #[serde(default)]
    pub fs_id: u64,
}

/// Static facts about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// A name for messages and metrics (the path, or the wrapper stack).
    pub name: String,
    pub size_bytes: u64,
    /// Offsets and lengths of every request must be multiples of this
    /// (512 or 4096 with O_DIRECT; 512 for buffered files).
    pub block_bytes: u32,
    /// Opened with O_DIRECT (bypasses the page cache).
    pub direct_io: bool,
    /// A spinning disk (or a wrapper emulating one).
    pub rotational: bool,
    /// Which I/O engine serves it: "io_uring", "threads", "sim", ...
    pub engine: &'static str,
    /// A regular file (not a block device): writes into never-written
    /// ranges make the file system allocate blocks.
    pub regular_file: bool,
}

/// A flat array of bytes with asynchronous positional I/O.
///
/// Contract (what the pool relies on; the simulator enforces it):
/// - `read` fills `buf.payload()` with the bytes at `offset`; never-written
///   bytes read as zeros.
/// - `write` stores `buf.payload()` at `offset`. When the future completes
///   the data is visible to later reads but NOT durable: after a crash or
///   power loss it may be absent, present, or torn at sector granularity.
/// - `flush` makes every write that completed before `flush` was called
///   durable; `flush_range` at least those inside a range. A failed write or flush makes the device's error sticky
///   ([`DeviceError::Failed`]).
/// - `discard` tells the device a range is unused; afterwards it reads as
///   zeros or as its old contents (callers must not depend on which).
/// - Offsets and lengths are multiples of `info().block_bytes` and inside
///   the device; buffers come back to the caller with the result so that an
///   asynchronous engine may own them while the kernel uses them.
/// - Many calls may be in flight at once and complete in any order.
pub trait Device: Send + Sync {
    fn info(&self) -> &DeviceInfo;
    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)>;
    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)>;
    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>>;

    /// Makes durable every write that completed before the call and lies in
    /// `[offset, offset + length)`; writes elsewhere may stay volatile. A
    /// device may flush more (the default flushes everything). The log uses
    /// it: on a device that also holds data, a whole flush would write back
    /// every dirty data page with each commit of a few log blocks.
    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        let _ = (offset, length);
        self.flush()
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>>;

    /// Writes `data` at `offset` straight from the caller's memory, when
    /// this device does such a write as a plain memory copy into the page
    /// cache (a buffered file). `None` means it does not: the caller writes
    /// the same bytes with [`Device::write`] (nothing was done, or, for a
    /// mirror, only what that write does again). Same checks, errors and
    /// durability as `write`.
    fn write_now(&self, _offset: u64, _data: &[u8]) -> Option<DeviceResult<()>> {
        None
    }

    /// Fills `dst` from `offset` at once, into the caller's memory, when
    /// this device holds all of it in memory (a buffered file whose pages
    /// are cached). `None`: it cannot, and the caller reads into an owned
    /// buffer with [`Device::read`] (`dst` may have been written to).
    fn read_now(&self, _offset: u64, _dst: &mut [u8]) -> Option<DeviceResult<()>> {
        None
    }

    /// For a sparse file: how much of it the file system has allocated, and
    /// the free space of that file system (`None` for block devices and
    /// simulated ones, which have all their space).
    fn backing_space(&self) -> Option<BackingSpace> {
        None
    }

    /// Gives up the exclusive lock taken when the device was opened
    /// ([`DeviceOptions::lock`]), so that it can be opened again while this
    /// handle still exists: the pool calls it on a device it let go of
    /// (detached) and never uses again. No-op by default.
    fn release_lock(&self) {}

    /// Makes the file system under a sparse file back `[offset, +length)`
    /// now (`fallocate`), so writes there can never fail for lack of space;
    /// ranges already backed are left as they are. A no-op for block
    /// devices and simulated ones.
    fn preallocate(&self, _offset: u64, _length: u64) -> DeviceResult<()> {
        Ok(())
    }

    /// Like [`Device::read_now`] for whole 4 KiB sectors
    /// ([`crate::checksum::SUM_SECTOR_BYTES`]), and each sector's CRC-32C
    /// into `sums` (one slot per sector), computed in the same pass over the
    /// data: for a device that can do that cheaper than a read followed by
    /// checksumming (a buffered file, through a mapping of it). `false`
    /// (the default): not done, for whatever reason (`dst` and `sums` may
    /// have been written); the caller reads the usual way, which reports
    /// any error.
    fn read_now_summed(&self, _offset: u64, _dst: &mut [u8], _sums: &mut [u32]) -> bool {
        false
    }
}

/// Checks a request against the device's geometry at entry: offset and
/// length must be multiples of `block_bytes` and the range must lie inside
/// the device. Every device (and wrapper) calls this before doing anything,
/// so a bad request is an error, never a panic or a stray write.
pub fn check_request(info: &DeviceInfo, offset: u64, length: u64) -> DeviceResult<()> {
    let block = u64::from(info.block_bytes.max(1));
    if !offset.is_multiple_of(block) || !length.is_multiple_of(block) {
        return Err(DeviceError::Misaligned {
            device: info.name.clone(),
            offset,
            length,
            alignment: info.block_bytes,
        });
    }
    match offset.checked_add(length) {
        Some(end) if end <= info.size_bytes => Ok(()),
        _ => Err(DeviceError::OutOfRange {
            device: info.name.clone(),
            offset,
            length,
            size: info.size_bytes,
        }),
    }
}

/// The sticky error state every device keeps: the first failed write or
/// flush records its reason, and from then on writes and flushes fail with
/// [`DeviceError::Failed`] (reads still go through). Without it a lost write
/// could be followed by a flush that appears to succeed (the fsync-gate
/// problem: Linux reports a writeback error to one fsync only).
#[derive(Debug, Default)]
pub struct StickyError {
    reason: OnceLock<String>,
}

impl StickyError {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the first failure; later calls keep the first reason.
    pub fn set(&self, reason: impl Into<String>) {
        let _ = self.reason.set(reason.into());
    }

    pub fn is_failed(&self) -> bool {
        self.reason.get().is_some()
    }

    /// `Err(Failed)` once a failure was recorded.
    pub fn check(&self, device: &str) -> DeviceResult<()> {
        match self.reason.get() {
            None => Ok(()),
            Some(reason) => Err(DeviceError::Failed {
                device: device.to_string(),
                reason: reason.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_buffers_are_kept_by_shape_up_to_the_limit() {
        let limit = 8 << 20;
        let buffers = ReadBuffers::new(limit);
        let mut first = buffers.take(24, 1 << 20);
        assert!(first.payload().iter().all(|&b| b == 0), "a new buffer is zeroed");
        first.payload_mut()[0] = 0xA5;
        let address = first.payload().as_ptr();
        buffers.give_back(first);
        // Another shape gets a new buffer; the same shape gets the kept one.
        let other = buffers.take(16, 1 << 20);
        assert_ne!(other.payload().as_ptr(), address);
        let again = buffers.take(24, 1 << 20);
        assert_eq!(again.payload().as_ptr(), address);
        assert_eq!(again.payload()[0], 0xA5);
        // Small buffers are not kept, and no more than the limit is.
        buffers.give_back(IoBuf::with_headroom(0, 4096));
        for _ in 0..(limit >> 20) + 3 {
            buffers.give_back(IoBuf::with_headroom(0, 1 << 20));
        }
        let free = buffers.free.lock().unwrap();
        assert!(free.iter().all(|b| b.len() == 1 << 20));
        assert_eq!(free.iter().map(IoBuf::len).sum::<usize>(), limit);
    }

    #[tokio::test]
    async fn read_from_fills_the_whole_payload_across_short_reads_or_reports_eof() {
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
        // A pipe that delivers the bytes in odd-sized pieces.
        let (mut writer, mut reader) = tokio::io::duplex(1000);
        let sent = data.clone();
        let feeder = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for piece in sent.chunks(777) {
                writer.write_all(piece).await.unwrap();
            }
        });
        let buf = IoBuf::read_from(&mut reader, data.len()).await.unwrap();
        feeder.await.unwrap();
        assert_eq!(buf.payload(), &data[..]);
        assert_eq!(buf.payload().as_ptr() as usize % BUFFER_ALIGN, 0);
        // The stream ends 1 byte short.
        let mut short = &data[..4095];
        let error = IoBuf::read_from(&mut short, 4096).await.expect_err("EOF");
        assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof);
        let mut empty: &[u8] = &[];
        assert!(IoBuf::read_from(&mut empty, 0).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn large_buffers_are_reused_and_never_show_what_they_held() {
        // A size no other test uses, so the spare found is this test's own.
        let len = (3 << 20) + 7 * BUFFER_ALIGN;
        let mut first = IoBuf::new(len);
        first.payload_mut().fill(0xEE);
        let address = first.payload().as_ptr();
        drop(first);
        // A zero-filled buffer of that size reuses it, zeroed.
        let zeroed = IoBuf::new(len);
        assert_eq!(zeroed.payload().as_ptr(), address, "the spare is reused");
        assert!(zeroed.payload().iter().all(|&b| b == 0));
        drop(zeroed);
        // A copy or a read from a stream gets it too, holding only the new bytes.
        let data: Vec<u8> = (0..len as u32).map(|i| (i % 199) as u8).collect();
        let copied = IoBuf::copy_from(&data);
        assert_eq!(copied.payload().as_ptr(), address);
        assert_eq!(copied.payload(), &data[..]);
        drop(copied);
        let read = IoBuf::read_from(&mut &data[..], len).await.unwrap();
        assert_eq!(read.payload().as_ptr(), address);
        assert_eq!(read.payload(), &data[..]);
        drop(read);
        // A short stream fails without exposing anything, and the spare stays usable.
        assert!(IoBuf::read_from(&mut &data[..10], len).await.is_err());
        assert!(IoBuf::new(len).payload().iter().all(|&b| b == 0));
        // Small buffers are not kept; no more than the limit is, the newest
        // spares first: one of another size freed last is kept.
        assert!(spares::take(Layout::from_size_align(4096, BUFFER_ALIGN).unwrap()).is_none());
        let many: Vec<IoBuf> = (0..(spares::MAX_KEPT_BYTES / len) + 2)
            .map(|_| IoBuf::new(len))
            .collect();
        drop(many);
        let other_len = len + BUFFER_ALIGN;
        let other = IoBuf::new(other_len);
        let other_address = other.payload().as_ptr();
        drop(other);
        let kept = spares::kept_bytes();
        assert!(kept <= spares::MAX_KEPT_BYTES, "{kept} bytes kept");
        assert_eq!(IoBuf::new(other_len).payload().as_ptr(), other_address);
    }

    #[tokio::test]
    async fn read_from_summing_checksums_each_whole_piece_as_it_arrives() {
        // 4 whole pieces and a partial one, delivered in pieces that never
        // line up with them.
        let data: Vec<u8> = (0..4 * PIECE_BYTES as u32 + 1000)
            .map(|i| (i * 13 % 253) as u8)
            .collect();
        let (mut writer, mut reader) = tokio::io::duplex(1500);
        let sent = data.clone();
        let feeder = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for piece in sent.chunks(1111) {
                writer.write_all(piece).await.unwrap();
            }
        });
        let mut buf = IoBuf::read_from_summing(&mut reader, data.len()).await.unwrap();
        feeder.await.unwrap();
        assert_eq!(buf.payload(), &data[..]);
        let expected: Vec<u32> = data.chunks_exact(PIECE_BYTES).map(crate::checksum::crc32c).collect();
        assert_eq!(expected.len(), 4);
        assert_eq!(buf.piece_crcs(), Some(&expected[..]));
        // Anything that may change the payload drops them.
        let _ = buf.payload_mut();
        assert_eq!(buf.piece_crcs(), None);
        let mut again = IoBuf::read_from_summing(&mut &data[..], data.len()).await.unwrap();
        assert_eq!(again.piece_crcs(), Some(&expected[..]));
        again.truncate(PIECE_BYTES);
        assert_eq!(again.piece_crcs(), None);
        // Plain reads and other constructors carry none.
        assert_eq!(
            IoBuf::read_from(&mut &data[..], data.len()).await.unwrap().piece_crcs(),
            None
        );
        assert_eq!(IoBuf::copy_from(&data).piece_crcs(), None);
    }

    #[test]
    fn alignment_and_headroom() {
        for headroom in [0, 16, 28, 4096, 5000] {
            let mut buf = IoBuf::with_headroom(headroom, 8192);
            assert_eq!(buf.payload().as_ptr() as usize % BUFFER_ALIGN, 0);
            assert_eq!(buf.headroom_mut().len(), headroom);
            buf.headroom_mut().fill(1);
            buf.payload_mut().fill(2);
            let bytes = buf.as_bytes();
            assert_eq!(bytes.len(), headroom + 8192);
            assert!(bytes[..headroom].iter().all(|&b| b == 1));
            assert!(bytes[headroom..].iter().all(|&b| b == 2));
        }
        let empty = IoBuf::new(0);
        assert!(empty.is_empty());
        assert_eq!(IoBuf::copy_from(b"abc").payload(), b"abc");
    }
}
