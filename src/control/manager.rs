//! The volume manager: opens the data directory, keeps the catalog, the
//! pools and the open volumes, and carries out admin operations (create,
//! set, resize, delete here; snapshots, clones, send and receive, file
//! datasets, pool properties and what the retention scheduler needs in the
//! submodules). Frontends look volumes up here once per connection; the
//! data path never takes the manager's locks.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use super::catalog::{sync_dir, Catalog, DeviceRecord, PoolRecord, VolumeRecord};
use crate::device::{create_file, open_device, DeviceOptions};
use crate::device::{Device, DeviceError, DeviceWraps};
use crate::pool::migrate::MigrationStatus;
use crate::pool::ram::{self, RamSource, MIN_RAM_BYTES};
use crate::pool::superblock::Role;
use crate::pool::volume::EngineVolume;
use crate::pool::{DeviceStatus, NewDevice, NewVdev, Pool, PoolError, PoolOptions, DEFAULT_CHUNK_BYTES};
use crate::volume::props::{
    canonical_value, IscsiAccess, IscsiAuthMode, PropError, PropertyRow, StoredProps, DEFAULT_VOLBLOCKSIZE,
};
use crate::volume::{full_name, ServedVolume};

mod clones;
mod datasets;
mod pool_props;
mod removal;
mod retention;
mod scrub;
pub use scrub::{next_scrub_due, ScrubAction, SCHEDULE_EVERY, SCRUB_FILE};
mod send;
mod snapshots;
pub use datasets::{canonical_dataset_value, DatasetInfo, DatasetSnapshotInfo, DATASET_PROPERTIES};
pub use pool_props::{canonical_pool_value, format_window, migration_settings, pool_rows, POOL_PROPERTY_NAMES};
pub use retention::{ScheduledKind, ScheduledObject, ScheduledSnapshot};
pub use send::{ReceiveOutcome, ReceiveStatus, ResumeToken, SendJob};
pub use snapshots::{split_snapshot_name, SnapshotView};

pub const DEFAULT_POOL: &str = "default";
pub const DEFAULT_VOLUME: &str = "vol0";
pub const DEFAULT_DATASET: &str = "files";
pub const DEFAULT_VOLUME_BYTES: u64 = 10 << 30;
/// The embedded default pool's sparse device files (they cost nothing until written).
pub const DEFAULT_FAST_BYTES: u64 = 16 << 30;
pub const DEFAULT_CAPACITY_BYTES: u64 = 64 << 30;
const LOCK_FILE: &str = "lock";
const MAX_NAME_BYTES: usize = 200;

/// Why an admin operation failed; the REST API maps each kind to a status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Internal(String),
    /// The pool has no space for what the call writes (HTTP 507).
    #[error("{0}")]
    NoSpace(String),
    /// A device of the pool failed a read or write (HTTP 503).
    #[error("{0}")]
    Io(String),
}

impl From<PropError> for AdminError {
    fn from(error: PropError) -> Self {
        AdminError::Invalid(error.to_string())
    }
}

/// What `volume list` and `volume get` show.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VolumeInfo {
    /// `pool/name`.
    pub name: String,
    pub pool: String,
    pub volsize: u64,
    pub volblocksize: u32,
    /// Bytes of storage allocated to the volume.
    pub used_bytes: u64,
    /// Open frontend handles (NBD connections).
    pub connections: usize,
    pub properties: Vec<PropertyRow>,
}

/// What `pool status` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolStatus {
    pub name: String,
    pub uuid: String,
    /// `ONLINE`, or `DEGRADED` while a mirror serves without one of its
    /// devices (every block still readable).
    #[serde(default = "online")]
    pub state: String,
    /// What to do about a degraded pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    pub chunk_bytes: u32,
    pub volumes: usize,
    /// Sum of all volume sizes (thin: may exceed the space available).
    pub provisioned_bytes: u64,
    /// Data capacity: the sum of the fast and capacity tiers.
    pub size_bytes: u64,
    pub used_bytes: u64,
    pub available_bytes: u64,
    /// Committed to be freed (a deleted snapshot or volume), not free yet:
    /// counted in `used_bytes` until the background freer reaches it.
    #[serde(default)]
    pub freeing_bytes: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    pub checksum_errors: u64,
    /// Corrupt metadata met since the daemon started (map or checksum
    /// pages that failed their checks, references to missing devices):
    /// each failed the request that met it with EIO.
    #[serde(default)]
    pub metadata_errors: u64,
    /// Chunks with parts not yet read back after a crash (a write may have
    /// been in flight there).
    pub suspect_chunks: usize,
    /// Since the daemon started: volume data written to devices, and
    /// metadata written (log and checkpoints) — their ratio is the
    /// metadata overhead.
    pub data_bytes_written: u64,
    pub metadata_bytes_written: u64,
    /// Intent-log commits that wrote records since the daemon started, and
    /// the records they wrote (records / commits: the group-commit batch).
    #[serde(default)]
    pub log_commits: u64,
    #[serde(default)]
    pub log_records: u64,
    /// Flushes of the data devices since the daemon started (a commit
    /// needs one when data was written in place since the last).
    #[serde(default)]
    pub data_flushes: u64,
    /// Of those, the ones log commits made under their lock (synchronous
    /// writers wait for them); the others are the destager's.
    #[serde(default)]
    pub commit_data_flushes: u64,
    /// Synchronous writes that waited for room in the intent log, and how
    /// long they waited in all (µs, summed over the writers).
    #[serde(default)]
    pub log_room_waits: u64,
    #[serde(default)]
    pub log_room_wait_micros: u64,
    /// Times a writer found the pool's allocator lock held, and the waits
    /// summed (µs); the same for the intent log's pending-records lock.
    /// Both are shared by all the pool's volumes.
    #[serde(default)]
    pub allocator_lock_waits: u64,
    #[serde(default)]
    pub allocator_lock_wait_micros: u64,
    #[serde(default)]
    pub log_lock_waits: u64,
    #[serde(default)]
    pub log_lock_wait_micros: u64,
    /// The block-map and checksum page caches: pages cached, the most they
    /// hold (a quarter of the pool's RAM, half each), and pages read from
    /// the metadata store because they were not cached.
    #[serde(default)]
    pub meta_cache: MetaCacheStatus,
    pub cache: PoolCacheStatus,
    pub devices: Vec<DeviceStatus>,
    /// The fast and capacity tiers' totals (their devices' data space).
    #[serde(default)]
    pub tiers: PoolTiers,
    /// Automatic tiering: settings, the pass under way, totals since start.
    #[serde(default)]
    pub migration: MigrationStatus,
    /// The scrub under way, or the last one (`pool scrub`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scrub: Option<crate::pool::ScrubStatus>,
    /// When the next scheduled scrub is due (unix seconds; pool property
    /// `scrub.interval`); absent while one is under way or paused, or when
    /// `scrub.interval=off`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_scrub_unix: Option<u64>,
}

/// Space of one tier: the sum of its devices'.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TierSpace {
    /// Data capacity of the tier's devices.
    pub size_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
}

/// The data tiers of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolTiers {
    pub fast: TierSpace,
    pub capacity: TierSpace,
}

impl PoolTiers {
    /// Totals by role of `devices` (log devices hold no data: left out).
    pub fn of(devices: &[DeviceStatus]) -> PoolTiers {
        let space = |role: Role| {
            let mut tier = TierSpace::default();
            for device in devices.iter().filter(|d| d.role == role) {
                tier.size_bytes += device.data_bytes;
                tier.used_bytes += device.used_bytes;
            }
            tier.free_bytes = tier.size_bytes.saturating_sub(tier.used_bytes);
            tier
        };
        PoolTiers {
            fast: space(Role::Fast),
            capacity: space(Role::Capacity),
        }
    }
}

/// The pool's RAM: the write-back cache (dirty data in the RAM tier) and
/// the read cache. Counters run since the daemon started.
/// A pool's block-map and checksum page caches ([`PoolStatus::meta_cache`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetaCacheStatus {
    pub map_pages: u64,
    pub map_max_pages: u64,
    pub map_misses: u64,
    pub crc_pages: u64,
    pub crc_max_pages: u64,
    pub crc_misses: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolCacheStatus {
    /// Written data held in the RAM tier, not yet at its place on a device.
    pub dirty_bytes: u64,
    /// The RAM tier's size: the bound on dirty data (writers wait beyond it).
    pub dirty_max_bytes: u64,
    /// Pool space promised to dirty data whose blocks are not placed yet
    /// (counted in the pool's `used_bytes`).
    pub reserved_bytes: u64,
    pub written_bytes: u64,
    /// Written bytes that went to the intent log (synchronous writes, flushes).
    pub logged_bytes: u64,
    pub destaged_bytes: u64,
    /// Writes that waited for RAM (backpressure).
    pub stalls: u64,
    pub read_cache_bytes: u64,
    pub read_cache_max_bytes: u64,
    pub read_hits: u64,
    pub read_misses: u64,
    /// Where the RAM tier lives: its file (in /dev/shm, or the pool's
    /// directory), or "heap".
    #[serde(default)]
    pub ram_tier: String,
}

pub struct VolumeManager {
    data_dir: PathBuf,
    /// Serialises the admin operations that change something, and holds
    /// the catalog as last saved. They may hold it for as long as the
    /// engine's work takes (a volume or snapshot delete, a rollback), so
    /// tasks on the runtime and read-only admin calls (status, list, get,
    /// metrics) never take it: they read `published`.
    catalog: Mutex<Catalog>,
    /// A copy of the catalog as last saved, replaced (never held for long)
    /// each time it changes: what frontends read when admitting clients,
    /// and what read-only admin calls show.
    published: RwLock<Arc<Catalog>>,
    volumes: RwLock<HashMap<String, Arc<ServedVolume>>>,
    engines: RwLock<HashMap<String, Arc<EngineVolume>>>,
    pools: RwLock<HashMap<String, Arc<Pool>>>,
    /// Open file datasets, by `pool/name`.
    datasets: RwLock<HashMap<String, datasets::OpenDataset>>,
    /// Runs pool work from admin calls (which run on blocking threads).
    runtime: tokio::runtime::Handle,
    /// Wrappers stacked on chosen devices as they are opened (`--wrap`).
    wraps: DeviceWraps,
    /// Read-only volumes of snapshots opened for exports, by `pool/vol@snap`.
    snapshot_views: Mutex<HashMap<String, snapshots::Export>>,
    /// Wakes the retention scheduler when a `snapshot.schedule` may have changed.
    schedule_changed: tokio::sync::Notify,
    /// Every request measured, for the heat maps and `strata iostat`.
    analytics: Arc<crate::analytics::Analytics>,
    /// Held open (and `flock`ed) so a second daemon on the same directory is refused.
    _lock: File,
}

