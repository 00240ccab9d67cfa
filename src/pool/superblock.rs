//! Device superblocks: every persistent device of a pool starts with two
//! checksummed copies naming the pool, the device, its role and every other
//! member, so a pool is recognised from its devices alone and a missing,
//! foreign or damaged device is refused. Layout: docs/FORMAT.md.

pub const SUPERBLOCK_BYTES: usize = 4096;
/// Byte offsets of the two copies. Both sit in chunk 0, which holds no data.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, 256 << 10];
pub const MAGIC: [u8; 8] = *b"STRATASB";
/// The format new pools are created with. Format 1: stored checksums are
/// plain crc32c. Format 2: they are tagged with each sector's place in its
/// volume (`pool::blockmap::sector_tag`). Format 3: as 2, plus a header of
/// [`HEADER_BYTES`] before any region (chunk 0 alone was smaller than the
/// second superblock copy's offset with chunks under 512 KiB), and mirrors:
/// each device names itself and the children of every mirrored member. A
/// pool keeps the format it was created with; versions that know fewer
/// formats refuse newer ones.
pub const FORMAT_VERSION: u32 = 3;
/// The first format whose stored checksums are tagged.
pub const TAGGED_CHECKSUMS_FORMAT: u32 = 2;
/// The first format with a [`HEADER_BYTES`] header and mirrors.
pub const MIRRORS_FORMAT: u32 = 3;
/// Bytes at the start of every device of a format-3 pool that hold the
/// superblocks and nothing else (rounded up to whole chunks).
pub const HEADER_BYTES: u64 = 1 << 20;
pub const MAX_MEMBERS: usize = 32;
/// Children of mirrored members, over all members.
pub const MAX_CHILDREN: usize = 64;
const NAME_BYTES: usize = 64;
const DEVICE_UUID_OFFSET: usize = 160;
const CHILD_COUNT_OFFSET: usize = 176;
const MEMBERS_OFFSET: usize = 256;
const MEMBER_BYTES: usize = 32;
const CHILDREN_OFFSET: usize = MEMBERS_OFFSET + MAX_MEMBERS * MEMBER_BYTES;
const CHILD_BYTES: usize = 32;
const CRC_OFFSET: usize = SUPERBLOCK_BYTES - 4;
const _: () = assert!(CHILDREN_OFFSET + MAX_CHILDREN * CHILD_BYTES <= CRC_OFFSET);

/// What a device is for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// SSD/NVMe: data (the fastest persistent tier), metadata, and the log
    /// unless a `log` device exists.
    Fast = 1,
    /// HDD: data, below the fast tier.
    Capacity = 2,
    /// A dedicated intent-log device.
    Log = 3,
}

impl Role {
    pub fn from_u8(value: u8) -> Option<Role> {
        match value {
            1 => Some(Role::Fast),
            2 => Some(Role::Capacity),
            3 => Some(Role::Log),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Fast => "fast",
            Role::Capacity => "capacity",
            Role::Log => "log",
        }
    }

    /// Whether data chunks are placed on devices of this role.
    pub fn holds_data(self) -> bool {
        matches!(self, Role::Fast | Role::Capacity)
    }
}

/// One pool member as every superblock lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub uuid: [u8; 16],
    pub role: Role,
    pub index: u8,
    pub size_bytes: u64,
    /// Whether the member is being removed, or is gone (`pool remove`).
    pub state: MemberState,
}

/// Where a member stands in its removal (`strata pool remove`,
/// `pool/remove.rs`). Stored in byte 18 of its member entry (zero in
/// superblocks written before removals existed: `Active`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemberState {
    /// A member like any other.
    #[default]
    Active = 0,
    /// Being emptied: no new data is placed on it, and a restart goes on
    /// moving its blocks to the other members.
    Evacuating = 1,
    /// Gone: it holds nothing and no device is opened for it. Its entry
    /// stays so that its index is never given to another member (stored
    /// metadata names members by index).
    Removed = 2,
}

impl MemberState {
    fn from_u8(value: u8) -> Option<MemberState> {
        match value {
            0 => Some(MemberState::Active),
            1 => Some(MemberState::Evacuating),
            2 => Some(MemberState::Removed),
            _ => None,
        }
    }
}

impl Member {
    /// Whether the member is gone from the pool (see [`MemberState::Removed`]).
    pub fn removed(&self) -> bool {
        self.state == MemberState::Removed
    }
}

