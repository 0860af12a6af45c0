"""Horovod-compat path: keep names and signatures identical to horovod.runner.util.threads.

Small threading helpers used by the launcher: start a function in the background, run a
function once an event fires, and map a function over argument lists on a bounded pool.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

__all__ = ["in_thread", "on_event", "execute_function_multithreaded"]


def _check_args(args: Any) -> None:
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for one argument write (arg,)")


def in_thread(target: Callable[..., Any], args: tuple = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` on a new thread and return the started thread.

    ``daemon`` threads do not keep the interpreter alive. With ``silent`` any exception raised by
    ``target`` is swallowed instead of being reported by :func:`threading.excepthook`.
    ``args`` must be a tuple (``ValueError`` otherwise).
    """
    _check_args(args)
    if silent:
        def body(*call_args: Any) -> None:
            try:
                target(*call_args)
            except BaseException:  # noqa: BLE001 - silent means silent
                pass
    else:
        body = target
    thread = threading.Thread(target=body, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: tuple = (),
             stop: threading.Event | None = None, check_stop_interval_s: float = 1.0,
             daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start a thread that waits for ``event`` and then calls ``func(*args)``; return the thread.

    When ``stop`` is given the thread re-checks it every ``check_stop_interval_s`` seconds and
    exits without calling ``func`` once ``stop`` is set (``stop`` wins if both are set). A
    non-daemon thread needs a ``stop`` event, otherwise it could block interpreter exit forever
    (``ValueError``). ``silent`` swallows exceptions raised by ``func``.
    """
    if event is None:
        raise ValueError("event must not be None")
    _check_args(args)
    if stop is None:
        if not daemon:
            raise ValueError("a non-daemon event thread needs a stop event")

        def wait_then_call() -> None:
            event.wait()
            func(*args)
    else:
        def wait_then_call() -> None:
            while not event.is_set() and not stop.is_set():
                event.wait(timeout=check_stop_interval_s)
            if not stop.is_set():
                func(*args)

    return in_thread(wait_then_call, daemon=daemon, silent=silent)


def execute_function_multithreaded(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                                   block_until_all_done: bool = True,
                                   max_concurrent_executions: int = 1000) -> dict[int, Any] | None:
    """Call ``fn(*args_list[i])`` for every ``i`` on at most ``max_concurrent_executions`` threads.

    Blocking (the default), wait for all calls and return ``{i: result}``; raise ``RuntimeError``
    (chained to the first failure) when any call raised. Not blocking, return ``None`` at once and
    let the non-daemon worker threads finish on their own. ``args_list`` is not modified.
    """
    if max_concurrent_executions < 1:
        raise ValueError(f"max_concurrent_executions must be at least 1, got {max_concurrent_executions}")
    work: queue.SimpleQueue = queue.SimpleQueue()
    for index, call_args in enumerate(args_list):
        work.put((index, tuple(call_args)))
    results: dict[int, Any] = {}
    failures: dict[int, BaseException] = {}
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                index, call_args = work.get_nowait()
            except queue.Empty:
                return
            try:
                value = fn(*call_args)
            except BaseException as exc:  # noqa: BLE001 - reported below
                with lock:
                    failures[index] = exc
            else:
                with lock:
                    results[index] = value

    count = min(max_concurrent_executions, len(args_list))
    threads = [in_thread(worker, daemon=not block_until_all_done) for _ in range(count)]
    if not block_until_all_done:
        return None
    # Join with a timeout in a loop so that KeyboardInterrupt still reaches the caller.
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.1)
    if failures:
        first = min(failures)
        name = getattr(fn, "__name__", repr(fn))
        raise RuntimeError(
            f"{len(failures)} of {len(args_list)} calls of {name} failed; the first, for args_list[{first}], "
            f"raised {failures[first]!r}"
        ) from failures[first]
    return results
