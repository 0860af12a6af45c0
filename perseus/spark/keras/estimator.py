"""``KerasEstimator`` and ``KerasModel``: Horovod's Spark ML estimator for Keras models on perseus.

``KerasEstimator(store=..., model=..., optimizer=..., loss=..., metrics=[...], feature_cols=[...],
label_cols=[...], batch_size=..., epochs=..., validation=...).fit(df)`` prepares ``df`` in the store, trains on
the backend's ranks (:mod:`perseus.spark.keras.remote`) and returns a ``KerasModel`` whose ``transform(df)`` adds
the model's predictions. The Keras is ``tf.keras``: Keras 3, or tf-keras 2 with ``TF_USE_LEGACY_KERAS=1``.
Parameters, defaults and accessors are Horovod's; the differences are in docs/spark.md.
"""

from __future__ import annotations

import base64
import time
import warnings
from typing import List, Optional

import cloudpickle
import numpy as np
import tensorflow as tf
from pyspark import TaskContext, keyword_only

from perseus.spark.common import util as common_util
from perseus.spark.common.datamodule import ParquetDataModule
from perseus.spark.common.estimator import HorovodEstimator, HorovodModel
from perseus.spark.common.params import EstimatorParams, declare
from perseus.spark.common.serialization import (PerseusParamsReadable, PerseusParamsWritable, decode_value,
                                                encode_value)
from perseus.spark.keras import util
from perseus.spark.keras.remote import PROGRESS_SUFFIX, RemoteTrainer, TrainSpec
from perseus.spark.keras.util import keras

__all__ = ["KerasEstimator", "KerasModel", "EstimatorParams"]

_DEFAULT_BACKEND_ENV = {"LIBHDFS_OPTS": "-Xms2048m -Xmx2048m"}
_MODEL_TAG = "__perseus_keras_model_base64__"
_OPTIMIZER_TAG = "__perseus_keras_optimizer__"


def _is_optimizer(value) -> bool:
    return hasattr(value, "get_config") and hasattr(value, "apply_gradients")


class _KerasPersistence(PerseusParamsWritable, PerseusParamsReadable):
    """Spark ML persistence of Keras values: the ``model`` as ``.keras`` archive bytes, the ``optimizer`` as its
    Keras configuration and variable values; loaded with the saved ``custom_objects``."""

    def _encode_param(self, name, value):
        if name == "model" and isinstance(value, keras.Model):
            return {_MODEL_TAG: base64.b64encode(util.model_to_bytes(value)).decode("ascii")}
        if name == "optimizer" and _is_optimizer(value):
            return {_OPTIMIZER_TAG: encode_value({"config": util.optimizer_config(value),
                                                  "values": util.optimizer_values(value)})}
        return super()._encode_param(name, value)

    @classmethod
    def _decode_params(cls, values: dict) -> dict:
        custom = decode_value(values.get("custom_objects")) or {}
        out = {}
        model = values.get("model")
        if isinstance(model, dict) and set(model) == {_MODEL_TAG}:
            out["model"] = _load_saved_model(base64.b64decode(model[_MODEL_TAG]), custom)
        for name, value in values.items():
            if name in out:
                continue
            if isinstance(value, dict) and set(value) == {_OPTIMIZER_TAG}:
                saved = decode_value(value[_OPTIMIZER_TAG])
                optimizer = util.optimizer_from_config(saved["config"], custom)
                if saved["values"] is not None and out.get("model") is not None:
                    util.restore_optimizer(optimizer, out["model"], saved["values"])
                out[name] = optimizer
            else:
                out[name] = decode_value(value)
        return out


def _load_saved_model(data: bytes, custom_objects: dict):
    """A saved model, compiled as it was saved when Keras can rebuild its compilation (else uncompiled, with a
    warning: a loss or metric that is neither Keras' nor in ``custom_objects``)."""
    try:
        return util.model_from_bytes(data, custom_objects, compile=True)
    except (TypeError, ValueError) as e:
        warnings.warn(f"perseus.spark.keras: the saved model is loaded uncompiled ({e}); pass its loss and "
                      "metrics in custom_objects to have it compiled", stacklevel=3)
        return util.model_from_bytes(data, custom_objects, compile=False)


