"""TensorFlow and Keras training under the elastic launcher on the emulated cluster (3 hosts, real ssh
launches): a rank killed with SIGKILL, a host removed, a host added. elastic_job_tf.py trains with
perseus.tensorflow.elastic (JOB_MODE=tf: a custom loop, TensorFlowState) or the Keras elastic path
(JOB_MODE=keras: model.fit, TensorFlowKerasState and the elastic callbacks), committing after every step.

A job that recovers must finish every step with the parameters of a single process that ran the same steps,
and every phase of it must start from the last commit, not from scratch (elastic_cluster.check_recovered).
Every case is bounded in time; a launcher still running at its deadline is a hang and fails the case.
The quick test run kills a rank of each kind of job (custom loop in process, model.fit relaunched); the cases
marked "full" run in the full test run, as CI does.
"""

import os
import time

import numpy as np
import pytest

from elastic_cluster import (HERE, check_recovered, discovery_fixture, events, finish, phases,
                             start, wait_for)

# For hangs: a job that starts, fails, re-forms and finishes, on a busy machine (the launcher's own deadline
# is elastic_cluster.finish's 400 s).
pytestmark = pytest.mark.timeout(900)

JOB = os.path.join(HERE, "elastic_job_tf.py")
STEPS = 24


@pytest.fixture
def disc(tmp_path):
    """3 hosts of the emulated cluster for this test alone, and a discovery script reporting the first two."""
    yield from discovery_fixture(tmp_path)


def _started(out, step=3, timeout=240):
    wait_for(lambda: any(e["kind"] == "step" and e["step"] >= step for e in events(out)), timeout, f"step {step}")


def _finished(proc, out, steps, tmp_path, timeout=400):
    code, log = finish(proc, out, timeout)
    assert code != "HANG", f"the launcher hung:\n{log[-4000:]}"
    assert code == 0, log[-4000:]
    ev = check_recovered(out, steps, tmp_path, JOB)
    gens = phases(ev)
    resets = [e for e in ev if e["kind"] == "reset"]  # the reset callbacks ran in every phase after the first
    assert sorted({(e["size"], e["host"]) for e in resets}) == sorted((s, h) for s, hosts in gens[1:] for h in hosts)
    final = np.load(os.path.join(out, "final.npy"))
    for rank in range(gens[-1][0]):  # the ranks of the last phase end with rank 0's parameters, bit for bit
        np.testing.assert_array_equal(np.load(os.path.join(out, f"final-rank{rank}.npy")), final)
    return log, gens


@pytest.mark.parametrize("mode,at,in_process", [("tf", "step", "1"),
                                                pytest.param("keras", "random", "1", marks=pytest.mark.full),
                                                ("keras", "step", "0")],
                         ids=["tf-custom-loop-kill-between-steps", "keras-fit-kill-at-a-random-moment",
                              "keras-fit-kill-then-relaunch"])
def test_rank_killed_at_3_hosts_recovers_on_the_survivors(disc, tmp_path, mode, at, in_process):
    """In process (the survivors re-form the job among themselves) or, with PERSEUS_ELASTIC_IN_PROCESS=0, by
    a new generation on the two hosts left, which restores the last commit from the keepers."""
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    out = str(tmp_path / "out")
    env = dict(JOB_MODE=mode, FAULT_KIND="kill", FAULT_AT=at, FAULT_RANK="1", FAULT_STEP="5",
               PERSEUS_ELASTIC_IN_PROCESS=in_process)
    log, gens = _finished(start(disc, out, np_=3, env=env, job=JOB), out, STEPS, tmp_path)
    assert gens[0] == (3, [H0, H1, H2]) and gens[-1] == (2, [H0, H2]), gens
    assert "blacklist" in log, log[-3000:]
    assert ("re-formed in process" in log) == (in_process == "1"), log[-3000:]


@pytest.mark.full
def test_keras_rank_killed_before_the_first_commit_starts_over(disc, tmp_path):
    """The optimizer has made no slots when the state is made; a rank dies in the first step: the survivors go
    back to the initial state, slots included, and train every step."""
    H0, H1, H2 = disc.hosts
    env = dict(JOB_MODE="keras", FAULT_KIND="kill", FAULT_AT="step", FAULT_RANK="1", FAULT_STEP="0")
    out = str(tmp_path / "out")
    log, gens = _finished(start(disc, out, env=env, job=JOB), out, STEPS, tmp_path)
    assert gens == [(2, [H0, H1]), (1, [H0])], gens


@pytest.mark.full
@pytest.mark.parametrize("mode", ["tf", "keras"])
def test_host_removed_shrinks_the_job(disc, tmp_path, mode):
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    out = str(tmp_path / "out")
    proc = start(disc, out, np_=3, env=dict(JOB_MODE=mode, STEPS="30", STEP_SLEEP="0.1"), job=JOB)
    _started(out)
    disc.set(H0, H1)
    log, gens = _finished(proc, out, 30, tmp_path)
    assert gens[0] == (3, [H0, H1, H2]) and gens[-1] == (2, [H0, H1]), gens


@pytest.mark.full
def test_host_added_grows_the_job(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(JOB_MODE="tf", STEPS="30", STEP_SLEEP="0.1", FAULT_STEP="5",
                                     WAIT_FILE=str(tmp_path / "go")), job=JOB)
    _started(out, 5)
    disc.set(H0, H1, H2)
    time.sleep(2.5)  # the driver sees the new host; rank 0 is held at step 5 meanwhile
    (tmp_path / "go").touch()
    log, gens = _finished(proc, out, 30, tmp_path)
    assert gens[0] == (2, [H0, H1]) and gens[-1] == (3, [H0, H1, H2]), gens
