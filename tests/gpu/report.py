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
    s1, c1, u1 = r("suspend1"), r("ckpt1"), r("resume1")
    s2, c2, rs, u2 = r("suspend2"), r("ckpt2"), r("restore"), r("resume2")
    cold, meta = r("cold"), meta_of(res)
    gpu_bytes = ready.get("bytes") or int(float(meta.get("gib", 0)) * (1 << 30))
    rows = []

    def row(group, phase, seconds, nbytes=None, note=""):
        if seconds is None:
            return
        gbs = (nbytes / 1e9 / seconds) if (nbytes and seconds > 0) else None
        rows.append({"group": group, "phase": phase, "s": round(seconds, 3),
                     "GB/s": None if gbs is None else round(gbs, 2), "note": note})

    if ready:
        row("workload start", "import torch", ready.get("import_s"))
        row("workload start", "CUDA init", ready.get("cuda_init_s"))
        row("workload start", "fill GPU memory (random)", ready.get("fill_s"), gpu_bytes)
        row("workload start", "save tensors for cold start", ready.get("save_s"), gpu_bytes)
    if rt:
        row("driver API, in place", "lock", secs(rt.get("lock_ms")))
        row("driver API, in place", "checkpoint (GPU -> host)", secs(rt.get("checkpoint_ms")), gpu_bytes)
        row("driver API, in place", "restore (host -> GPU)", secs(rt.get("restore_ms")), gpu_bytes)
        row("driver API, in place", "unlock", secs(rt.get("unlock_ms")))
    lr_bytes = (c1.get("stats") or {}).get("logical_bytes")
    if s1:
        row("CRIU, leave running", "lock", secs(s1.get("lock_ms")))
        row("CRIU, leave running", "checkpoint (GPU -> host)", secs(s1.get("checkpoint_ms")), gpu_bytes)
    if c1:
        t = c1.get("timings") or {}
        row("CRIU, leave running", "dump (CRIU)", secs(t.get("dump_ms")), lr_bytes)
        row("CRIU, leave running", "upload (chunk, compress, encrypt, store)", secs(t.get("store_ms")), lr_bytes)
    if u1:
        row("CRIU, leave running", "restore (host -> GPU)", secs(u1.get("restore_ms")), gpu_bytes)
        row("CRIU, leave running", "unlock", secs(u1.get("unlock_ms")))
    st_bytes = (c2.get("stats") or {}).get("logical_bytes")
    if s2:
        row("CRIU, stop + restore", "lock", secs(s2.get("lock_ms")))
        row("CRIU, stop + restore", "checkpoint (GPU -> host)", secs(s2.get("checkpoint_ms")), gpu_bytes)
    if c2:
        t = c2.get("timings") or {}
        row("CRIU, stop + restore", "dump (CRIU)", secs(t.get("dump_ms")), st_bytes)
        row("CRIU, stop + restore", "upload (chunk, compress, encrypt, store)", secs(t.get("store_ms")), st_bytes)
    if rs:
        row("CRIU, stop + restore", "download (fetch, verify, decrypt)", secs(rs.get("fetch_ms")), rs.get("bytes"))
        row("CRIU, stop + restore", "CRIU restore", secs(rs.get("restore_ms")), rs.get("bytes"))
    if u2:
        row("CRIU, stop + restore", "restore (host -> GPU)", secs(u2.get("restore_ms")), gpu_bytes)
        row("CRIU, stop + restore", "unlock", secs(u2.get("unlock_ms")))
    restore_total = None
    if rs and u2:
        restore_total = (rs.get("total_ms", 0) + u2.get("restore_ms", 0) + u2.get("unlock_ms", 0)
                         + u2.get("driver_load_ms", 0)) / 1000.0
        row("restore vs cold start", "restore, total (stasis restore + GPU restore + unlock)", restore_total)
    cold_s = meta.get("cold_wall_s")
    if cold_s is not None:
        row("restore vs cold start", "cold start (python, import torch, CUDA init, load tensors)", cold_s,
            cold.get("bytes"))
    ratio = round(cold_s / restore_total, 2) if (cold_s and restore_total) else None

    results = {"meta": meta, "ready": ready, "rows": rows, "restore_total_s": restore_total,
               "cold_start_s": cold_s, "cold_over_restore": ratio,
               "verify": {k: r("verify-" + k) for k in ("base", "rt", "lr", "restored")},
               "gpu_memory_used": {"before": rt.get("gpu_used_before_bytes"),
                                   "checkpointed": rt.get("gpu_used_checkpointed_bytes")}}
    lines = ["| group | phase | s | GB/s |", "|---|---|---:|---:|"]
    for x in rows:
        lines.append("| %s | %s | %.3f | %s |" % (x["group"], x["phase"], x["s"],
                                                  "" if x["GB/s"] is None else "%.2f" % x["GB/s"]))
    head = [
        "GPU: %s; driver %s; CUDA driver %s; torch %s (CUDA %s)" % (
            meta.get("gpu", "?"), meta.get("driver", "?"), meta.get("cuda_driver", "?"),
            ready.get("torch", "?"), ready.get("cuda", "?")),
        "runtime: %s; CRIU: %s; GPU data: %.2f GiB; store: %s" % (
            meta.get("runtime", "?"), meta.get("criu", "?"), gpu_bytes / (1 << 30), meta.get("store", "?")),
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
