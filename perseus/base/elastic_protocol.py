"""Messages between the elastic driver, the ranks and the checkpoint keepers.

A message is a JSON object followed by zero or more binary buffers:

    8 bytes  big-endian length H of the JSON header
    H bytes  UTF-8 JSON object; its optional "nbytes" key lists the lengths of the buffers that follow
    ...      the buffers, back to back

Buffers are sent with ``sendall`` on memoryviews (no copy, and the GIL is released while the bytes move) and
received into fresh ``bytearray`` objects. Every connection starts with a ``hello`` message carrying the job's
token; a server closes a connection whose token does not match.

Raises :class:`WireError` (a ``ConnectionError``) when the peer closes the connection mid-message, when a
header is not a JSON object or is absurdly large, and re-raises socket errors and timeouts as they come.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Sequence

__all__ = ["WireError", "send_msg", "recv_msg", "connect", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 16 << 20
_LEN = struct.Struct(">Q")


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not a message."""


def send_msg(sock: socket.socket, header: dict, buffers: Sequence[Any] = ()) -> None:
    """Send ``header`` (a JSON-serialisable dict) and ``buffers`` (bytes-like objects) as one message."""
    views = [memoryview(b).cast("B") for b in buffers]
    if views:
        header = dict(header, nbytes=[v.nbytes for v in views])
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)
    for view in views:
        sock.sendall(view)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed by the peer after {got} of {n} bytes")
        got += k
    return buf


def recv_msg(sock: socket.socket) -> tuple[dict, list[bytearray]]:
    """Receive one message: ``(header, buffers)``. Raises :class:`WireError` on a closed or garbled stream."""
    (n,) = _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))
    if n > MAX_HEADER_BYTES:
        raise WireError(f"message header of {n} bytes is larger than {MAX_HEADER_BYTES}: not a perseus peer")
    try:
        header = json.loads(bytes(_recv_exact(sock, n)))
    except ValueError as exc:
        raise WireError(f"message header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("message header is not a JSON object")
    buffers = [_recv_exact(sock, int(k)) for k in header.get("nbytes", ())]
    return header, buffers


def connect(address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``address:port`` (``timeout`` seconds to connect and for every later call), with
    Nagle's delay off. Raises ``OSError`` (``TimeoutError``, ``ConnectionRefusedError``...) on failure."""
    sock = socket.create_connection((address, int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
