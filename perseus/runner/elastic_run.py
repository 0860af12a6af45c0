"""``perseusrun --host-discovery-script S``: check the elastic flags and run the elastic driver
(:mod:`perseus.elastic.driver`), each generation an mpirun command built as for a fixed-size job."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Mapping, Optional

from perseus.common.knobs import read_knob
from perseus.runner import hosts as hostlib
from perseus.runner import mpi_run

__all__ = ["ELASTIC_FLAGS", "check_elastic_args", "launch_elastic", "DEFAULT_ELASTIC_TIMEOUT_S"]

#: horovodrun's default wait for enough hosts.
DEFAULT_ELASTIC_TIMEOUT_S = 600.0

ELASTIC_FLAGS = {"min_np": "--min-np", "max_np": "--max-np", "slots_per_host": "--slots-per-host",
                 "host_discovery_script": "--host-discovery-script", "reset_limit": "--reset-limit",
                 "cooldown_range": "--blacklist-cooldown-range", "elastic_timeout": "--elastic-timeout"}


def _int(args, dest: str, low: int) -> Optional[int]:
    from perseus.runner.launch import LaunchError

    text = getattr(args, dest)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise LaunchError(f"{ELASTIC_FLAGS[dest]} must be an integer >= {low}, got {text!r}")
    return value


def check_elastic_args(args: argparse.Namespace) -> dict:
    """The elastic settings from perseusrun's flags, checked.

    Raises:
        LaunchError: an elastic flag without ``--host-discovery-script``, ``-H``/``--hostfile`` with it, or a
            value out of range (``--min-np`` > ``--max-np``, a cool-down range with LO > HI, ...).
    """
    from perseus.runner.launch import LaunchError

    given = [flag for dest, flag in ELASTIC_FLAGS.items() if getattr(args, dest, None) is not None]
    if args.host_discovery_script is None:
        raise LaunchError(f"{', '.join(given)} need(s) --host-discovery-script: an elastic job learns its hosts "
                          f"from a script printing 'host:slots' lines")
    if args.hosts or args.hostfile:
        raise LaunchError("--host-discovery-script cannot be combined with -H/--hosts or --hostfile: an elastic "
                          "job's hosts come from the script")
    min_np, max_np = _int(args, "min_np", 1), _int(args, "max_np", 1)
    slots = _int(args, "slots_per_host", 1)
    reset_limit = _int(args, "reset_limit", 0)
    np_ = args.num_proc or min_np or 1
    min_np = min_np or np_
    if max_np is not None and min_np > max_np:
        raise LaunchError(f"--min-np {min_np} is larger than --max-np {max_np}")
    if min_np > np_ or (max_np is not None and np_ > max_np):
        raise LaunchError(f"-np {np_} must lie between --min-np {min_np} and --max-np {max_np}")
    cooldown = None
    if args.cooldown_range is not None:
        try:
            low, high = (float(v) for v in args.cooldown_range)
        except ValueError:
            low = high = -1.0
        if not 0 <= low <= high:
            raise LaunchError(f"--blacklist-cooldown-range takes LO HI seconds with 0 <= LO <= HI, got "
                              f"{' '.join(args.cooldown_range)}")
        cooldown = (low, high)
    timeout = DEFAULT_ELASTIC_TIMEOUT_S
    if args.elastic_timeout is not None:
        try:
            timeout = float(args.elastic_timeout)
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise LaunchError(f"--elastic-timeout must be a positive number of seconds, got {args.elastic_timeout!r}")
    return dict(np_=np_, min_np=min_np, max_np=max_np, slots_per_host=slots, reset_limit=reset_limit,
                cooldown=cooldown, elastic_timeout=timeout)


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
        LaunchError: bad elastic flags.
    """
    from perseus.elastic.discovery import Blacklist, HostDiscovery
    from perseus.elastic.driver import ElasticDriver
    from perseus.elastic.keeper import start_keeper
    from perseus.runner.launch import PROG, LaunchError

    opts = check_elastic_args(args)
    try:  # what the MPI cannot honour fails now, not when the first generation starts
        mpi_run.build_command(mpirun, flavour, num_proc=1, hosts=[hostlib.HostSlots("localhost", 1)], env={},
                              command=["true"], nics=args.nics, **(mpi_options or {}))
    except mpi_run.MpiError as exc:
        raise LaunchError(str(exc)) from None
    if args.dry_run:
        raise LaunchError("--dry-run is not available for elastic jobs: their mpirun commands depend on the hosts "
                          "discovered while the job runs")
    ulfm = flavour.name == mpi_run.OPENMPI and (flavour.major or 5) >= 5
    in_process = bool(read_knob("elastic_in_process", {**os.environ, **settings})[0]) and ulfm
    heartbeat = float(read_knob("elastic_heartbeat_timeout", {**os.environ, **settings})[0])
    ssh = []
    if args.ssh_port:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    launcher_env = dict(settings)
    launcher_env.update(env_extra or {})
    path = os.environ.get("PATH", "")
    if mpi_run.rank_path(path) != path:
        launcher_env["PATH"] = mpi_run.rank_path(path)
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    has_prefix = any(a == "--prefix" or a.startswith("--prefix=") for a in mpi_args)
    # ULFM on whenever the MPI has it: survivors of a failure then get an error they can act on (re-form in
    # process, or flush their commit and leave) instead of being killed with the job.
    extra_mpi = list(mpi_args) + (["--with-ft", "ulfm"] if ulfm else [])

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
            output_filename=args.output_filename, mpi_args=extra_mpi, as_root=as_root, prefix=prefix,
            **(mpi_options or {}))
        if args.verbose:
            print(f"{PROG}: {shlex.join(plan.argv)}", file=sys.stderr, flush=True)
        return subprocess.Popen(plan.argv, env={**env, **plan.env}, start_new_session=True)

    def keeper(host: str, token: str):
        return start_keeper(host, token, ssh_args=ssh, local=hostlib.is_local(host))

    driver = ElasticDriver(
        start=start, discovery=HostDiscovery(args.host_discovery_script, opts["slots_per_host"]),
        np_=opts["np_"], min_np=opts["min_np"], max_np=opts["max_np"], reset_limit=opts["reset_limit"],
        blacklist=Blacklist(opts["cooldown"]), elastic_timeout=opts["elastic_timeout"], heartbeat_timeout=heartbeat,
        in_process=in_process, start_keeper=keeper, kill_remote=lambda host, pid: _kill_remote(host, pid, ssh))

    def stop(signum, _frame):  # a scheduler's SIGTERM ends the job as Ctrl-C does: every generation torn down
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
