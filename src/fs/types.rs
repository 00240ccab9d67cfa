//! What the file service's callers (the NFS frontend, the admin API) see of a
//! dataset: attributes, handles, credentials, errors. Nothing here knows NFS's
//! wire format; the frontend maps these to it.

pub use crate::meta::fsrows::{FileType, Time, FILE_BITS, MAX_FILE_SIZE, MAX_INODES, MAX_NAME, MAX_SYMLINK, ROOT_INO};

/// A file's attributes (NFS's `fattr3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub kind: FileType,
    /// Permission bits and set-id/sticky bits (the low 12 bits).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Bytes of pool space the file's data takes (its mapped blocks).
    pub used: u64,
    /// Major and minor number of a device special file.
    pub rdev: (u32, u32),
    /// The dataset's file system id.
    pub fsid: u64,
    /// The inode number.
    pub fileid: u64,
    pub atime: Time,
    pub mtime: Time,
    pub ctime: Time,
}

/// An object's size and times right before a change (NFS's `wcc_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreAttr {
    pub size: u64,
    pub mtime: Time,
    pub ctime: Time,
}

impl From<&Attr> for PreAttr {
    fn from(attr: &Attr) -> PreAttr {
        PreAttr {
            size: attr.size,
            mtime: attr.mtime,
            ctime: attr.ctime,
        }
    }
}

/// An object's attributes around one change (NFS's `wcc_data`): `before`
/// is there only when it was taken under the same lock as the change and
/// `after` (a client that sees `before` equal to what it cached keeps its
/// cache, so a `before` that misses another client's change would be
/// worse than none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wcc {
    pub before: Option<PreAttr>,
    pub after: Attr,
}

/// A file handle: stable across restarts, never valid for another file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle {
    /// The pool's tag ([`crate::pool::Pool::handle_tag`]); 0 in a handle
    /// of the first version, which names no pool.
    pub pool: u64,
    pub dataset: u32,
    pub ino: u64,
    pub generation: u64,
}

/// Encoded handle length.
pub const HANDLE_BYTES: usize = 32;
const HANDLE_VERSION: u8 = 2;
/// The first version: no pool tag, 24 bytes. Still accepted (handles a
/// client kept from before an upgrade), naming a dataset only while one
/// pool alone has a dataset of that id.
const HANDLE_V1_BYTES: usize = 24;

impl Handle {
    /// version `u8` 2, three reserved zero bytes, dataset `u32`, inode
    /// `u64`, generation `u64`, pool tag `u64` (little endian;
    /// docs/FORMAT.md).
    pub fn encode(&self) -> [u8; HANDLE_BYTES] {
        let mut out = [0u8; HANDLE_BYTES];
        out[0] = HANDLE_VERSION;
        out[4..8].copy_from_slice(&self.dataset.to_le_bytes());
        out[8..16].copy_from_slice(&self.ino.to_le_bytes());
        out[16..24].copy_from_slice(&self.generation.to_le_bytes());
        out[24..32].copy_from_slice(&self.pool.to_le_bytes());
        out
    }

    /// `None` for bytes that are not a handle of ours (NFS3ERR_BADHANDLE).
    pub fn decode(bytes: &[u8]) -> Option<Handle> {
        let pool = match (bytes.len(), bytes.first()) {
            (HANDLE_BYTES, Some(&HANDLE_VERSION)) => u64::from_le_bytes(bytes[24..32].try_into().ok()?),
            (HANDLE_V1_BYTES, Some(1)) => 0,
            _ => return None,
        };
        if bytes[1..4] != [0, 0, 0] || (bytes[0] == HANDLE_VERSION && pool == 0) {
            return None;
        }
        Some(Handle {
            pool,
            dataset: u32::from_le_bytes(bytes[4..8].try_into().ok()?),
            ino: u64::from_le_bytes(bytes[8..16].try_into().ok()?),
            generation: u64::from_le_bytes(bytes[16..24].try_into().ok()?),
        })
    }
}

/// Who asks (AUTH_SYS credentials after squashing; AUTH_NONE is the
/// anonymous user).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cred {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (at most 16 in AUTH_SYS).
    pub gids: Vec<u32>,
}

impl Cred {
    pub fn root() -> Cred {
        Cred {
            uid: 0,
            gid: 0,
            gids: Vec::new(),
        }
    }

    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.gids.contains(&gid)
    }
}

