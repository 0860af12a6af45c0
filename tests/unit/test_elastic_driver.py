"""Unit tests for the elastic launcher's pieces that need no cluster: the discovery script's output, the
blacklist with its cool-down, the choice of a generation's hosts, and the driver against a fake mpirun."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from perseus.base import elastic_protocol as protocol
from perseus.runner import run_func
from perseus.runner.elastic.discovery import (Blacklist, DiscoveryError, FixedHosts, HostDiscovery,
                                              parse_discovery_output)
from perseus.runner.elastic.driver import ElasticDriver, JobFailed
from perseus.runner.hosts import HostSlots

pytestmark = pytest.mark.timeout(60)


def test_discovery_lines():
    assert parse_discovery_output("a:2\nb\n\n# c:9\nd:4  # comment\n", None) == [
        HostSlots("a", 2), HostSlots("b", 1), HostSlots("d", 4)]
    assert parse_discovery_output("a:8\nb\n", 2) == [HostSlots("a", 2), HostSlots("b", 2)]
    assert parse_discovery_output("a:1\na:3\n", None) == [HostSlots("a", 1)]
    assert parse_discovery_output("", None) == []


@pytest.mark.parametrize("text", ["a:0\n", "a b\n", "a:x\n", "this is :: not a host line\n", "a:1:2\n"])
def test_discovery_garbage_is_named(text):
    with pytest.raises(DiscoveryError, match="is not a host line"):
        parse_discovery_output(text, None)


def script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_discovery_script_failures_say_why(tmp_path):
    d = HostDiscovery(script(tmp_path, "echo backend unavailable >&2; exit 3\n"))
    with pytest.raises(DiscoveryError, match="exited with status 3: backend unavailable"):
        d.run()
    assert d.last is None
    d = HostDiscovery(script(tmp_path, "sleep 5\n"), timeout=0.5)
    with pytest.raises(DiscoveryError, match="did not finish within 0.5 s"):
        d.run()
    d = HostDiscovery(script(tmp_path, "echo a:2; echo b:1\n"))
    assert d.run() == [HostSlots("a", 2), HostSlots("b", 1)] == d.last


def test_blacklist_forever_and_with_cooldown():
    now = [0.0]
    forever = Blacklist(None, clock=lambda: now[0])
    assert forever.add("a") == float("inf")
    now[0] = 1e9
    assert forever.blocked("a") and not forever.blocked("b")
    cool = Blacklist((2.0, 4.0), clock=lambda: now[0])
    first = cool.add("a")
    assert 2.0 <= first <= 4.0 and cool.blocked("a")
    now[0] += first + 0.01
    assert not cool.blocked("a")
    assert cool.add("a") <= 4.0 and cool.failures("a") == 2
    assert cool.usable([HostSlots("a", 1), HostSlots("b", 1)]) == [HostSlots("b", 1)]
    with pytest.raises(ValueError, match="LO <= HI"):
        Blacklist((5, 1))


def make_driver(tmp_path, hosts="a:1\nb:1\n", **kw):
    args = dict(start=None, discovery=HostDiscovery(script(tmp_path, f"printf '{hosts}'\n")), np_=2, min_np=1,
                max_np=None, reset_limit=None, blacklist=Blacklist(), elastic_timeout=2.0, heartbeat_timeout=5.0,
                in_process=False, driver_address="127.0.0.1")
    args.update(kw)
    return ElasticDriver(**args)


def test_choose_keeps_previous_hosts_first_and_caps_max_np(tmp_path):
    d = make_driver(tmp_path, max_np=3)
    usable = [HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 2)]
    assert d._choose(usable, [HostSlots("c", 2)]) == [HostSlots("c", 2), HostSlots("a", 1)]
    d.max_np = None
    assert d._choose(usable, []) == usable


def test_too_few_hosts_fails_naming_min_np(tmp_path):
    d = make_driver(tmp_path, hosts="a:1\n", np_=2, min_np=2, elastic_timeout=1.0)
    d._discovered = [HostSlots("a", 1)]
    with pytest.raises(JobFailed, match="fewer than --min-np 2"):
        d._wait_for_hosts(2, [])
    d._discovered = None
    d._discovery_error = "exited with status 1: down"
    with pytest.raises(JobFailed, match="host discovery unavailable .*down"):
        d._wait_for_hosts(2, [])


FAKE_RANK = textwrap.dedent("""
    import os, socket, sys, time
    sys.path.insert(0, {repo!r})
    from perseus.base import elastic_protocol as protocol
    addr, _, port = os.environ["PERSEUS_ELASTIC_DRIVER"].rpartition(":")
    s = protocol.connect(addr, int(port), 5)
    rank = int(sys.argv[1])
    protocol.send_msg(s, dict(op="hello", token=os.environ["PERSEUS_ELASTIC_TOKEN"], rank=rank, size=2,
                          generation=int(os.environ["PERSEUS_ELASTIC_GENERATION"]), host="localhost",
                          pid=os.getpid()))
    mode = os.environ["FAKE_MODE"]
    if mode == "error" and rank == 1:
        protocol.send_msg(s, dict(op="exit", reason="error", detail="ValueError: boom"))
        time.sleep(30)
    protocol.send_msg(s, dict(op="heartbeat"))
    protocol.send_msg(s, dict(op="exit", reason="done", detail=""))
    protocol.send_msg(s, dict(op="bye"))
