//! Automatic tiering: heat per chunk, and the migrator that moves cold
//! chunks from the fast tier to the capacity tier (and hot ones back up).
//!
//! Heat: every device read and write that a request resolves to a slot
//! adds to its chunk's counters (reads and writes apart), which halve every
//! [`HEAT_HALF_LIFE`]: a decayed access frequency, so recent use weighs
//! more than old. Bounded memory: 8 bytes per data chunk of every device
//! (8 MiB per TiB at the default 1 MiB chunk), beside the chunk's epoch.
//!
//! A pass (every [`PASS_INTERVAL`] while `migration=on`, or at once with
//! `pool migrate`): when the fast tier is fuller than the high watermark,
//! the coldest fast chunks move down until it is at the low watermark.
//! Otherwise capacity chunks that clients use move up, hottest first,
//! while the fast tier stays under the high watermark, and past it a
//! capacity chunk more than twice as hot as the coldest fast chunk trades
//! places with it (at most [`SWAP_MAX_BYTES`] down per pass). Volumes
//! pinned with `tier=fast|capacity` move where they belong first.
//!
//! A move takes a chunk's blocks of one volume, and is what a write to a
//! block that must go to a new slot already is
//! (`EngineVolume::move_blocks`): under the blocks' exclusive stripe
//! locks, read them and verify their checksums, write them to new slots on
//! the target tier, log a `Map` record per block (new slot, old slot,
//! checksums). The commit that makes the records durable flushes the data
//! first; the old slots are freed only after it (the rules every
//! relocation follows: docs/FORMAT.md, "Ordering rules"). A crash at any
//! step leaves a block where it was or where it went, never lost and never
//! leaked. A block snapshots or clones share moves once for all of them,
//! with one `Relocate` record (`pool/relocate.rs`).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::superblock::Role;
use super::volume::{EngineVolume, Moved};
use super::{BlockPtr, Pool, PoolError, MAP_ENTRIES_PER_PAGE};
use crate::block::BlockDevice;
use crate::meta::MetaError;

/// How often the background migrator looks at the tiers.
pub const PASS_INTERVAL: Duration = Duration::from_secs(10);
/// Heat halves this often.
pub const HEAT_HALF_LIFE: Duration = Duration::from_secs(60);
/// The chunks' heat is stored with a checkpoint this often (and at a clean
/// stop): a restart forgets at most this much of what was hot.
pub const HEAT_SAVE_INTERVAL: Duration = Duration::from_secs(300);

/// Pool properties that steer migration (`strata pool set`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct MigrationSettings {
    /// `migration=on|off`: background passes run (a pass under way stops
    /// at the next block when turned off).
    pub enabled: bool,
    /// `migration.high`: percent of the fast tier in use above which cold
    /// chunks move down.
    pub high_percent: u8,
    /// `migration.low`: where demotion stops, and the most promotion fills.
    pub low_percent: u8,
    /// `migration.window=HH:MM-HH:MM` (UTC): background passes run only
    /// then (a window may wrap past midnight); `None` = any time.
    /// Minutes since midnight, start and end.
    pub window: Option<(u16, u16)>,
}

impl Default for MigrationSettings {
    fn default() -> Self {
        MigrationSettings {
            enabled: true,
            high_percent: 85,
            low_percent: 70,
            window: None,
        }
    }
}

impl MigrationSettings {
    /// Refuses settings that cannot work, with the reason.
    pub fn validate(&self) -> Result<(), String> {
        if self.high_percent > 100 || self.high_percent == 0 {
            return Err(format!(
                "migration.high must be 1..100 (percent), not {}",
                self.high_percent
            ));
        }
        if self.low_percent >= self.high_percent {
            return Err(format!(
                "migration.low ({}) must be below migration.high ({})",
                self.low_percent, self.high_percent
            ));
        }
        if let Some((start, end)) = self.window {
            if start >= 24 * 60 || end >= 24 * 60 || start == end {
                return Err("migration.window must be HH:MM-HH:MM with two different times".into());
            }
        }
        Ok(())
    }

    /// Whether a background pass may run at `minute` (of the day, UTC).
    pub fn in_window(&self, minute: u16) -> bool {
        match self.window {
            None => true,
            Some((start, end)) if start < end => (start..end).contains(&minute),
            Some((start, end)) => minute >= start || minute < end,
        }
    }
}

/// Where a volume's blocks belong (`tier=auto|fast|capacity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TierPin {
    /// Moved by heat.
    #[default]
    Auto,
    /// Kept on the fast tier (moved up in the background), space allowing.
    Fast,
    /// Kept on the capacity tier.
    Capacity,
}

/// One pass's result (`pool migrate`, and the daemon's log line).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct PassSummary {
    pub moved_down_bytes: u64,
    pub moved_up_bytes: u64,
    pub chunks_down: u64,
    pub chunks_up: u64,
    /// Blocks left where they are: shared with a snapshot or clone, or
    /// changed while the pass looked at them.
    pub skipped_blocks: u64,
    /// Moves abandoned on a read, verify or write error (the data stays
    /// where it was).
    pub errors: u64,
    pub seconds: f64,
    /// Why the pass did nothing, when it did nothing.
    #[serde(default)]
    pub idle_reason: Option<String>,
}

/// What `pool status` shows of migration.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct MigrationStatus {
    pub settings: Option<MigrationSettings>,
    /// A pass is under way.
    pub running: bool,
    /// The pass under way is yielding to client I/O.
    pub throttled: bool,
    /// Chunks the pass under way still has to move, each way.
    pub queued_down_chunks: u64,
    pub queued_up_chunks: u64,
    /// Since the daemon started.
    pub moved_down_bytes: u64,
    pub moved_up_bytes: u64,
    pub passes: u64,
    pub errors: u64,
    /// The pass under way: bytes it has moved and means to move, and its
    /// rate so far.
    pub pass_done_bytes: u64,
    pub pass_total_bytes: u64,
    pub rate_bytes_per_sec: u64,
    pub last_pass: Option<PassSummary>,
}

/// The migrator's state in the pool.
#[derive(Default)]
pub(crate) struct Migrator {
    settings: std::sync::Mutex<MigrationSettings>,
    pins: std::sync::Mutex<std::collections::HashMap<u32, TierPin>>,
    /// One pass at a time.
    pass: tokio::sync::Mutex<()>,
    /// Grows with client I/O (sampled: see `Heat::add`).
    foreground: AtomicU64,
    /// The next checkpoint stores every chunk's heat (set every
    /// [`HEAT_SAVE_INTERVAL`], and before the daemon's last checkpoint).
    heat_due: AtomicBool,
    running: AtomicBool,
    throttled: AtomicBool,
    queued_down: AtomicU64,
    queued_up: AtomicU64,
    moved_down: AtomicU64,
    moved_up: AtomicU64,
    passes: AtomicU64,
    errors: AtomicU64,
    pass_done: AtomicU64,
    pass_total: AtomicU64,
    rate: AtomicU64,
    last_pass: std::sync::Mutex<Option<PassSummary>>,
}

