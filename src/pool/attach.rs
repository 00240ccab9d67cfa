//! Attaching, detaching and replacing mirror devices while the pool runs
//! (`strata pool attach`, `detach`, `replace`).
//!
//! A member's `Vdev` is a single device until a device is attached beside
//! it; it is then a mirror (of two) for the rest of the pool's life, which a
//! detach may bring back to one device: a mirror of one, not a plain device
//! again (its device keeps the uuid its superblocks name it by, so nothing
//! else changes). A mirror's child list is replaced whole under a short
//! lock: a request works on the list it started with.
//!
//! **Attach** (`Pool::attach`), under the membership lock:
//! 1. checks: a format-3 pool, a device at least the member's size, no
//!    strata superblock on it (except one of this pool that names no device
//!    of it: left by an attach that did not finish), room in the child
//!    tables;
//! 2. the new generation `g + 1` lists the new device as a stale child
//!    with cursor 0 (and, when the member was a single device, that device
//!    as its up-to-date child under the member's own uuid); the new
//!    device's superblock is written first, then every other device's;
//! 3. the device joins the running mirror as *resilvering*: it takes every
//!    write from here on (a single device becomes a mirror once the writes
//!    that went to it alone have completed), and no read;
//! 4. the resilver copies the allocated ranges to it, records its cursor,
//!    and makes it up to date (`pool/resilver.rs`).
//!
//! A crash before any existing device carries `g + 1` leaves the pool as it
//! was (the new device's own `g + 1` superblock, if the caller gives it at
//! the next open, names itself stale and the others as before, which is
//! as true); after, the pool opens with the device stale and resumes its
//! resilver at the cursor. Either way the data is on the old devices.
//!
//! **Detach** (`Pool::detach`): refused when the device is the mirror's
//! last up-to-date one; else the next generation without its child entry is
//! written to the other devices, and only then it leaves the running
//! mirror (until then it takes every write, so a crash in between leaves it
//! a good copy). Its own superblock is left as it was: the caller forgets
//! it (its catalog) first, and then clears it ([`Pool::forget_device`]). At
//! open, a device whose superblock is older than the pool's newest and that
//! the newest does not list was detached: left out ([`Pool::take_detached`]).
//!
//! **Replace** (`Pool::replace`): an attach whose child entries mark the
//! old device *replaced* and the new one its *replacement*; when a resilver
//! has made the replacement up to date, the old device is detached as above
//! ([`Pool::finish_replacement`], also at open for a replacement that was up
//! to date when the pool stopped). The flags are in the superblocks, so a
//! restart goes on with the replacement. At every point the pool's newest
//! superblock lists the old device, the new one, or both with at least one
//! of them up to date.

use super::grow::names_device;
use super::superblock::{Child, ChildState, MAX_CHILDREN, MIRRORS_FORMAT};
use super::vdev::{Health, Mirror, MirrorChild, MAX_MIRROR_CHILDREN};
use super::*;

/// Which device of the pool a request means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The path it was opened from (a `--wrap` stack around it counts).
    Path(String),
    /// Its uuid, as its superblock has it (`pool status` names a device
    /// that is missing `device UUID`).
    Uuid([u8; 16]),
}

impl DeviceSpec {
    /// `device UUID` or 32 hex digits: a uuid; anything else a path.
    pub fn parse(text: &str) -> DeviceSpec {
        let hex = text.strip_prefix("device ").unwrap_or(text).trim();
        if hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            let mut uuid = [0u8; 16];
            for (i, byte) in uuid.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
            }
            return DeviceSpec::Uuid(uuid);
        }
        DeviceSpec::Path(text.to_string())
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Path(path) => f.write_str(path),
            DeviceSpec::Uuid(uuid) => write!(f, "device {}", uuid_text(uuid)),
        }
    }
}

/// Whether a device called `name` (a path, or a wrapper stack `kind(...)`
/// around one) is the device at `path`.
pub fn device_named(name: &str, path: &str) -> bool {
    name_is(name, path)
}

