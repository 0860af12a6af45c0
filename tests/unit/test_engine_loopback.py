"""Unit tests of the native engine (perseus._core) over the in-process loopback transport, without mpirun.

Each test builds a simulated job of N ranks in this process: N native engines, one per rank, joined by a
``perseus._core.LoopbackWorld`` (its ranks are threads). Every rank is driven from its own Python thread, as
a real job drives each process from its main thread, so the engines negotiate, fuse and run their channels
exactly as they do over MPI. The tests check what the protocol promises, not how the core is written:

* every collective and dtype gives the right answer on every rank (NumPy references that follow the
  documented arithmetic: combine in rank order, 16-bit floats in float32 rounded once per combine, integer
  scaling truncating toward zero);
* requests complete whatever order (and grouping) each rank submits them in; priorities order execution;
* disagreements between ranks raise the same MismatchError text on every rank, naming the tensor, the ranks
  and the fix; a duplicate in-flight name is a ValueError;
* a bounded name cache (evicting and renegotiating) keeps results right;
* fusion (packed units, in-place chunks, several channels, scale factors, empty tensors) keeps results right;
* join, transport failures, a dead world and shutdown fail or finish every rank as documented;
* the timeline records each request's negotiation, execution and fusion activities.

A hang fails the test (every wait and thread join has a timeout) instead of blocking the run.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import types
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perseus.base.exceptions import MismatchError, PerseusInternalError, StallError
from perseus.engine.messages import DType, OpType, Request, Timing, numpy_dtype
from perseus.engine.native import ENGINE_SETTINGS, Engine, load_core

pytestmark = pytest.mark.timeout(120)

core = load_core()

WAIT_S = 10.0  # one request; far above anything a healthy run needs
JOIN_S = 30.0  # one rank thread

SUM, AVERAGE, MIN, MAX, PRODUCT = 1, 0, 3, 4, 5

ALLREDUCE, ALLGATHER, BROADCAST = int(OpType.ALLREDUCE), int(OpType.ALLGATHER), int(OpType.BROADCAST)
ALLTOALL, REDUCESCATTER, BARRIER = int(OpType.ALLTOALL), int(OpType.REDUCESCATTER), int(OpType.BARRIER)

ALL_DTYPES = list(DType)

# Every engine setting, with values that keep tests fast and deterministic; tests override some.
DEFAULTS = dict(fusion_threshold_bytes=4 << 20, inplace_threshold_bytes=256 << 10, cycle_time_ms=0.0,
                num_channels=1, allreduce_algorithm="auto", hierarchical_allreduce=False, cache_capacity=4096,
                stall_check_disable=True, stall_check_time_s=60.0, stall_shutdown_time_s=0.0, idle_poll_max_ms=5.0,
                hierarchical_allgather=False, huge_pages=True, network_interface="", link_timeout_s=30.0,
                max_channels=0, autotune=False, device_fusion_threshold_bytes=64 << 20, device_bucket_bytes=25 << 20,
                device_cycle_time_ms=1.0, engine_lane_bytes=64 << 10)

# Timeline event kinds (native/timeline.h).
NEGOTIATE_START, OP_START, ACTIVITY, OP_END, CYCLE = 0, 1, 2, 3, 4


# ----------------------------------------------------------------------------- the simulated job

class Sim:
    """N native engines over one loopback world; ``run`` calls a function on every rank's own thread."""

    def __init__(self, n: int, *, world_ranks=None, start: bool = True, hosts=None, **overrides):
        unknown = set(overrides) - set(DEFAULTS)
        assert not unknown, f"unknown engine settings {unknown}"
        self.n = n
        self.settings = dict(DEFAULTS, **overrides)
        self.world = core.LoopbackWorld(n)
        self.world_ranks = list(world_ranks) if world_ranks is not None else list(range(n))
        hosts = list(hosts) if hosts is not None else [0] * n  # host key per rank
        self.engines = [Engine(types.SimpleNamespace(**self.settings), self.world_ranks[r], host_key=hosts[r])
                        for r in range(n)]
        self.closed = False
        self.troubled = False  # a rank raised or hung: peers may be stuck inside a collective

        def setup(r, e):  # adding a set is collective (it duplicates the communicator for each channel)
            e.add_loopback_process_set(0, self.world, r, self.world_ranks)
            if start:
                e.start()

        self.run(setup)

    # -- driving the ranks -----------------------------------------------------------------------------
    def outcomes(self, fn: Callable[[int, Engine], Any], ranks=None, timeout: float = JOIN_S):
        """fn(rank, engine) on one thread per rank; [(value, exception)] in rank order."""
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        out: dict[int, tuple] = {}

        def body(r):
            try:
                out[r] = (fn(r, self.engines[r]), None)
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                out[r] = (None, exc)

        threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in ranks]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        hung = [r for r, t in zip(ranks, threads) if t.is_alive()]
        if hung:
            # Unblock them (every wait fails once the world has failed) so the process can go on.
            self.troubled = True
            self.world.fail("test harness: rank threads hung")
            for t in threads:
                t.join(5.0)
            pytest.fail(f"ranks {hung} did not finish within {timeout} s (a hang in the engine?)")
        if any(exc is not None for _, exc in out.values()):
            self.troubled = True
        return [out[r] for r in ranks]

    def run(self, fn: Callable[[int, Engine], Any], ranks=None, timeout: float = JOIN_S) -> list:
        """As outcomes(), but re-raise the first exception (with its rank) and return the values."""
        results = self.outcomes(fn, ranks, timeout)
        ranks = list(range(self.n)) if ranks is None else list(ranks)
        for r, (_, exc) in zip(ranks, results):
            if exc is not None:
                raise AssertionError(f"rank {r} raised {type(exc).__name__}: {exc}") from exc
        return [v for v, _ in results]

    def close(self) -> list[bool]:
        """Shut every engine down; returns each engine's ``clean``."""
        if self.closed:
            return [e.clean for e in self.engines]
        self.closed = True
        if self.troubled or any(e.failed for e in self.engines):
            # A failed rank may have left peers' threads inside a collective that will never complete:
            # failing the world releases them, so shutdown is prompt and leaves no thread behind.
            self.world.fail("test harness: tearing down a failed job")
        for e in self.engines:
            e.shutdown(10.0)
        return [e.clean for e in self.engines]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def make_sim():
    sims = []

    def make(n, **kw):
        s = Sim(n, **kw)
        sims.append(s)
        return s

    yield make
    for s in sims:
        s.close()


# ----------------------------------------------------------------------------- requests

def item(name, dtype, x, out, *, op=SUM, root=-1, pre=1.0, post=1.0, prio=0, splits=None, shape=None,
         timing=Timing.FULL):
    """One request as perseus.runtime.collectives builds it."""
    shape = tuple(x.shape if x is not None else out.shape) if shape is None else tuple(shape)
    return Request(name=name, dtype=int(dtype), shape=shape, input=x, output=out, reduce_op=int(op),
                   root_rank=int(root), prescale=float(pre), postscale=float(post), priority=int(prio), splits=splits,
                   timing=timing)


def RESULTS(results):
    """A finish that returns what the engine produced: per request None, or (array, received_splits)."""
    return results


def submit(e: Engine, op_type: int, items, keep=None, finish=None) -> int:
    return e.submit(0, op_type, items, finish, keep)


def wait(e: Engine, hid: int):
    """The handle's value (None without a finish; the last rank for a join; finish(results)); raises the
    request's error; TimeoutError instead of hanging."""
    return e.wait(hid, WAIT_S)


def error_of(e: Engine, hid: int) -> BaseException:
    with pytest.raises(PerseusInternalError) as info:
        wait(e, hid)
    return info.value


# ----------------------------------------------------------------------------- NumPy references