/// The catalog held by one admin operation. It changes only through
/// [`CatalogGuard::set`] (after the new catalog is saved), which publishes
/// the copy the frontends read.
struct CatalogGuard<'a> {
    saved: std::sync::MutexGuard<'a, Catalog>,
    published: &'a RwLock<Arc<Catalog>>,
}

impl CatalogGuard<'_> {
    fn set(&mut self, saved: Catalog) {
        *self.published.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(saved.clone());
        *self.saved = saved;
    }
}

impl std::ops::Deref for CatalogGuard<'_> {
    type Target = Catalog;
    fn deref(&self) -> &Catalog {
        &self.saved
    }
}

pub(crate) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Checks one component of `pool/name`.
pub fn validate_component(kind: &str, text: &str) -> Result<(), AdminError> {
    let valid = !text.is_empty()
        && text.len() <= MAX_NAME_BYTES
        && text.as_bytes()[0].is_ascii_alphanumeric()
        && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(AdminError::Invalid(format!(
            "invalid {kind} name '{text}': use 1-{MAX_NAME_BYTES} letters, digits, '_', '-', '.', ':', starting with a letter or digit"
        )))
    }
}

/// Splits `pool/name` and validates both parts.
pub fn split_volume_name(text: &str) -> Result<(&str, &str), AdminError> {
    let (pool, name) = text
        .split_once('/')
        .ok_or_else(|| AdminError::Invalid(format!("invalid volume name '{text}': expected POOL/NAME")))?;
    validate_component("pool", pool)?;
    validate_component("volume", name)?;
    Ok((pool, name))
}

fn internal(context: &str, error: impl std::fmt::Display) -> AdminError {
    AdminError::Internal(format!("{context}: {error}"))
}

impl VolumeManager {
    /// Opens the data directory, creating the default pool and volume the
    /// first time, and recovers every pool (log replay) before returning.
    pub async fn open(data_dir: &Path) -> Result<Self, AdminError> {
        Self::open_with_wraps(data_dir, DeviceWraps::default()).await
    }

