"""Data-parallel training for MXNet: DistributedOptimizer (any mx.optimizer.Optimizer) and DistributedTrainer
(a gluon.Trainer). Both average every gradient over the ranks of their process set before the update.

Averaging: each gradient is multiplied by ``1 / gradient_predivide_factor`` before the sum and by
``gradient_predivide_factor / set size`` after it, so the update uses the mean gradient whatever the factor
(a factor above 1 keeps float16 sums from overflowing). With ``Trainer.step(batch_size)`` and the per-rank
batch size, N ranks therefore train exactly like one process on the global batch.

Gradients are handed to the engine as MXNet finishes computing them: the requests are submitted from the
last parameter to the first (the order backward produces them) and awaited together, so the reduction of
late layers overlaps the backward pass of early ones.

Compression: ``Compression.fp16`` sends floating-point gradients as float16; a communicating compressor
(``Compression.topk(0.01)``..., docs/compression.md) reduces each gradient (each group with ``num_groups``)
through its own collective, keyed by the gradient's name (the parameter's index), under which it keeps the
gradient's residual. With SGD or NAG and a sparsifying compressor (top-k, random-k, hierarchical top-k), the
momentum moves into the compressor (momentum correction, :mod:`perseus.mxnet.momentum`).

``op=hvd.Adasum`` (a perseus addition: Horovod's MXNet optimizers take no ``op``) combines each rank's model
update instead of averaging gradients (:mod:`perseus.mxnet.adasum`, docs/adasum.md).
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import mxnet as mx
import numpy as np

from perseus.runtime import guard as _guard
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Adasum, Average
from perseus.base.util import split_list
from perseus.compression import Reducer
from perseus.mxnet.adasum import AdasumDeltas, check_op
from perseus.mxnet.compression import Compression
from perseus.mxnet.momentum import MomentumMover
from perseus.mxnet.mpi_ops import _start_allreduce, reduce_with

__all__ = ["DistributedOptimizer", "DistributedTrainer"]


def _check_factor(gradient_predivide_factor) -> float:
    factor = float(gradient_predivide_factor)
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    return factor


class _GradientAverager:
    """Submits in-place averaging allreduces of named gradients (compressed by ``compression``) and waits for
    them all."""

    def __init__(self, gradient_predivide_factor, num_groups, process_set, compression=None):
        self.factor = _check_factor(gradient_predivide_factor)
        if int(num_groups) < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        self.num_groups = int(num_groups)
        self.process_set = process_set
        self.compression = Compression.none if compression is None else compression

    def active(self) -> bool:
        return bool(self.process_set.included()) and self.process_set.size() > 1

    def _start(self, grads, name, priority, what):
        return _start_allreduce(list(grads), True, Average, name, priority, 1.0 / self.factor, self.factor,
                                self.process_set, what, len(grads) == 1 and not self.num_groups)

    def reduce(self, names, grads, what: str, local=None) -> None:
        """Average ``grads`` (NDArrays, in parameter order) in place; ``names`` identify them across ranks.
        ``local``: the compressor's momentum correction (a LocalStep), for a communicating compressor only."""
        if isinstance(self.compression, Reducer):
            self._reduce_compressed(names, grads, what, local)
            return
        if local is not None:
            raise ValueError(f"perseus.mxnet: momentum correction needs a communicating compressor, not "
                             f"{self.compression!r}")
        pairs = [self.compression.compress(g) for g in grads]
        self._reduce([c for c, _ in pairs], names, what)
        for grad, (compressed, ctx) in zip(grads, pairs):
            if compressed is not grad:
                grad[:] = self.compression.decompress(compressed, ctx)

    def _reduce_compressed(self, names, grads, what: str, local=None) -> None:
        if self.num_groups > 0:
            groups = [(ns, gs) for ns, gs in zip(split_list(list(names), self.num_groups),
                                                 split_list(list(grads), self.num_groups)) if ns]
            keys = [f"{what}.{ns[0]}:{ns[-1]}" for ns, _ in groups]
            parts = [list(gs) for _, gs in groups]
        else:
            keys = [f"{what}.{n}" for n in names]
            parts = [[g] for g in grads]
        # From the last parameter to the first, as backward produces them.
        reduce_with(self.compression, parts[::-1], keys[::-1], True, Average, 1.0 / self.factor, self.factor,
                    self.process_set, what, local)

    def _reduce(self, grads, names, what: str) -> None:
        pending = []
        if self.num_groups > 0:
            groups = [g for g in zip(split_list(list(names), self.num_groups),
                                     split_list(list(grads), self.num_groups)) if g[0]]
            for i in reversed(range(len(groups))):
                by_dtype = defaultdict(list)
                for n, g in zip(*groups[i]):
                    by_dtype[np.dtype(g.dtype)].append((n, g))
                for entries in by_dtype.values():
                    ns, gs = zip(*entries)
                    pending.append(self._start(gs, f"{ns[0]}:{ns[-1]}", -i, what))
        else:
            for i in reversed(range(len(grads))):
                pending.append(self._start([grads[i]], names[i], -i, what))
        for p in pending:
            p.wait()


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wrap ``optimizer`` so that ``update``/``update_multi_precision`` first average the gradients over the
    ranks of ``process_set`` (in place), then apply the wrapped update.

    Every other attribute and method is the wrapped optimizer's: reading and setting ``lr``,
    ``rescale_grad``, ``param_dict``... act on it. Use it with ``mx.mod.Module`` or a ``gluon.Trainer`` with
    ``kvstore=None``; with Gluon, :class:`DistributedTrainer` is the usual choice. Gradients are named by
    the optimizer's parameter index, so two DistributedOptimizers reducing at the same time need
    different process sets.

    Args:
        optimizer: the ``mx.optimizer.Optimizer`` to wrap.
        gradient_predivide_factor: see the module docstring (must be positive).
        num_groups: 0 to reduce each gradient on its own; N to reduce the gradients of one update call in N
            grouped allreduces.
        process_set: the ranks to average over; ranks outside it update with their local gradients.
        compression: a perseus addition (Horovod's MXNet DistributedOptimizer has none): ``None``/
            ``Compression.none``, ``Compression.fp16``, or a communicating compressor such as
            ``Compression.topk(0.01)`` (docs/compression.md), which keeps a residual per gradient (give each
            optimizer its own instance).
        op: a perseus addition: ``hvd.Average`` (the default) averages the gradients; ``hvd.Adasum`` runs the
            wrapped update on the rank's own gradients and combines the ranks' updates with Adasum
            (:mod:`perseus.mxnet.adasum`; Compression.none or fp16 only, no ``num_groups``, no float16
            multi-precision weights).

    Momentum correction: when ``optimizer`` is SGD or NAG with momentum in (0, 1) and the compressor takes
    the momentum (``topk``, ``randomk``, ``hitopk``, or ``cupcake`` of one of them, with error feedback),
    ``update`` turns each gradient into ``clip(rescale_grad * grad) + wd * weight``, the compressor applies
    the momentum on each rank before compressing, and the wrapped update applies the averaged result without
    momentum, weight decay, rescaling or clipping (the attributes are restored after each update).
    ``Compression.topk(0.01, momentum_correction=False)`` keeps the momentum in the optimizer. Details:
    perseus/mxnet/momentum.py.

    Collective: every rank of the set makes the same updates in the same order.
    """

    _OWN = ("_optimizer", "_averager", "_mover", "_adasum")

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0, process_set=global_process_set,
                 compression=None, op=Average):
        _guard.refuse("the MXNet DistributedOptimizer")
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, got {type(optimizer).__name__}")
        adasum = None
        if check_op(op, "DistributedOptimizer") == Adasum:
            adasum = AdasumDeltas(process_set, compression, num_groups, gradient_predivide_factor,
                                  "DistributedOptimizer")
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_averager", _GradientAverager(gradient_predivide_factor, num_groups,
                                                                process_set, compression))
        object.__setattr__(self, "_mover", MomentumMover(compression))
        object.__setattr__(self, "_adasum", adasum)

    def __getattr__(self, item):
        if item in DistributedOptimizer._OWN or item.startswith("__"):
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key, value):
        if key in DistributedOptimizer._OWN:
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def __getstate__(self):
        return {"_optimizer": self._optimizer, "_averager": self._averager, "_mover": self._mover,
                "_adasum": self._adasum}

    def __setstate__(self, state):
        for key, value in state.items():
            object.__setattr__(self, key, value)
        if "_mover" not in state:  # pickled before momentum correction
            object.__setattr__(self, "_mover", MomentumMover(self._averager.compression))
        if "_adasum" not in state:  # pickled before Adasum
            object.__setattr__(self, "_adasum", None)

    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._optimizer.learning_rate = value

    def _allreduce(self, index, weight, grad) -> bool:
        """Average ``grad`` (one NDArray, or a list with ``index`` a list) in place; True when the result is a
        momentum-corrected update, to be applied without momentum."""
        averager = self._averager
        if not averager.active():
            return False
        indices, weights, grads = (list(index), list(weight), list(grad)) if isinstance(index, (list, tuple)) \
            else ([index], [weight], [grad])
        local = self._mover.spec(self._optimizer)
        if local is not None:
            self._mover.prepare(self._optimizer, indices, weights, grads)
        averager.reduce([str(i) for i in indices], grads, "DistributedOptimizer", local)
        return local is not None

    def _adasum_update(self, update, index, weight, grad, state) -> None:
        """``update`` (the wrapped optimizer's) on this rank's own gradients, then the ranks' updates combined
        with Adasum. Collective: every rank of the set."""
        indices, weights = (list(index), list(weight)) if isinstance(index, (list, tuple)) else ([index], [weight])
        names = [str(i) for i in indices]
        self._adasum.remember(names, weights)
        update(index, weight, grad, state)
        self._adasum.combine(names, weights)

    def update(self, index, weight, grad, state):
        """Average ``grad`` over the process set in place, then apply the wrapped optimizer's update (a plain
        step with momentum correction, see the class docstring); with ``op=Adasum`` the local update, then
        the updates combined."""
        if self._adasum is not None and self._adasum.active():
            self._adasum_update(self._optimizer.update, index, weight, grad, state)
        elif self._allreduce(index, weight, grad):
            with self._mover.plain(self._optimizer):
                self._optimizer.update(index, weight, grad, state)
        else:
            self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        """Average ``grad`` in place, then apply the wrapped optimizer's multi-precision update (a plain step
        with momentum correction); with ``op=Adasum`` see :meth:`update`.

        Raises:
            NotImplementedError: ``op=Adasum`` with float16 weights and ``multi_precision``: their float32
                master copies would not follow the combined update.
        """
        if self._adasum is not None and self._adasum.active():
            weights = list(weight) if isinstance(weight, (list, tuple)) else [weight]
            if self._optimizer.multi_precision and any(w.dtype == np.float16 for w in weights):
                raise NotImplementedError("perseus.mxnet.DistributedOptimizer(op=Adasum): float16 weights with "
                                          "multi_precision=True are not supported; train in float32 or turn "
                                          "multi_precision off")
            self._adasum_update(self._optimizer.update_multi_precision, index, weight, grad, state)
        elif self._allreduce(index, weight, grad):
            with self._mover.plain(self._optimizer):
                self._optimizer.update_multi_precision(index, weight, grad, state)
        else:
            self._optimizer.update_multi_precision(index, weight, grad, state)

    # Forwarded explicitly: the base class defines these, so attribute lookup would not reach __getattr__.
    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_scale(self, args_lrscale):
        self._optimizer.set_lr_scale(args_lrscale)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)

    def _set_current_context(self, device_id):
        self._optimizer._set_current_context(device_id)

    def _update_count(self, index):
        self._optimizer._update_count(index)

    def _get_lrs(self, indices):
        return self._optimizer._get_lrs(indices)

    def _get_lr(self, index):
        return self._optimizer._get_lr(index)

    def _get_wds(self, indices):
        return self._optimizer._get_wds(indices)

    def _get_wd(self, index):
        return self._optimizer._get_wd(index)


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` that averages gradients over the ranks of ``process_set`` instead of using a
    kvstore (it is created with ``kvstore=None``).

    Args:
        params: the parameters (a ParameterDict, dict or list of Parameters).
        optimizer, optimizer_params: as for ``gluon.Trainer``. A :class:`DistributedOptimizer` is unwrapped
            (with a warning): the trainer averages the gradients itself.
        compression: ``Compression.none``, ``Compression.fp16`` (floating-point gradients travel as
            float16 and are cast back), or a communicating compressor such as ``Compression.topk(0.01)``
            (docs/compression.md), which reduces each gradient through its own collective and keeps its
            residual under the gradient's name (give each trainer its own instance).
        gradient_predivide_factor: see the module docstring (must be positive).
        prefix: prepended to the gradient names; programs with several DistributedTrainers must give each
            a different prefix.
        num_groups: 0 to reduce each gradient on its own (still fused by the engine); N to submit them as
            N grouped allreduces (split by dtype).
        process_set: the ranks to average over; ranks outside it train on their local gradients.
        op: a perseus addition: ``hvd.Average`` (the default) averages the gradients; ``hvd.Adasum`` updates
            every parameter with this rank's own gradients and combines the ranks' updates with Adasum
            (:mod:`perseus.mxnet.adasum`; Compression.none or fp16 only, no ``num_groups``). ``allreduce_grads``
            then leaves the gradients local and ``update`` does the whole step.

    Momentum correction: with ``'sgd'``/``'nag'`` and a momentum in (0, 1), and a compressor that takes the
    momentum (``topk``, ``randomk``, ``hitopk``, or ``cupcake`` of one of them, with error feedback), each rank
    reduces ``clip(rescale_grad * grad) + wd * weight`` through the compressor, which applies the momentum
    before compressing, and the update applies the averaged result without momentum, weight decay,
    rescaling or clipping (perseus/mxnet/momentum.py). The rescaling needs the batch size, so
    ``allreduce_grads()`` then leaves the gradients local and ``update(batch_size)`` reduces them before
    updating (``step`` is unchanged). ``Compression.topk(0.01, momentum_correction=False)`` keeps the momentum
    in the optimizer.

    Collective: every rank of the set calls ``step``/``allreduce_grads`` with the same parameters. Each
    parameter must live on one context (one device per process).
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0, process_set=global_process_set,
                 op=Average):
        _guard.refuse("the MXNet DistributedTrainer")
        adasum = None
        if check_op(op, "DistributedTrainer") == Adasum:
            adasum = AdasumDeltas(process_set, compression, num_groups, gradient_predivide_factor,
                                  "DistributedTrainer")
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"DistributedTrainer: prefix must be a string, got {type(prefix).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer averages gradients itself; the DistributedOptimizer passed to it "
                          "has been unwrapped.")
        averager = _GradientAverager(gradient_predivide_factor, num_groups, process_set, compression)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._process_set = process_set
        self._prefix = prefix or ""
        self._averager = averager
        self._adasum = adasum
        self._mover = MomentumMover(compression)
        self._split_reduce = False      # inside allreduce_grads(): the batch size is not known yet
        self._reduce_in_update = False  # allreduce_grads() left the momentum-corrected reduction to update()
        self._corrected = False         # the gradients hold momentum-corrected updates (apply them plainly)

    def allreduce_grads(self):
        """Average the gradients over the process set (Gluon's split API: then ``update(batch_size)``). With
        momentum correction the reduction waits for ``update``, which knows the batch size. Collective."""
        self._split_reduce = True
        try:
            super().allreduce_grads()
        finally:
            self._split_reduce = False

    def _allreduce_grads(self):
        """Average every gradient over the process set (``step`` and ``allreduce_grads``); a momentum-corrected
        reduction asked for by ``allreduce_grads`` is left to ``update``. Collective: every rank of the set.
        Raises NotImplementedError for a parameter on several contexts, and the collective's errors."""
        if not self._averager.active() or self._adasum is not None:  # Adasum combines updates, in _update
            return
        local = self._mover.spec(self._optimizer)
        if local is not None and self._split_reduce:
            self._reduce_in_update = True
            return
        self._reduce_in_update = False
        self._reduce(local)

    def _update(self, ignore_stale_grad=False):
        """Run a reduction left by ``allreduce_grads`` (collective), then Gluon's update: a plain SGD step
        (no momentum, weight decay, rescaling, clipping) when the gradients are momentum-corrected updates.
        With ``op=Adasum``: the local update, then the ranks' updates combined (collective)."""
        if self._adasum is not None and self._adasum.active():
            names, weights = self._trained()
            self._adasum.remember(names, weights)
            result = super()._update(ignore_stale_grad)
            self._adasum.combine(names, weights)
            return result
        if self._reduce_in_update:
            self._reduce_in_update = False
            self._reduce(self._mover.spec(self._optimizer))
        corrected, self._corrected = self._corrected, False
        if not corrected:
            return super()._update(ignore_stale_grad)
        with self._mover.plain(self._optimizer):
            return super()._update(ignore_stale_grad)

    def _trained(self):
        """``(names, weights)`` of the parameters that train (their data on their one context).

        Raises:
            NotImplementedError: a parameter on several contexts.
        """
        names, weights = [], []
        for i, param in self._trained_params():
            names.append(self._prefix + str(i))
            weights.append(param.list_data()[0])
        return names, weights

    def _trained_params(self):
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            if len(param.list_ctx()) != 1:
                raise NotImplementedError(f"DistributedTrainer: parameter {param.name} lives on "
                                          f"{len(param.list_ctx())} contexts; perseus.mxnet supports one context "
                                          "per process")
            yield i, param

    def _reduce(self, local):
        """Average every gradient in place; with ``local`` (a LocalStep) momentum-corrected updates."""
        names, grads, indices, weights = [], [], [], []
        for i, param in self._trained_params():
            names.append(self._prefix + str(i))
            grads.append(param.list_grad()[0])
            indices.append(i)
            weights.append(param.list_data()[0])
        if not grads:
            return
        if local is not None:
            self._mover.prepare(self._optimizer, indices, weights, grads)
        self._averager.reduce(names, grads, "DistributedTrainer", local)
        self._corrected = local is not None
