"""Which algorithm reduces a sparse tensor: a per-tensor cost model fed with measurements.

The candidates and what one call costs the busiest rank (``n`` ranks, a table of ``R`` rows of ``rb``
bytes, ``x``-byte row ids on the wire, ``T`` rows over all ranks before the sum, ``U`` after it, i.e. the
post-aggregation density ``d_G^n = U / R``, and the overlap between ranks is ``T / U``):

==========  ===================================================================================================
dense       ring all-reduce of the densified table plus one float32 presence flag per row:
            ``2(n-1)/n * R (rb + 4)`` bytes, one collective; densifying touches ``~3 R rb`` bytes
allgather   every rank receives every other rank's rows and values: ``(T - nnz_min)(x + rb)``, one collective
            (Horovod's sparse path; the thesis's AGsparse; EmbRace's ``(N-1)(alpha M / B)``)
zen         push: the busiest owner receives ``imb (T - T/n) / n`` rows of ``x + rb`` bytes; pull: every rank
            receives the summed rows of the other owners, ``(n-1)/n (min(R/8, x U) + U rb)`` (hash bitmap or
            row ids, whichever is smaller per owner); two collectives (Zen's balanced parallelism, whose
            ``2(n-1)(d_G + d_G^n) M / (n B)`` this is, with the bitmap in the pull and the measured imbalance)
alltoall    column partition (EmbRace's AlltoAll): every rank sends its row ids and ``1/n`` of each row's
            columns to every rank, which sums its columns; the pull gathers the summed column slices, with no
            ids (every rank already received every id): ``(T - nnz_min) x + (T - T/n)/n rb c`` then
            ``(n-1)/n U rb c`` bytes, ``c`` the column imbalance ``ceil(W/n) / (W/n)``; two collectives
==========  ===================================================================================================

Time = collectives * latency + bytes * beta + local bytes touched * gamma + rows sorted * delta. The link's
latency and beta come from timed all-reduces of a few sizes (or ``PERSEUS_SPARSE_LATENCY_US`` /
``PERSEUS_SPARSE_BANDWIDTH_MBIT``), gamma and delta from timing a copy and a sort on the first rank; the
first rank's values are broadcast, and the measurements of a tensor (``T``, ``nnz_max``, ``nnz_min``, ``U``
and the imbalance, as exponentially weighted averages) come from the results of its previous calls, which
every rank holds identically. So every rank computes the same costs and makes the same choice, with no extra
communication. A tensor's first call has no history and runs Zen, which is never far from dense (it sends at
most the dense volume plus ids) and measures everything the next choice needs.

The model ranks; measured times decide (:func:`choose_measured`). Every message of a call carries how long
its sender's previous call under the name took, so after each call every rank knows the previous call's
time on every rank (the smallest is taken: the rank that arrived last waited for nobody). The algorithms
predicted within :data:`EXPLORE_WINDOW` of the best are each run :data:`EXPLORE_SAMPLES` times; from then on
each has a correction, the running ratio of its measured to its predicted time, and the choice is the
smallest corrected prediction. The model keeps following the measured densities, so a tensor whose density
drifts moves to another algorithm without being explored again, and algorithms the model puts far from the
best (dense for a large table, say) are never run.

:func:`set_policy` forces every 'auto' choice (for the autotuner, or a person comparing algorithms); it must
be called identically on every rank between steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, Optional

from perseus.runtime.step_policy import Following

__all__ = ["ALGORITHMS", "CHOICES", "Link", "Workload", "Prediction", "predict", "choose", "choose_measured",
           "set_policy", "policy", "DEFAULT_LINK", "EXPLORE_WINDOW", "EXPLORE_SAMPLES"]

#: what a sparse tensor can be reduced with
ALGORITHMS = ("dense", "allgather", "zen", "alltoall")
#: what the algorithm arguments and PERSEUS_SPARSE_ALGORITHM accept
CHOICES = ("auto",) + ALGORITHMS
_HEADER = 80
#: as perseus.sparse.zen.BITMAP_MAX_ROWS
BITMAP_MAX_ROWS = 1 << 26


@dataclasses.dataclass(frozen=True)
class Link:
    """Costs of the machine: seconds per collective, per byte on the wire, per byte of local memory work,
    per row sorted."""

    latency: float
    beta: float
    gamma: float = 2e-10
    delta: float = 2e-8


#: used when nothing was measured (a 10 Gbit/s link with 50 us per collective)
DEFAULT_LINK = Link(latency=50e-6, beta=8.0 / 10e9)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One sparse tensor as the cost model sees it (the measured quantities are per call)."""

    ranks: int
    rows: int                 #: R, rows of the dense table
    row_bytes: int            #: bytes per row (elements per row times the value size)
    index_bytes: int = 4      #: bytes per row id on the wire (4 while ids fit in int32)
    total: float = 0.0        #: T, rows over all ranks before the sum (each rank's rows coalesced)
    nnz_max: float = 0.0      #: rows on the rank with the most
    nnz_min: float = 0.0      #: rows on the rank with the fewest
    union: float = 0.0        #: U, distinct rows over all ranks (after the sum)
    imbalance: float = 1.0    #: rows the busiest Zen owner receives over the mean
    width: int = 1            #: elements per row (for the column partition)

    @property
    def density(self) -> float:
        """d_G: the mean fraction of rows a rank has."""
        return self.total / self.ranks / self.rows if self.rows > 0 else 0.0

    @property
    def aggregated_density(self) -> float:
        """d_G^n: the fraction of rows present after the sum."""
        return self.union / self.rows if self.rows > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Prediction:
    seconds: float
    wire_bytes: float      #: bytes the busiest rank receives
    local_bytes: float     #: bytes of local memory work
    collectives: int


