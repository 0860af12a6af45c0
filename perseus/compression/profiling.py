"""Profiling shared by the planning compressors (Cupcake, Espresso): per-key timings of the first steps,
affine fits, timed probes of a collective, and broadcasting a plan from the first rank of a process set."""

from __future__ import annotations

import pickle
import time

import numpy as np

from perseus.runtime.process_sets import ProcessSet
from perseus.base.reduce_ops import ReduceOp
from perseus.runtime.state import runtime
from perseus.runtime import collectives as c

__all__ = ["StepProfiler", "fit_affine", "probe_collective", "broadcast_from_first"]


def fit_affine(x, y) -> tuple:
    """Least-squares ``y = a + b*x`` with ``a, b >= 0``."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.size == 0:
        return 0.0, 0.0
    if x.size == 1 or np.ptp(x) == 0:
        return max(0.0, float(np.mean(y))), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return max(0.0, float(np.mean(y))), 0.0
    if a < 0:
        return 0.0, max(0.0, float(np.dot(x, y) / np.dot(x, x)))
    return float(a), float(b)


class StepProfiler:
    """What a wrapper learns while it passes each gradient through on its own: per call the key, its
    elements, when it arrived, how long the caller's thread spent in the reduction call (accumulate +
    encode + submission) and the payload bytes it produced. A step ends when a key comes a second time."""

    def __init__(self):
        self.steps: list = []      # one list of (key, elements, arrival, busy, payload bytes) per step
        self.shapes: dict = {}     # key -> the shapes of its arrays (latest call)
        self._seen: set = set()

    @property
    def step(self) -> int:
        """Index of the current step (0 for the first); -1 before the first call."""
        return len(self.steps) - 1

    def arrive(self, key: str) -> bool:
        """Note a call for ``key``; True when it starts a new step (the first call included)."""
        if not self.steps or key in self._seen:
            self.steps.append([])
            self._seen = set()
            self._seen.add(key)
            return True
        self._seen.add(key)
        return False

    def record(self, key: str, elements: int, arrival: float, busy: float, payload: int,
               shapes: tuple = ()) -> None:
        self.steps[-1].append((key, int(elements), float(arrival), float(busy), int(payload)))
        self.shapes[key] = tuple(shapes)

    def summary(self, skip: int = 0) -> dict:
        """Per key over the steps after the first ``skip`` (all steps when there are no others): backward
        order (of the last step), elements, backward seconds before it (median), busy seconds (minimum),
        payload bytes (last)."""
        steps = [s for s in self.steps if s]
        used = steps[skip:] or steps
        gaps: dict = {}
        busy: dict = {}
        elems: dict = {}
        payload: dict = {}
        for step in used:
            prev_free = None
            for key, n, arrival, t, p in step:
                gap = 0.0 if prev_free is None else max(0.0, arrival - prev_free)
                prev_free = arrival + t
                gaps.setdefault(key, []).append(gap)
                busy[key] = min(busy.get(key, np.inf), t)
                elems[key] = n
                payload[key] = p
        order = [key for key, *_ in used[-1]] if used else []
        seen = set(order)
        for step in used:  # keys absent from the last step still get planned (at the end)
            for key, *_ in step:
                if key not in seen:
                    order.append(key)
                    seen.add(key)
        return {"order": order,
                "elements": [elems[k] for k in order],
                "backward": [float(np.median(gaps[k])) for k in order],
                "busy": [float(busy[k]) for k in order],
                "payload": [payload[k] for k in order],
                "shapes": [self.shapes.get(k, ()) for k in order]}


def _set_info(process_set: ProcessSet):
    ps_id, size, rank = runtime().process_set_info(process_set)
    return size, rank, runtime().process_set_ranks(ps_id)[0]


def probe_collective(kind: str, process_set: ProcessSet, nbytes=(4096, 65536, 1 << 20), repeats: int = 3,
                     tag: str = "probe") -> list:
    """Time an ``"allgather"`` or ``"allreduce"`` (sum) of ``nbytes`` float32 bytes per rank, ``repeats``
    times each, on this rank; the best time per size (seconds).

    Collective: every rank of ``process_set`` calls it with the same arguments.
    """
    best = []
    for nb in nbytes:
        a = np.zeros(max(1, int(nb) // 4), np.float32)
        t_best = np.inf
        for r in range(repeats):
            name = f"{tag}.{kind}.{nb}.{r}"
            t0 = time.perf_counter()
            if kind == "allgather":
                h = c.allgather_async(a, lambda shape: np.empty(shape, np.float32), name=name,
                                      process_set=process_set)
            else:
                out = np.empty_like(a)
                h = c.allreduce_async(a, out, name=name, op=ReduceOp.SUM, process_set=process_set)
            c.synchronize(h)
            t_best = min(t_best, time.perf_counter() - t0)
        best.append(t_best)
    return best


def broadcast_from_first(obj, process_set: ProcessSet, tag: str):
    """The first rank of ``process_set``'s ``obj`` on every rank: pickled to uint8, then two broadcasts
    (the length, then the bytes). Collective: every rank calls it with the same ``tag``."""
    _, rank, root = _set_info(process_set)
    if rank == 0:
        data = np.frombuffer(pickle.dumps(obj, protocol=4), np.uint8).copy()
        length = np.array([data.size], np.int64)
    else:
        data, length = None, np.zeros(1, np.int64)
    got = np.zeros(1, np.int64)
    c.synchronize(c.broadcast_async(length, got, root, name=f"{tag}.len", process_set=process_set))
    if data is None:
        data = np.zeros(int(got[0]), np.uint8)
    out = np.empty(int(got[0]), np.uint8)
    c.synchronize(c.broadcast_async(data, out, root, name=f"{tag}.data", process_set=process_set))
    return obj if rank == 0 else pickle.loads(out.tobytes())
