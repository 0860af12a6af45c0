"""A rank's side of an elastic job started by ``perseusrun --host-discovery-script``.

The launcher's driver starts each *generation* of the job with ``mpirun`` and tells the ranks, through
``PERSEUS_ELASTIC_*`` variables (knobs ``elastic_*``), where it listens, which hosts this generation has and
where the checkpoint keepers are. :class:`ElasticSession` is the rank's end of that arrangement:

* a connection to the driver, opened by ``init()``: ``hello``, a heartbeat every second, the host-change
  notifications the driver sends (handed to :data:`perseus.elastic.state.notification_manager`, so the next
  ``commit()`` raises ``HostsUpdatedInterrupt`` on every rank), its aborts after a rank failed elsewhere, and
  its word that every rank has left the training function;
* the Gemini store (:class:`perseus.elastic.gemini.GeminiStore`): each ``commit()`` goes to this host's keeper
  (as shared-memory files it maps, :mod:`perseus.base.elastic_shm`) and, with ``PERSEUS_GEMINI_PEERS``, to other
  hosts'; a rank of a later generation restores the newest commit from there;
* re-forming in process after a rank died (ULFM revoke and shrink, :meth:`ElasticSession.recover_in_process`);
* leaving: when the job must be relaunched the rank reports why, makes sure its last commit has landed, and
  exits; the driver starts the next generation.

Nothing here runs in a job without an elastic launcher: :func:`launcher_attached` is False and
:func:`session` returns None.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from perseus.base.knobs import read_knob
from perseus.runtime.state import runtime
from perseus.base import elastic_protocol as protocol
from perseus.elastic.notifications import notification_manager
from perseus.base.elastic_shm import SharedArena, job_dir
from perseus.transport.mpi import load_mpi
from perseus.elastic.gemini import GeminiStore

__all__ = ["launcher_attached", "session", "ElasticSession", "EXIT_RESET", "parse_hosts", "parse_keepers"]

log = logging.getLogger("perseus.elastic")

#: Exit status of a rank that leaves so that the job can be re-formed after a failure.
EXIT_RESET = 75
_HEARTBEAT_S = 1.0
_FLUSH_TIMEOUT_S = 30.0        # a rank that finished waits this long for its last commit's copies
_LEAVE_FLUSH_TIMEOUT_S = 10.0
_GO_TIMEOUT_S = 30.0            # the longest a rank that left its function waits for the others   # a rank leaving for a re-form waits this long (a keeper may be cut off)

_session: Optional["ElasticSession"] = None
_session_lock = threading.Lock()


def launcher_attached() -> bool:
    """True in a rank started by the elastic launcher (``PERSEUS_ELASTIC_DRIVER`` is set)."""
    return bool(read_knob("elastic_driver")[0])


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"h0:1,h1:2"`` -> ``[("h0", 1), ("h1", 2)]`` (the generation's hosts in rank order)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        host, _, slots = item.rpartition(":")
        out.append((host, int(slots)) if host else (item, 1))
    return out


def parse_keepers(text: str) -> dict[str, tuple[str, int]]:
    """``"h0=10.0.0.1:4000,h1=..."`` -> ``{"h0": ("10.0.0.1", 4000), ...}``."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        host, _, addr = item.partition("=")
        address, _, port = addr.rpartition(":")
        out[host] = (address, int(port))
    return out


def host_of_rank(hosts: list[tuple[str, int]], rank: int) -> str:
    """The host a rank runs on when ranks fill ``hosts`` slot by slot, in order (mpirun --map-by slot)."""
    first = 0
    for host, slots in hosts:
        if rank < first + slots:
            return host
        first += slots
    raise ValueError(f"rank {rank} is beyond the {first} slots of {hosts}")


def _network_quiet() -> bool:
    """True when this rank has no collective on the network (the Gemini copies then go)."""
    engine = runtime().active_engine
    return engine is None or engine.open_requests() == 0


def session(rank: int, size: int) -> Optional["ElasticSession"]:
    """This process's session with the elastic launcher, started on first use; None without a launcher.

    Raises:
        ConnectionError: the driver cannot be reached (the launcher is gone).
    """
    global _session
    if not launcher_attached():
        return None
    with _session_lock:
        if _session is None:
            _session = ElasticSession(rank, size)
        return _session