def _zen_imbalance_prior(n: int, rows_per_owner: float) -> float:
    """Balls into bins: ``1 + sqrt(2 n ln n / m)`` for ``m`` rows per owner (Theorem 3.2's order)."""
    if n <= 1 or rows_per_owner <= 0:
        return 1.0
    return min(float(n), 1.0 + math.sqrt(2.0 * math.log(n) / max(rows_per_owner, 1.0)))


def predict(w: Workload, link: Link) -> Dict[str, Prediction]:
    """Modelled cost of one call per algorithm (those that apply: all but allgather need ``rows``)."""
    n = max(int(w.ranks), 1)
    x, rb = float(w.index_bytes), float(w.row_bytes)
    T, U, mx, mn = float(w.total), float(w.union), float(w.nnz_max), float(w.nnz_min)
    f = (n - 1) / n
    out: Dict[str, Prediction] = {}

    def add(name, coll, wire, local, sort):
        secs = coll * link.latency + wire * link.beta + local * link.gamma + sort * link.delta
        out[name] = Prediction(secs, wire, local, coll)

    add("allgather", 1, (T - mn) * (x + rb) + (n - 1) * _HEADER, 2 * mx * (x + rb) + 2 * T * (x + rb), 0.0)
    if w.rows < 0:
        return out
    R = float(w.rows)
    add("dense", 1, 2 * f * R * (rb + 4), 3 * R * rb + 8 * R + 2 * U * rb, 0.0)
    per_owner = T / n
    imb = max(1.0, float(w.imbalance))
    push = imb * (T - per_owner) / n * (x + rb) + (n - 1) * _HEADER
    bitmap = R / 8.0 if R <= BITMAP_MAX_ROWS else float("inf")
    index = min(bitmap, x * U)
    pull = f * (index + U * rb) + (n - 1) * (_HEADER + 8 * (n + 3))
    decode = 2 * R if index == bitmap else 0.0
    add("zen", 2, push + pull,
        2 * mx * (x + rb) + 2 * imb * per_owner * (x + rb) + 2 * U * rb + decode * (1 + 0.5 / n),
        mx + imb * per_owner + U)
    width = max(int(w.width), 1)
    cimb = math.ceil(width / n) / (width / n) if width >= 1 else 1.0
    push_c = (T - mn) * x + cimb * (T - per_owner) / n * rb + (n - 1) * _HEADER
    pull_c = f * U * rb * cimb + (n - 1) * (_HEADER + 8 * n)
    add("alltoall", 2, push_c + pull_c,
        mx * (n * x + rb) + T * x + 2 * cimb * per_owner * rb + 2 * U * rb, T)
    return out


def choose(w: Workload, link: Link, allowed: Optional[Iterable[str]] = None, current: Optional[str] = None,
           hysteresis: float = 0.05):
    """``(algorithm, predictions)``: the cheapest allowed algorithm; the ``current`` one is kept unless
    another is predicted at least ``hysteresis`` (a fraction) faster. Ties go to the earlier name in
    :data:`ALGORITHMS`, so the choice is a pure function of its arguments."""
    preds = predict(w, link)
    names = [a for a in ALGORITHMS if a in preds and (allowed is None or a in set(allowed))]
    if not names:
        raise ValueError("perseus.sparse: no algorithm applies")
    best = min(names, key=lambda a: (preds[a].seconds, ALGORITHMS.index(a)))
    if current in names and current != best:
        if preds[best].seconds >= preds[current].seconds * (1.0 - hysteresis):
            best = current
    return best, preds


