//! The io_uring engine: one thread owns a ring and serves every device.
//!
//! Submitters (any tokio task) send a request — the operation, the file, the
//! offset, the owned [`IoBuf`] and a oneshot reply channel — over a channel
//! and wake the ring thread through an eventfd. The ring itself keeps a read
//! armed on that eventfd, so the ring thread sleeps in `io_uring_enter`
//! waiting for either a completion or new work, and everything that queued up
//! while it was busy goes into the kernel with one submission. Submitters
//! only write the eventfd when the thread may be asleep (`wake_pending`), so
//! under load most requests cost no wake-up syscall at all.
//!
//! The buffer and an `Arc<File>` stay inside the request until its
//! completion is reaped, so the kernel never writes into freed memory or a
//! recycled descriptor, even when the caller's future was dropped.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use io_uring::{opcode, squeue, types, IoUring};
use tokio::sync::oneshot;

use super::IoBuf;

/// Submission queue entries; the completion queue gets twice as many.
const RING_ENTRIES: u32 = 256;
/// Requests in the kernel at once (one entry stays for the eventfd read).
const MAX_IN_FLIGHT: usize = RING_ENTRIES as usize - 1;
/// user_data of the eventfd read; request slots use their index.
const EVENTFD_TOKEN: u64 = u64::MAX;
/// Largest read or write put in one entry; longer requests continue as if
/// the kernel had returned a short count.
const MAX_ENTRY_BYTES: usize = 1 << 30;
/// EINTR/EAGAIN resubmissions before a request is failed.
const MAX_RETRIES: u32 = 1000;

/// The shared io_uring engine. Create it with [`UringEngine::shared`] (one
/// ring per process) or [`UringEngine::new`] (a private ring).
pub struct UringEngine {
    sender: mpsc::Sender<Message>,
    waker: Arc<Waker>,
}

struct Waker {
    eventfd: OwnedFd,
    /// True from the first wake-up write until the ring thread has reaped
    /// the eventfd read: further submitters need not write again.
    wake_pending: AtomicBool,
}

impl Waker {
    fn wake(&self) {
        if !self.wake_pending.swap(true, Ordering::AcqRel) {
            self.write_eventfd();
        }
    }

    fn write_eventfd(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. The
        // eventfd is blocking but a write only blocks when the counter would
        // overflow, which needs 2^64 wake-ups without a read.
        let written = unsafe { libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if written != 8 {
            tracing::error!(
                "io_uring engine: eventfd wake-up failed: {}",
                io::Error::last_os_error()
            );
        }
    }
}

enum Message {
    Request(Request),
    Shutdown,
}

struct Request {
    /// Keeps the descriptor open until the completion is reaped.
    file: Arc<File>,
    offset: u64,
    retries: u32,
    op: Op,
}

enum Op {
    Read {
        buf: IoBuf,
        done: usize,
        reply: oneshot::Sender<(IoBuf, io::Result<()>)>,
    },
    Write {
        buf: IoBuf,
        done: usize,
        reply: oneshot::Sender<(IoBuf, io::Result<()>)>,
    },
    Fsync {
        /// Bytes from the request's offset to sync; 0 is the whole file.
        len: u32,
        reply: oneshot::Sender<io::Result<()>>,
    },
}

impl Request {
    /// Sends the result to the submitter. A submitter that went away (its
    /// future was dropped) simply does not get it; the buffer is freed here,
    /// after the kernel is done with it.
    fn finish(self, result: io::Result<()>) {
        match self.op {
            Op::Read { buf, reply, .. } | Op::Write { buf, reply, .. } => {
                let _ = reply.send((buf, result));
            }
            Op::Fsync { reply, .. } => {
                let _ = reply.send(result);
            }
        }
    }

