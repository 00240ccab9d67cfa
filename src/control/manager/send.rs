//! Send and receive of snapshots (`strata send`, `strata receive`): the
//! daemon's side. A send reads a snapshot (read-only, held open so it
//! cannot be deleted meanwhile) and produces the stream of
//! `control::stream`; a receive applies one to a volume that nobody sees
//! until the END record checks out. The design is in ARCHITECTURE.md
//! ("Send and receive"), the stream in docs/FORMAT.md.
//!
//! What is persisted of a receive is its `ReceiveRecord` in the catalog
//! (the stream's identity, the offset of the last record applied and
//! flushed, the CRC so far): the volume is hidden while it is set. An
//! interruption (truncated stream, lost connection, daemon killed) keeps
//! it, so `send -t TOKEN | receive --resume TOKEN` goes on from there; a
//! stream that is corrupt or out of order is refused and what it wrote is
//! discarded at once (a new volume destroyed, an existing one rolled back
//! to the base snapshot); `receive --abort` discards a pending one.

use super::*;
use crate::block::{BlockDevice, BlockError};
use crate::control::catalog::ReceiveRecord;
use crate::control::stream::{
    self, end_payload, Accepted, Header, PlannedRecord, Position, RecordHeader, RecordKind, StreamError, StreamKind,
    END_PAYLOAD_BYTES, RECORD_HEADER_BYTES,
};
use crate::device::{IoBuf, ReadBuffers};
use crate::pool::snapshots::{SnapshotInfo, SnapshotRequest};
use hyper::body::Bytes;
use std::collections::{HashSet, VecDeque};
use tokio::sync::mpsc;

/// Reads (send) and writes (receive) kept in flight.
const IN_FLIGHT: usize = 8;
/// A receive flushes and records its progress at least this often.
const PROGRESS_BYTES: u64 = 64 << 20;
const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// Receives running in this process, by target name (a second one into
/// the same volume is refused).
static RUNNING: Mutex<Option<HashSet<String>>> = Mutex::new(None);

struct Running(String);

impl Running {
    fn claim(name: &str) -> Result<Running, AdminError> {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if !running.get_or_insert_with(HashSet::new).insert(name.to_string()) {
            return Err(AdminError::Busy(format!("a receive into '{name}' is already running")));
        }
        Ok(Running(name.to_string()))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(running) = RUNNING.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            running.remove(&self.0);
        }
    }
}

/// A snapshot's identity: stable across send and receive (a received
/// snapshot keeps its source's, recorded in the catalog), derived from the
/// pool's uuid, the snapshot's id, generation and creation time otherwise.
pub fn snapshot_guid(record: &PoolRecord, info: &SnapshotInfo) -> u64 {
    if let Some(guid) = record.snapshot_guids.get(&info.id) {
        return *guid;
    }
    let uuid = record.uuid.as_bytes();
    let id = info.id.to_le_bytes();
    let generation = info.generation.to_le_bytes();
    let created = info.created_unix.to_le_bytes();
    let high = crc32c::crc32c_append(crc32c::crc32c_append(crc32c::crc32c(uuid), &id), &generation);
    let low = crc32c::crc32c_append(crc32c::crc32c_append(crc32c::crc32c(&created), &id), uuid);
    ((high as u64) << 32 | low as u64).max(1)
}

/// What a resume token carries: where the receive stopped, and what the
/// sender needs to produce the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeToken {
    pub v: u32,
    /// The receiving `POOL/VOLUME`.
    pub target: String,
    /// The sending `POOL/VOLUME`, snapshot and base (empty for full).
    pub source: String,
    pub snapshot: String,
    pub base: String,
    pub guid: u64,
    pub base_guid: u64,
    pub offset: u64,
    pub crc: u32,
}