#: algorithms predicted within this factor of the best are tried before the model is trusted
EXPLORE_WINDOW = 2.0
#: calls each of them gets while exploring
EXPLORE_SAMPLES = 2


def choose_measured(preds: Dict[str, Prediction], corrections: Dict[str, float], tried: Dict[str, int],
                    current: Optional[str] = None, window: float = EXPLORE_WINDOW, samples: int = EXPLORE_SAMPLES,
                    hysteresis: float = 0.05):
    """``(algorithm, how, estimates)`` from the model's predictions and what was measured.

    The candidates are the algorithms predicted within ``window`` times the best. While one of them has been
    run fewer than ``samples`` times (``tried``) the least tried (then the cheapest) is run: ``how`` is
    'explore'. Then each candidate's estimate is its prediction times its correction (the running ratio of
    measured to predicted seconds; the largest known one for a candidate never measured), and the cheapest
    wins, with ``hysteresis`` for the ``current`` one: ``how`` is 'auto'. A pure function: every rank, given
    the same measurements, chooses the same."""
    names = [a for a in ALGORITHMS if a in preds]
    if not names:
        raise ValueError("perseus.sparse: no algorithm applies")
    best = min(preds[a].seconds for a in names)
    cands = [a for a in names if preds[a].seconds <= window * best]
    need = [a for a in cands if tried.get(a, 0) < samples]
    if need:
        pick = min(need, key=lambda a: (tried.get(a, 0), preds[a].seconds, ALGORITHMS.index(a)))
        return pick, "explore", {a: preds[a].seconds for a in cands}
    known = [corrections[a] for a in cands if a in corrections]
    fallback = max(known) if known else 1.0
    est = {a: preds[a].seconds * corrections.get(a, fallback) for a in cands}
    pick = min(cands, key=lambda a: (est[a], ALGORITHMS.index(a)))
    if current in est and current != pick and est[pick] >= est[current] * (1.0 - hysteresis):
        pick = current
    return pick, "auto", est


_policy: Optional[str] = None
_policy_explicit = False  # set_policy() was called by the program (the autotuner then leaves it alone)


def set_policy(algorithm: Optional[str], *, _by_tuner: bool = False) -> None:
    """Make every 'auto' choice ``algorithm`` (one of :data:`ALGORITHMS`), or None to model again.

    Collective in effect: call it on every rank at the same point between steps (the choice must agree).
    A policy set before the autotuner starts searching is kept by it (``PERSEUS_AUTOTUNE_FIXED=explicit``).

    Raises:
        ValueError: an unknown algorithm.
    """
    global _policy, _policy_explicit
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"perseus.sparse: unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    _policy = algorithm
    if not _by_tuner:
        _policy_explicit = True


def policy() -> Optional[str]:
    """The algorithm :func:`set_policy` forces, or None."""
    return _policy


def _forget_tuned() -> None:
    """A new job (init after shutdown): an algorithm the tuner forced belonged to the old job; one the program
    set stays."""
    global _policy, _following
    if not _policy_explicit:
        _policy = None
    _following = Following("sparse")


def policy_explicit() -> bool:
    """Whether the program called :func:`set_policy` (the autotuner keeps such a policy)."""
    return _policy_explicit


class _SparsePath:
    """The sparse all-reduce path's identity with the autotuner (perseus.runtime.step_policy, link 'sparse')."""


_PARTICIPANT = _SparsePath()
_following = Following("sparse")


def follow_tuner(key: str, process_set) -> None:
    """Called at every 'auto' sparse all-reduce of the global process set, before its choice: under the
    autotuner, at step boundaries, the per-step agreement of perseus.runtime.step_policy (one small all-reduce
    while the tuner may still switch), then the algorithm the tuner chose for this step on every rank
    (:func:`set_policy`). Without a tuner: nothing. Collective while following (every rank calls it at the
    same calls, which the identical sequence of sparse all-reduces gives)."""
    code = _following.at_call(_PARTICIPANT, key, process_set)
    if code is not None:
        set_policy(None if code == 0 else CHOICES[code], _by_tuner=True)


def tuned_index() -> int:
    """The policy in force as an index into :data:`CHOICES` (0: 'auto'); the tuner's sparse dimension."""
    return 0 if _policy is None else CHOICES.index(_policy)


def prior_imbalance(n: int, total: float) -> float:
    """The imbalance assumed before one was measured."""
    return _zen_imbalance_prior(n, total / max(n, 1))
