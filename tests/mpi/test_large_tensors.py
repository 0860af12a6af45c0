"""Collectives on tensors above 2 GiB in bytes and above 2^31 elements, where MPI's int counts end.

Every public collective of perseus.torch that takes such a tensor must give the right result: the MPI
transport cuts what does not fit an int count into pieces. Each test needs several GB on every rank; it
runs when /proc/meminfo's MemAvailable (the smallest any rank reads) covers what the whole job needs, and
otherwise skips, naming both figures (every rank decides alike, from the same all-reduced figure). Results are
checked block by block against a periodic pattern (no Python loop over elements, no full-size temporaries).

Run it on its own, at 2 ranks (the sizes are chosen so that 3 ranks fit too, when memory allows):
    mpirun -np 2 python -m pytest tests/mpi/test_large_tensors.py
The largest test needs about 10 GiB for the whole job at 2 ranks (the ring reduce-scatter: input, output and
two part-sized scratch buffers per rank) and 12 GiB at 3; measured on 2 shared cores: 1 to 3 minutes at 2
ranks, about 4 at 3.
"""

import time

import pytest
import torch

from job_env import restart

pytestmark = pytest.mark.timeout(900)

BIG = 2**31 + 7  # elements: above MPI's largest int count (2^31 - 1)
HALF = 2**30 + 2**20 + 3  # float16 elements: 2.15 GB, above 2 GiB in bytes
PERIOD = 251  # the pattern's period: prime, so no power-of-two piece boundary lines up with it
BLOCK_ROWS = 1 << 18  # pattern periods written or compared at once (64 MB for int8)
GIB = 2**30
MARGIN = 1 * GIB  # per job, for the interpreters' own growth while a test runs


