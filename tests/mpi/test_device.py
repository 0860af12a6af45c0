"""The GPU launcher (perseus/torch/device.py) without a GPU: CPU tensors through the same launcher thread,
process groups and fusion buffers, with torch's Gloo backend (what PERSEUS_DEVICE_BACKEND=gloo does), and a
fake stream shim whose work finishes late, on other threads, in random order of delays, and a fake device whose
queued work runs only when the test lets it (stream-ordered completion)."""

import gc
import queue
import random
import threading
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from perseus.torch import _allreduce_ops, device

pytestmark = pytest.mark.timeout(120)


def _route_cpu(monkeypatch, on):
    """What PERSEUS_DEVICE_BACKEND=gloo decides (CPU all-reduces through the launcher), for this test."""
    monkeypatch.setattr(device, "_gloo", on)
    monkeypatch.setattr(_allreduce_ops, "_plain_cpu", None)  # read again


@pytest.fixture
def launcher_on_cpu(monkeypatch):
    _route_cpu(monkeypatch, True)


def _launcher(hvd):
    launcher = device._launcher
    assert launcher is not None and launcher.engine is hvd.mpi_ops._runtime.engine._native
    return launcher


def test_allreduce_paths_go_through_the_launcher(hvd, launcher_on_cpu):
    size, rank = hvd.size(), hvd.rank()
    before = hvd.wire_bytes()["sent_bytes"]
    out = hvd.allreduce(torch.arange(6.0) * (rank + 1), op=hvd.Sum, name="dev.one")
    assert out.tolist() == [i * size * (size + 1) / 2 for i in range(6)]
    t = torch.full((1000,), float(rank))
    hvd.allreduce_(t, name="dev.avg")  # Average: postscale 1/size inside the launcher
    assert torch.allclose(t, torch.full((1000,), (size - 1) / 2))
    tensors = [torch.ones(3), torch.ones(50_000, dtype=torch.float64), torch.ones(4, dtype=torch.int32)]
    outs = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="dev.group")
    assert [o.dtype for o in outs] == [t.dtype for t in tensors]
    assert all(torch.all(o == size) for o in outs)
    m = torch.tensor([float(rank), -float(rank)])
    hvd.allreduce_(m, op=hvd.Max, name="dev.max", prescale_factor=2.0)
    assert m.tolist() == [2.0 * (size - 1), 0.0]
    launcher = _launcher(hvd)
    assert (0, device._CPU) in launcher._groups
    assert not launcher._entries, "every request is forgotten once its data has moved"
    # The payload moved through the Gloo groups, not perseus's channels (only the store's address did).
    assert hvd.wire_bytes()["sent_bytes"] - before < 1024


def test_big_tensor_split_into_units_and_fused_small_ones(hvd, monkeypatch):
    """With PERSEUS_DEVICE_FUSION_THRESHOLD=1 MB a 3 MB tensor arrives in 3 units (slices), and 20 small
    tensors negotiated together share one unit (packed into the fusion buffer)."""
    from job_env import restart

    old = restart(hvd, {"PERSEUS_DEVICE_FUSION_THRESHOLD": str(1 << 20)})
    try:
        _route_cpu(monkeypatch, True)
        launched = []
        real = device._Launcher._launch
        monkeypatch.setattr(device._Launcher, "_launch", lambda self, *a: (launched.append(a[-2]), real(self, *a))[1])
        size = hvd.size()
        big = torch.arange(3 << 18, dtype=torch.float32)  # 3 MB
        small = [torch.full((7,), float(i)) for i in range(20)]
        handles = [hvd.allreduce_async_(big, op=hvd.Sum, name="dev.big"),
                   hvd.grouped_allreduce_async_(small, op=hvd.Sum, name="dev.small")]
        for h in handles:
            hvd.synchronize(h)
        assert torch.equal(big, torch.arange(3 << 18, dtype=torch.float32) * size)
        assert all(torch.all(s == i * size) for i, s in enumerate(small))
        slices = [p for pieces in launched for p in pieces if p[0] == "allreduce.dev.big"]
        assert len(slices) == 3 and sum(p[2] for p in slices) == 3 << 18, slices
        assert [len(pieces) for pieces in launched if pieces[0][0].startswith("allreduce.dev.small.")] == [20]
    finally:
        restart(hvd, old)


