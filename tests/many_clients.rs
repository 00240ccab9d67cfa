//! Many clients at once: hundreds of connections writing over
//! NBD and iSCSI together while the daemon is killed with SIGKILL, every
//! acknowledged write read back after the restart; and a storm of a
//! thousand NBD connections that come and go, after which the daemon's
//! threads and memory are back near where they were.
//!
//! NBD: fio's nbd engine, one connection per job, each job in its own
//! region with crc32c verification (fio saves which writes completed when
//! its trigger kills the daemon). iSCSI: qemu-io sessions (fio has no iSCSI
//! engine in Debian 12), each writing its own region one FUA write at a
//! time and printing each acknowledgement, as in `iscsi_durability.rs`
//! (the LUN has its write cache on: what a kill may not lose is what was
//! written with FUA or flushed).

mod common;

use common::nbd::Raw;
use common::{require_tool, Server};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

const NBD_VOLUME: &str = "default/many";
const NBD_JOBS: usize = 256;
const ISCSI_VOLUME: &str = "default/manyi";
const ISCSI_TARGET: &str = "iqn.2026-11.io.strata:default.manyi";
const ISCSI_SESSIONS: u64 = 16;
/// Writes each qemu-io session is given (more than it gets through before the kill).
const ISCSI_WRITES: u64 = 4000;

fn pattern(session: u64, i: u64) -> u8 {
    1 + ((session * 37 + i * 11) % 255) as u8
}

fn iscsi_url(server: &Server) -> String {
    format!("iscsi://{}/{ISCSI_TARGET}/0", server.iscsi)
}

/// fio's nbd engine: NBD_JOBS connections, one job each, 4K random writes
/// at QD1 with crc32c verification, job `i` in `[i * 2 MiB, + size)`.
fn fio_writers(uri: &str, dir: &std::path::Path, size: &str) -> Command {
    let mut command = Command::new("fio");
    command
        .args([
            "--name=many",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=1",
            "--thread",
        ])
        .arg(format!("--numjobs={NBD_JOBS}"))
        .arg(format!("--size={size}"))
        .args(["--offset_increment=2m", "--group_reporting", "--verify=crc32c"])
        .arg(format!("--uri={uri}"))
        .current_dir(dir);
    command
}

fn fio_job(uri: &str, state_dir: &std::path::Path, verify_only: bool) -> Command {
    let mut command = fio_writers(uri, state_dir, "2m");
    command.arg("--randrepeat=1");
    if verify_only {
        command.args(["--verify_only=1", "--verify_state_load=1", "--verify_fatal=1"]);
    }
    command
}

