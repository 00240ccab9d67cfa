//! The NFS program, version 3 (RFC 1813): the 22 procedures' arguments
//! decoded into an [`NfsCall`], then executed against the export the file
//! handle names, and their results encoded.
//!
//! Every call with a handle goes through the same gate (`Gate::target`):
//! a handle that is not ours is NFS3ERR_BADHANDLE, one whose dataset is
//! not exported (destroyed, unexported) NFS3ERR_STALE, a client outside
//! the export's networks NFS3ERR_ACCES, a change to a read-only export
//! NFS3ERR_ROFS; the credential is squashed as the export says. Weak cache
//! consistency data carries no pre-operation attributes (allowed by RFC
//! 1813; the client then revalidates its cache from the post-operation
//! attributes, which are always sent when they can be read).

use std::net::SocketAddr;

use super::rpc::Auth;
use super::xdr::{padding, Decoder, Encode, XdrError};
use super::ArgsError;
use crate::fs::{
    access, Attr, CreateHow, Cred, DirEntry, Export, Exports, FileType, FsError, Handle, SetAttrs, SetTime, Stable,
    Time, MAX_FILE_SIZE, MAX_NAME, MAX_SYMLINK,
};
use crate::fs::{FileData, PreAttr, Wcc};

pub mod procedure {
    pub const NULL: u32 = 0;
    pub const GETATTR: u32 = 1;
    pub const SETATTR: u32 = 2;
    pub const LOOKUP: u32 = 3;
    pub const ACCESS: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const READ: u32 = 6;
    pub const WRITE: u32 = 7;
    pub const CREATE: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const SYMLINK: u32 = 10;
    pub const MKNOD: u32 = 11;
    pub const REMOVE: u32 = 12;
    pub const RMDIR: u32 = 13;
    pub const RENAME: u32 = 14;
    pub const LINK: u32 = 15;
    pub const READDIR: u32 = 16;
    pub const READDIRPLUS: u32 = 17;
    pub const FSSTAT: u32 = 18;
    pub const FSINFO: u32 = 19;
    pub const PATHCONF: u32 = 20;
    pub const COMMIT: u32 = 21;
}

/// `nfsstat3` values.
pub mod status {
    pub const OK: u32 = 0;
    pub const PERM: u32 = 1;
    pub const NOENT: u32 = 2;
    pub const IO: u32 = 5;
    pub const ACCES: u32 = 13;
    pub const EXIST: u32 = 17;
    pub const XDEV: u32 = 18;
    pub const NOTDIR: u32 = 20;
    pub const ISDIR: u32 = 21;
    pub const INVAL: u32 = 22;
    pub const FBIG: u32 = 27;
    pub const NOSPC: u32 = 28;
    pub const ROFS: u32 = 30;
    pub const MLINK: u32 = 31;
    pub const NAMETOOLONG: u32 = 63;
    pub const NOTEMPTY: u32 = 66;
    pub const DQUOT: u32 = 69;
    pub const STALE: u32 = 70;
    pub const BADHANDLE: u32 = 10001;
    pub const NOT_SYNC: u32 = 10002;
    pub const NOTSUPP: u32 = 10004;
    pub const TOOSMALL: u32 = 10005;
    pub const BADTYPE: u32 = 10007;
}

/// Largest file handle on the wire (NFS3_FHSIZE); ours are 24 bytes.
pub const MAX_FH: usize = 64;
/// Largest READ and WRITE (FSINFO's rtmax and wtmax), and the largest
/// READDIR reply we build.
pub const MAX_IO: u32 = 1 << 20;
/// Preferred READDIR size (FSINFO's dtpref).
pub const DTPREF: u32 = 64 << 10;
/// Names and symlink targets are decoded up to this length, so that one
/// longer than [`MAX_NAME`] or [`MAX_SYMLINK`] gets NFS3ERR_NAMETOOLONG
/// rather than GARBAGE_ARGS.
const MAX_DECODED_NAME: usize = 4096;
/// Most entries asked of the file system for one READDIR(PLUS).
const MAX_DIR_ENTRIES: usize = 4096;
/// FSINFO properties: hard links, symlinks, the same pathconf everywhere,
/// times settable by SETATTR.
const FSF3_LINK: u32 = 0x1;
const FSF3_SYMLINK: u32 = 0x2;
const FSF3_HOMOGENEOUS: u32 = 0x8;
const FSF3_CANSETTIME: u32 = 0x10;

/// A directory and a name in it (`diropargs3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirOp<'a> {
    pub dir: &'a [u8],
    pub name: &'a [u8],
}

/// What MKNOD makes (`mknoddata3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mknod {
    /// Regular files, directories and symlinks decode (the union's default
    /// arm) and are refused with NFS3ERR_BADTYPE.
    pub kind: FileType,
    pub attrs: SetAttrs,
    pub rdev: (u32, u32),
}

/// A decoded NFS call. File handles stay raw bytes: a handle that is not
/// ours is a status (NFS3ERR_BADHANDLE), not garbage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NfsCall<'a> {
    Null,
    GetAttr {
        fh: &'a [u8],
    },
    SetAttr {
        fh: &'a [u8],
        set: SetAttrs,
        guard: Option<Time>,
    },
    Lookup(DirOp<'a>),
    Access {
        fh: &'a [u8],
        mask: u32,
    },
    ReadLink {
        fh: &'a [u8],
    },
    Read {
        fh: &'a [u8],
        offset: u64,
        count: u32,
    },
    Write {
        fh: &'a [u8],
        offset: u64,
        stable: Stable,
        data: &'a [u8],
    },
    Create {
        at: DirOp<'a>,
        how: CreateHow,
    },
    Mkdir {
        at: DirOp<'a>,
        attrs: SetAttrs,
    },
    Symlink {
        at: DirOp<'a>,
        attrs: SetAttrs,
        target: &'a [u8],
    },
    Mknod {
        at: DirOp<'a>,
        what: Mknod,
    },
    Remove(DirOp<'a>),
    Rmdir(DirOp<'a>),
    Rename {
        from: DirOp<'a>,
        to: DirOp<'a>,
    },
    Link {
        fh: &'a [u8],
        at: DirOp<'a>,
    },
    ReadDir {
        dir: &'a [u8],
        cookie: u64,
        verifier: [u8; 8],
        count: u32,
    },
    ReadDirPlus {
        dir: &'a [u8],
        cookie: u64,
        verifier: [u8; 8],
        dircount: u32,
        maxcount: u32,
    },
    FsStat {
        fh: &'a [u8],
    },
    FsInfo {
        fh: &'a [u8],
    },
    PathConf {
        fh: &'a [u8],
    },
    Commit {
        fh: &'a [u8],
        offset: u64,
        count: u32,
    },
}

fn fh<'a>(d: &mut Decoder<'a>) -> Result<&'a [u8], XdrError> {
    d.opaque(MAX_FH)
}

