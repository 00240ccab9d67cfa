//! `snapshot.schedule`: which automatic snapshots a volume gets and how many
//! of each the daemon keeps, e.g. `hourly:24,daily:7,weekly:4`.
//!
//! Pure: the property's grammar and canonical spelling, and each period's
//! boundaries in UTC. The daemon's scheduler (`control/retention.rs`) decides
//! from these what to take and what to prune.

use std::fmt;

use crate::utc::{civil_from_days, days_from_civil};

/// Most snapshots one period keeps, and most all periods of one schedule
/// keep together: a volume is designed for up to 1,000 snapshots.
pub const MAX_KEEP: u32 = 1000;
/// Longest `Ns` period, in seconds (a day: longer intervals have names).
pub const MAX_PERIOD_SECONDS: u32 = 86_400;

const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

/// How often a kind of automatic snapshot is due. Every period starts at a
/// boundary in UTC: a multiple of its length since the epoch for the fixed
/// ones, Monday 00:00 for `Weekly`, the first of the month 00:00 for
/// `Monthly`, 1 January 00:00 for `Yearly`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// `Ns`: every N seconds, aligned to multiples of N seconds since the
    /// epoch. Meant for tests and demonstrations, where an hour is long.
    Seconds(u32),
    /// Every 15 minutes (`:00`, `:15`, `:30`, `:45`).
    Frequently,
    Hourly,
    Daily,
    Weekly,
    Monthly,
    Yearly,
}

impl Period {
    /// The period's name as written in the property and in snapshot names.
    pub fn label(self) -> String {
        match self {
            Period::Seconds(seconds) => format!("{seconds}s"),
            Period::Frequently => "frequently".into(),
            Period::Hourly => "hourly".into(),
            Period::Daily => "daily".into(),
            Period::Weekly => "weekly".into(),
            Period::Monthly => "monthly".into(),
            Period::Yearly => "yearly".into(),
        }
    }

    /// Parses a label (`hourly`, `30s`, ...).
    pub fn from_label(text: &str) -> Option<Period> {
        Some(match text {
            "frequently" => Period::Frequently,
            "hourly" => Period::Hourly,
            "daily" => Period::Daily,
            "weekly" => Period::Weekly,
            "monthly" => Period::Monthly,
            "yearly" => Period::Yearly,
            _ => {
                let digits = text.strip_suffix('s')?;
                if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let seconds: u32 = digits.parse().ok()?;
                if seconds > MAX_PERIOD_SECONDS {
                    return None;
                }
                Period::Seconds(seconds)
            }
        })
    }

    /// The period's usual length in seconds, for ordering (a month counts 31
    /// days, a year 366).
    fn nominal_seconds(self) -> u64 {
        match self {
            Period::Seconds(seconds) => u64::from(seconds),
            Period::Frequently => 15 * MINUTE,
            Period::Hourly => HOUR,
            Period::Daily => DAY,
            Period::Weekly => 7 * DAY,
            Period::Monthly => 31 * DAY,
            Period::Yearly => 366 * DAY,
        }
    }

    /// The latest boundary at or before `now` (Unix seconds).
    pub fn latest_boundary(self, now: u64) -> u64 {
        let fixed = |length: u64| now - now % length;
        match self {
            Period::Seconds(seconds) => fixed(u64::from(seconds)),
            Period::Frequently | Period::Hourly | Period::Daily => fixed(self.nominal_seconds()),
            Period::Weekly => {
                // 1970-01-01 was a Thursday: day d is (d + 3) % 7 days after a Monday.
                // (Saturating: a clock at the epoch itself must not panic.)
                let days = now / DAY;
                days.saturating_sub((days + 3) % 7) * DAY
            }
            Period::Monthly => {
                let (year, month, _) = civil_from_days(now / DAY);
                days_from_civil(year, month, 1) * DAY
            }
            Period::Yearly => {
                let (year, _, _) = civil_from_days(now / DAY);
                days_from_civil(year, 1, 1) * DAY
            }
        }
    }

