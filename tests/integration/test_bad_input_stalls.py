"""Bad input that no rank can detect alone and that ends in a stall (a name or a group that differs between
ranks): every rank fails within seconds of the stall shutdown time with a message naming the tensors and
the ranks that did not submit them, and the job exits non-zero. The seconds are counted from the moment every
rank has started (bad_input_job.py marks it), so that a busy machine's slow start does not count; a job still
running after HANG_S is a hang. The cases the ranks can detect as a
disagreement, and those caught before anything is sent, are in tests/mpi/test_bad_input.py."""

import os
import subprocess
import sys
import time

import pytest

from job_marks import since

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
SHUTDOWN_S = 3
LIMIT_S = 10 * SHUTDOWN_S
HANG_S = 240


def run(case, np_=2):
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [local if os.path.exists(local) else "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = dict(os.environ, PERSEUS_STALL_CHECK_TIME_SECONDS="1",
               PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=str(SHUTDOWN_S))
    proc = subprocess.run(cmd + [sys.executable, os.path.join(HERE, "bad_input_job.py"), case], env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    out = proc.stdout + proc.stderr
    took = since(out, "ready", time.time())
    print(f"{case} at {np_} ranks: exit {proc.returncode} {took:.1f} s after every rank started")
    return proc.returncode, out, took


@pytest.mark.parametrize("np_", [2, pytest.param(3, marks=pytest.mark.full)])
def test_name_differs_between_ranks(np_):
    code, out, took = run("name_differs", np_)
    assert code != 0 and took < LIMIT_S, out
    for r in range(np_):
        assert f"rank {r} caught" in out, out
        others = [o for o in range(np_) if o != r]
        assert f"allreduce.grad_of_rank{r}" in out and f"missing on ranks {others}" in out, out
    assert "a tensor name that differs between ranks" in out, out


def test_group_size_differs_between_ranks():
    # Not a disagreement the negotiation sees: group.0 matches, and rank 1 (one tensor) gets its result; the
    # stall comes at the next collective, rank 0 still waiting for group.1.
    code, out, took = run("group_size_differs")
    assert code != 0 and took < LIMIT_S, out
    assert "rank 0 caught" in out and "rank 1 caught" in out, out
    assert "allreduce.group.1" in out and "missing on ranks [1]" in out, out
    assert "allreduce.next_step" in out and "missing on ranks [0]" in out, out


def test_collective_differs_between_ranks():
    # The same name from two collectives: the names differ by their prefix (allreduce.w, broadcast.w).
    code, out, took = run("collective_differs")
    assert code != 0 and took < LIMIT_S, out
    assert "rank 0 caught" in out and "rank 1 caught" in out, out
    assert "allreduce.w" in out and "broadcast.w" in out, out
