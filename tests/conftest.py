"""Shared pytest configuration.

- Every test has a timeout (pytest-timeout; the default is in pyproject.toml).
- Under ``CI=true`` a skip is a failure, unless its reason is structural: the test needs more (or fewer) ranks
  than this run has. A missing package, a machine that cannot host the emulated cluster, a missing compiler:
  each of those would let a claim of the docs go untested while the run still reads green, so CI fails
  instead and the reason is in the report. Outside CI such tests skip and say why (``-rs`` lists them).
- The emulated cluster that integration tests share (tests/integration/cluster_support.py) is taken down when
  the test run that built it ends: by pytest itself, or under pytest-xdist by its controller once every worker
  is done.
- Before each test, Open MPI session directories of killed mpirun processes are removed
  (perseus.runner.session_dirs): a test that starts mpirun directly would otherwise fail at random when its
  process id is one a killed mpirun had.
"""

import os
import re
import sys

import pytest

from perseus.runner.session_dirs import remove_stale_session_dirs

# Skip reasons that depend only on how many ranks the suite runs with (it runs at 2 and 3 ranks; some tests
# need exactly one of those, some need several).
STRUCTURAL_SKIP = re.compile(
    r"needs (\d\+? |several |exactly \d )?ranks?|needs \d\+? ranks|at one rank|^one rank:|fewer columns than ranks",
    re.IGNORECASE)


@pytest.fixture(autouse=True)
def _no_stale_mpi_session_dirs():
    remove_stale_session_dirs()
    yield


def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") or not os.path.exists("/run/perseus-cluster/pytest-owner"):
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration"))
    from cluster_support import take_down_if_ours

    take_down_if_ours()


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if STRUCTURAL_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true, which runs every test the docs rely on: {reason}\n"
                       "(fix the machine or the setup so that the test can run; outside CI it is a skip)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same rule for a whole module skipped while it is collected (``pytest.importorskip`` at its top)."""
    outcome = yield
    report = outcome.get_result()
    if report.outcome != "skipped" or not _in_ci():
        return
    reason = _skip_reason(report)
    if STRUCTURAL_SKIP.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"{collector.nodeid} skipped under CI=true, which runs every test the docs rely on: {reason}"
