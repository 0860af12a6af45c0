"""What committing every step costs an elastic job: step time with and without ``state.commit()``.

A data-parallel job on 2 emulated hosts (1 rank each; tools/emulated_cluster.sh) under perseusrun's elastic
launcher trains an MLP whose state (parameters + SGD momentum, float32) is --state-mb MB. Modes:

  none     no commit (the baseline)
  gemini   state.commit() after every step, the defaults: the optimizer's tensors are copied in the background
           (the next step() waits for the copy), the copies to this host's and the peer host's keepers travel in
           chunks when the job's own collectives are off the network
  eager    state.commit() after every step, everything at once: PERSEUS_ELASTIC_SNAPSHOT=sync (the copy before
           commit() returns) and PERSEUS_GEMINI_MAX_DEFER_MS=0 (chunks sent without waiting for a gap)

Rounds interleave the modes; the median step time of each mode (steps after the first --warmup), and the ratio
to ``none``.

    tools/emulated_cluster.sh up 2 0 0 1
    python benchmarks/elastic_commit.py --state-mb 128 --rounds 3 --json benchmarks/results/elastic.jsonl
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = {"none": {}, "gemini": {},
         "eager": {"PERSEUS_ELASTIC_SNAPSHOT": "sync", "PERSEUS_GEMINI_MAX_DEFER_MS": "0"}}


def job(mode: str, out: str, state_mb: float, steps: int, batch: int) -> None:
    import torch

    import perseus.torch as hvd

    sys.path.insert(0, HERE)
    from elastic_recovery import _model

    hvd.init()
    model, opt, width = _model(state_mb)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)
    x = torch.randn(batch, width)
    times = []

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            state.step += 1
            if mode != "none":
                state.commit()
            times.append(time.perf_counter() - t0)

    train(state)
    if hvd.rank() == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(times, f)
    hvd.shutdown()


def run_once(mode, args, root):
    out = tempfile.mkdtemp(prefix=f"commit-{mode}-", dir=root)
    disc = os.path.join(out, "discover.sh")
    with open(disc, "w") as f:
        f.write("#!/bin/sh\n" + "".join(f"echo {h}:1\n" for h in args.hosts.split(",")))
    os.chmod(disc, 0o755)
    env = dict(os.environ, **MODES[mode])
    command = [sys.executable, os.path.abspath(__file__), "--job", mode, "--out", out, "--state-mb",
               str(args.state_mb), "--steps", str(args.steps), "--batch", str(args.batch)]
    with open(os.path.join(out, "launcher.log"), "w") as log:
        code = subprocess.run([sys.executable, "-m", "perseus.runner.launch", "-np", "2", "--min-np", "2",
                               "--max-np", "2", "--host-discovery-script", disc, "--network-interface", "perseus0",
                               *command], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=900).returncode
    if code != 0:
        raise RuntimeError(f"{mode}: the job failed (status {code}); see {out}/launcher.log")
    with open(os.path.join(out, "times.json")) as f:
        times = json.load(f)[args.warmup:]
    return dict(mode=mode, step_s=statistics.median(times), steps=len(times))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--state-mb", type=float, default=128.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=256, help="samples per rank and step (the compute per step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--hosts", default="perseus-h0,perseus-h1")
    p.add_argument("--json", help="append the results to this JSON-lines file")
    args = p.parse_args()
    if args.job:
        return job(args.job, args.out, args.state_mb, args.steps, args.batch)
    modes = args.modes.split(",")
    root = tempfile.mkdtemp(prefix="elastic-commit-")
    results = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:
            res = run_once(m, args, root)
            results[m].append(res["step_s"])
            print(json.dumps(dict(round=r, **res)), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(dict(bench="elastic_commit", round=r, state_mb=args.state_mb,
                                            batch=args.batch, **res)) + "\n")
    base = statistics.median(results["none"]) if "none" in results else None
    print(f"\nstate {args.state_mb:g} MB, batch {args.batch}/rank, medians of {args.rounds} round(s)")
    for m in modes:
        med = statistics.median(results[m])
        ratio = f"{med / base:.3f}x" if base else "-"
        print(f"{m:8s} step {med * 1000:8.1f} ms   vs none {ratio}")


if __name__ == "__main__":
    main()
