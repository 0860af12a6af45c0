"""Zen: sparse all-reduce by balanced parallelism (hash partition, push, sum at the owner, hash-bitmap pull).

Row granularity: an index is a row of the dense table (an embedding row), its value a row of ``W`` elements.

1. Every rank coalesces its rows (sums duplicates) and splits them by owner ``h0(row)`` (a keyed hash agreed
   by every rank, :mod:`perseus.sparse.hashing`). Two partitioners give the same set per owner: the bucket
   path (``h0`` then a counting sort; the default on CPU, and the oracle) and the hierarchical hash partition
   of the Zen paper (``k`` slot hashes into a parallel region of ``r1`` slots per owner, then a serial
   region; the serial region is sized from the count of rows left over, so no row is ever dropped).
2. Push: one alltoall of packed (header, int32/int64 rows, values) blocks, one per owner.
3. The owner sums what it received, source rank by source rank (deterministic), into the sorted union of
   its rows.
4. Pull: one allgather of each owner's (header, per-source counts, index section, summed values). The index
   section is a bitmap over ``I_j``, the sorted list of every row of the table whose owner is ``j``
   (computed once per table size, set size and seed, and cached), or the rows themselves when that is
   smaller. Over all owners the bitmaps add up to ``rows / 8`` bytes, whatever the number of ranks.
5. Every rank decodes every owner's part, so every rank ends with the same sorted rows and values.

The bitmap marks rows *present* in any rank's input (not rows whose sum is non-zero): the result has the
same rows as the all-gather path, so optimizers that treat present rows specially (SparseAdam) see the
same gradient whichever algorithm ran.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from perseus.sparse import _format
from perseus.sparse.hashing import Seeds, owner_of, slot_of
from perseus.sparse._runtime import settings

__all__ = ["coalesce", "bucket_partition", "hash_partition", "partition", "OwnedRows", "owned_rows",
           "encode_bitmap", "decode_bitmap", "push_imbalance", "pull_imbalance", "pack_push", "aggregate",
           "pack_pull", "unpack_pull", "assemble"]


# -- local preparation --------------------------------------------------------------------------------------
def coalesce(rows: np.ndarray, values: np.ndarray):
    """Sorted unique int64 rows and their summed values (duplicates summed in input order)."""
    rows = np.asarray(rows).astype(np.int64, copy=False).reshape(-1)
    if rows.size <= 1:
        return rows.copy(), values
    order = np.argsort(rows, kind="stable")
    r = rows[order]
    step = r[1:] != r[:-1]
    if step.all():
        if (order[1:] > order[:-1]).all():  # already sorted
            return r, values
        return r, values[order]
    starts = np.flatnonzero(np.concatenate([[True], step]))
    return r[starts], np.add.reduceat(values[order], starts, axis=0)


def bucket_partition(rows: np.ndarray, n: int, seed: int):
    """The CPU path: ``(perm, counts)``, ``perm`` the positions of ``rows`` grouped by owner ``h0`` (input
    order within an owner), ``counts`` the rows per owner."""
    owners = owner_of(rows, n, seed)
    counts = np.bincount(owners, minlength=n).astype(np.int64)
    key = owners.astype(np.uint16) if n <= 0xFFFF else owners
    return np.argsort(key, kind="stable"), counts


def hash_partition(rows: np.ndarray, n: int, seeds: Seeds, k: int = 3, load_factor: float = 0.5,
                   serial_fraction: float = 0.1):
    """The hierarchical hash partition (Zen's Algorithm 3.2), vectorised: ``(perm, counts, info)`` as
    :func:`bucket_partition`, with the rows of an owner in slot order.

    Each owner has ``r1 = ceil(m / (n * load_factor))`` parallel slots and a serial region of
    ``ceil(r1 * serial_fraction)`` slots. In round i every row not yet placed writes its position into
    slot ``h_i(row)`` of its owner if that slot is empty, then reads the slot back: the row whose write
    stayed has the slot (as the GPU version's write-and-check), the others try ``h_{i+1}``. After ``k``
    rounds the rows left are appended to their owner's serial region; when an owner has more of them than
    the region holds, the region is grown to the count first (``info['overflowed']``), so no row is lost.
    """
    rows = np.asarray(rows, np.int64).reshape(-1)
    m = rows.size
    if k < 1 or k > len(seeds.slots):
        raise ValueError(f"perseus.sparse: k={k} slot hashes requested, the seeds provide {len(seeds.slots)}")
    if load_factor <= 0 or serial_fraction < 0:
        raise ValueError("perseus.sparse: the load factor must be > 0 and the serial fraction >= 0")
    owners = owner_of(rows, n, seeds.h0)
    r1 = max(1, math.ceil(m / (n * load_factor)))
    r2 = max(1, math.ceil(r1 * serial_fraction))
    width = r1 + r2
    slots = np.full(n * width, -1, np.int64)
    base = owners * width
    pending = np.arange(m, dtype=np.int64)
    for i in range(k):
        if pending.size == 0:
            break
        flat = base[pending] + slot_of(rows[pending], r1, seeds.slots[i])
        free = slots[flat] < 0
        slots[flat[free]] = pending[free]
        won = slots[flat] == pending
        pending = pending[~won]
    serial = int(pending.size)
    overflowed = False
    if serial:
        lo = owners[pending]
        need = np.bincount(lo, minlength=n)
        if int(need.max()) > r2:
            overflowed = True
            grown = np.full((n, r1 + int(need.max())), -1, np.int64)
            grown[:, :width] = slots.reshape(n, width)
            r2 = int(need.max())
            width = r1 + r2
            slots = grown.reshape(-1)
        order = np.argsort(lo, kind="stable")
        starts = np.cumsum(need) - need
        within = np.arange(serial, dtype=np.int64) - starts[lo[order]]
        slots[lo[order] * width + r1 + within] = pending[order]
    table = slots.reshape(n, width)
    mask = table >= 0
    counts = mask.sum(axis=1).astype(np.int64)
    perm = table[mask]
    return perm, counts, {"r1": r1, "r2": r2, "serial": serial, "overflowed": overflowed,
                          "serial_fraction": serial / m if m else 0.0}


def partition(rows: np.ndarray, n: int, seeds: Seeds, method: str = "bucket", k: int = 3,
              load_factor: float = 0.5, serial_fraction: float = 0.1):
    """``(perm, counts, info)`` by ``method``: 'bucket', 'hash', or 'check' (both, compared; a difference
    raises AssertionError)."""
    if method == "bucket":
        perm, counts = bucket_partition(rows, n, seeds.h0)
        return perm, counts, {"serial": 0, "overflowed": False, "serial_fraction": 0.0}
    perm, counts, info = hash_partition(rows, n, seeds, k, load_factor, serial_fraction)
    if method == "check":
        ref, ref_counts = bucket_partition(rows, n, seeds.h0)
        if not np.array_equal(counts, ref_counts):
            raise AssertionError(f"perseus.sparse: hash partition counts {counts.tolist()} differ from the "
                                 f"bucket partition's {ref_counts.tolist()}")
        off = 0
        for c in counts.tolist():
            if not np.array_equal(np.sort(perm[off:off + c]), np.sort(ref[off:off + c])):
                raise AssertionError("perseus.sparse: the hash partition put a row with another owner")
            off += c
    elif method != "hash":
        raise ValueError(f"perseus.sparse: unknown partitioner {method!r}; use bucket, hash or check")
    return perm, counts, info


# -- rows owned by each rank ---------------------------------------------------------------------------------
class OwnedRows:
    """``I_j`` for every owner j: the sorted rows of a table of ``rows`` rows whose ``h0`` is j (4 bytes per
    row of the table while the row ids fit in int32)."""

    __slots__ = ("rows", "n", "seed", "order", "offsets")

    def __init__(self, rows: int, n: int, seed: int):
        self.rows, self.n, self.seed = int(rows), int(n), int(seed)
        key = np.empty(self.rows, np.uint16 if n <= 0xFFFF else np.int64)
        chunk = 1 << 20
        for start in range(0, self.rows, chunk):
            stop = min(self.rows, start + chunk)
            key[start:stop] = owner_of(np.arange(start, stop, dtype=np.int64), n, seed)
        counts = np.bincount(key, minlength=n)
        order = np.argsort(key, kind="stable")
        self.order = order.astype(np.int32) if self.rows < (1 << 31) else order
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def owned(self, j: int) -> np.ndarray:
        return self.order[self.offsets[j]:self.offsets[j + 1]]

    def count(self, j: int) -> int:
        return int(self.offsets[j + 1] - self.offsets[j])


#: tables with more rows pull row ids instead of hash bitmaps (no I_j lists are built for them)
BITMAP_MAX_ROWS = 1 << 26

_owned_cache: "OrderedDict[tuple, OwnedRows]" = OrderedDict()
_owned_lock = threading.Lock()
_OWNED_KEEP = 16


def owned_rows(rows: int, n: int, seed: int) -> OwnedRows:
    """The cached :class:`OwnedRows` for (table rows, set size, seed)."""
    key = (int(rows), int(n), int(seed))
    with _owned_lock:
        hit = _owned_cache.get(key)
        if hit is not None:
            _owned_cache.move_to_end(key)
            return hit
    made = OwnedRows(rows, n, seed)
    with _owned_lock:
        _owned_cache[key] = made
        while len(_owned_cache) > _OWNED_KEEP:
            _owned_cache.popitem(last=False)
    return made


def is_cached(rows, n: int, seed: int) -> bool:
    with _owned_lock:
        return (int(rows) if rows is not None else -1, int(n), int(seed)) in _owned_cache


def clear_cache() -> None:
    with _owned_lock:
        _owned_cache.clear()


# -- hash bitmap ---------------------------------------------------------------------------------------------
def encode_bitmap(owned: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Bit i (little-endian within each byte) set when ``owned[i]`` is in ``present`` (sorted, a subset of
    the sorted ``owned``): ``ceil(len(owned) / 8)`` bytes."""
    bits = np.zeros(owned.size, np.uint8)
    if present.size:
        bits[np.searchsorted(owned, present)] = 1
    return np.packbits(bits, bitorder="little")


def decode_bitmap(owned: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """The rows of ``owned`` whose bits are set in ``packed`` (sorted, int64)."""
    bits = np.unpackbits(packed, count=owned.size, bitorder="little")
    return owned[np.flatnonzero(bits)].astype(np.int64)


# -- imbalance -----------------------------------------------------------------------------------------------
def push_imbalance(counts: np.ndarray) -> float:
    """Zen's push imbalance: ``max n * |I_i^j| / |I_i|`` over senders i with rows and owners j, where
    ``counts[j, i]`` is what rank i sent to owner j. 1 is perfect; 1.0 when nobody sent anything."""
    counts = np.asarray(counts, np.float64)
    n = counts.shape[0]
    sent = counts.sum(axis=0)
    ok = sent > 0
    if not ok.any():
        return 1.0
    return float((n * counts[:, ok] / sent[ok]).max())


def pull_imbalance(per_owner: np.ndarray) -> float:
    """Zen's pull imbalance: ``max_j n * |S_j| / |S|`` (``per_owner[j]`` rows after the sum at owner j)."""
    per_owner = np.asarray(per_owner, np.float64)
    total = per_owner.sum()
    return float(per_owner.size * per_owner.max() / total) if total > 0 else 1.0


def receive_imbalance(counts: np.ndarray) -> float:
    """Rows the busiest owner received over the mean (what bounds the push's time)."""
    got = np.asarray(counts, np.float64).sum(axis=1)
    mean = got.mean() if got.size else 0.0
    return float(got.max() / mean) if mean > 0 else 1.0


# -- the protocol, as pure functions on buffers -----------------------------------------------------------
_EXT = 3  # pull extension words: format (0 bitmap, 1 rows), owned rows |I_j|, index items


def pack_push(table: _format.Table, rows: np.ndarray, values: np.ndarray, perm: np.ndarray, counts: np.ndarray,
              rank: int) -> _format.Writer:
    """One block per owner: header, rows (index dtype), values; ``writer.block_sizes`` are the splits."""
    x, rb = table.index_dtype.itemsize, table.row_bytes
    total = sum(_format.HEADER * 8 + _format.pad8(c * x) + _format.pad8(c * rb) for c in counts.tolist())
    w = _format.Writer(total)
    off = 0
    for c in counts.tolist():
        sel = perm[off:off + c]
        off += c
        w.put(table.header(c, rank))
        w.section(table.index_dtype, c)[...] = rows[sel]
        vs = w.section(table.dtype, c * table.width).reshape(c, table.width)
        np.take(values, sel, axis=0, out=vs)
        w.end_block()
    return w


def aggregate(table: _format.Table, buf: np.ndarray, splits, api: str = "sparse_allreduce"):
    """At an owner: ``(rows, sums, counts_from, headers)``: the sorted union of the rows received, their
    values summed source by source in rank order, how many rows each source sent, and the headers."""
    headers, readers = _format.blocks(table, buf, splits, api)
    counts = np.array([int(h[6]) for h in headers], np.int64)
    idx = [r.section(table.index_dtype, c) for r, c in zip(readers, counts.tolist())]
    vals = [r.section(table.dtype, c * table.width).reshape(c, table.width) for r, c in zip(readers, counts.tolist())]
    cat = np.concatenate(idx) if idx else np.zeros(0, table.index_dtype)
    if cat.size == 0:
        return np.zeros(0, np.int64), np.zeros((0, table.width), table.dtype), counts, headers
    union, inv = np.unique(cat, return_inverse=True)
    sums = np.zeros((union.size, table.width), table.dtype)
    off = 0
    for c, v in zip(counts.tolist(), vals):
        if c:
            sums[inv[off:off + c]] += v
        off += c
    return union.astype(np.int64), sums, counts, headers


def pack_pull(table: _format.Table, owned: Optional[np.ndarray], union: np.ndarray, sums: np.ndarray,
              counts_from: np.ndarray, rank: int) -> np.ndarray:
    """An owner's pull blob: header, (format, |I_j|, index items), per-source counts, index section, sums.
    ``owned`` None (a table too large for bitmaps): row ids."""
    x = table.index_dtype.itemsize
    n_owned = -1 if owned is None else int(owned.size)
    bitmap_bytes = (n_owned + 7) // 8
    use_rows = owned is None or union.size * x < bitmap_bytes
    index_items = union.size if use_rows else bitmap_bytes
    index_bytes = union.size * x if use_rows else bitmap_bytes
    total = 8 * (_format.HEADER + _EXT + counts_from.size) + _format.pad8(index_bytes) + \
        _format.pad8(union.size * table.row_bytes)
    w = _format.Writer(total)
    w.put(table.header(int(union.size), rank))
    w.put(np.array([1 if use_rows else 0, n_owned, index_items], np.int64))
    w.put(counts_from.astype(np.int64))
    if use_rows:
        w.section(table.index_dtype, union.size)[...] = union
    else:
        w.section(np.uint8, bitmap_bytes)[...] = encode_bitmap(owned, union)
    w.section(table.dtype, sums.size)[...] = sums.reshape(-1)
    return w.buf


def unpack_pull(table: _format.Table, buf: np.ndarray, splits, owned: Optional[OwnedRows],
                api: str = "sparse_allreduce"):
    """Every owner's part: ``(rows per owner, values per owner, counts[j, i], index bytes)``."""
    headers, readers = _format.blocks(table, buf, splits, api)
    n = len(headers)
    rows, vals = [], []
    counts = np.zeros((n, n), np.int64)
    index_bytes = 0
    for j, (h, r) in enumerate(zip(headers, readers)):
        u = int(h[6])
        fmt, n_owned, items = (int(v) for v in r.section(np.int64, _EXT))
        counts[j] = r.section(np.int64, n)
        mine = None if owned is None else owned.owned(j)
        if (-1 if mine is None else mine.size) != n_owned:
            raise _format.MismatchError(
                f"perseus.{api}({table.name!r}): owner {j} partitions the table differently ({n_owned} rows "
                f"owned, this rank computes {-1 if mine is None else mine.size}); the ranks' partition hashes "
                "differ")
        if fmt == 1:
            got = r.section(table.index_dtype, items).astype(np.int64)
            index_bytes += items * table.index_dtype.itemsize
        else:
            got = decode_bitmap(mine, r.section(np.uint8, items))
            index_bytes += items
        if got.size != u:
            raise _format.MismatchError(f"perseus.{api}({table.name!r}): owner {j}'s bitmap holds {got.size} rows but "
                                      f"its header says {u}")
        rows.append(got)
        vals.append(r.section(table.dtype, u * table.width).reshape(u, table.width))
    return rows, vals, counts, index_bytes


def assemble(rows_parts, value_parts, width: int, dtype, divisor: Optional[int] = None):
    """Merge disjoint sorted parts into sorted rows and their values (one copy of the values)."""
    sizes = [p.size for p in rows_parts]
    total = int(sum(sizes))
    out_vals = np.empty((total, width), dtype)
    if total == 0:
        return np.zeros(0, np.int64), out_vals
    cat = np.concatenate(rows_parts)
    order = np.argsort(cat, kind="stable")
    inv = np.empty(total, np.int64)
    inv[order] = np.arange(total, dtype=np.int64)
    off = 0
    for c, v in zip(sizes, value_parts):
        if c:
            out_vals[inv[off:off + c]] = v
        off += c
    if divisor is not None and divisor != 1:
        np.divide(out_vals, divisor, out=out_vals, casting="unsafe")
    return cat[order], out_vals


# -- the stages ----------------------------------------------------------------------------------------------
def start(call) -> None:
    """Partition and push (caller's thread); the owner's sum and the pull follow on the worker."""
    t, n, rank = call.table, call.n, call.rank
    cfg = settings()
    seeds = call.set.seeds
    perm, counts, info = partition(call.rows, n, seeds, cfg.zen_partitioner, int(cfg.zen_hash_funcs),
                                   float(cfg.zen_load_factor), float(cfg.zen_serial_fraction))
    call.info.update(info)
    # I_j: computed once per table size, set size and seed (none for huge tables: they pull row ids)
    owned = owned_rows(t.rows, n, seeds.h0) if t.rows <= BITMAP_MAX_ROWS else None
    w = pack_push(t, call.rows, call.values, perm, counts, rank)
    call.sent += w.buf.size - w.block_sizes[rank]
    hid = _format.submit_bytes(call.engine, call.ps_id, _format.ALLTOALL, t.name, w.buf, w.block_sizes)
    call.after([hid], lambda: _owner_stage(call, hid, owned))


def _owner_stage(call, hid, owned: OwnedRows) -> None:
    t, rank = call.table, call.rank
    (buf, splits), = call.engine.wait(hid)
    call.received += int(buf.size - splits[rank])
    union, sums, counts_from, headers = aggregate(t, buf, splits)
    call.peer_times(headers)
    blob = pack_pull(t, None if owned is None else owned.owned(rank), union, sums, counts_from, rank)
    call.sent += blob.size
    hid2 = _format.submit_bytes(call.engine, call.ps_id, _format.ALLGATHER, t.name + ".pull", blob)
    call.after([hid2], lambda: _pull_stage(call, hid2, owned))


def _pull_stage(call, hid, owned: OwnedRows) -> None:
    t, n, rank = call.table, call.n, call.rank
    (buf, splits), = call.engine.wait(hid)
    call.received += int(buf.size - splits[rank])
    rows_parts, value_parts, counts, index_bytes = unpack_pull(t, buf, splits, owned)
    rows, values = assemble(rows_parts, value_parts, t.width, t.dtype, n if t.op == 0 else None)
    call.finish(rows, values, True, nnz=counts.sum(axis=0), union=rows.size,
                push_imbalance=push_imbalance(counts), pull_imbalance=pull_imbalance([p.size for p in rows_parts]),
                receive_imbalance=receive_imbalance(counts), index_bytes=int(index_bytes))
