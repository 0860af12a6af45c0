"""Hierarchical top-k (HiTopKComm): dense inside a host, sparse between hosts.

For H hosts of L ranks each, one gradient of n entries goes through three collectives:

1. a dense reduce-scatter (sum) among the L ranks of a host: local rank j receives its host's sum of
   shard j (about n / L entries);
2. on that shard, the ``k = ceil(density * shard)`` entries of largest magnitude are gathered among the
   H ranks that own shard j on their hosts (one sparse allgather of ``[values, int32 indices]`` per shard,
   the L shards of a host travelling at once, each on its own connections) and summed in host order;
3. a dense allgather among the L ranks of a host puts the shards back together.

Only step 2 crosses hosts, and it carries ``density * n`` (value, index) pairs per host instead of the
``2 (H-1)/H * n`` values a dense all-reduce sends out of every host: the saving is for slow links between
hosts while shared memory inside a host stays dense. With one host nothing is compressed (a dense
all-reduce); with one rank per host it is plain top-k between hosts.

Error feedback (per rank, full size): the residual is added to the gradient before the reduce-scatter;
afterwards a rank keeps, in the slice of the shard it owns, what it did not send, and zero elsewhere (the
other slices' mass went to their owners through the reduce-scatter). So what the job sent plus every
rank's residual equals what it had to send, whichever rank owns which slice.

The local and cross process sets are registered the first time the compressor is used; that call is
collective over the whole job (every rank reduces the same first gradient, as training does).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Optional

import numpy as np

from perseus.base.knobs import read_knob
from perseus.base.partition import even_counts
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import ReduceOp
from perseus.compression import selectors
from perseus.compression.base import KeyState, Reducer, signature
from perseus.compression.local_step import check_warmup, density_at
from perseus.compression.topk import sparse_sum
from perseus.runtime.state import runtime
from perseus.runtime import collectives as c

__all__ = ["HiTopK"]

_topology_lock = threading.Lock()
_topology: dict = {}


def _sets():
    """``(local set, cross set, hosts, ranks per host)`` for this job, registering the sets once per job.

    Raises:
        NotImplementedError: hosts with different numbers of ranks.
    """
    st = runtime()
    engine = st.engine
    with _topology_lock:
        cached = _topology.get(id(engine))
        if cached is not None and cached is not True:
            return cached
        base = st.base_comm
        me = st.rank()
        pairs = base.allgather((st.cross_rank(), st.local_rank()))
        hosts = 1 + max(c for c, _ in pairs)
        per_host = 1 + max(lr for _, lr in pairs)
        if len(pairs) != hosts * per_host:
            raise NotImplementedError(
                "perseus: Compression.hitopk needs the same number of ranks on every host "
                f"({len(pairs)} ranks over {hosts} hosts); use Compression.topk")
        local_of = {}
        for h in range(hosts):
            local_of[h] = sorted(r for r, (c, _) in enumerate(pairs) if c == h)
        cross_of = {}
        for j in range(per_host):
            cross_of[j] = sorted(r for r, (_, lr) in enumerate(pairs) if lr == j)
        made = {}
        # every rank registers every set in the same order (registration is collective over the job)
        for ranks in [local_of[h] for h in range(hosts)] + [cross_of[j] for j in range(per_host)]:
            key = tuple(ranks)
            if key in made:
                continue
            made[key] = st.register(ProcessSet(list(ranks)), hidden=True)
        mine_c, mine_l = pairs[me]
        result = (made[tuple(local_of[mine_c])], made[tuple(cross_of[mine_l])], hosts, per_host)
        if not _topology:
            _topology["registered"] = True
            st.register_job_state(_forget)
        _topology[id(engine)] = result
        return result


def _forget() -> None:
    """At shutdown: the sets die with the engine (they are registered anew by the next job)."""
    with _topology_lock:
        _topology.clear()
        _topology["registered"] = True


class HiTopK(Reducer):
    """Top-k between hosts, dense inside them (see the module docstring).

    Args:
        density: fraction of each host's shard sent between hosts, in (0, 1].
        error_feedback: keep what was not sent (default True).
        selector: as for :class:`perseus.compression.TopK`.
        warmup_steps, warmup_start: a density warm-up, as for :class:`perseus.compression.TopK`.
        momentum_correction: as for :class:`perseus.compression.TopK`. There is no momentum factor masking:
            a rank does not learn which of its entries left the host (its host's owner of each slice chose).

    Raises:
        ValueError: density outside (0, 1]; a process set other than the global one.
        NotImplementedError: hosts with different numbers of ranks.
    """

    kind = "hitopk"
    supports_local_step = True

    def __init__(self, density: float, error_feedback: Optional[bool] = None, selector: Optional[str] = None,
                 warmup_steps: int = 0, warmup_start: float = 0.25, momentum_correction: bool = True):
        super().__init__(error_feedback, momentum_correction, momentum_masking=False)
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError(f"perseus: Compression.hitopk(density): density must be in (0, 1], got {density}")
        self.density = density
        self.selector = selector or read_knob("topk_selector")[0]
        if self.selector != "auto" and self.selector not in selectors.SELECTORS:
            raise ValueError(f"perseus: unknown top-k selector {self.selector!r}")
        self.warmup_steps, self.warmup_start = check_warmup(warmup_steps, warmup_start, "Compression.hitopk")

    def _describe(self) -> str:
        warmup = f", warmup_steps={self.warmup_steps}, warmup_start={self.warmup_start}" if self.warmup_steps else ""
        return (f"density={self.density}, error_feedback={self.error_feedback}{warmup}, "
                f"momentum_correction={self.momentum_correction}")

    def _submit(self, key: str, st: KeyState, acc: np.ndarray, process_set: ProcessSet, set_size: int):
        if process_set is not global_process_set:
            raise ValueError("perseus: Compression.hitopk works on the global process set only")
        local, cross, hosts, per_host = _sets()
        if hosts == 1:  # nothing crosses a host: an exact dense all-reduce
            return self._submit_whole(key, st, acc, process_set)
        n = acc.size
        st.extra["density"] = density_at(self.density, st.step, self.warmup_steps, self.warmup_start) \
            if st.extra.get("ramp", True) else self.density
        st.step += 1
        name = f"{self.kind}.{key}"
        counts = even_counts(n, per_host)
        sig = st.extra.setdefault("sig", signature("hitopk", n, per_host))
        j = local.rank()
        lo = int(sum(counts[:j]))
        cnt = int(counts[j])
        if "shard" not in st.extra:
            st.extra["shard"] = np.empty(cnt, np.float32)
            st.extra["shard_sum"] = np.empty(cnt, np.float32)
            st.extra["mag"] = np.empty(cnt, np.float32)
            st.extra["dense"] = np.empty(n, np.float32)
            st.extra["selector"] = selectors.choice(max(cnt, 1), self.density, self.selector)
        h1 = None
        if per_host > 1:
            h1 = c.reducescatter_async(acc, lambda shape: st.extra["shard"], name=name + ".rs", op=ReduceOp.SUM,
                                       process_set=local)
            self.payload_bytes += acc.nbytes
        return functools.partial(self._collect, st, acc, name, h1, sig, (lo, cnt), (local, cross, per_host))

    def _collect(self, st: KeyState, acc: np.ndarray, name: str, h1, sig: int, owned: tuple, sets: tuple):
        """Finish one step: this host's reduce-scatter, the top-k of the owned slice exchanged between hosts,
        the summed slices gathered within the host. Returns the dense result. Collective over both sets.

        Raises:
            MismatchError: the hosts disagree about the tensor (its size); every rank raises.
        """
        (lo, cnt), (local, cross, per_host) = owned, sets
        shard = st.extra["shard"]
        if h1 is not None:
            self._finish_reduce_scatter(st, h1, name, sig, cross)
        else:
            shard[:] = acc
        k = max(1, min(cnt, math.ceil(st.extra["density"] * cnt))) if cnt else 0
        mag = st.extra["mag"]
        np.abs(shard, out=mag)
        idx = selectors.select(mag, k, st.extra["selector"]) if k else np.empty(0, np.int64)
        payload = np.empty(2 * k + 1, np.float32)
        np.take(shard, idx, out=payload[:k])
        payload[k:2 * k].view(np.int32)[:] = idx
        payload[2 * k:].view(np.uint32)[0] = sig
        if self.error_feedback:  # keep the unsent part of the owned slice, nothing elsewhere
            acc.fill(0.0)
            own = acc[lo:lo + cnt]
            own[:] = shard
            own[idx] = 0.0
        self.payload_bytes += payload.nbytes
        h2 = c.allgather_async(payload, lambda shape: np.empty(shape, np.float32), name=name + ".x",
                               process_set=cross)
        res = c.synchronize(h2)
        off = 0
        for length in res.received_splits:
            off += int(length)
            if length < 1 or res.output[off - 1:off].view(np.uint32)[0] != sig:
                raise self._mismatch(st, "the size")
        summed = sparse_sum(res.output, res.received_splits, st.extra["shard_sum"], trailer=1)
        dense = st.extra["dense"]
        if per_host == 1:
            dense[:] = summed
            return dense
        h3 = c.allgather_async(summed, lambda shape: dense, name=name + ".ag", process_set=local)
        c.synchronize(h3)
        self.payload_bytes += summed.nbytes
        return dense

    def _finish_reduce_scatter(self, st: KeyState, h1, name: str, sig: int, cross) -> None:
        """Wait for this host's reduce-scatter. If it failed (this host disagreed), still take part in the
        exchange between hosts, with a payload whose signature cannot match, so the other hosts' ranks fail
        too, naming the key, instead of waiting for a peer that has given up; then raise its error."""
        try:
            c.synchronize(h1)
        except Exception:
            poison = np.zeros(1, np.float32)
            poison.view(np.uint32)[0] = (sig + 1) & 0xFFFFFFFF
            try:
                c.synchronize(c.allgather_async(poison, lambda shape: np.empty(shape, np.float32),
                                                name=name + ".x", process_set=cross))
            except Exception:  # noqa: BLE001 - expected: it only releases the other hosts; the real error follows
                pass
            self._drop(st)
            raise
