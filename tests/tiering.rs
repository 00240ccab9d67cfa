//! The control plane of automatic tiering, end to end through the real
//! daemon: pool properties (`pool get|set`), the `tier` volume property,
//! `pool migrate`, and what `pool status`, the REST API and `/metrics`
//! show of it; and data moving end to end: kill -9 in the middle of a pass,
//! and a pass paused and resumed while a client reads and writes.

mod common;

use common::{cli, cli_ok, http, pool_json, small_default_pool, Server};
use serde_json::Value;

/// A daemon on a fresh data directory with a small default pool.
fn start() -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    small_default_pool(dir.path());
    let server = Server::start(dir.path());
    (dir, server)
}

/// `strata ARGS` that must fail: exit status 1, nothing on stdout, one
/// error line on stderr, which it returns.
#[track_caller]
fn fails(server: &Server, args: &[&str]) -> String {
    let output = cli(server, args);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "strata {args:?} should fail: {stderr}");
    assert!(output.stdout.is_empty(), "strata {args:?} printed on stdout");
    assert_eq!(stderr.lines().count(), 1, "one error line: {stderr}");
    stderr
        .trim_end()
        .strip_prefix("strata: error: ")
        .unwrap_or_else(|| panic!("error line: {stderr}"))
        .to_string()
}

/// `get` output (NAME PROPERTY VALUE SOURCE) as (property, value, source).
fn rows(text: &str, name: &str) -> Vec<(String, String, String)> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("a header").split_whitespace().collect();
    assert_eq!(header, ["NAME", "PROPERTY", "VALUE", "SOURCE"], "{text}");
    lines
        .map(|line| {
            let cells: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(cells.len(), 4, "{text}");
            assert_eq!(cells[0], name, "{text}");
            (cells[1].to_string(), cells[2].to_string(), cells[3].to_string())
        })
        .collect()
}

fn property(server: &Server, args: &[&str], name: &str, wanted: &str) -> (String, String) {
    rows(&cli_ok(server, args), name)
        .into_iter()
        .find(|(p, _, _)| p == wanted)
        .map(|(_, v, s)| (v, s))
        .unwrap_or_else(|| panic!("no {wanted} in {args:?}"))
}

fn pool_property(server: &Server, wanted: &str) -> (String, String) {
    property(server, &["pool", "get", "default"], "default", wanted)
}

fn pair(value: &str, source: &str) -> (String, String) {
    (value.to_string(), source.to_string())
}

