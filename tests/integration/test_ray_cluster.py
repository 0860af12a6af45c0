"""perseus.ray across machines: a Ray cluster started with Ray's own ``ray start`` in two emulated hosts
(tools/emulated_cluster.sh: network namespaces with their own hostname and address; two hosts leased from the
tests' shared cluster), the driver in the head's host. RayExecutor trains on 4 workers over both hosts; ElasticRayExecutor survives a rank's process killed,
and the agent actor of a host killed. Needs root (the emulated cluster); the job's driver is
ray_cluster_job.py."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="perseus.ray needs ray (pip install perseus[ray])")

from cluster_support import REPO, leased_hosts  # noqa: E402

# pytest-xdist keeps the module's tests in one worker: one Ray cluster for the three of them.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("ray_cluster")]  # (hangs)

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_cluster_job.py")
ENV = "RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0"


def _ssh(host, command, timeout):
    return subprocess.run(["ssh", host, f"cd {REPO} && {ENV} {command}"], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def ray_cluster():
    """Ray's head in the first of two leased hosts and a worker node in the second, 2 CPUs each; yields the
    hosts (cluster_support.Host). The lease's end kills Ray's processes in those hosts only ("ray stop" would
    end every Ray of the machine, other tests' included)."""
    with leased_hosts(2) as (head, worker):
        common = "--num-cpus 2 --object-store-memory 100000000 --disable-usage-stats"
        up = _ssh(head.name, f"{RAY} start --head --node-ip-address {head.address} --port 6379 "
                             f"--include-dashboard false {common}", timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        up = _ssh(worker.name, f"{RAY} start --address {head.address}:6379 --node-ip-address {worker.address} "
                               f"{common}", timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        yield head, worker


def _job(hosts, mode):
    head = hosts[0]
    done = _ssh(head.name, f"{sys.executable} {JOB} {mode} {head.address}:6379", timeout=500)
    lines = [l for l in done.stdout.splitlines() if l.startswith("[")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1]), done.stdout + done.stderr


def test_ray_executor_trains_on_four_workers_over_two_hosts(ray_cluster):
    results, _ = _job(ray_cluster, "static")
    assert [r[:2] for r in results] == [[r, 4] for r in range(4)]
    hosts = [r[2] for r in results]  # ranks numbered host by host (which host is first is Ray's placement)
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and {hosts[0], hosts[2]} == {h.name for h in ray_cluster}
    assert all(r[3] == results[0][3] for r in results)


def test_elastic_ray_executor_survives_a_killed_rank(ray_cluster):
    results, output = _job(ray_cluster, "elastic-rank")
    died = re.search(r"rank 3 \(pid \d+\) on (perseus-node-\d) died", output)
    assert died and re.search(r"generation 1: 2 rank\(s\) on perseus-node-\d:2", output), output[-3000:]
    assert f"generation 1: 2 rank(s) on {died.group(1)}:2" not in output  # re-formed on the other host
    assert [r[:2] + r[3:4] for r in results] == [[0, 2, 40], [1, 2, 40]]
    assert results[0][2] == results[1][2] and results[0][4] == results[1][4]


@pytest.mark.full
def test_elastic_ray_executor_survives_a_killed_agent_actor(ray_cluster):
    results, output = _job(ray_cluster, "elastic-actor")
    assert "killed the agent actor of perseus-node-1" in output and "generation 1:" in output, output[-3000:]
    assert "restored commit" in output
    assert {r[1] for r in results} == {len(results)} and [r[0] for r in results] == list(range(len(results)))
    assert all(r[3] == 40 and r[4] == results[0][4] for r in results)
