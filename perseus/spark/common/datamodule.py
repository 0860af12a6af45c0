"""Data modules: how a rank of an estimator's job reads its share of the prepared data (Horovod's
``horovod.spark.common.datamodule`` interface).

A data module is a context manager made on every rank with the keyword arguments below; ``train_data()`` and
``val_data()`` give iterables of batches that never run dry (each epoch takes ``steps_per_epoch_*`` batches
from them). :class:`ParquetDataModule`, the default, reads the Parquet data that ``prepare_data`` wrote, with
:class:`perseus.spark.common.reader.ParquetBatches`: this rank's row groups, shuffled per epoch, every rank
the same number of batches. A batch is ``{column: numpy array}``; ``transform_fn`` (the estimator's
``transformation_fn``) maps each batch before the step.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Optional

from perseus.spark.common.reader import ParquetBatches

__all__ = ["DataModule", "ParquetDataModule"]


class DataModule:
    """The interface every data module has (subclass it to read data another way; pass the class as the
    estimator's ``data_module``)."""

    short_name: Optional[str] = None

    def __init__(self, train_dir: str, val_dir: Optional[str], num_train_epochs: int = 1, has_val: bool = True,
                 train_batch_size: int = 32, val_batch_size: int = 32, shuffle: bool = True,
                 transform_fn: Optional[Callable] = None, inmemory_cache_all: bool = False, cur_shard: int = 0,
                 shard_count: int = 1, schema_fields=None, storage_options=None, steps_per_epoch_train: int = 1,
                 steps_per_epoch_val: int = 1, verbose: int = 0, random_seed: Optional[int] = None,
                 filesystem=None, **kwargs):
        self.train_dir, self.val_dir = train_dir, val_dir
        self.num_train_epochs, self.has_val = num_train_epochs, has_val
        self.train_batch_size, self.val_batch_size = train_batch_size, val_batch_size
        self.shuffle, self.transform_fn, self.inmemory_cache_all = shuffle, transform_fn, inmemory_cache_all
        self.cur_shard, self.shard_count = cur_shard, shard_count
        self.schema_fields = list(schema_fields or [])
        self.storage_options, self.filesystem = storage_options, filesystem
        self.steps_per_epoch_train, self.steps_per_epoch_val = steps_per_epoch_train, steps_per_epoch_val
        self.verbose, self.random_seed = verbose, random_seed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def train_data(self):
        """An iterable of training batches that never runs dry."""
        raise NotImplementedError("a DataModule subclass implements train_data()")

    def val_data(self):
        """An iterable of validation batches that never runs dry."""
        raise NotImplementedError("a DataModule subclass implements val_data()")


class ParquetDataModule(DataModule):
    """Reads the prepared Parquet data (see the module doc). Every rank of the job makes one and takes the same
    number of batches per epoch.

    Raises (when the data is first read): what :class:`ParquetBatches` raises (an empty share names the rank
    and the fix).
    """

    short_name = "parquet"

    def _batches(self, path: str, batch_size: int, steps: int, shuffle: bool) -> Iterator[dict]:
        reader = ParquetBatches(path, self.schema_fields, batch_size, self.cur_shard, self.shard_count,
                                shuffle=shuffle, seed=self.random_seed or 0, filesystem=self.filesystem,
                                cache=self.inmemory_cache_all)
        for epoch in itertools.count():
            for batch in reader.epoch(epoch, steps=steps):
                yield self.transform_fn(batch) if self.transform_fn is not None else batch

    def train_data(self):
        return self._batches(self.train_dir, self.train_batch_size, self.steps_per_epoch_train, self.shuffle)

    def val_data(self):
        if not self.has_val:
            return iter(())
        return self._batches(self.val_dir, self.val_batch_size, self.steps_per_epoch_val, False)
