//! Growing a pool online: adding a fast or capacity device while volumes are
//! in use (`strata pool add-device`).
//!
//! The pool's membership lives in the superblocks: every device lists every
//! member, and the copy with the highest generation wins at open. An
//! addition is planned ([`Pool::prepare_add_device`]: the device is checked,
//! nothing is written) and then carried out ([`Pool::finish_add_device`]):
//!
//! 1. the new device's superblock (generation + 1, the full member table
//!    with the new device last) is written and flushed;
//! 2. every existing device's superblock is rewritten with that generation
//!    and table, one device at a time, each copy flushed;
//! 3. only then the device joins the running pool: it is appended to the
//!    device list and its space to the allocator, so no data can reach it
//!    before every superblock names it.
//!
//! A crash anywhere leaves a pool that opens: until some existing device
//! carries the new generation, the newest superblock among them does not
//! list the device, and the pool opens without it; from then on the new
//! device's own superblock is durable too, so opening with it completes the
//! addition (`Pool::open` rewrites stale superblocks). Which devices to open
//! is the caller's business: the volume manager records the device in its
//! catalog (as being added) before step 1 and asks
//! [`Pool::superblocks_list`] at the next start. docs/FORMAT.md has the
//! case analysis.
//!
//! If a superblock write fails, the addition is undone: the existing devices
//! get generation + 2 with the old table, and the new device's superblocks
//! are zeroed.

use std::sync::{Arc, OnceLock};

use super::alloc::DeviceSpace;
use super::superblock::{Member, Role, Superblock, MAX_MEMBERS, SUPERBLOCK_BYTES, SUPERBLOCK_OFFSETS};
use super::{
    random_uuid, read_superblock, round_up, write_superblock, Pool, PoolDevice, PoolError, MAX_META_BYTES,
    MIN_META_BYTES,
};
use crate::device::{Device, IoBuf};
use crate::meta::MetaError;
use crate::units::format_size;

/// Smallest device that can be added: chunk 0 (superblocks) and 4 data chunks,
/// as `Pool::create` requires of data devices.
const MIN_DATA_CHUNKS: u64 = 4;

/// Additions are rare; one at a time in the whole process keeps them from
/// racing for the same member index or generation.
static GROWING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The pool's devices, indexed by member index. Append-only, so a device
/// can join while requests hold references to the others: slots are filled
/// once, in order, and never change or move afterwards.
pub struct DeviceList {
    slots: Box<[OnceLock<PoolDevice>]>,
}

type Filled<'a> = fn(&'a OnceLock<PoolDevice>) -> Option<&'a PoolDevice>;

impl DeviceList {
    pub(crate) fn get(&self, index: usize) -> Option<&PoolDevice> {
        self.slots.get(index)?.get()
    }

    pub(crate) fn iter(&self) -> std::iter::MapWhile<std::slice::Iter<'_, OnceLock<PoolDevice>>, Filled<'_>> {
        self.slots.iter().map_while(OnceLock::get as Filled<'_>)
    }

    fn count(&self) -> usize {
        self.iter().count()
    }

    /// Appends a device; the caller holds [`GROWING`]. Returns its index.
    fn push(&self, device: PoolDevice) -> Result<usize, PoolError> {
        let index = self.count();
        let slot = self
            .slots
            .get(index)
            .ok_or_else(|| PoolError::Invalid(format!("a pool has at most {MAX_MEMBERS} devices")))?;
        slot.set(device)
            .map_err(|_| PoolError::Invalid("device slot taken twice".into()))?;
        Ok(index)
    }
}

impl From<Vec<PoolDevice>> for DeviceList {
    fn from(devices: Vec<PoolDevice>) -> Self {
        assert!(devices.len() <= MAX_MEMBERS, "too many pool devices");
        let slots: Box<[OnceLock<PoolDevice>]> = (0..MAX_MEMBERS).map(|_| OnceLock::new()).collect();
        for (slot, device) in slots.iter().zip(devices) {
            let _ = slot.set(device);
        }
        DeviceList { slots }
    }
}

impl DeviceList {
    /// The device at member index `index`, or an error naming it: an index
    /// comes from stored state (a map entry, a checksum page's key, a log
    /// record) that may be damaged, and a request that meets one fails
    /// instead of taking the daemon down.
    pub(crate) fn at(&self, index: u8) -> Result<&PoolDevice, MetaError> {
        self.get(index as usize).ok_or_else(|| {
            MetaError::Corrupt(format!(
                "pool device {index} does not exist (the pool has {})",
                self.count()
            ))
        })
    }
}

impl<'a> IntoIterator for &'a DeviceList {
    type Item = &'a PoolDevice;
    type IntoIter = std::iter::MapWhile<std::slice::Iter<'a, OnceLock<PoolDevice>>, Filled<'a>>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A checked plan to add one device ([`Pool::prepare_add_device`]). While
/// it exists no other addition can start.
pub struct DeviceAddition {
    device: Arc<dyn Device>,
    /// The new generation, as the new device gets it.
    superblock: Superblock,
    _one_at_a_time: tokio::sync::MutexGuard<'static, ()>,
}

impl DeviceAddition {
    /// The member index the device will have.
    pub fn index(&self) -> u8 {
        self.superblock.device_index
    }