class KerasEstimator(HorovodEstimator, _KerasPersistence):
    """Spark ML estimator training a ``tf.keras`` model on a DataFrame with perseus (Horovod's arguments).

    Every rank loads the model from its ``.keras`` bytes (``custom_objects`` honoured), compiles it with
    ``optimizer`` (or the compiled model's own) wrapped in perseus's ``DistributedOptimizer`` with the learning
    rate times the number of ranks, ``loss``, ``loss_weights`` and ``metrics``, and runs ``model.fit`` for
    ``epochs`` epochs on its share of the prepared data, with ``BroadcastGlobalVariablesCallback(0)``,
    ``MetricAverageCallback()`` and ``callbacks``. Rank 0 checkpoints every epoch into ``store``'s run
    directory (``run_id``); a fit whose ``run_id`` has a checkpoint resumes after its last epoch.

    Raises (from ``fit``, before any rank starts): ValueError for a missing store, model, loss, optimizer or
    column, a model that is not a ``tf.keras`` Model, feature or label columns that do not match the model's
    inputs or outputs (their number, or the values per row), ``loss_weights`` of the wrong length.
    """

    @keyword_only
    def __init__(self, num_proc=None, data_module=None, model=None, backend=None, store=None, custom_objects=None,
                 optimizer=None, loss=None, loss_weights=None, sample_weight_col=None, gradient_compression=None,
                 metrics=None, feature_cols=None, label_cols=None, continuous_cols=None, categorical_cols=None,
                 validation=None, callbacks=None, batch_size=None, val_batch_size=None, epochs=None, verbose=None,
                 random_seed=None, shuffle_buffer_size=None, shuffle=True, partitions_per_process=None,
                 run_id=None, train_steps_per_epoch=None, validation_steps_per_epoch=None, transformation_fn=None,
                 train_reader_num_workers=None, val_reader_num_workers=None, reader_pool_type='thread',
                 label_shapes=None, checkpoint_callback=None, inmemory_cache_all=False, backend_env=None,
                 use_gpu=True, mp_start_method=None, tensorflow_dataset_prefetch_buffer_size=0):
        super().__init__()
        self._setDefault(custom_objects={}, backend_env=dict(_DEFAULT_BACKEND_ENV))
        self.setParams(**{k: v for k, v in self._input_kwargs.items() if v is not None})

    def _optimizer(self):
        optimizer = self.getOptimizer()
        return optimizer if optimizer is not None else getattr(self.getModel(), "optimizer", None)

    def _check_before_preparing(self) -> None:
        """The checks that need no data: those of the base, then the model, loss, optimizer and the number of
        feature and label columns against the model's inputs and outputs.

        Raises:
            ValueError: see the class doc.
        """
        super()._check_before_preparing()
        self._check_keras()

    def _check_keras(self) -> None:
        """The checks of the model, loss, optimizer and column counts (see ``_check_before_preparing``)."""
        model = self.getModel()
        util.check_model(model)
        if not self.getLoss():
            raise ValueError("KerasEstimator: loss is required to compile the model")
        if self._optimizer() is None:
            raise ValueError("KerasEstimator: give optimizer=, or a model compiled with an optimizer")
        inputs, outputs = util.model_shapes(model)
        features, labels = list(self.getFeatureCols()), list(self.getLabelCols())
        if inputs is not None and len(inputs) != len(features):
            raise ValueError(f"{len(features)} feature columns {features} for a model of {len(inputs)} inputs: "
                             "give one feature column per model input, in the inputs' order")
        if outputs is not None and len(outputs) != len(labels):
            raise ValueError(f"{len(labels)} label columns {labels} for a model of {len(outputs)} outputs: "
                             "give one label column per model output")
        weights = self.getLossWeights()
        if isinstance(weights, (list, tuple)) and len(weights) != len(labels):
            raise ValueError(f"loss_weights has {len(weights)} values for {len(labels)} label columns")

    def get_model_shapes(self):
        """``(input_shapes, output_shapes)`` of the model, -1 for unknown dimensions (Horovod's); ``(None,
        None)`` for a model that does not know them."""
        return util.model_shapes(self.getModel())

    def _check_metadata_compatibility(self, metadata: dict) -> None:
        inputs, outputs = self.get_model_shapes()
        common_util.check_shape_compatibility(metadata, self.getFeatureCols(), self.getLabelCols(),
                                              input_shapes=inputs, output_shapes=outputs,
                                              label_shapes=self.getLabelShapes())

    def _fit_on_prepared_data(self, backend, train_rows, val_rows, metadata, avg_row_size, dataset_idx=None):
        self._check_params(metadata)
        self._check_keras()
        if self.getShufflingBufferSize() is not None:
            warnings.warn("shuffle_buffer_size is deprecated and has no effect: use shuffle", DeprecationWarning,
                          stacklevel=2)
        run_id = self.getRunId() or f"keras_{int(time.time())}"
        resumed = self._load_checkpoint(run_id)
        spec = self._spec(train_rows, val_rows, resumed)
        if resumed is not None and spec.start_epoch >= spec.epochs:
            result = resumed  # nothing left to train: the checkpoint is the result
        else:
            spec.store = self.getStore().to_remote(run_id, dataset_idx)
            result = backend.run(RemoteTrainer(), args=(spec,), env=self.getBackendEnv())[0]
        return self._create_model(result, run_id, metadata)

    def _spec(self, train_rows, val_rows, resumed) -> TrainSpec:
        model, custom = self.getModel(), self.getCustomObjects() or {}
        optimizer = self._optimizer()
        progress = (resumed or {}).get("progress") or {}
        if resumed is not None:
            model = self._model_from_checkpoint(resumed["checkpoint"])
            values, lr = progress.get("optimizer_values"), progress.get("learning_rate")
        else:
            values, lr = util.optimizer_values(optimizer), util.get_lr(optimizer)
        inputs, outputs = util.model_shapes(model)
        batch = self.getBatchSize()
        return TrainSpec(
            model_bytes=util.model_to_bytes(model), custom_objects=custom,
            optimizer_config=util.optimizer_config(optimizer), optimizer_values=values, learning_rate=lr,
            loss=self.getLoss(), loss_weights=self.getLossWeights(), metrics=self.getMetrics(),
            compression=self.getGradientCompression(), feature_cols=list(self.getFeatureCols()),
            label_cols=list(self.getLabelCols()), sample_weight_col=self.getSampleWeightCol(), input_shapes=inputs,
            label_shapes=self.getLabelShapes() or outputs, continuous_cols=self.getContinuousCols(),
            categorical_cols=self.getCategoricalCols(), batch_size=batch,
            val_batch_size=self.getValBatchSize() or batch, epochs=self.getEpochs(),
            start_epoch=int(progress.get("epoch", -1)) + 1, history=dict(progress.get("history") or {}),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(), train_rows=int(train_rows),
            val_rows=int(val_rows or 0), shuffle=self.getShuffle(), random_seed=self.getRandomSeed(),
            verbose=self.getVerbose(), transformation_fn=self.getTransformationFn(),
            data_module=self.getDataModule(), inmemory_cache_all=self.getInMemoryCacheAll(),
            use_gpu=self.getUseGpu(), prefetch=int(self.getTensorflowDatasetPrefetchBufferSize() or 0),
            callbacks=list(self.getCallbacks() or []), checkpoint_callback=self.getCheckpointCallback(),
            floatx=keras.backend.floatx(), reader_pool_type=self.getReaderPoolType(),
            train_reader_num_workers=self.getTrainReaderNumWorker(),
            val_reader_num_workers=self.getValReaderNumWorker())

    def _load_checkpoint(self, run_id: str) -> Optional[dict]:
        """The run's checkpoint and progress (``{"checkpoint": bytes, "progress": dict or None, "history"}``),
        or None when the run has no checkpoint."""
        if not self._has_checkpoint(run_id):
            return None
        store = self.getStore()
        path = f"{store.get_checkpoint_path(run_id)}/{store.get_checkpoint_filename()}"
        if self.getVerbose():
            print(f"perseus.spark.keras: resuming run {run_id} from {path}", flush=True)
        progress = None
        if store.exists(path + PROGRESS_SUFFIX):
            progress = util.progress_from_bytes(store.read(path + PROGRESS_SUFFIX))
        return {"checkpoint": store.read(path), "progress": progress,
                "history": (progress or {}).get("history") or {}}

    def _model_from_checkpoint(self, data: bytes):
        """The model of a checkpoint file: a whole model, or weights loaded into the estimator's model."""
        custom = self.getCustomObjects() or {}
        try:
            return util.model_from_bytes(data, custom)
        except (ValueError, OSError, KeyError):
            model = util.model_from_bytes(util.model_to_bytes(self.getModel()), custom)
            util.weights_into(model, data)
            return model

    def _create_model(self, result: dict, run_id: str, metadata: dict) -> "KerasModel":
        """The ``KerasModel`` of rank 0's result: the checkpoint's model compiled on the driver with a plain
        optimizer holding the trained state and the learning rate as given (not scaled)."""
        model = self._model_from_checkpoint(result["checkpoint"])
        progress = result.get("progress")
        if isinstance(progress, bytes):
            progress = util.progress_from_bytes(progress)
        progress = progress or {}
        optimizer = util.optimizer_from_config(util.optimizer_config(self._optimizer()), self.getCustomObjects())
        model.compile(optimizer=optimizer, loss=self.getLoss(), loss_weights=self.getLossWeights(),
                      metrics=self.getMetrics())
        if progress.get("optimizer_values") is not None:
            util.restore_optimizer(optimizer, model, progress["optimizer_values"])
        util.set_lr(optimizer, progress.get("learning_rate"))
        return KerasModel(history=result.get("history") or {}, model=model, feature_columns=self.getFeatureCols(),
                          label_columns=self.getLabelCols(), custom_objects=self.getCustomObjects(), run_id=run_id,
                          _metadata=metadata, _floatx=keras.backend.floatx())


