"""perseus.spark.run and TorchEstimator.fit on a Spark standalone cluster (a master and one worker of 2 cores,
started here from pyspark's own jars with spark-class): the tasks run in an executor of their own, not in the
driver's JVM."""

import os
import socket
import subprocess
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark")

import cloudpickle  # noqa: E402

import perseus.spark  # noqa: E402
from perseus.spark.driver import StartError  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this module
# pytest-xdist keeps the module's tests in one worker: one Spark for all of them.
pytestmark = pytest.mark.xdist_group("spark_cluster")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_line(log: str, text: str, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    """Wait until ``text`` appears in the log of ``proc`` (the master or worker is ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            seen = f.read()
        if text in seen:
            return
        assert proc.poll() is None, f"the Spark {what} ended with status {proc.returncode}:\n{seen[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"the Spark {what} did not log {text!r} within {timeout:g} s:\n{seen[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((15, 15.0), (9, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``spark://`` URL of a standalone master with one worker of 2 cores (both stopped afterwards)."""
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    work = str(tmp_path_factory.mktemp("spark-standalone"))
    python_path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "SPARK_HOME": os.path.dirname(pyspark.__file__), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": python_path, "SPARK_WORKER_DIR": work}
    port = _free_port()
    url = f"spark://127.0.0.1:{port}"
    procs = []
    try:
        log = os.path.join(work, "master.log")
        procs.append(subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", str(_free_port())], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True))
        _wait_for_line(log, "New state: ALIVE", procs[0], "master")
        procs.append(subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "2", "--memory",
             "1g", "--webui-port", str(_free_port()), "--work-dir", work, url], env=env,
            stdout=open(os.path.join(work, "worker.log"), "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True))
        _wait_for_line(os.path.join(work, "worker.log"), "Successfully registered with master", procs[1], "worker")
        yield url, python_path
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _where():
    import os
    import socket

    import perseus.torch as hvd

    hvd.init()
    in_executor, pid = False, os.getppid()  # is an ancestor of this rank the worker's executor?
    while pid > 1 and not in_executor:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            in_executor = b"CoarseGrainedExecutorBackend" in f.read()
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return hvd.rank(), hvd.size(), socket.gethostname(), in_executor


def _mse(output, label):
    import torch

    return torch.nn.functional.mse_loss(output, label)


def _fit_a_linear_model(session, store_dir: str):
    """TorchEstimator on 2 ranks of the cluster: y = 2 x0 - 3 x1 + 1 from a vector column; the trained model."""
    import numpy as np
    import torch
    from pyspark.ml.linalg import DenseVector, VectorUDT
    from pyspark.sql import types as T

    from perseus.spark.common.store import LocalStore
    from perseus.spark.torch import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 2))
    schema = T.StructType([T.StructField("features", VectorUDT()), T.StructField("y", T.DoubleType())])
    df = session.createDataFrame([(DenseVector(a), float(2 * a[0] - 3 * a[1] + 1)) for a in x], schema)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    estimator = TorchEstimator(num_proc=2, store=LocalStore(store_dir), model=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss=_mse,
                               feature_cols=["features"], label_cols=["y"], input_shapes=[[-1, 2]], batch_size=16,
                               epochs=4, verbose=0)
    return estimator.fit(df), df


@pytest.mark.timeout(600)  # for a hang: the master, the worker and two Spark jobs start on a busy machine
def test_run_on_a_standalone_cluster(cluster, tmp_path):
    from pyspark.sql import SparkSession

    # (SparkSession.builder keeps the options an earlier session of this process was given: set every one
    # this test relies on.)
    url, python_path = cluster
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executor's Python workers need this venv's torch
    session = (SparkSession.builder.master(url).appName("perseus-spark-standalone")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.memory", "512m").config("spark.executor.memory", "512m")
               .config("spark.executor.cores", "2").config("spark.cores.max", "2")
               .config("spark.executorEnv.PYTHONPATH", python_path)
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
               .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "40")  # Spark's default
               .getOrCreate())
    try:
        sc = session.sparkContext
        sc.setLogLevel("ERROR")
        assert sc.parallelize(range(2), 2).count() == 2  # waits for the worker's executor to register
        values = perseus.spark.run(_where, num_proc=2, start_timeout=180)
        assert [v[:2] for v in values] == [(0, 2), (1, 2)]
        assert values[0][2] == values[1][2] == socket.gethostname()
        assert values[0][3] and values[1][3], "the ranks are not children of the worker's executor"
        assert list(sc.statusTracker().getActiveJobsIds()) == []
        # More tasks than cores: Spark retries its barrier slot check (every 1 s here, 40 times); start_timeout
        # ends the wait (the message says so: Spark's own failure would say otherwise) and the Spark job is
        # cancelled.
        with pytest.raises(StartError, match=r"only 0 of the 3 Spark task\(s\) needed started within "
                                             r"start_timeout=5 s \(missing: task\(s\) 0, 1, 2\)"):
            perseus.spark.run(_where, num_proc=3, start_timeout=5)
        assert list(sc.statusTracker().getActiveJobsIds()) == []
        # The estimators: the data prepared by the cluster's executor, training on its 2 cores, transform there.
        trained, df = _fit_a_linear_model(session, str(tmp_path / "store"))
        weight = trained.getModel().weight.detach().numpy().ravel()
        assert abs(weight[0] - 2) < 0.1 and abs(weight[1] + 3) < 0.1, weight
        rows = trained.transform(df.limit(20)).collect()
        assert all(abs(r["y__output"] - r["y"]) < 0.3 for r in rows)
    finally:
        session.stop()
