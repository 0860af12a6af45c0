"""All-reduce against reduce-scatter + all-gather, perseus and raw MPI side by side.

DeAR-style schedules replace one all-reduce of a gradient by a reduce-scatter (during backward) and an
all-gather (before the next forward); that only pays if RS + AG costs about as much as AR. For each size
(float32, in MB) this measures, in interleaved rounds:

* perseus (perseus.torch): ``allreduce`` of the whole tensor, ``reducescatter`` of it (each rank keeps
  1/size), ``allgather`` of a 1/size shard (the whole tensor comes back), all with op Sum;
* raw MPI through mpi4py on a duplicate of COMM_WORLD: ``MPI_Allreduce``, ``MPI_Reduce_scatter`` (equal
  counts) and ``MPI_Allgather`` of the same buffers.

Every timed call starts after a barrier; its time is the slowest rank's. Reported per size and library:
the median time of each collective over every repetition of every round, and (RS + AG) / AR. Run it under
mpirun, e.g. on one host:

    mpirun -np 2 python benchmarks/collective_split.py --sizes 1,4,16,64 --rounds 5

and across the emulated hosts (tools/emulated_cluster.sh up 2 800 200):

    PERSEUS_NETWORK_INTERFACE=perseus0 mpirun --allow-run-as-root -np 2 --host perseus-h0:1,perseus-h1:1 \\
        --prefix $PWD/.venv -x PATH -x PERSEUS_NETWORK_INTERFACE python benchmarks/collective_split.py

perseus's settings come from the environment as usual (PERSEUS_ALLREDUCE_ALGORITHM, PERSEUS_NUM_CHANNELS...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64", help="tensor sizes in MB of float32 (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (every size, every collective)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls of each collective per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls of each collective before round 0")
    ap.add_argument("--json", default="", help="append the summary rows to this JSON-lines file (rank 0)")
    args = ap.parse_args()

    import numpy as np
    import torch
    from mpi4py import MPI

    import perseus.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = [float(s) for s in args.sizes.split(",") if s]

    def timed(fn) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    cases = []  # (size MB, library, collective, callable)
    for mb in sizes:
        numel = int(mb * (1 << 20)) // 4
        numel -= numel % size
        shard_n = numel // size
        x = torch.randn(numel)
        shard = torch.randn(shard_n)
        xn, outn = x.numpy().copy(), np.empty(numel, np.float32)
        shardn, rsn = shard.numpy().copy(), np.empty(shard_n, np.float32)
        tag = f"{mb:g}"
        cases += [
            (mb, "perseus", "ar", lambda x=x, tag=tag: hvd.allreduce(x, op=hvd.Sum, name=f"split.ar.{tag}")),
            (mb, "perseus", "rs", lambda x=x, tag=tag: hvd.reducescatter(x, op=hvd.Sum, name=f"split.rs.{tag}")),
            (mb, "perseus", "ag", lambda s=shard, tag=tag: hvd.allgather(s, name=f"split.ag.{tag}")),
            (mb, "mpi", "ar", lambda a=xn, b=outn: comm.Allreduce(a, b, op=MPI.SUM)),
            (mb, "mpi", "rs", lambda a=xn, b=rsn, c=[shard_n] * size: comm.Reduce_scatter(a, b, c, op=MPI.SUM)),
            (mb, "mpi", "ag", lambda a=shardn, b=outn: comm.Allgather(a, b)),
        ]

    for _ in range(args.warmup):
        for *_, fn in cases:
            timed(fn)
    times: dict[tuple, list[float]] = {}
    for rnd in range(args.rounds):
        # Interleaved: every round runs every case, in an order that rotates from round to round.
        k = rnd % len(cases)
        for mb, lib, op, fn in cases[k:] + cases[:k]:
            for _ in range(args.reps):
                times.setdefault((mb, lib, op), []).append(timed(fn))

    rows = []
    for mb in sizes:
        for lib in ("perseus", "mpi"):
            med = {op: statistics.median(times[(mb, lib, op)]) for op in ("ar", "rs", "ag")}
            rows.append({"size_mb": mb, "library": lib, "ranks": size, "ar_ms": round(med["ar"] * 1e3, 2),
                         "rs_ms": round(med["rs"] * 1e3, 2), "ag_ms": round(med["ag"] * 1e3, 2),
                         "rsag_over_ar": round((med["rs"] + med["ag"]) / med["ar"], 3),
                         "samples": len(times[(mb, lib, "ar")])})
    if rank == 0:
        print(f"{size} ranks, {args.rounds} rounds x {args.reps} calls; medians of the slowest rank's time (ms)")
        print(f"{'MB':>5} {'library':>8} {'AR':>9} {'RS':>9} {'AG':>9} {'RS+AG':>9} {'(RS+AG)/AR':>11}")
        for r in rows:
            print(f"{r['size_mb']:>5g} {r['library']:>8} {r['ar_ms']:>9.2f} {r['rs_ms']:>9.2f} {r['ag_ms']:>9.2f} "
                  f"{r['rs_ms'] + r['ag_ms']:>9.2f} {r['rsag_over_ar']:>11.3f}")
        if args.json:
            with open(args.json, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
