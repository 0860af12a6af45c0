"""Compressors that communicate: the framework-neutral base every lossy gradient compressor builds on.

Horovod's compressors (``Compression.fp16``) only change the dtype of a tensor before a normal allreduce.
The compressors here change *what* travels and *which collective* carries it (a sparse allgather of
(value, index) pairs, an allreduce of a few random coordinates, packed sign bits, low-rank factors), so each
one runs its own collective through the engine and hands back the dense reduced gradient.

Framework adapters pass NumPy views of their tensors (zero-copy for torch CPU tensors) to
:meth:`Reducer.reduce_async` and convert the result back; every compressor is written once, here.

Error feedback (``error_feedback=True``, the default for the biased compressors): per key (one gradient
or one fused group of gradients), each rank keeps a float32 residual of what it computed but did not send;
the next step adds it to the new gradient before compressing. What a rank sends plus its new residual is
exactly what it had to send (tests check this to the bit). :meth:`Reducer.reset` drops every residual (an
elastic reset calls it: the ranks of a new job start from none).
"""

from __future__ import annotations

import threading
import weakref
import zlib
from typing import Callable, Optional, Sequence

import numpy as np

from perseus.base.exceptions import MismatchError
from perseus.runtime.process_sets import ProcessSet, global_process_set
from perseus.base.reduce_ops import ReduceOp
from perseus.runtime.state import runtime
from perseus.runtime import collectives as c
from perseus.compression.local_step import LocalStep, apply_local_step, optional_spec

__all__ = ["Reducer", "Pending", "KeyState", "signature", "CHECK_LEN", "put_check", "verify_check",
           "key_hash"]


class KeyState:
    """What a compressor keeps for one key across steps: the residual, scratch buffers, a step counter.

    ``shapes`` are the shapes of the arrays given under the key (a new state is made when they change);
    ``set_size`` and ``rank`` are the process set's size and this rank's place in it, as of the latest call.
    """

    __slots__ = ("key", "size", "shapes", "residual", "scratch", "step", "extra", "set_size", "rank")

    def __init__(self, size: int, shapes: tuple = (), key: str = ""):
        self.key = key
        self.size = size
        self.shapes = shapes
        self.residual: Optional[np.ndarray] = None
        self.scratch: Optional[np.ndarray] = None
        self.step = 0
        self.extra: dict = {}
        self.set_size = 1
        self.rank = 0


def key_hash(key: str) -> int:
    """A hash of ``key`` that is the same in every process (Python's ``hash()`` of a str is salted)."""
    return zlib.crc32(key.encode("utf-8"))


def signature(*parts) -> int:
    """A 32-bit digest of what every rank must agree on for a key (its sizes, shapes, parameters)."""
    return zlib.crc32(repr(parts).encode("utf-8"))


#: float32 entries :func:`put_check` appends to a summed payload
CHECK_LEN = 16


def put_check(buf: np.ndarray, sig: int) -> None:
    """Write ``sig`` into the ``CHECK_LEN`` float32 entries ``buf`` so that, after a Sum over the ranks,
    :func:`verify_check` tells on *every* rank whether all ranks wrote the same ``sig``: the 8 hex digits
    d and their squares d*d. If every rank finds sum(d) == size*d_own and sum(d*d) == size*d_own**2 for
    each digit, the digits' variance over the ranks is zero, so they are all equal; if they are not all
    equal, no rank can find both equalities. The sums are exact in float32 up to 74,000 ranks."""
    digits = (np.uint32(sig) >> (np.arange(8, dtype=np.uint32) * 4)) & np.uint32(0xF)
    buf[:8] = digits
    buf[8:CHECK_LEN] = digits * digits


def verify_check(summed: np.ndarray, sig: int, set_size: int) -> bool:
    """True when every rank gave :func:`put_check` the same ``sig`` (``summed``: the Sum of the checks)."""
    own = np.empty(CHECK_LEN, np.float32)
    put_check(own, sig)
    own *= np.float32(set_size)
    return bool(np.array_equal(summed[:CHECK_LEN], own))