def f32_to_bf16(a) -> np.ndarray:
    """float32 -> bfloat16 words, round to nearest even (what the kernels do for finite values)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(u) -> np.ndarray:
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def widen(x, dt):
    if dt is DType.FLOAT16:
        return x.astype(np.float32)
    if dt is DType.BFLOAT16:
        return bf16_to_f32(x)
    return x


def narrow(f, dt):
    if dt is DType.FLOAT16:
        return np.asarray(f, np.float32).astype(np.float16)
    if dt is DType.BFLOAT16:
        return f32_to_bf16(f)
    return f


def ref_combine(a, b, dt, op):
    if dt is DType.BOOL:
        return (a | b) if op in (SUM, AVERAGE, MAX) else (a & b)
    fn = {SUM: np.add, AVERAGE: np.add, MIN: np.minimum, MAX: np.maximum, PRODUCT: np.multiply}[op]
    if dt in (DType.FLOAT16, DType.BFLOAT16):  # in float32, rounded once per combine
        return narrow(fn(widen(a, dt), widen(b, dt)), dt)
    with np.errstate(over="ignore"):
        return fn(a, b).astype(a.dtype)  # integers wrap around, as NumPy's do


def ref_scale(x, dt, factor: float):
    if dt is DType.BOOL:
        return x
    if dt in (DType.FLOAT16, DType.BFLOAT16):
        return narrow(widen(x, dt) * np.float32(factor), dt)
    if dt is DType.FLOAT32:
        return (x * np.float32(factor)).astype(np.float32)
    if dt is DType.FLOAT64:
        return x * factor
    return np.trunc(x.astype(np.float64) * factor).astype(np.int64).astype(x.dtype)  # toward zero


def ref_reduce(contribs, dt, op=SUM, pre=1.0, post=1.0):
    """What allreduce (and reducescatter before the split) gives: prescale, combine in rank order, postscale
    (Average is Sum with postscale/size)."""
    n = len(contribs)
    if op == AVERAGE:
        post = post / n
    cs = [ref_scale(c, dt, pre) if pre != 1.0 else c.copy() for c in contribs]
    acc = cs[0]
    for c in cs[1:]:
        acc = ref_combine(acc, c, dt, op)
    return ref_scale(acc, dt, post) if post != 1.0 else acc


def random_data(rng: np.random.Generator, dt: DType, shape, *, small_ints=False) -> np.ndarray:
    """Values whose reductions stay in range. small_ints: values whose sums are exact in every dtype (so
    the result does not depend on the order in which ranks' values are combined)."""
    npdt = numpy_dtype(dt)
    if dt is DType.BOOL:
        return rng.random(shape) < 0.5
    if dt in (DType.UINT8, DType.UINT16):
        return rng.integers(0, 10, shape).astype(npdt)
    if np.issubdtype(npdt, np.integer) and dt is not DType.BFLOAT16:  # bfloat16 words are uint16
        return rng.integers(-10, 10, shape).astype(npdt)
    f = rng.integers(-8, 9, shape).astype(np.float32) if small_ints else rng.uniform(-4, 4, shape).astype(np.float32)
    if dt is DType.BFLOAT16:
        return f32_to_bf16(f)
    return f.astype(npdt)


def assert_same(got, want, what=""):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        raise AssertionError(f"{what}: {bad.size} of {got.size} elements differ, first at {bad[:5].tolist()}: "
                             f"got {got.reshape(-1)[bad[:5]].tolist()} want {want.reshape(-1)[bad[:5]].tolist()}")


def even_counts(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def mismatch_text(op: str, name: str, field: str, ranks_b, vb: str, ranks_a, va: str) -> str:
    """The MismatchError text, as the Python engine produced it (and its tests asserted)."""
    fixes = {"shape": "every rank must submit the same shape for a name",
             "dtype": "every rank must submit the same dtype for a name",
             "op_type": "every rank must call the same collective for a name",
             "reduce_op": "every rank must use the same op for a name",
             "root_rank": "every rank must pass the same root_rank",
             "prescale_factor": "every rank must pass the same prescale_factor",
             "postscale_factor": "every rank must pass the same postscale_factor",
             "priority": "every rank must pass the same priority",
             "shape after the first dimension": "only the first dimension may differ between ranks"}
    op = "collective" if field == "op_type" else op
    return (f"perseus.{op}({name!r}): ranks {list(ranks_b)} sent {field} {vb} but ranks {list(ranks_a)} sent "
            f"{va}; {fixes[field]}.")


def joined_text(op: str, name: str) -> str:
    return (f"perseus.{op}({name!r}): one or more ranks have called join(); only allreduce can run until every "
            f"rank has joined. Call {op} before join() on every rank.")


# ============================================================================= settings and references

def test_defaults_name_every_engine_setting():
    assert set(DEFAULTS) == set(ENGINE_SETTINGS)


def test_bfloat16_reference_rounds_to_nearest_even():
    # The reference itself must be right: bfloat16 keeps 7 mantissa bits; ties go to the even word.
    one, ulp = 1.0, 2.0 ** -7
    values = np.array([one, one + ulp / 2, one + ulp + ulp / 2, one + ulp / 4, one + 3 * ulp / 4, -one - ulp / 2,
                       np.float32(3.4e38)], np.float32)
    assert f32_to_bf16(values).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F80, 0x3F81, 0xBF80, 0x7F80]  # 3.4e38: inf
    words = np.arange(0, 1 << 16, 7, dtype=np.uint16)
    finite = words[(words & 0x7F80) != 0x7F80]
    assert (f32_to_bf16(bf16_to_f32(finite)) == finite).all()


# ============================================================================= every op and dtype

SCALES = [(1.0, 1.0), (0.5, 3.0)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allreduce_every_dtype_op_and_scale(make_sim, n):
    sim = make_sim(n, allreduce_algorithm="mpi")  # rank-order reduction: results reproducible bit for bit
    rng = np.random.default_rng(n)
    cases = []
    for dt, op, (pre, post) in itertools.product(ALL_DTYPES, [SUM, AVERAGE, MIN, MAX, PRODUCT], SCALES):
        if dt is DType.BOOL and op == AVERAGE:
            continue  # rejected before it reaches the engine
        shape = (3, 5) if len(cases) % 2 else (7,)
        data = [random_data(rng, dt, shape) for _ in range(n)]
        cases.append((f"ar.{dt.name}.{op}.{pre}", dt, op, pre, post, data))

    def rank(r, e):
        order = list(range(len(cases)))
        random.Random(r).shuffle(order)  # each rank submits in its own order
        hids = {}
        outs = {}
        for i in order:
            name, dt, op, pre, post, data = cases[i]
            x = data[r].copy()
            outs[i] = np.zeros_like(x)
            hids[i] = submit(e, ALLREDUCE, [item(name, dt, x, outs[i], op=op, pre=pre, post=post)], (x, outs[i]))
        for i in order:
            assert wait(e, hids[i]) is None
        return outs

    outs = sim.run(rank)
    for i, (name, dt, op, pre, post, data) in enumerate(cases):
        want = ref_reduce(data, dt, op, pre, post)
        for r in range(n):
            assert_same(outs[r][i], want, f"{name} on rank {r}")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allgather_every_dtype(make_sim, n):
    sim = make_sim(n)
    rng = np.random.default_rng(10 + n)
    cases = []
    for dt in ALL_DTYPES:
        rows = [(r + 1) % 3 for r in range(n)]  # rank 2 sends no rows
        cases.append((f"ag.{dt.name}", dt, [random_data(rng, dt, (rows[r], 2, 3)) for r in range(n)]))
    cases.append(("ag.scalar", DType.FLOAT64, [np.array(float(r), np.float64) for r in range(n)]))

    def rank(r, e):
        got = {}
        hids = {name: submit(e, ALLGATHER, [item(name, dt, d[r], None, shape=d[r].shape or (1,))], d[r], RESULTS)
                for name, dt, d in cases}
        for name, hid in hids.items():
            got[name] = wait(e, hid)[0]
        return got

    for r, got in enumerate(sim.run(rank)):
        for name, dt, d in cases:
            arr, splits = got[name]
            want = np.concatenate([x.reshape((-1,) + x.shape[1:]) if x.ndim else x.reshape(1) for x in d])
            assert_same(arr, want, f"{name} on rank {r}")
            assert splits.tolist() == [x.shape[0] if x.ndim else 1 for x in d]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_broadcast_every_dtype_and_root(make_sim, n):
    sim = make_sim(n)
    rng = np.random.default_rng(20 + n)
    cases = [(f"bc.{dt.name}.{root}.{inplace}", dt, root, inplace,
              [random_data(rng, dt, (4, 3)) for _ in range(n)])
             for dt in ALL_DTYPES for root in range(n) for inplace in (False, True)]

    def rank(r, e):
        outs, hids = {}, {}
        for name, dt, root, inplace, d in cases:
            x = d[r].copy()
            out = x if inplace else np.zeros_like(x)
            outs[name] = out
            hids[name] = submit(e, BROADCAST, [item(name, dt, x, out, root=root)], (x, out))
        for hid in hids.values():
            wait(e, hid)
        return outs

    for r, outs in enumerate(sim.run(rank)):
        for name, dt, root, inplace, d in cases:
            assert_same(outs[name], d[root], f"{name} on rank {r}")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_alltoall_every_dtype(make_sim, n):
    sim = make_sim(n)
    rng = np.random.default_rng(30 + n)
    cases = []
    for dt in ALL_DTYPES:
        splits = [rng.integers(0, 3, n).tolist() for _ in range(n)]  # splits[src][dst]
        data = [random_data(rng, dt, (sum(splits[r]), 2)) for r in range(n)]
        cases.append((f"a2a.{dt.name}", dt, splits, data))

    def rank(r, e):
        hids = {name: submit(e, ALLTOALL, [item(name, dt, d[r], None, splits=sp[r])], d[r], RESULTS)
                for name, dt, sp, d in cases}
        return {name: wait(e, hid)[0] for name, hid in hids.items()}

    for r, got in enumerate(sim.run(rank)):
        for name, dt, sp, d in cases:
            arr, recv = got[name]
            parts = [d[src][sum(sp[src][:r]):sum(sp[src][:r + 1])] for src in range(n)]
            assert_same(arr, np.concatenate(parts), f"{name} on rank {r}")
            assert recv.tolist() == [sp[src][r] for src in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reducescatter_every_dtype_op_and_scale(make_sim, n):
    sim = make_sim(n)
    rng = np.random.default_rng(40 + n)
    rows = 2 * n + 1  # uneven: the first ranks get one row more
    counts = even_counts(rows, n)
    cases = []
    for dt, op, (pre, post) in itertools.product(ALL_DTYPES, [SUM, AVERAGE, MIN, MAX], SCALES):
        if dt is DType.BOOL and op == AVERAGE:
            continue
        cases.append((f"rs.{dt.name}.{op}.{pre}", dt, op, pre, post,
                      [random_data(rng, dt, (rows, 3)) for _ in range(n)]))

    def rank(r, e):
        outs, hids = {}, {}
        for name, dt, op, pre, post, d in cases:
            out = np.zeros((counts[r], 3), d[r].dtype)
            outs[name] = out
            hids[name] = submit(e, REDUCESCATTER, [item(name, dt, d[r], out, op=op, pre=pre, post=post)],
                                (d[r], out))
        for hid in hids.values():
            wait(e, hid)
        return outs

    for r, outs in enumerate(sim.run(rank)):
        start = sum(counts[:r])
        for name, dt, op, pre, post, d in cases:
            want = ref_reduce(d, dt, op, pre, post)[start:start + counts[r]]
            assert_same(outs[name], want, f"{name} on rank {r}")


@pytest.mark.parametrize("n", [1, 3])
def test_barrier_and_finish_object(make_sim, n):
    sim = make_sim(n)
    marker = object()

    def rank(r, e):
        for k, finish in enumerate([None, (marker,), lambda results: (marker, results)]):
            hid = submit(e, BARRIER, [Request(name=f"barrier.{k}", dtype=DType.UINT8, shape=())],
                         finish=finish)
            value = wait(e, hid)
            assert value == [None, marker, (marker, [None])][k]
            assert e.wait(hid) is None  # collected: the id is forgotten
            with pytest.raises(ValueError, match="unknown handle"):
                e.poll(hid)
        return True

    assert sim.run(rank) == [True] * n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_grouped_submissions(make_sim, n):
    sim = make_sim(n, fusion_threshold_bytes=256, inplace_threshold_bytes=512)
    rng = np.random.default_rng(50 + n)
    specs = [(DType.FLOAT32, (10,)), (DType.INT64, (3, 3)), (DType.FLOAT16, (200,)), (DType.FLOAT32, (0,)),
             (DType.BFLOAT16, (5,)), (DType.FLOAT64, (1000,))]
    data = [[random_data(rng, dt, shape, small_ints=True) for dt, shape in specs] for _ in range(n)]
    gather = [[random_data(rng, DType.INT32, (r + 1, 2)) for r in range(n)] for _ in range(3)]

    def rank(r, e):
        xs = [d.copy() for d in data[r]]
        outs = [np.zeros_like(x) for x in xs]
        items = [item(f"grp.{i}", dt, x, o, op=AVERAGE) for i, ((dt, _), x, o) in enumerate(zip(specs, xs, outs))]
        hid = submit(e, ALLREDUCE, items, (xs, outs), finish=RESULTS)
        ghid = submit(e, ALLGATHER, [item(f"ggrp.{i}", DType.INT32, g[r], None) for i, g in enumerate(gather)],
                      finish=RESULTS)
        assert wait(e, hid) == [None] * len(specs)
        gres = wait(e, ghid)
        return outs, gres

    for r, (outs, gres) in enumerate(sim.run(rank)):
        for i, (dt, _) in enumerate(specs):
            assert_same(outs[i], ref_reduce([d[i] for d in data], dt, AVERAGE), f"grp.{i} on rank {r}")
        assert len(gres) == len(gather)
        for g, (arr, splits) in zip(gather, gres):
            assert_same(arr, np.concatenate(g), f"ggrp on rank {r}")
            assert splits.tolist() == [x.shape[0] for x in g]


# ============================================================================= negotiation

@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(2, 4), k=st.integers(1, 12), cycle=st.sampled_from([0.0, 0.2]))
def test_requests_in_different_orders_and_groups_complete(data, n, k, cycle):
    """Each rank submits the same names in its own order, grouped its own way; everything completes."""
    plans = []
    for _ in range(n):
        order = data.draw(st.permutations(range(k)))
        cuts = sorted(data.draw(st.sets(st.integers(1, max(k - 1, 1)), max_size=k)) if k > 1 else [])
        groups = [list(order[a:b]) for a, b in zip([0] + cuts, cuts + [k]) if a < b]
        plans.append(groups)
    rng = np.random.default_rng(k)
    contrib = [[rng.integers(-50, 50, (i % 5 + 1,)).astype(np.int32) for i in range(k)] for _ in range(n)]
    with Sim(n, cycle_time_ms=cycle) as sim:
        def rank(r, e):
            outs = [np.zeros_like(c) for c in contrib[r]]
            hids = [submit(e, ALLREDUCE, [item(f"t{i}", DType.INT32, contrib[r][i], outs[i]) for i in g])
                    for g in plans[r]]
            for hid in hids:
                wait(e, hid)
            return outs

        for outs in sim.run(rank):
            for i in range(k):
                assert_same(outs[i], sum(contrib[r][i] for r in range(n)).astype(np.int32), f"t{i}")


@pytest.mark.parametrize("n", [2, 3])
def test_two_hundred_names_over_several_negotiation_words(make_sim, n):
    sim = make_sim(n)
    names = [f"layer{i:03d}" for i in range(200)]
    subset = sorted({0, 1, 62, 63, 64, 65, 127, 128, 129, 190, 191, 192, 199} | set(range(3, 200, 17)))

    def rank(r, e):
        rng = random.Random(r)
        for step, chosen in enumerate([list(range(200)), subset, list(range(150, 200))]):
            order = list(chosen)
            rng.shuffle(order)
            xs = {i: np.full(i % 7 + 1, (r + 1) * (i + step), np.int64) for i in order}
            hids = [submit(e, ALLREDUCE, [item(names[i], DType.INT64, xs[i], xs[i])]) for i in order]
            for hid in hids:
                wait(e, hid)
            for i in order:
                assert xs[i].tolist() == [(i + step) * n * (n + 1) // 2] * (i % 7 + 1), (step, names[i])
        return True

    assert sim.run(rank) == [True] * n


@pytest.mark.parametrize("n", [2, 3])
def test_name_pending_on_some_ranks_waits_without_blocking_others(make_sim, n):
    """A name only rank 0 has submitted waits; names every rank submits meanwhile complete, step after step."""
    sim = make_sim(n)
    late_in = [np.full(4, r + 1, np.float32) for r in range(n)]
    released = threading.Event()

    def rank(r, e):
        late_out = np.zeros(4, np.float32)
        late = submit(e, ALLREDUCE, [item("late", DType.FLOAT32, late_in[r], late_out)]) if r == 0 else None
        for step in range(5):
            x = np.full(3, step + r, np.float32)
            o = np.zeros_like(x)
            wait(e, submit(e, ALLREDUCE, [item(f"early.{step}", DType.FLOAT32, x, o)]))
            assert o.tolist() == [sum(step + q for q in range(n))] * 3
        if r == 0:
            assert not e.poll(late), "'late' completed before every rank submitted it"
            released.set()
        else:
            assert released.wait(WAIT_S)
            late = submit(e, ALLREDUCE, [item("late", DType.FLOAT32, late_in[r], late_out)])
        wait(e, late)
        return late_out

    for out in sim.run(rank):
        assert out.tolist() == [n * (n + 1) / 2] * 4


@pytest.mark.parametrize("n", [1, 2, 3])
def test_priorities_run_highest_first_in_the_same_order_on_every_rank(make_sim, n):
    # fusion threshold 0: one unit per tensor, so the (single) channel runs them in the negotiated order
    sim = make_sim(n, fusion_threshold_bytes=0)
    prios = {f"p{i}": p for i, p in enumerate([0, 5, 0, -1, 5, 2, 7, -3, 2, 0])}

    def rank(r, e):
        e._native.set_timeline(True)
        names = list(prios)
        random.Random(r).shuffle(names)
        xs = {nm: np.full(2, r, np.float32) for nm in names}
        outs = {nm: np.zeros(2, np.float32) for nm in names}
        # one group: negotiated in one round, so the order within it is the protocol's, not arrival order
        hid = submit(e, ALLREDUCE, [item(nm, DType.FLOAT32, xs[nm], outs[nm], prio=prios[nm]) for nm in names])
        wait(e, hid)
        events = e._native.drain_timeline()
        started = [name for kind, _, name, _, _ in events if kind == OP_START]
        ran = [name for kind, _, name, label, _ in events if kind == ACTIVITY and label == "MPI_ALLREDUCE"]
        assert all(o.tolist() == [n * (n - 1) / 2] * 2 for o in outs.values())
        return started, ran

    results = sim.run(rank)
    started0 = results[0][0]
    assert sorted(started0) == sorted(prios)
    assert [prios[nm] for nm in started0] == sorted(prios.values(), reverse=True)
    for started, ran in results:
        assert started == started0, "ranks executed in different orders"
        assert ran == started0, "the channel did not run units in the negotiated order"


# ----------------------------------------------------------------------------- mismatches

def _ar(name, shape=(4,), dtype=DType.FLOAT32, op=SUM, pre=1.0, post=1.0, prio=0):
    return ALLREDUCE, dict(name=name, dtype=dtype, shape=shape, op=op, pre=pre, post=post, prio=prio)


def _bc(name, root=0, shape=(4,), dtype=DType.FLOAT32):
    return BROADCAST, dict(name=name, dtype=dtype, shape=shape, root=root)


def _ag(name, shape, dtype=DType.FLOAT32):
    return ALLGATHER, dict(name=name, dtype=dtype, shape=shape)


def _submit_spec(e, spec, keep):
    op_type, s = spec
    x = np.zeros(s["shape"], numpy_dtype(s["dtype"]))
    out = None if op_type == ALLGATHER else np.zeros_like(x)
    keep.append((x, out))
    it = item(s["name"], s["dtype"], x, out, op=s.get("op", SUM), root=s.get("root", -1), pre=s.get("pre", 1.0),
              post=s.get("post", 1.0), prio=s.get("prio", 0))
    return submit(e, op_type, [it], (x, out))


# kind: (spec on the agreeing ranks, spec on the last rank, op, field label, value shown for A, for B)
MISMATCHES = {
    "shape": (_ar("t", shape=(2, 3)), _ar("t", shape=(2, 4)), "allreduce", "shape", "(2, 3)", "(2, 4)"),
    "dtype": (_ar("t", dtype=DType.FLOAT32), _ar("t", dtype=DType.FLOAT64), "allreduce", "dtype", "float32",
              "float64"),
    "op": (_ar("t"), _bc("t", root=0), "allreduce", "op_type", "allreduce", "broadcast"),
    "root": (_bc("t", root=0), _bc("t", root=1), "broadcast", "root_rank", "0", "1"),
    "reduce_op": (_ar("t", op=SUM), _ar("t", op=MAX), "allreduce", "reduce_op", "Sum", "Max"),
    "average": (_ar("t", op=AVERAGE), _ar("t", op=MIN), "allreduce", "reduce_op", "Average", "Min"),
    "prescale": (_ar("t", pre=1.0), _ar("t", pre=0.5), "allreduce", "prescale_factor", "1.0", "0.5"),
    "postscale": (_ar("t", post=2.0), _ar("t", post=1e-20), "allreduce", "postscale_factor", "2.0", "1e-20"),
    "priority": (_ar("t", prio=0), _ar("t", prio=3), "allreduce", "priority", "0", "3"),
    "allgather_trailing": (_ag("t", (2, 3)), _ag("t", (1, 4)), "allgather", "shape after the first dimension",
                           "(3,)", "(4,)"),
}


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_mismatch_raises_the_same_error_on_every_rank(make_sim, kind, n):
    spec_a, spec_b, op, field, va, vb = MISMATCHES[kind]
    sim = make_sim(n)
    expected = mismatch_text(op, "t", field, [n - 1], vb, list(range(n - 1)), va)

    def rank(r, e):
        keep = []
        hid = _submit_spec(e, spec_b if r == n - 1 else spec_a, keep)
        with pytest.raises(MismatchError) as info:
            wait(e, hid)
        # the failed name is forgotten everywhere: resubmitting it, now consistently, works
        x = np.full(4, r + 1, np.float32)
        out = np.zeros_like(x)
        wait(e, submit(e, ALLREDUCE, [item("t", DType.FLOAT32, x, out)]))
        assert out.tolist() == [n * (n + 1) / 2] * 4
        return str(info.value)

    messages = sim.run(rank)
    assert messages == [expected] * n


def test_mismatch_message_exact_text_for_shape(make_sim):
    # The text the Python engine produced (and its unit test asserted), word for word.
    sim = make_sim(2)

    def rank(r, e):
        x = np.zeros((2, 3) if r == 0 else (3, 2), np.float32)
        with pytest.raises(MismatchError) as info:
            wait(e, submit(e, ALLREDUCE, [item("grad/w", DType.FLOAT32, x, x)]))
        return str(info.value)

    assert sim.run(rank) == [
        "perseus.allreduce('grad/w'): ranks [1] sent shape (3, 2) but ranks [0] sent (2, 3); "
        "every rank must submit the same shape for a name."] * 2


def test_mismatch_message_names_job_ranks_and_quotes_like_python(make_sim):
    sim = make_sim(3, world_ranks=[4, 7, 9])
    name = "it's \"odd\"\n"

    def rank(r, e):
        dt = DType.INT32 if r == 1 else DType.FLOAT32
        x = np.zeros(4, numpy_dtype(dt))
        with pytest.raises(MismatchError) as info:
            wait(e, submit(e, ALLREDUCE, [item(name, dt, x, x)]))
        return str(info.value)

    assert sim.run(rank) == [mismatch_text("allreduce", name, "dtype", [7], "int32", [4, 9], "float32")] * 3


@pytest.mark.parametrize("n", [3, 4])
def test_mismatch_raised_only_once_every_rank_submitted(make_sim, n):
    """The first and last ranks disagree; nobody fails until the ranks in between have submitted too."""
    sim = make_sim(n)
    go = threading.Event()
    expected = mismatch_text("allreduce", "t", "shape", [n - 1], "(2, 4)", list(range(n - 1)), "(2, 3)")

    def rank(r, e):
        e._native.set_timeline(True)
        x = np.zeros((2, 4) if r == n - 1 else (2, 3), np.float32)
        if 0 < r < n - 1:
            assert go.wait(WAIT_S)
            hid = submit(e, ALLREDUCE, [item("t", DType.FLOAT32, x, x)])
        else:
            hid = submit(e, ALLREDUCE, [item("t", DType.FLOAT32, x, x)])
            if r == 0:
                # Let negotiation rounds run on the partial picture (two rounds started: the first, which
                # saw the disputed name, has completed), then check that nobody failed early.
                cycles, deadline = 0, time.monotonic() + 2.0
                while cycles < 2 and time.monotonic() < deadline:
                    cycles += sum(ev[0] == CYCLE for ev in e._native.drain_timeline())
                    time.sleep(0.002)
                time.sleep(0.05)
                assert not e.poll(hid), "the mismatch was raised before every rank had submitted"
                go.set()
        with pytest.raises(MismatchError) as info:
            wait(e, hid)
        return str(info.value)

    assert sim.run(rank) == [expected] * n


@pytest.mark.parametrize("n", [2, 3])
def test_mismatch_of_one_name_does_not_block_others(make_sim, n):
    sim = make_sim(n)

    def rank(r, e):
        good = [np.full(3, r + 1, np.float32) for _ in range(2)]
        bad = np.zeros(r + 1, np.float32)
        hids = [submit(e, ALLREDUCE, [item("good1", DType.FLOAT32, good[0], good[0])]),
                submit(e, ALLREDUCE, [item("bad", DType.FLOAT32, bad, bad)]),
                submit(e, ALLREDUCE, [item("good2", DType.FLOAT32, good[1], good[1])])]
        wait(e, hids[0])
        wait(e, hids[2])
        with pytest.raises(MismatchError) as info:
            wait(e, hids[1])
        return good, str(info.value)

    results = sim.run(rank)
    # with three different shapes the message names the first two groups (rank 0's first)
    expected = mismatch_text("allreduce", "bad", "shape", [1], "(2,)", [0], "(1,)")
    for good, msg in results:
        assert [g.tolist() for g in good] == [[n * (n + 1) / 2] * 3] * 2
        assert msg == expected


@pytest.mark.parametrize("n", [2, 3])
def test_changed_signature_on_one_rank_against_the_cache_is_a_mismatch(make_sim, n):
    sim = make_sim(n)

    def rank(r, e):
        x = np.ones(8, np.float32)
        wait(e, submit(e, ALLREDUCE, [item("t", DType.FLOAT32, x, x)]))
        y = np.ones(9 if r == 0 else 8, np.float32)  # rank 0 changes the shape; the others match the cache
        with pytest.raises(MismatchError) as info:
            wait(e, submit(e, ALLREDUCE, [item("t", DType.FLOAT32, y, y)]))
        return str(info.value)

    assert sim.run(rank) == [mismatch_text("allreduce", "t", "shape", list(range(1, n)), "(8,)", [0], "(9,)")] * n


@pytest.mark.parametrize("n", [1, 2, 3])
def test_signature_changed_on_every_rank_is_accepted(make_sim, n):
    sim = make_sim(n)

    def rank(r, e):
        outs = []
        for step, shape in enumerate([(8,), (16,), (16,), (2, 8), (8,)]):
            x = np.full(shape, r + step, np.float64)
            wait(e, submit(e, ALLREDUCE, [item("t", DType.FLOAT64, x, x)]))
            outs.append(x)
        return outs

    for outs in sim.run(rank):
        for step, x in enumerate(outs):
            assert (x == sum(q + step for q in range(n))).all()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_allgather_first_dimension_may_differ_between_ranks_and_steps(make_sim, n):
    sim = make_sim(n)

    def rank(r, e):
        res = []
        for step in range(3):
            x = np.full((r + 2 * step + 1, 3), r, np.int64)
            res.append(wait(e, submit(e, ALLGATHER, [item("g", DType.INT64, x, None)], finish=RESULTS))[0])
        return res

    for res in sim.run(rank):
        for step, (arr, splits) in enumerate(res):
            assert splits.tolist() == [q + 2 * step + 1 for q in range(n)]
            assert arr.shape == (sum(splits), 3)
            assert arr[:, 0].tolist() == [q for q in range(n) for _ in range(q + 2 * step + 1)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.floats(allow_nan=False, allow_infinity=False, width=64),
       b=st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_prescale_mismatch_shows_both_values_as_python_repr(a, b):
    if a == b:  # 0.0 == -0.0 too: equal factors are not a mismatch
        return
    with Sim(2) as sim:
        def rank(r, e):
            x = np.zeros(2, np.float64)
            with pytest.raises(MismatchError) as info:
                wait(e, submit(e, ALLREDUCE, [item("s", DType.FLOAT64, x, x, pre=a if r == 0 else b)]))
            return str(info.value)

        assert sim.run(rank) == [mismatch_text("allreduce", "s", "prescale_factor", [1], repr(b), [0], repr(a))] * 2


def test_duplicate_in_flight_name_is_a_value_error(make_sim):
    sim = make_sim(2)
    ready = threading.Event()

    def rank(r, e):
        x = np.ones(3, np.float32)
        if r == 0:
            hid = submit(e, ALLREDUCE, [item("dup", DType.FLOAT32, x, x)])
            with pytest.raises(ValueError, match=r"'dup' is already in flight on this rank"):
                submit(e, ALLREDUCE, [item("dup", DType.FLOAT32, x.copy(), x.copy())])
            with pytest.raises(ValueError, match="names the same tensor twice"):
                submit(e, ALLREDUCE, [item("twice", DType.FLOAT32, x, x), item("twice", DType.FLOAT32, x, x)])
            ready.set()
        else:
            assert ready.wait(WAIT_S)
            hid = submit(e, ALLREDUCE, [item("dup", DType.FLOAT32, x, x)])
        wait(e, hid)
        assert x.tolist() == [2.0] * 3
        # neither refused submission left anything behind: both names work now
        y = np.ones(3, np.float32)
        z = np.ones(3, np.float32)
        wait(e, submit(e, ALLREDUCE, [item("dup", DType.FLOAT32, y, y), item("twice", DType.FLOAT32, z, z)]))
        return y.tolist(), z.tolist()

    assert sim.run(rank) == [([2.0] * 3, [2.0] * 3)] * 2


def test_unknown_process_set_is_a_value_error(make_sim):
    sim = make_sim(1)
    x = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="process set 5 is not registered"):
        sim.engines[0].submit(5, ALLREDUCE, [item("x", DType.FLOAT32, x, x)], None, None)
    with pytest.raises(ValueError, match="process set 5 is not registered"):
        sim.engines[0].join(5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 3), capacity=st.sampled_from([0, 1, 2]))
def test_small_name_cache_evicts_and_renegotiates_correctly(data, n, capacity):
    names = [f"c{i}" for i in range(10)]
    steps = [data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=6, unique=True)) for _ in range(12)]
    # a name keeps its shape within a step but may change it between steps (same on every rank)
    shapes = [{nm: (data.draw(st.integers(1, 3)),) for nm in s} for s in steps]
    with Sim(n, cache_capacity=capacity) as sim:
        def rank(r, e):
            rng = random.Random(r)
            for step, (chosen, shp) in enumerate(zip(steps, shapes)):
                order = list(chosen)
                rng.shuffle(order)
                xs = {nm: np.full(shp[nm], (r + 1) * (step + 1), np.int64) for nm in order}
                hids = [submit(e, ALLREDUCE, [item(nm, DType.INT64, xs[nm], xs[nm])]) for nm in order]
                for hid in hids:
                    wait(e, hid)
                for nm in order:
                    assert xs[nm].tolist() == [(step + 1) * n * (n + 1) // 2] * shp[nm][0], (step, nm)
            return True

        assert sim.run(rank) == [True] * n


# ============================================================================= fusion and channels

FUSION_DTYPES = [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64, DType.INT32, DType.UINT8]

tensor_spec = st.tuples(
    st.sampled_from(FUSION_DTYPES),
    st.sampled_from([(0,), (1,), (3,), (17,), (64,), (3, 0), (5, 7), (301,), (600,)]),
    st.sampled_from([SUM, AVERAGE, MIN, MAX]),
    st.sampled_from([(1.0, 1.0), (0.5, 1.0), (1.0, 0.25), (2.0, 3.0)]),
    st.booleans(),  # in place (input is output)
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 4), channels=st.integers(1, 3),
       fusion=st.sampled_from([0, 16, 64, 256, 4096]), inplace=st.sampled_from([0, 32, 128, 1024, 1 << 20]),
       specs=st.lists(tensor_spec, min_size=1, max_size=14))
