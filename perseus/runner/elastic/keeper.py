"""The checkpoint keeper: one process per host that holds the ranks' committed state in host memory.

Gemini (SOSP'23) keeps checkpoints for failure recovery in CPU memory, on the rank's own host and on a few
other hosts, so that after a failure the newest commit comes back from memory instead of from disk. The
elastic launcher starts one keeper per host (:func:`perseus.runner.elastic.keeper_process.start_keeper`);
every rank then copies each commit to its own host's keeper and to the keepers
:func:`perseus.elastic.gemini.placement` names (:class:`perseus.elastic.gemini.GeminiStore`). A keeper
outlives the ranks of a generation (a rank that dies or a job that is re-formed loses nothing), but not the
job: it exits when its stdin reaches end of file, which happens when the launcher that started it (through a
pipe or ``ssh``) is gone.

Run as ``python -m perseus.runner.elastic.keeper [--bind ADDRS] [--toward ADDR] [--port PORT] [--host HOST]``.
The first line of stdin is the job's token (so that it never shows in ``ps``); once listening the keeper prints
one line ``PERSEUS_KEEPER_PORT <port>`` to stdout. It listens on the addresses of ``--bind``, else on those its
``--host`` name resolves to on this machine (the ranks connect to that name) and on its address on the route
to ``--toward`` (the launcher): never on every interface, so a local job's keeper stays on 127.0.0.1. It
serves any number of TCP connections, one thread each, with the messages of :mod:`perseus.base.elastic_protocol`.
A connection starts with ``{"op": "hello", "token": T}`` (answered ``ok``, or ``error`` and closed on a wrong
token), read with a deadline on a thread of its own (:class:`perseus.runner.handshake.HelloServer`: a client
that sends nothing, a few bytes a second or garbage costs a bounded handshake and is closed); then:

* ``put_begin`` {version, owner, nbytes_total, parts: [sizes]}, ``put_chunk`` {version, owner, part, offset}
  with one buffer, ..., ``put_end`` {version, owner}: a new version of the owner rank's state. Only
  ``put_end`` is answered (``stored``, or ``error`` when bytes are missing), so that the chunks stream
  without waiting. Each part is allocated once, at ``put_begin``, and the chunks are received straight into
  it. The newest write wins: a completed put replaces the owner's complete version even when its number is
  not higher (a job that rolled back to an earlier commit numbers its next commits again from there).
* ``list`` -> {complete: {"<owner>": version}}; ``get`` {version, owner} -> ``data`` {version, owner, parts}
  with the parts as the message's buffers, or ``missing``; ``drop_above`` {version} -> ``ok``: forgets every
  version newer than that (a job that rolled back).

Memory: per owner a keeper holds at most two versions, Gemini's two buffers: the newest complete one and one
in progress (a newer ``put_begin`` of the same owner drops the older in-progress one; a completed version
frees the previous complete one). A ``get`` being served keeps its version alive until it is sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import sys
import threading
from typing import Optional, Sequence

from perseus.base.elastic_shm import job_dir, owner_pid, pid_alive
from perseus.base.elastic_protocol import MAX_HEADER_BYTES, WireError, send_msg
from perseus.runner.elastic.keeper_process import PORT_LINE
from perseus.runner.handshake import HelloServer, address_towards, json_hello, own_addresses

__all__ = ["serve", "listen_addresses", "main"]

log = logging.getLogger("perseus.elastic")

_DRAIN = 1 << 20


class _Version:
    """One version of one owner's state: its parts, and how many bytes of each have arrived."""

    def __init__(self, version: int, sizes: Sequence[int]):
        self.version = version
        self.parts = [bytearray(int(n)) for n in sizes]
        self.received = [0] * len(self.parts)
        self.broken = ""
        self.files: list[str] = []  # shared-memory files the parts are mapped from (put_files)

    def forget(self) -> None:
        """This version is dropped: files of processes that are gone are removed (their pages are freed once
        no map of them is left)."""
        for path in set(self.files):
            pid = owner_pid(path)
            if pid is not None and not pid_alive(pid):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def complete(self) -> bool:
        return not self.broken and all(got == len(p) for got, p in zip(self.received, self.parts))


