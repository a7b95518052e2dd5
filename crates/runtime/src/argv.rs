//! runc's command line, as containerd's runc shim (go-runc) writes it:
//!
//! ```text
//! runc [global flags] <command> [command flags] <container-id> [more]
//! runc --root /run/containerd/runc/k8s.io --log /run/…/log.json --log-format json \
//!      [--systemd-cgroup] create --bundle B --pid-file P [--console-socket S] <id>
//! ```
//!
//! runc parses flags the Go way (urfave/cli over `flag`): `-name` and `--name` are the same,
//! a value follows as the next argument or after `=`, a boolean may be written `--name=false`,
//! `--` ends the flags, and the first non-flag argument is the command (or, after it, the first
//! positional). This parser follows those rules for the flags stasis needs and records anything
//! else as unknown; the caller passes the original arguments through untouched either way.

use std::ffi::OsString;

/// runc's global flags that take a value (runc 1.1).
const GLOBAL_VALUE_FLAGS: &[&str] = &["log", "log-format", "root", "criu", "rootless"];
/// runc's global boolean flags.
const GLOBAL_BOOL_FLAGS: &[&str] = &["debug", "systemd-cgroup", "help", "h", "version", "v"];

/// The global flags that matter here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Globals {
    pub root: Option<String>,
    pub log: Option<String>,
    pub log_format: Option<String>,
    pub systemd_cgroup: bool,
    /// Flags runc 1.1 does not define (runc itself will refuse them).
    pub unknown: Vec<String>,
}

/// `create`'s flags (runc 1.1: bundle/b, console-socket, pid-file, no-pivot, no-new-keyring,
/// preserve-fds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreateArgs {
    pub bundle: Option<String>,
    pub pid_file: Option<String>,
    pub console_socket: Option<String>,
    pub no_pivot: bool,
    pub no_new_keyring: bool,
    pub preserve_fds: Option<String>,
    pub id: Option<String>,
    /// Unknown flags and positionals after the id.
    pub unknown: Vec<String>,
}

/// `kill [--all] <id> [signal]` (runc's default signal is SIGTERM).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KillArgs {
    pub all: bool,
    pub id: Option<String>,
    pub signal: Option<String>,
    pub unknown: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Create(CreateArgs),
    Start {
        id: Option<String>,
    },
    Kill(KillArgs),
    Delete {
        id: Option<String>,
        force: bool,
    },
    /// Every other command (state, ps, events, exec, update, pause, resume, checkpoint, restore,
    /// features, run, list, spec, …): passed through.
    Other(String),
}

/// A parsed invocation; `args` are the original arguments (without argv\[0\]), verbatim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    pub args: Vec<OsString>,
    /// `args[..command_at]` are the global flags.
    pub command_at: usize,
    pub globals: Globals,
    /// `None`: no command (e.g. `runc --version`) or arguments that are not UTF-8.
    pub command: Option<Command>,
}

impl Invocation {
    /// The global flags, verbatim.
    pub fn global_args(&self) -> &[OsString] {
        &self.args[..self.command_at]
    }

    /// This invocation's `kill` with another signal: the global flags, `kill`, `--all` when it
    /// was given, the container and `signal`.
    pub fn kill_with_signal(&self, k: &KillArgs, signal: &str) -> Vec<OsString> {
        let mut args = self.global_args().to_vec();
        args.push("kill".into());
        if k.all {
            args.push("--all".into());
        }
        args.extend(k.id.iter().map(OsString::from));
        args.push(signal.into());
        args
    }
}

/// One token: `Flag { name, value }` for `-n`, `--n`, `--n=v`; `EndOfFlags` for `--`.
enum Token<'a> {
    Flag(&'a str, Option<&'a str>),
    EndOfFlags,
    Positional(&'a str),
}

fn token(s: &str) -> Token<'_> {
    if s == "--" {
        return Token::EndOfFlags;
    }
    if s.len() < 2 || !s.starts_with('-') {
        return Token::Positional(s);
    }
    let body = s.strip_prefix("--").unwrap_or(&s[1..]);
    match body.split_once('=') {
        Some((n, v)) => Token::Flag(n, Some(v)),
        None => Token::Flag(body, None),
    }
}

