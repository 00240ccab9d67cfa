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
    fn by_dataset(&self, _pool: u64, dataset: u32) -> Option<Export> {
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
        self.send(xid, &record).await
    }

    /// Sends a record (built by [`Client::record`], perhaps sent before)
    /// and reads its reply's results.
    async fn send(&mut self, xid: u32, record: &[u8]) -> Vec<u8> {
        self.stream.write_all(record).await.unwrap();
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
    mtime: (u32, u32),
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
    for _ in 0..2 {
        d.u32().unwrap();
    }
    let mtime = (d.u32().unwrap(), d.u32().unwrap());
    let ctime = (d.u32().unwrap(), d.u32().unwrap());
    Attrs {
        kind,
        size,
        fileid,
        mtime,
        ctime,
    }
}

fn post_op_attr(d: &mut Decoder<'_>) -> Option<Attrs> {
    d.bool().unwrap().then(|| fattr(d))
}

/// `wcc_attr`: size, mtime, ctime.
#[derive(Debug, PartialEq, Eq)]
struct PreAttrs {
    size: u64,
    mtime: (u32, u32),
    ctime: (u32, u32),
}

/// `wcc_data`: the pre-operation attributes, if sent, and the post-operation
/// ones.
fn wcc_data(d: &mut Decoder<'_>) -> (Option<PreAttrs>, Option<Attrs>) {
    let before = d.bool().unwrap().then(|| PreAttrs {
        size: d.u64().unwrap(),
        mtime: (d.u32().unwrap(), d.u32().unwrap()),
        ctime: (d.u32().unwrap(), d.u32().unwrap()),
    });
    (before, post_op_attr(d))
}

/// The post-operation attributes of a `wcc_data`.
fn wcc(d: &mut Decoder<'_>) -> Option<Attrs> {
    wcc_data(d).1
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
                assert_eq!(d.opaque(64).unwrap().len(), crate::fs::HANDLE_BYTES);
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
    let served = Served::start().await;
    let (fs, exports) = (served.exports.fs.clone(), served.exports.clone());
    let mut client = served.client(0).await;

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
    assert_eq!(d.remaining(), 0);

    // READs of odd lengths inside sectors and at the end of the file (the
    // data is sent after the reply's header, its XDR padding after it),
    // pipelined with a GETATTR: every record is framed right.
    let mut burst = Vec::new();
    let mut reads = Vec::new();
    for (offset, count) in [(4097u64, 1001u32), (39_998, 100), (1, 2), (40_000, 10)] {
        let mut args = fh_args(&file);
        args.put_u64(offset);
        args.put_u32(count);
        let (xid, record) = client.record(NFS_PROGRAM, p::READ, &args);
        let end = (offset + count as u64).min(40_000) as usize;
        reads.push((xid, expected[offset as usize..end].to_vec(), end == 40_000));
        burst.extend(record);
    }
    let (getattr, record) = client.record(NFS_PROGRAM, p::GETATTR, &fh_args(&file));
    burst.extend(record);
    client.stream.write_all(&burst).await.unwrap();
    for _ in 0..5 {
        let (xid, results) = client.reply().await;
        if xid == getattr {
            assert_eq!(fattr(&mut body(&results)).size, 40_000);
            continue;
        }
        let (_, data, eof) = reads.iter().find(|(x, _, _)| *x == xid).expect("a READ's xid");
        let mut d = body(&results);
        post_op_attr(&mut d).unwrap();
        assert_eq!(d.u32().unwrap() as usize, data.len());
        assert_eq!(d.bool().unwrap(), *eof);
        assert_eq!(d.opaque(1 << 20).unwrap(), &data[..]);
        assert_eq!(d.remaining(), 0);
        assert!(results.len() % 4 == 0 && results.ends_with(&[0u8; 3][..super::xdr::padding(data.len())]));
    }

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
        status_of(&client.nfs(p::CREATE, &create_args(&dir, b"new", 0)).await),
        status::ACCES
    );
    // Nobody from this address: NFS3ERR_ACCES, and MNT is refused.
    exports.options.lock().unwrap().clients.clear();
    assert_eq!(status_of(&client.nfs(p::GETATTR, &fh_args(&root)).await), status::ACCES);
    let mut args = Vec::new();
    args.put_string(PATH.as_bytes());
    assert_eq!(status_of(&client.call(MOUNT_PROGRAM, 1, &args).await), 13);

    served.stop().await;
}

