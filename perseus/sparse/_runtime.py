"""What the sparse paths share at run time: handles, the stage worker, per-set and per-tensor state, stats.

A sparse reduction is a chain of collectives with NumPy work between them (Zen: push, sum at the owner,
pull, decode). The first collective is submitted on the caller's thread; each later stage runs on one
perseus-sparse worker thread as soon as the engine reports the previous collective done (``on_done``), so
the chain advances while the caller goes on (backward keeps running), and the caller only waits in
:meth:`SparseHandle.wait`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np

from perseus.runtime.state import runtime
from perseus.base.exceptions import MismatchError
from perseus.base.reduce_ops import ReduceOp
from perseus.sparse import choice
from perseus.sparse.hashing import Seeds, h0_checksum
from perseus.base.exceptions import PerseusInternalError
from perseus.runtime.process_sets import global_process_set
from perseus.runtime import collectives as c
from perseus.compression.base import CHECK_LEN, put_check, verify_check
from perseus.compression.profiling import fit_affine, probe_collective

log = logging.getLogger("perseus")

__all__ = ["SparseResult", "SparseHandle", "SparseStats", "stats", "all_stats"]


class SparseResult:
    """The reduced sparse tensor: ``rows`` (int64) and ``values`` (``len(rows)`` rows, flattened to
    ``(len(rows), W)``). ``coalesced``: rows sorted and unique (every algorithm but allgather, whose rows are
    every rank's rows concatenated in rank order, as Horovod returns them)."""

    __slots__ = ("rows", "values", "coalesced", "algorithm")

    def __init__(self, rows, values, coalesced, algorithm):
        self.rows, self.values, self.coalesced, self.algorithm = rows, values, coalesced, algorithm

    def __repr__(self) -> str:
        return f"SparseResult({self.rows.size} rows, algorithm={self.algorithm!r}, coalesced={self.coalesced})"


class SparseHandle:
    """An in-flight sparse reduction. :meth:`wait` returns its :class:`SparseResult` (or raises what it
    raised, on every call); :meth:`on_done` calls back when it has finished."""

    __slots__ = ("name", "algorithm", "_event", "_lock", "_result", "_error", "_callbacks", "_engine")

    def __init__(self, name: str, algorithm: str, engine=None):
        self.name, self.algorithm = name, algorithm
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result = self._error = None
        self._callbacks: list = []
        self._engine = engine

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> SparseResult:
        """The result; raises what the reduction raised (MismatchError when the ranks disagree about the
        tensor, PerseusInternalError when the job failed)."""
        while not self._event.wait(1.0):
            failure = self._engine_failure()
            if failure is not None:
                self._resolve(error=failure)
        if self._error is not None:
            raise self._error
        return self._result

    def _engine_failure(self):
        engine = self._engine
        if engine is None:
            return None
        if runtime().active_engine is not engine:
            return PerseusInternalError(f"perseus.sparse_allreduce({self.name!r}): perseus was shut down")
        message = engine.failed
        return None if message is None else PerseusInternalError(f"perseus.sparse_allreduce({self.name!r}): "
                                                                 f"{message}")

    def on_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _resolve(self, result=None, error=None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - a callback's failure must not stop the others
                log.exception("perseus.sparse: a completion callback failed")

    def __repr__(self) -> str:
        return f"SparseHandle({self.name!r}, {self.algorithm}, {'done' if self.done() else 'in flight'})"


# -- the stage worker -----------------------------------------------------------------------------------------
class _Worker:
    def __init__(self):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def put(self, fn: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="perseus-sparse", daemon=True)
                    self._thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except BaseException:  # noqa: BLE001 - stages report their own errors; never let the thread die
                log.exception("perseus.sparse: a stage failed outside its handle")


_worker = _Worker()


# -- statistics -----------------------------------------------------------------------------------------------
class SparseStats:
    """What the latest call under a name did (read with :func:`perseus.sparse.stats`).

    ``nnz``: rows per rank before the sum (None when the algorithm does not tell: dense), ``union``: rows
    after it; ``push_imbalance`` and ``pull_imbalance``: Zen's ratios (``max n |I_i^j| / |I_i|`` and
    ``max n |S_j| / |S|``; 1 is perfect), ``receive_imbalance``: rows the busiest owner received over the
    mean; ``sent_bytes``/``received_bytes``: this rank's payload bytes to and from other ranks (headers
    included; the transport's counters in ``wire_bytes()`` count what the collectives forward too);
    ``index_bytes``: bytes of row ids or bitmaps in the pull; ``seconds``: this call on this rank;
    ``predicted``: the modelled seconds per algorithm when 'auto' chose; ``measured``: running seconds per
    algorithm (the fastest rank's), ``corrections``: running measured / predicted ratios; ``decided_by``:
    how the algorithm was picked ('explicit', 'first call', 'explore', 'auto' or 'policy')."""

    FIELDS = ("name", "algorithm", "decided_by", "ranks", "rows", "row_shape", "dtype", "nnz", "total", "union",
              "density", "aggregated_density", "push_imbalance", "pull_imbalance", "receive_imbalance",
              "sent_bytes", "received_bytes", "index_bytes", "serial_fraction", "overflowed", "seconds",
              "predicted", "measured", "corrections", "calls")
    __slots__ = FIELDS

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.get(f))

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}

    def __repr__(self) -> str:
        parts = ", ".join(f"{f}={getattr(self, f)!r}" for f in ("name", "algorithm", "union", "push_imbalance",
                                                               "pull_imbalance", "sent_bytes", "received_bytes"))
        return f"SparseStats({parts})"


