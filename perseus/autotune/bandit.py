"""The meta-solver: a multi-armed bandit that picks which search technique proposes the next sample.

Each technique is an arm. The bandit keeps a sliding window of the last ``window`` uses, each marked with
whether that use found a new global best. A technique's credit is the area under its curve in the window:
walking through its own uses in order, the curve steps up by one at every new best and stays flat
otherwise; the area is normalised by that of a technique that improved every time, so it lies in [0, 1].
The bandit picks ``argmax_t credit_t + C * sqrt(2 * ln|H| / H_t)`` (|H| the uses in the window, H_t those
of t): the second term favours techniques used rarely of late. A technique not used in the window yet is
picked first (in order).
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

__all__ = ["AucBandit"]


class AucBandit:
    """Sliding-window area-under-curve bandit over ``arms`` (names)."""

    def __init__(self, arms: Sequence[str], *, c: float = 0.2, window: int = 50):
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.arms = list(arms)
        self.c = float(c)
        self.history: collections.deque[tuple[str, bool]] = collections.deque(maxlen=window)

    def credit(self, arm: str) -> float:
        """The arm's area under its improvement curve in the window, in [0, 1]."""
        height, area, uses = 0, 0, 0
        for name, improved in self.history:
            if name != arm:
                continue
            uses += 1
            height += 1 if improved else 0
            area += height
        if uses == 0:
            return 0.0
        return area / (uses * (uses + 1) / 2)

    def uses(self, arm: str) -> int:
        return sum(1 for name, _ in self.history if name == arm)

    def score(self, arm: str) -> float:
        h_t = self.uses(arm)
        if h_t == 0:
            return math.inf
        total = len(self.history)
        return self.credit(arm) + self.c * math.sqrt(2.0 * math.log(total) / h_t)

    def select(self) -> str:
        """The arm to use next (ties: the earlier arm)."""
        best, best_score = self.arms[0], -math.inf
        for arm in self.arms:
            s = self.score(arm)
            if s > best_score:
                best, best_score = arm, s
        return best

    def record(self, arm: str, improved: bool) -> None:
        """Note that ``arm`` was used and whether it found a new global best."""
        if arm not in self.arms:
            raise ValueError(f"unknown arm {arm!r}; expected one of {', '.join(self.arms)}")
        self.history.append((arm, bool(improved)))