/// How SETATTR (or CREATE's attributes) sets a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SetTime {
    #[default]
    Keep,
    ServerNow,
    Client(Time),
}

/// Attributes to set (NFS's `sattr3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SetAttrs {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: SetTime,
    pub mtime: SetTime,
}

/// How CREATE treats an existing name (NFS's `createhow3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateHow {
    /// An existing regular file is used as it is (its size set if asked).
    Unchecked(SetAttrs),
    /// An existing name is an error.
    Guarded(SetAttrs),
    /// Exclusive create: a retransmission with the same verifier finds the
    /// file it created.
    Exclusive([u8; 8]),
}

/// A write's durability (NFS's `stable_how`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stable {
    /// In the RAM tier; durable after a COMMIT.
    Unstable,
    /// The data durable before the reply.
    DataSync,
    /// Data and attributes durable before the reply.
    FileSync,
}

/// One directory entry as READDIR(PLUS) returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Where the next READDIR resumes after this entry (never 0; cookies
    /// 1 and 2 are `.` and `..`).
    pub cookie: u64,
    pub name: Vec<u8>,
    pub fileid: u64,
    pub handle: Handle,
    pub attr: Attr,
}

/// A dataset's space and file counts (FSSTAT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStat {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub avail_bytes: u64,
    pub total_files: u64,
    pub free_files: u64,
}

/// What a file-service operation can fail with; the NFS frontend maps each
/// to its `nfsstat3`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsError {
    #[error("not owner")]
    Perm,
    #[error("no such file or directory")]
    NoEnt,
    #[error("I/O error: {0}")]
    Io(String),
    #[error("permission denied")]
    Access,
    #[error("file exists")]
    Exist,
    #[error("cross-device link")]
    XDev,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("invalid argument")]
    Inval,
    #[error("file too large")]
    FBig,
    #[error("no space left")]
    NoSpace,
    #[error("read-only file system")]
    ReadOnly,
    #[error("too many links")]
    MLink,
    #[error("name too long")]
    NameTooLong,
    #[error("directory not empty")]
    NotEmpty,
    #[error("quota exceeded")]
    DQuot,
    #[error("stale file handle")]
    Stale,
    #[error("bad file handle")]
    BadHandle,
    #[error("not supported")]
    NotSupp,
    #[error("wrong file type")]
    BadType,
    /// SETATTR's guard did not match the file's ctime.
    #[error("the file changed since the client looked (ctime guard)")]
    NotSync,
}

/// ACCESS bits (NFS's ACCESS3_*).
pub mod access {
    pub const READ: u32 = 0x01;
    pub const LOOKUP: u32 = 0x02;
    pub const MODIFY: u32 = 0x04;
    pub const EXTEND: u32 = 0x08;
    pub const DELETE: u32 = 0x10;
    pub const EXECUTE: u32 = 0x20;
}

/// Bytes a READ returns, in the buffer the engine read them into (whole
/// sectors around them).
pub struct FileData {
    pub(super) buf: crate::device::IoBuf,
    pub(super) range: std::ops::Range<usize>,
}

impl FileData {
    pub(super) fn empty() -> FileData {
        FileData {
            buf: crate::device::IoBuf::new(0),
            range: 0..0,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf.payload()[self.range.clone()]
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl std::fmt::Debug for FileData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileData({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_bytes_are_refused() {
        let handle = Handle {
            pool: 0x1234_5678_9abc_def0,
            dataset: 7,
            ino: 1234,
            generation: 99,
        };
        assert_eq!(Handle::decode(&handle.encode()), Some(handle));
        let mut bad = handle.encode();
        bad[0] = 3;
        assert_eq!(Handle::decode(&bad), None);
        assert_eq!(Handle::decode(&handle.encode()[..20]), None);
        // A second-version handle always names its pool.
        let mut no_pool = handle.encode();
        no_pool[24..].fill(0);
        assert_eq!(Handle::decode(&no_pool), None);
        // A first-version handle (24 bytes, version 1) names no pool.
        let mut first = handle.encode()[..24].to_vec();
        first[0] = 1;
        assert_eq!(Handle::decode(&first), Some(Handle { pool: 0, ..handle }));
        first[0] = 2;
        assert_eq!(Handle::decode(&first), None);
        for code in 1..=7 {
            assert_eq!(FileType::from_code(code).map(FileType::code), Some(code));
        }
        assert_eq!(FileType::from_code(0), None);
    }
}
