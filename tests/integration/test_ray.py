"""perseus.ray on a local Ray instance (one machine): RayExecutor's calls, its errors, ElasticRayExecutor.

Across machines (Ray started with ``ray start`` in emulated hosts, a killed worker survived) see
test_ray_cluster.py.
"""

import os
import re
import sys
import time

import cloudpickle

import pytest

ray = pytest.importorskip("ray", reason="perseus.ray needs ray (pip install perseus[ray])")

from perseus.ray import ElasticRayExecutor, RayExecutor, WorkerError  # noqa: E402

# pytest-xdist keeps the module's tests in one worker: one local Ray for all of them. The timeout is for hangs:
# the first test also waits for Ray to start, which on a busy machine takes a minute or more.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray_local")]
# How long the ranks may take to start (timeout_s, elastic_timeout): generous, so that a busy machine's slow start
# never decides a verdict.
START_S = 180
# How soon after a rank raises the call must end: "at once", with room for a busy machine; a job that waited for
# a timeout instead (elastic_timeout, a dead host's) would take longer.
ENDS_WITHIN_S = 30


def _raised_at(text: str) -> float:
    """The time a rank's function put into what it raised (``(t=<time.time()>)``)."""
    return float(re.search(r"\(t=([0-9.]+)\)", text).group(1))

# The ranks import perseus, not this test module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def train(steps):
    """Every rank: a few SGD steps of a tiny model from different seeds after a broadcast."""
    import socket

    import torch

    import perseus.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hvd.rank(), hvd.size(), socket.gethostname(), flat.tolist()


@pytest.mark.parametrize("workers", [2, pytest.param(4, marks=pytest.mark.full)])
def test_training_gives_identical_parameters_on_every_rank(workers):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=START_S), num_workers=workers)
    executor.start()
    try:
        results = executor.run(train, args=[5])
        again = executor.run(train, kwargs={"steps": 2})  # the same job serves many calls
    finally:
        executor.shutdown()
    assert [r[:2] for r in results] == [(r, workers) for r in range(workers)]
    assert all(r[3] == results[0][3] for r in results)
    assert all(r[3] == again[0][3] for r in again) and again[0][3] != results[0][3]


class Counter:
    def __init__(self, start):
        import perseus.torch as hvd

        hvd.init()
        self.value = start + hvd.rank()

    def bump(self):
        self.value += 1
        return self.value


def test_executable_objects_execute_single_run_remote_and_callbacks():
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=START_S), num_hosts=1, num_workers_per_host=2)
    executor.start(executable_cls=Counter, executable_args=[10], extra_env_vars={"PERSEUS_TEST_MARK": "m1"})
    try:
        assert executor.execute(lambda c: c.bump()) == [11, 12]
        assert executor.execute_single(lambda c: c.bump()) == 12
        refs = executor.run_remote(lambda: os.environ.get("PERSEUS_TEST_MARK"))
        assert ray.get(refs) == ["m1", "m1"]
        seen = []

        def logs():
            from perseus.ray import ray_logger
            import perseus.torch as hvd

            for step in range(3):
                ray_logger.log({"rank": hvd.rank(), "step": step})
            return True

        assert executor.run(logs, callbacks=[seen.append]) == [True, True]
        assert seen == [{"rank": 0, "step": s} for s in range(3)]  # rank 0's values only
    finally:
        executor.shutdown()


def raises_on_rank_one():
    import time

    import torch

    import perseus.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError(f"bad batch on rank one (t={time.time()})")
    hvd.allreduce(torch.ones(3), name="waits_for_rank_one")  # rank 0 would wait for ever without the job ending
    return hvd.rank()


def test_a_function_that_raises_on_one_rank_ends_the_call_naming_the_rank():
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=START_S), num_workers=2)
    executor.start()
    try:
        with pytest.raises(WorkerError) as info:
            executor.run(raises_on_rank_one)
        assert time.time() - _raised_at(str(info.value)) < ENDS_WITHIN_S, str(info.value)
        assert info.value.rank == 1 and not info.value.gone
        assert "rank 1 on perseus-node-0" in str(info.value) and "ValueError: bad batch on rank one" in str(info.value)
        with pytest.raises(RuntimeError, match="call start"):
            executor.run(raises_on_rank_one)
        executor.start()  # a new job on new actors
        assert executor.run(lambda: 5) == [5, 5]
    finally:
        executor.shutdown()


def test_a_killed_actor_fails_the_call_naming_its_rank():
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=START_S), num_workers=2)
    executor.start()
    try:
        refs = executor.run_remote(time.sleep, args=[4])
        time.sleep(1)
        ray.kill(executor.workers[1])
        from perseus.ray.runner import gather

        with pytest.raises(WorkerError, match="rank 1 on perseus-node-0"):
            gather(refs, where=executor._where)
    finally:
        executor.shutdown()


def test_an_impossible_placement_times_out_saying_what_the_cluster_has():
    executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=2, cpus_per_worker=64)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"could not place 2 worker\(s\) \(64 CPU per worker\).*CPU: .* free of 4"):
        executor.start()
    assert time.monotonic() - started < 60  # a 2 s placement timeout, not Ray's default 100 s
    assert ray.available_resources().get("CPU") == 4  # the placement group was removed


def test_sizes_as_horovod_passes_them():
    settings = RayExecutor.create_settings()
    executor = RayExecutor(settings, num_workers=4, num_hosts=None, num_workers_per_host=None)
    assert executor.num_workers == 4
    executor = RayExecutor(settings, num_hosts=2, num_slots=3, cpus_per_slot=2)
    assert executor.num_workers == 6 and executor.cpus_per_worker == 2


def test_bad_sizes_are_refused():
    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="num_workers"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="exclude each other"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(settings, max_workers=2)


