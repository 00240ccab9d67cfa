//! Deterministic simulation of the storage engine under concurrency: several
//! tasks write, read, trim, zero and flush two volumes of one pool at once
//! while another destages and checkpoints, on simulated devices whose
//! operations complete after seeded delays and out of order
//! ([`SimDelays`]). At a seeded moment, usually with operations in flight,
//! the power fails (or the process is killed); the pool is reopened and
//! every sector is checked against a model of what each client was told.
//!
//! The model keeps, per 512-byte sector, every value written to it with the
//! logical times its write was issued and acknowledged. After a crash a
//! sector must hold one of its values that no durable value surely
//! superseded (a value is durable once a FUA write or zeroing acknowledged
//! it, or a flush of its volume that began after it was acknowledged
//! completed); a read must return a value issued before the read completed
//! and not surely superseded before the read began. Every sector's bytes
//! name the write and the sector, so garbage and data of another block (or
//! volume) are caught too.
//!
//! Everything runs on one current-thread runtime with paused time, so a seed
//! replays exactly: a failure prints its seed, and
//! `STRATA_SIM_SEED=<seed> cargo test --test engine_sim_concurrent -- --nocapture concurrent_clients`
//! replays that run, printing every event kept. `STRATA_SIM_SEEDS=N` sets
//! how many seeds run (default 1000), from `STRATA_SIM_FIRST_SEED` (default
//! 0; a longer search outside CI starts past the seeds CI runs).
//! `STRATA_SIM_NO_DELAYS=1` turns the devices' delays off, to tell whether a
//! failure needs their reordering (the tasks still interleave at the
//! engine's own await points).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use strata::block::{BlockDevice, IoBuf, ZeroFlags};
use strata::device::sim::{CrashModel, SimDelays};
use strata::device::{Device, SimDevice, SimRng};
use strata::pool::migrate::MigrationSettings;
use strata::pool::ram::{HeapImage, RamSource, MIN_RAM_BYTES};
use strata::pool::snapshots::SnapshotRequest;
use strata::pool::superblock::Role;
use strata::pool::volume::EngineVolume;
use strata::pool::{NewDevice, Pool, PoolOptions};

const SECTOR: u64 = 512;
const VOLUMES: usize = 2;
const VOLUME_BYTES: u64 = 2 << 20;
const SECTORS_PER_VOLUME: usize = (VOLUME_BYTES / SECTOR) as usize;
/// Client tasks per round (each picks a volume per operation).
const WORKERS: usize = 3;
const OPERATIONS_PER_WORKER: usize = 10;
/// Rounds of concurrent work per seed; each may end in a crash.
const ROUNDS: usize = 3;
/// The crasher's turns before the power fails are drawn below this (a
/// round takes a few hundred, so most rounds crash with work in flight).
const CRASH_WITHIN_TURNS: u64 = 400;
/// The acknowledgement time of a write not (yet) acknowledged.
const NOT_ACKED: u64 = u64::MAX;

/// A future that is pending `remaining` times, waking itself: a pause of a
/// few scheduler turns, deterministic under a current-thread runtime.
struct Turns {
    remaining: u64,
}

