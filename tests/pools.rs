//! Pools: `strata pool create` end to end (a pool on two files made by the
//! user, a volume on it served over NBD, errors, and a restart), and growing
//! a pool online at engine level (`Pool::add_device`): on files, filling the
//! pool to ENOSPC first; on simulated devices, every point a crash or a
//! write error can interrupt the addition at; and a pool device failing reads
//! under `strata serve --wrap` (EIO to the client, counted, the rest works).

mod common;

use common::{cli, require_tool, run, Server};
use std::process::Command;
use std::sync::Arc;

use strata::block::{BlockDevice, BlockError, IoBuf};
use strata::device::wrappers::IoOp;
use strata::device::{open_device, Device, DeviceOptions, ErrorDevice, ErrorRule, SimDevice};
use strata::pool::superblock::{Role, SUPERBLOCK_BYTES, SUPERBLOCK_OFFSETS};
use strata::pool::volume::EngineVolume;
use strata::pool::{NewDevice, Pool, PoolError};

const MIB: u64 = 1 << 20;

#[test]
fn pool_create_serve_and_reopen() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let fast = common::sparse_file(dir.path(), "fast.img", 256 << 20);
    let capacity = common::sparse_file(dir.path(), "capacity.img", 512 << 20);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);

    let created = cli(
        &server,
        &["pool", "create", "tank", "--fast", &fast, "--capacity", &capacity],
    );
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    // The same devices cannot make a second pool.
    let again = cli(&server, &["pool", "create", "other", "--fast", &fast]);
    assert_eq!(again.status.code(), Some(1));
    let message = String::from_utf8_lossy(&again.stderr);
    assert_eq!(message.lines().count(), 1, "{message}");
    assert!(message.contains("strata: error:"), "{message}");
    // A pool needs a data device.
    let no_data = cli(&server, &["pool", "create", "empty"]);
    assert_eq!(no_data.status.code(), Some(1));

    let volume = cli(&server, &["volume", "create", "tank/v", "--size", "1G"]);
    assert!(volume.status.success(), "{}", String::from_utf8_lossy(&volume.stderr));
    let uri = server.uri("tank/v");
    run(Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x6b 0 4M",
            "-c",
            "flush",
            "-c",
            "read -P 0x6b 0 4M",
        ])
        .arg(&uri));

    let status = cli(&server, &["pool", "status", "tank", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["name"], "tank");
    assert_eq!(status["devices"].as_array().unwrap().len(), 2);
    assert_eq!(status["used_bytes"], 4u64 << 20);
    assert!(server.stop().success());

    // Restart: the pool is found from the catalog and its devices.
    let server = Server::start(&data);
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x6b 0 4M"])
        .arg(server.uri("tank/v")));
}

/// Whether `dir` is on tmpfs with at least `bytes` free.
fn tmpfs_with_room(dir: &str, bytes: u64) -> bool {
    let path = std::ffi::CString::new(dir).unwrap();
    // SAFETY: statfs fills the zeroed struct; `path` is a valid C string.
    let mut stats: libc::statfs = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::statfs(path.as_ptr(), &mut stats) } == 0;
    ok && stats.f_type as i64 == 0x0102_1994 && stats.f_bavail as u64 * stats.f_bsize as u64 >= bytes
}

