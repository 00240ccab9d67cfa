//! Automatic snapshots: the daemon takes and prunes snapshots of every
//! volume and file dataset whose `snapshot.schedule` is set
//! (`volume/schedule.rs`), like sanoid or zfs-auto-snapshot. Both kinds are
//! planned alike; only the manager's calls that take and delete differ.
//!
//! The decision is a pure function, [`plan`]: from the time, a schedule and
//! the object's snapshots it says which snapshots to take and which to
//! delete; it is tested with fixed times. [`run`] is the daemon's task around
//! it: a round at start (the catch-up after downtime), then one at each
//! period boundary, and one at once when a volume's or dataset's
//! properties change. A round runs on a blocking thread, because the
//! manager's calls do.
//!
//! Names: `auto-YYYY-MM-DDTHHMMSSZ-PERIOD`, e.g.
//! `auto-2026-11-25T090000Z-hourly`: the UTC time the round ran, so names
//! of one period sort by time. Only names of exactly that form are the
//! scheduler's; anything else is a snapshot taken by hand and never pruned.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::control::manager::{AdminError, ScheduledObject, VolumeManager};
use crate::utc::UtcTime;
use crate::volume::schedule::{Period, Rule, Schedule};

/// Prefix of every automatic snapshot's name.
pub const AUTO_PREFIX: &str = "auto-";
/// Longest wait between rounds, so a clock that jumps is noticed.
const IDLE_WAKE_SECONDS: u64 = 300;
/// Wait before trying again what a round had to skip (a busy export, a
/// failed snapshot).
const RETRY_SECONDS: u64 = 60;

/// The name of an automatic snapshot of `period` taken at `now`.
pub fn auto_name(period: Period, now: u64) -> String {
    format!("{AUTO_PREFIX}{}-{}", UtcTime::of_unix(now).compact(), period.label())
}

/// The time and period of an automatic snapshot's name; `None` for any
/// other name (a snapshot taken by hand).
pub fn parse_auto_name(name: &str) -> Option<(u64, Period)> {
    let rest = name.strip_prefix(AUTO_PREFIX)?;
    // `YYYY-MM-DDTHHMMSSZ` is 18 bytes, then `-PERIOD`.
    let stamp = rest.get(..18)?.as_bytes();
    let period = Period::from_label(rest.get(18..)?.strip_prefix('-')?)?;
    let shape_ok = stamp.iter().enumerate().all(|(i, b)| match i {
        4 | 7 => *b == b'-',
        10 => *b == b'T',
        17 => *b == b'Z',
        _ => b.is_ascii_digit(),
    });
    if !shape_ok {
        return None;
    }
    let number = |range: std::ops::Range<usize>| {
        stamp[range]
            .iter()
            .fold(0u64, |value, digit| value * 10 + u64::from(digit - b'0'))
    };
    let time = UtcTime {
        year: number(0..4),
        month: number(5..7),
        day: number(8..10),
        hour: number(11..13),
        minute: number(13..15),
        second: number(15..17),
    };
    if time.year < 1970
        || !(1..=12).contains(&time.month)
        || time.day == 0
        || time.hour > 23
        || time.minute > 59
        || time.second > 59
    {
        return None;
    }
    // Refuses 31 February and the like: the day must exist in that month.
    let unix = time.unix();
    if UtcTime::of_unix(unix) != time {
        return None;
    }
    Some((unix, period))
}

/// Why a snapshot past its period's keep count is not deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Clones depend on it (the engine refuses to delete it).
    Clones,
    /// Its read-only export has clients (volumes only: a dataset's
    /// snapshot may go while NFS clients read it).
    Clients(usize),
}

impl fmt::Display for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hold::Clones => f.write_str("clones depend on it"),
            Hold::Clients(count) => write!(f, "its export has {count} client(s)"),
        }
    }
}

