"""Unit tests for the elastic state API (perseus.elastic.state, perseus.torch.elastic), in one process.

perseus runs as a one-rank job here (MPI singleton); the retry loop's reset really restarts perseus.
"""

from __future__ import annotations

import copy
import queue

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import perseus.torch as hvd
import perseus.torch.elastic as elastic
from perseus.elastic import state as common_elastic
from perseus.elastic.state import HostUpdateResult, ObjectState, State, run_fn
from perseus.base.exceptions import HorovodInternalError, HostsUpdatedInterrupt, PerseusInternalError
from perseus.torch.elastic import sampler as sampler_module
from perseus.torch.elastic import state as state_module

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def perseus_job():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture(autouse=True)
def no_limit_override(monkeypatch):
    monkeypatch.delenv(common_elastic.RESET_LIMIT_ENV, raising=False)


class Recorder:
    """Stand-in broadcast for State without perseus: rank 0's view is this rank's, optionally replaced."""

    def __init__(self, replace=None):
        self.calls = []
        self.replace = replace

    def __call__(self, obj):
        self.calls.append(obj)
        if self.replace is not None and isinstance(obj, tuple):
            return self.replace
        return copy.deepcopy(obj)


def make_object_state(**kwargs):
    bcast = Recorder()
    return ObjectState(bcast, lambda: 0, **kwargs), bcast


# ----------------------------------------------------------------------------- ObjectState


def test_object_state_attributes_save_restore_commit():
    state, _ = make_object_state(epoch=1, batch=5, history=[1.0])
    assert (state.epoch, state.batch, state.history) == (1, 5, [1.0])

    state.epoch, state.batch = 2, 7
    state.history.append(2.0)
    state.restore()  # back to the constructor values, in-place list change included
    assert (state.epoch, state.batch, state.history) == (1, 5, [1.0])

    state.epoch = 3
    state.history.append(3.0)
    state.commit()
    state.epoch = 4
    state.history.append(4.0)  # changing the live list must not change the snapshot
    state.restore()
    assert (state.epoch, state.history) == (3, [1.0, 3.0])
    state.history.append(5.0)  # nor must changing the restored list
    state.restore()
    assert state.history == [1.0, 3.0]


def test_object_state_sync_uses_the_snapshot():
    bcast = Recorder()
    state = ObjectState(bcast, lambda: 0, lr=0.1, names=["a"])
    state.lr = 0.5  # not committed: sync sends the snapshot
    state.sync()
    assert state.lr == 0.1 and state.names == ["a"]
    assert bcast.calls == [{"lr": 0.1, "names": ["a"]}]

    empty_bcast = Recorder()
    ObjectState(empty_bcast, lambda: 0).sync()
    assert empty_bcast.calls == []  # nothing to send


def test_object_state_uncopyable_value_is_kept_by_reference():
    gen = (i for i in range(3))
    state, _ = make_object_state(gen=gen, n=1)
    state.commit()
    state.restore()
    assert state.gen is gen


def test_object_state_rejects_names_that_hide_its_machinery():
    for bad in ("commit", "save", "sync", "_saved_state", "_rank"):
        with pytest.raises(ValueError, match=bad):
            ObjectState(Recorder(), lambda: 0, **{bad: 1})


def test_state_base_is_abstract_and_reset_callbacks_run_in_order():
    base = State(Recorder(), lambda: 0)
    for method in (base.save, base.restore, base.sync):
        with pytest.raises(NotImplementedError):
            method()
    state, _ = make_object_state(x=1)
    order = []
    state.register_reset_callbacks([lambda: order.append("a")])
    state.register_reset_callbacks([lambda: order.append("b"), lambda: order.append("c")])
    state.on_hosts_updated(5, HostUpdateResult.added)
    state.on_reset()
    assert order == ["a", "b", "c"]
    assert state._host_messages.empty()  # notifications from before the reset are dropped


# ----------------------------------------------------------------------------- host updates


def test_check_host_updates_without_notifications_is_quiet_but_collective():
    state, bcast = make_object_state(x=1)
    for _ in range(3):
        state.commit()
    # One broadcast per check even when nothing happened, so every rank makes the same calls.
    assert [c for c in bcast.calls if isinstance(c, tuple)] == [(0, 0, 0)] * 3


@pytest.mark.parametrize("updates, skip_sync", [
    ([HostUpdateResult.removed], True),
    ([HostUpdateResult.added], False),
    ([HostUpdateResult.removed, HostUpdateResult.added], False),
    ([HostUpdateResult.mixed], False),
])
def test_check_host_updates_raises_after_a_notification(updates, skip_sync):
    state, _ = make_object_state(x=1)
    for i, update in enumerate(updates):
        state.on_hosts_updated(10 + i, update)
    state.x = 2
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is skip_sync
    state.restore()
    assert state.x == 2  # commit saved before it checked
    state.check_host_updates()  # the notification was consumed
    assert state._last_updated_timestamp == 10 + len(updates) - 1


