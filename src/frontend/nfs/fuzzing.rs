//! Fuzz entry points for the NFS server, shared by the `cargo fuzz`
//! targets in `fuzz/` and by the regression tests that replay
//! `fuzz/corpus-seeds/nfs_rpc/` and `fuzz/corpus-seeds/nfs_call/`.
//! [`rpc_input`] needs no file system: the decoders turn bytes into typed
//! calls. [`call_sequence_input`] runs whole procedures against a dataset
//! on an in-memory pool, the way the server answers a record.

use std::net::SocketAddr;
use std::sync::Arc;

use super::mount::{self, MountCall};
use super::nfs3::{self, procedure, status, NfsCall, MAX_FH, MAX_IO};
use super::portmap;
use super::rpc::{self, Auth, AUTH_NONE, AUTH_SYS, MAX_AUTH_GIDS, MAX_RECORD};
use super::server;
use super::xdr::{Decoder, Encode};
use super::{NFS_PROGRAM, NFS_VERSION};
use crate::device::sim::SimDevice;
use crate::fs::{CreateHow, Cred, Export, ExportOptions, Exports, FileSystem, Handle, SetAttrs, Squash, Stable};
use crate::pool::superblock::Role;
use crate::pool::{NewDevice, Pool};

/// Record marking, the call header and credentials, routing, and every
/// procedure's argument decoder over the call's arguments: none may panic,
/// and whatever decodes respects the bounds.
pub fn rpc_input(data: &[u8]) {
    // The bytes as a stream of marked fragments.
    if let Ok(Some((record, used))) = rpc::split_record(data) {
        assert!(record.len() <= MAX_RECORD);
        assert!(used <= data.len() && used >= record.len() + 4);
        call_input(&record);
    }
    // The bytes as one record, so the call decoders see them unmarked too.
    call_input(&data[..data.len().min(MAX_RECORD)]);
    let _ = rpc::AuthSys::decode(data);
}

fn call_input(record: &[u8]) {
    let call = match rpc::parse_call(record) {
        Ok(call) => call,
        Err(e) => {
            let _ = e.reply();
            return;
        }
    };
    if let Auth::Sys(sys) = &call.auth {
        assert!(sys.gids.len() <= MAX_AUTH_GIDS);
    }
    assert!(call.args.len() <= record.len());
    let _ = server::route(&call);
    for procedure in 0..=nfs3::procedure::COMMIT + 1 {
        if let Ok(decoded) = nfs3::decode(procedure, call.args) {
            check_nfs(&decoded);
        }
    }
    for procedure in 0..=mount::procedure::EXPORT + 1 {
        if let Ok(MountCall::Mnt { path } | MountCall::Umnt { path }) = mount::decode(procedure, call.args) {
            assert!(path.len() <= mount::MAX_PATH);
        }
    }
    for procedure in 0..=5 {
        let _ = portmap::decode(procedure, call.args);
    }
}

/// The bounds a decoded NFS call keeps.
fn check_nfs(call: &NfsCall<'_>) {
    let handle = |fh: &[u8]| assert!(fh.len() <= MAX_FH);
    match call {
        NfsCall::Write { fh, data, .. } => {
            handle(fh);
            assert!(data.len() <= MAX_IO as usize);
        }
        NfsCall::Rename { from, to } => {
            handle(from.dir);
            handle(to.dir);
        }
        NfsCall::Lookup(at) | NfsCall::Remove(at) | NfsCall::Rmdir(at) => handle(at.dir),
        NfsCall::Create { at, .. } | NfsCall::Mkdir { at, .. } | NfsCall::Mknod { at, .. } => handle(at.dir),
        NfsCall::Symlink { at, target, .. } => {
            handle(at.dir);
            assert!(target.len() <= rpc::MAX_RECORD);
        }
        NfsCall::Link { fh, at } => {
            handle(fh);
            handle(at.dir);
        }
        _ => {}
    }
    let _ = call.reply_capacity();
}

/// The dataset behind [`call_sequence_input`], exported at [`FUZZ_PATH`].
const FUZZ_DATASET: u32 = 5;
pub const FUZZ_PATH: &str = "/fuzz/files";
/// Calls one [`call_sequence_input`] runs at most.
const FUZZ_CALLS: usize = 64;

struct FuzzExport {
    fs: Arc<FileSystem>,
}

impl FuzzExport {
    fn export(&self) -> Export {
        Export {
            path: FUZZ_PATH.to_string(),
            fs: self.fs.clone(),
            options: ExportOptions {
                squash: Squash::None,
                ..ExportOptions::default()
            },
        }
    }
}

