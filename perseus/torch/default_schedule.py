"""The default schedule of :func:`perseus.torch.DistributedOptimizer`: reduce while backward is still running.

Each parameter's gradient is submitted to the engine from a post-accumulate-grad hook as soon as backward
produces it (or, with ``groups``, as soon as every gradient of its group is there), so communication
overlaps the rest of backward; ``step()`` waits for the results and runs the wrapped optimizer.
"""

from __future__ import annotations

import numbers
import warnings

import torch

from perseus.runtime import guard as _guard
from perseus.lifecycle.api import _basics, size
from perseus.base.partition import split_list
from perseus.runtime.process_sets import global_process_set
from perseus.runtime.step_policy import Following
from perseus.base.reduce_ops import Average, Sum
from perseus.compression import Reducer
from perseus.torch import device as _device
from perseus.torch._local_step import LocalSteps
from perseus.torch._allreduce_ops import (_reduce_compressed, allreduce, allreduce_async_, grouped_allreduce_async_,
                                          sparse_allreduce_async)
from perseus.torch._schedule import TOO_MANY_PASSES, PendingReduction, Schedule, check_op
from perseus.torch._tensors import synchronize
from perseus.torch.compression import Compression
from perseus.torch.functions import broadcast_object

__all__ = ["DefaultSchedule", "check_groups"]


def check_groups(groups) -> None:
    """Raise ValueError unless ``groups`` is None, a positive int or a list of lists of distinct tensors."""
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


def _params_of(key) -> tuple:
    """The parameters a key of :attr:`Schedule.pending` stands for (one parameter, or a group's tuple)."""
    return key if isinstance(key, tuple) else (key,)


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


def _finish_one(handle, p, compression, ctx, sparse):
    """Finish an all-reduce of one gradient: the result, decompressed, into ``p.grad``."""
    _set_grad(p, compression.decompress(synchronize(handle), ctx), sparse)


def _finish_group(handle, group, compression, ctxs):
    """Finish a grouped all-reduce: each result, decompressed, into its parameter's ``.grad``."""
    for p, out, (ctx, sparse) in zip(group, synchronize(handle), ctxs):
        _set_grad(p, compression.decompress(out, ctx), sparse)


def _put_sparse(p, wait):
    """Finish a sparse reduction: ``wait()`` returns the reduced sparse gradient."""
    p.grad = wait()


