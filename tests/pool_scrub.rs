//! Scrubbing a whole pool (`strata pool scrub`). At engine level, on
//! simulated devices: rot in one copy of a mirror is found and rewritten
//! from the other; rot on a single device is listed by volume and offset,
//! a snapshot's own blocks included; a paused scrub goes on from its
//! cursor and checks every block once. Under the daemon: `pool scrub
//! --wait` exits 0 on a clean pool and 1 naming the volume, offset and
//! dataset file of each block it could not repair, and mirror rot is
//! repaired and counted; a paused scrub outlives a restart and resumes;
//! clients keep reading and writing meanwhile.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::engine::{block_data, options, runtime, write_placed};
use common::{cli, cli_ok, qemu_io_ok, require_tool, run, Server};
use strata::block::{BlockDevice, IoBuf};
use strata::device::{Device, SimDevice};
use strata::pool::snapshots::SnapshotRequest;
use strata::pool::superblock::Role;
use strata::pool::volume::EngineVolume;
use strata::pool::{NewDevice, NewVdev, Pool, ScrubCommand, ScrubJob, ScrubState, ScrubStatus};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 64;

/// The test volume (id 1) of `pool`.
fn volume_of(pool: &Arc<Pool>) -> Arc<EngineVolume> {
    pool.open_volume(1, BLOCKS * BLOCK, BLOCK as u32).unwrap()
}

/// Blocks `blocks` written with round `round` and destaged to their places.
fn place_of(volume: &EngineVolume, block: u64) -> u64 {
    volume.block_place(block).unwrap().unwrap().1
}

/// A whole scrub run on `pool`, saved statuses ignored.
async fn scrub(pool: &Pool) -> ScrubStatus {
    let job = ScrubJob::new(ScrubStatus::new(0));
    pool.set_scrub_job(job.clone()).unwrap();
    pool.run_scrub(&job, Duration::from_secs(3600), &|_| {}).await;
    job.status()
}

