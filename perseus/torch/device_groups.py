"""The device launcher's process groups (:mod:`perseus.torch.device`): their construction over perseus's own
ranks and the measurement of a launch's cost that sets the device buckets' budget.

- At a process set's first device unit of a kind of memory, every member builds the set's groups for that kind
  (``PERSEUS_NUM_NCCL_STREAMS`` of them: NCCL for GPU memory, Gloo for CPU memory): the set's first rank starts
  a ``TCPStore`` on a free port and broadcasts its address with a perseus broadcast; each group gets a prefix
  of that store. Every member must take part (it is collective); a rank that joined before submitting any GPU
  tensor to the set cannot, and raises RuntimeError. Group timeouts exceed perseus's stall shutdown time.
- Right after, every member measures a launch's cost and the bandwidth on the first group and agrees on the
  slowest rank's (:meth:`LauncherGroups._calibrate`); the budget takes effect at a negotiated point. Failures
  there are logged and leave the default budget in force.
- On failure or at shutdown the groups are aborted (never waiting for a peer).
"""

from __future__ import annotations

import datetime
import logging
import socket
import time

import numpy as np
import torch

from perseus.runtime import collectives as _c
from perseus.runtime.state import runtime
from perseus.base.knobs import external, set_external_default

__all__ = ["LauncherGroups", "CALIBRATION_LAUNCHES"]

_runtime = runtime()

_SUM, _AVERAGE, _MIN, _MAX, _PRODUCT = 1, 0, 3, 4, 5  # perseus ReduceOp codes (perseus.base.reduce_ops)
CALIBRATION_LAUNCHES = 8  # a device bucket's transfer takes this many launch costs (see _Launcher._calibrate)
_log = logging.getLogger("perseus")

# The launcher's kinds of memory (the request signature's device code, which every rank must agree on).
_CUDA, _CPU = 0, 1


def _options(reduce_op):
    options = torch.distributed.AllreduceOptions()
    options.reduceOp = reduce_op
    return options


_OPTIONS = {}  # perseus ReduceOp code -> the backends' all-reduce options (made once)
if torch.distributed.is_available():
    _R = torch.distributed.ReduceOp
    _OPTIONS = {_SUM: _options(_R.SUM), _AVERAGE: _options(_R.SUM), _MIN: _options(_R.MIN),
                _MAX: _options(_R.MAX), _PRODUCT: _options(_R.PRODUCT)}


