//! A stopped pool whose metadata store and superblocks were overwritten in
//! random places, then started, as an administrator would after a disk
//! went bad: every start either refuses with one line naming what is
//! damaged, or serves, with every error it answers counted. None panics,
//! none hangs, and no block whose map entry is intact reads back as
//! anything but what was written.
//!
//! Each seed damages a fresh copy of one pool (simulated devices, in
//! memory) and starts it on its own thread with a deadline. The seeds run
//! here fit about a minute on two cores; `damaged_metadata_soak` (ignored,
//! `cargo nextest run --release --test damaged_metadata --run-ignored all`)
//! runs 100 of them, and `STRATA_DAMAGE_SEEDS=N` sets the count of either;
//! `STRATA_DAMAGE_SEED=N` runs seed N alone (to replay a failure).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Once};
use std::time::{Duration, Instant};

use strata::block::{BlockDevice, IoBuf};
use strata::device::sim::SimRng;
use strata::device::{Device, SimDevice};
use strata::pool::superblock::{Role, Superblock, SUPERBLOCK_BYTES, SUPERBLOCK_OFFSETS};
use strata::pool::{NewDevice, Pool, PoolOptions};

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 4 * MIB;
const BLOCK_BYTES: u64 = 16 << 10;
const VOLUMES: [u32; 2] = [1, 2];
/// Seeds run by the test in CI (about a minute on two cores).
const SEEDS: u64 = 24;
/// A start and the reads of both volumes take well under a second; past
/// this the start is taken for hung.
const DEADLINE: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn options() -> PoolOptions {
    PoolOptions {
        background: false,
        ..Default::default()
    }
}

/// The bytes written to sector `sector` of volume `volume`: its own
/// address, then bytes derived from it (so another block's sectors, or a
/// stale copy, never pass for it).
fn sector_pattern(volume: u32, sector: u64) -> Vec<u8> {
    let mut rng = SimRng::new(u64::from(volume) << 40 ^ sector ^ 0x5eed);
    let mut bytes = vec![0u8; 4096];
    rng.fill(&mut bytes);
    bytes[..4].copy_from_slice(&volume.to_le_bytes());
    bytes[4..12].copy_from_slice(&sector.to_le_bytes());
    bytes
}

fn expected(volume: u32, offset: u64, length: u64) -> Vec<u8> {
    (offset / 4096..(offset + length) / 4096)
        .flat_map(|sector| sector_pattern(volume, sector))
        .collect()
}

/// A stopped pool: its devices, and where its volumes' blocks live.
struct Original {
    devices: Vec<SimDevice>,
    entries: Vec<Vec<Option<(u8, u64)>>>,
    superblock: Superblock,
}

fn original() -> Original {
    runtime().block_on(async {
        // Fast: chunk 0, 32 MiB of metadata, 64 MiB of log, 7 MiB of data;
        // capacity: 15 MiB of data. 8 MiB written spill onto both.
        let devices = vec![SimDevice::new(104 * MIB, 1), SimDevice::new(16 * MIB, 2)];
        let new = devices
            .iter()
            .zip([Role::Fast, Role::Capacity])
            .map(|(sim, role)| NewDevice {
                device: sim.as_device(),
                role,
            })
            .collect();
        let pool = Pool::create_with("tank", 1 << 20, new, options()).await.unwrap();
        let mut entries = Vec::new();
        for volume in VOLUMES {
            let engine = pool.open_volume(volume, VOLUME_BYTES, BLOCK_BYTES as u32).unwrap();
            for at in (0..VOLUME_BYTES).step_by(MIB as usize) {
                engine
                    .write(at, IoBuf::copy_from(&expected(volume, at, MIB)), false)
                    .await
                    .unwrap();
            }
            engine.flush().await.unwrap();
        }
        pool.destage_all().await.unwrap();
        pool.checkpoint().await.unwrap();
        for volume in VOLUMES {
            let map = pool.block_places(volume, 0, VOLUME_BYTES / BLOCK_BYTES - 1).unwrap();
            assert!(map.iter().all(|e| e.is_some()), "every block is mapped");
            entries.push(map);
        }
        let on_capacity = entries.iter().flatten().filter(|e| matches!(e, Some((1, _)))).count();
        assert!(on_capacity > 0, "some blocks are on the capacity device");
        drop(pool);
        let (buf, result) = devices[0].as_device().read(0, IoBuf::new(SUPERBLOCK_BYTES)).await;
        result.unwrap();
        let superblock = Superblock::decode(buf.payload()).unwrap();
        Original {
            devices,
            entries,
            superblock,
        }
    })
}

