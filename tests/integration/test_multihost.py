"""perseusrun across hosts: real ssh launches on an emulated cluster (tools/emulated_cluster.sh).

The module leases 2 hosts of the shared emulated cluster (network namespaces with their own hostname, address
and sshd; cluster_support.leased_hosts) and shapes their links to 800 Mbit/s with 200 Mbit/s per TCP flow, like
the benchmarks' setting, so that the shaping is exercised too. Needs root; skipped otherwise, and where the
cluster cannot be built.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from cluster_support import STATE, cluster, leased_hosts

pytestmark = pytest.mark.timeout(600)  # for hangs: jobs launched over ssh, on a busy machine

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "multihost_job.py")
LINK_MBIT, FLOW_MBIT = 800, 200
_cluster = cluster


class Pair:
    """The module's two hosts: ``a`` and ``b`` (names), ``hosts`` (both, as the job takes them), their
    :class:`cluster_support.Host` tuples in ``h``, and the links' shaping."""

    def __init__(self, leased):
        self.h = leased
        self.a, self.b = (h.name for h in leased)
        self.hosts = f"{self.a},{self.b}"
        self.link, self.flow = LINK_MBIT, FLOW_MBIT

    def H(self, slots):
        """perseusrun's -H value: both hosts with ``slots`` slots each."""
        return f"{self.a}:{slots},{self.b}:{slots}"


@pytest.fixture(scope="module")
def cluster():
    """The module's two hosts (a :class:`Pair`), links shaped to 800/200 Mbit/s."""
    with leased_hosts(2, LINK_MBIT, FLOW_MBIT) as leased:
        yield Pair(leased)


def perseusrun(*args, env=None, timeout=400):
    """Run perseusrun with the job's environment; return (status, stdout + stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "perseus.runner.launch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def job(mode, hosts, per_host, *extra):
    """The job's command line; ``hosts`` are the names, comma-separated, in the order ranks fill them."""
    return ["python", JOB, mode, hosts, str(per_host), *extra]


def ok_lines(out, mode):
    return [line for line in out.splitlines() if line.startswith(f"OK {mode} ")]


def veth_bytes(name):
    with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
        tx = int(f.read())
    with open(f"/sys/class/net/{name}/statistics/rx_bytes") as f:
        rx = int(f.read())
    return tx, rx  # root side: tx goes into the host, rx comes out of it


def test_hostfile_lists_the_hosts(cluster):
    with open(os.path.join(STATE, "hostfile")) as f:
        lines = f.read().split("\n")
    for h in cluster.h:
        assert re.fullmatch(rf"{h.name} slots=\d+", lines[h.index]), lines


def test_collectives_two_hosts_one_rank_each(cluster):
    code, out, _ = perseusrun("-np", "2", "-H", cluster.H(1), *job("collectives", cluster.hosts, 1))
    assert code == 0, out
    lines = ok_lines(out, "collectives")
    assert len(lines) == 2, out
    assert any(f"rank 1 of 2 on {cluster.b} local 0/1 cross 1/2" in line for line in lines), out


def test_collectives_two_hosts_two_ranks_each_over_the_links(cluster, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{cluster.a} slots=2\n{cluster.b} slots=2\n")
    # The job's PATH lacks the environment's bin directory, like a remote login shell's: perseusrun must
    # put it back for a bare "python" to be the interpreter perseus is installed in.
    bindir = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != bindir)
    env = dict(os.environ, PATH=path or "/usr/bin:/bin")
    into_a, out_of_a = veth_bytes(cluster.h[0].veth)
    code, out, _ = perseusrun("-np", "4", "--hostfile", str(hostfile), "--network-interface", "perseus0",
                              *job("collectives", cluster.hosts, 2, "perseus0"), env=env)
    assert code == 0, out
    lines = ok_lines(out, "collectives")
    assert len(lines) == 4, out
    assert any(f"rank 3 of 4 on {cluster.b} local 1/2 cross 1/2" in line for line in lines), out
    # Every all-reduced element must reach each host from the other one: the large all-reduces alone
    # account for this many bytes through each host's link (and none of it may go through shared memory).
    moved = int(re.search(r"large allreduce bytes (\d+)", lines[0]).group(1))
    now_in, now_out = veth_bytes(cluster.h[0].veth)
    assert now_in - into_a >= moved and now_out - out_of_a >= moved, (now_in - into_a, now_out - out_of_a, moved)


