"""Parse and check the hosts a job runs on (``-H a:2,b:2`` and ``--hostfile``).

A host list is an ordered list of :class:`HostSlots`; a host named twice has its slots added up
(MPICH machine files commonly repeat a host once per slot). Parsing errors are ``ValueError``
with a message that names the bad entry and shows the accepted form.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
import subprocess
import time
from typing import Iterable, Sequence

from perseus.runner.util.threads import in_thread

__all__ = [
    "HostSlots", "parse_hosts", "parse_hostfile", "format_hosts", "total_slots", "is_loopback",
    "unresolvable_hosts", "is_local", "remote_hosts", "ssh_command", "ssh_failures",
]

_HOST_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_HOSTS_FORM = "write host:slots entries separated by commas, e.g. -H node1:4,node2:4"
_HOSTFILE_FORM = "write one host per line as 'host slots=N', 'host:N' or 'host'"


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """One host and the number of processes (slots) it may run."""

    host: str
    slots: int

    def __str__(self) -> str:
        return f"{self.host}:{self.slots}"


def _check_host(host: str, where: str, form: str) -> str:
    if not _HOST_RE.match(host):
        raise ValueError(f"{where}: {host!r} is not a valid host name; {form}")
    return host


def _parse_slots(text: str, where: str, form: str) -> int:
    digits = text.strip()
    slots = int(digits) if digits.isdigit() else 0
    if slots <= 0:
        raise ValueError(f"{where}: slots must be a positive integer, got {text!r}; {form}")
    return slots


def _merge(pairs: Iterable[tuple[str, int]]) -> list[HostSlots]:
    order: dict[str, int] = {}
    for host, slots in pairs:
        order[host] = order.get(host, 0) + slots
    return [HostSlots(host, slots) for host, slots in order.items()]


def parse_hosts(hosts_string: str) -> list[HostSlots]:
    """Parse ``"a:2,b:2"`` into ``[HostSlots("a", 2), HostSlots("b", 2)]``.

    A bare ``host`` means one slot. Raise ``ValueError`` for an empty list, an empty entry, a bad
    host name or slots that are not a positive integer.
    """
    if hosts_string is None or not hosts_string.strip():
        raise ValueError(f"the host list is empty; {_HOSTS_FORM}")
    pairs = []
    for raw in hosts_string.split(","):
        entry = raw.strip()
        where = f"malformed host entry {entry!r}"
        if not entry:
            raise ValueError(f"empty host entry in {hosts_string!r}; {_HOSTS_FORM}")
        if entry.count(":") > 1:
            raise ValueError(f"{where}: expected one ':' between host and slots; {_HOSTS_FORM}")
        host, sep, slots_text = entry.partition(":")
        host = _check_host(host.strip(), where, _HOSTS_FORM)
        slots = _parse_slots(slots_text, where, _HOSTS_FORM) if sep else 1
        pairs.append((host, slots))
    return _merge(pairs)


def parse_hostfile(path: str) -> list[HostSlots]:
    """Read a host file: one ``host slots=N``, ``host:N`` or ``host`` per line; ``#`` starts a comment.

    ``max_slots=``/``max-slots=`` are accepted and ignored (Open MPI syntax). Raise ``ValueError``
    naming the file and line for anything else, for an unreadable file and for a file without hosts.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read host file {path!r}: {exc.strerror or exc}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}:{number}: malformed line {text!r}"
        fields = text.split()
        first, options = fields[0], fields[1:]
        if ":" in first:
            if first.count(":") > 1:
                raise ValueError(f"{where}: expected one ':' between host and slots; {_HOSTFILE_FORM}")
            host, _, slots_text = first.partition(":")
            slots = _parse_slots(slots_text, where, _HOSTFILE_FORM)
        else:
            host, slots = first, None
        _check_host(host, where, _HOSTFILE_FORM)
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("slots", "max_slots", "max-slots"):
                raise ValueError(f"{where}: unexpected {option!r}; {_HOSTFILE_FORM}")
            if key == "slots":
                if slots is not None:
                    raise ValueError(f"{where}: slots given twice; {_HOSTFILE_FORM}")
                slots = _parse_slots(value, where, _HOSTFILE_FORM)
            else:
                _parse_slots(value, where, _HOSTFILE_FORM)
        pairs.append((host, 1 if slots is None else slots))
    if not pairs:
        raise ValueError(f"host file {path!r} lists no hosts; {_HOSTFILE_FORM}")
    return _merge(pairs)


