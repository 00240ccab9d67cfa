//! Storage-engine fault handling on simulated devices: running out of
//! space, device errors, bit rot, damaged superblocks, foreign and missing
//! devices. Each failure must be reported clearly and touch nothing else.

use std::sync::Arc;

use strata::block::{BlockDevice, BlockError, IoBuf};
use strata::device::sim::CrashModel;
use strata::device::wrappers::IoOp;
use strata::device::{Device, ErrorDevice, ErrorRule, SimDevice};
use strata::pool::superblock::Role;
use strata::pool::{NewDevice, Pool, PoolError};

const MIB: u64 = 1 << 20;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn devices(sizes: &[(u64, Role)]) -> Vec<SimDevice> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, (size, _))| SimDevice::new(*size, 100 + i as u64))
        .collect()
}

async fn create(sims: &[SimDevice], roles: &[Role]) -> Arc<Pool> {
    let new = sims
        .iter()
        .zip(roles)
        .map(|(sim, role)| NewDevice {
            device: sim.as_device(),
            role: *role,
        })
        .collect();
    Pool::create("test", 1 << 20, new).await.expect("create pool")
}

fn pattern(byte: u8, length: usize) -> IoBuf {
    IoBuf::copy_from(&vec![byte; length])
}

#[test]
fn enospc_fails_only_the_request_that_needs_space() {
    runtime().block_on(async {
        // Fast device: chunk 0 + 32 MiB metadata + 64 MiB log + 4 data chunks.
        let sims = devices(&[(101 * MIB, Role::Fast)]);
        let pool = create(&sims, &[Role::Fast]).await;
        let full = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
        let other = pool.open_volume(2, 64 * MIB, 64 << 10).unwrap();
        other.write(0, pattern(0x22, 4096), false).await.unwrap();
        // Fill what is left.
        let mut written = 0u64;
        let error = loop {
            match full.write(written, pattern(0x11, 1 << 16), false).await {
                Ok(()) => written += 1 << 16,
                Err(e) => break e,
            }
            assert!(written <= 64 * MIB, "a 4-chunk pool cannot hold 64 MiB");
        };
        assert!(matches!(error, BlockError::NoSpace), "{error}");
        assert_eq!(
            written,
            4 * MIB - (64 << 10),
            "every chunk filled, one slot taken by the other volume"
        );
        // Everything else keeps working: reads, overwrites of allocated blocks, flush.
        let (buf, result) = full.read(0, IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0x11));
        other.write(0, pattern(0x23, 4096), true).await.unwrap();
        full.write(0, pattern(0x12, 4096), false).await.unwrap();
        full.flush().await.unwrap();
        // Freeing space makes room again once the free is durable.
        full.trim(0, MIB, false).await.unwrap();
        full.flush().await.unwrap();
        full.write(written, pattern(0x13, 1 << 16), false).await.unwrap();
        let (buf, result) = full.read(0, IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0), "trimmed blocks read as zeros");
        // Full again; a trim with no flush after it still makes room: the
        // write that needs the space commits the free first.
        let mut next = written + (1 << 16);
        while full.write(next, pattern(0x14, 1 << 16), false).await.is_ok() {
            next += 1 << 16;
        }
        full.trim(MIB, 1 << 16, false).await.unwrap();
        full.write(next, pattern(0x15, 1 << 16), false).await.unwrap();
        let (buf, result) = full.read(next, IoBuf::new(1 << 16)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0x15));
    });
}

#[test]
fn device_write_errors_fail_the_request_and_are_counted() {
    runtime().block_on(async {
        let sim = SimDevice::new(160 * MIB, 7);
        let errors = Arc::new(ErrorDevice::new(sim.as_device(), Vec::new(), 1));
        let device: Arc<dyn Device> = errors.clone();
        let pool = Pool::create(
            "test",
            1 << 20,
            vec![NewDevice {
                device,
                role: Role::Fast,
            }],
        )
        .await
        .unwrap();
        let volume = pool.open_volume(1, 64 * MIB, 16 << 10).unwrap();
        volume.write(0, pattern(0x31, 16 << 10), true).await.unwrap();
        errors.set_rules(vec![ErrorRule::always(&[IoOp::Write])]);
        // A synchronous write (FUA) must reach the intent log, which lives on
        // the failing device: it fails.
        let error = volume.write(1 << 20, pattern(0x32, 4096), true).await.unwrap_err();
        assert!(matches!(error, BlockError::Io(_)), "{error}");
        // A cached write is accepted into RAM; the flush that must make it
        // durable fails, and so does its destage.
        volume.write(2 << 20, pattern(0x33, 4096), false).await.unwrap();
        let error = volume.flush().await.unwrap_err();
        assert!(matches!(error, BlockError::Io(_)), "{error}");
        assert!(pool.destage_all().await.is_err(), "destaging onto a failing device");
        let status = pool.status();
        assert!(status[0].write_errors >= 1, "{status:?}");
        // Reads of data written before are unaffected, and the cached write
        // still reads back: nothing acknowledged is dropped.
        let (buf, result) = volume.read(4096, IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0x31));
        let (buf, result) = volume.read(2 << 20, IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0x33));
        // A failed log write leaves the log's order unknown: the pool takes
        // no more synchronous writes, even once the device works again,
        // until it is reopened (like a suspended ZFS pool).
        errors.set_rules(Vec::new());
        assert!(volume.write(0, pattern(0x34, 4096), true).await.is_err());
        drop(volume);
        drop(pool);
        // Reopened (a new handle on the device, as after a restart).
        let pool = Pool::open(vec![sim.as_device()]).await.unwrap();
        let volume = pool.open_volume(1, 64 * MIB, 16 << 10).unwrap();
        // What was acknowledged as durable is there; the failed writes and
        // the never-flushed one were never promised.
        let (buf, result) = volume.read(0, IoBuf::new(16 << 10)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0x31));
        volume.write(2 << 20, pattern(0x35, 4096), true).await.unwrap();
        pool.destage_all().await.unwrap();
        assert!(
            volume.block_place((2 << 20) / (16 << 10)).unwrap().is_some(),
            "the new write has its place"
        );
        let (buf, result) = volume.read(2 << 20, IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 0x35));
    });
}

