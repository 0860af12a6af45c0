"""PowerSGD: rank-r approximation of each gradient matrix by one step of subspace iteration (Vogels et al.,
2019), with error feedback.

Each array of two or more dimensions is viewed as a matrix M of shape ``(shape[0], prod(shape[1:]))``; a
matrix worth compressing (see ``min_compression_rate``) travels as two thin factors, everything else (1-D
arrays, small or thin matrices) travels dense. Per step and key, two allreduces (Sum):

1. ``P_i = M_i Q_i`` for every compressed matrix, with ``Q_i`` (``cols x r``) kept from the previous step
   (warm start; the first ``Q_i`` comes from a generator seeded alike on every rank), summed together with
   the dense parts and a size check: ``[P_1 .. P_j, dense parts, check (16)]``. The summed ``P_i`` is the
   same on every rank; each rank orthonormalises it (QR) into ``P^_i``, identically.
2. ``Q_i = M_i^T P^_i``, summed: ``[Q_1 .. Q_j]``.

The result is ``P^_i (sum_r Q_i,r)^T = sum_r P^_i P^_i^T M_i,r``: each rank's matrix projected onto the same
r-dimensional column space, summed. The summed ``Q_i`` is the next step's ``Q_i``.

Error feedback: rank r keeps ``M_i,r - P^_i Q_i,r^T``, the part of *its own* matrix outside the shared
column space (dense parts leave nothing). By linearity ``P^_i Q_i,r^T`` is exactly rank r's share of the
result, so "what a rank sent plus its residual is what it had to send" holds per rank, as for every other
compressor here, and the residual, an orthogonal projection of the rank's own matrix, is never larger than
that matrix. PyTorch's hook keeps ``M_i,r`` minus the *average* approximation instead; the sum of the
residuals over the ranks (all that the training sees) is the same, but each rank's residual then also
carries that rank's gradient minus the mean, which adds up step after step like a random walk. The price is
one extra ``P^ Q_r^T`` product per matrix, computed while the second allreduce is on the wire.

The second round starts as soon as the first finishes, from a perseus thread, whatever order the caller
waits for its keys in: ranks that wait for different keys first cannot block each other.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Optional

import numpy as np

from perseus.runtime.process_sets import ProcessSet
from perseus.base.reduce_ops import ReduceOp
from perseus.compression.base import CHECK_LEN, KeyState, Reducer, key_hash, put_check, signature, verify_check
from perseus.runtime import collectives as c

__all__ = ["PowerSGD"]


class _Plan:
    """How one key's arrays travel: the compressed matrices and the dense segments, with their places in
    the flat gradient and in the round buffers."""

    __slots__ = ("mats", "dense", "p_len", "q_len", "dense_len")

    def __init__(self, shapes, rank: int, min_rate: float):
        self.mats = []  # (offset in the flat gradient, rows, cols, r, offset in P, offset in Q)
        self.dense = []  # (offset in the flat gradient, length, offset in the round-1 buffer after the Ps)
        runs = []
        off = p_off = q_off = 0
        for shape in shapes:
            size = int(np.prod(shape, dtype=np.int64))
            if len(shape) >= 2 and size:
                rows = int(shape[0])
                cols = size // rows
                r = min(rank, rows, cols)
                if rows * cols >= min_rate * (rows + cols) * r:
                    self.mats.append((off, rows, cols, r, p_off, q_off))
                    p_off += rows * r
                    q_off += cols * r
                    off += size
                    continue
            if size:
                if runs and runs[-1][0] + runs[-1][1] == off:  # merge neighbouring dense arrays
                    runs[-1][1] += size
                else:
                    runs.append([off, size])
            off += size
        self.p_len, self.q_len = p_off, q_off
        d_off = 0
        for start, length in runs:
            self.dense.append((start, length, p_off + d_off))
            d_off += length
        self.dense_len = d_off


class _Worker:
    """One daemon thread that runs second rounds as their first rounds finish (jobs are queued by the
    engine's completion callbacks, which must stay short)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def put(self, job) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="perseus-powersgd", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            self._queue.get()()


_worker = _Worker()


def orthonormalize(p: np.ndarray) -> np.ndarray:
    """Replace the columns of the float32 matrix ``p`` (rows >= cols), in place, by an orthonormal basis of
    a space containing them (Householder QR in float64; deterministic: identical inputs give identical
    outputs). Zero or dependent columns still come out as orthonormal columns."""
    q, _ = np.linalg.qr(p.astype(np.float64), mode="reduced")
    np.copyto(p, q, casting="same_kind")
    return p


class PowerSGD(Reducer):
    """Send each gradient matrix as two rank-``rank`` factors (two allreduces per step).

    Args:
        rank: the approximation rank r (>= 1); a matrix with fewer rows or columns uses that many.
        min_compression_rate: a matrix is compressed only if ``rows * cols >= min_compression_rate *
            (rows + cols) * r`` (it saves at least that factor); others, and 1-D arrays, are sent dense.
        error_feedback: keep what the approximation missed (default True; see the module docstring).
        seed: a non-negative int that, with the key's name, seeds the first ``Q`` of every matrix. Every rank
            must use the same seed.

    Collective: every rank reduces the same keys with arrays of the same shapes and the same settings.

    Payloads: round 1 float32 ``[P_1 .. P_j (rows x r each, row-major), dense parts, size check (16)]``,
    round 2 float32 ``[Q_1 .. Q_j (cols x r each)]``, both summed (collective names ``powersgd.<key>.p``
    and ``powersgd.<key>.q``). ``payload_bytes`` counts both.

    Raises:
        ValueError: rank < 1, a min_compression_rate that is not positive, or a negative or non-integer seed.
        MismatchError: (from the wait, on every rank) the ranks' arrays under one name differ in shape, or
            the ranks use different settings.
    """

    kind = "powersgd"

    def __init__(self, rank: int = 4, min_compression_rate: float = 2, error_feedback: Optional[bool] = None,
                 seed: int = 0):
        super().__init__(error_feedback)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"perseus: Compression.powersgd(rank): an int >= 1, got {rank!r}")
        min_compression_rate = float(min_compression_rate)
        if not min_compression_rate > 0 or not math.isfinite(min_compression_rate):
            raise ValueError("perseus: Compression.powersgd(min_compression_rate=): a positive number, got "
                             f"{min_compression_rate}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"perseus: Compression.powersgd(seed=): a non-negative int, got {seed!r}")
        self.rank = int(rank)
        self.min_compression_rate = min_compression_rate
        self.seed = int(seed)

    def _describe(self) -> str:
        return (f"rank={self.rank}, min_compression_rate={self.min_compression_rate}, "
                f"error_feedback={self.error_feedback}, seed={self.seed}")

    # -- the arithmetic, one step of one rank (the collectives are in _submit) ---------------------------
    def plan(self, st: KeyState) -> _Plan:
        """The key's layout (made on first use, with its buffers)."""
        ex = st.extra
        plan = ex.get("plan")
        if plan is None:
            shapes = st.shapes or ((st.size,),)
            plan = _Plan(shapes, self.rank, self.min_compression_rate)
            n1 = plan.p_len + plan.dense_len + CHECK_LEN
            ex["send1"] = np.empty(n1, np.float32)
            ex["recv1"] = np.empty(n1, np.float32)
            ex["send2"] = np.empty(plan.q_len, np.float32)
            ex["q"] = np.empty(plan.q_len, np.float32)  # the summed Q: next step's warm start
            ex["dense"] = np.empty(st.size, np.float32)
            ex["sig"] = signature("powersgd", tuple(st.shapes), self.rank, self.min_compression_rate, self.seed)
            for i in range(len(plan.mats)):
                self._draw_q(st, plan, i, 0)
            ex["plan"] = plan
        return plan

    def _draw_q(self, st: KeyState, plan: _Plan, i: int, step: int) -> None:
        _, _, cols, r, _, q_off = plan.mats[i]
        rng = np.random.default_rng([self.seed, key_hash(st.key), i, step])
        q = st.extra["q"][q_off:q_off + cols * r].reshape(cols, r)
        q[...] = rng.standard_normal((cols, r), dtype=np.float32)

    @staticmethod
    def _views(acc: np.ndarray, plan: _Plan, i: int, buf1: np.ndarray, buf2: np.ndarray):
        """``(M, P, Q)`` of matrix i: views of ``acc``, of a round-1 and of a round-2 buffer."""
        off, rows, cols, r, p_off, q_off = plan.mats[i]
        return (acc[off:off + rows * cols].reshape(rows, cols),
                buf1[p_off:p_off + rows * r].reshape(rows, r),
                buf2[q_off:q_off + cols * r].reshape(cols, r))

    def round1(self, acc: np.ndarray, st: KeyState) -> np.ndarray:
        """This rank's round-1 payload (``st.extra['send1']``): ``M_i Q_i``, the dense parts, the check."""
        plan = self.plan(st)
        ex = st.extra
        send1, q = ex["send1"], ex["q"]
        for i in range(len(plan.mats)):
            m, p, qi = self._views(acc, plan, i, send1, q)
            if not qi.any():  # a zero Q (after an all-zero gradient) would stay zero: draw a new one
                self._draw_q(st, plan, i, st.step + 1)
            np.matmul(m, qi, out=p)
        for off, length, d_off in plan.dense:
            send1[d_off:d_off + length] = acc[off:off + length]
        put_check(send1[plan.p_len + plan.dense_len:], ex["sig"])
        return send1

    def round2(self, acc: np.ndarray, st: KeyState) -> np.ndarray:
        """From the summed round 1 (``st.extra['recv1']``, checked): orthonormalise each ``P`` in place and
        return this rank's round-2 payload (``st.extra['send2']``): ``M_i^T P^_i``."""
        plan = st.extra["plan"]
        ex = st.extra
        recv1, send2 = ex["recv1"], ex["send2"]
        for i in range(len(plan.mats)):
            m, p, qi = self._views(acc, plan, i, recv1, send2)
            orthonormalize(p)
            np.matmul(m.T, p, out=qi)
        return send2

    def feedback(self, acc: np.ndarray, st: KeyState) -> None:
        """Leave in ``acc`` what this rank did not send: ``M_i - P^_i Q_i^T`` (its own Q) and zero for the
        dense parts. Uses the key's output buffer as scratch."""
        plan = st.extra["plan"]
        ex = st.extra
        recv1, send2, dense = ex["recv1"], ex["send2"], ex["dense"]
        for i in range(len(plan.mats)):
            m, p, qi = self._views(acc, plan, i, recv1, send2)
            off, rows, cols = plan.mats[i][:3]
            approx = dense[off:off + rows * cols].reshape(rows, cols)
            np.matmul(p, qi.T, out=approx)
            m -= approx
        for off, length, _ in plan.dense:
            acc[off:off + length] = 0.0

    def result(self, st: KeyState) -> np.ndarray:
        """The dense sum from the summed rounds: ``P^_i Q_i^T`` (the summed Q) and the summed dense parts."""
        plan = st.extra["plan"]
        ex = st.extra
        recv1, q, dense = ex["recv1"], ex["q"], ex["dense"]
        for i in range(len(plan.mats)):
            out, p, qi = self._views(dense, plan, i, recv1, q)
            np.matmul(p, qi.T, out=out)
        for off, length, d_off in plan.dense:
            dense[off:off + length] = recv1[d_off:d_off + length]
        return dense

    def check(self, st: KeyState) -> None:
        """Raise MismatchError (every rank does) unless every rank's round 1 had the same layout."""
        plan = st.extra["plan"]
        if not verify_check(st.extra["recv1"][plan.p_len + plan.dense_len:], st.extra["sig"], st.set_size):
            raise self._mismatch(st, "the shapes (or the compressor's settings)")

    # -- the collectives -------------------------------------------------------------------------------
    def _count(self, nbytes: int) -> None:
        with self._lock:  # second rounds count from the worker thread
            self.payload_bytes += nbytes

    def _submit(self, key: str, st: KeyState, acc: np.ndarray, process_set: ProcessSet, set_size: int):
        send1 = self.round1(acc, st)
        ex = st.extra
        st.step += 1
        h1 = c.allreduce_async(send1, ex["recv1"], name=f"{self.kind}.{key}.p", op=ReduceOp.SUM,
                               process_set=process_set)
        self._count(send1.nbytes)
        done = threading.Event()
        box = {}

        def second_round():
            try:
                c.synchronize(h1)
                self.check(st)
                if ex["plan"].mats:
                    send2 = self.round2(acc, st)
                    box["h2"] = c.allreduce_async(send2, ex["q"], name=f"{self.kind}.{key}.q",
                                                  op=ReduceOp.SUM, process_set=process_set)
                    self._count(send2.nbytes)
                if self.error_feedback:
                    self.feedback(acc, st)
            except BaseException as exc:  # noqa: BLE001 - raised by the wait
                box["exc"] = exc
            finally:
                done.set()

        c.on_done([h1], lambda: _worker.put(second_round))

        def collect():
            done.wait()
            if "exc" in box:
                raise box["exc"]
            if "h2" in box:
                c.synchronize(box["h2"])
            return self.result(st)
        return collect
