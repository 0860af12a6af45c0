"""What each Spark task of a :mod:`perseus.spark` job runs (inside Spark's Python worker on an executor).

The task starts a :class:`~perseus.runner.remote.service.NodeService` on its address towards the driver,
connects to the driver's registry (:mod:`perseus.spark.driver`), proves it belongs to the job with the job's
token, says where it runs (partition, attempt, host name, address, service port), and
then waits: ``mpirun`` may start its daemon through the service meanwhile. The task returns when the driver
says the job is over or its connection to the driver drops (the driver ended, or its machine went away: TCP
keepalive notices within about a minute); either way its service is closed first, which ends whatever it
still runs. The task therefore never outlives its driver's job.

Frames (:mod:`perseus.runner.run_frames`): task -> driver: the token (the hello), then one JSON object;
driver -> task: ``b"end"`` (or the connection closes).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Iterator

from perseus.runner.handshake import address_towards
from perseus.runner.remote.service import NodeService
from perseus.runner.run_frames import recv_frame, send_frame

__all__ = ["TaskConfig", "run_task"]

_CONNECT_TRIES_S = 30.0


class TaskConfig:
    """What a task needs to join its job: the driver's registry ``host:port``, the job's token (also the
    services' token) and whether the stage runs in barrier mode. Pickled by Spark with the task."""

    def __init__(self, registry: str, token: str, barrier: bool):
        self.registry, self.token, self.barrier = registry, token, barrier


def _context(barrier: bool):
    from pyspark import BarrierTaskContext, TaskContext

    ctx = BarrierTaskContext.get() if barrier else TaskContext.get()
    return ctx.partitionId(), ctx.attemptNumber()


def _keepalive(sock: socket.socket) -> None:
    """Notice a driver whose machine vanished (no FIN ever comes) within about a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _connect(host: str, port: int, index: int) -> socket.socket:
    """Connect to the driver's registry, retrying for a while (the driver may be busy).

    Raises:
        RuntimeError: it cannot be reached (the message names the task and the address).
    """
    deadline = time.monotonic() + _CONNECT_TRIES_S
    while True:
        try:
            return socket.create_connection((host, port), timeout=10.0)
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"perseus.spark: Spark task {index} on {socket.gethostname()} cannot reach the "
                                   f"driver at {host}:{port} ({exc}); is the driver's address reachable from the "
                                   f"executors (spark.driver.host, or pass nics=)?") from None
            time.sleep(0.5)


def run_task(config: TaskConfig, _rows: Iterator) -> Iterator[dict]:
    """The body of one Spark task (``mapPartitions``): join the job, serve it until the driver ends it.

    Yields one dict (partition, attempt, host) once the task has ended cleanly.

    Raises:
        RuntimeError: the driver cannot be reached (Spark then reports the task failed). A task the driver
            refuses or no longer needs returns at once.
    """
    index, attempt = _context(config.barrier)
    host, _, port = config.registry.rpartition(":")
    ip = address_towards(host) or socket.gethostbyname(socket.gethostname())
    service = NodeService(config.token, ip)
    try:
        sock = _connect(host, int(port), index)
        with sock:
            info = {"index": index, "attempt": attempt, "hostname": socket.gethostname(), "ip": ip,
                    "service": f"{ip}:{service.port}", "pid": os.getpid()}
            try:
                send_frame(sock, config.token.encode())
                send_frame(sock, json.dumps(info).encode())
            except OSError as exc:
                raise RuntimeError(f"perseus.spark: Spark task {index} could not register with the driver at "
                                   f"{config.registry} ({exc})") from None
            sock.settimeout(None)
            _keepalive(sock)
            try:
                recv_frame(sock, limit=64)  # "end"; the job runs meanwhile
            except (OSError, ConnectionError, ValueError):
                pass  # the driver is gone: so is its job
    finally:
        service.close()
    yield {"index": index, "attempt": attempt, "hostname": socket.gethostname()}
