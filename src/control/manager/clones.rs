//! Clones as the admin sees them: `volume clone POOL/VOL@SNAP POOL/NEW`,
//! `volume promote POOL/CLONE`, the `origin` property, and the start-up
//! check that the engine knows no clone the catalog does not. The engine
//! does the work (`pool/snapshots/clones.rs`).

use super::*;

impl VolumeManager {
    /// Creates volume `name` (`POOL/NEW`, same pool) as a writable clone of
    /// snapshot `origin` (`POOL/VOL@SNAP`): instant, sharing every block
    /// with the snapshot until it changes it. It takes the origin volume's
    /// properties, its size and block size; `properties` override them
    /// (`volsize` may grow it, `volblocksize` cannot change).
    pub fn clone_volume(
        &self,
        origin: &str,
        name: &str,
        properties: &[(String, String)],
    ) -> Result<VolumeInfo, AdminError> {
        let (origin_pool, origin_volume, _) = split_snapshot_name(origin)?;
        let (pool_name, short) = split_volume_name(name)?;
        let mut catalog = self.catalog();
        let (pool, snapshot) = self.find_snapshot(&catalog, origin)?;
        if origin_pool != pool_name {
            return Err(AdminError::Invalid(format!(
                "a clone lives in its origin's pool: '{name}' is not in pool '{origin_pool}'"
            )));
        }
        let Some(pool_record) = catalog.pools.get(pool_name) else {
            return Err(AdminError::NotFound(format!("pool '{pool_name}' does not exist")));
        };
        if pool_record.volumes.contains_key(short) {
            return Err(AdminError::AlreadyExists(format!("volume '{name}' already exists")));
        }
        let source = pool_record
            .volumes
            .get(origin_volume)
            .ok_or_else(|| AdminError::NotFound(format!("volume '{pool_name}/{origin_volume}' does not exist")))?;
        let mut stored = source.props.clone();
        stored.volsize = snapshot.size_bytes;
        // A clone of a golden image must not start taking (and pruning)
        // snapshots because its origin's volume does: the schedule is the
        // one property a clone does not take over (give it with -o).
        stored.local.remove("snapshot.schedule");
        for (key, value) in properties {
            let value = canonical_value(key, value)?;
            match key.as_str() {
                "volsize" => {
                    let size: u64 = value.parse().map_err(|e| internal("volsize", e))?;
                    if size < snapshot.size_bytes {
                        return Err(AdminError::Invalid(format!(
                            "volsize {size} is smaller than the snapshot ({} bytes): a clone can only grow",
                            snapshot.size_bytes
                        )));
                    }
                    stored.volsize = size;
                }
                "volblocksize" if value != stored.volblocksize.to_string() => {
                    return Err(AdminError::Invalid(format!(
                        "a clone keeps its origin's volblocksize ({}): it shares its blocks",
                        stored.volblocksize
                    )));
                }
                "volblocksize" => {}
                _ => {
                    stored.local.insert(key.clone(), value);
                }
            }
        }
        check_volsize(stored.volsize, stored.volblocksize)?;
        let mut updated = catalog.clone();
        let id = add_volume_record(&mut updated, pool_name, short, &stored)?;
        // The engine first: a crash before the catalog names the clone
        // leaves an engine clone no volume has, removed at the next start.
        self.runtime
            .block_on(pool.create_clone(id, snapshot.id))
            .map_err(|e| internal("cannot create the clone", e))?;
        let props = stored.effective();
        let opened = pool
            .open_volume(id, props.volsize, props.volblocksize)
            .map_err(|e| internal("cannot open the new clone", e));
        let saved = opened.and_then(|engine| {
            updated
                .save(&self.data_dir)
                .map_err(|e| internal("cannot save catalog", e))
                .map(|()| engine)
        });
        let engine = match saved {
            Ok(engine) => engine,
            Err(e) => {
                if let Err(undo) = self.runtime.block_on(pool.destroy_volume(id)) {
                    tracing::error!("clone {name} failed and could not be undone: {undo}");
                }
                return Err(e);
            }
        };
        catalog.set(updated);
        self.register_volume(pool_name, short, engine, &props);
        self.apply_tier_pin(pool_name, id, &stored);
        tracing::info!("volume {name} cloned from {origin}");
        self.schedule_changed.notify_one();
        self.info_of(&catalog, name)
    }

