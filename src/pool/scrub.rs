//! The scrub after a crash: every block that lies in a suspect part (a
//! write may have been in flight there when the pool stopped) is read back
//! where it lies and verified. A mismatch in a suspect part is repaired
//! from the data, since the crash explains it; a mismatch anywhere else is
//! a checksum error, counted and logged like any read's. Each block holds
//! only its own stripe's read lock while it is read, so clients' writes go
//! on meanwhile.

use super::*;
use crate::block::BlockDevice;
use crate::pool::volume::EngineVolume;

/// What a scrub did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScrubReport {
    /// Blocks read back and verified.
    pub blocks: u64,
    /// Sectors whose checksums were repaired from the data.
    pub repaired: u64,
    /// Blocks that failed to verify (checksum or read errors, counted on
    /// their devices).
    pub failed: u64,
    /// Chunks with suspect parts left: parts no open volume maps (free
    /// space, or blocks only snapshots keep). A read there repairs them; a
    /// write there clears them.
    pub left: usize,
}

impl Pool {
    /// Reads back and verifies the blocks of every open volume and dataset
    /// that lie in suspect parts.
    pub async fn scrub_suspect(&self) -> Result<ScrubReport, PoolError> {
        let suspect: HashMap<(u8, u64), ChunkParts> = self.suspect.lock_or_abort().clone();
        let mut report = ScrubReport::default();
        if suspect.is_empty() {
            return Ok(report);
        }
        let repaired = |pool: &Pool| -> u64 {
            pool.devices
                .iter()
                .map(|d| d.counters.repaired_after_crash.load(Ordering::Relaxed))
                .sum()
        };
        let repaired_before = repaired(self);
        let chunk_bytes = self.chunk_bytes as u64;
        for engine in self.engines() {
            if engine.is_snapshot() {
                continue;
            }
            let id = engine.id();
            let block_bytes = engine.block_bytes();
            let blocks = crate::block::BlockDevice::size_bytes(&*engine).div_ceil(block_bytes);
            if blocks == 0 {
                continue;
            }
            let mut wanted = Vec::new();
            for index in self.view_page_indexes(id, blocks).map_err(PoolError::Meta)? {
                let first = index * MAP_ENTRIES_PER_PAGE;
                let last = (first + MAP_ENTRIES_PER_PAGE - 1).min(blocks - 1);
                let entries = self.lookup_range(id, first, last).map_err(PoolError::Meta)?;
                for (block, entry) in (first..).zip(entries) {
                    let Some((device, offset)) = entry.place() else {
                        continue;
                    };
                    let Some(have) = suspect.get(&(device, offset / chunk_bytes)) else {
                        continue;
                    };
                    let (_, parts) = self.parts_of(offset, block_bytes);
                    if have.iter().zip(parts).any(|(have, want)| have & want != 0) {
                        wanted.push(block);
                    }
                }
            }
            report.blocks += wanted.len() as u64;
            report.failed += engine.scrub_blocks(&wanted).await;
        }
        report.repaired = repaired(self) - repaired_before;
        report.left = self.suspect_chunks();
        Ok(report)
    }

    pub(super) fn suspect_snapshot(&self) -> Vec<((u8, u64), ChunkParts)> {
        let mut parts: Vec<_> = self.suspect.lock_or_abort().iter().map(|(k, v)| (*k, *v)).collect();
        parts.sort_unstable();
        parts
    }

    /// Chunks with suspect parts.
    pub fn suspect_chunks(&self) -> usize {
        self.suspect.lock_or_abort().len()
    }
}

