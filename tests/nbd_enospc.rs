//! Running a pool out of space over NBD: a small pool made with `strata pool
//! create`, a thin volume larger than the pool filled by a real client until
//! a write fails. The failing request gets ENOSPC (never EIO), acknowledged
//! data stays readable, the pool's other volume and the server keep working,
//! and TRIM or deleting a volume makes room again.

mod common;

use common::{cli, cli_ok, qemu_io, qemu_io_ok, require_tool, Server};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const MIB: u64 = 1 << 20;
/// Data space of the pool: a fast file of chunk 0 + 32 MiB metadata + 64 MiB
/// log + 16 MiB, and a capacity file of chunk 0 + 16 MiB (1 MiB chunks).
const FAST_FILE: u64 = 97 * MIB + 16 * MIB;
const CAPACITY_FILE: u64 = MIB + 16 * MIB;
const POOL_DATA: u64 = 32 * MIB;
/// Written to `tank/other` before the pool fills.
const OTHER_DATA: u64 = 2 * MIB;
const ENOSPC: u32 = 28;

fn pool_json(server: &Server) -> serde_json::Value {
    common::pool_json(server, "tank")
}

use common::fill_pattern as pattern;

/// A minimal NBD client (fixed newstyle, NBD_OPT_EXPORT_NAME, simple
/// replies), to see the exact error number on the wire.
struct Nbd {
    stream: TcpStream,
    cookie: u64,
}

impl Nbd {
    fn connect(address: &str, export: &str) -> Nbd {
        const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
        let mut stream = TcpStream::connect(address).expect("connect to NBD");
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        // Client flags: fixed newstyle, no zeroes; then NBD_OPT_EXPORT_NAME.
        let mut out = 3u32.to_be_bytes().to_vec();
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&1u32.to_be_bytes());
        out.extend_from_slice(&(export.len() as u32).to_be_bytes());
        out.extend_from_slice(export.as_bytes());
        stream.write_all(&out).unwrap();
        let mut answer = [0u8; 10];
        stream.read_exact(&mut answer).expect("export size and flags");
        Nbd { stream, cookie: 0 }
    }

    /// Sends one request and returns (error, read payload).
    fn request(&mut self, kind: u16, offset: u64, length: u32, payload: &[u8]) -> (u32, Vec<u8>) {
        self.cookie += 1;
        let mut out = 0x2560_9513u32.to_be_bytes().to_vec();
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(payload);
        self.stream.write_all(&out).unwrap();
        let mut reply = [0u8; 16];
        self.stream.read_exact(&mut reply).expect("NBD reply");
        assert_eq!(u32::from_be_bytes(reply[..4].try_into().unwrap()), 0x6744_6698);
        assert_eq!(u64::from_be_bytes(reply[8..16].try_into().unwrap()), self.cookie);
        let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
        let mut data = Vec::new();
        if kind == 0 && error == 0 {
            data = vec![0u8; length as usize];
            self.stream.read_exact(&mut data).unwrap();
        }
        (error, data)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.request(1, offset, data.len() as u32, data).0
    }

    fn read(&mut self, offset: u64, length: u32) -> Vec<u8> {
        let (error, data) = self.request(0, offset, length, &[]);
        assert_eq!(error, 0, "read at {offset}");
        data
    }

    fn flush(&mut self) -> u32 {
        self.request(3, 0, 0, &[]).0
    }
}

