//! Durability over real NBD: fio writes with crc32c verification while the
//! daemon is killed with SIGKILL at a random moment (fio's trigger saves
//! which writes completed), then the daemon restarts and fio verifies every
//! completed write. Also: bit rot in a device file is reported as EIO.

mod common;

use common::{require_tool, run, Server, FIO_KILL_LOAD};
use std::process::Command;

const VOLUME_BYTES: &str = "1G";

/// One kill -9 cycle: write with `extra` fio options until the trigger kills
/// the daemon, restart it, verify. Returns the restarted server.
fn kill_cycle(dir: &std::path::Path, server: Server, volume: &str, extra: &[&str], seconds: u32) -> Server {
    let mut server = server;
    let uri = server.uri(volume);
    let state_dir = dir.join("fio-state");
    std::fs::create_dir_all(&state_dir).unwrap();
    let job = |uri: &str, verify_only: bool| {
        let mut command = Command::new("fio");
        command
            .args(["--name=k9", "--ioengine=nbd", "--rw=randwrite", "--bs=4k"])
            .args(FIO_KILL_LOAD)
            .args(["--verify=crc32c", "--randrepeat=1"])
            .arg(format!("--uri={uri}"))
            .current_dir(&state_dir);
        if verify_only {
            command.args(["--verify_only=1", "--verify_state_load=1", "--verify_fatal=1"]);
        }
        command
    };
    let output = job(&uri, false)
        .args(extra)
        .args(["--verify_state_save=1", "--time_based", "--runtime=60"])
        .arg(format!("--trigger-timeout={seconds}"))
        .arg(format!("--trigger=kill -9 {}", server.pid()))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    assert!(
        std::fs::read_dir(&state_dir)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".state")),
        "fio saved no verify state:\n{text}"
    );
    server.kill9();
    drop(server);

    let server = Server::start(dir);
    let uri = server.uri(volume);
    assert!(uri.ends_with(volume));
    let verify = job(&uri, true).output().unwrap();
    let report = String::from_utf8_lossy(&verify.stdout).to_string() + &String::from_utf8_lossy(&verify.stderr);
    assert!(verify.status.success(), "verification after kill -9 failed:\n{report}");
    assert!(report.contains("err= 0"), "fio reported errors:\n{report}");
    assert!(!report.contains("verify: bad"), "fio found lost writes:\n{report}");
    // fio must have verified something, or the check proves nothing.
    assert!(report.contains("READ: bw="), "fio verified nothing:\n{report}");
    server
}

#[test]
fn kill9_loses_no_acknowledged_write_with_sync_always() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.create_volume("default/k9", VOLUME_BYTES);
    server.set_property("default/k9", "sync", "always");
    let mut server = server;
    for (cycle, seconds) in kill_seconds(&[2, 3, 2]).into_iter().enumerate() {
        server = kill_cycle(dir.path(), server, "default/k9", &[], seconds);
        eprintln!("sync=always cycle {cycle} verified");
    }
}

#[test]
fn kill9_loses_no_acknowledged_write_with_logbias_throughput() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.create_volume("default/k9", VOLUME_BYTES);
    server.set_property("default/k9", "sync", "always");
    server.set_property("default/k9", "logbias", "throughput");
    let mut server = server;
    for (cycle, seconds) in kill_seconds(&[2, 3]).into_iter().enumerate() {
        server = kill_cycle(dir.path(), server, "default/k9", &[], seconds);
        eprintln!("sync=always logbias=throughput cycle {cycle} verified");
    }
}

#[test]
fn kill9_loses_no_flushed_write_with_write_cache_and_fsync() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.create_volume("default/k9", VOLUME_BYTES);
    let mut server = server;
    for (cycle, seconds) in kill_seconds(&[3, 2]).into_iter().enumerate() {
        server = kill_cycle(dir.path(), server, "default/k9", &["--fsync=1"], seconds);
        eprintln!("wce=on --fsync=1 cycle {cycle} verified");
    }
}

