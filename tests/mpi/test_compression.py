"""The communicating compressors (perseus.compression) under mpirun, through perseus.torch.

For top-k, random-k, sign, QSGD and PowerSGD: what each rank sent plus its new residual is what it had to
send, to the bit; the result is the sum of what the ranks sent and is bitwise the same on every rank;
training through DistributedOptimizer (per tensor and grouped) keeps the ranks' parameters identical;
16-bit gradients; errors raised on every rank; residuals gone after a shutdown.
"""

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from perseus.compression import PowerSGD, QSGD, RandomK, Sign, TopK
from perseus.compression.sign import signed

pytestmark = [pytest.mark.timeout(120), pytest.mark.rank_count]

MAKERS = {
    "topk": lambda **kw: TopK(0.1, **kw),
    "randomk": lambda **kw: RandomK(0.1, seed=1, **kw),
    "sign": lambda **kw: Sign(**kw),
    "qsgd": lambda **kw: QSGD(5, **kw),
    "qsgd127": lambda **kw: QSGD(127, **kw),
    "powersgd": lambda **kw: PowerSGD(rank=2, **kw),
}
NAMES = list(MAKERS)
#: results summed in rank order by the compressor itself (the others are summed by the engine's allreduce)
RANK_ORDER = {"topk", "sign", "qsgd", "qsgd127"}
#: (24, 16) and (12, 30) are compressed by PowerSGD(rank=2); (7,) and (3, 4, 5) travel dense
SHAPES = [(24, 16), (7,), (3, 4, 5), (12, 30)]


class Spy:
    """Records, per key, what a compressor had to send (gradient + residual) and what it sent."""

    def __init__(self, red):
        self.red, self.log = red, {}
        if isinstance(red, PowerSGD):
            round1 = red.round1

            def spy_round1(acc, st):
                self.log[st.key] = (acc.copy(), st, None, None)
                return round1(acc, st)
            red.round1 = spy_round1
        else:
            encode = red._encode

            def spy_encode(acc, st):
                before = acc.copy()
                payload, ctx = encode(acc, st)
                self.log[st.key] = (before, st, payload.copy(), ctx)
                return payload, ctx
            red._encode = spy_encode

    def sent(self, key):
        """``(had to send, what this rank's payload decodes to)``, flat float32."""
        before, st, p, ctx = self.log[key]
        red, n = self.red, st.size
        own = np.zeros(n, np.float32)
        if isinstance(red, TopK):
            k = (p.size - 1) // 2
            own[p[k:2 * k].view(np.int32)] = p[:k]
        elif isinstance(red, RandomK):
            own[ctx] = p[:ctx.size]
        elif isinstance(red, Sign):
            nb = (n + 7) // 8
            signed(np.unpackbits(p[:nb], count=n).view(np.bool_), p[nb:nb + 4].view(np.float32)[0], own)
        elif isinstance(red, QSGD):
            red._values(p, n, st.extra, own)
        else:
            own[:] = before  # dense parts as they were
            for off, rows, cols, r, p_off, q_off in st.extra["plan"].mats:
                ph = st.extra["recv1"][p_off:p_off + rows * r].reshape(rows, r)
                q = st.extra["send2"][q_off:q_off + cols * r].reshape(cols, r)
                own[off:off + rows * cols] = (ph @ q.T).reshape(-1)
        return before, own


def rank_arrays(rank, step, shapes=SHAPES, seed=0):
    rng = np.random.default_rng([seed, rank, step])
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def flat(arrays):
    return np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])


def gather_rows(hvd, vec, name):
    return hvd.allgather(torch.from_numpy(np.ascontiguousarray(vec)[None]), name=name).numpy()


def assert_same_everywhere(hvd, vec, name):
    rows = gather_rows(hvd, vec, name)
    for r in range(hvd.size()):
        assert np.array_equal(rows[r], rows[0]), f"rank {r} differs from rank 0"


# -- (a) exactness and (b) identical results -----------------------------------------------------------------