// The scrub of a whole pool (`strata pool scrub`): every block some volume,
// dataset, snapshot or clone maps is read back from every copy that holds
// it and verified against its stored checksums; a bad copy on a mirror is
// rewritten from a good one, a block no copy holds intact is listed by
// volume and offset. Last, every copy of the log's committed blocks that
// a recovery would replay is checked, and a checkpoint retires them if
// one fails (`Pool::scrub_log`).
//
// Order: the maps are walked once, volume by volume (by id), each
// volume's own view and then its snapshots' own pages, in block order; a
// batch of up to `SCRUB_BATCH` slots is collected and read in place order
// (member, then device offset), so a disk reads forward within a batch
// and memory stays bounded whatever the pool's size, as in ZFS's sorted
// scrub. A slot two maps of one batch share (a snapshot and its clone) is
// read once. Contiguous places are read in runs of up to
// `SCRUB_RUN_BYTES` and checked block by block; only a block that does
// not match is checked again, alone, under its stripe lock, the way a
// client's read would (a client's write in place between the run's read
// and its check explains a mismatch, and the recheck sees the block as it
// is now).
//
// Pace: while clients do I/O (the pool's foreground counters moved since
// the last run), the scrub rests after each run several times as long as
// the run took, so on a busy disk it takes a small share of it; idle, it
// runs at the device's speed (`Pool::yield_to_clients`, which the resilver
// uses too).

/// Places collected per walk of the maps.
pub(crate) const SCRUB_BATCH: usize = 128 * 1024;
/// The most one run reads at a time.
pub const SCRUB_RUN_BYTES: u64 = 1 << 20;
/// While clients are at work: rest this many times as long as a run took.
const SCRUB_BUSY_FACTOR: u32 = 4;
const SCRUB_MIN_REST: std::time::Duration = std::time::Duration::from_millis(2);
const SCRUB_MAX_REST: std::time::Duration = std::time::Duration::from_millis(200);
/// Blocks listed by name in a scrub's status; the rest are counted.
pub const SCRUB_MAX_FAULTS: usize = 1000;

/// Where a scrub is. The walk of the maps has collected every block
/// before (`volume`, `snapshot`, `block`) — a volume's own view first
/// (`snapshot` absent), then its snapshots' own pages — and of the batch
/// collected from there, every place before (`member`, `offset`) has been
/// checked.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
pub struct ScrubCursor {
    pub volume: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<u32>,
    pub block: u64,
    pub member: u8,
    pub offset: u64,
}

impl ScrubCursor {
    /// The start of the walk's next batch, nothing of it checked yet.
    fn batch_at(volume: u32, snapshot: Option<u32>, block: u64) -> ScrubCursor {
        ScrubCursor {
            volume,
            snapshot,
            block,
            member: 0,
            offset: 0,
        }
    }
}

/// A scrub's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScrubState {
    /// Under way.
    Scanning,
    /// Paused (`pool scrub --pause`): `pool scrub` goes on from its cursor.
    Paused,
    /// Every block was checked.
    Finished,
    /// Stopped before the end (`pool scrub --stop`).
    Stopped,
    /// Stopped by an error (its reason in `error`).
    Failed,
}

impl ScrubState {
    pub fn as_str(self) -> &'static str {
        match self {
            ScrubState::Scanning => "scanning",
            ScrubState::Paused => "paused",
            ScrubState::Finished => "finished",
            ScrubState::Stopped => "stopped",
            ScrubState::Failed => "failed",
        }
    }
}

/// A block the scrub found no intact copy of.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ScrubFault {
    /// The volume (or dataset) id, and the snapshot's when only a snapshot
    /// maps the block.
    pub volume: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<u32>,
    /// Byte offset and length in the volume (a dataset's object).
    pub offset: u64,
    pub length: u64,
    /// The device (or mirror) it lies on.
    pub device: String,
    /// Filled in by the manager: the volume's name (`pool/name`, with
    /// `@snapshot`), and for a dataset the file's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// A scrub's progress and findings, as `pool status` and `pool scrub`