impl Exports for FuzzExport {
    fn by_path(&self, path: &str) -> Option<Export> {
        (path == FUZZ_PATH).then(|| self.export())
    }
    fn by_dataset(&self, _pool: u64, dataset: u32) -> Option<Export> {
        (dataset == FUZZ_DATASET).then(|| self.export())
    }
    fn all(&self) -> Vec<Export> {
        vec![self.export()]
    }
}

/// A fresh dataset on a simulated (in-memory) device with a small tree:
/// `/f` (a file of 10,000 bytes), `/d` (a directory holding the empty file
/// `e`), `/l` (a symbolic link to `d/e`). The handles a call can start
/// with: none, then the root's, `f`'s, `d`'s and `l`'s.
async fn fuzz_dataset() -> (Arc<Pool>, FuzzExport, [Option<Vec<u8>>; 5]) {
    let sim = SimDevice::new(256 << 20, 1);
    let devices = vec![NewDevice {
        device: sim.as_device(),
        role: Role::Fast,
    }];
    let pool = Pool::create("fuzz", 1 << 20, devices).await.expect("a pool");
    let fs = FileSystem::open(&pool, FUZZ_DATASET, 16 << 10, 0)
        .await
        .expect("a dataset");
    let (cred, root) = (Cred::root(), fs.root());
    let mode = |mode| SetAttrs {
        mode: Some(mode),
        ..SetAttrs::default()
    };
    let (f, _, _) = fs
        .create(&root, b"f", &cred, CreateHow::Guarded(mode(0o666)))
        .await
        .expect("a file");
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    fs.write(&f, &cred, 0, &data, Stable::FileSync).await.expect("its data");
    let (d, _, _) = fs.mkdir(&root, b"d", &cred, mode(0o777)).await.expect("a directory");
    fs.create(&d, b"e", &cred, CreateHow::Guarded(mode(0o644)))
        .await
        .expect("a file in it");
    let (l, _, _) = fs
        .symlink(&root, b"l", &cred, b"d/e", SetAttrs::default())
        .await
        .expect("a link");
    let [root, f, d, l] = [root, f, d, l].map(|h: Handle| Some(h.encode().to_vec()));
    (pool, FuzzExport { fs }, [None, root, f, d, l])
}

/// Whole NFSv3 calls against a dataset on an in-memory pool, answered as
/// the server answers a record: a sequence of
/// `[procedure][flags][arguments length: u16 big-endian][arguments]`,
/// where the low 3 bits of `flags` put a handle of the tree (see
/// `fuzz_dataset`) before the arguments (0: none) and bit 3 calls as uid
/// 1000 instead of root. Nothing may panic; every call gets an accepted
/// reply with its xid and a known status, and a READDIR or READDIRPLUS
/// that succeeds lists only entries after its cookie.
pub fn call_sequence_input(data: &[u8]) {
    let peer: SocketAddr = "127.0.0.1:700".parse().expect("an address");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (_pool, exports, handles) = fuzz_dataset().await;
        let mut rest = data;
        for xid in 1..=FUZZ_CALLS as u32 {
            if rest.len() < 4 {
                break;
            }
            let number = u32::from(rest[0]) % (procedure::COMMIT + 2);
            let flags = rest[1];
            let len = u16::from_be_bytes([rest[2], rest[3]]) as usize;
            rest = &rest[4..];
            let take = len.min(rest.len());
            let (args_tail, after) = rest.split_at(take);
            rest = after;
            let mut args = Vec::new();
            if let Some(Some(fh)) = handles.get((flags & 7) as usize) {
                args.put_opaque(fh);
            }
            args.extend_from_slice(args_tail);
            let uid = if flags & 8 != 0 { 1000 } else { 0 };
            let record = call_record(xid, number, uid, &args);
            let reply = server::answer(&exports, peer, 2049, &record)
                .await
                .expect("a call gets a reply");
            check_reply(xid, number, &args, &reply.bytes());
        }
    });
}

/// A call record (no record mark) with an AUTH_SYS credential.
fn call_record(xid: u32, number: u32, uid: u32, args: &[u8]) -> Vec<u8> {
    let mut cred = Vec::new();
    cred.put_u32(1);
    cred.put_string(b"fuzz");
    cred.put_u32(uid);
    cred.put_u32(uid);
    cred.put_u32(0);
    let mut record = Vec::new();
    for word in [xid, 0, 2, NFS_PROGRAM, NFS_VERSION, number, AUTH_SYS] {
        record.put_u32(word);
    }
    record.put_opaque(&cred);
    record.put_u32(AUTH_NONE);
    record.put_opaque(&[]);
    record.extend_from_slice(args);
    record
}

