"""perseus.spark.common.util.prepare_data on a local[2] Spark: scalar, vector (dense, sparse) and array
columns, validation by fraction and by column, the metadata, reuse of a prepared dataset, every input error
before anything is written; and the prepared data read back by two ranks' ParquetBatches.

One SparkSession serves the module (as in test_spark.py).
"""

import os

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
pytest.importorskip("fsspec")

from pyspark.ml.linalg import Vectors  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from perseus.spark.common import util  # noqa: E402
from perseus.spark.common.reader import ParquetBatches  # noqa: E402
from perseus.spark.common.store import LocalStore  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("spark_local")]
ROWS = 24


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("perseus-spark-data-tests")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.memory", "512m").config("spark.sql.shuffle.partitions", "4")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def fresh_cache():
    util.clear_training_cache()
    yield
    util.clear_training_cache()


@pytest.fixture(scope="module")
def df(spark):
    """id (long), x (double), dense (vector of 2), sparse (sparse vectors of size 5), mixed (sparse and dense
    vectors of size 3), arr (array<float> of 3), label (double), weight (double), is_val (boolean)."""
    rows = []
    for i in range(ROWS):
        mixed = Vectors.dense([i, 0, 1]) if i % 2 else Vectors.sparse(3, [1], [float(i)])
        rows.append((i, i / 10, Vectors.dense([i, -i]), Vectors.sparse(5, [i % 5], [i + 1.0]), mixed,
                     [float(i), 1.0, 2.0], float(i % 3), 1.0, i % 4 == 0))
    schema = T.StructType([T.StructField("id", T.LongType()), T.StructField("x", T.DoubleType()),
                           T.StructField("dense", pyspark.ml.linalg.VectorUDT()),
                           T.StructField("sparse", pyspark.ml.linalg.VectorUDT()),
                           T.StructField("mixed", pyspark.ml.linalg.VectorUDT()),
                           T.StructField("arr", T.ArrayType(T.FloatType())), T.StructField("label", T.DoubleType()),
                           T.StructField("weight", T.DoubleType()), T.StructField("is_val", T.BooleanType())])
    return spark.createDataFrame(rows, schema)


FEATURES = ["id", "x", "dense", "sparse", "mixed", "arr"]


