"""Momentum correction for the MXNet DistributedOptimizer and DistributedTrainer: SGD's momentum moves into a
sparsifying compressor.

When the optimizer is ``mx.optimizer.SGD`` (``'sgd'``) or ``mx.optimizer.NAG`` (``'nag'``, Nesterov) with a
momentum ``0 < m < 1`` and their own update rule, and the compressor takes the momentum
(:meth:`perseus.compression.Reducer.takes_momentum`: ``Compression.topk``, ``randomk``, ``hitopk`` or
``cupcake`` of one of them, with error feedback and ``momentum_correction=True``, the default), each rank turns
its gradient into what MXNet's momentum would accumulate and applies the momentum to it before compressing
(perseus/compression/local_step.py)::

    g = clip(rescale_grad * grad, clip_gradient) + wd * weight        (what SGD's momentum adds, per rank)

and the averaged result, an *update*, is applied by the optimizer's own step with ``momentum``, ``wd``,
``clip_gradient`` set to 0/None and ``rescale_grad`` to 1 for the duration of the update only: the attributes
keep the user's values otherwise (schedulers and ``trainer.set_learning_rate`` keep working).

Differences from dense momentum SGD: ``clip_gradient`` clips each rank's gradient before the averaging (local
clipping) instead of the averaged gradient; the optimizer's momentum states are unused (a DistributedTrainer
creates none); the velocities live in the compressor, next to its residuals, and are not in saved trainer
states. With every entry sent (``Compression.topk(1.0)``) and no clipping, training equals dense momentum SGD,
and NAG without weight decay (MXNet's ``nag_mom_update`` decays its momentum state with the weight it has just
updated; the corrected NAG adds ``wd * weight`` of the weight before the step, as SGD does).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import mxnet as mx

from perseus.compression import Reducer
from perseus.compression.local_step import LocalStep

__all__ = ["MomentumMover"]

#: the optimizer attributes the compressor takes over, and the value the optimizer's own update then sees
_MOVED = (("momentum", 0.0), ("wd", 0.0), ("rescale_grad", 1.0), ("clip_gradient", None))
#: the methods whose resolution must be SGD's (NAG's) for the optimizer to follow its update rule
_RULE = ("update", "update_multi_precision", "_update_impl")


def _sgd_base(opt):
    """``mx.optimizer.SGD`` or ``mx.optimizer.NAG`` when ``opt`` is one (or a subclass keeping its update
    rule), else None."""
    for base in (mx.optimizer.NAG, mx.optimizer.SGD):
        if isinstance(opt, base):
            same = all(getattr(type(opt), name, None) is getattr(base, name, None) for name in _RULE)
            return base if same else None
    return None


def _masking(compression) -> bool:
    """Whether the compressor that runs the local step masks the momentum (``cupcake``'s inner one works)."""
    inner = getattr(compression, "inner", None)
    masking = getattr(inner if isinstance(inner, Reducer) else compression, "momentum_masking", None)
    return True if masking is None else bool(masking)  # None: the default for SGD, on


class MomentumMover:
    """Moves an MXNet SGD/NAG optimizer's momentum into ``compression`` (see the module docstring)."""

    def __init__(self, compression):
        self.compression = compression

    def spec(self, opt) -> Optional[LocalStep]:
        """The :class:`LocalStep` the compressor applies for optimizer ``opt`` now, or None (the optimizer
        applies its own momentum to the averaged gradients)."""
        comp = self.compression
        if not isinstance(comp, Reducer) or not comp.takes_momentum():
            return None
        base = _sgd_base(opt)
        momentum = getattr(opt, "momentum", 0.0)
        if base is None or isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            return None
        if not 0.0 < float(momentum) < 1.0:
            return None
        return LocalStep(float(momentum), base is mx.optimizer.NAG, masking=_masking(comp))

    @staticmethod
    def prepare(opt, indices, weights, grads) -> None:
        """Turn each gradient (NDArrays, in place) into what the optimizer's momentum would accumulate:
        ``clip(rescale_grad * grad, clip_gradient) + wd * weight``, with the weight decay of each index."""
        rescale = float(opt.rescale_grad)
        clip = opt.clip_gradient
        wds = opt._get_wds(list(indices))
        for weight, grad, wd in zip(weights, grads, wds):
            if rescale != 1.0:
                grad *= rescale
            if clip and clip > 0:
                mx.nd.clip(grad, -float(clip), float(clip), out=grad)
            if wd:
                grad += float(wd) * weight.astype(grad.dtype, copy=False)

    @staticmethod
    @contextmanager
    def plain(opt):
        """Run ``opt``'s update without momentum, weight decay, rescaling and clipping (restored after, also
        when the update raises)."""
        saved = {name: getattr(opt, name) for name, _ in _MOVED}
        for name, value in _MOVED:
            setattr(opt, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(opt, name, value)
