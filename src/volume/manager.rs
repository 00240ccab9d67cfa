//! The volume manager: opens the data directory, keeps the catalog and the
//! open volumes, and carries out admin operations (create, set, resize,
//! delete). Frontends look volumes up here once per connection; the data path
//! never takes the manager's locks.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use super::file::FileBacking;
use super::props::{canonical_value, PropError, PropertyRow, StoredProps, DEFAULT_VOLBLOCKSIZE};
use super::{full_name, BlockDevice, Volume};
use crate::meta::catalog::{sync_dir, Catalog, PoolRecord, VolumeRecord};

pub const DEFAULT_POOL: &str = "default";
pub const DEFAULT_VOLUME: &str = "vol0";
pub const DEFAULT_VOLUME_BYTES: u64 = 10 << 30;
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
}

impl From<PropError> for AdminError {
    fn from(error: PropError) -> Self {
        AdminError::Invalid(error.to_string())
    }
}

/// What `volume list` and `volume get` show.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub name: String,
    /// How volumes are stored: `file-per-volume` until the tiered engine lands.
    pub backing: String,
    pub path: String,
    pub volumes: usize,
    /// Sum of all volume sizes (thin: may exceed the space available).
    pub provisioned_bytes: u64,
    pub used_bytes: u64,
    /// Free space of the file system holding the pool.
    pub available_bytes: u64,
    pub read_errors: u64,
    pub write_errors: u64,
}

