"""init() settings that change how the engine runs on each rank (thread placement)."""

import glob
import os

import pytest
import torch

from job_env import restart

pytestmark = pytest.mark.timeout(120)


def test_thread_affinity_pins_the_engine_thread(hvd):
    """PERSEUS_THREAD_AFFINITY (horovodrun --thread-affinity): each rank's engine thread runs on the core
    listed for its local rank; the other threads keep their placement."""
    cores = os.cpu_count() or 1
    listed = ",".join(str((cores - 1 - i) % cores) for i in range(hvd.local_size()))
    old = restart(hvd, {"PERSEUS_THREAD_AFFINITY": listed})
    try:
        want = str(int(listed.split(",")[hvd.local_rank()]))
        engine = []
        for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
            with open(f"{task}/comm") as f:
                if f.read().strip() == "perseus-engine":
                    with open(f"{task}/status") as f:
                        engine += [line.split()[1] for line in f if line.startswith("Cpus_allowed_list")]
        assert engine == [want], (engine, want)
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="pinned").item() == hvd.size()
    finally:
        restart(hvd, old)
