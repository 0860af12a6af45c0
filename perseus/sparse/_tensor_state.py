"""Per tensor of the sparse paths: the history the 'auto' choice reads, and the statistics of the latest call.

One :class:`TensorState` per (process set, name), kept for the most recently used names (every rank folds
the same facts into it, so every rank's 'auto' choice agrees); :func:`stats`, :func:`all_stats` and
:func:`signature` read them on this rank alone: nothing here is collective, and nothing raises of its own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from perseus.sparse import choice
from perseus.sparse._handles import SparseHandle
from perseus.runtime.process_sets import global_process_set

__all__ = ["SparseStats", "TensorState", "tensor_state", "stats", "signature", "all_stats"]


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
