"""PyTorch allreduce (single, grouped, sparse, through a communicating compressor), re-exported by mpi_ops.

CPU tensors go straight to the engine; device tensors (and CPU tensors when the job's settings ask for it)
take a detour through the GPU launcher or host staging (:func:`_detour`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from perseus import sparse as _sparse
from perseus.runtime import collectives as _c
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import resolve_op
from perseus.compression import Pending, Reducer
from perseus.torch import device as _device
from perseus.torch import staging as _staging
from perseus.torch._tensors import _contig, _dtype, _np, _runtime, _tensor_list, synchronize
from perseus.torch.compression import Compression

__all__ = [
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
]


def _op(op, average, name="allreduce"):
    return resolve_op(op, average)


def _reduce_compressed(compression, name, tensors, outputs, op, prescale_factor, postscale_factor,
                       process_set, local=None):
    """Start a communicating compressor's reduction of ``tensors`` into ``outputs`` (same shapes; may be the
    same tensors); return its :class:`perseus.compression.Pending`, whose ``wait()`` returns ``outputs``.

    Device tensors (and CPU tensors under ``PERSEUS_STAGE_CPU_TENSORS=1``) are staged: the compressor works
    on host copies, and ``wait()`` copies the results back to ``outputs``. ``local``: the compressor's local
    step (momentum correction, local clipping; None for none).
    """
    extra = {} if local is None else {"local": local}
    if not any(_staging.wanted(t) for t in tensors):
        pending = compression.reduce_async(name, [_np(t) for t in tensors], [_np(o) for o in outputs], op,
                                           prescale_factor, postscale_factor, process_set, **extra)
        return Pending(lambda: (pending.wait(), outputs)[1])
    hosts = [_staging.to_host(t) for t in tensors]
    bufs = [_np(h) for h in hosts]
    pending = compression.reduce_async(name, bufs, bufs, op, prescale_factor, postscale_factor, process_set,
                                       **extra)

    def finish():
        pending.wait()
        return [_staging.copy_back(o, h) for o, h in zip(outputs, hosts)]
    return Pending(finish)


# -- allreduce ----------------------------------------------------------------------------------------------
#: True once this job's settings say CPU tensors go straight to the engine (neither PERSEUS_STAGE_CPU_TENSORS
#: nor PERSEUS_DEVICE_BACKEND=gloo): the per-gradient path tests it before anything else. None until known.
_plain_cpu: Optional[bool] = None


def _forget_plain_cpu() -> None:
    global _plain_cpu
    _plain_cpu = None


_runtime.register_job_state(_forget_plain_cpu)
_device._path_listeners.append(_forget_plain_cpu)  # the GPU path switched (the autotuner's choice)


def _detour(tensors, in_place, dts, name, op, prescale_factor, postscale_factor, process_set, single):
    """The handle of an allreduce of ``tensors`` (one request when ``single``, else a group) that does not go
    straight to the engine: through the GPU launcher (NCCL, or Gloo for tests) or host staging; None when
    it does go straight (CPU tensors). synchronize returns the tensor (single) or the list."""
    global _plain_cpu
    if _plain_cpu is None:
        _plain_cpu = not (_staging.stage_cpu() or _device.routes_cpu())
    if (not tensors[0].is_cpu or _device.routes_cpu()) and _device.takes(tensors, op, prescale_factor,
                                                                         postscale_factor):
        srcs = list(tensors) if in_place else [_contig(t) for t in tensors]
        outs = srcs if in_place else [torch.empty_like(t) for t in srcs]
        return _device.allreduce_async(srcs, outs, dts, name, op, prescale_factor, postscale_factor, process_set,
                                       (outs[0] if single else outs,), single)
    if not any(_staging.wanted(t) for t in tensors):
        return None
    # Reduced in place on host copies; copied back into the tensors (in place) or new tensors at synchronize.
    # The copies out are queued: the request reaches the engine from the stager thread once they are done, and
    # this thread (a backward hook's) goes on at once (perseus.torch.staging.defer).
    staged = [_staging.to_host_queued(t) for t in tensors]
    hosts = [h for h, _ in staged]
    if in_place:
        def back(_results):
            return [_staging.copy_back(t, h) for t, h in zip(tensors, hosts)]
    else:
        def back(_results):
            return [_staging.to_device(h, t) for h, t in zip(hosts, tensors)]
    if name is None:  # (an unnamed call's generated name follows the call order, not the stager's)
        name = _c.unnamed("allreduce", process_set)
    if single:
        ptr = hosts[0].data_ptr()
        return _staging.defer([c for _, c in staged], lambda: _c.allreduce_async(
            ptr, ptr, name, op, prescale_factor, postscale_factor, process_set, 0, dts[0], lambda r: back(r)[0],
            hosts[0].shape, hosts[0]))
    bufs = [_np(h) for h in hosts]
    return _staging.defer([c for _, c in staged], lambda: _c.grouped_allreduce_async(
        bufs, bufs, name, op, prescale_factor, postscale_factor, process_set, dtypes=dts, finish=back))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start an allreduce of ``tensor`` into a new tensor; return a handle for :func:`synchronize`."""
    dt = _dtype(tensor)
    op = _op(op, average)
    if not (tensor.is_cpu and _plain_cpu):
        handle = _detour([tensor], False, [dt], name, op, prescale_factor, postscale_factor, process_set, True)
        if handle is not None:
            return handle
    src = _contig(tensor)
    out = torch.empty_like(src)
    return _c.allreduce_async(src.data_ptr(), out.data_ptr(), name, op, prescale_factor,
                              postscale_factor, process_set, 0, dt, (out,), src.shape, (src, out))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start an in-place allreduce of ``tensor``; return a handle."""
    dt = _dtype(tensor)
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    op = _op(op, average)
    if not (tensor.is_cpu and _plain_cpu):
        handle = _detour([tensor], True, [dt], name, op, prescale_factor, postscale_factor, process_set, True)
        if handle is not None:
            return handle
    ptr = tensor.data_ptr()
    # (tensor,): synchronize returns the tensor itself, without a Python call.
    return _c.allreduce_async(ptr, ptr, name, op, prescale_factor, postscale_factor, process_set,
                              0, dt, (tensor,), tensor.shape, tensor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Allreduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad_output):
        average, op, pre, post, ps = ctx.args
        return (allreduce(grad_output, average=average, op=op, prescale_factor=pre, postscale_factor=post,
                          process_set=ps), None, None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Return the reduction of ``tensor`` over all ranks (default Average). Differentiable.

    Collective: every rank of ``process_set`` calls it with the same name, shape, dtype and op.

    With a communicating compressor (``Compression.topk(0.01)`` ...), the result is that compressor's
    estimate of the reduction (not differentiable); it needs ``name=`` to keep its residual per tensor.
    """
    if isinstance(compression, Reducer):
        _dtype(tensor)
        src = _contig(tensor.detach())
        out = torch.empty_like(src)
        return _reduce_compressed(compression, name, [src], [out], _op(op, average), prescale_factor,
                                  postscale_factor, process_set).wait()[0]
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start allreduces of a list of tensors, negotiated together; return one handle."""
    tensors = _tensor_list(tensors, "grouped_allreduce")
    dts = [_dtype(t) for t in tensors]
    op = _op(op, average)
    if tensors and not (_plain_cpu and all(t.is_cpu for t in tensors)):
        handle = _detour(tensors, False, dts, name, op, prescale_factor, postscale_factor, process_set, False)
        if handle is not None:
            return handle
    srcs = [_contig(t) for t in tensors]
    outs = [torch.empty_like(t) for t in srcs]
    return _c.grouped_allreduce_async([_np(t) for t in srcs], [_np(o) for o in outs], name, op,
                                      prescale_factor, postscale_factor, process_set, dtypes=dts,
                                      finish=lambda r: outs)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Start in-place allreduces of a list of tensors, negotiated together; return one handle."""
    tensors = _tensor_list(tensors, "grouped_allreduce_")
    dts = [_dtype(t) for t in tensors]
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("Tensor is required to be contiguous.")
    op = _op(op, average)
    if tensors and not (_plain_cpu and all(t.is_cpu for t in tensors)):
        handle = _detour(tensors, True, dts, name, op, prescale_factor, postscale_factor, process_set, False)
        if handle is not None:
            return handle
    bufs = [_np(t) for t in tensors]
    return _c.grouped_allreduce_async(bufs, bufs, name, op, prescale_factor, postscale_factor,
                                      process_set, dtypes=dts, finish=lambda r: list(tensors))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Allreduce each tensor of ``tensors`` in place, negotiated together; return the list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, pre, post, ps = ctx.args
        out = grouped_allreduce(list(grads), average=average, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=ps)
        return (None,) * 6 + tuple(out)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Return the allreduce of each tensor in ``tensors``, negotiated and fused together. Differentiable."""
    pairs = [compression.compress(t) for t in _tensor_list(tensors, "grouped_allreduce")]
    outs = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set, algorithm=None):
    """Start an allreduce of a sparse COO tensor; return a callable that waits and returns the reduced
    sparse tensor (of the input's size, dtype and sparse dimensions), as Horovod does.

    The tensor is row-sparse over its sparse dimensions (an embedding gradient: ids x embedding width).
    ``algorithm`` (a perseus addition) picks how: 'zen' (hash-partitioned push, sum at the owner, hash-bitmap
    pull), 'allgather' (Horovod's path: every rank gathers every rank's indices and values; the result is
    not coalesced and, for Average, the gathered values are divided by the set size), 'dense' (densify and
    all-reduce), 'alltoall' (column partition), or 'auto' (the cheapest by a cost model fed with measured
    densities, overlap and link; docs/sparse.md). None reads PERSEUS_SPARSE_ALGORITHM (default 'auto').
    Except allgather, the result is coalesced: sorted unique indices, each the sum (or average) over the
    ranks that had it. The callable has the :class:`perseus.sparse.SparseHandle` as ``.handle``.

    Collective: every rank of ``process_set`` calls it with the same name, dense size, dtype, op and
    algorithm (any number of non-zeros, none included).

    Raises:
        ValueError: not a sparse tensor, op other than Sum/Average, unknown algorithm.
        MismatchError (a HorovodInternalError), from the callable on every rank: the ranks disagree about
            the tensor (dense size, dtype, op or algorithm).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError("perseus.sparse_allreduce_async: expected a sparse COO tensor")
    device = tensor.device
    t = tensor.detach().coalesce()
    if device.type != "cpu":  # staged: indices and values to the host, the result back to the device
        t = t.cpu()
    size = tuple(t.shape)
    sdim = t.sparse_dim()
    sparse_sizes, row_shape = size[:sdim], size[sdim:]
    idx = t.indices().numpy()
    num_rows = int(np.prod(sparse_sizes, dtype=np.int64))
    rows = idx[0] if sdim == 1 else np.ravel_multi_index(tuple(idx), sparse_sizes)
    values = t.values()
    wide = values.dtype is torch.bfloat16
    if wide:
        values = values.float()
    vals = values.contiguous().numpy()
    handle = _sparse.sparse_allreduce_async(rows, vals, num_rows, name, resolve_op(op), process_set, algorithm,
                                            coalesced=True)

    def finish():
        res = handle.wait()
        k = int(res.rows.size)
        if sdim == 1:
            indices = torch.from_numpy(res.rows).reshape(1, k)
        else:
            indices = torch.from_numpy(np.stack(np.unravel_index(res.rows, sparse_sizes)).astype(np.int64))
        out = torch.from_numpy(res.values).reshape((k,) + tuple(row_shape))
        if wide:
            out = out.to(torch.bfloat16)
        result = torch.sparse_coo_tensor(indices, out, size=size, is_coalesced=bool(res.coalesced))
        return result if device.type == "cpu" else result.to(device)
    finish.handle = handle
    return finish