/// Snapshots acknowledged as taken and not asked to be deleted, and those
/// acknowledged as deleted, by a thread that takes one every 200 ms and
/// deletes all but the newest three until `stop`. The daemon is killed and
/// restarted meanwhile: a command that failed (its answer lost with the
/// daemon) may or may not have happened, and counts in neither list.
fn snapshotter(
    data_dir: std::path::PathBuf,
    volume: &'static str,
    prefix: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<(Vec<String>, Vec<String>)> {
    std::thread::spawn(move || {
        let strata = |args: &[&str]| {
            Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(args)
                .arg("--data-dir")
                .arg(&data_dir)
                .output()
                .unwrap()
                .status
                .success()
        };
        let (mut alive, mut deleted) = (Vec::new(), Vec::new());
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            n += 1;
            let name = format!("{volume}@{prefix}{n}");
            if strata(&["snapshot", "create", &name]) {
                alive.push(name);
            }
            while alive.len() > 3 {
                let oldest = alive.remove(0);
                if strata(&["snapshot", "delete", &oldest]) {
                    deleted.push(oldest);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        (alive, deleted)
    })
}

#[test]
fn kill9_while_snapshots_come_and_go_loses_nothing_and_leaks_nothing() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.create_volume("default/k9", VOLUME_BYTES);
    let mut server = server;
    let mut alive: Vec<String> = Vec::new();
    for (cycle, seconds) in kill_seconds(&[3, 2]).into_iter().enumerate() {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let taker = snapshotter(
            dir.path().to_path_buf(),
            "default/k9",
            format!("c{cycle}-"),
            stop.clone(),
        );
        server = kill_cycle(dir.path(), server, "default/k9", &["--fsync=1"], seconds);
        stop.store(true, std::sync::atomic::Ordering::Release);
        let (taken, deleted) = taker.join().unwrap();
        let listed: Vec<String> = serde_json::from_str::<serde_json::Value>(&common::cli_ok(
            &server,
            &["snapshot", "list", "--json", "default/k9"],
        ))
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
        alive.retain(|name| listed.contains(name));
        for name in &taken {
            assert!(
                listed.contains(name),
                "cycle {cycle}: acknowledged snapshot {name} is gone: {listed:?}"
            );
        }
        for name in &deleted {
            assert!(!listed.contains(name), "cycle {cycle}: deleted snapshot {name} is back");
        }
        assert!(!taken.is_empty(), "cycle {cycle}: no snapshot was taken during the run");
        eprintln!(
            "cycle {cycle}: {} snapshots kept, {} deleted, verified",
            taken.len(),
            deleted.len()
        );
        alive = listed;
    }
    // Every snapshot deleted, the cache placed: the pool holds exactly the
    // volume's blocks.
    for name in &alive {
        common::cli_ok(&server, &["snapshot", "delete", name]);
    }
    let pool = common::settled_pool_json(&server, "default");
    let placed: u64 = pool["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["used_bytes"].as_u64().unwrap())
        .sum();
    let volume: serde_json::Value =
        serde_json::from_str(&common::cli_ok(&server, &["volume", "get", "--json", "default/k9"])).unwrap();
    assert_eq!(placed, volume["used_bytes"].as_u64().unwrap(), "space leaked: {pool}");
}

/// A deleted snapshot's space is freed in the background, slowly while a
/// client reads: a kill -9 while it is freeing (right after the delete, and
/// after a checkpoint that wrote the queue as free) loses nothing the
/// volume holds, brings the snapshot back never, and leaks no space.
#[test]
fn kill9_while_space_is_freeing_loses_nothing_and_leaks_nothing() {
    require_tool("fio");
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    server.create_volume("default/fr", "256M");
    for (round, checkpoint) in [(1u8, false), (2, true)] {
        let uri = server.uri("default/fr");
        let (old, new) = (0x10 + round, 0x20 + round);
        common::qemu_io_ok(&uri, &[format!("write -P {old:#x} 0 256M"), "flush".into()]);
        common::cli_ok(&server, &["snapshot", "create", "default/fr@old"]);
        common::qemu_io_ok(&uri, &[format!("write -P {new:#x} 0 256M"), "flush".into()]);
        common::cli_ok(&server, &["pool", "sync", "default"]);
        // A reader keeps the freer at its slow pace.
        let mut reader = Command::new("fio")
            .args(["--name=r", "--ioengine=nbd", "--rw=randread", "--bs=4k", "--size=256M"])
            .args(["--time_based", "--runtime=60", "--output=/dev/null"])
            .arg(format!("--uri={uri}"))
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(500));
        common::cli_ok(&server, &["snapshot", "delete", "default/fr@old"]);
        let status = if checkpoint {
            // `pool sync` checkpoints: the queue is written as free.
            serde_json::from_str(&common::cli_ok(&server, &["pool", "sync", "default", "--json"])).unwrap()
        } else {
            common::pool_json(&server, "default")
        };
        let freeing = status["freeing_bytes"].as_u64().unwrap();
        assert!(freeing > 0, "round {round}: nothing left to free when killed: {status}");
        server.kill9();
        let _ = reader.kill();
        let _ = reader.wait();
        drop(server);

        server = Server::start(dir.path());
        let uri = server.uri("default/fr");
        common::qemu_io_ok(&uri, &[format!("read -P {new:#x} 0 256M")]);
        let snapshots = common::cli_ok(&server, &["snapshot", "list", "default/fr"]);
        assert!(
            !snapshots.contains("@old"),
            "round {round}: the deleted snapshot came back: {snapshots}"
        );
        let pool = common::settled_pool_json(&server, "default");
        let placed: u64 = pool["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["used_bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(
            placed,
            256 << 20,
            "round {round}: killed with {freeing} bytes freeing: {pool}"
        );
    }
}

#[test]
fn bit_rot_in_a_device_file_reads_as_eio_and_is_counted() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    // A pattern no metadata page contains, in two places.
    run(Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0xa7 0 64k",
            "-c",
            "write -P 0x3c 1M 64k",
            "-c",
            "flush",
        ])
        .arg(&uri));
    assert!(server.stop().success());

    // Find a 4 KiB sector of 0xa7 in the fast device file and flip one byte.
    let device = dir.path().join("pools/default/fast.dev");
    let offset = find_sector(&device, 0xa7).expect("the written pattern is on the fast device");
    flip_byte(&device, offset + 100);

    let server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    expect_eio(&uri, "read -P 0xa7 0 64k", "a rotten block");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x3c 1M 64k"])
        .arg(&uri));
    let status = common::http(&server.api, "GET", "/v1/pools/default", "");
    assert!(status.contains("\"checksum_errors\":1"), "{status}");

    // Rot under a running server: the flipped byte is in the page cache at
    // once, where large reads copy and checksum straight from (a mapping of)
    // the file. Still EIO, counted once more.
    let offset = find_sector(&device, 0x3c).expect("the second pattern is on the fast device");
    flip_byte(&device, offset + 4000);
    expect_eio(&uri, "read -P 0x3c 1M 64k", "a block rotten under a running server");
    let status = common::http(&server.api, "GET", "/v1/pools/default", "");
    assert!(status.contains("\"checksum_errors\":2"), "{status}");
}