/// A Go boolean flag's value: `--x` is true, `--x=false` false.
fn go_bool(v: Option<&str>) -> bool {
    !matches!(v, Some("false" | "0" | "f" | "F" | "FALSE" | "False"))
}

/// One argument of a command, as [`walk`] sees it.
enum Arg<'a> {
    Flag(&'a str, Option<&'a str>),
    Pos(&'a str),
}

/// Walks a command's arguments: `value_flags` consume a value, anything else starting with `-`
/// is a boolean flag.
fn walk<'a>(args: &[&'a str], value_flags: &[&str], mut f: impl FnMut(Arg<'a>)) {
    let mut i = 0;
    let mut flags_done = false;
    while i < args.len() {
        let a = args[i];
        i += 1;
        if flags_done {
            f(Arg::Pos(a));
            continue;
        }
        match token(a) {
            Token::EndOfFlags => flags_done = true,
            Token::Positional(p) => f(Arg::Pos(p)),
            Token::Flag(n, Some(v)) => f(Arg::Flag(n, Some(v))),
            Token::Flag(n, None) if value_flags.contains(&n) => {
                let v = args.get(i).copied();
                i += usize::from(v.is_some());
                f(Arg::Flag(n, v));
            }
            Token::Flag(n, None) => f(Arg::Flag(n, None)),
        }
    }
}

/// Parses runc's arguments (without argv\[0\]).
pub fn parse(args: Vec<OsString>) -> Invocation {
    let strs: Option<Vec<&str>> = args.iter().map(|a| a.to_str()).collect();
    let Some(strs) = strs else {
        // Not UTF-8: nothing stasis would act on. Pass through.
        let n = args.len();
        return Invocation {
            args,
            command_at: n,
            globals: Globals::default(),
            command: None,
        };
    };
    let mut g = Globals::default();
    let mut i = 0;
    let mut command_at = strs.len();
    while i < strs.len() {
        match token(strs[i]) {
            Token::EndOfFlags => {
                i += 1;
                command_at = i.min(strs.len());
                break;
            }
            Token::Positional(_) => {
                command_at = i;
                break;
            }
            Token::Flag(n, v) => {
                i += 1;
                let v = if v.is_none() && GLOBAL_VALUE_FLAGS.contains(&n) {
                    let v = strs.get(i).copied();
                    i += usize::from(v.is_some());
                    v
                } else {
                    v
                };
                match n {
                    "root" => g.root = v.map(str::to_owned),
                    "log" => g.log = v.map(str::to_owned),
                    "log-format" => g.log_format = v.map(str::to_owned),
                    "systemd-cgroup" => g.systemd_cgroup = go_bool(v),
                    n if GLOBAL_VALUE_FLAGS.contains(&n) || GLOBAL_BOOL_FLAGS.contains(&n) => {}
                    _ => g.unknown.push(strs[i - 1].to_owned()),
                }
            }
        }
    }
    let command = strs
        .get(command_at)
        .map(|name| parse_command(name, &strs[command_at + 1..]));
    let command_at = command_at.min(args.len());
    Invocation {
        args,
        command_at,
        globals: g,
        command,
    }
}

fn parse_command(name: &str, rest: &[&str]) -> Command {
    match name {
        "create" => {
            let mut c = CreateArgs::default();
            walk(
                rest,
                &["bundle", "b", "console-socket", "pid-file", "preserve-fds"],
                |a| match a {
                    Arg::Flag("bundle" | "b", v) => c.bundle = v.map(str::to_owned),
                    Arg::Flag("pid-file", v) => c.pid_file = v.map(str::to_owned),
                    Arg::Flag("console-socket", v) => c.console_socket = v.map(str::to_owned),
                    Arg::Flag("preserve-fds", v) => c.preserve_fds = v.map(str::to_owned),
                    Arg::Flag("no-pivot", v) => c.no_pivot = go_bool(v),
                    Arg::Flag("no-new-keyring", v) => c.no_new_keyring = go_bool(v),
                    Arg::Flag(n, _) => c.unknown.push(format!("-{n}")),
                    Arg::Pos(p) if c.id.is_none() => c.id = Some(p.to_owned()),
                    Arg::Pos(p) => c.unknown.push(p.to_owned()),
                },
            );
            Command::Create(c)
        }
        "start" => Command::Start {
            id: first_positional(rest),
        },
        "delete" => {
            let (mut force, mut id) = (false, None);
            walk(rest, &[], |a| match a {
                Arg::Flag("force" | "f", v) => force = go_bool(v),
                Arg::Flag(..) => {}
                Arg::Pos(p) => {
                    id.get_or_insert_with(|| p.to_owned());
                }
            });
            Command::Delete { id, force }
        }
        "kill" => {
            let mut k = KillArgs::default();
            let mut pos: Vec<&str> = Vec::new();
            walk(rest, &[], |a| match a {
                Arg::Flag("all" | "a", v) => k.all = go_bool(v),
                Arg::Flag(n, _) => k.unknown.push(format!("-{n}")),
                Arg::Pos(p) => pos.push(p),
            });
            k.id = pos.first().map(|s| (*s).to_owned());
            k.signal = pos.get(1).map(|s| (*s).to_owned());
            k.unknown
                .extend(pos.iter().skip(2).map(|s| (*s).to_owned()));
            Command::Kill(k)
        }
        other => Command::Other(other.to_owned()),
    }
}

