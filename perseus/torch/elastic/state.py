"""TorchState: elastic state for a PyTorch training process (Horovod's ``horovod.torch.elastic.state``)."""

from __future__ import annotations

import copy
import inspect

import torch

from perseus.elastic.state import ObjectState, _check_attribute_names
from perseus.base.knobs import read_knob
from perseus.torch.elastic.snapshot import Snapshotter
from perseus.torch.elastic.sampler import ElasticSampler
from perseus.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from perseus.torch.mpi_ops import broadcast_, rank, size

__all__ = [
    "TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
    "SchedulerStateHandler",
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
        self._snapshotter = Snapshotter()
        self._hooked = set()
        self._handlers, plain = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self):
        """Snapshot the state: tensors only an optimizer of the state changes are copied in the background
        (its ``step()`` waits for the copy), the rest at once; buffers are reused from commit to commit (see
        :mod:`perseus.torch.elastic.snapshot`)."""
        session = getattr(self, "_elastic_session", None)
        copier = self._snapshotter.begin(self._hurry, session.arena if session is not None else None)
        background = self._background_tensors()
        deferred = (lambda t: t.data_ptr() in background) if background else (lambda t: False)
        for name, handler in self._handlers.items():
            if "copier" in inspect.signature(handler.save).parameters:
                handler.save(copier.scoped(name), deferred)
            else:  # a handler of the program's own, written for Horovod's save()
                handler.save()
        super().save()
        self._snapshotter.launch(copier)

    def _background_tensors(self) -> set:
        """The storage addresses of the tensors the background copy may take: the parameters and state of the
        state's optimizers (none with PERSEUS_ELASTIC_SNAPSHOT=sync or a DeAR optimizer)."""
        optimizers = [h.value for h in self._handlers.values() if isinstance(h, OptimizerStateHandler)]
        if not optimizers or read_knob("elastic_snapshot")[0] != "async" or \
                any(hasattr(o, "dear_groups") for o in optimizers):
            return set()
        out = set()
        for opt in optimizers:
            if id(opt) not in self._hooked:
                opt.register_step_pre_hook(lambda *_: self._snapshotter.wait_copied())
                self._hooked.add(id(opt))
            for group in opt.param_groups:
                out.update(p.data_ptr() for p in group["params"])
            for per_param in opt.state.values():
                out.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return out

    def _hurry(self):
        session = getattr(self, "_elastic_session", None)
        if session is not None:
            session.store.hurry()

    def _after_snapshot(self, fn):
        self._snapshotter.after(fn)

    def _wait_snapshot(self):
        self._snapshotter.wait()

    def restore(self):
        self._snapshotter.wait_copied()  # the snapshot is complete; its copy to the keepers may go on
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        self._snapshotter.wait_copied()
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def snapshot_payload(self):
        """The last commit with every tensor as a NumPy array (sent to the keepers without a copy)."""
        self._snapshotter.wait_copied()
        return {"objects": _to_numpy(self._saved_state),
                "handlers": {name: _to_numpy(h.payload()) for name, h in self._handlers.items()}}

    def load_snapshot_payload(self, payload):
        self._snapshotter.wait()
        handlers = payload.get("handlers", {})
        missing = sorted(set(self._handlers) - set(handlers))
        if missing:
            raise ValueError(f"TorchState: the restored commit has no {', '.join(missing)}; every generation "
                             f"of an elastic job must build its state with the same attributes")
        for name, handler in self._handlers.items():
            handler.load_payload(_from_numpy(handlers[name]))
        self._saved_state = dict(_from_numpy(payload["objects"]))

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

    def save(self, copier=None, deferred=None):
        """Snapshot the value: deep copies, or (``copier``) copies into reused buffers, in the background for
        the tensors ``deferred(t)`` allows."""
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

    #: The attribute holding the last snapshot (handlers that keep it elsewhere override the two methods below).
    _saved_attr = None

    def payload(self):
        """The last snapshot, picklable, for the elastic launcher's checkpoint keepers."""
        if self._saved_attr is None:
            raise NotImplementedError(f"{type(self).__name__} cannot be checkpointed to the elastic launcher's "
                                      f"keepers: define payload() and load_payload()")
        return getattr(self, self._saved_attr)

    def load_payload(self, payload):
        """Make ``payload`` (from :meth:`payload`) the last snapshot; ``restore()`` puts it in place."""
        if self._saved_attr is None:
            raise NotImplementedError(f"{type(self).__name__} cannot be restored from the elastic launcher's "
                                      f"keepers: define payload() and load_payload()")
        setattr(self, self._saved_attr, payload)