class Pending:
    """An in-flight compressed reduction; :meth:`wait` returns the dense outputs (a list, one per input).

    ``finish`` runs once, on the first :meth:`wait`, on the caller's thread.
    """

    __slots__ = ("_finish", "_result", "_error")

    def __init__(self, finish: Callable[[], list]):
        self._finish = finish
        self._result = None
        self._error = None

    def wait(self) -> list:
        """The dense results; raises what the reduction raised, on this and every later call."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._result = finish()
            except BaseException as exc:
                self._error = exc
                raise
        if self._error is not None:
            raise self._error
        return self._result


_live = weakref.WeakSet()
_live_lock = threading.Lock()
_registered = False


def _forget_at_shutdown(reducer) -> None:
    """Drop the reducer's residuals whenever the job shuts down (an elastic reset included), without keeping
    the reducer alive."""
    global _registered
    with _live_lock:
        _live.add(reducer)
        if _registered:
            return
        _registered = True

    def reset():
        with _live_lock:
            reducers = list(_live)
        for r in reducers:
            r.reset()
    runtime().register_job_state(reset)


class _Refused:
    """``compress``/``decompress``: a communicating compressor is not a plain compress/decompress pair.
    Called on an instance or on the class itself (``Compression.sign`` instead of ``Compression.sign()``),
    they raise TypeError saying what to do instead."""

    def __get__(self, obj, cls):
        def refuse(*_args, **_kwargs):
            if obj is None:
                raise TypeError(f"perseus: {cls.__name__} is a class of communicating compressors; pass an "
                                f"instance (e.g. Compression.{cls.kind}(...)) as compression=")
            raise TypeError(f"perseus: {obj!r} runs its own collective and cannot be used as a plain "
                            "compress/decompress pair; pass it as compression= to DistributedOptimizer, "
                            "DistributedGradientTape or allreduce")
        return refuse


def _flat_len(arrays: Sequence[np.ndarray]) -> int:
    return int(sum(a.size for a in arrays))


class Reducer:
    """Base of the communicating compressors. One instance serves every tensor given to it (its state is
    kept per key), so pass the same instance to one optimizer; instances are cheap.

    Subclasses implement :meth:`_encode` and :meth:`_decode` and set ``collective`` to ``"allgather"`` (each
    rank's payload is gathered, payload sizes may differ) or ``"allreduce"`` (payloads of the same shape are
    summed). Multi-round compressors (PowerSGD) override :meth:`_submit` instead.
    """

    #: name used in collective names, logs and reports
    kind = "compressed"
    #: "allgather" or "allreduce"
    collective = "allgather"
    #: the compressor is biased and keeps residuals unless told not to
    default_error_feedback = True
    #: the compressor takes a :class:`perseus.compression.local_step.LocalStep` (momentum correction, local
    #: clipping): a sparsifier whose residual accumulates what the rank owes
    supports_local_step = False

    def __init__(self, error_feedback: Optional[bool] = None, momentum_correction: bool = True,
                 momentum_masking: Optional[bool] = None):
        self.error_feedback = self.default_error_feedback if error_feedback is None else bool(error_feedback)
        #: apply the optimizer's momentum locally, before compressing (when the adapter finds momentum SGD)
        self.momentum_correction = bool(momentum_correction) and self.supports_local_step
        #: zero the velocity of the entries sent (momentum factor masking); None: the adapter decides (on
        #: for SGD, off for Adam, as measured in docs/compression.md)
        self.momentum_masking = None if momentum_masking is None else bool(momentum_masking)
        self._states: dict = {}
        self._lock = threading.Lock()
        #: payload bytes this rank submitted, cumulative (the transport's own counters give wire bytes)
        self.payload_bytes = 0
        #: bytes the same tensors would have taken uncompressed (float32), cumulative
        self.dense_bytes = 0
        _forget_at_shutdown(self)

    # -- the Horovod compressor interface, for code that calls it directly -----------------------------
    compress = decompress = _Refused()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"

    def _describe(self) -> str:
        return f"error_feedback={self.error_feedback}"

    def takes_momentum(self) -> bool:
        """Whether an adapter should move the wrapped optimizer's momentum into this compressor (momentum
        correction): the compressor supports it, keeps residuals, and was not told otherwise."""
        return self.momentum_correction and self.error_feedback

    def takes_local_step(self) -> bool:
        """Whether :meth:`reduce_async` accepts ``local=`` (momentum correction or local clipping)."""
        return self.supports_local_step and self.error_feedback

    def warmup(self) -> int:
        """The warm-up the user asked for, in steps (0: none); with Adam the adapters make it dense."""
        return int(getattr(self, "warmup_steps", 0))

    def note_dense(self, nbytes: int) -> None:
        """Count ``nbytes`` sent uncompressed by an adapter on this compressor's behalf (Adam's dense
        steps), in both byte counters."""
        self.payload_bytes += nbytes
        self.dense_bytes += nbytes

    # -- state -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every residual and per-key state (elastic reset; a new model)."""
        with self._lock:
            self._states.clear()

    def residual(self, key: str) -> Optional[np.ndarray]:
        """The float32 residual kept for ``key`` (flat; None without error feedback or before the first step)."""
        st = self._states.get(key)
        return None if st is None else st.residual

    def _state(self, key: str, size: int, shapes: tuple = ()) -> KeyState:
        with self._lock:
            st = self._states.get(key)
            if st is None or st.size != size or st.shapes != shapes:
                st = KeyState(size, shapes, key)
                self._states[key] = st
        return st

    def _drop(self, st: KeyState) -> None:
        """Forget the state ``st`` if it is still its key's (after a failed reduction the residual is not
        trustworthy: the part that was sent never arrived)."""
        with self._lock:
            if self._states.get(st.key) is st:
                del self._states[st.key]

    def _mismatch(self, st: KeyState, what: str) -> MismatchError:
        """The error every rank raises when the ranks' payloads show that they disagree about ``st``'s key
        (its state is dropped)."""
        key = st.key
        self._drop(st)
        shapes = ", ".join(str(tuple(s)) for s in st.shapes) or str(st.size)
        return MismatchError(
            f"perseus: {type(self).__name__}: ranks disagree about {what} of {key!r} (this rank has shapes "
            f"[{shapes}], {st.size} elements, and {self!r}); every rank must pass the same tensors, in the same "
            "shapes, to the same compressor settings")

    # -- the work --------------------------------------------------------------------------------------
    def reduce_async(self, key: str, arrays: Sequence[np.ndarray], outputs: Optional[Sequence[np.ndarray]] = None,
                     op=ReduceOp.AVERAGE, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, local: Optional[LocalStep] = None) -> Pending:
        """Compress ``arrays`` (one gradient, or a fused group compressed as one vector) and start the
        collective; the returned :class:`Pending` gives the dense sum or average, one array per input.

        ``outputs``, when given, receive the results (they may be the inputs themselves); else new arrays
        of the inputs' shapes and dtypes are made. Floating-point inputs only; they are compressed in float32.

        ``local`` (a :class:`perseus.compression.local_step.LocalStep`): momentum correction and/or local
        clipping before compression (perseus/compression/local_step.py); the result is then the averaged
        *update* (velocity), to be applied without momentum. Only for compressors where
        :meth:`takes_local_step` is true.

        Collective: every rank of ``process_set`` calls it with the same ``key``, the same number of arrays
        and the same sizes, in any order relative to other keys.

        Raises:
            ValueError: no key, a non-float input, an op other than Sum/Average, ``local`` given to a
                compressor that does not take it (or a momentum outside [0, 1)).
            MismatchError (a HorovodInternalError), from :meth:`Pending.wait` on every rank: the ranks
                disagree about the sizes (or shapes, or the compressor's parameters) under ``key``; the
                key's residual is dropped.
        """
        if not key:
            raise ValueError(f"perseus: {type(self).__name__} keeps state per tensor and needs a name; pass "
                             "name= (DistributedOptimizer names gradients after their parameters)")
        op = ReduceOp(op)
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise ValueError(f"perseus: {type(self).__name__} reduces with Sum or Average only, not {op.name}")
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.dtype.kind != "f" and a.dtype != np.uint16:
                raise ValueError(f"perseus: {type(self).__name__} compresses floating-point gradients only; "
                                 f"{key!r} is {getattr(a, 'dtype', type(a).__name__)}")
        local = optional_spec(local)
        if local is not None and not self.takes_local_step():
            raise ValueError(f"perseus: {self!r} does not take a local step (momentum correction, local "
                             "clipping): only top-k, hierarchical top-k and random-k with error feedback do")

        _, set_size, rank = runtime().process_set_info(process_set)
        n = _flat_len(arrays)
        st = self._state(key, n, tuple(tuple(a.shape) for a in arrays))
        st.set_size, st.rank = set_size, rank
        st.extra["ramp"] = local is None or local.ramp
        acc = self._accumulate(st, arrays, prescale_factor, local)
        scale = postscale_factor / set_size if op == ReduceOp.AVERAGE else postscale_factor
        self.dense_bytes += 4 * n
        try:
            collect = self._submit(key, st, acc, process_set, set_size)
        except BaseException:
            self._drop(st)
            raise

        def finish():
            try:
                dense = collect()
            except BaseException:
                self._drop(st)
                raise
            return self._scatter(dense, arrays, outputs, scale)
        return Pending(finish)

    def _accumulate(self, st: KeyState, arrays, prescale: float, local: Optional[LocalStep] = None) -> np.ndarray:
        """The flat float32 vector to compress: the (prescaled) inputs plus the residual. With error feedback
        it *is* the residual buffer, which :meth:`_encode` leaves holding what was not sent. With ``local``,
        the inputs go through the local step (clipping, velocity) before they are added."""
        n = st.size
        if local is not None:
            if st.residual is None:
                st.residual = np.zeros(n, np.float32)
            grad = self._gather(st, arrays, prescale)
            apply_local_step(st, grad, st.residual, local)
            return st.residual
        if self.error_feedback:
            if st.residual is None:
                st.residual = np.zeros(n, np.float32)
            acc = st.residual
            off = 0
            for a in arrays:
                flat = _as_float(a).reshape(-1)
                if prescale != 1.0:
                    acc[off:off + flat.size] += flat * np.float32(prescale)
                else:
                    acc[off:off + flat.size] += flat
                off += flat.size
            return acc
        return self._gather(st, arrays, prescale)

    @staticmethod
    def _gather(st: KeyState, arrays, prescale: float) -> np.ndarray:
        """The (prescaled) inputs copied into the key's flat float32 scratch buffer."""
        if st.scratch is None:
            st.scratch = np.empty(st.size, np.float32)
        acc = st.scratch
        off = 0
        for a in arrays:
            flat = _as_float(a).reshape(-1)
            acc[off:off + flat.size] = flat
            off += flat.size
        if prescale != 1.0:
            acc *= np.float32(prescale)
        return acc

    def _submit_whole(self, key: str, st: KeyState, acc: np.ndarray, process_set: ProcessSet):
        """Send ``acc`` whole through one all-reduce (a sparsifier's dense step: during a density warm-up, or
        when the sparse payload would not be smaller); the residual is then empty. Returns the collect
        function, as :meth:`_submit` does. The payload carries a size check."""
        n = acc.size
        ex = st.extra
        payload = ex.get("dense_payload")
        if payload is None:
            payload = ex["dense_payload"] = np.empty(n + CHECK_LEN, np.float32)
            ex["dense_out"] = np.empty(n + CHECK_LEN, np.float32)
            ex["dense_sig"] = signature("dense", n)
        out = ex["dense_out"]
        payload[:n] = acc
        put_check(payload[n:], ex["dense_sig"])
        if self.error_feedback:
            acc.fill(0.0)
        st.step += 1
        self.payload_bytes += payload.nbytes
        handle = c.allreduce_async(payload, out, name=f"{self.kind}.dense.{key}", op=ReduceOp.SUM,
                                   process_set=process_set)

        def collect():
            c.synchronize(handle)
            if not verify_check(out[n:], ex["dense_sig"], st.set_size):
                raise self._mismatch(st, "the size (or the density schedule)")
            return out[:n]
        return collect

    def _submit(self, key: str, st: KeyState, acc: np.ndarray, process_set: ProcessSet, set_size: int):
        """Encode ``acc`` and start the collective; return a function that waits and gives the dense sum
        (float32, flat, length ``st.size``)."""
        payload, ctx = self._encode(acc, st)
        st.step += 1
        self.payload_bytes += payload.nbytes
        name = f"{self.kind}.{key}"
        if self.collective == "allreduce":
            out = st.extra.get("reduced")
            if out is None or out.shape != payload.shape or out.dtype != payload.dtype:
                out = st.extra["reduced"] = np.empty_like(payload)
            handle = c.allreduce_async(payload, out, name=name, op=ReduceOp.SUM, process_set=process_set)

            def collect():
                c.synchronize(handle)
                return self._decode(out, None, ctx, st)
        else:
            handle = c.allgather_async(payload, lambda shape: np.empty(shape, payload.dtype), name=name,
                                       process_set=process_set)

            def collect():
                res = c.synchronize(handle)
                return self._decode(res.output, res.received_splits, ctx, st)
        return collect

    def _encode(self, acc: np.ndarray, st: KeyState):
        """Return ``(payload, ctx)`` for the flat float32 ``acc``; with error feedback, leave ``acc`` holding
        ``acc - (what this rank's payload decodes to)``."""
        raise NotImplementedError

    def _decode(self, data: np.ndarray, splits, ctx, st: KeyState) -> np.ndarray:
        """The dense float32 sum over ranks (flat, length ``st.size``) from the collective's output."""
        raise NotImplementedError

    @staticmethod
    def _scatter(dense: np.ndarray, arrays, outputs, scale: float) -> list:
        """Split the flat dense result into one output per input, scaled, in the inputs' shapes and dtypes
        (one pass over the data for float32 outputs)."""
        factor = np.float32(scale)
        results, off = [], 0
        for i, a in enumerate(arrays):
            part = dense[off:off + a.size].reshape(a.shape)
            off += a.size
            target = outputs[i] if outputs is not None else np.empty(a.shape, a.dtype)
            if target.dtype == np.float32:
                if scale != 1.0:
                    np.multiply(part, factor, out=target)
                else:
                    np.copyto(target, part)
            else:
                if scale != 1.0:
                    part = part * factor
                if target.dtype == np.uint16:  # bfloat16 carried as raw words
                    target[...] = _to_bf16_words(part)
                else:
                    np.copyto(target, part, casting="unsafe")
            results.append(target)
        return results


def _as_float(a: np.ndarray) -> np.ndarray:
    """float16/32/64 as they are; raw bfloat16 words (uint16) widened to float32."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def _to_bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 words, rounding to nearest even."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)
