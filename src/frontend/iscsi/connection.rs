//! One iSCSI connection: the login phase, then the full feature phase.
//!
//! The reader (this task) parses PDUs, enforces the CmdSN window, gathers
//! write data (immediate, unsolicited and R2T-solicited Data-Out) and runs
//! each SCSI command on itself until the command has to wait, then on a
//! task of its own (`frontend::run_or_spawn`), so commands run concurrently
//! and complete in any order. Responses go through a channel to a writer
//! task that stamps StatSN/ExpCmdSN/MaxCmdSN at send time and writes every
//! queued PDU before one flush (replies that complete together leave in one
//! send).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::login::{Login, Negotiated, Next, SessionType};
use super::pdu::{self, op, reject, Bhs, Framing, Layout, Pdu, BHS_BYTES, RESERVED_TAG};
use super::server::Registry;
use super::text::{self, Params, TARGET_MAX_RECV_DATA_SEGMENT};
use crate::analytics::Recorder;
use crate::block::{Op, Protocol};
use crate::frontend::memory::MemoryPermit;
use crate::frontend::Shutdown;
use crate::scsi::cdb::{self, Command, Transfer};
use crate::scsi::lu::{LogicalUnit, Nexus, Outcome, ResetKind};
use crate::scsi::pages::{self, BLOCK_BYTES};
use crate::scsi::sense::{status, Sense};
use crate::volume::Client;

/// Commands the CmdSN window admits at once (MaxCmdSN - ExpCmdSN + 1 when idle).
pub const COMMAND_WINDOW: u32 = 128;
/// Hard cap on tasks per connection, immediate commands included.
const MAX_TASKS: u32 = 2 * COMMAND_WINDOW;
/// Largest data-out we gather for one command (the volume's request limit).
pub(super) const MAX_DATA_OUT_BYTES: u64 = crate::block::MAX_REQUEST_BYTES as u64;
/// How long a login may take before the connection is closed (an idle
/// half-logged-in connection holds nothing, but should not stay forever).
/// Write data one connection may be gathering at once (the sum of the
/// expected data of its writes waiting for their data-out); a write beyond
/// it is answered TASK SET FULL, which initiators retry. Bounds what one
/// connection can make the daemon hold (256 tasks of 32 MiB would be 8 GiB),
/// like NBD's in-flight budget.
const MAX_GATHERING_BYTES: usize = 128 << 20;
/// How long a refused connection may take to send its login request
/// before it is simply closed.
const REFUSAL_WAIT: Duration = Duration::from_secs(2);
/// How long Logout waits for running commands before answering anyway.
const LOGOUT_DRAIN: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("framing: {0}")]
    Frame(#[from] pdu::FrameError),
    #[error("protocol: {0}")]
    Protocol(&'static str),
}

/// A PDU payload: owned bytes, or a range of a shared read buffer (so a
/// large read is split into Data-In PDUs without copying).
enum Payload {
    Empty,
    Owned(Vec<u8>),
    Shared(Arc<Vec<u8>>, usize, usize),
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::Empty => &[],
            Payload::Owned(v) => v,
            Payload::Shared(v, start, end) => &v[*start..*end],
        }
    }
}

/// How the writer fills the StatSN field.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stamp {
    /// Carries status: gets the next StatSN, which then advances.
    Status,
    /// R2T and NOP-In pings: the next StatSN without advancing it.
    Peek,
    /// Data-In without status: the field is reserved.
    None,
}

struct Frame {
    bhs: Bhs,
    payload: Payload,
    stamp: Stamp,
}

impl Frame {
    fn new(bhs: Bhs, payload: Payload, stamp: Stamp) -> Self {
        Frame { bhs, payload, stamp }
    }
}

type Batch = Vec<Frame>;

/// What goes to the writer: frames, and the share of the process's memory
/// budget a command's data holds until they are written.
struct Outgoing {
    frames: Batch,
    _memory: Option<MemoryPermit>,
}

/// State shared by the reader, the command tasks and the writer.
struct Shared {
    exp_cmdsn: AtomicU32,
    /// Commands admitted and not yet answered.
    inflight: AtomicU32,
    /// Running tasks by ITT; `true` once aborted (its response is dropped).
    tasks: Mutex<HashMap<u32, bool>>,
}

impl Shared {
    fn max_cmdsn(&self) -> u32 {
        let inflight = self.inflight.load(Ordering::Acquire).min(COMMAND_WINDOW);
        self.exp_cmdsn
            .load(Ordering::Acquire)
            .wrapping_add(COMMAND_WINDOW - inflight)
            .wrapping_sub(1)
    }

    fn tasks(&self) -> std::sync::MutexGuard<'_, HashMap<u32, bool>> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn read_pdu<R: AsyncRead + Unpin>(reader: &mut R, framing: &Framing) -> Result<Option<Pdu>, ConnectionError> {
    let mut header = [0u8; BHS_BYTES];
    match reader.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let bhs = Bhs(header);
    // Bounds the data segment by the negotiated maximum before allocating.
    let layout = Layout::of(&bhs, framing)?;
    let mut header_tail = vec![0u8; layout.header_tail()];
    reader.read_exact(&mut header_tail).await?;
    pdu::check_header_digest(&bhs, &layout, &header_tail)?;
    let mut data = vec![0u8; layout.data_len];
    reader.read_exact(&mut data).await?;
    let mut data_tail = [0u8; 8];
    let data_tail = &mut data_tail[..layout.data_tail()];
    reader.read_exact(data_tail).await?;
    pdu::check_data_digest(&layout, &data, data_tail)?;
    header_tail.truncate(layout.ahs_bytes);
    Ok(Some(Pdu {
        bhs,
        ahs: header_tail,
        data,
    }))
}

