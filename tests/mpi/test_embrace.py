"""DistributedEmbedding (EmbRace) under mpirun: a column-sharded table trained with alltoall equals data-parallel
training of the same model with nn.Embedding on the same global batch (references are single-process runs on
the global batch, computed on every rank), with uneven and empty per-rank batches, padding, sparse and dense
gradients, SGD/Adam/SparseAdam, vertical scheduling with prefetch, saving and loading full tables, errors."""

import copy
import os
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from perseus.torch import embedding as emb_mod

pytestmark = [pytest.mark.timeout(180), pytest.mark.rank_count]

L, CLASSES = 23, 5


def table(D, seed=0, dtype=torch.float64):
    return torch.randn(L, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def tokens(step, rank, pad=None):
    """Rank ``rank``'s ids at ``step``: uneven counts (zero on some steps), duplicates, padding tokens."""
    n = 0 if (step + rank) % 4 == 3 else 3 + (7 * step + 5 * rank) % 9
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = (torch.rand(n, generator=g) ** 2 * L).long()  # skewed: low ids repeat
    if pad is not None and n > 2:
        ids[1] = pad
    targets = torch.randint(0, CLASSES, (n,), generator=g)
    return ids, targets


class Model(nn.Module):
    def __init__(self, emb, D):
        super().__init__()
        self.emb = emb
        torch.manual_seed(3)
        self.fc = nn.Linear(D, CLASSES, dtype=torch.float64)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)))


def local_loss(model, ids, targets):
    return F.cross_entropy(model(ids), targets, reduction="sum") / max(ids.numel(), 1)


def global_loss(model, step, size, pad=None):
    """(1/size) sum over ranks of each rank's mean loss: what averaged data-parallel gradients minimise."""
    return sum(local_loss(model, *tokens(step, r, pad)) for r in range(size)) / size


def shard_of(t, emb):
    c0, c1 = emb.columns
    return t[:, c0:c1]


