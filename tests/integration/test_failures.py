"""A rank that stalls, fails, dies or raises ends the whole job within seconds, with a clear message.

"Within seconds" is measured from the moment every rank has started (scenarios.py marks it) to the job's end,
and bounded by LIMIT_S, ten times the stall shutdown time these jobs run with; how long the ranks take to start
on a busy machine does not count. A job still running after HANG_S is a hang."""

import os
import subprocess
import sys
import time

import pytest

from job_marks import since

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))


def mpirun():
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return local if os.path.exists(local) else "mpirun"


SHUTDOWN_S = 3
LIMIT_S = 10 * SHUTDOWN_S
HANG_S = 240


def run(mode, np_=2, env=None):
    """Run scenarios.py MODE on ``np_`` ranks: (exit status, output, seconds from every rank started to the end)."""
    cmd = [mpirun(), "--oversubscribe", "--bind-to", "none", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    full_env = dict(os.environ, PERSEUS_STALL_CHECK_TIME_SECONDS="1",
                    PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=str(SHUTDOWN_S), **(env or {}))
    proc = subprocess.run(cmd + [sys.executable, os.path.join(HERE, "scenarios.py"), mode], env=full_env,
                          capture_output=True, text=True, timeout=HANG_S)
    out = proc.stdout + proc.stderr
    return proc.returncode, out, since(out, "ready", time.time())


def test_clean_run_exits_zero():
    code, out, took = run("clean")
    assert code == 0, out
    assert "rank 0 done" in out and "rank 1 done" in out
    assert took < LIMIT_S


def test_ignored_horovod_settings_warn_and_run():
    # Autotune on in a job too short to tune: the tuner's thread must not keep the job from ending.
    code, out, took = run("clean", env={"HOROVOD_MPI_THREADS_DISABLE": "1", "HOROVOD_AUTOTUNE": "1"})
    assert code == 0, out
    assert "rank 0 done" in out and "rank 1 done" in out
    assert "HOROVOD_MPI_THREADS_DISABLE/PERSEUS_MPI_THREADS_DISABLE is ignored" in out, out
    assert "[perseus rank 1]" in out, out
    assert "autotune stopped" not in out, out
    assert took < LIMIT_S


def test_stall_names_tensor_and_missing_rank():
    code, out, took = run("stall")
    assert code != 0, out
    assert took < LIMIT_S, out
    assert "allreduce.lonely" in out and "missing on ranks [1]" in out, out
    assert "rank 1 is at" in out and "scenarios.py" in out, out
    assert "StallError" in out, out


def test_transport_error_on_one_rank_fails_every_rank():
    code, out, took = run("transport_error")
    assert code != 0 and took < LIMIT_S, out
    assert "rank 1 caught" in out and "simulated transport failure" in out, out
    assert "rank 0 caught: perseus: rank 1 failed and stopped the job" in out, out


def test_caught_failure_then_normal_exit_does_not_hang():
    code, out, took = run("transport_error_caught")
    assert took < LIMIT_S, out
    assert "rank 0 caught" in out and "rank 1 caught" in out, out


def test_dead_rank_ends_job():
    code, out, took = run("rank_dies")
    assert code != 0 and took < LIMIT_S, out


def test_uncaught_exception_aborts_job():
    code, out, took = run("uncaught")
    assert code != 0 and took < LIMIT_S, out
    assert "user code failed on rank 1" in out and "aborting the job" in out, out


def test_peer_shutdown_is_reported():
    code, out, took = run("early_shutdown")
    assert took < LIMIT_S, out
    assert "rank 0 caught" in out and "rank 1 shut down" in out, out


def test_three_ranks_stall():
    code, out, took = run("stall", np_=3)
    assert code != 0 and took < LIMIT_S, out
    assert "missing on ranks [1, 2]" in out, out
