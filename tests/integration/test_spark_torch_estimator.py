"""perseus.spark.torch (horovod.spark.torch): TorchEstimator.fit on a local[2] Spark trains on 2 ranks and gives a
TorchModel whose transform predicts; a run resumes from its checkpoint; models save and load with Spark ML
persistence; bad input fails before any rank starts."""

import os
import sys
import time

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")
torch = pytest.importorskip("torch")

import cloudpickle  # noqa: E402

from perseus.spark.common.store import LocalStore  # noqa: E402
from perseus.spark.torch import TorchEstimator, TorchModel  # noqa: E402
from spark_support import linear_df, local_spark  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this module
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("spark_local")]


@pytest.fixture(scope="module")
def spark():
    yield from local_spark("perseus-spark-torch-estimator-tests")


def mse(output, label, reduction="mean"):
    return torch.nn.functional.mse_loss(output, label, reduction=reduction)


def mae(output, label):
    return (output - label).abs().mean()


def estimator(store, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    args = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                loss=mse, metrics=[mae], feature_cols=["features"], label_cols=["y"], input_shapes=[[-1, 2]],
                batch_size=16, epochs=4, validation=0.2, verbose=0, random_seed=1)
    args.update(kwargs)
    return TorchEstimator(**args)


def test_fit_trains_on_two_ranks_and_transform_predicts(spark, tmp_path):
    df = linear_df(spark)
    model = estimator(LocalStore(str(tmp_path / "store"))).fit(df)
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["train"]["loss"] < history[0]["train"]["loss"] / 4, history
    assert history[-1]["validation"]["loss"] < 0.05, history
    assert set(history[-1]["train"]["all_metrics"][0]) == {"group_0_y"}
    weight = model.getModel().weight.detach().numpy().ravel()
    np.testing.assert_allclose(weight, [2, -3], atol=0.1)
    out = model.setOutputCols(["y_hat"]).transform(df.limit(50)).collect()
    assert len(out) == 50 and all(abs(r["y_hat"] - r["y"]) < 0.3 for r in out)
    # the run's checkpoint is in the store, under Horovod's layout
    run = model.getRunId()
    assert os.path.isfile(tmp_path / "store" / "runs" / run / "checkpoint")


def test_a_run_resumes_after_its_last_checkpointed_epoch(spark, tmp_path):
    df = linear_df(spark, seed=1)
    store = LocalStore(str(tmp_path / "store"))
    first = estimator(store, epochs=1, run_id="resumable").fit(df)
    assert [h["epoch"] for h in first.getHistory()] == [0]
    second = estimator(store, epochs=3, run_id="resumable").fit(df)
    history = second.getHistory()
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert history[0] == first.getHistory()[0]  # epoch 0 was not trained again


def test_model_saves_and_loads_with_spark_ml_persistence(spark, tmp_path):
    df = linear_df(spark, rows=200, seed=2)
    model = estimator(LocalStore(str(tmp_path / "store")), epochs=1, validation=None).fit(df)
    path = str(tmp_path / "saved_model")
    model.write().save(path)
    loaded = TorchModel.load(path)
    a = [r["y__output"] for r in model.transform(df.limit(20)).collect()]
    b = [r["y__output"] for r in loaded.transform(df.limit(20)).collect()]
    assert a == b and loaded.getRunId() == model.getRunId()
    assert loaded.getHistory() == model.getHistory()


def test_bad_input_fails_before_any_rank_starts(spark, tmp_path):
    df = linear_df(spark, rows=40)
    store = LocalStore(str(tmp_path / "store"))
    started = time.monotonic()
    with pytest.raises(ValueError, match="nope"):
        estimator(store, feature_cols=["nope"]).fit(df)
    with pytest.raises(ValueError, match="input_shapes|shape"):
        estimator(store, input_shapes=[[-1, 3]]).fit(df)
    with pytest.raises(ValueError, match="loss or loss_constructors"):
        estimator(store, loss_constructors=[lambda: mse])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        estimator(store, backward_passes_per_step=0)
    assert time.monotonic() - started < 120
