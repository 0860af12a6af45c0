"""The Spark side of ``prepare_data`` (driver only): what each column is, one pass that measures the DataFrame
(rows, nulls, vector and array lengths, the validation split), the metadata, and the Parquet writes.

The prepared format (what :mod:`perseus.spark.common.reader` reads): per split one Parquet directory written by
Spark, with the feature, label and sample-weight columns in that order. A Spark ML vector becomes
``array<double>`` (densified), except with ``compress_sparse=True`` where a column holding only sparse vectors
stays as Spark writes vectors (``struct<type, size, indices, values>``, only the non-zeros stored), which the
reader densifies per batch. Arrays and scalars are written as they are.

pyspark is imported inside the functions: this module loads without it (ranks never call it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Optional

from perseus.spark.common.constants import ARRAY, CUSTOM_SPARSE, NOCHANGE

__all__ = ["SCALAR_DTYPES", "Column", "Measures", "column_kinds", "split_flag", "measure", "check_measures",
           "metadata_of", "selected", "converted", "write_split", "VAL_FLAG"]

# Spark scalar types the estimators take, and the numpy dtype a rank's batch holds for them.
SCALAR_DTYPES = {"ByteType": "int8", "ShortType": "int16", "IntegerType": "int32", "LongType": "int64",
                 "FloatType": "float32", "DoubleType": "float64", "BooleanType": "bool", "StringType": "object",
                 "BinaryType": "object"}
# Array elements: numbers and booleans only (a model cannot take an array of strings).
_ARRAY_ELEMENTS = {k: v for k, v in SCALAR_DTYPES.items() if v != "object"}
VAL_FLAG = "__perseus_is_validation__"
# Parquet row groups of about this many bytes: small enough that every rank gets several, large enough to read
# efficiently.
ROW_GROUP_BYTES = 4 << 20


@dataclass
class Column:
    """One column to prepare: ``kind`` is "scalar", "array" or "vector"; ``type_name`` Spark's type class name
    (the element type's for arrays); ``dtype`` the numpy dtype of its values in a batch."""
    name: str
    kind: str
    type_name: str
    dtype: str
    contains_null: bool = False


@dataclass
class Measures:
    """What the measuring pass found."""
    rows: int
    val_rows: int
    nulls: dict = field(default_factory=dict)        # column -> rows where it is null
    element_nulls: dict = field(default_factory=dict)  # array column -> rows with a null element
    lengths: dict = field(default_factory=dict)      # array/vector column -> (min, max) length
    sparse_only: dict = field(default_factory=dict)  # vector column -> every row a SparseVector (compress_sparse)
    max_nonzeros: dict = field(default_factory=dict)  # vector column -> most non-zeros in a row


def column_kinds(df, columns: list) -> list:
    """The :class:`Column` of each of ``columns`` (which exist in ``df``).

    Raises:
        ValueError: a column of a type the estimators cannot take, naming it, its type and the fix.
    """
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    types = {f.name: f.dataType for f in df.schema.fields}
    out = []
    for name in columns:
        dt = types[name]
        tname = type(dt).__name__
        if isinstance(dt, VectorUDT):
            out.append(Column(name, "vector", "VectorUDT", "float64"))
        elif isinstance(dt, T.ArrayType) and type(dt.elementType).__name__ in _ARRAY_ELEMENTS:
            el = type(dt.elementType).__name__
            out.append(Column(name, "array", el, _ARRAY_ELEMENTS[el], bool(dt.containsNull)))
        elif tname in SCALAR_DTYPES:
            out.append(Column(name, "scalar", tname, SCALAR_DTYPES[tname]))
        else:
            raise ValueError(
                f"column {name!r} is {dt.simpleString()}, which the estimators cannot take: use numbers, booleans, "
                "strings, arrays of numbers or Spark ML vectors (cast it, e.g. df.withColumn(name, "
                "df[name].cast('double')), or assemble it into a vector with VectorAssembler)")
    return out


def split_flag(df, validation, seed: int):
    """The expression that is true on validation rows (None without validation): ``rand(seed) < validation``
    for a fraction; the column's truth (booleans; non-zero numbers) for a column name.

    Raises:
        ValueError: the validation column is neither boolean nor numeric.
    """
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not validation:
        return None
    if isinstance(validation, str):
        dt = df.schema[validation].dataType
        if isinstance(dt, T.BooleanType):
            return F.col(validation)
        if isinstance(dt, T.NumericType):
            return F.col(validation) != 0
        raise ValueError(f"the validation column {validation!r} is {dt.simpleString()}: it must be boolean or "
                         "numeric (true or non-zero marks a validation row)")
    return F.rand(seed) < float(validation)


def _vector_stats_udf():
    """A Python UDF giving (is sparse, non-zeros, size) of a vector; defined here so that it travels by value."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    def stats(v):
        if v is None:
            return None
        sparse = type(v).__name__ == "SparseVector"
        return sparse, int(len(v.indices)) if sparse else int(len(v)), int(v.size)

    schema = T.StructType([T.StructField("sparse", T.BooleanType()), T.StructField("nnz", T.IntegerType()),
                           T.StructField("size", T.IntegerType())])
    if "useArrow" in inspect.signature(F.udf).parameters:
        return F.udf(stats, schema, useArrow=False)
    return F.udf(stats, schema)


def measure(df, columns: list, compress_sparse: bool) -> Measures:
    """One Spark job over ``df`` (from :func:`selected`): rows, validation rows,
    nulls, lengths of arrays and vectors and, with ``compress_sparse``, which vector columns are all sparse."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    def count_if(cond):
        return F.sum(F.when(cond, 1).otherwise(0))

    exprs = [F.count(F.lit(1)).alias("rows"),
             (count_if(F.col(VAL_FLAG)) if VAL_FLAG in df.columns else F.lit(0)).alias("val_rows")]
    for i, c in enumerate(columns):
        col = F.col(c.name)
        exprs.append(count_if(col.isNull()).alias(f"null{i}"))
        if c.kind == "scalar":
            continue
        # nulls are reported on their own: vector_to_array must not see them
        length = F.size(F.when(col.isNotNull(), vector_to_array(col)) if c.kind == "vector" else col)
        exprs += [F.min(length).alias(f"min{i}"), F.max(length).alias(f"max{i}")]
        if c.kind == "array" and c.contains_null:
            exprs.append(count_if(F.exists(col, lambda x: x.isNull())).alias(f"elnull{i}"))
        if c.kind == "vector" and compress_sparse:
            st = _vector_stats_udf()(col)
            exprs += [F.min(F.when(st["sparse"], 1).otherwise(0)).alias(f"sparse{i}"),
                      F.max(st["nnz"]).alias(f"nnz{i}")]
    row = df.agg(*exprs).collect()[0].asDict()
    m = Measures(rows=int(row["rows"]), val_rows=int(row["val_rows"] or 0))
    for i, c in enumerate(columns):
        m.nulls[c.name] = int(row[f"null{i}"] or 0)
        if c.kind != "scalar":
            m.lengths[c.name] = (row[f"min{i}"], row[f"max{i}"])
        if f"elnull{i}" in row:
            m.element_nulls[c.name] = int(row[f"elnull{i}"] or 0)
        if f"sparse{i}" in row:
            m.sparse_only[c.name] = row[f"sparse{i}"] == 1
            m.max_nonzeros[c.name] = int(row[f"nnz{i}"] or 0)
    return m


def check_measures(m: Measures, columns: list, num_processes: int, validation) -> None:
    """The errors the measures show, before anything is written.

    Raises:
        ValueError: an empty DataFrame or split, fewer training (or validation) rows than processes, null values,
        arrays or vectors of different lengths.
    """
    if m.rows == 0:
        raise ValueError("the DataFrame is empty: there is nothing to train on")
    for c in columns:
        if m.nulls.get(c.name):
            raise ValueError(f"column {c.name!r} is null in {m.nulls[c.name]} of {m.rows} rows: drop or fill them "
                             f"first (df.na.drop(subset=[{c.name!r}]) or df.na.fill(...))")
        if m.element_nulls.get(c.name):
            raise ValueError(f"column {c.name!r} has null elements in {m.element_nulls[c.name]} of {m.rows} rows: "
                             "replace them first")
        lo, hi = m.lengths.get(c.name, (1, 1))
        if lo != hi:
            raise ValueError(f"column {c.name!r} holds {c.kind}s of different lengths ({lo} to {hi}): every row "
                             "must have the same length")
    train_rows = m.rows - m.val_rows
    if validation and m.val_rows == 0:
        raise ValueError(f"validation={validation!r} selects none of the {m.rows} rows: the validation split "
                         "would be empty (use a larger fraction, or mark some rows)")
    if train_rows == 0:
        raise ValueError(f"validation={validation!r} selects all {m.rows} rows: the training split would be empty")
    for what, n in (("training", train_rows), ("validation", m.val_rows if validation else None)):
        if n is not None and n < num_processes:
            raise ValueError(f"{n} {what} rows for num_proc={num_processes} processes: every process needs at "
                             f"least one row; use at most {n} processes, or more data")


def metadata_of(columns: list, m: Measures, compress_sparse: bool) -> dict:
    """Horovod's metadata of each column (plus ``dtype``): see :func:`perseus.spark.common.util.prepare_data`."""
    meta = {}
    for c in columns:
        length = m.lengths.get(c.name, (1, 1))[0]
        if c.kind == "scalar":
            entry = dict(spark_data_type=c.type_name, is_sparse_vector_only=False, shape=1,
                         intermediate_format=NOCHANGE, max_size=1)
        elif c.kind == "array":
            entry = dict(spark_data_type="ArrayType", is_sparse_vector_only=False, shape=length,
                         intermediate_format=NOCHANGE, max_size=length)
        elif compress_sparse and m.sparse_only.get(c.name):
            entry = dict(spark_data_type="SparseVector", is_sparse_vector_only=True, shape=length,
                         intermediate_format=CUSTOM_SPARSE, max_size=m.max_nonzeros[c.name])
        else:
            entry = dict(spark_data_type="DenseVector", is_sparse_vector_only=False, shape=length,
                         intermediate_format=ARRAY, max_size=length)
        entry["dtype"] = c.dtype
        meta[c.name] = entry
    return meta


def selected(df, columns: list, flag):
    """``df`` with only ``columns`` and, with validation (``flag`` not None), the ``VAL_FLAG`` column."""
    from pyspark.sql import functions as F

    exprs = [F.col(c.name) for c in columns]
    if flag is not None:
        exprs.append(flag.alias(VAL_FLAG))
    return df.select(*exprs)


def converted(df, columns: list, metadata: dict):
    """``df`` (from :func:`selected`) with vectors turned into ``array<double>`` unless kept sparse."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    exprs = []
    for c in columns:
        keep = c.kind != "vector" or metadata[c.name]["intermediate_format"] == CUSTOM_SPARSE
        exprs.append(F.col(c.name) if keep else vector_to_array(F.col(c.name), "float64").alias(c.name))
    if VAL_FLAG in df.columns:
        exprs.append(F.col(VAL_FLAG))
    return df.select(*exprs)


def write_split(df, path: str, partitions: int, validation: Optional[bool]) -> None:
    """Write the training (``validation`` False) or validation (True) rows of ``df`` to ``path`` as Parquet in
    ``partitions`` files of about equal size (``validation`` None: all rows)."""
    from pyspark.sql import functions as F

    if validation is not None:
        df = df.filter(F.col(VAL_FLAG) if validation else ~F.col(VAL_FLAG)).drop(VAL_FLAG)
    (df.repartition(partitions).write.mode("overwrite").option("parquet.block.size", ROW_GROUP_BYTES)
     .parquet(path))