/// With no `STRATA_RAM_DIR`, the default pool's RAM tier is a file in
/// /dev/shm (tmpfs: never written back to a disk) when it has room, else
/// `pools/default/ram.tier`; it survives a kill -9, and a clean shutdown
/// removes it so a stopped daemon holds no RAM.
#[test]
fn ram_tier_file_lives_in_tmpfs_survives_kill9_and_goes_at_clean_shutdown() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start_with_ram_dir(&data, None);
    let key = strata::control::manager::ram_file_key(&data, "default");
    let shm = std::path::PathBuf::from(format!("/dev/shm/strata-{key}.ram"));
    let local = data.join("pools/default/ram.tier");
    // The daemon checked for room before choosing; 256 MiB of tier plus
    // its slot table is what it needed.
    let expected = if shm.exists() || tmpfs_with_room("/dev/shm", 300 << 20) {
        &shm
    } else {
        &local
    };
    let other = if expected == &shm { &local } else { &shm };
    assert!(expected.exists(), "no RAM tier file at {}", expected.display());
    assert!(!other.exists(), "a second RAM tier file at {}", other.display());
    // `pool status` says where it is.
    let response = common::http(&server.api, "GET", "/v1/pools/default", "");
    let body = &response[response.find("\r\n\r\n").expect("an HTTP response") + 4..];
    let status: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(status["cache"]["ram_tier"], expected.display().to_string(), "{status}");

    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x3c 0 256k", "-c", "flush"])
        .arg(&uri));
    server.kill9();
    assert!(expected.exists(), "kill -9 must leave the RAM tier file");

    let mut server = Server::start_with_ram_dir(&data, None);
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x3c 0 256k"])
        .arg(server.uri("default/vol0")));
    assert!(server.stop().success());
    assert!(!expected.exists(), "a clean shutdown leaves {}", expected.display());
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// 64 KiB of bytes that say which block they belong to and when it was written.
fn block_data(block: u64, round: u8) -> Vec<u8> {
    let mut data = common::pseudo_random(block * 1000 + round as u64, 64 << 10);
    data[0] = round;
    data
}

async fn read_block(volume: &EngineVolume, block: u64) -> Vec<u8> {
    let (buf, result) = volume.read(block << 16, IoBuf::new(64 << 10)).await;
    result.unwrap_or_else(|e| panic!("read of block {block}: {e}"));
    buf.payload().to_vec()
}

fn device_of(volume: &EngineVolume, block: u64) -> u8 {
    volume.block_place(block).unwrap().expect("block is mapped").0
}

/// Writes 64 KiB blocks from `next` until the pool is full; returns the first
/// block that did not fit.
async fn fill(volume: &EngineVolume, mut next: u64, round: u8) -> u64 {
    loop {
        match volume
            .write(next << 16, IoBuf::copy_from(&block_data(next, round)), false)
            .await
        {
            Ok(()) => next += 1,
            Err(BlockError::NoSpace) => return next,
            Err(e) => panic!("write of block {next}: {e}"),
        }
        assert!(next < 1024, "the pool should be full long before 64 MiB");
    }
}

fn open_file(path: &str) -> Arc<dyn Device> {
    open_device(path, &DeviceOptions::default()).unwrap()
}

#[test]
fn add_device_to_a_full_pool_on_files_then_reopen() {
    current_thread().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        // Chunk 0 + 32 MiB metadata + 64 MiB log + 4 data chunks.
        let fast = common::sparse_file(dir.path(), "fast.img", 101 * MIB);
        let capacity = common::sparse_file(dir.path(), "capacity.img", 16 * MIB);
        let fast2 = common::sparse_file(dir.path(), "fast2.img", 8 * MIB);
        let pool = Pool::create(
            "grow",
            1 << 20,
            vec![NewDevice {
                device: open_file(&fast),
                role: Role::Fast,
            }],
        )
        .await
        .unwrap();
        let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
        let full = fill(&volume, 0, 1).await;
        assert_eq!(full, 64, "4 data chunks of 1 MiB hold 64 blocks of 64 KiB");
        volume.flush().await.unwrap();

        // A capacity device: the pool grows by its 15 data chunks.
        assert_eq!(pool.add_device(open_file(&capacity), Role::Capacity).await.unwrap(), 1);
        let status = pool.status();
        assert_eq!(status.len(), 2);
        assert_eq!(status[1].role, Role::Capacity);
        assert_eq!(status[1].data_bytes, 15 * MIB);
        let full2 = fill(&volume, full, 1).await;
        assert_eq!(full2 - full, 15 * 16, "the new device's chunks are all usable");
        pool.destage_all().await.unwrap();
        assert!((full..full2).all(|b| device_of(&volume, b) == 1));
        volume.flush().await.unwrap();

        // Free some capacity blocks, then add a fast device: new data goes to
        // the fast tier first even though the device came last.
        volume.trim(full << 16, 16 * (64 << 10), false).await.unwrap();
        volume.flush().await.unwrap();
        assert_eq!(pool.add_device(open_file(&fast2), Role::Fast).await.unwrap(), 2);
        for block in full..full + 16 {
            volume
                .write(block << 16, IoBuf::copy_from(&block_data(block, 2)), false)
                .await
                .unwrap();
            pool.destage_all().await.unwrap();
            assert_eq!(device_of(&volume, block), 2, "block {block} on the new fast device");
        }
        // Overwrites of blocks on the added devices (in place, dirty marks).
        volume
            .write((full + 20) << 16, IoBuf::copy_from(&block_data(full + 20, 3)), true)
            .await
            .unwrap();
        volume.flush().await.unwrap();

        let expected = |block: u64| match block {
            b if (full..full + 16).contains(&b) => block_data(b, 2),
            b if b == full + 20 => block_data(b, 3),
            b => block_data(b, 1),
        };
        for block in 0..full2 {
            assert_eq!(read_block(&volume, block).await, expected(block), "block {block}");
        }
        // No checkpoint: the reopen replays the log records naming devices 1 and 2.
        drop(volume);
        drop(pool);

        // Every device is needed now, and is found in any order.
        let error = Pool::open(vec![open_file(&fast), open_file(&capacity)])
            .await
            .err()
            .expect("the new fast device is missing");
        assert!(matches!(error, PoolError::Missing { .. }), "{error}");
        assert!(error.to_string().contains("missing its fast device"), "{error}");
        let pool = Pool::open(vec![open_file(&fast2), open_file(&fast), open_file(&capacity)])
            .await
            .unwrap();
        assert_eq!(pool.status().len(), 3);
        let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
        for block in 0..full2 {
            assert_eq!(
                read_block(&volume, block).await,
                expected(block),
                "block {block} after reopen"
            );
        }
        assert_eq!(volume.used_bytes(), full2 << 16);
        // The space left is what the allocator says after the reopen too.
        // fast2: 7 data chunks (112 blocks), 16 used; capacity: the 16 trimmed blocks.
        let more = fill(&volume, full2, 4).await;
        assert_eq!(more - full2, 96 + 16);
    });
}

