//! Removing a pool member (`strata pool remove`). At engine level, on
//! simulated devices: every block (a snapshot's too) moves off the member,
//! which leaves the superblocks and is never opened again; a removal cut
//! short after its first step keeps the member closed to new data and
//! completes after a reopen. Under the daemon, through NBD: a capacity
//! device removed while fio writes and verifies, its file deleted and the
//! data read back after a restart; refusals; a kill -9 in the middle of the
//! move, after which the pool opens with the device in (the removal
//! resumes and completes) or out, with every byte intact.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engine::{block_data, options, runtime, write_placed};
use common::{cli, cli_ok, pool_json, qemu_io_ok, require_tool, run, Server};
use strata::block::{BlockDevice, IoBuf};
use strata::device::{Device, SimDevice};
use strata::pool::snapshots::SnapshotRequest;
use strata::pool::superblock::{MemberState, Role, Superblock, SUPERBLOCK_BYTES};
use strata::pool::volume::EngineVolume;
use strata::pool::{DeviceSpec, NewDevice, Pool};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 2048;

/// A small fast device (metadata and log) and two capacity devices: the
/// volumes' blocks fill the fast tier and spill to device 1, then 2.
struct Three {
    sims: [SimDevice; 3],
}

impl Three {
    fn new() -> Three {
        Three {
            sims: [
                // 7 MiB of data after its header, metadata and log.
                SimDevice::new(104 * MIB, 1),
                SimDevice::new(64 * MIB, 2),
                SimDevice::new(64 * MIB, 3),
            ],
        }
    }

    async fn create(&self) -> Arc<Pool> {
        let roles = [Role::Fast, Role::Capacity, Role::Capacity];
        let devices = self
            .sims
            .iter()
            .zip(roles)
            .map(|(sim, role)| NewDevice {
                device: sim.as_device(),
                role,
            })
            .collect();
        Pool::create_with("r", 1 << 20, devices, options()).await.unwrap()
    }

    async fn open(&self, which: &[usize]) -> Result<Arc<Pool>, strata::pool::PoolError> {
        let devices: Vec<Arc<dyn Device>> = which.iter().map(|&i| self.sims[i].as_device()).collect();
        Pool::open_with(devices, options()).await
    }

    fn superblock(&self, which: usize) -> Result<Superblock, strata::pool::superblock::SuperblockError> {
        Superblock::decode(&self.sims[which].snapshot().read(0, SUPERBLOCK_BYTES))
    }
}

fn volume_of(pool: &Arc<Pool>) -> Arc<EngineVolume> {
    pool.open_volume(1, BLOCKS * BLOCK, BLOCK as u32).unwrap()
}

async fn check_blocks(volume: &EngineVolume, blocks: std::ops::Range<u64>, round: u8) {
    for block in blocks {
        let (buf, result) = volume.read(block * BLOCK, IoBuf::new(BLOCK as usize)).await;
        result.unwrap_or_else(|e| panic!("block {block}: {e}"));
        assert!(
            buf.payload() == block_data(BLOCK, block, round),
            "block {block} differs"
        );
    }
}

fn on_device(volume: &EngineVolume, device: u8) -> u64 {
    (0..BLOCKS)
        .filter(|&b| volume.block_place(b).unwrap().is_some_and(|(d, _)| d == device))
        .count() as u64
}

