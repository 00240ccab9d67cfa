//! Snapshots as the frontends serve them, through real clients: each
//! snapshot's write-protected iSCSI target (libiscsi's tools, qemu-img,
//! qemu-io and a raw initiator for the sense data), the NBD changed-block
//! context (`nbdinfo --map`), and `snapshot rollback --force` with clients
//! connected. The daemon runs on ephemeral loopback ports and is stopped by
//! PID.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};

use common::iscsi::{command, command_out, login, Reply};
use common::nbd::{name_payload, Raw};
use common::{cli_ok, qemu_io_ok, require_tool, Server};

const VOLUME_TARGET: &str = "iqn.2026-11.io.strata:default.vol";
const SNAPSHOT_TARGET: &str = "iqn.2026-11.io.strata.snapshot:default.vol:s1";

fn iscsi_url(server: &Server, target: &str) -> String {
    format!("iscsi://{}/{target}/0", server.iscsi)
}

/// Runs a tool: (exit status success, stdout + stderr).
fn tool(name: &str, args: &[&str]) -> (bool, String) {
    let output = Command::new(name)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{name} is required for this test (install it): {e}"));
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

fn tool_ok(name: &str, args: &[&str]) -> String {
    let (ok, text) = tool(name, args);
    assert!(ok, "{name} {args:?} failed:\n{text}");
    text
}

/// Waits (up to 10 s) until `snapshot list` shows `count` connections to
/// the snapshot's exports.
fn wait_for_clients(server: &Server, snapshot: &str, count: u64) {
    let volume = snapshot.split_once('@').unwrap().0;
    for _ in 0..1000 {
        let listed: serde_json::Value =
            serde_json::from_str(&cli_ok(server, &["snapshot", "list", "--json", volume])).unwrap();
        let now = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == snapshot)
            .map(|s| s["connections"].as_u64().unwrap());
        if now == Some(count) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("{snapshot} never had {count} connections");
}

fn is_write_protected(reply: &Reply) -> bool {
    reply.status == 0x02 && reply.sense == Some((0x7, 0x27, 0x00))
}

/// MODE SENSE(6), all pages: the device-specific parameter's WP bit.
fn write_protect_bit(stream: &mut std::net::TcpStream) -> bool {
    let reply = command(stream, 0x300, &[0x1a, 0x08, 0x3f, 0, 0xff, 0], 0xff);
    assert_eq!(reply.status, 0, "MODE SENSE: {reply:?}");
    reply.data[2] & 0x80 != 0
}

/// Every medium-changing command, each with the data it carries.
fn writes() -> Vec<(&'static str, Vec<u8>, Vec<u8>)> {
    let block = vec![0x5au8; 512];
    let mut unmap = vec![0u8; 24];
    unmap[1] = 22; // data length
    unmap[3] = 16; // block descriptor data length
    unmap[8..16].copy_from_slice(&8u64.to_be_bytes());
    unmap[16..20].copy_from_slice(&1u32.to_be_bytes());
    vec![
        ("WRITE(6)", vec![0x0a, 0, 0, 8, 1, 0], block.clone()),
        ("WRITE(10)", vec![0x2a, 0, 0, 0, 0, 8, 0, 0, 1, 0], block.clone()),
        ("WRITE(12)", vec![0xaa, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0], block.clone()),
        (
            "WRITE(16)",
            vec![0x8a, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0],
            block.clone(),
        ),
        (
            "WRITE AND VERIFY(10)",
            vec![0x2e, 0, 0, 0, 0, 8, 0, 0, 1, 0],
            block.clone(),
        ),
        ("WRITE SAME(10)", vec![0x41, 0, 0, 0, 0, 8, 0, 0, 1, 0], block.clone()),
        (
            "WRITE SAME(16) UNMAP",
            vec![0x93, 0x08, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0],
            block.clone(),
        ),
        ("UNMAP", vec![0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0], unmap),
        (
            "COMPARE AND WRITE",
            vec![0x89, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0],
            [vec![0u8; 512], block].concat(),
        ),
    ]
}

#[test]
fn every_snapshot_is_a_write_protected_iscsi_target_of_a_frozen_image() {
    for name in ["iscsi-ls", "iscsi-inq", "qemu-img", "qemu-io"] {
        require_tool(name);
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    cli_ok(&server, &["volume", "create", "default/vol", "--size", "32M"]);
    let volume_nbd = server.uri("default/vol");
    qemu_io_ok(
        &volume_nbd,
        &["write -P 0xa1 0 8M".into(), "write -P 0xa2 20M 4M".into()],
    );
    // The copy taken at snapshot time (nothing writes meanwhile).
    let copy = dir.path().join("at-snapshot.raw");
    tool_ok(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", &volume_nbd, copy.to_str().unwrap()],
    );
    cli_ok(&server, &["snapshot", "create", "default/vol@s1"]);

    // Discovery lists the volume's target and its snapshot's, and the
    // snapshot target answers INQUIRY.
    let listed = tool_ok("iscsi-ls", &["-s", &format!("iscsi://{}", server.iscsi)]);
    assert!(listed.contains(&format!("Target:{VOLUME_TARGET} ")), "{listed}");
    assert!(listed.contains(&format!("Target:{SNAPSHOT_TARGET} ")), "{listed}");
    let inquiry = tool_ok("iscsi-inq", &[&iscsi_url(&server, SNAPSHOT_TARGET)]);
    assert!(inquiry.contains("STRATA"), "{inquiry}");

    // The volume keeps changing while a backup reads the snapshot's target.
    let mut writer_commands = Vec::new();
    for round in 0..200u64 {
        let pattern = 0x10 + round % 0x60;
        writer_commands.push(format!("write -P {pattern} {}M 1M", round % 32));
    }
    let mut writer = Command::new("qemu-io");
    writer.args(["-f", "raw"]);
    for c in &writer_commands {
        writer.arg("-c").arg(c);
    }
    let mut writer = writer
        .arg(&volume_nbd)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start qemu-io");
    let snapshot_url = iscsi_url(&server, SNAPSHOT_TARGET);
    let compared = tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &snapshot_url,
            copy.to_str().unwrap(),
        ],
    );
    assert!(writer.wait().unwrap().success());
    assert!(
        compared.0,
        "the snapshot's target differs from the copy:\n{}",
        compared.1
    );
    tool_ok(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &snapshot_url,
            copy.to_str().unwrap(),
        ],
    );
    // ... and the volume itself did change (the comparison can fail).
    let (same, text) = tool(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &volume_nbd, copy.to_str().unwrap()],
    );
    assert!(!same && text.contains("mismatch"), "{text}");

    // qemu refuses to open a write-protected LUN read-write (it reads WP
    // from MODE SENSE); read-only it reads the frozen image.
    let (ok, text) = common::qemu_io(&snapshot_url, &["read -P 0xa1 0 8M".into()]);
    assert!(!ok && text.contains("write protected"), "{text}");
    common::qemu_io_read_only(
        &snapshot_url,
        &[
            "read -P 0xa1 0 8M".into(),
            "read -P 0 8M 12M".into(),
            "read -P 0xa2 20M 4M".into(),
        ],
    );

    // Raw: WP is set on the snapshot's unit and not on the volume's; every
    // write command is refused with DATA PROTECT / WRITE PROTECTED on the
    // snapshot and succeeds on the volume.
    let address: SocketAddr = server.iscsi.parse().unwrap();
    let mut snapshot = login(address, SNAPSHOT_TARGET);
    let mut volume = login(address, VOLUME_TARGET);
    assert!(write_protect_bit(&mut snapshot));
    assert!(!write_protect_bit(&mut volume));
    for (itt, (name, cdb, data)) in writes().into_iter().enumerate() {
        let refused = command_out(&mut snapshot, 0x400 + itt as u32, &cdb, &data);
        assert!(is_write_protected(&refused), "{name} on the snapshot: {refused:?}");
        // (COMPARE AND WRITE compares with zeros: UNMAP just cleared the block.)
        let done = command_out(&mut volume, 0x400 + itt as u32, &cdb, &data);
        assert_eq!(done.status, 0, "{name} on the volume: {done:?}");
    }
    // Reads and a cache flush still work on the snapshot.
    let read = command(&mut snapshot, 0x500, &[0x28, 0, 0, 0, 0, 8, 0, 0, 1, 0], 512);
    assert_eq!(read.status, 0);
    assert!(read.data.iter().all(|&b| b == 0xa1), "{:x?}", &read.data[..16]);
    let sync = command(&mut snapshot, 0x501, &[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0);
    assert_eq!(sync.status, 0, "{sync:?}");
    // A logged-in session is a client: the snapshot cannot be deleted
    // under it.
    let busy = common::cli(&server, &["snapshot", "delete", "default/vol@s1"]);
    assert!(!busy.status.success());
    let said = String::from_utf8_lossy(&busy.stderr);
    assert!(said.contains("1 client connection"), "{said}");
    drop(snapshot);
    drop(volume);
    wait_for_clients(&server, "default/vol@s1", 0);

    // The volume's access rules apply to its snapshots' targets.
    cli_ok(
        &server,
        &[
            "volume",
            "set",
            "default/vol",
            "iscsi.initiators=iqn.2026-11.example:only",
        ],
    );
    let listed = tool_ok("iscsi-ls", &["-s", &format!("iscsi://{}", server.iscsi)]);
    assert!(!listed.contains(SNAPSHOT_TARGET), "{listed}");
    let (ok, text) = tool("iscsi-inq", &[&snapshot_url]);
    assert!(!ok, "{text}");
    let (ok, text) = tool("iscsi-inq", &["-i", "iqn.2026-11.example:only", &snapshot_url]);
    assert!(ok, "{text}");
    cli_ok(&server, &["volume", "set", "default/vol", "iscsi.initiators=*"]);

    // A deleted snapshot's target is gone from discovery and from login.
    cli_ok(&server, &["snapshot", "delete", "default/vol@s1"]);
    let listed = tool_ok("iscsi-ls", &["-s", &format!("iscsi://{}", server.iscsi)]);
    assert!(
        listed.contains(VOLUME_TARGET) && !listed.contains(SNAPSHOT_TARGET),
        "{listed}"
    );
    let (ok, text) = tool("iscsi-inq", &[&snapshot_url]);
    assert!(!ok, "{text}");
}

