"""``horovod.spark.common.util``: the driver's data preparation for the Spark estimators, and their checks.

:func:`prepare_data` writes the DataFrame's feature, label and sample-weight columns as Parquet into the store
(``intermediate_train_data.<idx>``, and ``intermediate_val_data.<idx>`` with validation) and yields the
dataset index; :func:`get_dataset_properties` gives its row counts and metadata. The format is described in
:mod:`perseus.spark.common._dataframe`; ranks read it with :class:`perseus.spark.common.reader.ParquetBatches`.

Metadata (one entry per column, Horovod's keys plus ``dtype``)::

    {column: {"spark_data_type": "DoubleType" | "LongType" | ... | "ArrayType" | "DenseVector" | "SparseVector",
              "is_sparse_vector_only": bool, "shape": int (values per row, 1 for scalars),
              "intermediate_format": "nochange" | "array" | "custom_sparse_format",
              "max_size": int (most values stored per row), "dtype": numpy dtype name of the batch values}}

Every check runs before anything is written (a write probe of the store aside), so that a bad input is one
clear error before any rank starts.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import threading
from typing import Optional

import numpy as np

from perseus.base.knobs import external
from perseus.spark.common import _dataframe as frame

__all__ = ["prepare_data", "get_dataset_properties", "clear_training_cache", "check_validation",
           "check_shape_compatibility", "to_list", "get_simple_meta_from_parquet", "is_databricks",
           "check_store_writable", "METADATA_FILE"]

# Written beside the Parquet files of each prepared split (hidden from Parquet readers by its leading "_").
METADATA_FILE = "_perseus_metadata.json"
_ARROW_TYPES = {"int8": "ByteType", "int16": "ShortType", "int32": "IntegerType", "int64": "LongType",
                "float": "FloatType", "double": "DoubleType", "bool": "BooleanType", "string": "StringType",
                "large_string": "StringType", "binary": "BinaryType", "large_binary": "BinaryType"}


def is_databricks() -> bool:
    """True on a Databricks runtime (``DATABRICKS_RUNTIME_VERSION`` is set)."""
    return external("DATABRICKS_RUNTIME_VERSION") is not None


def to_list(var, length: int):
    """``var`` as a list of ``length`` items: None stays None; a single value (or a one-item list) is repeated.

    Raises:
        ValueError: a list of another length.
    """
    if var is None:
        return None
    if not isinstance(var, list):
        var = [var]
    if len(var) == 1:
        return [var[0]] * length
    if len(var) != length:
        raise ValueError(f"List {var} must be length {length} (found: {len(var)})")
    return var


def check_validation(validation, df=None) -> None:
    """Check Horovod's ``validation`` parameter: None/0, a fraction in [0, 1), or a column name (of ``df``).

    Raises:
        ValueError: a fraction outside [0, 1), a column ``df`` lacks (listing its columns), any other type.
    """
    if not validation:
        return
    if isinstance(validation, bool) or not isinstance(validation, (float, int, str)):
        raise ValueError(f"validation must be a fraction in [0, 1) or a column name, not {validation!r}")
    if isinstance(validation, str):
        if df is not None and validation not in df.columns:
            raise ValueError(f"the validation column {validation!r} is not in the DataFrame (its columns: "
                             f"{', '.join(df.columns)})")
    elif not 0 <= validation < 1:
        raise ValueError(f"Validation split {validation} must be in the range: [0, 1)")


def check_shape_compatibility(metadata, feature_columns, label_columns, input_shapes=None, output_shapes=None,
                              label_shapes=None) -> None:
    """Check that each feature column holds as many values per row as its model input takes (the product of
    ``input_shapes[i]``, -1 counting as 1), and each label column as many as ``label_shapes[i]`` (else
    ``output_shapes[i]``). Columns whose metadata ``shape`` is None are not checked.

    Raises:
        ValueError: a count or size that differs, naming the column, both sizes and the index.
    """
    def check(columns, shapes, what):
        for idx, (col, shape) in enumerate(zip(columns, shapes)):
            size = metadata[col]["shape"]
            want = abs(int(np.prod(shape)))
            if size is not None and size != want:
                raise ValueError(f"{what[0]} column {col!r} has {size} values per row, but the {what[1]} at index "
                                 f"{idx} has shape {list(shape)} ({want} values)")

    if input_shapes is not None:
        if len(feature_columns) != len(input_shapes):
            raise ValueError(f"Feature column count {len(feature_columns)} must equal model inputs count "
                             f"{len(input_shapes)}")
        check(feature_columns, input_shapes, ("Feature", "model input"))
    for shapes, what in ((label_shapes, "provided label shapes"), (output_shapes, "model outputs")):
        if shapes is not None and len(label_columns) != len(shapes):
            raise ValueError(f"Label column count {len(label_columns)} must equal {what} count {len(shapes)}")
    if label_shapes is not None:
        check(label_columns, label_shapes, ("Label", "label shape"))
    elif output_shapes is not None:
        check(label_columns, output_shapes, ("Label", "model output"))


def check_store_writable(store) -> None:
    """Write and remove a small file under the store's prefix path (stores without ``check_writable`` pass).

    Raises:
        OSError: the path cannot be written, naming it.
    """
    check = getattr(store, "check_writable", None)
    if check is not None:
        check()


class _TrainingCache:
    """Which DataFrame each dataset index holds, in this process. An index is reused for a new DataFrame only
    when no running ``prepare_data`` uses it."""

    def __init__(self):
        self.lock = threading.RLock()
        self.clear()

    def clear(self):
        self.in_use = collections.Counter()
        self.key_to_idx, self.idx_to_key, self.props = {}, {}, {}

    @contextlib.contextmanager
    def use(self, key):
        with self.lock:
            self.in_use[key] += 1
        try:
            yield
        finally:
            with self.lock:
                self.in_use[key] -= 1

    def lookup(self, key, store, has_val: bool) -> Optional[int]:
        """The index already holding ``key``'s data, whose Parquet is still in the store; else None."""
        idx = self.key_to_idx.get(key)
        if idx is None or self.idx_to_key.get(idx) != key or idx not in self.props:
            return None
        if not store.is_parquet_dataset(store.get_train_data_path(idx)):
            return None
        if has_val and not store.is_parquet_dataset(store.get_val_data_path(idx)):
            return None
        return idx

    def free_index(self, key) -> int:
        idx = 0
        while self.idx_to_key.get(idx) not in (None, key) and self.in_use[self.idx_to_key[idx]] > 0:
            idx += 1
        return idx

    def remember(self, idx: int, key, props: tuple) -> None:
        old = self.idx_to_key.get(idx)
        if old is not None and old != key:
            self.key_to_idx.pop(old, None)
        self.idx_to_key[idx], self.key_to_idx[key], self.props[idx] = key, idx, props


