//! Read-only admin calls answer while a long mutating one runs: `pool
//! status`, `volume list`, `volume get`, `snapshot list`, `GET /metrics`
//! and `GET /v1/pools` never wait for a snapshot delete to finish.

mod common;

use common::{cli, http, require_tool, run, small_default_pool, Server};
use std::process::Command;
use std::time::{Duration, Instant};

/// Every flush of the default pool's fast device (which holds its intent
/// log) takes this long, so a snapshot delete, which ends with a log
/// commit, takes at least as long.
const FLUSH_DELAY: Duration = Duration::from_secs(3);

/// A snapshot of a 4 GiB volume, owning blocks spread over all of it, is
/// deleted while every read-only admin call is made: each answers long
/// before the delete ends (both measured from when the delete began).
#[test]
fn status_list_get_and_metrics_answer_while_a_snapshot_delete_runs() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    small_default_pool(&data);
    // Made without the delay (making a pool flushes many times), then
    // served with it.
    let mut first = Server::start(&data);
    first.create_volume("default/big", "4G");
    assert!(first.stop().success());
    let fast = data.join("pools/default/fast.dev");
    let wrap = format!("{}=delay:flush={}s", fast.display(), FLUSH_DELAY.as_secs());
    let server = Server::start_with_args(&data, Some(&data), &["--wrap", &wrap]);
    let uri = server.uri("default/big");
    // 64 KiB every 64 MiB of the 4 GiB, snapshotted, then overwritten: the
    // snapshot owns those blocks, and its delete frees them.
    let writes = |pattern: u8| -> Vec<String> {
        let mut commands: Vec<String> = (0..64u64)
            .map(|i| format!("write -P {pattern:#x} {} 64k", i << 26))
            .collect();
        commands.push("flush".into());
        commands
    };
    let qemu_io = |commands: Vec<String>| {
        let mut command = Command::new("qemu-io");
        command.args(["-f", "raw"]);
        for c in &commands {
            command.arg("-c").arg(c);
        }
        run(command.arg(&uri));
    };
    qemu_io(writes(0x11));
    let taken = cli(&server, &["snapshot", "create", "default/big@old"]);
    assert!(taken.status.success(), "{}", String::from_utf8_lossy(&taken.stderr));
    qemu_io(writes(0x22));

    let started = Instant::now();
    let deleter = {
        let data_dir = server.data_dir.clone();
        std::thread::spawn(move || {
            let output = Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(["snapshot", "delete", "default/big@old", "--data-dir"])
                .arg(&data_dir)
                .output()
                .unwrap();
            (output, started.elapsed())
        })
    };
    // Let the delete reach the engine (it then waits for the slow flush).
    std::thread::sleep(Duration::from_millis(500));
    let mut answers: Vec<(&str, Duration)> = Vec::new();
    let mut answered = |what: &'static str, ok: bool, said: String| {
        assert!(ok, "{what} failed during the delete: {said}");
        answers.push((what, started.elapsed()));
    };
    let response = http(&server.api, "GET", "/metrics", "");
    answered("GET /metrics", response.starts_with("HTTP/1.1 200"), response);
    let response = http(&server.api, "GET", "/v1/pools", "");
    answered("GET /v1/pools", response.starts_with("HTTP/1.1 200"), response);
    for args in [
        &["pool", "status"][..],
        &["volume", "list"],
        &["volume", "get", "default/big"],
        &["snapshot", "list"],
    ] {
        let output = cli(&server, args);
        let what: &'static str = Box::leak(format!("strata {}", args.join(" ")).into_boxed_str());
        answered(
            what,
            output.status.success(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        );
    }
    let (deleted, delete_took) = deleter.join().unwrap();
    assert!(
        deleted.status.success(),
        "snapshot delete: {}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    eprintln!("snapshot delete took {delete_took:?}; answers: {answers:?}");
    // The delete waited for at least one slow flush: long enough to tell
    // an answer that waited for it from one that did not.
    assert!(
        delete_took >= FLUSH_DELAY,
        "the delete took {delete_took:?}, less than one device flush ({FLUSH_DELAY:?}): nothing to observe"
    );
    for (what, at) in &answers {
        assert!(
            *at + Duration::from_secs(1) < delete_took,
            "{what} answered {at:?} after the delete began, the delete ended at {delete_took:?}: it waited for the delete"
        );
    }
    // Its effect is visible once it is done.
    let listed = cli(&server, &["snapshot", "list"]);
    assert!(!String::from_utf8_lossy(&listed.stdout).contains("default/big@old"));
}