def test_fusion_many_small_and_large_tensors(data, n, channels, fusion, inplace, specs):
    """Small tensors packed, large ones split in place, over 1-3 channels: every element right on every rank."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    tensors = [(f"f{i}", dt, shape, op, pre, post, ip, [random_data(rng, dt, shape, small_ints=True)
                                                         for _ in range(n)])
               for i, (dt, shape, op, (pre, post), ip) in enumerate(specs)]
    n_groups = data.draw(st.integers(1, len(tensors)))
    with Sim(n, num_channels=channels, fusion_threshold_bytes=fusion, inplace_threshold_bytes=inplace) as sim:
        def rank(r, e):
            order = list(range(len(tensors)))
            random.Random(seed + r).shuffle(order)
            groups = [order[g::n_groups] for g in range(n_groups)]
            outs, keep, hids = {}, [], []
            for g in groups:
                items = []
                for i in g:
                    name, dt, shape, op, pre, post, ip, d = tensors[i]
                    x = d[r].copy()
                    out = x if ip else np.zeros_like(x)
                    outs[i] = out
                    keep.append((x, out))
                    items.append(item(name, dt, x, out, op=op, pre=pre, post=post))
                hids.append(submit(e, ALLREDUCE, items, keep))
            for hid in hids:
                wait(e, hid)
            return outs

        results = sim.run(rank)
    for i, (name, dt, shape, op, pre, post, ip, d) in enumerate(tensors):
        want = ref_reduce(d, dt, op, pre, post)
        for r in range(n):
            assert_same(results[r][i], want, f"{name} {dt.name}{shape} op={op} pre={pre} post={post} rank {r}")


@pytest.mark.parametrize("algorithm", ["auto", "ring", "mpi"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_large_tensors_in_place_and_ring(make_sim, algorithm, n):
    # 70k elements: above the size where `auto` picks the ring for Average; small integers, so the result
    # does not depend on the order in which the ring combines ranks' values.
    sim = make_sim(n, allreduce_algorithm=algorithm, fusion_threshold_bytes=64 << 10,
                   inplace_threshold_bytes=1 << 10, num_channels=2)
    rng = np.random.default_rng(60 + n)
    cases = [(f"big.{dt.name}.{op}", dt, op, pre,
              [random_data(rng, dt, (70001,), small_ints=True) for _ in range(n)])
             for dt in (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.INT64)
             for op, pre in ((AVERAGE, 1.0), (SUM, 0.5), (MAX, 1.0))]

    def rank(r, e):
        outs, keep = {}, []
        hids = []
        for name, dt, op, pre, d in cases:
            x = d[r].copy()
            outs[name] = x
            keep.append(x)
            hids.append(submit(e, ALLREDUCE, [item(name, dt, x, x, op=op, pre=pre)], x))
        for hid in hids:
            wait(e, hid)
        return outs

    for r, outs in enumerate(sim.run(rank)):
        for name, dt, op, pre, d in cases:
            assert_same(outs[name], ref_reduce(d, dt, op, pre), f"{name} on rank {r}")


# Host layouts (host key per rank): blocked, one rank per host, interleaved, uneven, three hosts.
HOST_LAYOUTS = [[0, 0, 1, 1], [0, 1], [0, 1, 0, 1], [0, 0, 1], [0, 0, 1, 1, 2, 2]]


@pytest.mark.parametrize("algorithm", ["auto", "ring", "hierarchical", "mpi"])
@pytest.mark.parametrize("hosts", HOST_LAYOUTS, ids=lambda h: "".join(map(str, h)))
def test_allreduce_across_hosts_over_links(make_sim, algorithm, hosts):
    # Ranks on different host keys exchange ring messages over real TCP connections (here on loopback);
    # the hierarchical algorithm reduces inside hosts over the transport, across them over the links.
    n = len(hosts)
    sim = make_sim(n, hosts=hosts, allreduce_algorithm=algorithm, fusion_threshold_bytes=64 << 10,
                   inplace_threshold_bytes=1 << 10, num_channels=2, network_interface="lo")
    rng = np.random.default_rng(70 + n)
    cases = [(f"h.{dt.name}.{op}.{size}", dt, op, pre,
              [random_data(rng, dt, (size,), small_ints=True) for _ in range(n)])
             for dt in (DType.FLOAT32, DType.BFLOAT16, DType.INT64)
             for op, pre in ((AVERAGE, 1.0), (SUM, 0.5), (MIN, 1.0))
             for size in (3, 70001)]

    def rank(r, e):
        outs, keep, hids = {}, [], []
        for name, dt, op, pre, d in cases:
            x = d[r].copy()
            outs[name] = x
            keep.append(x)
            hids.append(submit(e, ALLREDUCE, [item(name, dt, x, x, op=op, pre=pre)], x))
        for hid in hids:
            wait(e, hid)
        return outs

    for r, outs in enumerate(sim.run(rank)):
        for name, dt, op, pre, d in cases:
            assert_same(outs[name], ref_reduce(d, dt, op, pre), f"{name} on rank {r}")


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("hosts", HOST_LAYOUTS, ids=lambda h: "".join(map(str, h)))
def test_allgather_across_hosts(make_sim, hierarchical, hosts):
    n = len(hosts)
    sim = make_sim(n, hosts=hosts, hierarchical_allgather=hierarchical, num_channels=2, network_interface="lo")
    rng = np.random.default_rng(80 + n)
    cases = []
    for dt in (DType.FLOAT32, DType.UINT8, DType.FLOAT16):
        rows = [(r * 7 + 1) % 4 for r in range(n)]  # some ranks send no rows
        cases.append((f"hag.{dt.name}", dt, [random_data(rng, dt, (rows[r], 3)) for r in range(n)]))

    def rank(r, e):
        hids = {name: submit(e, ALLGATHER, [item(name, dt, d[r], None)], d[r], RESULTS) for name, dt, d in cases}
        return {name: wait(e, hid)[0] for name, hid in hids.items()}

    for r, got in enumerate(sim.run(rank)):
        for name, dt, d in cases:
            arr, splits = got[name]
            assert_same(arr, np.concatenate(d), f"{name} on rank {r}")
            assert splits.tolist() == [x.shape[0] for x in d]


RS_LAYOUTS = [[0], [0, 0], [0, 0, 0]] + HOST_LAYOUTS  # one host (1-3 ranks), then across hosts


@pytest.mark.parametrize("algorithm", ["auto", "ring", "hierarchical", "mpi"])
@pytest.mark.parametrize("hosts", RS_LAYOUTS, ids=lambda h: "".join(map(str, h)))
def test_reducescatter_and_allgather_across_hosts_and_layouts(make_sim, algorithm, hosts):
    # Reduce-scatter and allgather take the allreduce's algorithm: above 64 kB `auto` runs reduce-scatter as
    # a ring (over the links across hosts) and allgather as one across hosts; a forced ring runs every size
    # as one. Uneven first dimensions (the
    # first ranks get a row more; some ranks gather no rows), every op and scale, small integers (the ring
    # combines in another order than the reference).
    n = len(hosts)
    sim = make_sim(n, hosts=hosts if n > 1 else None, allreduce_algorithm=algorithm, num_channels=2,
                   network_interface="lo")
    rng = np.random.default_rng(90 + n)
    rs_cases = []
    for dt, op, pre, post, (rows, cols) in itertools.product(
            (DType.FLOAT32, DType.BFLOAT16, DType.INT32, DType.FLOAT64), (SUM, AVERAGE, MAX),
            (1.0, 0.5), (1.0, 2.0), ((2 * n + 1, 3), (4099, 5), (n - 1, 7))):
        if (pre, post) == (0.5, 2.0):
            continue
        rs_cases.append((f"rs.{dt.name}.{op}.{pre}.{post}.{rows}", dt, op, pre, post, rows, cols,
                         [random_data(rng, dt, (rows, cols), small_ints=True) for _ in range(n)]))
    rs_cases.append(("rs.bool.big", DType.BOOL, MIN, 1.0, 1.0, 70001, 1,
                     [random_data(rng, DType.BOOL, (70001, 1)) for _ in range(n)]))
    ag_cases = []
    for dt in (DType.FLOAT32, DType.UINT8, DType.FLOAT16, DType.INT64):
        for base in (1, 3000):
            rows = [base * ((r * 5 + 2) % 4) + r for r in range(n)]  # uneven; rank 0 of 4 sends 2*base rows
            if n > 1:
                rows[1] = 0  # a rank with nothing to send
            ag_cases.append((f"ag.{dt.name}.{base}", dt, [random_data(rng, dt, (rows[r], 6)) for r in range(n)]))

    def rank(r, e):
        outs, hids = {}, {}
        for name, dt, op, pre, post, rows, cols, d in rs_cases:
            out = np.zeros((even_counts(rows, n)[r], cols), d[r].dtype)
            outs[name] = out
            hids[name] = submit(e, REDUCESCATTER, [item(name, dt, d[r], out, op=op, pre=pre, post=post)],
                                (d[r], out))
        for name, dt, d in ag_cases:
            hids[name] = submit(e, ALLGATHER, [item(name, dt, d[r], None)], d[r], RESULTS)
        got = {name: wait(e, hid) for name, hid in hids.items()}
        return outs, {name: got[name][0] for name, _, _ in ag_cases}

    for r, (outs, gathered) in enumerate(sim.run(rank)):
        for name, dt, op, pre, post, rows, cols, d in rs_cases:
            counts = even_counts(rows, n)
            start = sum(counts[:r])
            want = ref_reduce(d, dt, op, pre, post)[start:start + counts[r]]
            assert_same(outs[name], want, f"{name} on rank {r}")
        for name, dt, d in ag_cases:
            arr, splits = gathered[name]
            assert_same(arr, np.concatenate(d), f"{name} on rank {r}")
            assert splits.tolist() == [x.shape[0] for x in d]


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
@pytest.mark.parametrize("hosts", [[0, 0, 0], [0, 1, 2]], ids=lambda h: "".join(map(str, h)))
def test_ring_reducescatter_and_allgather_count_what_travels(make_sim, algorithm, hosts):
    # The ring's steps count what they move: (n-1)/n of the input out of every rank for a reduce-scatter
    # with even segments, every other rank's rows in for an allgather; MPI's are counted as the textbook
    # volume, which is the same here.
    n = len(hosts)
    sim = make_sim(n, hosts=hosts, allreduce_algorithm=algorithm, network_interface="lo")
    rows, cols = 3 * 1000, 8

    def rank(r, e):
        x = np.full((rows, cols), r + 1, np.float32)
        out = np.zeros((rows // n, cols), np.float32)
        def wire():
            w = e.wire_bytes(0)
            return w["sent_bytes"], w["received_bytes"]

        before = wire()
        wait(e, submit(e, REDUCESCATTER, [item("rs", DType.FLOAT32, x, out)], (x, out)))
        mid = wire()
        g = np.full((1000 * (r + 1), cols), r, np.float32)
        got = wait(e, submit(e, ALLGATHER, [item("ag", DType.FLOAT32, g, None)], g, RESULTS))[0][0]
        after = wire()
        return out, got, before, mid, after

    seg = rows // n * cols * 4
    for r, (out, got, before, mid, after) in enumerate(sim.run(rank)):
        assert (out == sum(range(1, n + 1))).all()
        assert got.shape == (1000 * sum(range(1, n + 1)), cols)
        assert mid[0] - before[0] == (n - 1) * seg and mid[1] - before[1] == (n - 1) * seg, (before, mid)
        mine = 1000 * (r + 1) * cols * 4
        others = 1000 * (sum(range(1, n + 1)) - (r + 1)) * cols * 4
        if algorithm == "mpi":
            assert after[0] - mid[0] == mine * (n - 1) and after[1] - mid[1] == others, (mid, after)
        else:  # the ring forwards every block but the one its right neighbour sent
            right = 1000 * ((r + 1) % n + 1) * cols * 4
            assert after[0] - mid[0] == mine + others - right and after[1] - mid[1] == others, (mid, after)


def test_links_to_an_interface_without_address_fail_clearly():
    with pytest.raises(Exception, match="PERSEUS_NETWORK_INTERFACE"):
        Sim(2, hosts=[0, 1], network_interface="perseus-no-such-if0")


@pytest.mark.parametrize("fusion,inplace", [(1 << 20, 1 << 30), (0, 1 << 30), (64, 0), (64, 1), (16, 64)])
def test_zero_size_tensors_among_others(make_sim, fusion, inplace):
    n = 3
    sim = make_sim(n, fusion_threshold_bytes=fusion, inplace_threshold_bytes=inplace, num_channels=2)
    shapes = [(4,), (0,), (3, 0), (40,), (0,), (1,)]

    def rank(r, e):
        xs = [np.full(s, r + 1, np.float32) for s in shapes]
        outs = [np.full(s, -1, np.float32) for s in shapes]
        hid = submit(e, ALLREDUCE, [item(f"z{i}", DType.FLOAT32, x, o, op=AVERAGE, post=2.0)
                                    for i, (x, o) in enumerate(zip(xs, outs))], (xs, outs))
        alone = np.zeros(0, np.float16)
        wait(e, submit(e, ALLREDUCE, [item("z.alone", DType.FLOAT16, alone, alone)], alone))
        g = wait(e, submit(e, ALLGATHER, [item("z.gather", DType.INT32, np.zeros((0, 2), np.int32), None)],
                           finish=RESULTS))[0]
        wait(e, hid)
        return outs, g

    for outs, (arr, splits) in sim.run(rank):
        for s, o in zip(shapes, outs):
            assert o.shape == s and (o == np.float32(6 * np.float32(2.0 / 3))).all()
        assert arr.shape == (0, 2) and splits.tolist() == [0] * n


# ============================================================================= join

@pytest.mark.parametrize("n,early,last", [(2, 1, 0), (2, 0, 1), (3, 2, 0), (3, 0, 1), (4, 3, 1)])
def test_join_contributes_zeros_and_returns_the_last_rank(make_sim, n, early, last):
    world_ranks = [10 + r for r in range(n)]
    # small fusion thresholds: the joined rank's zeros go through packed and in-place units alike
    sim = make_sim(n, world_ranks=world_ranks, fusion_threshold_bytes=64, inplace_threshold_bytes=128,
                   num_channels=2)
    others = [r for r in range(n) if r not in (early, last)]
    others_joined = threading.Barrier(len(others) + 1) if others else None
    active = [r for r in range(n) if r != early]

    def rank(r, e):
        if r == early:
            return ("join", wait(e, e.join(0)))
        sums = []
        for step in range(4):
            xs = [np.full(s, (r + 1) * (step + 1), np.float32) for s in ((3,), (50,), (0,))]
            hid = submit(e, ALLREDUCE, [item(f"j{i}", DType.FLOAT32, x, x) for i, x in enumerate(xs)], xs)
            wait(e, hid)
            sums.append([x.tolist() for x in xs])
        if r != last:
            hid = e.join(0)
            others_joined.wait(JOIN_S)
            return ("join_and_sums", wait(e, hid), sums)
        if others_joined is not None:
            others_joined.wait(JOIN_S)
        # Every other rank has called join: this allreduce can only run once they all count as joined, so
        # the last rank's join comes strictly after theirs. It gets this rank's value alone.
        x = np.full(5, 7.0, np.float32)
        wait(e, submit(e, ALLREDUCE, [item("after", DType.FLOAT32, x, x)]))
        assert x.tolist() == [7.0] * 5
        return ("join_and_sums", wait(e, e.join(0)), sums)

    results = sim.run(rank)
    total = sum(r + 1 for r in active)
    for r, res in enumerate(results):
        assert res[1] == world_ranks[last], f"rank {r}: join returned {res[1]}"
        if r != early:
            for step, sums in enumerate(res[2]):
                want = total * (step + 1)
                assert sums == [[want] * 3, [want] * 50, []], f"rank {r} step {step}"

    # after the join everything works as before, non-allreduce ops included
    def after(r, e):
        x = np.full(2, r, np.float32)
        wait(e, submit(e, BROADCAST, [item("bc.after", DType.FLOAT32, x, x, root=n - 1)]))
        return x.tolist()

    assert sim.run(after) == [[n - 1.0] * 2] * n


def test_join_on_a_single_rank(make_sim):
    sim = make_sim(1, world_ranks=[3])
    e = sim.engines[0]
    assert wait(e, e.join(0)) == 3
    x = np.ones(2, np.float32)
    wait(e, submit(e, ALLREDUCE, [item("x", DType.FLOAT32, x, x)]))
    assert wait(e, e.join(0)) == 3


@pytest.mark.parametrize("n", [2, 3])
def test_non_allreduce_collectives_fail_while_a_rank_is_joined(make_sim, n):
    sim = make_sim(n)
    joiner = n - 1
    done = threading.Barrier(n - 1)

    def rank(r, e):
        if r == joiner:
            hid = e.join(0)
            with pytest.raises(ValueError, match="already joined"):
                e.join(0)
            return wait(e, hid)
        x = np.full(3, r + 1, np.float32)
        b = np.zeros(3, np.float32)
        hids = {"a": submit(e, ALLREDUCE, [item("a", DType.FLOAT32, x, x)]),
                "b": submit(e, BROADCAST, [item("b", DType.FLOAT32, b, b, root=0)]),
                "g": submit(e, ALLGATHER, [item("g", DType.FLOAT32, b, None)]),
                "rs": submit(e, REDUCESCATTER, [item("rs", DType.FLOAT32, np.zeros((n, 1), np.float32),
                                                     np.zeros((1, 1), np.float32))])}
        wait(e, hids["a"])
        msgs = {}
        for key, op in (("b", "broadcast"), ("g", "allgather"), ("rs", "reducescatter")):
            with pytest.raises(MismatchError) as info:
                wait(e, hids[key])
            msgs[key] = str(info.value)
            assert msgs[key] == joined_text(op, key)
        done.wait(JOIN_S)
        last = wait(e, e.join(0))
        return x.tolist(), msgs, last

    results = sim.run(rank)
    active_sum = sum(r + 1 for r in range(n - 1))
    for r, res in enumerate(results[:-1]):
        assert res[0] == [active_sum] * 3
    lasts = [res if r == joiner else res[2] for r, res in enumerate(results)]
    assert len(set(lasts)) == 1 and lasts[0] in range(n - 1)


def test_join_called_while_a_round_is_in_flight_counts_from_the_next_round():
    """Rank 2 calls join() while it waits inside a negotiation round that will exchange new names: that round
    must still count it as not joined (as its band said), or the ranks would run a broadcast against a joined
    rank instead of rejecting it. Rank 0's engine starts late to hold the round open."""
    n = 3
    with Sim(n, start=False) as sim:
        e0, e1, e2 = sim.engines
        e2._native.set_timeline(True)
        e1.start()
        e2.start()
        bufs = [np.full(3, r, np.float32) for r in range(n)]
        h0 = submit(e0, BROADCAST, [item("b", DType.FLOAT32, bufs[0], bufs[0], root=0)])  # queued: not started
        h1 = submit(e1, BROADCAST, [item("b", DType.FLOAT32, bufs[1], bufs[1], root=0)])  # wakes rank 2
        deadline = time.monotonic() + WAIT_S
        while not any(ev[0] == CYCLE for ev in e2._native.drain_timeline()):  # rank 2 is inside the round
            assert time.monotonic() < deadline, "rank 2 never started a negotiation round"
            time.sleep(0.001)
        hj = e2.join(0)
        e0.start()
        for e, h in ((e0, h0), (e1, h1)):
            with pytest.raises(MismatchError) as info:
                wait(e, h)
            assert str(info.value) == joined_text("broadcast", "b")
        lasts = sim.run(lambda r, e: wait(e, hj if r == 2 else e.join(0)))
        assert len(set(lasts)) == 1 and lasts[0] in (0, 1)
        assert bufs[1].tolist() == [1.0] * 3  # the broadcast never ran


