"""Shared pieces of the elastic tests: an emulated cluster of 3 hosts (tools/emulated_cluster.sh, real ssh
launches), a host discovery script the test steers through a file, and a runner for elastic_job.py under
perseusrun's elastic launcher.
"""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from cluster_support import CANNOT_BUILD, REPO, STATE, cluster, why_not_here

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "elastic_job.py")
HOSTS = 3
_cluster = cluster


def _running_cluster():
    try:
        with open(os.path.join(STATE, "params")) as f:
            hosts = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    if hosts < HOSTS:
        return False
    for i in range(HOSTS):
        probe = subprocess.run(["ssh", f"perseus-h{i}", "hostname"], capture_output=True, text=True, timeout=20,
                               stdin=subprocess.DEVNULL)
        if probe.stdout.strip() != f"perseus-h{i}":
            return False
    return True


def cluster_fixture():
    """Generator for a module-scoped fixture: 3 emulated hosts, unshaped; an existing cluster is reused."""
    reason = why_not_here()
    if reason:
        pytest.skip(reason)
    if _running_cluster():
        yield
        return
    try:
        up = _cluster("up", str(HOSTS), "0", "0", "1", timeout=150)
        if up.returncode != 0:
            last = (up.stderr.strip().splitlines() or ["no output"])[-1]
            if any(mark in last for mark in CANNOT_BUILD):
                pytest.skip(f"the emulated cluster cannot be built here: {last}")
            pytest.fail(f"tools/emulated_cluster.sh up failed:\n{up.stdout}{up.stderr}")
        yield
    finally:
        _cluster("down", timeout=120)


def host_pids(host):
    """Process ids running inside an emulated host's network namespace."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def kill_strays():
    """Kill what a test left running in the hosts (workers, keepers, MPI daemons), keeping the ssh servers."""
    for i in range(HOSTS):
        for pid in host_pids(f"perseus-h{i}"):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "sshd":
                        continue
                os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def link(host, up):
    subprocess.run(["ip", "netns", "exec", host, "ip", "link", "set", "perseus0", "up" if up else "down"],
                   check=True, timeout=10)


def discovery_fixture(tmp_path):
    """Generator for a per-test fixture: a :class:`Discovery` reporting perseus-h0 and perseus-h1; afterwards
    every host's link is up again and what the test left running in the hosts is killed."""
    d = Discovery(tmp_path)
    d.set("perseus-h0", "perseus-h1")
    yield d
    for i in range(HOSTS):
        try:
            link(f"perseus-h{i}", True)
        except Exception:  # noqa: BLE001 - best effort: the next test starts from a clean cluster either way
            pass
    kill_strays()

class Discovery:
    """A discovery script printing the file ``hosts`` next to it; ``set()`` changes what it prints, ``fail()``
    makes it exit 1, ``garbage()`` print nonsense."""

    def __init__(self, tmp):
        self.dir = str(tmp)
        self.hosts_file = os.path.join(self.dir, "hosts")
        self.path = os.path.join(self.dir, "discover.sh")
        with open(self.path, "w") as f:
            f.write(textwrap.dedent(f"""\
                #!/bin/sh
                if [ -e {self.dir}/fail ]; then echo "discovery backend unavailable" >&2; exit 1; fi
                cat {self.hosts_file}
                """))
        os.chmod(self.path, os.stat(self.path).st_mode | stat.S_IEXEC)

    def set(self, *hosts):
        tmp = self.hosts_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(f"{h}:1\n" for h in hosts))
        os.replace(tmp, self.hosts_file)

    def garbage(self):
        with open(self.hosts_file + ".tmp", "w") as f:
            f.write("perseus-h0:1\nthis is :: not a host line\n")
        os.replace(self.hosts_file + ".tmp", self.hosts_file)

    def fail(self, on=True):
        flag = os.path.join(self.dir, "fail")
        if on:
            open(flag, "w").close()
        elif os.path.exists(flag):
            os.remove(flag)


def start(discovery, out, *, np_=2, min_np=1, max_np=3, extra=(), env=None, mode="train", job=JOB):
    """Start perseusrun's elastic launcher on ``job`` (default elastic_job.py); returns the Popen (stdout+stderr to
    out/log)."""
    os.makedirs(out, exist_ok=True)
    forward = " ".join(f"-x {name}" for name in (env or {}) if not name.startswith(("PERSEUS_", "HOROVOD_")))
    if forward:  # the job's own variables (FAULT_*, STEPS, ...) reach the ranks through mpirun
        extra = (*extra, "--mpi-args", forward)
    args = [sys.executable, "-m", "perseus.runner.launch", "-np", str(np_), "--min-np", str(min_np),
            "--max-np", str(max_np), "--host-discovery-script", discovery.path, "--network-interface", "perseus0",
            *extra, "python", job, mode, out]
    full_env = dict(os.environ, PERSEUS_ELASTIC_HEARTBEAT_TIMEOUT="4", **(env or {}))
    log = open(os.path.join(out, "log"), "w")
    return subprocess.Popen(args, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc, out, timeout=150):
    """Wait for the launcher (killing it and the hosts' strays at the deadline); return (status, log text)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        kill_strays()
        code = "HANG"
    with open(os.path.join(out, "log")) as f:
        text = f.read()
    return code, text


def events(out):
    path = os.path.join(out, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


_REFERENCE = {}


def reference(steps, tmp_root, job=JOB):
    """Final parameters of the same steps run by ``job`` on one process without perseus."""
    if (job, steps) not in _REFERENCE:
        out = os.path.join(str(tmp_root), f"reference-{os.path.basename(job)}-{steps}")
        subprocess.run([sys.executable, job, "reference", out], check=True, timeout=120,
                       env=dict(os.environ, STEPS=str(steps)))
        _REFERENCE[(job, steps)] = np.load(os.path.join(out, "reference.npy"))
    return _REFERENCE[(job, steps)]


def phases(ev):
    """The job's successive memberships: [(size, sorted hosts)], one per entry into the training function
    (a generation started by the launcher, or the survivors re-formed in process), in time order."""
    groups = {}
    for e in ev:
        if e["kind"] == "restored":
            key = (e["gen"], e["attempt"])
            t, size, hosts = groups.get(key, (e["t"], e["size"], set()))
            hosts.add(e["host"])
            groups[key] = (min(t, e["t"]), size, hosts)
    return [(size, sorted(hosts)) for _, size, hosts in sorted(groups.values(), key=lambda g: g[0])]


def check_recovered(out, steps, tmp_root, job=JOB):
    """The job finished every step and its parameters equal the reference's; no committed step was lost: each
    re-formed phase restored at least the last step committed before it, less the one commit whose copies may
    still have been travelling when a whole generation stopped."""
    ev = events(out)
    assert os.path.exists(os.path.join(out, "final.npy")), "rank 0 wrote no final parameters"
    final = np.load(os.path.join(out, "final.npy"))
    np.testing.assert_allclose(final, reference(steps, tmp_root, job), rtol=1e-4, atol=1e-5)
    restored = sorted((e for e in ev if e["kind"] == "restored"), key=lambda e: e["t"])
    for r in restored:
        before = [e["step"] for e in ev if e["kind"] == "step" and e["t"] < r["t"]]
        if before:
            assert r["step"] >= max(before) - 1, (r, max(before))
    assert max(e["step"] for e in ev if e["kind"] == "step") == steps
    return ev


def worker_pids(out, rank, gen=0):
    return [e["pid"] for e in events(out) if e["kind"] == "start" and e["rank"] == rank and e["gen"] == gen]