    /// The submission entry for the part of the request still to do.
    fn entry(&mut self, slot: usize) -> squeue::Entry {
        let fd = types::Fd(self.file.as_raw_fd());
        let entry = match &mut self.op {
            Op::Read { buf, done, .. } => {
                let rest = &mut buf.payload_mut()[*done..];
                let len = rest.len().min(MAX_ENTRY_BYTES) as u32;
                opcode::Read::new(fd, rest.as_mut_ptr(), len)
                    .offset(self.offset + *done as u64)
                    .build()
            }
            Op::Write { buf, done, .. } => {
                let rest = &buf.payload()[*done..];
                let len = rest.len().min(MAX_ENTRY_BYTES) as u32;
                opcode::Write::new(fd, rest.as_ptr(), len)
                    .offset(self.offset + *done as u64)
                    .build()
            }
            Op::Fsync { len, .. } => opcode::Fsync::new(fd)
                .offset(self.offset)
                .len(*len)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        entry.user_data(slot as u64)
    }

    /// Applies a completion: `Some(result)` when the request is finished,
    /// `None` when the rest must be resubmitted (short count, EINTR, EAGAIN).
    fn complete(&mut self, res: i32) -> Option<io::Result<()>> {
        if res < 0 {
            let errno = -res;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && self.retries < MAX_RETRIES {
                self.retries += 1;
                return None;
            }
            return Some(Err(io::Error::from_raw_os_error(errno)));
        }
        match &mut self.op {
            Op::Fsync { .. } => Some(Ok(())),
            Op::Read { buf, done, .. } => advance(buf.len(), done, res, "read"),
            Op::Write { buf, done, .. } => advance(buf.len(), done, res, "write"),
        }
    }
}

/// Counts `res` transferred bytes; finished when all `total` are done.
fn advance(total: usize, done: &mut usize, res: i32, what: &str) -> Option<io::Result<()>> {
    if res == 0 {
        // A zero count inside the device means the file shrank under us (or
        // the device refuses to make progress): an error, never a retry loop.
        let kind = if what == "read" {
            io::ErrorKind::UnexpectedEof
        } else {
            io::ErrorKind::WriteZero
        };
        return Some(Err(io::Error::new(
            kind,
            format!("{what} returned 0 bytes inside the device"),
        )));
    }
    *done += res as usize;
    if *done >= total {
        Some(Ok(()))
    } else {
        None
    }
}

impl UringEngine {
    /// The process-wide engine, started (and probed) on first use. The error
    /// says why io_uring is unavailable; it is computed once.
    pub fn shared() -> Result<Arc<UringEngine>, String> {
        static SHARED: OnceLock<Result<Arc<UringEngine>, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| UringEngine::new().map_err(|e| e.to_string()))
            .clone()
    }

