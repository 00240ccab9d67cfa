//! File datasets (`strata fs`): created, listed, changed and destroyed
//! here; opened with their pool; exported over NFS through [`Exports`].

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{internal, now_unix, split_volume_name, AdminError, VolumeManager};
use crate::control::catalog::{Catalog, DatasetRecord};
use crate::fs::{ClientNet, Export, ExportOptions, Exports, FileSystem, FsError, Squash};
use crate::pool::snapshots::SnapshotInfo;
use crate::pool::Pool;

/// Dataset properties: name, default, what it means.
pub const DATASET_PROPERTIES: &[(&str, &str, &str)] = &[
    (
        "recordsize",
        "16384",
        "block size of the files' data, 4K to 128K (set at creation only)",
    ),
    (
        "quota",
        "none",
        "most bytes the dataset's files may take (none: the pool's space)",
    ),
    (
        "nfs.clients",
        "127.0.0.1/8,::1",
        "addresses (CIDR) that may mount it; * for any",
    ),
    ("nfs.ro", "off", "exported read-only"),
    (
        "nfs.squash",
        "root",
        "credentials mapped to the anonymous user: root, all or none",
    ),
    ("nfs.anonuid", "65534", "the anonymous user's uid"),
    ("nfs.anongid", "65534", "the anonymous user's gid"),
    (
        "nfs.insecure",
        "on",
        "serve clients from source ports above 1023 (the kernel client through NAT or socat)",
    ),
    (
        "snapshot.schedule",
        "off",
        "automatic snapshots and how many of each to keep, e.g. hourly:24,daily:7 (as for volumes)",
    ),
];

/// What `fs list` and `fs get` show.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DatasetInfo {
    /// `POOL/NAME`.
    pub name: String,
    /// The NFS export path, `/POOL/NAME`.
    pub export: String,
    pub id: u32,
    pub created_unix: u64,
    /// Live files and directories.
    pub files: u64,
    /// Pool bytes the files' data takes.
    pub used_bytes: u64,
    /// Every property's value (set or default).
    pub properties: BTreeMap<String, String>,
    /// The snapshot it is a clone of (`POOL/NAME@SNAPSHOT`), if it is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

/// What `fs snapshots` shows of a dataset's snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DatasetSnapshotInfo {
    /// `POOL/NAME@SNAPSHOT`.
    pub name: String,
    /// `POOL/NAME`.
    pub dataset: String,
    pub snapshot: String,
    /// Where NFS clients find it: `/POOL/NAME/.snapshot/SNAPSHOT`.
    pub path: String,
    pub created_unix: u64,
    /// Files and directories in it.
    pub files: u64,
    /// Pool bytes of data it maps.
    pub referenced_bytes: u64,
    /// What destroying it would free.
    pub used_bytes: u64,
}

/// An open dataset.
pub(super) struct OpenDataset {
    pub id: u32,
    pub fs: Arc<FileSystem>,
    pub options: ExportOptions,
}

fn on_off(key: &str, value: &str) -> Result<String, AdminError> {
    match value {
        "on" | "yes" | "true" => Ok("on".into()),
        "off" | "no" | "false" => Ok("off".into()),
        _ => Err(AdminError::Invalid(format!("{key} must be on or off, not {value:?}"))),
    }
}

