"""Bad input that can only end in a stall, run as a real MPI job by test_bad_input_stalls.py:
``mpirun -np N python bad_input_job.py CASE``. Every rank prints what it caught, then exits non-zero."""

import sys

import torch

import perseus.torch as hvd
from job_marks import mark


def main(case: str) -> None:
    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(2), name="warmup")
    mark("ready")  # every rank started: what follows is what the test bounds in time
    try:
        if case == "name_differs":  # each rank names the tensor after itself
            hvd.allreduce(torch.ones(2), name=f"grad_of_rank{rank}")
        elif case == "group_size_differs":  # rank 1 passes one tensor fewer
            hvd.grouped_allreduce([torch.ones(2)] * (1 if rank == 1 else 2), name="group")
        elif case == "collective_differs":  # rank 1 broadcasts where the others all-reduce, same name
            if rank == 1:
                hvd.broadcast(torch.ones(2), 0, name="w")
            else:
                hvd.allreduce(torch.ones(2), name="w")
        else:
            raise SystemExit(f"unknown case {case}")
        hvd.allreduce(torch.ones(2), name="next_step")  # the job goes on, as a training loop would
    except hvd.HorovodInternalError as exc:
        print(f"rank {rank} caught {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print(f"rank {rank} finished without an error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
