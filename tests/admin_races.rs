//! Check-then-act races of admin operations: each check and its action are
//! one step. Many snapshots of one name asked for at once: one is taken. A
//! client opening a volume (or a snapshot's export) while it is deleted: it
//! is refused, or the delete is; never a client on a deleted volume.

use std::sync::Arc;
use std::time::Duration;

use strata::control::manager::{AdminError, VolumeManager};
use strata::device::wrappers::{DelayConfig, DelayDevice};
use strata::device::SimDevice;
use strata::pool::snapshots::SnapshotRequest;
use strata::pool::superblock::Role;
use strata::pool::{NewDevice, Pool, PoolError};
use strata::volume::Client;

fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// As a receive and a `snapshot create` may (neither holds the other
/// off): 8 creates of one name on one volume at once, each round while a
/// snapshot delete holds the volume's writes (its commit waits for a slow
/// device flush), so every create has checked the name before any is taken.
#[test]
fn concurrent_creates_of_one_snapshot_name_take_one_snapshot() {
    two_workers().block_on(async {
        let sim = SimDevice::new(160 << 20, 7);
        let slow = DelayConfig {
            flush: Duration::from_millis(100),
            ..DelayConfig::default()
        };
        let device = NewDevice {
            device: Arc::new(DelayDevice::new(sim.as_device(), slow)),
            role: Role::Fast,
        };
        let pool = Pool::create("race", 1 << 20, vec![device]).await.unwrap();
        let volume = pool.open_volume(1, 4 << 20, 8192).unwrap();
        for round in 0..4 {
            let doomed = format!("doomed{round}");
            let request = SnapshotRequest {
                volume: &volume,
                name: doomed.clone(),
            };
            let id = pool.create_snapshots(&[request]).await.unwrap()[0].id;
            let deleting = {
                let pool = pool.clone();
                tokio::spawn(async move { pool.destroy_snapshot(id).await })
            };
            tokio::time::sleep(Duration::from_millis(20)).await;
            let name = format!("same{round}");
            let start = Arc::new(tokio::sync::Barrier::new(8));
            let mut tasks = Vec::new();
            for _ in 0..8 {
                let (pool, volume, name, start) = (pool.clone(), volume.clone(), name.clone(), start.clone());
                tasks.push(tokio::spawn(async move {
                    start.wait().await;
                    pool.create_snapshots(&[SnapshotRequest { volume: &volume, name }])
                        .await
                }));
            }
            let mut taken = 0;
            for task in tasks {
                match task.await.unwrap() {
                    Ok(_) => taken += 1,
                    Err(PoolError::Invalid(message)) => {
                        assert!(message.ends_with("exists"), "round {round}: {message}")
                    }
                    Err(other) => panic!("round {round}: {other}"),
                }
            }
            deleting.await.unwrap().unwrap();
            let named = pool.snapshots_of(1).iter().filter(|s| s.name == name).count();
            assert_eq!(
                (taken, named),
                (1, 1),
                "round {round}: snapshots taken, and listed as {name}"
            );
        }
    });
}

/// First the order in which a handshake loses the race (it finds the
/// volume before the delete and opens it after), for a volume and for a
/// snapshot's export; then a delete and an open at once, 100 times.
#[test]
fn a_delete_and_a_client_opening_the_volume_never_both_succeed() {
    let dir = tempfile::tempdir().unwrap();
    // The RAM tier in the test's directory, not /dev/shm. SAFETY (of the
    // environment change): set before any other thread of this test runs.
    std::env::set_var("STRATA_RAM_DIR", dir.path());
    let runtime = two_workers();
    let manager = Arc::new(runtime.block_on(VolumeManager::open(dir.path())).unwrap());
    let m = manager.clone();
    let admin = runtime.spawn_blocking(move || {
        m.create("default/r", 1 << 30, &[]).unwrap();
        let found = m.lookup("default/r").unwrap();
        m.delete("default/r").unwrap();
        assert!(
            found.try_open_handle(Client::Nbd).is_none(),
            "a client opened volume default/r after its delete succeeded"
        );

        m.create("default/s", 1 << 30, &[]).unwrap();
        m.create_snapshots(&["default/s@a".to_string()]).unwrap();
        let view = m.lookup("default/s@a").unwrap();
        m.delete_snapshot("default/s@a").unwrap();
        assert!(
            view.try_open_handle(Client::Nbd).is_none(),
            "a client opened snapshot default/s@a after its delete succeeded"
        );

        for round in 0..100 {
            let name = format!("default/race{round}");
            m.create(&name, 1 << 30, &[]).unwrap();
            let opener = {
                let (m, name) = (m.clone(), name.clone());
                std::thread::spawn(move || m.lookup(&name).and_then(|v| v.try_open_handle(Client::Nbd)))
            };
            let deleted = m.delete(&name);
            let handle = opener.join().unwrap();
            match (&deleted, &handle) {
                (Ok(()), None) | (Err(AdminError::Busy(_)), Some(_)) => {}
                _ => panic!(
                    "round {round}: delete {deleted:?}, and a client handle: {}",
                    handle.is_some()
                ),
            }
            drop(handle);
            if deleted.is_err() {
                m.delete(&name).unwrap();
            }
        }
    });
    runtime.block_on(admin).unwrap();
    runtime.block_on(manager.close());
}
