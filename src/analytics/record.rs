//! Recording: one [`Recorder`] per connection (and the volume it serves),
//! counters only its connection adds to; a collector turns their growth
//! into one [`Frame`] per second, kept in a bounded history.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::hist::{bucket_of, Packed, Sparse, BUCKETS};
use crate::block::{Op, Protocol, OPS};
use crate::sync::LockOrAbort;

/// Regions a volume's offsets are counted in (each 1/32 of the volume).
pub const OFFSET_BUCKETS: usize = 32;
/// The offset of a request that addresses no single range (an iSCSI
/// UNMAP's ranges are in its parameter list): not counted in a region.
pub const NO_OFFSET: u64 = u64::MAX;
/// Seconds kept at one-second resolution.
pub const SECONDS_KEPT: usize = 3600;
/// Minutes kept at one-minute resolution.
pub const MINUTES_KEPT: usize = 1440;
/// Clients named in a frame (by operations); the rest count as `other`.
pub const TOP_CLIENTS: usize = 32;
/// The name the clients beyond [`TOP_CLIENTS`] share.
pub const OTHER_CLIENT: &str = "other";

const OPS_N: usize = OPS.len();
/// Buckets per operation: its latency, its time queued, its time waiting
/// for log commits.
const OP_BUCKETS: usize = 3 * BUCKETS;
const QUEUE_AT: usize = BUCKETS;
const COMMIT_AT: usize = 2 * BUCKETS;

/// One operation's counters in a recorder, allocated at its first request
/// (an idle connection holds none; one that reads and writes, two of
/// 2.4 KiB). Bucket counts are 32-bit: the collector takes differences
/// every second, which wrap correctly below 2^32 requests a second.
struct OpCounters {
    ops: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    buckets: Box<[AtomicU32]>,
}