# ============================================================================= failures and shutdown

# Every collective runs on a channel thread, so the peers' engine threads stay free to receive the abort
# while their channels wait inside the collective the faulty rank never enters.
@pytest.mark.parametrize("n,faulty", [(2, 0), (3, 1), (4, 3)])
def test_transport_failure_on_one_rank_fails_every_rank(make_sim, n, faulty):
    """The faulty rank fails the collective before entering it; its peers, left waiting inside it, must
    still fail (the abort reaches them as a control message)."""
    sim = make_sim(n)
    sim.engines[faulty]._native.fail_next_collective("injected fault")

    def rank(r, e):
        x = np.ones(4, np.float32)
        hid = submit(e, ALLREDUCE, [item("x", DType.FLOAT32, x, x)])
        try:
            e.wait(hid, 3.0)
        except PerseusInternalError as exc:
            return type(exc), str(exc)
        raise AssertionError("the request succeeded")

    results = sim.outcomes(rank)
    origin = "perseus.allreduce(x) failed in the transport: injected fault"
    for r, (value, exc) in enumerate(results):
        assert exc is None, f"rank {r}: {exc!r}"
        kind, msg = value
        assert kind is PerseusInternalError, f"rank {r} raised {kind.__name__}"
        if r == faulty:
            assert msg == origin
        else:
            assert msg == f"perseus: rank {faulty} failed and stopped the job: {origin}"
    # the job stays failed: new requests fail at once, on every rank
    for r, e in enumerate(sim.engines):
        x = np.ones(1, np.float32)
        with pytest.raises(PerseusInternalError):
            submit(e, ALLREDUCE, [item("y", DType.FLOAT32, x, x)])
        assert e.failed is not None


