//! Resilver: bringing a mirror's stale device up to date. A device that
//! missed writes (it failed one, or the pool ran without it) and is present
//! when the pool opens takes every write from then on; the resilver copies
//! what it may have missed from an up-to-date device, then lets it serve
//! reads again.
//!
//! What is copied: the metadata region and the log region when the member
//! holds them, and every chunk the allocator has assigned, in device order
//! ([`RESYNC_UNIT`] at a time, each under the mirror's barrier so no write
//! lands between reading a unit and writing it). Free chunks hold nothing a
//! read can reach, so they are not copied. When the mirror's dirty record
//! is complete for every device being resilvered (`pool/dirty.rs`: they
//! went stale while it tracked), only the parts of those ranges whose units
//! it marks are copied: nothing else was written while they were away. The
//! device's superblock entry keeps how far the copy got, so a resilver cut
//! short by a restart resumes there: the device took every write meanwhile.
//!
//! Pace: clients first. While they do I/O, the resilver rests after each
//! unit several times as long as the unit took, as the scrub does
//! ([`Pool::yield_to_clients`]); idle, it runs at the devices' speed.

use super::*;
use crate::pool::vdev::{Health, Mirror, MirrorChild, RESYNC_UNIT};

/// A resilver's progress, as `pool status` shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ResilverStatus {
    /// Bytes to copy in all (ranges below a resumed resilver's start
    /// included, counted as done).
    pub total_bytes: u64,
    pub done_bytes: u64,
    /// Since the resilver started (or resumed).
    pub seconds: u64,
    /// Bytes copied since it started, per second.
    pub bytes_per_second: u64,
}

/// How often the cursor is recorded in the superblocks.
const RECORD_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl Pool {
    /// Resilvers every mirror with devices being resilvered, one mirror at
    /// a time; returns the bytes copied. Errors reading the up-to-date
    /// copy stop that mirror's resilver (its devices stay stale).
    pub async fn resilver(&self) -> Result<u64, PoolError> {
        self.resilver_at_most(u64::MAX).await
    }

    /// [`Pool::resilver`], stopping once `budget` bytes are copied: the
    /// devices stay stale, their cursor recorded, as when a restart cuts a
    /// resilver short (tests use it to resume one).
    pub async fn resilver_at_most(&self, budget: u64) -> Result<u64, PoolError> {
        let _one_at_a_time = self.resilvering.lock().await;
        let mut copied = 0;
        // Again while devices were attached during a pass: each pass copies
        // to the devices being resilvered when it started.
        loop {
            let mut passes = 0;
            for device in &self.devices {
                let Some(mirror) = device.mirror().cloned() else {
                    continue;
                };
                if copied < budget && mirror.children().iter().any(|c| c.health() == Health::Resilvering) {
                    passes += 1;
                    copied += self.resilver_mirror(device, &mirror, budget - copied).await?;
                }
            }
            if passes == 0 || copied >= budget {
                return Ok(copied);
            }
        }
    }

    /// The byte ranges of member `device` that hold something, in order.
    fn resilver_ranges(&self, device: &PoolDevice) -> Vec<(u64, u64)> {
        let index = device.member.index;
        let mut ranges = Vec::new();
        if index == self.meta_device {
            ranges.push(self.regions.meta);
        }
        if index == self.regions.log_device {
            ranges.push(self.regions.log);
        }
        let chunk = self.chunk_bytes as u64;
        let allocator = self.allocator.lock_or_abort();
        if let Some(space) = allocator.devices().iter().find(|s| s.index == index) {
            for c in space.assigned_chunks() {
                match ranges.last_mut() {
                    Some((start, length)) if *start + *length == c * chunk => *length += chunk,
                    _ => ranges.push((c * chunk, chunk)),
                }
            }
        }
        ranges.sort_unstable();
        ranges
    }

    async fn resilver_mirror(&self, device: &PoolDevice, mirror: &Mirror, budget: u64) -> Result<u64, PoolError> {
        let mut targets: Vec<Arc<MirrorChild>> = mirror
            .children()
            .iter()
            .filter(|c| c.health() == Health::Resilvering)
            .cloned()
            .collect();
        // Resume where the least advanced of them stopped.
        let start = targets
            .iter()
            .map(|c| c.resilvered.load(Ordering::Acquire))
            .min()
            .unwrap_or(0);
        let mut ranges = self.resilver_ranges(device);
        // Every target went stale while the record tracked: the rest of
        // the member has not changed since.
        let record = if targets.iter().all(|t| t.tracked()) {
            mirror.dirty_units()
        } else {
            None
        };
        if let Some((unit, bits)) = &record {
            ranges = dirty_parts(&ranges, *unit, bits);
        }
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        let below: u64 = ranges.iter().map(|&(s, l)| l.min(start.saturating_sub(s))).sum();
        let began = std::time::Instant::now();
        self.set_resilver_status(
            device.member.index,
            Some(ResilverStatus {
                total_bytes: total,
                done_bytes: below,
                ..Default::default()
            }),
        );
        tracing::info!(
            "pool {}: resilvering {} ({} to copy{}{})",
            self.name,
            mirror.info().name,
            crate::units::format_size(total - below),
            if record.is_some() {
                ", what changed while it was away"
            } else {
                ""
            },
            if start > 0 {
                format!(", resuming at offset {start}")
            } else {
                String::new()
            }
        );
        mirror.set_resyncing(true).await;
        let mut copied = 0u64;
        let mut recorded = std::time::Instant::now();
        let mut outcome = Ok(());
        let mut paused = false;
        let mut seen = self.foreground_ops();
        'ranges: for (range_start, range_length) in ranges {
            let mut at = range_start.max(start);
            let end = range_start + range_length;
            while at < end && !targets.is_empty() {
                if copied >= budget {
                    paused = true;
                    break 'ranges;
                }
                let length = (RESYNC_UNIT - at % RESYNC_UNIT).min(end - at);
                let took = std::time::Instant::now();
                if let Err(e) = mirror.copy_unit(at, length, &mut targets).await {
                    outcome = Err(PoolError::Io(e));
                    break 'ranges;
                }
                at += length;
                copied += length;
                for target in &targets {
                    target.resilvered.store(at, Ordering::Release);
                }
                let seconds = began.elapsed().as_secs_f64().max(1e-3);
                self.set_resilver_status(
                    device.member.index,
                    Some(ResilverStatus {
                        total_bytes: total,
                        done_bytes: below + copied,
                        seconds: seconds as u64,
                        bytes_per_second: (copied as f64 / seconds) as u64,
                    }),
                );
                if recorded.elapsed() >= RECORD_EVERY {
                    self.membership.record_health().await;
                    recorded = std::time::Instant::now();
                }
                self.yield_to_clients(&mut seen, took.elapsed()).await;
            }
        }
        let mut finished = outcome.is_ok() && !paused;
        if finished && mirror.tracking() {
            // The devices about to be up to date hold the record too: a
            // device still behind may have to be resilvered from them.
            if let Err(e) = mirror.persist_record(true).await {
                outcome = Err(PoolError::Io(e));
                finished = false;
            }
        }
        if finished {
            // What was copied is durable before the devices count as up to date.
            for target in &targets {
                if let Some(child) = &target.device {
                    if let Err(e) = child.flush().await {
                        tracing::error!("{}: {e}; resilver failed", child.info().name);
                        target.change_health(Health::Resilvering, Health::Faulted);
                    }
                }
            }
            for target in &targets {
                if target.change_health(Health::Resilvering, Health::Online) {
                    target.resilvered.store(0, Ordering::Release);
                    target.tracked.store(false, Ordering::Release);
                }
            }
            mirror.refresh_tracking();
        }
        mirror.set_resyncing(false).await;
        self.membership.record_health().await;
        if finished {
            // A replacement that is now up to date takes its device's place.
            self.finish_replacement(device.member.index).await;
        }
        self.set_resilver_status(device.member.index, None);
        match &outcome {
            Ok(()) if !finished => tracing::info!(
                "pool {}: resilver of {} paused after {}",
                self.name,
                mirror.info().name,
                crate::units::format_size(copied)
            ),
            Ok(()) => tracing::info!(
                "pool {}: resilvered {} ({} copied in {:.1} s)",
                self.name,
                mirror.info().name,
                crate::units::format_size(copied),
                began.elapsed().as_secs_f64()
            ),
            Err(e) => tracing::error!("pool {}: resilver of {} stopped: {e}", self.name, mirror.info().name),
        }
        outcome.map(|()| copied)
    }

    /// Starts [`Pool::resilver`] in the background, if there is anything to
    /// resilver and a runtime to run it on.
    pub(crate) fn start_resilver(self: &Arc<Self>) {
        let needed = self.devices.iter().any(|d| {
            d.mirror()
                .is_some_and(|m| m.children().iter().any(|c| c.health() == Health::Resilvering))
        });
        let Some(runtime) = background_runtime().filter(|_| needed) else {
            return;
        };
        let pool = Arc::downgrade(self);
        runtime.spawn(async move {
            if let Some(pool) = pool.upgrade() {
                let _ = pool.resilver().await;
            }
        });
    }

    fn set_resilver_status(&self, member: u8, status: Option<ResilverStatus>) {
        let mut all = self.resilvers.lock().unwrap_or_else(|e| e.into_inner());
        match status {
            Some(status) => {
                all.insert(member, status);
            }
            None => {
                all.remove(&member);
            }
        }
    }

    /// The resilver under way on member `member`, if any.
    pub fn resilver_status(&self, member: u8) -> Option<ResilverStatus> {
        self.resilvers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&member)
            .copied()
    }
}

