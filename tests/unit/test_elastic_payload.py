"""Unit tests for what an elastic rank hands to the checkpoint keepers: state payloads (perseus.torch.elastic,
perseus.elastic.state) and the launcher variables a rank parses (perseus.elastic.worker). One process."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import perseus.torch as hvd
from perseus.elastic.state import ObjectState
from perseus.elastic import worker
from perseus.torch.elastic import ElasticSampler, TorchState

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def perseus_job():
    hvd.init()
    yield
    hvd.shutdown()


def travel(payload):
    """What the keepers do to a payload: pickle protocol 5, arrays out of band, then back."""
    buffers = []
    data = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[bytearray(b.raw()) for b in buffers]), len(buffers)


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sampler = ElasticSampler(list(range(20)), shuffle=True, seed=3)
    return model, opt, sampler


def test_torch_state_payload_round_trip_into_another_process_state():
    model, opt, sampler = make(0)
    sampler.record_batch(0, 3)
    state = TorchState(model, opt, sampler=sampler, epoch=4, note={"a": [1, 2]})
    state.commit()
    payload, n_buffers = travel(state.snapshot_payload())
    assert n_buffers >= 8  # the tensors travelled out of band

    other_model, other_opt, other_sampler = make(1)
    other = TorchState(other_model, other_opt, sampler=other_sampler, epoch=0, note=None)
    other.load_snapshot_payload(payload)
    other.restore()
    for a, b in zip(model.state_dict().values(), other_model.state_dict().values()):
        assert torch.equal(a, b)
    assert other.epoch == 4 and other.note == {"a": [1, 2]}
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert other_sampler.state_dict() == sampler.state_dict()
    # The optimizer still steps after the restore (its state tensors are real tensors again).
    other_model(torch.randn(4, 8)).sum().backward()
    other_opt.step()


def test_a_learning_rate_scheduler_travels_by_its_state_and_keeps_driving_the_optimizer():
    """A scheduler in the state (Horovod's Ray example keeps one there): its commit pickles for the keepers
    even with a DistributedOptimizer, and after a restore it still drives the optimizer being trained."""
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    state = TorchState(model, opt, scheduler=scheduler, epoch=0)
    for _ in range(3):
        opt.step()
        scheduler.step()
    state.commit()
    committed_lr = opt.param_groups[0]["lr"]
    payload, _ = travel(state.snapshot_payload())
    for _ in range(4):
        opt.step()
        scheduler.step()
    state.restore()
    assert state.scheduler is scheduler and scheduler.optimizer is opt
    assert scheduler.last_epoch == 3
    other_model = torch.nn.Linear(4, 2)
    other_opt = torch.optim.SGD(other_model.parameters(), lr=0.1)
    other_sched = torch.optim.lr_scheduler.CosineAnnealingLR(other_opt, T_max=10)
    other = TorchState(other_model, other_opt, scheduler=other_sched, epoch=0)
    other.load_snapshot_payload(payload)
    other.restore()
    assert other_sched.last_epoch == 3 and other_sched.optimizer is other_opt
    other_sched.step()
    assert other_opt.param_groups[0]["lr"] < committed_lr


def test_payload_is_the_commit_not_later_changes():
    model, opt, _ = make(0)
    state = TorchState(model, opt, step=1)
    state.commit()
    payload = state.snapshot_payload()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.step = 2
    restored, _ = travel(payload)
    other = TorchState(*make(1)[:2], step=0)
    other.load_snapshot_payload(restored)
    other.restore()
    assert other.step == 1
    assert not torch.equal(next(other.model.parameters()), next(model.parameters()))


def test_payload_keeps_bfloat16_and_state_dict_metadata():
    model = torch.nn.Linear(3, 3).to(torch.bfloat16)
    state = TorchState(model)
    payload, _ = travel(state.snapshot_payload())
    other = TorchState(torch.nn.Linear(3, 3).to(torch.bfloat16))
    other.load_snapshot_payload(payload)
    other.restore()
    assert torch.equal(other.model.weight, model.weight)
    assert hasattr(payload["handlers"]["model"], "_metadata")


def test_missing_handled_attribute_is_a_clear_error():
    model, opt, _ = make(0)
    payload, _ = travel(TorchState(model).snapshot_payload())
    with pytest.raises(ValueError, match="optimizer"):
        TorchState(model, opt).load_snapshot_payload(payload)


def test_object_state_payload():
    s = ObjectState(bcast_object=lambda x: x, get_rank=lambda: 0, epoch=1, arr=np.arange(5))
    s.commit()
    payload, _ = travel(s.snapshot_payload())
    t = ObjectState(bcast_object=lambda x: x, get_rank=lambda: 0, epoch=0, arr=None)
    t.load_snapshot_payload(payload)
    t.restore()
    assert t.epoch == 1 and np.array_equal(t.arr, np.arange(5))


def test_launcher_variables_parse():
    hosts = worker.parse_hosts("h0:1,h1:2, h2:1")
    assert hosts == [("h0", 1), ("h1", 2), ("h2", 1)]
    assert [worker.host_of_rank(hosts, r) for r in range(4)] == ["h0", "h1", "h1", "h2"]
    with pytest.raises(ValueError, match="rank 4"):
        worker.host_of_rank(hosts, 4)
    assert worker.parse_keepers("h0=10.0.0.1:4000,h1=node-b:51") == {"h0": ("10.0.0.1", 4000),
                                                                     "h1": ("node-b", 51)}
    assert not worker.launcher_attached()


# ---------------------------------------------------------------------------------------------------------
# Background snapshots (perseus.torch.elastic.snapshot)
# ---------------------------------------------------------------------------------------------------------

def _values(model, opt):
    return ([t.clone() for t in model.state_dict().values()],
            [t.clone() for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)])


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_snapshot_is_the_state_at_commit_even_when_steps_follow_at_once(monkeypatch, mode):
    monkeypatch.setenv("PERSEUS_ELASTIC_SNAPSHOT", mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, opt, step=0)

    def train(n):
        for _ in range(n):
            opt.zero_grad()
            model(torch.randn(16, 256)).square().mean().backward()
            opt.step()

    train(2)
    state.step = 2
    state.commit()
    want = _values(model, opt)
    train(3)  # step() waits for the background copy before it changes anything
    state.step = 5
    payload, _ = travel(state.snapshot_payload())
    state.restore()
    got = _values(model, opt)
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        assert torch.equal(a, b)
    assert state.step == 2
    other_model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8))
    other_opt = torch.optim.SGD(other_model.parameters(), lr=0.1, momentum=0.9)
    other = TorchState(other_model, other_opt, step=0)
    other.load_snapshot_payload(payload)
    other.restore()
    for a, b in zip(want[0], other_model.state_dict().values()):
        assert torch.equal(a, b)


def test_snapshot_buffers_are_reused_every_other_commit():
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    state = TorchState(model, opt)
    seen = []
    for _ in range(4):
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        state.commit()
        state._wait_snapshot()
        seen.append(state._handlers["model"]._saved_model_state["weight"].data_ptr())
    assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]