/// Runs one connection to completion.
pub async fn run(
    stream: TcpStream,
    registry: Arc<Registry>,
    portal: Option<SocketAddr>,
    mut stop: Shutdown,
) -> Result<(), ConnectionError> {
    let client = stream
        .peer_addr()
        .map_or(IpAddr::from([0, 0, 0, 0]), |address| address.ip());
    let (read_half, write_half) = stream.into_split();
    let mut reader = BufReader::with_capacity(256 * 1024, read_half);
    let mut writer = BufWriter::with_capacity(256 * 1024, write_half);
    let logging_in = tokio::time::timeout(
        crate::frontend::handshake_timeout(),
        login(&mut reader, &mut writer, &registry),
    );
    let logged_in = tokio::select! {
        logged_in = logging_in => logged_in,
        // Stopping: an initiator still logging in has no command in flight.
        _ = stop.wait_for(|stopped| *stopped) => return Ok(()),
    };
    let Ok(logged_in) = logged_in else {
        return Err(ConnectionError::Protocol("login did not complete in time"));
    };
    let Some((negotiated, final_response)) = logged_in? else {
        return Ok(());
    };
    let unit = match (&negotiated.session_type, &negotiated.target_name) {
        (SessionType::Normal, Some(name)) => match registry.unit(name) {
            Some(unit) => Some(unit),
            None => return Ok(()),
        },
        _ => None,
    };
    let nexus: Nexus = format!(
        "{},i,0x{}",
        negotiated.initiator_name,
        negotiated.isid.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
    .into();
    // A session counts as a client of its volume (or snapshot), as an NBD
    // connection does: deletion and rollback are refused while it lasts.
    // When the volume drops its clients (`rollback --force`), the watcher
    // shuts the socket's receive side: the reader sees the connection end,
    // the commands in flight are answered, then the connection closes. The
    // data path never looks at it.
    let mut _handle = None;
    let mut _watcher = None;
    if let Some(unit) = &unit {
        let Some(handle) = unit.volume().try_open_handle(Client::Iscsi) else {
            return Err(ConnectionError::Protocol("the volume is dropping its clients"));
        };
        _handle = Some(handle);
        let socket = reader.get_ref().as_ref().as_fd().try_clone_to_owned()?;
        let evicted = unit.volume().evicted();
        _watcher = Some(AbortOnDrop(tokio::spawn(async move {
            evicted.await;
            // SAFETY: shutdown(2) on a descriptor this task owns (a
            // duplicate of the connection's, so it stays valid).
            unsafe { libc::shutdown(socket.as_raw_fd(), libc::SHUT_RD) };
        })));
    }
    if let Some(unit) = &unit {
        unit.attach(&nexus);
    }
    let sent = async {
        writer.write_all(&final_response).await?;
        writer.flush().await
    };
    if let Err(error) = sent.await {
        if let Some(unit) = &unit {
            unit.detach(&nexus);
        }
        return Err(error.into());
    }
    let recorder = unit.as_ref().and_then(|unit| {
        let volume = unit.volume();
        registry.analytics().recorder(
            Protocol::Iscsi,
            &negotiated.initiator_name,
            volume.full_name(),
            volume.size_bytes(),
        )
    });
    let result = full_feature(
        reader,
        writer,
        &negotiated,
        &registry,
        unit.clone(),
        recorder,
        nexus.clone(),
        portal,
        client,
        stop,
    )
    .await;
    if let Some(unit) = &unit {
        unit.detach(&nexus);
    }
    result
}

/// A connection beyond the caps: its first login request is answered with
/// status "out of resources" (RFC 7143 11.13.5, 0x0302), then it is closed.
pub async fn refuse(mut stream: TcpStream) {
    let answered = async {
        let (read_half, mut write_half) = stream.split();
        let mut reader = BufReader::new(read_half);
        if let Ok(Some(request)) = read_pdu(&mut reader, &Framing::LOGIN).await {
            if request.bhs.opcode() == op::LOGIN {
                let bhs = super::login::out_of_resources(&request.bhs);
                let _ = write_half.write_all(&pdu::encode(&bhs, &[], false, false)).await;
                let _ = write_half.flush().await;
            }
        }
    };
    let _ = tokio::time::timeout(REFUSAL_WAIT, answered).await;
}

/// Runs the login phase. On success, returns what was negotiated and the
/// final login response (the transit to full feature phase), unsent: the
/// caller sends it once the session is attached to its logical unit, so a
/// command of another session that raises a unit attention for every
/// nexus after this initiator saw its login complete reaches this one too.
async fn login<R, W>(
    reader: &mut R,
    writer: &mut W,
    registry: &Registry,
) -> Result<Option<(Negotiated, Vec<u8>)>, ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut machine = Login::new(COMMAND_WINDOW);
    loop {
        let Some(request) = read_pdu(reader, &Framing::LOGIN).await? else {
            return Ok(None);
        };
        if request.bhs.opcode() != op::LOGIN {
            // Anything but a login request before login completes closes the
            // connection: no LUN is reachable before the full feature phase.
            return Err(ConnectionError::Protocol("PDU other than Login during login"));
        }
        let (bhs, text, next) = machine.step(&request.bhs, &request.data, registry, &mut || registry.new_tsih());
        let response = pdu::encode(&bhs, &text, false, false);
        if let Next::Complete(negotiated) = next {
            return Ok(Some((*negotiated, response)));
        }
        writer.write_all(&response).await?;
        writer.flush().await?;
        if let Next::Fail = next {
            return Ok(None);
        }
    }
}

