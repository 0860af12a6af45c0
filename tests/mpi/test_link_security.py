"""A channel's own TCP connections (native/links.cc) against connections that are not the job's.

Every rank runs a second engine whose ranks count as separate hosts (each its own host key), so that its two
channels connect over links on loopback. Each rank then finds its links' listening sockets (in /proc), the
ranks share their ports, and every rank attacks every listener: connections that send nothing, a hello with a
wrong session, a hello one byte at a time, a part of a hello, random bytes. The collectives must still
complete promptly and correctly, first while the links are being set up (the real peers connect through the
crowd), then while they are in use. Run at 2 and 3 ranks (the ring then connects every pair, so every
listener has done its work and must be closed).
"""

import os
import random
import socket
import struct
import threading
import time
import types

import numpy as np
import pytest
from proc_sockets import listening_sockets

from conftest import rank_data

pytestmark = pytest.mark.timeout(240)

MAGIC = 0x7065726C               # native/links.cc kMagic
HELLO = struct.Struct("<IiiIQ")  # magic, from, to, pad, session
SILENT = 50                      # silent connections per rank and listener
BOUND_S = 3.0                    # the first collective, which opens the links, must finish within this
LINK_TIMEOUT_S = 30.0
CHANNELS = 2
N = 70000                        # float32 elements per tensor: 280 kB, a unit of its own (ring over the links)


def listening(pid: int) -> set:
    """``(address, port)`` of the listening IPv4 TCP sockets that process ``pid`` holds."""
    return {(a, p) for a, p in listening_sockets(pid) if not a.startswith("tcp6:")}


@pytest.fixture(scope="module")
def linked(hvd):
    """``(engine, every rank's link ports, the ports this process listened on before)``."""
    from mpi4py import MPI

    from perseus.runtime.state import runtime
    from perseus.engine.native import ENGINE_SETTINGS, Engine

    comm = MPI.COMM_WORLD
    before = listening(os.getpid())
    values = {name: getattr(runtime().settings, name) for name in ENGINE_SETTINGS}
    values.update(allreduce_algorithm="ring", num_channels=CHANNELS, network_interface="lo",
                  link_timeout_s=LINK_TIMEOUT_S, fusion_threshold_bytes=64 << 10, cycle_time_ms=0.0)
    engine = Engine(types.SimpleNamespace(**values), comm.Get_rank(), host_key=comm.Get_rank())
    engine.add_process_set(0, comm.Dup(), list(range(comm.Get_size())))
    engine.start()
    mine = sorted(listening(os.getpid()) - before)
    # with network_interface=lo a rank advertises one address, 127.0.0.1, and listens on it alone
    assert {address for address, _ in mine} <= {"127.0.0.1"}, mine
    yield engine, comm.allgather([port for _, port in mine]), before
    engine.shutdown()


def allreduce_many(engine, rank, size, seed, count=2 * CHANNELS):
    """``count`` ring all-reduces at once (every channel gets some); checks the sums; returns the seconds."""
    from perseus.engine.messages import OpType, Request, dtype_of

    start = time.monotonic()
    hids, outs = [], []
    for i in range(count):
        src = rank_data(rank, (N,), "float32", seed=seed + i)
        out = np.empty_like(src)
        item = Request(name=f"links.security.{seed}.{i}", dtype=dtype_of(out), shape=out.shape, input=src,
                       output=out, reduce_op=1)
        hids.append(engine.submit(0, OpType.ALLREDUCE, [item], None, (src, out)))
        outs.append(out)
    for hid in hids:
        engine.wait(hid, LINK_TIMEOUT_S + 30)
    took = time.monotonic() - start
    for i, out in enumerate(outs):
        want = sum(rank_data(r, (N,), "float32", seed=seed + i) for r in range(size))
        np.testing.assert_array_equal(out, want)
    return took


