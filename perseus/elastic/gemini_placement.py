"""Where a rank's Gemini checkpoint copies go: the placement of copies on hosts and its recovery probability.

Placement (:func:`placement`) is Gemini's Algorithm 6.1 (mixed placement): with m copies in all and N hosts,
the hosts form N // m groups of m consecutive hosts and each host sends its commit to the other m - 1 members
of its group; when m does not divide N the leftover hosts join the last group, where each host sends to the
next m - 1 hosts of that group's ring. Every host sends and receives m - 1 copies, and when m divides N the
probability that some copy of every host survives k failed hosts is the best any placement reaches
(:func:`recovery_probability` computes it exactly, e.g. 0.9333 for N=16, m=2, k=2).

Pure functions of the host list, the same on every rank (every rank computes the placement itself); they raise
ValueError for bad arguments.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence, Union

__all__ = ["placement", "recovery_probability"]


def placement(hosts: Sequence[str], replicas: int, *, strategy: str = "mixed") -> dict[str, list[str]]:
    """For each host, the *other* hosts that receive copies of its commits (its own copy stays local).

    ``replicas`` counts every copy, the local one included. ``strategy`` "mixed" is Gemini's Algorithm 6.1
    (groups of ``replicas`` consecutive hosts, the leftovers in the last group, which uses a ring); "ring"
    sends every host's copies to the next ``replicas - 1`` hosts of the whole ring (for comparisons). With
    fewer hosts than replicas every host sends to all the others.

    Raises:
        ValueError: ``replicas`` < 1, a host named twice, or an unknown strategy.
    """
    hosts = list(hosts)
    if replicas < 1:
        raise ValueError(f"placement: replicas must be >= 1 (copies in all, the local one included), got {replicas}")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"placement: a host is named twice in {hosts}; pass each host once")
    if strategy not in ("mixed", "ring"):
        raise ValueError(f"placement: unknown strategy {strategy!r}; use 'mixed' or 'ring'")
    n, m = len(hosts), replicas
    if strategy == "ring" or n <= m:
        groups = [hosts] if hosts else []
    else:
        groups = [hosts[i * m:(i + 1) * m] for i in range(n // m)]
        groups[-1] = groups[-1] + hosts[(n // m) * m:]
    out = {}
    for group in groups:
        size = len(group)
        for i, host in enumerate(group):
            out[host] = [group[(i + j) % size] for j in range(1, min(m, size))]
    return out


def recovery_probability(hosts_or_n: Union[int, Sequence[str]], replicas: int, failures: int, *,
                         strategy: str = "mixed") -> float:
    """The probability that every host's commit survives in some copy when ``failures`` hosts, all sets equally
    likely, fail at once, with :func:`placement`'s copies; computed exactly over every failure set.

    Raises:
        ValueError: ``failures`` is negative or more than the number of hosts (or :func:`placement`'s errors).
    """
    hosts = [str(i) for i in range(hosts_or_n)] if isinstance(hosts_or_n, int) else list(hosts_or_n)
    if not 0 <= failures <= len(hosts):
        raise ValueError(f"recovery_probability: failures must be between 0 and {len(hosts)}, got {failures}")
    index = {h: i for i, h in enumerate(hosts)}
    holders = {frozenset([index[h]] + [index[d] for d in dests])
               for h, dests in placement(hosts, replicas, strategy=strategy).items()}
    lost = sum(1 for failed in itertools.combinations(range(len(hosts)), failures)
               if any(s.issubset(failed) for s in holders))
    return 1.0 - lost / math.comb(len(hosts), failures)