def _read_all(path, columns, size=2, batch=1):
    """Every rank's share of ``path`` read once (one pass each), concatenated per column."""
    out = {c: [] for c in columns}
    for rank in range(size):
        r = ParquetBatches(path, columns, batch, rank, size)
        for b in r.epoch(0, steps=r.rows // batch):
            for c in columns:
                out[c].append(b[c])
    return {c: np.concatenate(v) for c, v in out.items()}


def _expected_row(i):
    sparse = np.zeros(5)
    sparse[i % 5] = i + 1.0
    mixed = [i, 0, 1] if i % 2 else [0, i, 0]
    return {"x": i / 10, "dense": [i, -i], "sparse": sparse, "mixed": mixed, "arr": [i, 1, 2], "label": i % 3}


def _check_values(data):
    order = np.argsort(data["id"])
    for col in [c for c in _expected_row(0) if c in data]:
        got = data[col][order]
        np.testing.assert_allclose(got, [_expected_row(int(i))[col] for i in data["id"][order]], err_msg=col)


def test_prepare_without_validation_writes_every_row_once(spark, df, tmp_path):
    store = LocalStore(str(tmp_path))
    with util.prepare_data(2, store, df, ["label"], FEATURES, sample_weight_col="weight",
                           partitions_per_process=3) as idx:
        train_rows, val_rows, metadata, avg_row_size = util.get_dataset_properties(idx)
    assert (idx, train_rows, val_rows) == (0, ROWS, 0) and avg_row_size > 0
    assert os.path.isdir(tmp_path / "intermediate_train_data.0")
    assert not os.path.exists(tmp_path / "intermediate_val_data.0")
    files = [f for f in os.listdir(tmp_path / "intermediate_train_data.0") if f.endswith(".parquet")]
    assert 2 <= len(files) <= 6
    columns = FEATURES + ["label", "weight"]
    data = _read_all(store.get_train_data_path(idx), columns)
    assert sorted(data["id"]) == list(range(ROWS))  # both ranks' shares: every row once
    _check_values(data)
    assert data["arr"].dtype == np.float32 and data["dense"].shape == (ROWS, 2)
    assert metadata["id"] == dict(spark_data_type="LongType", is_sparse_vector_only=False, shape=1,
                                  intermediate_format="nochange", max_size=1, dtype="int64")
    assert metadata["dense"] == dict(spark_data_type="DenseVector", is_sparse_vector_only=False, shape=2,
                                     intermediate_format="array", max_size=2, dtype="float64")
    assert metadata["sparse"] == dict(spark_data_type="DenseVector", is_sparse_vector_only=False, shape=5,
                                      intermediate_format="array", max_size=5, dtype="float64")
    assert metadata["arr"] == dict(spark_data_type="ArrayType", is_sparse_vector_only=False, shape=3,
                                   intermediate_format="nochange", max_size=3, dtype="float32")
    assert list(metadata) == columns
    # fit_on_parquet's view of the same data
    rows, vrows, meta2, _ = util.get_simple_meta_from_parquet(store, ["label"], FEATURES, "weight", idx)
    assert (rows, vrows, meta2) == (ROWS, 0, metadata)


def test_compress_sparse_keeps_sparse_only_columns_sparse(spark, df, tmp_path):
    store = LocalStore(str(tmp_path))
    with util.prepare_data(2, store, df, ["label"], ["id", "sparse", "mixed", "dense"], compress_sparse=True,
                           partitions_per_process=2) as idx:
        metadata = util.get_dataset_properties(idx)[2]
    assert metadata["sparse"] == dict(spark_data_type="SparseVector", is_sparse_vector_only=True, shape=5,
                                      intermediate_format="custom_sparse_format", max_size=1, dtype="float64")
    assert metadata["mixed"]["spark_data_type"] == "DenseVector" and metadata["mixed"]["shape"] == 3
    data = _read_all(store.get_train_data_path(idx), ["id", "sparse", "mixed", "dense"], batch=2)
    assert sorted(data["id"]) == list(range(ROWS))
    _check_values(data)


def test_validation_fraction_splits_every_row_once_and_is_seeded(spark, df, tmp_path):
    store = LocalStore(str(tmp_path))
    with util.prepare_data(2, store, df, ["label"], ["id", "x"], validation=0.4, partitions_per_process=2) as idx:
        train_rows, val_rows, _, _ = util.get_dataset_properties(idx)
    train = _read_all(store.get_train_data_path(idx), ["id"])["id"]
    val = _read_all(store.get_val_data_path(idx), ["id"])["id"]
    assert train_rows == len(train) and val_rows == len(val) and train_rows >= 2 and val_rows >= 2
    assert sorted(np.concatenate([train, val])) == list(range(ROWS))
    util.clear_training_cache()
    with util.prepare_data(2, LocalStore(str(tmp_path / "again")), df, ["label"], ["id", "x"], validation=0.4,
                           partitions_per_process=2) as idx2:
        pass
    again = _read_all(LocalStore(str(tmp_path / "again")).get_val_data_path(idx2), ["id"])["id"]
    assert sorted(again) == sorted(val)


def test_validation_column_marks_the_validation_rows(spark, df, tmp_path):
    store = LocalStore(str(tmp_path))
    with util.prepare_data(2, store, df, ["label"], ["id", "dense"], validation="is_val",
                           partitions_per_process=2) as idx:
        train_rows, val_rows, metadata, _ = util.get_dataset_properties(idx)
    assert (train_rows, val_rows) == (ROWS - ROWS // 4, ROWS // 4) and "is_val" not in metadata
    val = _read_all(store.get_val_data_path(idx), ["id", "dense"])
    assert sorted(val["id"]) == [i for i in range(ROWS) if i % 4 == 0]
    assert sorted(_read_all(store.get_train_data_path(idx), ["id"])["id"]) == [i for i in range(ROWS) if i % 4]
    numeric = df.withColumn("v", (df["id"] % 4 == 0).cast("int"))
    with util.prepare_data(2, store, numeric, ["label"], ["id"], validation="v", partitions_per_process=1) as idx:
        assert util.get_dataset_properties(idx)[:2] == (ROWS - ROWS // 4, ROWS // 4)


def test_feature_columns_default_to_all_but_labels_weight_and_validation(spark, df, tmp_path):
    with util.prepare_data(2, LocalStore(str(tmp_path)), df, ["label"], None, validation="is_val",
                           sample_weight_col="weight", partitions_per_process=1) as idx:
        assert list(util.get_dataset_properties(idx)[2]) == FEATURES + ["label", "weight"]


def test_a_prepared_dataset_is_reused(spark, df, tmp_path):
    store = LocalStore(str(tmp_path))
    args = (2, store, df, ["label"], ["id", "x"])
    with util.prepare_data(*args, partitions_per_process=1) as idx:
        props = util.get_dataset_properties(idx)
    marker = tmp_path / "intermediate_train_data.0" / "_marker"
    marker.write_text("")
    with util.prepare_data(*args, partitions_per_process=1) as again:
        assert again == idx and util.get_dataset_properties(again) == props
        assert marker.exists()  # not written again
        other = df.filter(df["id"] < 10)
        with util.prepare_data(2, store, other, ["label"], ["id", "x"], partitions_per_process=1) as idx2:
            assert idx2 == 1 and util.get_dataset_properties(idx2)[0] == 10  # index 0 is in use
    util.clear_training_cache()
    with util.prepare_data(*args, partitions_per_process=1) as after:
        assert after == 0 and not marker.exists()  # forgotten: written again


def _nothing_written(path):
    return not any(name.startswith("intermediate_") for name in os.listdir(path)) if os.path.isdir(path) else True


@pytest.mark.parametrize("kwargs, error", [
    (dict(feature_columns=["id", "nope", "nada"]),
     r"the DataFrame has no column 'nope', 'nada' \(its columns: id, x, dense, sparse, mixed, arr, label, weight, "
     r"is_val\)"),
    (dict(label_columns=["nolabel"]), r"no column 'nolabel' \(its columns: id, x,"),
    (dict(sample_weight_col="w"), r"no column 'w'"),
    (dict(label_columns=[]), r"label_columns cannot be None or empty"),
    (dict(validation=1.5), r"Validation split 1.5 must be in the range: \[0, 1\)"),
    (dict(validation=-0.2), r"must be in the range"),
    (dict(validation=["is_val"]), r"validation must be a fraction in \[0, 1\) or a column name"),
    (dict(validation="missing"), r"the validation column 'missing' is not in the DataFrame \(its columns: id,"),
    (dict(validation="id_str"), r"the validation column 'id_str' is string: it must be boolean or numeric"),
    (dict(num_processes=0), r"num_proc=0 and partitions_per_process=10 must both be > 0"),
    (dict(num_processes=ROWS + 1), rf"{ROWS} training rows for num_proc={ROWS + 1} processes: .*at most {ROWS}"),
    (dict(validation="none_val"), r"validation='none_val' selects none of the 24 rows"),
    (dict(validation="all_val"), r"validation='all_val' selects all 24 rows: the training split would be empty"),
    (dict(validation="is_val", num_processes=7), r"6 validation rows for num_proc=7 processes"),
    (dict(feature_columns=["when"]), r"column 'when' is date, which the estimators cannot take"),
    (dict(feature_columns=["holes"]), r"column 'holes' is null in 12 of 24 rows: drop or fill them"),
    (dict(feature_columns=["holey_vectors"]), r"column 'holey_vectors' is null in 12 of 24 rows"),
    (dict(feature_columns=["ragged"]), r"column 'ragged' holds arrays of different lengths \(1 to 2\)"),
])
def test_bad_input_is_one_clear_error_before_anything_is_written(spark, df, tmp_path, kwargs, error):
    from pyspark.sql import functions as F

    bad = (df.withColumn("id_str", F.col("id").cast("string")).withColumn("none_val", F.lit(False))
           .withColumn("all_val", F.lit(True)).withColumn("when", F.current_date())
           .withColumn("holes", F.when(F.col("id") % 2 == 0, F.col("x")))
           .withColumn("holey_vectors", F.when(F.col("id") % 2 == 0, F.col("dense")))
           .withColumn("ragged", F.when(F.col("id") % 2 == 0, F.array(F.lit(1.0))).otherwise(F.array(F.lit(1.0),
                                                                                                    F.lit(2.0)))))
    args = dict(num_processes=2, store=LocalStore(str(tmp_path)), df=bad, label_columns=["label"],
                feature_columns=["id"], partitions_per_process=10)
    args.update(kwargs)
    if "columns:" in error:
        error = error.replace(r"is_val\)", r"is_val, id_str, none_val, all_val, when, holes, holey_vectors, ragged\)")
    with pytest.raises(ValueError, match=error):
        with util.prepare_data(**args):
            pytest.fail("prepare_data yielded")
    assert _nothing_written(tmp_path)


def test_an_empty_dataframe_is_refused(spark, df, tmp_path):
    with pytest.raises(ValueError, match="the DataFrame is empty"):
        with util.prepare_data(2, LocalStore(str(tmp_path)), df.filter("id < 0"), ["label"], ["id"]):
            pass
    assert _nothing_written(tmp_path)


def test_a_store_that_cannot_be_written_is_refused(spark, df, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(OSError, match=r"the store path file://.*/afile/store cannot be written"):
        with util.prepare_data(2, LocalStore(str(tmp_path / "afile" / "store")), df, ["label"], ["id"]):
            pass