_cache = _TrainingCache()


def _plan_digest(df) -> str:
    """A digest of the DataFrame's analyzed plan (its sources, expressions and their ids)."""
    try:
        text = df._jdf.queryExecution().analyzed().toString()
    except AttributeError:  # Spark Connect: no JVM plan here; the semantic hash and the object stand in
        text = f"{df.semanticHash()}:{id(df)}"
    return hashlib.sha256(text.encode()).hexdigest()


def _columns_to_prepare(num_processes, df, label_columns, feature_columns, validation, sample_weight_col,
                        partitions_per_process) -> list:
    """Check the arguments (no Spark job) and give the columns to write: features, labels, sample weight.

    Raises:
        ValueError: see :func:`prepare_data`.
    """
    check_validation(validation, df=df)
    if num_processes <= 0 or partitions_per_process <= 0:
        raise ValueError(f"num_proc={num_processes} and partitions_per_process={partitions_per_process} must both "
                         "be > 0")
    if not label_columns:
        raise ValueError("Parameter label_columns cannot be None or empty")
    label_columns = list(label_columns)
    if feature_columns is None:
        skip = set(label_columns) | {sample_weight_col, validation}
        feature_columns = [c for c in df.columns if c not in skip]
    wanted = list(feature_columns) + label_columns + ([sample_weight_col] if sample_weight_col else [])
    missing = [c for c in wanted if c not in df.columns]
    if missing:
        raise ValueError(f"the DataFrame has no column {', '.join(repr(c) for c in dict.fromkeys(missing))} (its "
                         f"columns: {', '.join(df.columns)})")
    if not feature_columns:
        raise ValueError("there are no feature columns: the DataFrame has only the label (and weight) columns")
    return list(dict.fromkeys(wanted))


