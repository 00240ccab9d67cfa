//! The NBD server: accepts connections, runs the fixed newstyle handshake,
//! then serves requests pipelined.
//!
//! The handshake runs on a tokio task, and so does transmission: the
//! connection's reader task receives (see [`Receiver`]), parses request
//! headers (and write payloads) and runs each request on itself until the
//! request has to wait, then on a task of its own, so many requests are
//! in flight and complete in any order. Replies go to the connection's
//! [`Outbox`]: the reader sends the replies of the requests it completed
//! together, just before it would wait for the socket; a spawned request
//! sends its own. A byte budget per connection bounds the memory one
//! client can pin; nothing is shared between connections except the
//! volume itself. A connection costs no thread of its own (docs/NBD.md,
//! "Transmission").
//!
//! After NBD_OPT_STARTTLS the handshake task also runs the TLS handshake
//! and option haggling starts over inside TLS ([`handshake`]). A TLS
//! connection's reader serves one end of a Unix socket pair, exactly as it
//! serves a TCP socket; a [`pump_tls`] task moves the bytes between the
//! other end and the TLS stream.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::proto::{self, cflag, chunk, cmd, info, opt, rep, ClientOption, Negotiated, Request};
use super::tls::{self, Access, NbdTls, Peer, TlsMode};
use crate::analytics::phase;
use crate::analytics::record::Split;
use crate::analytics::Recorder;
use crate::block::{BlockError, IoBuf, ZeroFlags, MAX_REQUEST_BYTES};
use crate::block::{Op, Protocol};
use crate::control::manager::{VolumeManager, DEFAULT_POOL, DEFAULT_VOLUME};
use crate::device::ReadBuffers;
use crate::frontend::lane::Lane;
use crate::frontend::limits::ConnectionLimits;
use crate::frontend::memory::MemoryPermit;
use crate::frontend::outbox::{Outbox, ReplySocket};
use crate::frontend::Shutdown;
use crate::volume::{full_name, Client, HandleGuard, ServedVolume};

/// Options one connection may send before it is considered abusive.
const MAX_OPTIONS_PER_CONNECTION: usize = 1024;
/// Bytes of request and reply payload one connection may have in flight.
const IN_FLIGHT_BUDGET_BYTES: usize = 128 << 20;
/// The budget is counted in units of this many bytes (each request takes at least one).
const BUDGET_UNIT_BYTES: usize = 4096;
/// Replies (batches of them) with at least this much read data are sent
/// from the connection's lane, at once.
const BULK_REPLY_BYTES: usize = 256 << 10;
/// Write payloads of at least this size are checksummed while they arrive.
const SUM_WHILE_RECEIVING_BYTES: usize = 64 << 10;
/// Room in front of read data for a structured chunk header and its offset.
const STRUCTURED_READ_HEADROOM: usize = proto::CHUNK_HEADER_BYTES + 8;
/// Threads per connection that run large reads: half the cores, between 1
/// and [`MAX_READ_THREADS`]. Two readers sending on one socket contend for
/// it; on two cores shared with the client, a second thread cost 35–40 % of
/// 1M read throughput on one machine and gained 5–11 % on another
/// (BENCHMARKS.md, "NBD").
fn read_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / 2).clamp(1, MAX_READ_THREADS)
    })
}
const MAX_READ_THREADS: usize = 4;
/// Bytes the reader buffers from the socket at a time.
const RECEIVE_BUFFER_BYTES: usize = 64 << 10;
/// Microseconds an idle connection's reader polls for its next request
/// before it sleeps (`strata serve --nbd-poll-us` sets it; see [`Receiver`]).
pub const DEFAULT_IDLE_POLL_US: u64 = 30;
/// Send buffer asked of the kernel per connection (`strata serve
/// --nbd-send-buffer` sets it, 0 keeps the kernel's autotuning): Linux doubles it, so about
/// one megabyte reply fits. Autotuned, the buffer grows to take a whole
/// megabyte reply while the one before it is still unread, and the
/// sending thread then also does the TCP work of the client's window
/// updates for the queued data (BENCHMARKS.md, "NBD": 1M reads +17–22 %, 8–13 %
/// less server CPU per read). A megabyte in flight per connection still
/// fills 10 Gb/s up to ~0.8 ms of round trip.
pub const DEFAULT_SEND_BUFFER_BYTES: u64 = 512 << 10;

#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("handshake: {0}")]
    Handshake(#[from] proto::HandshakeError),
    #[error("{0}")]
    Request(#[from] proto::BadRequestMagic),
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("option of {0} bytes refused")]
    OptionTooLarge(u32),
    #[error("more than {MAX_OPTIONS_PER_CONNECTION} options")]
    TooManyOptions,
    #[error("unknown export '{0}' requested with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("write payload of {0} bytes exceeds the {MAX_REQUEST_BYTES}-byte maximum")]
    PayloadTooLarge(u32),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("export '{0}' requested with NBD_OPT_EXPORT_NAME needs TLS or another identity")]
    ExportRefused(String),
    #[error("the connection's task ended without a result (it panicked)")]
    TaskLost,
    #[error("export '{0}' is dropping its clients (a forced rollback): connection closed")]
    Evicted(String),
}

/// Accepts NBD clients until `stop` turns true.
/// Connections beyond `limits` are closed at accept, before a byte is sent.
pub async fn serve(
    listener: TcpListener,
    manager: Arc<VolumeManager>,
    limits: Arc<ConnectionLimits>,
    tls: Arc<NbdTls>,
    stop: Shutdown,
) {
    let connection_stop = stop.clone();
    crate::frontend::accept_loop("nbd", listener, limits, stop, |stream, peer| {
        let manager = manager.clone();
        let stop = connection_stop.clone();
        let tls = tls.clone();
        async move {
            match handle_connection(stream, peer, &manager, &tls, stop).await {
                Ok(()) => tracing::debug!("nbd: {peer} disconnected"),
                Err(e) => tracing::info!("nbd: {peer} closed: {e}"),
            }
        }
    })
    .await;
}

