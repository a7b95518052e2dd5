//! Lines in runc's `--log` file, in runc's own format, so that what the wrapper decided shows up
//! where containerd looks: `--log-format json` is logrus's JSON (`{"level":…,"msg":…,"time":…}`),
//! the text format is logrus's `time="…" level=… msg="…"`.

use std::io::Write;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warning,
    Error,
}

impl Level {
    fn as_str(self) -> &'static str {
        match self {
            Level::Info => "info",
            Level::Warning => "warning",
            Level::Error => "error",
        }
    }
}

/// RFC 3339 UTC with seconds, for Unix seconds `t`.
pub fn rfc3339(t: i64) -> String {
    stasis_core::time::rfc3339(t)
}

/// One log line (without the newline).
pub fn line(json: bool, level: Level, msg: &str, unix_secs: i64) -> String {
    let time = rfc3339(unix_secs);
    if json {
        serde_json::json!({"level": level.as_str(), "msg": msg, "time": time}).to_string()
    } else {
        format!(
            "time={:?} level={} msg={}",
            time,
            level.as_str(),
            serde_json::Value::from(msg)
        )
    }
}

/// Appends one line to runc's log file (best effort: a log that cannot be written never changes
/// what the wrapper does).
pub fn append(log: Option<&str>, json: bool, level: Level, msg: &str) {
    let Some(path) = log else { return };
    let now = (stasis_core::time::now_ms() / 1000) as i64;
    let mut l = line(json, level, &format!("stasis-runc: {msg}"), now);
    l.push('\n');
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(Path::new(path))
    {
        let _ = f.write_all(l.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_000_000), "2026-11-18T11:06:40Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn runc_json_and_text_lines() {
        let j = line(true, Level::Warning, "cold start: \"x\"", 0);
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["level"], "warning");
        assert_eq!(v["msg"], "cold start: \"x\"");
        assert_eq!(v["time"], "1970-01-01T00:00:00Z");
        assert_eq!(
            line(false, Level::Info, "a b", 0),
            r#"time="1970-01-01T00:00:00Z" level=info msg="a b""#
        );
    }

    #[test]
    fn appends() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("log.json");
        std::fs::write(&p, "{\"level\":\"info\",\"msg\":\"runc\"}\n").unwrap();
        append(p.to_str(), true, Level::Info, "one");
        append(p.to_str(), true, Level::Error, "two");
        append(None, true, Level::Error, "nowhere");
        let s = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<_> = s.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[2].contains("stasis-runc: two"));
    }
}
