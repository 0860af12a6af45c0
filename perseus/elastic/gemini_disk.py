"""The disk copy of a Gemini checkpoint: one file per version and owner rank, written atomically.

A copy is ``gemini-v<version, 12 digits>-r<owner>.ckpt``: a magic line, the length of a JSON header (8 bytes,
big-endian), the header (version, owner, the size of each part) and the parts, the pickle of the payload
first and its out-of-band buffers after it. Only the rank that writes disk copies (rank 0 of
:class:`perseus.elastic.gemini.GeminiStore`) calls :func:`_write_disk`; any rank may read a copy back.
Writing raises OSError; reading raises OSError, or ValueError for a file that is not a whole copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile

__all__: list[str] = []  # helpers of perseus.elastic.gemini

_DISK_MAGIC = b"PERSEUS-GEMINI-1\n"
_DISK_NAME = re.compile(r"^gemini-v(\d+)-r(\d+)\.ckpt$")


def _disk_files(directory: str) -> list[tuple[int, int]]:
    if not directory or not os.path.isdir(directory):
        return []
    found = (_DISK_NAME.match(name) for name in os.listdir(directory))
    return [(int(m.group(1)), int(m.group(2))) for m in found if m]


def _write_disk(directory: str, job) -> None:
    """Write ``job`` (a version on its way: ``version``, ``owner``, ``parts``) as its disk copy in ``directory``,
    then delete that owner's older copies there."""
    os.makedirs(directory, exist_ok=True)
    views = [memoryview(p).cast("B") for p in job.parts]
    header = json.dumps({"version": job.version, "owner": job.owner, "parts": [v.nbytes for v in views]}).encode()
    fd, tmp = tempfile.mkstemp(prefix=".gemini-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_DISK_MAGIC + len(header).to_bytes(8, "big") + header)
            for view in views:
                f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, _disk_path(directory, job.version, job.owner))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    with contextlib.suppress(OSError):
        os.fsync(dir_fd)  # makes the rename durable; some file systems cannot sync a directory
    os.close(dir_fd)
    for version, owner in _disk_files(directory):  # older copies of this owner are superseded
        if owner == job.owner and version < job.version:
            os.unlink(_disk_path(directory, version, owner))


def _disk_path(directory: str, version: int, owner: int) -> str:
    return os.path.join(directory, f"gemini-v{int(version):012d}-r{int(owner)}.ckpt")


def _read_disk(path: str) -> list[bytearray]:
    """The parts of a disk copy written by :func:`_write_disk`. Raises OSError or ValueError."""
    with open(path, "rb") as f:
        if f.read(len(_DISK_MAGIC)) != _DISK_MAGIC:
            raise ValueError(f"{path} is not a perseus Gemini checkpoint")
        header = json.loads(f.read(int.from_bytes(f.read(8), "big")))
        parts = []
        for size in header["parts"]:
            part = bytearray(int(size))
            if f.readinto(part) != len(part):
                raise ValueError(f"{path} is truncated")
            parts.append(part)
    return parts