#[test]
fn every_block_and_a_snapshots_leave_the_member_which_is_never_opened_again() {
    runtime().block_on(async {
        let three = Three::new();
        let pool = three.create().await;
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
        // Half rewritten after the snapshot: the snapshot keeps the old
        // blocks, which must move too.
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS / 2, 2).await;
        let first = on_device(&volume, 1);
        assert!(first > 0, "the volume has blocks on device 1");
        pool.remove_member(1).await.unwrap();
        assert_eq!(on_device(&volume, 1), 0);
        assert_eq!(pool.member_live_bytes(1), 0);
        assert!(pool.status().iter().all(|d| d.index != 1), "{:?}", pool.status());
        check_blocks(&volume, 0..BLOCKS / 2, 2).await;
        check_blocks(&volume, BLOCKS / 2..BLOCKS, 1).await;
        let view = pool.open_snapshot(snapshot, BLOCK as u32).unwrap();
        check_blocks(&view, 0..BLOCKS, 1).await;
        // New writes never land there.
        write_placed(&pool, &volume, BLOCK, BLOCKS / 2..BLOCKS, 3).await;
        assert_eq!(on_device(&volume, 1), 0);
        drop((view, volume));
        pool.checkpoint().await.unwrap();
        drop(pool);

        // Its superblocks are gone; the others keep its entry, removed.
        assert!(
            three.superblock(1).is_err(),
            "the removed device's superblock is cleared"
        );
        let kept = three.superblock(2).unwrap();
        assert_eq!(kept.members.len(), 3);
        assert_eq!(kept.members[1].state, MemberState::Removed);
        // Opens without it, and its index stays taken.
        let pool = three.open(&[0, 2]).await.unwrap();
        let volume = volume_of(&pool);
        check_blocks(&volume, 0..BLOCKS / 2, 2).await;
        check_blocks(&volume, BLOCKS / 2..BLOCKS, 3).await;
        let view = pool.open_snapshot(snapshot, BLOCK as u32).unwrap();
        check_blocks(&view, 0..BLOCKS, 1).await;
        assert_eq!(pool.status().iter().map(|d| d.index).collect::<Vec<_>>(), vec![0, 2]);
        // A device added now gets a new index.
        let fourth = SimDevice::new(64 * MIB, 4);
        assert_eq!(pool.add_device(fourth.as_device(), Role::Capacity).await.unwrap(), 3);
        drop((view, volume));
        pool.checkpoint().await.unwrap();
        drop(pool);
        let devices: Vec<Arc<dyn Device>> =
            vec![three.sims[0].as_device(), three.sims[2].as_device(), fourth.as_device()];
        let pool = Pool::open_with(devices, options()).await.unwrap();
        let volume = volume_of(&pool);
        check_blocks(&volume, 0..BLOCKS / 2, 2).await;
        check_blocks(&volume, BLOCKS / 2..BLOCKS, 3).await;
    });
}

#[test]
fn a_whole_mirror_is_removed_and_both_its_devices_are_released() {
    runtime().block_on(async {
        let sims = [
            SimDevice::new(104 * MIB, 11),
            SimDevice::new(64 * MIB, 12),
            SimDevice::new(64 * MIB, 13),
            SimDevice::new(64 * MIB, 14),
        ];
        let vdevs = vec![
            strata::pool::NewVdev {
                role: Role::Fast,
                devices: vec![sims[0].as_device()],
                write_mostly: Vec::new(),
            },
            strata::pool::NewVdev {
                role: Role::Capacity,
                devices: vec![sims[1].as_device(), sims[2].as_device()],
                write_mostly: Vec::new(),
            },
            strata::pool::NewVdev {
                role: Role::Capacity,
                devices: vec![sims[3].as_device()],
                write_mostly: Vec::new(),
            },
        ];
        let pool = Pool::create_vdevs("m", 1 << 20, vdevs, options()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        assert!(on_device(&volume, 1) > 0, "the mirror holds blocks");
        // Named as `pool status` names it, or by either of its devices.
        assert_eq!(pool.member_named("mirror-1"), Some(1));
        pool.remove_member(1).await.unwrap();
        assert_eq!(on_device(&volume, 1), 0);
        check_blocks(&volume, 0..BLOCKS, 1).await;
        drop(volume);
        pool.checkpoint().await.unwrap();
        drop(pool);
        for sim in &sims[1..3] {
            assert!(Superblock::decode(&sim.snapshot().read(0, SUPERBLOCK_BYTES)).is_err());
        }
        let kept = Superblock::decode(&sims[3].snapshot().read(0, SUPERBLOCK_BYTES)).unwrap();
        assert_eq!(kept.members[1].state, MemberState::Removed);
        assert!(kept.children.is_empty(), "its child entries went with it");
        let devices: Vec<Arc<dyn Device>> = vec![sims[0].as_device(), sims[3].as_device()];
        let pool = Pool::open_with(devices, options()).await.unwrap();
        check_blocks(&volume_of(&pool), 0..BLOCKS, 1).await;
    });
}

#[test]
fn a_removal_cut_short_keeps_the_member_closed_to_new_data_and_resumes() {
    runtime().block_on(async {
        let three = Three::new();
        let pool = three.create().await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS / 2, 1).await;
        let on_one = on_device(&volume, 1);
        assert!(on_one > 0);
        // Only the first step: every superblock says evacuating.
        pool.start_removal(1).await.unwrap();
        // A member being removed gets no new mirror copy.
        let spare = SimDevice::new(64 * MIB, 4);
        let named = DeviceSpec::Uuid(three.superblock(1).unwrap().device_uuid);
        let refused = pool.attach(&named, spare.as_device()).await.unwrap_err().to_string();
        assert!(refused.contains("being removed"), "{refused}");
        drop(volume);
        pool.checkpoint().await.unwrap();
        drop(pool);
        for device in [0, 1, 2] {
            assert_eq!(
                three.superblock(device).unwrap().members[1].state,
                MemberState::Evacuating
            );
        }
        // "A crash": reopened, the member takes nothing new.
        let pool = three.open(&[0, 1, 2]).await.unwrap();
        assert_eq!(pool.evacuating_members(), vec![1]);
        assert_eq!(pool.status()[1].state, "REMOVING");
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, BLOCKS / 2..BLOCKS, 2).await;
        assert_eq!(on_device(&volume, 1), on_one, "nothing new on the member being removed");
        // Resumed as the volume manager does; its superblocks are kept
        // (the catalog would still list it).
        pool.start_removal(1).await.unwrap();
        pool.finish_removal(1).await.unwrap();
        assert_eq!(on_device(&volume, 1), 0);
        check_blocks(&volume, 0..BLOCKS / 2, 1).await;
        check_blocks(&volume, BLOCKS / 2..BLOCKS, 2).await;
        drop(volume);
        drop(pool);
        // The removed member's device given at open (a catalog not updated
        // before a crash) is left out.
        let pool = three.open(&[0, 1, 2]).await.unwrap();
        assert!(pool.status().iter().all(|d| d.index != 1));
        let volume = volume_of(&pool);
        check_blocks(&volume, 0..BLOCKS / 2, 1).await;
        check_blocks(&volume, BLOCKS / 2..BLOCKS, 2).await;
    });
}