    /// Promotes clone `name`: it no longer depends on its origin snapshot,
    /// which moves to it with the older snapshots of the origin's volume;
    /// that volume becomes a clone of the snapshot (`zfs promote`). Then
    /// the old volume can be deleted. Writes to both wait while the maps
    /// are rearranged; clients stay connected.
    pub fn promote(&self, name: &str) -> Result<VolumeInfo, AdminError> {
        let (pool_name, short) = split_volume_name(name)?;
        let catalog = self.catalog();
        let id = catalog
            .pools
            .get(pool_name)
            .and_then(|p| p.volumes.get(short))
            .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?
            .id;
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let origin = pool
            .origin_of(id)
            .and_then(|origin| pool.snapshot(origin))
            .ok_or_else(|| AdminError::Invalid(format!("volume '{name}' is not a clone")))?;
        let old_name = Self::volume_name_of(&catalog, pool_name, origin.volume);
        let engines = self.engines.read().unwrap_or_else(|e| e.into_inner());
        let (Some(clone), Some(old)) = (engines.get(name).cloned(), engines.get(&old_name).cloned()) else {
            return Err(AdminError::Internal(format!(
                "'{name}' or its origin's volume '{old_name}' is not open"
            )));
        };
        drop(engines);
        let moving: Vec<String> = pool
            .snapshots()
            .iter()
            .filter(|s| s.volume == origin.volume && s.generation <= origin.generation)
            .map(|s| format!("{old_name}@{}", s.name))
            .collect();
        if let Some(busy) = moving.iter().find(|s| self.open_snapshot_view(s).is_some()) {
            return Err(AdminError::Busy(format!(
                "snapshot '{busy}' is busy: exported to a client, and it would move to '{name}'; disconnect it first"
            )));
        }
        self.runtime.block_on(pool.promote(&clone, &old)).map_err(|e| match e {
            PoolError::Invalid(message) => AdminError::Invalid(message),
            other => AdminError::Internal(other.to_string()),
        })?;
        tracing::info!(
            "volume {name} promoted: {} now its own; {old_name} is a clone of {name}@{}",
            moving.join(", "),
            origin.name
        );
        self.info_of(&catalog, name)
    }

    /// `POOL/VOL@SNAP` of the snapshot volume `id` of `pool` was cloned
    /// from, if it is a clone.
    pub(super) fn origin_name(&self, catalog: &Catalog, pool_name: &str, id: u32) -> Option<String> {
        let pool = self.pool(pool_name)?;
        let origin = pool.snapshot(pool.origin_of(id)?)?;
        Some(self.snapshot_name(catalog, pool_name, &origin))
    }

    /// The space properties of volume `id`, as ZFS names them: `used`
    /// (what deleting it and its snapshots would free), `referenced` (what
    /// it maps, writes still in the RAM cache included), `usedbydataset`,
    /// `usedbysnapshots` and `written` (since its newest snapshot, or its
    /// origin). The last three count placed data: exact once the cache
    /// settles (`pool sync`). A volume with no snapshot and no origin
    /// shares nothing, and needs no map walk.
    pub(super) fn space_rows(
        &self,
        pool_name: &str,
        id: u32,
        volblocksize: u32,
        referenced: u64,
    ) -> Vec<(&'static str, u64)> {
        let block = volblocksize as u64;
        let shares = self
            .pool(pool_name)
            .filter(|pool| pool.origin_of(id).is_some() || pool.has_snapshots_of(id));
        let (dataset, snapshots, written) = match shares {
            None => (referenced, 0, referenced),
            Some(pool) => match pool.volume_space(id) {
                Ok(space) => (space.dataset * block, space.snapshots * block, space.written * block),
                Err(e) => {
                    tracing::error!("space of volume {pool_name}/#{id}: {e}");
                    return Vec::new();
                }
            },
        };
        vec![
            ("used", dataset + snapshots),
            ("referenced", referenced),
            ("usedbydataset", dataset),
            ("usedbysnapshots", snapshots),
            ("written", written),
        ]
    }

    /// Names for the clones (volume ids) that depend on a snapshot.
    pub(super) fn clone_names(catalog: &Catalog, pool_name: &str, ids: &[u32]) -> String {
        ids.iter()
            .map(|id| Self::volume_name_of(catalog, pool_name, *id))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Removes the engine's clones that the catalog does not name (a crash
/// between `clone`'s two steps): nothing refers to them.
pub(super) async fn remove_unnamed_clones(pool_name: &str, pool: &Pool, record: &PoolRecord) {
    for (volume, _) in pool.clones() {
        if record.volumes.values().any(|v| v.id == volume) || record.datasets.values().any(|d| d.id == volume) {
            continue;
        }
        match pool.destroy_volume(volume).await {
            Ok(()) => tracing::warn!("pool {pool_name}: removed clone {volume}, which no volume name refers to"),
            Err(e) => tracing::error!("pool {pool_name}: cannot remove unnamed clone {volume}: {e}"),
        }
    }
}
