"""Momentum correction, local clipping and Adam's frozen variance for a DistributedOptimizer whose
compressor is a sparsifier.

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

Under ``torch.optim.Adam``/``AdamW`` the compressor takes Adam's first moment over once the variance is
frozen, after a dense phase (:class:`AdamFreeze`).
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import torch

from perseus.lifecycle.api import rank
from perseus.compression import Reducer
from perseus.compression.local_step import LocalStep

__all__ = ["LocalSteps", "AdamFreeze", "ADAM_DENSE_STEPS"]

log = logging.getLogger("perseus")

#: Adam's dense steps (variance estimation) when the compressor names no warm-up
ADAM_DENSE_STEPS = 100

#: the SGD settings the compressor takes over, and the value the optimizer's own step then sees
_MOVED = (("momentum", 0.0), ("nesterov", False), ("dampening", 0.0), ("weight_decay", 0.0))


def _adam_like(opt) -> bool:
    """Adam or AdamW whose groups all use the plain algorithm (no amsgrad, no maximize)."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and not any(
        g.get("amsgrad") or g.get("maximize") for g in opt.param_groups)


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
        #: Adam's first moment is applied by the compressor once the variance is frozen (see AdamFreeze)
        self.adam = AdamFreeze(opt, compression.warmup() or ADAM_DENSE_STEPS) if (
            takes and compression.takes_momentum() and _adam_like(opt)) else None
        self.group_of = {p: i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        self.specs: dict = {}     # group index -> LocalStep in force
        self.clip_rms = 0.0       # local clipping bound per entry (0: off)
        if (self.momentum or self.adam is not None) and rank() == 0:
            log.info("perseus: %r takes %s over (docs/compression.md, 'Momentum SGD and Adam'; "
                     "momentum_correction=False turns it off)", compression,
                     "SGD's momentum" if self.momentum else
                     f"Adam's first moment after {self.adam.dense_steps} dense steps")

    def dense_now(self) -> bool:
        """Whether gradients go dense (uncompressed) this step: Adam's steps before its variance is frozen."""
        return self.adam is not None and self.adam.dense_now()

    def forget(self) -> None:
        """The optimizer's state is about to be replaced (``load_state_dict``): Adam decides again."""
        if self.adam is not None:
            self.adam.forget()

    def step(self, local_step, closure=None):
        """The wrapped optimizer's step (``local_step(closure)``) as the compressor needs it: without the
        settings it applied (SGD), or Adam's frozen-variance update."""
        if self.adam is not None:
            return self.adam.step(local_step, closure)
        with self.plain_step():
            return local_step(closure)

    def spec(self, p, grad):
        """The :class:`LocalStep` for ``p``'s gradient ``grad`` (None: nothing to do); adds the group's
        weight decay to ``grad`` in place when the compressor applies the momentum."""
        if not self.active:
            return None
        gi = self.group_of.get(p)
        if gi is None:
            return None
        group = self.opt.param_groups[gi]
        masking = self.opt._compression.momentum_masking
        if self.adam is not None and self.adam.frozen:
            return self.adam.spec(p, grad, group, bool(masking), self.clip_rms)
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
                                              masking is None or bool(masking), self.clip_rms)
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


