"""Files that one rank wrote, read on every rank: the root rank reads them and sends them to the others.

A distributed script usually writes its checkpoints on rank 0 only. When it later reads such a file back on
every rank (the best model for a final test, a checkpoint to resume from), the other ranks may not see it yet
(a race on one host) or at all (another host, no shared file system). :func:`root_file` makes the read safe:
the root reads the file's bytes and broadcasts them, every other rank writes them to a private temporary
copy, and every rank then loads the file with its usual loader (``torch.load``, ``keras.models.load_model``,
``model.load_weights``, ``net.load_parameters``, ``open``), each in its own way (``map_location``, devices).
:func:`root_call` gives every rank the root's answer to a question such as "does this file exist?", so that
a test such as ``if os.path.exists(checkpoint):`` takes the same branch everywhere.

Framework-neutral: the bytes travel as uint8 NumPy arrays through the engine's collectives, so these
functions work the same after ``perseus.torch``, ``perseus.tensorflow``, ``perseus.keras`` or
``perseus.mxnet`` was initialised.
"""

from __future__ import annotations

import atexit
import errno
import os
import pathlib
import shutil
import tempfile
import threading
from typing import Optional

import numpy as np

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.runtime.objects import broadcast_object
from perseus.runtime.process_sets import global_process_set

__all__ = ["root_file", "root_call"]

CHUNK_BYTES = 64 << 20  # bytes per broadcast: bounds the memory a large checkpoint needs on every rank

_lock = threading.Lock()
_copies_dir: Optional[str] = None
_copies: dict = {}  # the root's path -> this rank's latest copy of it (a directory holding it)
_count = 0


def _is_path(path) -> bool:
    return isinstance(path, (str, bytes, os.PathLike))


def _manifest(path) -> dict:
    """What the root has at ``path``: kind (file, dir, prefix, missing, none), its base name and its files."""
    if not _is_path(path):
        return {"kind": "none"}
    text = os.fsdecode(os.fspath(path))
    base = os.path.basename(text.rstrip(os.sep)) or "file"
    if os.path.isfile(text):
        return {"kind": "file", "key": os.path.abspath(text), "base": base,
                "entries": [(base, text, os.path.getsize(text))]}
    if os.path.isdir(text):
        entries = []
        for root, dirs, files in os.walk(text):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                entries.append((os.path.join(base, os.path.relpath(full, text)), full, os.path.getsize(full)))
        return {"kind": "dir", "key": os.path.abspath(text), "base": base, "entries": entries}
    folder = os.path.dirname(text) or "."
    if base and os.path.isdir(folder):  # a checkpoint prefix: ckpt -> ckpt.index, ckpt.data-00000-of-00001
        names = sorted(n for n in os.listdir(folder) if n.startswith(base)
                       and os.path.isfile(os.path.join(folder, n)))
        if names:
            return {"kind": "prefix", "key": os.path.abspath(text), "base": base,
                    "entries": [(n, os.path.join(folder, n), os.path.getsize(os.path.join(folder, n)))
                                for n in names]}
    return {"kind": "missing", "path": text}


def _private_dir(key: str) -> str:
    """A fresh directory for this rank's copy of the root's ``key``; the previous copy of it is removed."""
    global _copies_dir, _count
    with _lock:
        if _copies_dir is None:
            _copies_dir = tempfile.mkdtemp(prefix=f"perseus-root-files-{os.getpid()}-")
            atexit.register(shutil.rmtree, _copies_dir, True)
        _count += 1
        new = os.path.join(_copies_dir, str(_count))
        old = _copies.get(key)
        _copies[key] = new
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(new)
    return new