declare(KerasEstimator, [
    ("data_module", "the DataModule class that reads the prepared data", ParquetDataModule, None, None),
    ("custom_objects", "custom Keras classes and functions by name, for (de)serialising the model", None, None,
     None),
    ("checkpoint_callback", "a ModelCheckpoint callback writing the run's checkpoint (rank 0)", None, None, None),
    ("backend_env", "variables added to the ranks' environment", None, None, None),
])


class _Predictor:
    """The picklable prediction function of a ``KerasModel``'s ``transform``: features in, outputs out. The
    model travels as ``.keras`` bytes and is loaded once per Spark task; in a Spark task TensorFlow is kept off
    the GPUs when it has not started yet."""

    def __init__(self, model, custom_objects: dict, floatx: str):
        self.data = util.model_to_bytes(model)
        # pickled with cloudpickle itself, which honours its register_pickle_by_value (Spark's copy does not)
        self.custom_objects = cloudpickle.dumps(dict(custom_objects or {}))
        self.floatx = floatx
        self.shapes = util.model_shapes(model)[0]
        self.model = model

    def __getstate__(self):
        return {**self.__dict__, "model": None}

    def _model(self):
        if self.model is None:
            if TaskContext.get() is not None:
                try:
                    tf.config.set_visible_devices([], "GPU")
                except RuntimeError:  # TensorFlow already started in this worker: keep its devices
                    pass
            self.model = util.model_from_bytes(self.data, cloudpickle.loads(self.custom_objects))
        return self.model

    def __call__(self, features: List[np.ndarray]) -> List[np.ndarray]:
        shapes = self.shapes or [None] * len(features)
        inputs = []
        for values, shape in zip(features, shapes):
            array = np.asarray(values)
            if array.dtype.kind == "f":
                array = array.astype(self.floatx)
            inputs.append(_reshaped(array, shape))
        out = self._model()(inputs[0] if len(inputs) == 1 else inputs, training=False)
        if isinstance(out, dict):
            out = list(out.values())
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [np.asarray(o.numpy() if hasattr(o, "numpy") else o) for o in outs]


