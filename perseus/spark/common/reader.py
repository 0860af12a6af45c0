"""The rank side of the Spark estimators' data: batches of this rank's share of a prepared Parquet dataset.

pyarrow and numpy only (no perseus imports), so that both the driver and the ranks may use it. Every rank of a
job makes a :class:`ParquetBatches` with the same arguments but its own ``rank``; the dataset's row groups are
dealt out round robin (row group ``i`` to rank ``i % size``; when there are fewer row groups than ranks, the
largest are cut into row ranges first). Every rank runs the same number of steps per epoch (Horovod's
``max(1, rows_total // (batch_size * size))``), cycling over its share when it is short, so that none waits for
the others at an epoch's end.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Optional
from urllib.parse import urlparse

import numpy as np

__all__ = ["ParquetBatches", "DEFAULT_SHUFFLE_ROWS"]

# The rows mixed at once when shuffling is asked for without a buffer size.
DEFAULT_SHUFFLE_ROWS = 10_000
# Parquet files kept open at once by one reader.
_OPEN_FILES = 16


def _resolve_filesystem(path: str, filesystem):
    """(pyarrow FileSystem, path on it) for ``path`` given an fsspec or pyarrow file system, or None."""
    import pyarrow.fs as pafs

    if filesystem is None:
        if "://" in path:
            return pafs.FileSystem.from_uri(path)
        return pafs.LocalFileSystem(), os.path.abspath(path)
    if isinstance(filesystem, pafs.FileSystem):
        if "://" not in path:
            return filesystem, path
        url = urlparse(path)
        local = url.path if url.scheme in ("file", "hdfs", "viewfs") else url.netloc + url.path
        return filesystem, local
    local = filesystem._strip_protocol(path) if hasattr(filesystem, "_strip_protocol") else path
    protocols = filesystem.protocol if isinstance(filesystem.protocol, (tuple, list)) else (filesystem.protocol,)
    if "file" in protocols:
        return pafs.LocalFileSystem(), local
    inner = getattr(filesystem, "fs", None)  # fsspec's wrapper of a pyarrow file system (HDFS)
    if isinstance(inner, pafs.FileSystem):
        return inner, local
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), local


def _list_columns(arr, name: str) -> np.ndarray:
    """A list array whose rows all have the same length as a ``(rows, length)`` array."""
    import pyarrow as pa

    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        return arr.flatten().to_numpy(zero_copy_only=False, writable=True).reshape(n, arr.type.list_size)
    if arr.null_count:
        raise ValueError(f"column {name!r}: {arr.null_count} null rows")
    offsets = arr.offsets.to_numpy()
    lengths = np.diff(offsets)
    width = int(lengths[0]) if n else 0
    if n and (lengths != width).any():
        raise ValueError(f"column {name!r} holds rows of different lengths ({lengths.min()} to {lengths.max()}): "
                         "every row must have the same length")
    return arr.flatten().to_numpy(zero_copy_only=False, writable=True).reshape(n, width)


def _is_spark_vector(t) -> bool:
    import pyarrow as pa

    return pa.types.is_struct(t) and {f.name for f in t} >= {"type", "size", "indices", "values"}


def _dense_vectors(arr, name: str) -> np.ndarray:
    """Spark ML vectors as Spark writes them (``struct<type, size, indices, values>``; type 0 sparse, 1 dense) as
    a dense ``(rows, size)`` float64 array, without a Python loop over the rows."""
    n = len(arr)
    children = dict(zip([f.name for f in arr.type], arr.flatten()))
    dense = children["type"].to_numpy(zero_copy_only=False) == 1
    values = children["values"]
    offsets = values.offsets.to_numpy()
    lengths = np.diff(offsets)
    flat = values.flatten().to_numpy(zero_copy_only=False)
    sizes = np.where(dense, lengths, children["size"].fill_null(0).to_numpy(zero_copy_only=False))
    width = int(sizes.max()) if n else 0
    if n and (sizes != width).any():
        raise ValueError(f"column {name!r} holds vectors of different sizes ({sizes.min()} to {width})")
    out = np.zeros((n, width), dtype=np.float64)
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(len(flat)) - np.repeat(offsets[:-1] - offsets[0], lengths)  # position within the row
    sparse_values = np.repeat(~dense, lengths)
    if sparse_values.any():
        cols[sparse_values] = children["indices"].flatten().to_numpy(zero_copy_only=False)
    out[rows, cols] = flat
    return out


def _to_numpy(column, name: str) -> np.ndarray:
    """One column of a pyarrow table as numpy: scalars ``(rows,)``, lists and vectors ``(rows, length)``."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    t = arr.type
    if _is_spark_vector(t):
        return _dense_vectors(arr, name)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _list_columns(arr, name)
    return arr.to_numpy(zero_copy_only=False, writable=True)