class TensorState:
    """Per (process set, name): the history the 'auto' choice reads, and the latest stats."""

    __slots__ = ("key", "calls", "inflight", "choice", "history", "stats", "infos", "tried", "corrections",
                 "measured", "last_local", "table")

    def __init__(self, key):
        self.key = key
        self.calls = 0
        self.inflight: Optional[SparseHandle] = None
        self.choice: Optional[str] = None
        self.history: Optional[dict] = None
        self.stats: Optional[SparseStats] = None
        #: call number -> (algorithm, predicted seconds or None, setup work done in it)
        self.infos: "OrderedDict[int, tuple]" = OrderedDict()
        #: 'auto' decisions per algorithm; measured / predicted seconds per algorithm (running)
        self.tried: dict = {}
        self.corrections: dict = {}
        #: measured seconds per algorithm (running; every rank's smallest)
        self.measured: dict = {}
        #: (call number, seconds) of this rank's latest finished call
        self.last_local = None
        #: (rows of the dense table or None, row shape, dtype): set by each call, on the caller's thread
        self.table: Optional[tuple] = None

    def remember(self, index: int, algorithm: str, predicted: Optional[float], setup: bool) -> None:
        self.infos[index] = (algorithm, predicted, setup)
        while len(self.infos) > 8:
            self.infos.popitem(last=False)

    def observe_time(self, index: int, seconds: float) -> None:
        """Fold call ``index``'s time (the same on every rank) into the measurements of its algorithm."""
        info = self.infos.pop(index, None)
        if info is None or seconds <= 0:
            return
        algorithm, predicted, setup = info
        if setup:  # seeds, link probe or owned rows computed in that call: not what the algorithm costs
            return
        a = self._ALPHA
        old = self.measured.get(algorithm)
        self.measured[algorithm] = seconds if old is None else a * seconds + (1 - a) * old
        if predicted:
            ratio = seconds / predicted
            old = self.corrections.get(algorithm)
            self.corrections[algorithm] = ratio if old is None else a * ratio + (1 - a) * old

    _ALPHA = 0.5

    def observe(self, ranks: int, total: float, union: Optional[float], counts=None,
                imbalance: Optional[float] = None):
        """Fold one call's facts, which every rank holds identically, into exponentially weighted averages
        (``union`` None: not measured this time; the union per row before the sum is kept)."""
        h = self.history if self.history is not None else {}
        if union is None and "union_ratio" not in h:
            return
        a = self._ALPHA

        def fold(key, value):
            h[key] = float(value) if key not in h else a * float(value) + (1 - a) * h[key]
        fold("total", total)
        if union is not None:
            fold("union_ratio", float(union) / total if total > 0 else 1.0)
        mean = float(total) / max(ranks, 1)
        if counts is not None and len(counts) and mean > 0:
            fold("spread_hi", float(np.max(counts)) / mean)
            fold("spread_lo", float(np.min(counts)) / mean)
        if imbalance is not None:
            fold("imbalance", imbalance)
        self.history = h

    def workload(self, ranks: int, rows: int, row_bytes: int, index_bytes: int, width: int) -> choice.Workload:
        h = self.history
        mean = h["total"] / max(ranks, 1)
        imb = h.get("imbalance")
        return choice.Workload(ranks=ranks, rows=rows, row_bytes=row_bytes, index_bytes=index_bytes,
                               total=h["total"], nnz_max=mean * h.get("spread_hi", 1.0),
                               nnz_min=mean * h.get("spread_lo", 1.0), union=h["total"] * h["union_ratio"],
                               imbalance=imb if imb is not None else choice.prior_imbalance(ranks, h["total"]),
                               width=width)


