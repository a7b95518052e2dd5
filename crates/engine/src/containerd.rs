//! The `stasis` runtime handler in containerd's configuration: whether a node's containerd runs
//! stasis's runtime wrapper for pods of the RuntimeClass. One check for the node agent's ready
//! label and for `stasis doctor`, read as TOML so comments, quoting and layout do not matter.

use std::path::{Path, PathBuf};

/// Where the node installer puts the runtime wrapper.
pub const DEFAULT_RUNTIME_BINARY: &str = "/opt/stasis/bin/stasis-runc";
/// containerd's main configuration and the drop-in directory the node installer writes to.
pub const DEFAULT_CONFIGS: [&str; 2] = ["/etc/containerd/config.toml", "/etc/containerd/conf.d"];

/// The runtime handler the RuntimeClass names.
pub const HANDLER: &str = "stasis";
/// The shim that runs a runc-compatible binary named by `options.BinaryName`: with any other
/// `runtime_type` (or none) containerd decodes the options for another shim and ignores
/// `BinaryName`, so the pods would run without stasis's wrapper.
pub const RUNC_SHIM: &str = "io.containerd.runc.v2";
/// The CRI plugin that holds the runtimes in a version 2 configuration (containerd 1.x; 2.x
/// migrates such a file when it loads it).
pub const CRI_PLUGIN_V2: &str = "io.containerd.grpc.v1.cri";
/// ... and in a version 3 configuration (containerd 2.x, which migrates no version 3 file).
pub const CRI_PLUGIN_V3: &str = "io.containerd.cri.v1.runtime";

/// Why one containerd configuration file does not register the runtime handler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    #[error("not valid TOML (containerd would not start with it): {0}")]
    Toml(String),
    #[error("no table [{}]", expected.join("] or ["))]
    Missing { expected: Vec<String> },
    #[error("[{found}] is in a version 3 configuration, where containerd 2.x reads runtimes only from [{expected}]")]
    WrongPlugin { found: String, expected: String },
    #[error("[{table}] has {found}, not runtime_type = \"{RUNC_SHIM}\" (only the runc shim runs BinaryName)")]
    RuntimeType { table: String, found: String },
    #[error("[{table}.options] has {found}, not BinaryName = \"{expected}\" (containerd would run that instead of stasis's runtime wrapper)")]
    BinaryName {
        table: String,
        found: String,
        expected: String,
    },
}

/// The TOML key of the handler's table under `plugin`.
fn runtime_table(plugin: &str) -> String {
    format!("plugins.\"{plugin}\".containerd.runtimes.{HANDLER}")
}

/// `key = "value"` as found, or that `key` is missing.
fn found(key: &str, value: Option<&toml::Value>) -> String {
    value.map_or_else(|| format!("no {key}"), |v| format!("{key} = {v}"))
}

/// Whether one containerd configuration file (its text) registers the runtime handler `stasis`
/// so that containerd runs `runtime_binary` for it; `Ok` names the table.
///
/// Parsed as TOML, so comments, quoting and table layout do not matter: a table given only by
/// its `options` subtable exists too (TOML implies the parent), and then lacks `runtime_type`.
/// The table must be under the CRI plugin of the file's `version`: version 3 (containerd 2.x)
/// [`CRI_PLUGIN_V3`]; version 2 (containerd 1.x, migrated by 2.x) or none (a drop-in, read at
/// the version of the file that imports it) either plugin, [`CRI_PLUGIN_V2`] first. It needs
/// `runtime_type = "io.containerd.runc.v2"` and `options.BinaryName = <runtime_binary>`.
pub fn registers_handler(config: &str, runtime_binary: &Path) -> Result<String, HandlerError> {
    let doc: toml::Table = config
        .parse()
        .map_err(|e: toml::de::Error| HandlerError::Toml(e.message().to_owned()))?;
    let runtime = |plugin: &str| {
        doc.get("plugins")?
            .get(plugin)?
            .get("containerd")?
            .get("runtimes")?
            .get(HANDLER)
    };
    let version3 = doc
        .get("version")
        .and_then(toml::Value::as_integer)
        .is_some_and(|v| v >= 3);
    let plugins: &[&str] = if version3 {
        &[CRI_PLUGIN_V3]
    } else {
        &[CRI_PLUGIN_V2, CRI_PLUGIN_V3]
    };
    let Some((plugin, t)) = plugins.iter().find_map(|p| runtime(p).map(|t| (*p, t))) else {
        return Err(match runtime(CRI_PLUGIN_V2) {
            Some(_) => HandlerError::WrongPlugin {
                found: runtime_table(CRI_PLUGIN_V2),
                expected: runtime_table(CRI_PLUGIN_V3),
            },
            None => HandlerError::Missing {
                expected: plugins.iter().map(|p| runtime_table(p)).collect(),
            },
        });
    };
    let table = runtime_table(plugin);
    let runtime_type = t.get("runtime_type");
    if runtime_type.and_then(toml::Value::as_str) != Some(RUNC_SHIM) {
        return Err(HandlerError::RuntimeType {
            found: found("runtime_type", runtime_type),
            table,
        });
    }
    let binary = t.get("options").and_then(|o| o.get("BinaryName"));
    if binary.and_then(toml::Value::as_str).map(Path::new) != Some(runtime_binary) {
        return Err(HandlerError::BinaryName {
            found: found("BinaryName", binary),
            expected: runtime_binary.display().to_string(),
            table,
        });
    }
    Ok(format!("[{table}]"))
}

