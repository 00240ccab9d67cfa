//! Mirrors at engine level, on simulated devices: a copy whose bytes rot is
//! found by its checksums and rewritten from the other; a device that fails
//! writes is faulted and the pool goes on DEGRADED, the fault recorded in
//! the other device's superblocks; a mirror opens without one of its
//! devices; a device that missed writes is not read from until a resilver
//! has copied what it missed, and only what changed while it was away when
//! the mirror's dirty record covers its absence (else all of it); devices
//! used apart are refused together. And
//! under the daemon, through NBD: a device failing writes under `--wrap`,
//! its resilver after a restart, and bit rot healed.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::engine::{block_data, options, runtime};
use common::{cli, require_tool, run, Server};
use strata::block::{BlockDevice, IoBuf};
use strata::device::wrappers::IoOp;
use strata::device::{Device, ErrorDevice, ErrorRule, SimDevice};
use strata::pool::superblock::{ChildState, Role, Superblock, SUPERBLOCK_BYTES};
use strata::pool::vdev::Health;
use strata::pool::volume::EngineVolume;
use strata::pool::{NewVdev, Pool, ScrubJob, ScrubState, ScrubStatus};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 64;

struct Mirrored {
    sims: [SimDevice; 2],
    errors: [Arc<ErrorDevice>; 2],
}

impl Mirrored {
    fn new() -> Mirrored {
        Mirrored::sized(160 * MIB)
    }

    fn sized(size_bytes: u64) -> Mirrored {
        let sims = [SimDevice::new(size_bytes, 1), SimDevice::new(size_bytes, 2)];
        let errors = [0, 1].map(|i| Arc::new(ErrorDevice::new(sims[i].as_device(), Vec::new(), 9)));
        Mirrored { sims, errors }
    }

    /// The same devices opened again: no rules, no sticky error.
    fn reopened(self) -> Mirrored {
        let errors = [0, 1].map(|i| Arc::new(ErrorDevice::new(self.sims[i].as_device(), Vec::new(), 9)));
        Mirrored { errors, ..self }
    }

    fn devices(&self) -> Vec<Arc<dyn Device>> {
        self.errors.iter().map(|e| e.clone() as Arc<dyn Device>).collect()
    }

    async fn create(&self) -> Arc<Pool> {
        let vdevs = vec![NewVdev {
            role: Role::Fast,
            devices: self.devices(),
            write_mostly: Vec::new(),
        }];
        Pool::create_vdevs("m", 1 << 20, vdevs, options()).await.unwrap()
    }

    async fn open(&self, which: &[usize]) -> Arc<Pool> {
        let devices = which
            .iter()
            .map(|&i| -> Arc<dyn Device> { self.errors[i].clone() })
            .collect();
        Pool::open_with(devices, options()).await.unwrap()
    }

    fn superblock(&self, which: usize) -> Superblock {
        let bytes = self.sims[which].snapshot().read(0, SUPERBLOCK_BYTES);
        Superblock::decode(&bytes).unwrap()
    }
}

async fn write_all(volume: &EngineVolume, round: u8) {
    for block in 0..BLOCKS {
        volume
            .write(block * BLOCK, IoBuf::copy_from(&block_data(BLOCK, block, round)), false)
            .await
            .unwrap();
    }
    volume.flush().await.unwrap();
}

/// The test volume (id 1) of `pool`.
fn volume_of(pool: &Arc<Pool>) -> Arc<EngineVolume> {
    pool.open_volume(1, BLOCKS * BLOCK, BLOCK as u32).unwrap()
}

/// Round `round` written and destaged to its place on the devices.
async fn write_placed(pool: &Pool, volume: &EngineVolume, round: u8) {
    write_all(volume, round).await;
    pool.destage_all().await.unwrap();
}

async fn check_all(volume: &EngineVolume, round: u8) {
    for block in 0..BLOCKS {
        let (buf, result) = volume.read(block * BLOCK, IoBuf::new(BLOCK as usize)).await;
        result.unwrap_or_else(|e| panic!("block {block}: {e}"));
        assert!(
            buf.payload() == block_data(BLOCK, block, round),
            "block {block} differs"
        );
    }
}

fn children(pool: &Pool) -> Vec<(Health, u64, u64, u64)> {
    let status = pool.status();
    status[0]
        .children
        .iter()
        .map(|c| (c.state, c.checksum_errors, c.repaired_sectors, c.write_errors))
        .collect()
}