def test_world_failure_unblocks_ranks_waiting_for_a_silent_peer(make_sim):
    """Rank 2's engine never runs: ranks 0 and 1 wait inside a negotiation round until the world fails."""
    n = 3
    sim = make_sim(n, start=False)
    for e in sim.engines[:2]:
        e.start()
    started = threading.Barrier(3)

    def rank(r, e):
        x = np.ones(2, np.float32)
        hid = submit(e, ALLREDUCE, [item("x", DType.FLOAT32, x, x)])
        started.wait(JOIN_S)
        return str(error_of(e, hid))

    def fail_later():
        started.wait(JOIN_S)
        time.sleep(0.1)
        sim.world.fail("peer 2 died")

    t = threading.Thread(target=fail_later, daemon=True)
    t.start()
    messages = sim.run(rank, ranks=[0, 1])
    t.join(JOIN_S)
    assert all("peer 2 died" in m for m in messages), messages
    for e in sim.engines[:2]:
        assert "peer 2 died" in e.failed


@pytest.mark.parametrize("n", [2, 3])
def test_world_failure_unblocks_every_rank(make_sim, n):
    """Ranks 0..n-2 wait for a name rank n-1 never submits; a failed world fails them all, and rank n-1's
    next request too."""
    sim = make_sim(n)
    submitted = threading.Barrier(n)

    def rank(r, e):
        x = np.ones(2, np.float32)
        hid = submit(e, ALLREDUCE, [item("never", DType.FLOAT32, x, x)]) if r < n - 1 else None
        submitted.wait(JOIN_S)
        if r == n - 1:
            time.sleep(0.1)
            sim.world.fail("the network is gone")
            deadline = time.monotonic() + WAIT_S
            while e.failed is None and time.monotonic() < deadline:  # its engine notices on its next poll
                time.sleep(0.005)
            with pytest.raises(PerseusInternalError, match="the network is gone"):
                wait(e, submit(e, ALLREDUCE, [item("late", DType.FLOAT32, x, x)]))
            return e.failed
        return str(error_of(e, hid))

    for msg in sim.run(rank):
        assert "the network is gone" in msg


