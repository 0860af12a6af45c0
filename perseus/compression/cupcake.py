"""Cupcake: fuse consecutive gradients before compressing them, with the optimal grouping for a timeline model.

A communicating compressor pays a fixed cost per call (Python dispatch, allocation, one collective's
latency) on top of the work per byte; compressing each gradient on its own pays it once per layer. Cupcake
groups gradients that become ready one after another during backward into *consecutive* groups; each group
is compressed once, as one vector, and travels in one collective.

The planner (:func:`plan_fusion`, with the timeline model it optimises and :func:`simulate`, in
:mod:`perseus.compression.cupcake_plan`) picks the partition that minimises the modelled iteration time.

:class:`Cupcake` wraps any :class:`~perseus.compression.base.Reducer`: it profiles the job's first steps,
plans on the first rank of the process set, broadcasts the plan, and from then on reduces each group
through the wrapped compressor as one call (``Compression.cupcake(Compression.topk(0.01))``).

Semantics: a compressor that selects entries (top-k) selects *across the group* once gradients are fused:
the ``density`` fraction of the group's entries with the largest magnitudes, wherever they lie (a global
top-k), not ``density`` of every gradient. Error feedback keeps one residual per group.

Every rank of the process set must reduce the same keys in the same order: planning runs collectives
(``cupcake.probe.*``, ``cupcake.plan.*``) at the same call on every rank. :class:`Cupcake` raises TypeError
for an ``inner`` that is not a communicating compressor and ValueError for bad arguments or a gradient it
cannot reduce; :func:`merge_residuals` is local.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Optional, Sequence

import numpy as np

from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import ReduceOp
from perseus.compression.base import Pending, Reducer
from perseus.compression.cupcake_plan import plan_fusion, plan_fusion_brute_force, simulate  # noqa: F401 - re-exported
from perseus.compression.profiling import (  # noqa: F401 - re-exported
    StepProfiler, _set_info, broadcast_from_first, fit_affine, probe_collective)

__all__ = ["plan_fusion", "simulate", "plan_fusion_brute_force", "Cupcake", "StepProfiler", "fit_affine",
           "probe_collective", "broadcast_from_first", "merge_residuals"]

log = logging.getLogger("perseus")


def merge_residuals(reducer: Reducer, new_key: str, old_keys: Sequence[str], sizes: Sequence[int],
                    shapes: Sequence[tuple] = ()) -> None:
    """Carry the residuals of ``old_keys`` (``sizes`` entries each; ``shapes``: the shapes of each key's
    arrays) into the residual of ``new_key``, their concatenation in that order (zeros where a key has none),
    and drop the old keys' state: no residual mass is lost when gradients reduced one by one start being
    reduced as one group (whose arrays are the old keys' arrays, in that order).

    Uses :meth:`Reducer.merge_residuals` when the reducer has one (a compressor with other per-key state
    decides what to carry), else the base class's per-key state directly.
    """
    own = getattr(reducer, "merge_residuals", None)
    if own is not None:
        own(new_key, list(old_keys), list(sizes), list(shapes))
        return
    total = int(sum(sizes))
    parts, velocity_parts = [], []
    for key, n in zip(old_keys, sizes):
        r = reducer.residual(key)
        parts.append(r if r is not None and r.size == n else np.zeros(int(n), np.float32))
        old = reducer._states.get(key)
        v = None if old is None else old.extra.get("velocity")
        velocity_parts.append(v if v is not None and v.size == n else None)
    with reducer._lock:
        for key in old_keys:
            reducer._states.pop(key, None)
    group_shapes = tuple(s for per_key in shapes for s in per_key)
    try:
        st = reducer._state(new_key, total, group_shapes)
    except TypeError:  # a base class whose per-key state does not track shapes
        st = reducer._state(new_key, total)
    if reducer.error_feedback:
        st.residual = np.concatenate(parts).astype(np.float32, copy=False) if parts else \
            np.zeros(0, np.float32)
    velocities = [v for v in velocity_parts if v is not None]
    if velocities:  # momentum correction's velocities travel with the residuals
        st.extra["velocity"] = np.concatenate([v if v is not None else np.zeros(int(n), np.float32)
                                               for v, n in zip(velocity_parts, sizes)]).astype(np.float32,
                                                                                            copy=False)


# -- the wrapper ------------------------------------------------------------------------------------------------
class _Batch:
    """The gradients of one group that arrived this step and have not been submitted yet."""

    __slots__ = ("group", "entries", "params", "pending", "offsets")

    def __init__(self, group, params):
        self.group = group
        self.entries: dict = {}    # key -> (arrays, outputs)
        self.params = params
        self.pending = None
        self.offsets: dict = {}    # key -> (first output index, count)


class _Group:
    __slots__ = ("keys", "name", "sizes", "batch")

    def __init__(self, keys, sizes):
        self.keys = tuple(keys)
        self.sizes = tuple(int(n) for n in sizes)
        self.name = keys[0] if len(keys) == 1 else f"cupcake[{keys[0]}..{keys[-1]}]"
        self.batch: Optional[_Batch] = None


def _partial_name(keys) -> str:
    digest = hashlib.blake2s("\0".join(keys).encode(), digest_size=8).hexdigest()
    return f"cupcake.partial.{digest}"


class Cupcake(Reducer):
    """Fuse consecutive gradients into groups planned for the least iteration time, and reduce each group
    through ``inner`` as one compressed vector (``Compression.cupcake(Compression.topk(0.01))``).

    Life cycle, per instance (give each optimizer its own):

    1. *Warm-up and profiling*: for the first ``warmup_steps + profile_steps`` steps every gradient goes
       through ``inner`` on its own. The wrapper records each key's size, arrival order and arrival time, the
       seconds the caller spent in ``inner.reduce_async`` (accumulate + encode + submit: the model's encode
       time, on the compute thread) and the payload bytes it produced. Warm-up steps are not used for timing
       (first calls allocate buffers and calibrate top-k selectors). A step ends when a key comes again.
    2. *Planning*, at the first call of the next step, collective over the process set: unless ``comm_cost``
       is given, every rank times the inner compressor's collective (all-gather, or all-reduce for one that
       sums its payloads) of 4 KB, 64 KB and 1 MB per rank (3 times each, best kept); the
       first rank of the set fits ``h`` (encode seconds vs dense bytes over the profiled keys), the payload
       (bytes vs dense bytes) and ``g`` (probe seconds vs payload bytes per rank), runs :func:`plan_fusion`
       and broadcasts the plan (key names, not positions) to every rank. Each key's residual is carried into
       its group's residual (concatenated in plan order): no residual mass is lost.
    3. *Fused*: each group's gradients are held as they arrive and submitted as one
       ``inner.reduce_async(group name, all arrays, all outputs)`` when the last one arrives; every key's
       :class:`Pending` waits on its group's. A group of one keeps the key's own name; a larger one is named
       ``cupcake[<first key>..<last key>]``. Keys the plan does not know (never seen while profiling) are
       reduced alone.

    If ``wait()`` is called on a key whose group is still incomplete (a framework that waits tensor by
    tensor, or a step that skips some gradients), the keys of that group held so far are submitted at once
    as a *partial group* named ``cupcake.partial.<blake2s of their names>``, with its own residual; every
    rank makes the same partial groups when it makes the same calls in the same order.

    Top-k over a fused group selects across the group (a global top-k), not per gradient.

    Args:
        inner: the compressor that reduces every gradient or group (a :class:`Reducer`).
        plan: ``'auto'`` (profile, then plan), or a list of groups of keys (every rank must pass the same;
            used from the first call, with no profiling).
        profile_steps: steps timed before planning (after the warm-up steps).
        warmup_steps: steps passed through before timing starts.
        encode_cost: ``(alpha_h, beta_h)`` seconds per call and per dense byte, instead of the measurement.
        comm_cost: ``(alpha_g, beta_g)`` seconds per collective and per dense byte (the encoded size
            included), instead of the probe and the payload fit.

    Raises:
        TypeError: ``inner`` is not a communicating compressor.
        ValueError: a bad ``plan``, ``profile_steps`` < 1 or ``warmup_steps`` < 0.
    """

    kind = "cupcake"
    default_error_feedback = False

    def __init__(self, inner: Reducer, plan="auto", profile_steps: int = 1, warmup_steps: int = 1,
                 encode_cost: Optional[tuple] = None, comm_cost: Optional[tuple] = None):
        if not isinstance(inner, Reducer):
            raise TypeError(f"perseus: Compression.cupcake(inner): inner must be a communicating compressor such "
                            f"as Compression.topk(0.01), not {inner!r}")
        if int(profile_steps) < 1 or int(warmup_steps) < 0:
            raise ValueError("perseus: Compression.cupcake: profile_steps must be >= 1 and warmup_steps >= 0")
        if plan != "auto":
            if not isinstance(plan, (list, tuple)) or not all(isinstance(g, (list, tuple)) and g for g in plan):
                raise ValueError("perseus: Compression.cupcake: plan must be 'auto' or a list of non-empty lists "
                                 "of keys")
            flat = [k for g in plan for k in g]
            if len(set(flat)) != len(flat):
                raise ValueError("perseus: Compression.cupcake: a key appears in two groups of the plan")
        self.inner = inner
        super().__init__(error_feedback=False)
        self.error_feedback = inner.error_feedback
        self.plan_arg = plan
        self.profile_steps = int(profile_steps)
        self.warmup_steps = int(warmup_steps)
        self.encode_cost = None if encode_cost is None else tuple(float(v) for v in encode_cost)
        self.comm_cost = None if comm_cost is None else tuple(float(v) for v in comm_cost)
        self._rlock = threading.RLock()
        self._init_run_state()

    def _init_run_state(self):
        self.profiler = StepProfiler()
        self._groups: Optional[dict] = None   # key -> _Group once a plan is adopted
        self._plan: Optional[list] = None
        self.model: dict = {}

    # the byte counters are the inner compressor's
    @property
    def payload_bytes(self):
        return self.inner.payload_bytes

    @payload_bytes.setter
    def payload_bytes(self, value):
        pass

    @property
    def dense_bytes(self):
        return self.inner.dense_bytes

    @dense_bytes.setter
    def dense_bytes(self, value):
        pass

    def _describe(self) -> str:
        plan = "auto" if self.plan_arg == "auto" else f"{len(self.plan_arg)} groups"
        return f"{self.inner!r}, plan={plan}, profile_steps={self.profile_steps}"

    # -- state -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the plan, the profile and every residual (the next steps profile again)."""
        with self._rlock:
            self.inner.reset()
            self._init_run_state()

    def residual(self, key: str) -> Optional[np.ndarray]:
        """The residual of ``key``: its own, or its slice of its group's (a view)."""
        group = None if self._groups is None else self._groups.get(key)
        if group is None or len(group.keys) == 1:
            return self.inner.residual(key)
        r = self.inner.residual(group.name)
        if r is None:
            return None
        i = group.keys.index(key)
        off = sum(group.sizes[:i])
        return r[off:off + group.sizes[i]]

    @property
    def plan(self) -> Optional[list]:
        """The adopted plan: a list of groups (lists of keys) in backward order; None while profiling."""
        return None if self._plan is None else [list(g) for g in self._plan]

    @property
    def adopted(self) -> bool:
        return self._plan is not None

    # -- planning --------------------------------------------------------------------------------------
    def _make_plan(self, probe) -> tuple:
        prof = self.profiler.summary(skip=self.warmup_steps)
        keys = prof["order"]
        dense = 4.0 * np.asarray(prof["elements"], np.float64)
        if self.encode_cost is not None:
            enc = self.encode_cost
        else:
            enc = fit_affine(dense, prof["busy"])
        if self.comm_cost is not None:
            comm = self.comm_cost
            pay = (0.0, 1.0)
            link = None
        else:
            pay = fit_affine(dense, prof["payload"])
            nbytes, times = probe
            link = fit_affine(nbytes, times)
            comm = (link[0] + link[1] * pay[0], link[1] * pay[1])
        groups = plan_fusion(dense, prof["backward"], enc, comm)
        plan = [keys[a:b] for a, b in groups]
        model = {"keys": keys, "elements": prof["elements"], "shapes": prof["shapes"],
                 "backward": prof["backward"], "encode": enc,
                 "payload": pay, "link": link, "comm": comm, "groups": groups,
                 "predicted": simulate(groups, dense, prof["backward"], enc, comm),
                 "predicted_unfused": simulate([(i, i + 1) for i in range(len(keys))], dense,
                                               prof["backward"], enc, comm) if keys else 0.0}
        return plan, model

    def _plan_now(self, process_set: ProcessSet) -> None:
        """Collective: probe the link, plan on the first rank, broadcast, adopt. The collectives have fixed
        names (``cupcake.probe.*``, ``cupcake.plan.*``): they are blocking, so two instances never have them
        in flight at once, and a process that rejoins an elastic job uses the same names."""
        nbytes = (4096, 65536, 1 << 20)
        probe = None
        if self.comm_cost is None:
            kind = "allreduce" if getattr(self.inner, "collective", "") == "allreduce" else "allgather"
            times = probe_collective(kind, process_set, nbytes, tag="cupcake.probe")
            probe = (list(nbytes), times)
        _, rank, _ = _set_info(process_set)
        info = self._make_plan(probe) if rank == 0 else None
        plan, model = broadcast_from_first(info, process_set, "cupcake.plan")
        self.model = model
        own = self.profiler.summary(skip=self.warmup_steps)  # this rank's residuals follow its own shapes
        sizes = dict(zip(model["keys"], model["elements"]))
        sizes.update(zip(own["order"], own["elements"]))
        self._adopt(plan, sizes=sizes, shapes=dict(zip(own["order"], own["shapes"])))
        if rank == 0:
            fused = sum(1 for g in plan if len(g) > 1)
            log.info("cupcake: %d gradients in %d groups (%d fused); modelled backward+comm %.3f ms vs %.3f ms "
                     "one by one (encode %.1f us + %.3g ns/B, comm %.1f us + %.3g ns/B)", len(model["keys"]),
                     len(plan), fused, model["predicted"] * 1e3, model["predicted_unfused"] * 1e3,
                     model["encode"][0] * 1e6, model["encode"][1] * 1e9, model["comm"][0] * 1e6,
                     model["comm"][1] * 1e9)

    def _adopt(self, plan, sizes: dict, shapes: Optional[dict] = None) -> None:
        """Use ``plan`` from now on; carry each key's residual into its group's."""
        shapes = shapes or {}
        groups = {}
        for keys in plan:
            keys = [str(k) for k in keys]
            n = [int(sizes.get(k, 0)) for k in keys]
            group = _Group(keys, n)
            if len(keys) > 1 and all(n):
                merge_residuals(self.inner, group.name, keys, n, [shapes.get(k, ()) for k in keys])
            for k in keys:
                groups[k] = group
        self._groups = groups
        self._plan = [list(g) for g in plan]

    # -- the work --------------------------------------------------------------------------------------
    def takes_momentum(self) -> bool:
        """As the inner compressor's (momentum correction acts on each group's vector)."""
        return self.inner.takes_momentum()

    def takes_local_step(self) -> bool:
        """As the inner compressor's."""
        return self.inner.takes_local_step()

    def warmup(self) -> int:
        """The inner compressor's density warm-up (Cupcake's own ``warmup_steps`` is its profiling delay)."""
        return self.inner.warmup()

    def note_dense(self, nbytes: int) -> None:
        """Counted by the inner compressor, whose counters are Cupcake's."""
        self.inner.note_dense(nbytes)

    @property
    def momentum_masking(self):
        """The inner compressor's masking choice."""
        return self.inner.momentum_masking

    @momentum_masking.setter
    def momentum_masking(self, value):
        pass

    def reduce_async(self, key: str, arrays: Sequence[np.ndarray], outputs: Optional[Sequence[np.ndarray]] = None,
                     op=ReduceOp.AVERAGE, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, local=None) -> Pending:
        """As :meth:`Reducer.reduce_async`; see the class docstring for when gradients are fused. Gradients
        with different ``local`` steps (optimizer parameter groups with different momentum) are not fused
        together: a group is then submitted in parts."""
        if not key:
            raise ValueError("perseus: Cupcake keeps state per tensor and needs a name; pass name= "
                             "(DistributedOptimizer names gradients after their parameters)")
        arrays = list(arrays)
        if ReduceOp(op) not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise ValueError(f"perseus: Cupcake reduces with Sum or Average only, not {ReduceOp(op).name}")
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.dtype.kind != "f" and a.dtype != np.uint16:
                raise ValueError(f"perseus: Cupcake compresses floating-point gradients only; {key!r} is "
                                 f"{getattr(a, 'dtype', type(a).__name__)}")
        with self._rlock:
            if self._plan is None:
                if self.plan_arg != "auto":
                    self._adopt(self.plan_arg, sizes={})
                else:
                    new_step = self.profiler.arrive(key)
                    if new_step and self.profiler.step == self.warmup_steps + self.profile_steps:
                        self.profiler.steps.pop()  # the step that starts now is not profiled
                        self._plan_now(process_set)
            if self._plan is None:
                t0 = time.perf_counter()
                before = self.inner.payload_bytes
                pending = self.inner.reduce_async(key, arrays, outputs, op, prescale_factor, postscale_factor,
                                                  process_set, **({} if local is None else {"local": local}))
                self.profiler.record(key, sum(a.size for a in arrays), t0, time.perf_counter() - t0,
                                     self.inner.payload_bytes - before, tuple(tuple(a.shape) for a in arrays))
                return pending
            group = self._groups.get(key)
            if group is None:
                return self.inner.reduce_async(key, arrays, outputs, op, prescale_factor, postscale_factor,
                                               process_set, **({} if local is None else {"local": local}))
            if group.sizes[group.keys.index(key)] == 0:  # an explicit plan learns sizes as keys arrive
                sizes = list(group.sizes)
                sizes[group.keys.index(key)] = sum(a.size for a in arrays)
                group.sizes = tuple(sizes)
            if outputs is None:
                outputs = [np.empty(a.shape, a.dtype) for a in arrays]
            params = (ReduceOp(op), float(prescale_factor), float(postscale_factor), process_set, local)
            batch = group.batch
            if batch is not None and (key in batch.entries or batch.params != params):
                self._submit(batch)  # a key came again before its group completed, or other parameters
                batch = None
            if batch is None:
                batch = group.batch = _Batch(group, params)
            batch.entries[key] = (arrays, list(outputs))
            if len(batch.entries) == len(group.keys):
                self._submit(batch)

        def finish():
            with self._rlock:
                if batch.pending is None:
                    self._submit(batch)
            results = batch.pending.wait()
            first, count = batch.offsets[key]
            return results[first:first + count]
        return Pending(finish)

    def _submit(self, batch: _Batch) -> None:
        """Submit what ``batch`` holds through ``inner``: the whole group under its name, else a partial
        group under a name made from its keys."""
        group = batch.group
        if group.batch is batch:
            group.batch = None
        keys = [k for k in group.keys if k in batch.entries]
        name = group.name if len(keys) == len(group.keys) else _partial_name(keys)
        arrays, outputs = [], []
        for k in keys:
            a, o = batch.entries[k]
            batch.offsets[k] = (len(arrays), len(a))
            arrays.extend(a)
            outputs.extend(o)
        op, pre, post, ps, local = batch.params
        batch.pending = self.inner.reduce_async(name, arrays, outputs, op, pre, post, ps,
                                                **({} if local is None else {"local": local}))
