use super::*;

fn failed(detail: &str) -> EngineError {
    EngineError::ToolFailed {
        what: "runc restore c".into(),
        detail: detail.into(),
        log: None,
    }
}

#[test]
fn a_failed_restore_names_its_cause() {
    let cg =
        "(00.2) Error (criu/cgroup.c:2055): cg: cgroupd: recv req error: No such file or directory";
    // CRIU itself killed under a limit: only its lost helper is left in the log.
    let e = name_cause(failed(cg), Some(16 << 20)).to_string();
    assert!(e.contains("memory limit of 16.0 MiB"), "{e}");
    let e = name_cause(
        failed(&format!(
            "(00.1) Error (criu/cr-restore.c:1269): 7 killed by signal 9: Killed | {cg}"
        )),
        Some(16 << 20),
    )
    .to_string();
    assert!(e.contains("SIGKILL"), "{e}");
    // Without a limit there is no memory to blame.
    assert!(!name_cause(failed(cg), None).to_string().contains("memory"));
    // The binary is not in the rootfs (cgroupd's line follows every failure).
    let e = name_cause(
        failed(&format!("1: Error (criu/files-reg.c:2267): Can't open file stasis-counter: No such file or directory | {cg}")),
        Some(16 << 20),
    )
    .to_string();
    assert!(
        e.contains("missing from the bundle's rootfs") && !e.contains("memory"),
        "{e}"
    );
    let other = "(00.1) Error (criu/sk-inet.c:1): something else";
    assert_eq!(
        name_cause(failed(other), Some(1)).to_string(),
        failed(other).to_string()
    );
}
