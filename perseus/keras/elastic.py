"""Elastic ``keras`` training (Horovod's horovod.keras.elastic): KerasState, the commit/update
callbacks and ``run`` (see perseus.tensorflow.elastic)."""

import keras as _keras

from perseus.tensorflow._keras.elastic import KerasState, make_elastic_callbacks
from perseus.tensorflow.elastic import run

_classes = make_elastic_callbacks(_keras)
CommitStateCallback = _classes["CommitStateCallback"]
UpdateBatchStateCallback = _classes["UpdateBatchStateCallback"]
UpdateEpochStateCallback = _classes["UpdateEpochStateCallback"]

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