async fn handle_connection(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    manager: &VolumeManager,
    tls: &NbdTls,
    mut stop: Shutdown,
) -> Result<(), ConnectionError> {
    stream.set_nodelay(true)?;
    set_send_buffer(&stream, send_buffer_bytes());
    let limit = crate::frontend::handshake_timeout();
    let handshake = tokio::time::timeout(limit, handshake(stream, manager, tls));
    let agreed = tokio::select! {
        agreed = handshake => agreed.map_err(|_| ConnectionError::HandshakeTimeout(limit))??,
        // Stopping: a client still negotiating has nothing in flight.
        _ = stop.wait_for(|stopped| *stopped) => return Ok(()),
    };
    let Some(Agreed {
        transport,
        early,
        volume,
        negotiated,
    }) = agreed
    else {
        return Ok(());
    };
    // Counted as a client of the volume before transmission starts; a
    // volume dropping its clients (`rollback --force`) takes no new one.
    let Some(handle) = volume.try_open_handle(Client::Nbd) else {
        return Err(ConnectionError::Evicted(volume.full_name().to_string()));
    };
    let evicted = volume.evicted();
    let recorder = manager.analytics().recorder(
        Protocol::Nbd,
        &peer.ip().to_string(),
        volume.full_name(),
        volume.size_bytes(),
    );

    // Transmission runs on a task of its own, reading the TCP socket, or
    // for TLS one end of a Unix socket pair whose other end a pump task
    // connects to the TLS stream (see [`pump_tls`]). Whatever the client
    // sent after its last option is already in `early`.
    let serve = Serve {
        volume,
        handle,
        negotiated,
        recorder,
        client: peer.ip(),
    };
    let ((mut finished, watcher), pump) = match transport {
        Transport::Plain(stream) => (spawn_transmission(stream, early, serve)?, None),
        Transport::Tls(stream) => {
            let (ours, theirs) = tokio::net::UnixStream::pair()?;
            let pump = AbortOnDrop(tokio::spawn(pump_tls(*stream, ours)));
            (spawn_transmission(theirs, early, serve)?, Some(pump))
        }
    };
    let ended = tokio::select! {
        result = &mut finished => Some(result.unwrap_or(Err(ConnectionError::TaskLost))),
        _ = stop.wait_for(|stopped| *stopped) => None,
        () = evicted => None,
    };
    let result = match ended {
        Some(result) => result,
        None => {
            // The server is stopping, or the volume drops its clients: end
            // the reader's receive as a client hang-up would. Requests in
            // flight still finish and send their replies, then the
            // connection closes.
            watcher.shutdown(libc::SHUT_RD);
            finished.await.unwrap_or(Err(ConnectionError::TaskLost))
        }
    };
    if let Some(mut pump) = pump {
        // The last replies still go out through TLS.
        let _ = (&mut pump.0).await;
    }
    result
}

/// Ends a spawned task when dropped (a connection given up on while its
/// TLS pump still runs).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a connection in transmission serves.
struct Serve {
    volume: Arc<ServedVolume>,
    handle: HandleGuard,
    negotiated: Negotiated,
    recorder: Option<Arc<Recorder>>,
    /// The client's address: its share of the process's memory budget.
    client: std::net::IpAddr,
}

/// Starts transmission on `stream` on a task of its own: a reader that
/// starts with `early`, the bytes the handshake had already received, and
/// a reply socket of its own (a duplicate descriptor, see
/// [`ReplySocket`]). Returns the task and a [`Hangup`] that can end its
/// receive from outside (stop, eviction).
fn spawn_transmission<S>(
    stream: S,
    early: Vec<u8>,
    serve: Serve,
) -> std::io::Result<(tokio::task::JoinHandle<Result<(), ConnectionError>>, Hangup)>
where
    S: AsyncRead + AsFd + Unpin + Send + 'static,
{
    let replies = ReplySocket::new(stream.as_fd().try_clone_to_owned()?)?;
    let watcher = Hangup(stream.as_fd().try_clone_to_owned()?);
    let idle = Arc::new(AtomicBool::new(false));
    let receiver = Receiver {
        stream,
        idle: idle.clone(),
    };
    let reader = BufReader::with_capacity(RECEIVE_BUFFER_BYTES, std::io::Cursor::new(early).chain(receiver));
    let Serve {
        volume,
        handle,
        negotiated,
        recorder,
        client,
    } = serve;
    let task = tokio::spawn(async move {
        transmission(reader, replies, volume, handle, negotiated, &idle, recorder, client).await
    });
    Ok((task, watcher))
}

/// A connection whose handshake chose an export: in plaintext or in TLS.
enum Transport {
    Plain(TcpStream),
    Tls(Box<tokio_openssl::SslStream<TcpStream>>),
}

/// The end of a handshake that chose an export.
struct Agreed {
    transport: Transport,
    /// Bytes the client sent after its last option (already received).
    early: Vec<u8>,
    volume: Arc<ServedVolume>,
    negotiated: Negotiated,
}

/// Bytes the TLS pump moves at a time each way.
const PUMP_BUFFER_BYTES: usize = 256 << 10;

/// Moves bytes between a TLS connection and the Unix socket the
/// transmission code serves, both ways, until the transmission side has
/// closed (its last reply sent through TLS, then TLS closed). A client
/// that hangs up is passed on as end of stream.
async fn pump_tls(tls: tokio_openssl::SslStream<TcpStream>, plain: tokio::net::UnixStream) {
    let (tls_in, mut tls_out) = tokio::io::split(tls);
    let (plain_in, mut plain_out) = plain.into_split();
    let replies = async {
        let mut from = BufReader::with_capacity(PUMP_BUFFER_BYTES, plain_in);
        tokio::io::copy_buf(&mut from, &mut tls_out).await?;
        tls_out.shutdown().await
    };
    let requests = async {
        let mut from = BufReader::with_capacity(PUMP_BUFFER_BYTES, tls_in);
        let result = tokio::io::copy_buf(&mut from, &mut plain_out).await;
        // The transmission reader sees the end of the stream either way.
        let _ = plain_out.shutdown().await;
        result
    };
    tokio::pin!(replies, requests);
    let mut requests_done = false;
    loop {
        tokio::select! {
            result = &mut replies => {
                if let Err(e) = result {
                    tracing::debug!("nbd: TLS: {e}");
                }
                return;
            }
            result = &mut requests, if !requests_done => {
                requests_done = true;
                if let Err(e) = result {
                    tracing::debug!("nbd: TLS: {e}");
                }
            }
        }
    }
}

