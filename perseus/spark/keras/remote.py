"""The training function a :class:`~perseus.spark.keras.KerasEstimator` runs on every rank.

Each rank: ``hvd.init()`` (``perseus.tensorflow.keras``); its GPU (the local rank's, with memory growth) or
none; the model from the driver's ``.keras`` bytes (``custom_objects`` honoured); the optimizer from its Keras
configuration with the learning rate multiplied by the number of ranks (Horovod's estimator convention; the
run's progress file keeps the rate as given), wrapped in perseus's ``DistributedOptimizer``; ``model.compile``
with the estimator's loss, loss weights and metrics; the optimizer's saved state, when there is one; then
``model.fit`` on a ``tf.data`` pipeline over this rank's batches of the prepared data (the same number of steps
on every rank), with ``BroadcastGlobalVariablesCallback(0)``, ``MetricAverageCallback()`` and the user's
callbacks. After every epoch rank 0 writes the checkpoint (the model as a ``.keras`` archive, or what the
user's ``checkpoint_callback`` wrote) and ``<checkpoint>.progress.npz`` (epoch, history, learning rate,
optimizer state) into a local run directory and copies it into the store's run directory. Rank 0 returns
``{"history", "checkpoint", "progress"}`` (bytes of both files); the other ranks return None.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import warnings
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

import perseus.tensorflow.keras as hvd
from perseus.tensorflow._keras.callbacks import _LearningRateSchedule
from perseus.spark.common.datamodule import ParquetDataModule
from perseus.spark.keras import util
from perseus.spark.keras.util import keras

__all__ = ["TrainSpec", "RemoteTrainer", "PROGRESS_SUFFIX", "keras_batch"]

#: the progress file of a run: ``<checkpoint filename><PROGRESS_SUFFIX>`` beside the checkpoint
PROGRESS_SUFFIX = ".progress.npz"


@dataclasses.dataclass
class TrainSpec:
    """Everything a rank needs, picklable (made by the estimator on the driver)."""

    model_bytes: bytes               # the model to start from, a .keras archive
    custom_objects: dict
    optimizer_config: dict           # keras.optimizers.serialize of the optimizer
    optimizer_values: Optional[list]  # its variables' values to start from (a checkpoint's), or None
    learning_rate: Optional[float]   # the unscaled learning rate to start from; None: the configuration's
    loss: Any
    loss_weights: Any
    metrics: Any
    compression: Any
    feature_cols: list
    label_cols: list
    sample_weight_col: Optional[str]
    input_shapes: Optional[list]     # per feature column, -1 for unknown dimensions (None: no reshape)
    label_shapes: Optional[list]     # per label column (label_shapes, else the model's output shapes)
    continuous_cols: Optional[list]
    categorical_cols: Optional[list]
    batch_size: int
    val_batch_size: int
    epochs: int
    start_epoch: int
    history: dict                    # the Keras history of the epochs before start_epoch
    train_steps_per_epoch: Optional[int]
    validation_steps_per_epoch: Optional[int]
    train_rows: int
    val_rows: int
    shuffle: bool
    random_seed: Optional[int]
    verbose: int
    transformation_fn: Optional[Callable]
    data_module: Optional[type]
    inmemory_cache_all: bool
    use_gpu: bool
    prefetch: int
    callbacks: list
    checkpoint_callback: Any
    floatx: str
    reader_pool_type: str = "thread"
    train_reader_num_workers: int = 2
    val_reader_num_workers: int = 2
    store: Any = None                # the store's remote view (paths, sync, file system)


def _reshape(array: np.ndarray, shape: Optional[list]) -> np.ndarray:
    """``array`` (rows first) reshaped to ``shape`` (-1 for the batch and unknown dimensions) when at most one
    dimension besides the batch is unknown; as it is otherwise."""
    if not shape:
        return array
    dims = [array.shape[0]] + [int(d) for d in list(shape)[1:]]
    if dims.count(-1) > 1:
        return array
    return array.reshape(dims)


def _column(values, shape, floatx: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind == "f" and array.dtype != np.dtype(floatx):
        array = array.astype(floatx)
    return _reshape(array, shape)


def keras_batch(batch: dict, spec: TrainSpec) -> tuple:
    """One ``{column: array}`` batch as Keras' ``(inputs, targets[, sample_weights])``: an array for a single
    input or output, a tuple for several; floating columns as ``floatx``."""
    n_in, n_out = len(spec.feature_cols), len(spec.label_cols)
    in_shapes = spec.input_shapes or [None] * n_in
    out_shapes = spec.label_shapes or [None] * n_out
    x = [_column(batch[c], s, spec.floatx) for c, s in zip(spec.feature_cols, in_shapes)]
    y = [_column(batch[c], s, spec.floatx) for c, s in zip(spec.label_cols, out_shapes)]
    out = (x[0] if n_in == 1 else tuple(x), y[0] if n_out == 1 else tuple(y))
    if spec.sample_weight_col:
        w = np.asarray(batch[spec.sample_weight_col], dtype=spec.floatx).reshape(-1)
        out += (w if n_out == 1 else tuple([w] * n_out),)
    return out


def _dataset(batches, spec: TrainSpec):
    """A ``tf.data.Dataset`` over a data module's batches: itself when the module gives a dataset, else the
    ``{column: array}`` batches converted by :func:`keras_batch` (the signature taken from the first)."""
    if isinstance(batches, tf.data.Dataset):
        return batches
    source = iter(batches)
    first = [keras_batch(next(source), spec)]

    def generate():
        while first:
            yield first.pop()
        for batch in source:
            yield keras_batch(batch, spec)

    signature = tf.nest.map_structure(
        lambda a: tf.TensorSpec((None,) + tuple(a.shape[1:]), tf.as_dtype(a.dtype)), first[0])
    dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
    return dataset.prefetch(spec.prefetch if spec.prefetch > 0 else tf.data.AUTOTUNE)


def _pin_devices(use_gpu: bool) -> None:
    """This rank's GPU (local rank modulo the GPUs, memory growing as needed), or no GPU with ``use_gpu``
    False."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    if not use_gpu:
        tf.config.set_visible_devices([], "GPU")
        return
    gpu = gpus[hvd.local_rank() % len(gpus)]
    tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.set_visible_devices(gpu, "GPU")


