"""The launcher's listening sockets against clients that are not the job's: the checkpoint keepers, the elastic
driver's rank server and perseus.run's function service (perseus/runner/handshake.py does their handshakes).

For each server: a client without the job's token (none, a wrong one, garbage, a huge length prefix, a first
message that is not a hello) is closed at once; clients that send nothing or a byte at a time are closed at
their handshake deadline and delay no real client meanwhile; the handshakes in progress are bounded in number
and in memory; the servers listen on the address the ranks are told (127.0.0.1 for a job on this machine),
never on every interface. The times measured are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from proc_sockets import listening_sockets

from perseus.base import elastic_protocol as protocol
from perseus.runner import handshake, run_func
from perseus.runner.elastic.discovery import Blacklist, HostDiscovery
from perseus.runner.elastic.driver import ElasticDriver
from perseus.runner.elastic.keeper import listen_addresses, serve
from perseus.runner.elastic.keeper_process import start_keeper
from perseus.runner.elastic.ranks import RankServer
from perseus.runner.run_frames import recv_frame, send_frame

pytestmark = pytest.mark.timeout(120)

TOKEN = "5ecret0123456789abcdef0123456789"
LEN = struct.Struct(">Q")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SILENT = 50            # silent connections held open while a real client connects
REAL_CLIENT_BOUND_S = 1.0


# ----------------------------------------------------------------------------- what a process listens on

def listening(pid: int, port: int | None = None) -> set[str]:
    """The local addresses of the listening TCP sockets of process ``pid`` (on ``port``); IPv6 ones as
    ``tcp6:<hex>`` (none is expected)."""
    return {address for address, p in listening_sockets(pid) if port is None or p == port}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None."""
    for _, name in socket.if_nameindex():
        address = run_func._interface_address(name)
        if address and not address.startswith("127."):
            return address
    return None


def need_non_loopback() -> str:
    address = non_loopback_address()
    if address is None:
        why = "this machine has no IPv4 address but loopback: the address choice across hosts cannot be checked"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return address


# ----------------------------------------------------------------------------- the servers under test

def json_hello(token: str, **extra) -> bytes:
    body = json.dumps({"op": "hello", "token": token, **extra}).encode()
    return LEN.pack(len(body)) + body


class Target:
    """One server: its port, the hello of a real client, and ``real()`` (a real client's whole exchange,
    asserting it was served)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.closers = []
        if kind == "keeper":
            server = serve(["127.0.0.1"], 0, TOKEN, hello_deadline_s=1.5)
            self.server, self.port = server, server.port
            self.closers.append(server.close)
        elif kind == "ranks":
            server = RankServer(TOKEN, bind="127.0.0.1", hello_deadline_s=1.5)
            self.server, self.port = server._server, server.port
            self.ranks = server
            self.closers.append(server.close)
        else:
            server = run_func._Server("127.0.0.1", b"the payload", TOKEN, 1, hello_deadline_s=1.5)
            self.server, self.port = server._server, server.port
            self.run_server = server
            self.closers.append(server.close)

    def hello(self, token: str = TOKEN) -> bytes:
        if self.kind == "run":
            return LEN.pack(len(token)) + token.encode()
        return json_hello(token, rank=0, size=1, generation=0, host="localhost", pid=os.getpid())

    def real(self, rank: int = 0) -> float:
        """Seconds from connecting until the server answered the real client (its request served)."""
        start = time.monotonic()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        try:
            sock.sendall(self.hello())
            if self.kind == "keeper":
                assert protocol.recv_msg(sock)[0] == {"op": "ok"}
                protocol.send_msg(sock, {"op": "list"})
                assert protocol.recv_msg(sock)[0]["op"] == "list"
            elif self.kind == "ranks":
                event = self._next_event()
                assert event.kind == "hello" and event.link.rank == 0
                protocol.send_msg(sock, {"op": "exit", "reason": "done", "detail": ""})
                event = self._next_event()
                assert event.kind == "message" and event.header["op"] == "exit", event
            else:
                assert recv_frame(sock) == b"the payload"
                send_frame(sock, pickle.dumps((rank, True, rank * 10, None, 0, 1)))
            return time.monotonic() - start
        finally:
            sock.close()

    def _next_event(self):
        """The rank server's next event but the drops of earlier real clients' connections, which the server may
        see closed only after this client's first message (a busy machine makes that likely)."""
        event = self.ranks.events.get(timeout=10)
        while event.kind == "drop":
            event = self.ranks.events.get(timeout=10)
        return event

    def close(self):
        for close in self.closers:
            close()


