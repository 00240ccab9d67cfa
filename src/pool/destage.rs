//! Destaging: moving the write-back cache's dirty sectors to their place on
//! the data devices — by age (the commit interval), under pressure (the RAM
//! tier filling up, where writers wait: backpressure), and before a
//! checkpoint (so the intent log's space can be reclaimed).

use crate::sync::LockOrAbort;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::volume::EngineVolume;
use super::{Pool, PoolError};

/// Most blocks one destage pass writes before it commits.
const DESTAGE_BATCH_BLOCKS: usize = 512;
/// The same for a volume with cached writes of a snapshot not placed yet.
const PENDING_BATCH_BLOCKS: usize = 64;

impl Pool {
    /// Promises `bytes` of pool space to cached writes into unmapped blocks.
    pub(crate) fn reserve(&self, bytes: u64) -> bool {
        let mut allocator = self.allocator.lock_or_abort();
        let mut free = Self::unallocated(&allocator, self.chunk_bytes);
        let reserved = self.reserved_bytes.load(Ordering::Acquire);
        if reserved + bytes > free && allocator.reclaim_freeing() {
            // Space being freed in the background is needed now.
            free = Self::unallocated(&allocator, self.chunk_bytes);
        }
        if reserved + bytes > free {
            return false;
        }
        self.reserved_bytes.fetch_add(bytes, Ordering::AcqRel);
        true
    }

    fn unallocated(allocator: &super::alloc::Allocator, chunk_bytes: u32) -> u64 {
        allocator
            .devices()
            .iter()
            .map(|d| (d.data_chunks() * chunk_bytes as u64).saturating_sub(d.used_bytes()))
            .sum()
    }

    pub(crate) fn unreserve(&self, bytes: u64) {
        let _ = self
            .reserved_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| Some(r.saturating_sub(bytes)));
    }

    /// Lets the destager reach an open volume.
    pub(crate) fn register_volume(&self, id: u32, volume: Weak<EngineVolume>) {
        self.engines.lock_or_abort().insert(id, volume);
    }

    pub(crate) fn engines(&self) -> Vec<Arc<EngineVolume>> {
        let mut engines: Vec<Arc<EngineVolume>> = self
            .engines
            .lock_or_abort()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        engines.sort_by_key(|e| e.id());
        engines
    }

    /// Destages `blocks` of one volume; running out of space there makes
    /// the pool short of space (see [`Pool::space_short`]).
    async fn destage(&self, engine: &EngineVolume, blocks: &[u64]) -> Result<(), PoolError> {
        let result = engine.destage_blocks(blocks).await;
        if matches!(result, Err(crate::block::BlockError::NoSpace)) {
            self.note_no_space();
        }
        result.map_err(block_error)
    }

    /// A write to a device failed for lack of space. Until the destager
    /// sees room again, writes bypass the RAM cache: a write that needs new
    /// space then fails with ENOSPC when it is made, instead of being
    /// acknowledged into RAM and finding no place later.
    pub(crate) fn note_no_space(&self) {
        if !self.space_short.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                "pool {}: a write found no space (in the pool or on the file system under its devices); \
                 writes bypass the RAM cache until there is room again",
                self.name
            );
        }
    }

    /// Whether writes bypass the cache for lack of space.
    pub(crate) fn space_short(&self) -> bool {
        self.space_short.load(Ordering::Acquire)
    }

    /// Decides, from what is free, whether the pool is short of space:
    /// it is while any file device's file system has less free than the
    /// cached writes still waiting for a place plus a margin (5 % of it, at
    /// most 64 MiB), or the pool less than those writes. A shortage a
    /// failed write declared ends only here, once there is room.
    fn recheck_space(&self) {
        let waiting = self.reserved_bytes.load(Ordering::Acquire);
        let pool_room = {
            let allocator = self.allocator.lock_or_abort();
            Self::unallocated(&allocator, self.chunk_bytes)
        };
        let status = self.status();
        // The soft threshold (iSCSI's unit attention) follows within one tick.
        self.set_backing_space_low(status.iter().any(|d| d.backing_low()));
        let roomy = pool_room > waiting
            && status.iter().all(|d| {
                d.backing
                    .is_none_or(|b| b.fs_free_bytes >= waiting + (b.fs_size_bytes / 20).min(64 << 20))
            });
        if roomy && self.space_short.swap(false, Ordering::AcqRel) {
            tracing::info!("pool {}: there is room again; writes use the RAM cache", self.name);
        } else if !roomy && !self.space_short.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                "pool {}: nearly out of space (in the pool or on the file system under its devices); \
                 writes bypass the RAM cache until there is room again",
                self.name
            );
        }
    }

    /// Read cache counters.
    pub fn read_cache_stats(&self) -> super::readcache::ReadCacheStats {
        self.read_cache.stats()
    }

    /// Write-back cache counters.
    pub fn cache_stats(&self) -> super::cache::CacheStats {
        self.cache.stats()
    }

    /// Destages every cached sector whose data the intent log holds.
    pub async fn destage_logged(&self) -> Result<(), PoolError> {
        for engine in self.engines() {
            let blocks = engine.cached_blocks(|e| e.logged_at != 0, usize::MAX);
            for batch in blocks.chunks(DESTAGE_BATCH_BLOCKS) {
                self.destage(&engine, batch).await?;
            }
        }
        Ok(())
    }

    /// Destages everything in the cache (clean shutdown, tests).
    pub async fn destage_all(&self) -> Result<(), PoolError> {
        for engine in self.engines() {
            loop {
                let blocks = engine.cached_blocks(|_| true, DESTAGE_BATCH_BLOCKS);
                if blocks.is_empty() {
                    break;
                }
                self.destage(&engine, &blocks).await?;
            }
        }
        Ok(())
    }

    /// One destage pass over the next volume (round robin): up to
    /// `max_blocks` blocks, only entries older than `older_than` if given.
    /// Returns how many blocks it destaged.
    pub(crate) async fn destage_some(
        &self,
        max_blocks: usize,
        older_than: Option<Duration>,
    ) -> Result<usize, PoolError> {
        let engines = self.engines();
        if engines.is_empty() {
            return Ok(0);
        }
        let start = self.cache.cursor.fetch_add(1, Ordering::Relaxed) as usize;
        let cutoff = older_than.and_then(|age| Instant::now().checked_sub(age));
        for i in 0..engines.len() {
            let engine = &engines[(start + i) % engines.len()];
            // A volume whose cache holds a snapshot's writes places them
            // with the blocks of the same map pages (older first), so a
            // batch grows: smaller ones keep the stripe locks (and the
            // writers and snapshots behind them) waiting less long.
            let max_blocks = if engine.has_pending() {
                max_blocks.min(PENDING_BATCH_BLOCKS)
            } else {
                max_blocks
            };
            let blocks = engine.cached_blocks(|e| cutoff.is_none_or(|c| e.since <= c), max_blocks);
            if blocks.is_empty() {
                continue;
            }
            self.destage(engine, &blocks).await?;
            return Ok(blocks.len());
        }
        Ok(0)
    }

    /// Waits until `slots` RAM slots are free, destaging to make room
    /// (a writer slowed down at the cache's bound, never failed by it).
    pub(crate) async fn make_room(&self, slots: usize) -> Result<(), PoolError> {
        let mut stalled = false;
        while self.cache.ram.free_slots() < slots {
            if !stalled {
                self.cache.stalls.fetch_add(1, Ordering::Relaxed);
                stalled = true;
            }
            let notified = self.cache.space.notified();
            if self.destage_some(DESTAGE_BATCH_BLOCKS, None).await? == 0 && self.cache.ram.free_slots() < slots {
                // Everything left is being destaged by someone else.
                let _ = tokio::time::timeout(Duration::from_millis(10), notified).await;
            }
        }
        Ok(())
    }

    /// Starts the background destager: by age every commit interval, and
    /// early when the RAM tier is more than half full. It stops when the pool
    /// is dropped.
    pub(crate) fn start_destager(self: &Arc<Self>) {
        let Some(handle) = super::background_runtime() else {
            return;
        };
        let weak = Arc::downgrade(self);
        handle.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut ticks = 0u64;
            let mut warned = std::collections::HashSet::new();
            let mut failing = false;
            loop {
                tick.tick().await;
                let Some(pool) = weak.upgrade() else { return };
                // Every 10 s: the file systems under sparse devices.
                if ticks.is_multiple_of(50) {
                    pool.warn_about_backing(&mut warned);
                }
                ticks += 1;
                pool.recheck_space();
                let total = pool.cache.ram.total_slots();
                let result = async {
                    while pool.cache.ram.free_slots() < total / 2 {
                        if pool.destage_some(DESTAGE_BATCH_BLOCKS, None).await? == 0 {
                            break;
                        }
                    }
                    while pool
                        .destage_some(DESTAGE_BATCH_BLOCKS, Some(super::COMMIT_INTERVAL))
                        .await?
                        > 0
                    {}
                    Ok::<(), PoolError>(())
                }
                .await;
                match result {
                    // Once per streak: a full disk would otherwise log a line a second.
                    Err(e) => {
                        if !failing {
                            tracing::error!("pool {}: destaging failed: {e}; retrying every second", pool.name);
                            failing = true;
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    Ok(()) if failing => {
                        tracing::info!("pool {}: destaging works again", pool.name);
                        failing = false;
                    }
                    Ok(()) => {}
                }
            }
        });
    }
}