class _Store:
    """Per owner rank: the newest complete version and at most one in progress."""

    def __init__(self, shm_dir: Optional[str] = None):
        self.lock = threading.Lock()
        self.complete: dict[int, _Version] = {}
        self.pending: dict[int, _Version] = {}
        self.shm_dir = os.path.realpath(shm_dir) if shm_dir else None

    def install(self, owner: int, entry: "_Version") -> None:
        """Make ``entry`` the owner's complete version (the lock held), dropping the previous one."""
        old = self.complete.get(owner)
        self.complete[owner] = entry
        if old is not None and old is not entry:
            old.forget()

    def newest(self, owner: int) -> int:
        done = self.complete.get(owner)
        return done.version if done is not None else -1


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed by the peer after {got} of {n} bytes")
        got += k


def _recv_header(sock: socket.socket) -> Optional[dict]:
    """The next message's JSON header, its buffers left unread; None on a clean close between messages."""
    raw = bytearray(8)
    first = sock.recv_into(raw, 8)
    if first == 0:
        return None
    _recv_into(sock, memoryview(raw)[first:])
    n = int.from_bytes(raw, "big")
    if n > MAX_HEADER_BYTES:
        raise WireError(f"message header of {n} bytes is larger than {MAX_HEADER_BYTES}: not a perseus peer")
    body = bytearray(n)
    _recv_into(sock, memoryview(body))
    try:
        header = json.loads(bytes(body))
    except ValueError as exc:
        raise WireError(f"message header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("message header is not a JSON object")
    return header


def _drain(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _DRAIN) or 1))
    while n > 0:
        k = min(n, scratch.nbytes)
        _recv_into(sock, scratch[:k])
        n -= k


