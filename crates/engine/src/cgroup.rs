//! Moving a process into the cgroups of this one.
//!
//! A process outlives the container it was started in only outside that container's cgroups:
//! when a container ends, its runtime kills every process left in them (`runc kill --all`,
//! systemd stopping the scope). A lazy restore's `criu lazy-pages` daemon and its watchdog are
//! started by the node agent, in the agent's container, and must outlive the agent: the
//! wrapper that restores the container moves them into its own cgroups
//! ([`crate::restore::lazy::adopt_helpers`]).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The directories of the cgroups a process is in, one per hierarchy, from its
/// `/proc/<pid>/cgroup` and the `/proc/self/mountinfo` of the caller: cgroup v1 hierarchies
/// (named ones included) and the unified one. A hierarchy not mounted here, or mounted below
/// the process's cgroup, is left out.
pub fn cgroup_dirs(proc_cgroup: &str, mountinfo: &str) -> Vec<PathBuf> {
    // Each cgroup mount: (filesystem, its super options, the cgroup mounted, where).
    let mounts: Vec<(&str, Vec<&str>, &str, &str)> = mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            let (fstype, opts, root, point) = (*r.first()?, *r.get(2)?, *f.get(3)?, *f.get(4)?);
            matches!(fstype, "cgroup" | "cgroup2")
                .then(|| (fstype, opts.split(',').collect(), root, point))
        })
        .collect();
    let mut dirs = Vec::new();
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let wanted: Vec<&str> = controllers.split(',').filter(|c| !c.is_empty()).collect();
        let mount = mounts
            .iter()
            .find(|(fstype, opts, _, _)| match wanted.is_empty() {
                true => *fstype == "cgroup2",
                false => *fstype == "cgroup" && wanted.iter().all(|c| opts.contains(c)),
            });
        let Some((_, _, root, point)) = mount else {
            continue;
        };
        let Some(rel) = Path::new(path).strip_prefix(root).ok() else {
            continue;
        };
        dirs.push(
            Path::new(std::ffi::OsStr::from_bytes(&crate::mounts::unescape(point))).join(rel),
        );
    }
    dirs
}

/// The directories of the cgroups this process is in (see [`cgroup_dirs`]).
pub fn own_cgroup_dirs() -> std::io::Result<Vec<PathBuf>> {
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(cgroup_dirs(&own, &mountinfo))
}

/// Moves process `pid` (all its threads) into every cgroup this process is in. Every hierarchy
/// is tried; the error names those that refused.
pub fn move_into_own_cgroups(pid: i32) -> std::io::Result<()> {
    let dirs = own_cgroup_dirs()?;
    if dirs.is_empty() {
        return Err(std::io::Error::other(
            "no cgroup hierarchy of this process is mounted here",
        ));
    }
    let refused: Vec<String> = dirs
        .iter()
        .filter_map(|d| {
            std::fs::write(d.join("cgroup.procs"), pid.to_string())
                .err()
                .map(|e| format!("{}: {e}", d.display()))
        })
        .collect();
    match refused.is_empty() {
        true => Ok(()),
        false => Err(std::io::Error::other(refused.join("; "))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
34 33 0:29 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
35 33 0:30 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd
38 33 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct
39 33 0:34 / /sys/fs/cgroup/memory rw,nosuid shared:16 - cgroup cgroup rw,memory
40 33 0:35 / /sys/fs/cgroup/pids rw,nosuid shared:17 - cgroup cgroup rw,pids
41 33 0:36 /kubepods /mnt/odd\\040dir rw shared:18 - cgroup cgroup rw,freezer
";

    #[test]
    fn each_hierarchy_of_a_hybrid_host_maps_to_its_directory() {
        let own = "\
12:pids:/system.slice/containerd.service
10:memory:/system.slice/containerd.service
4:cpu,cpuacct:/system.slice/containerd.service
1:name=systemd:/system.slice/containerd.service
0::/system.slice/containerd.service
";
        assert_eq!(
            cgroup_dirs(own, MOUNTINFO),
            [
                "/sys/fs/cgroup/pids/system.slice/containerd.service",
                "/sys/fs/cgroup/memory/system.slice/containerd.service",
                "/sys/fs/cgroup/cpu,cpuacct/system.slice/containerd.service",
                "/sys/fs/cgroup/systemd/system.slice/containerd.service",
                "/sys/fs/cgroup/unified/system.slice/containerd.service",
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn a_hierarchy_mounted_below_the_cgroup_or_not_at_all_is_left_out() {
        // The freezer hierarchy is mounted from /kubepods (escaped name): a cgroup below it maps
        // into it, one beside it does not; `blkio` is not mounted at all.
        let own = "\
7:freezer:/kubepods/pod1
6:freezer:/system.slice
5:blkio:/
";
        assert_eq!(
            cgroup_dirs(own, MOUNTINFO),
            [PathBuf::from("/mnt/odd dir/pod1")]
        );
    }

    #[test]
    fn the_unified_hierarchy_alone() {
        let mountinfo =
            "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            cgroup_dirs("0::/kubepods.slice/x.scope\n", mountinfo),
            [PathBuf::from("/sys/fs/cgroup/kubepods.slice/x.scope")]
        );
    }
}