# -- forward ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("D", [8, 7, 5])
def test_forward_equals_full_table_lookup(hvd, D):
    size, rank = hvd.size(), hvd.rank()
    if D < size:
        pytest.skip("fewer columns than ranks")
    full = table(D, seed=D)
    emb = hvd.DistributedEmbedding(L, D, padding_idx=4, _weight=full, dtype=torch.float64)
    assert emb.weight.shape == (L, emb.columns[1] - emb.columns[0])
    widths = hvd.allgather(torch.tensor([emb.weight.shape[1]]))
    assert widths.tolist() == [D // size + (1 if r < D % size else 0) for r in range(size)]
    for step in range(4):
        ids, _ = tokens(step, rank, pad=4)
        ids = ids.view(1, -1) if step % 2 else ids  # any shape
        out = emb(ids)
        assert out.shape == ids.shape + (D,)
        torch.testing.assert_close(out, F.embedding(ids, full), rtol=0, atol=0)
    torch.testing.assert_close(emb.full_weight(root_rank=None), full, rtol=0, atol=0)
    got = emb.full_weight(root_rank=size - 1)
    assert (got is None) == (rank != size - 1)
    if got is not None:
        torch.testing.assert_close(got, full, rtol=0, atol=0)


def test_default_init_does_not_depend_on_the_number_of_ranks(hvd):
    torch.manual_seed(11)
    emb = hvd.DistributedEmbedding(L, 6, padding_idx=2)
    full = emb.full_weight(root_rank=None)
    assert float(full[2].abs().sum()) == 0.0
    torch.manual_seed(11)
    ref = torch.empty(L, 6)
    block = max(1, (1 << 20) // 6)
    for r0 in range(0, L, block):
        ref[r0:r0 + block] = torch.empty(min(block, L - r0), 6).normal_()
    ref[2] = 0
    torch.testing.assert_close(full, ref, rtol=0, atol=0)


# -- training equals dense data-parallel training ----------------------------------------------------------------
def build(hvd, variant, D, pad, sparse, extra=None):
    full = table(D, seed=1)
    ref = Model(nn.Embedding(L, D, padding_idx=pad, sparse=sparse, _weight=full.clone(), **(extra or {})), D)
    emb = hvd.DistributedEmbedding(L, D, padding_idx=pad, sparse=sparse, _weight=full, dtype=torch.float64,
                                   **(extra or {}))
    model = Model(emb, D)
    ref.fc.load_state_dict(model.fc.state_dict())
    return ref, model


def optimizers(hvd, variant, ref, model):
    """(reference optimizers, distributed optimizers) as users write them."""
    if variant == "sgd":
        make = lambda ps: [torch.optim.SGD(ps, lr=0.3, momentum=0.9)]  # noqa: E731
    elif variant == "adam":
        make = lambda ps: [torch.optim.Adam(ps, lr=0.05)]  # noqa: E731
    elif variant == "sgd_sparse":
        make = lambda ps: [torch.optim.SGD(ps, lr=0.3)]  # noqa: E731
    else:
        refs = [torch.optim.SparseAdam([ref.emb.weight], lr=0.05), torch.optim.Adam(ref.fc.parameters(), lr=0.05)]
        dist = [hvd.DistributedOptimizer(torch.optim.SparseAdam([model.emb.weight], lr=0.05),
                                         named_parameters=[("emb.weight", model.emb.weight)]),
                hvd.DistributedOptimizer(torch.optim.Adam(model.fc.parameters(), lr=0.05),
                                         named_parameters=model.fc.named_parameters())]
        return refs, dist
    return make(ref.parameters()), [hvd.DistributedOptimizer(make(model.parameters())[0],
                                                             named_parameters=model.named_parameters())]


@pytest.mark.parametrize("variant", ["sgd", "adam", "sgd_sparse", "adam_sparse"])
@pytest.mark.parametrize("D", [6, 7])
def test_training_equals_dense_data_parallel(hvd, variant, D):
    size, rank = hvd.size(), hvd.rank()
    sparse = variant.endswith("sparse")
    pad = 3
    ref, model = build(hvd, variant, D, pad, sparse)
    ref_opts, opts = optimizers(hvd, variant, ref, model)
    # Horovod's usual start: the shard is left alone, the dense layer comes from rank 0.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    for opt in opts:
        assert all(p is not model.emb.weight for p in opt._schedule.requires_update)
    for step in range(5):
        for o in ref_opts:
            o.zero_grad()
        ref_loss = global_loss(ref, step, size, pad)
        ref_loss.backward()
        for o in ref_opts:
            o.step()
        for o in opts:
            o.zero_grad()
        ids, targets = tokens(step, rank, pad)
        loss = local_loss(model, ids, targets)
        loss.backward()
        assert model.emb.weight.grad.is_sparse == sparse
        for o in opts:
            o.step()
        mean = hvd.allreduce(loss.detach(), name=f"loss.{variant}.{D}.{step}")
        torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(model.emb.weight.detach(), shard_of(ref.emb.weight.detach(), model.emb),
                                   rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(model.fc.weight.detach(), ref.fc.weight.detach(), rtol=1e-9, atol=1e-11)
    pad_row = model.emb.full_weight(root_rank=None)[pad]
    assert float(pad_row.abs().sum()) == float(ref.emb.weight[pad].detach().abs().sum())


def test_scale_grad_by_freq_and_sum_op(hvd):
    size, rank = hvd.size(), hvd.rank()
    D = 6
    full = table(D, seed=2)
    ref = Model(nn.Embedding(L, D, scale_grad_by_freq=True, _weight=full.clone()), D)
    model = Model(hvd.DistributedEmbedding(L, D, scale_grad_by_freq=True, _weight=full, dtype=torch.float64,
                                           op=hvd.Sum), D)
    ref.fc.load_state_dict(model.fc.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                   named_parameters=model.named_parameters(), op=hvd.Sum)
    for step in range(3):
        ref_opt.zero_grad()
        (global_loss(ref, step, size) * size).backward()  # Sum: the gradients of every rank added
        ref_opt.step()
        opt.zero_grad()
        local_loss(model, *tokens(step, rank)).backward()
        opt.step()
        torch.testing.assert_close(model.emb.weight.detach(), shard_of(ref.emb.weight.detach(), model.emb),
                                   rtol=1e-9, atol=1e-11)


def test_optimizer_state_broadcast_leaves_the_shard_alone(hvd):
    size, rank = hvd.size(), hvd.rank()
    _, model = build(hvd, "adam", 6, None, False)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    local_loss(model, *tokens(0, rank)).backward()
    opt.step()
    before = opt.state[model.emb.weight]["exp_avg"].clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    torch.testing.assert_close(opt.state[model.emb.weight]["exp_avg"], before, rtol=0, atol=0)
    shards = hvd.allgather(before.reshape(1, -1)[:, :L]) if size > 1 else before
    if size > 1:
        assert not torch.equal(shards[0], shards[1])


# -- vertical scheduling ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sparse", [False, True])
def test_prefetch_defers_rows_and_matches_dense_training(hvd, sparse):
    size, rank = hvd.size(), hvd.rank()
    pad, D, steps = 3, 7, 7
    ref, model = build(hvd, "sgd_sparse", D, pad, sparse)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3),
                                   named_parameters=model.named_parameters())
    deferred = 0
    for step in range(steps):
        ref_opt.zero_grad()
        ref_loss = global_loss(ref, step, size, pad)
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        ids, targets = tokens(step, rank, pad)
        loss = local_loss(model, ids, targets)
        nxt = tokens(step + 1, rank, pad)[0] if step + 1 < steps else None
        model.emb.prefetch(nxt)
        loss.backward()
        opt.step()
        deferred += model.emb.last_step_rows[1]
        # Every forward reads only rows that are up to date: the losses agree at every step.
        mean = hvd.allreduce(loss.detach(), name=f"pf.loss.{sparse}.{step}")
        torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    assert int(hvd.allreduce(torch.tensor([deferred]), op=hvd.Sum, name="pf.deferred")) > 0 or size == 1
    # The last step deferred nothing, and applied what the step before deferred.
    torch.testing.assert_close(model.emb.weight.detach(), shard_of(ref.emb.weight.detach(), model.emb),
                               rtol=1e-9, atol=1e-11)


def test_forward_after_prefetch_reuses_declared_ids_and_accepts_others(hvd):
    size, rank = hvd.size(), hvd.rank()
    full = table(6, seed=4)
    emb = hvd.DistributedEmbedding(L, 6, _weight=full, dtype=torch.float64, name="reuse")
    for step in range(3):
        declared = tokens(step, rank)[0]
        emb.prefetch(declared)
        ids = declared if (rank + step) % 2 else torch.tensor([step, 5, 5, rank])
        torch.testing.assert_close(emb(ids), F.embedding(ids, full), rtol=0, atol=0)


def test_forward_reading_a_deferred_row_raises_on_every_rank(hvd):
    rank = hvd.rank()
    if hvd.size() == 1:
        pytest.skip("nothing is deferred at one rank")
    emb = hvd.DistributedEmbedding(L, 6, _weight=table(6), dtype=torch.float64, name="stale")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    emb(torch.tensor([1, 2, 3 + rank])).sum().backward()
    emb.prefetch(torch.tensor([9]))
    opt.step()  # prefetch came after backward: nothing was deferred this time
    opt.zero_grad()
    assert emb.last_step_rows[1] == 0
    emb(torch.tensor([1, 2])).sum().backward()  # this backward defers rows 1 and 2 (not in the next batch)
    assert emb.last_step_rows[1] > 0
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="stale"):
        emb(torch.tensor([5, 2 if rank == 0 else 7]))
    emb.flush()
    assert emb.weight.grad is not None and emb.weight.grad.abs().sum() > 0
    opt.step()
    emb(torch.tensor([2]))  # applied now