    /// Probes io_uring and starts a private ring thread. Fails when the ring
    /// cannot be set up (EPERM from seccomp or `kernel.io_uring_disabled`,
    /// ENOSYS on old kernels), when READ, WRITE or FSYNC are not supported,
    /// or when a NOP does not complete.
    pub fn new() -> io::Result<Arc<UringEngine>> {
        let mut ring: IoUring = IoUring::builder().setup_cqsize(RING_ENTRIES * 2).build(RING_ENTRIES)?;
        let mut probe = io_uring::Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, name) in [
            (opcode::Read::CODE, "READ"),
            (opcode::Write::CODE, "WRITE"),
            (opcode::Fsync::CODE, "FSYNC"),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("io_uring op {name} unsupported"),
                ));
            }
        }
        // A NOP round trip proves io_uring_enter works (seccomp filters may
        // allow setup and block enter).
        // SAFETY: a NOP references no memory.
        unsafe {
            ring.submission()
                .push(&opcode::Nop::new().build().user_data(0))
                .map_err(|_| io::Error::other("io_uring probe: submission queue full"))?;
        }
        ring.submit_and_wait(1)?;
        let nop = ring
            .completion()
            .next()
            .ok_or_else(|| io::Error::other("io_uring probe: NOP did not complete"))?;
        if nop.result() < 0 {
            return Err(io::Error::from_raw_os_error(-nop.result()));
        }

        // SAFETY: eventfd takes no pointers; the result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(raw) };
        let waker = Arc::new(Waker {
            eventfd,
            wake_pending: AtomicBool::new(false),
        });
        let (sender, receiver) = mpsc::channel();
        let thread_waker = waker.clone();
        std::thread::Builder::new()
            .name("strata-uring".into())
            .spawn(move || RingThread::new(ring, receiver, thread_waker).run())?;
        Ok(Arc::new(UringEngine { sender, waker }))
    }

    fn submit(&self, request: Request) {
        if let Err(mpsc::SendError(message)) = self.sender.send(Message::Request(request)) {
            if let Message::Request(request) = message {
                request.finish(Err(io::Error::other("io_uring engine thread has stopped")));
            }
            return;
        }
        self.waker.wake();
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub async fn read(&self, file: Arc<File>, offset: u64, buf: IoBuf) -> (IoBuf, io::Result<()>) {
        self.read_rest(file, offset, buf, 0).await
    }

    /// Reads the part of `buf` after its first `done` bytes (which the
    /// caller already filled) from `offset + done`.
    pub async fn read_rest(&self, file: Arc<File>, offset: u64, buf: IoBuf, done: usize) -> (IoBuf, io::Result<()>) {
        if done >= buf.len() {
            return (buf, Ok(()));
        }
        let len = buf.len();
        let (reply, result) = oneshot::channel();
        self.submit(Request {
            file,
            offset,
            retries: 0,
            op: Op::Read { buf, done, reply },
        });
        result.await.unwrap_or_else(|_| (IoBuf::new(len), Err(lost_request())))
    }

    /// Writes all of `buf` at `offset`.
    pub async fn write(&self, file: Arc<File>, offset: u64, buf: IoBuf) -> (IoBuf, io::Result<()>) {
        if buf.is_empty() {
            return (buf, Ok(()));
        }
        let len = buf.len();
        let (reply, result) = oneshot::channel();
        self.submit(Request {
            file,
            offset,
            retries: 0,
            op: Op::Write { buf, done: 0, reply },
        });
        result.await.unwrap_or_else(|_| (IoBuf::new(len), Err(lost_request())))
    }

    /// IORING_OP_FSYNC with IORING_FSYNC_DATASYNC (fdatasync).
    pub async fn fdatasync(&self, file: Arc<File>) -> io::Result<()> {
        self.fdatasync_range(file, 0, 0).await
    }

    /// fdatasync of `[offset, offset + len)` only (the kernel's
    /// `vfs_fsync_range`: the range's dirty pages, the metadata needed to
    /// find them, and a device cache flush); `len` 0 is the whole file.
    pub async fn fdatasync_range(&self, file: Arc<File>, offset: u64, len: u32) -> io::Result<()> {
        let (reply, result) = oneshot::channel();
        self.submit(Request {
            file,
            offset,
            retries: 0,
            op: Op::Fsync { len, reply },
        });
        result.await.unwrap_or_else(|_| Err(lost_request()))
    }
}

fn lost_request() -> io::Error {
    io::Error::other("io_uring engine dropped the request")
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The thread finishes what is in flight (buffers must outlive the
        // kernel's use of them), then exits.
        let _ = self.sender.send(Message::Shutdown);
        self.waker.wake();
    }
}

struct RingThread {
    ring: IoUring,
    receiver: mpsc::Receiver<Message>,
    waker: Arc<Waker>,
    slots: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    in_flight: usize,
    /// Slots whose remainder must be submitted again.
    resubmit: VecDeque<usize>,
    eventfd_buf: Box<u64>,
    eventfd_armed: bool,
    shutting_down: bool,
}