#[test]
fn the_metadata_device_the_last_data_device_and_a_too_full_pool_are_refused() {
    runtime().block_on(async {
        let three = Three::new();
        let pool = three.create().await;
        let refused = |index: u8, needle: &'static str| {
            let pool = pool.clone();
            async move {
                let error = pool.start_removal(index).await.unwrap_err().to_string();
                assert!(error.contains(needle), "{error}");
            }
        };
        refused(0, "metadata region").await;
        refused(7, "has no member 7").await;
        // Device 1 holds more than device 2 has room for.
        let volume = pool.open_volume(1, 120 * MIB, BLOCK as u32).unwrap();
        for block in 0..(100 * MIB / BLOCK) {
            volume
                .write(block * BLOCK, IoBuf::copy_from(&block_data(BLOCK, block, 1)), false)
                .await
                .unwrap();
        }
        volume.flush().await.unwrap();
        pool.destage_all().await.unwrap();
        refused(1, "free").await;
        // Nothing changed: both still take data.
        assert!(pool.status().iter().all(|d| d.state == "ONLINE"), "{:?}", pool.status());
        assert_eq!(pool.evacuating_members(), Vec::<u8>::new());
    });
}

// ---------------------------------------------------------------------------
// Under the daemon

/// The `pool status --json` device rows of `pool`, by name.
fn device_row(status: &serde_json::Value, path: &str) -> Option<serde_json::Value> {
    status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| {
            d["name"]
                .as_str()
                .is_some_and(|n| n == path || n.contains(&format!("({path})")))
        })
        .cloned()
}

