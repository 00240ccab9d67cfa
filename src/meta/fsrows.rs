//! A dataset's namespace as stored: inode rows, directory entry rows, and
//! the operations a log record carries (docs/FORMAT.md, "File datasets").
//! All integers little endian. (The file service, `fs/`, builds on these.)

use super::sealed::{key2, key3, seal, unseal, SEAL_BYTES};

/// Longest name of a directory entry, in bytes (NFS's usual 255).
pub const MAX_NAME: usize = 255;
/// Longest symbolic link target, in bytes (it travels in one log record).
pub const MAX_SYMLINK: usize = 1024;
/// Bits of a file's byte offset: a file holds at most 1 TiB.
pub const FILE_BITS: u32 = 40;
/// Largest file size.
pub const MAX_FILE_SIZE: u64 = 1 << FILE_BITS;
/// Most inodes a dataset has at once (files share the dataset's address
/// space, 1 TiB each: 2^23 of them fill 2^63 bytes). Inode numbers are
/// reused after a file is removed, with a new generation.
pub const MAX_INODES: u64 = 1 << 23;
/// The root directory's inode number.
pub const ROOT_INO: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    Block,
    Char,
    Socket,
    Fifo,
}

impl FileType {
    /// The code stored on disk (docs/FORMAT.md) and NFS's `ftype3` value.
    pub fn code(self) -> u8 {
        match self {
            FileType::Regular => 1,
            FileType::Directory => 2,
            FileType::Block => 3,
            FileType::Char => 4,
            FileType::Symlink => 5,
            FileType::Socket => 6,
            FileType::Fifo => 7,
        }
    }

    pub fn from_code(code: u8) -> Option<FileType> {
        Some(match code {
            1 => FileType::Regular,
            2 => FileType::Directory,
            3 => FileType::Block,
            4 => FileType::Char,
            5 => FileType::Symlink,
            6 => FileType::Socket,
            7 => FileType::Fifo,
            _ => return None,
        })
    }
}

/// A point in time: seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Time {
    pub seconds: u64,
    pub nanos: u32,
}

impl Time {
    pub fn now() -> Time {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Time {
            seconds: now.as_secs(),
            nanos: now.subsec_nanos(),
        }
    }
}

/// An inode as the metadata store and the log keep it. Row 0 of a dataset
/// is not a file: its `generation` is the dataset's next generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRow {
    pub generation: u64,
    pub kind: FileType,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// 0: removed, its data not freed yet (it is, and the row goes, once
    /// a `Reaped` operation follows).
    pub nlink: u32,
    pub size: u64,
    pub atime: Time,
    pub mtime: Time,
    pub ctime: Time,
    pub rdev: (u32, u32),
    /// Directories: the parent directory (the root's is itself).
    pub parent: u64,
    /// Directories: the next cookie to give an entry (cookies only grow;
    /// 1 and 2 are `.` and `..`).
    pub next_cookie: u64,
    /// Exclusive CREATE's verifier (0: none).
    pub verifier: u64,
    /// Symbolic links: the target.
    pub target: Vec<u8>,
}

/// Fixed part of an encoded inode row.
const INODE_FIXED: usize = 1 + 8 + 4 * 4 + 8 + 3 * 12 + 8 + 8 + 8 + 8 + 2;

impl InodeRow {
    pub fn encoded_len(&self) -> usize {
        INODE_FIXED + self.target.len()
    }

