"""Horovod-compat path: keep names and signatures identical to horovod.runner.common.util.env.

Environment helpers for the launcher: which variables may be forwarded to remote ranks, and the
rank and size a launcher (perseusrun/horovodrun, Open MPI, MPICH/PMI) put in the environment.
"""

from __future__ import annotations

import re

from perseus.common.knobs import external

__all__ = ["IGNORE_REGEXES", "LOG_LEVEL_STR", "is_exportable", "get_env_rank_and_size"]

LOG_LEVEL_STR = ["FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]

# Variables never forwarded to other hosts: shell function exports, the caller's previous
# directory, per-host GPU selections and the launcher's shared secret.
IGNORE_REGEXES = {"BASH_FUNC_.*", "OLDPWD", ".*CUDA_VISIBLE_DEVICES", "HOROVOD_SECRET_KEY"}

_IGNORE = re.compile("|".join(f"(?:{r})" for r in sorted(IGNORE_REGEXES)))

# (rank variable, size variable), most specific launcher first.
_RANK_SIZE_VARS = (
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)


def is_exportable(v: str) -> bool:
    """Return whether the environment variable named ``v`` may be forwarded to other hosts."""
    return _IGNORE.match(v) is None


def get_env_rank_and_size() -> tuple[int, int] | None:
    """Return ``(rank, size)`` set by a launcher in the environment, or ``None`` when none is set.

    Tries HOROVOD_RANK/HOROVOD_SIZE, then OMPI_COMM_WORLD_RANK/SIZE, then PMI_RANK/PMI_SIZE.
    Raise ``RuntimeError`` when only one variable of a pair is set or a value is not an integer.
    """
    for rank_var, size_var in _RANK_SIZE_VARS:
        rank, size = external(rank_var), external(size_var)
        if rank is None and size is None:
            continue
        if rank is None or size is None:
            missing = rank_var if rank is None else size_var
            raise RuntimeError(
                f"cannot determine rank and size: {size_var if rank is None else rank_var} is set but "
                f"{missing} is not; set both or neither"
            )
        try:
            return int(rank), int(size)
        except ValueError:
            raise RuntimeError(
                f"cannot determine rank and size: {rank_var}={rank!r} and {size_var}={size!r} must be integers"
            ) from None
    return None