_tensors: "OrderedDict[tuple, TensorState]" = OrderedDict()
_tensors_lock = threading.Lock()
_TENSORS_KEEP = 4096


def tensor_state(ps_id: int, name: str) -> TensorState:
    key = (ps_id, name)
    with _tensors_lock:
        st = _tensors.get(key)
        if st is None:
            st = _tensors[key] = TensorState(key)
            while len(_tensors) > _TENSORS_KEEP:
                _tensors.popitem(last=False)
        else:
            _tensors.move_to_end(key)
        return st


def stats(name: str, process_set=None) -> Optional[SparseStats]:
    """The :class:`SparseStats` of the latest finished call under ``name`` on this rank (the name given to
    the call, e.g. ``grad.emb.weight`` for DistributedOptimizer's gradient of ``emb.weight``), or None."""
    ps = global_process_set if process_set is None else process_set
    ps_id = ps.process_set_id or 0
    full = name if name.startswith("sparse.") else f"sparse.{name}"
    with _tensors_lock:
        st = _tensors.get((ps_id, full))
    return None if st is None else st.stats


def signature() -> int:
    """A 64-bit digest of the global process set's sparse tensors reduced so far in this job (names, dense
    shapes, dtypes): what the engine's step digest leaves out of the sparse path, whose collectives change
    with the algorithm and with each step's rows. 0 when there are none."""
    import hashlib

    with _tensors_lock:
        items = [(name, st.table) for (ps_id, name), st in _tensors.items() if ps_id == 0 and st.table is not None]
    if not items:
        return 0
    text = ";".join(sorted(f"{name}:{table}" for name, table in items))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def all_stats() -> dict:
    """``{name: SparseStats}`` of every tensor with a finished call (global process set names plain)."""
    with _tensors_lock:
        items = list(_tensors.items())
    out = {}
    for (ps_id, name), st in items:
        if st.stats is not None:
            short = name[len("sparse."):] if name.startswith("sparse.") else name
            out[short if ps_id == 0 else f"{short}@{ps_id}"] = st.stats
    return out


# -- per process set: agreed seeds, measured link ---------------------------------------------------------
class SetState:
    __slots__ = ("ps_id", "size", "rank", "root", "seeds", "link", "lock")

    def __init__(self, ps_id, size, rank, root):
        self.ps_id, self.size, self.rank, self.root = ps_id, size, rank, root
        self.seeds: Optional[Seeds] = None
        self.link: Optional[choice.Link] = None
        self.lock = threading.Lock()


_sets: dict = {}
_sets_lock = threading.Lock()


def set_state(process_set) -> SetState:
    st = runtime()
    ps_id, size, rank = st.process_set_info(process_set)
    with _sets_lock:
        ss = _sets.get(ps_id)
        if ss is None or ss.size != size:
            ss = _sets[ps_id] = SetState(ps_id, size, rank, st.process_set_ranks(ps_id)[0])
        return ss


