//! Deterministic simulation of the storage engine: a pool on simulated
//! devices that drop or tear unflushed writes at a crash, driven by random
//! operations and checked against a model of what must read back and what
//! may survive a crash.
//!
//! Snapshots are part of the mix: taken, read back, deleted, rolled back
//! to, and cloned (the clone written, promoted, promoted back and
//! deleted); every snapshot must read back exactly after any crash.
//!
//! Mirrors have their own seeds: the fast tier (and sometimes the capacity
//! tier) a mirror of two or three devices, power loss on all at once, one
//! child failing reads or writes, bit rot in one child at a time; no error
//! may reach a caller then, every read returns the model's data, and each
//! rotten sector is rewritten from a good copy exactly once.
//!
//! Every seed is independent; a failure prints its seed, and
//! `STRATA_SIM_SEED=<seed> cargo test --release --test engine_sim -- --nocapture`
//! replays exactly that run (`STRATA_SIM_MIRROR_SEED` a mirror seed's).
//! `STRATA_SIM_SEEDS=N` sets how many seeds run (default 1000;
//! `STRATA_SIM_MIRROR_SEEDS`, default 8, for mirrors), from
//! `STRATA_SIM_FIRST_SEED` (default 0).

use std::collections::BTreeSet;
use std::sync::Arc;

use strata::block::{BlockDevice, BlockError, IoBuf, ZeroFlags};
use strata::device::sim::{CrashModel, SimFaults};
use strata::device::{Device, SimDevice, SimRng};
use strata::pool::migrate::{MigrationSettings, TierPin};
use strata::pool::ram::{HeapImage, RamSource, MIN_RAM_BYTES};
use strata::pool::snapshots::SnapshotRequest;
use strata::pool::superblock::Role;
use strata::pool::vdev::Health;
use strata::pool::volume::EngineVolume;
use strata::pool::{NewVdev, Pool, PoolOptions, ScrubJob, ScrubState, ScrubStatus};

const SECTOR: u64 = 512;
const VOLUME_ID: u32 = 7;
/// The clone the clone operation makes (and deletes again).
const CLONE_ID: u32 = 8;
/// Snapshots of the volume kept at most.
const MAX_SNAPSHOTS: usize = 4;
/// Operations per seed (the same when replaying one seed).
const OPERATIONS: usize = 120;
/// Frees of more slots than this wait for the freer's queue (`op_free_batch`).
const FREE_AT_ONCE: usize = 4;

/// What each 512-byte sector may hold: the value it reads now, and every
/// value a crash may leave there (the last durable one plus every value
/// written since).
#[derive(Clone)]
struct SectorModel {
    current: u64,
    possible_after_crash: BTreeSet<u64>,
}

struct Model {
    sectors: Vec<SectorModel>,
}

impl Model {
    fn new(sectors: usize) -> Self {
        Model {
            sectors: vec![
                SectorModel {
                    current: 0,
                    possible_after_crash: BTreeSet::from([0]),
                };
                sectors
            ],
        }
    }

    fn write(&mut self, first: usize, count: usize, tag_of: impl Fn(usize) -> u64, durable: bool) {
        for sector in first..first + count {
            let tag = tag_of(sector);
            let model = &mut self.sectors[sector];
            model.current = tag;
            if durable {
                model.possible_after_crash = BTreeSet::from([tag]);
            } else {
                model.possible_after_crash.insert(tag);
            }
        }
    }

    fn flush(&mut self) {
        for model in &mut self.sectors {
            model.possible_after_crash = BTreeSet::from([model.current]);
        }
    }
}

