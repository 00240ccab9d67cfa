//! Analytics against a running daemon: every request a real client makes
//! (fio over NBD, qemu-io over iSCSI) is counted once in the heat map and
//! the statistics, under the right volume, protocol, operation and client;
//! `strata iostat` prints what they did.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

fn get(server: &common::Server, path: &str) -> Value {
    let response = common::http(&server.api, "GET", path, "");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {response}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
}

/// The sum of a JSON matrix of counts (rows of numbers).
fn matrix_sum(matrix: &Value) -> u64 {
    matrix
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap())
        .map(|c| c.as_u64().unwrap())
        .sum()
}

fn latest(server: &common::Server) -> u64 {
    get(server, "/v1/analytics")["latest"].as_u64().unwrap_or(0)
}

/// Waits until the daemon has collected the second now under way (and
/// so every request completed before this call).
fn settle(server: &common::Server) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let deadline = Instant::now() + Duration::from_secs(10);
    while latest(server) < now {
        assert!(Instant::now() < deadline, "no analytics frame for second {now}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn every_request_is_counted_once_by_volume_protocol_op_and_client() {
    common::require_tool("fio");
    common::require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    common::small_default_pool(dir.path());
    let server = common::Server::start(dir.path());
    server.create_volume("default/a", "64M");
    server.create_volume("default/b", "64M");
    let start = latest(&server).max(1);

    // fio over NBD: 4096 random 4K writes, then 2048 reads, exactly.
    let uri = server.uri("default/a");
    for (rw, size) in [("randwrite", "16M"), ("randread", "8M")] {
        let out = common::stdout_of(Command::new("fio").args([
            "--name=a",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            "--bs=4k",
            "--iodepth=16",
            &format!("--size={size}"),
            "--output-format=terse",
        ]));
        assert!(out.contains(';'), "fio: {out}");
    }
    // qemu-io over iSCSI: 10 writes of 64K and 5 reads, one request each.
    let target = "iqn.2026-11.io.strata:default.b";
    let mut commands: Vec<String> = (0..10).map(|i| format!("write -P 7 {} 64k", i * 65536)).collect();
    commands.extend((0..5).map(|i| format!("read -P 7 {} 64k", i * 65536)));
    let mut qemu = Command::new("qemu-io");
    qemu.args(["-f", "raw", &format!("iscsi://{}/{target}/0", server.iscsi)]);
    for c in &commands {
        qemu.args(["-c", c]);
    }
    common::stdout_of(&mut qemu);
    settle(&server);
    let to = latest(&server);

    let stats = get(
        &server,
        &format!("/v1/analytics/stats?from={start}&to={to}&by=volume,protocol,op&top=100"),
    );
    let ops = |volume: &str, protocol: &str, op: &str| -> u64 {
        stats["breakdown"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["key"]["volume"] == volume && e["key"]["protocol"] == protocol && e["key"]["op"] == op)
            .map_or(0, |e| e["ops"].as_u64().unwrap())
    };
    assert_eq!(ops("default/a", "nbd", "write"), 4096, "{stats:#}");
    assert_eq!(ops("default/a", "nbd", "read"), 2048, "{stats:#}");
    assert_eq!(ops("default/b", "iscsi", "write"), 10, "{stats:#}");
    assert_eq!(ops("default/b", "iscsi", "read"), 5, "{stats:#}");
    let b_writes = stats["breakdown"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["key"]["volume"] == "default/b" && e["key"]["op"] == "write")
        .unwrap();
    assert_eq!(b_writes["bytes"].as_u64(), Some(10 * 65536));
    assert!(b_writes["p50_ns"].as_u64().unwrap() > 0);

    // The heat map counts the same requests, each once.
    let map = get(
        &server,
        &format!("/v1/analytics/heatmap?from={start}&to={to}&volume=default/a&by=op"),
    );
    let cells = matrix_sum(&map["counts"]);
    assert_eq!(cells, 4096 + 2048 + ops("default/a", "nbd", "flush"));
    let reads = map["series"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "read")
        .expect("a read series");
    let read_cells = matrix_sum(&reads["counts"]);
    assert_eq!(read_cells, 2048);
    assert_eq!(
        map["buckets"].as_array().unwrap().len(),
        map["counts"][0].as_array().unwrap().len()
    );

    // Clients: the NBD client by address, the iSCSI one by initiator name.
    let clients = get(&server, &format!("/v1/analytics/stats?from={start}&to={to}&by=client"));
    let names: Vec<&str> = clients["breakdown"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"127.0.0.1"), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("iqn.")), "{names:?}");

    // Offsets: the writes to volume b's first 640 KiB fall in its first region.
    let offsets = get(
        &server,
        &format!("/v1/analytics/offsets?volume=default/b&from={start}&to={to}"),
    );
    let first_region: u64 = offsets["writes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row[0].as_u64().unwrap())
        .sum();
    assert_eq!(first_region, 10);

    // Where the time went: reads never wait for log commits; on a
    // sync=always volume (below) writes do.
    let commit_reads = get(
        &server,
        &format!("/v1/analytics/stats?from={start}&to={to}&volume=default/a&op=read&phase=commit"),
    );
    assert_eq!(commit_reads["ops"].as_u64(), Some(0), "{commit_reads:#}");
    let queued = get(
        &server,
        &format!("/v1/analytics/stats?from={start}&to={to}&volume=default/a&op=read&phase=queued"),
    );
    assert!(queued["ops"].as_u64().unwrap() > 0, "{queued:#}");
    server.create_volume("default/c", "64M");
    server.set_property("default/c", "sync", "always");
    common::stdout_of(Command::new("fio").args([
        "--name=c",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri("default/c")),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=4",
        "--size=2M",
        "--output-format=terse",
    ]));
    settle(&server);
    let to = latest(&server);
    let all = get(
        &server,
        &format!("/v1/analytics/stats?from={start}&to={to}&volume=default/c&op=write"),
    );
    assert_eq!(all["ops"].as_u64(), Some(512), "{all:#}");
    let waited = get(
        &server,
        &format!("/v1/analytics/stats?from={start}&to={to}&volume=default/c&op=write&phase=commit"),
    );
    let waits = waited["ops"].as_u64().unwrap();
    assert!(
        (460..=512).contains(&waits),
        "{waits} of 512 synchronous writes waited for a commit"
    );
    assert!(waited["p50_ns"].as_u64().unwrap() <= all["p99_ns"].as_u64().unwrap());

    // Prometheus carries what the dashboard shows of the pool.
    let metrics = common::http(&server.api, "GET", "/metrics", "");
    let value = |series: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{series} is not in /metrics"))
    };
    let commits = value("strata_pool_log_commits_total{pool=\"default\"}");
    let records = value("strata_pool_log_records_total{pool=\"default\"}");
    assert!(
        commits > 0.0 && records >= commits,
        "{commits} commits, {records} records"
    );
    assert!(value("strata_pool_dirty_max_bytes{pool=\"default\"}") > 0.0);
    // Present (`value` fails the test if not); these reads were all of data
    // still in the write-back cache, so the read cache saw none of them.
    value("strata_pool_read_cache_hits_total{pool=\"default\"}");
    value("strata_pool_read_cache_misses_total{pool=\"default\"}");
    // The block-map and checksum page caches take a quarter of the pool's
    // RAM (512 MiB by default), half each: 2 KiB map pages, 4 KiB checksum
    // pages. These writes used map pages, and the first use of a page is a
    // miss (read from the store, or made empty).
    assert_eq!(value("strata_pool_map_cache_max_pages{pool=\"default\"}"), 32768.0);
    assert_eq!(value("strata_pool_checksum_cache_max_pages{pool=\"default\"}"), 16384.0);
    assert!(value("strata_pool_map_cache_pages{pool=\"default\"}") > 0.0);
    assert!(value("strata_pool_map_cache_misses_total{pool=\"default\"}") > 0.0);
    value("strata_pool_checksum_cache_misses_total{pool=\"default\"}");
    // The shared locks' waits are counted (how many depends on timing).
    for lock in ["allocator", "log"] {
        value(&format!("strata_pool_{lock}_lock_waits_total{{pool=\"default\"}}"));
        value(&format!(
            "strata_pool_{lock}_lock_wait_microseconds_total{{pool=\"default\"}}"
        ));
    }
    assert!(
        metrics.contains("strata_device_used_bytes{pool=\"default\""),
        "{metrics}"
    );
    assert!(metrics.contains("role=\"fast\""), "{metrics}");

    // Bad parameters get a 400 with a message.
    let bad = common::http(&server.api, "GET", "/v1/analytics/stats?by=colour", "");
    assert!(bad.starts_with("HTTP/1.1 400") && bad.contains("colour"), "{bad}");
    let phase = common::http(&server.api, "GET", "/v1/analytics/stats?phase=disk", "");
    assert!(phase.starts_with("HTTP/1.1 400") && phase.contains("phase"), "{phase}");
    let typo = common::http(&server.api, "GET", "/v1/analytics/stats?volumes=x", "");
    assert!(typo.starts_with("HTTP/1.1 400"), "{typo}");
}