def _take(pending: list, count: int) -> dict:
    """The first ``count`` rows of the chunks in ``pending`` (which hold at least that many), removed from it."""
    parts, need = [], count
    while need:
        chunk = pending[0]
        n = len(next(iter(chunk.values())))
        if n <= need:
            parts.append(pending.pop(0))
            need -= n
        else:
            parts.append({k: v[:need] for k, v in chunk.items()})
            pending[0] = {k: v[need:] for k, v in chunk.items()}
            need = 0
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _rows(chunk: dict) -> int:
    return len(next(iter(chunk.values())))


class ParquetBatches:
    """Batches of this rank's share of the Parquet dataset at ``path`` (a directory of Parquet files, or one
    file), as ``{column: numpy array}``: scalars ``(batch,)``, arrays and vectors ``(batch, length)`` (Spark ML
    vectors kept sparse are densified).

    ``columns``: the columns to read. ``rank``/``size``: this rank and the number of ranks. ``shuffle_buffer_size``:
    shuffle, mixing this many rows at once (with ``shuffle=True`` and no size, ``DEFAULT_SHUFFLE_ROWS``); the
    order of the row groups is shuffled too, differently each epoch and rank (seeded by ``seed``, the epoch and
    the rank). ``filesystem``: an fsspec or pyarrow file system (default: from the path). ``cache``: keep what
    was read in memory for later epochs (batches then share memory with it: do not modify them in place).

    Every rank must make its reader with the same ``path``, ``batch_size`` and ``size`` and run the same number
    of steps; :meth:`epoch` yields :meth:`steps` batches, each of exactly ``batch_size`` rows, cycling over the
    rank's share as needed. Iterating the reader itself runs epochs 0, 1, 2... one per ``for`` loop.

    Raises (when made): ValueError for a bad argument, a column the data lacks (listing its columns), no Parquet
    files, or a rank whose share is empty (naming the rank, the rows, and the fix); OSError from the file system.
    """

    def __init__(self, path: str, columns, batch_size: int, rank: int, size: int,
                 shuffle_buffer_size: Optional[int] = None, seed: Optional[int] = 0, filesystem=None, *,
                 shuffle: Optional[bool] = None, cache: bool = False):
        if int(batch_size) < 1 or int(size) < 1 or not 0 <= int(rank) < int(size):
            raise ValueError(f"ParquetBatches: batch_size={batch_size} must be >= 1 and rank={rank} in "
                             f"[0, size={size})")
        self.path, self.columns = path, list(columns)
        self.batch_size, self.rank, self.size = int(batch_size), int(rank), int(size)
        self.shuffle = bool(shuffle_buffer_size) if shuffle is None else bool(shuffle)
        self.shuffle_buffer_size = int(shuffle_buffer_size or DEFAULT_SHUFFLE_ROWS) if self.shuffle else 0
        self.seed = int(seed or 0) % (1 << 63)
        self._fs, root = _resolve_filesystem(path, filesystem)
        self._files = self._list_files(root)
        self._open: dict = {}
        self._cached: Optional[dict] = {} if cache else None
        groups = []
        for f_idx in range(len(self._files)):
            md = self._parquet_file(f_idx).metadata
            if f_idx == 0:
                self._check_columns(self._parquet_file(0).schema_arrow.names)
            groups += [[f_idx, g, 0, md.row_group(g).num_rows] for g in range(md.num_row_groups)
                       if md.row_group(g).num_rows]
        self.rows_total = sum(g[3] for g in groups)
        pieces = self._cut(groups, self.size)
        self._pieces = pieces[self.rank::self.size]
        self.rows = sum(p[3] - p[2] for p in self._pieces)
        if self.rows == 0:
            raise ValueError(
                f"rank {self.rank} of {self.size} has no rows to read: {path} has {self.rows_total} rows in "
                f"{len(groups)} row groups of {len(self._files)} files; run at most {self.rows_total} ranks, or "
                "write more rows (more partitions: partitions_per_process)")
        self._next_epoch = 0

    def _list_files(self, root: str) -> list:
        import pyarrow.fs as pafs

        info = self._fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"ParquetBatches: {self.path} does not exist")
        if info.type == pafs.FileType.File:
            return [root]
        found = self._fs.get_file_info(pafs.FileSelector(root, recursive=True))
        base = root.rstrip("/")
        files = sorted(i.path for i in found if i.type == pafs.FileType.File and i.path.endswith(".parquet")
                       and not any(p.startswith(("_", ".")) for p in i.path[len(base):].split("/") if p))
        if not files:
            raise ValueError(f"ParquetBatches: no Parquet files in {self.path}")
        return files

    def _check_columns(self, names: list) -> None:
        missing = [c for c in self.columns if c not in names]
        if missing or not self.columns:
            raise ValueError(f"ParquetBatches: {self.path} has no column {', '.join(map(repr, missing))} (its "
                             f"columns: {', '.join(names)})" if missing else "ParquetBatches: no columns given")

    @staticmethod
    def _cut(groups: list, size: int) -> list:
        """The row groups, the largest cut in halves until there are at least ``size`` pieces (or single rows)."""
        pieces = [list(g) for g in groups]
        while len(pieces) < size:
            i = max(range(len(pieces)), key=lambda j: pieces[j][3] - pieces[j][2], default=None)
            if i is None or pieces[i][3] - pieces[i][2] < 2:
                break
            f, g, start, stop = pieces[i]
            mid = (start + stop) // 2
            pieces[i:i + 1] = [[f, g, start, mid], [f, g, mid, stop]]
        return pieces

    def _parquet_file(self, f_idx: int):
        import pyarrow.parquet as pq

        held = self._open.get(f_idx)
        if held is None:
            if len(self._open) >= _OPEN_FILES:
                self._close(self._open.pop(next(iter(self._open))))
            handle = self._fs.open_input_file(self._files[f_idx])
            held = self._open[f_idx] = (pq.ParquetFile(handle), handle)
        return held[0]

    @staticmethod
    def _close(held) -> None:
        held[0].close()
        held[1].close()

    def _read(self, piece_idx: int) -> dict:
        """This rank's piece ``piece_idx`` as ``{column: numpy array}``."""
        if self._cached is not None and piece_idx in self._cached:
            return self._cached[piece_idx]
        f_idx, group, start, stop = self._pieces[piece_idx]
        table = self._parquet_file(f_idx).read_row_group(group, columns=self.columns)
        if start or stop != table.num_rows:
            table = table.slice(start, stop - start)
        chunk = {c: _to_numpy(table.column(c), c) for c in self.columns}
        if self._cached is not None:
            self._cached[piece_idx] = chunk
        return chunk

    def steps(self, rows_total: Optional[int] = None) -> int:
        """Steps per epoch, the same on every rank: ``max(1, rows_total // (batch_size * size))`` (default
        ``rows_total``: the dataset's rows)."""
        total = self.rows_total if rows_total is None else int(rows_total)
        return max(1, total // (self.batch_size * self.size))

    def __len__(self) -> int:
        return self.steps()

    def _chunks(self, rng) -> Iterator[dict]:
        """This rank's pieces, pass after pass without end, each pass in a new order when shuffling, its rows
        mixed in buffers of the shuffle buffer's size (a buffer never spans two passes)."""
        want = max(1, min(self.shuffle_buffer_size, self.rows))
        for _ in itertools.count():
            order = np.arange(len(self._pieces))
            if self.shuffle:
                rng.shuffle(order)
            if not self.shuffle or want == 1:
                yield from (self._read(int(i)) for i in order)
                continue
            buf, have = [], 0
            for n, i in enumerate(order):
                chunk = self._read(int(i))
                buf.append(chunk)
                have += _rows(chunk)
                if have >= want or n == len(order) - 1:
                    merged = _take(buf, have)
                    perm = rng.permutation(have)
                    yield {k: v[perm] for k, v in merged.items()}
                    buf, have = [], 0

    def epoch(self, epoch: int, steps: Optional[int] = None) -> Iterator[dict]:
        """The batches of epoch ``epoch``: ``steps`` of them (default :meth:`steps`), each ``batch_size`` rows.
        The same epoch number gives the same batches."""
        steps = self.steps() if steps is None else int(steps)
        if steps <= 0:
            return
        rng = np.random.default_rng([self.seed, int(epoch), self.rank])
        chunks = self._chunks(rng)
        pending, have, done = [], 0, 0
        for chunk in chunks:
            pending.append(chunk)
            have += _rows(chunk)
            while have >= self.batch_size:
                yield _take(pending, self.batch_size)
                have -= self.batch_size
                done += 1
                if done == steps:
                    return

    def __iter__(self) -> Iterator[dict]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        return self.epoch(epoch)

    def close(self) -> None:
        """Close the files this reader holds open (it reopens them if used again)."""
        for held in self._open.values():
            self._close(held)
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
