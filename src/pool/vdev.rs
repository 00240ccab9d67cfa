//! Virtual devices: what a pool member is. A member ([`Vdev`]) is a single
//! device or a mirror of devices; either way the pool sees one address
//! space, through the [`Device`] trait, so the allocator, the block map, the
//! metadata store and the log are the same on both (ZFS's vdevs are the
//! model). A single device becomes a mirror, and a mirror gains or loses
//! devices, while the pool runs (`pool/attach.rs`): a mirror's children are
//! a list replaced whole under a short lock, which every request reads once.
//!
//! A [`Mirror`]:
//! - writes to every child that is up to date (and to one being
//!   resilvered), all at once, and completes when they all have; a child
//!   that fails a write or a flush is faulted, and the fault is recorded in
//!   the other devices' superblocks (the pool's [`Membership`]) before
//!   the write completes, so a restart never trusts a copy that missed an
//!   acknowledged write. The write fails only when no up-to-date child took
//!   it.
//! - reads from the up-to-date child with the fewest reads in flight
//!   (write-mostly children only when no other can); a read that fails is
//!   retried on the next child, and the range that failed is rewritten from
//!   the copy that read.
//! - lets the pool read and write one child at a time
//!   ([`Mirror::read_child`], [`Mirror::write_child`]): a block whose
//!   checksum does not match is looked for on the other children and the
//!   bad copies rewritten from a good one (`pool/volume/read.rs`), each
//!   rewrite flushed before it counts as repaired.
//! - while a child that its dirty record is complete for is behind, keeps
//!   the record (`pool/dirty.rs`): a write to a unit whose bit is not yet
//!   durable on every written child waits until it is, so a returning child
//!   is resilvered only where the member changed.
//! - while the pool opens, reads from one child only ([`Mirror::pin_reads`]):
//!   the metadata store is opened from one copy, the log replayed from the
//!   copy that goes furthest (every child's is read), and the log region
//!   then copied to the others, so a write that was in flight on one child
//!   only when the pool stopped, or rot in one copy, cannot make the
//!   copies tell two stories.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use super::dirty::{self, DirtyState, RecordKey, RECORD_OFFSETS};
use super::superblock::{ChildState, Superblock};
use crate::device::{BackingSpace, BoxFuture, Device, DeviceError, DeviceInfo, DeviceResult, IoBuf};

/// How a mirror child is doing, as `pool status` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum Health {
    /// Up to date: written and read.
    Online,
    /// Being brought up to date: written, not read.
    Resilvering,
    /// Missed writes while it was away or failing (its superblocks say
    /// so): neither written nor read until a resilver.
    Stale,
    /// Failed a write or flush while the pool ran: no more I/O.
    Faulted,
    /// Not found when the pool was opened.
    Missing,
}

impl Health {
    fn from_u8(value: u8) -> Health {
        match value {
            0 => Health::Online,
            1 => Health::Resilvering,
            2 => Health::Stale,
            3 => Health::Faulted,
            _ => Health::Missing,
        }
    }

    fn code(self) -> u8 {
        match self {
            Health::Online => 0,
            Health::Resilvering => 1,
            Health::Stale => 2,
            Health::Faulted => 3,
            Health::Missing => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Health::Online => "ONLINE",
            Health::Resilvering => "RESILVERING",
            Health::Stale => "STALE",
            Health::Faulted => "FAULTED",
            Health::Missing => "MISSING",
        }
    }

    /// Whether the child gets writes.
    fn written(self) -> bool {
        matches!(self, Health::Online | Health::Resilvering)
    }
}

/// Error counts of one physical device.
#[derive(Debug, Default)]
pub struct ChildCounters {
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub checksum_errors: AtomicU64,
    /// Ranges rewritten from another copy (after a failed read or a
    /// checksum mismatch), in 4 KiB sectors.
    pub repaired: AtomicU64,
}

/// One device of a mirror.
pub struct MirrorChild {
    /// `None`: not found when the pool was opened.
    pub device: Option<Arc<dyn Device>>,
    /// The uuid its superblock carries.
    pub uuid: [u8; 16],
    /// A name for messages, also when the device is missing.
    pub name: String,
    pub write_mostly: bool,
    pub counters: ChildCounters,
    health: AtomicU8,
    in_flight: AtomicU32,
    /// While resilvering: every byte below this is up to date.
    pub(crate) resilvered: AtomicU64,
    /// Taken out of the mirror by a detach (a request that picked it
    /// before may still finish on it; nothing trusts it any more).
    detached: AtomicBool,
    /// As its superblock entry says: being replaced (detached once the
    /// replacement is up to date), or the replacement (`pool replace`).
    pub(crate) replaced: AtomicBool,
    pub(crate) replacement: AtomicBool,
    /// While not up to date: the mirror's dirty record holds every unit
    /// written since it went stale (its superblock entry's state `2`), so
    /// a resilver copies only those.
    pub(crate) tracked: AtomicBool,
}

impl MirrorChild {
    pub fn new(
        device: Option<Arc<dyn Device>>,
        uuid: [u8; 16],
        write_mostly: bool,
        health: Health,
        resilvered: u64,
    ) -> MirrorChild {
        let name = match &device {
            Some(device) => device.info().name.clone(),
            None => format!("device {}", super::uuid_text(&uuid)),
        };
        MirrorChild {
            device,
            uuid,
            name,
            write_mostly,
            counters: ChildCounters::default(),
            health: AtomicU8::new(health.code()),
            in_flight: AtomicU32::new(0),
            resilvered: AtomicU64::new(resilvered),
            detached: AtomicBool::new(false),
            replaced: AtomicBool::new(false),
            replacement: AtomicBool::new(false),
            tracked: AtomicBool::new(false),
        }
    }