impl Future for Turns {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.remaining == 0 {
            return Poll::Ready(());
        }
        self.remaining -= 1;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

fn turns(remaining: u64) -> Turns {
    Turns { remaining }
}

/// One value written to a sector: its tag, when its write was issued and
/// acknowledged (logical time), and whether it is known durable.
#[derive(Clone, Debug)]
struct Version {
    tag: u64,
    issued: u64,
    acked: u64,
    durable: bool,
}

/// The clients' view: every sector's history since the last crash, a
/// logical clock, the recent events (for a failure report) and the first
/// violation found by a task.
struct Model {
    clock: u64,
    /// Indexed by global sector: volume * SECTORS_PER_VOLUME + sector.
    sectors: Vec<Vec<Version>>,
    next_write: u64,
    events: Vec<String>,
    /// A hash of every event so far (FNV-1a): equal for two runs of a seed
    /// exactly when they interleaved the same way.
    digest: u64,
    failure: Option<String>,
}

impl Model {
    fn new() -> Self {
        let initial = Version {
            tag: 0,
            issued: 0,
            acked: 0,
            durable: true,
        };
        Model {
            clock: 1,
            sectors: vec![vec![initial]; VOLUMES * SECTORS_PER_VOLUME],
            next_write: 0,
            events: Vec::new(),
            digest: 0xcbf2_9ce4_8422_2325,
            failure: None,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn event(&mut self, text: String) {
        const KEPT: usize = 200;
        if self.events.len() >= 2 * KEPT {
            self.events.drain(..KEPT);
        }
        let text = format!("t={} {text}", self.clock);
        for byte in text.bytes() {
            self.digest = (self.digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
        self.events.push(text);
    }

    fn fail(&mut self, message: String) {
        if self.failure.is_none() {
            self.failure = Some(message);
        }
    }

    /// Records a write (zeros: `id` 0) of `count` sectors from global
    /// sector `first`, issued now; returns its issue time.
    fn issue_write(&mut self, first: usize, count: usize, id: u64) -> u64 {
        let issued = self.tick();
        for sector in first..first + count {
            let tag = if id == 0 { 0 } else { tag_for(id, sector) };
            self.sectors[sector].push(Version {
                tag,
                issued,
                acked: NOT_ACKED,
                durable: false,
            });
        }
        issued
    }

    fn ack_write(&mut self, first: usize, count: usize, issued: u64, durable: bool) {
        let acked = self.tick();
        for sector in first..first + count {
            let version = self.sectors[sector]
                .iter_mut()
                .find(|v| v.issued == issued)
                .expect("the write was recorded");
            version.acked = acked;
            version.durable = durable;
        }
    }

    /// A flush of `volume` issued at `issued` completed: every write of the
    /// volume acknowledged before that is durable.
    fn ack_flush(&mut self, volume: usize, issued: u64) {
        self.tick();
        for history in &mut self.sectors[volume * SECTORS_PER_VOLUME..(volume + 1) * SECTORS_PER_VOLUME] {
            for version in history.iter_mut().filter(|v| v.acked < issued) {
                version.durable = true;
            }
        }
    }

    /// The tags a read issued at `issued` and completed at `completed` may
    /// return for `sector`: values written before it completed that no
    /// value acknowledged before it began surely superseded (acknowledged
    /// before that value's write was issued).
    fn readable(&self, sector: usize, issued: u64, completed: u64) -> Vec<u64> {
        let history = &self.sectors[sector];
        let superseded_before = history
            .iter()
            .filter(|v| v.acked < issued)
            .map(|v| v.issued)
            .max()
            .unwrap_or(0);
        history
            .iter()
            .filter(|v| v.issued < completed && v.acked >= superseded_before)
            .map(|v| v.tag)
            .fold(Vec::new(), distinct)
    }

    /// The tags `sector` may hold after a crash, oldest first: values no
    /// durable value surely superseded.
    fn after_crash(&self, sector: usize) -> Vec<u64> {
        let history = &self.sectors[sector];
        let superseded_before = history
            .iter()
            .filter(|v| v.durable)
            .map(|v| v.issued)
            .max()
            .unwrap_or(0);
        history
            .iter()
            .filter(|v| v.acked >= superseded_before)
            .map(|v| v.tag)
            .fold(Vec::new(), distinct)
    }

    /// After recovery, what a sector holds is its only (durable) value.
    fn recovered(&mut self, sector: usize, tag: u64) {
        self.sectors[sector] = vec![Version {
            tag,
            issued: 0,
            acked: 0,
            durable: true,
        }];
    }
}

/// The filler words of a sector after its tag (a xorshift stream seeded by it).
fn filler(tag: u64) -> impl Iterator<Item = u64> {
    let mut state = tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    std::iter::repeat_with(move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    })
}

/// Sector contents for a tag: the tag, then filler derived from it. Tag 0
/// means zeros.
fn fill_sector(out: &mut [u8], tag: u64) {
    if tag == 0 {
        out.fill(0);
        return;
    }
    out[0..8].copy_from_slice(&tag.to_le_bytes());
    for (chunk, word) in out[8..].chunks_exact_mut(8).zip(filler(tag)) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
}

/// The tag a sector's bytes carry, or None if they are no valid sector.
fn tag_of_bytes(bytes: &[u8]) -> Option<u64> {
    let mut words = bytes
        .chunks_exact(8)
        .map(|chunk| u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
    let tag = words.next()?;
    if tag == 0 {
        return words.all(|word| word == 0).then_some(0);
    }
    words
        .zip(filler(tag))
        .all(|(word, expected)| word == expected)
        .then_some(tag)
}

/// Write `id`'s tag for a global sector: names the write and the sector
/// (and so the volume).
fn tag_for(id: u64, sector: usize) -> u64 {
    (id << 32) | sector as u64
}

/// Appends `tag` unless already there (keeps the history's order).
fn distinct(mut tags: Vec<u64>, tag: u64) -> Vec<u64> {
    if !tags.contains(&tag) {
        tags.push(tag);
    }
    tags
}

fn show(tags: &[u64]) -> String {
    let shown: Vec<String> = tags.iter().map(|t| format!("{t:#x}")).collect();
    format!("[{}]", shown.join(", "))
}

/// A random request range inside a volume, in bytes: mostly 4 KiB aligned
/// (sometimes large enough to go around the cache), sometimes 512-byte
/// granular.
fn random_range(rng: &mut SimRng) -> (u64, u64) {
    let sectors = SECTORS_PER_VOLUME as u64;
    let (unit, max_units) = match rng.below(10) {
        0 => (64, 6),     // 32..192 KiB, aligned to 32 KiB
        1..=7 => (8, 16), // 4..64 KiB
        _ => (1, 48),     // 512 B..24 KiB
    };
    let count = rng.range(1, max_units + 1) * unit;
    let start = rng.below((sectors - count) / unit + 1) * unit;
    (start * SECTOR, count * SECTOR)
}

/// Totals over all seeds run by this process, to check that the runs do
/// what they claim (crash with operations in flight, check many reads).
mod totals {
    use std::sync::atomic::AtomicU64;

    pub static SEEDS: AtomicU64 = AtomicU64::new(0);
    pub static CRASHES_IN_FLIGHT: AtomicU64 = AtomicU64::new(0);
    pub static CRASHES_IDLE: AtomicU64 = AtomicU64::new(0);
    pub static WRITES_ACKED: AtomicU64 = AtomicU64::new(0);
    pub static FLUSHES_ACKED: AtomicU64 = AtomicU64::new(0);
    pub static READS_CHECKED: AtomicU64 = AtomicU64::new(0);
    /// Sectors that, after a crash, were allowed more than one value.
    pub static UNCERTAIN_SECTORS: AtomicU64 = AtomicU64::new(0);
    /// ... and held a value newer than the oldest allowed one.
    pub static NEWER_SURVIVED: AtomicU64 = AtomicU64::new(0);
    /// Snapshots taken while clients wrote.
    pub static SNAPSHOTS: AtomicU64 = AtomicU64::new(0);
    /// Bytes the migrator moved between tiers while clients wrote.
    pub static MIGRATED: AtomicU64 = AtomicU64::new(0);
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// Everything a task needs, shared.
#[derive(Clone)]
struct Shared {
    volumes: Vec<Arc<EngineVolume>>,
    pool: Arc<Pool>,
    model: Arc<Mutex<Model>>,
    /// Writes and zeroing are durable once acknowledged (kill -9, not power loss).
    process_kill: bool,
    finished: Arc<AtomicUsize>,
}

impl Shared {
    fn model(&self) -> std::sync::MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A client: random operations on random volumes.
async fn worker(shared: Shared, mut rng: SimRng, name: usize) {
    for _ in 0..OPERATIONS_PER_WORKER {
        let volume_index = rng.below(VOLUMES as u64) as usize;
        let volume = &shared.volumes[volume_index];
        let base = volume_index * SECTORS_PER_VOLUME;
        let result = match rng.below(100) {
            0..=44 => {
                let (offset, length) = random_range(&mut rng);
                let fua = rng.chance(0.2);
                let first = base + (offset / SECTOR) as usize;
                let count = (length / SECTOR) as usize;
                let (id, issued) = {
                    let mut model = shared.model();
                    model.next_write += 1;
                    let id = model.next_write;
                    model.event(format!(
                        "w{name} write v{volume_index} {offset} +{length} fua={fua} id={id}"
                    ));
                    (id, model.issue_write(first, count, id))
                };
                let mut buf = IoBuf::new(length as usize);
                for (i, sector) in buf.payload_mut().chunks_mut(SECTOR as usize).enumerate() {
                    fill_sector(sector, tag_for(id, first + i));
                }
                let result = volume.write(offset, buf, fua).await;
                if result.is_ok() {
                    let mut model = shared.model();
                    model.event(format!("w{name} write id={id} done"));
                    add(&totals::WRITES_ACKED, 1);
                    model.ack_write(first, count, issued, fua || shared.process_kill);
                }
                result.map_err(|e| format!("write {offset} +{length}: {e}"))
            }
            45..=64 => {
                let (offset, length) = random_range(&mut rng);
                let issued = {
                    let mut model = shared.model();
                    model.event(format!("w{name} read v{volume_index} {offset} +{length}"));
                    model.tick()
                };
                let (buf, result) = volume.read(offset, IoBuf::new(length as usize)).await;
                if result.is_ok() {
                    let mut model = shared.model();
                    let completed = model.tick();
                    add(&totals::READS_CHECKED, 1);
                    let first = base + (offset / SECTOR) as usize;
                    for (i, bytes) in buf.payload().chunks(SECTOR as usize).enumerate() {
                        let allowed = model.readable(first + i, issued, completed);
                        let found = tag_of_bytes(bytes);
                        if !found.is_some_and(|tag| allowed.contains(&tag)) {
                            let message = format!(
                                "w{name}: read of v{volume_index} {offset} +{length} (t={issued}..{completed}): \
                                 sector {} holds {found:x?}, allowed {}",
                                first + i - base,
                                show(&allowed)
                            );
                            model.fail(message);
                            break;
                        }
                    }
                }
                result.map_err(|e| format!("read {offset} +{length}: {e}"))
            }
            65..=78 => {
                let (offset, length) = random_range(&mut rng);
                let fua = rng.chance(0.2);
                let trim = rng.chance(0.5);
                let first = base + (offset / SECTOR) as usize;
                let count = (length / SECTOR) as usize;
                let issued = {
                    let mut model = shared.model();
                    let what = if trim { "trim" } else { "zero" };
                    model.event(format!("w{name} {what} v{volume_index} {offset} +{length} fua={fua}"));
                    model.issue_write(first, count, 0)
                };
                let result = if trim {
                    volume.trim(offset, length, fua).await
                } else {
                    let flags = ZeroFlags {
                        may_trim: rng.chance(0.5),
                        fast_only: false,
                        fua,
                    };
                    volume.write_zeroes(offset, length, flags).await
                };
                if result.is_ok() {
                    let mut model = shared.model();
                    model.event(format!("w{name} zeroing t={issued} done"));
                    model.ack_write(first, count, issued, fua);
                }
                result.map_err(|e| format!("zeroing {offset} +{length}: {e}"))
            }
            79..=93 => {
                let issued = {
                    let mut model = shared.model();
                    model.event(format!("w{name} flush v{volume_index}"));
                    model.tick()
                };
                let result = volume.flush().await;
                if result.is_ok() {
                    let mut model = shared.model();
                    model.event(format!("w{name} flush t={issued} done"));
                    model.ack_flush(volume_index, issued);
                    add(&totals::FLUSHES_ACKED, 1);
                }
                result.map_err(|e| format!("flush: {e}"))
            }
            _ => {
                turns(rng.range(1, 20)).await;
                Ok(())
            }
        };
        if let Err(e) = result {
            shared.model().fail(format!("w{name}: {e}"));
            break;
        }
        if shared.model().failure.is_some() {
            break;
        }
    }
    shared.finished.fetch_add(1, Ordering::SeqCst);
}

/// The pool's own work, at the same time: destaging, checkpoints, and
/// snapshots taken by an admin. A snapshot's contents are not checked here
/// (the snapshot model tests do that), but taking them makes the volumes'
/// cached writes pending and their destages go map page by map page, which
/// the clients' data must survive.
async fn maintenance(shared: Shared, mut rng: SimRng) {
    for _ in 0..4 {
        turns(rng.range(0, 40)).await;
        let what = [
            "destage all",
            "destage logged",
            "checkpoint",
            "snapshot",
            "migrate down",
            "migrate up",
        ][rng.below(6) as usize];
        shared.model().event(format!("maintenance: {what}"));
        let result = match what {
            "destage all" => shared.pool.destage_all().await,
            "destage logged" => shared.pool.destage_logged().await,
            "snapshot" => {
                let volume = &shared.volumes[rng.below(VOLUMES as u64) as usize];
                let name = format!("s{}", shared.pool.snapshots().len());
                shared
                    .pool
                    .create_snapshots(&[SnapshotRequest { volume, name }])
                    .await
                    .map(|_| add(&totals::SNAPSHOTS, 1))
            }
            "migrate down" | "migrate up" => {
                // Every block moves to the other tier (a pool of one tier
                // has nothing to move): watermarks that empty the fast
                // tier, or that fill it with whatever was read.
                let (high_percent, low_percent) = if what == "migrate down" { (1, 0) } else { (100, 99) };
                let settings = MigrationSettings {
                    high_percent,
                    low_percent,
                    ..MigrationSettings::default()
                };
                shared.pool.set_migration_settings(settings).expect("valid settings");
                match shared.pool.migrate_now().await {
                    Ok(summary) if summary.errors > 0 => Err(strata::pool::PoolError::Invalid(format!(
                        "{} moves failed without device faults",
                        summary.errors
                    ))),
                    Ok(summary) => {
                        add(&totals::MIGRATED, summary.moved_down_bytes + summary.moved_up_bytes);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            _ => shared.pool.checkpoint().await,
        };
        let mut model = shared.model();
        match result {
            Ok(()) => model.event(format!("maintenance: {what} done")),
            Err(e) => {
                model.fail(format!("maintenance: {what} failed: {e}"));
                break;
            }
        }
    }
    shared.finished.fetch_add(1, Ordering::SeqCst);
}

/// Fails the power after `crash_after` of its turns unless every other task
/// finished first. Being a task itself, each of its turns lets every other
/// runnable task take one step, so the crash lands between any two steps of
/// the engine's work. The other tasks are aborted in the same step, so none
/// of them runs again: whatever they were doing is cut off, as by a power
/// loss or kill -9. Returns whether it crashed.
async fn crasher(
    shared: Shared,
    tasks: Vec<tokio::task::AbortHandle>,
    devices: Vec<SimDevice>,
    mut rng: SimRng,
    crash_after: u64,
) -> bool {
    let mut taken = 0;
    while shared.finished.load(Ordering::SeqCst) < WORKERS + 1 && taken < crash_after {
        turns(1).await;
        taken += 1;
    }
    if shared.finished.load(Ordering::SeqCst) == WORKERS + 1 {
        return false;
    }
    for task in &tasks {
        task.abort();
    }
    shared
        .model()
        .event(format!("crash after {taken} turns, with operations in flight"));
    for device in &devices {
        device.crash_with(&mut rng);
    }
    true
}

struct Harness {
    seed: u64,
    rng: SimRng,
    devices: Vec<SimDevice>,
    delays: SimDelays,
    ram: Arc<HeapImage>,
    process_kill: bool,
    volblocksizes: [u32; VOLUMES],
    pool: Option<Arc<Pool>>,
    volumes: Vec<Arc<EngineVolume>>,
    model: Arc<Mutex<Model>>,
}

impl Harness {
    fn model(&self) -> std::sync::MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, message: &str) -> ! {
        let model = self.model();
        // All kept events when replaying one seed, the last 60 otherwise.
        let shown = if std::env::var("STRATA_SIM_SEED").is_ok() {
            usize::MAX
        } else {
            60
        };
        let recent: Vec<&str> = model.events.iter().rev().take(shown).map(String::as_str).collect();
        panic!(
            "seed {} failed: {message}\nlast events (newest first):\n  {}\nreplay: STRATA_SIM_SEED={} cargo test \
             --test engine_sim_concurrent -- --nocapture concurrent_clients",
            self.seed,
            recent.join("\n  "),
            self.seed
        );
    }

    async fn open(&mut self) {
        let devices: Vec<Arc<dyn Device>> = self.devices.iter().map(SimDevice::as_device).collect();
        let options = PoolOptions {
            ram: Some(RamSource::Heap(self.ram.clone())),
            background: false,
            ..PoolOptions::default()
        };
        let pool = match Pool::open_with(devices, options).await {
            Ok(pool) => pool,
            Err(e) => self.fail(&format!("reopen failed: {e}")),
        };
        self.volumes = (0..VOLUMES)
            .map(|v| {
                pool.open_volume(v as u32 + 1, VOLUME_BYTES, self.volblocksizes[v])
                    .unwrap_or_else(|e| self.fail(&format!("open volume {v}: {e}")))
            })
            .collect();
        self.pool = Some(pool);
    }

    /// One round: the workers and the maintenance task run at once; after a
    /// seeded number of scheduler turns (often before they finish) the
    /// power fails, or, if they finish first, it fails with some chance.
    async fn round(&mut self, round: usize) {
        let finished = Arc::new(AtomicUsize::new(0));
        let shared = Shared {
            volumes: self.volumes.clone(),
            pool: self.pool.clone().expect("pool open"),
            model: self.model.clone(),
            process_kill: self.process_kill,
            finished: finished.clone(),
        };
        let mut tasks = tokio::task::JoinSet::new();
        let mut handles = Vec::new();
        for name in 0..WORKERS {
            handles.push(tasks.spawn(worker(shared.clone(), self.rng.fork(), name)));
        }
        handles.push(tasks.spawn(maintenance(shared.clone(), self.rng.fork())));
        let crash_after = self.rng.below(CRASH_WITHIN_TURNS);
        let crasher = crasher(shared, handles, self.devices.clone(), self.rng.fork(), crash_after);
        let crashed_in_flight = tokio::spawn(crasher)
            .await
            .unwrap_or_else(|e| self.fail(&format!("the crasher failed: {e}")));
        if crashed_in_flight {
            add(&totals::CRASHES_IN_FLIGHT, 1);
        }
        while let Some(joined) = tasks.join_next().await {
            if let Err(e) = joined {
                if e.is_panic() {
                    let payload = e.into_panic();
                    let text = payload
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    self.fail(&format!("a task panicked: {text}"));
                }
            }
        }
        // (The model's lock is taken again by `fail`: not held here.)
        let failure = self.model().failure.clone();
        if let Some(failure) = failure {
            self.fail(&failure);
        }
        // When everything finished first, the power fails with nothing in
        // flight (always after the last round, else sometimes).
        let idle_crash = !crashed_in_flight && (round + 1 == ROUNDS || self.rng.chance(0.5));
        if idle_crash {
            add(&totals::CRASHES_IDLE, 1);
            self.model()
                .event(format!("crash after round {round}, with nothing in flight"));
            for device in &self.devices {
                device.crash_with(&mut self.rng);
            }
        }
        if crashed_in_flight || idle_crash {
            self.recover().await;
        }
    }

    /// Drops the dead pool, reopens and checks every sector of every volume.
    async fn recover(&mut self) {
        self.volumes.clear();
        let old_pool = self.pool.take().map(|pool| Arc::downgrade(&pool));
        // Aborted tasks drop their handles when the runtime next runs them:
        // the dead pool must be gone before its RAM is wiped or reused.
        if let Some(old_pool) = old_pool {
            for _ in 0..10_000 {
                if old_pool.strong_count() == 0 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            if old_pool.strong_count() != 0 {
                self.fail("the crashed pool is still referenced after its tasks ended");
            }
        }
        if !self.process_kill {
            // Power loss: RAM forgets everything.
            self.ram.wipe();
        }
        // Recovery itself runs without delays (they come back afterwards).
        for device in &self.devices {
            device.set_delays(SimDelays::default());
        }
        self.open().await;
        for (index, volume) in self.volumes.clone().iter().enumerate() {
            let (buf, result) = volume.read(0, IoBuf::new(VOLUME_BYTES as usize)).await;
            if let Err(e) = result {
                self.fail(&format!("read of volume {index} after the crash failed: {e}"));
            }
            for (i, bytes) in buf.payload().chunks(SECTOR as usize).enumerate() {
                let sector = index * SECTORS_PER_VOLUME + i;
                let allowed = self.model().after_crash(sector);
                match tag_of_bytes(bytes) {
                    Some(tag) if allowed.contains(&tag) => {
                        if allowed.len() > 1 {
                            add(&totals::UNCERTAIN_SECTORS, 1);
                            if tag != allowed[0] {
                                add(&totals::NEWER_SURVIVED, 1);
                            }
                        }
                        self.model().recovered(sector, tag)
                    }
                    found => self.fail(&format!(
                        "after the crash sector {i} of volume {index} holds {found:x?}, allowed {}",
                        show(&allowed)
                    )),
                }
            }
            // What was read is now the state: make it durable.
            if let Err(e) = volume.flush().await {
                self.fail(&format!("flush after recovery failed: {e}"));
            }
        }
        for device in &self.devices {
            device.set_delays(self.delays);
        }
    }
}

/// Runs one seed; returns the digest of its events.
async fn run_seed(seed: u64) -> u64 {
    let mut rng = SimRng::new(seed);
    let two_tiers = rng.chance(0.5);
    let mut devices = vec![SimDevice::new(128 << 20, rng.next_u64())];
    let mut roles = vec![Role::Fast];
    if two_tiers {
        devices.push(SimDevice::new(48 << 20, rng.next_u64()));
        roles.push(Role::Capacity);
    }
    let volblocksizes = [[4096u32, 16384, 65536][rng.below(3) as usize], 4096];
    let process_kill = rng.chance(0.25);
    let mut delays = SimDelays {
        probability: [0.3, 0.7, 1.0][rng.below(3) as usize],
        max_yields: [2, 8, 24][rng.below(3) as usize],
    };
    if std::env::var_os("STRATA_SIM_NO_DELAYS").is_some() {
        // To tell whether a failure needs the device's reordering: the
        // tasks still interleave at the engine's own await points.
        delays.probability = 0.0;
    }
    let ram = HeapImage::new(MIN_RAM_BYTES);
    let new_devices = devices
        .iter()
        .zip(&roles)
        .map(|(device, role)| NewDevice {
            device: device.as_device(),
            role: *role,
        })
        .collect();
    let options = PoolOptions {
        ram: Some(RamSource::Heap(ram.clone())),
        background: false,
        ..PoolOptions::default()
    };
    let model = Arc::new(Mutex::new(Model::new()));
    model.lock().unwrap().event(format!(
        "seed {seed}: two_tiers={two_tiers} volblocksizes={volblocksizes:?} process_kill={process_kill} \
         delays={delays:?}"
    ));
    let mut harness = Harness {
        seed,
        rng,
        devices,
        delays,
        ram,
        process_kill,
        volblocksizes,
        pool: None,
        volumes: Vec::new(),
        model,
    };
    match Pool::create_with("sim", 1 << 20, new_devices, options).await {
        Ok(pool) => drop(pool),
        Err(e) => harness.fail(&format!("create failed: {e}")),
    }
    if process_kill {
        for device in &harness.devices {
            device.set_crash_model(CrashModel {
                drop_weight: 0,
                apply_weight: 1,
                tear_weight: 0,
            });
        }
    }
    harness.open().await;
    for device in &harness.devices {
        device.set_delays(delays);
    }
    for round in 0..ROUNDS {
        harness.round(round).await;
    }
    add(&totals::SEEDS, 1);
    let digest = harness.model().digest;
    digest
}

/// A current-thread runtime with paused time: tasks interleave only at
/// their await points, in an order fixed by the seed, and timers (the
/// pool's waits for cache room) fire when everything else waits, never by
/// the wall clock.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

// Two races this test guards against, each with a minimal reproduction
// below, and seeds that reach them:
// - a FLUSH racing a destage: 104, 118 (stale data back over a later trim);
// - a commit taking records appended during its data flush: 96, 199 (a
//   sector holds another block's data after the crash).
#[test]
fn concurrent_clients_destage_and_checkpoints_never_lose_acknowledged_writes() {
    if let Ok(seed) = std::env::var("STRATA_SIM_SEED") {
        let seed: u64 = seed.parse().expect("STRATA_SIM_SEED is a number");
        runtime().block_on(run_seed(seed));
        return;
    }
    let seeds: u64 = std::env::var("STRATA_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let first: u64 = std::env::var("STRATA_SIM_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // Seeds are independent: one worker thread per core, each with its own
    // runtime (a seed's run stays deterministic).
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    std::thread::scope(|scope| {
        for worker in 0..workers {
            scope.spawn(move || {
                let seeds_runtime = runtime();
                for seed in (first + worker..first + seeds).step_by(workers as usize) {
                    seeds_runtime.block_on(run_seed(seed));
                }
            });
        }
    });
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let in_flight = load(&totals::CRASHES_IN_FLIGHT);
    let uncertain = load(&totals::UNCERTAIN_SECTORS);
    let newer = load(&totals::NEWER_SURVIVED);
    let snapshots = load(&totals::SNAPSHOTS);
    let migrated = load(&totals::MIGRATED);
    println!(
        "{} seeds: {in_flight} crashes with operations in flight, {} with none; {} writes and {} flushes \
         acknowledged, {} reads checked; after crashes {uncertain} sectors had several allowed values and \
         {newer} of them held a newer one; {snapshots} snapshots taken and {migrated} bytes moved between \
         tiers meanwhile",
        load(&totals::SEEDS),
        load(&totals::CRASHES_IDLE),
        load(&totals::WRITES_ACKED),
        load(&totals::FLUSHES_ACKED),
        load(&totals::READS_CHECKED),
    );
    if seeds >= 50 {
        assert!(in_flight >= seeds, "most rounds should crash with operations in flight");
        assert!(
            migrated > 0,
            "the migrator should have moved blocks while clients wrote"
        );
        assert!(
            uncertain > 0 && newer > 0,
            "crashes should leave some sectors undecided"
        );
        assert!(snapshots > 0, "snapshots should be taken while clients write");
    }
}

/// The same seed interleaves the tasks the same way: the runtime, the
/// simulated delays and the harness depend on nothing but the seed.
#[test]
fn a_seed_replays_the_same_interleaving() {
    for seed in [3, 17] {
        let first = runtime().block_on(run_seed(seed));
        let second = runtime().block_on(run_seed(seed));
        assert_eq!(first, second, "seed {seed} interleaved differently on a second run");
    }
}

/// A FLUSH racing a destage, reduced: a 4 KiB write sits in
/// the RAM tier; a destage and a FLUSH of the volume run at once (the device
/// completes after one scheduler turn, so the destage's commit waits and the
/// FLUSH runs between its two locked phases: it logs the sector as a Data
/// record, and the destage then frees the sector anyway); the sector is then
/// trimmed, or overwritten and destaged, and flushed. After a power loss it
/// must read as the trim or the overwrite left it, not as the first write
/// (recovery replaying the stale Data record).
#[test]
fn a_flush_racing_a_destage_is_not_undone_by_recovery() {
    async fn run(trim: bool) -> Result<(), String> {
        let device = SimDevice::new(128 << 20, 1);
        let ram = HeapImage::new(MIN_RAM_BYTES);
        let options = || PoolOptions {
            ram: Some(RamSource::Heap(ram.clone())),
            background: false,
            ..PoolOptions::default()
        };
        let new_device = NewDevice {
            device: device.as_device(),
            role: Role::Fast,
        };
        drop(
            Pool::create_with("sim", 1 << 20, vec![new_device], options())
                .await
                .unwrap(),
        );
        let pool = Pool::open_with(vec![device.as_device()], options()).await.unwrap();
        let volume = pool.open_volume(1, 1 << 20, 4096).unwrap();
        volume.write(0, IoBuf::copy_from(&[0xAB; 4096]), false).await.unwrap();
        device.set_delays(SimDelays::always(1));
        let (destaged, flushed) = tokio::join!(pool.destage_all(), volume.flush());
        destaged.unwrap();
        flushed.unwrap();
        let expected = if trim {
            volume.trim(0, 4096, false).await.unwrap();
            0
        } else {
            volume.write(0, IoBuf::copy_from(&[0xCD; 4096]), false).await.unwrap();
            pool.destage_all().await.unwrap();
            0xCD
        };
        volume.flush().await.unwrap();
        device.set_delays(SimDelays::default());
        device.crash();
        drop(volume);
        drop(pool);
        ram.wipe();
        let pool = Pool::open_with(vec![device.as_device()], options()).await.unwrap();
        let volume = pool.open_volume(1, 1 << 20, 4096).unwrap();
        let (buf, result) = volume.read(0, IoBuf::new(4096)).await;
        result.unwrap();
        match buf.payload().iter().find(|&&byte| byte != expected) {
            None => Ok(()),
            Some(byte) => Err(format!(
                "after {} and a flush the sector holds {byte:#x}, not {expected:#x}",
                if trim { "a trim" } else { "an overwrite and a destage" }
            )),
        }
    }
    let runtime = runtime();
    let failures: Vec<String> = [true, false]
        .into_iter()
        .filter_map(|trim| runtime.block_on(run(trim)).err())
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A commit racing a data write, reduced: if `Log::commit` flushed the data
/// devices and only then took the pending records, a record appended while
/// that flush was in flight (the Map record of a write whose data completed
/// after the flush was issued) would be committed although its data is not
/// durable. Here a FLUSH (a commit: an earlier write left the data devices
/// unflushed) runs at the same time as a 128 KiB write around the cache to
/// unmapped blocks. After a power loss that drops the unflushed data, such
/// a commit would leave the write's blocks mapped to slots that never
/// received it: reading them would be a checksum error (or, when the slot
/// was reused, another block's data), where the contract allows only the
/// old contents or the new.
#[test]
fn a_commit_racing_a_data_write_never_maps_undurable_data() {
    async fn run() -> Result<(), String> {
        let device = SimDevice::new(128 << 20, 0);
        let ram = HeapImage::new(MIN_RAM_BYTES);
        let options = || PoolOptions {
            ram: Some(RamSource::Heap(ram.clone())),
            background: false,
            ..PoolOptions::default()
        };
        let new_device = NewDevice {
            device: device.as_device(),
            role: Role::Fast,
        };
        drop(
            Pool::create_with("sim", 1 << 20, vec![new_device], options())
                .await
                .unwrap(),
        );
        let pool = Pool::open_with(vec![device.as_device()], options()).await.unwrap();
        let volume = pool.open_volume(1, 4 << 20, 4096).unwrap();
        // Leaves a data write for the next commit to flush.
        volume
            .write(0, IoBuf::copy_from(&[0x11; 128 << 10]), false)
            .await
            .unwrap();
        device.set_delays(SimDelays::always(1));
        let (flushed, written) = tokio::join!(
            volume.flush(),
            volume.write(1 << 20, IoBuf::copy_from(&[0xAB; 128 << 10]), false)
        );
        flushed.unwrap();
        written.unwrap();
        device.set_delays(SimDelays::default());
        device.set_crash_model(CrashModel {
            drop_weight: 1,
            apply_weight: 0,
            tear_weight: 0,
        });
        device.crash();
        drop(volume);
        drop(pool);
        ram.wipe();
        let pool = Pool::open_with(vec![device.as_device()], options()).await.unwrap();
        let volume = pool.open_volume(1, 4 << 20, 4096).unwrap();
        let (buf, result) = volume.read(1 << 20, IoBuf::new(128 << 10)).await;
        result.map_err(|e| format!("the unflushed write's range cannot be read: {e}"))?;
        for (i, sector) in buf.payload().chunks(SECTOR as usize).enumerate() {
            if !(sector.iter().all(|&b| b == 0) || sector.iter().all(|&b| b == 0xAB)) {
                return Err(format!("sector {i} holds neither the old nor the new data"));
            }
        }
        Ok(())
    }
    if let Err(e) = runtime().block_on(run()) {
        panic!("{e}");
    }
}
