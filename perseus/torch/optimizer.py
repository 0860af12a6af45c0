"""DistributedOptimizer: average gradients across ranks while backward is still running.

:func:`DistributedOptimizer` returns an instance of a class made for the wrapped optimizer's class: a mixin
of this module (its methods first) on top of that class, so ``isinstance(opt, type(original))`` holds, the
wrapped class's ``step()``, ``zero_grad()``, ``state_dict()`` ... are reached with ``super()``, and the
result may itself be subclassed. The mixin keeps the configuration and forwards the work to a schedule
(:class:`perseus.torch._schedule.Schedule`) chosen when the optimizer is built: the default one
(:mod:`perseus.torch.default_schedule`), Adasum's (:mod:`perseus.torch.adasum_optimizer`) or DeAR's
(:mod:`perseus.torch.dear`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from perseus.runtime import guard as _guard
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Average, ReduceOp
from perseus.sparse import resolve_algorithm
from perseus.torch._schedule import parameter_names
from perseus.torch.adasum_optimizer import AdasumSchedule
from perseus.torch.compression import Compression
from perseus.torch.dear import DearSchedule
from perseus.torch.default_schedule import DefaultSchedule

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer:
    """The methods of a DistributedOptimizer, placed before the wrapped optimizer's class in the class
    :func:`DistributedOptimizer` makes. ``_schedule_type`` is the schedule each instance builds."""

    _schedule_type = DefaultSchedule

    def __init__(self, params, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set, sparse_algorithm=None, _defaults=None, _state=None):
        """Build the wrapped optimizer over ``params`` and this optimizer's schedule (the arguments are those
        of :func:`DistributedOptimizer`; ``_defaults`` and ``_state`` carry the wrapped instance's defaults,
        for optimizers with required constructor arguments, and state).

        Collective when ``groups`` is given (the ranks agree on the order of the parameters).

        Raises:
            ValueError: bad names, groups, factors, ``backward_passes_per_step`` or ``sparse_algorithm``.
            NotImplementedError: an argument the schedule does not support.
        """
        try:
            super().__init__(params)
        except TypeError:  # optimizers with required constructor arguments: reuse the wrapped defaults
            torch.optim.Optimizer.__init__(self, params, _defaults or {})
        if _state:
            self.state.update(_state)
        named = parameter_names(named_parameters, self.param_groups)
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self._parameter_names = {p: n for n, p in sorted(named, key=lambda item: item[0])}
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.sparse_algorithm = None if sparse_algorithm is None else resolve_algorithm(sparse_algorithm)
        self.process_set = process_set
        self._groups = groups
        self._schedule = self._schedule_type(self)
        self._schedule.start()

    def set_backward_passes_per_step(self, passes):
        """Accumulate ``passes`` backward passes locally before each reduction, from now on."""
        self.backward_passes_per_step = passes
        self._schedule.reset_delays(passes)

    def synchronize(self):
        """Submit any gradient not yet submitted (zeros if it was never computed) and wait for all of them.

        Collective: every rank of the process set calls it (``step()`` does).
        """
        self._schedule.synchronize()

    @contextmanager
    def skip_synchronize(self):
        """Inside this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._schedule.should_synchronize = False
        try:
            yield
        finally:
            self._schedule.should_synchronize = True

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
        return self._schedule.step(closure)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the averaged gradients by their global norm; call it after backward, before ``step()``.

        Waits for the reductions (``synchronize()``), clips every gradient with
        ``torch.nn.utils.clip_grad_norm_`` and lets the next ``step()`` skip synchronizing. Returns the total
        norm. The same call works with ``schedule="dear"`` (docs/dear.md), so scripts can switch schedules.

        Collective: every rank of the process set calls it.

        Raises:
            NotImplementedError: ``op=Adasum`` (no averaged gradients exist).
        """
        return self._schedule.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def _perseus_local_step(self, closure=None):
        """The wrapped optimizer's own step, with no communication (the schedules' updates; initialising
        state in broadcast_optimizer_state)."""
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        """The wrapped optimizer's ``zero_grad``.

        Raises:
            AssertionError: reductions are in flight (after backward, before ``step()``/``synchronize()``).
        """
        self._schedule.check_zero_grad()
        return super().zero_grad(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The wrapped optimizer's state after every update the schedule has deferred has been applied."""
        self._schedule.finish()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """Apply deferred updates, forget what is in flight, then load the wrapped optimizer's state."""
        self._schedule.finish()
        self._schedule.forget()
        return super().load_state_dict(*args, **kwargs)