#[test]
fn a_full_pool_fails_only_the_writes_that_need_space() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let fast = common::sparse_file(dir.path(), "fast.img", FAST_FILE);
    let capacity = common::sparse_file(dir.path(), "capacity.img", CAPACITY_FILE);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    cli_ok(
        &server,
        &["pool", "create", "tank", "--fast", &fast, "--capacity", &capacity],
    );
    assert_eq!(pool_json(&server)["size_bytes"], POOL_DATA);
    // A thin volume 32 times larger than the pool, and a small one.
    cli_ok(&server, &["volume", "create", "tank/big", "--size", "1G"]);
    cli_ok(&server, &["volume", "create", "tank/other", "--size", "64M"]);
    let big = server.uri("tank/big");
    let other = server.uri("tank/other");
    qemu_io_ok(&other, &[format!("write -P 0x0f 0 {OTHER_DATA}"), "flush".into()]);

    // Fill tank/big 1 MiB at a time, one client each, until a write fails.
    let (acknowledged, failure) = common::fill_until_failure(&big, POOL_DATA / MIB);
    eprintln!("{acknowledged} MiB acknowledged before the pool was full; then:\n{failure}");
    assert!(
        failure.contains("No space left on device"),
        "a write into a full pool must fail with ENOSPC:\n{failure}"
    );
    assert!(!failure.contains("Input/output error"), "{failure}");
    // The error came when the pool was really full, not early.
    assert!(acknowledged * MIB + OTHER_DATA <= POOL_DATA);
    let status = pool_json(&server);
    assert!(
        status["available_bytes"].as_u64().unwrap() < MIB,
        "ENOSPC with space left: {status}"
    );

    // The exact error number on the wire, for full and partial sectors, and
    // it is always the same answer (nothing becomes EIO).
    let mut raw = Nbd::connect(&server.nbd, "tank/big");
    for (offset, length) in [(900 * MIB, 4096usize), (901 * MIB + 512, 512), (902 * MIB, 1 << 20)] {
        assert_eq!(
            raw.write(offset, &vec![0x99; length]),
            ENOSPC,
            "write {length} at {offset}"
        );
    }
    // Writes into space already allocated need none, and a flush works.
    assert_eq!(raw.write(4096, &[0xa5; 4096]), 0);
    assert_eq!(raw.write(3 * MIB + 512, &[0xa6; 512]), 0, "sub-sector overwrite");
    assert_eq!(raw.flush(), 0, "flush on a full pool");
    assert_eq!(raw.read(4096, 4096), vec![0xa5; 4096]);
    assert_eq!(
        raw.read(900 * MIB, 4096),
        vec![0; 4096],
        "the failed write left nothing"
    );
    drop(raw);

    // Every acknowledged write reads back.
    let mut reads: Vec<String> = (1..acknowledged)
        .filter(|&i| i != 3)
        .map(|i| format!("read -P {:#x} {} {MIB}", pattern(i), i * MIB))
        .collect();
    // Around the two overwrites.
    reads.push(format!("read -P {:#x} 0 4096", pattern(0)));
    reads.push(format!("read -P {:#x} 8192 {}", pattern(0), MIB - 8192));
    reads.push(format!("read -P {:#x} {} 512", pattern(3), 3 * MIB));
    reads.push(format!("read -P {:#x} {} {}", pattern(3), 3 * MIB + 1024, MIB - 1024));
    reads.push("read -P 0xa5 4096 4096".into());
    reads.push(format!("read -P 0xa6 {} 512", 3 * MIB + 512));
    qemu_io_ok(&big, &reads);

    // The other volume: overwrites and reads work; it cannot grow either.
    qemu_io_ok(
        &other,
        &[
            format!("write -P 0x1e 0 {OTHER_DATA}"),
            "flush".into(),
            format!("read -P 0x1e 0 {OTHER_DATA}"),
        ],
    );
    let (_, text) = qemu_io(&other, &["write -P 0x1f 32M 64k".into()]);
    assert!(text.contains("No space left on device"), "{text}");
    // The server answers on every interface; the default pool is unaffected.
    assert!(common::http(&server.api, "GET", "/v1/pools", "").starts_with("HTTP/1.1 200"));
    qemu_io_ok(
        &server.uri("default/vol0"),
        &["write -P 0x33 0 1M".into(), "read -P 0x33 0 1M".into()],
    );

    // TRIM makes room once the free is committed (the flush).
    qemu_io_ok(&big, &["discard 0 4M".into(), "flush".into()]);
    let status = pool_json(&server);
    assert!(status["available_bytes"].as_u64().unwrap() >= 4 * MIB, "{status}");
    qemu_io_ok(
        &big,
        &[
            "write -P 0x71 500M 4M".into(),
            "flush".into(),
            "read -P 0x71 500M 4M".into(),
            "read -P 0 0 4M".into(),
        ],
    );
    // Deleting a volume makes room too.
    let (_, text) = qemu_io(&big, &["write -P 0x72 600M 1M".into()]);
    assert!(text.contains("No space left on device"), "full again: {text}");
    cli_ok(&server, &["volume", "delete", "tank/other"]);
    qemu_io_ok(
        &big,
        &[
            format!("write -P 0x72 600M {OTHER_DATA}"),
            "flush".into(),
            format!("read -P 0x72 600M {OTHER_DATA}"),
        ],
    );

    // A clean restart keeps all of it.
    assert!(server.stop().success(), "clean shutdown after ENOSPC");
    let server = Server::start(&data);
    let big = server.uri("tank/big");
    let mut reads: Vec<String> = (4..acknowledged)
        .map(|i| format!("read -P {:#x} {} {MIB}", pattern(i), i * MIB))
        .collect();
    reads.push("read -P 0 0 4M".into());
    reads.push("read -P 0x71 500M 4M".into());
    reads.push(format!("read -P 0x72 600M {OTHER_DATA}"));
    qemu_io_ok(&big, &reads);
    let status = pool_json(&server);
    assert_eq!(status["volumes"], 1, "{status}");
}

