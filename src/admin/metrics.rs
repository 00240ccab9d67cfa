//! `GET /metrics`: the volumes' counters and latency histograms
//! (`volume::stats`) in the Prometheus text format.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::block::{OPS, PROTOCOLS};
use crate::volume::stats::{OpStats, LATENCY_BUCKETS};
use crate::volume::ServedVolume;

fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Renders the Prometheus text exposition for `volumes`. Only the
/// (protocol, operation) pairs that have seen at least one request appear.
pub fn render(volumes: &[Arc<ServedVolume>]) -> String {
    let mut out = String::new();
    let mut series = Vec::new();
    for volume in volumes {
        for protocol in PROTOCOLS {
            for op in OPS {
                let stats = volume.stats().op(protocol, op);
                if stats.ops.load(Ordering::Relaxed) > 0 {
                    let labels = format!(
                        "volume=\"{}\",protocol=\"{}\",op=\"{}\"",
                        escape_label(volume.full_name()),
                        protocol.as_str(),
                        op.as_str()
                    );
                    series.push((labels, stats));
                }
            }
        }
    }
    type Counter = (&'static str, &'static str, fn(&OpStats) -> u64);
    let counters: [Counter; 3] = [
        (
            "strata_volume_operations_total",
            "Requests completed, by volume, protocol and operation.",
            |s| s.ops.load(Ordering::Relaxed),
        ),
        (
            "strata_volume_bytes_total",
            "Bytes transferred by successful requests.",
            |s| s.bytes.load(Ordering::Relaxed),
        ),
        (
            "strata_volume_errors_total",
            "Requests that completed with an error.",
            |s| s.errors.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (labels, stats) in &series {
            let _ = writeln!(out, "{name}{{{labels}}} {}", value(stats));
        }
    }
    let name = "strata_volume_latency_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Request latency from receipt to reply.\n# TYPE {name} histogram"
    );
    for (labels, stats) in &series {
        let mut cumulative = 0;
        for (index, bucket) in stats.buckets.iter().enumerate() {
            cumulative += bucket.load(Ordering::Relaxed);
            let le = if index == LATENCY_BUCKETS {
                "+Inf".to_string()
            } else {
                format!("{}", (1u64 << index) as f64 / 1e6)
            };
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let sum = stats.latency_ns_sum.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
    out
}

/// Gauges of the file systems under sparse file devices (the space a thin
/// pool stands on): free bytes, and the bytes each device file may still
/// grow by that its file system could not hold now.
pub fn render_backing(pools: &[crate::control::manager::PoolStatus]) -> String {
    let mut out = String::new();
    type Gauge = fn(&crate::pool::DeviceStatus) -> Option<u64>;
    let gauges: [(&str, &str, Gauge); 3] = [
        (
            "strata_device_fs_free_bytes",
            "Free bytes of the file system under a file device.",
            |d| d.backing.map(|b| b.fs_free_bytes),
        ),
        (
            "strata_device_unbacked_bytes",
            "Bytes a sparse device file may still grow by.",
            |d| d.backing.map(|b| d.size_bytes.saturating_sub(b.backed_bytes)),
        ),
        (
            "strata_device_unbackable_bytes",
            "Bytes a sparse device file may still grow by that its file system could not hold now.",
            |d| d.backing.map(|_| d.unbackable_bytes),
        ),
    ];
    type PoolValue = fn(&crate::control::manager::PoolStatus) -> u64;
    let pool_series: [(&str, &str, &str, PoolValue); 24] = [
        (
            "strata_pool_size_bytes",
            "gauge",
            "Data capacity (fast and capacity tiers).",
            |p| p.size_bytes,
        ),
        (
            "strata_pool_used_bytes",
            "gauge",
            "Data space in use or promised to cached writes.",
            |p| p.used_bytes,
        ),
        (
            "strata_pool_dirty_bytes",
            "gauge",
            "Written data held in the RAM tier, not yet placed.",
            |p| p.cache.dirty_bytes,
        ),
        (
            "strata_pool_dirty_max_bytes",
            "gauge",
            "The RAM tier's size (the bound on dirty data).",
            |p| p.cache.dirty_max_bytes,
        ),
        (
            "strata_pool_read_cache_hits_total",
            "counter",
            "Reads served by the read cache.",
            |p| p.cache.read_hits,
        ),
        (
            "strata_pool_read_cache_misses_total",
            "counter",
            "Reads the read cache could not serve.",
            |p| p.cache.read_misses,
        ),
        (
            "strata_pool_written_bytes_total",
            "counter",
            "Bytes written through the RAM write-back cache.",
            |p| p.cache.written_bytes,
        ),
        (
            "strata_pool_destaged_bytes_total",
            "counter",
            "Cached bytes written to their place on a device.",
            |p| p.cache.destaged_bytes,
        ),
        (
            "strata_pool_log_commits_total",
            "counter",
            "Intent-log commits that wrote records.",
            |p| p.log_commits,
        ),
        (
            "strata_pool_log_records_total",
            "counter",
            "Records those commits wrote (per commit: the group-commit batch).",
            |p| p.log_records,
        ),
        (
            "strata_pool_data_flushes_total",
            "counter",
            "Flushes of the data devices (fdatasync of each): by log commits and by the destager.",
            |p| p.data_flushes,
        ),
        (
            "strata_pool_commit_data_flushes_total",
            "counter",
            "Flushes of the data devices made by a log commit, under its lock (synchronous writers wait for them).",
            |p| p.commit_data_flushes,
        ),
        (
            "strata_pool_log_room_waits_total",
            "counter",
            "Synchronous writes that waited for room in the intent log (a checkpoint to free it): many mean the log is too small for the write rate.",
            |p| p.log_room_waits,
        ),
        (
            "strata_pool_log_room_wait_microseconds_total",
            "counter",
            "Time those writes waited, summed over the writers.",
            |p| p.log_room_wait_micros,
        ),
        (
            "strata_pool_allocator_lock_waits_total",
            "counter",
            "Times a write found the pool's allocator lock held by another (one lock for all the pool's volumes).",
            |p| p.allocator_lock_waits,
        ),
        (
            "strata_pool_allocator_lock_wait_microseconds_total",
            "counter",
            "Time those writes waited for the allocator lock, summed.",
            |p| p.allocator_lock_wait_micros,
        ),
        (
            "strata_pool_log_lock_waits_total",
            "counter",
            "Times a write found the intent log's pending-records lock held by another (one lock for all the pool's volumes).",
            |p| p.log_lock_waits,
        ),
        (
            "strata_pool_log_lock_wait_microseconds_total",
            "counter",
            "Time those writes waited for the log's pending-records lock, summed.",
            |p| p.log_lock_wait_micros,
        ),
        (
            "strata_pool_map_cache_pages",
            "gauge",
            "Block-map pages cached (2 KiB, each maps 1 MiB of a volume).",
            |p| p.meta_cache.map_pages,
        ),
        (
            "strata_pool_map_cache_max_pages",
            "gauge",
            "The most block-map pages the cache holds (an eighth of the pool's RAM setting).",
            |p| p.meta_cache.map_max_pages,
        ),
        (
            "strata_pool_map_cache_misses_total",
            "counter",
            "Block-map pages read from the metadata store because they were not cached: a steady rate means the cache is too small for the data written in use (raise the pool's RAM).",
            |p| p.meta_cache.map_misses,
        ),
        (
            "strata_pool_checksum_cache_pages",
            "gauge",
            "Checksum pages cached (4 KiB, each covers 4 MiB of data).",
            |p| p.meta_cache.crc_pages,
        ),
        (
            "strata_pool_checksum_cache_max_pages",
            "gauge",
            "The most checksum pages the cache holds (an eighth of the pool's RAM setting).",
            |p| p.meta_cache.crc_max_pages,
        ),
        (
            "strata_pool_checksum_cache_misses_total",
            "counter",
            "Checksum pages read from the metadata store because they were not cached.",
            |p| p.meta_cache.crc_misses,
        ),
    ];
    for (name, kind, help, value) in pool_series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for pool in pools {
            let _ = writeln!(out, "{name}{{pool=\"{}\"}} {}", escape_label(&pool.name), value(pool));
        }
    }
    render_migration(&mut out, pools);
    render_mirrors(&mut out, pools);
    render_scrub(&mut out, pools);
    let name = "strata_device_used_bytes";
    let _ = writeln!(
        out,
        "# HELP {name} Data bytes in use on a device, by tier.\n# TYPE {name} gauge"
    );
    for pool in pools {
        for device in &pool.devices {
            let _ = writeln!(
                out,
                "{name}{{pool=\"{}\",device=\"{}\",role=\"{}\"}} {}",
                escape_label(&pool.name),
                escape_label(&device.name),
                escape_label(&format!("{:?}", device.role).to_lowercase()),
                device.used_bytes
            );
        }
    }
    let name = "strata_pool_freeing_bytes";
    let _ = writeln!(
        out,
        "# HELP {name} Bytes committed to be freed (deleted snapshots and volumes), not free yet.\n# TYPE {name} gauge"
    );
    for pool in pools {
        let _ = writeln!(
            out,
            "{name}{{pool=\"{}\"}} {}",
            escape_label(&pool.name),
            pool.freeing_bytes
        );
    }
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for pool in pools {
            for device in &pool.devices {
                if let Some(value) = value(device) {
                    let _ = writeln!(
                        out,
                        "{name}{{pool=\"{}\",device=\"{}\"}} {value}",
                        escape_label(&pool.name),
                        escape_label(&device.name)
                    );
                }
            }
        }
    }
    out
}

