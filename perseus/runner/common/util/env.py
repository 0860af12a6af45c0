"""Horovod-compat path: keep names and signatures identical to horovod.runner.common.util.env.

Environment helpers for the launcher: which variables may be forwarded to remote ranks, and the
rank and size a launcher (perseusrun/horovodrun, Open MPI, MPICH/PMI) put in the environment.
"""

from __future__ import annotations

import re

from perseus.base.knobs import external

__all__ = ["IGNORE_REGEXES", "LAUNCHER_OWN_REGEXES", "LOG_LEVEL_STR", "is_exportable", "is_forwarded",
           "get_env_rank_and_size"]

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


# Variables an MPI launcher sets for one process of its own job (its rank, its daemon's contact, its
# application context). When perseusrun itself runs inside such a process, passing them on would make the
# ranks of the new job believe they belong to the outer one; the new job's launcher sets its own.
LAUNCHER_OWN_REGEXES = {"PMIX_.*", "PMI_.*", "PRTE_.*", "OMPI_COMM_WORLD_.*", "OMPI_UNIVERSE_SIZE",
                        "OMPI_FIRST_RANKS", "OMPI_APP_CTX_.*", "OMPI_NUM_APP_CTX", "OMPI_ARGV", "OMPI_COMMAND",
                        "OMPI_FILE_LOCATION", "OMPI_MCA_ess_base_.*", "OMPI_MCA_orte_.*", "OMPI_MCA_pmix.*",
                        "OMPI_MCA_initial_wdir", "HYDI_.*", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}

_LAUNCHER_OWN = re.compile("|".join(f"(?:{r})" for r in sorted(LAUNCHER_OWN_REGEXES)))


def is_exportable(v: str) -> bool:
    """Return whether the environment variable named ``v`` may be forwarded to other hosts."""
    return _IGNORE.match(v) is None


def is_forwarded(v: str) -> bool:
    """Return whether perseusrun forwards the caller's variable ``v`` to every rank: every exportable
    variable (as horovodrun) except those an MPI launcher set for the process perseusrun runs in."""
    return is_exportable(v) and _LAUNCHER_OWN.fullmatch(v) is None


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
