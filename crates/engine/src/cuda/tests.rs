//! No GPU here: the driver is [`stasis_gpu::sim::SimDriver`] (it follows the driver's state
//! machine) and `/proc` is a temporary directory; the real-driver paths are checked to be
//! no-ops on this driverless machine.
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use stasis_core::gpu::GpuDevice;
use stasis_gpu::sim::SimDriver;
use stasis_gpu::Op;

use super::*;

const T: Duration = Duration::from_secs(10);

fn fake_proc(procs: &[(i32, &[&str], &str)]) -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    for (pid, fds, maps) in procs {
        let d = t.path().join(pid.to_string());
        fs::create_dir_all(d.join("fd")).unwrap();
        for (i, f) in fds.iter().enumerate() {
            symlink(f, d.join("fd").join(i.to_string())).unwrap();
        }
        fs::write(d.join("maps"), maps).unwrap();
        fs::write(d.join("comm"), "python3\n").unwrap();
    }
    t
}

fn proc_at(p: &Path) -> Procfs {
    Procfs::new(p)
}

/// [`suspend_with`] against `sim`, its GPU and the fake `/proc` at `proc`.
fn suspend_sim(
    sim: &Arc<SimDriver>,
    proc: &Path,
    pids: &[i32],
) -> Result<Option<SuspendedGpu>, CudaError> {
    suspend_with(
        sim.clone(),
        &proc_at(proc),
        Some(&sim.fingerprint()),
        &|| None,
        pids,
        T,
    )
}

#[test]
fn empty_list_or_no_gpu_process_is_none_without_a_driver() {
    // This machine has no NVIDIA driver: nothing to do, and no error.
    assert!(suspend(&[], T).unwrap().is_none());
    let me = std::process::id() as i32;
    assert!(suspend(&[me], T).unwrap().is_none());
    assert!(cuda_processes(&[me]).is_empty());
    assert_eq!(resume_restored(&[], None).unwrap(), PhaseTimings::default());
}

#[test]
fn restoring_gpu_pids_without_a_driver_is_a_clear_error() {
    if Path::new("/proc/driver/nvidia").exists() {
        return; // a GPU machine
    }
    let e = resume_restored(&[12345], None).unwrap_err();
    assert!(e.to_string().starts_with("no NVIDIA driver"), "{e}");
}

#[test]
fn doctor_says_no_nvidia_driver_here() {
    if Path::new("/proc/driver/nvidia").exists() {
        return;
    }
    assert_eq!(probe().summary(), "no NVIDIA driver");
    assert!(gpu_fingerprint().is_none());
}

#[test]
fn suspends_only_the_cuda_processes_of_the_tree() {
    let t = fake_proc(&[
        (1, &["/dev/null"], ""),
        (2, &["/dev/nvidiactl", "/dev/nvidia0"], ""),
        (3, &[], "7f-80 r-xp 0 0:0 1 /usr/lib/libcuda.so.1\n"), // libcuda, no context
        (4, &["/dev/nvidia-uvm"], ""),
    ]);
    let sim = Arc::new(SimDriver::with_processes(&[2, 4]));
    let s = suspend_sim(&sim, t.path(), &[1, 2, 3, 4]).unwrap().unwrap();
    assert_eq!(s.pids(), [2, 4]);
    assert_eq!(sim.state_of(2), Some(ProcessState::Checkpointed));
    s.resume().unwrap();
    assert_eq!(sim.state_of(2), Some(ProcessState::Running));
    assert_eq!(sim.state_of(4), Some(ProcessState::Running));
}

#[test]
fn no_cuda_context_in_the_tree_is_none() {
    let t = fake_proc(&[(3, &[], "/usr/lib/libcuda.so.1\n")]);
    let sim = Arc::new(SimDriver::default());
    assert!(suspend_sim(&sim, t.path(), &[3]).unwrap().is_none());
}

