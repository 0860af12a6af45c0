"""Where an estimator's training function runs (Horovod's ``horovod.spark.common.backend``).

:class:`SparkBackend` runs it with :func:`perseus.spark.run` on the Spark executors; a :class:`Backend` of your
own can run it elsewhere (the estimator only calls ``run`` and ``num_processes``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from perseus.spark.runner import run as spark_run
from perseus.spark.session import active_context

__all__ = ["Backend", "SparkBackend", "default_num_proc"]


def default_num_proc() -> int:
    """The active SparkContext's default parallelism.

    Raises:
        RuntimeError: no active SparkContext.
    """
    return int(active_context("perseus.spark.common.backend").defaultParallelism)


class Backend:
    """Runs an estimator's training function on ``num_processes()`` ranks."""

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None,
            env: Optional[dict] = None) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank (with ``env`` added to their environment); return each rank's
        value in rank order."""
        raise NotImplementedError("a Backend subclass implements run(fn, args, kwargs, env)")

    def num_processes(self) -> int:
        """How many ranks :meth:`run` starts."""
        raise NotImplementedError("a Backend subclass implements num_processes()")


class SparkBackend(Backend):
    """Runs the training function with :func:`perseus.spark.run` on ``num_proc`` Spark tasks.

    Args:
        num_proc: ranks (default: the active SparkContext's default parallelism).
        env: variables for every rank.
        **kwargs: passed on to :func:`perseus.spark.run` (``start_timeout``, ``stdout``, ``stderr``, ``verbose``,
            ``nics``, ``prefix_output_with_timestamp``, ``extra_mpi_args``...).

    Raises:
        RuntimeError: ``num_proc`` not given and no active SparkContext.
    """

    def __init__(self, num_proc: Optional[int] = None, env: Optional[dict] = None, **kwargs):
        self._num_proc = int(num_proc) if num_proc else default_num_proc()
        self._env = dict(env or {})
        self._kwargs = kwargs

    def run(self, fn, args=(), kwargs=None, env=None) -> list:
        """Run ``fn`` on the ranks (see :class:`Backend`); raises what :func:`perseus.spark.run` raises."""
        full_env = {**self._env, **dict(env or {})}
        # A training process must see the executor's GPUs, whatever the driver hid from its own frameworks.
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        return spark_run(fn, args=tuple(args), kwargs=dict(kwargs or {}), num_proc=self._num_proc,
                         env=full_env or None, **self._kwargs)

    def num_processes(self) -> int:
        return self._num_proc
