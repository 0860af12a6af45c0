"""The driver's side of a :mod:`perseus.spark` job: the Spark job that holds the tasks, and the registry they
report to.

:class:`SparkJob` runs ``num_tasks`` Spark tasks (:func:`perseus.spark.task.run_task`) in a job group of its
own, on a background thread: one stage of ``num_tasks`` partitions, in barrier mode for a fixed-size job (Spark
starts all of them at once or none) and in ordinary mode for an elastic one (a task that fails leaves the
others running). :class:`Registry` listens for the tasks (token-authenticated), keeps each live task's
:class:`TaskInfo`, notices a task whose connection drops (it ended or died), and tells them all when the job is
over. :func:`machines` groups tasks into MPI nodes, one per machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import socket
import threading
import time
from typing import Callable, Optional, Sequence

from perseus.runner.handshake import HelloServer, Refused, same_secret
from perseus.runner.remote import job as remote_job
from perseus.runner.run_frames import recv_frame, send_frame
from perseus.runner.run_func import RunError

__all__ = ["TaskInfo", "Registry", "SparkJob", "Machine", "machines", "spark_error_text", "StartError"]

_job_ids = itertools.count()


class StartError(RunError):
    """The job's Spark tasks did not all start (the message says how many did, which are missing, and why)."""


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """A registered Spark task: its partition, attempt, machine (host name, address), service and process."""

    index: int
    attempt: int
    hostname: str
    ip: str
    service: str
    pid: int

    def where(self) -> str:
        return f"Spark task {self.index} on {self.hostname} ({self.ip})"


@dataclasses.dataclass(frozen=True)
class Machine:
    """One MPI node: its name in the job and its tasks (partition order; the first one's service starts the
    daemon, whose ranks are as many as the tasks)."""

    name: str
    tasks: tuple

    @property
    def service(self) -> str:
        return self.tasks[0].service

    @property
    def address(self) -> str:
        return self.tasks[0].ip

    def where(self) -> str:
        first = self.tasks[0]
        indexes = ", ".join(str(t.index) for t in self.tasks)
        return f"{self.name} = {first.hostname} ({first.ip}), Spark task{'s' if len(self.tasks) > 1 else ''} {indexes}"


def machines(tasks: Sequence[TaskInfo], names: Optional[dict] = None) -> list[Machine]:
    """Group ``tasks`` by machine (host name and address): the machine of the lowest partition first, then in
    the order of each machine's lowest partition. ``names`` (machine key -> node name) keeps names stable
    across calls (an elastic job's); new machines get the next free ``perseus-node-<i>`` and are added to it."""
    names = {} if names is None else names
    grouped: dict[tuple, list[TaskInfo]] = {}
    for t in sorted(tasks, key=lambda t: t.index):
        grouped.setdefault((t.hostname, t.ip), []).append(t)
    out = []
    for key, members in grouped.items():
        if key not in names:
            names[key] = remote_job.node_name(len(names))
        out.append(Machine(names[key], tuple(members)))
    return out


