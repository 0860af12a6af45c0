"""``horovod.spark.lightning``: Horovod's Spark ML estimator for PyTorch Lightning models, on perseus.

``TorchEstimator(...).fit(df)`` (also ``LightningEstimator``) trains a ``pytorch_lightning.LightningModule`` on a
Spark DataFrame across the executors, one Lightning ``Trainer`` per rank with
:class:`~perseus.spark.lightning.strategy.PerseusStrategy`, and returns a ``TorchModel`` (also
``LightningModel``; a Spark ``Transformer``). Needs pytorch_lightning 2 (``pip install 'perseus[spark,lightning]'``;
importing this package without it raises ImportError saying so). See :mod:`perseus.spark.lightning.estimator` and
docs/spark.md.
"""

from perseus.spark.lightning.estimator import TorchEstimator, TorchModel

LightningEstimator = TorchEstimator
LightningModel = TorchModel

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator", "LightningModel"]
