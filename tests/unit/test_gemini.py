"""Unit tests for the Gemini checkpoint store (perseus.elastic.gemini) and the keepers it talks to
(perseus.runner.elastic.keeper): real keeper processes on 127.0.0.1 stand for the hosts "a", "b" and "c"."""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import time

import numpy as np
import pytest

from perseus.base import elastic_protocol as protocol
from perseus.elastic.gemini import GeminiStore, placement, recovery_probability
from perseus.runner.elastic.keeper_process import start_keeper

pytestmark = pytest.mark.timeout(120)

# One token per test process: a job's shared-memory directory is named after its token, and the keepers of a
# test running in another pytest-xdist worker remove theirs when they stop.
TOKEN = f"test-token-{os.getpid()}"


@pytest.fixture
def keepers():
    procs = {h: start_keeper(h, TOKEN, local=True, bind="127.0.0.1") for h in "abc"}
    yield procs
    for proc in procs.values():
        proc.stop()


def addresses(procs):
    return {h: ("127.0.0.1", k.port) for h, k in procs.items()}


def make_store(procs, host="a", rank=0, **kwargs):
    kwargs.setdefault("replication", "sync")
    kwargs.setdefault("chunk_bytes", 1 << 16)
    store = GeminiStore(addresses(procs), ["a", "b", "c"], host, rank, kwargs.pop("token", TOKEN), **kwargs)
    store.CONNECT_TIMEOUT_S = store.IO_TIMEOUT_S = 5.0
    return store


def payload(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((512, 1024)),  # 4 MiB: many chunks
            "ids": np.arange(300_000, dtype=np.int32).reshape(1000, 300) + seed,
            "fortran": np.asfortranarray(rng.standard_normal((300, 200)).astype(np.float32)),
            "empty": np.zeros((0, 3), dtype=np.int64),
            "step": seed, "name": f"commit {seed}"}


