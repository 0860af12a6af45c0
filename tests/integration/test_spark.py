"""perseus.spark (horovod.spark): run() and run_elastic() on a local[2] Spark and their errors (the estimators
have test files of their own: test_spark_*_estimator.py).

One SparkSession serves the module. Spark's barrier slot check fails at once here (maxFailures=1) instead of
retrying for 10 minutes, so that a job larger than the cluster fails with Spark's own error. After every test
no Spark job and no mpirun, daemon or rank of this process may be left.
"""

import io
import os
import re
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark")

import cloudpickle  # noqa: E402

import perseus.spark  # noqa: E402
import perseus.spark.common.store  # noqa: E402
from perseus.runner.run_func import RunError  # noqa: E402
from perseus.spark.driver import Registry, StartError  # noqa: E402
from perseus.runner.run_frames import recv_frame, send_frame  # noqa: E402
from spark_support import local_spark  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this module
# pytest-xdist keeps the module's tests in one worker: one Spark for all of them. The timeout is for hangs only:
# the first test also waits for the SparkSession to start, which on a busy machine takes a minute or more.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("spark_local")]
# The jobs' start_timeout: generous, so that a busy machine's slow start never decides a verdict (the tests of
# the timeout itself set their own).
START_S = 180
# How soon after a rank raises (or its task dies) the call must end: the promise is "within seconds", this is
# many times what it takes, so that only a job waiting for some timeout instead fails it.
ENDS_WITHIN_S = 30


def _raised_at(text: str) -> float:
    """The time a rank's function put into what it raised or printed (``(t=<time.time()>)``)."""
    return float(re.search(r"\(t=([0-9.]+)\)", text).group(1))

_LEFTOVERS = (b"prterun", b"prted", b"mpirun", b"perseus.runner.run_task", b"perseus.runner.remote.agent")


@pytest.fixture(scope="module")
def spark():
    yield from local_spark("perseus-spark-tests", memory="512m",
                           conf={"spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s"})


