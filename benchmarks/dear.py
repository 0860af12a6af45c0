"""DeAR vs the default schedule vs Horovod: training-step time of a real model, side by side.

Each method runs in its own mpirun job per round, the order rotating every round. A job trains an MLP
(--layers Linear(--width, --width) + ReLU, batch --batch, one thread per rank) with the library's
DistributedOptimizer (SGD with momentum) for --warmup steps, then times --windows windows of --steps
consecutive steps each (no barrier between the steps of a window, so DeAR's all-gathers may overlap the next
forward; the window ends after DeAR's last update is applied with finish()). A window's time per step is
the slowest rank's. Reported: the median over every window of every round, its ratio to the default
schedule and to Horovod, the model's compute alone (forward + backward, no communication), and where a step's
time goes (forward with DeAR's waits and updates, backward, the step() call; slowest rank, median of jobs).

Methods: default (perseus, schedule="default"), dear (schedule="dear"; dear:BYTES sets its group
threshold), horovod (Horovod 0.28.1 from --horovod-venv), and rsag: perseus all-reduce vs reduce-scatter +
all-gather of buffers of the model's size and of one group's size (medians of --steps calls), the premise
of DeAR being (RS + AG) / AR ~ 1.

    python benchmarks/dear.py --hosts localhost --ranks-per-host 2 --methods default,dear,horovod,rsag
    python benchmarks/dear.py --hosts perseus-h0,perseus-h1 --iface perseus0    # emulated cluster
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
def _rsag(hvd, comm, args, rank):
    import torch

    rows = []
    sizes = [("model", args.layers * (args.width * args.width + args.width)),
             ("group", min(args.threshold // 4, args.layers * (args.width * args.width + args.width)))]
    for label, numel in sizes:
        numel -= numel % comm.Get_size()
        x = torch.randn(numel)
        shard = torch.randn(numel // comm.Get_size())
        times = {"ar": [], "rs": [], "ag": []}
        for i in range(args.steps + 2):
            for op, fn in (("ar", lambda: hvd.allreduce(x, name=f"bench.ar.{label}")),
                           ("rs", lambda: hvd.reducescatter(x, name=f"bench.rs.{label}")),
                           ("ag", lambda: hvd.allgather(shard, name=f"bench.ag.{label}"))):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = comm.allreduce(time.perf_counter() - t0, op=_mpi_max())
                if i >= 2:
                    times[op].append(dt)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"size": label, "bytes": numel * 4, "ar_s": round(med["ar"], 5), "rs_s": round(med["rs"], 5),
                     "ag_s": round(med["ag"], 5), "rsag_over_ar": round((med["rs"] + med["ag"]) / med["ar"], 3)})
    return rows


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX


def job(args) -> int:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    method, _, threshold = args.method.partition(":")
    if threshold:
        os.environ["PERSEUS_DEAR_THRESHOLD_BYTES"] = threshold
    if method == "horovod":
        import horovod.torch as hvd
    else:
        import perseus.torch as hvd
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    row = {"method": args.method, "ranks": comm.Get_size(), "layers": args.layers, "width": args.width,
           "batch": args.batch, "round": args.round}
    if method == "rsag":
        row["rsag"] = _rsag(hvd, comm, args, rank)
    else:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers)
        kwargs = {"schedule": "dear"} if method == "dear" else {}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                                       named_parameters=model.named_parameters(), **kwargs)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        gen = torch.Generator().manual_seed(rank)
        data = [torch.randn(args.batch, args.width, generator=gen) for _ in range(2)]

        phases = [0.0, 0.0, 0.0]  # forward (with DeAR's waits and updates), backward, step()

        def step(i):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(data[i % 2]).square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            phases[0] += t1 - t0
            phases[1] += t2 - t1
            phases[2] += t3 - t2

        for i in range(args.warmup):
            step(i)
        finish = getattr(opt, "finish", lambda: None)
        finish()
        windows = []
        phases[:] = [0.0, 0.0, 0.0]
        for w in range(args.windows):
            comm.Barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(i)
            finish()
            windows.append(comm.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX))
        # Compute alone (no communication), for the communication/compute ratio.
        ref = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        t0 = time.perf_counter()
        for i in range(3):
            ref(data[0]).square().mean().backward()
        row["compute_s"] = round(comm.allreduce((time.perf_counter() - t0) / 3, op=MPI.MAX), 4)
        row["step_s"] = [round(t, 4) for t in windows]
        n = args.windows * args.steps
        row["phases_s"] = [round(comm.allreduce(v / n, op=MPI.MAX), 4) for v in phases]
        if method == "dear" and hasattr(opt, "dear_groups"):
            row["groups"] = len(opt.dear_groups())
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    hvd.shutdown()
    return 0


# -------------------------------------------------------------------------------------------- driver side
def command(args, method: str, rnd: int, out: str) -> tuple[list[str], dict]:
    horovod = method.startswith("horovod")
    venv_bin = os.path.join(args.horovod_venv, "bin") if horovod else os.path.dirname(sys.executable)
    hosts = args.hosts.split(",")
    env = dict(os.environ)
    if args.iface:
        env["PERSEUS_NETWORK_INTERFACE"] = args.iface
    argv = [os.path.join(venv_bin, "mpirun"), "--allow-run-as-root", "--oversubscribe", "-np",
            str(args.ranks_per_host * len(hosts)), "--bind-to", "none"]
    if hosts != ["localhost"]:
        argv += ["--host", ",".join(f"{h}:{args.ranks_per_host}" for h in hosts),
                 "--prefix", os.path.dirname(venv_bin)]
    for name in sorted(env):
        if name.startswith(("PERSEUS_", "HOROVOD_", "OMPI_MCA_")) or name in ("PATH", "PYTHONPATH"):
            argv += ["-x", name]
    argv += shlex.split(args.mpi_args)
    argv += [os.path.join(venv_bin, "python"), os.path.abspath(__file__), "job", "--method", method,
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--windows", str(args.windows),
             "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
             "--threshold", str(args.threshold), "--round", str(rnd), "--out", out]
    return argv, env


def summarize(rows: list[dict], methods: list[str]) -> list[dict]:
    med = {}
    for m in methods:
        ts = [t for r in rows if r["method"] == m for t in r.get("step_s", [])]
        if ts:
            comp = [r["compute_s"] for r in rows if r["method"] == m]
            groups = [r["groups"] for r in rows if r["method"] == m and "groups" in r]
            ph = [statistics.median(r["phases_s"][k] for r in rows if r["method"] == m) for k in range(3)]
            med[m] = (statistics.median(ts), statistics.median(comp), len(ts), groups[0] if groups else None, ph)
    base = med.get("default", (None,))[0]
    hvd = med.get("horovod", (None,))[0]
    return [{"method": m, "median_step_s": round(t, 4), "compute_s": round(c, 4), "windows": n, "groups": g,
             "forward_s": round(ph[0], 4), "backward_s": round(ph[1], 4), "step_call_s": round(ph[2], 4),
             "vs_default": round(t / base, 3) if base else None, "vs_horovod": round(t / hvd, 3) if hvd else None}
            for m, (t, c, n, g, ph) in med.items()]


def driver(args) -> int:
    methods = args.methods.split(",")
    if "horovod" in methods and not os.path.exists(os.path.join(args.horovod_venv, "bin", "python")):
        print(f"dear: no Horovod environment at {args.horovod_venv}; leaving Horovod out", file=sys.stderr)
        methods.remove("horovod")
    out = tempfile.NamedTemporaryFile(prefix="perseus-dear-", suffix=".jsonl", delete=False).name
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
    print(f"\n{args.hosts}, {args.ranks_per_host} rank(s) per host, MLP {args.layers} x {args.width}^2 "
          f"({args.layers * (args.width ** 2 + args.width) * 4 / 2 ** 20:.1f} MiB of gradients), batch {args.batch}")
    print(f"{'method':<16} {'median s/step':>14} {'x default':>10} {'x horovod':>10} {'compute s':>10} "
          f"{'fwd s':>7} {'bwd s':>7} {'step() s':>9} {'groups':>7}")
    for r in table:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        print(f"{r['method']:<16} {r['median_step_s']:>14.4f} {f(r['vs_default'], '>10.3f')} "
              f"{f(r['vs_horovod'], '>10.3f')} {r['compute_s']:>10.4f} {r['forward_s']:>7.4f} "
              f"{r['backward_s']:>7.4f} {r['step_call_s']:>9.4f} {f(r['groups'], '>7')}")
    ratios = [x for r in rows if "rsag" in r for x in r["rsag"]]
    for label in ("model", "group"):
        sel = [x for x in ratios if x["size"] == label]
        if sel:
            ar, rs, ag = (statistics.median(x[k] for x in sel) for k in ("ar_s", "rs_s", "ag_s"))
            print(f"{label} buffer ({sel[0]['bytes'] / 2 ** 20:.1f} MiB): all-reduce {ar * 1e3:.1f} ms, "
                  f"reduce-scatter {rs * 1e3:.1f} ms, all-gather {ag * 1e3:.1f} ms, (RS + AG) / AR "
                  f"{(rs + ag) / ar:.2f}")
    if args.json:
        with open(args.json, "a") as fh:
            meta = {"bench": "dear", "hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
                    "layers": args.layers, "width": args.width, "batch": args.batch, "rounds": args.rounds}
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
    j.add_argument("--round", type=int, default=0)
    j.add_argument("--out", required=True)
    for p in (ap, j):
        p.add_argument("--steps", type=int, default=5, help="steps per timed window")
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--windows", type=int, default=3, help="timed windows per job")
        p.add_argument("--layers", type=int, default=12)
        p.add_argument("--width", type=int, default=512)
        p.add_argument("--batch", type=int, default=256)
        p.add_argument("--threshold", type=int, default=4 << 20, help="group size for rsag's group buffer")
    ap.add_argument("--hosts", default="localhost", help="'localhost' or comma-separated host names")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--methods", default="default,dear,horovod,rsag")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--iface", default="", help="interface for perseus's links (perseus0 on the emulated cluster)")
    ap.add_argument("--mpi-args", default="", help="extra mpirun arguments")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
