//! Protocol frontends. Each speaks a wire protocol and turns requests into
//! calls on a [`crate::volume::Volume`]; none touches storage directly.

pub mod iscsi;
pub mod lane;
pub mod nbd;
pub mod outbox;

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