#[test]
fn a_rotten_copy_is_found_by_its_checksums_and_rewritten_from_the_other() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let pool = mirror.create().await;
        assert_eq!(pool.status()[0].children.len(), 2);
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, 1).await;
        // Rot in every block of one copy.
        let places: Vec<(u8, u64)> = (0..BLOCKS).map(|b| volume.block_place(b).unwrap().unwrap()).collect();
        for &(_, offset) in &places {
            mirror.sims[1].corrupt(offset + 4096, 512);
        }
        // Reads alternate between copies, so read each block twice.
        for block in 0..BLOCKS {
            for _ in 0..2 {
                let (buf, result) = volume.read(block * BLOCK, IoBuf::new(BLOCK as usize)).await;
                result.unwrap_or_else(|e| panic!("block {block}: {e}"));
                assert!(buf.payload() == block_data(BLOCK, block, 1), "block {block} differs");
            }
        }
        let after = children(&pool);
        assert_eq!(after[0].1, 0, "the good copy has no errors: {after:?}");
        assert_eq!(after[1].1, BLOCKS, "one bad sector per block: {after:?}");
        assert_eq!(after[1].2, BLOCKS, "each rewritten: {after:?}");
        assert_eq!(pool.status()[0].checksum_errors, 0, "no error reached a client");
        // The bad copy now holds the data again, durably: a power loss
        // right after the reads cannot bring the rot back.
        let image = mirror.sims[1].durable_snapshot();
        for (block, &(_, offset)) in places.iter().enumerate() {
            let bytes = image.read(offset, BLOCK as usize);
            assert!(
                bytes == block_data(BLOCK, block as u64, 1),
                "copy of block {block} not repaired"
            );
        }
    });
}

#[test]
fn one_reader_at_a_time_reads_each_copy_in_turn() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let pool = mirror.create().await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, 1).await;
        let reads = || mirror.sims.iter().map(|s| s.stats().reads).collect::<Vec<_>>();
        let before = reads();
        for _ in 0..8 {
            let (_, result) = volume.read(3 * BLOCK, IoBuf::new(BLOCK as usize)).await;
            result.unwrap();
        }
        let after = reads();
        let each: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(
            each,
            vec![4, 4],
            "eight reads, one after another, spread over both copies"
        );
    });
}

#[test]
fn a_repair_lost_to_a_power_cut_still_leaves_the_good_copy_known() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let pool = mirror.create().await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, 1).await;
        pool.checkpoint().await.unwrap();
        let place = volume.block_place(3).unwrap().unwrap();
        // Overwritten in place: its new checksums are in memory only
        // until the next checkpoint (an overwrite logs none).
        volume
            .write(3 * BLOCK, IoBuf::copy_from(&block_data(BLOCK, 3, 2)), false)
            .await
            .unwrap();
        volume.flush().await.unwrap();
        pool.destage_all().await.unwrap();
        volume.flush().await.unwrap();
        assert_eq!(volume.block_place(3).unwrap(), Some(place), "not overwritten in place");
        // The new copy rots on the device reads go to, a read rewrites it
        // from the other, and then the power fails as if that rewrite had
        // never landed.
        let reads = || mirror.sims.iter().map(|s| s.stats().reads).collect::<Vec<_>>();
        let before = reads();
        let (_, result) = volume.read(3 * BLOCK, IoBuf::new(BLOCK as usize)).await;
        result.unwrap();
        let which = if reads()[0] > before[0] { 0 } else { 1 };
        let at = place.1 + 8192;
        mirror.sims[which].corrupt(at, 512);
        let rotten = mirror.sims[which].durable_snapshot().read(at, 4096);
        for _ in 0..4 {
            let (buf, result) = volume.read(3 * BLOCK, IoBuf::new(BLOCK as usize)).await;
            result.unwrap();
            assert!(buf.payload() == block_data(BLOCK, 3, 2));
        }
        let healed = children(&pool);
        assert_eq!(healed[which].2, 1, "the rotten sector was rewritten: {healed:?}");
        mirror.sims[which].write_durable(at, &rotten);
        for sim in &mirror.sims {
            sim.crash();
        }
        drop(volume);
        drop(pool);
        let mirror = mirror.reopened();
        let pool = mirror.open(&[0, 1]).await;
        let volume = volume_of(&pool);
        // The checksums that told the copies apart were made durable
        // before the rewrite: the rotten copy is found again and healed,
        // never taken for the data.
        for _ in 0..4 {
            let (buf, result) = volume.read(3 * BLOCK, IoBuf::new(BLOCK as usize)).await;
            result.unwrap();
            assert!(
                buf.payload() == block_data(BLOCK, 3, 2),
                "block 3 differs after the power cut"
            );
        }
        let after = children(&pool);
        assert_eq!(
            (after[which].1, after[which].2),
            (1, 1),
            "the rotten copy healed: {after:?}"
        );
        let durable = mirror.sims[which].durable_snapshot().read(place.1, BLOCK as usize);
        assert!(durable == block_data(BLOCK, 3, 2), "the healed copy is durable");
    });
}

