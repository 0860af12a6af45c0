"""join() for uneven data, and the timeline recorded by rank 0."""

import json
import os
import tempfile
import time

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def test_join_uneven_steps(hvd):
    size, rank = hvd.size(), hvd.rank()
    for step in range(rank + 1):  # rank r has r + 1 batches
        out = hvd.allreduce(torch.full((3,), float(rank + 1)), op=hvd.Sum, name=f"join_step{step}")
        # ranks that still have data contribute; joined ranks contribute zeros
        expect = float(sum(r + 1 for r in range(step, size)))
        assert out.tolist() == [expect] * 3
        avg = hvd.allreduce(torch.full((2,), 6.0), op=hvd.Average, name=f"join_avg{step}")
        assert avg.tolist() == [6.0 * (size - step) / size] * 2
    last = hvd.join()
    everyone = hvd.allgather(torch.tensor([last]), name="join_last")
    assert len(set(everyone.tolist())) == 1 and 0 <= last < size
    # The engine works normally after everybody joined.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_join").item() == size


def test_join_rejects_other_collectives(hvd):
    size, rank = hvd.size(), hvd.rank()
    if size == 1:
        pytest.skip("needs 2+ ranks")
    if rank == 0:
        with pytest.raises(RuntimeError, match="join"):
            hvd.allgather(torch.ones(2, 2), name="join_ag")
        with pytest.raises(RuntimeError, match="join"):
            hvd.broadcast(torch.tensor([7.0]), 0, name="join_bc")
    last = hvd.join()
    assert last == 0  # rank 0 joined last


def test_timeline(hvd):
    path = os.path.join(tempfile.gettempdir(), f"perseus_timeline_{os.getpid()}.json")
    path = hvd.broadcast_object(path) if hasattr(hvd, "broadcast_object") else path
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    hvd.allgather(torch.ones(2), name="test_allgather")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path) as f:
            text = f.read()
        events = json.loads(text)
        names = {e.get("name") for e in events}
        for needed in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START", "NEGOTIATE_ALLGATHER"):
            assert needed in names, names
        assert "allreduce.test_allreduce" in text and "start_time_since_epoch_in_micros" in text
        os.unlink(path)


def test_timeline_counts_wire_bytes(hvd):
    path = os.path.join(tempfile.gettempdir(), f"perseus_timeline_bytes_{os.getpid()}.json")
    path = hvd.broadcast_object(path)
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(1 << 16), name="test_wire_bytes")
    time.sleep(0.1)  # the engine's events are polled every 20 ms
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path) as f:
            counters = [e for e in json.load(f) if e.get("ph") == "C" and e.get("name") == "WIRE_BYTES"]
        os.unlink(path)
        assert counters, "no WIRE_BYTES counter in the timeline"
        last = counters[-1]["args"]
        # a ring or MPI all-reduce of 256 KB sends at least (n-1)/n of it (2 (n-1)/n for the ring)
        assert last["sent_bytes"] >= (1 << 18) * (hvd.size() - 1) // hvd.size(), last
        assert all(b["args"]["sent_bytes"] >= a["args"]["sent_bytes"] for a, b in zip(counters, counters[1:]))
