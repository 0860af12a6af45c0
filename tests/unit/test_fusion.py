"""Unit tests for perseus.engine.fusion.plan_units (no MPI)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from perseus.engine.fusion import Piece, Unit, UnitKind, plan_units
from perseus.engine.messages import DType, Entry, OpType, make_signature, numpy_dtype

pytestmark = pytest.mark.timeout(60)

BIG = 1 << 40  # an inplace threshold no test tensor reaches


# ----------------------------------------------------------------------------- helpers

def ar(name, numel, dtype=DType.FLOAT32, reduce_op=1, prescale=1.0, postscale=1.0, shape=None):
    shape = (numel,) if shape is None else tuple(shape)
    sig = make_signature(OpType.ALLREDUCE, dtype, shape, reduce_op, -1, prescale, postscale)
    return Entry(name, sig, shape, input=np.zeros(shape, numpy_dtype(dtype)))


def other(name, op, shape=(4, 3), dtype=DType.FLOAT32, reduce_op=1, postscale=1.0):
    sig_shape = tuple(shape[1:]) if op in (OpType.ALLGATHER, OpType.ALLTOALL) else tuple(shape)
    root = 0 if op is OpType.BROADCAST else -1
    sig = make_signature(op, dtype, sig_shape, reduce_op, root, 1.0, postscale)
    return Entry(name, sig, tuple(shape), input=np.zeros(shape, numpy_dtype(dtype)))


def layout(units):
    """[(kind, [(name, offset, count, buf_offset), ...]), ...]"""
    return [(u.kind, [(p.entry.name, p.offset, p.count, p.buf_offset) for p in u.pieces]) for u in units]


def numel_of(entry):
    n = 1
    for d in entry.shape:
        n *= d
    return n


def check_cover(entries, units):
    """Every element of every entry is in exactly one unit; remaining equals the number of units with it."""
    covered = {id(e): [] for e in entries}
    units_of = {id(e): 0 for e in entries}
    for u in units:
        assert isinstance(u, Unit)
        assert u.numel == sum(p.count for p in u.pieces)
        assert u.nbytes == u.numel * u.dtype.itemsize
        buf = 0
        for p in u.pieces:
            assert isinstance(p, Piece)
            if u.kind is UnitKind.PACKED:
                assert p.buf_offset == buf, "pieces of a packed unit must be contiguous in the buffer"
                assert p.offset == 0 and p.count == numel_of(p.entry)
            buf += p.count
            covered[id(p.entry)].append((p.offset, p.count))
            units_of[id(p.entry)] += 1
    for e in entries:
        spans = sorted(covered[id(e)])
        pos = 0
        for off, cnt in spans:
            assert off == pos, f"{e.name}: gap or overlap at element {pos}"
            pos += cnt
        assert pos == numel_of(e), f"{e.name}: covered {pos} of {numel_of(e)} elements"
        assert e.remaining == units_of[id(e)] >= 1
    # units are emitted in the order of their first tensor, and an entry's chunks are adjacent
    index = {id(e): i for i, e in enumerate(entries)}
    firsts = [index[id(u.pieces[0].entry)] for u in units]
    assert firsts == sorted(firsts)
    flat = [p.entry.name for u in units for p in u.pieces if u.kind is not UnitKind.PACKED]
    runs = [n for i, n in enumerate(flat) if i == 0 or flat[i - 1] != n]
    assert len(runs) == len(set(runs))


# ----------------------------------------------------------------------------- packing

def test_small_tensors_pack_up_to_the_threshold_in_order():
    # float32; threshold 64 bytes = 16 elements
    entries = [ar("a", 4), ar("b", 4), ar("c", 8), ar("d", 2), ar("e", 16), ar("f", 1), ar("g", 3)]
    units = plan_units(entries, 64, BIG, 1)
    assert layout(units) == [
        (UnitKind.PACKED, [("a", 0, 4, 0), ("b", 0, 4, 4), ("c", 0, 8, 8)]),  # exactly 64 bytes
        (UnitKind.PACKED, [("d", 0, 2, 0)]),                                  # 8 + 64 > 64
        (UnitKind.PACKED, [("e", 0, 16, 0)]),
        (UnitKind.PACKED, [("f", 0, 1, 0), ("g", 0, 3, 1)]),
    ]
    assert [u.numel for u in units] == [16, 2, 16, 4]
    assert all(u.nbytes <= 64 for u in units)
    assert all(u.op_type is OpType.ALLREDUCE and u.dtype is DType.FLOAT32 for u in units)
    assert all(e.remaining == 1 for e in entries)
    check_cover(entries, units)


def test_packing_uses_element_offsets_for_8_byte_types():
    entries = [ar("a", 3, DType.FLOAT64), ar("b", 5, DType.FLOAT64), ar("c", 1, DType.FLOAT64)]
    units = plan_units(entries, 64, BIG, 1)  # 8 float64 per unit
    assert layout(units) == [
        (UnitKind.PACKED, [("a", 0, 3, 0), ("b", 0, 5, 3)]),
        (UnitKind.PACKED, [("c", 0, 1, 0)]),
    ]


def test_multidimensional_tensors_count_all_elements():
    entries = [ar("m", None, shape=(2, 3, 2)), ar("v", None, shape=(4,))]
    units = plan_units(entries, 1 << 20, BIG, 1)
    assert layout(units) == [(UnitKind.PACKED, [("m", 0, 12, 0), ("v", 0, 4, 12)])]
    assert units[0].numel == 16 and units[0].nbytes == 64


def _greedy_reference(sizes_bytes, threshold):
    """Independent greedy packer over byte sizes: list of groups of indices."""
    groups, cur, cur_bytes = [], [], 0
    for i, b in enumerate(sizes_bytes):
        if cur and cur_bytes + b <= threshold:
            cur.append(i)
            cur_bytes += b
        else:
            if cur:
                groups.append(cur)
            cur, cur_bytes = [i], b
    if cur:
        groups.append(cur)
    return groups


@pytest.mark.parametrize("seed", range(8))
def test_random_small_tensors_match_greedy_reference(seed):
    rng = random.Random(seed)
    threshold = rng.choice([64, 100, 256, 1000])
    entries = [ar(f"t{i}", rng.randint(1, threshold // 4)) for i in range(rng.randint(1, 40))]
    units = plan_units(entries, threshold, BIG, 1)
    expected = _greedy_reference([4 * numel_of(e) for e in entries], threshold)
    assert [[entries.index(p.entry) for p in u.pieces] for u in units] == expected
    assert all(u.kind is UnitKind.PACKED and u.nbytes <= threshold for u in units)
    check_cover(entries, units)


# ----------------------------------------------------------------------------- in place

@pytest.mark.parametrize("numel,dtype,fusion,expected", [
    (37, DType.FLOAT32, 40, [(0, 10), (10, 10), (20, 10), (30, 7)]),
    (40, DType.FLOAT32, 40, [(0, 10), (10, 10), (20, 10), (30, 10)]),
    (41, DType.FLOAT32, 40, [(0, 10), (10, 10), (20, 10), (30, 10), (40, 1)]),
    (25, DType.FLOAT64, 100, [(0, 12), (12, 12), (24, 1)]),   # 100 // 8 = 12 elements per unit
    (30, DType.FLOAT16, 22, [(0, 11), (11, 11), (22, 8)]),
    (64, DType.BFLOAT16, 4096, [(0, 64)]),                     # >= inplace threshold, below fusion threshold
    (9, DType.INT64, 4, [(k, 1) for k in range(9)]),           # threshold below the item size: 1 element
])
def test_large_tensor_is_split_into_inplace_chunks(numel, dtype, fusion, expected):
    inplace = 16  # bytes: every tensor here is at least this large
    e = ar("big", numel, dtype)
    units = plan_units([e], fusion, inplace, 1)
    assert [(u.kind, u.pieces[0].offset, u.pieces[0].count) for u in units] == \
        [(UnitKind.INPLACE, off, cnt) for off, cnt in expected]
    assert all(len(u.pieces) == 1 and u.pieces[0].entry is e for u in units)
    assert all(u.numel == u.pieces[0].count and u.dtype is dtype for u in units)
    assert all(u.nbytes <= max(fusion, dtype.itemsize) for u in units)
    assert e.remaining == len(expected)
    check_cover([e], units)


def test_inplace_threshold_boundary():
    below, at = ar("below", 63), ar("at", 64)  # float32: 252 and 256 bytes
    units = plan_units([below, at], 1 << 20, 256, 1)
    assert [u.kind for u in units] == [UnitKind.PACKED, UnitKind.INPLACE]
    assert units[1].pieces[0].entry is at and units[1].numel == 64


def test_packed_unit_stays_open_across_inplace_units():
    entries = [ar("a", 2), ar("big", 100), ar("b", 2), ar("c", 2)]
    units = plan_units(entries, 64, 200, 1)
    assert layout(units) == [
        (UnitKind.PACKED, [("a", 0, 2, 0), ("b", 0, 2, 2), ("c", 0, 2, 4)]),
        (UnitKind.INPLACE, [("big", 0, 16, 0)]),
        (UnitKind.INPLACE, [("big", 16, 16, 0)]),
        (UnitKind.INPLACE, [("big", 32, 16, 0)]),
        (UnitKind.INPLACE, [("big", 48, 16, 0)]),
        (UnitKind.INPLACE, [("big", 64, 16, 0)]),
        (UnitKind.INPLACE, [("big", 80, 16, 0)]),
        (UnitKind.INPLACE, [("big", 96, 4, 0)]),
    ]
    assert entries[1].remaining == 7
    check_cover(entries, units)


def test_no_unit_exceeds_fusion_threshold_when_tensor_is_between_thresholds():
    e = ar("mid", 100)  # 400 bytes: above fusion (64), below inplace (1024)
    units = plan_units([e], 64, 1024, 1)
    check_cover([e], units)
    assert max(u.nbytes for u in units) <= 64


# ----------------------------------------------------------------------------- what may share a unit

@pytest.mark.parametrize("a,b", [
    (dict(dtype=DType.FLOAT32), dict(dtype=DType.INT32)),
    (dict(dtype=DType.FLOAT16), dict(dtype=DType.BFLOAT16)),
    (dict(reduce_op=1), dict(reduce_op=4)),
    (dict(reduce_op=3), dict(reduce_op=4)),
    (dict(prescale=1.0), dict(prescale=0.5)),
    (dict(postscale=1.0), dict(postscale=2.0)),
    (dict(reduce_op=0), dict(reduce_op=1)),           # Average (postscale 1/4) vs Sum (postscale 1)
])
def test_units_do_not_mix_dtypes_ops_or_scales(a, b):
    entries = [ar("x1", 2, **a), ar("y1", 2, **b), ar("y2", 2, **b), ar("x2", 2, **a)]
    units = plan_units(entries, 1 << 20, BIG, 4)
    assert layout(units) == [
        (UnitKind.PACKED, [("x1", 0, 2, 0), ("x2", 0, 2, 2)]),
        (UnitKind.PACKED, [("y1", 0, 2, 0), ("y2", 0, 2, 2)]),
    ]
    for u in units:
        sigs = {(p.entry.signature.dtype, p.entry.signature.reduce_op, p.entry.signature.prescale,
                 p.entry.signature.postscale) for p in u.pieces}
        assert len(sigs) == 1
        assert u.dtype is u.pieces[0].entry.signature.dtype
        assert u.prescale == u.pieces[0].entry.signature.prescale


def test_identical_attributes_share_one_unit():
    entries = [ar(f"t{i}", 3, DType.FLOAT16, reduce_op=5, prescale=0.25, postscale=3.0) for i in range(5)]
    units = plan_units(entries, 1 << 20, BIG, 2)
    assert len(units) == 1
    u = units[0]
    assert (u.kind, u.dtype, u.reduce_op, u.prescale, u.postscale, u.numel) == \
        (UnitKind.PACKED, DType.FLOAT16, 5, 0.25, 3.0, 15)


# ----------------------------------------------------------------------------- average

@pytest.mark.parametrize("divisor", [1, 2, 3, 7])
@pytest.mark.parametrize("postscale", [1.0, 2.0, 0.3])
@pytest.mark.parametrize("inplace", [False, True])
def test_average_becomes_sum_with_postscale(divisor, postscale, inplace):
    e = ar("avg", 8, reduce_op=0, postscale=postscale, prescale=0.5)
    units = plan_units([e], 64, 16 if inplace else BIG, divisor)
    assert all(u.kind is (UnitKind.INPLACE if inplace else UnitKind.PACKED) for u in units)
    for u in units:
        assert u.reduce_op == 1
        assert u.postscale == pytest.approx(postscale * (1.0 / divisor), rel=1e-15)
        assert u.prescale == 0.5
    assert e.signature.reduce_op == 0  # the signature itself is untouched


@pytest.mark.parametrize("op", [1, 2, 3, 4, 5])
def test_other_reductions_keep_op_and_postscale(op):
    e = ar("t", 4, reduce_op=op, postscale=1.5)
    (u,) = plan_units([e], 1 << 20, BIG, 4)
    assert u.reduce_op == op and u.postscale == 1.5


def test_reducescatter_average_postscale_divided():
    e = other("rs", OpType.REDUCESCATTER, shape=(8, 2), reduce_op=0, postscale=3.0)
    (u,) = plan_units([e], 1 << 20, BIG, 4)
    assert u.kind is UnitKind.SINGLE and u.op_type is OpType.REDUCESCATTER
    assert u.postscale == pytest.approx(0.75, rel=1e-15)


# ----------------------------------------------------------------------------- other ops

@pytest.mark.parametrize("op", [OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL, OpType.REDUCESCATTER])
def test_non_allreduce_ops_are_single_units_between_packed_tensors(op):
    entries = [ar("a", 2), ar("b", 2), other("x", op, shape=(4, 3)), ar("c", 2), other("y", op, shape=(2, 3)),
               ar("d", 2)]
    units = plan_units(entries, 1 << 20, BIG, 2)
    assert layout(units) == [
        (UnitKind.PACKED, [("a", 0, 2, 0), ("b", 0, 2, 2), ("c", 0, 2, 4), ("d", 0, 2, 6)]),
        (UnitKind.SINGLE, [("x", 0, 12, 0)]),
        (UnitKind.SINGLE, [("y", 0, 6, 0)]),
    ]
    assert units[1].op_type is op and units[2].op_type is op
    assert units[1].numel == 12
    assert all(e.remaining == 1 for e in entries)
    check_cover(entries, units)


def test_large_non_allreduce_is_not_split():
    e = other("g", OpType.ALLGATHER, shape=(1000, 10))
    (u,) = plan_units([e], 64, 16, 1)
    assert u.kind is UnitKind.SINGLE and u.numel == 10000 and e.remaining == 1


def test_barrier_is_a_single_unit():
    sig = make_signature(OpType.BARRIER, DType.UINT8, ())
    e = Entry("barrier", sig, (), input=None)
    (u,) = plan_units([e], 1 << 20, BIG, 3)
    assert u.kind is UnitKind.SINGLE and u.op_type is OpType.BARRIER and e.remaining == 1


# ----------------------------------------------------------------------------- threshold 0, empty tensors

@pytest.mark.parametrize("fusion", [0, -1])
def test_fusion_threshold_zero_gives_one_unit_per_tensor(fusion):
    entries = [ar("a", 1), ar("b", 3), ar("c", 1000), ar("d", 2, DType.FLOAT64), ar("e", 0)]
    units = plan_units(entries, fusion, BIG, 1)
    assert len(units) == len(entries)
    assert [[p.entry.name for p in u.pieces] for u in units] == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert [u.numel for u in units] == [1, 3, 1000, 2, 0]
    assert all(e.remaining == 1 for e in entries)
    check_cover(entries, units)


@pytest.mark.parametrize("fusion,inplace", [(1 << 20, BIG), (0, BIG), (64, 0), (64, 1)])
def test_zero_element_tensor_alone(fusion, inplace):
    e = ar("empty", 0)
    units = plan_units([e], fusion, inplace, 2)
    assert len(units) == 1
    assert units[0].numel == 0 and units[0].nbytes == 0
    assert [(p.entry, p.offset, p.count) for p in units[0].pieces] == [(e, 0, 0)]
    assert e.remaining == 1


def test_zero_element_tensor_among_others():
    entries = [ar("a", 4), ar("empty", None, shape=(3, 0)), ar("b", 4)]
    units = plan_units(entries, 1 << 20, BIG, 1)
    check_cover(entries, units)
    assert sum(u.numel for u in units) == 8


def test_empty_list():
    assert plan_units([], 1 << 20, BIG, 1) == []


# ----------------------------------------------------------------------------- random mixes

@pytest.mark.parametrize("seed", range(10))
def test_random_mix_covers_every_entry_exactly(seed):
    rng = random.Random(1000 + seed)
    fusion = rng.choice([0, 16, 64, 256, 4096])
    inplace = rng.choice([0, 32, 128, 1024])
    dtypes = [DType.FLOAT32, DType.FLOAT16, DType.FLOAT64, DType.INT32, DType.BFLOAT16]
    entries = []
    for i in range(rng.randint(1, 30)):
        kind = rng.random()
        if kind < 0.8:
            entries.append(ar(f"t{i}", rng.choice([0, 1, 2, 5, 17, 64, 300]), rng.choice(dtypes),
                              reduce_op=rng.choice([0, 1, 4]), postscale=rng.choice([1.0, 0.5])))
        else:
            entries.append(other(f"t{i}", rng.choice([OpType.ALLGATHER, OpType.BROADCAST]),
                                 shape=(rng.randint(0, 5), 3)))
    units = plan_units(entries, fusion, inplace, 3)
    check_cover(entries, units)
    for u in units:
        if u.kind is UnitKind.PACKED:
            assert len({p.entry.signature.dtype for p in u.pieces}) == 1
            assert len({1 if p.entry.signature.reduce_op == 0 else p.entry.signature.reduce_op
                        for p in u.pieces}) == 1
            if len(u.pieces) > 1:
                assert u.nbytes <= fusion
        if u.kind is UnitKind.INPLACE and fusion > 0:
            assert u.nbytes <= max(fusion, u.dtype.itemsize)
        if u.op_type is OpType.ALLREDUCE:
            assert u.reduce_op != 0
