//! Removing a member while the pool runs (`strata pool remove`): a single
//! device or a whole mirror.
//!
//! A removal is three recorded steps, each one written to every other
//! device's superblock (the member's state in its member entry) before the
//! next begins, so a restart knows where it was:
//!
//! 1. **Evacuating.** The allocator stops placing new slots on the member
//!    at once, then every superblock marks it `Evacuating`; a restart keeps
//!    it closed to new data and the volume manager resumes the removal.
//! 2. **The move.** Every block it holds is moved by the migrator's mover
//!    (`EngineVolume::move_blocks`: read, verify, write to a new slot, a
//!    `Map` or `Relocate` record that frees the old slot once committed) to
//!    the other members of its tier, or to the other tier when its tier has
//!    no other member. Blocks snapshots and clones share move once for all
//!    of them. Rounds repeat until the allocator says nothing live is left
//!    there (a block being written meanwhile is skipped and taken by the
//!    next round).
//! 3. **Removed.** The member leaves the allocator (its chunk records are
//!    deleted) and a checkpoint makes that durable, so no stored chunk
//!    record, suspect mark or log record after it names the member; then
//!    every other superblock marks it `Removed`. Its device is never opened
//!    again, and its entry stays: member indexes name devices in map
//!    entries, checksum pages and log records, and an index is never given
//!    to another member. Its own superblocks are zeroed last
//!    ([`Pool::release_removed`], once the volume manager's catalog no
//!    longer lists it; best effort), so the device can be used elsewhere.
//!
//! A crash before step 3's superblocks leaves the member in (evacuating:
//! the removal resumes); after, out. Data is where the last committed
//! record put it either way.
//!
//! Refused: the member holding the metadata region or the intent log (they
//! are not moved: the metadata store and the log name their region by
//! offset, and moving them under a running pool would need a second copy of
//! each and a switch-over recorded in the superblocks, which this does not
//! do), a log device, the last data member, and a member whose data the
//! destination members cannot hold.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::superblock::{MemberState, Role, Superblock, SUPERBLOCK_BYTES};
use super::volume::{EngineVolume, Moved};
use super::{read_superblock, write_superblock, BlockPtr, Pool, PoolError, MAP_ENTRIES_PER_PAGE};
use crate::block::BlockDevice;
use crate::device::{BoxFuture, Device, DeviceError, DeviceInfo, DeviceResult, IoBuf};
use crate::units::format_size;

/// Owners of blocks on the member collected per walk of the maps: bounds
/// the memory a round holds (about 48 bytes each).
const OWNERS_PER_ROUND: usize = 1 << 16;
/// Map pages listed at a time while walking a volume.
const PAGE_WINDOW: usize = 4096;
/// Blocks handed to the mover at once (one chunk's worth of 4 KiB blocks).
const MOVE_BATCH: usize = 256;
/// Rounds in a row that move nothing before the removal gives up (about a
/// minute: cached writes are destaged within seconds).
const STUCK_ROUNDS: u32 = 300;
const STUCK_PAUSE: Duration = Duration::from_millis(200);

/// A removal under way (or the last one, if it failed), as `pool status`
/// shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct RemovalStatus {
    /// The member's index.
    pub index: u8,
    /// Its device (or mirror).
    pub name: String,
    /// `evacuating`, `finishing`, or `failed` (see `error`).
    pub phase: String,
    /// Bytes in use on the member when the removal started.
    pub total_bytes: u64,
    /// Bytes of blocks moved off it so far.
    pub moved_bytes: u64,
    /// Bytes still in use on it.
    pub left_bytes: u64,
    /// The tier its blocks go to.
    pub destination: Role,
    /// Why the removal stopped (phase `failed`): the member stays in the
    /// pool, taking no new data, until the removal is run again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Stands in for a removed member in the pool's device list (member
/// indexes never move): every I/O fails, and nothing stored can reach it
/// (stored metadata naming it is refused as corrupt).
struct RemovedDevice {
    info: DeviceInfo,
}