def test_gradients_arriving_during_a_burst_share_units(hvd, monkeypatch):
    """Requests that arrive one by one while earlier ones are in flight wait the device cycle and travel
    together; a loop of synchronous calls (nothing in flight) is not held back by it."""
    from job_env import restart

    # A long cycle, so that "not held back by it" stays clear of a busy machine's scheduling delays.
    old = restart(hvd, {"PERSEUS_DEVICE_CYCLE_TIME_MS": "100"})
    try:
        _route_cpu(monkeypatch, True)
        launched = []
        real = device._Launcher._launch

        def slow_launch(self, *a):  # communication slower than the gradients arrive, on any machine
            launched.append(a[-2])
            time.sleep(0.003)
            return real(self, *a)

        monkeypatch.setattr(device._Launcher, "_launch", slow_launch)
        grads = [torch.full((1000,), float(i)) for i in range(40)]
        handles = []
        for i, g in enumerate(grads):  # a backward pass: one gradient every 0.2 ms
            handles.append(hvd.allreduce_async_(g, op=hvd.Sum, name=f"dev.burst.{i}"))
            time.sleep(0.0002)
        for h in handles:
            hvd.synchronize(h)
        assert all(torch.all(g == i * hvd.size()) for i, g in enumerate(grads))
        units = [p for p in launched if p[0][0].startswith("allreduce.dev.burst.")]
        assert len(units) <= 10, [len(p) for p in units]
        start = time.monotonic()
        for i in range(20):
            hvd.allreduce_(grads[0], name="dev.sync")
        assert (time.monotonic() - start) / 20 < 0.05  # well under the 100 ms cycle each
    finally:
        restart(hvd, old)


def test_several_channels(hvd, monkeypatch):
    """PERSEUS_NUM_NCCL_STREAMS=3: three groups, and units go to them in turn (unit k to group k % 3)."""
    from job_env import restart

    old = restart(hvd, {"PERSEUS_NUM_NCCL_STREAMS": "3", "PERSEUS_DEVICE_FUSION_THRESHOLD": "65536"})
    try:
        _route_cpu(monkeypatch, True)
        indices = []
        real = device._Launcher._launch
        monkeypatch.setattr(device._Launcher, "_launch", lambda self, *a: (indices.append(a[1]), real(self, *a))[1])
        tensors = [torch.full((20_000 + i,), float(i)) for i in range(24)]  # 80 KB each: a unit per tensor
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"dev.ch.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
        assert all(torch.all(t == i * hvd.size()) for i, t in enumerate(tensors))
        assert len(device._launcher._groups[(0, device._CPU)]) == 3
        assert {i % 3 for i in indices} == {0, 1, 2}, indices
    finally:
        restart(hvd, old)


def test_what_nccl_cannot_reduce_is_not_launched(hvd, launcher_on_cpu):
    assert not device.takes([torch.ones(2, dtype=torch.int16)], 1, 1.0, 1.0)
    assert not device.takes([torch.ones(2, dtype=torch.bool)], 1, 1.0, 1.0)
    assert not device.takes([torch.ones(2)], 2, 1.0, 1.0)  # Adasum
    assert not device.takes([torch.ones(2, dtype=torch.int32)], 0, 1.0, 1.0)  # integer Average
    assert not device.takes([torch.ones(2, dtype=torch.int64)], 1, 2.0, 1.0)  # scaled integers
    assert device.takes([torch.ones(2, dtype=torch.int64)], 1, 1.0, 1.0)
    out = hvd.allreduce(torch.ones(3, dtype=torch.int16), op=hvd.Sum, name="dev.int16")  # the channels' path
    assert out.tolist() == [hvd.size()] * 3


def test_device_kind_mismatch_names_tensor_and_fix(hvd, monkeypatch):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    _route_cpu(monkeypatch, hvd.rank() == 0)
    start = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(3), name="dev.mismatch")
    message = str(info.value)
    assert "dev.mismatch" in message and "the launcher on CPU memory" in message and "the CPU path" in message
    assert "PERSEUS_DEVICE_BACKEND" in message and time.monotonic() - start < 10
    _route_cpu(monkeypatch, True)
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="dev.mismatch").tolist() == [hvd.size()] * 3


