"""Failure scenarios run as real MPI jobs by test_failures.py: ``mpirun -np N python scenarios.py MODE``."""

import os
import sys
import time

import torch

import perseus.torch as hvd
from job_marks import mark


def main(mode: str) -> None:
    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(2), name="warmup")
    mark("ready")  # every rank started: what follows is what the test bounds in time
    if mode == "stall":
        if rank == 0:
            hvd.allreduce(torch.ones(2), name="lonely")
        else:
            time.sleep(60)  # never submits "lonely"
    elif mode in ("transport_error", "transport_error_caught"):
        if rank == 1:
            from perseus.runtime.state import runtime

            runtime().engine._native.fail_next_collective("simulated transport failure")
        try:
            hvd.allreduce(torch.ones(1 << 16), name="doomed")
        except hvd.HorovodInternalError as exc:
            print(f"rank {rank} caught: {exc}", flush=True)
            if mode == "transport_error_caught":
                return  # exit normally: rank 0's channel is still inside the collective rank 1 never joined
            if rank == 1:
                time.sleep(2)
            raise
    elif mode == "rank_dies":
        if rank == 1:
            os._exit(9)
        hvd.allreduce(torch.ones(2), name="after_death")
        time.sleep(60)
    elif mode == "uncaught":
        if rank == 1:
            raise ValueError("user code failed on rank 1")
        hvd.allreduce(torch.ones(2), name="waits_for_rank1")
        time.sleep(60)
    elif mode == "early_shutdown":
        if rank == 1:
            hvd.shutdown()
            time.sleep(3)
            return
        try:
            time.sleep(0.5)
            hvd.allreduce(torch.ones(2), name="after_peer_shutdown")
        except hvd.HorovodInternalError as exc:
            print(f"rank {rank} caught: {exc}", flush=True)
            return
        raise AssertionError("expected an error after the peer shut down")
    elif mode == "clean":
        for i in range(20):
            hvd.allreduce(torch.ones(100), name=f"step{i % 3}")
        print(f"rank {rank} done", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1])
