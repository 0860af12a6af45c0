"""Under CI=true a skip fails the run unless it depends only on the number of ranks (tests/conftest.py): a
machine that cannot host the emulated cluster, a missing package or compiler must not read as green."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

PLANTED = '''
import pytest

def test_structural():
    pytest.skip("needs 3+ ranks (a set of 2 that is not the global set)")

def test_cluster():
    pytest.skip("the emulated cluster cannot be built here: needs root")

@pytest.mark.skipif(True, reason="no C++ compiler")
def test_marked():
    pass

def test_runs():
    pass
'''


def _run(tmp_path, ci: bool):
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_planted.py").write_text(PLANTED)
    (tmp_path / "test_module.py").write_text("import pytest\npytest.importorskip('no_such_module_here')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = REPO
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
                           "--continue-on-collection-errors", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_outside_ci_they_skip_with_reasons(tmp_path):
    done = _run(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 4 skipped" in done.stdout, done.stdout


def test_under_ci_only_rank_count_skips_stay_skips(tmp_path):
    done = _run(tmp_path, ci=True)
    assert done.returncode == 1, done.stdout
    assert "FAILED test_planted.py::test_cluster" in done.stdout, done.stdout
    assert "emulated cluster cannot be built here" in done.stdout
    assert "test_planted.py::test_marked" in done.stdout and "no C++ compiler" in done.stdout
    assert "ERROR test_module.py" in done.stdout
    assert "SKIPPED [1] test_planted.py:5: needs 3+ ranks" in done.stdout, done.stdout
    assert "1 passed" in done.stdout