pub struct VolumeManager {
    data_dir: PathBuf,
    /// Serialises admin operations and holds the catalog as last saved.
    catalog: Mutex<Catalog>,
    volumes: RwLock<HashMap<String, Arc<Volume>>>,
    /// Held open (and `flock`ed) so a second daemon on the same directory is refused.
    _lock: File,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn new_guid() -> String {
    let mut bytes = [0u8; 8];
    let filled = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if filled.is_err() {
        // No /dev/urandom: fall back to the clock, unique enough for file names.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = (nanos as u64 ^ std::process::id() as u64).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
    /// first time.
    pub fn open(data_dir: &Path) -> Result<Self, AdminError> {
        fs::create_dir_all(data_dir)
            .map_err(|e| internal(&format!("cannot create data directory {}", data_dir.display()), e))?;
        let lock = lock_data_dir(data_dir)?;
        let catalog = match Catalog::load(data_dir).map_err(AdminError::Internal)? {
            Some(catalog) => catalog,
            None => initialise(data_dir)?,
        };
        let mut volumes = HashMap::new();
        for (pool, record) in &catalog.pools {
            for (name, volume) in &record.volumes {
                let path = volume_path(data_dir, pool, &volume.guid);
                let backing = FileBacking::open(&path)
                    .map_err(|e| internal(&format!("cannot open volume {pool}/{name} ({})", path.display()), e))?;
                if backing.size_bytes() != volume.props.volsize {
                    // A resize interrupted by a crash: the catalog's size is the truth.
                    backing
                        .resize(volume.props.volsize)
                        .map_err(|e| internal(&format!("cannot restore the size of {pool}/{name}"), e))?;
                }
                let opened = Volume::new(pool, name, Arc::new(backing), &volume.props.effective());
                volumes.insert(full_name(pool, name), Arc::new(opened));
            }
        }
        Ok(VolumeManager {
            data_dir: data_dir.to_path_buf(),
            catalog: Mutex::new(catalog),
            volumes: RwLock::new(volumes),
            _lock: lock,
        })
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The open volume called `pool/name`.
    pub fn lookup(&self, name: &str) -> Option<Arc<Volume>> {
        self.volumes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// All open volumes, sorted by name.
    pub fn volumes(&self) -> Vec<Arc<Volume>> {
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

    fn catalog(&self) -> std::sync::MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn info_of(&self, catalog: &Catalog, name: &str) -> Result<VolumeInfo, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let record = catalog
            .pools
            .get(pool)
            .and_then(|p| p.volumes.get(short))
            .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?;
        let used_bytes = fs::metadata(volume_path(&self.data_dir, pool, &record.guid))
            .map(|m| m.blocks() * 512)
            .unwrap_or(0);
        let connections = self.lookup(name).map(|v| v.open_handles()).unwrap_or(0);
        Ok(VolumeInfo {
            name: name.to_string(),
            pool: pool.to_string(),
            volsize: record.props.volsize,
            volblocksize: record.props.volblocksize,
            used_bytes,
            connections,
            properties: record.props.rows(),
        })
    }

    pub fn info(&self, name: &str) -> Result<VolumeInfo, AdminError> {
        let catalog = self.catalog();
        self.info_of(&catalog, name)
    }

    pub fn list(&self) -> Vec<VolumeInfo> {
        let catalog = self.catalog();
        let mut names = Vec::new();
        for (pool, record) in &catalog.pools {
            for name in record.volumes.keys() {
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
        let guid = new_guid();
        let path = volume_path(&self.data_dir, pool, &guid);
        let backing = FileBacking::create(&path, stored.volsize)
            .map_err(|e| internal(&format!("cannot create {}", path.display()), e))?;
        if let Some(parent) = path.parent() {
            sync_dir(parent).map_err(|e| internal("cannot sync volume directory", e))?;
        }
        let record = VolumeRecord {
            guid,
            created_unix: now_unix(),
            props: stored.clone(),
        };
        let mut updated = catalog.clone();
        if let Some(p) = updated.pools.get_mut(pool) {
            p.volumes.insert(short.to_string(), record);
        }
        if let Err(e) = updated.save(&self.data_dir) {
            let _ = fs::remove_file(&path);
            return Err(internal("cannot save catalog", e));
        }
        *catalog = updated;
        let volume = Volume::new(pool, short, Arc::new(backing), &stored.effective());
        self.volumes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), Arc::new(volume));
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
        *catalog = updated;
        volume.apply_props(&effective);
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
        if let Some(volume) = self.lookup(name) {
            let connections = volume.open_handles();
            if connections > 0 {
                return Err(AdminError::Busy(format!(
                    "volume '{name}' is busy: {connections} client connection(s) open"
                )));
            }
        }
        updated
            .save(&self.data_dir)
            .map_err(|e| internal("cannot save catalog", e))?;
        *catalog = updated;
        if let Some(volume) = self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(name) {
            volume.mark_deleted();
        }
        let path = volume_path(&self.data_dir, pool, &record.guid);
        if let Err(e) = fs::remove_file(&path) {
            tracing::warn!("volume {name} deleted but its file {} remains: {e}", path.display());
        }
        Ok(())
    }

    pub fn pool_status(&self) -> Vec<PoolStatus> {
        let catalog = self.catalog();
        let available_bytes = fs_available_bytes(&self.data_dir);
        catalog
            .pools
            .iter()
            .map(|(pool, record)| {
                let infos: Vec<VolumeInfo> = record
                    .volumes
                    .keys()
                    .filter_map(|n| self.info_of(&catalog, &full_name(pool, n)).ok())
                    .collect();
                let (read_errors, write_errors) =
                    self.volumes()
                        .iter()
                        .filter(|v| v.pool() == pool)
                        .fold((0, 0), |(r, w), v| {
                            let (vr, vw) = v.stats().error_totals();
                            (r + vr, w + vw)
                        });
                PoolStatus {
                    name: pool.clone(),
                    backing: "file-per-volume".to_string(),
                    path: pool_dir(&self.data_dir, pool).display().to_string(),
                    volumes: infos.len(),
                    provisioned_bytes: infos.iter().map(|i| i.volsize).sum(),
                    used_bytes: infos.iter().map(|i| i.used_bytes).sum(),
                    available_bytes,
                    read_errors,
                    write_errors,
                }
            })
            .collect()
    }

    /// Makes every acknowledged write durable (used at shutdown).
    pub async fn flush_all(&self) {
        for volume in self.volumes() {
            if let Err(e) = volume.flush().await {
                tracing::error!("flush of {} at shutdown failed: {e}", volume.full_name());
            }
        }
    }
}

fn check_volsize(size_bytes: u64, volblocksize: u32) -> Result<(), AdminError> {
    if size_bytes == 0 {
        return Err(AdminError::Invalid("volsize must be greater than zero".into()));
    }
    if size_bytes % volblocksize as u64 != 0 {
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

fn volume_path(data_dir: &Path, pool: &str, guid: &str) -> PathBuf {
    pool_dir(data_dir, pool).join("volumes").join(format!("{guid}.img"))
}

fn fs_available_bytes(path: &Path) -> u64 {
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs writes into the zeroed struct we pass and reads the
    // NUL-terminated path; both outlive the call.
    unsafe {
        let mut stats: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c_path.as_ptr(), &mut stats) == 0 {
            stats.f_bavail as u64 * stats.f_frsize as u64
        } else {
            0
        }
    }
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

/// First start: the default pool with one 10 GiB volume.
fn initialise(data_dir: &Path) -> Result<Catalog, AdminError> {
    let guid = new_guid();
    let path = volume_path(data_dir, DEFAULT_POOL, &guid);
    let volumes_dir = path.parent().unwrap_or(data_dir);
    fs::create_dir_all(volumes_dir).map_err(|e| internal("cannot create pool directory", e))?;
    FileBacking::create(&path, DEFAULT_VOLUME_BYTES)
        .map_err(|e| internal(&format!("cannot create {}", path.display()), e))?;
    sync_dir(volumes_dir).map_err(|e| internal("cannot sync pool directory", e))?;
    let mut pool = PoolRecord {
        created_unix: now_unix(),
        ..Default::default()
    };
    pool.volumes.insert(
        DEFAULT_VOLUME.to_string(),
        VolumeRecord {
            guid,
            created_unix: now_unix(),
            props: StoredProps {
                volsize: DEFAULT_VOLUME_BYTES,
                volblocksize: DEFAULT_VOLBLOCKSIZE,
                local: Default::default(),
            },
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

    fn props(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn lifecycle() {
        let dir = tempfile::tempdir().unwrap();
        let manager = VolumeManager::open(dir.path()).unwrap();
        assert!(manager.lookup("default/vol0").is_some());
        assert!(matches!(VolumeManager::open(dir.path()), Err(AdminError::Busy(_))));
        let info = manager
            .create("default/db", 1 << 30, &props(&[("sync", "always")]))
            .unwrap();
        assert_eq!(info.volsize, 1 << 30);
        assert!(matches!(
            manager.create("default/db", 1 << 30, &[]),
            Err(AdminError::AlreadyExists(_))
        ));
        assert!(matches!(
            manager.create("nopool/x", 1 << 30, &[]),
            Err(AdminError::NotFound(_))
        ));
        assert!(matches!(
            manager.create("default/bad name", 1 << 30, &[]),
            Err(AdminError::Invalid(_))
        ));
        assert!(matches!(
            manager.create("default/odd", 1000, &[]),
            Err(AdminError::Invalid(_))
        ));
        assert!(matches!(
            manager.create("default/x", 1 << 30, &props(&[("colour", "red")])),
            Err(AdminError::Invalid(_))
        ));
        manager.set("default/db", &props(&[("wce", "off")])).unwrap();
        assert!(!manager.lookup("default/db").unwrap().wce());
        assert!(matches!(
            manager.set("default/db", &props(&[("volblocksize", "8K")])),
            Err(AdminError::Invalid(_))
        ));
        manager.resize("default/db", 2 << 30).unwrap();
        assert!(matches!(
            manager.resize("default/db", 1 << 30),
            Err(AdminError::Invalid(_))
        ));
        let guard = manager.lookup("default/db").unwrap().open_handle();
        assert!(matches!(manager.delete("default/db"), Err(AdminError::Busy(_))));
        drop(guard);
        drop(manager);
        let manager = VolumeManager::open(dir.path()).unwrap();
        let reopened = manager.lookup("default/db").unwrap();
        assert_eq!(reopened.size_bytes(), 2 << 30);
        assert!(!reopened.wce());
        manager.delete("default/db").unwrap();
        assert!(manager.lookup("default/db").is_none());
        assert_eq!(manager.list().len(), 1);
    }
}
