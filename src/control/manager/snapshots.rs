//! Snapshots as the admin sees them: `POOL/VOL@SNAP` names, the commands
//! and API calls, and read-only snapshot volumes for the frontends. The
//! engine keeps the snapshots themselves (`pool/snapshots/`); the catalog
//! does not list them.

use super::*;
use crate::pool::snapshots::{SnapshotInfo, SnapshotRequest};
use std::sync::Weak;

/// What `snapshot list` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotView {
    /// `pool/volume@snapshot`
    pub name: String,
    pub pool: String,
    /// `pool/volume`
    pub volume: String,
    pub snapshot: String,
    pub created_unix: u64,
    /// The volume's size when the snapshot was taken.
    pub size_bytes: u64,
    /// The blocks the snapshot maps, in bytes.
    pub referenced_bytes: u64,
    /// What deleting it would free.
    pub used_bytes: u64,
    /// What it maps that the snapshot before it does not (all it maps, for
    /// the volume's oldest).
    pub written_bytes: u64,
    /// Open connections to its read-only export.
    pub connections: usize,
}

/// Splits `pool/volume@snapshot` and validates its parts.
pub fn split_snapshot_name(text: &str) -> Result<(&str, &str, &str), AdminError> {
    let (volume, snapshot) = text
        .split_once('@')
        .ok_or_else(|| AdminError::Invalid(format!("invalid snapshot name '{text}': expected POOL/VOLUME@SNAPSHOT")))?;
    let (pool, name) = split_volume_name(volume)?;
    validate_component("snapshot", snapshot)?;
    if snapshot.len() > crate::meta::log::MAX_SNAPSHOT_NAME {
        return Err(AdminError::Invalid(format!(
            "invalid snapshot name '{snapshot}': at most {} bytes",
            crate::meta::log::MAX_SNAPSHOT_NAME
        )));
    }
    Ok((pool, name, snapshot))
}

/// How long `rollback --force` waits for the dropped clients' connections
/// to end (they finish the requests in flight first).
const EVICTION_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Volumes dropping their clients; new clients are admitted again when it
/// is dropped (after the rollback, or when it failed), unless it is kept
/// (the volumes were deleted).
pub(super) struct Eviction(Vec<Arc<ServedVolume>>);

impl Eviction {
    /// Refuses new clients of `volumes` (those connected stay).
    pub(super) fn refuse_clients(volumes: Vec<Arc<ServedVolume>>) -> Eviction {
        for volume in &volumes {
            volume.refuse_clients();
        }
        Eviction(volumes)
    }

    pub(super) fn volumes(&self) -> &[Arc<ServedVolume>] {
        &self.0
    }

    /// Refuses new clients for good: the volumes are gone.
    pub(super) fn keep(mut self) {
        self.0.clear();
    }