/// Redundancy: whether each pool is degraded, and per mirror device its
/// state, errors and repairs; a resilver's progress.
fn render_mirrors(out: &mut String, pools: &[crate::control::manager::PoolStatus]) {
    let header = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let name = "strata_pool_degraded";
    header(
        out,
        name,
        "gauge",
        "1 while a mirror of the pool serves without one of its devices.",
    );
    for pool in pools {
        let _ = writeln!(
            out,
            "{name}{{pool=\"{}\"}} {}",
            escape_label(&pool.name),
            u8::from(pool.state != "ONLINE")
        );
    }
    type Count = fn(&crate::pool::ChildStatus) -> u64;
    let series: [(&str, &str, &str, Count); 5] = [
        (
            "strata_mirror_device_online",
            "gauge",
            "1 while the mirror device is up to date and serving reads.",
            |c| u64::from(c.state == crate::pool::vdev::Health::Online),
        ),
        (
            "strata_mirror_device_read_errors_total",
            "counter",
            "Reads the mirror device failed (served from another copy).",
            |c| c.read_errors,
        ),
        (
            "strata_mirror_device_write_errors_total",
            "counter",
            "Writes and flushes the mirror device failed.",
            |c| c.write_errors,
        ),
        (
            "strata_mirror_device_checksum_errors_total",
            "counter",
            "Sectors of the mirror device whose checksum did not match.",
            |c| c.checksum_errors,
        ),
        (
            "strata_mirror_device_repaired_sectors_total",
            "counter",
            "4 KiB sectors of the mirror device rewritten from another copy.",
            |c| c.repaired_sectors,
        ),
    ];
    for (name, kind, help, value) in series {
        header(out, name, kind, help);
        for pool in pools {
            for member in &pool.devices {
                for child in &member.children {
                    let _ = writeln!(
                        out,
                        "{name}{{pool=\"{}\",mirror=\"{}\",device=\"{}\"}} {}",
                        escape_label(&pool.name),
                        escape_label(&member.name),
                        escape_label(&child.name),
                        value(child)
                    );
                }
            }
        }
    }
    for (name, help, done) in [
        (
            "strata_mirror_resilver_done_bytes",
            "Bytes a resilver under way has brought up to date.",
            true,
        ),
        (
            "strata_mirror_resilver_total_bytes",
            "Bytes a resilver under way copies in all.",
            false,
        ),
    ] {
        header(out, name, "gauge", help);
        for pool in pools {
            for member in &pool.devices {
                if let Some(resilver) = member.resilver {
                    let _ = writeln!(
                        out,
                        "{name}{{pool=\"{}\",mirror=\"{}\"}} {}",
                        escape_label(&pool.name),
                        escape_label(&member.name),
                        if done {
                            resilver.done_bytes
                        } else {
                            resilver.total_bytes
                        }
                    );
                }
            }
        }
    }
}

