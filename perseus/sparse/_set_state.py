"""Per process set of the sparse paths: the hash seeds every rank agreed on, and the measured link.

:func:`set_state` looks a set up (raising what ``Runtime.process_set_info`` raises: TypeError for something
that is not a ProcessSet, ValueError for a set that is not registered or of which this rank is not a
member). :func:`ensure_seeds` and :func:`ensure_link` are collective the first time they run on a set: every
rank of the set must call them, in the same order; ensure_seeds raises MismatchError when the ranks compute
different partition hashes from the same seed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import numpy as np

from perseus.runtime.state import runtime
from perseus.base.exceptions import MismatchError
from perseus.base.reduce_ops import ReduceOp
from perseus.sparse import choice
from perseus.sparse.hashing import Seeds, h0_checksum
from perseus.runtime import collectives as c
from perseus.compression.base import CHECK_LEN, put_check, verify_check
from perseus.compression.profiling import fit_affine, probe_collective

log = logging.getLogger("perseus")

__all__ = ["SetState", "set_state", "settings", "ensure_seeds", "ensure_link"]


# -- per process set: agreed seeds, measured link ---------------------------------------------------------
class SetState:
    __slots__ = ("ps_id", "size", "rank", "root", "seeds", "link", "lock")

    def __init__(self, ps_id, size, rank, root):
        self.ps_id, self.size, self.rank, self.root = ps_id, size, rank, root
        self.seeds: Optional[Seeds] = None
        self.link: Optional[choice.Link] = None
        self.lock = threading.Lock()


_sets: dict = {}
_sets_lock = threading.Lock()


def set_state(process_set) -> SetState:
    st = runtime()
    ps_id, size, rank = st.process_set_info(process_set)
    with _sets_lock:
        ss = _sets.get(ps_id)
        if ss is None or ss.size != size:
            ss = _sets[ps_id] = SetState(ps_id, size, rank, st.process_set_ranks(ps_id)[0])
        return ss


def settings():
    return runtime().settings


def ensure_seeds(ss: SetState, process_set) -> Seeds:
    """The set's hash seeds: drawn on its first rank (or PERSEUS_ZEN_SEED), broadcast, and checked by an
    all-reduce of a digest of ``h0`` over a probe vector. Collective the first time on a set."""
    if ss.seeds is not None:
        return ss.seeds
    with ss.lock:
        if ss.seeds is not None:
            return ss.seeds

        cfg = settings()
        k = int(cfg.zen_hash_funcs)
        master = 0
        if ss.rank == 0:
            master = int(cfg.zen_seed) & 0x7FFFFFFFFFFFFFFF or \
                (int.from_bytes(os.urandom(8), "little") & 0x7FFFFFFFFFFFFFFF) or 1
        got = np.zeros(1, np.int64)
        c.synchronize(c.broadcast_async(np.array([master], np.int64), got, ss.root, name="perseus.sparse.seed",
                                        process_set=process_set))
        seeds = Seeds(int(got[0]), k)
        digest = h0_checksum(ss.size, seeds.h0)
        chk = np.zeros(CHECK_LEN, np.float32)
        put_check(chk, digest)
        out = np.empty_like(chk)
        c.synchronize(c.allreduce_async(chk, out, name="perseus.sparse.seed_check", op=ReduceOp.SUM,
                                        process_set=process_set))
        if not verify_check(out, digest, ss.size):
            raise MismatchError(
                "perseus.sparse: the ranks compute different partition hashes (h0) from the same seed; every "
                "rank must run the same perseus and NumPy versions (digest on this rank: "
                f"{digest:#010x})")
        ss.seeds = seeds
        return seeds


def _time_local():
    """(gamma, delta) on this machine: seconds per byte copied, per row sorted (best of 3)."""
    a = np.ones(1 << 20, np.float64)
    b = np.empty_like(a)
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    gamma = best / a.nbytes
    keys = np.random.default_rng(0).integers(0, 1 << 40, 1 << 16)
    best = np.inf
    for _ in range(3):
        t0 = time.perf_counter()
        np.argsort(keys, kind="stable")
        best = min(best, time.perf_counter() - t0)
    return gamma, best / keys.size


def ensure_link(ss: SetState, process_set) -> choice.Link:
    """The set's link and machine costs: timed all-reduces (unless both PERSEUS_SPARSE_LATENCY_US and
    PERSEUS_SPARSE_BANDWIDTH_MBIT are set) fitted on the first rank, with its copy and sort timings,
    broadcast to every rank. Collective the first time on a set."""
    if ss.link is not None:
        return ss.link
    with ss.lock:
        if ss.link is not None:
            return ss.link

        cfg = settings()
        lat_us, mbit = float(cfg.sparse_latency_us), float(cfg.sparse_bandwidth_mbit)
        latency = beta = None
        if ss.size > 1 and not (lat_us > 0 and mbit > 0):
            sizes = (4096, 256 << 10, 2 << 20)
            times = probe_collective("allreduce", process_set, sizes, repeats=3, tag="perseus.sparse.probe")
            a, b = fit_affine(list(sizes), times)
            latency, beta = a, b * ss.size / (2 * (ss.size - 1))
        if lat_us > 0:
            latency = lat_us * 1e-6
        if mbit > 0:
            beta = 8.0 / (mbit * 1e6)
        gamma, delta = _time_local()
        vec = np.array([latency if latency is not None else choice.DEFAULT_LINK.latency,
                        beta if beta is not None and beta > 0 else choice.DEFAULT_LINK.beta, gamma, delta],
                       np.float64)
        out = np.empty_like(vec)
        c.synchronize(c.broadcast_async(vec, out, ss.root, name="perseus.sparse.link", process_set=process_set))
        ss.link = choice.Link(*(float(v) for v in out))
        if ss.rank == 0:
            log.info("perseus.sparse: link %.1f us per collective, %.3g ns/B; local %.3g ns/B, %.3g ns/row sorted",
                     ss.link.latency * 1e6, ss.link.beta * 1e9, ss.link.gamma * 1e9, ss.link.delta * 1e9)
        return ss.link
