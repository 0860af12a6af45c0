"""Callbacks for ``keras`` training (Horovod's horovod.keras.callbacks)."""

import keras as _keras

from perseus.tensorflow._keras.callbacks import make_callbacks

_classes = make_callbacks(_keras)
BroadcastGlobalVariablesCallback = _classes["BroadcastGlobalVariablesCallback"]
MetricAverageCallback = _classes["MetricAverageCallback"]
LearningRateScheduleCallback = _classes["LearningRateScheduleCallback"]
LearningRateWarmupCallback = _classes["LearningRateWarmupCallback"]
BestModelCheckpoint = _classes["BestModelCheckpoint"]

__all__ = list(_classes)
