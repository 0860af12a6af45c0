"""perseus on Ray (Horovod's ``horovod.ray``): :class:`RayExecutor` and :class:`ElasticRayExecutor`.

The workers are Ray actors; the MPI job forms through them (:mod:`perseus.runner.remote`): ``mpirun`` starts its
daemon on each node through the actor there, so the ranks behave exactly as under perseusrun. See docs/ray.md.
Needs ``ray`` (``pip install perseus[ray]``) and Open MPI on every node.
"""

from perseus.ray.elastic import ElasticRayExecutor
from perseus.ray.runner import RayExecutor
from perseus.ray.worker import BaseHorovodWorker, WorkerError

__all__ = ["RayExecutor", "ElasticRayExecutor", "BaseHorovodWorker", "WorkerError"]
