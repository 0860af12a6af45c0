"""MPI transport: flat-buffer collectives and the control plane, through mpi4py.

Nothing here knows tensor names or frameworks. :class:`MpiComm` moves buffers on one communicator (one per
channel); :class:`MpiControl` carries negotiation (non-blocking bit-vector all-reduce and object all-gather)
and point-to-point control messages. Waiting on other ranks is always test-then-sleep, because Open MPI's
blocking calls busy-poll a core.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Optional

import numpy as np

from perseus.common.knobs import set_external_default
from perseus.common.partition import even_counts
from perseus.common.reduce_ops import ReduceOp
from perseus.engine.messages import DType
from perseus.transport.kernels import combine, scale_into

__all__ = ["load_mpi", "MpiComm", "MpiControl", "Sleeper", "mpi_flavour", "tighten_timer_slack"]

_MPI = None


def load_mpi(thread_multiple: bool = True):
    """Import ``mpi4py.MPI`` (which initialises MPI) with perseus's preferred runtime options.

    Sets ``OMPI_MCA_mpi_yield_when_idle=1`` unless the user chose a value: ranks that wait inside an Open MPI
    collective then yield the core instead of spinning on it, which matters whenever ranks share cores.
    """
    global _MPI
    if _MPI is not None:
        return _MPI
    set_external_default("OMPI_MCA_mpi_yield_when_idle", "1")
    import mpi4py

    if not thread_multiple:
        mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    _MPI = MPI
    return MPI


def mpi_flavour() -> str:
    """'openmpi', 'mpich' or 'other', from the library version string."""
    text = load_mpi().Get_library_version()
    if "Open MPI" in text:
        return "openmpi"
    if "MPICH" in text or "Intel" in text:
        return "mpich"
    return "other"


def tighten_timer_slack() -> None:
    """Ask Linux to wake this thread's short sleeps on time (default slack adds ~50 us to every sleep)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK = 29, 1 us
    except Exception:  # noqa: BLE001 - not Linux, or no libc: sleeps are just a little longer
        pass


class Sleeper:
    """Test-then-sleep back-off: short sleeps while an answer is likely soon, longer ones as waiting goes on."""

    __slots__ = ("delay", "min_s", "max_s")

    def __init__(self, min_s: float = 20e-6, max_s: float = 1e-3):
        self.min_s, self.max_s = min_s, max_s
        self.delay = 0.0

    def reset(self) -> None:
        self.delay = 0.0

    def sleep(self) -> None:
        if self.delay == 0.0:
            self.delay = self.min_s
            time.sleep(0)  # yield the GIL once before really sleeping
            return
        time.sleep(self.delay)
        self.delay = min(self.delay * 2.0, self.max_s)


_MPI_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVERAGE: "SUM", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX",
            ReduceOp.PRODUCT: "PROD"}
_BOOL_OPS = {ReduceOp.SUM: "LOR", ReduceOp.AVERAGE: "LOR", ReduceOp.MAX: "LOR", ReduceOp.MIN: "LAND",
             ReduceOp.PRODUCT: "LAND"}
_RING_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVERAGE: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
             ReduceOp.PRODUCT: "product"}
_native_fp16: Optional[bool] = None
_RING_MIN_BYTES = 64 << 10  # below this MPI's latency-optimised algorithms win over 2(n-1) ring steps


def _mpi_has_fp16() -> bool:
    """True when this MPI reduces float16 itself (Open MPI 5 does, via MPIX_C_FLOAT16)."""
    global _native_fp16
    if _native_fp16 is None:
        MPI = load_mpi()
        try:
            buf = np.ones(2, np.float16)
            MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            _native_fp16 = bool(buf[0] == 1)
        except Exception:
            _native_fp16 = False
    return _native_fp16