def settings():
    return runtime().settings


def ensure_seeds(ss: SetState, process_set) -> Seeds:
    """The set's hash seeds: drawn on its first rank (or PERSEUS_ZEN_SEED), broadcast, and checked by an
    all-reduce of a digest of ``h0`` over a probe vector. Collective the first time on a set."""
    if ss.seeds is not None:
        return ss.seeds
    with ss.lock:
        if ss.seeds is not None:
            return ss.seeds

        cfg = settings()
        k = int(cfg.zen_hash_funcs)
        master = 0
        if ss.rank == 0:
            master = int(cfg.zen_seed) & 0x7FFFFFFFFFFFFFFF or \
                (int.from_bytes(os.urandom(8), "little") & 0x7FFFFFFFFFFFFFFF) or 1
        got = np.zeros(1, np.int64)
        c.synchronize(c.broadcast_async(np.array([master], np.int64), got, ss.root, name="perseus.sparse.seed",
                                        process_set=process_set))
        seeds = Seeds(int(got[0]), k)
        digest = h0_checksum(ss.size, seeds.h0)
        chk = np.zeros(CHECK_LEN, np.float32)
        put_check(chk, digest)
        out = np.empty_like(chk)
        c.synchronize(c.allreduce_async(chk, out, name="perseus.sparse.seed_check", op=ReduceOp.SUM,
                                        process_set=process_set))
        if not verify_check(out, digest, ss.size):
            raise MismatchError(
                "perseus.sparse: the ranks compute different partition hashes (h0) from the same seed; every "
                "rank must run the same perseus and NumPy versions (digest on this rank: "
                f"{digest:#010x})")
        ss.seeds = seeds
        return seeds


def _time_local():
    """(gamma, delta) on this machine: seconds per byte copied, per row sorted (best of 3)."""
    a = np.ones(1 << 20, np.float64)
    b = np.empty_like(a)
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    gamma = best / a.nbytes
    keys = np.random.default_rng(0).integers(0, 1 << 40, 1 << 16)
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.argsort(keys, kind="stable")
        best = min(best, time.perf_counter() - t0)
    return gamma, best / keys.size


def ensure_link(ss: SetState, process_set) -> choice.Link:
    """The set's link and machine costs: timed all-reduces (unless both PERSEUS_SPARSE_LATENCY_US and
    PERSEUS_SPARSE_BANDWIDTH_MBIT are set) fitted on the first rank, with its copy and sort timings,
    broadcast to every rank. Collective the first time on a set."""
    if ss.link is not None:
        return ss.link
    with ss.lock:
        if ss.link is not None:
            return ss.link

        cfg = settings()
        lat_us, mbit = float(cfg.sparse_latency_us), float(cfg.sparse_bandwidth_mbit)
        latency = beta = None
        if ss.size > 1 and not (lat_us > 0 and mbit > 0):
            sizes = (4096, 256 << 10, 2 << 20)
            times = probe_collective("allreduce", process_set, sizes, repeats=3, tag="perseus.sparse.probe")
            a, b = fit_affine(list(sizes), times)
            latency, beta = a, b * ss.size / (2 * (ss.size - 1))
        if lat_us > 0:
            latency = lat_us * 1e-6
        if mbit > 0:
            beta = 8.0 / (mbit * 1e6)
        gamma, delta = _time_local()
        vec = np.array([latency if latency is not None else choice.DEFAULT_LINK.latency,
                        beta if beta is not None and beta > 0 else choice.DEFAULT_LINK.beta, gamma, delta],
                       np.float64)
        out = np.empty_like(vec)
        c.synchronize(c.broadcast_async(vec, out, ss.root, name="perseus.sparse.link", process_set=process_set))
        ss.link = choice.Link(*(float(v) for v in out))
        if ss.rank == 0:
            log.info("perseus.sparse: link %.1f us per collective, %.3g ns/B; local %.3g ns/B, %.3g ns/row sorted",
                     ss.link.latency * 1e6, ss.link.beta * 1e9, ss.link.gamma * 1e9, ss.link.delta * 1e9)
        return ss.link