/// The file system under the pool fills before the pool does (sparse
/// device files on a 160 MiB tmpfs, a pool of 400 MiB): the write that
/// needs space gets ENOSPC, never EIO; the device does not turn read-only
/// (overwrites of written blocks keep working); after a TRIM the freed
/// places take new writes, with no restart; a kill -9 loses nothing
/// acknowledged.
#[test]
fn a_full_file_system_under_the_pool_fails_only_the_writes_that_need_space() {
    require_tool("qemu-io");
    let small = common::SmallFs::mount();
    let (data, ram, log, fast) = (&small.data, &small.ram, &small.log, &small.fast);
    let mut server = Server::start_logged(data, Some(ram), &[], Some(log));
    let created = cli(&server, &["pool", "create", "tank", "--fast", fast]);
    assert!(created.status.success());
    let said = String::from_utf8_lossy(&created.stderr);
    assert!(
        said.contains("warning:") && said.contains("more than it can hold"),
        "pool create said: {said}"
    );
    cli_ok(&server, &["volume", "create", "tank/big", "--size", "1G"]);
    let big = server.uri("tank/big");

    // Seen coming before anything is written: the sparse device may grow
    // by more than its file system holds.
    let status = cli_ok(&server, &["pool", "status", "tank"]);
    assert!(
        status.contains("warning:") && status.contains("will fail with ENOSPC"),
        "{status}"
    );
    let device = &pool_json(&server)["devices"][0];
    let free = device["backing"]["fs_free_bytes"]
        .as_u64()
        .expect("backing space in pool status --json");
    assert!(
        free < 160 * MIB && device["unbackable_bytes"].as_u64().unwrap() > 0,
        "{device}"
    );
    // The log (64 MiB) and the metadata region (32 MiB here: smaller than
    // the store's headroom) are allocated on the file system from the
    // start: they never need space that may not be there.
    assert!(
        device["backing"]["backed_bytes"].as_u64().unwrap() >= 64 * MIB + 32 * MIB,
        "{device}"
    );
    let metrics = common::http(&server.api, "GET", "/metrics", "");
    assert!(
        metrics.contains("strata_device_fs_free_bytes{pool=\"tank\""),
        "{metrics}"
    );
    assert!(
        metrics.contains("strata_device_unbackable_bytes{pool=\"tank\""),
        "{metrics}"
    );
    common::wait_for_log(log, "will fail with ENOSPC");

    let acknowledged = common::fill_full_fs(&server, &big);

    // Still full: the same answer again, never EIO.
    let mut raw = Nbd::connect(&server.nbd, "tank/big");
    assert_eq!(raw.write(900 * MIB, &vec![0x99; 1 << 20]), ENOSPC);
    // Overwrites of written blocks need no new space: they work, and the
    // device did not turn read-only.
    assert_eq!(raw.write(0, &vec![0x77; 1 << 20]), 0);
    assert_eq!(raw.flush(), 0);
    assert!(raw.read(0, 4096).iter().all(|&b| b == 0x77));
    // Small writes, which the RAM cache would take, into new space: they
    // fail now rather than being acknowledged into RAM with no place to go;
    // small overwrites still work, and nothing is left dirty that a flush
    // or `pool sync` could not place.
    // (The file system may still have a few pages: the first ones can
    // succeed, and must then read back.)
    let mut placed = Vec::new();
    for i in 0..64 {
        match raw.write(700 * MIB + i * 65536, &[0x44; 4096]) {
            0 => placed.push(i),
            error => assert_eq!(error, ENOSPC, "small write {i}"),
        }
    }
    assert!(placed.len() < 64, "every small write into new space succeeded");
    for i in 0..64 {
        assert_eq!(raw.write(i * 4096, &[0x77; 4096]), 0, "small overwrite {i}");
    }
    assert_eq!(raw.flush(), 0);
    cli_ok(&server, &["pool", "sync", "tank"]);
    for i in placed {
        assert!(raw.read(700 * MIB + i * 65536, 4096).iter().all(|&b| b == 0x44));
    }
    assert_eq!(pool_json(&server)["cache"]["dirty_bytes"].as_u64(), Some(0));
    drop(raw);
    qemu_io_ok(&big, &[format!("read -P {:#x} {MIB} {MIB}", pattern(1))]);

    // TRIM frees places; new writes take them, with no restart.
    qemu_io_ok(&big, &[format!("discard {} {}", 2 * MIB, 8 * MIB), "flush".into()]);
    qemu_io_ok(
        &big,
        &[format!("write -P 0x5a {} {}", 950 * MIB, 4 * MIB), "flush".into()],
    );

    // kill -9, restart: everything acknowledged is there.
    server.kill9();
    let server = Server::start_with_ram_dir(data, Some(ram));
    let big = server.uri("tank/big");
    qemu_io_ok(
        &big,
        &[
            "read -P 0x77 0 1M".into(),
            format!("read -P 0x5a {} {}", 950 * MIB, 4 * MIB),
        ],
    );
    for i in (1..2).chain(10..acknowledged) {
        qemu_io_ok(&big, &[format!("read -P {:#x} {} {MIB}", pattern(i), i * MIB)]);
    }
}

