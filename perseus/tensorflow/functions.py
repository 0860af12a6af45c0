"""Broadcast variables, and move arbitrary Python objects between ranks (horovod.tensorflow.functions)."""

from __future__ import annotations

import tensorflow as tf

from perseus.runtime import objects as _objects
from perseus.runtime.process_sets import global_process_set
from perseus.tensorflow.mpi_ops import broadcast_
from perseus.tensorflow.util import _executing_eagerly

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "allgather_object", "BroadcastGlobalVariablesHook"]


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Overwrite ``variables`` on every rank of ``process_set`` with the values of job rank ``root_rank``.

    The broadcasts are started together and then awaited. ``inplace`` is accepted for compatibility (the
    variables are always assigned in place). Eagerly returns None; in a graph returns an op grouping the
    assignments.

    Collective: every rank passes variables of the same shapes and dtypes, in the same order.
    """
    variables = list(variables)
    updated = broadcast_(variables, root_rank, process_set=process_set)
    if _executing_eagerly():
        return None
    return tf.group(*updated)


def broadcast_global_variables(root_rank):
    """TF1 graph mode: an op broadcasting every global variable from ``root_rank``.

    Eagerly there is no global variable collection: RuntimeError naming the replacement, as Horovod does.
    """
    if _executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 sessions (``MonitoredTrainingSession``, Estimators): once the session is created (its variables
    initialized or restored from a checkpoint), every global variable is overwritten with ``root_rank``'s value,
    so that every rank starts from the same weights.

    ``device`` places the broadcast op (as Horovod's). Collective: every rank of ``process_set`` uses the hook
    with a graph of the same global variables.
    """

    def __init__(self, root_rank, device="", process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.bcast_op = None

    def begin(self):
        """The broadcast op, built in the session's graph (anew when the hook is used with another graph)."""
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_variables(tf.compat.v1.global_variables(), self.root_rank,
                                                    process_set=self.process_set)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return the root's ``obj`` on every rank of ``process_set`` (serialised with cloudpickle).

    Runs at once in Python, eagerly or while a graph is being built (``session`` is accepted for
    compatibility and not needed). ``root_rank`` is a job rank. Collective: every rank of the set calls it;
    only the root's ``obj`` matters.
    """
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper, eagerly here)."""
    name = name or "broadcast_object_fn"

    def _bcast(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return _bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Return the list of every rank's ``obj`` (ranks of ``process_set``, in order), via cloudpickle.

    Runs at once in Python, in any mode (``session`` is accepted for compatibility). Collective: every rank of
    the set calls it.
    """
    return _objects.allgather_object(obj, name, process_set)
