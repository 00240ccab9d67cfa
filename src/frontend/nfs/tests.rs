//! The NFS server end to end: a dataset on a simulated device, served on a
//! loopback port, driven by a small hand-written client over TCP (MOUNT,
//! then the NFS procedures as a client uses them).

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::nfs3::{procedure as p, status};
use super::rpc::{AUTH_NONE, AUTH_SYS, LAST_FRAGMENT};
use super::xdr::{Decoder, Encode};
use super::{MOUNT_PROGRAM, NFS_PROGRAM};
use crate::device::sim::SimDevice;
use crate::fs::{Export, ExportOptions, Exports, FileSystem, Squash};
use crate::pool::superblock::Role;
use crate::pool::{NewDevice, Pool};

const PATH: &str = "/test/files";
const DATASET: u32 = 5;

/// One export whose options a test can change.
struct OneExport {
    fs: Arc<FileSystem>,
    options: Mutex<ExportOptions>,
}

impl OneExport {
    fn export(&self) -> Export {
        Export {
            path: PATH.to_string(),
            fs: self.fs.clone(),
            options: self.options.lock().unwrap().clone(),
        }
    }
}

impl Exports for OneExport {
    fn by_path(&self, path: &str) -> Option<Export> {
        (path == PATH).then(|| self.export())
    }
    fn by_dataset(&self, dataset: u32) -> Option<Export> {
        (dataset == DATASET).then(|| self.export())
    }
    fn all(&self) -> Vec<Export> {
        vec![self.export()]
    }
}

struct Client {
    stream: TcpStream,
    xid: u32,
    uid: u32,
}

impl Client {
    fn record(&mut self, prog: u32, procedure: u32, args: &[u8]) -> (u32, Vec<u8>) {
        self.xid += 1;
        let mut record = Vec::new();
        record.put_u32(0);
        for word in [self.xid, 0, 2, prog, 3, procedure, AUTH_SYS] {
            record.put_u32(word);
        }
        let mut cred = Vec::new();
        cred.put_u32(1);
        cred.put_string(b"test");
        cred.put_u32(self.uid);
        cred.put_u32(self.uid);
        cred.put_u32(0);
        record.put_opaque(&cred);
        record.put_u32(AUTH_NONE);
        record.put_opaque(&[]);
        record.extend_from_slice(args);
        let len = (record.len() - 4) as u32;
        record[..4].copy_from_slice(&(LAST_FRAGMENT | len).to_be_bytes());
        (self.xid, record)
    }