# -- errors and edge cases ----------------------------------------------------------------------------------------
def test_out_of_range_id_raises_on_every_rank(hvd):
    size, rank = hvd.size(), hvd.rank()
    emb = hvd.DistributedEmbedding(L, 6, name="range")
    bad = torch.tensor([0, L + 3]) if rank == size - 1 else torch.tensor([1])
    with pytest.raises(IndexError, match=r"DistributedEmbedding\('range'\).*rank\(s\) \[" + str(size - 1)):
        emb(bad)
    with pytest.raises(IndexError, match="range"):
        emb(torch.tensor([-1]) if rank == 0 else torch.tensor([2]))
    with pytest.raises(IndexError, match="prefetch"):
        emb.prefetch(torch.tensor([L]) if rank == 0 else torch.tensor([2]))
    out = emb(torch.tensor([rank % L]))  # the table still works
    assert out.shape == (1, 6)


def test_every_rank_with_zero_tokens(hvd):
    emb = hvd.DistributedEmbedding(L, 6, _weight=table(6), dtype=torch.float64, sparse=True)
    out = emb(torch.zeros(0, 4, dtype=torch.long))
    assert out.shape == (0, 4, 6)
    out.sum().backward()
    assert emb.weight.grad.is_sparse and emb.weight.grad._nnz() == 0


