"""What the Spark estimator tests share: a local[2] SparkSession for a test module, and a small regression data
set (y = 2 x0 - 3 x1 + 1) whose trained model's weights a test can check."""

import os
import sys

import numpy as np


def local_spark(app: str, memory: str = "1g", conf: dict | None = None):
    """Yield a local[2] SparkSession (stopped afterwards) with ``memory`` for the driver and ``conf`` added;
    Spark's Python workers run this interpreter, whose venv has the frameworks the ranks and transform need."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master("local[2]").appName(app)
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.memory", memory)
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "1"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def linear_df(spark, rows=400, seed=0):
    """y = 2 x0 - 3 x1 + 1 (+ small noise), x as a dense vector column ``features``; a weight column ``w`` of
    ones."""
    from pyspark.ml.linalg import DenseVector, VectorUDT
    from pyspark.sql import types as T

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = 2 * x[:, 0] - 3 * x[:, 1] + 1 + rng.normal(scale=0.01, size=rows)
    schema = T.StructType([T.StructField("features", VectorUDT()), T.StructField("y", T.DoubleType()),
                           T.StructField("w", T.DoubleType())])
    return spark.createDataFrame([(DenseVector(a), float(b), 1.0) for a, b in zip(x, y)], schema)
