"""The remote-launch agent and the node service (perseus.runner.remote) without Ray or Spark: what ssh's
stand-in must do for mpirun and the elastic driver, and an mpirun job whose daemon starts through it."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from perseus.runner import mpi_run
from perseus.runner.remote import job as remote_job
from perseus.runner.remote.agent import split_ssh_argv, write_job_file
from perseus.runner.remote.service import NodeService

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def service(tmp_path):
    svc = NodeService("secret-token", "127.0.0.1", env={"FROM_SERVICE": "yes"})
    path = str(tmp_path / "job.json")
    write_job_file(path, "secret-token", {"perseus-node-0": f"127.0.0.1:{svc.port}"})
    yield svc, path
    svc.close()


def agent(path, *words, stdin=None, timeout=30):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "perseus.runner.remote.agent", "--job", path, *words], input=stdin,
                          capture_output=True, timeout=timeout, env=env)


def test_ssh_options_before_the_node_are_skipped():
    assert split_ssh_argv(["-o", "BatchMode=yes", "-x", "-p", "22", "node", "echo", "hi"]) == ("node", ["echo", "hi"])
    assert split_ssh_argv(["-T", "node"]) == ("node", [])
    assert split_ssh_argv(["-o", "X"]) == (None, [])


def test_the_agent_relays_output_input_status_and_environment(service):
    _, path = service
    done = agent(path, "-o", "BatchMode=yes", "perseus-node-0", "cat; echo out $FROM_SERVICE; echo err >&2; exit 7",
                 stdin=b"piped\n")
    assert done.returncode == 7
    assert done.stdout == b"piped\nout yes\n"
    assert done.stderr == b"err\n"


def test_the_job_file_is_private(service):
    _, path = service
    assert os.stat(path).st_mode & 0o077 == 0
    assert json.load(open(path))["nodes"]["perseus-node-0"].startswith("127.0.0.1:")


def test_a_wrong_token_or_unknown_node_fails_with_255_and_a_reason(service, tmp_path):
    svc, path = service
    done = agent(path, "perseus-node-9", "true")
    assert done.returncode == 255 and b"no worker of this job runs there" in done.stderr
    bad = str(tmp_path / "bad.json")
    write_job_file(bad, "wrong-token", {"perseus-node-0": f"127.0.0.1:{svc.port}"})
    done = agent(bad, "perseus-node-0", "true")
    assert done.returncode == 255 and b"lost the connection" in done.stderr
    assert svc.started == []
    done = agent(str(tmp_path / "missing.json"), "perseus-node-0", "true")
    assert done.returncode == 255 and b"cannot read the job file" in done.stderr


def test_the_command_ends_when_the_agent_is_killed(service, tmp_path):
    _, path = service
    marker = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "perseus.runner.remote.agent", "--job", path, "perseus-node-0",
                             f"echo $$ > {marker}; exec sleep 60"], env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(marker.read_text())
    proc.kill()
    proc.wait()
    assert _ends(pid), "the command outlived its agent"


def _ends(pid, within=10.0):
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_the_command_and_its_children_end_when_the_worker_is_killed(tmp_path):
    """A worker killed with SIGKILL (a Ray actor killed, a Spark task's executor lost): the guard ends the
    command's session, children included, and the agent ends with status 0 (the command ran)."""
    ready = tmp_path / "service.json"
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, time
        from perseus.runner.remote.service import NodeService
        from perseus.runner.remote.agent import write_job_file
        svc = NodeService("tok", "127.0.0.1")
        write_job_file({str(ready)!r}, "tok", {{"n": "127.0.0.1:%d" % svc.port}})
        time.sleep(120)
    """)], env={**os.environ, "PYTHONPATH": REPO})
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        marker = tmp_path / "pids"
        agent_proc = subprocess.Popen([sys.executable, "-m", "perseus.runner.remote.agent", "--job", str(ready), "n",
                                       f"sleep 60 & echo $! > {marker}; wait"], env={**os.environ, "PYTHONPATH": REPO},
                                      stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(marker.read_text())
        worker.kill()
        assert _ends(child), "a child of the command outlived its worker"
        assert agent_proc.wait(timeout=15) == 0
        assert b"lost the connection to its worker" in agent_proc.stderr.read()
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_that_is_its_containers_first_process_runs_commands(tmp_path):
    """A worker that is process 1 of its process-id namespace (a container's first process): its commands run,
    although their guard's parent has the id an orphan's parent has."""
    if os.geteuid() != 0:
        pytest.skip("a process-id namespace of its own (unshare --pid) needs root")
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from perseus.runner.remote.service import NodeService
        from perseus.runner.remote.agent import write_job_file
        assert os.getpid() == 1
        svc = NodeService("tok", "127.0.0.1")
        write_job_file({str(tmp_path / "job.json")!r}, "tok", {{"n": "127.0.0.1:%d" % svc.port}})
        done = subprocess.run([sys.executable, "-m", "perseus.runner.remote.agent", "--job",
                               {str(tmp_path / "job.json")!r}, "n", "echo ran; exit 3"], capture_output=True)
        svc.close()
        print(done.returncode, done.stdout.decode().strip(), done.stderr.decode().strip())
    """)
    # Its own TMPDIR: the session directories it sees are its own (none), never those of jobs running beside it.
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "ran"], done.stdout


def test_closing_the_service_ends_its_commands_and_tells_the_agent(service):
    svc, path = service
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "perseus.runner.remote.agent", "--job", path, "perseus-node-0",
                             "exec sleep 60"], env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not svc.started and time.monotonic() < deadline:
        time.sleep(0.05)
    svc.close()
    assert proc.wait(timeout=15) == 128 + 15  # SIGTERM's status, as the remote shell reports it


@pytest.mark.skipif(not mpi_run.is_open_mpi(), reason="needs Open MPI's mpirun (its remote-launch agent setting)")
def test_mpirun_starts_its_daemon_through_the_agent(service, tmp_path):
    svc, path = service
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        print("rank", c.rank, "of", c.size, "sum", c.allreduce(c.rank + 1), flush=True)
    """))
    plan = remote_job.plan([remote_job.Node("perseus-node-0", f"127.0.0.1:{svc.port}", 2)],
                           [sys.executable, str(script)], path, env={"PYTHONPATH": REPO})
    assert "perseus-node-0:2" in plan.argv and "--leave-session-attached" in plan.argv
    done = subprocess.run(plan.argv, env={**os.environ, **plan.env}, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 of 2 sum 3", "rank 1 of 2 sum 3"]
    assert any("prted" in c for c in svc.started), svc.started  # the daemon came through the service
