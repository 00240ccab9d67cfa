//! The catalog: which pools and volumes exist and their properties.
//!
//! Stored as one JSON document, `catalog.json` in the data directory, replaced
//! atomically (write a temporary file, fsync it, rename it over the old one,
//! fsync the directory) so a crash leaves either the old or the new catalog,
//! never a mix. Admin operations are rare; the data path never reads it.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::volume::props::StoredProps;

pub const CATALOG_FILE: &str = "catalog.json";
/// Format 2: pools made of devices (the storage engine). Format 1, a
/// one-sparse-file-per-volume layout, is refused with a message.
pub const CATALOG_FORMAT: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Catalog {
    /// Layout version; a newer one is refused rather than misread.
    pub format: u32,
    pub pools: BTreeMap<String, PoolRecord>,
    /// Daemon-wide iSCSI settings (`strata iscsi set`), e.g.
    /// `discovery_auth`; absent in catalogs written before they existed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub iscsi: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    pub created_unix: u64,
    /// The pool's uuid as its device superblocks carry it.
    pub uuid: String,
    /// Where to find the devices; their superblocks say what they are.
    pub devices: Vec<DeviceRecord>,
    /// Volume ids are never reused, so a destroyed volume's blocks can never
    /// be mistaken for a new one's.
    pub next_volume_id: u32,
    pub volumes: BTreeMap<String, VolumeRecord>,
    /// RAM for caching (`--ram`); absent = the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_bytes: Option<u64>,
    /// A device being added (`pool add-device`), recorded before its
    /// superblocks are written and moved to `devices` once they all are. At
    /// the next start it is opened with the pool if the pool's superblocks
    /// list it (a crash after they started naming it), else dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adding: Option<DeviceRecord>,
    /// A device being attached to a member as a mirror copy (`pool attach`,
    /// `pool replace`), recorded before its superblock is written and moved
    /// to `devices` once every superblock names it. At the next start it is
    /// opened with the pool if the superblocks list it (its own included:
    /// then it is a stale copy, resilvered), else dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attaching: Option<DeviceRecord>,
    /// The GUIDs of received snapshots (by snapshot id; ids are never
    /// reused, so an entry of a deleted snapshot matches nothing): a
    /// received snapshot keeps its source's GUID, so an incremental
    /// stream's base can be found here. Other snapshots' GUIDs are derived
    /// (`control::manager::send`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub snapshot_guids: BTreeMap<u32, u64>,
    /// Pool properties set explicitly (`strata pool set`), canonical
    /// spelling by name (`migration`, `migration.high`, ...); absent ones
    /// have their defaults, and catalogs written before they existed have
    /// none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,
    /// File datasets (`strata fs`), by name; their ids come from the same
    /// space as volumes' (`next_volume_id`). Absent in catalogs written
    /// before they existed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub datasets: BTreeMap<String, DatasetRecord>,
}

/// A file dataset: its id in the pool (its namespace and its files' engine
/// object) and the properties set on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetRecord {
    pub id: u32,
    pub created_unix: u64,
    /// Canonical values by name (`recordsize`, `quota`, `nfs.*`,
    /// `snapshot.schedule`); absent ones have their defaults.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeviceRecord {
    pub path: String,
    pub role: crate::pool::superblock::Role,
    /// When creating a pool: devices with the same number (and role) form
    /// one mirror. Not stored: the superblocks say which devices mirror
    /// which.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<u8>,
    /// When creating a pool: a mirror's device that takes reads only when
    /// no other can (md's write-mostly: an HDD copy of an SSD). Not stored.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub write_mostly: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// The volume's id in the pool's block map.
    pub id: u32,
    pub created_unix: u64,
    pub props: StoredProps,
    /// Set while a stream is being received into the volume (and after an
    /// interrupted receive, until it is resumed or aborted): the volume is
    /// then not exported nor listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receiving: Option<ReceiveRecord>,
}

/// What is persisted of a receive in progress (`strata receive`): the
/// stream's identity and how much of it is applied and durable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiveRecord {
    pub kind: crate::control::stream::StreamKind,
    /// The sending side's `POOL/VOLUME`, snapshot and base names.
    pub source: String,
    pub snapshot: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub base: String,
    pub guid: u64,
    pub base_guid: u64,
    /// The base snapshot's id on this pool (incremental), rolled back to
    /// when the receive is aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_id: Option<u32>,
    pub stream_bytes: u64,
    /// Bytes of the stream applied and flushed: a record boundary.
    pub offset: u64,
    /// CRC-32C of the stream's first `offset` bytes.
    pub crc: u32,
    /// Records before `offset`, and the WRITE payload bytes among them.
    pub records: u64,
    pub data_bytes: u64,
    /// Where the last record before `offset` ended in the volume (records
    /// must come in increasing offset order).
    pub volume_end: u64,
}

impl Catalog {
    pub fn empty() -> Self {
        Catalog {
            format: CATALOG_FORMAT,
            pools: BTreeMap::new(),
            iscsi: BTreeMap::new(),
        }
    }

    /// Loads the catalog; `Ok(None)` when the directory has none yet.
    pub fn load(dir: &Path) -> Result<Option<Catalog>, String> {
        let path = dir.join(CATALOG_FILE);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{} is damaged: {e}", path.display()))?;
        let format = value.get("format").and_then(|f| f.as_u64()).unwrap_or(0);
        if format == 1 {
            return Err(format!(
                "{} uses the foundation layout (format 1, one file per volume), which this strata no longer \
                 reads; move the data directory aside and start again",
                path.display()
            ));
        }
        if format != CATALOG_FORMAT as u64 {
            return Err(format!(
                "{} has format {format}, this strata understands format {CATALOG_FORMAT}",
                path.display()
            ));
        }
        let catalog: Catalog =
            serde_json::from_value(value).map_err(|e| format!("{} is damaged: {e}", path.display()))?;
        Ok(Some(catalog))
    }

    /// Replaces the catalog on disk atomically and durably.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let path = dir.join(CATALOG_FILE);
        let temporary = dir.join(format!("{CATALOG_FILE}.tmp"));
        let mut text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        text.push(b'\n');
        {
            // 0600: the catalog holds iSCSI CHAP secrets in clear.
            let _ = fs::remove_file(&temporary);
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temporary)?;
            file.write_all(&text)?;
            file.sync_all()?;
        }
        fs::rename(&temporary, &path)?;
        sync_dir(dir)
    }
}

/// Makes a directory's entries (created, renamed, removed files) durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_version_check() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Catalog::load(dir.path()).unwrap(), None);
        let mut catalog = Catalog::empty();
        catalog.pools.insert("default".into(), PoolRecord::default());
        catalog.save(dir.path()).unwrap();
        assert_eq!(Catalog::load(dir.path()).unwrap(), Some(catalog.clone()));
        catalog.format = 99;
        catalog.save(dir.path()).unwrap();
        assert!(Catalog::load(dir.path()).unwrap_err().contains("format 99"));
        fs::write(dir.path().join(CATALOG_FILE), "{ not json").unwrap();
        assert!(Catalog::load(dir.path()).unwrap_err().contains("damaged"));
    }
}