/// show them and as the daemon keeps them across restarts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ScrubStatus {
    pub state: ScrubState,
    pub started_unix: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_unix: Option<u64>,
    /// Bytes the pool's maps held when the scrub started (an estimate of
    /// what it reads: blocks written meanwhile are read too if they lie
    /// past the cursor).
    pub total_bytes: u64,
    /// Bytes of blocks read back and checked (each slot once, however many
    /// copies it has).
    pub issued_bytes: u64,
    /// Bytes rewritten from another copy while it ran.
    pub repaired_bytes: u64,
    /// Blocks no copy holds intact (or that could not be read at all).
    pub errors: u64,
    /// Seconds spent scanning (pauses left out), and its pace.
    pub seconds: u64,
    pub bytes_per_second: u64,
    pub cursor: ScrubCursor,
    /// The first [`SCRUB_MAX_FAULTS`] of `errors`.
    #[serde(default)]
    pub faults: Vec<ScrubFault>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl ScrubStatus {
    pub fn new(started_unix: u64) -> ScrubStatus {
        ScrubStatus {
            state: ScrubState::Scanning,
            started_unix,
            ended_unix: None,
            total_bytes: 0,
            issued_bytes: 0,
            repaired_bytes: 0,
            errors: 0,
            seconds: 0,
            bytes_per_second: 0,
            cursor: ScrubCursor::default(),
            faults: Vec::new(),
            error: None,
        }
    }

    /// Seconds left at the current pace, if it has one.
    pub fn eta_seconds(&self) -> Option<u64> {
        self.total_bytes
            .saturating_sub(self.issued_bytes)
            .checked_div(self.bytes_per_second)
    }
}

/// What a running scrub is asked to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrubCommand {
    Run,
    Pause,
    Stop,
}

/// A scrub the pool runs: its status, shared with whoever shows it, and
/// the command it checks between runs.
pub struct ScrubJob {
    status: Mutex<ScrubStatus>,
    command: Mutex<ScrubCommand>,
    /// Slots collected per batch of the walk.
    batch: usize,
}

impl ScrubJob {
    pub fn new(status: ScrubStatus) -> Arc<ScrubJob> {
        ScrubJob::with_batch(status, SCRUB_BATCH)
    }

    /// A job that collects `batch` slots per batch of its walk (tests use
    /// small ones to cross many batches).
    pub fn with_batch(status: ScrubStatus, batch: usize) -> Arc<ScrubJob> {
        Arc::new(ScrubJob {
            status: Mutex::new(status),
            command: Mutex::new(ScrubCommand::Run),
            batch: batch.max(1),
        })
    }

    pub fn status(&self) -> ScrubStatus {
        self.status.lock_or_abort().clone()
    }

    pub fn command(&self, command: ScrubCommand) {
        *self.command.lock_or_abort() = command;
    }

    /// Keeps the names the manager found for the first faults
    /// ([`ScrubFault::name`], `path`, and the offset within the file), so
    /// they are looked up once, not at every status.
    pub fn keep_fault_names(&self, named: &[ScrubFault]) {
        self.update(|s| {
            for (fault, named) in s.faults.iter_mut().zip(named) {
                if fault.name.is_none() && named.name.is_some() {
                    *fault = named.clone();
                }
            }
        });
    }

    fn next_command(&self) -> ScrubCommand {
        *self.command.lock_or_abort()
    }

    fn update(&self, change: impl FnOnce(&mut ScrubStatus)) {
        change(&mut self.status.lock_or_abort());
    }
}

/// One place to check: a slot, who maps it, and at which block.
#[derive(Clone)]
struct ScrubTarget {
    engine: Arc<EngineVolume>,
    block: u64,
    /// Mapped by this snapshot's own page (the volume no longer maps it).
    snapshot: Option<u32>,
    bytes: u64,
}

