"""What the schedules of :func:`perseus.torch.DistributedOptimizer` share.

A schedule decides when gradients are reduced and when the wrapped optimizer runs: the default one
(:mod:`perseus.torch.default_schedule`), Adasum's (:mod:`perseus.torch.adasum_optimizer`) and DeAR's
(:mod:`perseus.torch.dear`). The optimizer picks one when it is built and forwards ``step()``,
``synchronize()``, ``zero_grad()``, ``state_dict()`` and ``load_state_dict()`` to it. Every reduction a
schedule starts is held as a :class:`PendingReduction` until it is waited for.
"""

from __future__ import annotations

import torch

from perseus.base.reduce_ops import Average, reject_adasum

__all__ = ["PendingReduction", "Schedule", "check_op", "parameter_names", "TOO_MANY_PASSES", "ZERO_GRAD_RACE"]

#: raised by a gradient hook when a parameter's gradient arrives once more than backward_passes_per_step allows
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")
#: raised by zero_grad() while reductions are in flight
ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                  "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


class PendingReduction:
    """A reduction a schedule has started and not yet finished.

    :meth:`wait` blocks until the reduction has completed, puts its result where the schedule wants it (the
    gradients, the parameters, a buffer) and returns what it produced. The work runs once: a later call
    returns the same result, or raises the same error again.
    """

    __slots__ = ("_finish", "_args", "_result", "_error")

    def __init__(self, finish, *args):
        """``finish(*args)`` waits for the reduction and stores its result; it runs on the first :meth:`wait`."""
        self._finish = finish
        self._args = args
        self._result = self._error = None

    def wait(self):
        """The reduction's result (what ``finish`` returned), after waiting for it on the first call.

        Raises:
            HorovodInternalError: the collective failed (the same error on every later call).
        """
        finish = self._finish
        if finish is None:
            if self._error is not None:
                raise self._error
            return self._result
        self._finish = None
        try:
            self._result = finish(*self._args)
        except BaseException as exc:
            self._error = exc
            raise
        return self._result


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


def check_op(opt) -> None:
    """For the schedules that reduce gradients: raise ValueError for ``op=Adasum`` (its own schedule) or a
    ``gradient_predivide_factor`` with an op other than Average."""
    reject_adasum(opt.op, "torch.DistributedOptimizer")
    if opt.gradient_predivide_factor != 1.0 and opt.op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


class Schedule:
    """The base of the schedules: what is in flight and how many backward passes each gradient waits for.

    ``opt`` is the optimizer (an instance of the class :func:`perseus.torch.DistributedOptimizer` builds); it
    holds the configuration (``_parameter_names``, ``_compression``, ``op``, ``process_set``,
    ``backward_passes_per_step`` ...) and the schedule reads it from there, so a change the user makes to
    those attributes takes effect. Subclasses implement :meth:`start`, :meth:`step` and :meth:`synchronize`.
    """

    def __init__(self, opt):
        self.opt = opt
        #: reductions started and not yet waited for: parameter (or tuple of parameters) -> PendingReduction
        self.pending: dict = {}
        #: backward passes each parameter still accumulates locally before its gradient is reduced
        self.delay = {p: opt.backward_passes_per_step for g in opt.param_groups for p in g["params"]}
        #: the parameters whose gradients this schedule reduces (those it hooked)
        self.requires_update: set = set()
        self.hooks: list = []              # the hooks' removable handles
        self.synchronized = False          # synchronize() ran since the last step()
        self.should_synchronize = True     # False inside optimizer.skip_synchronize()

    # -- what every schedule implements ------------------------------------------------------------------
    def start(self) -> None:
        """Register the hooks when this rank communicates (called once, at the end of construction)."""
        raise NotImplementedError

    def step(self, closure=None):
        """``optimizer.step(closure)``. Collective."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """``optimizer.synchronize()``. Collective."""
        raise NotImplementedError

    # -- shared behaviour, overridden where a schedule differs --------------------------------------------
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients in ``.grad`` by their global norm (``torch.nn.utils.clip_grad_norm_``), as they
        are; the schedules that reduce first override it."""
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def scales(self):
        """``(prescale, postscale)`` of gradient reductions: the predivide factor around the sum (for
        Average the engine divides by the set size on top of postscale)."""
        opt = self.opt
        if opt.op == Average:
            return 1.0 / opt.gradient_predivide_factor, opt.gradient_predivide_factor
        return 1.0, 1.0

    def check_zero_grad(self) -> None:
        """Raise AssertionError when zero_grad() would race with reductions in flight."""
        if self.pending:
            raise AssertionError(ZERO_GRAD_RACE)

    def finish(self) -> None:
        """Apply any update the schedule has deferred (only DeAR defers). Every rank calls it."""

    def forget(self) -> None:
        """Drop what is in flight and start counting backward passes anew (before ``load_state_dict``)."""
        self.pending.clear()
        self.synchronized = False
        self.should_synchronize = True
        self.reset_delays(self.opt.backward_passes_per_step)

    def reset_delays(self, passes) -> None:
        """Every parameter accumulates ``passes`` backward passes before its next reduction."""
        delay = self.delay
        for p in delay:
            delay[p] = passes
