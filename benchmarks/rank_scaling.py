"""Control-plane cost by rank count on one host, oversubscribed: perseus beside raw MPI in the same jobs.

    python benchmarks/rank_scaling.py                      # 2, 4, 8, 16 and 32 ranks, 3 jobs each
    python benchmarks/rank_scaling.py --ranks 2,8 --jobs 1

Each job is benchmarks/small_tensors.py under ``mpirun --oversubscribe -np N`` with ``--only perseus,mpi``:

- ``many`` with --tensors (default 161, the tensor count of a ResNet-50 gradient set) tensors of 1 KB started
  asynchronously and then waited for: one step's negotiation, fusion and completion for that many names with
  almost no data, in microseconds per tensor (times the count: per step);
- ``one``: a synchronous 1-float all-reduce, per round trip.

Raw MPI does the same all-reduces one after the other on the caller's thread in the same job, so the ratio
shows what perseus adds at each rank count; on a machine with fewer cores than ranks both include the
scheduler's share, which grows with the rank count. Jobs of different rank counts alternate (rotating order).
Results are JSON lines (small_tensors.py's, with the rank count) in --out; a table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def job(ranks: int, args, out: str) -> None:
    """One small_tensors.py job at ``ranks`` ranks appending to ``out``; raises RuntimeError on failure."""
    bin_dir = os.path.dirname(sys.executable)
    cmd = [os.path.join(bin_dir, "mpirun"), "--oversubscribe", "--bind-to", "none", "-np", str(ranks)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, os.path.join(HERE, "small_tensors.py"), "--only", "perseus,mpi", "--tensors",
            str(args.tensors), "--calls", str(args.calls), "--rounds", str(args.rounds), "--json", out,
            "--tag", f"ranks={ranks}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks: exit status {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    print(f"[rank_scaling] {ranks} ranks: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)


def table(out: str) -> str:
    rows = [json.loads(line) for line in open(out)]
    lines = ["| ranks | case | perseus | raw MPI | perseus / MPI (median of rounds) | jobs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for ranks in sorted({r["ranks"] for r in rows}):
        for case, unit in (("many", "us per tensor"), ("one", "us per round trip")):
            sel = [r for r in rows if r["ranks"] == ranks and r["case"] == case]
            if not sel:
                continue
            med = lambda key: statistics.median(r[key] for r in sel)  # noqa: E731
            lines.append(f"| {ranks} | {case} ({unit}) | {med('perseus_us'):.2f} | {med('mpi_us'):.2f} | "
                         f"{med('perseus_over_mpi'):.2f}x | {len(sel)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,4,8,16,32")
    ap.add_argument("--jobs", type=int, default=3, help="jobs per rank count")
    ap.add_argument("--tensors", type=int, default=161)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "rank_scaling_" + time.strftime("%Y-%m-%d") + ".jsonl"))
    args = ap.parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    if os.path.exists(args.out):
        os.unlink(args.out)
    for j in range(args.jobs):
        shift = j % len(counts)
        for ranks in counts[shift:] + counts[:shift]:
            job(ranks, args, args.out)
    print(table(args.out))


if __name__ == "__main__":
    main()
