//! Space allocation: chunks on devices, slots within chunks.
//!
//! A device's data area is cut into chunks (the placement and
//! migration unit). A chunk in use is assigned one slot size (a volume's
//! `volblocksize`) and a bitmap of used slots. New slots come from the
//! fastest tier that has room: first from partly used chunks there, then
//! from a fresh chunk, and only then from the next tier down.
//!
//! The allocator is pure bookkeeping; persistence (checkpoints) and the rule
//! that a freed slot is not reused before its release is durable belong to
//! the pool.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::superblock::Role;
use crate::meta::sealed::{key2, seal, unseal, SEAL_BYTES};

/// What the allocator refuses: each one means the caller (or the metadata
/// it replays) is wrong, so each says exactly what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("device {0} is not a data device of this pool")]
    UnknownDevice(u8),
    #[error("chunk {chunk} of device {device} lies outside its data area (chunks {first}..{end})")]
    OutsideDevice {
        device: u8,
        chunk: u64,
        first: u64,
        end: u64,
    },
    #[error("slot size 2^{0} is not a supported block size")]
    BadSlotSize(u8),
    #[error("chunk {chunk} of device {device} holds slots of 2^{have} bytes, not 2^{want}")]
    SlotSizeMismatch { device: u8, chunk: u64, have: u8, want: u8 },
    #[error("offset {offset} of device {device} is not at a slot boundary (2^{slot_shift})")]
    Misaligned { device: u8, offset: u64, slot_shift: u8 },
    #[error("chunk {chunk} of device {device} marks slots past its last one used")]
    BitsPastTheEnd { device: u8, chunk: u64 },
    #[error("slot at offset {offset} of device {device} is already in use")]
    AlreadyUsed { device: u8, offset: u64 },
}

/// Smallest and largest slot (block) sizes: 4 KiB to 128 KiB.
pub const MIN_SLOT_SHIFT: u8 = 12;
pub const MAX_SLOT_SHIFT: u8 = 17;

/// Slots per chunk are at most 256 (1 MiB chunks of 4 KiB slots), so a
/// bitmap of four words covers any chunk.
pub const MAX_SLOTS_PER_CHUNK: u64 = 256;
/// Chunks of queued frees an allocation about to open an empty chunk takes
/// back (`Allocator::allocate_near`): each at most 256 slots to release.
const RECLAIM_CHUNKS: usize = 16;
/// Bytes of a chunk's state unsealed: slot shift, 256-bit bitmap.
const STORED_BYTES: usize = 33;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkState {
    pub slot_shift: u8,
    pub used: [u64; 4],
}

impl ChunkState {
    fn used_count(&self) -> u32 {
        self.used.iter().map(|w| w.count_ones()).sum()
    }

    /// Whether `slot` (below the chunk's slot count, which the caller
    /// checks) is free in this chunk and the chunk holds slots of this size:
    /// where a hinted allocation can go without opening another chunk.
    fn slot_free(&self, slot_shift: u8, slot: u64) -> bool {
        self.slot_shift == slot_shift && self.used[(slot / 64) as usize] & (1 << (slot % 64)) == 0
    }

    /// Unsealed stored form: slot shift, then the bitmap (little endian).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.slot_shift];
        for word in self.used {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out
    }

    /// Stored form under `key` (device, chunk): [`ChunkState::encode`],
    /// sealed (`meta/sealed.rs`).
    pub fn encode_stored(&self, key: (u32, u64)) -> Vec<u8> {
        let mut out = self.encode();
        seal(&key2(key), &mut out);
        out
    }

    /// The state stored under `key`: sealed (37 bytes), or unsealed as
    /// pools from before seals stored it (33). The lengths differ by a
    /// seal, so a moved boundary between two stored values leaves one of
    /// them of no valid length (or a sealed one without its seal, its
    /// bytes intact). The error names the field (the caller the table and
    /// key).
    pub fn decode_stored(key: (u32, u64), bytes: &[u8]) -> Result<ChunkState, String> {
        let body = if bytes.len() == STORED_BYTES + SEAL_BYTES {
            unseal(&key2(key), bytes)?
        } else {
            bytes
        };
        Self::decode(body).ok_or_else(|| {
            format!(
                "field length: value is {} bytes, not {} (sealed) nor {STORED_BYTES} (unsealed)",
                bytes.len(),
                STORED_BYTES + SEAL_BYTES
            )
        })
    }

    pub fn decode(bytes: &[u8]) -> Option<ChunkState> {
        if bytes.len() != STORED_BYTES {
            return None;
        }
        let mut used = [0u64; 4];
        for (i, word) in used.iter_mut().enumerate() {
            *word = u64::from_le_bytes(bytes[1 + i * 8..9 + i * 8].try_into().ok()?);
        }
        Some(ChunkState {
            slot_shift: bytes[0],
            used,
        })
    }
}

/// Where [`Allocator::allocate_near`] should try first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hint {
    /// This slot (device index, byte offset): the one right after (or
    /// before) a neighbouring logical block's.
    At(u8, u64),
    /// A fresh chunk, at the slot matching the block's place in its
    /// volume chunk: for a large write whose neighbours are not written yet.
    FreshChunk { logical_slot: u64 },
}

/// One device's space.
#[derive(Debug)]
pub struct DeviceSpace {
    pub index: u8,
    pub role: Role,
    /// Data chunks are `first_chunk..end_chunk`.
    pub first_chunk: u64,
    pub end_chunk: u64,
    chunks: HashMap<u64, ChunkState>,
    /// Assigned chunks with at least one free slot, per slot shift.
    with_room: HashMap<u8, BTreeSet<u64>>,
    free_chunks: BTreeSet<u64>,
    used_slots_bytes: u64,
    /// New slots may be placed here: false while the device is being
    /// removed (`pool remove`), so what is moved off it never comes back.
    pub accepting: bool,
}

impl DeviceSpace {
    pub fn new(index: u8, role: Role, first_chunk: u64, end_chunk: u64) -> Self {
        DeviceSpace {
            index,
            role,
            first_chunk,
            end_chunk,
            chunks: HashMap::new(),
            with_room: HashMap::new(),
            free_chunks: (first_chunk..end_chunk).collect(),
            used_slots_bytes: 0,
            accepting: true,
        }
    }

    pub fn data_chunks(&self) -> u64 {
        self.end_chunk - self.first_chunk
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_slots_bytes
    }

