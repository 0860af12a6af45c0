"""End-to-end data-parallel training throughput: perseus vs Horovod vs torch DDP, and the 1-rank baseline.

Two synthetic models train on random data on the CPU:

  resnet        a small ResNet (a 3x3 stem and four stages of two residual blocks, widths w, 2w, 4w, 8w) on
                --image-size square images, 10 classes; throughput in images per second
  transformer   token embedding + torch.nn.TransformerEncoder (--layers layers, --d-model wide, 4 heads,
                feed-forward 4 x d_model) + a vocabulary head on --seq-len tokens; sequences per second

Methods, each one mpirun job per model and round (the driver rotates the order of the methods every round):

  single    1 rank, plain optimizer, no communication: the baseline for scaling efficiency
  perseus   ``import perseus.torch as hvd``; hvd.DistributedOptimizer(named_parameters=...), whose hooks
            all-reduce every gradient as backward produces it, so communication overlaps the rest of backward
  horovod   the same code with ``import horovod.torch as hvd``, run from the Horovod venv (--horovod-venv) with
            its own mpirun; reported as unavailable (a printed line and a JSON row) when it does not import
  ddp       torch DistributedDataParallel on the gloo backend (bucketed all-reduce hooked into backward)

perseus and Horovod start (hvd.init()) before the job imports mpi4py, as in a training script, so each runs
with the MPI options it picks itself: perseus sets Open MPI's mpi_yield_when_idle=1 (a rank waiting in MPI
yields its core), Horovod leaves Open MPI's default (it spins). With one core per rank that matters: with MPI
started first, perseus's ResNet throughput here fell from about 290 to 210-230 images/s.

Every job sets torch.set_num_threads(1) on every rank, the 1-rank job included: on a 2-core machine each of
the 2 ranks gets one core, so a rank of a 2-rank job computes as fast as the single job and the comparison
isolates what communication (and its overlap) costs. Each job warms up --warmup steps, lines the ranks up with
a barrier, trains --steps steps and takes the slowest rank's elapsed time; a step is that time / --steps and
the job's throughput is ranks x batch x steps / that time (samples per second for the whole job). Each job
also records cpu_per_s, the busiest rank's CPU seconds (all its threads) per second of the timed steps: above
1.0, communication threads took CPU time that the rank's one compute thread then shares a core with; and
beside_cpu_per_step, the CPU seconds per step of every thread but the training thread (the library's engine
and channel threads, gloo's, torch's own) on the busiest rank.

The driver reports per model and method the median throughput over the rounds, the scaling efficiency
(median throughput / (ranks x median single throughput)) and the ratios to Horovod and to DDP as medians of
the per-round ratios (both methods ran in the same round). --json appends one line per (model, method) with
the per-round samples and the settings. --cluster runs the multi-rank jobs one rank per emulated host
(tools/emulated_cluster.sh up 2 800 200 first; needs root); the single job stays local.

    python benchmarks/training.py --rounds 3 --json benchmarks/results/training.jsonl
    python benchmarks/training.py --quick                    # 2 rounds, few steps, a couple of minutes
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
METHODS = ("single", "perseus", "horovod", "ddp")
UNITS = {"resnet": "images/s", "transformer": "sequences/s"}


# --------------------------------------------------------------------------------------------- models
def make_resnet(args, torch):
    """The small ResNet for --width and 10 classes, and a batch of random images and labels."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
            return F.relu(y + self.short(x))

    w = args.width
    layers, cin = [nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()], w
    for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
        layers += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    return model, x, torch.randint(0, 10, (args.batch,))


def make_transformer(args, torch):
    """The encoder language model for --d-model/--layers/--vocab, and a batch of random tokens as input and target."""
    nn = torch.nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.d_model
            self.embed = nn.Embedding(args.vocab, d)
            self.pos = nn.Parameter(torch.randn(args.seq_len, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, args.vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.pos)).flatten(0, 1)

    tokens = torch.randint(0, args.vocab, (args.seq_batch, args.seq_len))
    return Encoder(), tokens, tokens.flatten()