#[test]
fn bit_rot_is_an_error_never_wrong_data() {
    runtime().block_on(async {
        let sims = devices(&[(160 * MIB, Role::Fast)]);
        let pool = create(&sims, &[Role::Fast]).await;
        let volume = pool.open_volume(1, 64 * MIB, 16 << 10).unwrap();
        for block in 0..4u64 {
            volume
                .write(block * (16 << 10), pattern(block as u8 + 1, 16 << 10), false)
                .await
                .unwrap();
        }
        volume.flush().await.unwrap();
        pool.checkpoint().await.unwrap();
        // Rot one sector of block 2 on the device.
        let (_, offset) = volume.block_place(2).unwrap().expect("block 2 is mapped");
        sims[0].corrupt(offset + 4096, 1);
        let (_, result) = volume.read(2 * (16 << 10), IoBuf::new(16 << 10)).await;
        assert!(matches!(result, Err(BlockError::Checksum { .. })), "{result:?}");
        // The rotten sector only: its neighbours and other blocks read fine.
        let (buf, result) = volume.read(2 * (16 << 10), IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 3));
        for block in [0u64, 1, 3] {
            let (buf, result) = volume.read(block * (16 << 10), IoBuf::new(16 << 10)).await;
            result.unwrap();
            assert!(buf.payload().iter().all(|&b| b == block as u8 + 1));
        }
        assert_eq!(pool.status()[0].checksum_errors, 1);
        // Rewriting the block heals it.
        volume.write(2 * (16 << 10), pattern(9, 16 << 10), false).await.unwrap();
        let (buf, result) = volume.read(2 * (16 << 10), IoBuf::new(16 << 10)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 9));
    });
}

#[test]
fn superblocks_missing_foreign_and_damaged_devices_are_refused() {
    runtime().block_on(async {
        let sims = devices(&[(160 * MIB, Role::Fast), (64 * MIB, Role::Capacity)]);
        let pool = create(&sims, &[Role::Fast, Role::Capacity]).await;
        drop(pool);
        let open = |list: Vec<Arc<dyn Device>>| Pool::open(list);

        // A missing device.
        let error = open(vec![sims[0].as_device()]).await.err().expect("must fail");
        assert!(matches!(error, PoolError::Missing { .. }), "{error}");
        assert!(error.to_string().contains("missing its capacity device"), "{error}");

        // A device of another pool.
        let stranger = SimDevice::new(160 * MIB, 9);
        let other = create(std::slice::from_ref(&stranger), &[Role::Fast]).await;
        drop(other);
        let error = open(vec![sims[0].as_device(), sims[1].as_device(), stranger.as_device()])
            .await
            .err()
            .expect("must fail");
        assert!(matches!(error, PoolError::Foreign { .. }), "{error}");

        // A device that was never part of a pool.
        let blank = SimDevice::new(64 * MIB, 10);
        let error = open(vec![sims[0].as_device(), blank.as_device()])
            .await
            .err()
            .expect("must fail");
        assert!(error.to_string().contains("no strata superblock"), "{error}");

        // One damaged copy is repaired from the other...
        sims[1].corrupt(100, 1);
        let pool = open(vec![sims[1].as_device(), sims[0].as_device()])
            .await
            .expect("one good copy is enough");
        drop(pool);
        // ...both damaged copies make the device unusable.
        sims[1].corrupt(100, 1);
        sims[1].corrupt((256 << 10) + 100, 1);
        let error = open(vec![sims[0].as_device(), sims[1].as_device()])
            .await
            .err()
            .expect("must fail");
        assert!(error.to_string().contains("damaged"), "{error}");

        // A device already in a pool is not reused by `create`.
        let error = Pool::create(
            "again",
            1 << 20,
            vec![NewDevice {
                device: sims[0].as_device(),
                role: Role::Fast,
            }],
        )
        .await
        .err()
        .expect("must fail");
        assert!(matches!(error, PoolError::InUse(_)), "{error}");
    });
}

