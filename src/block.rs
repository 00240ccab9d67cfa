//! The block-device contract: what a block frontend (NBD, iSCSI) asks of
//! whatever serves a volume, and what the storage engine's thin volumes
//! ([`crate::pool::volume::EngineVolume`]) provide. It sits below both, so
//! the engine does not import the frontends' layer ([`crate::volume`]) and
//! that layer can sit above the pool it uses.

use std::future::Future;
use std::pin::Pin;

/// A boxed future, so that [`BlockDevice`] stays object safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Sector size every request offset and length must be a multiple of.
pub const SECTOR_BYTES: u32 = 512;
/// Largest single read or write the volume accepts (also advertised to clients).
pub const MAX_REQUEST_BYTES: u32 = 32 << 20;

/// What a device can do. Declared once; NBD transmission flags and SCSI VPD
/// and mode pages are all derived from this one description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub can_flush: bool,
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_zero: bool,
    /// WRITE_ZEROES can report "not fast" instead of writing zeros slowly.
    pub can_fast_zero: bool,
    pub can_cache: bool,
    pub can_block_status: bool,
    pub read_only: bool,
    pub rotational: bool,
    /// An acknowledged write may sit in volatile memory until a flush.
    pub volatile_write_cache: bool,
    /// A flush through any handle makes durable every write completed through
    /// every handle of the same volume (NBD's CAN_MULTI_CONN).
    pub flush_covers_all_handles: bool,
    pub min_block_bytes: u32,
    pub preferred_block_bytes: u32,
    pub max_request_bytes: u32,
}

#[cfg(test)]
impl Capabilities {
    /// A thin, writable, non-rotational device with a volatile write cache
    /// and 4 KiB preferred blocks (unit tests of what is derived from it).
    pub(crate) fn thin_for_tests() -> Self {
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
            volatile_write_cache: true,
            flush_covers_all_handles: true,
            min_block_bytes: 512,
            preferred_block_bytes: 4096,
            max_request_bytes: 32 << 20,
        }
    }
}

/// One run of a [`BlockDevice::block_status`] answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// No storage is allocated for this range.
    pub hole: bool,
    /// The range reads as zeros.
    pub zero: bool,
}

/// One run of a [`BlockDevice::changed_since`] answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangedRun {
    pub length: u64,
    /// The range may differ from the older snapshot (its blocks are mapped
    /// differently); false: it is the same data.
    pub changed: bool,
}

/// How WRITE_ZEROES may be carried out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The range may be deallocated (punched) instead of written.
    pub may_trim: bool,
    /// Fail with [`BlockError::NotFast`] rather than write zeros slowly.
    pub fast_only: bool,
    pub fua: bool,
}

/// Errors a block request can end with. Each frontend maps these to its wire
/// codes in exactly one place (NBD: `frontend::nbd::proto::errno_for`).
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("request [{offset}, +{length}) is beyond the end of the volume ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("request offset {offset} or length {length} is not a multiple of {alignment} bytes")]
    Misaligned { offset: u64, length: u64, alignment: u32 },
    #[error("request of {length} bytes exceeds the maximum of {max} bytes")]
    TooLarge { length: u64, max: u32 },
    #[error("no space left (in the pool, or on the file system under its devices)")]
    NoSpace,
    #[error("zeroing cannot be done quickly")]
    NotFast,
    #[error("operation not supported: {0}")]
    NotSupported(&'static str),
    #[error("volume is read-only")]
    ReadOnly,
    #[error("checksum mismatch reading offset {offset}")]
    Checksum { offset: u64 },
    #[error("volume has been deleted")]
    Gone,
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub type BlockResult<T> = Result<T, BlockError>;

pub use crate::device::IoBuf;

/// The block-device contract. Every method may complete asynchronously; a
/// frontend may have many calls in flight on one device and they complete in
/// any order. Callers (the [`crate::volume::ServedVolume`]) have already checked ranges and
/// alignment; the engine asserts them again (a bug above must not reach the
/// blocks of another volume).
///
/// Durability: a `write` with `fua` is durable when its future completes; a
/// `flush` makes durable every write that completed before the flush began.
pub trait BlockDevice: Send + Sync {
    fn capabilities(&self) -> Capabilities;
    fn size_bytes(&self) -> u64;
    /// Fills `buf.payload()` with the bytes at `offset`. Never-written ranges read as zeros.
    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, BlockResult<()>)>;
    fn write(&self, offset: u64, data: IoBuf, fua: bool) -> BoxFuture<'_, BlockResult<()>>;
    fn flush(&self) -> BoxFuture<'_, BlockResult<()>>;
    /// Deallocates the range; it reads back as zeros afterwards.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> BoxFuture<'_, BlockResult<()>>;
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>>;
    /// Prefetches the range into cache; a hint with no visible effect.
    fn cache(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<()>>;
    /// Describes allocation from `offset`; the extents cover at least one byte
    /// and at most `length` bytes.
    fn block_status(&self, offset: u64, length: u64) -> BoxFuture<'_, BlockResult<Vec<Extent>>>;
    /// Changes the size. Growing exposes zeros.
    fn resize(&self, new_size_bytes: u64) -> BlockResult<()>;

    /// For a snapshot: which parts of `offset..offset + length` changed
    /// since `older`, an older snapshot of the same volume (by engine id).
    /// The runs cover at least one byte and at most `length` bytes. Others
    /// do not track changes.
    fn changed_since(&self, _older: u32, _offset: u64, _length: u64) -> BoxFuture<'_, BlockResult<Vec<ChangedRun>>> {
        Box::pin(std::future::ready(Err(BlockError::NotSupported(
            "changed-block tracking (snapshots only)",
        ))))
    }

    /// `logbias=throughput` (true) or `latency`: where synchronous writes go
    /// first. Backings without an intent log ignore it.
    fn set_log_throughput(&self, _throughput: bool) {}

    /// Whether the space the backing draws on is running low (for the
    /// engine: the file system under the pool's sparse device files, as
    /// `pool status` warns). Called per SCSI command: must be as cheap as
    /// an atomic load, never compute anything.
    fn backing_space_low(&self) -> bool {
        false
    }
}

/// The block frontend a request came through (counted per volume and in
/// the analytics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Nbd = 0,
    Iscsi = 1,
}

pub const PROTOCOLS: [Protocol; 2] = [Protocol::Nbd, Protocol::Iscsi];

impl Protocol {
    pub const fn as_str(self) -> &'static str {
        match self {
            Protocol::Nbd => "nbd",
            Protocol::Iscsi => "iscsi",
        }
    }
}

/// The operations of the contract, as the frontends count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read = 0,
    Write = 1,
    Flush = 2,
    Trim = 3,
    WriteZeroes = 4,
    Cache = 5,
    BlockStatus = 6,
}

pub const OPS: [Op; 7] = [
    Op::Read,
    Op::Write,
    Op::Flush,
    Op::Trim,
    Op::WriteZeroes,
    Op::Cache,
    Op::BlockStatus,
];

impl Op {
    pub const fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::WriteZeroes => "write_zeroes",
            Op::Cache => "cache",
            Op::BlockStatus => "block_status",
        }
    }
}
