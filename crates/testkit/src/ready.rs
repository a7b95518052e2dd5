//! Whether a test's real tools are here.

use std::path::{Path, PathBuf};

/// What a test needs before it can run. Build it with the needs, then ask [`Requirements::met`].
///
/// ```no_run
/// # use stasis_testkit::Requirements;
/// if !Requirements::containers("my_test").binary("stasisd", None, "cargo build").met() {
///     return;
/// }
/// ```
pub struct Requirements {
    test: String,
    needs: Vec<Need>,
}

enum Need {
    Root,
    Criu,
    Runc,
    CounterImage,
    Binary {
        name: String,
        path: Option<PathBuf>,
        fix: String,
    },
}

impl Need {
    fn what(&self) -> String {
        match self {
            Need::Root => "root".into(),
            Need::Criu => "CRIU >= 4.2".into(),
            Need::Runc => "runc".into(),
            Need::CounterImage => "the counter image".into(),
            Need::Binary { name, .. } => name.clone(),
        }
    }

    /// Why this need is not met, or `None`.
    fn unmet(&self) -> Option<String> {
        match self {
            Need::Root => (!is_root()).then(|| "not running as root".to_owned()),
            Need::Criu => stasis_engine::tools::criu_checked()
                .err()
                .map(|e| e.to_string()),
            Need::Runc => (!Path::new("/usr/sbin/runc").exists()
                && stasis_engine::tools::which("runc").is_none())
            .then(|| "runc is not installed (scripts/setup)".to_owned()),
            Need::CounterImage => {
                let counter = crate::counter_rootfs().join("stasis-counter");
                (!counter.exists()).then(|| {
                    format!(
                        "{} is missing (scripts/build-counter-image)",
                        counter.display()
                    )
                })
            }
            Need::Binary { name, path, fix } => match path {
                Some(p) if p.exists() => None,
                _ => Some(format!("{name} is not built ({fix})")),
            },
        }
    }
}

impl Requirements {
    /// The needs of the test named `test` (the name is printed when it cannot run).
    pub fn new(test: &str) -> Self {
        Self {
            test: test.to_owned(),
            needs: Vec::new(),
        }
    }

    /// What a test of counter containers under runc needs: root, CRIU, runc and the counter
    /// image.
    pub fn containers(test: &str) -> Self {
        Self::new(test).root().criu().runc().counter_image()
    }

    /// Running as root.
    pub fn root(mut self) -> Self {
        self.needs.push(Need::Root);
        self
    }

    /// CRIU >= 4.2 (`scripts/setup`).
    pub fn criu(mut self) -> Self {
        self.needs.push(Need::Criu);
        self
    }

    /// runc on `PATH` or at `/usr/sbin/runc`.
    pub fn runc(mut self) -> Self {
        self.needs.push(Need::Runc);
        self
    }

    /// The counter image's rootfs (`scripts/build-counter-image`).
    pub fn counter_image(mut self) -> Self {
        self.needs.push(Need::CounterImage);
        self
    }

    /// A binary found at `path` (e.g. from [`crate::workspace_binary`]); `fix` says how to
    /// build it.
    pub fn binary(mut self, name: &str, path: Option<&Path>, fix: &str) -> Self {
        self.needs.push(Need::Binary {
            name: name.to_owned(),
            path: path.map(Path::to_path_buf),
            fix: fix.to_owned(),
        });
        self
    }

    /// Whether every need is met. When one is not, prints `SKIPPED <test>: needs ...: <why>`
    /// and returns false, or panics when `CI` is set (a CI machine must run every test).
    pub fn met(self) -> bool {
        let Some(why) = self.needs.iter().find_map(Need::unmet) else {
            return true;
        };
        let needs: Vec<String> = self.needs.iter().map(Need::what).collect();
        crate::cannot_run(&self.test, &join_and(&needs), &why);
        false
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// "a", "a and b", "a, b and c"
fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_read_as_a_list() {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(join_and(&s(&["root"])), "root");
        assert_eq!(join_and(&s(&["root", "runc"])), "root and runc");
        assert_eq!(
            join_and(&s(&["root", "CRIU", "runc"])),
            "root, CRIU and runc"
        );
    }

    #[test]
    fn a_missing_binary_is_named_with_its_fix() {
        let n = Need::Binary {
            name: "stasis-runc".into(),
            path: Some(PathBuf::from("/nonexistent/stasis-runc")),
            fix: "cargo build -p stasis-runtime".into(),
        };
        assert_eq!(
            n.unmet().as_deref(),
            Some("stasis-runc is not built (cargo build -p stasis-runtime)")
        );
    }
}
