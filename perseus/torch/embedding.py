"""EmbRace: an embedding table sharded by columns across the ranks (``perseus.torch.DistributedEmbedding``).

Data-parallel training keeps a whole copy of every embedding table on every rank and averages the table's
gradient across the ranks, although each step touches only the rows of the batch's tokens. A
:class:`DistributedEmbedding` instead keeps on each rank of its process set a *column shard* of the table
(``embedding_dim`` split as evenly as possible, the first ``embedding_dim % size`` ranks holding one column
more), and per forward/backward:

1. **allgather** of the batch's token ids (the number of tokens may differ between ranks, and may be zero);
2. every rank looks up *its columns* for the unique ids of *every* rank (sorted, deduplicated per rank);
3. **alltoall**: rank ``j`` receives the columns of its own unique ids from every rank, puts them side by
   side and expands them to its tokens: the output equals ``nn.Embedding`` with the full table;
4. backward: rank ``j`` sums its output gradient over duplicate ids (coalescing: one row per unique id),
   splits the coalesced rows by columns and sends each rank its columns (**alltoall**); each rank adds the
   rows it receives from all ranks into its shard's gradient (dense, or a sparse COO tensor with
   ``sparse=True``), scaled by ``1/size`` so that it equals the averaged gradient data-parallel training
   would compute for those columns.

Only values travel: the ids, and therefore every split size and the row each value belongs to, are known on
every rank from the gathered ids. Per step and rank this moves ``2 (size-1)/size * U * D`` values (``U``
unique ids of a rank, ``D`` the embedding dimension) plus the ids, where an allgather of the sparse gradient
moves ``(size-1) * rows * D``.

The shard is each rank's own: the parameter carries ``perseus_model_parallel = True`` and
``DistributedOptimizer``, ``broadcast_parameters`` and ``broadcast_optimizer_state`` leave it alone. Each
rank's optimizer updates its shard with the averaged gradient of those columns, which is what data-parallel
training does to the same columns, for any optimizer that updates each element from its own gradient
(SGD, Adam, SparseAdam, Adagrad...). Optimizers that look at the whole parameter (gradient clipping by the
global norm, LAMB/LARS trust ratios) see only the shard.

**Vertical scheduling** (:meth:`DistributedEmbedding.prefetch`): when the ids of the *next* forward are
known, the coalesced gradient rows split into those the next forward reads (sent at once, highest priority)
and the others (sent with the lowest priority, in the background, and merged into the gradient of the next
backward, so that the optimizer applies them one step later). Rows that are deferred are exactly the rows
the next forward does not read, so no forward ever sees a stale row (every forward checks this, see
:meth:`prefetch`). This is exact for optimizers that leave a row with a zero gradient unchanged and whose
per-row update does not depend on the step count (SGD without momentum or weight decay, Adagrad without
``lr_decay``); SparseAdam applies deferred rows with the next step's bias correction. Its methods are in
:mod:`perseus.torch._embedding_prefetch`.

**Priorities** travel with each request into the engine's negotiation, which orders the requests that
became ready in the same round by priority (higher first, ties by the negotiated index) identically on
every rank; nothing is reordered locally. See :class:`DistributedEmbedding` for the values.

Saving: ``state_dict()`` holds this rank's shard (and its column range in the state dict's metadata);
:func:`full_state_dict` gathers full tables; ``load_state_dict`` accepts a full table (any number of ranks)
or this rank's own shard.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from perseus.runtime import collectives as _c
from perseus.base.partition import even_counts
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import Average, ReduceOp, Sum
from perseus.torch._embedding_full import MODEL_PARALLEL_ATTR, FullTable, full_state_dict, mark_state_dict
from perseus.torch._embedding_prefetch import VerticalScheduling
from perseus.torch._tensors import _alloc_like, _dtype, _np, synchronize

__all__ = ["DistributedEmbedding", "full_state_dict", "is_model_parallel", "MODEL_PARALLEL_ATTR"]

def is_model_parallel(tensor) -> bool:
    """True when ``tensor`` is a per-rank shard (a parameter or state-dict tensor of a DistributedEmbedding)."""
    return bool(getattr(tensor, MODEL_PARALLEL_ATTR, False))


_names_lock = threading.Lock()
_names: dict = {}


def _default_name(ps_id: int) -> str:
    with _names_lock:
        n = _names.get(ps_id, 0)
        _names[ps_id] = n + 1
    return f"embrace.{ps_id}.{n}"


def _reset_names() -> None:
    with _names_lock:
        _names.clear()


_c.runtime().register_job_state(_reset_names)


class _Plan:
    """What one forward learned from the gathered ids, identically on every rank (but ``inverse``)."""

    __slots__ = ("all_ids", "uniq", "ucounts", "uoffsets", "inverse", "shape")

    def __init__(self, all_ids, uniq, ucounts, inverse, shape):
        self.all_ids, self.uniq, self.ucounts, self.inverse, self.shape = all_ids, uniq, ucounts, inverse, shape
        offsets = [0]
        for u in ucounts:
            offsets.append(offsets[-1] + u)
        self.uoffsets = offsets


class _Deferred:
    __slots__ = ("handle", "rows")

    def __init__(self, handle, rows):
        self.handle, self.rows = handle, rows


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, module, plan):
        ctx.module, ctx.plan = module, plan
        return module._lookup(weight, plan)

    @staticmethod
    def backward(ctx, grad_output):
        return ctx.module._gradient(grad_output, ctx.plan), None, None


class DistributedEmbedding(FullTable, VerticalScheduling, nn.Module):
    """An ``nn.Embedding`` whose table is split by columns across the ranks of ``process_set`` (EmbRace).

    Use it where ``nn.Embedding`` would be; every rank of the process set must call it (forward and
    backward) the same number of times, in the same order, as for any collective. Each rank passes its own
    ids (any shape, any number of tokens, zero included) and gets ``nn.Embedding``'s output for them.

    Args:
        num_embeddings, embedding_dim, padding_idx, scale_grad_by_freq, sparse, _weight, _freeze, device,
            dtype: as ``nn.Embedding``. ``_weight`` is the *full* ``[num_embeddings, embedding_dim]`` table
            (the same on every rank); this rank keeps its columns. Without it the full table is drawn from
            N(0, 1) in row blocks with the default generator (the same table on every rank that seeded the
            same way, whatever the number of ranks) and the padding row is zeroed. ``max_norm`` is not
            supported (it would renormalise rows across shards).
        process_set: the ranks that share the table (``embedding_dim`` must be at least its size).
        op: ``Average`` (default: the shard's gradient is averaged over the ranks, as DistributedOptimizer
            averages dense gradients) or ``Sum`` (use with ``DistributedOptimizer(op=Sum)``).
        name: the name of this table's collectives; every rank must use the same. By default tables are
            numbered in construction order per process set, so build the model the same way on every rank.

    Attributes:
        weight: this rank's shard ``[num_embeddings, columns[1] - columns[0]]``, marked
            ``perseus_model_parallel``.
        columns: ``(start, stop)``, the columns of the full table this rank holds.
        priority_gradient, priority_forward, priority_deferred: the priorities of the gradient rows the next
            forward reads (all rows without :meth:`prefetch`), of the forward's allgather and alltoall, and
            of deferred gradient rows. Defaults ``2_000_000``, ``1_000_000`` and ``-1_000_000``, minus the
            table's position in forward order (0 for the first table a forward used), so the first table's
            traffic goes first; DistributedOptimizer's dense gradients use 0. They must be the same on every
            rank (the negotiation checks).
        last_step_rows: ``(rows sent at once, rows deferred)`` by the latest backward (per rank, coalesced).
    """

    priority_gradient = 2_000_000
    priority_forward = 1_000_000
    priority_deferred = -1_000_000

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[torch.Tensor] = None, _freeze: bool = False,
                 device=None, dtype=None, process_set: ProcessSet = global_process_set, op=Average,
                 name: Optional[str] = None):
        super().__init__()
        if max_norm is not None:
            raise NotImplementedError("perseus.DistributedEmbedding: max_norm is not supported (renormalising a "
                                      "row needs all of its columns, which live on different ranks)")
        if device is not None and torch.device(device).type != "cpu":
            raise NotImplementedError("perseus.DistributedEmbedding: tensors on the GPU need the GPU transport, "
                                      "which is not implemented yet; use the CPU")
        op = ReduceOp(op)
        if op not in (Average, Sum):
            raise ValueError(f"perseus.DistributedEmbedding: op must be Average or Sum, not {op.name}")
        num_embeddings, embedding_dim = int(num_embeddings), int(embedding_dim)
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError("perseus.DistributedEmbedding: num_embeddings and embedding_dim must be positive")
        if padding_idx is not None:
            padding_idx = int(padding_idx)
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError("Padding_idx must be within num_embeddings")
            if padding_idx < 0:
                padding_idx += num_embeddings
        ps_id, size, rank = _c.runtime().process_set_info(process_set)
        if embedding_dim < size:
            raise ValueError(f"perseus.DistributedEmbedding: embedding_dim {embedding_dim} is smaller than the "
                             f"{size} ranks of the process set; every rank needs at least one column")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, None, norm_type
        self.scale_grad_by_freq, self.sparse = bool(scale_grad_by_freq), bool(sparse)
        self.process_set, self.op = process_set, op
        self.name = name if name is not None else _default_name(ps_id)
        self._ps_id, self._size, self._rank = ps_id, size, rank
        self._job_ranks = list(_c.runtime().process_set_ranks(ps_id))
        self._widths = even_counts(embedding_dim, size)
        starts = [sum(self._widths[:k]) for k in range(size)]
        self._bounds = [(s, s + w) for s, w in zip(starts, self._widths)]
        self.columns = self._bounds[rank]
        self._scale = 1.0 / size if op == Average else 1.0
        self._order: Optional[int] = None
        self._next: Optional[torch.Tensor] = None  # next forward's ids (all ranks), for the next backward
        self._next_set = False
        self._prefetched = None  # (this rank's declared ids, every rank's declared ids), for the next forward
        self._deferred: Optional[_Deferred] = None
        self._unapplied = None  # (rows, weight version) merged into a gradient that no step has applied yet
        self.last_step_rows = (0, 0)
        c0, c1 = self.columns
        if _weight is not None:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"perseus.DistributedEmbedding: _weight has shape {tuple(_weight.shape)}; "
                                 f"expected the full table [{num_embeddings}, {embedding_dim}]")
            shard = _weight.detach()[:, c0:c1].to(dtype=dtype).clone().contiguous()
        else:
            shard = self._init_shard(dtype)
        self.weight = nn.Parameter(shard, requires_grad=not _freeze)
        setattr(self.weight, MODEL_PARALLEL_ATTR, True)
        self.register_state_dict_post_hook(mark_state_dict)

    @property
    def perseus_sparse_shard(self) -> bool:
        """True when the shard's gradient is sparse (broadcast_optimizer_state initialises its state so)."""
        return self.sparse

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, embeddings, freeze=True, padding_idx=None, max_norm=None, norm_type=2.0,
                        scale_grad_by_freq=False, sparse=False, **kwargs):
        """Build from a full ``[num_embeddings, embedding_dim]`` table (as ``nn.Embedding.from_pretrained``)."""
        if embeddings.dim() != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, _weight=embeddings,
                   _freeze=freeze, **kwargs)

    def _init_shard(self, dtype):
        L, D = self.num_embeddings, self.embedding_dim
        c0, c1 = self.columns
        dtype = dtype or torch.get_default_dtype()
        shard = torch.empty(L, c1 - c0, dtype=dtype)
        block = max(1, (1 << 20) // D)
        with torch.no_grad():
            for r0 in range(0, L, block):
                r1 = min(L, r0 + block)
                shard[r0:r1] = torch.empty(r1 - r0, D, dtype=dtype).normal_()[:, c0:c1]
            if self.padding_idx is not None:
                shard[self.padding_idx].zero_()
        return shard

    def reset_parameters(self) -> None:
        """Draw the table again (N(0, 1), padding row zeroed), as ``nn.Embedding.reset_parameters``."""
        with torch.no_grad():
            self.weight.copy_(self._init_shard(self.weight.dtype))

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, columns={self.columns}, ranks={self._size}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.sparse:
            s += ", sparse=True"
        return s

    # -- collectives ---------------------------------------------------------------------------------------
    def _what(self) -> str:
        return f"perseus.DistributedEmbedding({self.name!r})"

    def _allgather(self, t: torch.Tensor, kind: str, priority: int):
        holder: list = []
        h = _c.allgather_async(_np(t), _alloc_like(t, holder), f"{self.name}.{kind}", self.process_set,
                               int(priority), dtype=_dtype(t),
                               finish=lambda r: (holder[0], [int(x) for x in r[0].received_splits]))
        return synchronize(h)

    def _alltoall_async(self, flat: torch.Tensor, splits, kind: str, priority: int):
        holder: list = []
        return _c.alltoall_async(_np(flat), splits, _alloc_like(flat, holder), f"{self.name}.{kind}",
                                 self.process_set, int(priority), dtype=_dtype(flat),
                                 finish=lambda r: holder[0])

    def _priorities(self):
        order = self._order or 0
        return (self.priority_gradient - order, self.priority_forward - order, self.priority_deferred - order)

    def _check_ids(self, all_ids, counts, what):
        if all_ids.numel() == 0:
            return
        bad = (all_ids < 0) | (all_ids >= self.num_embeddings)
        if bool(bad.any()):
            owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
            ranks = sorted({self._job_ranks[i] for i in owner[bad].tolist()})
            raise IndexError(f"{self._what()}: {what}: token id {int(all_ids[bad][0])} on rank(s) {ranks} is out "
                             f"of range for num_embeddings={self.num_embeddings} (ids must be in "
                             f"[0, {self.num_embeddings})); every rank of the process set raises this error")

    def _gather_ids(self, ids: torch.Tensor, kind: str, priority: int):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{self._what()}: expected a tensor of token ids, got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{self._what()}: token ids must be an integer tensor (got {ids.dtype})")
        flat = ids.detach().reshape(-1).to(torch.int64).contiguous()
        pre, self._prefetched = self._prefetched, None
        if pre is None:
            return self._allgather(flat, kind, priority)
        # prefetch() gathered the ids already (on every rank, so every rank takes this path): a rank whose ids
        # are those it declared sends only a flag, the others send their ids after a flag 0.
        local, segments = pre
        reuse = local.shape == flat.shape and torch.equal(local, flat)
        flag = torch.ones(1, dtype=torch.int64) if reuse else torch.zeros(1, dtype=torch.int64)
        message = flag if reuse else torch.cat([flag, flat])
        gathered, counts = self._allgather(message, kind, priority)
        parts, start = [], 0
        for j, c in enumerate(counts):
            parts.append(segments[j] if int(gathered[start]) == 1 else gathered[start + 1:start + c])
            start += c
        return torch.cat(parts), [p.numel() for p in parts]

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._order is None:
            self._order = _next_forward_order(self._ps_id)
        if self._size == 1:
            self._check_ids(input.reshape(-1).to(torch.int64), [input.numel()], "forward")
            return F.embedding(input, self.weight, self.padding_idx, None, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        _, p_forward, _ = self._priorities()
        all_ids, counts = self._gather_ids(input, "ids", p_forward)
        self._check_ids(all_ids, counts, "forward")
        self._check_fresh(all_ids)
        owner = torch.repeat_interleave(torch.arange(self._size, dtype=torch.int64),
                                        torch.tensor(counts, dtype=torch.int64))
        keys, inverse = torch.unique(owner * self.num_embeddings + all_ids, sorted=True, return_inverse=True)
        uniq = keys % self.num_embeddings
        ucounts = torch.bincount(keys // self.num_embeddings, minlength=self._size).tolist()
        me = self._rank
        start = sum(counts[:me])
        plan = _Plan(all_ids, uniq, ucounts, None, tuple(input.shape))
        plan.inverse = inverse[start:start + counts[me]] - plan.uoffsets[me]
        out = _Lookup.apply(self.weight, self, plan)
        return out.view(*input.shape, self.embedding_dim)

    def _lookup(self, weight, plan: _Plan) -> torch.Tensor:
        w = weight.shape[1]
        values = weight.index_select(0, plan.uniq).reshape(-1)
        splits = [u * w for u in plan.ucounts]
        _, p_forward, _ = self._priorities()
        received = synchronize(self._alltoall_async(values, splits, "lookup", p_forward))
        mine = plan.ucounts[self._rank]
        parts = received.split([mine * wk for wk in self._widths])
        rows = torch.cat([p.view(mine, wk) for p, wk in zip(parts, self._widths)], dim=1)
        return rows.index_select(0, plan.inverse)

    # -- backward ------------------------------------------------------------------------------------------
    def _send_rows(self, coalesced, plan: _Plan, mask, kind, priority):
        """Start the alltoall of the coalesced gradient rows selected by ``mask`` (over every rank's unique
        ids); return ``(handle, rows this rank will receive values for)``."""
        me = self._rank
        sel = coalesced[mask[plan.uoffsets[me]:plan.uoffsets[me + 1]]]
        m = sel.shape[0]
        send = torch.cat([sel[:, c0:c1].reshape(-1) for c0, c1 in self._bounds])
        handle = self._alltoall_async(send, [m * w for w in self._widths], kind, priority)
        return handle, plan.uniq[mask]

    def _gradient(self, grad_output, plan: _Plan):
        p_grad, _, p_deferred = self._priorities()
        me, D = self._rank, self.embedding_dim
        g = grad_output.reshape(-1, D)
        mine = plan.ucounts[me]
        coalesced = g.new_zeros(mine, D).index_add_(0, plan.inverse, g)
        if self.scale_grad_by_freq and mine:
            freq = torch.bincount(plan.inverse, minlength=mine).to(g.dtype)
            coalesced /= freq.unsqueeze(1)
        keep = torch.ones(plan.uniq.shape[0], dtype=torch.bool) if self.padding_idx is None \
            else plan.uniq != self.padding_idx
        next_ids, self._next, self._next_set = self._next, None, False
        if next_ids is None:
            now, later = keep, None
        else:
            hit = torch.isin(plan.uniq, next_ids)
            now, later = keep & hit, keep & ~hit
            if not bool(later.any()):
                later = None
        w = self.weight.shape[1]
        rows_list, values_list = [], []
        current = self._send_rows(coalesced, plan, now, "grad", p_grad) if bool(now.any()) else None
        # The rows the previous backward deferred: they join this gradient (waited for before this
        # backward's deferred rows are sent under the same name).
        previous, self._deferred = self._deferred, None
        if previous is not None:
            rows_list.append(previous.rows)
            values_list.append(synchronize(previous.handle).view(-1, w))
        if later is not None:
            handle, rows = self._send_rows(coalesced, plan, later, "grad_deferred", p_deferred)
            self._deferred = _Deferred(handle, rows)
        if current is not None:
            rows_list.append(current[1])
            values_list.append(synchronize(current[0]).view(-1, w))
        sends = lambda mask: int(mask[plan.uoffsets[me]:plan.uoffsets[me + 1]].sum())  # noqa: E731
        self.last_step_rows = (sends(now), 0 if later is None else sends(later))
        if previous is not None:
            self._unapplied = (previous.rows, self.weight._version)
        return self._shard_gradient(rows_list, values_list, g.dtype)

    def _shard_gradient(self, rows_list, values_list, dtype):
        L, w = self.num_embeddings, self.weight.shape[1]
        if rows_list:
            rows, values = torch.cat(rows_list), torch.cat(values_list)
        else:
            rows, values = torch.zeros(0, dtype=torch.int64), torch.zeros(0, w, dtype=dtype)
        if self._scale != 1.0:
            values = values * self._scale
        if self.sparse:
            return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (L, w), check_invariants=False).coalesce()
        return values.new_zeros(L, w).index_add_(0, rows, values)


_order_lock = threading.Lock()
_orders: dict = {}


def _next_forward_order(ps_id: int) -> int:
    with _order_lock:
        n = _orders.get(ps_id, 0)
        _orders[ps_id] = n + 1
    return n


def _reset_orders() -> None:
    with _order_lock:
        _orders.clear()


_c.runtime().register_job_state(_reset_orders)