fn first_positional(rest: &[&str]) -> Option<String> {
    let mut id = None;
    walk(rest, &[], |a| {
        if let Arg::Pos(p) = a {
            id.get_or_insert_with(|| p.to_owned());
        }
    });
    id
}

/// Whether a runc signal argument means SIGTERM (`15`, `TERM`, `SIGTERM`, any case); runc's
/// `kill` defaults to SIGTERM when none is given.
pub fn is_sigterm(signal: Option<&str>) -> bool {
    let Some(s) = signal else { return true };
    if let Ok(n) = s.parse::<i32>() {
        return n == 15;
    }
    let u = s.to_ascii_uppercase();
    u.strip_prefix("SIG").unwrap_or(&u) == "TERM"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Invocation {
        parse(s.split_whitespace().map(OsString::from).collect())
    }

    #[test]
    fn the_shims_create_from_design_section_2() {
        let inv = p("--root /run/containerd/runc/k8s.io --log /run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/log.json --log-format json create --bundle /run/containerd/io.containerd.runtime.v2.task/k8s.io/abc --pid-file /run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/init.pid abc");
        assert_eq!(inv.command_at, 6);
        assert_eq!(
            inv.globals,
            Globals {
                root: Some("/run/containerd/runc/k8s.io".into()),
                log: Some(
                    "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/log.json".into()
                ),
                log_format: Some("json".into()),
                systemd_cgroup: false,
                unknown: vec![],
            }
        );
        assert_eq!(
            inv.command,
            Some(Command::Create(CreateArgs {
                bundle: Some("/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc".into()),
                pid_file: Some(
                    "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/init.pid".into()
                ),
                id: Some("abc".into()),
                ..Default::default()
            }))
        );
        assert_eq!(inv.global_args().len(), 6);
    }

    #[test]
    fn equals_forms_single_dashes_systemd_and_console() {
        let inv = p("-root=/r --log=/l.json -log-format=json --systemd-cgroup create -b /b --pid-file=/p --console-socket /s --no-pivot id1");
        assert_eq!(inv.command_at, 4);
        assert_eq!(inv.globals.root.as_deref(), Some("/r"));
        assert_eq!(inv.globals.log.as_deref(), Some("/l.json"));
        assert_eq!(inv.globals.log_format.as_deref(), Some("json"));
        assert!(inv.globals.systemd_cgroup);
        let Some(Command::Create(c)) = inv.command else {
            panic!()
        };
        assert_eq!(c.bundle.as_deref(), Some("/b"));
        assert_eq!(c.pid_file.as_deref(), Some("/p"));
        assert_eq!(c.console_socket.as_deref(), Some("/s"));
        assert!(c.no_pivot);
        assert_eq!(c.id.as_deref(), Some("id1"));
        assert!(c.unknown.is_empty());
        assert!(!p("--systemd-cgroup=false state x").globals.systemd_cgroup);
    }

    #[test]
    fn unknown_flags_are_recorded_not_lost() {
        let inv = p("--root /r --frobnicate create --bundle /b --detach --preserve-fds 2 id extra");
        assert_eq!(inv.globals.unknown, vec!["--frobnicate".to_owned()]);
        let Some(Command::Create(c)) = &inv.command else {
            panic!()
        };
        assert_eq!(c.preserve_fds.as_deref(), Some("2"));
        assert_eq!(c.unknown, vec!["-detach".to_owned(), "extra".to_owned()]);
        assert_eq!(c.id.as_deref(), Some("id"));
        // The original arguments are kept verbatim.
        assert_eq!(inv.args.len(), 11);
        assert_eq!(inv.args[2], "--frobnicate");
    }

    #[test]
    fn double_dash_ends_flags() {
        let inv = p("--root /r create --bundle /b -- -weird-id");
        let Some(Command::Create(c)) = inv.command else {
            panic!()
        };
        assert_eq!(c.id.as_deref(), Some("-weird-id"));
        let inv = p("--root /r -- start x");
        assert_eq!(inv.command_at, 3);
        assert_eq!(
            inv.command,
            Some(Command::Start {
                id: Some("x".into())
            })
        );
    }

    #[test]
    fn other_commands() {
        let inv = p("--root /r --log /l --log-format json kill abc 15");
        assert_eq!(
            inv.command,
            Some(Command::Kill(KillArgs {
                all: false,
                id: Some("abc".into()),
                signal: Some("15".into()),
                unknown: vec![]
            }))
        );
        let Some(Command::Kill(k)) = p("kill --all abc").command else {
            panic!()
        };
        assert!(k.all);
        assert_eq!(k.signal, None);
        assert_eq!(
            p("--root /r delete --force abc").command,
            Some(Command::Delete {
                id: Some("abc".into()),
                force: true
            })
        );
        assert_eq!(
            p("--root /r start abc").command,
            Some(Command::Start {
                id: Some("abc".into())
            })
        );
        for cmd in [
            "state",
            "ps",
            "events",
            "exec",
            "update",
            "pause",
            "resume",
            "checkpoint",
            "restore",
            "features",
        ] {
            assert_eq!(
                p(&format!("--root /r {cmd} --x y abc")).command,
                Some(Command::Other(cmd.into()))
            );
        }
        let v = p("--version");
        assert_eq!(v.command, None);
        assert_eq!(v.command_at, 1);
        assert_eq!(p("").command, None);
    }

    #[test]
    fn a_value_flag_at_the_end_does_not_panic() {
        let inv = p("--root");
        assert_eq!(inv.command, None);
        assert_eq!(inv.command_at, 1);
        let Some(Command::Create(c)) = p("create --bundle").command else {
            panic!()
        };
        assert_eq!(c.bundle, None);
        assert_eq!(c.id, None);
    }

    #[test]
    fn non_utf8_arguments_pass_through() {
        use std::os::unix::ffi::OsStringExt;
        let inv = parse(vec![
            OsString::from("create"),
            OsString::from_vec(vec![0xff, 0xfe]),
        ]);
        assert_eq!(inv.command, None);
        assert_eq!(inv.args.len(), 2);
    }

    #[test]
    fn sigterm_spellings() {
        for s in [
            None,
            Some("15"),
            Some("TERM"),
            Some("SIGTERM"),
            Some("term"),
            Some("sigterm"),
        ] {
            assert!(is_sigterm(s), "{s:?}");
        }
        for s in ["9", "KILL", "SIGKILL", "SIGUSR1", "34", "TERMX", ""] {
            assert!(!is_sigterm(Some(s)), "{s}");
        }
    }

    #[test]
    fn a_kill_is_rewritten_with_another_signal_keeping_its_globals() {
        let inv = parse(
            ["--root", "/run/runc", "kill", "--all", "abc", "TERM"]
                .into_iter()
                .map(OsString::from)
                .collect(),
        );
        let Some(Command::Kill(k)) = inv.command.clone() else {
            panic!("{:?}", inv.command)
        };
        let want: Vec<OsString> = ["--root", "/run/runc", "kill", "--all", "abc", "KILL"]
            .into_iter()
            .map(OsString::from)
            .collect();
        assert_eq!(inv.kill_with_signal(&k, "KILL"), want);
        // runc's default signal (none given) is replaced too.
        let inv = parse(["kill", "abc"].into_iter().map(OsString::from).collect());
        let Some(Command::Kill(k)) = inv.command.clone() else {
            panic!("{:?}", inv.command)
        };
        assert_eq!(
            inv.kill_with_signal(&k, "KILL"),
            ["kill", "abc", "KILL"].map(OsString::from).to_vec()
        );
    }
}
