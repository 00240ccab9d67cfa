//! `strata send` and `strata receive` between two daemons (two data
//! directories: "another machine"), through the real CLI, a shell pipe,
//! the Unix socket and the TCP API with its token; the results compared
//! with `qemu-img compare` and `nbdinfo --map` over NBD. Bad streams
//! (a corrupted byte, a truncated stream, the wrong base, foreign bytes)
//! are refused and leave nothing behind; an interrupted receive resumes,
//! also after a kill -9 of the receiving daemon, and leaks no space.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::send::{
    compare, export_missing, map_of, pending_token, placed, receive_ok, receive_refused, received_bytes, send, volumes,
};
use common::{cli_ok, qemu_io_ok, require_tool, run, small_default_pool, token_for, Server};

const STRATA: &str = env!("CARGO_BIN_EXE_strata");

fn start(dir: &Path) -> Server {
    small_default_pool(dir);
    Server::start(dir)
}

/// A volume with a chain of three snapshots: data, overwrites (whole and
/// partial blocks), a trim (a hole in @s2 where @s1 had data), growth.
fn make_chain(server: &Server) {
    cli_ok(server, &["volume", "create", "default/db", "--size", "64M"]);
    let uri = server.uri("default/db");
    qemu_io_ok(
        &uri,
        &[
            "write -P 0xa1 0 8M".into(),
            "write -P 0xa2 20M 3M".into(),
            "flush".into(),
        ],
    );
    cli_ok(server, &["snapshot", "create", "default/db@s1"]);
    qemu_io_ok(
        &uri,
        &[
            "write -P 0xb1 1M 1M".into(),
            "write -P 0xb2 4100k 4k".into(),
            "discard 20M 2M".into(),
            "write -P 0xb3 40M 1M".into(),
            "flush".into(),
        ],
    );
    cli_ok(server, &["snapshot", "create", "default/db@s2"]);
    qemu_io_ok(
        &uri,
        &[
            "write -P 0xc1 0 64k".into(),
            "discard 40M 512k".into(),
            "write -P 0xc2 63M 1M".into(),
        ],
    );
    cli_ok(server, &["snapshot", "create", "default/db@s3"]);
}

#[test]
fn full_and_incremental_chains_round_trip() {
    require_tool("qemu-img");
    require_tool("nbdinfo");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(a_dir.path());
    let b = start(b_dir.path());
    make_chain(&a);

    let full = send(&a, &["default/db@s1"]);
    receive_ok(&b, &["default/copy"], &full);
    compare(&a.uri("default/db@s1"), &b.uri("default/copy@s1"));
    compare(&a.uri("default/db@s1"), &b.uri("default/copy"));
    // Holes stay holes: 8M..20M and beyond 23M were never written.
    let map = map_of(&b, "default/copy");
    assert!(map.contains("8388608 12582912 3 hole,zero"), "{map}");

    // Incremental, through a shell pipe as `send | ssh host receive` is.
    let pipe = format!(
        "{STRATA} send default/db@s2 -i @s1 --data-dir {} | STRATA_TOKEN=$TOKEN {STRATA} receive default/copy --api {}",
        a.data_dir.display(),
        b.api
    );
    run(Command::new("sh")
        .args(["-c", &pipe])
        .env("TOKEN", token_for(&b.api).unwrap()));
    compare(&a.uri("default/db@s2"), &b.uri("default/copy@s2"));
    let map = map_of(&b, "default/copy@s2");
    assert!(
        map.contains("8388608 14680064 3 hole,zero"),
        "the trimmed range is a hole again: {map}"
    );

    // An incremental stream holds only what changed.
    let incremental = send(&a, &["default/db@s3", "-i", "default/db@s2"]);
    assert!(incremental.len() < 3 << 20, "{} bytes", incremental.len());
    receive_ok(&b, &["default/copy"], &incremental);
    for snapshot in ["s1", "s2", "s3"] {
        compare(
            &a.uri(&format!("default/db@{snapshot}")),
            &b.uri(&format!("default/copy@{snapshot}")),
        );
    }
    compare(&a.uri("default/db"), &b.uri("default/copy"));

    // A received snapshot keeps its identity: a third machine's chain can
    // go on from B (the same stream from A applies to B's copy's copy).
    let from_b = send(&b, &["default/copy@s2"]);
    receive_ok(&a, &["default/again"], &from_b);
    let next = send(&a, &["default/db@s3", "-i", "@s2"]);
    receive_ok(&a, &["default/again"], &next);
    compare(&a.uri("default/db@s3"), &a.uri("default/again@s3"));
}