impl Pool {
    /// Logs a warning when the file system under a sparse device falls below
    /// what the device may still ask of it, or below 10 % free; once per
    /// device until it recovers (then an info line). Also keeps
    /// [`Pool::backing_space_low`]: any device's file system under 10 %
    /// free. Overcommit alone (sparse files that could outgrow their file
    /// system, the default pool's normal state) is said in the log and in
    /// `pool status`, not announced to every initiator.
    fn warn_about_backing(&self, warned: &mut std::collections::HashSet<u8>) {
        let warnings: Vec<_> = self
            .status()
            .into_iter()
            .map(|device| (device.backing_warning(), device))
            .collect();
        // Before the log lines, so whoever sees them sees the flag too.
        self.set_backing_space_low(warnings.iter().any(|(_, device)| device.backing_low()));
        for (warning, device) in warnings {
            match warning {
                Some(warning) if warned.insert(device.index) => {
                    tracing::warn!("pool {}: {warning}", self.name)
                }
                None if warned.remove(&device.index) => {
                    tracing::info!("pool {}: {}: its file system has room again", self.name, device.name)
                }
                _ => {}
            }
        }
    }
}

fn block_error(error: crate::block::BlockError) -> PoolError {
    match error {
        crate::block::BlockError::NoSpace => PoolError::Invalid(
            "no space left to place cached data (in the pool, or on the file system under its devices); \
             it stays in the RAM cache (and in the intent log once flushed) until space is freed"
                .into(),
        ),
        crate::block::BlockError::Io(error) => PoolError::Device {
            device: "pool".into(),
            reason: format!("destage: {error}"),
        },
        other => PoolError::Invalid(format!("destage: {other}")),
    }
}
