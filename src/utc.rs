//! UTC dates of Unix times and back: the crate's one calendar computation,
//! shared by snapshot schedules (period boundaries), the names of
//! automatic snapshots and the CLI's tables. Proleptic Gregorian from
//! 1970-01-01; no time zones and no leap seconds (Unix time has none).

/// Seconds in a day of Unix time.
pub const DAY_SECONDS: u64 = 86_400;

/// A Unix time as a UTC calendar date and time of day.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct UtcTime {
    pub year: u64,
    /// 1 to 12.
    pub month: u64,
    /// 1 to 31.
    pub day: u64,
    pub hour: u64,
    pub minute: u64,
    pub second: u64,
}

impl UtcTime {
    pub fn of_unix(unix: u64) -> UtcTime {
        let (year, month, day) = civil_from_days(unix / DAY_SECONDS);
        let seconds = unix % DAY_SECONDS;
        UtcTime {
            year,
            month,
            day,
            hour: seconds / 3600,
            minute: seconds % 3600 / 60,
            second: seconds % 60,
        }
    }

    /// The Unix time of this date and time (from 1970-01-01; a day past
    /// the end of its month counts on into the next month, so a caller
    /// that must refuse such dates compares `of_unix(t.unix())` with `t`).
    pub fn unix(&self) -> u64 {
        days_from_civil(self.year, self.month, self.day) * DAY_SECONDS
            + self.hour * 3600
            + self.minute * 60
            + self.second
    }

    /// `2026-11-25T064012Z`: sortable as text, and valid in a snapshot name.
    pub fn compact(&self) -> String {
        format!(
            "{:04}-{:02}-{:02}T{:02}{:02}{:02}Z",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

/// `2026-11-25 06:40:12`, as tables show a time.
impl std::fmt::Display for UtcTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

/// The civil date (year, month 1-12, day 1-31) of a day counted from
/// 1970-01-01. Dates are counted in 400-year eras of 146,097 days, each
/// year starting on 1 March so that the leap day ends it (Howard
/// Hinnant's algorithm).
pub fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Days since 0000-03-01.
    let shifted = days + 719_468;
    let era = shifted / 146_097;
    let day_of_era = shifted % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    // Months counted from March: 0 = March ... 11 = February.
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// The inverse of [`civil_from_days`], for dates from 1970-01-01.
pub fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year / 400;
    let year_of_era = year % 400;
    let month_from_march = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(year: u64, month: u64, day: u64, hour: u64, minute: u64, second: u64) -> UtcTime {
        UtcTime {
            year,
            month,
            day,
            hour,
            minute,
            second,
        }
    }

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        // 2000 was a leap year (divisible by 400), 2100 will not be.
        assert_eq!(civil_from_days(days_from_civil(2000, 2, 29) + 1), (2000, 3, 1));
        assert_eq!(civil_from_days(days_from_civil(2100, 2, 28) + 1), (2100, 3, 1));
        for days in (0..200_000).step_by(7) {
            let (year, month, day) = civil_from_days(days);
            assert_eq!(days_from_civil(year, month, day), days);
        }
    }

    #[test]
    fn unix_times_read_as_utc_dates_and_back() {
        for (unix, shown, compact) in [
            (0, "1970-01-01 00:00:00", "1970-01-01T000000Z"),
            (951_782_400, "2000-02-29 00:00:00", "2000-02-29T000000Z"),
            (1_795_593_599, "2026-11-25 07:59:59", "2026-11-25T075959Z"),
            (1_795_597_200, "2026-11-25 09:00:00", "2026-11-25T090000Z"),
            (4_107_542_400, "2100-03-01 00:00:00", "2100-03-01T000000Z"),
        ] {
            let time = UtcTime::of_unix(unix);
            assert_eq!(time.to_string(), shown);
            assert_eq!(time.compact(), compact);
            assert_eq!(time.unix(), unix);
        }
        assert_eq!(at(2026, 11, 25, 9, 0, 0).unix(), 1_795_597_200);
        // 31 February is not a date: it reads back as 3 March.
        let feb31 = at(2026, 2, 31, 0, 0, 0);
        assert_eq!(UtcTime::of_unix(feb31.unix()), at(2026, 3, 3, 0, 0, 0));
    }
}
