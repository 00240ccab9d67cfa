//! Automatic snapshots (`snapshot.schedule`) with a real daemon: they
//! appear at each period boundary, are pruned to the keep count, leave
//! snapshots taken by hand and those clones depend on alone, stop when the
//! schedule is removed, and a restart takes no burst of missed ones.
//!
//! The `Ns` period (every N seconds) keeps these tests to seconds.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{cli, cli_ok, Server};

/// The snapshot names (after `@`) of `volume`, oldest first.
fn snapshot_names(server: &Server, volume: &str) -> Vec<String> {
    listed_names(server, &["snapshot", "list", volume, "--json"])
}

/// The `snapshot` field of each row a `--json` listing prints.
fn listed_names(server: &Server, args: &[&str]) -> Vec<String> {
    let listed: serde_json::Value = serde_json::from_str(&cli_ok(server, args)).unwrap();
    listed
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot"].as_str().unwrap().to_string())
        .collect()
}

fn automatic(names: &[String]) -> Vec<String> {
    names.iter().filter(|n| n.starts_with("auto-")).cloned().collect()
}

/// `auto-2026-11-25T090005Z-2s` → seconds since midnight (tests run well
/// within a day; a run across midnight UTC only makes the wait longer).
fn second_of_day(name: &str) -> u64 {
    let stamp = &name["auto-2026-11-25T".len()..][..6];
    let field = |range: std::ops::Range<usize>| stamp[range].parse::<u64>().unwrap();
    field(0..2) * 3600 + field(2..4) * 60 + field(4..6)
}

/// Polls `check` every 200 ms until it returns `Some`, at most `limit`.
fn wait_for<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn property(server: &Server, volume: &str, name: &str) -> String {
    let json: serde_json::Value =
        serde_json::from_str(&cli_ok(server, &["volume", "get", volume, name, "--json"])).unwrap();
    json.to_string()
}

#[test]
fn automatic_snapshots_come_and_go_around_hand_made_ones_and_clone_origins() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("daemon.log");
    let mut server = Server::start_logged(dir.path(), Some(dir.path()), &[], Some(&log));
    cli_ok(&server, &["volume", "create", "default/db", "--size", "16M"]);

    // Bad schedules are refused with one line naming the property.
    for (args, why) in [
        (
            vec!["volume", "set", "default/db", "snapshot.schedule=hourly:0"],
            "1 to 1000",
        ),
        (
            vec!["volume", "set", "default/db", "snapshot.schedule=fortnightly:2"],
            "unknown period 'fortnightly'",
        ),
        (
            vec!["volume", "set", "default/db", "snapshot.schedule=hourly:2,hourly:3"],
            "named twice",
        ),
        (
            vec![
                "volume",
                "create",
                "default/x",
                "--size",
                "1M",
                "-o",
                "snapshot.schedule=daily",
            ],
            "not PERIOD:KEEP",
        ),
    ] {
        let output = cli(&server, &args);
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(
            said.contains("snapshot.schedule") && said.contains(why),
            "{args:?}: {said}"
        );
        assert_eq!(said.trim().lines().count(), 1, "{said}");
    }
    assert!(property(&server, "default/db", "snapshot.schedule").contains("\"off\""));
    assert!(snapshot_names(&server, "default/db").is_empty());

    cli_ok(&server, &["snapshot", "create", "default/db@by-hand"]);
    cli_ok(&server, &["volume", "set", "default/db", "snapshot.schedule=2s:3"]);
    let shown = property(&server, "default/db", "snapshot.schedule");
    assert!(shown.contains("\"2s:3\"") && shown.contains("\"local\""), "{shown}");

    // The first one comes at once; a clone is made of it.
    let origin = wait_for(Duration::from_secs(20), "a first automatic snapshot", || {
        automatic(&snapshot_names(&server, "default/db")).first().cloned()
    });
    assert!(origin.ends_with("Z-2s"), "{origin}");
    // A clone takes over its origin's properties, but not the schedule.
    cli_ok(
        &server,
        &["volume", "clone", &format!("default/db@{origin}"), "default/golden"],
    );
    let cloned = property(&server, "default/golden", "snapshot.schedule");
    assert!(cloned.contains("\"off\"") && cloned.contains("\"default\""), "{cloned}");

    // Five periods on, the newest three remain with the clone's origin.
    let mut seen = BTreeSet::new();
    let remaining = wait_for(Duration::from_secs(60), "pruning to three", || {
        let autos = automatic(&snapshot_names(&server, "default/db"));
        seen.extend(autos.iter().cloned());
        let newest = autos.last().map_or(0, |n| second_of_day(n));
        let others = autos.iter().filter(|n| **n != origin).count();
        (newest >= second_of_day(&origin) + 10 && others == 3).then_some(autos)
    });
    let names = snapshot_names(&server, "default/db");
    assert!(names.contains(&"by-hand".to_string()), "{names:?}");
    assert!(
        remaining.contains(&origin),
        "the clone's origin was pruned: {remaining:?}"
    );
    let pruned: Vec<&String> = seen.iter().filter(|n| !remaining.contains(n)).collect();
    assert!(!pruned.is_empty(), "nothing was pruned: seen {seen:?}");
    // The three kept are the newest.
    let mut kept: Vec<&String> = remaining.iter().filter(|n| **n != origin).collect();
    kept.sort();
    assert!(pruned.iter().all(|p| *p < kept[0]), "kept {kept:?}, pruned {pruned:?}");
    // Each automatic snapshot is a period apart from the one before.
    for pair in kept.windows(2) {
        assert!(second_of_day(pair[1]) >= second_of_day(pair[0]) + 2, "{kept:?}");
    }

    // Removing the schedule stops it: nothing taken, nothing pruned.
    cli_ok(&server, &["volume", "set", "default/db", "snapshot.schedule=off"]);
    assert!(property(&server, "default/db", "snapshot.schedule").contains("\"off\""));
    // A round under way when the schedule changed may still finish.
    std::thread::sleep(Duration::from_secs(1));
    let stopped = snapshot_names(&server, "default/db");
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(snapshot_names(&server, "default/db"), stopped);
    assert!(snapshot_names(&server, "default/golden").is_empty());

    // The log says each one taken and pruned, once, inside the scheduler's
    // span, and the held origin once.
    server.stop();
    let said = std::fs::read_to_string(&log).unwrap();
    let count = |span: &str, what: &str| {
        said.lines()
            .filter(|l| l.contains(span) && l.contains(what) && l.contains("default/db@"))
            .count()
    };
    let taken = count("retention{rule=2s:3}", " taken");
    let deleted = count("retention{prune=2s:3}", " deleted");
    assert!(taken >= seen.len() && deleted >= pruned.len(), "{said}");
    assert_eq!(taken - deleted, automatic(&stopped).len(), "{said}");
    let held = said
        .lines()
        .filter(|l| {
            l.contains(&format!(
                "default/db@{origin} is past its keep count but stays: clones depend on it"
            ))
        })
        .count();
    assert_eq!(held, 1, "{said}");
}

