//! Questions asked of the history: heat maps (time x latency bucket
//! counts), statistics with breakdowns (the drill-down), rates per second,
//! and the offset heat map of a volume. What the REST API returns.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::hist::{lower_ns, upper_ns, Sparse, BUCKETS};
use super::record::{Frame, History, Series, OFFSET_BUCKETS, SECONDS_KEPT};

/// A breakdown dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Volume,
    Protocol,
    Op,
    Client,
}

impl Dim {
    pub fn parse(name: &str) -> Result<Dim, String> {
        match name {
            "volume" => Ok(Dim::Volume),
            "protocol" => Ok(Dim::Protocol),
            "op" => Ok(Dim::Op),
            "client" => Ok(Dim::Client),
            other => Err(format!(
                "cannot break down by '{other}' (volume, protocol, op or client)"
            )),
        }
    }

    fn of(self, s: &Series) -> &str {
        match self {
            Dim::Volume => &s.volume,
            Dim::Protocol => s.protocol.as_str(),
            Dim::Op => s.op.as_str(),
            Dim::Client => &s.client,
        }
    }
}

/// Query parameters shared by the analytics endpoints.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct Params {
    /// First second (Unix time; zero or negative: relative to the newest
    /// second, `-59` = the last minute). Default: the last minute.
    pub from: Option<i64>,
    /// Last second, inclusive (same forms). Default: the newest second.
    pub to: Option<i64>,
    /// Period per row: 1 or 60 seconds. Default: 1 when the range lies in
    /// the last hour, else 60.
    pub step: Option<u64>,
    pub volume: Option<String>,
    pub protocol: Option<String>,
    pub op: Option<String>,
    pub client: Option<String>,
    /// Break down by these dimensions (comma-separated: volume, protocol,
    /// op, client).
    pub by: Option<String>,
    /// Count only latencies in `[min_ns, max_ns]` (a band of the heat map).
    pub min_ns: Option<u64>,
    pub max_ns: Option<u64>,
    /// At most this many breakdown entries (the rest are summed as `other`). Default 10.
    pub top: Option<usize>,
    /// Which time: `total` (arrival to reply, the default), `queued`
    /// (before the request ran) or `commit` (waiting for intent-log
    /// commits). With a part, only the requests that spent time in it
    /// count.
    pub phase: Option<String>,
}

/// Which part of the requests' latency a query looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Total,
    Queued,
    Commit,
}

/// A resolved query: the frames it covers and what it keeps of them.
struct Plan<'a> {
    phase: Phase,
    frames: Vec<&'a Frame>,
    step: u64,
    from: u64,
    to: u64,
    by: Vec<Dim>,
    params: &'a Params,
}

