"""Broadcast parameters, and move arbitrary Python objects between ranks (horovod.mxnet's helpers)."""

from __future__ import annotations

import types

import mxnet as mx

from perseus.runtime import objects as _objects
from perseus.runtime.process_sets import global_process_set
from perseus.mxnet.mpi_ops import _start_broadcast, broadcast_, size

__all__ = ["broadcast_parameters", "broadcast_object", "allgather_object"]


def _parameter_dict_types():
    try:
        from mxnet.gluon.parameter import ParameterDict
    except ImportError:  # MXNet 2 has no ParameterDict
        return (dict,)
    return (dict, ParameterDict)


def _broadcast_after_init(param, root_rank: int, name: str) -> None:
    """Make a deferred-initialised parameter broadcast its value from ``root_rank`` right after MXNet
    initialises it (at the first forward pass, which every rank makes)."""
    original = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        broadcast_(self.data(), root_rank, name=name)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params, root_rank=0, prefix=None):
    """Overwrite ``params`` on every rank with the values held by ``root_rank``, in place.

    Args:
        params: a dict of NDArrays or Parameters (e.g. ``Module.get_params()[0]``), or a gluon ParameterDict
            (``block.collect_params()``). Entries are broadcast in the order of their sorted keys, each
            named ``prefix + key``. A parameter whose initialisation is deferred (its shape is not known yet)
            is broadcast as soon as MXNet initialises it.
        root_rank: the rank whose values everyone gets.
        prefix: distinguishes the names when several sets of parameters are broadcast in one program.

    Collective: every rank calls it with the same keys, shapes and dtypes. With one rank it does nothing.

    Raises:
        ValueError: ``params`` is not a dict or ParameterDict, or ``prefix`` is not a string.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"broadcast_parameters: prefix must be a string, got {type(prefix).__name__}")
    if not isinstance(params, _parameter_dict_types()):
        raise ValueError(f"invalid params of type: {type(params)}; pass a dict or a gluon ParameterDict")
    if size() == 1:
        return
    prefix = prefix or ""
    tensors = []
    for key, p in sorted(params.items()):
        name = prefix + str(key)
        if isinstance(p, mx.gluon.parameter.Parameter):
            try:
                tensors.append((name, p.data()))
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(p, root_rank, name)
        else:
            tensors.append((name, p))
    # Started together, then awaited: the engine fuses and overlaps them.
    pending = [_start_broadcast(t, root_rank, True, name, 0, global_process_set, "broadcast_parameters")
               for name, t in tensors]
    for p in pending:
        p.wait()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return the root's ``obj`` on every rank of ``process_set`` (serialised with cloudpickle).

    ``root_rank`` is a job rank. Collective: every rank of the set calls it; only the root's ``obj`` matters.
    """
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Return the list of every rank's ``obj`` (ranks of ``process_set``, in order), via cloudpickle.

    Collective: every rank of the set calls it.
    """
    return _objects.allgather_object(obj, name, process_set)

