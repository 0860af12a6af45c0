"""Process sets: subsets of ranks that run collectives among themselves."""

from __future__ import annotations

from typing import Optional

__all__ = ["ProcessSet", "global_process_set", "entries", "check_ranks", "comm_ranks", "same_lists", "own_lists",
           "distinct_sets"]


class ProcessSet:
    """A set of ranks (of the job's global communicator) that run collectives together.

    Build it from a sequence of ranks, or from an mpi4py communicator (each rank its own; MPI.COMM_NULL outside).
    The object becomes usable once registered: at ``init(process_sets=[...])``, or by
    ``add_process_set()`` with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, when it gets its id.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id: Optional[int] = None
        self._member_rank: Optional[int] = None  # this process's job rank, set by the runtime while registered
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks: Optional[list[int]] = None
        else:
            try:
                ranks = sorted({int(r) for r in ranks_or_comm})
            except TypeError:
                raise ValueError("ProcessSet needs a sequence of ranks or an mpi4py communicator") from None
            self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._member_rank = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or None while it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (-1 if not a member), or None while not registered.

        Raises:
            ValueError: the global set, while perseus is not running.
        """
        if self.process_set_id is None:
            return None
        me = self._me()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set, or None while not registered.

        Raises:
            ValueError: the global set, while perseus is not running.
        """
        if self.process_set_id is None:
            return None
        return self._me() in self.ranks

    def _me(self) -> int:
        if self._member_rank is None:  # the global set while perseus is not running
            raise ValueError("perseus has not been initialized; use hvd.init().")
        return self._member_rank

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id \
            and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


# -- init(process_sets=...): what every rank passes, and the sets it forms -------------------------------

def entries(process_sets) -> list[ProcessSet]:
    """init()'s ``process_sets`` argument as a list of ProcessSet objects ([] for None and "dynamic")."""
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        return []
    return [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]


def check_ranks(ps: ProcessSet, size: int) -> None:
    """Raise ValueError unless a rank-defined set is a non-empty subset of 0..size-1."""
    if ps.ranks is not None and (not ps.ranks or any(not 0 <= r < size for r in ps.ranks)):
        raise ValueError(f"perseus: process set ranks {ps.ranks} must be a non-empty subset of 0..{size - 1}")


def comm_ranks(MPI, comm, base) -> Optional[list[int]]:
    """The ranks in ``base`` of the processes of ``comm`` (sorted), or None for MPI.COMM_NULL.

    Raises:
        ValueError: ``comm`` has processes outside ``base``.
    """
    if comm == MPI.COMM_NULL:
        return None
    members = list(range(comm.Get_size()))
    ranks = MPI.Group.Translate_ranks(comm.Get_group(), members, base.Get_group())
    if any(r == MPI.UNDEFINED for r in ranks):
        world = MPI.Group.Translate_ranks(comm.Get_group(), members, MPI.COMM_WORLD.Get_group())
        raise ValueError(f"perseus: a process set's communicator has processes outside the job's communicator "
                         f"(world ranks {list(world)})")
    return sorted(int(r) for r in ranks)


def same_lists(listed: list) -> None:
    """Raise ValueError (on every rank: each sees every rank's lists) unless every rank passed init() the same
    rank-defined process sets, in the same order."""
    differ = [r for r, mine in enumerate(listed) if mine != listed[0]]
    if differ:
        raise ValueError(f"perseus.init(process_sets=...): the ranks passed different process sets (rank 0: "
                         f"{listed[0]}; rank {differ[0]}: {listed[differ[0]]}); every rank must pass the same sets")


def own_lists(entries: list, gathered: list, rank: int) -> list:
    """The ranks of each init() entry on ``rank``: a communicator's ranks as this rank sees them; where this
    rank holds MPI.COMM_NULL and the other ranks' communicators formed exactly one set, that set (of which
    this rank is then not a member); else None."""
    out, i = [], 0
    for ps in entries:
        if ps.ranks is not None:
            out.append(ps.ranks)
            continue
        own = gathered[rank][i]
        if own is None:
            formed = {tuple(r[i]) for r in gathered if r[i] is not None}
            own = list(formed.pop()) if len(formed) == 1 else None
        out.append(own)
        i += 1
    return out


def distinct_sets(entries: list, gathered: list) -> list[list[int]]:
    """The sets init(process_sets=...) registers, in id order: first those of communicators (each entry's
    distinct rank lists over every rank, lowest first), then those of rank lists; each once."""
    out: list[list[int]] = []
    for i in range(sum(ps.ranks is None for ps in entries)):
        for ranks in sorted({tuple(r[i]) for r in gathered if r[i] is not None}):
            if list(ranks) not in out:
                out.append(list(ranks))
    for ps in entries:
        if ps.ranks is not None and ps.ranks not in out:
            out.append(list(ps.ranks))
    return out