fn plan<'a>(history: &'a History, params: &'a Params) -> Result<Plan<'a>, String> {
    let by = match &params.by {
        Some(by) if !by.is_empty() => by.split(',').map(Dim::parse).collect::<Result<Vec<_>, _>>()?,
        _ => Vec::new(),
    };
    if let Some(protocol) = &params.protocol {
        if !["nbd", "iscsi"].contains(&protocol.as_str()) {
            return Err(format!("unknown protocol '{protocol}' (nbd or iscsi)"));
        }
    }
    let phase = match params.phase.as_deref() {
        None | Some("total") => Phase::Total,
        Some("queued") => Phase::Queued,
        Some("commit") => Phase::Commit,
        Some(other) => return Err(format!("unknown phase '{other}' (total, queued or commit)")),
    };
    if let Some(op) = &params.op {
        if !crate::block::OPS.iter().any(|o| o.as_str() == op) {
            return Err(format!("unknown operation '{op}'"));
        }
    }
    let Some(latest) = history.latest() else {
        return Ok(Plan {
            phase,
            frames: Vec::new(),
            step: 1,
            from: 0,
            to: 0,
            by,
            params,
        });
    };
    let resolve = |value: Option<i64>, default: i64| -> u64 {
        let value = value.unwrap_or(default);
        if value <= 0 {
            latest.saturating_sub(value.unsigned_abs())
        } else {
            value as u64
        }
    };
    let to = resolve(params.to, 0);
    let mut from = resolve(params.from, -59);
    if from > to {
        return Err(format!("from ({from}) is after to ({to})"));
    }
    let oldest_second = history.seconds.front().map_or(latest, |f| f.unix);
    let step = match params.step {
        Some(1) => 1,
        Some(60) => 60,
        Some(other) => return Err(format!("step is 1 or 60 seconds, not {other}")),
        None if latest - from.min(latest) < SECONDS_KEPT as u64 => 1,
        None => 60,
    };
    // Nothing is kept before the oldest frame: the range starts there.
    let oldest = if step == 1 {
        oldest_second
    } else {
        history
            .minutes
            .front()
            .or(history.current_minute())
            .map_or(latest, |f| f.unix)
    };
    from = from.max(oldest).min(to);
    if step == 1 && to - from > 3600 {
        return Err("at most 3601 seconds at a one-second step".into());
    }
    let frames: Vec<&Frame> = if step == 1 {
        history
            .seconds
            .iter()
            .filter(|f| (from..=to).contains(&f.unix))
            .collect()
    } else {
        history
            .minutes
            .iter()
            .chain(history.current_minute())
            .filter(|f| f.unix + 59 >= from && f.unix <= to)
            .collect()
    };
    Ok(Plan {
        phase,
        frames,
        step,
        from,
        to,
        by,
        params,
    })
}

impl Plan<'_> {
    fn keeps(&self, s: &Series) -> bool {
        let p = self.params;
        p.volume.as_deref().is_none_or(|v| v == &*s.volume)
            && p.protocol.as_deref().is_none_or(|v| v == s.protocol.as_str())
            && p.op.as_deref().is_none_or(|v| v == s.op.as_str())
            && p.client.as_deref().is_none_or(|v| v == &*s.client)
    }

    /// Whether only some of a series' requests count (those in a latency
    /// band, or those that spent time in a part of the latency).
    fn banded(&self) -> bool {
        self.params.min_ns.is_some() || self.params.max_ns.is_some() || self.phase != Phase::Total
    }

    /// The series' latencies (or the part asked for), within the band if
    /// one was asked for.
    fn latency(&self, s: &Series) -> Sparse {
        let times = match self.phase {
            Phase::Total => s.latency(),
            Phase::Queued => s.queued(),
            Phase::Commit => s.commit(),
        };
        if self.params.min_ns.is_some() || self.params.max_ns.is_some() {
            times.band(self.params.min_ns.unwrap_or(0), self.params.max_ns.unwrap_or(u64::MAX))
        } else {
            times
        }
    }

    fn key(&self, s: &Series) -> String {
        self.by.iter().map(|d| d.of(s)).collect::<Vec<_>>().join(" ")
    }

    /// The kept series of each frame, in time order.
    fn each(&self) -> impl Iterator<Item = (&Frame, impl Iterator<Item = &Series>)> {
        self.frames
            .iter()
            .map(move |f| (*f, f.series.iter().filter(move |s| self.keeps(s))))
    }

    fn top(&self) -> usize {
        self.params.top.unwrap_or(10).max(1)
    }
}

/// Totals over a range (or one breakdown entry of it).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Totals {
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Per second over the range.
    pub ops_per_sec: f64,
    pub bytes_per_sec: f64,
    /// Latency percentiles (ns; bucket midpoints); absent with no requests.
    pub p50_ns: Option<u64>,
    pub p90_ns: Option<u64>,
    pub p99_ns: Option<u64>,
    pub p999_ns: Option<u64>,
    /// Upper end of the slowest bucket that counted a request.
    pub max_ns: Option<u64>,
}

impl Totals {
    fn from_parts(ops: u64, bytes: u64, errors: u64, latency: &Sparse, seconds: u64) -> Totals {
        let seconds = seconds.max(1) as f64;
        Totals {
            ops,
            bytes,
            errors,
            ops_per_sec: ops as f64 / seconds,
            bytes_per_sec: bytes as f64 / seconds,
            p50_ns: latency.quantile(0.5),
            p90_ns: latency.quantile(0.9),
            p99_ns: latency.quantile(0.99),
            p999_ns: latency.quantile(0.999),
            max_ns: latency.0.last().map(|(i, _)| upper_ns(*i as usize)),
        }
    }
}

