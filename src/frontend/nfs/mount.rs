//! The MOUNT protocol, version 3 (RFC 1813 appendix I): how a client turns
//! an export's path into its root file handle. Nothing is remembered per
//! client, so DUMP lists nobody and UMNT/UMNTALL only acknowledge; a
//! handle stays usable without a mount, as with every NFSv3 server (the
//! export's client check is made again on each NFS call).

use std::net::SocketAddr;

use super::xdr::{Decoder, Encode};
use super::ArgsError;
use crate::fs::{Cred, Export, Exports, FileType, Handle};

/// Longest path MNT and UMNT take (MNTPATHLEN).
pub const MAX_PATH: usize = 1024;

pub mod procedure {
    pub const NULL: u32 = 0;
    pub const MNT: u32 = 1;
    pub const DUMP: u32 = 2;
    pub const UMNT: u32 = 3;
    pub const UMNTALL: u32 = 4;
    pub const EXPORT: u32 = 5;
}

/// `mountstat3` values.
pub mod status {
    pub const OK: u32 = 0;
    pub const NOENT: u32 = 2;
    pub const ACCES: u32 = 13;
    pub const NOTDIR: u32 = 20;
}

/// A decoded MOUNT call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountCall<'a> {
    Null,
    Mnt { path: &'a [u8] },
    Dump,
    Umnt { path: &'a [u8] },
    UmntAll,
    Export,
}

/// Decodes the arguments of MOUNT procedure `procedure`.
pub fn decode(procedure: u32, args: &[u8]) -> Result<MountCall<'_>, ArgsError> {
    let mut d = Decoder::new(args);
    Ok(match procedure {
        procedure::NULL => MountCall::Null,
        procedure::MNT => MountCall::Mnt {
            path: d.string(MAX_PATH)?,
        },
        procedure::DUMP => MountCall::Dump,
        procedure::UMNT => MountCall::Umnt {
            path: d.string(MAX_PATH)?,
        },
        procedure::UMNTALL => MountCall::UmntAll,
        procedure::EXPORT => MountCall::Export,
        _ => return Err(ArgsError::ProcUnavail),
    })
}

/// An export path as clients send it: `/POOL/NAME`, perhaps with a
/// trailing slash.
fn export_path(path: &[u8]) -> Option<&str> {
    let path = std::str::from_utf8(path).ok()?;
    let trimmed = path.trim_end_matches('/');
    Some(if trimmed.is_empty() { path } else { trimmed })
}

/// The export `path` is in and the directory it names: an export's root,
/// or (as knfsd's mountd allows) a directory below it, looked up as root
/// on the server, `.snapshot/NAME` included (libnfs's tools mount the
/// directory of the file they open).
fn resolve(exports: &dyn Exports, path: &str) -> Result<(Export, Handle), u32> {
    if let Some(export) = exports.by_path(path) {
        let root = export.fs.root();
        return Ok((export, root));
    }
    let mut prefix = path;
    let export = loop {
        prefix = match prefix.rsplit_once('/') {
            Some((head, _)) if !head.is_empty() => head,
            _ => return Err(status::NOENT),
        };
        if let Some(export) = exports.by_path(prefix) {
            break export;
        }
    };
    let mut fs = export.fs.clone();
    let mut handle = fs.root();
    for name in path[prefix.len()..].split('/').filter(|n| !n.is_empty()) {
        if name == "." || name == ".." {
            return Err(status::NOENT);
        }
        let (next, attr) = fs
            .lookup(&handle, name.as_bytes(), &Cred::root())
            .map_err(|_| status::NOENT)?;
        if attr.kind != FileType::Directory {
            return Err(status::NOTDIR);
        }
        if next.dataset != handle.dataset {
            fs = exports.by_dataset(next.pool, next.dataset).ok_or(status::NOENT)?.fs;
        }
        handle = next;
    }
    Ok((export, handle))
}