fn dirop<'a>(d: &mut Decoder<'a>) -> Result<DirOp<'a>, XdrError> {
    Ok(DirOp {
        dir: fh(d)?,
        name: d.string(MAX_DECODED_NAME)?,
    })
}

fn time(d: &mut Decoder<'_>) -> Result<Time, XdrError> {
    Ok(Time {
        seconds: d.u32()? as u64,
        nanos: d.u32()?,
    })
}

fn set_time(d: &mut Decoder<'_>) -> Result<SetTime, XdrError> {
    match d.u32()? {
        0 => Ok(SetTime::Keep),
        1 => Ok(SetTime::ServerNow),
        2 => Ok(SetTime::Client(time(d)?)),
        other => Err(XdrError::BadDiscriminant(other)),
    }
}

/// `sattr3`.
fn sattr(d: &mut Decoder<'_>) -> Result<SetAttrs, XdrError> {
    Ok(SetAttrs {
        mode: d.optional(|d| d.u32())?,
        uid: d.optional(|d| d.u32())?,
        gid: d.optional(|d| d.u32())?,
        size: d.optional(|d| d.u64())?,
        atime: set_time(d)?,
        mtime: set_time(d)?,
    })
}

fn stable(d: &mut Decoder<'_>) -> Result<Stable, XdrError> {
    match d.u32()? {
        0 => Ok(Stable::Unstable),
        1 => Ok(Stable::DataSync),
        2 => Ok(Stable::FileSync),
        other => Err(XdrError::BadDiscriminant(other)),
    }
}

fn stable_code(stable: Stable) -> u32 {
    match stable {
        Stable::Unstable => 0,
        Stable::DataSync => 1,
        Stable::FileSync => 2,
    }
}

/// Decodes the arguments of NFS procedure `procedure`. Bytes after the
/// arguments are ignored.
pub fn decode(number: u32, args: &[u8]) -> Result<NfsCall<'_>, ArgsError> {
    use procedure as p;
    let mut d = Decoder::new(args);
    let d = &mut d;
    Ok(match number {
        p::NULL => NfsCall::Null,
        p::GETATTR => NfsCall::GetAttr { fh: fh(d)? },
        p::SETATTR => NfsCall::SetAttr {
            fh: fh(d)?,
            set: sattr(d)?,
            guard: d.optional(time)?,
        },
        p::LOOKUP => NfsCall::Lookup(dirop(d)?),
        p::ACCESS => NfsCall::Access {
            fh: fh(d)?,
            mask: d.u32()?,
        },
        p::READLINK => NfsCall::ReadLink { fh: fh(d)? },
        p::READ => NfsCall::Read {
            fh: fh(d)?,
            offset: d.u64()?,
            count: d.u32()?,
        },
        p::WRITE => {
            let fh = fh(d)?;
            let offset = d.u64()?;
            let count = d.u32()?;
            let stable = stable(d)?;
            let data = d.opaque(MAX_IO as usize)?;
            // The count and the data's own length must agree (knfsd
            // refuses the call the same way).
            if data.len() != count as usize {
                return Err(ArgsError::Garbage(XdrError::TooLong {
                    len: data.len() as u32,
                    max: count as usize,
                }));
            }
            NfsCall::Write {
                fh,
                offset,
                stable,
                data,
            }
        }
        p::CREATE => {
            let at = dirop(d)?;
            let how = match d.u32()? {
                0 => CreateHow::Unchecked(sattr(d)?),
                1 => CreateHow::Guarded(sattr(d)?),
                2 => CreateHow::Exclusive(d.array()?),
                other => return Err(XdrError::BadDiscriminant(other).into()),
            };
            NfsCall::Create { at, how }
        }
        p::MKDIR => NfsCall::Mkdir {
            at: dirop(d)?,
            attrs: sattr(d)?,
        },
        p::SYMLINK => NfsCall::Symlink {
            at: dirop(d)?,
            attrs: sattr(d)?,
            target: d.string(MAX_DECODED_NAME)?,
        },
        p::MKNOD => {
            let at = dirop(d)?;
            let code = d.u32()?;
            let kind = u8::try_from(code)
                .ok()
                .and_then(FileType::from_code)
                .ok_or(XdrError::BadDiscriminant(code))?;
            let what = match kind {
                FileType::Block | FileType::Char => Mknod {
                    kind,
                    attrs: sattr(d)?,
                    rdev: (d.u32()?, d.u32()?),
                },
                FileType::Socket | FileType::Fifo => Mknod {
                    kind,
                    attrs: sattr(d)?,
                    rdev: (0, 0),
                },
                FileType::Regular | FileType::Directory | FileType::Symlink => Mknod {
                    kind,
                    attrs: SetAttrs::default(),
                    rdev: (0, 0),
                },
            };
            NfsCall::Mknod { at, what }
        }
        p::REMOVE => NfsCall::Remove(dirop(d)?),
        p::RMDIR => NfsCall::Rmdir(dirop(d)?),
        p::RENAME => NfsCall::Rename {
            from: dirop(d)?,
            to: dirop(d)?,
        },
        p::LINK => NfsCall::Link {
            fh: fh(d)?,
            at: dirop(d)?,
        },
        p::READDIR => NfsCall::ReadDir {
            dir: fh(d)?,
            cookie: d.u64()?,
            verifier: d.array()?,
            count: d.u32()?,
        },
        p::READDIRPLUS => NfsCall::ReadDirPlus {
            dir: fh(d)?,
            cookie: d.u64()?,
            verifier: d.array()?,
            dircount: d.u32()?,
            maxcount: d.u32()?,
        },
        p::FSSTAT => NfsCall::FsStat { fh: fh(d)? },
        p::FSINFO => NfsCall::FsInfo { fh: fh(d)? },
        p::PATHCONF => NfsCall::PathConf { fh: fh(d)? },
        p::COMMIT => NfsCall::Commit {
            fh: fh(d)?,
            offset: d.u64()?,
            count: d.u32()?,
        },
        _ => return Err(ArgsError::ProcUnavail),
    })
}

