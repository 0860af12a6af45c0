"""DeAR schedule for :func:`perseus.torch.DistributedOptimizer` (``schedule="dear"``).

The all-reduce of the gradients is split in two (docs/dear.md):

* backward: parameters are fused into groups of consecutive modules in forward order; as soon as every
  gradient of a group is ready, and every later group (in forward order; backward produces them first) has
  been issued, the group's gradients are copied into one flat buffer (padded to a multiple of the set size)
  and reduce-scattered. Reduce-scatters carry the group index as priority, so when several are ready in one
  negotiation round the engine runs them in the same order on every rank.
* ``step()`` waits for the reduce-scatters only, then starts every group's all-gather (priority: group 0
  first) and returns without touching the parameters.
* next forward: a forward pre-hook on the first module of each group waits for that group's all-gather,
  puts the averaged gradients into ``.grad`` for a moment and runs the wrapped optimizer on that group's
  parameters only, with the hyper-parameters of the ``step()`` call. Gradients the user holds in ``.grad``
  are put back afterwards.

Forward order is recorded during the first forward after the optimizer is built (a global module forward
pre-hook notes which module first owns each parameter), and rank 0's layout is broadcast at the first
backward, so every rank forms the same groups and names.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch

from perseus.common import collectives as _c
from perseus.common.api import _basics
from perseus.common.exceptions import HorovodInternalError
from perseus.common.knobs import read_knob
from perseus.common.process_sets import global_process_set
from perseus.common.reduce_ops import Max, Sum
from perseus.torch.mpi_ops import allreduce_async, size, synchronize
from perseus.torch._tensors import _dtype, _np
from perseus.torch.optimizer import _DistributedOptimizer

__all__ = ["check_arguments", "mixin"]

_instances = itertools.count()


def check_arguments(compression, groups):
    """Raise ``NotImplementedError`` for what ``schedule="dear"`` does not support (naming the fix)."""
    from perseus.torch.compression import BF16Compressor, FP16Compressor
    from perseus.common.compression import NoneCompressor

    if not (isinstance(compression, type) and issubclass(compression, (NoneCompressor, FP16Compressor,
                                                                        BF16Compressor))):
        raise NotImplementedError(
            f"DistributedOptimizer(schedule='dear') supports compression=Compression.none, fp16 or bf16, not "
            f"{compression!r}; use schedule='default' for communicating compressors")
    if groups is not None:
        raise NotImplementedError("DistributedOptimizer(schedule='dear') forms its own fusion groups from the "
                                  "forward order (PERSEUS_DEAR_THRESHOLD_BYTES); drop groups=/num_groups= or "
                                  "use schedule='default'")
    if _basics.settings.elastic:
        raise NotImplementedError("DistributedOptimizer(schedule='dear') is not supported in elastic jobs; use "
                                  "schedule='default'")


class _Group:
    """One fusion group: its parameters, their slots in a flat padded buffer, and the buffers."""

    __slots__ = ("index", "params", "slots", "buf", "shard", "dt", "lists", "trigger", "filled", "rs", "ag")

    def __init__(self, index, params, wire_dtype, members, param_groups):
        self.index, self.params = index, params
        self.slots, start = [], 0
        for p in params:
            self.slots.append((start, p.numel()))
            start += p.numel()
        padded = start + (-start) % members
        self.buf = torch.zeros(padded, dtype=wire_dtype)
        self.shard = torch.zeros(padded // members, dtype=wire_dtype)
        self.dt = _dtype(self.buf)
        ids = {id(p) for p in params}
        self.lists = [[p for p in pg["params"] if id(p) in ids] for pg in param_groups]
        self.trigger = None
        self.filled: set = set()
        self.rs = self.ag = None


def _record_hook(ref):
    """A global forward pre-hook noting, until the groups are formed, which module first owns each parameter."""
    def hook(module, args):
        opt = ref()
        if opt is None or opt._dear_groups is not None:
            return
        for p in module.parameters(recurse=False):
            if id(p) in opt._dear_ids and id(p) not in opt._dear_owner:
                opt._dear_owner[id(p)] = module
                opt._dear_order.append(p)
    return hook


class _DeAR(torch.optim.Optimizer):
    """Methods that replace :class:`_DistributedOptimizer`'s for ``schedule="dear"``."""

    def __init__(self, *args, **kwargs):
        self._dear_active = False
        self._dear_threshold = int(read_knob("dear_threshold_bytes")[0])
        self._dear_tag = f"dear.{next(_instances)}"
        self._dear_groups = None
        self._dear_layout = None
        self._dear_new_threshold = None
        self._dear_hooks = []
        _DistributedOptimizer.__init__(self, *args, **kwargs)

    # -- set-up ----------------------------------------------------------------------------------------
    def _register_hooks(self):
        trainable, seen = [], set()
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    trainable.append(p)
        if any(getattr(p, "perseus_model_parallel", False) for p in trainable):
            raise NotImplementedError("DistributedOptimizer(schedule='dear') does not support model-parallel "
                                      "parameters (DistributedEmbedding); use schedule='default'")
        self._dear_active = True
        self._dear_params = sorted(trainable, key=lambda p: self._parameter_names[p])
        self._dear_ids = {id(p) for p in trainable}
        self._dear_owner: dict = {}
        self._dear_order: list = []
        self._dear_record = torch.nn.modules.module.register_module_forward_pre_hook(
            _record_hook(weakref.ref(self)))
        self._dear_step_state()
        for p in trainable:
            self._requires_update.add(p)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._dear_grad_hook))

    def _dear_step_state(self):
        """Forget this step's reductions (after step(), synchronize() or load_state_dict())."""
        self._dear_started = False     # a backward hook ran since the last step
        self._dear_reduced = False     # every reduce-scatter of this step has completed
        self._dear_pending = False     # all-gathers started, updates not all applied
        self._dear_next_apply = 0
        self._dear_next_rs = len(self._dear_groups) - 1 if self._dear_groups else -1
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for g in self._dear_groups or ():
            g.filled.clear()

    def _dear_check_schedule(self):
        """Fail on every rank, instead of hanging, when other ranks run the default schedule: its gradient
        names are submitted here with another dtype, which the negotiation reports as a mismatch."""
        handles = [allreduce_async(torch.ones(1, dtype=torch.int32), name=f"grad.{self._parameter_names[p]}",
                                   op=Sum, process_set=self.process_set) for p in self._dear_params]
        try:
            for h in handles:
                synchronize(h)
        except HorovodInternalError as exc:
            raise RuntimeError(
                "DistributedOptimizer(schedule='dear'): the ranks disagree on the schedule (another rank "
                "reduced these gradients with the default schedule); pass the same schedule= on every rank"
            ) from exc

    def _dear_build(self):
        """Form the groups: forward order recorded during the first forward, rank 0's layout everywhere."""
        from perseus.torch.functions import broadcast_object

        if self._dear_record is not None:
            self._dear_record.remove()
            self._dear_record = None
        names = self._parameter_names
        if self._dear_layout is None:
            self._dear_check_schedule()
            # Parameters no forward module owned (used outside their module's forward) come first.
            seen = {id(p) for p in self._dear_order}
            units = [[names[p] for p in self._dear_params if id(p) not in seen]]
            by_module: dict = {}
            for p in self._dear_order:
                key = id(self._dear_owner[id(p)])
                if key not in by_module:
                    by_module[key] = []
                    units.append(by_module[key])
                by_module[key].append(names[p])
            units = [u for u in units if u]
            root = (getattr(self.process_set, "ranks", None) or [0])[0]  # the set's first rank
            self._dear_layout = broadcast_object(units, root_rank=root, name=f"perseus.{self._dear_tag}.layout",
                                                 process_set=self.process_set)
        self._dear_regroup(self._dear_new_threshold or self._dear_threshold)

    def _dear_regroup(self, threshold):
        """Cut the layout into groups of at most ``threshold`` bytes (a module is never split)."""
        self._dear_threshold, self._dear_new_threshold = threshold, None
        for h in self._dear_hooks:
            h.remove()
        self._dear_hooks = []
        by_name = {n: p for p, n in self._parameter_names.items()}
        members = self.process_set.size() or size()
        wire = getattr(self._compression, "wire_dtype", None)
        cut, cur, cur_bytes, cur_dtype = [], [], 0, None
        for unit in self._dear_layout:
            ps = [by_name[n] for n in unit]
            dt = wire if wire is not None and ps[0].is_floating_point() else ps[0].dtype
            nbytes = sum(p.numel() for p in ps) * dt.itemsize
            if cur and (cur_bytes + nbytes > threshold or dt != cur_dtype or
                        any(p.dtype != ps[0].dtype for p in ps)):
                cut.append((cur, cur_dtype))
                cur, cur_bytes = [], 0
            cur, cur_bytes, cur_dtype = cur + ps, cur_bytes + nbytes, dt
        if cur:
            cut.append((cur, cur_dtype))
        self._dear_groups = [_Group(k, ps, dt, members, self.param_groups) for k, (ps, dt) in enumerate(cut)]
        self._dear_slot = {p: (g, i) for g in self._dear_groups for i, p in enumerate(g.params)}
        self._dear_version = getattr(self, "_dear_version", -1) + 1
        # Each group's update runs before the forward of the first module that owns one of its parameters.
        first = self._dear_owner.get(id(self._dear_order[0])) if self._dear_order else None
        last_of: dict = {}
        for g in self._dear_groups:
            g.trigger = self._dear_owner.get(id(g.params[0]), first)
            if g.trigger is not None:
                last_of[id(g.trigger)] = (g.trigger, g.index)
        ref = weakref.ref(self)
        for module, k in last_of.values():
            def pre(mod, args, k=k):
                opt = ref()
                if opt is not None and opt._dear_pending:
                    opt._dear_apply_upto(k)
            self._dear_hooks.append(module.register_forward_pre_hook(pre))
        self._dear_step_state()

    # -- backward: reduce-scatter per group, in strict group order --------------------------------------
    def _dear_grad_hook(self, p):
        if self._dear_groups is None:
            self._dear_build()
        if not self._dear_started:  # first gradient of this step: nothing of the last step may stay in flight
            self._dear_apply_upto(len(self._dear_groups) - 1)
            if self._dear_new_threshold is not None:
                self._dear_regroup(self._dear_new_threshold)
            self._dear_started = True
        if self._allreduce_delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] > 0:
            return
        g, i = self._dear_slot[p]
        self._dear_fill(g, i)
        if g.index == self._dear_next_rs and len(g.filled) == len(g.params):
            self._dear_issue_ready()

    def _dear_fill(self, g, i):
        p = g.params[i]
        start, n = g.slots[i]
        dst = g.buf[start:start + n].view(p.shape)
        grad = p.grad
        if grad is None:  # not produced on this rank this step (another rank may have it): zeros
            dst.zero_()
        else:
            if grad.is_sparse:
                if not self.sparse_as_dense:
                    raise NotImplementedError(
                        f"DistributedOptimizer(schedule='dear'): {self._parameter_names[p]} has a sparse "
                        "gradient; pass sparse_as_dense=True or use schedule='default'")
                grad = grad.to_dense()
            dst.copy_(grad)
        g.filled.add(i)

    def _dear_issue_ready(self):
        groups = self._dear_groups
        while self._dear_next_rs >= 0 and len(groups[self._dear_next_rs].filled) == len(
                groups[self._dear_next_rs].params):
            self._dear_issue_rs(groups[self._dear_next_rs])
            self._dear_next_rs -= 1

    def _dear_issue_rs(self, g):
        pre, post = self._scales()
        g.rs = _c.reducescatter_async(_np(g.buf), lambda shape, s=g.shard: _np(s),
                                      name=f"{self._dear_tag}.v{self._dear_version}.rs.{g.index}", op=self.op,
                                      process_set=self.process_set, prescale_factor=pre, postscale_factor=post,
                                      priority=g.index, dtype=g.dt)

    def _dear_reduce(self):
        """Issue what backward left (gradients it did not produce: ``.grad`` or zeros), wait for every
        reduce-scatter. Every rank's shard of each group then holds the averaged gradient."""
        if self._dear_reduced:
            return
        for k in range(self._dear_next_rs, -1, -1):
            g = self._dear_groups[k]
            for i in range(len(g.params)):
                if i not in g.filled:
                    self._dear_fill(g, i)
            self._dear_issue_rs(g)
        self._dear_next_rs = -1
        for g in reversed(self._dear_groups):
            if g.rs is not None:
                handle, g.rs = g.rs, None
                synchronize(handle)
        self._dear_reduced = True

    def _dear_start_allgathers(self):
        for g in self._dear_groups:
            g.ag = _c.allgather_async(_np(g.shard), lambda shape, b=g.buf: _np(b),
                                      name=f"{self._dear_tag}.v{self._dear_version}.ag.{g.index}",
                                      process_set=self.process_set, priority=-1 - g.index, dtype=g.dt)

    # -- forward: deferred per-group updates ------------------------------------------------------------
    def _dear_apply_upto(self, k):
        """Apply the pending updates of groups up to ``k`` (in group order)."""
        while self._dear_pending and self._dear_next_apply <= k:
            g = self._dear_groups[self._dear_next_apply]
            self._dear_next_apply += 1
            if self._dear_next_apply == len(self._dear_groups):
                self._dear_pending = False
            self._dear_apply(g)

    def _dear_apply(self, g):
        handle, g.ag = g.ag, None
        synchronize(handle)
        saved = [p.grad for p in g.params]
        for p, (start, n) in zip(g.params, g.slots):
            view = g.buf[start:start + n].view(p.shape)
            # The buffers live in host memory: a GPU parameter gets its reduced gradient copied over.
            p.grad = view if view.dtype == p.dtype and view.device == p.device else view.to(p.device, p.dtype)
        lists = [pg["params"] for pg in self.param_groups]
        current = []
        for pg, own, snap in zip(self.param_groups, g.lists, self._dear_hyper):
            pg["params"] = own
            current.append({k: pg[k] for k in snap if k in pg})
            pg.update(snap)
        try:
            super(self.__class__, self).step()
        finally:
            for pg, params, cur, snap in zip(self.param_groups, lists, current, self._dear_hyper):
                pg["params"] = params
                for k, v in cur.items():
                    if pg.get(k) is snap[k]:  # (a value the optimizer itself changed during step stays)
                        pg[k] = v
            for p, grad in zip(g.params, saved):
                p.grad = grad

    # -- public methods --------------------------------------------------------------------------------
    def step(self, closure=None):
        """Finish this step's reduce-scatters, start the all-gathers and return; each group's parameters
        are updated just before its first module's next forward (or by :meth:`synchronize`,
        :meth:`finish`, ``state_dict()`` or the next backward). Returns None.

        After :meth:`synchronize` (or inside ``skip_synchronize()``) it is the wrapped optimizer's full step
        on the averaged gradients in ``.grad``, as with the default schedule.

        Collective: every rank of the process set calls it.

        Raises:
            NotImplementedError: a closure was given (use schedule='default').
        """
        if closure is not None:
            raise NotImplementedError("DistributedOptimizer(schedule='dear') does not support step(closure) "
                                      "(L-BFGS); use schedule='default'")
        if not self._dear_active or self._synchronized or not self._should_synchronize:
            self._synchronized = False
            return super(self.__class__, self).step()
        if self._dear_groups is None:
            self._dear_build()
        self._dear_apply_upto(len(self._dear_groups) - 1)
        self._dear_reduce()
        self._dear_hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.param_groups]
        self._dear_start_allgathers()
        self._dear_step_state()
        self._dear_pending = True
        if self._dear_groups and self._dear_groups[0].trigger is None:  # no module seen: update now
            self._dear_apply_upto(len(self._dear_groups) - 1)
        self._dear_follow_tuner()
        return None

    def _dear_follow_tuner(self):
        """Under the autotuner (global process set): the group size is a search dimension
        (perseus.autotune.policy, link 'dear'); while the tuner may change it, each step ends with one small
        all-reduce so that every rank takes the same size from the same backward on. Collective."""
        if self.process_set is not global_process_set:
            return
        following = self.__dict__.get("_dear_following")
        if following is None:
            from perseus.autotune.policy import Following

            following = self._dear_following = Following("dear")
        code = following.at_call(self, "dear.step", self.process_set)
        if code is not None:
            from perseus.autotune.space import DEAR_THRESHOLDS

            self.set_dear_threshold(DEAR_THRESHOLDS[code])

    def synchronize(self):
        """Apply every pending update; then, if a backward ran since the last ``step()``, finish its
        reduction and write the averaged gradients into ``.grad`` (Horovod's meaning, for
        ``synchronize(); clip; with skip_synchronize(): step()``), after which ``step()`` is a full step.

        Call it (or :meth:`finish`) after the last ``step()`` of training, so the last update is applied.

        Collective: every rank of the process set calls it.
        """
        if not self._dear_active:
            self._synchronized = True
            return
        if self._dear_groups is None:
            if not any(p.grad is not None for p in self._dear_params):
                return
            self._dear_build()
        self._dear_apply_upto(len(self._dear_groups) - 1)
        if not self._dear_started:
            return
        self._dear_reduce()
        self._dear_start_allgathers()
        for g in self._dear_groups:
            handle, g.ag = g.ag, None
            synchronize(handle)
            for p, (start, n) in zip(g.params, g.slots):
                value = g.buf[start:start + n].view(p.shape)
                if p.grad is not None and not p.grad.is_sparse and p.grad.dtype == p.dtype:
                    p.grad.copy_(value)
                else:  # never a view of the buffer: the next backward overwrites it
                    p.grad = value.to(p.dtype, copy=True)
        self._dear_step_state()
        self._synchronized = True

    def finish(self):
        """Apply every pending update (after the last ``step()``, before evaluating on only some ranks or
        saving parameters). Every rank calls it; it waits only for all-gathers every rank already started."""
        if self._dear_active and self._dear_groups is not None:
            self._dear_apply_upto(len(self._dear_groups) - 1)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the averaged gradients of this step by their global norm; call it after backward, before
        ``step()``. Returns the total norm (a float32 tensor), like ``torch.nn.utils.clip_grad_norm_``.

        The norm comes from each rank's reduce-scattered shards and one small all-reduce; the shards are
        scaled before the all-gather, so the deferred updates see clipped gradients.

        Collective: every rank of the process set calls it.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
        """
        if not self._dear_active:
            params = [p for pg in self.param_groups for p in pg["params"] if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        if self._dear_groups is None:
            self._dear_build()
        self._dear_apply_upto(len(self._dear_groups) - 1)
        self._dear_reduce()
        norm_type = float(norm_type)
        shards = [g.shard.double() for g in self._dear_groups]
        if math.isinf(norm_type):
            local, op = max((float(s.abs().max()) for s in shards if s.numel()), default=0.0), Max
        else:
            local, op = sum(float(s.abs().pow(norm_type).sum()) for s in shards), Sum
        total = synchronize(allreduce_async(torch.tensor([local], dtype=torch.float64),
                                            name=f"perseus.{self._dear_tag}.norm", op=op,
                                            process_set=self.process_set))
        total = float(total[0]) if math.isinf(norm_type) else float(total[0]) ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot "
                               "be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        coef = min(float(max_norm) / (total + 1e-6), 1.0)
        if coef < 1.0:
            for g in self._dear_groups:
                g.shard.mul_(coef)
        return torch.tensor(total, dtype=torch.float32)

    def set_dear_threshold(self, threshold_bytes):
        """Regroup with groups of at most ``threshold_bytes`` at the start of the next backward (nothing is
        in flight then). Every rank must call it before the same step (the autotuner does)."""
        threshold_bytes = int(threshold_bytes)
        if threshold_bytes < 0:
            raise ValueError("set_dear_threshold: threshold_bytes must be >= 0")
        if self._dear_groups is None:
            self._dear_threshold = threshold_bytes
        else:
            self._dear_new_threshold = threshold_bytes

    def dear_groups(self):
        """The current groups as lists of parameter names, in forward order (empty before the first
        backward, or when this rank does not communicate)."""
        return [[self._parameter_names[p] for p in g.params] for g in self._dear_groups or ()]

    def zero_grad(self, *args, **kwargs):
        if self._dear_active and self._dear_groups and any(g.rs is not None for g in self._dear_groups):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The wrapped optimizer's state after every pending update has been applied."""
        self.finish()
        return super(self.__class__, self).state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """Apply pending updates, then load (forgetting any gradients reduced but not yet stepped)."""
        self.finish()
        result = _DistributedOptimizer.load_state_dict(self, *args, **kwargs)
        if self._dear_active:
            for g in self._dear_groups or ():
                g.rs = g.ag = None
            self._dear_step_state()
        return result


def mixin():
    """The class dictionary of a DeAR DistributedOptimizer: the default one with :class:`_DeAR`'s methods."""
    methods = dict(_DistributedOptimizer.__dict__)
    methods.update({k: v for k, v in _DeAR.__dict__.items() if k not in ("__dict__", "__weakref__")})
    return methods
