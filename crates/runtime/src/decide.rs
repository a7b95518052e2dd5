//! The decisions, without I/O: whether a `create` may become a restore, whether a plan is
//! acceptable, and the exact `runc restore` command line.

use std::ffi::OsString;
use std::path::Path;

use stasis_node_api::planfile::PlanFile;
use stasis_node_api::{ColdStartCause, Plan, PodRef};

use crate::argv::{CreateArgs, Invocation};
use crate::bundle::ContainerKind;

/// What to do with a `create` before looking for a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precheck {
    /// Not stasis's business (a pod sandbox, a malformed call runc will refuse): plain runc,
    /// nothing reported.
    Passthrough,
    /// A cold start for this reason (reported and logged).
    Cold(ColdStartCause, String),
    /// Look for a plan for this container.
    LookForPlan,
}

pub fn precheck(
    inv: &Invocation,
    c: &CreateArgs,
    kind: &ContainerKind,
    force_cold: bool,
) -> Precheck {
    if *kind == ContainerKind::Sandbox || c.id.is_none() {
        return Precheck::Passthrough;
    }
    if force_cold {
        return Precheck::Cold(
            ColdStartCause::Forced,
            format!(
                "the pod asks for a cold start ({})",
                crate::bundle::COLD_START
            ),
        );
    }
    if !inv.globals.unknown.is_empty() {
        return Precheck::Cold(
            ColdStartCause::Unsupported,
            format!(
                "runc global flags stasis does not know: {}",
                inv.globals.unknown.join(" ")
            ),
        );
    }
    if !c.unknown.is_empty() {
        return Precheck::Cold(
            ColdStartCause::Unsupported,
            format!(
                "create arguments stasis does not know: {}",
                c.unknown.join(" ")
            ),
        );
    }
    if c.preserve_fds.as_deref().is_some_and(|n| n != "0") {
        return Precheck::Cold(
            ColdStartCause::Unsupported,
            "--preserve-fds cannot be carried into a restore".into(),
        );
    }
    Precheck::LookForPlan
}

/// What the wrapper found out about a plan's image directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFacts {
    /// `<image>/criu/inventory.img` exists.
    pub criu_inventory: bool,
    /// `<image>/rootfs/diff.tar` exists.
    pub rootfs_diff: bool,
    /// The agent's verification stamp: `Ok(Some(checkpoint_ref))`, `Ok(None)` when absent,
    /// `Err(why)` when unreadable or untrusted.
    pub stamp: Result<Option<String>, String>,
    /// `lazy-pages.socket` exists in a lazy plan's work dir: the agent's `criu lazy-pages`
    /// daemon listens for its restore.
    pub lazy_daemon: bool,
}

/// Checks a plan against the container it would restore into. `Err(reason)`: cold start.
pub fn accept(
    pf: &PlanFile,
    container_id: &str,
    kind: &ContainerKind,
    now_unix_ms: u64,
    image: &ImageFacts,
) -> Result<Plan, String> {
    let empty = PodRef::default();
    let pod = match kind {
        ContainerKind::App(p) => p,
        _ => &empty,
    };
    if let Some(want) = &pf.container_id {
        if want != container_id {
            return Err(format!(
                "the plan is for container {want}, not {container_id}"
            ));
        }
    }
    if let Some(want) = &pf.pod_uid {
        if *want != pod.pod_uid {
            return Err(format!(
                "the plan is for pod uid {want}, this container's pod is {:?}",
                pod.pod_uid
            ));
        }
    }
    if let Some(want) = &pf.container_name {
        if *want != pod.container_name {
            return Err(format!(
                "the plan is for container name {want}, this one is {:?}",
                pod.container_name
            ));
        }
    }
    if let Some(exp) = pf.expires_at_unix_ms {
        if now_unix_ms > exp {
            return Err(format!(
                "the plan expired {} ms ago",
                now_unix_ms.saturating_sub(exp)
            ));
        }
    }
    let plan = &pf.plan;
    if !plan.image_dir.is_absolute() {
        return Err(format!(
            "the plan's image dir {} is not an absolute path",
            plan.image_dir.display()
        ));
    }
    if !image.criu_inventory {
        return Err(format!(
            "{} holds no CRIU images (criu/inventory.img)",
            plan.image_dir.display()
        ));
    }
    if plan.lazy && !image.lazy_daemon {
        return Err(format!(
            "the plan serves the memory lazily, but no lazy-pages daemon listens in {} (the agent stopped serving it)",
            plan.lazy_work_dir().display()
        ));
    }
    if plan.rootfs_method.is_some() && !image.rootfs_diff {
        return Err(format!(
            "{} lacks the filesystem changes (rootfs/diff.tar)",
            plan.image_dir.display()
        ));
    }
    match &image.stamp {
        Err(why) => Err(format!("the agent's verification stamp is unusable: {why}")),
        Ok(None) => Err(format!(
            "{} was not verified by the agent (no {})",
            plan.image_dir.display(),
            stasis_node_api::planfile::VERIFIED_STAMP
        )),
        Ok(Some(r)) if *r != plan.checkpoint_ref => Err(format!(
            "{} was verified for checkpoint {r}, the plan names {}",
            plan.image_dir.display(),
            plan.checkpoint_ref
        )),
        Ok(Some(_)) => Ok(plan.clone()),
    }
}

