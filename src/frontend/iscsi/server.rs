//! The iSCSI listener and the target registry: which targets exist (one per
//! volume), and the logical unit shared by every session to a target.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::TcpListener;

use super::login::Directory;
use crate::control::manager::VolumeManager;
use crate::frontend::limits::ConnectionLimits;
use crate::frontend::Shutdown;
use crate::scsi::lu::LogicalUnit;
use crate::volume::props::{IscsiAccess, StoredProps};
use crate::volume::ServedVolume;

/// Refused connections whose login is answered at the same time.
const MAX_REFUSALS_ANSWERING: usize = 16;

/// Default prefix of target names: `<prefix>:<pool>.<volume>`.
pub const DEFAULT_IQN_PREFIX: &str = "iqn.2026-11.io.strata";

/// Appended to the prefix for snapshot targets:
/// `<prefix>.snapshot:<pool>.<volume>:<snapshot>`. The naming authority
/// itself differs (`io.strata.snapshot` is a subdomain of `io.strata`), so
/// no volume's target name can equal a snapshot's: a volume's has `:` right
/// after the prefix, a snapshot's has `.`. Volume names may hold every
/// character an IQN allows, so no separator inside the unique part could
/// promise that.
pub const SNAPSHOT_SEGMENT: &str = ".snapshot";

/// Targets and their logical units. Looked up once per login; the data path
/// holds its `Arc<LogicalUnit>` and never comes back here.
pub struct Registry {
    manager: Arc<VolumeManager>,
    iqn_prefix: String,
    units: Mutex<HashMap<String, Arc<LogicalUnit>>>,
    next_tsih: AtomicU16,
}

impl Registry {
    pub fn new(manager: Arc<VolumeManager>, iqn_prefix: &str) -> Self {
        Registry {
            manager,
            iqn_prefix: iqn_prefix.to_string(),
            units: Mutex::new(HashMap::new()),
            next_tsih: AtomicU16::new(1),
        }
    }

    /// The target name of a volume (`<prefix>:POOL.NAME`) or of a snapshot
    /// (`<prefix>.snapshot:POOL.NAME:SNAPSHOT`, see [`SNAPSHOT_SEGMENT`]).
    pub fn target_name(&self, volume: &ServedVolume) -> String {
        self.name_of(volume.pool(), volume.name())
    }

    /// The target name of export `name` of pool `pool`: a volume's short
    /// name, or `VOLUME@SNAPSHOT`.
    fn name_of(&self, pool: &str, name: &str) -> String {
        match name.split_once('@') {
            Some((volume, snapshot)) => format!("{}{SNAPSHOT_SEGMENT}:{pool}.{volume}:{snapshot}", self.iqn_prefix),
            None => format!("{}:{pool}.{name}", self.iqn_prefix),
        }
    }

    /// Every export (`pool/vol`, then its snapshots `pool/vol@snap`, oldest
    /// first) with its target name.
    fn exports(&self) -> Vec<(String, String)> {
        self.manager
            .export_names()
            .into_iter()
            .filter_map(|export| {
                let (pool, name) = export.split_once('/')?;
                let target = self.name_of(pool, name);
                Some((export, target))
            })
            .collect()
    }

    /// All target names: each volume's, then its snapshots'.
    pub fn targets(&self) -> Vec<String> {
        self.exports().into_iter().map(|(_, target)| target).collect()
    }

    /// The target names `initiator` may log in to (its discovery answer):
    /// a snapshot's target has its volume's rules. When the access rules
    /// cannot be read, none.
    pub fn targets_for(&self, initiator: &str) -> Vec<String> {
        // A volume's snapshots follow it: its rules are read once for all.
        let mut last: Option<(String, bool)> = None;
        self.exports()
            .into_iter()
            .filter(|(export, _)| {
                let volume = export.split_once('@').map_or(export.as_str(), |(volume, _)| volume);
                if let Some((name, allowed)) = &last {
                    if name == volume {
                        return *allowed;
                    }
                }
                let allowed = self
                    .manager
                    .stored_props(volume)
                    .map(|p| p.iscsi_access().initiator_allowed(initiator))
                    .unwrap_or(false);
                last = Some((volume.to_string(), allowed));
                allowed
            })
            .map(|(_, target)| target)
            .collect()
    }

