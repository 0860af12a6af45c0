"""The elastic driver behind ``perseusrun --host-discovery-script`` (horovodrun's elastic mode).

The job runs as a sequence of *generations*, each one ``mpirun`` over the hosts usable at its start (the
discovery script's hosts less the blacklisted ones, at most ``--max-np`` slots). The driver:

* polls the discovery script every second (:class:`~perseus.runner.elastic.discovery.HostDiscovery`);
* starts a checkpoint keeper on every host it uses (:mod:`perseus.runner.elastic.keeper`, over ssh), which
  keeps the ranks' commits in memory across generations (Gemini);
* serves its ranks (:class:`~perseus.runner.elastic.ranks.RankServer`): hello, heartbeats, how each rank leaves;
* reacts:

  - a rank's connection drops without a report (``kill -9``, a crash, its host died): its host is blacklisted;
    the survivors are told to abort their pending collectives. With MPI's fault-tolerance extension (ULFM,
    Open MPI 5's ``--with-ft ulfm``) they re-form the job among themselves in process, from the commit in
    their own memory, within a second; otherwise they leave and the driver starts the next generation,
    whose ranks restore the newest commit from the keepers;
  - a rank silent for ``PERSEUS_ELASTIC_HEARTBEAT_TIMEOUT`` seconds (stopped, or its host cut off): its host is
    blacklisted and the generation is torn down and started again without it (MPI cannot tell a stopped
    process from a slow one, so in-process recovery is not attempted);
  - hosts added or removed by the discovery script: every rank is told; at their next ``commit()`` they all
    raise ``HostsUpdatedInterrupt`` together, flush their commit and leave, and the next generation starts on
    the new hosts (growing up to ``--max-np``);
  - an exception in the training code on any rank ends the job with that error (a bug is not retried);
  - fewer than ``--min-np`` slots usable: the driver waits up to ``--elastic-timeout`` seconds for hosts,
    then fails saying so; more than ``--reset-limit`` re-forms: it fails saying so.

Why relaunch rather than MPI's dynamic process management: a generation is an ordinary ``mpirun`` job, so
nothing in perseus's engine or in MPI needs to support processes joining a running communicator, and a new
host gets a fresh, consistent job. In-process recovery (ULFM revoke + shrink) is used only to drop failed
ranks, where it saves the relaunch.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from perseus.runner.elastic.ranks import Event, RankLink, RankServer
from perseus.runner.elastic.discovery import Blacklist, DiscoveryError, HostDiscovery
from perseus.runner.hosts import HostSlots, format_hosts, is_local

__all__ = ["JobFailed", "ElasticDriver", "DISCOVERY_INTERVAL_S"]

DISCOVERY_INTERVAL_S = 1.0
_STARTUP_TIMEOUT_S = 300.0      # a generation's ranks must say hello (from init()) within this
_RECOVERY_TIMEOUT_S = 30.0      # in-process recovery must be reported within this, else relaunch
_EXIT_GRACE_S = 5.0             # mpirun may take this long to end once every rank has left
_FAILED_STARTS = 3               # later generations whose ranks never reported, in a row, before the job fails
_LEAVE_TIMEOUT_S = 20.0         # ranks asked to leave must be gone within this, else they are killed


_SOURCES = {"memory": "the rank's own memory", "local": "its host's keeper", "peer": "a peer host's keeper",
            "disk": "disk"}


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


class ElasticDriver:
    """Runs an elastic job (see the module doc); :meth:`run` returns the launcher's exit status.

    Args:
        start: ``start(hosts, np, env) -> Popen`` starts one generation's ``mpirun`` (in its own session) with
            the ``PERSEUS_ELASTIC_*`` variables in ``env`` forwarded to every rank.
        discovery: where the hosts come from: ``run() -> [HostSlots]`` (the discovery script's runner, a fixed
            host list, an engine's nodes).
        np_: ranks wanted at the start (the first generation waits up to ``elastic_timeout`` for them).
        min_np, max_np: the job's bounds (``max_np`` None: as many as the hosts offer).
        reset_limit: re-forms allowed (None: no limit).
        blacklist: where failed hosts go.
        elastic_timeout: seconds to wait for enough hosts.
        heartbeat_timeout: seconds of silence after which a rank is taken as failed.
        in_process: whether ranks may re-form the job in process after a rank died (ULFM on).
        start_keeper: ``start_keeper(host, token, driver_address) -> keeper`` (an object with ``host``, ``port``,
            ``alive()`` and ``stop()``), or None to run without keepers.
        kill_remote: ``kill_remote(host, pid)`` kills a stray rank on a host (best effort).
        driver_address: the address ranks reach the driver at (default: see :func:`route_address`); the
            driver's server listens on it alone (127.0.0.1 when every host is this machine).
        host_address: ``host_address(host)`` is the address the ranks reach ``host``'s keeper at (default: the
            host's name; Ray and Spark jobs name their nodes ``perseus-node-<i>``, which do not resolve).
    """

    def __init__(self, *, start: Callable[[list[HostSlots], int, dict], subprocess.Popen],
                 discovery: HostDiscovery, np_: Optional[int], min_np: int, max_np: Optional[int],
                 reset_limit: Optional[int], blacklist: Blacklist, elastic_timeout: float, heartbeat_timeout: float,
                 in_process: bool, start_keeper=None, kill_remote=None, driver_address: Optional[str] = None,
                 host_address: Optional[Callable[[str], str]] = None):
        self._start, self.discovery = start, discovery
        self.min_np, self.max_np = max(1, min_np), max_np
        self.np_ = max(self.min_np, np_ or self.min_np)
        if self.max_np is not None:
            self.np_ = min(self.np_, self.max_np)
        self.reset_limit, self.blacklist = reset_limit, blacklist
        self.elastic_timeout, self.heartbeat_timeout = elastic_timeout, heartbeat_timeout
        self.in_process = in_process
        self._start_keeper, self._kill_remote = start_keeper, kill_remote
        self.driver_address = driver_address
        self._host_address = host_address or (lambda host: host)
        self.token = secrets.token_hex(16)
        self.resets = 0
        self.failed_starts = 0                # consecutive generations whose ranks never reported
        self.keepers: dict[str, object] = {}
        self._hosts_lock = threading.Lock()
        self._discovered: Optional[list[HostSlots]] = None
        self._discovery_error: Optional[str] = None
        self._said_errors: set[str] = set()
        self._stop = threading.Event()
        self.server: Optional[RankServer] = None

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

    # -- generations --------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to its end; 0 when every rank finished, 1 when it failed (the reason is printed)."""
        threading.Thread(target=self._poll_discovery, name="perseusrun-elastic-discovery", daemon=True).start()
        gen: Optional[_Generation] = None
        try:
            hosts = self._wait_for_hosts(self.np_, [])
            number = 0
            while True:
                gen = self._launch(number, hosts)
                outcome = self._watch(gen)
                if outcome == "done":
                    say(f"the job finished after {self.resets} re-form(s)")
                    return 0
                self._count_reset(outcome)
                hosts = self._wait_for_hosts(self.min_np, gen.hosts)
                number += 1
        except JobFailed as exc:
            say(f"error: {exc}")
            if gen is not None:
                self._teardown(gen)
            return 1
        except KeyboardInterrupt:
            if gen is not None:
                self._teardown(gen)
            return 130
        finally:
            self._stop.set()
            for keeper in self.keepers.values():
                try:
                    keeper.stop()
                except Exception:  # noqa: BLE001 - leaving: one keeper that fails to stop must not keep the others
                    pass
            if self.server is not None:
                self.server.close()

    def _count_reset(self, why: str) -> None:
        self.resets += 1
        if self.reset_limit is not None and self.resets > self.reset_limit:
            raise JobFailed(f"reset limit reached: the job was re-formed {self.resets - 1} time(s) and would need "
                            f"another ({why}); --reset-limit {self.reset_limit}")

    def _launch(self, number: int, hosts: list[HostSlots]) -> _Generation:
        if self.driver_address is None:
            self.driver_address = route_address([h.host for h in hosts])
        if self.server is None:  # on the address the ranks are told, not on every interface
            try:
                self.server = RankServer(self.token, bind=self.driver_address)
            except OSError as exc:
                raise JobFailed(f"cannot listen for the ranks on {self.driver_address} ({exc})") from None
        self._ensure_keepers(hosts)
        np_ = sum(h.slots for h in hosts)
        env = {"PERSEUS_ELASTIC_DRIVER": f"{self.driver_address}:{self.server.port}",
               "PERSEUS_ELASTIC_TOKEN": self.token, "PERSEUS_ELASTIC_GENERATION": str(number),
               "PERSEUS_ELASTIC_HOSTS": format_hosts(hosts), "PERSEUS_ELASTIC_KEEPERS": self._keeper_env(),
               "PERSEUS_ELASTIC_IN_PROCESS": "1" if self.in_process else "0"}
        say(f"generation {number}: {np_} rank(s) on {format_hosts(hosts)}")
        proc = self._start(hosts, np_, env)
        gen = _Generation(number, hosts, proc)
        gen.notified = self._host_key(hosts)
        return gen

    @staticmethod
    def _host_key(hosts: list[HostSlots]) -> tuple:
        return tuple(sorted(h.host for h in hosts))

    def _watch(self, gen: _Generation) -> str:
        """Follow one generation until it ends: ``"done"``, or the reason to start the next one."""
        while True:
            try:
                event = self.server.events.get(timeout=0.1)
            except queue.Empty:
                event = None
            if event is not None:
                self._on_event(gen, event)
                continue
            now = time.monotonic()
            if gen.leaving is None:
                self._check_silence(gen, now)
            if gen.leaving is None:
                self._check_hosts(gen)
                self._check_recovery(gen, now)
            if gen.proc.poll() is not None:
                return self._ended(gen)
            if gen.leaving is not None and now - gen.leaving[0] > _LEAVE_TIMEOUT_S:
                self._teardown(gen)
                return self._ended(gen)
            if not gen.links and now - gen.started > _STARTUP_TIMEOUT_S:
                self._teardown(gen)
                raise JobFailed(f"no rank of generation {gen.number} reported to the driver within "
                                f"{_STARTUP_TIMEOUT_S:g} s; does the script call init() (hvd.init())?")
            if gen.links and all(l.bye or not l.connected for l in gen.links):
                gen.finished_at = gen.finished_at or now
                if now - gen.finished_at > _EXIT_GRACE_S:  # every rank left; MPI_Finalize may hang after a shrink
                    self._teardown(gen, quiet=True)
                    return self._ended(gen)

    def _leave(self, gen: _Generation, why: str) -> None:
        """Ask every live rank to flush its last commit and leave; the next generation starts once mpirun has
        ended (or, after a while, is ended)."""
        gen.leaving = (time.monotonic(), why)
        gen.recovering_since = None
        for other in gen.live():
            self.server.send(other, {"op": "abort", "relaunch": True, "episode": gen.episode, "detail": why})

    def _on_event(self, gen: _Generation, event: Event) -> None:
        link, header = event.link, event.header
        if link.generation != gen.number:
            return
        if event.kind == "hello":
            gen.links.append(link)
            self.failed_starts = 0
            return
        if event.kind == "drop":
            if link.exit_reason is None and not link.bye:
                link.exit_reason = "died"
                self._on_death(gen, link)
            return
        op = header.get("op")
        if op == "exit":
            link.exit_reason, link.exit_detail = str(header.get("reason")), str(header.get("detail", ""))
            if link.exit_reason == "error":
                self._teardown(gen)
                raise JobFailed(f"rank {link.rank} on {link.host} raised {link.exit_detail.strip()}\nthe job stops:"
                                f" an error in the training code is not retried")
            if link.exit_reason == "reset" and "hosts changed" in link.exit_detail and gen.leaving is None:
                gen.leaving = (time.monotonic(), "hosts changed")  # the rest follow; if they do not, a teardown
            if not gen.gone and len(gen.links) >= gen.np and not gen.live():
                # Every rank left its training function: they may shut perseus down now without failing a
                # slower rank's last collective.
                gen.gone = True
                for other in gen.links:
                    if other.connected:
                        self.server.send(other, {"op": "go"})
        elif op == "bye":
            link.bye = True
        elif op == "restored" and link.rank == 0 and not gen.restored_said:
            gen.restored_said = True
            if header.get("version") is not None:
                where = _SOURCES.get(str(header.get("source")), str(header.get("source")))
                say(f"generation {gen.number} restored commit {header['version']} from {where} in "
                    f"{float(header.get('seconds', 0)):.3f} s")
        elif op == "recovered":
            link.rank, link.size = int(header["rank"]), int(header["size"])
            episode = int(header.get("episode", gen.episode))
            if episode > gen.counted and gen.leaving is None:  # re-formed by themselves: a collective failed
                gen.counted = gen.episode = episode
                gen.recovering_since = gen.recovering_since or time.monotonic()
                self._count_reset("a collective failed on every rank")
            gen.recovered.add(id(link))
            if link.size < self.min_np and gen.leaving is None:
                say(f"the job re-formed on {link.size} rank(s), fewer than --min-np {self.min_np}: stopping this "
                    f"generation")
                self._leave(gen, "fewer ranks than --min-np")
            if gen.recovering_since is not None and len(gen.recovered) >= len(gen.live()):
                say(f"the job re-formed in process on {link.size} rank(s) in "
                    f"{time.monotonic() - gen.recovering_since:.2f} s")
                gen.recovering_since = None

    def _on_death(self, gen: _Generation, link: RankLink) -> None:
        if gen.leaving is not None:  # the generation is stopping: MPI may take the survivors down with it
            say(f"{link} ended while generation {gen.number} was stopping")
            return
        say(f"{link} died: its connection closed without a report")
        self._blacklist(link.host)
        live = gen.live()
        # MPI's shared-memory transport cannot shrink around a dead process of the same machine (the survivors
        # wait for ever): relaunch then. Two names of this machine (localhost, 127.0.0.1) are one machine.
        same_host = [l for l in live if l.host == link.host or (is_local(l.host) and is_local(link.host))]
        if len(live) < self.min_np:
            say(f"{len(live)} rank(s) left, fewer than --min-np {self.min_np}: stopping this generation")
            return self._leave(gen, f"{link} died")
        if not self.in_process or same_host or gen.recovering_since is not None:
            return self._leave(gen, f"{link} died")
        self._count_reset(f"{link} died")
        gen.recovering_since, gen.recovered = time.monotonic(), set()
        for other in live:
            self.server.send(other, {"op": "abort", "relaunch": False, "episode": gen.episode,
                                     "detail": f"{link} died"})
        gen.episode += 1
        gen.counted = gen.episode
        gen.hosts = [h for h in gen.hosts if h.host != link.host]
        gen.notified = self._host_key(gen.hosts)

    def _blacklist(self, host: str) -> None:
        if self.blacklist.blocked(host):
            return
        delay = self.blacklist.add(host)
        say(f"blacklisting host {host} " + ("for the rest of the job" if delay == float("inf") else
                                             f"for {delay:.1f} s (--blacklist-cooldown-range)"))

    def _check_silence(self, gen: _Generation, now: float) -> None:
        for link in gen.live():
            silent = now - link.last_seen
            if silent > self.heartbeat_timeout:
                say(f"{link} has been silent for {silent:.1f} s (no heartbeat within "
                    f"PERSEUS_ELASTIC_HEARTBEAT_TIMEOUT={self.heartbeat_timeout:g}): stopped, hung or its host "
                    f"is unreachable; taken as failed")
                self._blacklist(link.host)
                link.exit_reason = "died"
                if self._kill_remote is not None:
                    threading.Thread(target=self._kill_remote, args=(link.host, link.pid), daemon=True).start()
                return self._leave(gen, f"{link} was silent")

    def _check_recovery(self, gen: _Generation, now: float) -> None:
        if gen.recovering_since is not None and now - gen.recovering_since > _RECOVERY_TIMEOUT_S:
            say(f"the survivors did not re-form the job in process within {_RECOVERY_TIMEOUT_S:g} s; relaunching")
            self._leave(gen, "in-process recovery timed out")

    def _check_hosts(self, gen: _Generation) -> None:
        if not gen.links or gen.recovering_since is not None:
            return
        usable = self.usable_hosts()
        with self._hosts_lock:
            if self._discovered is None:
                return
        current = {h.host for h in gen.hosts}
        names = {h.host for h in usable}
        removed = sorted(current - names)
        slots = sum(h.slots for h in gen.hosts)
        added = sorted(names - current) if self.max_np is None or slots < self.max_np else []
        key = self._host_key(self._choose(usable, gen.hosts)) if (added or removed) else gen.notified
        if key == gen.notified:
            return
        gen.notified = key
        change = 0
        change |= 1 if removed else 0
        change |= 2 if added else 0
        say("hosts changed (" + ", ".join([f"+{h}" for h in added] + [f"-{h}" for h in removed]) +
            "): the ranks re-form the job at their next commit")
        for link in gen.live():
            self.server.send(link, {"op": "hosts_updated", "timestamp": time.time(), "update": change})

    def _ended(self, gen: _Generation) -> str:
        """mpirun ended (or was ended once every rank had left): done, or why the job must re-form."""
        code = gen.proc.wait()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the last reports and drops
            try:
                event = self.server.events.get(timeout=0.1)
            except queue.Empty:
                if all(not l.connected for l in gen.links):
                    break
                continue
            self._on_event(gen, event)
        exits = [l.exit_reason for l in gen.links]
        if "done" in exits and all(r in ("done", "died") for r in exits):
            return "done"
        if code == 0 and len(gen.links) == gen.np and all(r is None and l.bye for r, l in zip(exits, gen.links)):
            return "done"  # a script that never called elastic.run ended normally on every rank
        if gen.leaving is not None:
            return gen.leaving[1]
        for link in gen.links:
            if link.exit_reason is None and link.connected is False:
                link.exit_reason = "died"
                say(f"{link} ended without a report")
                self._blacklist(link.host)
        if "reset" in exits or "died" in [l.exit_reason for l in gen.links]:
            return "hosts changed" if any("hosts changed" in l.exit_detail for l in gen.links) \
                else "a rank failed"
        if "terminated" in exits:
            # Not asked by this driver (it was not stopped): mpirun ended the job, e.g. after losing a host's
            # daemon (Open MPI ends the whole job then, even with ULFM). The job re-forms on the hosts still
            # usable, as after a rank's death.
            say(f"generation {gen.number}'s ranks were terminated by mpirun (status {code}; a daemon or host lost?)")
            return "ranks terminated"
        if not gen.links and code == 0:
            return "done"  # every rank exited 0 without init(): a job with nothing to re-form, and it finished
        if not gen.links:
            self.failed_starts += 1
            if gen.number == 0 or self.failed_starts > _FAILED_STARTS:
                raise JobFailed(f"mpirun exited with status {code} before any rank of generation {gen.number} "
                                f"reported; see its output above")
            # A later generation: a host may have gone between discovery and launch; try again, a few times.
            say(f"generation {gen.number} did not start (mpirun status {code}); trying again")
            return "a generation did not start"
        raise JobFailed(f"generation {gen.number} ended (mpirun status {code}) without its ranks reporting why; "
                        f"see the output above")

    def _teardown(self, gen: _Generation, quiet: bool = False) -> None:
        """End a generation: mpirun's process group gets SIGTERM, then SIGKILL; ranks still connected (a host
        mpirun cannot reach any more) are killed over ssh."""
        if gen.proc.poll() is None:
            if not quiet:
                say(f"stopping generation {gen.number}")
            for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(gen.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    gen.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        strays = [l for l in gen.links if l.connected]
        if strays and self._kill_remote is not None:
            time.sleep(0.5)
            threads = [threading.Thread(target=self._kill_remote, args=(l.host, l.pid), daemon=True)
                       for l in strays if l.connected]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10.0)


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