    /// [`VolumeManager::open`], stacking `wraps` on the devices they name
    /// (at this open and for devices added later). A wrap that names no
    /// device of any pool is refused: a mistyped path would otherwise
    /// quietly benchmark the bare device.
    pub async fn open_with_wraps(data_dir: &Path, wraps: DeviceWraps) -> Result<Self, AdminError> {
        make_private_dir(data_dir)?;
        let lock = lock_data_dir(data_dir)?;
        let catalog_path = data_dir.join(crate::control::catalog::CATALOG_FILE);
        if catalog_path.exists() {
            crate::private::tighten(&catalog_path).map_err(AdminError::Internal)?;
        }
        let mut catalog = match Catalog::load(data_dir).map_err(AdminError::Internal)? {
            Some(catalog) => catalog,
            None => initialise(data_dir, &wraps).await?,
        };
        let paths: Vec<&Path> = catalog
            .pools
            .values()
            .flat_map(|p| p.devices.iter().chain(&p.adding).chain(&p.attaching))
            .map(|d| Path::new(&d.path))
            .collect();
        if let Some(path) = wraps.unmatched(&paths).first() {
            return Err(AdminError::Invalid(format!(
                "--wrap names {}, which is not a device of any pool (devices: {})",
                path.display(),
                paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut volumes = HashMap::new();
        let mut engines = HashMap::new();
        let mut pools = HashMap::new();
        let mut open_datasets = HashMap::new();
        let mut settled = catalog.clone();
        let mut forgotten: Vec<(Arc<Pool>, Arc<dyn Device>)> = Vec::new();
        for (pool_name, record) in &catalog.pools {
            let OpenedPool {
                pool,
                joined,
                attached,
                unopened,
                removed,
            } = open_pool(data_dir, pool_name, record, &wraps).await?;
            let mut gone = Vec::new();
            if let Some(settled) = settled.pools.get_mut(pool_name) {
                // An attach that did not finish, settled the same way.
                if let Some(attaching) = settled.attaching.take() {
                    if attached {
                        tracing::warn!(
                            "pool {pool_name}: device {} was being attached when strata stopped; it is part of \
                             the pool and is resilvered",
                            attaching.path
                        );
                        settled.devices.push(attaching);
                    } else {
                        tracing::warn!(
                            "pool {pool_name}: device {} was being attached when strata stopped, before its \
                             superblock was written; it is not part of the pool",
                            attaching.path
                        );
                    }
                }
                gone = forget_detached(pool_name, &pool, settled, &unopened);
                // A removal that ended between its superblocks and the catalog.
                if !removed.is_empty() {
                    tracing::warn!(
                        "pool {pool_name}: {} removed from the pool before strata stopped; dropped from the catalog",
                        removed.join(", ")
                    );
                    settled.devices.retain(|d| !removed.contains(&d.path));
                }
            }
            // An addition that did not finish is settled now, one way or the other.
            if let (Some(adding), Some(settled)) = (&record.adding, settled.pools.get_mut(pool_name)) {
                settled.adding = None;
                if joined {
                    tracing::warn!(
                        "pool {pool_name}: completed the interrupted addition of device {}",
                        adding.path
                    );
                    settled.devices.push(adding.clone());
                } else {
                    tracing::warn!(
                        "pool {pool_name}: device {} was being added when strata stopped; the addition had not \
                         reached the pool's superblocks, so the device is not part of the pool",
                        adding.path
                    );
                }
            }
            forgotten.extend(gone.into_iter().map(|device| (pool.clone(), device)));
            clones::remove_unnamed_clones(pool_name, &pool, record).await;
            pool_props::apply_at_open(pool_name, &pool, &record.properties);
            for (name, volume) in &record.volumes {
                pool.set_tier_pin(volume.id, pool_props::tier_pin(&volume.props));
                let props = volume.props.effective();
                let engine = pool
                    .open_volume(volume.id, props.volsize, props.volblocksize)
                    .map_err(|e| internal(&format!("cannot open volume {pool_name}/{name}"), e))?;
                // A volume being received is not exported until the receive ends.
                if volume.receiving.is_none() {
                    let opened = ServedVolume::new(pool_name, name, engine.clone(), &props);
                    volumes.insert(full_name(pool_name, name), Arc::new(opened));
                }
                engines.insert(full_name(pool_name, name), engine);
            }
            for (name, record) in &record.datasets {
                let opened = datasets::open_dataset(&pool, record)
                    .await
                    .map_err(|e| internal(&format!("cannot open dataset {pool_name}/{name}"), e))?;
                open_datasets.insert(full_name(pool_name, name), opened);
            }
            if pool.suspect_chunks() > 0 {
                let scrubbing = pool.clone();
                tokio::spawn(async move {
                    match scrubbing.scrub_suspect().await {
                        Ok(report) => tracing::info!(
                            "pool {}: read back {} blocks written when it stopped: {} sectors repaired, {} blocks \
                             failed to verify; {} chunks keep suspect parts no volume maps",
                            scrubbing.name(),
                            report.blocks,
                            report.repaired,
                            report.failed,
                            report.left
                        ),
                        Err(e) => tracing::error!("pool {}: scrub after a crash failed: {e}", scrubbing.name()),
                    }
                });
            }
            pools.insert(pool_name.clone(), pool);
        }
        if settled != catalog {
            match settled.save(data_dir) {
                Ok(()) => {
                    catalog = settled;
                    // Out of the catalog: their superblocks may go now.
                    for (pool, device) in forgotten {
                        if let Err(e) = pool.forget_device(&device).await {
                            tracing::warn!("{}: cannot clear its superblocks: {e}", device.info().name);
                        }
                    }
                }
                // The next start settles it again, the same way.
                Err(e) => tracing::error!("cannot save the catalog after settling a device change: {e}"),
            }
        }
        let manager = VolumeManager {
            data_dir: data_dir.to_path_buf(),
            published: RwLock::new(Arc::new(catalog.clone())),
            catalog: Mutex::new(catalog),
            volumes: RwLock::new(volumes),
            engines: RwLock::new(engines),
            pools: RwLock::new(pools),
            datasets: RwLock::new(open_datasets),
            runtime: tokio::runtime::Handle::current(),
            wraps,
            schedule_changed: tokio::sync::Notify::new(),
            snapshot_views: Mutex::new(HashMap::new()),
            analytics: crate::analytics::Analytics::new(),
            _lock: lock,
        };
        manager.settle_receives().await;
        warn_stale_ram_tiers(data_dir);
        Ok(manager)
    }

    /// Makes a volume just saved in the catalog visible to the frontends.
    fn register_volume(
        &self,
        pool: &str,
        short: &str,
        engine: Arc<EngineVolume>,
        props: &crate::volume::props::VolumeProps,
    ) {
        let name = full_name(pool, short);
        let volume = ServedVolume::new(pool, short, engine.clone(), props);
        self.volumes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), Arc::new(volume));
        self.engines
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name, engine);
    }

    /// The open pool called `name`.
    pub fn pool(&self, name: &str) -> Option<Arc<Pool>> {
        self.pools.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    /// Every open pool with its name, as of now (the lock is not kept).
    pub(crate) fn open_pools(&self) -> Vec<(String, Arc<Pool>)> {
        self.pools
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(name, pool)| (name.clone(), pool.clone()))
            .collect()
    }

    /// Creates a pool on existing devices and adds it to the catalog.
    pub fn create_pool(
        &self,
        name: &str,
        devices: &[DeviceRecord],
        chunk_bytes: Option<u32>,
        ram_bytes: Option<u64>,
        force: bool,
    ) -> Result<PoolStatus, AdminError> {
        let devices = &devices
            .iter()
            .map(|d| {
                Ok(DeviceRecord {
                    path: canonical_device_path(&d.path)?,
                    role: d.role,
                    mirror: d.mirror,
                    write_mostly: d.write_mostly,
                })
            })
            .collect::<Result<Vec<_>, AdminError>>()?;
        if let Some(ram) = ram_bytes {
            if ram < 2 * MIN_RAM_BYTES {
                return Err(AdminError::Invalid(format!(
                    "--ram must be at least {} bytes",
                    2 * MIN_RAM_BYTES
                )));
            }
        }
        validate_component("pool", name)?;
        let mut catalog = self.catalog();
        if catalog.pools.contains_key(name) {
            return Err(AdminError::AlreadyExists(format!("pool '{name}' already exists")));
        }
        if devices.is_empty() || !devices.iter().any(|d| d.role != Role::Log) {
            return Err(AdminError::Invalid(
                "a pool needs at least one fast or capacity device".into(),
            ));
        }
        let known: Vec<&str> = catalog
            .pools
            .values()
            .flat_map(|p| {
                p.devices
                    .iter()
                    .chain(&p.adding)
                    .chain(&p.attaching)
                    .map(|d| d.path.as_str())
            })
            .collect();
        // Members in the order given; a mirror where its first device is.
        let mut opened: Vec<NewVdev> = Vec::new();
        let mut mirrors: Vec<((Role, u8), usize)> = Vec::new();
        for device in devices {
            if known.contains(&device.path.as_str()) || devices.iter().filter(|d| d.path == device.path).count() > 1 {
                return Err(AdminError::Invalid(format!("device {} is used twice", device.path)));
            }
            let handle = open_wrapped(&device.path, &self.wraps)
                .map_err(|e| AdminError::Invalid(format!("cannot open device {}: {e}", device.path)))?;
            if !force {
                self.refuse_if_not_empty(&device.path, &handle)?;
            }
            if device.write_mostly && device.mirror.is_none() {
                return Err(AdminError::Invalid(format!(
                    "{} is not part of a mirror: only a mirror's device can be write-mostly",
                    device.path
                )));
            }
            match device.mirror {
                None => opened.push(NewVdev {
                    role: device.role,
                    devices: vec![handle],
                    write_mostly: vec![false],
                }),
                Some(group) => match mirrors.iter().find(|(key, _)| *key == (device.role, group)) {
                    Some(&(_, at)) => {
                        opened[at].devices.push(handle);
                        opened[at].write_mostly.push(device.write_mostly);
                    }
                    None => {
                        mirrors.push(((device.role, group), opened.len()));
                        opened.push(NewVdev {
                            role: device.role,
                            devices: vec![handle],
                            write_mostly: vec![device.write_mostly],
                        });
                    }
                },
            }
        }
        if let Some(at) = mirrors
            .iter()
            .map(|(_, at)| *at)
            .find(|&at| opened[at].write_mostly.iter().all(|&w| w))
        {
            return Err(AdminError::Invalid(format!(
                "every device of a {} mirror is write-mostly: at least one must take reads",
                opened[at].role.as_str()
            )));
        }
        if let Some(((role, _), _)) = mirrors.iter().find(|(_, at)| opened[*at].devices.len() < 2) {
            return Err(AdminError::Invalid(format!(
                "a {} mirror needs at least two devices",
                role.as_str()
            )));
        }
        let chunk_bytes = chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES);
        fs::create_dir_all(pool_dir(&self.data_dir, name)).map_err(|e| internal("cannot create pool directory", e))?;
        let options = pool_options(&self.data_dir, name, ram_bytes);
        let pool = self
            .runtime
            .block_on(Pool::create_vdevs(name, chunk_bytes, opened, options))
            .map_err(|e| AdminError::Invalid(format!("cannot create pool '{name}': {e}")))?;
        let mut updated = catalog.clone();
        updated.pools.insert(
            name.to_string(),
            PoolRecord {
                created_unix: now_unix(),
                uuid: pool.uuid(),
                devices: devices
                    .iter()
                    .map(|d| DeviceRecord {
                        mirror: None,
                        write_mostly: false,
                        ..d.clone()
                    })
                    .collect(),
                next_volume_id: 1,
                volumes: Default::default(),
                ram_bytes,
                adding: None,
                attaching: None,
                snapshot_guids: Default::default(),
                properties: Default::default(),
                datasets: Default::default(),
            },
        );
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        drop(catalog);
        self.pools
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), pool);
        self.pool_status()
            .into_iter()
            .find(|p| p.name == name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{name}' vanished")))
    }

    /// Refuses a device that holds anything (a known signature or non-zero
    /// bytes in its first or last MiB: `device::signature`), read through
    /// `device` itself, the descriptor the pool then writes: a path swapped
    /// after this check cannot redirect the writes. A strata superblock is
    /// left to the pool, which refuses another pool's device and knows its
    /// own half-added one.
    fn refuse_if_not_empty(&self, path: &str, device: &Arc<dyn Device>) -> Result<(), AdminError> {
        use crate::device::signature;
        let size = device.info().size_bytes;
        let window = (signature::WINDOW_BYTES as u64).min(size);
        let read = |offset: u64| async move {
            let (buf, result) = device.read(offset, crate::device::IoBuf::new(window as usize)).await;
            result.map(|()| buf)
        };
        let (head, tail) = self
            .runtime
            .block_on(async { Ok::<_, DeviceError>((read(0).await?, read(size - window).await?)) })
            .map_err(|e| AdminError::Invalid(format!("cannot read device {path}: {}", device_error_reason(&e))))?;
        if head.payload().starts_with(&crate::pool::superblock::MAGIC) {
            return Ok(());
        }
        match signature::identify(head.payload(), tail.payload(), size) {
            None => Ok(()),
            Some(found) => Err(AdminError::Busy(format!(
                "device {path} is not empty: found {found}; use --force to overwrite it"
            ))),
        }
    }

    /// Adds a fast or capacity device to a running pool (`pool add-device`);
    /// its space is usable at once. Order (docs/FORMAT.md): the catalog
    /// records the device as being added, the pool writes the superblocks
    /// (new device first) and takes the device in, and the catalog moves it
    /// to the pool's devices.
    pub fn add_device(&self, pool_name: &str, device: &DeviceRecord, force: bool) -> Result<PoolStatus, AdminError> {
        validate_component("pool", pool_name)?;
        if device.path.is_empty() {
            return Err(AdminError::Invalid("missing device path".into()));
        }
        let device = &DeviceRecord {
            path: canonical_device_path(&device.path)?,
            role: device.role,
            mirror: None,
            write_mostly: false,
        };
        let mut catalog = self.catalog();
        let record = catalog
            .pools
            .get(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        if !device.role.holds_data() {
            return Err(role_refused(device.role.as_str()));
        }
        if device.path.is_empty() {
            return Err(AdminError::Invalid("missing device path".into()));
        }
        refuse_if_in_a_pool(&catalog.pools, &device.path, |name, other| {
            name == pool_name && other.adding.as_ref().is_some_and(|a| a.path == device.path)
        })?;
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' is in the catalog but not open")))?;
        let mut pending = catalog.clone();
        let pending_record = pending
            .pools
            .get_mut(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        if let Some(earlier) = record.adding.as_ref().filter(|a| a.path != device.path) {
            // Left by an addition whose undo failed: harmless unless the
            // superblocks list it (then only a restart can settle it).
            let listed = match open_device(&earlier.path, &DeviceOptions::default()) {
                Ok(handle) => self.runtime.block_on(pool.lists(&handle)),
                Err(_) => true,
            };
            if listed {
                return Err(AdminError::Busy(format!(
                    "an earlier addition of {} to pool '{pool_name}' did not finish; restart the daemon to settle it (or retry adding that device)",
                    earlier.path
                )));
            }
        }
        let handle = open_wrapped(&device.path, &self.wraps).map_err(|e| {
            let message = format!("cannot open device {}: {}", device.path, device_error_reason(&e));
            match &e {
                DeviceError::Io { source, .. } if source.kind() == std::io::ErrorKind::ResourceBusy => {
                    AdminError::Busy(message)
                }
                _ => AdminError::Invalid(message),
            }
        })?;
        if !force {
            self.refuse_if_not_empty(&device.path, &handle)?;
        }
        let addition = self
            .runtime
            .block_on(pool.prepare_add_device(handle, device.role))
            .map_err(|e| match e {
                PoolError::InUse(_) => AdminError::Busy(e.to_string()),
                PoolError::Invalid(_) => AdminError::Invalid(e.to_string()),
                _ => AdminError::Internal(format!("cannot add {} to pool '{pool_name}': {e}", device.path)),
            })?;
        pending_record.adding = Some(device.clone());
        pending
            .save(&self.data_dir)
            .map_err(|e| internal(&format!("cannot save catalog (device {} not added)", device.path), e))?;
        catalog.set(pending);
        if let Err(failure) = self.runtime.block_on(pool.finish_add_device(addition)) {
            let message = format!("cannot add {} to pool '{pool_name}': {failure}", device.path);
            if failure.undo_failed.is_some() {
                // The catalog keeps the device as being added; the next start
                // decides from the superblocks.
                return Err(AdminError::Internal(format!(
                    "{message}; the pool runs without the device, and the next start settles the addition"
                )));
            }
            let mut undone = catalog.clone();
            if let Some(record) = undone.pools.get_mut(pool_name) {
                record.adding = None;
            }
            if let Err(e) = undone.save(&self.data_dir) {
                // Harmless: the next start finds the superblocks do not list it.
                tracing::warn!("cannot save the catalog after an undone device addition: {e}");
            }
            catalog.set(undone);
            return Err(AdminError::Internal(message));
        }
        let mut done = catalog.clone();
        if let Some(record) = done.pools.get_mut(pool_name) {
            record.adding = None;
            record.devices.push(device.clone());
        }
        let saved = done.save(&self.data_dir);
        // The pool uses the device from now on, saved or not: the catalog
        // in memory says so, and so does the next save.
        catalog.set(done);
        drop(catalog);
        if let Err(e) = saved {
            return Err(AdminError::Internal(format!(
                "device {} was added to pool '{pool_name}' and is in use, but the catalog could not be saved ({e}); \
                 it lists the device as being added, which the next start completes",
                device.path
            )));
        }
        self.pool_status()
            .into_iter()
            .find(|p| p.name == pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' vanished")))
    }

    /// Adds a mirror as a new member (`pool add-device --capacity
    /// mirror:A,B[,...]`): `device` (A) is added, then each of `copies` is
    /// attached to it. The new member holds no data yet, so their resilver
    /// copies only what was written to it in between. Every copy is
    /// checked first (it exists, is named once, is in no pool, and is empty
    /// unless `force`), so a refusal changes nothing; should an attach fail
    /// after all, the error says that A was added alone and how to attach
    /// the rest.
    pub fn add_mirror(
        &self,
        pool_name: &str,
        device: &DeviceRecord,
        copies: &[String],
        force: bool,
    ) -> Result<PoolStatus, AdminError> {
        validate_component("pool", pool_name)?;
        let first = canonical_device_path(&device.path)?;
        let mut named = vec![first.clone()];
        for copy in copies {
            let path = canonical_device_path(copy)?;
            if named.contains(&path) {
                return Err(AdminError::Invalid(format!(
                    "device {path} is named twice in the mirror"
                )));
            }
            refuse_if_in_a_pool(&self.published().pools, &path, |_, _| false)?;
            if !force {
                let handle = open_device(&path, &DeviceOptions::default()).map_err(|e| {
                    AdminError::Invalid(format!("cannot open device {path}: {}", device_error_reason(&e)))
                })?;
                self.refuse_if_not_empty(&path, &handle)?;
            }
            named.push(path);
        }
        let mut status = self.add_device(pool_name, device, force)?;
        for copy in &named[1..] {
            status = self.attach_device(pool_name, &first, copy, false, force).map_err(|e| {
                let message = format!(
                    "{first} was added to pool '{pool_name}' as a single device, but attaching {copy} to it failed: \
                     {e}; `strata pool attach {pool_name} {first} {copy}` makes it a mirror"
                );
                match e {
                    AdminError::Busy(_) => AdminError::Busy(message),
                    AdminError::Invalid(_) | AdminError::NotFound(_) => AdminError::Invalid(message),
                    _ => AdminError::Internal(message),
                }
            })?;
        }
        Ok(status)
    }

    /// Attaches `new` to the pool as a mirror copy of `existing` (`pool
    /// attach`; with `replace`, as its replacement: `pool replace`). Order
    /// (docs/FORMAT.md, "Attaching, detaching and replacing"): the catalog
    /// records the new device as being attached, the pool writes the
    /// superblocks (the new device's first) and takes it in as resilvering,
    /// and the catalog moves it to the pool's devices. The resilver runs in
    /// the background; `pool status` shows it.
    pub fn attach_device(
        &self,
        pool_name: &str,
        existing: &str,
        new: &str,
        replace: bool,
        force: bool,
    ) -> Result<PoolStatus, AdminError> {
        validate_component("pool", pool_name)?;
        if existing.is_empty() {
            return Err(AdminError::Invalid("missing device".into()));
        }
        let new_path = canonical_device_path(new)?;
        let mut catalog = self.catalog();
        let pool = self.pool_of(&catalog, pool_name)?;
        self.settle_detached(&mut catalog, pool_name, &pool);
        refuse_if_in_a_pool(&catalog.pools, &new_path, |name, other| {
            name == pool_name && other.attaching.as_ref().is_some_and(|a| a.path == new_path)
        })?;
        let record = catalog
            .pools
            .get(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        if let Some(earlier) = record.attaching.as_ref().filter(|a| a.path != new_path) {
            let listed = match open_device(&earlier.path, &DeviceOptions::default()) {
                Ok(handle) => self.runtime.block_on(pool.lists(&handle)),
                Err(_) => false,
            };
            if listed {
                return Err(AdminError::Busy(format!(
                    "an earlier attach of {} to pool '{pool_name}' did not finish; restart the daemon to settle it",
                    earlier.path
                )));
            }
        }
        let (spec, missing_path) = resolve_device(&pool, record, existing);
        let (_, role) = pool.device_member(&spec).map_err(|e| pool_error(pool_name, e))?;
        let handle = open_wrapped(&new_path, &self.wraps).map_err(|e| {
            let message = format!("cannot open device {new_path}: {}", device_error_reason(&e));
            match &e {
                DeviceError::Io { source, .. } if source.kind() == std::io::ErrorKind::ResourceBusy => {
                    AdminError::Busy(message)
                }
                _ => AdminError::Invalid(message),
            }
        })?;
        if !force {
            self.refuse_if_not_empty(&new_path, &handle)?;
        }
        let device = DeviceRecord {
            path: new_path.clone(),
            role,
            mirror: None,
            write_mostly: false,
        };
        let mut pending = catalog.clone();
        if let Some(record) = pending.pools.get_mut(pool_name) {
            record.attaching = Some(device.clone());
        }
        pending
            .save(&self.data_dir)
            .map_err(|e| internal(&format!("cannot save catalog (device {new_path} not attached)"), e))?;
        catalog.set(pending);
        let attached = if replace {
            self.runtime.block_on(pool.replace(&spec, handle.clone()))
        } else {
            self.runtime.block_on(pool.attach(&spec, handle.clone()))
        };
        if let Err(e) = attached {
            // Unless its superblocks name it (they then do at the next
            // start too, which settles it), the device is not the pool's.
            if !self.runtime.block_on(pool.uses_device(&handle)) {
                let mut undone = catalog.clone();
                if let Some(record) = undone.pools.get_mut(pool_name) {
                    record.attaching = None;
                }
                if undone.save(&self.data_dir).is_ok() {
                    catalog.set(undone);
                }
            }
            return Err(pool_error(pool_name, e));
        }
        let mut done = catalog.clone();
        if let Some(record) = done.pools.get_mut(pool_name) {
            record.attaching = None;
            record.devices.push(device);
            // A missing device being replaced is not opened again.
            if let (true, Some(path)) = (replace, &missing_path) {
                record.devices.retain(|d| &d.path != path);
            }
        }
        let saved = done.save(&self.data_dir);
        catalog.set(done);
        drop(catalog);
        if let Err(e) = saved {
            return Err(AdminError::Internal(format!(
                "device {new_path} was attached to pool '{pool_name}' and is in use, but the catalog could not be \
                 saved ({e}); it lists the device as being attached, which the next start completes"
            )));
        }
        self.status_of(pool_name)
    }

    /// Detaches `device` from its mirror (`pool detach`): the pool's other
    /// superblocks stop naming it, the catalog forgets it, and its own
    /// superblocks are cleared so it can be used again.
    pub fn detach_device(&self, pool_name: &str, device: &str) -> Result<PoolStatus, AdminError> {
        validate_component("pool", pool_name)?;
        if device.is_empty() {
            return Err(AdminError::Invalid("missing device".into()));
        }
        let mut catalog = self.catalog();
        let pool = self.pool_of(&catalog, pool_name)?;
        self.settle_detached(&mut catalog, pool_name, &pool);
        let record = catalog
            .pools
            .get(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let (spec, missing_path) = resolve_device(&pool, record, device);
        let handle = self
            .runtime
            .block_on(pool.detach(&spec))
            .map_err(|e| pool_error(pool_name, e))?;
        let mut done = catalog.clone();
        if let Some(record) = done.pools.get_mut(pool_name) {
            record.devices.retain(|d| {
                let named = match (&handle, &spec) {
                    (Some(handle), _) => crate::pool::device_named(&handle.info().name, &d.path),
                    (None, crate::pool::DeviceSpec::Path(path)) => &d.path == path,
                    (None, _) => missing_path.as_ref() == Some(&d.path),
                };
                !named
            });
        }
        let saved = done.save(&self.data_dir);
        catalog.set(done);
        drop(catalog);
        match (saved, handle) {
            (Err(e), _) => {
                return Err(AdminError::Internal(format!(
                    "{device} was detached from pool '{pool_name}', but the catalog could not be saved ({e}); the \
                     next start leaves the device out"
                )))
            }
            (Ok(()), Some(handle)) => {
                if let Err(e) = self.runtime.block_on(pool.forget_device(&handle)) {
                    tracing::warn!("{}: detached, but its superblocks could not be cleared: {e}", device);
                }
            }
            (Ok(()), None) => {}
        }
        self.status_of(pool_name)
    }

    /// Forgets (in the catalog) the devices every pool has let go of by
    /// itself (a replaced device, once its replacement is resilvered), then
    /// clears their superblocks. The daemon calls it every few seconds.
    pub fn settle_devices(&self) {
        let pools: Vec<(String, Arc<Pool>)> = self
            .pools
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, p)| p.has_detached())
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect();
        if pools.is_empty() {
            return;
        }
        let mut catalog = self.catalog();
        for (name, pool) in pools {
            self.settle_detached(&mut catalog, &name, &pool);
        }
    }

    /// [`VolumeManager::settle_devices`] for one pool, under the catalog.
    fn settle_detached(&self, catalog: &mut CatalogGuard<'_>, pool_name: &str, pool: &Arc<Pool>) {
        if !pool.has_detached() {
            return;
        }
        let mut next = (**catalog).clone();
        let Some(record) = next.pools.get_mut(pool_name) else {
            return;
        };
        let detached = forget_detached(pool_name, pool, record, &[]);
        if let Err(e) = next.save(&self.data_dir) {
            // They stay listed; the next start leaves them out again.
            tracing::error!("cannot save the catalog after a device left pool '{pool_name}': {e}");
            return;
        }
        catalog.set(next);
        for device in detached {
            if let Err(e) = self.runtime.block_on(pool.forget_device(&device)) {
                tracing::warn!("{}: cannot clear its superblocks: {e}", device.info().name);
            }
        }
    }

    fn pool_of(&self, catalog: &Catalog, pool_name: &str) -> Result<Arc<Pool>, AdminError> {
        if !catalog.pools.contains_key(pool_name) {
            return Err(AdminError::NotFound(format!("pool '{pool_name}' does not exist")));
        }
        self.pool(pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' is in the catalog but not open")))
    }

    fn status_of(&self, pool_name: &str) -> Result<PoolStatus, AdminError> {
        self.pool_status()
            .into_iter()
            .find(|p| p.name == pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' vanished")))
    }

    /// Checkpoints every pool so the next start replays nothing (clean
    /// shutdown). Returns what did not reach its place, one line per pool
    /// (empty when everything did).
    pub async fn close(&self) -> Vec<String> {
        let pools: Vec<Arc<Pool>> = self
            .pools
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        let mut untold = Vec::new();
        for pool in pools {
            let mut said = Vec::new();
            // Space still being freed is punched now (no clients are left),
            // for at most 10 s; what remains is written as free anyway, only
            // its holes are not punched.
            let freeing = pool.freeing_bytes();
            if freeing > 0 {
                let drained = tokio::time::timeout(std::time::Duration::from_secs(10), pool.free_queued()).await;
                if drained.is_err() {
                    tracing::info!(
                        "pool {}: {} still to free at shutdown: free in the pool, its space not yet given back to the file system",
                        pool.name(),
                        crate::units::format_size(pool.freeing_bytes())
                    );
                }
            }
            if let Err(e) = pool.destage_all().await {
                tracing::error!("pool {}: destaging at shutdown failed: {e}", pool.name());
                said.push(format!(
                    "{} of cached writes stay in the RAM tier file and the intent log (not placed: {e})",
                    crate::units::format_size(pool.cache_stats().dirty_bytes)
                ));
            }
            pool.save_heat_at_next_checkpoint();
            if let Err(e) = pool.checkpoint().await {
                tracing::error!("pool {}: final checkpoint failed: {e}", pool.name());
                said.push(format!(
                    "not checkpointed ({e}): the intent log holds every change since the last checkpoint"
                ));
            }
            if pool.cache.ram.remove_file_if_clean() || said.is_empty() {
                continue;
            }
            untold.push(format!(
                "pool {}: {}; the next start replays them",
                pool.name(),
                said.join("; ")
            ));
        }
        untold
    }

    pub fn analytics(&self) -> &Arc<crate::analytics::Analytics> {
        &self.analytics
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The open volume called `pool/name`, or the read-only volume of
    /// snapshot `pool/name@snapshot`.
    pub fn lookup(&self, name: &str) -> Option<Arc<ServedVolume>> {
        if name.contains('@') {
            return self.snapshot_volume(name);
        }
        self.volumes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// All open volumes, sorted by name.
    pub fn volumes(&self) -> Vec<Arc<ServedVolume>> {
        let mut all: Vec<_> = self
            .volumes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        all.sort_by(|a, b| a.full_name().cmp(b.full_name()));
        all
    }

    /// Takes the catalog for an admin operation (on a blocking thread).
    fn catalog(&self) -> CatalogGuard<'_> {
        CatalogGuard {
            saved: self.catalog.lock().unwrap_or_else(|e| e.into_inner()),
            published: &self.published,
        }
    }

    /// The catalog as last saved, without waiting for an admin operation:
    /// for code on the runtime and read-only admin calls (see `catalog`).
    fn published(&self) -> Arc<Catalog> {
        self.published.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn info_of(&self, catalog: &Catalog, name: &str) -> Result<VolumeInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let record = catalog
            .pools
            .get(pool)
            .and_then(|p| p.volumes.get(short))
            .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?;
        let used_bytes = self
            .engines
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|e| e.used_bytes())
            .unwrap_or(0);
        let connections = self.lookup(name).map(|v| v.open_handles()).unwrap_or(0);
        let mut properties = record.props.rows();
        let fact = |property: &str, value: String| PropertyRow {
            property: property.into(),
            value,
            source: "-".into(),
        };
        properties.push(fact(
            "origin",
            self.origin_name(catalog, pool, record.id).unwrap_or_else(|| "-".into()),
        ));
        for (property, bytes) in self.space_rows(pool, record.id, record.props.volblocksize, used_bytes) {
            properties.push(fact(property, crate::units::format_size(bytes)));
        }
        // Where the volume's blocks are (automatic tiering).
        let tiers = self.tier_bytes(pool, record.id);
        let shown = |bytes: Option<u64>| bytes.map_or_else(|| "-".to_string(), crate::units::format_size);
        properties.push(fact("used.fast", shown(tiers.map(|t| t.0))));
        properties.push(fact("used.capacity", shown(tiers.map(|t| t.1))));
        Ok(VolumeInfo {
            name: name.to_string(),
            pool: pool.to_string(),
            volsize: record.props.volsize,
            volblocksize: record.props.volblocksize,
            used_bytes,
            connections,
            properties,
        })
    }

    /// The stored properties of `pool/name` (all of them, secrets included:
    /// for the frontends, never for display).
    /// The daemon-wide iSCSI settings as rows (secrets masked), every
    /// known setting with its value or `-`.
    pub fn iscsi_settings(&self) -> Vec<PropertyRow> {
        discovery_rows(&self.published().iscsi)
    }

    /// Changes daemon-wide iSCSI settings (`strata iscsi set`); an empty
    /// value clears one. They apply to the next login.
    pub fn set_iscsi(&self, changes: &[(String, String)]) -> Result<Vec<PropertyRow>, AdminError> {
        let mut validated = Vec::new();
        for (key, value) in changes {
            let property = discovery_property(key)?;
            validated.push((key.clone(), canonical_value(&property, value)?));
        }
        let mut catalog = self.catalog();
        let mut updated = catalog.clone();
        for (key, value) in validated {
            if value.is_empty() {
                updated.iscsi.remove(&key);
            } else {
                updated.iscsi.insert(key, value);
            }
        }
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        Ok(discovery_rows(&catalog.iscsi))
    }

    /// The rules discovery sessions must meet, or `None` when discovery is
    /// open (`discovery_auth` unset or `none`).
    pub fn discovery_access(&self) -> Option<IscsiAccess> {
        let access = discovery_props(&self.published().iscsi).iscsi_access();
        (access.auth != IscsiAuthMode::None).then_some(access)
    }

    /// A snapshot (`pool/name@snapshot`) has its volume's: who may read it
    /// is who may use the volume.
    pub fn stored_props(&self, name: &str) -> Option<StoredProps> {
        let volume = name.split_once('@').map_or(name, |(volume, _)| volume);
        let (pool, short) = split_volume_name(volume).ok()?;
        self.published()
            .pools
            .get(pool)
            .and_then(|p| p.volumes.get(short))
            .map(|record| record.props.clone())
    }

    pub fn info(&self, name: &str) -> Result<VolumeInfo, AdminError> {
        let catalog = self.published();
        self.info_of(&catalog, name)
    }

    pub fn list(&self) -> Vec<VolumeInfo> {
        let catalog = self.published();
        let mut names = Vec::new();
        for (pool, record) in &catalog.pools {
            for (name, volume) in &record.volumes {
                if volume.receiving.is_some() {
                    continue;
                }
                names.push(full_name(pool, name));
            }
        }
        names.iter().filter_map(|n| self.info_of(&catalog, n).ok()).collect()
    }

    /// Creates a thin volume of `size_bytes` with `properties` (`key`, `value`).
    pub fn create(
        &self,
        name: &str,
        size_bytes: u64,
        properties: &[(String, String)],
    ) -> Result<VolumeInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let mut catalog = self.catalog();
        let pool_record = catalog
            .pools
            .get(pool)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool}' does not exist")))?;
        if pool_record.volumes.contains_key(short) {
            return Err(AdminError::AlreadyExists(format!("volume '{name}' already exists")));
        }
        let mut stored = StoredProps {
            volsize: size_bytes,
            volblocksize: DEFAULT_VOLBLOCKSIZE,
            local: Default::default(),
        };
        for (key, value) in properties {
            let value = canonical_value(key, value)?;
            match key.as_str() {
                "volsize" => stored.volsize = value.parse().map_err(|e| internal("volsize", e))?,
                "volblocksize" => stored.volblocksize = value.parse().map_err(|e| internal("volblocksize", e))?,
                _ => {
                    stored.local.insert(key.clone(), value);
                }
            }
        }
        check_volsize(stored.volsize, stored.volblocksize)?;
        let pool_handle = self
            .pool(pool)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool}' is in the catalog but not open")))?;
        let mut updated = catalog.clone();
        let id = add_volume_record(&mut updated, pool, short, &stored)?;
        let props = stored.effective();
        let engine = pool_handle
            .open_volume(id, props.volsize, props.volblocksize)
            .map_err(|e| internal("cannot open the new volume", e))?;
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        self.register_volume(pool, short, engine, &props);
        self.apply_tier_pin(pool, id, &stored);
        self.schedule_changed.notify_one();
        self.info_of(&catalog, name)
    }

    /// Sets properties on an existing volume; takes effect at once. The whole
    /// request is validated first and saved in one catalog update.
    pub fn set(&self, name: &str, properties: &[(String, String)]) -> Result<VolumeInfo, AdminError> {
        let mut new_size = None;
        let mut changes = Vec::new();
        for (key, value) in properties {
            let value = canonical_value(key, value)?;
            match key.as_str() {
                "volblocksize" => return Err(PropError::ReadOnly(key.clone()).into()),
                "volsize" => new_size = Some(value.parse::<u64>().map_err(|e| internal("volsize", e))?),
                _ => changes.push((key.clone(), value)),
            }
        }
        self.update(name, new_size, changes)
    }

    /// Grows a volume. Shrinking would discard data and is refused.
    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo, AdminError> {
        self.update(name, Some(size_bytes), Vec::new())
    }

    /// Applies a new size and property values under one catalog lock.
    fn update(
        &self,
        name: &str,
        new_size: Option<u64>,
        changes: Vec<(String, String)>,
    ) -> Result<VolumeInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let mut catalog = self.catalog();
        let mut updated = catalog.clone();
        let record = updated
            .pools
            .get_mut(pool)
            .and_then(|p| p.volumes.get_mut(short))
            .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?;
        let volume = self
            .lookup(name)
            .ok_or_else(|| AdminError::Internal(format!("volume '{name}' is in the catalog but not open")))?;
        if let Some(size_bytes) = new_size {
            check_volsize(size_bytes, record.props.volblocksize)?;
            if size_bytes < record.props.volsize {
                return Err(AdminError::Invalid(format!(
                    "cannot shrink volume '{name}' from {} to {} bytes: shrinking discards data",
                    record.props.volsize, size_bytes
                )));
            }
            record.props.volsize = size_bytes;
        }
        for (key, value) in changes {
            record.props.local.insert(key, value);
        }
        let effective = record.props.effective();
        let (id, stored) = (record.id, record.props.clone());
        if effective.volsize != volume.size_bytes() {
            // Grow the backing first: a crash in between leaves a file larger
            // than the catalog says, which is harmless (the catalog size wins).
            volume
                .resize(effective.volsize)
                .map_err(|e| internal("cannot resize backing file", e))?;
        }
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        volume.apply_props(&effective);
        self.apply_tier_pin(pool, id, &stored);
        self.schedule_changed.notify_one();
        self.info_of(&catalog, name)
    }

    /// Destroys a volume and its data. Refused while clients are connected.
    pub fn delete(&self, name: &str) -> Result<(), AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let mut catalog = self.catalog();
        let mut updated = catalog.clone();
        let record = updated
            .pools
            .get_mut(pool)
            .and_then(|p| p.volumes.remove(short))
            .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?;
        // New clients are refused before the open ones are counted: a
        // handshake that found the volume either is counted here (and the
        // delete refused) or is refused itself (`ServedVolume::try_open_handle`).
        let refused = self
            .lookup(name)
            .map(|volume| snapshots::Eviction::refuse_clients(vec![volume]));
        if let Some(volume) = refused.as_ref().and_then(|r| r.volumes().first()) {
            let connections = volume.open_handles();
            if connections > 0 {
                return Err(AdminError::Busy(format!(
                    "volume '{name}' is busy: {connections} client connection(s) open"
                )));
            }
        }
        if let Some(pool_handle) = self.pool(pool) {
            let snapshots = pool_handle.snapshots_of(record.id).len();
            if snapshots > 0 {
                return Err(AdminError::Busy(format!(
                    "volume '{name}' has {snapshots} snapshot(s): delete them first (strata snapshot list {name})"
                )));
            }
        }
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        catalog.set(updated);
        if let Some(volume) = self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(name) {
            volume.mark_deleted();
        }
        // Deleted: its clients stay refused.
        if let Some(refused) = refused {
            refused.keep();
        }
        self.engines.write().unwrap_or_else(|e| e.into_inner()).remove(name);
        // The catalog no longer names the volume; now free its blocks. A
        // crash before this finishes leaves blocks allocated to an id no
        // volume has (reclaimed by a later scrub), never a volume without data.
        if let Some(pool_handle) = self.pool(pool) {
            pool_handle.set_tier_pin(record.id, crate::pool::migrate::TierPin::Auto);
            if let Err(e) = self.runtime.block_on(pool_handle.destroy_volume(record.id)) {
                tracing::error!("volume {name} deleted but freeing its blocks failed: {e}");
            }
        }
        Ok(())
    }

    /// Every pool's status, from the catalog as last published and the
    /// pools' own counters: never waits for an admin operation.
    pub fn pool_status(&self) -> Vec<PoolStatus> {
        let catalog = self.published();
        catalog
            .pools
            .iter()
            .filter_map(|(name, record)| {
                let pool = self.pool(name)?;
                let devices = pool.status();
                let data: Vec<&DeviceStatus> = devices.iter().filter(|d| d.role != Role::Log).collect();
                let size_bytes: u64 = data.iter().map(|d| d.data_bytes).sum();
                let reserved_bytes = pool.reserved_bytes();
                let used_bytes: u64 = data.iter().map(|d| d.used_bytes).sum::<u64>() + reserved_bytes;
                let write = pool.cache_stats();
                let read = pool.read_cache_stats();
                let counters = pool.meta_counters();
                let cache = PoolCacheStatus {
                    dirty_bytes: write.dirty_bytes,
                    dirty_max_bytes: write.ram_bytes,
                    reserved_bytes,
                    written_bytes: write.written_bytes,
                    logged_bytes: write.logged_bytes,
                    destaged_bytes: write.destaged_bytes,
                    stalls: write.stalls,
                    read_cache_bytes: read.used_bytes,
                    read_cache_max_bytes: read.capacity_bytes,
                    read_hits: read.hits,
                    read_misses: read.misses,
                    ram_tier: pool.cache.ram.location().to_string(),
                };
                let degraded = devices.iter().any(|d| d.state == "DEGRADED");
                let child_errors = |count: fn(&crate::pool::ChildStatus) -> u64| -> u64 {
                    devices.iter().flat_map(|d| &d.children).map(count).sum()
                };
                Some(PoolStatus {
                    name: name.clone(),
                    uuid: pool.uuid(),
                    state: if degraded { "DEGRADED" } else { "ONLINE" }.into(),
                    action: degraded.then(|| pool_action(name, &devices)),
                    chunk_bytes: pool.chunk_bytes(),
                    volumes: record.volumes.len(),
                    provisioned_bytes: record.volumes.values().map(|v| v.props.volsize).sum(),
                    size_bytes,
                    used_bytes,
                    available_bytes: size_bytes.saturating_sub(used_bytes),
                    freeing_bytes: pool.freeing_bytes(),
                    read_errors: devices.iter().map(|d| d.read_errors).sum::<u64>() + child_errors(|c| c.read_errors),
                    write_errors: devices.iter().map(|d| d.write_errors).sum::<u64>()
                        + child_errors(|c| c.write_errors),
                    checksum_errors: devices.iter().map(|d| d.checksum_errors).sum::<u64>()
                        + child_errors(|c| c.checksum_errors),
                    metadata_errors: counters.metadata_errors,
                    suspect_chunks: pool.suspect_chunks(),
                    data_bytes_written: counters.data_bytes,
                    metadata_bytes_written: counters.log_bytes + counters.store_bytes,
                    log_commits: counters.log_commits,
                    log_records: counters.log_records,
                    data_flushes: counters.data_flushes,
                    commit_data_flushes: counters.commit_data_flushes,
                    log_room_waits: counters.log_room_waits,
                    log_room_wait_micros: counters.log_room_wait_micros,
                    allocator_lock_waits: counters.allocator_lock_waits,
                    allocator_lock_wait_micros: counters.allocator_lock_wait_micros,
                    log_lock_waits: counters.log_lock_waits,
                    log_lock_wait_micros: counters.log_lock_wait_micros,
                    meta_cache: MetaCacheStatus {
                        map_pages: counters.map_cache_pages,
                        map_max_pages: counters.map_cache_max_pages,
                        map_misses: counters.map_cache_misses,
                        crc_pages: counters.crc_cache_pages,
                        crc_max_pages: counters.crc_cache_max_pages,
                        crc_misses: counters.crc_cache_misses,
                    },
                    cache,
                    tiers: PoolTiers::of(&devices),
                    migration: pool.migration_status(),
                    scrub: self.scrub_status_of(name, &pool),
                    next_scrub_unix: self.next_scrub_of(name, &pool),
                    devices,
                })
            })
            .collect()
    }

    /// `pool sync`: destages all of a pool's cached writes to their place
    /// on the data devices and checkpoints its metadata, so the devices
    /// alone hold everything written (before a backup of the device files,
    /// a device replacement, or a test that inspects them).
    pub async fn sync_pool(&self, pool_name: &str) -> Result<PoolStatus, AdminError> {
        validate_component("pool", pool_name)?;
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        pool.destage_all()
            .await
            .map_err(|e| AdminError::Internal(format!("pool '{pool_name}': destage failed: {e}")))?;
        pool.checkpoint()
            .await
            .map_err(|e| AdminError::Internal(format!("pool '{pool_name}': checkpoint failed: {e}")))?;
        self.pool_status()
            .into_iter()
            .find(|p| p.name == pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))
    }

    /// Makes every acknowledged write durable (used at shutdown).
    /// Flushes every open volume (shutdown); returns a line for each
    /// volume whose flush failed.
    pub async fn flush_all(&self) -> Vec<String> {
        let mut failed = Vec::new();
        for volume in self.volumes() {
            if let Err(e) = volume.flush().await {
                tracing::error!("flush of {} at shutdown failed: {e}", volume.full_name());
                failed.push(format!(
                    "volume {}: flush failed ({e}): its writes acknowledged since its last flush are only \
                     in the RAM tier file (kept across a restart of the daemon, lost if the machine restarts)",
                    volume.full_name()
                ));
            }
        }
        failed
    }
}

