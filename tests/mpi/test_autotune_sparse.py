"""The algorithm of 'auto' sparse all-reduces as a dimension of the run-time tuner, in a real job: the tuner
tries more than one algorithm, every rank runs the same algorithm at every step (ranks timed differently),
the per-step agreement stops at the same step everywhere, training stays identical on every rank, a second
run applies the remembered algorithm, and an explicit perseus.sparse.set_policy() is kept."""

import os
import random
import time

import pytest
import torch
import torch.nn as nn

from job_env import autotune_env, restart

pytest.importorskip("optuna")

pytestmark = pytest.mark.timeout(280)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(500, 16, sparse=True)
        self.head = nn.Linear(16, 2)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _train_until_tuned(hvd, model, max_steps=400):
    """Train until every rank's tuner has ended, then 3 steps more; per step, the algorithm the embedding's
    gradient took and whether the sparse path still follows the tuner."""
    from perseus.runtime.state import runtime
    from perseus.sparse import choice, stats

    tuner = runtime().service("tuner")
    assert tuner is not None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), sparse_algorithm="auto")
    g = torch.Generator().manual_seed(100 + hvd.rank())
    rng = random.Random(hvd.rank())
    record, steps, extra = [], 0, None
    while extra is None or extra > 0:
        if extra is None:
            finished = hvd.allreduce(torch.tensor([1.0 if tuner.done else 0.0]), name="sparse.tuned", op=hvd.Min)
            if finished.item() == 1.0 and steps >= 5:
                extra = 3
        else:
            extra -= 1
        ids = torch.randint(0, 500, (8 + 4 * hvd.rank(), 5), generator=g)  # uneven batches
        opt.zero_grad()
        model(ids).square().mean().backward()
        if hvd.rank() % 2 == 1:
            time.sleep(rng.uniform(0, 0.004))  # this rank is slower, irregularly
        opt.step()
        follower = choice._following.follower if choice._following is not None else None
        record.append((stats("grad.emb.weight").algorithm, None if follower is None else follower.finished))
        steps += 1
        assert steps < max_steps, "the tuner did not finish within its budget"
    return tuner, record


def _check_same_everywhere(hvd, model, tuner, record):
    everyone = hvd.allgather_object((record, tuner.result))
    for r, theirs in enumerate(everyone):
        assert theirs == everyone[0], f"rank {r} ran other sparse algorithms at some step than rank 0"
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).unsqueeze(0)
    params = hvd.allgather(flat, name="sparse.tuned.params")
    for r in range(hvd.size()):
        torch.testing.assert_close(params[r], params[0], rtol=0, atol=0, msg=f"rank {r} parameters differ")
    assert record[-1][1] is True  # the per-step agreement has stopped


def test_sparse_algorithm_is_searched_and_switches_at_the_same_step(hvd, tmp_path):
    from perseus.sparse import choice

    cache = hvd.broadcast_object(str(tmp_path / "cache"), root_rank=0)
    env = autotune_env(PERSEUS_CACHE_DIR=cache)
    old = {k: os.environ.get(k) for k in env}
    try:
        choice._policy, choice._policy_explicit = None, False
        restart(hvd, env)
        model = Model()
        tuner, record = _train_until_tuned(hvd, model)
        assert tuner._sparse_tuned and tuner.space.choices("sparse_algorithm") == (tuner.result.sparse_algorithm,)
        used = {alg for alg, _ in record}
        assert len(used) > 1, f"the search ran only {used}"
        _check_same_everywhere(hvd, model, tuner, record)
        final = tuner.result.sparse_name
        assert choice.policy() == (None if final == "auto" else final)
        # The second run of the same job applies the remembered algorithm without searching.
        restart(hvd, env)
        model = Model()
        tuner, record = _train_until_tuned(hvd, model)
        assert tuner.samples == 0 and tuner.result.sparse_name == final
        if final != "auto":
            assert record[-1][0] == final
        _check_same_everywhere(hvd, model, tuner, record)
    finally:
        choice._policy, choice._policy_explicit = None, False
        restart(hvd, old)


def test_explicit_sparse_policy_is_kept(hvd):
    from perseus.sparse import choice, set_policy

    env = autotune_env(PERSEUS_AUTOTUNE_FIXED="explicit", PERSEUS_AUTOTUNE_BUDGET_STEPS="6")
    old = {k: os.environ.get(k) for k in env}
    try:
        restart(hvd, env)
        set_policy("allgather")  # the program's own choice, before the search starts
        model = Model()
        tuner, record = _train_until_tuned(hvd, model)
        assert not tuner._sparse_tuned and {alg for alg, _ in record} == {"allgather"}
        assert tuner.space.choices("sparse_algorithm") == (0,)
        _check_same_everywhere(hvd, model, tuner, record)
    finally:
        choice._policy, choice._policy_explicit = None, False
        restart(hvd, old)