    /// Bytes that new slots may still take here: 0 on a device that takes
    /// no new data.
    pub fn free_bytes(&self, chunk_bytes: u64) -> u64 {
        if !self.accepting {
            return 0;
        }
        (self.data_chunks() * chunk_bytes).saturating_sub(self.used_slots_bytes)
    }

    /// The chunks that hold (or may hold) data, in order.
    pub fn assigned_chunks(&self) -> Vec<u64> {
        let mut chunks: Vec<u64> = self.chunks.keys().copied().collect();
        chunks.sort_unstable();
        chunks
    }
}

#[derive(Debug)]
pub struct Allocator {
    chunk_shift: u8,
    /// Data devices, fastest tier first.
    devices: Vec<DeviceSpace>,
    /// Chunks changed since the last checkpoint: (device index, chunk).
    dirty: HashSet<(u8, u64)>,
    /// Slots whose freeing is committed but not yet carried out (their
    /// holes are punched first, in the background): still in use here, so
    /// nothing allocates them, but checkpointed as free (see `take_dirty`).
    /// Per (device, chunk): a bitmap of its queued slots.
    freeing: BTreeMap<(u8, u64), [u64; 4]>,
    /// The batch the freer is punching (out of `freeing`, still queued).
    punching: Vec<(u8, u64)>,
    freeing_bytes: u64,
}

impl Allocator {
    pub fn new(chunk_bytes: u32, mut devices: Vec<DeviceSpace>) -> Self {
        assert!(chunk_bytes.is_power_of_two());
        devices.sort_by_key(|d| (d.role, d.index));
        Allocator {
            chunk_shift: chunk_bytes.trailing_zeros() as u8,
            devices,
            dirty: HashSet::new(),
            freeing: BTreeMap::new(),
            punching: Vec::new(),
            freeing_bytes: 0,
        }
    }

    /// Adds a data device that joined the pool (`pool add-device`); it takes
    /// its place in the tier order like the devices the pool started with.
    pub fn add_device(&mut self, device: DeviceSpace) {
        self.devices.retain(|d| d.index != device.index);
        self.devices.push(device);
        self.devices.sort_by_key(|d| (d.role, d.index));
    }

    pub fn devices(&self) -> &[DeviceSpace] {
        &self.devices
    }

    fn device_mut(&mut self, index: u8) -> Option<&mut DeviceSpace> {
        self.devices.iter_mut().find(|d| d.index == index)
    }

    fn slots_per_chunk(&self, slot_shift: u8) -> u64 {
        (1u64 << (self.chunk_shift - slot_shift)).min(MAX_SLOTS_PER_CHUNK)
    }

    /// Allocates one slot of `1 << slot_shift` bytes: (device index, byte offset).
    pub fn allocate(&mut self, slot_shift: u8) -> Option<(u8, u64)> {
        let per_chunk = self.slots_per_chunk(slot_shift);
        let chunk_shift = self.chunk_shift;
        for position in 0..self.devices.len() {
            let device = &mut self.devices[position];
            if !device.accepting {
                continue;
            }
            let room = device.with_room.entry(slot_shift).or_default();
            let chunk = match room.first().copied() {
                Some(chunk) => chunk,
                None => {
                    let Some(fresh) = device.free_chunks.pop_first() else {
                        continue;
                    };
                    device.chunks.insert(
                        fresh,
                        ChunkState {
                            slot_shift,
                            used: [0; 4],
                        },
                    );
                    room.insert(fresh);
                    fresh
                }
            };
            let state = device.chunks.get_mut(&chunk)?;
            let slot = (0..per_chunk).find(|s| state.used[(*s / 64) as usize] & (1 << (s % 64)) == 0)?;
            state.used[(slot / 64) as usize] |= 1 << (slot % 64);
            if state.used_count() as u64 == per_chunk {
                room.remove(&chunk);
            }
            device.used_slots_bytes += 1 << slot_shift;
            let index = device.index;
            self.dirty.insert((index, chunk));
            return Some((index, (chunk << chunk_shift) + (slot << slot_shift)));
        }
        None
    }

    /// Allocates one slot like [`Allocator::allocate`], but only on devices
    /// of tier `role` (the migrator's target).
    pub fn allocate_in(&mut self, slot_shift: u8, role: Role) -> Option<(u8, u64)> {
        // `allocate` takes the first device in tier order with room: the
        // others are hidden from it meanwhile.
        let (mut tier, rest): (Vec<DeviceSpace>, Vec<DeviceSpace>) = std::mem::take(&mut self.devices)
            .into_iter()
            .partition(|d| d.role == role);
        std::mem::swap(&mut self.devices, &mut tier);
        let found = self.allocate(slot_shift);
        self.devices.extend(rest);
        self.devices.sort_by_key(|d| (d.role, d.index));
        found
    }

    /// Device `index`'s data chunks (empty if it has none here).
    pub fn chunk_range(&self, index: u8) -> std::ops::Range<u64> {
        self.devices
            .iter()
            .find(|d| d.index == index)
            .map_or(0..0, |d| d.first_chunk..d.end_chunk)
    }

    /// The chunks of device `index` among `chunks` that hold slots in use,
    /// in order, each with whether any of those slots is live (not queued
    /// to be freed). It looks up every chunk of the range: the migrator
    /// lists a device a short range per hold of the allocator's lock, so a
    /// writer waiting to allocate waits for one range, not the whole pool.
    pub fn used_chunks_in(&self, index: u8, chunks: std::ops::Range<u64>) -> Vec<(u64, bool)> {
        let Some(device) = self.devices.iter().find(|d| d.index == index) else {
            return Vec::new();
        };
        chunks
            .filter_map(|chunk| {
                let state = device.chunks.get(&chunk).filter(|s| s.used_count() > 0)?;
                let queued = self.freeing.get(&(index, chunk)).copied().unwrap_or([0; 4]);
                let live = state.used.iter().zip(queued).any(|(used, queued)| used & !queued != 0);
                Some((chunk, live))
            })
            .collect()
    }

