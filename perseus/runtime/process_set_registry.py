"""The runtime's registry of process sets: registering them, giving them ids, looking them up, removing them.

:class:`ProcessSetRegistry` is a base class of :class:`perseus.runtime.state.Runtime`, which creates the state
it works on: ``_sets`` (the registered sets by id), ``_comms`` (each set's communicator, on its members),
``_next_id``, ``_given`` (the user's sets init() gave ids), ``_base`` (the job's communicator), ``_topology``
and ``_lock``.

Registering a set (:meth:`ProcessSetRegistry.register`, :meth:`ProcessSetRegistry.add_process_set`) is
collective over the job: every rank calls it with the same ranks, and the set gets the same id on every rank.
Looking sets up and giving init()'s entries their ids are local. The methods raise ValueError when perseus is
not running, a set duplicates a registered one or is not registered, or a rank is out of range
(:class:`perseus.base.exceptions.NotAMemberError`, a ValueError, when this rank is not a member of the set),
and TypeError for something that is not a ProcessSet.
"""

from __future__ import annotations

from typing import Sequence

from perseus.runtime import process_sets as psets
from perseus.base.exceptions import NotAMemberError
from perseus.runtime.process_sets import ProcessSet
from perseus.transport.mpi import load_mpi

__all__ = ["ProcessSetRegistry"]