    /// Bytes of the device the pool will use (whole chunks).
    pub fn size_bytes(&self) -> u64 {
        self.superblock.members[self.index() as usize].size_bytes
    }
}

/// Why [`Pool::finish_add_device`] failed, and whether it was undone.
#[derive(Debug)]
pub struct AddDeviceError {
    pub error: PoolError,
    /// `None`: undone, every superblock is back to the old member table (at a
    /// newer generation) and the device is not part of the pool. `Some`: the
    /// undo failed too (the reason); the superblocks may list the device,
    /// and the next open settles it ([`Pool::superblocks_list`]).
    pub undo_failed: Option<String>,
}

impl std::fmt::Display for AddDeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.undo_failed {
            None => write!(f, "{}; nothing was changed", self.error),
            Some(undo) => write!(f, "{}; undoing it failed too ({undo})", self.error),
        }
    }
}

impl std::error::Error for AddDeviceError {}

impl Pool {
    /// Checks that `device` can join this pool with `role` and plans the
    /// addition. Writes nothing. Refused: roles other than fast and
    /// capacity, a device that is already a strata device (except one left
    /// behind by an interrupted addition to this very pool), a device too
    /// small for its superblocks and 4 chunks, a 33rd member, and a device
    /// that would grow the data beyond what the metadata region (sized when
    /// the pool was created) is meant for.
    pub async fn prepare_add_device(&self, device: Arc<dyn Device>, role: Role) -> Result<DeviceAddition, PoolError> {
        let guard = GROWING.lock().await;
        let name = device.info().name.clone();
        if !role.holds_data() {
            return Err(PoolError::Invalid(format!(
                "cannot add {name} as a {} device: only fast and capacity devices can be added; a log device is fixed when the pool is created",
                role.as_str()
            )));
        }
        let count = self.devices.count();
        if count >= MAX_MEMBERS {
            return Err(PoolError::Invalid(format!(
                "pool '{}' already has {count} devices, the most a pool can have",
                self.name
            )));
        }
        // The superblock generation on disk, and the fields every member shares.
        let mut current: Option<Superblock> = None;
        for member in self.devices.iter().filter(|d| !d.is_removed()) {
            let (superblock, _) = read_superblock(&member.device).await?;
            if current.as_ref().is_none_or(|c| superblock.generation > c.generation) {
                current = Some(superblock);
            }
        }
        let current = current.ok_or_else(|| PoolError::Invalid("the pool has no devices".into()))?;
        // Removed members keep their entries (and indexes).
        let running: Vec<Member> = self
            .devices
            .iter()
            .map(|d| Member {
                state: d.state(),
                ..d.member
            })
            .collect();
        let agrees = current.pool_uuid == self.uuid
            && current.members.len() >= running.len()
            && running.iter().zip(&current.members).all(|(a, b)| a.uuid == b.uuid);
        if !agrees {
            return Err(PoolError::Invalid(format!(
                "pool '{}': the devices' superblocks do not match the running pool; restart the daemon before adding devices",
                self.name
            )));
        }
        // Above every generation the pool's devices or a leftover superblock
        // on the new device carry.
        let mut generation = current.generation + 1;
        if let Ok((found, _)) = read_superblock(&device).await {
            // A superblock of this pool naming a member the pool does not
            // have is what an interrupted or undone addition leaves behind:
            // nothing can be stored there, so it may be reused.
            let leftover = found.pool_uuid == self.uuid
                && found
                    .this_member()
                    .is_some_and(|m| !running.iter().any(|r| r.uuid == m.uuid));
            if !leftover {
                return Err(PoolError::InUse(name));
            }
            tracing::info!(
                "{name}: reusing the superblock left by an unfinished addition to pool {}",
                self.name
            );
            generation = generation.max(found.generation + 1);
        }
        let chunk = self.chunk_bytes as u64;
        let size_bytes = device.info().size_bytes / chunk * chunk;
        let needed = current.header_bytes() + MIN_DATA_CHUNKS * chunk;
        if size_bytes < needed {
            return Err(PoolError::Invalid(format!(
                "{name} is too small ({}; a data device of this pool needs at least {}: its superblocks and {MIN_DATA_CHUNKS} chunks of {})",
                format_size(device.info().size_bytes),
                format_size(needed),
                format_size(chunk)
            )));
        }
        // The rule `Pool::create` sized the metadata region by.
        let data_bytes: u64 = running
            .iter()
            .filter(|m| m.role.holds_data() && !m.removed())
            .map(|m| m.size_bytes)
            .sum::<u64>()
            + size_bytes;
        let meta_needed = round_up((data_bytes / 128).clamp(MIN_META_BYTES, MAX_META_BYTES), chunk);
        if meta_needed > current.meta_bytes {
            return Err(PoolError::Invalid(format!(
                "cannot add {name} to pool '{}': its metadata region ({}, sized when the pool was created) is meant for at most about {} of data, and the pool would have {}",
                self.name,
                format_size(current.meta_bytes),
                format_size(current.meta_bytes.saturating_mul(128)),
                format_size(data_bytes)
            )));
        }
        let mut members = running;
        members.push(Member {
            uuid: random_uuid(),
            role,
            index: count as u8,
            size_bytes,
            state: super::superblock::MemberState::Active,
        });
        let device_uuid = members[count].uuid;
        let superblock = Superblock {
            generation,
            device_index: count as u8,
            members,
            device_uuid,
            ..current
        };
        Ok(DeviceAddition {
            device,
            superblock,
            _one_at_a_time: guard,
        })
    }

