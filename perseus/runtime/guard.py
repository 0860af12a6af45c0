"""The non-finite gradient guard (PERSEUS_NONFINITE_GRADIENTS): stop NaN and Inf before they reach every rank.

A gradient with NaN or Inf on one rank becomes NaN on every rank once summed, and the model is lost everywhere.
With the guard on, a DistributedOptimizer checks each gradient on its own rank as it submits it (one pass
over the gradient), and at the end of the step's reduction every rank of the process set learns, through one
small all-reduce, whether any rank saw one; if so, the ranks exchange the names (an allgather, only then)
and every rank at the same step either raises :class:`~perseus.base.exceptions.NonFiniteGradientError`
naming the tensors and the ranks (``raise``), or skips the optimizer step (``skip``: the parameters and the
optimizer's state stay as they were; rank 0 logs a warning naming them). ``off`` (the default) costs
nothing.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from perseus.base.exceptions import NonFiniteGradientError
from perseus.base.knobs import read_knob
from perseus.runtime import collectives as c
from perseus.runtime.objects import allgather_object
from perseus.runtime.state import runtime

__all__ = ["Guard", "MODES", "mode", "for_optimizer", "refuse"]

log = logging.getLogger("perseus")

MODES = ("off", "raise", "skip")
_MAX, _INT64, _ALLREDUCE = 4, 4, 0


def mode() -> str:
    """The guard's mode from PERSEUS_NONFINITE_GRADIENTS ('off', 'raise' or 'skip')."""
    return str(read_knob("nonfinite_gradients")[0]).lower()


def refuse(what: str) -> None:
    """Raise NotImplementedError when the guard is on: ``what`` does not check its gradients."""
    if mode() != "off":
        raise NotImplementedError(f"PERSEUS_NONFINITE_GRADIENTS={mode()} is not supported by {what} yet; the guard "
                                  "covers perseus.torch.DistributedOptimizer (schedule='default', op Average or "
                                  "Sum); unset it")


def for_optimizer(process_set) -> Optional["Guard"]:
    """A Guard for one optimizer when the guard is on, else None."""
    m = mode()
    return None if m == "off" else Guard(process_set, m)


class Guard:
    """One optimizer's guard: the names of this step's non-finite gradients on this rank, and the verdict."""

    def __init__(self, process_set, how: str):
        if how not in MODES[1:]:
            raise ValueError(f"PERSEUS_NONFINITE_GRADIENTS must be one of {', '.join(MODES)}, not {how!r}")
        self.process_set = process_set
        self.mode = how
        self.bad: list[str] = []
        self.steps = 0
        self.skipped = 0
        self._flag = np.zeros(1, np.int64)

    def note(self, name: str, finite: bool) -> None:
        """Record the check of gradient ``name`` on this rank (local; no communication)."""
        if not finite:
            self.bad.append(name)

    def verdict(self) -> bool:
        """Collective over the process set, once per step, after the step's gradients were submitted: True
        when every rank's gradients were finite. Otherwise raises NonFiniteGradientError (mode 'raise') or
        returns False (mode 'skip': the caller skips the step), on every rank alike."""
        step = self.steps
        self.steps += 1
        self._flag[0] = 1 if self.bad else 0
        mine, self.bad = self.bad, []
        c.synchronize(c.allreduce_async(self._flag, self._flag, name=f"perseus.guard.{step}", op=_MAX,
                                        process_set=self.process_set))
        if self._flag[0] == 0:
            return True
        everyone = allgather_object(mine, name=f"perseus.guard.names.{step}", process_set=self.process_set)
        ranks = [r for r, names in enumerate(everyone) if names]
        where = "; ".join(f"rank {r}: {', '.join(sorted(set(names))[:8])}"
                          + (f" and {len(set(names)) - 8} more" if len(set(names)) > 8 else "")
                          for r, names in enumerate(everyone) if names)
        message = (f"perseus: NaN or Inf in gradients before they were reduced, at optimizer step {step} "
                   f"(rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of the process set) - {where}")
        if self.mode == "raise":
            raise NonFiniteGradientError(message + ". Find what produced them (a learning rate too high, a "
                                         "log of zero, bad input data) or set PERSEUS_NONFINITE_GRADIENTS=skip "
                                         "to skip such steps.")
        self.skipped += 1
        if _rank_in(self.process_set) == 0:
            log.warning("%s; the step is skipped on every rank (%d skipped so far)", message, self.skipped)
        return False


def _rank_in(process_set) -> int:
    _, _, rank = runtime().process_set_info(process_set)
    return rank
