//! `strata iostat [-v] [POOL|POOL/VOLUME ...] [INTERVAL [COUNT]]`: per
//! volume operations, bandwidth and latency percentiles, one report per
//! interval, in the layout of `zpool iostat -l`. A client of
//! `GET /v1/analytics/stats`.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use super::cli::{table, Align, CliError, CliResult, Client, ClientOptions};
use crate::analytics::query::{Stats, Status};
use crate::control::manager::{split_volume_name, validate_component};

#[derive(Debug, clap::Args)]
pub struct IostatArgs {
    #[command(flatten)]
    pub client: ClientOptions,
    /// Also a line per client (and protocol) under each volume.
    #[arg(short = 'v')]
    pub verbose: bool,
    /// Volumes (POOL/VOLUME) or pools (POOL) to show (default: all with
    /// requests), then INTERVAL seconds between reports and COUNT reports
    /// (without INTERVAL: one report of the last minute).
    #[arg(value_name = "POOL[/VOLUME]... [INTERVAL [COUNT]]")]
    pub args: Vec<String>,
}

/// What the arguments ask for.
#[derive(Debug, PartialEq)]
struct Plan {
    names: Vec<String>,
    interval: Option<u64>,
    count: Option<u64>,
}

fn parse(args: &[String]) -> CliResult<Plan> {
    let mut numbers: Vec<u64> = Vec::new();
    let mut names: Vec<String> = args.to_vec();
    while numbers.len() < 2 {
        match names.last().map(|a| a.parse::<u64>()) {
            Some(Ok(n)) => {
                numbers.insert(0, n);
                names.pop();
            }
            _ => break,
        }
    }
    for name in &names {
        if name.contains('/') {
            split_volume_name(name)?;
        } else {
            validate_component("pool", name)?;
        }
    }
    if numbers.first() == Some(&0) {
        return Err(CliError::from("the interval is at least 1 second"));
    }
    if numbers.get(1) == Some(&0) {
        return Err(CliError::from("the count is at least 1"));
    }
    Ok(Plan {
        names,
        interval: numbers.first().copied(),
        count: numbers.get(1).copied(),
    })
}

pub(super) fn run(args: IostatArgs) -> CliResult<String> {
    let plan = parse(&args.args)?;
    let client = Client::new(&args.client)?;
    let get = |by: &str, from: u64, to: u64| -> CliResult<Stats> {
        client.get(&format!(
            "/v1/analytics/stats?by={by}&from={from}&to={to}&top=100000&step=1"
        ))
    };
    // The volumes' lines, and with -v the lines of their clients.
    let query = |from: u64, to: u64| -> CliResult<Vec<Stats>> {
        let mut answers = vec![get("volume,op", from, to)?];
        if args.verbose {
            answers.push(get("volume,protocol,client,op", from, to)?);
        }
        Ok(answers)
    };
    let latest = || -> CliResult<u64> {
        let status: Status = client.get("/v1/analytics")?;
        if !status.enabled {
            return Err(CliError::from(
                "the daemon records no analytics (it was started with --no-analytics)",
            ));
        }
        Ok(status.latest.unwrap_or(0))
    };
    let Some(interval) = plan.interval else {
        let to = latest()?;
        let stats = query(to.saturating_sub(59).max(1), to.max(1))?;
        return Ok(if args.client.json {
            super::cli::pretty(&stats)
        } else {
            report(&stats, &plan.names)
        });
    };
    let mut stdout = std::io::stdout().lock();
    let mut to = latest()?;
    let mut from = to.saturating_sub(interval - 1).max(1);
    let mut printed = 0;
    loop {
        let stats = query(from, to.max(from))?;
        let text = if args.client.json {
            super::cli::pretty(&stats)
        } else {
            report(&stats, &plan.names)
        };
        if stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()).is_err() {
            // A closed stdout (`| head`) ends the reports.
            return Ok(String::new());
        }
        printed += 1;
        if plan.count.is_some_and(|count| printed >= count) {
            return Ok(String::new());
        }
        // The next report covers the next INTERVAL seconds once the daemon
        // has collected them (each second is collected as it ends).
        std::thread::sleep(Duration::from_secs(interval));
        let target = to + interval;
        let mut newest = latest()?;
        for _ in 0..30 {
            if newest >= target {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
            newest = latest()?;
        }
        from = to + 1;
        to = newest.min(target).max(from);
    }
}

/// One volume's (or client's) line.
#[derive(Default)]
struct Line {
    read_ops: u64,
    write_ops: u64,
    read_bytes: u64,
    write_bytes: u64,
    read_p50: Option<u64>,
    read_p99: Option<u64>,
    write_p50: Option<u64>,
    write_p99: Option<u64>,
}

