"""A long-lived rank that runs the functions its worker sends: ``python -m perseus.runner.remote.rank``.

Ray's executors keep one MPI job for many calls (``run``, ``execute``, ...). Each rank of that job runs this
module: it reads its rank from the launcher's variables, connects to its worker's
:class:`~perseus.runner.remote.link.RankEndpoint` (``PERSEUS_REMOTE_LINKS``: ``ip:port`` per rank, comma
separated) with the job's token, and serves messages (cloudpickled tuples) until told to exit or until the
connection drops:

* ``("init", cls, args, kwargs)``: create the executable object (``cls(*args, **kwargs)``, or None);
* ``("call", fn, args, kwargs, with_object)``: run ``fn(obj)`` (``with_object``) or ``fn(*args, **kwargs)``;
* ``("exit",)``: leave (exit status 0). A dropped connection (the worker died) ends the rank with status 3.

Replies: ``("log", info)`` for :func:`log` (Horovod's ``ray_logger.log``), then ``("result", ok, value,
traceback_text, exception)``. A call that raises is answered, then the process exits with status 1, so
that ``mpirun`` ends the ranks that may wait in a collective for this one: the job ends rather than hangs.
The rank dies with its parent (``PR_SET_PDEATHSIG``), the daemon its worker started.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import traceback
from typing import Any, Optional

from perseus.base.horovod_alias import install_if_asked
from perseus.base.knobs import read_knob
from perseus.runner.common.util.env import get_env_rank_and_size
from perseus.runner.remote.service import die_with_parent
from perseus.runner.run_frames import recv_frame, send_frame

__all__ = ["LINKS_ENV", "log", "main", "dumps"]

LINKS_ENV = "PERSEUS_REMOTE_LINKS"

_link: Optional[socket.socket] = None
_link_lock = threading.Lock()


def dumps(value: Any) -> bytes:
    import cloudpickle  # the functions of a Ray or Spark driver's __main__ travel by value

    return cloudpickle.dumps(value)


def log(info: Any) -> bool:
    """Send ``info`` to this rank's worker (for the driver's callbacks); False outside such a rank."""
    if _link is None:
        return False
    with _link_lock:
        send_frame(_link, dumps(("log", info)))
    return True


def _reply(rank: int, ok: bool, value: Any, text: str, error: Optional[BaseException]) -> bytes:
    try:
        return dumps(("result", ok, value, text, error))
    except Exception as exc:  # noqa: BLE001 - an unpicklable value or exception
        if ok:
            text = f"rank {rank} returned a value that cannot be pickled: {type(exc).__name__}: {exc}"
        return pickle.dumps(("result", False, None, text, None))


def _serve(sock: socket.socket, rank: int) -> int:
    obj: Any = None
    while True:
        try:
            frame = recv_frame(sock)
        except (OSError, ConnectionError, EOFError, ValueError):
            return 3  # the worker is gone: so is this rank, at once (no MPI_Finalize, which could wait for ever)
        try:
            message = pickle.loads(frame)
        except BaseException as exc:  # noqa: BLE001 - the call is told why, naming this rank
            text = (f"rank {rank} cannot unpickle the call it was sent: {type(exc).__name__}: {exc} (a module the "
                    "function needs that this rank's Python does not have?)\n"
                    + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            sys.stderr.write(text)
            sys.stderr.flush()
            with _link_lock:
                send_frame(sock, _reply(rank, False, None, text, None))
            return 1
        op = message[0]
        if op == "exit":
            return 0
        try:
            if op == "init":
                cls, args, kwargs = message[1:]
                obj = cls(*args, **kwargs) if cls is not None else None
                value = None
            else:
                fn, args, kwargs, with_object = message[1:]
                value = fn(obj) if with_object else fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the worker
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            sys.stderr.write(text)
            sys.stderr.flush()
            with _link_lock:
                send_frame(sock, _reply(rank, False, None, text, exc))
            return 1
        with _link_lock:
            send_frame(sock, _reply(rank, True, value, "", None))


def main() -> int:
    """Connect to this rank's worker and serve it (see the module doc); the exit status."""
    global _link
    die_with_parent()
    install_if_asked()  # (the caller had the horovod alias: the functions it sends may import horovod.*)
    found = get_env_rank_and_size()
    rank = found[0] if found else 0
    given = str(read_knob("remote_links")[0])
    links = given.split(",")
    if rank >= len(links) or ":" not in links[rank]:
        print(f"perseus: rank {rank} has no worker to serve ({LINKS_ENV}={given!r})",
              file=sys.stderr, flush=True)
        return 2
    host, _, port = links[rank].rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=60.0)
        sock.settimeout(None)
        send_frame(sock, str(read_knob("remote_token")[0]).encode())
        send_frame(sock, str(rank).encode())
    except OSError as exc:
        print(f"perseus: rank {rank} cannot reach its worker at {links[rank]}: {exc}", file=sys.stderr, flush=True)
        return 2
    _link = sock
    with sock:
        code = _serve(sock, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # no MPI_Finalize: the other ranks may be waiting for this one
    return code


if __name__ == "__main__":
    # Run as the imported module, so that log() (perseus.ray.ray_logger) finds the link this process opens.
    from perseus.runner.remote import rank as _module

    sys.exit(_module.main())
