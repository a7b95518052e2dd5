//! Init containers of a restored pod that already ran before its checkpoint: they must succeed
//! without running their command again (it would redo its work against the restored state).
//!
//! The wrapper cannot count on anything in the container's image (distroless images have no
//! shell and no `/bin/true`), so stasis brings its own: a static ELF executable of a few dozen
//! bytes that calls `exit_group(0)`, written beside `stasis-runc` (a directory the node executes
//! from; `/run` is often `noexec`) and bind-mounted read-only into the container as its only
//! command. Everything else of the container stays as the kubelet asked (user, namespaces,
//! cgroup, mounts), so it starts and ends like any container that exits 0 at once.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// Where the program appears in the container.
pub const DESTINATION: &str = "/.stasis-exit0";

/// The file name beside the wrapper's executable.
pub const FILE_NAME: &str = "stasis-exit0";

/// The machine code of `exit_group(0)` for this architecture, and the ELF machine number.
#[cfg(target_arch = "x86_64")]
const CODE: (&[u8], u16) = (
    // xor edi, edi; mov eax, 231 (exit_group); syscall
    &[0x31, 0xff, 0xb8, 0xe7, 0x00, 0x00, 0x00, 0x0f, 0x05],
    0x3e,
);
#[cfg(target_arch = "aarch64")]
const CODE: (&[u8], u16) = (
    // mov x0, #0; mov x8, #94 (exit_group); svc #0
    &[
        0x00, 0x00, 0x80, 0xd2, 0xc8, 0x0b, 0x80, 0xd2, 0x01, 0x00, 0x00, 0xd4,
    ],
    0xb7,
);

/// A static ELF64 executable: the header, one loadable segment (the whole file, read and
/// execute), then the code. No libc, no interpreter, no sections.
pub fn program() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    let (code, machine) = CODE;
    let size = HEADERS + code.len() as u64;
    let mut b = Vec::with_capacity(size as usize);
    // e_ident: magic, 64-bit, little-endian, version 1, System V ABI, padding.
    b.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    b.extend_from_slice(&2u16.to_le_bytes()); // e_type: executable
    b.extend_from_slice(&machine.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes()); // e_version
    b.extend_from_slice(&(BASE + HEADERS).to_le_bytes()); // e_entry
    b.extend_from_slice(&64u64.to_le_bytes()); // e_phoff
    b.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    b.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    b.extend_from_slice(&64u16.to_le_bytes()); // e_ehsize
    b.extend_from_slice(&56u16.to_le_bytes()); // e_phentsize
    b.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    b.extend_from_slice(&[0; 6]); // e_shentsize, e_shnum, e_shstrndx
    b.extend_from_slice(&1u32.to_le_bytes()); // p_type: PT_LOAD
    b.extend_from_slice(&5u32.to_le_bytes()); // p_flags: read + execute
    b.extend_from_slice(&0u64.to_le_bytes()); // p_offset
    b.extend_from_slice(&BASE.to_le_bytes()); // p_vaddr
    b.extend_from_slice(&BASE.to_le_bytes()); // p_paddr
    b.extend_from_slice(&size.to_le_bytes()); // p_filesz
    b.extend_from_slice(&size.to_le_bytes()); // p_memsz
    b.extend_from_slice(&0x1000u64.to_le_bytes()); // p_align
    b.extend_from_slice(code);
    b
}

/// Writes the program into `dir` unless it is there already, byte for byte: root's, mode 0755,
/// by a temporary file and a rename (a concurrent `create` sees the old file or the new one).
pub fn install(dir: &Path) -> std::io::Result<PathBuf> {
    let path = dir.join(FILE_NAME);
    let want = program();
    if let Ok(md) = std::fs::symlink_metadata(&path) {
        if md.is_file()
            && md.permissions().mode() & 0o7777 == 0o755
            && std::fs::read(&path).is_ok_and(|have| have == want)
        {
            return Ok(path);
        }
    }
    let tmp = dir.join(format!(".{FILE_NAME}.tmp-{}", std::process::id()));
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o755)
            .open(&tmp)?;
        f.write_all(&want)?;
        f.set_permissions(std::fs::Permissions::from_mode(0o755))?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r.map(|()| path)
}