#[test]
fn bit_rot_in_both_copies_of_a_sector_is_an_error_not_garbage() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let pool = mirror.create().await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, 1).await;
        let (_, offset) = volume.block_place(3).unwrap().unwrap();
        // Different sectors of block 3 on each copy: each sector has one good copy.
        mirror.sims[0].corrupt(offset, 512);
        mirror.sims[1].corrupt(offset + 8192, 512);
        check_all(&volume, 1).await;
        // The same sector on both: no good copy is left.
        let (_, offset) = volume.block_place(5).unwrap().unwrap();
        mirror.sims[0].corrupt(offset, 512);
        mirror.sims[1].corrupt(offset, 512);
        let (_, result) = volume.read(5 * BLOCK, IoBuf::new(BLOCK as usize)).await;
        assert!(result.is_err(), "a sector with no good copy must fail its read");
        assert_eq!(pool.status()[0].checksum_errors, 1);
    });
}

#[test]
fn a_device_that_fails_writes_is_faulted_and_the_pool_goes_on_degraded() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let pool = mirror.create().await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, 1).await;
        mirror.errors[1].set_rules(vec![ErrorRule::always(&[IoOp::Write, IoOp::Flush])]);
        // Every write and flush still succeeds for the client.
        write_placed(&pool, &volume, 2).await;
        pool.checkpoint().await.unwrap();
        check_all(&volume, 2).await;
        let status = pool.status();
        assert_eq!(status[0].state, "DEGRADED");
        let after = children(&pool);
        assert_eq!(after[0].0, Health::Online);
        assert_eq!(after[1].0, Health::Faulted);
        assert!(after[1].3 >= 1, "the failed write is counted: {after:?}");
        // The surviving device's superblocks say the other missed writes.
        let recorded = mirror.superblock(0);
        assert_eq!(recorded.children[1].state, ChildState::Stale);
        assert_eq!(recorded.children[0].state, ChildState::Online);
        drop(volume);
        drop(pool);

        // Reopened with both devices (the failing one working again): the
        // stale one is not trusted, and the data is the newest.
        let mirror = mirror.reopened();
        let pool = mirror.open(&[0, 1]).await;
        assert_eq!(children(&pool)[1].0, Health::Resilvering);
        let volume = volume_of(&pool);
        check_all(&volume, 2).await;
        check_all(&volume, 2).await;
        // The resilver copies what it missed; then it is a copy again.
        let copied = pool.resilver().await.unwrap();
        assert!(copied >= BLOCKS * BLOCK, "copied {copied}");
        assert_eq!(children(&pool)[1].0, Health::Online);
        assert_eq!(pool.status()[0].state, "ONLINE");
        assert_eq!(mirror.superblock(0).children[1].state, ChildState::Online);
        assert_copy_holds(&mirror, 1, &volume, 2);
    });
}

/// Device `which` holds round `round` of every block where the volume maps it.
fn assert_copy_holds(mirror: &Mirrored, which: usize, volume: &EngineVolume, round: u8) {
    let image = mirror.sims[which].snapshot();
    for block in 0..BLOCKS {
        let (_, offset) = volume.block_place(block).unwrap().unwrap();
        assert!(
            image.read(offset, BLOCK as usize) == block_data(BLOCK, block, round),
            "device {which} lacks block {block} of round {round}"
        );
    }
}