/// 256 NBD connections (fio, verified) and 16 iSCSI sessions (qemu-io, FUA
/// writes) writing at once; kill -9; every write fio saw complete and every
/// write qemu-io reported done reads back after the restart.
#[test]
fn hundreds_of_nbd_and_iscsi_connections_writing_lose_nothing_to_kill9() {
    require_tool("fio");
    require_tool("qemu-io");
    let iscsi_sessions = ISCSI_SESSIONS;
    let dir = tempfile::tempdir().unwrap();
    // 256 connections from one address: above the default per-client cap.
    let extra = ["--max-connections-per-client", "1024"];
    let server = Server::start_with_args(dir.path(), Some(dir.path()), &extra);
    server.create_volume(NBD_VOLUME, "1G");
    server.create_volume(ISCSI_VOLUME, "256M");
    // The default properties (write-back cache).

    // iSCSI writers first: they must be writing when fio's trigger kills
    // the daemon. Each session's acknowledged offsets, as they arrive.
    let acknowledged: Vec<Arc<Mutex<Vec<u64>>>> = (0..iscsi_sessions).map(|_| Arc::default()).collect();
    let mut writers = Vec::new();
    for session in 0..iscsi_sessions {
        let mut command = Command::new("qemu-io");
        command.args(["-f", "raw"]);
        let base = session * ISCSI_WRITES * 4096;
        for i in 0..ISCSI_WRITES {
            command
                .arg("-c")
                .arg(format!("write -f -P {} {} 4k", pattern(session, i), base + i * 4096));
        }
        let mut child = command
            .arg(iscsi_url(&server))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("qemu-io");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let acks = acknowledged[session as usize].clone();
        let reader = std::thread::spawn(move || {
            let mut line = String::new();
            // Whole lines only: the kill may cut the last one short, and a
            // cut "at offset 35536896" still parses, as 355368.
            while stdout.read_line(&mut line).is_ok_and(|n| n > 0) && line.ends_with('\n') {
                if let Some(Ok(offset)) = line
                    .strip_prefix("wrote 4096/4096 bytes at offset ")
                    .map(|rest| rest.trim().parse::<u64>())
                {
                    let base = session * ISCSI_WRITES * 4096;
                    assert!(
                        offset % 4096 == 0 && (base..base + ISCSI_WRITES * 4096).contains(&offset),
                        "qemu-io reported a write this session did not ask for: {line}"
                    );
                    acks.lock().unwrap().push(offset);
                }
                line.clear();
            }
        });
        writers.push((child, reader));
    }

    let state_dir = dir.path().join("fio-state");
    std::fs::create_dir_all(&state_dir).unwrap();
    let uri = server.uri(NBD_VOLUME);
    let output = fio_job(&uri, &state_dir, false)
        .args(["--verify_state_save=1", "--time_based", "--runtime=120"])
        .arg("--trigger-timeout=8")
        .arg(format!("--trigger=kill -9 {}", server.pid()))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    let states = std::fs::read_dir(&state_dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".state"))
        .count();
    assert!(
        states >= NBD_JOBS,
        "fio saved {states} verify states, not {NBD_JOBS}:\n{text}"
    );
    let mut server = server;
    server.kill9();
    for (mut child, reader) in writers {
        let _ = child.kill();
        let _ = child.wait();
        reader.join().unwrap();
    }
    drop(server);
    let acknowledged: Vec<Vec<u64>> = acknowledged.iter().map(|a| a.lock().unwrap().clone()).collect();
    let total: usize = acknowledged.iter().map(Vec::len).sum();
    assert!(
        acknowledged.iter().all(|a| !a.is_empty()),
        "every iSCSI session had writes acknowledged before the kill: {:?}",
        acknowledged.iter().map(Vec::len).collect::<Vec<_>>()
    );

    let server = Server::start_with_args(dir.path(), Some(dir.path()), &extra);
    let verify = fio_job(&server.uri(NBD_VOLUME), &state_dir, true).output().unwrap();
    let report = String::from_utf8_lossy(&verify.stdout).to_string() + &String::from_utf8_lossy(&verify.stderr);
    assert!(verify.status.success(), "verification after kill -9 failed:\n{report}");
    assert!(report.contains("err= 0"), "fio reported errors:\n{report}");
    assert!(!report.contains("verify: bad"), "fio found lost writes:\n{report}");
    assert!(report.contains("READ: bw="), "fio verified nothing:\n{report}");

    for (session, offsets) in acknowledged.iter().enumerate() {
        let base = session as u64 * ISCSI_WRITES * 4096;
        for batch in offsets.chunks(1000) {
            let mut command = Command::new("qemu-io");
            command.args(["-f", "raw"]);
            for offset in batch {
                let i = (offset - base) / 4096;
                command
                    .arg("-c")
                    .arg(format!("read -P {} {offset} 4k", pattern(session as u64, i)));
            }
            let output = command.arg(iscsi_url(&server)).output().unwrap();
            let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
            // What is not a successful read's two lines.
            let odd: Vec<&str> = text
                .lines()
                .filter(|l| !l.starts_with("read 4096/4096 bytes") && !l.starts_with("4 KiB, 1 ops"))
                .collect();
            assert!(
                output.status.success(),
                "qemu-io read of session {session} failed ({} reads ok):\n{}",
                text.matches("read 4096/4096 bytes").count(),
                odd.join("\n")
            );
            assert!(
                !text.contains("Pattern verification failed") && !text.contains("error"),
                "an acknowledged iSCSI write was lost:\n{text}"
            );
            assert_eq!(text.matches("read 4096/4096 bytes").count(), batch.len(), "{text}");
        }
    }
    eprintln!(
        "{NBD_JOBS} NBD connections verified by fio; {total} iSCSI writes of {iscsi_sessions} sessions read back"
    );
}

