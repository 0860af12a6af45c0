"""``horovod.spark.common``: the estimators' shared parts. perseus keeps only :mod:`perseus.spark.common.store`,
whose classes raise NotImplementedError (they serve the estimators, which perseus does not implement)."""