#[derive(Default)]
struct Sum {
    ops: u64,
    bytes: u64,
    errors: u64,
    latency: Sparse,
}

impl Sum {
    fn add(&mut self, s: &Series, latency: &Sparse, banded: bool) {
        // In a band, a request counts if its latency is in it.
        let ops = if banded { latency.total() } else { s.ops };
        if banded && s.ops > 0 {
            self.bytes += s.bytes * ops / s.ops;
            self.errors += s.errors * ops / s.ops;
        } else {
            self.bytes += s.bytes;
            self.errors += s.errors;
        }
        self.ops += ops;
        self.latency.merge(latency);
    }
}

/// A breakdown entry: the dimension values (joined by spaces in `name`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Entry {
    pub name: String,
    pub key: BTreeMap<String, String>,
    #[serde(flatten)]
    pub totals: Totals,
}

/// `GET /v1/analytics/stats`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Stats {
    pub from: u64,
    pub to: u64,
    pub seconds: u64,
    #[serde(flatten)]
    pub totals: Totals,
    /// By the `by` dimensions, busiest first (empty without `by`).
    pub breakdown: Vec<Entry>,
}

fn key_map(dims: &[Dim], s: &Series) -> BTreeMap<String, String> {
    dims.iter()
        .map(|d| {
            let name = match d {
                Dim::Volume => "volume",
                Dim::Protocol => "protocol",
                Dim::Op => "op",
                Dim::Client => "client",
            };
            (name.to_string(), d.of(s).to_string())
        })
        .collect()
}

pub fn stats(history: &History, params: &Params) -> Result<Stats, String> {
    let plan = plan(history, params)?;
    let seconds = if plan.frames.is_empty() {
        0
    } else {
        plan.to - plan.from + 1
    };
    let mut total = Sum::default();
    let mut parts: BTreeMap<String, (BTreeMap<String, String>, Sum)> = BTreeMap::new();
    let banded = plan.banded();
    for (_, series) in plan.each() {
        for s in series {
            let latency = plan.latency(s);
            total.add(s, &latency, banded);
            if !plan.by.is_empty() {
                parts
                    .entry(plan.key(s))
                    .or_insert_with(|| (key_map(&plan.by, s), Sum::default()))
                    .1
                    .add(s, &latency, banded);
            }
        }
    }
    let mut breakdown: Vec<Entry> = parts
        .into_iter()
        .filter(|(_, (_, sum))| sum.ops > 0)
        .map(|(name, (key, sum))| Entry {
            name,
            key,
            totals: Totals::from_parts(sum.ops, sum.bytes, sum.errors, &sum.latency, seconds),
        })
        .collect();
    breakdown.sort_by(|a, b| b.totals.ops.cmp(&a.totals.ops).then_with(|| a.name.cmp(&b.name)));
    breakdown.truncate(plan.top());
    Ok(Stats {
        from: plan.from,
        to: plan.to,
        seconds,
        totals: Totals::from_parts(total.ops, total.bytes, total.errors, &total.latency, seconds),
        breakdown,
    })
}

/// `GET /v1/analytics/heatmap`: counts per (row of time, latency bucket).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct HeatMap {
    pub step: u64,
    /// Start of each row (Unix seconds); rows with no frame are absent.
    pub times: Vec<u64>,
    /// The latency buckets of the columns, `[from_ns, to_ns)`: every
    /// bucket from the fastest to the slowest that counted a request.
    pub buckets: Vec<[u64; 2]>,
    /// `counts[row][column]`.
    pub counts: Vec<Vec<u64>>,
    /// The same per breakdown entry (the `top` busiest; the rest summed
    /// as `other`), when `by` was given.
    pub series: Vec<HeatSeries>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct HeatSeries {
    pub name: String,
    pub ops: u64,
    pub counts: Vec<Vec<u64>>,
}

