"""Which hosts an elastic job may use: the host discovery script and the blacklist of failed hosts.

The discovery script (``perseusrun --host-discovery-script S``, as horovodrun's) prints the hosts that are
available now, one per line, as ``host`` or ``host:slots``. It is run again every second; a run that fails,
hangs or prints something that is not a host line changes nothing (the previous answer stands) and is reported
once per kind of problem, so a flaky discovery backend never stops or shrinks a job.

A host whose worker failed is blacklisted: it is left out of later generations, for ever or, with
``--blacklist-cooldown-range LO HI``, for a cool-down drawn between LO and HI seconds that doubles with each
further failure of the same host (capped at HI), after which it may be used again.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from typing import Optional

from perseus.runner.hosts import HostSlots

__all__ = ["DiscoveryError", "parse_discovery_output", "HostDiscovery", "FixedHosts", "Blacklist"]

_LINE_RE = re.compile(r"^([A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?)(?::(\d+))?$")


class DiscoveryError(RuntimeError):
    """The discovery script failed, did not answer in time, or printed something that is not a host list."""


def parse_discovery_output(text: str, slots_per_host: Optional[int]) -> list[HostSlots]:
    """The hosts in the script's output, in order: ``host`` (``slots_per_host`` slots, default 1) or
    ``host:slots`` per line; blank lines and ``#`` comments are skipped; ``--slots-per-host`` caps a line's
    slots. A host named twice keeps its first line.

    Raises:
        DiscoveryError: a line is not a host line (the message names the line and shows the form).
    """
    hosts: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        match = _LINE_RE.match(entry)
        if match is None or (match.group(2) is not None and int(match.group(2)) <= 0):
            raise DiscoveryError(f"line {number} of its output, {entry!r}, is not a host line (write 'host' or "
                                 f"'host:slots', one per line)")
        slots = int(match.group(2)) if match.group(2) else (slots_per_host or 1)
        if slots_per_host:
            slots = min(slots, slots_per_host)
        hosts.setdefault(match.group(1), slots)
    return [HostSlots(h, s) for h, s in hosts.items()]


class HostDiscovery:
    """Runs the discovery script and remembers its last good answer.

    Args:
        script: the command (run through the shell, as horovodrun does).
        slots_per_host: slots of a line without ``:slots``, and the most any host gets (None: 1 / no cap).
        timeout: seconds one run may take.
    """

    def __init__(self, script: str, slots_per_host: Optional[int] = None, timeout: float = 10.0):
        self.script, self.slots_per_host, self.timeout = script, slots_per_host, timeout
        self.last: Optional[list[HostSlots]] = None

    def run(self) -> list[HostSlots]:
        """Run the script once and return its hosts (also kept in :attr:`last`).

        Raises:
            DiscoveryError: the script could not start, exited non-zero, timed out or printed garbage; the
                message names the script and carries the end of its error output.
        """
        try:
            done = subprocess.run(self.script, shell=True, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace", timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery script {self.script!r} did not finish within "
                                 f"{self.timeout:g} s") from None
        except OSError as exc:
            raise DiscoveryError(f"host discovery script {self.script!r} cannot be run: {exc}") from None
        if done.returncode != 0:
            tail = " / ".join(done.stderr.strip().splitlines()[-3:]) or "no error output"
            raise DiscoveryError(f"host discovery script {self.script!r} exited with status {done.returncode}: "
                                 f"{tail}")
        try:
            hosts = parse_discovery_output(done.stdout, self.slots_per_host)
        except DiscoveryError as exc:
            raise DiscoveryError(f"host discovery script {self.script!r}: {exc}") from None
        self.last = hosts
        return hosts


class FixedHosts:
    """A fixed host list in place of a discovery script (``perseusrun -H ... --min-np N``, as horovodrun): the
    same hosts at every poll, each capped at ``slots_per_host`` slots; the blacklist still drops failed ones."""

    def __init__(self, hosts: list[HostSlots], slots_per_host: Optional[int] = None):
        self.last = [HostSlots(h.host, min(h.slots, slots_per_host) if slots_per_host else h.slots) for h in hosts]

    def run(self) -> list[HostSlots]:
        return list(self.last)


class Blacklist:
    """Hosts left out after a failure, for ever or for a cool-down (see the module doc).

    Args:
        cooldown: ``(low, high)`` seconds, or None for a permanent blacklist (horovodrun's default).
        clock: the time source (tests).
    """

    def __init__(self, cooldown: Optional[tuple[float, float]] = None, clock=time.monotonic):
        if cooldown is not None:
            low, high = float(cooldown[0]), float(cooldown[1])
            if not 0 <= low <= high:
                raise ValueError(f"--blacklist-cooldown-range {cooldown[0]} {cooldown[1]}: expected 0 <= LO <= HI "
                                 f"seconds")
            cooldown = (low, high)
        self.cooldown = cooldown
        self._clock = clock
        self._until: dict[str, float] = {}
        self._failures: dict[str, int] = {}

    def add(self, host: str) -> float:
        """Blacklist ``host`` after a failure; returns the seconds until it may be used again (inf: never)."""
        n = self._failures[host] = self._failures.get(host, 0) + 1
        if self.cooldown is None:
            delay = float("inf")
        else:
            low, high = self.cooldown
            delay = min(high, random.uniform(low, high) * 2 ** (n - 1))
        self._until[host] = self._clock() + delay
        return delay

    def blocked(self, host: str) -> bool:
        """True while ``host`` is blacklisted."""
        until = self._until.get(host)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[host]
            return False
        return True

    def usable(self, hosts: list[HostSlots]) -> list[HostSlots]:
        """``hosts`` without the blacklisted ones, in order."""
        return [h for h in hosts if not self.blocked(h.host)]

    def failures(self, host: str) -> int:
        return self._failures.get(host, 0)
