"""Adasum all-reduce: perseus vs Horovod 0.28.1 (its CPU AdasumMPI), with perseus's Sum all-reduce for scale.

A job (one library, under mpirun) times ``allreduce_(t, op=Adasum)`` of float32 tensors of each --sizes
(bytes), --iters times after 3 untimed calls, the slowest rank's time per call; perseus also times op=Sum on
the same tensors. The driver runs one job per library and round, the order alternating each round
(interleaved), and prints the median per size, with Horovod / perseus.

    python benchmarks/adasum.py --np 2 --rounds 3        # 4 ranks: --np 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def job(args) -> int:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    if args.library == "horovod":
        import horovod.torch as hvd
    else:
        import perseus.torch as hvd
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rows = []
    ops = [("adasum", hvd.Adasum)] + ([("sum", hvd.Sum)] if args.library == "perseus" else [])
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        t = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(hvd.rank()))
        for label, op in ops:
            for _ in range(3):
                hvd.allreduce_(t.clone(), op=op, name=f"bench.{label}.{nbytes}")
            comm.Barrier()
            times = []
            for _ in range(args.iters):
                x = t.clone()
                comm.Barrier()
                t0 = time.perf_counter()
                hvd.allreduce_(x, op=op, name=f"bench.{label}.{nbytes}")
                times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            rows.append({"library": args.library, "op": label, "bytes": nbytes, "ranks": hvd.size(),
                         "median_s": statistics.median(times), "round": args.round})
    if hvd.rank() == 0:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    hvd.shutdown()
    return 0


def driver(args) -> int:
    here = os.path.abspath(__file__)
    venvs = {"perseus": os.path.dirname(sys.executable), "horovod": os.path.join(args.horovod_venv, "bin")}
    libraries = ["perseus", "horovod"]
    if not os.path.exists(os.path.join(venvs["horovod"], "python")):
        print(f"adasum: no Horovod environment at {args.horovod_venv}; perseus only", file=sys.stderr)
        libraries = ["perseus"]
    out = tempfile.NamedTemporaryFile(prefix="perseus-adasum-", suffix=".jsonl", delete=False).name
    for rnd in range(args.rounds):
        for lib in (libraries if rnd % 2 == 0 else libraries[::-1]):
            argv = [os.path.join(venvs[lib], "mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to",
                    "none", "-np", str(args.np), os.path.join(venvs[lib], "python"), here, "job", "--library", lib,
                    "--sizes", args.sizes, "--iters", str(args.iters), "--round", str(rnd), "--out", out]
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=args.job_timeout)
            print(f"round {rnd} {lib}: {'ok' if done.returncode == 0 else 'FAILED'}", flush=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], file=sys.stderr)
    rows = [json.loads(line) for line in open(out)]
    os.unlink(out)
    print(f"\n{args.np} ranks, float32, median of {args.rounds} rounds x {args.iters} calls (ms per call)")
    print(f"{'size':>10} {'perseus Adasum':>15} {'Horovod Adasum':>15} {'Horovod/perseus':>16} {'perseus Sum':>12}")
    table = []
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        def med(lib, op):
            v = [r["median_s"] for r in rows if r["library"] == lib and r["op"] == op and r["bytes"] == nbytes]
            return statistics.median(v) * 1e3 if v else None
        p, h, s = med("perseus", "adasum"), med("horovod", "adasum"), med("perseus", "sum")
        ratio = h / p if p and h else None
        table.append({"bytes": nbytes, "ranks": args.np, "perseus_adasum_ms": p, "horovod_adasum_ms": h,
                      "horovod_over_perseus": ratio, "perseus_sum_ms": s})

        def f(v, w):
            return format(v, f">{w}.3f") if v is not None else "-".rjust(w)
        print(f"{nbytes / (1 << 20):>9.2f}M {f(p, 15)} {f(h, 15)} {f(ratio, 16)} {f(s, 12)}")
    if args.json:
        with open(args.json, "a") as fh:
            for r in table:
                fh.write(json.dumps({"bench": "adasum", **r}) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode")
    j = sub.add_parser("job")
    j.add_argument("--library", choices=("perseus", "horovod"), required=True)
    j.add_argument("--round", type=int, default=0)
    j.add_argument("--out", required=True)
    for p in (ap, j):
        p.add_argument("--sizes", default=str(256 << 10) + "," + str(4 << 20) + "," + str(32 << 20))
        p.add_argument("--iters", type=int, default=10)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