/// The canonical spelling of a property value, or why it is refused.
pub fn canonical_dataset_value(key: &str, value: &str) -> Result<String, AdminError> {
    let value = value.trim();
    match key {
        "recordsize" => {
            let bytes = crate::units::parse_size(value).map_err(AdminError::Invalid)?;
            if !bytes.is_power_of_two() || !(4096..=128 << 10).contains(&bytes) {
                return Err(AdminError::Invalid(format!(
                    "recordsize must be a power of two from 4K to 128K, not {value}"
                )));
            }
            Ok(bytes.to_string())
        }
        "quota" => match value {
            "none" | "0" => Ok("none".into()),
            _ => Ok(crate::units::parse_size(value)
                .map_err(AdminError::Invalid)?
                .to_string()),
        },
        "nfs.clients" => {
            if value == "*" {
                return Ok("*".into());
            }
            let nets = value
                .split(',')
                .map(|part| ClientNet::parse(part.trim()).map(|n| n.to_string()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| AdminError::Invalid(format!("nfs.clients: {e}")))?;
            Ok(nets.join(","))
        }
        "nfs.ro" | "nfs.insecure" => on_off(key, value),
        "nfs.squash" => Squash::parse(value)
            .map(|s| s.as_str().to_string())
            .map_err(AdminError::Invalid),
        // The volume property's grammar, canonical form and messages.
        "snapshot.schedule" => {
            crate::volume::props::canonical_value(key, value).map_err(|e| AdminError::Invalid(e.to_string()))
        }
        "nfs.anonuid" | "nfs.anongid" => value
            .parse::<u32>()
            .map(|v| v.to_string())
            .map_err(|_| AdminError::Invalid(format!("{key} must be a number from 0 to 4294967295"))),
        _ => Err(AdminError::Invalid(format!(
            "unknown dataset property {key:?} (known: {})",
            DATASET_PROPERTIES.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
        ))),
    }
}

fn value<'a>(props: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    props
        .get(key)
        .map(String::as_str)
        .or_else(|| DATASET_PROPERTIES.iter().find(|p| p.0 == key).map(|p| p.1))
        .unwrap_or("")
}

fn recordsize(props: &BTreeMap<String, String>) -> u32 {
    crate::units::parse_size(value(props, "recordsize")).unwrap_or(16 << 10) as u32
}

fn quota(props: &BTreeMap<String, String>) -> u64 {
    value(props, "quota").parse().unwrap_or(0)
}

/// The export options the properties say.
pub fn export_options(props: &BTreeMap<String, String>) -> ExportOptions {
    let defaults = ExportOptions::default();
    let clients = match value(props, "nfs.clients") {
        "*" => vec![
            ClientNet::parse("0.0.0.0/0").expect("valid"),
            ClientNet::parse("::/0").expect("valid"),
        ],
        list => list
            .split(',')
            .filter_map(|n| ClientNet::parse(n.trim()).ok())
            .collect(),
    };
    ExportOptions {
        clients,
        read_only: value(props, "nfs.ro") == "on",
        squash: Squash::parse(value(props, "nfs.squash")).unwrap_or(defaults.squash),
        anon_uid: value(props, "nfs.anonuid").parse().unwrap_or(defaults.anon_uid),
        anon_gid: value(props, "nfs.anongid").parse().unwrap_or(defaults.anon_gid),
        insecure: value(props, "nfs.insecure") == "on",
    }
}

/// Splits `POOL/NAME@SNAPSHOT` into the dataset and the snapshot name.
fn split_dataset_snapshot(text: &str) -> Result<(&str, &str), AdminError> {
    let (dataset, snapshot) = text
        .split_once('@')
        .filter(|(d, s)| !d.is_empty() && !s.is_empty())
        .ok_or_else(|| AdminError::Invalid(format!("invalid snapshot name '{text}': expected POOL/NAME@SNAPSHOT")))?;
    split_volume_name(dataset)?;
    Ok((dataset, snapshot))
}

/// Adds dataset `short`'s record to pool `pool` of `catalog` (which has
/// it), with a new id.
fn add_dataset_record(
    catalog: &mut Catalog,
    pool: &str,
    short: &str,
    properties: BTreeMap<String, String>,
) -> DatasetRecord {
    let pool_record = catalog.pools.get_mut(pool).expect("the caller found the pool");
    let id = pool_record.next_volume_id.max(1);
    pool_record.next_volume_id = id + 1;
    let record = DatasetRecord {
        id,
        created_unix: now_unix(),
        properties,
    };
    pool_record.datasets.insert(short.to_string(), record.clone());
    record
}

/// Opens a dataset of an open pool.
pub(super) async fn open_dataset(pool: &Arc<Pool>, record: &DatasetRecord) -> Result<OpenDataset, AdminError> {
    let fs = FileSystem::open(
        pool,
        record.id,
        recordsize(&record.properties),
        quota(&record.properties),
    )
    .await
    .map_err(|e| internal("cannot open dataset", e))?;
    Ok(OpenDataset {
        id: record.id,
        fs,
        options: export_options(&record.properties),
    })
}

