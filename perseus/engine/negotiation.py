"""Stage 2: decentralised negotiation. No rank coordinates; every rank computes the same answer.

Each tensor name gets a global index, agreed by all ranks of a process set, together with its
:class:`Signature`. One negotiation round is a bitwise-AND all-reduce of a word vector:

* word 0 carries flags. ``NO_EXCHANGE`` and ``NOT_DIRTY`` are active-low, so after the AND they are clear if
  *any* rank cleared them; ``JOINED`` is active-high, so it stays set only if *every* rank has joined.
* then one readiness bit per index: set when this rank has that tensor pending with the signature on
  record (a joined rank sets every bit, since it will contribute zeros to anything);
* then the complement of this rank's real submissions, so that the AND yields NOT(any rank submitted it).
  A tensor is ready iff its readiness bit survives and at least one rank really submitted it (otherwise a
  job in which every rank has joined would find every known tensor "ready").

When any rank has a name without an index, or a signature that differs from the record, every rank follows
the AND with an all-gather of its whole pending list (name and signature). From those lists every rank assigns
new indices in the same order, finds the names now ready everywhere and the names whose signatures disagree,
and raises the same error for them. In steady state a training step costs one small AND per round.
"""

from __future__ import annotations

import heapq
import pickle
from typing import Iterable, Optional

import numpy as np

from perseus.engine.messages import Entry, Signature

__all__ = ["Registry", "Negotiator", "RoundResult", "FLAG_NO_EXCHANGE", "FLAG_NOT_DIRTY", "FLAG_JOINED",
           "FLAG_NONE_JOINED"]

FLAG_NO_EXCHANGE = np.uint64(1 << 0)
FLAG_NOT_DIRTY = np.uint64(1 << 1)
FLAG_JOINED = np.uint64(1 << 2)
FLAG_NONE_JOINED = np.uint64(1 << 3)
_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)


class Registry:
    """Name ↔ index ↔ signature, identical on every rank of a process set.

    Bounded like Horovod's response cache: :meth:`evict` drops the least recently used names beyond a
    capacity. Every rank evicts the same names (use is counted in agreed rounds) and reuses the lowest freed
    index first, so indices stay identical everywhere; an evicted name that comes back is simply negotiated
    again.
    """

    def __init__(self):
        self.index: dict[str, int] = {}
        self.names: list[Optional[str]] = []
        self.signatures: list[Optional[Signature]] = []
        self.last_used: list[int] = []
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.names)

    @property
    def live(self) -> int:
        return len(self.index)

    def add(self, name: str, signature: Signature, round_: int = 0) -> int:
        if self._free:
            idx = heapq.heappop(self._free)
            self.names[idx], self.signatures[idx], self.last_used[idx] = name, signature, round_
        else:
            idx = len(self.names)
            self.names.append(name)
            self.signatures.append(signature)
            self.last_used.append(round_)
        self.index[name] = idx
        return idx

    def touch(self, names: Iterable[str], round_: int) -> None:
        for name in names:
            self.last_used[self.index[name]] = round_

    def evict(self, capacity: int) -> list[str]:
        """Drop the least recently used names until at most ``max(capacity, 0)`` remain; return them."""
        excess = self.live - max(capacity, 0)
        if excess <= 0:
            return []
        victims = sorted(self.index.values(), key=lambda i: (self.last_used[i], i))[:excess]
        dropped = []
        for idx in victims:
            name = self.names[idx]
            dropped.append(name)
            del self.index[name]
            self.names[idx] = self.signatures[idx] = None
            heapq.heappush(self._free, idx)
        return dropped

    @property
    def bit_words(self) -> int:
        return (len(self.names) + 63) // 64

    @property
    def num_words(self) -> int:
        return 1 + 2 * self.bit_words


class RoundResult:
    """What one round decided, identically on every rank."""

    __slots__ = ("ready", "errors", "any_dirty", "all_joined", "any_joined", "exchanged")

    def __init__(self):
        self.ready: list[str] = []              # names, in execution order
        self.errors: dict[str, str] = {}        # name -> message, raised on every rank
        self.any_dirty = False
        self.all_joined = False
        self.any_joined = False
        self.exchanged = False