/// A pool on simulated devices, fast `a` and capacity `b`, with 40 blocks of
/// data committed, and `c`, a blank capacity device to add. `a` and `b` sit
/// behind error wrappers (no rules yet).
struct SimPool {
    a: SimDevice,
    b: SimDevice,
    c: SimDevice,
    errors: [Arc<ErrorDevice>; 3],
    pool: Arc<Pool>,
    volume: Arc<EngineVolume>,
}

const SIM_BLOCKS: u64 = 40;

async fn sim_pool() -> SimPool {
    let (a, b, c) = (
        SimDevice::new(101 * MIB, 1),
        SimDevice::new(16 * MIB, 2),
        SimDevice::new(16 * MIB, 3),
    );
    let errors = [&a, &b, &c].map(|sim| Arc::new(ErrorDevice::new(sim.as_device(), Vec::new(), 7)));
    let as_device = |e: &Arc<ErrorDevice>| -> Arc<dyn Device> { e.clone() };
    let pool = Pool::create(
        "sim",
        1 << 20,
        vec![
            NewDevice {
                device: as_device(&errors[0]),
                role: Role::Fast,
            },
            NewDevice {
                device: as_device(&errors[1]),
                role: Role::Capacity,
            },
        ],
    )
    .await
    .unwrap();
    let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
    for block in 0..SIM_BLOCKS {
        volume
            .write(block << 16, IoBuf::copy_from(&block_data(block, 1)), false)
            .await
            .unwrap();
    }
    volume.flush().await.unwrap();
    SimPool {
        a,
        b,
        c,
        errors,
        pool,
        volume,
    }
}

impl SimPool {
    fn new_device(&self) -> Arc<dyn Device> {
        self.errors[2].clone()
    }

    /// Power loss: the pool is gone, unflushed writes are dropped or torn.
    fn crash(self) -> (SimDevice, SimDevice, SimDevice) {
        drop(self.volume);
        drop(self.pool);
        for sim in [&self.a, &self.b, &self.c] {
            sim.crash();
        }
        (self.a, self.b, self.c)
    }
}

fn superblocks_of(sim: &SimDevice) -> Vec<Vec<u8>> {
    SUPERBLOCK_OFFSETS
        .iter()
        .map(|&offset| sim.read_durable(offset, SUPERBLOCK_BYTES))
        .collect()
}

