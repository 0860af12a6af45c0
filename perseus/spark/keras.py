"""``horovod.spark.keras``: Horovod's Keras estimator for Spark ML, which perseus does not implement.

``KerasEstimator`` and ``KerasModel`` raise NotImplementedError when created. Train with
:func:`perseus.spark.run` and a function of your own instead (see docs/spark.md).
"""

from perseus.spark._unsupported import NotImplementedInPerseus

__all__ = ["KerasEstimator", "KerasModel"]


class KerasEstimator(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError (use :func:`perseus.spark.run`)."""

    _horovod = "horovod.spark.keras.KerasEstimator"


class KerasModel(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError (use :func:`perseus.spark.run`)."""

    _horovod = "horovod.spark.keras.KerasModel"