#[test]
fn pool_properties_round_trip_and_survive_a_restart() {
    let (dir, mut server) = start();
    let all = rows(&cli_ok(&server, &["pool", "get", "default"]), "default");
    let names: Vec<&str> = all.iter().map(|(p, _, _)| p.as_str()).collect();
    assert_eq!(
        names,
        [
            "migration",
            "migration.high",
            "migration.low",
            "migration.window",
            "scrub.interval"
        ]
    );
    assert!(all.iter().all(|(_, _, source)| source == "default"), "{all:?}");
    assert_eq!(pool_property(&server, "migration"), pair("on", "default"));
    assert_eq!(pool_property(&server, "migration.window"), pair("none", "default"));

    cli_ok(
        &server,
        &[
            "pool",
            "set",
            "default",
            "migration=off",
            "migration.high=90",
            "migration.low=60%",
            "migration.window=22:00-6:30",
        ],
    );
    let expect_set = |server: &Server| {
        assert_eq!(pool_property(server, "migration"), pair("off", "local"));
        assert_eq!(pool_property(server, "migration.high"), pair("90", "local"));
        assert_eq!(pool_property(server, "migration.low"), pair("60", "local"));
        assert_eq!(pool_property(server, "migration.window"), pair("22:00-06:30", "local"));
        // Applied to the running pool.
        let settings = pool_json(server, "default")["migration"]["settings"].clone();
        assert_eq!(settings["enabled"], false, "{settings}");
        assert_eq!(settings["high_percent"], 90, "{settings}");
        assert_eq!(settings["low_percent"], 60, "{settings}");
        assert_eq!(
            settings["window"],
            serde_json::json!([22 * 60, 6 * 60 + 30]),
            "{settings}"
        );
    };
    expect_set(&server);
    // Named properties, in the order asked.
    let some = rows(
        &cli_ok(&server, &["pool", "get", "default", "migration.low", "migration"]),
        "default",
    );
    assert_eq!(some.len(), 2);
    assert_eq!(some[0].0, "migration.low");
    assert!(fails(&server, &["pool", "get", "default", "colour"]).contains("migration.window"));

    assert!(server.stop().success());
    let mut server = Server::start(dir.path());
    expect_set(&server);

    // `none` clears the window: back to its default.
    cli_ok(
        &server,
        &["pool", "set", "default", "migration.window=none", "migration=on"],
    );
    assert_eq!(pool_property(&server, "migration.window"), pair("none", "default"));
    assert_eq!(pool_property(&server, "migration"), pair("on", "local"));
    assert_eq!(
        pool_json(&server, "default")["migration"]["settings"]["window"],
        Value::Null
    );

    // The REST API: the same rows, and a flat object of changes.
    let response = http(&server.api, "GET", "/v1/pools/default/properties", "");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"migration.high\""), "{response}");
    let response = http(
        &server.api,
        "PATCH",
        "/v1/pools/default/properties",
        r#"{"migration.high": "80", "migration.low": 50}"#,
    );
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert_eq!(pool_property(&server, "migration.high"), pair("80", "local"));
    assert_eq!(pool_property(&server, "migration.low"), pair("50", "local"));
    let response = http(&server.api, "GET", "/v1/pools/nopool/properties", "");
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    assert!(server.stop().success());
}

#[test]
fn invalid_pool_properties_are_refused_and_change_nothing() {
    let (_dir, mut server) = start();
    let before = cli_ok(&server, &["pool", "get", "default"]);
    let cases: [(&[&str], &str); 7] = [
        (
            &["migration.low=85"],
            "migration.low (85) must be below migration.high (85)",
        ),
        (
            &["migration.high=60", "migration.low=70"],
            "must be below migration.high",
        ),
        (
            &["migration=maybe"],
            "bad value 'maybe' for property 'migration': on or off",
        ),
        (&["migration.window=25:00-01:00"], "property 'migration.window'"),
        (&["migration.window=01:00-01:00"], "property 'migration.window'"),
        (&["migration.high=101"], "property 'migration.high'"),
        // Valid values with an invalid one: none is applied.
        (
            &["migration=off", "colour=red"],
            "unknown pool property 'colour' (known: migration, migration.high, migration.low, migration.window, scrub.interval)",
        ),
    ];
    for (assignments, expected) in cases {
        let mut args = vec!["pool", "set", "default"];
        args.extend_from_slice(assignments);
        let message = fails(&server, &args);
        assert!(message.contains(expected), "{assignments:?}: {message}");
        assert_eq!(
            cli_ok(&server, &["pool", "get", "default"]),
            before,
            "{assignments:?} changed something"
        );
    }
    assert_eq!(pool_json(&server, "default")["migration"]["settings"]["enabled"], true);
    let response = http(
        &server.api,
        "PATCH",
        "/v1/pools/default/properties",
        r#"{"migration": "off", "migration.low": "99"}"#,
    );
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains("must be below migration.high"), "{response}");
    assert_eq!(cli_ok(&server, &["pool", "get", "default"]), before);
    assert!(fails(&server, &["pool", "set", "nopool", "migration=off"]).contains("does not exist"));
    assert!(server.stop().success());
}

