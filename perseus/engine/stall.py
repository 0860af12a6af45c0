"""Stall inspection, Python's part: where the main thread is.

The native engine runs the stall inspector (``native/stall.cc``): a rank whose oldest pending request has
waited longer than the warning time probes its peers, which answer with their pending names, whether they have
joined, and where their main thread is -- the one thing only Python knows, computed here.
"""

from __future__ import annotations

import sys
import threading
import traceback

__all__ = ["main_thread_location"]


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