fn put_superblocks(sim: &SimDevice, copies: &[Vec<u8>]) {
    for (offset, bytes) in SUPERBLOCK_OFFSETS.iter().zip(copies) {
        sim.write_durable(*offset, bytes);
    }
}

/// Opens the pool as the volume manager does after a crash during an
/// addition: with `c` when the superblocks list it. Checks the data, fills
/// the pool and returns it.
async fn reopen_and_check(a: &SimDevice, b: &SimDevice, c: &SimDevice, expect_listed: bool) -> Arc<Pool> {
    let mut devices = vec![a.as_device(), b.as_device()];
    let listed = Pool::superblocks_list(&devices, &c.as_device()).await;
    assert_eq!(listed, expect_listed, "does the pool list the added device?");
    if listed {
        devices.push(c.as_device());
    }
    let pool = Pool::open(devices).await.unwrap_or_else(|e| panic!("reopen: {e}"));
    let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
    for block in 0..SIM_BLOCKS {
        assert_eq!(read_block(&volume, block).await, block_data(block, 1), "block {block}");
    }
    // The pool takes writes again, and uses the added device when it has it.
    let full = fill(&volume, SIM_BLOCKS, 5).await;
    let data_chunks = 4 + 15 + if listed { 15 } else { 0 };
    assert_eq!(full, data_chunks * 16);
    volume.flush().await.unwrap();
    pool
}

#[test]
fn a_crash_at_any_point_of_an_addition_leaves_a_pool_that_opens() {
    // Superblock writes of an addition, in order: c, then a, then b.
    for reached in 0..=3usize {
        current_thread().block_on(async {
            let sim = sim_pool().await;
            let before = [superblocks_of(&sim.a), superblocks_of(&sim.b), superblocks_of(&sim.c)];
            sim.pool.add_device(sim.new_device(), Role::Capacity).await.unwrap();
            let (a, b, c) = sim.crash();
            // Put back what the crash came before.
            for (index, device) in [&c, &a, &b].into_iter().enumerate() {
                if index >= reached {
                    put_superblocks(device, &before[[2, 0, 1][index]]);
                }
            }
            if reached == 1 {
                // Only the new device was written: the old devices alone still
                // make the pool (as when the catalog never recorded the device).
                let alone = Pool::open(vec![a.as_device(), b.as_device()]).await.unwrap();
                assert_eq!(alone.status().len(), 2);
                drop(alone);
            }
            if reached >= 2 {
                // Some old device names it: the pool needs it from now on,
                // which is why the catalog records it before anything is written.
                let error = Pool::open(vec![a.as_device(), b.as_device()])
                    .await
                    .err()
                    .expect("must fail");
                assert!(error.to_string().contains("missing its capacity device"), "{error}");
            }
            let pool = reopen_and_check(&a, &b, &c, reached >= 1).await;
            assert_eq!(
                pool.status().len(),
                if reached >= 1 { 3 } else { 2 },
                "reached {reached}"
            );
        });
    }
}

#[test]
fn a_failed_addition_is_undone_and_the_device_can_be_added_again() {
    current_thread().block_on(async {
        let sim = sim_pool().await;
        // The new device's superblock write fails: undone at once.
        sim.errors[2].set_rules(vec![ErrorRule::always(&[IoOp::Write])]);
        let addition = sim
            .pool
            .prepare_add_device(sim.new_device(), Role::Capacity)
            .await
            .unwrap();
        let error = sim.pool.finish_add_device(addition).await.unwrap_err();
        assert!(error.undo_failed.is_none(), "{error}");
        assert!(error.to_string().contains("nothing was changed"), "{error}");
        assert_eq!(sim.pool.status().len(), 2);
        // The pool goes on as before.
        let full = fill(&sim.volume, SIM_BLOCKS, 1).await;
        assert_eq!(full, 19 * 16);
        sim.volume.flush().await.unwrap();
        // The same (now healthy) device can be added afterwards.
        let c: Arc<dyn Device> = sim.c.as_device();
        assert_eq!(sim.pool.add_device(c, Role::Capacity).await.unwrap(), 2);
        assert_eq!(fill(&sim.volume, full, 1).await, 34 * 16);
        sim.volume.flush().await.unwrap();
        let (a, b, c) = sim.crash();
        let pool = Pool::open(vec![a.as_device(), b.as_device(), c.as_device()])
            .await
            .unwrap();
        let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
        for block in 0..34 * 16 {
            assert_eq!(read_block(&volume, block).await, block_data(block, 1), "block {block}");
        }
    });
}