@contextlib.contextmanager
def prepare_data(num_processes, store, df, label_columns, feature_columns, validation=None,
                 sample_weight_col=None, compress_sparse=False, partitions_per_process=10, verbose=0, seed=0):
    """Write ``df``'s feature, label and sample-weight columns into ``store`` as Parquet for
    ``num_processes`` ranks, and yield the dataset index (a context manager: the index stays reserved for this
    DataFrame while the block runs). Runs on the driver.

    ``validation``: None (no split), a fraction in (0, 1) (rows drawn with ``rand(seed)``), or a column whose
    true (non-zero) rows are the validation split. ``feature_columns`` None: every column but the labels, the
    sample weight and the validation column. ``compress_sparse``: vector columns holding only sparse vectors
    stay sparse in the Parquet (the reader densifies each batch); other vectors always become arrays. Each split
    is written in ``num_processes * partitions_per_process`` files (in proportion to its share of the rows, at
    least ``num_processes``). The same DataFrame (the same plan), columns and validation prepared before in this
    process, whose Parquet is still in the store, is reused without a Spark job (:func:`clear_training_cache`
    forgets). A Spark job measures the data first; every check below raises before anything is written.

    Raises:
        ValueError: a bad ``validation``, ``num_processes`` or ``partitions_per_process``; no label columns; a
            missing column (named, with the DataFrame's columns); a column of a type a model cannot take; null
            values; arrays or vectors of different lengths; an empty DataFrame or split; fewer training or
            validation rows than ``num_processes``.
        OSError: the store's path cannot be written.
    """
    columns = _columns_to_prepare(num_processes, df, label_columns, feature_columns, validation,
                                  sample_weight_col, partitions_per_process)
    key = (_plan_digest(df), store.get_train_data_path(), store.get_val_data_path(), validation, tuple(columns),
           bool(compress_sparse), num_processes, partitions_per_process, seed)
    with _cache.use(key):
        with _cache.lock:
            idx = _cache.lookup(key, store, bool(validation))
            if idx is not None:
                if verbose:
                    print(f"prepare_data: reusing dataset {idx} ({store.get_train_data_path(idx)})", flush=True)
            else:
                kinds = frame.column_kinds(df, columns)
                flag = frame.split_flag(df, validation, seed)
                check_store_writable(store)
                idx = _cache.free_index(key)
                props = _write_dataset(num_processes, store, df, kinds, flag, validation, compress_sparse,
                                       num_processes * partitions_per_process, idx, verbose)
                _cache.remember(idx, key, props)
        yield idx


def _write_dataset(num_processes, store, df, kinds, flag, validation, compress_sparse, num_partitions, idx,
                   verbose) -> tuple:
    """Measure, check and write the splits of dataset ``idx``; its properties (see get_dataset_properties)."""
    from pyspark import StorageLevel

    base = frame.selected(df, kinds, flag).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        m = frame.measure(base, kinds, compress_sparse)
        frame.check_measures(m, kinds, num_processes, validation)
        metadata = frame.metadata_of(kinds, m, compress_sparse)
        out = frame.converted(base, kinds, metadata)
        ratio = m.val_rows / m.rows
        splits = [(store.get_train_data_path(idx), False if validation else None, 1.0 - ratio)]
        if validation:
            splits.append((store.get_val_data_path(idx), True, ratio))
        found = []
        for path, is_val, share in splits:
            parts = max(int(num_partitions * share), num_processes)
            if verbose:
                print(f"prepare_data: writing {path} in {parts} partitions", flush=True)
            frame.write_split(out, path, parts, is_val)
            found.append(_written(store, path, metadata))
    finally:
        base.unpersist()
    (train_rows, train_bytes), (val_rows, _) = found[0], (found[1] if validation else (0, 0))
    for what, rows in (("training", train_rows), ("validation", val_rows if validation else None)):
        if rows is not None and rows < num_processes:  # only when the data changed between two reads of it
            raise ValueError(f"{rows} {what} rows were written for num_proc={num_processes} processes: the "
                             "DataFrame gave other rows when written than when measured (is it deterministic?)")
    if verbose:
        print(f"prepare_data: dataset {idx}: {train_rows} training rows, {val_rows} validation rows", flush=True)
    return train_rows, val_rows, metadata, train_bytes / max(train_rows, 1)


def _written(store, path, metadata) -> tuple:
    """(rows, uncompressed bytes) of the Parquet at ``path``; writes the metadata file beside it."""
    rows, size, _groups = _parquet_totals(store, path)
    store.write_text(f"{path}/{METADATA_FILE}", json.dumps({"metadata": metadata, "rows": rows,
                                                              "total_byte_size": size}, sort_keys=True))
    return rows, size