def _send(manifest: dict, root_rank: int, is_root: bool, target: Optional[str], process_set) -> None:
    """Broadcast the bytes of every file of ``manifest`` from the root, in chunks; the others write them
    under ``target``."""
    for i, (rel, source, length) in enumerate(manifest["entries"]):
        src = open(source, "rb") if is_root else None
        dst = None
        if not is_root:
            out = os.path.join(target, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            dst = open(out, "wb")
        try:
            offset = 0
            while offset < length:
                n = min(CHUNK_BYTES, length - offset)
                if is_root:
                    buf = np.zeros(n, np.uint8)  # stays zero past the end of a file cut short meanwhile:
                    view, filled = memoryview(buf), 0  # every rank expects n bytes
                    while filled < n:
                        got = src.readinto(view[filled:])
                        if not got:
                            break
                        filled += got
                else:
                    buf = np.empty(n, np.uint8)
                _c.synchronize(_c.broadcast_async(buf, buf, root_rank, f"perseus.root_file.{i}", process_set,
                                                  finish=lambda r: buf))
                if dst is not None:
                    dst.write(buf.tobytes())
                offset += n
        finally:
            for f in (src, dst):
                if f is not None:
                    f.close()


def root_file(path, root_rank: int = 0, process_set=global_process_set):
    """Return a path, on this rank, to the root rank's file (or directory, or checkpoint prefix) ``path``.

    The root reads ``path`` and broadcasts its bytes; every other rank writes them to a private temporary
    directory (removed when the process exits; a later call for the same root path replaces the earlier
    copy) under the same base name, and returns the path of that copy. The root returns ``path`` itself.
    Only the root's ``path`` matters: the others' argument is not used to find the file, so a path that
    names a different place, or nothing, on another rank is fine. A directory is copied whole; a ``path``
    that is neither a file nor a directory on the root is taken as a checkpoint prefix (every file of its
    folder whose name starts with the prefix: ``ckpt.index``, ``ckpt.data-00000-of-00001``). When the
    root's ``path`` is not a path at all (an open file, a buffer), every rank returns its own argument.
    With one rank, ``path`` is returned at once.

    Use it around the path given to a loader: ``torch.load(root_file(p))``,
    ``keras.models.load_model(root_file(p))``, ``open(root_file(p), "rb")``.

    Collective: every rank of ``process_set`` calls it, in the same order as its other collectives;
    ``root_rank`` is a job rank in the set.

    Raises:
        FileNotFoundError: on every rank, when the root has nothing at ``path``.
        OSError: on every rank, when the root cannot read it (the root's error).
        ValueError: this rank is not in ``process_set``, or the set is not registered.
    """
    _, size, _ = runtime().process_set_info(process_set)
    if size == 1:
        return path
    is_root = runtime().rank() == int(root_rank)
    manifest = None
    if is_root:
        try:
            manifest = _manifest(path)
        except OSError as e:  # every rank must learn of it, or the others would wait for the bytes forever
            manifest = {"kind": "error", "error": e}
    manifest = broadcast_object(manifest, root_rank, name="perseus.root_file.manifest", process_set=process_set)
    kind = manifest["kind"]
    if kind == "none":
        return path
    if kind == "missing":
        raise FileNotFoundError(errno.ENOENT, f"rank {root_rank} has no file, directory or checkpoint prefix "
                                "named", manifest["path"])
    if kind == "error":
        raise manifest["error"]
    target = None if is_root else _private_dir(manifest["key"])
    _send(manifest, root_rank, is_root, target, process_set)
    if is_root:
        return path
    local = os.path.join(target, manifest["base"])
    if kind == "dir":
        os.makedirs(local, exist_ok=True)
    return pathlib.Path(local) if isinstance(path, pathlib.PurePath) else local


def root_call(fn, *args, root_rank: int = 0, process_set=global_process_set, **kwargs):
    """Call ``fn(*args, **kwargs)`` on the root rank only and return its result on every rank.

    For questions about files that the root may have written and the others may not see:
    ``root_call(os.path.exists, checkpoint)``, ``root_call(glob.glob, "ckpt/*.pt")``,
    ``root_call(tf.train.latest_checkpoint, folder)``, so that every rank takes the root's branch. The result
    travels pickled (cloudpickle); an exception raised by ``fn`` on the root is raised on every rank.

    Collective: every rank of ``process_set`` calls it; only the root's ``fn`` and arguments are used.

    Raises:
        Exception: whatever ``fn`` raised on the root, on every rank.
        ValueError: this rank is not in ``process_set``, or the set is not registered.
    """
    _, size, _ = runtime().process_set_info(process_set)
    if size == 1:
        return fn(*args, **kwargs)
    outcome = None
    if runtime().rank() == int(root_rank):
        try:
            outcome = (True, fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised there
            outcome = (False, e)
    ok, value = broadcast_object(outcome, root_rank, name="perseus.root_call", process_set=process_set)
    if not ok:
        raise value
    return value
