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
/// volume (`pool::blockmap::sector_tag`). A pool keeps the format it was
/// created with; versions that know only format 1 refuse format 2.
pub const FORMAT_VERSION: u32 = 2;
/// The first format whose stored checksums are tagged.
pub const TAGGED_CHECKSUMS_FORMAT: u32 = 2;
pub const MAX_MEMBERS: usize = 32;
const NAME_BYTES: usize = 64;
const MEMBERS_OFFSET: usize = 256;
const MEMBER_BYTES: usize = 32;
const CRC_OFFSET: usize = SUPERBLOCK_BYTES - 4;

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
            put_u64(&mut out, at + 24, member.size_bytes);
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
            members.push(Member {
                uuid: crate::bytes::array_at(bytes, at).ok_or_else(|| truncated(at))?,
                role,
                index: bytes[at + 17],
                size_bytes: get_u64(bytes, at + 24)?,
            });
        }
        let name_end = bytes[96..96 + NAME_BYTES]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(NAME_BYTES);
        let pool_name = String::from_utf8(bytes[96..96 + name_end].to_vec())
            .map_err(|_| SuperblockError::Invalid("pool name is not UTF-8".into()))?;
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
            let Some(member) = self.members.get(device as usize) else {
                return invalid(format!("{what} device {device}"));
            };
            if offset.checked_add(bytes).is_none_or(|end| end > member.size_bytes) || bytes == 0 {
                return invalid(format!("{what} region [{offset}, +{bytes}) outside device {device}"));
            }
            // Chunk 0 holds the superblocks; regions are whole chunks.
            if offset < chunk || !offset.is_multiple_of(chunk) || !bytes.is_multiple_of(chunk) {
                return invalid(format!(
                    "{what} region [{offset}, +{bytes}) is not made of whole chunks after chunk 0"
                ));
            }
        }
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
}

/// Picks the superblock from the two copies read off a device: the valid one
/// with the highest generation. Returns it and whether the other copy needs
/// rewriting.
pub fn choose(copies: [&[u8]; 2]) -> Result<(Superblock, bool), SuperblockError> {
    let decoded = copies.map(Superblock::decode);
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
                },
                Member {
                    uuid: [2; 16],
                    role: Role::Capacity,
                    index: 1,
                    size_bytes: 4 << 30,
                },
            ],
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
        assert!(error.to_string().contains("formats 1 to 2"), "{error}");
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