fn name_is(name: &str, path: &str) -> bool {
    let mut name = name;
    loop {
        if name == path {
            return true;
        }
        let Some(inner) = name
            .strip_suffix(')')
            .and_then(|n| n.split_once('('))
            .map(|(_, inner)| inner)
        else {
            return false;
        };
        name = inner;
    }
}

/// A device of the pool found by its [`DeviceSpec`].
struct Found {
    index: u8,
    /// `None`: the member is a single device (it is the device).
    child: Option<Arc<MirrorChild>>,
}

impl Pool {
    fn find_device(&self, spec: &DeviceSpec) -> Result<Found, PoolError> {
        for device in &self.devices {
            let index = device.member.index;
            match device.mirror() {
                None => {
                    let hit = match spec {
                        DeviceSpec::Uuid(uuid) => *uuid == device.member.uuid,
                        DeviceSpec::Path(path) => device
                            .vdev
                            .single_device()
                            .is_some_and(|d| name_is(&d.info().name, path)),
                    };
                    if hit {
                        return Ok(Found { index, child: None });
                    }
                }
                Some(mirror) => {
                    let children = mirror.children();
                    let child = children.iter().find(|c| match spec {
                        DeviceSpec::Uuid(uuid) => *uuid == c.uuid,
                        DeviceSpec::Path(path) => c.device.as_ref().is_some_and(|d| name_is(&d.info().name, path)),
                    });
                    if let Some(child) = child {
                        return Ok(Found {
                            index,
                            child: Some(child.clone()),
                        });
                    }
                }
            }
        }
        Err(PoolError::NotFound(format!(
            "{spec} is not a device of pool '{}'",
            self.name
        )))
    }

    /// The member index and role of the device `spec` names.
    pub fn device_member(&self, spec: &DeviceSpec) -> Result<(u8, super::superblock::Role), PoolError> {
        let found = self.find_device(spec)?;
        let role = self
            .devices
            .get(found.index as usize)
            .map(|d| d.member.role)
            .ok_or_else(|| PoolError::NotFound(format!("{spec} is not a device of pool '{}'", self.name)))?;
        Ok((found.index, role))
    }