#[test]
fn a_mirror_opens_without_one_device_and_never_reads_the_missing_one_again() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        {
            let pool = mirror.create().await;
            let volume = volume_of(&pool);
            write_placed(&pool, &volume, 1).await;
            pool.checkpoint().await.unwrap();
        }
        {
            // Device 1 is away: DEGRADED, writes go on.
            let pool = mirror.open(&[0]).await;
            assert_eq!(pool.status()[0].state, "DEGRADED");
            assert_eq!(children(&pool)[1].0, Health::Missing);
            let volume = volume_of(&pool);
            check_all(&volume, 1).await;
            write_placed(&pool, &volume, 2).await;
            pool.checkpoint().await.unwrap();
        }
        assert_eq!(mirror.superblock(0).children[1].state, ChildState::Stale);
        // Back with both: device 1 still holds round 1 and is not read
        // until it is resilvered; it takes the writes meanwhile.
        let pool = mirror.open(&[1, 0]).await;
        assert_eq!(children(&pool)[1].0, Health::Resilvering);
        let volume = volume_of(&pool);
        check_all(&volume, 2).await;
        check_all(&volume, 2).await;
        drop(volume);
        drop(pool);
        // Its own superblock now says so too: alone, it does not open.
        let error = Pool::open_with(vec![mirror.errors[1].clone() as Arc<dyn Device>], options())
            .await
            .err()
            .expect("a stale device alone must not open the pool");
        assert!(error.to_string().contains("missing"), "{error}");
        // With the other it is resilvered, and serves its copy after.
        let pool = mirror.open(&[0, 1]).await;
        pool.resilver().await.unwrap();
        let volume = volume_of(&pool);
        assert_copy_holds(&mirror, 1, &volume, 2);
        drop(volume);
        drop(pool);
        let pool = mirror.open(&[1]).await;
        assert_eq!(pool.status()[0].state, "DEGRADED");
        let volume = volume_of(&pool);
        check_all(&volume, 2).await;
    });
}

/// A pool written (round 1), opened without device 1 and, if `rewrite`,
/// written again (round 2); `tracked`: left as its dirty record has it,
/// else with device 1's entry stale without a record (a full resilver).
async fn away_and_back(mirror: &Mirrored, rewrite: bool, tracked: bool) {
    {
        let pool = mirror.create().await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, 1).await;
    }
    {
        let pool = mirror.open(&[0]).await;
        if rewrite {
            let volume = volume_of(&pool);
            write_placed(&pool, &volume, 2).await;
            pool.checkpoint().await.unwrap();
        }
    }
    assert!(mirror.superblock(0).children[1].tracked);
    if !tracked {
        rewrite_superblock(mirror, 0, |s| s.children[1].tracked = false);
    }
}

#[test]
fn a_resilver_cut_short_resumes_where_it_stopped() {
    // In full, and from the dirty record.
    for tracked in [false, true] {
        runtime().block_on(async {
            let mirror = Mirrored::new();
            away_and_back(&mirror, true, tracked).await;
            let first = {
                let pool = mirror.open(&[0, 1]).await;
                let copied = pool.resilver_at_most(4 << 20).await.unwrap();
                assert_eq!(children(&pool)[1].0, Health::Resilvering, "paused, not done");
                copied
            };
            let cursor = mirror.superblock(0).children[1].resilvered;
            assert!(cursor > 0, "the cursor is recorded");
            assert_eq!(mirror.superblock(0).children[1].state, ChildState::Stale);
            assert_eq!(mirror.superblock(0).children[1].tracked, tracked);
            // The next open resumes at the cursor: the rest only is copied.
            let pool = mirror.open(&[0, 1]).await;
            let rest = pool.resilver().await.unwrap();
            assert_eq!(children(&pool)[1].0, Health::Online);
            // The same history resilvered in one go; in full, a pool that
            // only went away copies as much (the same chunks are in use).
            let whole = {
                let fresh = Mirrored::new();
                away_and_back(&fresh, tracked, tracked).await;
                let pool = fresh.open(&[0, 1]).await;
                pool.resilver().await.unwrap()
            };
            eprintln!("tracked {tracked}: copied {first} then {rest}, whole {whole}");
            assert!(
                first >= 4 << 20 && rest < whole,
                "copied {first} then {rest}, whole {whole}"
            );
            if tracked {
                // The paused open's own writes may dirty a unit or two more.
                assert!(
                    first + rest <= whole + (2 << 20),
                    "copied {first} then {rest}, whole {whole}"
                );
                assert!(whole < 32 << 20, "only what changed: {whole}");
            } else {
                assert_eq!(first + rest, whole, "no byte copied twice, none skipped");
            }
            let volume = volume_of(&pool);
            assert_copy_holds(&mirror, 1, &volume, 2);
        });
    }
}