/// Scrubs: whether one is under way and what the current or last one
/// found, and when the next scheduled one is due.
fn render_scrub(out: &mut String, pools: &[crate::control::manager::PoolStatus]) {
    type Value = fn(&crate::control::manager::PoolStatus) -> Option<u64>;
    let series: [(&str, &str, Value); 7] = [
        (
            "strata_pool_scrub_running",
            "1 while a scrub of the pool is under way.",
            |p| {
                Some(u64::from(
                    p.scrub
                        .as_ref()
                        .is_some_and(|s| s.state == crate::pool::ScrubState::Scanning),
                ))
            },
        ),
        (
            "strata_pool_scrub_issued_bytes",
            "Bytes the current or last scrub read back and checked.",
            |p| p.scrub.as_ref().map(|s| s.issued_bytes),
        ),
        (
            "strata_pool_scrub_total_bytes",
            "Bytes the current or last scrub had to check when it started.",
            |p| p.scrub.as_ref().map(|s| s.total_bytes),
        ),
        (
            "strata_pool_scrub_repaired_bytes",
            "Bytes the current or last scrub rewrote from another copy.",
            |p| p.scrub.as_ref().map(|s| s.repaired_bytes),
        ),
        (
            "strata_pool_scrub_errors",
            "Blocks the current or last scrub found that no copy holds intact.",
            |p| p.scrub.as_ref().map(|s| s.errors),
        ),
        (
            "strata_pool_scrub_end_timestamp_seconds",
            "When the last scrub ended (unix seconds).",
            |p| p.scrub.as_ref().and_then(|s| s.ended_unix),
        ),
        (
            "strata_pool_scrub_next_timestamp_seconds",
            "When the next scheduled scrub is due (unix seconds; pool property scrub.interval).",
            |p| p.next_scrub_unix,
        ),
    ];
    for (name, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for pool in pools {
            if let Some(value) = value(pool) {
                let _ = writeln!(out, "{name}{{pool=\"{}\"}} {value}", escape_label(&pool.name));
            }
        }
    }
}