/// A write command gathering its data-out.
struct PendingWrite {
    /// The data's share of the process's memory budget.
    memory: Option<MemoryPermit>,
    lun: [u8; 8],
    command: Command,
    buf: Vec<u8>,
    /// Bytes to gather: the EDTL.
    expected: usize,
    /// Bytes the CDB asks for.
    spdtl: usize,
    /// Unsolicited Data-Out may still arrive (the command PDU had F=0).
    unsolicited_open: bool,
    /// Next offset to solicit with an R2T.
    next_r2t_offset: usize,
    outstanding_r2t: u32,
    r2tsn: u32,
    /// Expected DataSN of the next Data-Out in the current sequence.
    data_sn: u32,
}

struct Session<'a> {
    params: Params,
    negotiated: &'a Negotiated,
    registry: &'a Registry,
    unit: Option<Arc<LogicalUnit>>,
    recorder: Option<Arc<Recorder>>,
    nexus: Nexus,
    portal: Option<SocketAddr>,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Outgoing>,
    /// The initiator's address: its share of the process's memory budget.
    client: IpAddr,
    pending: HashMap<u32, PendingWrite>,
    next_ttt: u32,
    /// The rest of a text response that did not fit in one PDU.
    text_rest: Option<(u32, Vec<u8>)>,
}

