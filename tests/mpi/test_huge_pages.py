"""Reused large host buffers are collapsed into transparent huge pages (native/huge_pages.h)."""

import os
import platform

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def kernel_collapses() -> bool:
    """Whether this kernel offers MADV_COLLAPSE (Linux 6.1+) with transparent huge pages not disabled."""
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except (OSError, ValueError):
        return False
    return (major, minor) >= (6, 1) and "[never]" not in mode


def stats() -> dict:
    from perseus import _core  # after perseus.torch has loaded MPI's library

    return _core.huge_page_stats()


def huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds address."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split(" ", 1)[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_reused_gradient_is_collapsed_and_keeps_its_values(hvd):
    size, rank = hvd.size(), hvd.rank()
    before = stats()
    grad = torch.empty(3 << 20)  # 12 MiB: several whole 2 MiB frames whatever its alignment
    neighbour = torch.arange(1000.0)  # other memory of the process, perhaps in a collapsed frame
    for step in range(3):  # the third time the same buffer is reduced, its frames are collapsed
        grad.fill_(rank + step)
        hvd.allreduce_(grad, name="hp.grad")  # Average
        assert torch.all(grad == step + (size - 1) / 2), step
    assert torch.equal(neighbour, torch.arange(1000.0))
    after = stats()
    if kernel_collapses():
        assert after["collapsed_frames"] >= before["collapsed_frames"] + 4, (before, after)
        assert huge_kb_at(grad.data_ptr() + (6 << 20)) >= 2048
    else:  # refused, or given up earlier: nothing changed but the counters
        assert after["refused_frames"] > before["refused_frames"] or after["gave_up"], (before, after)


def test_buffers_at_new_addresses_are_left_alone(hvd):
    """Gradients allocated anew every step (zero_grad(set_to_none=True)) are not collapsed: a collapse copies
    its frames, which only memory that stays can repay."""
    before = stats()
    kept = []
    for step in range(5):
        grad = torch.full((3 << 20,), float(step))  # kept alive: every step's buffer has its own address
        kept.append(grad)
        hvd.allreduce_(grad, name="hp.fresh", op=hvd.Sum)
        assert torch.all(grad == step * hvd.size())
    assert stats()["collapsed_frames"] == before["collapsed_frames"]


def test_off_leaves_memory_alone(hvd):
    from job_env import restart

    old = restart(hvd, {"PERSEUS_HUGE_PAGES": "0"})
    try:
        before = stats()
        grad = torch.empty(3 << 20)
        for step in range(3):
            grad.fill_(float(step))
            hvd.allreduce_(grad, name="hp.off", op=hvd.Sum)
            assert torch.all(grad == step * hvd.size())
        assert stats() == before
    finally:
        restart(hvd, old)
