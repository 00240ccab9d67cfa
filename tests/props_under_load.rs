//! Volume properties changed online while fio writes and verifies over NBD:
//! `strata volume set` flips `sync`, `wce` and `logbias` every half second
//! under random writes at QD16 (first writes and overwrites). fio must find
//! every block it wrote, during the run and again after a restart: a clean
//! one (every acknowledged write, whatever the mode it was written in), and
//! a kill -9 (every write that was flushed).

mod common;

use common::{require_tool, Server, FIO_KILL_LOAD};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const VOLUME: &str = "default/props";

/// Every step sets all three properties, so each step is a distinct mode.
const ALL_MODES: &[&[&str]] = &[
    &["sync=always", "wce=on", "logbias=latency"],
    &["sync=standard", "wce=off", "logbias=latency"],
    &["sync=standard", "wce=on", "logbias=throughput"],
    &["sync=always", "wce=off", "logbias=throughput"],
    &["sync=disabled", "wce=on", "logbias=latency"],
    &["sync=standard", "wce=on", "logbias=latency"],
];

/// The same without `sync=disabled`, where a flush is a no-op and a crash
/// may lose flushed writes by design.
const SAFE_MODES: &[&[&str]] = &[
    &["sync=always", "wce=on", "logbias=latency"],
    &["sync=standard", "wce=off", "logbias=latency"],
    &["sync=standard", "wce=on", "logbias=throughput"],
    &["sync=always", "wce=off", "logbias=throughput"],
    &["sync=standard", "wce=on", "logbias=latency"],
];

/// Runs `strata volume set` through the modes every 0.5 s until `stop` is
/// set or `deadline` passes; returns how many changes succeeded and every
/// failure.
fn change_properties(
    api: String,
    modes: &'static [&'static [&'static str]],
    stop: Arc<AtomicBool>,
    deadline: Instant,
) -> JoinHandle<(usize, Vec<String>)> {
    std::thread::spawn(move || {
        let mut changes = 0;
        let mut failures = Vec::new();
        for step in modes.iter().cycle() {
            if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                break;
            }
            let output = Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(["volume", "set", VOLUME])
                .args(*step)
                .args(["--api", &api])
                .env("STRATA_TOKEN", common::token_for(&api).unwrap_or_default())
                .output()
                .unwrap();
            if output.status.success() {
                changes += 1;
            } else {
                failures.push(format!("{step:?}: {}", String::from_utf8_lossy(&output.stderr)));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        (changes, failures)
    })
}

/// With `norandommap` fio picks blocks with replacement, so many writes are
/// overwrites (fio then checks each block at its last version).
/// `serialize_overlap`: two writes of one block in flight at once may land in
/// either order (NBD orders nothing), which fio would report as a lost write.
const OVERWRITES: &[&str] = &[
    "--iodepth=16",
    "--size=128m",
    "--io_size=512m",
    "--norandommap",
    "--serialize_overlap=1",
];
/// Each block at most once: an overwrite in flight at a kill -9 could leave
/// either version, which fio would call a lost write. One write in flight per
/// job, for fio 3.33's verify state (see `FIO_KILL_LOAD`).
const FIRST_WRITES: &[&str] = FIO_KILL_LOAD;

/// fio's common options: 4K random writes at QD16 with crc32c headers.
fn fio(uri: &str, state_dir: &Path, shape: &[&str]) -> Command {
    let mut command = Command::new("fio");
    command
        .args(["--name=props", "--ioengine=nbd", "--rw=randwrite", "--bs=4k"])
        .args(shape)
        .args([
            "--randrepeat=1",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--output-format=json",
        ])
        .arg(format!("--uri={uri}"))
        .current_dir(state_dir);
    command
}

/// fio's JSON report (the nbd engine prints a line before it) and all its output.
fn report(output: &std::process::Output) -> (serde_json::Value, String) {
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let text = stdout.clone() + &String::from_utf8_lossy(&output.stderr);
    let json = stdout
        .find('{')
        .and_then(|at| serde_json::from_str(&stdout[at..]).ok())
        .unwrap_or_else(|| panic!("no fio JSON report:\n{text}"));
    (json, text)
}

/// After a restart: fio re-reads what the saved verify state says was written.
fn verify_only(server: &Server, state_dir: &Path, shape: &[&str]) -> u64 {
    let output = fio(&server.uri(VOLUME), state_dir, shape)
        .args(["--verify_only=1", "--verify_state_load=1"])
        .output()
        .unwrap();
    let (json, text) = report(&output);
    let job = &json["jobs"][0];
    assert!(output.status.success(), "fio verify after restart failed:\n{text}");
    assert_eq!(job["error"], 0, "fio verify after restart:\n{text}");
    assert!(!text.contains("verify: bad"), "lost writes:\n{text}");
    let verified = job["read"]["io_bytes"].as_u64().unwrap();
    assert!(verified > 0, "fio verified nothing:\n{text}");
    verified
}

fn current_mode(server: &Server) -> Vec<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "volume",
            "get",
            VOLUME,
            "sync",
            "wce",
            "logbias",
            "--json",
            "--api",
            &server.api,
        ])
        .env("STRATA_TOKEN", common::token_for(&server.api).unwrap_or_default())
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    info["properties"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| format!("{}={}", p["property"].as_str().unwrap(), p["value"].as_str().unwrap()))
        .collect()
}

