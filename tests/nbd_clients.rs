//! The NBD server against real clients: nbdinfo, qemu-img, qemu-io, nbdcopy, fio.

mod common;

use common::{pseudo_random, require_tool, run, stdout_of, Server};
use std::process::Command;

#[test]
fn nbdinfo_lists_exports_and_maps_allocation() {
    require_tool("nbdinfo");
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let list = stdout_of(
        Command::new("nbdinfo")
            .args(["--list", "--json"])
            .arg(format!("nbd://{}", server.nbd)),
    );
    let listed: serde_json::Value = serde_json::from_str(&list).unwrap();
    let exports = listed["exports"].as_array().unwrap();
    assert_eq!(exports.len(), 1, "{list}");
    let export = &exports[0];
    assert_eq!(export["export-name"], "default/vol0");
    assert_eq!(export["export-size"], 10u64 << 30);
    assert_eq!(export["block_size_minimum"], 512);
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_multi_conn",
        "can_cache",
        "can_df",
    ] {
        assert_eq!(export[flag], true, "{flag} in {list}");
    }
    assert!(
        export["contexts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c == "base:allocation"),
        "{list}"
    );

    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5a 1M 1M"])
        .arg(&uri));
    let map = stdout_of(Command::new("nbdinfo").args(["--map", "--json"]).arg(&uri));
    let extents: serde_json::Value = serde_json::from_str(&map).unwrap();
    let extents = extents.as_array().unwrap();
    let summary: Vec<(u64, u64, u64)> = extents
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["type"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (0, 1 << 20, 3),
            (1 << 20, 1 << 20, 0),
            (2 << 20, (10u64 << 30) - (2 << 20), 3)
        ]
    );
    // The empty export name means default/vol0.
    let info = stdout_of(
        Command::new("nbdinfo")
            .args(["--json"])
            .arg(format!("nbd://{}", server.nbd)),
    );
    assert!(info.contains("\"export-size\": 10737418240"), "{info}");
}

#[test]
fn qemu_img_convert_and_compare() {
    require_tool("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let image = dir.path().join("source.raw");
    // 16 MiB: random data, then a hole, then more data; the rest of the 10G volume stays zero.
    let mut content = pseudo_random(7, 16 << 20);
    content[4 << 20..8 << 20].fill(0);
    std::fs::write(&image, &content).unwrap();
    let uri = server.uri("default/vol0");
    let info = stdout_of(Command::new("qemu-img").args(["info", "--output=json"]).arg(&uri));
    assert!(info.contains("\"virtual-size\": 10737418240"), "{info}");
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&image)
        .arg(&uri));
    // compare in strict mode over the first 16 MiB, then the rest must read as zeros.
    let compare = stdout_of(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&image)
            .arg(&uri),
    );
    assert!(compare.contains("Images are identical"), "{compare}");
    // And a changed byte is noticed.
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x01 12M 512"])
        .arg(&uri));
    let status = Command::new("qemu-img")
        .args(["compare", "-q", "-f", "raw", "-F", "raw"])
        .arg(&image)
        .arg(&uri)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(1), "qemu-img compare must report the difference");
}

#[test]
fn qemu_io_patterns_zeroes_and_discard() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .arg("-f")
        .arg("raw")
        .args([
            "-c",
            "write -P 0xab 0 64k",
            "-c",
            "write -P 0xcd 1G 4k",
            "-c",
            "write -P 0xef 10239M 1M",
            "-c",
            "flush",
        ])
        .args([
            "-c",
            "read -P 0xab 0 64k",
            "-c",
            "read -P 0xcd 1G 4k",
            "-c",
            "read -P 0xef 10239M 1M",
            "-c",
            "read -P 0 64k 64k",
        ])
        .arg(&uri));
    // write -z (WRITE_ZEROES), -u (may unmap), discard (TRIM), FUA writes.
    run(Command::new("qemu-io")
        .arg("-f")
        .arg("raw")
        .args([
            "-c",
            "write -z 0 32k",
            "-c",
            "read -P 0 0 32k",
            "-c",
            "read -P 0xab 32k 32k",
        ])
        .args(["-c", "write -z -u 32k 32k", "-c", "read -P 0 0 64k"])
        .args(["-c", "discard 1G 4k", "-c", "read -P 0 1G 4k"])
        .args(["-c", "write -f -P 0x11 2G 128k", "-c", "read -P 0x11 2G 128k"])
        .arg(&uri));
    // A read past the end fails cleanly and the server keeps serving.
    let output = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 10G 4k"])
        .arg(&uri)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr);
    assert!(
        text.contains("error") || text.contains("Invalid") || !output.status.success(),
        "{text}"
    );
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0xef 10239M 1M"])
        .arg(&uri));
}