def _row(rank: int, dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
    """One period of rank's pattern: small integers (exact in every dtype, and their sums over up to 3 ranks
    fit int8), starting at element ``phase`` of the period."""
    i = (torch.arange(PERIOD, dtype=torch.int64) + phase) % PERIOD
    return ((i * 3 + rank * 7) % 41).to(dtype)


def _sum_row(size: int, dtype: torch.dtype) -> torch.Tensor:
    return sum(_row(r, torch.int64) for r in range(size)).to(dtype)


def _fill(t: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """Write the periodic pattern ``row`` over the 1-D contiguous ``t`` (element i = row[i % PERIOD])."""
    block = row.repeat(BLOCK_ROWS)
    for start in range(0, t.numel(), block.numel()):
        part = t[start:start + block.numel()]
        part.copy_(block[:part.numel()])
    return t


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x's bytes as int64 words where its size and alignment allow (8 times fewer elements to compare)."""
    try:
        return x.view(torch.int64)
    except RuntimeError:
        return x


def _mismatch(t: torch.Tensor, row: torch.Tensor, every: int = 1):
    """None when every element i of the 1-D ``t`` equals row[i % PERIOD]; else the first wrong block's
    element offset. every > 1: only every so many blocks of BLOCK_ROWS periods, and the last one."""
    head = min(t.numel(), (-t.data_ptr() % 8) // t.element_size())  # elements before an 8-byte boundary
    if not torch.equal(t[:head], row[:head]):
        return 0
    block = row.roll(-head).repeat(BLOCK_ROWS)
    wide = _wide(block)
    rest = t[head:]
    for i, start in enumerate(range(0, rest.numel(), block.numel())):
        if every > 1 and i % every != 0 and start + block.numel() < rest.numel():
            continue
        part = rest[start:start + block.numel()]
        same = torch.equal(_wide(part), wide) if part.numel() == block.numel() else \
            torch.equal(part, block[:part.numel()])
        if not same:
            return head + start
    return None


def _check(t: torch.Tensor, row: torch.Tensor, what: str, every: int = 1):
    bad = _mismatch(t.reshape(-1), row, every)
    assert bad is None, f"{what}: wrong values from element {bad} on (of {t.numel()})"


def _require(hvd, job_bytes: int, what: str):
    """Skip (on every rank) unless the smallest MemAvailable any rank reads covers job_bytes plus a margin."""
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    avail = int(hvd.allreduce(torch.tensor([avail], dtype=torch.int64), op=hvd.Min, name="large.mem").item())
    need = job_bytes + MARGIN
    if avail < need:
        pytest.skip(f"{what} needs {need / GIB:.1f} GiB of memory for {hvd.size()} ranks; this machine has "
                    f"{avail / GIB:.1f} GiB available (MemAvailable)")


class _Clock:
    """Times one test: from the start (filling included) and the collective alone; rank 0 prints both."""

    def __init__(self, hvd, what: str):
        self.hvd, self.what = hvd, what
        self.started = time.monotonic()
        self.op_s = 0.0

    def op(self, fn, *args, **kwargs):
        started = time.monotonic()
        out = fn(*args, **kwargs)
        self.op_s += time.monotonic() - started
        return out

    def report(self):
        if self.hvd.rank() == 0:
            print(f"\n[large] {self.what} at {self.hvd.size()} ranks: collective {self.op_s:.1f} s, with filling "
                  f"and checking {time.monotonic() - self.started:.1f} s", flush=True)


def _allreduce(hvd, n, dtype, label, in_place, op="Sum"):
    """Allreduce of n elements of dtype; Average gets each rank's values times the number of ranks, so that the
    result is exact."""
    size, rank = hvd.size(), hvd.rank()
    _require(hvd, size * (1 if in_place else 2) * n * dtype.itemsize, label)
    clock = _Clock(hvd, f"{label}: {n} x {dtype}")
    mine = _row(rank, dtype) * (size if op == "Average" else 1)
    x = _fill(torch.empty(n, dtype=dtype), mine)
    if in_place:
        out = clock.op(hvd.allreduce_, x, op=getattr(hvd, op), name=label)
        assert out is x
    else:
        out = clock.op(hvd.allreduce, x, op=getattr(hvd, op), name=label)
        assert out.shape == x.shape and out.dtype == dtype
        _check(x, mine, f"{label} input (must be left as it was)", every=8)
    del x
    _check(out, _sum_row(size, dtype), label)
    clock.report()


def _allgather(hvd, counts, dtype, label, cols=1):
    """Rank r contributes counts[r] elements (counts[r] / cols rows of cols)."""
    size, rank = hvd.size(), hvd.rank()
    _require(hvd, dtype.itemsize * (sum(counts) * size + sum(counts)), label)
    clock = _Clock(hvd, f"{label}: {counts} x {dtype}")
    x = _fill(torch.empty(counts[rank], dtype=dtype), _row(rank, dtype))
    if cols > 1:
        x = x.view(-1, cols)
    out = clock.op(hvd.allgather, x, name=label)
    del x
    assert out.shape == ((sum(counts) // cols, cols) if cols > 1 else (sum(counts),))
    out = out.view(-1)
    offset = 0
    for r, c in enumerate(counts):
        _check(out[offset:offset + c], _row(r, dtype), f"{label}: rank {r}'s part")
        offset += c
    clock.report()


def _reducescatter(hvd, n_rows, cols, dtype, label, scratch_parts):
    """Sum-reducescatter of (n_rows, cols); the algorithm may hold scratch_parts rank-sized parts more."""
    size, rank = hvd.size(), hvd.rank()
    part = -(-n_rows // size) * cols
    _require(hvd, size * dtype.itemsize * (n_rows * cols + (1 + scratch_parts) * part), label)
    clock = _Clock(hvd, f"{label}: ({n_rows}, {cols}) {dtype}")
    x = _fill(torch.empty(n_rows * cols, dtype=dtype), _row(rank, dtype)).view(n_rows, cols)
    out = clock.op(hvd.reducescatter, x, op=hvd.Sum, name=label)
    del x
    rows = [n_rows // size + (1 if r < n_rows % size else 0) for r in range(size)]
    assert out.shape == (rows[rank], cols)
    start = sum(rows[:rank]) * cols
    _check(out, _sum_row(size, dtype).roll(-(start % PERIOD)), label)
    clock.report()


RS_ROWS, RS_COLS = (BIG + 2**20) // 1024, 1024  # reducescatter: more than 2^31 elements in all


def test_allreduce_int8_over_2g_elements(hvd):
    _allreduce(hvd, BIG, torch.int8, "large.allreduce.int8", in_place=False)


def test_allreduce_in_place_average_float16_over_2gib(hvd):
    """In place, Average: on one host the ring (on fusion-sized units), each rank scaling its own segment."""
    _allreduce(hvd, HALF, torch.float16, "large.allreduce_avg.float16", in_place=True, op="Average")


def test_broadcast_uint8_over_2g_elements(hvd):
    size, rank = hvd.size(), hvd.rank()
    root, label = size - 1, "large.broadcast_.uint8"
    _require(hvd, size * BIG, label)
    clock = _Clock(hvd, f"{label}: {BIG} x uint8 from rank {root}")
    x = torch.empty(BIG, dtype=torch.uint8)
    if rank == root:
        _fill(x, _row(root, torch.uint8))
    else:
        x.zero_()
    assert clock.op(hvd.broadcast_, x, root, name=label) is x
    _check(x, _row(root, torch.uint8), label)
    clock.report()


def test_allgather_one_rank_over_2g_elements(hvd):
    """Rank 0 contributes more than 2^31 elements (its count, and every later rank's offset, above MPI's int)."""
    _allgather(hvd, [BIG] + [PERIOD + r for r in range(1, hvd.size())], torch.int8, "large.allgather.int8")


def test_allgather_rows_over_2g_elements(hvd):
    """Every rank contributes rows of 4096 elements; together more than 2^31 elements."""
    size, cols = hvd.size(), 4096
    counts = [(BIG // cols // size + 1 + r) * cols for r in range(size)]
    _allgather(hvd, counts, torch.uint8, "large.allgather_rows.uint8", cols=cols)


def test_allgather_float16_over_2gib(hvd):
    """More than 2 GiB gathered, below 2^31 elements: MPI's own allgather."""
    size = hvd.size()
    _allgather(hvd, [HALF // size + r for r in range(size)], torch.float16, "large.allgather.float16")


def test_alltoall_one_block_over_2g_elements(hvd):
    """Rank 0 sends more than 2^31 elements to rank 1; every other block is small."""
    size, rank = hvd.size(), hvd.rank()
    label, small = "large.alltoall.int8", PERIOD + 5
    splits = [small] * size
    if rank == 0:
        splits[1] = BIG
    _require(hvd, 2 * BIG + 2 * size * size * small, label)
    clock = _Clock(hvd, f"{label}: one block of {BIG} x int8 from rank 0 to rank 1")
    x = _fill(torch.empty(sum(splits), dtype=torch.int8), _row(rank, torch.int8))
    out, received = clock.op(hvd.alltoall, x, splits=torch.tensor(splits), name=label)
    del x
    expect = [BIG if (src == 0 and rank == 1) else small for src in range(size)]
    assert received.tolist() == expect
    assert received.dtype == (torch.int64 if rank == 1 else torch.int32)  # int32 (Horovod's) where it fits
    offset = 0
    for src, c in enumerate(expect):
        # src's block for this rank starts at element (src's splits before this rank) of its input.
        phase = small * rank if src != 0 or rank <= 1 else small * (rank - 1) + BIG
        _check(out[offset:offset + c], _row(src, torch.int8, phase % PERIOD), f"{label} from rank {src}")
        offset += c
    assert offset == out.numel()
    clock.report()


def test_reducescatter_int8_over_2g_elements(hvd):
    """On one host the ring, with two part-sized scratch buffers (they stay with the channel until perseus
    shuts down: the next tests restart it)."""
    _reducescatter(hvd, RS_ROWS, RS_COLS, torch.int8, "large.reducescatter.int8", scratch_parts=2)


@pytest.fixture
def whole_units(hvd, request):
    """perseus restarted with every tensor one unit (no splitting) on request.param's algorithm."""
    old = restart(hvd, {"PERSEUS_FUSION_THRESHOLD": "0", "PERSEUS_ALLREDUCE_ALGORITHM": request.param})
    yield hvd
    restart(hvd, old)


@pytest.mark.parametrize("whole_units", ["mpi"], indirect=True)
def test_mpi_collectives_whole_tensors(whole_units):
    """A single MPI_Allreduce / MPI_Reduce_scatter would need counts above 2^31: the transport cuts them."""
    _allreduce(whole_units, BIG, torch.uint8, "large.mpi.allreduce_.uint8", in_place=True)
    _reducescatter(whole_units, RS_ROWS, RS_COLS, torch.int8, "large.mpi.reducescatter.int8", scratch_parts=0)


@pytest.mark.parametrize("whole_units", ["ring"], indirect=True)
def test_ring_collectives_whole_tensors(whole_units):
    """The ring on whole tensors: messages above 1 GiB between two ranks, cut by the transport."""
    hvd = whole_units
    _allgather(hvd, [BIG] + [PERIOD + r for r in range(1, hvd.size())], torch.int8, "large.ring.allgather.int8")
    _allreduce(hvd, BIG, torch.int8, "large.ring.allreduce_.int8", in_place=True)  # then a part of scratch
