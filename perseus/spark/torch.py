"""``horovod.spark.torch``: Horovod's PyTorch estimator for Spark ML, which perseus does not implement.

``TorchEstimator`` and ``TorchModel`` raise NotImplementedError when created. Train with
:func:`perseus.spark.run` and a function of your own instead (see docs/spark.md).
"""

from perseus.spark._unsupported import NotImplementedInPerseus

__all__ = ["TorchEstimator", "TorchModel"]


class TorchEstimator(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError (use :func:`perseus.spark.run`)."""

    _horovod = "horovod.spark.torch.TorchEstimator"


class TorchModel(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError (use :func:`perseus.spark.run`)."""

    _horovod = "horovod.spark.torch.TorchModel"
