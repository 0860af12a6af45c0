"""Bytes on the wire (hvd.wire_bytes): what each collective puts on the wire from this rank, with the ring and
with MPI's own all-reduce, per process set, and only ever growing."""

import os

import pytest
import torch

from job_env import restart

pytestmark = pytest.mark.timeout(120)

KEYS = ("sent_bytes", "received_bytes", "control_sent_bytes", "control_received_bytes")


def _delta(before, after):
    assert set(before) == set(after) == set(KEYS)
    for k in KEYS:
        assert after[k] >= before[k], f"{k} went down: {before[k]} -> {after[k]}"
    return {k: after[k] - before[k] for k in KEYS}


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_allreduce_sends_two_size_minus_one_over_size_of_the_buffer(hvd, algorithm):
    # ring: the point-to-point steps are counted as they move; mpi: MPI_Allreduce counts the ring's volume.
    old = {"PERSEUS_ALLREDUCE_ALGORITHM": os.environ.get("PERSEUS_ALLREDUCE_ALGORITHM")}
    try:
        restart(hvd, {"PERSEUS_ALLREDUCE_ALGORITHM": algorithm})
        from perseus.runtime.state import runtime

        assert runtime().engine.params(0)[4] == {"mpi": 1, "ring": 2}[algorithm]
        size = hvd.size()
        count = 6 * 50000  # float32 elements: every ring segment the same size for 2 and 3 ranks
        start = hvd.wire_bytes()
        assert all(isinstance(start[k], int) and start[k] >= 0 for k in KEYS)
        for step in range(3):
            before = hvd.wire_bytes()
            x = torch.ones(count)
            out = hvd.allreduce(x, op=hvd.Sum, name=f"wire.ar.{algorithm}")
            d = _delta(before, hvd.wire_bytes())
            assert torch.all(out == size)
            want = 2 * (size - 1) * count * 4 // size
            for k in ("sent_bytes", "received_bytes"):
                assert want <= d[k] <= want + want // 100, (algorithm, step, k, d[k], want)
            if step == 0:  # a new name is negotiated: control bytes, never payload
                assert d["control_sent_bytes"] > 0 and d["control_received_bytes"] > 0, d
    finally:
        restart(hvd, old)
    # Counters start again at the next init() (they belong to the engine's process sets), and need one.
    fresh = hvd.wire_bytes()
    assert fresh["sent_bytes"] == fresh["received_bytes"] == 0, fresh
    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match="not been initialized"):
            hvd.wire_bytes()
    finally:
        hvd.init()


def test_allgather_counts_own_block_out_and_the_others_in(hvd):
    size, rank = hvd.size(), hvd.rank()
    rows = [r + 1 for r in range(size)]
    before = hvd.wire_bytes()
    out = hvd.allgather(torch.full((rows[rank], 7), float(rank)), name="wire.ag")
    d = _delta(before, hvd.wire_bytes())
    assert out.shape == (sum(rows), 7)
    assert d["sent_bytes"] == rows[rank] * 7 * 4 * (size - 1), d
    assert d["received_bytes"] == sum(rows[q] * 7 * 4 for q in range(size) if q != rank), d


def test_broadcast_and_alltoall_counts(hvd):
    size, rank = hvd.size(), hvd.rank()
    before = hvd.wire_bytes()
    hvd.broadcast(torch.zeros(1000), root_rank=0, name="wire.bc")
    d = _delta(before, hvd.wire_bytes())
    assert (d["sent_bytes"], d["received_bytes"]) == ((4000 * (size - 1), 0) if rank == 0 else (0, 4000)), d
    splits = [rank + q + 1 for q in range(size)]  # rows this rank sends to rank q
    before = hvd.wire_bytes()
    hvd.alltoall(torch.zeros(sum(splits), 2), splits=torch.tensor(splits), name="wire.a2a")
    d = _delta(before, hvd.wire_bytes())
    assert d["sent_bytes"] == sum(splits[q] * 8 for q in range(size) if q != rank), d
    assert d["received_bytes"] == sum((q + rank + 1) * 8 for q in range(size) if q != rank), d


def test_counters_are_per_process_set_and_only_grow(hvd):
    size, rank = hvd.size(), hvd.rank()
    ranks = [0, 1] if size > 2 else [0]  # a set other than the global one
    ps = hvd.add_process_set(ranks)
    try:
        member = rank in ranks
        if not member:
            with pytest.raises(ValueError, match="not a member"):
                hvd.wire_bytes(ps)
        readings = []

        def read():
            readings.append((hvd.wire_bytes(), hvd.wire_bytes(ps) if member else None))

        read()
        if member:
            assert readings[0][1]["sent_bytes"] == readings[0][1]["received_bytes"] == 0  # new: no payload yet
        count = 6000
        for step in range(4):
            on_set = step % 2 == 0
            if on_set and member:
                hvd.allreduce(torch.ones(count), op=hvd.Sum, name=f"wire.ps.{step}", process_set=ps)
            elif not on_set:
                hvd.allreduce(torch.ones(count), op=hvd.Sum, name=f"wire.global.{step}")
            read()
        for step in range(4):
            (g0, s0), (g1, s1) = readings[step], readings[step + 1]
            dg = _delta(g0, g1)
            if step % 2 == 0:  # traffic on the set only
                assert dg["sent_bytes"] == dg["received_bytes"] == 0, (step, dg)
                if member:
                    ds = _delta(s0, s1)
                    want = 2 * (len(ranks) - 1) * count * 4 // len(ranks)
                    assert ds["sent_bytes"] == ds["received_bytes"] == want, (step, ds)
            else:  # traffic on the global set only
                want = 2 * (size - 1) * count * 4 // size
                assert dg["sent_bytes"] == dg["received_bytes"] == want, (step, dg)
                if member:
                    ds = _delta(s0, s1)
                    assert ds["sent_bytes"] == ds["received_bytes"] == 0, (step, ds)
    finally:
        hvd.barrier()
        assert hvd.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        hvd.wire_bytes(ps)