/// A snapshot of the volume or dataset as [`plan`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Existing {
    pub name: String,
    pub hold: Option<Hold>,
}

/// What one round does to one volume or dataset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Snapshots to take (names), with the rule each is for.
    pub take: Vec<(String, Rule)>,
    /// Automatic snapshots to delete, with the rule that lets them go.
    /// Counted as if every snapshot of `take` was taken: prune only after
    /// they were.
    pub prune: Vec<(String, Rule)>,
    /// Automatic snapshots past their keep count that must stay for now.
    pub held: Vec<(String, Hold)>,
}

/// Decides, at `now` (Unix seconds), what `schedule` asks of a volume or dataset whose
/// snapshots are `existing`.
///
/// For each period of the schedule: a snapshot is due when none of that
/// period's automatic snapshots is as new as the period's latest boundary
/// (so after downtime exactly one is taken, not one per missed period). Of
/// the period's automatic snapshots, the newest `keep` (the one about to be
/// taken included) stay; older ones are pruned unless held, and held ones do
/// not count towards `keep`. Snapshots taken by hand and automatic ones of
/// periods the schedule does not name are left alone.
pub fn plan(now: u64, schedule: &Schedule, existing: &[Existing]) -> Plan {
    let mut result = Plan::default();
    for rule in &schedule.rules {
        // This period's automatic snapshots, newest first.
        let mut mine: Vec<(u64, &Existing)> = existing
            .iter()
            .filter_map(|snapshot| match parse_auto_name(&snapshot.name) {
                Some((time, period)) if period == rule.period => Some((time, snapshot)),
                _ => None,
            })
            .collect();
        mine.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.name.cmp(&a.1.name)));
        let boundary = rule.period.latest_boundary(now);
        let due = mine.first().is_none_or(|(time, _)| *time < boundary);
        let mut kept = 0;
        if due {
            result.take.push((auto_name(rule.period, now), *rule));
            kept += 1;
        }
        for (_, snapshot) in mine {
            if kept < rule.keep {
                kept += 1;
            } else if let Some(hold) = snapshot.hold {
                result.held.push((snapshot.name.clone(), hold));
            } else {
                result.prune.push((snapshot.name.clone(), *rule));
            }
        }
    }
    result
}

