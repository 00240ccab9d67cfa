//! A connection's bulk lane: a second thread for sending large replies, so
//! that one connection's reads run on two cores at once.
//!
//! One NBD connection is read by one task, and a task runs on one core at a
//! time. For megabyte reads that task would do everything in turn: read the
//! device and verify the checksums, then copy the reply into the socket
//! (through loopback TCP, the larger half of the cost). The lane takes the
//! sending onto a thread of the runtime's blocking pool while the reader
//! goes on with the next request: one hand-off per large reply.
//!
//! Large writes gain nothing from it, measured: executing them on the lane
//! moves the payload, just received on the reader's core, to another core
//! for checksumming and copying, and costs more CPU than it overlaps.
//!
//! Jobs run one at a time, in the order given. The lane's thread exists only
//! while the lane has jobs: it returns to the pool when the queue is empty
//! and the next job starts it again. At most [`MAX_RUNNING_LANES`] lanes run
//! at once across the process (so lanes never take all of the blocking
//! pool, which metadata work also needs); when none is free, `push` hands
//! the job back and the caller does it itself, as it would without a lane.
//!
//! A task would not do for the lane: tokio runs a task spawned (or woken)
//! from a worker on that same worker next (its LIFO slot), which is where
//! the reader already is, and other workers do not steal it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Lanes with a thread at once, process-wide.
pub const MAX_RUNNING_LANES: usize = 64;

static RUNNING_LANES: AtomicUsize = AtomicUsize::new(0);

pub struct Lane<J> {
    state: Mutex<State<J>>,
    run: fn(J),
}

struct State<J> {
    queue: VecDeque<J>,
    /// A thread is draining the queue.
    running: bool,
}

impl<J: Send + 'static> Lane<J> {
    /// A lane that runs each job with `run` on the lane's thread.
    pub fn new(run: fn(J)) -> Arc<Self> {
        Arc::new(Lane {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                running: false,
            }),
            run,
        })
    }

    /// Queues `job` after the lane's earlier jobs. `Err(job)` if the lane
    /// has no thread and none may start now (the caller runs it itself;
    /// nothing of this lane is queued then, so order is kept). Must be
    /// called inside a tokio runtime.
    pub fn push(self: &Arc<Self>, job: J) -> Result<(), J> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !state.running {
            let taken = RUNNING_LANES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |running| {
                (running < MAX_RUNNING_LANES).then_some(running + 1)
            });
            if taken.is_err() {
                return Err(job);
            }
            state.running = true;
            let lane = self.clone();
            drop(tokio::task::spawn_blocking(move || lane.drain()));
        }
        state.queue.push_back(job);
        Ok(())
    }

    /// Runs jobs until the queue is empty, then gives the thread back.
    fn drain(&self) {
        loop {
            let job = {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                match state.queue.pop_front() {
                    Some(job) => job,
                    None => {
                        state.running = false;
                        RUNNING_LANES.fetch_sub(1, Ordering::AcqRel);
                        return;
                    }
                }
            };
            (self.run)(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record((log, value): (Arc<Mutex<Vec<u32>>>, u32)) {
        log.lock().unwrap().push(value);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_run_once_each_in_order_and_the_thread_comes_back() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let lane = Lane::new(record);
        for round in 0..50u32 {
            for value in 0..20u32 {
                // Refused only when every lane thread of the process is
                // taken; the caller then runs the job itself, as here.
                if let Err(job) = lane.push((log.clone(), round * 20 + value)) {
                    record(job);
                }
            }
            if round % 2 == 0 {
                // Sometimes let the lane run dry so that its thread stops
                // and the next push starts it again.
                while lane.state.lock().unwrap().running {
                    tokio::task::yield_now().await;
                }
            }
        }
        while lane.state.lock().unwrap().running {
            tokio::task::yield_now().await;
        }
        assert_eq!(*log.lock().unwrap(), (0..1000).collect::<Vec<_>>());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lane_without_a_free_thread_hands_the_job_back() {
        let lanes: Vec<_> = (0..MAX_RUNNING_LANES + 1).map(|_| Lane::new(|_: ()| ())).collect();
        // Hold every lane thread of the process: mark them running without
        // threads (other tests may hold some; take what remains).
        let mut held = 0;
        while RUNNING_LANES
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                (r < MAX_RUNNING_LANES).then_some(r + 1)
            })
            .is_ok()
        {
            held += 1;
        }
        assert!(lanes[0].push(()).is_err(), "no lane thread was free");
        assert!(lanes[0].state.lock().unwrap().queue.is_empty());
        RUNNING_LANES.fetch_sub(held, Ordering::AcqRel);
        // Once threads are free again the same lane takes jobs.
        let mut accepted = false;
        for _ in 0..1000 {
            if lanes[0].push(()).is_ok() {
                accepted = true;
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(accepted);
    }
}