    /// Whether the mirror's dirty record is complete for it (see `tracked`).
    pub fn tracked(&self) -> bool {
        self.tracked.load(Ordering::Acquire)
    }

    pub fn health(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Acquire))
    }

    /// Moves the child from `from` to `to`; `false` if it was not in `from`.
    pub(crate) fn change_health(&self, from: Health, to: Health) -> bool {
        self.health
            .compare_exchange(from.code(), to.code(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether it is being replaced, and whether it is a replacement.
    pub fn replacing(&self) -> (bool, bool) {
        (
            self.replaced.load(Ordering::Acquire),
            self.replacement.load(Ordering::Acquire),
        )
    }

    /// Whether a detach took it out of its mirror.
    pub fn detached(&self) -> bool {
        self.detached.load(Ordering::Acquire)
    }

    fn is_online(&self) -> bool {
        self.health() == Health::Online && self.device.is_some()
    }

    fn is_written(&self) -> bool {
        self.health().written() && self.device.is_some()
    }
}

/// A mirror's children as they are at one moment: requests work on one
/// such list from start to end, so an index into it stays valid while the
/// mirror's own list changes (a device attached or detached).
pub type Children = Arc<[Arc<MirrorChild>]>;

/// Bytes a resilver copies at a time, and the unit its barrier locks.
pub const RESYNC_UNIT: u64 = 1 << 20;
const STRIPES: usize = 64;
/// Children of one mirror (a read's retries are a bit each in a `u64`).
pub const MAX_MIRROR_CHILDREN: usize = 64;

/// What [`Mirror::mark_faulted`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Faulting {
    /// The child is faulted now.
    Faulted,
    /// It was not written already (a concurrent failure faulted it).
    Already,
    /// The last up-to-date child, or a detached one: its errors are the
    /// pool's (or nobody's).
    Refused,
}

/// A mirror of one or more devices (see the module header).
pub struct Mirror {
    info: DeviceInfo,
    member: u8,
    /// Replaced whole (under the membership lock) when a device is attached
    /// or detached; readers clone the `Arc` under a short read lock.
    children: std::sync::RwLock<Children>,
    /// Reads go to the first up-to-date child only (while the pool opens).
    pinned: AtomicBool,
    /// Which child an idle mirror's next read prefers.
    turn: AtomicU32,
    /// While a resilver copies: writes and discards hold the stripes of the
    /// units they touch shared, the copy of a unit holds its stripe
    /// exclusively, so no write can land between the copy's read from an
    /// up-to-date child and its write to the child being resilvered.
    resyncing: AtomicBool,
    /// Writes under way that did not take a stripe (no resilver then).
    unbarred: AtomicU32,
    stripes: Box<[tokio::sync::RwLock<()>]>,
    /// Where a fault is recorded before the write that met it completes.
    membership: OnceLock<std::sync::Weak<Membership>>,
    /// The pool's uuid (set with the membership): dirty records name it.
    pool_uuid: OnceLock<[u8; 16]>,
    /// Bytes per bit of the dirty record, and 64-bit words of its bitmap.
    unit_bytes: u64,
    words: usize,
    dirty: std::sync::Mutex<DirtyState>,
    /// One persist of the dirty record at a time; writes that need new
    /// bits share the next.
    persisting: tokio::sync::Mutex<()>,
}

impl Mirror {
    /// A mirror of `children` (in the order the superblocks list them) as
    /// member `member` of size `size_bytes`. It reads from its first
    /// up-to-date child only until [`Mirror::pin_reads`] says otherwise.
    pub fn new(member: u8, size_bytes: u64, children: Vec<MirrorChild>) -> Mirror {
        let present: Vec<&Arc<dyn Device>> = children.iter().filter_map(|c| c.device.as_ref()).collect();
        let info = DeviceInfo {
            name: format!("mirror-{member}"),
            size_bytes,
            block_bytes: present.iter().map(|d| d.info().block_bytes).max().unwrap_or(512),
            direct_io: present.iter().all(|d| d.info().direct_io),
            rotational: children
                .iter()
                .filter(|c| !c.write_mostly)
                .filter_map(|c| c.device.as_ref())
                .any(|d| d.info().rotational),
            engine: "mirror",
            regular_file: present.iter().any(|d| d.info().regular_file),
        };
        Mirror {
            info,
            member,
            children: std::sync::RwLock::new(children.into_iter().map(Arc::new).collect()),
            pinned: AtomicBool::new(true),
            turn: AtomicU32::new(0),
            resyncing: AtomicBool::new(false),
            unbarred: AtomicU32::new(0),
            stripes: (0..STRIPES).map(|_| tokio::sync::RwLock::new(())).collect(),
            membership: OnceLock::new(),
            pool_uuid: OnceLock::new(),
            unit_bytes: dirty::unit_bytes_for(size_bytes),
            words: size_bytes.div_ceil(dirty::unit_bytes_for(size_bytes)).div_ceil(64) as usize,
            dirty: std::sync::Mutex::new(DirtyState::default()),
            persisting: tokio::sync::Mutex::new(()),
        }
    }

    pub fn member(&self) -> u8 {
        self.member
    }

    /// The children as they are now.
    pub fn children(&self) -> Children {
        self.children.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Appends `child` (attached: it takes writes from now on if it is
    /// resilvering). The caller holds the membership lock.
    pub(crate) fn push_child(&self, child: MirrorChild) -> Arc<MirrorChild> {
        let child = Arc::new(child);
        let mut children = self.children.write().unwrap_or_else(|e| e.into_inner());
        let mut next: Vec<Arc<MirrorChild>> = children.iter().cloned().collect();
        next.push(child.clone());
        *children = next.into();
        child
    }

    /// Takes the child of uuid `uuid` out (detached): no request started
    /// from now on reads or writes it. The caller holds the membership lock.
    pub(crate) fn remove_child(&self, uuid: &[u8; 16]) -> Option<Arc<MirrorChild>> {
        let mut children = self.children.write().unwrap_or_else(|e| e.into_inner());
        let removed = children.iter().find(|c| &c.uuid == uuid)?.clone();
        removed.detached.store(true, Ordering::Release);
        *children = children.iter().filter(|c| &c.uuid != uuid).cloned().collect();
        drop(children);
        self.refresh_tracking();
        Some(removed)
    }

    /// Reads from one child only (`true`, the state a mirror starts in) or
    /// from the least busy one.
    pub fn pin_reads(&self, pinned: bool) {
        self.pinned.store(pinned, Ordering::Release);
    }

    pub fn set_membership(&self, membership: &Arc<Membership>) {
        let _ = self.membership.set(Arc::downgrade(membership));
        let _ = self.pool_uuid.set(membership.pool_uuid);
    }

    /// Whether any child is not up to date.
    pub fn degraded(&self) -> bool {
        self.children().iter().any(|c| c.health() != Health::Online)
    }

    /// The children that are up to date, in order.
    pub fn online(&self) -> Vec<Arc<MirrorChild>> {
        self.children().iter().filter(|c| c.is_online()).cloned().collect()
    }

    /// The children that get writes (up to date or being resilvered).
    pub fn written(&self) -> Vec<Arc<MirrorChild>> {
        self.children().iter().filter(|c| c.is_written()).cloned().collect()
    }

    /// The child of `children` a read goes to, skipping those in `tried`
    /// (a bit each). The caller that then reads from it moves the turn on
    /// ([`Mirror::took_turn`]); a read that was not done (a fast path the
    /// device cannot take, before the usual read) must not, or a reader
    /// that tries both would land on the same child every time.
    fn pick(&self, children: &[Arc<MirrorChild>], tried: u64) -> Option<usize> {
        let candidates = || {
            children
                .iter()
                .enumerate()
                .filter(|(i, c)| tried & (1 << i) == 0 && c.is_online())
        };
        if self.pinned.load(Ordering::Acquire) {
            return candidates().map(|(i, _)| i).next();
        }
        // Ties (idle children) are broken in turn, so that one reader at a
        // time still spreads its reads over the copies.
        let turn = self.turn.load(Ordering::Relaxed) as usize;
        let count = children.len();
        let least_busy = |write_mostly: bool| {
            candidates()
                .filter(|(_, c)| c.write_mostly == write_mostly)
                .min_by_key(|(i, c)| (c.in_flight.load(Ordering::Relaxed), (i + count - turn % count) % count))
                .map(|(i, _)| i)
        };
        least_busy(false).or_else(|| least_busy(true))
    }

    /// A read went to the child [`Mirror::pick`] chose: the next tie goes
    /// to the next child.
    fn took_turn(&self) {
        self.turn.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads `buf.len()` bytes at `offset` from `child` alone, counting a
    /// failure on it.
    pub async fn read_child(&self, child: &MirrorChild, offset: u64, buf: IoBuf) -> (IoBuf, DeviceResult<()>) {
        let Some(device) = &child.device else {
            return (buf, Err(missing(child)));
        };
        child.in_flight.fetch_add(1, Ordering::Relaxed);
        let (buf, result) = device.read(offset, buf).await;
        child.in_flight.fetch_sub(1, Ordering::Relaxed);
        if result.is_err() {
            child.counters.read_errors.fetch_add(1, Ordering::Relaxed);
        }
        (buf, result)
    }

    /// Rewrites `[offset, +data.len())` of `child` alone with `data` (a
    /// repair: the copy failed a read or its checksum) and flushes that
    /// range, so that the repair is durable when it returns `Ok`. No pool
    /// flush would cover it otherwise (the pool flushes the data devices
    /// its own writes went to), and a power loss would bring the damage
    /// back unseen, leaving one good copy where the pool counts two. A
    /// child that fails the write or the flush is faulted.
    pub async fn write_child(&self, child: &MirrorChild, offset: u64, data: &[u8]) -> DeviceResult<()> {
        self.write_child_unflushed(child, offset, data).await?;
        let Some(device) = &child.device else {
            return Err(missing(child));
        };
        let result = device.flush_range(offset, data.len() as u64).await;
        if let Err(e) = &result {
            self.fault(child, e).await;
        }
        result
    }

    /// Writes `data` at `offset` to `child` alone, not flushed (a
    /// resilver's copy: the resilver flushes each child before it counts
    /// as up to date); a child that fails it is faulted.
    async fn write_child_unflushed(&self, child: &MirrorChild, offset: u64, data: &[u8]) -> DeviceResult<()> {
        let Some(device) = &child.device else {
            return Err(missing(child));
        };
        let length = data.len() as u64;
        self.note_recent(offset, length);
        let (_, result) = device.write(offset, IoBuf::copy_from(data)).await;
        self.note_recent(offset, length);
        if let Err(e) = &result {
            self.fault(child, e).await;
        }
        result
    }

    /// Marks `child` faulted after `error` and has the fault recorded. The
    /// last up-to-date child is never faulted: its errors are the pool's.
    async fn fault(&self, child: &MirrorChild, error: &DeviceError) {
        child.counters.write_errors.fetch_add(1, Ordering::Relaxed);
        match self.mark_faulted(child) {
            Faulting::Refused => return,
            // Faulted by a concurrent failure whose record may still be on
            // its way: this write waits for it too (both are no-ops once
            // done).
            Faulting::Already => {}
            Faulting::Faulted => tracing::error!(
                "{}: {error}; the device is faulted and {} goes on without it (DEGRADED)",
                child.name,
                self.info.name
            ),
        }
        // The units it may lack go into the record before its superblock
        // entry says the record is complete for it.
        if let Err(e) = self.persist_record(false).await {
            tracing::error!(
                "{}: cannot write its dirty record ({e}); {} will be resilvered in full",
                self.info.name,
                child.name
            );
            child.tracked.store(false, Ordering::Release);
        }
        // A device being resilvered loses its cursor too: it missed a write.
        if let Some(membership) = self.membership.get().and_then(std::sync::Weak::upgrade) {
            membership.record_health().await;
        }
    }

    /// Moves `child` to FAULTED (if it may be) and, when it was up to date
    /// or the record was already complete for it, starts the record for it
    /// with every unit it may not hold durably: those written since the
    /// last flush that covered them, and those in flight. Under the
    /// record's lock, so a write either is in that merge or sees the
    /// record tracking and waits for its bits.
    fn mark_faulted(&self, child: &MirrorChild) -> Faulting {
        let others_online = self
            .children()
            .iter()
            .any(|c| c.is_online() && !std::ptr::eq(&**c, child));
        if !others_online || child.detached() {
            return Faulting::Refused;
        }
        let mut state = self.dirty.lock().unwrap_or_else(|e| e.into_inner());
        let was = child.health();
        if !matches!(was, Health::Online | Health::Resilvering) || !child.change_health(was, Health::Faulted) {
            return Faulting::Already;
        }
        // A device being resilvered in full stays so: the record does not
        // know what it missed before it came back.
        let tracked = was == Health::Online || child.tracked();
        child.tracked.store(tracked, Ordering::Release);
        if tracked {
            state.start(self.words);
        }
        Faulting::Faulted
    }

    /// The units of the dirty record that `[offset, +length)` touches.
    fn units(&self, offset: u64, length: u64) -> std::ops::RangeInclusive<u64> {
        offset / self.unit_bytes..=(offset + length.max(1) - 1) / self.unit_bytes
    }

    fn dirty_state(&self) -> std::sync::MutexGuard<'_, DirtyState> {
        self.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes a write of `[offset, +length)` as recent (see
    /// `DirtyState::recent`): before it is issued, and again once done so
    /// that a flush that began meanwhile does not count it as covered.
    fn note_recent(&self, offset: u64, length: u64) {
        let units = self.units(offset, length);
        let mut state = self.dirty_state();
        for unit in units {
            state.recent.insert(unit);
        }
    }

    /// Before a write or discard of `[offset, +length)` is issued: its
    /// units are noted, and while the record tracks, made durable in it
    /// first (nothing to do when they already are).
    async fn before_write(&self, offset: u64, length: u64) -> DeviceResult<()> {
        let pending = self.dirty_state().note(self.units(offset, length), self.words);
        if pending {
            self.persist_record(false).await?;
        }
        Ok(())
    }

    /// Whether the dirty record tracks writes now.
    pub fn tracking(&self) -> bool {
        self.dirty_state().tracking
    }

    /// The record's unit and bits while it tracks (a resilver copies only
    /// the units set).
    pub(crate) fn dirty_units(&self) -> Option<(u64, Vec<u64>)> {
        let state = self.dirty_state();
        (state.tracking && state.marked.len() == self.words).then(|| (self.unit_bytes, state.marked.clone()))
    }

    /// For a child not up to date: at most how much its resilver copies,
    /// the units the dirty record marks, when the record is complete for
    /// it; `None` when it is to be resilvered in full.
    pub fn changed_bytes(&self, child: &MirrorChild) -> Option<u64> {
        if !child.tracked() {
            return None;
        }
        let (unit, bits) = self.dirty_units()?;
        Some(bits.iter().map(|w| u64::from(w.count_ones())).sum::<u64>() * unit)
    }

    /// Sets the record at open: `loaded` as read from the up-to-date
    /// children, tracking when a child it is complete for is behind.
    pub(crate) fn init_record(&self, loaded: Option<Vec<u64>>) {
        let tracking = self
            .children()
            .iter()
            .any(|c| c.tracked() && c.health() != Health::Online);
        let mut state = self.dirty_state();
        state.stop();
        if tracking {
            state.start(self.words);
            if let Some(bits) = loaded.filter(|b| b.len() == self.words) {
                state.marked = bits;
            }
        }
    }

    /// Stops the record once no child it is complete for is behind (all
    /// resilvered, or detached): it starts empty the next time one is.
    pub(crate) fn refresh_tracking(&self) {
        let children = self.children();
        let mut state = self.dirty_state();
        if state.tracking && !children.iter().any(|c| c.tracked() && c.health() != Health::Online) {
            state.stop();
        }
    }

    fn record_key(&self) -> Option<RecordKey> {
        let uuid = *self.pool_uuid.get()?;
        Some(RecordKey::new(uuid, self.member, self.info.size_bytes))
    }

    /// Reads the record from every up-to-date child present: the union of
    /// their copies, or `None` when one of them holds no valid copy (its
    /// bits could be the ones missing from the others').
    pub(crate) async fn load_record(&self) -> Option<Vec<u64>> {
        let key = self.record_key()?;
        let mut union = vec![0u64; self.words];
        let online = self.online();
        if online.is_empty() {
            return None;
        }
        for child in online {
            let mut found = false;
            for at in RECORD_OFFSETS {
                let (buf, result) = self.read_child(&child, at, IoBuf::new(key.encoded_bytes())).await;
                if result.is_err() {
                    continue;
                }
                match dirty::decode(&key, buf.payload()) {
                    Ok(bits) => {
                        found = true;
                        union.iter_mut().zip(&bits).for_each(|(u, b)| *u |= b);
                    }
                    Err(e) => tracing::warn!("{}: copy of the dirty record at {at}: {e}", child.name),
                }
            }
            if !found {
                return None;
            }
        }
        Some(union)
    }

    /// Writes the dirty record (both copies, each flushed) to every child
    /// that is written, when it has bits not yet durable there (`force`:
    /// in any case, while it tracks). A child that fails is faulted and
    /// the record written again to the others; fails only when the last
    /// up-to-date child cannot take it.
    pub(crate) async fn persist_record(&self, force: bool) -> DeviceResult<()> {
        let Some(key) = self.record_key() else {
            return Ok(());
        };
        let one_at_a_time = self.persisting.lock().await;
        let mut force = force;
        let mut faulted = false;
        loop {
            let snapshot = {
                let state = self.dirty_state();
                if !state.tracking || !(force || state.behind()) {
                    break;
                }
                state.marked.clone()
            };
            let bytes = dirty::encode(&key, &snapshot);
            let targets = self.written();
            let futures = targets
                .iter()
                .filter_map(|c| c.device.clone())
                .map(|device| -> BoxFuture<'_, DeviceResult<()>> {
                    let bytes = &bytes;
                    Box::pin(async move {
                        for at in RECORD_OFFSETS {
                            // Flushed one copy at a time: a crash tears one.
                            device.write(at, IoBuf::copy_from(bytes)).await.1?;
                            device.flush().await?;
                        }
                        Ok(())
                    })
                })
                .collect();
            let results = join_all(futures).await;
            let mut failed = Vec::new();
            for (child, result) in targets.iter().zip(results) {
                if let Err(e) = result {
                    failed.push((child.clone(), e));
                }
            }
            if failed.is_empty() {
                let mut state = self.dirty_state();
                if state.tracking {
                    state.durable.iter_mut().zip(&snapshot).for_each(|(d, s)| *d |= s);
                }
                break;
            }
            for (child, e) in failed {
                child.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    "{}: {e}; cannot write the dirty record of {}",
                    child.name,
                    self.info.name
                );
                match self.mark_faulted(&child) {
                    Faulting::Refused => return Err(e),
                    Faulting::Already => {}
                    Faulting::Faulted => faulted = true,
                }
            }
            force = true;
        }
        drop(one_at_a_time);
        if faulted {
            if let Some(membership) = self.membership.get().and_then(std::sync::Weak::upgrade) {
                membership.record_health().await;
            }
        }
        Ok(())
    }

    /// Runs `op` (a write or discard of `[offset, +length)`), holding the
    /// stripes of the units it touches while a resilver runs.
    async fn barred<'a, F, Fut>(&'a self, offset: u64, length: u64, op: F) -> DeviceResult<()>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = DeviceResult<()>> + 'a,
    {
        self.unbarred.fetch_add(1, Ordering::SeqCst);
        if !self.resyncing.load(Ordering::SeqCst) {
            let result = op().await;
            self.unbarred.fetch_sub(1, Ordering::SeqCst);
            return result;
        }
        self.unbarred.fetch_sub(1, Ordering::SeqCst);
        let first = offset / RESYNC_UNIT;
        let last = (offset + length.max(1) - 1) / RESYNC_UNIT;
        // Stripes in ascending order, each once: the copy holds one at a time.
        let mut wanted: Vec<usize> = (first..=last.min(first + STRIPES as u64 - 1))
            .map(|unit| (unit % STRIPES as u64) as usize)
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let mut guards = Vec::with_capacity(wanted.len());
        for stripe in wanted {
            guards.push(self.stripes[stripe].read().await);
        }
        op().await
    }

    /// Starts or ends a resilver's barrier ([`Mirror::copy_unit`]). Starting
    /// waits for the writes that began without it.
    pub async fn set_resyncing(&self, on: bool) {
        self.resyncing.store(on, Ordering::SeqCst);
        while on && self.unbarred.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Copies `[offset, +length)` (inside one [`RESYNC_UNIT`]) from an
    /// up-to-date child to each of `targets`, no write landing in between.
    /// A target that fails the write (it is faulted), or that was detached,
    /// is dropped from `targets`.
    pub async fn copy_unit(&self, offset: u64, length: u64, targets: &mut Vec<Arc<MirrorChild>>) -> DeviceResult<()> {
        debug_assert!(offset / RESYNC_UNIT == (offset + length - 1) / RESYNC_UNIT);
        let _unit = self.stripes[((offset / RESYNC_UNIT) % STRIPES as u64) as usize]
            .write()
            .await;
        targets.retain(|t| !t.detached() && t.health() == Health::Resilvering);
        if targets.is_empty() {
            return Ok(());
        }
        let (buf, result) = Device::read(self, offset, IoBuf::new(length as usize)).await;
        result?;
        let mut kept = Vec::with_capacity(targets.len());
        for target in targets.iter() {
            if self.write_child_unflushed(target, offset, buf.payload()).await.is_ok() {
                kept.push(target.clone());
            }
        }
        *targets = kept;
        Ok(())
    }

    /// Runs `op` on every child that gets writes, all at once; faults the
    /// ones that fail. `Ok` when at least one up-to-date child succeeded.
    async fn on_all<'a, F>(&'a self, op: F) -> DeviceResult<()>
    where
        F: Fn(Arc<dyn Device>) -> BoxFuture<'a, DeviceResult<()>>,
    {
        let targets: Vec<(Arc<MirrorChild>, Health)> = self
            .children()
            .iter()
            .filter(|c| c.is_written())
            .map(|c| (c.clone(), c.health()))
            .collect();
        let futures = targets
            .iter()
            .map(|(c, _)| op(c.device.clone().expect("present")))
            .collect();
        let results = join_all(futures).await;
        let mut first_error = None;
        let mut succeeded = false;
        for ((child, health), result) in targets.iter().zip(results) {
            match result {
                Ok(()) => succeeded |= *health == Health::Online,
                Err(e) => {
                    self.fault(child, &e).await;
                    first_error.get_or_insert(e);
                }
            }
        }
        match (succeeded, first_error) {
            (true, _) => Ok(()),
            (false, Some(e)) => Err(e),
            (false, None) => Err(unavailable(&self.info.name, "no device of the mirror is up to date")),
        }
    }
}

fn missing(child: &MirrorChild) -> DeviceError {
    unavailable(&child.name, "the device is not part of the running pool")
}

fn unavailable(name: &str, reason: &str) -> DeviceError {
    DeviceError::Io {
        device: name.to_string(),
        offset: 0,
        source: std::io::Error::new(std::io::ErrorKind::NotConnected, reason.to_string()),
    }
}

/// What a pool member is: one device, or a mirror, and a single device can
/// become a mirror while the pool runs (`pool attach`). The pool, its
/// metadata store and its log hold this as the member's one `Device`, so
/// they follow the change without knowing it.
///
/// A single device's reads go straight to it (one load to see it is not a
/// mirror); its writes, discards and preallocations also count themselves
/// in `writing` while they run, so that the switch to a mirror can wait for
/// those that began before it (a resilver must not copy a range that such a
/// write lands in afterwards). Once a mirror, always a mirror until the pool
/// is closed: a mirror left with one device by a detach stays a mirror of
/// one.
pub struct Vdev {
    /// The device while the member is a single device; `None` for a member
    /// opened as a mirror.
    single: Option<Arc<dyn Device>>,
    mirror: OnceLock<Arc<Mirror>>,
    /// Set (after `mirror`) when the member becomes a mirror; read with the
    /// same order as `writing` is counted, so a write either sees it or is
    /// waited for.
    mirrored: AtomicBool,
    /// Writes (and discards, preallocations) under way on `single`.
    writing: AtomicU32,
}

/// Counts one operation in [`Vdev::writing`] until dropped.
struct Writing<'a>(&'a AtomicU32);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Vdev {
    /// A single-device member.
    pub fn single(device: Arc<dyn Device>) -> Vdev {
        Vdev {
            single: Some(device),
            mirror: OnceLock::new(),
            mirrored: AtomicBool::new(false),
            writing: AtomicU32::new(0),
        }
    }

    /// A member that is a mirror.
    pub fn mirrored(mirror: Arc<Mirror>) -> Vdev {
        let vdev = Vdev {
            single: None,
            mirror: OnceLock::new(),
            mirrored: AtomicBool::new(true),
            writing: AtomicU32::new(0),
        };
        let _ = vdev.mirror.set(mirror);
        vdev
    }

    /// The mirror, once the member is one.
    pub fn mirror(&self) -> Option<&Arc<Mirror>> {
        self.mirror.get()
    }

    /// The device of a member that is (still) a single device.
    pub fn single_device(&self) -> Option<&Arc<dyn Device>> {
        match self.mirror.get() {
            Some(_) => None,
            None => self.single.as_ref(),
        }
    }

    /// Makes the single-device member a mirror of `mirror` (whose children
    /// include the device), then waits for the writes that went to the
    /// device alone before the switch. The caller holds the membership lock.
    pub(crate) async fn become_mirror(&self, mirror: Arc<Mirror>) -> Result<(), String> {
        if self.mirror.set(mirror).is_err() {
            return Err("the member is already a mirror".into());
        }
        self.mirrored.store(true, Ordering::SeqCst);
        while self.writing.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// The single device for an operation that changes its contents, counted
    /// until the guard is dropped; `None` when the member is a mirror.
    fn enter_single(&self) -> Option<(&Arc<dyn Device>, Writing<'_>)> {
        self.writing.fetch_add(1, Ordering::SeqCst);
        let guard = Writing(&self.writing);
        if self.mirrored.load(Ordering::SeqCst) {
            return None;
        }
        self.single.as_ref().map(|device| (device, guard))
    }

    fn current(&self) -> &dyn Device {
        match (self.mirror.get(), &self.single) {
            (Some(mirror), _) => &**mirror,
            (None, Some(single)) => &**single,
            (None, None) => unreachable!("a member is a device or a mirror"),
        }
    }
}

impl Device for Vdev {
    fn info(&self) -> &DeviceInfo {
        self.current().info()
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        self.current().read(offset, buf)
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        if let Some(mirror) = self.mirror.get() {
            return mirror.write(offset, buf);
        }
        Box::pin(async move {
            match self.enter_single() {
                Some((device, _writing)) => device.write(offset, buf).await,
                None => self.current().write(offset, buf).await,
            }
        })
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        self.current().flush()
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        self.current().flush_range(offset, length)
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        if let Some(mirror) = self.mirror.get() {
            return mirror.discard(offset, length);
        }
        Box::pin(async move {
            match self.enter_single() {
                Some((device, _writing)) => device.discard(offset, length).await,
                None => self.current().discard(offset, length).await,
            }
        })
    }

    fn write_now(&self, offset: u64, data: &[u8]) -> Option<DeviceResult<()>> {
        if let Some(mirror) = self.mirror.get() {
            return mirror.write_now(offset, data);
        }
        match self.enter_single() {
            Some((device, _writing)) => device.write_now(offset, data),
            None => self.current().write_now(offset, data),
        }
    }

    fn read_now(&self, offset: u64, dst: &mut [u8]) -> Option<DeviceResult<()>> {
        self.current().read_now(offset, dst)
    }

    fn read_now_summed(&self, offset: u64, dst: &mut [u8], sums: &mut [u32]) -> bool {
        self.current().read_now_summed(offset, dst, sums)
    }

    fn backing_space(&self) -> Option<BackingSpace> {
        self.current().backing_space()
    }

    fn preallocate(&self, offset: u64, length: u64) -> DeviceResult<()> {
        if let Some(mirror) = self.mirror.get() {
            return mirror.preallocate(offset, length);
        }
        match self.enter_single() {
            Some((device, _writing)) => device.preallocate(offset, length),
            None => self.current().preallocate(offset, length),
        }
    }
}

/// The pool's membership as its superblocks record it, kept in memory so
/// that a change (a mirror child faulted, a device added, attached or
/// detached) is written to every device under one lock, each with the next
/// generation.
pub struct Membership {
    /// The pool's, which mirrors' dirty records name.
    pool_uuid: [u8; 16],
    current: tokio::sync::Mutex<Superblock>,
    /// Every member, by member index.
    members: std::sync::RwLock<Vec<Option<Arc<Vdev>>>>,
}

impl Membership {
    pub fn new(current: Superblock) -> Membership {
        Membership {
            pool_uuid: current.pool_uuid,
            current: tokio::sync::Mutex::new(current),
            members: Default::default(),
        }
    }

    /// Adds member `index`.
    pub fn add_member(&self, index: u8, vdev: &Arc<Vdev>) {
        let index = index as usize;
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        if members.len() <= index {
            members.resize(index + 1, None);
        }
        members[index] = Some(vdev.clone());
    }

    /// Forgets member `index` (removed): no superblock is written to its
    /// devices any more.
    pub fn remove_member(&self, index: u8) {
        let index = index as usize;
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = members.get_mut(index) {
            *slot = None;
        }
    }

    /// The superblock as last written (or read at open).
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, Superblock> {
        self.current.lock().await
    }

    /// Every physical device that takes superblock writes now, with its
    /// member index and own uuid: single devices, and the mirror children
    /// `superblock` lists that are written to (up to date, or being
    /// resilvered).
    pub fn writable_devices(&self, superblock: &Superblock) -> Vec<(Arc<dyn Device>, u8, [u8; 16])> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for member in &superblock.members {
            let Some(Some(vdev)) = members.get(member.index as usize) else {
                continue;
            };
            match vdev.mirror() {
                None => {
                    if let Some(device) = vdev.single_device() {
                        out.push((device.clone(), member.index, member.uuid));
                    }
                }
                Some(mirror) => {
                    let listed = |uuid: &[u8; 16]| superblock.children_of(member.index).any(|c| &c.uuid == uuid);
                    for child in mirror.children().iter().filter(|c| c.is_written() && listed(&c.uuid)) {
                        if let Some(device) = &child.device {
                            out.push((device.clone(), member.index, child.uuid));
                        }
                    }
                }
            }
        }
        out
    }

    /// Copies the children's health into `superblock` (up to date or not).
    pub fn note_health(&self, superblock: &mut Superblock) {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        for entry in &mut superblock.children {
            let Some(Some(mirror)) = members
                .get(entry.member as usize)
                .map(|m| m.as_ref().and_then(|v| v.mirror()))
            else {
                continue;
            };
            if let Some(child) = mirror.children().iter().find(|c| c.uuid == entry.uuid) {
                (entry.state, entry.resilvered) = match child.health() {
                    Health::Online => (ChildState::Online, 0),
                    // Up to date below its resilver's cursor.
                    Health::Resilvering => (ChildState::Stale, child.resilvered.load(Ordering::Acquire)),
                    Health::Stale | Health::Faulted | Health::Missing => (ChildState::Stale, 0),
                };
                entry.tracked = entry.state == ChildState::Stale && child.tracked();
            }
        }
    }

    /// Writes `next` (the next generation) to every device it names that
    /// takes writes, and makes it the current one; the caller holds the
    /// lock (`current`). A device that fails is logged: it is failing, and
    /// its next write faults it (the newest generation is on the others).
    pub async fn write_all(&self, current: &mut Superblock, next: Superblock) {
        for (device, index, uuid) in self.writable_devices(&next) {
            if let Err(e) = super::write_superblock(&device, &next.for_device(index, uuid)).await {
                tracing::error!(
                    "{}: cannot record the pool's membership in its superblock: {e}",
                    device.info().name
                );
            }
        }
        *current = next;
    }

    /// Writes the children's health to every writable device, as the next
    /// generation. Failures are logged: a device that cannot take its
    /// superblock is failing, and the next write there faults it.
    pub async fn record_health(&self) {
        let mut current = self.lock().await;
        let mut next = current.clone();
        self.note_health(&mut next);
        if next.children == current.children {
            return;
        }
        next.generation += 1;
        self.write_all(&mut current, next).await;
    }
}

/// Polls every future to completion, all at once; results in order.
pub(crate) async fn join_all<T>(futures: Vec<BoxFuture<'_, T>>) -> Vec<T> {
    let mut futures: Vec<Option<BoxFuture<'_, T>>> = futures.into_iter().map(Some).collect();
    let mut results: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, result) in futures.iter_mut().zip(results.iter_mut()) {
            if let Some(f) = future {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => {
                        *result = Some(value);
                        *future = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    results
        .into_iter()
        .map(|r| r.expect("every future completed"))
        .collect()
}

impl Device for Mirror {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn read(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            let children = self.children();
            let mut tried = 0u64;
            let mut failed: Vec<usize> = Vec::new();
            let mut buf = buf;
            let mut last_error = None;
            while let Some(index) = self.pick(&children, tried) {
                tried |= 1 << index;
                self.took_turn();
                let (back, result) = self.read_child(&children[index], offset, buf).await;
                buf = back;
                match result {
                    Ok(()) => {
                        // Rewrite what failed to read from the copy that did.
                        for bad in failed {
                            let child = &children[bad];
                            if self.write_child(child, offset, buf.payload()).await.is_ok() {
                                let sectors = (buf.len() as u64).div_ceil(4096);
                                child.counters.repaired.fetch_add(sectors, Ordering::Relaxed);
                            }
                        }
                        return (buf, Ok(()));
                    }
                    Err(e) => {
                        tracing::warn!("{}: {e}; reading from another copy", children[index].name);
                        failed.push(index);
                        last_error = Some(e);
                    }
                }
            }
            let error =
                last_error.unwrap_or_else(|| unavailable(&self.info.name, "no device of the mirror is up to date"));
            (buf, Err(error))
        })
    }

    fn write(&self, offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move {
            let length = buf.len() as u64;
            if let Err(e) = self.before_write(offset, length).await {
                return (buf, Err(e));
            }
            let result = self
                .barred(offset, length, || {
                    self.on_all(|device| {
                        let copy = IoBuf::copy_from(buf.payload());
                        Box::pin(async move { device.write(offset, copy).await.1 })
                    })
                })
                .await;
            self.note_recent(offset, length);
            (buf, result)
        })
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move {
            // What was written before this flush is durable on each child
            // it succeeds on; a child it fails on is faulted with them.
            let flush = self.dirty_state().begin_flush();
            let result = self
                .on_all(|device| Box::pin(async move { device.flush().await }))
                .await;
            self.dirty_state().end_flush(flush);
            result
        })
    }

    fn flush_range(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(self.on_all(move |device| Box::pin(async move { device.flush_range(offset, length).await })))
    }

    fn discard(&self, offset: u64, length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        // A discard changes nothing a read may rely on (the range reads as
        // zeros or as before), so a child that refuses one is not faulted.
        Box::pin(async move {
            self.before_write(offset, length).await?;
            let result = self
                .barred(offset, length, move || async move {
                    let written = self.written();
                    let futures = written
                        .iter()
                        .filter_map(|c| c.device.as_ref())
                        .map(|d| d.discard(offset, length))
                        .collect();
                    let results = join_all(futures).await;
                    match results.iter().find_map(|r| r.as_ref().err()) {
                        Some(e) if results.iter().all(|r| r.is_err()) => {
                            Err(unavailable(&self.info.name, &e.to_string()))
                        }
                        _ => Ok(()),
                    }
                })
                .await;
            self.note_recent(offset, length);
            result
        })
    }

    /// Every child written at once from the caller's memory, when each of
    /// them can and none fails; else `None`, and the caller's `write` of
    /// the same bytes writes every child again (harmless for those already
    /// written) and deals with a failure, which may mean faulting a child:
    /// that waits for its superblocks, so it is not done here. Not while a
    /// resilver runs: its barrier is taken by `write`.
    fn write_now(&self, offset: u64, data: &[u8]) -> Option<DeviceResult<()>> {
        let length = data.len() as u64;
        {
            // A unit whose bit is not durable yet waits for it: not here.
            let units = self.units(offset, length);
            let mut state = self.dirty_state();
            if !state.covered(units.clone()) {
                return None;
            }
            state.note(units, self.words);
        }
        self.unbarred.fetch_add(1, Ordering::SeqCst);
        let children = self.children();
        let done = !self.resyncing.load(Ordering::SeqCst)
            && children.iter().any(|c| c.is_online())
            && children
                .iter()
                .filter(|c| c.is_written())
                .filter_map(|c| c.device.as_ref())
                .all(|device| matches!(device.write_now(offset, data), Some(Ok(()))));
        self.unbarred.fetch_sub(1, Ordering::SeqCst);
        self.note_recent(offset, length);
        done.then_some(Ok(()))
    }

    fn read_now(&self, offset: u64, dst: &mut [u8]) -> Option<DeviceResult<()>> {
        let children = self.children();
        let index = self.pick(&children, 0)?;
        let device = children[index].device.as_ref()?;
        match device.read_now(offset, dst)? {
            Ok(()) => {
                self.took_turn();
                Some(Ok(()))
            }
            // The usual read retries on another child.
            Err(_) => None,
        }
    }

    fn read_now_summed(&self, offset: u64, dst: &mut [u8], sums: &mut [u32]) -> bool {
        let children = self.children();
        let Some(index) = self.pick(&children, 0) else {
            return false;
        };
        let done = children[index]
            .device
            .as_ref()
            .is_some_and(|device| device.read_now_summed(offset, dst, sums));
        if done {
            self.took_turn();
        }
        done
    }

    fn backing_space(&self) -> Option<BackingSpace> {
        None
    }

    fn preallocate(&self, offset: u64, length: u64) -> DeviceResult<()> {
        for child in self.written() {
            if let Some(device) = &child.device {
                device.preallocate(offset, length)?;
            }
        }
        Ok(())
    }
}