impl RemovedDevice {
    fn error(&self) -> DeviceError {
        DeviceError::Io {
            device: self.info.name.clone(),
            offset: 0,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "the member was removed from the pool"),
        }
    }
}

impl Device for RemovedDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn read(&self, _offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move { (buf, Err(self.error())) })
    }

    fn write(&self, _offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, DeviceResult<()>)> {
        Box::pin(async move { (buf, Err(self.error())) })
    }

    fn flush(&self) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn discard(&self, _offset: u64, _length: u64) -> BoxFuture<'_, DeviceResult<()>> {
        Box::pin(async move { Err(self.error()) })
    }
}

/// The device a removed member `index` of `size_bytes` gets in the pool's
/// device list when the pool opens.
pub(super) fn removed_device(index: u8, size_bytes: u64) -> Arc<dyn Device> {
    Arc::new(RemovedDevice {
        info: DeviceInfo {
            name: format!("removed-{index}"),
            size_bytes,
            block_bytes: 512,
            direct_io: false,
            rotational: false,
            engine: "removed",
            regular_file: false,
        },
    })
}

impl Pool {
    /// The removal under way, or the last one that failed.
    pub fn removal_status(&self) -> Option<RemovalStatus> {
        self.removal.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Members whose superblocks say they are being removed: the volume
    /// manager resumes their removal after a restart.
    pub fn evacuating_members(&self) -> Vec<u8> {
        self.devices
            .iter()
            .filter(|d| d.state() == MemberState::Evacuating)
            .map(|d| d.member.index)
            .collect()
    }

    /// The member whose device (or one of whose mirror's devices) is named
    /// `name` (its path, possibly inside wrappers: `delay(PATH)`), or a
    /// mirror named `mirror-N`.
    pub fn member_named(&self, name: &str) -> Option<u8> {
        let names = |device: &str| device == name || device.contains(&format!("({name})"));
        self.devices
            .iter()
            .filter(|d| !d.is_removed())
            .find(|d| {
                names(&d.device.info().name)
                    || d.mirror().is_some_and(|m| {
                        name == format!("mirror-{}", m.member()) || m.children().iter().any(|c| names(&c.name))
                    })
            })
            .map(|d| d.member.index)
    }

    /// The names of member `index`'s devices (one, or each of its mirror's).
    pub fn member_device_names(&self, index: u8) -> Vec<String> {
        match self.devices.get(index as usize) {
            Some(d) => match d.mirror() {
                Some(mirror) => mirror.children().iter().map(|c| c.name.clone()).collect(),
                None => vec![d.device.info().name.clone()],
            },
            None => Vec::new(),
        }
    }

    /// Where member `index`'s blocks would go: the other members of its
    /// tier that take new data, or, when it has none, the other tier.
    fn removal_destination(&self, index: u8, role: Role) -> Role {
        let allocator = self.allocator.lock_or_abort();
        let others = allocator
            .devices()
            .iter()
            .any(|s| s.index != index && s.role == role && s.accepting);
        match (others, role) {
            (true, _) => role,
            (false, Role::Fast) => Role::Capacity,
            (false, _) => Role::Fast,
        }
    }

    /// Checks that member `index` can be removed, writing nothing: it is a
    /// data member other than the one holding the metadata or the log, not
    /// the last, and the destination has room for what it holds. Returns
    /// where its blocks go.
    pub fn check_removal(&self, index: u8) -> Result<Role, PoolError> {
        let refuse = |why: String| Err(PoolError::Invalid(why));
        let Some(device) = self.devices.get(index as usize).filter(|d| !d.is_removed()) else {
            return refuse(format!("pool '{}' has no member {index}", self.name));
        };
        let name = device.device.info().name.clone();
        let role = device.member.role;
        if !role.holds_data() {
            return refuse(format!(
                "cannot remove {name}: it is the pool's log device, which holds the intent log; a log device cannot be removed"
            ));
        }
        if index == self.meta_device {
            return refuse(format!(
                "cannot remove {name}: it holds the pool's metadata region, which is not moved (a removal moves data blocks only)"
            ));
        }
        if index == self.regions.log_device {
            return refuse(format!(
                "cannot remove {name}: it holds the pool's intent log region, which is not moved (a removal moves data blocks only)"
            ));
        }
        if self.removal_running(index) {
            return refuse(format!("{name} is already being removed"));
        }
        if device.mirror().is_some_and(|m| m.written().len() > m.online().len()) {
            return refuse(format!(
                "cannot remove {name}: a device of it is being resilvered; wait for the resilver to end, or detach that device"
            ));
        }
        let to = self.removal_destination(index, role);
        let allocator = self.allocator.lock_or_abort();
        let chunk = self.chunk_bytes as u64;
        let destinations: Vec<_> = allocator
            .devices()
            .iter()
            .filter(|s| s.index != index && s.role == to && s.accepting)
            .collect();
        if destinations.is_empty() {
            return refuse(format!(
                "cannot remove {name}: it is the pool's last data device (a pool keeps at least one)"
            ));
        }
        let used = allocator.live_bytes(index);
        let free: u64 = destinations.iter().map(|s| s.free_bytes(chunk)).sum();
        // A partly used chunk holds slots of one size only: keep a chunk
        // per destination device in hand.
        let margin = chunk * destinations.len() as u64;
        if used + margin > free {
            return refuse(format!(
                "cannot remove {name}: it holds {} and the other {} devices have {} free",
                format_size(used),
                to.as_str(),
                format_size(free)
            ));
        }
        Ok(to)
    }

    fn removal_running(&self, index: u8) -> bool {
        self.removal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|r| r.index == index && r.phase != "failed")
    }

