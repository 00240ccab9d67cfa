//! `SimDevice`: a deterministic, fault-injecting simulated disk for the
//! engine's simulation tests.
//!
//! Like a real disk with a volatile write cache, it keeps two images: the
//! *visible* one (what reads return) and the *durable* one (what survives a
//! power loss). A write updates the visible image at once and is remembered
//! as pending; `flush` makes every pending write durable. [`SimDevice::crash`]
//! is a power loss followed by a reboot: each pending write is, at random,
//! dropped, applied, or torn at 512-byte sector granularity (some sectors
//! new, some old), and the visible image becomes the durable one.
//!
//! Every random choice comes from one seeded [`SimRng`]. By default every
//! future is ready when returned and each operation takes effect when it is
//! called, so a single-threaded test replays exactly from its seed.
//!
//! Completion delays ([`SimDelays`], off by default) make the device
//! concurrent: a delayed operation's future returns `Pending` a seeded
//! number of times (waking itself each time, so it needs no timer and no
//! runtime) and takes effect only when it completes. Operations issued
//! together therefore complete, and take effect, in a seeded order that
//! differs from the order they were issued in, as on a real device with a
//! queue. The contract is kept exactly: a write is visible once its future
//! completes (not before), and a flush makes durable the writes that
//! completed before the flush was *called* — a write that completes while a
//! delayed flush is in flight stays volatile. Under a current-thread runtime
//! the interleaving is a function of the seed.
//!
//! Faults (all off by default, adjustable at runtime): EIO on read, write or
//! flush; misdirected writes (the data lands at another aligned offset, and
//! the intended place keeps its old contents); ignored discards; and bit rot
//! on demand ([`SimDevice::corrupt`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{check_request, BoxFuture, Device, DeviceError, DeviceInfo, DeviceResult, IoBuf};

/// Granularity of the sparse images.
const PAGE_BYTES: usize = 4096;
/// Granularity of torn writes.
pub const SECTOR_BYTES: u64 = 512;

/// A small, fast, seedable PRNG (splitmix64). Public so the simulation
/// harness draws from the same kind of generator and one seed replays all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRng {
    state: u64,
}

impl SimRng {
    pub fn new(seed: u64) -> Self {
        SimRng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound` (0 when `bound` is 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// Uniform in `low..high` (`low` when the range is empty).
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high.saturating_sub(low))
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`. Draws nothing when `p <= 0`, so turning a
    /// knob off does not shift the rest of the random sequence.
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        p >= 1.0 || self.unit() < p
    }

    /// An independent generator seeded from this one.
    pub fn fork(&mut self) -> SimRng {
        SimRng::new(self.next_u64())
    }

    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// Geometry and seed of a simulated device.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub name: String,
    pub size_bytes: u64,
    /// Required alignment of requests (a power of two, at least 512).
    pub block_bytes: u32,
    pub seed: u64,
    pub rotational: bool,
}

impl SimConfig {
    pub fn new(size_bytes: u64, seed: u64) -> Self {
        SimConfig {
            name: "sim".into(),
            size_bytes,
            block_bytes: 512,
            seed,
            rotational: false,
        }
    }
}

/// Fault probabilities, each per operation; all zero by default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SimFaults {
    /// A read fails with [`DeviceError::Injected`] (not sticky).
    pub read_error: f64,
    /// A write fails: each of its sectors may or may not have been written,
    /// and the device's error becomes sticky.
    pub write_error: f64,
    /// A flush fails: nothing becomes durable, the error becomes sticky.
    pub flush_error: f64,
    /// A write lands at another block-aligned offset (recorded, see
    /// [`SimDevice::misdirected_writes`]).
    pub misdirect: f64,
    /// A discard does nothing (the contract allows old contents to remain).
    pub discard_ignored: f64,
}

/// Seeded completion delays, per operation; off by default.
///
/// A delayed operation (read, write, flush or discard) completes after
/// `1..=max_yields` polls that return `Pending`, and takes effect then.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SimDelays {
    /// Probability that an operation is delayed at all (0 draws nothing from
    /// the device's PRNG, so a seed without delays replays exactly as on a
    /// device that has none).
    pub probability: f64,
    /// Most yields a delayed operation waits (at least 1 is used).
    pub max_yields: u32,
}

impl SimDelays {
    /// Every operation delayed by 1 to `max_yields` yields.
    pub fn always(max_yields: u32) -> Self {
        SimDelays {
            probability: 1.0,
            max_yields,
        }
    }
}

/// A future that returns `Pending` `remaining` times, waking its own task
/// each time: a delay measured in scheduler turns, deterministic under a
/// current-thread runtime and harmless under a plain `block_on` loop.
struct Yields {
    remaining: u32,
}

impl std::future::Future for Yields {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.remaining == 0 {
            return std::task::Poll::Ready(());
        }
        self.remaining -= 1;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

/// Relative weights of a pending write's fate at a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashModel {
    pub drop_weight: u32,
    pub apply_weight: u32,
    pub tear_weight: u32,
}

impl Default for CrashModel {
    fn default() -> Self {
        CrashModel {
            drop_weight: 1,
            apply_weight: 1,
            tear_weight: 1,
        }
    }
}

/// Operation counters (since creation or [`SimDevice::reset_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub injected_errors: u64,
    pub misdirected_writes: u64,
    pub crashes: u64,
}

/// A write that landed somewhere else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MisdirectedWrite {
    pub intended_offset: u64,
    pub actual_offset: u64,
    pub length: u64,
}

/// What a crash did to the pending writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashReport {
    pub pending: usize,
    pub dropped: usize,
    pub applied: usize,
    pub torn: usize,
}