/// Whether a mirror's child holds the member's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChildState {
    /// Up to date: it gets every write and may serve reads.
    Online = 0,
    /// Missed writes (it failed one, or the pool ran without it): never
    /// read from until a resilver has brought it up to date again.
    Stale = 1,
}

/// One child of a mirrored member, as every superblock lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Child {
    /// The device's own uuid (its superblock's `device_uuid`).
    pub uuid: [u8; 16],
    /// The member (mirror) it belongs to.
    pub member: u8,
    pub state: ChildState,
    /// Takes reads only when no other child can (an HDD copy of an SSD
    /// mirror), as md's write-mostly.
    pub write_mostly: bool,
    /// A stale child being resilvered: every byte below this offset is up
    /// to date (a resilver copies in device order and resumes here).
    pub resilvered: u64,
    /// Being replaced (`pool replace`): detached once the member's
    /// `replacement` child is up to date.
    pub replaced: bool,
    /// The device replacing the member's `replaced` child.
    pub replacement: bool,
    /// A stale child whose missed writes the member's dirty record
    /// (`pool/dirty.rs`) covers: the record on every up-to-date device
    /// holds every unit written since it went stale, so a resilver copies
    /// only those. `false` for an up-to-date child, and for a stale one
    /// resilvered in full (attached, replaced, or whose record was lost).
    /// Stored as child state `2`, which strata without dirty records
    /// refuses: it would write without keeping the record.
    pub tracked: bool,
}

/// A decoded superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The pool's format ([`FORMAT_VERSION`] when created now).
    pub format: u32,
    pub pool_uuid: [u8; 16],
    pub pool_name: String,
    /// Bumped on every rewrite; the valid copy with the highest wins.
    pub generation: u64,
    pub created_unix: u64,
    pub chunk_bytes: u32,
    /// This device's entry in `members`.
    pub device_index: u8,
    /// Where the metadata store lives: device index and byte range.
    pub meta_device: u8,
    pub meta_offset: u64,
    pub meta_bytes: u64,
    /// Where the log lives.
    pub log_device: u8,
    pub log_offset: u64,
    pub log_bytes: u64,
    pub members: Vec<Member>,
    /// Which device this is: the uuid of its member when that member is a
    /// single device, of its child entry when the member is a mirror.
    pub device_uuid: [u8; 16],
    /// The children of mirrored members (format 3); a member none of these
    /// names is a single device.
    pub children: Vec<Child>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SuperblockError {
    #[error("no strata superblock (not a strata device, or never initialised)")]
    NotStrata,
    #[error("superblock checksum mismatch in both copies (damaged device)")]
    Damaged,
    #[error("superblock format {0} is not supported by this strata (formats 1 to {FORMAT_VERSION})")]
    Version(u32),
    #[error("superblock is inconsistent: {0}")]
    Invalid(String),
}