pub fn heatmap(history: &History, params: &Params) -> Result<HeatMap, String> {
    let plan = plan(history, params)?;
    // Rows of sparse histograms, total and by key.
    let mut rows: Vec<(u64, Sparse, BTreeMap<String, Sparse>)> = Vec::new();
    for (frame, series) in plan.each() {
        let mut total = Sparse::default();
        let mut by_key: BTreeMap<String, Sparse> = BTreeMap::new();
        for s in series {
            let latency = plan.latency(s);
            total.merge(&latency);
            if !plan.by.is_empty() {
                by_key.entry(plan.key(s)).or_default().merge(&latency);
            }
        }
        rows.push((frame.unix, total, by_key));
    }
    let (low, high) = rows
        .iter()
        .flat_map(|(_, total, _)| total.0.iter().map(|(i, _)| *i as usize))
        .fold((BUCKETS, 0), |(lo, hi), i| (lo.min(i), hi.max(i)));
    let columns = if low > high { 0..0 } else { low..high + 1 };
    let dense = |sparse: &Sparse| -> Vec<u64> {
        let mut row = vec![0u64; columns.len()];
        for (i, c) in &sparse.0 {
            row[*i as usize - columns.start] += *c as u64;
        }
        row
    };
    // The busiest keys get their own series.
    let mut ops_by_key: BTreeMap<&str, u64> = BTreeMap::new();
    for (_, _, by_key) in &rows {
        for (key, sparse) in by_key {
            *ops_by_key.entry(key).or_default() += sparse.total();
        }
    }
    let mut ranked: Vec<(&str, u64)> = ops_by_key.into_iter().filter(|(_, ops)| *ops > 0).collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    let shown: Vec<(&str, u64)> = ranked.iter().take(plan.top()).copied().collect();
    let rest: u64 = ranked.iter().skip(plan.top()).map(|(_, ops)| ops).sum();
    let mut series: Vec<HeatSeries> = shown
        .iter()
        .map(|(name, ops)| HeatSeries {
            name: name.to_string(),
            ops: *ops,
            counts: rows
                .iter()
                .map(|(_, _, by_key)| by_key.get(*name).map(&dense).unwrap_or_else(|| vec![0; columns.len()]))
                .collect(),
        })
        .collect();
    if rest > 0 {
        series.push(HeatSeries {
            name: "other".into(),
            ops: rest,
            counts: rows
                .iter()
                .map(|(_, _, by_key)| {
                    let mut sum = Sparse::default();
                    for (key, sparse) in by_key {
                        if !shown.iter().any(|(name, _)| name == key) {
                            sum.merge(sparse);
                        }
                    }
                    dense(&sum)
                })
                .collect(),
        });
    }
    Ok(HeatMap {
        step: plan.step,
        times: rows.iter().map(|(t, _, _)| *t).collect(),
        buckets: columns.clone().map(|i| [lower_ns(i), upper_ns(i)]).collect(),
        counts: rows.iter().map(|(_, total, _)| dense(total)).collect(),
        series,
    })
}

/// `GET /v1/analytics/rates`: per row of time, totals of each breakdown
/// entry (or of everything kept, named `all`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Rates {
    pub step: u64,
    pub times: Vec<u64>,
    pub series: Vec<RateSeries>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct RateSeries {
    pub name: String,
    /// One per time row.
    pub points: Vec<Totals>,
}