    /// The first boundary after `now`.
    pub fn next_boundary(self, now: u64) -> u64 {
        let latest = self.latest_boundary(now);
        match self {
            Period::Seconds(_) | Period::Frequently | Period::Hourly | Period::Daily => latest + self.nominal_seconds(),
            Period::Weekly => latest + 7 * DAY,
            Period::Monthly => {
                let (year, month, _) = civil_from_days(latest / DAY);
                let (year, month) = if month == 12 { (year + 1, 1) } else { (year, month + 1) };
                days_from_civil(year, month, 1) * DAY
            }
            Period::Yearly => {
                let (year, _, _) = civil_from_days(latest / DAY);
                days_from_civil(year + 1, 1, 1) * DAY
            }
        }
    }
}

/// One `PERIOD:KEEP` of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub period: Period,
    /// How many of this period's automatic snapshots are kept (1..=MAX_KEEP).
    pub keep: u32,
}

/// A parsed `snapshot.schedule`: its rules, shortest period first, each
/// period at most once. Empty means off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    pub rules: Vec<Rule>,
}

/// What a schedule may look like, for error messages.
const GRAMMAR: &str = "off, or PERIOD:KEEP,... with PERIOD one of frequently (every 15 minutes), hourly, daily, \
                       weekly, monthly, yearly or Ns (every N seconds, 1 to 86400), e.g. hourly:24,daily:7";

impl Schedule {
    /// Parses the property's value; the error says what is wrong in one line.
    pub fn parse(text: &str) -> Result<Schedule, String> {
        let text = text.trim();
        if text.is_empty() || text == "off" {
            return Ok(Schedule::default());
        }
        let mut rules: Vec<Rule> = Vec::new();
        for item in text.split(',') {
            let item = item.trim();
            let Some((label, keep)) = item.split_once(':') else {
                return Err(format!("'{item}' is not PERIOD:KEEP; expected {GRAMMAR}"));
            };
            let (label, keep) = (label.trim(), keep.trim());
            let period =
                Period::from_label(label).ok_or_else(|| format!("unknown period '{label}'; expected {GRAMMAR}"))?;
            let keep: u32 = match keep.parse() {
                Ok(keep) if (1..=MAX_KEEP).contains(&keep) => keep,
                _ => {
                    return Err(format!(
                        "'{label}' keeps '{keep}': the count of snapshots kept is 1 to {MAX_KEEP} \
                         (to stop taking them, leave the period out)"
                    ))
                }
            };
            if rules.iter().any(|r| r.period == period) {
                return Err(format!("period '{label}' is named twice"));
            }
            rules.push(Rule { period, keep });
        }
        let total: u32 = rules.iter().map(|r| r.keep).sum();
        if total > MAX_KEEP {
            return Err(format!(
                "the periods keep {total} snapshots together; at most {MAX_KEEP} per volume"
            ));
        }
        rules.sort_by_key(|r| r.period.nominal_seconds());
        Ok(Schedule { rules })
    }

    pub fn is_off(&self) -> bool {
        self.rules.is_empty()
    }
}

