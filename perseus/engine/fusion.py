"""Stage 3: turn the negotiated, ordered list of ready entries into all-reduce units.

Small allreduce tensors that share dtype, reduction and scale factors are packed into one unit up to
``fusion_threshold_bytes``; a tensor of at least ``inplace_threshold_bytes`` is reduced where it lies, split
into units of at most ``fusion_threshold_bytes``. Every other op is one unit per tensor. Every rank computes the
same plan from the same negotiated list, so unit ``k`` is the same collective on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
from perseus.engine.messages import DType, Entry, OpType

__all__ = ["UnitKind", "Piece", "Unit", "plan_units"]


class UnitKind(enum.IntEnum):
    PACKED = 0   # several tensors copied into one fusion buffer
    INPLACE = 1  # one slice of one tensor, reduced where it lies
    SINGLE = 2   # one non-allreduce request


@dataclasses.dataclass(slots=True, eq=False)
class Piece:
    """``count`` elements of ``entry`` starting at element ``offset``, at element ``buf_offset`` of the unit."""

    entry: Entry
    offset: int
    count: int
    buf_offset: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class Unit:
    kind: UnitKind
    op_type: OpType
    dtype: DType
    pieces: list
    numel: int
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    index: int = 0  # position in the process set's unit sequence; picks the channel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_units(entries: list[Entry], fusion_threshold_bytes: int, inplace_threshold_bytes: int,
               average_divisor: int) -> list[Unit]:
    """Split ``entries`` (already in execution order) into units; set each entry's ``remaining`` count.

    ``average_divisor`` (the process-set size) turns Average into Sum with a postscale.
    """
    units: list[Unit] = []
    # A packed unit stays open while in-place units and other ops are emitted, so small tensors scattered
    # between large ones (biases between weights) still travel together: one open unit per
    # (dtype, reduction, scales), emitted at the position of its first tensor.
    open_units: dict = {}
    for entry in entries:
        sig = entry.signature
        if sig.op_type is not OpType.ALLREDUCE:
            entry.remaining = 1
            units.append(Unit(UnitKind.SINGLE, sig.op_type, sig.dtype, [Piece(entry, 0, entry.numel)],
                              entry.numel, sig.reduce_op, sig.prescale,
                              _postscale(sig, average_divisor)))
            continue
        numel, item = entry.numel, sig.dtype.itemsize
        post = _postscale(sig, average_divisor)
        reduce_op = 1 if sig.reduce_op == 0 else sig.reduce_op  # Average travels as Sum
        nbytes = numel * item
        if nbytes >= max(inplace_threshold_bytes, 1) or nbytes > fusion_threshold_bytes:
            step = max(fusion_threshold_bytes // item, 1) if fusion_threshold_bytes > 0 else max(numel, 1)
            starts = range(0, numel, step) if numel else [0]
            entry.remaining = len(starts)
            for start in starts:
                count = min(step, numel - start)
                units.append(Unit(UnitKind.INPLACE, OpType.ALLREDUCE, sig.dtype, [Piece(entry, start, count)],
                                  count, reduce_op, sig.prescale, post))
            continue
        entry.remaining = 1
        key = (sig.dtype, reduce_op, sig.prescale, post)
        open_unit = open_units.get(key)
        if open_unit is None or (open_unit.numel + numel) * item > fusion_threshold_bytes:
            open_unit = Unit(UnitKind.PACKED, OpType.ALLREDUCE, sig.dtype, [], 0, reduce_op, sig.prescale, post)
            open_units[key] = open_unit
            units.append(open_unit)
        open_unit.pieces.append(Piece(entry, 0, numel, open_unit.numel))
        open_unit.numel += numel
    return units


def _postscale(sig, divisor: int) -> float:
    if sig.reduce_op == 0 and sig.op_type in (OpType.ALLREDUCE, OpType.REDUCESCATTER):
        return sig.postscale / divisor
    return sig.postscale
