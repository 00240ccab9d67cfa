//! Attaching, detaching and replacing mirror devices while a pool runs. At
//! engine level, on simulated devices: a single device becomes a mirror
//! and the new copy alone then holds the data; a copy attached while a
//! writer runs misses nothing; a missing or present device is replaced;
//! detaches that would leave no up-to-date copy are refused; an attach's
//! resilver cut short resumes at its cursor; a detached device is left out
//! when it is given again. Under the daemon, through NBD: an attach while
//! qemu-io writes, a kill -9 during its resilver, a replace, and the
//! original device's file removed.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::engine::{block_data, options, runtime, write_placed};
use common::{cli, require_tool, Server};
use strata::block::{BlockDevice, IoBuf};
use strata::device::SimDevice;
use strata::pool::superblock::{ChildState, Role, Superblock, SUPERBLOCK_BYTES};
use strata::pool::vdev::Health;
use strata::pool::volume::EngineVolume;
use strata::pool::{DeviceSpec, NewVdev, Pool};

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 64;

fn sim(seed: u64) -> SimDevice {
    SimDevice::new(160 * MIB, seed)
}

async fn single_pool(device: &SimDevice) -> Arc<Pool> {
    let vdevs = vec![NewVdev {
        role: Role::Fast,
        devices: vec![device.as_device()],
        write_mostly: Vec::new(),
    }];
    Pool::create_vdevs("a", 1 << 20, vdevs, options()).await.unwrap()
}

async fn open(devices: &[&SimDevice]) -> Arc<Pool> {
    Pool::open_with(devices.iter().map(|d| d.as_device()).collect(), options())
        .await
        .unwrap()
}

fn volume_of(pool: &Arc<Pool>) -> Arc<EngineVolume> {
    pool.open_volume(1, BLOCKS * BLOCK, BLOCK as u32).unwrap()
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

/// `device` holds round `round` of every block where the volume maps it.
fn assert_holds(device: &SimDevice, volume: &EngineVolume, round: u8) {
    let image = device.snapshot();
    for block in 0..BLOCKS {
        let (_, offset) = volume.block_place(block).unwrap().unwrap();
        assert!(
            image.read(offset, BLOCK as usize) == block_data(BLOCK, block, round),
            "the device lacks block {block} of round {round}"
        );
    }
}

fn superblock(device: &SimDevice) -> Superblock {
    Superblock::decode(&device.snapshot().read(0, SUPERBLOCK_BYTES)).unwrap()
}

/// The member's children: (state, replaced, replacement).
fn children(pool: &Pool) -> Vec<(Health, bool, bool)> {
    pool.status()[0]
        .children
        .iter()
        .map(|c| (c.state, c.replaced, c.replacement))
        .collect()
}

fn spec(uuid: [u8; 16]) -> DeviceSpec {
    DeviceSpec::Uuid(uuid)
}

#[test]
fn a_single_device_becomes_a_mirror_and_the_new_copy_alone_holds_the_data() {
    runtime().block_on(async {
        let (a, b) = (sim(1), sim(2));
        let pool = single_pool(&a).await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        let member = superblock(&a).members[0].uuid;
        pool.attach(&spec(member), b.as_device()).await.unwrap();
        assert_eq!(
            children(&pool),
            [(Health::Online, false, false), (Health::Resilvering, false, false)]
        );
        // Writes land on the new device from now on; reads only once resilvered.
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 2).await;
        check_all(&volume, 2).await;
        let recorded = superblock(&a);
        assert_eq!(recorded.children.len(), 2);
        assert_eq!(recorded.children[0].uuid, member, "the old device keeps its uuid");
        assert_eq!(recorded.children[1].state, ChildState::Stale);
        assert_eq!(superblock(&b).device_uuid, recorded.children[1].uuid);
        let copied = pool.resilver().await.unwrap();
        assert!(copied >= BLOCKS * BLOCK, "copied {copied}");
        assert_eq!(
            children(&pool),
            [(Health::Online, false, false), (Health::Online, false, false)]
        );
        assert_eq!(pool.status()[0].state, "ONLINE");
        assert_eq!(superblock(&a).children[1].state, ChildState::Online);
        assert_holds(&b, &volume, 2);
        // The original's copy of every block rots: reads come back intact.
        for block in 0..BLOCKS {
            let (_, offset) = volume.block_place(block).unwrap().unwrap();
            a.corrupt(offset, BLOCK);
        }
        check_all(&volume, 2).await;
        check_all(&volume, 2).await;
        assert_eq!(pool.status()[0].checksum_errors, 0, "no error reached a client");
        drop(volume);
        pool.checkpoint().await.unwrap();
        drop(pool);
        // And the new device alone opens the pool (DEGRADED) with the data.
        let pool = open(&[&b]).await;
        assert_eq!(pool.status()[0].state, "DEGRADED");
        let volume = volume_of(&pool);
        check_all(&volume, 2).await;
    });
}