/// How checking one block came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScrubBlock {
    /// Every copy verified (or was repaired from one that did).
    Good,
    /// The slot no longer holds this block (rewritten or freed meanwhile).
    Gone,
    /// No copy verified.
    Bad,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Pool {
    /// The scrub running or last run since the pool opened, if any.
    pub fn scrub_job(&self) -> Option<Arc<ScrubJob>> {
        self.scrub.lock_or_abort().clone()
    }

    /// Makes `job` the pool's scrub, shown by [`Pool::scrub_job`]; refused
    /// while another is scanning.
    pub fn set_scrub_job(&self, job: Arc<ScrubJob>) -> Result<(), PoolError> {
        let mut current = self.scrub.lock_or_abort();
        if current
            .as_ref()
            .is_some_and(|j| j.status().state == ScrubState::Scanning)
        {
            return Err(PoolError::Invalid(format!(
                "pool '{}' is already being scrubbed",
                self.name
            )));
        }
        *current = Some(job);
        Ok(())
    }

    /// Bytes the maps of the open volumes hold (the allocator's live data).
    fn scrub_total_bytes(&self) -> u64 {
        let allocator = self.allocator.lock_or_abort();
        self.devices
            .iter()
            .filter(|d| d.member.role.holds_data() && !d.is_removed())
            .map(|d| allocator.live_bytes(d.member.index))
            .sum()
    }

    fn repaired_sectors(&self) -> u64 {
        self.devices
            .iter()
            .filter_map(|d| d.mirror())
            .flat_map(|m| {
                m.children()
                    .iter()
                    .map(|c| c.counters.repaired.load(Ordering::Relaxed))
                    .collect::<Vec<_>>()
            })
            .sum()
    }

    /// The last step of a scrub: every copy of the log's committed blocks
    /// that a recovery would replay now ([`Log::check_copy`]). A copy that
    /// fails its checks is not rewritten: a checkpoint retires those
    /// blocks instead (everything their records say is in the metadata
    /// store after it, and replay starts past them), on a single device as
    /// on a mirror. Returns the bytes of bad copies so retired (a scrub's
    /// `repaired_bytes`; its `issued_bytes` count blocks of data only);
    /// each bad copy of a mirror counts as checksum errors on its child
    /// (4 KiB each).
    async fn scrub_log(&self) -> Result<u64, PoolError> {
        let pool_device = self.data_device(self.regions.log_device).map_err(PoolError::Meta)?;
        let live = self.log.next_lsn().saturating_sub(self.log.tail_lsn());
        let mut bad_bytes = 0;
        match pool_device.mirror() {
            Some(mirror) => {
                for child in mirror.online() {
                    let Some(device) = &child.device else {
                        continue;
                    };
                    let bad = match self.log.check_copy(device).await {
                        Ok(bad) => bad,
                        Err(e) => {
                            child.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!("pool {}: scrub: reading the log on {}: {e}", self.name, child.name);
                            live
                        }
                    };
                    if bad > 0 {
                        child
                            .counters
                            .checksum_errors
                            .fetch_add(bad.div_ceil(crate::meta::log::LOG_BLOCK_BYTES), Ordering::Relaxed);
                        tracing::warn!(
                            "pool {}: scrub: {} of the log on {} failed its checks",
                            self.name,
                            crate::units::format_size(bad),
                            child.name
                        );
                    }
                    bad_bytes += bad;
                }
            }
            None => {
                let device: Arc<dyn Device> = pool_device.device.clone();
                let bad = match self.log.check_copy(&device).await {
                    Ok(bad) => bad,
                    Err(e) => {
                        pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!("pool {}: scrub: reading the log: {e}", self.name);
                        live
                    }
                };
                if bad > 0 {
                    tracing::warn!(
                        "pool {}: scrub: {} of the log failed its checks",
                        self.name,
                        crate::units::format_size(bad)
                    );
                }
                bad_bytes += bad;
            }
        }
        if bad_bytes > 0 {
            self.checkpoint().await?;
            tracing::warn!("pool {}: scrub: a checkpoint retired the damaged log blocks", self.name);
        }
        Ok(bad_bytes)
    }

    /// Runs `job` (the pool's scrub, [`Pool::set_scrub_job`]) from its
    /// cursor until every block is checked or it is told to pause or
    /// stop; `save` is called with its status every `save_every` and when
    /// it ends, so that a restart can go on from there.
    pub async fn run_scrub(
        &self,
        job: &ScrubJob,
        save_every: std::time::Duration,
        save: &(dyn Fn(&ScrubStatus) + Send + Sync),
    ) {
        let began = std::time::Instant::now();
        let (seconds_before, issued_before, repaired_before) = {
            let status = job.status();
            (status.seconds, status.issued_bytes, status.repaired_bytes)
        };
        let repaired_base = self.repaired_sectors();
        job.update(|s| {
            s.state = ScrubState::Scanning;
            s.ended_unix = None;
            s.error = None;
            if s.issued_bytes == 0 {
                s.total_bytes = self.scrub_total_bytes();
            }
        });
        save(&job.status());
        let mut saved = std::time::Instant::now();
        let mut seen = self.foreground_ops();
        let outcome: Result<ScrubState, PoolError> = async {
            loop {
                let cursor = job.status().cursor;
                let (batch, next) = self.scrub_batch(&cursor, job.batch)?;
                // Resumed within a batch: what it checked before is skipped.
                let skip = (cursor.member, cursor.offset);
                let batch: Vec<_> = batch.into_iter().filter(|(place, _)| *place >= skip).collect();
                let mut at = 0;
                while at < batch.len() {
                    match job.next_command() {
                        ScrubCommand::Run => {}
                        ScrubCommand::Pause => return Ok(ScrubState::Paused),
                        ScrubCommand::Stop => return Ok(ScrubState::Stopped),
                    }
                    // A run: places one after another on one member.
                    let ((member, offset), _) = &batch[at];
                    let mut end = at + 1;
                    let mut length = batch[at].1.bytes;
                    while end < batch.len() {
                        let ((m, o), t) = &batch[end];
                        if *m != *member || *o != offset + length || length + t.bytes > SCRUB_RUN_BYTES {
                            break;
                        }
                        length += t.bytes;
                        end += 1;
                    }
                    let run = std::time::Instant::now();
                    let faults = self.scrub_run(*member, *offset, &batch[at..end]).await?;
                    let last = &batch[end - 1];
                    let took = run.elapsed();
                    job.update(|s| {
                        s.cursor.member = last.0 .0;
                        s.cursor.offset = last.0 .1 + last.1.bytes;
                        s.issued_bytes += length;
                        s.total_bytes = s.total_bytes.max(s.issued_bytes);
                        s.repaired_bytes =
                            repaired_before + (self.repaired_sectors().saturating_sub(repaired_base)) * SECTOR_BYTES;
                        s.errors += faults.len() as u64;
                        let room = SCRUB_MAX_FAULTS.saturating_sub(s.faults.len());
                        s.faults.extend(faults.into_iter().take(room));
                        let elapsed = began.elapsed().as_secs_f64().max(1e-3);
                        s.seconds = seconds_before + elapsed as u64;
                        s.bytes_per_second = ((s.issued_bytes - issued_before) as f64 / elapsed) as u64;
                    });
                    if saved.elapsed() >= save_every {
                        save(&job.status());
                        saved = std::time::Instant::now();
                    }
                    self.yield_to_clients(&mut seen, took).await;
                    at = end;
                }
                let Some(next) = next else {
                    let retired = self.scrub_log().await?;
                    job.update(|s| s.repaired_bytes += retired);
                    return Ok(ScrubState::Finished);
                };
                job.update(|s| s.cursor = next);
            }
        }
        .await;
        job.update(|s| {
            match outcome {
                Ok(state) => s.state = state,
                Err(e) => {
                    s.state = ScrubState::Failed;
                    s.error = Some(e.to_string());
                }
            }
            if s.state == ScrubState::Stopped || s.state == ScrubState::Finished {
                s.ended_unix = Some(unix_now());
            }
        });
        let status = job.status();
        save(&status);
        let summary = format!(
            "{} checked, {} repaired, {} errors",
            crate::units::format_size(status.issued_bytes),
            crate::units::format_size(status.repaired_bytes),
            status.errors
        );
        match status.state {
            ScrubState::Failed => tracing::error!(
                "pool {}: scrub failed: {} ({summary})",
                self.name,
                status.error.as_deref().unwrap_or("")
            ),
            ScrubState::Finished if status.errors > 0 => {
                tracing::error!("pool {}: scrub finished: {summary}", self.name)
            }
            state => tracing::info!("pool {}: scrub {}: {summary}", self.name, state.as_str()),
        }
    }

    /// The next batch of the walk from `cursor`: at least `max` slots
    /// (whole map pages of them) that the open volumes, their snapshots and
    /// clones map, in place order, each slot once; and where the walk goes
    /// on (`None`: this is its last batch).
    #[allow(clippy::type_complexity)]
    fn scrub_batch(
        &self,
        cursor: &ScrubCursor,
        max: usize,
    ) -> Result<(Vec<((u8, u64), ScrubTarget)>, Option<ScrubCursor>), PoolError> {
        let mut batch: std::collections::BTreeMap<(u8, u64), ScrubTarget> = std::collections::BTreeMap::new();
        let mut engines: Vec<Arc<EngineVolume>> = self.engines().into_iter().filter(|e| !e.is_snapshot()).collect();
        engines.sort_by_key(|e| e.id());
        let walked: std::collections::HashSet<u32> = engines.iter().map(|e| e.id()).collect();
        let from = (cursor.volume, cursor.snapshot);
        for engine in engines.into_iter().filter(|e| e.id() >= cursor.volume) {
            let id = engine.id();
            let bytes = engine.block_bytes();
            let blocks = engine.size_bytes().div_ceil(bytes);
            // A clone's entries equal to its origin's are walked with the
            // origin (when the origin's volume is walked at all).
            let origin = self
                .origin_of(id)
                .filter(|&origin| self.snapshot(origin).is_some_and(|info| walked.contains(&info.volume)));
            let mut snapshots: Vec<u32> = self.snapshots_of(id).iter().map(|s| s.id).collect();
            snapshots.sort_unstable();
            let views = std::iter::once(None).chain(snapshots.into_iter().map(Some));
            for snapshot in views.filter(|&view| (id, view) >= from) {
                let first_block = if (id, snapshot) == from { cursor.block } else { 0 };
                let mut next = Some(first_block / MAP_ENTRIES_PER_PAGE);
                while let Some(start) = next {
                    let (indexes, more) = match snapshot {
                        None => self.view_page_indexes_from(id, blocks, start, migrate::PAGE_WINDOW)?,
                        Some(snapshot) => self.own_pages_from(snapshot, start, migrate::PAGE_WINDOW)?,
                    };
                    for index in indexes {
                        if batch.len() >= max {
                            let block = index * MAP_ENTRIES_PER_PAGE;
                            return Ok((
                                batch.into_iter().collect(),
                                Some(ScrubCursor::batch_at(id, snapshot, block)),
                            ));
                        }
                        let first = index * MAP_ENTRIES_PER_PAGE;
                        // What this view maps here, and what it shares
                        // with a view walked for itself.
                        let (entries, shared) = match snapshot {
                            None => {
                                let last = (first + MAP_ENTRIES_PER_PAGE - 1).min(blocks - 1);
                                let shared = match origin {
                                    Some(origin) => Some(self.view_entries(origin, index)?),
                                    None => None,
                                };
                                (self.lookup_range(id, first, last)?, shared)
                            }
                            Some(snapshot) => (
                                self.map_pages.get(&self.db, (snapshot, index))?.ptrs().to_vec(),
                                self.newer_view_entries(snapshot, index)?,
                            ),
                        };
                        for (within, (block, entry)) in (first..).zip(entries).enumerate() {
                            let Some(place) = entry.place() else { continue };
                            if block < first_block
                                || shared
                                    .as_ref()
                                    .is_some_and(|s| s.get(within).and_then(|e| e.place()) == Some(place))
                            {
                                continue;
                            }
                            batch.entry(place).or_insert_with(|| ScrubTarget {
                                engine: engine.clone(),
                                block,
                                snapshot,
                                bytes,
                            });
                        }
                    }
                    next = more;
                }
            }
        }
        Ok((batch.into_iter().collect(), None))
    }

    /// Clients first, for background work (the scrub, the resilver) after
    /// a step that took `took`: if clients did I/O since `seen` (the
    /// pool's foreground counters, which it moves on), rests several times
    /// as long as the step took; else only yields, so idle, the work runs
    /// at the devices' speed.
    pub(super) async fn yield_to_clients(&self, seen: &mut u64, took: std::time::Duration) {
        let now = self.foreground_ops();
        if now != *seen {
            let rest = (took * SCRUB_BUSY_FACTOR).clamp(SCRUB_MIN_REST, SCRUB_MAX_REST);
            tokio::time::sleep(rest).await;
            *seen = self.foreground_ops();
        } else {
            tokio::task::yield_now().await;
        }
    }

    /// Reads the run of `targets` (lying one after another on `member`
    /// from `offset`) from every up-to-date copy and checks each block;
    /// a block that does not match on some copy is checked again alone
    /// ([`EngineVolume::scrub_block`]). Returns the blocks left bad.
    async fn scrub_run(
        &self,
        member: u8,
        offset: u64,
        targets: &[((u8, u64), ScrubTarget)],
    ) -> Result<Vec<ScrubFault>, PoolError> {
        let length: u64 = targets.iter().map(|(_, t)| t.bytes).sum();
        let pool_device = self.data_device(member).map_err(PoolError::Meta)?;
        let stored = self
            .crcs(member, offset, (length / SECTOR_BYTES) as usize)
            .map_err(PoolError::Meta)?;
        let copies: Vec<(IoBuf, Result<(), DeviceError>)> = match pool_device.mirror() {
            Some(mirror) => {
                let children = mirror.online();
                let reads = children
                    .iter()
                    .map(|child| -> crate::device::BoxFuture<'_, _> {
                        Box::pin(mirror.read_child(child, offset, IoBuf::new(length as usize)))
                    })
                    .collect();
                vdev::join_all(reads).await
            }
            None => {
                let (buf, result) = pool_device.device.read(offset, IoBuf::new(length as usize)).await;
                if result.is_err() {
                    pool_device.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                }
                vec![(buf, result)]
            }
        };
        let mut faults = Vec::new();
        let mut at = 0u64;
        for (_, target) in targets {
            let sectors = (at / SECTOR_BYTES) as usize..((at + target.bytes) / SECTOR_BYTES) as usize;
            let logical = target.block * target.bytes;
            let matches = !copies.is_empty()
                && copies.iter().all(|(buf, result)| {
                    result.is_ok() && {
                        let data = &buf.payload()[at as usize..(at + target.bytes) as usize];
                        let mut sums = volume::sector_crcs(data);
                        self.tag_crcs(&mut sums, logical);
                        sums[..] == stored[sectors.clone()]
                    }
                });
            if !matches {
                let place = offset + at;
                let checked = target
                    .engine
                    .scrub_block(member, place, target.block, target.snapshot)
                    .await;
                if checked == ScrubBlock::Bad {
                    faults.push(ScrubFault {
                        volume: target.engine.id(),
                        snapshot: target.snapshot,
                        offset: logical,
                        length: target.bytes,
                        device: pool_device.device.info().name.clone(),
                        name: None,
                        path: None,
                    });
                }
            }
            at += target.bytes;
        }
        Ok(faults)
    }

    /// The entry of `block` in snapshot `snapshot`'s own map page.
    pub(crate) fn own_entry(&self, snapshot: u32, block: u64) -> Result<BlockPtr, MetaError> {
        let page = self.map_pages.get(&self.db, (snapshot, block / MAP_ENTRIES_PER_PAGE))?;
        Ok(page.ptrs()[(block % MAP_ENTRIES_PER_PAGE) as usize])
    }
}