def test_check_host_updates_ignores_stale_timestamps():
    state, _ = make_object_state(x=1)
    state.on_hosts_updated(10, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt):
        state.check_host_updates()
    state.on_hosts_updated(10, HostUpdateResult.added)
    state.on_hosts_updated(7, HostUpdateResult.removed)
    state.check_host_updates()  # nothing newer than 10


def test_check_host_updates_follows_rank_0():
    # A rank with no notification of its own still raises when rank 0 reports one...
    follower = ObjectState(Recorder(replace=(0, 42, int(HostUpdateResult.removed))), lambda: 1, x=1)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        follower.check_host_updates()
    assert info.value.skip_sync is True
    assert follower._last_updated_timestamp == 42
    # ... and a notification only this rank got does nothing when rank 0 saw none.
    quiet = ObjectState(Recorder(replace=(0, 0, 0)), lambda: 1, x=1)
    quiet.on_hosts_updated(99, HostUpdateResult.added)
    quiet.check_host_updates()
    assert quiet._last_updated_timestamp == 0


def test_torch_state_host_update_check_makes_no_collective_on_one_rank():
    state = elastic.TorchState(epoch=0)
    assert state._bcast_host_update((0, 5, 2)) == (0, 5, 2)
    state.on_hosts_updated(3, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is False


# ----------------------------------------------------------------------------- TorchState


def train_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b), (a, b)
    else:
        assert a == b


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
], ids=["sgd_momentum", "adam"])
def test_torch_state_restores_model_and_optimizer(make_optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    optimizer = make_optimizer(model.parameters())
    state = elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.sync()
    train_step(model, optimizer, 1)
    state.batch = 1
    state.commit()
    committed = snapshot(model, optimizer)

    for step in range(2, 5):
        train_step(model, optimizer, step)
        state.batch = step
    with pytest.raises(AssertionError):
        assert_same(snapshot(model, optimizer)[0], committed[0])

    state.restore()
    assert_same(snapshot(model, optimizer), committed)
    assert state.batch == 1

    # The optimizer must not share tensors with the snapshot: train on, restore again, same result.
    train_step(model, optimizer, 9)
    state.restore()
    assert_same(snapshot(model, optimizer), committed)
    assert state.model is model and state.optimizer is optimizer


def test_torch_state_mirrors_horovod_elastic_state_test():
    """Horovod's test_elastic_state, in a one-rank job: sync, partial change + restore, change + commit."""
    value = 1.0
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.load_state_dict({"0.weight": torch.full((2, 2), value), "0.bias": torch.full((2,), value)})
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    other.load_state_dict({"0.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "0.bias": torch.zeros(2)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001 * hvd.size())
    state = elastic.TorchState(model, optimizer, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    for w in state.model.state_dict().values():
        assert torch.equal(w, torch.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)
    synced = copy.deepcopy(model.state_dict())

    model.load_state_dict(other.state_dict())
    state.batch, state.epoch = 21, 11
    state.restore()
    assert_same(model.state_dict(), synced)
    assert (state.batch, state.epoch) == (20, 10)

    model.load_state_dict(other.state_dict())
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    assert_same(model.state_dict(), other.state_dict())
    assert (state.batch, state.epoch) == (21, 11)


def test_torch_state_assigning_a_handled_attribute_goes_to_the_handler():
    model = torch.nn.Linear(2, 2)
    state = elastic.TorchState(model=model, epoch=0)
    replacement = torch.nn.Linear(2, 2)
    with torch.no_grad():
        replacement.weight.fill_(3.0)
    state.model = replacement
    assert state.model is replacement and state._handlers["model"].value is replacement
    with torch.no_grad():
        replacement.weight.fill_(-1.0)
    state.restore()  # the assignment snapshotted the new model
    assert torch.all(replacement.weight == 3.0)
    # Unhandled attributes stay plain; model=None / optimizer=None are plain attributes too.
    plain = elastic.TorchState(epoch=5)
    assert plain.model is None and plain.optimizer is None and plain._handlers == {}


def test_handler_registry_accepts_custom_handlers():
    class Counter:
        def __init__(self):
            self.n = 0

    class CounterHandler(state_module.StateHandler):
        def __init__(self, value):
            super().__init__(value)
            self.save()

        def save(self):
            self.saved = self.value.n

        def restore(self):
            self.value.n = self.saved

        def sync(self):
            self.value.n = hvd.broadcast_object(self.value.n, 0)

    original = state_module.get_handler_registry()
    state_module.set_handler_registry(original + [(Counter, CounterHandler)])
    try:
        counter = Counter()
        state = elastic.TorchState(counter=counter)
        assert isinstance(state._handlers["counter"], CounterHandler)
        counter.n = 5
        state.commit()
        counter.n = 9
        state.restore()
        assert counter.n == 5
        state.sync()
    finally:
        state_module.set_handler_registry(original)
    assert state_module.get_handler_registry() is original
    assert [t for t, _ in original][:3] == [torch.nn.Module, torch.optim.Optimizer, elastic.ElasticSampler]
    assert original[3][1] is state_module.SchedulerStateHandler  # learning-rate schedulers (several classes)
    assert torch.optim.lr_scheduler.LRScheduler in original[3][0]


def test_module_surface():
    assert elastic.__all__ == ["TorchState", "ElasticSampler", "run"]
    assert elastic.ObjectState is ObjectState
    assert issubclass(elastic.TorchState, ObjectState)


# ----------------------------------------------------------------------------- ElasticSampler


class ListDataset(Dataset):
    def __init__(self, n):
        self.data = list(range(n))

    def __getitem__(self, idx):
        return self.data[idx]

    def __len__(self):
        return len(self.data)


@pytest.fixture
def fake_ranks(monkeypatch):
    """Act as any rank of a job of any size, without that job: ``be(rank, size)`` then build or reshard."""
    world = {"rank": 0, "size": 1}
    monkeypatch.setattr(sampler_module, "size", lambda: world["size"])
    monkeypatch.setattr(sampler_module, "rank", lambda: world["rank"])

    def be(world_rank, world_size):
        world.update(rank=world_rank, size=world_size)

    return be


def sampler_of(be, dataset, world_rank, world_size, **kwargs):
    be(world_rank, world_size)
    return elastic.ElasticSampler(dataset, **kwargs)


def test_sampler_one_rank_iterates_every_index_once():
    sampler = elastic.ElasticSampler(ListDataset(10), shuffle=False)
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    assert (sampler.num_replicas, sampler.rank, sampler.epoch, sampler.processed_num) == (1, 0, 0, 0)
    shuffled = elastic.ElasticSampler(ListDataset(10), shuffle=True, seed=3)
    assert sorted(shuffled) == list(range(10)) and list(shuffled) != list(range(10))


def test_sampler_set_epoch_reshuffles_deterministically():
    a = elastic.ElasticSampler(ListDataset(50), seed=7)
    b = elastic.ElasticSampler(ListDataset(50), seed=7)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)  # same seed and epoch: same order
        orders.append(list(a))
    assert orders[0] != orders[1] != orders[2]
    a.set_epoch(1)
    assert list(a) == orders[1]  # an epoch's order is a function of seed + epoch only
    c = elastic.ElasticSampler(ListDataset(50), seed=8)
    assert list(c) != orders[0]


def test_sampler_record_batch_and_state_dict_round_trip():
    dataset = ListDataset(20)
    sampler = elastic.ElasticSampler(dataset, seed=1)
    sampler.set_epoch(4)
    order = list(sampler)
    sampler.record_batch(0, 3)
    sampler.record_batch(1, 3)
    assert sampler.processed_num == 6
    assert list(sampler) == order  # iterating does not reshard ...
    sd = sampler.state_dict()
    assert sd == {"epoch": 4, "processed_num": 6, "processed_indices": []}

    other = elastic.ElasticSampler(dataset, seed=1)
    other.load_state_dict(sd)  # ... loading does
    assert other.epoch == 4 and other.processed_num == 6
    assert other.remaining_indices == order[6:] and list(other) == order[6:] and len(other) == 14
    other.load_state_dict({"epoch": 4, "processed_num": 10})  # Horovod's state_dict format
    assert list(other) == order[10:]

    other.record_indices([order[12], order[15]])
    third = elastic.ElasticSampler(dataset, seed=1)
    third.load_state_dict(other.state_dict())
    assert list(third) == [i for i in order[10:] if i not in (order[12], order[15])]

    third.set_epoch(5)
    assert third.processed_num == 0 and third.processed_indices == set() and len(third) == 20


def test_sampler_shards_are_disjoint_and_padded(fake_ranks):
    dataset = ListDataset(10)
    shards = [list(sampler_of(fake_ranks, dataset, r, 3, seed=2)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]
    flat = [i for s in shards for i in s]
    assert sorted(set(flat)) == list(range(10))
    assert len(flat) - len(set(flat)) == 2  # two padding repeats

    # Resuming: one batch of 2 per rank processed, the remaining 4 spread over 3 ranks.
    samplers = [sampler_of(fake_ranks, dataset, r, 3, seed=2) for r in range(3)]
    order = samplers[0].remaining_indices[:]
    for r, s in enumerate(samplers):
        fake_ranks(r, 3)
        s.record_batch(0, 2)
        s.load_state_dict(s.state_dict())
    assert all(s.processed_num == 6 for s in samplers)
    rest = [list(s) for s in samplers]
    assert {i for r in rest for i in r} == set(order[6:]) and all(len(r) == 2 for r in rest)

    # The same state resumed by 2 ranks instead: no padding needed.
    two = [sampler_of(fake_ranks, dataset, r, 2, seed=2) for r in range(2)]
    for r, s in enumerate(two):
        fake_ranks(r, 2)
        s.load_state_dict(samplers[0].state_dict())
    assert sorted(list(two[0]) + list(two[1])) == sorted(order[6:])

    # Fewer samples left than ranks: padding repeats them as often as needed.
    few = [sampler_of(fake_ranks, dataset, r, 4, seed=2) for r in range(4)]
    for r, s in enumerate(few):
        fake_ranks(r, 4)
        s.load_state_dict({"epoch": 0, "processed_num": 9})
    assert [list(s) for s in few] == [[order[9]]] * 4

    # Nothing left: every rank gets nothing.
    done = sampler_of(fake_ranks, dataset, 1, 3, seed=2)
    done.load_state_dict({"epoch": 0, "processed_num": 12})
    assert list(done) == [] and len(done) == 0


def test_sampler_mirrors_horovod_elastic_sampler_test():
    """Horovod's test_elastic_sampler, in a one-rank job."""
    batch_size, per_worker = 2, 8
    dataset = ListDataset(per_worker * hvd.size())
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
            assert sampler.processed_num == batch_size * hvd.size() * (batch_idx + 1)
            total += 1
    assert total == per_worker // batch_size * 2

    # Without set_epoch the loader repeats the same samples.
    assert sum(1 for _ in loader) == per_worker // batch_size

    sampler.set_epoch(2)
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    committed = sampler.processed_num
    state.commit()
    sampler.record_batch(2, batch_size)
    sampler.record_batch(3, batch_size)
    assert sampler.processed_num == 4 * batch_size * hvd.size()
    state.restore()
    assert sampler.processed_num == committed == 2 * batch_size * hvd.size()

    sampler.record_batch(2, batch_size)
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch_size * hvd.size()
    assert len(sampler) == batch_size and sum(1 for _ in loader) == 1

    sampler.set_epoch(3)
    assert len(sampler) == per_worker and sum(1 for _ in loader) == per_worker // batch_size


# ----------------------------------------------------------------------------- the run() loop


def test_run_retries_after_internal_error_from_the_last_commit():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model, optimizer, batch=0, log=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.is_initialized())])
    starts, committed = [], {}

    @elastic.run
    def train(state, steps, fail_at):
        starts.append((state.batch, list(state.log), copy.deepcopy(model.state_dict())))
        while state.batch < steps:
            train_step(model, optimizer, state.batch)
            state.batch += 1
            state.log.append(state.batch)
            if state.batch == fail_at and len(starts) == 1:
                raise PerseusInternalError("simulated failed collective")
            if state.batch % 2 == 0:
                state.commit()
                committed[state.batch] = copy.deepcopy(model.state_dict())
        return "done"

    assert train(state, 6, fail_at=5) == "done"
    assert len(starts) == 2 and resets == [True]
    batch, log, weights = starts[1]
    assert batch == 4 and log == [1, 2, 3, 4]  # back to the commit at batch 4
    assert_same(weights, committed[4])
    assert state.batch == 6 and state.log == [1, 2, 3, 4, 5, 6]
    assert hvd.is_initialized()

    # The same training without a failure ends with the same weights.
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(4, 2)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        train_step(ref_model, ref_opt, step)
    assert_same(model.state_dict(), ref_model.state_dict())


def test_run_gives_up_after_the_reset_limit():
    state, _ = make_object_state(x=0)
    attempts, resets = [], []
    state.register_reset_callbacks([lambda: resets.append(1)])

    def always_fails(state):
        attempts.append(state.x)
        state.x += 1
        raise HorovodInternalError("allreduce failed the same way again")

    wrapped = run_fn(always_fails, lambda: None)
    with pytest.raises(HorovodInternalError) as info:
        wrapped(state)
    limit = common_elastic.DEFAULT_RESET_LIMIT
    assert limit == 3 and len(attempts) == limit + 1 and len(resets) == limit
    assert attempts == [0] * (limit + 1)  # restored before every retry
    message = str(info.value)
    assert "giving up after 3 reset(s)" in message
    assert "not started by an elastic launcher" in message
    assert "allreduce failed the same way again" in message and common_elastic.RESET_LIMIT_ENV in message
    assert isinstance(info.value.__cause__, HorovodInternalError)


def test_run_reset_limit_from_the_environment(monkeypatch):
    calls = []

    @elastic.run
    def fails(state):
        calls.append(1)
        raise PerseusInternalError("stall")

    monkeypatch.setenv(common_elastic.RESET_LIMIT_ENV, "1")
    with pytest.raises(PerseusInternalError, match=r"giving up after 1 reset\(s\).*RESET_LIMIT=1"):
        fails(elastic.TorchState(epoch=0))
    assert len(calls) == 2 and hvd.is_initialized()

    monkeypatch.setenv(common_elastic.RESET_LIMIT_ENV, "0")
    calls.clear()
    with pytest.raises(PerseusInternalError):
        fails(elastic.TorchState(epoch=0))
    assert len(calls) == 1

    for bad in ("-1", "many"):
        monkeypatch.setenv(common_elastic.RESET_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match="expected an integer"):
            common_elastic.reset_limit()
    monkeypatch.setenv(common_elastic.RESET_LIMIT_ENV, "none")
    assert common_elastic.reset_limit() is None


def test_run_other_exceptions_propagate_without_reset():
    resets = []
    state = elastic.TorchState(epoch=0)
    state.register_reset_callbacks([lambda: resets.append(1)])

    @elastic.run
    def broken(state):
        raise ValueError("a bug in the training script")

    with pytest.raises(ValueError, match="a bug"):
        broken(state)
    assert resets == []
    assert state not in common_elastic.notification_manager._listeners


def test_run_hosts_updated_interrupt_keeps_state_and_honours_skip_sync():
    bcast_state = elastic.TorchState(epoch=0)
    syncs = []
    original_sync = bcast_state.sync

    def counting_sync():
        syncs.append(bcast_state.epoch)
        original_sync()

    bcast_state.sync = counting_sync
    resets = []
    bcast_state.register_reset_callbacks([lambda: resets.append(1)])
    schedule = [HostUpdateResult.removed, HostUpdateResult.added]

    @elastic.run
    def train(state):
        while state.epoch < 4:
            state.epoch += 1
            if schedule and state.epoch in (2, 3):
                state.on_hosts_updated(state.epoch, schedule.pop(0))
            state.commit()
        return state.epoch

    assert train(bcast_state) == 4
    assert len(resets) == 2
    # First attempt synced; after 'removed' (skip_sync) no sync; after 'added' a sync, of the committed epoch.
    assert syncs == [0, 3]


def test_notification_seam_delivers_launcher_updates():
    delivered = []

    class FakeSource:
        def __init__(self, manager):
            self.manager = manager
            delivered.append(manager)

    common_elastic.set_notification_source(FakeSource)
    try:
        assert common_elastic.reset_limit() == common_elastic.DEFAULT_RESET_LIMIT  # not started yet
        state = elastic.TorchState(epoch=0)
        seen = []

        @elastic.run
        def train(state):
            manager = common_elastic.notification_manager
            assert manager.attached and state in manager._listeners
            assert common_elastic.reset_limit() is None  # the launcher owns the limit
            seen.append(state.epoch)
            if len(seen) == 1:
                manager.handle_hosts_updated(1, HostUpdateResult.added)
            state.epoch += 1
            state.commit()
            return len(seen)

        assert train(state) == 2 and seen == [0, 1]
        assert delivered == [common_elastic.notification_manager]
        assert state not in common_elastic.notification_manager._listeners
    finally:
        common_elastic.set_notification_source(None)
        common_elastic.notification_manager._detach()
    assert not common_elastic.notification_manager.attached


def test_host_messages_queue_is_a_queue():
    # Horovod's own elastic test scripts poke at these two attributes.
    state = elastic.TorchState(epoch=0)
    assert isinstance(state._host_messages, queue.Queue) and state._last_updated_timestamp == 0


def test_horovod_common_elastic_path_names_the_same_objects():
    """Code that imports Horovod's horovod.common.elastic (through the alias) gets perseus.elastic.state's."""
    from perseus.common import elastic as at_horovod_path

    for name in common_elastic.__all__:
        assert getattr(at_horovod_path, name) is getattr(common_elastic, name), name
