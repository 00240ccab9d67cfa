//! Protocol frontends. Each speaks a wire protocol and turns requests into
//! calls on a [`crate::volume::Volume`]; none touches storage directly.

pub mod iscsi;
pub mod nbd;

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
    let mut work = Box::pin(work);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    if work.as_mut().poll(&mut context).is_pending() {
        tokio::spawn(work);
    }
}
