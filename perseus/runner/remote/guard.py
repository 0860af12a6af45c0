"""``python -m perseus.runner.remote.guard PARENT COMMAND``: run ``/bin/sh -c COMMAND`` and end it with its worker
(PARENT, the process id of the worker that starts the guard).

A :class:`~perseus.runner.remote.service.NodeService` starts every command through this guard, as the leader of
a new session; the guard waits for the shell and exits with its status (the command's stdin, stdout and stderr
are the guard's own), and ends on SIGTERM when the worker's process dies (``PR_SET_PDEATHSIG``). Its watchdog, a child process, asks the kernel for SIGTERM when the guard ends
and then ends the whole session (the shell, the MPI daemon it started and the daemon's
children): SIGTERM, then SIGKILL 3 s later. The guard cannot do this itself: an engine that kills a worker may
also kill the worker's children (Ray does, with SIGKILL), which would leave the rest running.
So whether the worker dies, the service ends the session, or the command ends, nothing it started outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from perseus.runner.remote.service import die_with_parent

_GRACE_S = 3.0


def _end_group(signum, _frame) -> None:
    """The watchdog's SIGTERM: end the session's processes (SIGTERM, then SIGKILL, itself included)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches this process too
    try:
        os.killpg(0, signal.SIGTERM)
        time.sleep(_GRACE_S)
    finally:
        os.killpg(0, signal.SIGKILL)
        os._exit(128 + signum)


def _watch(guard: int) -> None:
    """The watchdog, a child of the guard (so not a child of the worker, which an engine may SIGKILL along with
    the worker): SIGTERM when the guard ends, for any reason, ends the session."""
    signal.signal(signal.SIGTERM, _end_group)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != guard:  # the guard ended before the request above took effect
        _end_group(signal.SIGTERM, None)
    while True:
        signal.pause()


def main(argv=None) -> int:
    """Run the command (see the module doc); its exit status (128 + N when signal N ended it)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: python -m perseus.runner.remote.guard PARENT_PID COMMAND", file=sys.stderr)
        return 2
    guard = os.getpid()
    die_with_parent(signal.SIGTERM)  # the worker's process died: so does the guard, and the watchdog acts
    if os.getppid() != int(argv[0]):  # the worker died before the request above took effect (the worker itself
        return 128 + signal.SIGTERM  # may be process 1, as a container's first process is)
    if os.fork() == 0:
        for fd in (0, 1, 2):  # the watchdog holds none of the command's pipes open
            os.close(fd)
        _watch(guard)
    child = subprocess.Popen(["/bin/sh", "-c", argv[1]])
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
