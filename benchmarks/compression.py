"""Compressed gradients across emulated hosts: training-step time and bytes, perseus vs Horovod.

Needs an emulated cluster (tools/emulated_cluster.sh up 2 800 200) and root. Each method runs in its own
mpirun job per round (the order rotating every round). A job trains a model whose parameters have the
shapes of ResNet-50 (161 tensors, 25.6M parameters) through the library's DistributedOptimizer; its
forward and backward are replaced by a fixed amount of real CPU work (matrix products: --compute-ms per
step, a fifth in forward, the rest spread over the backward of the 161 tensors), so compression competes
with "compute" for the CPU as it would in training, and each backward step produces a random-normal
gradient. Reported per method: median step time (slowest rank), its ratio to the dense step of the same
library, and (perseus) the bytes this rank put on the wire per step:

    python benchmarks/compression.py --methods dense,fp16,topk,horovod-dense,horovod-fp16 --rounds 2 \\
        --json benchmarks/results/compression.jsonl

--ranks-per-host N runs N ranks on every host (hitopk: dense inside a host, top-k between hosts).

Methods: dense / fp16 / bf16 / topk / topk-noef / hitopk / randomk / sign / qsgd / powersgd / espresso / cupcake
(perseus.torch with that ``compression=``; top-k, random-k, Espresso and Cupcake at --density), and
horovod-dense / horovod-fp16 (Horovod 0.28.1 from --horovod-venv).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------------------------- job side
def _compression(hvd, method: str, density: float):
    C = hvd.Compression
    if method in ("dense", "horovod-dense"):
        return C.none
    if method in ("fp16", "horovod-fp16"):
        return C.fp16
    if method == "bf16":
        return C.bf16
    if method == "topk":
        return C.topk(density)
    if method == "topk-noef":
        return C.topk(density, error_feedback=False)
    if method == "hitopk":
        return C.hitopk(density)
    if method == "randomk":
        return C.randomk(density)
    if method == "sign":
        return C.sign()
    if method == "qsgd":
        return C.qsgd()
    if method == "powersgd":
        return C.powersgd(4)
    if method == "espresso":
        return C.espresso(density=density)
    if method == "cupcake":
        return C.cupcake(C.topk(density))
    raise SystemExit(f"unknown method {method!r}")


def job(args) -> int:
    sys.path.insert(0, HERE)
    import torch
    from mpi4py import MPI

    from gradient_sets import resnet50_shapes

    torch.set_num_threads(1)
    if args.method.startswith("horovod"):
        import horovod.torch as hvd
    else:
        import perseus.torch as hvd
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()

    a = torch.randn(192, 192)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    per_matmul = (time.perf_counter() - t0) / 50
    per_matmul = comm.allreduce(per_matmul, op=MPI.MAX)

    def burn(seconds):
        for _ in range(max(0, int(round(seconds / per_matmul)))):
            a @ a

    shapes = resnet50_shapes()
    n_tensors = len(shapes)
    backward_each = args.compute_ms * 0.8e-3 / n_tensors

    class Burn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            burn(backward_each)
            return grad

    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    targets = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    names = [(f"p{i:03d}", p) for i, p in enumerate(params)]
    compression = _compression(hvd, args.method, args.density)
    if args.optimizer == "adamw":
        base = torch.optim.AdamW(params, lr=1e-4)
        if hasattr(compression, "warmup_steps"):  # Adam's dense steps end before the timed steps
            compression.warmup_steps = max(1, args.warmup - 1)
    else:
        base = torch.optim.SGD(params, lr=1e-4, momentum=0.9 if args.optimizer == "momentum" else 0.0)
    opt = hvd.DistributedOptimizer(base, named_parameters=names, compression=compression)
    wire = getattr(hvd, "wire_bytes", None)

    def step(i):
        burn(args.compute_ms * 0.2e-3)
        loss = sum((Burn.apply(p) * g).sum() for p, g in zip(params, targets[i % 2]))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(args.warmup):
        step(i)
    comm.Barrier()
    before = wire()["sent_bytes"] if wire else None
    times = []
    for i in range(args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    sent = (wire()["sent_bytes"] - before) / args.steps if wire else None
    if rank == 0:
        row = {"method": args.method, "optimizer": args.optimizer, "ranks": comm.Get_size(),
               "compute_ms": args.compute_ms,
               "density": args.density, "params": int(sum(p.numel() for p in params)),
               "step_s": [round(t, 4) for t in times], "sent_bytes_per_step": sent, "round": args.round}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    hvd.shutdown()
    return 0


# -------------------------------------------------------------------------------------------- driver side
def command(args, method: str, rnd: int, out: str) -> tuple[list[str], dict]:
    horovod = method.startswith("horovod")
    venv_bin = os.path.join(args.horovod_venv, "bin") if horovod else os.path.dirname(sys.executable)
    hosts = ",".join(f"{h}:{args.ranks_per_host}" for h in args.hosts.split(","))
    env = dict(os.environ)
    if args.iface:
        env["PERSEUS_NETWORK_INTERFACE"] = args.iface
    np_ = args.ranks_per_host * len(args.hosts.split(","))
    argv = [os.path.join(venv_bin, "mpirun"), "--allow-run-as-root", "-np", str(np_), "--host", hosts,
            "--bind-to", "none", "--prefix", os.path.dirname(venv_bin)]
    for name in sorted(env):
        if name.startswith(("PERSEUS_", "HOROVOD_", "OMPI_MCA_")) or name in ("PATH", "PYTHONPATH"):
            argv += ["-x", name]
    argv += shlex.split(args.mpi_args)
    argv += [os.path.join(venv_bin, "python"), os.path.abspath(__file__), "job", "--method", method,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--compute-ms", str(args.compute_ms),
             "--density", str(args.density), "--round", str(rnd), "--optimizer", args.optimizer, "--out", out]
    return argv, env


def summarize(rows: list[dict], methods: list[str]) -> list[dict]:
    med = {}
    sent = {}
    for m in methods:
        ts = [t for r in rows if r["method"] == m for t in r["step_s"]]
        if ts:
            med[m] = statistics.median(ts)
            bs = [r["sent_bytes_per_step"] for r in rows if r["method"] == m and r["sent_bytes_per_step"]]
            sent[m] = statistics.median(bs) if bs else None
    table = []
    for m, t in med.items():
        base = med.get("horovod-dense" if m.startswith("horovod") else "dense")
        row = {"method": m, "median_s": round(t, 3), "vs_dense": round(t / base, 3) if base else None,
               "vs_horovod_fp16": round(t / med["horovod-fp16"], 3) if "horovod-fp16" in med else None,
               "sent_mb_per_step": round(sent[m] / 1e6, 2) if sent.get(m) else None}
        if sent.get(m) and sent.get("dense"):
            row["sent_vs_dense"] = round(sent[m] / sent["dense"], 4)
        table.append(row)
    return table


def driver(args) -> int:
    methods = args.methods.split(",")
    if any(m.startswith("horovod") for m in methods) and not os.path.exists(
            os.path.join(args.horovod_venv, "bin", "python")):
        print(f"compression: no Horovod environment at {args.horovod_venv}; leaving Horovod out", file=sys.stderr)
        methods = [m for m in methods if not m.startswith("horovod")]
    out = tempfile.NamedTemporaryFile(prefix="perseus-compression-", suffix=".jsonl", delete=False).name
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for m in order:
            argv, env = command(args, m, rnd, out)
            t0 = time.monotonic()
            done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=args.job_timeout)
            status = "ok" if done.returncode == 0 else f"FAILED rc={done.returncode}"
            print(f"round {rnd} {m}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in open(out)]
    os.unlink(out)
    table = summarize(rows, methods)
    print(f"\n{args.hosts}, {args.ranks_per_host} rank(s) per host, compute {args.compute_ms} ms per step, "
          f"density {args.density}, optimizer {args.optimizer}")
    print(f"{'method':<14} {'median s':>9} {'x dense':>8} {'x hvd fp16':>11} {'sent MB/step':>13} {'x dense bytes':>14}")
    for r in table:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        print(f"{r['method']:<14} {r['median_s']:>9.3f} {f(r['vs_dense'], '>8.3f')} "
              f"{f(r['vs_horovod_fp16'], '>11.3f')} {f(r['sent_mb_per_step'], '>13.2f')} "
              f"{f(r.get('sent_vs_dense'), '>14.4f')}")
    if args.json:
        with open(args.json, "a") as fh:
            meta = {"bench": "compression", "hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
                    "compute_ms": args.compute_ms, "optimizer": args.optimizer,
                    "density": args.density, "rounds": args.rounds}
            for r in rows:
                fh.write(json.dumps({**meta, "raw": r}) + "\n")
            for r in table:
                fh.write(json.dumps({**meta, **r}) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode")
    j = sub.add_parser("job", help="one timed job (run by mpirun on every rank)")
    j.add_argument("--method", required=True)
    j.add_argument("--steps", type=int, default=5)
    j.add_argument("--warmup", type=int, default=3)
    j.add_argument("--compute-ms", type=float, default=400)
    j.add_argument("--density", type=float, default=0.01)
    j.add_argument("--round", type=int, default=0)
    j.add_argument("--optimizer", default="sgd", choices=("sgd", "momentum", "adamw"))
    j.add_argument("--out", required=True)
    ap.add_argument("--hosts", default="perseus-h0,perseus-h1")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--methods", default="dense,fp16,topk,espresso,cupcake,powersgd,horovod-dense,horovod-fp16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per job")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per job (selector timing, plans)")
    ap.add_argument("--compute-ms", type=float, default=400, help="CPU work per step standing in for the model")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "momentum", "adamw"),
                    help="sgd (plain), momentum (SGD, 0.9: momentum correction under top-k), adamw (top-k: "
                         "dense for the untimed steps, then the variance frozen)")
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--iface", default="perseus0", help="interface inside the hosts for perseus's links")
    ap.add_argument("--mpi-args", default="", help="extra mpirun arguments")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