/// Adds volume `short` with `stored` properties to pool `pool` of
/// `catalog` under a new id, which it returns.
/// A volume's iSCSI target name ends in `POOL.NAME`, and target names
/// compare without case (RFC 3722): refuses a new volume whose name would
/// give an existing volume's target (`a.b/c` against `a/b.c`, `Vol`
/// against `vol`).
pub(crate) fn check_target_name_free(catalog: &Catalog, pool: &str, short: &str) -> Result<(), AdminError> {
    let wanted = format!("{pool}.{short}").to_lowercase();
    for (other_pool, record) in &catalog.pools {
        for other in record.volumes.keys() {
            let same = other_pool == pool && other == short;
            if !same && format!("{other_pool}.{other}").to_lowercase() == wanted {
                return Err(AdminError::AlreadyExists(format!(
                    "volume '{pool}/{short}' would have the iSCSI target name of volume '{other_pool}/{other}' \
                     (target names join pool and volume with '.' and ignore case): choose another name"
                )));
            }
        }
    }
    Ok(())
}

fn add_volume_record(catalog: &mut Catalog, pool: &str, short: &str, stored: &StoredProps) -> Result<u32, AdminError> {
    check_target_name_free(catalog, pool, short)?;
    let Some(pool_record) = catalog.pools.get_mut(pool) else {
        return Err(AdminError::NotFound(format!("pool '{pool}' does not exist")));
    };
    let id = pool_record.next_volume_id.max(1);
    pool_record.next_volume_id = id + 1;
    pool_record.volumes.insert(
        short.to_string(),
        VolumeRecord {
            id,
            created_unix: now_unix(),
            props: stored.clone(),
            receiving: None,
        },
    );
    Ok(id)
}

