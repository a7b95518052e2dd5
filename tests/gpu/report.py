#!/usr/bin/env python3
"""Helpers for tests/gpu/run.sh (standard library only).

  report.py get FILE DOTTED.PATH      print one value of a JSON file (strings raw, else JSON)
  report.py table RESDIR OUTDIR       print the results table; write gpu-results.{json,md}
"""

import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def get(path, dotted):
    d = load(path)
    for k in [k for k in dotted.split(".") if k]:
        if isinstance(d, list) and k.isdigit() and int(k) < len(d):
            d = d[int(k)]
        elif isinstance(d, dict) and k in d:
            d = d[k]
        else:
            return 1
    print(d if isinstance(d, str) else json.dumps(d))
    return 0


def lines_of(path):
    try:
        with open(path) as f:
            return [l.rstrip("\n") for l in f if l.strip()]
    except OSError:
        return []


def meta_of(res):
    """meta.env (KEY=VALUE lines), skipped.txt and failed.txt, as run.sh writes them."""
    meta = {}
    for l in lines_of(os.path.join(res, "meta.env")):
        k, _, v = l.partition("=")
        meta[k] = v
    if "cold_wall_s" in meta:
        try:
            meta["cold_wall_s"] = float(meta["cold_wall_s"])
        except ValueError:
            del meta["cold_wall_s"]
    meta["skipped"] = lines_of(os.path.join(res, "skipped.txt"))
    meta["failed"] = lines_of(os.path.join(res, "failed.txt"))
    return meta


def secs(ms):
    return None if ms is None else ms / 1000.0


