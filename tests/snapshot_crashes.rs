//! Crashes in the middle of the snapshot commands that rewrite a volume,
//! against the real daemon: a kill -9 during `snapshot rollback`, a kill
//! -9 of the receiving daemon during a full or an incremental receive
//! (held mid-stream, or at any moment of a whole one), and a kill of the
//! `strata send` feeding a receive. After each: the volume reads exactly
//! one of the two images it may have (compared block for block), an
//! acknowledged command is never undone, a receive that did not finish is
//! invisible and resumes (or aborts) from its token, and the pool holds
//! exactly the bytes the surviving images need: nothing leaked. And a
//! kill -9 while snapshots' writes are still in the RAM cache.

mod common;

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::send::{
    compare, export_missing, pending_token, placed, receive, receive_ok, received_bytes, send, volumes,
};
use common::{
    cli, cli_ok, qemu_io, qemu_io_ok, qemu_io_read_only, require_tool, small_default_pool, token_for, Server,
};

const STRATA: &str = env!("CARGO_BIN_EXE_strata");
const MIB: u64 = 1 << 20;

fn start(dir: &Path) -> Server {
    small_default_pool(dir);
    Server::start(dir)
}

/// Whether every `read -P` of `image` matches at `uri` (opened read-only).
fn reads_as(uri: &str, image: &[String]) -> bool {
    let mut command = Command::new("qemu-io");
    command.args(["-r", "-f", "raw"]);
    for c in image {
        command.arg("-c").arg(c);
    }
    let output = command.arg(uri).output().expect("run qemu-io");
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    output.status.success() && !text.contains("failed") && !text.contains("error")
}

fn snapshot_names(server: &Server, volume: &str) -> Vec<String> {
    serde_json::from_str::<serde_json::Value>(&cli_ok(server, &["snapshot", "list", "--json", volume]))
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot"].as_str().unwrap().to_string())
        .collect()
}

fn reads(spec: &[(u8, u64, u64)]) -> Vec<String> {
    spec.iter()
        .map(|(pattern, at, length)| format!("read -P {pattern:#x} {at}M {length}M"))
        .collect()
}

/// The rollback volume as @snap holds it: 128 MiB of 0xa1, then zeros.
fn snap_image() -> Vec<String> {
    reads(&[(0xa1, 0, 128), (0, 128, 384)])
}

/// The volume before the rollback: @snap's data partly overwritten and
/// trimmed, and 192 MiB written past it.
fn changed_image() -> Vec<String> {
    reads(&[
        (0xa1, 0, 32),
        (0xb1, 32, 64),
        (0xa1, 96, 16),
        (0, 112, 144),
        (0xb2, 256, 192),
        (0, 448, 64),
    ])
}

/// The writes that make `changed_image` of `snap_image`, flushed (durable,
/// still in the RAM cache: the rollback places them before undoing them).
fn change(uri: &str) {
    qemu_io_ok(
        uri,
        &[
            "write -P 0xb1 32M 64M".into(),
            "discard 112M 16M".into(),
            "write -P 0xb2 256M 192M".into(),
            "flush".into(),
        ],
    );
}

/// Placed bytes of each image: @snap's 128 MiB, plus what the volume
/// wrote after it (64 MiB overwritten, 192 MiB new; the trimmed 16 MiB
/// stay @snap's).
const SNAP_PLACED: u64 = 128 * MIB;
const CHANGED_PLACED: u64 = (128 + 64 + 192) * MIB;