#[test]
fn a_failed_undo_is_settled_by_the_next_open() {
    // An existing device fails its superblock write (and, the error being
    // sticky, the undo's too). Device 0 failing: the new generation is on the
    // new device only, so the next open completes the addition. Device 1
    // failing: the undo put the old table on device 0 at a newer generation,
    // so the next open leaves the new device out.
    for (failing, completes) in [(0usize, true), (1, false)] {
        current_thread().block_on(async {
            let sim = sim_pool().await;
            sim.errors[failing].set_rules(vec![ErrorRule {
                ops: vec![IoOp::Write],
                range: Some((0, MIB)),
                every: None,
                probability: None,
            }]);
            let addition = sim
                .pool
                .prepare_add_device(sim.new_device(), Role::Capacity)
                .await
                .unwrap();
            let error = sim.pool.finish_add_device(addition).await.unwrap_err();
            assert!(error.undo_failed.is_some(), "{error}");
            assert_eq!(sim.pool.status().len(), 2, "the device did not join the running pool");
            // While the superblocks may list it, the running pool says so.
            assert_eq!(sim.pool.lists(&sim.c.as_device()).await, completes);
            let (a, b, c) = sim.crash();
            let pool = reopen_and_check(&a, &b, &c, completes).await;
            assert_eq!(pool.status().len(), if completes { 3 } else { 2 });
            if !completes {
                // The new device keeps a superblock naming a member the pool
                // does not have: it may be added again.
                assert_ne!(c.read_durable(0, 8), vec![0; 8], "the undo could not clear it");
                assert_eq!(pool.add_device(c.as_device(), Role::Capacity).await.unwrap(), 2);
                assert_eq!(pool.status()[2].data_bytes, 15 * MIB);
            }
        });
    }
}

#[test]
fn additions_that_cannot_work_are_refused_and_change_nothing() {
    current_thread().block_on(async {
        let sim = sim_pool().await;
        let before = [superblocks_of(&sim.a), superblocks_of(&sim.b)];
        let refuse = |device: Arc<dyn Device>, role: Role| {
            let pool = sim.pool.clone();
            async move {
                let error = pool
                    .prepare_add_device(device, role)
                    .await
                    .err()
                    .expect("must be refused");
                error.to_string()
            }
        };
        let message = refuse(sim.c.as_device(), Role::Log).await;
        assert!(
            message.contains("a log device is fixed when the pool is created"),
            "{message}"
        );
        // Already a member (of this pool) and a device of another pool.
        let message = refuse(sim.a.as_device(), Role::Fast).await;
        assert!(message.contains("already part of a strata pool"), "{message}");
        let stranger = SimDevice::new(101 * MIB, 9);
        let other = Pool::create(
            "other",
            1 << 20,
            vec![NewDevice {
                device: stranger.as_device(),
                role: Role::Fast,
            }],
        )
        .await
        .unwrap();
        drop(other);
        let message = refuse(stranger.as_device(), Role::Capacity).await;
        assert!(message.contains("already part of a strata pool"), "{message}");
        // Too small: chunk 0 and 4 data chunks at least.
        let tiny = SimDevice::new(4 * MIB, 10);
        let message = refuse(tiny.as_device(), Role::Capacity).await;
        assert!(message.contains("too small"), "{message}");
        // More data than the metadata region (32 MiB) is meant for: 4 GiB.
        let huge = SimDevice::new(4 << 30, 11);
        let message = refuse(huge.as_device(), Role::Capacity).await;
        assert!(message.contains("metadata region"), "{message}");
        // Nothing was written anywhere.
        assert_eq!([superblocks_of(&sim.a), superblocks_of(&sim.b)], before);
        assert_eq!(sim.c.read_durable(0, SUPERBLOCK_BYTES), vec![0; SUPERBLOCK_BYTES]);
        assert_eq!(sim.pool.status().len(), 2);
    });
}