def test_elastic_settings_take_horovods_names_and_refuse_what_they_cannot_honour():
    s = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, reset_limit=3, ssh_port=22)
    assert (s.min_np, s.max_np, s.reset_limit, s.elastic) == (2, 4, 3, True)
    assert ElasticRayExecutor.create_settings(2, 4).max_np == 4  # Horovod's positional order
    with pytest.warns(DeprecationWarning, match="min_num_proc"):
        s = ElasticRayExecutor.create_settings(min_np=3, max_np=5)
    assert (s.min_np, s.max_np) == (3, 5)
    with pytest.raises(TypeError, match="extra_mpi_args"):
        ElasticRayExecutor.create_settings(min_num_proc=2, extra_mpi_args="-x A")
    with pytest.raises(ValueError, match="below min_num_proc"):
        ElasticRayExecutor.create_settings(min_num_proc=4, max_num_proc=2)
    with pytest.raises(ValueError, match="at least 1"):
        ElasticRayExecutor.create_settings(min_num_proc=0)


def elastic_train():
    import torch

    import perseus.torch as hvd
    from perseus.ray import ray_logger

    hvd.init()
    ray_logger.log({"started": hvd.rank()})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < 12:
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            state.step += 1
            if state.step % 4 == 0:
                state.commit()
        return hvd.rank(), hvd.size(), state.step, [float(p.sum()) for p in model.parameters()]

    return loop(state)


def test_elastic_executor_runs_an_elastic_function():
    """...and its callbacks get every rank's logged values, as Horovod's elastic executor forwards them."""
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2, elastic_timeout=START_S)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)
    executor.start()
    logged = []
    try:
        results = executor.run(elastic_train, callbacks=[logged.append])
    finally:
        executor.shutdown()
    assert [r[:3] for r in results] == [(0, 2, 12), (1, 2, 12)]
    assert results[0][3] == results[1][3]
    assert sorted(v["started"] for v in logged) == [0, 1], logged


def raises_outside_the_elastic_loop():
    import time

    import perseus.torch as hvd

    hvd.init()
    raise ValueError(f"broken data loader (t={time.time()})")


def test_elastic_function_raising_outside_its_loop_ends_the_job_at_once():
    from perseus.runner.run_func import RunError

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2, elastic_timeout=600)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)
    executor.start()
    try:
        with pytest.raises(RunError, match=r"(?s)rank \d raised.*ValueError: broken data loader") as info:
            executor.run(raises_outside_the_elastic_loop)
    finally:
        executor.shutdown()
    # not taken for a dead host, which would wait elastic_timeout
    assert time.time() - _raised_at(str(info.value)) < ENDS_WITHIN_S, str(info.value)


def test_horovod_ray_is_perseus_ray_through_the_alias():
    import perseus.compat.horovod_alias  # noqa: F401

    from horovod.ray import ElasticRayExecutor as E, RayExecutor as R
    from horovod.ray.elastic import TestDiscovery  # noqa: F401 - Horovod's examples import it
    from horovod.ray import ray_logger  # noqa: F401

    assert R is RayExecutor and E is ElasticRayExecutor


def _horovod_in_the_body():
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    return hvd.rank(), total, hvd.__name__


def test_a_function_importing_horovod_in_its_body_runs_when_the_caller_has_the_alias():
    """Horovod's Ray docs write the import in the function: the ranks get the caller's alias."""
    from perseus.compat import horovod_alias

    installed = horovod_alias.HorovodAlias in {type(f) for f in sys.meta_path}
    horovod_alias.install()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=START_S), num_workers=2)
    try:
        executor.start()
        assert executor.run(_horovod_in_the_body) == [(0, 2.0, "perseus.torch"), (1, 2.0, "perseus.torch")]
    finally:
        executor.shutdown()
        if not installed:
            horovod_alias.uninstall()


class _NamesAHostRayDoesNotHave:
    def find_available_hosts_and_slots(self):
        return {"node-that-is-not-in-ray": 2}


def test_a_discovery_host_that_is_no_ray_node_is_an_error_naming_it():
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2, elastic_timeout=START_S)
    settings.discovery = _NamesAHostRayDoesNotHave()
    executor = ElasticRayExecutor(settings, override_discovery=False)
    try:
        with pytest.raises(ValueError, match="node-that-is-not-in-ray.*not the address of any Ray node"):
            executor.run(lambda: 1)
    finally:
        executor.shutdown()


def test_an_executor_inside_a_placement_group_uses_its_bundles():
    """use_current_placement_group (Horovod's default): inside a group with a bundle per worker (all of the
    cluster's free CPUs here, so a group of its own could not be placed) the workers take that group's bundles."""
    from ray.util.placement_group import placement_group, remove_placement_group

    free = int(ray.available_resources().get("CPU", 0))
    assert free >= 2, ray.available_resources()
    pg = placement_group([{"CPU": 1}] * 2 + [{"CPU": 1}] * (free - 2), strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    start_s = START_S

    def in_the_group():  # (defined here: Ray pickles it by value; the actor cannot import this test module)
        from perseus.ray import RayExecutor

        def rank_and_size():
            import perseus.torch as hvd

            hvd.init()
            return hvd.rank(), hvd.size()
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=start_s), num_workers=2)
        try:
            executor.start()
            return executor._own_pg, executor.run(rank_and_size)
        finally:
            executor.shutdown()
    try:
        runner = ray.remote(in_the_group).options(num_cpus=0, placement_group=pg,
                                                  placement_group_capture_child_tasks=True)
        own, values = ray.get(runner.remote(), timeout=300)
        assert own is False and values == [(0, 2), (1, 2)]
    finally:
        remove_placement_group(pg)