fn shown(volume: &str, names: &[String]) -> bool {
    names.is_empty()
        || names.iter().any(|n| {
            n == volume
                || volume
                    .strip_prefix(n.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        })
}

/// The report of one interval: a line per volume (and with `-v`, per
/// client under it), operations and bytes per second, latency p50/p99.
fn report(answers: &[Stats], names: &[String]) -> String {
    let seconds = answers.first().map_or(1, |s| s.seconds.max(1));
    let mut lines: BTreeMap<(String, String), Line> = BTreeMap::new();
    for entry in answers.iter().flat_map(|s| &s.breakdown) {
        let volume = entry.key.get("volume").cloned().unwrap_or_default();
        if !shown(&volume, names) {
            continue;
        }
        let client = match (entry.key.get("protocol"), entry.key.get("client")) {
            (Some(p), Some(c)) => format!("  {p} {c}"),
            _ => String::new(),
        };
        let line = lines.entry((volume, client)).or_default();
        let t = &entry.totals;
        match entry.key.get("op").map(String::as_str) {
            Some("read") => {
                line.read_ops += t.ops;
                line.read_bytes += t.bytes;
                line.read_p50 = t.p50_ns;
                line.read_p99 = t.p99_ns;
            }
            Some("write") => {
                line.write_ops += t.ops;
                line.write_bytes += t.bytes;
                line.write_p50 = t.p50_ns;
                line.write_p99 = t.p99_ns;
            }
            _ => {}
        }
    }
    let headers = [
        ("volume", Align::Left),
        ("read/s", Align::Right),
        ("write/s", Align::Right),
        ("rbytes/s", Align::Right),
        ("wbytes/s", Align::Right),
        ("read_p50", Align::Right),
        ("read_p99", Align::Right),
        ("write_p50", Align::Right),
        ("write_p99", Align::Right),
    ];
    let rows: Vec<Vec<String>> = lines
        .into_iter()
        .map(|((volume, client), l)| {
            vec![
                if client.is_empty() { volume } else { client },
                count(l.read_ops as f64 / seconds as f64),
                count(l.write_ops as f64 / seconds as f64),
                bytes(l.read_bytes as f64 / seconds as f64),
                bytes(l.write_bytes as f64 / seconds as f64),
                latency(l.read_p50),
                latency(l.read_p99),
                latency(l.write_p50),
                latency(l.write_p99),
            ]
        })
        .collect();
    let mut out = table(&headers, &rows);
    if rows.is_empty() {
        out.push_str(&format!("(no requests in these {seconds} s)\n"));
    }
    out.push('\n');
    out
}

/// 1234 -> "1.2K", as `zpool iostat` prints counts.
fn count(value: f64) -> String {
    scaled(value, 1000.0, &["", "K", "M", "G"])
}

fn bytes(value: f64) -> String {
    scaled(value, 1024.0, &["", "K", "M", "G", "T"])
}

fn scaled(mut value: f64, unit: f64, suffixes: &[&str]) -> String {
    let mut index = 0;
    while value >= unit && index + 1 < suffixes.len() {
        value /= unit;
        index += 1;
    }
    if index == 0 {
        format!("{}", value.round() as u64)
    } else if value < 10.0 {
        format!("{value:.1}{}", suffixes[index])
    } else {
        format!("{}{}", value.round() as u64, suffixes[index])
    }
}

fn latency(ns: Option<u64>) -> String {
    let Some(ns) = ns else {
        return "-".into();
    };
    let (value, unit) = match ns {
        0..=999 => return format!("{ns}ns"),
        1_000..=999_999 => (ns as f64 / 1e3, "us"),
        1_000_000..=999_999_999 => (ns as f64 / 1e6, "ms"),
        _ => (ns as f64 / 1e9, "s"),
    };
    if value < 10.0 {
        format!("{value:.1}{unit}")
    } else {
        format!("{}{unit}", value.round() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn names_then_interval_and_count() {
        assert_eq!(
            parse(&strings(&["default/vol0", "1", "3"])).unwrap(),
            Plan {
                names: strings(&["default/vol0"]),
                interval: Some(1),
                count: Some(3)
            }
        );
        assert_eq!(
            parse(&strings(&["5"])).unwrap(),
            Plan {
                names: Vec::new(),
                interval: Some(5),
                count: None
            }
        );
        assert_eq!(parse(&[]).unwrap().interval, None);
        assert!(parse(&strings(&["0"])).is_err());
        assert!(parse(&strings(&["bad name!", "1"])).is_err());
    }

    #[test]
    fn a_quiet_interval_says_so_under_the_header() {
        let quiet = Stats {
            from: 10,
            to: 14,
            seconds: 5,
            totals: Default::default(),
            breakdown: Vec::new(),
        };
        let text = report(&[quiet], &[]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("volume"), "{text}");
        assert_eq!(lines[1], "(no requests in these 5 s)");
    }

    #[test]
    fn units_as_zpool_prints_them() {
        assert_eq!(count(13_064.0), "13K");
        assert_eq!(count(1_234.0), "1.2K");
        assert_eq!(count(7.0), "7");
        assert_eq!(bytes(53_511_168.0), "51M");
        assert_eq!(latency(Some(2_432)), "2.4us");
        assert_eq!(latency(Some(2_752_512)), "2.8ms");
        assert_eq!(latency(Some(512)), "512ns");
        assert_eq!(latency(None), "-");
    }
}
