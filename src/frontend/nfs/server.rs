//! The NFS server's connections: NFS (100003 v3), MOUNT (100005 v3) and a
//! portmapper (100000 v2) answer on the same TCP port, so a client needs
//! no rpcbind (`mount -o port=P,mountport=P,mountproto=tcp`).
//!
//! Per connection, a reader task assembles records and starts each call
//! as soon as its header is checked; a call runs on the reader until it
//! has to wait, then on a task of its own ([`run_or_spawn`]), so up to
//! [`MAX_IN_FLIGHT`] calls are in flight and their replies go out in the
//! order they complete. One writer task sends the replies, batching those
//! that are ready together. A reply holds its call's in-flight slot until
//! it is written, so a client that stops reading its replies stops being
//! read from too, and the memory one connection pins stays bounded.
//!
//! A retransmitted non-idempotent call (REMOVE, RENAME, CREATE
//! GUARDED...) is answered from the daemon's duplicate-request cache
//! ([`super::drc`]), shared by all connections, instead of running again.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::drc::{self, Lookup, ReplyCache};
use super::mount::{self, MountCall};
use super::nfs3::{self, NfsCall};
use super::portmap::{self, PortmapCall};
use super::rpc::{self, Accept, Call, CallError, RecordError};
use super::xdr::{padding, Encode};
use super::{ArgsError, MOUNT_PROGRAM, MOUNT_VERSION, NFS_PROGRAM, NFS_VERSION, PORTMAP_PROGRAM, PORTMAP_VERSION};
use crate::frontend::limits::ConnectionLimits;
use crate::frontend::memory::MemoryPermit;
use crate::frontend::{run_or_spawn, Shutdown};
use crate::fs::{Exports, FileData};

/// Calls one connection may have in flight (received, not yet replied).
pub const MAX_IN_FLIGHT: usize = 64;
/// Bytes the reader buffers from the socket at a time, and the writer
/// gathers replies into.
const SOCKET_BUFFER_BYTES: usize = 64 << 10;

/// Accepts NFS clients until `stop` turns true, then waits for the calls
/// in flight to be answered (see [`crate::frontend::Connections::drain`]). Connections
/// beyond `limits` are closed at accept, before a byte is read.
/// The daemon's duplicate-request cache is made (and shown by `GET
/// /metrics`) when this is called, not when the future first runs.
pub fn serve(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    limits: Arc<ConnectionLimits>,
    stop: Shutdown,
) -> impl std::future::Future<Output = ()> {
    serve_with_cache(listener, exports, drc::daemon_cache(), limits, stop)
}

/// [`serve`] with the duplicate-request cache given (tests look into it).
pub async fn serve_with_cache(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    cache: Arc<ReplyCache>,
    limits: Arc<ConnectionLimits>,
    stop: Shutdown,
) {
    let connection_stop = stop.clone();
    crate::frontend::accept_loop("nfs", listener, limits, stop, |stream, peer| {
        let exports = exports.clone();
        let stop = connection_stop.clone();
        let cache = cache.clone();
        async move {
            match connection(stream, peer, exports, cache, stop).await {
                Ok(()) => tracing::debug!("nfs: {peer} disconnected"),
                // Clients commonly reset the connection instead of closing
                // it (libnfs after every command).
                Err(RecordError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    tracing::debug!("nfs: {peer} disconnected: {e}")
                }
                Err(e) => tracing::info!("nfs: {peer} closed: {e}"),
            }
        }
    })
    .await;
}

/// A reply on its way to the writer, with the in-flight slot it frees.
/// A call's place: one of the connection's [`MAX_IN_FLIGHT`], and its share
/// of the process's memory budget (the largest record, [`CALL_MEMORY_BYTES`]),
/// both held until its reply is written.
type Slot = (OwnedSemaphorePermit, MemoryPermit);
type Outgoing = (Reply, Slot);

/// What one call may hold: its record (at most [`rpc::MAX_RECORD`]) or its
/// reply (a READ's data is at most as large). Taken before the record is
/// read, so that a client stalls itself when the budget is spent.
const CALL_MEMORY_BYTES: u64 = rpc::MAX_RECORD as u64;

