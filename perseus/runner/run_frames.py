"""The connection between :func:`perseus.run`'s calling process and its ranks: the variable that carries the
job's token, and length-prefixed frames (an 8-byte big-endian length, then the bytes).

Both ends use it: :mod:`perseus.runner.run_func` (the caller, which also launches the job) and
:mod:`perseus.runner.run_task` (each rank, which must not load the launcher).
"""

from __future__ import annotations

import socket
import struct

__all__ = ["TOKEN_ENV", "send_frame", "recv_frame"]

#: the environment variable carrying the job's token to the ranks (exported like every PERSEUS_* setting)
TOKEN_ENV = "PERSEUS_RUN_TOKEN"
_LEN = struct.Struct(">Q")
_MAX_FRAME = 1 << 34


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` as one frame. Raises ``OSError`` when the connection fails."""
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int = _MAX_FRAME) -> bytes:
    """Receive one frame's bytes.

    Raises:
        ConnectionError: the frame is longer than ``limit`` bytes, or the peer closed the connection first.
        OSError: the connection failed or timed out.
    """
    head = _recv_exact(sock, _LEN.size)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ConnectionError(f"a frame of {n} bytes (at most {limit} expected)")
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed early")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