    /// kind `u8`, generation `u64`, mode, uid, gid, nlink `u32`, size
    /// `u64`, atime, mtime, ctime (seconds `u64`, nanoseconds `u32`), rdev
    /// (major, minor `u32`), parent `u64`, next cookie `u64`, verifier
    /// `u64`, target length `u16`, target.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.kind.code());
        out.extend_from_slice(&self.generation.to_le_bytes());
        for v in [self.mode, self.uid, self.gid, self.nlink] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.size.to_le_bytes());
        for t in [self.atime, self.mtime, self.ctime] {
            out.extend_from_slice(&t.seconds.to_le_bytes());
            out.extend_from_slice(&t.nanos.to_le_bytes());
        }
        out.extend_from_slice(&self.rdev.0.to_le_bytes());
        out.extend_from_slice(&self.rdev.1.to_le_bytes());
        for v in [self.parent, self.next_cookie, self.verifier] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.target.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.target);
    }

    /// The row and the bytes it took; `None` for a damaged row.
    pub fn decode(bytes: &[u8]) -> Option<(InodeRow, usize)> {
        Self::decode_checked(bytes).ok()
    }

    /// [`InodeRow::decode`], the error naming the field that is wrong:
    /// cut short, an unknown kind, a size past [`MAX_FILE_SIZE`], a parent
    /// past [`MAX_INODES`], a link target past [`MAX_SYMLINK`].
    pub fn decode_checked(bytes: &[u8]) -> Result<(InodeRow, usize), String> {
        let (row, used) = Self::parse(bytes)
            .ok_or_else(|| format!("row of {} bytes is cut short or of an unknown kind", bytes.len()))?;
        if row.size > MAX_FILE_SIZE {
            return Err(format!(
                "field size: {} is past the largest file ({MAX_FILE_SIZE})",
                row.size
            ));
        }
        if row.parent >= MAX_INODES {
            return Err(format!(
                "field parent: inode {} is past the inode limit ({MAX_INODES})",
                row.parent
            ));
        }
        Ok((row, used))
    }

    fn parse(bytes: &[u8]) -> Option<(InodeRow, usize)> {
        let mut r = Reader(bytes);
        let kind = FileType::from_code(r.u8()?)?;
        let generation = r.u64()?;
        let (mode, uid, gid, nlink) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let size = r.u64()?;
        let mut times = [Time::default(); 3];
        for t in &mut times {
            *t = Time {
                seconds: r.u64()?,
                nanos: r.u32()?,
            };
        }
        let rdev = (r.u32()?, r.u32()?);
        let (parent, next_cookie, verifier) = (r.u64()?, r.u64()?, r.u64()?);
        let len = r.u16()? as usize;
        if len > MAX_SYMLINK {
            return None;
        }
        let target = r.take(len)?.to_vec();
        let row = InodeRow {
            generation,
            kind,
            mode,
            uid,
            gid,
            nlink,
            size,
            atime: times[0],
            mtime: times[1],
            ctime: times[2],
            rdev,
            parent,
            next_cookie,
            verifier,
            target,
        };
        Some((row, bytes.len() - r.0.len()))
    }
}

/// Marker bits of a sealed inode row's first byte (its kind, 1..7, has
/// neither): both are set in a sealed row, so one flipped bit leaves a
/// byte that is neither a kind nor a sealed row's.
const SEALED_KIND: u8 = 0xc0;
/// Marker bits of a sealed entry row's inode (inodes are below
/// [`MAX_INODES`]), set both for the same reason.
const SEALED_ENTRY: u64 = 3 << 62;

impl InodeRow {
    /// The row as `fs_inodes` stores it under `key` (dataset, inode):
    /// [`InodeRow::encode`] with the kind byte's marker bits set, sealed
    /// (`meta/sealed.rs`).
    pub fn encode_stored(&self, key: (u32, u64)) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len() + SEAL_BYTES);
        self.encode(&mut out);
        out[0] |= SEALED_KIND;
        seal(&key2(key), &mut out);
        out
    }

    /// The row stored under `key`: sealed (marker bits and seal right, no
    /// byte past the row), or unsealed as pools from before seals stored
    /// it. The error names the field.
    pub fn decode_stored(key: (u32, u64), bytes: &[u8]) -> Result<InodeRow, String> {
        match bytes.first() {
            Some(kind) if kind & SEALED_KIND == SEALED_KIND => {
                let mut plain = unseal(&key2(key), bytes)?.to_vec();
                plain[0] &= !SEALED_KIND;
                let (row, used) = Self::decode_checked(&plain)?;
                if used != plain.len() {
                    return Err(format!(
                        "field length: a row of {used} bytes is followed by {} more",
                        plain.len() - used
                    ));
                }
                Ok(row)
            }
            _ => Self::decode_checked(bytes).map(|(row, _)| row),
        }
    }
}

/// A directory entry as `fs_entries` stores it under `key` (dataset,
/// directory, cookie): [`encode_entry`] with the inode's marker bits set,
/// sealed.
pub fn encode_entry_stored(key: (u32, u64, u64), ino: u64, name: &[u8]) -> Vec<u8> {
    let mut out = encode_entry(ino | SEALED_ENTRY, name);
    seal(&key3(key), &mut out);
    out
}

/// The entry stored under `key`: sealed, or unsealed as pools from before
/// seals stored it. The error names the field; the inode is not checked
/// against the inode range here (an unsealed entry whose marker bit
/// flipped names an inode far past it).
pub fn decode_entry_stored(key: (u32, u64, u64), bytes: &[u8]) -> Result<(u64, &[u8]), String> {
    let length = |what: &str| {
        format!(
            "field length: value of {} bytes (an inode, a name of 1 to {MAX_NAME} bytes{what})",
            bytes.len()
        )
    };
    match crate::bytes::u64_at(bytes, 0) {
        Some(ino) if ino & SEALED_ENTRY == SEALED_ENTRY => {
            let body = unseal(&key3(key), bytes)?;
            let (ino, name) = decode_entry(body).ok_or_else(|| length(", a seal"))?;
            Ok((ino & !SEALED_ENTRY, name))
        }
        _ => decode_entry(bytes).ok_or_else(|| length("")),
    }
}