    /// Tells the frontends to close every connection to `volumes` and waits
    /// until they have, up to [`EVICTION_WAIT`].
    fn drop_clients(volumes: Vec<Arc<ServedVolume>>, volume_name: &str) -> Result<Eviction, AdminError> {
        for volume in &volumes {
            volume.begin_eviction();
        }
        let eviction = Eviction(volumes);
        let started = std::time::Instant::now();
        let mut logged = false;
        loop {
            let (nbd, iscsi) = eviction
                .0
                .iter()
                .map(|v| v.clients())
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
            if nbd + iscsi == 0 {
                return Ok(eviction);
            }
            if !logged {
                tracing::warn!(
                    "rollback --force of {volume_name}: dropping {nbd} NBD client(s) and {iscsi} iSCSI session(s)"
                );
                logged = true;
            }
            if started.elapsed() > EVICTION_WAIT {
                return Err(AdminError::Busy(format!(
                    "volume '{volume_name}': {nbd} NBD client(s) and {iscsi} iSCSI session(s) did not disconnect \
                     within {} s (requests still in flight); nothing was rolled back",
                    EVICTION_WAIT.as_secs()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

impl Drop for Eviction {
    fn drop(&mut self) {
        for volume in &self.0 {
            volume.end_eviction();
        }
    }
}

/// A snapshot's read-only export, by `POOL/VOL@SNAP`.
pub(super) enum Export {
    /// Opened for clients; gone when the last of them closes.
    Open(Weak<ServedVolume>),
    /// Being deleted: no client may open it.
    Deleting,
}

/// Snapshots being deleted (see [`VolumeManager::claim_for_delete`]).
struct DeleteClaim<'a> {
    manager: &'a VolumeManager,
    names: Vec<String>,
}

impl Drop for DeleteClaim<'_> {
    fn drop(&mut self) {
        let mut views = self.manager.snapshot_views.lock().unwrap_or_else(|e| e.into_inner());
        for name in &self.names {
            views.remove(name);
        }
    }
}

/// Each volume's snapshot space (`Pool::snapshot_space`): (used, written)
/// by snapshot id, by (pool, volume id).
type SpaceByVolume = HashMap<(String, u32), HashMap<u32, (u64, u64)>>;

fn pool_error(error: PoolError) -> AdminError {
    match error {
        PoolError::Invalid(message) if message.ends_with("exists") => AdminError::AlreadyExists(message),
        PoolError::Invalid(message) => AdminError::Invalid(message),
        other => AdminError::Internal(other.to_string()),
    }
}

impl VolumeManager {
    /// Takes snapshots `POOL/VOL@SNAP...` of volumes of one pool, at one
    /// consistency point.
    pub fn create_snapshots(&self, names: &[String]) -> Result<Vec<SnapshotView>, AdminError> {
        if names.is_empty() {
            return Err(AdminError::Invalid("name at least one POOL/VOLUME@SNAPSHOT".into()));
        }
        let catalog = self.catalog();
        let mut parsed = Vec::with_capacity(names.len());
        for name in names {
            parsed.push(split_snapshot_name(name)?);
        }
        // Every volume must exist (404) before the rule on their pools.
        let engines = self.engines.read().unwrap_or_else(|e| e.into_inner());
        let mut volumes = Vec::with_capacity(parsed.len());
        for (pool, volume, _) in &parsed {
            let full = full_name(pool, volume);
            volumes.push(
                engines
                    .get(&full)
                    .cloned()
                    .ok_or_else(|| AdminError::NotFound(format!("volume '{full}' does not exist")))?,
            );
        }
        drop(engines);
        let pool_name = parsed[0].0;
        if parsed.iter().any(|(pool, _, _)| *pool != pool_name) {
            return Err(AdminError::Invalid(
                "snapshots taken together must be of volumes of one pool".into(),
            ));
        }
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let requests: Vec<SnapshotRequest<'_>> = volumes
            .iter()
            .zip(&parsed)
            .map(|(volume, (_, _, snapshot))| SnapshotRequest {
                volume,
                name: snapshot.to_string(),
            })
            .collect();
        let started = std::time::Instant::now();
        let taken = self
            .runtime
            .block_on(pool.create_snapshots(&requests))
            .map_err(pool_error)?;
        let engine = started.elapsed();
        for info in &taken {
            tracing::info!("snapshot {} taken", self.snapshot_name(&catalog, pool_name, info));
        }
        let mut space = HashMap::new();
        let views = taken
            .iter()
            .map(|info| self.snapshot_view(&catalog, pool_name, &pool, info, &mut space))
            .collect();
        tracing::debug!(
            "snapshot create: {} µs in the engine, {} µs with the reply's figures",
            engine.as_micros(),
            started.elapsed().as_micros()
        );
        Ok(views)
    }

    /// Every snapshot, or those of volume `POOL/VOL`, oldest first per volume.
    pub fn list_snapshots(&self, volume: Option<&str>) -> Result<Vec<SnapshotView>, AdminError> {
        let catalog = self.published();
        let wanted = match volume {
            Some(name) => {
                let (pool, short) = split_volume_name(name)?;
                let id = catalog
                    .pools
                    .get(pool)
                    .and_then(|p| p.volumes.get(short))
                    .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?
                    .id;
                Some((pool, id))
            }
            None => None,
        };
        let mut views = Vec::new();
        let mut space = HashMap::new();
        for pool_name in catalog.pools.keys() {
            if wanted.is_some_and(|(pool, _)| pool != pool_name) {
                continue;
            }
            let Some(pool) = self.pool(pool_name) else { continue };
            let infos = match wanted {
                Some((_, id)) => pool.snapshots_of(id),
                // Volumes' snapshots only (datasets' are `fs snapshots`).
                None => {
                    let volumes: std::collections::HashSet<u32> =
                        catalog.pools[pool_name].volumes.values().map(|r| r.id).collect();
                    pool.snapshots()
                        .into_iter()
                        .filter(|s| volumes.contains(&s.volume))
                        .collect()
                }
            };
            for info in infos {
                views.push(self.snapshot_view(&catalog, pool_name, &pool, &info, &mut space));
            }
        }
        views.sort_by(|a, b| a.volume.cmp(&b.volume));
        Ok(views)
    }

    /// The names (`POOL/VOL@SNAP`) of volume `POOL/VOL`'s snapshots, oldest
    /// first (for export lists: no space computed).
    pub fn snapshot_names(&self, volume: &str) -> Vec<String> {
        let Ok((pool_name, short)) = split_volume_name(volume) else {
            return Vec::new();
        };
        let Some(id) = self
            .published()
            .pools
            .get(pool_name)
            .and_then(|p| p.volumes.get(short))
            .map(|record| record.id)
        else {
            return Vec::new();
        };
        let Some(pool) = self.pool(pool_name) else {
            return Vec::new();
        };
        pool.snapshots_of(id)
            .into_iter()
            .map(|s| format!("{volume}@{}", s.name))
            .collect()
    }

    /// Every volume `POOL/VOL`, each followed by its snapshots
    /// `POOL/VOL@SNAP` oldest first: every export, sorted by pool and
    /// volume. One pass over each pool's snapshots (iSCSI logins and
    /// discovery list them all).
    pub fn export_names(&self) -> Vec<String> {
        let catalog = self.published();
        let mut names = Vec::new();
        for (pool_name, record) in &catalog.pools {
            let snapshots = self.pool(pool_name).map(|p| p.snapshots()).unwrap_or_default();
            let mut by_volume: HashMap<u32, Vec<&str>> = HashMap::new();
            for snapshot in &snapshots {
                by_volume.entry(snapshot.volume).or_default().push(&snapshot.name);
            }
            for (name, volume) in &record.volumes {
                let full = full_name(pool_name, name);
                let snapshots = by_volume.get(&volume.id).into_iter().flatten();
                let of_volume: Vec<String> = snapshots.map(|snapshot| format!("{full}@{snapshot}")).collect();
                names.push(full);
                names.extend(of_volume);
            }
        }
        names
    }

    /// Deletes snapshot `POOL/VOL@SNAP`; refused while its export has
    /// clients.
    pub fn delete_snapshot(&self, name: &str) -> Result<(), AdminError> {
        let catalog = self.catalog();
        let (pool_name, _, _) = split_snapshot_name(name)?;
        let (pool, info) = self.find_snapshot(&catalog, name)?;
        let _claim = self.claim_for_delete(&[name.to_string()]).map_err(|(_, connections)| {
            AdminError::Busy(format!(
                "snapshot '{name}' is busy: {connections} client connection(s) open"
            ))
        })?;
        self.runtime
            .block_on(pool.destroy_snapshot(info.id))
            .map_err(|e| match e {
                PoolError::HasClones(ids) => AdminError::Busy(format!(
                "snapshot '{name}' has clones ({}): promote them (strata volume promote CLONE) or delete them first",
                Self::clone_names(&catalog, pool_name, &ids)
            )),
                other => pool_error(other),
            })?;
        tracing::info!("snapshot {} deleted", self.snapshot_name(&catalog, pool_name, &info));
        Ok(())
    }

    /// Rolls volume `POOL/VOL` back to snapshot `POOL/VOL@SNAP`. It must be
    /// the newest, unless `destroy_newer` (`-r`), which deletes the newer
    /// ones first. Refused while the volume (or a snapshot to delete) has
    /// clients. The volume keeps its size.
    pub fn rollback_snapshot(&self, name: &str, destroy_newer: bool) -> Result<(), AdminError> {
        self.rollback_snapshot_forced(name, destroy_newer, false)
    }

    /// [`Self::rollback_snapshot`]; with `force`, the clients of the volume
    /// (and of the newer snapshots `-r` deletes) are dropped first: each
    /// NBD connection and iSCSI connection is closed after the replies to
    /// what it had in flight, and no new one is admitted until the
    /// rollback is done.
    pub fn rollback_snapshot_forced(&self, name: &str, destroy_newer: bool, force: bool) -> Result<(), AdminError> {
        let (pool_name, short, _) = split_snapshot_name(name)?;
        let volume_name = full_name(pool_name, short);
        let volume = self
            .volumes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&volume_name)
            .cloned();
        // Clients are dropped before the catalog is taken: that may take up
        // to EVICTION_WAIT, and other admin calls need not wait for it.
        let _evicted = if force {
            let (pool, info) = self.find_snapshot(&self.catalog(), name)?;
            let newer: Vec<SnapshotInfo> = pool
                .snapshots_of(info.volume)
                .into_iter()
                .filter(|s| s.generation > info.generation)
                .collect();
            if newer.is_empty() || destroy_newer {
                let mut clients: Vec<Arc<ServedVolume>> = volume.iter().cloned().collect();
                for snapshot in newer {
                    clients.extend(self.open_snapshot_view(&format!("{volume_name}@{}", snapshot.name)));
                }
                Some(Eviction::drop_clients(clients, &volume_name)?)
            } else {
                // Refused below, with no client dropped.
                None
            }
        } else {
            None
        };
        // No client connects while the volume is checked and rolled back
        // (it would see its data change under it).
        let _refused = match (&_evicted, &volume) {
            (None, Some(volume)) => Some(Eviction::refuse_clients(vec![volume.clone()])),
            _ => None,
        };
        let catalog = self.catalog();
        let (pool, info) = self.find_snapshot(&catalog, name)?;
        if let Some(volume) = &volume {
            let (nbd, iscsi) = volume.clients();
            if nbd + iscsi > 0 {
                return Err(AdminError::Busy(format!(
                    "volume '{volume_name}' is busy: {nbd} NBD client(s) and {iscsi} iSCSI session(s) connected; \
                     disconnect them, or roll back with --force to drop them"
                )));
            }
        }
        let newer: Vec<SnapshotInfo> = pool
            .snapshots_of(info.volume)
            .into_iter()
            .filter(|s| s.generation > info.generation)
            .collect();
        if !newer.is_empty() && !destroy_newer {
            let names: Vec<String> = newer.iter().map(|s| format!("@{}", s.name)).collect();
            return Err(AdminError::Invalid(format!(
                "more recent snapshots of '{volume_name}' exist ({}): delete them, or roll back with -r to delete them",
                names.join(", ")
            )));
        }
        let newer_names: Vec<String> = newer.iter().map(|s| format!("{volume_name}@{}", s.name)).collect();
        let _claim = self.claim_for_delete(&newer_names).map_err(|(busy, _)| {
            AdminError::Busy(format!(
                "snapshot '{busy}' is busy: its export has clients; disconnect them, or roll back with --force to \
                 drop them"
            ))
        })?;
        for (snapshot, newer_name) in newer.iter().zip(&newer_names).rev() {
            self.runtime
                .block_on(pool.destroy_snapshot(snapshot.id))
                .map_err(pool_error)?;
            tracing::info!("snapshot {newer_name} deleted (rollback -r)");
        }
        let engine = self
            .engines
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&volume_name)
            .cloned()
            .ok_or_else(|| AdminError::NotFound(format!("volume '{volume_name}' does not exist")))?;
        self.runtime
            .block_on(pool.rollback(&engine, info.id))
            .map_err(pool_error)?;
        tracing::info!("volume {volume_name} rolled back to {name}");
        Ok(())
    }

    /// The snapshots of the same volume older than `POOL/VOL@SNAP`, oldest
    /// first, as (snapshot name, engine id): what its changed-block
    /// contexts may compare with. Empty for a volume or an unknown name.
    pub fn older_snapshots(&self, name: &str) -> Vec<(String, u32)> {
        if !name.contains('@') {
            return Vec::new();
        }
        let Ok((pool, info)) = self.find_snapshot(&self.published(), name) else {
            return Vec::new();
        };
        pool.snapshots_of(info.volume)
            .into_iter()
            .filter(|s| s.generation < info.generation)
            .map(|s| (s.name, s.id))
            .collect()
    }

    /// The read-only volume of snapshot `POOL/VOL@SNAP`, for an export.
    /// Opened under the views' lock, so it is never opened beside another
    /// view of the same snapshot, nor once a deletion claimed it.
    pub(super) fn snapshot_volume(&self, name: &str) -> Option<Arc<ServedVolume>> {
        let mut views = self.snapshot_views.lock().unwrap_or_else(|e| e.into_inner());
        match views.get(name) {
            Some(Export::Deleting) => return None,
            Some(Export::Open(view)) => {
                if let Some(open) = view.upgrade() {
                    return Some(open);
                }
            }
            None => {}
        }
        let catalog = self.published();
        let (pool_name, short, _) = split_snapshot_name(name).ok()?;
        let (pool, info) = self.find_snapshot(&catalog, name).ok()?;
        let record = catalog.pools.get(pool_name)?.volumes.get(short)?;
        let props = record.props.effective();
        let engine = pool.open_snapshot(info.id, props.volblocksize).ok()?;
        let short_name = name.split_once('/')?.1;
        let volume = Arc::new(ServedVolume::new(pool_name, short_name, engine, &props));
        views.insert(name.to_string(), Export::Open(Arc::downgrade(&volume)));
        Some(volume)
    }

    pub(super) fn open_snapshot_view(&self, name: &str) -> Option<Arc<ServedVolume>> {
        match self.snapshot_views.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
            Some(Export::Open(view)) => view.upgrade(),
            _ => None,
        }
    }

    /// Claims snapshots `names` for deletion: their exports take no new
    /// client until the claim is dropped (after the engine deleted them, or
    /// failed to). Refused, with nothing claimed, when one has clients:
    /// returns its name and client count.
    fn claim_for_delete(&self, names: &[String]) -> Result<DeleteClaim<'_>, (String, usize)> {
        let mut views = self.snapshot_views.lock().unwrap_or_else(|e| e.into_inner());
        // Clients of the open views are refused before they are counted: a
        // handshake holding a view is either counted or refused.
        let open: Vec<Arc<ServedVolume>> = names
            .iter()
            .filter_map(|name| match views.get(name) {
                Some(Export::Open(view)) => view.upgrade(),
                _ => None,
            })
            .collect();
        let refused = Eviction::refuse_clients(open);
        for view in refused.volumes() {
            let connections = view.open_handles();
            if connections > 0 {
                return Err((view.full_name().to_string(), connections));
            }
        }
        for name in names {
            if let Some(Export::Open(view)) = views.insert(name.clone(), Export::Deleting) {
                if let Some(view) = view.upgrade() {
                    view.mark_deleted();
                }
            }
        }
        // Deleted (or, should the engine fail, left to be opened afresh
        // once the claim is dropped): these views take no client again.
        refused.keep();
        Ok(DeleteClaim {
            manager: self,
            names: names.to_vec(),
        })
    }

    pub(super) fn find_snapshot(&self, catalog: &Catalog, name: &str) -> Result<(Arc<Pool>, SnapshotInfo), AdminError> {
        let (pool_name, short, snapshot) = split_snapshot_name(name)?;
        let missing = || AdminError::NotFound(format!("snapshot '{name}' does not exist"));
        let id = catalog
            .pools
            .get(pool_name)
            .and_then(|p| p.volumes.get(short))
            .ok_or_else(missing)?
            .id;
        let pool = self.pool(pool_name).ok_or_else(missing)?;
        let info = pool.snapshot_named(id, snapshot).ok_or_else(missing)?;
        Ok((pool, info))
    }

    pub(super) fn volume_name_of(catalog: &Catalog, pool: &str, id: u32) -> String {
        catalog
            .pools
            .get(pool)
            .and_then(|p| {
                p.volumes
                    .iter()
                    .find_map(|(name, record)| (record.id == id).then_some(name))
                    .or_else(|| {
                        p.datasets
                            .iter()
                            .find_map(|(name, record)| (record.id == id).then_some(name))
                    })
            })
            .map(|name| full_name(pool, name))
            .unwrap_or_else(|| format!("{pool}/#{id}"))
    }

    pub(super) fn snapshot_name(&self, catalog: &Catalog, pool: &str, info: &SnapshotInfo) -> String {
        format!("{}@{}", Self::volume_name_of(catalog, pool, info.volume), info.name)
    }

    /// `space` keeps each volume's snapshot space (one walk per volume).
    fn snapshot_view(
        &self,
        catalog: &Catalog,
        pool_name: &str,
        pool: &Pool,
        info: &SnapshotInfo,
        space: &mut SpaceByVolume,
    ) -> SnapshotView {
        let volume = Self::volume_name_of(catalog, pool_name, info.volume);
        let name = format!("{volume}@{}", info.name);
        let volblocksize = catalog
            .pools
            .get(pool_name)
            .and_then(|p| p.volumes.values().find(|r| r.id == info.volume))
            .map_or(0, |r| r.props.volblocksize as u64);
        let of_volume = space.entry((pool_name.to_string(), info.volume)).or_insert_with(|| {
            match pool.snapshot_space(info.volume) {
                Ok(space) => space
                    .into_iter()
                    .map(|(id, used, written)| (id, (used, written)))
                    .collect(),
                Err(e) => {
                    tracing::error!("space of the snapshots of {volume}: {e}");
                    HashMap::new()
                }
            }
        });
        let (used, written) = of_volume.get(&info.id).copied().unwrap_or((0, 0));
        SnapshotView {
            used_bytes: used * volblocksize,
            written_bytes: written * volblocksize,
            connections: self.open_snapshot_view(&name).map_or(0, |v| v.open_handles()),
            name,
            pool: pool_name.to_string(),
            volume,
            snapshot: info.name.clone(),
            created_unix: info.created_unix,
            size_bytes: info.size_bytes,
            referenced_bytes: info.mapped_blocks * volblocksize,
        }
    }
}