/// The first period boundary of `schedule` after `now`.
pub fn next_boundary(now: u64, schedule: &Schedule) -> Option<u64> {
    schedule.rules.iter().map(|r| r.period.next_boundary(now)).min()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The scheduler's state between rounds: which problems it has already
/// logged, so each is said once while it lasts (and again if it comes back
/// after going away).
pub struct Scheduler {
    manager: Arc<VolumeManager>,
    logged: HashSet<String>,
}

/// Problems met in one round, by key.
type Seen = HashSet<String>;

impl Scheduler {
    pub fn new(manager: Arc<VolumeManager>) -> Scheduler {
        Scheduler {
            manager,
            logged: HashSet::new(),
        }
    }

    /// One round at `now`: takes and prunes what every scheduled object
    /// needs. Blocks (the manager's calls do). Returns when the next round
    /// is due (Unix seconds).
    pub fn round(&mut self, now: u64) -> u64 {
        let mut seen = Seen::new();
        let mut next = now + IDLE_WAKE_SECONDS;
        let mut retry = false;
        for object in self.manager.scheduled_objects() {
            let schedule = match Schedule::parse(&object.schedule) {
                Ok(schedule) => schedule,
                Err(why) => {
                    let key = format!("schedule {}", object.name);
                    self.once(&mut seen, key, || {
                        format!(
                            "{}: snapshot.schedule '{}' is not valid, ignored: {why}",
                            object.name, object.schedule
                        )
                    });
                    continue;
                }
            };
            if let Some(boundary) = next_boundary(now, &schedule) {
                next = next.min(boundary);
            }
            retry |= self.apply(now, &schedule, &object, &mut seen);
        }
        // Problems that went away may be logged again if they come back.
        self.logged.retain(|key| seen.contains(key));
        if retry {
            next = next.min(now + RETRY_SECONDS);
        }
        next
    }

    /// Carries out the plan for one volume or dataset; whether something
    /// must be tried again soon.
    fn apply(&mut self, now: u64, schedule: &Schedule, object: &ScheduledObject, seen: &mut Seen) -> bool {
        let existing: Vec<Existing> = object
            .snapshots
            .iter()
            .map(|s| Existing {
                name: s.name.clone(),
                hold: if s.has_clones {
                    Some(Hold::Clones)
                } else if s.connections > 0 {
                    Some(Hold::Clients(s.connections))
                } else {
                    None
                },
            })
            .collect();
        let plan = plan(now, schedule, &existing);
        let mut retry = false;
        for (name, rule) in &plan.take {
            let full = format!("{}@{name}", object.name);
            // The manager logs the snapshot taken, inside this span.
            let span = tracing::info_span!("retention", rule = %rule_text(rule));
            let _entered = span.enter();
            if let Err(e) = self.manager.take_scheduled_snapshot(object.kind, &full) {
                retry = true;
                self.once(seen, format!("take {} {}", object.name, rule.period.label()), || {
                    format!("cannot take snapshot {full}: {e}")
                });
            }
        }
        if retry {
            // Pruning counted on the new snapshots: none goes before they exist.
            return true;
        }
        for (name, hold) in &plan.held {
            retry |= matches!(hold, Hold::Clients(_));
            let full = format!("{}@{name}", object.name);
            let kind = match hold {
                Hold::Clones => "clones",
                Hold::Clients(_) => "clients",
            };
            self.once(seen, format!("hold {full} {kind}"), || {
                format!("{full} is past its keep count but stays: {hold}")
            });
        }
        for (name, rule) in &plan.prune {
            let full = format!("{}@{name}", object.name);
            // The manager logs the snapshot deleted, inside this span.
            let span = tracing::info_span!("retention", prune = %rule_text(rule));
            let _entered = span.enter();
            match self.manager.delete_scheduled_snapshot(object.kind, &full) {
                Ok(()) => {}
                // Deleted by hand meanwhile: nothing left to do.
                Err(AdminError::NotFound(_)) => {}
                Err(e) => {
                    retry = true;
                    let kind = if matches!(e, AdminError::Busy(_)) {
                        "busy"
                    } else {
                        "failed"
                    };
                    self.once(seen, format!("prune {full} {kind}"), || {
                        format!("{full} not pruned, tried again later: {e}")
                    });
                }
            }
        }
        retry
    }

    /// Logs `message` the first time `key` is met (until a round without it).
    fn once(&mut self, seen: &mut Seen, key: String, message: impl FnOnce() -> String) {
        if self.logged.insert(key.clone()) {
            tracing::warn!("retention: {}", message());
        }
        seen.insert(key);
    }
}

fn rule_text(rule: &Rule) -> String {
    format!("{}:{}", rule.period.label(), rule.keep)
}

/// The daemon's retention task: a round now (catching up on what was missed
/// while the daemon was down), then at the next boundary of any schedule,
/// when a volume's or dataset's properties change, and at most
/// [`IDLE_WAKE_SECONDS`] apart. Returns when `stop` turns true, never in
/// the middle of a round.
pub async fn run(manager: Arc<VolumeManager>, mut stop: watch::Receiver<bool>) {
    let mut scheduler = Scheduler::new(manager.clone());
    loop {
        let now = unix_now();
        let round = tokio::task::spawn_blocking(move || {
            let next = scheduler.round(now);
            (scheduler, next)
        });
        let next = match round.await {
            Ok((back, next)) => {
                scheduler = back;
                next
            }
            Err(e) => {
                tracing::error!("retention: the scheduler stopped: {e}");
                return;
            }
        };
        // Sleep to the boundary itself, not to the whole second before it.
        let wait = (UNIX_EPOCH + Duration::from_secs(next))
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return;
                }
            }
            _ = manager.schedule_changed().notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
        if *stop.borrow() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix seconds of a UTC time.
    fn utc(year: u64, month: u64, day: u64, hour: u64, minute: u64, second: u64) -> u64 {
        UtcTime {
            year,
            month,
            day,
            hour,
            minute,
            second,
        }
        .unix()
    }

    fn schedule(text: &str) -> Schedule {
        Schedule::parse(text).unwrap()
    }

    fn free(name: &str) -> Existing {
        Existing {
            name: name.to_string(),
            hold: None,
        }
    }

    fn names(list: &[(String, Rule)]) -> Vec<&str> {
        list.iter().map(|(name, _)| name.as_str()).collect()
    }

    /// Hourly automatic snapshots of 2026-11-25 at `hours`.
    fn hourlies(hours: impl IntoIterator<Item = u64>) -> Vec<Existing> {
        hours
            .into_iter()
            .map(|hour| free(&auto_name(Period::Hourly, utc(2026, 11, 25, hour, 0, 0))))
            .collect()
    }

    #[test]
    fn names_are_sortable_valid_and_parse_back() {
        let now = utc(2026, 11, 25, 9, 0, 0);
        let name = auto_name(Period::Hourly, now);
        assert_eq!(name, "auto-2026-11-25T090000Z-hourly");
        assert_eq!(parse_auto_name(&name), Some((now, Period::Hourly)));
        assert_eq!(
            auto_name(Period::Seconds(30), utc(2027, 1, 2, 3, 4, 5)),
            "auto-2027-01-02T030405Z-30s"
        );
        // Valid snapshot names, within the length limit, for every period.
        for period in [
            Period::Seconds(86_400),
            Period::Frequently,
            Period::Hourly,
            Period::Daily,
            Period::Weekly,
            Period::Monthly,
            Period::Yearly,
        ] {
            let name = auto_name(period, utc(2099, 12, 31, 23, 59, 59));
            crate::control::manager::split_snapshot_name(&format!("p/v@{name}")).unwrap();
            assert_eq!(parse_auto_name(&name), Some((utc(2099, 12, 31, 23, 59, 59), period)));
        }
        // Later times sort later.
        let early = auto_name(Period::Daily, utc(2026, 9, 30, 0, 0, 0));
        let late = auto_name(Period::Daily, utc(2026, 10, 1, 0, 0, 0));
        assert!(early < late);
        for other in [
            "before-upgrade",
            "auto-",
            "auto-2026-11-25T090000Z",
            "auto-2026-11-25T090000Z-",
            "auto-2026-11-25T090000Z-fortnightly",
            "auto-2026-11-25T090000Z-hourly-copy",
            "auto-2026-11-25T090000-hourly",
            "auto-2026-11-25 090000Z-hourly",
            "auto-2026-13-25T090000Z-hourly",
            "auto-2026-02-30T090000Z-hourly",
            "auto-2026-11-25T240000Z-hourly",
            "auto-2026-11-25T096000Z-hourly",
            "auto-1969-12-31T000000Z-hourly",
            "Auto-2026-11-25T090000Z-hourly",
            "auto-2026-11-25T0900Z-hourly",
        ] {
            assert_eq!(parse_auto_name(other), None, "{other}");
        }
    }

    #[test]
    fn off_plans_nothing() {
        let existing = hourlies(0..10);
        assert_eq!(
            plan(utc(2026, 11, 25, 12, 0, 0), &schedule("off"), &existing),
            Plan::default()
        );
    }

    #[test]
    fn a_first_snapshot_is_taken_at_once_then_one_per_boundary() {
        let hourly = schedule("hourly:3");
        // Set at 09:20: the 09:00 period is not covered yet.
        let now = utc(2026, 11, 25, 9, 20, 7);
        let first = plan(now, &hourly, &[]);
        assert_eq!(names(&first.take), ["auto-2026-11-25T092007Z-hourly"]);
        assert_eq!(first.take[0].1.keep, 3);
        assert!(first.prune.is_empty() && first.held.is_empty());
        let existing = [free(&first.take[0].0)];
        // Covered until the next boundary, to the second.
        assert_eq!(plan(utc(2026, 11, 25, 9, 59, 59), &hourly, &existing), Plan::default());
        let at_ten = plan(utc(2026, 11, 25, 10, 0, 0), &hourly, &existing);
        assert_eq!(names(&at_ten.take), ["auto-2026-11-25T100000Z-hourly"]);
        // A snapshot taken exactly at the boundary covers it.
        let existing = hourlies([10]);
        assert!(plan(utc(2026, 11, 25, 10, 0, 0), &hourly, &existing).take.is_empty());
    }

    #[test]
    fn periods_due_together_each_get_a_snapshot_of_the_same_time() {
        let now = utc(2026, 11, 23, 0, 0, 0); // a Monday, midnight
        let before = utc(2026, 11, 22, 23, 45, 0);
        let mut existing: Vec<Existing> = [Period::Frequently, Period::Hourly, Period::Daily, Period::Weekly]
            .into_iter()
            .map(|period| free(&auto_name(period, before)))
            .collect();
        // The month's is covered since the 1st.
        existing.push(free(&auto_name(Period::Monthly, utc(2026, 11, 1, 0, 0, 0))));
        let all = schedule("frequently:4,hourly:24,daily:7,weekly:4,monthly:12");
        let result = plan(now, &all, &existing);
        assert_eq!(
            names(&result.take),
            [
                "auto-2026-11-23T000000Z-frequently",
                "auto-2026-11-23T000000Z-hourly",
                "auto-2026-11-23T000000Z-daily",
                "auto-2026-11-23T000000Z-weekly",
            ]
        );
        assert!(result.prune.is_empty());
    }

    #[test]
    fn the_newest_keep_stay_and_older_ones_are_pruned() {
        let hourly = schedule("hourly:3");
        // 06:00 to 10:00, at 10:30: nothing due, two too many.
        let existing = hourlies(6..=10);
        let result = plan(utc(2026, 11, 25, 10, 30, 0), &hourly, &existing);
        assert!(result.take.is_empty());
        assert_eq!(
            names(&result.prune),
            ["auto-2026-11-25T070000Z-hourly", "auto-2026-11-25T060000Z-hourly"]
        );
        // At 11:00 the new one counts: three go.
        let result = plan(utc(2026, 11, 25, 11, 0, 0), &hourly, &existing);
        assert_eq!(names(&result.take), ["auto-2026-11-25T110000Z-hourly"]);
        assert_eq!(result.prune.len(), 3);
        assert!(!names(&result.prune).contains(&"auto-2026-11-25T090000Z-hourly"));
        // Input order does not matter.
        let mut shuffled = existing.clone();
        shuffled.reverse();
        shuffled.swap(0, 3);
        assert_eq!(plan(utc(2026, 11, 25, 11, 0, 0), &hourly, &shuffled), result);
        // keep 1 at the boundary: everything older goes.
        let result = plan(utc(2026, 11, 25, 11, 0, 0), &schedule("hourly:1"), &existing);
        assert_eq!(result.prune.len(), 5);
    }

    #[test]
    fn snapshots_taken_by_hand_and_other_periods_are_never_pruned() {
        let mut existing = hourlies(0..10);
        let by_hand = [
            "before-upgrade",
            "auto-garbage",
            "auto-2026-11-25T010000Z-fortnightly",
            "auto-2026-11-25T010000Z-hourly.bak",
            "nightly-2026-11-25T010000Z-hourly",
        ];
        existing.extend(by_hand.iter().map(|name| free(name)));
        // A daily one: the schedule below does not name daily.
        let daily = auto_name(Period::Daily, utc(2026, 11, 20, 0, 0, 0));
        existing.push(free(&daily));
        let result = plan(utc(2026, 11, 25, 10, 0, 0), &schedule("hourly:2,2s:1"), &existing);
        let pruned = names(&result.prune);
        assert_eq!(pruned.len(), 9, "{pruned:?}");
        for name in by_hand.iter().chain([&daily.as_str()]) {
            assert!(!pruned.contains(name), "{name} pruned");
        }
        assert!(pruned.iter().all(|name| name.ends_with("-hourly")));
    }

    #[test]
    fn held_snapshots_stay_and_do_not_count_towards_keep() {
        let hourly = schedule("hourly:2");
        let mut existing = hourlies(5..=9);
        existing[0].hold = Some(Hold::Clones); // 05:00, the oldest
        existing[2].hold = Some(Hold::Clients(1)); // 07:00
        existing[4].hold = Some(Hold::Clones); // 09:00, the newest: kept anyway
        let result = plan(utc(2026, 11, 25, 9, 30, 0), &hourly, &existing);
        assert!(result.take.is_empty());
        assert_eq!(names(&result.prune), ["auto-2026-11-25T060000Z-hourly"]);
        assert_eq!(
            result.held,
            [
                ("auto-2026-11-25T070000Z-hourly".to_string(), Hold::Clients(1)),
                ("auto-2026-11-25T050000Z-hourly".to_string(), Hold::Clones),
            ]
        );
    }

    #[test]
    fn downtime_is_caught_up_with_one_snapshot_per_period() {
        let all = schedule("frequently:4,hourly:24,daily:7");
        // Down from 03:10 on the 23rd to 10:20 on the 25th.
        let last = utc(2026, 11, 23, 3, 0, 0);
        let existing: Vec<Existing> = [Period::Frequently, Period::Hourly, Period::Daily]
            .into_iter()
            .map(|period| free(&auto_name(period, last)))
            .collect();
        let now = utc(2026, 11, 25, 10, 20, 0);
        let result = plan(now, &all, &existing);
        assert_eq!(
            names(&result.take),
            [
                "auto-2026-11-25T102000Z-frequently",
                "auto-2026-11-25T102000Z-hourly",
                "auto-2026-11-25T102000Z-daily",
            ]
        );
        assert!(result.prune.is_empty());
        // After it, nothing more until the next boundary.
        let mut after = existing.clone();
        after.extend(result.take.iter().map(|(name, _)| free(name)));
        assert_eq!(plan(now + 60, &all, &after), Plan::default());
        assert_eq!(next_boundary(now, &all), Some(utc(2026, 11, 25, 10, 30, 0)));
    }

    #[test]
    fn a_clock_set_back_takes_nothing_until_it_passes_the_newest() {
        let hourly = schedule("hourly:3");
        let existing = hourlies([12]);
        assert_eq!(plan(utc(2026, 11, 25, 10, 5, 0), &hourly, &existing), Plan::default());
    }

    #[test]
    fn seconds_periods_align_to_multiples_of_their_length() {
        let every = schedule("2s:3");
        let result = plan(utc(2026, 11, 25, 9, 0, 5), &every, &[]);
        assert_eq!(names(&result.take), ["auto-2026-11-25T090005Z-2s"]);
        let existing = [free("auto-2026-11-25T090005Z-2s")];
        assert!(plan(utc(2026, 11, 25, 9, 0, 5), &every, &existing).take.is_empty());
        assert_eq!(plan(utc(2026, 11, 25, 9, 0, 6), &every, &existing).take.len(), 1);
        assert_eq!(
            next_boundary(utc(2026, 11, 25, 9, 0, 5), &every),
            Some(utc(2026, 11, 25, 9, 0, 6))
        );
    }
}
