//! A logical unit: executes decoded SBC/SPC commands against a [`ServedVolume`].
//!
//! One `LogicalUnit` exists per volume and is shared by every session that
//! reaches it. The data path (READ/WRITE) touches no lock except the
//! compare-and-write gate, which writers take shared; state that changes
//! rarely (unit attentions, reservations) sits behind a mutex that is only
//! taken when an atomic flag says there is something to look at.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::cdb::{Command, PageControl};
use super::pages::{self, ModeValues, UnitInfo, BLOCK_BYTES};
use super::pr;
use super::sense::{sense_for, status, Sense};
use crate::block::{BlockResult, IoBuf, ZeroFlags};
use crate::block::{Op, Protocol};
use crate::control::manager::VolumeManager;
use crate::volume::ServedVolume;

/// Identifies an I_T nexus: the initiator port (`name,i,0xISID`).
pub type Nexus = Arc<str>;

/// Unit attentions kept per nexus; older ones are dropped beyond this.
const MAX_ATTENTIONS: usize = 8;
/// Bytes written per call when WRITE SAME replicates a non-zero block.
const WRITE_SAME_CHUNK_BYTES: usize = 1 << 20;

/// What a command ended with: status, sense for CHECK CONDITION, and data-in.
#[derive(Debug)]
pub struct Outcome {
    pub status: u8,
    pub sense: Option<Sense>,
    pub data: Vec<u8>,
}

impl Outcome {
    pub fn good(data: Vec<u8>) -> Self {
        Outcome {
            status: status::GOOD,
            sense: None,
            data,
        }
    }

    pub fn check(sense: Sense) -> Self {
        Outcome {
            status: status::CHECK_CONDITION,
            sense: Some(sense),
            data: Vec::new(),
        }
    }

    pub fn conflict() -> Self {
        Outcome {
            status: status::RESERVATION_CONFLICT,
            sense: None,
            data: Vec::new(),
        }
    }

    fn from_result(result: BlockResult<()>) -> Self {
        match result {
            Ok(()) => Outcome::good(Vec::new()),
            Err(e) => Outcome::check(sense_for(&e)),
        }
    }
}

/// Truncates `data` to the allocation length.
fn allocated(mut data: Vec<u8>, alloc_len: u32) -> Vec<u8> {
    data.truncate(alloc_len as usize);
    data
}

/// How a task management function affects the logical unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetKind {
    LogicalUnit,
    TargetWarm,
    TargetCold,
}

#[derive(Default)]
struct SharedState {
    /// Nexuses with a session logged in to this unit.
    nexuses: Vec<Nexus>,
    attentions: HashMap<Nexus, VecDeque<Sense>>,
    /// Holder of a RESERVE(6) reservation.
    reserve6: Option<Nexus>,
    pr: pr::State,
}

/// Persistent-reservation state as saved to disk, so reservations survive
/// restarts (SPC-4 APTPL behaviour, always on).
#[derive(Serialize, Deserialize, Default)]
struct SavedReservations {
    state: pr::State,
}

pub struct LogicalUnit {
    volume: Arc<ServedVolume>,
    manager: Option<Arc<VolumeManager>>,
    naa: [u8; 16],
    serial: String,
    target_name: String,
    /// A snapshot's unit: every command that writes the medium ends with
    /// DATA PROTECT, WRITE PROTECTED (and MODE SENSE sets WP).
    read_only: bool,
    /// Writers take this shared; COMPARE AND WRITE takes it exclusively, so
    /// its read-compare-write is atomic against every other writer.
    write_gate: tokio::sync::RwLock<()>,
    /// Fast-path hints: set whenever `state` has attentions or reservations.
    attention_pending: AtomicBool,
    reserved: AtomicBool,
    /// The pool's backing space was low at the last command: the thin
    /// provisioning soft threshold's unit attention has been established
    /// for this crossing (raised again only after it cleared).
    threshold_reached: AtomicBool,
    state: Mutex<SharedState>,
    /// Where persistent reservations are saved (`None`: kept in memory).
    reservations_path: Option<PathBuf>,
}

impl LogicalUnit {
    /// A logical unit for `volume`, exported as `target_name`. With a
    /// `manager`, MODE SELECT changes persist through it and persistent
    /// reservations are saved under its data directory.
    pub fn new(volume: Arc<ServedVolume>, manager: Option<Arc<VolumeManager>>, target_name: &str) -> Self {
        let naa = pages::naa_for(volume.full_name());
        let serial: String = naa[8..16].iter().map(|b| format!("{b:02x}")).collect();
        let reservations_path = manager.as_ref().map(|m| {
            m.data_dir()
                .join("iscsi")
                .join(format!("{}.{}.reservations.json", volume.pool(), volume.name()))
        });
        let mut state = SharedState::default();
        if let Some(path) = &reservations_path {
            if let Ok(text) = std::fs::read_to_string(path) {
                match serde_json::from_str::<SavedReservations>(&text) {
                    Ok(saved) => state.pr = saved.state,
                    Err(e) => tracing::warn!("ignoring unreadable reservations in {}: {e}", path.display()),
                }
            }
        }
        let reserved = state.pr.is_active();
        let read_only = volume.capabilities().read_only;
        LogicalUnit {
            read_only,
            volume,
            manager,
            naa,
            serial,
            target_name: target_name.to_string(),
            write_gate: tokio::sync::RwLock::new(()),
            attention_pending: AtomicBool::new(false),
            reserved: AtomicBool::new(reserved),
            threshold_reached: AtomicBool::new(false),
            state: Mutex::new(state),
            reservations_path,
        }
    }

