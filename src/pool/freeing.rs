//! Freeing in the background. Deleting a snapshot, destroying a volume or
//! rolling one back commits a record that frees many slots at once; the
//! record's work on the map is quick (milliseconds for 4 GiB), but giving
//! the space back to the file system under sparse device files is not (ext4
//! takes ~0.8 s to punch 4 GiB of holes, holding the file's lock meanwhile).
//! So a commit that frees more than `BACKGROUND_FREE_ABOVE` slots queues
//! them in the allocator (`Allocator::defer_frees`: still in use there, so
//! nothing allocates them, but checkpointed as free) and the freer task
//! punches and frees them in small batches, slowly while clients are at
//! work. `pool status` shows the queue as FREEING.

use super::*;

/// Frees of more slots than this at once go to the background freer (a
/// TRIM of up to 16 MiB of 16 KiB blocks is still freed at once).
pub const BACKGROUND_FREE_ABOVE: usize = 1024;
/// Slots punched and freed per step of the freer (4 MiB of 16 KiB
/// blocks: about 1 ms of ext4's time).
const FREE_BATCH: usize = 256;
/// Between the freer's steps while clients are at work (so a punch holds
/// up at most ~1% of their I/O time), and while they are idle.
const BUSY_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);
const IDLE_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

impl Pool {
    /// How many slots one commit may free before the rest waits for the
    /// freer (`usize::MAX` while no freer runs: frees happen at once).
    pub(super) fn free_above(&self) -> usize {
        self.free_above.load(Ordering::Acquire)
    }

    /// Frees the slots a durable record freed: at once (holes punched, then
    /// the allocator), or through the freeing queue when there are many.
    pub(super) async fn release_frees(&self, frees: Vec<(u8, u64)>) {
        if frees.is_empty() {
            return;
        }
        if frees.len() > self.free_above() {
            self.defer_frees(frees);
            return;
        }
        self.punch_holes(&frees).await;
        let mut allocator = self.allocator.lock_or_abort();
        for (device, offset) in frees {
            assert!(
                allocator.free(device, offset),
                "slot {device}/{offset} replaced by a committed write was not in use"
            );
        }
    }

    /// Queues committed frees for the freer and wakes it.
    pub(super) fn defer_frees(&self, mut frees: Vec<(u8, u64)>) {
        if let Err((device, offset)) = self.allocator.lock_or_abort().defer_frees(&mut frees) {
            panic!("slot {device}/{offset} freed by a committed record was not in use");
        }
        self.freer_wake.notify_one();
    }

    /// Bytes committed to be freed and not yet freed ("freeing").
    pub fn freeing_bytes(&self) -> u64 {
        self.allocator.lock_or_abort().freeing_bytes()
    }

    /// Punches and frees one batch of the freeing queue; returns how many
    /// slots it freed (0: the queue is empty). One batch at a time: a punch
    /// must never reach a slot another batch already freed (and that may
    /// hold new data by now).
    pub async fn free_queued_batch(&self) -> usize {
        let _one = self.freer.lock().await;
        let batch = self.allocator.lock_or_abort().start_freeing(FREE_BATCH);
        if batch.is_empty() {
            return 0;
        }
        self.punch_holes(&batch).await;
        self.allocator.lock_or_abort().finish_freeing();
        batch.len()
    }

    /// Empties the freeing queue now (tests; `pool sync --wait-free`-like
    /// callers).
    pub async fn free_queued(&self) {
        while self.free_queued_batch().await > 0 {}
    }

    /// Reads and writes the pool served so far (the freer's sign of clients
    /// at work): reads through the read cache, writes into the RAM tier, and
    /// data written to the devices (a large write goes around the RAM tier:
    /// counted only there, a stream of them looked like an idle pool, and
    /// the freer punched at full speed, holding the device file's lock).
    pub(super) fn foreground_ops(&self) -> u64 {
        let read = self.read_cache.stats();
        let placed: u64 = self
            .devices
            .iter()
            .map(|device| device.written.writes.load(Ordering::Relaxed))
            .sum();
        read.hits + read.misses + self.cache.stats().written_bytes + placed
    }