/// A writer keeps writing while a device is attached and resilvered: the
/// new copy misses none of its writes.
#[test]
fn a_copy_attached_under_a_running_writer_misses_no_write() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (a, b) = (sim(3), sim(4));
        let pool = single_pool(&a).await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (volume, stop) = (volume.clone(), stop.clone());
            tokio::spawn(async move {
                let mut round = 2u8;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for block in 0..BLOCKS {
                        let data = IoBuf::copy_from(&block_data(BLOCK, block, round));
                        volume.write(block * BLOCK, data, false).await.unwrap();
                    }
                    volume.flush().await.unwrap();
                    round += 1;
                }
                round - 1
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let member = superblock(&a).members[0].uuid;
        pool.attach(&spec(member), b.as_device()).await.unwrap();
        pool.resilver().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let last = writer.await.unwrap();
        pool.destage_all().await.unwrap();
        assert_eq!(
            children(&pool),
            [(Health::Online, false, false), (Health::Online, false, false)]
        );
        check_all(&volume, last).await;
        assert_holds(&b, &volume, last);
        assert_holds(&a, &volume, last);
    });
}

#[test]
fn a_present_single_device_is_replaced_and_left_out_when_given_again() {
    runtime().block_on(async {
        let (a, b) = (sim(5), sim(6));
        let pool = single_pool(&a).await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        let old = superblock(&a).members[0].uuid;
        pool.replace(&spec(old), b.as_device()).await.unwrap();
        assert_eq!(
            children(&pool),
            [(Health::Online, true, false), (Health::Resilvering, false, true)]
        );
        // A second replacement in the same mirror waits for this one.
        let busy = pool.replace(&spec(old), sim(7).as_device()).await.unwrap_err();
        assert!(busy.to_string().contains("already under way"), "{busy}");
        pool.resilver().await.unwrap();
        // The old device is detached: a mirror of one, the new device.
        assert_eq!(children(&pool), [(Health::Online, false, false)]);
        let detached = pool.take_detached();
        assert_eq!(detached.len(), 1);
        assert!(!pool.uses_device(&detached[0]).await);
        let recorded = superblock(&b);
        assert_eq!(recorded.children.len(), 1);
        assert_ne!(recorded.children[0].uuid, old);
        check_all(&volume, 1).await;
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 2).await;
        drop(volume);
        pool.checkpoint().await.unwrap();
        drop(pool);
        // Given again, the old device is left out (its superblock is older
        // and the pool no longer lists it): the data is the newest.
        let pool = open(&[&a, &b]).await;
        assert_eq!(children(&pool), [(Health::Online, false, false)]);
        assert_eq!(pool.take_detached().len(), 1);
        let volume = volume_of(&pool);
        check_all(&volume, 2).await;
        // Cleared, it can be used again.
        pool.forget_device(&a.as_device()).await.unwrap();
        assert!(Superblock::decode(&a.snapshot().read(0, SUPERBLOCK_BYTES)).is_err());
    });
}