def _reshaped(array: np.ndarray, shape) -> np.ndarray:
    if not shape:
        return array
    dims = [array.shape[0]] + [int(d) for d in list(shape)[1:]]
    return array if dims.count(-1) > 1 else array.reshape(dims)


class KerasModel(HorovodModel, _KerasPersistence):
    """A trained Keras model as a Spark ``Transformer`` (``getModel()`` gives the compiled ``tf.keras`` model,
    ``getHistory()`` Keras' history dict, ``{metric: [value per epoch]}``).

    ``transform(df)`` runs the model on batches of rows in every Spark task (features reshaped to the model's
    inputs) and adds one column per label (``<label>__output``, or ``setOutputCols``): a double where the model
    gives one value per row, else a vector. Raises ValueError (from ``transform``) for a missing feature column.
    """

    @keyword_only
    def __init__(self, history=None, model=None, feature_columns=None, label_columns=None, custom_objects=None,
                 run_id=None, _metadata=None, _floatx=None):
        super().__init__()
        self._setDefault(custom_objects={})
        kwargs = {k: v for k, v in self._input_kwargs.items() if v is not None}
        if label_columns:
            self.setOutputCols([f"{c}__output" for c in label_columns])
        self.setParams(**kwargs)

    def _get_floatx(self) -> str:
        return self.getOrDefault(self._floatx) or keras.backend.floatx()

    def _predictor(self):
        model = self.getModel()
        if model is None:
            raise ValueError("KerasModel: no model (set it with setModel)")
        return _Predictor(model, self.getCustomObjects(), self._get_floatx())


declare(KerasModel, [
    ("custom_objects", "custom Keras classes and functions by name", None, None, None),
    ("_floatx", "Keras' float type when trained", None, None, "Floatx"),
])
