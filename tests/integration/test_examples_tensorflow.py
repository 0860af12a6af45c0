"""examples/tensorflow2_digits.py runs on 2 ranks under mpirun, learns, and leaves identical weights."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.timeout(900)  # for hangs: a training job, on a busy machine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mpirun_cmd(np_):
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [local if os.path.exists(local) else "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def test_tensorflow2_digits_converges_and_ranks_agree():
    epochs = 5
    cmd = mpirun_cmd(2) + [sys.executable, "examples/tensorflow2_digits.py", "--epochs", str(epochs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    losses = [float(x) for x in re.findall(r"train loss ([0-9.]+)", out)]
    accuracy = [float(x) for x in re.findall(r"test accuracy ([0-9.]+)", out)]
    assert len(losses) == epochs and len(accuracy) == epochs, out
    assert losses[-1] < losses[0] * 0.5, out
    assert accuracy[-1] > 0.85, out
    assert re.search(r"throughput [0-9]+ samples/s on 2 ranks", out), out
    assert "weights identical on all 2 ranks: True" in out, out
