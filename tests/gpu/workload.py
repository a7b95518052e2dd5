#!/usr/bin/env python3
"""GPU workload for tests/gpu/run.sh (needs PyTorch with CUDA; nothing else).

Run mode (default): fills --gib GiB of GPU memory with seeded random int32 data, records a
checksum per 1 GiB tensor in DIR/checksums.json, optionally saves the tensors to --save DIR (for
the cold start), writes DIR/ready, then counts steps forever: each step does a small matmul and
increments a step counter that lives on the GPU as well as one in Python. Every 10 steps the count
goes to DIR/step. When DIR/verify-request appears (its content is an id), it recomputes the
checksums on the GPU and writes DIR/verify-<id>.json: {ok, step, gpu_step, sums}. DIR/stop ends
it. It holds no file open between steps, so CRIU can dump and restore it.

Cold-start mode (--cold-start SAVED): what a restart costs instead of a restore: import torch,
CUDA init, load the saved tensors onto the GPU, verify them; prints one JSON line of timings.
"""

import argparse
import json
import os
import sys
import time

T0 = time.time()

import torch  # noqa: E402  (import time is part of the cold start)

T_IMPORT = time.time()
GIB = 1 << 30
CHUNK = 1 << 26  # int32 elements per checksum chunk (256 MiB)


def checksum(t):
    """Position-sensitive checksum of a 1-D int32 CUDA tensor, computed on the GPU."""
    s1 = 0
    s2 = 0
    for i, off in enumerate(range(0, t.numel(), CHUNK)):
        c = int(t[off:off + CHUNK].to(torch.int64).sum().item())
        s1 += c
        s2 += c * (i + 1)
    return "%x-%x" % (s1 & (2**64 - 1), s2 & (2**64 - 1))


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cuda_init():
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()


def fill(gib, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    left = max(1, int(gib * GIB) // 4)  # int32 elements
    tensors = []
    while left > 0:
        n = min(GIB // 4, left)
        t = torch.empty(n, dtype=torch.int32, device="cuda")
        t.random_(generator=g)
        tensors.append(t)
        left -= n
    torch.cuda.synchronize()
    return tensors, g


def run(args):
    d = args.dir
    os.makedirs(d, exist_ok=True)
    cuda_init()
    t_cuda = time.time()
    tensors, g = fill(args.gib, args.seed)
    t_fill = time.time()
    sums = [checksum(t) for t in tensors]
    t_sum = time.time()
    write_atomic(os.path.join(d, "checksums.json"),
                 json.dumps({"gib": args.gib, "tensors": len(tensors), "sums": sums}))
    t_save = t_sum
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        for i, t in enumerate(tensors):
            torch.save(t.cpu(), os.path.join(args.save, "t%03d.pt" % i))
        os.sync()
        t_save = time.time()
    work = torch.randn(1024, 1024, device="cuda", generator=g) / 32
    gpu_step = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    write_atomic(os.path.join(d, "ready"), json.dumps({
        "pid": os.getpid(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "import_s": T_IMPORT - T0,
        "cuda_init_s": t_cuda - T_IMPORT,
        "fill_s": t_fill - t_cuda,
        "checksum_s": t_sum - t_fill,
        "save_s": t_save - t_sum,
        "bytes": sum(t.numel() * 4 for t in tensors),
    }))
    step = 0
    req = os.path.join(d, "verify-request")
    stop = os.path.join(d, "stop")
    while True:
        work = torch.tanh(work @ work)
        gpu_step += 1
        step += 1
        if step % 10 == 0:
            torch.cuda.synchronize()
            write_atomic(os.path.join(d, "step"), str(step))
        if os.path.exists(req):
            with open(req) as f:
                rid = f.read().strip() or "x"
            os.unlink(req)
            now = [checksum(t) for t in tensors]
            gs = int(gpu_step.item())
            write_atomic(os.path.join(d, "verify-%s.json" % rid), json.dumps({
                "ok": now == sums and gs == step,
                "sums_ok": now == sums,
                "step": step,
                "gpu_step": gs,
                "sums": now,
            }))
        if os.path.exists(stop):
            return 0
        time.sleep(0.01)


def cold_start(args):
    cuda_init()
    t_cuda = time.time()
    files = sorted(f for f in os.listdir(args.cold_start) if f.endswith(".pt"))
    tensors = []
    for f in files:
        p = os.path.join(args.cold_start, f)
        try:
            cpu = torch.load(p, mmap=True, weights_only=True)
        except TypeError:  # torch < 2.1: no mmap
            cpu = torch.load(p)
        tensors.append(cpu.to("cuda"))
    torch.cuda.synchronize()
    t_load = time.time()
    ok = None
    if args.dir:
        with open(os.path.join(args.dir, "checksums.json")) as f:
            ok = [checksum(t) for t in tensors] == json.load(f)["sums"]
    print(json.dumps({
        "import_s": T_IMPORT - T0,
        "cuda_init_s": t_cuda - T_IMPORT,
        "load_s": t_load - t_cuda,
        "ready_s": t_load - T0,
        "bytes": sum(t.numel() * 4 for t in tensors),
        "ok": ok,
    }), flush=True)
    return 0 if ok is not False else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="state directory")
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", help="also save the tensors into this directory")
    p.add_argument("--cold-start", metavar="SAVED", help="cold-start from saved tensors and exit")
    args = p.parse_args()
    if args.cold_start:
        return cold_start(args)
    if not args.dir:
        p.error("--dir is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
