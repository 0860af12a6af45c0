"""The tuner's engine plumbing: its collectives, the TUNE request, and the engine's step records.

:class:`_EnginePlumbing` is part of :class:`~perseus.autotune.tuner.Tuner` (which sets the state it reads in its
``__init__``). Every rank's tuner submits the same collectives in the same order: a broadcast of rank 0's
word, an all-reduce with MAX of each rank's measured cost, and the TUNE request that switches the engine's
values at a point negotiated on every rank; all are named ``perseus.autotune.*`` and submitted with
``Timing.NONE``, so they belong to no step. The step records are read through ``read_steps`` (the engine's
own, or chosen times in a test). Every wait raises :class:`_Stopped` once the tuner is asked to stop
(shutdown), which ends the tuner's thread quietly.
"""

from __future__ import annotations

import numpy as np

from perseus.autotune.space import DEVICE, Config
from perseus.base.reduce_ops import ReduceOp
from perseus.engine.messages import DType, OpType, Request, Timing
from perseus.sparse._runtime import signature

__all__: list[str] = []

_BROADCAST, _ALLREDUCE = OpType.BROADCAST, OpType.ALLREDUCE
_INT64, _FLOAT64 = DType.INT64, DType.FLOAT64
_MAX = ReduceOp.MAX
_POLL_S = 0.005  # how often the thread looks for finished steps (only while it searches)


class _Stopped(Exception):
    pass


class _EnginePlumbing:
    """The tuner's collectives and step records (methods of :class:`~perseus.autotune.tuner.Tuner`)."""

    def _wait(self, hid: int):
        while True:
            if self._stop.is_set():
                raise _Stopped()
            try:
                return self.engine.wait(hid, 0.1)
            except TimeoutError:
                continue

    def _name(self, what: str) -> str:
        self._seq += 1
        return f"perseus.autotune.{what}.{self._seq}"

    def _broadcast(self, values: np.ndarray) -> np.ndarray:
        item = Request(name=self._name("setting"), dtype=_INT64, shape=values.shape, input=values, output=values,
                       root_rank=0, timing=Timing.NONE)
        self._wait(self.engine.submit(0, _BROADCAST, [item], None, values))
        return values

    def _max(self, value: float) -> float:
        buf = np.array([value], np.float64)
        item = Request(name=self._name("score"), dtype=_FLOAT64, shape=buf.shape, input=buf, output=buf,
                       reduce_op=_MAX, timing=Timing.NONE)
        self._wait(self.engine.submit(0, _ALLREDUCE, [item], None, buf))
        return float(buf[0])

    def _apply(self, config: Config, final: bool = False) -> None:
        # Posted first, on every rank: a compressor switches its policy at the first step boundary at which
        # any rank has posted it (perseus.runtime.step_policy); -1 leaves its policy alone.
        for name, link in self.links.items():
            link.post(getattr(config, name) if self._tuned[name] else -1, final)
        budget = (config.device_bucket_bytes,) if self._tuned[DEVICE] else ()  # (absent: unchanged)
        self._wait(self.engine.tune(0, self._name("tune"), *config.values(), *budget))

    def _completed(self) -> int:
        first, steps = self.read_steps(0, self._step)
        return first + len(steps)

    def _wait_steps(self, count: int, poll: float = 0.0) -> list:
        """Wait until steps [self._step, self._step + count) have completed; return them and move on."""
        while self._completed() < self._step + count:
            if self._stop.wait(poll or _POLL_S):
                raise _Stopped()
        first, steps = self.read_steps(0, self._step)
        taken = steps[:count]
        self._step = first + count
        return taken

    def _last_signature(self) -> tuple[int, int]:
        """(digest, bytes) of the last completed step: the engine's digest (which leaves the sparse path out)
        mixed with the sparse tensors' own signature."""
        first, steps = self.read_steps(0, max(0, self._step - 1))
        i = self._step - 1 - first  # the step just waited for (a later one may have completed meanwhile)
        if not steps or not 0 <= i < len(steps):
            return 0, 0
        return (int(steps[i][2]) ^ signature()) & ((1 << 64) - 1), int(steps[i][1])