/// A pool of one small fast device (about 20 MiB of data space after its
/// metadata and log) and two capacity devices, and a volume holding
/// `data_mib` of pattern 0x5c at its start: past the fast tier, on the
/// first capacity device.
fn three_device_pool(dir: &std::path::Path, data_mib: u64, c2_mib: u64) -> (Server, [String; 3]) {
    let fast = common::sparse_file(dir, "fast.img", 120 * MIB);
    let c1 = common::sparse_file(dir, "c1.img", 512 * MIB);
    let c2 = common::sparse_file(dir, "c2.img", c2_mib * MIB);
    let data = dir.join("data");
    let server = Server::start(&data);
    cli_ok(
        &server,
        &[
            "pool",
            "create",
            "tank",
            "--fast",
            &fast,
            "--capacity",
            &c1,
            "--capacity",
            &c2,
        ],
    );
    cli_ok(&server, &["volume", "create", "tank/v", "--size", "384M"]);
    let uri = server.uri("tank/v");
    qemu_io_ok(&uri, &[format!("write -P 0x5c 0 {data_mib}M"), "flush".into()]);
    cli_ok(&server, &["pool", "sync", "tank"]);
    let status = pool_json(&server, "tank");
    let used = device_row(&status, &c1).unwrap()["used_bytes"].as_u64().unwrap();
    assert!(used >= data_mib * MIB / 2, "the data is on {c1}: {status}");
    (server, [fast, c1, c2])
}

fn fio_verify(uri: &str, dir: &std::path::Path) -> Command {
    let mut command = Command::new("fio");
    command
        .args([
            "--name=remove",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
        ])
        .args(["--offset=256m", "--size=64m", "--rate_iops=4000"])
        .args([
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=json",
        ])
        .current_dir(dir)
        .arg(format!("--uri={uri}"));
    command
}

fn fio_report(output: &std::process::Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "fio failed: {text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&text[text.find('{').expect("fio JSON")..]).unwrap()
}