/// What a start of a damaged copy did.
#[derive(Debug, Default)]
struct Outcome {
    /// The start (or a volume's opening) refused, with this message.
    refused: Option<String>,
    /// Requests answered with an error, and errors the pool counted.
    failed_reads: u64,
    counted_errors: u64,
    /// Blocks read back as written, and blocks read back otherwise whose
    /// map entry is damaged (misdirected pointers are not detected yet).
    intact_blocks: u64,
    misdirected_blocks: u64,
    /// Blocks read back otherwise although their map entry is intact.
    wrong: Vec<String>,
}

/// Overwrites 1 to 8 random ranges of the metadata store (its header and
/// the bytes redb uses) and of the devices' superblock copies.
fn damage(copies: &[SimDevice], original: &Original, rng: &mut SimRng) -> Vec<String> {
    let sb = &original.superblock;
    let meta = &copies[sb.meta_device as usize];
    let header = meta.read_durable(sb.meta_offset, 4096);
    let used = u64::from_le_bytes(header[8..16].try_into().unwrap()).clamp(4096, sb.meta_bytes - 4096);
    let mut done = Vec::new();
    for _ in 0..rng.range(1, 9) {
        let (device, start, span, what) = match rng.below(10) {
            0..=6 => (sb.meta_device as usize, sb.meta_offset + 4096, used, "store"),
            7 => (sb.meta_device as usize, sb.meta_offset, 64, "store header"),
            _ => {
                let device = rng.below(copies.len() as u64) as usize;
                let copy = SUPERBLOCK_OFFSETS[rng.below(2) as usize];
                (device, copy, SUPERBLOCK_BYTES as u64, "superblock")
            }
        };
        let length = match rng.below(3) {
            0 => rng.range(1, 9),
            1 => rng.range(1, 513),
            _ => rng.range(1, 4097),
        }
        .min(span);
        let at = start + rng.below(span - length + 1);
        let mut bytes = vec![0u8; length as usize];
        if rng.chance(0.5) {
            rng.fill(&mut bytes);
        } else {
            // Bit flips: what rot does.
            bytes = copies[device].read_durable(at, length as usize);
            for _ in 0..rng.range(1, 9) {
                let byte = rng.below(length) as usize;
                bytes[byte] ^= 1 << rng.below(8);
            }
        }
        copies[device].write_durable(at, &bytes);
        done.push(format!("{what} device {device} [{at}, +{length})"));
    }
    done
}

/// Starts the damaged copy and reads every MiB of both volumes.
async fn start(copies: Vec<Arc<dyn Device>>, original: &Original) -> Outcome {
    let mut outcome = Outcome::default();
    let pool = match Pool::open_with(copies, options()).await {
        Ok(pool) => pool,
        Err(e) => {
            outcome.refused = Some(e.to_string());
            return outcome;
        }
    };
    for (index, volume) in VOLUMES.into_iter().enumerate() {
        let engine = match pool.open_volume(volume, VOLUME_BYTES, BLOCK_BYTES as u32) {
            Ok(engine) => engine,
            Err(e) => {
                outcome.refused = Some(e.to_string());
                continue;
            }
        };
        for at in (0..VOLUME_BYTES).step_by(MIB as usize) {
            let (buf, result) = engine.read(at, IoBuf::new(MIB as usize)).await;
            if result.is_err() {
                outcome.failed_reads += 1;
                continue;
            }
            let want = expected(volume, at, MIB);
            for (block, (got, want)) in buf
                .payload()
                .chunks(BLOCK_BYTES as usize)
                .zip(want.chunks(BLOCK_BYTES as usize))
                .enumerate()
            {
                if got == want {
                    outcome.intact_blocks += 1;
                    continue;
                }
                let block = at / BLOCK_BYTES + block as u64;
                let before = original.entries[index][block as usize];
                match pool.block_places(volume, block, block) {
                    Ok(now) if now[0] == before => outcome.wrong.push(format!(
                        "volume {volume} block {block}: entry {before:?} intact, data differs"
                    )),
                    _ => outcome.misdirected_blocks += 1,
                }
            }
        }
    }
    outcome.counted_errors = pool.metadata_errors()
        + pool
            .status()
            .iter()
            .map(|d| d.checksum_errors + d.read_errors)
            .sum::<u64>();
    outcome
}