/// `runc <same global flags> restore --detach --image-path <image>/criu --work-path <work>
/// [--bundle B] [--pid-file P] [--console-socket S] [--no-pivot] --file-locks
/// [--tcp-established] [--lazy-pages] <id>`. `--file-locks` matches the engine's checkpoints,
/// which always dump with it; `--lazy-pages` (a lazy plan) leaves the memory to the agent's
/// `criu lazy-pages` daemon, which listens in the work dir (the plan's, on the run directory).
pub fn restore_args(
    inv: &Invocation,
    c: &CreateArgs,
    id: &str,
    plan: &Plan,
    work: &Path,
) -> Vec<OsString> {
    let mut a: Vec<OsString> = inv.global_args().to_vec();
    let mut push = |s: &str| a.push(s.into());
    push("restore");
    push("--detach");
    a.push("--image-path".into());
    a.push(plan.image_dir.join("criu").into_os_string());
    a.push("--work-path".into());
    a.push(work.as_os_str().to_owned());
    for (flag, v) in [
        ("--bundle", &c.bundle),
        ("--pid-file", &c.pid_file),
        ("--console-socket", &c.console_socket),
    ] {
        if let Some(v) = v {
            a.push(flag.into());
            a.push(v.into());
        }
    }
    if c.no_pivot {
        a.push("--no-pivot".into());
    }
    a.push("--file-locks".into());
    if plan.tcp_established {
        a.push("--tcp-established".into());
    }
    if plan.lazy {
        a.push("--lazy-pages".into());
    }
    a.push(id.into());
    a
}

