//! What the retention scheduler (`control/retention.rs`) needs from the
//! manager: the volumes and file datasets with a `snapshot.schedule`, each
//! with its snapshots and what holds them; the calls that take and delete
//! their snapshots; and a wake-up when a schedule may have changed.

use std::collections::BTreeMap;

use super::*;

/// What kind of object a schedule is set on: the scheduler plans the same
/// way for both and only the calls that take and delete snapshots differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduledKind {
    Volume,
    Dataset,
}

/// A volume or dataset with a schedule, as the scheduler plans from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledObject {
    pub kind: ScheduledKind,
    /// `pool/name`
    pub name: String,
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
    /// Clients of its read-only export (volumes only: see
    /// [`VolumeManager::scheduled_datasets`]).
    pub connections: usize,
}

/// The schedule of a property map, unless unset or `off`.
fn active_schedule(props: &BTreeMap<String, String>) -> Option<&String> {
    props
        .get("snapshot.schedule")
        .filter(|schedule| !schedule.is_empty() && *schedule != "off")
}

impl VolumeManager {
    /// The volumes and datasets whose `snapshot.schedule` is set and not
    /// `off`: volumes first, each kind by name. Costs a look at the catalog
    /// and the snapshot lists (in memory): cheap enough for every round of
    /// the scheduler.
    pub fn scheduled_objects(&self) -> Vec<ScheduledObject> {
        let mut scheduled = self.scheduled_volumes();
        scheduled.extend(self.scheduled_datasets());
        scheduled
    }

