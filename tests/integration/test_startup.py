"""Start-up is all or nothing: a failure on one rank at any step of init() ends every rank within seconds,
with the same clear message where the ranks can still be told, or an MPI abort where they cannot. A
timeline set through the environment at init() records a valid trace. Every case is a real MPI job.

The seconds are counted from the moment every rank is about to call init() (startup_job.py marks it, its
imports done), so that a busy machine's slow start does not count; a job still running after HANG_S is a hang."""

import json
import os
import subprocess
import sys
import time

import pytest

from job_marks import since

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "startup_job.py")
LIMIT_S = 30  # the acceptance bound for a failed start-up
HANG_S = 240


def mpirun(np_: int, args: list, env=None):
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [local if os.path.exists(local) else "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    try:
        proc = subprocess.run(cmd + [sys.executable] + args, env=dict(os.environ, **(env or {})),
                              capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job hung (killed after {HANG_S} s): {exc.stdout}{exc.stderr}")
    out = proc.stdout + proc.stderr
    return proc.returncode, out, since(out, "init", time.time())


# Steps before any collective call: every rank catches the same error, naming the failing rank.
VOTED = {
    "settings": "ValueError: injected: bad setting",
    "core": "ImportError: injected: the native core could not be loaded",
    "process_set_ranks": "must be a non-empty subset",
    "tuner": "RuntimeError: injected start-up failure",
}


@pytest.mark.parametrize("np_,failing", [(2, 1), pytest.param(3, 2, marks=pytest.mark.full)])
@pytest.mark.parametrize("stage", sorted(VOTED))
def test_failure_before_collectives_raises_on_every_rank(stage, np_, failing):
    env = {"HOROVOD_AUTOTUNE": "1"} if stage == "tuner" else {}
    code, out, took = mpirun(np_, [JOB, stage, str(failing)], env)
    assert code != 0, out
    assert took < LIMIT_S, out
    for rank in range(np_):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"rank {rank} caught ")), None)
        assert line is not None, f"rank {rank} did not report the failure:\n{out}"
        assert f"failed on rank {failing} of {np_}" in line and VOTED[stage] in line, line


def test_missing_optuna_with_autotune_fails_every_rank():
    code, out, took = mpirun(2, [JOB, "optuna", "1"], {"HOROVOD_AUTOTUNE": "1"})
    assert code != 0 and took < LIMIT_S, out
    assert out.count("caught ImportError: perseus.init() failed on rank 1 of 2") == 2, out


def test_unwritable_timeline_on_rank_0_fails_every_rank(tmp_path):
    path = str(tmp_path / "no" / "such" / "dir" / "timeline.json")
    code, out, took = mpirun(2, [JOB, "none", "-1"], {"HOROVOD_TIMELINE": path})
    assert code != 0 and took < LIMIT_S, out
    assert out.count("perseus.init() failed on rank 0 of 2") == 2, out


def test_ranks_passing_different_process_sets_fail_together():
    code, out, took = mpirun(2, [JOB, "process_sets_differ", "1"])
    assert code != 0 and took < LIMIT_S, out
    for rank in range(2):
        assert f"rank {rank} caught ValueError: perseus.init(process_sets=...): the ranks passed different " \
               "process sets (rank 0: [[0]]; rank 1: [[1]])" in out, out


def test_every_rank_can_start_again_after_a_failed_start():
    code, out, took = mpirun(3, [JOB, "settings", "1", "retry"])
    assert code == 0, out
    assert all(f"rank {r} retried ok" in out for r in range(3)), out


# Steps inside collective calls: the failing rank names itself and the step, and aborts the job.
ABORTED = {
    "topology": "exchanging the topology",
    "channels": "creating the global process set's channels",
    "engine_start": "starting the engine",
    "process_sets": "creating the process sets",
}


@pytest.mark.parametrize("stage", sorted(ABORTED))
def test_failure_inside_collectives_aborts_the_job(stage):
    code, out, took = mpirun(2, [JOB, stage, "1"])
    assert code != 0, out
    assert took < LIMIT_S, out
    assert f"perseus: init() failed on rank 1 while {ABORTED[stage]}: RuntimeError: injected" in out, out
    assert "aborting the MPI job" in out, out
    assert "started, sum" not in out, out


def test_rank_failing_before_init_ends_the_job():
    # The failed rank waits in MPI_Finalize at exit, the others in init(): init()'s wait for every rank ends it.
    code, out, took = mpirun(2, [JOB, "before_init", "1"], {"PERSEUS_INIT_TIMEOUT_SECONDS": "3"})
    assert code != 0 and took < LIMIT_S, out
    assert "injected: this rank failed before calling init()" in out, out
    assert "waited 3 s in init() for the other ranks" in out, out


@pytest.mark.parametrize("np_", [2, pytest.param(3, marks=pytest.mark.full)])
def test_timeline_from_the_environment(tmp_path, np_):
    path = tmp_path / "timeline.json"
    code, out, took = mpirun(np_, [JOB, "none", "-1"],
                             {"HOROVOD_TIMELINE": str(path), "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert code == 0, out
    assert all(f"rank {r} started, sum [{float(np_)}, {float(np_)}]" in out for r in range(np_)), out
    events = json.loads(path.read_text())  # a complete JSON trace
    names = {e.get("name") for e in events}
    assert "CYCLE_START" in names, names
    assert any("started" in str(e.get("args", {}).get("name", "")) for e in events), events[:5]
    assert {"ALLREDUCE", "NEGOTIATE_ALLREDUCE"} <= names, names