class _AdasumDistributedOptimizer(_DistributedOptimizer):
    """``op=Adasum``: the wrapped optimizer runs per parameter during backward and the ranks' updates are
    combined by Adasum (:mod:`perseus.torch.adasum_optimizer`)."""

    _schedule_type = AdasumSchedule


class _DearDistributedOptimizer(_DistributedOptimizer):
    """``schedule="dear"`` (:mod:`perseus.torch.dear`, docs/dear.md), with DeAR's own methods."""

    _schedule_type = DearSchedule

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
        return self._schedule.step(closure)

    def synchronize(self):
        """Apply every pending update; then, if a backward ran since the last ``step()``, finish its
        reduction and write the averaged gradients into ``.grad`` (Horovod's meaning, for
        ``synchronize(); clip; with skip_synchronize(): step()``), after which ``step()`` is a full step.

        Call it (or :meth:`finish`) after the last ``step()`` of training, so the last update is applied.

        Collective: every rank of the process set calls it.
        """
        self._schedule.synchronize()

    def finish(self):
        """Apply every pending update (after the last ``step()``, before evaluating on only some ranks or
        saving parameters). Every rank calls it; it waits only for all-gathers every rank already started."""
        self._schedule.finish()

    def set_dear_threshold(self, threshold_bytes):
        """Regroup with groups of at most ``threshold_bytes`` at the start of the next backward (nothing is
        in flight then). Every rank must call it before the same step (the autotuner does).

        Raises:
            ValueError: ``threshold_bytes`` is negative.
        """
        self._schedule.set_threshold(threshold_bytes)

    def dear_groups(self):
        """The current groups as lists of parameter names, in forward order (empty before the first
        backward, or when this rank does not communicate)."""
        return self._schedule.group_names()

    @property
    def _dear_threshold(self):
        """The group size in force, in bytes (the autotuner starts its search from it)."""
        return self._schedule.threshold


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set,
                         sparse_algorithm=None, schedule="default"):
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of a subclass of the wrapped optimizer's class, with the same class name,
    the same parameter groups and the same state. That class may be subclassed again (``class
    Mine(type(opt))``, overrides calling ``super()``); ``Mine(params, named_parameters, ...)`` takes the
    arguments below in their order, less ``num_groups`` and ``schedule`` (the class keeps its schedule),
    with the hyper-parameters in the groups of ``params``.

    ``step(closure)`` works too (``torch.optim.LBFGS``, or any optimizer given a closure): each evaluation of
    the closure gets gradients averaged over the ranks, and the loss it returns is averaged as well, so every
    rank's optimizer makes the same decisions (L-BFGS's line search, its stopping tests) and evaluates the
    closure the same number of times; ranks that still disagree raise ``RuntimeError`` rather than hang.

    Args:
        optimizer: the torch.optim.Optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names the gradients so every rank matches them.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16`` for the wire, or a
            communicating compressor such as ``Compression.topk(0.01)`` (docs/compression.md); those keep
            per-parameter state, so give each optimizer its own instance; sparsifiers take SGD's momentum
            or Adam's moments over (docs/compression.md, "Momentum SGD and Adam").
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
    it is reduced, and ``step()`` raises ``perseus.base.exceptions.NonFiniteGradientError`` on every rank
    (naming the tensors and ranks) or skips the update on every rank (docs/troubleshooting.md).
    """
    if schedule not in ("default", "dear"):
        raise ValueError(f"DistributedOptimizer: schedule must be 'default' or 'dear', not {schedule!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    mixin = _DistributedOptimizer
    if int(op) == int(ReduceOp.ADASUM):
        if schedule == "dear":
            raise NotImplementedError("DistributedOptimizer: schedule='dear' with op=Adasum is not supported; "
                                      "use one of them")
        _guard.refuse("DistributedOptimizer(op=Adasum)")
        mixin = _AdasumDistributedOptimizer
    elif schedule == "dear":
        _guard.refuse("DistributedOptimizer(schedule='dear')")
        mixin = _DearDistributedOptimizer
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, sparse_algorithm,
               _defaults=optimizer.defaults, _state=dict(optimizer.state))
