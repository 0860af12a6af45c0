"""Stall inspector: find requests that some ranks never submitted, name those ranks, and fail loudly.

A rank whose oldest pending request has waited longer than the warning time sends a probe to every peer of
the process set. Each peer answers with its pending names, whether it has joined, and where its main thread is
(file, line, function). The prober then knows, for each stalled name, exactly which ranks lack it.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Optional

__all__ = ["main_thread_location", "StallReport", "format_stall"]


def main_thread_location(limit: int = 4) -> str:
    """The innermost user frames of the main thread, as ``file:line in function`` lines."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "main thread has exited"
    frames = [f for f in traceback.extract_stack(frame) if "/perseus/" not in f.filename.replace("\\", "/")
              and "threading.py" not in f.filename]
    if not frames:
        frames = traceback.extract_stack(frame)
    return " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames[-limit:]))


class StallReport:
    """Collects probe answers for one stall check."""

    def __init__(self, probe_id: int, peers: list[int], deadline: float):
        self.probe_id = probe_id
        self.waiting_for = set(peers)
        self.answers: dict[int, dict] = {}
        self.deadline = deadline

    def add(self, rank: int, info: dict) -> None:
        self.answers[rank] = info
        self.waiting_for.discard(rank)

    @property
    def complete(self) -> bool:
        return not self.waiting_for


def format_stall(my_rank: int, my_pending: dict[str, float], report: StallReport, now: float,
                 shutdown_in_s: Optional[float]) -> str:
    """The stall message: each stalled name with the ranks that have and have not submitted it."""
    lines = ["perseus stall: requests have waited for other ranks:"]
    all_ranks = sorted(set(report.answers) | {my_rank} | report.waiting_for)
    for name, since in sorted(my_pending.items(), key=lambda kv: kv[1]):
        have = [my_rank] + [r for r, info in report.answers.items()
                            if name in info["pending"] or info.get("joined")]
        missing = [r for r in all_ranks if r not in have]
        if not missing:
            continue
        lines.append(f"  {name}: waited {now - since:.0f} s; submitted by ranks {sorted(have)}, "
                     f"missing on ranks {missing}")
    if len(lines) == 1:
        return ""
    for r, info in sorted(report.answers.items()):
        if info.get("where"):
            lines.append(f"  rank {r} is at {info['where']}")
    for r in sorted(report.waiting_for):
        lines.append(f"  rank {r} did not answer the stall probe (busy outside perseus, hung, or dead)")
    lines.append("The usual cause is ranks taking different code paths: a condition on rank(), uneven data "
                 "without hvd.join(), or a tensor name that differs between ranks.")
    if shutdown_in_s is not None:
        lines.append(f"Every rank will fail in {shutdown_in_s:.0f} s (PERSEUS_STALL_SHUTDOWN_TIME_SECONDS).")
    return "\n".join(lines)
