//! `pool remove`: taking a member (a device, or a whole mirror) out of a
//! running pool. The pool moves its data and records each step in the
//! superblocks (`pool/remove.rs`); the catalog drops its devices once the
//! superblocks do. A start after a crash resumes a removal the superblocks
//! say is under way ([`VolumeManager::resume_removals`]), and leaves out a
//! device the catalog still lists after its member was removed (settled in
//! `open_pool`).

use std::sync::Arc;

use super::{canonical_device_path, validate_component, AdminError, PoolStatus, VolumeManager};
use crate::pool::{Pool, PoolError};

/// Whether the device name `name` (a path, or wrappers around one:
/// `delay(PATH)`) is the catalog's device `path`.
pub(super) fn names_path(name: &str, path: &str) -> bool {
    name == path || name.contains(&format!("({path})"))
}

impl VolumeManager {
    /// Starts removing `device` (the path of a single device, or
    /// `mirror-N`, or the path of any device of mirror N: the whole mirror
    /// goes) from pool `pool_name`: refused at once with the reason when
    /// it cannot be done, else the member takes no new data from now on,
    /// its blocks move in the background (`pool status` shows the
    /// progress), and when they have, it leaves the pool and the catalog.
    pub fn remove_device(self: &Arc<Self>, pool_name: &str, device: &str) -> Result<PoolStatus, AdminError> {
        validate_component("pool", pool_name)?;
        if device.is_empty() {
            return Err(AdminError::Invalid("missing device".into()));
        }
        let catalog = self.catalog();
        if !catalog.pools.contains_key(pool_name) {
            return Err(AdminError::NotFound(format!("pool '{pool_name}' does not exist")));
        }
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' is in the catalog but not open")))?;
        let canonical = canonical_device_path(device).unwrap_or_else(|_| device.to_string());
        let index = pool
            .member_named(&canonical)
            .or_else(|| pool.member_named(device))
            .ok_or_else(|| AdminError::NotFound(format!("{device} is not a device of pool '{pool_name}'")))?;
        self.runtime.block_on(pool.start_removal(index)).map_err(|e| match e {
            PoolError::Invalid(_) => AdminError::Invalid(e.to_string()),
            _ => AdminError::Internal(format!("cannot remove {device} from pool '{pool_name}': {e}")),
        })?;
        drop(catalog);
        self.spawn_removal(pool_name, &pool, index, false);
        self.pool_status()
            .into_iter()
            .find(|p| p.name == pool_name)
            .ok_or_else(|| AdminError::Internal(format!("pool '{pool_name}' vanished")))
    }

    /// Resumes every removal the pools' superblocks say is under way (the
    /// daemon stopped during one). Called once the manager is shared.
    pub fn resume_removals(self: &Arc<Self>) {
        for (name, pool) in self.open_pools() {
            for index in pool.evacuating_members() {
                tracing::info!("pool {name}: resuming the removal of member {index}");
                self.spawn_removal(&name, &pool, index, true);
            }
        }
    }

    /// Moves member `index`'s data off in the background (after starting
    /// the removal, when `start`: a resumed one) and, once it is out of the
    /// pool, drops its devices from the catalog.
    fn spawn_removal(self: &Arc<Self>, pool_name: &str, pool: &Arc<Pool>, index: u8, start: bool) {
        let manager = self.clone();
        let pool = pool.clone();
        let pool_name = pool_name.to_string();
        self.runtime.spawn(async move {
            if start {
                if let Err(e) = pool.start_removal(index).await {
                    tracing::error!(
                        "pool {pool_name}: cannot resume the removal of member {index}: {e}; it takes no new data \
                         until `strata pool remove` is run for it again"
                    );
                    return;
                }
            }
            let names = pool.member_device_names(index);
            if pool.finish_removal(index).await.is_err() {
                // Logged and shown in `pool status` by the pool.
                return;
            }
            let done = tokio::task::spawn_blocking(move || manager.forget_devices(&pool_name, &names)).await;
            match done.map_err(|e| AdminError::Internal(e.to_string())) {
                // Not listed any more: its superblocks can go.
                Ok(Ok(())) => pool.release_removed(index).await,
                Ok(Err(e)) | Err(e) => tracing::error!(
                    "the member is out of the pool, but the catalog could not be updated ({e}); the next start \
                     leaves its devices out and updates it"
                ),
            }
        });
    }

    /// Drops the catalog's devices of pool `pool_name` that `names` name.
    fn forget_devices(&self, pool_name: &str, names: &[String]) -> Result<(), AdminError> {
        let mut catalog = self.catalog();
        let mut next = catalog.clone();
        if let Some(record) = next.pools.get_mut(pool_name) {
            record
                .devices
                .retain(|d| !names.iter().any(|name| names_path(name, &d.path)));
        }
        if next == *catalog {
            return Ok(());
        }
        next.save(self.data_dir())
            .map_err(|e| AdminError::Internal(format!("cannot save the catalog: {e}")))?;
        catalog.set(next);
        Ok(())
    }
}
