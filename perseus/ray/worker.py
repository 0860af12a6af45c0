"""The Ray actor behind each rank of a :class:`~perseus.ray.RayExecutor` (Horovod's ``BaseHorovodWorker``).

The actor holds the rank's resources (its placement-group bundle) and runs, inside its own process:

* a :class:`~perseus.runner.remote.service.NodeService`, through which ``mpirun`` starts its daemon on the
  actor's node (one actor per node is asked to);
* a :class:`~perseus.runner.remote.link.RankEndpoint`, to which its rank (a process of the MPI job, child of
  that daemon) connects; the executor's calls reach the rank through it;
* for the actor of rank 0, ``mpirun`` itself.

The actor imports neither MPI nor a framework: the functions the executor sends run in the rank.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
from typing import Any, Optional

from perseus.base.knobs import environment, set_external
from perseus.runner.remote import job as remote_job
from perseus.runner.remote.agent import TOKEN_ENV, write_job_file
from perseus.runner.remote.link import RankEndpoint, RankGone
from perseus.runner.remote.service import NodeService

__all__ = ["BaseHorovodWorker", "WorkerError"]


class WorkerError(RuntimeError):
    """A rank's function raised, or its rank ended (the message names the rank, its node and the cause).

    ``rank``: the rank; ``node``: where it ran; ``gone``: the rank's process ended without answering (it did not
    raise itself); ``traceback_text``: the rank's traceback when it raised.
    """

    def __init__(self, message: str, rank: int = -1, node: str = "", gone: bool = False, traceback_text: str = ""):
        super().__init__(message)
        self.rank, self.node, self.gone, self.traceback_text = rank, node, gone, traceback_text

    def __reduce__(self):
        return (WorkerError, (str(self), self.rank, self.node, self.gone, self.traceback_text))


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class BaseHorovodWorker:
    """One rank's actor (see the module doc). Created by the executor; Horovod's helper methods (``hostname``,
    ``node_id``, ``get_gpu_ids``, ``update_env_vars``, ``env_vars``) work on an actor made by hand too.

    Args:
        token: the job's secret (None: a new one, for an actor made by hand).
        env: variables given to the daemon (and its ranks) this actor starts.
    """

    def __init__(self, token: Optional[str] = None, env: Optional[dict] = None):
        self.ip = _node_ip()
        token = token if token is not None else secrets.token_hex(16)
        self.token = token
        self.service = NodeService(token, self.ip, env={str(k): str(v) for k, v in (env or {}).items()})
        self.endpoint = RankEndpoint(token, self.ip)
        self.rank, self.node = -1, ""
        self.queue = None
        self.mpirun: Optional[subprocess.Popen] = None
        self.job_file = ""

    def info(self) -> dict:
        """Where this actor runs: host name, address, Ray node id, GPU ids, its service and link addresses."""
        import ray

        ctx = ray.get_runtime_context()
        return {"hostname": socket.gethostname(), "ip": self.ip, "node_id": ctx.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                "service": f"{self.ip}:{self.service.port}", "link": f"{self.ip}:{self.endpoint.port}"}

    def hostname(self) -> str:
        """This actor's host name (Horovod's ``BaseHorovodWorker.hostname``)."""
        return socket.gethostname()

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def get_gpu_ids(self) -> list:
        """The GPUs Ray gave this actor."""
        import ray

        return ray.get_gpu_ids()

    def update_env_vars(self, env_vars: dict) -> None:
        """Set variables in this actor's process (values made strings)."""
        for k, v in env_vars.items():
            set_external(str(k), str(v))

    def env_vars(self) -> dict:
        """This actor's process environment."""
        return environment()

    def assign(self, rank: int, node: str, node_env: dict, queue=None) -> None:
        """Take ``rank`` on ``node`` for the next job; ``node_env``: variables for the daemon started here."""
        self.rank, self.node, self.queue = rank, node, queue
        self.service.env.update({str(k): str(v) for k, v in node_env.items()})
        self.endpoint.expect(rank)

    def launch(self, nodes: list, command: list, env: dict, nics: list, verbose: bool) -> int:
        """Start the job's ``mpirun`` here (rank 0's actor); returns its pid.

        Raises:
            perseus.runner.mpi_run.MpiError: no usable Open MPI on this node.
            NotImplementedError: the MPI is not Open MPI.
        """
        nodes = [remote_job.Node(*n) for n in nodes]
        self.job_file = remote_job.job_file_path(self.token[:12])
        write_job_file(self.job_file, self.token, {n.name: n.service for n in nodes})
        plan = remote_job.plan(nodes, command, self.job_file, env={**env, TOKEN_ENV: self.token}, nics=nics)
        self.mpirun = remote_job.start(plan, verbose=verbose)
        return self.mpirun.pid

    def mpirun_status(self) -> Optional[int]:
        """``mpirun``'s exit status once it ended, else None (also None where it does not run)."""
        return None if self.mpirun is None else self.mpirun.poll()

    def wait_connected(self, timeout: float) -> bool:
        """Whether this actor's rank connected within ``timeout`` seconds."""
        return self.endpoint.wait_connected(timeout)

    def call(self, message: bytes) -> Any:
        """Send ``message`` (pickled by the driver: the actor never unpickles the user's function, which may live
        in a module only the ranks import) to the rank and return its value.

        Raises:
            WorkerError: the function raised on this rank, or the rank ended before answering.
        """
        on_log = None
        if self.rank == 0 and self.queue is not None:
            on_log = self.queue.put
        try:
            reply = self.endpoint.call(message, on_log=on_log)
        except RankGone as exc:
            raise WorkerError(f"rank {self.rank} on {self.node}: {exc}", self.rank, self.node,
                              gone=True) from None
        _, ok, value, text, error = reply
        if ok:
            return value
        what = f"{type(error).__name__}: {error}" if error is not None else (text.strip().splitlines() or ["an error"])[-1]
        raise WorkerError(f"rank {self.rank} on {self.node} raised {what}\n--- rank {self.rank} ---\n"
                          f"{text}", self.rank, self.node, traceback_text=text)

    def stop(self, grace: float = 10.0) -> Optional[int]:
        """Tell the rank to leave, end ``mpirun`` (here) after ``grace`` seconds, stop the services."""
        self.endpoint.close_link()
        code = None
        if self.mpirun is not None:
            try:
                code = self.mpirun.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.mpirun.pid, signal.SIGTERM)
                    code = self.mpirun.wait(5.0)
                except (OSError, subprocess.TimeoutExpired):
                    os.killpg(self.mpirun.pid, signal.SIGKILL)
                    code = self.mpirun.wait()
        return code

    def close(self) -> None:
        """Stop listening, end every command this actor's service still runs, remove the job file."""
        self.endpoint.close()
        self.service.close()
        if self.job_file:
            try:
                os.unlink(self.job_file)
            except OSError:
                pass