impl OpCounters {
    fn new() -> OpCounters {
        OpCounters {
            ops: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            buckets: (0..OP_BUCKETS).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

/// What the collector saw of a recorder last time.
struct Seen {
    /// Per operation: ops, bytes, errors, then the buckets.
    ops: [Option<Box<[u64]>>; OPS_N],
    offsets: [u32; 2 * OFFSET_BUCKETS],
}

/// Parts of a request's latency: how long it waited before it ran
/// (queued), and how long it waited for intent-log commits while running.
#[derive(Debug, Clone, Copy, Default)]
pub struct Split {
    pub queued_ns: u64,
    pub commit_ns: u64,
}

/// What one connection records for the volume it serves. Recording is a
/// few relaxed atomic adds on counters no other connection touches: no
/// lock, no allocation, no lookup.
pub struct Recorder {
    protocol: Protocol,
    client: Arc<str>,
    volume: Arc<str>,
    size_bytes: u64,
    /// Per operation (`Op as usize`).
    ops: [OnceLock<OpCounters>; OPS_N],
    /// Requests per region: reads, then writes.
    offsets: [AtomicU32; 2 * OFFSET_BUCKETS],
    /// The counters as the collector last saw them (only it touches this).
    seen: Mutex<Seen>,
}

impl Recorder {
    /// Records one request: `offset` and `bytes` of the range it addressed
    /// (bytes moved: 0 for a flush; offset [`NO_OFFSET`] when there is no
    /// single one), its latency from arrival to reply, and the parts of it
    /// `split` knows (a part of 0 is not counted).
    pub fn record(&self, op: Op, offset: u64, bytes: u64, latency: Duration, ok: bool, split: Split) {
        let counters = self.ops[op as usize].get_or_init(OpCounters::new);
        counters.ops.fetch_add(1, Ordering::Relaxed);
        if ok {
            counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        let add = |at: usize| {
            counters.buckets[at].fetch_add(1, Ordering::Relaxed);
        };
        let ns = latency.as_nanos().min(u64::MAX as u128) as u64;
        add(bucket_of(ns));
        if split.queued_ns > 0 {
            add(QUEUE_AT + bucket_of(split.queued_ns));
        }
        if split.commit_ns > 0 {
            add(COMMIT_AT + bucket_of(split.commit_ns));
        }
        let side = match op {
            _ if offset == NO_OFFSET => return,
            Op::Read => 0,
            Op::Write | Op::WriteZeroes | Op::Trim => 1,
            _ => return,
        };
        let region = if self.size_bytes == 0 {
            0
        } else {
            ((offset as u128 * OFFSET_BUCKETS as u128 / self.size_bytes as u128) as usize).min(OFFSET_BUCKETS - 1)
        };
        self.offsets[side * OFFSET_BUCKETS + region].fetch_add(1, Ordering::Relaxed);
    }
}

/// One second (or one minute) of everything recorded.
#[derive(Debug, Clone, Default)]
pub struct Frame {
    /// Start of the period, Unix seconds.
    pub unix: u64,
    pub series: Vec<Series>,
    pub offsets: Vec<Offsets>,
}

/// Requests of one volume, protocol, operation and client in a frame.
#[derive(Debug, Clone)]
pub struct Series {
    pub volume: Arc<str>,
    pub protocol: Protocol,
    pub op: Op,
    pub client: Arc<str>,
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Latency, time queued and time waiting for commits, packed.
    times: Packed,
}

impl Series {
    #[allow(clippy::too_many_arguments)]
    fn new(
        recorder: &Recorder,
        op: Op,
        ops: u64,
        bytes: u64,
        errors: u64,
        latency: &Sparse,
        queued: &Sparse,
        commit: &Sparse,
    ) -> Series {
        Series {
            volume: recorder.volume.clone(),
            protocol: recorder.protocol,
            op,
            client: recorder.client.clone(),
            ops,
            bytes,
            errors,
            times: Packed::new(&[latency, queued, commit]),
        }
    }

    /// The requests' latencies, arrival to reply.
    pub fn latency(&self) -> Sparse {
        self.times.get(0)
    }

    /// Their time queued before they ran (of those that waited).
    pub fn queued(&self) -> Sparse {
        self.times.get(1)
    }

    /// Their time waiting for intent-log commits (of those that waited).
    pub fn commit(&self) -> Sparse {
        self.times.get(2)
    }

    /// Adds another series of the same key.
    fn add(&mut self, other: &Series) {
        self.ops += other.ops;
        self.bytes += other.bytes;
        self.errors += other.errors;
        let mut times = [self.latency(), self.queued(), self.commit()];
        for (mine, theirs) in times.iter_mut().zip([other.latency(), other.queued(), other.commit()]) {
            mine.merge(&theirs);
        }
        self.times = Packed::new(&[&times[0], &times[1], &times[2]]);
    }

    fn heap_bytes(&self) -> usize {
        self.times.heap_bytes()
    }
}

/// Requests per region of a volume in a frame (counts by region, of
/// [`OFFSET_BUCKETS`], packed).
#[derive(Debug, Clone)]
pub struct Offsets {
    pub volume: Arc<str>,
    pub size_bytes: u64,
    counts: Packed,
}

impl Offsets {
    fn new(volume: Arc<str>, size_bytes: u64, reads: &Sparse, writes: &Sparse) -> Offsets {
        Offsets {
            volume,
            size_bytes,
            counts: Packed::new(&[reads, writes]),
        }
    }

    pub fn reads(&self) -> Sparse {
        self.counts.get(0)
    }

    pub fn writes(&self) -> Sparse {
        self.counts.get(1)
    }
}

impl Frame {
    fn heap_bytes(&self) -> usize {
        self.series.capacity() * std::mem::size_of::<Series>()
            + self.series.iter().map(Series::heap_bytes).sum::<usize>()
            + self.offsets.capacity() * std::mem::size_of::<Offsets>()
            + self.offsets.iter().map(|o| o.counts.heap_bytes()).sum::<usize>()
    }

    /// Adds `other` (a later period) into this one.
    fn merge(&mut self, other: &Frame) {
        let mut at: HashMap<(Arc<str>, u8, u8, Arc<str>), usize> = self
            .series
            .iter()
            .enumerate()
            .map(|(i, s)| ((s.volume.clone(), s.protocol as u8, s.op as u8, s.client.clone()), i))
            .collect();
        for series in &other.series {
            let key = (
                series.volume.clone(),
                series.protocol as u8,
                series.op as u8,
                series.client.clone(),
            );
            match at.get(&key) {
                Some(&i) => self.series[i].add(series),
                None => {
                    at.insert(key, self.series.len());
                    self.series.push(series.clone());
                }
            }
        }
        for offsets in &other.offsets {
            match self.offsets.iter_mut().find(|o| o.volume == offsets.volume) {
                Some(mine) => {
                    let (mut reads, mut writes) = (mine.reads(), mine.writes());
                    reads.merge(&offsets.reads());
                    writes.merge(&offsets.writes());
                    *mine = Offsets::new(mine.volume.clone(), offsets.size_bytes, &reads, &writes);
                }
                None => self.offsets.push(offsets.clone()),
            }
        }
    }
}

/// The history: the last hour by second, the last day by minute.
#[derive(Default)]
pub struct History {
    pub seconds: VecDeque<Frame>,
    pub minutes: VecDeque<Frame>,
    /// The minute being summed up (pushed to `minutes` when it ends).
    minute: Option<Frame>,
    heap_bytes: usize,
}

impl History {
    fn push(&mut self, frame: Frame) {
        let minute_start = frame.unix / 60 * 60;
        match &mut self.minute {
            Some(current) if current.unix == minute_start => current.merge(&frame),
            _ => {
                let mut summed = frame.clone();
                summed.unix = minute_start;
                if let Some(done) = self.minute.replace(summed) {
                    self.heap_bytes += done.heap_bytes();
                    self.minutes.push_back(done);
                    if self.minutes.len() > MINUTES_KEPT {
                        if let Some(old) = self.minutes.pop_front() {
                            self.heap_bytes -= old.heap_bytes();
                        }
                    }
                }
            }
        }
        self.heap_bytes += frame.heap_bytes();
        self.seconds.push_back(frame);
        if self.seconds.len() > SECONDS_KEPT {
            if let Some(old) = self.seconds.pop_front() {
                self.heap_bytes -= old.heap_bytes();
            }
        }
    }

    /// The newest complete second, if any.
    pub fn latest(&self) -> Option<u64> {
        self.seconds.back().map(|f| f.unix)
    }

    /// The minute being summed up (not in `minutes` yet).
    pub fn current_minute(&self) -> Option<&Frame> {
        self.minute.as_ref()
    }

    /// Bytes the kept frames hold (their vectors; the names they share are
    /// counted once by the recorders).
    pub fn heap_bytes(&self) -> usize {
        self.heap_bytes
            + self.minute.as_ref().map_or(0, Frame::heap_bytes)
            + (self.seconds.capacity() + self.minutes.capacity()) * std::mem::size_of::<Frame>()
    }
}

/// The daemon's analytics: the live recorders and the history.
pub struct Analytics {
    /// Off (`strata serve --no-analytics`): connections get no recorder.
    enabled: std::sync::atomic::AtomicBool,
    recorders: Mutex<Vec<Arc<Recorder>>>,
    history: Mutex<History>,
}

impl Analytics {
    pub fn new() -> Arc<Self> {
        Arc::new(Analytics {
            enabled: std::sync::atomic::AtomicBool::new(true),
            recorders: Mutex::default(),
            history: Mutex::default(),
        })
    }

    /// Turns recording on or off for connections made from now on.
    pub fn set_enabled(&self, enabled: bool) {
        self.enabled.store(enabled, Ordering::Relaxed);
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// A recorder for a new connection of `client` to `volume` (of
    /// `size_bytes`). Taken once per connection: the only lock on the way.
    /// None while analytics are off.
    pub fn recorder(&self, protocol: Protocol, client: &str, volume: &str, size_bytes: u64) -> Option<Arc<Recorder>> {
        if !self.enabled() {
            return None;
        }
        let recorder = Arc::new(Recorder {
            protocol,
            client: client.into(),
            volume: volume.into(),
            size_bytes,
            ops: Default::default(),
            offsets: std::array::from_fn(|_| AtomicU32::new(0)),
            seen: Mutex::new(Seen {
                ops: Default::default(),
                offsets: [0; 2 * OFFSET_BUCKETS],
            }),
        });
        self.recorders.lock_or_abort().push(recorder.clone());
        Some(recorder)
    }

    /// Connections recording now.
    pub fn recorders(&self) -> usize {
        self.recorders.lock_or_abort().len()
    }

    /// Turns what the recorders counted since the last call into the frame
    /// of second `unix`, and forgets the recorders of closed connections
    /// (after taking what they counted last).
    pub fn collect(&self, unix: u64) {
        let recorders: Vec<Arc<Recorder>> = self.recorders.lock_or_abort().clone();
        let mut series: HashMap<(Arc<str>, u8, u8, Arc<str>), Series> = HashMap::new();
        let mut offsets: HashMap<Arc<str>, (u64, Vec<u64>)> = HashMap::new();
        let mut closed = Vec::new();
        for recorder in &recorders {
            // Two references: this list's and the registry's; the
            // connection has dropped its own.
            if Arc::strong_count(recorder) <= 2 {
                closed.push(Arc::as_ptr(recorder));
            }
            let mut seen = recorder.seen.lock_or_abort();
            for op in OPS {
                let i = op as usize;
                let Some(counters) = recorder.ops[i].get() else {
                    continue;
                };
                let last = seen.ops[i].get_or_insert_with(|| vec![0; 3 + OP_BUCKETS].into_boxed_slice());
                let mut delta = |at: usize, now: u64| {
                    let d = now.wrapping_sub(last[at]);
                    last[at] = now;
                    d
                };
                let ops = delta(0, counters.ops.load(Ordering::Relaxed));
                if ops == 0 {
                    continue;
                }
                let bytes = delta(1, counters.bytes.load(Ordering::Relaxed));
                let errors = delta(2, counters.errors.load(Ordering::Relaxed));
                let mut buckets = |from: usize| {
                    Sparse::from_dense((from..from + BUCKETS).map(|b| {
                        let now = counters.buckets[b].load(Ordering::Relaxed);
                        let d = now.wrapping_sub(last[3 + b] as u32);
                        last[3 + b] = u64::from(now);
                        u64::from(d)
                    }))
                };
                let latency = buckets(0);
                let queued = buckets(QUEUE_AT);
                let commit = buckets(COMMIT_AT);
                let key = (
                    recorder.volume.clone(),
                    recorder.protocol as u8,
                    op as u8,
                    recorder.client.clone(),
                );
                let new = Series::new(recorder, op, ops, bytes, errors, &latency, &queued, &commit);
                match series.get_mut(&key) {
                    Some(entry) => entry.add(&new),
                    None => {
                        series.insert(key, new);
                    }
                }
            }
            let region: Vec<u64> = (0..2 * OFFSET_BUCKETS)
                .map(|r| {
                    let now = recorder.offsets[r].load(Ordering::Relaxed);
                    let d = now.wrapping_sub(seen.offsets[r]);
                    seen.offsets[r] = now;
                    u64::from(d)
                })
                .collect();
            if region.iter().any(|c| *c > 0) {
                let entry = offsets
                    .entry(recorder.volume.clone())
                    .or_insert_with(|| (recorder.size_bytes, vec![0; 2 * OFFSET_BUCKETS]));
                for (sum, c) in entry.1.iter_mut().zip(region) {
                    *sum += c;
                }
            }
        }
        drop(recorders);
        if !closed.is_empty() {
            self.recorders
                .lock_or_abort()
                .retain(|r| !closed.contains(&Arc::as_ptr(r)));
        }
        let mut series: Vec<Series> = series.into_values().collect();
        bound_clients(&mut series);
        series.sort_by(|a, b| {
            (&a.volume, a.protocol as u8, a.op as u8, &a.client).cmp(&(
                &b.volume,
                b.protocol as u8,
                b.op as u8,
                &b.client,
            ))
        });
        let mut offsets: Vec<Offsets> = offsets
            .into_iter()
            .map(|(volume, (size_bytes, counts))| {
                let reads = Sparse::from_dense(counts[..OFFSET_BUCKETS].iter().copied());
                let writes = Sparse::from_dense(counts[OFFSET_BUCKETS..].iter().copied());
                Offsets::new(volume, size_bytes, &reads, &writes)
            })
            .collect();
        offsets.sort_by(|a, b| a.volume.cmp(&b.volume));
        let frame = Frame { unix, series, offsets };
        let mut history = self.history.lock_or_abort();
        if history.latest().is_some_and(|latest| latest >= unix) {
            // The clock went back: keep the history in order.
            return;
        }
        history.push(frame);
    }

    /// Runs `f` on the history (briefly: the collector waits meanwhile).
    pub fn with_history<R>(&self, f: impl FnOnce(&History) -> R) -> R {
        f(&self.history.lock_or_abort())
    }
}

/// Keeps the [`TOP_CLIENTS`] busiest clients of a frame by name and merges
/// the rest into [`OTHER_CLIENT`], so a frame's size does not grow with
/// the number of clients.
fn bound_clients(series: &mut Vec<Series>) {
    let mut by_client: HashMap<Arc<str>, u64> = HashMap::new();
    for s in series.iter() {
        *by_client.entry(s.client.clone()).or_default() += s.ops;
    }
    if by_client.len() <= TOP_CLIENTS {
        return;
    }
    let mut ranked: Vec<(Arc<str>, u64)> = by_client.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let kept: std::collections::HashSet<Arc<str>> = ranked.into_iter().take(TOP_CLIENTS).map(|(c, _)| c).collect();
    let other: Arc<str> = OTHER_CLIENT.into();
    let mut merged: HashMap<(Arc<str>, u8, u8, Arc<str>), Series> = HashMap::new();
    for mut s in series.drain(..) {
        if !kept.contains(&s.client) {
            s.client = other.clone();
        }
        let key = (s.volume.clone(), s.protocol as u8, s.op as u8, s.client.clone());
        match merged.get_mut(&key) {
            Some(m) => m.add(&s),
            None => {
                merged.insert(key, s);
            }
        }
    }
    series.extend(merged.into_values());
}

/// Collects a frame at each wall-clock second until `stop`.
pub async fn run(analytics: Arc<Analytics>, mut stop: tokio::sync::watch::Receiver<bool>) {
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let next = Duration::from_secs(now.as_secs() + 1);
        tokio::select! {
            _ = tokio::time::sleep(next.saturating_sub(now)) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        // The second that just ended.
        analytics.collect(now.as_secs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_holds_what_each_connection_did_that_second() {
        let analytics = Analytics::new();
        let a = analytics.recorder(Protocol::Nbd, "10.0.0.1", "p/v", 1 << 30).unwrap();
        let b = analytics.recorder(Protocol::Iscsi, "iqn.x", "p/v", 1 << 30).unwrap();
        for _ in 0..10 {
            a.record(Op::Read, 0, 4096, Duration::from_micros(50), true, Split::default());
        }
        a.record(
            Op::Write,
            (1 << 30) - 4096,
            4096,
            Duration::from_millis(2),
            false,
            Split::default(),
        );
        b.record(
            Op::Write,
            1 << 29,
            8192,
            Duration::from_micros(100),
            true,
            Split::default(),
        );
        analytics.collect(100);
        a.record(Op::Read, 0, 4096, Duration::from_micros(50), true, Split::default());
        analytics.collect(101);
        analytics.with_history(|h| {
            assert_eq!(h.seconds.len(), 2);
            let first = &h.seconds[0];
            assert_eq!(first.unix, 100);
            let read = first.series.iter().find(|s| s.op == Op::Read).unwrap();
            assert_eq!((read.ops, read.bytes, read.errors), (10, 40960, 0));
            assert_eq!(
                read.latency().quantile(0.5),
                Some(super::super::hist::value_ns(bucket_of(50_000)))
            );
            let nbd_write = first
                .series
                .iter()
                .find(|s| s.op == Op::Write && s.protocol == Protocol::Nbd)
                .unwrap();
            assert_eq!((nbd_write.ops, nbd_write.bytes, nbd_write.errors), (1, 0, 1));
            let offsets = &first.offsets[0];
            assert_eq!(offsets.reads(), Sparse(vec![(0, 10)]));
            assert_eq!(offsets.writes(), Sparse(vec![(16, 1), (31, 1)]));
            assert_eq!(h.seconds[1].series.len(), 1);
            assert_eq!(h.seconds[1].series[0].ops, 1);
        });
    }

    #[test]
    fn closed_connections_are_counted_once_then_forgotten() {
        let analytics = Analytics::new();
        let a = analytics.recorder(Protocol::Nbd, "c", "p/v", 1 << 20).unwrap();
        a.record(Op::Flush, 0, 0, Duration::from_micros(5), true, Split::default());
        drop(a);
        analytics.collect(1);
        assert_eq!(analytics.recorders(), 0);
        analytics.collect(2);
        analytics.with_history(|h| {
            assert_eq!(h.seconds[0].series[0].ops, 1);
            assert!(h.seconds[1].series.is_empty());
        });
    }

    #[test]
    fn clients_beyond_the_busiest_share_one_name() {
        let analytics = Analytics::new();
        let recorders: Vec<_> = (0..TOP_CLIENTS + 8)
            .map(|i| {
                analytics
                    .recorder(Protocol::Nbd, &format!("c{i}"), "p/v", 1 << 20)
                    .unwrap()
            })
            .collect();
        for (i, r) in recorders.iter().enumerate() {
            for _ in 0..=i {
                r.record(Op::Read, 0, 512, Duration::from_micros(5), true, Split::default());
            }
        }
        analytics.collect(7);
        analytics.with_history(|h| {
            let frame = &h.seconds[0];
            assert_eq!(frame.series.len(), TOP_CLIENTS + 1);
            let other = frame.series.iter().find(|s| &*s.client == OTHER_CLIENT).unwrap();
            // The 8 quietest: 1 + 2 + ... + 8 reads.
            assert_eq!(other.ops, 36);
            let total: u64 = frame.series.iter().map(|s| s.ops).sum();
            assert_eq!(total, (1..=(TOP_CLIENTS as u64 + 8)).sum::<u64>());
        });
    }

    #[test]
    fn minutes_sum_their_seconds_and_the_history_is_bounded() {
        let analytics = Analytics::new();
        let r = analytics.recorder(Protocol::Nbd, "c", "p/v", 1 << 20).unwrap();
        for second in 0..(SECONDS_KEPT as u64 + 120) {
            r.record(Op::Write, 0, 4096, Duration::from_micros(20), true, Split::default());
            analytics.collect(second);
        }
        analytics.with_history(|h| {
            assert_eq!(h.seconds.len(), SECONDS_KEPT);
            assert_eq!(h.minutes.len(), (SECONDS_KEPT + 120) / 60 - 1);
            assert!(h.minutes.iter().all(|m| m.series[0].ops == 60));
            assert!(h.heap_bytes() > 0);
        });
    }

    /// What an hour (by second) and a day (by minute) of history cost with
    /// 100 volumes and 50 clients (each client on two volumes, reading and
    /// writing every second with latencies over ~30 buckets). The day is
    /// projected from the hour's minutes (86,400 simulated seconds would
    /// take minutes here); ARCHITECTURE.md ("Analytics") quotes the printed
    /// numbers.
    #[test]
    fn an_hour_of_100_volumes_and_50_clients_fits_the_stated_memory() {
        // (The numbers include the queued and commit-wait histograms.)
        let analytics = Analytics::new();
        let recorders: Vec<Arc<Recorder>> = (0..50)
            .flat_map(|client| {
                let analytics = &analytics;
                (0..2).map(move |i| {
                    let volume = format!("pool/vol{}", (client * 2 + i) % 100);
                    analytics
                        .recorder(Protocol::Nbd, &format!("10.0.0.{client}"), &volume, 1 << 30)
                        .unwrap()
                })
            })
            .collect();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for second in 0..SECONDS_KEPT as u64 {
            for r in &recorders {
                for k in 0..64u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // 20 µs .. ~20 ms, log-uniform: ~30-70 buckets per op.
                    let ns = 20_000u64 << (x % 10);
                    let op = if k % 2 == 0 { Op::Read } else { Op::Write };
                    // Some time queued, and writes wait for commits.
                    let split = Split {
                        queued_ns: 200 + (x >> 50) % 2_000,
                        commit_ns: if op == Op::Write { ns / 2 } else { 0 },
                    };
                    r.record(
                        op,
                        (x >> 20) % (1 << 30),
                        4096,
                        Duration::from_nanos(ns + (x >> 40) % ns),
                        true,
                        split,
                    );
                }
            }
            analytics.collect(second);
        }
        let (hour, minute, minutes) = analytics.with_history(|h| {
            let seconds: usize = h.seconds.iter().map(Frame::heap_bytes).sum();
            let per_minute = h.minutes.iter().map(Frame::heap_bytes).sum::<usize>() / h.minutes.len().max(1);
            (seconds, per_minute, h.minutes.len())
        });
        let day = minute * MINUTES_KEPT;
        eprintln!(
            "analytics history: 100 volumes x 50 clients: an hour by second {:.1} MiB, a minute {} KiB, a day by minute {:.1} MiB (projected from {minutes} minutes)",
            hour as f64 / (1 << 20) as f64,
            minute / 1024,
            day as f64 / (1 << 20) as f64
        );
        assert_eq!(minutes, SECONDS_KEPT / 60 - 1);
        // The bounds ARCHITECTURE.md states.
        assert!(hour < 192 << 20, "an hour takes {hour} bytes");
        assert!(day < 128 << 20, "a day takes {day} bytes");
    }
}
