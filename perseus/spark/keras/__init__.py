"""``horovod.spark.keras``: Horovod's Spark ML estimator for Keras models, on perseus.

``KerasEstimator(...).fit(df)`` trains a ``tf.keras`` model (Keras 3, or tf-keras 2 with
``TF_USE_LEGACY_KERAS=1``) on a Spark DataFrame across the executors and returns a ``KerasModel`` (a Spark
``Transformer``). See :mod:`perseus.spark.keras.estimator` and docs/spark.md.
"""

from perseus.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
