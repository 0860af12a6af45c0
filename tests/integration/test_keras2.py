"""perseus.tensorflow.keras with tf-keras 2 (TF_USE_LEGACY_KERAS=1) on 2 ranks, each script in its own MPI
job: the Keras generation is fixed when TensorFlow is first imported, so it cannot share a process with Keras 3
tests."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(900)  # for hangs: a training job, on a busy machine
HERE = os.path.dirname(os.path.abspath(__file__))


def _run_on_two_ranks(script: str) -> str:
    """Run ``script`` (next to this file) under mpirun on 2 ranks with tf-keras 2; its output. Fails the test
    when the job fails."""
    pytest.importorskip("tf_keras", reason="tf-keras is not installed (tools/run_tests.sh installs it)")
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [local if os.path.exists(local) else "mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    proc = subprocess.run(cmd + [sys.executable, os.path.join(HERE, script)], env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def test_tf_keras2_fit_matches_global_batch_and_aggregates():
    out = _run_on_two_ranks("keras2_training.py")
    assert out.count(" OK") == 18, out


@pytest.mark.full
def test_tf_keras2_elastic_state_recovers_before_the_first_commit():
    # (keras2_elastic.py: a new-style Adam and a legacy SGD with momentum, both made unbuilt, recover from a
    # failure in the first batches to their initial state)
    out = _run_on_two_ranks("keras2_elastic.py")
    assert "adam OK" in out and "legacy_sgd_momentum OK" in out, out[-6000:]
