"""Gradient-set all-reduce across emulated hosts: perseus channels vs raw MPI vs Horovod vs torch gloo.

Needs an emulated cluster (tools/emulated_cluster.sh up 2 800 200) and root. The driver starts one mpirun
job per method and round, rotating the order of the methods in every round, and reports per method the
median step time, the ratios to Horovod, to 1-channel perseus and to the link bound (the bytes a ring
must send per host divided by the link rate):

    python benchmarks/multihost.py --hosts perseus-h0,perseus-h1 --ranks-per-host 1 \\
        --link-mbit 800 --flow-mbit 200 --sets resnet50,bert_large --rounds 3 \\
        --horovod-venv /work/hvd-venv --json benchmarks/results/multihost.jsonl

Each job (``multihost.py job ...``, run by mpirun on every rank) warms the method up with one 32 MB
all-reduce (connections opened, TCP windows grown), then times --steps steps of the whole gradient set:
every rank submits every gradient (reverse order, as backward produces them) and waits for all; a step's
time is the slowest rank's. Methods:

  perseus-<N>ch   perseus.torch allreduce_async_ (Average), PERSEUS_NUM_CHANNELS=N
  perseus-default the same with no perseus setting at all (PERSEUS_NUM_CHANNELS and
                  PERSEUS_ALLREDUCE_ALGORITHM removed from the job's environment): what a user gets
  perseus-hier-<N>ch / perseus-ring-<N>ch   the same with PERSEUS_ALLREDUCE_ALGORITHM=hierarchical / ring
  mpi             in-place MPI_Allreduce of each gradient in 6 MB pieces (one TCP flow between a pair)
  mpi-links<K>    the same with Open MPI's btl_tcp_links=K (K TCP connections per pair of processes)
  horovod         Horovod 0.28.1 (from --horovod-venv), same calls as perseus
  gloo            torch.distributed gloo, DDP-style 25 MB buckets
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ----------------------------------------------------------------------------------------------- job side
def job(args) -> int:
    sys.path.insert(0, HERE)
    import numpy as np
    import torch
    from mpi4py import MPI

    from gradient_sets import bench_gloo, bench_mpi_chunked, bench_perseus, bert_large_shapes, make_grads, resnet50_shapes

    method = args.method
    hvd = dist = None
    if method.startswith("perseus"):
        import perseus.torch as hvd
    elif method == "horovod":
        import horovod.torch as hvd
    if hvd is not None:
        hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    if method == "gloo":
        import torch.distributed as dist

        addr = comm.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None, root=0)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, "29541"
        dist.init_process_group("gloo", rank=rank, world_size=size)

    shapes = {"resnet50": resnet50_shapes, "bert_large": bert_large_shapes}[args.set]()
    grads = make_grads(shapes, torch)
    warm = [torch.ones(8 << 20)]  # 32 MB: 8 units of 4 MB, so every channel opens its connections
    if hvd is not None:
        step, warm_step = bench_perseus(grads, hvd), bench_perseus(warm, hvd)
    elif method.startswith("mpi"):
        step, warm_step = bench_mpi_chunked(grads, comm, MPI), bench_mpi_chunked(warm, comm, MPI)
    elif method == "gloo":
        step, warm_step = bench_gloo(grads, dist, torch), bench_gloo(warm, dist, torch)
    else:
        raise SystemExit(f"unknown method {method!r}")
    warm_step()
    times = []
    for _ in range(args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if rank == 0:
        row = {"method": method, "set": args.set, "ranks": size, "params": int(sum(g.numel() for g in grads)),
               "step_s": [round(t, 4) for t in times], "round": args.round}
        if method.startswith("perseus"):  # the channels in use (perseus-default: what init() chose)
            from perseus.runtime.state import runtime

            row["channels"] = int(runtime().engine.params(0)[2])
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    if dist is not None:
        dist.destroy_process_group()
    if hvd is not None:
        hvd.shutdown()
    return 0


# -------------------------------------------------------------------------------------------- driver side
def method_env(method: str) -> dict:
    env = {}
    if method == "perseus-default":
        return env
    if method.startswith("perseus"):
        parts = method.split("-")
        env["PERSEUS_NUM_CHANNELS"] = parts[-1].rstrip("ch")
        if len(parts) == 3:
            env["PERSEUS_ALLREDUCE_ALGORITHM"] = {"hier": "hierarchical", "ring": "ring"}[parts[1]]
    elif method.startswith("mpi-links"):
        env["OMPI_MCA_btl_tcp_links"] = method[len("mpi-links"):]
    return env


def command(args, method: str, set_name: str, rnd: int, out: str) -> tuple[list[str], dict]:
    venv_bin = os.path.join(args.horovod_venv, "bin") if method == "horovod" else os.path.dirname(sys.executable)
    hosts = ",".join(f"{h}:{args.ranks_per_host}" for h in args.hosts.split(","))
    np_ = args.ranks_per_host * len(args.hosts.split(","))
    env = dict(os.environ)
    if method == "perseus-default":
        for name in ("PERSEUS_NUM_CHANNELS", "PERSEUS_ALLREDUCE_ALGORITHM", "PERSEUS_HIERARCHICAL_ALLREDUCE",
                     "HOROVOD_HIERARCHICAL_ALLREDUCE"):
            env.pop(name, None)
    env.update(method_env(method))
    if args.iface:
        env["PERSEUS_NETWORK_INTERFACE"] = env["GLOO_SOCKET_IFNAME"] = args.iface
    argv = [os.path.join(venv_bin, "mpirun"), "--allow-run-as-root", "-np", str(np_), "--host", hosts,
            "--bind-to", "none", "--prefix", os.path.dirname(venv_bin)]
    for name in sorted(env):
        if name.startswith(("PERSEUS_", "HOROVOD_", "OMPI_MCA_", "GLOO_")) or name in ("PATH", "PYTHONPATH"):
            argv += ["-x", name]
    argv += shlex.split(args.mpi_args)
    argv += [os.path.join(venv_bin, "python"), os.path.abspath(__file__), "job", "--method", method, "--set",
             set_name, "--steps", str(args.steps if set_name != "bert_large" else args.bert_steps), "--round",
             str(rnd), "--out", out]
    return argv, env


def summarize(rows: list[dict], args) -> list[dict]:
    table = []
    link_bytes_per_s = args.link_mbit * 1e6 / 8
    for set_name in args.sets.split(","):
        mine = [r for r in rows if r["set"] == set_name]
        if not mine:
            continue
        n_hosts = len(args.hosts.split(","))
        params = mine[0]["params"]
        # A ring over the hosts sends 2 (n-1)/n of the buffer out of every host (hierarchical: the same).
        bound_s = 2 * (n_hosts - 1) / n_hosts * params * 4 / link_bytes_per_s
        med = {}
        for m in args.methods.split(","):
            ts = [t for r in mine if r["method"] == m for t in r["step_s"]]
            if ts:
                med[m] = statistics.median(ts)
        for m, t in med.items():
            row = {"set": set_name, "method": m, "median_s": round(t, 3), "over_bound": round(t / bound_s, 2),
                   "bound_s": round(bound_s, 3)}
            used = sorted({r["channels"] for r in mine if r["method"] == m and "channels" in r})
            if used:
                row["channels"] = used[0] if len(used) == 1 else used
            if "horovod" in med:
                row["speedup_vs_horovod"] = round(med["horovod"] / t, 2)
            if "perseus-1ch" in med:
                row["speedup_vs_perseus_1ch"] = round(med["perseus-1ch"] / t, 2)
            table.append(row)
    return table


def driver(args) -> int:
    methods = args.methods.split(",")
    if "horovod" in methods and not os.path.exists(os.path.join(args.horovod_venv, "bin", "python")):
        print(f"multihost: no Horovod environment at {args.horovod_venv}; leaving horovod out", file=sys.stderr)
        methods.remove("horovod")
        args.methods = ",".join(methods)
    out = tempfile.NamedTemporaryFile(prefix="perseus-multihost-", suffix=".jsonl", delete=False).name
    for rnd in range(args.rounds):
        for set_name in args.sets.split(","):
            order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
            for m in order:
                argv, env = command(args, m, set_name, rnd, out)
                t0 = time.monotonic()
                done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=args.job_timeout)
                status = "ok" if done.returncode == 0 else f"FAILED rc={done.returncode}"
                print(f"round {rnd} {set_name} {m}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
                if done.returncode != 0:
                    print(done.stdout[-3000:], file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in open(out)]
    table = summarize(rows, args)
    print(f"\nlink {args.link_mbit} Mbit/s, flow {args.flow_mbit} Mbit/s, {args.hosts} x {args.ranks_per_host} ranks")
    print(f"{'set':<11} {'method':<18} {'median s':>9} {'x bound':>8} {'vs horovod':>11} {'vs 1ch':>7}")
    for r in table:
        print(f"{r['set']:<11} {r['method']:<18} {r['median_s']:>9.3f} {r['over_bound']:>8.2f} "
              f"{r.get('speedup_vs_horovod', float('nan')):>11.2f} {r.get('speedup_vs_perseus_1ch', float('nan')):>7.2f}")
    if args.json:
        with open(args.json, "a") as f:
            meta = {"bench": "multihost", "link_mbit": args.link_mbit, "flow_mbit": args.flow_mbit, "hosts": args.hosts,
                    "ranks_per_host": args.ranks_per_host, "rounds": args.rounds}
            for r in rows:
                f.write(json.dumps({**meta, "raw": r}) + "\n")
            for r in table:
                f.write(json.dumps({**meta, **r}) + "\n")
    os.unlink(out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode")
    j = sub.add_parser("job", help="one timed job (run by mpirun on every rank)")
    j.add_argument("--method", required=True)
    j.add_argument("--set", required=True)
    j.add_argument("--steps", type=int, default=3)
    j.add_argument("--round", type=int, default=0)
    j.add_argument("--out", required=True)
    ap.add_argument("--hosts", default="perseus-h0,perseus-h1")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--link-mbit", type=float, default=800)
    ap.add_argument("--flow-mbit", type=float, default=200)
    ap.add_argument("--sets", default="resnet50,bert_large")
    ap.add_argument("--methods", default="perseus-1ch,perseus-2ch,perseus-4ch,perseus-8ch,mpi,mpi-links8,horovod,gloo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per job (ResNet-50)")
    ap.add_argument("--bert-steps", type=int, default=1, help="timed steps per job (BERT-large)")
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--iface", default="", help="interface name inside the hosts (for perseus links and gloo)")
    ap.add_argument("--mpi-args", default="", help="extra mpirun arguments")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
