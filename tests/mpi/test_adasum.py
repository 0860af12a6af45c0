"""op=Adasum: the engine's recursive vector-halving distance-doubling result equals a direct implementation of
the formula (the same combination tree), at any number of ranks, for every floating dtype, one tensor or
many fused (each with its own coefficients), large tensors kept whole; wrong dtypes fail on every rank."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.timeout(120), pytest.mark.rank_count]


def pair(a, b):
    """Adasum of two vectors: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b (a zero vector's coefficient is 1)."""
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    return (1 - ab / (2 * aa) if aa > 0 else 1.0) * a + (1 - ab / (2 * bb) if bb > 0 else 1.0) * b


def tree(vectors):
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    return pair(tree(vectors[:half]), tree(vectors[half:]))


def reference(all_vectors):
    """The documented order: the ranks past the largest power of two fold into ranks 0, 1, ... first."""
    n = len(all_vectors)
    p2 = 1
    while p2 * 2 <= n:
        p2 *= 2
    vs = [np.asarray(v, np.float64) for v in all_vectors[:p2]]
    for i in range(n - p2):
        vs[i] = pair(vs[i], np.asarray(all_vectors[p2 + i], np.float64))
    return tree(vs)


def vectors(hvd, n_elems, seed=0, kind="random"):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=n_elems)
    if kind == "parallel":
        return [base * s for s in rng.uniform(0.5, 2.0, hvd.size())]
    if kind == "zero_on_rank0":
        out = [rng.normal(size=n_elems) for _ in range(hvd.size())]
        out[0][:] = 0
        return out
    return [rng.normal(size=n_elems) for _ in range(hvd.size())]


@pytest.mark.parametrize("kind", ["random", "parallel", "zero_on_rank0"])
@pytest.mark.parametrize("n_elems", [1, 7, 1000])
def test_float64_equals_the_formula(hvd, kind, n_elems):
    vs = vectors(hvd, n_elems, 3, kind)
    out = hvd.allreduce(torch.from_numpy(vs[hvd.rank()].copy()), op=hvd.Adasum, name=f"ada.{kind}.{n_elems}")
    np.testing.assert_allclose(out.numpy(), reference(vs), rtol=1e-12, atol=1e-12)
    if kind == "parallel" and hvd.size() & (hvd.size() - 1) == 0:  # 2^k ranks: parallel gradients average
        np.testing.assert_allclose(out.numpy(), np.mean(vs, axis=0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_low_precision_dtypes(hvd, dtype, tol):
    vs = vectors(hvd, 513, 5)
    mine = torch.from_numpy(vs[hvd.rank()].copy()).to(dtype)
    exact = [torch.from_numpy(v).to(dtype).double().numpy() for v in vs]  # what each rank really sent
    out = hvd.allreduce(mine, op=hvd.Adasum, name=f"ada.{dtype}")
    assert out.dtype == dtype
    ref = reference(exact)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_fused_tensors_keep_their_own_coefficients(hvd):
    sizes = [5, 300, 1, 64]
    per = [vectors(hvd, n, 10 + i) for i, n in enumerate(sizes)]
    tensors = [torch.from_numpy(p[hvd.rank()].copy()) for p in per]
    outs = hvd.grouped_allreduce(tensors, op=hvd.Adasum, name="ada.group")
    for out, p in zip(outs, per):
        np.testing.assert_allclose(out.numpy(), reference(p), rtol=1e-12, atol=1e-12)
    # async, several at once: fused by the engine, each still its own
    handles = [hvd.allreduce_async(t.clone(), op=hvd.Adasum, name=f"ada.async.{i}") for i, t in enumerate(tensors)]
    for h, p in zip(handles, per):
        np.testing.assert_allclose(hvd.synchronize(h).numpy(), reference(p), rtol=1e-12, atol=1e-12)


def test_large_tensor_is_not_split(hvd, monkeypatch):
    # Above the fusion threshold an all-reduce is cut into units; an Adasum tensor must stay whole.
    n = (hvd.size() * 3 + 1) * (1 << 16)
    vs = vectors(hvd, n, 21)
    t = torch.from_numpy(vs[hvd.rank()].copy())
    hvd.allreduce_(t, op=hvd.Adasum, name="ada.large")
    np.testing.assert_allclose(t.numpy(), reference(vs), rtol=1e-10, atol=1e-10)


def test_scales_and_process_set(hvd):
    vs = vectors(hvd, 33, 8)
    out = hvd.allreduce(torch.from_numpy(vs[hvd.rank()].copy()), op=hvd.Adasum, prescale_factor=2.0,
                        postscale_factor=0.25, name="ada.scaled")
    np.testing.assert_allclose(out.numpy(), 0.25 * reference([2 * v for v in vs]), rtol=1e-12, atol=1e-12)
    if hvd.size() >= 3:
        ps = hvd.add_process_set([0, 2])
        try:
            if hvd.rank() in (0, 2):
                out = hvd.allreduce(torch.from_numpy(vs[hvd.rank()].copy()), op=hvd.Adasum, process_set=ps,
                                    name="ada.subset")
                np.testing.assert_allclose(out.numpy(), reference([vs[0], vs[2]]), rtol=1e-12, atol=1e-12)
        finally:
            hvd.remove_process_set(ps)


def test_integer_tensors_are_rejected_on_every_rank(hvd):
    with pytest.raises(ValueError, match="Adasum needs floating-point"):
        hvd.allreduce(torch.ones(4, dtype=torch.int32), op=hvd.Adasum, name="ada.int")
    with pytest.raises(ValueError, match="Adasum needs floating-point"):
        hvd.grouped_allreduce([torch.ones(2), torch.ones(2, dtype=torch.int64)], op=hvd.Adasum, name="ada.gint")
    # nothing was submitted: the engine goes on
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ada.after").item() == hvd.size()


def test_tensorflow_allreduce(hvd):
    tf = pytest.importorskip("tensorflow")
    import perseus.tensorflow as htf

    vs = vectors(hvd, 17, 4)
    out = htf.allreduce(tf.constant(vs[hvd.rank()]), op=htf.Adasum, name="ada.tf")
    np.testing.assert_allclose(out.numpy(), reference(vs), rtol=1e-12, atol=1e-12)
    fn = tf.function(lambda x: htf.allreduce(x, op=htf.Adasum, name="ada.tf.fn"))
    np.testing.assert_allclose(fn(tf.constant(vs[hvd.rank()])).numpy(), reference(vs), rtol=1e-12, atol=1e-12)


# -- DistributedOptimizer(op=Adasum): Adasum of each rank's local update ------------------------------------
@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.Adam(ps, lr=0.05),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)],
                         ids=["sgd_momentum", "adam", "adamw"])
