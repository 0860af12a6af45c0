"""Broadcast, allgather, alltoall and reducescatter of device tensors through the launcher (NCCL on a GPU).

:mod:`perseus.torch.device` moves all-reduces; this module gives the launcher the other collectives, so a GPU
tensor handed to any of them never passes through host memory. The engine negotiates these requests like any
other (names, shapes, roots and ops are checked on every rank) and hands each one to the launcher as a unit of
its own, in the negotiated order; the launcher runs it on the set's process group with the backend's own
collective:

- broadcast: ``broadcast`` from the root's index in the set, in place on the output.
- allgather: the first dimensions are exchanged first (a tiny allgather); equal ones gather straight into the
  result, uneven ones gather rows padded to the largest and are compacted into the result.
- alltoall: the row counts are exchanged first (a tiny alltoall); then one ``alltoall_base`` with the sent and
  received splits. The received splits are part of the result.
- reducescatter: rank r keeps ``even_counts(rows, size)[r]`` rows (earlier ranks one more where the rows do not
  divide): one ``reduce_scatter`` of equal chunks, padded where the counts differ; prescale on the copy it
  reads, postscale on the result, Average as Sum with a postscale of 1/size.

Which requests take this path (:func:`takes`): CUDA tensors when the device backend uses NCCL, CPU tensors when
``PERSEUS_DEVICE_BACKEND=gloo``; dtypes the backends move (floats, 8/32/64-bit integers; bool for the ops that
do not reduce); reducescatter under the all-reduce's rules (integers unscaled, no integer Average). The rest is
staged through host memory as before. While a rank has joined only all-reduces run (the engine rejects the
others), so these units never hold a joined rank's stand-in.
"""

from __future__ import annotations

import torch

from perseus.runtime import collectives as _c
from perseus.runtime.process_sets import global_process_set
from perseus.runtime.state import runtime
from perseus.engine.messages import Request
from perseus.torch import device as _device
from perseus.torch._tensors import _dtype
from perseus.torch.device_ops import ALLGATHER, ALLTOALL, BROADCAST, REDUCESCATTER

__all__ = ["takes", "submit", "OpEntry", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"]
_MOVED = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int32,
          torch.int64, torch.bool}
_PREFIX = {ALLGATHER: "allgather", BROADCAST: "broadcast", ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter"}


def takes(tensors, op_type: int, reduce_op: int = 1, prescale_factor: float = 1.0,
          postscale_factor: float = 1.0) -> bool:
    """True when a collective ``op_type`` of ``tensors`` goes through the launcher (see the module docstring).

    Raises:
        ValueError: ``PERSEUS_DEVICE_BACKEND=nccl`` and this torch has no NCCL.
    """
    if not tensors:
        return False
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or not (first.is_cuda or first.is_cpu):
        return False
    if op_type == REDUCESCATTER:
        return all(t.dim() > 0 for t in tensors) and _device.takes(tensors, reduce_op, prescale_factor,
                                                                    postscale_factor)
    if first.is_cuda:
        if not _device._use_nccl():
            return False
    elif not _device.routes_cpu():
        return False
    return all(t.device == first.device and t.dtype in _MOVED for t in tensors)


class OpEntry:
    """One request's tensors from submission until its unit has run: ``input`` (contiguous), ``output`` (given
    for broadcast and reducescatter; made by the launcher for allgather and alltoall), ``ready`` (the callers'
    stream event), the op's arguments, and ``stream`` (a CUDA caller's stream: a result made on the launcher's
    stream is marked used by it)."""

    __slots__ = ("input", "output", "ready", "numel", "moved", "handle", "done", "root", "splits", "received",
                 "stream")

    def __init__(self, inp, out, ready, root=-1, splits=None, stream=None):
        self.input, self.output, self.ready = inp, out, ready
        self.numel, self.moved, self.handle, self.done = inp.numel(), 0, -1, []
        self.root, self.splits, self.received, self.stream = root, splits, None, stream


# -- submission (caller's thread) --------------------------------------------------------------------------
def submit(op_type: int, tensors, name=None, process_set=global_process_set, *, root_rank: int = -1,
           splits=None, reduce_op: int = 1, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
           outputs=None, single: bool = True, finish=None, priority: int = 0) -> int:
    """Start ``op_type`` on ``tensors`` (one request each, negotiated together) through the launcher and return
    the engine handle; ``synchronize`` returns ``finish(entries)`` (default: the outputs, a list unless
    ``single``). Collective as the host forms in :mod:`perseus.runtime.collectives`.

    ``outputs``: broadcast's and reducescatter's result tensors (broadcast: may be the input itself, in place);
    for allgather, optional: the result goes there when it has the gathered shape. ``priority`` orders requests
    negotiated in one round (higher first), as for host requests.
    ``root_rank`` is the job rank of a broadcast's root; ``splits`` the rows an alltoall sends to each rank.

    Raises:
        ValueError: a bad root, splits or op, a request of the same name in flight, an unknown process set.
    """
    ps_id, size, rank = _c._info(process_set)
    device = tensors[0].device
    launcher = _device._launcher_for(device)
    code = _device._CUDA if device.type == "cuda" else _device._CPU
    base = _c._name(_PREFIX[op_type], name, ps_id)
    names = [base] if single else [f"{base}.{i}" for i in range(len(tensors))]
    root = _c.root_in_set(root_rank, ps_id) if op_type == BROADCAST else -1
    pre, post, op = 1.0, 1.0, int(reduce_op)
    if op_type == REDUCESCATTER:
        pre, post = _c._factors(prescale_factor, postscale_factor, "reducescatter")
    stream = torch.cuda.current_stream(device) if code == _device._CUDA else None
    entries, items = [], []
    for i, (t, n) in enumerate(zip(tensors, names)):
        t = t.detach()
        inp = t if t.is_contiguous() else t.contiguous()
        out = None if outputs is None else outputs[i].detach()
        shape = tuple(inp.shape)
        sent = None
        if op_type in (ALLGATHER, ALLTOALL) and not shape:
            shape = (1,)
        if op_type == ALLTOALL:
            sent = _c.alltoall_splits(splits, shape[0], size)  # (validated as for host tensors)
        entries.append(OpEntry(inp, out, None, root, sent, stream))
        items.append(Request(name=n, dtype=int(_dtype(inp)), shape=shape, input=inp.data_ptr(),
                             output=None if out is None else out.data_ptr(), reduce_op=op, root_rank=root,
                             prescale=pre, postscale=post, priority=int(priority),
                             splits=None if sent is None else sent.tolist()))
    streams = launcher.streams[code]
    ready = streams.ready(tensors[0])  # after the outputs were made on the caller's stream
    for e in entries:
        e.ready = ready

    def done(results):
        if streams.ordered:  # the caller's stream waits for the unit (the result may still be in the making)
            _device.caller_wait(streams, entries)
        values = finish(entries) if finish is not None else [e.output for e in entries]
        return values[0] if single and finish is None else values

    handle = runtime().engine.submit(ps_id, op_type, items, done, entries, int(code))
    launcher.register(ps_id, names, entries, process_set, handle)
    return handle