/// The parts of `ranges` (sorted, disjoint) inside units of `unit_bytes`
/// whose bit is set in `bits`, merged where they touch.
fn dirty_parts(ranges: &[(u64, u64)], unit_bytes: u64, bits: &[u64]) -> Vec<(u64, u64)> {
    let dirty = |unit: u64| {
        bits.get((unit / 64) as usize)
            .is_some_and(|w| w & (1 << (unit % 64)) != 0)
    };
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(start, length) in ranges {
        let end = start + length;
        let mut at = start;
        while at < end {
            let next = ((at / unit_bytes + 1) * unit_bytes).min(end);
            if dirty(at / unit_bytes) {
                match out.last_mut() {
                    Some((s, l)) if *s + *l == at => *l += next - at,
                    _ => out.push((at, next - at)),
                }
            }
            at = next;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::dirty_parts;

    #[test]
    fn only_the_dirty_units_of_the_ranges_are_copied() {
        const MIB: u64 = 1 << 20;
        // Units 1, 2 and 5 of 1 MiB dirty.
        let bits = [0b100110u64];
        let ranges = [(0, 3 * MIB + MIB / 2), (5 * MIB, MIB / 4), (7 * MIB, MIB)];
        assert_eq!(
            dirty_parts(&ranges, MIB, &bits),
            vec![(MIB, 2 * MIB), (5 * MIB, MIB / 4)]
        );
        // A coarser unit covers more.
        assert_eq!(dirty_parts(&ranges, 4 * MIB, &[0b1]), vec![(0, 3 * MIB + MIB / 2)]);
        assert!(dirty_parts(&ranges, MIB, &[0]).is_empty());
    }
}
