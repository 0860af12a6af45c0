"""Elastic state of a Keras model and its optimizer (Keras 3 and tf-keras 2): Horovod's ``KerasState``, also
``perseus.tensorflow.elastic.TensorFlowKerasState``."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from perseus.runtime.state import runtime
from perseus.elastic.state import ObjectState
from perseus.tensorflow.keras_values import broadcast_values
from perseus.tensorflow.functions import broadcast_object

__all__ = ["KerasState"]


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    variables = optimizer.variables
    if callable(variables) and not isinstance(variables, list):
        variables = variables()
    return list(variables)


def _build_optimizer(optimizer, model) -> None:
    """Give an optimizer that makes its slot variables lazily its slots now, for the model's trainable
    variables, as its first step would: otherwise a restore to a commit taken before that step finds more
    variables than the commit holds."""
    if optimizer is None:
        return
    variables = model.trainable_variables
    if hasattr(optimizer, "built") and callable(getattr(optimizer, "build", None)):  # Keras 3
        if not optimizer.built:
            optimizer.build(variables)
    elif hasattr(optimizer, "_build_index_dict"):  # tf-keras 2
        if not getattr(optimizer, "_built", False):
            optimizer.build(variables)
    elif callable(getattr(optimizer, "_create_all_weights", None)):  # tf-keras 2's legacy optimizers
        with tf.init_scope():
            optimizer._create_all_weights(variables)  # adds only what is missing


def _model_built(model) -> bool:
    return bool(getattr(model, "built", False)) and bool(model.variables)


def _snapshot(variables):
    return [np.array(v.numpy() if hasattr(v, "numpy") else v, copy=True) for v in variables]


class KerasState(ObjectState):
    """Elastic state of a Keras model and optimizer, plus any keyword values (``epoch=0, batch=0``).

    ``commit()`` copies the model's and the optimizer's variables to host memory; ``restore()`` writes the
    copy back; ``sync()`` broadcasts rank 0's variables and values to every rank. The model must be built; an
    optimizer that has not made its slot variables yet makes them here (``optimizer.build`` on the model's
    trainable variables), so that the state holds them from the first commit on.

    Args:
        model: a built Keras model.
        optimizer: the optimizer (default ``model.optimizer``).
        kwargs: more values to keep, exposed as attributes.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not _model_built(model):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        _build_optimizer(self.optimizer, model)
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=runtime().rank, **kwargs)

    def _variables(self):
        return list(self.model.variables) + _optimizer_variables(self.optimizer)

    def _save_model(self):
        self._saved_model_state = _snapshot(self._variables())

    def _load_model(self):
        variables = self._variables()
        if len(variables) != len(self._saved_model_state):
            raise RuntimeError(f"KerasState: the model/optimizer now has {len(variables)} variables, the "
                               f"commit has {len(self._saved_model_state)}; commit after the optimizer is built")
        for var, value in zip(variables, self._saved_model_state):
            var.assign(value)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def snapshot_payload(self):
        return {"objects": self._saved_state, "variables": self._saved_model_state}

    def load_snapshot_payload(self, payload):
        self._saved_model_state = list(payload["variables"])
        self._saved_state = dict(payload["objects"])
        if self.optimizer is not None and len(self._variables()) < len(self._saved_model_state):
            build = getattr(self.optimizer, "build", None)
            if callable(build):  # Keras 3 builds its slots lazily; the commit has them
                build(self.model.trainable_variables)

    def sync(self):
        variables = self._variables()
        for var, value in zip(variables, broadcast_values(variables, 0, "KerasState.sync")):
            var.assign(value)
        self._save_model()
        super().sync()
