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

from perseus.common.process_sets import global_process_set
from perseus.common.reduce_ops import Adasum
from perseus.torch.mpi_ops import allreduce_async_, size, synchronize

__all__ = ["mixin", "check_arguments"]


def check_arguments(compression, groups, sparse_as_dense, gradient_predivide_factor) -> None:
    """Raise NotImplementedError/ValueError for what the Adasum optimizer does not take."""
    from perseus.compression import Reducer

    if isinstance(compression, Reducer):
        raise NotImplementedError("DistributedOptimizer(op=Adasum) takes Compression.none, fp16 or bf16, not a "
                                  "communicating compressor; Adasum needs each rank's whole update")
    if groups:
        raise NotImplementedError("DistributedOptimizer(op=Adasum): groups are not supported; leave groups unset")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


class _AdasumOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see perseus.torch.DistributedOptimizer)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=Adasum,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set, sparse_algorithm=None, _defaults=None, _state=None):
        try:
            super(self.__class__, self).__init__(params)
        except TypeError:
            torch.optim.Optimizer.__init__(self, params, _defaults or {})
        if _state:
            self.state.update(_state)
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        from perseus.torch.optimizer import parameter_names

        all_params = [p for g in self.param_groups for p in g["params"]]
        self._parameter_names = {p: n for n, p in parameter_names(named_parameters, self.param_groups)}
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        self._delay = {p: backward_passes_per_step for p in all_params}
        self._start = {p: torch.empty_like(p, memory_format=torch.preserve_format)
                       for p in all_params if p.requires_grad}
        self._handles: dict = {}
        self._hooks = []
        self._synchronized = False
        self._should_synchronize = True
        if self.process_set.included() and size() > 1:
            for p in self._start:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    # -- the per-parameter update ------------------------------------------------------------------------
    def _local_step_on(self, p) -> None:
        """The wrapped optimizer's step on ``p`` alone: the other parameters are hidden from it."""
        hidden = []
        for group in self.param_groups:
            hidden.append(group["params"])
            group["params"] = [q for q in group["params"] if q is p]
        try:
            super(self.__class__, self).step()
        finally:
            for group, params in zip(self.param_groups, hidden):
                group["params"] = params

    def _submit(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                raise NotImplementedError("DistributedOptimizer(op=Adasum): sparse gradients need "
                                          "sparse_as_dense=True")
            p.grad = p.grad.to_dense()
        start = self._start[p]
        with torch.no_grad():
            start.copy_(p)
            self._local_step_on(p)
            p.sub_(start)  # p now holds this rank's update
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=f"adasum.{self._parameter_names.get(p)}", op=Adasum,
                                  process_set=self.process_set)
        return handle, ctx

    def _hook(self, p):
        if p in self._handles:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        self._handles[p] = self._submit(p)

    # -- public ------------------------------------------------------------------------------------------
    def synchronize(self):
        """Submit the update of every parameter whose gradient did not come (zero update), wait for all of
        them and apply ``p = start + combined update``. Collective."""
        if not self.process_set.included() or not self._hooks:
            self._synchronized = True
            return
        for p in self._start:
            if p not in self._handles:
                self._handles[p] = self._submit(p)
        with torch.no_grad():
            for p, (handle, ctx) in self._handles.items():
                delta = self._compression.decompress(synchronize(handle), ctx)
                p.copy_(self._start[p] + delta.to(p.dtype))
                self._delay[p] = self.backward_passes_per_step
        self._handles.clear()
        self._synchronized = True

    def step(self, closure=None):
        """Apply the Adasum-combined updates (the wrapped optimizer already ran per parameter during
        backward). Returns the closure's loss, if one is given (it is evaluated once, before). Collective."""
        if not self._hooks:  # one rank: the plain optimizer
            return super(self.__class__, self).step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        return loss

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def mixin() -> dict:
    """The methods of the Adasum optimizer subclass."""
    return dict(_AdasumOptimizer.__dict__)