@pytest.fixture(params=["keeper", "ranks", "run"])
def target(request):
    t = Target(request.param)
    yield t
    t.close()


def closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """(seconds until the server closed ``sock``, what it sent first); fails if it stays open ``limit`` s."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"the server kept a stranger's connection open for {limit} s")
    return time.monotonic() - start, got


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes (it may close the connection before reading it all)."""
    try:
        sock.sendall(data)
    except OSError:
        pass


class Drip:
    """Clients that send ``data`` one byte every ``interval`` seconds until stopped or closed."""

    def __init__(self, port: int, data: bytes, count: int, interval: float):
        self.socks = [connect(port) for _ in range(count)]
        self.stop = threading.Event()
        self.closed_at: dict[int, float] = {}
        self.start = time.monotonic()
        self.threads = [threading.Thread(target=self._run, args=(i, s, data, interval), daemon=True)
                        for i, s in enumerate(self.socks)]
        for t in self.threads:
            t.start()

    def _run(self, i, sock, data, interval):
        for byte in data:
            if self.stop.wait(interval):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                self.closed_at[i] = time.monotonic() - self.start
                return

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for s in self.socks:
            s.close()


# ----------------------------------------------------------------------------- refusal

STRANGERS = {
    "wrong token": lambda t: t.hello("not-" + TOKEN[4:]),
    "no token": lambda t: LEN.pack(14) + b'{"op":"hello"}' if t.kind != "run" else LEN.pack(0),
    "garbage": lambda t: os.urandom(4096),
    "huge length": lambda t: LEN.pack(1 << 62) + b"x" * 64,
    "length just over the limit": lambda t: LEN.pack(t.server.hello_limit + 1) + b"y" * 64,
    "not a hello": lambda t: (LEN.pack(17) + b'{"op":"list"}    ') if t.kind != "run" else LEN.pack(3) + b"abc",
    "garbage of a valid length": lambda t: LEN.pack(40) + os.urandom(40),
}


@pytest.mark.parametrize("stranger", sorted(STRANGERS))
def test_a_client_without_the_token_is_refused_and_the_job_goes_on(target, stranger):
    sock = connect(target.port)
    send_quietly(sock, STRANGERS[stranger](target))
    took, reply = closed_after(sock, 5.0)
    sock.close()
    assert took < 1.0, f"{stranger}: closed after {took:.2f} s"
    if target.kind == "keeper" and stranger in ("wrong token", "no token", "not a hello", "garbage of a valid length"):
        (n,) = LEN.unpack(reply[:8])
        answer = json.loads(reply[8:8 + n])
        assert answer["op"] == "error" and "token" in answer["detail"]
    else:
        assert reply == b""
    assert target.server.counts["refused"] == 1 and target.server.counts["served"] == 0
    assert target.real() < REAL_CLIENT_BOUND_S
    assert target.server.counts["served"] == 1
    print(f"\n{target.kind} / {stranger}: refused after {took * 1e3:.1f} ms")


def test_tokens_are_compared_in_constant_time_and_only_as_strings():
    assert handshake.same_secret(TOKEN, TOKEN)
    for given in (TOKEN[:-1], TOKEN + "0", None, 0, [TOKEN], {"t": TOKEN}, "\ud800", ""):
        assert not handshake.same_secret(given, TOKEN)
    with pytest.raises(handshake.Refused, match="token"):
        handshake.json_hello(json.dumps({"op": "hello", "token": ["x"]}).encode(), TOKEN)
    with pytest.raises(handshake.Refused, match="not a hello"):
        handshake.json_hello(json.dumps({"op": "hello", "token": TOKEN, "nbytes": [1 << 40]}).encode(), TOKEN)


