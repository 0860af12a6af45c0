"""``perseus.run``: run a Python function on every process of a new job and return each rank's result.

The calling process serves the function and collects the results over one TCP connection per rank; the
ranks are started by :mod:`perseus.runner.launch` (perseusrun, hence mpirun and ssh for remote hosts) with
``python -m perseus.runner.run_task <address> <port>``. Each rank connects, proves it belongs to this job
(a random token passed in its environment), receives the cloudpickled ``(func, args, kwargs)``, runs it and
sends back its cloudpickled return value, or its exception and traceback. Nothing here imports the engine:
the function calls ``hvd.init()`` itself, as in a script.

Frames on the connection (:mod:`perseus.runner.run_frames`): 8-byte big-endian length, then the bytes.
Worker -> caller: the token, then (after running) a pickled ``(rank, ok, value_or_error_text,
exception_or_None)``, after any number of ``("log", value)`` (values rank 0 logs for the caller's callbacks); caller -> worker: the payload.
"""

from __future__ import annotations

import fcntl
import pickle
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Optional

from perseus.common.knobs import read_knob
from perseus.runner import hosts as hostlib
from perseus.runner import launch
from perseus.runner.handshake import HelloServer, Refused
from perseus.runner.run_frames import TOKEN_ENV, recv_frame, send_frame

__all__ = ["run", "RunError"]


class RunError(RuntimeError):
    """perseus.run(): some rank failed, or the job ended without every rank's result."""


def _address_towards(hosts: list[str], interface: Optional[str]) -> str:
    """The address of this machine that the ranks can reach: 127.0.0.1 for local jobs; else that of
    ``interface`` when given, else the source address the kernel picks to reach the first remote host."""
    remote = [h for h in hosts if not hostlib.is_local(h)]
    if not remote:
        return "127.0.0.1"
    if interface:
        addr = _interface_address(interface.split(",")[0])
        if addr:
            return addr
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
        self.results: dict[int, tuple] = {}
        self.arrival: list[int] = []  # ranks in the order their replies came
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
                with self._lock:
                    self.results[int(reply[0])] = tuple(reply[1:])
                    self.arrival.append(int(reply[0]))
        except (OSError, ConnectionError, EOFError, ValueError) as exc:
            with self._lock:
                self.problems.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be unpickled here
            with self._lock:
                self.problems.append(f"a result could not be read: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._server.close()


def run(func: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None, num_proc: Optional[int] = None,
        *, hosts: Optional[str] = None, hostfile: Optional[str] = None, start_timeout: Optional[int] = None,
        ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None,
        output_filename: Optional[str] = None, verbose: Optional[int] = None, mpi_args: Optional[str] = None,
        network_interfaces: Optional[list] = None, executable: Optional[str] = None) -> list:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` processes (see :func:`perseus.runner.run`).

    Returns the return values in rank order. Raises :class:`RunError` naming the ranks that failed (with the
    first failure's traceback; the original exception is chained when it could be transported), or that
    ended without a result (crashed, killed, or the job could not start: perseusrun's error is printed);
    ValueError for a malformed ``hosts``/``hostfile``, before anything starts.
    """
    import cloudpickle  # only perseus.run's caller needs it (14 ms to import)

    kwargs = dict(kwargs or {})
    num_proc = int(num_proc or 1)
    try:
        payload = cloudpickle.dumps((func, tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001 - anything cloudpickle raises
        raise RunError(f"perseus.run: the function or its arguments cannot be pickled: {exc}") from exc
    nics = ",".join(network_interfaces or [])
    host_names = _host_names(hosts, hostfile)
    address = _address_towards(host_names, nics or str(read_knob("network_interface")[0]))
    token = secrets.token_hex(16)
    try:
        server = _Server(address, payload, token, num_proc)  # where the ranks connect, not every interface
    except OSError as exc:
        raise RunError(f"perseus.run: cannot listen for the ranks on {address} ({exc}); pass "
                       "network_interface= naming the interface that connects the hosts") from None
    argv = ["-np", str(num_proc)]
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
    try:
        code = launch.main(argv, env_extra={TOKEN_ENV: token})  # forwarded to every rank
    finally:
        server.close()
    server.settle()
    return _collect(server, num_proc, code)


def _host_names(hosts: Optional[str], hostfile: Optional[str]) -> list[str]:
    """The host names of ``hosts`` (``"node1:4,node2:4"``) or ``hostfile``; ``["localhost"]`` when neither is
    given.

    Raises:
        ValueError: both are given, or the list or file is malformed, empty or unreadable (the message names
            the entry or line and the expected form).
    """
    if hosts and hostfile:
        raise ValueError("perseus.run: hosts and hostfile were both given; use one of them")
    try:
        if hosts:
            return [h.host for h in hostlib.parse_hosts(hosts)]
        if hostfile:
            return [h.host for h in hostlib.parse_hostfile(hostfile)]
    except ValueError as exc:
        raise ValueError(f"perseus.run: {exc}") from None
    return ["localhost"]


def _collect(server: _Server, num_proc: int, code: int, what: str = "perseus.run") -> list:
    results = dict(server.results)
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
