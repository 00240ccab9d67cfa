//! A connection's lanes: threads beside its reader for bulk work, so that
//! one connection's large reads run on more than one core.
//!
//! One NBD connection is read by one task, which parses requests and runs
//! the small ones itself. A megabyte read done there would be done in turn:
//! read the device, verify the checksums, copy the reply into the socket
//! (through loopback TCP, the larger half of the cost), and only then parse
//! the next request. The NBD server has two lanes per connection: one of
//! a thread or a few that each run a whole large read (read, verify, send), and
//! one thread that sends the replies the reader collected once they carry
//! enough data. One hand-off per job.
//!
//! Large writes gain nothing from a lane, measured: executing them there
//! moves the payload, just received on the reader's core, to another core
//! for checksumming and copying, and costs more CPU than it overlaps.
//!
//! A lane has one thread or a few ([`Lane::with_threads`]). With one, jobs
//! run one at a time, in the order given; with more, each thread takes the
//! next queued job, so jobs start in order and finish in any. A lane's
//! threads are tokio blocking-pool threads that stay only while the lane
//! has jobs: a thread that finds the queue empty returns to the pool, and
//! the next job starts one again. At most [`MAX_RUNNING_LANES`] lane threads
//! run at once across the process (so lanes never take all of the blocking
//! pool, which metadata work also needs); when a lane has no thread and none
//! is free, `push` hands the job back and the caller does it itself, as it
//! would without a lane.
//!
//! A task would not do for a lane: tokio runs a task spawned (or woken)
//! from a worker on that same worker next (its LIFO slot), and other
//! workers do not steal it at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Lane threads at once, process-wide.
pub const MAX_RUNNING_LANES: usize = 64;

static RUNNING_LANES: AtomicUsize = AtomicUsize::new(0);

pub struct Lane<J> {
    state: Mutex<State<J>>,
    run: fn(J),
    /// Threads that may drain the queue at once.
    threads: usize,
}

struct State<J> {
    queue: VecDeque<J>,
    /// Threads draining the queue.
    running: usize,
}

impl<J: Send + 'static> Lane<J> {
    /// A lane that runs each job with `run` on the lane's thread.
    pub fn new(run: fn(J)) -> Arc<Self> {
        Self::with_threads(run, 1)
    }

    /// A lane with up to `threads` threads, each running the next queued
    /// job: with more than one, jobs start in order but may finish in any.
    pub fn with_threads(run: fn(J), threads: usize) -> Arc<Self> {
        Arc::new(Lane {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                running: 0,
            }),
            run,
            threads: threads.max(1),
        })
    }

    /// Queues `job` after the lane's earlier jobs. `Err(job)` if the lane
    /// has no thread and none may start now (the caller runs it itself;
    /// nothing of this lane is queued then, so order is kept). Must be
    /// called inside a tokio runtime.
    pub fn push(self: &Arc<Self>, job: J) -> Result<(), J> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // Every running thread is busy with a job (one that finds the queue
        // empty leaves): another may start, up to the lane's number.
        if state.running < self.threads {
            let taken = RUNNING_LANES.fetch_update(Ordering::AcqRel, Ordering::Acquire, |running| {
                (running < MAX_RUNNING_LANES).then_some(running + 1)
            });
            match taken {
                Ok(_) => {
                    state.running += 1;
                    let lane = self.clone();
                    drop(tokio::task::spawn_blocking(move || lane.drain()));
                }
                // No thread for this lane at all: the caller runs the job.
                Err(_) if state.running == 0 => return Err(job),
                // The lane's running threads take it.
                Err(_) => {}
            }
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
                        state.running -= 1;
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
                while lane.state.lock().unwrap().running > 0 {
                    tokio::task::yield_now().await;
                }
            }
        }
        while lane.state.lock().unwrap().running > 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*log.lock().unwrap(), (0..1000).collect::<Vec<_>>());
    }

    static ACTIVE: AtomicUsize = AtomicUsize::new(0);
    static MOST_ACTIVE: AtomicUsize = AtomicUsize::new(0);

    fn overlap((log, value): (Arc<Mutex<Vec<u32>>>, u32)) {
        let active = ACTIVE.fetch_add(1, Ordering::SeqCst) + 1;
        MOST_ACTIVE.fetch_max(active, Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_micros(200));
        log.lock().unwrap().push(value);
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lane_of_three_threads_runs_every_job_once_and_never_more_than_three_at_once() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let lane = Lane::with_threads(overlap, 3);
        for round in 0..10u32 {
            for value in 0..30u32 {
                if let Err(job) = lane.push((log.clone(), round * 30 + value)) {
                    overlap(job);
                }
            }
            while lane.state.lock().unwrap().running > 0 {
                tokio::task::yield_now().await;
            }
        }
        let mut ran = log.lock().unwrap().clone();
        ran.sort_unstable();
        assert_eq!(ran, (0..300).collect::<Vec<_>>());
        let most = MOST_ACTIVE.load(Ordering::SeqCst);
        assert!(most <= 3, "{most} jobs ran at once on a lane of three threads");
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