#[test]
fn volume_tier_pin() {
    let (dir, mut server) = start();
    let get = ["volume", "get", "default/vol0"];
    assert_eq!(property(&server, &get, "default/vol0", "tier"), pair("auto", "default"));
    // Read-only facts: where the volume's blocks are.
    assert_eq!(property(&server, &get, "default/vol0", "used.fast").1, "-");
    assert_eq!(property(&server, &get, "default/vol0", "used.capacity").1, "-");
    cli_ok(&server, &["volume", "set", "default/vol0", "tier=capacity"]);
    assert_eq!(
        property(&server, &get, "default/vol0", "tier"),
        pair("capacity", "local")
    );
    let message = fails(&server, &["volume", "set", "default/vol0", "tier=bogus"]);
    assert!(
        message.contains("bad value 'bogus' for property 'tier': auto, fast or capacity"),
        "{message}"
    );
    assert_eq!(
        property(&server, &get, "default/vol0", "tier"),
        pair("capacity", "local")
    );
    // At creation too, and across a restart.
    let output = cli(
        &server,
        &["volume", "create", "default/hot", "--size", "64M", "-o", "tier=fast"],
    );
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(server.stop().success());
    let mut server = Server::start(dir.path());
    assert_eq!(
        property(&server, &get, "default/vol0", "tier"),
        pair("capacity", "local")
    );
    assert_eq!(
        property(&server, &["volume", "get", "default/hot"], "default/hot", "tier"),
        pair("fast", "local")
    );
    cli_ok(&server, &["volume", "set", "default/vol0", "tier=auto"]);
    assert_eq!(property(&server, &get, "default/vol0", "tier"), pair("auto", "local"));
    assert!(server.stop().success());
}

#[test]
fn pool_migrate_and_status() {
    let (_dir, mut server) = start();
    let said = cli_ok(&server, &["pool", "migrate", "default", "--wait"]);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(said.starts_with("pool default: moved "), "{said}");
    assert!(
        said.contains(" down (") && said.contains(" up (") && said.contains("errors"),
        "{said}"
    );
    let summary: Value =
        serde_json::from_str(&cli_ok(&server, &["pool", "migrate", "default", "--wait", "--json"])).unwrap();
    for field in [
        "moved_down_bytes",
        "moved_up_bytes",
        "chunks_down",
        "chunks_up",
        "skipped_blocks",
        "errors",
        "seconds",
    ] {
        assert!(summary.get(field).is_some(), "{field} in {summary}");
    }
    // Without --wait: started in the background.
    assert_eq!(cli_ok(&server, &["pool", "migrate", "default"]), "");
    let response = http(&server.api, "POST", "/v1/pools/default/migrate?wait=false", "");
    assert!(response.starts_with("HTTP/1.1 202"), "{response}");
    let response = http(&server.api, "POST", "/v1/pools/nopool/migrate", "");
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    assert!(fails(&server, &["pool", "migrate", "nopool", "--wait"]).contains("does not exist"));

    let status = pool_json(&server, "default");
    let migration = &status["migration"];
    assert!(migration.is_object(), "{status}");
    for field in [
        "running",
        "throttled",
        "queued_down_chunks",
        "queued_up_chunks",
        "moved_down_bytes",
        "moved_up_bytes",
        "passes",
        "errors",
        "pass_done_bytes",
        "pass_total_bytes",
        "rate_bytes_per_sec",
    ] {
        assert!(migration.get(field).is_some(), "migration.{field} in {migration}");
    }
    assert_eq!(migration["settings"]["enabled"], true);
    let tiers = &status["tiers"];
    assert_eq!(
        tiers["fast"]["size_bytes"], status["devices"][0]["data_bytes"],
        "{status}"
    );
    assert_eq!(
        tiers["capacity"]["size_bytes"], status["devices"][1]["data_bytes"],
        "{status}"
    );
    for tier in ["fast", "capacity"] {
        let space = &tiers[tier];
        assert_eq!(
            space["free_bytes"].as_u64().unwrap(),
            space["size_bytes"].as_u64().unwrap() - space["used_bytes"].as_u64().unwrap()
        );
    }

    let text = cli_ok(&server, &["pool", "status", "default"]);
    assert!(
        text.contains("default: migration on (high 85%, low 70%, window any time)"),
        "{text}"
    );
    let tier_rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|cells| cells.len() == 5 && cells[0] == "default" && ["fast", "capacity"].contains(&cells[1]))
        .collect();
    assert_eq!(tier_rows.len(), 2, "{text}");

    let metrics = http(&server.api, "GET", "/metrics", "");
    for series in [
        "strata_pool_migrated_bytes_total{pool=\"default\",direction=\"down\"}",
        "strata_pool_migrated_bytes_total{pool=\"default\",direction=\"up\"}",
        "strata_pool_migration_errors_total{pool=\"default\"}",
        "strata_pool_migration_running{pool=\"default\"}",
        "strata_pool_migration_queued_chunks{pool=\"default\",direction=\"down\"}",
        "strata_pool_tier_bytes{pool=\"default\",tier=\"fast\",kind=\"size\"}",
        "strata_pool_tier_bytes{pool=\"default\",tier=\"capacity\",kind=\"used\"}",
    ] {
        assert!(metrics.contains(series), "{series} not in /metrics");
    }
    assert!(server.stop().success());
}

