"""``perseus.run``: run a Python function on every process of a new job and return each rank's result.

The calling process serves the function and collects the results over one TCP connection per rank; the
ranks are started by :mod:`perseus.runner.launch` (perseusrun, hence mpirun and ssh for remote hosts) with
``python -m perseus.runner.run_task <address> <port>``. Each rank connects, proves it belongs to this job
(a random token passed in its environment), receives the cloudpickled ``(func, args, kwargs)``, runs it and
sends back its cloudpickled return value, or its exception and traceback. Nothing here imports the engine:
the function calls ``hvd.init()`` itself, as in a script.

Frames on the connection (:mod:`perseus.runner.run_frames`): 8-byte big-endian length, then the bytes.
Worker -> caller: the token, then (after running) a pickled ``(rank, ok, value_or_error_text,
exception_or_None, generation, size)``, after any number of ``("log", value)`` (values rank 0 logs for the
caller's callbacks); caller -> worker: the payload.

Elastic jobs (``min_np``, ``host_discovery_script``, ...) run under perseusrun's elastic driver: each generation's
ranks fetch the function again (they restore the last commit inside ``hvd.elastic.run``), ranks that leave for a
re-form send nothing, and the values returned are those of the generation that finished.
"""

from __future__ import annotations

import dataclasses
import fcntl
import pickle
import re
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Optional

from perseus.base.knobs import read_knob
from perseus.runner import hosts as hostlib
from perseus.runner import launch
from perseus.runner.elastic.discovery import DiscoveryError, HostDiscovery
from perseus.runner.elastic_flags import check_elastic_args
from perseus.runner.errors import LaunchError
from perseus.runner.handshake import HelloServer, Refused
from perseus.runner.run_frames import TOKEN_ENV, recv_frame, send_frame

__all__ = ["run", "RunError", "Elastic"]


class RunError(RuntimeError):
    """perseus.run(): some rank failed, or the job ended without every rank's result."""