@pytest.mark.parametrize("n", [2, 3])
def test_shutdown_fails_pending_requests(make_sim, n):
    sim = make_sim(n)
    submitted = threading.Barrier(n)
    shut = threading.Event()

    def rank(r, e):
        x = np.ones(2, np.float32)
        # "only0" waits for peers that never submit it; the others wait for rank 0, which never submits theirs
        hid = submit(e, ALLREDUCE, [item("only0" if r == 0 else f"only{r}", DType.FLOAT32, x, x)])
        submitted.wait(JOIN_S)
        if r == 0:
            time.sleep(0.05)
            e.shutdown(10.0)
            shut.set()
            err = error_of(e, hid)
            assert type(err) is PerseusInternalError and str(err) == "perseus has been shut down"
            with pytest.raises(PerseusInternalError, match="perseus has been shut down; call init"):
                submit(e, ALLREDUCE, [item("after", DType.FLOAT32, x, x)])
            return e.clean
        assert shut.wait(WAIT_S)
        expected = ("perseus: rank 0 shut down (perseus.shutdown() or process exit) while this rank still used "
                    "process set 0; every rank must call the same collectives before exiting.")
        err = error_of(e, hid)
        assert str(err) == expected
        with pytest.raises(PerseusInternalError) as info:
            submit(e, ALLREDUCE, [item("after", DType.FLOAT32, x, x)])
        assert str(info.value) == expected
        return True

    assert sim.run(rank) == [True] * n


