"""The emulated cluster (tools/emulated_cluster.sh) as the tests share it: one cluster of ``POOL`` hosts for the
whole test run, and hosts leased from it, so that tests running at the same time (pytest-xdist workers) never
touch each other's hosts.

- :func:`leased_hosts` brings the cluster up on first use (under a lock: one process builds it, the others
  wait and reuse it), then holds ``n`` hosts for the caller alone (a file lock per host, released when the
  caller is done or dies) and shapes their links as asked. Whatever runs in a leased host but its ssh server
  (ranks, MPI daemons, keepers, Ray) is killed when the lease begins and when it ends.
- A cluster that was already up with at least ``POOL`` hosts is used as it is and left up (someone may be
  measuring on it). One this test run built is taken down when the run ends (:func:`take_down_if_ours`, from
  tests/integration/conftest.py), by the process that started pytest.
- Host names are returned in the order their names sort in, so that tests can compare sorted lists of them.
"""

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from typing import NamedTuple

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(REPO, "tools", "emulated_cluster.sh")
STATE = "/run/perseus-cluster"
#: hosts of the shared cluster: room for 4 tests of 3 hosts at once (more workers wait for a lease)
POOL = int(os.environ.get("PERSEUS_TEST_CLUSTER_HOSTS", "12"))
_UP_LOCK = "/run/perseus-cluster.lock"        # held while the cluster is checked, built or taken down
_LEASES = "/run/perseus-cluster.leases"       # one lock file per host, held by the test leasing it
_OWNER = os.path.join(STATE, "pytest-owner")  # the process id of the test run that built the cluster
#: how long a test waits for hosts held by other tests before it fails
LEASE_WAIT_S = 300.0
# Lines of emulated_cluster.sh that mean "this machine cannot host the cluster", not "the script is wrong".
CANNOT_BUILD = ("does not work here", "could not install openssh-server", "apt-get is not available",
                "is missing; install it", "is already used on this machine")


class Host(NamedTuple):
    """One emulated host: its name (also its hostname and ssh name), address and the root end of its link."""
    name: str
    index: int

    @property
    def address(self) -> str:
        return f"10.213.0.{10 + self.index}"

    @property
    def veth(self) -> str:
        return f"perseus-v{self.index}"


def why_not_here():
    """Why the emulated cluster cannot be built on this machine, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: the emulated cluster creates network namespaces and ssh daemons"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing: the emulated cluster needs iproute2, util-linux and openssh-client"
    if not os.path.exists("/usr/sbin/sshd") and shutil.which("apt-get") is None:
        return "no /usr/sbin/sshd and no apt-get to install openssh-server"
    return None


def cluster(*args, timeout=60):
    """Run ``tools/emulated_cluster.sh ARGS``; its CompletedProcess (text output captured)."""
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


def _test_run_pid() -> int:
    """The process that started this test run: pytest itself, or, in a pytest-xdist worker, its controller."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


def _running_hosts() -> int:
    """How many hosts the running cluster has whose namespace and ssh server are alive (0: no cluster)."""
    try:
        with open(os.path.join(STATE, "params")) as f:
            hosts = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    for i in range(hosts):
        try:
            with open(os.path.join(STATE, f"h{i}", "sshd.pid")) as f:
                pid = int(f.read())
            with open(f"/proc/{pid}/comm") as f:
                alive = f.read().strip() == "sshd"
        except (OSError, ValueError):
            alive = False
        if not alive or not os.path.exists(f"/run/netns/perseus-h{i}"):
            return 0
    return hosts


@contextlib.contextmanager
def _locked(path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_cluster():
    """Make sure the shared cluster runs with at least ``POOL`` hosts; skip the test where this machine cannot
    host it, fail it where the script fails."""
    reason = why_not_here()
    if reason:
        pytest.skip(reason)
    with _locked(_UP_LOCK):
        if _running_hosts() >= POOL:
            return
        up = cluster("up", str(POOL), "0", "0", timeout=300)
        if up.returncode != 0:
            last = (up.stderr.strip().splitlines() or ["no output"])[-1]
            if any(mark in last for mark in CANNOT_BUILD):
                pytest.skip(f"the emulated cluster cannot be built here: {last}")
            pytest.fail(f"tools/emulated_cluster.sh up failed:\n{up.stdout}{up.stderr}")
        with open(_OWNER, "w") as f:
            f.write(str(_test_run_pid()))


def take_down_if_ours():
    """Take the shared cluster down if this test run built it (called once, by the process that started
    pytest, when the run ends)."""
    try:
        with open(_OWNER) as f:
            owner = int(f.read())
    except (OSError, ValueError):
        return
    if owner == os.getpid():
        with _locked(_UP_LOCK):
            cluster("down", timeout=120)


def host_pids(host: str) -> list:
    """Process ids running inside an emulated host's network namespace."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def kill_strays(hosts):
    """Kill what runs in the emulated ``hosts`` (names) but their ssh servers: workers, keepers, MPI daemons,
    Ray. (A network namespace shares the machine's process table: killing by name would reach other tests.)"""
    for host in hosts:
        for pid in host_pids(host):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "sshd":
                        continue
                os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def _shape(host: Host, link: int, flow: int):
    try:
        with open(os.path.join(STATE, f"h{host.index}", "shape")) as f:
            if f.read().split() == [str(link), str(flow)]:
                return
    except OSError:
        pass
    done = cluster("shape", host.name, str(link), str(flow))
    assert done.returncode == 0, done.stdout + done.stderr


@contextlib.contextmanager
def leased_hosts(n: int, link: int = 0, flow: int = 0):
    """Hold ``n`` hosts of the shared cluster for the caller alone, their links shaped to ``link``/``flow``
    Mbit/s (0: unshaped); yields them as :class:`Host` tuples, in the order their names sort in. Waits (at most
    :data:`LEASE_WAIT_S`) while other tests hold too many hosts."""
    assert n <= POOL, f"{n} hosts asked for; the shared cluster has {POOL} (PERSEUS_TEST_CLUSTER_HOSTS)"
    ensure_cluster()
    os.makedirs(_LEASES, exist_ok=True)
    deadline = time.monotonic() + LEASE_WAIT_S
    held = []
    try:
        while True:
            for i in range(POOL):
                f = open(os.path.join(_LEASES, f"h{i}"), "a")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    f.close()
                    continue
                held.append((Host(f"perseus-h{i}", i), f))
                if len(held) == n:
                    break
            if len(held) == n:
                break
            for _, f in held:  # never sit on some hosts while waiting for more
                f.close()
            held = []
            if time.monotonic() > deadline:
                pytest.fail(f"no {n} free hosts of the emulated cluster's {POOL} within {LEASE_WAIT_S:g} s")
            time.sleep(0.5)
        hosts = sorted((h for h, _ in held), key=lambda h: h.name)
        kill_strays(h.name for h in hosts)  # what an earlier test that died left running
        for h in hosts:
            _shape(h, link, flow)
        yield hosts
    finally:
        kill_strays(h.name for h, _ in held)
        for _, f in held:
            f.close()