/// Sends the greeting and runs option haggling: in plaintext, and after
/// NBD_OPT_STARTTLS once more inside TLS. `None` when the client aborted.
async fn handshake(
    stream: TcpStream,
    manager: &VolumeManager,
    tls: &NbdTls,
) -> Result<Option<Agreed>, ConnectionError> {
    let (read_half, mut writer) = stream.into_split();
    let mut reader = BufReader::with_capacity(RECEIVE_BUFFER_BYTES, read_half);
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&proto::NBD_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
    writer.write_all(&greeting).await?;
    let mut flags = [0u8; 4];
    reader.read_exact(&mut flags).await?;
    let client_flags = proto::parse_client_flags(flags)?;
    let no_zeroes = client_flags & proto::CLIENT_FLAG_NO_ZEROES != 0;

    match negotiate(&mut reader, &mut writer, manager, tls, no_zeroes, None).await? {
        Outcome::Abort => return Ok(None),
        Outcome::Export(volume, negotiated) => {
            let early = reader.buffer().to_vec();
            let stream = reader
                .into_inner()
                .reunite(writer)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            return Ok(Some(Agreed {
                transport: Transport::Plain(stream),
                early,
                volume,
                negotiated,
            }));
        }
        Outcome::StartTls => {}
    }
    // The client starts TLS only after our acknowledgement; anything it
    // sent before would be plaintext injected ahead of the TLS stream.
    if !reader.buffer().is_empty() {
        return Err(ConnectionError::Tls(
            "data sent after NBD_OPT_STARTTLS ahead of its reply".into(),
        ));
    }
    let stream = reader
        .into_inner()
        .reunite(writer)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let session = tls.session().map_err(ConnectionError::Tls)?;
    let mut stream = tokio_openssl::SslStream::new(session, stream).map_err(|e| ConnectionError::Tls(e.to_string()))?;
    Pin::new(&mut stream)
        .accept()
        .await
        .map_err(|e| ConnectionError::Tls(format!("handshake failed: {e}")))?;
    let peer = tls::peer_of(stream.ssl());
    tracing::debug!(
        "nbd: TLS {} as {:?}",
        stream.ssl().version_str(),
        peer.identity.as_deref().unwrap_or("(no identity)")
    );
    let (read_half, mut writer) = tokio::io::split(stream);
    let mut reader = BufReader::with_capacity(RECEIVE_BUFFER_BYTES, read_half);
    match negotiate(&mut reader, &mut writer, manager, tls, no_zeroes, Some(&peer)).await? {
        Outcome::Abort => Ok(None),
        Outcome::StartTls => Err(ConnectionError::Tls("NBD_OPT_STARTTLS inside TLS".into())),
        Outcome::Export(volume, negotiated) => {
            let early = reader.buffer().to_vec();
            let stream = reader.into_inner().unsplit(writer);
            Ok(Some(Agreed {
                transport: Transport::Tls(Box::new(stream)),
                early,
                volume,
                negotiated,
            }))
        }
    }
}

/// Shuts a connection's socket down both ways when dropped, as when a
/// stopping server gives up waiting for it (see [`crate::frontend::Connections::drain`]):
/// the connection's transmission task, which runs on detached, then sends
/// nothing more and its receive ends. After a normal end it changes nothing.
struct Hangup(OwnedFd);

impl Hangup {
    fn shutdown(&self, how: libc::c_int) {
        // SAFETY: shutdown(2) on a descriptor this value owns.
        unsafe { libc::shutdown(self.0.as_raw_fd(), how) };
    }
}

impl Drop for Hangup {
    fn drop(&mut self) {
        self.shutdown(libc::SHUT_RDWR);
    }
}

static IDLE_POLL_US: AtomicU64 = AtomicU64::new(DEFAULT_IDLE_POLL_US);
static SEND_BUFFER_BYTES: AtomicU64 = AtomicU64::new(DEFAULT_SEND_BUFFER_BYTES);

/// Sets how long an idle connection's reader polls for its next request
/// before it sleeps, in microseconds (0 turns polling off): `strata serve
/// --nbd-poll-us`, once at start.
pub fn set_idle_poll_us(micros: u64) {
    IDLE_POLL_US.store(micros, Ordering::Relaxed);
}

/// How long an idle connection's reader polls for its next request before
/// it sleeps ([`set_idle_poll_us`]; [`DEFAULT_IDLE_POLL_US`] by default).
fn idle_poll() -> Duration {
    Duration::from_micros(IDLE_POLL_US.load(Ordering::Relaxed))
}

/// Sets the send buffer each connection asks of the kernel, in bytes (0
/// leaves it to the kernel's autotuning): `strata serve
/// --nbd-send-buffer`, once at start. Says so when the kernel caps it.
pub fn set_send_buffer_bytes(bytes: u64) {
    if let Some(cap) = wmem_max().filter(|&cap| bytes > cap) {
        tracing::warn!(
            "nbd: net.core.wmem_max ({cap}) caps the {bytes}-byte send buffer; \
             large reads are slower until it is raised (sysctl -w net.core.wmem_max={bytes})"
        );
    }
    SEND_BUFFER_BYTES.store(bytes, Ordering::Relaxed);
}

/// The send buffer each connection asks of the kernel
/// ([`set_send_buffer_bytes`]; [`DEFAULT_SEND_BUFFER_BYTES`] by default).
fn send_buffer_bytes() -> u64 {
    SEND_BUFFER_BYTES.load(Ordering::Relaxed)
}

/// The kernel's cap on a socket's requested send buffer
/// (`net.core.wmem_max`), if it can be read.
fn wmem_max() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/net/core/wmem_max")
        .ok()
        .and_then(|text| text.trim().parse().ok())
}

/// Asks the kernel for a send buffer of `bytes` on `stream` (0: leave it
/// alone). Linux caps the value at `net.core.wmem_max`, doubles it for its
/// bookkeeping and stops autotuning it. Failure only costs speed, so it is
/// logged, not fatal.
fn set_send_buffer(stream: &TcpStream, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let value = bytes.min(i32::MAX as u64) as libc::c_int;
    // SAFETY: a valid descriptor and a c_int option value of the size given.
    let result = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            &value as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if result != 0 {
        tracing::debug!("nbd: SO_SNDBUF {bytes}: {}", std::io::Error::last_os_error());
    }
}

/// Readers polling at this moment, process-wide: at most half the cores
/// poll at once, so many idle connections never take every core.
static POLLING: AtomicUsize = AtomicUsize::new(0);

fn polling_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1))
}

/// One non-blocking `recv` on `fd` into `unfilled`.
fn recv_now(fd: libc::c_int, unfilled: &mut [std::mem::MaybeUninit<u8>]) -> isize {
    // SAFETY: the pointer and length describe writable memory owned by the caller.
    unsafe { libc::recv(fd, unfilled.as_mut_ptr().cast(), unfilled.len(), libc::MSG_DONTWAIT) }
}

/// Whether idle polls have been catching the next request, process-wide:
/// +1 for a poll that did, -1 for one that waited its whole window, kept
/// within ±[`POLL_SCORE_LIMIT`]. Polls run while it is positive; while
/// it is not, one idle receive in [`POLL_PROBE_EVERY`] polls anyway, to
/// learn when polling pays again.
static POLL_SCORE: AtomicI32 = AtomicI32::new(POLL_SCORE_LIMIT);
static POLL_PROBE: AtomicU32 = AtomicU32::new(0);
const POLL_SCORE_LIMIT: i32 = 16;
const POLL_PROBE_EVERY: u32 = 64;