impl NfsCall<'_> {
    /// Bytes to reserve for the reply's results (a READDIR listing), so it
    /// is built without reallocating. (A READ's data is not copied into
    /// the reply: see [`execute`].)
    pub fn reply_capacity(&self) -> usize {
        match *self {
            NfsCall::ReadDir { count, .. } => count.min(MAX_IO) as usize + 64,
            NfsCall::ReadDirPlus { maxcount, .. } => maxcount.min(MAX_IO) as usize + 64,
            _ => 256,
        }
    }
}

/// The `nfsstat3` of a file-system error.
pub fn status_of(error: &FsError) -> u32 {
    match error {
        FsError::Perm => status::PERM,
        FsError::NoEnt => status::NOENT,
        FsError::Io(_) => status::IO,
        FsError::Access => status::ACCES,
        FsError::Exist => status::EXIST,
        FsError::XDev => status::XDEV,
        FsError::NotDir => status::NOTDIR,
        FsError::IsDir => status::ISDIR,
        FsError::Inval => status::INVAL,
        FsError::FBig => status::FBIG,
        FsError::NoSpace => status::NOSPC,
        FsError::ReadOnly => status::ROFS,
        FsError::MLink => status::MLINK,
        FsError::NameTooLong => status::NAMETOOLONG,
        FsError::NotEmpty => status::NOTEMPTY,
        FsError::DQuot => status::DQUOT,
        FsError::Stale => status::STALE,
        FsError::BadHandle => status::BADHANDLE,
        FsError::NotSupp => status::NOTSUPP,
        FsError::BadType => status::BADTYPE,
        FsError::NotSync => status::NOT_SYNC,
    }
}

/// A failed step: the `nfsstat3` to answer.
type Status<T> = Result<T, u32>;

fn fs<T>(result: Result<T, FsError>) -> Status<T> {
    result.map_err(|e| {
        if let FsError::Io(message) = &e {
            tracing::warn!("nfs: I/O error: {message}");
        }
        status_of(&e)
    })
}

/// A name a new entry may get, or one REMOVE, RMDIR and RENAME act on:
/// not empty, `.` or `..`, no `/` or NUL, at most [`MAX_NAME`] bytes.
fn check_name(name: &[u8]) -> Status<()> {
    if name.len() > MAX_NAME {
        return Err(status::NAMETOOLONG);
    }
    if name.is_empty() || name == b"." || name == b".." || name.iter().any(|&b| b == b'/' || b == 0) {
        return Err(status::INVAL);
    }
    Ok(())
}

/// A name LOOKUP takes: `.` and `..` are the file system's to resolve.
fn check_lookup_name(name: &[u8]) -> Status<()> {
    if name == b"." || name == b".." {
        return Ok(());
    }
    check_name(name)
}

/// Times a client sets must be real times.
fn check_times(set: &SetAttrs) -> Status<()> {
    for time in [set.atime, set.mtime] {
        if let SetTime::Client(t) = time {
            if t.nanos >= 1_000_000_000 {
                return Err(status::INVAL);
            }
        }
    }
    Ok(())
}

/// The file a call acts on, after the gate: its export, its handle and the
/// credential to act with.
struct Target {
    export: Export,
    handle: Handle,
    cred: Cred,
}

impl Target {
    fn fs(&self) -> &crate::fs::FileSystem {
        &self.export.fs
    }

    /// Post-operation attributes of `handle`, if they can be read.
    fn attr_of(&self, handle: &Handle) -> Option<Attr> {
        self.fs().getattr(handle).ok()
    }

    fn attr(&self) -> Option<Attr> {
        self.attr_of(&self.handle)
    }

    /// Another handle of the same call (RENAME's target directory, LINK's
    /// directory), which must be in the same dataset.
    fn same_dataset(&self, fh: &[u8]) -> Status<Handle> {
        let handle = Handle::decode(fh).ok_or(status::BADHANDLE)?;
        if (handle.pool, handle.dataset) != (self.handle.pool, self.handle.dataset) {
            return Err(status::XDEV);
        }
        Ok(handle)
    }
}

/// Who calls, checked against each export a call touches.
struct Gate<'a> {
    exports: &'a dyn Exports,
    peer: SocketAddr,
    auth: &'a Auth,
}

impl Gate<'_> {
    fn target(&self, fh: &[u8], modifies: bool) -> Status<Target> {
        let handle = Handle::decode(fh).ok_or(status::BADHANDLE)?;
        let export = self
            .exports
            .by_dataset(handle.pool, handle.dataset)
            .ok_or(status::STALE)?;
        let options = &export.options;
        if !options.allows(self.peer.ip(), self.peer.port()) {
            return Err(status::ACCES);
        }
        if modifies && options.read_only {
            return Err(status::ROFS);
        }
        let cred = match self.auth {
            Auth::Sys(sys) => options.squash(Cred {
                uid: sys.uid,
                gid: sys.gid,
                gids: sys.gids.clone(),
            }),
            Auth::None => options.anonymous(),
        };
        Ok(Target { export, handle, cred })
    }
}

