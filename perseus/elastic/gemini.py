"""A rank's side of the Gemini checkpoint store: in-memory copies of each commit on this and other hosts.

Gemini (SOSP'23) recovers from failures with checkpoints held in CPU memory: every commit is kept on the
rank's own host and copied to a few other hosts, and after a failure the newest commit is fetched from the
fastest place that still has it. Here the memory is the checkpoint keepers' (:mod:`perseus.runner.elastic.keeper`,
one process per host, so a copy survives its rank), and the order is: this process's own memory
("memory"), its host's keeper ("local"), other hosts' keepers ("peer"), then an optional disk copy ("disk").

Where the copies go is :func:`placement` (Gemini's mixed placement, with :func:`recovery_probability`, in
:mod:`perseus.elastic.gemini_placement`); the disk copy's format is :mod:`perseus.elastic.gemini_disk`.

:class:`GeminiStore.put` pickles the payload with protocol 5, its NumPy arrays out of band, so the arrays are
sent from where they are, never copied; the payload must therefore not change after ``put`` (state
snapshots never do). One background thread sends each version to every destination in chunks, destination
after destination, then writes the disk copy when one is due. At most one version is in flight: ``put``
first waits until the previous version is handled, so a rank never queues more than one commit (with
replication "sync", ``put`` also waits for its own version). A keeper that cannot be reached is skipped (one
warning per keeper, then a 10 s pause before it is tried again) and its copy is missing; sockets have
timeouts, so a dead keeper never stops or fails the training.

Each rank has its own store and calls it alone: no collective; every rank of a job must pass the same ``ring``
so that the placements agree. The store raises ValueError for bad arguments, TypeError for a payload that
cannot be pickled, RuntimeError for a ``put`` on a closed store and LookupError when no place has a version.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import threading
import time
from typing import Callable, Optional

from perseus.base import elastic_protocol as protocol
from perseus.elastic.gemini_disk import _disk_files, _disk_path, _read_disk, _write_disk
from perseus.elastic.gemini_placement import placement, recovery_probability  # noqa: F401 - re-exported

__all__ = ["placement", "recovery_probability", "GeminiStore"]

log = logging.getLogger("perseus.elastic")


class _Job:
    """One version on its way to the keepers (and perhaps the disk)."""

    def __init__(self, version: int, owner: int, parts: list, dests: list, disk: bool):
        self.version, self.owner, self.parts, self.dests, self.disk = version, owner, parts, dests, disk
        self.started = False
        self.done = threading.Event()
        self.stored: set[str] = set()
        self.refused: set[str] = set()  # reachable keepers that did not store it


class GeminiStore:
    """Copies this rank's commits to the keepers and fetches them back (see the module doc).

    ``keepers``: host -> (address, port) of every running keeper; ``ring``: the job's hosts in order; ``host``
    and ``rank``: this rank's; ``peers``: how many other hosts receive a copy; ``replication``: "async" or
    "sync"; ``disk_dir``/``disk_every``: rank 0 also writes every ``disk_every``-th version there;
    ``on_durable(v)`` is called from the sender thread once every reachable destination stored version v;
    ``quiet()``, when given, says whether the training's own collectives are off the network now: each chunk
    waits for that, at most ``max_defer_s`` seconds.

    Raises:
        ValueError: an unknown ``replication``, or ``peers`` < 0, ``chunk_bytes`` < 1 or ``disk_every`` < 1.
    """

    CONNECT_TIMEOUT_S = 5.0
    IO_TIMEOUT_S = 30.0
    RETRY_AFTER_S = 10.0

    def __init__(self, keepers: dict[str, tuple[str, int]], ring: list[str], host: str, rank: int, token: str, *,
                 peers: int = 1, chunk_bytes: int = 4 << 20, replication: str = "async", disk_dir: str = "",
                 disk_every: int = 100, on_durable: Optional[Callable[[int], None]] = None,
                 quiet: Optional[Callable[[], bool]] = None, max_defer_s: float = 0.05, arena=None):
        if replication not in ("async", "sync"):
            raise ValueError(f"GeminiStore: replication must be 'async' or 'sync', got {replication!r}")
        if peers < 0 or chunk_bytes < 1 or disk_every < 1:
            raise ValueError(f"GeminiStore: need peers >= 0, chunk_bytes >= 1 and disk_every >= 1; got peers={peers}, "
                             f"chunk_bytes={chunk_bytes}, disk_every={disk_every}")
        self.keepers = {h: (str(a), int(p)) for h, (a, p) in keepers.items()}
        self.ring, self.host, self.rank, self.token = list(ring), host, int(rank), token
        self.peers, self.chunk_bytes, self.replication = int(peers), int(chunk_bytes), replication
        self.disk_dir, self.disk_every, self.on_durable = disk_dir, int(disk_every), on_durable
        self.quiet, self.max_defer_s = quiet, float(max_defer_s)
        self.arena = arena  # a perseus.base.elastic_shm.SharedArena: this host's keeper maps its files
        self._local_conns: dict[str, socket.socket] = {}  # used by put()'s caller only
        self._urgent = False  # someone waits for the version in flight: send without waiting for gaps
        self._cond = threading.Condition()
        self._job: Optional[_Job] = None
        self._memory: Optional[tuple[int, int, list]] = None  # (version, owner, parts) of the newest put
        self._closed = False
        self._send_conns: dict[str, socket.socket] = {}  # used by the sender thread only
        self._query_conns: dict[str, socket.socket] = {}  # used by the training thread only
        self._query_lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._sender, name="perseus-gemini-sender", daemon=True)
        self._thread.start()

    # -- the training thread's calls -----------------------------------------------------------------------------

    def destinations(self) -> list[str]:
        """The hosts whose keepers receive this rank's next version: its own host's, then its placement's."""
        out = [self.host] if self.host in self.keepers else []
        if self.peers and self.host in self.ring:
            out += [h for h in placement(self.ring, self.peers + 1)[self.host] if h in self.keepers and h not in out]
        return out

    def put(self, version: int, payload) -> None:
        """Make ``payload`` version ``version`` of this rank: kept in this process and sent to the keepers (in
        the background with "async"; before returning with "sync"). Waits first for the previous version.

        Raises:
            TypeError: the payload cannot be pickled.
            RuntimeError: the store is closed.
        """
        buffers: list[pickle.PickleBuffer] = []
        try:
            head = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            raise TypeError(f"perseus elastic: commit {version} cannot be pickled ({exc}); keep only NumPy arrays and "
                            f"plain Python objects in the state's payload") from exc
        parts = [head] + [b.raw() for b in buffers]
        with self._cond:
            while self._job is not None and not self._job.done.is_set() and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("perseus elastic: put() on a closed GeminiStore; create a new store")
            disk = bool(self.disk_dir) and self.rank == 0 and version % self.disk_every == 0
            self._urgent = False
            job = _Job(int(version), self.rank, parts, self.destinations(), disk)
            self._memory = (job.version, job.owner, parts)
        if self.arena is not None and self.host in job.dests:
            self._put_local(job)  # before the job is published: the sender thread then skips this host
        with self._cond:
            self._job = job
            self._cond.notify_all()
        if self.replication == "sync":
            job.done.wait()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the newest version to be handled; True if every destination (at
        least one) stored it."""
        with self._cond:
            job = self._job
        if job is None:
            return True
        self.hurry()
        if not job.done.wait(timeout):
            return False
        return bool(job.dests) and job.stored == set(job.dests)

    def latest(self) -> Optional[tuple[int, list[int]]]:
        """The newest version some keeper (or the disk copy, or this process) holds complete, with the sorted
        owner ranks that have a complete copy of it anywhere; None when there is none. Unreachable keepers are
        skipped."""
        found: dict[int, set[int]] = {}
        for host in self._keeper_order():
            try:
                reply, _ = self._query(host, {"op": "list"})
            except OSError:
                continue
            for owner, version in reply.get("complete", {}).items():
                found.setdefault(int(version), set()).add(int(owner))
        if self._memory is not None:
            found.setdefault(self._memory[0], set()).add(self._memory[1])
        for version, owner in _disk_files(self.disk_dir):
            found.setdefault(version, set()).add(owner)
        newest = max(found, default=None)
        return None if newest is None else (newest, sorted(found[newest]))

    def get(self, version: int, owners) -> tuple[object, str, float]:
        """Version ``version`` of the payload of one of ``owners`` (a rank, or ranks in order of preference)
        from the fastest place that has one: ``(payload, source, seconds)``, source one of "memory", "local"
        (this host's keeper), "peer" (another host's keeper), "disk". Every owner is tried at a place before
        the next, slower place is.

        Raises:
            LookupError: no place has that version (the message lists the places tried and why each failed).
        """
        owners = [int(owners)] if isinstance(owners, int) else [int(o) for o in owners]
        start = time.monotonic()
        memory = self._memory
        if memory is not None and memory[0] == version and memory[1] in owners:
            payload = pickle.loads(memory[2][0], buffers=[bytearray(p) for p in memory[2][1:]])  # own copy
            return payload, "memory", time.monotonic() - start
        tried = ["memory (holds " + (f"version {memory[0]} of rank {memory[1]})" if memory else "nothing)")]
        for host in self._keeper_order():
            for owner in owners:
                try:
                    reply, parts = self._query(host, {"op": "get", "version": int(version), "owner": owner})
                except OSError as exc:
                    tried.append(f"keeper {host} (unreachable: {exc})")
                    break
                if reply.get("op") != "data" or len(parts) != int(reply.get("parts", -1)) or not parts:
                    tried.append(f"keeper {host} for rank {owner} ({reply.get('op')})")
                    continue
                source = "local" if host == self.host else "peer"
                return pickle.loads(parts[0], buffers=parts[1:]), source, time.monotonic() - start
        if self.disk_dir:
            for owner in owners:
                try:
                    parts = _read_disk(_disk_path(self.disk_dir, version, owner))
                    return pickle.loads(parts[0], buffers=parts[1:]), "disk", time.monotonic() - start
                except (OSError, ValueError, KeyError) as exc:
                    tried.append(f"disk ({exc!r})")
        raise LookupError(f"perseus elastic: version {version} of rank(s) {owners} is in no reachable place (tried "
                          f"{'; '.join(tried)}); restore an older version, or set PERSEUS_GEMINI_DISK_DIR")

    def drop_above(self, version: int) -> None:
        """Make every reachable keeper forget versions newer than ``version`` (the job rolled back to it, so
        copies of later commits belong to a history that no longer exists). Unreachable keepers are skipped."""
        for host in self._keeper_order():
            try:
                self._query(host, {"op": "drop_above", "version": int(version)})
            except OSError:
                continue

    def set_ring(self, ring: list[str], rank: int) -> None:
        """The job was re-formed: later versions are placed on ``ring`` and belong to rank ``rank``."""
        with self._cond:
            self.ring, self.rank = list(ring), int(rank)

    def close(self) -> None:
        """Stop the sender thread (waiting at most a second) and close every connection."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for sock in list(self._send_conns.values()) + list(self._local_conns.values()):
            _shut(sock)
        self._thread.join(1.0)
        with self._query_lock:
            for sock in self._query_conns.values():
                _shut(sock)
            self._query_conns.clear()

    # -- connections ---------------------------------------------------------------------------------------------

    def _keeper_order(self) -> list[str]:
        """Own host's keeper first, then the others in ring order from this host on, then any not in the ring."""
        ring = self.ring
        at = ring.index(self.host) if self.host in ring else 0
        order = [self.host] + ring[at + 1:] + ring[:at] + sorted(self.keepers)
        return [h for i, h in enumerate(order) if h in self.keepers and h not in order[:i]]

    def _open(self, host: str) -> socket.socket:
        address, port = self.keepers[host]
        sock = protocol.connect(address, port, timeout=self.CONNECT_TIMEOUT_S)
        try:
            sock.settimeout(self.IO_TIMEOUT_S)
            protocol.send_msg(sock, {"op": "hello", "token": self.token})
            reply, _ = protocol.recv_msg(sock)
            if reply.get("op") != "ok":
                raise ConnectionRefusedError(f"keeper of {host} at {address}:{port} refused the hello: "
                                             f"{reply.get('detail', reply)}")
            return sock
        except BaseException:
            sock.close()
            raise

    def _exchange(self, conns: dict, host: str, talk: Callable[[socket.socket], object]):
        """``talk(sock)`` on the kept connection to ``host``'s keeper, opened lazily and re-opened once."""
        for attempt in (0, 1):
            sock = conns.get(host)
            kept = sock is not None
            if not kept:
                sock = conns[host] = self._open(host)
            try:
                return talk(sock)
            except OSError:
                conns.pop(host, None)
                _shut(sock)
                if not kept or attempt:
                    raise

    def _query(self, host: str, header: dict) -> tuple[dict, list[bytearray]]:
        def talk(sock):
            protocol.send_msg(sock, header)
            return protocol.recv_msg(sock)

        with self._query_lock:
            return self._exchange(self._query_conns, host, talk)

    # -- the sender thread ---------------------------------------------------------------------------------------

    def _sender(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._job is None or self._job.started):
                    self._cond.wait()
                if self._closed:
                    if self._job is not None:
                        self._job.done.set()
                    return
                job = self._job
                job.started = True
            try:
                self._send(job)
            except Exception as exc:  # noqa: BLE001 - the sender must outlive any surprise
                log.warning("perseus elastic: copying commit %d failed: %s", job.version, exc)
            finally:
                with self._cond:
                    job.done.set()
                    self._cond.notify_all()

    def _put_local(self, job: _Job) -> None:
        """Hand the version to this host's keeper by naming the shared-memory files its large parts lie in
        (nothing is copied); parts outside the arena travel with the message. Synchronous: the snapshot buffers
        of the version before may be reused as soon as this returns. On failure the sender thread sends the
        parts themselves."""
        host = self.host
        if time.monotonic() < self._down_until.get(host, 0.0):
            return
        descs, inline = [], []
        for i, part in enumerate(job.parts):
            where = self.arena.locate(part) if i else None
            if where is None:
                descs.append({"inline": len(inline)})
                inline.append(part)
            else:
                descs.append({"file": where[0], "offset": where[1], "nbytes": where[2]})
        header = {"op": "put_files", "version": job.version, "owner": job.owner, "parts": descs}

        def talk(sock):
            protocol.send_msg(sock, header, inline)
            return protocol.recv_msg(sock)[0]

        try:
            reply = self._exchange(self._local_conns, host, talk)
        except OSError as exc:
            self._down_until[host] = time.monotonic() + self.RETRY_AFTER_S
            log.warning("perseus elastic: the checkpoint keeper of %s cannot be reached (%s)", host, exc)
            return
        if reply.get("op") == "stored":
            job.stored.add(host)
        else:
            log.warning("perseus elastic: the keeper of %s did not map commit %d (%s); sending it instead", host,
                        job.version, reply.get("detail", reply))

    def _send(self, job: _Job) -> None:
        for host in job.dests:
            if host in job.stored:  # handed over already (shared memory)
                continue
            if self._closed or time.monotonic() < self._down_until.get(host, 0.0):
                continue
            try:
                reply = self._exchange(self._send_conns, host, lambda sock: self._put_version(sock, job))
            except OSError as exc:
                self._down_until[host] = time.monotonic() + self.RETRY_AFTER_S
                if host not in self._warned and not self._closed:
                    self._warned.add(host)
                    log.warning("perseus elastic: the checkpoint keeper of %s cannot be reached (%s); rank %d's "
                                "commits go on without that copy", host, exc, job.owner)
                continue
            if host in self._warned:
                self._warned.discard(host)
                log.warning("perseus elastic: the checkpoint keeper of %s is reachable again", host)
            if reply.get("op") == "stored":
                job.stored.add(host)
            else:
                job.refused.add(host)
                log.warning("perseus elastic: the keeper of %s did not store commit %d: %s", host, job.version,
                            reply.get("detail", reply))
        if job.stored and not job.refused and self.on_durable is not None and not self._closed:
            try:
                self.on_durable(job.version)
            except Exception as exc:  # noqa: BLE001 - a callback's failure must not stop the copies
                log.warning("perseus elastic: the durable-commit callback failed: %s", exc)
        if job.disk and not self._closed:
            try:
                _write_disk(self.disk_dir, job)
            except OSError as exc:
                log.warning("perseus elastic: writing commit %d to %s failed: %s", job.version, self.disk_dir, exc)

    def _put_version(self, sock: socket.socket, job: _Job) -> dict:
        views = [memoryview(p).cast("B") for p in job.parts]
        sizes = [v.nbytes for v in views]
        key = {"version": job.version, "owner": job.owner}
        protocol.send_msg(sock, dict(key, op="put_begin", nbytes_total=sum(sizes), parts=sizes))
        for i, view in enumerate(views):
            for offset in range(0, view.nbytes, self.chunk_bytes):
                if self._closed:
                    raise ConnectionAbortedError("the store was closed")
                self._wait_for_gap()
                protocol.send_msg(sock, dict(key, op="put_chunk", part=i, offset=offset),
                              [view[offset:offset + self.chunk_bytes]])
        protocol.send_msg(sock, dict(key, op="put_end"))
        return protocol.recv_msg(sock)[0]

    def hurry(self) -> None:
        """The training waits for the version in flight (its next commit, a flush, a failure): send the rest of
        it without waiting for gaps."""
        self._urgent = True

    def _wait_for_gap(self) -> None:
        """Hold the next chunk until the training's own collectives leave the network idle (``quiet()``), at
        most ``max_defer_s``: Gemini's interleaving of checkpoint traffic into the gaps of gradient traffic."""
        if self.quiet is None:
            return
        deadline = time.monotonic() + self.max_defer_s
        while not self._closed and not self._urgent and time.monotonic() < deadline:
            try:
                if self.quiet():
                    return
            except Exception:  # noqa: BLE001 - no engine (shut down between generations): nothing to wait for
                return
            time.sleep(0.001)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