#[test]
fn devices_of_a_mirror_used_apart_are_refused_together() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        drop(mirror.create().await);
        for (alone, round) in [(0, 1), (1, 2)] {
            // Each alone: neither superblock knows what the other did.
            let pool = mirror.open(&[alone]).await;
            let volume = volume_of(&pool);
            write_all(&volume, round).await;
            pool.destage_all().await.unwrap();
        }
        let error = Pool::open_with(mirror.devices(), options())
            .await
            .err()
            .expect("devices used apart must not open together");
        assert!(
            error.to_string().contains("each say the other missed writes"),
            "{error}"
        );
    });
}

/// The pool's status as JSON.
fn pool_json(server: &Server) -> serde_json::Value {
    let status = cli(server, &["pool", "status", "tank", "--json"]);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    serde_json::from_slice(&status.stdout).unwrap()
}

/// The mirror's device rows (the pool's only member).
fn mirror_children(status: &serde_json::Value) -> Vec<serde_json::Value> {
    status["devices"][0]["children"].as_array().cloned().unwrap_or_default()
}

#[test]
fn a_mirror_under_the_daemon_outlives_a_failing_device_resilvers_it_and_heals_rot() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let a = common::sparse_file(dir.path(), "a.img", 256 << 20);
    let b = common::sparse_file(dir.path(), "b.img", 256 << 20);
    let data = dir.path().join("data");
    // The metadata and log regions end at 97 MiB (a 1 MiB header, 32 MiB
    // of metadata, 64 MiB of log); writes past 100 MiB on b fail.
    let mut server = Server::start(&data);
    let spec = format!("mirror:{a},{b}");
    // b takes reads only when a cannot: every read below goes to a.
    let created = cli(
        &server,
        &["pool", "create", "tank", "--capacity", &spec, "--write-mostly", &b],
    );
    assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    let volume = cli(&server, &["volume", "create", "tank/v", "--size", "64M"]);
    assert!(volume.status.success(), "{}", String::from_utf8_lossy(&volume.stderr));
    assert_eq!(mirror_children(&pool_json(&server)).len(), 2);
    assert!(server.stop().success());
    let wrap = format!("{b}=error:write,offset=100M-256M");
    let mut server = Server::start_with_args(&data, Some(&data), &["--wrap", &wrap]);
    let uri = server.uri("tank/v");
    // No error reaches the client; the data reads back.
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5a 0 32M", "-c", "flush"])
        .arg(&uri));
    let synced = cli(&server, &["pool", "sync", "tank"]);
    assert!(synced.status.success(), "{}", String::from_utf8_lossy(&synced.stderr));
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x5a 0 32M"])
        .arg(&uri));
    let status = pool_json(&server);
    assert_eq!(status["state"], "DEGRADED", "{status}");
    let children = mirror_children(&status);
    assert_eq!(children[0]["state"], "ONLINE", "{status}");
    assert_eq!(children[1]["state"], "FAULTED", "{status}");
    assert!(children[1]["write_errors"].as_u64().unwrap() >= 1, "{status}");
    assert!(status["action"].as_str().unwrap().contains("faulted"), "{status}");
    let text = cli(&server, &["pool", "status", "tank"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("FAULTED") && text.contains("is DEGRADED"), "{text}");
    // Its return copies only what the writes since the fault changed.
    assert!(children[1]["changed_bytes"].as_u64().is_some(), "{status}");
    assert!(
        text.lines()
            .any(|l| l.contains(&b) && l.contains(" of mirror-") && l.contains(" is FAULTED: at most ")),
        "{text}"
    );
    assert!(server.stop().success());

    // Without the failing writes: b is resilvered in the background.
    let mut server = Server::start(&data);
    let mut waited = 0;
    loop {
        let status = pool_json(&server);
        if status["state"] == "ONLINE" {
            break;
        }
        assert!(waited < 600, "the resilver did not finish: {status}");
        std::thread::sleep(std::time::Duration::from_millis(100));
        waited += 1;
    }
    assert!(server.stop().success());

    // Rot in a's copy of the data, under a running daemon (nothing cached
    // yet): reads return the data, and the rotten sectors are rewritten.
    let server = Server::start(&data);
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&a).unwrap();
        let mut byte = [0u8; 1];
        for sector in 0..256u64 {
            let at = (97 << 20) + sector * 4096 + 100;
            file.read_exact_at(&mut byte, at).unwrap();
            byte[0] ^= 0x40;
            file.write_all_at(&byte, at).unwrap();
        }
        file.sync_all().unwrap();
    }
    let uri = server.uri("tank/v");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x5a 0 32M"])
        .arg(&uri));
    let status = pool_json(&server);
    let children = mirror_children(&status);
    assert_eq!(children[1]["write_mostly"], true, "{status}");
    assert_eq!(
        children[0]["checksum_errors"], 256,
        "every rotten sector was found: {status}"
    );
    assert_eq!(children[0]["repaired_sectors"], 256, "and rewritten: {status}");
    assert_eq!(
        status["devices"][0]["checksum_errors"], 0,
        "no error reached a client: {status}"
    );
    // Rewritten: a's copy of those sectors is b's again.
    let range = |path: &str| {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0u8; 1 << 20];
        std::fs::File::open(path)
            .unwrap()
            .read_exact_at(&mut bytes, 97 << 20)
            .unwrap();
        bytes
    };
    assert!(
        range(&a) == range(&b),
        "the rotten copy was rewritten from the good one"
    );
    drop(server);
}

