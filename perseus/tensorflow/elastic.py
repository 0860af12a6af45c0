"""Elastic training for TensorFlow 2 (Horovod's ``horovod.tensorflow.elastic``).

``TensorFlowKerasState`` keeps a Keras model and optimizer, ``TensorFlowState`` a list of ``tf.Variable``;
``run`` is the retry loop of :mod:`perseus.elastic.state` (under ``perseusrun --host-discovery-script`` the job
also survives ranks that die and hosts that come and go). TF1 sessions are not supported.
"""

from __future__ import annotations

import functools
import re

import tensorflow as tf

from perseus.elastic.state import ObjectState, run_fn
from perseus.base.exceptions import HorovodInternalError
from perseus.runtime.state import runtime as _runtime
from perseus.tensorflow.functions import broadcast_object, broadcast_variables
from perseus.tensorflow.keras_state import KerasState as TensorFlowKerasState
from perseus.tensorflow.mpi_ops import init, rank, shutdown

__all__ = ["TensorFlowKerasState", "TensorFlowState", "run", "ObjectState"]


class TensorFlowState(ObjectState):
    """Elastic state of ``tf.Variable`` objects plus keyword values.

    Args:
        variables: the variables to keep (required: TF2 has no global variable collection).
        session: must be None (TF1 sessions are not supported).
        kwargs: more values to keep, exposed as attributes.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise NotImplementedError("perseus.tensorflow.elastic.TensorFlowState does not support TF1 sessions")
        if variables is None:
            raise ValueError("TensorFlowState needs the list of variables to keep (TF2 has no global "
                             "variable collection)")
        self.variables = list(variables)
        self._values = [tf.identity(v) for v in self.variables]
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self):
        self._values = [tf.identity(v) for v in self.variables]
        super().save()

    def restore(self):
        for var, value in zip(self.variables, self._values):
            var.assign(value)
        super().restore()

    def snapshot_payload(self):
        return {"objects": self._saved_state, "variables": [v.numpy() for v in self._values]}

    def load_snapshot_payload(self, payload):
        self._values = [tf.constant(a) for a in payload["variables"]]
        self._saved_state = dict(payload["objects"])

    def sync(self):
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._values = [tf.identity(v) for v in self.variables]
        super().sync()


# A perseus collective's failure as it surfaces from a TF graph (tf.function, Keras fit): the message of the
# py_function's RuntimeError, or the guard that reports a cross-rank mismatch.
_GRAPH_FAILURE = re.compile(r"perseus\.[a-z_]+\(|perseus_collective_failed")


def run(func):
    """Decorator running ``func(state, *args, **kwargs)`` in the elastic retry loop (see
    :func:`perseus.elastic.state.run_fn`): on ``HorovodInternalError`` every rank restores its last commit,
    perseus restarts, the state is synced from rank 0 and ``func`` runs again. A perseus collective that
    failed inside a TF graph reaches Python as a ``tf.errors.OpError`` (``UnknownError``,
    ``FailedPreconditionError``); such errors count as ``HorovodInternalError`` here, as with Horovod."""

    @functools.wraps(func)
    def graph_errors_are_internal(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            if isinstance(exc, HorovodInternalError) or not _GRAPH_FAILURE.search(str(exc.message)):
                raise
            raise HorovodInternalError(exc.message) from exc

    return run_fn(graph_errors_are_internal, _reset, _init_on)


def _reset():
    comm = _runtime().world_comm()
    shutdown()
    init(comm=comm)


def _init_on(comm):
    """Start perseus on ``comm`` (the survivors' communicator after a rank failed in an elastic job)."""
    init(comm=comm)