def test_constructor_errors(hvd):
    with pytest.raises(NotImplementedError, match="max_norm"):
        hvd.DistributedEmbedding(L, 6, max_norm=1.0)
    with pytest.raises(ValueError, match="full table"):
        hvd.DistributedEmbedding(L, 6, _weight=torch.zeros(L, 5))
    if hvd.size() > 1:
        with pytest.raises(ValueError, match="at least one column"):
            hvd.DistributedEmbedding(L, hvd.size() - 1)


def test_priorities_travel_with_the_requests(hvd, monkeypatch):
    size, rank = hvd.size(), hvd.rank()
    if size == 1:
        pytest.skip("no communication at one rank")
    seen = []
    for fn in ("allgather_async", "alltoall_async"):
        original = getattr(emb_mod._c, fn)

        def spy(*args, _orig=original, _fn=fn, **kwargs):
            seen.append((args[2], args[4]) if _fn == "allgather_async" else (args[3], args[5]))
            return _orig(*args, **kwargs)
        monkeypatch.setattr(emb_mod._c, fn, spy)
    emb = hvd.DistributedEmbedding(L, 6, name="prio")
    out = emb(torch.tensor([1, 2, rank]))
    emb.prefetch(torch.tensor([1]))
    out.sum().backward()
    monkeypatch.undo()
    names = [n for n, _ in seen]
    prio = dict(seen)
    g, f, d = emb._priorities()
    assert names == ["prio.ids", "prio.lookup", "prio.next_ids", "prio.grad", "prio.grad_deferred"]
    assert prio["prio.grad"] == g and prio["prio.lookup"] == f and prio["prio.grad_deferred"] == d
    assert g > f > 0 > d
    emb.flush()


# -- saving and loading ---------------------------------------------------------------------------------------------
def shared_tmpdir(hvd):
    path = tempfile.mkdtemp(prefix="embrace") if hvd.rank() == 0 else None
    return hvd.broadcast_object(path, root_rank=0, name="embrace.tmp")


def test_full_state_dict_saves_on_rank0_and_loads_into_any_number_of_shards(hvd):
    size, rank = hvd.size(), hvd.rank()
    D = 7
    full = table(D, seed=5)
    model = Model(hvd.DistributedEmbedding(L, D, padding_idx=0, _weight=full, dtype=torch.float64, name="sd"), D)
    sd = emb_mod.full_state_dict(model, root_rank=0)
    assert (sd is None) == (rank != 0)
    path = os.path.join(shared_tmpdir(hvd), "full.pt")
    if rank == 0:
        torch.testing.assert_close(sd["emb.weight"], full, rtol=0, atol=0)
        torch.save(sd, path)
    hvd.barrier()
    # Into a dense model, and into a fresh sharded model on every rank.
    dense = Model(nn.Embedding(L, D, dtype=torch.float64), D)
    dense.load_state_dict(torch.load(path))
    torch.testing.assert_close(dense.emb.weight.detach(), full, rtol=0, atol=0)
    fresh = Model(hvd.DistributedEmbedding(L, D, padding_idx=0, dtype=torch.float64, name="sd2"), D)
    fresh.load_state_dict(torch.load(path))
    torch.testing.assert_close(fresh.emb.weight.detach(), shard_of(full, fresh.emb), rtol=0, atol=0)
    torch.testing.assert_close(fresh.fc.weight.detach(), model.fc.weight.detach(), rtol=0, atol=0)
    # Into fewer shards: process sets of the first k ranks.
    for k in range(1, size):
        ps = hvd.add_process_set(list(range(k)))
        if rank < k:
            part = hvd.DistributedEmbedding(L, D, dtype=torch.float64, process_set=ps, name=f"sd.k{k}")
            assert part.weight.shape[1] == D // k + (1 if rank < D % k else 0)
            part.load_state_dict({"weight": torch.load(path)["emb.weight"]})
            torch.testing.assert_close(part.full_weight(root_rank=None), full, rtol=0, atol=0)
            # Scattered from the root instead of read on every rank.
            part2 = hvd.DistributedEmbedding(L, D, dtype=torch.float64, process_set=ps, name=f"sd.s{k}")
            part2.load_full_state_dict({"weight": full} if rank == 0 else None, root_rank=0)
            torch.testing.assert_close(part2.weight.detach(), shard_of(full, part2), rtol=0, atol=0)
        hvd.remove_process_set(ps)
    # The local state dict holds this rank's shard and loads back into the same layout only.
    local = model.state_dict()
    assert emb_mod.is_model_parallel(local["emb.weight"])
    torch.testing.assert_close(local["emb.weight"], shard_of(full, model.emb), rtol=0, atol=0)
    again = Model(hvd.DistributedEmbedding(L, D, dtype=torch.float64, name="sd3"), D)
    again.load_state_dict(local)
    torch.testing.assert_close(again.emb.weight.detach(), model.emb.weight.detach(), rtol=0, atol=0)
    if size > 1:
        others = hvd.allgather_object(local, name="embrace.sd.local")
        wrong = others[(rank + 1) % size]
        if model.emb.columns != tuple(wrong._metadata["emb"]["perseus_shard"]["columns"]):
            with pytest.raises(RuntimeError, match="full table"):
                again.load_state_dict(wrong)