class Strangers:
    """Connections to every listener of ``ports`` (per rank) that are not the job's, kept open until close()."""

    def __init__(self, ports: list):
        self.socks, self.refused, self.stop = [], 0, threading.Event()
        self.threads = []
        rng = random.Random(os.getpid())
        for to, mine in enumerate(ports):
            for port in mine:
                for _ in range(SILENT):
                    self._open(port)
                for data in (HELLO.pack(MAGIC, 0, to, 0, rng.getrandbits(64)),   # a wrong session
                             HELLO.pack(MAGIC, 0, to, 0, rng.getrandbits(64))[:10],  # part of a hello
                             bytes(rng.getrandbits(8) for _ in range(HELLO.size)),  # random bytes
                             bytes(rng.getrandbits(8) for _ in range(1 << 16))):  # a lot of them
                    sock = self._open(port)
                    if sock is not None:
                        try:
                            sock.sendall(data)
                        except OSError:
                            pass
                drip = self._open(port)
                if drip is not None:
                    t = threading.Thread(target=self._drip, args=(drip, HELLO.pack(MAGIC, 0, to, 0, 12345)),
                                         daemon=True)
                    t.start()
                    self.threads.append(t)

    def _open(self, port):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            self.refused += 1
            return None
        self.socks.append(sock)
        return sock

    def _drip(self, sock, data):
        for byte in data:
            if self.stop.wait(0.5):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for sock in self.socks:
            sock.close()


def test_strangers_do_not_delay_links_being_set_up(hvd, linked):
    from mpi4py import MPI

    engine, ports, before = linked
    rank, size = hvd.rank(), hvd.size()
    # rank 0 accepts no connection (the lower rank of a pair connects), so it keeps no listener
    assert [len(p) for p in ports] == [0] + [CHANNELS] * (size - 1), ports
    strangers = Strangers(ports)
    try:
        MPI.COMM_WORLD.Barrier()
        took = allreduce_many(engine, rank, size, seed=1)
        worst = MPI.COMM_WORLD.allreduce(took, op=MPI.MAX)
        opened = MPI.COMM_WORLD.allreduce(len(strangers.socks), op=MPI.SUM)
        assert worst < BOUND_S, f"the first collective over the links took {worst:.2f} s"
        if rank == 0:
            print(f"\nlinks, {size} ranks: the first {2 * CHANNELS} all-reduces (opening the links) took "
                  f"{worst * 1e3:.0f} ms (worst rank) while {opened} stranger connections were made "
                  f"({SILENT} silent per rank and listener)")
        # every pair is connected now (a ring of 2 or 3 ranks): every listener has closed
        deadline = time.monotonic() + 5
        while listening(os.getpid()) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not listening(os.getpid()) - before, "a link's listener is still open after every peer connected"
    finally:
        strangers.close()
        MPI.COMM_WORLD.Barrier()


def test_strangers_do_not_disturb_links_in_use(hvd, linked):
    from mpi4py import MPI

    engine, ports, _ = linked
    rank, size = hvd.rank(), hvd.size()
    baseline = allreduce_many(engine, rank, size, seed=20)
    stop = threading.Event()
    made = []

    def keep_attacking():
        while not stop.is_set():
            s = Strangers(ports)
            made.append(len(s.socks) + s.refused)
            s.close()
            stop.wait(0.01)  # a stream of attempts, not a busy loop taking the cores from the ranks

    attacker = threading.Thread(target=keep_attacking, daemon=True)
    attacker.start()
    try:
        took = max(allreduce_many(engine, rank, size, seed=30 + k) for k in range(5))
    finally:
        stop.set()
        attacker.join(30)
    worst = MPI.COMM_WORLD.allreduce(took, op=MPI.MAX)
    base = MPI.COMM_WORLD.allreduce(baseline, op=MPI.MAX)
    assert worst < BOUND_S, f"all-reduces over links in use took {worst:.2f} s while strangers connected"
    if rank == 0:
        print(f"\nlinks in use, {size} ranks: {2 * CHANNELS} all-reduces took {base * 1e3:.0f} ms undisturbed, "
              f"{worst * 1e3:.0f} ms at worst while strangers kept connecting ({sum(made)} attempts by rank 0)")
