"""Each TensorFlow/Keras module of perseus imports on its own, first, in a fresh interpreter (perseus.tensorflow._keras
sits above perseus.tensorflow's modules, so the import order must not matter), and importing
perseus.tensorflow does not import the Keras front ends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.timeout(240)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=200,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# (each a fresh interpreter importing TensorFlow, ~9 s of CPU: the quick test run tries the two front ends)
@pytest.mark.parametrize("module", ["perseus.keras", "perseus.tensorflow.keras.elastic"] + [
    pytest.param(m, marks=pytest.mark.full) for m in ("perseus.tensorflow._keras.elastic", "perseus.tensorflow._keras.frontend",
                                                      "perseus.tensorflow._keras.callbacks", "perseus.tensorflow.keras_optimizer")])
def test_module_imports_first(module):
    _run(f"import {module}")


def test_perseus_tensorflow_leaves_the_keras_front_ends_alone():
    front_ends = ("perseus.keras", "perseus.tensorflow.keras", "perseus.tensorflow._keras.frontend", "perseus.tensorflow._keras.callbacks",
                  "perseus.tensorflow._keras.embedding")
    out = _run("import sys, perseus.tensorflow as hvd\n"
               f"print(sorted(m for m in sys.modules if m in {front_ends!r}"
               " or m.startswith(('perseus.keras.', 'perseus.tensorflow.keras.'))))")
    assert out.strip() == "[]"