#[test]
fn kill9_during_a_rollback_leaves_one_image_or_the_other_and_leaks_nothing() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    cli_ok(&server, &["volume", "create", "default/vm", "--size", "512M"]);
    let uri = server.uri("default/vm");
    qemu_io_ok(&uri, &["write -P 0xa1 0 128M".into(), "flush".into()]);
    cli_ok(&server, &["snapshot", "create", "default/vm@snap"]);
    let base = placed(&server);
    assert_eq!(base, SNAP_PLACED);

    // The kill lands at a different moment of the rollback each cycle:
    // before the command reaches the daemon, while it places the cached
    // writes, while it rewrites the map, after it answered. Every other
    // cycle also has a newer snapshot for `-r` to delete first.
    let delays_ms = [0u64, 1, 2, 3, 4, 5, 6, 8, 10, 13, 20, 60, 250];
    let (mut in_flight, mut rolled_back, mut kept) = (0, 0, 0);
    for (cycle, delay_ms) in delays_ms.into_iter().enumerate() {
        let uri = server.uri("default/vm");
        if !reads_as(&uri, &changed_image()) {
            change(&uri);
        }
        let with_later = cycle % 2 == 1;
        if with_later && !snapshot_names(&server, "default/vm").contains(&"later".to_string()) {
            cli_ok(&server, &["snapshot", "create", "default/vm@later"]);
        }
        let mut rollback = Command::new(STRATA)
            .args(["snapshot", "rollback", "-r", "--force", "default/vm@snap", "--data-dir"])
            .arg(&server.data_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let answered = rollback.try_wait().unwrap();
        if answered.is_none() {
            in_flight += 1;
        }
        server.kill9();
        let status = rollback.wait().unwrap();
        let acknowledged = answered.is_some_and(|s| s.success());
        if let Some(status) = answered {
            assert!(
                status.success(),
                "cycle {cycle}: the rollback failed on its own: {status}"
            );
        }
        server = Server::start(dir.path());
        let uri = server.uri("default/vm");

        // The snapshot is intact, whatever happened.
        let snapshots = snapshot_names(&server, "default/vm");
        assert!(snapshots.contains(&"snap".to_string()), "cycle {cycle}: {snapshots:?}");
        qemu_io_read_only(&server.uri("default/vm@snap"), &snap_image());
        // The volume is one image or the other, exactly.
        let is_snap = reads_as(&uri, &snap_image());
        let is_changed = reads_as(&uri, &changed_image());
        assert!(
            is_snap != is_changed,
            "cycle {cycle} (kill after {delay_ms} ms, command {status}): the volume reads as neither image"
        );
        if acknowledged {
            assert!(
                is_snap,
                "cycle {cycle}: an acknowledged rollback was undone by the crash"
            );
        }
        if is_snap {
            rolled_back += 1;
            // Rolled back past @later: -r deleted it first.
            assert_eq!(snapshots, ["snap"], "cycle {cycle}");
        } else {
            kept += 1;
            if snapshots.contains(&"later".to_string()) {
                qemu_io_read_only(&server.uri("default/vm@later"), &changed_image());
            }
        }
        // Nothing leaked: the pool holds exactly the surviving image's blocks.
        let expected = if is_snap { SNAP_PLACED } else { CHANGED_PLACED };
        assert_eq!(
            placed(&server),
            expected,
            "cycle {cycle} (kill after {delay_ms} ms): placed bytes, volume rolled back: {is_snap}"
        );
        eprintln!("cycle {cycle}: kill after {delay_ms} ms, command {status}, rolled back: {is_snap}");
    }
    assert!(in_flight > 0, "no kill landed while a rollback command ran");
    eprintln!("{in_flight} kills during the command; {rolled_back} rolled back, {kept} not");

    // The volume still works: a clean rollback, then the snapshot's
    // deletion leave exactly its 128 MiB, now the volume's own.
    let uri = server.uri("default/vm");
    if !reads_as(&uri, &changed_image()) {
        change(&uri);
    }
    cli_ok(&server, &["snapshot", "rollback", "-r", "default/vm@snap"]);
    cli_ok(&server, &["snapshot", "delete", "default/vm@snap"]);
    qemu_io_ok(&uri, &snap_image());
    assert_eq!(placed(&server), SNAP_PLACED);
}

/// `strata receive ARGS --data-dir` fed the first `bytes` of `stream`,
/// its stdin held open (the rest of the stream "still on its way").
fn receive_held(server: &Server, args: &[&str], stream: &[u8], bytes: usize) -> (Child, std::process::ChildStdin) {
    let mut child = Command::new(STRATA)
        .arg("receive")
        .args(args)
        .arg("--data-dir")
        .arg(&server.data_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&stream[..bytes]).unwrap();
    (child, stdin)
}

