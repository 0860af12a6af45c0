"""Soak: random mixed collectives for a long time, every result checked, memory and hangs watched.

Run on 3 ranks (by hand, for an hour):
    mpirun -np 3 python benchmarks/soak.py --duration 3600 --out soak.json

Each step picks, from an RNG seeded by (--seed, step) and so the same on every rank, one of: a synchronous
collective (allreduce, allgather, broadcast, alltoall, reducescatter), a grouped one (grouped_allreduce,
grouped_allgather, grouped_reducescatter), or a batch of asynchronous ones of mixed kinds that each rank then
synchronizes in its own random order; with random dtypes (float32/64, float16, bfloat16, int8/32/64, uint8)
and random sizes (1 element to --max-bytes). Each rank sleeps a random few milliseconds before some steps
(its own RNG: the only thing that differs between ranks). Now and then one rank stops early: it calls
join() while the others run a few more allreduces (the joined rank counts as zeros), then join() themselves.

A watchdog thread ends the run with exit status 3 when one collective has not finished after --watchdog
seconds (a hang); a wrong result or an exception ends it with status 1. Rank 0 prints a JSON report (and
writes it to --out): operations done, ops/s, each rank's RSS at the start, after --warmup seconds, at the end
and at 20 points between (each read after gc.collect() and malloc_trim(0), so that memory the allocator
keeps free does not count), the growth after the warm-up (end minus warm-up reading, and per hour; and the
least-squares slope of the samples after the warm-up), joins, hangs and errors. Every report is one line that starts
with "soak report: " and ends with the JSON (a rank that hangs or fails prints its own).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import sys
import threading
import time
import traceback

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
          torch.uint8]
KINDS = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
MODES = ["sync"] * 4 + ["grouped", "async", "async"]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


try:
    _trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _trim = None


def settled_rss() -> int:
    """RSS once Python's garbage is collected and glibc has handed its free heap memory back (malloc_trim):
    what is still in use, without the allocator's cached free blocks that make single readings jump."""
    gc.collect()
    if _trim is not None:
        _trim(0)
    return rss_bytes()


def slope_per_hour(samples, since: float) -> float:
    """Least-squares growth, in MB per hour, of (seconds, MB) samples taken at or after `since`."""
    pts = [(t, m) for t, m in samples if t >= since]
    if len(pts) < 2:
        return 0.0
    mt = sum(t for t, _ in pts) / len(pts)
    mm = sum(m for _, m in pts) / len(pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 0.0 if var == 0 else sum((t - mt) * (m - mm) for t, m in pts) / var * 3600


class Watchdog:
    """Times each collective of the main thread; one that runs past limit_s is a hang: the report says which,
    and the process exits with status 3 (mpirun then ends the other ranks)."""

    def __init__(self, rank: int, limit_s: float, report):
        self.rank, self.limit_s, self.report = rank, limit_s, report
        self.what, self.since = None, 0.0
        threading.Thread(target=self._watch, daemon=True, name="soak-watchdog").start()

    def start(self, what: str):
        self.since, self.what = time.monotonic(), what

    def stop(self):
        self.what = None

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.limit_s / 4))
            what = self.what
            if what is not None and time.monotonic() - self.since > self.limit_s:
                self.report(hang=f"rank {self.rank}: {what} did not finish within {self.limit_s:.0f} s")
                os._exit(3)


