"""Per-tensor cost and small-message latency, side by side: perseus, raw MPI, torch.distributed gloo, Horovod.

Run on 2 ranks:  mpirun -np 2 python benchmarks/small_tensors.py   (Horovod: --only horovod, in its own job)

Two cases, op=Sum, CPU float32 tensors, every method on the same buffers, rounds interleaved:

- ``many``: N tensors of 1 KB (256 floats) are all started asynchronously, then all waited for; the figure
  is the round's time divided by N (microseconds per tensor). Raw MPI does one blocking MPI_Allreduce per
  tensor (what a library would pay with no fusion); gloo starts N async all-reduces and waits.
- ``one``: a synchronous allreduce of a single float, K times in a row; the figure is the round's time
  divided by K (microseconds per round trip).

Reports the median over --rounds rounds after --warmup rounds, agreed across ranks (the slowest rank's
time), and each library's ratio to raw MPI (median of per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from gradient_sets import interleaved


def perseus_like(hvd, tensors, single, calls):
    """``many`` and ``one`` for the Horovod API (perseus or Horovod itself)."""
    handles = [None] * len(tensors)

    def many():
        for i, t in enumerate(tensors):
            handles[i] = hvd.allreduce_async_(t, name=f"small.{i}", op=hvd.Sum)
        for h in handles:
            hvd.synchronize(h)

    def one():
        for _ in range(calls):
            hvd.allreduce_(single, name="small.one", op=hvd.Sum)
    return many, one


def raw_mpi(comm, MPI, tensors, single, calls):
    arrays = [t.numpy() for t in tensors]
    one_array = single.numpy()

    def many():
        for a in arrays:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def one():
        for _ in range(calls):
            comm.Allreduce(MPI.IN_PLACE, one_array, op=MPI.SUM)
    return many, one


def gloo(dist, tensors, single, calls):
    def many():
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for w in works:
            w.wait()

    def one():
        for _ in range(calls):
            dist.all_reduce(single)
    return many, one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=1000, help="N for the 'many' case")
    ap.add_argument("--calls", type=int, default=200, help="K for the 'one' case")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="perseus,mpi,gloo", help="comma list of perseus, mpi, gloo, horovod")
    ap.add_argument("--json", default="", help="append results as JSON lines to this file (rank 0)")
    ap.add_argument("--tag", default="", help="label stored with the results (e.g. a setting under test)")
    args = ap.parse_args()
    import torch

    which = set(args.only.split(","))
    if "horovod" in which:
        import horovod.torch as hvd
    else:
        import perseus.torch as hvd
    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    dist = None
    if "gloo" in which:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        dist.init_process_group("gloo", rank=rank, world_size=size)

    # Sum over rounds grows the values; fine for timing (float32 overflows to inf, which costs the same).
    tensors = [torch.full((256,), float(rank + 1)) for _ in range(args.tensors)]
    single = torch.ones(1)
    cases = {"many": {}, "one": {}}
    if "mpi" in which:
        cases["many"]["mpi"], cases["one"]["mpi"] = raw_mpi(comm, MPI, tensors, single, args.calls)
    for name in ("perseus", "horovod"):
        if name in which:
            cases["many"][name], cases["one"][name] = perseus_like(hvd, tensors, single, args.calls)
    if dist is not None:
        cases["many"]["gloo"], cases["one"]["gloo"] = gloo(dist, tensors, single, args.calls)

    per = {"many": args.tensors, "one": args.calls}
    what = {"many": f"{args.tensors} x 1 KB async allreduce, per tensor",
            "one": "1-float synchronous allreduce, per round trip"}
    for case, fns in cases.items():
        times = interleaved(fns, args.warmup, args.rounds, comm)  # ms per round
        row = {"bench": "small_tensors", "case": case, "ranks": size, "tag": args.tag, "what": what[case]}
        us = {name: np.array(ts) * 1e3 / per[case] for name, ts in times.items()}
        for name, values in us.items():
            row[f"{name}_us"] = round(float(np.median(values)), 2)
        if "mpi" in us:
            for name, values in us.items():
                if name != "mpi":
                    row[f"{name}_over_mpi"] = round(float(np.median(values / us["mpi"])), 2)
        if rank == 0:
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            figures = ", ".join(f"{name} {row[f'{name}_us']:.1f} us" for name in us)
            print(f"{what[case]}: {figures}", flush=True)
    if dist is not None:
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