#[test]
fn a_missing_mirror_device_is_replaced_from_the_other() {
    runtime().block_on(async {
        let (a, b, c) = (sim(8), sim(9), sim(10));
        let vdevs = vec![NewVdev {
            role: Role::Fast,
            devices: vec![a.as_device(), b.as_device()],
            write_mostly: Vec::new(),
        }];
        let pool = Pool::create_vdevs("m", 1 << 20, vdevs, options()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        pool.checkpoint().await.unwrap();
        drop(volume);
        drop(pool);
        let gone = superblock(&b).device_uuid;
        let pool = open(&[&a]).await;
        assert_eq!(children(&pool)[1].0, Health::Missing);
        // Its status name is how a missing device is given.
        let named = pool.status()[0].children[1].name.clone();
        assert_eq!(DeviceSpec::parse(&named), spec(gone));
        pool.replace(&DeviceSpec::parse(&named), c.as_device()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 2).await;
        pool.resilver().await.unwrap();
        assert_eq!(
            children(&pool),
            [(Health::Online, false, false), (Health::Online, false, false)]
        );
        assert_eq!(pool.status()[0].state, "ONLINE");
        assert!(pool.take_detached().is_empty(), "nothing to clear: it was missing");
        assert_holds(&c, &volume, 2);
        drop(volume);
        pool.checkpoint().await.unwrap();
        drop(pool);
        let pool = open(&[&c, &a]).await;
        assert_eq!(pool.status()[0].state, "ONLINE");
        check_all(&volume_of(&pool), 2).await;
    });
}

#[test]
fn detaching_the_last_up_to_date_copy_or_a_single_device_is_refused() {
    runtime().block_on(async {
        let (a, b) = (sim(11), sim(12));
        let pool = single_pool(&a).await;
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        let member = superblock(&a).members[0].uuid;
        let error = pool.detach(&spec(member)).await.err().unwrap();
        assert!(error.to_string().contains("not part of a mirror"), "{error}");
        pool.attach(&spec(member), b.as_device()).await.unwrap();
        // b is still resilvering: a is the only up-to-date copy.
        let error = pool.detach(&spec(member)).await.err().unwrap();
        assert!(error.to_string().contains("only up-to-date device"), "{error}");
        let unknown = pool.detach(&DeviceSpec::Path("/nowhere".into())).await.err().unwrap();
        assert!(unknown.to_string().contains("is not a device of pool"), "{unknown}");
        // Detaching the one being resilvered is allowed (an attach undone).
        let new = superblock(&b).device_uuid;
        let handle = pool.detach(&spec(new)).await.unwrap().unwrap();
        assert_eq!(children(&pool), [(Health::Online, false, false)]);
        pool.forget_device(&handle).await.unwrap();
        check_all(&volume, 1).await;
        // The last device of a mirror of one is its only copy.
        let error = pool.detach(&spec(member)).await.err().unwrap();
        assert!(error.to_string().contains("only up-to-date device"), "{error}");
        // A device the pool uses is never cleared.
        assert!(pool.forget_device(&a.as_device()).await.is_err());
        // Attached again, resilvered, then the original detached: b alone.
        pool.attach(&spec(member), b.as_device()).await.unwrap();
        pool.resilver().await.unwrap();
        pool.detach(&spec(member)).await.unwrap();
        check_all(&volume, 1).await;
        drop(volume);
        pool.checkpoint().await.unwrap();
        drop(pool);
        check_all(&volume_of(&open(&[&b]).await), 1).await;
    });
}

#[test]
fn an_attachs_resilver_cut_short_resumes_at_its_cursor() {
    runtime().block_on(async {
        let (a, b) = (sim(13), sim(14));
        {
            let pool = single_pool(&a).await;
            let volume = volume_of(&pool);
            write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
            let member = superblock(&a).members[0].uuid;
            pool.attach(&spec(member), b.as_device()).await.unwrap();
            pool.resilver_at_most(8 << 20).await.unwrap();
            assert_eq!(children(&pool)[1].0, Health::Resilvering, "paused, not done");
            // The pool stops here (no checkpoint: as a kill would).
        }
        let cursor = superblock(&a).children[1].resilvered;
        assert!(cursor > 0, "the cursor is recorded");
        let pool = open(&[&a, &b]).await;
        assert_eq!(children(&pool)[1].0, Health::Resilvering);
        let rest = pool.resilver().await.unwrap();
        assert!(rest > 0);
        assert_eq!(children(&pool)[1].0, Health::Online);
        let volume = volume_of(&pool);
        check_all(&volume, 1).await;
        assert_holds(&b, &volume, 1);
        // An attach that never reached the old device: given with it, the
        // new device's own superblock makes it a stale copy, resilvered.
        drop(volume);
        drop(pool);
    });
}

#[test]
fn an_attachs_resilver_cut_again_and_again_copies_each_unit_once() {
    runtime().block_on(async {
        let attached = |a: SimDevice, b: SimDevice| async move {
            let pool = single_pool(&a).await;
            let volume = volume_of(&pool);
            write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
            let member = superblock(&a).members[0].uuid;
            pool.attach(&spec(member), b.as_device()).await.unwrap();
            pool
        };
        // The same history resilvered in one go.
        let whole = attached(sim(21), sim(22)).await.resilver().await.unwrap();
        let (a, b) = (sim(23), sim(24));
        drop(attached(a.clone(), b.clone()).await);
        // Each cut ends inside a run of units copied at once (11 MiB: 8
        // units, then 3), and the pool stops there, as a kill would.
        let (mut copied, mut cursor) = (0, 0);
        let pool = loop {
            let pool = open(&[&a, &b]).await;
            if children(&pool)[1].0 == Health::Online {
                break pool;
            }
            assert!(copied < whole, "copied {copied} of {whole} and not done");
            copied += pool.resilver_at_most(11 * MIB).await.unwrap();
            drop(pool);
            let next = superblock(&a).children[1].resilvered;
            assert!(next > cursor || next == 0, "the cursor moves on: {cursor} then {next}");
            cursor = next;
        };
        assert_eq!(copied, whole, "no byte copied twice, none skipped");
        let volume = volume_of(&pool);
        check_all(&volume, 1).await;
        assert_holds(&b, &volume, 1);
    });
}

#[test]
fn a_faulted_mirror_device_is_replaced_and_then_forgotten() {
    use strata::device::wrappers::IoOp;
    use strata::device::{ErrorDevice, ErrorRule};
    runtime().block_on(async {
        let (a, b, c) = (sim(15), sim(16), sim(17));
        let failing = Arc::new(ErrorDevice::new(b.as_device(), Vec::new(), 3));
        let vdevs = vec![NewVdev {
            role: Role::Fast,
            devices: vec![a.as_device(), failing.clone()],
            write_mostly: Vec::new(),
        }];
        let pool = Pool::create_vdevs("f", 1 << 20, vdevs, options()).await.unwrap();
        let volume = volume_of(&pool);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
        failing.set_rules(vec![ErrorRule::always(&[IoOp::Write, IoOp::Flush])]);
        write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 2).await;
        assert_eq!(children(&pool)[1].0, Health::Faulted);
        let name = pool.status()[0].children[1].name.clone();
        pool.replace(&DeviceSpec::Path(name), c.as_device()).await.unwrap();
        assert_eq!(
            children(&pool),
            [
                (Health::Online, false, false),
                (Health::Faulted, true, false),
                (Health::Resilvering, false, true)
            ]
        );
        pool.resilver().await.unwrap();
        assert_eq!(
            children(&pool),
            [(Health::Online, false, false), (Health::Online, false, false)]
        );
        assert_eq!(pool.status()[0].state, "ONLINE");
        // The faulted device is handed over to be forgotten.
        assert_eq!(pool.take_detached().len(), 1);
        assert_holds(&c, &volume, 2);
        check_all(&volume, 2).await;
    });
}

