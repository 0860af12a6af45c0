"""The elastic driver's server for its ranks: every rank of every generation connects, says ``hello`` with the
job's token, sends a heartbeat every second and reports how it leaves; the driver sends host-change
notifications and aborts back on the same connection.

Everything a rank sends arrives as an :class:`Event` on one queue that the driver's loop drains, so the
driver's state is only ever touched by its own thread.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from perseus.base import elastic_protocol as protocol
from perseus.runner.handshake import HelloServer, json_hello

__all__ = ["RankLink", "Event", "RankServer"]

log = logging.getLogger("perseus.elastic")


@dataclass(eq=False)
class RankLink:
    """One rank's connection, as the driver sees it."""

    sock: socket.socket
    rank: int = -1
    size: int = 0
    generation: int = -1
    host: str = "?"
    pid: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    exit_reason: Optional[str] = None   # done | error | reset | terminated, once the rank said so
    exit_detail: str = ""
    connected: bool = True
    bye: bool = False                   # the process is exiting (its interpreter is shutting down)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __str__(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) on {self.host}"


@dataclass
class Event:
    """``kind`` is ``"hello"``, ``"message"`` (``header`` set) or ``"drop"`` (the connection closed)."""

    kind: str
    link: RankLink
    header: dict = field(default_factory=dict)


class RankServer:
    """Accepts the ranks' connections on ``bind`` (comma-separated addresses; any free port, the same on each);
    events go to :attr:`events`. A connection must send a hello with the job's token within
    ``hello_deadline_s`` (:class:`perseus.runner.handshake.HelloServer`: the handshakes run on a thread of
    their own, so a client that sends nothing, a trickle or garbage delays no rank); one without it is closed.

    Raises:
        OSError: an address of ``bind`` cannot be bound.
    """

    def __init__(self, token: str, bind: str = "127.0.0.1", hello_deadline_s: float = 15.0):
        self.token = token
        self.events: "queue.Queue[Event]" = queue.Queue()
        self._server = HelloServer([a for a in bind.split(",") if a], self._check, self._serve,
                                   name="perseusrun elastic", deadline_s=hello_deadline_s)
        self.port = self._server.port

    @property
    def counts(self) -> dict:
        """Connections served, refused, timed out in their handshake... (see HelloServer.counts)."""
        return self._server.counts

    def _check(self, body: bytes) -> dict:
        return json_hello(body, self.token)

    def _serve(self, sock: socket.socket, header: dict) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = RankLink(sock)
        try:
            link.rank, link.size = int(header.get("rank", -1)), int(header.get("size", 0))
            link.generation, link.host = int(header.get("generation", -1)), str(header.get("host", "?"))
            link.pid = int(header.get("pid", 0))
        except (TypeError, ValueError):
            log.warning("perseusrun: elastic: a hello with the job's token but unreadable fields was refused")
            sock.close()
            return
        self.events.put(Event("hello", link, header))
        while True:
            try:
                header, _ = protocol.recv_msg(sock)
            except (OSError, protocol.WireError):
                break
            link.last_seen = time.monotonic()
            if header.get("op") != "heartbeat":
                self.events.put(Event("message", link, header))
        link.connected = False
        self.events.put(Event("drop", link))
        try:
            sock.close()
        except OSError:
            pass

    def send(self, link: RankLink, header: dict) -> bool:
        """Send ``header`` to one rank; False if its connection is gone."""
        with link.lock:
            try:  # small messages: the kernel's buffer takes them even from a stopped rank
                protocol.send_msg(link.sock, header)
                return True
            except OSError:
                return False

    def close(self) -> None:
        """Stop accepting connections (those of the ranks stay open until they close)."""
        self._server.close()