# ----------------------------------------------------------------------------- slow clients

def test_silent_dripping_and_garbage_clients_delay_no_real_client(target):
    silent = [connect(target.port) for _ in range(SILENT)]
    drip = Drip(target.port, target.hello(), 5, 0.2)  # a real hello, a byte every 0.2 s: never in time
    garbage = []
    for _ in range(5):
        g = connect(target.port)
        g.sendall(LEN.pack(200) + os.urandom(100))  # half a hello, then nothing
        garbage.append(g)
    try:
        time.sleep(0.2)
        took = [target.real(rank=0) for _ in range(1 if target.kind == "run" else 3)]
        assert max(took) < REAL_CLIENT_BOUND_S, took
        print(f"\n{target.kind}: a real client served in {max(took) * 1e3:.1f} ms (worst of {len(took)}) while "
              f"{SILENT} silent, 5 dripping and 5 half-hello connections are open")
        # and every one of them is closed at its deadline (1.5 s after it was accepted)
        late = [closed_after(s, 6.0)[0] for s in silent + garbage]
        assert max(late) < 4.0, max(late)
        deadline = time.monotonic() + 6.0
        while len(drip.closed_at) < len(drip.socks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(drip.closed_at) == len(drip.socks), "a dripping client outlived its handshake deadline"
        assert max(drip.closed_at.values()) < 4.5, drip.closed_at
        assert target.server.counts["timed_out"] == SILENT + 10 and target.server.pending() == 0
        print(f"{target.kind}: silent clients closed within {max(late):.2f} s, dripping ones within "
              f"{max(drip.closed_at.values()):.2f} s (deadline 1.5 s)")
    finally:
        drip.close()
        for s in silent + garbage:
            s.close()


def test_handshakes_in_progress_are_bounded():
    served = []
    server = handshake.HelloServer(["127.0.0.1"], lambda body: body, lambda sock, hello: served.append(hello),
                                   max_pending=8, deadline_s=30.0, hello_limit=64)
    socks = []
    try:
        for _ in range(40):
            socks.append(connect(server.port))
        deadline = time.monotonic() + 5
        while server.counts["evicted"] < 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.counts["evicted"] == 32 and server.pending() == 8
        start = time.monotonic()
        real = connect(server.port)
        real.sendall(LEN.pack(4) + b"mine")
        while not served and time.monotonic() - start < 5:
            time.sleep(0.001)
        took = time.monotonic() - start
        real.close()
        assert served == [b"mine"] and took < REAL_CLIENT_BOUND_S
        assert server.pending() <= 8
        print(f"\n40 silent clients against 8 handshake slots: 32 closed as the oldest, a real client served in "
              f"{took * 1e3:.1f} ms")
    finally:
        server.close()
        for s in socks:
            s.close()


def test_huge_lengths_and_garbage_allocate_nothing_in_a_keeper_process():
    keeper = start_keeper("localhost", TOKEN, local=True)
    try:
        before = rss_kib(keeper.proc.pid)
        for _ in range(3):
            socks = []
            for length in (1 << 62, 1 << 40, 1 << 31, 8 << 20, (16 << 10) + 1):
                s = connect(keeper.port)
                send_quietly(s, LEN.pack(length) + os.urandom(4096))
                socks.append(s)
            for _ in range(20):
                s = connect(keeper.port)
                send_quietly(s, os.urandom(65536))
                socks.append(s)
            for s in socks:
                closed_after(s, 5.0)
                s.close()
        grew = rss_kib(keeper.proc.pid) - before
        assert grew < 4096, f"the keeper grew by {grew} KiB"
        sock = connect(keeper.port)
        sock.sendall(json_hello(TOKEN))
        assert protocol.recv_msg(sock)[0] == {"op": "ok"}
        sock.close()
        print(f"\nkeeper: 75 garbage / huge-length connections, RSS grew {grew} KiB")
    finally:
        keeper.stop()


def test_a_real_client_of_a_keeper_process_is_served_while_strangers_hold_connections():
    keeper = start_keeper("localhost", TOKEN, local=True)
    silent = [connect(keeper.port) for _ in range(SILENT)]
    try:
        start = time.monotonic()
        sock = connect(keeper.port)
        sock.sendall(json_hello(TOKEN))
        assert protocol.recv_msg(sock)[0] == {"op": "ok"}
        took = time.monotonic() - start
        sock.close()
        assert took < REAL_CLIENT_BOUND_S
        print(f"\nkeeper process: a real client served in {took * 1e3:.1f} ms with {SILENT} silent connections open")
    finally:
        for s in silent:
            s.close()
        keeper.stop()


# ----------------------------------------------------------------------------- where they listen

def test_a_local_keeper_listens_on_loopback_only():
    keeper = start_keeper("localhost", TOKEN, local=True, toward="127.0.0.1")
    try:
        assert listening(keeper.proc.pid) == {"127.0.0.1"}
    finally:
        keeper.stop()
    assert listen_addresses("localhost", "") == ["127.0.0.1"]
    assert listen_addresses("localhost", "127.0.0.1") == ["127.0.0.1"]
    assert listen_addresses("no-such-host.invalid", "") == []


def test_a_keeper_listens_where_its_host_name_resolves_and_towards_the_driver():
    address = need_non_loopback()
    # named by its cluster address, launched from a driver on this machine's loopback
    keeper = start_keeper(address, TOKEN, local=True, toward="127.0.0.1")
    try:
        assert listening(keeper.proc.pid) == {address, "127.0.0.1"}
        for where in (address, "127.0.0.1"):
            sock = socket.create_connection((where, keeper.port), timeout=5)
            sock.sendall(json_hello(TOKEN))
            assert protocol.recv_msg(sock)[0] == {"op": "ok"}
            sock.close()
    finally:
        keeper.stop()
    # a host named by a name of loopback, whose driver is reached over the cluster network
    assert listen_addresses("localhost", address) == ["127.0.0.1", address]


def test_a_keeper_without_an_address_to_listen_on_says_so():
    with pytest.raises(RuntimeError, match="no address of this machine to listen on"):
        start_keeper("no-such-host.invalid", TOKEN, local=True, timeout=10.0)


FAKE_RANK = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    from perseus.base import elastic_protocol as protocol
    addr, _, port = os.environ["PERSEUS_ELASTIC_DRIVER"].rpartition(":")
    s = protocol.connect(addr, int(port), 5)
    protocol.send_msg(s, dict(op="hello", token=os.environ["PERSEUS_ELASTIC_TOKEN"], rank=int(sys.argv[1]),
                              size=2, generation=int(os.environ["PERSEUS_ELASTIC_GENERATION"]), host="localhost",
                              pid=os.getpid()))
    protocol.send_msg(s, dict(op="exit", reason="done", detail=""))
    protocol.send_msg(s, dict(op="bye"))
""")


def test_the_elastic_driver_listens_on_its_address_and_strangers_do_not_delay_the_ranks(tmp_path):
    code = tmp_path / "rank.py"
    code.write_text(FAKE_RANK.format(repo=REPO))
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    seen: dict = {}
    strangers: list[socket.socket] = []

    def start(hosts, np_, env):
        address, _, port = env["PERSEUS_ELASTIC_DRIVER"].rpartition(":")
        seen["driver"] = (address, listening(os.getpid(), int(port)))
        keeper_host, _, keeper_port = env["PERSEUS_ELASTIC_KEEPERS"].partition("=")[2].rpartition(":")
        seen["keeper"] = (keeper_host, listening(driver.keepers["localhost"].proc.pid, int(keeper_port)))
        for _ in range(SILENT):
            strangers.append(connect(int(port)))
        for data in (json_hello("wrong"), os.urandom(1000), LEN.pack(1 << 60)):
            s = connect(int(port))
            send_quietly(s, data)
            strangers.append(s)
        seen["launched"] = time.monotonic()
        cmd = " & ".join(f"{sys.executable} {code} {r}" for r in range(np_)) + " & wait"
        return subprocess.Popen(["sh", "-c", cmd], env={**os.environ, **env}, start_new_session=True)

    driver = ElasticDriver(start=start, discovery=HostDiscovery(str(discover)), np_=2, min_np=1, max_np=None,
                           reset_limit=None, blacklist=Blacklist(), elastic_timeout=5.0, heartbeat_timeout=10.0,
                           in_process=False,
                           start_keeper=lambda host, token, toward: start_keeper(host, token, local=True,
                                                                                 toward=toward))
    try:
        assert driver.run() == 0
    finally:
        for s in strangers:
            s.close()
    took = time.monotonic() - seen["launched"]
    assert seen["driver"] == ("127.0.0.1", {"127.0.0.1"})
    assert seen["keeper"] == ("localhost", {"127.0.0.1"})
    assert driver.server.counts["refused"] == 3 and driver.server.counts["served"] == 2
    assert took < 10.0
    print(f"\nelastic driver: 2 ranks finished {took:.2f} s after launch with {SILENT} silent and 3 refused "
          f"strangers connected (each rank is a new Python process)")


@pytest.mark.parametrize("where", ["local", "cluster"])
def test_perseus_run_listens_where_the_ranks_connect(monkeypatch, where):
    address = "127.0.0.1" if where == "local" else need_non_loopback()
    if where == "cluster":
        monkeypatch.setattr(run_func, "_address_towards", lambda hosts, nic, may_grow=False: address)
    seen = {}

    def fake_launch(argv, env_extra):
        host, port = argv[-2], int(argv[-1])
        seen["address"], seen["listening"] = host, listening(os.getpid(), port)
        strangers = [socket.create_connection((host, port), timeout=5) for _ in range(SILENT)]
        try:
            start = time.monotonic()
            sock = socket.create_connection((host, port), timeout=5)
            send_frame(sock, env_extra["PERSEUS_RUN_TOKEN"].encode())
            func, args, kwargs = pickle.loads(recv_frame(sock))
            seen["served_s"] = time.monotonic() - start
            send_frame(sock, pickle.dumps((0, True, func(*args, **kwargs), None, 0, 1)))
            sock.close()
        finally:
            for s in strangers:
                s.close()
        return 0

    monkeypatch.setattr(run_func.launch, "main", fake_launch)
    assert run_func.run(lambda x: x + 1, args=(41,), num_proc=1) == [42]
    assert seen["address"] == address and seen["listening"] == {address}
    assert seen["served_s"] < REAL_CLIENT_BOUND_S
    print(f"\nperseus.run ({where}, {address}): the rank got its function {seen['served_s'] * 1e3:.1f} ms after "
          f"connecting, {SILENT} silent connections open")


OUT_OF_FDS = textwrap.dedent("""
    import os, resource, sys, time
    sys.path.insert(0, {repo!r})
    from perseus.runner.handshake import HelloServer
    served = []
    server = HelloServer(["127.0.0.1"], lambda body: body, lambda sock, hello: (served.append(hello), sock.close()),
                         deadline_s=1.0)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 10, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(server.port, flush=True)
    while not served:
        time.sleep(0.01)
    print("served", served[0].decode(), server.counts["timed_out"], flush=True)
""")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_server_out_of_file_descriptors_does_not_spin_and_recovers(tmp_path):
    code = tmp_path / "server.py"
    code.write_text(OUT_OF_FDS.format(repo=REPO))
    proc = subprocess.Popen([sys.executable, str(code)], stdout=subprocess.PIPE, text=True)
    silent = []
    try:
        port = int(proc.stdout.readline())
        silent = [connect(port) for _ in range(40)]  # more than its descriptors: accept fails (EMFILE)
        before = cpu_seconds(proc.pid)
        time.sleep(0.8)
        spent = cpu_seconds(proc.pid) - before
        assert spent < 0.2, f"{spent:.2f} s of CPU in 0.8 s while accept failed"
        for s in silent:  # their handshakes expire, the descriptors come back, the backlog is accepted
            s.close()
        real = connect(port)
        real.sendall(LEN.pack(4) + b"mine")
        line = proc.stdout.readline().split()
        real.close()
        assert line[:2] == ["served", "mine"], line
        print(f"\nout of descriptors: {spent:.2f} s of CPU in 0.8 s; a real client served afterwards")
    finally:
        proc.kill()
        proc.wait()
        for s in silent:
            s.close()
