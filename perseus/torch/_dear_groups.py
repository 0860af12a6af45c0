"""The fusion groups of the DeAR schedule (:mod:`perseus.torch.dear`): how gradients are grouped, and when.

- Forward order: until the groups are formed, a global module forward pre-hook notes which module first owns
  each trainable parameter (:func:`_record_hook`).
- At the first backward (or ``step()``/``synchronize()``) every rank checks that all ranks run DeAR (a small
  all-reduce under the default schedule's gradient names; a mismatch raises RuntimeError on every rank), then
  rank 0's layout (the parameter names of each module, in forward order) is broadcast, so every rank forms the
  same groups and names. Every rank of the process set must take part.
- The layout is cut into groups of at most the threshold's bytes (a module is never split; a group holds one
  dtype), each with a flat buffer padded to a multiple of the set size (:class:`_Group`), and each group's
  deferred update is hooked to the forward of the first module that owns one of its parameters.
- ``set_threshold`` regroups at the start of the next backward; every rank must call it before the same step
  (a negative threshold raises ValueError).
"""

from __future__ import annotations

import weakref

import torch

from perseus.lifecycle.api import size
from perseus.base.exceptions import HorovodInternalError
from perseus.base.reduce_ops import Sum
from perseus.torch import device_collectives as _dc
from perseus.torch._allreduce_ops import allreduce_async
from perseus.torch._tensors import _dtype, synchronize
from perseus.torch.functions import broadcast_object

__all__ = ["DearGroups"]

# DeAR schedules built so far, per process set id: names each schedule's collectives. A schedule takes its
# number when it forms its first groups (after the check that every rank runs DeAR), which happens in program
# order on every member of the set, so every member gives it the same number; a construction on some ranks
# only (a program error, raised on every rank) takes none.
_builds: dict[int, int] = {}