def _reset() -> None:
    with _sets_lock:
        _sets.clear()
    with _tensors_lock:
        _tensors.clear()
    choice._forget_tuned()


runtime().register_job_state(_reset)


# -- one call -------------------------------------------------------------------------------------------------
class Call:
    """One sparse reduction on its way: what the algorithm's stages share."""

    __slots__ = ("engine", "ps_id", "n", "rank", "table", "rows", "values", "handle", "tstate", "t0", "how",
                 "predicted", "sent", "received", "info", "set", "index")

    def __init__(self, engine, ss: SetState, table, rows, values, handle, tstate, how, predicted):
        self.engine, self.ps_id, self.n, self.rank = engine, ss.ps_id, ss.size, ss.rank
        self.set = ss
        self.table, self.rows, self.values = table, rows, values
        self.handle, self.tstate = handle, tstate
        self.t0 = time.perf_counter()
        self.how, self.predicted = how, predicted
        self.sent = self.received = 0
        self.info: dict = {}
        self.index = tstate.calls
        if tstate.last_local is not None:
            index, seconds = tstate.last_local
            table.previous = (int(seconds * 1e9), int(index))

    def peer_times(self, headers, seconds=None, indices=None) -> None:
        """Fold the previous call's time, which every rank's message carried, into the tensor's measurements
        (``headers``, or for the dense path the ``seconds`` and call ``indices`` gathered from every rank)."""
        if headers is not None:
            if not headers or any(h.size < 10 for h in headers):
                return
            seconds = np.array([h[8] for h in headers], np.float64) / 1e9
            indices = np.array([h[9] for h in headers], np.int64)
        if seconds is None or not len(seconds) or (indices != indices[0]).any() or indices[0] < 0 or \
                (seconds <= 0).any():
            return
        self.tstate.observe_time(int(indices[0]), float(seconds.min()))

    def after(self, hids, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker once the engine requests ``hids`` are done; what it raises fails the call."""
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
                self.handle._resolve(error=exc)
        self.engine.on_done([int(h) for h in hids], lambda: _worker.put(run))

    def finish(self, rows: np.ndarray, values: np.ndarray, coalesced: bool, *, nnz=None, total=None,
               union=None, push_imbalance=None, pull_imbalance=None, receive_imbalance=None,
               index_bytes=None) -> None:
        """Record the call's facts (history for 'auto', stats for people), then hand the result over."""
        t = self.table
        if total is None and nnz is not None:
            total = int(np.sum(nnz))
        ts = self.tstate
        elapsed = time.perf_counter() - self.t0
        ts.last_local = (self.index, elapsed)
        if total is not None:
            ts.observe(self.n, total, union, nnz, receive_imbalance)
        rows_known = t.rows if t.rows >= 0 else None
        ts.stats = SparseStats(
            name=t.name[len("sparse."):] if t.name.startswith("sparse.") else t.name, algorithm=t.algorithm,
            decided_by=self.how, ranks=self.n, rows=rows_known, row_shape=t.row_shape, dtype=t.dtype.name,
            nnz=None if nnz is None else [int(v) for v in nnz], total=None if total is None else int(total),
            union=None if union is None else int(union),
            density=(total / self.n / rows_known) if total is not None and rows_known else None,
            aggregated_density=(union / rows_known) if union is not None and rows_known else None,
            push_imbalance=push_imbalance, pull_imbalance=pull_imbalance, receive_imbalance=receive_imbalance,
            sent_bytes=int(self.sent), received_bytes=int(self.received), index_bytes=index_bytes,
            serial_fraction=self.info.get("serial_fraction"), overflowed=self.info.get("overflowed"),
            seconds=elapsed,
            predicted=None if self.predicted is None else {a: p.seconds for a, p in self.predicted.items()},
            measured=dict(ts.measured), corrections=dict(ts.corrections), calls=ts.calls)
        self.handle._resolve(SparseResult(rows, values, coalesced, t.algorithm))