def assert_same(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            np.testing.assert_array_equal(got[key], value)
        else:
            assert got[key] == value


def raw_connection(procs, host, token=TOKEN):
    sock = protocol.connect("127.0.0.1", procs[host].port, timeout=5.0)
    protocol.send_msg(sock, {"op": "hello", "token": token})
    return sock, protocol.recv_msg(sock)[0]


def test_round_trip_from_memory_local_peer_and_disk(keepers, tmp_path):
    store = make_store(keepers, disk_dir=str(tmp_path), disk_every=1)
    try:
        store.put(1, payload(1))
        store.put(2, payload(2))
        assert store.flush(5.0)
        got, source, _ = store.get(2, 0)
        assert source == "memory"
        assert_same(got, payload(2))
        got["w"][0, 0] = 42.0  # a restored payload is the caller's own
        assert_same(store.get(2, 0)[0], payload(2))
    finally:
        store.close()
    sources = []
    for stop in ("a", "b"):  # a fresh process has no memory: its own host's keeper, then a peer's
        fresh = make_store(keepers, disk_dir=str(tmp_path), disk_every=1)
        assert fresh.latest() == (2, [0])
        got, source, seconds = fresh.get(2, 0)
        assert_same(got, payload(2))
        assert seconds >= 0
        sources.append(source)
        fresh.close()
        keepers[stop].stop()
    assert sources == ["local", "peer"]
    fresh = make_store(keepers, disk_dir=str(tmp_path), disk_every=1)  # no keeper holds it any more
    try:
        assert fresh.latest() == (2, [0])
        got, source, _ = fresh.get(2, 0)
        assert source == "disk"
        assert_same(got, payload(2))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["gemini-v000000000002-r0.ckpt"]
        with pytest.raises(LookupError, match=r"version 1 of rank\(s\) \[0\]"):
            fresh.get(1, 0)
    finally:
        fresh.close()


def test_latest_is_the_newest_complete_version_with_its_owners(keepers):
    s0, s1 = make_store(keepers, "a", 0), make_store(keepers, "b", 1)
    try:
        assert s0.latest() is None
        s0.put(1, payload(1))
        s1.put(1, payload(11))
        s0.put(2, payload(2))
        assert s1.latest() == (2, [0])
        s1.put(2, payload(12))
        assert s0.latest() == (2, [0, 1])
        got, source, _ = s0.get(2, 1)  # rank 1 (host b) copied to b and c, not a
        assert source == "peer"
        assert_same(got, payload(12))
    finally:
        s0.close()
        s1.close()


def test_interrupted_put_leaves_the_previous_version(keepers):
    store = make_store(keepers)
    try:
        store.put(1, payload(1))
        sock, hello = raw_connection(keepers, "a")
        assert hello == {"op": "ok"}
        protocol.send_msg(sock, {"op": "put_begin", "version": 2, "owner": 0, "nbytes_total": 150, "parts": [100, 50]})
        protocol.send_msg(sock, {"op": "put_chunk", "version": 2, "owner": 0, "part": 0, "offset": 0}, [b"x" * 60])
        sock.close()  # the rank died mid-put
        sock, _ = raw_connection(keepers, "a")
        protocol.send_msg(sock, {"op": "put_begin", "version": 3, "owner": 0, "nbytes_total": 150, "parts": [100, 50]})
        protocol.send_msg(sock, {"op": "put_chunk", "version": 3, "owner": 0, "part": 1, "offset": 0}, [b"y" * 50])
        protocol.send_msg(sock, {"op": "put_end", "version": 3, "owner": 0})
        reply, _ = protocol.recv_msg(sock)
        assert reply["op"] == "error" and "incomplete" in reply["detail"]
        protocol.send_msg(sock, {"op": "list"})
        assert protocol.recv_msg(sock)[0] == {"op": "list", "complete": {"0": 1}}
        protocol.send_msg(sock, {"op": "get", "version": 3, "owner": 0})
        assert protocol.recv_msg(sock)[0]["op"] == "missing"
        sock.close()
        fresh = make_store(keepers)
        got, source, _ = fresh.get(1, 0)
        assert source == "local"
        assert_same(got, payload(1))
        fresh.close()
    finally:
        store.close()


def test_wrong_token_is_refused(keepers):
    sock, reply = raw_connection(keepers, "a", token="not-the-token")
    assert reply["op"] == "error" and "token" in reply["detail"]
    with pytest.raises(protocol.WireError):
        protocol.recv_msg(sock)
    sock.close()
    store = make_store(keepers, token="not-the-token")
    try:
        store.put(1, payload(1))
        assert not store.flush(5.0)
        assert store.latest() == (1, [0])  # only its own memory
        with pytest.raises(LookupError, match=r"version 1 of rank\(s\) \[1\]"):
            store.get(1, 1)
    finally:
        store.close()


def test_async_put_then_flush_is_durable(keepers):
    durable = []
    store = make_store(keepers, replication="async", on_durable=durable.append)
    try:
        for version in range(1, 4):
            store.put(version, payload(version))
        assert store.flush(10.0)
        assert durable == [1, 2, 3]
        fresh = make_store(keepers, host="c", rank=2)
        assert fresh.latest() == (3, [0])
        fresh.close()
    finally:
        store.close()


def test_a_dead_keeper_never_fails_or_stops_the_training(keepers, caplog):
    keepers["b"].stop()
    durable = []
    store = make_store(keepers, replication="async", on_durable=durable.append)
    store.RETRY_AFTER_S = 0.0  # try the dead keeper at every put
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="perseus.elastic"):
            for version in range(1, 6):
                store.put(version, payload(version))
            assert not store.flush(10.0)
        assert time.monotonic() - start < 10.0
        assert durable == [1, 2, 3, 4, 5]  # the reachable destination stored every version
        warnings = [r for r in caplog.records if "keeper of b" in r.getMessage()]
        assert len(warnings) == 1
        assert store.get(5, 0)[1] == "memory"
        fresh = make_store(keepers)
        assert fresh.get(5, 0)[1] == "local"
        fresh.close()
    finally:
        store.close()


def test_set_ring_moves_later_copies(keepers):
    store = make_store(keepers, host="a", rank=3)
    try:
        assert store.destinations() == ["a", "b"]
        store.set_ring(["c", "a"], 1)
        assert store.destinations() == ["a", "c"]
        store.put(1, payload(1))
        assert store.latest() == (1, [1])
    finally:
        store.close()


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("m", [2, 3])
def test_placement(n, m):
    hosts = [f"h{i}" for i in range(n)]
    plan = placement(hosts, m)
    assert set(plan) == set(hosts)
    received = {h: 0 for h in hosts}
    for host, dests in plan.items():
        assert host not in dests and len(set(dests)) == len(dests)
        assert len(dests) == (m - 1 if n >= m else n - 1)
        for d in dests:
            received[d] += 1
    assert set(received.values()) == {m - 1 if n >= m else n - 1}
    if n % m == 0:  # group strategy: the holder sets are n / m disjoint groups of consecutive hosts
        groups = {frozenset([h, *d]) for h, d in plan.items()}
        assert groups == {frozenset(hosts[i:i + m]) for i in range(0, n, m)}


def test_placement_errors():
    with pytest.raises(ValueError, match="replicas"):
        placement(["a"], 0)
    with pytest.raises(ValueError, match="twice"):
        placement(["a", "a"], 2)