/// Every `nfsstat3` the server answers with.
const KNOWN_STATUSES: [u32; 23] = [
    status::OK,
    status::PERM,
    status::NOENT,
    status::IO,
    status::ACCES,
    status::EXIST,
    status::XDEV,
    status::NOTDIR,
    status::ISDIR,
    status::INVAL,
    status::FBIG,
    status::NOSPC,
    status::ROFS,
    status::MLINK,
    status::NAMETOOLONG,
    status::NOTEMPTY,
    status::DQUOT,
    status::STALE,
    status::BADHANDLE,
    status::NOT_SYNC,
    status::NOTSUPP,
    status::TOOSMALL,
    status::BADTYPE,
];

fn check_reply(xid: u32, number: u32, args: &[u8], reply: &[u8]) {
    let mut d = Decoder::new(reply);
    let mark = d.u32().expect("a record mark");
    assert_eq!((mark & !rpc::LAST_FRAGMENT) as usize, reply.len() - 4, "record mark");
    assert_eq!(d.u32(), Ok(xid), "the reply's xid");
    assert_eq!(d.u32(), Ok(1), "a reply");
    assert_eq!(d.u32(), Ok(0), "accepted");
    let _flavor = d.u32().expect("a verifier");
    let _verifier = d.opaque(400).expect("a verifier");
    let accept = d.u32().expect("an accept status");
    // NULL has no results; garbage arguments are refused with
    // GARBAGE_ARGS (4), the procedure past COMMIT as unavailable (3).
    if number == procedure::NULL {
        assert!(accept == 0 || accept == 4, "NULL: accept {accept}");
        return;
    }
    if accept != 0 {
        assert!(
            accept == 4 || (accept == 3 && number > procedure::COMMIT),
            "procedure {number}: accept {accept}"
        );
        return;
    }
    let stat = d.u32().expect("a status");
    assert!(KNOWN_STATUSES.contains(&stat), "procedure {number}: status {stat}");
    if stat == status::OK && (number == procedure::READDIR || number == procedure::READDIRPLUS) {
        let mut call = Decoder::new(args);
        let _dir = call.opaque(MAX_FH).expect("decoded before");
        let cookie = call.u64().expect("decoded before");
        for entry_cookie in readdir_cookies(&mut d, number == procedure::READDIRPLUS) {
            assert!(
                entry_cookie > cookie,
                "READDIR after cookie {cookie} listed cookie {entry_cookie}"
            );
        }
    }
}

/// The cookies of a READDIR(PLUS) reply's entries, after its status.
fn readdir_cookies(d: &mut Decoder<'_>, plus: bool) -> Vec<u64> {
    let skip_attr = |d: &mut Decoder<'_>| {
        if d.bool().expect("attributes follow?") {
            d.opaque_fixed(84).expect("fattr3");
        }
    };
    skip_attr(d);
    d.opaque_fixed(8).expect("a cookie verifier");
    let mut cookies = Vec::new();
    while d.bool().expect("an entry follows?") {
        d.u64().expect("a file id");
        d.string(4096).expect("a name");
        cookies.push(d.u64().expect("a cookie"));
        if plus {
            skip_attr(d);
            if d.bool().expect("a handle follows?") {
                d.opaque(MAX_FH).expect("a handle");
            }
        }
    }
    cookies
}

#[cfg(test)]
mod tests {
    fn seeds() -> Vec<Vec<u8>> {
        seeds_of("nfs_rpc")
    }

    fn seeds_of(target: &str) -> Vec<Vec<u8>> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus-seeds")
            .join(target);
        let mut paths: Vec<_> = std::fs::read_dir(root)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .collect();
        paths.sort();
        paths.into_iter().map(|path| std::fs::read(path).unwrap()).collect()
    }

    /// Replays the seeds of whole calls against a dataset.
    #[test]
    fn call_seeds_run_against_a_dataset() {
        let seeds = seeds_of("nfs_call");
        for seed in &seeds {
            super::call_sequence_input(seed);
        }
        assert!(seeds.len() >= 6, "only {} seeds found", seeds.len());
    }

    /// Replays the regression seeds.
    #[test]
    fn corpus_seeds_do_not_panic() {
        let seeds = seeds();
        for seed in &seeds {
            super::rpc_input(seed);
        }
        assert!(seeds.len() >= 8, "only {} seeds found", seeds.len());
    }

    /// Every prefix of each seed, and each of its first bytes flipped: a
    /// cheap stand-in for a fuzzing run, in every test run.
    #[test]
    fn mutated_seeds_do_not_panic() {
        for seed in seeds() {
            for len in 0..=seed.len().min(512) {
                super::rpc_input(&seed[..len]);
            }
            for at in 0..seed.len().min(256) {
                for flip in [0x01, 0x80, 0xff] {
                    let mut mutated = seed.clone();
                    mutated[at] ^= flip;
                    super::rpc_input(&mutated);
                }
            }
        }
    }
}
