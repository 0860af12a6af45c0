"""Keras helpers of the Spark Keras estimator, for the driver and the ranks alike.

The Keras is ``tf.keras``: Keras 3 (TensorFlow backend), or tf-keras 2 when ``TF_USE_LEGACY_KERAS=1``. Models
travel and are stored in Keras' own saving format (the ``.keras`` archive) as bytes; optimizers as their Keras
configuration plus the values of their variables; a run's progress (epoch, history, learning rate, optimizer
values) as a small ``.npz`` file beside its checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import warnings
from typing import Optional

import numpy as np
from tensorflow import keras

__all__ = ["keras", "is_keras3", "check_model", "model_to_bytes", "model_from_bytes", "weights_into",
           "model_shapes", "optimizer_config", "optimizer_from_config", "optimizer_values", "restore_optimizer",
           "get_lr", "set_lr", "progress_to_bytes", "progress_from_bytes", "merge_history"]

_ZIP = b"PK"
_HDF5 = b"\x89HDF"


def is_keras3() -> bool:
    """True when ``tf.keras`` is Keras 3 (False for tf-keras 2)."""
    return keras.Model.__module__.startswith("keras.")


def check_model(model) -> None:
    """Raises ValueError unless ``model`` is a model of this process's ``tf.keras``."""
    if not isinstance(model, keras.Model):
        which = "Keras 3" if is_keras3() else "tf-keras 2 (TF_USE_LEGACY_KERAS=1)"
        raise ValueError(f"model must be a tf.keras Model ({which} here), not {type(model).__module__}."
                         f"{type(model).__name__}; a model of the other Keras needs TF_USE_LEGACY_KERAS set "
                         "accordingly before TensorFlow is imported")


def model_to_bytes(model) -> bytes:
    """The model (architecture, weights and, when compiled, its optimizer) as ``.keras`` archive bytes.

    Raises: what Keras' ``model.save`` raises (a model whose layers cannot be serialised)."""
    with tempfile.TemporaryDirectory(prefix="perseus-keras-") as tmp, warnings.catch_warnings():
        # Keras 3 converts its variables with np.array(x, copy=False), which NumPy 2 warns about
        warnings.filterwarnings("ignore", message="__array__ implementation doesn't accept a copy keyword",
                                category=DeprecationWarning)
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def _suffix(data: bytes, weights_only: bool = False) -> str:
    if data[:2] == _ZIP:
        return ".keras"
    if data[:4] == _HDF5:
        return ".weights.h5" if weights_only and is_keras3() else ".h5"
    raise ValueError("not a Keras model file (neither a .keras archive nor HDF5)")


def model_from_bytes(data: bytes, custom_objects: Optional[dict] = None, compile: bool = False):
    """The model saved in ``data`` (a ``.keras`` archive, or a whole model in HDF5), with ``custom_objects``.

    Raises: ValueError for bytes that are not a Keras model file, or a file holding weights only (see
    :func:`weights_into`); what ``keras.models.load_model`` raises (an unknown custom object, named)."""
    custom_objects = dict(custom_objects or {})
    with tempfile.TemporaryDirectory(prefix="perseus-keras-") as tmp:
        path = os.path.join(tmp, "model" + _suffix(data))
        with open(path, "wb") as f:
            f.write(data)
        with keras.utils.custom_object_scope(custom_objects):
            return keras.models.load_model(path, custom_objects=custom_objects, compile=compile, safe_mode=False)


def weights_into(model, data: bytes) -> None:
    """Load the weights in ``data`` (a weights file, HDF5, or a ``.keras`` archive) into ``model``."""
    with tempfile.TemporaryDirectory(prefix="perseus-keras-") as tmp:
        path = os.path.join(tmp, "weights" + _suffix(data, weights_only=True))
        with open(path, "wb") as f:
            f.write(data)
        model.load_weights(path)


def _dims(shape) -> list:
    return [int(d) if d is not None else -1 for d in list(shape)]