class AdamFreeze:
    """Adam or AdamW under a sparsifier (1-bit Adam's scheme, with top-k in place of 1-bit compression).

    Adam normalises each entry by its running variance, which breaks error feedback: an entry that waited
    in the residual arrives as one burst and is normalised like one ordinary step. So the first
    ``dense_steps`` optimizer steps are ordinary Adam on dense gradients; then every rank freezes the
    variance ``v`` (identical on every rank: it was computed from the same averaged gradients) and Adam
    becomes momentum SGD with a fixed per-entry scale ``P = 1 / (sqrt(v / (1 - beta2^t)) + eps)``, which
    is linear in the gradients: each rank scales its gradient by ``P`` and the compressor applies the first
    moment locally (momentum correction with ``m = beta1``, dampening ``beta1``); the optimizer's step is
    then ``p -= lr * update`` (AdamW first decays ``p`` by ``lr * weight_decay``; Adam's L2 weight decay is
    added to the gradient before the scaling). The optimizer's own state (``exp_avg``, ``exp_avg_sq``,
    ``step``) stays as it was at the freeze, so the step count in that state tells every rank, after a
    checkpoint is loaded or an elastic job synchronises its state, whether the variance is frozen.
    """

    def __init__(self, opt, dense_steps: int):
        self.opt = opt
        self.dense_steps = int(dense_steps)
        self.frozen = False
        self.checked = False     # the optimizer's state was looked at since the last forget()
        self.scale: dict = {}    # parameter -> P (a tensor like the parameter)
        self.specs: dict = {}

    def adam_steps(self) -> int:
        """Adam's step count, from the optimizer's state (the same on every rank: it is part of what a
        checkpoint or an elastic sync restores)."""
        steps = [float(st["step"]) for st in self.opt.state.values() if "step" in st]
        return int(max(steps)) if steps else 0

    def dense_now(self) -> bool:
        """Whether gradients still go dense. The first call after construction or a state load freezes at
        once when the optimizer's state is past the dense phase (a restored checkpoint, a rank joining an
        elastic job), so every rank decides alike."""
        if not self.frozen and not self.checked:
            self.checked = True
            if self.adam_steps() >= self.dense_steps:
                self.freeze()
        return not self.frozen

    def forget(self) -> None:
        """After ``load_state_dict``: decide again from the loaded state."""
        self.frozen, self.checked = False, False
        self.scale.clear()

    def freeze(self) -> None:
        """Compute every parameter's ``P`` from the optimizer's state (the same on every rank)."""
        for group in self.opt.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                state = self.opt.state.get(p)
                if not state or "exp_avg_sq" not in state:
                    continue
                t = float(state["step"])
                v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** t)
                self.scale[p] = 1.0 / (v_hat.sqrt() + eps)
        self.frozen = True

    def spec(self, p, grad, group, masking: bool, clip_rms: float):
        """Scale ``grad`` in place (L2 weight decay first, for Adam) and return the momentum correction's
        :class:`LocalStep`; None for a parameter with no frozen variance (it goes uncorrected)."""
        scale = self.scale.get(p)
        if scale is None:
            return None
        if not isinstance(self.opt, torch.optim.AdamW) and group.get("weight_decay", 0):
            grad.add_(p.detach(), alpha=group["weight_decay"])
        grad.mul_(scale)
        beta1 = float(group["betas"][0])
        key = (beta1, masking, clip_rms)
        spec = self.specs.get(key)
        if spec is None:
            spec = self.specs[key] = LocalStep(beta1, False, beta1, masking, clip_rms, ramp=False)
        return spec

    def step(self, local_step, closure=None):
        """Adam's own step while dense (freezing the variance after the last one), then the plain update."""
        if not self.frozen:
            loss = local_step(closure)
            if self.adam_steps() >= self.dense_steps:
                self.freeze()
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decoupled = isinstance(self.opt, torch.optim.AdamW)
        with torch.no_grad():
            for group in self.opt.param_groups:
                lr, wd = group["lr"], group.get("weight_decay", 0)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p not in self.scale:  # no Adam state at the freeze: plain Adam on its gradient
                        self._adam_update(p, group, decoupled)
                        continue
                    if decoupled and wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(p.grad, alpha=-lr)
        return loss

    def _adam_update(self, p, group, decoupled: bool) -> None:
        """One ordinary Adam(W) step of ``p`` on its ``.grad`` (a parameter that had no optimizer state when
        the variance was frozen, e.g. one that started training later)."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group.get("weight_decay", 0), group["eps"]
        state = self.opt.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = float(state["step"])
        grad = p.grad
        if wd and decoupled:
            p.mul_(1.0 - lr * wd)
        elif wd:
            grad = grad + wd * p
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (state["exp_avg_sq"] / (1.0 - beta2 ** t)).sqrt_().add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1.0 - beta1 ** t))
