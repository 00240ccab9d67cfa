//! `pool scrub`: the daemon's side of a whole-pool scrub (the reading and
//! repairing is the pool's, `pool/scrub.rs`). One scrub per pool at a
//! time; its status is kept in `scrub.json` in the pool's directory,
//! rewritten every few seconds and when it ends, so a scrub cut short by a
//! restart or a crash goes on from where the file says it was, and the
//! last scrub's findings are still shown after a restart.
//!
//! Scheduled scrubs: the daemon starts one when a pool's `scrub.interval`
//! (default 30 days) has passed since its last scrub started, or since the
//! pool was created if it never had one. A scrub under way or paused by
//! hand is left alone; a stopped or failed one counts as the last scrub.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::{now_unix, pool_dir, validate_component, AdminError, VolumeManager};
use crate::pool::{Pool, ScrubCommand, ScrubJob, ScrubState, ScrubStatus};

/// The scrub's status in the pool's directory.
pub const SCRUB_FILE: &str = "scrub.json";
/// How often a running scrub's status is written to [`SCRUB_FILE`]: what
/// a crash can make it read again.
const SAVE_EVERY: Duration = Duration::from_secs(5);
/// How long `--pause` and `--stop` wait for the scrub to reach the end of
/// the run it is reading.
const SETTLE_WAIT: Duration = Duration::from_secs(30);
/// How often the daemon looks for pools whose scheduled scrub is due
/// ([`VolumeManager::start_due_scrubs`]).
pub const SCHEDULE_EVERY: Duration = Duration::from_secs(2);

/// When a pool's next scheduled scrub is due (unix seconds): `interval`
/// after the last scrub started (`last`, its state and start) or, with no
/// scrub yet, after the pool was created. `None` when scrubs are not
/// scheduled (`interval` is `None`) or while one is scanning or paused.
pub fn next_scrub_due(interval: Option<u64>, last: Option<(ScrubState, u64)>, created_unix: u64) -> Option<u64> {
    let interval = interval?;
    let base = match last {
        Some((ScrubState::Scanning | ScrubState::Paused, _)) => return None,
        Some((_, started)) => started,
        None => created_unix,
    };
    Some(base.saturating_add(interval))
}

/// What `POST /v1/pools/{pool}/scrub` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ScrubAction {
    /// Start a scrub, or go on with a paused one.
    Start,
    Pause,
    Stop,
}

fn scrub_file(data_dir: &Path, pool: &str) -> PathBuf {
    pool_dir(data_dir, pool).join(SCRUB_FILE)
}

/// The status `path` holds; `None` if there is none. A damaged file is
/// reported and ignored (the next scrub starts from the beginning).
fn load(path: &Path) -> Option<ScrubStatus> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!("{}: {e}; the last scrub's status is not shown", path.display());
            return None;
        }
    };
    match serde_json::from_slice(&text) {
        Ok(status) => Some(status),
        Err(e) => {
            tracing::warn!(
                "{}: not a scrub status ({e}); it is ignored, and the next scrub starts from the beginning",
                path.display()
            );
            None
        }
    }
}

/// Writes `status` to `path` whole or not at all (a new file renamed over
/// the old one).
fn save(path: &Path, status: &ScrubStatus) {
    let write = || -> std::io::Result<()> {
        let temporary = path.with_extension("json.tmp");
        let mut text = serde_json::to_vec_pretty(status).map_err(std::io::Error::other)?;
        text.push(b'\n');
        std::fs::write(&temporary, &text)?;
        std::fs::File::open(&temporary)?.sync_all()?;
        std::fs::rename(&temporary, path)?;
        if let Some(dir) = path.parent() {
            crate::control::catalog::sync_dir(dir)?;
        }
        Ok(())
    };
    if let Err(e) = write() {
        tracing::warn!("{}: cannot save the scrub's status: {e}", path.display());
    }
}

