"""PyTorch allgather, broadcast, alltoall, reducescatter, join and barrier (re-exported by mpi_ops)."""

from __future__ import annotations

import numpy as np
import torch

from perseus.runtime import collectives as _c
from perseus.lifecycle.api import rank
from perseus.base.partition import even_counts
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Average, ReduceOp, Sum
from perseus.torch import device_collectives as _dc
from perseus.torch import staging as _staging
from perseus.torch._allreduce_ops import allreduce, grouped_allreduce
from perseus.torch._tensors import _alloc_like, _contig, _dtype, _np, _tensor_list, synchronize
from perseus.torch.compression import Compression

__all__ = [
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier",
]


# -- allgather ----------------------------------------------------------------------------------------------
def _adoptable(t: torch.Tensor) -> bool:
    """Whether the engine's result array can become the tensor as it is (NumPy has the dtype)."""
    return t.dtype != torch.bfloat16


def _adopt(result) -> torch.Tensor:
    """The engine-allocated result as a tensor, sharing its memory (the array owns it)."""
    return torch.from_numpy(result.output)


def _source(tensor: torch.Tensor):
    """``(host tensor the engine reads, back)``: a staged copy when ``tensor`` is staged (then ``back(out)``
    moves a host result to ``tensor``'s device), else ``tensor`` made contiguous (then ``back`` returns its
    argument)."""
    if _staging.wanted(tensor):
        return _staging.to_host(tensor), (lambda out: _staging.to_device(out, tensor))
    return _contig(tensor), (lambda out: out)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start an allgather (concatenation on the first dimension); return a handle."""
    dt = _dtype(tensor)
    if _dc.takes([tensor], _dc.ALLGATHER):
        return _dc.submit(_dc.ALLGATHER, [tensor], name, process_set)
    src, back = _source(tensor)
    if _adoptable(src):
        return _c.allgather_async(_np(src), None, name, process_set, dtype=dt,
                                  finish=lambda r: back(_adopt(r[0])))
    holder: list = []
    return _c.allgather_async(_np(src), _alloc_like(src, holder), name, process_set, dtype=dt,
                              finish=lambda r: back(holder[0]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        _dtype(tensor)  # a clear TypeError for a non-tensor, before its shape is read
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        grad = allreduce(grad_output, op=Average, process_set=ps)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64), process_set=ps)
        offset = int(dims[: ps.rank()].sum()) if ps.rank() else 0
        return grad.narrow(0, offset, ctx.dim), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate ``tensor`` from every rank along the first dimension (which may differ). Differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start allgathers of a list of tensors, negotiated together; return one handle."""
    tensors = _tensor_list(tensors, "grouped_allgather")
    dts = [_dtype(t) for t in tensors]
    if _dc.takes(tensors, _dc.ALLGATHER):
        return _dc.submit(_dc.ALLGATHER, tensors, name, process_set, single=False)
    srcs, backs = zip(*[_source(t) for t in tensors]) if tensors else ((), ())
    holders = [[] for _ in srcs]
    allocs = [None if _adoptable(t) else _alloc_like(t, h) for t, h in zip(srcs, holders)]

    def finish(results):
        return [back(_adopt(res) if alloc is None else h[0])
                for res, alloc, h, back in zip(results, allocs, holders, backs)]
    return _c.grouped_allgather_async([_np(t) for t in srcs], allocs, name, process_set, dtypes=dts,
                                      finish=finish)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        for t in tensors:
            _dtype(t)  # a clear TypeError for a non-tensor, before its shape is read
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ps)
        dims = allgather(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ps)
        offsets = dims[: ps.rank()].sum(0) if ps.rank() else torch.zeros(len(ctx.dims), dtype=torch.int64)
        out = [g.narrow(0, int(o), d) for g, o, d in zip(reduced, offsets.tolist(), ctx.dims)]
        return (None, None) + tuple(out)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor of ``tensors``, negotiated together. Differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *_tensor_list(tensors, "grouped_allgather")))


