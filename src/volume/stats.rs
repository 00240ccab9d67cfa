//! Per-volume, per-protocol, per-operation counters and latency histograms,
//! recorded by the frontends through the volume they serve.
//!
//! Recording is a handful of relaxed atomic adds on counters the volume owns:
//! no lock and no map lookup on the data path. The histogram buckets are
//! powers of two of microseconds; `admin::metrics` renders them in the
//! Prometheus text format. (The latency heat maps read the finer
//! log-linear buckets of [`crate::analytics`] instead.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::block::{Op, Protocol, OPS, PROTOCOLS};

/// Bucket `i` counts latencies up to 2^i microseconds (1 µs .. ~8.4 s); one
/// more bucket counts everything slower.
pub const LATENCY_BUCKETS: usize = 24;

#[derive(Debug, Default)]
pub struct OpStats {
    pub ops: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
    pub latency_ns_sum: AtomicU64,
    pub buckets: [AtomicU64; LATENCY_BUCKETS + 1],
}

/// The bucket a latency falls in.
pub fn bucket_index(latency: Duration) -> usize {
    let micros = latency.as_micros().max(1) as u64;
    // ceil(log2(micros)): 1 µs -> 0, 2 µs -> 1, 3..4 µs -> 2, ...
    let index = (u64::BITS - (micros - 1).leading_zeros()) as usize;
    index.min(LATENCY_BUCKETS)
}

impl OpStats {
    pub fn record(&self, bytes: u64, latency: Duration, ok: bool) {
        self.ops.fetch_add(1, Ordering::Relaxed);
        if ok {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.latency_ns_sum
            .fetch_add(latency.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
        self.buckets[bucket_index(latency)].fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
pub struct VolumeStats {
    per_protocol: [[OpStats; OPS.len()]; PROTOCOLS.len()],
}

impl VolumeStats {
    pub fn op(&self, protocol: Protocol, op: Op) -> &OpStats {
        &self.per_protocol[protocol as usize][op as usize]
    }

    pub fn record(&self, protocol: Protocol, op: Op, bytes: u64, latency: Duration, ok: bool) {
        self.op(protocol, op).record(bytes, latency, ok);
    }

    /// Failed reads and failed writes (write, trim, write-zeroes, flush) over
    /// all protocols, for `pool status`.
    pub fn error_totals(&self) -> (u64, u64) {
        let mut read = 0;
        let mut write = 0;
        for protocol in PROTOCOLS {
            for op in OPS {
                let errors = self.op(protocol, op).errors.load(Ordering::Relaxed);
                match op {
                    Op::Read | Op::Cache | Op::BlockStatus => read += errors,
                    Op::Write | Op::Flush | Op::Trim | Op::WriteZeroes => write += errors,
                }
            }
        }
        (read, write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(bucket_index(Duration::from_nanos(10)), 0);
        assert_eq!(bucket_index(Duration::from_micros(1)), 0);
        assert_eq!(bucket_index(Duration::from_micros(2)), 1);
        assert_eq!(bucket_index(Duration::from_micros(3)), 2);
        assert_eq!(bucket_index(Duration::from_micros(4)), 2);
        assert_eq!(bucket_index(Duration::from_micros(5)), 3);
        assert_eq!(bucket_index(Duration::from_secs(3600)), LATENCY_BUCKETS);
    }

    #[test]
    fn records() {
        let stats = VolumeStats::default();
        stats.record(Protocol::Nbd, Op::Read, 4096, Duration::from_micros(3), true);
        stats.record(Protocol::Nbd, Op::Write, 4096, Duration::from_micros(3), false);
        let read = stats.op(Protocol::Nbd, Op::Read);
        assert_eq!(read.ops.load(Ordering::Relaxed), 1);
        assert_eq!(read.bytes.load(Ordering::Relaxed), 4096);
        assert_eq!(read.buckets[2].load(Ordering::Relaxed), 1);
        assert_eq!(stats.error_totals(), (0, 1));
    }
}