pub fn rates(history: &History, params: &Params) -> Result<Rates, String> {
    let plan = plan(history, params)?;
    let banded = plan.banded();
    let mut rows: Vec<(u64, BTreeMap<String, Sum>)> = Vec::new();
    let mut ops_by_key: BTreeMap<String, u64> = BTreeMap::new();
    for (frame, series) in plan.each() {
        let mut sums: BTreeMap<String, Sum> = BTreeMap::new();
        for s in series {
            let key = if plan.by.is_empty() {
                "all".to_string()
            } else {
                plan.key(s)
            };
            let latency = plan.latency(s);
            let sum = sums.entry(key.clone()).or_default();
            sum.add(s, &latency, banded);
            *ops_by_key.entry(key).or_default() += s.ops;
        }
        rows.push((frame.unix, sums));
    }
    let mut ranked: Vec<(String, u64)> = ops_by_key.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    ranked.truncate(plan.top());
    let series = ranked
        .into_iter()
        .map(|(name, _)| RateSeries {
            points: rows
                .iter()
                .map(|(_, sums)| match sums.get(&name) {
                    Some(sum) => Totals::from_parts(sum.ops, sum.bytes, sum.errors, &sum.latency, plan.step),
                    None => Totals::default(),
                })
                .collect(),
            name,
        })
        .collect();
    Ok(Rates {
        step: plan.step,
        times: rows.iter().map(|(t, _)| *t).collect(),
        series,
    })
}

/// `GET /v1/analytics/offsets`: requests per region of one volume.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct OffsetMap {
    pub volume: String,
    pub step: u64,
    /// The volume's size when last seen; region `i` is
    /// `[i * size / regions, (i + 1) * size / regions)`.
    pub size_bytes: u64,
    pub regions: usize,
    pub times: Vec<u64>,
    pub reads: Vec<Vec<u64>>,
    pub writes: Vec<Vec<u64>>,
}

pub fn offsets(history: &History, params: &Params) -> Result<OffsetMap, String> {
    let Some(volume) = params.volume.clone() else {
        return Err("name a volume (volume=POOL/VOL)".into());
    };
    let plan = plan(history, params)?;
    let dense = |sparse: &Sparse| {
        let mut row = vec![0u64; OFFSET_BUCKETS];
        for (i, c) in &sparse.0 {
            row[*i as usize] += *c as u64;
        }
        row
    };
    let mut map = OffsetMap {
        volume: volume.clone(),
        step: plan.step,
        size_bytes: 0,
        regions: OFFSET_BUCKETS,
        times: Vec::new(),
        reads: Vec::new(),
        writes: Vec::new(),
    };
    for frame in &plan.frames {
        let found = frame.offsets.iter().find(|o| *o.volume == *volume);
        map.times.push(frame.unix);
        match found {
            Some(o) => {
                map.size_bytes = o.size_bytes;
                map.reads.push(dense(&o.reads()));
                map.writes.push(dense(&o.writes()));
            }
            None => {
                map.reads.push(vec![0; OFFSET_BUCKETS]);
                map.writes.push(vec![0; OFFSET_BUCKETS]);
            }
        }
    }
    Ok(map)
}

/// `GET /v1/analytics`: what is kept and what it costs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Status {
    /// Whether connections record (`strata serve --no-analytics` turns it off).
    pub enabled: bool,
    /// Newest complete second (absent before the first).
    pub latest: Option<u64>,
    pub seconds_kept: usize,
    pub minutes_kept: usize,
    pub recorders: usize,
    /// Bytes held by the kept history.
    pub history_bytes: usize,
    /// The latency buckets, `[from_ns, to_ns)` each.
    pub buckets: Vec<[u64; 2]>,
}

