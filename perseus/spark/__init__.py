"""perseus on Spark (Horovod's ``horovod.spark``): :func:`run` and :func:`run_elastic`.

Each rank is held by a Spark task; the MPI job forms through the tasks (:mod:`perseus.runner.remote`):
``mpirun`` runs in the driver and starts its daemon on each machine through a task there, so the ranks behave
exactly as under perseusrun. Needs ``pyspark`` on the driver and executors, and Open MPI and perseus on every
machine. Horovod's Spark ML estimators are in :mod:`perseus.spark.torch`, :mod:`perseus.spark.keras` and
:mod:`perseus.spark.lightning`, their stores and data preparation in :mod:`perseus.spark.common`. See
docs/spark.md.
"""

from perseus.spark.elastic import run_elastic
from perseus.spark.runner import run

__all__ = ["run", "run_elastic"]
