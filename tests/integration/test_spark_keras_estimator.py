"""perseus.spark.keras (horovod.spark.keras): KerasEstimator.fit on a local[2] Spark trains on 2 ranks and gives a
KerasModel whose transform predicts; a run resumes from its checkpoint; models save and load with Spark ML
persistence; bad input fails before any rank starts. Keras 3 here; the last test fits and checks again with
tf-keras 2 (TF_USE_LEGACY_KERAS=1) in a new process."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")
tf = pytest.importorskip("tensorflow")

import cloudpickle  # noqa: E402
from tensorflow import keras  # noqa: E402

from perseus.spark.common.store import LocalStore  # noqa: E402
from perseus.spark.keras import KerasEstimator, KerasModel  # noqa: E402
from spark_support import linear_df, local_spark  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this module
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("spark_local")]


@pytest.fixture(scope="module")
def spark():
    yield from local_spark("perseus-spark-keras-estimator-tests")


def squared_error(y_true, y_pred):
    """A loss Keras does not know by name: it travels with cloudpickle, and by name in custom_objects."""
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


def estimator(store, **kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    args = dict(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(0.05), loss=squared_error,
                metrics=["mae"], feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=4,
                validation=0.2, verbose=0, random_seed=1, custom_objects={"squared_error": squared_error})
    args.update(kwargs)
    return KerasEstimator(**args)


def check_trained(model, df, epochs):
    """The history has every epoch; the linear model learned y = 2 x0 - 3 x1 + 1; transform predicts it."""
    history = model.getHistory()
    assert set(history) == {"loss", "mae", "val_loss", "val_mae"}, history
    assert all(len(v) == epochs for v in history.values()), history
    assert history["loss"][-1] < history["loss"][0] / 4 and history["val_loss"][-1] < 0.05, history
    trained = model.getModel()
    kernel, bias = (w.numpy() for w in trained.weights[:2])
    np.testing.assert_allclose(kernel.ravel(), [2, -3], atol=0.1)
    np.testing.assert_allclose(bias, [1], atol=0.1)
    # compiled on the driver with the learning rate as given (the ranks trained with 2 x 0.05)
    assert float(trained.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    out = model.setOutputCols(["y_hat"]).transform(df.limit(50)).collect()
    assert len(out) == 50 and all(abs(r["y_hat"] - r["y"]) < 0.3 for r in out)


def fit_and_check(spark, tmp_path):
    """One fit of 3 epochs on 2 ranks, checked; returns (model, store, DataFrame)."""
    df = linear_df(spark)
    store = LocalStore(str(tmp_path / "store"))
    model = estimator(store, epochs=3, run_id="linear").fit(df)
    check_trained(model, df, 3)
    # the run's checkpoint (a .keras archive) and its progress are in the store, under Horovod's layout
    run_dir = tmp_path / "store" / "runs" / "linear"
    assert (run_dir / "checkpoint").read_bytes()[:2] == b"PK" and (run_dir / "checkpoint.progress.npz").is_file()
    return model, store, df


@pytest.mark.full  # 3 minutes: the full test run (what CI runs) only; the quick run keeps the bad-input test
def test_fit_trains_on_two_ranks_resumes_and_the_model_saves_and_loads(spark, tmp_path):
    first, store, df = fit_and_check(spark, tmp_path)
    # the same run_id with more epochs resumes after the checkpoint's last epoch
    second = estimator(store, epochs=4, run_id="linear").fit(df)
    history = second.getHistory()
    assert all(len(v) == 4 for v in history.values()), history
    for key, values in first.getHistory().items():
        assert history[key][:3] == values  # epochs 0..2 were not trained again
    # the optimizer went on counting its steps
    steps = int(first.getModel().optimizer.iterations.numpy())
    assert int(second.getModel().optimizer.iterations.numpy()) == steps * 4 // 3
    # Spark ML persistence: the model in Keras' format, compiled again on loading (its loss from custom_objects)
    path = str(tmp_path / "saved_model")
    second.write().save(path)
    loaded = KerasModel.load(path)
    a = [r["y_hat"] for r in second.setOutputCols(["y_hat"]).transform(df.limit(20)).collect()]
    b = [r["y__output"] for r in loaded.transform(df.limit(20)).collect()]
    assert a == b and loaded.getRunId() == "linear" and loaded.getHistory() == history
    assert loaded.getModel().optimizer is not None and set(loaded.getCustomObjects()) == {"squared_error"}
    # the estimator too: its model and optimizer in Keras' formats, the store not saved
    est = estimator(store, batch_size=8)
    est.write().save(str(tmp_path / "saved_estimator"))
    again = KerasEstimator.load(str(tmp_path / "saved_estimator"))
    assert isinstance(again.getModel(), keras.Model) and isinstance(again.getOptimizer(), keras.optimizers.SGD)
    assert again.getBatchSize() == 8 and again.getLabelCols() == ["y"] and again.getStore() is None


def test_bad_input_fails_before_any_rank_starts(spark, tmp_path):
    df = linear_df(spark, rows=40)
    store = LocalStore(str(tmp_path / "store"))
    started = time.monotonic()
    with pytest.raises(ValueError, match="nope"):
        estimator(store, feature_cols=["nope"]).fit(df)
    with pytest.raises(ValueError, match="2 feature columns .* 1 inputs"):
        estimator(store, feature_cols=["features", "w"]).fit(df)
    wide = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="values per row"):
        estimator(store, model=wide).fit(df)
    with pytest.raises(ValueError, match="loss is required"):
        estimator(store, loss=None).fit(df)
    with pytest.raises(ValueError, match="tf.keras Model"):
        estimator(store, model=object()).fit(df)
    with pytest.raises(ValueError, match="loss_weights"):
        estimator(store, loss_weights=[1.0, 2.0]).fit(df)
    assert time.monotonic() - started < 120


_LEGACY_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from tensorflow import keras
assert keras.Model.__module__.startswith("tf_keras"), keras.Model.__module__
import test_spark_keras_estimator as t
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
import pathlib
t.fit_and_check(spark, pathlib.Path({tmp!r}))
spark.stop()
print("LEGACY-KERAS-OK")
"""


@pytest.mark.full  # 2 minutes: the full test run (what CI runs) only
def test_fit_with_tf_keras_2(tmp_path):
    pytest.importorskip("tf_keras")
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "PYSPARK_PYTHON": sys.executable}
    script = _LEGACY_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=400)
    assert "LEGACY-KERAS-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