/// The canonical spelling: `off`, or the rules shortest period first.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_off() {
            return f.write_str("off");
        }
        let rules: Vec<String> = self
            .rules
            .iter()
            .map(|r| format!("{}:{}", r.period.label(), r.keep))
            .collect();
        f.write_str(&rules.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix seconds of a UTC time.
    fn utc(year: u64, month: u64, day: u64, hour: u64, minute: u64) -> u64 {
        crate::utc::UtcTime {
            year,
            month,
            day,
            hour,
            minute,
            second: 0,
        }
        .unix()
    }

    #[test]
    fn boundaries_are_aligned_in_utc() {
        // Wednesday 2026-11-25 09:37.
        let now = utc(2026, 11, 25, 9, 37) + 12;
        assert_eq!(Period::Seconds(10).latest_boundary(now), now - 2);
        assert_eq!(Period::Frequently.latest_boundary(now), utc(2026, 11, 25, 9, 30));
        assert_eq!(Period::Frequently.next_boundary(now), utc(2026, 11, 25, 9, 45));
        assert_eq!(Period::Hourly.latest_boundary(now), utc(2026, 11, 25, 9, 0));
        assert_eq!(Period::Daily.latest_boundary(now), utc(2026, 11, 25, 0, 0));
        assert_eq!(Period::Weekly.latest_boundary(now), utc(2026, 11, 23, 0, 0));
        assert_eq!(Period::Weekly.next_boundary(now), utc(2026, 11, 30, 0, 0));
        assert_eq!(Period::Monthly.latest_boundary(now), utc(2026, 11, 1, 0, 0));
        assert_eq!(Period::Monthly.next_boundary(now), utc(2026, 12, 1, 0, 0));
        assert_eq!(Period::Yearly.latest_boundary(now), utc(2026, 1, 1, 0, 0));
        assert_eq!(Period::Yearly.next_boundary(now), utc(2027, 1, 1, 0, 0));
        // December rolls into January.
        let december = utc(2026, 12, 31, 23, 59);
        assert_eq!(Period::Monthly.next_boundary(december), utc(2027, 1, 1, 0, 0));
        // A boundary is its own latest boundary; the next one is a period on.
        for period in [
            Period::Seconds(7),
            Period::Frequently,
            Period::Hourly,
            Period::Daily,
            Period::Weekly,
            Period::Monthly,
            Period::Yearly,
        ] {
            let boundary = period.latest_boundary(now);
            assert_eq!(period.latest_boundary(boundary), boundary, "{period:?}");
            assert_eq!(
                period.latest_boundary(boundary - 1),
                period.latest_boundary(boundary - 1)
            );
            assert!(period.latest_boundary(boundary - 1) < boundary, "{period:?}");
            let next = period.next_boundary(boundary);
            assert!(next > boundary && period.latest_boundary(next) == next, "{period:?}");
            assert_eq!(period.latest_boundary(next - 1), boundary, "{period:?}");
        }
        // Weekly boundaries are Mondays: 2026-11-23 was one.
        assert_eq!(
            Period::Weekly.latest_boundary(utc(2026, 11, 23, 0, 0)),
            utc(2026, 11, 23, 0, 0)
        );
        assert_eq!(
            Period::Weekly.latest_boundary(utc(2026, 11, 22, 23, 59)),
            utc(2026, 11, 16, 0, 0)
        );
    }

    #[test]
    fn schedules_parse_canonically_and_refuse_nonsense() {
        let canonical = |text: &str| Schedule::parse(text).map(|s| s.to_string());
        assert_eq!(canonical("").unwrap(), "off");
        assert_eq!(canonical(" off ").unwrap(), "off");
        assert_eq!(
            canonical("weekly:4, hourly:24,daily:7").unwrap(),
            "hourly:24,daily:7,weekly:4"
        );
        assert_eq!(
            canonical("yearly:1,monthly:12,frequently:4,2s:3").unwrap(),
            "2s:3,frequently:4,monthly:12,yearly:1"
        );
        assert_eq!(
            Schedule::parse("hourly:24").unwrap().rules,
            vec![Rule {
                period: Period::Hourly,
                keep: 24
            }]
        );
        for (text, why) in [
            ("fortnightly:2", "unknown period 'fortnightly'"),
            ("hourly", "is not PERIOD:KEEP"),
            ("hourly:0", "1 to 1000"),
            ("hourly:-1", "1 to 1000"),
            ("hourly:1001", "1 to 1000"),
            ("hourly:lots", "1 to 1000"),
            ("hourly:2,hourly:3", "named twice"),
            ("hourly:600,daily:600", "at most 1000 per volume"),
            ("0s:3", "unknown period '0s'"),
            ("05s:3", "unknown period '05s'"),
            ("86401s:3", "unknown period '86401s'"),
            ("hourly:2,,daily:2", "is not PERIOD:KEEP"),
        ] {
            let error = Schedule::parse(text).unwrap_err();
            assert!(error.contains(why), "{text}: {error}");
            assert!(!error.contains('\n'), "{error}");
        }
    }
}