    /// Carries out a planned addition: superblocks first (the new device's,
    /// then every existing device's), then the device joins the running pool
    /// and new allocations may land on it (fastest tier with room first, as
    /// always). Returns the device's member index.
    pub async fn finish_add_device(&self, addition: DeviceAddition) -> Result<u8, AddDeviceError> {
        let new = &addition.superblock;
        let index = new.device_index;
        if let Err(error) = self.write_member_superblocks(&addition.device, new).await {
            let undo_failed = self.undo_add_device(&addition).await.err();
            return Err(AddDeviceError { error, undo_failed });
        }
        let member = new.members[index as usize];
        let chunk = self.chunk_bytes as u64;
        let chunks = member.size_bytes / chunk;
        let vdev = Arc::new(super::vdev::Vdev::single(addition.device.clone()));
        let joined = self.devices.push(PoolDevice::new(vdev.clone(), member, chunks));
        if let Err(error) = joined {
            // Cannot happen while additions are serialised; the superblocks
            // list the device, so the next open takes it in.
            return Err(AddDeviceError {
                error,
                undo_failed: Some("the superblocks already list the device".into()),
            });
        }
        // Stored references to the device are valid from now on.
        self.geometry
            .write()
            .unwrap_or_else(|_| crate::sync::poisoned())
            .devices
            .push(crate::meta::geometry::DeviceExtent {
                holds_data: member.role.holds_data(),
                first_data: new.header_bytes(),
                end: chunks * chunk,
            });
        // The header holds the superblocks; every other chunk is data.
        self.allocator.lock_or_abort().add_device(DeviceSpace::new(
            index,
            member.role,
            new.header_bytes() / chunk,
            chunks,
        ));
        self.membership.add_member(index, &vdev);
        tracing::info!(
            "pool {}: added {} as {} device {index} ({} of data); superblock generation {}",
            self.name,
            addition.device.info().name,
            member.role.as_str(),
            format_size(chunks * chunk - new.header_bytes()),
            new.generation
        );
        Ok(index)
    }

    /// Plans and carries out an addition in one step.
    pub async fn add_device(&self, device: Arc<dyn Device>, role: Role) -> Result<u8, PoolError> {
        let addition = self.prepare_add_device(device, role).await?;
        self.finish_add_device(addition).await.map_err(|e| match e.undo_failed {
            None => e.error,
            Some(_) => PoolError::Invalid(e.to_string()),
        })
    }