# ----------------------------------------------------------------------------------------------- job side
def start_library(method: str):
    """Import and initialise perseus.torch or horovod.torch (None for other methods).

    It runs before the job imports mpi4py, as in a training script that starts with hvd.init(): perseus picks
    MPI's options (mpi_yield_when_idle) only when it is the one that starts MPI.
    """
    if method == "perseus":
        import perseus.torch as hvd
    elif method == "horovod":
        import horovod.torch as hvd
    else:
        return None
    hvd.init()
    return hvd


def distribute(args, model, optimizer, comm, hvd):
    """Wrap model and optimizer for args.method; return (model, optimizer, shutdown callable)."""
    if args.method == "single":
        return model, optimizer, lambda: None
    if hvd is not None:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return model, optimizer, hvd.shutdown
    if args.method == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if comm.Get_rank() == 0:
            addr = socket.gethostbyname(socket.gethostname()) if args.cluster else "127.0.0.1"
            with socket.socket() as s:  # a free port for the rendezvous, chosen by the kernel
                s.bind((addr, 0))
                port = s.getsockname()[1]
        addr, port = comm.bcast((addr, port) if comm.Get_rank() == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.Get_rank(),
                                world_size=comm.Get_size())
        return DistributedDataParallel(model), optimizer, dist.destroy_process_group
    raise SystemExit(f"unknown method {args.method!r}")


def thread_cpu() -> dict:
    """CPU seconds so far of each of this process's threads, summed by thread name (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def job(args) -> int:
    """One timed job on this rank; rank 0 appends the job's row to args.out."""
    import torch

    hvd = start_library(args.method)
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(1234)  # the same initial weights everywhere (broadcast from rank 0 anyway)
    model, x, y = (make_resnet if args.model == "resnet" else make_transformer)(args, torch)
    torch.manual_seed(1234 + rank)
    x = x if args.model == "transformer" else torch.randn_like(x)  # each rank its own images
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, shutdown = distribute(args, model, optimizer, comm, hvd)
    loss_fn = torch.nn.functional.cross_entropy

    def step():
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    comm.Barrier()
    t0, c0, m0, threads0 = time.perf_counter(), time.process_time(), time.thread_time(), thread_cpu()
    for _ in range(args.steps):
        loss = step()
    elapsed, cpu, threads1 = time.perf_counter() - t0, time.process_time() - c0, thread_cpu()
    beside = cpu - (time.thread_time() - m0)  # every thread but the training thread: the library's, torch's
    beside_max = comm.allreduce(beside / args.steps, op=MPI.MAX)
    slowest = comm.allreduce(elapsed, op=MPI.MAX)
    busiest = comm.allreduce(cpu / elapsed, op=MPI.MAX)  # CPU seconds per second, all of a process's threads
    batch = args.batch if args.model == "resnet" else args.seq_batch
    if rank == 0:
        row = {"model": args.model, "method": args.method, "ranks": size, "round": args.round,
               "step_s": round(slowest / args.steps, 5), "throughput": round(size * batch * args.steps / slowest, 3),
               "params": sum(p.numel() for p in model.parameters()), "final_loss": round(loss.item(), 4),
               "cpu_per_s": round(busiest, 3),
               # CPU seconds per step of the threads beside the training thread, on the busiest rank
               "beside_cpu_per_step": round(beside_max, 5),
               # rank 0's CPU seconds per step by thread name: what the library's threads take from the core
               "thread_cpu_per_step": {k: round((v - threads0.get(k, 0.0)) / args.steps, 4)
                                       for k, v in threads1.items() if v - threads0.get(k, 0.0) > 0}}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    shutdown()
    return 0


