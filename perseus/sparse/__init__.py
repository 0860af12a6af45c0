"""Sparse all-reduce for row-sparse gradients (embedding tables), framework-neutral (NumPy).

Four algorithms reduce a tensor given as (row ids, rows of values) over a process set:

* ``zen``: Zen's balanced parallelism: rows hashed to owner ranks, pushed with one alltoall, summed at the
  owner, pulled back with one allgather of hash bitmaps and summed rows (:mod:`perseus.sparse.zen`);
* ``allgather``: every rank gathers every rank's rows (Horovod's path, :mod:`perseus.sparse.allgather`);
* ``dense``: densify and all-reduce (:mod:`perseus.sparse.dense`);
* ``alltoall``: column partition, as EmbRace (:mod:`perseus.sparse.columns`);

and ``auto`` picks one per tensor from a cost model fed with measured densities, overlap, imbalance and link
costs (:mod:`perseus.sparse.choice`). Framework adapters: ``perseus.torch.sparse_allreduce_async`` and
``DistributedOptimizer(sparse_algorithm=...)``, ``perseus.tensorflow.allreduce`` of ``tf.IndexedSlices``.
See docs/sparse.md.
"""

from perseus.sparse._runtime import SparseHandle, SparseResult, SparseStats, all_stats, stats
from perseus.sparse.choice import ALGORITHMS, CHOICES, policy, set_policy
from perseus.sparse.core import resolve_algorithm, sparse_allreduce, sparse_allreduce_async

__all__ = ["sparse_allreduce_async", "sparse_allreduce", "SparseHandle", "SparseResult", "SparseStats", "stats",
           "all_stats", "ALGORITHMS", "CHOICES", "set_policy", "policy", "resolve_algorithm"]
