"""The all-gather path (Horovod's sparse all-reduce, the thesis's AGsparse), framework-neutral.

Each rank's coalesced rows and values travel in one blob (header, int32/int64 row ids, values) through one
allgather; every rank concatenates them in rank order. The result is not coalesced (a row several ranks
have appears several times), as Horovod returns it; with op=Average the gathered values are divided by the
set size, as Horovod does.
"""

from __future__ import annotations

import numpy as np

from perseus.sparse import _format

__all__ = ["pack", "unpack", "start"]


def pack(table: _format.Table, rows: np.ndarray, values: np.ndarray, rank: int) -> np.ndarray:
    m = rows.size
    w = _format.Writer(8 * _format.HEADER + _format.pad8(m * table.index_dtype.itemsize) + _format.pad8(m * table.row_bytes))
    w.put(table.header(m, rank))
    w.section(table.index_dtype, m)[...] = rows
    w.section(table.dtype, m * table.width)[...] = values.reshape(-1)
    return w.buf


def unpack(table: _format.Table, buf: np.ndarray, splits, api: str = "sparse_allreduce"):
    """``(rows, values, counts, headers)``: every rank's rows (int64) and values concatenated in rank order."""
    headers, readers = _format.blocks(table, buf, splits, api)
    counts = np.array([int(h[6]) for h in headers], np.int64)
    total = int(counts.sum())
    rows = np.empty(total, np.int64)
    values = np.empty((total, table.width), table.dtype)
    off = 0
    for r, c in zip(readers, counts.tolist()):
        rows[off:off + c] = r.section(table.index_dtype, c)
        values[off:off + c] = r.section(table.dtype, c * table.width).reshape(c, table.width)
        off += c
    return rows, values, counts, headers


def _union(rows: np.ndarray, num_rows: int, index: int):
    """Distinct rows (only 'auto' needs them): by a mask of the table when that is not much bigger than the
    rows, else by sorting on every 8th call (None on the others; the same calls on every rank)."""
    if 0 <= num_rows <= 64 * max(rows.size, 1):
        mask = np.zeros(num_rows, bool)
        mask[rows] = True
        return int(np.count_nonzero(mask))
    return int(np.unique(rows).size) if index % 8 == 0 else None


def start(call) -> None:
    t, n, rank = call.table, call.n, call.rank
    blob = pack(t, call.rows, call.values, rank)
    call.sent += blob.size
    hid = _format.submit_bytes(call.engine, call.ps_id, _format.ALLGATHER, t.name, blob)

    def gathered():
        (buf, splits), = call.engine.wait(hid)
        call.received += int(buf.size - splits[rank])
        rows, values, counts, headers = unpack(t, buf, splits)
        call.peer_times(headers)
        if t.op == 0 and n != 1:
            np.divide(values, n, out=values, casting="unsafe")
        union = _union(rows, t.rows, call.index) if call.how != "explicit" else None
        call.finish(rows, values, False, nnz=counts, union=union)
    call.after([hid], gathered)