#[test]
fn properties_change_under_fio_verify_then_clean_restart() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("fio");
    std::fs::create_dir_all(&state_dir).unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    server.create_volume(VOLUME, "1G");

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let setter = change_properties(
        server.api.clone(),
        ALL_MODES,
        stop.clone(),
        started + Duration::from_secs(60),
    );
    // 512 MiB of 4K writes into 128 MiB (about 98% of the blocks written,
    // many more than once), then fio reads every block back.
    let output = fio(&server.uri(VOLUME), &state_dir, OVERWRITES)
        .args(["--do_verify=1", "--verify_state_save=1"])
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    let (changes, failures) = setter.join().unwrap();
    let (json, text) = report(&output);
    let job = &json["jobs"][0];
    let written = job["write"]["io_bytes"].as_u64().unwrap();
    let verified = job["read"]["io_bytes"].as_u64().unwrap();
    eprintln!(
        "fio wrote {} MiB and verified {} MiB in {:.1} s while the properties changed {changes} times",
        written >> 20,
        verified >> 20,
        started.elapsed().as_secs_f64()
    );
    assert!(output.status.success(), "fio failed:\n{text}");
    assert_eq!(job["error"], 0, "fio reported an error:\n{text}");
    assert!(!text.contains("verify: bad"), "{text}");
    assert_eq!(written, 512 << 20, "{text}");
    // Every distinct block written is read once (overwrites are checked at
    // their last version).
    assert!(
        (110 << 20..=128 << 20).contains(&verified),
        "verified {verified}:\n{text}"
    );
    assert!(failures.is_empty(), "volume set failed: {failures:?}");
    assert!(changes >= 6, "only {changes} property changes during the run");

    // A clean stop makes every acknowledged write durable, whatever mode it
    // was written in (sync=disabled too).
    let mode = current_mode(&server);
    assert!(server.stop().success(), "clean shutdown");
    let server = Server::start(&data);
    assert_eq!(current_mode(&server), mode, "the properties survive the restart");
    let again = verify_only(&server, &state_dir, OVERWRITES);
    assert_eq!(
        again, verified,
        "after the restart fio verified {again} of {verified} bytes"
    );
}

#[test]
fn properties_change_under_fio_then_kill9() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("fio");
    std::fs::create_dir_all(&state_dir).unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    server.create_volume(VOLUME, "1G");

    // fio flushes after every write and kills the daemon after 6 s; the
    // properties change until a second before.
    let kill_after = 6;
    let stop = Arc::new(AtomicBool::new(false));
    let setter = change_properties(
        server.api.clone(),
        SAFE_MODES,
        stop.clone(),
        Instant::now() + Duration::from_secs(kill_after - 1),
    );
    let output = fio(&server.uri(VOLUME), &state_dir, FIRST_WRITES)
        .args(["--fsync=1", "--verify_state_save=1", "--time_based", "--runtime=60"])
        .arg(format!("--trigger-timeout={kill_after}"))
        .arg(format!("--trigger=kill -9 {}", server.pid()))
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    let (changes, failures) = setter.join().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    assert!(
        std::fs::read_dir(&state_dir)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().ends_with(".state")),
        "fio saved no verify state:\n{text}"
    );
    assert!(failures.is_empty(), "volume set failed: {failures:?}");
    assert!(changes >= 4, "only {changes} property changes before the kill");
    server.kill9();
    drop(server);

    let server = Server::start(&data);
    let verified = verify_only(&server, &state_dir, FIRST_WRITES);
    eprintln!(
        "after kill -9: fio verified {} MiB written while the properties changed {changes} times",
        verified >> 20
    );
}
