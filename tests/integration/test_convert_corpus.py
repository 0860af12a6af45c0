"""perseus-convert on the corpus in tests/convert_corpus: every script is converted, run on 2 ranks and
checked: the run succeeds, every rank ends with the same parameters, and (where the script reads its data in
a fixed order) 2 ranks with batch B reach the parameters of the unconverted script run alone with batch 2B."""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("libcst")

from perseus.convert import convert_source  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # for hangs: two training jobs, on a busy machine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "convert_corpus")

# script -> (how the per-process batch size is passed, per-rank batch or None (fixed in the script),
#            compare with the unconverted script on the global batch?, needs TensorFlow?)
CASES = {
    "torch_argparse_functions.py": ("flag", 16, True, False),
    "torch_toplevel_adam.py": ("env", 16, True, False),
    "torch_helper_scheduler.py": ("env", 16, True, False),
    "torch_two_optimizers.py": ("env", 16, True, False),
    "torch_resume_onecycle.py": ("flag", 16, True, False),
    "torch_trainer_class.py": ("env", 8, False, False),   # shuffled: only the ranks' agreement is checked
    "horovod_torch.py": ("env", None, False, False),      # already distributed: renamed imports only
    "keras_fit_arrays.py": ("env", 16, True, True),
    "keras_fit_checkpoint.py": ("env", 16, True, True),
    "tf_custom_loop.py": ("env", 16, True, True),
    "mxnet_gluon.py": ("env", 16, True, False),
    # files written on rank 0 only and read back on every rank (root_file / root_call)
    "torch_best_model_reload.py": ("env", 16, True, False),
    "torch_resume_phases.py": ("env", 16, True, False),
    "keras_best_checkpoint.py": ("env", 16, True, True),
    "mxnet_gluon_best.py": ("env", 16, True, False),
    "torch_lbfgs_closure.py": ("env", 128, True, False),  # optimizer.step(closure), several evaluations
}
# MXNet 1.9.1 lives in its own environment (tools/setup_mxnet_env.sh): its scripts run with that Python;
# the conversion itself runs wherever this test runs (tools/run_mxnet_tests.sh runs it from .venv-mxnet).
MXNET = {"mxnet_gluon.py", "mxnet_gluon_best.py"}
# The quick test run converts and trains these (one of each kind: a plain torch script, a class-based trainer, a
# Horovod script, a rank-0 file read back, Keras fit); the full run, all of them.
QUICK = {"torch_toplevel_adam.py", "torch_trainer_class.py", "horovod_torch.py", "torch_best_model_reload.py",
         "keras_fit_arrays.py", "mxnet_gluon.py"}
MXNET_PYTHON = os.path.join(ROOT, ".venv-mxnet", "bin", "python")


def test_corpus_is_complete():
    assert sorted(CASES) == sorted(f for f in os.listdir(CORPUS) if f.endswith(".py"))


def _run(cmd, env, cwd, timeout=600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _env(tmp_path, out, style, batch):
    env = dict(os.environ, CORPUS_PARAMS_OUT=str(tmp_path / out), TF_CPP_MIN_LOG_LEVEL="2",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMPI_COMM_WORLD_RANK", None)
    if style == "env" and batch is not None:
        env["BATCH_SIZE"] = str(batch)
    return env


def _args(style, batch):
    return ["--batch-size", str(batch)] if style == "flag" and batch is not None else []


def _load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.full) for n in sorted(CASES)])
def test_converted_script_trains_on_two_ranks(name, tmp_path):
    style, batch, reference, needs_tf = CASES[name]
    if needs_tf:
        pytest.importorskip("tensorflow")
    python = sys.executable
    if name in MXNET:
        if not os.access(MXNET_PYTHON, os.X_OK):
            pytest.skip("no MXNet environment (.venv-mxnet; create it with tools/setup_mxnet_env.sh)")
        python = MXNET_PYTHON
    with open(os.path.join(CORPUS, name)) as f:
        source = f.read()
    result = convert_source(source, name)
    assert result.error is None and result.changed, result.lines()
    assert convert_source(result.converted, name).converted == result.converted, "not idempotent"
    script = tmp_path / name
    script.write_text(result.converted)

    cmd = [python, "-m", "perseus.runner.launch", "-np", "2", python, str(script),
           *_args(style, batch)]
    _run(cmd, _env(tmp_path, "dist_{rank}.npz", style, batch), str(tmp_path))
    rank0, rank1 = _load(tmp_path / "dist_0.npz"), _load(tmp_path / "dist_1.npz")
    assert len(rank0) == len(rank1) > 0
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b, err_msg="the ranks' parameters differ")

    if reference:  # the unconverted script, one process, the global batch of 2B
        original = tmp_path / ("orig_" + name)
        original.write_text(source)
        _run([python, str(original), *_args(style, 2 * batch)],
             _env(tmp_path, "single_{rank}.npz", style, 2 * batch), str(tmp_path))
        single = _load(tmp_path / "single_0.npz")
        assert len(single) == len(rank0)
        for a, b in zip(rank0, single):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5,
                                       err_msg="2 ranks differ from one process on the global batch")