/// A directory entry row's value: inode `u64`, then the name.
pub fn encode_entry(ino: u64, name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + name.len());
    out.extend_from_slice(&ino.to_le_bytes());
    out.extend_from_slice(name);
    out
}

pub fn decode_entry(bytes: &[u8]) -> Option<(u64, &[u8])> {
    if bytes.len() < 9 || bytes.len() > 8 + MAX_NAME {
        return None;
    }
    Some((u64::from_le_bytes(bytes[..8].try_into().ok()?), &bytes[8..]))
}

/// One change to a namespace. A log record carries a list of them, applied
/// together (a rename is one record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NsOp {
    /// Inode `ino` is now `row` (created or changed).
    Inode { ino: u64, row: InodeRow },
    /// Inode `ino` is removed: its row stays, with no links, until its
    /// data is freed.
    Free { ino: u64 },
    /// Removed inode `ino`'s data is freed: the number may be used again.
    Reaped { ino: u64 },
    /// Directory `dir` has entry `name` → `ino` at `cookie`.
    Link {
        dir: u64,
        cookie: u64,
        ino: u64,
        name: Vec<u8>,
    },
    /// Directory `dir`'s entry at `cookie` is gone.
    Unlink { dir: u64, cookie: u64 },
}

impl NsOp {
    pub fn encoded_len(&self) -> usize {
        match self {
            NsOp::Inode { row, .. } => 9 + row.encoded_len(),
            NsOp::Free { .. } | NsOp::Reaped { .. } => 9,
            NsOp::Link { name, .. } => 26 + name.len(),
            NsOp::Unlink { .. } => 17,
        }
    }

    /// kind `u8` (1 Inode, 2 Free, 3 Reaped, 4 Link, 5 Unlink), then: inode
    /// `u64` and the row; inode `u64`; inode `u64`; directory `u64`, cookie
    /// `u64`, inode `u64`, name length `u8`, name; directory `u64`, cookie
    /// `u64`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            NsOp::Inode { ino, row } => {
                out.push(1);
                out.extend_from_slice(&ino.to_le_bytes());
                row.encode(out);
            }
            NsOp::Free { ino } => {
                out.push(2);
                out.extend_from_slice(&ino.to_le_bytes());
            }
            NsOp::Reaped { ino } => {
                out.push(3);
                out.extend_from_slice(&ino.to_le_bytes());
            }
            NsOp::Link { dir, cookie, ino, name } => {
                out.push(4);
                for v in [dir, cookie, ino] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.push(name.len() as u8);
                out.extend_from_slice(name);
            }
            NsOp::Unlink { dir, cookie } => {
                out.push(5);
                out.extend_from_slice(&dir.to_le_bytes());
                out.extend_from_slice(&cookie.to_le_bytes());
            }
        }
    }

    /// Decodes one operation; `None` when it is cut short, of an unknown
    /// kind, or names an inode or directory outside `1..MAX_INODES`.
    pub fn decode(bytes: &[u8]) -> Option<(NsOp, usize)> {
        let (op, used) = Self::parse(bytes)?;
        let inode = |ino: u64| (ROOT_INO..MAX_INODES).contains(&ino);
        let valid = match &op {
            NsOp::Inode { ino, .. } | NsOp::Free { ino } | NsOp::Reaped { ino } => inode(*ino),
            NsOp::Link { dir, ino, .. } => inode(*dir) && inode(*ino),
            NsOp::Unlink { dir, .. } => inode(*dir),
        };
        valid.then_some((op, used))
    }

    fn parse(bytes: &[u8]) -> Option<(NsOp, usize)> {
        let mut r = Reader(bytes);
        let op = match r.u8()? {
            1 => {
                let ino = r.u64()?;
                let (row, used) = InodeRow::decode_checked(r.0).ok()?;
                r.take(used)?;
                NsOp::Inode { ino, row }
            }
            2 => NsOp::Free { ino: r.u64()? },
            3 => NsOp::Reaped { ino: r.u64()? },
            4 => {
                let (dir, cookie, ino) = (r.u64()?, r.u64()?, r.u64()?);
                let len = r.u8()? as usize;
                if len == 0 {
                    return None;
                }
                NsOp::Link {
                    dir,
                    cookie,
                    ino,
                    name: r.take(len)?.to_vec(),
                }
            }
            5 => NsOp::Unlink {
                dir: r.u64()?,
                cookie: r.u64()?,
            },
            _ => return None,
        };
        Some((op, bytes.len() - r.0.len()))
    }
}

