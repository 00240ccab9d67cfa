//! Creating and opening a pool: superblocks, loading the allocator from the
//! checkpoint, replaying the intent log, and sizing the RAM tier for what
//! the log still holds.

use super::*;
use crate::meta::geometry::{CorruptionLog, DeviceExtent, Geometry};

pub(super) fn round_up(value: u64, unit: u64) -> u64 {
    value.div_ceil(unit) * unit
}

pub(super) async fn read_superblock(device: &Arc<dyn Device>) -> Result<(Superblock, bool), PoolError> {
    let mut copies = Vec::new();
    for offset in SUPERBLOCK_OFFSETS {
        let (buf, result) = device.read(offset, IoBuf::new(SUPERBLOCK_BYTES)).await;
        match result {
            Ok(()) => copies.push(buf.payload().to_vec()),
            Err(_) => copies.push(vec![0xff; SUPERBLOCK_BYTES]),
        }
    }
    superblock::choose([&copies[0], &copies[1]]).map_err(|e| PoolError::Device {
        device: device.info().name.clone(),
        reason: e.to_string(),
    })
}

pub(super) async fn write_superblock(device: &Arc<dyn Device>, superblock: &Superblock) -> Result<(), DeviceError> {
    let bytes = superblock.encode();
    for &offset in superblock.copy_offsets() {
        let (_, result) = device.write(offset, IoBuf::copy_from(&bytes)).await;
        result?;
        // Flush between copies: a crash can tear at most one of them.
        device.flush().await?;
    }
    Ok(())
}

impl Pool {
    /// Initialises a pool on `devices` (which must not already be strata
    /// devices) and opens it.
    pub async fn create(name: &str, chunk_bytes: u32, devices: Vec<NewDevice>) -> Result<Arc<Pool>, PoolError> {
        Self::create_with(name, chunk_bytes, devices, PoolOptions::default()).await
    }