class Soak:
    """The state of one rank's run: its RNGs, counters and the checks."""

    def __init__(self, hvd, args):
        self.hvd, self.args = hvd, args
        self.rank, self.size = hvd.rank(), hvd.size()
        self.ops = self.tensors = self.joins = self.steps = 0
        self.by_kind: dict[str, int] = {}
        self.local = random.Random(args.seed * 7919 + self.rank)  # this rank's delays and wait order
        self.watchdog = Watchdog(self.rank, args.watchdog, self.emergency)

    # -- values --------------------------------------------------------------------------------------
    @staticmethod
    def pattern(n: int, offset: int, dtype) -> torch.Tensor:
        """Small integers (exact in every dtype, sums over a few ranks fit int8): (i % 7) + offset."""
        return (torch.arange(n, dtype=torch.int64) % 7 + offset).to(dtype)

    def elements(self, rng: random.Random, dtype) -> int:
        """Log-uniform between 1 and --max-bytes worth of dtype."""
        top = max(1, self.args.max_bytes // torch.empty((), dtype=dtype).element_size())
        return max(1, int(math.exp(rng.uniform(0, math.log(top)))))

    # -- bookkeeping ---------------------------------------------------------------------------------
    def call(self, what: str, fn, *args, **kwargs):
        """Run one collective (or synchronize) under the watchdog."""
        self.watchdog.start(what)
        try:
            return fn(*args, **kwargs)
        finally:
            self.watchdog.stop()

    def count(self, kind: str, tensors: int = 1):
        self.ops += 1
        self.tensors += tensors
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def tamper(self, x: torch.Tensor) -> torch.Tensor:
        """x, or x + 1 at --wrong-at-step (to show that the checks catch a wrong result)."""
        return x + 1 if self.steps == self.args.wrong_at_step and x.numel() else x

    def expect(self, ok: bool, what: str):
        if not ok:
            raise AssertionError(f"rank {self.rank}, step {self.steps}: wrong result of {what}")

    # -- one collective: (start it, check its result) ---------------------------------------------------
    def plan(self, kind: str, rng: random.Random, name: str, run_async: bool):
        """Start one collective of `kind` (asynchronously when run_async) from shared random choices; return
        (handle or result, check(result)). Every rank draws the same numbers from rng."""
        hvd, size, rank = self.hvd, self.size, self.rank
        dtype = rng.choice(DTYPES)
        floating = dtype.is_floating_point
        total = size * (size - 1) // 2
        if kind == "allreduce":
            n = self.elements(rng, dtype)
            op = rng.choice(["Sum", "Min", "Max"] + (["Average"] if floating else []))
            scale = size if op == "Average" else 1
            x = ((torch.arange(n) % 7 + rank) * scale).to(dtype)
            p = self.pattern(n, 0, torch.int64)
            want = {"Sum": p * size + total, "Average": p * size + total, "Min": p, "Max": p + size - 1}[op]
            fn = hvd.allreduce_async if run_async else hvd.allreduce
            return fn(self.tamper(x), op=getattr(hvd, op), name=name), \
                lambda out: self.expect(torch.equal(out.to(torch.int64), want), f"allreduce {op} {n} x {dtype}")
        if kind == "allgather":
            cols = rng.randint(1, 16)
            rows = [self.elements(rng, dtype) // cols for _ in range(size)]
            x = self.pattern(rows[rank] * cols, rank, dtype).view(rows[rank], cols)
            want = torch.cat([self.pattern(rows[r] * cols, r, torch.int64) for r in range(size)]).view(-1, cols)
            fn = hvd.allgather_async if run_async else hvd.allgather
            return fn(self.tamper(x), name=name), \
                lambda out: self.expect(torch.equal(out.to(torch.int64), want), f"allgather {rows} x {cols} {dtype}")
        if kind == "broadcast":
            n, root = self.elements(rng, dtype), rng.randrange(size)
            x = self.pattern(n, rank, dtype)
            fn = hvd.broadcast_async if run_async else hvd.broadcast
            want = self.pattern(n, root, torch.int64)
            return fn(self.tamper(x), root, name=name), \
                lambda out: self.expect(torch.equal(out.to(torch.int64), want), f"broadcast {n} x {dtype} from {root}")
        if kind == "alltoall":
            cols = rng.randint(1, 8)
            budget = max(1, self.elements(rng, dtype) // (cols * size))
            splits = [[rng.randint(0, budget) for _ in range(size)] for _ in range(size)]
            x = torch.cat([torch.full((splits[rank][d], cols), (rank * size + d) % 23, dtype=dtype)
                           for d in range(size)])
            want = torch.cat([torch.full((splits[s][rank], cols), (s * size + rank) % 23, dtype=torch.int64)
                              for s in range(size)])
            received = [splits[s][rank] for s in range(size)]

            def check(res):
                out, got = res
                self.expect(got.tolist() == received and torch.equal(out.to(torch.int64), want),
                            f"alltoall {splits} x {cols} {dtype}")
            fn = hvd.alltoall_async if run_async else hvd.alltoall
            return fn(self.tamper(x), splits=torch.tensor(splits[rank]), name=name), check
        return self.plan_reducescatter(rng, dtype, name, run_async)

    def plan_reducescatter(self, rng, dtype, name, run_async):
        hvd, size, rank = self.hvd, self.size, self.rank
        cols = rng.randint(1, 16)
        rows = max(1, self.elements(rng, dtype) // cols)
        op = rng.choice(["Sum", "Average"] if dtype.is_floating_point else ["Sum"])
        scale = size if op == "Average" else 1
        x = ((torch.arange(rows * cols) % 7 + rank) * scale).to(dtype).view(rows, cols)
        mine = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(mine[:rank]) * cols
        full = self.pattern(rows * cols, 0, torch.int64) * size + size * (size - 1) // 2
        want = full[start:start + mine[rank] * cols].view(mine[rank], cols)
        fn = hvd.reducescatter_async if run_async else hvd.reducescatter
        return fn(self.tamper(x), op=getattr(hvd, op), name=name), \
            lambda out: self.expect(torch.equal(out.to(torch.int64), want), f"reducescatter {op} ({rows}, {cols})")

    # -- steps ---------------------------------------------------------------------------------------
    def step(self, step: int):
        rng = random.Random(self.args.seed * 1_000_003 + step)  # the same on every rank
        if self.local.random() < 0.3:
            time.sleep(self.local.uniform(0, self.args.max_delay_ms) / 1000)
        if step == self.args.stall_at_step and self.rank == self.size - 1:
            time.sleep(1e6)  # this rank stops taking part: the others' watchdogs must notice
        if self.size > 1 and rng.random() < 1.0 / self.args.join_every and step != self.args.wrong_at_step:
            return self.join_episode(rng)
        mode = "sync" if step == self.args.wrong_at_step else rng.choice(MODES)
        if mode == "sync":
            kind = rng.choice(KINDS)
            result, check = self.call(f"{kind} (step {step})", self.plan, kind, rng, f"soak.{kind}", False)
            check(result)
            self.count(kind)
        elif mode == "grouped":
            self.grouped(rng, step)
        else:
            self.batch(rng, step)

    def batch(self, rng: random.Random, step: int):
        """Several collectives in flight at once; this rank waits for them in its own order."""
        started = []
        for j in range(rng.randint(2, 8)):
            kind = rng.choice(KINDS)
            handle, check = self.call(f"{kind} async (step {step})", self.plan, kind, rng, f"soak.async.{j}", True)
            started.append((kind, handle, check))
        self.local.shuffle(started)
        for kind, handle, check in started:
            check(self.call(f"synchronize {kind} (step {step})", self.hvd.synchronize, handle))
            self.count(f"{kind}_async")

    def grouped(self, rng: random.Random, step: int):
        hvd, size, rank = self.hvd, self.size, self.rank
        kind = rng.choice(["allreduce", "allgather", "reducescatter"])
        dtype = rng.choice(DTYPES)
        k = rng.randint(2, 6)
        sizes = [max(size, self.elements(rng, dtype) // k) for _ in range(k)]
        xs = [self.pattern(n, rank, dtype) for n in sizes]
        what = f"grouped_{kind} {sizes} x {dtype} (step {step})"
        if kind == "allreduce":
            outs = self.call(what, hvd.grouped_allreduce, xs, op=hvd.Sum, name="soak.grouped_allreduce")
            wants = [self.pattern(n, 0, torch.int64) * size + size * (size - 1) // 2 for n in sizes]
        elif kind == "allgather":
            outs = self.call(what, hvd.grouped_allgather, xs, name="soak.grouped_allgather")
            wants = [torch.cat([self.pattern(n, r, torch.int64) for r in range(size)]) for n in sizes]
        else:
            outs = self.call(what, hvd.grouped_reducescatter, xs, op=hvd.Sum, name="soak.grouped_reducescatter")
            wants = []
            for n in sizes:
                parts = [n // size + (1 if r < n % size else 0) for r in range(size)]
                s = sum(parts[:rank])
                wants.append((self.pattern(n, 0, torch.int64) * size + size * (size - 1) // 2)[s:s + parts[rank]])
        self.expect(len(outs) == k and all(torch.equal(o.to(torch.int64), w) for o, w in zip(outs, wants)), what)
        self.count(f"grouped_{kind}", k)

    def join_episode(self, rng: random.Random):
        """One rank (the same on every rank) joins at once; the others run a few allreduces without it, then
        join too. Every rank must be told the same last rank to join, one of the others."""
        hvd = self.hvd
        early, extra = rng.randrange(self.size), rng.randint(1, 4)
        if self.rank != early:
            for j in range(extra):
                n = self.elements(rng, torch.float32)
                x = self.pattern(n, self.rank, torch.float32)
                out = self.call("allreduce while a rank has joined", hvd.allreduce, x, op=hvd.Sum,
                                name=f"soak.joined.{j}")
                others = [r for r in range(self.size) if r != early]
                want = self.pattern(n, 0, torch.int64) * len(others) + sum(others)
                self.expect(torch.equal(out.to(torch.int64), want), f"allreduce with rank {early} joined")
                self.count("allreduce_joined")
        last = self.call("join", hvd.join)
        lasts = self.call("allgather after join", hvd.allgather, torch.tensor([last]), name="soak.join.last")
        self.expect(len(set(lasts.tolist())) == 1 and last != early, f"join (rank {early} early): lasts {lasts}")
        self.joins += 1
        self.count("join")

    def emergency(self, hang=None, error=None):
        """Report from this rank alone (a hang or an error stops the job)."""
        print("soak report: " + json.dumps({"rank": self.rank, "steps": self.steps, "operations": self.ops,
                          "hangs": 1 if hang else 0, "errors": 1 if error else 0, "hang": hang, "error": error}),
              flush=True)


def run(hvd, args) -> dict:
    soak = Soak(hvd, args)
    rss_start = settled_rss()
    started = time.monotonic()
    deadline = started + args.duration
    warm = None  # (time, rss, operations) once the warm-up is over
    samples, every = [], args.duration / 20  # RSS now and then, to tell a plateau from a steady climb
    step = 0
    while True:
        if time.monotonic() - started >= len(samples) * every:
            samples.append((round(time.monotonic() - started, 1), round(settled_rss() / 2**20, 1)))
        if step % 16 == 0:  # every rank stops at the same step: the first rank past the deadline decides
            late = float(time.monotonic() >= deadline)
            stop = soak.call("stop check", hvd.allreduce, torch.tensor([late]), op=hvd.Max, name="soak.stop")
            if stop.item() > 0:
                break
        if warm is None and time.monotonic() - started >= args.warmup:
            warm = (time.monotonic(), settled_rss(), soak.ops)
        soak.step(step)
        soak.steps = step = step + 1
    ended, rss_end = time.monotonic(), settled_rss()
    samples.append((round(ended - started, 1), round(rss_end / 2**20, 1)))
    if warm is None:
        warm = (started, rss_start, 0)
    growth = rss_end - warm[1]
    per_hour = growth / max(ended - warm[0], 1e-9) * 3600
    mine = {"rss_start_mb": rss_start / 2**20, "rss_after_warmup_mb": warm[1] / 2**20, "rss_end_mb": rss_end / 2**20,
            "rss_growth_after_warmup_mb": growth / 2**20, "rss_growth_mb_per_hour": per_hour / 2**20,
            "rss_slope_mb_per_hour": slope_per_hour(samples, args.warmup), "operations": soak.ops,
            "tensors": soak.tensors, "samples_s_mb": samples}
    everyone = hvd.allgather_object(mine)
    elapsed = ended - started
    return {
        "ranks": soak.size, "seed": args.seed, "duration_s": round(elapsed, 1), "steps": step,
        "operations": soak.ops, "tensors": soak.tensors, "ops_per_s": round(soak.ops / elapsed, 1),
        "operations_after_warmup": soak.ops - warm[2], "warmup_s": args.warmup,
        "by_kind": dict(sorted(soak.by_kind.items())), "joins": soak.joins, "hangs": 0, "errors": 0,
        # per rank: RSS at the start, after the warm-up and at the end, and (seconds, MB) samples
        "rss_mb": [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in everyone],
        "max_rss_growth_after_warmup_mb": round(max(r["rss_growth_after_warmup_mb"] for r in everyone), 1),
        "max_rss_growth_mb_per_hour": round(max(r["rss_growth_mb_per_hour"] for r in everyone), 1),
        "max_rss_slope_mb_per_hour": round(max(r["rss_slope_mb_per_hour"] for r in everyone), 1),
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="seconds to run (default: an hour)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the RSS baseline is taken (default: a quarter of --duration, at most 300)")
    p.add_argument("--watchdog", type=float, default=60.0, help="seconds one collective may take before it "
                                                                  "counts as a hang")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="largest tensor, in bytes")
    p.add_argument("--max-delay-ms", type=float, default=5.0, help="longest random pause of a rank before a step")
    p.add_argument("--join-every", type=int, default=200, help="one step in this many (on average) is a join")
    p.add_argument("--out", default=None, help="also write the JSON report here (rank 0)")
    p.add_argument("--stall-at-step", type=int, default=-1,
                   help="(to test the watchdog) the last rank stops taking part at this step")
    p.add_argument("--wrong-at-step", type=int, default=-1,
                   help="(to test the checks) every rank adds 1 to its input at this step")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(300.0, args.duration / 4)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import perseus.torch as hvd

    hvd.init()
    try:
        report = run(hvd, args)
    except Exception:  # a wrong result or a failed collective: report it, stop every rank
        text = traceback.format_exc()
        print("soak report: " + json.dumps({"rank": hvd.rank(), "hangs": 0, "errors": 1, "error": text}), flush=True)
        sys.stderr.write(text)
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        return 1
    if hvd.rank() == 0:
        print("soak report: " + json.dumps(report), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=1) + "\n")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
