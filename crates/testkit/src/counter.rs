//! The counter workload's output: one `count=<n> state=ok|CORRUPT` line per tick on stdout
//! (`workloads/counter`). Its stderr lines (`stasis-counter: full-check count=...`) are not
//! counts.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The count of a status line, `None` for any other line.
pub fn count_of(line: &str) -> Option<u64> {
    line.strip_prefix("count=")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The counts of `lines`, in order.
pub fn counts<S: AsRef<str>>(lines: &[S]) -> Vec<u64> {
    lines.iter().filter_map(|l| count_of(l.as_ref())).collect()
}

/// The last count among lines collected so far (e.g. by [`crate::World::run_piped`]).
pub fn last_count(lines: &Mutex<Vec<String>>) -> Option<u64> {
    lines.lock().unwrap().iter().rev().find_map(|l| count_of(l))
}

/// Waits (30 s at most, then panics) until the collected lines reach count `n`.
pub fn wait_counts(lines: &Mutex<Vec<String>>, n: u64) {
    let until = Instant::now() + Duration::from_secs(30);
    while last_count(lines).unwrap_or(0) < n {
        assert!(
            Instant::now() < until,
            "the counter does not reach count {n} within 30 s (last {:?})",
            last_count(lines)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_status_lines_are_counts() {
        assert_eq!(count_of("count=42 state=ok"), Some(42));
        assert_eq!(count_of("count=7"), Some(7));
        assert_eq!(
            count_of("stasis-counter: full-check count=0 blocks=1"),
            None
        );
        assert_eq!(count_of("count=x state=ok"), None);
        assert_eq!(
            counts(&["count=1 state=ok", "noise", "count=2 state=ok"]),
            vec![1, 2]
        );
    }

    #[test]
    fn the_last_count_skips_later_noise() {
        let l = Mutex::new(vec!["count=3 state=ok".to_owned(), "other".to_owned()]);
        assert_eq!(last_count(&l), Some(3));
        wait_counts(&l, 3);
    }
}
