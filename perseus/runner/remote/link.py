"""The worker's end of its rank's connection (see :mod:`perseus.runner.remote.rank`).

A :class:`RankEndpoint` listens on the worker's address for the one rank assigned to it, which must present
the job's token and its rank number. :meth:`RankEndpoint.call` sends one message and waits for the answer,
handing ``("log", info)`` messages that arrive meanwhile to a callback.
"""

from __future__ import annotations

import pickle
import socket
import threading
from typing import Any, Callable, Optional

from perseus.runner.handshake import HelloServer, Refused, same_secret
from perseus.runner.remote.rank import dumps
from perseus.runner.run_frames import recv_frame, send_frame

__all__ = ["RankEndpoint", "RankGone"]


class RankGone(RuntimeError):
    """The rank's process ended or its connection dropped (the job ended, or its node died)."""


class RankEndpoint:
    """Waits for its rank and talks to it.

    Args:
        token: the job's secret.
        address: where to listen.
        rank: the rank that must connect (set before the job starts; see :meth:`expect`).
    """

    def __init__(self, token: str, address: str, rank: int = -1):
        self.token, self.rank = token, rank
        self._sock: Optional[socket.socket] = None
        self._connected = threading.Event()
        self._lock = threading.Lock()
        self._server = HelloServer([address], self._check, self._accept, name="perseus-rank-link",
                                   hello_limit=max(256, 2 * len(token)), deadline_s=60.0)
        self.address, self.port = address, self._server.port

    def expect(self, rank: int) -> None:
        """Set the rank that must connect next (a new job's), dropping any previous rank's connection."""
        self.close_link()
        self.rank = rank
        self._connected.clear()

    def _check(self, body: bytes) -> None:
        if not same_secret(body.decode(errors="replace"), self.token):
            raise Refused("a connection without the job's token")

    def _accept(self, conn: socket.socket, _hello) -> None:
        try:
            conn.settimeout(30.0)
            said = int(recv_frame(conn, limit=32))
            conn.settimeout(None)
        except (OSError, ValueError):
            conn.close()
            return
        if said != self.rank:
            conn.close()
            return
        with self._lock:
            self._sock = conn
        self._connected.set()

    def wait_connected(self, timeout: float) -> bool:
        """Whether the rank connected within ``timeout`` seconds."""
        return self._connected.wait(timeout)

    def call(self, message, on_log: Optional[Callable[[Any], None]] = None) -> tuple:
        """Send ``message`` (a tuple, or one already pickled: bytes) and return the rank's ``("result", ok, value,
        text, exception)``.

        Raises:
            RankGone: the rank is not connected, or its connection dropped before it answered.
        """
        sock = self._sock
        if sock is None:
            raise RankGone("its rank is not connected")
        try:
            send_frame(sock, message if isinstance(message, bytes) else dumps(message))
            while True:
                reply = pickle.loads(recv_frame(sock))
                if reply[0] == "log":
                    if on_log is not None:
                        on_log(reply[1])
                    continue
                return reply
        except (OSError, ConnectionError, EOFError, ValueError) as exc:
            self.close_link()
            raise RankGone(f"its rank's process ended or its connection dropped ({exc or 'closed'})") from None

    def close_link(self) -> None:
        """Tell the rank to leave (best effort) and drop its connection."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                send_frame(sock, dumps(("exit",)))
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        """Stop listening and drop the rank's connection."""
        self._server.close()
        self.close_link()