fn put_u32(out: &mut [u8], at: usize, value: u32) {
    out[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut [u8], at: usize, value: u64) {
    out[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

fn get_u32(bytes: &[u8], at: usize) -> Result<u32, SuperblockError> {
    crate::bytes::u32_at(bytes, at).ok_or_else(|| truncated(at))
}

fn get_u64(bytes: &[u8], at: usize) -> Result<u64, SuperblockError> {
    crate::bytes::u64_at(bytes, at).ok_or_else(|| truncated(at))
}

fn truncated(at: usize) -> SuperblockError {
    SuperblockError::Invalid(format!("superblock ends before its field at byte {at}"))
}

impl Superblock {
    pub fn this_member(&self) -> Option<&Member> {
        self.members.get(self.device_index as usize)
    }

    /// The children of member `index` (empty: it is a single device).
    pub fn children_of(&self, index: u8) -> impl Iterator<Item = &Child> + '_ {
        self.children.iter().filter(move |c| c.member == index)
    }

    /// Whether member `index` is a mirror.
    pub fn is_mirror(&self, index: u8) -> bool {
        self.children_of(index).next().is_some()
    }

    /// Bytes at the start of every device that hold only superblocks: one
    /// chunk before format 3, [`HEADER_BYTES`] (whole chunks) since.
    pub fn header_bytes(&self) -> u64 {
        header_bytes(self.format, self.chunk_bytes)
    }

    /// The offsets of the superblock copies this pool keeps: both, unless
    /// its header is too small for the second (pools of format 1 and 2
    /// with chunks under 512 KiB, where the second copy's place belongs to
    /// the metadata region or to data).
    pub fn copy_offsets(&self) -> &'static [u64] {
        copy_offsets(self.header_bytes())
    }

    /// This superblock as device `device_uuid` of member `index` carries it.
    pub fn for_device(&self, index: u8, device_uuid: [u8; 16]) -> Superblock {
        Superblock {
            device_index: index,
            device_uuid,
            ..self.clone()
        }
    }

    /// Encodes into exactly [`SUPERBLOCK_BYTES`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.members.len() <= MAX_MEMBERS, "too many pool members");
        let mut out = vec![0u8; SUPERBLOCK_BYTES];
        out[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut out, 8, self.format);
        out[16..32].copy_from_slice(&self.pool_uuid);
        put_u64(&mut out, 32, self.generation);
        put_u64(&mut out, 40, self.created_unix);
        put_u32(&mut out, 48, self.chunk_bytes);
        out[52] = self.device_index;
        out[53] = self.members.len() as u8;
        out[54] = self.meta_device;
        out[55] = self.log_device;
        put_u64(&mut out, 56, self.meta_offset);
        put_u64(&mut out, 64, self.meta_bytes);
        put_u64(&mut out, 72, self.log_offset);
        put_u64(&mut out, 80, self.log_bytes);
        let name = self.pool_name.as_bytes();
        let name_len = name.len().min(NAME_BYTES);
        out[96..96 + name_len].copy_from_slice(&name[..name_len]);
        for (index, member) in self.members.iter().enumerate() {
            let at = MEMBERS_OFFSET + index * MEMBER_BYTES;
            out[at..at + 16].copy_from_slice(&member.uuid);
            out[at + 16] = member.role as u8;
            out[at + 17] = member.index;
            out[at + 18] = member.state as u8;
            put_u64(&mut out, at + 24, member.size_bytes);
        }
        if self.format >= MIRRORS_FORMAT {
            assert!(self.children.len() <= MAX_CHILDREN, "too many mirror children");
            out[DEVICE_UUID_OFFSET..DEVICE_UUID_OFFSET + 16].copy_from_slice(&self.device_uuid);
            out[CHILD_COUNT_OFFSET] = self.children.len() as u8;
            for (index, child) in self.children.iter().enumerate() {
                let at = CHILDREN_OFFSET + index * CHILD_BYTES;
                out[at..at + 16].copy_from_slice(&child.uuid);
                out[at + 16] = child.member;
                out[at + 17] = match (child.state, child.tracked) {
                    (ChildState::Online, _) => 0,
                    (ChildState::Stale, false) => 1,
                    (ChildState::Stale, true) => 2,
                };
                out[at + 18] = child.write_mostly as u8 | (child.replaced as u8) << 1 | (child.replacement as u8) << 2;
                put_u64(&mut out, at + 24, child.resilvered);
            }
        }
        let crc = crate::checksum::crc32c(&out[..CRC_OFFSET]);
        put_u32(&mut out, CRC_OFFSET, crc);
        out
    }

    /// Decodes one copy, checking magic, checksum and internal consistency.
    pub fn decode(bytes: &[u8]) -> Result<Superblock, SuperblockError> {
        if bytes.len() < SUPERBLOCK_BYTES || bytes[0..8] != MAGIC {
            return Err(SuperblockError::NotStrata);
        }
        if crate::checksum::crc32c(&bytes[..CRC_OFFSET]) != get_u32(bytes, CRC_OFFSET)? {
            return Err(SuperblockError::Damaged);
        }
        let version = get_u32(bytes, 8)?;
        if !(1..=FORMAT_VERSION).contains(&version) {
            return Err(SuperblockError::Version(version));
        }
        let member_count = bytes[53] as usize;
        if member_count == 0 || member_count > MAX_MEMBERS {
            return Err(SuperblockError::Invalid(format!("{member_count} members")));
        }
        let mut members = Vec::with_capacity(member_count);
        for index in 0..member_count {
            let at = MEMBERS_OFFSET + index * MEMBER_BYTES;
            let role = Role::from_u8(bytes[at + 16]).ok_or_else(|| {
                SuperblockError::Invalid(format!("member {index} has unknown role {}", bytes[at + 16]))
            })?;
            let state = MemberState::from_u8(bytes[at + 18]).ok_or_else(|| {
                SuperblockError::Invalid(format!("member {index} has unknown state {}", bytes[at + 18]))
            })?;
            members.push(Member {
                uuid: crate::bytes::array_at(bytes, at).ok_or_else(|| truncated(at))?,
                role,
                index: bytes[at + 17],
                size_bytes: get_u64(bytes, at + 24)?,
                state,
            });
        }
        let name_end = bytes[96..96 + NAME_BYTES]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(NAME_BYTES);
        let pool_name = String::from_utf8(bytes[96..96 + name_end].to_vec())
            .map_err(|_| SuperblockError::Invalid("pool name is not UTF-8".into()))?;
        let mut children = Vec::new();
        let mut device_uuid = [0u8; 16];
        if version >= MIRRORS_FORMAT {
            device_uuid =
                crate::bytes::array_at(bytes, DEVICE_UUID_OFFSET).ok_or_else(|| truncated(DEVICE_UUID_OFFSET))?;
            let count = bytes[CHILD_COUNT_OFFSET] as usize;
            if count > MAX_CHILDREN {
                return Err(SuperblockError::Invalid(format!("{count} mirror children")));
            }
            for index in 0..count {
                let at = CHILDREN_OFFSET + index * CHILD_BYTES;
                let (state, tracked) = match bytes[at + 17] {
                    0 => (ChildState::Online, false),
                    1 => (ChildState::Stale, false),
                    2 => (ChildState::Stale, true),
                    other => {
                        return Err(SuperblockError::Invalid(format!(
                            "mirror child {index} has unknown state {other}"
                        )))
                    }
                };
                children.push(Child {
                    uuid: crate::bytes::array_at(bytes, at).ok_or_else(|| truncated(at))?,
                    member: bytes[at + 16],
                    state,
                    write_mostly: bytes[at + 18] & 1 != 0,
                    replaced: bytes[at + 18] & 2 != 0,
                    replacement: bytes[at + 18] & 4 != 0,
                    resilvered: get_u64(bytes, at + 24)?,
                    tracked,
                });
            }
        } else if let Some(member) = members.get(bytes[52] as usize) {
            device_uuid = member.uuid;
        }
        let superblock = Superblock {
            format: version,
            pool_uuid: crate::bytes::array_at(bytes, 16).ok_or_else(|| truncated(16))?,
            pool_name,
            generation: get_u64(bytes, 32)?,
            created_unix: get_u64(bytes, 40)?,
            chunk_bytes: get_u32(bytes, 48)?,
            device_index: bytes[52],
            meta_device: bytes[54],
            log_device: bytes[55],
            meta_offset: get_u64(bytes, 56)?,
            meta_bytes: get_u64(bytes, 64)?,
            log_offset: get_u64(bytes, 72)?,
            log_bytes: get_u64(bytes, 80)?,
            members,
            device_uuid,
            children,
        };
        superblock.check()?;
        Ok(superblock)
    }

    fn check(&self) -> Result<(), SuperblockError> {
        let invalid = |what: String| Err(SuperblockError::Invalid(what));
        if !self.chunk_bytes.is_power_of_two() || !(64 << 10..=64 << 20).contains(&self.chunk_bytes) {
            return invalid(format!("chunk size {}", self.chunk_bytes));
        }
        if self.device_index as usize >= self.members.len() {
            return invalid(format!("device index {}", self.device_index));
        }
        if self.members[self.device_index as usize].removed() {
            return invalid(format!("device index {} names a removed member", self.device_index));
        }
        if self.members.iter().all(Member::removed) {
            return invalid("every member is removed".into());
        }
        for (index, member) in self.members.iter().enumerate() {
            if member.index as usize != index {
                return invalid(format!("member {index} claims index {}", member.index));
            }
        }
        let chunk = self.chunk_bytes as u64;
        for (index, member) in self.members.iter().enumerate() {
            if member.size_bytes < chunk || !member.size_bytes.is_multiple_of(chunk) {
                return invalid(format!(
                    "member {index} size {} is not a whole number of chunks",
                    member.size_bytes
                ));
            }
            if self.members[..index].iter().any(|other| other.uuid == member.uuid) {
                return invalid(format!("member {index} has the UUID of another member"));
            }
        }
        for (device, offset, bytes, what) in [
            (self.meta_device, self.meta_offset, self.meta_bytes, "metadata"),
            (self.log_device, self.log_offset, self.log_bytes, "log"),
        ] {
            let Some(member) = self.members.get(device as usize).filter(|m| !m.removed()) else {
                return invalid(format!("{what} device {device}"));
            };
            if offset.checked_add(bytes).is_none_or(|end| end > member.size_bytes) || bytes == 0 {
                return invalid(format!("{what} region [{offset}, +{bytes}) outside device {device}"));
            }
            // The header holds the superblocks; regions are whole chunks.
            if offset < self.header_bytes() || !offset.is_multiple_of(chunk) || !bytes.is_multiple_of(chunk) {
                return invalid(format!(
                    "{what} region [{offset}, +{bytes}) is not made of whole chunks after the header"
                ));
            }
        }
        self.check_children()?;
        if !self.members[self.meta_device as usize].role.holds_data() {
            return invalid(format!("metadata device {} holds no data", self.meta_device));
        }
        if self.meta_device == self.log_device
            && self.meta_offset < self.log_offset + self.log_bytes
            && self.log_offset < self.meta_offset + self.meta_bytes
        {
            return invalid("the metadata and log regions overlap".into());
        }
        Ok(())
    }

    fn check_children(&self) -> Result<(), SuperblockError> {
        let invalid = |what: String| Err(SuperblockError::Invalid(what));
        for (index, child) in self.children.iter().enumerate() {
            if self.members.get(child.member as usize).is_none_or(Member::removed) {
                return invalid(format!("mirror child {index} names member {}", child.member));
            }
            let twice = self.children[..index].iter().any(|other| other.uuid == child.uuid);
            // A device that was a single-device member before a device was
            // attached beside it keeps its uuid, the member's, as a child.
            let other_member = self
                .members
                .iter()
                .any(|m| m.uuid == child.uuid && m.index != child.member);
            if twice || other_member {
                return invalid(format!("mirror child {index} has the UUID of another device"));
            }
        }
        for member in &self.members {
            if self.is_mirror(member.index) && self.children_of(member.index).all(|c| c.state != ChildState::Online) {
                return invalid(format!("mirror {} has no child that is up to date", member.index));
            }
        }
        let own = if self.is_mirror(self.device_index) {
            self.children_of(self.device_index).any(|c| c.uuid == self.device_uuid)
        } else {
            self.members[self.device_index as usize].uuid == self.device_uuid
        };
        if !own {
            return invalid(format!(
                "device {} is not listed among the devices of member {}",
                uuid_hex(&self.device_uuid),
                self.device_index
            ));
        }
        Ok(())
    }
}

