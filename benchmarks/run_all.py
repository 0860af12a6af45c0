"""Run every benchmark that the docs quote, write the results, and regenerate the docs' tables and plots.

    python benchmarks/run_all.py            # the runs on one host (about 13 minutes on 2 cores)
    python benchmarks/run_all.py --cluster  # and across emulated hosts (root; about an hour in all): what the
                                            # docs show
    python benchmarks/run_all.py --quick    # about 3 minutes: fewer rounds and steps, no BERT-large

Phases (``--phases``; each writes JSON lines into the results folder, one file per phase):

- ``core``: benchmarks/core_job.py, one 2-rank job per library and round, the order of the jobs rotating every
  round: perseus, Horovod 0.28.1 (from --horovod-venv, when it is installed there), and a job with no
  library (the bounds with nothing idle beside them, and torch.distributed on gloo). Each job times its
  library against raw-MPI bounds in the same process, step by step, with the library initialised and idle.
- ``profile``: benchmarks/single_host_profile.py, where the time goes on one host (pages, latency).
- ``training``: benchmarks/training.py, end-to-end training throughput and scaling efficiency.
- ``convergence``: benchmarks/compression_convergence.py with evaluation curves: an MLP and a CNN under
  momentum SGD, a transformer encoder under AdamW, dense against top-k with and without momentum
  correction, PowerSGD; at 2 and 3 ranks.
- ``device``: benchmarks/gpu_step.py on CPU (``--backend gloo``): perseus's GPU launcher over Gloo, with and
  without its device buckets, against torch DDP over Gloo, on an MLP and a ResNet-18, with no injected launch
  cost and with 5 ms per launch (a stand-in for an expensive NCCL call): step times and launches per step.
- ``multihost``, ``recovery``, ``training_cluster`` (with --cluster): channel scaling across 2 emulated hosts
  (800 Mbit/s links, 200 Mbit/s per flow), elastic recovery, training across the hosts.
- ``dear``, ``embrace``, ``elastic_commit``, ``compression`` (with --cluster): benchmarks/dear.py (DeAR against
  the default schedule and Horovod, and (RS + AG) / AR), benchmarks/sparse.py at 4 ranks, 2 per host (sparse
  embedding gradients: EmbRace, Zen, allgather, dense, Horovod), benchmarks/elastic_commit.py (the cost of
  committing an elastic job's state every step; unshaped links) and benchmarks/compression.py (compressed
  gradients against dense and Horovod), each across 2 emulated hosts.

A phase's Horovod jobs run only when ``import horovod.torch`` works in --horovod-venv; without it the other
methods still run.

The full run writes into benchmarks/results/run_all/ (committed; the docs are generated from it), --quick into
benchmarks/results/run_all_quick/. After the phases, benchmarks/report.py rewrites the tables between the
markers in docs/benchmarks.md, docs/compression.md, docs/gpu.md and README.md and draws the plots into docs/img/ (--no-docs skips that; a quick
run never touches the docs unless --docs is given). Progress goes to stderr, one line per job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("core", "profile", "training", "convergence", "device", "multihost", "recovery", "training_cluster",
          "dear", "embrace", "elastic_commit", "compression")
CLUSTER_PHASES = ("multihost", "recovery", "training_cluster", "dear", "embrace", "elastic_commit", "compression")
#: tools/emulated_cluster.sh up's arguments per phase (hosts, link Mbit/s, flow Mbit/s[, slots per host]);
#: other cluster phases: 2 hosts, 800 Mbit/s links, 200 Mbit/s per TCP flow
CLUSTER_UP = {"recovery": ("2", "0", "0", "1"), "elastic_commit": ("2", "0", "0", "1"),
              "embrace": ("2", "800", "200", "2")}
HOSTS = "perseus-h0,perseus-h1"


def say(msg: str) -> None:
    print(f"[run_all {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mpirun(bin_dir: str, np_: int = 2) -> list[str]:
    cmd = [os.path.join(bin_dir, "mpirun"), "--oversubscribe", "--bind-to", "none", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def run(cmd: list[str], timeout: float, env: dict | None = None) -> str:
    """Run one job and return its output; raise RuntimeError with the output's tail when it fails or outlives
    timeout."""
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    subprocess.run([sys.executable, "-m", "perseus.runner.session_dirs"], check=False, env=full_env,
                   capture_output=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(cmd)}: no result after {timeout:.0f} s") from e
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd)}: exit status {proc.returncode}\n{tail}")
    say(f"  done in {time.monotonic() - t0:.1f} s: {' '.join(os.path.basename(c) for c in cmd[-8:])}")
    return proc.stdout + proc.stderr


def horovod_bin(venv: str) -> str | None:
    """The Horovod venv's bin folder when horovod.torch imports there, else None."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        return None
    ok = subprocess.run([py, "-c", "import horovod.torch"], capture_output=True).returncode == 0
    return os.path.join(venv, "bin") if ok else None