#[test]
fn a_capacity_device_leaves_while_fio_writes_and_verifies_and_its_file_can_go() {
    require_tool("qemu-io");
    require_tool("fio");
    let dir = tempfile::tempdir().unwrap();
    let (mut server, [_, c1, c2]) = three_device_pool(dir.path(), 192, 512);
    let uri = server.uri("tank/v");
    let fio = fio_verify(&uri, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    let line = cli_ok(&server, &["pool", "remove", "tank", &c1, "--wait"]);
    let seconds = started.elapsed().as_secs_f64();
    assert!(line.contains("removed") && line.contains("c1.img"), "{line}");
    let report = fio_report(&fio.wait_with_output().unwrap());
    let job = &report["jobs"][0];
    assert_eq!(job["error"], 0, "{report}");
    assert_eq!(job["write"]["io_bytes"].as_u64().unwrap(), 64 * MIB);
    assert_eq!(
        job["read"]["io_bytes"].as_u64().unwrap(),
        64 * MIB,
        "fio verified all it wrote"
    );
    eprintln!("removed {c1} (192 MiB and fio's writes) in {seconds:.1} s");
    let status = pool_json(&server, "tank");
    assert!(device_row(&status, &c1).is_none(), "{status}");
    assert_eq!(status["state"], "ONLINE", "{status}");
    let used = device_row(&status, &c2).unwrap()["used_bytes"].as_u64().unwrap();
    // All of c1's (192 MiB less the fast tier's 19 MiB; fio's last writes
    // may still be cached).
    assert!(used >= 170 * MIB, "the data is on {c2} now: {status}");
    qemu_io_ok(&uri, &["read -P 0x5c 0 192M".into()]);
    // The catalog no longer names it; the file can go.
    let catalog = std::fs::read_to_string(dir.path().join("data/catalog.json")).unwrap();
    assert!(!catalog.contains("c1.img"), "{catalog}");
    assert!(server.stop().success());
    std::fs::remove_file(&c1).unwrap();
    let server = Server::start(&dir.path().join("data"));
    let uri = server.uri("tank/v");
    qemu_io_ok(&uri, &["read -P 0x5c 0 192M".into()]);
    let verify = run(fio_verify(&uri, dir.path()).args(["--verify_only"]));
    let report = fio_report(&verify);
    assert_eq!(report["jobs"][0]["error"], 0, "{report}");
    assert_eq!(report["jobs"][0]["read"]["io_bytes"].as_u64().unwrap(), 64 * MIB);
    // A removed device's index is not reused: adding one works.
    let c3 = common::sparse_file(dir.path(), "c3.img", 512 * MIB);
    cli_ok(&server, &["pool", "add-device", "tank", "--capacity", &c3]);
    let status = pool_json(&server, "tank");
    assert_eq!(device_row(&status, &c3).unwrap()["index"], 3, "{status}");
}

#[test]
fn a_removal_is_refused_in_one_line_when_it_cannot_be_done() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    // c2 has under 64 MiB of data space; c1 holds at least half of the
    // 192 MiB written (however much the fast tier kept): c2 cannot take it.
    let (server, [fast, c1, c2]) = three_device_pool(dir.path(), 192, 64);
    let refused = |device: &str, needle: &str| {
        let output = cli(&server, &["pool", "remove", "tank", device]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{device}: {stderr}");
        assert!(stderr.contains(needle), "{device}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    };
    refused(&fast, "metadata region");
    refused(
        &dir.path().join("nothing.img").display().to_string(),
        "not a device of pool",
    );
    refused("mirror-4", "not a device of pool");
    refused(&c1, "the other capacity devices have");
    // Nothing changed: both still take data, and the data reads back.
    let status = pool_json(&server, "tank");
    for path in [&c1, &c2] {
        assert_eq!(device_row(&status, path).unwrap()["state"], "ONLINE", "{status}");
        assert!(device_row(&status, path).unwrap().get("removal").is_none(), "{status}");
    }
    let uri = server.uri("tank/v");
    qemu_io_ok(&uri, &["read -P 0x5c 0 192M".into()]);
    // c2 holds nothing: it can go (to c1), and does.
    let line = cli_ok(&server, &["pool", "remove", "tank", &c2, "--wait"]);
    assert!(line.contains("removed"), "{line}");
    // Now c1 is the last capacity device; the fast tier cannot hold it.
    refused(&c1, "the other fast devices have");
    qemu_io_ok(&uri, &["read -P 0x5c 0 192M".into()]);
}

#[test]
fn a_kill_during_the_move_leaves_the_device_in_or_out_and_the_data_intact() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let (mut server, [_, c1, _]) = three_device_pool(dir.path(), 256, 512);
    let data = dir.path().join("data");
    assert!(server.stop().success());
    // I/O on c1 at 40 MB/s: the move takes several seconds.
    let wrap = format!("{c1}=throttle:bw=40M");
    let start = || {
        // A wrap may name only a device the catalog lists.
        let catalog = std::fs::read_to_string(data.join("catalog.json")).unwrap();
        let args: &[&str] = if catalog.contains("c1.img") {
            &["--wrap", &wrap]
        } else {
            &[]
        };
        Server::start_with_args(&data, Some(&data), args)
    };
    let mut server = start();
    cli_ok(&server, &["pool", "remove", "tank", &c1]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = pool_json(&server, "tank");
        let row = device_row(&status, &c1).expect("still in");
        assert_eq!(row["state"], "REMOVING", "{status}");
        if row["removal"]["moved_bytes"].as_u64().unwrap() >= 32 * MIB {
            break;
        }
        assert!(Instant::now() < deadline, "no progress: {status}");
        std::thread::sleep(Duration::from_millis(50));
    }
    server.kill9();
    let mut kills = 1;
    loop {
        // In (the removal resumes by itself) or out; the data is intact.
        let mut server = start();
        let status = pool_json(&server, "tank");
        match device_row(&status, &c1) {
            Some(row) => {
                assert_eq!(row["state"], "REMOVING", "{status}");
                eprintln!("after kill {kills}: in, removing ({})", row["removal"]);
            }
            None => eprintln!("after kill {kills}: out"),
        }
        let uri = server.uri("tank/v");
        qemu_io_ok(&uri, &["read -P 0x5c 0 256M".into()]);
        if device_row(&status, &c1).is_some() && kills < 3 {
            // Again, a moment into the resumed move.
            std::thread::sleep(Duration::from_millis(700 * kills));
            server.kill9();
            kills += 1;
            continue;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while device_row(&pool_json(&server, "tank"), &c1).is_some() {
            assert!(Instant::now() < deadline, "the resumed removal did not end");
            std::thread::sleep(Duration::from_millis(100));
        }
        qemu_io_ok(&uri, &["read -P 0x5c 0 256M".into()]);
        assert!(server.stop().success());
        break;
    }
    // Out for good: the catalog drops it and its file can go.
    let catalog = std::fs::read_to_string(data.join("catalog.json")).unwrap();
    assert!(!catalog.contains("c1.img"), "{catalog}");
    std::fs::remove_file(&c1).unwrap();
    let server = Server::start(&data);
    qemu_io_ok(&server.uri("tank/v"), &["read -P 0x5c 0 256M".into()]);
}
