"""Keyed 64-bit hashing for Zen, vectorised over NumPy uint64 arrays.

One mixer serves every hash Zen needs: ``mix64(x, seed)`` is the splitmix64 output function applied to
``x + (seed + 1) * 0x9E3779B97F4A7C15`` (mod 2**64), so ``mix64(x, 0)``, ``mix64(x, 1)``, ... are the
first outputs of a splitmix64 generator started at state ``x``; the published splitmix64 sequences are
therefore test vectors (tests/unit/test_sparse_zen.py checks them against a pure-Python version).

From one 64-bit master seed, agreed by every rank of a process set (the first rank draws it and
broadcasts it), :class:`Seeds` derives the partition hash ``h0`` (row -> owner rank) and the slot hashes
``h1..hk`` of the hierarchical hash partition. Only ``h0`` decides where a row goes; the slot hashes only
decide where it is parked on the way (see :mod:`perseus.sparse.zen`).
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

__all__ = ["GOLDEN", "mix64", "mix64_scalar", "reduce_range", "Seeds", "owner_of", "slot_of", "h0_checksum"]

GOLDEN = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def mix64(x, seed: int) -> np.ndarray:
    """The keyed mixer on an array of non-negative integers (any integer dtype): uint64 hashes."""
    x = np.asarray(x)
    if x.dtype != np.uint64:
        x = x.astype(np.uint64)  # int64 rows are >= 0: the same bits
    offset = np.uint64(((int(seed) + 1) * GOLDEN) & _MASK)
    z = x + offset
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def mix64_scalar(x: int, seed: int) -> int:
    """:func:`mix64` on one Python int (the reference the vectorised version is tested against)."""
    z = (int(x) + (int(seed) + 1) * GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def reduce_range(h: np.ndarray, m: int) -> np.ndarray:
    """Map uint64 hashes onto ``[0, m)`` by the high 32 bits times ``m`` (no modulo bias worth the name,
    no division): int64 results. ``m`` must be below 2**32."""
    if not 0 < m < (1 << 32):
        raise ValueError(f"perseus.sparse: a hash range must be in [1, 2**32), got {m}")
    return (((h >> np.uint64(32)) * np.uint64(m)) >> np.uint64(32)).astype(np.int64)


class Seeds:
    """The seeds of ``h0`` (partition) and ``h1..hk`` (slots), derived from one master seed."""

    __slots__ = ("master", "h0", "slots")

    def __init__(self, master: int, k: int = 3):
        self.master = int(master) & _MASK
        derived = [mix64_scalar(i, self.master) for i in range(1 + max(int(k), 1))]
        self.h0 = derived[0]
        self.slots: Sequence[int] = tuple(derived[1:])

    def __repr__(self) -> str:
        return f"Seeds(master={self.master:#x}, k={len(self.slots)})"


def owner_of(rows, n: int, seed: int) -> np.ndarray:
    """``h0``: the owner rank (0..n-1) of each row, int64. Depends on nothing but the row and the seed."""
    if n == 1:
        return np.zeros(np.shape(rows), np.int64)
    return reduce_range(mix64(rows, seed), n)


def slot_of(rows, r1: int, seed: int) -> np.ndarray:
    """A slot hash ``h_i``: a slot 0..r1-1 of the parallel region for each row, int64."""
    return reduce_range(mix64(rows, seed), r1)


def h0_checksum(n: int, seed: int, probe: int = 4096) -> int:
    """A 32-bit digest of ``h0`` over a fixed probe vector (small rows, rows near 2**31 and 2**40): ranks
    whose digests differ would send the same row to different owners."""
    rows = np.concatenate([np.arange(probe, dtype=np.int64),
                           np.arange(probe, dtype=np.int64) + (1 << 31) - probe // 2,
                           np.arange(probe, dtype=np.int64) * 7919 + (1 << 40)])
    return zlib.crc32(owner_of(rows, n, seed).astype("<i8").tobytes()) ^ (n * 2654435761 & 0xFFFFFFFF)
