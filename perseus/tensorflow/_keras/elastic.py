"""Elastic callbacks for Keras models (Keras 3 and tf-keras 2), built for a given Keras module, and the
elastic state of a Keras model (:class:`KerasState`, defined in perseus.tensorflow.keras_state).

Each callback's behaviour is a plain class here (``_CommitState``...); :func:`make_elastic_callbacks` derives
the public classes from it and the Keras module's ``Callback``.
"""

from __future__ import annotations

import functools

from perseus.tensorflow._keras.classes import keras_class
from perseus.tensorflow.keras_state import KerasState

__all__ = ["KerasState", "make_elastic_callbacks"]


class _CommitState:
    """Commit the state every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class _UpdateBatchState:
    """Track the batch within the epoch in ``state.batch`` (0 at the end of an epoch); a resumed epoch
    runs only its remaining steps where Keras honours ``params['steps']``."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class _UpdateEpochState:
    """Track the number of finished epochs, across resets, in ``state.epoch``."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


@functools.lru_cache(maxsize=None)
def make_elastic_callbacks(keras):
    """CommitStateCallback, UpdateBatchStateCallback and UpdateEpochStateCallback for module ``keras``, by
    name: subclasses of its ``callbacks.Callback``."""
    base = keras.callbacks.Callback
    classes = (keras_class("CommitStateCallback", _CommitState, base),
               keras_class("UpdateBatchStateCallback", _UpdateBatchState, base),
               keras_class("UpdateEpochStateCallback", _UpdateEpochState, base))
    return {cls.__name__: cls for cls in classes}