impl RingThread {
    fn new(ring: IoUring, receiver: mpsc::Receiver<Message>, waker: Arc<Waker>) -> Self {
        RingThread {
            ring,
            receiver,
            waker,
            slots: (0..MAX_IN_FLIGHT).map(|_| None).collect(),
            free_slots: (0..MAX_IN_FLIGHT).rev().collect(),
            in_flight: 0,
            resubmit: VecDeque::new(),
            eventfd_buf: Box::new(0),
            eventfd_armed: false,
            shutting_down: false,
        }
    }

    fn run(mut self) {
        let mut completions: Vec<(u64, i32)> = Vec::with_capacity(RING_ENTRIES as usize * 2);
        let mut self_woken = false;
        loop {
            if !self.eventfd_armed && !self.shutting_down {
                let entry = opcode::Read::new(
                    types::Fd(self.waker.eventfd.as_raw_fd()),
                    (&mut *self.eventfd_buf as *mut u64).cast(),
                    8,
                )
                .build()
                .user_data(EVENTFD_TOKEN);
                // SAFETY: the 8-byte buffer is a Box owned by this thread that
                // lives until the read's completion is reaped (run() does not
                // return while the read is armed).
                if unsafe { self.push(&entry) } {
                    self.eventfd_armed = true;
                }
            }
            while let Some(slot) = self.resubmit.pop_front() {
                if !self.push_slot(slot) {
                    self.resubmit.push_front(slot);
                    break;
                }
            }
            while !self.shutting_down && self.in_flight < MAX_IN_FLIGHT {
                match self.receiver.try_recv() {
                    Ok(Message::Request(request)) => self.start(request),
                    Ok(Message::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => self.shutting_down = true,
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            if self.shutting_down {
                if self.in_flight == 0 && !self.eventfd_armed {
                    return;
                }
                if self.eventfd_armed && !self_woken {
                    // Completes our own armed read so its buffer can go.
                    self.waker.write_eventfd();
                    self_woken = true;
                }
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => {
                    tracing::error!("io_uring engine: io_uring_enter failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            completions.clear();
            completions.extend(self.ring.completion().map(|cqe| (cqe.user_data(), cqe.result())));
            for &(user_data, res) in &completions {
                if user_data == EVENTFD_TOKEN {
                    self.eventfd_armed = false;
                    // Swap, not store: the acquire pairs with submitters'
                    // release so every request sent before their (skipped)
                    // wake-up is seen by the next try_recv loop.
                    self.waker.wake_pending.swap(false, Ordering::AcqRel);
                    continue;
                }
                self.complete(user_data as usize, res);
            }
        }
    }

    fn start(&mut self, request: Request) {
        let Some(slot) = self.free_slots.pop() else {
            // Unreachable: callers check in_flight < MAX_IN_FLIGHT first.
            request.finish(Err(io::Error::other("io_uring engine: no free slot")));
            return;
        };
        self.slots[slot] = Some(request);
        self.in_flight += 1;
        if !self.push_slot(slot) {
            self.resubmit.push_back(slot);
        }
    }

    /// Pushes the entry for a slot; false if the submission queue is full.
    fn push_slot(&mut self, slot: usize) -> bool {
        let Some(request) = self.slots[slot].as_mut() else {
            return true;
        };
        let entry = request.entry(slot);
        // SAFETY: the entry points into the request's IoBuf (heap memory that
        // does not move when the IoBuf does) and names the request's file;
        // both stay in `self.slots[slot]` until the completion is reaped.
        unsafe { self.push(&entry) }
    }

    /// # Safety
    /// Every buffer and descriptor the entry references must stay valid
    /// until its completion is reaped.
    unsafe fn push(&mut self, entry: &squeue::Entry) -> bool {
        // SAFETY: forwarded to the caller.
        if unsafe { self.ring.submission().push(entry) }.is_ok() {
            return true;
        }
        // The queue only fills if the kernel has not consumed earlier
        // entries yet; hand them over and try once more.
        let _ = self.ring.submit();
        // SAFETY: forwarded to the caller.
        unsafe { self.ring.submission().push(entry) }.is_ok()
    }

    fn complete(&mut self, slot: usize, res: i32) {
        let Some(request) = self.slots.get_mut(slot).and_then(|s| s.as_mut()) else {
            tracing::error!("io_uring engine: completion for unknown slot {slot}");
            return;
        };
        match request.complete(res) {
            None => self.resubmit.push_back(slot),
            Some(result) => {
                if let Some(request) = self.slots[slot].take() {
                    self.in_flight -= 1;
                    self.free_slots.push(slot);
                    request.finish(result);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn engine_or_skip() -> Option<Arc<UringEngine>> {
        match UringEngine::new() {
            Ok(engine) => Some(engine),
            Err(e) => {
                eprintln!("io_uring unavailable here ({e}); skipping");
                None
            }
        }
    }

    #[tokio::test]
    async fn read_write_fsync_round_trip() {
        let Some(engine) = engine_or_skip() else { return };
        let mut tmp = tempfile::tempfile().unwrap();
        tmp.write_all(&vec![0u8; 1 << 20]).unwrap();
        let file = Arc::new(tmp);
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let (_, res) = engine.write(file.clone(), 4096, IoBuf::copy_from(&data)).await;
        res.unwrap();
        engine.fdatasync(file.clone()).await.unwrap();
        let (_, res) = engine.write(file.clone(), 65536, IoBuf::copy_from(&data)).await;
        res.unwrap();
        engine.fdatasync_range(file.clone(), 65536, 8192).await.unwrap();
        let (buf, res) = engine.read(file.clone(), 4096, IoBuf::new(8192)).await;
        res.unwrap();
        assert_eq!(buf.payload(), &data[..]);
    }

    #[tokio::test]
    async fn read_past_end_of_file_is_an_error() {
        let Some(engine) = engine_or_skip() else { return };
        let file = Arc::new(tempfile::tempfile().unwrap());
        let (buf, res) = engine.read(file, 0, IoBuf::new(4096)).await;
        assert_eq!(buf.len(), 4096);
        assert_eq!(res.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[tokio::test]
    async fn errors_come_back_with_the_buffer() {
        let Some(engine) = engine_or_skip() else { return };
        // A read-only descriptor: writes fail with EBADF.
        let path = tempfile::NamedTempFile::new().unwrap();
        let file = Arc::new(File::open(path.path()).unwrap());
        let (buf, res) = engine.write(file, 0, IoBuf::copy_from(&[7u8; 512])).await;
        assert_eq!(buf.payload(), &[7u8; 512]);
        assert_eq!(res.unwrap_err().raw_os_error(), Some(libc::EBADF));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_concurrent_requests_exceeding_the_ring() {
        let Some(engine) = engine_or_skip() else { return };
        let tmp = tempfile::tempfile().unwrap();
        tmp.set_len(2048 * 4096).unwrap();
        let file = Arc::new(tmp);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..2048u64 {
            let engine = engine.clone();
            let file = file.clone();
            tasks.spawn(async move {
                let (_, res) = engine
                    .write(file, i * 4096, IoBuf::copy_from(&[(i % 256) as u8; 4096]))
                    .await;
                res
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined.unwrap().unwrap();
        }
        for i in (0..2048u64).step_by(97) {
            let (buf, res) = engine.read(file.clone(), i * 4096, IoBuf::new(4096)).await;
            res.unwrap();
            assert!(buf.payload().iter().all(|&b| b == (i % 256) as u8));
        }
    }

    #[test]
    fn dropping_a_private_engine_stops_its_thread_cleanly() {
        let Some(engine) = engine_or_skip() else { return };
        let file = Arc::new(tempfile::tempfile().unwrap());
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(engine.fdatasync(file)).unwrap();
        // The ring thread holds the other reference to the waker: it is
        // gone once the thread has returned.
        let waker = Arc::downgrade(&engine.waker);
        assert_eq!(waker.strong_count(), 2);
        drop(engine);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while waker.strong_count() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(waker.strong_count(), 0, "the ring thread did not stop");
    }
}
