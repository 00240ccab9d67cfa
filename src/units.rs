//! Human sizes: parsing `10G`-style arguments and printing byte counts;
//! and spans of time: `30d`-style arguments.
//!
//! Size suffixes are binary (K = 1024), as in ZFS and qemu-img: `10G` is
//! 10 GiB.

/// Parses a size such as `4096`, `512K`, `10G`, `1.5T`, `64MiB`.
///
/// Returns a one-line message naming the bad input on failure.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let err = || format!("invalid size '{text}': expected a number with an optional K, M, G, T or P suffix (e.g. 10G)");
    if trimmed.is_empty() {
        return Err(err());
    }
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(split);
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        "P" | "PB" | "PIB" => 50,
        _ => return Err(err()),
    };
    if number.is_empty() || number.matches('.').count() > 1 {
        return Err(err());
    }
    let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| err())?
    };
    let unit = 1u64 << shift;
    let mut bytes = whole
        .checked_mul(unit)
        .ok_or_else(|| format!("invalid size '{text}': too large"))?;
    if !frac.is_empty() {
        // Exact decimal fraction of the unit; a fraction that does not come out
        // to whole bytes is refused rather than silently rounded.
        let digits = frac.len() as u32;
        if digits > 18 {
            return Err(err());
        }
        let numerator: u128 = frac.parse().map_err(|_| err())?;
        let denominator = 10u128.pow(digits);
        let scaled = numerator * unit as u128;
        if !scaled.is_multiple_of(denominator) {
            return Err(format!("invalid size '{text}': not a whole number of bytes"));
        }
        bytes = bytes
            .checked_add((scaled / denominator) as u64)
            .ok_or_else(|| format!("invalid size '{text}': too large"))?;
    }
    Ok(bytes)
}

/// Formats a byte count the way `zfs list` does: `10G`, `1.50G`, `512K`, `0B`.
pub fn format_size(bytes: u64) -> String {
    const SUFFIXES: [&str; 6] = ["B", "K", "M", "G", "T", "P"];
    let mut index = 0;
    let mut value = bytes as f64;
    while value >= 1024.0 && index + 1 < SUFFIXES.len() {
        value /= 1024.0;
        index += 1;
    }
    if index == 0 {
        format!("{bytes}B")
    } else if value.fract() == 0.0 {
        format!("{}{}", value as u64, SUFFIXES[index])
    } else if value < 10.0 {
        format!("{value:.2}{}", SUFFIXES[index])
    } else if value < 100.0 {
        format!("{value:.1}{}", SUFFIXES[index])
    } else {
        format!("{value:.0}{}", SUFFIXES[index])
    }
}

/// Seconds in each span suffix, largest first (how [`format_span`] picks).
const SPAN_UNITS: [(&str, u64); 5] = [("w", 7 * 86_400), ("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];

/// Parses a span of time such as `30d`, `2w`, `12h`, `90m` or `45s` (a
/// whole number and one suffix) into seconds; zero is refused.
pub fn parse_span(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let err = || format!("invalid span '{text}': expected a whole number and s, m, h, d or w (e.g. 30d)");
    let split = trimmed.find(|c: char| !c.is_ascii_digit()).ok_or_else(err)?;
    let (number, suffix) = trimmed.split_at(split);
    let unit = SPAN_UNITS
        .iter()
        .find(|(name, _)| *name == suffix)
        .map(|(_, seconds)| *seconds)
        .ok_or_else(err)?;
    let count: u64 = number.parse().map_err(|_| err())?;
    match count.checked_mul(unit) {
        Some(0) => Err(format!("invalid span '{text}': it must be longer than zero")),
        Some(seconds) => Ok(seconds),
        None => Err(format!("invalid span '{text}': too long")),
    }
}

/// Formats seconds as [`parse_span`] reads them, in the largest unit that
/// divides them: `30d`, `36h`, `90s`.
pub fn format_span(seconds: u64) -> String {
    let (name, unit) = SPAN_UNITS
        .iter()
        .find(|(_, unit)| seconds.is_multiple_of(*unit))
        .copied()
        .unwrap_or(("s", 1));
    format!("{}{name}", seconds / unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_round_trip_in_their_largest_unit() {
        assert_eq!(parse_span("30d"), Ok(30 * 86_400));
        assert_eq!(parse_span(" 2w "), Ok(14 * 86_400));
        assert_eq!(parse_span("90m"), Ok(5_400));
        assert_eq!(parse_span("45s"), Ok(45));
        for bad in [
            "",
            "d",
            "30",
            "30x",
            "1.5d",
            "-1d",
            "0h",
            "99999999999999999999s",
            "30 d",
        ] {
            assert!(parse_span(bad).is_err(), "{bad}");
        }
        assert!(parse_span(&format!("{}w", u64::MAX / 2))
            .unwrap_err()
            .contains("too long"));
        assert_eq!(format_span(30 * 86_400), "30d");
        assert_eq!(format_span(14 * 86_400), "2w");
        assert_eq!(format_span(36 * 3_600), "36h");
        assert_eq!(format_span(90), "90s");
        for seconds in [1, 59, 60, 3_601, 86_400, 604_800, 1_000_000] {
            assert_eq!(parse_span(&format_span(seconds)), Ok(seconds));
        }
    }

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("10g"), Ok(10 << 30));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1.5T"), Ok(3 << 39));
        assert_eq!(parse_size(" 2M "), Ok(2 << 20));
    }

    #[test]
    fn refuses_garbage() {
        for bad in [
            "",
            "G",
            "10X",
            "1.2.3G",
            "-5G",
            "0.1",
            "99999999999999999999",
            "16777216T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn formats_like_zfs() {
        assert_eq!(format_size(0), "0B");
        assert_eq!(format_size(10 << 30), "10G");
        assert_eq!(format_size(3 << 29), "1.50G");
        assert_eq!(format_size(1000), "1000B");
    }
}
