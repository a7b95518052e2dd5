//! `stasis doctor`: is this machine ready to checkpoint and restore, and if not, what to do.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use serde::Serialize;
use stasis_core::fingerprint::MIN_CRIU;
use stasis_engine::{node, tools};

use crate::args::DoctorArgs;
use crate::output;

#[derive(Debug, Serialize)]
struct Check {
    name: &'static str,
    ok: bool,
    /// False for checks that only matter for some uses (GPU, Kubernetes).
    required: bool,
    detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    fix: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    ready: bool,
    checks: Vec<Check>,
    fingerprint: stasis_core::NodeFingerprint,
}

fn check(name: &'static str, required: bool, r: Result<String, (String, String)>) -> Check {
    match r {
        Ok(detail) => Check {
            name,
            ok: true,
            required,
            detail,
            fix: None,
        },
        Err((detail, fix)) => Check {
            name,
            ok: false,
            required,
            detail,
            fix: Some(fix),
        },
    }
}

const SETUP: &str = "run scripts/setup (as root) from the stasis repository";

pub fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let mut checks = Vec::new();

    checks.push(check("root", true, {
        if nix_is_root() {
            Ok("running as root".into())
        } else {
            Err((
                "not running as root".into(),
                "CRIU needs root: run stasis with sudo".into(),
            ))
        }
    }));

    let criu = tools::criu_binary();
    checks.push(check("criu", true, match &criu {
        Err(e) => Err((e.to_string(), SETUP.into())),
        Ok(path) => match tools::criu_version(path) {
            Ok(v) if (v.major, v.minor) >= (MIN_CRIU.major, MIN_CRIU.minor) => {
                Ok(format!("CRIU {v} at {}", path.display()))
            }
            Ok(v) => Err((
                format!("CRIU {v} at {} is older than {MIN_CRIU} (4.1 cannot dump INET sockets on current kernels)", path.display()),
                SETUP.into(),
            )),
            Err(e) => Err((e.to_string(), SETUP.into())),
        },
    }));

    if let Ok(path) = &criu {
        checks.push(check("criu check", true, {
            match Command::new(path).arg("check").output() {
                Ok(o) if o.status.success() => {
                    Ok("kernel supports what CRIU needs (criu check: Looks good)".into())
                }
                Ok(o) => Err((
                    format!(
                        "criu check failed: {}",
                        tools::tail(&[o.stdout, o.stderr].concat(), 3)
                    ),
                    "use a kernel with CONFIG_CHECKPOINT_RESTORE and run as root".into(),
                )),
                Err(e) => Err((format!("cannot run criu: {e}"), SETUP.into())),
            }
        }));
        // Servers: connections dumped, accepted ones skipped, closed where a restore cannot
        // keep them (DESIGN §9.8).
        checks.push(check("sockets", true, stasis_engine::sockets::probe(path)));
        checks.push(check("memory tracking", false, {
            match Command::new(path).args(["check", "--feature", "mem_dirty_track"]).output() {
                Ok(o) if o.status.success() => Ok("soft-dirty tracking available".into()),
                _ => Err((
                    "no soft-dirty memory tracking: incremental checkpoints rely on content-defined deduplication instead".into(),
                    "nothing to do; CRIU pre-dumps are not used".into(),
                )),
            }
        }));
    }

    checks.push(check(
        "runc",
        true,
        match tools::which("runc") {
            Some(p) => match tools::runc_version(&p) {
                Some(v) => Ok(format!("runc {v} at {}", p.display())),
                None => Err((
                    format!("{} does not report a version", p.display()),
                    SETUP.into(),
                )),
            },
            None => Err(("runc not found on PATH".into(), SETUP.into())),
        },
    ));

    checks.push(check(
        "iptables",
        true,
        match tools::which("iptables-restore") {
            Some(p) => Ok(format!("{} (CRIU locks the network with it)", p.display())),
            None => Err((
                "iptables-restore not found: CRIU cannot lock the network during a dump".into(),
                SETUP.into(),
            )),
        },
    ));

    checks.push(check(
        "tar",
        true,
        match tools::which("tar") {
            Some(p) => Ok(format!("{} (filesystem capture)", p.display())),
            None => Err(("GNU tar not found".into(), "apt-get install tar".into())),
        },
    ));

    let kernel = node::kernel_release();
    checks.push(check("kernel", true, {
        if Path::new("/proc/sys/kernel/ns_last_pid").exists() {
            Ok(format!("{kernel} with CHECKPOINT_RESTORE"))
        } else {
            Err((format!("{kernel} lacks CONFIG_CHECKPOINT_RESTORE (/proc/sys/kernel/ns_last_pid missing)"), "use a kernel built with CONFIG_CHECKPOINT_RESTORE=y".into()))
        }
    }));

    checks.push(check("cgroups", false, {
        if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            Ok("cgroup v2".into())
        } else if Path::new("/sys/fs/cgroup/freezer").exists() {
            Ok("cgroup v1 with the freezer controller".into())
        } else {
            Err((
                "no cgroup freezer found: containers cannot be paused for a consistent capture"
                    .into(),
                "mount the cgroup v1 freezer or use cgroup v2".into(),
            ))
        }
    }));

    checks.push(check("lazy restore", false, lazy_restore_check()));

    checks.push(check("gpu", false, gpu_check()));

    checks.push(check("runtime handler", false, {
        use stasis_engine::containerd::{handler_check, DEFAULT_CONFIGS, DEFAULT_RUNTIME_BINARY};
        let configs = DEFAULT_CONFIGS.map(PathBuf::from);
        handler_check(&configs, Path::new(DEFAULT_RUNTIME_BINARY)).map_err(|why| {
            (
                format!("{why} (only needed on Kubernetes nodes)"),
                "install the stasis Helm chart; its node installer registers it".into(),
            )
        })
    }));

    if let Some(url) = &args.store {
        checks.push(check("store", true, super::store_reachable(url)));
    }

    let ready = checks.iter().all(|c| c.ok || !c.required);
    let report = Report {
        ready,
        checks,
        fingerprint: node::fingerprint(),
    };
    output::emit(&report, || {
        let mut s = String::new();
        for c in &report.checks {
            let mark = if c.ok {
                "ok  "
            } else if c.required {
                "FAIL"
            } else {
                "note"
            };
            s.push_str(&format!("[{mark}] {:<16} {}\n", c.name, c.detail));
            if let (false, Some(fix)) = (c.ok, &c.fix) {
                s.push_str(&format!("       {:<16} fix: {fix}\n", ""));
            }
        }
        s.push_str(if report.ready {
            "\nthis machine is ready to checkpoint and restore"
        } else {
            "\nthis machine is NOT ready: fix the FAIL lines above"
        });
        s
    });
    Ok(if ready {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// Whether a container can run before its memory has arrived here: userfaultfd, and the
/// cgroups the runtime moves the page service into (the node's runtime wrapper runs as this
/// command does: as root, outside any pod) are mounted and writable.
fn lazy_restore_check() -> Result<String, (String, String)> {
    if let Some(why) = stasis_engine::restore::lazy::no_userfaultfd() {
        return Err((
            format!("{why}: restores fetch all of a checkpoint before the workload runs"),
            "use a kernel with CONFIG_USERFAULTFD, run as root".into(),
        ));
    }
    let dirs = stasis_engine::cgroup::own_cgroup_dirs().unwrap_or_default();
    let writable = |d: &PathBuf| {
        nix::unistd::access(&d.join("cgroup.procs"), nix::unistd::AccessFlags::W_OK).is_ok()
    };
    match dirs.iter().find(|d| !writable(d)) {
        _ if dirs.is_empty() => Err((
            "no cgroup hierarchy of this process is mounted here: a lazy restore's page service cannot be moved out of the agent's container, and such restores start cold".into(),
            "mount the cgroup hierarchies (/sys/fs/cgroup), or set the chart's agent.lazyRestore: off".into(),
        )),
        Some(d) => Err((
            format!("{}/cgroup.procs is not writable: a lazy restore's page service cannot be moved out of the agent's container, and such restores start cold", d.display()),
            "run as root with /sys/fs/cgroup writable, or set the chart's agent.lazyRestore: off".into(),
        )),
        None => Ok(format!(
            "userfaultfd available; the page service can outlive the agent ({} cgroup hierarchies)",
            dirs.len()
        )),
    }
}

fn gpu_check() -> Result<String, (String, String)> {
    let probe = stasis_engine::cuda::probe();
    if probe.ready() {
        Ok(probe.summary())
    } else {
        Err((
            probe.summary(),
            "only needed for GPU workloads: an NVIDIA driver >= 570 (r580 to restore onto other GPUs), persistence mode on".into(),
        ))
    }
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