impl ResumeToken {
    /// Hex of: version (1 byte), guid, base guid, offset (u64 LE), crc
    /// (u32 LE), target, source, snapshot and base (a length byte and
    /// UTF-8 each), then the CRC-32C of all that (u32 LE).
    pub fn encode(&self) -> String {
        let mut bytes = vec![self.v as u8];
        bytes.extend_from_slice(&self.guid.to_le_bytes());
        bytes.extend_from_slice(&self.base_guid.to_le_bytes());
        bytes.extend_from_slice(&self.offset.to_le_bytes());
        bytes.extend_from_slice(&self.crc.to_le_bytes());
        for text in [&self.target, &self.source, &self.snapshot, &self.base] {
            let text = &text.as_bytes()[..text.len().min(255)];
            bytes.push(text.len() as u8);
            bytes.extend_from_slice(text);
        }
        let crc = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn decode(text: &str) -> Result<ResumeToken, AdminError> {
        let bad = || AdminError::Invalid("invalid resume token (copy it whole from the receive's message)".into());
        let text = text.trim();
        if !text.len().is_multiple_of(2) || text.len() > 4096 {
            return Err(bad());
        }
        let bytes: Vec<u8> = (0..text.len())
            .step_by(2)
            .map(|i| text.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(bad)?;
        let body = bytes.len().checked_sub(4).ok_or_else(bad)?;
        if crate::bytes::u32_at(&bytes, body) != Some(crc32c::crc32c(&bytes[..body])) || bytes[0] != 1 {
            return Err(bad());
        }
        let mut at = 29;
        let mut texts = Vec::with_capacity(4);
        for _ in 0..4 {
            let len = *bytes.get(at).ok_or_else(bad)? as usize;
            let text = bytes
                .get(at + 1..at + 1 + len)
                .filter(|_| at + 1 + len <= body)
                .ok_or_else(bad)?;
            texts.push(String::from_utf8(text.to_vec()).map_err(|_| bad())?);
            at += 1 + len;
        }
        if at != body {
            return Err(bad());
        }
        let base = texts.pop().unwrap_or_default();
        let snapshot = texts.pop().unwrap_or_default();
        let source = texts.pop().unwrap_or_default();
        let target = texts.pop().unwrap_or_default();
        Ok(ResumeToken {
            v: 1,
            guid: crate::bytes::u64_at(&bytes, 1).ok_or_else(bad)?,
            base_guid: crate::bytes::u64_at(&bytes, 9).ok_or_else(bad)?,
            offset: crate::bytes::u64_at(&bytes, 17).ok_or_else(bad)?,
            crc: crate::bytes::u32_at(&bytes, 25).ok_or_else(bad)?,
            target,
            source,
            snapshot,
            base,
        })
    }

    fn of(target: &str, state: &ReceiveRecord) -> ResumeToken {
        ResumeToken {
            v: 1,
            target: target.to_string(),
            source: state.source.clone(),
            snapshot: state.snapshot.clone(),
            base: state.base.clone(),
            guid: state.guid,
            base_guid: state.base_guid,
            offset: state.offset,
            crc: state.crc,
        }
    }
}

/// A receive's place in its stream, as the stream's checks keep it.
trait Progress {
    fn position(&self) -> Position;
    fn advance_to(&mut self, position: Position);
}

impl Progress for ReceiveRecord {
    fn position(&self) -> Position {
        Position {
            offset: self.offset,
            crc: self.crc,
            records: self.records,
            data_bytes: self.data_bytes,
            volume_end: self.volume_end,
        }
    }

    fn advance_to(&mut self, position: Position) {
        self.offset = position.offset;
        self.crc = position.crc;
        self.records = position.records;
        self.data_bytes = position.data_bytes;
        self.volume_end = position.volume_end;
    }
}

/// A stream ready to be produced ([`SendJob::run`]).
pub struct SendJob {
    header: Vec<u8>,
    records: Vec<PlannedRecord>,
    /// The first record to send (a continuation skips the others).
    first: usize,
    /// CRC-32C of the original stream up to the first record sent.
    crc: u32,
    /// All records' count and WRITE bytes (END carries them).
    total_records: u64,
    total_data: u64,
    /// The snapshot's read-only volume, held open (a snapshot with open
    /// handles cannot be deleted).
    volume: Arc<ServedVolume>,
    _handle: crate::volume::HandleGuard,
    /// Bytes this response carries.
    pub body_bytes: u64,
}

/// A pending receive, as `receive --status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiveStatus {
    pub name: String,
    pub source: String,
    pub snapshot: String,
    pub base: String,
    pub received_bytes: u64,
    pub stream_bytes: u64,
    pub token: String,
}

/// How a receive ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiveOutcome {
    /// `POOL/VOLUME@SNAPSHOT` received.
    pub name: String,
    pub stream_bytes: u64,
    pub data_bytes: u64,
    pub records: u64,
}

/// A receive that did not finish: why, and the token to resume it with
/// when it can be resumed.
#[derive(Debug)]
pub struct ReceiveFailure {
    pub error: AdminError,
    pub token: Option<String>,
}

impl From<AdminError> for ReceiveFailure {
    fn from(error: AdminError) -> Self {
        ReceiveFailure { error, token: None }
    }
}

/// The body of a stream as it arrives.
pub type Chunks = mpsc::Receiver<Result<Bytes, String>>;

/// How reading the stream went wrong.
enum Broken {
    /// The stream is bad: refuse it and discard what it wrote.
    Bad(StreamError),
    /// It stopped (truncated, connection lost): keep what is applied.
    Interrupted(String),
    /// Applying it failed here (space, I/O): keep what is durable.
    Local(AdminError),
}

/// Bytes received and not yet parsed.
struct Input {
    chunks: Chunks,
    buffer: Vec<u8>,
    at: usize,
    ended: bool,
}

impl Input {
    /// Makes at least `n` bytes available at `self.at`; `Ok(false)` if the
    /// stream ended first.
    async fn fill(&mut self, n: usize) -> Result<bool, Broken> {
        while self.buffer.len() - self.at < n {
            if self.ended {
                return Ok(false);
            }
            if self.at > 0 {
                self.buffer.drain(..self.at);
                self.at = 0;
            }
            match self.chunks.recv().await {
                Some(Ok(bytes)) => self.buffer.extend_from_slice(&bytes),
                Some(Err(e)) => return Err(Broken::Interrupted(e)),
                None => self.ended = true,
            }
        }
        Ok(true)
    }

    fn take(&mut self, n: usize) -> &[u8] {
        let slice = &self.buffer[self.at..self.at + n];
        self.at += n;
        slice
    }
}

fn not_found(name: &str) -> AdminError {
    AdminError::NotFound(format!("snapshot '{name}' does not exist"))
}