/// Sector contents for write `id`: the id and the sector number, then filler.
/// Tag 0 means zeros.
fn fill_sector(out: &mut [u8], tag: u64) {
    if tag == 0 {
        out.fill(0);
        return;
    }
    out[0..8].copy_from_slice(&tag.to_le_bytes());
    let mut state = tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out[8..].chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let bytes = state.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// The tag a sector's bytes carry, or None if they are no valid sector.
fn tag_of_bytes(bytes: &[u8]) -> Option<u64> {
    if bytes.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let tag = u64::from_le_bytes(bytes[0..8].try_into().ok()?);
    let mut expected = vec![0u8; bytes.len()];
    fill_sector(&mut expected, tag);
    (expected == bytes).then_some(tag)
}

fn tag_for(write_id: u64, sector: usize) -> u64 {
    (write_id << 32) | sector as u64
}

struct Harness {
    seed: u64,
    rng: SimRng,
    devices: Vec<(SimDevice, Role)>,
    pool: Option<Arc<Pool>>,
    volume: Option<Arc<EngineVolume>>,
    volume_bytes: u64,
    volblocksize: u32,
    model: Model,
    /// Crashes behave like kill -9: every completed write must survive.
    process_kill: bool,
    /// The RAM tier: kept across a simulated kill, wiped by a power loss.
    ram: Arc<HeapImage>,
    /// Synchronous writes go in place (`logbias=throughput`), not to the log.
    log_throughput: bool,
    next_write: u64,
    log: Vec<String>,
    /// The volume's snapshots, oldest first: id and the tag of every sector.
    snapshots: Vec<(u32, Vec<u64>)>,
    snapshots_taken: u64,
    /// A snapshot operation failed: after the next crash, the snapshots
    /// are those the pool lists (with this one, named so, if it made it).
    unsure: Option<Option<(String, Vec<u64>)>>,
    /// Per pool member (by index): the indexes in `devices` of its
    /// devices, several for a mirror.
    members: Vec<Vec<usize>>,
    /// Faults are injected into one child of a mirror only: the pool must
    /// hide every one of them (no I/O error may reach a caller).
    masked: bool,
    /// Bit rot checks run, and the rotten sectors they saw rewritten.
    rot_checks: u64,
    rot_sectors: u64,
}

impl Harness {
    fn fail(&self, message: String) -> ! {
        let recent: Vec<&String> = self.log.iter().rev().take(40).collect();
        let (variable, test) = if self.masked {
            ("STRATA_SIM_MIRROR_SEED", "simulated_crashes_faults_and_rot_on_mirrors")
        } else {
            ("STRATA_SIM_SEED", "simulated_crashes_never_lose_flushed_writes")
        };
        panic!(
            "seed {} failed: {message}\n{}\nlast operations (newest first):\n  {}\nreplay: {variable}={} cargo test --release --test engine_sim {test} -- --nocapture",
            self.seed,
            self.log[0],
            recent.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  "),
            self.seed
        );
    }

    /// `operation`, failing the seed if it has not finished within a
    /// minute (a deadlock: nothing else runs meanwhile).
    async fn in_time<T>(&self, what: &str, operation: impl std::future::Future<Output = T>) -> T {
        match tokio::time::timeout(std::time::Duration::from_secs(60), operation).await {
            Ok(done) => done,
            Err(_) => self.fail(format!("{what} never finished")),
        }
    }

    /// An injected fault reached a caller: honest unless the pool should
    /// have hidden it (`masked`).
    fn injected_error(&self, what: &str, error: impl std::fmt::Display) {
        if self.masked {
            self.fail(format!("{what} failed with one bad copy of a mirror: {error}"));
        }
    }

    /// Every device's faults, then none on any (recovery, checks).
    fn faults_off(&self) -> Vec<SimFaults> {
        let faults = self.devices.iter().map(|(d, _)| d.faults()).collect();
        for (device, _) in &self.devices {
            device.set_faults(SimFaults::default());
        }
        faults
    }

    fn restore_faults(&self, faults: Vec<SimFaults>) {
        for ((device, _), faults) in self.devices.iter().zip(faults) {
            device.set_faults(faults);
        }
    }

    fn volume(&self) -> &Arc<EngineVolume> {
        self.volume.as_ref().expect("volume open")
    }

    async fn open(&mut self) {
        let devices: Vec<Arc<dyn Device>> = self.devices.iter().map(|(d, _)| d.as_device()).collect();
        let options = PoolOptions {
            ram: Some(RamSource::Heap(self.ram.clone())),
            background: false,
            background_free_above: Some(FREE_AT_ONCE),
            ..PoolOptions::default()
        };
        let pool = match Pool::open_with(devices, options).await {
            Ok(pool) => pool,
            Err(e) => self.fail(format!("reopen failed: {e}")),
        };
        let volume = pool
            .open_volume(VOLUME_ID, self.volume_bytes, self.volblocksize)
            .unwrap_or_else(|e| self.fail(format!("open volume: {e}")));
        volume.set_log_throughput(self.log_throughput);
        self.pool = Some(pool);
        self.volume = Some(volume);
    }

    /// One step of the background freer (frees of more than
    /// `FREE_AT_ONCE` slots wait in its queue until then).
    async fn op_free_batch(&mut self) {
        let pool = self.pool.clone().expect("pool");
        let freed = pool.free_queued_batch().await;
        self.log.push(format!("freer: {freed} slots"));
    }

    /// A migration pass that moves every block it may to the other tier
    /// (watermarks that empty the fast tier, or fill it with what was
    /// read), sometimes with the volume pinned. Read errors (fault seeds)
    /// abandon moves; the data stays where it was.
    async fn op_migrate(&mut self) {
        let pool = self.pool.clone().expect("pool");
        let down = self.rng.chance(0.5);
        let (high_percent, low_percent) = if down { (1, 0) } else { (100, 99) };
        let settings = MigrationSettings {
            high_percent,
            low_percent,
            ..MigrationSettings::default()
        };
        pool.set_migration_settings(settings).expect("valid settings");
        let pin = [TierPin::Auto, TierPin::Auto, TierPin::Fast, TierPin::Capacity][self.rng.below(4) as usize];
        pool.set_tier_pin(VOLUME_ID, pin);
        let result = pool.migrate_now().await;
        drop(pool);
        match result {
            Ok(summary) => self.log.push(format!(
                "migrate down={down} pin={pin:?}: {} down, {} up, {} skipped, {} errors",
                summary.moved_down_bytes, summary.moved_up_bytes, summary.skipped_blocks, summary.errors
            )),
            Err(e) => {
                self.injected_error("migration", &e);
                self.log.push(format!("migrate failed: {e}"));
                self.crash_and_reopen("after failed migration").await;
            }
        }
    }

    async fn op_destage(&mut self) {
        let pool = self.pool.clone().expect("pool");
        let all = self.rng.chance(0.5);
        self.log.push(format!("destage all={all}"));
        let result = if all {
            pool.destage_all().await
        } else {
            pool.destage_logged().await
        };
        drop(pool);
        if let Err(e) = result {
            self.injected_error("destage", &e);
            self.log.push(format!("destage failed: {e}"));
            self.crash_and_reopen("after failed destage").await;
        }
    }

    fn random_range(&mut self) -> (u64, u64) {
        let sectors = self.volume_bytes / SECTOR;
        // Mostly 4K-aligned requests, sometimes 512-byte granular ones.
        let (unit, max_units) = if self.rng.chance(0.8) { (8, 32) } else { (1, 64) };
        let count = self.rng.range(1, max_units + 1) * unit;
        let start = self.rng.below((sectors - count) / unit + 1) * unit;
        (start * SECTOR, count * SECTOR)
    }

    async fn op_write(&mut self) {
        let (offset, length) = self.random_range();
        let fua = self.rng.chance(0.2);
        self.next_write += 1;
        let id = self.next_write;
        let first = (offset / SECTOR) as usize;
        let count = (length / SECTOR) as usize;
        let mut buf = IoBuf::new(length as usize);
        for (i, sector) in buf.payload_mut().chunks_mut(SECTOR as usize).enumerate() {
            fill_sector(sector, tag_for(id, first + i));
        }
        if self.rng.chance(0.5) {
            // As the NBD frontend receives large payloads: with the
            // checksums of its 4 KiB pieces computed on arrival, which the
            // engine then uses instead of computing its own.
            buf = IoBuf::read_from_summing(&mut buf.payload(), length as usize)
                .await
                .expect("a buffer reads whole");
        }
        self.log.push(format!("write {offset} +{length} fua={fua} id={id}"));
        match self.volume().write(offset, buf, fua).await {
            Ok(()) => {
                self.model
                    .write(first, count, |s| tag_for(id, s), fua || self.process_kill);
                // A FUA write is durable when acknowledged, not at some later
                // commit: crash right now, sometimes.
                if fua && self.rng.chance(0.1) {
                    self.crash_and_reopen("right after a FUA write").await;
                }
            }
            // A device error (injected) is allowed; the write may be partly
            // done, so every sector may now hold either value.
            Err(BlockError::Io(e)) => {
                self.injected_error("write", e);
                for sector in first..first + count {
                    self.model.sectors[sector]
                        .possible_after_crash
                        .insert(tag_for(id, sector));
                }
                self.crash_and_reopen("after failed write").await;
            }
            Err(e) => self.fail(format!("write failed: {e}")),
        }
    }

    async fn op_zero(&mut self, trim: bool) {
        let (offset, length) = self.random_range();
        let fua = self.rng.chance(0.2);
        self.log.push(format!(
            "{} {offset} +{length} fua={fua}",
            if trim { "trim" } else { "zero" }
        ));
        let result = if trim {
            self.volume().trim(offset, length, fua).await
        } else {
            let flags = ZeroFlags {
                may_trim: self.rng.chance(0.5),
                fast_only: false,
                fua,
            };
            self.volume().write_zeroes(offset, length, flags).await
        };
        match result {
            Ok(()) => self
                .model
                .write((offset / SECTOR) as usize, (length / SECTOR) as usize, |_| 0, fua),
            // Like a failed write: the range may now hold zeros or not.
            Err(BlockError::Io(e)) => {
                self.injected_error("zeroing", e);
                for sector in (offset / SECTOR) as usize..((offset + length) / SECTOR) as usize {
                    self.model.sectors[sector].possible_after_crash.insert(0);
                }
                self.crash_and_reopen("after failed zeroing").await
            }
            Err(e) => self.fail(format!("zeroing failed: {e}")),
        }
    }

    async fn op_read(&mut self) {
        let (offset, length) = self.random_range();
        self.log.push(format!("read {offset} +{length}"));
        let (buf, result) = self.volume().read(offset, IoBuf::new(length as usize)).await;
        match result {
            Ok(()) => {}
            Err(BlockError::Io(e)) => {
                // An injected read error is an honest answer.
                self.injected_error("read", e);
                return;
            }
            Err(e) => self.fail(format!("read failed: {e}")),
        }
        let first = (offset / SECTOR) as usize;
        for (i, bytes) in buf.payload().chunks(SECTOR as usize).enumerate() {
            let expected = self.model.sectors[first + i].current;
            if tag_of_bytes(bytes) != Some(expected) {
                self.fail(format!(
                    "sector {} read {:?}, expected tag {expected:#x}",
                    first + i,
                    tag_of_bytes(bytes)
                ));
            }
        }
    }

    async fn op_flush(&mut self) {
        self.log.push("flush".into());
        match self.volume().flush().await {
            Ok(()) => self.model.flush(),
            Err(BlockError::Io(e)) => {
                self.injected_error("flush", e);
                self.crash_and_reopen("after failed flush").await
            }
            Err(e) => self.fail(format!("flush failed: {e}")),
        }
    }

    async fn op_checkpoint(&mut self) {
        self.log.push("checkpoint".into());
        let pool = self.pool.clone().expect("pool");
        let result = pool.checkpoint().await;
        drop(pool);
        if let Err(e) = result {
            self.injected_error("checkpoint", &e);
            self.log.push(format!("checkpoint failed: {e}"));
            self.crash_and_reopen("after failed checkpoint").await;
        }
    }

    fn pool(&self) -> Arc<Pool> {
        self.pool.clone().expect("pool")
    }

    /// The tags a volume's sectors hold now, as the model says.
    fn image(&self) -> Vec<u64> {
        self.model.sectors.iter().map(|s| s.current).collect()
    }

    /// Reads all of `volume` (faults off) and compares it with `image`.
    async fn check_image(&self, volume: &EngineVolume, image: &[u64], what: &str) {
        self.check_image_times(volume, image, what, 1).await
    }

    /// [`Harness::check_image`], each piece read `times` times in a row
    /// (a mirror's reads go to each copy in turn).
    async fn check_image_times(&self, volume: &EngineVolume, image: &[u64], what: &str, times: usize) {
        let step = 256usize;
        for first in (0..image.len())
            .step_by(step)
            .flat_map(|first| std::iter::repeat_n(first, times))
        {
            let count = step.min(image.len() - first);
            let (buf, result) = volume
                .read(first as u64 * SECTOR, IoBuf::new(count * SECTOR as usize))
                .await;
            match result {
                Ok(()) => {}
                Err(BlockError::Io(e)) => {
                    // An injected read error.
                    self.injected_error(&format!("reading {what}"), e);
                    return;
                }
                Err(e) => self.fail(format!("reading {what} at sector {first}: {e}")),
            }
            for (i, bytes) in buf.payload().chunks(SECTOR as usize).enumerate() {
                if tag_of_bytes(bytes) != Some(image[first + i]) {
                    self.fail(format!(
                        "{what}: sector {} holds {:?}, expected {:#x}",
                        first + i,
                        tag_of_bytes(bytes),
                        image[first + i]
                    ));
                }
            }
        }
    }

    async fn check_snapshot(&self, at: usize) {
        let (id, image) = &self.snapshots[at];
        let view = self
            .pool()
            .open_snapshot(*id, self.volblocksize)
            .unwrap_or_else(|e| self.fail(format!("open snapshot {id:#x}: {e}")));
        self.check_image(&view, image, &format!("snapshot {id:#x}")).await;
    }

    /// After a crash whose operation may or may not have reached the pool:
    /// the model keeps the snapshots the pool has.
    fn keep_listed_snapshots(&mut self) {
        let listed: BTreeSet<u32> = self.pool().snapshots().iter().map(|s| s.id).collect();
        self.snapshots.retain(|(id, _)| listed.contains(id));
        for id in listed {
            if !self.snapshots.iter().any(|(s, _)| *s == id) {
                self.fail(format!("snapshot {id:#x} exists but was never taken"));
            }
        }
    }

    async fn op_snapshot(&mut self) {
        if self.snapshots.len() >= MAX_SNAPSHOTS {
            return;
        }
        self.snapshots_taken += 1;
        let name = format!("s{}", self.snapshots_taken);
        self.log.push(format!("snapshot {name}"));
        // A snapshot holds every write acknowledged before it; those not
        // flushed yet stay in the cache and are as durable as the volume's
        // (a power loss may take them from both). After a flush, all of
        // them must survive in it; a kill keeps everything anyway.
        if !self.process_kill {
            match self.volume().flush().await {
                Ok(()) => {}
                // An injected error: handled as any failed flush, and no
                // snapshot is taken.
                Err(BlockError::Io(e)) => {
                    self.injected_error("the flush before a snapshot", e);
                    self.crash_and_reopen("after failed flush before a snapshot").await;
                    return;
                }
                Err(e) => self.fail(format!("flush before the snapshot failed: {e}")),
            }
        }
        let pool = self.pool();
        let volume = self.volume().clone();
        let result = pool
            .create_snapshots(&[SnapshotRequest {
                volume: &volume,
                name: name.clone(),
            }])
            .await;
        drop(pool);
        drop(volume);
        match result {
            Ok(taken) => {
                // Everything acknowledged is in it, and durable (flushed
                // before, or a kill).
                self.model.flush();
                let image = self.image();
                self.snapshots.push((taken[0].id, image));
            }
            Err(e) => {
                // A snapshot that failed may or may not be there after a
                // crash; if it is, it holds what the volume held.
                self.injected_error("snapshot", &e);
                self.log.push(format!("snapshot failed: {e}"));
                self.unsure = Some(Some((name, self.image())));
                self.crash_and_reopen("after failed snapshot").await;
            }
        }
    }

    async fn op_delete_snapshot(&mut self) {
        if self.snapshots.is_empty() {
            return;
        }
        let at = self.rng.below(self.snapshots.len() as u64) as usize;
        let id = self.snapshots[at].0;
        self.log.push(format!("delete snapshot {id:#x}"));
        let pool = self.pool();
        let result = self.in_time("the snapshot delete", pool.destroy_snapshot(id)).await;
        match result {
            Ok(()) => {
                self.snapshots.remove(at);
            }
            Err(e) => {
                self.injected_error("snapshot delete", &e);
                self.log.push(format!("delete failed: {e}"));
                self.unsure = Some(None);
                self.crash_and_reopen("after failed snapshot delete").await;
            }
        }
    }

    async fn op_rollback(&mut self) {
        let Some((id, image)) = self.snapshots.last().cloned() else {
            return;
        };
        self.log.push(format!("rollback to {id:#x}"));
        let volume = self.volume().clone();
        let pool = self.pool();
        let result = self.in_time("the rollback", pool.rollback(&volume, id)).await;
        drop(volume);
        match result {
            Ok(()) => {
                for (sector, tag) in self.model.sectors.iter_mut().zip(&image) {
                    *sector = SectorModel {
                        current: *tag,
                        possible_after_crash: BTreeSet::from([*tag]),
                    };
                }
            }
            Err(e) => {
                // Done or not: either image may be found after the crash.
                self.injected_error("rollback", &e);
                self.log.push(format!("rollback failed: {e}"));
                for (sector, tag) in self.model.sectors.iter_mut().zip(&image) {
                    sector.possible_after_crash.insert(*tag);
                }
                self.unsure = Some(None);
                self.crash_and_reopen("after failed rollback").await;
            }
        }
    }

    /// A clone of a snapshot is checked, written, promoted (the volume then
    /// a clone of it), checked, promoted back, and deleted; no faults and
    /// no crash meanwhile.
    async fn op_clone(&mut self) {
        if self.snapshots.is_empty() {
            return;
        }
        let at = self.rng.below(self.snapshots.len() as u64) as usize;
        let (origin, mut image) = self.snapshots[at].clone();
        self.log.push(format!("clone {origin:#x}"));
        let faults = self.faults_off();
        let pool = self.pool();
        if let Err(e) = pool.create_clone(CLONE_ID, origin).await {
            self.fail(format!("clone: {e}"));
        }
        let clone = pool
            .open_volume(CLONE_ID, self.volume_bytes, self.volblocksize)
            .unwrap_or_else(|e| self.fail(format!("open clone: {e}")));
        self.check_image(&clone, &image, "the new clone").await;
        for _ in 0..self.rng.range(1, 6) {
            let (offset, length) = self.random_range();
            self.next_write += 1;
            let id = self.next_write;
            let first = (offset / SECTOR) as usize;
            let mut buf = IoBuf::new(length as usize);
            for (i, sector) in buf.payload_mut().chunks_mut(SECTOR as usize).enumerate() {
                fill_sector(sector, tag_for(id, first + i));
                image[first + i] = tag_for(id, first + i);
            }
            self.log.push(format!("clone write {offset} +{length} id={id}"));
            if let Err(e) = clone.write(offset, buf, false).await {
                self.fail(format!("clone write: {e}"));
            }
        }
        self.check_image(&clone, &image, "the clone").await;
        let volume = self.volume().clone();
        let volume_image = self.image();
        if self.rng.chance(0.5) {
            self.log.push("promote the clone, then the volume".into());
            if let Err(e) = self.in_time("the promotion", pool.promote(&clone, &volume)).await {
                self.fail(format!("promote: {e}"));
            }
            self.check_image(&clone, &image, "the promoted clone").await;
            self.check_image(&volume, &volume_image, "the volume, now a clone")
                .await;
            for at in 0..self.snapshots.len() {
                self.check_snapshot(at).await;
            }
            if let Err(e) = self.in_time("the promotion back", pool.promote(&volume, &clone)).await {
                self.fail(format!("promote back: {e}"));
            }
        }
        self.check_image(&volume, &volume_image, "the volume").await;
        drop(clone);
        if let Err(e) = pool.destroy_volume(CLONE_ID).await {
            self.fail(format!("delete the clone: {e}"));
        }
        if pool.snapshots().iter().any(|s| s.volume != VOLUME_ID) || !pool.clones().is_empty() {
            self.fail("snapshots or clones left over after the clone went".into());
        }
        drop(pool);
        self.restore_faults(faults);
    }

    /// A whole-pool scrub, run to its end; it must find no block that no
    /// copy holds intact.
    async fn scrub(&self, what: &str) -> ScrubStatus {
        let pool = self.pool();
        let job = ScrubJob::new(ScrubStatus::new(0));
        if let Err(e) = pool.set_scrub_job(job.clone()) {
            self.fail(format!("{what}: starting the scrub: {e}"));
        }
        self.in_time(
            "the scrub",
            pool.run_scrub(&job, std::time::Duration::from_secs(3600), &|_| {}),
        )
        .await;
        let status = job.status();
        if status.state != ScrubState::Finished || status.errors != 0 {
            self.fail(format!(
                "{what}: the scrub found damage it could not repair: {status:?}"
            ));
        }
        status
    }

    /// Sectors rewritten from another copy on every mirror's children so
    /// far, and checksum errors that reached a caller.
    fn repair_counters(&self) -> (u64, u64) {
        let status = self.pool().status();
        let repaired = status
            .iter()
            .flat_map(|m| m.children.iter().map(|c| c.repaired_sectors))
            .sum();
        (repaired, status.iter().map(|m| m.checksum_errors).sum())
    }

    /// A resilver of whatever children missed writes (a crash or a failed
    /// write left them stale), faults on: the bad child may fail it again,
    /// which only keeps it stale.
    async fn op_resilver(&mut self) {
        let pool = self.pool();
        let result = self.in_time("the resilver", pool.resilver()).await;
        drop(pool);
        match result {
            Ok(copied) => self.log.push(format!("resilver: {copied} bytes")),
            Err(e) => self.log.push(format!("resilver failed: {e}")),
        }
    }

    /// Bit rot in one copy: with faults off, every mirror is resilvered
    /// and scrubbed (its copies agree again: a crash may have left them
    /// apart where writes were in flight); then a sector of a few mapped
    /// blocks rots on one child of their mirror. Every read must return
    /// the model's data, no checksum error may reach a caller, and the
    /// reads and a scrub must rewrite each rotten sector exactly once.
    async fn op_rot(&mut self) {
        if self.devices.iter().any(|(d, _)| d.has_failed()) {
            // A child that failed is faulted until the next crash: its copy
            // is not there to fall back on.
            self.log.push("rot: skipped (a child is faulted)".into());
            return;
        }
        let faults = self.faults_off();
        let pool = self.pool();
        if let Err(e) = self.in_time("the resilver", pool.resilver()).await {
            self.fail(format!("resilver before rot: {e}"));
        }
        let states: Vec<Vec<Health>> = pool
            .status()
            .iter()
            .map(|m| m.children.iter().map(|c| c.state).collect())
            .collect();
        if states.iter().flatten().any(|&s| s != Health::Online) {
            self.fail(format!(
                "children not online after a resilver without faults: {states:?}"
            ));
        }
        // The cached writes go to their places, where they can rot.
        if let Err(e) = self.in_time("the destage", pool.destage_all()).await {
            self.fail(format!("destage before rot: {e}"));
        }
        drop(pool);
        self.scrub("the scrub before rot").await;
        let volume = self.volume().clone();
        let blocks = self.volume_bytes / self.volblocksize as u64;
        // The volume's blocks that lie on a mirror, and where.
        let mut mirrored = Vec::new();
        for block in 0..blocks {
            let place = volume
                .block_place(block)
                .unwrap_or_else(|e| self.fail(format!("place of block {block}: {e}")));
            if let Some((member, offset)) = place {
                if self.members[member as usize].len() > 1 {
                    mirrored.push((block, member, offset));
                }
            }
        }
        let mut rotten = BTreeSet::new();
        // One child of each mirror rots (the same in a mirror of three,
        // whose two others stay good), and only it.
        let which = self.rng.below(3) as usize;
        for _ in 0..self.rng.range(1, 5) {
            if mirrored.is_empty() {
                break;
            }
            let (block, member, offset) = mirrored[self.rng.below(mirrored.len() as u64) as usize];
            let children = self.members[member as usize].clone();
            let child = children[which % children.len()];
            let at = offset + self.rng.below(self.volblocksize as u64 / SECTOR) * SECTOR;
            self.devices[child].0.corrupt(at, SECTOR);
            self.log.push(format!("rot: block {block} at {at} of device {child}"));
            // Checksums cover 4 KiB: each rotten one is rewritten whole.
            rotten.insert((child, at / 4096));
        }
        let (repaired_before, errors_before) = self.repair_counters();
        // Reads go to each copy in turn: each piece is read once per copy.
        let copies = self.members.iter().map(Vec::len).max().unwrap_or(1);
        let image = self.image();
        self.check_image_times(&volume, &image, "the volume after bit rot", copies)
            .await;
        let scrubbed = self.scrub("the scrub after rot").await;
        let (repaired, errors) = self.repair_counters();
        self.log.push(format!(
            "rot: {} sectors rotten, {} rewritten ({} by the scrub)",
            rotten.len(),
            repaired - repaired_before,
            scrubbed.repaired_bytes / 4096
        ));
        if repaired - repaired_before != rotten.len() as u64 || errors != errors_before {
            self.fail(format!(
                "{} rotten sectors, {} rewritten from another copy, {} checksum errors reached a caller",
                rotten.len(),
                repaired - repaired_before,
                errors - errors_before
            ));
        }
        self.rot_checks += 1;
        self.rot_sectors += rotten.len() as u64;
        self.restore_faults(faults);
    }

    async fn crash_and_reopen(&mut self, why: &str) {
        self.log.push(format!("crash ({why})"));
        // The power fails first; only then is the old pool dropped (its
        // handles are dead by then: dropping it must not flush anything).
        // No faults while recovering; they come back afterwards.
        let faults = self.faults_off();
        for (device, _) in &self.devices {
            device.crash_with(&mut self.rng);
        }
        let old_pool = self.pool.as_ref().map(Arc::downgrade);
        self.volume = None;
        self.pool = None;
        // A task the old pool spawned (a checkpoint soon after a write) may
        // still hold it; let it run to its end, as a dead process's threads
        // would have stopped, before RAM is wiped or reused.
        if let Some(old_pool) = old_pool {
            for _ in 0..10_000 {
                if old_pool.strong_count() == 0 {
                    break;
                }
                tokio::task::yield_now().await;
            }
            if old_pool.strong_count() != 0 {
                self.fail("the crashed pool is still referenced after its tasks ran".into());
            }
        }
        if !self.process_kill {
            // Power loss: RAM forgets everything.
            self.ram.wipe();
        }
        self.open().await;
        // Every sector must hold one of the values the model allows.
        let sectors = self.model.sectors.len();
        let step = 256usize;
        for first in (0..sectors).step_by(step) {
            let count = step.min(sectors - first);
            let (buf, result) = self
                .volume()
                .read(first as u64 * SECTOR, IoBuf::new(count * SECTOR as usize))
                .await;
            if let Err(e) = result {
                self.fail(format!("read after crash failed at sector {first}: {e}"));
            }
            for (i, bytes) in buf.payload().chunks(SECTOR as usize).enumerate() {
                let sector = first + i;
                let found = tag_of_bytes(bytes);
                let allowed = &self.model.sectors[sector].possible_after_crash;
                match found {
                    Some(tag) if allowed.contains(&tag) => {
                        self.model.sectors[sector] = SectorModel {
                            current: tag,
                            possible_after_crash: BTreeSet::from([tag]),
                        };
                    }
                    _ => self.fail(format!(
                        "after crash sector {sector} holds {found:?}, allowed {:?}",
                        allowed.iter().map(|t| format!("{t:#x}")).collect::<Vec<_>>()
                    )),
                }
            }
        }
        if let Some(new) = self.unsure.take() {
            if let Some((name, image)) = new {
                if let Some(info) = self.pool().snapshots().into_iter().find(|s| s.name == name) {
                    self.snapshots.push((info.id, image));
                }
            }
            self.keep_listed_snapshots();
        }
        // Every snapshot reads exactly what it was taken of.
        let listed = self.pool().snapshots().len();
        if listed != self.snapshots.len() {
            self.fail(format!(
                "{listed} snapshots after the crash, {} expected",
                self.snapshots.len()
            ));
        }
        for at in 0..self.snapshots.len() {
            self.check_snapshot(at).await;
        }
        // What was read is now the state; make it durable so the model holds.
        if let Err(e) = self.volume().flush().await {
            self.fail(format!("flush after recovery failed: {e}"));
        }
        self.restore_faults(faults);
    }
}

async fn run_seed(seed: u64, operations: usize) {
    let mut rng = SimRng::new(seed);
    let volblocksize = [4096u32, 16384, 65536][rng.below(3) as usize];
    let two_tiers = rng.chance(0.5);
    let mut devices = vec![(SimDevice::new(160 << 20, rng.next_u64()), Role::Fast)];
    if two_tiers {
        devices.push((SimDevice::new(64 << 20, rng.next_u64()), Role::Capacity));
    }
    // One seed in four logs to a small dedicated device (a 1 MiB log, its
    // usable three quarters filled by a few flushes of the RAM tier): the
    // log is often full when snapshots are deleted, rolled back to or
    // promoted with the volume's logged writes still cached. Chosen by the
    // seed, not drawn, so that the other seeds run as they always did.
    let small_log = seed % 4 == 3;
    if small_log {
        devices.push((SimDevice::new(2 << 20, seed ^ 0x106_de71ce), Role::Log));
    }
    let with_faults = rng.chance(0.3);
    // Some seeds crash like kill -9 (everything written reaches the device,
    // flushed or not); the others like power loss (unflushed writes dropped
    // or torn).
    let process_kill = rng.chance(0.3);
    let log_throughput = rng.chance(0.25);
    let faults = SimFaults {
        read_error: if with_faults { 0.01 } else { 0.0 },
        ..SimFaults::default()
    };
    let faults = vec![faults; devices.len()];
    let members = (0..devices.len()).map(|i| vec![i]).collect();
    let config = format!(
        "volblocksize={volblocksize} two_tiers={two_tiers} faults={with_faults} process_kill={process_kill} \
         log_throughput={log_throughput} small_log={small_log}"
    );
    let harness = Harness::new(
        seed,
        rng,
        devices,
        members,
        volblocksize,
        process_kill,
        log_throughput,
        config,
    );
    harness.run(faults, operations).await;
}

impl Harness {
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        rng: SimRng,
        devices: Vec<(SimDevice, Role)>,
        members: Vec<Vec<usize>>,
        volblocksize: u32,
        process_kill: bool,
        log_throughput: bool,
        config: String,
    ) -> Harness {
        let volume_bytes = 8u64 << 20;
        // A small RAM tier (about 250 sectors against 2048 in the volume), so
        // writers often have to destage to make room.
        let ram = HeapImage::new(MIN_RAM_BYTES);
        Harness {
            seed,
            rng,
            devices,
            pool: None,
            volume: None,
            volume_bytes,
            volblocksize,
            model: Model::new((volume_bytes / SECTOR) as usize),
            process_kill,
            ram,
            log_throughput,
            next_write: 0,
            snapshots: Vec::new(),
            snapshots_taken: 0,
            unsure: None,
            members,
            masked: false,
            rot_checks: 0,
            rot_sectors: 0,
            log: vec![config],
        }
    }

    /// Creates the pool (its members as `members` says), opens it, turns on
    /// each device's `faults` and runs `operations` random operations, then
    /// a last crash.
    async fn run(mut self, faults: Vec<SimFaults>, operations: usize) {
        let harness = &mut self;
        if harness.process_kill {
            for (device, _) in &harness.devices {
                device.set_crash_model(CrashModel {
                    drop_weight: 0,
                    apply_weight: 1,
                    tear_weight: 0,
                });
            }
        }
        let vdevs = harness
            .members
            .iter()
            .map(|member| NewVdev {
                role: harness.devices[member[0]].1,
                devices: member.iter().map(|&i| harness.devices[i].0.as_device()).collect(),
                write_mostly: Vec::new(),
            })
            .collect();
        let options = PoolOptions {
            ram: Some(RamSource::Heap(harness.ram.clone())),
            background: false,
            background_free_above: Some(FREE_AT_ONCE),
            ..PoolOptions::default()
        };
        let pool = Pool::create_vdevs("sim", 1 << 20, vdevs, options)
            .await
            .unwrap_or_else(|e| harness.fail(format!("create failed: {e}")));
        drop(pool);
        harness.open().await;
        harness.restore_faults(faults);
        // Mirrors add their own operations; the others' seeds run as they
        // always did.
        let kinds = if harness.masked { 124 } else { 116 };
        for _ in 0..operations {
            match harness.rng.below(kinds) {
                0..=39 => harness.op_write().await,
                40..=59 => harness.op_read().await,
                60..=66 => harness.op_zero(true).await,
                67..=72 => harness.op_zero(false).await,
                73..=84 => harness.op_flush().await,
                85..=87 => harness.op_checkpoint().await,
                88..=89 => harness.op_destage().await,
                90..=99 => harness.crash_and_reopen("random").await,
                100..=103 => harness.op_snapshot().await,
                104..=105 => harness.op_delete_snapshot().await,
                106 => harness.op_rollback().await,
                110 => harness.op_free_batch().await,
                113..=115 => harness.op_migrate().await,
                116..=119 => harness.op_rot().await,
                120..=123 => harness.op_resilver().await,
                107..=109 => {
                    if !harness.snapshots.is_empty() {
                        let at = harness.rng.below(harness.snapshots.len() as u64) as usize;
                        harness.check_snapshot(at).await;
                    }
                }
                _ => harness.op_clone().await,
            }
        }
        harness.crash_and_reopen("final").await;
        if harness.masked {
            // What the seed covered (shown with --nocapture).
            let crashes = harness.log.iter().filter(|l| l.starts_with("crash")).count();
            let stats: Vec<(u64, u64, u64)> = harness
                .devices
                .iter()
                .map(|(d, _)| d.stats())
                .map(|s| (s.reads, s.writes, s.injected_errors))
                .collect();
            eprintln!(
                "mirror seed {}: {crashes} crashes, (reads, writes, injected errors) {stats:?}, {} rot checks ({} sectors rewritten); {}",
                harness.seed,
                harness.rot_checks,
                harness.rot_sectors,
                harness.log[0]
            );
        }
    }
}

