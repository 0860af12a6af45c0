"""Where the time goes on one host: the figures behind docs/benchmarks.md "Where the time goes".

    python benchmarks/single_host_profile.py [--json FILE]     # starts its own 2-rank jobs

Two questions, each answered by 2-rank jobs (perseus initialised first, as in a user's script):

1. Memory. Raw MPI_Allreduce (in place, 4 MB pieces) over the same 102 MB (the ResNet-50 set) in buffers
   that differ only in their pages: NumPy's (NumPy asks for transparent huge pages for large arrays), torch's
   (4 KiB pages unless the system makes every mapping huge), and torch's after MADV_COLLAPSE; then perseus on
   the ResNet-50 set with PERSEUS_HUGE_PAGES=0 and 1 (one job each, alternating), against the flat bound.
2. Latency. A loop of synchronous 1-float all-reduces, perseus and raw MPI: microseconds per round trip, the
   context switches per round trip of all the process's threads (/proc/self/task/*/status) and the cores kept
   busy.

Rank 0 prints one JSON line per job and appends them to --json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FRAME = 2 << 20


def collapse(t) -> int:
    """MADV_COLLAPSE the 2 MiB frames under tensor t; returns madvise's status."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    a, n = t.data_ptr(), t.numel() * t.element_size()
    start, end = a & ~(FRAME - 1), (a + n + FRAME - 1) & ~(FRAME - 1)
    return libc.madvise(start, end - start, 25)


def context_switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def memory_job(hvd, comm, MPI, torch, steps: int) -> dict:
    import numpy as np

    from core_job import mpi_flat
    from gradient_sets import bench_mpi_chunked, bench_perseus, interleaved, make_grads, resnet50_shapes

    grads = make_grads(resnet50_shapes(), torch)
    n = sum(g.numel() for g in grads)
    collapsed = torch.zeros(n)
    status = collapse(collapsed)
    fns = {"mpi_numpy_pages": bench_mpi_chunked([torch.from_numpy(np.zeros(n, np.float32))], comm, MPI, 4 << 20),
           "mpi_torch_pages": bench_mpi_chunked([torch.zeros(n)], comm, MPI, 4 << 20),
           "mpi_torch_collapsed": bench_mpi_chunked([collapsed], comm, MPI, 4 << 20),
           "mpi_flat": mpi_flat(n * 4, comm, MPI), "perseus": bench_perseus(grads, hvd)}
    times = interleaved(fns, 2, steps, comm)  # milliseconds
    return {"case": "memory", "collapse_status": status, "huge_pages": os.environ.get("PERSEUS_HUGE_PAGES", "1"),
            "median_ms": {k: round(float(np.median(v)), 2) for k, v in times.items()}}


def latency_job(hvd, comm, MPI, torch, calls: int) -> dict:
    x = torch.ones(1)
    a = x.numpy()
    loops = {"perseus": lambda: hvd.allreduce_(x, name="profile.rt", op=hvd.Sum),
             "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)}
    out = {"case": "latency"}
    for name, call in loops.items():
        for _ in range(calls // 10):
            call()
        comm.Barrier()
        c0, t0, cpu0 = context_switches(), time.perf_counter(), os.times()
        for _ in range(calls):
            call()
        wall = time.perf_counter() - t0
        cpu1, c1 = os.times(), context_switches()
        busy = (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / wall
        worst = comm.allreduce(wall, op=MPI.MAX)
        out[name] = {"us_per_round_trip": round(worst / calls * 1e6, 2),
                     "context_switches_per_round_trip": round((c1 - c0) / calls, 2), "cores_busy": round(busy, 2)}
    return out


def job(args) -> int:
    import torch

    torch.set_num_threads(1)
    import perseus.torch as hvd

    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    row = memory_job(hvd, comm, MPI, torch, args.steps) if args.case == "memory" else \
        latency_job(hvd, comm, MPI, torch, args.calls)
    if comm.Get_rank() == 0:
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(row, bench="single_host_profile", round=args.round)) + "\n")
    hvd.shutdown()
    return 0


def driver(args) -> int:
    mpirun = [os.path.join(os.path.dirname(sys.executable), "mpirun"), "--bind-to", "none", "-np", "2"]
    if os.geteuid() == 0:
        mpirun.append("--allow-run-as-root")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + HERE)
    for r in range(args.rounds):
        for case, huge in (("memory", "0"), ("memory", "1"), ("latency", "1"))[::1 if r % 2 == 0 else -1]:
            cmd = mpirun + [sys.executable, os.path.abspath(__file__), "job", "--case", case, "--round", str(r),
                            "--steps", str(args.steps), "--calls", str(args.calls)]
            if args.json:
                cmd += ["--json", os.path.abspath(args.json)]
            subprocess.run(cmd, env=dict(env, PERSEUS_HUGE_PAGES=huge), check=True, timeout=600)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="driver", choices=["driver", "job"])
    ap.add_argument("--case", choices=["memory", "latency"], default="memory")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