def spark_error_text(exc: BaseException, lines: int = 12) -> str:
    """A short account of a Spark job's failure: the Java exception's own line(s) for a Py4J error (not its
    stack), the last lines of a Python error."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            text = str(java.toString())
            cause = java.getCause()
            while cause is not None:
                text += f"\n  caused by {cause.toString()}"
                cause = cause.getCause()
            return _tail(text, lines)
        except Exception:  # noqa: BLE001 - the JVM gateway is gone: fall back to the Python text
            pass
    return _tail(f"{type(exc).__name__}: {exc}", lines)


def _tail(text: str, lines: int) -> str:
    kept = [line for line in str(text).strip().splitlines() if line.strip() and not line.lstrip().startswith("at ")]
    return "\n".join(kept[:3] + (["  ..."] if len(kept) > lines else []) + kept[3:][-(lines - 3):])


class Registry:
    """Listens on ``address`` for the job's tasks (see :mod:`perseus.spark.task`); keeps the live ones.

    Raises:
        OSError: ``address`` cannot be listened on.
    """

    def __init__(self, address: str, token: str):
        self.token = token
        self.tasks: dict[int, TaskInfo] = {}       # by partition: the live tasks
        self.lost: list[TaskInfo] = []             # tasks whose connection dropped before the job ended them
        self._conns: dict[int, socket.socket] = {}
        self._ended = False
        self._cond = threading.Condition()
        self._server = HelloServer([address], self._check, self._serve, name="perseus-spark-registry",
                                   hello_limit=max(256, 2 * len(token)), deadline_s=30.0)
        self.address = f"{address}:{self._server.port}"

    def _check(self, body: bytes) -> None:
        if not same_secret(body.decode(errors="replace"), self.token):
            raise Refused("a connection without the job's token")

    def _serve(self, conn: socket.socket, _hello) -> None:
        try:
            conn.settimeout(30.0)
            raw = json.loads(recv_frame(conn, limit=1 << 16))
            info = TaskInfo(int(raw["index"]), int(raw["attempt"]), str(raw["hostname"]), str(raw["ip"]),
                            str(raw["service"]), int(raw["pid"]))
            conn.settimeout(None)
        except (OSError, ConnectionError, ValueError, KeyError, TypeError):
            conn.close()
            return
        with self._cond:
            if self._ended:
                conn.close()
                return
            self.tasks[info.index] = info
            self._conns[info.index] = conn
            self._cond.notify_all()
        try:
            while recv_frame(conn, limit=64):  # a task sends nothing more: this returns when it ends
                pass
        except (OSError, ConnectionError, ValueError):
            pass
        with self._cond:
            if self._conns.get(info.index) is conn:
                del self._conns[info.index]
                del self.tasks[info.index]
                if not self._ended:
                    self.lost.append(info)
                self._cond.notify_all()

    def live(self) -> list[TaskInfo]:
        """The tasks registered and still connected, in partition order."""
        with self._cond:
            return [self.tasks[i] for i in sorted(self.tasks)]

    def wait_for(self, count: int, timeout: float, job: "SparkJob", what: str, strict: bool = True) -> list[TaskInfo]:
        """Wait until ``count`` tasks are registered; return them in partition order.

        Raises:
            StartError: the Spark job failed first (Spark's error is in the message), a task ended first (only
                when ``strict``), or ``timeout`` seconds passed (the message names the tasks missing and the
                likely reason).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.tasks) < count:
                if job.error is not None:
                    raise StartError(f"{what}: the Spark job failed before its {count} task(s) needed started "
                                     f"({len(self.tasks)} registered). {job.slots_hint()}")
                if strict and self.lost:
                    raise StartError(f"{what}: {self.lost[0].where()} ended before the job started")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [i for i in range(job.num_tasks) if i not in self.tasks]
                    raise StartError(
                        f"{what}: only {len(self.tasks)} of the {count} Spark task(s) needed started within "
                        f"start_timeout={timeout:g} s (missing: task(s) {', '.join(map(str, missing[:16]))}). "
                        f"{job.slots_hint()}")
                self._cond.wait(min(left, 0.25))
            return [self.tasks[i] for i in sorted(self.tasks)]

    def end(self) -> None:
        """Tell every task the job is over (they close their services and return) and stop listening."""
        with self._cond:
            self._ended = True
            conns, self._conns = list(self._conns.values()), {}
        self._server.close()
        for conn in conns:
            try:
                send_frame(conn, b"end")
            except OSError:
                pass
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class SparkJob:
    """``num_tasks`` Spark tasks running ``mapper`` in a job group of their own, on a background thread.

    ``error``: the Spark job's exception once it failed; ``done``: whether it ended.
    """

    def __init__(self, sc, num_tasks: int, mapper: Callable, barrier: bool, description: str):
        self.sc, self.num_tasks, self.barrier = sc, num_tasks, barrier
        self.group = f"perseus.spark.{next(_job_ids)}.{id(self):x}"
        self.error: Optional[BaseException] = None
        self.result: Optional[list] = None
        self._mapper, self._description = mapper, description
        from pyspark import InheritableThread

        self._thread = InheritableThread(target=self._run, name="perseus-spark-job", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.sc.setJobGroup(self.group, self._description, interruptOnCancel=True)
            rdd = self.sc.parallelize(range(self.num_tasks), self.num_tasks)
            if self.barrier:
                rdd = rdd.barrier()
            self.result = rdd.mapPartitions(self._mapper).collect()
        except BaseException as exc:  # noqa: BLE001 - kept for the driver, which raises it in its own words
            self.error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the Spark job to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def slots_hint(self) -> str:
        """Why tasks may be missing, with what Spark says about its slots, and Spark's error if it failed."""
        parallelism = getattr(self.sc, "defaultParallelism", "?")
        text = (f"The job's {self.num_tasks} Spark task(s) must run at once{' (barrier mode)' if self.barrier else ''}"
                f"; Spark's default parallelism is {parallelism}. Give the cluster more executor cores, lower "
                f"num_proc, or raise start_timeout if executors are acquired on demand.")
        if self.error is not None:
            text += f"\nSpark's error:\n{spark_error_text(self.error)}"
        return text

    def finish(self, wait_s: float, cancel: bool) -> bool:
        """Let the job end (its tasks were told to), cancelling its group when ``cancel`` or when it is still
        running after ``wait_s`` seconds; returns whether it ended (within another 30 s after a cancel)."""
        if not cancel:
            self._thread.join(wait_s)
        if self._thread.is_alive():
            try:
                self.sc.cancelJobGroup(self.group)
            except Exception:  # noqa: BLE001 - the context already stopped: nothing left to cancel
                pass
            self._thread.join(30.0)
        return not self._thread.is_alive()
