"""The whole table of a :class:`perseus.torch.DistributedEmbedding`: gathering it from the column shards,
scattering one into them, and state dicts that hold either a full table or this rank's shard.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from perseus.runtime import collectives as _c
from perseus.torch._tensors import synchronize

__all__ = ["FullTable", "full_state_dict", "mark_state_dict", "MODEL_PARALLEL_ATTR"]

#: Attribute set (True) on parameters, and on their state-dict tensors, that hold a different shard on each
#: rank: perseus' DistributedOptimizer does not reduce their gradients and the broadcast helpers skip them.
MODEL_PARALLEL_ATTR = "perseus_model_parallel"

_METADATA_KEY = "perseus_shard"


class FullTable:
    """The full-table methods of :class:`perseus.torch.DistributedEmbedding`, placed before ``nn.Module`` in
    its bases. They use the embedding's layout (``num_embeddings``, ``embedding_dim``, ``columns``,
    ``weight``, ``_size``, ``_rank``, ``_job_ranks``, ``_widths``, ``_bounds``) and its collectives
    (``_allgather``, ``_alltoall_async``, ``_what``)."""

    # -- full table ----------------------------------------------------------------------------------------
    def _root_position(self, root_rank) -> int:
        root_rank = int(root_rank)
        if root_rank not in self._job_ranks:
            raise ValueError(f"{self._what()}: root_rank {root_rank} is not a rank of the process set "
                             f"(ranks {self._job_ranks})")
        return self._job_ranks.index(root_rank)

    def full_weight(self, root_rank: Optional[int] = 0) -> Optional[torch.Tensor]:
        """The full ``[num_embeddings, embedding_dim]`` table, gathered from the shards.

        With ``root_rank`` (a job rank; default 0) only that rank gets it and the others get None; with
        ``root_rank=None`` every rank gets it. Collective over the process set. Rows whose deferred gradient
        (see :meth:`prefetch`) is still pending do not have it yet.
        """
        L = self.num_embeddings
        shard = self.weight.detach().contiguous().reshape(-1)
        if self._size == 1:
            return shard.view(L, -1).clone()
        if root_rank is None:
            flat, _ = self._allgather(shard, "full", 0)
        else:
            pos = self._root_position(root_rank)
            splits = [shard.numel() if k == pos else 0 for k in range(self._size)]
            flat = synchronize(self._alltoall_async(shard, splits, "gather_full", 0))
            if self._rank != pos:
                return None
        parts = flat.split([L * w for w in self._widths])
        return torch.cat([p.view(L, w) for p, w in zip(parts, self._widths)], dim=1)

    def load_full_weight(self, weight: Optional[torch.Tensor], root_rank: Optional[int] = None) -> None:
        """Copy this rank's columns of a full ``[num_embeddings, embedding_dim]`` table into the shard.

        With ``root_rank=None`` every rank passes the table and nothing is communicated. With a job rank, only
        that rank's ``weight`` is read (others may pass None) and each rank receives its columns from it
        (collective over the process set).
        """
        L, D = self.num_embeddings, self.embedding_dim
        if root_rank is None or self._size == 1:
            if weight is None or tuple(weight.shape) != (L, D):
                raise ValueError(f"{self._what()}: expected the full table [{L}, {D}], got "
                                 f"{None if weight is None else tuple(weight.shape)}")
            c0, c1 = self.columns
            with torch.no_grad():
                self.weight.copy_(weight.detach()[:, c0:c1])
            return
        pos = self._root_position(root_rank)
        if self._rank == pos:
            if weight is None or tuple(weight.shape) != (L, D):
                raise ValueError(f"{self._what()}: expected the full table [{L}, {D}] on the root, got "
                                 f"{None if weight is None else tuple(weight.shape)}")
            src = weight.detach().to(self.weight.dtype)
            send = torch.cat([src[:, c0:c1].reshape(-1) for c0, c1 in self._bounds])
            splits = [L * w for w in self._widths]
        else:
            send = torch.zeros(0, dtype=self.weight.dtype)
            splits = [0] * self._size
        received = synchronize(self._alltoall_async(send, splits, "scatter_full", 0))
        with torch.no_grad():
            self.weight.copy_(received.view(L, -1))

    def full_state_dict(self, root_rank: Optional[int] = 0):
        """``state_dict()`` with the full table instead of the shard (see :func:`full_state_dict`)."""
        return full_state_dict(self, root_rank)

    def load_full_state_dict(self, state_dict, root_rank: Optional[int] = None):
        """Load a state dict holding the full table. With ``root_rank`` only that rank's ``state_dict`` is
        read (others may pass None) and each rank receives its columns from it (collective)."""
        if root_rank is None or self._size == 1:
            return self.load_state_dict(state_dict)
        pos = self._root_position(root_rank)
        self.load_full_weight(state_dict["weight"] if self._rank == pos else None, root_rank)

    # -- state dict ----------------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor):
            L, D = self.num_embeddings, self.embedding_dim
            info = (local_metadata or {}).get(_METADATA_KEY)
            c0, c1 = self.columns
            whole = tuple(value.shape) == (L, D) and (info is None or tuple(info["columns"]) == (0, D))
            if whole:
                state_dict[key] = value[:, c0:c1]
            elif not (info is not None and tuple(info["columns"]) == (c0, c1) and int(info["embedding_dim"]) == D
                      and tuple(value.shape) == (L, c1 - c0)):
                where = "" if info is None else (f" (the shard of columns {tuple(info['columns'])} of "
                                                 f"{info['embedding_dim']}, saved by one of {info['num_shards']} "
                                                 "ranks)")
                error_msgs.append(
                    f"{self._what()}: {key!r} has shape {tuple(value.shape)}{where}; expected the full table "
                    f"[{L}, {D}] or this rank's shard (columns {self.columns}). Save full tables with "
                    "perseus.torch.embedding.full_state_dict(model) to load them on any number of ranks.")
                state_dict = dict(state_dict)
                del state_dict[key]
                before = len(missing_keys)
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                              unexpected_keys, error_msgs)
                del missing_keys[before:]
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def mark_state_dict(module, state_dict, prefix, local_metadata):
    """State-dict post-hook of a DistributedEmbedding: mark its shard model-parallel and note its columns."""
    t = state_dict.get(prefix + "weight")
    if isinstance(t, torch.Tensor):
        try:
            setattr(t, MODEL_PARALLEL_ATTR, True)
        except (AttributeError, RuntimeError):
            pass
    local_metadata[_METADATA_KEY] = {"columns": list(module.columns), "embedding_dim": module.embedding_dim,
                                     "num_shards": module._size}


def full_state_dict(model: nn.Module, root_rank: Optional[int] = 0):
    """``model.state_dict()`` with the full table of every :class:`DistributedEmbedding` in place of its shard.

    Collective: every rank calls it (each table gathers its shards). With ``root_rank`` (a job rank, default
    0) that rank gets the state dict and the others None; with ``root_rank=None`` every rank gets it. Save it
    on the root (``torch.save``); ``model.load_state_dict`` then loads it on any number of ranks (each keeps
    its columns), and into ``nn.Embedding`` as well.
    """
    state = model.state_dict()
    me = _c.runtime().rank()
    keep = root_rank is None or me == int(root_rank)
    for name, module in model.named_modules():
        if not isinstance(module, FullTable):
            continue
        full = module.full_weight(root_rank)
        key = f"{name}.weight" if name else "weight"
        if keep and full is not None:
            state[key] = full
            meta = getattr(state, "_metadata", {}).get(name)
            if meta is not None:
                meta.pop(_METADATA_KEY, None)
    return state if keep else None
