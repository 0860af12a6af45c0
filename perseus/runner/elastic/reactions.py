"""How the elastic driver reacts to what its ranks and hosts do during a generation.

:class:`_Reactions` is part of :class:`~perseus.runner.elastic.driver.ElasticDriver` (which sets the state it
reads in its ``__init__`` and provides ``_teardown`` and ``_count_reset``): a rank's hello, report or dropped
connection (:class:`~perseus.runner.elastic.ranks.Event`), a rank gone silent, an in-process recovery that
takes too long, hosts added or removed by discovery. A dead or silent rank's host is blacklisted; the
survivors are told to re-form in process (``abort`` without relaunch: every live rank must then report
``recovered``) or to flush their commit and leave (``abort`` with relaunch); a host change is told to every
live rank (``hosts_updated``), which all leave together at their next commit. An error in the training code on
any rank raises :class:`~perseus.runner.elastic.generation.JobFailed`, as does a re-form past
``--reset-limit``. This runs in the ``perseusrun`` process only, never in a rank.
"""

from __future__ import annotations

import threading
import time

from perseus.runner.elastic.generation import JobFailed, _Generation, say
from perseus.runner.elastic.ranks import Event, RankLink
from perseus.runner.hosts import is_local

__all__: list[str] = []

_RECOVERY_TIMEOUT_S = 30.0      # in-process recovery must be reported within this, else relaunch
_TOO_FEW = "fewer ranks than --min-np"  # why a generation whose ranks re-formed without some of them stops


_SOURCES = {"memory": "the rank's own memory", "local": "its host's keeper", "peer": "a peer host's keeper",
            "disk": "disk"}


class _Reactions:
    """The elastic driver's reactions (methods of :class:`~perseus.runner.elastic.driver.ElasticDriver`)."""

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
                self._leave(gen, _TOO_FEW)
            if gen.recovering_since is not None and len(gen.recovered) >= len(gen.live()):
                say(f"the job re-formed in process on {link.size} rank(s) in "
                    f"{time.monotonic() - gen.recovering_since:.2f} s")
                gen.recovering_since = None

    def _on_death(self, gen: _Generation, link: RankLink) -> None:
        if gen.leaving is not None:  # the generation is stopping: MPI may take the survivors down with it
            if gen.leaving[1] == _TOO_FEW and id(link) not in gen.recovered:
                # The survivors re-formed without this rank before its connection closed: it is the rank that
                # failed, whichever the driver heard of first, and its host is blacklisted as for any failure.
                say(f"{link} died: the others re-formed the job without it")
                self._blacklist(link.host)
                return
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