impl VolumeManager {
    fn dataset_info(&self, catalog: &Catalog, name: &str) -> Result<DatasetInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let record = catalog
            .pools
            .get(pool)
            .and_then(|p| p.datasets.get(short))
            .ok_or_else(|| AdminError::NotFound(format!("dataset '{name}' does not exist")))?;
        let (files, used_bytes) = self
            .datasets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|d| d.fs.usage())
            .unwrap_or_default();
        let properties = DATASET_PROPERTIES
            .iter()
            .map(|(key, _, _)| (key.to_string(), value(&record.properties, key).to_string()))
            .collect();
        let origin = self.pool(pool).and_then(|handle| {
            let snapshot = handle.snapshot(handle.origin_of(record.id)?)?;
            Some(self.snapshot_name(catalog, pool, &snapshot))
        });
        Ok(DatasetInfo {
            name: name.to_string(),
            export: format!("/{name}"),
            id: record.id,
            created_unix: record.created_unix,
            files,
            used_bytes,
            properties,
            origin,
        })
    }

    /// Every dataset.
    pub fn fs_list(&self) -> Vec<DatasetInfo> {
        let catalog = self.published();
        let names: Vec<String> = catalog
            .pools
            .iter()
            .flat_map(|(pool, record)| record.datasets.keys().map(move |name| format!("{pool}/{name}")))
            .collect();
        names
            .iter()
            .filter_map(|n| self.dataset_info(&catalog, n).ok())
            .collect()
    }

    pub fn fs_info(&self, name: &str) -> Result<DatasetInfo, AdminError> {
        let catalog = self.published();
        self.dataset_info(&catalog, name)
    }

    /// Creates dataset `POOL/NAME` with `properties`; exported at once.
    pub fn fs_create(&self, name: &str, properties: &[(String, String)]) -> Result<DatasetInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let mut catalog = self.catalog();
        let pool_record = catalog
            .pools
            .get(pool)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool}' does not exist")))?;
        if pool_record.datasets.contains_key(short) || pool_record.volumes.contains_key(short) {
            return Err(AdminError::AlreadyExists(format!(
                "'{name}' already exists (volumes and datasets share names)"
            )));
        }
        let mut props = BTreeMap::new();
        for (key, value) in properties {
            props.insert(key.clone(), canonical_dataset_value(key, value)?);
        }
        let pool_handle = self
            .pool(pool)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool}' is in the catalog but not open")))?;
        let mut updated = catalog.clone();
        let record = add_dataset_record(&mut updated, pool, short, props);
        // The catalog first: a crash before the root directory is logged
        // leaves a dataset that gets its root at the next open.
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        let opened = self.runtime.block_on(open_dataset(&pool_handle, &record))?;
        self.datasets
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), opened);
        self.schedule_changed.notify_one();
        self.dataset_info(&catalog, name)
    }

    /// Creates dataset `name` (`POOL/NEW`, same pool) as a writable clone
    /// of snapshot `origin` (`POOL/NAME@SNAPSHOT`): instant, its files
    /// those of the snapshot, sharing their data until they change. It
    /// takes the origin dataset's properties but its schedule;
    /// `properties` override them (`recordsize` cannot change).
    pub fn fs_clone(
        &self,
        origin: &str,
        name: &str,
        properties: &[(String, String)],
    ) -> Result<DatasetInfo, AdminError> {
        let (origin_dataset, snapshot_name) = split_dataset_snapshot(origin)?;
        let (origin_pool, origin_short) = split_volume_name(origin_dataset)?;
        let (pool, short) = split_volume_name(name)?;
        let mut catalog = self.catalog();
        let missing = || AdminError::NotFound(format!("snapshot '{origin}' does not exist"));
        let source = catalog
            .pools
            .get(origin_pool)
            .and_then(|record| record.datasets.get(origin_short))
            .ok_or_else(missing)?;
        if origin_pool != pool {
            return Err(AdminError::Invalid(format!(
                "a clone lives in its origin's pool: '{name}' is not in pool '{origin_pool}'"
            )));
        }
        let pool_record = catalog.pools.get(pool).ok_or_else(missing)?;
        if pool_record.datasets.contains_key(short) || pool_record.volumes.contains_key(short) {
            return Err(AdminError::AlreadyExists(format!(
                "'{name}' already exists (volumes and datasets share names)"
            )));
        }
        let pool_handle = self.pool(pool).ok_or_else(missing)?;
        let snapshot = pool_handle
            .snapshot_named(source.id, snapshot_name)
            .ok_or_else(missing)?;
        let mut props = source.properties.clone();
        // Like a volume's clone: a copy must not start taking (and
        // pruning) snapshots because its origin does.
        props.remove("snapshot.schedule");
        for (key, value) in properties {
            let value = canonical_dataset_value(key, value)?;
            if key == "recordsize" && value != recordsize(&props).to_string() {
                return Err(AdminError::Invalid(format!(
                    "a clone keeps its origin's recordsize ({}): it shares its data",
                    recordsize(&props)
                )));
            }
            props.insert(key.clone(), value);
        }
        let mut updated = catalog.clone();
        let record = add_dataset_record(&mut updated, pool, short, props);
        // The engine first: a crash before the catalog names the clone
        // leaves an engine clone no dataset has, removed at the next start.
        self.runtime
            .block_on(pool_handle.create_clone(record.id, snapshot.id))
            .map_err(|e| internal("cannot create the clone", e))?;
        let opened = updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))
            .and_then(|()| self.runtime.block_on(open_dataset(&pool_handle, &record)));
        let opened = match opened {
            Ok(opened) => opened,
            Err(e) => {
                if let Err(undo) = self.runtime.block_on(pool_handle.destroy_volume(record.id)) {
                    tracing::error!("clone {name} failed and could not be undone: {undo}");
                }
                return Err(e);
            }
        };
        catalog.set(updated);
        self.datasets
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), opened);
        tracing::info!("dataset {name} cloned from {origin}");
        self.dataset_info(&catalog, name)
    }

    /// Rolls dataset `POOL/NAME` back to its snapshot `POOL/NAME@SNAPSHOT`:
    /// its files become the snapshot's again, everything written since is
    /// discarded. It must be the newest snapshot, unless `destroy_newer`
    /// (`-r`), which destroys the newer ones first (refused if one has
    /// clones). NFS clients stay mounted: calls under way finish first.
    pub fn fs_rollback(&self, name: &str, destroy_newer: bool) -> Result<(), AdminError> {
        let (dataset, snapshot) = split_dataset_snapshot(name)?;
        let fs = self.open_fs(dataset)?;
        let snapshots = fs.snapshot_list();
        let target = snapshots
            .iter()
            .find(|s| s.name == snapshot)
            .ok_or_else(|| AdminError::NotFound(format!("snapshot '{name}' does not exist")))?;
        let newer: Vec<&SnapshotInfo> = snapshots.iter().filter(|s| s.generation > target.generation).collect();
        if !newer.is_empty() && !destroy_newer {
            let names: Vec<String> = newer.iter().map(|s| format!("@{}", s.name)).collect();
            return Err(AdminError::Invalid(format!(
                "more recent snapshots of '{dataset}' exist ({}): destroy them, or roll back with -r to destroy them",
                names.join(", ")
            )));
        }
        // Every newer snapshot is checked before any is destroyed: one with
        // clones refuses the whole rollback, with nothing changed.
        let (pool, _) = split_volume_name(dataset)?;
        for snapshot in &newer {
            self.refuse_if_cloned(pool, &format!("{dataset}@{}", snapshot.name), snapshot.id)?;
        }
        for snapshot in newer.iter().rev() {
            self.fs_snapshot_destroy(&format!("{dataset}@{}", snapshot.name))?;
        }
        self.runtime.block_on(fs.rollback(snapshot)).map_err(|e| match e {
            FsError::NoEnt => AdminError::NotFound(format!("snapshot '{name}' does not exist")),
            FsError::Io(message) => AdminError::Invalid(message),
            other => AdminError::Internal(format!("rolling {dataset} back: {other:?}")),
        })?;
        tracing::info!("dataset {dataset} rolled back to {name}");
        Ok(())
    }

    /// Promotes clone `POOL/NAME` (`zfs promote`): its origin snapshot and
    /// the older snapshots of the origin's dataset become its own, under
    /// the same names (NFS clients find them in its `.snapshot`), and the
    /// origin's dataset becomes a clone of that snapshot, so that it can be
    /// destroyed (its newer snapshots first) while this one keeps every
    /// file. NFS calls to both datasets wait while the maps are rearranged;
    /// clients stay mounted, and handles of files in the moved snapshots
    /// stay valid (served by this dataset from then on).
    pub fn fs_promote(&self, name: &str) -> Result<DatasetInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        // Held to the end: no other admin operation runs meanwhile.
        let catalog = self.catalog();
        let pool_record = catalog
            .pools
            .get(pool)
            .ok_or_else(|| AdminError::NotFound(format!("dataset '{name}' does not exist")))?;
        let record = pool_record
            .datasets
            .get(short)
            .ok_or_else(|| AdminError::NotFound(format!("dataset '{name}' does not exist")))?;
        let pool_handle = self
            .pool(pool)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool}' is in the catalog but not open")))?;
        let origin = pool_handle
            .origin_of(record.id)
            .and_then(|id| pool_handle.snapshot(id))
            .ok_or_else(|| {
                AdminError::Invalid(format!(
                    "dataset '{name}' is not a clone: it has no origin snapshot to take over"
                ))
            })?;
        let old_short = pool_record
            .datasets
            .iter()
            .find_map(|(n, r)| (r.id == origin.volume).then_some(n.as_str()))
            .ok_or_else(|| {
                AdminError::Internal(format!(
                    "the origin snapshot of '{name}' belongs to no dataset (id {})",
                    origin.volume
                ))
            })?;
        let old_name = format!("{pool}/{old_short}");
        let clone_fs = self.open_fs(name)?;
        let old_fs = self.open_fs(&old_name)?;
        let moving: Vec<SnapshotInfo> = old_fs
            .snapshot_list()
            .into_iter()
            .filter(|s| s.generation <= origin.generation)
            .collect();
        let own = clone_fs.snapshot_list();
        if let Some(clash) = moving.iter().find(|m| own.iter().any(|s| s.name == m.name)) {
            return Err(AdminError::Invalid(format!(
                "'{name}' has a snapshot named '{0}' like {old_name}@{0}, which the promotion would move to it: \
                 destroy {name}@{0} first",
                clash.name
            )));
        }
        let moved = self.runtime.block_on(clone_fs.promote(&old_fs)).map_err(|e| match e {
            FsError::Io(message) if message.contains("being destroyed") => {
                AdminError::Busy(format!("promoting {name}: {message}"))
            }
            FsError::Io(message) => AdminError::Invalid(format!("promoting {name}: {message}")),
            other => AdminError::Internal(format!("promoting {name}: {other:?}")),
        })?;
        debug_assert_eq!(moved.len(), moving.len());
        let names: Vec<String> = moving.iter().map(|s| format!("@{}", s.name)).collect();
        tracing::info!(
            "dataset {name} promoted: {} now its own; {old_name} is a clone of {name}@{}",
            names.join(", "),
            origin.name
        );
        // The schedule finds each dataset's snapshots anew.
        self.schedule_changed.notify_one();
        self.dataset_info(&catalog, name)
    }

    /// Sets properties (all validated first, saved in one catalog update).
    pub fn fs_set(&self, name: &str, properties: &[(String, String)]) -> Result<DatasetInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let mut changes = Vec::new();
        for (key, value) in properties {
            if key == "recordsize" {
                return Err(AdminError::Invalid(
                    "recordsize is set when a dataset is created and cannot change".into(),
                ));
            }
            changes.push((key.clone(), canonical_dataset_value(key, value)?));
        }
        let mut catalog = self.catalog();
        let mut updated = catalog.clone();
        let record = updated
            .pools
            .get_mut(pool)
            .and_then(|p| p.datasets.get_mut(short))
            .ok_or_else(|| AdminError::NotFound(format!("dataset '{name}' does not exist")))?;
        record.properties.extend(changes);
        let props = record.properties.clone();
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        if let Some(open) = self.datasets.write().unwrap_or_else(|e| e.into_inner()).get_mut(name) {
            open.options = export_options(&props);
            open.fs.set_quota(quota(&props));
        }
        self.schedule_changed.notify_one();
        self.dataset_info(&catalog, name)
    }

    /// The open dataset `POOL/NAME`.
    pub(super) fn open_fs(&self, name: &str) -> Result<Arc<FileSystem>, AdminError> {
        self.datasets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|d| d.fs.clone())
            .ok_or_else(|| AdminError::NotFound(format!("dataset '{name}' does not exist")))
    }

    fn dataset_snapshot_info(dataset: &str, fs: &FileSystem, info: &SnapshotInfo) -> DatasetSnapshotInfo {
        let recordsize = fs.recordsize() as u64;
        let used = fs
            .snapshot_space()
            .into_iter()
            .find(|(id, _, _)| *id == info.id)
            .map_or(0, |(_, used, _)| used);
        DatasetSnapshotInfo {
            name: format!("{dataset}@{}", info.name),
            dataset: dataset.to_string(),
            snapshot: info.name.clone(),
            path: format!("/{dataset}/.snapshot/{}", info.name),
            created_unix: info.created_unix,
            files: fs.snapshot_fs(info.id).map_or(0, |s| s.usage().0),
            referenced_bytes: info.mapped_blocks * recordsize,
            used_bytes: used * recordsize,
        }
    }

    /// Takes snapshot `POOL/NAME@SNAPSHOT` of a dataset: every write
    /// acknowledged before it is in it; NFS calls to the dataset wait
    /// while it is taken.
    pub fn fs_snapshot(&self, name: &str) -> Result<DatasetSnapshotInfo, AdminError> {
        let (dataset, snapshot) = split_dataset_snapshot(name)?;
        let fs = self.open_fs(dataset)?;
        let info = self.runtime.block_on(fs.snapshot(snapshot)).map_err(|e| match e {
            FsError::Io(message) if message.contains("exists") => AdminError::AlreadyExists(message),
            FsError::Io(message) => AdminError::Invalid(message),
            FsError::Inval | FsError::NameTooLong => AdminError::Invalid(format!("invalid snapshot name '{snapshot}'")),
            other => AdminError::Internal(format!("snapshot of {dataset}: {other:?}")),
        })?;
        tracing::info!("snapshot {name} taken");
        Ok(Self::dataset_snapshot_info(dataset, &fs, &info))
    }

    /// The snapshots of dataset `POOL/NAME`, or of every dataset.
    pub fn fs_snapshots(&self, dataset: Option<&str>) -> Result<Vec<DatasetSnapshotInfo>, AdminError> {
        let open: Vec<(String, Arc<FileSystem>)> = match dataset {
            Some(name) => vec![(name.to_string(), self.open_fs(name)?)],
            None => {
                let datasets = self.datasets.read().unwrap_or_else(|e| e.into_inner());
                let mut all: Vec<(String, Arc<FileSystem>)> =
                    datasets.iter().map(|(name, d)| (name.clone(), d.fs.clone())).collect();
                all.sort_by(|a, b| a.0.cmp(&b.0));
                all
            }
        };
        Ok(open
            .iter()
            .flat_map(|(name, fs)| {
                fs.snapshot_list()
                    .into_iter()
                    .map(|info| Self::dataset_snapshot_info(name, fs, &info))
                    .collect::<Vec<_>>()
            })
            .collect())
    }

    /// Busy, naming the clones, if snapshot `name` (engine id `id`) of a
    /// dataset in `pool` has any.
    fn refuse_if_cloned(&self, pool: &str, name: &str, id: u32) -> Result<(), AdminError> {
        let Some(pool_handle) = self.pool(pool) else {
            return Ok(());
        };
        let clones: Vec<u32> = pool_handle
            .clones()
            .into_iter()
            .filter(|(_, origin)| *origin == id)
            .map(|(clone, _)| clone)
            .collect();
        if clones.is_empty() {
            return Ok(());
        }
        Err(AdminError::Busy(format!(
            "snapshot '{name}' has clones ({}): promote them (strata fs promote CLONE) or destroy them first",
            Self::clone_names(&self.catalog(), pool, &clones)
        )))
    }

    /// Destroys snapshot `POOL/NAME@SNAPSHOT`: calls in its files finish
    /// first; clients still using it get NFS3ERR_STALE.
    pub fn fs_snapshot_destroy(&self, name: &str) -> Result<(), AdminError> {
        let (dataset, snapshot) = split_dataset_snapshot(name)?;
        let fs = self.open_fs(dataset)?;
        let (pool, _) = split_volume_name(dataset)?;
        if let Some(info) = fs.snapshot_list().into_iter().find(|s| s.name == snapshot) {
            self.refuse_if_cloned(pool, name, info.id)?;
        }
        self.runtime
            .block_on(fs.destroy_snapshot(snapshot))
            .map_err(|e| match e {
                FsError::NoEnt => AdminError::NotFound(format!("snapshot '{name}' does not exist")),
                other => AdminError::Internal(format!("destroying {name}: {other:?}")),
            })?;
        tracing::info!("snapshot {name} destroyed");
        Ok(())
    }

    /// Destroys a dataset: its files, directories and data (refused while
    /// it has snapshots). Calls under way finish first; clients that still
    /// use it get NFS3ERR_STALE. `POOL/NAME@SNAPSHOT` destroys a snapshot.
    pub fn fs_destroy(&self, name: &str) -> Result<(), AdminError> {
        if name.contains('@') {
            return self.fs_snapshot_destroy(name);
        }
        let (pool, short) = split_volume_name(name)?;
        if let Ok(fs) = self.open_fs(name) {
            let snapshots = fs.snapshot_list();
            if !snapshots.is_empty() {
                return Err(AdminError::Busy(format!(
                    "dataset '{name}' has {} snapshot(s): destroy them first (strata fs destroy {name}@{})",
                    snapshots.len(),
                    snapshots[0].name
                )));
            }
        }
        let mut catalog = self.catalog();
        let mut updated = catalog.clone();
        let record = updated
            .pools
            .get_mut(pool)
            .and_then(|p| p.datasets.remove(short))
            .ok_or_else(|| AdminError::NotFound(format!("dataset '{name}' does not exist")))?;
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        let open = self.datasets.write().unwrap_or_else(|e| e.into_inner()).remove(name);
        if let Some(open) = open {
            // Calls under way finish before the data goes.
            self.runtime.block_on(open.fs.retire());
        }
        if let Some(pool_handle) = self.pool(pool) {
            if let Err(e) = self.runtime.block_on(pool_handle.destroy_volume(record.id)) {
                tracing::error!("dataset {name} destroyed but freeing its data failed: {e}");
            }
        }
        Ok(())
    }
}

