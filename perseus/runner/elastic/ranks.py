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

from perseus.elastic import protocol

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
    """Accepts the ranks' connections on ``bind`` (any free port); events go to :attr:`events`."""

    def __init__(self, token: str, bind: str = "0.0.0.0"):
        self.token = token
        self.events: "queue.Queue[Event]" = queue.Queue()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="perseusrun-elastic-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="perseusrun-elastic-rank", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(15.0)
        link = RankLink(sock)
        try:
            header, _ = protocol.recv_msg(sock)
        except (OSError, protocol.WireError):
            sock.close()
            return
        if header.get("op") != "hello" or header.get("token") != self.token:
            log.warning("perseusrun: elastic: a connection without the job's token was refused")
            sock.close()
            return
        link.rank, link.size = int(header.get("rank", -1)), int(header.get("size", 0))
        link.generation, link.host = int(header.get("generation", -1)), str(header.get("host", "?"))
        link.pid = int(header.get("pid", 0))
        sock.settimeout(None)
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
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