// A returning device is resilvered from the mirror's dirty record: only
// the units written while it was away are copied.

/// 64 MiB of data in 64 KiB blocks.
const BIG_BLOCKS: u64 = 1024;
/// The places rewritten while a device is away: three runs of 1 MiB.
const CHANGED: [std::ops::Range<u64>; 3] = [100..116, 500..516, 1000..1016];

fn big_volume(pool: &Arc<Pool>) -> Arc<EngineVolume> {
    pool.open_volume(1, BIG_BLOCKS * BLOCK, BLOCK as u32).unwrap()
}

/// The round each block of the big volume holds after the changes.
fn round_of(block: u64) -> u8 {
    if CHANGED.iter().any(|r| r.contains(&block)) {
        2
    } else {
        1
    }
}

async fn write_blocks(pool: &Pool, volume: &EngineVolume, blocks: impl Iterator<Item = u64>, round: u8) {
    common::engine::write_placed(pool, volume, BLOCK, blocks, round).await;
    pool.checkpoint().await.unwrap();
}

async fn check_big(volume: &EngineVolume) {
    for block in 0..BIG_BLOCKS {
        let (buf, result) = volume.read(block * BLOCK, IoBuf::new(BLOCK as usize)).await;
        result.unwrap_or_else(|e| panic!("block {block}: {e}"));
        assert!(
            buf.payload() == block_data(BLOCK, block, round_of(block)),
            "block {block} differs"
        );
    }
}

/// A pool with the big volume written whole (round 1), closed.
async fn big_pool(mirror: &Mirrored) {
    let pool = mirror.create().await;
    let volume = big_volume(&pool);
    write_blocks(&pool, &volume, 0..BIG_BLOCKS, 1).await;
}

/// 1 MiB units outside the header where two images differ.
fn differing_units(a: &strata::device::sim::SimImage, b: &strata::device::sim::SimImage) -> Vec<u64> {
    let mut units: Vec<u64> = a
        .differing_sectors(b)
        .into_iter()
        .map(|o| o / MIB)
        .filter(|&u| u > 0)
        .collect();
    units.dedup();
    units
}

/// Opens `mirror` with both devices (device 1 stale), resilvers, and
/// returns the bytes copied and the 1 MiB units device 0 changed in since
/// `before` (the session without device 1, and this open's own writes).
/// `pool status` shows beforehand at most what is copied, or that the
/// copy is whole when the record does not cover the device.
async fn resilver_back(mirror: &Mirrored, before: &strata::device::sim::SimImage) -> (u64, Vec<u64>) {
    let pool = mirror.open(&[0, 1]).await;
    assert_eq!(children(&pool)[1].0, Health::Resilvering);
    let shown = pool.status()[0].children[1].changed_bytes;
    let changed = differing_units(before, &mirror.sims[0].snapshot());
    let copied = pool.resilver().await.unwrap();
    match shown {
        Some(bytes) => assert!(copied <= bytes, "copied {copied}, status said at most {bytes}"),
        None => assert!(copied >= FULL_AT_LEAST, "copied {copied}: status said in full"),
    }
    assert_eq!(children(&pool)[1].0, Health::Online);
    assert_eq!(mirror.superblock(0).children[1].state, ChildState::Online);
    assert!(!mirror.superblock(0).children[1].tracked);
    (copied, changed)
}