class DefaultSchedule(Schedule):
    """All-reduce each gradient (or group) from its hook; ``step()`` waits for all of them, then steps.

    Raises (on construction):
        ValueError: ``op=Adasum`` (another schedule), ``gradient_predivide_factor`` with an op other than
            Average, or malformed ``groups``.
    """

    def __init__(self, opt):
        check_op(opt)
        check_groups(opt._groups)
        super().__init__(opt)
        self.group_of: dict = {}      # parameter -> its group's tuple (grouped parameters only)
        self.group_ready: dict = {}   # group tuple -> the parameters whose gradients are ready
        self.wire_names: dict = {}    # parameter -> the name its gradient's reduction carries ("grad.<name>")
        self.presynchronized = False  # clip_grad_norm_ synchronized already: the next step() does not
        self.skip_step = False        # the guard saw a non-finite gradient: the next step() does nothing
        #: PERSEUS_NONFINITE_GRADIENTS: each gradient checked as it is submitted, the verdict after the step's
        #: reduction (perseus.runtime.guard); None when off
        self.guard = _guard.for_optimizer(opt.process_set)
        #: momentum correction and local clipping, when the compressor is a sparsifier (torch/_local_step.py)
        self.local = LocalSteps(opt)
        #: the tuner's hold on the GPU path (perseus.autotune: space.PATH), once gradients went through the launcher
        self.path = None

    # -- set-up ----------------------------------------------------------------------------------------
    def start(self):
        # An elastic job may grow from one rank, so its hooks are needed even at size 1.
        if self.opt.process_set.included() and (size() > 1 or _basics.settings.elastic):
            self._register_hooks()

    def _register_hooks(self):
        opt = self.opt
        # A parameter marked perseus_model_parallel (a DistributedEmbedding's shard) differs on every rank and
        # its gradient is complete already: it is never reduced.
        trainable = [p for g in opt.param_groups for p in g["params"]
                     if p.requires_grad and not getattr(p, "perseus_model_parallel", False)]
        if opt._groups is not None:
            self._form_groups(trainable)
        names = opt._parameter_names
        self.wire_names.update((p, f"grad.{names.get(p)}") for p in trainable)
        hook = self._make_hook()
        for p in trainable:
            self.requires_update.add(p)
            self.hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _form_groups(self, trainable):
        """Fill :attr:`group_of` and :attr:`group_ready` from ``groups``; sorts ``trainable`` in place.
        Collective (a broadcast from rank 0): every rank must form the same groups."""
        opt, names = self.opt, self.opt._parameter_names
        order = broadcast_object([names[p] for p in trainable], root_rank=0, name="perseus.param_order",
                                 process_set=opt.process_set)
        position = {n: i for i, n in enumerate(order)}
        trainable.sort(key=lambda p: position.get(names[p], len(position)))
        if isinstance(opt._groups, list):
            ids = {id(p) for p in trainable}
            groups = [[p for p in g if id(p) in ids] for g in opt._groups]
            grouped = {id(p) for g in groups for p in g}
            groups += [[p] for p in trainable if id(p) not in grouped]
        else:
            groups = [g for g in split_list(trainable, opt._groups) if g]
        for group in groups:
            key = tuple(group)
            for p in group:
                self.group_of[p] = key
            self.group_ready[key] = set()

    def _make_hook(self):
        # The per-gradient path: the dictionaries are bound once (they are only ever changed in place).
        pending, delay, group_of, group_ready = self.pending, self.delay, self.group_of, self.group_ready
        submit, submit_group = self._submit, self._submit_group

        def hook(p):
            if p in pending and delay[p] <= 0:
                raise AssertionError(TOO_MANY_PASSES)
            assert not p.grad.requires_grad
            assert delay[p] > 0
            delay[p] -= 1
            if delay[p] > 0:
                return
            group = group_of.get(p)
            if group is None:
                pending[p] = submit(p)
                return
            ready = group_ready[group]
            ready.add(p)
            if len(ready) == len(group):
                pending[group] = submit_group(group)
                ready.clear()
        return hook

    # -- submission ------------------------------------------------------------------------------------
    def _submit(self, p) -> PendingReduction:
        """Start the reduction of ``p``'s gradient (zeros if it has none)."""
        opt = self.opt
        if p.grad is None:
            # Another rank may have produced this gradient (dynamic graphs): submit zeros, never hang.
            p.grad = torch.zeros_like(p)
        name = self.wire_names[p]
        grad, sparse = p.grad, p.grad.is_sparse
        if self.guard is not None:
            self._check_finite(name, grad._values() if sparse else grad)
        if sparse:
            if not opt.sparse_as_dense:
                return PendingReduction(_put_sparse, p, sparse_allreduce_async(
                    grad, name=name, op=opt.op, process_set=opt.process_set, algorithm=opt.sparse_algorithm))
            grad = grad.to_dense()
        pre, post = self.scales()
        compression = opt._compression
        if isinstance(compression, Reducer) and self.local.dense_now():
            compression.note_dense(4 * grad.numel())
            compression = Compression.none  # Adam's dense steps before its variance is frozen
        if isinstance(compression, Reducer):  # the compressor writes the result into the gradient
            if not grad.is_contiguous() or sparse:
                grad = p.grad = grad.contiguous()
            return PendingReduction(_reduce_compressed(compression, name, [grad], [grad], opt.op, pre, post,
                                                       opt.process_set, self.local.spec(p, grad)).wait)
        compressed, ctx = compression.compress(grad)
        handle = allreduce_async_(compressed, name=name, op=opt.op, prescale_factor=pre, postscale_factor=post,
                                  process_set=opt.process_set)
        return PendingReduction(_finish_one, handle, p, compression, ctx, sparse)

    def _check_finite(self, name, grad):
        """The guard's local check; in 'skip' mode a non-finite gradient is zeroed before it is sent, so that
        nothing (a compressor's error feedback included) keeps its NaN once the step is skipped."""
        finite = bool(torch.isfinite(grad).all())
        self.guard.note(name, finite)
        if not finite and self.guard.mode == "skip":
            grad.zero_()

    def _submit_group(self, group) -> PendingReduction:
        """Start one grouped reduction of the gradients of ``group`` (a tuple of parameters)."""
        opt = self.opt
        grads = []
        for p in group:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            if self.guard is not None:
                self._check_finite(self.wire_names[p], grads[-1])
        pre, post = self.scales()
        name = f"grad.group.{opt._parameter_names[group[0]]}"
        compression = opt._compression
        if isinstance(compression, Reducer) and self.local.dense_now():
            compression.note_dense(4 * sum(g.numel() for g in grads))
            compression = Compression.none
        if isinstance(compression, Reducer):
            grads = [g.contiguous() for g in grads]
            for p, g in zip(group, grads):
                p.grad = g
            specs = {self.local.spec(p, g) for p, g in zip(group, grads)}
            if len(specs) > 1:
                raise NotImplementedError(
                    f"DistributedOptimizer: the gradients of group {name!r} belong to parameter groups with "
                    "different momentum settings, which the compressor applies per group; put parameters of "
                    "one optimizer parameter group in each of groups=")
            return PendingReduction(_reduce_compressed(compression, name, grads, grads, opt.op, pre, post,
                                                       opt.process_set, specs.pop()).wait)
        pairs = [compression.compress(g) for g in grads]
        handle = grouped_allreduce_async_([c for c, _ in pairs], name=name, op=opt.op, prescale_factor=pre,
                                          postscale_factor=post, process_set=opt.process_set)
        return PendingReduction(_finish_group, handle, group, compression,
                                [(ctx, p.grad.is_sparse) for p, (_, ctx) in zip(group, pairs)])

    # -- the optimizer's methods -------------------------------------------------------------------------
    def synchronize(self):
        """Submit any gradient not yet submitted (zeros if it was never computed) and wait for all of them.

        Collective: every rank of the process set calls it (``step()`` does).
        """
        opt = self.opt
        if not opt.process_set.included():
            self.synchronized = True
            return
        pending = self.pending
        done = set()
        for key in pending:
            done.update(_params_of(key))
        for p in self.requires_update - done:
            group = self.group_of.get(p)
            if group is None:
                pending[p] = self._submit(p)
            elif group not in pending:
                pending[group] = self._submit_group(group)
                self.group_ready[group].clear()
        passes, delay = opt.backward_passes_per_step, self.delay
        for key, reduction in list(pending.items()):
            if isinstance(key, tuple):
                for p in key:
                    delay[p] = passes
            else:
                delay[key] = passes
            reduction.wait()
        pending.clear()
        self.synchronized = True
        if self.guard is not None and not self.guard.verdict():
            self.skip_step = True  # PERSEUS_NONFINITE_GRADIENTS=skip: the next step() does nothing

    def step(self, closure=None):
        """See :meth:`perseus.torch.optimizer._DistributedOptimizer.step`."""
        opt = self.opt
        if closure is not None and self.hooks and opt.process_set.included():
            return self._step_with_closure(closure)
        if self.should_synchronize and not self.presynchronized:
            if self.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            opt.synchronize()  # (the optimizer's method: a subclass may extend it)
        self.synchronized = self.presynchronized = False
        if self.skip_step:  # non-finite gradients on some rank (every rank skips this step)
            self.skip_step = False
            self._follow_path()
            return None
        result = self.local.step(opt._perseus_local_step, closure)
        self._follow_path()
        return result

    def _follow_path(self) -> None:
        """At the end of a step (every rank at the same one): the GPU path the tuner agreed on, from the next
        step on. Only for the global process set, once its gradients have gone through the device launcher
        (the same step on every rank); without autotuning nothing is exchanged."""
        if self.path is None:
            opt = self.opt
            if opt.process_set is not global_process_set or not _device.launched():
                return
            self.path = Following("path")
        code = self.path.at_call(self.opt, "path.step", self.opt.process_set)
        if code is not None and code >= 0:
            _device.use_path(code)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Wait for the reductions, clip, and let the next ``step()`` skip synchronizing. Collective.

        With a compressor that takes local steps (a sparsifier with error feedback), the 2-norm bound is
        applied on each rank before accumulation from the next gradients on (perseus/torch/_local_step.py);
        the averaged result is then left as it is and its norm returned."""
        opt = self.opt
        opt.synchronize()
        self.presynchronized = True
        if float(norm_type) == 2.0 and opt.process_set.included():
            entries = sum(p.numel() for p in self.requires_update)
            members = opt.process_set.size() or size()
            if self.local.clip_locally(max_norm, members, entries):
                return super().clip_grad_norm_(float("inf"), norm_type, error_if_nonfinite)
        return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def forget(self):
        super().forget()
        self.local.forget()
        for ready in self.group_ready.values():
            ready.clear()

    # -- step(closure) -------------------------------------------------------------------------------------
    def _step_with_closure(self, closure):
        """``step(closure)`` across ranks: see :meth:`perseus.torch.optimizer._DistributedOptimizer.step`."""
        if self.guard is not None and self.guard.mode == "skip":
            raise NotImplementedError("PERSEUS_NONFINITE_GRADIENTS=skip does not apply to step(closure); use "
                                      "'raise' (the closure's gradients are checked) or step() without a closure")
        opt = self.opt
        if self.pending:  # a backward pass made before step(): finish its reductions before the closure runs
            opt.synchronize()

        def evaluate():
            self._closure_rendezvous(evaluating=True)
            loss = closure()
            opt.synchronize()  # the gradients of this evaluation, averaged, before the optimizer reads them
            return self._average_loss(loss)

        loss = self.local.step(opt._perseus_local_step, evaluate)
        self._closure_rendezvous(evaluating=False)
        self.synchronized = False
        return loss

    def _closure_rendezvous(self, evaluating):
        """Every rank says whether it is about to evaluate the closure again (before any gradient is
        submitted); a disagreement raises on every rank rather than leaving some ranks waiting forever."""
        process_set = self.opt.process_set
        flag = torch.tensor([1.0 if evaluating else 0.0], dtype=torch.float64)
        count = int(allreduce(flag, name="perseus.closure.evaluating", op=Sum, process_set=process_set))
        members = process_set.size() or size()
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
        process_set = self.opt.process_set
        if torch.is_tensor(loss):
            value = loss.detach()
            mean = allreduce(value.to("cpu", torch.float64), name="perseus.closure.loss", op=Average,
                             process_set=process_set)
            return mean.to(device=value.device, dtype=value.dtype)
        if isinstance(loss, numbers.Real):
            mean = allreduce(torch.tensor([float(loss)], dtype=torch.float64), name="perseus.closure.loss",
                             op=Average, process_set=process_set)
            return float(mean[0])
        raise TypeError(f"optimizer.step(closure): the closure returned a {type(loss).__name__}; it must return "
                        "the loss as a tensor or a number, or None")