""")


def fake_start(tmp_path, mode):
    code = tmp_path / "rank.py"
    code.write_text(FAKE_RANK.format(repo=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

    def start(hosts, np_, env):
        cmd = " & ".join(f"{sys.executable} {code} {r}" for r in range(np_)) + " & wait"
        return subprocess.Popen(["sh", "-c", cmd], env={**os.environ, **env, "FAKE_MODE": mode},
                                start_new_session=True)
    return start


def test_driver_finishes_when_every_rank_is_done(tmp_path, capsys):
    d = make_driver(tmp_path, start=fake_start(tmp_path, "done"))
    assert d.run() == 0
    assert "the job finished after 0 re-form(s)" in capsys.readouterr().err


def test_driver_stops_on_an_error_in_the_training_code(tmp_path, capsys):
    d = make_driver(tmp_path, start=fake_start(tmp_path, "error"))
    assert d.run() == 1
    err = capsys.readouterr().err
    assert "rank 1 on localhost raised ValueError: boom" in err and "not retried" in err


def test_wrong_token_is_refused(tmp_path):
    from perseus.runner.elastic.ranks import RankServer

    server = RankServer("secret", bind="127.0.0.1")
    try:
        sock = protocol.connect("127.0.0.1", server.port, 5)
        protocol.send_msg(sock, {"op": "hello", "token": "guess", "rank": 0})
        sock.settimeout(5)
        assert sock.recv(1) == b""  # closed
        assert server.events.empty()
    finally:
        server.close()


def test_fixed_hosts_stand_in_for_a_script():
    """``-H``/``--hostfile`` with elastic flags (horovodrun's fixed-host elastic mode): the same hosts every time,
    capped at ``--slots-per-host``."""
    fixed = FixedHosts([HostSlots("a", 4), HostSlots("b", 1)], slots_per_host=2)
    assert fixed.run() == [HostSlots("a", 2), HostSlots("b", 1)] == fixed.run()
    assert FixedHosts([HostSlots("a", 4)]).run() == [HostSlots("a", 4)]


def test_a_generation_without_init_that_exits_0_is_done(tmp_path, capsys):
    """Ranks that never call init() (a function returning its environment's rank) and all exit 0 finished the job;
    the same with a failing status is a launch failure."""
    for status, outcome in ((0, 0), (3, 1)):
        d = make_driver(tmp_path, hosts="localhost:2\n", np_=2, min_np=2,
                        start=lambda hosts, np_, env, status=status: subprocess.Popen(["sh", "-c", f"exit {status}"]))
        assert d.run() == outcome
    assert "before any rank of generation 0 reported" in capsys.readouterr().err


def test_run_keeps_the_newest_generations_replies():
    """perseus.run's server: replies of a later elastic generation replace those of earlier ones (whose ranks left
    for a re-form); a late reply of an earlier generation is dropped; the expected count is what the ranks said."""
    server = run_func._Server("127.0.0.1", b"payload", "token", 3)
    try:
        server._keep((0, True, "g0 r0", None, 0, 3))
        server._keep((1, True, "g1 r1", None, 1, 2))
        server._keep((2, True, "g0 r2", None, 0, 3))
        server._keep((0, True, "g1 r0", None, 1, 2))
        assert run_func._collect(server, 3, 0) == ["g1 r0", "g1 r1"]
        server._keep((0, True, "g2 r0", None, 2, 2))
        with pytest.raises(run_func.RunError, match="rank 1 returned no result"):
            run_func._collect(server, 3, 0)
    finally:
        server.close()


class _Sent:
    """Stands in for the driver's rank server: keeps what the driver sends."""

    def __init__(self):
        self.messages = []

    def send(self, link, header):
        self.messages.append((link.rank, header))


@pytest.mark.parametrize("order", ["survivors first", "death first"])
def test_a_rank_lost_below_min_np_is_blacklisted_whichever_the_driver_hears_first(tmp_path, order, capsys):
    """min_np 2, one rank of 2 dies: whether the survivor's "re-formed on 1 rank" or the dead rank's closed
    connection reaches the driver first, the dead rank's host is blacklisted (and the survivor's is not), so the
    next generation waits for hosts instead of starting on the failed one again."""
    from perseus.runner.elastic.generation import _Generation
    from perseus.runner.elastic.ranks import Event, RankLink

    d = make_driver(tmp_path, min_np=2, in_process=True)
    d.server = _Sent()
    gen = _Generation(0, [HostSlots("a", 1), HostSlots("b", 1)], proc=None)
    survivor = RankLink(sock=None, rank=0, size=2, generation=0, host="a")
    dead = RankLink(sock=None, rank=1, size=2, generation=0, host="b")
    for link in (survivor, dead):
        d._on_event(gen, Event("hello", link))
    reformed = Event("message", survivor, {"op": "recovered", "rank": 0, "size": 1, "episode": 1})
    events = [reformed, Event("drop", dead)] if order == "survivors first" else [Event("drop", dead), reformed]
    for event in events:
        d._on_event(gen, event)
    assert d.blacklist.blocked("b") and not d.blacklist.blocked("a")
    assert gen.leaving is not None
    d._on_event(gen, Event("drop", survivor))  # the survivor leaves as asked: not a failure
    assert not d.blacklist.blocked("a")
