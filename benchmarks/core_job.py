"""One job of the core comparison that benchmarks/run_all.py drives: every rank runs this file under mpirun.

    mpirun -np 2 python benchmarks/core_job.py --lib perseus --out core.jsonl --round 0

A job initialises one library (``--lib perseus``, ``horovod`` or ``none``), leaves it idle, and times in
interleaved steps (the order of the methods rotates every step) the library against bounds measured in the
same process, on the same buffers, with the library initialised and idle:

- gradient sets (ResNet-50: 161 tensors, 102 MB; BERT-large: 391 tensors, 1.34 GB): the library all-reduces
  every tensor (op=Average, reverse order, all submitted then all waited for, as DistributedOptimizer does);
  ``mpi_flat`` is raw MPI_Allreduce over one flat buffer of the same bytes in 6 MB pieces (the bound with no
  per-tensor cost); ``mpi_tensor`` does the same per tensor (each tensor in 6 MB pieces, no fusion);
- ``many``: 1000 tensors of 1 KB started asynchronously then all waited for, per tensor; bounds
  ``mpi_tensor`` (one MPI_Allreduce per tensor) and ``mpi_flat`` (one over the 1000 KB);
- ``one``: a synchronous 1-float all-reduce, per round trip; bound ``mpi_tensor`` (one MPI_Allreduce).

With ``--lib none`` no library is initialised: the same bounds are measured with nothing idle beside them
(run_all.py divides the two to get the idle library's cost), and torch.distributed on gloo is timed as the
library (25 MB DDP-style buckets for the gradient sets).

Every step's time is the slowest rank's. Rank 0 appends one JSON line per workload to --out, holding every
method's per-step samples (milliseconds for the gradient sets, microseconds per tensor or per round trip for
``many`` and ``one``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradient_sets import bench_gloo, bench_mpi_chunked, bench_perseus, bert_large_shapes, interleaved, \
    make_grads, resnet50_shapes  # noqa: E402
from small_tensors import gloo as gloo_small, perseus_like, raw_mpi  # noqa: E402

CHUNK = 6 << 20


def mpi_flat(nbytes: int, comm, MPI):
    """Raw MPI over one flat float32 buffer of nbytes, in CHUNK pieces, in place."""
    flat = np.zeros(max(nbytes // 4, 1), dtype=np.float32)
    step_n = CHUNK // 4

    def step():
        for s in range(0, flat.size, step_n):
            comm.Allreduce(MPI.IN_PLACE, flat[s:s + step_n], op=MPI.SUM)
    return step


def gradient_set_methods(lib: str, hvd, dist, grads, comm, MPI) -> dict:
    fns = {"mpi_flat": mpi_flat(sum(g.numel() * 4 for g in grads), comm, MPI),
           "mpi_tensor": bench_mpi_chunked(grads, comm, MPI, CHUNK)}
    if lib == "none":
        import torch

        fns["gloo"] = bench_gloo(grads, dist, torch)
    else:
        fns[lib] = bench_perseus(grads, hvd)
    return fns


def small_methods(lib: str, hvd, dist, comm, MPI, n: int, calls: int) -> tuple[dict, dict]:
    import torch

    rank = comm.Get_rank()
    tensors = [torch.full((256,), float(rank + 1)) for _ in range(n)]
    single = torch.ones(1)
    many, one = {}, {}
    many["mpi_tensor"], one["mpi_tensor"] = raw_mpi(comm, MPI, tensors, single, calls)
    many["mpi_flat"] = mpi_flat(n * 1024, comm, MPI)
    if lib == "none":
        many["gloo"], one["gloo"] = gloo_small(dist, tensors, single, calls)
    else:
        many[lib], one[lib] = perseus_like(hvd, tensors, single, calls)
    return many, one


def init_library(lib: str):
    """Initialise perseus or Horovod before mpi4py is imported, as a user's script does (the library then
    starts MPI with its own settings); None for ``none``."""
    if lib == "perseus":
        import perseus.torch as hvd
    elif lib == "horovod":
        import horovod.torch as hvd
    else:
        return None
    hvd.init()
    return hvd


def init_gloo(comm):
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    return dist


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", choices=("perseus", "horovod", "none"), required=True)
    ap.add_argument("--sets", default="resnet50", help="comma list of resnet50, bert_large (empty: none)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per gradient set")
    ap.add_argument("--bert-steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--small-rounds", type=int, default=5, help="timed rounds of 'many' and 'one' (0: skip)")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    hvd = init_library(args.lib)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    dist = init_gloo(comm) if hvd is None else None
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = []
    base = {"bench": "core", "lib": args.lib, "round": args.round, "ranks": size}
    for set_name in filter(None, args.sets.split(",")):
        grads = make_grads({"resnet50": resnet50_shapes, "bert_large": bert_large_shapes}[set_name](), torch)
        steps = args.bert_steps if set_name == "bert_large" else args.steps
        times = interleaved(gradient_set_methods(args.lib, hvd, dist, grads, comm, MPI), args.warmup, steps,
                            comm)  # milliseconds per step
        rows.append(dict(base, workload=set_name, unit="ms", tensors=len(grads),
                         bytes=sum(g.numel() * 4 for g in grads),
                         samples={k: [round(t, 3) for t in v] for k, v in times.items()}))
        del grads
    if args.small_rounds:
        many, one = small_methods(args.lib, hvd, dist, comm, MPI, args.tensors, args.calls)
        for workload, fns, per in (("many", many, args.tensors), ("one", one, args.calls)):
            times = interleaved(fns, 2, args.small_rounds, comm)
            rows.append(dict(base, workload=workload, unit="us", tensors=per,
                             samples={k: [round(t * 1e3 / per, 3) for t in v] for k, v in times.items()}))
    if rank == 0:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    if dist is not None:
        dist.destroy_process_group()
    if hvd is not None:
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
