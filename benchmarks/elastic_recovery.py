"""Recovery after kill -9 of a worker: Gemini (in-memory commits) vs restoring from a disk checkpoint.

A data-parallel job on 2 emulated hosts (1 rank each; tools/emulated_cluster.sh) trains an MLP whose state
(parameters + SGD momentum, float32) is --state-mb MB, committing after every step. At step --kill-step rank 1
kills itself with SIGKILL; the job must go on on the surviving host. Methods:

  inprocess  perseusrun's elastic launcher, the default: the survivor re-forms the job in process (MPI's ULFM
             revoke + shrink), restores its last commit from its own memory and continues
  relaunch   perseusrun's elastic launcher with PERSEUS_ELASTIC_IN_PROCESS=0: the launcher starts the job
             again on the good host and the rank restores the newest commit from the keepers' memory
  disk       a static perseusrun job saving a checkpoint to disk (torch.save + fsync, rank 0) after every step;
             after the failure the job is started again (as a scheduler would, at once) on the good host and
             loads the checkpoint (torch.load) -- the usual way without an elastic launcher

Recovery time = (the moment training resumes from the restored state) - (the moment of the kill). Also
reported: the time lost to the failure (end of the first step after it, less the kill time and that step's
own duration), the time to get the state back (restore), and the normal step time with the commit (or the
disk save) after every step. Rounds interleave the methods; medians and ratios.

    tools/emulated_cluster.sh up 2 0 0 1
    python benchmarks/elastic_recovery.py --state-mb 128 --rounds 3 --json benchmarks/results/elastic.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = ("inprocess", "relaunch", "disk")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# ----------------------------------------------------------------------------------------------- job side
def _model(state_mb: float):
    import torch

    # parameters + momentum = 2 x 4 bytes per parameter
    width = 2048
    layers = max(1, round(state_mb * (1 << 20) / 8 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9), width


def job(mode: str, out: str, state_mb: float, steps: int, kill_step: int) -> None:
    import torch

    import perseus.torch as hvd

    hvd.init()
    gen = int(os.environ.get("PERSEUS_ELASTIC_GENERATION", "0"))
    restart = os.environ.get("BENCH_RESTART") == "1"
    model, opt, width = _model(state_mb)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    log = open(os.path.join(out, "events.jsonl"), "a")

    def event(kind, **kw):
        log.write(json.dumps(dict(kind=kind, rank=hvd.rank(), size=hvd.size(), gen=gen, t=time.time(), **kw))
                  + "\n")
        log.flush()

    x = torch.randn(32, width)

    def one_step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    ckpt = os.path.join(out, "ckpt.pt")
    if mode == "disk":
        step = 0
        hvd.broadcast_parameters(model.state_dict(), 0)
        if restart:
            t0 = time.time()
            saved = torch.load(ckpt, weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            step = saved["step"]
            event("restored", step=step, seconds=time.time() - t0)
        while step < steps:
            if not restart and step == kill_step and hvd.rank() == 1:
                event("kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.time()
            one_step()
            step += 1
            if hvd.rank() == 0:
                ts = time.time()
                with open(ckpt + ".tmp", "wb") as f:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(ckpt + ".tmp", ckpt)
                event("step", step=step, seconds=time.time() - t0, commit=time.time() - ts)
        hvd.shutdown()
        return

    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def train(state):
        event("restored", step=state.step)
        while state.step < steps:
            if gen == 0 and state.step == kill_step and hvd.rank() == 1 and hvd.size() == 2:
                event("kill", step=state.step)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.time()
            one_step()
            state.step += 1
            ts = time.time()
            state.commit()
            event("step", step=state.step, seconds=time.time() - t0, commit=time.time() - ts)

    train(state)
    hvd.shutdown()


# -------------------------------------------------------------------------------------------- driver side
def _events(out):
    with open(os.path.join(out, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _launcher(args, extra, command, env, out, timeout):
    with open(os.path.join(out, "launcher.log"), "a") as log:
        proc = subprocess.run([sys.executable, "-m", "perseus.runner.launch", *extra, *command], cwd=REPO,
                              env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode


def run_once(method, args, root):
    out = tempfile.mkdtemp(prefix=f"elastic-{method}-", dir=root)
    command = [sys.executable, os.path.abspath(__file__), "--job", method, "--out", out, "--state-mb",
               str(args.state_mb), "--steps", str(args.steps), "--kill-step", str(args.kill_step)]
    env = dict(os.environ, PERSEUS_NETWORK_INTERFACE="perseus0")
    hosts = args.hosts.split(",")
    if method == "disk":
        code = _launcher(args, ["-np", "2", "-H", f"{hosts[0]}:1,{hosts[1]}:1", "--network-interface",
                                "perseus0"], command, env, out, 600)
        # The scheduler starts the job again at once, on the host that is still good.
        code = _launcher(args, ["-np", "1", "-H", f"{hosts[0]}:1", "--network-interface", "perseus0",
                                "--mpi-args", "-x BENCH_RESTART"], command, dict(env, BENCH_RESTART="1"), out, 600)
    else:
        if method == "relaunch":
            env["PERSEUS_ELASTIC_IN_PROCESS"] = "0"
        disc = os.path.join(out, "discover.sh")
        with open(disc, "w") as f:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}:1\n" for h in hosts[:2]))
        os.chmod(disc, 0o755)
        code = _launcher(args, ["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", disc,
                                "--network-interface", "perseus0"], command, env, out, 600)
    if code != 0:
        raise RuntimeError(f"{method}: the job failed (status {code}); see {out}/launcher.log")
    ev = _events(out)
    kill = next(e for e in ev if e["kind"] == "kill")
    before = [e for e in ev if e["kind"] == "step" and e["t"] < kill["t"] and e["rank"] == 0]
    after = [e for e in ev if e["kind"] == "step" and e["t"] > kill["t"] and e["rank"] == 0
             and e["step"] > kill["step"]]
    normal = statistics.median(e["t"] - p["t"] for p, e in zip(before[1:], before[2:]))
    restored = [e for e in ev if e["kind"] == "restored" and e["t"] > kill["t"] and e["rank"] == 0]
    if not restored:
        raise RuntimeError(f"{method}: no restore after the kill; see {out}")
    after_step = after[1]["t"] - after[0]["t"] if len(after) > 1 else normal
    restore_s = restored[0].get("seconds") if restored else None
    log_path = os.path.join(out, "launcher.log")
    if restore_s is None and os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                if "restored commit" in line and " in " in line:
                    try:
                        restore_s = float(line.rsplit(" in ", 1)[1].split()[0])
                    except ValueError:
                        pass
    return dict(method=method, recovery_s=restored[0]["t"] - kill["t"],
                lost_s=after[0]["t"] - kill["t"] - after_step, step_s=normal,
                commit_s=statistics.median(e["commit"] for e in before[1:]), restore_s=restore_s,
                resumed_step=restored[0]["step"] if restored else None, killed_at=kill["step"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--state-mb", type=float, default=128.0, help="parameters + momentum, MB (default 128)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-step", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--hosts", default="perseus-h0,perseus-h1")
    p.add_argument("--json", help="append the results to this JSON-lines file")
    args = p.parse_args()
    if args.job:
        return job(args.job, args.out, args.state_mb, args.steps, args.kill_step)
    methods = args.methods.split(",")
    root = tempfile.mkdtemp(prefix="elastic-bench-")
    results = {m: [] for m in methods}
    for r in range(args.rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            res = run_once(m, args, root)
            results[m].append(res)
            print(json.dumps(dict(round=r, **res)), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(dict(bench="elastic_recovery", round=r, state_mb=args.state_mb, **res))
                            + "\n")
    med = {m: {k: statistics.median(x[k] for x in results[m] if x[k] is not None)
               for k in ("recovery_s", "lost_s", "step_s", "commit_s")} for m in methods}
    print(f"\nstate {args.state_mb:g} MB, kill -9 of rank 1 at step {args.kill_step}, medians of {args.rounds}")
    print(f"{'method':10s} {'recovery s':>11s} {'lost s':>8s} {'step s':>8s} {'commit s':>9s}")
    for m in methods:
        print(f"{m:10s} {med[m]['recovery_s']:11.3f} {med[m]['lost_s']:8.3f} {med[m]['step_s']:8.3f} "
              f"{med[m]['commit_s']:9.3f}")
    if "disk" in med:
        for m in methods:
            if m != "disk":
                print(f"disk / {m}: recovery {med['disk']['recovery_s'] / med[m]['recovery_s']:.1f}x, "
                      f"time lost {med['disk']['lost_s'] / med[m]['lost_s']:.1f}x")


if __name__ == "__main__":
    main()