    /// Allocates one slot like [`Allocator::allocate`], but at `hint` (the
    /// byte right after the slot of the previous logical block) when that
    /// slot is free and on the tier `allocate` would use now. So a volume
    /// written front to back, even by several writers at once, is laid out
    /// front to back, and a large request later touches one device run
    /// instead of many. When the hinted slot is taken, a fresh chunk after it
    /// is used (so two writers do not interleave), else `allocate`'s order.
    ///
    /// Slots queued for the freer are taken back first, a few chunks' worth
    /// at a time (without their holes punched), when this allocation would
    /// otherwise start a chunk that holds nothing: space freed and not punched yet is reused before the
    /// pool writes into holes of its device files. A file rewritten after a
    /// truncation, or a volume refilled after a large TRIM, then lands in
    /// the space its old data held instead of growing the device files
    /// while the freer punches the old space, slowly, holding the file's
    /// lock (and, on a VM, into page cache memory never touched before,
    /// which can cost the kernel several times the copy: BENCHMARKS.md, "NFS").
    pub fn allocate_near(&mut self, slot_shift: u8, hint: Option<Hint>) -> Option<(u8, u64)> {
        if !self.freeing.is_empty() && self.would_open_chunk(slot_shift, hint) {
            self.reclaim_chunks(RECLAIM_CHUNKS);
        }
        let found = match hint {
            Some(Hint::At(device_index, offset)) => self.take_near(slot_shift, device_index, offset),
            Some(Hint::FreshChunk { logical_slot }) => self.take_fresh(slot_shift, logical_slot),
            None => None,
        };
        found.or_else(|| self.allocate(slot_shift))
    }

    /// Whether `allocate_near(slot_shift, hint)` would take a chunk from the
    /// free chunks (one that holds no slot in use) rather than a free slot
    /// of a chunk in use.
    fn would_open_chunk(&self, slot_shift: u8, hint: Option<Hint>) -> bool {
        let Some(first) = self.first_with_room(slot_shift) else {
            return false;
        };
        let chunk_shift = self.chunk_shift;
        match hint {
            Some(Hint::FreshChunk { .. }) => true,
            Some(Hint::At(index, offset)) if self.devices.iter().any(|d| d.index == index && d.role == first.role) => {
                let slot = (offset & ((1 << chunk_shift) - 1)) >> slot_shift;
                // `take_near`: the hinted slot if free in a chunk of this
                // slot size, else a free chunk.
                let in_use = self
                    .devices
                    .iter()
                    .find(|d| d.index == index)
                    .and_then(|d| d.chunks.get(&(offset >> chunk_shift)));
                !(slot < self.slots_per_chunk(slot_shift) && in_use.is_some_and(|s| s.slot_free(slot_shift, slot)))
            }
            // `allocate`: the first device in tier order with room, a chunk
            // of this slot size with a free slot before a free chunk.
            _ => first.with_room.get(&slot_shift).is_none_or(|room| room.is_empty()),
        }
    }

    /// A fresh chunk on the tier `allocate` would use, and in it the slot a
    /// block at `logical_slot` would have if the chunk mirrored the
    /// volume's chunk (its neighbours, written later, then find their
    /// places free on either side).
    fn take_fresh(&mut self, slot_shift: u8, logical_slot: u64) -> Option<(u8, u64)> {
        let per_chunk = self.slots_per_chunk(slot_shift);
        let device = self.first_with_room(slot_shift)?;
        let chunk = *device.free_chunks.first()?;
        let offset = (chunk << self.chunk_shift) + ((logical_slot % per_chunk) << slot_shift);
        self.take_near(slot_shift, device.index, offset)
    }

    /// The device plain allocation would use: the first, in tier order,
    /// with a free chunk or a chunk of this slot size with room.
    fn first_with_room(&self, slot_shift: u8) -> Option<&DeviceSpace> {
        self.devices
            .iter()
            .filter(|d| d.accepting)
            .find(|d| !d.free_chunks.is_empty() || d.with_room.get(&slot_shift).is_some_and(|r| !r.is_empty()))
    }

    fn take_near(&mut self, slot_shift: u8, device_index: u8, offset: u64) -> Option<(u8, u64)> {
        let per_chunk = self.slots_per_chunk(slot_shift);
        let chunk_shift = self.chunk_shift;
        // Never keep filling a slower tier while a faster one has room.
        let tier = self.first_with_room(slot_shift)?.role;
        let device = self.devices.iter_mut().find(|d| d.index == device_index)?;
        if device.role != tier || !device.accepting {
            return None;
        }
        let hinted_chunk = offset >> chunk_shift;
        let hinted_slot = (offset & ((1 << chunk_shift) - 1)) >> slot_shift;
        let hinted_free = hinted_slot < per_chunk
            && match device.chunks.get(&hinted_chunk) {
                Some(state) => state.slot_free(slot_shift, hinted_slot),
                None => device.free_chunks.contains(&hinted_chunk),
            };
        // Taken (typically by another writer's run): this writer moves to a
        // chunk of its own rather than interleaving with the other.
        let (chunk, slot) = if hinted_free {
            (hinted_chunk, hinted_slot)
        } else {
            (*device.free_chunks.range(hinted_chunk + 1..).next()?, 0)
        };
        let index = device.index;
        let offset = (chunk << chunk_shift) + (slot << slot_shift);
        // The slot is free in a chunk of this slot size (checked above).
        self.mark_used(index, offset, slot_shift)
            .unwrap_or_else(|e| panic!("hinted allocation: {e}"));
        Some((index, offset))
    }

    /// Marks a slot used (log replay, hinted allocation). A slot already in
    /// use is `AlreadyUsed` (which replay expects when the checkpoint came
    /// after the record); every other error is a bug or corrupt metadata.
    pub fn mark_used(&mut self, device_index: u8, offset: u64, slot_shift: u8) -> Result<(), AllocError> {
        if !(MIN_SLOT_SHIFT..=MAX_SLOT_SHIFT.min(self.chunk_shift)).contains(&slot_shift) {
            return Err(AllocError::BadSlotSize(slot_shift));
        }
        if offset & ((1 << slot_shift) - 1) != 0 {
            return Err(AllocError::Misaligned {
                device: device_index,
                offset,
                slot_shift,
            });
        }
        let chunk_shift = self.chunk_shift;
        let per_chunk = self.slots_per_chunk(slot_shift);
        let chunk = offset >> chunk_shift;
        let slot = (offset & ((1 << chunk_shift) - 1)) >> slot_shift;
        let device = self
            .device_mut(device_index)
            .ok_or(AllocError::UnknownDevice(device_index))?;
        if chunk < device.first_chunk || chunk >= device.end_chunk {
            return Err(AllocError::OutsideDevice {
                device: device_index,
                chunk,
                first: device.first_chunk,
                end: device.end_chunk,
            });
        }
        let state = device.chunks.entry(chunk).or_insert_with(|| ChunkState {
            slot_shift,
            used: [0; 4],
        });
        if state.slot_shift != slot_shift {
            return Err(AllocError::SlotSizeMismatch {
                device: device_index,
                chunk,
                have: state.slot_shift,
                want: slot_shift,
            });
        }
        if state.used_count() == 0 {
            // A chunk that was free (or just created above).
            device.free_chunks.remove(&chunk);
            device.with_room.entry(slot_shift).or_default().insert(chunk);
        }
        let bit = 1u64 << (slot % 64);
        if state.used[(slot / 64) as usize] & bit != 0 {
            return Err(AllocError::AlreadyUsed {
                device: device_index,
                offset,
            });
        }
        state.used[(slot / 64) as usize] |= bit;
        device.used_slots_bytes += 1 << slot_shift;
        if state.used_count() as u64 == per_chunk {
            if let Some(room) = device.with_room.get_mut(&slot_shift) {
                room.remove(&chunk);
            }
        }
        self.dirty.insert((device_index, chunk));
        Ok(())
    }

