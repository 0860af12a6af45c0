"""``horovod.spark.lightning``: Horovod's PyTorch Lightning estimator for Spark ML, which perseus does not
implement.

``TorchEstimator`` (also ``LightningEstimator``) and ``TorchModel`` (also ``LightningModel``) raise
NotImplementedError when created. Train with :func:`perseus.spark.run` and a function of your own instead
(see docs/spark.md).
"""

from perseus.spark._unsupported import NotImplementedInPerseus

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator", "LightningModel"]


class TorchEstimator(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError (use :func:`perseus.spark.run`)."""

    _horovod = "horovod.spark.lightning.TorchEstimator"


class TorchModel(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError (use :func:`perseus.spark.run`)."""

    _horovod = "horovod.spark.lightning.TorchModel"


LightningEstimator = TorchEstimator
LightningModel = TorchModel
