"""Starting and stopping the checkpoint keepers (:mod:`perseus.runner.elastic.keeper`), in the launcher.

:func:`start_keeper` starts the keeper of one host, as a child process or over ``ssh``, hands it the job's
token on its stdin and waits for the line that names its port. The keeper lives as long as that stdin stays
open. This module is what the elastic launcher needs of the keepers; it imports neither the keeper's server
nor NumPy, which the launcher has no use for.
"""

from __future__ import annotations

import collections
import os
import select
import shlex
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

__all__ = ["KeeperProcess", "start_keeper", "PORT_LINE", "KEEPER_MODULE"]

#: the first line a keeper prints to stdout, followed by its port
PORT_LINE = "PERSEUS_KEEPER_PORT"
#: the module a keeper process runs (``python -m``)
KEEPER_MODULE = "perseus.runner.elastic.keeper"
# The directory that holds this perseus package: a local keeper imports the same perseus as its launcher.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class KeeperProcess:
    """A keeper started by :func:`start_keeper`: its ``host``, ``port`` and process (``proc``, the local
    process or the ``ssh`` client)."""

    def __init__(self, host: str, port: int, proc: subprocess.Popen, stderr_tail: collections.deque):
        self.host, self.port, self.proc = host, port, proc
        self._stderr_tail = stderr_tail

    def alive(self) -> bool:
        """True while the keeper (or the ssh connection to it) is running."""
        return self.proc.poll() is None

    def stderr_tail(self) -> str:
        """The last lines the keeper wrote to stderr."""
        return "".join(self._stderr_tail).strip()

    def stop(self) -> None:
        """Close the keeper's stdin (it then exits), wait up to 5 s, then kill it."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __repr__(self) -> str:
        return f"KeeperProcess(host={self.host!r}, port={self.port}, pid={self.proc.pid}, alive={self.alive()})"


def _drain_stderr(stream, tail: collections.deque) -> None:
    for line in iter(stream.readline, b""):
        tail.append(line.decode(errors="replace"))
    stream.close()


def start_keeper(host: str, token: str, *, python: str = sys.executable, ssh_args: Sequence[str] = (),
                 local: bool, timeout: float = 20.0, bind: str = "", toward: str = "", port: int = 0,
                 remote_shell: Optional[Sequence[str]] = None) -> KeeperProcess:
    """Start the keeper of ``host``: a child process (``local``) or one reached with ``ssh -o BatchMode=yes
    [ssh_args] host`` (or ``remote_shell host``: Ray's and Spark's agent, :mod:`perseus.runner.remote.agent`). The token goes to its stdin, which stays open: closing it (:meth:`KeeperProcess.stop`,
    or this process ending) makes the keeper exit. It listens on ``bind`` (comma-separated addresses), else on
    the addresses of that machine that ``host`` resolves to there and on its address on the route to
    ``toward`` (the driver's address, which the ranks reach): the cluster network, never every interface.

    Raises:
        RuntimeError: the keeper did not report its port within ``timeout`` seconds (it is killed); the
            message names the host and ends with what the keeper wrote to stderr.
    """
    module = [python, "-m", KEEPER_MODULE, "--port", str(int(port)), "--host", host]
    module += ["--bind", bind] if bind else []
    module += ["--toward", toward] if toward else []
    if local:
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if _PACKAGE_PARENT not in paths:  # the keeper runs the same perseus as its launcher
            env["PYTHONPATH"] = os.pathsep.join(paths + [_PACKAGE_PARENT])
        cmd = module
    else:
        env = None
        remote = ["exec"]
        if os.environ.get("PYTHONPATH"):
            remote += ["env", "PYTHONPATH=" + os.environ["PYTHONPATH"]]
        shell = list(remote_shell) if remote_shell else ["ssh", "-o", "BatchMode=yes", *ssh_args]
        cmd = [*shell, host, " ".join(shlex.quote(a) for a in remote + module)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=20)
    threading.Thread(target=_drain_stderr, args=(proc.stderr, tail), name="perseus-keeper-stderr",
                     daemon=True).start()
    keeper = KeeperProcess(host, 0, proc, tail)
    try:
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.flush()
        keeper.port = _read_port(proc, timeout)
    except (OSError, RuntimeError) as exc:
        proc.kill()
        proc.wait()
        time.sleep(0.05)  # let the stderr reader take the last lines
        raise RuntimeError(f"perseus: the checkpoint keeper on {host} did not start ({exc}); check that "
                           f"{python} can import perseus there. Its stderr: {keeper.stderr_tail() or '(empty)'}"
                           ) from None
    return keeper


def _read_port(proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    fd, data = proc.stdout.fileno(), b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no {PORT_LINE} line within {timeout:g} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"it exited with status {proc.wait()} before reporting its port")
            data += chunk
    line = data.split(b"\n", 1)[0].decode(errors="replace").split()
    if len(line) != 2 or line[0] != PORT_LINE or not line[1].isdigit():
        raise RuntimeError(f"unexpected first line {data[:200]!r}")
    return int(line[1])