/// Automatic tiering: what the migrator moved, is moving and failed to
/// move, and each tier's size and use.
fn render_migration(out: &mut String, pools: &[crate::control::manager::PoolStatus]) {
    let header = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let name = "strata_pool_migrated_bytes_total";
    header(
        out,
        name,
        "counter",
        "Bytes the migrator moved between tiers since the daemon started (down: fast to capacity).",
    );
    for pool in pools {
        let label = escape_label(&pool.name);
        let migration = &pool.migration;
        for (direction, value) in [("down", migration.moved_down_bytes), ("up", migration.moved_up_bytes)] {
            let _ = writeln!(out, "{name}{{pool=\"{label}\",direction=\"{direction}\"}} {value}");
        }
    }
    let name = "strata_pool_migration_errors_total";
    header(
        out,
        name,
        "counter",
        "Block moves the migrator abandoned on an error (the data stayed where it was).",
    );
    for pool in pools {
        let _ = writeln!(
            out,
            "{name}{{pool=\"{}\"}} {}",
            escape_label(&pool.name),
            pool.migration.errors
        );
    }
    let name = "strata_pool_migration_running";
    header(out, name, "gauge", "1 while a migration pass is under way.");
    for pool in pools {
        let _ = writeln!(
            out,
            "{name}{{pool=\"{}\"}} {}",
            escape_label(&pool.name),
            u8::from(pool.migration.running)
        );
    }
    let name = "strata_pool_migration_queued_chunks";
    header(
        out,
        name,
        "gauge",
        "Chunks the pass under way still has to move, each way.",
    );
    for pool in pools {
        let label = escape_label(&pool.name);
        let migration = &pool.migration;
        for (direction, value) in [
            ("down", migration.queued_down_chunks),
            ("up", migration.queued_up_chunks),
        ] {
            let _ = writeln!(out, "{name}{{pool=\"{label}\",direction=\"{direction}\"}} {value}");
        }
    }
    let name = "strata_pool_tier_bytes";
    header(
        out,
        name,
        "gauge",
        "Data capacity (size) and space in use (used) of each tier.",
    );
    for pool in pools {
        let label = escape_label(&pool.name);
        for (tier, space) in [("fast", pool.tiers.fast), ("capacity", pool.tiers.capacity)] {
            for (kind, value) in [("size", space.size_bytes), ("used", space.used_bytes)] {
                let _ = writeln!(
                    out,
                    "{name}{{pool=\"{label}\",tier=\"{tier}\",kind=\"{kind}\"}} {value}"
                );
            }
        }
    }
}