@pytest.mark.parametrize("passes", [1, 2])
def test_optimizer_combines_local_updates(hvd, make, passes):
    n, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    init = [torch.randn(6, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    targets = [[torch.full((6,), float(r + 1), dtype=torch.float64), torch.arange(3.0, dtype=torch.float64) * r]
               for r in range(n)]
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = hvd.DistributedOptimizer(make(params), named_parameters=[("w", params[0]), ("b", params[1])],
                                   op=hvd.Adasum, backward_passes_per_step=passes)
    # every rank simulates every rank's local optimizer (its own state) and combines with the formula
    sims = [[torch.nn.Parameter(t.clone()) for t in init] for _ in range(n)]
    sim_opts = [make(s) for s in sims]
    shared = [t.clone() for t in init]

    def loss_of(ps, r, micro):
        return sum(((p - t * (1 + 0.5 * micro)) ** 2).sum() for p, t in zip(ps, targets[r]))

    for step in range(3):
        opt.zero_grad()
        for micro in range(passes):
            loss_of(params, rank, micro).backward()
        opt.step()
        deltas = []
        for r in range(n):
            with torch.no_grad():
                for s, v in zip(sims[r], shared):
                    s.copy_(v)
            sim_opts[r].zero_grad()
            for micro in range(passes):
                loss_of(sims[r], r, micro).backward()
            sim_opts[r].step()
            deltas.append([(s.detach() - v) for s, v in zip(sims[r], shared)])
        for i in range(len(shared)):
            combined = reference([d[i].numpy() for d in deltas])
            shared[i] = shared[i] + torch.from_numpy(combined)
        for p, v in zip(params, shared):
            torch.testing.assert_close(p.detach(), v, rtol=1e-9, atol=1e-9)


def test_optimizer_rejects_what_it_cannot_do(hvd):
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(NotImplementedError, match="schedule='dear' with op=Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), op=hvd.Adasum, schedule="dear")
    with pytest.raises(NotImplementedError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), op=hvd.Adasum, groups=1)
    with pytest.raises(NotImplementedError, match="communicating compressor"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), op=hvd.Adasum,
                                 compression=hvd.Compression.topk(0.5))
