"""What the sparse paths share at run time: handles, the stage worker, per-set and per-tensor state, stats.

A sparse reduction is a chain of collectives with NumPy work between them (Zen: push, sum at the owner,
pull, decode). The first collective is submitted on the caller's thread; each later stage runs on one
perseus-sparse worker thread as soon as the engine reports the previous collective done (``on_done``), so
the chain advances while the caller goes on (backward keeps running), and the caller only waits in
:meth:`SparseHandle.wait`.

This module holds :class:`Call`, one reduction on its way (what its stages share), and clears the per-set and
per-tensor state at every shutdown, so that every rank starts a new job alike. The handle and the worker are
:mod:`perseus.sparse._handles`, the per-tensor state and statistics :mod:`perseus.sparse._tensor_state`, the
per-set seeds and link :mod:`perseus.sparse._set_state`; their names are imported here too. A stage that
raises fails its call: the handle's ``wait()`` raises it.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from perseus.runtime.state import runtime
from perseus.sparse import choice
from perseus.sparse._handles import SparseHandle, SparseResult, _worker
from perseus.sparse._tensor_state import (  # noqa: F401 - re-exported: core, zen and the tuner read them here
    SparseStats, TensorState, _tensors, _tensors_lock, all_stats, signature, stats, tensor_state)
from perseus.sparse._set_state import (  # noqa: F401 - re-exported: core, zen and the tuner read them here
    SetState, _sets, _sets_lock, ensure_link, ensure_seeds, set_state, settings)

__all__ = ["SparseResult", "SparseHandle", "SparseStats", "stats", "all_stats"]


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
