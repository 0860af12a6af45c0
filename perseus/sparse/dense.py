"""The dense path for a sparse tensor: densify, all-reduce, take the rows back out.

The rows are scattered into a zero table that is all-reduced with the engine's all-reduce (the same
algorithm, fusion and wire as every dense gradient), together with one float32 presence flag per row, so the
result has exactly the rows some rank had (the rows the other algorithms return), values summed by the
engine. This is what 'auto' picks for dense enough tensors; ``sparse_as_dense=True`` in the optimizers is
Horovod's older meaning (the gradient itself becomes dense) and does not come through here.
"""

from __future__ import annotations

import numpy as np

from perseus.sparse import _format

__all__ = ["start"]


def start(call) -> None:
    t, n = call.table, call.n
    table = np.zeros((t.rows, t.width), t.dtype)
    table[call.rows] = call.values
    # one presence flag per row, then every rank's (previous call's seconds, its number + 1) in its own slots
    present = np.zeros(t.rows + 2 * n, np.float32)
    present[call.rows] = 1.0
    ns, index = t.previous
    present[t.rows + call.rank] = ns / 1e9 if ns >= 0 else -1.0
    present[t.rows + n + call.rank] = index + 1
    call.sent += table.nbytes + present.nbytes
    hid = _format.submit_allreduce(call.engine, call.ps_id, [t.name, t.name + ".rows"], [table, present],
                                 [t.op, 1])

    def reduced():
        call.engine.wait(hid)
        call.received += table.nbytes + present.nbytes
        tail = present[t.rows:].astype(np.float64)
        call.peer_times(None, seconds=tail[:n], indices=np.rint(tail[n:]).astype(np.int64) - 1)
        flags = present[:t.rows]
        rows = np.flatnonzero(flags > 0)
        call.finish(rows.astype(np.int64), table[rows], True, total=int(flags.sum(dtype=np.float64)),
                    union=int(rows.size))
    call.after([hid], reduced)