/// Polls `fd` for data for up to [`idle_poll`]: bytes received (0 at end
/// of stream), or `None` if nothing came (or polling is off, taken, or
/// has not been paying: see [`POLL_SCORE`]).
fn poll_briefly(fd: libc::c_int, unfilled: &mut [std::mem::MaybeUninit<u8>]) -> Option<isize> {
    let window = idle_poll();
    if window.is_zero() {
        return None;
    }
    if POLL_SCORE.load(Ordering::Relaxed) <= 0
        && !POLL_PROBE
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(POLL_PROBE_EVERY)
    {
        return None;
    }
    if POLLING.fetch_add(1, Ordering::Relaxed) >= polling_limit() {
        POLLING.fetch_sub(1, Ordering::Relaxed);
        return None;
    }
    let until = Instant::now() + window;
    let (received, caught) = loop {
        let received = recv_now(fd, unfilled);
        if received >= 0 {
            break (Some(received), true);
        }
        let again = std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock;
        if !again {
            // An error is reported by the receive that follows.
            break (None, true);
        }
        if Instant::now() >= until {
            break (None, false);
        }
        std::hint::spin_loop();
    };
    POLLING.fetch_sub(1, Ordering::Relaxed);
    let change = if caught { 1 } else { -1 };
    let _ = POLL_SCORE.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |score| {
        Some((score + change).clamp(-POLL_SCORE_LIMIT, POLL_SCORE_LIMIT))
    });
    received
}

/// Marks `buf`'s first `received` unfilled bytes as read.
fn advance_received(buf: &mut ReadBuf<'_>, received: usize) {
    // SAFETY: the kernel wrote `received` bytes at the start of the unfilled part.
    unsafe { buf.assume_init(received) };
    buf.advance(received);
}

/// The receiving side of a connection in transmission: the socket (TCP,
/// or the Unix socket behind a TLS pump), read on the connection's task.
///
/// Each read first tries a non-blocking `recv` of its own, and only when
/// nothing is there asks tokio's stream, which registers the task for the
/// socket's readiness. Through tokio's stream alone, one connection at
/// QD32 does 25 % fewer 4K reads than a reader on a thread of its own (in
/// fewer, larger batches: the reader learns of new requests only when the
/// reactor next reports the socket readable); with its own `recv` first, as
/// many (docs/NBD.md, "Transmission").
///
/// When the reader waits for the next request with nothing in flight
/// (`idle`, set by [`transmission`]: a client doing one request at a
/// time), the receive polls for up to [`idle_poll`] before it waits: the
/// next request of such a client usually comes within tens of
/// microseconds, and a worker that parked must be woken on a core that
/// went idle, which on a virtual machine costs about as much again
/// (4K QD1 reads: 58 µs at the median without the poll, 33 µs with it).
/// A poll holds up the other tasks of its worker, so polls run only while
/// they have been catching requests ([`POLL_SCORE`]): with a hundred busy
/// connections a client's next request rarely comes within the window.
struct Receiver<S> {
    stream: S,
    idle: Arc<AtomicBool>,
}

impl<S: AsyncRead + AsFd + Unpin> AsyncRead for Receiver<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let fd = self.stream.as_fd().as_raw_fd();
        // SAFETY: `recv` only writes into the unfilled part, and
        // `advance_received` marks only the bytes it reported received.
        let unfilled = unsafe { buf.unfilled_mut() };
        let mut received = recv_now(fd, unfilled);
        if received < 0 && self.idle.load(Ordering::Relaxed) {
            received = poll_briefly(fd, unfilled).unwrap_or(-1);
        }
        if received >= 0 {
            advance_received(buf, received as usize);
            return Poll::Ready(Ok(()));
        }
        // Nothing there (or an error, which the stream's own read reports).
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

/// The volume an export name means; the empty name is `default/vol0`.
fn lookup_export(manager: &VolumeManager, name: &str) -> Option<Arc<ServedVolume>> {
    if name.is_empty() {
        manager.lookup(&full_name(DEFAULT_POOL, DEFAULT_VOLUME))
    } else {
        manager.lookup(name)
    }
}

/// Where option haggling ended.
enum Outcome {
    /// The client aborted.
    Abort,
    Export(Arc<ServedVolume>, Negotiated),
    /// NBD_OPT_STARTTLS was acknowledged: the TLS handshake comes next.
    StartTls,
}

/// Whether the client (in TLS as `peer`, or in plaintext) may see and
/// open `volume`: its `nbd.tls_identities` list. A volume whose
/// properties cannot be read is refused.
fn export_access(manager: &VolumeManager, volume: &ServedVolume, peer: Option<&Peer>) -> Access {
    match manager.stored_props(volume.full_name()) {
        Some(props) => tls::access(props.nbd_tls_identities(), peer),
        None => Access::Denied,
    }
}

/// The option error for an export the client may not open, if it may not.
fn refusal(access: Access, export: &str) -> Option<(u32, String)> {
    match access {
        Access::Allowed => None,
        Access::NeedsTls => Some((
            rep::ERR_TLS_REQD,
            format!("export '{export}' needs TLS (NBD_OPT_STARTTLS)"),
        )),
        Access::Denied => Some((
            rep::ERR_POLICY,
            format!("export '{export}' is not open to this client's TLS identity"),
        )),
    }
}