class FakeStreams(device.Streams):
    """Each unit's work 'finishes' on a timer thread after a random delay, as on a busy GPU."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.created: list = []

    def done(self):
        event = threading.Event()
        event.when = None

        def fire():
            event.when = time.monotonic()
            event.set()
        self.created.append(event)
        threading.Timer(self.rng.uniform(0.01, 0.05), fire).start()
        return event

    def wait_done(self, event):
        assert event.wait(10)


def test_completion_waits_for_the_device_and_keeps_tensors_alive(hvd, monkeypatch):
    from job_env import restart

    old = restart(hvd, {"PERSEUS_DEVICE_FUSION_THRESHOLD": str(1 << 20)})  # a unit per tensor below
    _route_cpu(monkeypatch, True)
    hvd.allreduce(torch.ones(1), name="dev.fake.warmup")  # the launcher and its groups exist
    launcher = _launcher(hvd)
    fake = FakeStreams(seed=hvd.rank())
    launcher.streams[device._CPU] = fake
    try:
        handles = []
        for i in range(30):  # 800 KB each: several units under the 4 MB fusion threshold
            t = torch.full((200_000,), float(i + hvd.rank()))
            handles.append(hvd.allreduce_async(t, op=hvd.Sum, name=f"dev.fake.{i}"))
        del t  # the inputs go away at once: the launcher holds what it still needs
        returned = []
        for i, h in enumerate(handles):
            out = hvd.synchronize(h)
            returned.append(time.monotonic())
            assert torch.all(out == sum(float(i + r) for r in range(hvd.size()))), i
        assert len(fake.created) >= 30 and all(e.is_set() for e in fake.created)
        # No request completed before the 'device' finished the first unit's work.
        assert returned[0] >= min(e.when for e in fake.created)
        with launcher._lock:
            assert not [k for k in launcher._entries if k[1].startswith("allreduce.dev.fake.")]
    finally:
        restart(hvd, old)


class LateDevice(device.Streams):
    """A device with stream-ordered completion whose queued work runs in order on a thread of its own, and only
    once the test opens ``gate`` (a GPU stream still busy with earlier kernels). ``caller_wait`` waits on the host
    for the unit's marker: the stand-in for a stream wait, so that the test may read the tensor at once."""

    ordered = True

    def __init__(self):
        self.gate = threading.Event()
        self.work: queue.Queue = queue.Queue()
        self.caller_waits = 0
        threading.Thread(target=self._device, daemon=True).start()

    def _device(self):
        while True:
            what, a, b = self.work.get()
            if what is None:
                return
            assert self.gate.wait(60)
            if what == "run":
                a.wait()
                b()
            else:
                a.set()

    def run(self, work, finish):
        self.work.put(("run", work, finish))

    def done(self):
        marker = threading.Event()
        self.work.put(("done", marker, None))
        return marker

    def caller_wait(self, marker):
        self.caller_waits += 1
        assert marker.wait(60)

    def wait_done(self, marker):
        assert marker.wait(60)


def test_stream_ordered_completion_with_late_device_work(hvd, monkeypatch):
    size, rank = hvd.size(), hvd.rank()
    _route_cpu(monkeypatch, True)
    hvd.allreduce(torch.ones(1), name="dev.late.warmup")  # the launcher and its groups exist
    launcher = _launcher(hvd)
    late = LateDevice()
    launcher.streams[device._CPU] = late
    try:
        t = torch.full((1000,), float(rank + 1))
        memory = StorageWeakRef(t.untyped_storage())  # the input's memory, whoever holds it
        first = hvd.allreduce_async(t, name="dev.late.avg")  # Average: the postscale runs on the device
        gathered = hvd.allgather_async(torch.full((rank + 1, 2), float(rank)), name="dev.late.ag")
        del t
        # The engine completes both while the device has run none of their work: nothing waits on the host.
        deadline = time.monotonic() + 30
        while not (hvd.poll(first) and hvd.poll(gathered)):
            assert time.monotonic() < deadline, "the requests never completed"
            time.sleep(0.01)
        assert not late.gate.is_set() and late.caller_waits == 0
        # The name may be used again at once; the first request's input is still referenced (its work is queued).
        again = hvd.allreduce_async(torch.full((1000,), 2.0 * (rank + 1)), name="dev.late.avg")
        gc.collect()
        assert not memory.expired()
        threading.Timer(0.2, late.gate.set).start()
        opened = time.monotonic()
        out = hvd.synchronize(first)  # waits (the caller's 'stream') for the device to finish the unit
        assert time.monotonic() - opened >= 0.15
        assert torch.allclose(out, torch.full((1000,), (size + 1) / 2))
        expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)])
        assert torch.equal(hvd.synchronize(gathered), expected)
        assert torch.allclose(hvd.synchronize(again), torch.full((1000,), float(size + 1)))
        assert late.caller_waits >= 3
        # Once the device is done the finalizer lets the tensors go.
        deadline = time.monotonic() + 30
        while not memory.expired():
            assert time.monotonic() < deadline, "the launcher kept the input after its work was done"
            gc.collect()
            time.sleep(0.01)
        with launcher._lock:
            assert not [k for k in launcher._entries if "dev.late." in k[1]]
    finally:
        late.gate.set()
        late.work.put((None, None, None))
        launcher.streams[device._CPU] = device.HostStreams()


def test_launcher_failure_fails_every_rank_naming_the_tensor(hvd, monkeypatch):
    """An error inside the launcher (a broken NCCL call) fails the unit on every rank within seconds, with the
    tensor's name; perseus can be started again afterwards."""
    from job_env import restart

    _route_cpu(monkeypatch, True)
    hvd.allreduce(torch.ones(1), name="dev.fail.warmup")
    launcher = _launcher(hvd)
    if hvd.rank() == hvd.size() - 1:
        group = launcher._groups[(0, device._CPU)][0]

        class Broken:
            def allreduce(self, *args):
                raise RuntimeError("injected NCCL failure")
        launcher._groups[(0, device._CPU)] = [Broken()]
        del group
    start = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(4), name="dev.fail.victim")
    assert "dev.fail.victim" in str(info.value), str(info.value)
    assert time.monotonic() - start < 20
    restart(hvd, {})
    _route_cpu(monkeypatch, True)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="dev.after").tolist() == [hvd.size()] * 2