    /// Frees a slot. Returns false if it was not in use: outside log
    /// replay (which may free what the checkpoint already freed) that is a
    /// double free, and callers assert it.
    #[must_use = "false means a double free: assert it unless replaying the log"]
    pub fn free(&mut self, device_index: u8, offset: u64) -> bool {
        let chunk_shift = self.chunk_shift;
        let chunk = offset >> chunk_shift;
        let Some(device) = self.device_mut(device_index) else {
            return false;
        };
        let Some(state) = device.chunks.get_mut(&chunk) else {
            return false;
        };
        let slot_shift = state.slot_shift;
        let slot = (offset & ((1 << chunk_shift) - 1)) >> slot_shift;
        let bit = 1u64 << (slot % 64);
        if state.used[(slot / 64) as usize] & bit == 0 {
            return false;
        }
        state.used[(slot / 64) as usize] &= !bit;
        device.used_slots_bytes -= 1 << slot_shift;
        if state.used_count() == 0 {
            device.chunks.remove(&chunk);
            if let Some(room) = device.with_room.get_mut(&slot_shift) {
                room.remove(&chunk);
            }
            device.free_chunks.insert(chunk);
        } else {
            device.with_room.entry(slot_shift).or_default().insert(chunk);
        }
        self.dirty.insert((device_index, chunk));
        true
    }

    /// Loads a checkpointed chunk record; a record that cannot be right (a
    /// device or chunk outside the pool, a bad slot size, bits past the
    /// chunk's last slot) is an error naming it.
    pub fn load_chunk(&mut self, device_index: u8, chunk: u64, state: ChunkState) -> Result<(), AllocError> {
        if !(MIN_SLOT_SHIFT..=MAX_SLOT_SHIFT.min(self.chunk_shift)).contains(&state.slot_shift) {
            return Err(AllocError::BadSlotSize(state.slot_shift));
        }
        let per_chunk = self.slots_per_chunk(state.slot_shift);
        let slot_bytes = 1u64 << state.slot_shift;
        let device = self
            .device_mut(device_index)
            .ok_or(AllocError::UnknownDevice(device_index))?;
        if chunk < device.first_chunk || chunk >= device.end_chunk {
            return Err(AllocError::OutsideDevice {
                device: device_index,
                chunk,
                first: device.first_chunk,
                end: device.end_chunk,
            });
        }
        let past_the_end =
            (per_chunk..MAX_SLOTS_PER_CHUNK).any(|s| state.used[(s / 64) as usize] & (1 << (s % 64)) != 0);
        if past_the_end {
            return Err(AllocError::BitsPastTheEnd {
                device: device_index,
                chunk,
            });
        }
        device.free_chunks.remove(&chunk);
        let used = state.used_count() as u64;
        device.used_slots_bytes += used * slot_bytes;
        if used < per_chunk {
            device.with_room.entry(state.slot_shift).or_default().insert(chunk);
        }
        device.chunks.insert(chunk, state);
        Ok(())
    }

    /// The chunk records changed since the last call: `None` means "now
    /// free". Slots waiting in the freeing queue are recorded as free: their
    /// freeing is committed, so after a restart they must be free (their
    /// holes may stay unpunched: that costs only file-system space).
    pub fn take_dirty(&mut self) -> Vec<((u8, u64), Option<ChunkState>)> {
        let dirty: Vec<(u8, u64)> = self.dirty.drain().collect();
        let chunk_shift = self.chunk_shift;
        let punching: Vec<(u8, u64)> = self.punching.clone();
        dirty
            .into_iter()
            .map(|(device, chunk)| {
                let state = self
                    .devices
                    .iter()
                    .find(|d| d.index == device)
                    .and_then(|d| d.chunks.get(&chunk).copied())
                    .and_then(|mut state| {
                        if let Some(queued) = self.freeing.get(&(device, chunk)) {
                            for (word, queued) in state.used.iter_mut().zip(queued) {
                                *word &= !queued;
                            }
                        }
                        for &(_, offset) in punching
                            .iter()
                            .filter(|(d, o)| *d == device && o >> chunk_shift == chunk)
                        {
                            let slot = (offset & ((1 << chunk_shift) - 1)) >> state.slot_shift;
                            state.used[(slot / 64) as usize] &= !(1u64 << (slot % 64));
                        }
                        (state.used_count() > 0).then_some(state)
                    });
                ((device, chunk), state)
            })
            .collect()
    }

