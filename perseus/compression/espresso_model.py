"""Espresso's cost model and decision: link costs, measured codec costs, the timeline simulator and
Algorithm 4.1.

The model (a timeline simulator, :func:`simulate_timeline`):

* gradients in backward order; backward, encoding (the gradient hook) and decoding share one serial
  compute queue: gradient ``i`` is ready for the link after its backward and its encode;
* one link, first in first out, in ready order: a collective starts when its gradient is ready and the
  previous collective has finished;
* decoding runs after backward, in submission order, each once its collective has finished (the
  optimizer's ``synchronize()``); iteration time = forward + the end of the last decode;
* link costs are the alpha-beta models of the ring algorithms for ``p`` ranks (m: bytes per rank):
  all-reduce ``2(p-1) alpha + 2(p-1)/p m beta``, all-gather ``(p-1) alpha + (p-1) m beta``;
* encode (accumulate + encode), decode and payload bytes per option are affine in the dense bytes, measured
  on this machine on random data (4 KB to 4 MB, best of 3 runs, cached per process).

The decision is the thesis's Algorithm 4.1 (:func:`decide`): start with every gradient dense; visit the
gradients by size, largest first (equal sizes: the one ready first, nearest the output, first); for each
try every option and keep the one with the least simulated iteration time (ties keep the current one);
after every decision, drop from the candidates the still-dense gradients whose collective comes before the
last bubble of the link (compressing them cannot shorten the iteration). The thesis's CPU offloading
(Algorithm 4.2) is not needed here: compression already runs on the CPU, on the thread that runs backward,
and there is no second device to offload to.

Local: no collective (:class:`~perseus.compression.espresso.Espresso` decides on one rank and
broadcasts). :func:`measure_codec` touches no state of the compressor it times. Nothing here raises errors
of its own.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import numpy as np

from perseus.compression.base import KeyState, Reducer
from perseus.compression.profiling import fit_affine

__all__ = ["allreduce_time", "allgather_time", "simulate_timeline", "decide", "measure_codec"]


# -- cost models -----------------------------------------------------------------------------------------------
def allreduce_time(nbytes, p: int, alpha: float, beta: float):
    """Ring all-reduce of ``nbytes`` per rank over ``p`` ranks: ``2(p-1) alpha + 2(p-1)/p nbytes beta``."""
    if p <= 1:
        return np.zeros_like(np.asarray(nbytes, np.float64))
    return 2 * (p - 1) * alpha + 2.0 * (p - 1) / p * np.asarray(nbytes, np.float64) * beta


def allgather_time(nbytes, p: int, alpha: float, beta: float):
    """Ring all-gather of ``nbytes`` from each of ``p`` ranks: ``(p-1) alpha + (p-1) nbytes beta``."""
    if p <= 1:
        return np.zeros_like(np.asarray(nbytes, np.float64))
    return (p - 1) * alpha + (p - 1) * np.asarray(nbytes, np.float64) * beta


def simulate_timeline(backward, encode, comm, decode, forward: float = 0.0, detail: bool = False):
    """The modelled iteration time (seconds) for per-gradient costs in backward order (see the module
    docstring); with ``detail``, also a dict of the link's start/end times and the compute end of backward.

    O(N), vectorised: ``end_i = max(ready_i, end_{i-1}) + comm_i`` is ``C_i + max_{j<=i}(ready_j - C_{j-1})``
    with ``C`` the running sum of the comm times (the same for the decodes).
    """
    b = np.asarray(backward, np.float64)
    e = np.asarray(encode, np.float64)
    c = np.asarray(comm, np.float64)
    d = np.asarray(decode, np.float64)
    if b.size == 0:
        return (float(forward), {"start": b, "end": b, "compute": 0.0}) if detail else float(forward)
    ready = np.cumsum(b + e)
    C = np.cumsum(c)
    end = C + np.maximum.accumulate(ready - (C - c))
    D = np.cumsum(d)
    done = D + np.maximum(ready[-1], np.maximum.accumulate(end - (D - d)))
    total = float(forward) + float(done[-1])
    if detail:
        return total, {"start": end - c, "end": end, "compute": float(ready[-1])}
    return total


def _last_bubble(start, end) -> int:
    """Index of the last collective that starts after the link sat idle (0 when none does)."""
    if start.size < 2:
        return 0
    idle = start[1:] > end[:-1] * (1 + 1e-12) + 1e-15
    hits = np.flatnonzero(idle)
    return int(hits[-1]) + 1 if hits.size else 0


def decide(elements, backward, encode, comm, decode, forward: float = 0.0, min_gain: float = 0.0) -> np.ndarray:
    """Algorithm 4.1: the option index per gradient (0 = the baseline, dense).

    Args:
        elements: size of each gradient (orders the visits: largest first, then backward order).
        backward: seconds of backward before each gradient is ready (after the previous one).
        encode, comm, decode: arrays of shape (options, gradients): each option's seconds per gradient.
        forward: seconds of forward pass.
        min_gain: a gradient leaves dense only for an option that shortens the modelled iteration by more
            than this many seconds (measured costs are noisy: a gain within the noise is no gain).
    """
    enc = np.asarray(encode, np.float64)
    com = np.asarray(comm, np.float64)
    dec = np.asarray(decode, np.float64)
    n_opt, n = enc.shape
    cols = np.arange(n)
    choice = np.zeros(n, np.int64)
    removed = np.zeros(n, bool)

    def run(ch, detail=False):
        return simulate_timeline(backward, enc[ch, cols], com[ch, cols], dec[ch, cols], forward, detail)

    def prune(ch):
        _, tl = run(ch, detail=True)
        last = _last_bubble(tl["start"], tl["end"])
        removed[:last] |= ch[:last] == 0

    cur = run(choice)
    prune(choice)
    order = sorted(range(n), key=lambda i: (-int(elements[i]), i))
    for i in order:
        if removed[i] or choice[i] != 0:
            continue
        best_o, best_t = 0, cur
        for o in range(1, n_opt):
            choice[i] = o
            t = run(choice)
            if t < best_t - max(1e-12 * max(1.0, abs(best_t)), min_gain):
                best_o, best_t = o, t
        choice[i] = best_o
        cur = best_t
        prune(choice)
    return choice


# -- measuring the options -------------------------------------------------------------------------------------
_codec_lock = threading.Lock()
_codec_cache: dict = {}


def measure_codec(reducer: Reducer, p: int, sizes: Sequence[int] = (1 << 10, 1 << 14, 1 << 17, 1 << 20),
                  repeats: int = 3) -> Optional[dict]:
    """Affine fits in the dense bytes ``x`` of ``reducer``'s encode (accumulate + encode) and decode seconds
    (the decode of ``p`` ranks' payloads) and of its payload bytes, from random data of ``sizes`` elements
    (best of ``repeats`` after one warm-up call). Cached per process by (type, parameters, p). None for a
    compressor that does not encode in one step (one without an ``_encode`` of its own, such as PowerSGD).

    Local: no collective; touches no state of ``reducer`` (a scratch per-key state is used).
    """
    cache_key = (type(reducer).__name__, reducer._describe(), int(p), tuple(sizes), int(repeats))
    with _codec_lock:
        if cache_key in _codec_cache:
            return _codec_cache[cache_key]
    if type(reducer)._encode is Reducer._encode:  # multi-round compressors have no single encode
        return None
    rng = np.random.default_rng(1234)
    xs, enc_t, dec_t, pay = [], [], [], []
    for n in sizes:
        grad = rng.standard_normal(int(n)).astype(np.float32)
        st = KeyState(int(n))
        best_e = best_d = np.inf
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            acc = reducer._accumulate(st, [grad], 1.0)
            payload, ctx = reducer._encode(acc, st)
            t1 = time.perf_counter()
            if reducer.collective == "allreduce":
                data, splits = payload.copy(), None
            else:
                data, splits = np.concatenate([payload] * max(1, p)), [payload.size] * max(1, p)
            t2 = time.perf_counter()
            reducer._decode(data, splits, ctx, st)
            t3 = time.perf_counter()
            if r:
                best_e, best_d = min(best_e, t1 - t0), min(best_d, t3 - t2)
        xs.append(4.0 * n)
        enc_t.append(best_e)
        dec_t.append(best_d)
        pay.append(float(payload.nbytes))
    fits = {"encode": fit_affine(xs, enc_t), "decode": fit_affine(xs, dec_t), "payload": fit_affine(xs, pay),
            "collective": reducer.collective}
    with _codec_lock:
        _codec_cache[cache_key] = fits
    return fits
