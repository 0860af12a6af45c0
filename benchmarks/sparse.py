"""Sparse embedding gradients: step time and bytes of every path, perseus vs Horovod, on Zipf token batches.

A job trains, for --steps timed steps after --warmup untimed ones, an embedding table of --vocab rows x
--dim columns (float32) followed by a small dense head (mean of the bag -> linear -> loss) on batches of
--tokens token ids per rank drawn from a Zipf law (exponent --zipf) over a random permutation of the
vocabulary, so that ranks share their frequent tokens (overlap) and each has its own tail. Methods:

  allgather   perseus DistributedOptimizer, sparse gradients allgathered (Horovod's own algorithm)
  dense       perseus, sparse_as_dense=True (the table's gradient all-reduced densely)
  zen         perseus, sparse_algorithm='zen' (balanced hash partition: push, sum, pull)
  auto        perseus, sparse_algorithm='auto' (the per-tensor choice)
  embrace     perseus DistributedEmbedding (column shards, all-to-all of lookups and gradients)
  horovod     Horovod 0.28.1's DistributedOptimizer with sparse gradients (its allgather path)

The driver runs one mpirun job per method and round (the order rotating each round) and reports the median
step time (slowest rank), ratios to the allgather path, and the bytes per step from perseus's counters
(hvd.wire_bytes(), every process set this rank belongs to is not summed: the global set's counters). Across
emulated hosts it also reports, for every method Horovod included, the bytes that really crossed between
hosts per step: the transmit counters of each host's PERSEUS_NETWORK_INTERFACE (/proc/net/dev of its network
namespace, TCP/IP headers included), summed over the hosts.

    python benchmarks/sparse.py --np 2 --rounds 2 --json benchmarks/results/sparse.jsonl
    tools/emulated_cluster.sh up 2 800 200 2
    python benchmarks/sparse.py --hosts perseus-h0,perseus-h1 --ranks-per-host 2 --rounds 2
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

METHODS = ("allgather", "dense", "zen", "auto", "embrace", "horovod")


# ----------------------------------------------------------------------------------------------- job side
def zipf_batch(rng, vocab: int, tokens: int, exponent: float, perm):
    import numpy as np

    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -exponent
    p /= p.sum()
    return perm[rng.choice(vocab, size=tokens, p=p)]


def link_tx_bytes():
    """Bytes sent so far by this network namespace's PERSEUS_NETWORK_INTERFACE (None without one)."""
    iface = os.environ.get("PERSEUS_NETWORK_INTERFACE")
    if not iface:
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])  # receive: 8 fields, then transmit bytes
    return None