#[test]
fn device_holder_without_context_is_refused() {
    let t = fake_proc(&[(2, &["/dev/nvidia0"], ""), (5, &["/dev/nvidiactl"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[2]));
    let e = suspend_sim(&sim, t.path(), &[2, 5]).unwrap_err();
    assert!(
        e.to_string().contains("process 5 has /dev/nvidia* open"),
        "{e}"
    );
    assert!(sim.log().is_empty(), "nothing locked");
}

#[test]
fn mig_is_refused_before_locking() {
    let t = fake_proc(&[(2, &["/dev/nvidia0"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[2]));
    let fp = GpuFingerprint {
        driver_version: "580.65.06".into(),
        devices: vec![GpuDevice {
            name: "NVIDIA H200".into(),
            uuid: "GPU-x".into(),
            memory_bytes: 1,
            mig_enabled: Some(true),
        }],
        ..Default::default()
    };
    let e = suspend_with(
        sim.clone(),
        &proc_at(t.path()),
        Some(&fp),
        &|| None,
        &[2],
        T,
    )
    .unwrap_err();
    assert!(e.to_string().contains("MIG"), "{e}");
    assert!(sim.log().is_empty());
}

#[test]
fn lock_timeout_fails_the_checkpoint_and_leaves_all_running() {
    let t = fake_proc(&[(2, &["/dev/nvidia0"], ""), (3, &["/dev/nvidia0"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[2, 3]));
    sim.lock_times_out(3);
    let e = suspend_sim(&sim, t.path(), &[2, 3]).unwrap_err();
    assert_eq!(e, CudaError::LockTimeout { pid: 3, timeout: T });
    assert_eq!(sim.log(), [(Op::Lock, 2), (Op::Lock, 3), (Op::Unlock, 2)]);
    assert_eq!(sim.state_of(2), Some(ProcessState::Running));
}

#[test]
fn a_checkpoint_records_the_gpus_the_device_plugin_gave_the_workload() {
    let t = fake_proc(&[(2, &["/dev/nvidia1"], "")]);
    fs::write(
        t.path().join("2/environ"),
        b"PATH=/bin\0NVIDIA_VISIBLE_DEVICES=1\0".as_slice(),
    )
    .unwrap();
    let sim = Arc::new(SimDriver::with_processes(&[2]));
    let mut node = sim.fingerprint();
    let mut second = node.devices[0].clone();
    second.uuid = "GPU-5a5a5a5a-0000-4000-8000-000000000002".into();
    node.devices.push(second.clone());
    let s = suspend_with(
        sim.clone(),
        &proc_at(t.path()),
        Some(&node),
        &|| None,
        &[2],
        T,
    )
    .unwrap()
    .unwrap();
    assert_eq!(s.fingerprint().workload_gpus, [second.uuid.clone()]);
    s.discard();
    // The restore side reads the new container's GPUs from its bundle.
    let b = tempfile::tempdir().unwrap();
    fs::write(
        b.path().join("config.json"),
        format!(
            r#"{{"process":{{"env":["A=1","NVIDIA_VISIBLE_DEVICES={}"]}}}}"#,
            node.devices[0].uuid
        ),
    )
    .unwrap();
    let assigned = bundle_gpus(b.path(), &node).unwrap();
    assert_eq!(assigned, [node.devices[0].uuid.clone()]);
    let mut recorded = node.clone();
    recorded.workload_gpus = vec![second.uuid.clone()];
    let pairs = remap_onto(&recorded, &node, &assigned).unwrap().unwrap();
    assert_eq!(pairs[0].old.to_string(), second.uuid);
    assert_eq!(pairs[0].new.to_string(), node.devices[0].uuid);
}

#[test]
fn the_gpu_record_of_a_prepared_image_round_trips_and_is_removed_when_stale() {
    let d = tempfile::tempdir().unwrap();
    let fp = SimDriver::default().fingerprint();
    assert_eq!(read_gpu_record(d.path()).unwrap(), None);
    write_gpu_record(d.path(), Some(&fp), 2).unwrap();
    assert_eq!(
        read_gpu_record(d.path()).unwrap(),
        Some(GpuRecord {
            processes: 2,
            recorded: fp.clone()
        })
    );
    // A CPU-only checkpoint prepared into the same directory later.
    write_gpu_record(d.path(), Some(&fp), 0).unwrap();
    assert_eq!(read_gpu_record(d.path()).unwrap(), None);
    fs::write(d.path().join(GPU_RECORD_FILE), "{").unwrap();
    assert!(read_gpu_record(d.path()).is_err());
}

#[test]
fn a_restore_of_gpu_state_without_a_driver_is_refused_with_the_reason() {
    if Path::new("/proc/driver/nvidia").exists() {
        return; // a GPU machine
    }
    let fp = SimDriver::default().fingerprint();
    let e = resume_after_restore(1, 1, &fp, None).unwrap_err();
    assert!(
        e.to_string().contains("this node has no NVIDIA driver"),
        "{e}"
    );
}

#[test]
fn criu_gets_an_empty_plugin_dir_only_this_user_can_write() {
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("run/criu-no-plugins");
    empty_plugin_dir(&dir).unwrap();
    assert_eq!(
        fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    empty_plugin_dir(&dir).unwrap(); // again: it exists, still fine
    fs::write(dir.join("cuda_plugin.so"), "").unwrap();
    let e = empty_plugin_dir(&dir).unwrap_err();
    assert!(e.contains("not empty (cuda_plugin.so)"), "{e}");
    fs::remove_file(dir.join("cuda_plugin.so")).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    let e = empty_plugin_dir(&dir).unwrap_err();
    assert!(e.contains("only this user can write"), "{e}");
}

#[test]
fn the_report_counts_the_bytes_the_driver_released_and_the_blocked_time() {
    let t = fake_proc(&[(2, &["/dev/nvidia0"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[2]));
    // NVML's view: 10 GiB in use while the process holds the GPU, 1 GiB (another process)
    // once it is checkpointed.
    let used = {
        let sim = sim.clone();
        move || match sim.state_of(2) {
            Some(ProcessState::Checkpointed) => Some(1 << 30),
            _ => Some(10 << 30),
        }
    };
    let s = suspend_with(
        sim.clone(),
        &proc_at(t.path()),
        Some(&sim.fingerprint()),
        &used,
        &[2],
        T,
    )
    .unwrap()
    .unwrap();
    std::thread::sleep(Duration::from_millis(20)); // the "dump"
    let r = s.resume().unwrap();
    assert_eq!(r.processes, 1);
    assert_eq!(r.bytes_moved, Some(9 << 30));
    assert!(r.blocked_ms >= 20.0, "{r:?}");
    let json = serde_json::to_value(r).unwrap();
    for k in [
        "lock_ms",
        "checkpoint_ms",
        "restore_ms",
        "unlock_ms",
        "blocked_ms",
    ] {
        assert!(json[k].is_number(), "{k} in {json}");
    }
}

#[test]
fn cuda_processes_on_a_node_nvml_does_not_describe_are_refused() {
    let t = fake_proc(&[(2, &["/dev/nvidia0"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[2]));
    let e = suspend_with(sim.clone(), &proc_at(t.path()), None, &|| None, &[2], T).unwrap_err();
    assert!(e.to_string().contains("NVML does not describe"), "{e}");
    assert!(sim.log().is_empty());
}

#[test]
fn a_failed_gpu_restore_after_a_leave_running_dump_kills_the_process() {
    // A real process stands for the CUDA process, so that the kill can be seen.
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let t = fake_proc(&[(pid, &["/dev/nvidia0"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[pid]));
    sim.fail(Op::Restore, pid, stasis_gpu::CuResult::OUT_OF_MEMORY, false);
    let s = suspend_sim(&sim, t.path(), &[pid]).unwrap().unwrap();
    let e = s.resume().unwrap_err();
    assert!(
        matches!(&e, CudaError::NotResumed { pids, killed: true, .. } if pids == &[pid]),
        "{e:?}"
    );
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "the stranded process was killed");
}

#[test]
fn an_error_between_suspend_and_resume_still_unlocks() {
    let t = fake_proc(&[(2, &["/dev/nvidia0"], "")]);
    let sim = Arc::new(SimDriver::with_processes(&[2]));
    let dump = || -> Result<(), String> {
        let _gpu = suspend_sim(&sim, t.path(), &[2]).map_err(|e| e.to_string())?;
        Err("criu dump failed".into())
    };
    assert!(dump().is_err());
    assert_eq!(sim.state_of(2), Some(ProcessState::Running));
}

#[test]
fn restore_of_a_tree_finds_its_cuda_processes_and_counts_them() {
    let t = tempfile::tempdir().unwrap();
    for (pid, kids) in [(1, "5 6"), (5, ""), (6, "")] {
        let d = t.path().join(format!("{pid}/task/{pid}"));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("children"), kids).unwrap();
    }
    let sim = SimDriver::with_processes(&[5]);
    sim.set_state(5, ProcessState::Checkpointed);
    let p = proc_at(t.path());
    resume_restored_tree_with(&sim, &p, 1, 1, None).unwrap();
    assert_eq!(sim.state_of(5), Some(ProcessState::Running));
    let e = resume_restored_tree_with(&sim, &p, 1, 2, None).unwrap_err();
    assert!(e.to_string().contains("had 2 CUDA processes"), "{e}");
    assert_eq!(
        resume_restored_tree(1, 0, None).unwrap(),
        PhaseTimings::default()
    );
}

#[test]
fn restore_side_with_and_without_remap() {
    let sim = SimDriver::with_processes(&[2]).with_migration();
    sim.set_state(2, ProcessState::Checkpointed);
    let pair = GpuPair {
        old: GpuUuid([1; 16]),
        new: GpuUuid([2; 16]),
    };
    resume_restored_with(&sim, &[2], Some(&[pair])).unwrap();
    assert_eq!(sim.state_of(2), Some(ProcessState::Running));
    assert_eq!(sim.restored_pairs(), [(2, vec![pair])]);
    let rec = GpuFingerprint {
        driver_version: "580.1".into(),
        devices: vec![GpuDevice {
            name: "H200".into(),
            uuid: GpuUuid([1; 16]).to_string(),
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(remap_for(&rec, &rec).unwrap(), None);
    let mut node = rec.clone();
    node.devices[0].uuid = GpuUuid([2; 16]).to_string();
    assert_eq!(remap_for(&rec, &node).unwrap(), Some(vec![pair]));
}
