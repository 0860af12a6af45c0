"""``perseus.spark.run_elastic``: an elastic job on Spark tasks (Horovod's ``horovod.spark.run_elastic``).

The driver starts ``max_num_proc`` Spark tasks in an ordinary stage (not barrier mode: a task that fails leaves
the others running, and Spark may start it again), waits for ``min_num_proc`` of them to register, and runs
perseusrun's elastic driver here (:func:`perseus.runner.remote.elastic_job.run_elastic`) with the live tasks as
its discovery: one node per machine, as many slots as live tasks there, the daemons started through a live
task's service. The job re-forms when tasks are lost or join, as under perseusrun.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from perseus.runner.remote.elastic_job import HostedNode
from perseus.runner.remote.elastic_job import run_elastic as run_elastic_job
from perseus.runner.run_func import RunError
from perseus.spark.driver import machines, spark_error_text
from perseus.spark.session import JobSession, active_context, driver_address, nic_list, seconds

__all__ = ["run_elastic"]

_WHAT = "perseus.spark.run_elastic"


def _sizes(sc, num_proc, min_num_proc, max_num_proc, min_np, max_np) -> tuple[int, int, int]:
    """``(num_proc, min, max)``: ``min_np``/``max_np`` are other names of ``min_num_proc``/``max_num_proc``;
    ``num_proc`` defaults to Spark's default parallelism (within the bounds), the bounds to ``num_proc``.

    Raises:
        ValueError: both spellings of a bound differ, or not ``1 <= min <= num_proc <= max``.
    """
    for a, b, name in ((min_np, min_num_proc, "min"), (max_np, max_num_proc, "max")):
        if a is not None and b is not None and int(a) != int(b):
            raise ValueError(f"{_WHAT}: {name}_np={a} and {name}_num_proc={b} differ; give one of them")
    low, high = (min_np if min_np is not None else min_num_proc), (max_np if max_np is not None else max_num_proc)
    wanted = int(num_proc or sc.defaultParallelism)
    low = int(low if low is not None else wanted)
    high = int(high if high is not None else wanted)
    num_proc = int(num_proc) if num_proc else max(low, min(wanted, high))  # the default fits the bounds
    if not 1 <= low <= num_proc <= high:
        raise ValueError(f"{_WHAT}: need 1 <= min_num_proc ({low}) <= num_proc ({num_proc}) <= max_num_proc ({high})")
    return num_proc, low, high


def run_elastic(fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
                start_timeout: Optional[float] = None, elastic_timeout: Optional[float] = None,
                reset_limit: Optional[int] = None, env: Optional[dict] = None, stdout=None, stderr=None,
                verbose: int = 1, nics=None, prefix_output_with_timestamp: bool = False,
                min_np: Optional[int] = None, max_np: Optional[int] = None) -> list:
    """Run ``fn(*args, **kwargs)`` elastically on Spark tasks; return the values of the last generation's ranks
    in rank order.

    Every rank runs ``fn``, which calls ``hvd.init()`` and uses ``hvd.elastic.run`` as under perseusrun.
    ``max_num_proc`` (default ``num_proc``, itself Spark's default parallelism) Spark tasks are started; the
    job starts with ``num_proc`` ranks once that many slots are there and runs on at least ``min_num_proc``
    (``min_np``/``max_np`` are accepted for the bounds too). ``start_timeout``: seconds for ``min_num_proc``
    tasks to register (default ``PERSEUS_SPARK_START_TIMEOUT``/``HOROVOD_SPARK_START_TIMEOUT``, else 600);
    ``elastic_timeout``: seconds the job waits for enough slots (default ``PERSEUS_SPARK_ELASTIC_TIMEOUT``/
    ``HOROVOD_ELASTIC_TIMEOUT``, else 600); ``reset_limit``: most re-forms. ``env``: variables for the ranks;
    ``nics``: network interfaces; ``verbose`` >= 2 prints each ``mpirun`` command. ``stdout``, ``stderr`` and
    ``prefix_output_with_timestamp`` are not supported here (a warning says so): the output goes to this
    process's own.

    Raises:
        perseus.runner.run_func.RunError: the job failed (a rank raised: its traceback is in the message; too
            few slots within ``elastic_timeout``; the reset limit was reached), or fewer than ``min_num_proc``
            tasks started within ``start_timeout`` (Spark's error included when it failed).
        ValueError: inconsistent sizes, a timeout that is not a positive number, a network interface without an
            address, or a driver host name that does not resolve.
        RuntimeError: no active SparkContext.
        NotImplementedError: the MPI found is not Open MPI.
    """
    sc = active_context(_WHAT)
    num_proc, low, high = _sizes(sc, num_proc, min_num_proc, max_num_proc, min_np, max_np)
    timeout = seconds(start_timeout, "spark_start_timeout", "start_timeout", _WHAT)
    wait_slots = seconds(elastic_timeout, "spark_elastic_timeout", "elastic_timeout", _WHAT)
    if stdout is not None or stderr is not None or prefix_output_with_timestamp:
        warnings.warn(f"{_WHAT}: stdout, stderr and prefix_output_with_timestamp are not supported for elastic jobs; "
                      f"the job's output goes to this process's own stdout and stderr", stacklevel=2)
    nics = nic_list(nics)
    address = driver_address(sc, nics, _WHAT)
    with JobSession(sc, address, high, barrier=False, what=_WHAT) as session:
        session.registry.wait_for(low, timeout, session.job, _WHAT, strict=False)
        session.formed = True
        names: dict = {}

        def nodes() -> list[HostedNode]:
            return [HostedNode(m.name, m.service, m.address, len(m.tasks))
                    for m in machines(session.registry.live(), names)]

        rank_env = {str(k): str(v) for k, v in dict(env or {}).items()}
        if nics:
            rank_env["PERSEUS_NETWORK_INTERFACE"] = ",".join(nics)
        try:
            return run_elastic_job(fn, tuple(args or ()), dict(kwargs or {}), nodes, service_token=session.token,
                                   driver_address=address, min_np=low, max_np=high, np_=num_proc,
                                   reset_limit=reset_limit, elastic_timeout=wait_slots, env=rank_env, nics=nics,
                                   verbose=int(verbose or 0) >= 2, what=_WHAT)
        except RunError as err:
            text = str(err).replace("perseus.run:", f"{_WHAT}:", 1)
            live = session.registry.live()
            text += "\n(Spark tasks still live: " + (", ".join(t.where() for t in live) or "none") + ")"
            for t in session.registry.lost:
                text += f"\n{t.where()} ended while the job ran"
            if session.job.error is not None:
                text += f"\nSpark's error:\n{spark_error_text(session.job.error)}"
            raise RunError(text) from err.__cause__