/// Runs option haggling, in plaintext (`peer` is `None`) or inside TLS.
async fn negotiate<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    reader: &mut BufReader<R>,
    writer: &mut W,
    manager: &VolumeManager,
    tls: &NbdTls,
    no_zeroes: bool,
    peer: Option<&Peer>,
) -> Result<Outcome, ConnectionError> {
    let mut negotiated = Negotiated::default();
    // The export the selected meta context belongs to.
    let mut meta_export: Option<String> = None;
    // In `require` mode nothing but STARTTLS (and ABORT) before TLS.
    let tls_required = tls.mode == TlsMode::Require && peer.is_none();

    for _ in 0..MAX_OPTIONS_PER_CONNECTION {
        let mut header = [0u8; proto::OPTION_HEADER_BYTES];
        reader.read_exact(&mut header).await?;
        let header = proto::parse_option_header(&header)?;
        if header.length > proto::MAX_OPTION_BYTES {
            // Reading (or skipping) gigabytes of option data would let one
            // client tie us up; refuse and hang up.
            let message = format!("option longer than {} bytes", proto::MAX_OPTION_BYTES);
            writer
                .write_all(&proto::option_reply(
                    header.option,
                    rep::ERR_TOO_BIG,
                    message.as_bytes(),
                ))
                .await?;
            return Err(ConnectionError::OptionTooLarge(header.length));
        }
        let mut data = vec![0u8; header.length as usize];
        reader.read_exact(&mut data).await?;
        let reply = |kind: u32, data: &[u8]| proto::option_reply(header.option, kind, data);
        let option = match proto::parse_option(header.option, &data) {
            Ok(option) => option,
            Err(e) => {
                writer.write_all(&reply(e.reply, e.message.as_bytes())).await?;
                continue;
            }
        };
        if tls_required && !matches!(option, ClientOption::StartTls | ClientOption::Abort) {
            if let ClientOption::ExportName(name) = option {
                // No way to refuse EXPORT_NAME but to close.
                return Err(ConnectionError::ExportRefused(name));
            }
            let message = b"TLS is required: send NBD_OPT_STARTTLS first";
            writer.write_all(&reply(rep::ERR_TLS_REQD, message)).await?;
            continue;
        }
        match option {
            ClientOption::ExportName(name) => {
                let Some(volume) = lookup_export(manager, &name) else {
                    // The protocol gives no way to refuse EXPORT_NAME but to close.
                    return Err(ConnectionError::UnknownExport(name));
                };
                if export_access(manager, &volume, peer) != Access::Allowed {
                    return Err(ConnectionError::ExportRefused(name));
                }
                if meta_export.as_deref() != Some(volume.full_name()) {
                    negotiated.base_allocation = false;
                    negotiated.changed = None;
                }
                let caps = volume.capabilities();
                let mut out = Vec::with_capacity(10 + 124);
                out.extend_from_slice(&volume.size_bytes().to_be_bytes());
                out.extend_from_slice(&proto::transmission_flags(&caps, negotiated.structured_replies).to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                writer.write_all(&out).await?;
                return Ok(Outcome::Export(volume, negotiated));
            }
            ClientOption::Abort => {
                // The client may already have closed; a failed send is fine.
                let _ = writer.write_all(&reply(rep::ACK, &[])).await;
                let _ = writer.flush().await;
                return Ok(Outcome::Abort);
            }
            ClientOption::List => {
                let mut out = Vec::new();
                // Only the exports this client may open are listed.
                let volumes = manager.volumes();
                let visible = volumes
                    .iter()
                    .filter(|volume| export_access(manager, volume, peer) == Access::Allowed);
                // Each volume, then its snapshots (read-only exports with
                // the volume's access rules).
                for volume in visible {
                    let mut names = vec![volume.full_name().to_string()];
                    names.extend(manager.snapshot_names(volume.full_name()));
                    for name in names {
                        let mut entry = (name.len() as u32).to_be_bytes().to_vec();
                        entry.extend_from_slice(name.as_bytes());
                        out.extend_from_slice(&reply(rep::SERVER, &entry));
                    }
                }
                out.extend_from_slice(&reply(rep::ACK, &[]));
                writer.write_all(&out).await?;
            }
            ClientOption::StructuredReply => {
                negotiated.structured_replies = true;
                writer.write_all(&reply(rep::ACK, &[])).await?;
            }
            ClientOption::StartTls => {
                let refused: Option<(u32, &[u8])> = if !data.is_empty() {
                    Some((rep::ERR_INVALID, b"NBD_OPT_STARTTLS takes no data"))
                } else if peer.is_some() {
                    Some((rep::ERR_INVALID, b"TLS is already negotiated"))
                } else if !tls.enabled() {
                    Some((rep::ERR_POLICY, b"TLS is off on this server (strata serve --tls)"))
                } else {
                    None
                };
                if let Some((kind, message)) = refused {
                    writer.write_all(&reply(kind, message)).await?;
                    continue;
                }
                writer.write_all(&reply(rep::ACK, &[])).await?;
                writer.flush().await?;
                return Ok(Outcome::StartTls);
            }
            ClientOption::Info { export, requests } | ClientOption::Go { export, requests } => {
                let Some(volume) = lookup_export(manager, &export) else {
                    let message = format!("no export named '{export}'");
                    writer.write_all(&reply(rep::ERR_UNKNOWN, message.as_bytes())).await?;
                    continue;
                };
                if let Some((kind, message)) = refusal(export_access(manager, &volume, peer), &export) {
                    writer.write_all(&reply(kind, message.as_bytes())).await?;
                    continue;
                }
                let caps = volume.capabilities();
                let flags = proto::transmission_flags(&caps, negotiated.structured_replies);
                let mut out = reply(rep::INFO, &proto::info_export(volume.size_bytes(), flags));
                if requests.contains(&info::NAME) {
                    out.extend_from_slice(&reply(rep::INFO, &proto::info_string(info::NAME, volume.full_name())));
                }
                if requests.contains(&info::DESCRIPTION) {
                    let description = format!("strata volume {}", volume.full_name());
                    out.extend_from_slice(&reply(rep::INFO, &proto::info_string(info::DESCRIPTION, &description)));
                }
                // Always sent: the protocol allows it unrequested, and clients
                // that honour it never send misaligned requests.
                out.extend_from_slice(&reply(rep::INFO, &proto::info_block_size(&caps)));
                out.extend_from_slice(&reply(rep::ACK, &[]));
                writer.write_all(&out).await?;
                if header.option == opt::GO {
                    // Contexts selected for another export do not apply.
                    if meta_export.as_deref() != Some(volume.full_name()) {
                        negotiated.base_allocation = false;
                        negotiated.changed = None;
                    }
                    return Ok(Outcome::Export(volume, negotiated));
                }
            }
            ClientOption::ListMetaContext { export, queries } | ClientOption::SetMetaContext { export, queries } => {
                let setting = header.option == opt::SET_META_CONTEXT;
                if setting && !negotiated.structured_replies {
                    let message = b"NBD_OPT_STRUCTURED_REPLY must be negotiated first";
                    writer.write_all(&reply(rep::ERR_INVALID, message)).await?;
                    continue;
                }
                let Some(volume) = lookup_export(manager, &export) else {
                    let message = format!("no export named '{export}'");
                    writer.write_all(&reply(rep::ERR_UNKNOWN, message.as_bytes())).await?;
                    continue;
                };
                if let Some((kind, message)) = refusal(export_access(manager, &volume, peer), &export) {
                    writer.write_all(&reply(kind, message.as_bytes())).await?;
                    continue;
                }
                // A snapshot export offers the blocks changed since each
                // older snapshot of its volume.
                let older = manager.older_snapshots(volume.full_name());
                let older_names: Vec<&str> = older.iter().map(|(name, _)| name.as_str()).collect();
                let mut contexts = proto::match_meta_contexts(&queries, !setting, &older_names);
                if setting {
                    // At most one changed-block context: the first asked for.
                    let mut changed = None;
                    contexts.retain(|(_, name)| {
                        if name == proto::BASE_ALLOCATION {
                            return true;
                        }
                        if changed.is_some() {
                            return false;
                        }
                        changed = proto::changed_context(name, &older);
                        changed.is_some()
                    });
                    negotiated.base_allocation = contexts.iter().any(|(_, name)| name == proto::BASE_ALLOCATION);
                    negotiated.changed = changed;
                    meta_export = Some(volume.full_name().to_string());
                }
                let mut out = Vec::new();
                for (id, name) in contexts {
                    let mut data = id.to_be_bytes().to_vec();
                    data.extend_from_slice(name.as_bytes());
                    out.extend_from_slice(&reply(rep::META_CONTEXT, &data));
                }
                out.extend_from_slice(&reply(rep::ACK, &[]));
                writer.write_all(&out).await?;
            }
            ClientOption::Unsupported(code) => {
                let message = format!("option {code} is not supported");
                writer.write_all(&reply(rep::ERR_UNSUP, message.as_bytes())).await?;
            }
        }
    }
    Err(ConnectionError::TooManyOptions)
}

/// Reply bytes: built in a Vec, or a read buffer with the header in its headroom.
enum ReplyBytes {
    Built(Vec<u8>),
    Read(IoBuf),
}

impl AsRef<[u8]> for Reply {
    fn as_ref(&self) -> &[u8] {
        self.bytes.as_slice()
    }
}

impl ReplyBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            ReplyBytes::Built(bytes) => bytes,
            ReplyBytes::Read(buf) => buf.as_bytes(),
        }
    }
}