/// The configuration files among `paths`: files as given, and the `*.toml` files of directories
/// of drop-ins (what containerd's `imports = ["<dir>/*.toml"]` loads), in name order.
fn config_files(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut dropins: Vec<PathBuf> = std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|f| f.extension().is_some_and(|x| x == "toml") && f.is_file())
                .collect();
            dropins.sort();
            files.extend(dropins);
        } else if p.exists() {
            files.push(p.clone());
        }
    }
    files
}

/// Looks for the handler in containerd config files or directories of drop-ins; the error says,
/// per file, what is missing.
pub fn handler_check(paths: &[PathBuf], runtime_binary: &Path) -> Result<String, String> {
    if !runtime_binary.exists() {
        return Err(format!("{} is not installed", runtime_binary.display()));
    }
    let mut why = Vec::new();
    for f in config_files(paths) {
        let verdict = std::fs::read_to_string(&f)
            .map_err(|e| e.to_string())
            .and_then(|t| registers_handler(&t, runtime_binary).map_err(|e| e.to_string()));
        match verdict {
            Ok(table) => {
                return Ok(format!(
                    "runtime handler {HANDLER} registered in {} ({table})",
                    f.display()
                ))
            }
            Err(e) => why.push(format!("{}: {e}", f.display())),
        }
    }
    let paths = paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Err(if why.is_empty() {
        format!("no containerd configuration found at {paths}")
    } else {
        format!(
            "no containerd configuration among {paths} registers the runtime handler {HANDLER}: {}",
            why.join("; ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIN: &str = "/opt/stasis/bin/stasis-runc";

    fn check(config: &str) -> Result<String, HandlerError> {
        registers_handler(config, Path::new(BIN))
    }

    /// What the node installer writes, for containerd 1.x (version 2) and 2.x (version 3).
    fn dropin(version: u8, plugin: &str) -> String {
        format!(
            "version = {version}\n\
             [plugins.'{plugin}'.containerd.runtimes.stasis]\n  \
               runtime_type = \"io.containerd.runc.v2\"\n  \
               pod_annotations = [\"stasis.dev/*\"]\n  \
               [plugins.'{plugin}'.containerd.runtimes.stasis.options]\n    \
                 BinaryName = \"{BIN}\"\n    SystemdCgroup = false\n"
        )
    }

    #[test]
    fn the_installers_dropins_register_the_handler() {
        assert_eq!(
            check(&dropin(2, CRI_PLUGIN_V2)).unwrap(),
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.stasis]"
        );
        assert_eq!(
            check(&dropin(3, CRI_PLUGIN_V3)).unwrap(),
            "[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.stasis]"
        );
        // Any TOML spelling of the same tables: dotted keys, inline tables, quoted names.
        let inline = format!(
            "version = 3\n[plugins]\n\"io.containerd.cri.v1.runtime\".containerd.runtimes.\"stasis\" = \
             {{ runtime_type = \"io.containerd.runc.v2\", options = {{ BinaryName = \"{BIN}\" }} }}\n"
        );
        assert!(check(&inline).is_ok(), "{:?}", check(&inline));
        // A drop-in without `version` is read at its importer's version: either plugin.
        for plugin in [CRI_PLUGIN_V2, CRI_PLUGIN_V3] {
            let unversioned = dropin(2, plugin).replace("version = 2\n", "");
            assert!(
                check(&unversioned).is_ok(),
                "{plugin}: {:?}",
                check(&unversioned)
            );
        }
        // Version 2 with the 2.x plugin: containerd 2.x merges the migrated runtimes into it.
        assert!(check(&dropin(2, CRI_PLUGIN_V3)).is_ok());
    }

    #[test]
    fn a_version_3_file_needs_the_2x_plugin() {
        let e = check(&dropin(3, CRI_PLUGIN_V2)).unwrap_err();
        assert!(matches!(e, HandlerError::WrongPlugin { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.stasis]"),
            "names the table to use: {e}"
        );
    }

    #[test]
    fn an_options_table_alone_has_no_runtime_type() {
        // TOML implies [..runtimes.stasis] from its subtable: the handler exists, but without
        // runtime_type containerd ignores BinaryName and runs plain runc.
        let c = format!(
            "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.stasis.options]\n\
             BinaryName = \"{BIN}\"\n"
        );
        let e = check(&c).unwrap_err();
        assert_eq!(
            e,
            HandlerError::RuntimeType {
                table: runtime_table(CRI_PLUGIN_V3),
                found: "no runtime_type".into()
            }
        );
        assert!(
            e.to_string()
                .contains("has no runtime_type, not runtime_type = \"io.containerd.runc.v2\""),
            "{e}"
        );
    }

    #[test]
    fn a_commented_out_table_is_not_there() {
        // (a line that looks like the table inside a multi-line string is text, too)
        let c = "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n\
             runtime_type = \"io.containerd.runc.v2\"\n\
             # [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.stasis]\n\
             #   runtime_type = \"io.containerd.runc.v2\"\n\
             x = \"runtimes.stasis]\" # runtimes.stasis]\n\
             y = \"\"\"\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.stasis]\n\"\"\"\n";
        let e = check(c).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no table [plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.stasis]"
        );
        // Unversioned: both tables are named.
        assert_eq!(
            check("").unwrap_err().to_string(),
            "no table [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.stasis] or \
             [plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.stasis]"
        );
    }

    #[test]
    fn a_wrong_runtime_type_or_binary_is_named() {
        let wrong_type =
            dropin(3, CRI_PLUGIN_V3).replace("io.containerd.runc.v2", "io.containerd.kata.v2");
        let e = check(&wrong_type).unwrap_err().to_string();
        assert!(e.contains("has runtime_type = \"io.containerd.kata.v2\", not runtime_type = \"io.containerd.runc.v2\""), "{e}");
        let wrong_bin = dropin(2, CRI_PLUGIN_V2).replace(BIN, "/usr/bin/runc");
        let e = check(&wrong_bin).unwrap_err().to_string();
        assert_eq!(
            e,
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.stasis.options] has \
             BinaryName = \"/usr/bin/runc\", not BinaryName = \"/opt/stasis/bin/stasis-runc\" \
             (containerd would run that instead of stasis's runtime wrapper)"
        );
        let no_bin = dropin(3, CRI_PLUGIN_V3).replace(&format!("BinaryName = \"{BIN}\""), "");
        assert!(check(&no_bin)
            .unwrap_err()
            .to_string()
            .contains("has no BinaryName"));
        let e = check("[plugins\n").unwrap_err();
        assert!(matches!(e, HandlerError::Toml(_)), "{e:?}");
    }

    #[test]
    fn handler_check_reads_drop_ins() {
        let t = tempfile::tempdir().unwrap();
        let bin = t.path().join("stasis-runc");
        let conf = t.path().join("conf.d");
        std::fs::create_dir(&conf).unwrap();
        assert!(handler_check(std::slice::from_ref(&conf), &bin)
            .unwrap_err()
            .contains("not installed"));
        std::fs::write(&bin, "").unwrap();
        assert_eq!(
            handler_check(std::slice::from_ref(&conf), &bin).unwrap_err(),
            format!("no containerd configuration found at {}", conf.display())
        );
        let registers = dropin(3, CRI_PLUGIN_V3).replace(BIN, &bin.display().to_string());
        // Not a drop-in containerd imports: only *.toml counts.
        std::fs::write(conf.join("90-stasis.toml.bak"), &registers).unwrap();
        std::fs::write(conf.join("10-other.toml"), "version = 3\n").unwrap();
        let e = handler_check(std::slice::from_ref(&conf), &bin).unwrap_err();
        assert!(
            e.contains("registers the runtime handler stasis: ")
                && e.contains("10-other.toml: no table [plugins.\"io.containerd.cri.v1.runtime\"")
                && !e.contains(".bak"),
            "{e}"
        );
        std::fs::write(conf.join("90-stasis.toml"), &registers).unwrap();
        let ok = handler_check(&[t.path().join("absent.toml"), conf.clone()], &bin).unwrap();
        assert!(ok.contains("90-stasis.toml ([plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.stasis])"), "{ok}");
    }
}
