"""What :func:`perseus.spark.run` and :func:`perseus.spark.run_elastic` share: the active SparkContext, the
driver's address, the timeouts, and :class:`JobSession`, which holds a job's Spark tasks and ends them."""

from __future__ import annotations

import functools
import secrets
import socket
from typing import Any, Optional, Sequence

from perseus.base.knobs import read_knob
from perseus.runner.run_func import RunError, _interface_address
from perseus.spark.driver import Registry, SparkJob
from perseus.spark.task import TaskConfig, run_task

__all__ = ["active_context", "driver_address", "nic_list", "seconds", "payload", "JobSession"]

# After the tasks are told the job is over: how long they may take to return before their group is cancelled.
_END_WAIT_S = 20.0
_END_WAIT_FAILED_S = 5.0


def active_context(what: str):
    """The active SparkContext.

    Raises:
        ImportError: pyspark is not installed.
        RuntimeError: no SparkContext is active (no SparkSession was created).
    """
    try:
        import pyspark
    except ImportError as exc:
        raise ImportError(f"{what} needs pyspark ('pip install pyspark'; Java 17 or later to run it)") from exc
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(f"{what}: no active SparkContext; create a SparkSession (or SparkContext) first")
    return sc


def nic_list(nics: Any) -> list[str]:
    """The network interfaces as a sorted list: ``nics`` may be None, a comma-separated string or a collection."""
    if not nics:
        return []
    if isinstance(nics, str):
        return sorted(n for n in nics.split(",") if n)
    return sorted(str(n) for n in nics)


def driver_address(sc, nics: Sequence[str], what: str) -> str:
    """The address of this process that Spark's executors can reach: 127.0.0.1 under a local master, else that
    of the first of ``nics`` when given, else that of ``spark.driver.host`` (this machine's name by default).

    Raises:
        ValueError: a named interface has no IPv4 address, or the driver's host name does not resolve.
    """
    if str(sc.master).startswith("local"):
        return "127.0.0.1"
    if nics:
        found = _interface_address(nics[0])
        if not found:
            raise ValueError(f"{what}: the network interface {nics[0]!r} has no IPv4 address on this machine")
        return found
    host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"{what}: the driver's host name {host!r} (spark.driver.host) does not resolve ({exc}); "
                         f"set spark.driver.host to an address the executors reach, or pass nics=") from None


def seconds(value: Optional[float], knob_name: str, argument: str, what: str) -> float:
    """``value``, or the knob's when None (its environment variable, else its default).

    Raises:
        ValueError: the value is not a positive number.
    """
    result = float(read_knob(knob_name)[0] if value is None else value)
    if not result > 0:
        raise ValueError(f"{what}: {argument} must be a positive number of seconds, got {value!r}")
    return result


def payload(fn, args, kwargs, what: str) -> bytes:
    """The cloudpickled ``(fn, args, kwargs)`` the ranks run.

    Raises:
        RunError: something cannot be pickled.
    """
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, tuple(args or ()), dict(kwargs or {})))
    except Exception as exc:  # noqa: BLE001 - anything cloudpickle raises
        raise RunError(f"{what}: the function or its arguments cannot be pickled: {exc}") from exc


class JobSession:
    """A context manager holding ``num_tasks`` Spark tasks (see :mod:`perseus.spark.driver`) for one job.

    On entry the registry listens on ``address`` and the Spark job starts; on exit every task is told the job is
    over and the Spark job is let end, its group cancelled when it does not end in time or when the block
    raised (at once when the job never formed: ``formed`` False). ``token``: the job's secret (the tasks'
    services take it too).

    Raises:
        RunError: the registry cannot listen on ``address``.
    """

    def __init__(self, sc, address: str, num_tasks: int, barrier: bool, what: str):
        self.sc, self.address, self.num_tasks, self.barrier, self.what = sc, address, num_tasks, barrier, what
        self.token = secrets.token_hex(16)
        self.formed = False
        self.registry: Optional[Registry] = None
        self.job: Optional[SparkJob] = None

    def __enter__(self) -> "JobSession":
        try:
            self.registry = Registry(self.address, self.token)
        except OSError as exc:
            raise RunError(f"{self.what}: cannot listen for the Spark tasks on {self.address} ({exc}); set "
                           f"spark.driver.host to this machine's address, or pass nics=") from None
        mapper = functools.partial(run_task, TaskConfig(self.registry.address, self.token, self.barrier))
        try:
            self.job = SparkJob(self.sc, self.num_tasks, mapper, self.barrier, f"{self.what} ({self.num_tasks} tasks)")
        except BaseException:
            self.registry.end()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.registry.end()
        failed = exc_type is not None
        wait = 0.0 if failed and not self.formed else (_END_WAIT_FAILED_S if failed else _END_WAIT_S)
        if not self.job.finish(wait, cancel=wait == 0.0) and not failed:
            raise RunError(f"{self.what}: the Spark job of the tasks ({self.job.group}) did not end within "
                           f"{wait + 30:g} s after it was cancelled")