/// A reply ready to send. The budget permit is released once it is written.
struct Reply {
    bytes: ReplyBytes,
    _permit: OwnedSemaphorePermit,
    /// The payload's share of the process's budget (READ and WRITE).
    _memory: Option<MemoryPermit>,
    /// Where a read buffer goes once the reply is written (or dropped).
    buffers: Arc<ReadBuffers>,
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let ReplyBytes::Read(buf) = std::mem::replace(&mut self.bytes, ReplyBytes::Built(Vec::new())) {
            self.buffers.give_back(buf);
        }
    }
}

/// Bytes of read buffers one connection keeps for its next reads at most.
const KEPT_READ_BUFFER_BYTES: usize = 8 << 20;

/// Replies carrying large reads, for the connection's [`Lane`] to send.
type Bulk = (Vec<Reply>, Arc<Outbox<Reply>>);

fn send_bulk((replies, outbox): Bulk) {
    outbox.send_all(replies);
}

/// Sends finished replies carrying `bytes` in all: from the lane if that is
/// at least [`BULK_REPLY_BYTES`] (or here if the lane has no thread), else
/// here.
fn send_replies(replies: Vec<Reply>, bytes: usize, outbox: &Arc<Outbox<Reply>>, lane: &Arc<Lane<Bulk>>) {
    if bytes < BULK_REPLY_BYTES {
        outbox.send_all(replies);
    } else if let Err(job) = lane.push((replies, outbox.clone())) {
        send_bulk(job);
    }
}

/// A large read for one of the connection's read threads: the request's
/// work (read, verify, build the reply) and where its reply goes.
struct ReadJob {
    work: std::pin::Pin<Box<dyn std::future::Future<Output = Reply> + Send>>,
    outbox: Arc<Outbox<Reply>>,
}

/// Runs a large read as far as it goes without waiting and sends its reply;
/// a read that has to wait goes on as a task, which sends the reply.
fn run_read(ReadJob { work, outbox }: ReadJob) {
    let outbox_for_task = outbox.clone();
    if let Some(reply) = crate::frontend::run_inline_or_spawn(work, move |reply| outbox_for_task.send(reply)) {
        outbox.send(reply);
    }
}

/// Replies the reader finished, sent together just before it would wait:
/// from the reader itself, or (when they carry at least
/// [`BULK_REPLY_BYTES`] of data) from the lane.
struct Ready {
    replies: Vec<Reply>,
    bytes: usize,
}

impl Ready {
    fn push(&mut self, reply: Reply) {
        self.bytes += reply.bytes.as_slice().len();
        self.replies.push(reply);
    }

    fn send(&mut self, outbox: &Arc<Outbox<Reply>>, lane: &Arc<Lane<Bulk>>) {
        if self.replies.is_empty() {
            return;
        }
        let replies = std::mem::take(&mut self.replies);
        send_replies(replies, std::mem::replace(&mut self.bytes, 0), outbox, lane);
    }
}