    pub fn volume(&self) -> &Arc<ServedVolume> {
        &self.volume
    }

    fn state(&self) -> MutexGuard<'_, SharedState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn capacity_blocks(&self) -> u64 {
        self.volume.size_bytes() / BLOCK_BYTES as u64
    }

    fn unit_info(&self) -> UnitInfo {
        UnitInfo {
            capacity_blocks: self.capacity_blocks(),
            caps: self.volume.capabilities(),
            wce: self.volume.wce(),
            naa: self.naa,
            serial: self.serial.clone(),
            target_name: self.target_name.clone(),
        }
    }

    /// A session for `nexus` logged in.
    pub fn attach(&self, nexus: &Nexus) {
        let mut state = self.state();
        if !state.nexuses.contains(nexus) {
            state.nexuses.push(nexus.clone());
        }
    }

    /// The session for `nexus` ended: its RESERVE(6) is released (I_T nexus
    /// loss); persistent reservations stay.
    pub fn detach(&self, nexus: &Nexus) {
        let mut state = self.state();
        state.nexuses.retain(|n| n != nexus);
        state.attentions.remove(nexus);
        if state.reserve6.as_ref() == Some(nexus) {
            state.reserve6 = None;
        }
        self.refresh_flags(&state);
    }

    /// Applies a reset: RESERVE(6) reservations are released and every other
    /// nexus gets a unit attention.
    pub fn reset(&self, kind: ResetKind, issuer: &Nexus) {
        let sense = match kind {
            ResetKind::LogicalUnit => Sense::BUS_DEVICE_RESET,
            ResetKind::TargetWarm => Sense::new(super::sense::key::UNIT_ATTENTION, 0x29, 0x02),
            ResetKind::TargetCold => Sense::POWER_ON_RESET,
        };
        let mut state = self.state();
        state.reserve6 = None;
        let others: Vec<Nexus> = state.nexuses.iter().filter(|n| *n != issuer).cloned().collect();
        for nexus in others {
            push_attention(&mut state, &nexus, sense);
        }
        self.refresh_flags(&state);
    }

    /// Follows the pool's backing-space condition (one atomic load per
    /// command): when it turns on, every logged-in I_T nexus gets the
    /// THIN PROVISIONING SOFT THRESHOLD REACHED unit attention (SITUA is
    /// zero), once per crossing.
    fn follow_soft_threshold(&self) {
        let low = self.volume.backing_space_low();
        if low == self.threshold_reached.load(Ordering::Acquire) {
            return;
        }
        let mut state = self.state();
        if self.threshold_reached.swap(low, Ordering::AcqRel) == low || !low {
            return;
        }
        tracing::warn!(
            "{}: thin provisioning soft threshold reached (the file system under the pool is low on space); \
             unit attention for {} initiator(s)",
            self.volume.full_name(),
            state.nexuses.len()
        );
        let nexuses = state.nexuses.clone();
        for nexus in nexuses {
            push_attention(&mut state, &nexus, Sense::THIN_PROVISIONING_SOFT_THRESHOLD_REACHED);
        }
        self.refresh_flags(&state);
    }

    fn refresh_flags(&self, state: &SharedState) {
        let pending = state.attentions.values().any(|q| !q.is_empty());
        self.attention_pending.store(pending, Ordering::Release);
        self.reserved
            .store(state.reserve6.is_some() || state.pr.is_active(), Ordering::Release);
    }

    fn take_attention(&self, nexus: &Nexus) -> Option<Sense> {
        let mut state = self.state();
        let sense = state.attentions.get_mut(nexus).and_then(|q| q.pop_front());
        self.refresh_flags(&state);
        sense
    }

    /// Whether `command` from `nexus` conflicts with a reservation.
    fn conflicts(&self, nexus: &Nexus, command: &Command) -> bool {
        let state = self.state();
        if let Some(holder) = &state.reserve6 {
            if holder == nexus {
                return false;
            }
            return !matches!(
                command,
                Command::Inquiry { .. }
                    | Command::ReportLuns { .. }
                    | Command::RequestSense { .. }
                    | Command::Release6
                    | Command::ReportSupportedOpcodes { .. }
            );
        }
        state.pr.conflicts(nexus, command)
    }

    /// Executes `command` for `nexus`. `data_out` holds exactly the bytes the
    /// command's [`Command::transfer`] asked for.
    pub async fn execute(&self, nexus: &Nexus, command: &Command, data_out: Vec<u8>) -> Outcome {
        self.follow_soft_threshold();
        let exempt_from_attention = matches!(
            command,
            Command::Inquiry { .. } | Command::ReportLuns { .. } | Command::RequestSense { .. }
        );
        if !exempt_from_attention && self.attention_pending.load(Ordering::Acquire) {
            if let Some(sense) = self.take_attention(nexus) {
                return Outcome::check(sense);
            }
        }
        if self.reserved.load(Ordering::Acquire) && self.conflicts(nexus, command) {
            return Outcome::conflict();
        }
        if self.read_only && command.writes_medium() {
            return Outcome::check(Sense::WRITE_PROTECTED);
        }
        match *command {
            Command::TestUnitReady => Outcome::good(Vec::new()),
            Command::RequestSense { descriptor, alloc_len } => {
                let sense = self.take_attention(nexus).unwrap_or(Sense::new(0, 0, 0));
                let data = if descriptor {
                    sense.to_descriptor()
                } else {
                    sense.to_fixed().to_vec()
                };
                Outcome::good(allocated(data, alloc_len))
            }
            Command::Inquiry { evpd, page, alloc_len } => {
                if !evpd {
                    return Outcome::good(allocated(pages::standard_inquiry(), alloc_len));
                }
                match pages::vpd_page(page, &self.unit_info()) {
                    Some(data) => Outcome::good(allocated(data, alloc_len)),
                    None => Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, None)),
                }
            }
            Command::ReportLuns { select, alloc_len } => {
                if select > 2 && !(0x10..=0x12).contains(&select) {
                    return Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, None));
                }
                if alloc_len < 16 {
                    return Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(6, None));
                }
                let mut data = vec![0u8; 16];
                data[3] = 8;
                Outcome::good(allocated(data, alloc_len))
            }
            Command::ReadCapacity10 => Outcome::good(pages::read_capacity10(&self.unit_info())),
            Command::ReadCapacity16 { alloc_len } => {
                Outcome::good(allocated(pages::read_capacity16(&self.unit_info()), alloc_len))
            }
            Command::Read { lba, blocks, fua } => self.read(lba, blocks, fua).await,
            Command::Write { lba, blocks, fua } => self.write(lba, blocks, fua, data_out).await,
            Command::WriteAndVerify { lba, blocks } => self.write(lba, blocks, true, data_out).await,
            Command::Verify { lba, blocks, bytchk } => self.verify(lba, blocks, bytchk, data_out).await,
            Command::WriteSame {
                lba,
                blocks,
                unmap,
                ndob,
            } => self.write_same(lba, blocks, unmap, ndob, data_out).await,
            Command::Unmap { .. } => self.unmap(&data_out).await,
            Command::GetLbaStatus { lba, alloc_len } => self.lba_status(lba, alloc_len).await,
            Command::CompareAndWrite { lba, blocks, fua } => self.compare_and_write(lba, blocks, fua, data_out).await,
            Command::SynchronizeCache { lba, blocks } => {
                if let Err(sense) = self.check_lba(lba, blocks) {
                    return Outcome::check(sense);
                }
                let started = Instant::now();
                let result = self.volume.flush().await;
                self.record(Op::Flush, 0, started, result.is_ok());
                Outcome::from_result(result)
            }
            Command::Prefetch { lba, blocks } => {
                if let Err(sense) = self.check_lba(lba, blocks) {
                    return Outcome::check(sense);
                }
                let result = self
                    .volume
                    .cache(lba * BLOCK_BYTES as u64, blocks as u64 * BLOCK_BYTES as u64)
                    .await;
                Outcome::from_result(result)
            }
            Command::ModeSense {
                ten,
                dbd,
                llbaa,
                pc,
                page,
                subpage,
                alloc_len,
            } => {
                let values = match pc {
                    PageControl::Current | PageControl::Saved => ModeValues::Current,
                    PageControl::Changeable => ModeValues::Changeable,
                    PageControl::Default => ModeValues::Default,
                };
                let info = self.unit_info();
                match pages::mode_pages(&info, page, subpage, values) {
                    Some(body) => Outcome::good(allocated(
                        pages::mode_sense_data(&info, ten, dbd, llbaa, &body),
                        alloc_len,
                    )),
                    None if subpage != 0 && pages::known_page(page) => {
                        Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(3, None))
                    }
                    None => Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(5))),
                }
            }
            Command::ModeSelect { ten, pf, .. } => self.mode_select(ten, pf, &data_out),
            Command::ReportSupportedOpcodes {
                rctd,
                options,
                opcode,
                service_action,
                alloc_len,
            } => match super::opcodes::report(rctd, options, opcode, service_action) {
                Ok(data) => Outcome::good(allocated(data, alloc_len)),
                Err(sense) => Outcome::check(sense),
            },
            Command::StartStopUnit { .. } | Command::PreventAllowMediumRemoval { .. } => Outcome::good(Vec::new()),
            Command::Reserve6 => {
                let mut state = self.state();
                if state.pr.is_active() || state.reserve6.as_ref().is_some_and(|h| h != nexus) {
                    return Outcome::conflict();
                }
                state.reserve6 = Some(nexus.clone());
                self.refresh_flags(&state);
                Outcome::good(Vec::new())
            }
            Command::Release6 => {
                let mut state = self.state();
                if state.reserve6.as_ref() == Some(nexus) {
                    state.reserve6 = None;
                }
                self.refresh_flags(&state);
                Outcome::good(Vec::new())
            }
            Command::PersistentReserveIn { action, alloc_len } => {
                let state = self.state();
                if state.reserve6.is_some() && state.reserve6.as_ref() != Some(nexus) {
                    return Outcome::conflict();
                }
                match state.pr.report(action, nexus) {
                    Ok(data) => Outcome::good(allocated(data, alloc_len)),
                    Err(sense) => Outcome::check(sense),
                }
            }
            Command::PersistentReserveOut {
                action,
                scope,
                kind,
                param_len,
            } => self.persistent_reserve_out(nexus, action, scope, kind, param_len, &data_out),
        }
    }

    /// Makes write data exactly `spdtl` bytes when the initiator sent a
    /// different amount (EDTL): extra bytes are dropped, and missing bytes
    /// are filled with the blocks' current contents, so only the bytes that
    /// were transferred change.
    pub async fn fit_write_data(&self, command: &Command, mut data: Vec<u8>, spdtl: usize) -> Result<Vec<u8>, Sense> {
        if data.len() >= spdtl {
            data.truncate(spdtl);
            return Ok(data);
        }
        let (Command::Write { lba, blocks, .. } | Command::WriteAndVerify { lba, blocks }) = *command else {
            return Err(Sense::INVALID_FIELD_IN_INFORMATION_UNIT);
        };
        self.check_transfer(lba, blocks)?;
        let mut current = self.read_range(lba, blocks).await?;
        current[..data.len()].copy_from_slice(&data);
        Ok(current)
    }

    fn record(&self, op: Op, bytes: u64, started: Instant, ok: bool) {
        self.volume
            .stats()
            .record(Protocol::Iscsi, op, bytes, started.elapsed(), ok);
    }

    /// Checks that `[lba, lba + blocks)` lies within the volume.
    fn check_lba(&self, lba: u64, blocks: u32) -> Result<(), Sense> {
        match lba.checked_add(blocks as u64) {
            Some(end) if end <= self.capacity_blocks() => Ok(()),
            _ => Err(Sense::LBA_OUT_OF_RANGE),
        }
    }

    /// Checks the range and the per-request size limit of a data transfer.
    fn check_transfer(&self, lba: u64, blocks: u32) -> Result<(), Sense> {
        self.check_lba(lba, blocks)?;
        if blocks as u64 * BLOCK_BYTES as u64 > self.volume.capabilities().max_request_bytes as u64 {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        Ok(())
    }

    async fn read(&self, lba: u64, blocks: u32, _fua: bool) -> Outcome {
        if let Err(sense) = self.check_transfer(lba, blocks) {
            return Outcome::check(sense);
        }
        if blocks == 0 {
            return Outcome::good(Vec::new());
        }
        let bytes = blocks as usize * BLOCK_BYTES as usize;
        let started = Instant::now();
        let (buf, result) = self
            .volume
            .read(lba * BLOCK_BYTES as u64, IoBuf::with_headroom(0, bytes))
            .await;
        self.record(Op::Read, bytes as u64, started, result.is_ok());
        match result {
            Ok(()) => Outcome::good(buf.into_vec()),
            Err(e) => Outcome::check(sense_for(&e)),
        }
    }

    async fn write(&self, lba: u64, blocks: u32, fua: bool, data: Vec<u8>) -> Outcome {
        if let Err(sense) = self.check_transfer(lba, blocks) {
            return Outcome::check(sense);
        }
        if blocks == 0 {
            return Outcome::good(Vec::new());
        }
        debug_assert_eq!(data.len(), blocks as usize * BLOCK_BYTES as usize);
        let bytes = data.len() as u64;
        let started = Instant::now();
        let result = {
            let _shared = self.write_gate.read().await;
            self.volume
                .write(lba * BLOCK_BYTES as u64, IoBuf::from_vec(data), fua)
                .await
        };
        self.record(Op::Write, bytes, started, result.is_ok());
        Outcome::from_result(result)
    }

    async fn read_range(&self, lba: u64, blocks: u32) -> Result<Vec<u8>, Sense> {
        let bytes = blocks as usize * BLOCK_BYTES as usize;
        let (buf, result) = self
            .volume
            .read(lba * BLOCK_BYTES as u64, IoBuf::with_headroom(0, bytes))
            .await;
        result.map_err(|e| sense_for(&e))?;
        Ok(buf.into_vec())
    }

    async fn verify(&self, lba: u64, blocks: u32, bytchk: u8, data: Vec<u8>) -> Outcome {
        if let Err(sense) = self.check_transfer(lba, blocks) {
            return Outcome::check(sense);
        }
        if blocks == 0 || bytchk == 0 {
            return Outcome::good(Vec::new());
        }
        let stored = match self.read_range(lba, blocks).await {
            Ok(stored) => stored,
            Err(sense) => return Outcome::check(sense),
        };
        let block = BLOCK_BYTES as usize;
        let mismatch = if bytchk == 3 {
            stored
                .chunks(block)
                .enumerate()
                .find_map(|(i, chunk)| first_difference(chunk, &data).map(|at| i * block + at))
        } else {
            first_difference(&stored, &data)
        };
        match mismatch {
            None => Outcome::good(Vec::new()),
            Some(at) => Outcome::check(Sense::MISCOMPARE_DURING_VERIFY.with_information(at as u64)),
        }
    }

    async fn write_same(&self, lba: u64, blocks: u32, unmap: bool, ndob: bool, data: Vec<u8>) -> Outcome {
        if let Err(sense) = self.check_lba(lba, blocks) {
            return Outcome::check(sense);
        }
        if blocks == 0 || blocks > pages::MAX_UNMAP_BLOCKS {
            return Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(7, None));
        }
        let zero = ndob || data.iter().all(|&b| b == 0);
        let offset = lba * BLOCK_BYTES as u64;
        let length = blocks as u64 * BLOCK_BYTES as u64;
        let started = Instant::now();
        let _shared = self.write_gate.read().await;
        if zero {
            let may_trim = unmap && self.volume.capabilities().can_trim;
            let result = self
                .volume
                .write_zeroes(
                    offset,
                    length,
                    ZeroFlags {
                        may_trim,
                        fast_only: false,
                        fua: false,
                    },
                )
                .await;
            self.record(Op::WriteZeroes, length, started, result.is_ok());
            return Outcome::from_result(result);
        }
        let block = BLOCK_BYTES as usize;
        let chunk_blocks = (WRITE_SAME_CHUNK_BYTES / block).min(blocks as usize);
        let pattern: Vec<u8> = data.iter().copied().cycle().take(chunk_blocks * block).collect();
        let mut done: u64 = 0;
        while done < length {
            let this = (length - done).min(pattern.len() as u64) as usize;
            let result = self
                .volume
                .write(offset + done, IoBuf::from_vec(pattern[..this].to_vec()), false)
                .await;
            if let Err(e) = result {
                self.record(Op::Write, done, started, false);
                return Outcome::check(sense_for(&e));
            }
            done += this as u64;
        }
        self.record(Op::Write, length, started, true);
        Outcome::good(Vec::new())
    }

    async fn unmap(&self, params: &[u8]) -> Outcome {
        if params.is_empty() {
            return Outcome::good(Vec::new());
        }
        if params.len() < 8 {
            return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        let descriptor_bytes = u16::from_be_bytes([params[2], params[3]]) as usize;
        let available = (params.len() - 8).min(descriptor_bytes);
        let count = available / 16;
        if count > pages::MAX_UNMAP_DESCRIPTORS as usize {
            return Outcome::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        let mut ranges = Vec::with_capacity(count);
        for descriptor in params[8..8 + count * 16].chunks_exact(16) {
            let mut lba_bytes = [0u8; 8];
            lba_bytes.copy_from_slice(&descriptor[0..8]);
            let lba = u64::from_be_bytes(lba_bytes);
            let blocks = u32::from_be_bytes([descriptor[8], descriptor[9], descriptor[10], descriptor[11]]);
            if let Err(sense) = self.check_lba(lba, blocks) {
                return Outcome::check(sense);
            }
            if blocks > pages::MAX_UNMAP_BLOCKS {
                return Outcome::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
            }
            if blocks > 0 {
                ranges.push((lba, blocks));
            }
        }
        let _shared = self.write_gate.read().await;
        for (lba, blocks) in ranges {
            let started = Instant::now();
            let length = blocks as u64 * BLOCK_BYTES as u64;
            let result = self.volume.trim(lba * BLOCK_BYTES as u64, length, false).await;
            self.record(Op::Trim, length, started, result.is_ok());
            if let Err(e) = result {
                return Outcome::check(sense_for(&e));
            }
        }
        Outcome::good(Vec::new())
    }

    async fn lba_status(&self, lba: u64, alloc_len: u32) -> Outcome {
        let capacity = self.capacity_blocks();
        if lba >= capacity {
            return Outcome::check(Sense::LBA_OUT_OF_RANGE);
        }
        // Ask about at most 1 GiB; the initiator asks again from where we stop.
        let blocks = (capacity - lba).min(1 << 21);
        let started = Instant::now();
        let result = self
            .volume
            .block_status(lba * BLOCK_BYTES as u64, blocks * BLOCK_BYTES as u64)
            .await;
        self.record(Op::BlockStatus, 0, started, result.is_ok());
        let extents = match result {
            Ok(extents) => extents,
            Err(e) => return Outcome::check(sense_for(&e)),
        };
        let max_descriptors = (alloc_len.saturating_sub(8) / 16).clamp(1, 1024) as usize;
        let mut descriptors: Vec<(u64, u64, u8)> = Vec::new();
        let mut at = lba;
        for extent in extents {
            let count = extent.length / BLOCK_BYTES as u64;
            if count == 0 {
                continue;
            }
            let state = if extent.hole { 1 } else { 0 };
            match descriptors.last_mut() {
                Some(last) if last.2 == state => last.1 += count,
                _ => {
                    if descriptors.len() == max_descriptors {
                        break;
                    }
                    descriptors.push((at, count, state));
                }
            }
            at += count;
        }
        let mut data = vec![0u8; 8];
        for (start, count, state) in descriptors {
            data.extend_from_slice(&start.to_be_bytes());
            data.extend_from_slice(&(count.min(u32::MAX as u64) as u32).to_be_bytes());
            data.extend_from_slice(&[state, 0, 0, 0]);
        }
        let length = (data.len() - 4) as u32;
        data[0..4].copy_from_slice(&length.to_be_bytes());
        Outcome::good(allocated(data, alloc_len))
    }

    async fn compare_and_write(&self, lba: u64, blocks: u32, fua: bool, data: Vec<u8>) -> Outcome {
        if let Err(sense) = self.check_lba(lba, blocks) {
            return Outcome::check(sense);
        }
        if blocks == 0 {
            return Outcome::good(Vec::new());
        }
        if blocks > pages::MAX_COMPARE_AND_WRITE_BLOCKS {
            return Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(13, None));
        }
        let half = blocks as usize * BLOCK_BYTES as usize;
        if data.len() != 2 * half {
            return Outcome::check(Sense::INVALID_FIELD_IN_CDB);
        }
        let _exclusive = self.write_gate.write().await;
        let stored = match self.read_range(lba, blocks).await {
            Ok(stored) => stored,
            Err(sense) => return Outcome::check(sense),
        };
        if let Some(at) = first_difference(&stored, &data[..half]) {
            return Outcome::check(Sense::MISCOMPARE_DURING_VERIFY.with_information(at as u64));
        }
        let started = Instant::now();
        let result = self
            .volume
            .write(lba * BLOCK_BYTES as u64, IoBuf::from_vec(data[half..].to_vec()), fua)
            .await;
        self.record(Op::Write, half as u64, started, result.is_ok());
        Outcome::from_result(result)
    }

    fn mode_select(&self, ten: bool, pf: bool, params: &[u8]) -> Outcome {
        if params.is_empty() {
            return Outcome::good(Vec::new());
        }
        if !pf {
            return Outcome::check(Sense::INVALID_FIELD_IN_CDB.in_cdb(1, Some(4)));
        }
        let (header_len, descriptor_len) = if ten {
            if params.len() < 8 {
                return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
            }
            (8, u16::from_be_bytes([params[6], params[7]]) as usize)
        } else {
            if params.len() < 4 {
                return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
            }
            (4, params[3] as usize)
        };
        let mut at = header_len + descriptor_len;
        if at > params.len() {
            return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        let info = self.unit_info();
        let mut new_wce = None;
        while at < params.len() {
            if params.len() - at < 2 {
                return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
            }
            let page = params[at] & 0x3f;
            let subpage_format = params[at] & 0x40 != 0;
            let (subpage, header, len) = if subpage_format {
                if params.len() - at < 4 {
                    return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
                }
                let len = u16::from_be_bytes([params[at + 2], params[at + 3]]) as usize + 4;
                (params[at + 1], 4, len)
            } else {
                (0, 2, params[at + 1] as usize + 2)
            };
            if at + len > params.len() {
                return Outcome::check(Sense::PARAMETER_LIST_LENGTH_ERROR);
            }
            let body = &params[at..at + len];
            let (current, changeable) = match (page, subpage) {
                // Nothing in it is changeable: the same values are accepted,
                // any change is refused (SPC-4 6.11).
                (pages::LBP_PAGE, pages::LBP_SUBPAGE) if subpage_format && info.caps.can_trim => (
                    pages::lbp_page(&info, ModeValues::Current),
                    pages::lbp_page(&info, ModeValues::Changeable),
                ),
                _ if subpage_format => return Outcome::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST),
                (pages::CACHING_PAGE, _) => (
                    pages::caching_page(&info, ModeValues::Current),
                    pages::caching_page(&info, ModeValues::Changeable),
                ),
                (pages::CONTROL_PAGE, _) => (
                    pages::control_page(ModeValues::Current),
                    pages::control_page(ModeValues::Changeable),
                ),
                _ => return Outcome::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST),
            };
            if body.len() != current.len() {
                return Outcome::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
            }
            // Every bit outside the changeable mask must keep its current value.
            for i in header..body.len() {
                if (body[i] ^ current[i]) & !changeable[i] != 0 {
                    return Outcome::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
                }
            }
            if page == pages::CACHING_PAGE {
                new_wce = Some(body[2] & 0x04 != 0);
            }
            at += len;
        }
        if let Some(wce) = new_wce {
            if wce != self.volume.wce() {
                let Some(manager) = &self.manager else {
                    return Outcome::check(Sense::INTERNAL_TARGET_FAILURE);
                };
                let value = if wce { "on" } else { "off" };
                if let Err(e) = manager.set(self.volume.full_name(), &[("wce".into(), value.into())]) {
                    tracing::warn!(
                        "MODE SELECT could not set wce={value} on {}: {e}",
                        self.volume.full_name()
                    );
                    return Outcome::check(Sense::INTERNAL_TARGET_FAILURE);
                }
            }
        }
        Outcome::good(Vec::new())
    }

    fn persistent_reserve_out(
        &self,
        nexus: &Nexus,
        action: u8,
        scope: u8,
        kind: u8,
        param_len: u32,
        params: &[u8],
    ) -> Outcome {
        let mut state = self.state();
        if state.reserve6.is_some() && state.reserve6.as_ref() != Some(nexus) {
            return Outcome::conflict();
        }
        let result = pr::out(&mut state.pr, nexus, action, scope, kind, param_len, params);
        let outcome = match result {
            Ok(notify) => {
                for (target, sense) in notify {
                    push_attention(&mut state, &target, sense);
                }
                if let Err(e) = self.save_reservations(&state.pr) {
                    tracing::warn!("cannot save persistent reservations: {e}");
                }
                Outcome::good(Vec::new())
            }
            Err(pr::Failure::Conflict) => Outcome::conflict(),
            Err(pr::Failure::Sense(sense)) => Outcome::check(sense),
        };
        self.refresh_flags(&state);
        outcome
    }

    fn save_reservations(&self, state: &pr::State) -> std::io::Result<()> {
        let Some(path) = &self.reservations_path else {
            return Ok(());
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let saved = SavedReservations { state: state.clone() };
        let text = serde_json::to_string(&saved).map_err(std::io::Error::other)?;
        let temporary = path.with_extension("json.tmp");
        {
            use std::io::Write;
            let mut file = std::fs::File::create(&temporary)?;
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
        }
        std::fs::rename(&temporary, path)
    }
}

