"""Open MPI session directories left by killed mpirun processes: with pid reuse they make a later mpirun fail
at start-up (status 213, "The PMIx server's listener thread failed to start"). perseusrun removes them first.

Each test uses its own TMPDIR, so the leftovers it plants never reach another job on this machine, and the
scenarios that plant leftovers for the next process ids run in a process-id namespace of their own."""

import os
import socket
import subprocess
import sys
import time

import pytest

from perseus.runner import mpi_run
from perseus.runner.session_dirs import remove_stale_session_dirs, stale_session_dirs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from session_dirs_job import plant  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_dead_mpiruns_directories_are_removed(tmp_path):
    dead = plant(tmp_path, _dead_pid(), "ompi")
    dead_daemon = plant(tmp_path, _dead_pid(), "prted")
    alive = plant(tmp_path, os.getpid(), "ompi")
    alive_daemon = plant(tmp_path, os.getpid(), "prted")
    other = tmp_path / "ompi.12x"
    other.mkdir()
    (tmp_path / "ompi.99999999").write_text("a file, not a session directory")
    assert stale_session_dirs(str(tmp_path)) == sorted([dead, dead_daemon])
    assert remove_stale_session_dirs(str(tmp_path)) == sorted([dead, dead_daemon])
    assert not os.path.exists(dead) and not os.path.exists(dead_daemon)
    assert os.path.isdir(alive) and os.path.isdir(alive_daemon) and other.is_dir()
    assert remove_stale_session_dirs(str(tmp_path / "missing")) == []


def test_a_directory_whose_pmix_server_still_listens_is_kept(tmp_path):
    """A job in another process-id namespace sharing TMPDIR: its id looks dead here, its server's port does not."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        path = plant(tmp_path, _dead_pid(), "ompi")
        with open(os.path.join(path, "pmix.vm.tool"), "w") as f:
            f.write(f"prterun-vm-1@0.0;tcp4://127.0.0.1:{server.getsockname()[1]}\n5.0.11\n")
        assert stale_session_dirs(str(tmp_path)) == []
    assert stale_session_dirs(str(tmp_path)) == [path]


@pytest.mark.skipif(not mpi_run.is_open_mpi(), reason="Open MPI's session directories (MPICH keeps none)")
def test_a_sandbox_with_its_own_process_ids_keeps_a_running_mpiruns_directory(tmp_path):
    """Cleaning up from a process-id namespace of its own (a container sharing /tmp) never removes the directory
    of an mpirun that runs outside it."""
    if os.geteuid() != 0:
        pytest.skip("a process-id namespace of its own (unshare --pid) needs root")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "mpirun"), "--allow-run-as-root",
                             "-np", "1", "sleep", "30"], env=env, stdout=subprocess.DEVNULL)
    try:
        live = tmp_path / f"ompi.{proc.pid}"
        deadline = time.monotonic() + 30
        while not (live / "pmix.vm.tool").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (live / "pmix.vm.tool").exists(), "mpirun wrote no rendezvous file"
        script = ("import sys; from perseus.runner.session_dirs import remove_stale_session_dirs as r; "
                  "print(r(sys.argv[1]))")
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script,
                               str(tmp_path)], capture_output=True, text=True, timeout=60,
                              env={**env, "PYTHONPATH": REPO})
        assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
        assert live.is_dir()
    finally:
        proc.kill()
        proc.wait()


def _scenario(name: str, tmp_path) -> None:
    """Run a scenario of session_dirs_job.py as the first process of a process-id namespace of its own: other
    processes on the machine (parallel test workers) cannot take the process ids it plants leftovers for."""
    if os.geteuid() != 0:
        pytest.skip("choosing the next process id (/proc/sys/kernel/ns_last_pid) in a new namespace needs root")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                           os.path.join(HERE, "session_dirs_job.py"), name, str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_perseusrun_starts_where_leftovers_break_plain_mpirun(tmp_path):
    _scenario("mpirun", tmp_path)


@pytest.mark.skipif(not mpi_run.is_open_mpi(), reason="needs Open MPI's mpirun (its remote-launch agent setting)")
def test_a_node_service_starts_its_daemon_where_leftovers_break_it(tmp_path):
    """perseus.spark.run, the Ray executor and elastic Spark jobs start MPI's daemon through a node service; a
    daemon's leftover (``prted.<pid>``) breaks the next daemon of that id unless the service removes it first."""
    _scenario("daemon", tmp_path)
