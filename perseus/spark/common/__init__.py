"""``horovod.spark.common``: the Spark estimators' shared parts: :mod:`~perseus.spark.common.store` (where data and
checkpoints live), :mod:`~perseus.spark.common.util` (the driver's data preparation and checks) and
:mod:`~perseus.spark.common.reader` (the ranks' batches of the prepared data)."""