#[test]
fn bad_streams_are_refused_and_leave_nothing_behind() {
    require_tool("qemu-img");
    require_tool("nbdinfo");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(a_dir.path());
    let b = start(b_dir.path());
    make_chain(&a);
    let full = send(&a, &["default/db@s1"]);
    let before = placed(&b);

    // Foreign bytes, and the wrong version.
    let refused = receive_refused(&b, &["default/x"], b"GIF89a this is not a stream at all");
    assert!(refused.contains("not a strata send stream"), "{refused}");
    let mut version = full.clone();
    version[8] = 9;
    let refused = receive_refused(&b, &["default/x"], &version);
    assert!(refused.contains("version 9"), "{refused}");

    // A corrupted byte in the data: refused, and the volume made for it is gone.
    let mut corrupt = full.clone();
    let at = full.len() / 2;
    corrupt[at] ^= 0x10;
    let refused = receive_refused(&b, &["default/x"], &corrupt);
    assert!(refused.contains("checksum mismatch"), "{refused}");
    assert!(!volumes(&b).contains(&"default/x".to_string()));
    export_missing(&b, "default/x");
    assert_eq!(placed(&b), before, "a refused stream left data behind");

    // A truncated stream: refused with a resume token; nothing is visible
    // and the partial volume is discarded by --abort.
    let refused = receive_refused(&b, &["default/x"], &full[..full.len() - 1000]);
    assert!(
        refused.contains("stopped at") && refused.contains("resume with: strata send -t "),
        "{refused}"
    );
    assert!(!volumes(&b).contains(&"default/x".to_string()));
    export_missing(&b, "default/x");
    cli_ok(&b, &["receive", "--abort", "default/x"]);
    assert_eq!(placed(&b), before, "an aborted receive left data behind");

    // The chain: B holds @s1. The wrong base (s2 -> s3) is refused at once.
    receive_ok(&b, &["default/copy"], &full);
    let wrong = send(&a, &["default/db@s3", "-i", "@s2"]);
    let refused = receive_refused(&b, &["default/copy"], &wrong);
    assert!(refused.contains("wrong base"), "{refused}");
    compare(&a.uri("default/db@s1"), &b.uri("default/copy"));

    // A corrupt incremental stream is refused and rolled back: the copy
    // is @s1 again, exported, and can take the right stream.
    let good = send(&a, &["default/db@s2", "-i", "@s1"]);
    let mut corrupt = good.clone();
    let at = good.len() - 2000;
    corrupt[at] ^= 1;
    let refused = receive_refused(&b, &["default/copy"], &corrupt);
    assert!(refused.contains("corrupt send stream"), "{refused}");
    compare(&a.uri("default/db@s1"), &b.uri("default/copy"));
    // Records out of order (two swapped) are refused too: the stream's
    // records after the header, swapped pairwise where they are the
    // same size, fail the order check or the stream checksum.
    let header = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let first_len = 32 + u32::from_le_bytes(good[header + 4..header + 8].try_into().unwrap()) as usize;
    let second_len =
        32 + u32::from_le_bytes(good[header + first_len + 4..header + first_len + 8].try_into().unwrap()) as usize;
    let mut swapped = good[..header].to_vec();
    swapped.extend_from_slice(&good[header + first_len..header + first_len + second_len]);
    swapped.extend_from_slice(&good[header..header + first_len]);
    swapped.extend_from_slice(&good[header + first_len + second_len..]);
    let refused = receive_refused(&b, &["default/copy"], &swapped);
    assert!(refused.contains("out of order"), "{refused}");
    compare(&a.uri("default/db@s1"), &b.uri("default/copy"));
    // A volume changed since its snapshot takes no incremental stream.
    qemu_io_ok(&b.uri("default/copy"), &["write -P 0x77 0 4k".into()]);
    let refused = receive_refused(&b, &["default/copy"], &good);
    assert!(refused.contains("was modified since its snapshot @s1"), "{refused}");
    cli_ok(&b, &["snapshot", "rollback", "default/copy@s1"]);
    receive_ok(&b, &["default/copy"], &good);
    compare(&a.uri("default/db@s2"), &b.uri("default/copy@s2"));
}

#[test]
fn an_interrupted_receive_resumes_even_after_a_kill_9() {
    require_tool("qemu-img");
    require_tool("nbdinfo");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(a_dir.path());
    let mut b = start(b_dir.path());
    cli_ok(&a, &["volume", "create", "default/big", "--size", "256M"]);
    qemu_io_ok(
        &a.uri("default/big"),
        &["write -P 0x5a 0 200M".into(), "write -P 0x5b 210M 40M".into()],
    );
    cli_ok(&a, &["snapshot", "create", "default/big@one"]);
    let stream = send(&a, &["default/big@one"]);
    let before = placed(&b);

    // Feed the first 150 MiB, wait for the daemon to record progress,
    // then kill it in the middle of the receive.
    let mut child = Command::new(STRATA)
        .args(["receive", "default/big"])
        .arg("--data-dir")
        .arg(&b.data_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&stream[..150 << 20]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let received = received_bytes(&b, "default/big");
        if received > 64 << 20 {
            break;
        }
        assert!(Instant::now() < deadline, "no progress recorded: {received} bytes");
        std::thread::sleep(Duration::from_millis(200));
    }
    b.kill9();
    drop(stdin);
    let _ = child.wait_with_output();
    let b = Server::start(b_dir.path());

    // Nothing half-applied is visible; the receive resumes from its token.
    assert!(!volumes(&b).contains(&"default/big".to_string()));
    export_missing(&b, "default/big");
    let token = pending_token(&b, "default/big");
    let rest = send(&a, &["-t", &token]);
    assert!(
        rest.len() < stream.len() - (64 << 20),
        "{} of {}",
        rest.len(),
        stream.len()
    );
    // The continuation of another receive is refused.
    let refused = receive_refused(&b, &["default/other", "--resume", &token], &rest);
    assert!(
        refused.contains("no receive into 'default/other' is pending"),
        "{refused}"
    );
    receive_ok(&b, &["--resume", &token], &rest);
    compare(&a.uri("default/big@one"), &b.uri("default/big@one"));
    compare(&a.uri("default/big"), &b.uri("default/big"));
    // No space leaked: the pool holds exactly the volume's blocks.
    assert_eq!(
        placed(&b),
        before + 240 * (1 << 20),
        "placed bytes after the resumed receive"
    );

    // A kill -9 with nothing to resume from: --abort gives all the space back.
    let mut b = b;
    let mut child = Command::new(STRATA)
        .args(["receive", "default/second"])
        .arg("--data-dir")
        .arg(&b.data_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&stream[..100 << 20]).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    b.kill9();
    drop(stdin);
    let _ = child.wait_with_output();
    let b = Server::start(b_dir.path());
    assert!(!volumes(&b).contains(&"default/second".to_string()));
    cli_ok(&b, &["receive", "--abort", "default/second"]);
    assert_eq!(
        placed(&b),
        before + 240 * (1 << 20),
        "space left behind by the aborted receive"
    );
}