/// Panics anywhere in the process (the pool's own threads included),
/// except inside redb.
static PANICS: AtomicUsize = AtomicUsize::new(0);
/// Panics inside redb (its `unreachable!` on a damaged B-tree page): each
/// must be one strata caught and turned into an error
/// (`strata::meta::store::caught_panics`).
static REDB_PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let in_redb = info.location().is_some_and(|l| l.file().contains("/redb-"));
            if in_redb {
                REDB_PANICS.fetch_add(1, Ordering::SeqCst);
            } else {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

fn run_seeds(seeds: u64) {
    count_panics();
    let seeds = std::env::var("STRATA_DAMAGE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seeds);
    let only: Option<u64> = std::env::var("STRATA_DAMAGE_SEED").ok().and_then(|s| s.parse().ok());
    let original = Arc::new(original());
    let started = Instant::now();
    let (mut refused, mut served, mut with_errors) = (0, 0, 0);
    let mut failures = Vec::new();
    for seed in 0..seeds {
        if only.is_some_and(|only| only != seed) {
            continue;
        }
        let mut rng = SimRng::new(seed);
        let copies: Vec<SimDevice> = original.devices.iter().map(|d| d.copy(seed)).collect();
        let damaged = damage(&copies, &original, &mut rng);
        let handles: Vec<Arc<dyn Device>> = copies.iter().map(|c| c.as_device()).collect();
        let panics_before = PANICS.load(Ordering::SeqCst);
        let redb_before = (REDB_PANICS.load(Ordering::SeqCst), strata::meta::store::caught_panics());
        let (send, receive) = mpsc::channel();
        let shared = original.clone();
        std::thread::spawn(move || {
            let outcome = runtime().block_on(start(handles, &shared));
            let _ = send.send(outcome);
        });
        let outcome = match receive.recv_timeout(DEADLINE) {
            Ok(outcome) => outcome,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                failures.push(format!("seed {seed}: no answer in {DEADLINE:?} (damaged {damaged:?})"));
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                failures.push(format!("seed {seed}: the start panicked (damaged {damaged:?})"));
                continue;
            }
        };
        if PANICS.load(Ordering::SeqCst) != panics_before {
            failures.push(format!("seed {seed}: a thread panicked (damaged {damaged:?})"));
        }
        let redb_panics = REDB_PANICS.load(Ordering::SeqCst) - redb_before.0;
        let caught = strata::meta::store::caught_panics() - redb_before.1;
        if redb_panics as u64 != caught {
            failures.push(format!(
                "seed {seed}: {redb_panics} panics inside redb, {caught} caught (damaged {damaged:?})"
            ));
        }
        for wrong in &outcome.wrong {
            failures.push(format!("seed {seed}: {wrong} (damaged {damaged:?})"));
        }
        if let Some(message) = &outcome.refused {
            refused += 1;
            if message.is_empty() || message.contains('\n') {
                failures.push(format!("seed {seed}: refused with {message:?}, not one line"));
            }
        } else {
            served += 1;
        }
        if outcome.failed_reads > 0 {
            with_errors += 1;
            if outcome.counted_errors == 0 {
                failures.push(format!(
                    "seed {seed}: {} reads failed and no error was counted (damaged {damaged:?})",
                    outcome.failed_reads
                ));
            }
        }
        eprintln!(
            "seed {seed}: {} ({} reads failed, {} counted; {} blocks right, {} with damaged entries; \
             {caught} redb panics caught)",
            outcome.refused.as_deref().unwrap_or("served"),
            outcome.failed_reads,
            outcome.counted_errors,
            outcome.intact_blocks,
            outcome.misdirected_blocks
        );
    }
    eprintln!(
        "{seeds} seeds in {:?}: {refused} refused, {served} served ({with_errors} with failed reads)",
        started.elapsed()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn damaged_metadata_is_refused_or_served_with_errors_counted() {
    run_seeds(SEEDS);
}

#[test]
#[ignore = "soak: 100 seeds, a few minutes"]
fn damaged_metadata_soak() {
    run_seeds(100);
}

/// The metadata store of a copy of the pool.
fn open_copied_store(copies: &[SimDevice], original: &Original) -> strata::meta::store::Store {
    let sb = &original.superblock;
    strata::meta::store::open_database(
        copies[sb.meta_device as usize].as_device(),
        sb.meta_offset,
        sb.meta_bytes,
        1 << 20,
        Arc::default(),
    )
    .unwrap()
}

/// The value stored under `key` of `table` in a copy of the pool's
/// metadata store, read through the store itself.
fn stored_value(
    copies: &[SimDevice],
    original: &Original,
    table: redb::TableDefinition<(u32, u64), &[u8]>,
    key: (u32, u64),
) -> Option<Vec<u8>> {
    let db = open_copied_store(copies, original);
    strata::meta::store::read_page(&db, table, key).unwrap()
}

/// The keys of `table` in a copy of the pool's store.
fn stored_keys(
    copies: &[SimDevice],
    original: &Original,
    table: redb::TableDefinition<(u32, u64), &[u8]>,
) -> Vec<(u32, u64)> {
    let db = open_copied_store(copies, original);
    let txn = db.begin_read().unwrap();
    let table = txn.open_table(table).unwrap();
    let keys = redb::ReadableTable::iter(&table)
        .unwrap()
        .map(|row| row.unwrap().0.value())
        .collect();
    keys
}

/// Flips bit `bit` of every copy of `value` in the store's bytes on the
/// device (redb writes pages copy-on-write: an older copy may still be
/// there), as rot would; returns how many it found.
fn flip_stored(copies: &[SimDevice], original: &Original, value: &[u8], bit: usize) -> usize {
    let sb = &original.superblock;
    let meta = &copies[sb.meta_device as usize];
    let header = meta.read_durable(sb.meta_offset, 4096);
    let used = u64::from_le_bytes(header[8..16].try_into().unwrap());
    let start = sb.meta_offset + 4096;
    let store = meta.read_durable(start, used as usize);
    let mut found = 0;
    let mut at = 0;
    while let Some(offset) = store[at..].windows(value.len()).position(|w| w == value) {
        let position = at + offset;
        let mut byte = [store[position + bit / 8]];
        byte[0] ^= 1 << (bit % 8);
        meta.write_durable(start + (position + bit / 8) as u64, &byte);
        found += 1;
        at = position + value.len();
    }
    found
}

/// Reads every MiB of `volume`: for each, whether it read back as written
/// (`Some(true)`), read other bytes (`Some(false)`), or failed with an I/O
/// error (`None`: EIO on the wire) whose message names `named`.
async fn read_all(engine: &strata::pool::volume::EngineVolume, volume: u32, named: &str) -> Vec<Option<bool>> {
    let mut outcomes = Vec::new();
    for at in (0..VOLUME_BYTES).step_by(MIB as usize) {
        let (buf, result) = engine.read(at, IoBuf::new(MIB as usize)).await;
        match result {
            Ok(()) => outcomes.push(Some(buf.payload() == expected(volume, at, MIB).as_slice())),
            Err(strata::block::BlockError::Io(error)) => {
                assert!(error.to_string().contains(named), "{error}");
                outcomes.push(None);
            }
            Err(other) => panic!("volume {volume} at {at}: {other}"),
        }
    }
    outcomes
}

/// A bit flipped inside a stored map page of volume 1 (its entries still
/// decode as slots of the pool: only the page's seal tells): the pool
/// opens, volume 1 is refused with one line naming the table, the key and
/// the checksum (opening a volume reads its pages to count its blocks),
/// counted; volume 2 opens and reads back as written. Before the flip the
/// same pool opens both.
#[test]
fn a_flipped_bit_in_a_stored_map_page_takes_its_volume_offline_and_nothing_else() {
    count_panics();
    let original = original();
    let copies: Vec<SimDevice> = original.devices.iter().map(|d| d.copy(1)).collect();
    let page = stored_value(&copies, &original, strata::meta::store::MAP_PAGES, (1, 0)).expect("volume 1's page 0");
    assert_eq!(page.len(), strata::meta::pages::SEALED_MAP_PAGE_BYTES, "stored sealed");
    // Entry 20's offset bits: the flipped entry still maps a slot.
    let bit = 20 * 64 + 13;
    assert!(
        flip_stored(&copies, &original, &page, bit) >= 1,
        "the page is in the store's bytes"
    );
    let panics = PANICS.load(Ordering::SeqCst);
    runtime().block_on(async {
        let handles: Vec<Arc<dyn Device>> = copies.iter().map(|c| c.as_device()).collect();
        let pool = Pool::open_with(handles, options()).await.expect("the pool opens");
        let error = pool
            .open_volume(1, VOLUME_BYTES, BLOCK_BYTES as u32)
            .err()
            .expect("volume 1 is refused")
            .to_string();
        assert!(
            error.contains("corrupt metadata: table map_pages key (1, 0): checksum: stored"),
            "{error}"
        );
        assert!(!error.contains('\n'), "one line: {error}");
        assert!(pool.metadata_errors() >= 1, "counted");
        let other = pool
            .open_volume(2, VOLUME_BYTES, BLOCK_BYTES as u32)
            .expect("volume 2 opens");
        let outcomes = read_all(&other, 2, "").await;
        assert!(
            outcomes.iter().all(|o| *o == Some(true)),
            "volume 2 reads back: {outcomes:?}"
        );
    });
    assert_eq!(PANICS.load(Ordering::SeqCst), panics, "nothing panicked");
}

/// A bit flipped inside a stored checksum page that covers some of
/// volume 1's blocks: both volumes open; each read that needs the page
/// fails with EIO naming the table, the key and the checksum, counted;
/// every other read of either volume returns what was written.
#[test]
fn a_flipped_bit_in_a_stored_checksum_page_fails_the_reads_that_need_it() {
    count_panics();
    let original = original();
    let copies: Vec<SimDevice> = original.devices.iter().map(|d| d.copy(2)).collect();
    // Each block's checksum page: (device, device offset / 4 MiB).
    let crc_page = |place: &Option<(u8, u64)>| place.map(|(device, offset)| (device as u32, offset >> 22));
    let keys = stored_keys(&copies, &original, strata::meta::store::CRC_PAGES);
    // A page holding volume 1's checksums, the fewer of volume 2's the better.
    let key = keys
        .iter()
        .copied()
        .filter(|key| original.entries[0].iter().any(|e| crc_page(e) == Some(*key)))
        .min_by_key(|key| original.entries[1].iter().filter(|e| crc_page(e) == Some(*key)).count())
        .expect("a checksum page of volume 1");
    let page = stored_value(&copies, &original, strata::meta::store::CRC_PAGES, key).unwrap();
    assert_eq!(page.len(), strata::meta::pages::SEALED_CRC_PAGE_BYTES, "stored sealed");
    assert!(flip_stored(&copies, &original, &page, 8 * 1000 + 3) >= 1);
    let panics = PANICS.load(Ordering::SeqCst);
    runtime().block_on(async {
        let handles: Vec<Arc<dyn Device>> = copies.iter().map(|c| c.as_device()).collect();
        let pool = Pool::open_with(handles, options()).await.expect("the pool opens");
        let named = format!("table crc_pages key {key:?}: checksum: stored");
        let mut failed = 0;
        for (index, volume) in VOLUMES.into_iter().enumerate() {
            let engine = pool
                .open_volume(volume, VOLUME_BYTES, BLOCK_BYTES as u32)
                .expect("opens");
            let outcomes = read_all(&engine, volume, &named).await;
            let blocks_per_read = (MIB / BLOCK_BYTES) as usize;
            for (read, outcome) in outcomes.iter().enumerate() {
                let needs_page = original.entries[index][read * blocks_per_read..(read + 1) * blocks_per_read]
                    .iter()
                    .any(|e| crc_page(e) == Some(key));
                if needs_page {
                    assert_eq!(*outcome, None, "volume {volume} MiB {read} needs the damaged page");
                    failed += 1;
                } else {
                    assert_eq!(*outcome, Some(true), "volume {volume} MiB {read} reads back");
                }
            }
        }
        assert!(failed >= 1);
        assert!(pool.metadata_errors() >= failed, "each failed read is counted");
    });
    assert_eq!(PANICS.load(Ordering::SeqCst), panics, "nothing panicked");
}