def test_clean_shutdown_after_work(make_sim):
    sim = make_sim(3, num_channels=3, fusion_threshold_bytes=64)

    def rank(r, e):
        xs = [np.full(40, r, np.float64) for _ in range(5)]
        wait(e, submit(e, ALLREDUCE, [item(f"c{i}", DType.FLOAT64, x, x) for i, x in enumerate(xs)], xs))
        return True

    sim.run(rank)
    assert sim.close() == [True] * 3


def test_stall_shutdown_fails_every_rank(make_sim):
    sim = make_sim(2, stall_check_disable=False, stall_check_time_s=0.2, stall_shutdown_time_s=0.4)

    def rank(r, e):
        x = np.ones(2, np.float32)
        if r == 1:
            deadline = time.monotonic() + WAIT_S
            while e.failed is None and time.monotonic() < deadline:
                time.sleep(0.01)
            return e.failed
        with pytest.raises(StallError) as info:
            wait(e, submit(e, ALLREDUCE, [item("stuck", DType.FLOAT32, x, x)]))
        return str(info.value)

    msg0, failed1 = sim.run(rank)
    assert msg0.startswith("perseus stall: requests have waited for other ranks:")
    assert "stuck: waited" in msg0 and "submitted by ranks [0], missing on ranks [1]" in msg0
    assert msg0.endswith("Shutting down: the stall lasted longer than the stall shutdown time.")
    assert failed1 == f"perseus: rank 0 failed and stopped the job: {msg0}"


# ============================================================================= timeline

def test_timeline_records_each_request_and_fusion_activities(make_sim):
    n = 2
    sim = make_sim(n, fusion_threshold_bytes=256, inplace_threshold_bytes=1024)

    def rank(r, e):
        e._native.set_timeline(True)
        small = [np.full(8, r, np.float32) for _ in range(3)]  # packed into one unit
        big = np.full(1000, r, np.float32)  # 4000 bytes: in place, in 16 chunks of 256 bytes
        g = np.full((r + 1, 2), r, np.int32)
        b = np.full(4, r, np.float64)
        hids = [submit(e, ALLREDUCE, [item(f"small{i}", DType.FLOAT32, x, x) for i, x in enumerate(small)], small),
                submit(e, ALLREDUCE, [item("big", DType.FLOAT32, big, big)], big),
                submit(e, ALLGATHER, [item("gath", DType.INT32, g, None)], g),
                submit(e, BROADCAST, [item("bcast", DType.FLOAT64, b, b, root=1)], b)]
        for hid in hids:
            wait(e, hid)
        events = e._native.drain_timeline()
        e._native.set_timeline(False)
        x = np.ones(1, np.float32)
        wait(e, submit(e, ALLREDUCE, [item("untraced", DType.FLOAT32, x, x)]))
        return events, e._native.drain_timeline()

    ops = {"small0": ALLREDUCE, "small1": ALLREDUCE, "small2": ALLREDUCE, "big": ALLREDUCE, "gath": ALLGATHER,
           "bcast": BROADCAST}
    for r, (events, after_off) in enumerate(sim.run(rank)):
        assert after_off == [], "events recorded with the timeline off"
        assert any(kind == CYCLE for kind, *_ in events)
        for name, op in ops.items():
            mine = [ev for ev in events if ev[2] == name]
            kinds = [ev[0] for ev in mine]
            assert all(ev[1] == op for ev in mine), f"{name}: wrong op in {mine}"
            assert kinds.count(NEGOTIATE_START) == kinds.count(OP_START) == kinds.count(OP_END) == 1, (name, kinds)
            ts = {k: ev[4] for ev in mine for k in [ev[0]] if k != ACTIVITY}
            assert ts[NEGOTIATE_START] <= ts[OP_START] <= ts[OP_END], name
            acts = [ev for ev in mine if ev[0] == ACTIVITY]
            assert all(ts[OP_START] <= ev[4] <= ts[OP_END] for ev in acts), name
            labels = [ev[3] for ev in acts]
            assert all(ev[3] is None for ev in mine if ev[0] != ACTIVITY)
            if name.startswith("small"):
                assert labels == ["MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"], labels
            elif name == "big":
                assert labels == ["MPI_ALLREDUCE"] * 16, labels
            else:
                assert labels == [], labels


# ============================================================================= run-time parameters (TUNE)

MPI_ALG, RING_ALG, HIER_ALG = 1, 2, 3


def _tune(e, name, fusion, inplace, channels, cycle_us=0, algorithm=0):
    return e.tune(0, name, fusion, inplace, channels, cycle_us, algorithm)


@pytest.mark.parametrize("hosts", [None, [0, 0, 1, 1]], ids=["one-host", "two-hosts"])
def test_tune_changes_parameters_at_the_same_point_on_every_rank(make_sim, hosts):
    # Each rank submits its tune requests at a different moment relative to its allreduces (and sleeps a
    # different time), as ranks that measured different timings would; every rank must still switch after
    # the same units, so every collective matches and every result is right.
    n = 4
    sim = make_sim(n, hosts=hosts, max_channels=4, network_interface="lo", fusion_threshold_bytes=1 << 20,
                   inplace_threshold_bytes=64 << 10)
    plans = [(64 << 10, 16 << 10, 4, 0, RING_ALG), (8 << 10, 1 << 30, 2, 200, MPI_ALG),
             (2 << 20, 256 << 10, 3, 0, HIER_ALG if hosts else RING_ALG), (4 << 20, 256 << 10, 1, 0, 0)]
    rng = np.random.default_rng(5)
    data = [[random_data(rng, DType.FLOAT32, (s,), small_ints=True) for s in (5, 3000, 70001, 300000)]
            for _ in range(n)]

    def rank(r, e):
        got, params = [], []
        for step, plan in enumerate(plans):
            xs = [d.copy() for d in data[r]]
            hids = [submit(e, ALLREDUCE, [item(f"s{step}.t{i}", DType.FLOAT32, x, x)], x) for i, x in enumerate(xs)]
            time.sleep(0.002 * ((r + step) % 3))
            wait(e, _tune(e, f"tune.{step}", *plan))
            for h in hids:
                wait(e, h)
            got.append(xs)
            params.append(tuple(e.params(0)))
        return got, params

    out = sim.run(rank)
    for r, (got, params) in enumerate(out):
        assert params == out[0][1], f"rank {r} applied {params}, rank 0 {out[0][1]}"
        for step, plan in enumerate(plans):
            assert params[step][:5] == plan and params[step][5] == 4
            for i in range(4):
                assert_same(got[step][i], ref_reduce([data[q][i] for q in range(n)], DType.FLOAT32),
                            f"step {step} tensor {i} rank {r}")


def test_tune_with_different_values_is_a_mismatch_on_every_rank(make_sim):
    sim = make_sim(2, max_channels=2)

    def rank(r, e):
        hid = _tune(e, "tune.x", 1 << 20, 1 << 20, 1 + r)
        with pytest.raises(MismatchError) as info:
            wait(e, hid)
        return str(info.value)

    texts = sim.run(rank)
    assert texts[0] == texts[1] and "tune.x" in texts[0], texts


def test_tune_out_of_range_fails_on_every_rank_and_keeps_the_old_values(make_sim):
    sim = make_sim(2, num_channels=2)

    def rank(r, e):
        before = tuple(e.params(0))
        with pytest.raises(ValueError, match="channels 1..2"):
            wait(e, _tune(e, "tune.bad", 1 << 20, 1 << 20, 3))
        return before, tuple(e.params(0))

    for before, after in sim.run(rank):
        assert before == after and after[2] == 2 and after[5] == 2