/// `nbdinfo --map=CONTEXT`: (offset, length, flags) per line.
fn map_of(context: &str, uri: &str) -> Vec<(u64, u64, u32)> {
    let text = tool_ok("nbdinfo", &[&format!("--map={context}"), uri]);
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            (
                words[0].parse().unwrap(),
                words[1].parse().unwrap(),
                words[2].parse().unwrap(),
            )
        })
        .collect()
}

/// The ranges a map flags with bit 0, merged.
fn flagged(map: &[(u64, u64, u32)]) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &(offset, length, flags) in map {
        if flags & 1 == 0 {
            continue;
        }
        match ranges.last_mut() {
            Some((start, len)) if *start + *len == offset => *len += length,
            _ => ranges.push((offset, length)),
        }
    }
    ranges
}

#[test]
fn a_snapshot_export_reports_the_blocks_changed_since_an_older_snapshot() {
    for name in ["nbdinfo", "qemu-io", "qemu-img"] {
        require_tool(name);
    }
    const K: u64 = 1024;
    const M: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    // volblocksize 16K: changes are reported per 16 KiB block.
    cli_ok(&server, &["volume", "create", "default/cbt", "--size", "16M"]);
    let volume = server.uri("default/cbt");
    qemu_io_ok(&volume, &["write -P 1 0 1M".into(), "write -P 1 4M 1M".into()]);
    cli_ok(&server, &["snapshot", "create", "default/cbt@a"]);
    // Between @a and @b: a partial block, new blocks, a trim of old ones,
    // and a block rewritten with the same bytes (a new slot: reported).
    qemu_io_ok(
        &volume,
        &[
            "write -P 2 2052k 4k".into(),
            "write -P 3 8M 64k".into(),
            "discard 0 64k".into(),
            "write -P 1 4M 16k".into(),
        ],
    );
    cli_ok(&server, &["snapshot", "create", "default/cbt@b"]);
    qemu_io_ok(&volume, &["write -P 4 12M 1M".into(), "write -P 5 100k 4k".into()]);
    cli_ok(&server, &["snapshot", "create", "default/cbt@c"]);

    let b = server.uri("default/cbt@b");
    let expected_a_b = vec![(0, 64 * K), (2 * M, 16 * K), (4 * M, 16 * K), (8 * M, 64 * K)];
    // The export lists its contexts: one pair per older snapshot.
    let info = tool_ok("nbdinfo", &[&b]);
    for context in ["base:allocation", "qemu:dirty-bitmap:a", "strata:changed:a"] {
        assert!(info.contains(context), "{info}");
    }
    assert!(
        !info.contains("dirty-bitmap:b") && !info.contains("dirty-bitmap:c"),
        "{info}"
    );
    let qemu_map = map_of("qemu:dirty-bitmap:a", &b);
    assert_eq!(flagged(&qemu_map), expected_a_b, "{qemu_map:?}");
    assert_eq!(
        qemu_map.iter().map(|m| m.1).sum::<u64>(),
        16 * M,
        "the map covers the export"
    );
    assert_eq!(flagged(&map_of("strata:changed:a", &b)), expected_a_b);
    // Writes after @b are not in it; @c against @b shows only them, and
    // against @a the union.
    let c = server.uri("default/cbt@c");
    assert_eq!(
        flagged(&map_of("qemu:dirty-bitmap:b", &c)),
        vec![(96 * K, 16 * K), (12 * M, M)]
    );
    assert_eq!(
        flagged(&map_of("strata:changed:a", &c)),
        vec![
            (0, 64 * K),
            (96 * K, 16 * K),
            (2 * M, 16 * K),
            (4 * M, 16 * K),
            (8 * M, 64 * K),
            (12 * M, M)
        ]
    );
    // qemu's own NBD client reads the context as a dirty bitmap
    // (x-dirty-bitmap reports dirty extents as "data": false).
    let port = server.nbd.rsplit_once(':').unwrap().1;
    let map = tool_ok(
        "qemu-img",
        &[
            "map",
            "--output=json",
            "--image-opts",
            &format!(
                "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=default/cbt@b,x-dirty-bitmap=qemu:dirty-bitmap:a"
            ),
        ],
    );
    let extents: Vec<serde_json::Value> = serde_json::from_str(&map).unwrap();
    let dirty: Vec<(u64, u64)> = extents
        .iter()
        .filter(|e| e["data"] == false)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(dirty, expected_a_b, "{map}");

    // Not offered: an unknown snapshot, a newer one, and any on the volume
    // itself (its map is still changing).
    for (context, uri) in [
        ("qemu:dirty-bitmap:nosuch", &b),
        ("strata:changed:c", &b),
        ("qemu:dirty-bitmap:b", &b),
        ("qemu:dirty-bitmap:a", &volume),
    ] {
        let (ok, text) = tool("nbdinfo", &[&format!("--map={context}"), uri]);
        assert!(!ok && text.contains("does not support"), "{context} on {uri}: {text}");
    }
    // A deleted older snapshot: its context is gone from the export.
    cli_ok(&server, &["snapshot", "delete", "default/cbt@a"]);
    let info = tool_ok("nbdinfo", &[&c]);
    assert!(
        !info.contains("dirty-bitmap:a") && !info.contains("changed:a") && info.contains("qemu:dirty-bitmap:b"),
        "{info}"
    );
}

