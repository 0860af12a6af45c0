"""Momentum correction and local clipping for a DistributedOptimizer whose compressor is a sparsifier.

When the wrapped optimizer is ``torch.optim.SGD`` with momentum and the compressor takes it
(``Compression.topk``, ``randomk``, ``hitopk``, or ``cupcake`` of one of them, with error feedback and
``momentum_correction=True``, the default), the momentum moves into the compressor: each rank applies it to
its own gradient before compressing (perseus/compression/local_step.py), and the optimizer's own step runs
with ``momentum``, ``nesterov``, ``dampening`` and ``weight_decay`` set to 0 for the duration of
``step()`` only (weight decay is added to the gradient before the momentum, where SGD applies it). The
parameter groups keep the user's values: schedulers that change momentum keep working.

``optimizer.clip_grad_norm_(max_norm)`` then clips each rank's gradients locally, before they are
accumulated: every gradient of ``n`` entries to at most ``max_norm * sqrt(n / (N * total))`` (``total``
entries in all, ``N`` ranks), so the whole local gradient stays within ``max_norm / sqrt(N)``, the bound of
Deep Gradient Compression. The first call cannot reach the gradients already sent and clips the averaged
result of that step instead.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from perseus.compression import Reducer
from perseus.compression.local_step import LocalStep

__all__ = ["LocalSteps"]

#: the SGD settings the compressor takes over, and the value the optimizer's own step then sees
_MOVED = (("momentum", 0.0), ("nesterov", False), ("dampening", 0.0), ("weight_decay", 0.0))


class LocalSteps:
    """What an optimizer's compressor does on each rank before compressing, per parameter group."""

    def __init__(self, opt):
        self.opt = opt
        compression = opt._compression
        takes = isinstance(compression, Reducer) and compression.takes_local_step()
        #: the compressor takes local steps at all (momentum correction, local clipping)
        self.active = takes
        #: SGD's momentum is applied by the compressor
        self.momentum = takes and compression.takes_momentum() and isinstance(opt, torch.optim.SGD)
        self.group_of = {p: i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        self.specs: dict = {}     # group index -> LocalStep in force
        self.clip_rms = 0.0       # local clipping bound per entry (0: off)

    def moves_momentum(self) -> bool:
        """Whether any parameter group's momentum is applied by the compressor now."""
        return self.momentum and any(g.get("momentum", 0) for g in self.opt.param_groups)

    def spec(self, p, grad):
        """The :class:`LocalStep` for ``p``'s gradient ``grad`` (None: nothing to do); adds the group's
        weight decay to ``grad`` in place when the compressor applies the momentum."""
        if not self.active:
            return None
        gi = self.group_of.get(p)
        if gi is None:
            return None
        group = self.opt.param_groups[gi]
        m = float(group.get("momentum", 0.0)) if self.momentum else 0.0
        if not m and not self.clip_rms:
            return None
        if m and group.get("weight_decay", 0):
            grad.add_(p.detach(), alpha=group["weight_decay"])
        spec = self.specs.get(gi)
        if spec is None or spec.momentum != m or spec.nesterov != bool(group.get("nesterov", False)) \
                or spec.dampening != float(group.get("dampening", 0.0)) or spec.clip_rms != self.clip_rms:
            spec = self.specs[gi] = LocalStep(m, bool(group.get("nesterov", False)),
                                              float(group.get("dampening", 0.0)),
                                              self.opt._compression.momentum_masking, self.clip_rms)
        return spec

    @contextmanager
    def plain_step(self):
        """Run the wrapped optimizer's step without the settings the compressor applied (restored after)."""
        saved = []
        if self.momentum:
            for group in self.opt.param_groups:
                if group.get("momentum", 0):
                    saved.append((group, {k: group.get(k) for k, _ in _MOVED}))
                    for k, plain in _MOVED:
                        if k in group:
                            group[k] = plain
        try:
            yield
        finally:
            for group, values in saved:
                for k, v in values.items():
                    if v is not None:
                        group[k] = v

    def clip_locally(self, max_norm: float, set_size: int, entries: int) -> bool:
        """Clip locally from the next gradients on (see the module docstring); False when the compressor
        takes no local step (the caller then clips the averaged gradients)."""
        if not self.active:
            return False
        first = self.clip_rms == 0.0
        self.clip_rms = float(max_norm) / math.sqrt(max(1, set_size) * max(1, entries))
        return not first