/// Device 1 alone serves every block, old and new.
async fn check_alone(mirror: &Mirrored, which: usize) {
    let pool = mirror.open(&[which]).await;
    assert_eq!(pool.status()[0].state, "DEGRADED");
    let volume = big_volume(&pool);
    check_big(&volume).await;
}

/// What a full resilver of the same pool copies: the metadata and log
/// regions and every assigned chunk (over 64 MiB of data).
const FULL_AT_LEAST: u64 = (32 + 64 + 64) * MIB;

#[test]
fn a_device_back_after_an_absence_is_resilvered_only_where_the_mirror_changed() {
    runtime().block_on(async {
        let mirror = Mirrored::sized(256 * MIB);
        big_pool(&mirror).await;
        let before = mirror.sims[0].snapshot();
        {
            let pool = mirror.open(&[0]).await;
            assert_eq!(children(&pool)[1].0, Health::Missing);
            let volume = big_volume(&pool);
            write_blocks(&pool, &volume, CHANGED.into_iter().flatten(), 2).await;
            // `pool status` says the return copies little.
            let shown = pool.status()[0].children[1].changed_bytes;
            assert!(
                shown.is_some_and(|bytes| (3 * MIB..FULL_AT_LEAST / 8).contains(&bytes)),
                "{shown:?}"
            );
        }
        let recorded = mirror.superblock(0);
        assert_eq!(recorded.children[1].state, ChildState::Stale);
        assert!(recorded.children[1].tracked, "the record covers its absence");
        let (copied, changed) = resilver_back(&mirror, &before).await;
        let changed_bytes = changed.len() as u64 * MIB;
        eprintln!("copied {copied} bytes; {} units changed", changed.len());
        // At least the 3 MiB rewritten, at most what changed (plus the
        // units written with the same bytes), far below a full resilver.
        assert!(copied >= 3 * MIB, "copied {copied}");
        assert!(
            copied <= changed_bytes + 4 * MIB,
            "copied {copied}, changed {changed_bytes}"
        );
        assert!(copied * 8 < FULL_AT_LEAST, "copied {copied}");
        // Device 0 away now: device 1 alone holds every byte.
        check_alone(&mirror, 1).await;
    });
}

#[test]
fn a_device_faulted_by_write_errors_is_resilvered_only_where_writes_went_on() {
    runtime().block_on(async {
        let mirror = Mirrored::sized(256 * MIB);
        big_pool(&mirror).await;
        let mirror = mirror.reopened();
        let before = mirror.sims[0].snapshot();
        {
            let pool = mirror.open(&[0, 1]).await;
            let volume = big_volume(&pool);
            mirror.errors[1].set_rules(vec![ErrorRule::always(&[IoOp::Write, IoOp::Flush])]);
            write_blocks(&pool, &volume, CHANGED.into_iter().flatten(), 2).await;
            assert_eq!(children(&pool)[1].0, Health::Faulted);
            let recorded = mirror.superblock(0);
            assert_eq!(recorded.children[1].state, ChildState::Stale);
            assert!(recorded.children[1].tracked, "the record covers what it missed");
            check_big(&volume).await;
        }
        // The same path, working again.
        let mirror = mirror.reopened();
        let (copied, changed) = resilver_back(&mirror, &before).await;
        let changed_bytes = changed.len() as u64 * MIB;
        eprintln!("copied {copied} bytes; {} units changed", changed.len());
        assert!(copied >= 3 * MIB, "copied {copied}");
        assert!(
            copied <= changed_bytes + 4 * MIB,
            "copied {copied}, changed {changed_bytes}"
        );
        assert!(copied * 8 < FULL_AT_LEAST, "copied {copied}");
        check_alone(&mirror, 1).await;
    });
}

/// Rewrites device `which`'s superblocks as `change` makes them.
fn rewrite_superblock(mirror: &Mirrored, which: usize, change: impl Fn(&mut Superblock)) {
    let mut superblock = mirror.superblock(which);
    change(&mut superblock);
    for offset in superblock.copy_offsets() {
        mirror.sims[which].write_durable(*offset, &superblock.encode());
    }
}

