"""TorchState: elastic state for a PyTorch training process (Horovod's ``horovod.torch.elastic.state``)."""

from __future__ import annotations

import copy

import torch

from perseus.common.elastic import ObjectState, _check_attribute_names
from perseus.torch.elastic.sampler import ElasticSampler
from perseus.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from perseus.torch.mpi_ops import broadcast_, rank, size

__all__ = [
    "TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
    "get_handler_registry", "set_handler_registry",
]


class TorchState(ObjectState):
    """Elastic state of a PyTorch training process.

    Every keyword argument becomes an attribute. Values of a type in the handler registry (``nn.Module``,
    ``optim.Optimizer``, :class:`ElasticSampler`, or what :func:`set_handler_registry` adds) are saved, restored
    and synced by their handler; everything else as a plain Python object (``broadcast_object``). Assigning a
    new object to a handled attribute (``state.model = other_model``) hands it to the handler, which snapshots it.

    Args:
        model: optional model; ``sync()`` broadcasts its ``state_dict()`` from rank 0.
        optimizer: optional optimizer (plain or ``DistributedOptimizer``); ``sync()`` broadcasts its state.
        kwargs: more models, optimizers, samplers or plain values (``epoch=0, batch=0``).
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        _check_attribute_names(type(self), kwargs)
        self._handlers, plain = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _bcast_host_update(self, values):
        # One small tensor broadcast instead of a pickled object (two broadcasts); nothing at all on one rank.
        if size() == 1:
            return tuple(values)
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        broadcast_(t, 0, name="perseus.elastic.host_update")
        return tuple(int(v) if v.is_integer() else v for v in t.tolist())


class StateHandler:
    """Saves, restores and syncs one object of a given type for :class:`TorchState`."""

    def __init__(self, value):
        self.value = value

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def reset(self):
        """Called after perseus restarted, before ``sync()``. Default: nothing."""

    def set_value(self, value):
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    """``nn.Module``: a deep copy of ``state_dict()``; sync broadcasts parameters and buffers from rank 0."""

    def __init__(self, model):
        super().__init__(model)
        self.save()

    def save(self):
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved_model_state)  # copies into the parameters: no aliasing

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)
        self.save()  # the synced state is what every rank restores until the next commit


class OptimizerStateHandler(StateHandler):
    """``optim.Optimizer``: a deep copy of ``state_dict()``; sync broadcasts the state from rank 0."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.save()

    def save(self):
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        # load_state_dict may keep the given tensors as the optimizer's state; give it a copy so later steps
        # do not change the snapshot.
        self.value.load_state_dict(copy.deepcopy(self._saved_optimizer_state))

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)
        self.save()


class SamplerStateHandler(StateHandler):
    """:class:`ElasticSampler`: its ``state_dict()``; sync takes rank 0's epoch and processed count and the
    union of the indices every rank recorded, then reshards."""

    def __init__(self, sampler):
        super().__init__(sampler)
        self.save()

    def save(self):
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved_sampler_state))

    def sync(self):
        states = allgather_object(self.value.state_dict(), name="perseus.elastic.sampler")
        merged = dict(states[0])
        recorded = set()
        for s in states:
            recorded.update(s.get("processed_indices", ()))
        merged["processed_indices"] = sorted(recorded)
        self.value.load_state_dict(merged)
        self.save()

    def reset(self):
        self.value.reset()


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    """The ``[(type, handler class), ...]`` list :class:`TorchState` consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry):
    """Replace the registry (for example ``get_handler_registry() + [(MyType, MyHandler)]``)."""
    global _handler_registry
    _handler_registry = registry


def _get_handler(value):
    for handled_type, handler_cls in _handler_registry:
        if isinstance(value, handled_type):
            return handler_cls(value)
    return None


def _get_handlers(kwargs):
    handlers, plain = {}, {}
    for name, value in kwargs.items():
        handler = _get_handler(value)
        if handler is not None:
            handlers[name] = handler
        else:
            plain[name] = value
    return handlers, plain
