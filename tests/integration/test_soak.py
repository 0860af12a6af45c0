"""A minute of benchmarks/soak.py on 3 ranks: random mixed collectives, every result checked, no hang.

The soak itself runs for hours by hand (see its docstring); here it runs for 60 s and must finish with no hang
and no error, a floor of operations done, and a generous bound on memory growth after its warm-up (printed, so
that the figure is in the log: run with -s).
"""

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.full]  # soak runs: the full test run only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DURATION_S = 60
MIN_OPERATIONS = 500  # measured: about 4,300 in a minute on 2 shared cores; a floor that only a stuck run misses
MAX_GROWTH_MB = 200  # after the warm-up; measured: under 10 MB


def mpirun():
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return local if os.path.exists(local) else "mpirun"


def soak(*args, limit_s):
    """Run soak.py on 3 ranks with args; return (exit status, its reports, all output, seconds)."""
    cmd = [mpirun(), "--oversubscribe", "--bind-to", "none", "-np", "3"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py")] + [str(a) for a in args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
    reports = [json.loads(line.split("soak report: ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("soak report: ")]
    return proc.returncode, reports, proc.stdout + proc.stderr, time.monotonic() - started


def test_soak_a_minute_on_three_ranks(tmp_path):
    out = tmp_path / "soak.json"
    code, reports, text, took = soak("--duration", DURATION_S, "--warmup", 15, "--watchdog", 60, "--out", out,
                                     limit_s=DURATION_S + 150)
    assert code == 0, f"exit status {code} after {took:.0f} s\n{text[-6000:]}"
    assert len(reports) == 1, text[-6000:]
    r = reports[0]
    assert r == json.loads(out.read_text())
    print(f"\nsoak, 3 ranks, {r['duration_s']} s: {r['operations']} operations ({r['ops_per_s']}/s), "
          f"{r['joins']} joins, {r['hangs']} hangs, {r['errors']} errors; RSS growth after the {r['warmup_s']} s "
          f"warm-up: at most {r['max_rss_growth_after_warmup_mb']} MB on a rank "
          f"({r['max_rss_slope_mb_per_hour']} MB/h as a slope)")
    assert r["hangs"] == 0 and r["errors"] == 0, r
    assert r["ranks"] == 3 and r["duration_s"] >= DURATION_S
    assert r["operations"] >= MIN_OPERATIONS, r
    assert set(r["by_kind"]) >= {"allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                                 "allreduce_async", "grouped_allreduce"}, r["by_kind"]
    assert r["max_rss_growth_after_warmup_mb"] < MAX_GROWTH_MB, r["rss_mb"]


def test_soak_watchdog_ends_a_hung_run():
    """The last rank stops taking part at step 30: the others' watchdogs (5 s) report a hang and the job ends
    with a non-zero status."""
    code, reports, text, took = soak("--duration", 60, "--watchdog", 5, "--stall-at-step", 30, limit_s=120)
    assert code != 0, text[-4000:]
    assert took < 60, text[-4000:]
    hung = [r for r in reports if r["hangs"] == 1]
    assert hung and all(r["rank"] != 2 and "did not finish within 5 s" in r["hang"] for r in hung), text[-4000:]


def test_soak_checks_catch_a_wrong_result():
    """Every rank adds 1 to its input at step 20: the check fails, the run ends with status 1 and an error."""
    code, reports, text, took = soak("--duration", 60, "--watchdog", 30, "--wrong-at-step", 20, limit_s=120)
    assert code != 0, text[-4000:]
    assert took < 60, text[-4000:]
    assert any(r["errors"] == 1 and "step 20: wrong result" in r["error"] for r in reports), text[-4000:]
