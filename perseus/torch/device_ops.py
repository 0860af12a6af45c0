"""The launcher's side of broadcast, allgather, alltoall and reducescatter on device tensors (one request a unit).

:mod:`perseus.torch.device`'s launcher thread calls :func:`launch` for every unit that is not an all-reduce,
inside the stream context of the unit's process group; requests are submitted by
:mod:`perseus.torch.device_collectives`, which says what each collective does. ``entry`` is that module's
``OpEntry``: the request's tensors and arguments.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from perseus.base.partition import even_counts
from perseus.engine.messages import OpType

__all__ = ["ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER", "launch"]

ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER = (int(OpType.ALLGATHER), int(OpType.BROADCAST),
                                                 int(OpType.ALLTOALL), int(OpType.REDUCESCATTER))


def launch(group, op_type: int, entry, reduce_op: int, prescale: float, postscale: float, size: int,
           rank: int, options):
    """Start the unit's collective on ``group`` (inside the launcher's stream context) and return ``(work,
    finish)``: ``finish()`` runs after ``work`` (on the same stream for CUDA) and completes the result.
    ``options`` maps a perseus reduce-op code to the backend's all-reduce options (its reduceOp is used)."""
    inp = entry.input
    if op_type == BROADCAST:
        out = entry.output
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = entry.root, 0
        return group.broadcast([out], opts), _nothing
    rest = tuple(inp.shape[1:])
    rows = inp.reshape(inp.shape[0] if inp.dim() else 1, math.prod(rest))
    if op_type == ALLGATHER:
        return _allgather(group, entry, rows, rest, size)
    if op_type == ALLTOALL:
        return _alltoall(group, entry, rows, rest, size)
    if op_type == REDUCESCATTER:
        return _reducescatter(group, entry, rows, reduce_op, prescale, postscale, size, rank, options)
    raise NotImplementedError(f"perseus: the device launcher does not run op type {op_type}")


def _nothing():
    pass


def _own(entry, t: torch.Tensor) -> torch.Tensor:
    """A result made on the launcher's stream, marked as used by the caller's (CUDA), so that its memory is not
    reused before the caller's work on it is done."""
    if entry.stream is not None:
        t.record_stream(entry.stream)
    return t


def _exchange_allgather(group, value: int, size: int, device) -> list:
    """Every rank's ``value`` (a blocking tiny allgather; a host value is needed to size the result)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = torch.empty(size, dtype=torch.int64, device=device)
    group._allgather_base(every, mine).wait()
    return every.tolist()


def _allgather(group, entry, rows, rest, size):
    counts = _exchange_allgather(group, rows.shape[0], size, rows.device)
    width = rows.shape[1]
    out = entry.output
    if out is None or tuple(out.shape) != (sum(counts),) + rest:
        out = _own(entry, torch.empty((sum(counts),) + rest, dtype=rows.dtype, device=rows.device))
    entry.output = out
    top = max(counts)
    if all(c == top for c in counts):
        return group._allgather_base(out.view(-1), rows.reshape(-1)), _nothing
    padded = torch.zeros(top * width, dtype=rows.dtype, device=rows.device)
    padded[:rows.numel()].copy_(rows.reshape(-1))
    gathered = torch.empty(size * top * width, dtype=rows.dtype, device=rows.device)
    work = group._allgather_base(gathered, padded)

    def finish():
        parts = gathered.view(size, top * width)
        torch.cat([parts[i, :c * width] for i, c in enumerate(counts)], out=out.view(-1))
    return work, finish


def _alltoall(group, entry, rows, rest, size):
    device = rows.device
    sent = torch.tensor(entry.splits.tolist(), dtype=torch.int64, device=device)
    received = torch.empty(size, dtype=torch.int64, device=device)
    ones = [1] * size
    group.alltoall_base(received, sent, ones, ones, dist.AllToAllOptions()).wait()
    counts = received.tolist()
    entry.received = counts
    out = _own(entry, torch.empty((sum(counts),) + rest, dtype=rows.dtype, device=device))
    entry.output = out
    return group.alltoall_base(out.view(out.shape[0], rows.shape[1]), rows, counts, entry.splits.tolist(),
                               dist.AllToAllOptions()), _nothing


def _reducescatter(group, entry, rows, reduce_op, prescale, postscale, size, rank, options):
    counts = even_counts(rows.shape[0], size)
    width = rows.shape[1]
    top = int(counts[0])  # even_counts gives earlier ranks the extra rows
    out = entry.output
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = options[reduce_op].reduceOp
    if all(int(c) == top for c in counts) and prescale == 1.0:
        source = rows.reshape(-1)
    else:
        source = torch.zeros(size * top * width, dtype=rows.dtype, device=rows.device)
        start = 0
        view = source.view(size, top * width)
        for i, c in enumerate(counts):
            c = int(c)
            view[i, :c * width].copy_(rows[start:start + c].reshape(-1))
            start += c
        if prescale != 1.0:
            source.mul_(prescale)
    mine = int(counts[rank]) * width
    short = mine != top * width  # this rank keeps fewer rows than a chunk: reduce into a scratch chunk
    target = torch.empty(top * width, dtype=rows.dtype, device=rows.device) if short else out.view(-1)
    work = group._reduce_scatter_base(target, source, opts)

    def finish():
        if short:
            out.view(-1).copy_(target[:mine])
        if postscale != 1.0:
            out.mul_(postscale)
    return work, finish
