"""``TorchEstimator`` and ``TorchModel`` of ``horovod.spark.lightning``: Horovod's Spark ML estimator for PyTorch
Lightning models, on perseus and Lightning 2.

``TorchEstimator(store=..., model=LightningModule, feature_cols=[...], label_cols=[...], input_shapes=[...],
batch_size=..., epochs=..., validation=...).fit(df)`` prepares ``df`` in the store, runs a Lightning ``Trainer`` on
every rank of the backend's job (:mod:`perseus.spark.lightning.remote`, with
:class:`~perseus.spark.lightning.strategy.PerseusStrategy`) and returns a ``TorchModel`` whose ``transform(df)``
adds the model's predictions. Parameters, defaults and accessors are Horovod's; the differences are in
docs/spark.md.
"""

from __future__ import annotations

import copy
import inspect
import io
import time

import torch
from packaging import version
from pyspark import keyword_only
from pyspark.ml.param import TypeConverters

try:
    import pytorch_lightning as pl
except ImportError as e:  # the estimator's own message: how to get Lightning
    raise ImportError("perseus.spark.lightning needs PyTorch Lightning 2 (the pytorch_lightning package): "
                      "pip install 'perseus[spark,lightning]'") from e

from perseus.spark.common import util
from perseus.spark.common.estimator import HorovodEstimator
from perseus.spark.common.params import EstimatorParams, declare
from perseus.spark.common.serialization import PerseusParamsReadable, PerseusParamsWritable, encode_param
from perseus.spark.lightning.legacy import to_lightning_module
from perseus.spark.lightning.remote import OWNED_TRAINER_ARGS, RemoteTrainer, TrainSpec
from perseus.spark.torch.estimator import TorchModel as _TorchModel

__all__ = ["TorchEstimator", "TorchModel", "EstimatorParams", "MIN_PL_VERSION"]

#: the oldest pytorch_lightning the estimator runs with (Lightning 2's strategy and hook API)
MIN_PL_VERSION = "2.0.0"

#: Horovod's name for how a parameter is saved (perseus.spark.common.serialization.encode_param)
_torch_param_serialize = encode_param

_LIGHTNING_PARAMS = [
    ("input_shapes", "the shape of each feature column's tensor, -1 for the batch (transform)", None, None, None),
    ("loss_constructors", "functions that make the losses (a plain torch.nn.Module only)", None, None, None),
    ("train_minibatch_fn", "Horovod's PyTorch-estimator training pass (no effect with Lightning)", None, None, None),
    ("num_gpus", "GPUs per rank: 0 trains on the CPU; default one when CUDA is available", None, None, "NumGPUs"),
    ("logger", "the Lightning logger (default: a CSVLogger in the run's logs directory)", None, None, None),
    ("log_every_n_steps", "the Trainer's logging interval in steps", 50, TypeConverters.toInt, None),
    ("data_module", "the LightningDataModule class that reads the prepared data (default: ParquetDataModule)",
     None, None, None),
    ("loader_num_epochs", "passes of the reader over the data (Horovod's Petastorm setting, given to the data "
     "module)", None, None, None),
    ("terminate_on_nan", "stop with ValueError when a loss or a parameter is NaN or infinite", False,
     TypeConverters.toBoolean, None),
    ("profiler", "the Lightning profiler (a name or an instance)", None, None, None),
    ("trainer_args", "more Trainer arguments, over the estimator's", None, None, None),
    ("debug_data_loader", "data module debugging (given to the data module)", False, TypeConverters.toBoolean,
     None),
    ("train_async_data_loader_queue_size", "Horovod's async loader queue (given to the data module)", None, None,
     None),
    ("val_async_data_loader_queue_size", "Horovod's async loader queue (given to the data module)", None, None,
     None),
]


def _optimizer_like(model, optimizer):
    """A new optimizer of ``optimizer``'s class over ``model``'s parameters, with its state."""
    fresh = type(optimizer)(model.parameters(), lr=1.0)
    fresh.load_state_dict(optimizer.state_dict())
    return fresh