fn push_attention(state: &mut SharedState, nexus: &Nexus, sense: Sense) {
    let queue = state.attentions.entry(nexus.clone()).or_default();
    if queue.len() >= MAX_ATTENTIONS {
        queue.pop_front();
    }
    queue.push_back(sense);
}

/// Offset of the first byte where `a` and `b` differ.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b.iter()).position(|(x, y)| x != y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockDevice, BlockError, BoxFuture, Capabilities, Extent};
    use crate::volume::props::{LogBias, SyncMode, VolumeProps};

    /// A backing whose only behaviour is the backing-space flag.
    struct Backing {
        low: AtomicBool,
    }

    impl BlockDevice for Backing {
        fn capabilities(&self) -> Capabilities {
            Capabilities::thin_for_tests()
        }
        fn size_bytes(&self) -> u64 {
            1 << 20
        }
        fn read(&self, _offset: u64, buf: IoBuf) -> BoxFuture<'_, (IoBuf, BlockResult<()>)> {
            Box::pin(async move { (buf, Err(BlockError::NotSupported("test"))) })
        }
        fn write(&self, _offset: u64, _data: IoBuf, _fua: bool) -> BoxFuture<'_, BlockResult<()>> {
            Box::pin(async { Err(BlockError::NotSupported("test")) })
        }
        fn flush(&self) -> BoxFuture<'_, BlockResult<()>> {
            Box::pin(async { Ok(()) })
        }
        fn trim(&self, _offset: u64, _length: u64, _fua: bool) -> BoxFuture<'_, BlockResult<()>> {
            Box::pin(async { Ok(()) })
        }
        fn write_zeroes(&self, _offset: u64, _length: u64, _flags: ZeroFlags) -> BoxFuture<'_, BlockResult<()>> {
            Box::pin(async { Ok(()) })
        }
        fn cache(&self, _offset: u64, _length: u64) -> BoxFuture<'_, BlockResult<()>> {
            Box::pin(async { Ok(()) })
        }
        fn block_status(&self, _offset: u64, _length: u64) -> BoxFuture<'_, BlockResult<Vec<Extent>>> {
            Box::pin(async { Ok(Vec::new()) })
        }
        fn resize(&self, _new_size_bytes: u64) -> BlockResult<()> {
            Ok(())
        }
        fn backing_space_low(&self) -> bool {
            self.low.load(Ordering::Relaxed)
        }
    }

    fn run(unit: &LogicalUnit, nexus: &Nexus, command: Command, data_out: Vec<u8>) -> Outcome {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(unit.execute(nexus, &command, data_out))
    }

    fn tur(unit: &LogicalUnit, nexus: &Nexus) -> Option<Sense> {
        run(unit, nexus, Command::TestUnitReady, Vec::new()).sense
    }

    fn unit(backing: Arc<Backing>) -> LogicalUnit {
        let props = VolumeProps {
            volsize: 1 << 20,
            volblocksize: 4096,
            sync: SyncMode::Standard,
            logbias: LogBias::Latency,
            wce: true,
        };
        let volume = Arc::new(ServedVolume::new("tank", "vol", backing, &props));
        LogicalUnit::new(volume, None, "iqn.test:tank.vol")
    }

    #[test]
    fn lbp_mode_page_is_sensed_and_refuses_changes() {
        let unit = unit(Arc::new(Backing {
            low: AtomicBool::new(false),
        }));
        let nexus: Nexus = "a".into();
        unit.attach(&nexus);
        let sense = |page, subpage| Command::ModeSense {
            ten: false,
            dbd: true,
            llbaa: false,
            pc: PageControl::Current,
            page,
            subpage,
            alloc_len: 255,
        };
        let outcome = run(&unit, &nexus, sense(0x1c, 0x02), Vec::new());
        assert_eq!(outcome.status, status::GOOD);
        let page = outcome.data[4..].to_vec();
        assert_eq!((page[0], page[1], page.len()), (0x5c, 0x02, 24));
        // A subpage we lack points at the SUBPAGE CODE; a page we lack
        // (0x1c subpage 0 is informational exceptions control) at the PAGE CODE.
        let refused = run(&unit, &nexus, sense(0x08, 0x01), Vec::new());
        assert_eq!(refused.sense, Some(Sense::INVALID_FIELD_IN_CDB.in_cdb(3, None)));
        let refused = run(&unit, &nexus, sense(0x1c, 0x00), Vec::new());
        assert_eq!(refused.sense, Some(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(5))));
        // MODE SELECT(6): the page as it is is accepted, a change is not.
        let select = |page: &[u8]| {
            let mut params = vec![0u8; 4];
            params.extend_from_slice(page);
            let command = Command::ModeSelect {
                ten: false,
                pf: true,
                sp: false,
                param_len: params.len() as u32,
            };
            run(&unit, &nexus, command, params)
        };
        assert_eq!(select(&page).status, status::GOOD);
        let mut changed = page.clone();
        changed[4] |= 0x01; // SITUA
        assert_eq!(select(&changed).sense, Some(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
        let mut changed = page.clone();
        changed[23] ^= 0x01; // THRESHOLD COUNT
        assert_eq!(select(&changed).sense, Some(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
        assert_eq!(
            select(&page[..20]).sense,
            Some(Sense::PARAMETER_LIST_LENGTH_ERROR),
            "shorter than its PAGE LENGTH"
        );
    }

    #[test]
    fn soft_threshold_attention_reaches_every_nexus_once_per_crossing() {
        let backing = Arc::new(Backing {
            low: AtomicBool::new(false),
        });
        let unit = unit(backing.clone());
        let (a, b): (Nexus, Nexus) = ("a".into(), "b".into());
        unit.attach(&a);
        unit.attach(&b);
        assert_eq!(tur(&unit, &a), None);
        let soft = Some(Sense::THIN_PROVISIONING_SOFT_THRESHOLD_REACHED);
        for _ in 0..2 {
            backing.low.store(true, Ordering::Relaxed);
            assert_eq!(tur(&unit, &a), soft);
            assert_eq!(tur(&unit, &a), None, "once");
            // INQUIRY does not report it; the next other command does.
            let inquiry = Command::Inquiry {
                evpd: false,
                page: 0,
                alloc_len: 96,
            };
            assert_eq!(run(&unit, &b, inquiry, Vec::new()).status, status::GOOD);
            assert_eq!(tur(&unit, &b), soft);
            assert_eq!(tur(&unit, &b), None);
            // A nexus that logs in later does not get it.
            let c: Nexus = "c".into();
            unit.attach(&c);
            assert_eq!(tur(&unit, &c), None);
            unit.detach(&c);
            // Still low: nothing new. Cleared: nothing. Back: raised again.
            assert_eq!(tur(&unit, &a), None);
            backing.low.store(false, Ordering::Relaxed);
            assert_eq!(tur(&unit, &a), None);
            assert_eq!(tur(&unit, &b), None);
        }
        let fixed = Sense::THIN_PROVISIONING_SOFT_THRESHOLD_REACHED.to_fixed();
        assert_eq!((fixed[2], fixed[12], fixed[13]), (0x6, 0x38, 0x07));
        assert_eq!(&fixed[3..7], &[0, 0, 0, 16], "INFORMATION: the descriptor's offset");
    }
}
