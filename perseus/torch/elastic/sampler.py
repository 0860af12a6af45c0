"""ElasticSampler: a DistributedSampler that remembers how far the epoch got (Horovod's
``horovod.torch.elastic.sampler``)."""

from __future__ import annotations

import math
import random

import torch.utils.data

from perseus.torch.mpi_ops import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Shards the samples of the epoch that are not yet processed across the current ranks.

    Like ``DistributedSampler``, each rank gets every ``size()``-th index of the epoch's order, padded by
    repeating indices so that every rank gets the same number. Unlike it, the sampler counts the samples
    already processed this epoch; kept in a ``TorchState``, that count is committed, restored and synced with
    the rest of the state, so after a reset the epoch resumes where it stopped, sharded over the ranks the job
    has now.

    Use it like this:

    1. put it in the ``TorchState`` (``TorchState(model, optimizer, sampler=sampler)``);
    2. call :meth:`record_batch` after each batch (or :meth:`record_indices` with the indices used);
    3. call :meth:`set_epoch` at the *end* of each epoch, which clears the processed samples.

    The remaining samples are recomputed by :meth:`set_epoch`, :meth:`load_state_dict` (so by restore and sync)
    and :meth:`reset`, not by iterating: iterating twice without those gives the same samples twice.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the order of each epoch (the same order on every rank).
        seed: shuffling seed; must be the same on every rank. Epoch ``e`` uses ``seed + e``.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        super().__init__()
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed

        self.epoch = 0
        self.processed_num = 0          # samples processed this epoch by all ranks: a prefix of the epoch order
        self.processed_indices = set()  # further indices recorded one by one (record_indices)

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.num_samples = 0
        self.total_size = 0
        self.indices = []

        self.reset()

    def set_epoch(self, epoch):
        """Start epoch ``epoch``: new order (when shuffling), nothing processed yet.

        Call it when an epoch *ends* (then ``epoch + 1``), so that an interrupted epoch is not started over.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Record that every rank processed one more batch of ``batch_size`` samples.

        Adds ``batch_size * num_replicas`` to :attr:`processed_num`: the ranks together consumed that many more
        samples of the epoch's order. ``batch_idx`` is accepted for Horovod compatibility and not used.
        """
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices):
        """Record dataset indices this rank processed; ``sync`` unites every rank's recorded indices."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self):
        return dict(epoch=self.epoch, processed_num=self.processed_num,
                    processed_indices=sorted(self.processed_indices))

    def load_state_dict(self, state_dict):
        """Load :meth:`state_dict` output (Horovod's, without ``processed_indices``, works too) and reshard."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.processed_indices = set(state_dict.get("processed_indices", ()))
        self.reset()

    def reset(self):
        """Re-read ``rank()``/``size()`` and recompute the samples left in this epoch and this rank's share."""
        self.num_replicas = size()
        self.rank = rank()

        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = order[self.processed_num:]
        if self.processed_indices:
            remaining = [i for i in remaining if i not in self.processed_indices]
        self.remaining_indices = remaining

        self.num_samples = int(math.ceil(len(remaining) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        padding = self.total_size - len(indices)
        if padding > 0:
            # Repeat from the start (more than once when fewer samples are left than ranks).
            indices += (indices * int(math.ceil(padding / len(indices))))[:padding]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
