"""DistributedOptimizer: average gradients across ranks while backward is still running.

Each parameter's gradient is submitted to the engine from a post-accumulate-grad hook as soon as backward
produces it, so communication overlaps the rest of backward; ``step()`` waits for the results.
"""

from __future__ import annotations

import numbers
import warnings
from contextlib import contextmanager

import torch

from perseus.common import guard as _guard
from perseus.common.api import _basics
from perseus.compression import Pending, Reducer
from perseus.common.partition import split_list
from perseus.common.process_sets import global_process_set
from perseus.common.reduce_ops import Average, ReduceOp, Sum, reject_adasum
from perseus.torch.compression import Compression
from perseus.common.api import size
from perseus.torch._allreduce_ops import (_reduce_compressed, allreduce, allreduce_async_, grouped_allreduce_async_,
                                          sparse_allreduce_async)
from perseus.torch._tensors import synchronize

__all__ = ["DistributedOptimizer"]



def parameter_names(named_parameters, param_groups) -> list:
    """``[(name, parameter)]`` from ``named_parameters`` (checked), or made up from positions when None.

    Raises:
        ValueError: not (name, parameter) tuples, duplicate names, or parameters left unnamed.
    """
    if named_parameters is None:
        return [(f"noname.{i}.{j}", p) for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                         "produced by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: " + ", ".join(dups))
    unnamed = {id(p) for g in param_groups for p in g["params"]} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not "
                         "named. Python object ids: " + ", ".join(str(i) for i in sorted(unnamed)))
    return named


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=Average,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set, sparse_algorithm=None, _defaults=None, _state=None):
        try:
            super(self.__class__, self).__init__(params)
        except TypeError:  # optimizers with required constructor arguments: reuse the wrapped defaults
            torch.optim.Optimizer.__init__(self, params, _defaults or {})
        if _state:
            self.state.update(_state)
        self._compression = compression
        all_params = [p for g in self.param_groups for p in g["params"]]
        named = parameter_names(named_parameters, self.param_groups)
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        reject_adasum(op, "torch.DistributedOptimizer")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            seen = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
        self._parameter_names = {p: n for n, p in sorted(named, key=lambda item: item[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in all_params}
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        if sparse_algorithm is not None:
            from perseus.sparse import resolve_algorithm

            sparse_algorithm = resolve_algorithm(sparse_algorithm)
        self.sparse_algorithm = sparse_algorithm
        self.process_set = process_set
        self._handles: dict = {}
        self._hook_handles = []
        self._requires_update = set()
        self._synchronized = False
        self._presynchronized = False  # clip_grad_norm_ synchronized already: the next step() does not
        self._should_synchronize = True
        self._groups = groups
        self._group_of: dict = {}
        self._group_ready: dict = {}
        #: PERSEUS_NONFINITE_GRADIENTS: each gradient checked as it is submitted, the verdict after the step's
        #: reduction (perseus.common.guard); None when off
        self._guard = _guard.for_optimizer(process_set)
        self._skip_step = False
        # An elastic job may grow from one rank, so its hooks are needed even at size 1.
        if self.process_set.included() and (size() > 1 or _basics.settings.elastic):
            self._register_hooks()

    # -- set-up ----------------------------------------------------------------------------------------
    def _register_hooks(self):
        # A parameter marked perseus_model_parallel (a DistributedEmbedding's shard) differs on every rank and
        # its gradient is complete already: it is never reduced.
        trainable = [p for g in self.param_groups for p in g["params"]
                     if p.requires_grad and not getattr(p, "perseus_model_parallel", False)]
        if self._groups is not None:
            from perseus.torch.functions import broadcast_object

            # Every rank must form the same groups: order parameters as rank 0 names them.
            order = broadcast_object([self._parameter_names[p] for p in trainable], root_rank=0,
                                     name="perseus.param_order", process_set=self.process_set)
            position = {n: i for i, n in enumerate(order)}
            trainable.sort(key=lambda p: position.get(self._parameter_names[p], len(position)))
            if isinstance(self._groups, list):
                ids = {id(p) for p in trainable}
                groups = [[p for p in g if id(p) in ids] for g in self._groups]
                grouped = {id(p) for g in groups for p in g}
                groups += [[p] for p in trainable if id(p) not in grouped]
            else:
                groups = [g for g in split_list(trainable, self._groups) if g]
            for group in groups:
                key = tuple(group)
                for p in group:
                    self._group_of[p] = key
                self._group_ready[key] = set()
        for p in trainable:
            self._requires_update.add(p)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    def _make_hook(self):
        def hook(p):
            if p in self._handles and self._handles[p][0] is not None:
                if self._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times before call to "
                        "step(). Increase backward_passes_per_step to accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] > 0:
                return
            group = self._group_of.get(p)
            if group is None:
                self._handles[p] = self._allreduce_grad_async(p)
                return
            ready = self._group_ready[group]
            ready.add(p)
            if len(ready) == len(group):
                self._handles[group] = self._grouped_allreduce_async(group)
                ready.clear()
        return hook

    # -- submission ------------------------------------------------------------------------------------
    def _scales(self):
        if self.op == Average:  # the engine divides by the set size on top of postscale
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # Another rank may have produced this gradient (dynamic graphs): submit zeros, never hang.
            p.grad = torch.zeros_like(p)
        name = f"grad.{self._parameter_names.get(p)}"
        grad, sparse = p.grad, p.grad.is_sparse
        if self._guard is not None:
            self._check_finite(name, grad._values() if sparse else grad)
        if sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set,
                                              algorithm=self.sparse_algorithm), None
            grad = grad.to_dense()
        pre, post = self._scales()
        if isinstance(self._compression, Reducer):
            if not grad.is_contiguous() or sparse:
                grad = p.grad = grad.contiguous()
            pending = _reduce_compressed(self._compression, name, [grad], [grad], self.op, pre, post,
                                         self.process_set)
            return pending, None
        compressed, ctx = self._compression.compress(grad)
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                  postscale_factor=post, process_set=self.process_set)
        return handle, (ctx, sparse)

    def _check_finite(self, name, grad):
        """The guard's local check; in 'skip' mode a non-finite gradient is zeroed before it is sent, so that
        nothing (a compressor's error feedback included) keeps its NaN once the step is skipped."""
        finite = bool(torch.isfinite(grad).all())
        self._guard.note(name, finite)
        if not finite and self._guard.mode == "skip":
            grad.zero_()

    def _grouped_allreduce_async(self, group):
        grads = []
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            if self._guard is not None:
                self._check_finite(f"grad.{self._parameter_names.get(p)}", grads[-1])
        pre, post = self._scales()
        if isinstance(self._compression, Reducer):
            grads = [g.contiguous() for g in grads]
            for p, g in zip(group, grads):
                p.grad = g
            pending = _reduce_compressed(self._compression, f"grad.group.{self._parameter_names[group[0]]}", grads,
                                         grads, self.op, pre, post, self.process_set)
            return pending, None
        pairs = [self._compression.compress(g) for g in grads]
        handle = grouped_allreduce_async_([c for c, _ in pairs],
                                          name=f"grad.group.{self._parameter_names[group[0]]}",
                                          op=self.op, prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return handle, [(ctx, p.grad.is_sparse) for p, (_, ctx) in zip(group, pairs)]

    # -- public methods --------------------------------------------------------------------------------
    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def synchronize(self):
        """Submit any gradient not yet submitted (zeros if it was never computed) and wait for all of them.

        Collective: every rank of the process set calls it (``step()`` does).
        """
        if not self.process_set.included():
            self._synchronized = True
            return
        done = set()
        for key in self._handles:
            done.update(key if isinstance(key, tuple) else (key,))
        for p in self._requires_update - done:
            group = self._group_of.get(p)
            if group is None:
                self._handles[p] = self._allreduce_grad_async(p)
            elif group not in self._handles:
                self._handles[group] = self._grouped_allreduce_async(group)
                self._group_ready[group].clear()
        for key, (handle, ctx) in list(self._handles.items()):
            if isinstance(handle, Pending):  # a communicating compressor wrote the result into the gradients
                handle.wait()
                for p in key if isinstance(key, tuple) else (key,):
                    self._allreduce_delay[p] = self.backward_passes_per_step
                continue
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                for p, out, (c, sparse) in zip(key, outputs, ctx):
                    self._allreduce_delay[p] = self.backward_passes_per_step
                    self._set_grad(p, self._compression.decompress(out, c), sparse)
                continue
            p = key
            self._allreduce_delay[p] = self.backward_passes_per_step
            if callable(handle):  # a sparse reduction returns a closure
                p.grad = handle()
                continue
            c, sparse = ctx
            self._set_grad(p, self._compression.decompress(synchronize(handle), c), sparse)
        self._handles.clear()
        self._synchronized = True
        if self._guard is not None and not self._guard.verdict():
            self._skip_step = True  # PERSEUS_NONFINITE_GRADIENTS=skip: the next step() does nothing

    @staticmethod
    def _set_grad(p, value, sparse=False):
        """Put the reduced gradient back: sparse again if it was sparse, else in place when possible."""
        if sparse:
            p.grad = value.to_sparse()
        elif value is p.grad:
            return
        elif p.grad is not None and value.dtype == p.grad.dtype and value.shape == p.grad.shape:
            p.grad.copy_(value)
        else:
            p.grad = value

    @contextmanager
    def skip_synchronize(self):
        """Inside this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """One optimizer step with the gradients averaged over the ranks; returns the closure's loss, if any.

        Without ``closure``: waits for the gradients submitted during backward (unless inside
        ``skip_synchronize()``), then steps.

        With ``closure`` (L-BFGS, or any optimizer given one): the wrapped optimizer may evaluate the closure
        several times; every evaluation's gradients are averaged over the ranks before the optimizer reads
        them, and the loss it returns is averaged too (a detached tensor of the same dtype, device and
        shape, or a float), so every rank sees the same values, takes the same decisions and evaluates the
        closure the same number of times. Each evaluation is reduced at its end, whatever
        ``backward_passes_per_step`` says.

        Collective: every rank of the process set calls it, with a closure on every rank or on none.
        The closure must return a tensor or a number on every rank, or None on every rank.

        Raises:
            RuntimeError: with a closure, the ranks disagree on whether to evaluate it once more (their
                optimizers diverged); every rank raises instead of waiting forever.
            TypeError: the closure returned something other than a tensor, a number or None.
        """
        if closure is not None and self._hook_handles and self.process_set.included():
            return self._step_with_closure(closure)
        if self._should_synchronize and not self._presynchronized:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = self._presynchronized = False
        if self._skip_step:  # non-finite gradients on some rank (every rank skips this step)
            self._skip_step = False
            return None
        return super(self.__class__, self).step(closure)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the averaged gradients by their global norm; call it after backward, before ``step()``.

        Waits for the reductions (``synchronize()``), clips every gradient with
        ``torch.nn.utils.clip_grad_norm_`` and lets the next ``step()`` skip synchronizing. Returns the total
        norm. The same call works with ``schedule="dear"`` (docs/dear.md), so scripts can switch schedules.

        Collective: every rank of the process set calls it.
        """
        self.synchronize()
        self._presynchronized = True
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def _step_with_closure(self, closure):
        if self._guard is not None and self._guard.mode == "skip":
            raise NotImplementedError("PERSEUS_NONFINITE_GRADIENTS=skip does not apply to step(closure); use "
                                      "'raise' (the closure's gradients are checked) or step() without a closure")
        """``step(closure)`` across ranks: see :meth:`step`."""
        if self._handles:  # a backward pass made before step(): finish its reductions before the closure runs
            self.synchronize()

        def evaluate():
            self._closure_rendezvous(evaluating=True)
            loss = closure()
            self.synchronize()  # the gradients of this evaluation, averaged, before the optimizer reads them
            return self._average_loss(loss)

        loss = super(self.__class__, self).step(evaluate)
        self._closure_rendezvous(evaluating=False)
        self._synchronized = False
        return loss

    def _closure_rendezvous(self, evaluating):
        """Every rank says whether it is about to evaluate the closure again (before any gradient is
        submitted); a disagreement raises on every rank rather than leaving some ranks waiting forever."""
        flag = torch.tensor([1.0 if evaluating else 0.0], dtype=torch.float64)
        count = int(allreduce(flag, name="perseus.closure.evaluating", op=Sum, process_set=self.process_set))
        members = self.process_set.size() or size()
        if count not in (0, members):
            raise RuntimeError(
                f"optimizer.step(closure): {count} of {members} ranks evaluate the closure once more and the "
                f"others have finished the step; the ranks' optimizers have diverged (this rank "
                f"{'evaluates again' if evaluating else 'has finished'}). Every rank must compute the same "
                "parameters: broadcast them from one rank, and give every rank the same data layout and "
                "number of samples per step.")

    def _average_loss(self, loss):
        """The closure's loss averaged over the ranks (float64 on the wire), as the same kind of value."""
        if loss is None:
            return None
        if torch.is_tensor(loss):
            value = loss.detach()
            mean = allreduce(value.to("cpu", torch.float64), name="perseus.closure.loss", op=Average,
                             process_set=self.process_set)
            return mean.to(device=value.device, dtype=value.dtype)
        if isinstance(loss, numbers.Real):
            mean = allreduce(torch.tensor([float(loss)], dtype=torch.float64), name="perseus.closure.loss",
                             op=Average, process_set=self.process_set)
            return float(mean[0])
        raise TypeError(f"optimizer.step(closure): the closure returned a {type(loss).__name__}; it must return "
                        "the loss as a tensor or a number, or None")

    def _perseus_local_step(self, closure=None):
        """The wrapped optimizer's own step, with no communication (used to initialise state)."""
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        return super(self.__class__, self).load_state_dict(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set,
                         sparse_algorithm=None, schedule="default"):
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of a subclass of the wrapped optimizer's class, with the same class name,
    the same parameter groups and the same state.

    ``step(closure)`` works too (``torch.optim.LBFGS``, or any optimizer given a closure): each evaluation of
    the closure gets gradients averaged over the ranks, and the loss it returns is averaged as well, so every
    rank's optimizer makes the same decisions (L-BFGS's line search, its stopping tests) and evaluates the
    closure the same number of times; ranks that still disagree raise ``RuntimeError`` rather than hang.

    Args:
        optimizer: the torch.optim.Optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names the gradients so every rank matches them.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16`` for the wire, or a
            communicating compressor such as ``Compression.topk(0.01)`` (docs/compression.md); those keep
            per-parameter state, so give each optimizer its own instance.
        backward_passes_per_step: backward passes accumulated locally before gradients are reduced.
        op: ``Average`` (default), ``Sum``, or ``Adasum``: each rank runs the wrapped optimizer on each
            parameter as soon as its gradient is ready and the ranks' updates (not gradients) are combined
            by Adasum (perseus.torch.adasum_optimizer; docs/adasum.md).
        gradient_predivide_factor: divide gradients by this before summing and multiply after (Average only).
        num_groups: deprecated; use ``groups``.
        groups: an int (split the parameters into that many groups) or a list of lists of parameters; each
            group is reduced as one grouped allreduce.
        sparse_as_dense: reduce sparse gradients as dense tensors (the gradients become dense, as in Horovod).
        process_set: the ranks that train together.
        sparse_algorithm: (perseus) how sparse gradients are reduced when not ``sparse_as_dense``: 'auto',
            'zen', 'allgather', 'dense' or 'alltoall' (see :func:`sparse_allreduce_async` and docs/sparse.md);
            None reads PERSEUS_SPARSE_ALGORITHM (default 'auto'). The gradient stays sparse.
        schedule: (perseus) ``"default"``: each gradient is all-reduced during backward and ``step()`` waits
            for all of them. ``"dear"``: gradients are reduce-scattered per fusion group during backward,
            ``step()`` waits only for those, and each group's all-gather and update run just before the
            group's next forward (docs/dear.md); every rank must pass the same schedule, and
            ``synchronize()`` (or ``finish()``) after the last ``step()`` applies the last update. A DeAR
            optimizer also has ``finish()``, ``set_dear_threshold(bytes)`` (group size, from the next
            backward; PERSEUS_DEAR_THRESHOLD_BYTES by default) and ``dear_groups()``.

    Both schedules offer ``optimizer.clip_grad_norm_(max_norm, norm_type=2.0)``: call it after backward and
    before ``step()`` to clip the averaged gradients by their global norm (it returns the norm).

    Raises:
        ValueError: bad names, groups, factors, ``backward_passes_per_step``, ``sparse_algorithm`` or
            ``schedule``.
        NotImplementedError: ``schedule="dear"`` with ``groups``, a communicating compressor, or in an
            elastic job; ``op=Adasum`` with ``groups``, a communicating compressor or ``schedule="dear"``;
            PERSEUS_NONFINITE_GRADIENTS set with ``op=Adasum`` or ``schedule="dear"``.

    With PERSEUS_NONFINITE_GRADIENTS=raise or skip, each gradient is checked for NaN/Inf on its rank before
    it is reduced, and ``step()`` raises ``perseus.common.exceptions.NonFiniteGradientError`` on every rank
    (naming the tensors and ranks) or skips the update on every rank (docs/troubleshooting.md).
    """
    if schedule not in ("default", "dear"):
        raise ValueError(f"DistributedOptimizer: schedule must be 'default' or 'dear', not {schedule!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    methods = dict(_DistributedOptimizer.__dict__)
    if int(op) == int(ReduceOp.ADASUM):
        if schedule == "dear":
            raise NotImplementedError("DistributedOptimizer: schedule='dear' with op=Adasum is not supported; "
                                      "use one of them")
        from perseus.torch import adasum_optimizer

        _guard.refuse("DistributedOptimizer(op=Adasum)")
        adasum_optimizer.check_arguments(compression, groups, sparse_as_dense, gradient_predivide_factor)
        methods = adasum_optimizer.mixin()
    elif schedule == "dear":
        _guard.refuse("DistributedOptimizer(schedule='dear')")
        from perseus.torch import dear

        dear.check_arguments(compression, groups)
        methods = dear.mixin()
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, sparse_algorithm,
               _defaults=optimizer.defaults, _state=dict(optimizer.state))