#[test]
fn nbdcopy_round_trip_keeps_checksum() {
    require_tool("nbdcopy");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    server.create_volume("default/copy", "64M");
    let uri = server.uri("default/copy");
    let source = dir.path().join("in.raw");
    // 64 MiB: random data with a 16 MiB run of zeros in the middle.
    let mut content = pseudo_random(42, 64 << 20);
    content[16 << 20..32 << 20].fill(0);
    std::fs::write(&source, &content).unwrap();
    run(Command::new("nbdcopy").arg("--flush").arg(&source).arg(&uri));
    let out = dir.path().join("out.raw");
    run(Command::new("nbdcopy").arg(&uri).arg(&out));
    let copied = std::fs::read(&out).unwrap();
    assert_eq!(copied.len(), content.len());
    assert_eq!(
        strata::checksum::crc32c(&copied),
        strata::checksum::crc32c(&content),
        "copied data differs"
    );
    // The zero run was sent as holes and left unallocated.
    let map = stdout_of(Command::new("nbdinfo").args(["--map", "--json"]).arg(&uri));
    let extents: serde_json::Value = serde_json::from_str(&map).unwrap();
    let hole_bytes: u64 = extents
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"].as_u64() == Some(3))
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    assert!(hole_bytes >= 16 << 20, "expected the zero run to stay sparse: {map}");
}

#[test]
fn fio_random_writes_verify_at_qd32_over_four_connections() {
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    // Four jobs = four NBD connections, each on its own 64 MiB region, 4K
    // random writes at QD32, every block verified with crc32c.
    let output = run(Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
        ])
        .args([
            "--numjobs=4",
            "--size=64m",
            "--offset_increment=64m",
            "--verify=crc32c",
            "--do_verify=1",
        ])
        .args(["--verify_fatal=1", "--group_reporting", "--output-format=json"])
        .current_dir(dir.path())
        .arg(format!("--uri={uri}")));
    // fio's nbd engine prints a line before the JSON document.
    let text = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value = serde_json::from_str(&text[text.find('{').expect("fio JSON")..]).unwrap();
    let job = &report["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error");
    let written = job["write"]["io_bytes"].as_u64().unwrap();
    let verified = job["read"]["io_bytes"].as_u64().unwrap();
    assert_eq!(written, 4 * (64 << 20), "fio wrote {written} bytes");
    assert_eq!(verified, written, "fio verified {verified} of {written} bytes");
}

#[test]
fn restart_and_crash_keep_flushed_data() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x77 3M 1M", "-c", "flush"])
        .arg(&uri));
    assert!(server.stop().success(), "clean shutdown must exit 0");

    let mut server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x77 3M 1M", "-c", "read -P 0 4M 1M"])
        .arg(&uri));
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -f -P 0x78 5M 1M"])
        .arg(&uri));
    server.kill9();

    let server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x77 3M 1M", "-c", "read -P 0x78 5M 1M"])
        .arg(&uri));
}

#[test]
fn metrics_count_nbd_operations() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path());
    run(Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 1 0 64k",
            "-c",
            "read -P 1 0 64k",
            "-c",
            "flush",
        ])
        .arg(server.uri("default/vol0")));
    let body = http_get(&server.api, "/metrics");
    let line = |op: &str| {
        body.lines()
            .find(|l| {
                l.starts_with(&format!(
                    "strata_volume_operations_total{{volume=\"default/vol0\",protocol=\"nbd\",op=\"{op}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(line("write") >= 1 && line("read") >= 1 && line("flush") >= 1, "{body}");
    assert!(
        body.contains("strata_volume_bytes_total{volume=\"default/vol0\",protocol=\"nbd\",op=\"write\"} 65536"),
        "{body}"
    );
    assert!(body.contains(
        "strata_volume_latency_seconds_bucket{volume=\"default/vol0\",protocol=\"nbd\",op=\"read\",le=\"+Inf\"}"
    ));
}

fn http_get(address: &str, path: &str) -> String {
    let response = common::http(address, "GET", path, "");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}