/// `runc <same global flags> delete --force <id>`.
pub fn delete_args(inv: &Invocation, id: &str) -> Vec<OsString> {
    let mut a: Vec<OsString> = inv.global_args().to_vec();
    a.extend(["delete", "--force", id].map(OsString::from));
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::argv::{parse, Command};
    use stasis_node_api::{RootfsMethod, PROTOCOL_VERSION};

    fn inv(s: &str) -> (Invocation, CreateArgs) {
        let i = parse(s.split_whitespace().map(OsString::from).collect());
        let Some(Command::Create(c)) = i.command.clone() else {
            panic!("not a create: {s}")
        };
        (i, c)
    }

    const SHIM: &str = "--root /R --log /L --log-format json create --bundle /B --pid-file /P cid";

    fn app() -> ContainerKind {
        ContainerKind::App(PodRef {
            pod_uid: "uid-1".into(),
            pod_namespace: "ns".into(),
            pod_name: "p".into(),
            container_name: "app".into(),
        })
    }

    fn planfile() -> PlanFile {
        PlanFile {
            v: PROTOCOL_VERSION,
            container_id: None,
            pod_uid: Some("uid-1".into()),
            container_name: Some("app".into()),
            plan: Plan {
                image_dir: "/img".into(),
                rootfs_method: Some(RootfsMethod::ChangedSinceStart),
                checkpoint_ref: "ref-1".into(),
                tcp_established: true,
                lazy: false,
                work_dir: None,
            },
            expires_at_unix_ms: Some(2_000),
        }
    }

    fn good() -> ImageFacts {
        ImageFacts {
            criu_inventory: true,
            rootfs_diff: true,
            stamp: Ok(Some("ref-1".into())),
            lazy_daemon: false,
        }
    }

    #[test]
    fn prechecks() {
        let (i, c) = inv(SHIM);
        assert_eq!(precheck(&i, &c, &app(), false), Precheck::LookForPlan);
        assert_eq!(
            precheck(&i, &c, &ContainerKind::Plain, false),
            Precheck::LookForPlan
        );
        assert_eq!(
            precheck(&i, &c, &ContainerKind::Sandbox, false),
            Precheck::Passthrough
        );
        assert!(
            matches!(precheck(&i, &c, &app(), true), Precheck::Cold(ColdStartCause::Forced, r) if r.contains("cold-start"))
        );
        let (i, c) = inv("--root /R --weird create --bundle /B cid");
        assert!(
            matches!(precheck(&i, &c, &app(), false), Precheck::Cold(_, r) if r.contains("--weird"))
        );
        let (i, c) = inv("create --bundle /B --preserve-fds 3 cid");
        assert!(
            matches!(precheck(&i, &c, &app(), false), Precheck::Cold(_, r) if r.contains("preserve-fds"))
        );
        let (i, c) = inv("create --bundle /B --preserve-fds 0 cid");
        assert_eq!(precheck(&i, &c, &app(), false), Precheck::LookForPlan);
        let (i, c) = inv("create --bundle /B cid surplus");
        assert!(matches!(
            precheck(&i, &c, &app(), false),
            Precheck::Cold(ColdStartCause::Unsupported, _)
        ));
        let (i, c) = inv("create --bundle /B");
        assert_eq!(precheck(&i, &c, &app(), false), Precheck::Passthrough);
    }

    #[test]
    fn a_good_plan_is_accepted() {
        assert_eq!(
            accept(&planfile(), "cid", &app(), 1_000, &good()).unwrap(),
            planfile().plan
        );
        // A per-id plan for a container without CRI annotations.
        let mut pf = planfile();
        pf.pod_uid = None;
        pf.container_name = None;
        pf.container_id = Some("cid".into());
        pf.expires_at_unix_ms = None;
        assert!(accept(&pf, "cid", &ContainerKind::Plain, 1_000, &good()).is_ok());
    }

    #[test]
    fn every_doubt_is_a_cold_start() {
        let check = |pf: PlanFile, kind: ContainerKind, facts: ImageFacts, want: &str| {
            let r = accept(&pf, "cid", &kind, 1_000, &facts).unwrap_err();
            assert!(r.contains(want), "{r:?} lacks {want:?}");
        };
        let mut pf = planfile();
        pf.container_id = Some("other".into());
        check(pf, app(), good(), "container other");
        let mut pf = planfile();
        pf.pod_uid = Some("uid-2".into());
        check(pf, app(), good(), "pod uid uid-2");
        check(planfile(), ContainerKind::Plain, good(), "pod uid");
        let mut pf = planfile();
        pf.container_name = Some("sidecar".into());
        check(pf, app(), good(), "sidecar");
        let mut pf = planfile();
        pf.expires_at_unix_ms = Some(500);
        check(pf, app(), good(), "expired 500 ms ago");
        let mut pf = planfile();
        pf.plan.image_dir = "img".into();
        check(pf, app(), good(), "absolute");
        let mut f = good();
        f.criu_inventory = false;
        check(planfile(), app(), f, "inventory.img");
        let mut f = good();
        f.rootfs_diff = false;
        check(planfile(), app(), f, "diff.tar");
        let mut f = good();
        f.stamp = Ok(None);
        check(planfile(), app(), f, "not verified");
        let mut f = good();
        f.stamp = Ok(Some("ref-0".into()));
        check(planfile(), app(), f, "verified for checkpoint ref-0");
        let mut f = good();
        f.stamp = Err("owned by uid 1000".into());
        check(planfile(), app(), f, "uid 1000");
        // No filesystem changes to put back: no diff needed.
        let mut pf = planfile();
        pf.plan.rootfs_method = None;
        let mut f = good();
        f.rootfs_diff = false;
        assert!(accept(&pf, "cid", &app(), 1_000, &f).is_ok());
        // A lazy plan whose daemon is gone (the agent stopped serving it).
        let mut pf = planfile();
        pf.plan.lazy = true;
        check(
            pf.clone(),
            app(),
            good(),
            "no lazy-pages daemon listens in /img/criu",
        );
        let mut f = good();
        f.lazy_daemon = true;
        assert!(accept(&pf, "cid", &app(), 1_000, &f).unwrap().lazy);
        // Its work dir on the run directory, as the agent writes it now.
        pf.plan.work_dir = Some("/run/stasis/lazy/u1/app".into());
        check(
            pf,
            app(),
            good(),
            "no lazy-pages daemon listens in /run/stasis/lazy/u1/app",
        );
    }

    #[test]
    fn restore_command_line_keeps_globals_and_shim_paths() {
        let (i, c) = inv(SHIM);
        let a = restore_args(&i, &c, "cid", &planfile().plan, Path::new("/W"));
        let s: Vec<_> = a.iter().map(|x| x.to_str().unwrap()).collect();
        assert_eq!(
            s.join(" "),
            "--root /R --log /L --log-format json restore --detach --image-path /img/criu --work-path /W --bundle /B --pid-file /P --file-locks --tcp-established cid"
        );
        let (i, c) = inv("--root=/R --systemd-cgroup create -b /B --console-socket /S --no-pivot --pid-file=/P cid");
        let mut plan = planfile().plan;
        plan.tcp_established = false;
        let a = restore_args(&i, &c, "cid", &plan, Path::new("/W"));
        let s: Vec<_> = a.iter().map(|x| x.to_str().unwrap()).collect();
        assert_eq!(
            s.join(" "),
            "--root=/R --systemd-cgroup restore --detach --image-path /img/criu --work-path /W --bundle /B --pid-file /P --console-socket /S --no-pivot --file-locks cid"
        );
        // A lazy plan: the memory comes from the agent's daemon in the work dir.
        plan.lazy = true;
        let a = restore_args(&i, &c, "cid", &plan, Path::new("/img/criu"));
        let s: Vec<_> = a.iter().map(|x| x.to_str().unwrap()).collect();
        assert!(
            s.join(" ").ends_with("--work-path /img/criu --bundle /B --pid-file /P --console-socket /S --no-pivot --file-locks --lazy-pages cid"),
            "{s:?}"
        );
        let d = delete_args(&i, "cid");
        assert_eq!(
            d,
            ["--root=/R", "--systemd-cgroup", "delete", "--force", "cid"].map(OsString::from)
        );
    }
}
