//! The dashboard in real browsers: headless Chromium driven by Selenium
//! (`tests/dashboard/check.py`) and headless Firefox driven over Marionette
//! (`tests/dashboard/firefox.py`), against a daemon serving fio's requests.
//! The page must sign in, draw requests in the heat map, filter it when a
//! breakdown entry is clicked; in Chromium also show a column's
//! percentiles and a band's breakdown, and log no errors. The screenshots
//! are left in `target/dashboard.png` (the one in docs/ is a copy of it)
//! and `target/dashboard-firefox.png`.

mod common;

use std::process::{Command, Stdio};

/// A daemon with two volumes under fio load; the loads end when dropped.
struct Loaded {
    dir: tempfile::TempDir,
    server: common::Server,
    loads: Vec<std::process::Child>,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        for load in &mut self.loads {
            let _ = load.kill();
            let _ = load.wait();
        }
    }
}

fn loaded() -> Loaded {
    common::require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    common::small_default_pool(dir.path());
    let server = common::Server::start(dir.path());
    server.create_volume("default/web", "256M");
    server.create_volume("default/db", "256M");
    let fio = |volume: &str, rw: &str| {
        Command::new("fio")
            .args([
                &format!("--name={rw}"),
                "--ioengine=nbd",
                &format!("--uri={}", server.uri(volume)),
                &format!("--rw={rw}"),
                "--bs=4k",
                "--iodepth=4",
                "--size=64M",
                "--time_based",
                "--runtime=60",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let loads = vec![fio("default/web", "randread"), fio("default/db", "randwrite")];
    std::thread::sleep(std::time::Duration::from_secs(3));
    Loaded { dir, server, loads }
}

/// Runs a browser script against the loaded daemon; returns its stdout.
fn browse(loaded: &Loaded, script: &str, shot: &str) -> String {
    let token = std::fs::read_to_string(loaded.dir.path().join("api.token")).unwrap();
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("..").join(shot);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/dashboard")
        .join(script);
    let output = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", loaded.server.api))
        .arg(token.trim())
        .arg(&shot)
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{script:?} failed:\n{stdout}\n{stderr}");
    assert!(
        std::fs::metadata(&shot).map(|m| m.len() > 10_000).unwrap_or(false),
        "no screenshot at {shot:?}"
    );
    stdout
}

#[test]
fn the_dashboard_draws_live_requests_and_drills_down() {
    common::require_tool("chromium");
    common::require_tool("chromedriver");
    let loaded = loaded();
    let stdout = browse(&loaded, "check.py", "dashboard.png");
    assert!(stdout.contains("dashboard ok"), "{stdout}");
}

#[test]
fn the_dashboard_works_in_firefox() {
    common::require_tool("firefox-esr");
    let loaded = loaded();
    let stdout = browse(&loaded, "firefox.py", "dashboard-firefox.png");
    assert!(stdout.contains("dashboard ok in firefox"), "{stdout}");
}