/// A pool of a 160 MiB fast device (63 data chunks) and a 256 MiB
/// capacity device that takes 20 ms per operation (`--wrap`: a pass moving
/// 48 MiB down takes seconds), with migration off until the test says,
/// and a 64 MiB volume holding 48 MiB of patterns (one per MiB).
fn two_tier_daemon(dir: &std::path::Path) -> (Server, Vec<String>) {
    let fast = common::sparse_file(dir, "fast.img", 160 << 20);
    let capacity = common::sparse_file(dir, "capacity.img", 256 << 20);
    let args = vec!["--wrap".to_string(), format!("{capacity}=delay:20ms")];
    let data = dir.join("data");
    let mut server = Server::start(&data);
    cli_ok(
        &server,
        &["pool", "create", "tank", "--fast", &fast, "--capacity", &capacity],
    );
    cli_ok(&server, &["pool", "set", "tank", "migration=off"]);
    cli_ok(&server, &["volume", "create", "tank/v", "--size", "64M"]);
    let writes: Vec<String> = (0..48)
        .map(|mib| format!("write -P {} {mib}M 1M", pattern(mib)))
        .collect();
    common::qemu_io_ok(&server.uri("tank/v"), &writes);
    // `--wrap` names a pool's device: from the next start on.
    assert!(server.stop().success());
    let wrap: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start_with_args(&data, Some(&data), &wrap);
    (server, args)
}

fn pattern(mib: u64) -> u64 {
    (mib * 37 + 11) % 251
}

/// Every MiB reads back as written.
fn verify(server: &Server, when: &str) {
    let reads: Vec<String> = (0..48)
        .map(|mib| format!("read -P {} {mib}M 1M", pattern(mib)))
        .collect();
    let (ok, text) = common::qemu_io(&server.uri("tank/v"), &reads);
    assert!(
        ok && !text.contains("failed") && !text.contains("error"),
        "{when}:\n{text}"
    );
}

fn tier_used(server: &Server) -> (u64, u64) {
    let status = pool_json(server, "tank");
    let used = |tier: &str| status["tiers"][tier]["used_bytes"].as_u64().unwrap();
    (used("fast"), used("capacity"))
}