/// The NFS duplicate-request cache (`frontend::nfs::drc`), once the NFS
/// server runs: replays and drops of retransmitted calls, early evictions
/// (the cache too small for the retransmissions it should catch), and
/// what it holds.
pub fn render_nfs(stats: Option<crate::frontend::nfs::drc::DrcStats>) -> String {
    let mut out = String::new();
    let Some(stats) = stats else {
        return out;
    };
    let rows = [
        (
            "strata_nfs_drc_replays_total",
            "counter",
            "Retransmitted non-idempotent NFS calls answered from the duplicate-request cache.",
            stats.replayed,
        ),
        (
            "strata_nfs_drc_dropped_total",
            "counter",
            "Retransmitted NFS calls dropped unanswered because their first copy was still running.",
            stats.dropped,
        ),
        (
            "strata_nfs_drc_evictions_total",
            "counter",
            "Replies dropped from the duplicate-request cache before they expired, to keep its bounds.",
            stats.evicted,
        ),
        (
            "strata_nfs_drc_entries",
            "gauge",
            "Replies held in the duplicate-request cache.",
            stats.entries,
        ),
        (
            "strata_nfs_drc_bytes",
            "gauge",
            "Bytes of replies held in the duplicate-request cache.",
            stats.bytes,
        ),
    ];
    write_plain_rows(&mut out, &rows);
    out
}

/// Writes unlabelled metrics, each a (name, kind, help, value) row.
fn write_plain_rows(out: &mut String, rows: &[(&str, &str, &str, u64)]) {
    for (name, kind, help, value) in rows {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
}

/// The file service: removed files whose data freeing failed after the
/// removal committed (the removal was answered as done), and how their
/// background retries went.
pub fn render_fs(frees: crate::fs::DeferredFrees) -> String {
    let mut out = String::new();
    let rows = [
        (
            "strata_fs_deferred_frees_total",
            "counter",
            "Removed files whose data could not be freed at once (retried in the background).",
            frees.deferred,
        ),
        (
            "strata_fs_deferred_frees_done_total",
            "counter",
            "Removed files whose data a background retry freed.",
            frees.freed,
        ),
        (
            "strata_fs_deferred_free_retries_failed_total",
            "counter",
            "Background retries of freeing a removed file's data that failed again.",
            frees.retries_failed,
        ),
        (
            "strata_fs_deferred_frees_pending",
            "gauge",
            "Removed files whose data waits for a background retry to be freed.",
            frees.pending,
        ),
    ];
    write_plain_rows(&mut out, &rows);
    out
}