class _RunCheckpoint(keras.callbacks.Callback):
    """Rank 0, after every epoch: the checkpoint (the model, unless the user's ``checkpoint_callback`` wrote it
    to ``user_file``) and the progress file into ``out_dir``, then ``out_dir`` copied into the store."""

    def __init__(self, spec: TrainSpec, out_dir: str, size: int, user_file: Optional[str]):
        super().__init__()
        self.spec, self.out_dir, self.size, self.user_file = spec, out_dir, size, user_file
        self.path = os.path.join(out_dir, spec.store.checkpoint_filename)
        self.history = dict(spec.history)

    def save_model(self) -> None:
        tmp = os.path.join(self.out_dir, "perseus-checkpoint.keras")
        self.model.save(tmp)
        os.replace(tmp, self.path)

    def on_epoch_end(self, epoch, logs=None):
        if self.user_file is None:
            self.save_model()
        elif os.path.exists(self.user_file):
            os.replace(self.user_file, self.path)
        values = {k: [float(np.asarray(v))] for k, v in (logs or {}).items() if np.size(v) == 1}
        self.history = util.merge_history(self.history, values)
        optimizer = self.model.optimizer
        lr = util.get_lr(optimizer)
        progress = util.progress_to_bytes(epoch, self.history, None if lr is None else lr / self.size,
                                          util.optimizer_values(optimizer))
        with open(self.path + PROGRESS_SUFFIX, "wb") as f:
            f.write(progress)
        if self.spec.store.saving_runs:
            self.spec.store.sync(self.out_dir)

    def result(self) -> dict:
        """What rank 0 returns (the model saved now if no checkpoint was written)."""
        if not os.path.exists(self.path):
            self.save_model()
        with open(self.path, "rb") as f:
            checkpoint = f.read()
        progress_path = self.path + PROGRESS_SUFFIX
        progress = None
        if os.path.exists(progress_path):
            with open(progress_path, "rb") as f:
                progress = f.read()
        return {"history": self.history, "checkpoint": checkpoint, "progress": progress}


class RemoteTrainer:
    """``trainer(spec)`` trains on this rank (see the module doc). Collective: every rank of the job calls it.

    Raises: what the model, the loss, Keras or the data raise (the job then fails naming the rank);
    ValueError when the saved optimizer state does not fit the model.
    """

    def __call__(self, spec: TrainSpec):
        hvd.init()
        _pin_devices(spec.use_gpu)
        if spec.random_seed is not None:
            keras.utils.set_random_seed(spec.random_seed)
        keras.backend.set_floatx(spec.floatx)
        model = util.model_from_bytes(spec.model_bytes, spec.custom_objects)
        size = hvd.size()
        optimizer = util.optimizer_from_config(spec.optimizer_config, spec.custom_objects)
        lr = spec.learning_rate if spec.learning_rate is not None else util.get_lr(optimizer)
        scaled = None if lr is None else lr * size
        util.set_lr(optimizer, scaled)
        kwargs = {"compression": spec.compression} if spec.compression is not None else {}
        optimizer = hvd.DistributedOptimizer(optimizer, **kwargs)
        model.compile(optimizer=optimizer, loss=spec.loss, loss_weights=spec.loss_weights, metrics=spec.metrics)
        if spec.optimizer_values is not None:
            util.restore_optimizer(optimizer, model, spec.optimizer_values)
            util.set_lr(optimizer, scaled)
        return _Fit(spec, model, size, scaled).run()


