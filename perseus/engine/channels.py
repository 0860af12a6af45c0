"""Stage 4: concurrent communication channels.

A channel is a duplicated communicator driven by its own thread. Units are assigned to channels by their
position in the process set's unit sequence (``unit.index % num_channels``), which is the same on every rank,
so each communicator sees the same sequence of collectives everywhere while different channels run at once.
An idle channel thread sleeps on its queue.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Callable

import numpy as np

from perseus.common.partition import even_counts
from perseus.transport.kernels import scale_into
from perseus.engine.fusion import Unit, UnitKind
from perseus.engine.messages import DType, Entry, OpType, numpy_dtype
from perseus.transport.mpi import MpiComm

__all__ = ["Channel", "execute_unit"]

_STOP = object()


class Channel:
    """One communicator plus the thread that runs its units in order."""

    def __init__(self, comm, name: str, on_done: Callable[[Entry], None],
                 on_error: Callable[[Unit, BaseException], None], get_timeline: Callable[[], object],
                 algorithm: str = "auto"):
        self.comm = MpiComm(comm)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._on_done, self._on_error = on_done, on_error
        self._buffer = np.empty(0, np.uint8)
        self._get_timeline = get_timeline
        self.algorithm = algorithm
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, unit: Unit) -> None:
        self._queue.put(unit)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the queued units; return False if the thread is still inside a collective."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            unit = self._queue.get()
            if unit is _STOP:
                return
            try:
                execute_unit(self.comm, unit, self._fusion_buffer, self._get_timeline(), self.algorithm)
            except BaseException as exc:  # noqa: BLE001 - reported to the engine, which fails every rank
                self._on_error(unit, exc)
                continue
            for piece in unit.pieces:
                self._on_done(piece.entry)

    def _fusion_buffer(self, nbytes: int) -> np.ndarray:
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, np.uint8)
        return self._buffer


def _flat(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1)


def execute_unit(comm: MpiComm, unit: Unit, fusion_buffer: Callable[[int], np.ndarray], timeline=None,
                 algorithm: str = "auto") -> None:
    """Run one unit's collective on ``comm`` and write results into the entries' outputs.

    Collective: every rank of the communicator runs the same unit (same index) in the same order.
    """
    op = unit.op_type
    if op is OpType.ALLREDUCE:
        _allreduce(comm, unit, fusion_buffer, timeline, algorithm)
    elif op is OpType.ALLGATHER:
        _allgather(comm, unit.pieces[0].entry)
    elif op is OpType.BROADCAST:
        _broadcast(comm, unit.pieces[0].entry)
    elif op is OpType.ALLTOALL:
        _alltoall(comm, unit.pieces[0].entry)
    elif op is OpType.REDUCESCATTER:
        _reducescatter(comm, unit)
    elif op is OpType.BARRIER:
        comm.barrier()
    else:  # pragma: no cover - OpType is closed
        raise NotImplementedError(f"perseus engine cannot execute {op!r}")


def _allreduce(comm: MpiComm, unit: Unit, fusion_buffer, timeline, algorithm: str) -> None:
    bf16 = unit.dtype is DType.BFLOAT16
    pre, post = unit.prescale, unit.postscale
    if unit.kind is UnitKind.INPLACE:
        piece = unit.pieces[0]
        entry = piece.entry
        dst = _flat(entry.output)[piece.offset: piece.offset + piece.count]
        src = None if entry.input is None else _flat(entry.input)[piece.offset: piece.offset + piece.count]
        if pre != 1.0:
            scale_into(src if src is not None else dst, dst, pre, bf16)
            src = None
        elif src is not None and np.shares_memory(src, dst):
            src = None
        comm.allreduce(src, dst, unit.dtype, unit.reduce_op, post, algorithm)
        return
    npdt = numpy_dtype(unit.dtype)
    buf = fusion_buffer(unit.nbytes)[: unit.nbytes].view(npdt)
    if timeline is not None:
        timeline.activity_start_all(unit.pieces, "MEMCPY_IN_FUSION_BUFFER")
    for piece in unit.pieces:
        src = piece.entry.input if piece.entry.input is not None else piece.entry.output
        part = buf[piece.buf_offset: piece.buf_offset + piece.count]
        if pre != 1.0:
            scale_into(_flat(src), part, pre, bf16)
        else:
            np.copyto(part, _flat(src))
    if timeline is not None:
        timeline.activity_start_all(unit.pieces, "MPI_ALLREDUCE")
    comm.allreduce(None, buf, unit.dtype, unit.reduce_op, 1.0, algorithm)  # postscale applied on copy-out
    if timeline is not None:
        timeline.activity_start_all(unit.pieces, "MEMCPY_OUT_FUSION_BUFFER")
    for piece in unit.pieces:
        part = buf[piece.buf_offset: piece.buf_offset + piece.count]
        dst = _flat(piece.entry.output)
        if post != 1.0:
            scale_into(part, dst, post, bf16)
        else:
            np.copyto(dst, part)


def _allgather(comm: MpiComm, entry: Entry) -> None:
    rows = entry.shape[0] if entry.shape else 1
    counts_rows = comm.allgather_ints(np.array([rows], np.int64))[:, 0]
    row = math.prod(entry.shape[1:])
    out_shape = (int(counts_rows.sum()),) + tuple(entry.shape[1:])
    out = entry.alloc(out_shape)
    comm.allgatherv(_flat(entry.input), _flat(out), [int(c) * row for c in counts_rows])
    entry.output = out
    entry.received_splits = counts_rows


def _broadcast(comm: MpiComm, entry: Entry) -> None:
    root = entry.signature.root_rank
    out = entry.output
    if comm.rank == root and entry.input is not None and not np.shares_memory(entry.input, out):
        np.copyto(_flat(out), _flat(entry.input))
    comm.broadcast(_flat(out), root)


def _alltoall(comm: MpiComm, entry: Entry) -> None:
    row = math.prod(entry.shape[1:])
    send_rows = np.ascontiguousarray(entry.splits, dtype=np.int64)
    recv_rows = comm.alltoall_ints(send_rows)
    out = entry.alloc((int(recv_rows.sum()),) + tuple(entry.shape[1:]))
    comm.alltoallv(_flat(entry.input), [int(c) * row for c in send_rows], _flat(out),
                   [int(c) * row for c in recv_rows])
    entry.output = out
    entry.received_splits = recv_rows


def reducescatter_rows(first_dim: int, size: int) -> list[int]:
    """Rows of the first dimension each rank receives from reducescatter (earlier ranks take the remainder)."""
    return even_counts(first_dim, size)


def _reducescatter(comm: MpiComm, unit: Unit) -> None:
    entry = unit.pieces[0].entry
    bf16 = unit.dtype is DType.BFLOAT16
    rows = reducescatter_rows(entry.shape[0] if entry.shape else 1, comm.size)
    row = math.prod(entry.shape[1:])
    out = entry.alloc((rows[comm.rank],) + tuple(entry.shape[1:]))
    src = _flat(entry.input)
    if unit.prescale != 1.0:
        scaled = np.empty_like(src)
        scale_into(src, scaled, unit.prescale, bf16)
        src = scaled
    reduce_op = 1 if unit.reduce_op == 0 else unit.reduce_op
    comm.reducescatter(src, _flat(out), [r * row for r in rows], unit.dtype, reduce_op)
    if unit.postscale != 1.0:
        scale_into(_flat(out), _flat(out), unit.postscale, bf16)
    entry.output = out

