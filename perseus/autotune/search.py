"""The search loop without the job: the bandit picks a technique, the technique a configuration; every
measured cost goes to every technique, and the bandit credits the technique whose sample was a new best.

Kept free of MPI and of the engine so that it can be tested with made-up cost functions; the tuner
(:mod:`perseus.autotune.tuner`) feeds it measured step times on rank 0.
"""

from __future__ import annotations

import statistics
from typing import Optional

from perseus.autotune.bandit import AucBandit
from perseus.autotune.space import Config, Space
from perseus.autotune.techniques import Technique, make_techniques

__all__ = ["Search"]


class Search:
    """Meta-solver state: techniques, bandit, and every cost measured per configuration."""

    def __init__(self, space: Space, *, seed: int = 0, c: float = 0.2, window: int = 50,
                 techniques: Optional[list[Technique]] = None, start: Optional[Config] = None):
        self.space = space
        self.techniques = {t.name: t for t in (techniques or make_techniques(space, seed))}
        self.bandit = AucBandit(list(self.techniques), c=c, window=window)
        self.costs: dict[Config, list[float]] = {}
        self.start = space.nearest(start) if start is not None else None
        self.samples = 0

    def next(self) -> tuple[str, Config]:
        """(technique, configuration) for the next sample; the first sample measures ``start`` if given."""
        if self.samples == 0 and self.start is not None:
            return "start", self.start
        name = self.bandit.select()
        return name, self.techniques[name].ask()

    def cost(self, config: Config) -> float:
        """The configuration's median measured cost (inf when unmeasured)."""
        costs = self.costs.get(config)
        return statistics.median(costs) if costs else float("inf")

    def best(self) -> tuple[Optional[Config], float]:
        if not self.costs:
            return None, float("inf")
        config = min(self.costs, key=self.cost)
        return config, self.cost(config)

    def observe(self, technique: str, config: Config, cost: float) -> bool:
        """Record a sample; returns whether it is a new global best."""
        _, best_before = self.best()
        self.costs.setdefault(config, []).append(float(cost))
        self.samples += 1
        improved = cost < best_before
        for name, t in self.techniques.items():
            t.tell(config, cost, own=(name == technique))
        if technique in self.techniques:
            self.bandit.record(technique, improved)
        return improved

    def finalists(self, k: int = 2) -> list[Config]:
        """The k configurations with the lowest median cost (to measure again before choosing)."""
        return sorted(self.costs, key=self.cost)[:k]
