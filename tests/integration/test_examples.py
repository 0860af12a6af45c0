"""The examples run on 2 ranks through perseusrun and train."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(900)  # for hangs: a training job, on a busy machine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def perseusrun(*args):
    cmd = [sys.executable, "-m", "perseus.runner.launch", "-np", "2", sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_digits_training_converges_and_ranks_agree():
    proc = perseusrun("examples/pytorch_digits.py", "--epochs", "6")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    losses = [float(x) for x in re.findall(r"train loss ([0-9.]+)", out)]
    accuracy = [float(x) for x in re.findall(r"test accuracy ([0-9.]+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0] * 0.5, out
    assert accuracy[-1] > 0.8, out
    assert "throughput" in out and "parameters identical on all 2 ranks: True" in out, out


def test_synthetic_benchmark_reports_throughput():
    proc = perseusrun("examples/pytorch_synthetic_benchmark.py", "--num-iters", "2", "--num-batches-per-iter",
                      "2", "--num-warmup-batches", "1", "--batch-size", "4", "--image-size", "64",
                      "--fp16-allreduce")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"Total img/sec on 2 rank\(s\): [0-9.]+", out), out


def test_keras_fit_example_with_callbacks():
    proc = perseusrun("examples/keras_digits.py", "--epochs", "6")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracy = [float(x) for x in re.findall(r"test accuracy ([0-9.]+)", out)]
    assert len(accuracy) == 6 and accuracy[-1] > 0.85, out
    assert "best model saved: True" in out and "weights identical on all 2 ranks: True" in out, out
