"""Byte layout of the sparse paths' messages, and their submission to the engine.

Every message a rank sends (one alltoall block per destination, one allgather blob) is a byte string made
of 8-byte-aligned sections: a header of :data:`HEADER` int64 words, then the algorithm's arrays, each padded
to a multiple of 8 bytes. Since every block is a multiple of 8 bytes long and the engine allocates its
outputs aligned, every section of a received buffer can be viewed in place with its dtype (no copy).

Header words: magic, algorithm, rows of the table (-1 when unknown), elements per row, layout digest (row
shape, dtype, op), partition seed (0 when unused), entry count, sender's rank in the set, and how long the
sender's previous call under the name took (nanoseconds) with that call's number (-1 when none): the
'auto' choice learns the algorithms' real costs from them (:mod:`perseus.sparse.choice`). Every rank
receives every other rank's header in the first collective of every algorithm, so a disagreement about the
table is found by every rank at the same point (:func:`check_headers`), and they all raise.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import numpy as np

from perseus.base.exceptions import MismatchError
from perseus.engine.messages import DType, OpType, Request, Timing, dtype_of

HEADER = 10
MAGIC = 0x5A454E5350415253  # "ZENSPARS"
ALGORITHMS = ("dense", "allgather", "zen", "alltoall")
CODE = {a: i for i, a in enumerate(ALGORITHMS)}

_UINT8 = int(DType.UINT8)
ALLREDUCE, ALLGATHER, ALLTOALL = int(OpType.ALLREDUCE), int(OpType.ALLGATHER), int(OpType.ALLTOALL)


def pad8(n: int) -> int:
    return (int(n) + 7) & ~7


def layout_digest(row_shape: tuple, dtype: np.dtype, op: int) -> int:
    return zlib.crc32(repr((tuple(int(s) for s in row_shape), np.dtype(dtype).str, int(op))).encode())


class Table:
    """What every rank must agree on about one call: rows, row shape, value dtype, op, algorithm, seed."""

    __slots__ = ("name", "rows", "row_shape", "width", "dtype", "op", "algorithm", "seed", "index_dtype",
                 "digest", "previous")

    def __init__(self, name: str, rows: Optional[int], row_shape: tuple, dtype, op: int, algorithm: str,
                 seed: int = 0):
        self.name = name
        self.rows = -1 if rows is None else int(rows)
        self.row_shape = tuple(int(s) for s in row_shape)
        self.width = int(np.prod(self.row_shape, dtype=np.int64)) if self.row_shape else 1
        self.dtype = np.dtype(dtype)
        self.op = int(op)
        self.algorithm = algorithm
        self.seed = int(seed) & 0x7FFFFFFFFFFFFFFF
        # int32 indices on the wire when every row id fits (and always for an unknown size: ids must fit)
        self.index_dtype = np.dtype(np.int32) if 0 <= self.rows < (1 << 31) else np.dtype(np.int64)
        self.digest = layout_digest(self.row_shape, self.dtype, op)
        #: (nanoseconds, call number) of this rank's previous call under the name, or (-1, -1)
        self.previous = (-1, -1)

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    def header(self, count: int, rank: int) -> np.ndarray:
        return np.array([MAGIC, CODE[self.algorithm], self.rows, self.width, self.digest, self.seed, count, rank,
                         self.previous[0], self.previous[1]], np.int64)

    def describe(self) -> str:
        rows = "an unknown number of" if self.rows < 0 else str(self.rows)
        return (f"{rows} rows of shape {self.row_shape} ({self.dtype.name}), algorithm {self.algorithm}, "
                f"op {'Average' if self.op == 0 else 'Sum'}")


def describe_header(h: np.ndarray) -> str:
    if int(h[0]) != MAGIC:
        return "a message that is not a perseus sparse message"
    code = int(h[1])
    alg = ALGORITHMS[code] if 0 <= code < len(ALGORITHMS) else f"#{code}"
    rows = "an unknown number of" if int(h[2]) < 0 else str(int(h[2]))
    return f"{rows} rows of {int(h[3])} elements, algorithm {alg}, layout digest {int(h[4]):#x}, seed {int(h[5]):#x}"


def check_headers(table: Table, headers: Sequence[np.ndarray], api: str = "sparse_allreduce") -> None:
    """Raise MismatchError (on every rank: each sees all headers) unless every header matches ``table``."""
    mine = table.header(0, 0)[:6]
    for src, h in enumerate(headers):
        if h.size < HEADER or not np.array_equal(h[:6], mine):
            what = describe_header(h) if h.size >= HEADER else "a truncated message"
            raise MismatchError(
                f"perseus.{api}({table.name!r}): ranks disagree about the tensor: rank {src} of the process set "
                f"sent {what}, but this rank has {table.describe()}, seed {table.seed:#x}. Every rank must pass "
                "a sparse tensor of the same dense shape and dtype under a name, with the same op and algorithm.")


def blocks(table: Table, buf: np.ndarray, splits, api: str = "sparse_allreduce"):
    """``(headers, readers)`` of the blocks of a received buffer (``splits``: bytes per sender), each reader
    positioned after its block's header, once every header has been checked against ``table``."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(splits, np.int64))]).tolist()
    headers, readers = [], []
    for s in range(len(starts) - 1):
        r = Reader(buf, starts[s])
        headers.append(r.section(np.int64, HEADER) if starts[s + 1] - starts[s] >= 8 * HEADER
                       else np.zeros(0, np.int64))
        readers.append(r)
    check_headers(table, headers, api)
    return headers, readers


