"""Leftover session directories against plain Open MPI and against perseus, run by test_session_dirs.py.

``unshare --pid --fork --mount-proc python session_dirs_job.py SCENARIO TMPDIR``: the job runs as the first
process of a process-id namespace of its own, so no other process on the machine takes the ids it plants
leftovers for. SCENARIO ``mpirun`` plants ``ompi.<pid>`` leftovers, shows that a plain ``mpirun`` fails beside
them, then that ``perseusrun`` starts; ``daemon`` plants ``prted.<pid>`` leftovers, shows that a daemon started
through a node service that does not clean up fails, then that perseus's node service starts it. Exits 0 when
every step went as expected; otherwise prints what went wrong and exits 1.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BIN = os.path.dirname(sys.executable)
LEFTOVER_FAILURE = "The PMIx server's listener thread failed to start"
sys.path.insert(0, REPO)

from perseus.runner.remote import job as remote_job  # noqa: E402
from perseus.runner.remote import service as service_module  # noqa: E402
from perseus.runner.remote.agent import write_job_file  # noqa: E402
from perseus.runner.remote.service import NodeService  # noqa: E402


def plant(base: str, pid: int, kind: str) -> str:
    """A leftover as a killed mpirun (``ompi``) or MPI daemon (``prted``) leaves it: the directory and its PMIx
    rendezvous files."""
    path = os.path.join(base, f"{kind}.{pid}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    for name in ("pmix.vm.tool", f"pmix.vm.tool.{pid}", f"pmix.vm.tool.prterun-vm-{pid}@0"):
        with open(os.path.join(path, name), "w") as f:
            f.write("pmix-tool-rendezvous\n")
    return path


def plant_window(base: str, kind: str, size: int = 300) -> range:
    """Leftovers for ``size`` free process ids past the current one, and the namespace's next process id set
    just before them (``/proc/sys/kernel/ns_last_pid``): the next processes started get ids inside the window."""
    with open("/proc/sys/kernel/ns_last_pid") as f:
        start = int(f.read()) + 100
    window = range(start, start + size)
    for pid in window:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            plant(base, pid, kind)
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(start - 1))
    return window


def check(ok: bool, message: str) -> None:
    if not ok:
        print(message, flush=True)
        sys.exit(1)


def mpirun_scenario(tmp: str) -> None:
    env = {**os.environ, "TMPDIR": tmp, "PYTHONPATH": REPO, "PATH": BIN + ":" + os.environ["PATH"]}
    window = plant_window(tmp, "ompi")
    plain = subprocess.Popen([os.path.join(BIN, "mpirun"), "--allow-run-as-root", "-np", "1", "true"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = plain.communicate(timeout=60)
    check(plain.pid in window, f"mpirun got process id {plain.pid}, outside the planted {window}")
    check(plain.returncode != 0 and LEFTOVER_FAILURE in out,
          "plain mpirun did not fail as beside a leftover of its own id (the test proves nothing):\n" + out)
    plant_window(tmp, "ompi")
    done = subprocess.run([sys.executable, "-m", "perseus.runner.launch", "-np", "1", "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    check(done.returncode == 0, "perseusrun failed beside the leftovers:\n" + done.stdout + done.stderr)


def daemon_scenario(tmp: str) -> None:
    os.environ["TMPDIR"] = tmp
    svc = NodeService("tok", "127.0.0.1", env={"TMPDIR": tmp, "PYTHONPATH": REPO})
    job_file = os.path.join(tmp, "job.json")
    write_job_file(job_file, "tok", {"perseus-node-0": f"127.0.0.1:{svc.port}"})
    # The rank lives half a second: a command that ends at once sometimes left mpirun and its daemon waiting on
    # each other when the daemon came through the agent (Open MPI 5.0.11, about 1 run in 5, with no leftovers
    # at all); perseus's ranks start a Python interpreter first, which takes longer.
    plan = remote_job.plan([remote_job.Node("perseus-node-0", f"127.0.0.1:{svc.port}", 1)], ["sleep", "0.5"],
                           job_file)
    cleanup = service_module.remove_stale_session_dirs
    try:
        service_module.remove_stale_session_dirs = lambda tmpdir=None: []
        plant_window(tmp, "prted")
        plain = subprocess.run(plan.argv, env={**os.environ, **plan.env}, capture_output=True, text=True,
                               timeout=60)
        check(plain.returncode != 0 and LEFTOVER_FAILURE in plain.stdout + plain.stderr,
              "the daemon did not fail as beside a leftover of its own id (the test proves nothing):\n"
              + plain.stdout + plain.stderr)
        service_module.remove_stale_session_dirs = cleanup
        plant_window(tmp, "prted")
        proc = remote_job.start(plan, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=60)
        check(proc.returncode == 0, "the daemon failed beside the leftovers although the service cleans up:\n" + out)
    finally:
        service_module.remove_stale_session_dirs = cleanup
        svc.close()


if __name__ == "__main__":
    {"mpirun": mpirun_scenario, "daemon": daemon_scenario}[sys.argv[1]](sys.argv[2])
    print("ok", flush=True)