    /// Whether devices left the pool that the caller has not taken yet
    /// ([`Pool::take_detached`]).
    pub fn has_detached(&self) -> bool {
        !self.detached.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Attaches `new` beside `existing` (a single-device member, which
    /// becomes a two-way mirror, or a mirror's device, which gets one more
    /// copy) and starts resilvering it. Returns once its superblocks are
    /// written and it takes writes; the resilver runs in the background
    /// (or, without background work, at the next [`Pool::resilver`]).
    pub async fn attach(&self, existing: &DeviceSpec, new: Arc<dyn Device>) -> Result<(), PoolError> {
        self.attach_as(existing, new, false).await
    }

    /// Attaches `new` beside `old` as its replacement: once `new` is
    /// resilvered, `old` is detached. `old` may be missing or faulted (the
    /// copy then comes from the mirror's other devices).
    pub async fn replace(&self, old: &DeviceSpec, new: Arc<dyn Device>) -> Result<(), PoolError> {
        self.attach_as(old, new, true).await
    }

    async fn attach_as(&self, existing: &DeviceSpec, new: Arc<dyn Device>, replacing: bool) -> Result<(), PoolError> {
        let mut current = self.membership.lock().await;
        let found = self.find_device(existing)?;
        let index = found.index;
        let pool_device = self
            .devices
            .get(index as usize)
            .ok_or_else(|| PoolError::Invalid(format!("pool device {index} vanished")))?;
        let member = pool_device.member;
        let name = new.info().name.clone();
        let what = if replacing { "replace" } else { "attach" };
        if pool_device.state() != super::superblock::MemberState::Active {
            return Err(PoolError::Invalid(format!(
                "cannot {what} a device of {}: it is being removed from pool '{}'",
                pool_device.device.info().name,
                self.name
            )));
        }
        if current.format < MIRRORS_FORMAT {
            return Err(PoolError::Invalid(format!(
                "pool '{}' has on-disk format {}, which has no mirrors (format {MIRRORS_FORMAT} has): \
                 devices cannot be attached to it",
                self.name, current.format
            )));
        }
        let chunk = self.chunk_bytes as u64;
        if new.info().size_bytes / chunk * chunk < member.size_bytes {
            return Err(PoolError::Invalid(format!(
                "{name} is too small ({}): device {index} of pool '{}' uses {}",
                crate::units::format_size(new.info().size_bytes),
                self.name,
                crate::units::format_size(member.size_bytes)
            )));
        }
        let mut generation = current.generation + 1;
        if let Ok((found_superblock, _)) = read_superblock(&new).await {
            // Left by an attach or addition that did not finish, or by a
            // detach: it names no device the pool has.
            let leftover = found_superblock.pool_uuid == self.uuid
                && !names_device(&current, found_superblock.device_index, &found_superblock.device_uuid);
            if !leftover {
                return Err(PoolError::InUse(name));
            }
            generation = generation.max(found_superblock.generation + 1);
        }
        let mirror = pool_device.mirror().cloned();
        let entries = if mirror.is_some() { 1 } else { 2 };
        if current.children.len() + entries > MAX_CHILDREN {
            return Err(PoolError::Invalid(format!(
                "pool '{}' has {} mirror devices, and its superblocks hold at most {MAX_CHILDREN}",
                self.name,
                current.children.len()
            )));
        }
        if mirror
            .as_ref()
            .is_some_and(|m| m.children().len() >= MAX_MIRROR_CHILDREN)
        {
            return Err(PoolError::Invalid(format!(
                "mirror-{index} already has {MAX_MIRROR_CHILDREN} devices"
            )));
        }
        if replacing && current.children_of(index).any(|c| c.replaced || c.replacement) {
            return Err(PoolError::Busy(format!(
                "a replacement is already under way in mirror-{index} of pool '{}': wait for its resilver \
                 to finish, or detach its new device",
                self.name
            )));
        }
        let new_uuid = random_uuid();
        let mut next = current.clone();
        self.membership.note_health(&mut next);
        next.generation = generation;
        match &found.child {
            None => next.children.push(Child {
                uuid: member.uuid,
                member: index,
                state: ChildState::Online,
                write_mostly: false,
                resilvered: 0,
                tracked: false,
                replaced: replacing,
                replacement: false,
            }),
            Some(old) => {
                if let Some(entry) = next.children.iter_mut().find(|c| c.uuid == old.uuid) {
                    entry.replaced |= replacing;
                }
            }
        }
        next.children.push(Child {
            uuid: new_uuid,
            member: index,
            state: ChildState::Stale,
            write_mostly: false,
            resilvered: 0,
            tracked: false,
            replaced: false,
            replacement: replacing,
        });
        // The new device first: once any other device names it, its own
        // superblock is durable.
        if let Err(e) = write_superblock(&new, &next.for_device(index, new_uuid)).await {
            let _ = clear_superblocks(&new).await;
            return Err(PoolError::Device {
                device: name,
                reason: format!("cannot write its superblock ({e}); nothing was changed"),
            });
        }
        let child = MirrorChild::new(Some(new), new_uuid, false, Health::Resilvering, 0);
        child.replacement.store(replacing, Ordering::Release);
        // Every other device, then the running mirror takes the device in.
        match (&mirror, &found.child) {
            (Some(mirror), old) => {
                self.membership.write_all(&mut current, next).await;
                if let Some(old) = old {
                    old.replaced.fetch_or(replacing, Ordering::AcqRel);
                }
                mirror.push_child(child);
            }
            (None, _) => {
                let single = pool_device
                    .vdev
                    .single_device()
                    .cloned()
                    .ok_or_else(|| PoolError::Invalid(format!("pool device {index} has no device")))?;
                self.membership.write_all(&mut current, next).await;
                let old = MirrorChild::new(Some(single), member.uuid, false, Health::Online, 0);
                old.replaced.store(replacing, Ordering::Release);
                let mirror = Arc::new(Mirror::new(index, member.size_bytes, vec![old, child]));
                mirror.pin_reads(false);
                mirror.set_membership(&self.membership);
                pool_device
                    .vdev
                    .become_mirror(mirror)
                    .await
                    .map_err(PoolError::Invalid)?;
            }
        }
        drop(current);
        tracing::info!(
            "pool {}: {what}: {name} attached to device {index} ({}) as a mirror copy; resilvering it",
            self.name,
            existing
        );
        if self.background {
            if let Some(pool) = self.self_ref.get().and_then(std::sync::Weak::upgrade) {
                pool.start_resilver();
            }
        }
        Ok(())
    }

    /// Takes `spec` out of its mirror. Refused for a single-device member
    /// and for a mirror's last up-to-date device. Returns the device (when
    /// it is present) for the caller to clear once it has forgotten it
    /// ([`Pool::forget_device`]).
    pub async fn detach(&self, spec: &DeviceSpec) -> Result<Option<Arc<dyn Device>>, PoolError> {
        let mut current = self.membership.lock().await;
        let found = self.find_device(spec)?;
        let index = found.index;
        let Some(child) = found.child else {
            return Err(PoolError::Invalid(format!(
                "{spec} is device {index} of pool '{}' on its own, not part of a mirror: there is no other \
                 copy to keep; `strata pool replace {} {spec} NEW` moves it to another device",
                self.name, self.name
            )));
        };
        let mirror = self
            .devices
            .get(index as usize)
            .and_then(|d| d.mirror())
            .cloned()
            .ok_or_else(|| PoolError::Invalid(format!("pool device {index} is not a mirror")))?;
        let others = mirror.online().into_iter().filter(|c| !Arc::ptr_eq(c, &child)).count();
        if others == 0 {
            let state = child.health();
            return Err(PoolError::Invalid(format!(
                "cannot detach {spec}: it is the only up-to-date device of mirror-{index} of pool '{}' \
                 (the others are {}), so nothing would hold its data; attach another device and let it \
                 resilver first",
                self.name,
                if mirror.children().len() > 1 {
                    mirror
                        .children()
                        .iter()
                        .filter(|c| !Arc::ptr_eq(c, &child))
                        .map(|c| format!("{} {}", c.name, c.health().as_str()))
                        .collect::<Vec<_>>()
                        .join(", ")
                } else {
                    format!("none; it is {}", state.as_str())
                }
            )));
        }
        self.detach_locked(&mut current, &mirror, &child).await;
        tracing::info!("pool {}: detached {} from mirror-{index}", self.name, child.name);
        Ok(child.device.clone())
    }

    /// Writes the next generation without `child` to every other device,
    /// then takes it out of `mirror`. A replacement pair loses its flags.
    async fn detach_locked(&self, current: &mut Superblock, mirror: &Mirror, child: &Arc<MirrorChild>) {
        let index = mirror.member();
        let mut next = current.clone();
        self.membership.note_health(&mut next);
        next.generation += 1;
        let pair = next
            .children
            .iter()
            .find(|c| c.uuid == child.uuid)
            .is_some_and(|c| c.replaced || c.replacement);
        next.children.retain(|c| c.uuid != child.uuid);
        if pair {
            for entry in next.children.iter_mut().filter(|c| c.member == index) {
                entry.replaced = false;
                entry.replacement = false;
            }
        }
        // `child` is not listed in `next`, so it is not written.
        self.membership.write_all(current, next).await;
        mirror.remove_child(&child.uuid);
        if pair {
            for other in mirror.children().iter() {
                other.replaced.store(false, Ordering::Release);
                other.replacement.store(false, Ordering::Release);
            }
        }
    }

    /// Detaches the replaced devices of mirror `index` once its replacement
    /// is up to date (after a resilver, and at open).
    pub(super) async fn finish_replacement(&self, index: u8) {
        let Some(mirror) = self.devices.get(index as usize).and_then(|d| d.mirror()).cloned() else {
            return;
        };
        let mut current = self.membership.lock().await;
        let children = mirror.children();
        let Some(replacement) = children.iter().find(|c| c.replacing().1) else {
            return;
        };
        if replacement.health() != Health::Online || replacement.device.is_none() {
            return;
        }
        for old in children.iter().filter(|c| c.replacing().0) {
            self.detach_locked(&mut current, &mirror, old).await;
            tracing::info!(
                "pool {}: {} replaced {} in mirror-{index}, which is detached",
                self.name,
                replacement.name,
                old.name
            );
            if let Some(device) = &old.device {
                self.detached
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(device.clone());
            }
        }
    }

    /// [`Pool::finish_replacement`] for every mirror.
    pub(super) async fn finish_replacements(&self) {
        let indexes: Vec<u8> = self.devices.iter().map(|d| d.member.index).collect();
        for index in indexes {
            self.finish_replacement(index).await;
        }
    }

    /// Devices that left the pool without being asked to by a caller that
    /// gets them back: replaced devices detached once their replacement was
    /// up to date, and devices given at open that the pool's newest
    /// superblock no longer lists. The caller forgets them and then clears
    /// them ([`Pool::forget_device`]).
    pub fn take_detached(&self) -> Vec<Arc<dyn Device>> {
        std::mem::take(&mut *self.detached.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether the running pool lists `device` (by its own superblock's
    /// identity) as one of its devices.
    pub async fn uses_device(&self, device: &Arc<dyn Device>) -> bool {
        let Ok((own, _)) = read_superblock(device).await else {
            return false;
        };
        let current = self.membership.lock().await;
        own.pool_uuid == self.uuid && names_device(&current, own.device_index, &own.device_uuid)
    }

    /// Clears the superblocks of `device`, which was this pool's and is no
    /// longer (detached, or replaced), so it can be used again, and gives up
    /// its lock: a device that was a single-device member stays open until
    /// the pool closes (its member's `Vdev` keeps it, never using it again),
    /// and can be opened anew meanwhile. Refused for a device the pool
    /// lists; a device with no superblock of this pool is left alone.
    pub async fn forget_device(&self, device: &Arc<dyn Device>) -> Result<(), PoolError> {
        let Ok((own, _)) = read_superblock(device).await else {
            return Ok(());
        };
        if own.pool_uuid != self.uuid {
            return Ok(());
        }
        if self.uses_device(device).await {
            return Err(PoolError::Invalid(format!(
                "{} is still a device of pool '{}'",
                device.info().name,
                self.name
            )));
        }
        clear_superblocks(device).await.map_err(PoolError::Io)?;
        // It may be opened again (attached back, used elsewhere) while this
        // handle lives on, unused.
        device.release_lock();
        Ok(())
    }
}

/// Zeroes both superblock copies of `device`.
pub(super) async fn clear_superblocks(device: &Arc<dyn Device>) -> Result<(), DeviceError> {
    for offset in SUPERBLOCK_OFFSETS {
        let (_, written) = device.write(offset, IoBuf::new(SUPERBLOCK_BYTES)).await;
        written?;
        device.flush().await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_and_wrapped_names() {
        assert_eq!(DeviceSpec::parse("/dev/sdb"), DeviceSpec::Path("/dev/sdb".into()));
        let hex = "00112233445566778899aabbccddeeff";
        let uuid = DeviceSpec::Uuid([
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff,
        ]);
        assert_eq!(DeviceSpec::parse(hex), uuid);
        assert_eq!(DeviceSpec::parse(&format!("device {hex}")), uuid);
        assert_eq!(uuid.to_string(), format!("device {hex}"));
        assert!(name_is("/a/b.img", "/a/b.img"));
        assert!(name_is("error(delay(/a/b.img))", "/a/b.img"));
        assert!(name_is("/a/b(1).img", "/a/b(1).img"));
        assert!(!name_is("error(/a/c.img)", "/a/b.img"));
    }
}
