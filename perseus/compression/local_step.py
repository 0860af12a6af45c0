"""What a rank does to its own gradient before a sparsifier compresses it: momentum correction, momentum
factor masking, local clipping (Deep Gradient Compression), and the density warm-up schedule.

Why: with top-k and error feedback, momentum applied *after* aggregation acts on a sparse, delayed signal
(a coordinate's accumulated residual arrives in bursts) and amplifies the bursts; at low density training
becomes unstable. Momentum correction moves the momentum before the compression: each rank keeps its own
velocity ``u`` and accumulates the velocity, not the gradient, into its residual ``v``::

    g  = local gradient (+ weight decay * parameter), clipped locally if asked
    u  = m * u + (1 - dampening) * g          (first step: u = g, as torch.optim.SGD does)
    v += u                                     (Nesterov: v += g + m * u)
    send top-k(v); v[sent] = 0; u[sent] = 0    (the last: momentum factor masking)

and the wrapped optimizer applies the averaged result as a plain SGD step (no momentum, no weight decay of
its own). With every entry sent (density 1) this is exactly momentum SGD on the averaged gradient, because
momentum is linear; no masking happens on such a dense step.

Masking stops a coordinate's momentum once it has been sent: the velocity that built up while the
coordinate waited in the residual has then been applied, and would otherwise push again, stale.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

__all__ = ["LocalStep", "apply_local_step", "mask_sent", "density_at", "check_warmup", "optional_spec"]


class LocalStep(NamedTuple):
    """The local work before compression, for one gradient (the same for every gradient of an optimizer's
    parameter group, and on every rank).

    Attributes:
        momentum: the momentum coefficient ``m`` (0 <= m < 1; 0: no momentum correction, clipping only).
        nesterov: Nesterov momentum (``v += g + m * u``).
        dampening: torch.optim.SGD's dampening (the gradient enters the velocity times ``1 - dampening``).
        masking: zero the velocity of the entries this rank sent (momentum factor masking).
        clip_rms: local clipping: a gradient of ``n`` entries is scaled down to norm ``clip_rms * sqrt(n)``
            when its norm is larger; 0 turns it off. The adapters derive it from the global bound the user
            clips to, so that the whole model's local gradient stays within ``max_norm / sqrt(ranks)``.
        ramp: the compressor's density warm-up applies (False: the adapter ran its warm-up already, dense,
            as for Adam).
    """

    momentum: float
    nesterov: bool = False
    dampening: float = 0.0
    masking: bool = True
    clip_rms: float = 0.0
    ramp: bool = True


def apply_local_step(st, grad: np.ndarray, residual: np.ndarray, spec: LocalStep) -> None:
    """Clip ``grad`` (flat float32, modified in place), update the velocity kept in ``st.extra`` and add what
    the rank owes this step to ``residual``. ``st`` is the key's :class:`perseus.compression.base.KeyState`."""
    if spec.clip_rms > 0.0:
        bound = spec.clip_rms * math.sqrt(grad.size)
        norm = float(np.linalg.norm(grad))
        if norm > bound:
            grad *= np.float32(bound / norm)
    ex = st.extra
    if not spec.momentum:  # local clipping only
        residual += grad
        return
    u = ex.get("velocity")
    m = np.float32(spec.momentum)
    if u is None or u.size != grad.size:
        u = ex["velocity"] = grad.copy()
    else:
        u *= m
        if spec.dampening:
            u += grad * np.float32(1.0 - spec.dampening)
        else:
            u += grad
    ex["masking"] = spec.masking
    if spec.nesterov:
        residual += grad
        tmp = ex.get("nesterov_tmp")
        if tmp is None or tmp.size != grad.size:
            tmp = ex["nesterov_tmp"] = np.empty_like(grad)
        np.multiply(u, m, out=tmp)
        residual += tmp
    else:
        residual += u


def mask_sent(st, idx: np.ndarray) -> None:
    """Momentum factor masking: zero the velocity at the entries ``idx`` this rank just sent (when the key's
    local step asked for it)."""
    u = st.extra.get("velocity")
    if u is not None and st.extra.get("masking"):
        u[idx] = 0.0


def check_warmup(warmup_steps, warmup_start, what: str) -> tuple:
    """Validated ``(warmup_steps, warmup_start)``.

    Raises:
        ValueError: a negative or non-integer step count, or a start density outside (0, 1].
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < 0:
        raise ValueError(f"perseus: {what}(warmup_steps=): a non-negative int, got {warmup_steps!r}")
    start = float(warmup_start)
    if not 0.0 < start <= 1.0:
        raise ValueError(f"perseus: {what}(warmup_start=): a density in (0, 1], got {warmup_start!r}")
    return int(warmup_steps), start


def density_at(density: float, step: int, warmup_steps: int, warmup_start: float) -> float:
    """The density in force at ``step`` (0 for a key's first reduction): ``warmup_start`` at step 0, falling
    exponentially to ``density`` at ``warmup_steps``, then ``density``. It depends only on the key's step
    count, which is the same on every rank (every rank reduces every key once per step)."""
    if step >= warmup_steps or warmup_start <= density:
        return density
    return warmup_start * (density / warmup_start) ** (step / warmup_steps)


def optional_spec(spec: Optional[LocalStep]) -> Optional[LocalStep]:
    """``spec`` when it asks for anything (momentum correction or local clipping), else None.

    Raises:
        ValueError: a momentum outside [0, 1) or a negative clipping bound.
    """
    if spec is None or not spec.momentum and not spec.clip_rms:
        return None
    if spec.clip_rms < 0:
        raise ValueError(f"perseus: local clipping needs a non-negative bound, got {spec.clip_rms}")
    if not 0.0 <= spec.momentum < 1.0:
        raise ValueError(f"perseus: momentum correction needs a momentum in (0, 1), got {spec.momentum}")
    return spec