fn uuid_hex(uuid: &[u8; 16]) -> String {
    uuid.iter().map(|b| format!("{b:02x}")).collect()
}

/// See [`Superblock::header_bytes`].
pub fn header_bytes(format: u32, chunk_bytes: u32) -> u64 {
    let chunk = u64::from(chunk_bytes);
    if format >= MIRRORS_FORMAT {
        HEADER_BYTES.div_ceil(chunk) * chunk
    } else {
        chunk
    }
}

/// See [`Superblock::copy_offsets`].
pub fn copy_offsets(header_bytes: u64) -> &'static [u64] {
    if SUPERBLOCK_OFFSETS[1] + SUPERBLOCK_BYTES as u64 <= header_bytes {
        &SUPERBLOCK_OFFSETS
    } else {
        &SUPERBLOCK_OFFSETS[..1]
    }
}

/// Picks the superblock from the two copies read off a device: the valid one
/// with the highest generation. Returns it and whether the other copy needs
/// rewriting.
pub fn choose(copies: [&[u8]; 2]) -> Result<(Superblock, bool), SuperblockError> {
    let decoded = copies.map(Superblock::decode);
    // A pool whose header has no room for the second copy does not keep
    // one: that place belongs to the metadata region or to data, so what
    // it holds is not compared (a copy found there is one written when the
    // pool was created, used only when the first is damaged).
    if let Ok(first) = &decoded[0] {
        if first.copy_offsets().len() == 1 {
            return Ok((first.clone(), false));
        }
    }
    match decoded {
        [Ok(a), Ok(b)] => {
            let stale = a != b;
            Ok((if b.generation > a.generation { b } else { a }, stale))
        }
        [Ok(one), Err(_)] | [Err(_), Ok(one)] => Ok((one, true)),
        [Err(SuperblockError::NotStrata), Err(SuperblockError::NotStrata)] => Err(SuperblockError::NotStrata),
        [Err(SuperblockError::Version(v)), _] | [_, Err(SuperblockError::Version(v))] => {
            Err(SuperblockError::Version(v))
        }
        [Err(first), Err(_)] => Err(if first == SuperblockError::NotStrata {
            SuperblockError::Damaged
        } else {
            first
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            format: FORMAT_VERSION,
            pool_uuid: [7; 16],
            pool_name: "tank".into(),
            generation: 3,
            created_unix: 1_700_000_000,
            chunk_bytes: 1 << 20,
            device_index: 1,
            meta_device: 0,
            meta_offset: 1 << 20,
            meta_bytes: 64 << 20,
            log_device: 0,
            log_offset: 65 << 20,
            log_bytes: 64 << 20,
            members: vec![
                Member {
                    uuid: [1; 16],
                    role: Role::Fast,
                    index: 0,
                    size_bytes: 1 << 30,
                    state: MemberState::Active,
                },
                Member {
                    uuid: [2; 16],
                    role: Role::Capacity,
                    index: 1,
                    size_bytes: 4 << 30,
                    state: MemberState::Active,
                },
            ],
            device_uuid: [2; 16],
            children: Vec::new(),
        }
    }

    /// Member 1 a mirror of two devices; this one is its second.
    fn mirrored() -> Superblock {
        let child = |uuid: u8, state| Child {
            uuid: [uuid; 16],
            member: 1,
            state,
            write_mostly: uuid == 4,
            resilvered: if state == ChildState::Stale { 5 << 20 } else { 0 },
            replaced: false,
            replacement: uuid == 4,
            tracked: state == ChildState::Stale,
        };
        Superblock {
            device_uuid: [4; 16],
            children: vec![child(3, ChildState::Online), child(4, ChildState::Stale)],
            ..sample()
        }
    }

    #[test]
    fn a_mirror_round_trips_and_its_devices_must_be_listed() {
        let superblock = mirrored();
        let decoded = Superblock::decode(&superblock.encode()).unwrap();
        assert_eq!(decoded, superblock);
        assert!(decoded.is_mirror(1) && !decoded.is_mirror(0));
        assert_eq!(decoded.children_of(1).count(), 2);
        let refused = |change: fn(&mut Superblock), needle: &str| {
            let mut superblock = mirrored();
            change(&mut superblock);
            match Superblock::decode(&superblock.encode()) {
                Err(SuperblockError::Invalid(what)) => assert!(what.contains(needle), "{what}"),
                other => panic!("{needle}: {other:?}"),
            }
        };
        // The member's own uuid names no device once it is a mirror.
        refused(|s| s.device_uuid = [2; 16], "not listed");
        refused(|s| s.children[1].uuid = [3; 16], "UUID of another device");
        refused(|s| s.children[0].uuid = [1; 16], "UUID of another device");
        // Its own member's uuid is allowed: the device the member was
        // before a device was attached beside it.
        let mut attached = mirrored();
        attached.children[0].uuid = [2; 16];
        attached.children[1].replaced = true;
        assert_eq!(Superblock::decode(&attached.encode()).unwrap(), attached);
        refused(|s| s.children[0].member = 7, "names member 7");
        refused(
            |s| s.children[0].state = ChildState::Stale,
            "no child that is up to date",
        );
    }

    #[test]
    fn small_chunks_keep_one_copy_before_format_3_and_a_header_since() {
        let old = Superblock {
            format: 2,
            chunk_bytes: 64 << 10,
            meta_offset: 64 << 10,
            log_offset: (64 << 20) + (64 << 10),
            ..sample()
        };
        assert_eq!(old.copy_offsets(), &SUPERBLOCK_OFFSETS[..1]);
        // A leftover second copy is not read: it is not the pool's any more.
        let mut stale = old.clone();
        stale.generation += 5;
        let (chosen, repair) = choose([&old.encode(), &stale.encode()]).unwrap();
        assert_eq!((chosen.generation, repair), (old.generation, false));
        let new = Superblock {
            chunk_bytes: 64 << 10,
            ..sample()
        };
        assert_eq!(new.header_bytes(), HEADER_BYTES);
        assert_eq!(new.copy_offsets(), &SUPERBLOCK_OFFSETS);
        // Format 3 regions start after the header.
        let inside = Superblock {
            meta_offset: 64 << 10,
            ..new
        };
        assert!(matches!(
            Superblock::decode(&inside.encode()),
            Err(SuperblockError::Invalid(_))
        ));
    }

    /// A removed member keeps its entry (its index is never reused) and
    /// can hold neither region nor be the device a superblock is on.
    #[test]
    fn member_states_round_trip_and_a_removed_member_holds_nothing() {
        let mut superblock = Superblock {
            device_index: 0,
            device_uuid: [1; 16],
            ..sample()
        };
        superblock.members[1].state = MemberState::Evacuating;
        assert_eq!(Superblock::decode(&superblock.encode()).unwrap(), superblock);
        superblock.members[1].state = MemberState::Removed;
        let decoded = Superblock::decode(&superblock.encode()).unwrap();
        assert!(decoded.members[1].removed() && !decoded.members[0].removed());
        let mut on_removed = superblock.clone();
        on_removed.members[0].state = MemberState::Removed;
        assert!(matches!(
            Superblock::decode(&on_removed.encode()),
            Err(SuperblockError::Invalid(_))
        ));
        let mut bytes = superblock.encode();
        bytes[256 + 32 + 18] = 9;
        let crc = crate::checksum::crc32c(&bytes[..CRC_OFFSET]);
        put_u32(&mut bytes, CRC_OFFSET, crc);
        match Superblock::decode(&bytes) {
            Err(SuperblockError::Invalid(what)) => assert!(what.contains("unknown state 9"), "{what}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn round_trip() {
        let superblock = sample();
        let bytes = superblock.encode();
        assert_eq!(bytes.len(), SUPERBLOCK_BYTES);
        assert_eq!(Superblock::decode(&bytes).unwrap(), superblock);
    }

    #[test]
    fn a_pool_keeps_its_format_and_unknown_formats_are_refused() {
        let old = Superblock { format: 1, ..sample() };
        assert_eq!(Superblock::decode(&old.encode()).unwrap().format, 1);
        let newer = Superblock {
            format: FORMAT_VERSION + 1,
            ..sample()
        };
        let error = Superblock::decode(&newer.encode()).unwrap_err();
        assert_eq!(error, SuperblockError::Version(FORMAT_VERSION + 1));
        assert!(error.to_string().contains("formats 1 to 3"), "{error}");
    }

    #[test]
    fn damage_and_choice() {
        let good = sample().encode();
        let mut newer = sample();
        newer.generation = 4;
        let newer = newer.encode();
        let mut rotten = good.clone();
        rotten[100] ^= 1;
        assert_eq!(Superblock::decode(&rotten), Err(SuperblockError::Damaged));
        assert_eq!(choose([&good, &newer]).unwrap().0.generation, 4);
        let (chosen, repair) = choose([&rotten, &good]).unwrap();
        assert!(repair);
        assert_eq!(chosen.generation, 3);
        assert_eq!(choose([&rotten, &rotten]), Err(SuperblockError::Damaged));
        let zeros = vec![0u8; SUPERBLOCK_BYTES];
        assert_eq!(choose([&zeros, &zeros]), Err(SuperblockError::NotStrata));
        assert_eq!(choose([&zeros, &rotten]), Err(SuperblockError::Damaged));
    }

    /// Fields whose checksum is right but whose values cannot describe a
    /// pool are refused, each with its field named.
    #[test]
    fn inconsistent_fields_are_refused_by_name() {
        let refused = |change: fn(&mut Superblock), needle: &str| {
            let mut superblock = sample();
            change(&mut superblock);
            match Superblock::decode(&superblock.encode()) {
                Err(SuperblockError::Invalid(what)) => assert!(what.contains(needle), "{what}"),
                other => panic!("{needle}: {other:?}"),
            }
        };
        refused(|s| s.meta_offset = 4096, "metadata region");
        refused(|s| s.meta_offset = 0, "metadata region");
        refused(|s| s.log_bytes = (64 << 20) + 512, "log region");
        refused(|s| s.log_offset = 32 << 20, "overlap");
        refused(|s| s.members[1].size_bytes += 1, "member 1 size");
        refused(|s| s.members[1].uuid = s.members[0].uuid, "UUID");
        refused(|s| s.meta_device = 5, "metadata device 5");
        refused(
            |s| {
                s.members[0].role = Role::Log;
            },
            "holds no data",
        );
        assert!(Superblock::decode(&sample().encode()).is_ok());
    }
}
