"""Open MPI session directories left by killed mpirun processes: with pid reuse they make a later mpirun fail
at start-up (status 213, "The PMIx server's listener thread failed to start"). perseusrun removes them first.

Each test uses its own TMPDIR, so the leftovers it plants never reach another job on this machine."""

import os
import subprocess
import sys

import pytest

from perseus.runner import mpi_run
from perseus.runner.remote import job as remote_job
from perseus.runner.remote import service as service_module
from perseus.runner.remote.agent import write_job_file
from perseus.runner.remote.service import NodeService
from perseus.runner.session_dirs import remove_stale_session_dirs, stale_session_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)

pytestmark = pytest.mark.timeout(300)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _plant(base, pid: int, kind: str = "ompi") -> str:
    """A leftover as a killed mpirun (``ompi``) or MPI daemon (``prted``) leaves it: the directory and its PMIx
    rendezvous files."""
    path = os.path.join(base, f"{kind}.{pid}")
    os.makedirs(path, mode=0o700)
    for name in ("pmix.vm.tool", f"pmix.vm.tool.{pid}", f"pmix.vm.tool.prterun-vm-{pid}@0"):
        with open(os.path.join(path, name), "w") as f:
            f.write("pmix-tool-rendezvous\n")
    return path


def test_only_dead_mpiruns_directories_are_removed(tmp_path):
    dead = _plant(tmp_path, _dead_pid())
    dead_daemon = _plant(tmp_path, _dead_pid(), "prted")
    alive = _plant(tmp_path, os.getpid())
    alive_daemon = _plant(tmp_path, os.getpid(), "prted")
    other = tmp_path / "ompi.12x"
    other.mkdir()
    (tmp_path / "ompi.99999999").write_text("a file, not a session directory")
    assert stale_session_dirs(str(tmp_path)) == sorted([dead, dead_daemon])
    assert remove_stale_session_dirs(str(tmp_path)) == sorted([dead, dead_daemon])
    assert not os.path.exists(dead) and not os.path.exists(dead_daemon)
    assert os.path.isdir(alive) and os.path.isdir(alive_daemon) and other.is_dir()
    assert remove_stale_session_dirs(str(tmp_path / "missing")) == []


def _plant_window(base, size: int = 300, kind: str = "ompi") -> range:
    """Leftovers for ``size`` free process ids from a point well past the current one, and the kernel's
    next process id set just before them (``/proc/sys/kernel/ns_last_pid``, root only): the next processes
    started get ids inside the window."""
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    start = last + 1000 if last + 1000 + size < pid_max else 1000
    window = range(start, start + size)
    for pid in window:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if not os.path.exists(os.path.join(base, f"{kind}.{pid}")):
                _plant(base, pid, kind)
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(start - 1))
    return window


def test_perseusrun_starts_where_leftovers_break_plain_mpirun(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("choosing the next process id (/proc/sys/kernel/ns_last_pid) needs root")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": REPO, "PATH": BIN + ":" + os.environ["PATH"]}
    window = _plant_window(tmp_path)
    plain = subprocess.Popen([os.path.join(BIN, "mpirun"), "--allow-run-as-root", "-np", "1", "true"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = plain.communicate(timeout=60)
    assert plain.pid in window, f"mpirun got process id {plain.pid}, outside the planted {window}"
    assert plain.returncode != 0, f"plain mpirun started beside a leftover of its own id: the test proves nothing"
    _plant_window(tmp_path)
    done = subprocess.run([sys.executable, "-m", "perseus.runner.launch", "-np", "1", "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not mpi_run.is_open_mpi(), reason="needs Open MPI's mpirun (its remote-launch agent setting)")
def test_a_node_service_starts_its_daemon_where_leftovers_break_it(tmp_path, monkeypatch):
    """perseus.spark.run, the Ray executor and elastic Spark jobs start MPI's daemon through a node service; a
    daemon's leftover (``prted.<pid>``) breaks the next daemon of that id unless the service removes it first."""
    if os.geteuid() != 0:
        pytest.skip("choosing the next process id (/proc/sys/kernel/ns_last_pid) needs root")
    tmp = str(tmp_path)
    monkeypatch.setenv("TMPDIR", tmp)
    svc = NodeService("tok", "127.0.0.1", env={"TMPDIR": tmp, "PYTHONPATH": REPO})
    job_file = str(tmp_path / "job.json")
    write_job_file(job_file, "tok", {"perseus-node-0": f"127.0.0.1:{svc.port}"})
    # The rank lives half a second: a command that ends at once sometimes left mpirun and its daemon waiting on
    # each other when the daemon came through the agent (Open MPI 5.0.11, about 1 run in 5, with no leftovers
    # at all); perseus's ranks start a Python interpreter first, which takes longer.
    plan = remote_job.plan([remote_job.Node("perseus-node-0", f"127.0.0.1:{svc.port}", 1)], ["sleep", "0.5"],
                           job_file)
    try:
        monkeypatch.setattr(service_module, "remove_stale_session_dirs", lambda tmpdir=None: [])
        _plant_window(tmp, kind="prted")
        plain = subprocess.run(plan.argv, env={**os.environ, **plan.env}, capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0, "the daemon started beside a leftover of its own id: the test proves nothing"
        monkeypatch.undo()
        monkeypatch.setenv("TMPDIR", tmp)
        _plant_window(tmp, kind="prted")
        proc = remote_job.start(plan, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        svc.close()