    fn update_removal(&self, change: impl FnOnce(&mut RemovalStatus)) {
        if let Some(status) = self.removal.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            change(status);
        }
    }

    /// Starts a removal ([`Pool::check_removal`] first): the member takes
    /// no new data from now on and every superblock says so. Returns once
    /// that is recorded; [`Pool::finish_removal`] does the rest.
    pub async fn start_removal(&self, index: u8) -> Result<(), PoolError> {
        let to = self.check_removal(index)?;
        let device = self
            .devices
            .get(index as usize)
            .ok_or_else(|| PoolError::Invalid(format!("no member {index}")))?;
        let used = self.allocator.lock_or_abort().live_bytes(index);
        *self.removal.lock().unwrap_or_else(|e| e.into_inner()) = Some(RemovalStatus {
            index,
            name: device.device.info().name.clone(),
            phase: "evacuating".into(),
            total_bytes: used,
            moved_bytes: 0,
            left_bytes: used,
            destination: to,
            error: None,
        });
        if device.state() == MemberState::Evacuating {
            return Ok(());
        }
        // The allocator first: nothing new lands there from this moment.
        self.allocator.lock_or_abort().set_accepting(index, false);
        device.set_state(MemberState::Evacuating);
        if let Err(e) = self.record_member_state(index, MemberState::Evacuating).await {
            // Some superblocks may say evacuating: the next start resumes
            // the removal. Until then the device takes data again.
            self.allocator.lock_or_abort().set_accepting(index, true);
            device.set_state(MemberState::Active);
            self.update_removal(|s| {
                s.phase = "failed".into();
                s.error = Some(e.to_string());
            });
            return Err(e);
        }
        tracing::info!(
            "pool {}: removing {} (member {index}): moving {} to the {} tier",
            self.name,
            device.device.info().name,
            format_size(used),
            to.as_str()
        );
        Ok(())
    }

    /// Moves every block off member `index` (being removed: see
    /// [`Pool::start_removal`]), then takes it out of the allocator, the
    /// superblocks and the running pool. A failure leaves it in, taking
    /// no new data, with the reason in [`Pool::removal_status`].
    pub async fn finish_removal(self: &Arc<Self>, index: u8) -> Result<(), PoolError> {
        let result = self.evacuate_and_drop(index).await;
        if let Err(e) = &result {
            tracing::error!("pool {}: removing member {index} stopped: {e}", self.name);
            self.update_removal(|s| {
                s.phase = "failed".into();
                s.error = Some(e.to_string());
            });
        }
        result
    }

    /// [`Pool::start_removal`], [`Pool::finish_removal`], then
    /// [`Pool::release_removed`]: for callers that keep no list of the
    /// pool's devices.
    pub async fn remove_member(self: &Arc<Self>, index: u8) -> Result<(), PoolError> {
        self.start_removal(index).await?;
        self.finish_removal(index).await?;
        self.release_removed(index).await;
        Ok(())
    }

    async fn evacuate_and_drop(self: &Arc<Self>, index: u8) -> Result<(), PoolError> {
        let device = self
            .devices
            .get(index as usize)
            .ok_or_else(|| PoolError::Invalid(format!("no member {index}")))?;
        assert_eq!(
            device.state(),
            MemberState::Evacuating,
            "a removal starts with start_removal"
        );
        let to = self.removal_status().map_or_else(
            || self.removal_destination(index, device.member.role),
            |s| s.destination,
        );
        let mut stuck = 0;
        loop {
            self.evacuate(index, to).await?;
            self.update_removal(|s| s.phase = "finishing".into());
            // Empty: out of the allocator, and durably so, before any
            // superblock stops naming it.
            let retired = {
                let mut allocator = self.allocator.lock_or_abort();
                allocator.retire_device(index)
            };
            match retired {
                Ok(()) => break,
                // The freer is punching a batch there, or a block landed
                // between the last round and now: again.
                Err(_) if stuck < STUCK_ROUNDS => {
                    stuck += 1;
                    self.update_removal(|s| s.phase = "evacuating".into());
                    tokio::time::sleep(STUCK_PAUSE).await;
                }
                Err(left) => {
                    return Err(PoolError::Invalid(format!(
                        "{} still holds {} after every block was moved",
                        device.device.info().name,
                        format_size(left)
                    )))
                }
            }
        }
        self.suspect.lock_or_abort().retain(|(d, _), _| *d != index);
        if let Some(extent) = self
            .geometry
            .write()
            .unwrap_or_else(|_| crate::sync::poisoned())
            .devices
            .get_mut(index as usize)
        {
            // From here a stored reference to the member is corrupt.
            extent.holds_data = false;
        }
        self.save_heat_at_next_checkpoint();
        device.set_state(MemberState::Removed);
        self.checkpoint().await?;
        self.record_member_state(index, MemberState::Removed).await?;
        self.membership.remove_member(index);
        self.update_removal(|s| {
            s.left_bytes = 0;
            s.phase = "done".into();
        });
        *self.removal.lock().unwrap_or_else(|e| e.into_inner()) = None;
        tracing::info!(
            "pool {}: removed {} (member {index}); its device can be taken away",
            self.name,
            device.device.info().name
        );
        Ok(())
    }

    /// Rounds of moves until member `index` holds nothing live: each round
    /// walks the open volumes' and their snapshots' maps for blocks there
    /// (up to [`OWNERS_PER_ROUND`]) and has the mover take them to tier
    /// `to`; the commit after each batch frees their old slots.
    async fn evacuate(self: &Arc<Self>, index: u8, to: Role) -> Result<(), PoolError> {
        let mut stuck = 0u32;
        loop {
            let left = self.allocator.lock_or_abort().live_bytes(index);
            self.update_removal(|s| s.left_bytes = left);
            if left == 0 {
                return Ok(());
            }
            let owners = self.owners_on(index)?;
            let mut moved_any = false;
            let mut failed = 0u64;
            for (engine, mut blocks) in owners {
                blocks.sort_by_key(|(block, _)| *block);
                for batch in blocks.chunks(MOVE_BATCH) {
                    let outcome = match engine.move_blocks(batch, to).await {
                        Ok(outcome) => outcome,
                        Err(crate::block::BlockError::NoSpace) => {
                            return Err(PoolError::Invalid(format!(
                                "the {} tier ran out of space while blocks moved to it",
                                to.as_str()
                            )))
                        }
                        Err(e) => {
                            return Err(PoolError::Invalid(format!(
                                "moving blocks of volume {} failed: {e}",
                                engine.id()
                            )))
                        }
                    };
                    let mut moved = 0;
                    for result in outcome {
                        match result {
                            Moved::To(..) => moved += engine.block_bytes(),
                            Moved::Skipped => {}
                            Moved::Failed => failed += 1,
                        }
                    }
                    if moved > 0 {
                        moved_any = true;
                        self.update_removal(|s| s.moved_bytes += moved);
                    }
                    self.commit_quiet().await?;
                    tokio::task::yield_now().await;
                }
            }
            if moved_any {
                stuck = 0;
                continue;
            }
            // Nothing moved: blocks with cached writes pending (placed by
            // the destager first), old slots waiting for a commit or for
            // the freer, or blocks that cannot be read.
            stuck += 1;
            if stuck >= STUCK_ROUNDS {
                let left = self.allocator.lock_or_abort().live_bytes(index);
                let why = if failed > 0 {
                    format!("{failed} blocks there could not be read or copied")
                } else {
                    "no open volume or snapshot maps them".into()
                };
                return Err(PoolError::Invalid(format!(
                    "member {index} still holds {} that cannot be moved: {why}",
                    format_size(left)
                )));
            }
            self.destage_all().await?;
            self.commit_quiet().await?;
            tokio::time::sleep(STUCK_PAUSE).await;
        }
    }

    /// The blocks on member `index` and who maps them, by engine: the open
    /// volumes' own blocks, and their snapshots' where the volume no
    /// longer maps the slot (a slot shared by several is listed once: the
    /// mover moves it for all of them). At most [`OWNERS_PER_ROUND`].
    #[allow(clippy::type_complexity)]
    fn owners_on(&self, index: u8) -> Result<Vec<(Arc<EngineVolume>, Vec<(u64, BlockPtr)>)>, PoolError> {
        let mut seen: HashSet<BlockPtr> = HashSet::new();
        let mut out: Vec<(Arc<EngineVolume>, Vec<(u64, BlockPtr)>)> = Vec::new();
        let mut count = 0;
        for engine in self.engines() {
            if engine.is_snapshot() {
                continue;
            }
            let id = engine.id();
            let mut blocks = Vec::new();
            let mut note = |block: u64, entry: BlockPtr, blocks: &mut Vec<(u64, BlockPtr)>| {
                if entry.place().is_some_and(|(device, _)| device == index) && seen.insert(entry.slot()) {
                    blocks.push((block, entry.slot()));
                }
            };
            let size = engine.size_bytes().div_ceil(engine.block_bytes());
            let mut from = Some(0);
            while let Some(start) = from.filter(|_| count + blocks.len() < OWNERS_PER_ROUND) {
                let (indexes, next) = self.view_page_indexes_from(id, size, start, PAGE_WINDOW)?;
                for page in indexes {
                    let first = page * MAP_ENTRIES_PER_PAGE;
                    let last = (first + MAP_ENTRIES_PER_PAGE - 1).min(size.saturating_sub(1));
                    for (block, entry) in (first..).zip(self.lookup_range(id, first, last)?) {
                        note(block, entry, &mut blocks);
                    }
                }
                from = next;
            }
            for snapshot in self.snapshots_of(id).iter().map(|s| s.id) {
                let mut from = Some(0);
                while let Some(start) = from.filter(|_| count + blocks.len() < OWNERS_PER_ROUND) {
                    let (indexes, next) = self.own_pages_from(snapshot, start, PAGE_WINDOW)?;
                    for page in indexes {
                        let stored = self.map_pages.get(&self.db, (snapshot, page))?;
                        for (within, entry) in stored.ptrs().into_iter().enumerate() {
                            note(page * MAP_ENTRIES_PER_PAGE + within as u64, entry, &mut blocks);
                        }
                    }
                    from = next;
                }
            }
            count += blocks.len();
            if !blocks.is_empty() {
                out.push((engine, blocks));
            }
            if count >= OWNERS_PER_ROUND {
                break;
            }
        }
        Ok(out)
    }

    /// Writes the next generation of the superblocks with member `index`
    /// in `state` to every device that takes superblock writes (a removed
    /// member's own devices excepted, and its mirror's children dropped
    /// from the child table).
    async fn record_member_state(&self, index: u8, state: MemberState) -> Result<(), PoolError> {
        let mut current = self.membership.lock().await;
        let mut next = current.clone();
        self.membership.note_health(&mut next);
        let member = next
            .members
            .get_mut(index as usize)
            .ok_or_else(|| PoolError::Invalid(format!("no member {index}")))?;
        member.state = state;
        if state == MemberState::Removed {
            next.children.retain(|c| c.member != index);
        }
        next.generation += 1;
        for (device, member, uuid) in self.membership.writable_devices(&next) {
            if member == index && state == MemberState::Removed {
                continue;
            }
            write_superblock(&device, &next.for_device(member, uuid)).await?;
        }
        *current = next;
        Ok(())
    }

    /// Zeroes both superblock copies of removed member `index`'s devices,
    /// so they can go into another pool. Best effort: a device that keeps
    /// them is left out by this pool (its member is removed) and refused by
    /// others as this pool's. The caller calls it once it no longer lists
    /// the devices (the catalog): a device listed without a superblock
    /// would stop the pool from opening.
    pub async fn release_removed(&self, index: u8) {
        let Some(device) = self.devices.get(index as usize).filter(|d| d.is_removed()) else {
            return;
        };
        let devices: Vec<Arc<dyn Device>> = match device.mirror() {
            Some(mirror) => mirror.children().iter().filter_map(|c| c.device.clone()).collect(),
            None => vec![device.device.clone()],
        };
        for device in devices {
            for offset in super::superblock::SUPERBLOCK_OFFSETS {
                let (_, written) = device.write(offset, IoBuf::new(SUPERBLOCK_BYTES)).await;
                if let Err(e) = written.and(device.flush().await) {
                    tracing::warn!(
                        "{}: could not clear the superblock of a removed device: {e}",
                        device.info().name
                    );
                    break;
                }
            }
        }
    }

    /// Whether `candidate` is a device of a member that the newest
    /// superblock among it and `members` marks removed: a device the
    /// catalog still lists after a removal was cut short between its
    /// superblock writes and the catalog's update. Such a device is left
    /// out of the pool.
    pub async fn superblocks_removed(members: &[Arc<dyn Device>], candidate: &Arc<dyn Device>) -> bool {
        let Ok((own, _)) = read_superblock(candidate).await else {
            return false;
        };
        let mut newest: Superblock = own.clone();
        for member in members {
            if let Ok((superblock, _)) = read_superblock(member).await {
                if superblock.pool_uuid == own.pool_uuid && superblock.generation > newest.generation {
                    newest = superblock;
                }
            }
        }
        newest
            .members
            .get(own.device_index as usize)
            .is_some_and(|m| m.removed() && m.uuid == own.members[own.device_index as usize].uuid)
    }

    /// Bytes of member `index` still in use by live slots.
    pub fn member_live_bytes(&self, index: u8) -> u64 {
        self.allocator.lock_or_abort().live_bytes(index)
    }
}

impl super::PoolDevice {
    pub(crate) fn state(&self) -> MemberState {
        match self.state.load(Ordering::Acquire) {
            1 => MemberState::Evacuating,
            2 => MemberState::Removed,
            _ => MemberState::Active,
        }
    }

    pub(crate) fn set_state(&self, state: MemberState) {
        self.state.store(state as u8, Ordering::Release);
    }

    /// Whether the member is gone from the pool.
    pub fn is_removed(&self) -> bool {
        self.state() == MemberState::Removed
    }
}