/// kill -9 while a pass moves blocks down (twice, with a full pass up in
/// between): after each restart every byte reads back as written, and the
/// pool's space is the volume's 48 MiB, once: nothing lost, nothing
/// leaked, no block left in two places.
#[test]
fn kill_9_while_blocks_move_loses_nothing_and_leaks_nothing() {
    common::require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let (mut server, args) = two_tier_daemon(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let data = dir.path().join("data");
    for (round, pin) in ["capacity", "fast", "capacity"].into_iter().enumerate() {
        cli_ok(&server, &["volume", "set", "tank/v", &format!("tier={pin}")]);
        if pin == "fast" {
            let summary = cli_ok(&server, &["pool", "migrate", "tank", "--wait"]);
            assert!(summary.contains("up ("), "{summary}");
            assert_eq!(tier_used(&server).1, 0, "everything moved up");
            verify(&server, "after the pass up");
            continue;
        }
        cli_ok(&server, &["pool", "migrate", "tank"]);
        // Well inside the pass (48 chunks, each a read and a write of 20 ms
        // on the capacity device; a commit after the 16th chunk, before
        // the 17th starts, and every second): early in the first round
        // (its moves most likely not committed yet), past the 16th chunk's
        // commit in the last (some committed, some not).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let wanted: u64 = if round == 0 { 1 } else { 20 << 20 };
        let status = loop {
            let status = pool_json(&server, "tank");
            if status["migration"]["pass_done_bytes"].as_u64().unwrap() >= wanted {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: the pass does not move: {status}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(
            status["migration"]["running"], true,
            "round {round}: the pass ended early: {status}"
        );
        server.kill9();
        server = Server::start_with_args(&data, Some(&data), &args);
        verify(&server, &format!("round {round}, after kill -9 mid-pass"));
        let settled = common::settled_pool_json(&server, "tank");
        assert_eq!(settled["used_bytes"], 48u64 << 20, "round {round}: {settled}");
        let (fast, capacity) = tier_used(&server);
        assert_eq!(fast + capacity, 48 << 20, "round {round}");
        if round > 0 {
            assert!(
                fast > 0 && capacity > 0,
                "round {round}: killed mid-pass, yet fast {fast} capacity {capacity}"
            );
        }
    }
    // The rest moves down when asked again; nothing was left half-done.
    cli_ok(&server, &["pool", "migrate", "tank", "--wait"]);
    assert_eq!(tier_used(&server), (0, 48 << 20));
    verify(&server, "after the last pass");
}

/// `migration=off` stops a background pass under way at once, and `on`
/// lets the next pass carry on; meanwhile a client reads and writes.
#[test]
fn migration_pauses_and_resumes_under_load() {
    common::require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let (server, _) = two_tier_daemon(dir.path());
    // Watermarks that send nearly everything down, in the background.
    cli_ok(
        &server,
        &[
            "pool",
            "set",
            "tank",
            "migration.high=5",
            "migration.low=1",
            "migration=on",
        ],
    );
    let uri = server.uri("tank/v");
    let client = {
        let uri = uri.clone();
        std::thread::spawn(move || {
            for round in 0..200u64 {
                let mib = 48 + round % 16;
                let (ok, text) = common::qemu_io(
                    &uri,
                    &[format!("write -P 7 {mib}M 64k"), format!("read -P 7 {mib}M 64k")],
                );
                assert!(ok && !text.contains("failed"), "{text}");
            }
        })
    };
    let wait_for = |what: &str, done: &dyn Fn(&Value) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let status = pool_json(&server, "tank");
            if done(&status["migration"]) {
                return status["migration"].clone();
            }
            assert!(std::time::Instant::now() < deadline, "{what}: {status}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    wait_for("a background pass starts (every 10 s)", &|m| {
        m["running"] == true && m["pass_done_bytes"].as_u64() > Some(0)
    });
    cli_ok(&server, &["pool", "set", "tank", "migration=off"]);
    let paused = wait_for("the pass stops at its next chunk", &|m| m["running"] == false);
    let moved = paused["moved_down_bytes"].as_u64().unwrap();
    assert!(moved > 0 && moved < 48 << 20, "{paused}");
    std::thread::sleep(std::time::Duration::from_secs(11));
    let still = pool_json(&server, "tank")["migration"].clone();
    assert_eq!(
        still["moved_down_bytes"].as_u64(),
        Some(moved),
        "moved while off: {still}"
    );
    cli_ok(&server, &["pool", "set", "tank", "migration=on"]);
    wait_for("the next pass carries on", &|m| {
        m["moved_down_bytes"].as_u64() > Some(moved)
    });
    client.join().unwrap();
    verify(&server, "after pause and resume");
}

/// kill -9 (twice) while fio writes with crc32c verification and the
/// migrator moves everything it can down — the fill a snapshot shares
/// (one move for both), and fio's new blocks as they land — so clients
/// rewrite blocks that were just moved: after each restart fio verifies
/// every write it saw complete, the snapshot reads back as taken, and once
/// it is deleted the pool holds exactly the volume's blocks.
#[test]
fn kill_9_while_migration_runs_under_fio_verify() {
    common::require_tool("fio");
    common::require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let fast = common::sparse_file(dir.path(), "fast.img", 160 << 20);
    let capacity = common::sparse_file(dir.path(), "capacity.img", 512 << 20);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    cli_ok(
        &server,
        &["pool", "create", "tank", "--fast", &fast, "--capacity", &capacity],
    );
    // Nearly everything belongs down: the migrator never runs out of work.
    cli_ok(&server, &["pool", "set", "tank", "migration.high=5", "migration.low=1"]);
    cli_ok(&server, &["volume", "create", "tank/v", "--size", "64M"]);
    common::qemu_io_ok(&server.uri("tank/v"), &["write -P 0x5a 0 64M".to_string()]);
    cli_ok(&server, &["snapshot", "create", "tank/v@fill"]);
    assert!(server.stop().success());
    // A capacity device that takes 2 ms per operation: a pass is seconds.
    let wrap = format!("{capacity}=delay:2ms");
    let args = ["--wrap", wrap.as_str()];
    let mut server = Server::start_with_args(&data, Some(&data), &args);
    let state_dir = dir.path().join("fio-state");
    std::fs::create_dir_all(&state_dir).unwrap();
    let job = |uri: &str, verify_only: bool| {
        let mut command = std::process::Command::new("fio");
        command
            .args([
                "--name=tier",
                "--ioengine=nbd",
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=4",
            ])
            .args([
                "--numjobs=4",
                "--size=16m",
                "--offset_increment=16m",
                "--group_reporting",
            ])
            .args(["--verify=crc32c", "--randrepeat=1"])
            .arg(format!("--uri={uri}"))
            .current_dir(&state_dir);
        if verify_only {
            command.args(["--verify_only=1", "--verify_state_load=1", "--verify_fatal=1"]);
        }
        command
    };
    let mut moved = 0;
    for cycle in 0..2 {
        // A pass now (and every 10 s in the background after it).
        cli_ok(&server, &["pool", "migrate", "tank"]);
        let output = job(&server.uri("tank/v"), false)
            .args(["--verify_state_save=1", "--time_based", "--runtime=60"])
            .arg("--trigger-timeout=6")
            .arg(format!("--trigger=kill -9 {}", server.pid()))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
        assert!(
            std::fs::read_dir(&state_dir).unwrap().any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".state")),
            "cycle {cycle}: fio saved no verify state:\n{text}"
        );
        server.kill9();
        server = Server::start_with_args(&data, Some(&data), &args);
        let verify = job(&server.uri("tank/v"), true).output().unwrap();
        let report = String::from_utf8_lossy(&verify.stdout).to_string() + &String::from_utf8_lossy(&verify.stderr);
        assert!(verify.status.success(), "cycle {cycle}: verification failed:\n{report}");
        assert!(
            report.contains("err= 0"),
            "cycle {cycle}: fio reported errors:\n{report}"
        );
        assert!(!report.contains("verify: bad"), "cycle {cycle}: lost writes:\n{report}");
        assert!(
            report.contains("READ: bw="),
            "cycle {cycle}: fio verified nothing:\n{report}"
        );
        common::qemu_io_read_only(&server.uri("tank/v@fill"), &["read -P 0x5a 0 64M".to_string()]);
        let status = pool_json(&server, "tank");
        moved = status["migration"]["moved_down_bytes"].as_u64().unwrap_or(0);
        eprintln!("cycle {cycle} verified; {}", status["tiers"]);
    }
    // The pass after the last restart has moved shared blocks too (the
    // counters start again at each start); the capacity tier holds data.
    let (_, capacity_used) = tier_used(&server);
    assert!(capacity_used > 0, "nothing moved down (moved {moved})");
    cli_ok(&server, &["snapshot", "delete", "tank/v@fill"]);
    let settled = common::settled_pool_json(&server, "tank");
    let volume: Value = serde_json::from_str(&cli_ok(&server, &["volume", "get", "--json", "tank/v"])).unwrap();
    assert_eq!(
        settled["used_bytes"], volume["used_bytes"],
        "space leaked or lost: {settled}"
    );
}