#[test]
fn a_scrub_rewrites_rotten_copies_of_a_mirror_from_the_good_ones() {
    runtime().block_on(async {
        let sims = [SimDevice::new(160 * MIB, 1), SimDevice::new(160 * MIB, 2)];
        let vdevs = vec![NewVdev {
            role: Role::Fast,
            devices: sims.iter().map(|s| s.as_device()).collect::<Vec<Arc<dyn Device>>>(),
            write_mostly: Vec::new(),
        }];
        let pool = Pool::create_vdevs("m", 1 << 20, vdevs, options()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        // One sector of every block rots on the second copy, and one
        // sector of block 7 on the first: every block has a good copy.
        for block in 0..BLOCKS {
            sims[1].corrupt(place_of(&volume, block) + 4096, 512);
        }
        sims[0].corrupt(place_of(&volume, 7) + 8192, 512);
        let status = scrub(&pool).await;
        assert_eq!(status.state, ScrubState::Finished, "{status:?}");
        assert_eq!(status.errors, 0, "{status:?}");
        assert_eq!(status.issued_bytes, BLOCKS * BLOCK, "each block read once: {status:?}");
        // Checksums cover 4 KiB sectors: each rotten one is rewritten whole.
        assert_eq!(status.repaired_bytes, (BLOCKS + 1) * 4096, "{status:?}");
        let children = &pool.status()[0].children;
        assert_eq!(children[0].repaired_sectors, 1);
        assert_eq!(children[1].repaired_sectors, BLOCKS);
        // Both copies hold the data again, without a client having read it.
        for sim in &sims {
            let image = sim.snapshot();
            for block in 0..BLOCKS {
                let bytes = image.read(place_of(&volume, block), BLOCK as usize);
                assert!(bytes == block_data(BLOCK, block, 1), "block {block} not repaired");
            }
        }
        // A second scrub finds nothing left to repair.
        let again = scrub(&pool).await;
        assert_eq!((again.errors, again.repaired_bytes), (0, 0), "{again:?}");
    });
}

#[test]
fn rot_on_a_single_device_is_listed_by_volume_and_offset_snapshots_too() {
    runtime().block_on(async {
        let sim = SimDevice::new(160 * MIB, 1);
        let devices = vec![NewDevice {
            device: sim.as_device(),
            role: Role::Fast,
        }];
        let pool = Pool::create_with("s", 1 << 20, devices, options()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        let snapshot = pool
            .create_snapshots(&[SnapshotRequest {
                volume: &volume,
                name: "before".into(),
            }])
            .await
            .unwrap()[0]
            .id;
        // Block 3's old copy is the snapshot's alone once it is rewritten.
        let old_place = place_of(&volume, 3);
        write_placed(&pool, &volume, BLOCK, 0..8, 2).await;
        assert_ne!(place_of(&volume, 3), old_place);
        sim.corrupt(old_place + 512, 512);
        sim.corrupt(place_of(&volume, 40) + 60_000, 100);
        let status = scrub(&pool).await;
        assert_eq!(status.state, ScrubState::Finished);
        assert_eq!(status.errors, 2, "{status:?}");
        assert_eq!(status.issued_bytes, (BLOCKS + 8) * BLOCK, "{status:?}");
        let mut found: Vec<(u32, Option<u32>, u64, u64)> = status
            .faults
            .iter()
            .map(|f| (f.volume, f.snapshot, f.offset, f.length))
            .collect();
        found.sort();
        assert_eq!(
            found,
            [(1, None, 40 * BLOCK, BLOCK), (1, Some(snapshot), 3 * BLOCK, BLOCK)]
        );
        assert!(status.faults.iter().all(|f| !f.device.is_empty()));
        // The errors are counted on the device, as a read's would be, and
        // a client reading the live block still gets EIO, never garbage.
        assert_eq!(pool.status()[0].checksum_errors, 2);
        let (_, result) = volume.read(40 * BLOCK, IoBuf::new(BLOCK as usize)).await;
        assert!(result.is_err());
    });
}

#[test]
fn a_paused_scrub_goes_on_from_its_cursor_and_checks_every_block_once() {
    runtime().block_on(async {
        let sim = SimDevice::new(160 * MIB, 1);
        let devices = vec![NewDevice {
            device: sim.as_device(),
            role: Role::Fast,
        }];
        let pool = Pool::create_with("p", 1 << 20, devices, options()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        pool.create_snapshots(&[SnapshotRequest {
            volume: &volume,
            name: "before".into(),
        }])
        .await
        .unwrap();
        let old_place = place_of(&volume, 3);
        write_placed(&pool, &volume, BLOCK, 0..8, 2).await;
        // Rot at both ends of the volume and in a block only the snapshot
        // keeps: found before and after the pause.
        sim.corrupt(place_of(&volume, 0) + 1024, 512);
        sim.corrupt(place_of(&volume, BLOCKS - 1) + 1024, 512);
        sim.corrupt(old_place + 1024, 512);
        // Batches of 5 slots, so the walk crosses many, and paused as soon
        // as a third of the slots are checked (statuses are saved after
        // every run here), likely within a batch.
        let slots = BLOCKS + 8;
        let job = ScrubJob::with_batch(ScrubStatus::new(0), 5);
        pool.set_scrub_job(job.clone()).unwrap();
        let saved: Mutex<Vec<ScrubStatus>> = Mutex::new(Vec::new());
        let pausing = job.clone();
        pool.run_scrub(&job, Duration::ZERO, &|s| {
            saved.lock().unwrap().push(s.clone());
            if s.issued_bytes > slots / 3 * BLOCK {
                pausing.command(ScrubCommand::Pause);
            }
        })
        .await;
        let paused = job.status();
        assert_eq!(paused.state, ScrubState::Paused);
        assert!(
            paused.issued_bytes > 0 && paused.issued_bytes < slots * BLOCK,
            "{paused:?}"
        );
        assert_eq!(saved.lock().unwrap().last(), Some(&paused), "the pause is saved");
        // The paused one's status, handed to a new job (as after a
        // restart), resumes from its cursor.
        let resumed = ScrubJob::with_batch(paused.clone(), 5);
        pool.set_scrub_job(resumed.clone()).unwrap();
        pool.run_scrub(&resumed, Duration::from_secs(3600), &|_| {}).await;
        let done = resumed.status();
        assert_eq!(done.state, ScrubState::Finished, "{done:?}");
        assert_eq!(done.issued_bytes, slots * BLOCK, "every slot once: {done:?}");
        assert_eq!(done.errors, 3, "{done:?}");
        let mut found: Vec<(Option<u32>, u64)> = done.faults.iter().map(|f| (f.snapshot, f.offset)).collect();
        found.sort();
        assert_eq!(found.len(), 3);
        assert_eq!(found[0], (None, 0));
        assert_eq!(found[1], (None, (BLOCKS - 1) * BLOCK));
        assert_eq!(found[2].1, 3 * BLOCK);
        assert!(found[2].0.is_some(), "{found:?}");
        assert!(done.ended_unix.is_some());
        // The same walk in one go, in batches of the default size, checks
        // the same slots.
        let whole = scrub(&pool).await;
        assert_eq!((whole.issued_bytes, whole.errors), (slots * BLOCK, 3), "{whole:?}");
    });
}

#[test]
fn a_scrub_cannot_start_beside_one_that_scans() {
    runtime().block_on(async {
        let sim = SimDevice::new(160 * MIB, 1);
        let devices = vec![NewDevice {
            device: sim.as_device(),
            role: Role::Fast,
        }];
        let pool = Pool::create_with("b", 1 << 20, devices, options()).await.unwrap();
        let scanning = ScrubJob::new(ScrubStatus::new(0));
        pool.set_scrub_job(scanning).unwrap();
        let error = pool.set_scrub_job(ScrubJob::new(ScrubStatus::new(0))).unwrap_err();
        assert!(error.to_string().contains("already being scrubbed"), "{error}");
    });
}

// ---------------------------------------------------------------------------
// Under the daemon

/// The first 4 KiB-aligned offset of `file` whose 4 KiB all hold `byte`.
fn find_block(file: &str, byte: u8) -> u64 {
    let image = std::fs::read(file).unwrap();
    image
        .chunks(4096)
        .position(|c| c.iter().all(|&b| b == byte))
        .map(|i| i as u64 * 4096)
        .unwrap_or_else(|| panic!("{file} holds no block of {byte:#x}"))
}

fn rot(file: &str, offset: u64, length: usize) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(&vec![0x11; length], offset).unwrap();
    f.sync_all().unwrap();
}

fn scrub_json(server: &Server, pool: &str) -> serde_json::Value {
    common::pool_json(server, pool)["scrub"].clone()
}

#[test]
fn pool_scrub_exits_0_when_clean_and_1_naming_every_block_it_cannot_repair() {
    require_tool("qemu-io");
    require_tool("nfs-cp");
    let dir = tempfile::tempdir().unwrap();
    let a = common::sparse_file(dir.path(), "a.img", 256 << 20);
    let b = common::sparse_file(dir.path(), "b.img", 256 << 20);
    let c = common::sparse_file(dir.path(), "c.img", 256 << 20);
    let data = dir.path().join("data");
    let server = Server::start(&data);
    // A mirror, and a single device with no copy.
    let mirror = format!("mirror:{a},{b}");
    cli_ok(&server, &["pool", "create", "tank", "--fast", &mirror]);
    cli_ok(&server, &["pool", "create", "solo", "--fast", &c]);
    server.create_volume("tank/v", "32M");
    server.create_volume("solo/v", "32M");
    qemu_io_ok(&server.uri("tank/v"), &["write -P 0xab 0 16M".into(), "flush".into()]);
    qemu_io_ok(&server.uri("solo/v"), &["write -P 0xcd 0 16M".into(), "flush".into()]);
    // A file in a dataset of the single-device pool.
    cli_ok(&server, &["fs", "create", "solo/files"]);
    let file = dir.path().join("f.bin");
    std::fs::write(&file, vec![0x5a; 200_000]).unwrap();
    let port = server
        .nfs
        .as_deref()
        .and_then(|a| a.rsplit(':').next())
        .unwrap()
        .to_string();
    let url = format!("nfs://127.0.0.1/solo/files/sub.bin?nfsport={port}&mountport={port}&version=3");
    run(std::process::Command::new("nfs-cp").arg(&file).arg(&url));
    cli_ok(&server, &["pool", "sync", "tank"]);
    cli_ok(&server, &["pool", "sync", "solo"]);

    // Clean: exit 0, every byte of the volume checked.
    let said = cli_ok(&server, &["pool", "scrub", "tank", "--wait"]);
    assert!(
        said.contains("pool tank: scrubbed 16M") && said.contains("0 errors"),
        "{said}"
    );
    assert_eq!(scrub_json(&server, "tank")["state"], "finished");

    // Rot across two 4 KiB sectors of copy a: repaired from b, counted,
    // exit 0.
    let at = find_block(&a, 0xab);
    rot(&a, at + (1 << 20) - 512, 1024);
    let said = cli_ok(&server, &["pool", "scrub", "tank", "--wait"]);
    assert!(said.contains("8K repaired, 0 errors"), "{said}");
    let status = common::pool_json(&server, "tank");
    assert_eq!(status["devices"][0]["children"][0]["repaired_sectors"], 2, "{status}");
    assert_eq!(status["scrub"]["repaired_bytes"], 8192, "{status}");
    qemu_io_ok(&server.uri("tank/v"), &["read -P 0xab 0 16M".into()]);

    // Rot on the single device, in the volume and in the file: exit 1,
    // each named.
    let volume_at = find_block(&c, 0xcd);
    rot(&c, volume_at + (5 << 20) + 100, 10);
    let file_at = find_block(&c, 0x5a);
    rot(&c, file_at + 70_000, 10);
    let out = cli(&server, &["pool", "scrub", "solo", "--wait"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("2 errors"), "{stdout}");
    assert!(stdout.contains("pool solo: unrepaired: solo/v at offset "), "{stdout}");
    assert!(
        stdout.contains("pool solo: unrepaired: solo/files (file /sub.bin) at offset 65536"),
        "{stdout}"
    );
    assert_eq!(
        stderr.trim(),
        "strata: error: pool solo: 2 blocks could not be repaired"
    );
    // The volume's fault lies where the rot is: 5 MiB past where the volume
    // starts on c (its blocks are laid out in order).
    let faults = scrub_json(&server, "solo")["faults"].clone();
    let volume_fault = faults
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "solo/v")
        .unwrap()
        .clone();
    let offset = volume_fault["offset"].as_u64().unwrap();
    let length = volume_fault["length"].as_u64().unwrap();
    assert!(offset <= 5 << 20 && 5 << 20 < offset + length, "{volume_fault}");
    // `pool status` shows the last scrub and its findings.
    let status = cli_ok(&server, &["pool", "status", "solo"]);
    assert!(
        status.contains("pool solo: scrubbed") && status.contains("unrepaired: solo/v"),
        "{status}"
    );
    // A bad request is one clear line.
    let out = cli(&server, &["pool", "scrub", "solo", "--pause"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("strata: error: ") && stderr.trim().lines().count() == 1,
        "{stderr}"
    );
    let out = cli(&server, &["pool", "scrub", "nosuch"]);
    assert_eq!(out.status.code(), Some(1));
}

/// A running daemon with pool `tank` on one 256 MiB file device (its path
/// returned) and volume `tank/v` of `size`, its first `written` bytes
/// (qemu-io's notation) written with `pattern` and synced to the device.
fn written_pool(dir: &Path, data: &Path, size: &str, pattern: u8, written: &str) -> (Server, String) {
    let a = common::sparse_file(dir, "a.img", 256 << 20);
    let server = Server::start(data);
    cli_ok(&server, &["pool", "create", "tank", "--fast", &a]);
    server.create_volume("tank/v", size);
    qemu_io_ok(
        &server.uri("tank/v"),
        &[format!("write -P {pattern:#x} 0 {written}"), "flush".into()],
    );
    cli_ok(&server, &["pool", "sync", "tank"]);
    (server, a)
}

#[test]
fn a_paused_scrub_outlives_a_restart_and_clients_go_on_while_it_runs() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut server, a) = written_pool(dir.path(), &data, "96M", 0x31, "64M");
    assert!(server.stop().success());
    // Reads of a at 8 MiB/s: the scrub of 64 MiB takes about 8 s.
    let wrap = format!("{a}=throttle:bw=8M");
    let mut server = Server::start_with_args(&data, Some(&data), &["--wrap", &wrap]);
    cli_ok(&server, &["pool", "scrub", "tank"]);
    // A second start is refused while it runs.
    let out = cli(&server, &["pool", "scrub", "tank"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already being scrubbed"));
    // Clients write and read meanwhile.
    qemu_io_ok(
        &server.uri("tank/v"),
        &[
            "write -P 0x32 64M 4M".into(),
            "flush".into(),
            "read -P 0x31 0 1M".into(),
        ],
    );
    std::thread::sleep(Duration::from_secs(2));
    let said = cli_ok(&server, &["pool", "scrub", "tank", "--pause"]);
    assert!(said.contains("pool tank: scrub paused at"), "{said}");
    let paused = scrub_json(&server, "tank");
    assert_eq!(paused["state"], "paused", "{paused}");
    let issued = paused["issued_bytes"].as_u64().unwrap();
    assert!(issued > 0 && issued < 64 << 20, "{paused}");
    // The pause is kept in the pool's directory and outlives a restart;
    // started again, the scrub goes on from its cursor.
    assert!(server.stop().success());
    let server = Server::start(&data);
    let kept = scrub_json(&server, "tank");
    assert_eq!(kept["state"], "paused", "{kept}");
    assert_eq!(kept["cursor"], paused["cursor"], "{kept}");
    let said = cli_ok(&server, &["pool", "scrub", "tank", "--wait"]);
    assert!(said.contains("0 errors"), "{said}");
    let done = scrub_json(&server, "tank");
    assert_eq!(done["state"], "finished", "{done}");
    // Every block once: what was written before and during the scrub.
    assert_eq!(done["issued_bytes"].as_u64().unwrap(), 68 << 20, "{done}");
    qemu_io_ok(
        &server.uri("tank/v"),
        &["read -P 0x31 0 64M".into(), "read -P 0x32 64M 4M".into()],
    );
}

#[test]
fn a_scrub_cut_by_a_kill_resumes_after_the_restart() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut server, a) = written_pool(dir.path(), &data, "96M", 0x41, "80M");
    assert!(server.stop().success());
    // 80 MiB at 8 MiB/s: the status is saved 5 s in, the kill comes at 7 s.
    let wrap = format!("{a}=throttle:bw=8M");
    let mut server = Server::start_with_args(&data, Some(&data), &["--wrap", &wrap]);
    cli_ok(&server, &["pool", "scrub", "tank"]);
    std::thread::sleep(Duration::from_secs(7));
    server.kill9();
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("pools/tank/scrub.json")).unwrap()).unwrap();
    assert_eq!(saved["state"], "scanning", "{saved}");
    let issued = saved["issued_bytes"].as_u64().unwrap();
    assert!(issued > 0 && issued < 80 << 20, "{saved}");
    // The restart goes on by itself.
    let log = dir.path().join("daemon.log");
    let server = Server::start_logged(&data, Some(&data), &[], Some(&log));
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let done = loop {
        let scrub = scrub_json(&server, "tank");
        if scrub["state"] != "scanning" {
            break scrub;
        }
        assert!(std::time::Instant::now() < deadline, "{scrub}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(done["state"], "finished", "{done}");
    // Resumed, not restarted: what it had checked before the kill is
    // read again at most up to the saved cursor's age, never from zero
    // (the whole volume is 80 MiB; it counted `issued` before).
    let total = done["issued_bytes"].as_u64().unwrap();
    assert_eq!(total, 80 << 20, "{done}");
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("resuming the scrub"), "{said}");
}