class Writer:
    """Builds one byte buffer from blocks of aligned sections; :meth:`splits` gives each block's size."""

    def __init__(self, total: int):
        self.buf = np.empty(int(total), np.uint8)
        self.offset = 0
        self.block_sizes: list = []
        self._block_start = 0

    def section(self, dtype, count: int) -> np.ndarray:
        """A writable view of ``count`` items of ``dtype`` at the current offset (then padded to 8 bytes)."""
        dtype = np.dtype(dtype)
        n = int(count) * dtype.itemsize
        view = self.buf[self.offset:self.offset + n].view(dtype)
        self.offset += pad8(n)
        return view

    def put(self, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array)
        self.section(a.dtype, a.size)[...] = a.reshape(-1)

    def end_block(self) -> None:
        self.block_sizes.append(self.offset - self._block_start)
        self._block_start = self.offset


class Reader:
    """Reads aligned sections back from a received buffer (views, no copies)."""

    def __init__(self, buf: np.ndarray, offset: int = 0):
        self.buf = buf
        self.offset = int(offset)

    def section(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(count) * dtype.itemsize
        if self.offset + n > self.buf.size:
            raise MismatchError("perseus.sparse: a received message is shorter than its header says (ranks "
                                "disagree about the tensor or run different perseus versions)")
        view = self.buf[self.offset:self.offset + n].view(dtype)
        self.offset += pad8(n)
        return view


def submit_bytes(engine, ps_id: int, op_type: int, name: str, buf: np.ndarray,
                 splits: Optional[Sequence[int]] = None) -> int:
    """Start an allgather or alltoall of the uint8 ``buf`` named exactly ``name``; synchronize gives
    ``[(received uint8 array, received splits)]``. Timed in the training step, not in its digest (the
    sizes vary by step)."""
    item = Request(name=name, dtype=_UINT8, shape=(int(buf.size),), input=buf,
                   splits=None if splits is None else [int(s) for s in splits], timing=Timing.UNSIGNED)
    return engine.submit(ps_id, op_type, [item], lambda r: r, buf)


def submit_allreduce(engine, ps_id: int, names: Sequence[str], arrays: Sequence[np.ndarray], ops: Sequence[int]) -> int:
    """Start in-place allreduces of ``arrays`` (negotiated together) under exactly ``names``. Timed in the
    training step, not in its digest (which the tuner takes from the sparse tensors' own signature)."""
    items = [Request(name=nm, dtype=int(dtype_of(a)), shape=a.shape, input=a, output=a, reduce_op=int(op),
                     timing=Timing.UNSIGNED) for nm, a, op in zip(names, arrays, ops)]
    return engine.submit(ps_id, ALLREDUCE, items, (None,), list(arrays))