impl VolumeManager {
    /// Plans the stream of snapshot `POOL/VOL@SNAP`: all it maps, or (with
    /// `from`, `@A` or `POOL/VOL@A`) what changed since snapshot A; with a
    /// resume token, the rest of the stream it names.
    pub fn plan_send(&self, name: &str, from: Option<&str>, token: Option<&str>) -> Result<SendJob, AdminError> {
        // The snapshot named must exist, token or not (404 before 400).
        {
            let (pool_name, short, _) = split_snapshot_name(name)?;
            let catalog = self.catalog();
            let record = catalog.pools.get(pool_name).ok_or_else(|| not_found(name))?;
            let volume_record = record.volumes.get(short).ok_or_else(|| not_found(name))?;
            let pool = self.pool(pool_name).ok_or_else(|| not_found(name))?;
            snapshot_named(&pool, volume_record.id, name)?;
        }
        // An empty token is none (`?resume=`).
        let token = token.map(str::trim).filter(|token| !token.is_empty());
        let token = token.map(ResumeToken::decode).transpose()?;
        let (name, from) = match &token {
            Some(token) => {
                let named = format!("{}@{}", token.source, token.snapshot);
                if named != name {
                    return Err(AdminError::Invalid(format!(
                        "the resume token continues a stream of '{named}', not of '{name}'"
                    )));
                }
                (named, (!token.base.is_empty()).then(|| token.base.clone()))
            }
            None => (name.to_string(), from.map(str::to_string)),
        };
        let (pool_name, short, _) = split_snapshot_name(&name)?;
        let volume_name = full_name(pool_name, short);
        let catalog = self.catalog();
        let record = catalog.pools.get(pool_name).ok_or_else(|| not_found(&name))?;
        let volume_record = record.volumes.get(short).ok_or_else(|| not_found(&name))?;
        if volume_record.receiving.is_some() {
            return Err(AdminError::Busy(format!("volume '{volume_name}' is being received")));
        }
        let pool = self.pool(pool_name).ok_or_else(|| not_found(&name))?;
        let info = snapshot_named(&pool, volume_record.id, &name)?;
        let base = match &from {
            Some(from) => {
                let short_base = from.rsplit_once('@').map_or(from.as_str(), |(volume, snapshot)| {
                    if !volume.is_empty() && volume != volume_name {
                        ""
                    } else {
                        snapshot
                    }
                });
                if short_base.is_empty() {
                    return Err(AdminError::Invalid(format!(
                        "-i {from}: the base must be a snapshot of '{volume_name}' (@SNAP)"
                    )));
                }
                let base_name = format!("{volume_name}@{short_base}");
                let base = snapshot_named(&pool, volume_record.id, &base_name)?;
                if base.generation >= info.generation {
                    return Err(AdminError::Invalid(format!(
                        "-i {from}: @{short_base} is not older than @{}",
                        info.name
                    )));
                }
                Some(base)
            }
            None => None,
        };
        let guid = snapshot_guid(record, &info);
        let base_guid = base.as_ref().map_or(0, |b| snapshot_guid(record, b));
        if let Some(token) = &token {
            if token.guid != guid || token.base_guid != base_guid {
                return Err(AdminError::Invalid(format!(
                    "the resume token is for another stream: '{name}' is no longer the snapshot it was sent from"
                )));
            }
        }
        let volblocksize = volume_record.props.volblocksize;
        let blocks = info.size_bytes.div_ceil(volblocksize as u64);
        // Cached writes that belong to the snapshot reach the map first
        // (the plan is made from the maps).
        self.runtime
            .block_on(pool.place_before(info.volume, info.cache_seq))
            .map_err(|e| internal("cannot place the snapshot's cached writes", e))?;
        let extents = pool
            .send_extents(base.as_ref().map(|b| b.id), info.id, blocks)
            .map_err(|e| internal("cannot read the snapshot's map", e))?;
        let records = stream::records(&extents, volblocksize, info.size_bytes);
        let mut header = Header {
            kind: if base.is_some() {
                StreamKind::Incremental
            } else {
                StreamKind::Full
            },
            resume_offset: None,
            volsize: info.size_bytes,
            volblocksize,
            guid,
            base_guid,
            created_unix: info.created_unix,
            stream_bytes: 0,
            pool_uuid: record.uuid.clone(),
            volume: volume_name.clone(),
            snapshot: info.name.clone(),
            base: base.as_ref().map(|b| b.name.clone()).unwrap_or_default(),
        };
        let header_bytes = header.encode().len();
        header.stream_bytes = stream::stream_bytes(header_bytes, &records);
        let total_records = records.len() as u64;
        let total_data = records.iter().filter(|r| r.0 == RecordKind::Write).map(|r| r.2).sum();
        let (encoded, first, crc) = match &token {
            None => {
                let encoded = header.encode();
                let crc = crc32c::crc32c(&encoded);
                (encoded, 0, crc)
            }
            Some(token) => {
                // The record that starts at the token's offset.
                let mut at = header_bytes as u64;
                let mut first = None;
                for (i, (kind, _, length)) in records.iter().enumerate() {
                    if at == token.offset {
                        first = Some(i);
                        break;
                    }
                    at += RECORD_HEADER_BYTES as u64 + if *kind == RecordKind::Write { *length } else { 0 };
                }
                let first = match first {
                    Some(i) => i,
                    None if at == token.offset => records.len(),
                    None => {
                        return Err(AdminError::Invalid(format!(
                            "the resume token's offset {} is not a record boundary of this stream",
                            token.offset
                        )))
                    }
                };
                header.resume_offset = Some(token.offset);
                (header.encode(), first, token.crc)
            }
        };
        drop(catalog);
        let body_bytes = encoded.len() as u64
            + records[first..]
                .iter()
                .map(|(kind, _, length)| {
                    RECORD_HEADER_BYTES as u64 + if *kind == RecordKind::Write { *length } else { 0 }
                })
                .sum::<u64>()
            + (RECORD_HEADER_BYTES + END_PAYLOAD_BYTES) as u64;
        let volume = self.snapshot_volume(&name).ok_or_else(|| not_found(&name))?;
        let handle = volume.open_handle();
        Ok(SendJob {
            header: encoded,
            records,
            first,
            crc,
            total_records,
            total_data,
            volume,
            _handle: handle,
            body_bytes,
        })
    }

    /// The state of a pending (interrupted) receive into `POOL/VOL`.
    pub fn receive_status(&self, name: &str) -> Result<ReceiveStatus, AdminError> {
        let (pool, short) = split_volume_name(name)?;
        let catalog = self.published();
        let state = catalog
            .pools
            .get(pool)
            .and_then(|p| p.volumes.get(short))
            .and_then(|v| v.receiving.clone())
            .ok_or_else(|| AdminError::NotFound(format!("no receive into '{name}' is pending")))?;
        Ok(ReceiveStatus {
            name: name.to_string(),
            source: state.source.clone(),
            snapshot: state.snapshot.clone(),
            base: state.base.clone(),
            received_bytes: state.offset,
            stream_bytes: state.stream_bytes,
            token: ResumeToken::of(name, &state).encode(),
        })
    }