/// A reply record: its mark and header and results, then (a READ's) data
/// where the engine read it, sent after them with its XDR padding.
pub struct Reply {
    head: Vec<u8>,
    data: Option<FileData>,
}

impl Reply {
    /// Sets the record mark of `head` (built by `rpc::accepted` and the
    /// like) for it and `data`.
    fn finish(head: Vec<u8>, data: Option<FileData>) -> Reply {
        let trailing = data.as_ref().map_or(0, |d| d.len() + padding(d.len()));
        Reply {
            head: rpc::finish_before(head, trailing),
            data,
        }
    }

    /// The record as one run of bytes (borrowed unless it carries data).
    pub fn bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        match &self.data {
            None => std::borrow::Cow::Borrowed(&self.head),
            Some(data) => {
                let mut all = self.head.clone();
                all.put_fixed(data.bytes());
                std::borrow::Cow::Owned(all)
            }
        }
    }

    async fn send<W: tokio::io::AsyncWrite + Unpin>(&self, socket: &mut W) -> std::io::Result<()> {
        socket.write_all(&self.head).await?;
        if let Some(data) = &self.data {
            socket.write_all(data.bytes()).await?;
            socket.write_all(&[0u8; 3][..padding(data.len())]).await?;
        }
        Ok(())
    }
}

impl From<Vec<u8>> for Reply {
    /// A whole record, mark included.
    fn from(head: Vec<u8>) -> Reply {
        Reply { head, data: None }
    }
}

/// Serves one connection until the client closes it, sends something
/// that cannot be a call, or the server stops.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    exports: Arc<dyn Exports>,
    cache: Arc<ReplyCache>,
    mut stop: Shutdown,
) -> Result<(), RecordError> {
    stream.set_nodelay(true)?;
    let port = stream.local_addr()?.port();
    let (read_half, write_half) = stream.into_split();
    let mut reader = BufReader::with_capacity(SOCKET_BUFFER_BYTES, read_half);
    // Never full: each message holds one of MAX_IN_FLIGHT permits.
    let (replies, outgoing) = mpsc::channel::<Outgoing>(MAX_IN_FLIGHT);
    let mut writer = tokio::spawn(write_replies(write_half, outgoing));
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut writer_ended = None;

    let memory = crate::frontend::memory::global();
    let result = loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            _ = stop.wait_for(|stopped| *stopped) => break Ok(()),
            ended = &mut writer => {
                writer_ended = Some(ended);
                break Ok(());
            }
        };
        // The next call's first bytes, before its share: an idle
        // connection holds none of the budget.
        let waiting = tokio::select! {
            waiting = reader.fill_buf() => waiting.map(|bytes| bytes.is_empty()),
            _ = stop.wait_for(|stopped| *stopped) => break Ok(()),
            ended = &mut writer => {
                writer_ended = Some(ended);
                break Ok(());
            }
        };
        match waiting {
            Ok(false) => {}
            Ok(true) => break Ok(()),
            Err(e) => break Err(e.into()),
        }
        let share = tokio::select! {
            share = memory.acquire(peer.ip(), CALL_MEMORY_BYTES) => share,
            _ = stop.wait_for(|stopped| *stopped) => break Ok(()),
            ended = &mut writer => {
                writer_ended = Some(ended);
                break Ok(());
            }
        };
        let slot = (slot, share);
        let mut record = Vec::new();
        let read = tokio::select! {
            read = rpc::read_record(&mut reader, &mut record) => read,
            // A record half received when the stop comes is dropped
            // unanswered.
            _ = stop.wait_for(|stopped| *stopped) => break Ok(()),
            ended = &mut writer => {
                writer_ended = Some(ended);
                break Ok(());
            }
        };
        match read {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            Err(e) => break Err(e),
        }
        // The header is checked here, so that a garbled one closes the
        // connection at once; the call is decoded again where it runs.
        let key = match rpc::parse_call(&record) {
            Ok(call) => drc::Key::of(peer.ip(), &call),
            Err(e @ CallError::Garbled(_)) => {
                break Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()).into());
            }
            Err(e) => {
                tracing::debug!("nfs: {peer}: {e}");
                if let Some(reply) = e.reply() {
                    let _ = replies.try_send((reply.into(), slot));
                }
                continue;
            }
        };
        let pending = match key.map(|key| cache.lookup(key)) {
            None => None,
            Some(Lookup::Run(pending)) => Some(pending),
            Some(Lookup::Replay(reply)) => {
                let _ = replies.try_send((reply.to_vec().into(), slot));
                continue;
            }
            Some(Lookup::InProgress) => {
                tracing::debug!("nfs: {peer}: a retransmitted call still running, dropped");
                continue;
            }
        };
        let exports = exports.clone();
        let replies = replies.clone();
        run_or_spawn(async move {
            if let Some(reply) = answer(&*exports, peer, port, &record).await {
                if let Some(pending) = pending {
                    pending.finish(&reply.bytes());
                }
                // Fails only when the writer has given up on the socket.
                let _ = replies.try_send((reply, slot));
            }
        });
    };
    // The calls still running hold their own senders: the writer ends
    // after it has sent their replies.
    drop(replies);
    let written = match writer_ended {
        Some(ended) => ended,
        None => writer.await,
    };
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!("nfs: {peer}: writing replies: {e}"),
        Err(e) => tracing::warn!("nfs: {peer}: reply writer lost: {e}"),
    }
    result
}