/// Threads and resident memory of a process, from /proc.
fn threads_and_rss(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("Threads:"), field("VmRSS:") * 1024)
}

/// Waits (up to 10 s) for `pid`'s thread count to fall to `at_most`;
/// returns the last reading.
fn settled(pid: u32, at_most: u64) -> (u64, u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let reading = threads_and_rss(pid);
        if reading.0 <= at_most || std::time::Instant::now() > deadline {
            return reading;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// 256 connections writing a `sync=always` volume: every write's data
/// goes through the intent log, which fills (64 MiB by default) many times
/// over. Writers wait for room while the engine destages and checkpoints;
/// none gets "the log is full" (EIO), and all of it verifies.
#[test]
fn hundreds_of_synchronous_writers_wait_for_log_room_instead_of_failing() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let extra = ["--max-connections-per-client", "1024"];
    let log = dir.path().join("daemon.log");
    let server = Server::start_logged(dir.path(), Some(dir.path()), &extra, Some(&log));
    server.create_volume(NBD_VOLUME, "1G");
    server.set_property(NBD_VOLUME, "sync", "always");
    let output = fio_writers(&server.uri(NBD_VOLUME), dir.path(), "1m")
        .args(["--verify_fatal=1", "--verify_state_save=0"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    let daemon = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !daemon.contains("the log is full"),
        "the daemon failed writes on a full log:\n{}",
        daemon
            .lines()
            .filter(|l| l.contains("the log is full"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(output.status.success(), "fio failed:\n{text}");
    assert!(text.contains("err= 0"), "fio reported errors:\n{text}");
    assert!(!text.contains("verify: bad"), "fio found bad data:\n{text}");
    // 256 MiB written, each 4K with its log record: the 64 MiB log filled
    // and was freed several times over.
    assert!(text.contains("WRITE: bw=") && text.contains("READ: bw="), "{text}");
}

#[test]
fn a_storm_of_a_thousand_nbd_connections_leaves_no_thread_or_memory_behind() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with_args(dir.path(), Some(dir.path()), &["--max-connections-per-client", "1024"]);
    server.create_volume("default/storm", "64M");
    // Warm up what a first connection starts once (pools of threads and
    // buffers), so the comparison is of what connections leave behind.
    for _ in 0..20 {
        let mut raw = Raw::go(&server.nbd, "default/storm", false);
        raw.request(0, 2, 1, 0, 0, &[]);
    }
    let (threads_before, rss_before) = settled(server.pid(), u64::MAX);
    // 1,000 connections: 100 at a time held open in transmission (a
    // request served on each), then dropped; every tenth leaves without
    // saying goodbye (the socket just closes).
    for round in 0..10 {
        let mut open = Vec::new();
        for i in 0..100 {
            let mut raw = Raw::go(&server.nbd, "default/storm", false);
            // NBD_CMD_READ of 4 KiB, answered before the next connection.
            raw.request(0, 0, i, (i % 16) * 4096, 4096, &[]);
            assert_eq!(raw.simple_reply(), (0, i), "round {round} connection {i}");
            assert_eq!(raw.read(4096), vec![0u8; 4096]);
            open.push(raw);
        }
        // Transmission runs on tasks: 100 open connections cost no thread
        // each (a thread per connection would add 100 here).
        let (threads_open, _) = threads_and_rss(server.pid());
        assert!(
            threads_open < threads_before + 50,
            "100 open connections took {} threads ({threads_before} before)",
            threads_open.saturating_sub(threads_before)
        );
        for (i, mut raw) in open.into_iter().enumerate() {
            if i % 10 != 0 {
                // NBD_CMD_DISC.
                raw.request(0, 2, 0, 0, 0, &[]);
            }
        }
    }
    let (threads_after, rss_after) = settled(server.pid(), threads_before + 2);
    assert!(
        threads_after <= threads_before + 2,
        "threads: {threads_before} before the storm, {threads_after} after"
    );
    assert!(
        rss_after <= rss_before + (32 << 20),
        "RSS: {} MiB before the storm, {} MiB after",
        rss_before >> 20,
        rss_after >> 20
    );
    eprintln!(
        "storm: threads {threads_before} -> {threads_after}, RSS {} -> {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
}