@pytest.mark.parametrize("ef", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_sent_plus_residual_is_exact_and_the_result_is_the_sum_sent(hvd, name, ef):
    size, rank = hvd.size(), hvd.rank()
    red = MAKERS[name](error_feedback=ef)
    spy = Spy(red)
    key = f"exact.{name}.{ef}"
    n = sum(int(np.prod(s)) for s in SHAPES)
    for step in range(3):
        arrays = rank_arrays(rank, step)
        old = red.residual(key)
        had = np.zeros(n, np.float32) if old is None else old.copy()
        off = 0
        for a in arrays:
            had[off:off + a.size] += a.reshape(-1)
            off += a.size
        if not ef:
            had = flat(arrays)
        out = red.reduce_async(key, arrays, op=hvd.Sum).wait()
        assert [o.shape for o in out] == SHAPES and all(o.dtype == np.float32 for o in out)
        before, own = spy.sent(key)
        assert np.array_equal(before, had)
        new = red.residual(key)
        if ef:
            assert np.array_equal(new, had - own)
            if name in ("topk", "randomk"):  # entries are sent or kept, never split
                assert np.array_equal(own + new, had)
            else:
                np.testing.assert_allclose(own + new, had, rtol=1e-6, atol=1e-6)
        else:
            assert new is None
        result = flat(out)
        owns = gather_rows(hvd, own, f"{key}.own.{step}")
        total = np.zeros(n, np.float32)
        for r in range(size):
            total += owns[r]
        if name in RANK_ORDER:
            assert np.array_equal(result, total)
        else:
            np.testing.assert_allclose(result, total, rtol=1e-5, atol=1e-5)
        assert_same_everywhere(hvd, result, f"{key}.result.{step}")


@pytest.mark.parametrize("name", NAMES)
def test_average_and_scale_factors(hvd, name):
    size, rank = hvd.size(), hvd.rank()
    arrays = rank_arrays(rank, 0, seed=5)
    outs = {}
    for label, op, pre, post in [("sum", hvd.Sum, 1.0, 1.0), ("avg", hvd.Average, 1.0, 1.0),
                                 ("scaled", hvd.Sum, 2.0, 0.5)]:
        red = MAKERS[name]()  # a fresh compressor each time: same draws, no residual
        outs[label] = flat(red.reduce_async(f"avg.{name}", [a.copy() for a in arrays], op=op,
                                            prescale_factor=pre, postscale_factor=post).wait())
    np.testing.assert_allclose(outs["avg"], outs["sum"] / size, rtol=1e-6, atol=1e-7)
    # every compressor here is homogeneous: doubling the input doubles what is sent
    np.testing.assert_allclose(outs["scaled"], outs["sum"], rtol=1e-5, atol=1e-6)
    assert_same_everywhere(hvd, outs["avg"], f"avg.{name}.same")


def test_powersgd_counts_both_rounds_and_any_wait_order(hvd):
    rank = hvd.rank()
    red = PowerSGD(rank=2)
    pa = red.reduce_async("order.a", rank_arrays(rank, 0), op=hvd.Sum)
    pb = red.reduce_async("order.b", rank_arrays(rank, 1), op=hvd.Sum)
    # ranks wait for the keys in opposite orders: each key's second round starts without waiting for it
    first, second = (pa, pb) if rank % 2 == 0 else (pb, pa)
    first.wait()
    second.wait()
    st = red._states["order.a"]
    one = st.extra["send1"].nbytes + st.extra["send2"].nbytes
    assert red.payload_bytes == 2 * one
    assert red.dense_bytes == 2 * 4 * st.size and red.payload_bytes < red.dense_bytes


# -- (c) full density is the dense allreduce ---------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: TopK(1.0), lambda: RandomK(1.0)], ids=["topk", "randomk"])
def test_full_density_equals_dense_allreduce(hvd, make):
    red = make()
    for step in range(2):
        t = torch.from_numpy(rank_arrays(hvd.rank(), step, [(50, 3)])[0])
        got = hvd.allreduce(t, op=hvd.Sum, name=f"full.{red.kind}", compression=red)
        want = hvd.allreduce(t, op=hvd.Sum, name=f"full.{red.kind}.dense")
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not red.residual(f"full.{red.kind}").any()


# -- (d) training ------------------------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()


@pytest.mark.parametrize("groups", [None, 2])
@pytest.mark.parametrize("name", NAMES)
def test_distributed_optimizer_keeps_ranks_identical(hvd, name, groups):
    rank = hvd.rank()
    torch.manual_seed(rank)  # different initial weights: the broadcast makes them equal
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = params(model).copy()
    comp = MAKERS[name]()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp, groups=groups)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x = torch.randn(4, 1, 8, 8, generator=g)
        y = torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    now = params(model)
    assert not np.array_equal(now, start)
    assert np.isfinite(now).all()
    assert_same_everywhere(hvd, now, f"opt.{name}.{groups}")
    assert 0 < comp.payload_bytes < comp.dense_bytes
    if groups:
        assert any(k.startswith("grad.group.") for k in comp._states)


# -- (e) 16-bit gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_16_bit_gradients(hvd, name, dtype):
    rank = hvd.rank()
    src = torch.from_numpy(rank_arrays(rank, 0, [(20, 12)], seed=7)[0]).to(dtype)
    key = f"half.{name}"
    got = hvd.allreduce(src.clone(), op=hvd.Sum, name=key, compression=MAKERS[name]())
    assert got.dtype == dtype and got.shape == src.shape
    # the same compressor fed the same values in float32 gives the float32 result that was rounded
    ref = hvd.allreduce(src.float(), op=hvd.Sum, name=key, compression=MAKERS[name]())
    assert torch.equal(got, ref.to(dtype))
    assert_same_everywhere(hvd, got.float().numpy(), f"{key}.{dtype}.same")