    /// The volume (or read-only snapshot volume) behind `target_name`.
    fn volume_for(&self, target_name: &str) -> Option<Arc<ServedVolume>> {
        let (export, _) = self.exports().into_iter().find(|(_, target)| target == target_name)?;
        self.manager.lookup(&export)
    }

    /// The logical unit behind `target_name`, created on first use. A volume
    /// that was deleted and created again under the same name gets a new unit.
    pub fn unit(&self, target_name: &str) -> Option<Arc<LogicalUnit>> {
        let volume = self.volume_for(target_name)?;
        let mut units = self.units.lock().unwrap_or_else(|e| e.into_inner());
        // Units of deleted volumes and snapshots go (their sessions keep
        // their own reference until they end).
        units.retain(|_, unit| !unit.volume().is_deleted());
        if let Some(unit) = units.get(target_name) {
            if Arc::ptr_eq(unit.volume(), &volume) {
                return Some(unit.clone());
            }
        }
        let unit = Arc::new(LogicalUnit::new(volume, Some(self.manager.clone()), target_name));
        units.insert(target_name.to_string(), unit.clone());
        Some(unit)
    }

    /// Where connections record their requests.
    pub fn analytics(&self) -> &Arc<crate::analytics::Analytics> {
        self.manager.analytics()
    }

    /// A new non-zero session handle.
    pub fn new_tsih(&self) -> u16 {
        loop {
            let tsih = self.next_tsih.fetch_add(1, Ordering::Relaxed);
            if tsih != 0 {
                return tsih;
            }
        }
    }
}

impl Directory for Registry {
    /// The volume's `iscsi.*` properties: authentication and allow-list.
    fn target(&self, target_name: &str) -> Result<Option<IscsiAccess>, String> {
        let Some(volume) = self.volume_for(target_name) else {
            return Ok(None);
        };
        if volume.is_evicting() {
            // Answered 0x0300 (target error): try again after the rollback.
            return Err(format!(
                "{} is dropping its clients (a forced rollback)",
                volume.full_name()
            ));
        }
        // Read at every login, so a changed property applies to the next one.
        Ok(self
            .manager
            .stored_props(volume.full_name())
            .map(|p| StoredProps::iscsi_access(&p)))
    }

    /// `strata iscsi set discovery_auth=...`: read at every discovery login.
    fn discovery(&self) -> Result<Option<IscsiAccess>, String> {
        Ok(self.manager.discovery_access())
    }
}

/// Serves iSCSI on `listener` until `stop` becomes true. Each connection runs
/// on its own task; a failing connection never affects another.
pub async fn serve(listener: TcpListener, manager: Arc<VolumeManager>, limits: Arc<ConnectionLimits>, stop: Shutdown) {
    serve_with_prefix(listener, manager, limits, stop, DEFAULT_IQN_PREFIX).await
}

/// [`serve`] with a configurable target name prefix.
pub async fn serve_with_prefix(
    listener: TcpListener,
    manager: Arc<VolumeManager>,
    limits: Arc<ConnectionLimits>,
    mut stop: Shutdown,
    iqn_prefix: &str,
) {
    let registry = Arc::new(Registry::new(manager, iqn_prefix));
    // Refused connections answered at once; more are just closed, so a
    // flood of them cannot hold more than this many tasks and descriptors.
    let refusals = Arc::new(tokio::sync::Semaphore::new(MAX_REFUSALS_ANSWERING));
    let connection_stop = stop.clone();
    let mut connections = crate::frontend::Connections::default();
    loop {
        // The select only picks; the work happens after it, so no watch
        // guard is held across an await (the future must stay Send).
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopped| *stopped) => break,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let slot = match limits.admit(peer.ip()) {
                    Ok(slot) => slot,
                    Err(_) => {
                        // Answer the login with "out of resources" where
                        // the initiator sends one soon, then close.
                        if let Ok(permit) = refusals.clone().try_acquire_owned() {
                            connections.spawn(async move {
                                super::connection::refuse(stream).await;
                                drop(permit);
                            });
                        }
                        continue;
                    }
                };
                let registry = registry.clone();
                let stop = connection_stop.clone();
                connections.spawn(async move {
                    let _slot = slot;
                    let portal: Option<SocketAddr> = stream.local_addr().ok();
                    if let Err(e) = super::connection::run(stream, registry, portal, stop).await {
                        tracing::debug!("iSCSI connection from {peer} ended: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("iSCSI accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
    connections.drain("iscsi").await;
}