def test_recovery_probability_matches_the_digest():
    assert recovery_probability(16, 2, 2) == pytest.approx(0.9333, abs=1e-4)
    assert recovery_probability(16, 2, 3) == pytest.approx(0.8000, abs=1e-4)
    assert recovery_probability(8, 2, 2) == pytest.approx(0.8571, abs=1e-4)
    assert recovery_probability(4, 2, 2) == pytest.approx(0.6667, abs=1e-4)
    assert recovery_probability(16, 2, 3, strategy="ring") == pytest.approx(0.6286, abs=1e-4)
    assert recovery_probability(4, 2, 2, strategy="ring") == pytest.approx(0.3333, abs=1e-4)
    assert recovery_probability(16, 2, 1) == 1.0
    for n, m, k in itertools.product([8, 16], [2, 4], range(2, 8)):  # Corollary 6.1, equality for m <= k < 2m
        if m <= k < 2 * m:
            bound = max(0.0, 1 - n * math.comb(n - m, k - m) / (m * math.comb(n, k)))
            assert recovery_probability(n, m, k) == pytest.approx(bound)
    optimum = 1 - math.ceil(5 / 2) / math.comb(5, 2)  # mixed placement's gap is within (2m - 3) / C(N, m)
    assert optimum - recovery_probability(5, 2, 2) <= (2 * 2 - 3) / math.comb(5, 2) + 1e-12


def test_keepers_exit_when_stdin_closes_or_on_sigterm():
    first = start_keeper("a", TOKEN, local=True, bind="127.0.0.1")
    second = start_keeper("b", TOKEN, local=True, bind="127.0.0.1")
    assert first.alive() and second.alive()
    first.proc.stdin.close()
    assert first.proc.wait(5.0) == 0
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(5.0) == 0
    second.stop()


def test_start_keeper_failure_names_the_host():
    with pytest.raises(RuntimeError, match="keeper on nowhere did not start"):
        start_keeper("nowhere", TOKEN, local=True, python="false", timeout=5.0)


def test_start_keeper_over_ssh(tmp_path, monkeypatch):
    fake_ssh = tmp_path / "ssh"  # runs the remote command here, as ssh would on the host
    fake_ssh.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\neval "last=\\${$#}"\nexec sh -c "$last"\n')
    fake_ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    keeper = start_keeper("far", TOKEN, local=False, ssh_args=["-p", "2222"], bind="127.0.0.1")
    try:
        args = (tmp_path / "args").read_text()
        assert args.startswith("-o BatchMode=yes -p 2222 far exec env PYTHONPATH=")
        sock, hello = raw_connection({"far": keeper}, "far")
        assert hello == {"op": "ok"}
        sock.close()
    finally:
        keeper.stop()
    assert keeper.proc.returncode == 0


# ---------------------------------------------------------------------------------------------------------
# Shared memory: the host's keeper maps the rank's snapshot buffers (perseus.base.elastic_shm)
# ---------------------------------------------------------------------------------------------------------

def test_local_copy_is_the_shared_memory_buffer_itself(keepers):
    from perseus.base.elastic_shm import SharedArena, job_dir

    directory = job_dir(TOKEN, "a")
    if directory is None:
        pytest.skip("no writable /dev/shm")
    arena = SharedArena(directory)
    big = arena.allocate((256, 1024), np.float64)
    big[:] = 3.0
    store = make_store(keepers, peers=0, arena=arena)
    try:
        store.put(1, {"w": big, "n": 1})
        assert store.flush(5.0)
        fresh = make_store(keepers, peers=0)
        got, source, _ = fresh.get(1, 0)
        assert source == "local" and got["n"] == 1
        np.testing.assert_array_equal(got["w"], big)
        big[:] = 4.0  # the keeper maps the very pages: nothing was copied
        np.testing.assert_array_equal(fresh.get(1, 0)[0]["w"], big)
        fresh.close()
        other = arena.allocate((8,), np.int32)
        store.put(2, {"w": other, "n": 2})
        assert store.flush(5.0)
        assert make_store(keepers, peers=0).latest() == (2, [0])
    finally:
        store.close()
    keepers["a"].stop()
    assert not os.path.exists(directory)  # the keeper removes its host's directory when the job ends


def test_keeper_refuses_files_outside_its_directory(keepers, tmp_path):
    sock, reply = raw_connection(keepers, "a")
    outside = tmp_path / "f"
    outside.write_bytes(b"x" * 64)
    protocol.send_msg(sock, {"op": "put_files", "version": 1, "owner": 0,
                         "parts": [{"inline": 0}, {"file": str(outside), "offset": 0, "nbytes": 64}]}, [b"head"])
    reply, _ = protocol.recv_msg(sock)
    assert reply["op"] == "error" and "outside" in reply["detail"]
    sock.close()


def test_a_full_shared_memory_is_an_error_not_a_crash(tmp_path):
    import subprocess

    from perseus.base.elastic_shm import SharedArena

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        arena = SharedArena(str(mount / "job"))
        small = arena.allocate((1000,), np.float32)
        small[:] = 1
        with pytest.raises(OSError):
            arena.allocate((1 << 20,), np.float32)  # 4 MB in a 1 MB file system
        assert sorted(os.listdir(mount / "job")) == [os.path.basename(arena.locate(small)[0])]
    finally:
        del small, arena
        subprocess.run(["umount", "-l", str(mount)])