class Negotiator:
    """Builds this rank's words for a round and turns the reduced words (and exchange lists) into a result."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.registry = Registry()
        self._words = np.zeros(1, np.uint64)

    def build_words(self, pending: dict[str, Entry], dirty: bool, joined: bool) -> tuple[np.ndarray, bool]:
        """Return ``(words, needs_exchange)`` for this rank. ``words`` is reused between rounds."""
        n, nb = self.registry.num_words, self.registry.bit_words
        if self._words.size != n:
            self._words = np.zeros(n, np.uint64)
        words = self._words
        ready, mine = words[1:1 + nb], words[1 + nb:]
        needs_exchange = False
        ready[:] = 0
        index, sigs = self.registry.index, self.registry.signatures
        for name, entry in pending.items():
            idx = index.get(name)
            if idx is None or sigs[idx] != entry.signature:
                needs_exchange = True
            else:
                ready[idx >> 6] |= np.uint64(1 << (idx & 63))
        np.invert(ready, out=mine)
        if joined:
            ready[:] = _ALL_ONES
        flags = np.uint64(0)
        if not needs_exchange:
            flags |= FLAG_NO_EXCHANGE
        if not dirty:
            flags |= FLAG_NOT_DIRTY
        if joined:
            flags |= FLAG_JOINED
        else:
            flags |= FLAG_NONE_JOINED
        words[0] = flags
        return words, needs_exchange

    def decode(self, words: np.ndarray) -> tuple[RoundResult, bool]:
        """Interpret the reduced words; return ``(result, exchange_needed)``."""
        result = RoundResult()
        flags = words[0]
        result.any_dirty = not bool(flags & FLAG_NOT_DIRTY)
        result.all_joined = bool(flags & FLAG_JOINED)
        result.any_joined = not bool(flags & FLAG_NONE_JOINED)
        nb = self.registry.bit_words
        bits = words[1:1 + nb] & ~words[1 + nb:1 + 2 * nb]
        ready = []
        for w in np.flatnonzero(bits):
            word = int(bits[w])
            base = int(w) * 64
            while word:
                low = word & -word
                idx = base + low.bit_length() - 1
                if idx < len(self.registry):
                    ready.append(idx)
                word ^= low
        result.ready = [self.registry.names[i] for i in ready]
        return result, not bool(flags & FLAG_NO_EXCHANGE)

    @staticmethod
    def exchange_payload(pending: dict[str, Entry], joined: bool) -> bytes:
        return pickle.dumps((joined, [(name, e.signature) for name, e in pending.items()]),
                            protocol=pickle.HIGHEST_PROTOCOL)

    def apply_exchange(self, result: RoundResult, payloads: list[bytes], rank_names: Optional[list] = None,
                       round_: int = 0) -> None:
        """Merge every rank's pending list into ``result``: new indices, newly ready names, mismatches.

        ``rank_names`` maps a position in the process set to the rank number shown in messages.
        """
        result.exchanged = True
        lists = [pickle.loads(p) for p in payloads]
        active = {r for r, (joined, _) in enumerate(lists) if not joined}
        seen: dict[str, dict[int, Signature]] = {}
        for r, (_, items) in enumerate(lists):
            for name, sig in items:
                seen.setdefault(name, {})[r] = sig
        already = set(result.ready)
        for name, by_rank in seen.items():  # insertion order: rank 0's order first, the same on every rank
            groups: dict[Signature, list[int]] = {}
            for r, sig in by_rank.items():
                groups.setdefault(sig, []).append(r)
            complete = active.issubset(by_rank)
            if len(groups) > 1:
                if complete:  # wait until every rank has submitted, so that every rank raises together
                    result.errors[name] = _mismatch_message(name, groups, rank_names)
                continue
            (sig,) = groups
            idx = self.registry.index.get(name)
            if complete:
                if idx is None:
                    self.registry.add(name, sig, round_)
                else:
                    self.registry.signatures[idx] = sig
                if name not in already:
                    result.ready.append(name)
                    already.add(name)
            elif idx is None:
                self.registry.add(name, sig, round_)
        result.ready = [n for n in result.ready if n not in result.errors]

    def reject_while_joined(self, result: RoundResult) -> None:
        """While any rank has joined, only allreduce can run (joined ranks contribute zeros): every other
        ready collective fails on every rank, as in Horovod."""
        if not result.any_joined:
            return
        idx, sigs = self.registry.index, self.registry.signatures
        keep = []
        for name in result.ready:
            op = sigs[idx[name]].op_type
            if op.name == "ALLREDUCE":
                keep.append(name)
            else:
                result.errors[name] = (
                    f"perseus.{op.name.lower()}({name!r}): one or more ranks have called join(); only allreduce "
                    f"can run until every rank has joined. Call {op.name.lower()} before join() on every rank.")
        result.ready = keep

    def order(self, names: Iterable[str]) -> list[str]:
        """Execution order: higher priority first, then by index (first-submitted first)."""
        idx, sigs = self.registry.index, self.registry.signatures
        return sorted(names, key=lambda n: (-sigs[idx[n]].priority, idx[n]))


def _mismatch_message(name: str, groups: dict[Signature, list[int]], rank_names) -> str:
    show = (lambda rs: [rank_names[r] for r in rs]) if rank_names else (lambda rs: rs)
    (sig_a, ranks_a), (sig_b, ranks_b) = list(groups.items())[:2]
    field, a, b = sig_a.describe_difference(sig_b)
    op = sig_a.op_type.name.lower() if field != "op_type" else "collective"
    fix = {
        "shape": "every rank must submit the same shape for a name",
        "dtype": "every rank must submit the same dtype for a name",
        "op_type": "every rank must call the same collective for a name",
        "reduce_op": "every rank must use the same op for a name",
        "root_rank": "every rank must pass the same root_rank",
        "prescale": "every rank must pass the same prescale_factor",
        "postscale": "every rank must pass the same postscale_factor",
        "priority": "every rank must pass the same priority",
    }[field]
    label = {"shape": "shape", "prescale": "prescale_factor", "postscale": "postscale_factor"}.get(field, field)
    if field == "shape" and sig_a.op_type.name in ("ALLGATHER", "ALLTOALL"):
        label, fix = "shape after the first dimension", "only the first dimension may differ between ranks"
    return (f"perseus.{op}({name!r}): ranks {show(ranks_b)} sent {label} {b} but ranks {show(ranks_a)} sent "
            f"{a}; {fix}.")