def _parquet_totals(store, path) -> tuple:
    """(rows, uncompressed bytes, row groups) of the Parquet files at ``path``, from their footers."""
    import pyarrow.parquet as pq

    rows = size = groups = 0
    for name in store.list_parquet_files(path):
        with store.fs.open(name, "rb") as f:
            md = pq.ParquetFile(f).metadata
        rows += md.num_rows
        groups += md.num_row_groups
        size += sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
    return rows, size, groups


def _get_metadata(df, compress_sparse: bool = False) -> dict:
    """The metadata of every column of ``df`` (one Spark job over it), as ``prepare_data`` records it (Horovod's
    name; its tests call it).

    Raises:
        ValueError: a column of a type a model cannot take (named).
    """
    columns = frame.column_kinds(df, list(df.columns))
    return frame.metadata_of(columns, frame.measure(df, columns, compress_sparse), compress_sparse)


def get_dataset_properties(dataset_idx) -> tuple:
    """``(train_rows, val_rows, metadata, avg_row_size)`` of a dataset ``prepare_data`` wrote in this process
    (``avg_row_size``: uncompressed bytes per training row).

    Raises:
        KeyError: no such dataset in this process.
    """
    return _cache.props[dataset_idx]


def clear_training_cache() -> None:
    """Forget the prepared datasets (their files stay in the store; the next ``prepare_data`` rewrites)."""
    with _cache.lock:
        _cache.clear()


def _arrow_metadata(field) -> dict:
    """Metadata of a Parquet column from its Arrow type alone (lengths unknown: ``shape`` None for lists)."""
    import pyarrow as pa

    t = field.type
    if pa.types.is_struct(t) and {f.name for f in t} >= {"type", "size", "indices", "values"}:
        return dict(spark_data_type="SparseVector", is_sparse_vector_only=False, shape=None,
                    intermediate_format="custom_sparse_format", max_size=None, dtype="float64")
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        size = t.list_size if pa.types.is_fixed_size_list(t) else None
        return dict(spark_data_type="ArrayType", is_sparse_vector_only=False, shape=size,
                    intermediate_format="nochange", max_size=size, dtype=t.value_type.to_pandas_dtype().__name__)
    name = _ARROW_TYPES.get(str(t), type(t).__name__)
    dtype = frame.SCALAR_DTYPES.get(name, "object")
    return dict(spark_data_type=name, is_sparse_vector_only=False, shape=1, intermediate_format="nochange",
                max_size=1, dtype=dtype)


def get_simple_meta_from_parquet(store, label_columns, feature_columns, sample_weight_col, dataset_idx=None):
    """``(train_rows, val_rows, metadata, avg_row_size)`` of Parquet data already in the store (the estimators'
    ``fit_on_parquet``): from the metadata file ``prepare_data`` wrote, else from the Parquet schema and footers.

    Raises:
        ValueError: no Parquet data at the training path, or a column it lacks (listing its columns).
    """
    import pyarrow.parquet as pq

    train_path, val_path = store.get_train_data_path(dataset_idx), store.get_val_data_path(dataset_idx)
    files = store.list_parquet_files(train_path)
    if not files:
        raise ValueError(f"no Parquet data at {train_path} in the store: prepare it first (fit(df) does)")
    columns = list(feature_columns or []) + list(label_columns or []) + ([sample_weight_col]
                                                                         if sample_weight_col else [])
    with store.fs.open(files[0], "rb") as f:
        schema = pq.ParquetFile(f).schema_arrow
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ValueError(f"the Parquet data at {train_path} has no column {', '.join(map(repr, missing))} (its "
                         f"columns: {', '.join(schema.names)})")
    saved = {}
    if store.exists(f"{train_path}/{METADATA_FILE}"):
        saved = json.loads(store.read(f"{train_path}/{METADATA_FILE}")).get("metadata", {})
    metadata = {c: saved.get(c) or _arrow_metadata(schema.field(c)) for c in columns}
    train_rows, size, _ = _parquet_totals(store, train_path)
    val_rows = _parquet_totals(store, val_path)[0] if store.is_parquet_dataset(val_path) else 0
    if train_rows == 0:
        raise ValueError(f"the Parquet data at {train_path} has no rows")
    return train_rows, val_rows, metadata, size / train_rows
