"""A listening socket whose clients must prove they belong to the job before anything is served to them.

The launcher's servers (the elastic driver's rank server, the checkpoint keepers, ``perseus.run``'s function
service) listen on a network that other programs reach too: port scanners, health checks, another job's
ranks, a client that hangs. :class:`HelloServer` keeps those from costing the job anything:

* every connection's first message is a *hello*: an 8-byte big-endian length, then that many bytes, at most
  ``hello_limit`` of them (a larger length is refused at once, before anything is allocated);
* all handshakes run on one thread that never blocks (a selector over every listener and every connection
  still in its handshake), so a client that sends nothing, or one byte a second, holds up nobody else;
* a connection must complete its hello within ``deadline_s`` of being accepted, else it is closed;
* at most ``max_pending`` connections are in their handshake at once; one more closes the oldest (a real
  client sends its hello as soon as it connects, so it completes long before it could become the oldest);
* the hello is read byte-exactly (nothing after it), then ``check(body)`` decides: it returns what the server
  wants to know about the client, or raises :class:`Refused` (whose ``reply`` bytes are sent, best effort,
  before the connection is closed);
* an accepted connection is handed, blocking again, to ``serve(sock, hello)`` on a thread of its own.

Memory is bounded by ``max_pending * hello_limit`` bytes for the handshakes, whatever the clients send.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional, Sequence

__all__ = ["HelloServer", "Refused", "listen_on", "same_secret", "json_hello", "own_addresses", "address_towards"]

log = logging.getLogger("perseus.runner")

_LEN = struct.Struct(">Q")
_WARN_EVERY_S = 10.0


class Refused(Exception):
    """Raised by a hello check: the client is not one of the job's. ``reply``: bytes sent before closing."""

    def __init__(self, reason: str, reply: bytes = b""):
        super().__init__(reason)
        self.reply = reply