def test_each_channel_is_its_own_tcp_flow(cluster):
    # MPI shares one connection per pair of processes between all communicators; perseus's channels
    # open their own: N channels add N connections between the hosts.
    counts = {}
    for channels in (1, 4):
        env = dict(os.environ, PERSEUS_NUM_CHANNELS=str(channels))
        code, out, _ = perseusrun("-np", "2", "-H", cluster.H(1), *job("flows", cluster.hosts, 1), env=env)
        assert code == 0, out
        lines = ok_lines(out, "flows")
        assert len(lines) == 2, out
        counts[channels] = sorted(int(re.search(r"connections (\d+)", line).group(1)) for line in lines)
    assert all(c >= 1 for c in counts[1]), counts
    assert [b - a for a, b in zip(counts[1], counts[4])] == [3, 3], counts


def test_default_settings_use_several_channels_across_hosts(cluster):
    # Nothing set: init() sees ranks on two hosts and opens CROSS_HOST_CHANNELS channels, each its own TCP
    # flow, which the settings report; an explicit PERSEUS_NUM_CHANNELS=1 still gets one.
    from perseus.engine.settings import CROSS_HOST_CHANNELS

    seen = {}
    for given in ("", "1"):
        env = {k: v for k, v in os.environ.items() if k not in ("PERSEUS_NUM_CHANNELS", "PERSEUS_MAX_CHANNELS")}
        if given:
            env["PERSEUS_NUM_CHANNELS"] = given
        code, out, _ = perseusrun("-np", "2", "-H", cluster.H(1), *job("flows", cluster.hosts, 1), env=env)
        assert code == 0, out
        lines = ok_lines(out, "flows")
        assert len(lines) == 2, out
        seen[given] = sorted((int(re.search(r"channels (\d+)", line).group(1)),
                              int(re.search(r"connections (\d+)", line).group(1))) for line in lines)
    assert [c for c, _ in seen["1"]] == [1, 1] and [c for c, _ in seen[""]] == [CROSS_HOST_CHANNELS] * 2, seen
    assert [b[1] - a[1] for a, b in zip(seen["1"], seen[""])] == [CROSS_HOST_CHANNELS - 1] * 2, seen


@pytest.mark.full
@pytest.mark.parametrize("settings", [
    {"PERSEUS_ALLREDUCE_ALGORITHM": "ring", "HOROVOD_HIERARCHICAL_ALLGATHER": "1", "PERSEUS_NUM_CHANNELS": "2"},
    {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "PERSEUS_NUM_CHANNELS": "3"},
], ids=["ring+hierarchical-allgather", "hierarchical-allreduce"])
def test_collectives_two_by_two_with_each_algorithm(cluster, settings):
    env = dict(os.environ, **settings)
    code, out, _ = perseusrun("-np", "4", "-H", cluster.H(2), *job("collectives", cluster.hosts, 2), env=env)
    assert code == 0, out
    assert len(ok_lines(out, "collectives")) == 4, out


def test_training_two_hosts_two_ranks_each(cluster):
    code, out, _ = perseusrun("-np", "4", "-H", cluster.H(2), *job("train", cluster.hosts, 2))
    assert code == 0, out
    assert len(ok_lines(out, "train")) == 4, out


def test_hierarchical_topk_two_by_two(cluster):
    code, out, _ = perseusrun("-np", "4", "-H", cluster.H(2), *job("hitopk", cluster.hosts, 2))
    assert code == 0, out
    assert len(ok_lines(out, "hitopk")) == 4, out