/// `POST` of a send stream to the TCP API with the daemon's token: the
/// status line and the body of the answer.
fn post_stream(server: &Server, path: &str, stream: &[u8]) -> (String, String) {
    use std::io::Read;
    let mut connection = std::net::TcpStream::connect(&server.api).expect("connect to the API");
    let token = token_for(&server.api).expect("the test daemon's token");
    write!(
        connection,
        "POST {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAuthorization: Bearer {token}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        server.api,
        stream.len()
    )
    .unwrap();
    // The daemon may answer before it has read everything.
    let _ = connection.write_all(stream);
    let mut answer = String::new();
    let _ = connection.read_to_string(&mut answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (head.lines().next().unwrap_or("").to_string(), body.to_string())
}

/// A receive into a pool that runs out of space is answered as that: HTTP
/// 507 with a message naming the pool (the CLI's one line), never a 500;
/// the receive stays pending, and once a device adds space it resumes from
/// its token and the volume is the snapshot sent.
#[test]
fn a_receive_into_a_full_pool_says_so_and_resumes_once_space_is_added() {
    require_tool("qemu-img");
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    // 32 MiB of data space: the fast device holds the metadata and the log.
    let fast = common::sparse_file(dir.path(), "fast.img", 113 * MIB);
    let capacity = common::sparse_file(dir.path(), "capacity.img", 17 * MIB);
    cli_ok(
        &server,
        &["pool", "create", "tank", "--fast", &fast, "--capacity", &capacity],
    );
    assert_eq!(common::pool_json(&server, "tank")["size_bytes"], 32 * MIB);
    cli_ok(&server, &["volume", "create", "default/src", "--size", "64M"]);
    qemu_io_ok(
        &server.uri("default/src"),
        &[
            "write -P 0x6d 0 40M".into(),
            "write -P 0x6e 44M 8M".into(),
            "flush".into(),
        ],
    );
    cli_ok(&server, &["snapshot", "create", "default/src@s"]);
    let stream = send(&server, &["default/src@s"]);

    // The CLI: one line that says what happened, and how to resume.
    let output = common::send::receive(&server, &["tank/copy"], &stream);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let mut lines = stderr.lines();
    assert_eq!(
        lines.next(),
        Some(
            "strata: error: no space left in pool 'tank' for the received data; add a device to the pool or free space in it, then resume the receive"
        ),
        "{stderr}"
    );
    assert!(
        lines
            .next()
            .is_some_and(|l| l.starts_with("resume with: strata send -t ")),
        "{stderr}"
    );
    assert!(!volumes(&server).contains(&"tank/copy".to_string()));

    // The API: 507 with the resume token, for the continuation too while
    // the pool is still full.
    let token = pending_token(&server, "tank/copy");
    let rest = send(&server, &["-t", &token]);
    let (status, body) = post_stream(&server, "/v1/volumes/tank/copy/receive?resume=true", &rest);
    assert_eq!(status, "HTTP/1.1 507 Insufficient Storage", "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .starts_with("no space left in pool 'tank'"),
        "{answer}"
    );
    assert!(
        answer["resume_token"].as_str().is_some_and(|t| !t.is_empty()),
        "{answer}"
    );

    // Space added: the receive resumes where it stopped and completes.
    let more = common::sparse_file(dir.path(), "more.img", 65 * MIB);
    cli_ok(&server, &["pool", "add-device", "tank", "--capacity", &more]);
    let token = pending_token(&server, "tank/copy");
    let rest = send(&server, &["-t", &token]);
    receive_ok(&server, &["--resume", &token], &rest);
    compare(&server.uri("default/src@s"), &server.uri("tank/copy@s"));
    compare(&server.uri("default/src@s"), &server.uri("tank/copy"));
}