#[allow(clippy::too_many_arguments)]
async fn transmission<R: AsyncRead + Unpin>(
    mut reader: BufReader<R>,
    socket: ReplySocket,
    volume: Arc<ServedVolume>,
    _handle: HandleGuard,
    negotiated: Negotiated,
    idle: &AtomicBool,
    recorder: Option<Arc<Recorder>>,
    client: std::net::IpAddr,
) -> Result<(), ConnectionError> {
    let shared_memory = crate::frontend::memory::global();
    let (outbox, flusher) = Outbox::start(socket);
    let budget_units = IN_FLIGHT_BUDGET_BYTES / BUDGET_UNIT_BYTES;
    let budget = Arc::new(Semaphore::new(budget_units));
    // Replies of requests that finished on this task, sent together (one
    // writev) before the reader next waits for anything: the requests the
    // client pipelined in one segment get their replies in one.
    let mut ready = Ready {
        replies: Vec::new(),
        bytes: 0,
    };
    let lane = Lane::new(send_bulk);
    let reads = Lane::with_threads(run_read, read_threads());
    let buffers = Arc::new(ReadBuffers::new(KEPT_READ_BUFFER_BYTES));

    let result = loop {
        if reader.buffer().len() < proto::REQUEST_BYTES {
            ready.send(&outbox, &lane);
        }
        let mut header = [0u8; proto::REQUEST_BYTES];
        // Nothing buffered and nothing in flight (every reply written): the
        // client waits for us, and its next request is the next thing to
        // come; the receive may poll for it briefly (see `Receiver`).
        idle.store(
            reader.buffer().is_empty() && budget.available_permits() == budget_units,
            Ordering::Relaxed,
        );
        let read = reader.read_exact(&mut header).await;
        idle.store(false, Ordering::Relaxed);
        match read {
            Ok(_) => {}
            // A client may close without NBD_CMD_DISC.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e.into()),
        }
        let received = Instant::now();
        let request = match proto::parse_request(&header) {
            Ok(request) => request,
            Err(e) => break Err(e.into()),
        };
        if request.kind == cmd::DISC {
            break Ok(());
        }
        let payload_bytes = if request.kind == cmd::WRITE { request.length } else { 0 };
        if payload_bytes > MAX_REQUEST_BYTES {
            // We cannot stay in step without reading the payload; a payload
            // this size is treated as an attack and the connection dropped.
            break Err(ConnectionError::PayloadTooLarge(payload_bytes));
        }
        let data_bytes = match request.kind {
            cmd::READ | cmd::WRITE => (request.length.min(MAX_REQUEST_BYTES)) as usize,
            _ => 0,
        };
        let units = (data_bytes / BUDGET_UNIT_BYTES + 1) as u32;
        let permit = match budget.clone().try_acquire_many_owned(units) {
            Ok(permit) => permit,
            Err(_) => {
                // Replies we hold keep budget; send them before waiting.
                ready.send(&outbox, &lane);
                match budget.clone().acquire_many_owned(units).await {
                    Ok(permit) => permit,
                    Err(_) => break Ok(()),
                }
            }
        };
        // The process-wide share, after the connection's own: waiting for
        // it stops this connection's reading, nobody else's.
        let memory = if data_bytes > 0 {
            Some(match shared_memory.try_acquire(client, data_bytes as u64) {
                Some(permit) => permit,
                None => {
                    ready.send(&outbox, &lane);
                    shared_memory.acquire(client, data_bytes as u64).await
                }
            })
        } else {
            None
        };
        let payload = if payload_bytes > 0 {
            if reader.buffer().len() < payload_bytes as usize {
                ready.send(&outbox, &lane);
            }
            // Large payloads are checksummed (per sector) as they arrive:
            // the bytes are still in cache, and the reader would otherwise
            // only wait for the rest of them.
            let received = if payload_bytes as usize >= SUM_WHILE_RECEIVING_BYTES {
                IoBuf::read_from_summing(&mut reader, payload_bytes as usize).await
            } else {
                IoBuf::read_from(&mut reader, payload_bytes as usize).await
            };
            match received {
                Ok(data) => Some(data),
                Err(e) => break Err(e.into()),
            }
        } else {
            None
        };
        if let Err(errno) = proto::check_request(&request, &negotiated) {
            let bytes = error_reply(&request, &negotiated, errno, "invalid request type or flags");
            ready.push(Reply {
                bytes: ReplyBytes::Built(bytes),
                _permit: permit,
                _memory: memory,
                buffers: buffers.clone(),
            });
            continue;
        }
        let (volume, buffers, recorder) = (volume.clone(), buffers.clone(), recorder.clone());
        let work = async move {
            let bytes = execute(&volume, &recorder, request, payload, negotiated, received, &buffers).await;
            Reply {
                bytes,
                _permit: permit,
                _memory: memory,
                buffers,
            }
        };
        if request.kind == cmd::READ && data_bytes >= BULK_REPLY_BYTES {
            // A large read runs whole on one of the connection's read
            // threads: the reader goes on parsing while it is read,
            // verified and sent.
            match reads.push(ReadJob {
                work: Box::pin(work),
                outbox: outbox.clone(),
            }) {
                Ok(()) => continue,
                Err(job) => {
                    run_read(job);
                    continue;
                }
            }
        }
        let (outbox_for_task, lane_for_task) = (outbox.clone(), lane.clone());
        let finish = move |reply: Reply| {
            // A large read that had to wait: its reply leaves from the lane
            // too, not from the worker the reader may need.
            let bytes = reply.bytes.as_slice().len();
            send_replies(vec![reply], bytes, &outbox_for_task, &lane_for_task);
        };
        if let Some(reply) = crate::frontend::run_inline_or_spawn(work, finish) {
            ready.push(reply);
            if ready.bytes >= BULK_REPLY_BYTES {
                ready.send(&outbox, &lane);
            }
        }
    };
    ready.send(&outbox, &lane);
    // Outstanding requests finish and their replies are sent (or dropped,
    // if the client is gone) before the connection closes: every request
    // holds budget until then.
    let _ = budget.acquire_many(budget_units as u32).await;
    outbox.close();
    let _ = flusher.await;
    result
}

fn op_of(kind: u16) -> Op {
    match kind {
        cmd::READ => Op::Read,
        cmd::WRITE => Op::Write,
        cmd::FLUSH => Op::Flush,
        cmd::TRIM => Op::Trim,
        cmd::WRITE_ZEROES => Op::WriteZeroes,
        cmd::CACHE => Op::Cache,
        _ => Op::BlockStatus,
    }
}

/// An error reply: structured (with a message) when negotiated, else simple.
fn error_reply(request: &Request, negotiated: &Negotiated, errno: u32, message: &str) -> Vec<u8> {
    if negotiated.structured_replies {
        proto::error_chunk(request.cookie, errno, message)
    } else {
        proto::simple_reply(errno, request.cookie)
    }
}

fn log_error(volume: &ServedVolume, request: &Request, error: &BlockError) {
    match error {
        BlockError::Io(_) | BlockError::Checksum { .. } => tracing::warn!(
            "nbd: {} {} at {} (+{}) failed: {error}",
            volume.full_name(),
            op_of(request.kind).as_str(),
            request.offset,
            request.length
        ),
        _ => tracing::debug!("nbd: {}: {error}", volume.full_name()),
    }
}

/// Runs one request and builds its reply.
async fn execute(
    volume: &ServedVolume,
    recorder: &Option<Arc<Recorder>>,
    request: Request,
    payload: Option<IoBuf>,
    negotiated: Negotiated,
    received: Instant,
    buffers: &ReadBuffers,
) -> ReplyBytes {
    let op = op_of(request.kind);
    let offset = request.offset;
    let Some(recorder) = recorder else {
        let (bytes, moved, ok) = run(volume, request, payload, negotiated, buffers).await;
        volume.stats().record(Protocol::Nbd, op, moved, received.elapsed(), ok);
        return bytes;
    };
    // Analytics: what it waited for before it ran, and for log commits.
    let queued = received.elapsed();
    let ((bytes, moved, ok), phases) = phase::measure(run(volume, request, payload, negotiated, buffers)).await;
    let latency = received.elapsed();
    volume.stats().record(Protocol::Nbd, op, moved, latency, ok);
    let split = Split {
        queued_ns: queued.as_nanos() as u64,
        commit_ns: phases.commit_ns.get(),
    };
    recorder.record(op, offset, moved, latency, ok, split);
    bytes
}

