"""The Lightning estimator's default data module: this rank's share of the prepared Parquet data as Lightning
batches (Horovod's ``horovod.spark.lightning.datamodule``, whose ``PetastormDataModule`` it replaces).

:class:`ParquetDataModule` is a ``LightningDataModule`` made on every rank with Horovod's keyword arguments
(below). It reads with :class:`perseus.spark.common.datamodule.ParquetDataModule` (``ParquetBatches``: this
rank's row groups, shuffled per epoch, every rank the same number of batches) and gives the Trainer loaders of
exactly ``steps_per_epoch_train`` (``steps_per_epoch_val``) batches per epoch. A batch is a dict
``{column: torch.Tensor}`` (``batch["features"]``, ``batch["label"]``): numeric columns as tensors of the Parquet
dtype (float64 for arrays and vectors, shape ``(rows, length)``; ``(rows,)`` for scalars), other columns as numpy
arrays. ``transformation`` (the estimator's ``transformation_fn``) maps each batch, a dict of numpy arrays,
before it becomes tensors.

A data module of your own (the estimator's ``data_module``, a ``LightningDataModule`` class) is made with the same
keyword arguments less ``filesystem``; it must give every rank the same number of batches per epoch.
"""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import pytorch_lightning as pl
import torch

from perseus.spark.common.datamodule import ParquetDataModule as _ParquetReader

__all__ = ["ParquetDataModule", "PetastormDataModule", "to_tensors"]


def to_tensors(batch: dict) -> dict:
    """A numpy batch as the model's steps get it: numeric arrays as tensors, other values as they are."""
    out = {}
    for name, value in batch.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            out[name] = torch.as_tensor(value)
        else:
            out[name] = value
    return out


class _Epochs:
    """A loader of ``steps`` batches per pass (``len`` is ``steps``), taken from a stream that never runs dry."""

    def __init__(self, stream, steps: int):
        self.stream, self.steps = stream, int(steps)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for batch in itertools.islice(self.stream, self.steps):
            yield to_tensors(batch)


class ParquetDataModule(pl.LightningDataModule):
    """Reads the prepared data on a rank (see the module doc). Every rank of the job makes one.

    ``num_reader_epochs``, ``reader_pool_type``, ``reader_worker_count``, ``transformation_edit_fields``,
    ``transformation_removed_fields``, ``debug_data_loader`` and the async queue sizes are Horovod's Petastorm
    settings: accepted, no effect (one reader per rank, in the training thread).

    Raises (when the data is first read): what :class:`perseus.spark.common.reader.ParquetBatches` raises.
    """

    def __init__(self, train_dir: str, val_dir: Optional[str] = None, num_train_epochs: int = 1, has_val: bool = True,
                 train_batch_size: int = 32, val_batch_size: int = 32, shuffle: bool = True,
                 num_reader_epochs=None, reader_pool_type: str = "thread", reader_worker_count: int = 2,
                 transformation=None, transformation_edit_fields=None, transformation_removed_fields=None,
                 inmemory_cache_all: bool = False, cur_shard: int = 0, shard_count: int = 1, schema_fields=None,
                 storage_options=None, steps_per_epoch_train: int = 1, steps_per_epoch_val: int = 1,
                 verbose: bool = True, debug_data_loader: bool = False, train_async_data_loader_queue_size=None,
                 val_async_data_loader_queue_size=None, seed: Optional[int] = None, filesystem=None, **kwargs):
        super().__init__()
        self.train_dir, self.val_dir, self.has_val = train_dir, val_dir, bool(has_val)
        self.num_train_epochs = num_train_epochs
        self.train_batch_size, self.val_batch_size = train_batch_size, val_batch_size
        self.shuffle, self.transformation, self.inmemory_cache_all = shuffle, transformation, inmemory_cache_all
        self.cur_shard, self.shard_count, self.schema_fields = cur_shard, shard_count, schema_fields
        self.storage_options, self.filesystem = storage_options, filesystem
        self.steps_per_epoch_train, self.steps_per_epoch_val = steps_per_epoch_train, steps_per_epoch_val
        self.verbose, self.seed = verbose, seed
        self._reader = None
        self._train = self._val = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self._reader is not None:
            return
        self._reader = _ParquetReader(
            train_dir=self.train_dir, val_dir=self.val_dir, num_train_epochs=self.num_train_epochs,
            has_val=self.has_val, train_batch_size=self.train_batch_size, val_batch_size=self.val_batch_size,
            shuffle=self.shuffle, transform_fn=self.transformation, inmemory_cache_all=self.inmemory_cache_all,
            cur_shard=self.cur_shard, shard_count=self.shard_count, schema_fields=self.schema_fields,
            storage_options=self.storage_options, steps_per_epoch_train=self.steps_per_epoch_train,
            steps_per_epoch_val=self.steps_per_epoch_val, verbose=self.verbose, random_seed=self.seed,
            filesystem=self.filesystem)
        self._train = self._reader.train_data()
        self._val = self._reader.val_data() if self.has_val else None

    def train_dataloader(self):
        return _Epochs(self._train, self.steps_per_epoch_train)

    def val_dataloader(self):
        if not self.has_val:
            return []
        return _Epochs(self._val, self.steps_per_epoch_val)

    def teardown(self, stage: Optional[str] = None) -> None:
        for stream in (self._train, self._val):
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        self._reader = self._train = self._val = None


#: Horovod's name for the default data module
PetastormDataModule = ParquetDataModule
