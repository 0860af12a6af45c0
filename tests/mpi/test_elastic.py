"""Elastic state under mpirun: sync from rank 0, sampler sharding and resumption, and the run() retry loop
recovering from a collective that failed on every rank."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import perseus.torch.elastic as elastic
from perseus.elastic import state as common_elastic
from perseus.elastic.state import HostUpdateResult, ObjectState
from perseus.base.exceptions import HorovodInternalError, HostsUpdatedInterrupt

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_limit_override(monkeypatch):
    monkeypatch.delenv(common_elastic.RESET_LIMIT_ENV, raising=False)


def flat(obj):
    """Tensors in a nested state_dict as plain lists (picklable, comparable)."""
    if isinstance(obj, dict):
        return {k: flat(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [flat(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.tolist()
    return obj


def assert_everyone_has(hvd, value):
    """Every rank's ``value`` equals rank 0's."""
    values = hvd.allgather_object(value)
    for r, v in enumerate(values):
        assert v == values[0], f"rank {r} differs from rank 0"
    return values[0]


def build(rank, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def local_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


# ----------------------------------------------------------------------------- sync


def test_torch_state_sync_makes_every_rank_equal_rank_0(hvd):
    r = hvd.rank()
    model = build(r)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.9, 0.99 - 0.01 * r))
    for step in range(r + 1):  # different moments and step counts on each rank
        local_step(model, optimizer, seed=100 * r + step)
    state = elastic.TorchState(model, optimizer, epoch=10 + r, batch=20 + r, tags=["r%d" % r])

    state.sync()
    assert (state.epoch, state.batch, state.tags) == (10, 20, ["r0"])
    synced = assert_everyone_has(hvd, (flat(model.state_dict()), flat(optimizer.state_dict())))
    assert synced[1]["param_groups"][0]["lr"] == 0.01
    assert all(s["step"] == 1 for s in synced[1]["state"].values())

    # The synced state is the committed one: a restore keeps every rank at rank 0's values.
    local_step(model, optimizer, seed=7 + r)
    state.epoch = 99
    state.restore()
    assert flat(model.state_dict()) == synced[0] and flat(optimizer.state_dict()) == synced[1]
    assert state.epoch == 10


def test_object_state_sync_of_scalars_and_lists(hvd):
    r = hvd.rank()
    state = ObjectState(hvd.broadcast_object, hvd.rank, lr=0.1 * (r + 1), step=r, seen=list(range(r + 2)),
                        meta={"rank": r}, none=None)
    state.sync()
    assert (state.lr, state.step, state.seen, state.meta, state.none) == (0.1, 0, [0, 1], {"rank": 0}, None)

    # sync sends rank 0's committed values, not uncommitted changes.
    state.step = 5 + r
    state.sync()
    assert state.step == 0
    state.step = 7
    state.seen.append(r)
    state.commit()
    state.sync()
    assert state.step == 7 and state.seen == [0, 1, 0]
    assert_everyone_has(hvd, (state.lr, state.step, state.seen, state.meta))


def test_torch_state_mirrors_horovod_elastic_state_test(hvd):
    """Horovod's test_elastic_state at any size: sync to rank 0, restore, commit."""
    v = 1.0 if hvd.rank() == 0 else 2.0
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.load_state_dict({"0.weight": torch.full((2, 2), v), "0.bias": torch.full((2,), v)})
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    other.load_state_dict({"0.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "0.bias": torch.zeros(2)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001 * hvd.size())
    state = elastic.TorchState(model, optimizer, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    for w in state.model.state_dict().values():
        assert torch.equal(w, torch.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)

    model.load_state_dict(other.state_dict())
    state.batch, state.epoch = 21, 11
    state.restore()
    for w in model.state_dict().values():
        assert torch.equal(w, torch.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)

    model.load_state_dict(other.state_dict())
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    assert flat(model.state_dict()) == flat(other.state_dict())
    assert (state.batch, state.epoch) == (21, 11)


# ----------------------------------------------------------------------------- host updates


def test_check_host_updates_is_decided_by_rank_0(hvd):
    state = elastic.TorchState(epoch=0)
    for _ in range(3):
        state.commit()  # nothing happened: no rank raises

    # Only a non-zero rank was told: nobody raises (rank 0 decides), and nobody hangs.
    if hvd.rank() == hvd.size() - 1 and hvd.size() > 1:
        state.on_hosts_updated(5, HostUpdateResult.added)
    state.check_host_updates()

    # Rank 0 was told about removed hosts: every rank raises, with skip_sync.
    if hvd.rank() == 0:
        state.on_hosts_updated(7, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is True
    assert_everyone_has(hvd, state._last_updated_timestamp)
    state.check_host_updates()

    # With nothing to report a check is one small broadcast: it never waits on a timer or a timeout (a hang
    # bound only, far above a busy machine's time; the cost itself is measured, not asserted).
    for _ in range(20):
        start = time.monotonic()
        state.check_host_updates()
        assert time.monotonic() - start < 2.0


# ----------------------------------------------------------------------------- sampler


class ListDataset(Dataset):
    def __init__(self, n):
        self.data = list(range(n))

    def __getitem__(self, idx):
        return self.data[idx]

    def __len__(self):
        return len(self.data)


@pytest.mark.parametrize("n", [24, 25, 31])
def test_sampler_shards_disjoint_cover_and_resume(hvd, n):
    size, batch = hvd.size(), 2
    sampler = elastic.ElasticSampler(ListDataset(n), shuffle=True, seed=5)
    sampler.set_epoch(1)
    order = sampler.remaining_indices[:]
    state = elastic.TorchState(sampler=sampler)
    state.sync()

    shards = hvd.allgather_object(list(sampler))
    assert all(len(s) == -(-n // size) for s in shards)
    everything = [i for s in shards for i in s]
    assert set(everything) == set(range(n))
    assert len(everything) - n == -(-n // size) * size - n  # only the padding repeats
    assert len({i for s in shards for i in s[:n // size]}) == (n // size) * size  # disjoint before padding

    # Two batches on every rank, commit, a third one lost, restore, sync: resume after the committed two.
    it = iter(sampler)
    for b in range(2):
        [next(it) for _ in range(batch)]
        sampler.record_batch(b, batch)
    state.commit()
    sampler.record_batch(2, batch)
    state.restore()
    state.sync()
    done = 2 * batch * size
    assert sampler.processed_num == done
    assert {i for s in shards for i in s[:2 * batch]} == set(order[:done])  # what the two batches used
    remaining = assert_everyone_has(hvd, sampler.remaining_indices)
    assert remaining == order[done:]
    rest = hvd.allgather_object(list(sampler))
    assert {i for s in rest for i in s} == set(remaining)
    assert all(len(s) == -(-(n - done) // size) for s in rest)


def test_sampler_sync_unites_recorded_indices(hvd):
    r, size = hvd.rank(), hvd.size()
    sampler = elastic.ElasticSampler(ListDataset(6 * size), shuffle=False)
    state = elastic.TorchState(sampler=sampler)
    mine = list(sampler)
    sampler.record_indices(mine[:3])  # each rank processed the first 3 samples of its own shard
    state.commit()
    state.sync()
    expected = sorted(i for s in hvd.allgather_object(mine) for i in s[:3])
    assert sampler.state_dict()["processed_indices"] == expected
    left = hvd.allgather_object(list(sampler))
    assert sorted(i for s in left for i in s) == sorted(set(range(6 * size)) - set(expected))
    assert len(sampler) == 3 and r == hvd.rank()


def test_sampler_mirrors_horovod_elastic_sampler_test(hvd):
    """Horovod's test_elastic_sampler at any size."""
    batch_size, per_worker, size = 2, 8, hvd.size()
    dataset = ListDataset(per_worker * size)
    sampler = elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = elastic.TorchState(sampler=sampler)
    state.sync()
    assert state.sampler.epoch == 0 and state.sampler.processed_num == 0

    total = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch_idx, _ in enumerate(loader):
            sampler.record_batch(batch_idx, batch_size)
            assert sampler.processed_num == batch_size * size * (batch_idx + 1)
            total += 1
    assert total == per_worker // batch_size * 2
    assert sum(1 for _ in loader) == per_worker // batch_size  # no set_epoch: the same samples again

    sampler.set_epoch(2)
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    state.commit()
    sampler.record_batch(2, batch_size)
    sampler.record_batch(3, batch_size)
    state.restore()
    assert sampler.processed_num == 2 * batch_size * size

    sampler.record_batch(2, batch_size)
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch_size * size
    assert len(sampler) == batch_size and sum(1 for _ in loader) == 1
    seen = hvd.allgather_object([int(x) for b in loader for x in b])
    assert len({i for s in seen for i in s}) == batch_size * size  # the last batch: disjoint across ranks

    sampler.set_epoch(3)
    assert len(sampler) == per_worker and sum(1 for _ in loader) == per_worker // batch_size


# ----------------------------------------------------------------------------- run()


def make_training(hvd, seed=0):
    torch.manual_seed(seed + hvd.rank())  # different start on every rank: the first sync fixes that
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    return model, optimizer


def batch_for(hvd, step):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def train_reference(hvd, steps):
    model, optimizer = make_training(hvd)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(steps):
        x, y = batch_for(hvd, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return flat(model.state_dict())


@pytest.mark.parametrize("failure", ["raised", "mismatched_collective"])
def test_run_recovers_from_a_failure_every_rank_saw(hvd, failure):
    steps, fail_at, commit_every = 9, 6, 2
    reference = train_reference(hvd, steps)

    model, optimizer = make_training(hvd)
    state = elastic.TorchState(model, optimizer, batch=0, commits=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.is_initialized())])
    attempts, commits = [], {}

    @elastic.run
    def train(state):
        attempts.append((state.batch, state.commits, flat(model.state_dict()), flat(optimizer.state_dict())))
        while state.batch < steps:
            x, y = batch_for(hvd, state.batch)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # gradients now in flight
            if state.batch == fail_at and len(attempts) == 1:
                if failure == "raised":
                    raise HorovodInternalError("simulated failed collective")
                shape = (3,) if hvd.rank() == 0 else (4,)
                hvd.allreduce(torch.ones(shape), name="elastic.mismatch")  # fails on every rank
                raise AssertionError("the mismatched allreduce should have failed")
            optimizer.step()
            state.batch += 1
            if state.batch % commit_every == 0:
                state.commits += 1
                state.commit()
                commits[state.batch] = (flat(model.state_dict()), flat(optimizer.state_dict()))
        return state.batch

    assert train(state) == steps
    assert len(attempts) == 2 and resets == [True]
    batch, ncommits, weights, opt_state = attempts[1]
    last_commit = fail_at // commit_every * commit_every
    assert (batch, ncommits) == (last_commit, last_commit // commit_every)
    assert weights == commits[last_commit][0] and opt_state == commits[last_commit][1]
    assert_everyone_has(hvd, attempts[1][2:])  # restored to the same commit everywhere

    final = assert_everyone_has(hvd, flat(model.state_dict()))
    for name, values in final.items():
        assert torch.allclose(torch.tensor(values), torch.tensor(reference[name]), atol=1e-6), name
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="elastic.after")
    assert out.tolist() == [hvd.size()] * 2


def test_run_stops_after_the_reset_limit_on_every_rank(hvd, monkeypatch):
    monkeypatch.setenv(common_elastic.RESET_LIMIT_ENV, "2")
    state = elastic.TorchState(epoch=hvd.rank())
    attempts = []

    @elastic.run
    def train(state):
        attempts.append(state.epoch)
        shape = (2,) if hvd.rank() == 0 else (5,)
        hvd.allreduce(torch.ones(shape), name="elastic.always_mismatched")

    with pytest.raises(HorovodInternalError) as info:
        train(state)
    assert attempts == [0, 0, 0]
    message = str(info.value)
    assert "giving up after 2 reset(s)" in message and "not started by an elastic launcher" in message
    assert "shape" in message
    assert hvd.is_initialized()
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="elastic.after_limit")
    assert out.tolist() == [hvd.size()] * 2


def test_reset_renumbers_unnamed_requests_on_every_rank(hvd):
    # Before the failure rank 0 made one more unnamed allreduce than the others (its peers never submit it).
    # After the reset every rank must name its unnamed requests from the same start again, or the first
    # unnamed collective of the new attempt would wait forever for names that differ by rank.
    attempts = []

    @elastic.run
    def train(state):
        attempts.append(len(attempts))
        if len(attempts) == 1:
            if hvd.rank() == 0:
                hvd.allreduce_async(torch.ones(2))  # allreduce.noname.N on rank 0 only
            shape = (2,) if hvd.rank() == 0 else (3,)
            hvd.allreduce(torch.ones(shape), name="elastic.unnamed_mismatch")  # fails on every rank
            raise AssertionError("the mismatched allreduce should have failed")
        handle = hvd.allreduce_async(torch.full((2,), float(hvd.rank())), op=hvd.Sum)
        deadline = time.monotonic() + 20
        while not hvd.poll(handle):
            assert time.monotonic() < deadline, "unnamed requests got different names on different ranks"
            time.sleep(0.01)
        return hvd.synchronize(handle)

    out = train(elastic.TorchState(epoch=0))
    assert attempts == [0, 1]
    assert out.tolist() == [float(sum(range(hvd.size())))] * 2


def test_run_with_sampler_resumes_the_epoch(hvd):
    """A sampler in the state: after a failure the epoch resumes at the last commit, nothing is skipped."""
    size, batch_size, n = hvd.size(), 2, 12 * hvd.size()
    dataset = ListDataset(n)
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = elastic.TorchState(sampler=sampler, epoch=0)
    # What this rank consumed is rank-local (sync would replace it with rank 0's), so it is kept outside the
    # state and cut back to the last commit by a reset callback.
    seen, seen_at_commit, failed = [], [0], []
    state.register_reset_callbacks([lambda: seen.__delitem__(slice(seen_at_commit[0], None))])

    def commit():
        state.commit()
        seen_at_commit[0] = len(seen)

    @elastic.run
    def train(state):
        while state.epoch < 2:
            for batch_idx, batch in enumerate(loader):
                seen.extend(int(i) for i in batch)
                sampler.record_batch(batch_idx, batch_size)
                if state.epoch == 1 and sampler.processed_num == 3 * batch_size * size and not failed:
                    failed.append(1)
                    raise HorovodInternalError("simulated")
                if batch_idx % 2 == 1:
                    commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            commit()

    train(state)
    assert failed == [1]
    everything = [i for s in hvd.allgather_object(seen) for i in s]
    assert sorted(everything) == sorted(list(range(n)) * 2)  # each sample exactly once per epoch
