//! The NFSv3 server (RFC 1813), with its MOUNT protocol and a minimal
//! portmapper on the same TCP port: ONC RPC record marking and XDR by
//! hand, AUTH_SYS and AUTH_NONE, calls run concurrently and answered out
//! of order. Each procedure's arguments are decoded into a typed call
//! first (no file system needed, so the fuzz target runs the decoders
//! alone), then executed against the [`crate::fs::FileSystem`] of the
//! export the file handle names (docs/NFS.md).

pub mod drc;
pub mod fuzzing;
pub mod mount;
pub mod nfs3;
pub mod portmap;
pub mod rpc;
pub mod server;
pub mod xdr;

#[cfg(test)]
mod tests;

pub const NFS_PROGRAM: u32 = 100003;
pub const NFS_VERSION: u32 = 3;
pub const MOUNT_PROGRAM: u32 = 100005;
pub const MOUNT_VERSION: u32 = 3;
pub const PORTMAP_PROGRAM: u32 = 100000;
pub const PORTMAP_VERSION: u32 = 2;

/// Why a procedure's arguments were not turned into a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ArgsError {
    /// A procedure number the program does not have: PROC_UNAVAIL.
    #[error("no such procedure")]
    ProcUnavail,
    /// Arguments that do not decode: GARBAGE_ARGS.
    #[error("garbage arguments: {0}")]
    Garbage(#[from] xdr::XdrError),
}
