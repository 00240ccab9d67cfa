//! The simulator's crash semantics through the public API, over 1000 seeds,
//! with injected write and flush failures mixed in: after every crash each
//! sector that a successful flush covered holds exactly what was flushed,
//! and every other sector holds its old contents or one of the values
//! written to it since. A failure prints its seed; rerun one seed with
//! `STRATA_SIM_SEED=<seed> cargo test --test device_sim`.

use strata::device::sim::{SimFaults, SECTOR_BYTES};
use strata::device::{Device, DeviceError, IoBuf, SimDevice, SimRng};

const SECTORS: u64 = 96;

/// Polls a simulator future once: it is always ready.
fn now<T>(fut: impl std::future::Future<Output = T>) -> T {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => panic!("simulator futures are ready at once"),
    }
}

/// Reads every sector and returns the write id stored in each (each sector
/// of write `id` is filled with `id` as little-endian u64 words).
fn sector_ids(dev: &SimDevice, seed: u64) -> Vec<u64> {
    let (buf, res) = now(dev.read(0, IoBuf::new((SECTORS * SECTOR_BYTES) as usize)));
    res.unwrap_or_else(|e| panic!("seed {seed}: read failed: {e}"));
    buf.payload()
        .chunks(SECTOR_BYTES as usize)
        .map(|sector| {
            let id = u64::from_le_bytes(sector[..8].try_into().unwrap());
            assert!(
                sector.chunks(8).all(|w| w == id.to_le_bytes()),
                "seed {seed}: a sector mixes two writes"
            );
            id
        })
        .collect()
}

fn run_seed(seed: u64) {
    let mut rng = SimRng::new(seed);
    let dev = SimDevice::new(SECTORS * SECTOR_BYTES, rng.next_u64());
    let faulty = rng.below(2) == 0;
    if faulty {
        dev.set_faults(SimFaults {
            write_error: 0.02,
            flush_error: 0.05,
            ..SimFaults::default()
        });
    }
    let mut durable = vec![0u64; SECTORS as usize];
    let mut candidates: Vec<Vec<u64>> = vec![Vec::new(); SECTORS as usize];
    let mut visible = vec![0u64; SECTORS as usize];
    let mut failed = false;
    let mut next_id = 1u64;
    for _ in 0..150 {
        match rng.below(12) {
            0..=7 => {
                let start = rng.below(SECTORS);
                let count = rng.range(1, (SECTORS - start).min(24) + 1);
                let id = next_id;
                next_id += 1;
                let data: Vec<u8> = std::iter::repeat_n(id.to_le_bytes(), (count * SECTOR_BYTES / 8) as usize)
                    .flatten()
                    .collect();
                let (_, res) = now(dev.write(start * SECTOR_BYTES, IoBuf::copy_from(&data)));
                match res {
                    Ok(()) => {
                        assert!(!failed, "seed {seed}: a write succeeded on a failed device");
                        for s in start..start + count {
                            visible[s as usize] = id;
                            candidates[s as usize].push(id);
                        }
                    }
                    Err(DeviceError::Injected { .. }) => {
                        // Each sector of a failed write may or may not have
                        // been written; from now on the device is read-only.
                        failed = true;
                        for s in start..start + count {
                            candidates[s as usize].push(id);
                        }
                        let ids = sector_ids(&dev, seed);
                        for s in start..start + count {
                            let got = ids[s as usize];
                            assert!(got == id || got == visible[s as usize], "seed {seed}");
                            visible[s as usize] = got;
                        }
                    }
                    Err(DeviceError::Failed { .. }) => assert!(failed, "seed {seed}: sticky without a failure"),
                    Err(e) => panic!("seed {seed}: {e}"),
                }
            }
            8 | 9 => match now(dev.flush()) {
                Ok(()) => {
                    assert!(!failed, "seed {seed}: a flush succeeded on a failed device");
                    durable.clone_from(&visible);
                    candidates.iter_mut().for_each(Vec::clear);
                }
                Err(DeviceError::Injected { .. }) => failed = true,
                Err(DeviceError::Failed { .. }) => assert!(failed, "seed {seed}"),
                Err(e) => panic!("seed {seed}: {e}"),
            },
            10 => assert_eq!(
                sector_ids(&dev, seed),
                visible,
                "seed {seed}: reads differ from the last writes"
            ),
            _ => {
                dev.crash_with(&mut rng);
                let ids = sector_ids(&dev, seed);
                for s in 0..SECTORS as usize {
                    if candidates[s].is_empty() {
                        assert_eq!(ids[s], durable[s], "seed {seed}: flushed sector {s} changed");
                    } else {
                        assert!(
                            ids[s] == durable[s] || candidates[s].contains(&ids[s]),
                            "seed {seed}: sector {s} holds {} (old {}, written {:?})",
                            ids[s],
                            durable[s],
                            candidates[s]
                        );
                    }
                }
                durable.clone_from(&ids);
                visible.clone_from(&ids);
                candidates.iter_mut().for_each(Vec::clear);
                failed = false;
                assert!(!dev.has_failed(), "seed {seed}: a reboot clears the sticky error");
            }
        }
    }
}

#[test]
fn crash_semantics_hold_for_1000_seeds() {
    if let Ok(seed) = std::env::var("STRATA_SIM_SEED") {
        run_seed(seed.parse().expect("STRATA_SIM_SEED must be a number"));
        return;
    }
    for seed in 0..1000 {
        run_seed(seed);
    }
}

#[test]
fn misdirected_writes_only_change_the_recorded_places() {
    for seed in 0..200u64 {
        let dev = SimDevice::new(SECTORS * SECTOR_BYTES, seed);
        dev.set_faults(SimFaults {
            misdirect: 0.3,
            ..SimFaults::default()
        });
        let mut rng = SimRng::new(seed);
        let mut expected = vec![0u64; SECTORS as usize];
        for id in 1..=40u64 {
            let start = rng.below(SECTORS);
            let data: Vec<u8> = std::iter::repeat_n(id.to_le_bytes(), (SECTOR_BYTES / 8) as usize)
                .flatten()
                .collect();
            let misdirected_before = dev.misdirected_writes().len();
            let (_, res) = now(dev.write(start * SECTOR_BYTES, IoBuf::copy_from(&data)));
            res.unwrap();
            let landed = match dev.misdirected_writes().get(misdirected_before) {
                Some(m) => {
                    assert_eq!(m.intended_offset, start * SECTOR_BYTES);
                    m.actual_offset / SECTOR_BYTES
                }
                None => start,
            };
            expected[landed as usize] = id;
        }
        assert_eq!(sector_ids(&dev, seed), expected, "seed {seed}");
        assert!(dev.stats().misdirected_writes > 0, "seed {seed}");
    }
}
