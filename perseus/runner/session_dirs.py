"""Open MPI session directories left behind by dead ``mpirun`` processes and MPI daemons.

Open MPI 5 (PRRTE and PMIx) keeps each ``mpirun``'s rendezvous files in ``$TMPDIR/ompi.<pid>``, and each MPI
daemon's (``prted``, started on another node through ssh or perseus's agent) in ``$TMPDIR/prted.<pid>``
(``/tmp`` when TMPDIR is unset). A process that ends normally removes its directory; one that is killed
(SIGKILL, an out-of-memory kill, a job scheduler's time limit, a node service ending its command) leaves it
behind. When a later ``mpirun`` or daemon happens to get the same process id (Linux reuses ids; many
machines wrap at 32768), its PMIx server finds the old files and fails at once: ``mpirun`` exits with status
213, "The PMIx server's listener thread failed to start". The launchers remove such leftovers before they
start ``mpirun``, and a node service before it starts a daemon.

A directory is removed only when all of these hold: its name is exactly ``ompi.<digits>`` or
``prted.<digits>``, it belongs to this user, no process with that id exists, and no PMIx server named in its
rendezvous files (``pmix.*``, whose first line ends in ``tcp4://ADDRESS:PORT``) still listens. The last check
keeps the directories of jobs that run in another process-id namespace (a container or a ``unshare --pid``
sandbox sharing ``/tmp``), whose ids this process cannot see but whose listening ports it can.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

from perseus.base.knobs import external

__all__ = ["stale_session_dirs", "remove_stale_session_dirs"]

_NAME = re.compile(r"(?:ompi|prted)\.(\d+)")
_URI = re.compile(r"tcp[46]?://\[?[0-9A-Fa-f.:]+\]?:(\d+)")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _listening_ports() -> set:
    """The TCP ports something listens on in this network namespace (from /proc/net/tcp and tcp6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == _LISTEN:
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except (OSError, ValueError):  # no such table (no IPv6), or a line not in its format: none from it
            continue
    return ports


def _server_ports(path: str) -> set:
    """The TCP ports of the PMIx servers named in a session directory's rendezvous files."""
    ports = set()
    try:
        names = [n for n in os.listdir(path) if n.startswith("pmix.")]
    except OSError:
        return ports
    for name in names:
        try:
            with open(os.path.join(path, name), errors="replace") as f:
                first = f.readline(4096)
        except OSError:  # removed meanwhile, or not a file
            continue
        match = _URI.search(first)
        if match is not None:
            ports.add(int(match.group(1)))
    return ports


def _base(tmpdir: Optional[str]) -> str:
    return tmpdir or external("TMPDIR") or "/tmp"


def stale_session_dirs(tmpdir: Optional[str] = None) -> list:
    """Paths of this user's Open MPI session directories in ``tmpdir`` (default: $TMPDIR or /tmp) whose
    ``mpirun`` or daemon no longer exists and whose PMIx server no longer listens. Never raises: an unreadable
    directory has no leftovers to report."""
    base = _base(tmpdir)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    uid = os.getuid()
    listening = None
    out = []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:  # removed meanwhile
            continue
        if st.st_uid != uid or not os.path.isdir(path) or os.path.islink(path) or _alive(int(match.group(1))):
            continue
        if listening is None:
            listening = _listening_ports()
        if not _server_ports(path) & listening:
            out.append(path)
    return sorted(out)


def remove_stale_session_dirs(tmpdir: Optional[str] = None) -> list:
    """Remove :func:`stale_session_dirs` and return the paths removed. Local; never raises (a directory that
    cannot be removed is left as it is and not returned)."""
    removed = []
    for path in stale_session_dirs(tmpdir):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


if __name__ == "__main__":  # python -m perseus.runner.session_dirs: clean up, say what was removed
    for gone in remove_stale_session_dirs():
        print(f"removed {gone} (its mpirun no longer runs)")