    fn scheduled_volumes(&self) -> Vec<ScheduledObject> {
        let catalog = self.catalog();
        let mut scheduled = Vec::new();
        for (pool_name, pool_record) in &catalog.pools {
            let wanted: Vec<(&String, &VolumeRecord, &String)> = pool_record
                .volumes
                .iter()
                .filter_map(|(name, record)| Some((name, record, active_schedule(&record.props.local)?)))
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
                scheduled.push(ScheduledObject {
                    kind: ScheduledKind::Volume,
                    name: volume,
                    schedule: schedule.clone(),
                    snapshots,
                });
            }
        }
        scheduled
    }

    /// The scheduled datasets that are open (a dataset whose pool is not
    /// open has no snapshot list to plan from).
    ///
    /// No dataset snapshot is held for its readers: NFSv3 is stateless, so
    /// the server cannot know a client still reads one (it has no opens and
    /// no connection per export), and destroying it is safe (calls under way
    /// finish first, later ones get NFS3ERR_STALE). Holding one that was
    /// read lately would let a client that lists `.snapshot` now and then
    /// keep every automatic snapshot past its keep count.
    fn scheduled_datasets(&self) -> Vec<ScheduledObject> {
        let catalog = self.catalog();
        let mut scheduled = Vec::new();
        for (pool_name, pool_record) in &catalog.pools {
            for (name, record) in &pool_record.datasets {
                let Some(schedule) = active_schedule(&record.properties) else {
                    continue;
                };
                let dataset = full_name(pool_name, name);
                let Ok(fs) = self.open_fs(&dataset) else { continue };
                let origins: std::collections::HashSet<u32> = self
                    .pool(pool_name)
                    .map(|pool| pool.clones().into_iter().map(|(_, origin)| origin).collect())
                    .unwrap_or_default();
                let snapshots = fs
                    .snapshot_list()
                    .into_iter()
                    .map(|s| ScheduledSnapshot {
                        has_clones: origins.contains(&s.id),
                        name: s.name,
                        connections: 0,
                    })
                    .collect();
                scheduled.push(ScheduledObject {
                    kind: ScheduledKind::Dataset,
                    name: dataset,
                    schedule: schedule.clone(),
                    snapshots,
                });
            }
        }
        scheduled
    }

    /// Takes snapshot `POOL/NAME@SNAPSHOT` of a scheduled object.
    pub fn take_scheduled_snapshot(&self, kind: ScheduledKind, full: &str) -> Result<(), AdminError> {
        match kind {
            ScheduledKind::Volume => self.create_snapshots(std::slice::from_ref(&full.to_string())).map(drop),
            ScheduledKind::Dataset => self.fs_snapshot(full).map(drop),
        }
    }

    /// Deletes snapshot `POOL/NAME@SNAPSHOT` of a scheduled object.
    pub fn delete_scheduled_snapshot(&self, kind: ScheduledKind, full: &str) -> Result<(), AdminError> {
        match kind {
            ScheduledKind::Volume => self.delete_snapshot(full),
            ScheduledKind::Dataset => self.fs_snapshot_destroy(full),
        }
    }

    /// Woken (one stored permit) whenever a volume or dataset is created or
    /// its properties change, so a new schedule takes effect at once.
    pub fn schedule_changed(&self) -> &tokio::sync::Notify {
        &self.schedule_changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Volumes and datasets with a schedule are listed with their kind, their
    /// canonical schedule and their snapshots; those without one, or with
    /// `off`, are not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scheduled_objects_lists_volumes_and_datasets_with_a_schedule() {
        let dir = tempfile::tempdir().unwrap();
        let manager = Arc::new(VolumeManager::open(dir.path()).await.unwrap());
        let m = manager.clone();
        tokio::task::spawn_blocking(move || {
            m.create(
                "default/db",
                16 << 20,
                &props(&[("snapshot.schedule", "daily:7, hourly:24")]),
            )
            .unwrap();
            m.create("default/plain", 16 << 20, &[]).unwrap();
            m.fs_create("default/home", &props(&[("snapshot.schedule", " daily:2 ,hourly:3")]))
                .unwrap();
            m.fs_create("default/scratch", &props(&[("snapshot.schedule", "off")]))
                .unwrap();
            m.fs_create("default/later", &[]).unwrap();
            m.fs_snapshot("default/home@by-hand").unwrap();
            m.take_scheduled_snapshot(ScheduledKind::Dataset, "default/home@auto-2026-11-25T090000Z-hourly")
                .unwrap();
            assert_eq!(
                m.scheduled_objects(),
                vec![
                    ScheduledObject {
                        kind: ScheduledKind::Volume,
                        name: "default/db".into(),
                        schedule: "hourly:24,daily:7".into(),
                        snapshots: vec![],
                    },
                    ScheduledObject {
                        kind: ScheduledKind::Dataset,
                        name: "default/home".into(),
                        schedule: "hourly:3,daily:2".into(),
                        snapshots: ["by-hand", "auto-2026-11-25T090000Z-hourly"]
                            .into_iter()
                            .map(|name| ScheduledSnapshot {
                                name: name.into(),
                                has_clones: false,
                                connections: 0,
                            })
                            .collect(),
                    },
                ]
            );

            // Setting the property adds the dataset, `off` takes it away.
            m.fs_set("default/later", &props(&[("snapshot.schedule", "2s:3")]))
                .unwrap();
            m.fs_set("default/home", &props(&[("snapshot.schedule", "off")]))
                .unwrap();
            let listed: Vec<(ScheduledKind, String)> =
                m.scheduled_objects().into_iter().map(|o| (o.kind, o.name)).collect();
            assert_eq!(
                listed,
                [
                    (ScheduledKind::Volume, "default/db".to_string()),
                    (ScheduledKind::Dataset, "default/later".to_string()),
                ]
            );

            // The scheduler deletes through the same call for either kind.
            m.delete_scheduled_snapshot(ScheduledKind::Dataset, "default/home@auto-2026-11-25T090000Z-hourly")
                .unwrap();
            assert!(matches!(
                m.delete_scheduled_snapshot(ScheduledKind::Dataset, "default/home@auto-2026-11-25T090000Z-hourly"),
                Err(AdminError::NotFound(_))
            ));
            let left: Vec<String> = m
                .fs_snapshots(Some("default/home"))
                .unwrap()
                .into_iter()
                .map(|s| s.snapshot)
                .collect();
            assert_eq!(left, ["by-hand"]);
        })
        .await
        .unwrap();
    }

    /// The dataset property takes exactly the volume property's values, in
    /// its canonical spelling, and refuses what it refuses with its message.
    #[test]
    fn dataset_schedule_is_validated_as_the_volume_property() {
        use crate::volume::props::canonical_value;
        for text in ["daily:7, hourly:24", "", "off", "2s:3", " weekly:4 "] {
            assert_eq!(
                canonical_dataset_value("snapshot.schedule", text).unwrap(),
                canonical_value("snapshot.schedule", text.trim()).unwrap(),
                "{text:?}"
            );
        }
        for text in ["hourly:0", "fortnightly:2", "hourly:2,hourly:3", "daily"] {
            let volume = canonical_value("snapshot.schedule", text).unwrap_err().to_string();
            match canonical_dataset_value("snapshot.schedule", text) {
                Err(AdminError::Invalid(message)) => assert_eq!(message, volume),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }
}