# -------------------------------------------------------------------------------------------- driver side
def horovod_missing(venv: str) -> str:
    """Why Horovod cannot run from venv ('' when ``import horovod.torch`` works there)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return f"no Python at {python}"
    try:
        probe = subprocess.run([python, "-c", "import horovod.torch, mpi4py"], capture_output=True, text=True,
                               timeout=180)
    except subprocess.TimeoutExpired:
        return f"importing horovod.torch from {venv} took over 180 s"
    if probe.returncode != 0:
        return f"import horovod.torch fails in {venv}: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
    return ""


SIZE_FLAGS = ("batch", "image_size", "width", "seq_batch", "seq_len", "d_model", "layers", "vocab", "steps",
              "warmup")


def command(args, method: str, model: str, rnd: int, out: str) -> tuple[list[str], dict]:
    """The mpirun argv and environment of one job."""
    venv_bin = os.path.join(args.horovod_venv, "bin") if method == "horovod" else os.path.dirname(sys.executable)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    argv = [os.path.join(venv_bin, "mpirun"), "--allow-run-as-root", "--bind-to", "none"]
    ranks = 1 if method == "single" else args.ranks
    if args.cluster and method != "single":
        hosts = args.hosts.split(",")
        per_host = -(-ranks // len(hosts))
        argv += ["--host", ",".join(f"{h}:{per_host}" for h in hosts), "--prefix", os.path.dirname(venv_bin)]
        env["PERSEUS_NETWORK_INTERFACE"] = env["GLOO_SOCKET_IFNAME"] = args.iface
    else:
        argv += ["--oversubscribe"]
    argv += ["-np", str(ranks)]
    for name in sorted(env):
        if name.startswith(("PERSEUS_", "HOROVOD_", "OMPI_MCA_", "GLOO_")) or name in ("PATH", "PYTHONPATH"):
            argv += ["-x", name]
    argv += shlex.split(args.mpi_args)
    argv += [os.path.join(venv_bin, "python"), os.path.abspath(__file__), "job", "--method", method, "--model",
             model, "--round", str(rnd), "--out", out]
    for flag in SIZE_FLAGS:
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + (["--cluster"] if args.cluster else []), env


def run_rounds(args, methods: list[str], out: str) -> int:
    """Run every (round, model, method) job, rotating the method order per round; return the failures."""
    failures = 0
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for model in args.models.split(","):
            for m in order:
                argv, env = command(args, m, model, rnd, out)
                t0 = time.monotonic()
                try:
                    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          timeout=args.job_timeout)
                    rc, text = done.returncode, done.stdout
                except subprocess.TimeoutExpired as e:  # the output so far comes as bytes
                    rc, text = "timeout", (e.stdout or b"").decode(errors="replace")
                status = "ok" if rc == 0 else f"FAILED rc={rc}"
                print(f"round {rnd} {model} {m}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
                if rc != 0:
                    failures += 1
                    print(text[-3000:], file=sys.stderr, flush=True)
    return failures


def per_round_ratio(rows: list[dict], method: str, other: str):
    """Median over rounds of throughput(method) / throughput(other), both from the same round; None if none."""
    by_round = {}
    for r in rows:
        by_round.setdefault(r["round"], {})[r["method"]] = r["throughput"]
    ratios = [v[method] / v[other] for v in by_round.values() if method in v and other in v]
    return round(statistics.median(ratios), 3) if ratios else None


def summarize(rows: list[dict], args, methods: list[str]) -> list[dict]:
    """One summary per (model, method) that has samples."""
    table = []
    for model in args.models.split(","):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["round"])
        med = {m: statistics.median([r["throughput"] for r in mine if r["method"] == m])
               for m in methods if any(r["method"] == m for r in mine)}
        for m in med:
            samples = [r for r in mine if r["method"] == m]
            ranks = samples[0]["ranks"]
            row = {"model": model, "method": m, "available": True, "ranks": ranks, "unit": UNITS[model],
                   "params": samples[0]["params"], "median_throughput": round(med[m], 2),
                   "throughput": [r["throughput"] for r in samples], "step_s": [r["step_s"] for r in samples],
                   "cpu_per_s": [r["cpu_per_s"] for r in samples],
                   "beside_cpu_per_step": [r.get("beside_cpu_per_step") for r in samples],
                   "rounds_done": [r["round"] for r in samples]}
            if "single" in med:
                row["efficiency"] = round(med[m] / (ranks * med["single"]), 3)
            for other in ("horovod", "ddp"):
                if other in med and other != m and m != "single":
                    row[f"vs_{other}"] = per_round_ratio(mine, m, other)
            table.append(row)
    return table


def settings(args) -> dict:
    """The settings recorded with every JSON row."""
    s = {flag: getattr(args, flag) for flag in SIZE_FLAGS}
    s.update(bench="training", date=time.strftime("%Y-%m-%d"), rounds=args.rounds, multi_ranks=args.ranks,
             cluster=args.hosts if args.cluster else "", torch_threads_per_rank=1, cpus=os.cpu_count(),
             host=socket.gethostname(), loadavg_at_end=[round(x, 2) for x in os.getloadavg()])
    return s


def report(table: list[dict], missing: str, args) -> None:
    """Print the table (and why Horovod is missing) and append the JSON rows to args.json."""
    print(f"\n{'model':<12} {'method':<8} {'ranks':>5} {'median':>9} {'unit':<12} {'eff':>6} {'vs hvd':>7} "
          f"{'vs ddp':>7}")
    def fmt(v):
        return f"{v:>7.2f}" if isinstance(v, float) else f"{'-':>7}"

    for r in table:
        print(f"{r['model']:<12} {r['method']:<8} {r['ranks']:>5} {r['median_throughput']:>9.1f} {r['unit']:<12} "
              f"{r.get('efficiency', float('nan')):>6.2f} {fmt(r.get('vs_horovod'))} {fmt(r.get('vs_ddp'))}")
    if missing:
        print(f"horovod: unavailable ({missing})")
    if args.json:
        meta = settings(args)
        with open(args.json, "a") as f:
            for r in table:
                f.write(json.dumps({**meta, **r}) + "\n")
            if missing:
                for model in args.models.split(","):
                    f.write(json.dumps({**meta, "model": model, "method": "horovod", "available": False,
                                        "reason": missing}) + "\n")


def driver(args) -> int:
    """Run all jobs, print the summary, write --json; exit status 1 if any job failed."""
    for name, normal, quick in (("rounds", 3, 2), ("steps", 20, 4), ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else normal)
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    missing = horovod_missing(args.horovod_venv) if "horovod" in methods else ""
    if missing:
        print(f"horovod: unavailable, left out ({missing})", flush=True)
        methods.remove("horovod")
    fd, out = tempfile.mkstemp(prefix="perseus-training-", suffix=".jsonl")
    os.close(fd)
    try:
        failures = run_rounds(args, methods, out)
        with open(out) as f:
            rows = [json.loads(line) for line in f]
    finally:
        os.unlink(out)
    report(summarize(rows, args, methods), missing, args)
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="driver", choices=["driver", "job"])
    ap.add_argument("--models", default="resnet,transformer")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per job; default 20 (4 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first; default 3 (1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 steps after 1 warm-up step")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the distributed jobs")
    ap.add_argument("--batch", type=int, default=32, help="resnet images per rank and step")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--width", type=int, default=32, help="resnet channels of the first stage")
    ap.add_argument("--seq-batch", type=int, default=4, help="transformer sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--cluster", action="store_true", help="multi-rank jobs across the emulated hosts (root)")
    ap.add_argument("--hosts", default="perseus-h0,perseus-h1")
    ap.add_argument("--iface", default="perseus0", help="interface inside the emulated hosts")
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--mpi-args", default="", help="extra mpirun arguments")
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--json", default="")
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    return job(args) if args.mode == "job" else driver(args)


if __name__ == "__main__":
    sys.exit(main())
