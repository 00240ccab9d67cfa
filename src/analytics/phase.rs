//! Where a request's time goes: the layers it passes through add the time
//! it waited for them (the one layer that does is the intent log's commit)
//! to a task-local tally that the frontend reads when the request
//! completes. Outside a measured request (the destager, checkpoints)
//! adding does nothing.

use std::cell::Cell;
use std::future::Future;
use std::time::Instant;

/// Time (ns) a request spent waiting in each phase.
#[derive(Debug, Default)]
pub struct Phases {
    pub commit_ns: Cell<u64>,
}

tokio::task_local! {
    static PHASES: Phases;
}

/// Runs `request`, tallying its phases; returns its output and the tally.
pub async fn measure<F: Future>(request: F) -> (F::Output, Phases) {
    let mut scoped = std::pin::pin!(PHASES.scope(Phases::default(), request));
    let output = (&mut scoped).await;
    let phases = scoped.as_mut().take_value().unwrap_or_default();
    (output, phases)
}

/// Adds the time since `since` to the current request's wait for log
/// commits.
pub fn add_commit_wait(since: Instant) {
    let _ = PHASES.try_with(|p| p.commit_ns.set(p.commit_ns.get() + since.elapsed().as_nanos() as u64));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_measured_request_gets_its_waits_and_others_are_ignored() {
        add_commit_wait(Instant::now()); // not measured: ignored
        let ((), phases) = measure(async {
            let at = Instant::now() - std::time::Duration::from_micros(30);
            add_commit_wait(at);
            tokio::task::yield_now().await;
            add_commit_wait(at);
        })
        .await;
        assert!(phases.commit_ns.get() >= 60_000, "{phases:?}");
    }
}
