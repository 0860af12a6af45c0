"""Names shared by the estimators' data preparation, readers and metadata (Horovod's
``horovod.spark.common.constants``): how a column is stored in the prepared Parquet data."""

#: a Spark ML vector column written as ``array<double>``
ARRAY = "array"
#: a column of sparse vectors kept compressed (``compress_sparse=True``; written as Spark writes vectors)
CUSTOM_SPARSE = "custom_sparse_format"
#: a scalar or array column written as it is
NOCHANGE = "nochange"
