//! What the retention scheduler (`control/retention.rs`) needs from the
//! manager: the volumes with a `snapshot.schedule`, each with its snapshots
//! and what holds them, and a wake-up when a schedule may have changed.

use super::*;

/// A volume with a schedule, as the scheduler plans from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledVolume {
    /// `pool/volume`
    pub volume: String,
    /// The property's canonical value (never `off`).
    pub schedule: String,
    /// Its snapshots, oldest first.
    pub snapshots: Vec<ScheduledSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSnapshot {
    /// The snapshot's own name (after the `@`).
    pub name: String,
    /// Clones depend on it: the engine refuses to delete it.
    pub has_clones: bool,
    /// Clients of its read-only export.
    pub connections: usize,
}

impl VolumeManager {
    /// The volumes whose `snapshot.schedule` is set and not `off`, by name.
    /// Costs a look at the catalog and the pools' snapshot lists (in
    /// memory): cheap enough for every round of the scheduler.
    pub fn scheduled_volumes(&self) -> Vec<ScheduledVolume> {
        let catalog = self.catalog();
        let mut scheduled = Vec::new();
        for (pool_name, pool_record) in &catalog.pools {
            let wanted: Vec<(&String, &VolumeRecord, &String)> = pool_record
                .volumes
                .iter()
                .filter_map(|(name, record)| {
                    let schedule = record.props.local.get("snapshot.schedule")?;
                    (!schedule.is_empty() && schedule != "off").then_some((name, record, schedule))
                })
                .collect();
            if wanted.is_empty() {
                continue;
            }
            let Some(pool) = self.pool(pool_name) else { continue };
            let snapshots = pool.snapshots();
            let origins: std::collections::HashSet<u32> = pool.clones().into_iter().map(|(_, o)| o).collect();
            for (name, record, schedule) in wanted {
                let volume = full_name(pool_name, name);
                let snapshots = snapshots
                    .iter()
                    .filter(|s| s.volume == record.id)
                    .map(|s| ScheduledSnapshot {
                        name: s.name.clone(),
                        has_clones: origins.contains(&s.id),
                        connections: self
                            .open_snapshot_view(&format!("{volume}@{}", s.name))
                            .map_or(0, |v| v.open_handles()),
                    })
                    .collect();
                scheduled.push(ScheduledVolume {
                    volume,
                    schedule: schedule.clone(),
                    snapshots,
                });
            }
        }
        scheduled
    }

    /// Woken (one stored permit) whenever a volume is created or its
    /// properties change, so a new schedule takes effect at once.
    pub fn schedule_changed(&self) -> &tokio::sync::Notify {
        &self.schedule_changed
    }
}
