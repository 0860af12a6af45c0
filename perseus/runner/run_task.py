"""One rank of :func:`perseus.run`: ``python -m perseus.runner.run_task <address> <port>``.

Connects to the calling process, presents the job's token (``PERSEUS_RUN_TOKEN``), receives the cloudpickled
``(func, args, kwargs)``, runs it, and sends back ``(rank, ok, value_or_traceback, exception_or_None, generation,
size)``: ``generation`` is the elastic job's generation (0 outside elastic jobs), ``rank`` and ``size`` are this
rank's place in the job as the function left it (an elastic job re-formed in process renumbers its ranks).
Exits 0 after a result was sent, 1 when the function raised (so that mpirun ends the other ranks instead of
letting them wait in a collective for this one), 2 when the caller could not be reached.
"""

from __future__ import annotations

import pickle
import socket
import sys
import traceback

from perseus.base.horovod_alias import install_if_asked
from perseus.base.knobs import read_knob
from perseus.runner.common.util.env import get_env_rank_and_size
from perseus.runner.remote import rank as remote_rank
from perseus.runner.remote.service import die_with_parent
from perseus.runner.run_frames import TOKEN_ENV, recv_frame, send_frame


def _launched_place() -> tuple[int, int]:
    """``(rank, size)`` as the launcher numbered this process (``(0, 1)`` when it did not say)."""
    try:
        found = get_env_rank_and_size()
    except RuntimeError:
        found = None
    return (found[0], found[1]) if found else (0, 1)


def _place() -> tuple[int, int]:
    """``(rank, size)`` now: the engine's, when the function left perseus running (an elastic job that re-formed
    in process renumbered its ranks), else the launcher's. The engine is looked up, never imported: a function
    that did not use perseus does not pay for loading it."""
    state = sys.modules.get("perseus.runtime.state")
    if state is not None:
        try:
            now = state.runtime()
            if now.is_initialized():
                return now.rank(), now.size()
        except Exception:  # noqa: BLE001 - a runtime that cannot answer: the launcher's numbering stands
            pass
    return _launched_place()


def _reply(ok: bool, value, error, generation: int) -> bytes:
    import cloudpickle

    rank, size = _place()
    try:
        return cloudpickle.dumps((rank, ok, value, error, generation, size))
    except Exception as exc:  # noqa: BLE001 - an unpicklable return value or exception
        if ok:
            text = f"rank {rank} returned a value that cannot be pickled: {type(exc).__name__}: {exc}"
        else:
            text = value
        return pickle.dumps((rank, False, text, None, generation, size))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m perseus.runner.run_task ADDRESS PORT (started by perseus.run)", file=sys.stderr)
        return 2
    address, port = argv[0], int(argv[1])
    die_with_parent()  # the MPI daemon that started this rank: a rank never outlives it
    rank = _launched_place()[0]
    generation = int(read_knob("elastic_generation")[0])
    try:
        sock = socket.create_connection((address, port), timeout=60.0)
    except OSError as exc:
        print(f"perseus.run: rank {rank} cannot reach the calling process at {address}:{port}: {exc}",
              file=sys.stderr, flush=True)
        return 2
    with sock:
        send_frame(sock, str(read_knob("run_token")[0]).encode())
        try:
            payload = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            print(f"perseus.run: rank {rank} got no function from {address}:{port} ({exc}; a wrong "
                  f"{TOKEN_ENV}?)", file=sys.stderr, flush=True)
            return 2
        sock.settimeout(None)
        import cloudpickle  # noqa: F401 - the payload may need its reducers

        # What the rank logs (perseus.ray.ray_logger.log) goes to the caller's callbacks: every rank's, as
        # Horovod's elastic Ray jobs forward them.
        remote_rank._link = sock

        install_if_asked()  # (the caller had the horovod alias: the function may import horovod.*)
        try:
            try:
                func, args, kwargs = pickle.loads(payload)
            except BaseException as exc:  # noqa: BLE001 - named for the caller
                raise RuntimeError(f"perseus.run: rank {rank} cannot unpickle the function it was sent: "
                                   f"{type(exc).__name__}: {exc} (a module the function needs that this rank's "
                                   "Python does not have?)") from exc
            value = func(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            with remote_rank._link_lock:
                send_frame(sock, _reply(False, text, exc, generation))
            # Printed by the interpreter's hook, which an elastic rank has extended to tell its driver: an error in
            # the training code then ends the job at once instead of being taken for a dead host.
            sys.excepthook(type(exc), exc, exc.__traceback__)
            sys.stderr.flush()
            return 1
        with remote_rank._link_lock:
            send_frame(sock, _reply(True, value, None, generation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