/// Waits until the receive into `volume` recorded more than `bytes`.
fn wait_for_progress(server: &Server, volume: &str, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let received = received_bytes(server, volume);
        if received > bytes {
            return;
        }
        assert!(Instant::now() < deadline, "no progress recorded: {received} bytes");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The source of the incremental tests: `default/src` (256 MiB) with
/// @base (64 MiB of 0x11) and @next (32 MiB of it overwritten, 8 MiB
/// trimmed, 160 MiB written past it).
fn make_source(a: &Server) {
    cli_ok(a, &["volume", "create", "default/src", "--size", "256M"]);
    let uri = a.uri("default/src");
    qemu_io_ok(&uri, &["write -P 0x11 0 64M".into(), "flush".into()]);
    cli_ok(a, &["snapshot", "create", "default/src@base"]);
    qemu_io_ok(
        &uri,
        &[
            "write -P 0x22 16M 32M".into(),
            "discard 56M 8M".into(),
            "write -P 0x33 64M 160M".into(),
            "flush".into(),
        ],
    );
    cli_ok(a, &["snapshot", "create", "default/src@next"]);
}

/// What B places for a copy of @base, and of @base and @next.
const BASE_PLACED: u64 = 64 * MIB;
const NEXT_PLACED: u64 = (64 + 32 + 160) * MIB;

/// The receive's eight 1 MiB writes in flight meet in one map page: unless
/// the engine logs a map page's copy into a snapshot before making it
/// visible, one can log its mapping ahead of the other's `CopyPage` record,
/// and about one run in 40 fails here (a hole of @base reads the
/// incremental stream's data after the kill; after an aborted receive a
/// block both snapshots share reads the aborted stream's). The engine's
/// unit test `a_page_copy_is_logged_before_the_writes_that_find_it_made`
/// forces that interleaving.
#[test]
fn kill9_of_the_receiver_during_an_incremental_receive_resumes_or_aborts_cleanly() {
    require_tool("qemu-img");
    require_tool("nbdinfo");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(a_dir.path());
    let mut b = start(b_dir.path());
    make_source(&a);
    receive_ok(&b, &["default/copy"], &send(&a, &["default/src@base"]));
    assert_eq!(placed(&b), BASE_PLACED);
    let incremental = send(&a, &["default/src@next", "-i", "@base"]);
    assert!(incremental.len() > 190 << 20, "{}", incremental.len());

    // Killed with 150 MiB of the stream fed and more than 64 MiB applied.
    let (child, stdin) = receive_held(&b, &["default/copy"], &incremental, 150 << 20);
    wait_for_progress(&b, "default/copy", 64 << 20);
    b.kill9();
    drop(stdin);
    let _ = child.wait_with_output();
    let b = Server::start(b_dir.path());

    // The half-applied volume is hidden; its snapshot @base is unchanged
    // and readable; @next is not there.
    assert!(!volumes(&b).contains(&"default/copy".to_string()));
    export_missing(&b, "default/copy");
    compare(&a.uri("default/src@base"), &b.uri("default/copy@base"));
    assert_eq!(snapshot_names(&b, "default/copy"), ["base"]);
    // The token resumes it to completion, sending only the rest.
    let token = pending_token(&b, "default/copy");
    let rest = send(&a, &["-t", &token]);
    assert!(
        rest.len() < incremental.len() - (64 << 20),
        "{} of {}",
        rest.len(),
        incremental.len()
    );
    receive_ok(&b, &["--resume", &token], &rest);
    compare(&a.uri("default/src@next"), &b.uri("default/copy@next"));
    compare(&a.uri("default/src@next"), &b.uri("default/copy"));
    compare(&a.uri("default/src@base"), &b.uri("default/copy@base"));
    assert_eq!(placed(&b), NEXT_PLACED, "placed bytes after the resumed receive");

    // Once more, from @next to @third, killed and then aborted: the copy
    // is @next again, exported, and all the partial stream wrote is freed.
    qemu_io_ok(&a.uri("default/src"), &["write -P 0x44 0 100M".into(), "flush".into()]);
    cli_ok(&a, &["snapshot", "create", "default/src@third"]);
    let third = send(&a, &["default/src@third", "-i", "@next"]);
    let mut b = b;
    let (child, stdin) = receive_held(&b, &["default/copy"], &third, 80 << 20);
    wait_for_progress(&b, "default/copy", 32 << 20);
    b.kill9();
    drop(stdin);
    let _ = child.wait_with_output();
    let b = Server::start(b_dir.path());
    export_missing(&b, "default/copy");
    cli_ok(&b, &["receive", "--abort", "default/copy"]);
    assert_eq!(snapshot_names(&b, "default/copy"), ["base", "next"]);
    compare(&a.uri("default/src@next"), &b.uri("default/copy"));
    assert_eq!(placed(&b), NEXT_PLACED, "space left behind by the aborted receive");
    // And the whole stream applies after that.
    receive_ok(&b, &["default/copy"], &third);
    compare(&a.uri("default/src@third"), &b.uri("default/copy"));
    assert_eq!(placed(&b), NEXT_PLACED + 100 * MIB);
}

#[test]
fn kill9_of_the_receiver_at_any_moment_of_a_full_receive() {
    require_tool("qemu-img");
    require_tool("nbdinfo");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(a_dir.path());
    let mut b = start(b_dir.path());
    cli_ok(&a, &["volume", "create", "default/src", "--size", "128M"]);
    qemu_io_ok(
        &a.uri("default/src"),
        &[
            "write -P 0x61 0 40M".into(),
            "write -P 0x62 64M 56M".into(),
            "flush".into(),
        ],
    );
    cli_ok(&a, &["snapshot", "create", "default/src@one"]);
    let stream = send(&a, &["default/src@one"]);
    let empty = placed(&b);

    // The whole stream, the daemon killed at a growing delay: mid-stream,
    // at END, while the received snapshot is taken and recorded, after.
    let (mut finished, mut resumed, mut absent) = (0, 0, 0);
    for delay_ms in [20u64, 50, 80, 110, 140, 170, 200, 230, 260, 300, 500] {
        let mut child = Command::new(STRATA)
            .args(["receive", "default/copy", "--data-dir"])
            .arg(&b.data_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let feeder = {
            let stream = stream.clone();
            std::thread::spawn(move || {
                let _ = stdin.write_all(&stream);
            })
        };
        std::thread::sleep(Duration::from_millis(delay_ms));
        let answered = child.try_wait().unwrap();
        b.kill9();
        let _ = child.wait();
        feeder.join().unwrap();
        b = Server::start(b_dir.path());

        if let Some(status) = answered {
            assert!(status.success(), "the receive failed on its own: {status}");
        }
        let listed = volumes(&b).contains(&"default/copy".to_string());
        let pending = cli(&b, &["receive", "--status", "default/copy"]).status.success();
        assert!(
            !(listed && pending),
            "kill after {delay_ms} ms: listed and pending at once"
        );
        if answered.is_some() {
            assert!(listed, "kill after {delay_ms} ms: an acknowledged receive was undone");
        }
        if listed {
            finished += 1;
        } else if pending {
            resumed += 1;
            export_missing(&b, "default/copy");
            let token = pending_token(&b, "default/copy");
            receive_ok(&b, &["--resume", &token], &send(&a, &["-t", &token]));
        } else {
            absent += 1;
            export_missing(&b, "default/copy");
            assert_eq!(
                placed(&b),
                empty,
                "kill after {delay_ms} ms: nothing received, space held"
            );
            receive_ok(&b, &["default/copy"], &stream);
        }
        compare(&a.uri("default/src@one"), &b.uri("default/copy@one"));
        compare(&a.uri("default/src@one"), &b.uri("default/copy"));
        assert_eq!(placed(&b), empty + 96 * MIB, "kill after {delay_ms} ms: placed bytes");
        eprintln!("kill after {delay_ms} ms: listed {listed}, pending {pending}");
        cli_ok(&b, &["snapshot", "delete", "default/copy@one"]);
        cli_ok(&b, &["volume", "delete", "default/copy"]);
        assert_eq!(
            placed(&b),
            empty,
            "kill after {delay_ms} ms: space after deleting the copy"
        );
    }
    eprintln!("{finished} finished, {resumed} resumed, {absent} started over");
    assert!(resumed > 0, "no kill landed in the middle of the receive");
}

/// `strata send SEND_ARGS | strata receive RECEIVE_ARGS` (over B's TCP
/// API, as from another machine), the sender killed once it has written
/// `kill_after` bytes; what it wrote before is still delivered. The
/// receive's output.
fn pipe_killing_the_sender(
    a: &Server,
    b: &Server,
    send_args: &[&str],
    receive_args: &[&str],
    kill_after: usize,
) -> Output {
    let mut sender = Command::new(STRATA)
        .arg("send")
        .args(send_args)
        .arg("--data-dir")
        .arg(&a.data_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut receiver = Command::new(STRATA)
        .arg("receive")
        .args(receive_args)
        .args(["--api", &b.api])
        .env("STRATA_TOKEN", token_for(&b.api).unwrap())
        .env_remove("STRATA_DATA_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut from = sender.stdout.take().unwrap();
    let mut to = receiver.stdin.take().unwrap();
    let mut relayed = 0;
    let mut buffer = vec![0u8; 1 << 16];
    let mut killed = false;
    loop {
        if !killed && relayed >= kill_after {
            sender.kill().unwrap();
            killed = true;
        }
        let n = from.read(&mut buffer).unwrap();
        if n == 0 {
            break;
        }
        to.write_all(&buffer[..n]).unwrap();
        relayed += n;
    }
    let status = sender.wait().unwrap();
    assert!(
        killed && status.signal() == Some(libc::SIGKILL),
        "the sender finished ({relayed} bytes, {status}) before it was killed"
    );
    drop(to);
    receiver.wait_with_output().unwrap()
}

/// The receive's stderr: one error line, then the line with its token.
fn interrupted(output: &Output) -> String {
    assert!(!output.status.success(), "the receive of a cut stream succeeded");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with("strata: error: the send stream stopped at ") && lines[0].contains("can be resumed"),
        "{stderr}"
    );
    assert!(lines[1].starts_with("resume with: strata send -t "), "{stderr}");
    lines[1].split_whitespace().nth(5).unwrap().to_string()
}

#[test]
fn a_killed_sender_leaves_a_receive_that_resumes_or_aborts_and_nothing_half_applied() {
    require_tool("qemu-img");
    require_tool("nbdinfo");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(a_dir.path());
    let b = start(b_dir.path());
    make_source(&a);
    let empty = placed(&b);

    // A full send killed after 40 MiB: refused with its token, nothing
    // visible; aborted, nothing left; sent again whole, received.
    let output = pipe_killing_the_sender(&a, &b, &["default/src@base"], &["default/copy"], 40 << 20);
    let token = interrupted(&output);
    assert_eq!(token, pending_token(&b, "default/copy"));
    assert!(!volumes(&b).contains(&"default/copy".to_string()));
    export_missing(&b, "default/copy");
    export_missing(&b, "default/copy@base");
    cli_ok(&b, &["receive", "--abort", "default/copy"]);
    let status = cli(&b, &["receive", "--status", "default/copy"]);
    assert!(!status.status.success(), "a receive is still pending after --abort");
    assert_eq!(placed(&b), empty, "the aborted receive left data behind");
    receive_ok(&b, &["default/copy"], &send(&a, &["default/src@base"]));
    compare(&a.uri("default/src@base"), &b.uri("default/copy"));
    assert_eq!(placed(&b), empty + BASE_PLACED);

    // An incremental send killed after 100 MiB: the copy is hidden, its
    // @base intact; the token resumes it to @next exactly.
    let output = pipe_killing_the_sender(
        &a,
        &b,
        &["default/src@next", "-i", "@base"],
        &["default/copy"],
        100 << 20,
    );
    let token = interrupted(&output);
    // It kept every whole record the sender wrote before it died (at
    // least 100 MiB were relayed; a record is at most 1 MiB and 32 bytes).
    let received = received_bytes(&b, "default/copy");
    assert!(received > 98 << 20 && received < 102 << 20, "{received}");
    export_missing(&b, "default/copy");
    compare(&a.uri("default/src@base"), &b.uri("default/copy@base"));
    assert_eq!(snapshot_names(&b, "default/copy"), ["base"]);
    // The same stream again, not a continuation, is refused while pending.
    let again = receive(&b, &["default/copy"], &send(&a, &["default/src@next", "-i", "@base"]));
    assert!(!again.status.success());
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(said.contains("is pending"), "{said}");
    let rest = send(&a, &["-t", &token]);
    receive_ok(&b, &["--resume", &token], &rest);
    compare(&a.uri("default/src@next"), &b.uri("default/copy@next"));
    compare(&a.uri("default/src@next"), &b.uri("default/copy"));
    assert_eq!(placed(&b), empty + NEXT_PLACED);
    let (ok, text) = qemu_io(&b.uri("default/copy"), &["read -P 0x33 64M 160M".into()]);
    assert!(ok && !text.contains("failed"), "{text}");
}

/// Small writes (`length` MiB from `at` MiB in 64 KiB pieces, so they go
/// through the RAM cache) of `pattern`.
fn cached_writes(uri: &str, pattern: u8, at: u64, length: u64) {
    let commands: Vec<String> = (0..length * 16)
        .map(|i| format!("write -P {pattern:#x} {}k 64k", at * 1024 + i * 64))
        .collect();
    qemu_io_ok(uri, &commands);
}

/// Snapshots leave the volume's cached writes in the RAM cache (they
/// belong to the snapshot and are placed later): after a kill -9 those
/// entries come back from the RAM tier, and each snapshot still reads
/// exactly the writes acknowledged before it — through overwrites of its
/// cached sectors, a newer snapshot, and writes after the restart.
#[test]
fn kill9_with_a_snapshots_writes_still_cached_keeps_every_image() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = start(dir.path());
    server.create_volume("default/v", "16M");
    let uri = server.uri("default/v");
    cached_writes(&uri, 0x11, 0, 4);
    cli_ok(&server, &["snapshot", "create", "default/v@s1"]);
    // Overwrites of s1's cached sectors, and new ones.
    cached_writes(&uri, 0x22, 2, 4);
    cli_ok(&server, &["snapshot", "create", "default/v@s2"]);
    cached_writes(&uri, 0x33, 1, 2);
    let s1 = reads(&[(0x11, 0, 4), (0, 4, 12)]);
    let s2 = reads(&[(0x11, 0, 2), (0x22, 2, 4), (0, 6, 10)]);
    let now = reads(&[(0x11, 0, 1), (0x33, 1, 2), (0x22, 3, 3), (0, 6, 10)]);
    server.kill9();
    let server = Server::start(dir.path());
    assert!(reads_as(&server.uri("default/v@s1"), &s1), "s1 after the kill");
    assert!(reads_as(&server.uri("default/v@s2"), &s2), "s2 after the kill");
    assert!(reads_as(&server.uri("default/v"), &now), "the volume after the kill");
    // New writes after the restart come after both snapshots.
    cached_writes(&server.uri("default/v"), 0x44, 0, 1);
    cli_ok(&server, &["snapshot", "create", "default/v@s3"]);
    cached_writes(&server.uri("default/v"), 0x55, 5, 2);
    let s3 = reads(&[(0x44, 0, 1), (0x33, 1, 2), (0x22, 3, 3), (0, 6, 10)]);
    assert!(reads_as(&server.uri("default/v@s3"), &s3), "s3");
    assert!(reads_as(&server.uri("default/v@s2"), &s2), "s2 after more writes");
    assert!(reads_as(&server.uri("default/v@s1"), &s1), "s1 after more writes");
    let after = reads(&[(0x44, 0, 1), (0x33, 1, 2), (0x22, 3, 2), (0x55, 5, 2), (0, 7, 9)]);
    assert!(reads_as(&server.uri("default/v"), &after), "the volume at the end");
}