    /// Queues slots whose freeing is committed for the background freer
    /// (`freeing_batch`, then `finish_freeing`). Fails naming the first
    /// slot that is not in use or already queued (queuing the others).
    pub fn defer_frees(&mut self, slots: &mut [(u8, u64)]) -> Result<(), (u8, u64)> {
        slots.sort_unstable();
        let chunk_shift = self.chunk_shift;
        let mut bad = None;
        for group in slots.chunk_by(|a, b| a.0 == b.0 && a.1 >> chunk_shift == b.1 >> chunk_shift) {
            let (device, chunk) = (group[0].0, group[0].1 >> chunk_shift);
            let Some((slot_shift, used)) = self.slot_shift_of(device, chunk) else {
                bad = bad.or(Some(group[0]));
                continue;
            };
            let queued = self.freeing.entry((device, chunk)).or_insert([0; 4]);
            for &(device, offset) in group {
                let slot = (offset & ((1 << chunk_shift) - 1)) >> slot_shift;
                let (word, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
                if used[word] & bit == 0 || queued[word] & bit != 0 {
                    bad = bad.or(Some((device, offset)));
                    continue;
                }
                queued[word] |= bit;
                self.freeing_bytes += 1 << slot_shift;
            }
            if *queued == [0; 4] {
                self.freeing.remove(&(device, chunk));
            }
            self.dirty.insert((device, chunk));
        }
        bad.map_or(Ok(()), Err)
    }

    /// Takes up to `max` queued slots, in device order (so their holes
    /// merge), for the freer to punch; `finish_freeing` frees them. They
    /// stay counted as freeing (and checkpointed as free) meanwhile.
    /// A batch left unfinished (its freer was cancelled) is given again: a
    /// second punch of slots not yet freed is harmless.
    pub fn start_freeing(&mut self, max: usize) -> Vec<(u8, u64)> {
        if !self.punching.is_empty() {
            return self.punching.clone();
        }
        let mut batch = Vec::new();
        while batch.len() < max {
            let Some(mut entry) = self.freeing.first_entry() else {
                break;
            };
            let (device, chunk) = *entry.key();
            let slot_shift = self
                .devices
                .iter()
                .find(|d| d.index == device)
                .and_then(|d| d.chunks.get(&chunk))
                .map_or(MIN_SLOT_SHIFT, |s| s.slot_shift);
            let queued = entry.get_mut();
            for slot in 0..MAX_SLOTS_PER_CHUNK {
                let (word, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
                if queued[word] & bit != 0 && batch.len() < max {
                    queued[word] &= !bit;
                    batch.push((device, (chunk << self.chunk_shift) + (slot << slot_shift)));
                }
            }
            if *queued == [0; 4] {
                entry.remove();
            }
        }
        self.punching = batch.clone();
        batch
    }

    /// Frees the batch `start_freeing` gave (its holes punched).
    pub fn finish_freeing(&mut self) {
        for (device, offset) in std::mem::take(&mut self.punching) {
            self.release_queued(device, offset);
        }
    }

    /// Frees every queued slot not being punched, without punching: the
    /// pool needs the space now (it will be written again, so a hole would
    /// not last). Returns whether there was any.
    pub fn reclaim_freeing(&mut self) -> bool {
        self.reclaim_chunks(usize::MAX)
    }

    /// Like [`Allocator::reclaim_freeing`], for the queued slots of at most
    /// `chunks` chunks (the first in device order): a writer about to open a
    /// chunk takes back a few, so its allocator lock is held for
    /// microseconds even when a deleted snapshot queued a terabyte.
    fn reclaim_chunks(&mut self, chunks: usize) -> bool {
        let mut any = false;
        for _ in 0..chunks {
            let Some(((device, chunk), queued)) = self.freeing.pop_first() else {
                break;
            };
            any = true;
            let Some((slot_shift, _)) = self.slot_shift_of(device, chunk) else {
                continue;
            };
            for slot in 0..MAX_SLOTS_PER_CHUNK {
                if queued[(slot / 64) as usize] & (1 << (slot % 64)) != 0 {
                    self.release_queued(device, (chunk << self.chunk_shift) + (slot << slot_shift));
                }
            }
        }
        any
    }

    fn release_queued(&mut self, device: u8, offset: u64) {
        let slot_bytes = self
            .slot_shift_of(device, offset >> self.chunk_shift)
            .map_or(0, |(shift, _)| 1u64 << shift);
        self.freeing_bytes -= slot_bytes;
        assert!(
            self.free(device, offset),
            "queued slot {device}/{offset} was not in use"
        );
    }

    /// Stops (`false`) or resumes placing new slots on device `index`.
    /// Returns whether the allocator has that device.
    pub fn set_accepting(&mut self, index: u8, accepting: bool) -> bool {
        self.device_mut(index).map(|d| d.accepting = accepting).is_some()
    }

    /// Takes device `index` out for good (`pool remove`, once every block
    /// has moved off it): its queued frees are released unpunched (the
    /// device leaves the pool), its chunk records are marked for deletion
    /// by the next checkpoint, and its space goes. Refused with the bytes
    /// still in use there (live slots, or a batch the freer is punching)
    /// when it is not empty; nothing changes then.
    pub fn retire_device(&mut self, index: u8) -> Result<(), u64> {
        if !self.devices.iter().any(|d| d.index == index) {
            return Ok(());
        }
        let punching = self.punching.iter().filter(|(d, _)| *d == index).count() as u64;
        let live = self.live_bytes(index);
        if live > 0 || punching > 0 {
            return Err(live.max(punching));
        }
        let queued_chunks: Vec<u64> = self
            .freeing
            .range((index, 0)..=(index, u64::MAX))
            .map(|(&(_, chunk), _)| chunk)
            .collect();
        for chunk in queued_chunks {
            let Some(bits) = self.freeing.remove(&(index, chunk)) else {
                continue;
            };
            let Some((slot_shift, _)) = self.slot_shift_of(index, chunk) else {
                continue;
            };
            for slot in 0..MAX_SLOTS_PER_CHUNK {
                if bits[(slot / 64) as usize] & (1 << (slot % 64)) != 0 {
                    self.release_queued(index, (chunk << self.chunk_shift) + (slot << slot_shift));
                }
            }
        }
        let Some(position) = self.devices.iter().position(|d| d.index == index) else {
            return Ok(());
        };
        let device = self.devices.remove(position);
        assert_eq!(device.used_slots_bytes, 0, "a retired device holds no slots");
        self.dirty.extend(device.chunks.keys().map(|&chunk| (index, chunk)));
        Ok(())
    }

    /// Bytes of device `index` in live slots: in use and not queued to be
    /// freed (0 for a device the allocator does not have).
    pub fn live_bytes(&self, index: u8) -> u64 {
        let Some(device) = self.devices.iter().find(|d| d.index == index) else {
            return 0;
        };
        let queued: u64 = self
            .freeing
            .range((index, 0)..=(index, u64::MAX))
            .map(|(&(_, chunk), bits)| {
                let shift = device.chunks.get(&chunk).map_or(MIN_SLOT_SHIFT, |s| s.slot_shift);
                bits.iter().map(|w| w.count_ones() as u64).sum::<u64>() << shift
            })
            .sum();
        device.used_slots_bytes.saturating_sub(queued)
    }

    /// Bytes queued to be freed.
    pub fn freeing_bytes(&self) -> u64 {
        self.freeing_bytes
    }

    /// Puts records back after a failed checkpoint.
    pub fn restore_dirty(&mut self, keys: impl IntoIterator<Item = (u8, u64)>) {
        self.dirty.extend(keys);
    }

    /// A chunk's slot size (as a shift) and its bitmap of used slots, or
    /// `None` if the chunk is free (for scrubbing).
    pub fn slot_shift_of(&self, device_index: u8, chunk: u64) -> Option<(u8, [u64; 4])> {
        self.devices
            .iter()
            .find(|d| d.index == device_index)
            .and_then(|d| d.chunks.get(&chunk))
            .map(|s| (s.slot_shift, s.used))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_frees_stay_in_use_but_are_checkpointed_as_free() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 64);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        // Two slots of one chunk, one of another.
        let a = allocator.allocate(14).unwrap();
        let b = allocator.allocate(14).unwrap();
        let c = (0, 5 << 20);
        allocator.mark_used(c.0, c.1, 14).unwrap();
        allocator.take_dirty();
        assert_eq!(allocator.defer_frees(&mut [c, a]), Ok(()));
        assert_eq!(allocator.defer_frees(&mut [c]), Err(c), "queued twice");
        assert_eq!(
            allocator.defer_frees(&mut [(0, 9 << 20)]),
            Err((0, 9 << 20)),
            "a free slot"
        );
        assert_eq!(allocator.freeing_bytes(), 2 << 14);
        // Still in use: nothing allocates them...
        assert_eq!(allocator.devices()[0].used_bytes(), 3 << 14);
        for _ in 0..100 {
            let got = allocator.allocate(14).unwrap();
            assert!(got != a && got != c);
        }
        // ...but a checkpoint records them as free.
        let mut dirty = allocator.take_dirty();
        dirty.sort_by_key(|(key, _)| *key);
        let chunk_of = |offset: u64| offset >> 20;
        let first = dirty
            .iter()
            .find(|(key, _)| *key == (0, chunk_of(a.1)))
            .unwrap()
            .1
            .unwrap();
        let slot = |offset: u64| ((offset & ((1 << 20) - 1)) >> 14) as usize;
        assert_eq!(first.used[0] & (1 << slot(a.1)), 0);
        assert_ne!(first.used[0] & (1 << slot(b.1)), 0);
        let fifth = dirty.iter().find(|(key, _)| *key == (0, 5)).unwrap().1;
        assert!(
            fifth.is_none_or(|state| state.used[0] & (1 << slot(c.1)) == 0),
            "{fifth:?}"
        );
        // The freer frees them for real.
        let batch = allocator.start_freeing(1);
        assert_eq!(batch, vec![a]);
        assert_eq!(allocator.freeing_bytes(), 2 << 14, "still freeing while punched");
        // Short of space: the rest is freed at once, not the batch being punched.
        assert!(allocator.reclaim_freeing());
        assert_eq!(allocator.freeing_bytes(), 1 << 14);
        assert!(!allocator.free(c.0, c.1), "already free");
        allocator.restore_dirty([(0, chunk_of(a.1))]);
        let dirty = allocator.take_dirty();
        let first = dirty
            .iter()
            .find(|(key, _)| *key == (0, chunk_of(a.1)))
            .unwrap()
            .1
            .unwrap();
        assert_eq!(
            first.used[0] & (1 << slot(a.1)),
            0,
            "the batch being punched is checkpointed as free"
        );
        allocator.finish_freeing();
        assert_eq!(allocator.freeing_bytes(), 0);
        assert!(!allocator.free(a.0, a.1), "already free");
        assert!(!allocator.reclaim_freeing());
    }

    #[test]
    fn queued_frees_are_reused_before_a_chunk_that_holds_nothing() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 64);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        // Chunks 1 and 2 filled (64 slots of 16 KiB each), chunk 3 started.
        let mut old: Vec<(u8, u64)> = (0..128).map(|_| allocator.allocate_near(14, None).unwrap()).collect();
        assert!(old.iter().all(|&(_, offset)| [1, 2].contains(&(offset >> 20))));
        let started = allocator.allocate_near(14, None).unwrap();
        assert_eq!(started.1 >> 20, 3);
        allocator.defer_frees(&mut old).unwrap();
        assert_eq!(allocator.freeing_bytes(), 128 << 14);
        // Room in a chunk in use, hinted or not: the queue is left to the
        // freer.
        let next = allocator
            .allocate_near(14, Some(Hint::At(started.0, started.1 + (1 << 14))))
            .unwrap();
        assert_eq!(next, (0, started.1 + (1 << 14)));
        assert_eq!(allocator.allocate_near(14, None).unwrap().1 >> 20, 3);
        assert_eq!(allocator.freeing_bytes(), 128 << 14);
        // The freer punches a batch of chunk 1 meanwhile.
        let punching = allocator.start_freeing(4);
        assert!(punching.iter().all(|&(_, offset)| offset >> 20 == 1));
        // An allocation that would start a chunk holding nothing (a hole in
        // a sparse device file) takes the queued slots back first: chunk 2,
        // now empty, is the first free chunk again.
        let got = allocator
            .allocate_near(14, Some(Hint::FreshChunk { logical_slot: 7 }))
            .unwrap();
        assert_eq!(
            allocator.freeing_bytes(),
            4 << 14,
            "only the batch being punched is left"
        );
        assert_eq!(got, (0, (2 << 20) + (7 << 14)));
        // The rest of chunks 1 and 2 comes before chunk 3's room; never the
        // batch being punched.
        let mut reused = vec![got];
        while let Some(slot) = allocator.allocate_near(14, None) {
            if slot.1 >> 20 == 3 {
                break;
            }
            reused.push(slot);
        }
        assert_eq!(reused.len(), 124, "all of chunks 1 and 2 but the 4 being punched");
        assert!(reused.iter().all(|slot| !punching.contains(slot)));
        allocator.finish_freeing();
        assert_eq!(allocator.freeing_bytes(), 0);
    }

    #[test]
    fn a_writer_takes_back_a_few_chunks_of_a_long_queue_at_a_time() {
        let fast = DeviceSpace::new(0, Role::Fast, 0, 64);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        let mut old: Vec<(u8, u64)> = (0..40 * 64).map(|_| allocator.allocate(14).unwrap()).collect();
        allocator.defer_frees(&mut old).unwrap();
        assert_eq!(allocator.freeing_bytes(), 40 << 20);
        let got = allocator
            .allocate_near(14, Some(Hint::FreshChunk { logical_slot: 0 }))
            .unwrap();
        assert_eq!(got, (0, 0), "the first chunk taken back");
        assert_eq!(allocator.freeing_bytes(), (40 - RECLAIM_CHUNKS as u64) << 20);
        // Out of space: everything queued comes back at once.
        assert!(allocator.reclaim_freeing());
        assert_eq!(allocator.freeing_bytes(), 0);
    }

    #[test]
    fn hinted_allocations_lay_interleaved_streams_out_in_order() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 64);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        // Two writers, each writing its own region front to back, their
        // 16 KiB blocks interleaved in time.
        let mut last: [Option<(u8, u64)>; 2] = [None, None];
        let mut layout: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..200 {
            for (stream, previous) in last.iter_mut().enumerate() {
                let hint = previous.map(|(device, offset)| (device, offset + (1 << 14)));
                let got = allocator.allocate_near(14, hint.map(|(d, o)| Hint::At(d, o))).unwrap();
                layout[stream].push(got.1);
                *previous = Some(got);
            }
        }
        for stream in &layout {
            let breaks = stream.windows(2).filter(|w| w[1] != w[0] + (1 << 14)).count();
            // 200 blocks of 16 KiB span 3.1 chunks: at most a jump per chunk.
            assert!(breaks <= 4, "{breaks} discontinuities: {stream:?}");
        }
        // No slot handed out twice.
        let all: HashSet<u64> = layout.iter().flatten().copied().collect();
        assert_eq!(all.len(), 400);
    }

    #[test]
    fn out_of_order_large_writes_still_land_in_volume_order() {
        // A volume chunk's four 256 KiB pieces (16 blocks of 16 KiB each)
        // written last first, as a parallel copier may: the first piece
        // written takes a fresh chunk at its own place, the others are
        // placed before their right neighbour.
        let fast = DeviceSpace::new(0, Role::Fast, 1, 64);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        let mut placed = [0u64; 64];
        for piece in (0..4u64).rev() {
            let first = piece * 16;
            let hint = if piece == 3 {
                Hint::FreshChunk { logical_slot: first }
            } else {
                Hint::At(0, placed[(first + 16) as usize] - 16 * (1 << 14))
            };
            let mut previous = allocator.allocate_near(14, Some(hint)).unwrap();
            placed[first as usize] = previous.1;
            for block in first + 1..first + 16 {
                previous = allocator
                    .allocate_near(14, Some(Hint::At(0, previous.1 + (1 << 14))))
                    .unwrap();
                placed[block as usize] = previous.1;
            }
        }
        let base = placed[0];
        assert_eq!(base % (1 << 20), 0, "the chunk starts with block 0");
        for (block, offset) in placed.iter().enumerate() {
            assert_eq!(*offset, base + block as u64 * (1 << 14), "block {block}");
        }
    }

    #[test]
    fn a_hint_never_keeps_a_slower_tier_filling_or_reuses_a_slot() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 2); // one chunk
        let capacity = DeviceSpace::new(1, Role::Capacity, 1, 9);
        let mut allocator = Allocator::new(1 << 20, vec![fast, capacity]);
        // A hint on the capacity tier is ignored while fast has room.
        assert_eq!(allocator.allocate_near(17, Some(Hint::At(1, 4 << 20))).unwrap().0, 0);
        // A hint at a used slot, with no fresh chunk after it on the tier:
        // the usual order (the rest of the fast chunk).
        let (_, taken) = allocator.allocate(17).unwrap();
        let (device, next) = allocator.allocate_near(17, Some(Hint::At(0, taken))).unwrap();
        assert_eq!(device, 0);
        assert_ne!(next, taken);
        // Fill fast; then hints on capacity are followed.
        while allocator.devices()[0].used_bytes() < 1 << 20 {
            allocator.allocate(17).unwrap();
        }
        assert_eq!(
            allocator.allocate_near(17, Some(Hint::At(1, 5 << 20))),
            Some((1, 5 << 20))
        );
        assert_eq!(
            allocator.allocate_near(17, Some(Hint::At(1, (5 << 20) + (1 << 17)))),
            Some((1, (5 << 20) + (1 << 17)))
        );
        // A hint outside the data area, or at a chunk of another slot size,
        // falls back to the usual order.
        let (device, _) = allocator.allocate_near(17, Some(Hint::At(1, 100 << 20))).unwrap();
        assert_eq!(device, 1);
        let (_, small) = allocator.allocate(12).unwrap();
        let (_, other) = allocator.allocate_near(17, Some(Hint::At(1, small))).unwrap();
        assert_ne!(other >> 20, small >> 20, "a 128 KiB slot in a chunk of 4 KiB slots");
    }

    #[test]
    fn fills_fast_tier_first_then_spills() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 3); // 2 chunks
        let capacity = DeviceSpace::new(1, Role::Capacity, 1, 5);
        let mut allocator = Allocator::new(1 << 20, vec![capacity, fast]);
        let mut seen = HashSet::new();
        for _ in 0..128 {
            let (device, offset) = allocator.allocate(14).unwrap();
            assert_eq!(device, 0, "fast tier has room");
            assert!(seen.insert(offset));
            assert_eq!(offset % (16 << 10), 0);
            assert!((1 << 20..3 << 20).contains(&offset));
        }
        let (device, _) = allocator.allocate(14).unwrap();
        assert_eq!(device, 1, "spills to capacity when fast is full");
        // Freeing a fast slot makes it the next choice again.
        let freed = *seen.iter().next().unwrap();
        assert!(allocator.free(0, freed));
        assert!(!allocator.free(0, freed), "double free is refused");
        assert_eq!(allocator.allocate(14), Some((0, freed)));
    }

    #[test]
    fn a_device_added_later_takes_its_tier_place() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 2);
        let capacity = DeviceSpace::new(1, Role::Capacity, 1, 3);
        let mut allocator = Allocator::new(1 << 20, vec![fast, capacity]);
        for _ in 0..8 {
            assert_eq!(allocator.allocate(17).unwrap().0, 0);
        }
        assert_eq!(allocator.allocate(17).unwrap().0, 1, "fast is full");
        allocator.add_device(DeviceSpace::new(2, Role::Fast, 1, 2));
        for _ in 0..8 {
            assert_eq!(allocator.allocate(17).unwrap().0, 2, "the added fast device first");
        }
        assert_eq!(allocator.allocate(17).unwrap().0, 1);
        let order: Vec<u8> = allocator.devices().iter().map(|d| d.index).collect();
        assert_eq!(order, [0, 2, 1]);
    }

    /// A device being removed takes no new slot, not even one hinted next
    /// to its own; once empty it is retired and its chunk records deleted.
    #[test]
    fn a_device_that_stops_accepting_gets_nothing_new_and_retires_when_empty() {
        let mut allocator = Allocator::new(
            1 << 20,
            vec![
                DeviceSpace::new(0, Role::Capacity, 1, 4),
                DeviceSpace::new(1, Role::Capacity, 1, 4),
            ],
        );
        let (device, offset) = allocator.allocate(12).unwrap();
        assert_eq!(device, 0);
        assert!(allocator.set_accepting(0, false));
        for _ in 0..100 {
            assert_eq!(allocator.allocate(12).unwrap().0, 1);
        }
        let hinted = allocator.allocate_near(12, Some(Hint::At(0, offset + 4096))).unwrap();
        assert_eq!(hinted.0, 1);
        assert_eq!(allocator.devices()[0].free_bytes(1 << 20), 0);
        assert_eq!(allocator.retire_device(0), Err(4096));
        allocator.take_dirty();
        let mut queued = [(0, offset)];
        allocator.defer_frees(&mut queued).unwrap();
        allocator.retire_device(0).unwrap();
        assert!(allocator.devices().iter().all(|d| d.index != 0));
        let dirty = allocator.take_dirty();
        assert!(dirty.contains(&((0, offset >> 20), None)), "{dirty:?}");
    }

    #[test]
    fn runs_out() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 2);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        for _ in 0..8 {
            assert!(allocator.allocate(17).is_some());
        }
        assert_eq!(allocator.allocate(17), None);
        assert_eq!(allocator.allocate(12), None, "no free chunk for another slot size");
    }

    #[test]
    fn chunk_state_round_trip() {
        let state = ChunkState {
            slot_shift: 14,
            used: [1, 2, 3, u64::MAX],
        };
        assert_eq!(ChunkState::decode(&state.encode()), Some(state));
        // Stored sealed; an unsealed state (older pools) still decodes.
        let key = (1, 40);
        let stored = state.encode_stored(key);
        assert_eq!(stored.len(), 37);
        assert_eq!(ChunkState::decode_stored(key, &stored), Ok(state));
        assert_eq!(ChunkState::decode_stored(key, &state.encode()), Ok(state));
        assert!(ChunkState::decode_stored(key, &stored[..30])
            .unwrap_err()
            .contains("field length"));
    }

    /// One flipped bit anywhere in a stored chunk state fails its decode
    /// naming the checksum (the pool's open names the table and key).
    #[test]
    fn a_flipped_bit_in_a_stored_chunk_state_fails_its_load() {
        let state = ChunkState {
            slot_shift: 14,
            used: [0x0f0f, 0, 1 << 40, 7],
        };
        let key = (0, 77);
        let stored = state.encode_stored(key);
        assert_eq!(ChunkState::decode_stored(key, &stored), Ok(state));
        for bit in 0..stored.len() * 8 {
            let mut flipped = stored.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let error = ChunkState::decode_stored(key, &flipped).expect_err("a flipped bit");
            assert!(error.starts_with("checksum: stored"), "bit {bit}: {error}");
        }
        assert!(
            ChunkState::decode_stored((0, 78), &stored).is_err(),
            "under another key"
        );
    }

    #[test]
    fn mark_used_checks_the_chunks_slot_size_alignment_and_range() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 8);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        let chunk = 1u64 << 20;
        allocator.mark_used(0, chunk, 14).unwrap();
        assert_eq!(
            allocator.mark_used(0, chunk, 14),
            Err(AllocError::AlreadyUsed {
                device: 0,
                offset: chunk
            })
        );
        // The same chunk cannot hold 4 KiB slots too (accepted, this would
        // set the bit of a different slot and count 4 KiB as used).
        assert_eq!(
            allocator.mark_used(0, chunk + (1 << 14), 12),
            Err(AllocError::SlotSizeMismatch {
                device: 0,
                chunk: 1,
                have: 14,
                want: 12
            })
        );
        assert!(matches!(
            allocator.mark_used(0, chunk + 4096, 14),
            Err(AllocError::Misaligned { .. })
        ));
        assert!(matches!(
            allocator.mark_used(0, 0, 14),
            Err(AllocError::OutsideDevice { .. })
        ));
        assert!(matches!(
            allocator.mark_used(0, 8 * chunk, 14),
            Err(AllocError::OutsideDevice { .. })
        ));
        assert_eq!(allocator.mark_used(3, chunk, 14), Err(AllocError::UnknownDevice(3)));
        assert_eq!(allocator.mark_used(0, chunk, 11), Err(AllocError::BadSlotSize(11)));
        assert_eq!(allocator.devices()[0].used_bytes(), 1 << 14);
    }

    #[test]
    fn load_chunk_refuses_records_that_cannot_be_right() {
        let fast = DeviceSpace::new(0, Role::Fast, 1, 8);
        let mut allocator = Allocator::new(1 << 20, vec![fast]);
        let state = |slot_shift, used| ChunkState { slot_shift, used };
        // A chunk outside the device is an error, not silently dropped.
        assert!(matches!(
            allocator.load_chunk(0, 9, state(14, [1, 0, 0, 0])),
            Err(AllocError::OutsideDevice { chunk: 9, .. })
        ));
        assert_eq!(
            allocator.load_chunk(2, 1, state(14, [1, 0, 0, 0])),
            Err(AllocError::UnknownDevice(2))
        );
        assert_eq!(
            allocator.load_chunk(0, 1, state(40, [1, 0, 0, 0])),
            Err(AllocError::BadSlotSize(40))
        );
        // 16 KiB slots: 64 per chunk; bit 64 does not exist.
        assert_eq!(
            allocator.load_chunk(0, 1, state(14, [1, 1, 0, 0])),
            Err(AllocError::BitsPastTheEnd { device: 0, chunk: 1 })
        );
        allocator.load_chunk(0, 1, state(14, [3, 0, 0, 0])).unwrap();
        assert_eq!(allocator.devices()[0].used_bytes(), 2 << 14);
    }
}
