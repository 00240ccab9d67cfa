//! Taking snapshots: several volumes at one consistency point, one log
//! record, with writes held for as long as it takes to append it. No map
//! walk: a snapshot is a registry entry and a generation; its pages are
//! copied lazily (`cow.rs`). Its own room because it is the one place
//! that stops writes across several volumes at once.

use super::*;
use crate::meta::log::{SnapshotEntry, MAX_SNAPSHOTS_PER_RECORD, MAX_SNAPSHOT_NAME};

/// Refuses requests naming a snapshot their volume already has.
fn name_taken(snapshots: &Snapshots, requests: &[SnapshotRequest<'_>]) -> Result<(), PoolError> {
    for request in requests {
        let taken = snapshots
            .by_volume
            .get(&request.volume.id())
            .is_some_and(|list| list.iter().any(|s| snapshots.by_id[s].name == request.name));
        if taken {
            return Err(PoolError::Invalid(format!("snapshot '{}' exists", request.name)));
        }
    }
    Ok(())
}

/// What a new snapshot needs from its volume.
pub struct SnapshotRequest<'a> {
    pub volume: &'a Arc<volume::EngineVolume>,
    pub name: String,
}

impl Pool {
    /// Takes snapshots of several volumes at one consistency point: every
    /// write acknowledged before it returns is in them, none that a client
    /// sends after it started. Writes to those volumes wait meanwhile, for
    /// one record; their cached data belongs to the snapshot and stays in
    /// the cache until the destager places it.
    pub async fn create_snapshots(&self, requests: &[SnapshotRequest<'_>]) -> Result<Vec<SnapshotInfo>, PoolError> {
        if requests.is_empty() || requests.len() > MAX_SNAPSHOTS_PER_RECORD {
            return Err(PoolError::Invalid(format!(
                "one snapshot command takes 1 to {MAX_SNAPSHOTS_PER_RECORD} volumes"
            )));
        }
        let mut volumes: Vec<&Arc<volume::EngineVolume>> = requests.iter().map(|r| r.volume).collect();
        volumes.sort_by_key(|v| v.id());
        volumes.dedup_by_key(|v| v.id());
        if volumes.len() != requests.len() {
            return Err(PoolError::Invalid("a volume is named twice".into()));
        }
        for request in requests {
            if is_snapshot_id(request.volume.id()) {
                return Err(PoolError::Invalid("a snapshot cannot be snapshotted".into()));
            }
            if request.name.is_empty() || request.name.len() > MAX_SNAPSHOT_NAME {
                return Err(PoolError::Invalid(format!(
                    "a snapshot name has 1 to {MAX_SNAPSHOT_NAME} bytes"
                )));
            }
        }
        // A taken name is refused before writes stop, and checked again
        // where the snapshot is inserted (below): callers need not hold the
        // catalog (a receive does not), so two may race for one name.
        name_taken(&self.snapshots_read(), requests)?;
        // Writes stop (in id order, so two commands cannot deadlock) for as
        // long as it takes to write one record. What the volumes have in
        // the RAM cache stays there: those entries are below the snapshot's
        // `cache_seq`, so they belong to it, and they reach the map before
        // anything after the snapshot changes their pages
        // (`EngineVolume::destage_blocks`).
        let started = std::time::Instant::now();
        let mut barriers = Vec::with_capacity(volumes.len());
        for volume in &volumes {
            barriers.push(volume.barrier().write().await);
        }
        let stopped = started.elapsed();
        let created_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let (taken, gated) = {
            let _gate = self.gate(requests[0].volume.id()).read().await;
            let gated = started.elapsed();
            let mut snapshots = self.snapshots_write();
            // The check that counts: under the lock the insertion holds.
            name_taken(&snapshots, requests)?;
            snapshots.generation += 1;
            let generation = snapshots.generation;
            // Every write to these volumes so far is below it (theirs wait
            // at the barriers).
            let cache_seq = self.cache.current_seq();
            let mut entries = Vec::with_capacity(requests.len());
            let mut taken = Vec::with_capacity(requests.len());
            for request in requests {
                let id = SNAPSHOT_ID_BASE | snapshots.next_id;
                let info = SnapshotInfo {
                    id,
                    volume: request.volume.id(),
                    name: request.name.clone(),
                    generation,
                    created_unix,
                    // Placed blocks and those the cache will place.
                    mapped_blocks: request.volume.used_bytes() / request.volume.volblocksize() as u64,
                    size_bytes: crate::block::BlockDevice::size_bytes(request.volume.as_ref()),
                    cache_seq,
                };
                entries.push(SnapshotEntry {
                    volume: info.volume,
                    snapshot: id,
                    mapped_blocks: info.mapped_blocks,
                    size_bytes: info.size_bytes,
                    name: info.name.clone(),
                });
                snapshots.insert(info.clone());
                taken.push(info);
            }
            self.has_snapshots.store(true, Ordering::Release);
            self.log.append(Record::Snapshot {
                generation,
                created_unix,
                cache_seq,
                snapshots: entries,
            });
            for volume in &volumes {
                self.cache.volume(volume.id()).lock().set_floor(cache_seq);
            }
            // A file dataset's namespace is copied at the record, still
            // under the gate (its changes are logged under it too).
            drop(snapshots);
            for info in &taken {
                self.copy_namespace(info.volume, info.id);
            }
            (taken, gated)
        };
        // Writes go on as soon as the record is appended: whatever they log
        // comes after it, so no commit makes theirs durable without it,
        // and a crash before it is committed takes the snapshot and only
        // writes acknowledged after it (none of which was flushed).
        drop(barriers);
        let appended = started.elapsed();
        // The record needs no data flushed before it (what the volumes
        // have not flushed is as durable in the snapshot as in them): one
        // log write, unless other pending records need the data devices
        // flushed (a flush of a large dirty page cache takes long).
        self.commit_marks().await?;
        tracing::debug!(
            "snapshot create: writes stopped {} µs, gate {} µs, writes resumed {} µs, committed {} µs",
            stopped.as_micros(),
            gated.as_micros(),
            appended.as_micros(),
            started.elapsed().as_micros()
        );
        Ok(taken)
    }
}