impl Exports for VolumeManager {
    fn by_path(&self, path: &str) -> Option<Export> {
        let name = path.trim_end_matches('/').strip_prefix('/')?;
        let datasets = self.datasets.read().unwrap_or_else(|e| e.into_inner());
        let open = datasets.get(name)?;
        Some(Export {
            path: format!("/{name}"),
            fs: open.fs.clone(),
            options: open.options.clone(),
        })
    }

    fn by_dataset(&self, pool: u64, dataset: u32) -> Option<Export> {
        let datasets = self.datasets.read().unwrap_or_else(|e| e.into_inner());
        // Ids are per pool: the handle's pool tag picks the pool.
        let in_pool = datasets
            .iter()
            .filter(|(_, open)| pool == 0 || open.fs.pool_tag() == pool);
        let mut found: Vec<Export> = if crate::pool::snapshots::is_snapshot_id(dataset) {
            // A snapshot: read-only whatever its dataset's options say.
            in_pool
                .filter_map(|(name, open)| {
                    let fs = open.fs.snapshot_fs(dataset)?;
                    Some(Export {
                        path: format!("/{name}/.snapshot"),
                        fs,
                        options: ExportOptions {
                            read_only: true,
                            ..open.options.clone()
                        },
                    })
                })
                .collect()
        } else {
            in_pool
                .filter(|(_, d)| d.id == dataset)
                .map(|(name, open)| Export {
                    path: format!("/{name}"),
                    fs: open.fs.clone(),
                    options: open.options.clone(),
                })
                .collect()
        };
        // One pool's dataset or snapshot of that id: it. More (only a
        // first-version handle, without a pool, can match several): none,
        // the handle is stale rather than served by the wrong dataset.
        match found.len() {
            1 => found.pop(),
            _ => None,
        }
    }

    fn all(&self) -> Vec<Export> {
        let datasets = self.datasets.read().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<Export> = datasets
            .iter()
            .map(|(name, open)| Export {
                path: format!("/{name}"),
                fs: open.fs.clone(),
                options: open.options.clone(),
            })
            .collect();
        all.sort_by(|a, b| a.path.cmp(&b.path));
        all
    }
}
