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

:class:`ElasticDriver` runs the generations (launch, watch, end); where they run (discovery, the choice of
hosts, the keepers) is in :mod:`~perseus.runner.elastic.placement`, how it reacts to the ranks and hosts in
:mod:`~perseus.runner.elastic.reactions`, and one generation's record, :class:`JobFailed` and :func:`say` in
:mod:`~perseus.runner.elastic.generation`. This runs in the ``perseusrun`` process only, never in a rank.
:meth:`ElasticDriver.run` says a :class:`JobFailed` and returns 1 (130 on Ctrl-C).
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from typing import Callable, Optional

from perseus.runner.elastic.ranks import RankServer
from perseus.runner.elastic.discovery import Blacklist, HostDiscovery
from perseus.runner.elastic.generation import JobFailed, _Generation, say
from perseus.runner.elastic.placement import DISCOVERY_INTERVAL_S, _Placement, route_address
from perseus.runner.elastic.reactions import _Reactions
from perseus.runner.hosts import HostSlots, format_hosts

__all__ = ["JobFailed", "ElasticDriver", "DISCOVERY_INTERVAL_S", "say", "route_address"]

_STARTUP_TIMEOUT_S = 300.0      # a generation's ranks must say hello (from init()) within this
_EXIT_GRACE_S = 5.0             # mpirun may take this long to end once every rank has left
_FAILED_STARTS = 3               # later generations whose ranks never reported, in a row, before the job fails
_LEAVE_TIMEOUT_S = 20.0         # ranks asked to leave must be gone within this, else they are killed


class ElasticDriver(_Placement, _Reactions):
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