pub fn status(history: &History, enabled: bool, recorders: usize) -> Status {
    Status {
        enabled,
        latest: history.latest(),
        seconds_kept: history.seconds.len(),
        minutes_kept: history.minutes.len(),
        recorders,
        history_bytes: history.heap_bytes(),
        buckets: (0..BUCKETS).map(|i| [lower_ns(i), upper_ns(i)]).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::record::Analytics;
    use super::*;
    use crate::block::{Op, Protocol};
    use std::time::Duration;

    fn sample() -> std::sync::Arc<Analytics> {
        let analytics = Analytics::new();
        let a = analytics.recorder(Protocol::Nbd, "10.0.0.1", "p/a", 1 << 30).unwrap();
        let b = analytics.recorder(Protocol::Iscsi, "iqn.b", "p/b", 1 << 30).unwrap();
        for second in 100..110 {
            for _ in 0..100 {
                a.record(Op::Read, 0, 4096, Duration::from_micros(40), true, Default::default());
            }
            for _ in 0..10 {
                b.record(
                    Op::Write,
                    1 << 29,
                    8192,
                    Duration::from_millis(3),
                    true,
                    Default::default(),
                );
            }
            analytics.collect(second);
        }
        analytics
    }

    #[test]
    fn stats_break_down_and_drill_into_a_band() {
        let analytics = sample();
        analytics.with_history(|h| {
            let all = stats(
                h,
                &Params {
                    by: Some("volume".into()),
                    ..Params::default()
                },
            )
            .unwrap();
            assert_eq!((all.from, all.to, all.seconds), (100, 109, 10));
            assert_eq!(all.totals.ops, 1100);
            assert_eq!(all.totals.bytes, 1000 * 4096 + 100 * 8192);
            assert_eq!(all.breakdown[0].name, "p/a");
            assert_eq!(all.breakdown[0].totals.ops_per_sec, 100.0);
            // The slow band came from volume b's iSCSI client only.
            let slow = stats(
                h,
                &Params {
                    by: Some("volume,client".into()),
                    min_ns: Some(1_000_000),
                    ..Params::default()
                },
            )
            .unwrap();
            assert_eq!(slow.totals.ops, 100);
            assert_eq!(slow.breakdown.len(), 1);
            assert_eq!(slow.breakdown[0].name, "p/b iqn.b");
            assert_eq!(slow.breakdown[0].key["client"], "iqn.b");
            // One second (a column of the heat map).
            let one = stats(
                h,
                &Params {
                    from: Some(105),
                    to: Some(105),
                    ..Params::default()
                },
            )
            .unwrap();
            assert_eq!(one.totals.ops, 110);
            let p99 = one.totals.p99_ns.unwrap();
            assert!((2_800_000..3_200_000).contains(&p99), "{p99}");
        });
    }

    #[test]
    fn heatmap_counts_every_request_once() {
        let analytics = sample();
        analytics.with_history(|h| {
            let map = heatmap(
                h,
                &Params {
                    by: Some("op".into()),
                    ..Params::default()
                },
            )
            .unwrap();
            assert_eq!(map.times, (100..110).collect::<Vec<_>>());
            let total: u64 = map.counts.iter().flatten().sum();
            assert_eq!(total, 1100);
            assert_eq!(map.series.len(), 2);
            assert_eq!(map.series[0].name, "read");
            let reads: u64 = map.series[0].counts.iter().flatten().sum();
            assert_eq!(reads, 1000);
            assert_eq!(map.buckets.len(), map.counts[0].len());
            assert!(map.buckets[0][0] <= 40_000 && map.buckets.last().unwrap()[1] > 3_000_000);
            let none = heatmap(
                h,
                &Params {
                    volume: Some("p/zzz".into()),
                    ..Params::default()
                },
            )
            .unwrap();
            assert!(none.buckets.is_empty() && none.counts.iter().all(|r| r.is_empty()));
        });
    }

    #[test]
    fn rates_and_offsets_per_second() {
        let analytics = sample();
        analytics.with_history(|h| {
            let r = rates(
                h,
                &Params {
                    by: Some("volume".into()),
                    from: Some(-4),
                    ..Params::default()
                },
            )
            .unwrap();
            assert_eq!(r.times, vec![105, 106, 107, 108, 109]);
            assert_eq!(r.series[0].name, "p/a");
            assert!(r.series[0]
                .points
                .iter()
                .all(|p| p.ops == 100 && p.bytes_per_sec == 409_600.0));
            let o = offsets(
                h,
                &Params {
                    volume: Some("p/b".into()),
                    ..Params::default()
                },
            )
            .unwrap();
            assert_eq!(o.writes[0][16], 10);
            assert_eq!(o.reads[0].iter().sum::<u64>(), 0);
            assert!(offsets(h, &Params::default()).is_err());
            assert!(stats(
                h,
                &Params {
                    by: Some("colour".into()),
                    ..Params::default()
                }
            )
            .is_err());
            assert!(stats(
                h,
                &Params {
                    from: Some(109),
                    to: Some(100),
                    ..Params::default()
                }
            )
            .is_err());
        });
    }
}
