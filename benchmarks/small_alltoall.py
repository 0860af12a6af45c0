"""Small alltoall latency: microseconds per synchronous 16-float-per-rank alltoall of perseus.torch, with a
1-float synchronous allreduce measured in the same job as a reference (medians of rounds of 1000 calls).

Run on 2 ranks:  mpirun -np 2 python benchmarks/small_alltoall.py [--rounds 5] [--json FILE --tag TAG]
"""

import argparse
import json
import statistics
import time

import torch

import perseus.torch as hvd


def per_call_us(fn, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean time of ``calls`` calls of ``fn``, in microseconds."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", default="", help="append the result as a JSON line to this file (rank 0)")
    ap.add_argument("--tag", default="", help="label stored with the result")
    args = ap.parse_args()
    hvd.init()
    x, y = torch.ones(16 * hvd.size()), torch.ones(16)
    for _ in range(200):  # warm-up: names negotiated, buffers allocated
        hvd.alltoall(x, name="a2a.warmup")
    row = {"bench": "small_alltoall", "ranks": hvd.size(), "tag": args.tag,
           "alltoall_us": round(per_call_us(lambda: hvd.alltoall(x, name="a2a"), args.calls, args.rounds), 2),
           "allreduce_us": round(per_call_us(lambda: hvd.allreduce(y, name="ar"), args.calls, args.rounds), 2)}
    if hvd.rank() == 0:
        print(row)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    hvd.shutdown()


if __name__ == "__main__":
    main()
