"""``perseus.spark.run``: run a function on ``num_proc`` ranks held by Spark tasks (Horovod's
``horovod.spark.run``).

The driver (this process) starts ``num_proc`` Spark tasks in barrier mode (:mod:`perseus.spark.driver`),
waits for all of them to register, groups them by machine (one MPI node per machine, as many slots as tasks
there), and starts ``mpirun`` here, whose daemons start through one task's service per machine
(:mod:`perseus.runner.remote`). Each rank is ``python -m perseus.runner.run_task``: it fetches the function
from this process, runs it and sends its value back (as under :func:`perseus.run`). When ``mpirun`` has ended
the tasks are told to return, and the Spark job ends.
"""

from __future__ import annotations

import codecs
import io
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from perseus.base import horovod_alias
from perseus.runner.remote import job as remote_job
from perseus.runner.remote.agent import write_job_file
from perseus.runner.run_frames import TOKEN_ENV as RUN_TOKEN_ENV
from perseus.runner.run_func import RunError, _collect, _Server
from perseus.runner.remote.service import end_session
from perseus.spark.driver import Machine, machines, spark_error_text
from perseus.spark.session import JobSession, active_context, driver_address, nic_list, payload, seconds

__all__ = ["run"]

_WHAT = "perseus.spark.run"
# A task lost while mpirun runs: how long mpirun may take to end on its own before it is ended.
_LOST_GRACE_S = 30.0
# After mpirun ended: how long the ranks' replies may take to be read (and unpickled) here.
_REPLY_WAIT_S = 60.0
# A task was lost: how long to wait for Spark's own account of it (the stage's failure).
_SPARK_ERROR_WAIT_S = 10.0


