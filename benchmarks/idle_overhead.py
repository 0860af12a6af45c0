"""How much an idle engine slows the training process's own compute.

    perseusrun -np 2 python benchmarks/idle_overhead.py [--lib perseus|horovod|none]

Every rank runs the same compute loop (single-threaded torch matmuls, then a pure-Python loop) after
initialising the library and submitting nothing; the time is compared with --lib none (no library
initialised; MPI itself still initialised). Run once per library; each run prints its medians as JSON.
"""

import argparse
import json
import time

import numpy as np


def torch_loop(torch, n=200):
    a = torch.randn(256, 256)
    b = torch.randn(256, 256)
    t = time.perf_counter()
    for _ in range(n):
        a = (a @ b).tanh_()
    return time.perf_counter() - t


def python_loop(n=300_000):
    t = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i * i % 7
    return time.perf_counter() - t


def library_thread_cpu_s() -> float:
    """CPU seconds used so far by this process's threads other than the main thread (Linux /proc)."""
    import os
    import threading

    main_tid = threading.main_thread().native_id
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == main_tid:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="perseus", choices=["perseus", "horovod", "none"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default="", help="append the result as a JSON line to this file (rank 0)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.lib != "none":
        hvd = __import__(f"{args.lib}.torch", fromlist=["torch"])
        hvd.init()
        hvd.allreduce(torch.ones(4), name="warmup")  # the engine has run once, then stays idle
        time.sleep(1.0)
    rows = {"torch_s": [], "python_s": []}
    cpu0, wall0 = library_thread_cpu_s(), time.perf_counter()
    for _ in range(args.repeats):
        comm.Barrier()
        rows["torch_s"].append(torch_loop(torch))
        comm.Barrier()
        rows["python_s"].append(python_loop())
    result = {k: float(np.median(v)) for k, v in rows.items()}
    result["other_threads_cpu_share"] = (library_thread_cpu_s() - cpu0) / (time.perf_counter() - wall0)
    result.update(lib=args.lib, ranks=comm.Get_size())
    all_results = comm.gather(result)
    if comm.Get_rank() == 0:
        merged = {"bench": "idle_overhead", "lib": args.lib, "ranks": comm.Get_size(),
                  "torch_s": float(np.mean([r["torch_s"] for r in all_results])),
                  "python_s": float(np.mean([r["python_s"] for r in all_results])),
                  "other_threads_cpu_share": float(np.mean([r["other_threads_cpu_share"] for r in all_results]))}
        print(json.dumps(merged), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(merged) + "\n")
    if args.lib != "none":
        hvd.shutdown()


if __name__ == "__main__":
    main()
