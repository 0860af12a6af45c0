"""All-reduce the gradient sets of ResNet-50 and BERT-large, side by side, on the same data.

Run on 2 ranks:  perseusrun -np 2 python benchmarks/gradient_sets.py   (or mpirun -np 2 ...)

Each step submits every gradient tensor in reverse order (as backward produces them), then waits for all.
Measured in one run, on the same buffers: perseus (op=Average, as DistributedOptimizer uses), plain
MPI_Allreduce on the same data cut into ~6 MB pieces with no copies (the per-tensor bound), with the library
initialised and idle, torch.distributed gloo with DDP-style 25 MB buckets, and Horovod when it is installed
(--only horovod, in a job of its own from Horovod's venv). Reports the median of --steps steps after
--warmup steps, and ratios. benchmarks/run_all.py runs the comparison the docs quote (benchmarks/core_job.py:
also the flat-buffer bound, the idle library's cost, and the libraries' jobs alternating round by round).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def resnet50_shapes():
    """The 161 gradient tensors of torchvision's ResNet-50 (25.6M parameters), in forward order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def bert_large_shapes():
    """The 391 gradient tensors of BERT-large (embeddings, 24 layers, pooler; ~335M parameters)."""
    h, inter, vocab, layers = 1024, 4096, 30522, 24
    shapes = [(vocab, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (inter, h), (inter,), (h, inter), (h,), (h,), (h,)]
    shapes += [(h, h), (h,)]
    return shapes


def make_grads(shapes, torch_mod):
    g = torch_mod.Generator().manual_seed(0)
    return [torch_mod.randn(s, generator=g) for s in shapes]


def interleaved(fns: dict, warmup: int, steps: int, comm) -> dict:
    """Time every method once per round, rotating, so that all see the same machine conditions.

    Returns per-method milliseconds (per step, the slowest rank's time). The library under test stays
    initialised and idle while the bound runs (benchmarks/core_job.py also measures what that idle costs).
    """
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(warmup + steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            comm.Barrier()
            t0 = time.perf_counter()
            fns[name]()
            elapsed = comm.allreduce(time.perf_counter() - t0, op=MPI_MAX())
            if i >= warmup:
                times[name].append(elapsed * 1e3)
    return times


def MPI_MAX():
    from mpi4py import MPI

    return MPI.MAX


def bench_perseus(grads, hvd):
    handles = []

    def step():
        handles.clear()
        for i in range(len(grads) - 1, -1, -1):
            handles.append(hvd.allreduce_async_(grads[i], name=f"g{i}", op=hvd.Average))
        for h in handles:
            hvd.synchronize(h)
    return step


def bench_mpi_chunked(grads, comm, MPI, chunk_bytes=6 << 20):
    flats = [g.view(-1).numpy() for g in reversed(grads)]

    def step():
        for arr in flats:
            step_n = max(chunk_bytes // arr.itemsize, 1)
            for s in range(0, arr.size, step_n):
                comm.Allreduce(MPI.IN_PLACE, arr[s:s + step_n], op=MPI.SUM)
    return step


def bench_gloo(grads, dist, torch_mod, bucket_bytes=25 << 20):
    buckets, cur, cur_bytes = [], [], 0
    for g in reversed(grads):
        cur.append(g)
        cur_bytes += g.numel() * 4
        if cur_bytes >= bucket_bytes:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)
    flat = [torch_mod.empty(sum(t.numel() for t in b)) for b in buckets]

    def step():
        works = []
        for b, f in zip(buckets, flat):
            torch_mod.cat([t.view(-1) for t in b], out=f)
            works.append(dist.all_reduce(f, async_op=True))
        for b, f, w in zip(buckets, flat, works):
            w.wait()
            f.div_(dist.get_world_size())
            off = 0
            for t in b:
                t.view(-1).copy_(f[off:off + t.numel()])
                off += t.numel()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sets", default="resnet50,bert_large")
    ap.add_argument("--only", default="perseus,mpi,gloo", help="comma list of perseus, mpi, gloo, horovod")
    ap.add_argument("--json", default="", help="append results as JSON lines to this file (rank 0)")
    ap.add_argument("--tag", default="", help="label stored with the results (e.g. a setting under test)")
    args = ap.parse_args()
    import torch

    which = set(args.only.split(","))
    results = {}
    # MPI first (mpi4py initialises it); the bound is measured with the library initialised and idle.
    from mpi4py import MPI

    if "horovod" in which:
        import horovod.torch as hvd
    else:
        import perseus.torch as hvd
    hvd.init()

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    dist = None
    if "gloo" in which:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=rank, world_size=size)
    for set_name in args.sets.split(","):
        shapes = {"resnet50": resnet50_shapes, "bert_large": bert_large_shapes}[set_name]()
        grads = make_grads(shapes, torch)
        nparams = sum(g.numel() for g in grads)
        row = {"bench": "gradient_sets", "set": set_name, "tensors": len(grads), "params": nparams, "ranks": size,
               "tag": args.tag}
        fns = {}
        if "mpi" in which:
            fns["mpi_chunked"] = bench_mpi_chunked(grads, comm, MPI)
        hvd_name = None
        for name in ("perseus", "horovod"):
            if name in which:
                fns[name] = bench_perseus(grads, hvd)
                hvd_name = name
        if dist is not None:
            fns["gloo"] = bench_gloo(grads, dist, torch)
        times = interleaved(fns, args.warmup, args.steps, comm)
        for name, ts in times.items():
            row[f"{name}_ms"] = round(float(np.median(ts)), 2)
        if "mpi_chunked" in times:
            for name, ts in times.items():
                if name != "mpi_chunked":  # per-round ratio, then the median: robust to machine drift
                    ratios = np.array(ts) / np.array(times["mpi_chunked"])
                    row[f"{name}_over_bound"] = round(float(np.median(ratios)), 3)
        results[set_name] = row
        if rank == 0:
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if rank == 0:
        for r in results.values():
            for name in ("perseus", "horovod", "gloo"):
                if f"{name}_over_bound" in r:
                    print(f"{r['set']}: {name} / chunked-MPI bound = {r[f'{name}_over_bound']:.2f}x "
                          f"(median of per-round ratios)", flush=True)
    if dist is not None:
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
