//! The process tree under a pid, read from /proc.

use std::collections::HashMap;

use stasis_core::manifest::ProcessInfo;

/// Parses `/proc/<pid>/stat` into (ppid, comm). The command name is in parentheses and may itself
/// contain spaces and parentheses, so the fields after it are found from the last `)`.
pub fn parse_stat(stat: &str) -> Option<(i32, String)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let mut rest = stat.get(close + 2..)?.split(' ');
    let _state = rest.next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some((ppid, comm))
}

/// Whether a process exists (a zombie counts as gone).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let close = s.rfind(')')?;
            s.get(close + 2..close + 3).map(|st| st != "Z" && st != "X")
        })
        .unwrap_or(false)
}

/// The parent of `pid` when `pid` is a zombie (it exited and its parent has not reaped it).
pub fn zombie_parent(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = s.rfind(')')?;
    let mut rest = s.get(close + 2..)?.split(' ');
    (rest.next()? == "Z").then(|| rest.next()?.parse().ok())?
}

/// The process `root` and all its descendants, root first, then in pid order.
pub fn tree(root: i32) -> Vec<ProcessInfo> {
    let mut all: HashMap<i32, (i32, String)> = HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Some(v) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| parse_stat(&s))
            {
                all.insert(pid, v);
            }
        }
    }
    let Some((ppid, comm)) = all.get(&root).cloned() else {
        return Vec::new();
    };
    let mut out = vec![ProcessInfo {
        pid: root,
        ppid,
        command: comm,
    }];
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        let mut kids: Vec<i32> = all
            .iter()
            .filter(|(_, (pp, _))| *pp == p)
            .map(|(k, _)| *k)
            .collect();
        kids.sort_unstable();
        for k in kids {
            out.push(ProcessInfo {
                pid: k,
                ppid: p,
                command: all[&k].1.clone(),
            });
            frontier.push(k);
        }
    }
    out[1..].sort_by_key(|p| p.pid);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_command_names() {
        assert_eq!(
            parse_stat("42 (a) b) c) S 7 42 42 0 -1"),
            Some((7, "a) b) c".to_owned()))
        );
        assert_eq!(parse_stat("1 (init) S 0 1 1"), Some((0, "init".to_owned())));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_zombie_names_the_parent_that_did_not_reap_it() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while zombie_parent(pid).is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "{pid} never became a zombie"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(zombie_parent(pid), Some(std::process::id() as i32));
        assert!(!alive(pid));
        child.wait().unwrap();
        assert_eq!(zombie_parent(std::process::id() as i32), None);
    }

    #[test]
    fn own_tree_contains_self() {
        let me = std::process::id() as i32;
        let t = tree(me);
        assert_eq!(t[0].pid, me);
        assert!(alive(me));
        assert!(!alive(i32::MAX));
    }
}