def model_shapes(model) -> tuple:
    """``(input_shapes, output_shapes)``: one list per input or output, -1 for unknown dimensions (the batch);
    ``(None, None)`` when the model does not know them (a subclassed model never called)."""
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        return None, None
    if not inputs or not outputs:
        return None, None
    return [_dims(t.shape) for t in inputs], [_dims(t.shape) for t in outputs]


def optimizer_config(optimizer) -> dict:
    """The optimizer's Keras serialisation (class and configuration), without its variables."""
    return keras.optimizers.serialize(optimizer)


def optimizer_from_config(config: dict, custom_objects: Optional[dict] = None):
    """A new optimizer from :func:`optimizer_config`'s result."""
    return keras.optimizers.deserialize(config, custom_objects=dict(custom_objects or {}))


def _variables(optimizer) -> list:
    variables = optimizer.variables
    if callable(variables):
        variables = variables()
    return list(variables)


def _built(optimizer) -> bool:
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def optimizer_values(optimizer) -> Optional[list]:
    """The values of the optimizer's variables (iterations, slots...) when it has been built; else None."""
    if not _built(optimizer):
        return None
    return [np.array(v.numpy() if hasattr(v, "numpy") else v) for v in _variables(optimizer)]


def restore_optimizer(optimizer, model, values: list) -> None:
    """Build ``optimizer`` over ``model``'s trainable variables and give its variables ``values`` (from
    :func:`optimizer_values` of the same optimizer class over the same model).

    Raises: ValueError when the number of variables differs (an optimizer state of another model)."""
    if not _built(optimizer):
        if hasattr(optimizer, "build"):
            optimizer.build(model.trainable_variables)
        else:  # legacy tf-keras optimizers
            optimizer._create_all_weights(model.trainable_variables)
    variables = _variables(optimizer)
    if len(variables) != len(values):
        raise ValueError(f"the saved optimizer state has {len(values)} variables, the optimizer over this model "
                         f"{len(variables)}: it belongs to another model or optimizer")
    for var, value in zip(variables, values):
        var.assign(value)


def get_lr(optimizer) -> Optional[float]:
    """The optimizer's constant learning rate, or None when it follows a schedule."""
    configured = optimizer.get_config().get("learning_rate")
    if isinstance(configured, dict):
        return None
    value = optimizer.learning_rate
    return float(np.asarray(value.numpy() if hasattr(value, "numpy") else value))


def set_lr(optimizer, value: Optional[float]) -> None:
    """Set a constant learning rate (nothing for None)."""
    if value is not None:
        optimizer.learning_rate = value


def progress_to_bytes(epoch: int, history: dict, learning_rate: Optional[float], values: Optional[list]) -> bytes:
    """A run's progress after ``epoch`` as ``.npz`` bytes (read back with :func:`progress_from_bytes`)."""
    arrays = {"epoch": np.asarray(epoch, np.int64), "history": np.asarray(json.dumps(history)),
              "learning_rate": np.asarray(np.nan if learning_rate is None else learning_rate, np.float64)}
    if values is not None:
        arrays.update({f"optimizer_{i}": np.asarray(v) for i, v in enumerate(values)})
        arrays["optimizer_count"] = np.asarray(len(values), np.int64)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def progress_from_bytes(data: bytes) -> dict:
    """``{"epoch", "history", "learning_rate" (None for a schedule), "optimizer_values" (None when not
    saved)}`` from :func:`progress_to_bytes`'s bytes."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        lr = float(z["learning_rate"])
        count = int(z["optimizer_count"]) if "optimizer_count" in z.files else None
        return {"epoch": int(z["epoch"]), "history": json.loads(str(z["history"])),
                "learning_rate": None if np.isnan(lr) else lr,
                "optimizer_values": None if count is None else [z[f"optimizer_{i}"] for i in range(count)]}


def merge_history(before: dict, after: dict) -> dict:
    """Keras history dicts (``{metric: [value per epoch]}``) of two consecutive parts of a run, joined."""
    keys = list(before) + [k for k in after if k not in before]
    return {k: list(before.get(k, [])) + list(after.get(k, [])) for k in keys}
