//! Output as kubectl prints it: upper-case headers, columns three spaces apart, `<none>` for an
//! empty cell, ages in kubectl's short form, sizes in binary units.

use std::fmt::Write as _;
use std::time::Duration;

/// A table: a header and rows of cells, printed left-aligned.
#[derive(Debug, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| h.to_uppercase()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text; the last column is never padded (as kubectl's tabwriter).
    pub fn render(&self) -> String {
        let cell = |s: &str| {
            if s.is_empty() {
                "<none>".to_owned()
            } else {
                s.to_owned()
            }
        };
        let all: Vec<Vec<String>> = std::iter::once(self.header.clone())
            .chain(
                self.rows
                    .iter()
                    .map(|r| r.iter().map(|c| cell(c)).collect()),
            )
            .collect();
        let cols = self.header.len();
        let widths: Vec<usize> = (0..cols)
            .map(|i| {
                all.iter()
                    .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for r in &all {
            let mut line = String::new();
            for (i, c) in r.iter().enumerate().take(cols) {
                if i + 1 == cols {
                    line.push_str(c);
                } else {
                    let _ = write!(line, "{c:<w$}   ", w = widths[i]);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// kubectl's age (`k8s.io/apimachinery/pkg/util/duration.HumanDuration`): `45s`, `3m20s`,
/// `15m`, `2h5m`, `10h`, `3d4h`, `20d`, `2y30d`, `9y`.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s < 60 * 2 {
        return format!("{s}s");
    }
    let m = s / 60;
    if m < 10 {
        return with_rest(m, "m", s % 60, "s");
    }
    if m < 60 * 3 {
        return format!("{m}m");
    }
    let h = m / 60;
    if h < 8 {
        return with_rest(h, "h", m % 60, "m");
    }
    if h < 48 {
        return format!("{h}h");
    }
    if h < 24 * 8 {
        return with_rest(h / 24, "d", h % 24, "h");
    }
    if h < 24 * 365 * 2 {
        return format!("{}d", h / 24);
    }
    if h < 24 * 365 * 8 {
        return with_rest(h / 24 / 365, "y", (h / 24) % 365, "d");
    }
    format!("{}y", h / 24 / 365)
}

fn with_rest(n: u64, unit: &str, rest: u64, rest_unit: &str) -> String {
    if rest == 0 {
        format!("{n}{unit}")
    } else {
        format!("{n}{unit}{rest}{rest_unit}")
    }
}

/// Bytes in binary units with one decimal (`512B`, `1.5Ki`, `256.0Mi`, `2.0Gi`).
pub fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["Ki", "Mi", "Gi", "Ti", "Pi"];
    if n < 1024 {
        return format!("{n}B");
    }
    let mut v = n as f64;
    let mut unit = "B";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{v:.1}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        // Each branch of apimachinery's HumanDuration, with and without a remainder.
        for (secs, want) in [
            (1, "1s"),
            (70, "70s"),
            (190, "3m10s"),
            (180, "3m"),
            (60 * 10 + 1, "10m"),
            (60 * 47, "47m"),
            (60 * 59, "59m"),
            (3600 * 2 + 60 * 30, "150m"),
            (3600 * 3 + 60 * 30, "3h30m"),
            (3600 * 3, "3h"),
            (3600 * 8 + 60 * 10, "8h"),
            (3600 * 47, "47h"),
            (3600 * 49, "2d1h"),
            (3600 * 24 * 7, "7d"),
            (3600 * 24 * 9, "9d"),
            (3600 * 24 * 730, "2y"),
            (3600 * 24 * 731, "2y1d"),
            (3600 * 24 * 365 * 8, "8y"),
        ] {
            assert_eq!(human_duration(Duration::from_secs(secs)), want, "{secs} s");
        }
    }

    #[test]
    fn sizes_in_binary_units() {
        assert_eq!(bytes(512), "512B");
        assert_eq!(bytes(1536), "1.5Ki");
        assert_eq!(bytes(256 << 20), "256.0Mi");
        assert_eq!(bytes(3 << 30), "3.0Gi");
    }

    #[test]
    fn columns_are_three_spaces_apart_and_empty_cells_say_none() {
        let mut t = Table::new(&["name", "phase", "message"]);
        t.row(vec!["web-1".into(), "Succeeded".into(), String::new()]);
        t.row(vec!["a".into(), "".into(), "frozen for too long".into()]);
        assert_eq!(
            t.render(),
            "NAME    PHASE       MESSAGE\n\
             web-1   Succeeded   <none>\n\
             a       <none>      frozen for too long\n"
        );
    }
}
