//! The wrapper's settings, from its environment (containerd's shim passes its own environment
//! on; the defaults are what a node needs, so nothing has to be set there).
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `STASIS_REAL_RUNC` | `/usr/sbin/runc`, else `runc` on `PATH` (never this binary) | the runc to run |
//! | `STASIS_RUN_DIR` | `/run/stasis` | `plans/`, `restored/`, `work/` live here |
//! | `STASIS_AGENT_SOCKET` | `<run dir>/agent.sock` | the agent's socket |
//! | `STASIS_PLAN_TIMEOUT_MS` | 200 (at most 200) | the whole plan lookup on `create` |
//! | `STASIS_AGENT_CONNECT_TIMEOUT_MS` | 100 | connecting to the agent |
//! | `STASIS_FINAL_CHECKPOINT_TIMEOUT_MS` | 20000 | the longest `kill` SIGTERM waits for a final checkpoint (0: never ask) |
//! | `STASIS_RUNC_PASSTHROUGH` | unset | `1`: behave exactly like runc (kill switch) |

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

pub const MAX_PLAN_TIMEOUT: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub real_runc: Option<PathBuf>,
    pub run_dir: PathBuf,
    pub socket: PathBuf,
    pub plan_timeout: Duration,
    pub connect_timeout: Duration,
    pub final_checkpoint_timeout: Duration,
    pub passthrough: bool,
}

impl Config {
    pub fn plans_dir(&self) -> PathBuf {
        self.run_dir.join("plans")
    }
    pub fn restored_dir(&self) -> PathBuf {
        self.run_dir.join("restored")
    }
    pub fn work_dir(&self) -> PathBuf {
        self.run_dir.join("work")
    }

    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var_os(k))
    }

    /// Builds the settings from a variable lookup; malformed numbers fall back to the defaults.
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
        let ms = |k: &str, default: u64| {
            get(k)
                .and_then(|v| v.to_str().and_then(|s| s.trim().parse::<u64>().ok()))
                .map_or(Duration::from_millis(default), Duration::from_millis)
        };
        let run_dir = get("STASIS_RUN_DIR").filter(|v| !v.is_empty()).map_or_else(
            || PathBuf::from(stasis_node_api::DEFAULT_RUN_DIR),
            PathBuf::from,
        );
        let socket = get("STASIS_AGENT_SOCKET")
            .filter(|v| !v.is_empty())
            .map_or_else(|| run_dir.join("agent.sock"), PathBuf::from);
        Self {
            real_runc: get("STASIS_REAL_RUNC")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            socket,
            run_dir,
            plan_timeout: ms("STASIS_PLAN_TIMEOUT_MS", 200).min(MAX_PLAN_TIMEOUT),
            connect_timeout: ms("STASIS_AGENT_CONNECT_TIMEOUT_MS", 100),
            final_checkpoint_timeout: ms("STASIS_FINAL_CHECKPOINT_TIMEOUT_MS", 20_000),
            passthrough: get("STASIS_RUNC_PASSTHROUGH").is_some_and(|v| v == "1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        let m: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), OsString::from(v)))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]);
        assert_eq!(c.real_runc, None);
        assert_eq!(c.socket, PathBuf::from("/run/stasis/agent.sock"));
        assert_eq!(c.plans_dir(), PathBuf::from("/run/stasis/plans"));
        assert_eq!(c.restored_dir(), PathBuf::from("/run/stasis/restored"));
        assert_eq!(c.plan_timeout, Duration::from_millis(200));
        assert_eq!(c.connect_timeout, Duration::from_millis(100));
        assert_eq!(c.final_checkpoint_timeout, Duration::from_secs(20));
        assert!(!c.passthrough);
    }

    #[test]
    fn overrides_and_bounds() {
        let c = cfg(&[
            ("STASIS_RUN_DIR", "/tmp/x"),
            ("STASIS_PLAN_TIMEOUT_MS", "5000"),
            ("STASIS_FINAL_CHECKPOINT_TIMEOUT_MS", "bogus"),
            ("STASIS_REAL_RUNC", "/opt/runc"),
            ("STASIS_RUNC_PASSTHROUGH", "1"),
        ]);
        assert_eq!(c.socket, PathBuf::from("/tmp/x/agent.sock"));
        assert_eq!(c.plan_timeout, MAX_PLAN_TIMEOUT);
        assert_eq!(c.final_checkpoint_timeout, Duration::from_secs(20));
        assert_eq!(c.real_runc, Some(PathBuf::from("/opt/runc")));
        assert!(c.passthrough);
        let c = cfg(&[
            ("STASIS_AGENT_SOCKET", "/s.sock"),
            ("STASIS_PLAN_TIMEOUT_MS", "50"),
        ]);
        assert_eq!(c.socket, PathBuf::from("/s.sock"));
        assert_eq!(c.plan_timeout, Duration::from_millis(50));
    }
}