/// Polls pool `pool`'s scrub until `done` holds for it (at most 60 s).
fn wait_scrub(server: &Server, pool: &str, what: &str, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let began = std::time::Instant::now();
    loop {
        let scrub = scrub_json(server, pool);
        if done(&scrub) {
            return scrub;
        }
        assert!(began.elapsed() < Duration::from_secs(60), "no {what}: {scrub}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn scrub_interval_schedules_scrubs_and_off_stops_them() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut server, _) = written_pool(dir.path(), &data, "32M", 0x41, "8M");

    // The default: a scrub 30 days after the pool was created.
    let said = cli_ok(&server, &["pool", "get", "tank", "scrub.interval"]);
    assert!(said.contains("30d") && said.contains("default"), "{said}");
    let status = common::pool_json(&server, "tank");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let due = status["next_scrub_unix"].as_u64().unwrap();
    assert!(due.abs_diff(now + 30 * 86_400) < 120, "{status}");
    assert!(status["scrub"].is_null(), "{status}");
    assert!(cli_ok(&server, &["pool", "status", "tank"]).contains("pool tank: next scrub due"));

    // Refused values change nothing.
    for bad in ["scrub.interval=0d", "scrub.interval=monthly"] {
        let out = cli(&server, &["pool", "set", "tank", bad]);
        assert_eq!(out.status.code(), Some(1), "{bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("scrub.interval"), "{bad}");
    }

    // Every 4 s: the pool is older than that, so a scrub starts at once,
    // checks the volume, and another follows it.
    cli_ok(&server, &["pool", "set", "tank", "scrub.interval=4s"]);
    let first = wait_scrub(&server, "tank", "scheduled scrub", |s| s["state"] == "finished");
    assert_eq!(first["issued_bytes"], 8 << 20, "{first}");
    let started = first["started_unix"].as_u64().unwrap();
    let second = wait_scrub(&server, "tank", "second scheduled scrub", |s| {
        s["state"] == "finished" && s["started_unix"].as_u64().unwrap() > started
    });
    assert!(second["started_unix"].as_u64().unwrap() >= started + 4, "{second}");
    let metrics = common::http(&server.api, "GET", "/metrics", "");
    assert!(
        metrics.contains("strata_pool_scrub_issued_bytes{pool=\"tank\"} 8388608"),
        "{metrics}"
    );
    assert!(metrics.contains("strata_pool_scrub_next_timestamp_seconds{pool=\"tank\"}"));

    // Off: none is due, none starts, and that outlives a restart.
    cli_ok(&server, &["pool", "set", "tank", "scrub.interval=off"]);
    let last = wait_scrub(&server, "tank", "end of the scrub under way", |s| {
        s["state"] == "finished"
    });
    assert!(server.stop().success());
    let server = Server::start(&data);
    std::thread::sleep(Duration::from_secs(6));
    let status = common::pool_json(&server, "tank");
    assert!(status["next_scrub_unix"].is_null(), "{status}");
    assert_eq!(status["scrub"]["started_unix"], last["started_unix"], "{status}");
    let metrics = common::http(&server.api, "GET", "/metrics", "");
    assert!(
        metrics.contains("strata_pool_scrub_running{pool=\"tank\"} 0"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("strata_pool_scrub_next_timestamp_seconds{pool=\"tank\"}"),
        "{metrics}"
    );
    qemu_io_ok(&server.uri("tank/v"), &["read -P 0x41 0 8M".into()]);
}
