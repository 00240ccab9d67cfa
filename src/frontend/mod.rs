//! Protocol frontends. Each speaks a wire protocol and turns requests into
//! calls on a [`crate::volume::ServedVolume`] (NBD, iSCSI) or on a dataset's
//! [`crate::fs::FileSystem`] (NFS); none touches storage directly. Beside
//! them: connection caps ([`limits`]), the process-wide budget of request
//! and reply payloads in flight ([`memory`]), and the reply path ([`outbox`]) and
//! bulk-read threads ([`lane`]) that NBD connections use.

pub mod iscsi;
pub mod lane;
pub mod limits;
pub mod memory;
pub mod nbd;
pub mod nfs;
pub mod outbox;

use std::time::Duration;

/// The receiving side of the shutdown signal every listener watches (the
/// daemon holds the sender): `true` once the daemon is stopping.
pub type Shutdown = tokio::sync::watch::Receiver<bool>;

/// How long a stopping server waits for its connections to finish the
/// requests they have in flight and send their replies, before it flushes
/// the pools and exits.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Default time an NBD client has for its handshake and an iSCSI initiator
/// for its login; a client idle or trickling past it is cut.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
static HANDSHAKE_TIMEOUT_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(DEFAULT_HANDSHAKE_TIMEOUT.as_millis() as u64);

/// Sets the handshake/login time limit (`strata serve --handshake-timeout`).
pub fn set_handshake_timeout(limit: Duration) {
    HANDSHAKE_TIMEOUT_MS.store(limit.as_millis().max(1) as u64, std::sync::atomic::Ordering::Relaxed);
}

/// The time an NBD handshake or an iSCSI login may take.
pub fn handshake_timeout() -> Duration {
    Duration::from_millis(HANDSHAKE_TIMEOUT_MS.load(std::sync::atomic::Ordering::Relaxed))
}

/// The connection tasks of one listener, so that a stop waits for them:
/// a request that was in flight when the stop came either completes and is
/// answered before the final flush (so every acknowledged write is in it),
/// or is not answered at all.
#[derive(Default)]
pub struct Connections {
    tasks: tokio::task::JoinSet<()>,
}

impl Connections {
    /// Runs `connection` as a task of its own.
    pub fn spawn<F>(&mut self, connection: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        // Forget the connections that ended, so the set stays as large as
        // the number open.
        while self.tasks.try_join_next().is_some() {}
        self.tasks.spawn(connection);
    }

    /// After a stop (every connection watches it and winds down): waits
    /// until all have ended, for at most [`DRAIN_TIMEOUT`]; then drops the
    /// rest, which closes their sockets, so no reply goes out after this
    /// returns.
    pub async fn drain(mut self, protocol: &str) {
        let all_ended = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(DRAIN_TIMEOUT, all_ended).await.is_err() {
            tracing::warn!(
                "{protocol}: {} connection(s) still busy {DRAIN_TIMEOUT:?} after the stop; closing them \
                 (their unanswered requests were not acknowledged)",
                self.tasks.len()
            );
            self.tasks.shutdown().await;
        }
    }
}

/// Accepts connections on `listener` until `stop` turns true: each one
/// `limits` admits runs `connection(stream, peer)` as a task of its own
/// (holding its slot); one `limits` refuses is closed at accept, before a
/// byte is sent. Then waits for the connections (see [`Connections::drain`]).
pub async fn accept_loop<F, Fut>(
    protocol: &'static str,
    listener: tokio::net::TcpListener,
    limits: std::sync::Arc<limits::ConnectionLimits>,
    mut stop: Shutdown,
    mut connection: F,
) where
    F: FnMut(tokio::net::TcpStream, std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut connections = Connections::default();
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|stopped| *stopped) => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(connection) => connection,
            Err(e) => {
                // Typically EMFILE; back off instead of spinning.
                tracing::warn!("{protocol}: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = limits.admit(peer.ip()) else {
            // Dropping the stream closes it.
            continue;
        };
        let work = connection(stream, peer);
        connections.spawn(async move {
            let _slot = slot;
            work.await
        });
    }
    connections.drain(protocol).await;
}

/// Runs `work` on the calling task as far as it goes without waiting, and
/// spawns it only if it has to wait. Most requests never wait (a write into
/// the RAM tier, a read the page cache or the read cache serves): they skip
/// a task allocation and a cross-thread wake-up each. The first poll uses a
/// no-op waker; a request that returns `Pending` moves to its own task,
/// whose first poll registers the real waker (every future here re-registers
/// its waker on each poll, as tokio's do).
pub fn run_or_spawn<F>(work: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let _ = run_inline_or_spawn(work, |()| ());
}

/// [`run_or_spawn`] for work with a result: `Some(result)` if it finished
/// on the caller; otherwise it is spawned and `finish` gets the result on
/// its task.
pub fn run_inline_or_spawn<F, D>(work: F, finish: D) -> Option<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
    D: FnOnce(F::Output) + Send + 'static,
{
    let mut work = Box::pin(work);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match work.as_mut().poll(&mut context) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => {
            tokio::spawn(async move { finish(work.await) });
            None
        }
    }
}