class MpiComm:
    """Buffer collectives on one communicator. Not thread-safe: one channel thread owns each instance."""

    def __init__(self, comm):
        self.MPI = load_mpi()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._scratch = [np.empty(0, np.uint8), np.empty(0, np.uint8)]

    # -- helpers ---------------------------------------------------------------------------------------
    def _temp(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """Reusable scratch bytes; ``slot`` 0 is the ring's receive buffer, 1 a whole-buffer work copy."""
        if self._scratch[slot].nbytes < nbytes:
            self._scratch[slot] = np.empty(max(nbytes, 2 * self._scratch[slot].nbytes), np.uint8)
        return self._scratch[slot]

    def _uses_ring(self, dtype: DType) -> bool:
        return dtype is DType.BFLOAT16 or (dtype is DType.FLOAT16 and not _mpi_has_fp16())

    def _op(self, dtype: DType, op: ReduceOp):
        if op == ReduceOp.ADASUM:
            raise NotImplementedError("perseus does not implement Adasum yet; use op=Average or op=Sum")
        names = _BOOL_OPS if dtype is DType.BOOL else _MPI_OPS
        return getattr(self.MPI, names[ReduceOp(op)])

    # -- collectives -----------------------------------------------------------------------------------
    def allreduce(self, send: Optional[np.ndarray], recv: np.ndarray, dtype: DType, op: ReduceOp,
                  postscale: float = 1.0, algorithm: str = "auto") -> None:
        """Reduce ``send`` (or ``recv`` in place when ``send`` is None) across ranks into ``recv``, times
        ``postscale``.

        ``algorithm``: ``mpi`` (MPI_Allreduce, then a scaling pass), ``ring`` (reduce-scatter and allgather
        over point-to-point messages; each rank scales only the segment it owns, so Average costs 1/size of
        a pass instead of a whole one, and an out-of-place reduction needs no copy), or ``auto`` (ring when it
        saves that pass on a large buffer, or when MPI cannot reduce the dtype).
        """
        ring = self._uses_ring(dtype) or algorithm == "ring" or (
            algorithm == "auto" and postscale != 1.0 and recv.nbytes >= _RING_MIN_BYTES and self.size > 1)
        if not ring:
            self.comm.Allreduce(self.MPI.IN_PLACE if send is None else send, recv, op=self._op(dtype, op))
            if postscale != 1.0:
                scale_into(recv, recv, postscale, dtype is DType.BFLOAT16)
            return
        counts = even_counts(recv.size, self.size)
        self._ring_reduce_scatter(recv, counts, dtype, op, src=send)
        if postscale != 1.0 or self.size == 1:
            start = sum(counts[: self.rank])
            mine = recv[start: start + counts[self.rank]]
            if self.size == 1 and send is not None:
                scale_into(send, mine, postscale, dtype is DType.BFLOAT16)
            elif postscale != 1.0:
                scale_into(mine, mine, postscale, dtype is DType.BFLOAT16)
        self._ring_allgather(recv, counts)

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], dtype: DType,
                      op: ReduceOp) -> None:
        """Reduce ``send`` across ranks; this rank receives the ``counts[rank]`` elements at its offset."""
        if self._uses_ring(dtype):
            work = self._temp(send.nbytes, slot=1)[: send.nbytes].view(send.dtype)
            self._ring_reduce_scatter(work, counts, dtype, op, src=send.reshape(-1))
            start = sum(counts[: self.rank])
            np.copyto(recv.reshape(-1), work[start: start + counts[self.rank]])
            return
        self.comm.Reduce_scatter(send, recv, recvcounts=counts, op=self._op(dtype, op))

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        """Concatenate every rank's ``send`` (``counts[r]`` elements from rank r) into ``recv``."""
        displs = _displacements(counts)
        self.comm.Allgatherv(send, [recv, counts, displs, self._mpi_type(recv)])

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast(buf, root=root)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        mtype = self._mpi_type(recv)
        self.comm.Alltoallv([send, send_counts, _displacements(send_counts), mtype],
                            [recv, recv_counts, _displacements(recv_counts), mtype])

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (int64, same length everywhere), stacked as ``(size, len)``."""
        out = np.empty((self.size, values.size), np.int64)
        self.comm.Allgather(values, out)
        return out

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self.comm.Alltoall(values, out)
        return out

    def barrier(self) -> None:
        self.comm.Barrier()

    def _mpi_type(self, arr: np.ndarray):
        from mpi4py.util.dtlib import from_numpy_dtype

        return from_numpy_dtype(arr.dtype)

    # -- ring algorithms (16-bit floats): point-to-point messages, vectorised arithmetic ------------
    def _ring_reduce_scatter(self, buf: np.ndarray, counts: list[int], dtype: DType, op: ReduceOp,
                             src: Optional[np.ndarray] = None) -> None:
        """Leave the full reduction of segment ``rank`` (sized by ``counts``) in that segment of ``buf``.

        With ``src``, the local contribution is read from ``src`` (each segment of ``buf`` this rank
        reduces is written once, from ``src`` plus what arrives), so no copy into ``buf`` is needed.
        """
        n, r = self.size, self.rank
        if n == 1:
            return
        displs = _displacements(counts)
        right, left = (r + 1) % n, (r - 1) % n
        tmp = self._temp(max(counts) * buf.itemsize)[: max(counts) * buf.itemsize].view(buf.dtype)
        kind, bf16 = _RING_OPS[ReduceOp(op)], dtype is DType.BFLOAT16
        for step in range(n - 1):
            s, q = (r - step - 1) % n, (r - step - 2) % n
            origin = src if (src is not None and step == 0) else buf
            incoming = tmp[: counts[q]]
            self.comm.Sendrecv(origin[displs[s]: displs[s] + counts[s]], dest=right, sendtag=17,
                               recvbuf=incoming, source=left, recvtag=17)
            mine = (src if src is not None else buf)[displs[q]: displs[q] + counts[q]]
            combine(mine, incoming, buf[displs[q]: displs[q] + counts[q]], kind, bfloat16=bf16)

    def _ring_allgather(self, buf: np.ndarray, counts: list[int]) -> None:
        n, r = self.size, self.rank
        displs = _displacements(counts)
        right, left = (r + 1) % n, (r - 1) % n
        for step in range(n - 1):
            s, q = (r - step) % n, (r - step - 1) % n
            self.comm.Sendrecv(buf[displs[s]: displs[s] + counts[s]], dest=right, sendtag=18,
                               recvbuf=buf[displs[q]: displs[q] + counts[q]], source=left, recvtag=18)


def _displacements(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


_CTRL_TAG = 7


class _AllgatherBytes:
    """Non-blocking all-gather of one byte string per rank: sizes first, then the bytes."""

    def __init__(self, comm, payload: bytes):
        MPI = load_mpi()
        self._comm = comm
        self._send = np.frombuffer(payload, np.uint8) if payload else np.zeros(0, np.uint8)
        self._mine = np.array([len(payload)], np.int64)
        self._sizes = np.empty(comm.Get_size(), np.int64)
        self._req = comm.Iallgather(self._mine, self._sizes)
        self._phase = 0
        self._MPI = MPI
        self._recv = None

    def test(self) -> Optional[list[bytes]]:
        if not self._req.Test():
            return None
        if self._phase == 0:
            counts = [int(c) for c in self._sizes]
            self._recv = np.empty(sum(counts), np.uint8)
            self._counts, self._displs = counts, _displacements(counts)
            self._req = self._comm.Iallgatherv(self._send, [self._recv, counts, self._displs, self._MPI.BYTE])
            self._phase = 1
            return self.test()
        raw = self._recv.tobytes()
        return [raw[d: d + c] for d, c in zip(self._displs, self._counts)]


class MpiControl:
    """Negotiation collectives and control messages for one process set.

    Two private communicators: one for the negotiation collectives (every rank issues them in the same
    order), one for point-to-point control messages (wake, stall probe, abort, shutdown).
    """

    def __init__(self, comm):
        self.MPI = load_mpi()
        self.coll = comm.Dup()
        self.p2p = comm.Dup()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._sends: list[Any] = []

    def start_band(self, words: np.ndarray):
        """Start an all-reduce with bitwise AND of ``words`` (uint64, in place); return the request."""
        return self.coll.Iallreduce(self.MPI.IN_PLACE, words, op=self.MPI.BAND)

    def start_allgather(self, payload: bytes) -> _AllgatherBytes:
        """Start an all-gather of byte strings; ``.test()`` returns the list (by rank) once complete."""
        return _AllgatherBytes(self.coll, payload)

    def send(self, dest: int, message: Any) -> None:
        """Send a control message (any picklable object) without blocking."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        buf = np.frombuffer(data, np.uint8)
        self._sends.append((self.p2p.Isend([buf, self.MPI.BYTE], dest=dest, tag=_CTRL_TAG), buf))
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def broadcast_message(self, message: Any) -> None:
        for dest in range(self.size):
            if dest != self.rank:
                self.send(dest, message)

    def poll(self) -> list[tuple[int, Any]]:
        """Return every control message that has arrived, as ``(source, message)``."""
        out = []
        status = self.MPI.Status()
        while True:
            msg = self.p2p.Improbe(source=self.MPI.ANY_SOURCE, tag=_CTRL_TAG, status=status)
            if msg is None:
                return out
            buf = np.empty(status.Get_count(self.MPI.BYTE), np.uint8)
            msg.Recv([buf, self.MPI.BYTE])
            out.append((status.Get_source(), pickle.loads(buf.tobytes())))

    def flush_sends(self, timeout_s: float = 2.0) -> None:
        """Wait (test-then-sleep) for outstanding control sends to complete, up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        sleeper = Sleeper()
        while self._sends and time.monotonic() < deadline:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]
            if self._sends:
                sleeper.sleep()