def phase_core(args, out: str, hvd_bin: str | None) -> None:
    libs = [("perseus", os.path.dirname(sys.executable)), ("none", os.path.dirname(sys.executable))]
    if hvd_bin:
        libs.insert(1, ("horovod", hvd_bin))
    else:
        say(f"Horovod is not installed in {args.horovod_venv} (tools/install_horovod_baseline.sh): not measured")
    sets = "resnet50" if args.quick else "resnet50,bert_large"
    for r in range(args.rounds):
        order = libs[r % len(libs):] + libs[:r % len(libs)]
        for lib, bin_dir in order:
            say(f"core round {r + 1}/{args.rounds}: {lib}")
            run(mpirun(bin_dir) + [os.path.join(bin_dir, "python"), os.path.join(HERE, "core_job.py"),
                                   "--lib", lib, "--sets", sets, "--round", str(r), "--out", out,
                                   "--steps", str(args.steps), "--bert-steps", str(max(args.steps // 3, 1)),
                                   "--small-rounds", str(args.steps)], timeout=1800)


def phase_profile(args, out: str, hvd_bin: str | None) -> None:
    run([sys.executable, os.path.join(HERE, "single_host_profile.py"), "--rounds", str(args.rounds),
         "--json", out], timeout=1800)


def phase_training(args, out: str, hvd_bin: str | None, cluster: bool = False) -> None:
    cmd = [sys.executable, os.path.join(HERE, "training.py"), "--rounds", str(args.rounds), "--json", out,
           "--horovod-venv", args.horovod_venv]
    if args.quick:
        cmd.append("--quick")
    if cluster:
        cmd.append("--cluster")
    run(cmd, timeout=5400)


#: the convergence runs: (rank counts, arguments); variants "name:...:nomc" are the uncorrected baselines
CONVERGENCE = (
    ("mlp", ["--tasks", "mlp", "--mlp-seeds", "3", "--eval-every", "50", "--variants",
             "dense,topk:0.01:nomc,topk:0.01,topk:0.001:nomc,topk:0.001,topk:0.001:warmup_steps=150,powersgd:4"]),
    ("mlp_short", ["--tasks", "mlp_short", "--mlp-seeds", "3", "--eval-every", "25", "--variants",
                   "dense,topk:0.01:nomc,topk:0.01,topk:0.001:nomc,topk:0.001,topk:0.001:warmup_steps=75"]),
    ("digits", ["--tasks", "digits", "--momentum", "0.9", "--digits-lr", "0.03", "--digits-seeds", "3",
                "--eval-every", "90", "--variants",
                "dense,topk:0.01:nomc,topk:0.01,topk:0.001:warmup_steps=270,powersgd:4"]),
    ("transformer", ["--tasks", "transformer", "--transformer-seeds", "2", "--eval-every", "50", "--variants",
                     "dense,topk:0.01:nomc,topk:0.01,topk:0.05,topk:0.001,powersgd:4"]),
    ("linear", ["--tasks", "linear", "--eval-every", "60", "--variants", "dense,topk:0.01,topk:0.01:noef"]),
)
QUICK_CONVERGENCE = (
    ("mlp", ["--tasks", "mlp", "--mlp-seeds", "1", "--mlp-steps", "300", "--eval-every", "50", "--variants",
             "dense,topk:0.01:nomc,topk:0.01"]),
    ("transformer", ["--tasks", "transformer", "--transformer-seeds", "1", "--tf-steps", "200", "--eval-every",
                     "50", "--variants", "dense,topk:0.01:nomc,topk:0.01"]),
)


def phase_convergence(args, out: str, hvd_bin: str | None) -> None:
    """benchmarks/compression_convergence.py: every task of CONVERGENCE (QUICK_CONVERGENCE with --quick) at 2
    and 3 ranks (2 only with --quick), appending to ``out``."""
    bin_dir = os.path.dirname(sys.executable)
    for np_ in ((2,) if args.quick else (2, 3)):
        for task, task_args in (QUICK_CONVERGENCE if args.quick else CONVERGENCE):
            say(f"convergence: {task} on {np_} ranks")
            run(mpirun(bin_dir, np_) + [sys.executable, os.path.join(HERE, "compression_convergence.py"),
                                        *task_args, "--json", out], timeout=3600)


#: the device phase's runs: (model, extra arguments); each with every launch cost of DEVICE_LAUNCH_COSTS_MS
DEVICE_MODELS = (("mlp", ["--batch", "32"]), ("resnet18", ["--batch", "8", "--image-size", "32"]))
DEVICE_LAUNCH_COSTS_MS = (0.0, 5.0)


def phase_device(args, out: str, hvd_bin: str | None) -> None:
    """benchmarks/gpu_step.py --backend gloo on 2 ranks: each model with each injected launch cost, one JSON line
    per run appended to ``out``."""
    bin_dir = os.path.dirname(sys.executable)
    steps = "6" if args.quick else "12"
    for model, extra in DEVICE_MODELS:
        for cost in DEVICE_LAUNCH_COSTS_MS:
            say(f"device: {model}, {cost:g} ms per launch")
            run(mpirun(bin_dir) + [sys.executable, os.path.join(HERE, "gpu_step.py"), "--backend", "gloo",
                                   "--models", model, "--rounds", str(args.rounds), "--steps", steps,
                                   "--launch-cost-ms", str(cost), "--jsonl", out, *extra], timeout=1800)


def phase_multihost(args, out: str, hvd_bin: str | None) -> None:
    methods = "perseus-default,perseus-1ch,perseus-2ch,perseus-4ch,perseus-8ch,mpi"
    if hvd_bin:
        methods += ",horovod"
    run([sys.executable, os.path.join(HERE, "multihost.py"), "--sets", "resnet50", "--methods", methods,
         "--rounds", str(args.rounds), "--link-mbit", "800", "--flow-mbit", "200",
         "--horovod-venv", args.horovod_venv, "--json", out], timeout=5400)


def phase_recovery(args, out: str, hvd_bin: str | None) -> None:
    run([sys.executable, os.path.join(HERE, "elastic_recovery.py"), "--state-mb", "32" if args.quick else "128",
         "--rounds", str(args.rounds), "--json", out], timeout=3600)


def run_driver(cmd: list[str], out: str, timeout: float) -> None:
    """run() for a benchmark driver that carries on past a failed job (dear.py, sparse.py and compression.py
    print "round R METHOD: FAILED ..." and still exit 0): RuntimeError when a job failed or nothing reached
    ``out``, so that the phase counts as failed and the docs keep its last complete run."""
    output = run(cmd, timeout)
    failed = re.findall(r"^round \d+ \S+: FAILED.*$", output, re.M)
    if failed:
        raise RuntimeError(f"{len(failed)} job(s) failed: {'; '.join(failed)}\n{output[-3000:]}")
    if not os.path.exists(out) or not os.path.getsize(out):
        raise RuntimeError(f"{os.path.basename(cmd[1])} wrote no results\n{output[-3000:]}")


def usable(methods: str, hvd_bin: str | None, args) -> str:
    """``methods`` (a comma list) less the Horovod ones when Horovod does not import from --horovod-venv."""
    kept = [m for m in methods.split(",") if hvd_bin or not m.startswith("horovod")]
    if len(kept) < len(methods.split(",")):
        say(f"Horovod is not installed in {args.horovod_venv} (tools/install_horovod_baseline.sh): not measured")
    return ",".join(kept)


def phase_dear(args, out: str, hvd_bin: str | None) -> None:
    """benchmarks/dear.py with one rank on each emulated host: the default schedule, DeAR, Horovod, and
    reduce-scatter + all-gather against all-reduce (rsag)."""
    cmd = [sys.executable, os.path.join(HERE, "dear.py"), "--hosts", HOSTS, "--iface", "perseus0",
           "--methods", usable("default,dear,dear:1048576,horovod,rsag", hvd_bin, args), "--rounds", str(args.rounds),
           "--horovod-venv", args.horovod_venv, "--layers", "8", "--batch", "1024", "--json", out]
    cmd += ["--windows", "2", "--steps", "3"] if args.quick else ["--windows", "3", "--steps", "4"]
    run_driver(cmd, out, timeout=3600)


def phase_embrace(args, out: str, hvd_bin: str | None) -> None:
    """benchmarks/sparse.py at 4 ranks, 2 on each emulated host: every sparse path, EmbRace and Horovod's."""
    cmd = [sys.executable, os.path.join(HERE, "sparse.py"), "--hosts", HOSTS, "--ranks-per-host", "2",
           "--methods", usable("allgather,dense,zen,auto,embrace,horovod", hvd_bin, args),
           "--rounds", str(args.rounds), "--horovod-venv", args.horovod_venv, "--json", out]
    if args.quick:
        cmd += ["--steps", "5", "--warmup", "2"]
    run_driver(cmd, out, timeout=3600)


def phase_elastic_commit(args, out: str, hvd_bin: str | None) -> None:
    """benchmarks/elastic_commit.py on 2 emulated hosts: step time with and without a commit every step."""
    run_driver([sys.executable, os.path.join(HERE, "elastic_commit.py"), "--hosts", HOSTS,
                "--state-mb", "32" if args.quick else "128", "--rounds", str(args.rounds), "--json", out],
               out, timeout=3600)


def phase_compression(args, out: str, hvd_bin: str | None) -> None:
    """benchmarks/compression.py, one rank on each emulated host, its default methods."""
    methods = "dense,fp16,topk,espresso,cupcake,powersgd,horovod-dense,horovod-fp16"
    cmd = [sys.executable, os.path.join(HERE, "compression.py"), "--hosts", HOSTS, "--iface", "perseus0",
           "--methods", usable(methods, hvd_bin, args), "--rounds", str(args.rounds),
           "--horovod-venv", args.horovod_venv, "--json", out]
    if args.quick:
        cmd += ["--steps", "3"]
    run_driver(cmd, out, timeout=5400)


def cluster(action: str, *params: str) -> None:
    """Bring the emulated cluster up or down; RuntimeError when it does not come up."""
    cmd = ["bash", os.path.join(ROOT, "tools", "emulated_cluster.sh"), action, *params]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if action == "up" and done.returncode != 0:
        raise RuntimeError(f"the emulated cluster did not come up: {done.stderr[-2000:]}")


RUNNERS = {"core": phase_core, "profile": phase_profile, "training": phase_training, "convergence": phase_convergence,
           "device": phase_device, "multihost": phase_multihost, "recovery": phase_recovery,
           "training_cluster": lambda a, o, h: phase_training(a, o, h, cluster=True), "dear": phase_dear,
           "embrace": phase_embrace, "elastic_commit": phase_elastic_commit, "compression": phase_compression}


def phase_args(args, phase: str):
    """The arguments a phase runs with: the emulated-host phases take --cluster-rounds rounds."""
    if phase not in CLUSTER_PHASES:
        return args
    return argparse.Namespace(**dict(vars(args), rounds=args.cluster_rounds))


def write_meta(folder: str, args, ran: dict) -> None:
    """meta.json: per phase, when and how it last ran (the phases of earlier runs keep their entries)."""
    path = os.path.join(folder, "meta.json")
    meta = json.load(open(path)) if os.path.exists(path) else {}
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    common = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit, "quick": args.quick,
              "steps": args.steps, "cpus": os.cpu_count(), "machine": platform.platform(),
              "python": platform.python_version()}
    for phase, seconds in ran.items():
        meta[phase] = dict(common, rounds=phase_args(args, phase).rounds, seconds=round(seconds))
    with open(path, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps, no BERT-large")
    ap.add_argument("--cluster", action="store_true", help="also the emulated-host phases (root)")
    ap.add_argument("--phases", default="", help="comma list of " + ", ".join(PHASES) + " (default: all that apply)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per phase (default 5, quick 3)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per core job (default 9, quick 4)")
    ap.add_argument("--cluster-rounds", type=int, default=3, help="rounds of the emulated-host phases")
    ap.add_argument("--horovod-venv", default="/work/hvd-venv")
    ap.add_argument("--out", default="", help="results folder (default benchmarks/results/run_all[_quick])")
    ap.add_argument("--docs", dest="docs", action="store_true", default=None, help="regenerate the docs")
    ap.add_argument("--no-docs", dest="docs", action="store_false")
    args = ap.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (4 if args.quick else 9)
    docs = (not args.quick) if args.docs is None else args.docs
    phases = args.phases.split(",") if args.phases else [
        p for p in PHASES if args.cluster or p not in CLUSTER_PHASES]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phase(s) {sorted(unknown)}; choose from {', '.join(PHASES)}")
    if any(p in CLUSTER_PHASES for p in phases) and os.geteuid() != 0:
        ap.error("the emulated-host phases need root (network namespaces); leave out --cluster")
    folder = args.out or os.path.join(HERE, "results", "run_all_quick" if args.quick else "run_all")
    os.makedirs(folder, exist_ok=True)
    hvd_bin = horovod_bin(args.horovod_venv)
    failed, ran = [], {}
    for phase in phases:
        out = os.path.join(folder, f"{phase}.jsonl")
        if os.path.exists(out):
            shutil.move(out, out + ".previous")  # a phase's file holds one run; the last one stays beside it
        say(f"phase {phase} -> {os.path.relpath(out, ROOT)}")
        t0 = time.monotonic()
        try:
            if phase in CLUSTER_PHASES:
                cluster("up", *CLUSTER_UP.get(phase, ("2", "800", "200")))
            RUNNERS[phase](phase_args(args, phase), out, hvd_bin)
        except RuntimeError as e:  # one phase's failure is reported and the others still run
            failed.append(phase)
            say(f"phase {phase} FAILED: {e}")
            if os.path.exists(out):
                shutil.move(out, out + ".failed")
            if os.path.exists(out + ".previous"):  # the docs keep the last complete run of this phase
                shutil.move(out + ".previous", out)
        finally:
            if phase in CLUSTER_PHASES:
                cluster("down")
        say(f"phase {phase}: {time.monotonic() - t0:.0f} s")
        if phase not in failed:
            ran[phase] = time.monotonic() - t0
    write_meta(folder, args, ran)
    for f in os.listdir(folder):
        if f.endswith(".previous"):
            os.remove(os.path.join(folder, f))
    if docs:
        subprocess.run([sys.executable, os.path.join(HERE, "report.py"), folder], check=True)
    say("failed phases: " + ", ".join(failed) if failed else "every phase ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