fn check_volsize(size_bytes: u64, volblocksize: u32) -> Result<(), AdminError> {
    if size_bytes == 0 {
        return Err(AdminError::Invalid("volsize must be greater than zero".into()));
    }
    if !size_bytes.is_multiple_of(volblocksize as u64) {
        return Err(AdminError::Invalid(format!(
            "volsize {size_bytes} is not a multiple of volblocksize {volblocksize}"
        )));
    }
    // Keeps every offset + length computation far from u64 overflow.
    if size_bytes > 1 << 60 {
        return Err(AdminError::Invalid(format!(
            "volsize {size_bytes} is too large (max 1E)"
        )));
    }
    Ok(())
}

fn pool_dir(data_dir: &Path, pool: &str) -> PathBuf {
    data_dir.join("pools").join(pool)
}

/// RAM a pool uses for caching unless `--ram` says otherwise.
pub const DEFAULT_POOL_RAM_BYTES: u64 = 512 << 20;

/// Where RAM tier files go when it is tmpfs with room (`STRATA_RAM_DIR`
/// overrides, and need not be tmpfs).
pub const DEFAULT_RAM_DIR: &str = "/dev/shm";

/// The name a data directory's pool gives its RAM tier file in the RAM
/// directory: unique per data directory (a hash of its canonical path) and
/// pool, so two daemons never map the same region.
pub fn ram_file_key(data_dir: &Path, pool: &str) -> String {
    let canonical = fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let hash = crate::checksum::crc32c(canonical.as_os_str().as_encoded_bytes());
    format!("{hash:08x}-{pool}")
}

