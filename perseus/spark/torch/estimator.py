"""``TorchEstimator`` and ``TorchModel``: Horovod's Spark ML estimator for PyTorch models on perseus.

``TorchEstimator(store=..., model=..., optimizer=..., loss=..., feature_cols=[...], label_cols=[...],
input_shapes=[...], batch_size=..., epochs=..., validation=...).fit(df)`` prepares ``df`` in the store, trains
on the backend's ranks (:mod:`perseus.spark.torch.remote`) and returns a ``TorchModel`` whose ``transform(df)``
adds the model's predictions. Parameters, defaults and accessors are Horovod's; the differences are in
docs/spark.md.
"""

from __future__ import annotations

import copy
import io
import time
from typing import List

import numpy as np
import torch
from pyspark import keyword_only
from pyspark.ml.param import Param, Params

from perseus.spark.common import util
from perseus.spark.common.estimator import HorovodEstimator, HorovodModel
from perseus.spark.common.params import EstimatorParams, declare
from perseus.spark.common.serialization import PerseusParamsReadable, PerseusParamsWritable, encode_param
from perseus.spark.torch.remote import RemoteTrainer, TrainSpec

__all__ = ["TorchEstimator", "TorchModel", "EstimatorParams"]

_TORCH_PARAMS = [
    ("data_module", "the DataModule class that reads the prepared data (default: ParquetDataModule)", None, None,
     None),
    ("input_shapes", "the shape of each feature column's tensor, -1 for the batch", None, None, None),
    ("loss_constructors", "functions that make the losses on each rank (instead of loss)", None, None, None),
    ("train_minibatch_fn", "a function running one training pass (Horovod's protocol)", None, None, None),
]


#: Horovod's name for how a parameter is saved (perseus.spark.common.serialization.encode_param)
_torch_param_serialize = encode_param


def _optimizer_like(model, optimizer):
    """A new optimizer of ``optimizer``'s class over ``model``'s parameters, with its state."""
    fresh = type(optimizer)(model.parameters(), lr=1.0)
    fresh.load_state_dict(optimizer.state_dict())
    return fresh


class TorchEstimator(HorovodEstimator, PerseusParamsWritable, PerseusParamsReadable):
    """Spark ML estimator training a ``torch.nn.Module`` on a DataFrame with perseus (Horovod's arguments).

    Every rank wraps ``optimizer``'s class in a ``DistributedOptimizer`` with the learning rate times the number
    of ranks, reads its share of the prepared data in batches of ``batch_size`` rows, and trains ``epochs``
    epochs; rank 0 checkpoints every epoch to ``store``'s run directory (``run_id``; a fit with a ``run_id``
    that has a checkpoint resumes after its last epoch).

    Raises (from ``fit``, before any rank starts): ValueError for a missing store, model, column, a shape that
    does not match ``input_shapes``, ``loss`` and ``loss_constructors`` both given, ``backward_passes_per_step``
    below 1, or ``loss_weights`` of the wrong length.
    """

    @keyword_only
    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None, optimizer=None,
                 loss=None, loss_constructors=None, metrics=None, loss_weights=None, sample_weight_col=None,
                 gradient_compression=None, feature_cols=None, continuous_cols=None, categorical_cols=None,
                 input_shapes=None, validation=None, label_cols=None, callbacks=None, batch_size=None,
                 val_batch_size=None, epochs=None, verbose=1, random_seed=None, shuffle_buffer_size=None,
                 shuffle=True, partitions_per_process=None, run_id=None, train_minibatch_fn=None,
                 train_steps_per_epoch=None, validation_steps_per_epoch=None, transformation_fn=None,
                 train_reader_num_workers=None, val_reader_num_workers=None, reader_pool_type='thread',
                 label_shapes=None, inmemory_cache_all=False, use_gpu=True, mp_start_method=None,
                 backward_passes_per_step=1):
        super().__init__()
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if "loss" in kwargs and "loss_constructors" in kwargs:
            raise ValueError("give loss or loss_constructors, not both")
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        self.setParams(**kwargs)

    def getOptimizer(self):
        """The optimizer, rebuilt over the model's parameters (as Horovod returns it)."""
        optimizer, model = self.getOrDefault(self.optimizer), self.getModel()
        return _optimizer_like(model, optimizer) if model is not None and optimizer is not None else optimizer

    def _check_metadata_compatibility(self, metadata: dict) -> None:
        util.check_shape_compatibility(metadata, self.getFeatureCols(), self.getLabelCols(),
                                       input_shapes=self.getInputShapes(), label_shapes=self.getLabelShapes())

    def _spec(self, metadata, train_rows, val_rows, run_id, resumed) -> TrainSpec:
        labels = list(self.getLabelCols())
        loss = self.getLoss()
        constructors = self.getLossConstructors()
        loss_fns = util.to_list(loss if loss is not None else [c() for c in util.to_list(constructors, len(labels))],
                                len(labels))
        weights = self.getLossWeights() or [1.0 / len(labels)] * len(labels)
        if len(weights) != len(labels):
            raise ValueError(f"loss_weights has {len(weights)} values for {len(labels)} label columns")
        metrics = self.getMetrics() or []
        groups = [list(g) if isinstance(g, (list, tuple)) else [g] for g in metrics]
        optimizer = self.getOrDefault(self.optimizer)
        if optimizer is None:
            raise ValueError("TorchEstimator: optimizer must be given")
        batch = self.getBatchSize()
        model = copy.deepcopy(self.getModel())
        return TrainSpec(
            model=model, optimizer_cls=type(optimizer),
            optimizer_state=resumed["optimizer"] if resumed else optimizer.state_dict(),
            model_state=resumed["model"] if resumed else None,
            start_epoch=int(resumed.get("epoch", -1)) + 1 if resumed else 0,
            history=list(resumed.get("history", [])) if resumed else [],
            loss_fns=loss_fns, loss_weights=list(weights), metric_groups=groups,
            feature_cols=list(self.getFeatureCols()), label_cols=labels, input_shapes=self.getInputShapes(),
            label_shapes=self.getLabelShapes(), sample_weight_col=self.getSampleWeightCol(), batch_size=batch,
            val_batch_size=self.getValBatchSize() or batch, epochs=self.getEpochs(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(), train_rows=int(train_rows),
            val_rows=int(val_rows or 0), shuffle=self.getShuffle(), random_seed=self.getRandomSeed(),
            verbose=self.getVerbose(), backward_passes_per_step=self.getBackwardPassesPerStep(),
            compression=self.getGradientCompression(), transformation_fn=self.getTransformationFn(),
            train_minibatch_fn=self.getTrainMinibatchFn(), data_module=self.getDataModule(),
            inmemory_cache_all=self.getInMemoryCacheAll(), use_gpu=self.getUseGpu(), store=None)

    def _fit_on_prepared_data(self, backend, train_rows, val_rows, metadata, avg_row_size, dataset_idx=None):
        self._check_params(metadata)
        run_id = self.getRunId() or f"pytorch_{int(time.time())}"
        resumed = self._load_checkpoint(run_id)
        spec = self._spec(metadata, train_rows, val_rows, run_id, resumed)
        spec.store = self.getStore().to_remote(run_id, dataset_idx)
        results = backend.run(RemoteTrainer(), args=(spec,))
        history, checkpoint = results[0]
        state = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=False)
        model = copy.deepcopy(self.getModel())
        model.load_state_dict(state["model"])
        model.eval()
        optimizer = _optimizer_like(model, self.getOrDefault(self.optimizer))
        optimizer.load_state_dict(state["optimizer"])
        return TorchModel(history=history, model=model, optimizer=optimizer, feature_columns=self.getFeatureCols(),
                          input_shapes=self.getInputShapes(), label_columns=self.getLabelCols(), run_id=run_id,
                          _metadata=metadata, loss=self.getLoss(), loss_constructors=self.getLossConstructors())

    def _load_checkpoint(self, run_id: str):
        """The run's last checkpoint (``{"model", "optimizer", "epoch", "history"}``), or None."""
        if not self._has_checkpoint(run_id):
            return None
        store = self.getStore()
        path = f"{store.get_checkpoint_path(run_id)}/{store.get_checkpoint_filename()}"
        if self.getVerbose():
            print(f"perseus.spark.torch: resuming run {run_id} from {path}", flush=True)
        return torch.load(io.BytesIO(store.read(path)), map_location="cpu", weights_only=False)