/// A crash between an attach's superblock writes: the new device's is
/// written, the old device's is not. The pool opens with the old device
/// alone as before, or with both, the new one then a stale copy that is
/// resilvered; never with neither, and the data is there either way.
#[test]
fn an_attach_cut_short_between_its_superblock_writes_opens_with_or_without_the_new_device() {
    runtime().block_on(async {
        let (a, b) = (sim(18), sim(19));
        let header = {
            let pool = single_pool(&a).await;
            let volume = volume_of(&pool);
            write_placed(&pool, &volume, BLOCK, 0..BLOCKS, 1).await;
            pool.checkpoint().await.unwrap();
            let header = a.snapshot().read(0, 1 << 20);
            let member = superblock(&a).members[0].uuid;
            pool.attach(&spec(member), b.as_device()).await.unwrap();
            header
        };
        // a as it was before the attach reached it.
        a.write_durable(0, &header);
        assert!(superblock(&a).children.is_empty());
        for devices in [vec![&a], vec![&a, &b]] {
            let pool = open(&devices).await;
            let volume = volume_of(&pool);
            check_all(&volume, 1).await;
            if devices.len() == 2 {
                assert_eq!(
                    children(&pool),
                    [(Health::Online, false, false), (Health::Resilvering, false, false)]
                );
                pool.resilver().await.unwrap();
                assert_holds(&b, &volume, 1);
            } else {
                assert!(pool.status()[0].children.is_empty(), "a single device, as before");
            }
        }
    });
}