    /// `create` with options for the opened pool.
    pub async fn create_with(
        name: &str,
        chunk_bytes: u32,
        devices: Vec<NewDevice>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>, PoolError> {
        let vdevs = devices
            .into_iter()
            .map(|d| NewVdev {
                role: d.role,
                devices: vec![d.device],
                write_mostly: Vec::new(),
            })
            .collect();
        Self::create_vdevs(name, chunk_bytes, vdevs, options).await
    }

    /// Initialises a pool whose members are single devices or mirrors
    /// (`vdevs`, none of whose devices may already be strata devices) and
    /// opens it.
    pub async fn create_vdevs(
        name: &str,
        chunk_bytes: u32,
        vdevs: Vec<NewVdev>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>, PoolError> {
        if vdevs.is_empty() || vdevs.len() > superblock::MAX_MEMBERS {
            return Err(PoolError::Invalid(format!(
                "a pool needs 1 to {} devices",
                superblock::MAX_MEMBERS
            )));
        }
        if vdevs.iter().any(|v| v.devices.is_empty()) {
            return Err(PoolError::Invalid("a mirror needs at least one device".into()));
        }
        let child_count: usize = vdevs
            .iter()
            .filter(|v| v.devices.len() > 1)
            .map(|v| v.devices.len())
            .sum();
        if child_count > superblock::MAX_CHILDREN {
            return Err(PoolError::Invalid(format!(
                "a pool's mirrors have at most {} devices in all",
                superblock::MAX_CHILDREN
            )));
        }
        if !chunk_bytes.is_power_of_two() || !(64 << 10..=64 << 20).contains(&chunk_bytes) {
            return Err(PoolError::Invalid(format!(
                "chunk size {chunk_bytes} must be a power of two from 64K to 64M"
            )));
        }
        if !vdevs.iter().any(|d| d.role.holds_data()) {
            return Err(PoolError::Invalid(
                "a pool needs at least one fast or capacity device".into(),
            ));
        }
        for device in vdevs.iter().flat_map(|v| &v.devices) {
            if read_superblock(device).await.is_ok() {
                return Err(PoolError::InUse(device.info().name.clone()));
            }
        }
        let chunk = chunk_bytes as u64;
        let format = superblock::FORMAT_VERSION;
        let header = superblock::header_bytes(format, chunk_bytes);
        // The name of a member in messages: its device, or its mirror's.
        let vdev_name = |index: u8| -> String {
            let devices = &vdevs[index as usize].devices;
            devices
                .iter()
                .map(|d| d.info().name.clone())
                .collect::<Vec<_>>()
                .join(" + ")
        };
        let members: Vec<Member> = vdevs
            .iter()
            .enumerate()
            .map(|(index, new)| Member {
                uuid: random_uuid(),
                role: new.role,
                index: index as u8,
                // A mirror is as large as its smallest device.
                size_bytes: new.devices.iter().map(|d| d.info().size_bytes).min().unwrap_or(0) / chunk * chunk,
                state: crate::pool::superblock::MemberState::Active,
            })
            .collect();
        let mut children = Vec::new();
        // Each device's own uuid, in `vdevs` order.
        let mut device_uuids: Vec<Vec<[u8; 16]>> = Vec::new();
        for (index, new) in vdevs.iter().enumerate() {
            if new.devices.len() == 1 {
                device_uuids.push(vec![members[index].uuid]);
                continue;
            }
            let uuids: Vec<[u8; 16]> = new.devices.iter().map(|_| random_uuid()).collect();
            for (at, uuid) in uuids.iter().enumerate() {
                children.push(superblock::Child {
                    uuid: *uuid,
                    member: index as u8,
                    state: superblock::ChildState::Online,
                    write_mostly: new.write_mostly.get(at).copied().unwrap_or(false),
                    resilvered: 0,
                    tracked: false,
                    replaced: false,
                    replacement: false,
                });
            }
            device_uuids.push(uuids);
        }
        // Metadata on the first fast device (else the first data device).
        let meta_device = members
            .iter()
            .find(|m| m.role == Role::Fast)
            .or_else(|| members.iter().find(|m| m.role.holds_data()))
            .map(|m| m.index)
            .unwrap_or(0);
        let data_bytes: u64 = members
            .iter()
            .filter(|m| m.role.holds_data())
            .map(|m| m.size_bytes)
            .sum();
        // Metadata needs about 1/128 of the data; four times that leaves
        // room to grow the pool fourfold with `pool add-device`.
        let meta_bytes = round_up((data_bytes / 32).clamp(MIN_META_BYTES, MAX_META_BYTES), chunk);
        let meta_offset = header;
        let (log_device, log_offset, log_bytes) = match members.iter().find(|m| m.role == Role::Log) {
            Some(log) => (
                log.index,
                header,
                round_up(log.size_bytes.saturating_sub(header).min(1 << 30), chunk),
            ),
            None => (
                meta_device,
                meta_offset + meta_bytes,
                round_up(DEFAULT_LOG_BYTES, chunk),
            ),
        };
        // A log region smaller than a chunk (a dedicated log device under
        // two chunks) cannot hold a commit's blocks.
        let log_member = &members[log_device as usize];
        if log_bytes < chunk || log_offset + log_bytes > log_member.size_bytes {
            return Err(PoolError::Invalid(format!(
                "{} is too small for a log ({} bytes; needs at least {})",
                vdev_name(log_device),
                log_member.size_bytes,
                header + chunk
            )));
        }
        for member in &members {
            let mut reserved = header;
            if member.index == meta_device {
                reserved += meta_bytes;
            }
            if member.index == log_device {
                reserved = reserved.max(log_offset + log_bytes);
            }
            if member.size_bytes < reserved + if member.role.holds_data() { 4 * chunk } else { 0 } {
                return Err(PoolError::Invalid(format!(
                    "{} is too small ({} bytes; needs at least {} for its role)",
                    vdev_name(member.index),
                    member.size_bytes,
                    reserved + 4 * chunk
                )));
            }
        }
        let pool_uuid = random_uuid();
        let created_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // An empty header makes the metadata region start empty.
        for meta in &vdevs[meta_device as usize].devices {
            let (_, result) = meta.write(meta_offset, IoBuf::new(4096)).await;
            result?;
            meta.flush().await?;
        }
        // On a regular file, write the log region once now: otherwise each
        // commit's first pass over it makes the file system allocate blocks,
        // and the commit's fdatasync then also commits the file system's
        // journal (measured: a 4K sync write's p50 375 µs on a sparse log
        // file against 243 µs on a written one).
        for log_dev in &vdevs[log_device as usize].devices {
            if !log_dev.info().regular_file {
                continue;
            }
            let mut zeros = IoBuf::new(1 << 20);
            let mut at = 0;
            while at < log_bytes {
                let length = (log_bytes - at).min(1 << 20) as usize;
                if zeros.len() != length {
                    zeros = IoBuf::new(length);
                }
                let (buf, result) = log_dev.write(log_offset + at, zeros).await;
                result?;
                zeros = buf;
                at += length as u64;
            }
            log_dev.flush().await?;
        }
        let template = Superblock {
            format,
            pool_uuid,
            pool_name: name.to_string(),
            generation: 1,
            created_unix,
            chunk_bytes,
            device_index: 0,
            meta_device,
            meta_offset,
            meta_bytes,
            log_device,
            log_offset,
            log_bytes,
            members: members.clone(),
            device_uuid: members[0].uuid,
            children,
        };
        for (index, new) in vdevs.iter().enumerate() {
            for (device, uuid) in new.devices.iter().zip(&device_uuids[index]) {
                write_superblock(device, &template.for_device(index as u8, *uuid)).await?;
            }
        }
        Self::open_with(vdevs.into_iter().flat_map(|v| v.devices).collect(), options).await
    }

    /// Opens a pool from its devices (in any order), replaying the log.
    pub async fn open(devices: Vec<Arc<dyn Device>>) -> Result<Arc<Pool>, PoolError> {
        Self::open_with(devices, PoolOptions::default()).await
    }

    /// `open` with a RAM tier and background work as given.
    pub async fn open_with(devices: Vec<Arc<dyn Device>>, options: PoolOptions) -> Result<Arc<Pool>, PoolError> {
        let mut found = Vec::new();
        for device in &devices {
            let (superblock, repair) = read_superblock(device).await?;
            found.push((device.clone(), superblock, repair));
        }
        // The newest superblock describes the pool; every device must agree.
        let reference = found
            .iter()
            .max_by_key(|(_, s, _)| s.generation)
            .map(|(_, s, _)| s.clone())
            .ok_or_else(|| PoolError::Invalid("no devices given".into()))?;
        // Each member's devices as the reference lists them: one for a
        // single device, one per child for a mirror.
        let listed = |index: u8| -> Vec<[u8; 16]> {
            if reference.is_mirror(index) {
                reference.children_of(index).map(|c| c.uuid).collect()
            } else {
                vec![reference.members[index as usize].uuid]
            }
        };
        let mut slots: Vec<Vec<Option<Arc<dyn Device>>>> = reference
            .members
            .iter()
            .map(|m| vec![None; listed(m.index).len()])
            .collect();
        let mut left_out: Vec<Arc<dyn Device>> = Vec::new();
        for (device, superblock, repair) in &found {
            if superblock.pool_uuid != reference.pool_uuid {
                return Err(PoolError::Foreign {
                    device: device.info().name.clone(),
                    found: superblock.pool_name.clone(),
                    found_uuid: uuid_text(&superblock.pool_uuid),
                    expected: reference.pool_name.clone(),
                });
            }
            let index = superblock.device_index;
            // A device of a member removed since it was last written (the
            // catalog may still list it after a crash): never opened again.
            if reference.members.get(index as usize).is_some_and(|m| m.removed()) {
                tracing::warn!(
                    "{}: its member was removed from pool '{}'; it is left out",
                    device.info().name,
                    reference.pool_name
                );
                continue;
            }
            let position = (index as usize)
                .lt(&reference.members.len())
                .then(|| listed(index).iter().position(|u| *u == superblock.device_uuid))
                .flatten();
            let Some(position) = position else {
                if superblock.generation < reference.generation {
                    // Detached (or replaced) since: the newest superblock
                    // no longer names it. Left for the caller to clear.
                    tracing::warn!(
                        "{}: was detached from pool '{}' (its superblock is of generation {}, the pool's {}); \
                         opening without it",
                        device.info().name,
                        reference.pool_name,
                        superblock.generation,
                        reference.generation
                    );
                    left_out.push(device.clone());
                    continue;
                }
                return Err(PoolError::Invalid(format!(
                    "{} claims to be device {} of pool '{}' but the pool does not list it",
                    device.info().name,
                    index,
                    reference.pool_name
                )));
            };
            let slot = &mut slots[index as usize][position];
            if slot.is_some() {
                return Err(PoolError::Invalid(format!(
                    "device {} of pool '{}' was given twice",
                    index, reference.pool_name
                )));
            }
            if *repair || superblock.generation < reference.generation {
                let rewritten = write_superblock(device, &reference.for_device(index, superblock.device_uuid)).await;
                match rewritten {
                    Ok(()) => tracing::warn!("{}: rewrote a damaged or stale superblock copy", device.info().name),
                    // A mirror goes on without a device that cannot take
                    // its superblock; any other member is needed.
                    Err(e) if reference.is_mirror(index) => {
                        tracing::error!("{}: {e}; the mirror opens without it", device.info().name);
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            *slot = Some(device.clone());
        }
        // Two devices of one mirror that each say the other missed writes
        // were used apart (the pool opened with one, then with the other):
        // neither can be trusted over the other without the admin.
        for (a, first, _) in &found {
            for (b, second, _) in &found {
                let stale_in = |s: &Superblock, uuid: [u8; 16]| {
                    s.children
                        .iter()
                        .any(|c| c.uuid == uuid && c.state == superblock::ChildState::Stale)
                };
                if first.device_index == second.device_index
                    && first.device_uuid < second.device_uuid
                    && stale_in(first, second.device_uuid)
                    && stale_in(second, first.device_uuid)
                {
                    return Err(PoolError::Invalid(format!(
                        "{} and {} of pool '{}' each say the other missed writes: the pool ran on each \
                         of them without the other, and their data differs. Open the pool with only the \
                         one to keep (leave the other out of catalog.json)",
                        a.info().name,
                        b.info().name,
                        reference.pool_name
                    )));
                }
            }
        }
        let membership = Arc::new(super::vdev::Membership::new(reference.clone()));
        let mut pool_devices = Vec::new();
        let mut mirrors = Vec::new();
        for (index, slot) in slots.into_iter().enumerate() {
            let member = reference.members[index];
            if member.removed() {
                // Its index stays taken: stored metadata names members by index.
                let device = super::remove::removed_device(index as u8, member.size_bytes);
                pool_devices.push(PoolDevice::new(Arc::new(super::vdev::Vdev::single(device)), member, 0));
                continue;
            }
            let missing = || PoolError::Missing {
                pool: reference.pool_name.clone(),
                role: member.role.as_str(),
                uuid: uuid_text(&member.uuid),
                index: index as u8,
                count: reference.members.len(),
            };
            for device in slot.iter().flatten() {
                if device.info().size_bytes < member.size_bytes {
                    return Err(PoolError::Device {
                        device: device.info().name.clone(),
                        reason: format!(
                            "is {} bytes but the pool recorded {} (truncated or wrong device)",
                            device.info().size_bytes,
                            member.size_bytes
                        ),
                    });
                }
            }
            let vdev = if reference.is_mirror(index as u8) {
                use super::vdev::{Health, Mirror, MirrorChild};
                let children: Vec<MirrorChild> = reference
                    .children_of(index as u8)
                    .zip(slot)
                    .map(|(child, device)| {
                        // A stale device that is here is resilvered: it
                        // takes every write from now on, and reads once the
                        // resilver (`Pool::resilver`) has copied the rest.
                        let health = match (&device, child.state) {
                            (None, _) => Health::Missing,
                            (Some(_), superblock::ChildState::Online) => Health::Online,
                            (Some(_), superblock::ChildState::Stale) => Health::Resilvering,
                        };
                        // One up to date and missing now is tracked from
                        // here: the record starts before anything is written.
                        let missing_now = device.is_none() && child.state == superblock::ChildState::Online;
                        let opened = MirrorChild::new(device, child.uuid, child.write_mostly, health, child.resilvered);
                        opened.replaced.store(child.replaced, Ordering::Release);
                        opened.replacement.store(child.replacement, Ordering::Release);
                        opened.tracked.store(child.tracked || missing_now, Ordering::Release);
                        opened
                    })
                    .collect();
                let mirror = Arc::new(Mirror::new(index as u8, member.size_bytes, children));
                if mirror.online().is_empty() {
                    return Err(missing());
                }
                for child in mirror.children().iter().filter(|c| c.health() != Health::Online) {
                    tracing::warn!(
                        "pool '{}': {} of {} is {}; the mirror is DEGRADED",
                        reference.pool_name,
                        child.name,
                        mirror.info().name,
                        child.health().as_str()
                    );
                }
                mirror.set_membership(&membership);
                mirrors.push(mirror.clone());
                Arc::new(super::vdev::Vdev::mirrored(mirror))
            } else {
                let Some(device) = slot.into_iter().next().flatten() else {
                    return Err(missing());
                };
                Arc::new(super::vdev::Vdev::single(device))
            };
            membership.add_member(index as u8, &vdev);
            let chunks = member.size_bytes / reference.chunk_bytes as u64;
            pool_devices.push(PoolDevice::new(vdev, member, chunks));
        }
        // A child that was up to date and is not here misses every write
        // from now on: say so in the others' superblocks before writing
        // (and a stale child whose dirty record was lost is resilvered in
        // full: say that too, before writes the record would miss).
        for mirror in &mirrors {
            Self::open_dirty_record(&reference, mirror).await?;
        }
        membership.record_health().await;
        let pool = Self::recover(reference, pool_devices, membership, options).await?;
        // A replacement up to date when the pool stopped takes its place now.
        pool.finish_replacements().await;
        pool.detached.lock().unwrap_or_else(|e| e.into_inner()).extend(left_out);
        Ok(pool)
    }

    /// Reads the dirty record of `mirror` when a stale child is tracked by
    /// it; when it cannot be read whole, those children are resilvered in
    /// full. While it tracks, it is written to every device the mirror
    /// writes before any superblock names a tracked child or anything else
    /// is written.
    async fn open_dirty_record(reference: &Superblock, mirror: &super::vdev::Mirror) -> Result<(), PoolError> {
        let index = mirror.member();
        let stale_tracked = reference
            .children_of(index)
            .any(|c| c.state == superblock::ChildState::Stale && c.tracked);
        let loaded = if stale_tracked {
            let loaded = mirror.load_record().await;
            if loaded.is_none() {
                tracing::warn!(
                    "pool '{}': the dirty record of {} cannot be read; its stale devices are resilvered in full",
                    reference.pool_name,
                    mirror.info().name
                );
                for (entry, child) in reference.children_of(index).zip(mirror.children().iter()) {
                    if entry.state == superblock::ChildState::Stale {
                        child.tracked.store(false, Ordering::Release);
                    }
                }
            }
            loaded
        } else {
            None
        };
        mirror.init_record(loaded);
        if mirror.tracking() {
            mirror.persist_record(true).await?;
        }
        Ok(())
    }

    async fn recover(
        superblock: Superblock,
        devices: Vec<PoolDevice>,
        membership: Arc<super::vdev::Membership>,
        options: PoolOptions,
    ) -> Result<Arc<Pool>, PoolError> {
        let chunk = superblock.chunk_bytes as u64;
        let devices = grow::DeviceList::from(devices);
        let meta_dev = devices
            .at(superblock.meta_device)
            .map_err(PoolError::Meta)?
            .device
            .clone();
        let (meta_offset, meta_bytes) = (superblock.meta_offset, superblock.meta_bytes);
        let store_bytes = Arc::new(AtomicU64::new(0));
        let written = store_bytes.clone();
        let db =
            run_blocking(move || store::open_database(meta_dev, meta_offset, meta_bytes, STORE_CACHE_BYTES, written))
                .await
                .map_err(PoolError::Meta)?;
        let checkpoint_lsn = store::read_state(&db, "checkpoint_lsn").map_err(PoolError::Meta)?;
        // Pools checkpointed before the intent log carried data have no
        // separate data tail (0 = the checkpoint LSN).
        let data_tail = match store::read_state(&db, "has_data_tail").map_err(PoolError::Meta)? {
            0 => checkpoint_lsn,
            _ => store::read_state(&db, "data_tail")
                .map_err(PoolError::Meta)?
                .min(checkpoint_lsn),
        };
        let epoch = store::read_state(&db, "epoch").map_err(PoolError::Meta)? as u32;
        let checksum_tags = superblock.format >= superblock::TAGGED_CHECKSUMS_FORMAT;
        let snapshots = snapshots::load(&db).map_err(PoolError::Meta)?;
        let namespaces = files::load_namespaces(&db).map_err(PoolError::Meta)?;

        // Space: every data device minus chunk 0 and the metadata/log regions.
        let first_data_chunk = |d: &PoolDevice| {
            let mut first = superblock.header_bytes() / chunk;
            if d.member.index == superblock.meta_device {
                first = first.max((superblock.meta_offset + superblock.meta_bytes).div_ceil(chunk));
            }
            if d.member.index == superblock.log_device {
                first = first.max((superblock.log_offset + superblock.log_bytes).div_ceil(chunk));
            }
            first
        };
        let spaces = devices
            .iter()
            .filter(|d| d.member.role.holds_data() && !d.member.removed())
            .map(|d| {
                let mut space = DeviceSpace::new(
                    d.member.index,
                    d.member.role,
                    first_data_chunk(d),
                    d.member.size_bytes / chunk,
                );
                // Being removed: nothing new goes there (`pool/remove.rs`).
                space.accepting = d.member.state == superblock::MemberState::Active;
                space
            })
            .collect();
        // What stored map entries and checksum pages are checked against.
        let geometry = Geometry {
            entries: BlockPtr::LAYOUT,
            sector_bytes: SECTOR_BYTES,
            devices: devices
                .iter()
                .map(|d| DeviceExtent {
                    holds_data: d.member.role.holds_data() && !d.member.removed(),
                    first_data: first_data_chunk(d) * chunk,
                    end: d.member.size_bytes / chunk * chunk,
                })
                .collect(),
        };
        let mut allocator = Allocator::new(superblock.chunk_bytes, spaces);
        // Rows of a removed member: a removal deletes them with the
        // checkpoint before its superblocks, so none should be left.
        let removed = |device: u32| devices.get(device as usize).is_some_and(|d| d.member.removed());
        let mut suspect: HashMap<(u8, u64), ChunkParts> = HashMap::new();
        store::guarded("loading the chunk, suspect and heat tables", || {
            let txn = db.begin_read().map_err(MetaError::from)?;
            let chunks = txn.open_table(CHUNKS).map_err(MetaError::from)?;
            for row in chunks.iter().map_err(MetaError::from)? {
                let (key, value) = row.map_err(MetaError::from)?;
                let (device, chunk_index) = key.value();
                if removed(device) {
                    continue;
                }
                let state = ChunkState::decode_stored((device, chunk_index), value.value())
                    .map_err(|e| corrupt(format!("table chunks key ({device}, {chunk_index}): {e}")))?;
                let device = u8::try_from(device).map_err(|_| {
                    corrupt(format!(
                        "table chunks key ({device}, {chunk_index}): device {device} does not exist"
                    ))
                })?;
                allocator
                    .load_chunk(device, chunk_index, state)
                    .map_err(|e| corrupt(format!("table chunks key ({device}, {chunk_index}): {e}")))?;
            }
            let table = txn.open_table(SUSPECT).map_err(MetaError::from)?;
            for row in table.iter().map_err(MetaError::from)? {
                let (key, _) = row.map_err(MetaError::from)?;
                let (device, chunk_index) = key.value();
                if removed(device) {
                    continue;
                }
                geometry
                    .check_chunk(device as u64, chunk_index, chunk)
                    .map_err(|e| corrupt(format!("table suspect key ({device}, {chunk_index}): {e}")))?;
                suspect.insert((device as u8, chunk_index), ALL_PARTS);
            }
            // Pools from before parts were kept have no such table.
            if let Ok(table) = txn.open_table(crate::meta::store::SUSPECT_PARTS) {
                for row in table.iter().map_err(MetaError::from)? {
                    let (key, value) = row.map_err(MetaError::from)?;
                    let (device, chunk_index) = key.value();
                    if removed(device) {
                        continue;
                    }
                    geometry
                        .check_chunk(device as u64, chunk_index, chunk)
                        .map_err(|e| corrupt(format!("table suspect_parts key ({device}, {chunk_index}): {e}")))?;
                    let parts = decode_parts((device, chunk_index), value.value())
                        .map_err(|e| corrupt(format!("table suspect_parts key ({device}, {chunk_index}): {e}")))?;
                    let entry = suspect.entry((device as u8, chunk_index)).or_default();
                    for (word, add) in entry.iter_mut().zip(parts) {
                        *word |= add;
                    }
                }
            }
            // Heat is a hint: a pool from before it was stored has none.
            if let Ok(table) = txn.open_table(crate::meta::store::HEAT) {
                for row in table.iter().map_err(MetaError::from)? {
                    let (key, counts) = row.map_err(MetaError::from)?;
                    let (device, chunk_index) = key.value();
                    if let Some(d) = devices.iter().find(|d| d.member.index as u32 == device) {
                        d.heat.restore(chunk_index, counts.value());
                    }
                }
            }
            Ok::<(), PoolError>(())
        })?;
        allocator.take_dirty();

        let log_member = devices.at(superblock.log_device).map_err(PoolError::Meta)?;
        let log_device = log_member.device.clone();
        let pool_tag = pool_tag(&superblock.pool_uuid);
        let (records, end_lsn, valid_end, log_source) =
            replay_longest(log_member, &superblock, pool_tag, data_tail).await?;
        let log = Log::new(
            log_device,
            superblock.log_offset,
            superblock.log_bytes,
            pool_tag,
            data_tail,
            end_lsn,
        );
        // The RAM tier: if it survived (the process died, the machine did
        // not), it holds the newest contents of every dirty sector and the
        // log's Data records are not needed. Otherwise the live Data records
        // rebuild the cache.
        let source = options
            .ram
            .clone()
            .unwrap_or_else(|| ram::RamSource::Heap(ram::HeapImage::new(DEFAULT_RAM_BYTES)));
        let (ram_tier, survivors, intact) = ram::RamTier::open(&source, &superblock.pool_uuid)
            .map_err(|e| PoolError::Invalid(format!("cannot open the RAM tier: {e}")))?;
        // The checkpoint stored epoch `epoch` as the one it began: writes in
        // place before it are in its checksums, those from it on may not be.
        let covered = epoch.wrapping_sub(1);
        let crash_marks = ram_tier.marks_after(covered);
        let replayed_data = if intact {
            Vec::new()
        } else {
            cache::live_data_records(&records)
        };
        let (ram_tier, survivors) = if replayed_data.len() > ram_tier.total_slots() {
            // Smaller than the data the log still holds: a larger heap region
            // until the next start.
            tracing::warn!(
                "RAM tier {} is smaller than the {} sectors to replay; using a larger heap region",
                ram_tier.location(),
                replayed_data.len()
            );
            let image = ram::HeapImage::new((replayed_data.len() as u64 + 64) * ram::SLOT_BYTES as u64 * 2);
            let (tier, survivors, _) = ram::RamTier::open(&ram::RamSource::Heap(image), &superblock.pool_uuid)
                .map_err(|e| PoolError::Invalid(format!("cannot open the RAM tier: {e}")))?;
            (tier, survivors)
        } else {
            (ram_tier, survivors)
        };
        if !survivors.is_empty() {
            tracing::info!(
                "pool {}: {} dirty sectors survived in the RAM tier {}",
                superblock.pool_name,
                survivors.len(),
                ram_tier.location()
            );
        }
        let write_cache = cache::WriteCache::new(ram_tier, &survivors, data_tail);
        let geometry = Arc::new(std::sync::RwLock::new(geometry));
        let corruption: Arc<CorruptionLog> = Arc::default();
        let pool = Arc::new(Pool {
            name: superblock.pool_name.clone(),
            uuid: superblock.pool_uuid,
            chunk_bytes: superblock.chunk_bytes,
            meta_device: superblock.meta_device,
            devices,
            db,
            log,
            map_pages: PageCache::new(meta_cache_pages(options.meta_cache_bytes).0)
                .checked(geometry.clone(), corruption.clone()),
            crc_pages: PageCache::new(meta_cache_pages(options.meta_cache_bytes).1)
                .checked(geometry.clone(), corruption.clone()),
            checksum_tags,
            geometry,
            membership,
            regions: Regions {
                meta: (superblock.meta_offset, superblock.meta_bytes),
                log_device: superblock.log_device,
                log: (superblock.log_offset, superblock.log_bytes),
            },
            resilvers: Mutex::new(HashMap::new()),
            background: options.background,
            resilvering: tokio::sync::Mutex::new(()),
            detached: Mutex::new(Vec::new()),
            removal: Mutex::new(None),
            scrub: Mutex::new(None),
            corruption,
            allocator: Ranked::new(Rank::Allocator, 0, crate::sync::WatchedMutex::new(allocator)),
            epoch: AtomicU32::new(epoch.wrapping_add(1).max(1)),
            suspect: Ranked::new(Rank::Suspect, 0, Mutex::new(suspect)),
            covered: AtomicU32::new(covered),
            crash_marks: Mutex::new(crash_marks),
            destroyed: Ranked::new(Rank::Destroyed, 0, Mutex::new(HashSet::new())),
            gates: new_gates(),
            checkpointing: Ranked::new(Rank::Checkpointing, 0, tokio::sync::Mutex::new(())),
            making_log_room: Ranked::new(Rank::MakingLogRoom, 0, tokio::sync::Mutex::new(())),
            releasing: Ranked::new(Rank::Releasing, 0, tokio::sync::RwLock::new(())),
            checkpoints: AtomicU64::new(0),
            checkpoint_pages: AtomicU64::new(0),
            checkpoint_scheduled: std::sync::atomic::AtomicBool::new(false),
            free_above: std::sync::atomic::AtomicUsize::new(options.background_free_above.unwrap_or(usize::MAX)),
            freer_wake: Arc::new(tokio::sync::Notify::new()),
            freer: tokio::sync::Mutex::new(()),
            backing_low: std::sync::atomic::AtomicBool::new(false),
            store_bytes,
            cache: write_cache,
            read_cache: readcache::ReadCache::new(options.read_cache_bytes),
            reserved_bytes: AtomicU64::new(0),
            space_short: std::sync::atomic::AtomicBool::new(false),
            has_snapshots: std::sync::atomic::AtomicBool::new(!snapshots.is_empty()),
            snapshots: Ranked::new(Rank::Snapshots, 0, std::sync::RwLock::new(snapshots)),
            page_copy: Ranked::new(Rank::PageCopy, 0, Mutex::new(())),
            relocations: AtomicU64::new(0),
            open_engines: Ranked::new(Rank::OpenEngines, 0, Mutex::new(Vec::new())),
            data_flushes: AtomicU64::new(0),
            commit_data_flushes: AtomicU64::new(0),
            log_room_waits: AtomicU64::new(0),
            log_room_wait_micros: AtomicU64::new(0),
            data_flush: Ranked::new(Rank::DataFlush, 0, tokio::sync::Mutex::new(())),
            migrator: Default::default(),
            data_tail: AtomicU64::new(data_tail),
            engines: Mutex::new(std::collections::HashMap::new()),
            namespaces: Mutex::new(namespaces),
            self_ref: std::sync::OnceLock::new(),
            #[cfg(test)]
            fail_mapping_after: std::sync::atomic::AtomicI64::new(-1),
            #[cfg(test)]
            page_copy_pause: Mutex::new(None),
        });
        let _ = pool.self_ref.set(Arc::downgrade(&pool));
        let replayed = records.len();
        let mut staged_dropped = 0;
        for (record, committed, lsn) in records {
            // Records before the checkpoint were kept for their data only.
            if lsn < checkpoint_lsn || matches!(record, Record::Data { .. } | Record::Written { .. }) {
                continue;
            }
            pool.check_replayed(&record)
                .map_err(|e| corrupt(format!("log record at LSN {lsn}: {e}")))?;
            // A staged record (never committed) counts only if the data it
            // maps made it to the device intact (on a mirror, to some copy
            // of each sector; the others are rewritten from it): staging has no data flush before it, so after a
            // power loss the mapping may have landed without its data.
            // (After a kill -9 it always matches: no write overwrites a
            // block in place while its mapping is uncommitted.)
            if !committed && !pool.staged_data_present(&record).await {
                staged_dropped += 1;
                continue;
            }
            pool.apply_replayed(record)?;
        }
        if staged_dropped > 0 {
            tracing::info!(
                "pool {}: ignored {staged_dropped} uncommitted mappings whose data never landed",
                pool.name
            );
        }
        let crash_marks = pool.crash_marks.lock_or_abort().take();
        if replayed > 0 {
            let (chunks, sectors) = {
                let suspect = pool.suspect.lock_or_abort();
                let parts: u64 = suspect.values().flatten().map(|w| w.count_ones() as u64).sum();
                (suspect.len(), parts)
            };
            tracing::info!(
                "pool {}: replayed {replayed} log records; {sectors} parts of {chunks} chunks are suspect \
                 (a write in place may have been in flight there){}",
                pool.name,
                if crash_marks.is_some() {
                    ""
                } else {
                    ": the RAM tier's in-place marks did not survive (the machine restarted), so every \
                     part of a chunk written in place is"
                }
            );
        }
        // New cached writes come after every snapshot taken so far (a
        // restart after a crash may find fewer entries than were written).
        let newest_floor = pool.snapshots_read().newest_cache_seq();
        pool.cache.advance_seq(newest_floor);
        if !replayed_data.is_empty() {
            tracing::info!(
                "pool {}: {} sectors of acknowledged synchronous writes restored from the intent log",
                pool.name,
                replayed_data.len()
            );
            pool.cache.restore(replayed_data, end_lsn);
        }
        // Persist what replay rebuilt and start the log afresh; blocks staged
        // before the crash must not be replayed again by a later recovery.
        pool.checkpoint().await?;
        pool.sync_mirrored_log(&superblock, log_source).await?;
        pool.log.seal(valid_end).await?;
        if options.background {
            pool.start_destager();
            pool.start_migrator();
            pool.start_freer();
            pool.start_resilver();
        }
        Ok(pool)
    }

    /// Mirrors read from one child while the pool opens. The log was
    /// replayed from `log_source` ([`replay_longest`]); a write in flight
    /// when the pool stopped may have reached one child's log and not
    /// another's, and rot may have cut one short, so the log region is
    /// copied from that child to the others before new records follow the
    /// replayed ones; from then on reads go to the least busy child.
    async fn sync_mirrored_log(&self, superblock: &Superblock, log_source: Option<[u8; 16]>) -> Result<(), PoolError> {
        for device in &self.devices {
            let Some(mirror) = device.mirror() else {
                continue;
            };
            let online = mirror.online();
            let source = online
                .iter()
                .find(|c| Some(c.uuid) == log_source)
                .or(online.first())
                .cloned();
            if let (Some(source), true) = (source, device.member.index == superblock.log_device) {
                let targets: Vec<_> = mirror
                    .written()
                    .into_iter()
                    .filter(|c| !Arc::ptr_eq(c, &source))
                    .collect();
                let step = 1u64 << 20;
                let mut at = 0;
                while at < superblock.log_bytes && !targets.is_empty() {
                    let length = (superblock.log_bytes - at).min(step);
                    let offset = superblock.log_offset + at;
                    let (buf, result) = mirror.read_child(&source, offset, IoBuf::new(length as usize)).await;
                    result?;
                    for target in &targets {
                        // A child that fails this is faulted; the others go on.
                        let _ = mirror.write_child(target, offset, buf.payload()).await;
                    }
                    at += length;
                }
            }
            mirror.pin_reads(false);
        }
        Ok(())
    }

    /// Checks a log record about to be replayed against the pool's
    /// devices: the slots it names, the chunks it marks, the checksums a
    /// new slot comes with (one per sector, a power of two of them).
    pub(super) fn check_replayed(&self, record: &Record) -> Result<(), String> {
        let geometry = self.geometry.read().unwrap_or_else(|_| crate::sync::poisoned());
        let slot = |field: &str, entry: u64| {
            geometry
                .check_map_entry(entry)
                .map_err(|e| format!("field {field}: {e}"))
        };
        let checksums = |new: BlockPtr, crcs: &[u32]| {
            let fits = if !new.is_mapped() {
                crcs.is_empty()
            } else {
                crcs.len().is_power_of_two()
            };
            if fits {
                Ok(())
            } else {
                Err(format!("field crcs: {} checksums for slot {new:#018x}", crcs.len()))
            }
        };
        match record {
            Record::Dirty { device, chunk } => geometry
                .check_chunk(*device as u64, *chunk, self.chunk_bytes as u64)
                .map_err(|e| format!("Dirty, field chunk: {e}")),
            Record::Map {
                volume,
                block,
                new,
                old,
                crcs,
            } => {
                let what = |e: String| format!("Map of volume {volume} block {block}, {e}");
                slot("new", *new).map_err(what)?;
                slot("old", *old).map_err(what)?;
                checksums(BlockPtr::from_bits(*new), crcs).map_err(what)
            }
            Record::Relocate {
                block, old, new, crcs, ..
            } => {
                let what = |e: String| format!("Relocate of block {block}, {e}");
                slot("new", *new).map_err(what)?;
                slot("old", *old).map_err(what)?;
                checksums(BlockPtr::from_bits(*new), crcs).map_err(what)
            }
            Record::Sums { device, offset, crcs } => geometry
                .check_sectors(*device, *offset, crcs.len() as u64)
                .map_err(|e| format!("Sums, {e}")),
            _ => Ok(()),
        }
    }

    /// Whether the data a staged `Map` record points at matches its checksums.
    /// A staged `Sums` record never counts: the repair it came before
    /// waits for its commit, so without one there was no repair.
    async fn staged_data_present(&self, record: &Record) -> bool {
        if matches!(record, Record::Sums { .. }) {
            return false;
        }
        let (Record::Map { crcs, .. } | Record::Relocate { crcs, .. }) = record else {
            return true;
        };
        let Some((device, offset)) = record.block_ptrs().and_then(|(new, _)| new.place()) else {
            return true;
        };
        let Some(pool_device) = self.devices.get(device as usize) else {
            return false;
        };
        let length = crcs.len() * SECTOR_BYTES as usize;
        let sector = SECTOR_BYTES as usize;
        let Some(mirror) = pool_device.mirror() else {
            let (buf, result) = pool_device.device.read(offset, IoBuf::new(length)).await;
            return result.is_ok()
                && buf
                    .payload()
                    .chunks(sector)
                    .zip(crcs)
                    .all(|(data, crc)| crate::checksum::crc32c(data) == *crc);
        };
        // The write went to each child unflushed: a power loss may tear it
        // on one copy and not another, and a child that failed it may not
        // have been marked faulted before the process died. A read through
        // the mirror sees one child only; accepting the mapping on its word
        // would leave a copy whose checksum is wrong that no later read
        // looks for (new blocks are not suspect) until the good copy is
        // gone. So every copy is read: the mapping counts if each sector is
        // intact on some child, and the copies that differ are rewritten
        // from those sectors before the pool serves the block. (No later
        // record can have put other data in the slot: a slot freed after
        // this record is free for reuse only once a commit covers both.)
        let children = mirror.written();
        let mut copies = Vec::with_capacity(children.len());
        for child in &children {
            let (buf, result) = mirror.read_child(child, offset, IoBuf::new(length)).await;
            copies.push(result.ok().map(|()| buf));
        }
        let mut good = vec![0u8; length];
        for (index, crc) in crcs.iter().enumerate() {
            let range = index * sector..(index + 1) * sector;
            let intact = copies
                .iter()
                .flatten()
                .map(|buf| &buf.payload()[range.clone()])
                .find(|data| crate::checksum::crc32c(data) == *crc);
            match intact {
                Some(data) => good[range].copy_from_slice(data),
                None => return false,
            }
        }
        for (child, copy) in children.iter().zip(&copies) {
            if copy.as_ref().is_some_and(|buf| buf.payload() == good.as_slice()) {
                continue;
            }
            // A child that fails the rewrite is faulted; the block stands
            // on the others.
            if mirror.write_child(child, offset, &good).await.is_ok() {
                let differing = match copy {
                    Some(buf) => buf
                        .payload()
                        .chunks(sector)
                        .zip(good.chunks(sector))
                        .filter(|(a, b)| a != b)
                        .count(),
                    None => crcs.len(),
                };
                child.counters.repaired.fetch_add(differing as u64, Ordering::Relaxed);
            }
        }
        true
    }

    /// The slots of a replayed mapping change: `freed` (unmapped: none) is
    /// free, `new` (unmapped: none) in use with checksums `crcs`. Either may be so
    /// already, if the checkpoint came after the record.
    /// `block`: the volume block the slot holds (what its stored checksums
    /// are tagged with).
    fn replay_slots(&self, freed: BlockPtr, new: BlockPtr, block: u64, crcs: &[u32]) -> Result<(), String> {
        let mut allocator = self.allocator.lock_or_abort();
        if let Some((device, offset)) = freed.place() {
            let _ = allocator.free(device, offset);
        }
        if let Some((device, offset)) = new.place() {
            let slot_shift = (crcs.len().max(1) as u64 * SECTOR_BYTES).trailing_zeros() as u8;
            match allocator.mark_used(device, offset, slot_shift) {
                Ok(()) | Err(alloc::AllocError::AlreadyUsed { .. }) => {}
                Err(e) => return Err(e.to_string()),
            }
            drop(allocator);
            let mut stored = crcs.to_vec();
            self.tag_crcs(&mut stored, block * crcs.len() as u64 * SECTOR_BYTES);
            self.store_crcs(device, offset, &stored).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    pub(super) fn apply_replayed(&self, record: Record) -> Result<(), PoolError> {
        match record {
            Record::Dirty { device, chunk } => {
                // With the in-place marks of the process that died: the
                // sectors it was about to write there (none if it never
                // wrote there in place, every one if a chunk found no entry
                // for its marks). Without: all of them.
                let parts = match &*self.crash_marks.lock_or_abort() {
                    Some(marks) => match marks.chunks.get(&(device, chunk)) {
                        Some(parts) => *parts,
                        None if marks.overflowed => ALL_PARTS,
                        None => [0; 4],
                    },
                    None => ALL_PARTS,
                };
                if parts.iter().any(|word| *word != 0) {
                    let mut suspect = self.suspect.lock_or_abort();
                    let entry = suspect.entry((device, chunk)).or_default();
                    for (word, add) in entry.iter_mut().zip(parts) {
                        *word |= add;
                    }
                }
            }
            Record::Map {
                volume,
                block,
                new,
                old,
                crcs,
            } => {
                let (new, old) = (BlockPtr::from_bits(new), BlockPtr::from_bits(old));
                let page = self.map_page(volume, block).map_err(PoolError::Meta)?;
                page.set_ptr((block % MAP_ENTRIES_PER_PAGE) as usize, new);
                page.present.store(true, Ordering::Release);
                self.map_pages.mark_dirty(&page);
                // A slot a snapshot shares stays.
                let freed = if old.is_shared() { BlockPtr::NONE } else { old };
                self.replay_slots(freed, new, block, &crcs)
                    .map_err(|e| corrupt(format!("log record mapping volume {volume} block {block}: {e}")))?;
            }
            Record::Relocate {
                block,
                old,
                new,
                crcs,
                owners,
            } => {
                let (new, old) = (BlockPtr::from_bits(new), BlockPtr::from_bits(old));
                self.apply_relocate(block, old, new, &owners).map_err(PoolError::Meta)?;
                self.replay_slots(old, new, block, &crcs)
                    .map_err(|e| corrupt(format!("log record moving block {block} of {owners:?}: {e}")))?;
            }
            Record::Sums { device, offset, crcs } => self.store_crcs(device, offset, &crcs).map_err(PoolError::Meta)?,
            Record::Destroy { volume } => self.free_volume_blocks(volume, Release::Replaying)?,
            Record::Namespace { dataset, ops } => self.replay_namespace(dataset, &ops),
            Record::Data { .. } | Record::Written { .. } => {}
            Record::Snapshot {
                generation,
                created_unix,
                cache_seq,
                snapshots,
            } => self.apply_snapshot_record(generation, created_unix, cache_seq, snapshots),
            Record::CopyPage {
                volume,
                page,
                snapshot,
                generation,
            } => self
                .apply_copy_page(volume, page, snapshot, generation)
                .map_err(PoolError::Meta)?,
            Record::Rollback { volume, snapshot } => {
                let freed = self.apply_rollback(volume, snapshot)?;
                self.roll_back_namespace(volume, snapshot);
                let mut allocator = self.allocator.lock_or_abort();
                for (device, offset) in freed {
                    // Already free if the checkpoint came after this record.
                    let _ = allocator.free(device, offset);
                }
            }
            Record::Clone { volume, origin } => {
                self.apply_clone(volume, origin);
                self.copy_namespace(origin, volume);
            }
            Record::ClonePage { volume, page } => self.apply_clone_page(volume, page).map_err(PoolError::Meta)?,
            Record::Promote { volume, origin } => self.apply_promote(volume, origin)?,
            Record::DestroySnapshot { snapshot } => {
                let freed = self.apply_destroy_snapshot(snapshot)?;
                let mut allocator = self.allocator.lock_or_abort();
                for (device, offset) in freed {
                    // Already free if the checkpoint came after this record.
                    let _ = allocator.free(device, offset);
                }
            }
        }
        Ok(())
    }
}

/// The tag every log block of the pool carries: the first 8 bytes of its
/// UUID.
/// What [`replay_longest`] found: the records (each with whether a commit
/// wrote it and its block's LSN), where the next commit goes, where the
/// valid blocks end, and the mirror child it read them from.
type Replayed = (Vec<(Record, bool, u64)>, u64, u64, Option<[u8; 16]>);

/// Replays the log of `member` from `tail`: on a mirror, from every
/// up-to-date child, keeping the one whose committed blocks go furthest
/// (then whose valid blocks do), with that child's uuid. The copies differ
/// only where a commit that was never acknowledged reached one child and
/// not another, or where rot cut one short: the longest holds every
/// acknowledged record either way. A child that cannot be read is passed
/// over (the error is returned only if none can).
async fn replay_longest(
    member: &PoolDevice,
    superblock: &Superblock,
    pool_tag: u64,
    tail: u64,
) -> Result<Replayed, PoolError> {
    let replay = |device: Arc<dyn Device>| async move {
        Log::replay(&device, superblock.log_offset, superblock.log_bytes, pool_tag, tail).await
    };
    let Some(mirror) = member.mirror() else {
        let (records, next, end) = replay(member.device.clone()).await?;
        return Ok((records, next, end, None));
    };
    let mut best: Option<Replayed> = None;
    let mut first_error = None;
    for child in mirror.online() {
        let Some(device) = child.device.clone() else {
            continue;
        };
        match replay(device).await {
            Ok((records, next, end)) => {
                if let Some((_, best_next, best_end, _)) = &best {
                    if (next, end) != (*best_next, *best_end) {
                        tracing::warn!(
                            "{}: its copy of the log ends at {next} (valid to {end}), another's at \
                             {best_next} (valid to {best_end}); replaying the longer",
                            child.name
                        );
                    }
                }
                if best.as_ref().is_none_or(|(_, n, e, _)| (next, end) > (*n, *e)) {
                    best = Some((records, next, end, Some(child.uuid)));
                }
            }
            Err(e) => {
                child.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("{}: reading its copy of the log: {e}", child.name);
                first_error.get_or_insert(e);
            }
        }
    }
    match (best, first_error) {
        (Some(best), _) => Ok(best),
        (None, Some(e)) => Err(e.into()),
        (None, None) => Err(PoolError::Invalid(format!(
            "no up-to-date device of {} holds the log",
            mirror.info().name
        ))),
    }
}

fn pool_tag(uuid: &[u8; 16]) -> u64 {
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&uuid[..8]);
    u64::from_le_bytes(tag)
}

fn corrupt(what: String) -> PoolError {
    PoolError::Meta(MetaError::Corrupt(what))
}

/// A chunk's suspect parts as stored under `key` in `suspect_parts`:
/// sealed (36 bytes: four `u64`, little endian, part 0 the lowest bit of
/// the first, then the seal), or unsealed as pools from before seals
/// stored them (32). The lengths differ by a seal, so a moved boundary
/// between two stored values leaves one of them of no valid length. The
/// error names the field (the caller the table and key).
pub(super) fn decode_parts(key: (u32, u64), bytes: &[u8]) -> Result<ChunkParts, String> {
    let body = match bytes.len() {
        PARTS_BYTES => bytes,
        n if n == PARTS_BYTES + crate::meta::sealed::SEAL_BYTES => {
            crate::meta::sealed::unseal(&crate::meta::sealed::key2(key), bytes)?
        }
        n => {
            return Err(format!(
                "field length: value is {n} bytes, not {} (sealed) nor {PARTS_BYTES} (unsealed)",
                PARTS_BYTES + crate::meta::sealed::SEAL_BYTES
            ))
        }
    };
    Ok(std::array::from_fn(|i| {
        u64::from_le_bytes(body[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
    }))
}

/// Bytes of a chunk's suspect parts, unsealed.
const PARTS_BYTES: usize = 32;

/// The value stored under `key` for a chunk's suspect parts, sealed (see
/// [`decode_parts`]).
pub(super) fn encode_parts(key: (u32, u64), parts: &ChunkParts) -> Vec<u8> {
    let mut out = Vec::with_capacity(PARTS_BYTES + crate::meta::sealed::SEAL_BYTES);
    for word in parts {
        out.extend_from_slice(&word.to_le_bytes());
    }
    crate::meta::sealed::seal(&crate::meta::sealed::key2(key), &mut out);
    out
}

#[cfg(test)]
mod parts_tests {
    use super::*;

    #[test]
    fn suspect_parts_are_sealed_and_older_unsealed_values_still_read() {
        let key = (1, 9);
        let parts: ChunkParts = [1, 0, 1 << 63, 5];
        let stored = encode_parts(key, &parts);
        assert_eq!(stored.len(), PARTS_BYTES + crate::meta::sealed::SEAL_BYTES);
        assert_eq!(decode_parts(key, &stored), Ok(parts));
        assert!(decode_parts((1, 10), &stored).unwrap_err().starts_with("checksum"));
        for bit in 0..stored.len() * 8 {
            let mut flipped = stored.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_parts(key, &flipped).is_err(), "bit {bit}");
        }
        // A pool from before the seal stored the 32 bytes alone.
        assert_eq!(decode_parts(key, &stored[..PARTS_BYTES]), Ok(parts));
        assert!(decode_parts(key, &stored[..7]).unwrap_err().starts_with("field length"));
    }
}
