"""Snapshot buffers in shared memory, so that a rank's own host keeps its commit without a copy.

A rank's snapshot (:mod:`perseus.torch.elastic.snapshot`) is copied into buffers anyway. Under the elastic
launcher those buffers are files in ``/dev/shm`` (one directory per job and host, :func:`job_dir`), mapped into
the rank's memory: the copy *is* the host's copy. Handing a commit to its host's keeper is then a message
naming the files; the keeper maps them read-only and keeps them mapped, so the commit outlives the rank (a
``kill -9`` loses nothing) without a byte of it moving. Only copies for other hosts, and restores, move data.

:class:`SharedArena` allocates the buffers (NumPy memory maps, one file each, named after the process id) and
tells which file and offset a buffer lies at (:meth:`SharedArena.locate`). Files of a process that is gone are
removed by the keeper once it no longer needs them, and the job's directory when the keeper exits.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import threading
from typing import Optional

import numpy as np

__all__ = ["SHM_ROOT", "job_dir", "SharedArena", "owner_pid", "pid_alive"]

SHM_ROOT = "/dev/shm"


def job_dir(token: str, host: str, root: str = SHM_ROOT) -> Optional[str]:
    """The shared-memory directory of one job on one host, or None where there is no usable ``/dev/shm``
    (the commits then travel to the keeper over TCP)."""
    if not token or not os.path.isdir(root) or not os.access(root, os.W_OK):
        return None
    tag = hashlib.sha256(token.encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in host) or "host"
    return os.path.join(root, f"perseus-{tag}", safe)


def owner_pid(path: str) -> Optional[int]:
    """The process id a buffer file was made by (``p<pid>-...``), or None."""
    name = os.path.basename(path)
    if not name.startswith("p"):
        return None
    head = name[1:].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class SharedArena:
    """Buffers of one process mapped from files in ``directory`` (see the module doc).

    Raises:
        OSError: the directory cannot be created.
    """

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._spans: list[tuple[int, int, str]] = []  # (start, nbytes, path), sorted by start
        self._names = itertools.count()

    def allocate(self, shape, dtype: np.dtype) -> np.ndarray:
        """A zeroed array of ``shape`` and ``dtype`` backed by a new file of this arena.

        Raises:
            OSError: the shared memory is full (ENOSPC) or the file cannot be made; the caller falls back to
                ordinary memory.
        """
        path = os.path.join(self.directory, f"p{os.getpid()}-{next(self._names)}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        # The pages are reserved first: a full /dev/shm is then an OSError here, not a SIGBUS at the first write.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        # A plain ndarray over the map (its base keeps the map): a memmap would pickle its bytes in band.
        array = np.memmap(path, dtype=dtype, mode="r+", shape=tuple(shape)).view(np.ndarray)
        start = array.ctypes.data
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._spans.insert(i, (start, nbytes, path))
        return array

    def release(self, array: np.ndarray) -> None:
        """Forget ``array``'s file and remove it (a keeper that maps it keeps its pages)."""
        start = array.ctypes.data
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                _, _, path = self._spans.pop(i)
                self._starts.pop(i)
            else:
                return
        try:
            os.unlink(path)
        except OSError:
            pass

    def locate(self, buffer) -> Optional[tuple[str, int, int]]:
        """``(path, offset, nbytes)`` of a buffer lying inside one of this arena's files, else None."""
        view = memoryview(buffer).cast("B")
        if view.nbytes == 0:
            return None
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        with self._lock:
            i = bisect.bisect(self._starts, address) - 1
            if i < 0:
                return None
            start, nbytes, path = self._spans[i]
        offset = address - start
        if offset + view.nbytes > nbytes:
            return None
        return path, offset, view.nbytes
