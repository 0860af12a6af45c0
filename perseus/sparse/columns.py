"""The all-to-all path (EmbRace's column partition) for a sparse tensor.

Rank k owns columns ``cols_k`` of every row (``array_split`` of the row's W elements: the first ``W % n``
ranks have one more). Push: one alltoall in which every rank sends every rank its row ids and those rows'
``cols_k`` slices; every rank therefore receives every id and computes the same union. Rank k sums its
slices source by source in rank order. Pull: one allgather of the summed slices, with no ids. Perfectly
balanced whatever the skew (the load is split by column, not by row), at the price of sending every row id
to every rank.
"""

from __future__ import annotations

import numpy as np

from perseus.sparse import _format

__all__ = ["column_bounds", "start"]


def column_bounds(width: int, n: int) -> list:
    base, extra = divmod(int(width), int(n))
    bounds, c0 = [], 0
    for k in range(n):
        c1 = c0 + base + (1 if k < extra else 0)
        bounds.append((c0, c1))
        c0 = c1
    return bounds


def start(call) -> None:
    t, n, rank = call.table, call.n, call.rank
    m = call.rows.size
    bounds = column_bounds(t.width, n)
    x, item = t.index_dtype.itemsize, t.dtype.itemsize
    total = sum(8 * _format.HEADER + _format.pad8(m * x) + _format.pad8(m * (c1 - c0) * item) for c0, c1 in bounds)
    w = _format.Writer(total)
    for c0, c1 in bounds:
        w.put(t.header(m, rank))
        w.section(t.index_dtype, m)[...] = call.rows
        w.section(t.dtype, m * (c1 - c0)).reshape(m, c1 - c0)[...] = call.values[:, c0:c1]
        w.end_block()
    call.sent += w.buf.size - w.block_sizes[rank]
    hid = _format.submit_bytes(call.engine, call.ps_id, _format.ALLTOALL, t.name, w.buf, w.block_sizes)
    call.after([hid], lambda: _sum_stage(call, hid, bounds))


def _sum_stage(call, hid, bounds) -> None:
    t, n, rank = call.table, call.n, call.rank
    (buf, splits), = call.engine.wait(hid)
    call.received += int(buf.size - splits[rank])
    headers, readers = _format.blocks(t, buf, splits)
    call.peer_times(headers)
    counts = np.array([int(h[6]) for h in headers], np.int64)
    c0, c1 = bounds[rank]
    cols = c1 - c0
    idx = [r.section(t.index_dtype, c) for r, c in zip(readers, counts.tolist())]
    vals = [r.section(t.dtype, c * cols).reshape(c, cols) for r, c in zip(readers, counts.tolist())]
    cat = np.concatenate(idx) if idx else np.zeros(0, t.index_dtype)
    union, inv = np.unique(cat, return_inverse=True)
    sums = np.zeros((union.size, cols), t.dtype)
    off = 0
    for c, v in zip(counts.tolist(), vals):
        if c and cols:
            sums[inv[off:off + c]] += v
        off += c
    w = _format.Writer(8 * (_format.HEADER + n) + _format.pad8(sums.nbytes))
    w.put(t.header(int(union.size), rank))
    w.put(counts)
    w.section(t.dtype, sums.size)[...] = sums.reshape(-1)
    call.sent += w.buf.size
    hid2 = _format.submit_bytes(call.engine, call.ps_id, _format.ALLGATHER, t.name + ".pull", w.buf)
    rows = union.astype(np.int64)
    call.after([hid2], lambda: _gather_stage(call, hid2, bounds, rows, counts))


def _gather_stage(call, hid, bounds, rows, counts) -> None:
    t, n, rank = call.table, call.n, call.rank
    (buf, splits), = call.engine.wait(hid)
    call.received += int(buf.size - splits[rank])
    u = rows.size
    values = np.empty((u, t.width), t.dtype)
    headers, readers = _format.blocks(t, buf, splits)
    for k, (h, r) in enumerate(zip(headers, readers)):
        if int(h[6]) != u:
            raise _format.MismatchError(f"perseus.sparse_allreduce({t.name!r}): rank {k} summed {int(h[6])} rows, "
                                      f"this rank {u}")
        r.section(np.int64, n)
        c0, c1 = bounds[k]
        values[:, c0:c1] = r.section(t.dtype, u * (c1 - c0)).reshape(u, c1 - c0)
    if t.op == 0 and n != 1:
        np.divide(values, n, out=values, casting="unsafe")
    call.finish(rows, values, True, nnz=counts, union=u)