#[test]
fn iostat_prints_a_report_per_interval() {
    common::require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    common::small_default_pool(dir.path());
    let server = common::Server::start(dir.path());
    server.create_volume("default/io", "64M");
    let mut fio = Command::new("fio")
        .args([
            "--name=io",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri("default/io")),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=4",
            "--size=64M",
            "--time_based",
            "--runtime=8",
            "--output-format=terse",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();
    let out = common::cli_ok(&server, &["iostat", "-v", "default/io", "1", "3"]);
    let took = started.elapsed();
    fio.wait().unwrap();
    // Three reports, a second apart.
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(8),
        "{took:?}"
    );
    let reports: Vec<&str> = out.split("\n\n").filter(|r| !r.trim().is_empty()).collect();
    assert_eq!(reports.len(), 3, "{out}");
    for report in reports {
        let lines: Vec<&str> = report.lines().collect();
        let header: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(
            header,
            [
                "volume",
                "read/s",
                "write/s",
                "rbytes/s",
                "wbytes/s",
                "read_p50",
                "read_p99",
                "write_p50",
                "write_p99"
            ]
        );
        let volume: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(volume[0], "default/io", "{report}");
        assert_eq!(volume.len(), 9, "{report}");
        // Reads and writes per second: counts like "812" or "1.2K".
        for cell in &volume[1..3] {
            let number: f64 = cell.trim_end_matches(['K', 'M']).parse().unwrap_or(0.0);
            assert!(number > 0.0, "no requests counted in: {report}");
        }
        assert!(volume[5].ends_with('s') && volume[5] != "-", "{report}");
        // -v: the NBD client's line under its volume.
        let client: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(&client[..2], ["nbd", "127.0.0.1"], "{report}");
    }
}