class LauncherGroups:
    """The process-group methods of the device launcher (``perseus.torch.device_launcher._Launcher``), one of
    its bases. They use the launcher's ``_groups``, ``_sets``, ``_device`` and ``calibration``."""

    def _collective(self, group, buf, reduce_op):
        """Start one all-reduce of ``buf`` on ``group`` and return its work (every launch, and the calibration,
        goes through here)."""
        return group.allreduce([buf], _OPTIONS[reduce_op])

    def _calibrate(self, ps_id, kind, group) -> None:
        """Measure what a launch costs on the set's new groups and choose the device buckets' budget from it, the
        same on every rank (collective: every member does this at the set's first unit of ``kind``).

        The cost of a launch is the median time of an all-reduce of 256 bytes; the bandwidth comes from one of
        8 MiB; each is the slowest rank's (an all-reduce MAX over the group). The budget is the size whose
        transfer takes CALIBRATION_LAUNCHES launch costs (so a launch's fixed cost is at most about 1/8 of it),
        at least DDP's 25 MiB and at most 256 MiB: large where launches are expensive, DDP-like where they are
        cheap. It takes effect at a negotiated point (a TUNE request whose other values stay as they are). An
        explicit PERSEUS_DEVICE_BUCKET_BYTES is kept. Failures leave the default in force."""
        settings = _runtime.settings
        if settings.is_explicit("device_bucket_bytes") or settings.device_bucket_bytes <= 0:
            return
        device = self._device if kind == _CUDA else "cpu"
        sync = torch.cuda.synchronize if kind == _CUDA else (lambda *a: None)

        def timed(numel, repeats):
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            self._collective(group, buf, _SUM).wait()  # (first use: connections, buffers)
            sync(device)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._collective(group, buf, _SUM).wait()
                sync(device)
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        try:
            small = timed(64, 9)
            large = timed(2 << 20, 3)
            agreed = torch.tensor([small, max(large - small, 1e-9)], dtype=torch.float64, device=device)
            self._collective(group, agreed, _MAX).wait()
            sync(device)
            cost, seconds_per_8mib = (float(v) for v in agreed.cpu())
            bandwidth = (8 << 20) / seconds_per_8mib
            budget = int(min(max(CALIBRATION_LAUNCHES * cost * bandwidth, 25 << 20), 256 << 20))
            self.calibration[ps_id] = {"launch_cost_s": cost, "bandwidth_bytes_per_s": bandwidth,
                                       "bucket_bytes": budget}
            engine = _runtime.engine
            _c.synchronize(engine.tune(ps_id, f"perseus.device.budget.{ps_id}.{kind}", -1, -1, -1, -1, -1, budget))
        except Exception as exc:  # noqa: BLE001 - the default budget stays; the job goes on
            _log.warning("perseus: measuring the device launch cost failed (%s: %s); device buckets keep their "
                         "default budget", type(exc).__name__, exc)

    def _make_groups(self, ps_id, kind):
        """The set's process groups for ``kind`` (NCCL for GPU memory, Gloo for CPU memory), built collectively:
        at the set's first unit of that kind, on every member."""
        from torch._C._distributed_c10d import PrefixStore, TCPStore

        settings = _runtime.settings
        process_set = self._sets.get(ps_id)
        if process_set is None:
            raise RuntimeError(f"process set {ps_id}: this rank joined before submitting any GPU tensor to it, so "
                               "it cannot build its NCCL groups; submit a GPU all-reduce on every rank first")
        members = _runtime.process_set_ranks(ps_id)
        rank, size = members.index(_runtime.rank()), len(members)
        timeout = datetime.timedelta(seconds=max(settings.stall_shutdown_time_s, settings.stall_check_time_s) + 60)
        info = np.zeros(256, np.uint8)
        if rank == 0:
            host = "127.0.0.1" if _runtime.cross_size() == 1 else socket.gethostbyname(socket.gethostname())
            store = TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
            text = f"{host}:{store.port}".encode()
            info[:len(text)] = np.frombuffer(text, np.uint8)
        _c.synchronize(_c.broadcast_async(info, info, members[0], name=f"perseus.device.store.{ps_id}.{kind}",
                                          process_set=process_set))
        if rank != 0:
            host, port = bytes(info).rstrip(b"\0").decode().rsplit(":", 1)
            store = TCPStore(host, int(port), size, False, timeout)
        groups = []
        for channel in range(max(1, int(settings.num_nccl_streams))):
            prefixed = PrefixStore(f"perseus/{ps_id}/{kind}/{channel}", store)
            if kind == _CUDA:
                from torch._C._distributed_c10d import ProcessGroupNCCL

                if external("NCCL_LAUNCH_ORDER_IMPLICIT") is None and torch.cuda.nccl.version() >= (2, 26, 0):
                    # Groups run concurrently: NCCL orders their kernels as this one thread launches them.
                    set_external_default("NCCL_LAUNCH_ORDER_IMPLICIT", "1")
                group = ProcessGroupNCCL(prefixed, rank, size, ProcessGroupNCCL.Options())
            else:
                from torch._C._distributed_c10d import ProcessGroupGloo

                group = ProcessGroupGloo(prefixed, rank, size, timeout)
            group._set_default_timeout(timeout)
            groups.append(group)
        return groups

    def _abort_groups(self):
        for groups in self._groups.values():
            for g in groups:
                abort = getattr(g, "abort", None)
                if abort is not None:
                    try:
                        abort()
                    except Exception:  # noqa: BLE001 - already failing
                        pass