/// The directory RAM tier files go to, and whether it must be tmpfs:
/// `STRATA_RAM_DIR`, which may name any directory (the tests keep their RAM
/// tiers in their own temporary directories), else /dev/shm.
fn ram_dir(data_dir: &Path) -> (PathBuf, bool) {
    match std::env::var_os("STRATA_RAM_DIR") {
        Some(dir) => (PathBuf::from(dir), false),
        // Unit tests drop managers without a clean shutdown: nothing of
        // theirs may stay behind in tmpfs.
        None if cfg!(test) => (data_dir.to_path_buf(), false),
        None => (PathBuf::from(DEFAULT_RAM_DIR), true),
    }
}

/// Warns about each RAM tier file in the RAM directory that no process
/// holds (every pool of this daemon holds its own by now): left by a
/// daemon killed without a clean shutdown, it pins its size in RAM until
/// that data directory's daemon starts again or `strata ram-tier remove`
/// removes it.
fn warn_stale_ram_tiers(data_dir: &Path) {
    let (dir, _) = ram_dir(data_dir);
    let Ok(files) = ram::region_files(&dir) else {
        return;
    };
    for file in files.iter().filter(|f| f.held_by.is_none()) {
        let owner = match &file.data_dir {
            Some(owner) if owner.exists() => owner.display().to_string(),
            Some(owner) => format!("{} (which no longer exists)", owner.display()),
            None => "not recorded".to_string(),
        };
        let dirty = if file.dirty {
            "; it holds writes that daemon acknowledged and had not placed, which its next start replays"
        } else {
            ""
        };
        tracing::warn!(
            "stale RAM tier file {} ({}): pool {}, data directory {owner}; no running daemon uses it{dirty}. \
             If no daemon will start on that data directory again, remove it: strata ram-tier remove {}",
            file.path.display(),
            crate::units::format_size(file.bytes),
            file.pool,
            file.path.display()
        );
    }
}

