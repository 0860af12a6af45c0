"""perseus.spark.lightning (horovod.spark.lightning): the Lightning TorchEstimator on a local[2] Spark trains a
LightningModule on 2 ranks with identical weights and the same number of steps, and gives a TorchModel whose
transform predicts; Lightning 1.x hooks (validation_epoch_end, a callback's on_epoch_end) still run; a run
resumes after its last checkpointed epoch; a plain torch.nn.Module with an optimizer and a loss trains too;
models save and load with Spark ML persistence; bad input fails before any rank starts."""

import json
import os
import sys
import time

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyspark.cloudpickle")
torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

import cloudpickle  # noqa: E402

from perseus.spark.common.store import LocalStore  # noqa: E402
from perseus.spark.lightning import LightningEstimator, LightningModel, TorchEstimator, TorchModel  # noqa: E402
from spark_support import linear_df, local_spark  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this module
pyspark.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # nor can transform's Spark tasks
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("spark_local")]


@pytest.fixture(scope="module")
def spark():
    yield from local_spark("perseus-spark-lightning-estimator-tests")


class LinearRegression(pl.LightningModule):
    """Linear regression as Horovod-era Lightning code writes it: batch["features"], batch["y"], and a
    validation_epoch_end (removed in Lightning 2) that logs the average validation loss."""

    def __init__(self, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.linear(x.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"].float())
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"].float())
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def validation_epoch_end(self, outputs):
        self.log("avg_val_loss", torch.stack(outputs).mean(), sync_dist=True)


class Recorder(pl.Callback):
    """Writes, on each rank at the end of training, its step count, weights and hook counts to a file."""

    def __init__(self, directory):
        self.directory = directory
        self.epoch_ends = self.train_epoch_ends = self.val_epoch_ends = self.inits = 0

    def on_init_end(self, trainer):  # a Lightning 1.x hook
        self.inits += 1

    def on_epoch_end(self, trainer, pl_module):  # a Lightning 1.x hook
        self.epoch_ends += 1

    def on_train_epoch_end(self, trainer, pl_module):
        self.train_epoch_ends += 1

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val_epoch_ends += 1

    def on_train_end(self, trainer, pl_module):
        record = {"rank": trainer.global_rank, "world": trainer.world_size, "steps": trainer.global_step,
                  "weights": [float(v) for v in pl_module.linear.weight.detach().ravel()]
                  + [float(pl_module.linear.bias.detach())],
                  "epoch_ends": self.epoch_ends, "train_epoch_ends": self.train_epoch_ends,
                  "val_epoch_ends": self.val_epoch_ends, "inits": self.inits}
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def estimator(store, **kwargs):
    torch.manual_seed(0)
    args = dict(num_proc=2, store=store, model=LinearRegression(), feature_cols=["features"], label_cols=["y"],
                input_shapes=[[-1, 2]], batch_size=16, epochs=4, validation=0.2, verbose=0, random_seed=1)
    args.update(kwargs)
    return TorchEstimator(**args)


@pytest.fixture(scope="module")
def trained(spark, tmp_path_factory):
    """One fit of 4 epochs on 2 ranks, shared by the tests that only read its result."""
    tmp = tmp_path_factory.mktemp("lightning")
    records = tmp / "records"
    records.mkdir()
    df = linear_df(spark)
    store = LocalStore(str(tmp / "store"))
    model = estimator(store, callbacks=[Recorder(str(records))]).fit(df)
    return df, model, tmp


def read_records(directory):
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_fit_trains_on_two_ranks_and_transform_predicts(trained):
    df, model, tmp = trained
    assert isinstance(model, TorchModel) and LightningModel is TorchModel and LightningEstimator is TorchEstimator
    history = model.getHistory()
    assert set(history) == {"train_loss", "val_loss", "avg_val_loss"}, history  # the last logged values
    assert history["val_loss"] < 0.05 and history["train_loss"] < 0.1, history
    trained_module = model.getModel()
    assert isinstance(trained_module, LinearRegression) and not trained_module.training
    weights = trained_module.linear.weight.detach().numpy().ravel().tolist()
    np.testing.assert_allclose(weights, [2, -3], atol=0.1)
    out = model.copy().setOutputCols(["y_hat"]).transform(df.limit(50)).collect()
    assert len(out) == 50 and all(abs(r["y_hat"] - r["y"]) < 0.3 for r in out)
    # both ranks: one job of 2, the same number of steps, identical weights (gradients averaged), and the
    # removed Lightning 1.x hooks called where Lightning 1.x called them
    records = read_records(tmp / "records")
    assert [r["world"] for r in records] == [2, 2]
    steps = 320 // 16 // 2  # training rows (about 0.8 of 400) / batch size / ranks, per epoch
    assert records[0]["steps"] == records[1]["steps"] and abs(records[0]["steps"] - 4 * steps) <= 8, records
    np.testing.assert_allclose(records[0]["weights"], records[1]["weights"], rtol=0, atol=1e-6)
    bias = float(trained_module.linear.bias.detach())
    np.testing.assert_allclose(records[0]["weights"], weights + [bias], atol=1e-6)
    for r in records:
        assert r["inits"] == 1 and r["train_epoch_ends"] == 4 and r["val_epoch_ends"] == 4, r
        assert r["epoch_ends"] == r["train_epoch_ends"] + r["val_epoch_ends"], r
    # the run's Lightning checkpoint and logs are in the store, under Horovod's layout
    run = tmp / "store" / "runs" / model.getRunId()
    assert (run / "checkpoint.ckpt").is_file()
    assert list(run.glob("logs/**/metrics.csv"))


def test_model_saves_and_loads_with_spark_ml_persistence(trained, tmp_path):
    df, model, _ = trained
    path = str(tmp_path / "saved_model")
    model.write().save(path)
    loaded = TorchModel.load(path)
    assert type(loaded) is TorchModel and isinstance(loaded.getModel(), LinearRegression)
    assert loaded.getRunId() == model.getRunId() and loaded.getHistory() == model.getHistory()
    assert loaded.getOutputCols() == ["y__output"] and loaded.getInputShapes() == [[-1, 2]]
    rows = df.limit(20).collect()
    with torch.no_grad():
        features = torch.tensor(np.stack([r["features"].toArray() for r in rows]))
        expected = model.getModel()(features).squeeze(1).tolist()
    got = [r["y__output"] for r in loaded.transform(df.limit(20)).collect()]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.full  # the full test run (what CI runs) only: the quick run's Spark group is its longest
def test_a_run_resumes_after_its_last_checkpointed_epoch(trained, tmp_path):
    df, model, tmp = trained
    first = read_records(tmp / "records")[0]
    records = tmp_path / "resumed"
    records.mkdir()
    store = LocalStore(str(tmp / "store"))
    resumed = estimator(store, epochs=5, run_id=model.getRunId(), callbacks=[Recorder(str(records))]).fit(df)
    again = read_records(records)[0]
    # only epoch 4 was trained: epochs 0-3 (and their steps) came from the checkpoint
    assert again["train_epoch_ends"] == 1 and again["steps"] * 4 == first["steps"] * 5, (first, again)
    assert set(resumed.getHistory()) == set(model.getHistory())
    # with nothing left to train, the fit returns the checkpoint's weights and history
    done = estimator(store, epochs=5, run_id=model.getRunId()).fit(df)
    assert done.getHistory() == resumed.getHistory()
    for a, b in zip(done.getModel().parameters(), resumed.getModel().parameters()):
        assert torch.equal(a, b)


def test_a_plain_torch_module_trains_with_an_optimizer_and_a_loss(spark, tmp_path):
    """Horovod's legacy path, with Lightning's monitoring callbacks (their decisions are reduced over the ranks;
    the best ModelCheckpoint checkpoint is what fit returns)."""
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

    df = linear_df(spark, rows=200, seed=2)
    torch.manual_seed(0)
    module = torch.nn.Linear(2, 1)
    callbacks = [ModelCheckpoint(monitor="val_loss", mode="min", filename="best"),
                 EarlyStopping(monitor="val_loss", mode="min", patience=10)]
    est = TorchEstimator(num_proc=2, store=LocalStore(str(tmp_path / "store")), model=module,
                         optimizer=torch.optim.SGD(module.parameters(), lr=0.05),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["y"],
                         input_shapes=[[-1, 2]], batch_size=16, epochs=4, validation=0.2, verbose=0,
                         callbacks=callbacks)
    model = est.fit(df)
    assert isinstance(model.getModel(), torch.nn.Linear) and model.getOptimizer() is None
    assert set(model.getHistory()) == {"train_loss", "val_loss"} and model.getHistory()["val_loss"] < 0.05
    np.testing.assert_allclose(model.getModel().weight.detach().numpy().ravel(), [2, -3], atol=0.1)
    run = tmp_path / "store" / "runs" / model.getRunId()
    best = torch.load(run / "best.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(best["_model.weight"], model.getModel().weight)


def test_horovod_spark_lightning_imports_through_the_alias():
    installed = [f for f in sys.meta_path if type(f).__name__ == "HorovodAlias"]
    from perseus.compat import horovod_alias

    horovod_alias.install()
    try:
        import horovod.spark.lightning as hvd_lightning
        from horovod.spark.lightning.datamodule import PetastormDataModule
        from horovod.spark.lightning.estimator import MIN_PL_VERSION
        from horovod.spark.lightning.legacy import to_lightning_module

        assert hvd_lightning.TorchEstimator is TorchEstimator and hvd_lightning.TorchModel is TorchModel
        assert MIN_PL_VERSION == "2.0.0" and issubclass(PetastormDataModule, pl.LightningDataModule)
        assert callable(to_lightning_module)
    finally:
        if not installed:  # leave the process as it was
            horovod_alias.uninstall()
            for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
                del sys.modules[name]


def test_bad_input_fails_before_any_rank_starts(spark, tmp_path):
    df = linear_df(spark, rows=40)
    store = LocalStore(str(tmp_path / "store"))
    started = time.monotonic()
    with pytest.raises(ValueError, match="nope"):
        estimator(store, feature_cols=["nope"]).fit(df)
    with pytest.raises(ValueError, match="shape"):
        estimator(store, input_shapes=[[-1, 3]]).fit(df)
    with pytest.raises(ValueError, match="optimizer cannot be given with a LightningModule"):
        estimator(store, optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)).fit(df)
    with pytest.raises(ValueError, match="needs optimizer="):
        estimator(store, model=torch.nn.Linear(2, 1), loss=torch.nn.functional.mse_loss).fit(df)
    with pytest.raises(ValueError, match="may not set"):
        estimator(store, trainer_args={"strategy": "ddp"}).fit(df)
    with pytest.raises(ValueError, match="stochastic_weight_avg"):
        estimator(store, trainer_args={"stochastic_weight_avg": True}).fit(df)
    with pytest.raises(ValueError, match="num_gpus"):
        estimator(store, num_gpus=2).fit(df)
    with pytest.raises(ValueError, match="Callbacks"):
        estimator(store, callbacks=[object()]).fit(df)
    with pytest.raises(ValueError, match="loss or loss_constructors"):
        estimator(store, loss=torch.nn.functional.mse_loss, loss_constructors=[lambda: None])
    assert time.monotonic() - started < 120