# -- broadcast ----------------------------------------------------------------------------------------------
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start a broadcast from ``root_rank`` into a new tensor; return a handle."""
    dt = _dtype(tensor)
    if _dc.takes([tensor], _dc.BROADCAST):
        return _dc.submit(_dc.BROADCAST, [tensor], name, process_set, root_rank=root_rank,
                          outputs=[torch.empty_like(tensor, memory_format=torch.contiguous_format)])
    src, back = _source(tensor)
    if _staging.wanted(tensor):  # broadcast in place on the host copy
        return _c.broadcast_async(_np(src), _np(src), root_rank, name, process_set, dtype=dt,
                                  finish=lambda r: back(src))
    out = torch.empty_like(src)
    return _c.broadcast_async(_np(src), _np(out), root_rank, name, process_set, dtype=dt, finish=lambda r: out)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start an in-place broadcast from ``root_rank``; return a handle."""
    dt = _dtype(tensor)
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    if _dc.takes([tensor], _dc.BROADCAST):
        return _dc.submit(_dc.BROADCAST, [tensor], name, process_set, root_rank=root_rank, outputs=[tensor],
                          finish=lambda entries: tensor)
    if _staging.wanted(tensor):  # on a host copy, copied back into tensor at synchronize
        host = _staging.to_host(tensor)
        buf = _np(host)
        return _c.broadcast_async(buf, buf, root_rank, name, process_set, dtype=dt,
                                  finish=lambda r: _staging.copy_back(tensor, host))
    buf = _np(tensor)
    return _c.broadcast_async(buf, buf, root_rank, name, process_set, dtype=dt, finish=lambda r: tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast ``tensor`` in place from ``root_rank`` and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``tensor`` as held by ``root_rank``. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall -----------------------------------------------------------------------------------------------
def _received_splits(splits) -> torch.Tensor:
    """The rows received from each rank as Horovod gives them (int32), or int64 where one rank sent more
    than 2^31 - 1 rows (int32 would wrap around)."""
    return torch.from_numpy(splits.astype("int32" if int(splits.max(initial=0)) < 2**31 else "int64"))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)`` (int32, or int64 where a count
    is above 2^31 - 1)."""
    dt = _dtype(tensor)
    if splits is not None:
        if isinstance(splits, torch.Tensor):
            splits = splits.detach().cpu().numpy()
    if _dc.takes([tensor], _dc.ALLTOALL):
        return _dc.submit(_dc.ALLTOALL, [tensor], name, process_set, splits=splits,
                          finish=lambda entries: (entries[0].output,
                                                  _received_splits(np.asarray(entries[0].received, np.int64))))
    src, back = _source(tensor)
    holder: list = []

    def finish(results):
        return back(holder[0]), _received_splits(results[0].received_splits)
    return _c.alltoall_async(_np(src), splits, _alloc_like(src, holder), name, process_set, dtype=dt,
                             finish=finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send rows ``splits[i]`` of ``tensor`` to rank i; return the received rows (and the received splits
    when ``splits`` is given). Differentiable."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter ------------------------------------------------------------------------------------------
def _share(tensor, process_set) -> torch.Tensor:
    """This rank's reducescatter result for ``tensor``: its share of the first dimension (earlier ranks one
    more row where it does not divide), on ``tensor``'s device."""
    rows = even_counts(tensor.shape[0], process_set.size())[process_set.rank()]
    return torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start a reducescatter; return a handle."""
    dt = _dtype(tensor)
    if _dc.takes([tensor], _dc.REDUCESCATTER, int(op), prescale_factor, postscale_factor):
        return _dc.submit(_dc.REDUCESCATTER, [tensor], name, process_set, reduce_op=int(op),
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          outputs=[_share(tensor, process_set)])
    src, back = _source(tensor)
    holder: list = []
    return _c.reducescatter_async(_np(src), _alloc_like(src, holder), name, op, process_set, prescale_factor,
                                  postscale_factor, dtype=dt, finish=lambda r: back(holder[0]))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        op, ps, pre, post = ctx.args
        grad = grad_output
        if ReduceOp(op) == Sum:
            grad = grad * ps.size()
        grad = grad * (pre * post) if pre * post != 1.0 else grad
        return allgather(grad, process_set=ps), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and return this rank's share of the first dimension (earlier ranks
    get one extra row when it does not divide evenly). Differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start reducescatters of a list of tensors, negotiated together; return one handle."""
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    dts = [_dtype(t) for t in tensors]
    if _dc.takes(tensors, _dc.REDUCESCATTER, int(op), prescale_factor, postscale_factor):
        return _dc.submit(_dc.REDUCESCATTER, tensors, name, process_set, reduce_op=int(op),
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          outputs=[_share(t, process_set) for t in tensors], single=False)
    srcs, backs = zip(*[_source(t) for t in tensors]) if tensors else ((), ())
    holders = [[] for _ in srcs]
    return _c.grouped_reducescatter_async([_np(t) for t in srcs], [_alloc_like(t, h) for t, h in
                                                                   zip(srcs, holders)],
                                          name, op, process_set, prescale_factor, postscale_factor, dtypes=dts,
                                          finish=lambda r: [back(h[0]) for h, back in zip(holders, backs)])


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        op, ps, pre, post = ctx.args
        factor = (ps.size() if ReduceOp(op) == Sum else 1) * pre * post
        grads = [g * factor if factor != 1 else g for g in grads]
        return (None,) * 5 + tuple(grouped_allgather(grads, process_set=ps))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter each tensor of ``tensors``, negotiated together. Differentiable."""
    pairs = [compression.compress(t) for t in _tensor_list(tensors, "grouped_reducescatter")]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# -- join / barrier -----------------------------------------------------------------------------------------
def join(device=-1):
    """Wait until every rank has joined; until then this rank contributes zeros to the others' allreduces.

    Returns the rank that joined last. ``device`` is accepted for Horovod compatibility (CPU only).
    """
    _staging.drain()  # staged all-reduces still waiting for their copies reach the engine first
    return _c.join()


def barrier(process_set=global_process_set):
    """Block until every rank of ``process_set`` reaches the barrier."""
    _c.barrier(process_set)
