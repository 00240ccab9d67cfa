//! A connection's outgoing replies, written by whoever produced them.
//!
//! A request that completes on the connection's reader (most do: a RAM-tier
//! write, a page-cache read) or on its own task hands its reply to the
//! outbox, which writes it to the socket at once with a non-blocking
//! `writev` when nothing is queued ahead of it. Only what the socket will
//! not take now is left for the connection's flusher task, which waits for
//! the socket to become writable. So a reply costs no task hand-off and no
//! cross-thread wake-up unless the client is slow to read.
//!
//! The outbox writes to its own descriptor of the socket, registered with
//! tokio for writability only ([`ReplySocket`]): the connection's reader
//! has the socket's readability to itself (its own registration), and a
//! second registration that also asked for readability would wake an idle
//! tokio worker once more for every segment that arrives.
//!
//! All writes happen under one lock, so the bytes of two replies never
//! interleave; replies queued together go out in one `writev` (up to
//! [`MAX_PER_WRITE`]). A reply is dropped once written (releasing whatever it
//! holds, such as its share of the connection's in-flight budget), or at
//! once if the connection is broken.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::{Arc, Mutex, MutexGuard};

use std::os::fd::{AsRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;

/// Replies merged into one `writev` at most.
pub const MAX_PER_WRITE: usize = 64;

/// The sending side of a connected stream socket (TCP, or the Unix socket
/// behind a TLS connection's pump): a descriptor of its own
/// (a duplicate), registered with tokio's reactor for writability only, so
/// that incoming data never wakes a reactor thread. Sends never block
/// (`MSG_DONTWAIT`, whatever the socket's mode). Dropping it shuts down the
/// socket's write side, as the peer expects once the last reply is sent.
pub struct ReplySocket {
    fd: AsyncFd<OwnedFd>,
}

impl ReplySocket {
    /// Takes `socket` (typically a `try_clone` of the connection's socket).
    /// Must be called inside a tokio runtime.
    pub fn new(socket: impl Into<OwnedFd>) -> std::io::Result<Self> {
        // SAFETY: the `OwnedFd` owns its descriptor, which stays open and
        // the same until the `AsyncFd` (owning it) is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(socket.into(), Interest::WRITABLE) }?;
        Ok(ReplySocket { fd })
    }

    /// One non-blocking `sendmsg` of `slices`: the bytes the socket took,
    /// or `WouldBlock`.
    fn try_write_vectored(&self, slices: &[IoSlice<'_>]) -> std::io::Result<usize> {
        // SAFETY: an all-zero msghdr is valid (no address, no control data).
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        // `IoSlice` is ABI-compatible with `iovec` on Unix; sendmsg only reads them.
        message.msg_iov = slices.as_ptr() as *mut libc::iovec;
        message.msg_iovlen = slices.len() as _;
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        // SAFETY: the descriptor is open for as long as `self.fd` lives, and
        // every iovec points into a live slice.
        let sent = unsafe { libc::sendmsg(self.fd.get_ref().as_raw_fd(), &message, flags) };
        if sent < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(sent as usize)
        }
    }

    /// Waits until the socket may take more bytes (or has failed).
    async fn writable(&self) -> std::io::Result<()> {
        let mut guard = self.fd.writable().await?;
        // Edge-triggered: forget this readiness; the caller tries a write
        // next, and a socket that is still full sets a new edge when room
        // appears.
        guard.clear_ready();
        Ok(())
    }
}

impl Drop for ReplySocket {
    fn drop(&mut self) {
        // SAFETY: shutdown(2) on a descriptor this socket owns.
        unsafe { libc::shutdown(self.fd.get_ref().as_raw_fd(), libc::SHUT_WR) };
    }
}

pub struct Outbox<T> {
    socket: ReplySocket,
    state: Mutex<State<T>>,
    /// Tells the flusher that replies wait for the socket, or that the
    /// connection is closing.
    wake: Notify,
}

struct State<T> {
    queue: VecDeque<T>,
    /// Bytes of the queue's first reply already written.
    head_written: usize,
    /// The socket refused more bytes; the flusher is waiting for room.
    blocked: bool,
    /// A write failed: replies are dropped unsent.
    broken: bool,
    /// No more replies will come; the flusher ends once the queue is empty.
    closing: bool,
}

impl<T: AsRef<[u8]> + Send + 'static> Outbox<T> {
    /// Wraps `socket` and starts the flusher task. The write side of the
    /// socket is shut down when the outbox is closed and drained (or broken).
    pub fn start(socket: ReplySocket) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let outbox = Arc::new(Outbox {
            socket,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                head_written: 0,
                blocked: false,
                broken: false,
                closing: false,
            }),
            wake: Notify::new(),
        });
        let flusher = tokio::spawn(outbox.clone().flush_until_closed());
        (outbox, flusher)
    }

    /// Queues one reply and writes what the socket takes now.
    pub fn send(&self, reply: T) {
        self.send_all(std::iter::once(reply));
    }

    /// Queues replies in order and writes what the socket takes now.
    pub fn send_all(&self, replies: impl IntoIterator<Item = T>) {
        let mut state = self.lock();
        if state.broken {
            return;
        }
        let before = state.queue.len();
        state.queue.extend(replies);
        if state.queue.len() == before {
            return;
        }
        if !state.blocked {
            self.write_now(&mut state);
            if !state.queue.is_empty() {
                // The socket is full: the flusher waits for room.
                state.blocked = true;
                drop(state);
                self.wake.notify_one();
            }
        }
    }

    /// No more replies will be sent: the flusher writes what is queued and
    /// ends. Await the handle [`Outbox::start`] returned to know when.
    pub fn close(&self) {
        self.lock().closing = true;
        self.wake.notify_one();
    }

    /// Whether a write failed (the peer is gone).
    pub fn is_broken(&self) -> bool {
        self.lock().broken
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding the lock cannot leave the queue half-updated
        // in a way that matters more than the panic itself.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Writes queued replies until the queue is empty or the socket would
    /// block. Marks the outbox broken (and drops everything) on an error.
    fn write_now(&self, state: &mut State<T>) {
        while !state.queue.is_empty() {
            let written = {
                let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(state.queue.len().min(MAX_PER_WRITE));
                for (index, reply) in state.queue.iter().take(MAX_PER_WRITE).enumerate() {
                    let bytes = reply.as_ref();
                    let bytes = if index == 0 {
                        &bytes[state.head_written..]
                    } else {
                        bytes
                    };
                    slices.push(IoSlice::new(bytes));
                }
                self.socket.try_write_vectored(&slices)
            };
            match written {
                Ok(0) => {
                    state.fail("socket accepted no bytes");
                    return;
                }
                Ok(mut written) => {
                    while written > 0 {
                        let left = state.queue[0].as_ref().len() - state.head_written;
                        if written >= left {
                            written -= left;
                            state.head_written = 0;
                            state.queue.pop_front();
                        } else {
                            state.head_written += written;
                            written = 0;
                        }
                    }
                    // Empty replies (none are built today) would never be
                    // popped by a write; drop them here.
                    while state.head_written == 0 && state.queue.front().is_some_and(|r| r.as_ref().is_empty()) {
                        state.queue.pop_front();
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    state.fail(&e.to_string());
                    return;
                }
            }
        }
    }

    async fn flush_until_closed(self: Arc<Self>) {
        loop {
            self.wake.notified().await;
            loop {
                {
                    let mut state = self.lock();
                    if state.broken || (state.closing && state.queue.is_empty()) {
                        return;
                    }
                    if state.queue.is_empty() {
                        state.blocked = false;
                        break;
                    }
                    self.write_now(&mut state);
                    if state.queue.is_empty() {
                        state.blocked = false;
                        if state.closing {
                            return;
                        }
                        break;
                    }
                    state.blocked = true;
                }
                if let Err(e) = self.socket.writable().await {
                    self.lock().fail(&e.to_string());
                    return;
                }
            }
        }
    }
}

impl<T> State<T> {
    fn fail(&mut self, why: &str) {
        tracing::debug!("sending replies failed: {why}");
        self.broken = true;
        self.queue.clear();
        self.head_written = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connected pair on loopback: (our reply socket, the peer).
    async fn pair() -> (ReplySocket, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
        // In blocking mode, as the NBD server leaves it: sends must still
        // never block. The original descriptor may go: the duplicate keeps
        // the socket open.
        let ours = accepted.unwrap().0.into_std().unwrap();
        ours.set_nonblocking(false).unwrap();
        (ReplySocket::new(ours.try_clone().unwrap()).unwrap(), client.unwrap())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replies_arrive_whole_and_in_order_when_the_peer_reads_late() {
        let (socket, mut peer) = pair().await;
        let (outbox, flusher) = Outbox::start(socket);
        // 64 replies of 256 KiB, far more than the socket buffers hold while
        // the peer is not reading: `send` must return at once every time
        // (the rest waits for the flusher), never block or reorder.
        let mut expected = Vec::new();
        for i in 0..64u32 {
            let reply: Vec<u8> = (0..256 * 1024u32).map(|j| (i.wrapping_mul(31) ^ j) as u8).collect();
            expected.extend_from_slice(&reply);
            outbox.send(reply);
        }
        outbox.send_all(vec![b"tail".to_vec(), Vec::new(), b"end".to_vec()]);
        expected.extend_from_slice(b"tailend");
        outbox.close();
        // The socket closes (and the peer sees the end) once the flusher,
        // holding the last reference, has written everything.
        drop(outbox);
        let mut received = Vec::new();
        peer.read_to_end(&mut received).await.unwrap();
        flusher.await.unwrap();
        assert_eq!(received.len(), expected.len());
        assert!(received == expected, "bytes differ");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gone_peer_drops_replies_instead_of_blocking() {
        let (socket, peer) = pair().await;
        let (outbox, flusher) = Outbox::start(socket);
        drop(peer);
        let held = std::sync::Arc::new(());
        struct Tracked(#[allow(dead_code)] std::sync::Arc<()>, Vec<u8>);
        impl AsRef<[u8]> for Tracked {
            fn as_ref(&self) -> &[u8] {
                &self.1
            }
        }
        // Keep sending until the reset is seen; each reply must be released
        // (its Arc dropped) once the outbox knows the peer is gone.
        for _ in 0..2000 {
            outbox.send(Tracked(held.clone(), vec![7u8; 64 * 1024]));
            tokio::task::yield_now().await;
        }
        assert!(outbox.is_broken(), "writes to a closed peer failed");
        outbox.close();
        tokio::time::timeout(std::time::Duration::from_secs(10), flusher)
            .await
            .expect("the flusher ends")
            .unwrap();
        assert_eq!(std::sync::Arc::strong_count(&held), 1, "replies still held");
    }
}
