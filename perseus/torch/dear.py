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
backward, so every rank forms the same groups and names (:mod:`perseus.torch._dear_groups`).
"""

from __future__ import annotations

import math
import weakref

import torch

from perseus.runtime.step_policy import Following
from perseus.autotune.space import DEAR_THRESHOLDS
from perseus.runtime import collectives as _c
from perseus.lifecycle.api import _basics, size
from perseus.base.knobs import read_knob
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Max, Sum
from perseus.torch import device_collectives as _dc
from perseus.torch._allreduce_ops import allreduce_async
from perseus.torch._dear_groups import DearGroups, _record_hook
from perseus.torch._schedule import TOO_MANY_PASSES, ZERO_GRAD_RACE, PendingReduction, Schedule, check_op
from perseus.torch._tensors import _np, synchronize
from perseus.torch.compression import Compression

__all__ = ["DearSchedule"]


class DearSchedule(DearGroups, Schedule):
    """The DeAR schedule (see the module's description).

    Raises (on construction):
        NotImplementedError: a compressor other than Compression.none, fp16 or bf16, ``groups``, or an
            elastic job.
        ValueError: ``op=Adasum``, or ``gradient_predivide_factor`` with an op other than Average.
    """

    def __init__(self, opt):
        check_op(opt)
        compression = opt._compression
        if not (isinstance(compression, type) and issubclass(compression, (Compression.none, Compression.fp16,
                                                                            Compression.bf16))):
            raise NotImplementedError(
                f"DistributedOptimizer(schedule='dear') supports compression=Compression.none, fp16 or bf16, not "
                f"{compression!r}; use schedule='default' for communicating compressors")
        if opt._groups is not None:
            raise NotImplementedError("DistributedOptimizer(schedule='dear') forms its own fusion groups from the "
                                      "forward order (PERSEUS_DEAR_THRESHOLD_BYTES); drop groups=/num_groups= or "
                                      "use schedule='default'")
        if _basics.settings.elastic:
            raise NotImplementedError("DistributedOptimizer(schedule='dear') is not supported in elastic jobs; "
                                      "use schedule='default'")
        super().__init__(opt)
        self.active = False               # this rank communicates (hooks registered)
        self.threshold = int(read_knob("dear_threshold_bytes")[0])
        self.new_threshold = None         # set_threshold() before the groups are cut anew
        self.tag = None                   # "dear.<set>.<n>", given when the first groups are formed (_build)
        self.groups = None                # the _Groups, once the first backward has formed them
        self.layout = None                # rank 0's modules, as lists of parameter names, in forward order
        self.module_hooks = []
        self.version = -1                 # bumped at each regrouping: names the collectives of each grouping
        self.following = None             # the autotuner link, once step() has asked for it
        self.params: list = []            # the trainable parameters, by name
        self.ids: set = set()             # their ids
        self.owner: dict = {}             # parameter id -> the module whose forward first used it
        self.order: list = []             # the parameters in the order their modules' forwards ran
        self.record = None                # the global forward pre-hook recording owner and order

    # -- set-up ----------------------------------------------------------------------------------------
    def start(self):
        if self.opt.process_set.included() and size() > 1:
            self._register_hooks()

    def _register_hooks(self):
        opt = self.opt
        trainable, seen = [], set()
        for g in opt.param_groups:
            for p in g["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    trainable.append(p)
        if any(getattr(p, "perseus_model_parallel", False) for p in trainable):
            raise NotImplementedError("DistributedOptimizer(schedule='dear') does not support model-parallel "
                                      "parameters (DistributedEmbedding); use schedule='default'")
        self.active = True
        self.params = sorted(trainable, key=lambda p: opt._parameter_names[p])
        self.ids = {id(p) for p in trainable}
        self.record = torch.nn.modules.module.register_module_forward_pre_hook(_record_hook(weakref.ref(self)))
        self._new_step()
        for p in trainable:
            self.requires_update.add(p)
            self.hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    def _new_step(self):
        """Forget this step's reductions (after step(), synchronize() or load_state_dict())."""
        self.started = False          # a backward hook ran since the last step
        self.reduced = False          # every reduce-scatter of this step has completed
        self.updates_pending = False  # all-gathers started, updates not all applied
        self.next_apply = 0
        self.next_rs = len(self.groups) - 1 if self.groups else -1
        self.reset_delays(self.opt.backward_passes_per_step)
        for g in self.groups or ():
            g.filled.clear()

    # -- backward: reduce-scatter per group, in strict group order --------------------------------------
    def _grad_hook(self, p):
        if self.groups is None:
            self._build()
        if not self.started:  # first gradient of this step: nothing of the last step may stay in flight
            self.apply_upto(len(self.groups) - 1)
            if self.new_threshold is not None:
                self._regroup(self.new_threshold)
            self.started = True
        delay = self.delay
        if delay[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        delay[p] -= 1
        if delay[p] > 0:
            return
        g, i = self.slot[p]
        self._fill(g, i)
        if g.index == self.next_rs and len(g.filled) == len(g.params):
            self._issue_ready()

    def _fill(self, g, i):
        p = g.params[i]
        start, n = g.slots[i]
        dst = g.buf[start:start + n].view(p.shape)
        grad = p.grad
        if grad is None:  # not produced on this rank this step (another rank may have it): zeros
            dst.zero_()
        else:
            if grad.is_sparse:
                if not self.opt.sparse_as_dense:
                    raise NotImplementedError(
                        f"DistributedOptimizer(schedule='dear'): {self.opt._parameter_names[p]} has a sparse "
                        "gradient; pass sparse_as_dense=True or use schedule='default'")
                grad = grad.to_dense()
            dst.copy_(grad)
        g.filled.add(i)

    def _issue_ready(self):
        groups = self.groups
        while self.next_rs >= 0 and len(groups[self.next_rs].filled) == len(groups[self.next_rs].params):
            self._issue_rs(groups[self.next_rs])
            self.next_rs -= 1

    def _issue_rs(self, g):
        pre, post = self.scales()
        opt = self.opt
        name = f"{self.tag}.v{self.version}.rs.{g.index}"
        if g.launcher:  # on the device, through the launcher (NCCL): no host copy
            g.rs = PendingReduction(synchronize, _dc.submit(
                _dc.REDUCESCATTER, [g.buf], name, opt.process_set, reduce_op=int(opt.op), prescale_factor=pre,
                postscale_factor=post, outputs=[g.shard], priority=g.index))
            return
        g.rs = PendingReduction(synchronize, _c.reducescatter_async(
            _np(g.buf), lambda shape, s=g.shard: _np(s), name=name, op=opt.op, process_set=opt.process_set,
            prescale_factor=pre, postscale_factor=post, priority=g.index, dtype=g.dt))

    def _reduce(self):
        """Issue what backward left (gradients it did not produce: ``.grad`` or zeros), wait for every
        reduce-scatter. Every rank's shard of each group then holds the averaged gradient."""
        if self.reduced:
            return
        for k in range(self.next_rs, -1, -1):
            g = self.groups[k]
            for i in range(len(g.params)):
                if i not in g.filled:
                    self._fill(g, i)
            self._issue_rs(g)
        self.next_rs = -1
        for g in reversed(self.groups):
            if g.rs is not None:
                reduction, g.rs = g.rs, None
                reduction.wait()
        self.reduced = True

    def _start_allgathers(self):
        process_set = self.opt.process_set
        for g in self.groups:
            name = f"{self.tag}.v{self.version}.ag.{g.index}"
            if g.launcher:
                g.ag = PendingReduction(synchronize, _dc.submit(_dc.ALLGATHER, [g.shard], name, process_set,
                                                                outputs=[g.buf], priority=-1 - g.index))
                continue
            g.ag = PendingReduction(synchronize, _c.allgather_async(
                _np(g.shard), lambda shape, b=g.buf: _np(b), name=name, process_set=process_set,
                priority=-1 - g.index, dtype=g.dt))

    # -- forward: deferred per-group updates ------------------------------------------------------------
    def apply_upto(self, k):
        """Apply the pending updates of groups up to ``k`` (in group order)."""
        while self.updates_pending and self.next_apply <= k:
            g = self.groups[self.next_apply]
            self.next_apply += 1
            if self.next_apply == len(self.groups):
                self.updates_pending = False
            self._apply(g)

    def _apply(self, g):
        """Wait for ``g``'s all-gather and run the wrapped optimizer on ``g``'s parameters alone, with the
        hyper-parameters of the ``step()`` call and the averaged gradients (the user's ``.grad`` put back
        afterwards)."""
        reduction, g.ag = g.ag, None
        reduction.wait()
        saved = [p.grad for p in g.params]
        for p, (start, n) in zip(g.params, g.slots):
            view = g.buf[start:start + n].view(p.shape)
            # Host buffers (staged): a GPU parameter gets its reduced gradient copied over.
            p.grad = view if view.dtype == p.dtype and view.device == p.device else view.to(p.device, p.dtype)
        opt = self.opt
        lists = [pg["params"] for pg in opt.param_groups]
        current = []
        for pg, own, snap in zip(opt.param_groups, g.lists, self.hyper):
            pg["params"] = own
            current.append({k: pg[k] for k in snap if k in pg})
            pg.update(snap)
        try:
            opt._perseus_local_step()
        finally:
            for pg, params, cur, snap in zip(opt.param_groups, lists, current, self.hyper):
                pg["params"] = params
                for k, v in cur.items():
                    if pg.get(k) is snap[k]:  # (a value the optimizer itself changed during step stays)
                        pg[k] = v
            for p, grad in zip(g.params, saved):
                p.grad = grad

    # -- the optimizer's methods -------------------------------------------------------------------------
    def step(self, closure=None):
        """Finish this step's reduce-scatters, start the all-gathers and return None (see
        :meth:`perseus.torch.optimizer._DearDistributedOptimizer.step`). Collective.

        Raises:
            NotImplementedError: a closure was given (use schedule='default').
        """
        if closure is not None:
            raise NotImplementedError("DistributedOptimizer(schedule='dear') does not support step(closure) "
                                      "(L-BFGS); use schedule='default'")
        if not self.active or self.synchronized or not self.should_synchronize:
            self.synchronized = False
            return self.opt._perseus_local_step()
        if self.groups is None:
            self._build()
        self.apply_upto(len(self.groups) - 1)
        self._reduce()
        self.hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.opt.param_groups]
        self._start_allgathers()
        self._new_step()
        self.updates_pending = True
        if self.groups and self.groups[0].trigger is None:  # no module seen: update now
            self.apply_upto(len(self.groups) - 1)
        self._follow_tuner()
        return None

    def _follow_tuner(self):
        """Under the autotuner (global process set): the group size is a search dimension
        (perseus.runtime.step_policy, link 'dear'); while the tuner may change it, each step ends with one small
        all-reduce so that every rank takes the same size from the same backward on. Collective."""
        if self.opt.process_set is not global_process_set:
            return
        if self.following is None:
            self.following = Following("dear")
        code = self.following.at_call(self.opt, "dear.step", self.opt.process_set)
        if code is not None:
            self.set_threshold(DEAR_THRESHOLDS[code])

    def synchronize(self):
        """Apply every pending update; then, if a backward ran since the last ``step()``, finish its
        reduction and write the averaged gradients into ``.grad``. Collective."""
        if not self.active:
            self.synchronized = True
            return
        if self.groups is None:
            if not any(p.grad is not None for p in self.params):
                return
            self._build()
        self.apply_upto(len(self.groups) - 1)
        if not self.started:
            return
        self._reduce()
        self._start_allgathers()
        for g in self.groups:
            reduction, g.ag = g.ag, None
            reduction.wait()
            for p, (start, n) in zip(g.params, g.slots):
                value = g.buf[start:start + n].view(p.shape)
                if p.grad is not None and not p.grad.is_sparse and p.grad.dtype == p.dtype:
                    p.grad.copy_(value)
                else:  # never a view of the buffer: the next backward overwrites it
                    p.grad = value.to(p.dtype, copy=True)
        self._new_step()
        self.synchronized = True

    def finish(self):
        """Apply every pending update. Every rank calls it; it waits only for all-gathers every rank already
        started."""
        if self.active and self.groups is not None:
            self.apply_upto(len(self.groups) - 1)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip this step's averaged gradients by their global norm, from each rank's reduce-scattered shards
        and one small all-reduce; the shards are scaled before the all-gather, so the deferred updates see
        clipped gradients. Returns the total norm (a float32 tensor). Collective.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
        """
        if not self.active:
            return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        if self.groups is None:
            self._build()
        self.apply_upto(len(self.groups) - 1)
        self._reduce()
        norm_type = float(norm_type)
        shards = [g.shard.double() for g in self.groups]
        if math.isinf(norm_type):
            local, op = max((float(s.abs().max()) for s in shards if s.numel()), default=0.0), Max
        else:
            local, op = sum(float(s.abs().pow(norm_type).sum()) for s in shards), Sum
        total = synchronize(allreduce_async(torch.tensor([local], dtype=torch.float64),
                                            name=f"perseus.{self.tag}.norm", op=op,
                                            process_set=self.opt.process_set))
        total = float(total[0]) if math.isinf(norm_type) else float(total[0]) ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot "
                               "be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        coef = min(float(max_norm) / (total + 1e-6), 1.0)
        if coef < 1.0:
            for g in self.groups:
                g.shard.mul_(coef)
        return torch.tensor(total, dtype=torch.float32)

    def check_zero_grad(self):
        if self.active and self.groups and any(g.rs is not None for g in self.groups):
            raise AssertionError(ZERO_GRAD_RACE)

    def forget(self):
        """Forget any gradients reduced but not yet stepped (apply pending updates first: :meth:`finish`)."""
        super().forget()
        if self.active:
            for g in self.groups or ():
                g.rs = g.ag = None
            self._new_step()
