//! `advise` as text: a kubectl table with one row per workload, then per workload the figures
//! with where each came from, and its findings (what, why, how to fix).

use std::fmt::Write as _;
use std::time::Duration;

use super::{Figure, Report, WorkloadAdvice};
use crate::table::{human_duration, Table};

/// Seconds as people read them: `55ms`, `1.2s`, `30s`, then kubectl's ages (`3m10s`, `2h5m`).
pub fn seconds(s: f64) -> String {
    if !s.is_finite() || s < 0.0 {
        return "?".into();
    }
    if s < 1.0 {
        return format!("{:.0}ms", s * 1000.0);
    }
    if s < 10.0 {
        return format!("{s:.1}s");
    }
    human_duration(Duration::from_secs_f64(s.round()))
}

fn percent(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn figure_line(out: &mut String, what: &str, value: &str, f: &Figure) {
    let _ = writeln!(
        out,
        "  {what:<18}{value:<10}{}: {}",
        f.source.name(),
        f.from
    );
}

/// The table and the details, or nothing when no workload is in scope.
pub fn render(r: &Report, all_namespaces: bool) -> String {
    if r.workloads.is_empty() {
        return r.notes.iter().map(|n| format!("note: {n}\n")).collect();
    }
    let mut head = vec![
        "workload",
        "pods",
        "pool",
        "checks failed",
        "interval",
        "checkpoint",
        "loss/eviction",
        "goodput without → with",
    ];
    if all_namespaces {
        head.insert(0, "namespace");
    }
    let mut t = Table::new(&head);
    for w in &r.workloads {
        let mut cells = vec![
            w.workload.clone(),
            w.pods.len().to_string(),
            w.node_pool.clone().unwrap_or_default(),
            w.findings.len().to_string(),
            w.interval_seconds
                .as_ref()
                .map_or("no policy".into(), |i| seconds(i.value)),
            format!(
                "{} (frozen {})",
                seconds(w.checkpoint_seconds.value),
                seconds(w.freeze_seconds.value)
            ),
            w.goodput
                .map_or(String::new(), |g| seconds(g.loss_per_eviction_s)),
            w.goodput.map_or(String::new(), |g| {
                format!("{} → {}", percent(g.without_stasis), percent(g.with_stasis))
            }),
        ];
        if all_namespaces {
            cells.insert(0, w.namespace.clone());
        }
        t.row(cells);
    }
    let mut out = t.render();
    for w in &r.workloads {
        details(&mut out, w);
    }
    for n in &r.notes {
        let _ = writeln!(out, "\nnote: {n}");
    }
    out
}

fn details(out: &mut String, w: &WorkloadAdvice) {
    let _ = writeln!(out, "\n{} in {}:", w.workload, w.namespace);
    match &w.interval_seconds {
        Some(i) => figure_line(out, "interval", &seconds(i.value), i),
        None => {
            let _ = writeln!(
                out,
                "  {:<18}{:<10}no CheckpointPolicy selects it",
                "interval", "-"
            );
        }
    }
    for (what, f) in [
        ("checkpoint", &w.checkpoint_seconds),
        ("freeze", &w.freeze_seconds),
        ("restore", &w.restore_seconds),
        ("cold start", &w.cold_start_seconds),
    ] {
        figure_line(out, what, &seconds(f.value), f);
    }
    if w.lost_work_without_seconds.value > 0.0 {
        figure_line(
            out,
            "work lost without",
            &seconds(w.lost_work_without_seconds.value),
            &w.lost_work_without_seconds,
        );
    }
    figure_line(
        out,
        "evictions",
        &format!("{:.2}/h", w.evictions_per_hour.value),
        &w.evictions_per_hour,
    );
    if let Some(g) = w.goodput {
        let _ = writeln!(
            out,
            "  {:<18}with stasis {} lost per eviction (half the interval + the restore), goodput {}; without {} lost, goodput {}",
            "per eviction",
            seconds(g.loss_per_eviction_s),
            percent(g.with_stasis),
            seconds(g.loss_per_eviction_without_s),
            percent(g.without_stasis),
        );
        if let Some(s) = g.suggested_interval_s {
            let _ = writeln!(
                out,
                "  {:<18}interval: auto would choose {}",
                "",
                seconds(s)
            );
        }
    }
    if w.findings.is_empty() {
        let _ = writeln!(out, "  no findings");
    }
    for f in &w.findings {
        let _ = writeln!(out, "  {:<8} {}: {}", f.severity.name(), f.code, f.what);
        let _ = writeln!(out, "           why: {}", f.why);
        let _ = writeln!(out, "           fix: {}", f.fix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_read_as_people_read_them() {
        assert_eq!(seconds(0.055), "55ms");
        assert_eq!(seconds(1.25), "1.2s");
        assert_eq!(seconds(30.0), "30s");
        assert_eq!(seconds(190.0), "3m10s");
        assert_eq!(seconds(f64::NAN), "?");
    }
}