/// The volume's open connections (NBD and iSCSI), as `volume get` shows.
fn connections(server: &Server, volume: &str) -> u64 {
    let info: serde_json::Value = serde_json::from_str(&cli_ok(server, &["volume", "get", volume, "--json"])).unwrap();
    info["connections"].as_u64().unwrap_or_else(|| panic!("{info}"))
}

fn wait_for_connections(server: &Server, volume: &str, count: u64) {
    for _ in 0..1000 {
        if connections(server, volume) == count {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("{volume} never had {count} connections");
}

/// The connection was closed by the target: the next read sees the end of
/// the stream (not a timeout: no hang).
fn assert_closed(stream: &mut std::net::TcpStream) {
    use std::io::Read;
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the connection should be closed: {other:?}"),
    }
}

#[test]
fn rollback_is_refused_with_clients_and_force_drops_them_cleanly() {
    for name in ["qemu-io", "iscsi-inq"] {
        require_tool(name);
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    cli_ok(&server, &["volume", "create", "default/vol", "--size", "16M"]);
    let volume = server.uri("default/vol");
    qemu_io_ok(&volume, &["write -P 0xa1 0 4M".into()]);
    cli_ok(&server, &["snapshot", "create", "default/vol@s1"]);
    qemu_io_ok(&volume, &["write -P 0xb2 0 1M".into()]);
    cli_ok(&server, &["snapshot", "create", "default/vol@t"]);
    qemu_io_ok(&volume, &["write -P 0xc3 0 64k".into()]);

    // Clients: qemu-io holding an NBD connection (it reads commands from
    // its stdin), a raw iSCSI session on the volume's target and one on
    // the newer snapshot's target.
    let mut holder = Command::new("qemu-io")
        .args(["-f", "raw", &volume])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start qemu-io");
    let address: SocketAddr = server.iscsi.parse().unwrap();
    let mut session = login(address, VOLUME_TARGET);
    let newer_target = "iqn.2026-11.io.strata.snapshot:default.vol:t";
    let mut newer_session = login(address, newer_target);
    wait_for_connections(&server, "default/vol", 2);

    // Refused, saying who is connected; nothing changes.
    let refused = common::cli(&server, &["snapshot", "rollback", "-r", "default/vol@s1"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("1 NBD client(s) and 1 iSCSI session(s)") && said.contains("--force"),
        "{said}"
    );
    let read = command(&mut session, 0x10, &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0], 512);
    assert_eq!(read.status, 0);
    assert!(read.data.iter().all(|&b| b == 0xc3));

    // --force drops them: each connection ends cleanly, the rollback and
    // the deletion of the newer snapshot happen.
    cli_ok(&server, &["snapshot", "rollback", "-r", "--force", "default/vol@s1"]);
    assert_closed(&mut session);
    assert_closed(&mut newer_session);
    {
        use std::io::Write;
        let mut stdin = holder.stdin.take().unwrap();
        writeln!(stdin, "read -P 0xa1 0 4k").unwrap();
        writeln!(stdin, "quit").unwrap();
    }
    let output = holder.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    assert!(
        text.contains("read failed"),
        "qemu-io kept a dropped connection:\n{text}"
    );
    assert_eq!(connections(&server, "default/vol"), 0);
    qemu_io_ok(&volume, &["read -P 0xa1 0 4M".into(), "read -P 0 4M 12M".into()]);
    let listed = cli_ok(&server, &["snapshot", "list", "default/vol"]);
    assert!(
        listed.contains("default/vol@s1") && !listed.contains("default/vol@t"),
        "{listed}"
    );
    // The deleted snapshot's target is gone; the volume admits clients again.
    let (ok, text) = tool("iscsi-inq", &[&iscsi_url(&server, newer_target)]);
    assert!(!ok, "{text}");
    tool_ok("iscsi-inq", &[&iscsi_url(&server, VOLUME_TARGET)]);

    // The REST API's `force`.
    qemu_io_ok(&volume, &["write -P 0xd4 0 64k".into()]);
    let _session = login(address, VOLUME_TARGET);
    wait_for_connections(&server, "default/vol", 1);
    let response = common::http(&server.api, "POST", "/v1/snapshots/default/vol@s1/rollback", "{}");
    assert!(response.starts_with("HTTP/1.1 409"), "{response}");
    let response = common::http(
        &server.api,
        "POST",
        "/v1/snapshots/default/vol@s1/rollback",
        "{\"force\": true}",
    );
    assert!(response.starts_with("HTTP/1.1 204"), "{response}");
    qemu_io_ok(&volume, &["read -P 0xa1 0 4M".into()]);
}

/// One NBD client of the storm below: lists the exports, asks about one,
/// opens it and reads its first block. Every step may be refused (the
/// export deleted, or closed while its volume rolls back) but must be
/// answered: `Err` says what was not.
fn visit(address: &str, export: &str) -> Result<(), String> {
    let mut raw = Raw::start(address);
    raw.option(3, &[]);
    loop {
        match raw.option_reply().0 {
            2 => continue,
            1 => break,
            other => return Err(format!("LIST answered {other:#x}")),
        }
    }
    let mut data = name_payload(export);
    data.extend_from_slice(&0u16.to_be_bytes());
    raw.option(7, &data);
    loop {
        match raw.option_reply().0 {
            3 => continue,
            1 => break,
            // Unknown (deleted) or otherwise refused: a clear error.
            kind if kind & (1 << 31) != 0 => return Ok(()),
            other => return Err(format!("GO on {export} answered {other:#x}")),
        }
    }
    raw.request(0, 0, 7, 0, 4096, &[]);
    let mut header = [0u8; 16];
    match std::io::Read::read_exact(&mut raw.stream, &mut header) {
        // Closed: the volume was rolling back and took no new client.
        Err(_) => Ok(()),
        Ok(()) if u32::from_be_bytes(header[4..8].try_into().unwrap()) != 0 => Ok(()),
        Ok(()) => {
            let mut block = vec![0u8; 4096];
            std::io::Read::read_exact(&mut raw.stream, &mut block).map_err(|e| format!("read of {export}: {e}"))
        }
    }
}

/// Snapshot create, delete and rollback, clone and promote all finish
/// while NBD clients keep connecting and a writer keeps the destager busy.
/// Admin operations wait on the runtime (for writes in flight and the
/// destager) and the runtime never waits on them: frontends read the
/// catalog as last published. Otherwise NBD handshakes block on the
/// catalog while a snapshot deletion holding it waits for the destager,
/// which has no worker left to run on.
#[test]
fn admin_operations_finish_while_clients_connect_and_write() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    cli_ok(&server, &["volume", "create", "default/vol", "--size", "256M"]);
    cli_ok(&server, &["volume", "create", "default/other", "--size", "16M"]);
    let mut writer = Command::new("fio")
        .args([
            "--name=busy",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--time_based",
            "--runtime=600",
            "--output=/dev/null",
        ])
        .arg(format!("--uri={}", server.uri("default/vol")))
        .current_dir(dir.path())
        .spawn()
        .expect("start fio");

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let exports = std::sync::Arc::new(std::sync::Mutex::new(vec!["default/other".to_string()]));
    let storm: Vec<_> = (0..6)
        .map(|thread| {
            let (stop, exports, address) = (stop.clone(), exports.clone(), server.nbd.clone());
            std::thread::spawn(move || -> Result<u64, String> {
                let mut visits = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let export = {
                        let exports = exports.lock().unwrap();
                        exports[(visits as usize + thread) % exports.len()].clone()
                    };
                    visit(&address, &export)?;
                    visits += 1;
                }
                Ok(visits)
            })
        })
        .collect();

    // The admin work runs on a thread of its own so a hang fails the test
    // instead of stalling it.
    let (done, finished) = std::sync::mpsc::channel();
    let admin = {
        let (data_dir, exports) = (server.data_dir.clone(), exports.clone());
        std::thread::spawn(move || {
            // Refused as busy while a visiting client holds the export:
            // tried again (visits are short), anything else fails.
            let strata = |args: &[&str]| {
                for _ in 0..500 {
                    let output = Command::new(env!("CARGO_BIN_EXE_strata"))
                        .args(args)
                        .arg("--data-dir")
                        .arg(&data_dir)
                        .output()
                        .unwrap();
                    let said = String::from_utf8_lossy(&output.stderr);
                    if output.status.success() {
                        return;
                    }
                    assert!(said.contains("busy"), "strata {args:?}: {said}");
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                panic!("strata {args:?} stayed busy");
            };
            for round in 0..12 {
                let snapshot = format!("default/vol@s{round}");
                strata(&["snapshot", "create", &snapshot]);
                exports.lock().unwrap().push(snapshot.clone());
                let clone = format!("default/c{round}");
                strata(&["volume", "clone", &snapshot, &clone]);
                exports.lock().unwrap().push(clone.clone());
                if round == 5 {
                    // The clone takes vol's snapshots with it, and back.
                    strata(&["volume", "promote", &clone]);
                    strata(&["volume", "promote", "default/vol"]);
                }
                strata(&["volume", "delete", &clone]);
                if round > 0 {
                    strata(&["snapshot", "delete", &format!("default/vol@s{}", round - 1)]);
                }
                strata(&["snapshot", "create", &format!("default/other@r{round}")]);
                strata(&["snapshot", "rollback", &format!("default/other@r{round}")]);
                done.send(round).unwrap();
            }
        })
    };
    for round in 0..12 {
        match finished.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(finished) => assert_eq!(finished, round),
            Err(e) => panic!("admin round {round} did not finish in 120 s ({e}): a deadlock?"),
        }
    }
    admin.join().expect("every admin operation succeeded");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let visits: u64 = storm
        .into_iter()
        .map(|t| t.join().unwrap().expect("every NBD client was answered"))
        .sum();
    assert!(visits > 0);
    assert!(
        writer.try_wait().unwrap().is_none(),
        "fio stopped while the admin work ran"
    );
    writer.kill().unwrap();
    writer.wait().unwrap();
    let listed = cli_ok(&server, &["snapshot", "list", "default/vol"]);
    assert!(listed.contains("default/vol@s11"), "{listed}");
}