def job(args) -> int:
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    if args.method == "horovod":
        import horovod.torch as hvd
    else:
        import perseus.torch as hvd
    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    if args.method == "embrace":
        emb = hvd.DistributedEmbedding(args.vocab, args.dim, sparse=True)
    else:
        emb = torch.nn.Embedding(args.vocab, args.dim, sparse=args.method != "dense")
    head = torch.nn.Linear(args.dim, 16)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kwargs = {}
    if args.method in ("zen", "auto", "allgather"):
        kwargs["sparse_algorithm"] = args.method
    if args.method == "dense":
        kwargs["sparse_as_dense"] = True
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)
    rng = np.random.default_rng(1000 + rank)
    perm = np.random.default_rng(7).permutation(args.vocab)
    batches = [torch.from_numpy(zipf_batch(rng, args.vocab, args.tokens, args.zipf, perm)).reshape(-1, 32)
               for _ in range(4)]
    target = torch.zeros(batches[0].shape[0], 16)
    wire = getattr(hvd, "wire_bytes", None)

    def step(i):
        ids = batches[i % len(batches)]
        opt.zero_grad()
        out = head(model["emb"](ids).mean(dim=1))
        torch.nn.functional.mse_loss(out, target).backward()
        opt.step()

    for i in range(args.warmup):
        step(i)
    comm.Barrier()
    before = wire()["sent_bytes"] if wire else None
    link_before = link_tx_bytes()
    times = []
    for i in range(args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    sent = (wire()["sent_bytes"] - before) / args.steps if wire else None
    sent = comm.allreduce(sent, op=MPI.MAX) if sent is not None else None
    link_after = link_tx_bytes()  # after the last allreduce: every rank has finished every step
    # One reading per host (the ranks of a host share its namespace's counter): the first rank's.
    seen = comm.gather((MPI.Get_processor_name(), link_before, link_after), root=0)
    link = None
    if rank == 0 and all(b is not None and a is not None for _, b, a in seen):
        per_host = {}
        for host, b, a in seen:
            per_host.setdefault(host, a - b)
        link = sum(per_host.values()) / args.steps if len(per_host) > 1 else None
    if rank == 0:
        row = {"method": args.method, "ranks": size, "vocab": args.vocab, "dim": args.dim, "tokens": args.tokens,
               "zipf": args.zipf, "step_s": [round(t, 4) for t in times], "sent_bytes_per_step": sent,
               "link_bytes_per_step": link, "round": args.round}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    hvd.shutdown()
    return 0


# -------------------------------------------------------------------------------------------- driver side
def command(args, method: str, rnd: int, out: str) -> list[str]:
    venv_bin = os.path.join(args.horovod_venv, "bin") if method == "horovod" else os.path.dirname(sys.executable)
    argv = [os.path.join(venv_bin, "mpirun"), "--allow-run-as-root", "--bind-to", "none"]
    if args.hosts:
        hosts = args.hosts.split(",")
        argv += ["-np", str(args.ranks_per_host * len(hosts)), "--host",
                 ",".join(f"{h}:{args.ranks_per_host}" for h in hosts), "--prefix", os.path.dirname(venv_bin),
                 "-x", "PATH", "-x", "PERSEUS_NETWORK_INTERFACE"]
    else:
        argv += ["-np", str(args.np), "--oversubscribe"]
    argv += shlex.split(args.mpi_args)
    argv += [os.path.join(venv_bin, "python"), os.path.abspath(__file__), "job", "--method", method,
             "--vocab", str(args.vocab), "--dim", str(args.dim), "--tokens", str(args.tokens), "--zipf",
             str(args.zipf), "--steps", str(args.steps), "--warmup", str(args.warmup), "--round", str(rnd),
             "--out", out]
    return argv


def driver(args) -> int:
    methods = args.methods.split(",")
    if "horovod" in methods and not os.path.exists(os.path.join(args.horovod_venv, "bin", "python")):
        print(f"sparse: no Horovod environment at {args.horovod_venv}; leaving it out", file=sys.stderr)
        methods.remove("horovod")
    env = dict(os.environ)
    if args.hosts:
        env.setdefault("PERSEUS_NETWORK_INTERFACE", "perseus0")
    out = tempfile.NamedTemporaryFile(prefix="perseus-sparse-", suffix=".jsonl", delete=False).name
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for m in order:
            t0 = time.monotonic()
            done = subprocess.run(command(args, m, rnd, out), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=args.job_timeout)
            status = "ok" if done.returncode == 0 else f"FAILED rc={done.returncode}"
            print(f"round {rnd} {m}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in open(out)]
    os.unlink(out)
    med, sent, link = {}, {}, {}
    for m in methods:
        ts = [t for r in rows if r["method"] == m for t in r["step_s"]]
        if ts:
            med[m] = statistics.median(ts)
            bs = [r["sent_bytes_per_step"] for r in rows if r["method"] == m and r["sent_bytes_per_step"]]
            sent[m] = statistics.median(bs) if bs else None
            ls = [r["link_bytes_per_step"] for r in rows if r["method"] == m and r.get("link_bytes_per_step")]
            link[m] = statistics.median(ls) if ls else None
    ranks = rows[0]["ranks"] if rows else 0
    print(f"\n{ranks} ranks, vocab {args.vocab} x dim {args.dim}, {args.tokens} tokens per rank, zipf {args.zipf}")
    print(f"{'method':<10} {'median ms':>10} {'x allgather':>12} {'sent MB/step':>13} {'bytes x allgather':>18} "
          f"{'between hosts MB/step':>22}")
    table = []
    for m, t in med.items():
        row = {"method": m, "ranks": ranks, "median_ms": round(t * 1e3, 2),
               "vs_allgather": round(t / med["allgather"], 3) if "allgather" in med else None,
               "sent_mb": round(sent[m] / 1e6, 3) if sent.get(m) else None,
               "link_mb": round(link[m] / 1e6, 3) if link.get(m) else None}
        if sent.get(m) and sent.get("allgather"):
            row["bytes_vs_allgather"] = round(sent[m] / sent["allgather"], 3)
        table.append(row)

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        print(f"{m:<10} {row['median_ms']:>10.1f} {f(row['vs_allgather'], '>12.3f')} {f(row['sent_mb'], '>13.3f')} "
              f"{f(row.get('bytes_vs_allgather'), '>18.3f')} {f(row['link_mb'], '>22.3f')}")
    if args.json:
        with open(args.json, "a") as fh:
            meta = {"bench": "sparse", "hosts": args.hosts, "vocab": args.vocab, "dim": args.dim,
                    "tokens": args.tokens, "zipf": args.zipf, "rounds": args.rounds}
            for r in rows:
                fh.write(json.dumps({**meta, "raw": r}) + "\n")
            for r in table:
                fh.write(json.dumps({**meta, **r}) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode")
    j = sub.add_parser("job", help="one timed job (run by mpirun on every rank)")
    j.add_argument("--method", required=True, choices=METHODS)
    j.add_argument("--round", type=int, default=0)
    j.add_argument("--out", required=True)
    for p in (ap, j):
        p.add_argument("--vocab", type=int, default=100_000)
        p.add_argument("--dim", type=int, default=256)
        p.add_argument("--tokens", type=int, default=4096, help="token ids per rank per step")
        p.add_argument("--zipf", type=float, default=1.1)
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--np", type=int, default=2, help="ranks on this machine (without --hosts)")
    ap.add_argument("--hosts", default="", help="emulated hosts, e.g. perseus-h0,perseus-h1")
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--mpi-args", default="")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
