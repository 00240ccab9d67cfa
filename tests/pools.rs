//! `strata pool create` end to end: a pool on two files made by the user,
//! a volume on it served over NBD, errors, and a restart.

mod common;

use common::{require_tool, run, Server};
use std::process::Command;

fn cli(server: &Server, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .args(["--api", &server.api])
        .output()
        .unwrap()
}

#[test]
fn pool_create_serve_and_reopen() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let fast = dir.path().join("fast.img");
    let capacity = dir.path().join("capacity.img");
    std::fs::File::create(&fast).unwrap().set_len(256 << 20).unwrap();
    std::fs::File::create(&capacity).unwrap().set_len(512 << 20).unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data);

    let created = cli(
        &server,
        &[
            "pool",
            "create",
            "tank",
            "--fast",
            fast.to_str().unwrap(),
            "--capacity",
            capacity.to_str().unwrap(),
        ],
    );
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    // The same devices cannot make a second pool.
    let again = cli(&server, &["pool", "create", "other", "--fast", fast.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(1));
    let message = String::from_utf8_lossy(&again.stderr);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains("strata: error:"), "{message}");
    // A pool needs a data device.
    let no_data = cli(&server, &["pool", "create", "empty"]);
    assert_eq!(no_data.status.code(), Some(1));

    let volume = cli(&server, &["volume", "create", "tank/v", "--size", "1G"]);
    assert!(volume.status.success(), "{}", String::from_utf8_lossy(&volume.stderr));
    let uri = server.uri("tank/v");
    run(Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x6b 0 4M",
            "-c",
            "flush",
            "-c",
            "read -P 0x6b 0 4M",
        ])
        .arg(&uri));

    let status = cli(&server, &["pool", "status", "tank", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["name"], "tank");
    assert_eq!(status["devices"].as_array().unwrap().len(), 2);
    assert_eq!(status["used_bytes"], 4u64 << 20);
    assert!(server.stop().success());

    // Restart: the pool is found from the catalog and its devices.
    let server = Server::start(&data);
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x6b 0 4M"])
        .arg(server.uri("tank/v")));
}