def test_steps_are_timed_from_first_submission_to_last_completion(make_sim):
    # A step ends when one of its names comes again; the tuner's own requests (Timing.NONE) belong to no step.
    sim = make_sim(2, autotune=True)
    xs = [np.ones(1000, np.float32) for _ in range(3)]

    def rank(r, e):
        for step in range(5):
            hids = []
            for i, x in enumerate(xs):
                hids.append(submit(e, ALLREDUCE, [item(f"g{i}", DType.FLOAT32, x, x)], x))
                if step == 2 and i == 0:
                    time.sleep(0.1)  # the third step's last gradients come later: it lasts longer
            wait(e, submit(e, ALLREDUCE, [item(f"tuner.score.{step}", DType.FLOAT32, xs[0][:1].copy(),
                                               np.zeros(1, np.float32), timing=Timing.NONE)], None))
            for h in hids:
                wait(e, h)
            time.sleep(0.01)  # time between steps is not part of a step
        return e.steps(0), e.steps(0, 3)

    for (first, steps), (first3, steps3) in sim.run(rank):
        assert first == 0 and len(steps) == 4, steps  # the fifth step has not ended (no name came again)
        assert all(b == 3 * 4000 for _, b, _ in steps), steps
        assert len({d for _, _, d in steps}) == 1, steps  # the same names, dtypes and shapes every step
        assert steps[2][0] >= 0.1 > max(steps[0][0], steps[1][0], steps[3][0]), steps
        assert first3 == 3 and steps3 == steps[3:]


def test_unsigned_requests_count_in_the_step_but_not_its_digest(make_sim):
    # A request marked Timing.UNSIGNED whose size changes every step: its bytes are the step's, the digest
    # (names, ops, dtypes, shapes) stays the same.
    sim = make_sim(2, autotune=True)
    x = np.ones(100, np.float32)

    def rank(r, e):
        for step in range(4):
            rows = np.ones(step + 1, np.float32)
            wait(e, submit(e, ALLREDUCE, [item("rows", DType.FLOAT32, rows, rows, timing=Timing.UNSIGNED)], rows))
            wait(e, submit(e, ALLREDUCE, [item("g", DType.FLOAT32, x, x)], x))
        return e.steps(0)

    for first, steps in sim.run(rank):
        assert first == 0 and len(steps) == 3, steps
        assert [b for _, b, _ in steps] == [400 + 4 * (k + 1) for k in range(3)], steps
        assert len({d for _, _, d in steps}) == 1, steps


# ============================================================================= bytes on the wire

WIRE_KEYS = ("sent_bytes", "received_bytes", "control_sent_bytes", "control_received_bytes")


def _wire_delta(before: dict, after: dict) -> dict:
    assert set(before) == set(after) == set(WIRE_KEYS)
    for k in WIRE_KEYS:
        assert after[k] >= before[k], f"{k} went down: {before[k]} -> {after[k]}"
    return {k: after[k] - before[k] for k in WIRE_KEYS}


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_wire_bytes_of_each_collective(make_sim, algorithm, n):
    # The ring counts what its point-to-point steps move; the transport's own all-reduce counts the ring's
    # volume: both are 2 (n-1)/n of the buffer each way. The other collectives count the textbook volume,
    # but for allgather and reducescatter under a forced ring, which count what the ring moves.
    sim = make_sim(n, allreduce_algorithm=algorithm)
    count = 12000  # float32 elements: divisible by 1..4, so every ring segment is the same size
    nbytes = count * 4
    rows = [r + 1 for r in range(n)]  # allgather: rank r sends r+1 rows of 5 float32
    splits = [[r + q + 1 for q in range(n)] for r in range(n)]  # alltoall: rank r sends r+q+1 rows to q
    rs_counts = [c * 4 for c in even_counts(2 * n + 1, n)]  # reducescatter: elements of (2n+1, 4) per rank

    def rank(r, e):
        deltas = {}

        def measure(what, op_type, items, keep, finish=None):
            before = e.wire_bytes(0)
            wait(e, submit(e, op_type, items, keep, finish))
            deltas[what] = _wire_delta(before, e.wire_bytes(0))

        x = np.ones(count, np.float32)
        measure("allreduce", ALLREDUCE, [item("w.ar", DType.FLOAT32, x, x)], x)
        g = np.ones((rows[r], 5), np.float32)
        measure("allgather", ALLGATHER, [item("w.ag", DType.FLOAT32, g, None)], g, RESULTS)
        b = np.ones(1000, np.float32)
        measure("broadcast", BROADCAST, [item("w.bc", DType.FLOAT32, b, b, root=n - 1)], b)
        a = np.ones((sum(splits[r]), 3), np.float32)
        measure("alltoall", ALLTOALL, [item("w.a2a", DType.FLOAT32, a, None, splits=splits[r])], a, RESULTS)
        s = np.ones((2 * n + 1, 4), np.float32)
        out = np.zeros((even_counts(2 * n + 1, n)[r], 4), np.float32)
        measure("reducescatter", REDUCESCATTER, [item("w.rs", DType.FLOAT32, s, out)], (s, out))
        measure("barrier", BARRIER, [item("w.barrier", DType.UINT8, None, None, shape=())], None)
        return deltas

    for r, d in enumerate(sim.run(rank)):
        ar = 2 * (n - 1) * nbytes // n
        assert (d["allreduce"]["sent_bytes"], d["allreduce"]["received_bytes"]) == (ar, ar), (r, d["allreduce"])
        ring = algorithm == "ring" and n > 1  # a forced ring runs allgather and reducescatter as rings too
        if ring:  # every rank forwards every block but the one its right neighbour sent
            assert d["allgather"]["sent_bytes"] == sum(rows[q] * 20 for q in range(n) if q != (r + 1) % n)
        else:
            assert d["allgather"]["sent_bytes"] == rows[r] * 20 * (n - 1), (r, d["allgather"])
        assert d["allgather"]["received_bytes"] == sum(rows[q] * 20 for q in range(n) if q != r)
        root = n - 1
        assert d["broadcast"]["sent_bytes"] == (4000 * (n - 1) if r == root else 0), (r, d["broadcast"])
        assert d["broadcast"]["received_bytes"] == (0 if r == root or n == 1 else 4000), (r, d["broadcast"])
        assert d["alltoall"]["sent_bytes"] == sum(splits[r][q] * 12 for q in range(n) if q != r)
        assert d["alltoall"]["received_bytes"] == sum(splits[q][r] * 12 for q in range(n) if q != r)
        assert d["reducescatter"]["sent_bytes"] == sum(rs_counts[q] * 4 for q in range(n) if q != r)
        if ring:  # partial sums of every segment but the left neighbour's come in
            assert d["reducescatter"]["received_bytes"] == sum(rs_counts[q] * 4 for q in range(n) if q != (r - 1) % n)
        else:
            assert d["reducescatter"]["received_bytes"] == rs_counts[r] * 4 * (n - 1)
        assert d["barrier"]["sent_bytes"] == d["barrier"]["received_bytes"] == 0
        if n > 1:  # every new name was negotiated: control traffic, never counted as payload
            for what in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier"):
                assert d[what]["control_sent_bytes"] > 0 and d[what]["control_received_bytes"] > 0, (what, d)
        else:
            assert all(v == 0 for v in d["allreduce"].values()), d


@pytest.mark.parametrize("algorithm,hosts", [("ring", [0, 1]), ("ring", [0, 1, 2]), ("hierarchical", [0, 0, 1, 1])],
                         ids=["ring-2", "ring-3", "hierarchical-2x2"])
def test_wire_bytes_over_links_count_what_moves(make_sim, algorithm, hosts):
    # Across hosts the ring travels over the channels' TCP connections: the bodies are payload, the 8-byte
    # length of each transfer and the handshakes are control. The hierarchical all-reduce of 2 hosts x 2
    # ranks moves half the buffer in each of its three phases.
    n = len(hosts)
    sim = make_sim(n, hosts=hosts, allreduce_algorithm=algorithm, network_interface="lo")
    count = 12000
    nbytes = count * 4

    def rank(r, e):
        x = np.ones(count, np.float32)
        before = e.wire_bytes(0)
        wait(e, submit(e, ALLREDUCE, [item("links.ar", DType.FLOAT32, x, x, op=SUM)], x))
        after = e.wire_bytes(0)
        assert np.all(x == n)
        return _wire_delta(before, after)

    want = 3 * nbytes // 2 if algorithm == "hierarchical" else 2 * (n - 1) * nbytes // n
    deltas = sim.run(rank)
    for r, d in enumerate(deltas):
        assert d["sent_bytes"] == want and d["received_bytes"] == want, (r, d)
        # At least the length headers of the ring's 2 (n-1) transfers (or the cross ring's 2) travelled.
        transfers = 2 if algorithm == "hierarchical" else 2 * (n - 1)
        assert d["control_sent_bytes"] >= 8 * transfers and d["control_received_bytes"] >= 8 * transfers, (r, d)


def test_wire_bytes_are_per_process_set_and_only_grow(make_sim):
    n = 3
    sim = make_sim(n, allreduce_algorithm="ring")
    sim.run(lambda r, e: e.add_loopback_process_set(1, sim.world, r, sim.world_ranks))

    def rank(r, e):
        readings = [(e.wire_bytes(0), e.wire_bytes(1))]
        assert readings[0][1]["sent_bytes"] == readings[0][1]["received_bytes"] == 0  # a new set: no payload yet
        for step in range(4):
            ps = step % 2
            x = np.ones(3000 * (step + 1), np.float32)
            wait(e, e.submit(ps, ALLREDUCE, [item(f"ps.{step}", DType.FLOAT32, x, x)], None, x))
            readings.append((e.wire_bytes(0), e.wire_bytes(1)))
        with pytest.raises(ValueError, match="no process set with id 7"):
            e.wire_bytes(7)
        return readings

    for r, readings in enumerate(sim.run(rank)):
        for step in range(4):
            (b0, b1), (a0, a1) = readings[step], readings[step + 1]
            d0, d1 = _wire_delta(b0, a0), _wire_delta(b1, a1)
            moved = 2 * (n - 1) * 3000 * (step + 1) * 4 // n
            busy, idle = (d0, d1) if step % 2 == 0 else (d1, d0)
            assert busy["sent_bytes"] == busy["received_bytes"] == moved, (r, step, busy)
            assert idle["sent_bytes"] == idle["received_bytes"] == 0, (r, step, idle)


def test_wire_bytes_before_init_is_a_value_error():
    from perseus.lifecycle import api
    from perseus.runtime.state import Runtime

    with pytest.raises(ValueError, match="not been initialized"):
        Runtime().wire_bytes()
    assert api.wire_bytes.__self__ is api._basics and "wire_bytes" in api.__all__