    /// Writes `superblock` to the new device, then to every existing one
    /// (each mirror child with its own identity), and makes it the
    /// membership the pool records from now on.
    async fn write_member_superblocks(
        &self,
        new_device: &Arc<dyn Device>,
        superblock: &Superblock,
    ) -> Result<(), PoolError> {
        let mut current = self.membership.lock().await;
        let mut next = superblock.clone();
        // Mirror children faulted, and members being removed, since the
        // addition was planned.
        next.children = current.children.clone();
        for (member, recorded) in next.members.iter_mut().zip(&current.members) {
            member.state = recorded.state;
        }
        self.membership.note_health(&mut next);
        next.generation = next.generation.max(current.generation + 1);
        // The new device first: once any existing device names it, its own
        // superblock must already be durable, or the pool would not open.
        write_superblock(new_device, &next).await?;
        for (device, index, uuid) in self.membership.writable_devices(&next) {
            if let Err(e) = write_superblock(&device, &next.for_device(index, uuid)).await {
                if let Some(member) = self.devices.get(index as usize) {
                    member
                        .counters
                        .write_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                return Err(e.into());
            }
        }
        *current = next;
        Ok(())
    }

    /// Puts the old member table back on every existing device (one
    /// generation above the failed addition, so it wins wherever it lands),
    /// then zeroes the new device's superblocks (best effort: a leftover
    /// superblock naming an unknown member is harmless and may be reused).
    async fn undo_add_device(&self, addition: &DeviceAddition) -> Result<(), String> {
        let mut current = self.membership.lock().await;
        let mut old = current.clone();
        self.membership.note_health(&mut old);
        old.generation = old.generation.max(addition.superblock.generation) + 1;
        old.members.truncate(addition.index() as usize);
        for (device, index, uuid) in self.membership.writable_devices(&old) {
            write_superblock(&device, &old.for_device(index, uuid))
                .await
                .map_err(|e| e.to_string())?;
        }
        *current = old;
        drop(current);
        let device = &addition.device;
        for offset in SUPERBLOCK_OFFSETS {
            let (_, written) = device.write(offset, IoBuf::new(SUPERBLOCK_BYTES)).await;
            let result = match written {
                Ok(()) => device.flush().await,
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                tracing::warn!(
                    "{}: could not clear the superblock of an undone addition: {e}",
                    device.info().name
                );
                break;
            }
        }
        Ok(())
    }

    /// Whether `candidate` is a device of the pool made of `members` as the
    /// superblocks have it (a member, or a mirror's child): its own superblock is valid and names the same
    /// pool, and the newest superblock among all of them lists it. Decides,
    /// after a crash or a failed undo, whether a device whose addition did
    /// not finish must be opened with the pool (the addition had reached the
    /// existing devices) or left out (it had not; the pool never used it).
    pub async fn superblocks_list(members: &[Arc<dyn Device>], candidate: &Arc<dyn Device>) -> bool {
        let Ok((own, _)) = read_superblock(candidate).await else {
            return false;
        };
        if own.this_member().is_none() {
            return false;
        }
        let mut newest = own.clone();
        let mut same_pool = false;
        for member in members {
            if let Ok((superblock, _)) = read_superblock(member).await {
                if superblock.pool_uuid != own.pool_uuid {
                    continue;
                }
                same_pool = true;
                if superblock.generation > newest.generation {
                    newest = superblock;
                }
            }
        }
        same_pool && names_device(&newest, own.device_index, &own.device_uuid)
    }

    /// [`Pool::superblocks_list`] against this pool's running devices.
    pub async fn lists(&self, candidate: &Arc<dyn Device>) -> bool {
        let members: Vec<Arc<dyn Device>> = self
            .devices
            .iter()
            .filter(|d| !d.is_removed())
            .map(|d| d.device.clone())
            .collect();
        Self::superblocks_list(&members, candidate).await
    }
}

/// Whether `superblock` lists device `device_uuid` in member `index`: as the
/// member itself when it is a single device, as a child when a mirror.
pub(super) fn names_device(superblock: &Superblock, index: u8, device_uuid: &[u8; 16]) -> bool {
    if superblock.is_mirror(index) {
        superblock.children_of(index).any(|c| &c.uuid == device_uuid)
    } else {
        superblock
            .members
            .get(index as usize)
            .is_some_and(|m| &m.uuid == device_uuid)
    }
}
