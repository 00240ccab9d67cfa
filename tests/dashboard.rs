//! The dashboard in a real browser: headless Chromium driven by Selenium
//! (`tests/dashboard/check.py`) against a daemon serving fio's requests.
//! The page must sign in, draw requests in the heat map, filter it when a
//! breakdown entry is clicked, show a column's percentiles, and log no
//! errors. The screenshot is left in `target/dashboard.png` (the one in
//! docs/ is a copy of it).

mod common;

use std::process::{Command, Stdio};

#[test]
fn the_dashboard_draws_live_requests_and_drills_down() {
    common::require_tool("fio");
    common::require_tool("chromium");
    common::require_tool("chromedriver");
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
                "--runtime=40",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut loads = [fio("default/web", "randread"), fio("default/db", "randwrite")];
    std::thread::sleep(std::time::Duration::from_secs(3));
    let token = std::fs::read_to_string(dir.path().join("api.token")).unwrap();
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("../dashboard.png");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/dashboard/check.py");
    let output = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", server.api))
        .arg(token.trim())
        .arg(&shot)
        .output()
        .expect("python3");
    for load in &mut loads {
        let _ = load.kill();
        let _ = load.wait();
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "dashboard check failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("dashboard ok"), "{stdout}");
    assert!(
        std::fs::metadata(&shot).map(|m| m.len() > 10_000).unwrap_or(false),
        "no screenshot at {shot:?}"
    );
}
