"""Even partitions, shared by the engine, the transport and the framework modules."""

from __future__ import annotations

from typing import Sequence, TypeVar

__all__ = ["even_counts", "split_list"]

T = TypeVar("T")


def even_counts(total: int, parts: int) -> list[int]:
    """Split ``total`` items into ``parts`` counts that differ by at most one, the larger ones first.

    This is how reducescatter assigns rows to ranks and how the ring splits a buffer into segments.

    Raises:
        ValueError: ``parts`` is not positive.
    """
    if parts <= 0:
        raise ValueError(f"cannot split {total} items into {parts} parts; the number of parts must be positive")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_list(items: Sequence[T], n: int) -> list[Sequence[T]]:
    """Split ``items`` into ``n`` contiguous chunks whose lengths differ by at most one (earlier chunks longer;
    chunks may be empty when there are fewer items than chunks)."""
    out, start = [], 0
    for count in even_counts(len(items), n):
        out.append(items[start:start + count])
        start += count
    return out
