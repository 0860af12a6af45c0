"""``DistributedOptimizer(op=hvd.Adasum)``: Adasum applied to each rank's model update, not to its gradient.

Adasum combines vectors by how much they agree, so it should see what the optimizer would do with a
gradient (momentum, Adam's scaling, the learning rate), not the raw gradient. Each rank therefore, as soon
as backward has produced a parameter's gradient:

1. remembers the parameter's value (``start``),
2. runs the wrapped optimizer's step on that parameter alone (its own state: momentum, Adam moments),
3. turns the parameter into its local update ``delta = p - start`` and starts an Adasum all-reduce of it;

and ``step()`` waits for every parameter's combined delta and sets ``p = start + delta``. Parameters whose
gradient never came are reduced with a zero update, so every rank runs the same collectives. With
``backward_passes_per_step = k`` gradients accumulate locally and the update runs on the k-th pass.

Every rank must call backward and ``step()`` alike (collective); every rank's parameters are equal after
``step()`` when they were before (the broadcast at the start of training).
"""

from __future__ import annotations

import torch

from perseus.lifecycle.api import size
from perseus.base.reduce_ops import Adasum
from perseus.compression import Reducer
from perseus.torch._allreduce_ops import allreduce_async_
from perseus.torch._schedule import TOO_MANY_PASSES, PendingReduction, Schedule
from perseus.torch._tensors import synchronize

__all__ = ["AdasumSchedule"]


class AdasumSchedule(Schedule):
    """The schedule of ``DistributedOptimizer(op=Adasum)``: per-parameter local steps during backward, the
    updates combined by Adasum, ``p = start + combined update`` at ``step()``.

    Raises (on construction):
        NotImplementedError: a communicating compressor, or ``groups``.
        ValueError: ``gradient_predivide_factor`` other than 1.
    """

    def __init__(self, opt):
        if isinstance(opt._compression, Reducer):
            raise NotImplementedError("DistributedOptimizer(op=Adasum) takes Compression.none, fp16 or bf16, not a "
                                      "communicating compressor; Adasum needs each rank's whole update")
        if opt._groups:
            raise NotImplementedError("DistributedOptimizer(op=Adasum): groups are not supported; leave groups "
                                      "unset")
        if opt.gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        super().__init__(opt)
        #: each parameter's value before this step's local update
        self.start_values = {p: torch.empty_like(p, memory_format=torch.preserve_format)
                             for p in self.delay if p.requires_grad}

    def start(self):
        if self.opt.process_set.included() and size() > 1:
            for p in self.start_values:
                self.requires_update.add(p)
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    # -- the per-parameter update ------------------------------------------------------------------------
    def _local_step_on(self, p) -> None:
        """The wrapped optimizer's step on ``p`` alone: the other parameters are hidden from it."""
        opt = self.opt
        hidden = []
        for group in opt.param_groups:
            hidden.append(group["params"])
            group["params"] = [q for q in group["params"] if q is p]
        try:
            opt._perseus_local_step()
        finally:
            for group, params in zip(opt.param_groups, hidden):
                group["params"] = params

    def _submit(self, p) -> PendingReduction:
        """Run the local step on ``p`` and start the Adasum all-reduce of its update."""
        opt = self.opt
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not opt.sparse_as_dense:
                raise NotImplementedError("DistributedOptimizer(op=Adasum): sparse gradients need "
                                          "sparse_as_dense=True")
            p.grad = p.grad.to_dense()
        start = self.start_values[p]
        with torch.no_grad():
            start.copy_(p)
            self._local_step_on(p)
            p.sub_(start)  # p now holds this rank's update
        compressed, ctx = opt._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=f"adasum.{opt._parameter_names.get(p)}", op=Adasum,
                                  process_set=opt.process_set)
        return PendingReduction(self._apply, handle, p, ctx)

    def _apply(self, handle, p, ctx):
        """``p = start + combined update``."""
        delta = self.opt._compression.decompress(synchronize(handle), ctx)
        with torch.no_grad():
            p.copy_(self.start_values[p] + delta.to(p.dtype))

    def _hook(self, p):
        if p in self.pending:
            raise AssertionError(TOO_MANY_PASSES)
        self.delay[p] -= 1
        if self.delay[p] > 0:
            return
        self.pending[p] = self._submit(p)

    # -- the optimizer's methods -------------------------------------------------------------------------
    def synchronize(self):
        """Submit the update of every parameter whose gradient did not come (zero update), wait for all of
        them and apply ``p = start + combined update``. Collective."""
        if not self.opt.process_set.included() or not self.hooks:
            self.synchronized = True
            return
        pending = self.pending
        for p in self.start_values:
            if p not in pending:
                pending[p] = self._submit(p)
        passes = self.opt.backward_passes_per_step
        for p, reduction in pending.items():
            reduction.wait()
            self.delay[p] = passes
        pending.clear()
        self.synchronized = True

    def step(self, closure=None):
        """Apply the Adasum-combined updates (the wrapped optimizer already ran per parameter during
        backward). Returns the closure's loss, if one is given (it is evaluated once, before). Collective."""
        opt = self.opt
        if not self.hooks:  # one rank: the plain optimizer
            return opt._perseus_local_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.should_synchronize:
            opt.synchronize()
        self.synchronized = False
        return loss

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Not available: each rank's update is applied during backward, so no averaged gradients exist to
        clip.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("DistributedOptimizer(op=Adasum) has no averaged gradients to clip (each "
                                  "rank's update is made during backward); use op=Average to clip them")