class _Group:
    """One fusion group: its parameters, their slots in a flat padded buffer, the buffers, and its reduce-scatter
    (``rs``) and all-gather (``ag``) while they are in flight (:class:`PendingReduction`)."""

    __slots__ = ("index", "params", "slots", "buf", "shard", "dt", "lists", "trigger", "filled", "rs", "ag",
                 "launcher")

    def __init__(self, index, params, wire_dtype, members, param_groups, op):
        self.index, self.params = index, params
        self.slots, start = [], 0
        for p in params:
            self.slots.append((start, p.numel()))
            start += p.numel()
        padded = start + (-start) % members
        # On the parameters' GPU when the device launcher (NCCL) runs both collectives, else in host memory.
        device = params[0].device
        probe = torch.empty(1, dtype=wire_dtype, device=device)
        self.launcher = (_dc.takes([probe], _dc.REDUCESCATTER, int(op)) and _dc.takes([probe], _dc.ALLGATHER))
        if not self.launcher:
            device = "cpu"
        self.buf = torch.zeros(padded, dtype=wire_dtype, device=device)
        self.shard = torch.zeros(padded // members, dtype=wire_dtype, device=device)
        self.dt = _dtype(self.buf)
        ids = {id(p) for p in params}
        self.lists = [[p for p in pg["params"] if id(p) in ids] for pg in param_groups]
        self.trigger = None
        self.filled: set = set()
        self.rs = self.ag = None


def _record_hook(ref):
    """A global forward pre-hook noting, until the groups are formed, which module first owns each parameter."""
    def hook(module, args):
        schedule = ref()
        if schedule is None or schedule.groups is not None:
            return
        for p in module.parameters(recurse=False):
            if id(p) in schedule.ids and id(p) not in schedule.owner:
                schedule.owner[id(p)] = module
                schedule.order.append(p)
    return hook


class DearGroups:
    """The grouping methods of :class:`perseus.torch.dear.DearSchedule`, one of its bases. They use the
    schedule's ``opt``, ``params``, ``owner``, ``order``, ``record``, ``layout``, ``tag``, ``threshold``,
    ``new_threshold``, ``groups``, ``slot``, ``version`` and ``module_hooks``, and its ``apply_upto`` and
    ``_new_step``."""

    def _check_schedule(self):
        """Fail on every rank, instead of hanging, when other ranks run the default schedule: its gradient
        names are submitted here with another dtype, which the negotiation reports as a mismatch."""
        opt = self.opt
        handles = [allreduce_async(torch.ones(1, dtype=torch.int32), name=f"grad.{opt._parameter_names[p]}",
                                   op=Sum, process_set=opt.process_set) for p in self.params]
        try:
            for h in handles:
                synchronize(h)
        except HorovodInternalError as exc:
            raise RuntimeError(
                "DistributedOptimizer(schedule='dear'): the ranks disagree on the schedule (another rank "
                "reduced these gradients with the default schedule); pass the same schedule= on every rank"
            ) from exc

    def _build(self):
        """Form the groups: forward order recorded during the first forward, rank 0's layout everywhere."""
        if self.record is not None:
            self.record.remove()
            self.record = None
        names = self.opt._parameter_names
        if self.layout is None:
            self._check_schedule()
            ps_id = self.opt.process_set.process_set_id
            number = _builds.get(ps_id, 0)
            _builds[ps_id] = number + 1
            self.tag = f"dear.{ps_id}.{number}"
            # Parameters no forward module owned (used outside their module's forward) come first.
            seen = {id(p) for p in self.order}
            units = [[names[p] for p in self.params if id(p) not in seen]]
            by_module: dict = {}
            for p in self.order:
                key = id(self.owner[id(p)])
                if key not in by_module:
                    by_module[key] = []
                    units.append(by_module[key])
                by_module[key].append(names[p])
            units = [u for u in units if u]
            process_set = self.opt.process_set
            root = (getattr(process_set, "ranks", None) or [0])[0]  # the set's first rank
            self.layout = broadcast_object(units, root_rank=root, name=f"perseus.{self.tag}.layout",
                                           process_set=process_set)
        self._regroup(self.new_threshold or self.threshold)

    def _cut(self, threshold):
        """``[(parameters, wire dtype)]``: the layout cut into groups of at most ``threshold`` bytes (a module
        is never split; a group holds one dtype)."""
        opt = self.opt
        by_name = {n: p for p, n in opt._parameter_names.items()}
        wire = getattr(opt._compression, "wire_dtype", None)
        cut, cur, cur_bytes, cur_dtype = [], [], 0, None
        for unit in self.layout:
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
        return cut

    def _regroup(self, threshold):
        """Form the groups for ``threshold`` and hook each group's update to its first module's forward."""
        self.threshold, self.new_threshold = threshold, None
        for h in self.module_hooks:
            h.remove()
        self.module_hooks = []
        opt = self.opt
        members = opt.process_set.size() or size()
        self.groups = [_Group(k, ps, dt, members, opt.param_groups, opt.op)
                       for k, (ps, dt) in enumerate(self._cut(threshold))]
        self.slot = {p: (g, i) for g in self.groups for i, p in enumerate(g.params)}
        self.version += 1
        # Each group's update runs before the forward of the first module that owns one of its parameters.
        first = self.owner.get(id(self.order[0])) if self.order else None
        last_of: dict = {}
        for g in self.groups:
            g.trigger = self.owner.get(id(g.params[0]), first)
            if g.trigger is not None:
                last_of[id(g.trigger)] = (g.trigger, g.index)
        ref = weakref.ref(self)
        for module, k in last_of.values():
            def pre(mod, args, k=k):
                schedule = ref()
                if schedule is not None and schedule.updates_pending:
                    schedule.apply_upto(k)
            self.module_hooks.append(module.register_forward_pre_hook(pre))
        self._new_step()

    def set_threshold(self, threshold_bytes):
        """Regroup with groups of at most ``threshold_bytes`` at the start of the next backward (nothing is
        in flight then). Every rank must call it before the same step.

        Raises:
            ValueError: ``threshold_bytes`` is negative.
        """
        threshold_bytes = int(threshold_bytes)
        if threshold_bytes < 0:
            raise ValueError("set_dear_threshold: threshold_bytes must be >= 0")
        if self.groups is None:
            self.threshold = threshold_bytes
        else:
            self.new_threshold = threshold_bytes

    def group_names(self):
        """The current groups as lists of parameter names, in forward order."""
        names = self.opt._parameter_names
        return [[names[p] for p in g.params] for g in self.groups or ()]