    /// Reads one reply: its xid, and its accept_stat and results.
    async fn reply(&mut self) -> (u32, Vec<u8>) {
        let mut mark = [0u8; 4];
        self.stream.read_exact(&mut mark).await.unwrap();
        let mut reply = vec![0u8; (u32::from_be_bytes(mark) & !LAST_FRAGMENT) as usize];
        self.stream.read_exact(&mut reply).await.unwrap();
        // REPLY, MSG_ACCEPTED, an AUTH_NONE verifier.
        assert_eq!(&reply[4..20], [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        (u32::from_be_bytes(reply[..4].try_into().unwrap()), reply[20..].to_vec())
    }

    async fn call(&mut self, prog: u32, procedure: u32, args: &[u8]) -> Vec<u8> {
        let (xid, record) = self.record(prog, procedure, args);
        self.stream.write_all(&record).await.unwrap();
        let (got, results) = self.reply().await;
        assert_eq!(got, xid);
        results
    }

    async fn nfs(&mut self, procedure: u32, args: &[u8]) -> Vec<u8> {
        self.call(NFS_PROGRAM, procedure, args).await
    }
}

fn fh_args(fh: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.put_opaque(fh);
    out
}

fn dirop(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut out = fh_args(dir);
    out.put_string(name);
    out
}

/// A `sattr3` setting only the mode.
fn mode(mode: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for word in [1, mode, 0, 0, 0, 0, 0] {
        out.put_u32(word);
    }
    out
}

/// The accept_stat, then the results; this reads the status.
fn status_of(results: &[u8]) -> u32 {
    u32::from_be_bytes(results[4..8].try_into().unwrap())
}

struct Attrs {
    kind: u32,
    size: u64,
    fileid: u64,
    ctime: (u32, u32),
}

fn fattr(d: &mut Decoder<'_>) -> Attrs {
    let kind = d.u32().unwrap();
    for _ in 0..4 {
        d.u32().unwrap();
    }
    let size = d.u64().unwrap();
    d.u64().unwrap();
    d.u64().unwrap();
    d.u64().unwrap();
    let fileid = d.u64().unwrap();
    for _ in 0..4 {
        d.u32().unwrap();
    }
    let ctime = (d.u32().unwrap(), d.u32().unwrap());
    Attrs {
        kind,
        size,
        fileid,
        ctime,
    }
}

fn post_op_attr(d: &mut Decoder<'_>) -> Option<Attrs> {
    d.bool().unwrap().then(|| fattr(d))
}

fn wcc(d: &mut Decoder<'_>) -> Option<Attrs> {
    assert!(!d.bool().unwrap(), "pre-operation attributes are not sent");
    post_op_attr(d)
}

/// Results after accept_stat (SUCCESS) and the NFS status.
fn body(results: &[u8]) -> Decoder<'_> {
    assert_eq!(&results[..4], [0, 0, 0, 0]);
    let mut d = Decoder::new(&results[4..]);
    d.u32().unwrap();
    d
}

/// CREATE, MKDIR, SYMLINK: the new handle.
fn made(results: &[u8]) -> Vec<u8> {
    assert_eq!(status_of(results), status::OK, "{results:?}");
    let mut d = body(results);
    assert!(d.bool().unwrap());
    let fh = d.opaque(64).unwrap().to_vec();
    assert!(post_op_attr(&mut d).is_some());
    assert!(wcc(&mut d).is_some());
    fh
}

/// Lists a directory with READDIR(PLUS) in pages of `count` bytes.
async fn list(client: &mut Client, dir: &[u8], count: u32, plus: bool) -> Vec<String> {
    let mut names = Vec::new();
    let mut cookie = 0;
    loop {
        let mut args = fh_args(dir);
        args.put_u64(cookie);
        args.put_fixed(&[0; 8]);
        args.put_u32(count);
        if plus {
            args.put_u32(count);
        }
        let results = client.nfs(if plus { p::READDIRPLUS } else { p::READDIR }, &args).await;
        assert_eq!(status_of(&results), status::OK);
        assert!(results.len() - 4 <= count as usize);
        let mut d = body(&results);
        assert!(post_op_attr(&mut d).is_some());
        assert_eq!(d.array::<8>().unwrap(), [0; 8]);
        let mut page = 0;
        while d.bool().unwrap() {
            d.u64().unwrap();
            names.push(String::from_utf8(d.string(255).unwrap().to_vec()).unwrap());
            cookie = d.u64().unwrap();
            if plus {
                assert!(post_op_attr(&mut d).is_some());
                assert!(d.bool().unwrap());
                assert_eq!(d.opaque(64).unwrap().len(), 24);
            }
            page += 1;
        }
        assert!(page > 0);
        if d.bool().unwrap() {
            return names;
        }
    }
}

#[tokio::test]
async fn a_client_mounts_writes_reads_and_lists() {
    let sim = SimDevice::new(160 << 20, 11);
    let devices = vec![NewDevice {
        device: sim.as_device(),
        role: Role::Fast,
    }];
    let pool = Pool::create("test", 1 << 20, devices).await.unwrap();
    let fs = FileSystem::open(&pool, DATASET, 16 << 10, 0).await.unwrap();
    let exports = Arc::new(OneExport {
        fs: fs.clone(),
        options: Mutex::new(ExportOptions {
            squash: Squash::None,
            ..ExportOptions::default()
        }),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop_sender, stop) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(super::server::serve(
        listener,
        exports.clone(),
        crate::frontend::limits::ConnectionLimits::new("nfs", 16, 16),
        stop,
    ));
    let mut client = Client {
        stream: TcpStream::connect(address).await.unwrap(),
        xid: 0,
        uid: 0,
    };

    // MOUNT: the root handle, AUTH_SYS offered first; EXPORT lists us.
    let mut args = Vec::new();
    args.put_string(format!("{PATH}/").as_bytes());
    let results = client.call(MOUNT_PROGRAM, 1, &args).await;
    let mut d = Decoder::new(&results[4..]);
    assert_eq!(d.u32().unwrap(), 0);
    let root = d.opaque(64).unwrap().to_vec();
    assert_eq!(root, fs.root().encode());
    assert_eq!((d.u32().unwrap(), d.u32().unwrap()), (2, AUTH_SYS));
    let results = client.call(MOUNT_PROGRAM, 5, &[]).await;
    let mut d = Decoder::new(&results[4..]);
    assert!(d.bool().unwrap());
    assert_eq!(d.string(1024).unwrap(), PATH.as_bytes());

    // CREATE, WRITE (pipelined), COMMIT, READ.
    let mut args = dirop(&root, b"hello");
    args.put_u32(1);
    args.extend(mode(0o644));
    let file = made(&client.nfs(p::CREATE, &args).await);
    let mut expected = Vec::new();
    let mut xids = Vec::new();
    let mut burst = Vec::new();
    for i in 0..8u64 {
        let chunk = vec![i as u8 + 1; 5000];
        let mut args = fh_args(&file);
        args.put_u64(i * 5000);
        args.put_u32(5000);
        args.put_u32(0);
        args.put_opaque(&chunk);
        expected.extend(chunk);
        let (xid, record) = client.record(NFS_PROGRAM, p::WRITE, &args);
        xids.push(xid);
        burst.extend(record);
    }
    client.stream.write_all(&burst).await.unwrap();
    for _ in 0..8 {
        let (xid, results) = client.reply().await;
        assert!(xids.contains(&xid));
        assert_eq!(status_of(&results), status::OK);
        let mut d = body(&results);
        assert!(wcc(&mut d).is_some());
        assert_eq!(d.u32().unwrap(), 5000);
        d.u32().unwrap();
        assert_eq!(d.array::<8>().unwrap(), fs.write_verifier());
    }
    let mut args = fh_args(&file);
    args.put_u64(0);
    args.put_u32(0);
    let results = client.nfs(p::COMMIT, &args).await;
    assert_eq!(status_of(&results), status::OK);
    let mut d = body(&results);
    wcc(&mut d);
    assert_eq!(d.array::<8>().unwrap(), fs.write_verifier());

    let mut args = fh_args(&file);
    args.put_u64(0);
    args.put_u32(1 << 20);
    let results = client.nfs(p::READ, &args).await;
    assert_eq!(status_of(&results), status::OK);
    let mut d = body(&results);
    assert_eq!(post_op_attr(&mut d).unwrap().size, 40_000);
    assert_eq!(d.u32().unwrap(), 40_000);
    assert!(d.bool().unwrap());
    assert_eq!(d.opaque(1 << 20).unwrap(), &expected[..]);

    // LOOKUP finds it; GETATTR; SETATTR with a wrong and a right guard.
    let results = client.nfs(p::LOOKUP, &dirop(&root, b"hello")).await;
    let mut d = body(&results);
    assert_eq!(d.opaque(64).unwrap(), &file[..]);
    let results = client.nfs(p::LOOKUP, &dirop(&root, b"nothing")).await;
    assert_eq!(status_of(&results), status::NOENT);
    let results = client.nfs(p::GETATTR, &fh_args(&file)).await;
    let attrs = fattr(&mut body(&results));
    assert_eq!((attrs.kind, attrs.size), (1, 40_000));
    let mut args = fh_args(&file);
    args.extend(mode(0o600));
    args.put_bool(true);
    args.put_u32(attrs.ctime.0.wrapping_add(1));
    args.put_u32(attrs.ctime.1);
    assert_eq!(status_of(&client.nfs(p::SETATTR, &args).await), status::NOT_SYNC);
    let mut args = fh_args(&file);
    args.extend(mode(0o600));
    args.put_bool(true);
    args.put_u32(attrs.ctime.0);
    args.put_u32(attrs.ctime.1);
    assert_eq!(status_of(&client.nfs(p::SETATTR, &args).await), status::OK);

    // MKDIR, SYMLINK, READLINK, bad names.
    let mut args = dirop(&root, b"d");
    args.extend(mode(0o755));
    let dir = made(&client.nfs(p::MKDIR, &args).await);
    let mut args = dirop(&root, b"l");
    args.extend(mode(0o777));
    args.put_string(b"hello");
    let link = made(&client.nfs(p::SYMLINK, &args).await);
    let results = client.nfs(p::READLINK, &fh_args(&link)).await;
    let mut d = body(&results);
    post_op_attr(&mut d);
    assert_eq!(d.string(4096).unwrap(), b"hello");
    for (name, expected) in [(&b"a/b"[..], status::INVAL), (&[b'n'; 256][..], status::NAMETOOLONG)] {
        let mut args = dirop(&root, name);
        args.put_u32(0);
        args.extend(mode(0o644));
        assert_eq!(status_of(&client.nfs(p::CREATE, &args).await), expected);
    }

    // Twenty more files, listed in small pages by both READDIRs.
    for i in 0..20 {
        let mut args = dirop(&dir, format!("file-{i:02}").as_bytes());
        args.put_u32(1);
        args.extend(mode(0o644));
        made(&client.nfs(p::CREATE, &args).await);
    }
    let mut want: Vec<String> = [".", "..", "d", "hello", "l"].iter().map(|s| s.to_string()).collect();
    want.sort();
    let mut names = list(&mut client, &root, 256, false).await;
    names.sort();
    assert_eq!(names, want);
    let names = list(&mut client, &dir, 300, false).await;
    assert_eq!(names.len(), 22);
    let names = list(&mut client, &dir, 1200, true).await;
    assert_eq!(names.len(), 22);
    // Too small for a single entry.
    let mut args = fh_args(&dir);
    args.put_u64(0);
    args.put_fixed(&[0; 8]);
    args.put_u32(100);
    assert_eq!(status_of(&client.nfs(p::READDIR, &args).await), status::TOOSMALL);

    // RENAME, LINK, REMOVE, RMDIR.
    let mut args = dirop(&root, b"hello");
    args.extend(dirop(&dir, b"moved"));
    assert_eq!(status_of(&client.nfs(p::RENAME, &args).await), status::OK);
    let mut args = fh_args(&file);
    args.extend(dirop(&root, b"again"));
    let results = client.nfs(p::LINK, &args).await;
    assert_eq!(status_of(&results), status::OK);
    let mut d = body(&results);
    assert_eq!(post_op_attr(&mut d).unwrap().fileid, attrs.fileid);
    assert_eq!(
        status_of(&client.nfs(p::RMDIR, &dirop(&root, b"d")).await),
        status::NOTEMPTY
    );
    assert_eq!(
        status_of(&client.nfs(p::REMOVE, &dirop(&root, b"again")).await),
        status::OK
    );
    assert_eq!(
        status_of(&client.nfs(p::REMOVE, &dirop(&root, b"again")).await),
        status::NOENT
    );

    // FSSTAT, FSINFO, PATHCONF, ACCESS.
    for procedure in [p::FSSTAT, p::FSINFO, p::PATHCONF] {
        assert_eq!(status_of(&client.nfs(procedure, &fh_args(&root)).await), status::OK);
    }
    let mut args = fh_args(&root);
    args.put_u32(0x3f);
    let results = client.nfs(p::ACCESS, &args).await;
    let mut d = body(&results);
    post_op_attr(&mut d);
    let granted = d.u32().unwrap();
    assert_ne!(granted & 0x04, 0, "root may modify the root directory");

    // Read-only: changes are refused, ACCESS grants no modification.
    exports.options.lock().unwrap().read_only = true;
    let mut args = dirop(&root, b"new");
    args.put_u32(0);
    args.extend(mode(0o644));
    assert_eq!(status_of(&client.nfs(p::CREATE, &args).await), status::ROFS);
    let mut args = fh_args(&root);
    args.put_u32(0x3f);
    let results = client.nfs(p::ACCESS, &args).await;
    let mut d = body(&results);
    post_op_attr(&mut d);
    assert_eq!(d.u32().unwrap() & 0x1c, 0);

    // Root squashed: uid 0 acts as 65534, which may not write in `d`
    // (0755, made by root).
    {
        let mut options = exports.options.lock().unwrap();
        options.read_only = false;
        options.squash = Squash::Root;
    }
    assert_eq!(
        status_of(&client.nfs(p::CREATE, &args_create(&dir, b"new")).await),
        status::ACCES
    );
    // Nobody from this address: NFS3ERR_ACCES, and MNT is refused.
    exports.options.lock().unwrap().clients.clear();
    assert_eq!(status_of(&client.nfs(p::GETATTR, &fh_args(&root)).await), status::ACCES);
    let mut args = Vec::new();
    args.put_string(PATH.as_bytes());
    assert_eq!(status_of(&client.call(MOUNT_PROGRAM, 1, &args).await), 13);

    stop_sender.send(true).unwrap();
    server.await.unwrap();
}

fn args_create(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut args = dirop(dir, name);
    args.put_u32(0);
    args.extend(mode(0o644));
    args
}