@dataclasses.dataclass(frozen=True)
class Elastic:
    """``perseus.run``'s elastic arguments (Horovod's names); all None: a fixed-size job."""

    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    slots: Optional[int] = None
    reset_limit: Optional[int] = None
    cooldown_range: Optional[tuple] = None

    def given(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def argv(self, num_proc: int) -> list[str]:
        """perseusrun's elastic flags for these arguments. ``-np`` is at least ``min_np``: Horovod's
        ``num_proc`` (default 1) is only the number of slots waited for at the start."""
        argv = ["-np", str(max(num_proc, int(self.min_np or 1)))]
        for flag, value in (("--min-np", self.min_np), ("--max-np", self.max_np), ("--slots-per-host", self.slots),
                            ("--reset-limit", self.reset_limit), ("--host-discovery-script", self.host_discovery_script)):
            if value is not None:
                argv += [flag, str(value)]
        if self.cooldown_range is not None:
            try:
                low, high = self.cooldown_range
            except (TypeError, ValueError):
                raise ValueError(f"perseus.run: cooldown_range takes (low, high) seconds, got "
                                 f"{self.cooldown_range!r}") from None
            argv += ["--blacklist-cooldown-range", str(low), str(high)]
        return argv


def _address_towards(hosts: list[str], interface: Optional[str], may_grow: bool = False) -> str:
    """The address of this machine that the ranks can reach: 127.0.0.1 for local jobs (unless ``may_grow``, an
    elastic job whose later hosts are not known yet, and ``interface`` is given); else that of ``interface``
    when given, else the source address the kernel picks to reach the first remote host."""
    remote = [h for h in hosts if not hostlib.is_local(h)]
    if not remote and not (may_grow and interface):
        return "127.0.0.1"
    if interface:
        addr = _interface_address(interface.split(",")[0])
        if addr:
            return addr
    if not remote:
        return "127.0.0.1"
    try:
        target = socket.getaddrinfo(remote[0], None, socket.AF_INET)[0][4][0]
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((target, 9))  # UDP: no packet is sent; only the route is looked up
            return probe.getsockname()[0]
        finally:
            probe.close()
    except OSError as exc:
        raise RunError(f"perseus.run: cannot find this machine's address towards {remote[0]!r} ({exc}); "
                       "pass network_interface=") from None


def _interface_address(name: str) -> Optional[str]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


class _Server:
    """Serves the payload to ranks that present the token; keeps each rank's reply. Listens on ``bind`` only
    (the address the ranks are told). The token frame is read with a deadline on a thread of its own
    (:class:`perseus.runner.handshake.HelloServer`), so a client that sends nothing, a trickle, garbage or a
    huge length delays no rank and allocates nothing beyond the token's few bytes.

    Raises:
        OSError: ``bind`` cannot be bound.
    """

    def __init__(self, bind: str, payload: bytes, token: str, num_proc: int, hello_deadline_s: float = 30.0,
                 on_log=None):
        self.payload, self.token, self.num_proc, self.on_log = payload, token, num_proc, on_log
        self.results: dict[int, tuple] = {}  # rank -> (ok, value, error) of the newest generation that replied
        self.arrival: list[int] = []  # ranks in the order their replies came
        self.generation = -1  # the elastic generation of the replies in results (0 outside elastic jobs)
        self.size: Optional[int] = None  # the ranks of that generation, as they said
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self._reading = 0  # connections whose reply is still being read
        self._server = HelloServer([bind], self._check, self._serve, name="perseus.run",
                                   hello_limit=max(256, 2 * len(token)), deadline_s=hello_deadline_s,
                                   backlog=max(128, num_proc))
        self.port = self._server.port
        self.counts = self._server.counts

    def _check(self, body: bytes) -> None:
        if not secrets.compare_digest(body, self.token.encode()):
            raise Refused("a connection without the job's token")

    def _serve(self, conn: socket.socket, _hello) -> None:
        with self._lock:
            self._reading += 1
        try:
            self._read_reply(conn)
        finally:
            with self._lock:
                self._reading -= 1

    def settle(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` s) until every rank connection accepted so far has been read to its end: a
        rank's reply may still be arriving, or being unpickled (a first torch tensor imports torch), when the
        job itself has already ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._reading == 0:
                    return
            time.sleep(0.02)

    def _read_reply(self, conn: socket.socket) -> None:
        try:
            with conn:
                send_frame(conn, self.payload)
                while True:
                    reply = pickle.loads(recv_frame(conn))  # the function may run for a long time: no timeout
                    if reply[0] != "log":
                        break
                    if self.on_log is not None:  # a value rank 0 logged (perseus.ray.ray_logger.log)
                        self.on_log(reply[1])
                self._keep(reply)
        except (OSError, ConnectionError, EOFError, ValueError) as exc:
            with self._lock:
                self.problems.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be unpickled here
            with self._lock:
                self.problems.append(f"a result could not be read: {type(exc).__name__}: {exc}")

    def _keep(self, reply: tuple) -> None:
        """Keep a rank's reply; a reply of a later elastic generation drops those of earlier ones (whose ranks
        left for a re-form), a reply of an earlier one is dropped."""
        rank, ok, value, error, generation, size = reply
        with self._lock:
            if generation < self.generation:
                return
            if generation > self.generation:
                self.results.clear()
                self.arrival.clear()
                self.generation = generation
            self.size = int(size)
            self.results[int(rank)] = (ok, value, error)
            self.arrival.append(int(rank))

    def close(self) -> None:
        self._server.close()


def run(func: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None, num_proc: Optional[int] = None,
        *, hosts: Optional[str] = None, hostfile: Optional[str] = None, start_timeout: Optional[int] = None,
        ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None,
        output_filename: Optional[str] = None, verbose: Optional[int] = None, mpi_args: Optional[str] = None,
        network_interfaces: Optional[list] = None, executable: Optional[str] = None,
        elastic: Optional[Elastic] = None) -> list:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` processes (see :func:`perseus.runner.run`); with
    ``elastic``, as an elastic job under perseusrun's elastic driver.

    Returns the return values in rank order (of an elastic job: its last generation's first ``min_np``, or
    ``num_proc`` without ``min_np``, as Horovod returns). Raises :class:`RunError` naming the ranks that failed
    (with the first failure's traceback; the original exception is chained when it could be transported), or
    that ended without a result (crashed, killed, or the job could not start: perseusrun's error is printed);
    ValueError for a malformed ``hosts``/``hostfile`` or elastic argument, before anything starts.
    """
    import cloudpickle  # only perseus.run's caller needs it (14 ms to import)

    kwargs = dict(kwargs or {})
    num_proc = int(num_proc or 1)
    try:
        payload = cloudpickle.dumps((func, tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001 - anything cloudpickle raises
        raise RunError(f"perseus.run: the function or its arguments cannot be pickled: {exc}") from exc
    nics = ",".join(network_interfaces or [])
    host_names = _host_names(hosts, hostfile, elastic.host_discovery_script if elastic else None)
    address = _address_towards(host_names, nics or str(read_knob("network_interface")[0]), may_grow=bool(elastic))
    token = secrets.token_hex(16)
    try:
        server = _Server(address, payload, token, num_proc)  # where the ranks connect, not every interface
    except OSError as exc:
        raise RunError(f"perseus.run: cannot listen for the ranks on {address} ({exc}); pass "
                       "network_interface= naming the interface that connects the hosts") from None
    argv = elastic.argv(num_proc) if elastic else ["-np", str(num_proc)]
    if hosts:
        argv += ["-H", hosts]
    if hostfile:
        argv += ["--hostfile", hostfile]
    if start_timeout:
        argv += ["--start-timeout", str(int(start_timeout))]
    if ssh_port:
        argv += ["--ssh-port", str(int(ssh_port))]
    if ssh_identity_file:
        argv += ["--ssh-identity-file", ssh_identity_file]
    if output_filename:
        argv += ["--output-filename", output_filename]
    if verbose:
        argv += ["--verbose"]
    if mpi_args:
        argv += ["--mpi-args", mpi_args]
    if nics:
        argv += ["--network-interfaces", nics]
    argv += [executable or sys.executable, "-m", "perseus.runner.run_task", address, str(server.port)]
    if elastic:
        try:  # what perseusrun would refuse is a ValueError here, before anything starts
            check_elastic_args(launch.parse_args(argv))
        except LaunchError as exc:
            server.close()
            raise ValueError(f"perseus.run: {_argument_names(str(exc))}") from None
    try:
        code = launch.main(argv, env_extra={TOKEN_ENV: token})  # forwarded to every rank
    finally:
        server.close()
    server.settle()
    values = _collect(server, num_proc, code)
    return values[:elastic.min_np or num_proc] if elastic else values


#: perseusrun's elastic flags as perseus.run's arguments, for messages
_ARGUMENTS = {"--min-np": "min_np", "--max-np": "max_np", "--slots-per-host": "slots", "--reset-limit": "reset_limit",
              "--host-discovery-script": "host_discovery_script", "--blacklist-cooldown-range": "cooldown_range",
              "-H/--hostfile": "hosts/hostfile", "-H/--hosts or --hostfile": "hosts/hostfile", "-np": "num_proc"}


def _argument_names(message: str) -> str:
    """A perseusrun message about elastic flags in perseus.run's words (``--min-np`` -> ``min_np``)."""
    pattern = "|".join(re.escape(k) for k in sorted(_ARGUMENTS, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({pattern})(?![\w-])", lambda m: _ARGUMENTS[m.group(1)], message)


def _host_names(hosts: Optional[str], hostfile: Optional[str], discovery_script: Optional[str] = None) -> list[str]:
    """The host names of ``hosts`` (``"node1:4,node2:4"``), ``hostfile`` or what ``discovery_script`` lists
    now; ``["localhost"]`` when none is given.

    Raises:
        ValueError: both lists are given, a list or file is malformed, empty or unreadable (the message names
            the entry or line and the expected form), or the discovery script fails.
    """
    if hosts and hostfile:
        raise ValueError("perseus.run: hosts and hostfile were both given; use one of them")
    try:
        if hosts:
            return [h.host for h in hostlib.parse_hosts(hosts)]
        if hostfile:
            return [h.host for h in hostlib.parse_hostfile(hostfile)]
        if discovery_script:
            return [h.host for h in HostDiscovery(discovery_script).run()] or ["localhost"]
    except (ValueError, DiscoveryError) as exc:
        raise ValueError(f"perseus.run: {exc}") from None
    return ["localhost"]


def _collect(server: _Server, num_proc: int, code: int, what: str = "perseus.run") -> list:
    """The values of ``server``'s newest generation in rank order (``num_proc`` ranks, unless they said how many
    they were), or :class:`RunError` naming the ranks that raised or returned nothing."""
    results = dict(server.results)
    num_proc = server.size or num_proc
    failed = sorted(r for r, (ok, _, _) in results.items() if not ok)
    missing = [r for r in range(num_proc) if r not in results]
    if not failed and not missing and code == 0:
        return [results[r][1] for r in range(num_proc)]
    parts = []
    first = next((r for r in server.arrival if r in failed), None)  # the earliest failure: likely the cause
    if failed:
        parts.append(f"rank {first} raised" + (f" first (ranks {', '.join(map(str, failed))} raised)"
                                               if len(failed) > 1 else ""))
    if missing:
        parts.append(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} returned no result "
                     f"(the job exited with status {code}; see the output above)")
    elif code != 0:
        parts.append(f"the job exited with status {code}")
    message = f"{what}: " + "; ".join(parts)
    cause = None
    if failed:
        _, text, cause = results[first]
        message += f"\n--- rank {first} ---\n{text}"
    if server.problems:
        message += "\n(connection problems: " + "; ".join(sorted(set(server.problems))[:3]) + ")"
    raise RunError(message) from cause
