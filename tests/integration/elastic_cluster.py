"""Shared pieces of the elastic tests: 3 hosts of the emulated cluster (tools/emulated_cluster.sh, real ssh
launches) leased for each test alone (cluster_support.leased_hosts), a host discovery script the test steers
through a file, and a runner for elastic_job.py under perseusrun's elastic launcher.
"""

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np

from cluster_support import REPO, leased_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "elastic_job.py")
HOSTS = 3


def link(host, up):
    subprocess.run(["ip", "netns", "exec", host, "ip", "link", "set", "perseus0", "up" if up else "down"],
                   check=True, timeout=10)


def discovery_fixture(tmp_path):
    """Generator for a per-test fixture: 3 leased hosts and a :class:`Discovery` reporting the first two;
    afterwards every host's link is up again (and the lease's end kills what the test left running there)."""
    with leased_hosts(HOSTS) as leased:
        d = Discovery(tmp_path, [h.name for h in leased])
        d.set(*d.hosts[:2])
        try:
            yield d
        finally:
            for host in d.hosts:
                try:
                    link(host, True)
                except Exception:  # noqa: BLE001 - best effort: the next test starts from a clean host either way
                    pass


class Discovery:
    """A discovery script printing the file ``hosts`` next to it; ``set()`` changes what it prints, ``fail()``
    makes it exit 1, ``garbage()`` print nonsense. ``hosts`` are the names of the test's leased hosts."""

    def __init__(self, tmp, hosts):
        self.hosts = hosts
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
            f.write(f"{self.hosts[0]}:1\nthis is :: not a host line\n")
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


def finish(proc, out, timeout=400):
    """Wait for the launcher (killing it and the hosts' strays at the deadline); return (status, log text)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "HANG"  # (the discovery fixture kills what the launcher left in the hosts)
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
        subprocess.run([sys.executable, job, "reference", out], check=True, timeout=300,
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