/// Runs one request: its reply, the bytes it moved (read or written) and
/// whether it succeeded.
async fn run(
    volume: &ServedVolume,
    request: Request,
    payload: Option<IoBuf>,
    negotiated: Negotiated,
    buffers: &ReadBuffers,
) -> (ReplyBytes, u64, bool) {
    let fua = request.flags & cflag::FUA != 0;
    let offset = request.offset;
    let length = request.length as u64;
    let result = match request.kind {
        cmd::READ => {
            let (bytes, ok) = read_reply(volume, &request, &negotiated, buffers).await;
            return (bytes, length, ok);
        }
        cmd::WRITE => volume
            .write(offset, payload.unwrap_or_default(), fua)
            .await
            .map(|()| None),
        cmd::FLUSH => volume.flush().await.map(|()| None),
        cmd::TRIM => volume.trim(offset, length, fua).await.map(|()| None),
        cmd::WRITE_ZEROES => {
            let flags = ZeroFlags {
                may_trim: request.flags & cflag::NO_HOLE == 0,
                fast_only: request.flags & cflag::FAST_ZERO != 0,
                fua,
            };
            volume.write_zeroes(offset, length, flags).await.map(|()| None)
        }
        cmd::CACHE => volume.cache(offset, length).await.map(|()| None),
        _ => block_status(volume, &request, &negotiated).await.map(Some),
    };
    let moved = if matches!(request.kind, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES) {
        length
    } else {
        0
    };
    let ok = result.is_ok();
    let bytes = match result {
        Ok(Some(chunk)) => chunk,
        Ok(None) => proto::simple_reply(0, request.cookie),
        Err(e) => {
            log_error(volume, &request, &e);
            error_reply(
                &request,
                &negotiated,
                proto::errno_for(&e, request.kind),
                &e.to_string(),
            )
        }
    };
    (ReplyBytes::Built(bytes), moved, ok)
}

/// The chunks of a BLOCK_STATUS reply: one per selected context,
/// `base:allocation` first, the last one final.
async fn block_status(
    volume: &ServedVolume,
    request: &Request,
    negotiated: &Negotiated,
) -> Result<Vec<u8>, BlockError> {
    let req_one = request.flags & cflag::REQ_ONE != 0;
    let (offset, length) = (request.offset, request.length as u64);
    let mut out = Vec::new();
    if negotiated.base_allocation {
        let extents = volume.block_status(offset, length).await?;
        proto::push_block_status(
            &mut out,
            request.cookie,
            proto::BASE_ALLOCATION_ID,
            proto::allocation_descriptors(&extents),
            request.length,
            req_one,
            negotiated.changed.is_none(),
        );
    }
    if let Some(context) = negotiated.changed {
        let runs = volume.changed_since(context.older, offset, length).await?;
        proto::push_block_status(
            &mut out,
            request.cookie,
            context.id,
            proto::changed_descriptors(&runs),
            request.length,
            req_one,
            true,
        );
    }
    Ok(out)
}

/// Reads and builds the reply. Without structured replies: a simple reply
/// followed by the data. With them: one data chunk, or (unless the client set
/// DF) hole chunks for 4 KiB runs of zeros and data chunks between.
async fn read_reply(
    volume: &ServedVolume,
    request: &Request,
    negotiated: &Negotiated,
    buffers: &ReadBuffers,
) -> (ReplyBytes, bool) {
    let failed = |e: BlockError| {
        log_error(volume, request, &e);
        let errno = proto::errno_for(&e, request.kind);
        (
            ReplyBytes::Built(error_reply(request, negotiated, errno, &e.to_string())),
            false,
        )
    };
    if let Err(e) = volume.check_range(request.offset, request.length as u64, true) {
        return failed(e);
    }
    let headroom = if negotiated.structured_replies {
        STRUCTURED_READ_HEADROOM
    } else {
        proto::SIMPLE_REPLY_BYTES
    };
    let buf = buffers.take(headroom, request.length as usize);
    let (mut buf, result) = volume.read(request.offset, buf).await;
    if let Err(e) = result {
        return failed(e);
    }
    if !negotiated.structured_replies {
        proto::put_simple_reply(buf.headroom_mut(), 0, request.cookie);
        return (ReplyBytes::Read(buf), true);
    }
    let runs = if request.flags & cflag::DF != 0 {
        Vec::new()
    } else {
        proto::zero_runs(buf.payload())
    };
    if runs.iter().all(|run| !run.0) {
        // All data: send the buffer as one chunk, header written in place.
        let chunk_length = (8 + request.length as usize) as u32;
        let head = buf.headroom_mut();
        proto::put_chunk_header(head, chunk::FLAG_DONE, chunk::OFFSET_DATA, request.cookie, chunk_length);
        head[proto::CHUNK_HEADER_BYTES..].copy_from_slice(&request.offset.to_be_bytes());
        return (ReplyBytes::Read(buf), true);
    }
    let data = buf.payload();
    let mut out = Vec::with_capacity(data.len() + runs.len() * STRUCTURED_READ_HEADROOM);
    for (index, &(zero, start, end)) in runs.iter().enumerate() {
        let flags = if index + 1 == runs.len() { chunk::FLAG_DONE } else { 0 };
        let chunk_offset = (request.offset + start as u64).to_be_bytes();
        if zero {
            let mut payload = chunk_offset.to_vec();
            payload.extend_from_slice(&((end - start) as u32).to_be_bytes());
            proto::push_chunk(&mut out, flags, chunk::OFFSET_HOLE, request.cookie, &payload);
        } else {
            let mut payload = Vec::with_capacity(8 + end - start);
            payload.extend_from_slice(&chunk_offset);
            payload.extend_from_slice(&data[start..end]);
            proto::push_chunk(&mut out, flags, chunk::OFFSET_DATA, request.cookie, &payload);
        }
    }
    buffers.give_back(buf);
    (ReplyBytes::Built(out), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_buffer_of(stream: &TcpStream) -> libc::c_int {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid descriptor and an out-parameter of the size given.
        let result = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                &mut value as *mut libc::c_int as *mut libc::c_void,
                &mut len,
            )
        };
        assert_eq!(result, 0);
        value
    }

    #[tokio::test]
    async fn the_send_buffer_is_set_as_asked_and_zero_leaves_the_kernels() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (first, second) = tokio::join!(TcpStream::connect(address), TcpStream::connect(address));
        let (first, second) = (first.unwrap(), second.unwrap());
        let untouched = send_buffer_of(&second);
        set_send_buffer(&first, DEFAULT_SEND_BUFFER_BYTES);
        // Linux caps the value at net.core.wmem_max and keeps twice that
        // (its bookkeeping share).
        let cap = wmem_max().unwrap_or(u64::MAX);
        assert_eq!(send_buffer_of(&first) as u64, 2 * DEFAULT_SEND_BUFFER_BYTES.min(cap));
        set_send_buffer(&second, 0);
        assert_eq!(send_buffer_of(&second), untouched);
        assert_ne!(untouched as u64, 2 * DEFAULT_SEND_BUFFER_BYTES.min(cap));
    }
}