class ModelStateHandler(StateHandler):
    """``nn.Module``: a deep copy of ``state_dict()``; sync broadcasts parameters and buffers from rank 0."""

    _saved_attr = "_saved_model_state"

    def __init__(self, model):
        super().__init__(model)
        self.save()

    def save(self, copier=None, deferred=None):
        if copier is None:
            self._saved_model_state = copy.deepcopy(self.value.state_dict())
        else:
            self._saved_model_state = copier.tree("state", self.value.state_dict(), deferred)

    def restore(self):
        self.value.load_state_dict(self._saved_model_state)  # copies into the parameters: no aliasing

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)
        self.save()  # the synced state is what every rank restores until the next commit


class OptimizerStateHandler(StateHandler):
    """``optim.Optimizer``: a deep copy of ``state_dict()``; sync broadcasts the state from rank 0."""

    _saved_attr = "_saved_optimizer_state"

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.save()

    def save(self, copier=None, deferred=None):
        if copier is None:
            self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())
        else:
            self._saved_optimizer_state = copier.tree("state", self.value.state_dict(), deferred)

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

    _saved_attr = "_saved_sampler_state"

    def __init__(self, sampler):
        super().__init__(sampler)
        self.save()

    def save(self, copier=None, deferred=None):
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


class SchedulerStateHandler(StateHandler):
    """A learning-rate scheduler: its ``state_dict()`` (which leaves the optimizer out), loaded back into the
    same scheduler, so that after a restore it still drives the optimizer being trained; sync takes rank 0's.
    (A deep copy of the scheduler itself would copy its optimizer too, and could not travel to the keepers.)"""

    _saved_attr = "_saved_scheduler_state"

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.save()

    def save(self, copier=None, deferred=None):
        self._saved_scheduler_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self._saved_scheduler_state))

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0,
                                                    name="perseus.elastic.scheduler"))
        self.save()


def _scheduler_types() -> tuple:
    sched = torch.optim.lr_scheduler
    found = [getattr(sched, n) for n in ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau") if hasattr(sched, n)]
    return tuple(dict.fromkeys(found))


class _NumpyTensor:
    """A CPU tensor travelling as a NumPy array (pickle protocol 5 sends the array's memory out of band)."""

    __slots__ = ("array", "dtype", "requires_grad")

    def __init__(self, array, dtype, requires_grad):
        self.array, self.dtype, self.requires_grad = array, dtype, requires_grad

    def __getstate__(self):
        return self.array, self.dtype, self.requires_grad

    def __setstate__(self, state):
        self.array, self.dtype, self.requires_grad = state


def _to_numpy(value):
    """``value`` with every CPU tensor NumPy can hold replaced by a :class:`_NumpyTensor` sharing its memory
    (the snapshot is a private copy, so nothing changes it later); other tensors pickle as torch does."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type == "cpu" and not t.is_sparse and t.dtype not in (torch.bfloat16,) and \
                not t.is_complex() and not t.is_quantized:
            return _NumpyTensor(t.contiguous().numpy(), str(t.dtype), bool(value.requires_grad))
        return value
    if isinstance(value, dict):
        return _same_mapping(value, {k: _to_numpy(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_numpy(v) for v in value)
    return value


def _same_mapping(original, items):
    """``items`` as a mapping of ``original``'s type, keeping a state_dict's ``_metadata`` (module versions)."""
    if type(original) is dict:
        return items
    out = type(original)(items)
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def _from_numpy(value):
    if isinstance(value, _NumpyTensor):
        t = torch.from_numpy(value.array)
        return t.requires_grad_(True) if value.requires_grad and t.is_floating_point() else t
    if isinstance(value, dict):
        return _same_mapping(value, {k: _from_numpy(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_from_numpy(v) for v in value)
    return value


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
    (_scheduler_types(), SchedulerStateHandler),
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
