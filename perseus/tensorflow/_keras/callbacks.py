"""Keras callbacks for distributed training, built for a given Keras module (Keras 3 or tf-keras 2).

The callbacks talk to the other ranks through perseus' NumPy-level collectives, eagerly, between steps, so
they work the same with any Keras backend and whether or not ``model.fit`` compiles its step. Each callback's
behaviour is a plain class here (``_MetricAverage``...); :func:`make_callbacks` derives the public classes from
it and the Keras module's ``Callback`` (or ``ModelCheckpoint``).
"""

from __future__ import annotations

import functools

import numpy as np

from perseus.runtime.state import runtime
from perseus.tensorflow._keras.classes import keras_class
from perseus.tensorflow.keras_values import allreduce_value, broadcast_values
from perseus.tensorflow.gradient_aggregation import is_model_parallel, var_key

__all__ = ["make_callbacks"]


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    if callable(variables) and not isinstance(variables, list):
        variables = variables()
    return list(variables)


def _to_float(value) -> float:
    if hasattr(value, "numpy"):
        value = value.numpy()
    return float(np.asarray(value))


def _get_lr(optimizer) -> float:
    lr = optimizer.learning_rate
    if callable(lr) and not hasattr(lr, "numpy"):
        raise ValueError("perseus: the learning-rate callbacks need a constant learning rate, not a schedule "
                         f"({type(lr).__name__}); use either the schedule or the callback")
    return _to_float(lr)


def _momentum_variable(optimizer):
    """Where momentum can be changed between steps: a variable, or a legacy optimizer hyper-parameter. A
    plain float (Keras 3 and tf-keras 2 new optimizers) is baked into the compiled step: None."""
    momentum = getattr(optimizer, "momentum", None)
    if momentum is None:
        return None
    if hasattr(momentum, "assign"):
        return momentum
    hyper = getattr(optimizer, "_hyper", None)
    if isinstance(hyper, dict) and "momentum" in hyper:
        return "hyper"
    return None


def _set_momentum(optimizer, where, value):
    if where == "hyper":
        optimizer.momentum = value
    else:
        where.assign(value)


class _BroadcastGlobalVariables:
    """Broadcast the model's and the optimizer's variables from ``root_rank`` once, at the end of the first
    batch (when the optimizer's variables exist), so every rank continues from the same state.

    ``local_variables`` (or :meth:`register_local_var`) are left alone. ``device`` is accepted for
    compatibility. Every rank must use the callback.
    """

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = set()
        for var in local_variables or []:
            self.register_local_var(var)

    def register_local_var(self, var):
        """Do not broadcast ``var``."""
        self._local_vars.add(var_key(var))

    def _broadcast(self):
        # Per-rank shards (DistributedEmbedding) and their optimizer slots (named after the shard's path)
        # stay as they are.
        shards = tuple(str(getattr(v, "path", v.name)).replace("/", "_") + "_" for v in self.model.variables
                       if is_model_parallel(v))
        variables = [v for v in self.model.variables
                     if var_key(v) not in self._local_vars and not is_model_parallel(v)]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += [v for v in _optimizer_variables(optimizer) if var_key(v) not in self._local_vars
                          and not (shards and str(v.name).startswith(shards))]
        values = broadcast_values(variables, self.root_rank, "BroadcastGlobalVariablesCallback")
        for var, value in zip(variables, values):
            var.assign(value)

    def on_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


class _MetricAverage:
    """At the end of every epoch replace each metric in ``logs`` by its average over the ranks (so that
    callbacks after this one, e.g. checkpointing or early stopping, agree on every rank)."""

    def __init__(self, device=''):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        for metric in sorted(logs):
            value = logs[metric]
            if isinstance(value, (int, float, np.number, np.ndarray)) or hasattr(value, "numpy"):
                reduced = allreduce_value(np.asarray(_to_float(value), np.float64),
                                          name=f"MetricAverageCallback.{metric}")
                logs[metric] = float(reduced)


class _LearningRateSchedule:
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in [start_epoch, end_epoch).

    A constant ``multiplier`` means ``multiplier ** (epoch - start_epoch)``. With ``staircase`` the rate
    changes at the first batch of an epoch, otherwise at every batch with fractional epochs (then the steps
    per epoch are taken from ``steps_per_epoch`` or from fit's parameters). With ``momentum_correction``
    the momentum is scaled by new_lr/old_lr for the batch where the rate changes, where the optimizer keeps
    momentum in a variable (legacy tf-keras optimizers); a plain-float momentum is left as it is.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch; pass steps_per_epoch to "
                         f"{type(self).__name__}()")

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        where = _momentum_variable(optimizer) if self.momentum_correction else None
        if where is not None and old_lr:
            current = _to_float(optimizer.momentum)
            self.restore_momentum = (where, current)
            _set_momentum(optimizer, where, current * new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch is None or self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        if self.restore_momentum is not None:
            where, value = self.restore_momentum
            _set_momentum(self.model.optimizer, where, value)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class _LearningRateWarmup:
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` epochs,
    batch by batch (Goyal et al.'s gradual warm-up for large global batches)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0):
        def multiplier(epoch):
            size = runtime().size()
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime().rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class _BestModelCheckpoint:
    """Save the best model seen so far (``save_best_only``), judged by ``monitor``.

    ``filepath`` may be given later (``callback.filepath = ...``) but must be set before ``fit`` starts.
    Use it on rank 0 only, after a MetricAverageCallback so the monitored value is the global one.
    """

    def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto',
                 save_freq='epoch', filepath=None):
        suffix = ".weights.h5" if save_weights_only else ".keras"
        super().__init__(filepath=filepath or f"unset{suffix}", monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint.filepath is not set: pass filepath= or assign "
                             "callback.filepath before fit()")
        parent = getattr(super(), "on_train_begin", None)
        if parent is not None:
            parent(logs)


@functools.lru_cache(maxsize=None)
def make_callbacks(keras):
    """The callback classes for the Keras module ``keras`` (``tf.keras`` or the ``keras`` package), by name:
    BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback (a subclass of LearningRateScheduleCallback) and BestModelCheckpoint."""
    base = keras.callbacks.Callback
    schedule = keras_class("LearningRateScheduleCallback", _LearningRateSchedule, base)
    classes = (keras_class("BroadcastGlobalVariablesCallback", _BroadcastGlobalVariables, base),
               keras_class("MetricAverageCallback", _MetricAverage, base),
               schedule,
               keras_class("LearningRateWarmupCallback", _LearningRateWarmup, schedule),
               keras_class("BestModelCheckpoint", _BestModelCheckpoint, keras.callbacks.ModelCheckpoint))
    return {cls.__name__: cls for cls in classes}
