//! Times as the project writes and reads them: RFC 3339 (runc's `created`, the wrapper's log
//! lines, manifests), the UTC calendar of checkpoint ids, and the project's one wall clock,
//! [`now_ms`]. The calendar is chrono's, core's one date library (it also reads the RFC 2822
//! dates of cloud notices).

use chrono::{DateTime, Datelike, Timelike, Utc};

/// Now, in Unix milliseconds (0 on a clock set before 1970). The one read of the wall clock in
/// core, so that every process stamps times the same way; the decisions take times as
/// arguments and stay pure.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Unix seconds as a UTC time (the epoch for seconds beyond chrono's range, ±262,000 years).
fn utc(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(secs, 0).unwrap_or_default()
}

/// Unix seconds to the UTC calendar: (year, month, day, hour, minute, second).
pub fn civil_from_unix(secs: i64) -> (i64, u32, u32, u32, u32, u32) {
    let t = utc(secs);
    (
        i64::from(t.year()),
        t.month(),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
    )
}

/// RFC 3339 UTC with whole seconds (`2026-11-29T08:00:00Z`).
pub fn rfc3339(secs: i64) -> String {
    utc(secs).format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Parses RFC 3339 (`Z` or `±hh:mm`, optional fraction, as runc writes `created`) into Unix
/// nanoseconds.
pub fn parse_rfc3339_nanos(s: &str) -> Option<i128> {
    let t = DateTime::parse_from_rfc3339(s).ok()?;
    Some(i128::from(t.timestamp()) * 1_000_000_000 + i128::from(t.timestamp_subsec_nanos()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_709_208_000), "2024-02-29T12:00:00Z");
        assert_eq!(civil_from_unix(951_782_400), (2000, 2, 29, 0, 0, 0));
        assert_eq!(civil_from_unix(-1), (1969, 12, 31, 23, 59, 59));
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
        assert_eq!(parse_rfc3339_nanos("2026-13-01T00:00:00Z"), None);
    }
}