impl VolumeManager {
    /// `pool scrub`: starts a scrub of pool `pool_name` (or goes on with a
    /// paused one from its cursor), pauses or stops the one under way.
    /// Returns the scrub's status.
    pub fn scrub_pool(self: &Arc<Self>, pool_name: &str, action: ScrubAction) -> Result<ScrubStatus, AdminError> {
        validate_component("pool", pool_name)?;
        let pool = self
            .pool(pool_name)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool_name}' does not exist")))?;
        let current = pool.scrub_job();
        let state = current.as_ref().map(|job| job.status().state);
        let status = match action {
            ScrubAction::Start => {
                let mut status = match current.map(|job| job.status()) {
                    Some(status) if status.state == ScrubState::Scanning => {
                        return Err(AdminError::Invalid(format!(
                            "pool '{pool_name}' is already being scrubbed (`strata pool scrub {pool_name} --pause` \
                             or `--stop` to end it)"
                        )))
                    }
                    Some(status) if status.state == ScrubState::Paused => status,
                    _ => ScrubStatus::new(now_unix()),
                };
                // Scanning from now on, so whoever looks next (`--wait`)
                // does not see the pause it goes on from.
                status.state = ScrubState::Scanning;
                status.ended_unix = None;
                let job = ScrubJob::new(status);
                pool.set_scrub_job(job.clone())
                    .map_err(|e| AdminError::Invalid(e.to_string()))?;
                self.spawn_scrub(pool_name, &pool, job.clone());
                job.status()
            }
            ScrubAction::Pause | ScrubAction::Stop => {
                let job = match (current, state) {
                    (Some(job), Some(ScrubState::Scanning)) => job,
                    (Some(job), Some(ScrubState::Paused)) if action == ScrubAction::Stop => {
                        // Nothing runs: the stop is recorded here.
                        let mut status = job.status();
                        status.state = ScrubState::Stopped;
                        status.ended_unix = Some(now_unix());
                        save(&scrub_file(self.data_dir(), pool_name), &status);
                        pool.set_scrub_job(ScrubJob::new(status.clone()))
                            .map_err(|e| AdminError::Invalid(e.to_string()))?;
                        return Ok(self.named_scrub(pool_name, &pool, status));
                    }
                    _ => {
                        return Err(AdminError::Invalid(format!(
                            "pool '{pool_name}' is not being scrubbed{}",
                            if action == ScrubAction::Pause {
                                ""
                            } else {
                                " (nor has a paused scrub)"
                            }
                        )))
                    }
                };
                job.command(if action == ScrubAction::Pause {
                    ScrubCommand::Pause
                } else {
                    ScrubCommand::Stop
                });
                // The scrub stops at the end of the run it is reading.
                let began = std::time::Instant::now();
                while job.status().state == ScrubState::Scanning && began.elapsed() < SETTLE_WAIT {
                    std::thread::sleep(Duration::from_millis(10));
                }
                job.status()
            }
        };
        Ok(self.named_scrub(pool_name, &pool, status))
    }

    fn spawn_scrub(self: &Arc<Self>, pool_name: &str, pool: &Arc<Pool>, job: Arc<ScrubJob>) {
        let path = scrub_file(self.data_dir(), pool_name);
        let pool = pool.clone();
        self.runtime.spawn(async move {
            pool.run_scrub(&job, SAVE_EVERY, &|status| save(&path, status)).await;
        });
    }

    /// At start: shows each pool's last scrub (its `scrub.json`), and goes
    /// on with one that was scanning when the daemon stopped. Called once
    /// the manager is shared.
    pub fn resume_scrubs(self: &Arc<Self>) {
        for (name, pool) in self.open_pools() {
            let Some(status) = load(&scrub_file(self.data_dir(), &name)) else {
                continue;
            };
            let scanning = status.state == ScrubState::Scanning;
            let job = ScrubJob::new(status);
            if pool.set_scrub_job(job.clone()).is_err() {
                continue;
            }
            if scanning {
                let status = job.status();
                tracing::info!(
                    "pool {name}: resuming the scrub at volume {} block {} ({} checked)",
                    status.cursor.volume,
                    status.cursor.block,
                    crate::units::format_size(status.issued_bytes)
                );
                self.spawn_scrub(&name, &pool, job);
            }
        }
    }

    /// When pool `pool_name`'s next scheduled scrub is due (see
    /// [`next_scrub_due`]).
    pub(super) fn next_scrub_of(&self, pool_name: &str, pool: &Pool) -> Option<u64> {
        let catalog = self.published();
        let record = catalog.pools.get(pool_name)?;
        let last = pool.scrub_job().map(|job| {
            let status = job.status();
            (status.state, status.started_unix)
        });
        next_scrub_due(
            super::pool_props::scrub_interval(&record.properties),
            last,
            record.created_unix,
        )
    }

    /// Starts the scrub of each pool whose scheduled one is due at `now`.
    pub fn start_due_scrubs(self: &Arc<Self>, now: u64) {
        for (name, pool) in self.open_pools() {
            let Some(due) = self.next_scrub_of(&name, &pool).filter(|due| *due <= now) else {
                continue;
            };
            let interval = self
                .published()
                .pools
                .get(&name)
                .and_then(|record| super::pool_props::scrub_interval(&record.properties))
                .unwrap_or_default();
            tracing::info!(
                "pool {name}: starting its scheduled scrub (scrub.interval={}, due {} s ago)",
                crate::units::format_span(interval),
                now - due
            );
            if let Err(e) = self.scrub_pool(&name, ScrubAction::Start) {
                tracing::error!("pool {name}: its scheduled scrub did not start: {e}");
            }
        }
    }

    /// Pool `pool_name`'s scrub as `pool status` shows it.
    pub(super) fn scrub_status_of(&self, pool_name: &str, pool: &Pool) -> Option<ScrubStatus> {
        let job = pool.scrub_job()?;
        let status = self.named_scrub(pool_name, pool, job.status());
        job.keep_fault_names(&status.faults);
        Some(status)
    }

    /// `status` with each fault not named yet given its volume's (or
    /// dataset's, and snapshot's) name, and for a dataset the file's path
    /// and the offset within the file.
    fn named_scrub(&self, pool_name: &str, pool: &Pool, mut status: ScrubStatus) -> ScrubStatus {
        let catalog = self.published();
        let Some(record) = catalog.pools.get(pool_name) else {
            return status;
        };
        for fault in status.faults.iter_mut().filter(|f| f.name.is_none()) {
            let volume = record
                .volumes
                .iter()
                .find(|(_, v)| v.id == fault.volume)
                .map(|(n, _)| n);
            let dataset = record
                .datasets
                .iter()
                .find(|(_, d)| d.id == fault.volume)
                .map(|(n, _)| n);
            let Some(short) = volume.or(dataset) else {
                continue;
            };
            let snapshot = fault.snapshot.and_then(|id| pool.snapshot(id));
            fault.name = Some(match &snapshot {
                Some(snapshot) => format!("{pool_name}/{short}@{}", snapshot.name),
                None => format!("{pool_name}/{short}"),
            });
            if dataset.is_some() {
                let ino = fault.offset >> crate::meta::fsrows::FILE_BITS;
                let namespace = pool.namespace(fault.snapshot.unwrap_or(fault.volume));
                let path = namespace.lock().unwrap_or_else(|e| e.into_inner()).path_of(ino);
                fault.path = path.or_else(|| Some(format!("(inode {ino}, no longer linked)")));
                fault.offset &= crate::meta::fsrows::MAX_FILE_SIZE - 1;
            }
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_scrub_is_due_an_interval_after_the_last_began() {
        let day = 86_400;
        // Never scrubbed: an interval after the pool was created.
        assert_eq!(next_scrub_due(Some(30 * day), None, 1_000), Some(1_000 + 30 * day));
        // After a finished, stopped or failed scrub: after it started.
        for state in [ScrubState::Finished, ScrubState::Stopped, ScrubState::Failed] {
            assert_eq!(
                next_scrub_due(Some(day), Some((state, 5_000)), 1_000),
                Some(5_000 + day),
                "{state:?}"
            );
        }
        // Not while one scans or is paused, nor when scrubs are off.
        for state in [ScrubState::Scanning, ScrubState::Paused] {
            assert_eq!(next_scrub_due(Some(day), Some((state, 5_000)), 1_000), None);
        }
        assert_eq!(next_scrub_due(None, None, 1_000), None);
        assert_eq!(next_scrub_due(Some(u64::MAX), None, 1_000), Some(u64::MAX));
    }
}
