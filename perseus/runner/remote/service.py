"""The worker's side of a remote launch: run commands for :mod:`perseus.runner.remote.agent`.

A :class:`NodeService` runs inside an engine's worker (a Ray actor, a Spark task). It listens on the
worker's address; a client proves it belongs to the job with the job's token (the hello frame), then sends
one JSON frame ``{"command": "<shell command>", "env": {...}}``. The service runs ``/bin/sh -c command`` under
:mod:`perseus.runner.remote.guard` in a session of its own, with the worker's environment plus the service's
``env`` plus the request's, and relays:

* service -> client: ``b"4"`` once the command started, tagged frames ``b"1" + bytes`` (stdout), ``b"2" +
  bytes`` (stderr), then ``b"3" + exit status`` once the command ended and its output is drained;
* client -> service: ``b"0" + bytes`` (stdin), ``b"0"`` alone for end of input.

When the client's connection drops, the command's session is sent SIGTERM, then SIGKILL 3 s later (ssh's
semantics: the daemon ends with the agent that started it). When the worker's process dies, the guard ends
the command's session (the MPI daemon and its ranks).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional

from perseus.runner.handshake import HelloServer, Refused, same_secret
from perseus.runner.run_frames import recv_frame, send_frame
from perseus.runner.session_dirs import remove_stale_session_dirs

__all__ = ["NodeService", "STDIN", "STDOUT", "STDERR", "STATUS", "STARTED", "die_with_parent",
           "end_session"]

STDIN, STDOUT, STDERR, STATUS, STARTED = b"0", b"1", b"2", b"3", b"4"
_KILL_GRACE_S = 3.0
_GUARD = "perseus.runner.remote.guard"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when the thread that started it ends
    (``PR_SET_PDEATHSIG``; a no-op where there is no prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the connection drop still ends the command
        pass


def end_session(proc: subprocess.Popen, grace: float = _KILL_GRACE_S) -> None:
    """SIGTERM to the session ``proc`` leads (a command, or mpirun with its daemons), SIGKILL ``grace`` s later."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, max(1.0, grace))):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class NodeService:
    """Runs commands for the job's agents (see the module doc) until :meth:`close`.

    Args:
        token: the job's secret; a client must present it first.
        address: where to listen (the worker's address on the cluster network).
        env: variables added to every command's environment (e.g. the node's GPU list).

    Raises:
        OSError: ``address`` cannot be listened on.
    """

    def __init__(self, token: str, address: str, env: Optional[Mapping[str, str]] = None):
        self.token, self.address = token, address
        self.env = dict(env or {})
        self.started: list[str] = []  # the commands run so far (for diagnostics)
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._server = HelloServer([address], self._check, self._serve, name="perseus-node-service",
                                   hello_limit=max(256, 2 * len(token)), deadline_s=30.0)
        self.port = self._server.port

    def _check(self, body: bytes) -> None:
        if not same_secret(body.decode(errors="replace"), self.token):
            raise Refused("a connection without the job's token")

    def _serve(self, conn: socket.socket, _hello) -> None:
        with conn:
            try:
                request = json.loads(recv_frame(conn, limit=1 << 20))
                command = str(request["command"])
                env = {**os.environ, **self.env, **{str(k): str(v) for k, v in dict(request.get("env", {})).items()}}
            except (OSError, ConnectionError, ValueError, KeyError, TypeError):
                return
            remove_stale_session_dirs(env.get("TMPDIR"))  # a daemon with a reused process id would fail
            try:
                proc = subprocess.Popen([sys.executable, "-m", _GUARD, str(os.getpid()), command],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env=env, start_new_session=True)
            except OSError as exc:
                text = f"perseus: cannot start the command on this node ({sys.executable} -m {_GUARD}): {exc}\n"
                _send(conn, threading.Lock(), STDERR, text.encode())
                _send(conn, threading.Lock(), STATUS, b"127")
                return
            with self._lock:
                self._procs.add(proc)
                self.started.append(command)
            _send(conn, threading.Lock(), STARTED, b"")
            try:
                self._relay(conn, proc)
            finally:
                with self._lock:
                    self._procs.discard(proc)

    def _relay(self, conn: socket.socket, proc: subprocess.Popen) -> None:
        lock = threading.Lock()
        readers = [threading.Thread(target=_pump, args=(stream, conn, lock, tag), daemon=True,
                                    name="perseus-node-service-out") for stream, tag in
                   ((proc.stdout, STDOUT), (proc.stderr, STDERR))]
        for t in readers:
            t.start()
        feeder = threading.Thread(target=_feed, args=(conn, proc), daemon=True, name="perseus-node-service-in")
        feeder.start()
        while proc.poll() is None:
            feeder.join(0.2)
            if not feeder.is_alive() and getattr(feeder, "lost", False):
                end_session(proc)  # the agent is gone: so goes its command
        for t in readers:
            t.join(5.0)
        _send(conn, lock, STATUS, str(proc.returncode if proc.returncode >= 0 else 128 - proc.returncode).encode())

    def close(self) -> None:
        """Stop listening and end every command still running (SIGTERM, then SIGKILL)."""
        self._server.close()
        with self._lock:
            procs = list(self._procs)
        threads = [threading.Thread(target=end_session, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_KILL_GRACE_S + 2.0)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # let each relay tell its agent the exit status (no "lost" noise)
            with self._lock:
                if not self._procs:
                    break
            time.sleep(0.05)


def _send(conn: socket.socket, lock: threading.Lock, tag: bytes, data: bytes) -> bool:
    try:
        with lock:
            send_frame(conn, tag + data)
        return True
    except OSError:
        return False


def _pump(stream, conn: socket.socket, lock: threading.Lock, tag: bytes) -> None:
    """Copy one of the command's output pipes to the client until end of file (kept draining when the client
    is gone, so that the command never blocks on a full pipe)."""
    fd = stream.fileno()
    connected = True
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        if connected:
            connected = _send(conn, lock, tag, data)
    stream.close()


def _feed(conn: socket.socket, proc: subprocess.Popen) -> None:
    """Copy the client's input frames to the command's stdin; mark the thread ``lost`` when the connection
    drops before the command ended."""
    me = threading.current_thread()
    stdin_open = True
    while True:
        try:
            frame = recv_frame(conn)
        except (OSError, ConnectionError, ValueError):
            me.lost = proc.poll() is None  # type: ignore[attr-defined]
            break
        if frame[:1] != STDIN or not stdin_open:
            continue
        try:
            if len(frame) == 1:
                proc.stdin.close()
                stdin_open = False
            else:
                proc.stdin.write(frame[1:])
                proc.stdin.flush()
        except OSError:
            stdin_open = False
    if stdin_open:
        try:
            proc.stdin.close()
        except OSError:
            pass
