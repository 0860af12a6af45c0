"""The estimator and model bases: ``fit(DataFrame)`` prepares the data once in the store and trains on the
backend's ranks; the model's ``transform(DataFrame)`` adds a prediction column per label.

A framework's estimator provides ``_check_metadata_compatibility(metadata)`` and ``_fit_on_prepared_data(backend,
train_rows, val_rows, metadata, avg_row_size, dataset_idx)``; its model provides ``_predictor()``, a picklable
function from a list of feature arrays (one per feature column, rows first) to a list of output arrays (one per
label column), which every Spark task of ``transform`` calls on batches of its rows.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Iterator, List

import numpy as np
from pyspark.ml import Estimator, Model
from pyspark.ml.linalg import DenseVector, Vector, VectorUDT
from pyspark.sql import Row, SparkSession
from pyspark.sql import types as T

from perseus.spark.common import util
from perseus.spark.common.backend import SparkBackend
from perseus.spark.common.params import EstimatorParams, ModelParams

__all__ = ["HorovodEstimator", "HorovodModel", "PREDICT_BATCH_ROWS"]

#: rows a ``transform`` task hands the model at once
PREDICT_BATCH_ROWS = 256


class HorovodEstimator(Estimator, EstimatorParams):
    """``fit(df)``: the data prepared in the store (reused when the same DataFrame was prepared before), then the
    framework's training on the backend's ranks; returns the framework's model (a Spark ``Model``)."""

    def fit(self, df, params=None):
        """Train on ``df`` (a Spark DataFrame); ``params`` overrides parameters for this fit. Returns the trained
        model. Raises ValueError for a missing column, a shape that does not match, too few rows or a store
        that cannot be written, before any rank starts; ``perseus.runner.run_func.RunError`` when a rank fails."""
        return super().fit(df, params)

    def fit_on_parquet(self, params=None, dataset_idx=None):
        """Train on data already prepared in the store (``prepare_data``'s dataset ``dataset_idx``)."""
        if params:
            return self.copy(params)._fit_on_parquet(dataset_idx=dataset_idx)
        return self._fit_on_parquet(dataset_idx=dataset_idx)

    def _fit_on_parquet(self, dataset_idx=None):
        backend = self._get_or_create_backend()
        train_rows, val_rows, metadata, avg_row_size = util.get_simple_meta_from_parquet(
            self.getStore(), label_columns=self.getLabelCols(), feature_columns=self.getFeatureCols(),
            sample_weight_col=self.getSampleWeightCol(), dataset_idx=dataset_idx)
        return self._fit_on_prepared_data(backend, train_rows, val_rows, metadata, avg_row_size, dataset_idx)

    def _fit(self, df):
        self._check_before_preparing()
        backend = self._get_or_create_backend()
        with util.prepare_data(backend.num_processes(), self.getStore(), df, label_columns=self.getLabelCols(),
                               feature_columns=self.getFeatureCols(), validation=self.getValidation(),
                               sample_weight_col=self.getSampleWeightCol(),
                               compress_sparse=self.getCompressSparseCols(),
                               partitions_per_process=self.getPartitionsPerProcess(),
                               verbose=self.getVerbose()) as dataset_idx:
            train_rows, val_rows, metadata, avg_row_size = util.get_dataset_properties(dataset_idx)
            self._check_metadata_compatibility(metadata)
            return self._fit_on_prepared_data(backend, train_rows, val_rows, metadata, avg_row_size, dataset_idx)

    def _check_before_preparing(self) -> None:
        """What can be checked before the data is written.

        Raises:
            ValueError: no store, model, feature or label columns.
        """
        missing = [name for name, value in (("store", self.getStore()), ("model", self.getModel()),
                                            ("feature_cols", self.getFeatureCols()),
                                            ("label_cols", self.getLabelCols())) if not value]
        if missing:
            raise ValueError(f"{type(self).__name__}: {', '.join(missing)} must be given")

    def _get_or_create_backend(self):
        backend = self.getBackend()
        if backend is None:
            return SparkBackend(self.getNumProc(), verbose=self.getVerbose())
        if self.getNumProc() is not None:
            raise ValueError("at most one of backend and num_proc may be given (a backend knows its number of "
                             "processes)")
        return backend

    def _has_checkpoint(self, run_id: str) -> bool:
        store = self.getStore()
        path = store.get_checkpoint_path(run_id)
        return path is not None and store.exists(f"{path}/{store.get_checkpoint_filename()}")