# -- (f) errors --------------------------------------------------------------------------------------------

def test_usage_errors(hvd):
    t = torch.ones(8)
    for name in NAMES:
        red = MAKERS[name]()
        with pytest.raises(ValueError, match="needs a name"):
            hvd.allreduce(t, compression=red)
        with pytest.raises(ValueError, match="Sum or Average"):
            hvd.allreduce(t, name=f"max.{name}", op=hvd.Max, compression=red)
        with pytest.raises(ValueError, match="floating-point"):
            red.reduce_async("ints", [np.ones(3, np.int32)])
        with pytest.raises(TypeError, match="own collective"):
            red.compress(t)
        with pytest.raises(TypeError):
            type(red).compress(t)
    # the engine is fine: nothing was submitted
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after_usage").item() == hvd.size()


#: (name, shape of rank 0, shape of the other ranks): payloads of equal size (the compressor's own check
#: finds the difference) or of different sizes (the engine, or the compressor's length check, does)
MISMATCHES = [
    ("topk", (1000,), (999,)), ("topk", (1000,), (10,)),
    ("randomk", (1000,), (999,)), ("randomk", (1000,), (2000,)),
    ("sign", (10,), (12,)), ("sign", (10,), (100,)),
    ("qsgd", (10,), (9,)), ("qsgd127", (10,), (11,)),
    ("powersgd", (20, 30), (20, 31)), ("powersgd", (20, 30), (30, 20)), ("powersgd", (7,), (8,)),
]


@pytest.mark.parametrize("name,mine,other", MISMATCHES)
def test_size_mismatch_raises_on_every_rank(hvd, name, mine, other):
    if hvd.size() == 1:
        pytest.skip("needs 2+ ranks")
    shape = mine if hvd.rank() == 0 else other
    red = MAKERS[name]()
    key = f"mismatch.{name}.{mine}.{other}"
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        hvd.allreduce(torch.ones(shape), name=key, compression=red)
    assert isinstance(info.value, hvd.HorovodInternalError), repr(info.value)
    assert type(info.value).__name__ == "MismatchError"
    assert key in str(info.value)
    assert time.monotonic() - start < 10
    assert red.residual(key) is None  # dropped: the part that was sent never arrived
    # the engine and the compressor still work, under the same name too
    out = hvd.allreduce(torch.ones(mine), name=key, op=hvd.Sum, compression=red)
    assert out.shape == mine
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"{key}.after").tolist() == [hvd.size()] * 2


def test_process_set(hvd):
    if hvd.size() < 3:
        pytest.skip("needs 3+ ranks (a set of 2 that is not the global set)")
    rank = hvd.rank()
    ps = hvd.add_process_set([0, 1])
    try:
        if rank < 2:
            for name in NAMES:
                red = MAKERS[name]()
                arrays = rank_arrays(rank, 0, seed=11)
                out = flat(red.reduce_async(f"ps.{name}", arrays, op=hvd.Sum, process_set=ps).wait())
                rows = hvd.allgather(torch.from_numpy(out[None]), name=f"ps.{name}.same", process_set=ps)
                assert torch.equal(rows[0], rows[1])
            full = TopK(1.0).reduce_async("ps.full", rank_arrays(rank, 0, seed=11), op=hvd.Sum,
                                          process_set=ps).wait()
            want = flat(rank_arrays(0, 0, seed=11)) + flat(rank_arrays(1, 0, seed=11))
            np.testing.assert_allclose(flat(full), want, rtol=1e-6, atol=1e-6)
    finally:
        hvd.remove_process_set(ps)


# -- (g) shutdown ------------------------------------------------------------------------------------------

def test_residuals_are_forgotten_at_shutdown(hvd):
    rank = hvd.rank()
    reds = {name: MAKERS[name](error_feedback=True) for name in NAMES}
    for name, red in reds.items():
        red.reduce_async(f"reset.{name}", rank_arrays(rank, 0), op=hvd.Sum).wait()
        assert red.residual(f"reset.{name}") is not None
    hvd.shutdown()
    try:
        for name, red in reds.items():
            assert red.residual(f"reset.{name}") is None
    finally:
        hvd.init()
    # a new job: the same compressors start afresh, identically on every rank
    for name, red in reds.items():
        out = flat(red.reduce_async(f"reset.{name}", rank_arrays(rank, 0), op=hvd.Sum).wait())
        assert_same_everywhere(hvd, out, f"reset.{name}.same")
        assert red._states[f"reset.{name}"].step == 1
