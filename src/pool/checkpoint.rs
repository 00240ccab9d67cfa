//! Checkpoints: the changed map, checksum and allocation pages written to
//! the metadata store in one transaction, after which the log is freed up
//! to the checkpoint.

use super::*;

/// Runs metadata-store work off the async workers when there are threads to
/// spare; inline on a current-thread runtime (the simulator's devices
/// complete at once, so nothing there would wait).
pub(super) async fn run_blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            match tokio::task::spawn_blocking(work).await {
                Ok(value) => value,
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        _ => work(),
    }
}

fn write_pages<P: Page>(
    txn: &redb::WriteTransaction,
    definition: TableDefinition<(u32, u64), &[u8]>,
    pages: &[TakenPage<P>],
) -> Result<(), MetaError> {
    let mut table = txn.open_table(definition)?;
    for (key, bytes, _) in pages {
        table.insert(*key, bytes.as_slice())?;
    }
    Ok(())
}

impl Pool {
    fn wants_checkpoint(&self) -> bool {
        self.log.usage() > 0.5
            || self.map_pages.dirty_count() + self.crc_pages.dirty_count() > MAX_DIRTY_PAGES
            || self.log.pending_bytes() > 1 << 20
    }

    /// Starts a checkpoint in the background when the log or the dirty pages
    /// grow large (needs a multi-thread runtime; the simulator checkpoints
    /// explicitly).
    pub(crate) fn maybe_checkpoint_soon(&self) {
        if !self.wants_checkpoint() || self.checkpoint_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = self.self_ref.get().and_then(|weak| weak.upgrade());
        match (pool, tokio::runtime::Handle::try_current()) {
            (Some(pool), Ok(handle)) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                handle.spawn(async move {
                    if let Err(e) = pool.checkpoint().await {
                        tracing::error!("pool {}: background checkpoint failed: {e}", pool.name);
                    }
                    pool.checkpoint_scheduled.store(false, Ordering::Release);
                });
            }
            _ => self.checkpoint_scheduled.store(false, Ordering::Release),
        }
    }

    /// Destages the data the intent log holds, then writes every change
    /// since the last checkpoint to the metadata store and frees the log.
    pub async fn checkpoint(&self) -> Result<(), PoolError> {
        if let Err(e) = self.destage_logged().await {
            tracing::warn!("pool {}: destaging before a checkpoint failed: {e}", self.name);
        }
        self.checkpoint_metadata().await
    }

    /// The metadata part of a checkpoint. The log is freed up to the
    /// checkpoint, or up to the oldest Data record still needed.
    pub(crate) async fn checkpoint_metadata(&self) -> Result<(), PoolError> {
        let _one = self.checkpointing.lock().await;
        let started = std::time::Instant::now();
        // Writers stop only for what must be consistent. Before the gate:
        // the data devices are flushed (the commit under the gate then has
        // little left to flush) and the dirty pages copied (thousands of
        // pages take hundreds of milliseconds to copy); under it, only the
        // pages changed since are copied again, and their new copies win.
        if let Err(e) = self.flush_data_devices().await {
            tracing::warn!("pool {}: flushing before a checkpoint failed: {e}", self.name);
        }
        // Off the async workers' queue: thousands of pages are tens of
        // milliseconds of copying.
        let (early_map, early_crcs) =
            store::blocking_section(|| (self.map_pages.take_dirty(), self.crc_pages.take_dirty()));
        let early = started.elapsed();
        let gate = self.close_gate().await;
        let gated = started.elapsed();
        // Commits before this one have released what their records freed
        // (the allocator's state below must show it: the log's tail moves
        // past those records), and none starts until the state is taken.
        let releasing = self.releasing.write().await;
        // Everything logged so far becomes durable first, so the checkpoint
        // LSN is a position every earlier record precedes (records destage
        // passes hold back included: the state taken below has their
        // changes).
        self.log.settle(None);
        let frees = match self.log.commit(|| self.flush_data_devices(), true).await {
            Ok(frees) => frees,
            Err(e) => {
                self.map_pages.restore_dirty(&early_map);
                self.crc_pages.restore_dirty(&early_crcs);
                return Err(e.into());
            }
        };
        let committed = started.elapsed();
        self.release_frees(frees).await;
        let lsn = self.log.next_lsn();
        let epoch = self.epoch.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        let map = crate::meta::pages::newest_copies(early_map, self.map_pages.take_dirty());
        let crcs = crate::meta::pages::newest_copies(early_crcs, self.crc_pages.take_dirty());
        let chunks = self.allocator.lock_or_abort().take_dirty();
        let suspect = self.suspect_snapshot();
        // Data records are appended under the gate, so none is in flight.
        let data_tail = self.cache.oldest_log_lsn().map_or(lsn, |oldest| oldest.min(lsn));
        let destroyed: Vec<u32> = self.destroyed.lock_or_abort().iter().copied().collect();
        let snapshots = self.take_snapshot_state();
        let heat = self.heat_to_save();
        let namespaces = self.take_namespace_changes();
        drop(releasing);
        drop(gate);
        let released = started.elapsed();

        let pages = (map.len() + crcs.len()) as u64;
        let result = store::blocking_section(|| {
            self.write_checkpoint(
                &map,
                &crcs,
                &chunks,
                &suspect,
                &destroyed,
                snapshots.as_ref(),
                heat.as_deref(),
                &namespaces,
                (lsn, data_tail),
                epoch,
            )
        });
        match result {
            Ok(()) => {
                tracing::debug!(
                    "checkpoint: pages copied at {} µs, gate taken at {} µs, commit done at {} µs, \
                     gate released at {} µs, {pages} pages stored at {} µs",
                    early.as_micros(),
                    gated.as_micros(),
                    committed.as_micros(),
                    released.as_micros(),
                    started.elapsed().as_micros()
                );
                self.log.set_tail(data_tail);
                self.data_tail.store(data_tail, Ordering::Release);
                // Every write in place before this epoch has its checksums
                // stored and its data flushed: their marks are not needed.
                self.covered.store(epoch.wrapping_sub(1), Ordering::Release);
                let mut pending = self.destroyed.lock_or_abort();
                for volume in destroyed {
                    pending.remove(&volume);
                }
                self.checkpoints.fetch_add(1, Ordering::Relaxed);
                self.checkpoint_pages.fetch_add(pages, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                self.map_pages.restore_dirty(&map);
                self.crc_pages.restore_dirty(&crcs);
                self.allocator
                    .lock_or_abort()
                    .restore_dirty(chunks.iter().map(|(key, _)| *key));
                if snapshots.is_some() {
                    self.restore_snapshot_state();
                }
                self.restore_namespace_changes(&namespaces);
                Err(PoolError::Meta(MetaError::Failed(format!("checkpoint failed: {e}"))))
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write_checkpoint(
        &self,
        map: &[TakenPage<MapPage>],
        crcs: &[TakenPage<CrcPage>],
        chunks: &[((u8, u64), Option<ChunkState>)],
        suspect: &[((u8, u64), ChunkParts)],
        destroyed: &[u32],
        snapshots: Option<&snapshots::SnapshotState>,
        heat: Option<&[((u32, u64), u64)]>,
        namespaces: &files::NamespaceChanges,
        (lsn, data_tail): (u64, u64),
        epoch: u32,
    ) -> Result<(), MetaError> {
        // The store's backend blocks on device I/O; the simulator's devices
        // complete at once and real engines complete on their own threads.
        self.db.write("the checkpoint's commit", |db| {
            let txn = db.begin_write()?;
            {
                let mut table = txn.open_table(MAP_PAGES)?;
                for (key, bytes, _) in map {
                    table.insert(*key, bytes.as_slice())?;
                }
                for volume in destroyed {
                    let keys: Vec<(u32, u64)> = table
                        .range((*volume, 0)..=(*volume, u64::MAX))?
                        .filter_map(|row| row.ok().map(|(k, _)| k.value()))
                        .collect();
                    for key in keys {
                        table.remove(key)?;
                    }
                }
            }
            write_pages(&txn, CRC_PAGES, crcs)?;
            files::write_namespaces(&txn, namespaces, destroyed)?;
            {
                let mut table = txn.open_table(CHUNKS)?;
                for ((device, chunk), state) in chunks {
                    match state {
                        Some(state) => {
                            let key = (*device as u32, *chunk);
                            table.insert(key, state.encode_stored(key).as_slice())?;
                        }
                        None => {
                            table.remove((*device as u32, *chunk))?;
                        }
                    }
                }
            }
            {
                txn.open_table(SUSPECT)?.retain(|_, _| false)?;
                let mut table = txn.open_table(crate::meta::store::SUSPECT_PARTS)?;
                table.retain(|_, _| false)?;
                for ((device, chunk), parts) in suspect {
                    let key = (*device as u32, *chunk);
                    table.insert(key, super::recover::encode_parts(key, parts).as_slice())?;
                }
            }
            if let Some(state) = snapshots {
                snapshots::save(&txn, state)?;
            }
            if let Some(rows) = heat {
                let mut table = txn.open_table(crate::meta::store::HEAT)?;
                table.retain(|_, _| false)?;
                for (key, counts) in rows {
                    table.insert(*key, *counts)?;
                }
            }
            {
                let mut table = txn.open_table(STATE)?;
                table.insert("checkpoint_lsn", lsn)?;
                table.insert("data_tail", data_tail)?;
                table.insert("has_data_tail", 1)?;
                table.insert("epoch", epoch as u64)?;
            }
            txn.commit().map_err(MetaError::from)
        })
    }
}