type Page = Arc<[u8; PAGE_BYTES]>;

/// A sparse byte image (never-written bytes are zeros). Cloning is cheap:
/// pages are shared until written.
#[derive(Clone, Default)]
pub struct SimImage {
    pages: BTreeMap<u64, Page>,
}

impl std::fmt::Debug for SimImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimImage").field("pages", &self.pages.len()).finish()
    }
}

impl SimImage {
    /// Copies `len` bytes at `offset` out of the image.
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.read_into(offset, &mut out);
        out
    }

    fn read_into(&self, offset: u64, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let pos = offset + done as u64;
            let index = pos / PAGE_BYTES as u64;
            let within = (pos % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - within).min(out.len() - done);
            match self.pages.get(&index) {
                Some(page) => out[done..done + n].copy_from_slice(&page[within..within + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let pos = offset + done as u64;
            let index = pos / PAGE_BYTES as u64;
            let within = (pos % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - within).min(data.len() - done);
            let page = self.pages.entry(index).or_insert_with(|| Arc::new([0; PAGE_BYTES]));
            Arc::make_mut(page)[within..within + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
    }

    fn zero(&mut self, offset: u64, len: u64) {
        let mut done = 0;
        while done < len {
            let pos = offset + done;
            let index = pos / PAGE_BYTES as u64;
            let within = (pos % PAGE_BYTES as u64) as usize;
            let n = ((PAGE_BYTES - within) as u64).min(len - done);
            if n == PAGE_BYTES as u64 {
                self.pages.remove(&index);
            } else if let Some(page) = self.pages.get_mut(&index) {
                Arc::make_mut(page)[within..within + n as usize].fill(0);
            }
            done += n;
        }
    }

    fn xor_byte(&mut self, offset: u64, mask: u8) {
        let index = offset / PAGE_BYTES as u64;
        let within = (offset % PAGE_BYTES as u64) as usize;
        let page = self.pages.entry(index).or_insert_with(|| Arc::new([0; PAGE_BYTES]));
        Arc::make_mut(page)[within] ^= mask;
    }

    /// Offsets of the 512-byte sectors whose contents differ.
    pub fn differing_sectors(&self, other: &SimImage) -> Vec<u64> {
        let zero = [0u8; PAGE_BYTES];
        let mut indexes: Vec<u64> = self.pages.keys().chain(other.pages.keys()).copied().collect();
        indexes.sort_unstable();
        indexes.dedup();
        let mut out = Vec::new();
        for index in indexes {
            let a = self.pages.get(&index).map_or(&zero, |p| &**p);
            let b = other.pages.get(&index).map_or(&zero, |p| &**p);
            for (s, (x, y)) in a.chunks(512).zip(b.chunks(512)).enumerate() {
                if x != y {
                    out.push(index * PAGE_BYTES as u64 + s as u64 * SECTOR_BYTES);
                }
            }
        }
        out
    }

    /// Bytes held in memory (written pages).
    pub fn allocated_bytes(&self) -> u64 {
        self.pages.len() as u64 * PAGE_BYTES as u64
    }
}

impl PartialEq for SimImage {
    fn eq(&self, other: &Self) -> bool {
        self.differing_sectors(other).is_empty()
    }
}

/// A write (or a discard, `data: None`) not yet covered by a flush.
struct Pending {
    /// Completion order: the write completed as the `seq`-th one (from 0).
    seq: u64,
    offset: u64,
    length: u64,
    data: Option<Vec<u8>>,
}

impl Pending {
    fn apply(&self, image: &mut SimImage) {
        match &self.data {
            Some(data) => image.write(self.offset, data),
            None => image.zero(self.offset, self.length),
        }
    }

    fn apply_sector(&self, image: &mut SimImage, sector: u64) {
        let start = sector * SECTOR_BYTES;
        match &self.data {
            Some(data) => image.write(
                self.offset + start,
                &data[start as usize..(start + SECTOR_BYTES) as usize],
            ),
            None => image.zero(self.offset + start, SECTOR_BYTES),
        }
    }
}

struct SimState {
    visible: SimImage,
    durable: SimImage,
    pending: Vec<Pending>,
    rng: SimRng,
    faults: SimFaults,
    delays: SimDelays,
    /// Writes and discards completed so far: the next one's [`Pending::seq`].
    completed: u64,
    crash_model: CrashModel,
    stats: SimStats,
    sticky: Option<String>,
    misdirected: Vec<MisdirectedWrite>,
    /// Simulated power losses so far.
    power_cycles: u64,
}

impl SimState {
    /// Records a completed write or discard as not yet durable.
    fn push_pending(&mut self, offset: u64, length: u64, data: Option<Vec<u8>>) {
        let seq = self.completed;
        self.completed += 1;
        self.pending.push(Pending {
            seq,
            offset,
            length,
            data,
        });
    }
}

struct SimInner {
    info: DeviceInfo,
    state: Mutex<SimState>,
}

/// The simulated device. Clone the handle freely: the test harness keeps one
/// for crashes and faults while the pool owns another as `Arc<dyn Device>`
/// (see [`SimDevice::as_device`]).
#[derive(Clone)]
pub struct SimDevice {
    inner: Arc<SimInner>,
    /// Handles given out by [`SimDevice::as_device`] belong to one power
    /// cycle: after a crash they fail every request, so a pool still holding
    /// them (being dropped, say) cannot touch the "rebooted" device. The
    /// harness's own handle (`None`) always works.
    power_cycle: Option<u64>,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice").field("info", &self.inner.info).finish()
    }
}

impl SimDevice {
    /// A sparse device of `size_bytes` (512-byte blocks) seeded with `seed`.
    pub fn new(size_bytes: u64, seed: u64) -> Self {
        Self::with_config(SimConfig::new(size_bytes, seed))
    }

    pub fn with_config(config: SimConfig) -> Self {
        let block_bytes = config.block_bytes.max(512).next_power_of_two();
        let info = DeviceInfo {
            name: config.name,
            size_bytes: config.size_bytes - config.size_bytes % u64::from(block_bytes),
            block_bytes,
            direct_io: true,
            rotational: config.rotational,
            engine: "sim",
            regular_file: false,
        };
        SimDevice {
            inner: Arc::new(SimInner {
                info,
                state: Mutex::new(SimState {
                    visible: SimImage::default(),
                    durable: SimImage::default(),
                    pending: Vec::new(),
                    rng: SimRng::new(config.seed),
                    faults: SimFaults::default(),
                    delays: SimDelays::default(),
                    completed: 0,
                    crash_model: CrashModel::default(),
                    stats: SimStats::default(),
                    sticky: None,
                    misdirected: Vec::new(),
                    power_cycles: 0,
                }),
            }),
            power_cycle: None,
        }
    }

    /// Another handle to the same device, as the trait object the pool keeps.
    pub fn as_device(&self) -> Arc<dyn Device> {
        let cycle = self.state().power_cycles;
        Arc::new(SimDevice {
            inner: self.inner.clone(),
            power_cycle: Some(cycle),
        })
    }

    /// `Err` when this handle predates the last simulated power loss.
    fn check_powered(&self, state: &SimState) -> DeviceResult<()> {
        match self.power_cycle {
            Some(cycle) if cycle != state.power_cycles => Err(DeviceError::Failed {
                device: self.inner.info.name.clone(),
                reason: "the power failed: this handle predates a simulated crash".into(),
            }),
            _ => Ok(()),
        }
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        // A panic in a test while holding the lock must not hide the state
        // from the harness that reports it.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn faults(&self) -> SimFaults {
        self.state().faults
    }

    pub fn set_faults(&self, faults: SimFaults) {
        self.state().faults = faults;
    }

    pub fn delays(&self) -> SimDelays {
        self.state().delays
    }

    /// Turns seeded completion delays on (or off, with the default).
    pub fn set_delays(&self, delays: SimDelays) {
        self.state().delays = delays;
    }

    pub fn set_crash_model(&self, model: CrashModel) {
        self.state().crash_model = model;
    }

    pub fn stats(&self) -> SimStats {
        self.state().stats
    }

    pub fn reset_stats(&self) {
        self.state().stats = SimStats::default();
    }

    /// Every write that landed somewhere else, oldest first.
    pub fn misdirected_writes(&self) -> Vec<MisdirectedWrite> {
        self.state().misdirected.clone()
    }

    /// Writes (and discards) not yet covered by a flush.
    pub fn pending_writes(&self) -> usize {
        self.state().pending.len()
    }

    /// True once a write or flush failed (until the next crash/reboot).
    pub fn has_failed(&self) -> bool {
        self.state().sticky.is_some()
    }

    /// The image reads return now.
    pub fn snapshot(&self) -> SimImage {
        self.state().visible.clone()
    }

    /// The image a crash would start from (before pending writes are resolved).
    pub fn durable_snapshot(&self) -> SimImage {
        self.state().durable.clone()
    }

    /// What a read would return now (the unit tests' view of the device).
    #[cfg(test)]
    fn read_visible(&self, offset: u64, len: usize) -> Vec<u8> {
        self.state().visible.read(offset, len)
    }

    pub fn read_durable(&self, offset: u64, len: usize) -> Vec<u8> {
        self.state().durable.read(offset, len)
    }

    /// Writes straight into both images, bypassing faults and counters:
    /// for setting up a test (a foreign superblock, a damaged record).
    pub fn write_durable(&self, offset: u64, data: &[u8]) {
        let mut state = self.state();
        state.visible.write(offset, data);
        state.durable.write(offset, data);
    }

    /// A new device holding what reads of this one return now (a copy of
    /// a stopped device, to damage without touching the original).
    pub fn copy(&self, seed: u64) -> SimDevice {
        let info = &self.inner.info;
        let copy = SimDevice::with_config(SimConfig {
            name: info.name.clone(),
            size_bytes: info.size_bytes,
            block_bytes: info.block_bytes,
            seed,
            rotational: info.rotational,
        });
        let image = self.state().visible.clone();
        {
            let mut state = copy.state();
            state.visible = image.clone();
            state.durable = image;
        }
        copy
    }

    /// Bit rot: in every 512-byte piece of `[offset, offset + len)` one
    /// random byte gets random bits flipped, in both images.
    pub fn corrupt(&self, offset: u64, len: u64) {
        let mut state = self.state();
        let end = offset.saturating_add(len).min(self.inner.info.size_bytes);
        let mut pos = offset;
        while pos < end {
            let piece_end = ((pos / SECTOR_BYTES + 1) * SECTOR_BYTES).min(end);
            let target = state.rng.range(pos, piece_end);
            let mask = (state.rng.below(255) + 1) as u8;
            state.durable.xor_byte(target, mask);
            state.visible.xor_byte(target, mask);
            pos = piece_end;
        }
    }

    /// Power loss and reboot, using the device's own PRNG.
    pub fn crash(&self) -> CrashReport {
        let mut state = self.state();
        let mut rng = state.rng.fork();
        Self::crash_locked(&mut state, &mut rng)
    }

    /// Power loss and reboot, with the harness's PRNG deciding the fate of
    /// each pending write. Afterwards reads return the durable image, the
    /// sticky error is cleared (the device was "reopened") and the device
    /// keeps working.
    pub fn crash_with(&self, rng: &mut SimRng) -> CrashReport {
        let mut state = self.state();
        Self::crash_locked(&mut state, rng)
    }

    fn crash_locked(state: &mut SimState, rng: &mut SimRng) -> CrashReport {
        let model = state.crash_model;
        let total = u64::from(model.drop_weight) + u64::from(model.apply_weight) + u64::from(model.tear_weight);
        let pending = std::mem::take(&mut state.pending);
        let mut report = CrashReport {
            pending: pending.len(),
            ..CrashReport::default()
        };
        for write in &pending {
            let pick = rng.below(total.max(1));
            if pick < u64::from(model.drop_weight) || total == 0 {
                report.dropped += 1;
            } else if pick < u64::from(model.drop_weight) + u64::from(model.apply_weight) {
                write.apply(&mut state.durable);
                report.applied += 1;
            } else {
                for sector in 0..write.length / SECTOR_BYTES {
                    if rng.below(2) == 1 {
                        write.apply_sector(&mut state.durable, sector);
                    }
                }
                report.torn += 1;
            }
        }
        state.visible = state.durable.clone();
        state.sticky = None;
        state.stats.crashes += 1;
        state.power_cycles += 1;
        report
    }

    fn do_read(&self, offset: u64, buf: &mut IoBuf) -> DeviceResult<()> {
        let info = &self.inner.info;
        check_request(info, offset, buf.len() as u64)?;
        let mut state = self.state();
        self.check_powered(&state)?;
        state.stats.reads += 1;
        state.stats.bytes_read += buf.len() as u64;
        let p = state.faults.read_error;
        if state.rng.chance(p) {
            state.stats.injected_errors += 1;
            return Err(DeviceError::Injected {
                device: info.name.clone(),
                offset,
            });
        }
        state.visible.read_into(offset, buf.payload_mut());
        Ok(())
    }

    fn do_write(&self, offset: u64, data: &[u8]) -> DeviceResult<()> {
        let info = &self.inner.info;
        check_request(info, offset, data.len() as u64)?;
        let mut state = self.state();
        self.check_powered(&state)?;
        if let Some(reason) = &state.sticky {
            return Err(DeviceError::Failed {
                device: info.name.clone(),
                reason: reason.clone(),
            });
        }
        state.stats.writes += 1;
        state.stats.bytes_written += data.len() as u64;
        if data.is_empty() {
            return Ok(());
        }
        let p = state.faults.write_error;
        if state.rng.chance(p) {
            // A failed write leaves each sector either old or new.
            for sector in 0..data.len() as u64 / SECTOR_BYTES {
                if state.rng.below(2) == 1 {
                    let start = (sector * SECTOR_BYTES) as usize;
                    let piece = data[start..start + SECTOR_BYTES as usize].to_vec();
                    let at = offset + sector * SECTOR_BYTES;
                    state.visible.write(at, &piece);
                    state.push_pending(at, SECTOR_BYTES, Some(piece));
                }
            }
            state.stats.injected_errors += 1;
            state.sticky = Some(format!("injected write error at offset {offset}"));
            return Err(DeviceError::Injected {
                device: info.name.clone(),
                offset,
            });
        }
        let mut target = offset;
        let p = state.faults.misdirect;
        if state.rng.chance(p) {
            let block = u64::from(info.block_bytes);
            let slots = (info.size_bytes - data.len() as u64) / block + 1;
            if slots > 1 {
                let mut slot = state.rng.below(slots - 1);
                if slot >= offset / block {
                    slot += 1;
                }
                target = slot * block;
                state.stats.misdirected_writes += 1;
                state.misdirected.push(MisdirectedWrite {
                    intended_offset: offset,
                    actual_offset: target,
                    length: data.len() as u64,
                });
            }
        }
        state.visible.write(target, data);
        state.push_pending(target, data.len() as u64, Some(data.to_vec()));
        Ok(())
    }

    /// A flush of `[offset, offset + length)`: the pending writes inside it
    /// that completed before the flush was called (`seq < upto`) become
    /// durable, the others stay pending. If such a write straddles the
    /// range's edge, all of them are flushed (a device may flush more than
    /// asked; splitting it could reorder overlapping writes). Writes that
    /// completed later are newer than every write flushed here, so leaving
    /// them pending reorders nothing.
    fn do_flush_range(&self, offset: u64, length: u64, upto: u64) -> DeviceResult<()> {
        let info = &self.inner.info;
        let mut state = self.state();
        self.check_powered(&state)?;
        if let Some(reason) = &state.sticky {
            return Err(DeviceError::Failed {
                device: info.name.clone(),
                reason: reason.clone(),
            });
        }
        state.stats.flushes += 1;
        let p = state.faults.flush_error;
        if state.rng.chance(p) {
            state.stats.injected_errors += 1;
            state.sticky = Some("injected flush error".into());
            return Err(DeviceError::Injected {
                device: info.name.clone(),
                offset: 0,
            });
        }
        let end = offset.saturating_add(length);
        let inside = |w: &Pending| w.offset >= offset && w.offset + w.length <= end;
        let outside = |w: &Pending| w.offset + w.length <= offset || w.offset >= end;
        let covered = |w: &Pending| w.seq < upto;
        let state = &mut *state;
        let whole = state.pending.iter().any(|w| covered(w) && !inside(w) && !outside(w));
        let (durable, still): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut state.pending)
            .into_iter()
            .partition(|w| covered(w) && (whole || inside(w)));
        for write in &durable {
            write.apply(&mut state.durable);
        }
        state.pending = still;
        Ok(())
    }

    fn do_discard(&self, offset: u64, length: u64) -> DeviceResult<()> {
        let info = &self.inner.info;
        check_request(info, offset, length)?;
        let mut state = self.state();
        self.check_powered(&state)?;
        if let Some(reason) = &state.sticky {
            return Err(DeviceError::Failed {
                device: info.name.clone(),
                reason: reason.clone(),
            });
        }
        state.stats.discards += 1;
        let p = state.faults.discard_ignored;
        if length == 0 || state.rng.chance(p) {
            return Ok(());
        }
        state.visible.zero(offset, length);
        state.push_pending(offset, length, None);
        Ok(())
    }
}

/// How an operation runs: at once, or after a delay on a handle bound to
/// the power cycle it was issued in.
enum Issue {
    Now,
    /// Wait `yields` turns, then run on `handle`; `completed` is the
    /// device's count of completed writes when the operation was issued
    /// (what a flush covers).
    Delayed {
        yields: u32,
        handle: SimDevice,
        completed: u64,
    },
}

impl SimDevice {
    /// Decides (from the device's PRNG, drawing nothing when delays are
    /// off) whether an operation issued now is delayed, and by how much.
    fn issue(&self) -> Issue {
        let mut state = self.state();
        let delays = state.delays;
        if !state.rng.chance(delays.probability) {
            return Issue::Now;
        }
        let yields = state.rng.range(1, u64::from(delays.max_yields.max(1)) + 1) as u32;
        Issue::Delayed {
            yields,
            // An operation issued before a crash fails when it completes
            // after it, even on the harness's own handle.
            handle: SimDevice {
                inner: self.inner.clone(),
                power_cycle: Some(self.power_cycle.unwrap_or(state.power_cycles)),
            },
            completed: state.completed,
        }
    }
}

impl Device for SimDevice {
    fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    fn read(&self, offset: u64, mut buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        match self.issue() {
            Issue::Now => {
                let result = self.do_read(offset, &mut buf);
                Box::pin(std::future::ready((buf, result)))
            }
            Issue::Delayed { yields, handle, .. } => Box::pin(async move {
                Yields { remaining: yields }.await;
                let result = handle.do_read(offset, &mut buf);
                (buf, result)
            }),
        }
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        match self.issue() {
            Issue::Now => {
                let result = self.do_write(offset, buf.payload());
                Box::pin(std::future::ready((buf, result)))
            }
            Issue::Delayed { yields, handle, .. } => Box::pin(async move {
                Yields { remaining: yields }.await;
                let result = handle.do_write(offset, buf.payload());
                (buf, result)
            }),
        }
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        self.flush_range(0, u64::MAX)
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        match self.issue() {
            Issue::Now => {
                let upto = self.state().completed;
                Box::pin(std::future::ready(self.do_flush_range(offset, length, upto)))
            }
            // Covers only the writes completed before this call.
            Issue::Delayed {
                yields,
                handle,
                completed,
            } => Box::pin(async move {
                Yields { remaining: yields }.await;
                handle.do_flush_range(offset, length, completed)
            }),
        }
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        match self.issue() {
            Issue::Now => Box::pin(std::future::ready(self.do_discard(offset, length))),
            Issue::Delayed { yields, handle, .. } => Box::pin(async move {
                Yields { remaining: yields }.await;
                handle.do_discard(offset, length)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    /// Polls a sim future once: it must be ready.
    fn now<T>(fut: impl Future<Output = T>) -> T {
        let mut cx = Context::from_waker(Waker::noop());
        let mut fut = std::pin::pin!(fut);
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("SimDevice futures must be ready at once"),
        }
    }

    fn write(dev: &SimDevice, offset: u64, data: &[u8]) -> DeviceResult<()> {
        now(dev.write(offset, IoBuf::copy_from(data))).1
    }

    fn read(dev: &SimDevice, offset: u64, len: usize) -> DeviceResult<Vec<u8>> {
        let (buf, res) = now(dev.read(offset, IoBuf::new(len)));
        res.map(|()| buf.into_vec())
    }

    #[test]
    fn rng_is_deterministic_and_spread() {
        let mut a = SimRng::new(42);
        let mut b = SimRng::new(42);
        let xs: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(SimRng::new(1).next_u64(), SimRng::new(2).next_u64());
        let mut counts = [0u32; 10];
        for _ in 0..10_000 {
            counts[a.below(10) as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
        assert!(!a.chance(0.0));
        assert!(a.chance(1.0));
    }

    #[test]
    fn sparse_and_zero_filled() {
        let dev = SimDevice::new(64 << 30, 1);
        assert_eq!(read(&dev, 40 << 30, 8192).unwrap(), vec![0; 8192]);
        write(&dev, 10 << 30, &[5; 4096]).unwrap();
        assert_eq!(read(&dev, 10 << 30, 4096).unwrap(), vec![5; 4096]);
        assert_eq!(dev.snapshot().allocated_bytes(), 4096);
    }

    #[test]
    fn entry_checks() {
        let dev = SimDevice::new(1 << 20, 1);
        assert!(matches!(
            write(&dev, 100, &[0; 512]),
            Err(DeviceError::Misaligned { .. })
        ));
        assert!(matches!(write(&dev, 0, &[0; 100]), Err(DeviceError::Misaligned { .. })));
        assert!(matches!(read(&dev, 1 << 20, 512), Err(DeviceError::OutOfRange { .. })));
        assert!(matches!(
            read(&dev, u64::MAX - 511, 512),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            now(dev.discard(1 << 20, 512)),
            Err(DeviceError::OutOfRange { .. })
        ));
    }

    #[test]
    fn flushed_writes_survive_and_unflushed_may_not() {
        let dev = SimDevice::new(1 << 20, 7);
        write(&dev, 0, &[1; 4096]).unwrap();
        now(dev.flush()).unwrap();
        write(&dev, 0, &[2; 4096]).unwrap();
        assert_eq!(dev.pending_writes(), 1);
        dev.set_crash_model(CrashModel {
            drop_weight: 1,
            apply_weight: 0,
            tear_weight: 0,
        });
        let report = dev.crash();
        assert_eq!(report.dropped, 1);
        assert_eq!(read(&dev, 0, 4096).unwrap(), vec![1; 4096]);
        assert_eq!(dev.pending_writes(), 0);
    }

    #[test]
    fn a_ranged_flush_makes_only_its_range_durable_unless_a_write_straddles_it() {
        let drop_all = CrashModel {
            drop_weight: 1,
            apply_weight: 0,
            tear_weight: 0,
        };
        let dev = SimDevice::new(1 << 20, 9);
        dev.set_crash_model(drop_all);
        write(&dev, 0, &[1; 4096]).unwrap();
        write(&dev, 65536, &[2; 8192]).unwrap();
        now(dev.flush_range(65536, 65536)).unwrap();
        assert_eq!(dev.pending_writes(), 1, "the write outside the range stays pending");
        dev.crash();
        assert_eq!(read(&dev, 0, 4096).unwrap(), vec![0; 4096], "outside: lost");
        assert_eq!(read(&dev, 65536, 8192).unwrap(), vec![2; 8192], "inside: durable");
        // A write across the range's edge: everything is flushed.
        write(&dev, 0, &[3; 4096]).unwrap();
        write(&dev, 61440, &[4; 8192]).unwrap();
        now(dev.flush_range(65536, 65536)).unwrap();
        assert_eq!(dev.pending_writes(), 0);
        dev.crash();
        assert_eq!(read(&dev, 0, 4096).unwrap(), vec![3; 4096]);
        assert_eq!(read(&dev, 61440, 8192).unwrap(), vec![4; 8192]);
    }

    #[test]
    fn discard_reads_zeros_and_is_pending_until_flushed() {
        let dev = SimDevice::new(1 << 20, 3);
        write(&dev, 0, &[4; 8192]).unwrap();
        now(dev.flush()).unwrap();
        now(dev.discard(0, 4096)).unwrap();
        assert_eq!(read(&dev, 0, 4096).unwrap(), vec![0; 4096]);
        dev.set_crash_model(CrashModel {
            drop_weight: 1,
            apply_weight: 0,
            tear_weight: 0,
        });
        dev.crash();
        assert_eq!(
            read(&dev, 0, 4096).unwrap(),
            vec![4; 4096],
            "an unflushed discard may be lost"
        );
        now(dev.discard(0, 4096)).unwrap();
        now(dev.flush()).unwrap();
        dev.crash();
        assert_eq!(read(&dev, 0, 8192).unwrap()[..4096], [0; 4096]);
        // Ignored discards keep the data, which the contract allows.
        dev.set_faults(SimFaults {
            discard_ignored: 1.0,
            ..SimFaults::default()
        });
        now(dev.discard(4096, 4096)).unwrap();
        assert_eq!(read(&dev, 4096, 4096).unwrap(), vec![4; 4096]);
    }

    #[test]
    fn injected_errors_and_stickiness() {
        let dev = SimDevice::new(1 << 20, 11);
        dev.set_faults(SimFaults {
            read_error: 1.0,
            ..SimFaults::default()
        });
        assert!(matches!(read(&dev, 0, 512), Err(DeviceError::Injected { .. })));
        assert!(!dev.has_failed(), "read errors are not sticky");
        dev.set_faults(SimFaults {
            write_error: 1.0,
            ..SimFaults::default()
        });
        assert!(matches!(write(&dev, 0, &[1; 512]), Err(DeviceError::Injected { .. })));
        dev.set_faults(SimFaults::default());
        assert!(matches!(write(&dev, 0, &[1; 512]), Err(DeviceError::Failed { .. })));
        assert!(matches!(now(dev.flush()), Err(DeviceError::Failed { .. })));
        assert!(read(&dev, 0, 512).is_ok(), "reads still work");
        dev.crash();
        assert!(!dev.has_failed(), "a reboot clears the sticky error");
        write(&dev, 0, &[1; 512]).unwrap();
        dev.set_faults(SimFaults {
            flush_error: 1.0,
            ..SimFaults::default()
        });
        assert!(matches!(now(dev.flush()), Err(DeviceError::Injected { .. })));
        assert_eq!(dev.pending_writes(), 1, "a failed flush makes nothing durable");
        assert_eq!(dev.stats().injected_errors, 3);
    }

    #[test]
    fn misdirected_writes_are_recorded() {
        let dev = SimDevice::new(1 << 20, 5);
        dev.set_faults(SimFaults {
            misdirect: 1.0,
            ..SimFaults::default()
        });
        write(&dev, 8192, &[9; 4096]).unwrap();
        let [m] = dev.misdirected_writes()[..] else {
            panic!("one misdirected write expected")
        };
        assert_eq!(m.intended_offset, 8192);
        assert_ne!(m.actual_offset, 8192);
        assert_eq!(m.actual_offset % 512, 0);
        assert!(m.actual_offset + 4096 <= 1 << 20);
        assert_eq!(read(&dev, m.actual_offset, 4096).unwrap(), vec![9; 4096]);
        if m.actual_offset.abs_diff(8192) >= 4096 {
            assert_eq!(read(&dev, 8192, 4096).unwrap(), vec![0; 4096]);
        }
    }

    #[test]
    fn corrupt_flips_bits_in_every_sector_of_the_range() {
        let dev = SimDevice::new(1 << 20, 9);
        write(&dev, 0, &[0xAA; 8192]).unwrap();
        now(dev.flush()).unwrap();
        let before = dev.snapshot();
        dev.corrupt(1024, 2048);
        let after = dev.snapshot();
        assert_eq!(before.differing_sectors(&after), vec![1024, 1536, 2048, 2560]);
        assert_eq!(dev.durable_snapshot(), after, "bit rot is on the medium");
    }

    #[test]
    fn stats_count_operations() {
        let dev = SimDevice::new(1 << 20, 2);
        write(&dev, 0, &[1; 4096]).unwrap();
        write(&dev, 4096, &[1; 512]).unwrap();
        read(&dev, 0, 1024).unwrap();
        now(dev.flush()).unwrap();
        let stats = dev.stats();
        assert_eq!((stats.writes, stats.bytes_written), (2, 4608));
        assert_eq!((stats.reads, stats.bytes_read), (1, 1024));
        assert_eq!(stats.flushes, 1);
        dev.reset_stats();
        assert_eq!(dev.stats(), SimStats::default());
    }

    /// A sector's contents in the model: the id of the write that put it
    /// there (0 = never written). Each written sector is filled with its
    /// write id so a read tells which write it came from, and a sector that
    /// mixes two writes is detected.
    fn sector_id(bytes: &[u8]) -> u64 {
        let id = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert!(
            bytes.chunks(8).all(|w| w == id.to_le_bytes()),
            "a sector mixes two writes (tearing inside a sector)"
        );
        id
    }

    #[test]
    fn crash_property_many_seeds() {
        const SECTORS: u64 = 64;
        let mut totals = CrashReport::default();
        let mut mixed_torn_write_seen = false;
        for seed in 0..400u64 {
            let mut rng = SimRng::new(seed);
            let dev = SimDevice::new(SECTORS * SECTOR_BYTES, rng.next_u64());
            // Per sector: the durable id and the ids written since the last flush.
            let mut durable = vec![0u64; SECTORS as usize];
            let mut since_flush: Vec<Vec<u64>> = vec![Vec::new(); SECTORS as usize];
            let mut visible = vec![0u64; SECTORS as usize];
            let mut next_id = 1u64;
            for _step in 0..120 {
                match rng.below(10) {
                    0..=6 => {
                        let start = rng.below(SECTORS);
                        let count = rng.range(1, (SECTORS - start).min(16) + 1);
                        let id = next_id;
                        next_id += 1;
                        let data: Vec<u8> = std::iter::repeat_n(id.to_le_bytes(), (count * 64) as usize)
                            .flatten()
                            .collect();
                        write(&dev, start * SECTOR_BYTES, &data).unwrap();
                        for s in start..start + count {
                            since_flush[s as usize].push(id);
                            visible[s as usize] = id;
                        }
                    }
                    7 => {
                        now(dev.flush()).unwrap();
                        for s in 0..SECTORS as usize {
                            durable[s] = visible[s];
                            since_flush[s].clear();
                        }
                    }
                    8 => {
                        let got = read(&dev, 0, (SECTORS * SECTOR_BYTES) as usize).unwrap();
                        for s in 0..SECTORS as usize {
                            assert_eq!(sector_id(&got[s * 512..(s + 1) * 512]), visible[s], "seed {seed}");
                        }
                    }
                    _ => {
                        let report = dev.crash_with(&mut rng);
                        totals.dropped += report.dropped;
                        totals.applied += report.applied;
                        totals.torn += report.torn;
                        let got = read(&dev, 0, (SECTORS * SECTOR_BYTES) as usize).unwrap();
                        let mut ids_per_write: BTreeMap<u64, (bool, bool)> = BTreeMap::new();
                        for s in 0..SECTORS as usize {
                            let id = sector_id(&got[s * 512..(s + 1) * 512]);
                            if since_flush[s].is_empty() {
                                assert_eq!(id, durable[s], "seed {seed}: a flushed sector changed");
                            } else {
                                assert!(
                                    id == durable[s] || since_flush[s].contains(&id),
                                    "seed {seed}: sector {s} holds {id}, neither old {} nor one of {:?}",
                                    durable[s],
                                    since_flush[s]
                                );
                                if let Some(&last) = since_flush[s].last() {
                                    let entry = ids_per_write.entry(last).or_default();
                                    if id == last {
                                        entry.0 = true;
                                    } else {
                                        entry.1 = true;
                                    }
                                }
                            }
                            durable[s] = id;
                            visible[s] = id;
                            since_flush[s].clear();
                        }
                        if ids_per_write.values().any(|&(new, old)| new && old) {
                            mixed_torn_write_seen = true;
                        }
                    }
                }
            }
        }
        assert!(
            totals.dropped > 100 && totals.applied > 100 && totals.torn > 100,
            "{totals:?}"
        );
        assert!(
            mixed_torn_write_seen,
            "some write must have been torn into old and new sectors"
        );
    }

    /// Polls each future in turn, round robin, until all are done, and
    /// returns their indexes in completion order with their outputs (a
    /// minimal deterministic executor: the sim's delays wake themselves).
    fn complete_all<T>(futures: Vec<BoxFuture<'_, T>>) -> Vec<(usize, T)> {
        let mut cx = Context::from_waker(Waker::noop());
        let mut futures: Vec<Option<BoxFuture<'_, T>>> = futures.into_iter().map(Some).collect();
        let mut done = Vec::new();
        while done.len() < futures.len() {
            for (index, slot) in futures.iter_mut().enumerate() {
                if let Some(fut) = slot {
                    if let Poll::Ready(value) = fut.as_mut().poll(&mut cx) {
                        done.push((index, value));
                        *slot = None;
                    }
                }
            }
        }
        done
    }

    #[test]
    fn delayed_writes_complete_out_of_order_and_take_effect_when_they_complete() {
        let order = |seed: u64| {
            let dev = SimDevice::new(1 << 20, seed);
            dev.set_delays(SimDelays::always(8));
            let writes: Vec<BoxFuture<'_, _>> = (0..8u8)
                .map(|i| dev.write(u64::from(i) * 4096, IoBuf::copy_from(&[i + 1; 4096])))
                .collect();
            assert_eq!(dev.pending_writes(), 0, "nothing takes effect before it completes");
            assert_eq!(dev.read_visible(0, 4096), vec![0; 4096]);
            let done = complete_all(writes);
            for (_, (_, result)) in &done {
                result.as_ref().unwrap();
            }
            assert_eq!(dev.pending_writes(), 8);
            for i in 0..8u8 {
                assert_eq!(dev.read_visible(u64::from(i) * 4096, 4096), vec![i + 1; 4096]);
            }
            done.into_iter().map(|(index, _)| index).collect::<Vec<_>>()
        };
        let a = order(5);
        assert_eq!(a, order(5), "the same seed completes in the same order");
        let reordered = (0..20).map(order).filter(|o| o.windows(2).any(|w| w[0] > w[1])).count();
        assert!(reordered >= 15, "most seeds reorder completions ({reordered} of 20)");
        // Overlapping writes: the one that completes last wins.
        let dev = SimDevice::new(1 << 20, 3);
        dev.set_delays(SimDelays::always(16));
        let writes: Vec<BoxFuture<'_, _>> = (1..=6u8).map(|i| dev.write(0, IoBuf::copy_from(&[i; 512]))).collect();
        let last = complete_all(writes).last().unwrap().0 as u8 + 1;
        assert_eq!(dev.read_visible(0, 512), vec![last; 512]);
    }

    #[test]
    fn a_delayed_flush_covers_only_writes_completed_before_it_was_called() {
        let drop_all = CrashModel {
            drop_weight: 1,
            apply_weight: 0,
            tear_weight: 0,
        };
        for seed in 0..50 {
            let dev = SimDevice::new(1 << 20, seed);
            dev.set_crash_model(drop_all);
            write(&dev, 0, &[1; 4096]).unwrap();
            dev.set_delays(SimDelays::always(4));
            // A write issued before the flush, completing after it was called.
            let late = dev.write(4096, IoBuf::copy_from(&[2; 4096]));
            let flush = dev.flush();
            let results = complete_all(vec![Box::pin(async move { late.await.1 }) as BoxFuture<'_, _>, flush]);
            for (_, result) in results {
                result.unwrap();
            }
            dev.set_delays(SimDelays::default());
            assert_eq!(dev.pending_writes(), 1, "seed {seed}: the late write stays volatile");
            assert_eq!(read(&dev, 4096, 4096).unwrap(), vec![2; 4096], "but visible");
            dev.crash();
            assert_eq!(read(&dev, 0, 4096).unwrap(), vec![1; 4096], "seed {seed}: flushed");
            assert_eq!(read(&dev, 4096, 4096).unwrap(), vec![0; 4096], "seed {seed}: dropped");
        }
    }

    #[test]
    fn an_operation_in_flight_at_a_crash_fails_and_changes_nothing() {
        let dev = SimDevice::new(1 << 20, 4);
        dev.set_delays(SimDelays::always(3));
        let handle = dev.as_device();
        let mut cx = Context::from_waker(Waker::noop());
        let mut in_flight = handle.write(0, IoBuf::copy_from(&[7; 512]));
        assert!(in_flight.as_mut().poll(&mut cx).is_pending());
        let mut own = dev.write(512, IoBuf::copy_from(&[8; 512]));
        assert!(own.as_mut().poll(&mut cx).is_pending());
        dev.crash();
        // Both fail: the pool's handle belongs to the old power cycle, and
        // the harness's write was issued in it.
        for (_, (_, result)) in complete_all(vec![in_flight, own]) {
            assert!(matches!(result, Err(DeviceError::Failed { .. })), "{result:?}");
        }
        dev.set_delays(SimDelays::default());
        assert_eq!(read(&dev, 0, 1024).unwrap(), vec![0; 1024]);
        assert_eq!(dev.pending_writes(), 0);
    }

    #[test]
    fn same_seed_same_outcome() {
        let run = |seed: u64| {
            let dev = SimDevice::new(1 << 16, seed);
            dev.set_faults(SimFaults {
                misdirect: 0.2,
                ..SimFaults::default()
            });
            let mut rng = SimRng::new(seed ^ 1);
            for i in 0..50u64 {
                let off = rng.below(128) * 512;
                let _ = write(&dev, off, &[i as u8; 512]);
            }
            dev.crash();
            (dev.snapshot(), dev.misdirected_writes())
        };
        let (a, ma) = run(77);
        let (b, mb) = run(77);
        assert!(a == b && ma == mb);
        let (c, _) = run(78);
        assert!(a != c);
    }
}