/// Runs a MOUNT call from `peer`, appending its results to `out` (a
/// SUCCESS reply).
pub fn execute(exports: &dyn Exports, peer: SocketAddr, call: &MountCall<'_>, out: &mut Vec<u8>) {
    match *call {
        MountCall::Null | MountCall::Umnt { .. } | MountCall::UmntAll => {}
        MountCall::Mnt { path } => {
            let (export, handle) = match export_path(path).ok_or(status::NOENT).and_then(|p| resolve(exports, p)) {
                Ok(found) => found,
                Err(code) => {
                    out.put_u32(code);
                    return;
                }
            };
            if !export.options.allows(peer.ip(), peer.port()) {
                tracing::info!("nfs: MNT {} refused to {peer}", export.path);
                out.put_u32(status::ACCES);
                return;
            }
            out.put_u32(status::OK);
            out.put_opaque(&handle.encode());
            // AUTH_SYS first: the client uses the first flavor it knows.
            out.put_u32(2);
            out.put_u32(super::rpc::AUTH_SYS);
            out.put_u32(super::rpc::AUTH_NONE);
        }
        // Mounts are not remembered (see the module comment).
        MountCall::Dump => out.put_bool(false),
        MountCall::Export => {
            for export in exports.all() {
                out.put_bool(true);
                out.put_string(export.path.as_bytes());
                for net in &export.options.clients {
                    out.put_bool(true);
                    out.put_string(net.to_string().as_bytes());
                }
                out.put_bool(false);
            }
            out.put_bool(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_decode() {
        let mut args = Vec::new();
        args.put_string(b"/tank/home");
        assert_eq!(
            decode(procedure::MNT, &args),
            Ok(MountCall::Mnt { path: b"/tank/home" })
        );
        assert_eq!(
            decode(procedure::UMNT, &args),
            Ok(MountCall::Umnt { path: b"/tank/home" })
        );
        assert_eq!(decode(procedure::NULL, &[]), Ok(MountCall::Null));
        assert_eq!(decode(procedure::DUMP, &[]), Ok(MountCall::Dump));
        assert_eq!(decode(procedure::UMNTALL, &[]), Ok(MountCall::UmntAll));
        assert_eq!(decode(procedure::EXPORT, &[]), Ok(MountCall::Export));
        assert_eq!(decode(6, &[]), Err(ArgsError::ProcUnavail));
        assert!(matches!(decode(procedure::MNT, &args[..7]), Err(ArgsError::Garbage(_))));
        let mut long = Vec::new();
        long.put_string(&[b'a'; MAX_PATH + 1]);
        assert!(matches!(decode(procedure::MNT, &long), Err(ArgsError::Garbage(_))));
    }

    #[test]
    fn paths_lose_trailing_slashes() {
        assert_eq!(export_path(b"/tank/home/"), Some("/tank/home"));
        assert_eq!(export_path(b"/tank/home"), Some("/tank/home"));
        assert_eq!(export_path(b"/"), Some("/"));
        assert_eq!(export_path(&[0xff]), None);
    }

    #[test]
    fn empty_export_list_and_unknown_paths() {
        struct NoExports;
        impl Exports for NoExports {
            fn by_path(&self, _: &str) -> Option<crate::fs::Export> {
                None
            }
            fn by_dataset(&self, _: u64, _: u32) -> Option<crate::fs::Export> {
                None
            }
            fn all(&self) -> Vec<crate::fs::Export> {
                Vec::new()
            }
        }
        let peer: SocketAddr = "127.0.0.1:900".parse().unwrap();
        let mut out = Vec::new();
        execute(&NoExports, peer, &MountCall::Mnt { path: b"/x/y" }, &mut out);
        assert_eq!(out, [0, 0, 0, 2]);
        out.clear();
        execute(&NoExports, peer, &MountCall::Export, &mut out);
        assert_eq!(out, [0, 0, 0, 0]);
    }
}