class _Connection:
    """One client whose hello carried the job's token (:func:`serve` checked it): any number of requests,
    answered in order."""

    def __init__(self, sock: socket.socket, store: _Store):
        self.sock, self.store = sock, store

    def run(self) -> None:
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            send_msg(self.sock, {"op": "ok"})
            while True:
                header = _recv_header(self.sock)
                if header is None:
                    return
                self.handle(header)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.debug("perseus keeper: connection ended: %s", exc)
        finally:
            self.sock.close()

    def handle(self, h: dict) -> None:
        op, store = h.get("op"), self.store
        sizes = [int(k) for k in h.get("nbytes", ())]
        if op == "put_chunk":
            self.put_chunk(h, sizes)
            return
        if op == "put_files":
            inline = []
            for n in sizes:
                inline.append(bytearray(n))
                _recv_into(self.sock, memoryview(inline[-1]))
            send_msg(self.sock, self.put_files(h, inline))
            return
        _drain(self.sock, sum(sizes))
        if op == "put_begin":
            owner, version, parts = int(h["owner"]), int(h["version"]), [int(n) for n in h["parts"]]
            if sum(parts) != int(h.get("nbytes_total", sum(parts))) or min(parts, default=0) < 0:
                raise ValueError(f"put_begin of version {version}: part sizes {parts} do not add up")
            with store.lock:
                store.pending.pop(owner, None)  # free the older buffer before allocating the new one
            entry = _Version(version, parts)  # allocated outside the lock: other owners go on meanwhile
            with store.lock:
                store.pending[owner] = entry
        elif op == "put_end":
            send_msg(self.sock, self.put_end(int(h["owner"]), int(h["version"])))
        elif op == "list":
            with store.lock:
                complete = {str(o): v.version for o, v in store.complete.items()}
            send_msg(self.sock, {"op": "list", "complete": complete})
        elif op == "get":
            owner, version = int(h["owner"]), int(h["version"])
            with store.lock:
                entry = store.complete.get(owner)
            if entry is None or entry.version != version:
                send_msg(self.sock, {"op": "missing", "version": version, "owner": owner})
            else:
                send_msg(self.sock, {"op": "data", "version": version, "owner": owner, "parts": len(entry.parts)},
                         entry.parts)
        elif op == "drop_above":
            version = int(h["version"])
            with store.lock:
                for table in (store.complete, store.pending):
                    for owner in [o for o, v in table.items() if v.version > version]:
                        table.pop(owner).forget()
            send_msg(self.sock, {"op": "ok"})
        else:
            send_msg(self.sock, {"op": "error", "detail": f"perseus keeper: unknown op {op!r}; the rank and the "
                                                          f"keeper must run the same perseus version"})

    def put_chunk(self, h: dict, sizes: list[int]) -> None:
        owner, version, part, offset = int(h["owner"]), int(h["version"]), int(h["part"]), int(h["offset"])
        n = sum(sizes)
        with self.store.lock:
            entry = self.store.pending.get(owner)
        if entry is None or entry.version != version:
            _drain(self.sock, n)  # an ignored (old) version, or one another put_begin replaced
            return
        if len(sizes) != 1 or not 0 <= part < len(entry.parts) or offset < 0 or offset + n > len(entry.parts[part]):
            entry.broken = f"chunk of {n} bytes at offset {offset} does not fit part {part}"
            _drain(self.sock, n)
            return
        _recv_into(self.sock, memoryview(entry.parts[part])[offset:offset + n])
        with self.store.lock:
            entry.received[part] += n

    def put_end(self, owner: int, version: int) -> dict:
        store = self.store
        with store.lock:
            entry = store.pending.get(owner)
            if entry is None or entry.version != version:
                return {"op": "error", "detail": f"perseus keeper: version {version} of rank {owner} is not in "
                                                 f"progress (a newer put replaced it); send it again"}
            if not entry.complete():
                del store.pending[owner]
                missing = sum(len(p) for p in entry.parts) - sum(entry.received)
                return {"op": "error", "detail": f"perseus keeper: version {version} of rank {owner} is "
                                                 f"incomplete ({entry.broken or f'{missing} bytes missing'}); "
                                                 f"send it again"}
            del store.pending[owner]
            store.install(owner, entry)  # the previous complete version is freed here
        return {"op": "stored", "version": version, "owner": owner}

    def put_files(self, h: dict, inline: list[bytearray]) -> dict:
        """A complete version whose large parts are files in this host's shared-memory directory (the rank's
        own snapshot buffers): mapped read-only, nothing copied."""
        owner, version = int(h["owner"]), int(h["version"])
        store = self.store
        if store.shm_dir is None:
            return {"op": "error", "detail": "perseus keeper: this keeper has no shared-memory directory; send "
                                             "the parts themselves"}
        entry = _Version(version, ())
        try:
            for d in h["parts"]:
                if "inline" in d:
                    entry.parts.append(inline[int(d["inline"])])
                    continue
                path = os.path.realpath(str(d["file"]))
                if os.path.dirname(path) != store.shm_dir:
                    raise ValueError(f"{path} is outside {store.shm_dir}")
                offset, n = int(d["offset"]), int(d["nbytes"])
                with open(path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if offset < 0 or offset + n > len(mapped):
                    raise ValueError(f"{n} bytes at {offset} do not lie in {path}")
                entry.parts.append(memoryview(mapped)[offset:offset + n])
                entry.files.append(path)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            return {"op": "error", "detail": f"perseus keeper: version {version} of rank {owner} cannot be mapped "
                                             f"({exc}); send the parts themselves"}
        entry.received = [len(p) for p in entry.parts]
        with store.lock:
            store.pending.pop(owner, None)
            store.install(owner, entry)
        return {"op": "stored", "version": version, "owner": owner}


_REFUSAL = {"op": "error", "detail": "perseus keeper: wrong or missing job token in hello; connect with the "
                                   "job's own token"}


def serve(addresses: Sequence[str], port: int, token: str, shm_dir: Optional[str] = None,
          hello_deadline_s: float = 10.0) -> HelloServer:
    """Listen on ``addresses`` (all on ``port``; 0: any free one) and serve every client whose hello carries
    ``token``, each on its own thread (see :class:`perseus.runner.handshake.HelloServer` for what a client
    without it, a silent one or a garbled one costs: nothing but a bounded handshake). ``shm_dir``: the host's
    shared-memory directory whose files ``put_files`` may name; ``hello_deadline_s``: how long a connection
    may take to send its hello. Returns the server (``close()`` stops it).

    Raises:
        OSError: an address cannot be bound.
    """
    store = _Store(shm_dir)
    return HelloServer(addresses, lambda body: json_hello(body, token, _REFUSAL),
                       lambda sock, _hello: _Connection(sock, store).run(), port=port, name="perseus keeper",
                       deadline_s=hello_deadline_s)


def listen_addresses(host: str, toward: str) -> list[str]:
    """Where a keeper listens when no ``--bind`` is given: the addresses of this machine that its ``host``
    name resolves to (the ranks connect to that name), and its address on the route to ``toward`` (the
    launcher's driver, so the cluster network the job uses); empty when neither gives one."""
    out = own_addresses(host) if host else []
    if toward:
        mine = address_towards(toward)
        if mine:
            out.append(mine)
    return list(dict.fromkeys(out))


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The keeper process (see the module doc). Returns the exit status: 0 on stdin EOF or SIGTERM, 2 when no
    token arrives on stdin, no address to listen on is known or an address cannot be bound."""
    parser = argparse.ArgumentParser(prog="python -m perseus.runner.elastic.keeper",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default="", help="comma-separated addresses to listen on (default: those "
                        "--host resolves to on this machine, and the address on the route to --toward)")
    parser.add_argument("--toward", default="", help="the launcher's address (the driver's, which the ranks "
                        "reach): the keeper also listens on this machine's address on the route to it")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    parser.add_argument("--host", default="", help="the host's name in the job (the ranks connect to it; it "
                        "names the shared-memory directory, where ranks keep their snapshots); empty: no shared "
                        "memory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s perseus keeper: %(message)s")
    token = sys.stdin.buffer.readline().decode(errors="replace").strip()
    if not token:
        print("perseus keeper: no job token on the first line of stdin; start keepers with "
              "perseus.runner.elastic.keeper_process.start_keeper", file=sys.stderr)
        return 2
    addresses = [a for a in args.bind.split(",") if a] or listen_addresses(args.host, args.toward)
    if not addresses:
        print(f"perseus keeper: no address of this machine to listen on: {args.host!r} does not resolve to one "
              f"and no route to the launcher ({args.toward or 'not given'}) was found; pass --bind",
              file=sys.stderr)
        return 2
    shm_dir = job_dir(token, args.host) if args.host else None
    if shm_dir is not None:
        try:
            os.makedirs(shm_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            log.warning("perseus keeper: no shared-memory directory %s (%s); commits travel over TCP", shm_dir, exc)
            shm_dir = None
    try:
        server = serve(addresses, args.port, token, shm_dir)
    except OSError as exc:
        print(f"perseus keeper: {exc}; pick another --port or --bind", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    print(f"{PORT_LINE} {server.port}", flush=True)
    try:
        while sys.stdin.buffer.read1(65536):
            pass
    except (SystemExit, KeyboardInterrupt):
        pass
    server.close()
    if shm_dir is not None:  # the job is over on this host: its snapshots go
        shutil.rmtree(shm_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(shm_dir))  # the job's directory, once no host of it is left here
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # connection threads may be blocked in recv; nothing of theirs needs to outlive the job


if __name__ == "__main__":
    sys.exit(main())
