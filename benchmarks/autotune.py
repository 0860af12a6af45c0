"""The run-time tuner on a gradient set: tuned from a bad setting vs the default vs an exhaustive grid.

Run on 2 ranks (or across emulated hosts):  mpirun -np 2 python benchmarks/autotune.py --set resnet50

In one job, on the same buffers (a step all-reduces every gradient of the set, reverse order, Average):

1. the tuner starts from a deliberately bad setting (--bad) and searches for --budget steps (ordinary
   steps: their times count);
2. an exhaustive grid (channels x unit size x algorithm, in-place threshold and cycle time at their
   defaults) is measured point by point, --grid-steps steps each (median), switching with the same TUNE
   requests the tuner uses;
3. the tuner's final setting, the default setting and the grid's best point are then measured in
   interleaved blocks (--blocks x --block-steps steps each) and compared by median.

Prints (rank 0) the tuned / grid-best ratio (target <= 1.10) and the projected time of search + 300 steps
against 300 steps of the default setting (target: below). --horovod instead runs Horovod 0.28.1 with
HOROVOD_AUTOTUNE=1 for --horovod-steps steps and reports how its step time evolves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MB = 1 << 20
ALGS = {"auto": 0, "mpi": 1, "ring": 2, "hierarchical": 3}


def parse_setting(text: str) -> tuple:
    """'fusion_mb,inplace_kb,channels,cycle_ms,algorithm' -> TUNE values."""
    f, i, c, cyc, alg = text.split(",")
    return (int(float(f) * MB), int(float(i) * 1024), int(c), int(float(cyc) * 1000), ALGS[alg])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="resnet50", choices=("resnet50", "bert_large"))
    ap.add_argument("--bad", default="64,4096,8,1,mpi", help="fusion MB, in-place KB, channels, cycle ms, algorithm")
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--grid-steps", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--horovod", action="store_true")
    ap.add_argument("--horovod-steps", type=int, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch

    from gradient_sets import bench_perseus, bert_large_shapes, make_grads, resnet50_shapes

    grads = make_grads({"resnet50": resnet50_shapes, "bert_large": bert_large_shapes}[args.set](), torch)
    if args.horovod:
        return horovod_run(args, grads, bench_perseus)

    bad = parse_setting(args.bad)
    # The tuner starts at init from the bad setting (explicit values, tuned all the same), with no memory
    # of earlier runs (the cache directory cannot be created).
    os.environ.update({
        "PERSEUS_AUTOTUNE": "1", "PERSEUS_AUTOTUNE_FIXED": "none", "PERSEUS_AUTOTUNE_BUDGET_STEPS": str(args.budget),
        "PERSEUS_AUTOTUNE_WARMUP_SAMPLES": "0", "PERSEUS_CACHE_DIR": "/proc/perseus-benchmark-no-cache",
        "PERSEUS_FUSION_THRESHOLD": str(bad[0]), "PERSEUS_INPLACE_THRESHOLD": str(bad[1]),
        "PERSEUS_NUM_CHANNELS": str(bad[2]), "PERSEUS_CYCLE_TIME": str(bad[3] / 1000),
        "PERSEUS_ALLREDUCE_ALGORITHM": [k for k, v in ALGS.items() if v == bad[4]][0],
    })
    import perseus.torch as hvd
    from perseus.runtime.state import runtime
    from perseus.base.knobs import knob
    from perseus.engine.settings import topology_channels

    hvd.init()
    engine = runtime().engine
    tuner = runtime()._tuner
    rank = hvd.rank()
    step = bench_perseus(grads, hvd)
    seq = itertools.count()

    def apply(values):
        engine.wait(engine.tune(0, f"bench.tune.{next(seq)}", *values), 60.0)

    def timed(n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            out.append(hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max, name="bench.t").item())
        return out

    topo = runtime()._topology
    # the default channel count is chosen by topology at init() (0: one host 1, several hosts more)
    default = (knob("fusion_threshold_bytes").default, knob("inplace_threshold_bytes").default,
               topology_channels(knob("num_channels").default, topo.local_size < topo.size),
               int(knob("cycle_time_ms").default * 1000), 0)
    max_channels = engine.params(0)[5]
    # 1. the tuner, from the bad setting: every step until every rank's tuner has finished
    search_times = []
    while True:
        search_times += timed(1)
        done = hvd.allreduce(torch.tensor([1.0 if tuner.done else 0.0]), op=hvd.Min, name="bench.done").item()
        if done == 1.0:
            break
    tuned = tuner.result.values()
    # 2. the grid
    algorithms = [0, 1, 2] + ([3] if topo[5] > 1 and topo[3] > 1 else [])
    grid = [(f, default[1], c, default[3], a) for c in (1, 2, 4, 8) if c <= max_channels
            for f in (1 * MB, 4 * MB, 16 * MB, 64 * MB) for a in algorithms]
    grid_times = {}
    for point in grid:
        apply(point)
        timed(1)  # the step during the switch
        grid_times[point] = statistics.median(timed(args.grid_steps))
    grid_best = min(grid_times, key=grid_times.get)
    # 3. interleaved blocks
    contenders = {"tuned": tuned, "default": default, "grid_best": grid_best}
    blocks = {name: [] for name in contenders}
    for b in range(args.blocks):
        names = list(contenders)
        for name in names[b % 3:] + names[:b % 3]:
            apply(contenders[name])
            timed(1)
            blocks[name] += timed(args.block_steps)
    med = {name: statistics.median(ts) for name, ts in blocks.items()}
    row = {
        "bench": "autotune", "set": args.set, "ranks": hvd.size(), "bad": bad, "default": default, "tuned": tuned,
        "grid_best": grid_best, "grid_points": len(grid), "search_steps": len(search_times),
        "search_s": round(sum(search_times), 3), "samples": tuner.samples,
        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "tuned_over_grid_best": round(med["tuned"] / med["grid_best"], 3),
        "search_plus_300_s": round(sum(search_times) + 300 * med["tuned"], 2),
        "default_300_s": round(300 * med["default"], 2),
        "bad_ms": round(statistics.median(search_times[:3]) * 1e3, 2),
    }
    if rank == 0:
        print(json.dumps(row), flush=True)
        print(f"{args.set}: tuned {med['tuned'] * 1e3:.1f} ms/step, grid best {med['grid_best'] * 1e3:.1f} "
              f"({row['tuned_over_grid_best']:.2f}x), default {med['default'] * 1e3:.1f}; search {len(search_times)} "
              f"steps {sum(search_times):.1f} s; search+300 = {row['search_plus_300_s']:.1f} s vs default 300 = "
              f"{row['default_300_s']:.1f} s", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    hvd.shutdown()
    return 0


def horovod_run(args, grads, bench) -> int:
    os.environ["HOROVOD_AUTOTUNE"] = "1"
    import horovod.torch as hvd
    import torch

    hvd.init()
    step = bench(grads, hvd)
    times = []
    for _ in range(args.horovod_steps):
        t0 = time.perf_counter()
        step()
        times.append(hvd.allreduce(torch.tensor([time.perf_counter() - t0]), op=hvd.Max, name="bench.t").item())
    if hvd.rank() == 0:
        tail = statistics.median(times[-30:])
        row = {"bench": "autotune_horovod", "set": args.set, "ranks": hvd.size(), "steps": len(times),
               "median_ms_by_50": [round(statistics.median(times[i:i + 50]) * 1e3, 2) for i in range(0, len(times), 50)],
               "final_ms": round(tail * 1e3, 2), "total_s": round(sum(times), 2)}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