class HorovodModel(Model, ModelParams):
    """A trained model as a Spark ``Transformer``: ``transform(df)`` adds one prediction column per label
    (``<label>__output`` unless ``setOutputCols``)."""

    def transform(self, df, params=None):
        """``df`` with the prediction columns added (see the class doc)."""
        return super().transform(df, params)

    def _predictor(self) -> Callable[[List[np.ndarray]], List[np.ndarray]]:
        raise NotImplementedError("a HorovodModel subclass provides _predictor()")

    def _output_cols(self) -> list:
        return list(self.getOrDefault(self.outputCols) if self.isDefined(self.outputCols) else
                    [f"{c}__output" for c in self.getLabelColumns()])

    def _transform(self, df):
        features, labels = list(self.getFeatureColumns()), list(self.getLabelColumns())
        outputs = self._output_cols()
        if len(outputs) != len(labels):
            raise ValueError(f"{len(outputs)} output columns for {len(labels)} label columns; setOutputCols with "
                             "one name per label")
        missing = [c for c in features if c not in df.columns]
        if missing:
            raise ValueError(f"the DataFrame lacks the feature columns {missing} (its columns: {df.columns})")
        predict = self._predictor()
        metadata = self._get_metadata() or {}
        sample = df.select(*features).limit(1).collect()
        if not sample:
            kinds = [_kind_from_metadata(metadata.get(label)) for label in labels]
        else:
            kinds = [_kind(out) for out in predict(_feature_arrays(sample, features))]
        schema = T.StructType(list(df.schema.fields) + [T.StructField(name, _spark_type(kind), True)
                                                        for name, kind in zip(outputs, kinds)])
        columns = list(df.columns)

        def run(rows: Iterator[Row]) -> Iterator[tuple]:
            chunk = []
            for row in rows:
                chunk.append(row)
                if len(chunk) == PREDICT_BATCH_ROWS:
                    yield from _predict_rows(chunk, columns, features, kinds, predict)
                    chunk = []
            if chunk:
                yield from _predict_rows(chunk, columns, features, kinds, predict)

        spark = SparkSession.builder.getOrCreate()
        return spark.createDataFrame(df.rdd.mapPartitions(run), schema)


def _feature_arrays(rows: list, features: list) -> List[np.ndarray]:
    """One array per feature column, rows first (vectors and arrays become rows of floats)."""
    out = []
    for col in features:
        values = [row[col] for row in rows]
        first = values[0]
        if isinstance(first, Vector):
            out.append(np.stack([v.toArray() for v in values]))
        elif isinstance(first, (list, tuple, np.ndarray)):
            out.append(np.asarray(values, dtype=np.float64))
        else:
            out.append(np.asarray(values))
    return out


def _kind(output: np.ndarray) -> str:
    """How an output column is written: one number per row ("double"), or a vector per row ("vector")."""
    per_row = int(np.prod(np.shape(output)[1:])) if np.ndim(output) > 1 else 1
    return "double" if per_row == 1 else "vector"


def _kind_from_metadata(meta: Any) -> str:
    if not meta:
        return "double"
    return "vector" if int(meta.get("shape", 1) or 1) > 1 else "double"


def _spark_type(kind: str):
    return VectorUDT() if kind == "vector" else T.DoubleType()


def _value(output_row: np.ndarray, kind: str):
    if kind == "vector":
        return DenseVector(np.asarray(output_row, dtype=np.float64).reshape(-1))
    value = np.asarray(output_row).reshape(-1)[0].item()
    return float(value) if isinstance(value, numbers.Number) else value


def _predict_rows(rows: list, columns: list, features: list, kinds: list, predict) -> Iterator[tuple]:
    outputs = predict(_feature_arrays(rows, features))
    for i, row in enumerate(rows):
        yield tuple(row[c] for c in columns) + tuple(_value(out[i], kind) for out, kind in zip(outputs, kinds))
