"""Process sets: subsets of ranks that run collectives among themselves."""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A set of ranks (of the job's global communicator) that run collectives together.

    Build it from a sequence of ranks, or from an mpi4py communicator (only at ``init(process_sets=...)``).
    The object becomes usable once registered: at ``init(process_sets=[...])``, or by
    :func:`add_process_set` with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id: Optional[int] = None
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

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or None while it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set (-1 if not a member), or None while not registered."""
        if self.process_set_id is None:
            return None
        from perseus.common.basics import state

        me = state().rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set, or None while not registered."""
        if self.process_set_id is None:
            return None
        from perseus.common.basics import state

        return state().rank() in self.ranks

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


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set after init; see :meth:`perseus.common.basics.PerseusBasics.add_process_set`."""
    from perseus.common.basics import state

    return state().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregister a process set; see :meth:`perseus.common.basics.PerseusBasics.remove_process_set`."""
    from perseus.common.basics import state

    return state().remove_process_set(process_set)
