"""``python -m perseus.runner.remote.agent --job FILE [ssh options] NODE COMMAND...``: ssh's stand-in inside
Ray and Spark.

``mpirun`` (PRRTE's ``plm_ssh_agent``) and perseus's elastic driver (checkpoint keepers, killing a stray
rank) run it exactly as they would run ssh. It looks ``NODE`` up in the job file (JSON, readable by its owner
only: ``{"token": "...", "nodes": {"perseus-node-0": "10.0.0.5:41234", ...}}``, written by
:func:`write_job_file` and rewritten as nodes come and go), connects to the
:class:`~perseus.runner.remote.service.NodeService` of the engine's worker there with the job's token, has it
run ``COMMAND`` (the words joined by spaces and run by ``/bin/sh -c``, as
ssh runs them), copies this process's stdin to it and its stdout and stderr back, and exits with its exit
status. ssh's options before ``NODE`` (``-o X``, ``-p N``, ``-x``, ...) are accepted and ignored. Status 255,
with one line on stderr, means the node's worker could not be reached (ssh's convention); a connection lost
after the command started ends the agent with status 0 and that line (the command died with its worker).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Optional, Sequence

from perseus.runner.remote.service import STARTED, STATUS, STDERR, STDIN, STDOUT
from perseus.runner.run_frames import recv_frame, send_frame

__all__ = ["TOKEN_ENV", "main", "split_ssh_argv", "write_job_file"]

#: the job's token in the ranks' environment (for their connection to their worker, see ``rank.py``)
TOKEN_ENV = "PERSEUS_REMOTE_TOKEN"
_CONNECT_TIMEOUT_S = 20.0
# ssh's options that take a value (the rest are flags)
_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")


def split_ssh_argv(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """Return ``(node, command words)`` from an ssh-style argument list (options before the node skipped)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and len(argv[i]) > 1:
        opt = argv[i]
        i += 1
        if opt == "--":
            break
        if opt[-1] in _WITH_VALUE and len(opt) == 2:  # "-o X": the value is the next word
            i += 1
    if i >= len(argv):
        return None, []
    return argv[i], list(argv[i + 1:])


def write_job_file(path: str, token: str, nodes: dict) -> None:
    """Write (atomically replace) the job file at ``path``, readable by its owner only."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"token": token, "nodes": dict(nodes)}, f)
    os.replace(tmp, path)


def _fail(node: str, text: str) -> int:
    print(f"perseus agent: node {node}: {text}", file=sys.stderr, flush=True)
    return 255


def _copy_stdin(sock: socket.socket) -> None:
    try:
        while True:
            data = os.read(0, 65536)
            send_frame(sock, STDIN + data)
            if not data:
                return
    except OSError:  # stdin closed or the connection gone: nothing more to send
        return


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the agent (see the module doc); returns the remote command's exit status, or 255."""
    argv = list(sys.argv[1:] if argv is None else argv)
    job_file = argv[1] if len(argv) > 1 and argv[0] == "--job" else ""
    node, words = split_ssh_argv(argv[2:] if job_file else argv)
    if node is None or not job_file:
        print("usage: python -m perseus.runner.remote.agent --job FILE [ssh options] NODE COMMAND...",
              file=sys.stderr)
        return 255
    try:
        with open(job_file) as f:
            job = json.load(f)
        nodes, token = dict(job["nodes"]), str(job["token"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _fail(node, f"cannot read the job file {job_file} ({exc}); has the job ended?")
    if node not in nodes:
        return _fail(node, f"no worker of this job runs there (known nodes: {', '.join(sorted(nodes)) or 'none'})")
    host, _, port = str(nodes[node]).rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        send_frame(sock, token.encode())
        send_frame(sock, json.dumps({"command": " ".join(words)}).encode())
    except (OSError, ValueError) as exc:
        return _fail(node, f"cannot reach its worker's service at {nodes[node]} ({exc}); did the worker die?")
    threading.Thread(target=_copy_stdin, args=(sock,), daemon=True, name="perseus-agent-stdin").start()
    started = False
    with sock:
        while True:
            try:
                frame = recv_frame(sock)
            except (OSError, ConnectionError, ValueError) as exc:
                code = _fail(node, f"lost the connection to its worker ({exc or 'closed'}); the worker or its "
                                   f"node is gone{', and so is the command' if started else ''}")
                # Once the command ran, its end is not a failure to start it: mpirun learns that its daemon is
                # gone from the daemon's own connection, as after ssh's session of a daemonized daemon ended
                # (and the job's fault tolerance, if on, can act).
                return 0 if started else code
            tag, data = frame[:1], frame[1:]
            if tag == STARTED:
                started = True
            elif tag == STDOUT:
                _write(1, data)
            elif tag == STDERR:
                _write(2, data)
            elif tag == STATUS:
                return int(data or b"255")


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError:
            return
        view = view[n:]


if __name__ == "__main__":
    sys.exit(main())