def format_hosts(hosts: Iterable[HostSlots]) -> str:
    """Return the ``a:2,b:2`` form of ``hosts`` (what mpirun's ``--host`` takes)."""
    return ",".join(str(h) for h in hosts)


def total_slots(hosts: Iterable[HostSlots]) -> int:
    """Return the number of slots over all ``hosts``."""
    return sum(h.slots for h in hosts)


def is_loopback(host: str) -> bool:
    """Return whether ``host`` is ``localhost`` or a loopback address (always usable, never looked up)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unresolvable_hosts(hosts: Iterable[str], timeout_s: float = 10.0) -> list[tuple[str, str]]:
    """Return ``(host, reason)`` for each host name that does not resolve within ``timeout_s``.

    Loopback names are skipped. Look-ups run in parallel on daemon threads, so a hanging resolver
    costs at most ``timeout_s`` and never blocks interpreter exit.
    """
    names = [h for h in dict.fromkeys(hosts) if not is_loopback(h)]
    outcome: dict[str, str | None] = {}

    def look_up(name: str) -> None:
        try:
            socket.getaddrinfo(name, None)
            outcome[name] = None
        except (OSError, UnicodeError) as exc:
            outcome[name] = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__

    threads = [in_thread(look_up, (name,), name=f"perseusrun-resolve-{name}") for name in names]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    bad = []
    for name in names:
        if name not in outcome:
            bad.append((name, f"no answer within {timeout_s:g} s"))
        elif outcome[name] is not None:
            bad.append((name, outcome[name]))
    return bad


def is_local(host: str) -> bool:
    """Return whether ``host`` names this machine: a loopback name or address, this machine's host name,
    or a name whose address belongs to one of this machine's interfaces (it can be bound here).

    MPI starts processes on such a host directly; on any other host it logs in with ssh.
    """
    if is_loopback(host):
        return True
    own = socket.gethostname().lower()
    if host.lower() in (own, own.split(".")[0]):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))  # fails with EADDRNOTAVAIL unless the address is ours
            return True
        except OSError:
            continue
    return False


def remote_hosts(hosts: Iterable[str], timeout_s: float = 10.0) -> list[str]:
    """Return the hosts of ``hosts`` that are not this machine (see :func:`is_local`), in order.

    The checks run in parallel on daemon threads; a host whose check does not finish within
    ``timeout_s`` counts as remote.
    """
    names = list(dict.fromkeys(hosts))
    local: dict[str, bool] = {}

    def check(name: str) -> None:
        local[name] = is_local(name)

    threads = [in_thread(check, (name,), name=f"perseusrun-local-{name}", silent=True) for name in names]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [name for name in names if not local.get(name, False)]


def ssh_command(host: str, port: int | None = None, identity_file: str | None = None,
                connect_timeout_s: float = 5.0) -> list[str]:
    """Return the command that checks a non-interactive ssh login to ``host`` (it runs ``true`` there)."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(connect_timeout_s))}"]
    if port:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file]
    return argv + [host, "true"]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def ssh_failures(hosts: Sequence[str], port: int | None = None, identity_file: str | None = None,
                 timeout_s: float = 10.0) -> list[tuple[str, str]]:
    """Log in to each of ``hosts`` with ssh, as MPI will, and return ``(host, reason)`` for each failure.

    The logins run in parallel, never prompt (``BatchMode``), and each gets at most ``timeout_s``
    seconds (the TCP connection at most 5 of them); one still running then is killed and reported.
    """
    names = list(dict.fromkeys(hosts))
    outcome: dict[str, str | None] = {}
    deadline = time.monotonic() + timeout_s

    def attempt(name: str) -> None:
        argv = ssh_command(name, port, identity_file, min(5.0, timeout_s))
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, errors="replace")
        except OSError as exc:
            outcome[name] = f"cannot run ssh: {exc.strerror or exc}"
            return
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            outcome[name] = f"no answer within {timeout_s:g} s"
            return
        if proc.returncode == 0:
            outcome[name] = None
        else:
            outcome[name] = _last_line(err) or f"ssh exited with status {proc.returncode}"

    threads = [in_thread(attempt, (name,), name=f"perseusrun-ssh-{name}") for name in names]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 2.0)
    bad = []
    for name in names:
        reason = outcome.get(name, f"no answer within {timeout_s:g} s")
        if reason is not None:
            bad.append((name, reason))
    return bad