#[test]
fn a_restart_takes_no_burst_and_no_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    cli_ok(
        &server,
        &[
            "volume",
            "create",
            "default/h",
            "--size",
            "1M",
            "-o",
            "snapshot.schedule=daily:2, hourly:2",
        ],
    );
    let shown = property(&server, "default/h", "snapshot.schedule");
    assert!(shown.contains("\"hourly:2,daily:2\""), "{shown}");
    // One of each, at once.
    let first = wait_for(Duration::from_secs(20), "an hourly and a daily snapshot", || {
        let autos = automatic(&snapshot_names(&server, "default/h"));
        (autos.len() == 2).then_some(autos)
    });
    assert!(first.iter().any(|n| n.ends_with("-hourly")) && first.iter().any(|n| n.ends_with("-daily")));
    server.stop();

    let mut server = Server::start(dir.path());
    // A probe volume with a 1 s period: once it has a snapshot, a round
    // has run since the restart (rounds cover every volume).
    cli_ok(
        &server,
        &[
            "volume",
            "create",
            "default/probe",
            "--size",
            "1M",
            "-o",
            "snapshot.schedule=1s:1",
        ],
    );
    wait_for(Duration::from_secs(20), "a round after the restart", || {
        (!snapshot_names(&server, "default/probe").is_empty()).then_some(())
    });
    // Still at most one per hour and per day: the restart took no new one
    // for a period already covered (a new hour may have begun meanwhile).
    let autos = automatic(&snapshot_names(&server, "default/h"));
    for (period, prefix_bytes) in [
        ("-hourly", "auto-2026-11-25T09".len()),
        ("-daily", "auto-2026-11-25".len()),
    ] {
        let slots: Vec<&str> = autos
            .iter()
            .filter(|n| n.ends_with(period))
            .map(|n| &n[..prefix_bytes])
            .collect();
        let distinct: BTreeSet<&&str> = slots.iter().collect();
        assert!(!slots.is_empty(), "{autos:?}");
        assert_eq!(
            slots.len(),
            distinct.len(),
            "two snapshots of one {period} period: {autos:?}"
        );
    }
    // A schedule with a period of one second and a keep of one: each new
    // one replaces the last.
    let probe = automatic(&snapshot_names(&server, "default/probe"));
    wait_for(Duration::from_secs(20), "the probe's snapshot replaced", || {
        let now = automatic(&snapshot_names(&server, "default/probe"));
        (now.len() == 1 && !probe.contains(&now[0])).then_some(())
    });
    server.stop();
}

#[test]
fn a_dataset_gets_automatic_snapshots_pruned_to_its_keep_count() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let names = |server: &Server| listed_names(server, &["fs", "snapshots", "default/home", "--json"]);
    // The volume property's validation and message.
    let output = cli(
        &server,
        &["fs", "create", "default/bad", "-o", "snapshot.schedule=hourly:0"],
    );
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && said.contains("snapshot.schedule") && said.contains("1 to 1000"),
        "{said}"
    );
    cli_ok(
        &server,
        &["fs", "create", "default/home", "-o", "snapshot.schedule=off"],
    );
    cli_ok(&server, &["fs", "snapshot", "default/home@by-hand"]);
    cli_ok(&server, &["fs", "set", "default/home", "snapshot.schedule=2s:2"]);
    assert!(cli_ok(&server, &["fs", "get", "default/home"]).contains("2s:2"));

    // Four periods on, the newest two remain beside the one taken by hand.
    let mut seen = BTreeSet::new();
    let first = wait_for(Duration::from_secs(20), "a first automatic snapshot", || {
        automatic(&names(&server)).first().cloned()
    });
    assert!(first.ends_with("Z-2s"), "{first}");
    let remaining = wait_for(Duration::from_secs(60), "pruning to two", || {
        let autos = automatic(&names(&server));
        seen.extend(autos.iter().cloned());
        let newest = autos.last().map_or(0, |n| second_of_day(n));
        (newest >= second_of_day(&first) + 8 && autos.len() == 2).then_some(autos)
    });
    assert!(names(&server).contains(&"by-hand".to_string()));
    assert!(!remaining.contains(&first), "{remaining:?}");
    assert!(seen.len() > 2, "nothing was pruned: {seen:?}");
    assert!(cli_ok(&server, &["fs", "snapshots"]).contains(&remaining[1]));
}