/// Small writes cached in RAM before the file system under the pool filled
/// find no place when they are destaged: they stay in the RAM cache and,
/// once flushed, in the intent log; `pool sync` says so, the shutdown says
/// so (not "all flushed"), the next start replays them, and once space is
/// freed they reach their place.
#[test]
fn cached_writes_that_find_no_place_stay_logged_and_the_shutdown_says_so() {
    require_tool("qemu-io");
    let small = common::SmallFs::mount();
    let mut server = Server::start_logged(&small.data, Some(&small.ram), &[], Some(&small.log));
    cli_ok(&server, &["pool", "create", "tank", "--fast", &small.fast]);
    cli_ok(&server, &["volume", "create", "tank/big", "--size", "1G"]);
    let mut raw = Nbd::connect(&server.nbd, "tank/big");
    // Into the RAM cache (new blocks, 4 KiB each), then into the log.
    for i in 0..64 {
        assert_eq!(raw.write(600 * MIB + i * 65536, &[0x61; 4096]), 0);
    }
    assert_eq!(raw.flush(), 0);
    // Large writes go to their place and fill the file system first.
    let mut filled = 0u64;
    while raw.write(filled * MIB, &vec![pattern(filled); MIB as usize]) == 0 {
        filled += 1;
        assert!(filled < 400, "wrote more than the file system holds");
    }
    assert!(filled >= 16, "the file system filled too early: {filled} MiB");
    assert_eq!(raw.flush(), 0, "everything acknowledged is logged or placed");
    drop(raw);
    let sync = cli(&server, &["pool", "sync", "tank"]);
    let said = String::from_utf8_lossy(&sync.stderr);
    assert!(
        !sync.status.success() && said.contains("stays in the RAM cache"),
        "pool sync: {said}"
    );

    let (status, said) = server.stop_saying();
    assert!(status.success(), "{status:?}: {said}");
    assert!(
        said.contains("not everything reached its place")
            && said.contains("pool tank:")
            && said.contains("the next start replays them")
            && !said.contains("all acknowledged writes flushed"),
        "the daemon's last words: {said}"
    );

    let mut server = Server::start_with_ram_dir(&small.data, Some(&small.ram));
    let big = server.uri("tank/big");
    let reads: Vec<String> = (0..64)
        .map(|i| format!("read -P 0x61 {} 4k", 600 * MIB + i * 65536))
        .chain((0..filled).map(|i| format!("read -P {:#x} {} {MIB}", pattern(i), i * MIB)))
        .collect();
    qemu_io_ok(&big, &reads);

    // Room again: the cached writes reach their place, and a stop says
    // everything was flushed.
    qemu_io_ok(&big, &[format!("discard 0 {}", 16 * MIB), "flush".into()]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !cli(&server, &["pool", "sync", "tank"]).status.success() {
        assert!(
            std::time::Instant::now() < deadline,
            "the cached writes found no place after a TRIM: {}\n{}",
            String::from_utf8_lossy(&cli(&server, &["pool", "sync", "tank"]).stderr),
            cli_ok(&server, &["pool", "status", "tank"])
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(pool_json(&server)["cache"]["dirty_bytes"].as_u64(), Some(0));
    let (status, said) = server.stop_saying();
    assert!(
        status.success() && said.contains("all acknowledged writes flushed"),
        "{status:?}: {said}"
    );
}