# -- Keras ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("sparse", [False, True])
def test_keras_fit_equals_dense_data_parallel(hvd, opt_name, sparse):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    keras = pytest.importorskip("keras")
    import numpy as np
    import perseus.keras as hvd_keras
    import tensorflow as tf

    size, rank = hvd.size(), hvd.rank()
    D, S, per, bs = 7, 4, 12, 4
    rng = np.random.RandomState(0)
    full = rng.randn(L, D).astype("float32")
    dense_w = [rng.randn(S * D, 1).astype("float32") * 0.1, np.zeros(1, "float32")]
    x = (rng.rand(per * size, S) ** 2 * L).astype("int32")
    y = rng.randn(per * size, 1).astype("float32")
    make_opt = (lambda: keras.optimizers.SGD(0.1)) if opt_name == "sgd" else (lambda: keras.optimizers.Adam(0.02))

    def build(layer):
        model = keras.Sequential([keras.Input((S,), dtype="int32"), layer, keras.layers.Flatten(),
                                  keras.layers.Dense(1)])
        model.layers[-1].set_weights(dense_w)
        return model

    emb = hvd_keras.DistributedEmbedding(L, D, weights=full, sparse=sparse, name=f"kemb_{opt_name}_{sparse}")
    model = build(emb)
    assert getattr(emb.embeddings, "perseus_model_parallel", False)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(make_opt()), loss="mse")
    model.fit(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], batch_size=bs, epochs=2,
              shuffle=False, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    class OneHotEmbedding(keras.layers.Layer):
        """The dense reference: a one-hot matmul, so the table's gradient is a dense tensor (Keras' own Embedding
        gives tf.IndexedSlices with repeated rows, which Keras' Adam squares row by row before summing)."""

        def build(self, input_shape):
            self.table = self.add_weight(shape=(L, D), initializer=lambda shape, dtype=None: full)

        def call(self, ids):
            return tf.matmul(tf.one_hot(ids, L), self.table)

    ref = build(OneHotEmbedding())
    ref.compile(optimizer=make_opt(), loss="mse")
    order = np.concatenate([np.arange(k * per, (k + 1) * per).reshape(-1, bs) for k in range(size)], axis=1).ravel()
    ref.fit(x[order], y[order], batch_size=bs * size, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(emb.full_weights(), ref.layers[0].get_weights()[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model.layers[-1].get_weights()[0], ref.layers[-1].get_weights()[0], rtol=1e-4,
                               atol=1e-5)
    out = emb(np.array([[1, 2, 3, 4]], "int32"))
    np.testing.assert_allclose(np.asarray(out), emb.full_weights()[[1, 2, 3, 4]][None], rtol=0, atol=0)
