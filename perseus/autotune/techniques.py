"""The search techniques the bandit chooses among: grid search, Bayesian optimisation (Optuna TPE),
Hyperband (Optuna's pruner over random configurations) and population-based training (here: Optuna has none).

Every technique proposes a :class:`~perseus.autotune.space.Config` (``ask``) and learns the measured cost
of every sample, its own and the others' (``tell``; lower is better: seconds per step). Only rank 0 runs
them; the configuration it picks reaches the other ranks by broadcast.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

from perseus.autotune.space import Config, Space

__all__ = ["Technique", "GridSearch", "Bayesian", "Hyperband", "PopulationBased", "make_techniques"]


def _optuna():
    try:
        import optuna
    except ImportError as exc:
        raise ImportError("perseus's autotuner needs Optuna: pip install optuna (or perseus[tune]); or run "
                          "without HOROVOD_AUTOTUNE/PERSEUS_AUTOTUNE") from exc
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


class Technique:
    """A search technique: ``ask`` proposes, ``tell`` learns (own=True for the config it proposed last)."""

    name = "technique"

    def ask(self) -> Config:
        raise NotImplementedError

    def tell(self, config: Config, cost: float, own: bool) -> None:
        raise NotImplementedError


class _OptunaTechnique(Technique):
    """Shared plumbing: one Optuna study over the space's categorical parameters (the compressor policy among
    them when it is searched)."""

    def __init__(self, space: Space, sampler, pruner=None, seed: int = 0):
        optuna = _optuna()
        self._optuna = optuna
        self.space = space
        self.names = space.searched()
        # A fixed study name: Optuna's Hyperband pruner assigns trials to brackets by a hash of the study's name,
        # so an automatic (random) one would make the same seed search differently from run to run.
        self.study = optuna.create_study(direction="minimize", sampler=sampler, pruner=pruner,
                                         study_name=f"perseus-{self.name}-{seed}")
        self.dists = {n: optuna.distributions.CategoricalDistribution(list(space.choices(n))) for n in self.names}
        self.trial = None

    def _suggest(self) -> Config:
        self.trial = self.study.ask(self.dists)
        return self.space.make(**{n: self.trial.params[n] for n in self.names})

    def ask(self) -> Config:
        return self._suggest()

    def tell(self, config: Config, cost: float, own: bool) -> None:
        if own and self.trial is not None:
            self.study.tell(self.trial, cost)
            self.trial = None
        elif self.space.contains(config):
            self.study.add_trial(self._optuna.trial.create_trial(
                params={n: getattr(config, n) for n in self.names}, distributions=self.dists, value=cost))


class GridSearch(Technique):
    """Every point of the space once, in a seeded shuffled order (points already measured are skipped)."""

    name = "grid"

    def __init__(self, space: Space, seed: int = 0):
        self.points = space.grid(seed)
        self.seen: set[Config] = set()
        self.i = 0

    def ask(self) -> Config:
        while self.i < len(self.points) and self.points[self.i] in self.seen:
            self.i += 1
        if self.i >= len(self.points):  # exhausted: start over (the bandit will have moved on by then)
            self.i = 0
        return self.points[self.i]

    def tell(self, config: Config, cost: float, own: bool) -> None:
        self.seen.add(config)


class Bayesian(_OptunaTechnique):
    """Optuna's TPE sampler: models good and bad regions from every measured sample."""

    name = "bayesian"

    def __init__(self, space: Space, seed: int = 0, startup: int = 4):
        optuna = _optuna()
        super().__init__(space, optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True),
                         seed=seed)


class Hyperband(_OptunaTechnique):
    """Random configurations under Optuna's Hyperband pruner: a configuration gets up to ``max_samples``
    samples, and those that measure worse than others at the same point are dropped early."""

    name = "hyperband"

    def __init__(self, space: Space, seed: int = 0, max_samples: int = 3):
        optuna = _optuna()
        super().__init__(space, optuna.samplers.RandomSampler(seed=seed),
                         optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_samples,
                                                        reduction_factor=3), seed=seed)
        self.max_samples = max_samples
        self.current: Optional[Config] = None
        self.reports = 0
        self.best_cost = float("inf")

    def ask(self) -> Config:
        if self.trial is None:
            self.current = self._suggest()
            self.reports = 0
            self.best_cost = float("inf")
        return self.current

    def tell(self, config: Config, cost: float, own: bool) -> None:
        if not own or self.trial is None or config != self.current:
            return  # Hyperband allocates samples to its own configurations only
        self.reports += 1
        self.best_cost = min(self.best_cost, cost)
        self.trial.report(cost, step=self.reports)
        if self.trial.should_prune():
            self.study.tell(self.trial, state=self._optuna.trial.TrialState.PRUNED)
            self.trial = None
        elif self.reports >= self.max_samples:
            self.study.tell(self.trial, self.best_cost)
            self.trial = None


class PopulationBased(Technique):
    """Population-based training over configurations: a population of members; each turn one member is
    either replaced by a copy of the best member (when it is in the worst quarter) or kept, then perturbed:
    usually one parameter moves one step, sometimes (``resample``) one parameter takes any of its values,
    so that the population can leave a region that one-step moves would take many samples to cross. The
    compressor policy, when searched, is one parameter like the others (its step: the next policy in
    COMPRESSION_POLICIES)."""

    name = "pbt"

    def __init__(self, space: Space, seed: int = 0, population: int = 4, resample: float = 0.3):
        self.space = space
        self.resample = resample
        self.rng = random.Random(seed)
        self.population: list[tuple[Config, float]] = []  # (config, cost)
        self.size = population
        self.turn = 0
        self.pending: Optional[tuple[int, Config]] = None

    def ask(self) -> Config:
        if len(self.population) < self.size:
            config = self.space.random(self.rng)
            self.pending = (-1, config)
            return config
        i = self.turn % len(self.population)
        self.turn += 1
        ranked = sorted(range(len(self.population)), key=lambda k: self.population[k][1])
        base = self.population[i][0]
        if i in ranked[-max(1, len(ranked) // 4):]:
            base = self.population[ranked[0]][0]  # exploit: copy the best
        if self.rng.random() < self.resample:  # explore far: one parameter, any value
            names = self.space.searched()
            name = self.rng.choice([n for n in names if len(self.space.choices(n)) > 1] or list(names))
            config = dataclasses.replace(base, **{name: self.rng.choice(self.space.choices(name))})
        else:  # explore near: one parameter, one step
            config = self.rng.choice(list(self.space.neighbours(base)) or [base])
        self.pending = (i, config)
        return config

    def tell(self, config: Config, cost: float, own: bool) -> None:
        if own and self.pending is not None and self.pending[1] == config:
            i, _ = self.pending
            self.pending = None
            if i < 0:
                self.population.append((config, cost))
            elif cost <= self.population[i][1] or self.rng.random() < 0.25:
                self.population[i] = (config, cost)
            return
        # Another technique's sample: it joins the population if it beats the worst member.
        if len(self.population) < self.size:
            self.population.append((config, cost))
            return
        worst = max(range(len(self.population)), key=lambda k: self.population[k][1])
        if cost < self.population[worst][1]:
            self.population[worst] = (config, cost)


def make_techniques(space: Space, seed: int = 0) -> list[Technique]:
    """The four techniques of the ensemble, in the bandit's tie-break order."""
    return [GridSearch(space, seed), Bayesian(space, seed), Hyperband(space, seed), PopulationBased(space, seed)]