/// A seed of the mirror simulation: the fast tier a mirror of two or
/// three devices, sometimes a capacity tier (a mirror of two, or one
/// device). Power losses hit every device at once (each drops or tears its
/// own unflushed writes); faults go to one child of a mirror only (failed
/// reads, or failed writes and flushes that fault it until a crash and a
/// resilver bring it back), and bit rot to one child at a time, so a good
/// copy of everything is always left: no error may reach a caller.
async fn run_mirror_seed(seed: u64, operations: usize) {
    // Another stream than `run_seed`'s for the same number.
    let mut rng = SimRng::new(seed ^ 0x3141_5926_5358_9793);
    let volblocksize = [4096u32, 16384, 65536][rng.below(3) as usize];
    let copies = if rng.chance(0.3) { 3 } else { 2 };
    let mut devices: Vec<(SimDevice, Role)> = (0..copies)
        .map(|_| (SimDevice::new(160 << 20, rng.next_u64()), Role::Fast))
        .collect();
    let mut members = vec![(0..copies).collect::<Vec<usize>>()];
    let capacity = rng.below(3);
    for _ in 0..capacity {
        devices.push((SimDevice::new(64 << 20, rng.next_u64()), Role::Capacity));
    }
    if capacity > 0 {
        members.push((copies..copies + capacity as usize).collect());
    }
    let process_kill = rng.chance(0.2);
    let log_throughput = rng.chance(0.25);
    // One child of one mirror fails: reads, or writes and flushes, or all.
    let mirrors: Vec<&Vec<usize>> = members.iter().filter(|m| m.len() > 1).collect();
    let mirror = mirrors[rng.below(mirrors.len() as u64) as usize];
    let bad = mirror[rng.below(mirror.len() as u64) as usize];
    let kind = rng.below(4);
    let bad_faults = SimFaults {
        read_error: if kind & 1 == 1 { 0.25 } else { 0.0 },
        write_error: if kind & 2 == 2 { 0.03 } else { 0.0 },
        flush_error: if kind & 2 == 2 { 0.03 } else { 0.0 },
        ..SimFaults::default()
    };
    let mut faults = vec![SimFaults::default(); devices.len()];
    faults[bad] = bad_faults;
    let config = format!(
        "mirror: volblocksize={volblocksize} copies={copies} capacity={capacity} process_kill={process_kill} \
         log_throughput={log_throughput} bad device {bad}: {bad_faults:?}"
    );
    let mut harness = Harness::new(
        seed,
        rng,
        devices,
        members,
        volblocksize,
        process_kill,
        log_throughput,
        config,
    );
    harness.masked = true;
    harness.run(faults, operations).await;
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn simulated_crashes_never_lose_flushed_writes() {
    if let Ok(seed) = std::env::var("STRATA_SIM_SEED") {
        let seed: u64 = seed.parse().expect("STRATA_SIM_SEED is a number");
        runtime().block_on(run_seed(seed, OPERATIONS));
        return;
    }
    run_seeds(env_number("STRATA_SIM_SEEDS", 1000), |seed| run_seed(seed, OPERATIONS));
}

/// The number environment variable `name` holds, else `default`.
fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Runs `run` on `count` seeds from `STRATA_SIM_FIRST_SEED` (default 0,
/// for longer searches). Seeds are independent: one worker per core, each
/// with its own single-threaded runtime (a seed's run stays deterministic).
fn run_seeds<F: std::future::Future<Output = ()>>(count: u64, run: impl Fn(u64) -> F + Sync) {
    let first = env_number("STRATA_SIM_FIRST_SEED", 0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    std::thread::scope(|scope| {
        for worker in 0..workers {
            let run = &run;
            scope.spawn(move || {
                let seeds_runtime = runtime();
                for seed in (first + worker..first + count).step_by(workers as usize) {
                    seeds_runtime.block_on(run(seed));
                }
            });
        }
    });
}

/// Mirror seeds that failed once, with how many operations showed it; each
/// runs on every test run.
const MIRROR_REGRESSIONS: &[(u64, usize)] = &[
    // A rotten sector rewritten on one child, the rewrite lost to a power
    // loss, then the other child faulted.
    (50, 117),
    // A rotten sector rewritten on one child, then a power loss: the
    // checksum that told the copies apart (of an overwrite in place) was
    // not durable, and the rotten copy was taken as the data.
    (13, 90),
    // An unflushed write torn by a power loss on one child only, its
    // staged mapping checked against the other: accepted, and the torn
    // copy was left for a read once the good child was faulted.
    (43, 103),
];

#[test]
fn simulated_mirrors_seeds_that_failed_once() {
    for &(seed, operations) in MIRROR_REGRESSIONS {
        runtime().block_on(run_mirror_seed(seed, operations));
    }
}

/// Seeds of the mirror simulation per run (`STRATA_SIM_MIRROR_SEEDS`).
const MIRROR_SEEDS: u64 = 24;

#[test]
fn simulated_crashes_faults_and_rot_on_mirrors_never_lose_or_garble_data() {
    if let Ok(seed) = std::env::var("STRATA_SIM_MIRROR_SEED") {
        let seed: u64 = seed.parse().expect("STRATA_SIM_MIRROR_SEED is a number");
        // Fewer operations (`STRATA_SIM_OPERATIONS`) to find the shortest
        // run of a seed that still fails.
        let operations = env_number("STRATA_SIM_OPERATIONS", OPERATIONS as u64) as _;
        runtime().block_on(run_mirror_seed(seed, operations));
        return;
    }
    run_seeds(env_number("STRATA_SIM_MIRROR_SEEDS", MIRROR_SEEDS), |seed| {
        run_mirror_seed(seed, OPERATIONS)
    });
}