/// Sends replies as they come, each batch of ready ones in one write.
async fn write_replies(socket: OwnedWriteHalf, mut outgoing: mpsc::Receiver<Outgoing>) -> std::io::Result<()> {
    let mut socket = BufWriter::with_capacity(SOCKET_BUFFER_BYTES, socket);
    while let Some((reply, _slot)) = outgoing.recv().await {
        reply.send(&mut socket).await?;
        while let Ok((reply, _slot)) = outgoing.try_recv() {
            reply.send(&mut socket).await?;
        }
        socket.flush().await?;
    }
    socket.shutdown().await
}

/// A call routed to its program and decoded, or the reply that refuses it.
#[derive(Debug)]
pub enum Routed<'a> {
    Nfs(NfsCall<'a>),
    Mount(MountCall<'a>),
    Portmap(PortmapCall),
    Refused(Accept),
}

/// Finds a call's program and version and decodes its arguments.
pub fn route<'a>(call: &Call<'a>) -> Routed<'a> {
    fn refused<'a>(error: ArgsError) -> Routed<'a> {
        Routed::Refused(match error {
            ArgsError::ProcUnavail => Accept::ProcUnavail,
            ArgsError::Garbage(_) => Accept::GarbageArgs,
        })
    }
    let only = |vers: u32| Routed::Refused(Accept::ProgMismatch { low: vers, high: vers });
    match (call.prog, call.vers) {
        (NFS_PROGRAM, NFS_VERSION) => nfs3::decode(call.procedure, call.args).map_or_else(refused, Routed::Nfs),
        (NFS_PROGRAM, _) => only(NFS_VERSION),
        (MOUNT_PROGRAM, MOUNT_VERSION) => mount::decode(call.procedure, call.args).map_or_else(refused, Routed::Mount),
        (MOUNT_PROGRAM, _) => only(MOUNT_VERSION),
        (PORTMAP_PROGRAM, PORTMAP_VERSION) => {
            portmap::decode(call.procedure, call.args).map_or_else(refused, Routed::Portmap)
        }
        (PORTMAP_PROGRAM, _) => only(PORTMAP_VERSION),
        _ => Routed::Refused(Accept::ProgUnavail),
    }
}