    /// Starts the freer: it works through the freeing queue whenever a
    /// commit adds to it. A punch holds the device file's lock (clients'
    /// I/O to that file waits for it), so while clients are at work it
    /// punches one batch per `BUSY_PAUSE`; when they are idle it runs at the
    /// file system's speed. It stops when the pool is dropped. Without it (a
    /// current-thread runtime, a pool opened without background work) frees
    /// happen at once unless `PoolOptions::background_free_above` asks for
    /// a queue.
    pub(crate) fn start_freer(self: &Arc<Self>) {
        let Some(handle) = super::background_runtime() else {
            return;
        };
        let weak = Arc::downgrade(self);
        let _ =
            self.free_above
                .compare_exchange(usize::MAX, BACKGROUND_FREE_ABOVE, Ordering::AcqRel, Ordering::Acquire);
        let wake = self.freer_wake.clone();
        handle.spawn(async move {
            loop {
                // A timeout as well: the pool may go away while nothing wakes us.
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), wake.notified()).await;
                let mut seen = None;
                loop {
                    let Some(pool) = weak.upgrade() else { return };
                    let ops = pool.foreground_ops();
                    let busy = seen.is_some_and(|seen| seen != ops);
                    seen = Some(ops);
                    if pool.free_queued_batch().await == 0 {
                        break;
                    }
                    drop(pool);
                    let pause = if busy { BUSY_PAUSE } else { IDLE_PAUSE };
                    tokio::time::sleep(pause).await;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockDevice, BlockError};
    use crate::device::SimDevice;
    use crate::pool::NewDevice;

    const MIB: u64 = 1 << 20;

    fn placed(pool: &Pool) -> u64 {
        pool.status().iter().map(|d| d.used_bytes).sum()
    }

    /// A destroyed volume's space waits in the freeing queue (counted as
    /// used), yet a pool that runs out of space takes it back at once.
    #[test]
    fn a_full_pool_takes_back_what_is_freeing() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let sim = SimDevice::new(160 * MIB, 1);
            let device = NewDevice {
                device: sim.as_device(),
                role: Role::Fast,
            };
            let options = PoolOptions {
                background_free_above: Some(4),
                ..PoolOptions::default()
            };
            let pool = Pool::create_with("test", 1 << 20, vec![device], options).await.unwrap();
            let write = |volume: Arc<volume::EngineVolume>, offset: u64| async move {
                let result = volume
                    .write(offset, IoBuf::copy_from(&vec![0x5a; MIB as usize]), false)
                    .await;
                match result {
                    Ok(()) => volume.flush().await,
                    Err(e) => Err(e),
                }
            };
            let first = pool.open_volume(1, 64 * MIB, 16384).unwrap();
            for i in 0..32 {
                write(first.clone(), i * MIB).await.unwrap();
            }
            // The second volume fills the rest of the pool.
            let second = pool.open_volume(2, 1024 * MIB, 16384).unwrap();
            let mut written = 0;
            loop {
                match write(second.clone(), written * MIB).await {
                    Ok(()) => written += 1,
                    Err(BlockError::NoSpace) => break,
                    Err(e) => panic!("write {written}: {e}"),
                }
                assert!(written < 1024, "the pool never filled");
            }
            pool.destage_all().await.unwrap();
            drop(first);
            pool.destroy_volume(1).await.unwrap();
            assert_eq!(pool.freeing_bytes(), 32 * MIB, "queued, not freed");
            // Full but for the queue: writing needs it, and gets it.
            for i in 0..16 {
                write(second.clone(), (written + i) * MIB).await.unwrap();
            }
            pool.destage_all().await.unwrap();
            pool.commit().await.unwrap();
            assert_eq!(pool.freeing_bytes(), 0, "taken back");
            assert_eq!(placed(&pool), second.used_bytes(), "nothing leaked");
        });
    }
}