def table(res, out):
    r = lambda name: load(os.path.join(res, name + ".json")) or {}
    ready, rt = r("ready"), r("roundtrip")
    c1, c2, rs = r("ckpt1"), r("ckpt2"), r("restore")
    g1, g2, gr = c1.get("gpu") or {}, c2.get("gpu") or {}, rs.get("gpu") or {}
    cold, meta = r("cold"), meta_of(res)
    tensor_bytes = ready.get("bytes") or int(float(meta.get("gib", 0)) * (1 << 30))
    rows = []

    def row(group, phase, seconds, nbytes=None, note=""):
        if seconds is None:
            return
        gbs = (nbytes / 1e9 / seconds) if (nbytes and seconds > 0) else None
        rows.append({"group": group, "phase": phase, "s": round(seconds, 3),
                     "GB/s": None if gbs is None else round(gbs, 2), "note": note})

    # What the driver moved (NVML: GPU memory in use before minus while checkpointed), not the
    # tensors: allocator caches, library workspaces and the contexts move too.
    rt_bytes = None
    if rt.get("gpu_used_before_bytes") is not None and rt.get("gpu_used_checkpointed_bytes") is not None:
        rt_bytes = max(0, rt["gpu_used_before_bytes"] - rt["gpu_used_checkpointed_bytes"])
    if ready:
        row("workload start", "import torch", ready.get("import_s"))
        row("workload start", "CUDA init", ready.get("cuda_init_s"))
        row("workload start", "fill GPU memory (random)", ready.get("fill_s"), tensor_bytes)
        row("workload start", "save tensors for cold start", ready.get("save_s"), tensor_bytes)
    if rt:
        g = "driver API, in place"
        row(g, "driver load (libcuda, cuInit)", secs(rt.get("driver_load_ms")))
        row(g, "lock", secs(rt.get("lock_ms")))
        row(g, "checkpoint (GPU -> host)", secs(rt.get("checkpoint_ms")), rt_bytes)
        row(g, "restore (host -> GPU)", secs(rt.get("restore_ms")), rt_bytes)
        row(g, "unlock", secs(rt.get("unlock_ms")))
    if c2:
        g, t = "stasis, stop + restore", c2.get("timings") or {}
        moved = g2.get("bytes_moved")
        row(g, "driver load (libcuda, cuInit)", secs(g2.get("driver_load_ms")))
        row(g, "lock", secs(g2.get("lock_ms")))
        row(g, "checkpoint (GPU -> host)", secs(g2.get("checkpoint_ms")), moved)
        row(g, "dump (CRIU)", secs(t.get("dump_ms")), (c2.get("stats") or {}).get("logical_bytes"))
        row(g, "CUDA blocked (lock -> end of dump)", secs(g2.get("blocked_ms")))
        row(g, "upload (chunk, compress, encrypt, store)", secs(t.get("store_ms")),
            (c2.get("stats") or {}).get("logical_bytes"))
    if rs:
        g = "stasis, stop + restore"
        row(g, "download (fetch, verify, decrypt)", secs(rs.get("fetch_ms")), rs.get("bytes"))
        if gr:
            row(g, "CRIU restore", secs(rs.get("restore_ms", 0) - gr.get("total_ms", 0)), rs.get("bytes"))
            row(g, "driver load (libcuda, cuInit)", secs(gr.get("driver_load_ms")))
            row(g, "restore (host -> GPU)", secs(gr.get("restore_ms")), g2.get("bytes_moved"))
            row(g, "unlock", secs(gr.get("unlock_ms")))
        else:
            row(g, "CRIU restore (no GPU step reported)", secs(rs.get("restore_ms")), rs.get("bytes"))
    if c1:
        g, t = "stasis, leave running (restored process)", c1.get("timings") or {}
        moved = g1.get("bytes_moved")
        row(g, "lock", secs(g1.get("lock_ms")))
        row(g, "checkpoint (GPU -> host)", secs(g1.get("checkpoint_ms")), moved)
        row(g, "dump (CRIU)", secs(t.get("dump_ms")), (c1.get("stats") or {}).get("logical_bytes"))
        row(g, "restore (host -> GPU)", secs(g1.get("restore_ms")), moved)
        row(g, "unlock", secs(g1.get("unlock_ms")))
        row(g, "frozen: CUDA blocked, lock -> unlock", secs(t.get("frozen_ms")))
        row(g, "upload (chunk, compress, encrypt, store)", secs(t.get("store_ms")),
            (c1.get("stats") or {}).get("logical_bytes"))
    restore_total = None
    if rs:
        # stasis's own total: fetch, CRIU restore, driver load, GPU restore, unlock.
        restore_total = secs(rs.get("total_ms"))
        row("restore vs cold start", "restore, total (stasis restore, GPU steps included)", restore_total)
    cold_s = meta.get("cold_wall_s")
    if cold_s is not None:
        row("restore vs cold start", "cold start (python, import torch, CUDA init, load tensors)", cold_s,
            cold.get("bytes"))
    ratio = round(cold_s / restore_total, 2) if (cold_s and restore_total) else None

    results = {"meta": meta, "ready": ready, "rows": rows, "restore_total_s": restore_total,
               "cold_start_s": cold_s, "cold_over_restore": ratio,
               "verify": {k: r("verify-" + k) for k in ("base", "rt", "restored", "lr")},
               "gpu_memory_used": {"before": rt.get("gpu_used_before_bytes"),
                                   "checkpointed": rt.get("gpu_used_checkpointed_bytes")},
               "bytes": {"tensors": tensor_bytes, "driver_in_place": rt_bytes,
                         "driver_stop": g2.get("bytes_moved"), "driver_leave_running": g1.get("bytes_moved")}}
    lines = ["| group | phase | s | GB/s |", "|---|---|---:|---:|"]
    for x in rows:
        lines.append("| %s | %s | %.3f | %s |" % (x["group"], x["phase"], x["s"],
                                                  "" if x["GB/s"] is None else "%.2f" % x["GB/s"]))
    head = [
        "GPU: %s; driver %s; CUDA driver %s; torch %s (CUDA %s)" % (
            meta.get("gpu", "?"), meta.get("driver", "?"), meta.get("cuda_driver", "?"),
            ready.get("torch", "?"), ready.get("cuda", "?")),
        "runtime: %s; persistence mode: %s (the driver held open by a helper); CRIU: %s; store: %s" % (
            meta.get("runtime", "?"), meta.get("persistence_mode", "?"), meta.get("criu", "?"),
            meta.get("store", "?")),
        "GPU data: %.2f GiB of tensors; the driver moved %s (GB/s below are from the bytes the driver moved)" % (
            tensor_bytes / (1 << 30),
            "; ".join("%.2f GiB %s" % (b / (1 << 30), w) for w, b in (
                ("in place", rt_bytes), ("at the --stop checkpoint", g2.get("bytes_moved")),
                ("at the leave-running checkpoint", g1.get("bytes_moved"))) if b is not None) or "?"),
    ]
    if ratio:
        head.append("restore %.2f s vs cold start %.2f s: cold start / restore = %.2fx" % (
            restore_total, cold_s, ratio))
    used = results["gpu_memory_used"]
    if used["before"] is not None and used["checkpointed"] is not None:
        head.append("GPU memory in use: %.2f GiB before, %.2f GiB while checkpointed" % (
            used["before"] / (1 << 30), used["checkpointed"] / (1 << 30)))
    skipped = meta.get("skipped") or []
    failed = meta.get("failed") or []
    tail = ["", "skipped: " + ("; ".join(skipped) if skipped else "nothing"),
            "failed: " + ("; ".join(failed) if failed else "nothing")]
    text = "\n".join(head + [""] + lines + tail) + "\n"
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu-results.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(out, "gpu-results.md"), "w") as f:
            f.write(text)
    return 0


def main(argv):
    if len(argv) == 4 and argv[1] == "get":
        return get(argv[2], argv[3])
    if len(argv) in (3, 4) and argv[1] == "table":
        return table(argv[2], argv[3] if len(argv) == 4 else "")
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
