//! Snapshots through the CLI, the REST API and real NBD clients: a
//! snapshot keeps the image it was taken of while the volume changes, is
//! exported read-only as `POOL/VOLUME@SNAPSHOT`, survives a clean stop and
//! a kill -9, blocks the deletion of its volume, and gives its space back
//! when deleted.

mod common;

use common::{cli, cli_ok, qemu_io, qemu_io_ok, qemu_io_read_only, require_tool, settled_pool_json, Server};

const MIB: u64 = 1 << 20;

fn used(server: &Server) -> u64 {
    settled_pool_json(server, "default")["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["used_bytes"].as_u64().unwrap())
        .sum()
}

fn snapshots_json(server: &Server, volume: Option<&str>) -> Vec<serde_json::Value> {
    let mut args = vec!["snapshot", "list", "--json"];
    args.extend(volume);
    serde_json::from_str::<serde_json::Value>(&cli_ok(server, &args))
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn a_snapshot_keeps_its_image_while_the_volume_changes() {
    require_tool("qemu-io");
    require_tool("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    cli_ok(&server, &["volume", "create", "default/db", "--size", "64M"]);
    cli_ok(&server, &["volume", "create", "default/logs", "--size", "16M"]);
    let db = server.uri("default/db");
    qemu_io_ok(&db, &["write -P 0xa1 0 8M".into(), "flush".into()]);
    qemu_io_ok(
        &server.uri("default/logs"),
        &["write -P 0xb1 0 1M".into(), "flush".into()],
    );
    cli_ok(&server, &["pool", "sync", "default"]);
    let before = used(&server);

    // Two volumes at one consistency point.
    cli_ok(
        &server,
        &["snapshot", "create", "default/db@before", "default/logs@before"],
    );
    let all = snapshots_json(&server, None);
    assert_eq!(all.len(), 2, "{all:?}");
    let listed = snapshots_json(&server, Some("default/db"));
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], "default/db@before");
    assert_eq!(listed[0]["referenced_bytes"].as_u64(), Some(8 * MIB));
    assert_eq!(listed[0]["size_bytes"].as_u64(), Some(64 * MIB));
    // nbdinfo --list shows the snapshot exports after their volumes.
    let list = common::stdout_of(std::process::Command::new("nbdinfo").args(["--list", &server.uri("")]));
    assert!(list.contains("export=\"default/db@before\""), "{list}");
    let table = cli_ok(&server, &["snapshot", "list"]);
    assert!(
        table.contains("default/logs@before") && table.contains("REFERENCED"),
        "{table}"
    );
    // The same name again is refused; so is a bad one.
    let again = cli(&server, &["snapshot", "create", "default/db@before"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists"));
    let bad = cli(&server, &["snapshot", "create", "default/db@no/slash"]);
    assert!(!bad.status.success());

    // The volume changes: whole blocks, a partial block, a trim.
    qemu_io_ok(
        &db,
        &[
            "write -P 0xa2 0 2M".into(),
            "write -P 0xa3 4100k 4k".into(),
            "discard 6M 1M".into(),
            "write -P 0xa4 16M 1M".into(),
            "flush".into(),
        ],
    );
    qemu_io_ok(
        &db,
        &[
            "read -P 0xa2 0 2M".into(),
            "read -P 0xa1 2M 2M".into(),
            "read -P 0xa3 4100k 4k".into(),
            "read -P 0 6M 1M".into(),
            "read -P 0xa4 16M 1M".into(),
        ],
    );
    // The snapshot still reads as it was, and says it is read-only.
    let snapshot = server.uri("default/db@before");
    let image = ["read -P 0xa1 0 8M".to_string(), "read -P 0 8M 56M".to_string()];
    qemu_io_read_only(&snapshot, &image);
    let info = common::stdout_of(std::process::Command::new("nbdinfo").arg(&snapshot));
    assert!(info.contains("is_read_only: true"), "{info}");
    let (_, text) = qemu_io(&snapshot, &["write -P 0xff 0 4k".into()]);
    assert!(
        text.contains("Permission denied") || text.contains("Operation not permitted"),
        "{text}"
    );
    qemu_io_read_only(&snapshot, &image);
    // The blocks the volume changed are kept for the snapshot: 2 MiB
    // overwritten, one 16 KiB block written in part, 1 MiB trimmed.
    cli_ok(&server, &["pool", "sync", "default"]);
    assert!(used(&server) >= before + 3 * MIB, "{} {}", used(&server), before);
    let listed = snapshots_json(&server, Some("default/db"));
    assert_eq!(
        listed[0]["used_bytes"].as_u64(),
        Some(3 * MIB + 16 * 1024),
        "{listed:?}"
    );
    assert_eq!(listed[0]["written_bytes"].as_u64(), Some(8 * MIB), "{listed:?}");
    let logs = snapshots_json(&server, Some("default/logs"));
    assert_eq!(logs[0]["used_bytes"].as_u64(), Some(0), "{logs:?}");

    // A volume with snapshots is not deleted.
    let delete = cli(&server, &["volume", "delete", "default/db"]);
    assert!(!delete.status.success());
    assert!(String::from_utf8_lossy(&delete.stderr).contains("snapshot"));

    // A clean stop and a crash keep both.
    let (status, _) = server.stop_saying();
    assert!(status.success());
    let mut server = Server::start(dir.path());
    qemu_io_read_only(&server.uri("default/db@before"), &image);
    qemu_io_read_only(&server.uri("default/logs@before"), &["read -P 0xb1 0 1M".into()]);
    qemu_io_ok(
        &server.uri("default/db"),
        &["write -P 0xa5 8M 1M".into(), "flush".into()],
    );
    server.kill9();
    let server = Server::start(dir.path());
    qemu_io_read_only(&server.uri("default/db@before"), &image);
    let db = server.uri("default/db");
    qemu_io_ok(
        &db,
        &[
            "read -P 0xa2 0 2M".into(),
            "read -P 0xa5 8M 1M".into(),
            "read -P 0xa4 16M 1M".into(),
        ],
    );

    // Deleted: gone from the list and the exports, its space given back,
    // the volume untouched.
    cli_ok(&server, &["pool", "sync", "default"]);
    let with = used(&server);
    cli_ok(&server, &["snapshot", "delete", "default/db@before"]);
    cli_ok(&server, &["snapshot", "delete", "default/logs@before"]);
    assert!(snapshots_json(&server, None).is_empty());
    let (ok, _) = qemu_io(&server.uri("default/db@before"), &["read 0 4k".into()]);
    assert!(!ok, "a deleted snapshot's export is gone");
    cli_ok(&server, &["pool", "sync", "default"]);
    assert!(used(&server) < with, "{} {}", used(&server), with);
    qemu_io_ok(
        &db,
        &[
            "read -P 0xa2 0 2M".into(),
            "read -P 0xa1 2M 2M".into(),
            "read -P 0 6M 1M".into(),
            "read -P 0xa5 8M 1M".into(),
        ],
    );
    let missing = cli(&server, &["snapshot", "delete", "default/db@before"]);
    assert!(!missing.status.success());
    cli_ok(&server, &["volume", "delete", "default/db"]);
}

/// `strata snapshot rollback ARGS`, retried for up to 5 s while the daemon
/// still counts the NBD connection of a qemu-io that has just exited (it
/// notices the disconnect a moment later).
fn rollback_once_qemu_io_is_gone(server: &Server, args: &[&str]) {
    let mut command = vec!["snapshot", "rollback"];
    command.extend_from_slice(args);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let output = cli(server, &command);
        let said = String::from_utf8_lossy(&output.stderr).to_string();
        if output.status.success() {
            return;
        }
        assert!(
            said.contains("is busy") && std::time::Instant::now() < deadline,
            "{command:?}: {said}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn a_volume_rolls_back_to_a_snapshot() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    cli_ok(&server, &["volume", "create", "default/vm", "--size", "32M"]);
    let vm = server.uri("default/vm");
    qemu_io_ok(&vm, &["write -P 0xc1 0 4M".into(), "flush".into()]);
    cli_ok(&server, &["snapshot", "create", "default/vm@golden"]);
    qemu_io_ok(
        &vm,
        &[
            "write -P 0xc2 1M 1M".into(),
            "write -P 0xc2 8M 1M".into(),
            "flush".into(),
        ],
    );
    cli_ok(&server, &["snapshot", "create", "default/vm@patched"]);
    // Cached, never flushed: undone by the rollback all the same.
    qemu_io_ok(&vm, &["write -P 0xc3 0 4k".into(), "discard 2M 1M".into()]);

    // Not past a newer snapshot without -r.
    let refused = cli(&server, &["snapshot", "rollback", "default/vm@golden"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("@patched") && said.contains("-r"), "{said}");

    rollback_once_qemu_io_is_gone(&server, &["default/vm@patched"]);
    qemu_io_ok(
        &vm,
        &[
            "read -P 0xc1 0 1M".into(),
            "read -P 0xc2 1M 1M".into(),
            "read -P 0xc1 2M 2M".into(),
            "read -P 0xc2 8M 1M".into(),
        ],
    );
    rollback_once_qemu_io_is_gone(&server, &["-r", "default/vm@golden"]);
    let left = snapshots_json(&server, Some("default/vm"));
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0]["snapshot"], "golden");
    let golden = ["read -P 0xc1 0 4M".to_string(), "read -P 0 4M 28M".to_string()];
    qemu_io_ok(&vm, &golden);
    // The volume goes on from there; the snapshot stays as it was.
    qemu_io_ok(&vm, &["write -P 0xc4 0 64k".into(), "flush".into()]);
    qemu_io_read_only(&server.uri("default/vm@golden"), &golden);
    let mut server = server;
    server.kill9();
    let server = Server::start(dir.path());
    let vm = server.uri("default/vm");
    qemu_io_ok(&vm, &["read -P 0xc4 0 64k".into(), "read -P 0xc1 64k 3968k".into()]);
    qemu_io_read_only(&server.uri("default/vm@golden"), &golden);
}

/// A property's value as `volume get --json` gives it.
fn property(server: &Server, volume: &str, name: &str) -> String {
    let out = cli_ok(server, &["volume", "get", "--json", volume, name]);
    let value: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let rows = value
        .as_array()
        .cloned()
        .unwrap_or_else(|| value["properties"].as_array().cloned().unwrap());
    rows.iter()
        .find(|r| r["property"] == name)
        .unwrap_or_else(|| panic!("{name} in {out}"))["value"]
        .as_str()
        .unwrap()
        .to_string()
}

fn origin_of(server: &Server, volume: &str) -> String {
    cli_ok(server, &["volume", "get", volume, "origin"])
}

#[test]
fn a_clone_shares_its_snapshot_and_a_promotion_frees_it_from_it() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    cli_ok(
        &server,
        &[
            "volume",
            "create",
            "default/golden",
            "--size",
            "32M",
            "-o",
            "sync=always",
        ],
    );
    let golden = server.uri("default/golden");
    qemu_io_ok(&golden, &["write -P 0xd1 0 4M".into(), "flush".into()]);
    cli_ok(&server, &["snapshot", "create", "default/golden@v1"]);
    qemu_io_ok(&golden, &["write -P 0xd2 0 1M".into(), "flush".into()]);
    cli_ok(&server, &["pool", "sync", "default"]);
    let before = used(&server);

    // Instant, writable, with the origin's properties; nothing placed.
    cli_ok(&server, &["volume", "clone", "default/golden@v1", "default/vm1"]);
    assert!(origin_of(&server, "default/vm1").contains("default/golden@v1"));
    assert!(origin_of(&server, "default/golden").contains(" - "));
    let sync = cli_ok(&server, &["volume", "get", "default/vm1", "sync"]);
    assert!(sync.contains("always"), "{sync}");
    let vm1 = server.uri("default/vm1");
    qemu_io_ok(&vm1, &["read -P 0xd1 0 4M".into(), "read -P 0 4M 28M".into()]);
    assert_eq!(used(&server), before, "a clone places nothing");
    // A 4K write into a shared block copies that block only.
    qemu_io_ok(&vm1, &["write -P 0xe1 1M 4k".into(), "flush".into()]);
    cli_ok(&server, &["pool", "sync", "default"]);
    assert_eq!(used(&server), before + 16 * 1024, "one 16K block copied");
    qemu_io_ok(
        &vm1,
        &[
            "read -P 0xd1 0 1M".into(),
            "read -P 0xe1 1M 4k".into(),
            "read -P 0xd1 1028k 3068k".into(),
        ],
    );
    // Space as ZFS reports it: the clone owns its one copied block; the
    // origin its first megabyte (rewritten after the snapshot), its
    // snapshot the megabyte it replaced; three more are shared.
    let space = |volume: &str| {
        ["used", "referenced", "usedbydataset", "usedbysnapshots", "written"].map(|p| property(&server, volume, p))
    };
    assert_eq!(space("default/vm1"), ["16K", "4M", "16K", "0B", "16K"]);
    assert_eq!(space("default/golden"), ["2M", "4M", "1M", "1M", "1M"]);
    // The origin and its snapshot did not change.
    qemu_io_ok(&golden, &["read -P 0xd2 0 1M".into(), "read -P 0xd1 1M 3M".into()]);
    qemu_io_read_only(&server.uri("default/golden@v1"), &["read -P 0xd1 0 4M".into()]);
    // Wrong origins and sizes are refused with a reason.
    for (args, expected) in [
        (
            vec!["volume", "clone", "default/golden@nope", "default/x"],
            "does not exist",
        ),
        (vec!["volume", "clone", "default/golden@v1", "default/vm1"], "exists"),
        (
            vec![
                "volume",
                "clone",
                "default/golden@v1",
                "default/x",
                "-o",
                "volblocksize=64K",
            ],
            "volblocksize",
        ),
        (vec!["volume", "promote", "default/golden"], "not a clone"),
    ] {
        let out = cli(&server, &args);
        assert!(!out.status.success(), "{args:?}");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(said.contains(expected), "{args:?}: {said}");
    }
    // The snapshot cannot go while the clone depends on it.
    let refused = cli(&server, &["snapshot", "delete", "default/golden@v1"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("clones") && said.contains("default/vm1") && said.contains("promote"),
        "{said}"
    );

    // It survives a kill -9, as do its writes.
    server.kill9();
    let mut server = Server::start(dir.path());
    let vm1 = server.uri("default/vm1");
    qemu_io_ok(&vm1, &["read -P 0xe1 1M 4k".into(), "read -P 0xd1 0 1M".into()]);

    // Promoted, the clone owns the snapshot; the old volume is a clone of
    // it and can go, with every block the clone still uses kept.
    cli_ok(&server, &["volume", "promote", "default/vm1"]);
    assert!(origin_of(&server, "default/vm1").contains(" - "));
    assert!(origin_of(&server, "default/golden").contains("default/vm1@v1"));
    let listed = snapshots_json(&server, Some("default/vm1"));
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], "default/vm1@v1");
    cli_ok(&server, &["volume", "delete", "default/golden"]);
    qemu_io_ok(
        &vm1,
        &[
            "read -P 0xd1 0 1M".into(),
            "read -P 0xe1 1M 4k".into(),
            "read -P 0xd1 1028k 3068k".into(),
            "write -P 0xe2 2M 1M".into(),
            "flush".into(),
        ],
    );
    cli_ok(&server, &["snapshot", "delete", "default/vm1@v1"]);
    server.stop();
    let server = Server::start(dir.path());
    let vm1 = server.uri("default/vm1");
    qemu_io_ok(
        &vm1,
        &[
            "read -P 0xd1 0 1M".into(),
            "read -P 0xe1 1M 4k".into(),
            "read -P 0xe2 2M 1M".into(),
            "read -P 0xd1 3M 1M".into(),
        ],
    );
    // What is left placed is the clone's 4 MiB and nothing else.
    cli_ok(&server, &["pool", "sync", "default"]);
    assert_eq!(used(&server), 4 * MIB);
}
