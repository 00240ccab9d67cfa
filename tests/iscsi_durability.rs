//! Durability over real iSCSI: qemu-io (through libiscsi) writes 4 KiB blocks
//! one at a time while the daemon is killed with SIGKILL; every write qemu-io
//! reported as completed before the kill must read back after a restart.
//!
//! qemu-io runs its commands in order, one at a time, and prints "wrote ..."
//! only after the target acknowledged the write, so the lines read before the
//! kill are a subset of the acknowledged writes: the check is exact, with no
//! in-flight guesswork (fio has no iSCSI engine in Debian 12).

mod common;

use common::{require_tool, Server};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const VOLUME: &str = "default/k9";
const TARGET: &str = "iqn.2026-11.io.strata:default.k9";
/// Writes per qemu-io run: more than any kill lets through.
const WRITES: u64 = 6000;

/// The pattern byte of write `i` in cycle `cycle` (never 0: unwritten blocks
/// read as zeros and must not pass for written ones).
fn pattern(cycle: u64, i: u64) -> u8 {
    1 + ((cycle * 31 + i * 7) % 255) as u8
}

fn url(server: &Server) -> String {
    format!("iscsi://{}/{TARGET}/0", server.iscsi)
}

/// One cycle: writes until `kill_after` acknowledgements, kills the daemon,
/// restarts it and reads back every acknowledged write. `fua` makes each
/// write FUA (for `wce=on`, where only FUA or a flush promises durability).
fn kill_cycle(dir: &std::path::Path, mut server: Server, cycle: u64, kill_after: usize, fua: bool) -> Server {
    let flag = if fua { "-f " } else { "" };
    let mut command = Command::new("qemu-io");
    command.args(["-f", "raw"]);
    // Each cycle writes its own region (40 regions of 24 MiB, reused after
    // that with other patterns).
    let base = (cycle % 40) * WRITES * 4096;
    for i in 0..WRITES {
        command
            .arg("-c")
            .arg(format!("write {flag}-P {} {} 4k", pattern(cycle, i), base + i * 4096));
    }
    let mut writer = command
        .arg(url(&server))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-io");
    let mut acknowledged = Vec::new();
    let stdout = BufReader::new(writer.stdout.take().unwrap());
    let started = Instant::now();
    let mut lines = stdout.lines();
    while acknowledged.len() < kill_after {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("qemu-io stopped after {} writes", acknowledged.len()))
            .unwrap();
        if let Some(rest) = line.strip_prefix("wrote 4096/4096 bytes at offset ") {
            acknowledged.push(rest.trim().parse::<u64>().unwrap());
        }
        assert!(started.elapsed() < Duration::from_secs(120), "writes too slow");
    }
    server.kill9();
    let _ = writer.kill();
    let _ = writer.wait();
    drop(server);

    let server = Server::start(dir);
    // Read back in batches: one qemu-io per 1000 blocks.
    for batch in acknowledged.chunks(1000) {
        let mut command = Command::new("qemu-io");
        command.args(["-f", "raw"]);
        for offset in batch {
            let i = (offset - base) / 4096;
            command
                .arg("-c")
                .arg(format!("read -P {} {offset} 4k", pattern(cycle, i)));
        }
        let output = command.arg(url(&server)).output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "qemu-io read failed:\n{text}");
        assert!(
            !text.contains("Pattern verification failed") && !text.contains("error"),
            "an acknowledged write was lost:\n{text}"
        );
        assert_eq!(text.matches("read 4096/4096 bytes").count(), batch.len(), "{text}");
    }
    eprintln!("cycle {cycle}: {} acknowledged writes read back", acknowledged.len());
    server
}

fn kill_loop(properties: &[(&str, &str)], fua: bool) {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    server.create_volume(VOLUME, "1G");
    for (key, value) in properties {
        server.set_property(VOLUME, key, value);
    }
    let cycles: u64 = std::env::var("STRATA_KILL_CYCLES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2);
    for cycle in 0..cycles {
        // A different moment each cycle.
        let kill_after = 300 + ((cycle * 977 + 401) % 1200) as usize;
        server = kill_cycle(dir.path(), server, cycle, kill_after, fua);
    }
}

#[test]
fn iscsi_kill9_loses_no_write_with_sync_always() {
    kill_loop(&[("sync", "always")], false);
}

#[test]
fn iscsi_kill9_loses_no_write_with_logbias_throughput() {
    kill_loop(&[("sync", "always"), ("logbias", "throughput")], false);
}

#[test]
fn iscsi_kill9_loses_no_fua_write_with_write_cache() {
    kill_loop(&[], true);
}