impl Pool {
    pub fn migration_settings(&self) -> MigrationSettings {
        *self.migrator.settings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies pool properties (validated first). `enabled = false` stops a
    /// pass under way at its next block.
    pub fn set_migration_settings(&self, settings: MigrationSettings) -> Result<(), PoolError> {
        settings.validate().map_err(PoolError::Invalid)?;
        *self.migrator.settings.lock().unwrap_or_else(|e| e.into_inner()) = settings;
        Ok(())
    }

    /// Pins volume `id` to a tier (or back to `Auto`); the next pass moves
    /// it.
    pub fn set_tier_pin(&self, id: u32, pin: TierPin) {
        let mut pins = self.migrator.pins.lock().unwrap_or_else(|e| e.into_inner());
        if pin == TierPin::Auto {
            pins.remove(&id);
        } else {
            pins.insert(id, pin);
        }
    }

    pub fn tier_pin(&self, id: u32) -> TierPin {
        let pins = self.migrator.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.get(&id).copied().unwrap_or_default()
    }

    pub fn migration_status(&self) -> MigrationStatus {
        let m = &self.migrator;
        MigrationStatus {
            settings: Some(self.migration_settings()),
            running: m.running.load(Ordering::Relaxed),
            throttled: m.throttled.load(Ordering::Relaxed),
            queued_down_chunks: m.queued_down.load(Ordering::Relaxed),
            queued_up_chunks: m.queued_up.load(Ordering::Relaxed),
            moved_down_bytes: m.moved_down.load(Ordering::Relaxed),
            moved_up_bytes: m.moved_up.load(Ordering::Relaxed),
            passes: m.passes.load(Ordering::Relaxed),
            errors: m.errors.load(Ordering::Relaxed),
            pass_done_bytes: m.pass_done.load(Ordering::Relaxed),
            pass_total_bytes: m.pass_total.load(Ordering::Relaxed),
            rate_bytes_per_sec: m.rate.load(Ordering::Relaxed),
            last_pass: m.last_pass.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }

    /// Bytes of volume `id`'s mapped blocks on each tier (a walk of its
    /// map: for `volume get`). Blocks it sees through a clone's origin
    /// count too.
    pub fn volume_tier_bytes(&self, id: u32) -> Result<Vec<(Role, u64)>, PoolError> {
        let Some(engine) = self.engines().into_iter().find(|e| e.id() == id) else {
            return Err(PoolError::Invalid(format!("volume {id} is not open")));
        };
        let block_bytes = engine.block_bytes();
        let blocks = engine.size_bytes().div_ceil(block_bytes);
        let mut fast = 0;
        let mut capacity = 0;
        for index in self.view_page_indexes(id, blocks)? {
            let first = index * MAP_ENTRIES_PER_PAGE;
            let last = (first + MAP_ENTRIES_PER_PAGE - 1).min(blocks - 1);
            for entry in self.lookup_range(id, first, last)? {
                if let Some((device, _)) = entry.place() {
                    match self.devices.get(device as usize).map(|d| d.member.role) {
                        Some(Role::Capacity) => capacity += block_bytes,
                        Some(_) => fast += block_bytes,
                        None => {}
                    }
                }
            }
        }
        Ok(vec![(Role::Fast, fast), (Role::Capacity, capacity)])
    }

    /// Runs one pass now (whatever `migration` says: an admin asked), or
    /// waits for the one under way and runs another after it.
    pub async fn migrate_now(self: &Arc<Self>) -> Result<PassSummary, PoolError> {
        self.migrate_pass(true).await
    }

    /// Makes the next checkpoint store the chunks' heat (the daemon asks
    /// before its last one, so a restart finds what was hot).
    pub fn save_heat_at_next_checkpoint(&self) {
        self.migrator.heat_due.store(true, Ordering::Relaxed);
    }

    /// Every warm chunk's counts, if the checkpoint is to store them.
    pub(crate) fn heat_to_save(&self) -> Option<Vec<((u32, u64), u64)>> {
        if !self.migrator.heat_due.swap(false, Ordering::Relaxed) {
            return None;
        }
        let mut rows = Vec::new();
        for device in self.devices.iter().filter(|d| !d.is_removed()) {
            let index = device.member.index as u32;
            rows.extend(device.heat.warm().map(|(chunk, counts)| ((index, chunk), counts)));
        }
        Some(rows)
    }

    /// Counts an access to the chunk holding `offset` of `device`.
    pub(crate) fn note_heat(&self, device: u8, offset: u64, write: bool, count: u64) {
        if let Some(d) = self.devices.get(device as usize) {
            let chunk = offset / self.chunk_bytes as u64;
            if d.heat.add(chunk, write, count) {
                self.migrator.foreground.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether a move of `block` of `volume` changes no one else's view:
    /// its map page is the volume's own (not a clone's view of its
    /// origin) and would not be copied into a snapshot by a change now.
    pub(crate) fn block_is_own(&self, volume: u32, block: u64) -> Result<bool, MetaError> {
        if !self.has_snapshots() {
            return Ok(true);
        }
        if self.page_will_be_copied(volume, block, None)? {
            return Ok(false);
        }
        Ok(self.map_page(volume, block)?.present.load(Ordering::Acquire))
    }

    /// Used and data bytes of the devices of each tier: (fast used, fast
    /// size, capacity used, capacity size).
    fn tier_space(&self) -> TierSpace {
        let mut space = TierSpace::default();
        for device in self.status() {
            match device.role {
                Role::Fast => {
                    space.fast_used += device.used_bytes;
                    space.fast_size += device.data_bytes;
                }
                Role::Capacity => {
                    space.capacity_used += device.used_bytes;
                    space.capacity_size += device.data_bytes;
                }
                Role::Log => {}
            }
        }
        space
    }

    /// Halves every chunk's heat (every [`HEAT_HALF_LIFE`]).
    fn decay_heat(&self) {
        for device in self.devices.iter() {
            device.heat.decay();
        }
    }

    /// One pass: plans the moves (coldest fast chunks down past the high
    /// watermark, hottest capacity chunks up below the low one, pinned
    /// volumes to their tier) and makes them, yielding to client I/O.
    async fn migrate_pass(self: &Arc<Self>, explicit: bool) -> Result<PassSummary, PoolError> {
        let m = &self.migrator;
        let _one = m.pass.lock().await;
        let started = Instant::now();
        let settings = self.migration_settings();
        let mut summary = PassSummary::default();
        let space = self.tier_space();
        if space.fast_size == 0 || space.capacity_size == 0 {
            summary.idle_reason = Some("the pool has one tier: nothing to move".into());
            return Ok(self.finish_pass(summary, started));
        }
        let mut stats = PlanStats::default();
        let plan = self.plan_pass(&settings, &space, PlanLimits::of(self.chunk_bytes), &mut stats)?;
        tracing::debug!("pool {}: migration plan: {stats:?}", self.name());
        if plan.is_empty() {
            summary.idle_reason = Some("every chunk is on the tier it belongs to".into());
            return Ok(self.finish_pass(summary, started));
        }
        m.running.store(true, Ordering::Relaxed);
        let down_chunks = plan.iter().filter(|c| c.to == Role::Capacity).count() as u64;
        m.queued_down.store(down_chunks, Ordering::Relaxed);
        m.queued_up.store(plan.len() as u64 - down_chunks, Ordering::Relaxed);
        m.pass_done.store(0, Ordering::Relaxed);
        m.pass_total
            .store(plan.iter().map(|c| c.bytes).sum(), Ordering::Relaxed);
        let result = self.run_plan(plan, explicit, &mut summary, started).await;
        m.running.store(false, Ordering::Relaxed);
        m.throttled.store(false, Ordering::Relaxed);
        m.queued_down.store(0, Ordering::Relaxed);
        m.queued_up.store(0, Ordering::Relaxed);
        // The old slots are freed by the commit of the records that moved
        // their blocks.
        self.commit_quiet().await?;
        result?;
        Ok(self.finish_pass(summary, started))
    }

    fn finish_pass(&self, mut summary: PassSummary, started: Instant) -> PassSummary {
        let m = &self.migrator;
        summary.seconds = started.elapsed().as_secs_f64();
        m.passes.fetch_add(1, Ordering::Relaxed);
        m.errors.fetch_add(summary.errors, Ordering::Relaxed);
        if summary.moved_down_bytes + summary.moved_up_bytes + summary.errors > 0 {
            tracing::info!(
                "pool {}: migration moved {} down ({} chunks) and {} up ({} chunks) in {:.1} s; {} blocks skipped, {} errors",
                self.name(),
                crate::units::format_size(summary.moved_down_bytes),
                summary.chunks_down,
                crate::units::format_size(summary.moved_up_bytes),
                summary.chunks_up,
                summary.seconds,
                summary.skipped_blocks,
                summary.errors
            );
        }
        *m.last_pass.lock().unwrap_or_else(|e| e.into_inner()) = Some(summary.clone());
        summary
    }

    /// The chunks to move this pass, in order: pinned volumes' first, then
    /// demotion (coldest first) or promotion (hottest first).
    ///
    /// Bounded by `limits`, however large the pool: the candidates by heat
    /// are chosen first from the allocator's list of used chunks (read a
    /// short range per hold of its lock), at most `limits.chunks` each way;
    /// the walk of the maps then keeps owners only for blocks in those
    /// chunks, and for at most `limits.chunks` chunks of pinned volumes on
    /// the wrong tier. What a pass leaves, the next one takes.
    fn plan_pass(
        &self,
        settings: &MigrationSettings,
        space: &TierSpace,
        limits: PlanLimits,
        stats: &mut PlanStats,
    ) -> Result<Vec<ChunkMove>, PoolError> {
        let chunk_bytes = self.chunk_bytes as u64;
        let candidates = self.heat_candidates(limits, stats);
        // The walk below reads every open volume's map: only when a move
        // may come of it (a pin, a full fast tier, or a capacity chunk
        // hot enough to move up into room or in place of a much colder
        // fast chunk), not every 10 s of a pool at rest.
        let pins = self.migrator.pins.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let pinned_any = pins.values().any(|pin| *pin != TierPin::Auto);
        let full = space.fast_used > space.fast_size * settings.high_percent as u64 / 100;
        let hottest_capacity = candidates.hot.first().map_or(0, |c| c.heat);
        let coldest_fast = candidates.cold.first().map(|c| c.heat);
        let room_up = space.fast_used + chunk_bytes <= space.fast_size * settings.high_percent as u64 / 100;
        let swap_floor = candidates.swap_floor;
        let promote = hottest_capacity >= PROMOTE_MIN_HEAT
            && (room_up || coldest_fast.is_some_and(|cold| worth_swapping(hottest_capacity, cold, swap_floor)));
        if !pinned_any && !full && !promote {
            return Ok(Vec::new());
        }
        // Who maps the candidates' blocks: the open volumes, and their
        // snapshots where the volume no longer does. A slot snapshots or
        // clones share is listed once, under the first volume found to map
        // it, and moves once for all (`EngineVolume::move_blocks`). Blocks
        // of other chunks are passed over, so what this holds is bounded
        // by the candidates, not by what the pool maps.
        let mut owners: HashMap<(u8, u64), Vec<Owner>> = candidates
            .cold
            .iter()
            .chain(&candidates.hot)
            .map(|c| ((c.device, c.chunk), Vec::new()))
            .collect();
        let mut seen: HashSet<BlockPtr> = HashSet::new();
        // Chunks holding a pinned volume's blocks: never moved by heat;
        // those on the wrong tier (at most `limits.chunks`) move first.
        let mut pinned: BTreeMap<(u8, u64), Role> = BTreeMap::new();
        let mut pinned_away = 0;
        let role_of = |device: u8| self.devices.get(device as usize).map(|d| d.member.role);
        for engine in self.engines() {
            if engine.is_snapshot() {
                continue;
            }
            let id = engine.id();
            let pin = match pins.get(&id).copied().unwrap_or_default() {
                TierPin::Fast => Some(Role::Fast),
                TierPin::Capacity => Some(Role::Capacity),
                TierPin::Auto => None,
            };
            let mut note = |block: u64, entry: BlockPtr, owners: &mut HashMap<(u8, u64), Vec<Owner>>| {
                let Some((device, offset)) = entry.place() else {
                    return;
                };
                let key = (device, offset / chunk_bytes);
                let candidate = owners.contains_key(&key);
                // A pinned volume's block on the wrong tier makes its
                // chunk one to move, while there is room in the pass.
                let away = pin.is_some_and(|to| role_of(device) != Some(to)) && pinned_away < limits.chunks;
                if !candidate && !away {
                    return;
                }
                if !seen.insert(entry.slot()) {
                    return;
                }
                if let Some(to) = pin {
                    if !candidate {
                        pinned_away += 1;
                    }
                    pinned.insert(key, to);
                }
                owners.entry(key).or_default().push(Owner {
                    engine: engine.clone(),
                    block,
                    entry: entry.slot(),
                });
            };
            // Page indexes a window at a time, so the list of them is
            // bounded too.
            let blocks = engine.size_bytes().div_ceil(engine.block_bytes());
            let mut from = Some(0);
            while let Some(start) = from {
                let (indexes, next) = self.view_page_indexes_from(id, blocks, start, PAGE_WINDOW)?;
                for index in indexes {
                    let first = index * MAP_ENTRIES_PER_PAGE;
                    let last = (first + MAP_ENTRIES_PER_PAGE - 1).min(blocks - 1);
                    for (block, entry) in (first..).zip(self.lookup_range(id, first, last)?) {
                        note(block, entry, &mut owners);
                    }
                }
                from = next;
            }
            let snapshots: Vec<u32> = self.snapshots_of(id).iter().map(|s| s.id).collect();
            for snapshot in snapshots {
                let mut from = Some(0);
                while let Some(start) = from {
                    let (indexes, next) = self.own_pages_from(snapshot, start, PAGE_WINDOW)?;
                    for index in indexes {
                        let page = self.map_pages.get(&self.db, (snapshot, index))?;
                        for (within, entry) in page.ptrs().into_iter().enumerate() {
                            note(index * MAP_ENTRIES_PER_PAGE + within as u64, entry, &mut owners);
                        }
                    }
                    from = next;
                }
            }
        }
        // A candidate no open volume maps (its slots wait to be freed, or
        // belong to a volume not open) has nothing to move.
        owners.retain(|_, blocks| !blocks.is_empty());
        stats.owners = owners.values().map(Vec::len).sum::<usize>() + seen.len();
        drop(seen);
        let mut plan = Vec::new();
        let mut fast_used = space.fast_used;
        let fast_room = |percent: u8| space.fast_size * percent as u64 / 100;
        // Pinned volumes first: down always, up while the fast tier stays
        // under its high watermark.
        for (&key, &to) in &pinned {
            if role_of(key.0) == Some(to) {
                continue;
            }
            let Some(chunk) = ChunkMove::take(&mut owners, key, to) else {
                continue;
            };
            let bytes = chunk.bytes;
            if to == Role::Fast {
                if fast_used + bytes > fast_room(settings.high_percent) {
                    continue;
                }
                fast_used += bytes;
            } else {
                fast_used = fast_used.saturating_sub(bytes);
            }
            plan.push(chunk);
        }
        let movable = |info: &ChunkInfo, owners: &HashMap<(u8, u64), Vec<Owner>>| {
            let key = (info.device, info.chunk);
            !pinned.contains_key(&key) && owners.contains_key(&key)
        };
        // Fast chunks, coldest first: what demotion and swaps send down.
        let cold: Vec<&ChunkInfo> = candidates.cold.iter().filter(|c| movable(c, &owners)).collect();
        let mut capacity_free = space.capacity_size.saturating_sub(space.capacity_used);
        if fast_used > fast_room(settings.high_percent) {
            // Demotion: coldest first, down to the low watermark, as far
            // as the capacity tier has room.
            for info in cold {
                if fast_used <= fast_room(settings.low_percent) {
                    break;
                }
                let chunk = ChunkMove::take(&mut owners, (info.device, info.chunk), Role::Capacity).unwrap_or_default();
                if chunk.bytes > capacity_free {
                    break;
                }
                capacity_free -= chunk.bytes;
                fast_used = fast_used.saturating_sub(chunk.bytes);
                plan.push(chunk);
            }
        } else {
            // Promotion: capacity chunks hotter than a floor (a few reads
            // are not heat), hottest first, while the fast tier stays
            // under its high watermark; then
            // swaps: a capacity chunk much hotter than the coldest fast
            // one trades places with it.
            let hot: Vec<&ChunkInfo> = candidates.hot.iter().filter(|c| movable(c, &owners)).collect();
            let mut cold = cold.into_iter();
            let mut swapped = 0u64;
            for info in hot {
                let up = ChunkMove::take(&mut owners, (info.device, info.chunk), Role::Fast).unwrap_or_default();
                let bytes = up.bytes;
                if fast_used + bytes <= fast_room(settings.high_percent) {
                    fast_used += bytes;
                    capacity_free += bytes;
                    plan.push(up);
                    continue;
                }
                // A swap: the coldest fast chunks left go down first, as
                // long as it is worth it (`worth_swapping`).
                while fast_used + bytes > fast_room(settings.high_percent) && swapped < SWAP_MAX_BYTES {
                    let Some(victim) = cold.next() else { break };
                    if !worth_swapping(info.heat, victim.heat, swap_floor) {
                        break;
                    }
                    let down =
                        ChunkMove::take(&mut owners, (victim.device, victim.chunk), Role::Capacity).unwrap_or_default();
                    if down.bytes > capacity_free {
                        break;
                    }
                    capacity_free -= down.bytes;
                    fast_used = fast_used.saturating_sub(down.bytes);
                    swapped += down.bytes;
                    plan.push(down);
                }
                if fast_used + bytes > fast_room(settings.high_percent) {
                    break;
                }
                fast_used += bytes;
                capacity_free += bytes;
                plan.push(up);
            }
        }
        Ok(plan)
    }

    /// The chunks a pass may move by heat: the `limits.chunks` coldest
    /// fast chunks (coldest first) and hottest capacity chunks of at least
    /// [`PROMOTE_MIN_HEAT`] (hottest first), among those holding live
    /// slots; and the swap floor, from each tier's mean heat. The
    /// allocator's used chunks are listed `limits.lock_batch` chunk
    /// numbers per hold of its lock; the heat is read outside it.
    fn heat_candidates(&self, limits: PlanLimits, stats: &mut PlanStats) -> Candidates {
        // Each kept as a max-heap of its `limits.chunks` first in the
        // order the plan takes them: the last is dropped when it overflows.
        let mut cold: BinaryHeap<(u64, u8, u64)> = BinaryHeap::new();
        let mut hot: BinaryHeap<(Reverse<u64>, u8, u64)> = BinaryHeap::new();
        // (sum, count) of the heat of the fast and capacity tiers' chunks.
        let mut fast_heat = (0u64, 0u64);
        let mut capacity_heat = (0u64, 0u64);
        for device in self.devices.iter() {
            let role = device.member.role;
            if !role.holds_data() {
                continue;
            }
            let index = device.member.index;
            let mut from = 0;
            loop {
                let (listed, to, end) = {
                    let allocator = self.allocator.lock_or_abort();
                    let held = Instant::now();
                    let range = allocator.chunk_range(index);
                    let start = from.max(range.start);
                    let to = start.saturating_add(limits.lock_batch).min(range.end).max(start);
                    let listed = allocator.used_chunks_in(index, start..to);
                    stats.note_hold(held.elapsed(), to - start);
                    (listed, to, range.end)
                };
                for (chunk, live) in listed {
                    let heat = device.heat.score(chunk);
                    let sum = if role == Role::Capacity {
                        &mut capacity_heat
                    } else {
                        &mut fast_heat
                    };
                    *sum = (sum.0.saturating_add(heat), sum.1 + 1);
                    if !live {
                        continue;
                    }
                    match role {
                        Role::Capacity if heat >= PROMOTE_MIN_HEAT => {
                            keep_first(&mut hot, (Reverse(heat), index, chunk), limits.chunks)
                        }
                        Role::Capacity => {}
                        _ => keep_first(&mut cold, (heat, index, chunk), limits.chunks),
                    }
                }
                if to >= end {
                    break;
                }
                from = to;
            }
        }
        let info = |heat: u64, device: u8, chunk: u64| ChunkInfo { device, chunk, heat };
        let candidates = Candidates {
            cold: cold
                .into_sorted_vec()
                .into_iter()
                .map(|(heat, device, chunk)| info(heat, device, chunk))
                .collect(),
            hot: hot
                .into_sorted_vec()
                .into_iter()
                .map(|(Reverse(heat), device, chunk)| info(heat, device, chunk))
                .collect(),
            swap_floor: swap_floor(fast_heat, capacity_heat),
        };
        stats.chunks_kept = candidates.cold.len() + candidates.hot.len();
        candidates
    }

    /// Makes the planned moves, a chunk at a time (its blocks read in one
    /// device read where they lie together). While clients do I/O it works
    /// in short bursts ([`BURST`]) with as long a rest after each; when
    /// idle, at the devices' speed. A background pass stops
    /// when `migration` is turned off.
    async fn run_plan(
        self: &Arc<Self>,
        plan: Vec<ChunkMove>,
        explicit: bool,
        summary: &mut PassSummary,
        started: Instant,
    ) -> Result<(), PoolError> {
        let m = &self.migrator;
        let mut burst = Instant::now();
        let mut seen = m.foreground.load(Ordering::Relaxed);
        let mut committed = Instant::now();
        for (done_chunks, chunk) in plan.into_iter().enumerate() {
            if !explicit && !self.migration_settings().enabled {
                return Ok(());
            }
            if burst.elapsed() >= BURST {
                let now = m.foreground.load(Ordering::Relaxed);
                let busy = now != seen;
                m.throttled.store(busy, Ordering::Relaxed);
                if busy {
                    tokio::time::sleep(burst.elapsed().min(MAX_REST)).await;
                    seen = m.foreground.load(Ordering::Relaxed);
                } else {
                    tokio::task::yield_now().await;
                }
                burst = Instant::now();
            }
            let source = chunk.blocks.first().and_then(|o| o.entry.place());
            let heat = source.map_or(0, |(device, offset)| {
                self.devices
                    .get(device as usize)
                    .map_or(0, |d| d.heat.take(offset / self.chunk_bytes as u64))
            });
            let mut moved_bytes = 0;
            let mut targets: Vec<(u8, u64)> = Vec::new();
            // The chunk's blocks by volume (mostly one).
            let mut owners = chunk.blocks;
            owners.sort_by_key(|o| (o.engine.id(), o.block));
            for group in owners.chunk_by(|a, b| a.engine.id() == b.engine.id()) {
                let engine = &group[0].engine;
                let blocks: Vec<(u64, BlockPtr)> = group.iter().map(|o| (o.block, o.entry)).collect();
                let outcome = match engine.move_blocks(&blocks, chunk.to).await {
                    Ok(outcome) => outcome,
                    // The target tier filled meanwhile: the rest waits.
                    Err(crate::block::BlockError::NoSpace) => return Ok(()),
                    Err(e) => {
                        summary.errors += blocks.len() as u64;
                        tracing::warn!(
                            "pool {}: moving blocks of volume {} to the {} tier failed, they stay where they were: {e}",
                            self.name(),
                            engine.id(),
                            chunk.to.as_str()
                        );
                        continue;
                    }
                };
                for (moved, (block, _)) in outcome.into_iter().zip(&blocks) {
                    match moved {
                        Moved::To(device, offset) => {
                            moved_bytes += engine.block_bytes();
                            let target = (device, offset / self.chunk_bytes as u64);
                            if !targets.contains(&target) {
                                targets.push(target);
                            }
                        }
                        Moved::Skipped => summary.skipped_blocks += 1,
                        Moved::Failed => {
                            summary.errors += 1;
                            tracing::warn!(
                                "pool {}: moving block {block} of volume {} to the {} tier failed; it stays where it was",
                                self.name(),
                                engine.id(),
                                chunk.to.as_str()
                            );
                        }
                    }
                }
            }
            m.pass_done.fetch_add(chunk.bytes, Ordering::Relaxed);
            let elapsed = started.elapsed().as_secs_f64();
            if elapsed > 0.0 {
                m.rate.store(
                    (m.pass_done.load(Ordering::Relaxed) as f64 / elapsed) as u64,
                    Ordering::Relaxed,
                );
            }
            // Heat moves with the data (a promoted chunk is not cold where
            // it lands).
            for (device, target) in targets {
                if let Some(d) = self.devices.get(device as usize) {
                    d.heat.raise(target, heat);
                }
            }
            let queue = if chunk.to == Role::Capacity {
                summary.moved_down_bytes += moved_bytes;
                summary.chunks_down += 1;
                m.moved_down.fetch_add(moved_bytes, Ordering::Relaxed);
                &m.queued_down
            } else {
                summary.moved_up_bytes += moved_bytes;
                summary.chunks_up += 1;
                m.moved_up.fetch_add(moved_bytes, Ordering::Relaxed);
                &m.queued_up
            };
            let _ = queue.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| Some(q.saturating_sub(1)));
            // Commit every 16 chunks or every second: the old slots are
            // freed only then (and a crash redoes no more than that).
            if (done_chunks + 1).is_multiple_of(16) || committed.elapsed() >= Duration::from_secs(1) {
                self.commit_quiet().await?;
                committed = Instant::now();
            }
        }
        Ok(())
    }

    /// Starts the background migrator: a pass every [`PASS_INTERVAL`]
    /// while `migration=on` (and inside `migration.window`), heat halved
    /// every [`HEAT_HALF_LIFE`]. It stops when the pool is dropped.
    pub(crate) fn start_migrator(self: &Arc<Self>) {
        let Some(handle) = super::background_runtime() else {
            return;
        };
        let weak = Arc::downgrade(self);
        handle.spawn(async move {
            // The first pass one interval after the start, not during it.
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + PASS_INTERVAL, PASS_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_decay = Instant::now();
            let mut last_save = Instant::now();
            let mut failing = false;
            loop {
                tick.tick().await;
                let Some(pool) = weak.upgrade() else { return };
                while last_decay.elapsed() >= HEAT_HALF_LIFE {
                    pool.decay_heat();
                    last_decay += HEAT_HALF_LIFE;
                }
                if last_save.elapsed() >= HEAT_SAVE_INTERVAL {
                    pool.save_heat_at_next_checkpoint();
                    last_save = Instant::now();
                }
                let settings = pool.migration_settings();
                if !settings.enabled || !settings.in_window(minute_of_day_utc()) {
                    continue;
                }
                match pool.migrate_pass(false).await {
                    Err(e) if !failing => {
                        tracing::error!("pool {}: migration failed: {e}; retrying every pass", pool.name());
                        failing = true;
                    }
                    Ok(_) if failing => {
                        tracing::info!("pool {}: migration works again", pool.name());
                        failing = false;
                    }
                    _ => {}
                }
            }
        });
    }
}

/// Capacity chunks need at least this much heat (decayed accesses) to
/// move up: a chunk read once or twice is not hot.
pub const PROMOTE_MIN_HEAT: u64 = 8;
/// The most a pass moves down to make room for hotter chunks (swaps).
pub const SWAP_MAX_BYTES: u64 = 256 << 20;
/// A capacity chunk trades places with a fast one only if its heat is at
/// least this many times the mean heat of the colder tier's chunks. Reads
/// spread evenly over far more chunks than the fast tier holds give every
/// chunk, fast or capacity, about the same heat, and the chunk that looked
/// hottest this minute is no hotter than the rest the next. Swapping on
/// that noise (at twice the coldest fast chunk's heat) moves 1.2 GiB up
/// and 1.5 GiB down in 10 minutes of `bench/tiering.sh` for no IOPS, and
/// raises the clients' p99 by a quarter (BENCHMARKS.md, "Tiering").
/// A hot set on the capacity tier stands out from it, and a fast tier
/// nobody reads is cold: those still trade places.
pub const SWAP_STANDOUT: u64 = 4;

/// Whether a capacity chunk of heat `hot` should trade places with a fast
/// chunk of heat `cold`: it is hot, more than twice as hot, and stands out
/// from the noise (`floor`, [`swap_floor`]).
fn worth_swapping(hot: u64, cold: u64, floor: u64) -> bool {
    hot >= PROMOTE_MIN_HEAT && hot > cold.saturating_mul(2) && hot >= floor
}

/// Adds `key` to `heap`, which keeps the `limit` least keys.
fn keep_first<K: Ord>(heap: &mut BinaryHeap<K>, key: K, limit: usize) {
    if heap.len() < limit {
        heap.push(key);
    } else if heap.peek().is_some_and(|last| key < *last) {
        heap.pop();
        heap.push(key);
    }
}

/// The heat a capacity chunk needs to trade places with a fast chunk:
/// [`SWAP_STANDOUT`] times the lower of the two tiers' mean chunk heat,
/// and at least [`PROMOTE_MIN_HEAT`].
fn swap_floor(fast_heat: (u64, u64), capacity_heat: (u64, u64)) -> u64 {
    let mean = |(sum, count): (u64, u64)| sum / count.max(1);
    mean(fast_heat)
        .min(mean(capacity_heat))
        .saturating_mul(SWAP_STANDOUT)
        .max(PROMOTE_MIN_HEAT)
}

/// While clients do I/O, the migrator works this long (a chunk at least),
/// then rests as long as it worked. Its time includes waiting behind
/// clients' requests at the device, so the busier the device, the slower
/// it goes; one request at a time, it takes a small share of a busy disk.
pub const BURST: Duration = Duration::from_millis(2);
/// The longest rest after a burst. A chunk whose move took longer spent
/// that time waiting behind clients' requests at a busy device (a 1 MiB
/// read on the emulated HDD of `bench/tiering.sh` waits ~100 ms behind 16
/// client reads): resting as long again would halve the migrator's share
/// of the disk without shortening the clients' queue, which its one
/// request at a time lengthens by one.
pub const MAX_REST: Duration = Duration::from_millis(20);

fn minute_of_day_utc() -> u16 {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    ((seconds / 60) % (24 * 60)) as u16
}

#[derive(Debug, Default, Clone, Copy)]
struct TierSpace {
    fast_used: u64,
    fast_size: u64,
    capacity_used: u64,
    capacity_size: u64,
}

/// The most a pass plans to move by heat each way, and out of place for
/// pinned volumes: what bounds its planning's memory (an owner per block
/// of at most three times this, 24 bytes each: 18 MiB at 4 KiB blocks).
/// A pass takes about as long as it moves (a capacity HDD writes 1 GiB in
/// 7 s or more), and the next begins when it ends.
pub const PASS_MAX_BYTES: u64 = 1 << 30;
/// Chunk numbers of a device the planner looks at per hold of the
/// allocator lock: a hash lookup each (a cache miss in a large pool's
/// chunk table), a few hundred microseconds a hold at most.
pub const LIST_BATCH_CHUNKS: u64 = 1024;

/// Map page indexes the walk lists at a time (of a volume's view, or a
/// snapshot's own pages): 2 Mi blocks' worth.
pub(crate) const PAGE_WINDOW: usize = 4096;

/// Bounds of one pass's planning (tests choose smaller ones).
#[derive(Debug, Clone, Copy)]
struct PlanLimits {
    /// The most chunks a pass considers moving each way.
    chunks: usize,
    /// Chunks of a device looked at per hold of the allocator lock.
    lock_batch: u64,
}

impl PlanLimits {
    fn of(chunk_bytes: u32) -> Self {
        PlanLimits {
            chunks: (PASS_MAX_BYTES / chunk_bytes as u64).max(1) as usize,
            lock_batch: LIST_BATCH_CHUNKS,
        }
    }
}

/// What one pass's planning held and how long it held the allocator lock
/// (the figures `planning_at_scale` reports).
#[derive(Debug, Default, Clone)]
pub(crate) struct PlanStats {
    /// Entries of blocks the plan kept at once (owners, and slots seen).
    pub owners: usize,
    /// Chunks kept with their heat.
    pub chunks_kept: usize,
    /// Holds of the allocator lock, the longest, and the most chunks
    /// looked at in one.
    pub holds: u64,
    pub longest_hold: Duration,
    pub total_hold: Duration,
    pub most_chunks_per_hold: u64,
}

impl PlanStats {
    fn note_hold(&mut self, held: Duration, chunks: u64) {
        self.holds += 1;
        self.longest_hold = self.longest_hold.max(held);
        self.total_hold += held;
        self.most_chunks_per_hold = self.most_chunks_per_hold.max(chunks);
    }
}

/// A pass's candidates by heat (`Pool::heat_candidates`).
struct Candidates {
    /// Fast chunks, coldest first.
    cold: Vec<ChunkInfo>,
    /// Capacity chunks, hottest first.
    hot: Vec<ChunkInfo>,
    swap_floor: u64,
}

struct ChunkInfo {
    device: u8,
    chunk: u64,
    heat: u64,
}

struct Owner {
    engine: Arc<EngineVolume>,
    block: u64,
    entry: BlockPtr,
}

struct ChunkMove {
    to: Role,
    bytes: u64,
    blocks: Vec<Owner>,
}

impl ChunkMove {
    /// The move of chunk `key`'s blocks (taken out of `owners`, so no
    /// chunk is planned twice) to tier `to`; `None` if no open volume owns
    /// any of them.
    fn take(owners: &mut HashMap<(u8, u64), Vec<Owner>>, key: (u8, u64), to: Role) -> Option<ChunkMove> {
        let blocks = owners.remove(&key)?;
        let bytes = blocks.iter().map(|o| o.engine.block_bytes()).sum();
        Some(ChunkMove { to, bytes, blocks })
    }
}

impl Default for ChunkMove {
    fn default() -> Self {
        ChunkMove {
            to: Role::Capacity,
            bytes: 0,
            blocks: Vec::new(),
        }
    }
}

/// Per chunk of a device: reads (low 32 bits) and writes (high 32 bits),
/// halved every [`HEAT_HALF_LIFE`].
pub(crate) struct Heat {
    counts: Box<[AtomicU64]>,
}

impl Heat {
    pub(crate) fn new(chunks: u64) -> Self {
        Heat {
            counts: (0..chunks).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Counts `n` accesses; true each time the count passes a multiple of
    /// 16 (the migrator's sign of client I/O, kept off a shared counter
    /// for every request).
    fn add(&self, chunk: u64, write: bool, n: u64) -> bool {
        let Some(count) = self.counts.get(chunk as usize) else {
            return false;
        };
        let shift = if write { 32 } else { 0 };
        let before = (count.fetch_add(n << shift, Ordering::Relaxed) >> shift) & 0xffff_ffff;
        before / 16 != (before + n) / 16
    }

    /// Reads plus writes, decayed.
    pub(crate) fn score(&self, chunk: u64) -> u64 {
        self.counts
            .get(chunk as usize)
            .map_or(0, |c| split(c.load(Ordering::Relaxed)).iter().sum())
    }

    /// The chunk's score, and its counts cleared (its data moved away).
    fn take(&self, chunk: u64) -> u64 {
        self.counts
            .get(chunk as usize)
            .map_or(0, |c| split(c.swap(0, Ordering::Relaxed)).iter().sum())
    }

    /// Raises a chunk's counts to at least `score` (as reads).
    fn raise(&self, chunk: u64, score: u64) {
        if let Some(count) = self.counts.get(chunk as usize) {
            let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                let [reads, writes] = split(v);
                (reads + writes < score).then(|| join(score.min(u32::MAX as u64), writes))
            });
        }
    }

    /// Counts stored by a checkpoint, back after a restart.
    pub(crate) fn restore(&self, chunk: u64, counts: u64) {
        if let Some(count) = self.counts.get(chunk as usize) {
            count.store(counts, Ordering::Relaxed);
        }
    }

    /// The chunks with any heat, and their counts.
    fn warm(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .map(|(chunk, c)| (chunk as u64, c.load(Ordering::Relaxed)))
            .filter(|(_, counts)| *counts != 0)
    }

    fn decay(&self) {
        for count in self.counts.iter() {
            let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                let [reads, writes] = split(v);
                Some(join(reads / 2, writes / 2))
            });
        }
    }
}

fn split(value: u64) -> [u64; 2] {
    [value & 0xffff_ffff, value >> 32]
}

fn join(reads: u64, writes: u64) -> u64 {
    reads.min(u32::MAX as u64) | (writes.min(u32::MAX as u64) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{IoBuf, SimDevice};
    use crate::pool::NewDevice;

    const MIB: u64 = 1 << 20;

    fn two_tier_devices(fast: &SimDevice, capacity: &SimDevice) -> Vec<NewDevice> {
        vec![
            NewDevice {
                device: fast.as_device(),
                role: Role::Fast,
            },
            NewDevice {
                device: capacity.as_device(),
                role: Role::Capacity,
            },
        ]
    }

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(future)
    }

    /// A pool of a 160 MiB fast and a 256 MiB capacity simulated device,
    /// 1 MiB chunks, and a 512 MiB volume of 4 KiB blocks.
    async fn two_tier_pool(seed: u64) -> (SimDevice, SimDevice, Arc<Pool>, Arc<EngineVolume>) {
        let fast = SimDevice::new(160 * MIB, seed);
        let capacity = SimDevice::new(256 * MIB, seed + 1);
        let pool = Pool::create("test", 1 << 20, two_tier_devices(&fast, &capacity))
            .await
            .unwrap();
        let volume = pool.open_volume(1, 512 * MIB, 4096).unwrap();
        (fast, capacity, pool, volume)
    }

    /// Writes MiB `index`'s pattern for every index.
    async fn write_mibs(volume: &EngineVolume, indices: impl IntoIterator<Item = u64>) {
        for index in indices {
            volume
                .write(index * MIB, IoBuf::copy_from(&mib_of(index)), false)
                .await
                .unwrap();
        }
    }

    /// Moves everything volume 1 has to the capacity tier.
    async fn park_on_capacity(pool: &Arc<Pool>) {
        pool.set_tier_pin(1, TierPin::Capacity);
        pool.migrate_now().await.unwrap();
        pool.set_tier_pin(1, TierPin::Auto);
    }

    fn mib_of(index: u64) -> Vec<u8> {
        (0..MIB).map(|i| ((i / 4096 + index * 7) % 251) as u8 + 1).collect()
    }

    async fn read_mib(volume: &EngineVolume, index: u64) -> Vec<u8> {
        let (buf, result) = volume.read(index * MIB, IoBuf::new(MIB as usize)).await;
        result.unwrap();
        buf.payload().to_vec()
    }

    /// A client's read in MiB `index`: its middle half (far enough from
    /// its neighbours' reads not to pass for a scan, and above the read
    /// cache's request size, so it reaches the device).
    async fn touch_mib(volume: &EngineVolume, index: u64) {
        let (_, result) = volume.read(index * MIB + MIB / 4, IoBuf::new(MIB as usize / 2)).await;
        result.unwrap();
    }

    fn on_fast(pool: &Pool, index: u64) -> bool {
        let blocks = MIB / 4096;
        pool.lookup_range(1, index * blocks, (index + 1) * blocks - 1)
            .unwrap()
            .into_iter()
            .all(|e| matches!(e.place(), Some((device, _)) if pool.devices.at(device).unwrap().member.role == Role::Fast))
    }

    /// A file dataset's engine object spans 2^63 bytes. With the fast tier
    /// full, a pass walks every open volume's map: only the pages that can
    /// map anything, so it ends, and a block far out in such an object
    /// moves like any other. (A walk of every page index of the object's
    /// size never ended, on a core of its own, evicting the volumes' map
    /// pages as it went.)
    #[test]
    fn a_pass_walks_only_the_map_pages_that_exist() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            block_on(async {
                let (_fast, _capacity, pool, volume) = two_tier_pool(5).await;
                let huge = pool.open_volume(2, 1 << 60, 4096).unwrap();
                let far = (1u64 << 50) / MIB;
                huge.write(far * MIB, IoBuf::copy_from(&mib_of(far)), false)
                    .await
                    .unwrap();
                let space = pool.tier_space();
                write_mibs(&volume, 0..space.fast_size * 95 / 100 / MIB).await;
                pool.commit_quiet().await.unwrap();
                pool.set_tier_pin(2, TierPin::Capacity);
                let summary = pool.migrate_now().await.unwrap();
                assert_eq!(summary.errors, 0);
                let tiers = pool.volume_tier_bytes(2).unwrap();
                assert_eq!(tiers, vec![(Role::Fast, 0), (Role::Capacity, MIB)], "{summary:?}");
                let (buf, result) = huge.read(far * MIB, IoBuf::new(MIB as usize)).await;
                result.unwrap();
                assert!(buf.payload() == mib_of(far), "the far MiB differs after its move");
            });
            done_tx.send(()).unwrap();
        });
        match done_rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(()) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("the pass did not end in 120 s"),
            // The thread panicked: its assertion is in the test's output.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the test's thread failed"),
        }
    }

    /// A fast tier filled past the high watermark: a pass moves the
    /// coldest chunks down to the low watermark, keeps the chunks clients
    /// read on the fast tier, moves every byte (nothing copied twice,
    /// nothing lost), and all of it survives a power loss right after.
    #[test]
    fn cold_chunks_move_down_to_the_low_watermark_and_hot_ones_stay() {
        block_on(async {
            let (fast, capacity, pool, volume) = two_tier_pool(3).await;
            let before = pool.tier_space();
            let written = before.fast_size * 95 / 100 / MIB;
            write_mibs(&volume, 0..written).await;
            pool.commit_quiet().await.unwrap();
            let full = pool.tier_space();
            assert_eq!(full.capacity_used, 0, "the fast tier had room for all of it");
            assert!(full.fast_used > full.fast_size * 85 / 100);
            // Clients read the last 8 MiB written: hot.
            let hot = written - 8..written;
            for _ in 0..20 {
                for index in hot.clone() {
                    touch_mib(&volume, index).await;
                }
            }
            let summary = pool.migrate_now().await.unwrap();
            assert_eq!(summary.errors, 0);
            assert!(summary.chunks_down > 0 && summary.chunks_up == 0, "{summary:?}");
            let after = pool.tier_space();
            assert!(
                after.fast_used <= after.fast_size * 70 / 100,
                "fast tier {} of {} used after the pass",
                after.fast_used,
                after.fast_size
            );
            assert_eq!(
                after.fast_used + after.capacity_used,
                written * MIB,
                "moved, not copied"
            );
            assert_eq!(summary.moved_down_bytes, after.capacity_used);
            for index in hot.clone() {
                assert!(on_fast(&pool, index), "hot MiB {index} moved down");
            }
            for index in 0..written {
                assert!(
                    read_mib(&volume, index).await == mib_of(index),
                    "MiB {index} differs after the pass"
                );
            }
            let status = pool.migration_status();
            assert_eq!(status.moved_down_bytes, summary.moved_down_bytes);
            assert!(!status.running);
            // A power loss now: the moves were committed; nothing lost,
            // nothing leaked (every slot in use is a mapped block's).
            drop(volume);
            drop(pool);
            fast.crash();
            capacity.crash();
            let pool = Pool::open(vec![fast.as_device(), capacity.as_device()]).await.unwrap();
            let volume = pool.open_volume(1, 512 * MIB, 4096).unwrap();
            for index in 0..written {
                assert!(
                    read_mib(&volume, index).await == mib_of(index),
                    "MiB {index} differs after the crash"
                );
            }
            let reopened = pool.tier_space();
            assert_eq!(
                reopened.fast_used + reopened.capacity_used,
                written * MIB,
                "a slot leaked"
            );
            assert_eq!(reopened.capacity_used, after.capacity_used);
        });
    }

    /// With room on the fast tier, capacity chunks clients read often move up;
    /// cold ones stay down. A volume pinned to the capacity tier moves down
    /// whatever its heat.
    #[test]
    fn hot_chunks_move_up_and_pins_win() {
        block_on(async {
            let (_fast, _capacity, pool, volume) = two_tier_pool(5).await;
            write_mibs(&volume, 0..16).await;
            pool.set_tier_pin(1, TierPin::Capacity);
            let down = pool.migrate_now().await.unwrap();
            assert_eq!(down.chunks_down, 16, "{down:?}");
            assert!((0..16).all(|index| !on_fast(&pool, index)));
            pool.set_tier_pin(1, TierPin::Auto);
            // MiBs 0..4 are read often; the rest not at all.
            for _ in 0..40 {
                for index in 0..4 {
                    touch_mib(&volume, index).await;
                }
            }
            let up = pool.migrate_now().await.unwrap();
            assert_eq!(up.chunks_up, 4, "{up:?}");
            for index in 0..16 {
                assert_eq!(on_fast(&pool, index), index < 4, "MiB {index}");
                assert!(read_mib(&volume, index).await == mib_of(index));
            }
            // Nothing bounces back: the next pass has nothing to do.
            let again = pool.migrate_now().await.unwrap();
            assert_eq!((again.chunks_up, again.chunks_down), (0, 0), "{again:?}");
        });
    }

    /// A full fast tier (under its high watermark) and a hot set on the
    /// capacity tier: the hot chunks trade places with the coldest fast
    /// ones, and the fast tier stays under the watermark.
    #[test]
    fn a_hot_capacity_chunk_trades_places_with_a_cold_fast_one() {
        block_on(async {
            let (_fast, _capacity, pool, volume) = two_tier_pool(8).await;
            let hot = 0..8;
            write_mibs(&volume, hot.clone()).await;
            park_on_capacity(&pool).await;
            // Cold data up to 84 % of the fast tier (the high watermark is 85).
            let size = pool.tier_space().fast_size;
            let cold = 8..8 + size * 84 / 100 / MIB;
            write_mibs(&volume, cold.clone()).await;
            pool.commit_quiet().await.unwrap();
            assert!(hot.clone().all(|index| !on_fast(&pool, index)));
            for _ in 0..40 {
                for index in hot.clone() {
                    touch_mib(&volume, index).await;
                }
            }
            let summary = pool.migrate_now().await.unwrap();
            assert_eq!(summary.chunks_up, 8, "{summary:?}");
            assert!(summary.chunks_down > 0, "{summary:?}");
            assert!(hot.clone().all(|index| on_fast(&pool, index)));
            let space = pool.tier_space();
            assert!(space.fast_used <= space.fast_size * 85 / 100);
            for index in hot.chain(cold) {
                assert!(read_mib(&volume, index).await == mib_of(index), "MiB {index}");
            }
        });
    }

    /// A full fast tier whose chunks clients read, and capacity chunks
    /// read from as often to three times as often: none stands out (that
    /// is noise: the next minute another looks hottest; a swap needed
    /// only twice the fast chunk's heat before). One read far more does.
    #[test]
    fn capacity_chunks_that_do_not_stand_out_do_not_swap_and_one_that_does_does() {
        block_on(async {
            let (_fast, _capacity, pool, volume) = two_tier_pool(21).await;
            let uneven = 0..16;
            write_mibs(&volume, uneven.clone()).await;
            park_on_capacity(&pool).await;
            // Up to the high watermark: no room for a chunk more.
            let size = pool.tier_space().fast_size;
            let fast = 16..16 + size * 85 / 100 / MIB;
            write_mibs(&volume, fast.clone()).await;
            pool.commit_quiet().await.unwrap();
            for round in 0..40 {
                for index in fast.clone() {
                    if round < 10 {
                        touch_mib(&volume, index).await;
                    }
                }
                for index in uneven.clone() {
                    if round < (index % 3 + 1) * 10 {
                        touch_mib(&volume, index).await;
                    }
                }
            }
            let summary = pool.migrate_now().await.unwrap();
            assert_eq!((summary.chunks_up, summary.chunks_down), (0, 0), "{summary:?}");
            for _ in 0..300 {
                touch_mib(&volume, 3).await;
            }
            let summary = pool.migrate_now().await.unwrap();
            assert_eq!(summary.chunks_up, 1, "{summary:?}");
            assert!(on_fast(&pool, 3));
            assert!(uneven.filter(|index| *index != 3).all(|index| !on_fast(&pool, index)));
            for index in (0..16).chain(fast) {
                assert!(read_mib(&volume, index).await == mib_of(index), "MiB {index}");
            }
        });
    }

    /// The capacity device fails every read while hot chunks would move up:
    /// the moves are abandoned and counted, the data stays where it was,
    /// and once the device reads again the next pass moves it.
    #[test]
    fn a_read_error_during_a_move_leaves_the_data_where_it_was() {
        block_on(async {
            let (_fast, capacity, pool, volume) = two_tier_pool(10).await;
            write_mibs(&volume, 0..4).await;
            park_on_capacity(&pool).await;
            for _ in 0..40 {
                for index in 0..4 {
                    touch_mib(&volume, index).await;
                }
            }
            let used = pool.tier_space();
            capacity.set_faults(crate::device::sim::SimFaults {
                read_error: 1.0,
                ..Default::default()
            });
            let failed = pool.migrate_now().await.unwrap();
            assert_eq!(failed.moved_up_bytes, 0, "{failed:?}");
            assert_eq!(failed.errors, 4 * MIB / 4096, "{failed:?}");
            assert_eq!(pool.migration_status().errors, failed.errors);
            assert_eq!(
                pool.tier_space().fast_used,
                used.fast_used,
                "a failed move left a slot behind"
            );
            capacity.set_faults(crate::device::sim::SimFaults::default());
            for index in 0..4 {
                assert!(!on_fast(&pool, index));
                assert!(read_mib(&volume, index).await == mib_of(index));
            }
            // The heat went with the failed attempt; clients read again.
            for _ in 0..40 {
                for index in 0..4 {
                    touch_mib(&volume, index).await;
                }
            }
            let moved = pool.migrate_now().await.unwrap();
            assert_eq!((moved.chunks_up, moved.errors), (4, 0), "{moved:?}");
            assert!((0..4).all(|index| on_fast(&pool, index)));
        });
    }

    /// Sequential reads (a backup scanning the data, 256 KiB at a time,
    /// three times over; a stream's first 256 KiB count) promote nothing; the same reads in a scattered
    /// order do.
    #[test]
    fn scans_do_not_promote() {
        block_on(async {
            let (_fast, _capacity, pool, volume) = two_tier_pool(12).await;
            // Eight MiBs 32 MiB apart.
            let at = |index: u64| index * 32 * MIB;
            for index in 0..8 {
                volume
                    .write(at(index), IoBuf::copy_from(&mib_of(index)), false)
                    .await
                    .unwrap();
            }
            park_on_capacity(&pool).await;
            // Reads above the read cache's request size: each reaches the device.
            let piece = 256 << 10;
            let pieces = MIB / piece;
            for _ in 0..3 {
                for index in 0..8 {
                    for p in 0..pieces {
                        let (_, result) = volume.read(at(index) + p * piece, IoBuf::new(piece as usize)).await;
                        result.unwrap();
                    }
                }
            }
            let after_scans = pool.migrate_now().await.unwrap();
            assert_eq!(after_scans.chunks_up, 0, "{after_scans:?}");
            // The same reads, each MiB's pieces backwards, going from one
            // MiB to the next (forwards, that would be eight scans): heat.
            for _ in 0..10 {
                for p in (0..pieces).rev() {
                    for index in 0..8 {
                        let (_, result) = volume.read(at(index) + p * piece, IoBuf::new(piece as usize)).await;
                        result.unwrap();
                    }
                }
            }
            let after_random = pool.migrate_now().await.unwrap();
            assert_eq!(after_random.chunks_up, 8, "{after_random:?}");
        });
    }

    /// What was hot is still hot after a restart: a checkpoint stores the
    /// chunks' heat when asked (the daemon asks every few minutes and
    /// before it stops), and the pool's open restores it.
    #[test]
    fn heat_outlives_a_restart() {
        block_on(async {
            let (fast, capacity, pool, volume) = two_tier_pool(14).await;
            volume.write(0, IoBuf::copy_from(&mib_of(0)), false).await.unwrap();
            for _ in 0..30 {
                touch_mib(&volume, 0).await;
            }
            let chunk = |pool: &Pool| {
                let entry = pool.lookup(1, 0).unwrap();
                let (device, offset) = entry.place().unwrap();
                pool.devices.at(device).unwrap().heat.score(offset / MIB)
            };
            let hot = chunk(&pool);
            assert!(hot >= 30, "{hot}");
            // A checkpoint not asked to store heat does not.
            pool.checkpoint().await.unwrap();
            pool.save_heat_at_next_checkpoint();
            touch_mib(&volume, 0).await;
            pool.checkpoint().await.unwrap();
            drop(volume);
            drop(pool);
            fast.crash();
            capacity.crash();
            let pool = Pool::open(vec![fast.as_device(), capacity.as_device()]).await.unwrap();
            assert_eq!(chunk(&pool), hot + 1);
        });
    }

    /// A full fast tier: writes go on to the capacity tier (nothing fails),
    /// a pass makes room, and new data lands on the fast tier again.
    #[test]
    fn a_full_fast_tier_spills_then_gets_room_back() {
        block_on(async {
            let (_fast, _capacity, pool, volume) = two_tier_pool(16).await;
            let size = pool.tier_space().fast_size / MIB;
            write_mibs(&volume, 0..size + 8).await;
            pool.commit_quiet().await.unwrap();
            let full = pool.tier_space();
            assert_eq!(full.fast_used, full.fast_size, "the fast tier is full");
            assert_eq!(full.capacity_used, 8 * MIB, "the rest spilled");
            let summary = pool.migrate_now().await.unwrap();
            assert!(summary.chunks_down > 0 && summary.errors == 0, "{summary:?}");
            let room = pool.tier_space();
            assert!(room.fast_used <= room.fast_size * 70 / 100);
            write_mibs(&volume, size + 8..size + 12).await;
            pool.commit_quiet().await.unwrap();
            assert!(
                (size + 8..size + 12).all(|index| on_fast(&pool, index)),
                "new data lands on the fast tier"
            );
            for index in 0..size + 12 {
                assert!(read_mib(&volume, index).await == mib_of(index), "MiB {index}");
            }
        });
    }

    #[test]
    fn settings_are_checked_and_windows_may_wrap_midnight() {
        let mut settings = MigrationSettings::default();
        assert!(settings.validate().is_ok());
        settings.low_percent = 90;
        assert!(settings.validate().unwrap_err().contains("below migration.high"));
        settings = MigrationSettings {
            window: Some((23 * 60, 5 * 60)),
            ..MigrationSettings::default()
        };
        assert!(settings.in_window(23 * 60 + 30) && settings.in_window(60) && !settings.in_window(12 * 60));
        settings.window = Some((60, 300));
        assert!(settings.in_window(60) && !settings.in_window(300) && !settings.in_window(0));
    }

    /// A client rewrites a block the migrator has just moved, before the
    /// pass commits, into a chunk already marked dirty in this epoch, and
    /// the daemon is killed. The move's `Map` record (it frees the old
    /// slot) counts as a pending allocation; if it did not, the rewrite
    /// would go in place over the new slot without logging anything, and
    /// replay, without the record, would map the old slot: the acknowledged
    /// rewrite would be lost.
    #[test]
    fn a_rewrite_of_a_block_just_moved_survives_a_kill() {
        block_on(async {
            let (fast, capacity, pool, volume) = two_tier_pool(19).await;
            let half = MIB / 2;
            let data = |byte: u8| IoBuf::copy_from(&vec![byte; half as usize]);
            let blocks_of = |first: u64| -> Vec<(u64, BlockPtr)> {
                let count = half / 4096;
                (first..first + count)
                    .zip(pool.lookup_range(1, first, first + count - 1).unwrap())
                    .collect()
            };
            let on_capacity = |blocks: &[(u64, BlockPtr)]| -> Vec<(u8, u64)> {
                blocks
                    .iter()
                    .map(|(block, _)| pool.lookup(1, *block).unwrap().place().unwrap())
                    .inspect(|(device, _)| assert_eq!(pool.devices.at(*device).unwrap().member.role, Role::Capacity))
                    .collect()
            };
            // Half a MiB moved down and overwritten in place: its capacity
            // chunk is marked dirty in this epoch.
            volume.write(0, data(1), false).await.unwrap();
            pool.commit_quiet().await.unwrap();
            volume.move_blocks(&blocks_of(0), Role::Capacity).await.unwrap();
            pool.commit_quiet().await.unwrap();
            volume.write(0, data(2), false).await.unwrap();
            pool.commit_quiet().await.unwrap();
            // The next half MiB moved into the same chunk, not committed.
            volume.write(MIB, data(3), false).await.unwrap();
            pool.commit_quiet().await.unwrap();
            let second = blocks_of(MIB / 4096);
            volume.move_blocks(&second, Role::Capacity).await.unwrap();
            let moved = on_capacity(&second);
            assert!(moved.iter().all(|at| pool.is_marked(*at, pool.epoch())), "{moved:?}");
            let committed = pool.log.next_lsn();
            volume.write(MIB, data(4), false).await.unwrap();
            assert_eq!(pool.log.next_lsn(), committed, "the rewrite committed the log");
            drop(volume);
            drop(pool);
            // kill -9: every write reached the files, the log as staged.
            for sim in [&fast, &capacity] {
                sim.set_crash_model(crate::device::sim::CrashModel {
                    drop_weight: 0,
                    apply_weight: 1,
                    tear_weight: 0,
                });
                sim.crash();
            }
            let pool = Pool::open(vec![fast.as_device(), capacity.as_device()]).await.unwrap();
            let volume = pool.open_volume(1, 512 * MIB, 4096).unwrap();
            let (buf, result) = volume.read(MIB, IoBuf::new(half as usize)).await;
            result.unwrap();
            let first = buf.payload()[0];
            assert_eq!(first, 4, "read back {first:#x}, not the rewrite");
            assert!(buf.payload().iter().all(|&b| b == first));
        });
    }

    /// Blocks a snapshot shares with its volume and a clone of it, and
    /// blocks only the snapshot still maps, move too: once each, every
    /// view reading what it read before, through a power loss; deleting
    /// the clone and the snapshot afterwards frees exactly their space.
    #[test]
    fn shared_blocks_move_once_for_every_owner() {
        block_on(async {
            use crate::pool::snapshots::SnapshotRequest;
            let (fast, capacity, pool, volume) = two_tier_pool(17).await;
            write_mibs(&volume, 0..16).await;
            pool.create_snapshots(&[SnapshotRequest {
                volume: &volume,
                name: "s".into(),
            }])
            .await
            .unwrap();
            let snapshot = pool.snapshots_of(1)[0].id;
            // MiBs 0..3 rewritten: their old data only the snapshot maps.
            let new_of = |index: u64| -> Vec<u8> { mib_of(index + 100) };
            for index in 0..3 {
                volume
                    .write(index * MIB, IoBuf::copy_from(&new_of(index)), false)
                    .await
                    .unwrap();
            }
            // A clone of the snapshot that changed MiB 8 (its page of the
            // origin's blocks is its own now, every entry shared).
            pool.create_clone(2, snapshot).await.unwrap();
            let clone = pool.open_volume(2, 512 * MIB, 4096).unwrap();
            clone.write(8 * MIB, IoBuf::copy_from(&new_of(8)), false).await.unwrap();
            let view = pool.open_snapshot(snapshot, 4096).unwrap();
            pool.commit_quiet().await.unwrap();
            let used = |pool: &Pool| {
                let space = pool.tier_space();
                (space.fast_used, space.capacity_used)
            };
            assert_eq!(used(&pool), (20 * MIB, 0));
            // Everything volume 1's family maps goes down but the clone's
            // own MiB (the clone is not pinned).
            pool.set_tier_pin(1, TierPin::Capacity);
            let summary = pool.migrate_now().await.unwrap();
            assert_eq!(summary.errors, 0, "{summary:?}");
            assert_eq!(used(&pool), (MIB, 19 * MIB), "{summary:?}");
            let expect = |index: u64, who: u32| -> Vec<u8> {
                match who {
                    1 if index < 3 => new_of(index),
                    2 if index == 8 => new_of(index),
                    _ => mib_of(index),
                }
            };
            let check = |volume: Arc<EngineVolume>,
                         view: Arc<EngineVolume>,
                         clone: Arc<EngineVolume>,
                         when: &'static str| async move {
                for index in 0..16 {
                    assert!(
                        read_mib(&volume, index).await == expect(index, 1),
                        "volume, MiB {index}, {when}"
                    );
                    assert!(
                        read_mib(&view, index).await == mib_of(index),
                        "snapshot, MiB {index}, {when}"
                    );
                    assert!(
                        read_mib(&clone, index).await == expect(index, 2),
                        "clone, MiB {index}, {when}"
                    );
                }
            };
            check(volume.clone(), view.clone(), clone.clone(), "after the move").await;
            // A power loss: the moves were committed.
            drop((volume, view, clone));
            drop(pool);
            fast.crash();
            capacity.crash();
            let pool = Pool::open(vec![fast.as_device(), capacity.as_device()]).await.unwrap();
            assert_eq!(used(&pool), (MIB, 19 * MIB), "a slot leaked or was lost");
            let volume = pool.open_volume(1, 512 * MIB, 4096).unwrap();
            let clone = pool.open_volume(2, 512 * MIB, 4096).unwrap();
            let view = pool.open_snapshot(snapshot, 4096).unwrap();
            check(volume.clone(), view.clone(), clone.clone(), "after the crash").await;
            // Deleting the clone frees its own MiB; the snapshot, the 3 MiB
            // only it maps.
            drop((view, clone));
            pool.destroy_volume(2).await.unwrap();
            pool.destroy_snapshot(snapshot).await.unwrap();
            assert_eq!(used(&pool), (0, 16 * MIB));
            for index in 0..16 {
                assert!(
                    read_mib(&volume, index).await == expect(index, 1),
                    "MiB {index} at the end"
                );
            }
        });
    }

    /// Planning keeps owners only for the chunks a pass may move, however
    /// much the pool maps, and lists the used chunks in short holds of the
    /// allocator lock. A fast tier 95 % full of 4K blocks wants 15 chunks
    /// down; with room for 4 a pass, the plan is the 4 coldest, its owners
    /// at most their blocks, and no hold of the lock looks at more than 8
    /// chunks.
    #[test]
    fn planning_keeps_only_the_chunks_it_may_move() {
        block_on(async {
            let (_fast, _capacity, pool, volume) = two_tier_pool(23).await;
            let space = pool.tier_space();
            let mibs = space.fast_size * 95 / 100 / MIB;
            // Half the map pages stored by a checkpoint, the rest only cached.
            write_mibs(&volume, 0..mibs / 2).await;
            pool.checkpoint().await.unwrap();
            write_mibs(&volume, mibs / 2..mibs).await;
            pool.commit_quiet().await.unwrap();
            // The walk lists the map's pages a window at a time: all of
            // them, once each.
            let blocks = 512 * MIB / 4096;
            let mut windows = Vec::new();
            let mut from = Some(0);
            while let Some(start) = from {
                let (indexes, next) = pool.view_page_indexes_from(1, blocks, start, 3).unwrap();
                assert!(indexes.len() <= 3, "{indexes:?}");
                windows.extend(indexes);
                from = next;
            }
            assert_eq!(windows, pool.view_page_indexes(1, blocks).unwrap());
            assert!(windows.len() > 10, "{windows:?}");
            // Every chunk but MiBs 5, 9, 20 and 33 read: those are the coldest.
            for index in (0..mibs).filter(|i| ![5, 9, 20, 33].contains(i)) {
                touch_mib(&volume, index).await;
            }
            let settings = MigrationSettings::default();
            let space = pool.tier_space();
            let limits = PlanLimits {
                chunks: 4,
                lock_batch: 8,
            };
            let mut stats = PlanStats::default();
            let plan = pool.plan_pass(&settings, &space, limits, &mut stats).unwrap();
            let blocks_per_chunk = (MIB / 4096) as usize;
            assert!(stats.owners <= 4 * blocks_per_chunk * 2, "{stats:?}");
            assert!(stats.chunks_kept <= 2 * 4, "{stats:?}");
            assert!(stats.most_chunks_per_hold <= 8, "{stats:?}");
            assert!(stats.holds >= (mibs / 8), "{stats:?}");
            assert_eq!(plan.len(), 4, "{stats:?}");
            assert!(plan.iter().all(|c| c.to == Role::Capacity));
            let mut planned: Vec<u64> = plan
                .iter()
                .flat_map(|c| c.blocks.iter().map(|o| o.block / blocks_per_chunk as u64))
                .collect();
            planned.dedup();
            planned.sort_unstable();
            planned.dedup();
            assert_eq!(planned, vec![5, 9, 20, 33]);
            // The default bounds move it all in one pass, as before.
            let summary = pool.migrate_now().await.unwrap();
            assert!(summary.chunks_down > 4 && summary.errors == 0, "{summary:?}");
            assert!(pool.tier_space().fast_used <= space.fast_size * 70 / 100);
        });
    }

    /// A measurement, not a check (`bench/migrate_plan.py` runs it):
    /// one pass's planning over a pool of STRATA_PLAN_GIB GiB (default 4)
    /// of mapped 16 KiB blocks on sparse files in STRATA_PLAN_DIR (default
    /// a temporary directory), half of them on a fast tier filled to 90 %
    /// (above its high watermark: a demotion pass). The blocks are mapped
    /// to slots without writing their data: planning reads only maps and
    /// the allocator. Prints one `plan:` line of JSON.
    #[test]
    #[ignore = "a measurement: bench/migrate_plan.py runs it"]
    fn planning_at_scale() {
        use crate::device::file::{create_file, open_device};
        use crate::device::DeviceOptions;
        let gib: u64 = std::env::var("STRATA_PLAN_GIB").map_or(4, |v| v.parse().unwrap());
        let base = std::env::var("STRATA_PLAN_DIR").map_or_else(|_| std::env::temp_dir(), std::path::PathBuf::from);
        let dir = tempfile::tempdir_in(base).unwrap();
        let block: u64 = 16 << 10;
        let data = gib << 30;
        let fast_path = dir.path().join("fast.img");
        let capacity_path = dir.path().join("capacity.img");
        create_file(&fast_path, data / 2 + (17 << 30)).unwrap();
        create_file(&capacity_path, data).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let options = DeviceOptions::default();
            let devices = vec![
                NewDevice {
                    device: open_device(&fast_path, &options).unwrap(),
                    role: Role::Fast,
                },
                NewDevice {
                    device: open_device(&capacity_path, &options).unwrap(),
                    role: Role::Capacity,
                },
            ];
            // A map cache that holds every page: they stay dirty (no
            // checkpoint runs), and a full cache of dirty pages looks for
            // a page to evict on every load.
            let options = crate::pool::PoolOptions {
                meta_cache_bytes: 64 << 30,
                ..Default::default()
            };
            let pool = Pool::create_with("scale", 1 << 20, devices, options).await.unwrap();
            pool.set_migration_settings(MigrationSettings {
                enabled: false,
                ..MigrationSettings::default()
            })
            .unwrap();
            let space = pool.tier_space();
            let blocks = data / block;
            let on_fast = (space.fast_size * 9 / 10 / block).min(blocks);
            let _volume = pool.open_volume(1, blocks * block, block as u32).unwrap();
            let filled = Instant::now();
            let per_chunk = (1u64 << 20) / block;
            let mut next = 0;
            while next < blocks {
                let count = per_chunk.min(blocks - next);
                let slots: Vec<(u8, u64)> = {
                    let mut allocator = pool.allocator.lock_or_abort();
                    (next..next + count)
                        .map(|b| {
                            let role = if b < on_fast { Role::Fast } else { Role::Capacity };
                            allocator.allocate_in(14, role).expect("room")
                        })
                        .collect()
                };
                for (b, (device, offset)) in (next..).zip(slots) {
                    pool.set_mapping(1, b, BlockPtr::at(device, offset)).unwrap();
                }
                next += count;
            }
            let fill_seconds = filled.elapsed().as_secs_f64();
            let space = pool.tier_space();
            let settings = pool.migration_settings();
            let rss_kib = |field: &str| -> u64 {
                let status = std::fs::read_to_string("/proc/self/status").unwrap();
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
                    .unwrap()
            };
            // Peak RSS from here on (Linux: "5" resets VmHWM).
            std::fs::write("/proc/self/clear_refs", "5").unwrap();
            let before = rss_kib("VmRSS:");
            let planned = Instant::now();
            let mut stats = PlanStats::default();
            let plan = pool
                .plan_pass(&settings, &space, PlanLimits::of(pool.chunk_bytes), &mut stats)
                .unwrap();
            let plan_seconds = planned.elapsed().as_secs_f64();
            let peak = rss_kib("VmHWM:");
            let planned_bytes: u64 = plan.iter().map(|c| c.bytes).sum();
            drop(plan);
            println!(
                "plan: {{\"gib\": {gib}, \"blocks\": {blocks}, \"fill_s\": {fill_seconds:.1}, \"plan_s\": {plan_seconds:.3}, \
                 \"owners\": {}, \"chunks_kept\": {}, \"holds\": {}, \"longest_hold_us\": {}, \"mean_hold_us\": {:.1}, \
                 \"most_chunks_per_hold\": {}, \"rss_before_kib\": {before}, \"plan_peak_growth_kib\": {}, \
                 \"planned_bytes\": {planned_bytes}}}",
                stats.owners,
                stats.chunks_kept,
                stats.holds,
                stats.longest_hold.as_micros(),
                stats.total_hold.as_secs_f64() * 1e6 / stats.holds.max(1) as f64,
                stats.most_chunks_per_hold,
                peak.saturating_sub(before),
            );
        });
    }

    #[test]
    fn heat_decays_and_follows_moved_data() {
        let heat = Heat::new(4);
        for _ in 0..10 {
            heat.add(1, false, 1);
        }
        for _ in 0..6 {
            heat.add(1, true, 1);
        }
        assert_eq!(heat.score(1), 16);
        heat.decay();
        assert_eq!(heat.score(1), 8);
        assert_eq!(heat.take(1), 8);
        assert_eq!(heat.score(1), 0);
        heat.raise(2, 8);
        heat.raise(2, 3);
        assert_eq!(heat.score(2), 8);
        assert_eq!(heat.score(99), 0, "out of range is cold, not a panic");
    }
}