def run(fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None, num_proc: Optional[int] = None,
        start_timeout: Optional[float] = None, use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args=None, env: Optional[dict] = None, stdout=None, stderr=None, verbose: int = 1,
        nics=None, prefix_output_with_timestamp: bool = False, executable: Optional[str] = None) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks, each held by a Spark task; return the values in rank
    order.

    Every rank runs ``fn``, which calls ``hvd.init()`` itself. ``num_proc``: default Spark's default parallelism.
    ``start_timeout``: seconds for all the tasks to start and register (default ``PERSEUS_SPARK_START_TIMEOUT``
    or ``HOROVOD_SPARK_START_TIMEOUT``, else 600). ``extra_mpi_args``: further ``mpirun`` options (a string,
    or a list of words).
    ``env``: variables for the ranks. ``stdout``/``stderr``: file objects that get the job's output (default
    this process's). ``verbose`` >= 2 prints the ``mpirun`` command. ``nics``: network interfaces for MPI and
    perseus. ``prefix_output_with_timestamp``: stamp every output line. ``executable``: the ranks' Python
    (default this one). ``use_mpi``/``use_gloo`` are accepted: perseus always starts the job with Open MPI.

    Ranks are numbered machine by machine, the machine of Spark's partition 0 first.

    Raises:
        perseus.runner.run_func.RunError: ``fn`` raised on some rank (the message names it, its node and host,
            with its traceback), a rank or task ended without a result, or the tasks did not all start within
            ``start_timeout`` or Spark could not run them (its error is included).
        RuntimeError: no active SparkContext.
        ValueError: ``num_proc`` below 1, a ``start_timeout`` that is not a positive number, a network interface
            without an address, or a driver host name that does not resolve.
        ImportError: pyspark is missing.
        NotImplementedError: the MPI found is not Open MPI.
    """
    sc = active_context(_WHAT)
    num_proc = int(num_proc or sc.defaultParallelism)
    if num_proc < 1:
        raise ValueError(f"{_WHAT}: num_proc must be at least 1, got {num_proc}")
    timeout = seconds(start_timeout, "spark_start_timeout", "start_timeout", _WHAT)
    body = payload(fn, args, kwargs, _WHAT)
    nics = nic_list(nics)
    address = driver_address(sc, nics, _WHAT)
    options = dict(extra_mpi_args=extra_mpi_args, env=env, stdout=stdout, stderr=stderr, verbose=verbose, nics=nics,
                   timestamp=prefix_output_with_timestamp, executable=executable or sys.executable)
    with JobSession(sc, address, num_proc, barrier=True, what=_WHAT) as session:
        tasks = session.registry.wait_for(num_proc, timeout, session.job, _WHAT)
        session.formed = True
        return _run_job(session, machines(tasks), body, options)


def _run_job(session: JobSession, nodes: list[Machine], body: bytes, options: dict) -> list:
    """Start ``mpirun`` over ``nodes``, relay its output, wait for it, collect the ranks' values.

    Raises:
        RunError: some rank failed or returned nothing (its node named); see :func:`run`.
    """
    num_proc = sum(len(m.tasks) for m in nodes)
    run_token = secrets.token_hex(16)
    server = _Server(session.address, body, run_token, num_proc)
    job_file = remote_job.job_file_path(run_token[:12])
    proc: Optional[subprocess.Popen] = None
    try:
        write_job_file(job_file, session.token, {m.name: m.service for m in nodes})
        rank_env = {str(k): str(v) for k, v in dict(options["env"] or {}).items()}
        rank_env[RUN_TOKEN_ENV] = run_token
        rank_env.update(horovod_alias.env())  # the ranks resolve horovod.* as this process does
        if options["nics"]:
            rank_env["PERSEUS_NETWORK_INTERFACE"] = ",".join(options["nics"])
        command = [options["executable"], "-m", "perseus.runner.run_task", session.address, str(server.port)]
        extra = options["extra_mpi_args"] or ""
        plan = remote_job.plan([remote_job.Node(m.name, m.service, len(m.tasks)) for m in nodes], command, job_file,
                               env=rank_env, nics=options["nics"],
                               mpi_args=shlex.split(extra) if isinstance(extra, str) else [str(a) for a in extra],
                               timestamp=bool(options["timestamp"]))
        pipes = {k: subprocess.PIPE for k in ("stdout", "stderr") if options[k] is not None}
        proc = remote_job.start(plan, verbose=int(options["verbose"] or 0) >= 2, stdin=subprocess.DEVNULL, **pipes)
        relays = [threading.Thread(target=_relay, args=(getattr(proc, k), options[k]), daemon=True,
                                   name=f"perseus-spark-{k}") for k in pipes]
        for t in relays:
            t.start()
        code = _wait(proc, session)
        for t in relays:
            t.join(10.0)
    finally:
        if proc is not None and proc.poll() is None:
            end_session(proc, 5.0)
        server.close()
        try:
            os.unlink(job_file)
        except OSError:
            pass
    server.settle(_REPLY_WAIT_S)
    try:
        return _collect(server, num_proc, code)
    except RunError as err:
        raise RunError(_explain(str(err), nodes, session)) from err.__cause__


def _wait(proc: subprocess.Popen, session: JobSession) -> int:
    """``mpirun``'s exit status; it is ended when a task was lost or the Spark job failed and it does not end
    on its own within a grace period (its daemon there is gone, so its ranks are)."""
    trouble_since: Optional[float] = None
    while True:
        try:
            return proc.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
        if trouble_since is None and (session.registry.lost or session.job.error is not None):
            trouble_since = time.monotonic()
        if trouble_since is not None and time.monotonic() - trouble_since > _LOST_GRACE_S:
            end_session(proc, 5.0)
            return proc.wait()


def _relay(pipe, target) -> None:
    """Copy a pipe of ``mpirun`` to ``target`` (a text or binary file object) until end of file."""
    binary = isinstance(target, (io.RawIOBase, io.BufferedIOBase)) or "b" in str(getattr(target, "mode", ""))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = pipe.fileno()
    broken = False
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        if broken:
            continue  # keep draining: mpirun must never block on a full pipe
        try:
            target.write(data if binary else decoder.decode(data))
            if hasattr(target, "flush"):
                target.flush()
        except (OSError, ValueError, TypeError):
            broken = True
    pipe.close()


def _explain(text: str, nodes: Sequence[Machine], session: JobSession) -> str:
    """``_collect``'s message in this API's words: the failing rank's node named, where every rank ran, and any
    Spark task lost or Spark error."""
    ranks: list[Machine] = [m for m in nodes for _ in m.tasks]

    def node_of(match: re.Match) -> str:
        rank = int(match.group(1))
        return f"rank {rank} (on {ranks[rank].where()}) raised" if rank < len(ranks) else match.group(0)

    text = re.sub(r"\brank (\d+) raised", node_of, text.replace("perseus.run:", f"{_WHAT}:", 1), count=1)
    first = 0
    lines = []
    for m in nodes:
        span = f"{first}" if len(m.tasks) == 1 else f"{first}-{first + len(m.tasks) - 1}"
        lines.append(f"ranks {span} on {m.where()}")
        first += len(m.tasks)
    text += "\n(" + "; ".join(lines) + ")"
    for t in session.registry.lost:
        text += f"\n{t.where()} ended while the job ran (its executor or Python worker died?)"
    if session.registry.lost:
        session.job.wait(_SPARK_ERROR_WAIT_S)  # Spark fails the stage of a lost barrier task soon: say why
    if session.job.error is not None:
        text += f"\nSpark's error:\n{spark_error_text(session.job.error)}"
    return text