#[test]
fn devices_are_added_while_writes_are_in_flight() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let sim = sim_pool().await;
            let (pool, volume) = (sim.pool.clone(), sim.volume.clone());
            // Writers overwrite the first blocks and fill new ones while two
            // devices join.
            let mut writers = Vec::new();
            for writer in 0..4u64 {
                let volume = volume.clone();
                writers.push(tokio::spawn(async move {
                    let mut written = Vec::new();
                    for i in 0..150u64 {
                        let block = SIM_BLOCKS + writer + 4 * i;
                        match volume
                            .write(block << 16, IoBuf::copy_from(&block_data(block, 6)), i % 8 == 0)
                            .await
                        {
                            Ok(()) => written.push(block),
                            Err(BlockError::NoSpace) => {}
                            Err(e) => panic!("write of block {block}: {e}"),
                        }
                        tokio::task::yield_now().await;
                    }
                    written
                }));
            }
            let d = SimDevice::new(16 * MIB, 4);
            pool.add_device(sim.new_device(), Role::Capacity).await.unwrap();
            pool.add_device(d.as_device(), Role::Fast).await.unwrap();
            let mut written = Vec::new();
            for writer in writers {
                written.extend(writer.await.unwrap());
            }
            volume.flush().await.unwrap();
            assert_eq!(pool.status().len(), 4);
            for &block in &written {
                assert_eq!(read_block(&volume, block).await, block_data(block, 6), "block {block}");
            }
            drop(volume);
            drop(pool);
            let (a, b, c) = sim.crash();
            d.crash();
            let pool = Pool::open(vec![a.as_device(), b.as_device(), c.as_device(), d.as_device()])
                .await
                .unwrap();
            let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
            for block in (0..SIM_BLOCKS).chain(written.iter().copied()) {
                let round = if block < SIM_BLOCKS { 1 } else { 6 };
                assert_eq!(
                    read_block(&volume, block).await,
                    block_data(block, round),
                    "block {block}"
                );
            }
        });
}

#[test]
fn a_device_failing_reads_under_wrap_gives_eio_and_is_counted_and_the_rest_works() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path());
    let uri = server.uri("default/vol0");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x61 0 1M", "-c", "flush"])
        .arg(&uri));
    // A clean stop writes the RAM tier out: the data is on the fast device.
    assert!(server.stop().success());

    // The same pool with every read of its fast device's data chunks
    // failing (the superblocks, metadata and log before them stay readable:
    // the data starts where the log region ends, docs/FORMAT.md).
    let fast = dir.path().join("pools/default/fast.dev");
    let mut superblock = vec![0u8; 4096];
    std::io::Read::read_exact(&mut std::fs::File::open(&fast).unwrap(), &mut superblock).unwrap();
    let field = |at: usize| u64::from_le_bytes(superblock[at..at + 8].try_into().unwrap());
    let data_start = field(72) + field(80);
    let size = std::fs::metadata(&fast).unwrap().len();
    assert!(
        data_start > MIB && data_start < size,
        "data start {data_start} of {size}"
    );
    let wrap = format!("{}=error:read,offset={data_start}-{size}", fast.display());
    let mut server = Server::start_with_args(dir.path(), Some(dir.path()), &["--wrap", &wrap]);
    let uri = server.uri("default/vol0");
    let failed = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x61 0 64k"])
        .arg(&uri)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&failed.stdout),
        String::from_utf8_lossy(&failed.stderr)
    );
    assert!(
        said.contains("Input/output error"),
        "a failed device read must be EIO: {said}"
    );
    // Writes (into the RAM tier) and reading them back still work.
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x62 4M 64k", "-c", "read -P 0x62 4M 64k"])
        .arg(&uri));
    let status = cli(&server, &["pool", "status", "default", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let fast_status = status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["role"] == "fast")
        .unwrap()
        .clone();
    assert!(
        fast_status["name"].as_str().unwrap().starts_with("error("),
        "the wrap is shown: {fast_status}"
    );
    assert!(fast_status["read_errors"].as_u64().unwrap() >= 1, "{fast_status}");
    assert_eq!(fast_status["checksum_errors"], 0, "{fast_status}");
    assert!(server.stop().success());

    // Without the wrap nothing was lost: both writes read back.
    let mut server = Server::start(dir.path());
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x61 0 1M", "-c", "read -P 0x62 4M 64k"])
        .arg(server.uri("default/vol0")));
    assert!(server.stop().success());
}