def same_secret(given: Any, secret: str) -> bool:
    """Whether ``given`` (any value a client sent) equals the job's ``secret``, compared in constant time."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), secret.encode("utf-8", "surrogatepass"))


def listen_on(addresses: Sequence[str], port: int = 0, backlog: int = 128, tries: int = 20) -> list[socket.socket]:
    """Non-blocking IPv4 listening sockets, one per address of ``addresses``, all on the same port (``port``,
    or one the first bind picks when 0: it is retried up to ``tries`` times when another address has that
    port taken already).

    Raises:
        OSError: an address cannot be bound (the message names it).
    """
    addresses = list(dict.fromkeys(addresses))
    if not addresses:
        raise OSError(errno.EADDRNOTAVAIL, "no address to listen on")
    for attempt in range(tries if port == 0 else 1):
        socks: list[socket.socket] = []
        chosen = port
        try:
            for address in addresses:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((address, chosen))
                except OSError as exc:
                    raise OSError(exc.errno, f"cannot listen on {address}:{chosen}: {exc.strerror}") from None
                sock.listen(backlog)
                sock.setblocking(False)
                chosen = sock.getsockname()[1]
            return socks
        except OSError as exc:
            for sock in socks:
                sock.close()
            if exc.errno != errno.EADDRINUSE or port != 0 or attempt == tries - 1 or len(socks) < 2:
                raise
    raise AssertionError("unreachable")


class _Pending:
    """One connection in its handshake: the bytes of its hello received so far."""

    __slots__ = ("sock", "deadline", "head", "body", "got")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.head = bytearray(_LEN.size)
        self.body: Optional[bytearray] = None
        self.got = 0


class HelloServer:
    """Listens on ``addresses`` (one socket each, one port: :attr:`port`) and serves the clients whose hello
    ``check`` accepts (see the module doc). ``counts`` says how many connections were served, refused,
    timed out in their handshake, closed as the oldest of too many, or sent a hello over the limit."""

    def __init__(self, addresses: Sequence[str], check: Callable[[bytes], Any],
                 serve: Callable[[socket.socket, Any], None], *, port: int = 0, name: str = "perseus",
                 hello_limit: int = 16 << 10, deadline_s: float = 10.0, max_pending: int = 256, backlog: int = 128):
        self._listeners = listen_on(addresses, port, backlog)
        self.port = self._listeners[0].getsockname()[1]
        self.addresses = [s.getsockname()[0] for s in self._listeners]
        self._check, self._serve, self._name = check, serve, name
        self.hello_limit, self.deadline_s, self.max_pending = hello_limit, deadline_s, max(1, max_pending)
        self.counts = {"served": 0, "refused": 0, "timed_out": 0, "evicted": 0, "oversized": 0}
        self._pending: dict[int, _Pending] = {}  # by file descriptor, in order of arrival
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._said = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-handshakes", daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Connections in their handshake now."""
        return len(self._pending)

    def close(self) -> None:
        """Stop listening and close every connection still in its handshake (served ones are left alone)."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    # -- the handshake thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        for listener in self._listeners:
            sel.register(listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                first = min((p.deadline for p in self._pending.values()), default=now + 0.5)
                ready = sel.select(max(0.0, min(first - now, 0.5)))
                clients = [key.data for key, _ in ready if key.data is not None]
                for p in clients:  # the hellos first: a flood of new connections cannot overtake them
                    self._read(sel, p)
                if any(key.fileobj in self._listeners for key, _ in ready):
                    self._accept(sel)
                self._expire(sel)
        finally:
            for p in list(self._pending.values()):
                self._drop(sel, p)
            for listener in self._listeners:
                listener.close()
            sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for listener in self._listeners:
            for _ in range(self.max_pending):
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # e.g. out of file descriptors: the backlog waits for the next round
                    self._warn(f"accept failed ({exc})")
                    time.sleep(0.05)  # the listener stays readable: do not spin on it
                    break
                sock.setblocking(False)
                if len(self._pending) >= self.max_pending:
                    self.counts["evicted"] += 1
                    self._drop(sel, next(iter(self._pending.values())))
                p = _Pending(sock, time.monotonic() + self.deadline_s)
                self._pending[sock.fileno()] = p
                sel.register(sock, selectors.EVENT_READ, p)

    def _read(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        if p.sock.fileno() not in self._pending:
            return
        target = p.head if p.body is None else p.body
        try:
            k = p.sock.recv_into(memoryview(target)[p.got:], len(target) - p.got)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            k = 0
        if k == 0:  # closed (or reset) before its hello was complete
            self._drop(sel, p)
            return
        p.got += k
        if p.got < len(target):
            return
        if p.body is None:
            (n,) = _LEN.unpack(bytes(p.head))
            if n > self.hello_limit:
                self.counts["oversized"] += 1
                self._refuse(sel, p, Refused(f"a hello of {n} bytes (at most {self.hello_limit})"))
                return
            p.body, p.got = bytearray(n), 0
            if n > 0:
                return
        self._finish(sel, p)

    def _finish(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            hello = self._check(bytes(p.body or b""))
        except Refused as exc:
            self._refuse(sel, p, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a hello the check cannot read is refused, not fatal
            self._refuse(sel, p, Refused(f"an unreadable hello ({type(exc).__name__}: {exc})"))
            return
        sel.unregister(p.sock)
        del self._pending[p.sock.fileno()]
        p.sock.setblocking(True)
        self.counts["served"] += 1
        threading.Thread(target=self._serve, args=(p.sock, hello), name=f"{self._name}-conn", daemon=True).start()

    def _refuse(self, sel: selectors.BaseSelector, p: _Pending, why: Refused) -> None:
        if why.reply:
            try:
                p.sock.send(why.reply)  # best effort: a small reply fits the empty send buffer
            except OSError:
                pass
        self.counts["refused"] += 1
        self._warn(f"a connection was refused: {why}")
        self._drop(sel, p)

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        late = [p for p in self._pending.values() if p.deadline <= now]
        for p in late:
            self.counts["timed_out"] += 1
            self._drop(sel, p)
        if late:
            self._warn(f"{len(late)} connection(s) sent no complete hello within {self.deadline_s:g} s and were "
                       f"closed")

    def _drop(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        fd = p.sock.fileno()
        if self._pending.pop(fd, None) is not None:
            try:
                sel.unregister(p.sock)
            except (KeyError, ValueError):
                pass
        p.sock.close()

    def _warn(self, text: str) -> None:
        """Log ``text``, at most once every few seconds (a flood of strangers must not flood the log)."""
        now = time.monotonic()
        if now - self._said >= _WARN_EVERY_S:
            self._said = now
            so_far = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in self.counts.items() if v)
            log.warning("%s: %s%s", self._name, text, f" ({so_far} so far)" if so_far else "")


def json_hello(body: bytes, token: str, refusal: Optional[dict] = None) -> dict:
    """The hello of :mod:`perseus.base.elastic_protocol`'s peers, checked: a JSON object with ``"op": "hello"``, no
    buffers after it, and the job's ``token`` (compared in constant time). Raises :class:`Refused` otherwise,
    its reply being the message ``refusal`` when given."""
    reply = b""
    if refusal is not None:
        text = json.dumps(refusal, separators=(",", ":")).encode()
        reply = _LEN.pack(len(text)) + text
    try:
        hello = json.loads(body)
    except ValueError:
        raise Refused("a hello that is not JSON", reply) from None
    if not isinstance(hello, dict) or hello.get("op") != "hello" or hello.get("nbytes"):
        raise Refused("a first message that is not a hello", reply)
    if not same_secret(hello.get("token"), token):
        raise Refused("a hello without the job's token", reply)
    return hello


def own_addresses(name: str) -> list[str]:
    """The IPv4 addresses ``name`` resolves to here that belong to this machine (those it can bind)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out = []
    for *_, address in infos:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))  # fails with EADDRNOTAVAIL unless the address is ours
            out.append(address[0])
        except OSError:
            continue
    return list(dict.fromkeys(out))


def address_towards(peer: str) -> Optional[str]:
    """This machine's IPv4 address on the route to ``peer`` (no packet is sent); None when there is no route."""
    try:
        target = socket.getaddrinfo(peer, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return probe.getsockname()[0]
    except (OSError, UnicodeError, IndexError):
        return None
