"""What the run-time tuner searches: the engine parameters a TUNE request sets, each with its candidate values.

A :class:`Config` is one point: fusion (all-reduce unit) size, in-place threshold, active channels, cycle time
and all-reduce algorithm, the policy of the job's Espresso compressor, and the algorithm of the job's sparse
all-reduces ('auto' calls). :class:`Space` lists the candidate
values per parameter; a parameter the user set explicitly has one candidate (its value), so the tuner never
overrides an explicit choice.

The compressor policy (:data:`POLICY`) is a dimension only when an Espresso compressor takes part
(:mod:`perseus.runtime.step_policy`); otherwise it has the one candidate 0 and is searched by no technique, so a
job without one is tuned exactly as before. Likewise the sparse algorithm (:data:`SPARSE`): a dimension only
when the job reduces sparse tensors with ``algorithm='auto'`` (:mod:`perseus.sparse.choice`), and DeAR's
fusion-group size (:data:`DEAR`): only when a ``DistributedOptimizer(schedule='dear')`` takes part, and the
budget of the device buckets (:data:`DEVICE`) and the GPU path itself (:data:`PATH`: the launcher, or host
staging): only when the job's all-reduces go through the GPU launcher.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Iterator, Sequence

from perseus.sparse.choice import CHOICES

__all__ = ["ALGORITHMS", "COMPRESSION_POLICIES", "SPARSE_ALGORITHMS", "DEAR_THRESHOLDS", "Config", "Space",
           "DEVICE_BUCKETS", "DEVICE_PATHS", "PARAMS", "POLICY", "SPARSE", "DEAR", "DEVICE", "PATH",
           "OPTIONAL_PARAMS", "STEP_PARAMS", "ALL_PARAMS"]

# Codes as in the engine (native/common.h Algorithm) and PERSEUS_ALLREDUCE_ALGORITHM.
ALGORITHMS = ("auto", "mpi", "ring", "hierarchical")
#: Espresso's policies (perseus.compression.espresso.POLICIES, same order): Config.compression_policy indexes it
COMPRESSION_POLICIES = ("espresso", "dense", "all-compressed")
#: the engine parameters, in the order of a TUNE request
PARAMS = ("fusion_threshold_bytes", "inplace_threshold_bytes", "channels", "cycle_time_us", "algorithm")
#: the compressor's policy: not an engine parameter; applied by the compressor at a step boundary
POLICY = "compression_policy"
#: what every 'auto' sparse all-reduce runs ('auto': the per-tensor cost model; perseus.sparse.choice)
SPARSE_ALGORITHMS = CHOICES
#: the sparse algorithm: not an engine parameter either; applied by the sparse path at a step boundary
SPARSE = "sparse_algorithm"
#: DeAR's fusion-group sizes in bytes (Config.dear_threshold indexes it)
DEAR_THRESHOLDS = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
#: DeAR's group size: applied by the DeAR optimizer at a step boundary
DEAR = "dear_threshold"
#: the device buckets' budgets in bytes (Config.device_bucket indexes it; native/device_buckets.h)
DEVICE_BUCKETS = (4 << 20, 16 << 20, 25 << 20, 64 << 20, 256 << 20)
#: the device buckets' budget: carried by the TUNE request (its sixth value) when searched
DEVICE = "device_bucket"
#: how a DistributedOptimizer's gradients on a device move (Config.device_path indexes it): the launcher (NCCL;
#: Gloo for CPU tensors with PERSEUS_DEVICE_BACKEND=gloo), or host memory (staging; CPU tensors: the engine's
#: own channels)
DEVICE_PATHS = ("launcher", "host")
#: the GPU path: applied by the optimizer at a step boundary
PATH = "device_path"
#: the dimensions applied at step boundaries, not through the TUNE request
STEP_PARAMS = (POLICY, SPARSE, DEAR, PATH)
#: the dimensions searched only when what they tune takes part (else they keep one value, unused)
OPTIONAL_PARAMS = STEP_PARAMS + (DEVICE,)
ALL_PARAMS = PARAMS + OPTIONAL_PARAMS

_KB, _MB = 1 << 10, 1 << 20
FUSION_CHOICES = (256 * _KB, 1 * _MB, 2 * _MB, 4 * _MB, 8 * _MB, 16 * _MB, 32 * _MB, 64 * _MB)
INPLACE_CHOICES = (64 * _KB, 256 * _KB, 1 * _MB, 4 * _MB)
CHANNEL_CHOICES = (1, 2, 4, 8, 16)
CYCLE_CHOICES_US = (0, 250, 1000)


@dataclasses.dataclass(frozen=True, order=True)
class Config:
    """One setting of the tuned parameters (the values a TUNE request carries)."""

    fusion_threshold_bytes: int
    inplace_threshold_bytes: int
    channels: int
    cycle_time_us: int
    algorithm: int  # index into ALGORITHMS
    #: index into COMPRESSION_POLICIES; 0 ('espresso', Espresso's default) when no compressor takes part, and
    #: for a setting remembered before the field existed
    compression_policy: int = 0
    #: index into SPARSE_ALGORITHMS; 0 ('auto') when the job has no sparse 'auto' tensors
    sparse_algorithm: int = 0
    #: index into DEAR_THRESHOLDS; 0 (and meaningless) when no DeAR optimizer takes part
    dear_threshold: int = 0
    #: index into DEVICE_BUCKETS; 0 (and meaningless) when the device launcher takes no part
    device_bucket: int = 0
    #: index into DEVICE_PATHS; 0 when the device launcher takes no part
    device_path: int = 0

    def values(self) -> tuple[int, int, int, int, int]:
        """The engine parameters (what a TUNE request carries)."""
        return (self.fusion_threshold_bytes, self.inplace_threshold_bytes, self.channels, self.cycle_time_us,
                self.algorithm)

    def all_values(self) -> tuple[int, ...]:
        """The engine parameters, then the optional ones (OPTIONAL_PARAMS order)."""
        return self.values() + tuple(getattr(self, n) for n in OPTIONAL_PARAMS)

    @property
    def policy_name(self) -> str:
        return COMPRESSION_POLICIES[self.compression_policy]

    @property
    def sparse_name(self) -> str:
        return SPARSE_ALGORITHMS[self.sparse_algorithm]

    @property
    def dear_bytes(self) -> int:
        return DEAR_THRESHOLDS[self.dear_threshold]

    @property
    def device_bucket_bytes(self) -> int:
        return DEVICE_BUCKETS[self.device_bucket]

    def describe(self, policy: bool = False, sparse: bool = False, dear: bool = False, device: bool = False,
                 path: bool = False) -> str:
        """One line for people; ``policy``, ``sparse``, ``dear``, ``device``, ``path``: also name the compressor
        policy, the sparse algorithm, DeAR's group size, the device buckets' budget, the GPU path (when they are
        tuned)."""
        return (f"unit {self.fusion_threshold_bytes / _MB:g} MB, in-place from {self.inplace_threshold_bytes / _KB:g} KB, "
                f"{self.channels} channel{'s' if self.channels != 1 else ''}, cycle {self.cycle_time_us / 1000:g} ms, "
                f"{ALGORITHMS[self.algorithm]}" + (f", policy {self.policy_name}" if policy else "")
                + (f", sparse {self.sparse_name}" if sparse else "")
                + (f", DeAR groups {self.dear_bytes / _MB:g} MB" if dear else "")
                + (f", device buckets {self.device_bucket_bytes / _MB:g} MB" if device else "")
                + (f", GPU path {DEVICE_PATHS[self.device_path]}" if path else ""))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Space:
    """Candidate values per parameter, in increasing order (algorithms in ALGORITHMS order)."""

    fusion_threshold_bytes: tuple[int, ...]
    inplace_threshold_bytes: tuple[int, ...]
    channels: tuple[int, ...]
    cycle_time_us: tuple[int, ...]
    algorithm: tuple[int, ...]
    compression_policy: tuple[int, ...] = (0,)
    sparse_algorithm: tuple[int, ...] = (0,)
    dear_threshold: tuple[int, ...] = (0,)
    device_bucket: tuple[int, ...] = (0,)
    device_path: tuple[int, ...] = (0,)

    @classmethod
    def build(cls, *, max_channels: int, multi_host: bool, fixed: dict | None = None,
              policies: bool = False) -> "Space":
        """The default space; ``fixed`` maps parameter names (ALL_PARAMS) to the one value they must keep;
        ``policies``: search the compressor policy over every one of COMPRESSION_POLICIES."""
        fixed = fixed or {}
        algorithms = (0, 1, 2, 3) if multi_host else (0, 1, 2)
        choices = {
            "fusion_threshold_bytes": FUSION_CHOICES,
            "inplace_threshold_bytes": INPLACE_CHOICES,
            "channels": tuple(c for c in CHANNEL_CHOICES if c <= max_channels) or (1,),
            "cycle_time_us": CYCLE_CHOICES_US,
            "algorithm": algorithms,
            POLICY: tuple(range(len(COMPRESSION_POLICIES))) if policies else (0,),
            SPARSE: (0,),
            DEAR: (0,),
            DEVICE: (0,),
            PATH: (0,),
        }
        for name, value in fixed.items():
            if name not in choices:
                raise ValueError(f"unknown tuned parameter {name!r}; expected one of {', '.join(ALL_PARAMS)}")
            choices[name] = (value,)
        return cls(**choices)

    def with_policies(self, policies) -> "Space":
        """This space with the compressor policy's candidates replaced (indexes into COMPRESSION_POLICIES)."""
        return dataclasses.replace(self, compression_policy=tuple(int(p) for p in policies))

    def with_sparse(self, algorithms) -> "Space":
        """This space with the sparse algorithm's candidates replaced (indexes into SPARSE_ALGORITHMS)."""
        return self.with_choices(SPARSE, algorithms)

    def with_choices(self, name: str, values) -> "Space":
        """This space with parameter ``name``'s candidates replaced."""
        return dataclasses.replace(self, **{name: tuple(int(v) for v in values)})

    def choices(self, name: str) -> tuple[int, ...]:
        return getattr(self, name)

    def searched(self) -> tuple[str, ...]:
        """The parameters a technique proposes values for: the engine's, and each optional one when it has more
        than one candidate (else it keeps its one value, and a job without a compressor, sparse tensors, DeAR
        or device buckets is searched as it always was)."""
        return PARAMS + tuple(n for n in OPTIONAL_PARAMS if len(self.choices(n)) > 1)

    def make(self, **values) -> Config:
        """A Config from values of :meth:`searched`; a parameter not given takes its first candidate."""
        for name in ALL_PARAMS:
            if name not in values:
                values[name] = self.choices(name)[0]
        return Config(**values)

    def size(self) -> int:
        n = 1
        for name in ALL_PARAMS:
            n *= len(self.choices(name))
        return n

    def contains(self, config: Config) -> bool:
        return all(getattr(config, name) in self.choices(name) for name in ALL_PARAMS)

    def grid(self, seed: int = 0) -> list[Config]:
        """Every point, in a shuffled (seeded) order: a grid search that stops early has still spread out."""
        names = self.searched()
        points = [self.make(**dict(zip(names, vals))) for vals in itertools.product(*(self.choices(n) for n in names))]
        random.Random(seed).shuffle(points)
        return points

    def random(self, rng: random.Random) -> Config:
        names = self.searched()
        return self.make(**{n: rng.choice(self.choices(n)) for n in names})

    def neighbours(self, config: Config) -> Iterator[Config]:
        """Configs that differ in one parameter by one step of its candidate list."""
        for name in self.searched():
            options = self.choices(name)
            value = getattr(config, name)
            i = options.index(value) if value in options else 0
            for j in (i - 1, i + 1):
                if 0 <= j < len(options):
                    yield dataclasses.replace(config, **{name: options[j]})

    def nearest(self, config: Config) -> Config:
        """The point of this space closest to config (per parameter, the nearest candidate)."""
        values = {}
        for name in ALL_PARAMS:
            options: Sequence[int] = self.choices(name)
            v = getattr(config, name)
            values[name] = v if v in options else min(options, key=lambda o: (abs(o - v), o))
        return Config(**values)
