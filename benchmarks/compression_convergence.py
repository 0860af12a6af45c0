"""Convergence of the communicating gradient compressors against dense all-reduce.

Run under MPI, once per rank count (every rank runs this file; rank 0 prints and writes); the committed
runs come from ``python benchmarks/run_all.py --phases convergence`` (benchmarks/run_all.py, CONVERGENCE):

    mpirun -np 2 python benchmarks/compression_convergence.py --tasks mlp --json convergence.jsonl

Tasks (--tasks, default mlp,digits,transformer; benchmarks/convergence_tasks.py describes each recipe):

* ``mlp``: an MLP on scikit-learn's make_classification, SGD with momentum 0.9 (--mlp-*); test accuracy.
* ``digits``: the CNN of examples/pytorch_digits.py on scikit-learn's digits; SGD, lr 0.3 and no momentum
  unless --momentum/--digits-lr say otherwise; test accuracy.
* ``transformer``: a small causal transformer encoder on a Zipf-Markov token chain, AdamW (--tf-*);
  held-out loss (and next-token accuracy).
* ``lm``: a GRU language model on the same kind of chain, plain SGD with clipping; held-out loss.
* ``linear``: least squares whose signal lies only in small-gradient features (error feedback decides);
  relative held-out error. tests/integration/test_compression_convergence.py runs it.

Variants (--variants, comma-separated ``name[:arg...][:noef][:nomc][:nomask][:key=value...]``): ``dense``
(Compression.none) or any compressor of Compression with its positional arguments (``topk:0.01``,
``powersgd:4``); ``noef``: error_feedback=False; ``nomc``: momentum_correction=False (the optimizer applies
its momentum, or Adam runs, on the aggregated gradient); ``nomask``: momentum_masking=False;
``key=value``: any other keyword (``warmup_steps=150``). A variant the installed perseus lacks is reported
as unavailable and skipped.

The recipe is the same for every variant of a task and at every rank count: the same seeds and initial
weights, the same global batch (split evenly over the ranks; each rank draws its part from its own shard of
the training set), the same number of steps and the same learning-rate schedule. The table gives, per
variant, the mean over seeds, the mean paired difference to dense over the same seeds with its standard
error (accuracy in percentage points, loss in percent of dense's loss), "sent" (what the compressor
submitted, dense steps included, relative to float32 gradients) and the training loop's wall time summed
over seeds (evaluation excluded).

Targets printed with the table: on the MLP, top-k with momentum correction within 1 pp of dense; on the
transformer, within 2% of dense's held-out loss; on digits within 0.5 pp; without error feedback (or
without correction) measurably worse.

Every (task, variant) appends one JSON line to --json (rank 0): the summary, the recipe, every seed's
result (with the evaluation curves of the metric and the training loss when --eval-every is given) and the
source revision.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn

DEFAULT_VARIANTS = "dense,topk:0.01:nomc,topk:0.01,topk:0.01:noef,powersgd:4"


# -- variants --------------------------------------------------------------------------------------------

def _parse(spec: str):
    """``name[:arg...][:noef][:nomc][:nomask][:key=value...]`` -> (name, args, kwargs)."""
    name, *rest = spec.split(":")
    args, kwargs = [], {}
    flags = {"noef": ("error_feedback", False), "nomc": ("momentum_correction", False),
             "nomask": ("momentum_masking", False)}
    for r in rest:
        if r in flags:
            kwargs[flags[r][0]] = flags[r][1]
        elif "=" in r:
            k, v = r.split("=", 1)
            kwargs[k] = float(v) if any(c in v for c in ".e") else int(v)
        else:
            args.append(float(r) if any(c in r for c in ".e") else int(r))
    return name, args, kwargs


def variant_label(spec: str) -> str:
    name, args, kwargs = _parse(spec)
    if name == "dense":
        return "dense"
    label = f"{name}({', '.join(str(a) for a in args)})"
    words = {"error_feedback": ("no EF", "EF"), "momentum_correction": ("no MC", "MC"),
             "momentum_masking": ("no mask", "mask")}
    for k, v in kwargs.items():
        if k in words:
            label += " " + words[k][1 if v else 0]
        elif k == "warmup_steps":
            label += f" wu{v}"
        elif k == "warmup_start":
            label += f"@{v:g}"
        else:
            label += f" {k}={v}"
    return label


def make_compression(hvd, spec: str):
    """The compression object of ``spec``, or None when this perseus does not have that compressor."""
    name, args, kwargs = _parse(spec)
    if name == "dense":
        return hvd.Compression.none
    factory = getattr(hvd.Compression, name, None)
    if factory is None:
        return None
    late = {k: kwargs.pop(k) for k in list(kwargs) if k == "adam_dense_steps"}
    comp = factory(*args, **kwargs)
    for k, v in late.items():
        setattr(comp, k, v)
    return comp


# -- tasks -----------------------------------------------------------------------------------------------

from convergence_tasks import TASKS, Task  # noqa: E402  (benchmarks/ is the script directory)



# -- training --------------------------------------------------------------------------------------------

def train_once(hvd, task: Task, compression, seed: int, args) -> dict:
    rank, size = hvd.rank(), hvd.size()
    if task.global_batch % size:
        raise SystemExit(f"{task.name}: the global batch {task.global_batch} does not split over {size} ranks")
    per_rank = task.global_batch // size
    torch.manual_seed(seed)
    model = task.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = task.make_optimizer(model.parameters())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, task.schedule)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    shard, cache = task.shard(rank, size), {}
    hvd.allreduce(torch.zeros(1), name="cc.start")  # start the clocks together
    t0 = time.perf_counter()
    losses, curve = [], []
    for step in range(task.steps):
        batch = task.batch(shard, step, per_rank, gen, cache)
        opt.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        if task.clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        sched.step()
        losses.append(loss.item())
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < task.steps:
            paused = time.perf_counter()
            point = evaluate(hvd, task, model)
            point["train_loss"] = _recent_loss(hvd, losses, args.eval_every)
            curve.append((step + 1, point))
            t0 += time.perf_counter() - paused
    wall = time.perf_counter() - t0
    result = evaluate(hvd, task, model)
    curve.append((task.steps, dict(result, train_loss=_recent_loss(hvd, losses, args.eval_every or 10))))
    result["curve"] = [(s, p[task.metric]) for s, p in curve]
    result["curves"] = curve
    tail = max(1, len(losses) // 10)
    result["train_loss"] = hvd.allreduce(torch.tensor(sum(losses[-tail:]) / tail), name="cc.train_loss").item()
    result["wall_s"] = hvd.allreduce(torch.tensor(wall), op=hvd.Max, name="cc.wall").item()
    payload, dense = getattr(compression, "payload_bytes", None), getattr(compression, "dense_bytes", None)
    result["sent"] = payload / dense if payload is not None and dense else 1.0
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="cc.params")
    result["ranks_agree"] = all(torch.equal(gathered[0], gathered[r]) for r in range(size))
    return result


def _recent_loss(hvd, losses: list, window: int) -> float:
    """The training loss over the last ``window`` steps, averaged over steps and ranks (collective)."""
    tail = losses[-max(1, window):]
    return hvd.allreduce(torch.tensor(sum(tail) / len(tail)), name="cc.recent_loss").item()


def evaluate(hvd, task: Task, model: nn.Module) -> dict:
    model.eval()
    sums = hvd.allreduce(torch.tensor(task.evaluate(model, hvd.rank(), hvd.size()), dtype=torch.float64),
                         op=hvd.Sum, name="cc.eval")
    model.train()
    return task.finish(sums.tolist())


def git_commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def summarize(task: Task, spec: str, runs: list, dense_runs: list | None) -> dict:
    metric = task.metric
    values = [r[metric] for r in runs]
    row = {"task": task.name, "variant": spec, "label": variant_label(spec), "metric": metric,
           "mean": float(np.mean(values)), "per_seed": values,
           "train_loss": float(np.mean([r["train_loss"] for r in runs])),
           "wall_s": float(sum(r["wall_s"] for r in runs)), "sent": float(np.mean([r["sent"] for r in runs])),
           "ranks_agree": all(r["ranks_agree"] for r in runs)}
    if metric == "accuracy":
        row["test_loss"] = float(np.mean([r["test_loss"] for r in runs]))
    elif "accuracy" in runs[0]:
        row["accuracy"] = float(np.mean([r["accuracy"] for r in runs]))
    if dense_runs is not None:
        diffs = []
        for r, d in zip(runs, dense_runs):
            if metric == "accuracy":
                diffs.append(100.0 * (r[metric] - d[metric]))          # pp
            else:
                diffs.append(100.0 * (r[metric] / d[metric] - 1.0))   # % of dense loss
        row["diff"] = float(np.mean(diffs))
        row["diff_per_seed"] = diffs
        # standard error of the mean paired difference (seed-to-seed spread), when there are 2+ seeds
        row["diff_se"] = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else None
    return row


def verdict(task: Task, spec: str, row: dict, rows: dict) -> str:
    """The acceptance target this row answers to, and whether it is met."""
    name = spec.split(":")[0]
    if "diff" not in row or spec == "dense":
        return ""
    if name in ("topk", "powersgd") and "noef" not in spec and "nomc" not in spec:
        if task.name in ("digits", "mlp"):
            bound = 0.5 if task.name == "digits" else 1.0
            return f"PASS (>= -{bound} pp)" if row["diff"] >= -bound else f"FAIL (target >= -{bound} pp)"
        if task.name in ("lm", "transformer"):
            return "PASS (<= +2%)" if row["diff"] <= 2.0 else "FAIL (target <= +2%)"
    for flag, what in ((":noef", "EF"), (":nomc", "MC")):
        if flag not in spec:
            continue
        ef = rows.get(spec.replace(flag, ""))
        if ef is not None:
            worse = row["mean"] < ef["mean"] if task.metric == "accuracy" else row["mean"] > ef["mean"]
            gap = (100.0 * (ef["mean"] - row["mean"]) if task.metric == "accuracy"
                   else 100.0 * (row["mean"] / ef["mean"] - 1.0))
            unit = "pp" if task.metric == "accuracy" else "%"
            return f"{'worse' if worse else 'NOT worse'} than with {what} by {gap:+.2f} {unit}"
    return ""


def print_table(task: Task, size: int, rows: list, extra: str) -> None:
    unit = "test acc" if task.metric == "accuracy" else "held-out loss"
    dunit = "pp" if task.metric == "accuracy" else "%"
    print(f"\n{task.name}, {size} ranks  ({extra})", flush=True)
    print(f"{'variant':<20}{'ranks':>6}{unit:>15}{'vs dense':>20}{'sent':>9}{'wall s':>9}  per seed / target")
    by_spec = {r["variant"]: r for r in rows}
    for r in rows:
        val = f"{100 * r['mean']:.2f}%" if task.metric == "accuracy" else f"{r['mean']:.4f}"
        diff = ""
        if "diff" in r and r["variant"] != "dense":
            se = f" ± {r['diff_se']:.2f}" if r.get("diff_se") is not None else ""
            diff = f"{r['diff']:+.2f}{se} {dunit}"
        per_seed = " ".join(f"{100 * v:.1f}" if task.metric == "accuracy" else f"{v:.4f}" for v in r["per_seed"])
        note = verdict(task, r["variant"], r, by_spec)
        if "accuracy" in r and task.metric == "loss":
            dense = by_spec.get("dense")
            acc_diff = f", {100 * (r['accuracy'] - dense['accuracy']):+.2f} pp" if dense and r is not dense else ""
            note = f"acc {100 * r['accuracy']:.2f}%{acc_diff} " + note
        print(f"{r['label']:<20}{size:>6}{val:>15}{diff:>20}{r['sent']:>9.4f}{r['wall_s']:>9.1f}  [{per_seed}] {note}",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="mlp,digits,transformer", help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--seeds", type=int, default=0, help="seeds 1..N per (task, variant), for every task "
                    "(default: --mlp-seeds, --digits-seeds, --transformer-seeds, --lm-seeds, --linear-seeds)")
    ap.add_argument("--momentum", type=float, default=None,
                    help="SGD momentum for digits, lm and linear (default 0; mlp has its own, --mlp-momentum)")
    ap.add_argument("--mlp-steps", type=int, default=500)
    ap.add_argument("--mlp-batch", type=int, default=96, help="global batch (divisible by 2 and 3)")
    ap.add_argument("--mlp-lr", type=float, default=0.05)
    ap.add_argument("--mlp-momentum", type=float, default=0.9)
    ap.add_argument("--mlp-hidden", type=int, default=512)
    ap.add_argument("--mlp-seeds", type=int, default=3)
    ap.add_argument("--tf-vocab", type=int, default=200)
    ap.add_argument("--tf-steps", type=int, default=600)
    ap.add_argument("--tf-batch", type=int, default=48, help="global batch (windows; divisible by 2 and 3)")
    ap.add_argument("--tf-lr", type=float, default=3e-3)
    ap.add_argument("--transformer-seeds", type=int, default=2)
    ap.add_argument("--digits-seeds", type=int, default=5)
    ap.add_argument("--digits-epochs", type=int, default=40)
    ap.add_argument("--digits-batch", type=int, default=48, help="global batch")
    ap.add_argument("--digits-lr", type=float, default=0.3)
    ap.add_argument("--digits-test", type=int, default=500)
    ap.add_argument("--lm-seeds", type=int, default=2)
    ap.add_argument("--lm-vocab", type=int, default=500)
    ap.add_argument("--lm-zipf", type=float, default=1.1)
    ap.add_argument("--lm-train-tokens", type=int, default=1_000_000)
    ap.add_argument("--lm-test-tokens", type=int, default=40_000)
    ap.add_argument("--lm-seq", type=int, default=32)
    ap.add_argument("--lm-batch", type=int, default=48, help="global batch (sequences)")
    ap.add_argument("--lm-steps", type=int, default=1500)
    ap.add_argument("--lm-lr", type=float, default=20.0)
    ap.add_argument("--lm-clip", type=float, default=1.0)
    ap.add_argument("--lm-emb", type=int, default=32)
    ap.add_argument("--lm-hidden", type=int, default=128)
    ap.add_argument("--linear-seeds", type=int, default=1)
    ap.add_argument("--linear-steps", type=int, default=600)
    ap.add_argument("--linear-batch", type=int, default=96)
    ap.add_argument("--linear-lr", type=float, default=0.005)
    ap.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (kept in the JSON)")
    ap.add_argument("--json", default="", help="append one JSON line per (task, variant) here (rank 0)")
    args = ap.parse_args()

    import perseus.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    specs = [s for s in args.variants.split(",") if s]
    commit = git_commit() if rank == 0 else ""
    for tname in [t for t in args.tasks.split(",") if t]:
        task = TASKS[tname](args)
        if args.momentum is not None and tname in ("digits", "lm", "linear"):  # (the others have their own)
            task.momentum = args.momentum
        seeds = args.seeds or getattr(args, f"{tname.split('_')[0]}_seeds")
        rows, dense_runs = [], None
        for spec in specs:
            if make_compression(hvd, spec) is None:
                if rank == 0:
                    print(f"{tname}: {variant_label(spec)}: not available in this perseus "
                          f"(no Compression.{spec.split(':')[0]}); skipped", flush=True)
                continue
            runs = []
            for seed in range(1, seeds + 1):
                result = train_once(hvd, task, make_compression(hvd, spec), seed, args)
                runs.append(result)
                if rank == 0:
                    shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in result.items()
                             if k != "curve"}
                    if len(result["curve"]) > 1:
                        shown["curve"] = " ".join(f"{s}:{v:.4f}" for s, v in result["curve"])
                    print(f"{tname} {variant_label(spec)} seed {seed}: {shown}", flush=True)
            if spec == "dense":
                dense_runs = runs
            row = summarize(task, spec, runs, dense_runs)
            rows.append(row)
            if rank == 0 and args.json:
                record = dict(row, ranks=size, seeds=seeds, momentum=task.momentum, optimizer=task.optimizer, recipe=task.recipe,
                              compressor="none" if spec == "dense" else repr(make_compression(hvd, spec)),
                              runs=runs, commit=commit, host=platform.node(),
                              date=datetime.datetime.now().isoformat(timespec="seconds"))
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if rank == 0:
            extra = (f"{task.steps} steps, global batch {task.global_batch}, lr {task.lr}, {task.optimizer}"
                     + (f" momentum {task.momentum}" if task.optimizer == "sgd" else ""))
            if tname == "lm":
                extra += f"; entropy rate (best possible loss) {task.chain.entropy_rate():.4f}"
            print_table(task, size, rows, extra)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