class ProcessSetRegistry:
    """The process sets of a :class:`perseus.runtime.state.Runtime`: its methods that register, look up and
    remove them."""

    def _process_set_lists(self, entries: list) -> list:
        """The ranks of each entry of init(process_sets=...) on this rank (None: a communicator it is not in)."""
        MPI = load_mpi()
        return [ps.ranks if ps.ranks is not None else psets.comm_ranks(MPI, ps.mpi_comm, self._base)
                for ps in entries]

    def _assign(self, lists: list, entries: list) -> None:
        """Give each entry the id of the registered set with its ranks (``lists[i]``, None for a communicator
        this rank is not in). Local.

        Raises:
            ValueError: an entry's ranks are registered under an id an earlier entry (or the global set)
                already took, or are not registered at all.
        """
        by_ranks = {tuple(ps.ranks): ps_id for ps_id, ps in self._sets.items() if not getattr(ps, "_hidden", False)}
        seen = {0: "the global process set"}
        problems = []
        for i, (ps, ranks) in enumerate(zip(entries, lists)):
            if ranks is None:  # a communicator this rank is not part of
                continue
            ps_id = by_ranks.get(tuple(ranks))
            if ps_id is None:
                problems.append(f"entry {i} ({ranks}) is not a registered process set")
                ps._invalidate()
            elif ps_id in seen:
                problems.append(f"entry {i} has the same ranks {ranks} as {seen[ps_id]}")
                ps._invalidate()
            else:
                ps.process_set_id, ps.ranks = ps_id, list(ranks)
                ps._member_rank = self._topology.rank
                seen[ps_id] = f"entry {i}"
                self._given.append(ps)
        if problems:
            raise ValueError("perseus.init(process_sets=...): " + "; ".join(problems) + ". Duplicate process sets "
                             "are not allowed. perseus is running with the distinct sets registered "
                             f"({self._get_process_set_ids_and_ranks()}); pass each set once.")

    def add_process_set(self, process_set: ProcessSet | Sequence[int]) -> ProcessSet:
        """Register a process set after init. Collective: every rank calls it with the same ranks.

        A set built from an mpi4py communicator (``ProcessSet(comm)``, or the communicator itself) is collective
        over the job too: each rank passes its own communicator (``MPI.COMM_NULL`` on a rank outside it), the
        ranks are exchanged, and every distinct set they make is registered on every rank, in the order of their
        ranks; each rank gets back the set it belongs to (a rank in none: the first).

        Raises:
            ValueError: not initialised, dynamic process sets not enabled, a set with these ranks exists,
                a rank is out of range, or a communicator has processes outside the job's.
        """
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        self.engine
        if not self.settings.dynamic_process_sets:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call init(process_sets='dynamic')) to add "
                             "process sets after init().")
        if process_set.mpi_comm is not None and process_set.ranks is None:
            return self._add_comm_set(process_set)
        return self.register(process_set)

    def _add_comm_set(self, process_set: ProcessSet) -> ProcessSet:
        """add_process_set() of a communicator-defined set (see there). Collective over the job."""
        MPI = load_mpi()
        try:
            mine = psets.comm_ranks(MPI, process_set.mpi_comm, self._base)
        except ValueError as exc:
            mine = str(exc)
        every = self._base.allgather(mine)
        failed = [(r, v) for r, v in enumerate(every) if isinstance(v, str)]
        if failed:
            raise ValueError(f"perseus.add_process_set: rank {failed[0][0]}: {failed[0][1]}")
        sets = sorted({tuple(v) for v in every if v})
        if not sets:
            raise ValueError("perseus.add_process_set: every rank passed MPI.COMM_NULL; no set to add")
        chosen = tuple(mine) if mine else sets[0]
        for ranks in sets:
            if ranks == chosen:
                process_set.ranks = list(ranks)
                self.register(process_set)
            else:
                self.register(ProcessSet(list(ranks)))
        return process_set

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Deregister ``process_set``; return False for the global set or an unregistered set."""
        engine = self.engine
        ps_id = process_set.process_set_id
        if ps_id is None or ps_id == 0 or ps_id not in self._sets:
            return False
        if not self.settings.dynamic_process_sets:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to remove process sets after init().")
        with self._lock:
            engine.remove_process_set(ps_id)
            self._sets.pop(ps_id, None)
            self._comms.pop(ps_id, None)
            process_set._invalidate()
        return True

    def register(self, ps: ProcessSet, hidden: bool = False) -> ProcessSet:
        """Register ``ps`` (collective over the job: every rank calls it with the same ranks). ``hidden``: a
        set perseus makes for itself (the hierarchical compressors' local and cross sets): it may share its
        ranks with a user's set and is left out of the listings.

        Raises:
            ValueError: a rank is out of range, or a set with these ranks exists (same on every rank).
        """
        self.engine
        psets.check_ranks(ps, self.size())
        with self._lock:
            for other in self._sets.values():
                if other.ranks == ps.ranks and not hidden and not getattr(other, "_hidden", False):
                    raise ValueError(f"A process set with the same ranks {ps.ranks} has already been registered "
                                     f"(process_set_id={other.process_set_id})")
            return self._add_set(load_mpi(), ps, hidden)

    def _add_set(self, MPI, ps: ProcessSet, hidden: bool = False) -> ProcessSet:
        """Give ``ps`` the next id, its communicator and (on members) its channels. Collective over the job."""
        ps_id = self._next_id
        self._next_id += 1
        me = self._topology.rank
        member = me in ps.ranks
        comm = self._base.Split(0 if member else MPI.UNDEFINED, me)
        if member:
            self.active_engine.add_process_set(ps_id, comm, list(ps.ranks))
            self._comms[ps_id] = comm
        ps.process_set_id = ps_id
        ps._member_rank = me
        ps._hidden = hidden
        self._sets[ps_id] = ps
        return ps

    def process_set_ranks(self, ps_id: int) -> list[int]:
        """The job ranks of registered process set ``ps_id``."""
        return self._sets[ps_id].ranks

    def _get_process_set_ids_and_ranks(self) -> dict[int, list[int]]:
        """Every registered process set id and its ranks (Horovod's test helper)."""
        self.engine
        return {ps_id: list(ps.ranks) for ps_id, ps in sorted(self._sets.items())
                if not getattr(ps, "_hidden", False)}

    def process_set_info(self, process_set: ProcessSet) -> tuple[int, int, int]:
        """``(id, size, rank_in_set)`` of a registered set this rank belongs to.

        Raises:
            TypeError: ``process_set`` is not a ProcessSet (None, a set id). ValueError: the set is not
                registered; :class:`NotAMemberError` (a ValueError): this rank is not a member.
        """
        self.engine
        if not isinstance(process_set, ProcessSet):
            raise TypeError(f"perseus: process_set must be a ProcessSet (global_process_set, or one from "
                            f"add_process_set), not {type(process_set).__name__} {process_set!r}")
        ps_id = process_set.process_set_id
        if ps_id is None or ps_id not in self._sets:
            raise ValueError(f"perseus: {process_set} is not registered; register it with init(process_sets=...) "
                             "or add_process_set()")
        ranks = self._sets[ps_id].ranks
        me = self.rank()
        if me not in ranks:
            raise NotAMemberError(f"perseus: rank {me} is not a member of process set {ps_id} (ranks {ranks}); only "
                             "members may call its collectives")
        return ps_id, len(ranks), ranks.index(me)