def _descendants_running(names=_LEFTOVERS) -> list[str]:
    """Command lines of this process's descendants that belong to a job (mpirun, its daemons, ranks, agents)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    mine, found = {os.getpid()}, []
    for pid in sorted(parent):
        chain, p = [], pid
        while p in parent and p not in mine and p > 1:
            chain.append(p)
            p = parent[p]
        if p in mine:
            mine.update(chain)
    for pid in mine - {os.getpid()}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if any(n in cmd for n in names):
            found.append(cmd.decode(errors="replace"))
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind(spark):
    yield
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + 60
    while (tracker.getActiveJobsIds() or _descendants_running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tracker.getActiveJobsIds()) == [], "a Spark job is still running"
    assert _descendants_running() == [], "a process of the job is still running"


def _hello(tag, *, times):
    import os
    import sys

    import perseus.torch as hvd

    hvd.init()
    print(f"hello from rank {hvd.rank()}", flush=True)
    print(f"note from rank {hvd.rank()}", file=sys.stderr, flush=True)
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "value": tag * times,
            "env": os.environ.get("SPARK_TEST_VALUE")}


def test_run_returns_values_in_rank_order_and_relays_output(spark):
    out, err = io.StringIO(), io.BytesIO()
    values = perseus.spark.run(_hello, args=("ab",), kwargs={"times": 2}, num_proc=2, start_timeout=START_S,
                               env={"SPARK_TEST_VALUE": "a b"}, stdout=out, stderr=err,
                               extra_mpi_args="--mca btl self,tcp")
    assert values == [{"rank": r, "size": 2, "local_rank": r, "value": "abab", "env": "a b"} for r in range(2)]
    assert "hello from rank 0" in out.getvalue() and "hello from rank 1" in out.getvalue()
    assert b"note from rank 0" in err.getvalue() and b"note from rank 1" in err.getvalue()
    assert "note" not in out.getvalue() and b"hello" not in err.getvalue()


def test_output_lines_can_be_stamped_and_verbose_shows_mpirun(spark, capsys):
    out = io.StringIO()
    assert perseus.spark.run(_seven, num_proc=2, stdout=out, prefix_output_with_timestamp=True, verbose=2) == [7, 7]
    said = capsys.readouterr().err
    assert "mpirun" in said and "plm_ssh_agent" in said and "perseus.runner.remote.agent" in said, said
    stamped = re.compile(r"^\[\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4}\]<stdout>: seven$", re.M)
    assert len(stamped.findall(out.getvalue())) == 2, out.getvalue()


def _slow_to_load(value):
    import time

    time.sleep(1.5)  # as a first unpickled torch tensor does: torch is imported first
    return value


class _SlowToLoad:
    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _slow_to_load, (self.value,)


def _rank_slow_to_load():
    import perseus.torch as hvd

    hvd.init()
    return _SlowToLoad(hvd.rank())


def test_values_slow_to_unpickle_are_waited_for(spark):
    # mpirun has exited by the time they are read: run() must still wait for them.
    assert perseus.spark.run(_rank_slow_to_load, num_proc=2) == [0, 1]


def _train(steps):
    import torch

    import perseus.torch as hvd

    hvd.init()
    torch.manual_seed(1000 + hvd.rank())  # different initial weights: the broadcast makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    start = [p.detach().clone() for p in model.parameters()]
    data = torch.Generator().manual_seed(hvd.rank())  # each rank its own batches
    for _ in range(steps):
        x = torch.randn(32, 8, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    moved = sum(float((p.detach() - s).abs().sum()) for p, s in zip(model.parameters(), start))
    return [p.detach().numpy().tolist() for p in model.parameters()], moved


def test_torch_training_gives_identical_parameters_on_both_ranks(spark):
    (params0, moved0), (params1, moved1) = perseus.spark.run(_train, args=(5,), num_proc=2, start_timeout=START_S)
    assert params0 == params1
    assert moved0 > 0 and moved0 == moved1


def _fail_on_rank_1():
    import time

    import torch

    import perseus.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError(f"bad batch on rank 1 (t={time.time()})")
    hvd.allreduce(torch.ones(1))  # rank 0 waits here for rank 1: the job ends it
    return hvd.rank()


def _seven():
    print("seven", flush=True)
    return 7


def test_an_exception_on_rank_1_names_it_and_the_next_run_works(spark):
    with pytest.raises(RunError) as info:
        perseus.spark.run(_fail_on_rank_1, num_proc=2, start_timeout=START_S)
    text = str(info.value)
    assert time.time() - _raised_at(text) < ENDS_WITHIN_S, text
    first = text.splitlines()[0]
    assert first.startswith("perseus.spark.run: rank 1 (on perseus-node-0") and "Spark tasks 0, 1" in first, text
    assert "ValueError: bad batch on rank 1" in text, text
    assert isinstance(info.value.__cause__, ValueError)
    assert perseus.spark.run(_seven) == [7, 7]  # num_proc: Spark's default parallelism (local[2])


def test_more_tasks_than_slots_fails_with_sparks_error(spark):
    # Spark's own slot check ends the job (the module's session fails it at once): not start_timeout, which
    # would end it with another message.
    with pytest.raises(StartError) as info:
        perseus.spark.run(_seven, num_proc=3, start_timeout=START_S)
    text = str(info.value)
    assert "3 task(s)" in text and "barrier mode" in text and "default parallelism is 2" in text, text
    assert "BarrierJobSlotsNumberCheckFailed" in text, text


def _kill_my_task_then_wait():
    import os
    import signal
    import time

    import perseus.torch as hvd

    hvd.init()
    if hvd.rank() == 1:  # end the Spark task (its Python worker) through which this node's daemon started
        print(f"killing my Spark task (t={time.time()})", flush=True)
        pid = os.getppid()
        while pid > 1:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pyspark" in f.read():
                    os.kill(pid, signal.SIGKILL)
                    break
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
    time.sleep(120)


def test_a_task_that_dies_during_the_job_is_named(spark):
    out = io.StringIO()
    with pytest.raises(RunError) as info:
        perseus.spark.run(_kill_my_task_then_wait, num_proc=2, start_timeout=START_S, stdout=out)
    assert time.time() - _raised_at(out.getvalue()) < ENDS_WITHIN_S, out.getvalue()
    text = str(info.value)
    assert "ranks 0, 1 returned no result" in text, text
    assert "Spark task 0 on" in text and "ended while the job ran" in text, text
    assert "Python worker exited unexpectedly" in text, text  # Spark's own account
    assert perseus.spark.run(_seven, num_proc=2) == [7, 7]


def _elastic_train(epochs):
    import torch

    import perseus.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < epochs:
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            state.epoch += 1
            state.commit()
        return hvd.rank(), hvd.size(), state.epoch, [float(v) for v in model.weight.detach().flatten()]

    return loop(state)


def test_run_elastic_completes_an_elastic_loop(spark):
    with pytest.warns(UserWarning, match="stdout, stderr and prefix_output_with_timestamp are not supported"):
        values = perseus.spark.run_elastic(_elastic_train, args=(3,), min_np=2, max_np=2, start_timeout=START_S,
                                           elastic_timeout=START_S, stdout=io.StringIO())
    assert [v[:3] for v in values] == [(0, 2, 3), (1, 2, 3)]
    assert values[0][3] == values[1][3]


def test_without_an_active_spark_context_run_says_so(spark, monkeypatch):
    monkeypatch.setattr(pyspark.SparkContext, "_active_spark_context", None)
    with pytest.raises(RuntimeError, match="no active SparkContext; create a SparkSession"):
        perseus.spark.run(_seven, num_proc=2)
    with pytest.raises(RuntimeError, match="no active SparkContext"):
        perseus.spark.run_elastic(_seven, num_proc=2)


def _elastic_fail_on_rank_1():
    import time

    import torch

    import perseus.torch as hvd

    hvd.init()

    @hvd.elastic.run
    def loop(state):
        if hvd.rank() == 1:
            raise KeyError(f"no such feature on rank 1 (t={time.time()})")
        hvd.allreduce(torch.ones(1))  # rank 0 waits here for rank 1: the job ends it
        return hvd.rank()

    return loop(hvd.elastic.TorchState(epoch=0))


def test_run_elastic_names_the_rank_that_raised(spark):
    with pytest.raises(RunError) as info:
        perseus.spark.run_elastic(_elastic_fail_on_rank_1, min_np=2, max_np=2, start_timeout=START_S,
                                  elastic_timeout=START_S)
    text = str(info.value)
    assert time.time() - _raised_at(text) < ENDS_WITHIN_S, text
    assert text.startswith("perseus.spark.run_elastic: rank 1 raised"), text
    assert "KeyError: 'no such feature on rank 1 (t=" in text and "Spark tasks still live" in text, text


class _NeverStarts:
    num_tasks, barrier, error = 2, True, None

    def slots_hint(self):
        return "(the hint)"


def test_registry_times_out_naming_the_missing_tasks_and_tracks_lost_ones():
    import json
    import socket

    registry = Registry("127.0.0.1", "the-token")
    try:
        started = time.monotonic()
        with pytest.raises(StartError, match=r"only 0 of the 2 .* within start_timeout=1 s \(missing: task\(s\) 0, 1\)"
                                             r"\. \(the hint\)"):
            registry.wait_for(2, 1.0, _NeverStarts(), "test")
        assert time.monotonic() - started < 10  # a 1 s timeout: nothing waits for anything longer
        host, port = registry.address.rsplit(":", 1)
        stranger = socket.create_connection((host, int(port)))
        send_frame(stranger, b"not-the-token")
        task = socket.create_connection((host, int(port)))
        send_frame(task, b"the-token")
        send_frame(task, json.dumps({"index": 1, "attempt": 0, "hostname": "h", "ip": "127.0.0.1",
                                     "service": "127.0.0.1:1", "pid": 1}).encode())
        deadline = time.monotonic() + 5
        while not registry.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [t.index for t in registry.live()] == [1]
        task.close()
        while registry.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert registry.live() == [] and [t.index for t in registry.lost] == [1]
        with pytest.raises(StartError, match="Spark task 1 on h .* ended before the job started"):
            registry.wait_for(2, 1.0, _NeverStarts(), "test")
        stranger.settimeout(5)
        with pytest.raises((ConnectionError, OSError)):
            recv_frame(stranger)  # refused: closed without a word
    finally:
        registry.end()


def test_horovod_spark_imports_through_the_alias():
    installed = [f for f in sys.meta_path if type(f).__name__ == "HorovodAlias"]
    from perseus.compat import horovod_alias

    horovod_alias.install()
    try:
        import horovod.spark
        from horovod.spark.keras import KerasEstimator
        from horovod.spark.common.store import HDFSStore

        assert horovod.spark.run is perseus.spark.run and horovod.spark.run_elastic is perseus.spark.run_elastic
        assert KerasEstimator is perseus.spark.keras.KerasEstimator  # implemented (test_spark_keras_estimator.py)
        assert HDFSStore is perseus.spark.common.store.HDFSStore  # the stores are implemented (test_spark_store.py)
    finally:
        if not installed:  # leave the process as it was
            horovod_alias.uninstall()
            for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
                del sys.modules[name]


def _horovod_in_the_body():
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    return hvd.rank(), total, hvd.__name__


def test_a_function_importing_horovod_in_its_body_runs_when_the_caller_has_the_alias(spark):
    """Horovod's Spark docs write the import in the function: the ranks get the caller's alias."""
    from perseus.compat import horovod_alias

    installed = horovod_alias.HorovodAlias in {type(f) for f in sys.meta_path}
    horovod_alias.install()
    try:
        assert perseus.spark.run(_horovod_in_the_body, num_proc=2, start_timeout=START_S) == [
            (0, 2.0, "perseus.torch"), (1, 2.0, "perseus.torch")]
    finally:
        if not installed:
            horovod_alias.uninstall()