/// How analytics count a command: its operation, and the offset and
/// bytes of the range it addresses. None for commands that move no data
/// and touch no block (INQUIRY, TEST UNIT READY, ...).
pub(super) fn analytics_op(command: &Command) -> Option<(Op, u64, u64)> {
    // Before the logical unit's range check: an LBA whose byte offset does
    // not fit in 64 bits is recorded with no offset (the command fails).
    let at = |lba: u64| {
        lba.checked_mul(BLOCK_BYTES as u64)
            .unwrap_or(crate::analytics::record::NO_OFFSET)
    };
    let range = |lba: u64, blocks: u32| (at(lba), blocks as u64 * BLOCK_BYTES as u64);
    let (op, (offset, bytes)) = match *command {
        Command::Read { lba, blocks, .. } => (Op::Read, range(lba, blocks)),
        Command::Write { lba, blocks, .. }
        | Command::WriteAndVerify { lba, blocks }
        | Command::CompareAndWrite { lba, blocks, .. } => (Op::Write, range(lba, blocks)),
        Command::WriteSame { lba, blocks, unmap, .. } => {
            (if unmap { Op::Trim } else { Op::WriteZeroes }, range(lba, blocks))
        }
        // Its ranges are in the parameter list: no single offset.
        Command::Unmap { .. } => (Op::Trim, (crate::analytics::record::NO_OFFSET, 0)),
        Command::SynchronizeCache { lba, .. } => (Op::Flush, (at(lba), 0)),
        Command::Prefetch { lba, blocks } => (Op::Cache, range(lba, blocks)),
        Command::GetLbaStatus { lba, .. } => (Op::BlockStatus, (at(lba), 0)),
        _ => return None,
    };
    Some((op, offset, bytes))
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[allow(clippy::too_many_arguments)]
async fn full_feature<R, W>(
    mut reader: R,
    writer: W,
    negotiated: &Negotiated,
    registry: &Registry,
    unit: Option<Arc<LogicalUnit>>,
    recorder: Option<Arc<Recorder>>,
    nexus: Nexus,
    portal: Option<SocketAddr>,
    client: IpAddr,
    mut stop: Shutdown,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let params = negotiated.params;
    let framing = Framing {
        header_digest: params.header_digest,
        data_digest: params.data_digest,
        max_data_segment: TARGET_MAX_RECV_DATA_SEGMENT,
    };
    let shared = Arc::new(Shared {
        exp_cmdsn: AtomicU32::new(negotiated.exp_cmdsn),
        inflight: AtomicU32::new(0),
        tasks: Mutex::new(HashMap::new()),
    });
    let (tx, rx) = mpsc::channel::<Outgoing>(4 * COMMAND_WINDOW as usize);
    // Aborted if this connection is dropped unfinished (a stopping server
    // gave up waiting for it): no response goes out after that.
    let mut writer_task = AbortOnDrop(tokio::spawn(write_loop(
        writer,
        rx,
        shared.clone(),
        negotiated.statsn.wrapping_add(1),
        params.header_digest,
        params.data_digest,
    )));
    let mut session = Session {
        params,
        negotiated,
        registry,
        unit,
        recorder,
        nexus,
        portal,
        shared,
        tx,
        client,
        pending: HashMap::new(),
        next_ttt: 1,
        text_rest: None,
    };
    let result = loop {
        let next = tokio::select! {
            next = read_pdu(&mut reader, &framing) => next,
            _ = stop.wait_for(|stopped| *stopped) => break Ok(()),
        };
        let request = match next {
            Ok(Some(request)) => request,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        match session.handle(request).await {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    drop(session);
    // The writer ends once every command task has sent its response.
    let _ = (&mut writer_task.0).await;
    result
}

impl Session<'_> {
    async fn send(&self, batch: Batch) {
        let _ = self
            .tx
            .send(Outgoing {
                frames: batch,
                _memory: None,
            })
            .await;
    }

    /// Takes `bytes` of the process's memory budget for a command's data.
    /// While this connection gathers write data, the reader must not wait
    /// (those writes need it to read their Data-Out): `Err` then, and the
    /// command is answered TASK SET FULL, which initiators retry.
    async fn reserve(&self, bytes: usize) -> Result<Option<MemoryPermit>, ()> {
        if bytes == 0 {
            return Ok(None);
        }
        let budget = crate::frontend::memory::global();
        if let Some(permit) = budget.try_acquire(self.client, bytes as u64) {
            return Ok(Some(permit));
        }
        if !self.pending.is_empty() {
            return Err(());
        }
        Ok(Some(budget.acquire(self.client, bytes as u64).await))
    }

    /// Answers a command TASK SET FULL (the initiator retries it).
    async fn task_set_full(&self, itt: u32, lun: [u8; 8], edtl: u32) {
        let full = Outcome {
            status: status::TASK_SET_FULL,
            sense: None,
            data: Vec::new(),
        };
        self.complete(itt, lun, edtl, Some(0), full).await;
    }

    async fn send_reject(&self, rejected: &Bhs, reason: u8) {
        let mut bhs = Bhs::new(op::REJECT);
        bhs.0[1] = 0x80;
        bhs.0[2] = reason;
        bhs.set_u32(16, RESERVED_TAG);
        self.send(vec![Frame::new(
            bhs,
            Payload::Owned(rejected.0.to_vec()),
            Stamp::Status,
        )])
        .await;
    }

    /// Applies CmdSN ordering to a non-immediate PDU; `false` means it lies
    /// outside the window and must be silently ignored (RFC 7143 4.2.2.1).
    fn admit(&self, bhs: &Bhs) -> bool {
        if bhs.immediate() {
            return true;
        }
        let cmdsn = bhs.cmdsn();
        let exp = self.shared.exp_cmdsn.load(Ordering::Acquire);
        let max = self.shared.max_cmdsn();
        if !pdu::serial_ge(cmdsn, exp) || !pdu::serial_ge(max, cmdsn) {
            return false;
        }
        self.shared.exp_cmdsn.store(cmdsn.wrapping_add(1), Ordering::Release);
        true
    }

    /// Handles one PDU; `Ok(false)` ends the connection.
    async fn handle(&mut self, request: Pdu) -> Result<bool, ConnectionError> {
        let bhs = request.bhs;
        match bhs.opcode() {
            op::NOP_OUT => {
                if !self.admit(&bhs) {
                    return Ok(true);
                }
                if bhs.itt() != RESERVED_TAG {
                    let mut reply = Bhs::new(op::NOP_IN);
                    reply.0[1] = 0x80;
                    reply.set_lun(bhs.lun());
                    reply.set_u32(16, bhs.itt());
                    reply.set_u32(20, RESERVED_TAG);
                    let mut data = request.data;
                    data.truncate(self.params.initiator_max_recv_data_segment as usize);
                    self.send(vec![Frame::new(reply, Payload::Owned(data), Stamp::Status)])
                        .await;
                }
                Ok(true)
            }
            op::SCSI_COMMAND => {
                if !self.admit(&bhs) {
                    return Ok(true);
                }
                self.scsi_command(request).await;
                Ok(true)
            }
            op::DATA_OUT => {
                self.data_out(request).await;
                Ok(true)
            }
            op::TASK_MANAGEMENT => {
                if !self.admit(&bhs) {
                    return Ok(true);
                }
                self.task_management(&bhs).await
            }
            op::TEXT => {
                if !self.admit(&bhs) {
                    return Ok(true);
                }
                self.text(&bhs, &request.data).await;
                Ok(true)
            }
            op::LOGOUT => {
                if !self.admit(&bhs) {
                    return Ok(true);
                }
                self.logout(&bhs).await;
                Ok(false)
            }
            op::SNACK => {
                // ErrorRecoveryLevel 0: SNACK is not supported.
                self.send_reject(&bhs, reject::SNACK_REJECT).await;
                Ok(true)
            }
            op::LOGIN => {
                self.send_reject(&bhs, reject::PROTOCOL_ERROR).await;
                Ok(true)
            }
            _ => {
                self.send_reject(&bhs, reject::COMMAND_NOT_SUPPORTED).await;
                Ok(true)
            }
        }
    }

    async fn scsi_command(&mut self, request: Pdu) {
        let bhs = request.bhs;
        let itt = bhs.itt();
        let Some(unit) = self.unit.clone() else {
            // Discovery sessions carry no SCSI commands.
            self.send_reject(&bhs, reject::PROTOCOL_ERROR).await;
            return;
        };
        if self.pending.contains_key(&itt) || self.shared.tasks().contains_key(&itt) {
            // A reused ITT while the first task is still running.
            self.send_reject(&bhs, reject::TASK_IN_PROGRESS).await;
            return;
        }
        if self.shared.inflight.load(Ordering::Acquire) >= MAX_TASKS {
            self.send_reject(&bhs, reject::OUT_OF_RESOURCES).await;
            return;
        }
        let edtl = bhs.word20();
        let lun = bhs.lun();
        let mut cdb_bytes = [0u8; 16];
        cdb_bytes.copy_from_slice(bhs.cdb());
        self.shared.inflight.fetch_add(1, Ordering::AcqRel);
        self.shared.tasks().insert(itt, false);

        let command = if !request.ahs.is_empty() {
            // Extended CDBs (more than 16 bytes) are not supported.
            Err(Sense::INVALID_OPCODE)
        } else if lun != [0u8; 8] {
            lun_not_supported(&cdb_bytes)
        } else {
            cdb::decode(&cdb_bytes)
        };
        let command = match command {
            Ok(command) => command,
            Err(sense) => {
                let outcome = if sense == Sense::LUN_NOT_SUPPORTED && cdb_bytes[0] == cdb::opcode::INQUIRY {
                    let mut data = pages::standard_inquiry();
                    data[0] = 0x7f;
                    Outcome::good(data)
                } else {
                    Outcome::check(sense)
                };
                let alloc = match cdb::decode(&cdb_bytes) {
                    Ok(Command::Inquiry { alloc_len, .. }) => alloc_len as usize,
                    _ => usize::MAX,
                };
                let mut outcome = outcome;
                outcome.data.truncate(alloc);
                self.complete(itt, lun, edtl, None, outcome).await;
                return;
            }
        };
        match command.transfer(BLOCK_BYTES) {
            Transfer::Out(spdtl) if spdtl > 0 || edtl > 0 => {
                if matches!(command, Command::CompareAndWrite { .. }) && spdtl != edtl as u64 {
                    // The data-out must be exactly the verify and write data.
                    self.complete(itt, lun, edtl, Some(0), Outcome::check(Sense::INVALID_FIELD_IN_CDB))
                        .await;
                    return;
                }
                if spdtl > MAX_DATA_OUT_BYTES || edtl as u64 > MAX_DATA_OUT_BYTES {
                    self.complete(itt, lun, edtl, Some(0), Outcome::check(Sense::INVALID_FIELD_IN_CDB))
                        .await;
                    return;
                }
                let partial_allowed = matches!(command, Command::Write { .. } | Command::WriteAndVerify { .. });
                if spdtl != edtl as u64 && !partial_allowed {
                    // SPDTL and EDTL disagree on a parameter list: refuse
                    // without transferring data, reporting the difference.
                    self.complete(
                        itt,
                        lun,
                        edtl,
                        Some(spdtl as usize),
                        Outcome::check(Sense::INVALID_FIELD_IN_INFORMATION_UNIT),
                    )
                    .await;
                    return;
                }
                // Gather what the initiator sends (EDTL); a write whose CDB
                // asks for a different amount writes the overlap only (FCP-4
                // 9.4.2 residual handling) and reports the residual.
                let spdtl = spdtl as usize;
                let expected = edtl as usize;
                let immediate = request.data;
                if immediate.len() > expected
                    || (!immediate.is_empty() && !self.params.immediate_data)
                    || immediate.len() > self.params.first_burst as usize
                {
                    self.forget(itt);
                    self.send_reject(&bhs, reject::PROTOCOL_ERROR).await;
                    return;
                }
                let unsolicited_open = !bhs.is_final() && !self.params.initial_r2t;
                let unsolicited_end = if unsolicited_open {
                    (self.params.first_burst as usize).min(expected)
                } else {
                    immediate.len()
                };
                let gathering: usize = self.pending.values().map(|p| p.expected).sum();
                if gathering + expected > MAX_GATHERING_BYTES {
                    self.task_set_full(itt, lun, edtl).await;
                    return;
                }
                let Ok(memory) = self.reserve(expected).await else {
                    self.task_set_full(itt, lun, edtl).await;
                    return;
                };
                let mut buf = Vec::with_capacity(expected);
                buf.extend_from_slice(&immediate);
                let pending = PendingWrite {
                    memory,
                    lun,
                    command,
                    buf,
                    expected,
                    spdtl,
                    unsolicited_open,
                    next_r2t_offset: unsolicited_end.max(immediate.len()),
                    outstanding_r2t: 0,
                    r2tsn: 0,
                    data_sn: 0,
                };
                self.pending.insert(itt, pending);
                self.progress_write(itt).await;
            }
            _ => {
                // Data-in (a read's) is held until it is written.
                let Ok(memory) = self.reserve(edtl as usize).await else {
                    self.task_set_full(itt, lun, edtl).await;
                    return;
                };
                self.execute(unit, itt, lun, edtl, command, Vec::new(), None, memory)
            }
        }
    }

    /// Drops a task that will get no response.
    fn forget(&self, itt: u32) {
        self.shared.tasks().remove(&itt);
        self.shared.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Issues R2Ts as the window allows, or executes once all data is in.
    async fn progress_write(&mut self, itt: u32) {
        let Some(pending) = self.pending.get_mut(&itt) else {
            return;
        };
        if pending.buf.len() == pending.expected {
            let Some(pending) = self.pending.remove(&itt) else {
                return;
            };
            if let Some(unit) = self.unit.clone() {
                let edtl = pending.expected as u32;
                self.execute(
                    unit,
                    itt,
                    pending.lun,
                    edtl,
                    pending.command,
                    pending.buf,
                    Some(pending.spdtl),
                    pending.memory,
                );
            }
            return;
        }
        if pending.unsolicited_open {
            return;
        }
        let mut batch = Vec::new();
        while pending.outstanding_r2t < self.params.max_outstanding_r2t && pending.next_r2t_offset < pending.expected {
            let length = (pending.expected - pending.next_r2t_offset).min(self.params.max_burst as usize);
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1);
            if self.next_ttt == RESERVED_TAG {
                self.next_ttt = 1;
            }
            let mut r2t = Bhs::new(op::R2T);
            r2t.0[1] = 0x80;
            r2t.set_lun(pending.lun);
            r2t.set_u32(16, itt);
            r2t.set_u32(20, ttt);
            r2t.set_u32(36, pending.r2tsn);
            r2t.set_u32(40, pending.next_r2t_offset as u32);
            r2t.set_u32(44, length as u32);
            batch.push(Frame::new(r2t, Payload::Empty, Stamp::Peek));
            pending.r2tsn += 1;
            pending.outstanding_r2t += 1;
            pending.next_r2t_offset += length;
        }
        if !batch.is_empty() {
            self.send(batch).await;
        }
    }

    async fn data_out(&mut self, request: Pdu) {
        let bhs = request.bhs;
        let itt = bhs.itt();
        let Some(pending) = self.pending.get_mut(&itt) else {
            // Data for a task that already ended (refused, or aborted): drop it.
            return;
        };
        let offset = bhs.u32_at(40) as usize;
        let data_sn = bhs.u32_at(36);
        let solicited = bhs.word20() != RESERVED_TAG;
        let fits = offset == pending.buf.len() && offset + request.data.len() <= pending.expected;
        if !fits || data_sn != pending.data_sn || (!solicited && !pending.unsolicited_open) {
            // Out of order or beyond the transfer: with DataPDUInOrder=Yes and
            // ErrorRecoveryLevel=0 this is a protocol error; end the task.
            let lun = pending.lun;
            let edtl = pending.expected as u32;
            self.pending.remove(&itt);
            self.send_reject(&bhs, reject::PROTOCOL_ERROR).await;
            self.complete(
                itt,
                lun,
                edtl,
                Some(0),
                Outcome::check(Sense::new(crate::scsi::sense::key::ABORTED_COMMAND, 0x4b, 0x00)),
            )
            .await;
            return;
        }
        pending.buf.extend_from_slice(&request.data);
        pending.data_sn = pending.data_sn.wrapping_add(1);
        if bhs.is_final() {
            pending.data_sn = 0;
            if solicited {
                pending.outstanding_r2t = pending.outstanding_r2t.saturating_sub(1);
            } else {
                pending.unsolicited_open = false;
                pending.next_r2t_offset = pending.next_r2t_offset.max(pending.buf.len());
            }
        }
        self.progress_write(itt).await;
    }

    /// Sends the response for a command that did not run.
    async fn complete(&self, itt: u32, lun: [u8; 8], edtl: u32, out_bytes: Option<usize>, outcome: Outcome) {
        let batch = response_frames(itt, lun, edtl, out_bytes, outcome, &self.params);
        let aborted = self.shared.tasks().remove(&itt).unwrap_or(false);
        self.shared.inflight.fetch_sub(1, Ordering::AcqRel);
        if !aborted {
            self.send(batch).await;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        unit: Arc<LogicalUnit>,
        itt: u32,
        lun: [u8; 8],
        edtl: u32,
        command: Command,
        data_out: Vec<u8>,
        out_bytes: Option<usize>,
        memory: Option<MemoryPermit>,
    ) {
        let shared = self.shared.clone();
        let tx = self.tx.clone();
        let nexus = self.nexus.clone();
        let params = self.params;
        let recorder = self.recorder.clone();
        let started = std::time::Instant::now();
        crate::frontend::run_or_spawn(async move {
            let queued = started.elapsed();
            let run = async {
                match out_bytes {
                    Some(spdtl) if data_out.len() != spdtl => {
                        match unit.fit_write_data(&command, data_out, spdtl).await {
                            Ok(data_out) => unit.execute(&nexus, &command, data_out).await,
                            Err(sense) => Outcome::check(sense),
                        }
                    }
                    _ => unit.execute(&nexus, &command, data_out).await,
                }
            };
            let outcome = match (&recorder, analytics_op(&command)) {
                (Some(recorder), Some((op, offset, bytes))) => {
                    let (outcome, phases) = crate::analytics::phase::measure(run).await;
                    let ok = outcome.status == status::GOOD;
                    let split = crate::analytics::record::Split {
                        queued_ns: queued.as_nanos() as u64,
                        commit_ns: phases.commit_ns.get(),
                    };
                    recorder.record(op, offset, if ok { bytes } else { 0 }, started.elapsed(), ok, split);
                    outcome
                }
                _ => run.await,
            };
            let batch = response_frames(itt, lun, edtl, out_bytes, outcome, &params);
            let aborted = shared.tasks().remove(&itt).unwrap_or(false);
            shared.inflight.fetch_sub(1, Ordering::AcqRel);
            if !aborted {
                let _ = tx
                    .send(Outgoing {
                        frames: batch,
                        _memory: memory,
                    })
                    .await;
            }
        });
    }

    /// Marks every running task aborted and drops those gathering data.
    fn abort_all(&mut self) {
        for itt in self.pending.keys().copied().collect::<Vec<_>>() {
            self.pending.remove(&itt);
            self.forget(itt);
        }
        for aborted in self.shared.tasks().values_mut() {
            *aborted = true;
        }
    }

    async fn task_management(&mut self, bhs: &Bhs) -> Result<bool, ConnectionError> {
        const COMPLETE: u8 = 0;
        const TASK_DOES_NOT_EXIST: u8 = 1;
        const LUN_DOES_NOT_EXIST: u8 = 2;
        const REASSIGNMENT_NOT_SUPPORTED: u8 = 4;
        const NOT_SUPPORTED: u8 = 5;
        let function = bhs.flags() & 0x7f;
        let lun_ok = bhs.lun() == [0u8; 8];
        let mut close = false;
        let response = match function {
            // ABORT TASK
            1 => {
                // A task is aborted exactly when this finds it still running
                // (its completion takes it out of `tasks` under the same
                // lock), so "function complete" always means no response.
                let referenced = bhs.word20();
                if self.pending.remove(&referenced).is_some() {
                    self.forget(referenced);
                    COMPLETE
                } else if let Some(aborted) = self.shared.tasks().get_mut(&referenced) {
                    *aborted = true;
                    COMPLETE
                } else {
                    TASK_DOES_NOT_EXIST
                }
            }
            // ABORT TASK SET, CLEAR TASK SET
            2 | 4 => {
                if !lun_ok {
                    LUN_DOES_NOT_EXIST
                } else {
                    self.abort_all();
                    COMPLETE
                }
            }
            // CLEAR ACA: no ACA support.
            3 => NOT_SUPPORTED,
            // LOGICAL UNIT RESET
            5 => {
                if !lun_ok {
                    LUN_DOES_NOT_EXIST
                } else {
                    self.abort_all();
                    if let Some(unit) = &self.unit {
                        unit.reset(ResetKind::LogicalUnit, &self.nexus);
                    }
                    COMPLETE
                }
            }
            // TARGET WARM RESET, TARGET COLD RESET
            6 | 7 => {
                self.abort_all();
                if let Some(unit) = &self.unit {
                    let kind = if function == 6 {
                        ResetKind::TargetWarm
                    } else {
                        ResetKind::TargetCold
                    };
                    unit.reset(kind, &self.nexus);
                }
                // A cold reset also ends the connection (RFC 7143 11.5.1).
                close = function == 7;
                COMPLETE
            }
            8 => REASSIGNMENT_NOT_SUPPORTED,
            _ => NOT_SUPPORTED,
        };
        let mut reply = Bhs::new(op::TASK_MANAGEMENT_RESPONSE);
        reply.0[1] = 0x80;
        reply.0[2] = response;
        reply.set_u32(16, bhs.itt());
        self.send(vec![Frame::new(reply, Payload::Empty, Stamp::Status)]).await;
        let _ = self.registry;
        Ok(!close)
    }

    async fn text(&mut self, bhs: &Bhs, data: &[u8]) {
        let itt = bhs.itt();
        let ttt = bhs.word20();
        let body = match self.text_rest.take() {
            Some((expected_ttt, rest)) if ttt == expected_ttt => rest,
            _ => {
                let pairs = match text::parse(data) {
                    Ok(pairs) => pairs,
                    Err(_) => {
                        self.send_reject(bhs, reject::PROTOCOL_ERROR).await;
                        return;
                    }
                };
                let mut reply: Vec<(String, String)> = Vec::new();
                for (key, value) in pairs {
                    if key == "SendTargets" {
                        reply.extend(self.send_targets(&value));
                    } else {
                        reply.push((key, "NotUnderstood".into()));
                    }
                }
                text::encode(&reply)
            }
        };
        let limit = self.params.initiator_max_recv_data_segment as usize;
        let mut response = Bhs::new(op::TEXT_RESPONSE);
        response.set_u32(16, itt);
        let chunk = if body.len() > limit {
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1).max(1);
            self.text_rest = Some((ttt, body[limit..].to_vec()));
            response.0[1] = 0x40; // C: more text follows
            response.set_u32(20, ttt);
            body[..limit].to_vec()
        } else {
            response.0[1] = 0x80;
            response.set_u32(20, RESERVED_TAG);
            body
        };
        self.send(vec![Frame::new(response, Payload::Owned(chunk), Stamp::Status)])
            .await;
    }

    fn send_targets(&self, value: &str) -> Vec<(String, String)> {
        let names: Vec<String> = match (value, self.negotiated.session_type) {
            ("All", SessionType::Discovery) => self.registry.targets_for(&self.negotiated.initiator_name),
            ("", SessionType::Normal) | ("All", SessionType::Normal) => {
                self.negotiated.target_name.iter().cloned().collect()
            }
            (name, _) => self
                .registry
                .targets_for(&self.negotiated.initiator_name)
                .into_iter()
                .filter(|t| t == name)
                .collect(),
        };
        let address = match self.portal {
            Some(SocketAddr::V4(a)) => Some(format!("{}:{},1", a.ip(), a.port())),
            Some(SocketAddr::V6(a)) => Some(format!("[{}]:{},1", a.ip(), a.port())),
            None => None,
        };
        let mut pairs = Vec::new();
        for name in names {
            pairs.push(("TargetName".to_string(), name));
            if let Some(address) = &address {
                pairs.push(("TargetAddress".to_string(), address.clone()));
            }
        }
        pairs
    }

    async fn logout(&mut self, bhs: &Bhs) {
        self.pending.clear();
        let started = tokio::time::Instant::now();
        while self.shared.inflight.load(Ordering::Acquire) > self.pending.len() as u32 {
            if started.elapsed() > LOGOUT_DRAIN {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut reply = Bhs::new(op::LOGOUT_RESPONSE);
        reply.0[1] = 0x80;
        reply.0[2] = 0; // connection or session closed successfully
        reply.set_u32(16, bhs.itt());
        self.send(vec![Frame::new(reply, Payload::Empty, Stamp::Status)]).await;
    }
}

/// For a command addressed to a LUN other than 0: INQUIRY answers with
/// "no logical unit", REPORT LUNS works on any LUN, everything else fails.
fn lun_not_supported(cdb_bytes: &[u8; 16]) -> Result<Command, Sense> {
    match cdb::decode(cdb_bytes) {
        Ok(command @ Command::ReportLuns { .. }) => Ok(command),
        Ok(Command::RequestSense { .. }) => cdb::decode(cdb_bytes),
        _ => Err(Sense::LUN_NOT_SUPPORTED),
    }
}

/// Builds the Data-In PDUs and/or SCSI Response for a finished command.
/// `out_bytes` is the data-out length the command transferred (for write
/// commands), which is what residuals compare against EDTL.
fn response_frames(
    itt: u32,
    lun: [u8; 8],
    edtl: u32,
    out_bytes: Option<usize>,
    outcome: Outcome,
    params: &Params,
) -> Batch {
    let edtl = edtl as usize;
    let transferred = out_bytes.unwrap_or(outcome.data.len());
    let (residual_flag, residual) = if transferred > edtl {
        (0x04u8, transferred - edtl)
    } else if transferred < edtl {
        (0x02u8, edtl - transferred)
    } else {
        (0, 0)
    };
    let residual = residual.min(u32::MAX as usize) as u32;
    let mut batch = Vec::new();
    let send_len = if out_bytes.is_none() {
        outcome.data.len().min(edtl)
    } else {
        0
    };
    let mut data_sn = 0u32;
    if outcome.status == status::GOOD && send_len > 0 {
        let data = Arc::new(outcome.data);
        let segment = params.initiator_max_recv_data_segment as usize;
        let burst = params.max_burst.max(segment as u32) as usize;
        let mut offset = 0usize;
        while offset < send_len {
            let end = (offset + segment).min(send_len);
            let last = end == send_len;
            let mut bhs = Bhs::new(op::DATA_IN);
            let mut flags = 0u8;
            if last || end % burst == 0 {
                flags |= 0x80;
            }
            if last {
                // Phase collapse: the final Data-In carries the status.
                flags |= 0x01 | residual_flag;
                bhs.0[3] = outcome.status;
                bhs.set_u32(44, residual);
            }
            bhs.0[1] = flags;
            bhs.set_lun(lun);
            bhs.set_u32(16, itt);
            bhs.set_u32(20, RESERVED_TAG);
            bhs.set_u32(36, data_sn);
            bhs.set_u32(40, offset as u32);
            let stamp = if last { Stamp::Status } else { Stamp::None };
            batch.push(Frame::new(bhs, Payload::Shared(data.clone(), offset, end), stamp));
            data_sn += 1;
            offset = end;
        }
        return batch;
    }
    let mut bhs = Bhs::new(op::SCSI_RESPONSE);
    bhs.0[1] = 0x80 | residual_flag;
    bhs.0[2] = 0x00; // command completed at target
    bhs.0[3] = outcome.status;
    bhs.set_u32(16, itt);
    bhs.set_u32(36, data_sn);
    bhs.set_u32(44, residual);
    let payload = match outcome.sense {
        Some(sense) if outcome.status == status::CHECK_CONDITION => {
            let sense = sense.to_fixed();
            let mut data = (sense.len() as u16).to_be_bytes().to_vec();
            data.extend_from_slice(&sense);
            Payload::Owned(data)
        }
        _ => Payload::Empty,
    };
    batch.push(Frame::new(bhs, payload, Stamp::Status));
    batch
}

async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    frame: Frame,
    statsn: &mut u32,
    shared: &Shared,
    header_digest: bool,
    data_digest: bool,
) -> io::Result<()> {
    let mut bhs = frame.bhs;
    match frame.stamp {
        Stamp::Status => {
            bhs.set_u32(24, *statsn);
            *statsn = statsn.wrapping_add(1);
        }
        Stamp::Peek => bhs.set_u32(24, *statsn),
        Stamp::None => {}
    }
    bhs.set_u32(28, shared.exp_cmdsn.load(Ordering::Acquire));
    bhs.set_u32(32, shared.max_cmdsn());
    let data = frame.payload.bytes();
    bhs.set_data_segment_len(data.len() as u32);
    writer.write_all(&bhs.0).await?;
    if header_digest {
        writer.write_all(&pdu::digest(&[&bhs.0])).await?;
    }
    if !data.is_empty() {
        writer.write_all(data).await?;
        let padding = &[0u8; 3][..pdu::padding_for(data.len())];
        writer.write_all(padding).await?;
        if data_digest {
            writer.write_all(&pdu::digest(&[data, padding])).await?;
        }
    }
    Ok(())
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<Outgoing>,
    shared: Arc<Shared>,
    mut statsn: u32,
    header_digest: bool,
    data_digest: bool,
) -> io::Result<()> {
    while let Some(batch) = rx.recv().await {
        for frame in batch.frames {
            write_frame(&mut writer, frame, &mut statsn, &shared, header_digest, data_digest).await?;
        }
        // Temporal merge: everything already queued leaves with this flush.
        while let Ok(batch) = rx.try_recv() {
            for frame in batch.frames {
                write_frame(&mut writer, frame, &mut statsn, &shared, header_digest, data_digest).await?;
            }
        }
        writer.flush().await?;
    }
    writer.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analytics::record::NO_OFFSET;

    /// An LBA from the wire whose byte offset does not fit in 64 bits is
    /// counted with no offset, never a wrapped one (nor a panic): the
    /// logical unit refuses the command after this runs.
    #[test]
    fn analytics_offsets_of_huge_lbas_do_not_wrap() {
        for lba in [u64::MAX, u64::MAX / 512 + 1, 1 << 55] {
            let commands = [
                Command::Read {
                    lba,
                    blocks: 8,
                    fua: false,
                },
                Command::Write {
                    lba,
                    blocks: 8,
                    fua: false,
                },
                Command::SynchronizeCache { lba, blocks: 0 },
                Command::Prefetch { lba, blocks: 1 },
                Command::GetLbaStatus { lba, alloc_len: 32 },
            ];
            for command in commands {
                let (_, offset, _) = analytics_op(&command).expect("a data command");
                assert_eq!(offset, NO_OFFSET, "{command:?}");
            }
        }
        // The largest LBA that fits keeps its offset.
        let lba = u64::MAX / 512;
        let read = Command::Read {
            lba,
            blocks: 1,
            fua: false,
        };
        assert_eq!(analytics_op(&read), Some((Op::Read, lba * 512, 512)));
    }
}
