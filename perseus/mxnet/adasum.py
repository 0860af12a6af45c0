"""``op=hvd.Adasum`` in the MXNet DistributedOptimizer and DistributedTrainer: Adasum applied to each rank's
model update, not to its gradient (as ``perseus.torch``'s, docs/adasum.md).

Adasum combines vectors by how much they agree, so it should see what the optimizer does with a gradient
(momentum, Adam's scaling, the learning rate), not the raw gradient. Each rank therefore remembers its
weights, runs the wrapped optimizer's update on its own gradients, turns every weight into its update
``delta = weight - start`` in place, reduces the deltas with Adasum, and sets ``weight = start + combined``.
The copies of the weights are kept between steps (one per parameter), so a step allocates nothing new.
"""

from __future__ import annotations

import mxnet as mx

from perseus.base.reduce_ops import Adasum, Average, ReduceOp
from perseus.compression import Reducer
from perseus.mxnet.compression import Compression
from perseus.mxnet.mpi_ops import _start_allreduce

__all__ = ["check_op", "AdasumDeltas"]


def check_op(op, what: str) -> ReduceOp:
    """``op`` of an MXNet optimizer: Average (the gradients) or Adasum (the updates).

    Raises:
        ValueError: any other op.
    """
    op = ReduceOp(op)
    if op not in (Average, Adasum):
        raise ValueError(f"perseus.mxnet.{what}: op must be hvd.Average or hvd.Adasum, not hvd.{op.name.title()}")
    return op


class AdasumDeltas:
    """Combines the ranks' local updates of named weights with Adasum (see the module doc).

    Usage, on every rank of ``process_set`` alike: ``remember(names, weights)``, the local update of those
    weights, then ``combine(names, weights)``.

    Raises (on construction):
        NotImplementedError: a communicating compressor or ``num_groups`` (Adasum needs each rank's whole
            update, tensor by tensor).
        ValueError: ``gradient_predivide_factor`` other than 1.
    """

    def __init__(self, process_set, compression, num_groups: int, gradient_predivide_factor: float, what: str):
        if isinstance(compression, Reducer):
            raise NotImplementedError(f"perseus.mxnet.{what}(op=Adasum) takes Compression.none or fp16, not a "
                                      "communicating compressor; Adasum needs each rank's whole update")
        if int(num_groups or 0) > 0:
            raise NotImplementedError(f"perseus.mxnet.{what}(op=Adasum): num_groups is not supported; leave it 0 "
                                      "(the engine still fuses small updates, each keeping its own coefficients)")
        if float(gradient_predivide_factor) != 1.0:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self.process_set = process_set
        self.compression = Compression.none if compression is None else compression
        self.what = what
        self._starts: dict[str, mx.nd.NDArray] = {}

    def active(self) -> bool:
        """True when this rank is in the set and the set has more than one rank (else: a plain local step)."""
        return bool(self.process_set.included()) and self.process_set.size() > 1

    def remember(self, names, weights) -> None:
        """Copy each weight before its local update (into a buffer kept for its name)."""
        for name, weight in zip(names, weights):
            start = self._starts.get(name)
            if start is None or start.shape != weight.shape or start.dtype != weight.dtype \
                    or start.context != weight.context:
                start = self._starts[name] = mx.nd.empty(weight.shape, ctx=weight.context, dtype=weight.dtype)
            weight.copyto(start)

    def combine(self, names, weights) -> None:
        """``weight = start + Adasum over the ranks of (weight - start)``, for every weight ``remember`` saw.

        Collective: every rank of the set combines the same names in the same order. Raises the collective's
        errors (PerseusMXNetValueError for a weight that is not floating-point, a mismatch error when the
        ranks disagree).
        """
        deltas, contexts = [], []
        for name, weight in zip(names, weights):
            weight -= self._starts[name]  # the weight now holds this rank's update
            compressed, ctx = self.compression.compress(weight)
            deltas.append(compressed)
            contexts.append(ctx)
        pending = [_start_allreduce([deltas[i]], True, Adasum, f"{self.what}.adasum.{names[i]}", -i, 1.0, 1.0,
                                    self.process_set, self.what, True)
                   for i in reversed(range(len(deltas)))]  # the last parameter first, as backward makes them
        for p in pending:
            p.wait()
        for name, weight, delta, ctx in zip(names, weights, deltas, contexts):
            if delta is not weight:
                weight[:] = self.compression.decompress(delta, ctx)
            weight += self._starts[name]
