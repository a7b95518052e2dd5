//! UTC calendar arithmetic (H. Hinnant's civil-date algorithms), so that checkpoint ids, runc's
//! timestamps and log lines are read and written in one place without a date library; and the
//! project's one wall clock, [`now_ms`].

/// Now, in Unix milliseconds (0 on a clock set before 1970). The one read of the wall clock in
/// core, so that every process stamps times the same way; the decisions take times as
/// arguments and stay pure.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Unix seconds to the UTC calendar: (year, month, day, hour, minute, second).
pub fn civil_from_unix(secs: i64) -> (i64, u32, u32, u32, u32, u32) {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        m as u32,
        d as u32,
        (rem / 3600) as u32,
        (rem % 3600 / 60) as u32,
        (rem % 60) as u32,
    )
}

/// The UTC calendar to Unix seconds.
pub fn unix_from_civil(y: i64, mo: i64, d: i64, h: i64, mi: i64, s: i64) -> i64 {
    let (yy, mm) = if mo <= 2 {
        (y - 1, mo + 9)
    } else {
        (y, mo - 3)
    };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe - 719_468) * 86_400 + h * 3600 + mi * 60 + s
}

/// RFC 3339 UTC with whole seconds (`2026-11-29T08:00:00Z`).
pub fn rfc3339(secs: i64) -> String {
    let (y, mo, d, h, mi, s) = civil_from_unix(secs);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// Parses RFC 3339 (`Z` or `±hh:mm`, optional fraction, as runc writes `created`) into Unix
/// nanoseconds.
pub fn parse_rfc3339_nanos(s: &str) -> Option<i128> {
    if s.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let secs = unix_from_civil(
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    let tail = s.get(19..)?;
    let frac = tail.strip_prefix('.').map_or("", |t| {
        &t[..t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len())]
    });
    let tz = &tail[if frac.is_empty() { 0 } else { frac.len() + 1 }..];
    let offset = match tz {
        "Z" | "z" => 0,
        t if t.len() == 6 && (t.starts_with('+') || t.starts_with('-')) => {
            let sign = if t.starts_with('-') { -1 } else { 1 };
            sign * (t.get(1..3)?.parse::<i64>().ok()? * 3600
                + t.get(4..6)?.parse::<i64>().ok()? * 60)
        }
        _ => return None,
    };
    let mut nanos: i128 = 0;
    for (i, c) in frac.bytes().take(9).enumerate() {
        nanos += i128::from(c - b'0') * 10i128.pow(8 - i as u32);
    }
    Some(i128::from(secs - offset) * 1_000_000_000 + nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_709_208_000), "2024-02-29T12:00:00Z");
        for t in [0, 1, 86_399, 951_782_400, 1_795_000_000, 4_102_444_800] {
            assert_eq!(
                parse_rfc3339_nanos(&rfc3339(t)),
                Some(i128::from(t) * 1_000_000_000)
            );
        }
    }

    #[test]
    fn runc_created_times() {
        assert_eq!(
            parse_rfc3339_nanos("1970-01-01T00:00:01.5Z"),
            Some(1_500_000_000)
        );
        assert_eq!(
            parse_rfc3339_nanos("2026-11-18T11:06:40.123456789Z"),
            Some(1_795_000_000_123_456_789)
        );
        assert_eq!(
            parse_rfc3339_nanos("2026-11-18T12:06:40+01:00"),
            Some(1_795_000_000_000_000_000)
        );
        assert_eq!(parse_rfc3339_nanos("yesterday"), None);
    }
}
