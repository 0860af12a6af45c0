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
        for kwargs, kind in ((dict(np=2, min_np=1), NotImplementedError), (dict(np=2, num_proc=3), ValueError),
                             (dict(np=0), ValueError), (dict(use_gloo=True), NotImplementedError)):
            try:
                perseus.run(print, **kwargs)
            except kind as exc:
                print("ARG", kind.__name__, str(exc).split(":")[0])
        try:
            perseus.run(lambda: 1, np=1, hosts="bad host:x")
        except ValueError as exc:  # refused before anything starts
            print("HOSTS", str(exc).startswith("perseus.run: ") and "host:slots" in str(exc))
    """)
    assert code == 0, out + err
    assert "LOCK True" in out, out + err
    assert out.count("ARG ") == 4 and "HOSTS True" in out, out + err
