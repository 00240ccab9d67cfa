//! The NFS file service against clients nobody here wrote (libnfs's
//! nfs-cp, nfs-cat, nfs-ls) and against malformed RPC input.

mod common;

use common::{require_tool, run, small_default_pool, Server};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn url(server: &Server, path: &str) -> String {
    let port = server
        .nfs
        .as_deref()
        .and_then(|a| a.rsplit(':').next())
        .expect("the daemon printed its NFS address");
    format!("nfs://127.0.0.1{path}?nfsport={port}&mountport={port}&version=3")
}

fn start(dir: &Path) -> Server {
    small_default_pool(dir);
    Server::start(dir)
}

fn nfs_cp(from: &str, to: &str) -> std::process::Output {
    Command::new("nfs-cp").args([from, to]).output().unwrap()
}

fn nfs_cat(server: &Server, path: &str) -> Vec<u8> {
    run(Command::new("nfs-cat").arg(url(server, path))).stdout
}

fn nfs_ls(server: &Server, path: &str) -> String {
    String::from_utf8_lossy(&run(Command::new("nfs-ls").arg(url(server, path))).stdout).into_owned()
}

#[test]
fn files_copied_in_read_back_and_survive_a_kill() {
    for tool in ["nfs-cp", "nfs-cat", "nfs-ls"] {
        require_tool(tool);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let big = common::pseudo_random(11, 3_000_017);
    let small = b"hello over NFS\n".to_vec();
    let local = dir.path().join("in");
    std::fs::create_dir(&local).unwrap();
    std::fs::write(local.join("big.bin"), &big).unwrap();
    std::fs::write(local.join("small.txt"), &small).unwrap();
    for name in ["big.bin", "small.txt"] {
        let output = nfs_cp(
            local.join(name).to_str().unwrap(),
            &url(&server, &format!("/default/files/{name}")),
        );
        assert!(output.status.success(), "nfs-cp {name}: {output:?}");
    }
    let listing = nfs_ls(&server, "/default/files");
    assert!(
        listing.contains("big.bin") && listing.contains("3000017") && listing.contains("small.txt"),
        "{listing}"
    );
    assert_eq!(nfs_cat(&server, "/default/files/big.bin"), big);
    assert_eq!(nfs_cat(&server, "/default/files/small.txt"), small);

    // nfs-cp closes (COMMIT) before it exits: the files are durable.
    server.kill9();
    let server = Server::start(dir.path());
    assert_eq!(nfs_cat(&server, "/default/files/big.bin"), big);
    assert_eq!(nfs_cat(&server, "/default/files/small.txt"), small);
    // Copying back out with nfs-cp gives the same bytes.
    let out = dir.path().join("out.bin");
    let output = nfs_cp(&url(&server, "/default/files/big.bin"), out.to_str().unwrap());
    assert!(output.status.success(), "{output:?}");
    assert_eq!(std::fs::read(out).unwrap(), big);
}

/// One RPC call record: AUTH_NONE, no verifier.
/// Volume and dataset ids are each pool's own: a second pool's dataset
/// with the id of the default pool's is another export, whose handles
/// never reach the first (each handle carries its pool's tag).
#[test]
fn datasets_of_two_pools_with_one_id_keep_their_own_files() {
    for tool in ["nfs-cp", "nfs-cat", "nfs-ls"] {
        require_tool(tool);
    }
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let device = common::sparse_file(dir.path(), "second.img", 256 << 20);
    common::cli_ok(&server, &["pool", "create", "second", "--fast", &device]);
    // Id 1 a volume, id 2 the dataset: as default's `files`.
    server.create_volume("second/v", "16M");
    common::cli_ok(&server, &["fs", "create", "second/files"]);
    let listed = common::cli_ok(&server, &["fs", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let ids: Vec<&serde_json::Value> = listed.as_array().unwrap().iter().map(|d| &d["id"]).collect();
    assert_eq!(ids[0], ids[1], "the test wants one id in both pools: {listed}");
    let local = dir.path().join("in");
    std::fs::create_dir(&local).unwrap();
    for (export, text) in [("default", "in the default pool\n"), ("second", "in the second pool\n")] {
        let file = local.join(export);
        std::fs::write(&file, text).unwrap();
        let output = nfs_cp(
            file.to_str().unwrap(),
            &url(&server, &format!("/{export}/files/{export}.txt")),
        );
        assert!(output.status.success(), "nfs-cp to {export}: {output:?}");
    }
    for (export, other, text) in [
        ("default", "second", "in the default pool\n"),
        ("second", "default", "in the second pool\n"),
    ] {
        assert_eq!(
            nfs_cat(&server, &format!("/{export}/files/{export}.txt")),
            text.as_bytes()
        );
        let listing = nfs_ls(&server, &format!("/{export}/files"));
        assert!(listing.contains(&format!("{export}.txt")), "{listing}");
        assert!(!listing.contains(&format!("{other}.txt")), "{export}: {listing}");
    }
}

fn call(xid: u32, program: u32, version: u32, procedure: u32, args: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    for word in [xid, 0, 2, program, version, procedure, 0, 0, 0, 0] {
        body.extend_from_slice(&word.to_be_bytes());
    }
    body.extend_from_slice(args);
    let mut record = (0x8000_0000u32 | body.len() as u32).to_be_bytes().to_vec();
    record.extend_from_slice(&body);
    record
}

/// Reads one reply record; `None` when the server closed the connection.
fn reply(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut mark = [0u8; 4];
    stream.read_exact(&mut mark).ok()?;
    let length = (u32::from_be_bytes(mark) & 0x7fff_ffff) as usize;
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).ok()?;
    Some(body)
}

fn word(bytes: &[u8], index: usize) -> u32 {
    u32::from_be_bytes(bytes[index * 4..index * 4 + 4].try_into().unwrap())
}

fn connect(server: &Server) -> TcpStream {
    let stream = TcpStream::connect(server.nfs.as_deref().unwrap()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
}

#[test]
fn malformed_rpc_gets_errors_and_the_server_keeps_serving() {
    require_tool("nfs-ls");
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());

    // Replies: xid, REPLY(1), MSG_ACCEPTED(0), verifier (flavor, length),
    // accept_stat.
    let mut stream = connect(&server);
    stream.write_all(&call(7, 100_099, 1, 0, &[])).unwrap();
    let body = reply(&mut stream).unwrap();
    assert_eq!((word(&body, 0), word(&body, 1), word(&body, 2)), (7, 1, 0));
    assert_eq!(word(&body, 5), 1, "PROG_UNAVAIL");
    stream.write_all(&call(8, 100_003, 4, 0, &[])).unwrap();
    let body = reply(&mut stream).unwrap();
    assert_eq!(word(&body, 5), 2, "PROG_MISMATCH");
    assert_eq!((word(&body, 6), word(&body, 7)), (3, 3));
    stream.write_all(&call(9, 100_003, 3, 99, &[])).unwrap();
    let body = reply(&mut stream).unwrap();
    assert_eq!(word(&body, 5), 3, "PROC_UNAVAIL");
    // GETATTR with arguments cut short, then with a handle not of ours.
    stream.write_all(&call(10, 100_003, 3, 1, &[0, 0, 0])).unwrap();
    let body = reply(&mut stream).unwrap();
    assert_eq!(word(&body, 5), 4, "GARBAGE_ARGS");
    let mut handle = 8u32.to_be_bytes().to_vec();
    handle.extend_from_slice(b"notours!");
    stream.write_all(&call(11, 100_003, 3, 1, &handle)).unwrap();
    let body = reply(&mut stream).unwrap();
    assert_eq!((word(&body, 5), word(&body, 6)), (0, 10001), "NFS3ERR_BADHANDLE");
    // MOUNT of a path that is not exported.
    let path = b"/default/nothere";
    let mut args = (path.len() as u32).to_be_bytes().to_vec();
    args.extend_from_slice(path);
    args.resize(4 + path.len().div_ceil(4) * 4, 0);
    stream.write_all(&call(12, 100_005, 3, 1, &args)).unwrap();
    let body = reply(&mut stream).unwrap();
    assert_eq!((word(&body, 5), word(&body, 6)), (0, 2), "MNT3ERR_NOENT");

    // A record claiming 2 GiB is refused by closing, not by allocating.
    let mut stream = connect(&server);
    stream.write_all(&0xffff_fff0u32.to_be_bytes()).unwrap();
    stream.write_all(&[0u8; 64]).unwrap();
    assert!(reply(&mut stream).is_none(), "the connection is closed");
    // Garbage where a call header belongs.
    let mut stream = connect(&server);
    let mut garbage = 40u32.to_be_bytes().to_vec();
    garbage[0] |= 0x80;
    garbage.extend_from_slice(&[0xAB; 40]);
    stream.write_all(&garbage).unwrap();
    let _ = reply(&mut stream);
    // A client that goes away mid-record.
    let mut stream = connect(&server);
    stream.write_all(&[0x80, 0, 1, 0, 1, 2]).unwrap();
    drop(stream);

    // Everything else still works.
    let output = Command::new("nfs-ls")
        .arg(url(&server, "/default/files"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
}

/// `strata fs snapshot` through the CLI, read back by libnfs under the
/// export's hidden `.snapshot` directory, read-only, across a kill -9;
/// `fs destroy` refuses a dataset with snapshots and destroys a snapshot.
#[test]
fn snapshots_are_read_only_under_dot_snapshot_and_survive_a_kill() {
    for tool in ["nfs-cp", "nfs-cat", "nfs-ls"] {
        require_tool(tool);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let before = common::pseudo_random(3, 200_003);
    let after = common::pseudo_random(4, 100_001);
    let local = dir.path().join("in");
    std::fs::create_dir(&local).unwrap();
    std::fs::write(local.join("before"), &before).unwrap();
    std::fs::write(local.join("after"), &after).unwrap();
    let copy = |server: &Server, from: &str, to: &str| nfs_cp(local.join(from).to_str().unwrap(), &url(server, to));
    assert!(copy(&server, "before", "/default/files/f.bin").status.success());

    common::cli_ok(&server, &["fs", "snapshot", "default/files@monday"]);
    let again = common::cli(&server, &["fs", "snapshot", "default/files@monday"]);
    assert!(!again.status.success(), "a second snapshot of that name is refused");
    let listing = common::cli_ok(&server, &["fs", "snapshots", "default/files"]);
    assert!(
        listing.contains("default/files@monday") && listing.contains("/default/files/.snapshot/monday"),
        "{listing}"
    );

    // The live dataset changes (nfs-cp only creates: GUARDED); the
    // snapshot does not. (Data overwritten after a snapshot: src/fs/tests.rs.)
    let output = copy(&server, "after", "/default/files/g.bin");
    assert!(output.status.success(), "{output:?}");
    assert_eq!(nfs_cat(&server, "/default/files/g.bin"), after);
    assert_eq!(nfs_cat(&server, "/default/files/.snapshot/monday/f.bin"), before);
    let snapshots = nfs_ls(&server, "/default/files/.snapshot");
    assert!(snapshots.contains("monday"), "{snapshots}");
    let files = nfs_ls(&server, "/default/files/.snapshot/monday");
    assert!(files.contains("f.bin") && !files.contains("g.bin"), "{files}");
    assert!(!nfs_ls(&server, "/default/files").contains(".snapshot"), "hidden");
    let refused = copy(&server, "after", "/default/files/.snapshot/monday/h.bin");
    assert!(!refused.status.success(), "a snapshot is read-only");

    server.kill9();
    let server = Server::start(dir.path());
    assert_eq!(nfs_cat(&server, "/default/files/.snapshot/monday/f.bin"), before);
    assert_eq!(nfs_cat(&server, "/default/files/g.bin"), after);

    let busy = common::cli(&server, &["fs", "destroy", "default/files"]);
    assert!(!busy.status.success());
    assert!(
        String::from_utf8_lossy(&busy.stderr).contains("snapshot"),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );
    common::cli_ok(&server, &["fs", "destroy", "default/files@monday"]);
    let gone = Command::new("nfs-cat")
        .arg(url(&server, "/default/files/.snapshot/monday/f.bin"))
        .output()
        .unwrap();
    assert!(!gone.status.success(), "destroyed");
    assert!(!common::cli_ok(&server, &["fs", "snapshots"]).contains("monday"));
    assert_eq!(nfs_cat(&server, "/default/files/f.bin"), before);
}

/// `fs promote`: both datasets stay exported; the promoted clone's
/// `.snapshot` holds the moved snapshots with their files, the former
/// origin keeps its newer one; after a kill -9 too (replay of the
/// promotion), and once the former origin is destroyed.
#[test]
fn a_promoted_clone_serves_the_moved_snapshots() {
    for tool in ["nfs-cp", "nfs-cat", "nfs-ls"] {
        require_tool(tool);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let before = common::pseudo_random(5, 150_001);
    let after = common::pseudo_random(6, 70_001);
    let mine = common::pseudo_random(7, 30_003);
    let local = dir.path().join("in");
    std::fs::create_dir(&local).unwrap();
    for (name, data) in [("before", &before), ("after", &after), ("mine", &mine)] {
        std::fs::write(local.join(name), data).unwrap();
    }
    let copy = |server: &Server, from: &str, to: &str| {
        let output = nfs_cp(local.join(from).to_str().unwrap(), &url(server, to));
        assert!(output.status.success(), "nfs-cp {from} {to}: {output:?}");
    };
    copy(&server, "before", "/default/files/f.bin");
    common::cli_ok(&server, &["fs", "snapshot", "default/files@monday"]);
    copy(&server, "after", "/default/files/g.bin");
    common::cli_ok(&server, &["fs", "snapshot", "default/files@tuesday"]);
    common::cli_ok(&server, &["fs", "clone", "default/files@monday", "default/work"]);
    copy(&server, "mine", "/default/work/w.bin");
    common::cli_ok(&server, &["fs", "promote", "default/work"]);

    let check = |server: &Server| {
        assert_eq!(nfs_cat(server, "/default/work/.snapshot/monday/f.bin"), before);
        let files = nfs_ls(server, "/default/work/.snapshot/monday");
        assert!(files.contains("f.bin") && !files.contains("g.bin"), "{files}");
        let snapshots = nfs_ls(server, "/default/work/.snapshot");
        assert!(
            snapshots.contains("monday") && !snapshots.contains("tuesday"),
            "{snapshots}"
        );
        assert_eq!(nfs_cat(server, "/default/work/w.bin"), mine);
        assert_eq!(nfs_cat(server, "/default/work/f.bin"), before);
        let snapshots = nfs_ls(server, "/default/files/.snapshot");
        assert!(
            snapshots.contains("tuesday") && !snapshots.contains("monday"),
            "{snapshots}"
        );
        assert_eq!(nfs_cat(server, "/default/files/.snapshot/tuesday/g.bin"), after);
        assert_eq!(nfs_cat(server, "/default/files/g.bin"), after);
        assert_eq!(nfs_cat(server, "/default/files/f.bin"), before);
        let moved = Command::new("nfs-cat")
            .arg(url(server, "/default/files/.snapshot/monday/f.bin"))
            .output()
            .unwrap();
        assert!(!moved.status.success(), "monday is the clone's now");
    };
    check(&server);
    server.kill9();
    let mut server = Server::start(dir.path());
    check(&server);

    // The former origin goes; the promoted clone keeps everything.
    common::cli_ok(&server, &["fs", "destroy", "default/files@tuesday"]);
    common::cli_ok(&server, &["fs", "destroy", "default/files"]);
    let gone = Command::new("nfs-cat")
        .arg(url(&server, "/default/files/f.bin"))
        .output()
        .unwrap();
    assert!(!gone.status.success(), "destroyed");
    assert_eq!(nfs_cat(&server, "/default/work/.snapshot/monday/f.bin"), before);
    assert_eq!(nfs_cat(&server, "/default/work/w.bin"), mine);
    server.kill9();
    let server = Server::start(dir.path());
    assert_eq!(nfs_cat(&server, "/default/work/.snapshot/monday/f.bin"), before);
    assert_eq!(nfs_cat(&server, "/default/work/f.bin"), before);
    assert_eq!(nfs_cat(&server, "/default/work/w.bin"), mine);
}

/// `len` and `bytes` as XDR `opaque<>`, padded to four bytes.
fn xdr_opaque(bytes: &[u8]) -> Vec<u8> {
    let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(bytes);
    out.resize(4 + bytes.len().div_ceil(4) * 4, 0);
    out
}

/// The XDR `opaque<>` at byte `at` of `body`.
fn opaque_at(body: &[u8], at: usize) -> Vec<u8> {
    let length = u32::from_be_bytes(body[at..at + 4].try_into().unwrap()) as usize;
    body[at + 4..at + 4 + length].to_vec()
}

fn u64_at(body: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(body[at..at + 8].try_into().unwrap())
}

/// A client that keeps file handles across admin commands and restarts,
/// as a mounted client does (libnfs's tools mount afresh every time).
/// Replies: xid, REPLY, MSG_ACCEPTED, verifier, accept_stat (words 0-5),
/// then the procedure's status (word 6, byte 24) and results (byte 28).
struct RawClient {
    stream: TcpStream,
    xid: u32,
}

impl RawClient {
    fn new(server: &Server) -> RawClient {
        RawClient {
            stream: connect(server),
            xid: 0,
        }
    }

    /// Runs one call; its status, and the reply.
    fn call(&mut self, program: u32, procedure: u32, args: &[u8]) -> (u32, Vec<u8>) {
        self.xid += 1;
        self.stream
            .write_all(&call(self.xid, program, 3, procedure, args))
            .unwrap();
        let body = reply(&mut self.stream).expect("a reply");
        assert_eq!((word(&body, 0), word(&body, 5)), (self.xid, 0), "accepted");
        (word(&body, 6), body)
    }

    /// MNT: the root handle of `path`, or MOUNT's status.
    fn mount(&mut self, path: &str) -> Result<Vec<u8>, u32> {
        match self.call(100_005, 1, &xdr_opaque(path.as_bytes())) {
            (0, body) => Ok(opaque_at(&body, 28)),
            (status, _) => Err(status),
        }
    }

    fn lookup(&mut self, dir: &[u8], name: &str) -> Result<Vec<u8>, u32> {
        let mut args = xdr_opaque(dir);
        args.extend(xdr_opaque(name.as_bytes()));
        match self.call(100_003, 3, &args) {
            (0, body) => Ok(opaque_at(&body, 28)),
            (status, _) => Err(status),
        }
    }

    /// GETATTR: the size and the fsid, or NFS's status.
    fn size_and_fsid(&mut self, handle: &[u8]) -> Result<(u64, u64), u32> {
        match self.call(100_003, 1, &xdr_opaque(handle)) {
            // fattr3: type, mode, nlink, uid, gid, size, used, rdev, fsid.
            (0, body) => Ok((u64_at(&body, 28 + 20), u64_at(&body, 28 + 44))),
            (status, _) => Err(status),
        }
    }

    fn read(&mut self, handle: &[u8], offset: u64, count: u32) -> Result<Vec<u8>, u32> {
        let mut args = xdr_opaque(handle);
        args.extend_from_slice(&offset.to_be_bytes());
        args.extend_from_slice(&count.to_be_bytes());
        match self.call(100_003, 6, &args) {
            // post_op_attr (a bool, then fattr3's 84 bytes), count, eof, data.
            (0, body) => {
                let at = if word(&body, 7) == 1 { 32 + 84 } else { 32 };
                Ok(opaque_at(&body, at + 8))
            }
            (status, _) => Err(status),
        }
    }
}

/// What the docs promise of a handle of a file in a snapshot that a
/// promotion moves: it stays valid, same file, same data, served through
/// the promoted clone (its fsid) from then on; across a kill -9 and once
/// the former origin is destroyed too. The snapshot's path under the
/// origin is gone.
#[test]
fn a_handle_in_a_moved_snapshot_stays_valid() {
    require_tool("nfs-cp");
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    let before = common::pseudo_random(8, 90_001);
    let local = dir.path().join("before");
    std::fs::write(&local, &before).unwrap();
    let output = nfs_cp(local.to_str().unwrap(), &url(&server, "/default/files/f.bin"));
    assert!(output.status.success(), "{output:?}");
    common::cli_ok(&server, &["fs", "snapshot", "default/files@monday"]);
    common::cli_ok(&server, &["fs", "clone", "default/files@monday", "default/work"]);

    let mut client = RawClient::new(&server);
    let files = client.mount("/default/files").unwrap();
    let (_, files_fsid) = client.size_and_fsid(&files).unwrap();
    let work = client.mount("/default/work").unwrap();
    let (_, work_fsid) = client.size_and_fsid(&work).unwrap();
    assert_ne!(files_fsid, work_fsid);
    let snap_root = client.mount("/default/files/.snapshot/monday").unwrap();
    let f = client.lookup(&snap_root, "f.bin").unwrap();
    assert_eq!(client.size_and_fsid(&f).unwrap(), (before.len() as u64, files_fsid));
    assert_eq!(client.read(&f, 0, 4096).unwrap(), before[..4096]);

    common::cli_ok(&server, &["fs", "promote", "default/work"]);
    let check = |client: &mut RawClient| {
        assert_eq!(
            client.size_and_fsid(&f),
            Ok((before.len() as u64, work_fsid)),
            "the same file, through the clone"
        );
        assert_eq!(client.read(&f, 80_000, 20_000).unwrap(), before[80_000..]);
        assert_eq!(client.lookup(&snap_root, "f.bin").as_ref(), Ok(&f));
        assert_eq!(
            client.mount("/default/work/.snapshot/monday").as_ref(),
            Ok(&snap_root),
            "a handle names the snapshot, not its dataset"
        );
        assert_eq!(
            client.mount("/default/files/.snapshot/monday"),
            Err(2),
            "MNT3ERR_NOENT: moved away"
        );
    };
    check(&mut client);
    server.kill9();
    let mut server = Server::start(dir.path());
    let mut client = RawClient::new(&server);
    check(&mut client);
    common::cli_ok(&server, &["fs", "destroy", "default/files"]);
    check(&mut client);
    server.stop();
}

/// The migrator moves a dataset's files down while an NFS client writes
/// them (watermarks of 1 % and 0 % of the fast tier, passes run back to
/// back): every file reads back as written, before and after a kill -9.
#[test]
fn a_datasets_files_move_between_tiers_under_nfs_writes_and_survive_a_kill() {
    for tool in ["nfs-cp", "nfs-cat"] {
        require_tool(tool);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    common::cli_ok(
        &server,
        &["pool", "set", "default", "migration.high=1", "migration.low=0"],
    );
    let local = dir.path().join("in");
    std::fs::create_dir(&local).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..12u64)
        .map(|i| {
            (
                format!("f{i}.bin"),
                common::pseudo_random(100 + i, (4 << 20) + i as usize * 4099),
            )
        })
        .collect();
    for (name, bytes) in &files {
        std::fs::write(local.join(name), bytes).unwrap();
    }
    let targets: Vec<(std::path::PathBuf, String)> = files
        .iter()
        .map(|(name, _)| (local.join(name), url(&server, &format!("/default/files/{name}"))))
        .collect();
    let writer = std::thread::spawn(move || {
        for (from, to) in targets {
            let output = nfs_cp(from.to_str().unwrap(), &to);
            assert!(output.status.success(), "nfs-cp {to}: {output:?}");
        }
    });
    let mut passes = 0;
    while !writer.is_finished() {
        common::cli_ok(&server, &["pool", "migrate", "default", "--wait"]);
        passes += 1;
    }
    writer.join().unwrap();
    common::cli_ok(&server, &["pool", "migrate", "default", "--wait"]);
    let status = common::pool_json(&server, "default");
    let moved = status["migration"]["moved_down_bytes"].as_u64().unwrap();
    assert!(
        moved > 0,
        "{passes} passes during the writes and one after moved nothing down: {status}"
    );
    let capacity = status["tiers"]["capacity"]["used_bytes"].as_u64().unwrap();
    eprintln!("{passes} passes during the writes, {moved} bytes moved down, {capacity} on the capacity tier");
    assert!(capacity > 0, "nothing on the capacity tier: {status}");
    for (name, bytes) in &files {
        assert!(
            nfs_cat(&server, &format!("/default/files/{name}")) == *bytes,
            "{name} differs"
        );
    }
    server.kill9();
    let server = Server::start(dir.path());
    for (name, bytes) in &files {
        assert!(
            nfs_cat(&server, &format!("/default/files/{name}")) == *bytes,
            "{name} differs after kill -9"
        );
    }
}
