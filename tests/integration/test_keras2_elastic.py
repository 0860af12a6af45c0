"""The Keras elastic path with tf-keras 2 (TF_USE_LEGACY_KERAS=1) on 2 ranks, in its own MPI job
(keras2_elastic.py): the Keras generation is fixed when TensorFlow is first imported, so it cannot share a
process with Keras 3 tests."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)
HERE = os.path.dirname(os.path.abspath(__file__))


def test_tf_keras2_state_recovers_before_the_first_commit():
    pytest.importorskip("tf_keras", reason="tf-keras is not installed (tools/run_tests.sh installs it)")
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [local if os.path.exists(local) else "mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    proc = subprocess.run(cmd + [sys.executable, os.path.join(HERE, "keras2_elastic.py")], env=env,
                          capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "adam OK" in out and "legacy_sgd_momentum OK" in out, out[-6000:]