/// Most bytes of operations one record carries (it must fit a log block
/// with its header).
pub const MAX_OPS_BYTES: usize = 3072;

/// Encodes a namespace record's body after its kind byte: dataset `u32`,
/// count `u16`, the operations.
pub fn encode_ops(dataset: u32, ops: &[NsOp], out: &mut Vec<u8>) {
    out.extend_from_slice(&dataset.to_le_bytes());
    out.extend_from_slice(&(ops.len() as u16).to_le_bytes());
    for op in ops {
        op.encode(out);
    }
}

pub fn ops_len(ops: &[NsOp]) -> usize {
    6 + ops.iter().map(NsOp::encoded_len).sum::<usize>()
}

pub fn decode_ops(bytes: &[u8]) -> Option<(u32, Vec<NsOp>, usize)> {
    let mut r = Reader(bytes);
    let dataset = r.u32()?;
    let count = r.u16()? as usize;
    let mut ops = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let (op, used) = NsOp::decode(r.0)?;
        r.take(used)?;
        ops.push(op);
    }
    Some((dataset, ops, bytes.len() - r.0.len()))
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn row(kind: FileType) -> InodeRow {
        InodeRow {
            generation: 5,
            kind,
            mode: 0o755,
            uid: 1000,
            gid: 100,
            nlink: 1,
            size: 12345,
            atime: Time { seconds: 1, nanos: 2 },
            mtime: Time { seconds: 3, nanos: 4 },
            ctime: Time { seconds: 5, nanos: 6 },
            rdev: (8, 1),
            parent: 1,
            next_cookie: 3,
            verifier: 77,
            target: b"../x".to_vec(),
        }
    }

    #[test]
    fn operations_round_trip_and_truncations_are_refused() {
        let ops = vec![
            NsOp::Inode {
                ino: 9,
                row: row(FileType::Symlink),
            },
            NsOp::Free { ino: 3 },
            NsOp::Reaped { ino: 3 },
            NsOp::Link {
                dir: 1,
                cookie: 17,
                ino: 9,
                name: b"name".to_vec(),
            },
            NsOp::Unlink { dir: 1, cookie: 4 },
        ];
        let mut out = Vec::new();
        encode_ops(42, &ops, &mut out);
        assert_eq!(out.len(), ops_len(&ops));
        let (dataset, back, used) = decode_ops(&out).unwrap();
        assert_eq!((dataset, &back, used), (42, &ops, out.len()));
        for cut in 0..out.len() {
            assert!(decode_ops(&out[..cut]).is_none(), "cut at {cut}");
        }
        assert_eq!(decode_entry(&encode_entry(7, b"abc")), Some((7, &b"abc"[..])));
        assert_eq!(decode_entry(&7u64.to_le_bytes()), None);
    }

    /// Operations naming inodes or directories outside `1..MAX_INODES`
    /// do not decode (replay would index and size tables by them), and
    /// rows with a size or parent past the limits name the field.
    #[test]
    fn numbers_past_the_limits_are_refused() {
        let encoded = |op: NsOp| {
            let mut out = Vec::new();
            op.encode(&mut out);
            out
        };
        for op in [
            NsOp::Free { ino: MAX_INODES },
            NsOp::Reaped { ino: 0 },
            NsOp::Inode {
                ino: u64::MAX,
                row: row(FileType::Regular),
            },
            NsOp::Link {
                dir: 1,
                cookie: 3,
                ino: 1 << 40,
                name: b"a".to_vec(),
            },
            NsOp::Unlink {
                dir: MAX_INODES,
                cookie: 3,
            },
        ] {
            assert!(NsOp::decode(&encoded(op.clone())).is_none(), "{op:?} decoded");
        }
        let ok = NsOp::Free { ino: MAX_INODES - 1 };
        assert_eq!(NsOp::decode(&encoded(ok.clone())).map(|(op, _)| op), Some(ok));
        let mut big = row(FileType::Regular);
        big.size = MAX_FILE_SIZE + 1;
        let mut bytes = Vec::new();
        big.encode(&mut bytes);
        assert!(InodeRow::decode_checked(&bytes).unwrap_err().contains("field size"));
        let mut orphan = row(FileType::Directory);
        orphan.parent = MAX_INODES;
        let mut bytes = Vec::new();
        orphan.encode(&mut bytes);
        assert!(InodeRow::decode_checked(&bytes).unwrap_err().contains("field parent"));
    }
}
