"""perseus.ray across machines: a Ray cluster started with Ray's own ``ray start`` in two emulated hosts
(tools/emulated_cluster.sh: network namespaces with their own hostname and address), the driver in the head's
host. RayExecutor trains on 4 workers over both hosts; ElasticRayExecutor survives a rank's process killed,
and the agent actor of a host killed. Needs root (the emulated cluster); the job's driver is
ray_cluster_job.py."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="perseus.ray needs ray (pip install perseus[ray])")

from elastic_cluster import REPO, cluster_fixture  # noqa: E402

pytestmark = pytest.mark.timeout(240)

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_cluster_job.py")
ENV = "RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0"
HEAD = "10.213.0.10"


def _ssh(host, command, timeout):
    return subprocess.run(["ssh", host, f"cd {REPO} && {ENV} {command}"], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _stop_ray():
    for host in ("perseus-h0", "perseus-h1"):
        _ssh(host, f"{RAY} stop --force", timeout=60)


@pytest.fixture(scope="module")
def ray_cluster():
    """Ray's head in perseus-h0 and a worker node in perseus-h1, 2 CPUs each."""
    yield from _with_ray(cluster_fixture())


def _with_ray(hosts):
    next(hosts)  # the emulated hosts are up (or the module was skipped)
    try:
        _stop_ray()
        common = "--num-cpus 2 --object-store-memory 100000000 --disable-usage-stats"
        head = _ssh("perseus-h0", f"{RAY} start --head --node-ip-address {HEAD} --port 6379 "
                                  f"--include-dashboard false {common}", timeout=120)
        assert head.returncode == 0, head.stdout + head.stderr
        worker = _ssh("perseus-h1", f"{RAY} start --address {HEAD}:6379 --node-ip-address 10.213.0.11 {common}",
                      timeout=120)
        assert worker.returncode == 0, worker.stdout + worker.stderr
        yield
    finally:
        _stop_ray()
        for _ in hosts:  # the emulated cluster's own teardown
            pass


def _job(mode):
    done = _ssh("perseus-h0", f"{sys.executable} {JOB} {mode}", timeout=200)
    lines = [l for l in done.stdout.splitlines() if l.startswith("[")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1]), done.stdout + done.stderr


def test_ray_executor_trains_on_four_workers_over_two_hosts(ray_cluster):
    results, _ = _job("static")
    assert [r[:2] for r in results] == [[r, 4] for r in range(4)]
    hosts = [r[2] for r in results]  # ranks numbered host by host (which host is first is Ray's placement)
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and {hosts[0], hosts[2]} == {"perseus-h0", "perseus-h1"}
    assert all(r[3] == results[0][3] for r in results)


def test_elastic_ray_executor_survives_a_killed_rank(ray_cluster):
    results, output = _job("elastic-rank")
    died = re.search(r"rank 3 \(pid \d+\) on (perseus-node-\d) died", output)
    assert died and re.search(r"generation 1: 2 rank\(s\) on perseus-node-\d:2", output), output[-3000:]
    assert f"generation 1: 2 rank(s) on {died.group(1)}:2" not in output  # re-formed on the other host
    assert [r[:2] + r[3:4] for r in results] == [[0, 2, 40], [1, 2, 40]]
    assert results[0][2] == results[1][2] and results[0][4] == results[1][4]


def test_elastic_ray_executor_survives_a_killed_agent_actor(ray_cluster):
    results, output = _job("elastic-actor")
    assert "killed the agent actor of perseus-node-1" in output and "generation 1:" in output, output[-3000:]
    assert "restored commit" in output
    assert {r[1] for r in results} == {len(results)} and [r[0] for r in results] == list(range(len(results)))
    assert all(r[3] == 40 and r[4] == results[0][4] for r in results)