/// The options a pool of this data directory opens with: half its RAM is the
/// RAM tier (dirty data; in /dev/shm when it is tmpfs with room, else in
/// `pools/NAME/ram.tier`), half the read cache; its block-map and checksum
/// page caches take a quarter of it more (128 MiB at the default, filled
/// only as pages are read: the map pages of 32 GiB of written data; 32 MiB
/// would hold those of 8 GiB, and 16 filled 1 GiB volumes would thrash it).
fn pool_options(data_dir: &Path, name: &str, ram_bytes: Option<u64>) -> PoolOptions {
    let ram = ram_bytes.unwrap_or(DEFAULT_POOL_RAM_BYTES);
    let tier_bytes = (ram / 2).max(MIN_RAM_BYTES);
    let (ram_dir, require_tmpfs) = ram_dir(data_dir);
    let path = ram::choose_location(
        &pool_dir(data_dir, name),
        &ram_dir,
        require_tmpfs,
        &ram_file_key(data_dir, name),
        tier_bytes,
    );
    tracing::debug!("pool {name}: RAM tier in {}", path.display());
    PoolOptions {
        ram: Some(RamSource::File {
            path,
            bytes: tier_bytes,
            data_dir: Some(fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf())),
        }),
        background: true,
        read_cache_bytes: ram / 2,
        meta_cache_bytes: ram / 4,
        ..PoolOptions::default()
    }
}

/// Opens the device at `path`, with the wrappers `wraps` asks for on it.
/// The daemon-wide iSCSI settings: `discovery_X` is checked and behaves as
/// a volume's `iscsi.X` (same values, same secret rules).
const DISCOVERY_SETTINGS: [&str; 5] = [
    "discovery_auth",
    "discovery_chap_user",
    "discovery_chap_secret",
    "discovery_mutual_user",
    "discovery_mutual_secret",
];

/// The volume property a discovery setting mirrors.
fn discovery_property(key: &str) -> Result<String, AdminError> {
    match key.strip_prefix("discovery_") {
        Some(rest) if DISCOVERY_SETTINGS.contains(&key) => Ok(format!("iscsi.{rest}")),
        _ => Err(AdminError::Invalid(format!(
            "unknown iSCSI setting '{key}' (known: {})",
            DISCOVERY_SETTINGS.join(", ")
        ))),
    }
}

/// The settings as the properties of a pseudo-volume, to reuse their rules.
fn discovery_props(settings: &std::collections::BTreeMap<String, String>) -> StoredProps {
    let mut props = StoredProps::default();
    for (key, value) in settings {
        if let Ok(property) = discovery_property(key) {
            props.local.insert(property, value.clone());
        }
    }
    props
}

fn discovery_rows(settings: &std::collections::BTreeMap<String, String>) -> Vec<PropertyRow> {
    discovery_props(settings)
        .rows()
        .into_iter()
        .filter_map(|row| {
            let rest = row.property.strip_prefix("iscsi.")?;
            let name = format!("discovery_{rest}");
            DISCOVERY_SETTINGS
                .contains(&name.as_str())
                .then_some(PropertyRow { property: name, ..row })
        })
        .collect()
}

/// A device path as the pool records it: absolute, with every symlink and
/// `..` resolved, so the catalog names the file itself.
pub(super) fn canonical_device_path(path: &str) -> Result<String, AdminError> {
    if path.is_empty() {
        return Err(AdminError::Invalid("missing device path".into()));
    }
    let canonical = fs::canonicalize(path)
        .map_err(|e| AdminError::Invalid(format!("cannot open device {path}: {}", io_reason(&e))))?;
    canonical
        .to_str()
        .map(str::to_string)
        .ok_or_else(|| AdminError::Invalid(format!("device path {} is not UTF-8", canonical.display())))
}

/// "No such file or directory (os error 2)" -> "No such file or directory".
fn io_reason(error: &std::io::Error) -> String {
    let text = error.to_string();
    text.split(" (os error").next().unwrap_or(&text).to_string()
}

fn open_wrapped(path: impl AsRef<Path>, wraps: &DeviceWraps) -> Result<Arc<dyn Device>, DeviceError> {
    let path = path.as_ref();
    Ok(wraps.apply(path, open_device(path, &DeviceOptions::default())?))
}

/// Runs `work` on a blocking thread every `period` until `stop` turns
/// true (the daemon's periodic admin chores: they take the catalog, which
/// nothing on the runtime may wait for).
pub async fn every(
    period: std::time::Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    work: impl Fn() + Clone + Send + 'static,
) {
    loop {
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return;
                }
            }
            _ = tokio::time::sleep(period) => {}
        }
        let _ = tokio::task::spawn_blocking(work.clone()).await;
    }
}

/// How often the daemon lets go of the devices a pool released: a
/// replaced device leaves the catalog soon after its replacement is
/// resilvered ([`VolumeManager::settle_devices`]).
pub const SETTLE_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Refuses `path` when a pool's record names it (as a device, or one being
/// added or attached), unless `retrying` says that record was left by an
/// earlier try of this same request.
fn refuse_if_in_a_pool(
    pools: &std::collections::BTreeMap<String, PoolRecord>,
    path: &str,
    retrying: impl Fn(&str, &PoolRecord) -> bool,
) -> Result<(), AdminError> {
    for (name, other) in pools {
        let named = other
            .devices
            .iter()
            .chain(&other.adding)
            .chain(&other.attaching)
            .any(|d| d.path == path);
        if named && !retrying(name, other) {
            return Err(AdminError::Busy(format!(
                "device {path} is already part of pool '{name}'"
            )));
        }
    }
    Ok(())
}

/// How a request's device is meant, for the pool: a path (canonical when
/// it exists) or a uuid. A path of the catalog that names no device the
/// pool has open is the pool's one missing device, if it has exactly one
/// (returned too: the catalog path that stands for it).
fn resolve_device(pool: &Pool, record: &PoolRecord, text: &str) -> (crate::pool::DeviceSpec, Option<String>) {
    use crate::pool::DeviceSpec;
    let spec = DeviceSpec::parse(text);
    let DeviceSpec::Path(path) = &spec else {
        return (spec, None);
    };
    let path = fs::canonicalize(path)
        .ok()
        .and_then(|p| p.to_str().map(str::to_string))
        .unwrap_or_else(|| path.clone());
    let spec = DeviceSpec::Path(path.clone());
    if pool.device_member(&spec).is_ok() || !record.devices.iter().any(|d| d.path == path) {
        return (spec, None);
    }
    let missing: Vec<DeviceSpec> = pool
        .status()
        .iter()
        .flat_map(|d| &d.children)
        .filter(|c| c.state == crate::pool::vdev::Health::Missing)
        .map(|c| DeviceSpec::parse(&c.name))
        .collect();
    match &missing[..] {
        [one] => (one.clone(), Some(path)),
        _ => (spec, None),
    }
}

/// A pool's refusal as the admin error of its kind.
fn pool_error(pool_name: &str, error: PoolError) -> AdminError {
    match error {
        PoolError::NotFound(_) => AdminError::NotFound(error.to_string()),
        PoolError::InUse(_) | PoolError::Busy(_) => AdminError::Busy(error.to_string()),
        PoolError::Invalid(_) | PoolError::Device { .. } => AdminError::Invalid(error.to_string()),
        PoolError::Io(_) => AdminError::Io(format!("pool '{pool_name}': {error}")),
        _ => AdminError::Internal(format!("pool '{pool_name}': {error}")),
    }
}

/// A pool as [`open_pool`] opened it.
struct OpenedPool {
    pool: Arc<Pool>,
    /// The device being added (`record.adding`) was opened as a member.
    joined: bool,
    /// The device being attached (`record.attaching`) was opened as one of
    /// the pool's devices.
    attached: bool,
    /// Paths of `record.devices` that could not be opened.
    unopened: Vec<String>,
    /// Paths of `record.devices` left out because their member was removed
    /// (a removal that ended between the superblocks and the catalog).
    removed: Vec<String>,
}

/// Opens a pool's devices and the pool (replaying its log). Also says
/// whether the device being added (`record.adding`) or attached
/// (`record.attaching`), if any, was opened with it: it is when the pool's
/// superblocks list it; and which of the catalog's devices were left out
/// because their member was removed.
async fn open_pool(
    data_dir: &Path,
    name: &str,
    record: &PoolRecord,
    wraps: &DeviceWraps,
) -> Result<OpenedPool, AdminError> {
    let mut devices = Vec::new();
    // A device that cannot be opened is left out: a mirror opens without
    // one of its devices (DEGRADED); any other member missing fails the
    // open below, which then names these.
    let mut unopened = Vec::new();
    let mut unopened_paths = Vec::new();
    let mut paths = Vec::new();
    for device in &record.devices {
        match open_wrapped(&device.path, wraps) {
            Ok(opened) => {
                devices.push(opened);
                paths.push(device.path.clone());
            }
            Err(e) => {
                tracing::warn!("pool {name}: cannot open device {}: {e}", device.path);
                unopened.push(format!("cannot open device {}: {e}", device.path));
                unopened_paths.push(device.path.clone());
            }
        }
    }
    // Devices of a member removed after the catalog was last saved.
    let mut removed = Vec::new();
    let mut kept = Vec::new();
    for (device, path) in devices.iter().zip(paths) {
        if Pool::superblocks_removed(&devices, device).await {
            removed.push(path.clone());
        } else {
            kept.push(device.clone());
        }
    }
    let mut devices = kept;
    let mut joined = false;
    if let Some(adding) = &record.adding {
        // Unreadable or not listed: leave it out. If the superblocks do list
        // it, `Pool::open` then refuses with the missing member, as it must.
        if let Ok(candidate) = open_wrapped(&adding.path, wraps) {
            if Pool::superblocks_list(&devices, &candidate).await {
                devices.push(candidate);
                joined = true;
            }
        }
    }
    let mut attached = false;
    if let Some(attaching) = &record.attaching {
        // The same rule: its own superblock, once written, lists it (as a
        // stale copy), so it is opened with the pool whatever the others say.
        if let Ok(candidate) = open_wrapped(&attaching.path, wraps) {
            if Pool::superblocks_list(&devices, &candidate).await {
                devices.push(candidate);
                attached = true;
            }
        }
    }
    let pool = Pool::open_with(devices, pool_options(data_dir, name, record.ram_bytes))
        .await
        .map_err(|e| {
            let hint = match e {
                PoolError::Missing { .. } => {
                    " (every device of the pool must be listed under its \"devices\" in catalog.json and be readable)"
                }
                _ => "",
            };
            let unopened = if unopened.is_empty() {
                String::new()
            } else {
                format!(" ({})", unopened.join("; "))
            };
            AdminError::Internal(format!("pool {name}: {e}{hint}{unopened}"))
        })?;
    if pool.uuid() != record.uuid {
        return Err(AdminError::Internal(format!(
            "pool {name}: its devices belong to pool {} but the catalog expects {}",
            pool.uuid(),
            record.uuid
        )));
    }
    Ok(OpenedPool {
        pool,
        joined,
        attached,
        unopened: unopened_paths,
        removed,
    })
}

