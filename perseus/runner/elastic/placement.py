"""Where the elastic driver runs its generations: the discovered hosts, their choice, and their keepers.

:class:`_Placement` is part of :class:`~perseus.runner.elastic.driver.ElasticDriver` (which sets the state it
reads in its ``__init__``): a thread polls the discovery script every :data:`DISCOVERY_INTERVAL_S` seconds, the
next generation gets the usable hosts (less the blacklisted ones, the previous hosts first, up to
``--max-np`` slots) once enough of them are there, and a checkpoint keeper runs on each of them.
:func:`route_address` is the address the ranks reach the driver at. Waiting for hosts raises
:class:`~perseus.runner.elastic.generation.JobFailed` when fewer than ``--min-np`` slots are usable after
``--elastic-timeout`` seconds, or when discovery never answered; a failed discovery run or keeper start is
said and survived. This runs in the ``perseusrun`` process only, never in a rank.
"""

from __future__ import annotations

import socket
import threading
import time

from perseus.runner.elastic.discovery import DiscoveryError
from perseus.runner.elastic.generation import JobFailed, say
from perseus.runner.hosts import HostSlots, format_hosts, is_local

__all__ = ["DISCOVERY_INTERVAL_S", "route_address"]

DISCOVERY_INTERVAL_S = 1.0


class _Placement:
    """The elastic driver's hosts and keepers (methods of :class:`~perseus.runner.elastic.driver.ElasticDriver`)."""

    # -- discovery ----------------------------------------------------------------------------------------------

    def _poll_discovery(self) -> None:
        while not self._stop.is_set():
            try:
                hosts = self.discovery.run()
                with self._hosts_lock:
                    self._discovered, self._discovery_error = hosts, None
                self._said_errors.clear()
            except DiscoveryError as exc:
                text = str(exc)
                with self._hosts_lock:
                    self._discovery_error = text
                if text not in self._said_errors:
                    self._said_errors.add(text)
                    say(f"host discovery failed, keeping the hosts it last reported: {text}")
            self._stop.wait(DISCOVERY_INTERVAL_S)

    def usable_hosts(self) -> list[HostSlots]:
        with self._hosts_lock:
            hosts = list(self._discovered or [])
        return self.blacklist.usable(hosts)

    def _choose(self, usable: list[HostSlots], previous: list[HostSlots]) -> list[HostSlots]:
        """The next generation's hosts: the previous ones still usable first (rank 0 stays where it was), then
        new ones in discovery order, up to ``max_np`` slots."""
        by_name = {h.host: h for h in usable}
        ordered = [by_name[h.host] for h in previous if h.host in by_name]
        ordered += [h for h in usable if h.host not in {p.host for p in ordered}]
        chosen, total = [], 0
        for h in ordered:
            if self.max_np is not None and total >= self.max_np:
                break
            slots = h.slots if self.max_np is None else min(h.slots, self.max_np - total)
            chosen.append(HostSlots(h.host, slots))
            total += slots
        return chosen

    def _wait_for_hosts(self, need: int, previous: list[HostSlots]) -> list[HostSlots]:
        """Hosts for the next generation once at least ``need`` slots are usable (``--min-np`` at worst after
        ``elastic_timeout``)."""
        deadline = time.monotonic() + self.elastic_timeout
        said = False
        while True:
            usable = self.usable_hosts()
            slots = sum(h.slots for h in usable)
            if slots >= need or (time.monotonic() >= deadline and slots >= self.min_np):
                return self._choose(usable, previous)
            if time.monotonic() >= deadline:
                with self._hosts_lock:
                    error, found = self._discovery_error, self._discovered
                if found is None:
                    raise JobFailed(f"host discovery unavailable for {self.elastic_timeout:g} s "
                                    f"(--elastic-timeout): {error}; fix the discovery script")
                blocked = sorted({h.host for h in found} - {h.host for h in usable})
                raise JobFailed(f"only {slots} usable slot(s) after waiting {self.elastic_timeout:g} s "
                                f"(--elastic-timeout): {format_hosts(usable) or 'no hosts'}"
                                f"{'; blacklisted: ' + ', '.join(blocked) if blocked else ''}; fewer than "
                                f"--min-np {self.min_np}: add hosts to the discovery script's output or lower "
                                f"--min-np")
            with self._hosts_lock:
                answered = self._discovered is not None or self._discovery_error is not None
            if not said and answered:
                say(f"waiting up to {self.elastic_timeout:g} s for {need} slot(s); usable now: {slots} "
                    f"({format_hosts(usable) or 'none'})")
                said = True
            time.sleep(0.2)

    # -- keepers ------------------------------------------------------------------------------------------------

    def _ensure_keepers(self, hosts: list[HostSlots]) -> None:
        if self._start_keeper is None:
            return
        missing = [h.host for h in hosts if h.host not in self.keepers or not self.keepers[h.host].alive()]
        results: dict[str, object] = {}

        def start(host):
            try:
                results[host] = self._start_keeper(host, self.token, self.driver_address)
            except Exception as exc:  # noqa: BLE001 - a host without a keeper only loses its copies
                results[host] = exc

        threads = [threading.Thread(target=start, args=(h,), daemon=True) for h in missing]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        for host in missing:
            keeper = results.get(host)
            if isinstance(keeper, Exception) or keeper is None:
                say(f"no checkpoint keeper on {host} ({keeper or 'no answer'}); its commits are copied to the "
                    f"other hosts only")
                self.keepers.pop(host, None)
            else:
                self.keepers[host] = keeper

    def _keeper_env(self) -> str:
        return ",".join(f"{host}={self._host_address(host)}:{k.port}" for host, k in self.keepers.items()
                        if k.alive())

    @staticmethod
    def _host_key(hosts: list[HostSlots]) -> tuple:
        return tuple(sorted(h.host for h in hosts))


def route_address(hosts: list[str]) -> str:
    """The address of this machine that ``hosts`` reach it at: the source address of the route to the first
    remote host (no packet is sent); 127.0.0.1 when every host is this machine."""
    for host in hosts:
        if is_local(host):
            continue
        try:
            address = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((address, 9))
                return probe.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"