declare(TorchEstimator, _TORCH_PARAMS)


class TorchModel(HorovodModel, PerseusParamsWritable, PerseusParamsReadable):
    """A trained PyTorch model as a Spark ``Transformer`` (``getModel()`` gives the ``torch.nn.Module``).

    ``transform(df)`` runs the model on batches of rows in every Spark task (features reshaped to
    ``input_shapes``) and adds one column per label: a double where the model gives one value per row, else a
    vector.
    """

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, input_shapes=None, label_columns=None,
                 optimizer=None, run_id=None, _metadata=None, loss=None, loss_constructors=None):
        super().__init__()
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if label_columns:
            self.setOutputCols([f"{c}__output" for c in label_columns])
        self.setParams(**kwargs)

    def getOptimizer(self):
        """The optimizer, rebuilt over the model's parameters."""
        optimizer, model = self.getOrDefault(self.optimizer), self.getModel()
        return _optimizer_like(model, optimizer) if model is not None and optimizer is not None else optimizer

    def _predictor(self):
        model, shapes = self.getModel(), self.getInputShapes()

        # A shape with -1 takes a batch of rows; one without (Horovod's [[2]]) is one row's, so the model is
        # called row by row, as it was written for.
        batched = not shapes or all(s is None or -1 in list(s) for s in shapes)

        def run(tensors):
            with torch.no_grad():
                out = model(*tensors)
            return [o.detach().cpu().numpy() for o in (out if isinstance(out, (list, tuple)) else [out])]

        def predict(features: List[np.ndarray]) -> List[np.ndarray]:
            model.eval()
            tensors = [torch.as_tensor(np.asarray(f)).float() for f in features]
            if batched:
                return run([t.reshape(list(shapes[i])) if shapes and shapes[i] is not None else t
                            for i, t in enumerate(tensors)])
            rows = [run([t[r].reshape(list(shapes[i])) for i, t in enumerate(tensors)])
                    for r in range(len(tensors[0]))]
            return [np.stack([np.asarray(row[j]).reshape(-1) for row in rows]) for j in range(len(rows[0]))]

        return predict


declare(TorchModel, [
    ("optimizer", "the optimizer as trained", None, None, None),
    ("input_shapes", "the shape of each feature column's tensor", None, None, None),
    ("loss", "the loss", None, None, None),
    ("loss_constructors", "the loss constructors", None, None, None),
])