    /// Discards a pending receive into `POOL/VOL`: a volume being created
    /// is destroyed, an existing one rolled back to the base snapshot.
    pub async fn abort_receive(self: &Arc<Self>, name: &str) -> Result<(), AdminError> {
        let _running = Running::claim(name)?;
        self.discard(name).await
    }

    async fn discard(self: &Arc<Self>, name: &str) -> Result<(), AdminError> {
        let (pool_name, short) = split_volume_name(name)?;
        let (state, id) = {
            let catalog = self.published();
            let record = catalog
                .pools
                .get(pool_name)
                .and_then(|p| p.volumes.get(short))
                .ok_or_else(|| AdminError::NotFound(format!("no receive into '{name}' is pending")))?;
            let state = record
                .receiving
                .clone()
                .ok_or_else(|| AdminError::NotFound(format!("no receive into '{name}' is pending")))?;
            (state, record.id)
        };
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let engine = self
            .engines
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned();
        match (state.kind, state.base_id, engine) {
            (StreamKind::Incremental, Some(base), Some(engine)) => {
                // A snapshot taken by a receive that ended just before a
                // crash, not yet recorded, goes first.
                for newer in pool.snapshots().iter().filter(|s| s.volume == id && s.id > base) {
                    pool.destroy_snapshot(newer.id)
                        .await
                        .map_err(|e| internal("abort", e))?;
                }
                pool.rollback(&engine, base)
                    .await
                    .map_err(|e| internal("cannot roll back to the base snapshot", e))?;
                self.finish_catalog(name, None).await?;
                tracing::info!("receive into {name} aborted: rolled back to @{}", state.base);
            }
            _ => {
                for snapshot in pool.snapshots().iter().filter(|s| s.volume == id) {
                    pool.destroy_snapshot(snapshot.id)
                        .await
                        .map_err(|e| internal("abort", e))?;
                }
                let manager = self.clone();
                let target = name.to_string();
                tokio::task::spawn_blocking(move || {
                    let mut catalog = manager.catalog();
                    let mut updated = catalog.clone();
                    if let Some(p) = updated.pools.get_mut(pool_name_of(&target)) {
                        p.volumes.remove(short_name_of(&target));
                    }
                    updated
                        .save(&manager.data_dir)
                        .map_err(|e| internal("cannot save catalog", e))?;
                    catalog.set(updated);
                    manager
                        .engines
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&target);
                    Ok::<(), AdminError>(())
                })
                .await
                .map_err(|e| internal("abort", e))??;
                pool.destroy_volume(id)
                    .await
                    .map_err(|e| internal("cannot free the partly received volume", e))?;
                tracing::info!("receive into {name} aborted: the partly received volume is destroyed");
            }
        }
        Ok(())
    }

    /// Clears `name`'s receive state (recording `guid` for its received
    /// snapshot `snapshot_id`) and exports the volume again.
    async fn finish_catalog(self: &Arc<Self>, name: &str, received: Option<(u32, u64)>) -> Result<(), AdminError> {
        let manager = self.clone();
        let name = name.to_string();
        tokio::task::spawn_blocking(move || {
            let (pool, short) = split_volume_name(&name)?;
            let mut catalog = manager.catalog();
            let mut updated = catalog.clone();
            let pool_record = updated
                .pools
                .get_mut(pool)
                .ok_or_else(|| AdminError::NotFound(format!("pool '{pool}' does not exist")))?;
            if let Some((id, guid)) = received {
                pool_record.snapshot_guids.insert(id, guid);
            }
            let record = pool_record
                .volumes
                .get_mut(short)
                .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?;
            record.receiving = None;
            let props = record.props.effective();
            updated
                .save(&manager.data_dir)
                .map_err(|e| internal("cannot save catalog", e))?;
            catalog.set(updated);
            let engine = manager
                .engines
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(&name)
                .cloned();
            if let Some(engine) = engine {
                let volume = ServedVolume::new(pool, short, engine, &props);
                manager
                    .volumes
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.clone(), Arc::new(volume));
            }
            Ok(())
        })
        .await
        .map_err(|e| internal("receive", e))?
    }

    /// Records a receive's progress (or its start) in the catalog.
    async fn save_progress(self: &Arc<Self>, name: &str, state: &ReceiveRecord) -> Result<(), AdminError> {
        let manager = self.clone();
        let name = name.to_string();
        let state = state.clone();
        tokio::task::spawn_blocking(move || {
            let (pool, short) = split_volume_name(&name)?;
            let mut catalog = manager.catalog();
            let mut updated = catalog.clone();
            let record = updated
                .pools
                .get_mut(pool)
                .and_then(|p| p.volumes.get_mut(short))
                .ok_or_else(|| AdminError::NotFound(format!("volume '{name}' does not exist")))?;
            record.receiving = Some(state);
            updated
                .save(&manager.data_dir)
                .map_err(|e| internal("cannot save catalog", e))?;
            catalog.set(updated);
            Ok(())
        })
        .await
        .map_err(|e| internal("receive", e))?
    }

    /// At start-up: a receive whose snapshot exists finished just before
    /// the daemon stopped (the snapshot is taken only after END checked
    /// out) and is completed now; the others stay pending, resumable.
    pub(super) async fn settle_receives(&self) {
        let pending: Vec<(String, u32, ReceiveRecord)> = self
            .catalog()
            .pools
            .iter()
            .flat_map(|(pool, p)| {
                p.volumes
                    .iter()
                    .filter_map(move |(name, v)| v.receiving.clone().map(|state| (full_name(pool, name), v.id, state)))
            })
            .collect();
        for (name, id, state) in pending {
            let Some(pool) = self.pool(pool_name_of(&name)) else {
                continue;
            };
            let done = pool
                .snapshots()
                .into_iter()
                .find(|s| s.volume == id && s.name == state.snapshot && state.base_id.is_none_or(|base| s.id > base));
            match done {
                Some(info) => {
                    let mut catalog = self.catalog();
                    let mut updated = catalog.clone();
                    let Some(record) = updated.pools.get_mut(pool_name_of(&name)) else { continue };
                    record.snapshot_guids.insert(info.id, state.guid);
                    let Some(volume) = record.volumes.get_mut(short_name_of(&name)) else { continue };
                    volume.receiving = None;
                    let props = volume.props.effective();
                    if let Err(e) = updated.save(&self.data_dir) {
                        tracing::error!("cannot record the receive into {name}: {e}");
                        continue;
                    }
                    catalog.set(updated);
                    let engine = self.engines.read().unwrap_or_else(|e| e.into_inner()).get(&name).cloned();
                    if let Some(engine) = engine {
                        let volume = ServedVolume::new(pool_name_of(&name), short_name_of(&name), engine, &props);
                        self.volumes
                            .write()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(name.clone(), Arc::new(volume));
                    }
                    tracing::info!("the receive into {name} had finished: {name}@{} recorded", state.snapshot);
                }
                None => tracing::warn!(
                    "the receive into {name} was interrupted at {} of {} bytes; resume it (strata receive --status {name} shows the token) or discard it (strata receive --abort {name})",
                    state.offset,
                    state.stream_bytes
                ),
            }
        }
    }

    /// Receives a stream into `POOL/VOL` (`resume`: the continuation of a
    /// pending receive). Nothing is visible until END checks out.
    pub async fn receive(
        self: &Arc<Self>,
        name: &str,
        resume: bool,
        chunks: Chunks,
    ) -> Result<ReceiveOutcome, ReceiveFailure> {
        let (pool_name, short) = split_volume_name(name)?;
        // The pool must exist before the stream is read (404 before 400).
        if self.pool(pool_name).is_none() {
            return Err(AdminError::NotFound(format!("pool '{pool_name}' does not exist")).into());
        }
        let _running = Running::claim(name)?;
        let mut input = Input {
            chunks,
            buffer: Vec::with_capacity(4 << 20),
            at: 0,
            ended: false,
        };
        let refused = |e: StreamError| ReceiveFailure::from(AdminError::Invalid(e.to_string()));
        // The header: nothing is touched until it checks out.
        let header = match self.read_header(&mut input).await {
            Ok(header) => header,
            Err(Broken::Bad(e)) => return Err(refused(e)),
            Err(Broken::Interrupted(e)) => {
                return Err(AdminError::Invalid(format!("truncated send stream: {e}")).into())
            }
            Err(Broken::Local(e)) => return Err(e.into()),
        };
        let (mut state, engine, stream_start) = self.begin(name, pool_name, short, &header, resume).await?;
        let result = self
            .apply(&mut input, &header, &mut state, &engine, stream_start, name)
            .await;
        match result {
            Ok(()) => {}
            Err(Broken::Bad(e)) => {
                let message = e.to_string();
                if let Err(discard) = self.discard(name).await {
                    tracing::error!("receive into {name}: refused ({message}), and discarding failed: {discard}");
                }
                return Err(AdminError::Invalid(format!("{message}; nothing was received")).into());
            }
            Err(Broken::Interrupted(why)) => {
                let token = ResumeToken::of(name, &state).encode();
                return Err(ReceiveFailure {
                    error: AdminError::Invalid(format!(
                        "the send stream stopped at {} of {} bytes ({why}); the receive can be resumed",
                        state.offset, state.stream_bytes
                    )),
                    token: Some(token),
                });
            }
            Err(Broken::Local(e)) => {
                let token = ResumeToken::of(name, &state).encode();
                return Err(ReceiveFailure {
                    error: e,
                    token: Some(token),
                });
            }
        }
        // END checked out and everything is flushed: the snapshot, then the
        // volume becomes visible.
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}'")))?;
        let taken = pool
            .create_snapshots(&[SnapshotRequest {
                volume: &engine,
                name: header.snapshot.clone(),
            }])
            .await
            .map_err(|e| internal("cannot take the received snapshot", e))?;
        let id = taken.first().map(|s| s.id).unwrap_or(0);
        self.finish_catalog(name, Some((id, header.guid))).await?;
        tracing::info!(
            "received {name}@{} ({} bytes of stream, {} of data)",
            header.snapshot,
            state.offset,
            state.data_bytes
        );
        Ok(ReceiveOutcome {
            name: format!("{name}@{}", header.snapshot),
            stream_bytes: state.offset,
            data_bytes: state.data_bytes,
            records: state.records,
        })
    }

    async fn read_header(&self, input: &mut Input) -> Result<Header, Broken> {
        if !input.fill(16).await? {
            let got = input.buffer.len() - input.at;
            return Err(Broken::Bad(if got == 0 {
                StreamError::Truncated("the stream is empty".into())
            } else {
                StreamError::Truncated(format!("{got} bytes, shorter than a header"))
            }));
        }
        let length = Header::length(&input.buffer[input.at..input.at + 16]).map_err(Broken::Bad)?;
        if !input.fill(length).await? {
            return Err(Broken::Bad(StreamError::Truncated("the header is cut short".into())));
        }
        Header::decode(input.take(length)).map_err(Broken::Bad)
    }

    /// Checks the header against the target and sets the receive up: a new
    /// hidden volume (full), the existing volume hidden (incremental), or
    /// the pending receive (continuation). Returns its state, the engine
    /// volume, and the stream offset the records start at.
    async fn begin(
        self: &Arc<Self>,
        name: &str,
        pool_name: &str,
        short: &str,
        header: &Header,
        resume: bool,
    ) -> Result<(ReceiveRecord, Arc<EngineVolume>, u64), ReceiveFailure> {
        let invalid = |m: String| ReceiveFailure::from(AdminError::Invalid(m));
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let header_bytes = header.encode();
        let existing = {
            let catalog = self.published();
            catalog
                .pools
                .get(pool_name)
                .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?
                .volumes
                .get(short)
                .cloned()
        };
        // A continuation goes on where the pending receive stopped.
        if let Some(offset) = header.resume_offset {
            let state = existing
                .and_then(|r| r.receiving)
                .ok_or_else(|| invalid(format!("no receive into '{name}' is pending to resume")))?;
            if state.guid != header.guid || state.base_guid != header.base_guid {
                return Err(invalid(format!(
                    "this stream is not the rest of the receive pending in '{name}' (that one is {}@{})",
                    state.source, state.snapshot
                )));
            }
            if state.offset != offset {
                return Err(invalid(format!(
                    "this continuation starts at byte {offset}, but the receive into '{name}' stopped at byte {}: use its current token (strata receive --status {name})",
                    state.offset
                )));
            }
            let engine = self
                .engines
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(name)
                .cloned()
                .ok_or_else(|| AdminError::Internal(format!("volume '{name}' is not open")))?;
            return Ok((state, engine, offset));
        }
        if resume {
            return Err(invalid(
                "--resume needs a continuation stream: strata send -t TOKEN".to_string(),
            ));
        }
        if let Some(pending) = existing.as_ref().and_then(|r| r.receiving.as_ref()) {
            return Err(ReceiveFailure::from(AdminError::Busy(format!(
                "a receive into '{name}' is pending ({}@{}, {} of {} bytes): resume it (strata receive --status {name} shows the token) or discard it (strata receive --abort {name})",
                pending.source, pending.snapshot, pending.offset, pending.stream_bytes
            ))));
        }
        let mut state = ReceiveRecord {
            kind: header.kind,
            source: header.volume.clone(),
            snapshot: header.snapshot.clone(),
            base: header.base.clone(),
            guid: header.guid,
            base_guid: header.base_guid,
            base_id: None,
            stream_bytes: header.stream_bytes,
            offset: header_bytes.len() as u64,
            crc: crc32c::crc32c(&header_bytes),
            records: 0,
            data_bytes: 0,
            volume_end: 0,
        };
        crate::meta::log::MAX_SNAPSHOT_NAME
            .checked_sub(header.snapshot.len())
            .ok_or_else(|| invalid(format!("the stream's snapshot name '{}' is too long", header.snapshot)))?;
        validate_component("snapshot", &header.snapshot)?;
        match header.kind {
            StreamKind::Full => {
                if existing.is_some() {
                    return Err(ReceiveFailure::from(AdminError::AlreadyExists(format!(
                        "volume '{name}' already exists: a full stream makes a new volume (for an update, send an incremental stream with -i)"
                    ))));
                }
                check_volsize(header.volsize, header.volblocksize)?;
                let manager = self.clone();
                let (pool_owned, short_owned) = (pool_name.to_string(), short.to_string());
                let state_saved = state.clone();
                let volblocksize = header.volblocksize;
                let volsize = header.volsize;
                let id = tokio::task::spawn_blocking(move || {
                    let mut catalog = manager.catalog();
                    let mut updated = catalog.clone();
                    super::check_target_name_free(&updated, &pool_owned, &short_owned)?;
                    let record = updated
                        .pools
                        .get_mut(&pool_owned)
                        .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_owned}' does not exist")))?;
                    if record.volumes.contains_key(&short_owned) {
                        return Err(AdminError::AlreadyExists(format!(
                            "volume '{pool_owned}/{short_owned}' already exists"
                        )));
                    }
                    let id = record.next_volume_id.max(1);
                    record.next_volume_id = id + 1;
                    record.volumes.insert(
                        short_owned,
                        VolumeRecord {
                            id,
                            created_unix: now_unix(),
                            props: StoredProps {
                                volsize,
                                volblocksize,
                                local: Default::default(),
                            },
                            receiving: Some(state_saved),
                        },
                    );
                    updated
                        .save(&manager.data_dir)
                        .map_err(|e| internal("cannot save catalog", e))?;
                    catalog.set(updated);
                    Ok(id)
                })
                .await
                .map_err(|e| internal("receive", e))??;
                let engine = match pool.open_volume(id, header.volsize, header.volblocksize) {
                    Ok(engine) => engine,
                    Err(e) => {
                        let _ = self.discard(name).await;
                        return Err(invalid(format!("cannot make volume '{name}': {e}")));
                    }
                };
                self.engines
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.to_string(), engine.clone());
                let start = state.offset;
                Ok((state, engine, start))
            }
            StreamKind::Incremental => {
                let record = existing.ok_or_else(|| {
                    AdminError::NotFound(format!(
                        "volume '{name}' does not exist: an incremental stream (from @{}) applies to the volume that received @{}; receive a full stream first",
                        header.base, header.base
                    ))
                })?;
                let guids = self.published().pools.get(pool_name).cloned().unwrap_or_default();
                let snapshots: Vec<SnapshotInfo> =
                    pool.snapshots().into_iter().filter(|s| s.volume == record.id).collect();
                let newest = snapshots.last().ok_or_else(|| {
                    invalid(format!(
                        "wrong base: the stream is incremental from @{}, but '{name}' has no snapshot",
                        header.base
                    ))
                })?;
                if snapshot_guid(&guids, newest) != header.base_guid {
                    let has_base = snapshots.iter().any(|s| snapshot_guid(&guids, s) == header.base_guid);
                    return Err(invalid(if has_base {
                        format!(
                            "wrong base: the stream is incremental from @{}, but the newest snapshot of '{name}' is @{}: roll back to @{} first",
                            header.base, newest.name, header.base
                        )
                    } else {
                        format!(
                            "wrong base: the stream is incremental from {}@{}, which '{name}' never received (its newest snapshot is @{})",
                            header.volume, header.base, newest.name
                        )
                    }));
                }
                if snapshots.iter().any(|s| s.name == header.snapshot) {
                    return Err(ReceiveFailure::from(AdminError::AlreadyExists(format!(
                        "snapshot '{name}@{}' already exists",
                        header.snapshot
                    ))));
                }
                if header.volsize != record.props.volsize || header.volblocksize != record.props.volblocksize {
                    return Err(invalid(format!(
                        "the stream's volume is {} bytes in {}-byte blocks, '{name}' is {} in {}: resize it first",
                        header.volsize, header.volblocksize, record.props.volsize, record.props.volblocksize
                    )));
                }
                let engine = self
                    .engines
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(name)
                    .cloned()
                    .ok_or_else(|| AdminError::Internal(format!("volume '{name}' is not open")))?;
                // No client may see it change: it leaves the exports first.
                let exported = self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(name);
                let restore = |manager: &Self| {
                    if let Some(volume) = exported.clone() {
                        manager
                            .volumes
                            .write()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(name.to_string(), volume);
                    }
                };
                if let Some(connections) = exported.as_ref().map(|v| v.open_handles()).filter(|n| *n > 0) {
                    restore(self);
                    return Err(ReceiveFailure::from(AdminError::Busy(format!(
                        "volume '{name}' is busy: {connections} client connection(s) open; disconnect them first"
                    ))));
                }
                match pool.changed_since(&engine, newest.id) {
                    Ok(false) => {}
                    Ok(true) => {
                        restore(self);
                        return Err(invalid(format!(
                            "volume '{name}' was modified since its snapshot @{}: roll it back first (strata snapshot rollback {name}@{})",
                            newest.name, newest.name
                        )));
                    }
                    Err(e) => {
                        restore(self);
                        return Err(internal("cannot read the volume's map", e).into());
                    }
                }
                state.base_id = Some(newest.id);
                if let Err(e) = self.save_progress(name, &state).await {
                    restore(self);
                    return Err(e.into());
                }
                let start = state.offset;
                Ok((state, engine, start))
            }
        }
    }

    /// Applies records until END. `state` follows what is applied; it is
    /// saved (after a flush) every so often and when the stream stops.
    async fn apply(
        self: &Arc<Self>,
        input: &mut Input,
        header: &Header,
        state: &mut ReceiveRecord,
        engine: &Arc<EngineVolume>,
        _start: u64,
        name: &str,
    ) -> Result<(), Broken> {
        let mut in_flight: VecDeque<tokio::task::JoinHandle<Result<(), Applying>>> = VecDeque::new();
        let pool_name = pool_name_of(name);
        let failed = |error: Applying| Broken::Local(error.into_admin(pool_name));
        // What is applied but not yet saved as progress.
        let mut pending = state.clone();
        let mut saved_at = (state.offset, std::time::Instant::now());
        let result: Result<(), Broken> = async {
            loop {
                if !input.fill(RECORD_HEADER_BYTES).await? {
                    return Err(Broken::Interrupted("it ended before its END record".into()));
                }
                let fixed: [u8; RECORD_HEADER_BYTES] = input
                    .take(RECORD_HEADER_BYTES)
                    .try_into()
                    .expect("a record header's length");
                let record = RecordHeader::decode(&fixed).map_err(Broken::Bad)?;
                let payload_len = record.payload_bytes as usize;
                if !input.fill(payload_len).await? {
                    return Err(Broken::Interrupted("it ended inside a record".into()));
                }
                let payload = input.take(payload_len);
                let payload_crc = crc32c::crc32c(payload);
                let mut position = pending.position();
                let accepted = position
                    .accept(header, &fixed, &record, payload, payload_crc)
                    .map_err(Broken::Bad)?;
                if accepted == Accepted::End {
                    drain(&mut in_flight).await.map_err(&failed)?;
                    engine.flush().await.map_err(|e| failed(Applying::Block(e)))?;
                    *state = pending.clone();
                    state.offset = position.offset;
                    return Ok(());
                }
                if in_flight.len() >= IN_FLIGHT {
                    if let Some(task) = in_flight.pop_front() {
                        settle(task).await.map_err(&failed)?;
                    }
                }
                let target = engine.clone();
                let (offset, length) = (record.offset, record.length);
                in_flight.push_back(match record.kind {
                    RecordKind::Write => {
                        let data = IoBuf::copy_from(payload);
                        tokio::spawn(async move { target.write(offset, data, false).await.map_err(Applying::Block) })
                    }
                    _ => tokio::spawn(async move { target.trim(offset, length, false).await.map_err(Applying::Block) }),
                });
                pending.advance_to(position);
                if pending.offset - saved_at.0 >= PROGRESS_BYTES || saved_at.1.elapsed() >= PROGRESS_INTERVAL {
                    drain(&mut in_flight).await.map_err(&failed)?;
                    engine.flush().await.map_err(|e| failed(Applying::Block(e)))?;
                    self.save_progress(name, &pending).await.map_err(Broken::Local)?;
                    *state = pending.clone();
                    saved_at = (state.offset, std::time::Instant::now());
                }
            }
        }
        .await;
        if let Err(Broken::Interrupted(_) | Broken::Local(_)) = &result {
            // Keep what is applied and durable, for a resume.
            if drain(&mut in_flight).await.is_ok()
                && engine.flush().await.is_ok()
                && self.save_progress(name, &pending).await.is_ok()
            {
                *state = pending;
            }
        } else {
            let _ = drain(&mut in_flight).await;
        }
        result
    }
}