class TorchEstimator(HorovodEstimator, PerseusParamsWritable, PerseusParamsReadable):
    """Spark ML estimator training a PyTorch Lightning ``LightningModule`` on a DataFrame with perseus (Horovod's
    arguments, in Horovod's order; keyword arguments only).

    Each rank runs a Lightning ``Trainer`` for ``epochs`` epochs over its share of the prepared data, in batches
    of ``batch_size`` rows (``batch["<column>"]`` tensors), with gradients averaged by perseus and the learning
    rate multiplied by the number of ranks; the model's ``training_step``, ``validation_step`` and
    ``configure_optimizers`` run as written. Rank 0 checkpoints every epoch into the store's run directory
    (``runs/<run_id>/checkpoint.ckpt``); a fit with a ``run_id`` that has one resumes after its last epoch. A
    plain ``torch.nn.Module`` with ``optimizer`` and ``loss`` is trained through
    :func:`~perseus.spark.lightning.legacy.to_lightning_module`, as in Horovod.

    Raises: RuntimeError when the installed pytorch_lightning is older than :data:`MIN_PL_VERSION`; ValueError
    when ``loss`` and ``loss_constructors`` are both given. From ``fit``, before any rank starts: ValueError for a
    missing store, model or column, a shape that does not match ``input_shapes``, ``optimizer``/``loss``/
    ``loss_weights``/``loss_constructors`` with a LightningModule (or no optimizer or loss with a plain module),
    ``num_gpus`` above 1, ``trainer_args`` that are not Trainer arguments or that set the strategy, accelerator,
    devices or nodes, callbacks that are not Lightning callbacks, a data module that is not a LightningDataModule
    class, a logger that is not a Lightning logger, a model of the ``lightning`` package (``lightning.pytorch``)
    rather than ``pytorch_lightning``.
    """

    @keyword_only
    def __init__(self, num_proc=None, model=None, backend=None, store=None, optimizer=None, loss=None,
                 loss_constructors=None, metrics=None, loss_weights=None, sample_weight_col=None,
                 gradient_compression=None, feature_cols=None, input_shapes=None, validation=None, label_cols=None,
                 callbacks=None, batch_size=None, val_batch_size=None, epochs=None, verbose=1, random_seed=None,
                 shuffle_buffer_size=None, shuffle=True, partitions_per_process=None, run_id=None,
                 train_minibatch_fn=None, train_steps_per_epoch=None, validation_steps_per_epoch=None,
                 transformation_fn=None, transformation_edit_fields=None, transformation_removed_fields=None,
                 train_reader_num_workers=None, trainer_args=None, val_reader_num_workers=None,
                 reader_pool_type=None, label_shapes=None, inmemory_cache_all=False, num_gpus=None, logger=None,
                 log_every_n_steps=50, data_module=None, loader_num_epochs=None, terminate_on_nan=False,
                 profiler=None, debug_data_loader=False, train_async_data_loader_queue_size=None,
                 val_async_data_loader_queue_size=None, use_gpu=True, mp_start_method=None):
        super().__init__()
        if version.parse(pl.__version__) < version.parse(MIN_PL_VERSION):
            raise RuntimeError(f"perseus.spark.lightning needs pytorch_lightning {MIN_PL_VERSION} or later, found "
                               f"{pl.__version__}")
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if "loss" in kwargs and "loss_constructors" in kwargs:
            raise ValueError("give loss or loss_constructors, not both")
        self.setParams(**kwargs)

    def getOptimizer(self):
        """The optimizer, rebuilt over the model's parameters (as Horovod returns it); None with a
        LightningModule (whose ``configure_optimizers`` makes it)."""
        optimizer, model = self.getOrDefault(self.optimizer), self.getModel()
        return _optimizer_like(model, optimizer) if model is not None and optimizer is not None else optimizer

    def _check_metadata_compatibility(self, metadata: dict) -> None:
        util.check_shape_compatibility(metadata, self.getFeatureCols(), self.getLabelCols(),
                                       input_shapes=self.getInputShapes(), label_shapes=self.getLabelShapes())

    def _check_before_preparing(self) -> None:
        super()._check_before_preparing()
        self._check_lightning()

    def _check_lightning(self) -> None:
        """The Lightning-specific checks (see the class doc). Raises ValueError."""
        model = self.getModel()
        if any(c.__name__ == "LightningModule" and c.__module__.startswith("lightning.")
               for c in type(model).__mro__):
            raise ValueError("the model is a lightning.pytorch LightningModule (the `lightning` package); the "
                             "estimator trains pytorch_lightning LightningModules (import pytorch_lightning)")
        if isinstance(model, pl.LightningModule):
            given = [name for name, value in (("optimizer", self.getOrDefault(self.optimizer)),
                                              ("loss", self.getLoss()), ("loss_weights", self.getLossWeights()),
                                              ("loss_constructors", self.getLossConstructors())) if value]
            if given:
                raise ValueError(f"{', '.join(given)} cannot be given with a LightningModule: its "
                                 "configure_optimizers and training_step define them")
        elif isinstance(model, torch.nn.Module):
            if self.getOrDefault(self.optimizer) is None:
                raise ValueError("a plain torch.nn.Module needs optimizer= (or pass a LightningModule)")
            if self.getLoss() is None and not self.getLossConstructors():
                raise ValueError("a plain torch.nn.Module needs loss= or loss_constructors= (or pass a "
                                 "LightningModule)")
        elif model is not None:
            raise ValueError(f"model must be a pytorch_lightning.LightningModule or a torch.nn.Module, not "
                             f"{type(model).__name__}")
        if self.getNumGPUs() not in (None, 0, 1):
            raise ValueError(f"num_gpus={self.getNumGPUs()}: each rank trains on one GPU (or none: 0); start more "
                             "processes to use more GPUs")
        self._check_trainer_args()
        for cb in self.getCallbacks() or []:
            if not isinstance(cb, pl.Callback):
                raise ValueError(f"callbacks must be pytorch_lightning Callbacks, got {type(cb).__name__}")
        module = self.getDataModule()
        if module is not None and not (isinstance(module, type) and issubclass(module, pl.LightningDataModule)):
            raise ValueError("data_module must be a LightningDataModule class (the ranks make it with Horovod's "
                             f"keyword arguments), got {module!r}")
        logger = self.getLogger()
        if logger is not None and not isinstance(logger, (bool, pl.loggers.Logger)):
            raise ValueError(f"logger must be a pytorch_lightning logger (or False), got {type(logger).__name__}")

    def _check_trainer_args(self) -> None:
        args = self.getTrainerArgs()
        if args is None:
            return
        if not isinstance(args, dict):
            raise ValueError(f"trainer_args must be a dict of Trainer arguments, got {type(args).__name__}")
        owned = [k for k in args if k in OWNED_TRAINER_ARGS]
        if owned:
            raise ValueError(f"trainer_args may not set {owned}: the estimator runs one process and device per rank "
                             "with perseus (use num_proc, use_gpu, num_gpus)")
        known = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
        unknown = sorted(k for k in args if k not in known)
        if unknown:
            raise ValueError(f"trainer_args has arguments pytorch_lightning {pl.__version__}'s Trainer does not take: "
                             f"{unknown} (Lightning 2 removed several of Lightning 1's)")

    def _lightning_module(self):
        """The LightningModule the ranks train: a copy of the model, or a plain module wrapped."""
        model = self.getModel()
        if isinstance(model, pl.LightningModule):
            # Not a copy: the model travels in one pickle with whatever its methods refer to, so a
            # configure_optimizers that names the model object (not self) gets the rank's own model.
            return model
        labels = list(self.getLabelCols())
        loss = self.getLoss()
        if loss is None:
            loss = [c() for c in util.to_list(self.getLossConstructors(), len(labels))]
        module, optimizer = copy.deepcopy((model, self.getOrDefault(self.optimizer)))
        return to_lightning_module(module, optimizer, loss, self.getLossWeights(), self.getFeatureCols(), labels,
                                   sample_weights_col=self.getSampleWeightCol(), validation=self.getValidation(),
                                   input_shapes=self.getInputShapes(), label_shapes=self.getLabelShapes())

    def _checkpoint_path(self, run_id: str):
        """The store path of the run's Lightning checkpoint (``<run>/<checkpoint_filename>.ckpt``), or None when
        the store keeps no runs."""
        store = self.getStore()
        directory = store.get_checkpoint_path(run_id)
        return None if directory is None else f"{directory}/{store.get_checkpoint_filename()}.ckpt"

    def _has_checkpoint(self, run_id: str) -> bool:
        path = self._checkpoint_path(run_id)
        return path is not None and self.getStore().exists(path)

    def _read_checkpoint(self, run_id: str) -> str:
        """The checkpoint to resume ``run_id`` from (Horovod's name; called when there is one): its store path,
        which the ranks fetch themselves."""
        path = self._checkpoint_path(run_id)
        if self.getVerbose():
            print(f"perseus.spark.lightning: resuming run {run_id} from {path}", flush=True)
        return path

    def _spec(self, train_rows, val_rows, run_id) -> TrainSpec:
        batch = self.getBatchSize()
        return TrainSpec(
            model=self._lightning_module(), feature_cols=list(self.getFeatureCols()),
            label_cols=list(self.getLabelCols()), sample_weight_col=self.getSampleWeightCol(), batch_size=batch,
            val_batch_size=self.getValBatchSize() or batch, epochs=self.getEpochs(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(), train_rows=int(train_rows),
            val_rows=int(val_rows or 0), shuffle=self.getShuffle(), random_seed=self.getRandomSeed(),
            verbose=self.getVerbose(), callbacks=list(self.getCallbacks() or []), logger=self.getLogger(),
            log_every_n_steps=self.getLogEveryNSteps(), profiler=self.getProfiler(),
            trainer_args=dict(self.getTrainerArgs() or {}), terminate_on_nan=bool(self.getTerminateOnNan()),
            data_module=self.getDataModule(),
            data_module_args=dict(
                num_reader_epochs=self.getLoaderNumEpochs(), reader_pool_type=self.getReaderPoolType(),
                reader_worker_count=self.getTrainReaderNumWorker(), transformation=self.getTransformationFn(),
                transformation_edit_fields=self.getTransformationEditFields(),
                transformation_removed_fields=self.getTransformationRemovedFields(),
                inmemory_cache_all=self.getInMemoryCacheAll(), debug_data_loader=self.getDebugDataLoader(),
                train_async_data_loader_queue_size=self.getTrainAsyncDataLoaderQueueSize(),
                val_async_data_loader_queue_size=self.getValAsyncDataLoaderQueueSize()),
            compression=self.getGradientCompression(), use_gpu=self.getUseGpu(), num_gpus=self.getNumGPUs(),
            mp_start_method=self.getMpStartMethod(), resume_from=self._read_checkpoint(run_id) if self._has_checkpoint(run_id) else None)

    def _fit_on_prepared_data(self, backend, train_rows, val_rows, metadata, avg_row_size, dataset_idx=None):
        self._check_params(metadata)
        self._check_lightning()
        run_id = self.getRunId() or f"pytorch_{int(time.time())}"
        spec = self._spec(train_rows, val_rows, run_id)
        spec.store = self.getStore().to_remote(run_id, dataset_idx)
        results = backend.run(RemoteTrainer(), args=(spec,))
        state = torch.load(io.BytesIO(results[0]), map_location="cpu", weights_only=False)
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(state["model"])
        model.eval()
        return TorchModel(history=state["history"], model=model, feature_columns=self.getFeatureCols(),
                          input_shapes=self.getInputShapes(), label_columns=self.getLabelCols(), run_id=run_id,
                          _metadata=metadata, loss=self.getLoss(), loss_constructors=self.getLossConstructors())


declare(TorchEstimator, _LIGHTNING_PARAMS)


class TorchModel(_TorchModel):
    """A trained Lightning (or plain PyTorch) model as a Spark ``Transformer``: ``getModel()`` gives the trained
    module, ``getHistory()`` the metrics the run logged last (``{name: float}``), ``getOptimizer()`` None (the
    LightningModule makes its optimizer, as in Horovod).

    ``transform(df)`` runs ``model.forward`` on batches of rows in every Spark task (features reshaped to
    ``input_shapes``) and adds one column per label: a double where the model gives one value per row, else a
    vector. Saved and loaded with Spark ML persistence (``write().save(path)``, ``TorchModel.load(path)``).
    """
