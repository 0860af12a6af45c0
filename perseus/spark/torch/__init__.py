"""``horovod.spark.torch``: Horovod's Spark ML estimator for PyTorch models, on perseus.

``TorchEstimator(...).fit(df)`` trains a ``torch.nn.Module`` on a Spark DataFrame across the executors and
returns a ``TorchModel`` (a Spark ``Transformer``). See :mod:`perseus.spark.torch.estimator` and docs/spark.md.
"""

from perseus.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