// ---------------------------------------------------------------------------
// Under the daemon

const MIB_PATTERNS: u64 = 64;

/// `pool status tank --json`.
fn tank(server: &Server) -> serde_json::Value {
    common::pool_json(server, "tank")
}

/// The states of the pool's first member's devices (a mirror's children).
fn child_states(status: &serde_json::Value) -> Vec<String> {
    status["devices"][0]["children"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| c["state"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn child_names(status: &serde_json::Value) -> Vec<String> {
    status["devices"][0]["children"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| c["name"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until every device of the pool is up to date and no device is
/// left to forget (a replaced one leaves the catalog within seconds).
fn wait_online(server: &Server, limit_s: u64) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(limit_s);
    loop {
        let status = tank(server);
        if status["state"] == "ONLINE" {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the resilver did not finish: {status}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// qemu-io commands writing MiB `i` of the volume with pattern `pattern(i)`.
fn pattern_writes(pattern: impl Fn(u64) -> u64) -> Vec<String> {
    let mut commands: Vec<String> = (0..MIB_PATTERNS)
        .map(|i| format!("write -P {} {}M 1M", pattern(i), i))
        .collect();
    commands.push("flush".into());
    commands
}

fn pattern_reads(pattern: impl Fn(u64) -> u64) -> Vec<String> {
    (0..MIB_PATTERNS)
        .map(|i| format!("read -P {} {}M 1M", pattern(i), i))
        .collect()
}

fn catalog_paths(data: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(data.join("catalog.json")).unwrap();
    let catalog: serde_json::Value = serde_json::from_str(&text).unwrap();
    catalog["pools"]["tank"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["path"].as_str().unwrap().to_string())
        .collect()
}

fn has_superblock(path: &str) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    std::fs::File::open(path).unwrap().read_exact(&mut magic).unwrap();
    &magic == b"STRATASB"
}

#[test]
fn a_device_attached_while_a_client_writes_resilvers_and_alone_holds_the_data() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let a = common::sparse_file(dir.path(), "a.img", 256 << 20);
    let b = common::sparse_file(dir.path(), "b.img", 256 << 20);
    let small = common::sparse_file(dir.path(), "small.img", 64 << 20);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    common::cli_ok(&server, &["pool", "create", "tank", "--fast", &a]);
    server.create_volume("tank/v", "64M");
    let uri = server.uri("tank/v");
    common::qemu_io_ok(&uri, &pattern_writes(|i| i + 1));
    // A client writes three more passes while b is attached.
    let mut writes: Vec<String> = Vec::new();
    for round in 0..3u64 {
        writes.extend(pattern_writes(|i| (i + 10 * round + 20) % 250 + 1));
    }
    let mut writer = Command::new("qemu-io");
    writer.args(["-f", "raw"]);
    for command in &writes {
        writer.arg("-c").arg(command);
    }
    let writer = writer
        .arg(&uri)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(150));
    // Refused first: too small, and a device of no mirror is not detached.
    let refused = cli(&server, &["pool", "attach", "tank", &a, &small]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("too small"),
        "{refused:?}"
    );
    let refused = cli(&server, &["pool", "detach", "tank", &a]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        said.contains("not part of a mirror") && said.contains("pool replace"),
        "{said}"
    );
    let attached = common::cli_ok(&server, &["pool", "attach", "tank", &a, &b, "--json"]);
    let attached: serde_json::Value = serde_json::from_str(&attached).unwrap();
    // The new copy is resilvering, or already done: 160 MiB of a fast
    // device can be copied before the answer is sent.
    let states = child_states(&attached);
    assert!(
        states[0] == "ONLINE" && ["RESILVERING", "ONLINE"].contains(&states[1].as_str()),
        "{attached}"
    );
    assert_eq!(attached["devices"][0]["name"], "mirror-0", "{attached}");
    let written = writer.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&written.stdout).to_string() + &String::from_utf8_lossy(&written.stderr);
    assert!(
        written.status.success() && !text.contains("failed") && !text.contains("error"),
        "the client saw an error during the attach:\n{text}"
    );
    let last = |i: u64| (i + 40) % 250 + 1;
    let status = wait_online(&server, 120);
    assert_eq!(child_states(&status), ["ONLINE", "ONLINE"], "{status}");
    assert!(catalog_paths(&data).contains(&b), "the catalog lists b");
    // The last up-to-date copy cannot go while the other is its only peer.
    common::qemu_io_ok(&uri, &pattern_reads(last));
    common::cli_ok(&server, &["pool", "sync", "tank"]);
    assert!(server.stop().success());

    // The original device's file is gone: the pool opens from b alone.
    std::fs::remove_file(&a).unwrap();
    let server = Server::start(&data);
    let status = tank(&server);
    assert_eq!(status["state"], "DEGRADED", "{status}");
    assert_eq!(child_states(&status), ["MISSING", "ONLINE"], "{status}");
    let action = status["action"].as_str().unwrap();
    assert!(action.contains("strata pool replace tank"), "{action}");
    common::qemu_io_ok(&server.uri("tank/v"), &pattern_reads(last));
    // b is the last up-to-date copy: detaching it is refused.
    let refused = cli(&server, &["pool", "detach", "tank", &b]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("only up-to-date device"),
        "{refused:?}"
    );
    // The missing one may go: the catalog forgets its path too.
    common::cli_ok(&server, &["pool", "detach", "tank", &a]);
    let status = tank(&server);
    assert_eq!(child_states(&status), ["ONLINE"], "{status}");
    assert_eq!(status["state"], "ONLINE", "{status}");
    assert_eq!(catalog_paths(&data), [b]);
}

#[test]
fn a_kill_during_an_attachs_resilver_resumes_at_its_cursor_after_the_restart() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let a = common::sparse_file(dir.path(), "a.img", 256 << 20);
    let b = common::sparse_file(dir.path(), "b.img", 256 << 20);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    common::cli_ok(&server, &["pool", "create", "tank", "--fast", &a]);
    server.create_volume("tank/v", "64M");
    common::qemu_io_ok(&server.uri("tank/v"), &pattern_writes(|i| i + 1));
    common::cli_ok(&server, &["pool", "sync", "tank"]);
    assert!(server.stop().success());
    // Reads of a at 12 MiB/s: the resilver (metadata and log regions and
    // the volume's data, about 160 MiB) takes over 10 s, and its cursor is
    // recorded 10 s in.
    let wrap = format!("{a}=throttle:bw=12M");
    let mut server = Server::start_with_args(&data, Some(&data), &["--wrap", &wrap]);
    common::cli_ok(&server, &["pool", "attach", "tank", &a, &b]);
    std::thread::sleep(std::time::Duration::from_millis(11_500));
    let status = tank(&server);
    assert_eq!(child_states(&status), ["ONLINE", "RESILVERING"], "{status}");
    server.kill9();
    let recorded = Superblock::decode(&std::fs::read(&a).unwrap()[..SUPERBLOCK_BYTES]).unwrap();
    assert_eq!(recorded.children.len(), 2);
    assert_eq!(recorded.children[1].state, ChildState::Stale);
    let cursor = recorded.children[1].resilvered;
    assert!(cursor > 0, "the cursor was recorded before the kill");
    // The restart resumes at the cursor and finishes; the data is intact.
    let log = dir.path().join("daemon.log");
    let server = Server::start_logged(&data, Some(&data), &[], Some(&log));
    let status = wait_online(&server, 120);
    assert_eq!(child_states(&status), ["ONLINE", "ONLINE"], "{status}");
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains(&format!("resuming at offset {cursor}")), "{said}");
    common::qemu_io_ok(&server.uri("tank/v"), &pattern_reads(|i| i + 1));
    drop(server);
    // b alone holds the data too.
    std::fs::remove_file(&a).unwrap();
    let server = Server::start(&data);
    common::qemu_io_ok(&server.uri("tank/v"), &pattern_reads(|i| i + 1));
}

#[test]
fn replace_moves_a_single_device_and_replaces_a_missing_mirror_device() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    let a = common::sparse_file(dir.path(), "a.img", 256 << 20);
    let b = common::sparse_file(dir.path(), "b.img", 256 << 20);
    let c = common::sparse_file(dir.path(), "c.img", 256 << 20);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    common::cli_ok(&server, &["pool", "create", "tank", "--fast", &a]);
    server.create_volume("tank/v", "64M");
    let uri = server.uri("tank/v");
    common::qemu_io_ok(&uri, &pattern_writes(|i| i + 1));
    // A present single device: b copies from it, then it is detached, the
    // catalog forgets it and its superblocks are cleared.
    let replacing = common::cli_ok(&server, &["pool", "replace", "tank", &a, &b, "--json"]);
    let replacing: serde_json::Value = serde_json::from_str(&replacing).unwrap();
    let children = &replacing["devices"][0]["children"];
    assert_eq!(children[0]["replaced"], true, "{replacing}");
    assert_eq!(children[1]["replacement"], true, "{replacing}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while catalog_paths(&data) != [b.clone()] || has_superblock(&a) {
        assert!(
            std::time::Instant::now() < deadline,
            "a was not forgotten: {}",
            tank(&server)
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let status = tank(&server);
    assert_eq!(child_states(&status), ["ONLINE"], "{status}");
    assert_eq!(status["state"], "ONLINE", "{status}");
    common::qemu_io_ok(&uri, &pattern_reads(|i| i + 1));
    // a is free again: attached back as a second copy of b.
    common::cli_ok(&server, &["pool", "attach", "tank", &b, &a]);
    wait_online(&server, 120);
    common::cli_ok(&server, &["pool", "sync", "tank"]);
    assert!(server.stop().success());

    // a's file is removed; it is replaced by c from b.
    std::fs::remove_file(&a).unwrap();
    let mut server = Server::start(&data);
    let status = tank(&server);
    assert_eq!(child_states(&status), ["ONLINE", "MISSING"], "{status}");
    common::cli_ok(&server, &["pool", "replace", "tank", &a, &c]);
    let status = wait_online(&server, 120);
    assert_eq!(child_states(&status), ["ONLINE", "ONLINE"], "{status}");
    assert!(child_names(&status)[1].ends_with("c.img"), "{status}");
    let mut paths = catalog_paths(&data);
    paths.sort();
    assert_eq!(paths, [b.clone(), c.clone()]);
    common::qemu_io_ok(&uri_of(&server), &pattern_reads(|i| i + 1));
    assert!(server.stop().success());
    let server = Server::start(&data);
    assert_eq!(tank(&server)["state"], "ONLINE");
    common::qemu_io_ok(&uri_of(&server), &pattern_reads(|i| i + 1));
}

fn uri_of(server: &Server) -> String {
    server.uri("tank/v")
}

#[test]
fn add_device_adds_a_whole_mirror_whose_every_copy_holds_the_data() {
    require_tool("qemu-io");
    let dir = tempfile::tempdir().unwrap();
    // The fast device holds the log and metadata regions and about 60 MiB
    // of data: the rest of the volume's 128 MiB lands on the new mirror.
    let a = common::sparse_file(dir.path(), "a.img", 160 << 20);
    let b = common::sparse_file(dir.path(), "b.img", 256 << 20);
    let c = common::sparse_file(dir.path(), "c.img", 256 << 20);
    let data = dir.path().join("data");
    let mut server = Server::start(&data);
    common::cli_ok(&server, &["pool", "create", "tank", "--fast", &a]);

    // Refused, and nothing changes: one device, a device named twice, a
    // device of the pool.
    for (spec, said) in [
        (format!("mirror:{b}"), "at least two devices"),
        (format!("mirror:{b},{b}"), "named twice"),
        (format!("mirror:{b},{a}"), "already part of pool 'tank'"),
    ] {
        let out = cli(&server, &["pool", "add-device", "tank", "--capacity", &spec]);
        assert_eq!(out.status.code(), Some(1), "{spec}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(said), "{spec}: {stderr}");
        assert_eq!(tank(&server)["devices"].as_array().unwrap().len(), 1, "{spec}");
    }

    let mirror = format!("mirror:{b},{c}");
    common::cli_ok(&server, &["pool", "add-device", "tank", "--capacity", &mirror]);
    let status = wait_online(&server, 60);
    let member = &status["devices"][1];
    assert_eq!(member["role"], "capacity", "{status}");
    let names: Vec<&str> = member["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [b.as_str(), c.as_str()], "{status}");

    server.create_volume("tank/v", "128M");
    let uri = server.uri("tank/v");
    let mut writes = pattern_writes(|i| i + 1);
    writes.push("write -P 0x77 64M 64M".into());
    writes.push("flush".into());
    common::qemu_io_ok(&uri, &writes);
    common::cli_ok(&server, &["pool", "sync", "tank"]);
    let status = tank(&server);
    assert!(
        status["devices"][1]["used_bytes"].as_u64().unwrap() >= 32 << 20,
        "the mirror holds little of the volume: {status}"
    );
    assert!(server.stop().success());

    // Each copy alone serves every byte.
    for gone in [&b, &c] {
        let kept = format!("{gone}.away");
        std::fs::rename(gone, &kept).unwrap();
        let mut server = Server::start(&data);
        let status = tank(&server);
        assert_eq!(status["state"], "DEGRADED", "{status}");
        let mut reads = pattern_reads(|i| i + 1);
        reads.push("read -P 0x77 64M 64M".into());
        common::qemu_io_ok(&server.uri("tank/v"), &reads);
        assert!(server.stop().success());
        std::fs::rename(&kept, gone).unwrap();
        // Back with the other one: nothing was written, both are current.
        let mut server = Server::start(&data);
        wait_online(&server, 60);
        assert!(server.stop().success());
    }
}