#[test]
fn a_stale_device_without_a_whole_dirty_record_is_resilvered_in_full() {
    // The record damaged on the up-to-date device (a torn or rotten
    // copy), or a stale entry that never had one (as every pool from
    // before dirty records): the whole device is copied, and is right.
    for case in ["damaged record", "untracked entry"] {
        runtime().block_on(async {
            let mirror = Mirrored::sized(256 * MIB);
            big_pool(&mirror).await;
            let before = mirror.sims[0].snapshot();
            {
                let pool = mirror.open(&[0]).await;
                let volume = big_volume(&pool);
                write_blocks(&pool, &volume, CHANGED.into_iter().flatten(), 2).await;
            }
            assert!(mirror.superblock(0).children[1].tracked);
            match case {
                "damaged record" => {
                    for offset in strata::pool::dirty::RECORD_OFFSETS {
                        mirror.sims[0].corrupt(offset, 64);
                    }
                }
                _ => rewrite_superblock(&mirror, 0, |s| s.children[1].tracked = false),
            }
            let (copied, changed) = resilver_back(&mirror, &before).await;
            eprintln!("{case}: copied {copied} bytes; {} units changed", changed.len());
            assert!(copied >= FULL_AT_LEAST, "{case}: copied {copied}");
            check_alone(&mirror, 1).await;
        });
    }
}

/// A new pool with round 1 placed and checkpointed, and round 2
/// acknowledged and flushed but not checkpointed: a recovery replays the
/// log for it.
async fn round_two_in_the_log(mirror: &Mirrored) -> (Arc<Pool>, Arc<EngineVolume>) {
    let pool = mirror.create().await;
    let volume = volume_of(&pool);
    write_placed(&pool, &volume, 1).await;
    pool.checkpoint().await.unwrap();
    write_all(&volume, 2).await;
    (pool, volume)
}

/// Bit rot over device `which`'s whole log region.
fn rot_log(mirror: &Mirrored, which: usize) {
    let superblock = mirror.superblock(which);
    mirror.sims[which].corrupt(superblock.log_offset, superblock.log_bytes);
}

#[test]
fn rot_in_one_copy_of_the_log_is_found_by_the_scrub_and_retired_by_a_checkpoint() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let (pool, volume) = round_two_in_the_log(&mirror).await;
        rot_log(&mirror, 1);
        let checkpoints = pool.meta_counters().checkpoints;
        let job = ScrubJob::new(ScrubStatus::new(0));
        pool.set_scrub_job(job.clone()).unwrap();
        pool.run_scrub(&job, std::time::Duration::from_secs(3600), &|_| {})
            .await;
        let status = job.status();
        assert_eq!((status.state, status.errors), (ScrubState::Finished, 0), "{status:?}");
        assert!(
            status.repaired_bytes > 0,
            "the damaged log blocks count as repaired: {status:?}"
        );
        let after = children(&pool);
        assert_eq!(after[0].1, 0, "the good copy has no errors: {after:?}");
        assert!(after[1].1 > 0, "the rotten copy's errors are counted: {after:?}");
        assert!(
            pool.meta_counters().checkpoints > checkpoints,
            "a checkpoint retired them"
        );
        // A power cut, then the rotten copy alone: it opens with round 2.
        for sim in &mirror.sims {
            sim.crash();
        }
        drop(volume);
        drop(pool);
        let mirror = mirror.reopened();
        let pool = mirror.open(&[1]).await;
        check_all(&volume_of(&pool), 2).await;
        // A scrub of a pool whose log is intact finds nothing.
        let job = ScrubJob::new(ScrubStatus::new(0));
        pool.set_scrub_job(job.clone()).unwrap();
        pool.run_scrub(&job, std::time::Duration::from_secs(3600), &|_| {})
            .await;
        let clean = job.status();
        assert_eq!((clean.errors, clean.repaired_bytes), (0, 0), "{clean:?}");
    });
}

#[test]
fn a_copy_of_the_log_cut_short_by_rot_is_not_the_one_replayed() {
    runtime().block_on(async {
        let mirror = Mirrored::new();
        let (pool, volume) = round_two_in_the_log(&mirror).await;
        // Rot in the first device's log (the one the pool would read first
        // while it opens), then a power cut.
        rot_log(&mirror, 0);
        for sim in &mirror.sims {
            sim.crash();
        }
        drop(volume);
        drop(pool);
        let mirror = mirror.reopened();
        let pool = mirror.open(&[0, 1]).await;
        check_all(&volume_of(&pool), 2).await;
        drop(pool);
        // The open copied the replayed log over the rotten one: that device
        // alone opens with round 2 too.
        for sim in &mirror.sims {
            sim.crash();
        }
        let mirror = mirror.reopened();
        let pool = mirror.open(&[0]).await;
        check_all(&volume_of(&pool), 2).await;
    });
}
