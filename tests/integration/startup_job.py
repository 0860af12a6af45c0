"""Start-up failures injected on one rank, run as real MPI jobs by test_startup.py.

``mpirun -np N python startup_job.py STAGE RANK [retry]``: on rank RANK, make the step of ``init()`` named by
STAGE raise; every rank then calls ``init()`` and reports how it ended ("rank R caught TYPE: MESSAGE").
With ``retry``, every rank that caught the failure calls ``init()`` again (without the fault) and runs an
all-reduce, which shows that the failed start left nothing half-built.
"""

import sys

import torch

import perseus.torch as hvd
from perseus.autotune import service
from perseus.runtime import startup, state
from perseus.engine import native
from perseus.transport.mpi import load_mpi

from job_marks import mark


def _fail(*_args, **_kwargs):
    raise RuntimeError("injected start-up failure")


def _bad_setting(*_args, **_kwargs):
    raise ValueError("injected: bad setting")


def _no_core(*_args, **_kwargs):
    raise ImportError("injected: the native core could not be loaded")


def _no_optuna(*_args, **_kwargs):
    raise ImportError("injected: No module named 'optuna'")


def _patches(stage: str) -> list:
    """(object, attribute, replacement) that make the step named ``stage`` fail."""
    import perseus.autotune.techniques as techniques

    return {
        "settings": [(state, "load_settings", _bad_setting)],
        "core": [(native, "load_core", _no_core)],
        "optuna": [(techniques, "_optuna", _no_optuna)],
        "topology": [(startup, "topology", _fail)],
        "channels": [(native.Engine, "add_process_set", _fail)],
        "engine_start": [(native.Engine, "start", _fail)],
        "tuner": [(service, "make_tuner", _fail)],
        "process_sets": [(state.Runtime, "_add_set", _fail)],
    }.get(stage, [])


def main(stage: str, failing: int, retry: bool) -> int:
    world_rank = load_mpi().COMM_WORLD.Get_rank()
    kwargs = {"process_sets": [hvd.ProcessSet([0])]} if stage in ("process_sets", "process_sets_differ") else {}
    undo = []
    if world_rank == failing:
        if stage == "process_set_ranks":
            kwargs["process_sets"] = [hvd.ProcessSet([0, 99])]
        if stage == "process_sets_differ":
            kwargs["process_sets"] = [hvd.ProcessSet([1])]
        for obj, name, replacement in _patches(stage):
            undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, replacement)
    mark("init")  # imports done: the start-up the test bounds in time begins here
    if stage == "before_init" and world_rank == failing:
        raise RuntimeError("injected: this rank failed before calling init()")
    try:
        hvd.init(**kwargs)
    except Exception as exc:  # noqa: BLE001 - reported, then the job ends (or starts again)
        print(f"rank {world_rank} caught {type(exc).__name__}: {exc}", flush=True)
        if not retry:
            return 3
        for obj, name, original in undo:
            setattr(obj, name, original)
        hvd.init()
        hvd.allreduce(torch.ones(2), name="after_retry")
        print(f"rank {world_rank} retried ok", flush=True)
        return 0
    total = hvd.allreduce(torch.ones(2), name="started", op=hvd.Sum)
    print(f"rank {world_rank} started, sum {total.tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "retry"))