/// `GET /openapi.json` (no token needed) is a valid OpenAPI 3 document
/// (openapi-spec-validator) that describes every endpoint `GET /v1` lists.
#[test]
fn the_openapi_document_is_valid_and_covers_every_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    common::small_default_pool(dir.path());
    let server = common::Server::start(dir.path());
    let mut stream = std::net::TcpStream::connect(&server.api).unwrap();
    use std::io::{Read, Write};
    write!(
        stream,
        "GET /openapi.json HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        server.api
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let doc: Value = serde_json::from_str(body).unwrap();
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, body).unwrap();
    let validated = Command::new("python3")
        .args(["-m", "openapi_spec_validator"])
        .arg(&file)
        .output()
        .expect("python3");
    assert!(
        validated.status.success(),
        "openapi-spec-validator: {}{}",
        String::from_utf8_lossy(&validated.stdout),
        String::from_utf8_lossy(&validated.stderr)
    );
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for endpoint in strata::admin::api::ENDPOINTS {
        let (method, path) = endpoint.split_once(' ').unwrap();
        let path = path
            .split(['[', '?'])
            .next()
            .unwrap()
            .replace("{name}@{snapshot}", "{name}");
        let operation = &doc["paths"][path.as_str()][method.to_lowercase()];
        assert!(operation.is_object(), "{endpoint} is not in /openapi.json");
        assert!(operation["responses"].is_object(), "{endpoint} has no responses");
    }
    // And the live answers match what it says of one of them.
    let volume = get(&server, "/v1/volumes/default/vol0");
    let schema = &doc["components"]["schemas"]["VolumeInfo"]["properties"];
    for field in volume.as_object().unwrap().keys() {
        assert!(schema.get(field).is_some(), "VolumeInfo.{field} is not described");
    }
}