/// CREATE's arguments: UNCHECKED (`how` 0) or GUARDED (1), mode 0644.
fn create_args(dir: &[u8], name: &[u8], how: u32) -> Vec<u8> {
    let mut args = dirop(dir, name);
    args.put_u32(how);
    args.extend(mode(0o644));
    args
}

/// A dataset served on a loopback port, its root mounted.
struct Served {
    exports: Arc<OneExport>,
    address: std::net::SocketAddr,
    root: Vec<u8>,
    cache: Arc<super::drc::ReplyCache>,
    stop: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

impl Served {
    async fn start() -> Served {
        let sim = SimDevice::new(160 << 20, 12);
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
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let cache = super::drc::ReplyCache::new();
        let server = tokio::spawn(super::server::serve_with_cache(
            listener,
            exports.clone(),
            cache.clone(),
            crate::frontend::limits::ConnectionLimits::new("nfs", 16, 16),
            stopped,
        ));
        let root = fs.root().encode().to_vec();
        Served {
            exports,
            cache,
            address,
            root,
            stop,
            server,
        }
    }

    /// A new connection (a new source port), its XIDs from `xid + 1`.
    async fn client(&self, xid: u32) -> Client {
        Client {
            stream: TcpStream::connect(self.address).await.unwrap(),
            xid,
            uid: 0,
        }
    }

