"""perseus.run (horovod.run): a function on N ranks, results in rank order, errors naming the rank.

Each case runs a small script in a fresh interpreter (the function is defined in its __main__, so that
cloudpickle sends it by value, as from a notebook)."""

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(600)  # for hangs


def script(body: str, timeout=400):
    env = {**os.environ, "PYTHONPATH": REPO, "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")
    return proc.returncode, proc.stdout, proc.stderr


def test_results_in_rank_order_with_args_and_a_collective():
    code, out, err = script("""
        import perseus

        def train(scale, offset=0):
            import torch
            import perseus.torch as hvd
            hvd.init()
            total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
            rank, size = hvd.rank(), hvd.size()
            hvd.shutdown()
            return {"rank": rank, "size": size, "total": total * scale + offset}

        print("RESULT", perseus.run(train, args=(10,), kwargs={"offset": 1}, np=3))
        print("RESULT1", perseus.run(lambda: 42))
    """)
    assert code == 0, out + err
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("RESULT")}
    assert lines["RESULT"] == str([{"rank": r, "size": 3, "total": 61.0} for r in range(3)]), out
    assert lines["RESULT1"] == "[42]", out


def test_horovod_run_of_a_function_importing_horovod_in_its_body():
    """Horovod's docs write the import inside the function: with the alias in the caller (here through
    ``import horovod`` after the alias module), every rank resolves ``horovod.torch`` too; a rank that cannot
    unpickle the function is named with the cause."""
    code, out, err = script("""
        import perseus.compat.horovod_alias  # noqa: F401
        import horovod

        def fn():
            import horovod.torch as hvd
            import torch
            hvd.init()
            total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
            rank = hvd.rank()
            hvd.shutdown()
            return rank, total, hvd.__name__

        print("RESULT", horovod.run(fn, np=2))
    """)
    assert code == 0, out + err
    assert "RESULT [(0, 2.0, 'perseus.torch'), (1, 2.0, 'perseus.torch')]" in out, out + err


def test_an_exception_on_one_rank_names_it_and_is_chained():
    code, out, err = script("""
        import perseus
        from perseus.runner.run_func import RunError

        def work():
            import os
            import perseus.torch as hvd
            hvd.init()
            if hvd.rank() == 1:
                raise KeyError("no such column on this rank")
            import torch
            hvd.allreduce(torch.ones(1))  # rank 0 waits here for rank 1: the launcher ends it
            return 1

        try:
            perseus.run(work, np=2)
        except RunError as exc:
            print("MESSAGE", str(exc).splitlines()[0])
            print("CAUSE", type(exc.__cause__).__name__)
            print("TRACE", "no such column on this rank" in str(exc))
    """)
    assert code == 0, out + err
    assert "MESSAGE perseus.run: rank 1 raised" in out, out + err
    assert "CAUSE KeyError" in out and "TRACE True" in out, out


def test_unpicklable_result_and_bad_arguments():
    code, out, err = script("""
        import threading
        import perseus
        from perseus.runner.run_func import RunError

        try:
            perseus.run(threading.Lock, np=1)
        except RunError as exc:
            print("LOCK", "cannot be pickled" in str(exc))
        for kwargs, kind in ((dict(np=2, min_np=1), ValueError), (dict(np=2, num_proc=3), ValueError),
                             (dict(np=0), ValueError), (dict(use_gloo=True), NotImplementedError),
                             (dict(min_np=3, max_np=2, hosts="localhost:3"), ValueError),
                             (dict(min_np=1, hosts="localhost:1", cooldown_range=5), ValueError),
                             (dict(min_np=1, host_discovery_script="exit 3"), ValueError)):
            try:
                perseus.run(print, **kwargs)
            except kind as exc:
                print("ARG", kind.__name__, str(exc))
        try:
            perseus.run(lambda: 1, np=1, hosts="bad host:x")
        except ValueError as exc:  # refused before anything starts
            print("HOSTS", str(exc).startswith("perseus.run: ") and "host:slots" in str(exc))
    """)
    assert code == 0, out + err
    assert "LOCK True" in out, out + err
    assert out.count("ARG ") == 7 and "HOSTS True" in out, out + err
    # elastic arguments are refused in perseus.run's words, before anything starts
    assert "min_np need(s) host_discovery_script (a script printing 'host:slots' lines) or hosts/hostfile" in out, out
    assert "perseus.run: min_np 3 is larger than max_np 2" in out, out
    assert "cooldown_range takes (low, high) seconds, got 5" in out, out
    assert "host discovery script 'exit 3' exited with status 3" in out, out


def test_elastic_run_as_horovod_run_returns_the_last_generations_values():
    """horovod.run's elastic arguments (Horovod's test_elastic_run cases: fixed hosts, a discovery script), and a
    rank killed mid-training: the job re-forms without its host (two names of this machine: the survivors share
    its memory transport, so the launcher relaunches) and returns the finishing generation's first min_np
    values."""
    code, out, err = script("""
        import os
        import stat
        import tempfile

        import perseus
        from perseus.runner.common.util.env import get_env_rank_and_size

        def env_place():
            return get_env_rank_and_size()

        print("HOSTS", perseus.run(env_place, num_proc=2, min_num_proc=2, max_num_proc=2,
                                   hosts="localhost:2,127.0.0.1:2"))
        with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
            f.write("echo localhost:2; echo 127.0.0.1:2")
        os.chmod(f.name, stat.S_IRWXU)
        print("SCRIPT", perseus.run(env_place, num_proc=2, min_num_proc=2, max_num_proc=2,
                                    host_discovery_script=f.name))

        def train():
            import torch
            import perseus.torch as hvd
            hvd.init()

            @hvd.elastic.run
            def loop(state):
                while state.epoch < 4:
                    hvd.allreduce(torch.ones(1), name="step")
                    if state.epoch == 2 and hvd.size() == 3 and hvd.rank() == 2:
                        os._exit(1)  # dies between two commits
                    state.epoch += 1
                    state.commit()
                return hvd.rank(), hvd.size(), state.epoch

            return loop(hvd.elastic.TorchState(epoch=0))

        print("KILLED", perseus.run(train, num_proc=3, min_np=2, max_np=3, hosts="localhost:2,127.0.0.1:1"))
    """)
    assert code == 0, out + err
    assert "HOSTS [(0, 2), (1, 2)]" in out and "SCRIPT [(0, 2), (1, 2)]" in out, out + err
    assert "KILLED [(0, 2, 4), (1, 2, 4)]" in out, out + err
    assert "blacklisting host 127.0.0.1" in err and "generation 1: 2 rank(s) on localhost:2" in err, err
    assert "did not re-form the job in process" not in err, err