#[test]
fn data_placement_fills_the_fast_tier_then_spills() {
    runtime().block_on(async {
        let sims = devices(&[(101 * MIB, Role::Fast), (64 * MIB, Role::Capacity)]);
        let pool = create(&sims, &[Role::Fast, Role::Capacity]).await;
        let volume = pool.open_volume(1, 32 * MIB, 64 << 10).unwrap();
        for block in 0..80u64 {
            volume
                .write(block * (64 << 10), pattern(1, 64 << 10), false)
                .await
                .unwrap();
        }
        // Cached writes take their place when destaged.
        pool.destage_all().await.unwrap();
        let devices: Vec<u8> = (0..80u64).map(|b| volume.block_place(b).unwrap().unwrap().0).collect();
        assert!(
            devices[..64].iter().all(|&d| d == 0),
            "the first 4 MiB land on the fast tier"
        );
        assert!(devices[64..].iter().all(|&d| d == 1), "the rest spills to capacity");
        let status = pool.status();
        assert_eq!(status[0].used_bytes, 4 * MIB);
        assert_eq!(status[1].used_bytes, MIB);
    });
}

#[test]
fn writes_around_the_cache_never_take_space_promised_to_cached_writes() {
    runtime().block_on(async {
        // 4 data chunks (4 MiB); the default 64 MiB RAM tier holds them all.
        let sims = devices(&[(101 * MIB, Role::Fast)]);
        let pool = create(&sims, &[Role::Fast]).await;
        let volume = pool.open_volume(1, 64 * MIB, 64 << 10).unwrap();
        // Small writes fill the pool through the cache: all of it reserved,
        // none of it placed yet.
        let mut cached = 0u64;
        while volume.write(cached, pattern(0x41, 1 << 16), false).await.is_ok() {
            cached += 1 << 16;
            assert!(cached <= 64 * MIB, "a 4 MiB pool took 64 MiB");
        }
        assert_eq!(cached, 4 * MIB, "every chunk promised to cached writes");
        // A large write (around the cache) finds no space: it must not take
        // the space the cached writes were promised.
        let error = volume.write(32 * MIB, pattern(0x42, 1 << 20), false).await.unwrap_err();
        assert!(matches!(error, BlockError::NoSpace), "{error}");
        // Every cached write still reaches its place.
        pool.destage_all().await.unwrap();
        for offset in (0..cached).step_by(1 << 16) {
            let (buf, result) = volume.read(offset, IoBuf::new(1 << 16)).await;
            result.unwrap();
            assert!(buf.payload().iter().all(|&b| b == 0x41), "offset {offset}");
        }
        assert_eq!(pool.reserved_bytes(), 0);
    });
}

/// Every way of writing synchronously — FUA, with the data in the intent log
/// (`logbias=latency`) or in place (`logbias=throughput`), on new and on
/// already-mapped blocks, in a chunk already marked dirty — survives a power
/// loss that drops every write the devices were not told to flush.
#[test]
fn synchronous_writes_survive_a_power_loss_that_drops_every_unflushed_write() {
    runtime().block_on(async {
        for throughput in [false, true] {
            let sims = devices(&[(160 * MIB, Role::Fast)]);
            sims[0].set_crash_model(CrashModel {
                drop_weight: 1,
                apply_weight: 0,
                tear_weight: 0,
            });
            let pool = create(&sims, &[Role::Fast]).await;
            let volume = pool.open_volume(1, 64 * MIB, 16 << 10).unwrap();
            volume.set_log_throughput(throughput);
            // A new block, then overwrites of it (mapped, chunk dirty), then
            // a neighbour in the same chunk.
            for (round, offset) in [(1u8, 0u64), (2, 0), (3, 4096), (4, 16 << 10)] {
                volume.write(offset, pattern(round, 4096), true).await.unwrap();
            }
            pool.destage_all().await.unwrap();
            volume.write(0, pattern(5, 4096), true).await.unwrap();
            // The power fails the moment the last write is acknowledged.
            sims[0].crash();
            drop(volume);
            drop(pool);
            let pool = Pool::open(vec![sims[0].as_device()]).await.unwrap();
            let volume = pool.open_volume(1, 64 * MIB, 16 << 10).unwrap();
            for (offset, byte) in [(0u64, 5u8), (4096, 3), (16 << 10, 4)] {
                let (buf, result) = volume.read(offset, IoBuf::new(4096)).await;
                result.unwrap();
                assert!(
                    buf.payload().iter().all(|&b| b == byte),
                    "logbias={}: offset {offset} lost its FUA write (reads {})",
                    if throughput { "throughput" } else { "latency" },
                    buf.payload()[0]
                );
            }
        }
    });
}