/// Runs an NFS call from `peer` with credential `auth`, appending its
/// results to `out` (a SUCCESS reply being built). A READ's data is not
/// appended: `out` ends with its length, and the data comes back, still
/// in the buffer the engine read it into, to be sent after `out` with its
/// XDR padding (copying each 1 MiB READ costs a quarter of the server's
/// CPU on sequential reads).
pub async fn execute(
    exports: &dyn Exports,
    peer: SocketAddr,
    auth: &Auth,
    call: &NfsCall<'_>,
    out: &mut Vec<u8>,
) -> Option<FileData> {
    let gate = Gate { exports, peer, auth };
    let mut read_data = None;
    match *call {
        NfsCall::Null => {}
        NfsCall::GetAttr { fh } => {
            let result = gate.target(fh, false).and_then(|t| fs(t.fs().getattr(&t.handle)));
            encode_getattr(out, result);
        }
        NfsCall::SetAttr { fh, set, guard } => {
            let target = gate.target(fh, true);
            let result = match &target {
                Ok(t) => setattr(t, set, guard).await,
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            put_wcc_of(out, result.ok(), || target.ok().and_then(|t| t.attr()));
        }
        NfsCall::Lookup(DirOp { dir, name }) => {
            let target = gate.target(dir, false);
            let result = target.as_ref().map_err(|s| *s).and_then(|t| {
                check_lookup_name(name)?;
                fs(t.fs().lookup(&t.handle, name, &t.cred))
            });
            let dir_attr = target.ok().and_then(|t| t.attr());
            match result {
                Ok((handle, attr)) => {
                    out.put_u32(status::OK);
                    out.put_opaque(&handle.encode());
                    put_attr(out, Some(&attr));
                    put_attr(out, dir_attr.as_ref());
                }
                Err(s) => {
                    out.put_u32(s);
                    put_attr(out, dir_attr.as_ref());
                }
            }
        }
        NfsCall::Access { fh, mask } => {
            let target = gate.target(fh, false);
            let result = target.as_ref().map_err(|s| *s).and_then(|t| {
                let granted = fs(t.fs().access(&t.handle, &t.cred, mask))?;
                // Nothing on a read-only export may be changed, whatever
                // the modes say.
                Ok(if t.export.options.read_only {
                    granted & !(access::MODIFY | access::EXTEND | access::DELETE)
                } else {
                    granted
                })
            });
            put_status(out, &result);
            put_attr(out, target.ok().and_then(|t| t.attr()).as_ref());
            if let Ok(granted) = result {
                out.put_u32(granted);
            }
        }
        NfsCall::ReadLink { fh } => {
            let target = gate.target(fh, false);
            let result = target
                .as_ref()
                .map_err(|s| *s)
                .and_then(|t| fs(t.fs().readlink(&t.handle)));
            put_status(out, &result);
            put_attr(out, target.ok().and_then(|t| t.attr()).as_ref());
            if let Ok(path) = result {
                out.put_string(&path);
            }
        }
        NfsCall::Read { fh, offset, count } => {
            let target = gate.target(fh, false);
            let result = match &target {
                Ok(t) => fs(t.fs().read_data(&t.handle, &t.cred, offset, count.min(MAX_IO)).await),
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            put_attr(out, target.ok().and_then(|t| t.attr()).as_ref());
            if let Ok((data, eof)) = result {
                out.put_u32(data.len() as u32);
                out.put_bool(eof);
                // The opaque's length; its bytes follow `out`.
                out.put_u32(data.len() as u32);
                read_data = Some(data);
            }
        }
        NfsCall::Write {
            fh,
            offset,
            stable,
            data,
        } => {
            let target = gate.target(fh, true);
            let result = match &target {
                Ok(t) => fs(t.fs().write(&t.handle, &t.cred, offset, data, stable).await),
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            match result {
                Ok((count, committed, wcc)) => {
                    put_wcc_of(out, Some(wcc), || None);
                    out.put_u32(count);
                    out.put_u32(stable_code(committed));
                    let verifier = target.as_ref().map(|t| t.fs().write_verifier()).unwrap_or_default();
                    out.put_fixed(&verifier);
                }
                Err(_) => put_wcc(out, target.ok().and_then(|t| t.attr()).as_ref()),
            }
        }
        NfsCall::Create { at, how } => {
            let target = gate.target(at.dir, true);
            let result = match &target {
                Ok(t) => {
                    async {
                        check_name(at.name)?;
                        match how {
                            CreateHow::Unchecked(set) | CreateHow::Guarded(set) => check_times(&set)?,
                            CreateHow::Exclusive(_) => {}
                        }
                        fs(t.fs().create(&t.handle, at.name, &t.cred, how).await)
                    }
                    .await
                }
                Err(s) => Err(*s),
            };
            encode_made(out, result, target);
        }
        NfsCall::Mkdir { at, attrs } => {
            let target = gate.target(at.dir, true);
            let result = match &target {
                Ok(t) => {
                    async {
                        check_name(at.name)?;
                        check_times(&attrs)?;
                        fs(t.fs().mkdir(&t.handle, at.name, &t.cred, attrs).await)
                    }
                    .await
                }
                Err(s) => Err(*s),
            };
            encode_made(out, result, target);
        }
        NfsCall::Symlink {
            at,
            attrs,
            target: path,
        } => {
            let target = gate.target(at.dir, true);
            let result = match &target {
                Ok(t) => {
                    async {
                        check_name(at.name)?;
                        if path.len() > MAX_SYMLINK {
                            return Err(status::NAMETOOLONG);
                        }
                        check_times(&attrs)?;
                        fs(t.fs().symlink(&t.handle, at.name, &t.cred, path, attrs).await)
                    }
                    .await
                }
                Err(s) => Err(*s),
            };
            encode_made(out, result, target);
        }
        NfsCall::Mknod { at, what } => {
            let target = gate.target(at.dir, true);
            let result = match &target {
                Ok(t) => {
                    async {
                        check_name(at.name)?;
                        if matches!(what.kind, FileType::Regular | FileType::Directory | FileType::Symlink) {
                            return Err(status::BADTYPE);
                        }
                        check_times(&what.attrs)?;
                        fs(t.fs()
                            .mknod(&t.handle, at.name, &t.cred, what.kind, what.rdev, what.attrs)
                            .await)
                    }
                    .await
                }
                Err(s) => Err(*s),
            };
            encode_made(out, result, target);
        }
        NfsCall::Remove(DirOp { dir, name }) | NfsCall::Rmdir(DirOp { dir, name }) => {
            let target = gate.target(dir, true);
            let result = match &target {
                Ok(t) => match check_name(name) {
                    Err(s) => Err(s),
                    Ok(()) if matches!(call, NfsCall::Remove(_)) => fs(t.fs().remove(&t.handle, name, &t.cred).await),
                    Ok(()) => fs(t.fs().rmdir(&t.handle, name, &t.cred).await),
                },
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            put_wcc_of(out, result.ok().flatten(), || target.ok().and_then(|t| t.attr()));
        }
        NfsCall::Rename { from, to } => {
            let target = gate.target(from.dir, true);
            let mut to_dir = None;
            let result = match &target {
                Ok(t) => {
                    async {
                        let to_handle = t.same_dataset(to.dir)?;
                        to_dir = Some(to_handle);
                        check_name(from.name)?;
                        check_name(to.name)?;
                        fs(t.fs().rename(&t.handle, from.name, &to_handle, to.name, &t.cred).await)
                    }
                    .await
                }
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            let target = target.ok();
            let [from_wcc, to_wcc] = result.unwrap_or_default();
            put_wcc_of(out, from_wcc, || target.as_ref().and_then(|t| t.attr()));
            put_wcc_of(out, to_wcc, || {
                target.as_ref().zip(to_dir).and_then(|(t, h)| t.attr_of(&h))
            });
        }
        NfsCall::Link { fh, at } => {
            let target = gate.target(fh, true);
            let mut dir = None;
            let result = match &target {
                Ok(t) => {
                    async {
                        let dir_handle = t.same_dataset(at.dir)?;
                        dir = Some(dir_handle);
                        check_name(at.name)?;
                        fs(t.fs().link(&t.handle, &dir_handle, at.name, &t.cred).await)
                    }
                    .await
                }
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            let target = target.ok();
            put_attr(out, target.as_ref().and_then(|t| t.attr()).as_ref());
            let dir_wcc = result.ok().flatten();
            put_wcc_of(out, dir_wcc, || {
                target.as_ref().zip(dir).and_then(|(t, h)| t.attr_of(&h))
            });
        }
        NfsCall::ReadDir { dir, cookie, count, .. } => {
            readdir(&gate, out, dir, cookie, count, false);
        }
        NfsCall::ReadDirPlus {
            dir, cookie, maxcount, ..
        } => {
            readdir(&gate, out, dir, cookie, maxcount, true);
        }
        NfsCall::FsStat { fh } => {
            let (result, attr) = checked(&gate, fh);
            let result = result.map(|t| t.fs().fsstat());
            put_status(out, &result);
            put_attr(out, attr.as_ref());
            if let Ok(stat) = result {
                out.put_u64(stat.total_bytes);
                out.put_u64(stat.free_bytes);
                out.put_u64(stat.avail_bytes);
                out.put_u64(stat.total_files);
                out.put_u64(stat.free_files);
                // Files available to the caller: no per-user limits.
                out.put_u64(stat.free_files);
                // invarsec: may change at any time.
                out.put_u32(0);
            }
        }
        NfsCall::FsInfo { fh } => {
            let (result, attr) = checked(&gate, fh);
            put_status(out, &result);
            put_attr(out, attr.as_ref());
            if result.is_ok() {
                put_fsinfo(out);
            }
        }
        NfsCall::PathConf { fh } => {
            let (result, attr) = checked(&gate, fh);
            put_status(out, &result);
            put_attr(out, attr.as_ref());
            if result.is_ok() {
                out.put_u32(65535);
                out.put_u32(MAX_NAME as u32);
                out.put_bool(true); // no_trunc: long names are refused
                out.put_bool(true); // chown_restricted
                out.put_bool(false); // case_insensitive
                out.put_bool(true); // case_preserving
            }
        }
        NfsCall::Commit { fh, .. } => {
            // The whole file is committed whatever range is asked.
            let target = gate.target(fh, false);
            let result = match &target {
                Ok(t) => fs(t.fs().commit(&t.handle).await).map(|()| t.fs().write_verifier()),
                Err(s) => Err(*s),
            };
            put_status(out, &result);
            // COMMIT changes no attribute: one read is both before and
            // after.
            let after = target.ok().and_then(|t| t.attr());
            let wcc = after.map(|after| Wcc {
                before: Some(PreAttr::from(&after)),
                after,
            });
            put_wcc_of(out, wcc, || None);
            if let Ok(verifier) = result {
                out.put_fixed(&verifier);
            }
        }
    }
    read_data
}

/// SETATTR: the file system checks the guard with the change, under one
/// lock (NFS3ERR_NOT_SYNC when the ctime differs).
async fn setattr(t: &Target, set: SetAttrs, guard: Option<Time>) -> Status<Wcc> {
    check_times(&set)?;
    fs(t.fs().setattr(&t.handle, &t.cred, set, guard).await)
}

/// For FSSTAT, FSINFO and PATHCONF: the gate, then the object's attributes
/// (which also prove the handle is live).
fn checked(gate: &Gate<'_>, fh: &[u8]) -> (Status<Target>, Option<Attr>) {
    match gate.target(fh, false) {
        Err(s) => (Err(s), None),
        Ok(t) => match fs(t.fs().getattr(&t.handle)) {
            Ok(attr) => (Ok(t), Some(attr)),
            Err(s) => (Err(s), None),
        },
    }
}

/// The results of CREATE, MKDIR, SYMLINK and MKNOD.
fn encode_made(out: &mut Vec<u8>, result: Status<(Handle, Attr, Option<Wcc>)>, target: Status<Target>) {
    put_status(out, &result);
    let dir_wcc = match result {
        Ok((handle, attr, dir_wcc)) => {
            out.put_bool(true);
            out.put_opaque(&handle.encode());
            put_attr(out, Some(&attr));
            dir_wcc
        }
        Err(_) => None,
    };
    put_wcc_of(out, dir_wcc, || target.ok().and_then(|t| t.attr()));
}

/// READDIR and READDIRPLUS.
fn readdir(gate: &Gate<'_>, out: &mut Vec<u8>, dir: &[u8], cookie: u64, count: u32, plus: bool) {
    let budget = count.min(MAX_IO) as usize;
    let target = match gate.target(dir, false) {
        Ok(t) => t,
        Err(s) => {
            out.put_u32(s);
            put_attr(out, None);
            return;
        }
    };
    let dir_attr = target.attr();
    // Enough entries to fill the budget if every name were one byte long;
    // more are not asked for.
    let smallest = entry_bytes(1, plus);
    let wanted = (budget.saturating_sub(READDIR_FIXED_BYTES) / smallest + 1).min(MAX_DIR_ENTRIES);
    match fs(target.fs().readdir(&target.handle, &target.cred, cookie, wanted)) {
        Ok((entries, eof)) => encode_readdir(out, dir_attr.as_ref(), &entries, eof, budget, plus),
        Err(s) => {
            out.put_u32(s);
            put_attr(out, dir_attr.as_ref());
        }
    }
}

/// Bytes of a READDIR(PLUS) reply besides its entries: status, directory
/// attributes, cookie verifier, the list's end and eof.
const READDIR_FIXED_BYTES: usize = 4 + 4 + FATTR_BYTES + 8 + 4 + 4;
/// Encoded `fattr3`.
const FATTR_BYTES: usize = 84;

/// Bytes of one entry with a name of `name_len` bytes: `entry3`, or
/// `entryplus3` with attributes and handle.
fn entry_bytes(name_len: usize, plus: bool) -> usize {
    let base = 4 + 8 + 4 + name_len + padding(name_len) + 8;
    if plus {
        base + 4 + FATTR_BYTES + 4 + 4 + crate::fs::HANDLE_BYTES
    } else {
        base
    }
}

/// Encodes a READDIR(PLUS) reply of as many of `entries` as fit in
/// `budget` bytes (READDIR's count, READDIRPLUS's maxcount; READDIRPLUS's
/// dircount is not enforced, the whole reply being bounded by maxcount:
/// older Linux clients send maxcount / 8 as dircount, which would cut each
/// reply to an eighth of what the client takes). `eof` only if every
/// entry fit and the file system said the listing is complete;
/// NFS3ERR_TOOSMALL if not even one fits. The cookie verifier is always
/// zero and any is accepted: cookies never go stale.
pub fn encode_readdir(
    out: &mut Vec<u8>,
    dir_attr: Option<&Attr>,
    entries: &[DirEntry],
    eof: bool,
    budget: usize,
    plus: bool,
) {
    let mut used = READDIR_FIXED_BYTES;
    let fitting = entries
        .iter()
        .take_while(|entry| {
            used += entry_bytes(entry.name.len(), plus);
            used <= budget
        })
        .count();
    if fitting == 0 && !entries.is_empty() {
        out.put_u32(status::TOOSMALL);
        put_attr(out, dir_attr);
        return;
    }
    out.put_u32(status::OK);
    put_attr(out, dir_attr);
    out.put_fixed(&[0; 8]);
    for entry in &entries[..fitting] {
        out.put_bool(true);
        out.put_u64(entry.fileid);
        out.put_string(&entry.name);
        out.put_u64(entry.cookie);
        if plus {
            put_attr(out, Some(&entry.attr));
            out.put_bool(true);
            out.put_opaque(&entry.handle.encode());
        }
    }
    out.put_bool(false);
    out.put_bool(eof && fitting == entries.len());
}

/// GETATTR's results.
pub fn encode_getattr(out: &mut Vec<u8>, result: Status<Attr>) {
    match result {
        Ok(attr) => {
            out.put_u32(status::OK);
            put_fattr(out, &attr);
        }
        Err(s) => out.put_u32(s),
    }
}

fn put_fsinfo(out: &mut Vec<u8>) {
    out.put_u32(MAX_IO); // rtmax
    out.put_u32(MAX_IO); // rtpref
    out.put_u32(4096); // rtmult
    out.put_u32(MAX_IO); // wtmax
    out.put_u32(MAX_IO); // wtpref
    out.put_u32(4096); // wtmult
    out.put_u32(DTPREF);
    out.put_u64(MAX_FILE_SIZE - 1);
    put_time(out, Time { seconds: 0, nanos: 1 }); // time_delta
    out.put_u32(FSF3_LINK | FSF3_SYMLINK | FSF3_HOMOGENEOUS | FSF3_CANSETTIME);
}

fn put_status<T>(out: &mut Vec<u8>, result: &Status<T>) {
    out.put_u32(match result {
        Ok(_) => status::OK,
        Err(s) => *s,
    });
}

/// A time's seconds as `nfstime3` carries them: past 2106 they do not fit
/// and are clamped.
fn wire_seconds(time: Time) -> u32 {
    time.seconds.min(u32::MAX as u64) as u32
}

/// `nfstime3`.
fn put_time(out: &mut Vec<u8>, time: Time) {
    out.put_u32(wire_seconds(time));
    out.put_u32(time.nanos);
}

/// `fattr3`.
pub fn put_fattr(out: &mut Vec<u8>, attr: &Attr) {
    out.put_u32(attr.kind.code() as u32);
    out.put_u32(attr.mode & 0o7777);
    out.put_u32(attr.nlink);
    out.put_u32(attr.uid);
    out.put_u32(attr.gid);
    out.put_u64(attr.size);
    out.put_u64(attr.used);
    out.put_u32(attr.rdev.0);
    out.put_u32(attr.rdev.1);
    out.put_u64(attr.fsid);
    out.put_u64(attr.fileid);
    put_time(out, attr.atime);
    put_time(out, attr.mtime);
    put_time(out, attr.ctime);
}

/// `post_op_attr`.
fn put_attr(out: &mut Vec<u8>, attr: Option<&Attr>) {
    match attr {
        Some(attr) => {
            out.put_bool(true);
            put_fattr(out, attr);
        }
        None => out.put_bool(false),
    }
}

/// `wcc_data` without pre-operation attributes (a call that failed, or
/// whose change could not be seen atomically with them).
fn put_wcc(out: &mut Vec<u8>, after: Option<&Attr>) {
    out.put_bool(false);
    put_attr(out, after);
}

/// `wcc_data` of a change the file system saw, or, if it gave none (the
/// call failed), the post-operation attributes of `fallback()` alone.
fn put_wcc_of(out: &mut Vec<u8>, wcc: Option<Wcc>, fallback: impl FnOnce() -> Option<Attr>) {
    match wcc {
        Some(Wcc {
            before: Some(before),
            after,
        }) => {
            out.put_bool(true);
            out.put_u64(before.size);
            put_time(out, before.mtime);
            put_time(out, before.ctime);
            put_attr(out, Some(&after));
        }
        Some(Wcc { before: None, after }) => put_wcc(out, Some(&after)),
        None => put_wcc(out, fallback().as_ref()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> Handle {
        Handle {
            pool: 5,
            dataset: 3,
            ino: 9,
            generation: 2,
        }
    }

    fn fh_args() -> Vec<u8> {
        let mut out = Vec::new();
        out.put_opaque(&handle().encode());
        out
    }

    fn dirop_args(name: &[u8]) -> Vec<u8> {
        let mut out = fh_args();
        out.put_string(name);
        out
    }

    /// sattr3 setting the mode to 0o640 and mtime to the client's 5.6.
    fn sattr_args() -> Vec<u8> {
        let mut out = Vec::new();
        for word in [1, 0o640, 0, 0, 0, 0, 2, 5, 6] {
            out.put_u32(word);
        }
        out
    }

    fn sattr_value() -> SetAttrs {
        SetAttrs {
            mode: Some(0o640),
            mtime: SetTime::Client(Time { seconds: 5, nanos: 6 }),
            ..SetAttrs::default()
        }
    }

    /// Decodes `args` as `procedure`, and checks that every shorter prefix
    /// is garbage (for procedures with arguments).
    fn decoded(procedure: u32, args: &[u8]) -> NfsCall<'_> {
        for cut in 0..args.len() {
            assert!(
                matches!(decode(procedure, &args[..cut]), Err(ArgsError::Garbage(_))),
                "procedure {procedure} decoded from {cut} of {} bytes",
                args.len()
            );
        }
        decode(procedure, args).unwrap()
    }

    #[test]
    fn every_procedure_decodes() {
        use procedure as p;
        let h = handle().encode();
        let fh = &h[..];
        assert_eq!(decode(p::NULL, &[]), Ok(NfsCall::Null));
        assert_eq!(decode(22, &[]), Err(ArgsError::ProcUnavail));
        let args = fh_args();
        assert_eq!(decoded(p::GETATTR, &args), NfsCall::GetAttr { fh });
        assert_eq!(decoded(p::READLINK, &args), NfsCall::ReadLink { fh });
        assert_eq!(decoded(p::FSSTAT, &args), NfsCall::FsStat { fh });
        assert_eq!(decoded(p::FSINFO, &args), NfsCall::FsInfo { fh });
        assert_eq!(decoded(p::PATHCONF, &args), NfsCall::PathConf { fh });

        let mut args = fh_args();
        args.extend(sattr_args());
        args.put_bool(true);
        args.put_u32(100);
        args.put_u32(7);
        assert_eq!(
            decoded(p::SETATTR, &args),
            NfsCall::SetAttr {
                fh,
                set: sattr_value(),
                guard: Some(Time { seconds: 100, nanos: 7 })
            }
        );

        let args = dirop_args(b"name");
        let at = DirOp { dir: fh, name: b"name" };
        assert_eq!(decoded(p::LOOKUP, &args), NfsCall::Lookup(at));
        assert_eq!(decoded(p::REMOVE, &args), NfsCall::Remove(at));
        assert_eq!(decoded(p::RMDIR, &args), NfsCall::Rmdir(at));

        let mut args = fh_args();
        args.put_u32(0x3f);
        assert_eq!(decoded(p::ACCESS, &args), NfsCall::Access { fh, mask: 0x3f });

        let mut args = fh_args();
        args.put_u64(1 << 33);
        args.put_u32(4096);
        assert_eq!(
            decoded(p::READ, &args),
            NfsCall::Read {
                fh,
                offset: 1 << 33,
                count: 4096
            }
        );
        assert_eq!(
            decoded(p::COMMIT, &args),
            NfsCall::Commit {
                fh,
                offset: 1 << 33,
                count: 4096
            }
        );

        let mut args = fh_args();
        args.put_u64(10);
        args.put_u32(5);
        args.put_u32(1);
        args.put_opaque(b"hello");
        assert_eq!(
            decoded(p::WRITE, &args),
            NfsCall::Write {
                fh,
                offset: 10,
                stable: Stable::DataSync,
                data: b"hello"
            }
        );
        // A count that disagrees with the data is garbage.
        let mut bad = args.clone();
        bad[fh_args().len() + 11] = 4;
        assert!(matches!(decode(p::WRITE, &bad), Err(ArgsError::Garbage(_))));

        let mut args = dirop_args(b"f");
        args.put_u32(1);
        args.extend(sattr_args());
        assert_eq!(
            decoded(p::CREATE, &args),
            NfsCall::Create {
                at: DirOp { dir: fh, name: b"f" },
                how: CreateHow::Guarded(sattr_value())
            }
        );
        let mut args = dirop_args(b"f");
        args.put_u32(2);
        args.put_fixed(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            decoded(p::CREATE, &args),
            NfsCall::Create {
                at: DirOp { dir: fh, name: b"f" },
                how: CreateHow::Exclusive([1, 2, 3, 4, 5, 6, 7, 8])
            }
        );

        let mut args = dirop_args(b"d");
        args.extend(sattr_args());
        let at = DirOp { dir: fh, name: b"d" };
        assert_eq!(
            decoded(p::MKDIR, &args),
            NfsCall::Mkdir {
                at,
                attrs: sattr_value()
            }
        );
        args.put_string(b"../target");
        assert_eq!(
            decoded(p::SYMLINK, &args),
            NfsCall::Symlink {
                at,
                attrs: sattr_value(),
                target: b"../target"
            }
        );

        let mut args = dirop_args(b"d");
        args.put_u32(4); // NF3CHR
        args.extend(sattr_args());
        args.put_u32(1);
        args.put_u32(3);
        assert_eq!(
            decoded(p::MKNOD, &args),
            NfsCall::Mknod {
                at,
                what: Mknod {
                    kind: FileType::Char,
                    attrs: sattr_value(),
                    rdev: (1, 3)
                }
            }
        );
        let mut args = dirop_args(b"d");
        args.put_u32(1); // NF3REG: decodes, refused when run
        assert_eq!(
            decoded(p::MKNOD, &args),
            NfsCall::Mknod {
                at,
                what: Mknod {
                    kind: FileType::Regular,
                    attrs: SetAttrs::default(),
                    rdev: (0, 0)
                }
            }
        );
        let mut args = dirop_args(b"d");
        args.put_u32(8);
        assert!(matches!(decode(p::MKNOD, &args), Err(ArgsError::Garbage(_))));

        let mut args = dirop_args(b"a");
        args.extend(dirop_args(b"b"));
        assert_eq!(
            decoded(p::RENAME, &args),
            NfsCall::Rename {
                from: DirOp { dir: fh, name: b"a" },
                to: DirOp { dir: fh, name: b"b" }
            }
        );

        let mut args = fh_args();
        args.extend(dirop_args(b"l"));
        assert_eq!(
            decoded(p::LINK, &args),
            NfsCall::Link {
                fh,
                at: DirOp { dir: fh, name: b"l" }
            }
        );

        let mut args = fh_args();
        args.put_u64(3);
        args.put_fixed(&[0; 8]);
        args.put_u32(8192);
        assert_eq!(
            decoded(p::READDIR, &args),
            NfsCall::ReadDir {
                dir: fh,
                cookie: 3,
                verifier: [0; 8],
                count: 8192
            }
        );
        args.put_u32(65536);
        assert_eq!(
            decoded(p::READDIRPLUS, &args),
            NfsCall::ReadDirPlus {
                dir: fh,
                cookie: 3,
                verifier: [0; 8],
                dircount: 8192,
                maxcount: 65536
            }
        );

        // A handle longer than NFS3_FHSIZE is garbage; a short one decodes
        // (and is NFS3ERR_BADHANDLE when run).
        let mut args = Vec::new();
        args.put_opaque(&[1; 65]);
        assert!(matches!(decode(p::GETATTR, &args), Err(ArgsError::Garbage(_))));
        let mut args = Vec::new();
        args.put_opaque(&[1; 4]);
        assert_eq!(decode(p::GETATTR, &args), Ok(NfsCall::GetAttr { fh: &[1; 4] }));
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(check_name(b"file"), Ok(()));
        assert_eq!(check_name(&[b'a'; MAX_NAME]), Ok(()));
        assert_eq!(check_name(&[b'a'; MAX_NAME + 1]), Err(status::NAMETOOLONG));
        for bad in [&b""[..], b".", b"..", b"a/b", b"a\0"] {
            assert_eq!(check_name(bad), Err(status::INVAL), "{bad:?}");
        }
        assert_eq!(check_lookup_name(b".."), Ok(()));
        assert_eq!(check_lookup_name(b"a/b"), Err(status::INVAL));
        let late = SetAttrs {
            atime: SetTime::Client(Time {
                seconds: 1,
                nanos: 1_000_000_000,
            }),
            ..SetAttrs::default()
        };
        assert_eq!(check_times(&late), Err(status::INVAL));
        assert_eq!(status_of(&FsError::NotEmpty), 66);
        assert_eq!(status_of(&FsError::BadType), 10007);
        assert_eq!(status_of(&FsError::Io("x".into())), 5);
    }

    fn attr() -> Attr {
        Attr {
            kind: FileType::Directory,
            mode: 0o40755,
            nlink: 2,
            uid: 1000,
            gid: 100,
            size: 0x1_0000_0002,
            used: 4096,
            rdev: (0, 0),
            fsid: 3,
            fileid: 9,
            atime: Time { seconds: 10, nanos: 1 },
            mtime: Time { seconds: 11, nanos: 2 },
            ctime: Time { seconds: 12, nanos: 3 },
        }
    }

    /// `fattr3` of [`attr`], computed by hand.
    fn attr_bytes() -> Vec<u8> {
        let words: [u32; 21] = [
            2, 0o755, 2, 1000, 100, // type (NF3DIR), mode (type bits dropped), nlink, uid, gid
            1, 2, // size
            0, 4096, // used
            0, 0, // rdev
            0, 3, // fsid
            0, 9, // fileid
            10, 1, 11, 2, 12, 3, // atime, mtime, ctime
        ];
        words.iter().flat_map(|w| w.to_be_bytes()).collect()
    }

    #[test]
    fn getattr_reply_bytes() {
        let mut out = Vec::new();
        encode_getattr(&mut out, Ok(attr()));
        let mut expected = vec![0, 0, 0, 0];
        expected.extend(attr_bytes());
        assert_eq!(out.len(), 4 + FATTR_BYTES);
        assert_eq!(out, expected);
        out.clear();
        encode_getattr(&mut out, Err(status::STALE));
        assert_eq!(out, [0, 0, 0, 70]);
    }

    fn entry(cookie: u64, name: &[u8]) -> DirEntry {
        DirEntry {
            cookie,
            name: name.to_vec(),
            fileid: 100 + cookie,
            handle: handle(),
            attr: attr(),
        }
    }

    #[test]
    fn readdir_reply_bytes() {
        let entries = [entry(1, b"."), entry(2, b".."), entry(3, b"hello")];
        let mut out = Vec::new();
        encode_readdir(&mut out, None, &entries, true, 4096, false);
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            0u32, // NFS3_OK
            0, // no directory attributes
            0, 0, // cookie verifier
            1, 0, 101, 1, u32::from_be_bytes(*b".\0\0\0"), 0, 1,
            1, 0, 102, 2, u32::from_be_bytes(*b"..\0\0"), 0, 2,
            1, 0, 103, 5, u32::from_be_bytes(*b"hell"), u32::from_be_bytes(*b"o\0\0\0"), 0, 3,
            0, // end of entries
            1, // eof
        ]
        .iter()
        .flat_map(|w| w.to_be_bytes())
        .collect();
        assert_eq!(out, expected);

        // With directory attributes, a budget for exactly two entries: the
        // third ends the reply, which is then not eof.
        let two = READDIR_FIXED_BYTES + entry_bytes(1, false) + entry_bytes(2, false);
        out.clear();
        encode_readdir(&mut out, Some(&attr()), &entries, true, two, false);
        assert_eq!(out.len(), two);
        assert_eq!(&out[4..8], [0, 0, 0, 1]);
        assert_eq!(&out[8..8 + FATTR_BYTES], attr_bytes());
        assert_eq!(&out[out.len() - 8..], [0, 0, 0, 0, 0, 0, 0, 0]);

        // Not even one fits: NFS3ERR_TOOSMALL with the directory's attributes.
        out.clear();
        encode_readdir(&mut out, None, &entries, true, READDIR_FIXED_BYTES, false);
        assert_eq!(out, [0, 0, 0x27, 0x15, 0, 0, 0, 0]);
        // An empty listing fits in any budget.
        out.clear();
        encode_readdir(&mut out, None, &[], true, 0, false);
        assert_eq!(
            out,
            [0u32, 0, 0, 0, 0, 1]
                .iter()
                .flat_map(|w| w.to_be_bytes())
                .collect::<Vec<_>>()
        );

        // READDIRPLUS carries each entry's attributes and handle.
        out.clear();
        encode_readdir(&mut out, None, &entries[2..], false, 4096, true);
        assert_eq!(out.len(), 4 + 4 + 8 + entry_bytes(5, true) + 8);
        let name_end = 16 + 4 + 8 + 4 + 8;
        assert_eq!(&out[name_end..name_end + 8], [0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(&out[name_end + 8..name_end + 12], [0, 0, 0, 1]);
        assert_eq!(&out[name_end + 12..name_end + 12 + FATTR_BYTES], attr_bytes());
        let fh_at = name_end + 12 + FATTR_BYTES;
        assert_eq!(&out[fh_at..fh_at + 8], [0, 0, 0, 1, 0, 0, 0, 32]);
        assert_eq!(&out[fh_at + 8..fh_at + 40], handle().encode());
        assert_eq!(&out[fh_at + 40..], [0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn fsinfo_reply_bytes() {
        let mut out = Vec::new();
        put_fsinfo(&mut out);
        let words: Vec<u32> = vec![
            1 << 20,
            1 << 20,
            4096,
            1 << 20,
            1 << 20,
            4096,
            65536,
            0,
            (MAX_FILE_SIZE - 1) as u32,
            0,
            1,
            0x1b,
        ];
        let expected: Vec<u8> = words
            .iter()
            .enumerate()
            .flat_map(|(i, w)| if i == 7 { ((MAX_FILE_SIZE - 1) >> 32) as u32 } else { *w }.to_be_bytes())
            .collect();
        assert_eq!(out, expected);
    }
}