/// Runs one qemu-io command against `uri` and asserts it failed with EIO.
fn expect_eio(uri: &str, command: &str, what: &str) {
    let bad = Command::new("qemu-io")
        .args(["-f", "raw", "-c", command])
        .arg(uri)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&bad.stdout).to_string() + &String::from_utf8_lossy(&bad.stderr);
    assert!(text.contains("Input/output error"), "{what} must read as EIO:\n{text}");
}

/// Seconds before each kill: `default` in CI; `STRATA_KILL_CYCLES=N` (the
/// soak script, bench/soak.sh) runs N cycles at 1 to 4 seconds each.
fn kill_seconds(default: &[u32]) -> Vec<u32> {
    match std::env::var("STRATA_KILL_CYCLES")
        .ok()
        .and_then(|n| n.parse::<u32>().ok())
    {
        Some(cycles) => (0..cycles).map(|i| 1 + (i * 7 + 3) % 4).collect(),
        None => default.to_vec(),
    }
}

/// Offset of the last 4 KiB sector filled with `byte` in the data parts of
/// `path`: the copy in the data chunks, which follow the intent log on the
/// device (docs/FORMAT.md); the log may still hold a copy in a Data record.
fn find_sector(path: &std::path::Path, byte: u8) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    use std::os::unix::io::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let size = file.metadata().unwrap().len();
    let mut position = 0u64;
    let mut sector = vec![0u8; 4096];
    let mut found = None;
    while position < size {
        // SAFETY: lseek on a descriptor we own.
        let data = unsafe { libc::lseek(file.as_raw_fd(), position as i64, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) } as u64;
        let mut at = data as u64 / 4096 * 4096;
        while at < hole {
            file.read_exact_at(&mut sector, at).unwrap();
            if sector.iter().all(|&b| b == byte) {
                found = Some(at);
            }
            at += 4096;
        }
        position = hole.max(position + 4096);
    }
    found
}

fn flip_byte(path: &std::path::Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset).unwrap();
    byte[0] ^= 0x40;
    file.write_all_at(&byte, offset).unwrap();
    file.sync_all().unwrap();
}