/// How applying a record of the stream failed here.
enum Applying {
    /// The engine refused or failed the write, trim or flush.
    Block(BlockError),
    /// The task applying it did not finish (a panic, or the runtime
    /// shutting down).
    Task(String),
}

impl Applying {
    /// The error the receive answers with: no space (HTTP 507) and device
    /// I/O errors (503) as what they are; the receive stays pending in
    /// both, to be resumed once space is added or the device is back.
    fn into_admin(self, pool: &str) -> AdminError {
        match self {
            Applying::Block(BlockError::NoSpace) => AdminError::NoSpace(format!(
                "no space left in pool '{pool}' for the received data; add a device to the pool or free space in it, then resume the receive"
            )),
            Applying::Block(error @ (BlockError::Io(_) | BlockError::Checksum { .. })) => AdminError::Io(format!(
                "I/O error writing the received data to pool '{pool}': {error}; the receive can be resumed"
            )),
            Applying::Block(error) => internal("cannot write the received data", error),
            Applying::Task(error) => internal("cannot write the received data", error),
        }
    }
}

async fn settle(task: tokio::task::JoinHandle<Result<(), Applying>>) -> Result<(), Applying> {
    task.await.map_err(|e| Applying::Task(e.to_string()))?
}

/// Waits for every write in flight; the first error.
async fn drain(in_flight: &mut VecDeque<tokio::task::JoinHandle<Result<(), Applying>>>) -> Result<(), Applying> {
    let mut first = Ok(());
    while let Some(task) = in_flight.pop_front() {
        if let Err(e) = settle(task).await {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// Snapshot `POOL/VOL@SNAP` of volume `volume`.
fn snapshot_named(pool: &Pool, volume: u32, name: &str) -> Result<SnapshotInfo, AdminError> {
    let snapshot = name.rsplit_once('@').map_or("", |(_, s)| s);
    pool.snapshots()
        .into_iter()
        .find(|s| s.volume == volume && s.name == snapshot)
        .ok_or_else(|| not_found(name))
}

fn pool_name_of(name: &str) -> &str {
    name.split_once('/').map_or(name, |(pool, _)| pool)
}

fn short_name_of(name: &str) -> &str {
    name.split_once('/').map_or(name, |(_, short)| short)
}

/// A buffer read from the snapshot, as the bytes of a response body; back
/// to the stream's [`ReadBuffers`] once sent.
struct Payload(Option<IoBuf>, Arc<ReadBuffers>);

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref().map_or(&[], IoBuf::payload)
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(buf) = self.0.take() {
            self.1.give_back(buf);
        }
    }
}

impl SendJob {
    /// Produces the stream into `out`, reading the snapshot in batches of
    /// up to 1 MiB with several reads in flight. An error ends the stream
    /// early (the receiver sees it cut short).
    pub async fn run(self, out: mpsc::Sender<Result<Bytes, String>>) {
        if out.send(Ok(Bytes::from(self.header.clone()))).await.is_err() {
            return;
        }
        let mut crc = self.crc;
        // Buffers for the reads in flight and the chunks the connection
        // has not sent yet, reused (a new one is zeroed first).
        let buffers = Arc::new(ReadBuffers::new((4 * IN_FLIGHT) << 20));
        // A read hands back its buffer and the CRC-32C of it (summed on
        // the reading task, so reads and sums of several batches overlap).
        type Read = tokio::task::JoinHandle<Result<(IoBuf, u32), String>>;
        let mut reads: VecDeque<(PlannedRecord, Option<Read>)> = VecDeque::new();
        let mut next = self.first;
        loop {
            while reads.len() < IN_FLIGHT && next < self.records.len() {
                let record = self.records[next];
                next += 1;
                let read = (record.0 == RecordKind::Write).then(|| {
                    let volume = self.volume.clone();
                    let buf = buffers.take(0, record.2 as usize);
                    tokio::spawn(async move {
                        let (buf, result) = volume.read(record.1, buf).await;
                        result.map_err(|e| e.to_string())?;
                        let sum = crate::checksum::crc32c(buf.payload());
                        Ok((buf, sum))
                    })
                });
                reads.push_back((record, read));
            }
            let Some(((kind, offset, length), read)) = reads.pop_front() else {
                break;
            };
            let (payload, payload_crc) = match read {
                Some(task) => match task.await.map_err(|e| e.to_string()).and_then(|r| r) {
                    Ok((buf, sum)) => (Some(buf), sum),
                    Err(e) => {
                        tracing::error!("send: reading [{offset}, +{length}) failed: {e}");
                        let _ = out.send(Err(e)).await;
                        return;
                    }
                },
                None => (None, 0),
            };
            let payload_bytes = payload.as_ref().map_or(0, IoBuf::len);
            let fixed = RecordHeader::encode_summed(kind, offset, length, payload_bytes, payload_crc);
            crc = crate::checksum::crc32c_combine(crc32c::crc32c_append(crc, &fixed), payload_crc, payload_bytes);
            if out.send(Ok(Bytes::copy_from_slice(&fixed))).await.is_err() {
                return;
            }
            // The buffer read goes out as it is, not copied.
            if let Some(buf) = payload {
                if out
                    .send(Ok(Bytes::from_owner(Payload(Some(buf), buffers.clone()))))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        let payload = end_payload(crc);
        let fixed = RecordHeader::encode(RecordKind::End, self.total_records, self.total_data, &payload);
        let mut chunk = fixed.to_vec();
        chunk.extend_from_slice(&payload);
        let _ = out.send(Ok(Bytes::from(chunk))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_tokens_round_trip_and_a_changed_digit_is_refused() {
        let token = ResumeToken {
            v: 1,
            target: "tank/db".into(),
            source: "default/db".into(),
            snapshot: "b".into(),
            base: "a".into(),
            guid: 0x1234_5678_9abc_def0,
            base_guid: 42,
            offset: 1 << 33,
            crc: 0xdead_beef,
        };
        let text = token.encode();
        assert_eq!(ResumeToken::decode(&text).unwrap(), token);
        for at in 0..text.len() {
            let mut bad: Vec<u8> = text.clone().into_bytes();
            bad[at] = if bad[at] == b'0' { b'1' } else { b'0' };
            assert!(
                ResumeToken::decode(std::str::from_utf8(&bad).unwrap()).is_err(),
                "digit {at}"
            );
        }
        for bad in ["", "zz", "0", &text[..text.len() - 2]] {
            assert!(ResumeToken::decode(bad).is_err());
        }
    }
}