class _Fit:
    def __init__(self, spec: TrainSpec, model, size: int, scaled_lr: Optional[float]):
        self.spec, self.model, self.size, self.scaled_lr = spec, model, size, scaled_lr
        self.rank = hvd.rank()
        self.steps = spec.train_steps_per_epoch or max(1, math.ceil(spec.train_rows / spec.batch_size / size))
        self.val_steps = 0
        if spec.val_rows > 0:
            self.val_steps = spec.validation_steps_per_epoch or max(
                1, math.ceil(spec.val_rows / spec.val_batch_size / size))

    def _callbacks(self, out_dir: str):
        """perseus's two callbacks, the user's (their learning-rate schedules starting from the scaled rate;
        TensorBoard on rank 0 only, writing to the run's logs, and only when TensorBoard is installed), and on
        rank 0 the checkpointing (and a TensorBoard callback when the user gave none)."""
        s = self.spec
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        logs_dir = os.path.join(out_dir, s.store.logs_subdir)
        board = None
        has_tensorboard = importlib.util.find_spec("tensorboard") is not None
        for cb in s.callbacks or []:
            if isinstance(cb, keras.callbacks.TensorBoard):
                if not has_tensorboard:
                    if self.rank == 0:
                        warnings.warn("perseus.spark.keras: TensorBoard is not installed; the TensorBoard "
                                      "callback is left out (pip install tensorboard)", stacklevel=2)
                    continue
                if self.rank == 0 and board is None:
                    cb.log_dir = logs_dir
                    board = cb
                continue
            if isinstance(cb, _LearningRateSchedule) and self.scaled_lr is not None:
                cb.initial_lr = self.scaled_lr
            callbacks.append(cb)
        if self.rank != 0:
            return callbacks, None
        user_file = None
        if s.checkpoint_callback is not None:
            weights_only = bool(getattr(s.checkpoint_callback, "save_weights_only", False))
            suffix = (".weights.h5" if util.is_keras3() else ".h5") if weights_only else ".keras"
            user_file = os.path.join(out_dir, "perseus-user-checkpoint" + suffix)
            s.checkpoint_callback.filepath = user_file
            callbacks.append(s.checkpoint_callback)
        if board is None and s.store.saving_runs and has_tensorboard:
            board = keras.callbacks.TensorBoard(logs_dir)
        if board is not None:
            callbacks.append(board)
        checkpoint = _RunCheckpoint(s, out_dir, self.size, user_file)
        callbacks.append(checkpoint)
        return callbacks, checkpoint

    def _data_module(self):
        s = self.spec
        module = s.data_module or ParquetDataModule
        fields = s.feature_cols + s.label_cols + ([s.sample_weight_col] if s.sample_weight_col else [])
        return module(train_dir=s.store.train_data_path, val_dir=s.store.val_data_path, num_train_epochs=s.epochs,
                      has_val=self.val_steps > 0, train_batch_size=s.batch_size, val_batch_size=s.val_batch_size,
                      shuffle=s.shuffle, transform_fn=s.transformation_fn, inmemory_cache_all=s.inmemory_cache_all,
                      cur_shard=self.rank, shard_count=self.size, schema_fields=fields,
                      storage_options=s.store.storage_options, steps_per_epoch_train=self.steps,
                      steps_per_epoch_val=self.val_steps, verbose=s.verbose if self.rank == 0 else 0,
                      random_seed=s.random_seed, filesystem=s.store.filesystem(), label_cols=s.label_cols,
                      continuous_cols=s.continuous_cols, categorical_cols=s.categorical_cols,
                      tensorflow_dataset_prefetch_buffer_size=s.prefetch, reader_pool_type=s.reader_pool_type,
                      train_reader_worker_count=s.train_reader_num_workers,
                      val_reader_worker_count=s.val_reader_num_workers)

    def run(self):
        s = self.spec
        verbose = s.verbose if self.rank == 0 else 0
        if verbose:
            print(f"perseus.spark.keras: epochs {s.start_epoch}..{s.epochs - 1}, {s.train_rows} training rows, "
                  f"{self.steps} steps per epoch of {s.batch_size} rows on each of {self.size} ranks"
                  + (f", {self.val_steps} validation steps" if self.val_steps else "")
                  + (f", learning rate {self.scaled_lr:g}" if self.scaled_lr is not None else ""), flush=True)
        with s.store.get_local_output_dir() as out_dir, self._data_module() as dm:
            callbacks, checkpoint = self._callbacks(out_dir)
            train = _dataset(dm.train_data(), s)
            val = _dataset(dm.val_data(), s) if self.val_steps else None
            self.model.fit(train, validation_data=val, steps_per_epoch=self.steps,
                           validation_steps=self.val_steps or None, epochs=s.epochs, initial_epoch=s.start_epoch,
                           callbacks=callbacks, verbose=verbose, shuffle=False)  # the reader shuffles
            return checkpoint.result() if checkpoint is not None else None
