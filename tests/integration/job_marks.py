"""Time bounds that measure perseus, not the machine. A job run by a test prints when it reached a point
(:func:`mark`, every rank) and the test bounds the time from there to the job's end (:func:`since`). Starting
Python and importing the frameworks, which a busy machine slows many times over, then never decides a verdict;
the subprocess's own timeout, far longer, is there for a hang only."""

import re
import time

_TAG = "@@perseus-test-mark"


def mark(name: str) -> None:
    """In a job: print that this process reached ``name`` now."""
    print(f"{_TAG} {name} {time.time():.3f}", flush=True)


def since(out: str, name: str, end: float) -> float:
    """In a test: seconds from the last process of the job reaching ``name`` (its output ``out``) until ``end``
    (``time.time()`` when the job ended). Fails the test when no process reached it."""
    times = [float(t) for n, t in re.findall(rf"^{_TAG} (\S+) ([0-9.]+)$", out, re.M) if n == name]
    assert times, f"no process of the job reached {name!r}:\n{out[-3000:]}"
    return end - max(times)