    async fn stop(self) {
        self.stop.send(true).unwrap();
        self.server.await.unwrap();
    }
}

fn create_guarded(dir: &[u8], name: &[u8]) -> Vec<u8> {
    create_args(dir, name, 1)
}

#[tokio::test]
async fn a_remove_resent_on_a_new_connection_is_answered_from_the_cache() {
    let served = Served::start().await;
    let mut first = served.client(100).await;
    made(&first.nfs(p::CREATE, &create_guarded(&served.root, b"gone")).await);
    let (xid, record) = first.record(NFS_PROGRAM, p::REMOVE, &dirop(&served.root, b"gone"));
    let reply = first.send(xid, &record).await;
    assert_eq!(status_of(&reply), status::OK);
    // The connection breaks before the reply arrives; the client resends
    // the same call on a new one.
    drop(first);
    let mut second = served.client(5000).await;
    assert_eq!(second.send(xid, &record).await, reply);
    // Removed once: a new REMOVE (another XID) runs and finds nothing.
    let results = second.nfs(p::REMOVE, &dirop(&served.root, b"gone")).await;
    assert_eq!(status_of(&results), status::NOENT);
    served.stop().await;
}

#[tokio::test]
async fn a_create_guarded_resent_gets_the_same_handle() {
    let served = Served::start().await;
    let mut first = served.client(100).await;
    let (xid, record) = first.record(NFS_PROGRAM, p::CREATE, &create_guarded(&served.root, b"new"));
    let reply = first.send(xid, &record).await;
    let handle = made(&reply);
    let mut second = served.client(5000).await;
    let again = second.send(xid, &record).await;
    assert_eq!(again, reply);
    assert_eq!(made(&again), handle);
    // Not from the cache (another XID): the name exists.
    let results = second.nfs(p::CREATE, &create_guarded(&served.root, b"new")).await;
    assert_eq!(status_of(&results), status::EXIST);
    served.stop().await;
}

#[tokio::test]
async fn an_xid_reused_with_other_arguments_runs() {
    let served = Served::start().await;
    let mut first = served.client(100).await;
    made(&first.nfs(p::CREATE, &create_guarded(&served.root, b"a")).await);
    made(&first.nfs(p::CREATE, &create_guarded(&served.root, b"b")).await);
    let (xid, record) = first.record(NFS_PROGRAM, p::REMOVE, &dirop(&served.root, b"a"));
    assert_eq!(status_of(&first.send(xid, &record).await), status::OK);
    // The same XID from the same address, removing another name.
    let mut second = served.client(xid - 1).await;
    let results = second.nfs(p::REMOVE, &dirop(&served.root, b"b")).await;
    assert_eq!(status_of(&results), status::OK);
    let results = second.nfs(p::LOOKUP, &dirop(&served.root, b"b")).await;
    assert_eq!(status_of(&results), status::NOENT);
    served.stop().await;
}

#[tokio::test]
async fn the_reply_cache_stays_within_its_bound() {
    let served = Served::start().await;
    let mut client = served.client(0).await;
    let file = made(&client.nfs(p::CREATE, &create_guarded(&served.root, b"f")).await);
    // More distinct SETATTRs than the cache holds, pipelined in batches.
    let calls = super::drc::MAX_ENTRIES + 200;
    for batch in (0..calls).collect::<Vec<_>>().chunks(50) {
        let mut burst = Vec::new();
        for _ in batch {
            let mut args = fh_args(&file);
            args.extend(mode(0o600));
            args.put_u32(0);
            burst.extend(client.record(NFS_PROGRAM, p::SETATTR, &args).1);
        }
        client.stream.write_all(&burst).await.unwrap();
        for _ in batch {
            assert_eq!(status_of(&client.reply().await.1), status::OK);
        }
    }
    let (entries, bytes) = served.cache.len_and_bytes();
    assert_eq!(entries, super::drc::MAX_ENTRIES);
    assert!(bytes <= super::drc::MAX_BYTES);
    // READ, GETATTR and the like are not cached.
    client.nfs(p::GETATTR, &fh_args(&file)).await;
    assert_eq!(served.cache.len_and_bytes().0, super::drc::MAX_ENTRIES);
    served.stop().await;
}

fn wire_time(time: crate::fs::Time) -> (u32, u32) {
    (time.seconds as u32, time.nanos)
}

fn write_args(fh: &[u8], offset: u64, data: &[u8], stable: u32) -> Vec<u8> {
    let mut args = fh_args(fh);
    args.put_u64(offset);
    args.put_u32(data.len() as u32);
    args.put_u32(stable);
    args.put_opaque(data);
    args
}

#[tokio::test]
async fn a_write_reply_carries_the_size_and_times_before_it() {
    let served = Served::start().await;
    let mut client = served.client(0).await;
    let file = made(&client.nfs(p::CREATE, &create_guarded(&served.root, b"w")).await);
    let created = served
        .exports
        .fs
        .getattr(&crate::fs::Handle::decode(&file).unwrap())
        .unwrap();
    // UNSTABLE (the size changes in memory) and FILE_SYNC (the row is
    // logged ahead of the data): both report what was there before.
    let mut expected_before = PreAttrs {
        size: 0,
        mtime: wire_time(created.mtime),
        ctime: wire_time(created.ctime),
    };
    for (offset, stable) in [(0u64, 0u32), (5000, 2), (2000, 0)] {
        let results = client
            .nfs(p::WRITE, &write_args(&file, offset, &[9; 5000], stable))
            .await;
        assert_eq!(status_of(&results), status::OK);
        let (before, after) = wcc_data(&mut body(&results));
        let after = after.unwrap();
        assert_eq!(before.unwrap(), expected_before, "write at {offset}");
        assert_eq!(after.size, (offset + 5000).max(expected_before.size));
        expected_before = PreAttrs {
            size: after.size,
            mtime: after.mtime,
            ctime: after.ctime,
        };
    }
    // COMMIT changes nothing: before is after.
    let mut args = fh_args(&file);
    args.put_u64(0);
    args.put_u32(0);
    let results = client.nfs(p::COMMIT, &args).await;
    assert_eq!(status_of(&results), status::OK);
    let (before, after) = wcc_data(&mut body(&results));
    assert_eq!(before.unwrap(), expected_before);
    assert_eq!(after.unwrap().size, 10_000);
    served.stop().await;
}

#[tokio::test]
async fn directory_changes_carry_the_directory_before_them() {
    let served = Served::start().await;
    let mut client = served.client(0).await;
    let root = served.exports.fs.getattr(&served.exports.fs.root()).unwrap();
    // Times in whole nanoseconds apart: the change's own time differs.
    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    let results = client.nfs(p::CREATE, &create_guarded(&served.root, b"c")).await;
    assert_eq!(status_of(&results), status::OK);
    let mut d = body(&results);
    assert!(d.bool().unwrap());
    d.opaque(64).unwrap();
    assert!(post_op_attr(&mut d).is_some());
    let (before, after) = wcc_data(&mut d);
    let before = before.unwrap();
    assert_eq!(before.mtime, wire_time(root.mtime));
    assert_eq!(before.ctime, wire_time(root.ctime));
    let after = after.unwrap();
    assert_ne!(after.mtime, before.mtime);
    // REMOVE's directory before is the CREATE's after.
    let results = client.nfs(p::REMOVE, &dirop(&served.root, b"c")).await;
    assert_eq!(status_of(&results), status::OK);
    let (removed_before, _) = wcc_data(&mut body(&results));
    assert_eq!(removed_before.unwrap().mtime, after.mtime);
    // A failed change sends no pre-operation attributes.
    let results = client.nfs(p::REMOVE, &dirop(&served.root, b"c")).await;
    assert_eq!(status_of(&results), status::NOENT);
    let (before, after) = wcc_data(&mut body(&results));
    assert!(before.is_none() && after.is_some());
    served.stop().await;
}