def test_run_a_function_on_two_hosts(cluster):
    """perseus.run from this (root) namespace: the ranks start on the emulated hosts, fetch the function from
    this process over the bridge, all-reduce across the link and return their results in rank order."""
    body = textwrap.dedent("""
        import perseus

        def where():
            import socket
            import torch
            import perseus.torch as hvd
            hvd.init()
            total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
            out = (hvd.rank(), socket.gethostname(), total)
            hvd.shutdown()
            return out

        print("RESULT", perseus.run(where, np=2, hosts=HOSTS, network_interface="perseus0"))
    """).replace("HOSTS", repr(cluster.H(1)))
    proc = subprocess.run([sys.executable, "-c", body], cwd="/", capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": REPO})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"RESULT [(0, '{cluster.a}', 3.0), (1, '{cluster.b}', 3.0)]" in out, out


def one_error_line(out):
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("perseusrun: error: cannot log in with ssh to "), out
    return lines[0]


# "Fast": the check gives up after its own connect timeout (5 s), not the kernel's two minutes of SYN retries;
# the bound leaves room for perseusrun's start on a busy machine.
FAST_S = 45


def test_unreachable_host_is_one_fast_line(cluster):
    # An address on the cluster's subnet that no host has: ssh gets no answer at all.
    code, out, took = perseusrun("-np", "2", "-H", f"{cluster.a}:1,10.213.0.99:1",
                                 *job("collectives", cluster.hosts, 1), timeout=240)
    assert code == 2, out
    line = one_error_line(out)
    assert "'10.213.0.99'" in line and "--skip-ssh-check" in line and cluster.a not in line, line
    assert took < FAST_S, took


def test_ssh_refused_is_one_fast_line(cluster):
    code, out, took = perseusrun("-np", "2", "-H", cluster.H(1), "--ssh-port", "2222",
                                 *job("collectives", cluster.hosts, 1), timeout=240)
    assert code == 2, out
    line = one_error_line(out)
    assert f"'{cluster.a}'" in line and f"'{cluster.b}'" in line and "Connection refused" in line, line
    assert took < FAST_S, took


def test_shaping_caps_flows_and_link(cluster):
    link, flow = cluster.link, cluster.flow
    done = _cluster("check", "1", cluster.a, cluster.b, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    totals = {}
    for direction, block in zip(("out", "back"), done.stdout.split(" -> ")[1:]):
        for n, rate in re.findall(r"^\s+(\d+) flows?\s+([0-9.]+) Mbit/s", block, re.M):
            totals[(direction, int(n))] = float(rate)
    assert len(totals) == 6, done.stdout
    for direction in ("out", "back"):
        for n in (1, 4, 8):
            # A shaper never lets more through than its rate (the probe counts payload, about 96 % of it); the
            # lower bound is loose, for a busy 2-core machine and the odd hash collision between flows.
            expected = min(link, n * flow)
            assert 0.5 * expected <= totals[(direction, n)] <= 1.02 * expected, done.stdout


ENV_PROBE = textwrap.dedent("""
    import json, os, socket
    import perseus.torch as hvd
    from perseus.runtime.state import runtime
    hvd.init()
    params = runtime().engine.params(0)  # (fusion bytes, in-place bytes, channels, cycle us, algorithm, ...)
    names = ("MY_DATA_DIR", "OMP_NUM_THREADS", "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "OLDPWD")
    print("ENV", json.dumps({"host": socket.gethostname(), "rank": hvd.rank(),
                             "env": {n: os.environ.get(n) for n in names},
                             "fusion": params[0], "cycle_us": params[3]}), flush=True)
    hvd.shutdown()
""")


def test_caller_environment_and_config_file_reach_every_host(cluster, tmp_path):
    """horovodrun's forwarding: the caller's variables arrive on both hosts, values unchanged (spaces,
    newlines, '='), except the excluded ones; a --config-file's settings change the engine on every rank."""
    config = tmp_path / "hvd.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 7\n")
    odd = "/data dir/with=sign\nand a second line"
    env = dict(os.environ, MY_DATA_DIR=odd, OMP_NUM_THREADS="3", NCCL_DEBUG="WARN", CUDA_VISIBLE_DEVICES="5",
               OLDPWD="/somewhere")
    code, out, _ = perseusrun("-np", "2", "-H", cluster.H(1), "--config-file", str(config),
                              "python", "-c", ENV_PROBE, env=env)
    assert code == 0, out
    seen = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ENV ")]
    assert sorted(s["host"] for s in seen) == [cluster.a, cluster.b], out
    for s in seen:
        assert s["env"]["MY_DATA_DIR"] == odd and s["env"]["OMP_NUM_THREADS"] == "3", s
        assert s["env"]["NCCL_DEBUG"] == "WARN", s
        assert (s["fusion"], s["cycle_us"]) == (32 << 20, 7000), s
    # Excluded variables do not travel to another host (a rank on the launching host inherits its environment,
    # as with horovodrun; both emulated hosts are other hosts here).
    assert all(s["env"]["CUDA_VISIBLE_DEVICES"] is None and s["env"]["OLDPWD"] is None for s in seen), seen
