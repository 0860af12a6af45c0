"""One generation of an elastic job as the driver follows it, and what every part of the driver shares.

:class:`_Generation` is the driver's record of one ``mpirun`` job: its hosts, its process, the ranks that said
hello (:class:`~perseus.runner.elastic.ranks.RankLink`), and where it stands (recovering in process, leaving,
gone). :class:`JobFailed` is raised wherever the job cannot go on (the driver prints its message and
``perseusrun`` exits 1); :func:`say` is how the driver speaks (stderr). This runs in the ``perseusrun``
process only, never in a rank.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Optional

from perseus.runner.elastic.ranks import RankLink
from perseus.runner.hosts import HostSlots

__all__ = ["JobFailed", "say"]


class JobFailed(Exception):
    """The job cannot go on; the message says why and what to do."""


def say(message: str) -> None:
    print(f"perseusrun: elastic: {message}", file=sys.stderr, flush=True)


class _Generation:
    def __init__(self, number: int, hosts: list[HostSlots], proc: subprocess.Popen):
        self.number, self.hosts, self.proc = number, hosts, proc
        self.np = sum(h.slots for h in hosts)
        self.links: list[RankLink] = []
        self.started = time.monotonic()
        self.episode = 0                      # in-process recoveries asked of the ranks, or reported by them
        self.counted = 0                      # recoveries counted against --reset-limit
        self.recovering_since: Optional[float] = None
        self.recovered: set[int] = set()
        self.notified: Optional[tuple] = None   # the host set the ranks were last told about
        self.restored_said = False
        self.finished_at: Optional[float] = None
        self.leaving: Optional[tuple[float, str]] = None  # (since, why) once the ranks were asked to leave
        self.gone = False                     # every rank left its function and was told so

    def live(self) -> list[RankLink]:
        """Ranks still connected that have not said how they leave."""
        return [l for l in self.links if l.connected and l.exit_reason is None]