class ElasticSession:
    """The rank's connection to the elastic driver and its Gemini checkpoint store (see the module doc)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.generation = int(read_knob("elastic_generation")[0])
        self.token = read_knob("elastic_token")[0]
        self.hosts = parse_hosts(read_knob("elastic_hosts")[0])
        self.host = host_of_rank(self.hosts, rank) if self.hosts else socket.gethostname()
        self.version = 0
        self.state = None               # the state being committed (set by its first commit)
        self.episode = 0                # in-process recoveries done (the driver numbers its aborts alike)
        self.force_relaunch = False     # the driver asked for a relaunch rather than an in-process recovery
        self.recovered_in_process = False
        self._go = threading.Event()    # the driver says every rank of the generation has left its function
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        address, _, port = read_knob("elastic_driver")[0].rpartition(":")
        try:
            self._sock = protocol.connect(address, int(port), timeout=10.0)
        except OSError as exc:
            raise ConnectionError(f"perseus elastic: rank {rank} cannot reach the launcher's driver at "
                                  f"{address}:{port}: {exc}; the launcher has probably stopped") from None
        self._sock.settimeout(10.0)
        self.send({"op": "hello", "token": self.token, "rank": rank, "size": size,
                   "generation": self.generation, "host": self.host, "pid": os.getpid()})

        mpi = load_mpi()
        mpi.COMM_WORLD.Set_errhandler(mpi.ERRORS_RETURN)  # a dead peer is an error to handle, not an abort
        self._wake_r, self._wake_w = socket.socketpair()
        self._install_sigterm()
        self._store = self._make_store()
        threading.Thread(target=self._heartbeat, name="perseus-elastic-heartbeat", daemon=True).start()
        threading.Thread(target=self._receive, name="perseus-elastic-driver", daemon=True).start()
        atexit.register(self._at_exit)
        self._reported_error = False
        previous = sys.excepthook

        def report_uncaught(exc_type, exc, tb):
            # An exception outside elastic.run (data loading, the end of the script) ends the job too.
            if not self._reported_error and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
                self.report_error(exc)
            previous(exc_type, exc, tb)

        sys.excepthook = report_uncaught

    def _at_exit(self) -> None:
        """The interpreter is exiting: output flushed, then the driver told (it may end mpirun should MPI's
        finalisation hang after an in-process recovery)."""
        self._flush_std()
        self.send({"op": "bye"})

    # -- the driver connection ------------------------------------------------------------------------------

    def send(self, header: dict) -> bool:
        """Send one message to the driver; False if the connection is gone (the driver then sees a drop)."""
        with self._send_lock:
            try:
                protocol.send_msg(self._sock, header)
                return True
            except OSError:
                return False

    def _heartbeat(self) -> None:
        while not self._closed.wait(_HEARTBEAT_S):
            if not self.send({"op": "heartbeat"}):
                return

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._sock, self._wake_r], [], [], 1.0)
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                try:
                    signals = self._wake_r.recv(64)
                except OSError:
                    signals = b""
                if signal.SIGTERM in signals:
                    # mpirun is tearing this generation down (another rank failed): say so, and go.
                    self.send({"op": "exit", "reason": "terminated", "detail": "SIGTERM"})
                    self._flush_std()
                    os._exit(128 + signal.SIGTERM)
            if self._sock in ready:
                try:
                    header, _ = protocol.recv_msg(self._sock)
                except (OSError, protocol.WireError):
                    return
                op = header.get("op")
                if op == "go":
                    self._go.set()
                elif op == "hosts_updated":
                    notification_manager.handle_hosts_updated(float(header["timestamp"]), int(header["update"]))
                elif op == "abort":
                    if header.get("relaunch"):
                        self.force_relaunch = True  # leave for the next generation, whatever happened before
                    elif int(header.get("episode", 0)) < self.episode:
                        continue  # a failure this rank has already recovered from in process
                    self._abort_engine(str(header.get("detail", "another rank failed")))

    @staticmethod
    def _abort_engine(detail: str) -> None:
        """The driver saw a rank fail: fail this rank's pending collectives now (they would otherwise wait for
        the dead rank until a timeout), so that the training function gets ``HorovodInternalError``."""
        try:
            if runtime().is_initialized():
                runtime().engine.abort(f"perseus elastic: {detail}")
        except Exception as exc:  # noqa: BLE001 - the engine may be shutting down already
            log.debug("abort after a failure elsewhere: %s", exc)

    def _install_sigterm(self) -> None:
        """Let the receiver thread hear SIGTERM at once, whatever the main thread is doing (a signal's Python
        handler only runs when the main thread next executes Python code)."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._wake_w.setblocking(False)
            previous_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
            if previous_fd != -1:  # someone else (an event loop) owns the wake-up fd: leave it to them
                signal.set_wakeup_fd(previous_fd)
                return
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, lambda *_: None)  # the receiver thread acts on it
        except (ValueError, OSError):
            pass

    # -- Gemini ------------------------------------------------------------------------------------------------

    def _make_store(self):
        keepers = parse_keepers(read_knob("elastic_keepers")[0])
        ring = [h for h, _ in self.hosts] or [self.host]
        self.arena = None
        directory = job_dir(self.token, self.host) if self.host in keepers else None
        if directory is not None:  # snapshot buffers in shared memory: this host's keeper maps them
            try:
                self.arena = SharedArena(directory)
            except OSError as exc:
                log.warning("perseus elastic: no shared memory at %s (%s); commits travel to the keeper over TCP",
                            directory, exc)
        return GeminiStore(
            keepers, ring, self.host, self.rank, self.token, peers=int(read_knob("gemini_peers")[0]),
            chunk_bytes=int(read_knob("gemini_chunk_bytes")[0]),
            replication="sync" if read_knob("gemini_sync")[0] else "async", disk_dir=read_knob("gemini_disk_dir")[0],
            disk_every=int(read_knob("gemini_disk_every")[0]),
            on_durable=lambda v: self.send({"op": "durable", "version": int(v)}), quiet=_network_quiet,
            max_defer_s=float(read_knob("gemini_max_defer_ms")[0]) / 1000.0, arena=self.arena)

    @property
    def store(self):
        return self._store

    def commit(self, state) -> None:
        """Hand the state's latest snapshot to the keepers as the next version (every rank, at every commit),
        once the snapshot is complete (a ``TorchState`` copies its tensors in the background)."""
        self.version += 1
        version = self.version
        self.state = state
        state._after_snapshot(lambda: self._store.put(version, state.snapshot_payload()))

    def _settle(self) -> None:
        """Wait for the state's snapshot in progress and its hand-over to the store; copies still travelling
        go at once, without waiting for gaps in the training's traffic (there is no more training here)."""
        self._store.max_defer_s = 0.0
        self._store.hurry()
        state = getattr(self, "state", None)
        if state is not None:
            try:
                state._wait_snapshot()
            except Exception as exc:  # noqa: BLE001 - leaving anyway
                log.warning("perseus elastic: the last snapshot did not complete: %s", exc)

    def restore(self, state, bcast_object) -> Optional[int]:
        """Put the newest committed state back at the start of a later generation (a collective: every rank
        calls it). Rank 0 finds the newest version the keepers (or the disk copy) hold, fetches one copy of it
        from the fastest place (this host's keeper, another host's, the disk) and loads it; the other ranks
        receive it through the ``state.sync()`` that follows (in data-parallel training every rank commits the
        same state). Returns the version, or None when nothing was ever committed (the job then starts from the
        state the script built).

        Raises:
            LookupError: rank 0 cannot fetch the version it found (no place holding it is reachable any more).
        """
        found = None
        if self.rank == 0:
            latest = self._store.latest()
            if latest is not None:
                version, owners = latest
                found = int(version)
                payload, source, seconds = self._store.get(version, owners)
                state.load_snapshot_payload(payload)
                state.restore()
                self._store.drop_above(version)
                log.warning("perseus elastic: generation %d restored commit %d (%s copy) in %.3f s",
                            self.generation, version, source, seconds)
                self.send({"op": "restored", "version": version, "source": source, "seconds": float(seconds)})
            else:
                log.warning("perseus elastic: generation %d starts from the script's initial state: no commit "
                            "was found in the keepers", self.generation)
                self.send({"op": "restored", "version": None, "source": "none", "seconds": 0.0})
        found = bcast_object([found])[0]  # a list on every rank: the broadcast's name follows the object's type
        if found is not None:
            self.version = found
        return found

    # -- re-forming in process (ULFM) ---------------------------------------------------------------------------

    @property
    def in_process(self) -> bool:
        """True when the launcher started this generation with MPI's fault-tolerance extension on and
        in-process recovery is allowed (knob ``elastic_in_process``)."""
        if not read_knob("elastic_in_process")[0] or self.force_relaunch:
            return False

        return hasattr(load_mpi().Comm, "Shrink")

    def recover_in_process(self, comm, init) -> bool:
        """Re-form the job among the ranks still alive, without restarting them; True on success.

        Every surviving rank calls this after ``HorovodInternalError``: perseus is shut down, ``comm`` (the
        communicator perseus ran on) is revoked so that no survivor keeps waiting in it, and shrunk to the
        ranks still alive (MPI agrees on the set); ``init(new_comm)`` starts perseus again. Ranks are numbered
        anew in their old order. The driver is told, and decides whether the smaller job may go on. False (the
        caller then leaves for a relaunch) when MPI cannot shrink the communicator.
        """
        start = time.monotonic()
        old_rank = self.rank
        runtime().shutdown()
        try:
            comm.Revoke()
        except Exception:  # noqa: BLE001 - already revoked by another survivor, or nothing to revoke
            pass
        try:
            new = comm.Shrink()
        except Exception as exc:  # noqa: BLE001 - no ULFM at run time: relaunch instead
            log.warning("perseus elastic: rank %d cannot re-form the job in process (%s); leaving for a relaunch",
                        old_rank, exc)
            return False

        new.Set_errhandler(load_mpi().ERRORS_RETURN)
        self.rank, self.size = new.Get_rank(), new.Get_size()
        ring = []
        for host in new.allgather(self.host):
            if host not in ring:
                ring.append(host)
        self.version = new.bcast(self.version, root=0)
        self._store.set_ring(ring, self.rank)
        if self.rank == 0:  # copies of commits after the one every rank went back to belong to no history now
            self._store.drop_above(self.version)
        self.episode += 1
        self.recovered_in_process = True
        init(new)
        if self.force_relaunch:  # the driver asked for a relaunch while this rank was re-forming
            return False
        seconds = time.monotonic() - start
        self.send({"op": "recovered", "rank": self.rank, "size": self.size, "old_rank": old_rank,
                   "seconds": seconds, "episode": self.episode})
        if self.rank == 0:
            log.warning("perseus elastic: job re-formed in process on %d rank(s) in %.3f s", self.size, seconds)
        return True

    # -- leaving -----------------------------------------------------------------------------------------------

    def report_done(self) -> None:
        """The training function returned on this rank: its last commit is flushed and the driver told."""
        self._settle()
        self._store.flush(_FLUSH_TIMEOUT_S)
        self.send({"op": "exit", "reason": "done", "detail": ""})
        self._wait_for_the_others()

    def _wait_for_the_others(self) -> None:
        """Wait until the driver says every rank has left the training function (at most a while): a rank
        that shut perseus down at once could fail a slower rank's last collective, still in flight."""
        if not self._go.wait(_GO_TIMEOUT_S):
            log.warning("perseus elastic: rank %d did not hear from the driver that every rank left within %g s; "
                        "going on", self.rank, _GO_TIMEOUT_S)

    def report_error(self, error: BaseException) -> None:
        """An exception from the user's code ends the job: tell the driver what it was (type, message and
        where), so that it can say so and stop instead of re-forming the job around a bug."""
        self._reported_error = True
        tail = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-3:]).strip()
        self.send({"op": "exit", "reason": "error", "detail": f"{type(error).__name__}: {error}\n{tail}"})

    def leave_for_reset(self, error: BaseException, graceful: bool) -> None:
        """Leave so that the driver re-forms the job; never returns.

        ``graceful`` (hosts changed; every rank raised at the same commit and the engine still works): the last
        commit is flushed, perseus and MPI are shut down and the process exits 0. Otherwise (a collective
        failed, perhaps because a peer died) the last commit is flushed as far as it can be and the process
        exits with :data:`EXIT_RESET` at once.
        """
        self._settle()
        durable = self._store.flush(_LEAVE_FLUSH_TIMEOUT_S)
        if not durable:
            log.warning("perseus elastic: rank %d leaves with its last commit not fully copied", self.rank)
        reason = "hosts changed" if graceful else f"{type(error).__name__}: {error}"
        self.send({"op": "exit", "reason": "reset", "detail": reason})
        if graceful:
            self._wait_for_the_others()
        code = EXIT_RESET
        if graceful and self.recovered_in_process:
            # MPI_Finalize can wait for ever on a job that lost a process: leave without it.
            try:
                runtime().shutdown()
                code = 0
            except Exception as exc:  # noqa: BLE001 - said, and the process leaves with EXIT_RESET anyway
                log.warning("perseus elastic: shutdown before the re-form failed: %s", exc)
        elif graceful:
            try:
                runtime().shutdown()

                mpi = load_mpi()
                if mpi.Is_initialized() and not mpi.Is_finalized():
                    mpi.Finalize()
                code = 0
            except Exception as exc:  # noqa: BLE001 - leaving anyway; the driver re-forms the job
                log.warning("perseus elastic: clean shutdown before the re-form failed: %s", exc)
        self.close()
        self._flush_std()
        os._exit(code)

    def close(self) -> None:
        self._closed.set()
        try:
            self._store.close()
        except Exception:  # noqa: BLE001 - leaving: the keepers hold the commit; a local copy that cannot close is lost
            pass
        try:
            self._sock.close()
        except OSError:
            pass

    @staticmethod
    def _flush_std() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream: there is nowhere left to say it
                pass