/// The directory of the wrapper's own executable (where [`install`] puts the program).
pub fn beside_wrapper() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    exe.parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| std::io::Error::other("the wrapper's executable has no directory"))
}

/// Turns an OCI config into one that runs the program at `program` (a host path) and nothing
/// else: its arguments become [`DESTINATION`], a read-only bind mount puts the program there.
pub fn rewrite(config: &mut Value, program: &Path) -> Result<(), String> {
    let process = config
        .get_mut("process")
        .and_then(Value::as_object_mut)
        .ok_or("config.json has no process")?;
    process.insert("args".into(), json!([DESTINATION]));
    // No terminal to wait for: the command ends at once.
    process.insert("terminal".into(), json!(false));
    let mounts = config
        .as_object_mut()
        .ok_or("config.json is not an object")?
        .entry("mounts")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or("config.json's mounts are not a list")?;
    mounts.push(json!({
        "destination": DESTINATION,
        "type": "bind",
        "source": program,
        "options": ["rbind", "ro", "nosuid", "nodev"],
    }));
    Ok(())
}

/// [`rewrite`] of the bundle's `config.json` in place (temporary file and rename).
pub fn rewrite_bundle(bundle: &Path, program: &Path) -> Result<(), String> {
    let path = bundle.join("config.json");
    let raw = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut config: Value =
        serde_json::from_slice(&raw).map_err(|e| format!("{}: {e}", path.display()))?;
    rewrite(&mut config, program)?;
    let tmp = bundle.join(".config.json.stasis-skip");
    std::fs::write(
        &tmp,
        serde_json::to_vec(&config).map_err(|e| e.to_string())?,
    )
    .and_then(|()| std::fs::rename(&tmp, &path))
    .map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The program runs on this machine and exits 0, without any library.
    #[test]
    fn the_program_exits_zero() {
        let t = tempfile::tempdir().unwrap();
        let p = install(t.path()).unwrap();
        assert!(program().len() < 160);
        let st = std::process::Command::new(&p).status().unwrap();
        assert_eq!(st.code(), Some(0));
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
            0o755
        );
        // A changed file is replaced; an intact one is left alone.
        std::fs::write(&p, b"#!/bin/sh\nexit 3\n").unwrap();
        install(t.path()).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), program());
        assert_eq!(
            std::process::Command::new(&p).status().unwrap().code(),
            Some(0)
        );
    }

    #[test]
    fn the_config_runs_the_program_and_nothing_else() {
        let mut c = json!({
            "process": {"args": ["sh", "-c", "echo again >> /data/log"], "user": {"uid": 1000},
                        "terminal": true, "cwd": "/work"},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "root": {"path": "rootfs", "readonly": true},
        });
        rewrite(&mut c, Path::new("/opt/stasis/bin/stasis-exit0")).unwrap();
        assert_eq!(c["process"]["args"], json!([DESTINATION]));
        assert_eq!(c["process"]["terminal"], json!(false));
        // The rest as the kubelet asked.
        assert_eq!(c["process"]["user"]["uid"], 1000);
        assert_eq!(c["process"]["cwd"], "/work");
        assert_eq!(c["root"]["readonly"], true);
        let m = c["mounts"].as_array().unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[1]["destination"], DESTINATION);
        assert_eq!(m[1]["source"], "/opt/stasis/bin/stasis-exit0");
        assert!(m[1]["options"].as_array().unwrap().contains(&json!("ro")));
        assert!(rewrite(&mut json!({}), Path::new("/x")).is_err());
        let mut no_mounts = json!({"process": {"args": ["x"]}});
        rewrite(&mut no_mounts, Path::new("/x")).unwrap();
        assert_eq!(no_mounts["mounts"].as_array().unwrap().len(), 1);
    }
}
