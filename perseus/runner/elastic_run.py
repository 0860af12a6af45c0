"""``perseusrun --host-discovery-script S``: run the elastic driver (:mod:`perseus.runner.elastic.driver`),
each generation an mpirun command built as for a fixed-size job. The flags are checked by
:mod:`perseus.runner.elastic_flags`."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Callable, Mapping

from perseus.base.knobs import read_knob
from perseus.runner import hosts as hostlib
from perseus.runner import mpi_run
from perseus.runner.elastic.discovery import Blacklist, FixedHosts, HostDiscovery
from perseus.runner.elastic.driver import ElasticDriver
from perseus.runner.elastic.keeper_process import start_keeper
from perseus.runner.elastic_flags import check_elastic_args
from perseus.runner.errors import PROG, LaunchError
from perseus.runner.session_dirs import remove_stale_session_dirs

__all__ = ["launch_elastic"]


def _kill_remote(host: str, pid: int, ssh: list[str]) -> None:
    """SIGKILL a stray rank (a stopped one, or one on a host mpirun lost); best effort, 5 s at most."""
    if pid <= 0:
        return
    if hostlib.is_local(host):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    try:
        subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", *ssh, host, f"kill -9 {pid}"],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


def launch_elastic(args: argparse.Namespace, settings: dict[str, str], mpi_args: list[str], mpirun: str,
                   flavour: mpi_run.MpiFlavour, env_extra: Mapping[str, str] | None = None,
                   mpi_options: Mapping[str, Any] | None = None) -> int:
    """Run an elastic job; returns the exit status (0: every rank finished).

    Raises:
        LaunchError: bad elastic flags, an option the MPI cannot honour, or ``--dry-run``.
    """
    opts = check_elastic_args(args)
    mpi_options = dict(mpi_options or {})
    try:  # what the MPI cannot honour fails now, not when the first generation starts
        mpi_run.build_command(mpirun, flavour, num_proc=1, hosts=[hostlib.HostSlots("localhost", 1)], env={},
                              command=["true"], nics=args.nics, **mpi_options)
    except mpi_run.MpiError as exc:
        raise LaunchError(str(exc)) from None
    if args.dry_run:
        raise LaunchError("--dry-run is not available for elastic jobs: their mpirun commands depend on the hosts "
                          "discovered while the job runs")
    ulfm = flavour.name == mpi_run.OPENMPI and (flavour.major or 5) >= 5
    in_process = bool(read_knob("elastic_in_process", {**os.environ, **settings})[0]) and ulfm
    heartbeat = float(read_knob("elastic_heartbeat_timeout", {**os.environ, **settings})[0])
    ssh = mpi_run.ssh_args(args.ssh_port, args.ssh_identity_file)
    # ULFM on whenever the MPI has it: survivors of a failure then get an error they can act on (re-form in
    # process, or flush their commit and leave) instead of being killed with the job.
    extra_mpi = list(mpi_args) + (["--with-ft", "ulfm"] if ulfm else [])
    start = _generation_starter(args, mpirun, flavour, mpi_run.launcher_variables(settings, env_extra), extra_mpi,
                                mpi_options)

    def keeper(host: str, token: str, driver_address: str):
        return start_keeper(host, token, ssh_args=ssh, local=hostlib.is_local(host), toward=driver_address)

    driver = ElasticDriver(
        start=start, discovery=_discovery(args, opts["slots_per_host"]),
        np_=opts["np_"], min_np=opts["min_np"], max_np=opts["max_np"], reset_limit=opts["reset_limit"],
        blacklist=Blacklist(opts["cooldown"]), elastic_timeout=opts["elastic_timeout"], heartbeat_timeout=heartbeat,
        in_process=in_process, start_keeper=keeper, kill_remote=lambda host, pid: _kill_remote(host, pid, ssh))
    return _run_driver(driver)


def _discovery(args: argparse.Namespace, slots_per_host: int | None) -> HostDiscovery | FixedHosts:
    """The job's hosts: the discovery script, or the fixed ``-H``/``--hostfile`` list.

    Raises:
        LaunchError: the host list or file is malformed or unreadable.
    """
    if args.host_discovery_script is not None:
        return HostDiscovery(args.host_discovery_script, slots_per_host)
    try:
        hosts = hostlib.parse_hosts(args.hosts) if args.hosts else hostlib.parse_hostfile(args.hostfile)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    return FixedHosts(hosts, slots_per_host)


def _generation_starter(args: argparse.Namespace, mpirun: str, flavour: mpi_run.MpiFlavour,
                        launcher_env: Mapping[str, str], mpi_args: list[str],
                        mpi_options: Mapping[str, Any]) -> Callable[[list, int, dict], subprocess.Popen]:
    """The driver's ``start(hosts, np, elastic_env)``: it runs one generation's mpirun in a session of its own,
    with ``launcher_env`` and the generation's ``elastic_env`` forwarded to every rank."""
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    has_prefix = any(a == "--prefix" or a.startswith("--prefix=") for a in mpi_args)

    def start(hosts: list[hostlib.HostSlots], np_: int, elastic_env: dict) -> subprocess.Popen:
        job_env = {**launcher_env, **elastic_env}
        env = {**os.environ, **job_env}
        remote = hostlib.remote_hosts((h.host for h in hosts), float(args.start_timeout or 10))
        prefix = None
        if remote and flavour.name == mpi_run.OPENMPI and not has_prefix:
            prefix = mpi_run.python_env_prefix(mpirun)
        plan = mpi_run.build_command(
            mpirun, flavour, num_proc=np_, hosts=hosts, env=env, command=args.command, launcher_env=job_env,
            nics=args.nics, ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file,
            output_filename=args.output_filename, mpi_args=mpi_args, as_root=as_root, prefix=prefix, **mpi_options)
        if args.verbose:
            print(f"{PROG}: {shlex.join(plan.argv)}", file=sys.stderr, flush=True)
        full_env = {**env, **plan.env}
        remove_stale_session_dirs(full_env.get("TMPDIR"))  # a reused process id would fail mpirun (status 213)
        return subprocess.Popen(plan.argv, env=full_env, start_new_session=True)

    return start


def _run_driver(driver: ElasticDriver) -> int:
    """``driver.run()``, with a scheduler's SIGTERM ending the job as Ctrl-C does (every generation torn
    down) while it runs."""
    def stop(signum, _frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        previous = None
    try:
        return driver.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