/// The reply to one record from `peer`, received on local port `port`;
/// `None` when it gets none (not a call, or a garbled header).
pub async fn answer(exports: &dyn Exports, peer: SocketAddr, port: u16, record: &[u8]) -> Option<Reply> {
    let call = match rpc::parse_call(record) {
        Ok(call) => call,
        Err(e) => return e.reply().map(Reply::from),
    };
    let mut data = None;
    let reply = match route(&call) {
        Routed::Refused(accept) => rpc::accepted(call.xid, accept),
        Routed::Nfs(nfs) => {
            let mut out = rpc::accepted_with_capacity(call.xid, Accept::Success, nfs.reply_capacity());
            data = nfs3::execute(exports, peer, &call.auth, &nfs, &mut out).await;
            out
        }
        Routed::Mount(mount) => {
            let mut out = rpc::accepted(call.xid, Accept::Success);
            mount::execute(exports, peer, &mount, &mut out);
            out
        }
        Routed::Portmap(portmap) => {
            let mut out = rpc::accepted(call.xid, Accept::Success);
            portmap::execute(portmap, port, &mut out);
            out
        }
    };
    Some(Reply::finish(reply, data))
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::frontend::nfs::nfs3::procedure as p;
    use crate::frontend::nfs::rpc::tests::call;
    use crate::frontend::nfs::rpc::{LAST_FRAGMENT, MARK_BYTES, MAX_RECORD};
    use crate::frontend::nfs::xdr::Encode;
    use crate::fs::{Export, Handle};
    use std::time::Duration;

    /// No dataset is exported: every handle is stale, every path unknown.
    struct NoExports;

    impl Exports for NoExports {
        fn by_path(&self, _: &str) -> Option<Export> {
            None
        }
        fn by_dataset(&self, _: u64, _: u32) -> Option<Export> {
            None
        }
        fn all(&self) -> Vec<Export> {
            Vec::new()
        }
    }

    const PEER: &str = "127.0.0.1:801";

    async fn answer_to(record: &[u8]) -> Option<Vec<u8>> {
        let reply = answer(&NoExports, PEER.parse().unwrap(), 2049, record).await?;
        Some(reply.bytes().into_owned())
    }

    /// The accept_stat and results of an accepted reply.
    fn accepted_body(reply: &[u8]) -> (u32, &[u8]) {
        let mark = u32::from_be_bytes(reply[..4].try_into().unwrap());
        assert_eq!(mark, LAST_FRAGMENT | (reply.len() - MARK_BYTES) as u32);
        assert_eq!(&reply[8..16], [0, 0, 0, 1, 0, 0, 0, 0]);
        (u32::from_be_bytes(reply[24..28].try_into().unwrap()), &reply[28..])
    }

    fn handle_bytes() -> Vec<u8> {
        let mut args = Vec::new();
        args.put_opaque(
            &Handle {
                pool: 5,
                dataset: 3,
                ino: 1,
                generation: 1,
            }
            .encode(),
        );
        args
    }

    #[tokio::test]
    async fn programs_versions_and_procedures_are_routed() {
        let reply = answer_to(&call(1, NFS_PROGRAM, 3, p::NULL, &[])).await.unwrap();
        assert_eq!(accepted_body(&reply), (0, &[][..]));
        let reply = answer_to(&call(1, NFS_PROGRAM, 2, p::NULL, &[])).await.unwrap();
        assert_eq!(accepted_body(&reply), (2, &[0, 0, 0, 3, 0, 0, 0, 3][..]));
        let reply = answer_to(&call(1, MOUNT_PROGRAM, 1, 0, &[])).await.unwrap();
        assert_eq!(accepted_body(&reply), (2, &[0, 0, 0, 3, 0, 0, 0, 3][..]));
        let reply = answer_to(&call(1, 100021, 4, 0, &[])).await.unwrap();
        assert_eq!(accepted_body(&reply).0, 1);
        let reply = answer_to(&call(1, NFS_PROGRAM, 3, 22, &[])).await.unwrap();
        assert_eq!(accepted_body(&reply).0, 3);
        let reply = answer_to(&call(1, PORTMAP_PROGRAM, 2, 0, &[])).await.unwrap();
        assert_eq!(accepted_body(&reply), (0, &[][..]));
        // A garbled header gets no reply (the connection closes).
        assert!(answer_to(&[0, 0, 0, 1, 0, 0]).await.is_none());
    }

    #[tokio::test]
    async fn truncated_arguments_are_garbage() {
        let args = handle_bytes();
        for procedure in [p::GETATTR, p::SETATTR, p::READ, p::WRITE, p::READDIR, p::COMMIT] {
            let reply = answer_to(&call(1, NFS_PROGRAM, 3, procedure, &args[..args.len() - 2]))
                .await
                .unwrap();
            assert_eq!(accepted_body(&reply), (4, &[][..]), "procedure {procedure}");
        }
        let reply = answer_to(&call(1, MOUNT_PROGRAM, 3, 1, &[0, 0, 0, 9, b'/']))
            .await
            .unwrap();
        assert_eq!(accepted_body(&reply).0, 4);
    }

    #[tokio::test]
    async fn handles_are_checked_before_anything_runs() {
        // Our handle, no export: NFS3ERR_STALE and no attributes.
        let reply = answer_to(&call(1, NFS_PROGRAM, 3, p::GETATTR, &handle_bytes()))
            .await
            .unwrap();
        assert_eq!(accepted_body(&reply), (0, &[0, 0, 0, 70][..]));
        // Not our handle: NFS3ERR_BADHANDLE.
        let mut args = Vec::new();
        args.put_opaque(&[7; 32]);
        let reply = answer_to(&call(1, NFS_PROGRAM, 3, p::GETATTR, &args)).await.unwrap();
        assert_eq!(accepted_body(&reply), (0, &[0, 0, 0x27, 0x11][..]));
        // LOOKUP fails with the directory's post_op_attr (none).
        let mut args = handle_bytes();
        args.put_string(b"x");
        let reply = answer_to(&call(1, NFS_PROGRAM, 3, p::LOOKUP, &args)).await.unwrap();
        assert_eq!(accepted_body(&reply), (0, &[0, 0, 0, 70, 0, 0, 0, 0][..]));
        // REMOVE fails with empty wcc_data.
        let reply = answer_to(&call(1, NFS_PROGRAM, 3, p::REMOVE, &args)).await.unwrap();
        assert_eq!(accepted_body(&reply), (0, &[0, 0, 0, 70, 0, 0, 0, 0, 0, 0, 0, 0][..]));
        // MNT of an unknown path: MNT3ERR_NOENT.
        let mut args = Vec::new();
        args.put_string(b"/tank/none");
        let reply = answer_to(&call(1, MOUNT_PROGRAM, 3, 1, &args)).await.unwrap();
        assert_eq!(accepted_body(&reply), (0, &[0, 0, 0, 2][..]));
    }

    fn marked(record: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.put_u32(LAST_FRAGMENT | record.len() as u32);
        out.extend_from_slice(record);
        out
    }

    async fn read_reply(stream: &mut TcpStream) -> Vec<u8> {
        let mut mark = [0u8; 4];
        stream.read_exact(&mut mark).await.unwrap();
        let len = (u32::from_be_bytes(mark) & !LAST_FRAGMENT) as usize;
        let mut reply = vec![0u8; len];
        stream.read_exact(&mut reply).await.unwrap();
        reply
    }

    #[tokio::test]
    async fn serves_pipelined_calls_and_closes_on_oversized_records() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop_sender, stop) = tokio::sync::watch::channel(false);
        let server = tokio::spawn(serve(
            listener,
            Arc::new(NoExports),
            ConnectionLimits::new("nfs", 16, 16),
            stop,
        ));

        let mut client = TcpStream::connect(address).await.unwrap();
        let mut calls = Vec::new();
        for xid in 0..100u32 {
            calls.extend(marked(&call(xid, NFS_PROGRAM, 3, p::NULL, &[])));
        }
        // Where is MOUNT? Here.
        let mut getport = Vec::new();
        for word in [MOUNT_PROGRAM, 3, 6, 0] {
            getport.put_u32(word);
        }
        calls.extend(marked(&call(100, PORTMAP_PROGRAM, 2, 3, &getport)));
        client.write_all(&calls).await.unwrap();
        let mut seen = Vec::new();
        for _ in 0..101 {
            let reply = read_reply(&mut client).await;
            let xid = u32::from_be_bytes(reply[..4].try_into().unwrap());
            if xid == 100 {
                assert_eq!(&reply[24..], (address.port() as u32).to_be_bytes());
            }
            seen.push(xid);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..101).collect::<Vec<_>>());

        // A record claiming more than MAX_RECORD: the server hangs up.
        client
            .write_all(&(LAST_FRAGMENT | (MAX_RECORD as u32 + 1)).to_be_bytes())
            .await
            .unwrap();
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());

        // An idle connection does not keep the server from stopping.
        let _idle = TcpStream::connect(address).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        stop_sender.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap();
    }
}