/// Takes the devices `pool` no longer uses (detached: a replaced device, or
/// one whose superblock the pool's newest no longer lists) out of `record`,
/// and, when the pool misses none of its devices, the paths in `record`
/// that could not be opened: none of them is a device of the pool. Returns
/// the detached devices, whose superblocks are cleared once the catalog is
/// saved without them.
fn forget_detached(pool_name: &str, pool: &Pool, record: &mut PoolRecord, unopened: &[String]) -> Vec<Arc<dyn Device>> {
    let detached = pool.take_detached();
    for device in &detached {
        let name = device.info().name.clone();
        record.devices.retain(|d| {
            let named = crate::pool::device_named(&name, &d.path);
            if named {
                tracing::warn!(
                    "pool {pool_name}: {} is no longer one of its devices; forgetting it",
                    d.path
                );
            }
            !named
        });
    }
    let missing = pool
        .status()
        .iter()
        .flat_map(|d| &d.children)
        .any(|c| c.state == crate::pool::vdev::Health::Missing);
    if !missing {
        record.devices.retain(|d| {
            let gone = unopened.contains(&d.path);
            if gone {
                tracing::warn!(
                    "pool {pool_name}: {} cannot be opened and the pool misses none of its devices; forgetting it",
                    d.path
                );
            }
            !gone
        });
    }
    detached
}

fn online() -> String {
    "ONLINE".into()
}

/// The action line of a degraded pool: which devices are not up to date,
/// and what brings them back.
fn pool_action(pool: &str, devices: &[DeviceStatus]) -> String {
    use crate::pool::vdev::Health;
    let mut out = Vec::new();
    for child in devices.iter().flat_map(|d| &d.children) {
        let replace = format!(
            "`strata pool replace {pool} {} NEW`",
            child.name.trim_start_matches("device ")
        );
        let what = match child.state {
            Health::Online if child.replaced => {
                "is being replaced: it is detached once its replacement is resilvered".to_string()
            }
            Health::Online => continue,
            Health::Resilvering if child.replacement => {
                "is being resilvered to replace another device; the mirror is whole again when it finishes".to_string()
            }
            Health::Resilvering => "is being resilvered; the mirror is whole again when it finishes".to_string(),
            Health::Faulted => format!(
                "failed a write and is faulted: replace it with {replace} (or check the device, then restart \
                 the daemon with it to resilver it)"
            ),
            Health::Stale => "missed writes: it is resilvered when the daemon next starts with it".to_string(),
            Health::Missing => format!(
                "is missing: replace it with {replace}, or make it available and restart the daemon to \
                 resilver it"
            ),
        };
        out.push(format!("{} {what}", child.name));
    }
    out.join("; ")
}

/// The role names `pool add-device` accepts (`fast`, `capacity`), with a
/// clear refusal for the others.
pub fn role_for_add(text: &str) -> Result<Role, AdminError> {
    match text {
        "fast" => Ok(Role::Fast),
        "capacity" => Ok(Role::Capacity),
        other => Err(role_refused(other)),
    }
}

fn role_refused(role: &str) -> AdminError {
    AdminError::Invalid(match role {
        "log" => "a log device cannot be added to an existing pool: the log's place is fixed when the pool is \
                  created; add fast or capacity devices"
            .to_string(),
        "ram" => "a RAM tier cannot be added as a pool device; add fast or capacity devices".to_string(),
        other => format!("unknown device role '{other}': add-device takes fast or capacity"),
    })
}

/// A device error without the device name and offset (the caller names the device).
fn device_error_reason(error: &DeviceError) -> String {
    match error {
        DeviceError::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

/// Creates the data directory owner-only (0700), or makes an existing one
/// so, saying so: it holds the API token, the catalog with CHAP secrets and
/// usually the device files.
fn make_private_dir(data_dir: &Path) -> Result<(), AdminError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|e| internal(&format!("cannot create data directory {}", data_dir.display()), e))?;
    let mode = fs::metadata(data_dir)
        .map_err(|e| internal(&format!("cannot stat {}", data_dir.display()), e))?
        .permissions()
        .mode()
        & 0o777;
    if mode != 0o700 {
        fs::set_permissions(data_dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| internal(&format!("cannot make {} private", data_dir.display()), e))?;
        tracing::info!("data directory {} was mode {mode:o}; made it 0700", data_dir.display());
    }
    Ok(())
}

/// Takes an exclusive `flock` on `DATA_DIR/lock` and records our pid in it.
fn lock_data_dir(data_dir: &Path) -> Result<File, AdminError> {
    let path = data_dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| internal(&format!("cannot open {}", path.display()), e))?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        return Err(AdminError::Busy(format!(
            "data directory {} is in use by another strata process (pid {})",
            data_dir.display(),
            holder.trim()
        )));
    }
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = write!(file, "{}", std::process::id());
    Ok(file)
}

/// First start: the default pool (one fast and one capacity device, sparse
/// files in the data directory) with one 10 GiB volume.
async fn initialise(data_dir: &Path, wraps: &DeviceWraps) -> Result<Catalog, AdminError> {
    let directory = pool_dir(data_dir, DEFAULT_POOL);
    fs::create_dir_all(&directory).map_err(|e| internal("cannot create pool directory", e))?;
    let mut records = Vec::new();
    let mut devices = Vec::new();
    for (file, role, size) in [
        ("fast.dev", Role::Fast, DEFAULT_FAST_BYTES),
        ("capacity.dev", Role::Capacity, DEFAULT_CAPACITY_BYTES),
    ] {
        let path = directory.join(file);
        if !path.exists() {
            create_file(&path, size).map_err(|e| internal("cannot create device file", e))?;
        }
        let device = open_wrapped(&path, wraps).map_err(|e| internal("cannot open device", e))?;
        devices.push(NewDevice { device, role });
        records.push(DeviceRecord {
            path: path.display().to_string(),
            role,
            mirror: None,
            write_mostly: false,
        });
    }
    sync_dir(&directory).map_err(|e| internal("cannot sync pool directory", e))?;
    let pool = Pool::create(DEFAULT_POOL, DEFAULT_CHUNK_BYTES, devices)
        .await
        .map_err(|e| AdminError::Internal(format!("cannot create the default pool: {e}")))?;
    let uuid = pool.uuid();
    // Close it again: `open` reopens every pool the catalog names.
    pool.checkpoint()
        .await
        .map_err(|e| AdminError::Internal(format!("cannot create the default pool: {e}")))?;
    drop(pool);
    let mut pool = PoolRecord {
        created_unix: now_unix(),
        uuid,
        devices: records,
        next_volume_id: 3,
        ..Default::default()
    };
    // A file dataset beside the volume, exported over NFS as /default/files.
    pool.datasets.insert(
        DEFAULT_DATASET.to_string(),
        super::catalog::DatasetRecord {
            id: 2,
            created_unix: now_unix(),
            properties: Default::default(),
        },
    );
    pool.volumes.insert(
        DEFAULT_VOLUME.to_string(),
        VolumeRecord {
            id: 1,
            created_unix: now_unix(),
            props: StoredProps {
                volsize: DEFAULT_VOLUME_BYTES,
                volblocksize: DEFAULT_VOLBLOCKSIZE,
                local: Default::default(),
            },
            receiving: None,
        },
    );
    let mut catalog = Catalog::empty();
    catalog.pools.insert(DEFAULT_POOL.to_string(), pool);
    catalog.save(data_dir).map_err(|e| internal("cannot save catalog", e))?;
    Ok(catalog)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::IoBuf;

    fn props(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let manager = Arc::new(VolumeManager::open(&path).await.unwrap());
        assert!(manager.lookup("default/vol0").is_some());
        assert!(matches!(VolumeManager::open(&path).await, Err(AdminError::Busy(_))));
        let status = manager.pool_status();
        assert_eq!(status.len(), 1);
        assert_eq!(status[0].devices.len(), 2);
        assert!(
            status[0].size_bytes > 70 << 30,
            "fast + capacity tiers: {}",
            status[0].size_bytes
        );
        // Admin calls block (the API runs them on the blocking pool).
        let m = manager.clone();
        tokio::task::spawn_blocking(move || {
            let info = m.create("default/db", 1 << 30, &props(&[("sync", "always")])).unwrap();
            assert_eq!(info.volsize, 1 << 30);
            assert!(matches!(
                m.create("default/db", 1 << 30, &[]),
                Err(AdminError::AlreadyExists(_))
            ));
            assert!(matches!(
                m.create("nopool/x", 1 << 30, &[]),
                Err(AdminError::NotFound(_))
            ));
            assert!(matches!(
                m.create("default/bad name", 1 << 30, &[]),
                Err(AdminError::Invalid(_))
            ));
            assert!(matches!(
                m.create("default/odd", 1000, &[]),
                Err(AdminError::Invalid(_))
            ));
            assert!(matches!(
                m.create("default/x", 1 << 30, &props(&[("colour", "red")])),
                Err(AdminError::Invalid(_))
            ));
            m.set("default/db", &props(&[("wce", "off")])).unwrap();
            assert!(!m.lookup("default/db").unwrap().wce());
            assert!(matches!(
                m.set("default/db", &props(&[("volblocksize", "8K")])),
                Err(AdminError::Invalid(_))
            ));
            m.resize("default/db", 2 << 30).unwrap();
            assert!(matches!(m.resize("default/db", 1 << 30), Err(AdminError::Invalid(_))));
            let guard = m.lookup("default/db").unwrap().open_handle();
            assert!(matches!(m.delete("default/db"), Err(AdminError::Busy(_))));
            drop(guard);
        })
        .await
        .unwrap();
        let volume = manager.lookup("default/db").unwrap();
        volume.write(0, IoBuf::copy_from(&[7u8; 4096]), true).await.unwrap();
        assert_eq!(manager.info("default/db").unwrap().used_bytes, 16 << 10);
        drop(volume);
        manager.close().await;
        drop(manager);
        let manager = Arc::new(VolumeManager::open(&path).await.unwrap());
        let reopened = manager.lookup("default/db").unwrap();
        assert_eq!(reopened.size_bytes(), 2 << 30);
        assert!(!reopened.wce());
        let (buf, result) = reopened.read(0, IoBuf::new(4096)).await;
        result.unwrap();
        assert!(buf.payload().iter().all(|&b| b == 7));
        assert_eq!(manager.info("default/db").unwrap().used_bytes, 16 << 10);
        drop(reopened);
        let m = manager.clone();
        tokio::task::spawn_blocking(move || m.delete("default/db").unwrap())
            .await
            .unwrap();
        assert!(manager.lookup("default/db").is_none());
        assert_eq!(manager.list().len(), 1);
        let used: u64 = manager.pool_status()[0].used_bytes;
        assert_eq!(used, 0, "the deleted volume's blocks are free again");
    }
}
